"""Helpers for dsec's many-node tests on one machine: a real etcd, and several dsecd processes, each in a network
namespace of its own with its own address.

Etcd: Debian's /usr/bin/etcd on free ports of 127.0.0.1 (and of any other host address given, such as the bridge
address the namespaced agents reach it on), with a scratch data directory; its v3 JSON gateway is read and written
with urllib (keys and values are base64 there).

NetnsAgents: a bridge in the host's namespace holding 10.<x>.<y>.254/24 (a /24 that no route or address of the
host overlaps), and N namespaces dsec-t<pid>-<i>, each joined to the bridge by a veth pair and holding
10.<x>.<y>.<i+1>/24. Agent i is dsecd run with `nsenter --net=/run/netns/dsec-t<pid>-<i>`: only its network
namespace changes (not its mounts, so cgroups, layer mounts and the leftover checks see the host's), it listens on
<its address>:7070 and on a unix socket, and its sandboxes' network namespaces are made from inside its own. close()
stops every agent and removes the namespaces, veths and bridge, and fails when any of them, or a process inside
them, is left.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import shutil
import ssl
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import select

import dsec_testlib as lib

ETCD = "/usr/bin/etcd"
AGENT_PORT = 7070


def etcd_skip_reason() -> str | None:
    if not os.access(ETCD, os.X_OK):
        return "no etcd at /usr/bin/etcd (apt-get install etcd-server; scripts/install-deps.sh installs it)"
    return None


def netns_skip_reason() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed (apt-get install iproute2)"
    if shutil.which("nsenter") is None:
        return "util-linux's nsenter is not installed"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def _prefix_end(prefix: str) -> str:
    b = bytearray(prefix.encode())
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return base64.b64encode(bytes(b)).decode()
        b.pop()
    return _b64(b"\0")


# --------------------------------------------------------------------------------------------------------------
# etcd

class Etcd:
    """One etcd member for the tests. `hosts`: the addresses it listens on for clients (127.0.0.1 always). With
    `tls` ({"cert", "key", "ca"}: PEM files), clients speak https and must present a certificate that CA signed."""

    def __init__(self, hosts=(), tls: dict | None = None) -> None:
        self.hosts = ["127.0.0.1", *[h for h in hosts if h != "127.0.0.1"]]
        self.tls = tls
        self.client_port = free_port()
        self.peer_port = free_port()
        self.tmp = tempfile.mkdtemp(prefix="dsec-it-etcd-")
        self.data_dir = os.path.join(self.tmp, "data")
        self.log_path = os.path.join(self.tmp, "etcd.log")
        self.proc: subprocess.Popen | None = None

    def url(self, host: str = "127.0.0.1") -> str:
        return f"{'https' if self.tls else 'http'}://{host}:{self.client_port}"

    def start(self, wipe: bool = False, timeout: float = 30.0) -> None:
        """Starts etcd (on the same ports; on the same data unless `wipe`) and waits until it answers."""
        if self.alive():
            return
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        peer = f"http://127.0.0.1:{self.peer_port}"
        client_urls = ",".join(self.url(h) for h in self.hosts)
        args = [ETCD, "--name", "dsec-it", "--data-dir", self.data_dir, "--listen-client-urls", client_urls,
                "--advertise-client-urls", client_urls, "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer, "--initial-cluster", f"dsec-it={peer}"]
        if self.tls:
            args += ["--cert-file", self.tls["cert"], "--key-file", self.tls["key"], "--trusted-ca-file",
                     self.tls["ca"], "--client-cert-auth"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode} at start:\n{self.log_tail()}")
            if self.healthy():
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"etcd did not get healthy within {timeout}s:\n{self.log_tail()}")
            time.sleep(0.1)

    def healthy(self) -> bool:
        context = None
        if self.tls:
            context = ssl.create_default_context(cafile=self.tls["ca"])
            context.load_cert_chain(self.tls["client_cert"], self.tls["client_key"])
        try:
            with urllib.request.urlopen(self.url() + "/health", timeout=2, context=context) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash (the data directory stays)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        """Stops etcd and removes its data; asserts it is gone."""
        self.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)
        assert self.proc is None or self.proc.poll() is not None, "etcd still running"

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return "(no log)"

    # The v3 JSON gateway.

    def call(self, path: str, body: dict, timeout: float = 5.0) -> dict:
        req = urllib.request.Request(self.url() + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read().decode().split("\n")[0])

    def range_prefix(self, prefix: str) -> dict[str, dict]:
        """{key: {"value": str, "lease": int, "mod_revision": int}} for every key under `prefix`."""
        r = self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        out = {}
        for kv in r.get("kvs", []):
            out[base64.b64decode(kv["key"]).decode()] = {
                "value": base64.b64decode(kv.get("value", "")).decode(),
                "lease": int(kv.get("lease", 0)),
                "mod_revision": int(kv.get("mod_revision", 0)),
            }
        return out

    def get(self, key: str) -> dict | None:
        return self.range_prefix(key).get(key)

    def nodes(self, prefix: str = "/dsec/") -> dict[str, dict]:
        """The registrations under <prefix>nodes/: {node id: {"endpoint": ..., "node": {...}, "lease": id}}."""
        base = prefix + "nodes/"
        out = {}
        for key, kv in self.range_prefix(base).items():
            record = json.loads(kv["value"])
            record["lease"] = kv["lease"]
            out[key[len(base):]] = record
        return out

    def lease_ttl(self, lease: int) -> int:
        """Seconds left on a lease; -1 when it does not exist."""
        r = self.call("/v3/lease/timetolive", {"ID": str(lease)})
        return int(r.get("TTL", -1))

    def delete_prefix(self, prefix: str) -> int:
        r = self.call("/v3/kv/deleterange", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        return int(r.get("deleted", 0))


# --------------------------------------------------------------------------------------------------------------
# Agents in network namespaces

def _host_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the host has a route or an address in (all namespaces' views would be overkill)."""
    nets = []
    for line in _run("ip", "-4", "-o", "addr", "show").stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.append(ipaddress.ip_network(parts[parts.index("inet") + 1], strict=False))
    for line in _run("ip", "-4", "route", "show", "table", "all").stdout.splitlines():
        dest = line.split()[0] if line.split() else ""
        if dest in ("default", "broadcast", "local", "unreachable", "prohibit", "blackhole", "multicast"):
            dest = line.split()[1] if dest != "default" and len(line.split()) > 1 else ""
        try:
            if dest:
                nets.append(ipaddress.ip_network(dest, strict=False))
        except ValueError:
            pass
    return [n for n in nets if n.prefixlen > 0]


def _pick_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that overlaps nothing the host routes, starting from one derived from our pid."""
    taken = _host_networks()
    start = (os.getpid() * 7919) % (250 * 250)
    for k in range(250 * 250):
        n = (start + k) % (250 * 250)
        candidate = ipaddress.ip_network(f"10.{n // 250 + 1}.{n % 250 + 1}.0/24")
        if not any(candidate.overlaps(t) for t in taken):
            return candidate
    raise RuntimeError("no free 10.x.y.0/24 for the test network")


def _netns_inode(name: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return None


def processes_in_netns(inode: int) -> list[tuple[int, str]]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino != inode:
                continue
            with open(f"/proc/{pid}/comm") as f:
                found.append((int(pid), f.read().strip()))
        except OSError:
            continue
    return found


class NetnsAgent(lib.Agent):
    """A dsecd inside network namespace `netns`, listening on address:7070 and on a unix socket, with its own
    state directory and layer cache and the image store of `home` (shared read-only with the other agents)."""

    def __init__(self, home: str, *, tag: str, netns: str, address: str, backends: str = "null",
                 etcd: str | None = None, etcd_prefix: str = "/dsec/", lease_ttl: int = 3, extra_args=()) -> None:
        super().__init__(home, tag=tag)
        self.netns = netns
        self.address = address
        self.url = f"http://{address}:{AGENT_PORT}"
        self.backends = backends
        self.etcd = etcd
        args = ["--listen", f"{address}:{AGENT_PORT}", "--insecure-no-tls",
                "--state-dir", os.path.join(self.tmp, "state"),
                "--layer-cache", os.path.join(self.tmp, "layers"), "--store", os.path.join(home, "store"),
                "--backends", backends, "--netns-pool", "2"]
        if etcd:
            args += ["--etcd", etcd, "--etcd-prefix", etcd_prefix, "--etcd-lease-ttl", str(lease_ttl)]
        self.extra_args = args + list(extra_args)

    def start(self, timeout: float = 30.0) -> None:
        """Like lib.Agent.start, with dsecd entered into the namespace's network (and nothing else)."""
        ready_r, ready_w = os.pipe()
        args = ["nsenter", f"--net=/run/netns/{self.netns}", "--", str(lib.DSECD), "--socket", self.socket_path,
                "--home", self.home, "--run-dir", self.run_dir, "--node-id", self.node_id, "--cgroup-name",
                self.cgroup_name, "--max-body", str(self.max_body), "--ready-fd", str(ready_w), *self.extra_args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         pass_fds=(ready_w,), start_new_session=True)
        os.close(ready_w)
        try:
            deadline = time.monotonic() + timeout
            got = b""
            while b"ready\n" not in got:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"dsecd in {self.netns} did not get ready within {timeout}s:\n"
                                       f"{self.log_tail()}")
                r, _, _ = select.select([ready_r], [], [], min(left, 0.5))
                if r:
                    chunk = os.read(ready_r, 64)
                    if not chunk:
                        raise RuntimeError(f"dsecd in {self.netns} closed its ready fd (exit {self.proc.poll()}):"
                                           f"\n{self.log_tail()}")
                    got += chunk
                elif self.proc.poll() is not None:
                    raise RuntimeError(f"dsecd in {self.netns} exited with {self.proc.returncode} before ready:\n"
                                       f"{self.log_tail()}")
        finally:
            os.close(ready_r)

    def kill(self) -> None:
        """kill -9: no shutdown, no lease revoked (its sandboxes' leftovers are then the test's to clean)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def http_get(self, path: str, timeout: float = 5.0):
        """GET over TCP from the host's namespace, through the bridge, to the agent's address."""
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())


class NetnsAgents:
    """N slots, each a network namespace on a test bridge with its own address; start()/kill()/stop() agents in
    them. Use as a context manager, or call close(), which asserts nothing is left behind."""

    def __init__(self, home: str, count: int) -> None:
        reason = netns_skip_reason()
        if reason:
            raise RuntimeError(reason)
        self.home = home
        self.count = count
        pid = os.getpid()
        self.tag = f"{pid}"
        self.bridge = f"dsb{pid}"[:15]
        self.subnet = _pick_subnet()
        hosts = list(self.subnet.hosts())
        self.host_address = str(hosts[-1])                                     # .254
        self.addresses = [str(hosts[i]) for i in range(count)]                 # .1, .2, ...
        self.netns_names = [f"dsec-t{pid}-{i}" for i in range(count)]
        self.veths = [f"dv{pid}h{i}"[:15] for i in range(count)]
        self.agents: list[NetnsAgent | None] = [None] * count
        self._closed = False
        self._setup_done: list[str] = []
        try:
            self._setup()
        except Exception:
            self._teardown_network()
            raise

    def _setup(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._setup_done.append("bridge")
        _run("ip", "addr", "add", f"{self.host_address}/{self.subnet.prefixlen}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, ns in enumerate(self.netns_names):
            _run("ip", "netns", "add", ns)
            peer = f"dv{os.getpid()}n{i}"[:15]
            _run("ip", "link", "add", self.veths[i], "type", "veth", "peer", "name", peer, "netns", ns)
            _run("ip", "link", "set", self.veths[i], "master", self.bridge)
            _run("ip", "link", "set", self.veths[i], "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", peer, "name", "eth0")
            _run("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/{self.subnet.prefixlen}", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
        # A fresh bridge port is usable at once only without STP's forwarding delay.
        _run("ip", "link", "set", self.bridge, "type", "bridge", "forward_delay", "0", check=False)

    def __enter__(self) -> "NetnsAgents":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, i: int, *, backends: str = "null", etcd: str | None = None, etcd_prefix: str = "/dsec/",
              lease_ttl: int = 3, extra_args=()) -> NetnsAgent:
        """Starts agent i (stopping the one there before, if any) and waits until it serves."""
        if self.agents[i] is not None and self.agents[i].alive():
            raise RuntimeError(f"agent {i} is running")
        agent = NetnsAgent(self.home, tag=f"n{i}", netns=self.netns_names[i], address=self.addresses[i],
                           backends=backends, etcd=etcd, etcd_prefix=etcd_prefix, lease_ttl=lease_ttl,
                           extra_args=extra_args)
        self.agents[i] = agent
        agent.start()
        return agent

    def kill(self, i: int) -> None:
        """kill -9 agent i."""
        if self.agents[i] is not None:
            self.agents[i].kill()

    def stop(self, i: int) -> int:
        """SIGTERM agent i; its exit status."""
        a = self.agents[i]
        return a.stop() if a is not None else 0

    def stop_all(self) -> list[str]:
        """Stops every agent; returns what they left behind (mounts, cgroups, run dir entries, bad exits)."""
        problems = []
        for i, a in enumerate(self.agents):
            if a is None:
                continue
            if a.proc is not None and a.proc.returncode == -signal.SIGKILL:
                # What an operator does after a crash: start the agent again on the same state, which clears what
                # the dead one left (its layer mounts, sandbox records), and stop it cleanly.
                try:
                    a.start()
                except RuntimeError as e:
                    problems.append(f"agent {i} could not restart after kill -9: {e}")
            status = a.stop()
            if status != 0:
                problems.append(f"agent {i} exited with {status}:\n{a.log_tail()}")
            left = a.leftovers()
            problems += [f"agent {i}: {p}" for p in left]
            if not left:
                a.remove_husks()
            self.agents[i] = None
        return problems

    def leftovers(self) -> list[str]:
        """Namespaces, links and processes of this helper still on the host."""
        problems = []
        netns = _run("ip", "netns", "list", check=False).stdout
        for ns in self.netns_names:
            if any(line.split()[0] == ns for line in netns.splitlines() if line.split()):
                problems.append(f"network namespace left: {ns}")
        links = _run("ip", "-o", "link", "show", check=False).stdout
        for line in links.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
            if name == self.bridge or name in self.veths:
                problems.append(f"link left: {name}")
        for a in self.agents:
            if a is not None and a.alive():
                problems.append(f"agent {a.node_id} still running (pid {a.proc.pid})")
        return problems

    def _teardown_network(self) -> list[str]:
        problems = []
        for ns in self.netns_names:
            inode = _netns_inode(ns)
            if inode is not None:
                for pid, comm in processes_in_netns(inode):
                    problems.append(f"process {pid} ({comm}) still in network namespace {ns}")
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        # A veth goes with its namespace; one whose namespace is still pinned somewhere would stay.
        for v in self.veths:
            _run("ip", "link", "del", v, check=False)
        return problems

    def close(self) -> None:
        """Stops every agent, removes namespaces, veths and the bridge; asserts none of it (nor a process) is left."""
        if self._closed:
            return
        self._closed = True
        problems = self.stop_all()
        problems += self._teardown_network()
        deadline = time.monotonic() + 10
        left = self.leftovers()
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = self.leftovers()
        problems += left
        assert not problems, "the netns test cluster left things behind:\n  " + "\n  ".join(problems)
