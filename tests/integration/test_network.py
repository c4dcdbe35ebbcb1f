"""Sandbox networking: modes, first-match rules, names through the agent's resolver, live changes that cut
connections, what is always blocked.

All traffic stays on this machine: the "outside" is network namespaces this module makes itself (a server stand-in
with HTTP, echo and DNS servers, and a stand-in that owns the metadata address 169.254.169.254), joined to the host by
veth pairs. Nothing is ever sent to any other address.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time

import pytest

import dsec_testlib as lib

dsec = lib.dsec

PID = os.getpid()
OCTET = 20 + PID % 200
OUT_NS = f"dsit{PID}o"        # the server stand-in
META_NS = f"dsit{PID}m"       # owns 169.254.169.254
HOST_IP = f"10.199.{OCTET}.1"  # the host's end of the link to the stand-in
SERVER = f"10.199.{OCTET}.2"   # the stand-in's address
DENIED = f"10.199.{OCTET}.3"   # another address of the stand-in, in the agent's --egress-deny
RANGE = f"10.87.{OCTET}.0/24"  # this module's agents' sandbox range
META = "169.254.169.254"

ECHO_SERVER = textwrap.dedent("""
    import socket, sys, threading
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(16)
    def serve(c):
        with c:
            while (data := c.recv(4096)):
                c.sendall(data)
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
""")


# Reads what a connection sends until it has argv[3] bytes, then answers "<bytes> <seconds from the first byte to the
# last>" and closes: the rate a sandbox sends at, measured where it arrives.
SINK_SERVER = textwrap.dedent("""
    import socket, sys, threading, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(16)
    want = int(sys.argv[3])
    def serve(c):
        with c:
            got, first = 0, None
            while got < want and (data := c.recv(65536)):
                first = first or time.monotonic()
                got += len(data)
            c.sendall(f"{got} {time.monotonic() - (first or time.monotonic()):.3f}\\n".encode())
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
""")
SINK_BYTES = 3_000_000

# The stand-in's zone: what the agent's resolver asks upstream for the names sandboxes may resolve. It logs every
# question it gets, so the tests see which names the agent forwarded at all.
DNS_SERVER = textwrap.dedent("""
    import sys, time
    from dnslib import A, CNAME, QTYPE, RCODE, RR
    from dnslib.server import BaseResolver, DNSServer
    address, server, denied, log = sys.argv[1:5]
    ZONE = {"mirror.test.": ("A", server), "www.example.test.": ("A", server), "x.y.example.test.": ("A", server),
            "example.test.": ("A", server), "other.test.": ("A", server), "denied.test.": ("A", denied),
            "alias.test.": ("CNAME", "www.example.test.")}
    class Zone(BaseResolver):
        def resolve(self, request, handler):
            name = str(request.q.qname).lower()
            with open(log, "a") as f:
                f.write(name + "\\n")
            reply = request.reply()
            if name not in ZONE:
                reply.header.rcode = RCODE.NXDOMAIN
                return reply
            kind, value = ZONE[name]
            if kind == "CNAME":
                reply.add_answer(RR(name, QTYPE.CNAME, rdata=CNAME(value), ttl=60))
                name, (kind, value) = value, ZONE[value]
            if request.q.qtype == QTYPE.A:
                reply.add_answer(RR(name, QTYPE.A, rdata=A(value), ttl=60))
            return reply
    DNSServer(Zone(), address=address, port=53).start_thread()
    while True:
        time.sleep(3600)
""")
DNS_LOG = os.path.join(tempfile.gettempdir(), f"dsec-it-dns-{PID}.log")


def sh_host(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr}")
    return r


def skip_reason() -> str | None:
    if not shutil.which("ip"):
        return "iproute2 (ip) is not installed"
    if not shutil.which("nft"):
        return "nftables (nft) is not installed (scripts/install-deps.sh installs it)"
    return None


@pytest.fixture(scope="module")
def outside():
    """The stand-ins: OUT_NS at SERVER (HTTP on 8080 and 8081, an echo server on 9009), META_NS at 169.254.169.254,
    both reachable from the host."""
    if skip_reason():
        pytest.skip(skip_reason())
    procs = []
    try:
        for ns, host_if, inner, host_addr, inner_addr in [
                (OUT_NS, f"dsit{PID}a", "eth0", f"{HOST_IP}/24", f"{SERVER}/24"),
                (META_NS, f"dsit{PID}b", "eth0", None, f"{META}/32")]:
            sh_host("ip", "netns", "add", ns)
            sh_host("ip", "link", "add", host_if, "type", "veth", "peer", "name", inner, "netns", ns)
            if host_addr:
                sh_host("ip", "addr", "add", host_addr, "dev", host_if)
            sh_host("ip", "link", "set", host_if, "up")
            sh_host("ip", "-n", ns, "addr", "add", inner_addr, "dev", inner)
            sh_host("ip", "-n", ns, "link", "set", inner, "up")
            sh_host("ip", "-n", ns, "link", "set", "lo", "up")
        # The metadata stand-in: reachable from the host through its link, as a cloud's metadata server would be.
        sh_host("ip", "-n", OUT_NS, "addr", "add", f"{DENIED}/24", "dev", "eth0")
        sh_host("ip", "route", "add", f"{META}/32", "dev", f"dsit{PID}b")
        sh_host("ip", "-n", META_NS, "route", "add", "default", "dev", "eth0")
        web = tempfile.mkdtemp(prefix="dsec-it-web-")
        with open(os.path.join(web, "index.html"), "w") as f:
            f.write("stand-in\n")
        for ns, addr, port in [(OUT_NS, SERVER, 8080), (OUT_NS, SERVER, 8081), (OUT_NS, DENIED, 8080),
                               (META_NS, META, 80)]:
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "/usr/bin/python3", "-m", "http.server",
                                           str(port), "--bind", addr, "--directory", web],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        procs.append(subprocess.Popen(["ip", "netns", "exec", OUT_NS, "/usr/bin/python3", "-c", ECHO_SERVER,
                                       SERVER, "9009"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        procs.append(subprocess.Popen(["ip", "netns", "exec", OUT_NS, "/usr/bin/python3", "-c", SINK_SERVER,
                                       SERVER, "9010", str(SINK_BYTES)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        procs.append(subprocess.Popen(["ip", "netns", "exec", OUT_NS, "/usr/bin/python3", "-c", DNS_SERVER,
                                       SERVER, SERVER, DENIED, DNS_LOG], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        for url in (f"http://{SERVER}:8080/", f"http://{SERVER}:8081/", f"http://{DENIED}:8080/", f"http://{META}/"):
            assert lib.wait_for(lambda: sh_host("curl", "-s", "-m", "2", url, check=False).stdout == "stand-in\n",
                                15), f"stand-in {url} does not answer the host"
        assert lib.wait_for(lambda: os.path.exists(DNS_LOG) or dns_probe(), 15), "the DNS stand-in does not answer"
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
        sh_host("ip", "route", "del", f"{META}/32", check=False)
        if os.path.exists(DNS_LOG):
            os.unlink(DNS_LOG)
        for ns in (OUT_NS, META_NS):
            sh_host("ip", "netns", "del", ns, check=False)
        for i in ("a", "b"):
            sh_host("ip", "link", "del", f"dsit{PID}{i}", check=False)


def dns_probe() -> bool:
    """One question from the host to the DNS stand-in (it then exists and logs)."""
    import dnslib
    try:
        dnslib.DNSRecord.question("mirror.test").send(SERVER, 53, timeout=1)
        return True
    except OSError:
        return False


def start(home: str, image_home: str, tag: str, *extra: str) -> lib.Agent:
    a = lib.Agent(home, tag=tag, extra_args=["--store", os.path.join(image_home, "store"), "--network-range", RANGE,
                                             *extra])
    a.start()
    return a


@pytest.fixture(scope="module")
def home():
    h = tempfile.mkdtemp(prefix="dsec-it-net-")
    yield h
    shutil.rmtree(h, ignore_errors=True)


@pytest.fixture(scope="module")
def net(outside, home, image_home):
    """An agent whose TCP listener is on the host's address of the stand-in link: a sandbox must not reach it."""
    port = 20000 + PID % 20000
    a = start(home, image_home, "net", "--listen", f"{HOST_IP}:{port}", "--insecure-no-tls",
              "--egress-deny", f"{DENIED}/32", "--dns-upstream", SERVER)
    a.api_port = port
    yield a
    table = f"dsec_{a.cgroup_name}".replace("-", "_")
    a.stop_and_check()
    r = sh_host("nft", "list", "table", "inet", table, check=False)
    assert r.returncode != 0, f"table inet {table} left after the agent stopped:\n{r.stdout}"


def client_of(agent):
    return dsec.Client(endpoints=[agent.endpoint])


def connect(sb, host: str, port: int, seconds: int = 3) -> bool:
    """Whether a TCP connection from the sandbox to host:port is answered (an HTTP request, or the echo)."""
    r = sb.exec(["sh", "-c", f'printf "GET / HTTP/1.0\\r\\n\\r\\n" | timeout {seconds} nc {host} {port}'],
                timeout=seconds + 10)
    return r.exit_code == 0 and len(r.stdout) > 0


def test_none_is_loopback_only(net):
    with client_of(net) as c:
        sb = c.create(image="busybox", ttl=300)
        try:
            assert sb.network() == {"mode": "none", "rules": []}
            r = sb.exec(["ip", "-o", "link"])
            assert [line.split(":")[1].strip() for line in r.stdout.decode().splitlines()] == ["lo"], r.stdout
            assert not connect(sb, SERVER, 8080, 2)
        finally:
            sb.destroy()


def test_egress_rules_first_match_and_open(net):
    with client_of(net) as c:
        rules = [{"cidr": f"{SERVER}/32", "protocol": "tcp", "ports": "8081", "allow": False},
                 {"cidr": f"10.199.{OCTET}.0/24", "protocol": "tcp", "ports": "8080-8081"}]
        sb = c.create(image="busybox", ttl=300, network={"mode": "egress", "rules": rules})
        try:
            assert sb.network()["rules"][0] == {"allow": False, "cidr": f"{SERVER}/32", "protocol": "tcp",
                                                "ports": "8081"}
            assert connect(sb, SERVER, 8080)            # allowed by the second rule
            assert not connect(sb, SERVER, 8081, 2)     # the first rule, a deny, matches first
            assert not connect(sb, SERVER, 9009, 2)     # no rule: refused
            # Open egress: anything but what is always blocked.
            assert sb.set_network("open") == {"mode": "open", "rules": []}
            assert connect(sb, SERVER, 8081) and connect(sb, SERVER, 9009)
            # A whole CIDR, any protocol.
            sb.set_network("egress", rules=[{"cidr": f"10.199.{OCTET}.0/24"}])
            assert connect(sb, SERVER, 9009)
        finally:
            sb.destroy()


def resolve(sb, name: str) -> list[str]:
    """The IPv4 addresses the sandbox gets for a name through its resolv.conf (busybox nslookup); [] for none."""
    r = sb.exec(["nslookup", "-type=a", name], timeout=20)
    out = r.stdout.decode()
    answers = out.split("answer:", 1)[1] if "answer:" in out else ""
    return [line.split(":", 1)[1].strip() for line in answers.splitlines() if line.startswith("Address:")]


def asked_upstream() -> list[str]:
    with open(DNS_LOG) as f:
        return [line.strip().rstrip(".") for line in f]


def test_names_resolve_only_when_allowed_and_admit_what_was_answered(net):
    """A name rule: the resolver answers only allowed names (the others never leave the node), and a connection is
    admitted to the addresses it answered, with the rule's ports, and to no others."""
    with client_of(net) as c:
        sb = c.create(image="busybox", ttl=300, network={"mode": "egress", "rules": [
            {"host": "mirror.test", "protocol": "tcp", "ports": "8080"}]})
        try:
            assert "nameserver" in sb.read_file("/etc/resolv.conf").decode()
            assert not connect(sb, SERVER, 8080, 2), "an address no answer handed out was reached"
            asked = len(asked_upstream())
            assert resolve(sb, "other.test") == []
            assert resolve(sb, "www.example.test") == []
            assert asked_upstream()[asked:] == [], "names no rule allows were asked upstream"
            assert resolve(sb, "MIRROR.test") == [SERVER]  # case does not matter
            assert "mirror.test" in asked_upstream()[asked:]
            assert sb.network_usage()["resolved"] == {"mirror.test": [SERVER]}
            assert connect(sb, SERVER, 8080), "the address answered for an allowed name is not admitted"
            assert not connect(sb, SERVER, 8081, 2), "a port the name's rule does not name was reached"
            # A resolver named in the sandbox's own resolv.conf, or any other address: port 53 reaches the agent's.
            r = sb.exec(["nslookup", "-type=a", "other.test", META], timeout=20)
            assert SERVER not in r.stdout.decode().split("answer:", 1)[-1]
            # The next phase allows no name: what was admitted for one goes with it.
            sb.set_network("egress", rules=[{"cidr": f"{DENIED}/32"}])
            assert not connect(sb, SERVER, 8080, 2)
            assert resolve(sb, "mirror.test") == []
        finally:
            sb.destroy()


def test_wildcard_names_first_match_cnames_and_what_stays_blocked(net):
    with client_of(net) as c:
        sb = c.create(image="busybox", ttl=300, network={"mode": "egress", "rules": [
            {"host": "www.example.test", "allow": False},
            {"host": "*.example.test", "protocol": "tcp", "ports": "8081"},
            {"host": "alias.test", "protocol": "tcp", "ports": "8080"},
            {"host": "denied.test"}]})
        try:
            assert resolve(sb, "x.y.example.test") == [SERVER]  # any depth below the wildcard
            assert resolve(sb, "example.test") == []            # not the name itself
            assert resolve(sb, "www.example.test") == []        # the deny rule matches first
            assert connect(sb, SERVER, 8081) and not connect(sb, SERVER, 8080, 2)
            # A CNAME: the address at its end is admitted under the rule of the name asked.
            assert resolve(sb, "alias.test") == [SERVER]
            assert connect(sb, SERVER, 8080)
            # An allowed name whose address is always blocked (--egress-deny): answered, never reached.
            assert resolve(sb, "denied.test") == [DENIED]
            assert not connect(sb, DENIED, 8080, 2)
        finally:
            sb.destroy()


def send_rate(sb) -> float:
    """Bytes a second the sandbox sends SINK_BYTES at, measured by the stand-in that receives them."""
    r = sb.exec(["sh", "-c", f"head -c {SINK_BYTES} /dev/zero | nc {SERVER} 9010"], timeout=60)
    got, seconds = r.stdout.decode().split()
    assert int(got) == SINK_BYTES, r.stdout
    return SINK_BYTES / max(float(seconds), 1e-3)


def test_limits_shape_what_a_sandbox_sends_and_cap_its_connections_and_usage_is_counted(net):
    rules = {"mode": "egress", "rules": [{"cidr": f"{SERVER}/32", "protocol": "tcp", "ports": "9009-9010"}]}
    with client_of(net) as c:
        shaped = c.create(image="busybox", ttl=300, network=rules, egress_mbps=8)  # 1 MB/s
        free = c.create(image="busybox", ttl=300, network=rules)
        capped = c.create(image="busybox", ttl=300, network=rules, connections=2)
        try:
            assert shaped.info().resources.egress_mbps == 8
            slow, fast = send_rate(shaped), send_rate(free)
            assert 0.5e6 < slow < 1.5e6, f"{slow:.0f} B/s with egress_mbps=8 (1e6 B/s)"
            assert fast > 2 * slow, f"unshaped {fast:.0f} B/s, shaped {slow:.0f} B/s"
            # Two connections held open: the third is refused, and goes through once one is gone.
            capped.exec(["sh", "-c", f"for i in 1 2; do (sleep 60 | nc {SERVER} 9009 >/dev/null 2>&1 &); done"])
            assert lib.wait_for(lambda: capped.exec(["sh", "-c", "ps -o comm | grep -c '^nc$'"]).stdout.strip() == b"2",
                                10)
            time.sleep(0.5)
            assert not connect(capped, SERVER, 9009, 2), "a third connection went through connections=2"
            capped.exec(["sh", "-c", "kill $(ps -o pid,comm | awk '$2 == \"nc\" {print $1}')"])
            assert lib.wait_for(lambda: connect(capped, SERVER, 9009, 2), 10), "no connection after the held ones went"
            # Usage: what went out, and what the rules refused (a port no rule names, an address always blocked).
            assert not connect(free, SERVER, 8081, 1) and not connect(free, DENIED, 8080, 1)
            usage = free.network_usage()
            assert usage["bytes_out"] >= SINK_BYTES and usage["packets_out"] > 0 and usage["bytes_in"] > 0
            assert usage["refused"] >= 2, usage
            assert shaped.network_usage()["refused"] == 0
            text = lib.http_request(net.socket_path, "GET", "/metrics").body.decode()
            line = f'dsec_sandbox_network_bytes_total{{sandbox="{free.id}",direction="out"}} '
            assert int(text.split(line, 1)[1].split()[0]) >= SINK_BYTES
            assert f'dsec_sandbox_network_refused_total{{sandbox="{free.id}"}} ' in text
        finally:
            for sb in (shaped, free, capped):
                sb.destroy()


def test_always_blocked_whatever_the_rules(net):
    """The node's own addresses (its agent API among them), the metadata address, other sandboxes, the agent's
    --egress-deny: unreachable even with open egress or a rule that names them."""
    with client_of(net) as c:
        everything = [{"cidr": "0.0.0.0/0"}]
        a = c.create(image="busybox", ttl=300, network={"mode": "egress", "rules": everything})
        b = c.create(image="busybox", ttl=300, network="open")
        try:
            # The host reaches its own agent and the metadata stand-in; the sandboxes do not.
            assert sh_host("curl", "-s", "-m", "3", f"http://{HOST_IP}:{net.api_port}/healthz",
                           check=False).returncode == 0
            for sb in (a, b):
                assert connect(sb, SERVER, 8080)  # the rules do let traffic out
                assert not connect(sb, HOST_IP, net.api_port, 2), "a sandbox reached the agent's API"
                assert not connect(sb, META, 80, 2), "a sandbox reached the metadata address"
                assert not connect(sb, DENIED, 8080, 2), "a sandbox reached an --egress-deny address"
            # One sandbox cannot reach another, not even with a listener waiting.
            b_addr = b.exec(["sh", "-c", "ip -o -4 addr show eth0 | awk '{print $4}' | cut -d/ -f1"]).stdout
            b_addr = b_addr.decode().strip()
            b.exec(["sh", "-c", "(while true; do echo hi | nc -l -p 7000; done) >/dev/null 2>&1 &"])
            assert lib.wait_for(lambda: connect(b, "127.0.0.1", 7000, 2), 10), "the listener never answered"
            assert not connect(a, b_addr, 7000, 2), "a sandbox reached another"
            # IPv6 is not routed at all.
            r = a.exec(["sh", "-c", "ip -6 route | grep -c default"])
            assert r.stdout.strip() in (b"0", b""), r.stdout
        finally:
            a.destroy()
            b.destroy()


SPOOF = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.settimeout(3); s.bind((sys.argv[1], 0))
    try:
        s.connect((sys.argv[2], int(sys.argv[3]))); print("connected")
    except OSError as e:
        print("refused", e)
""")


def test_a_spoofed_source_is_dropped(net):
    with client_of(net) as c:
        sb = c.create(image="busybox", ttl=300, network="open")
        try:
            nsnet = f"/proc/{init_pid(net, sb.id)}/ns/net"
            own = sh_host("nsenter", f"--net={nsnet}", "ip", "-o", "-4", "addr", "show", "eth0").stdout.split()[3]
            own = own.split("/")[0]
            # The host's root adds another sandbox's address inside (nothing inside could: no capability) and
            # connects from it; from the sandbox's own address the same connection goes through.
            a, b, c3, d = (int(x) for x in own.split("."))
            spoofed = f"{a}.{b}.{c3}.{(d + 4) % 256}"
            sh_host("nsenter", f"--net={nsnet}", "ip", "addr", "add", f"{spoofed}/32", "dev", "eth0")

            def from_(source: str) -> str:
                return sh_host("nsenter", f"--net={nsnet}", "/usr/bin/python3", "-c", SPOOF, source, SERVER,
                               "8080").stdout.strip()
            assert from_(own) == "connected"
            assert from_(spoofed).startswith("refused"), "a packet with another sandbox's source went out"
        finally:
            sb.destroy()


def init_pid(agent, sid: str) -> int:
    with open(os.path.join(agent.home, "state", "sandboxes", sid + ".json")) as f:
        return int(json.load(f)["backend"]["init_pid"])


def test_a_phase_change_cuts_a_live_connection_and_a_sleeping_sandbox_can_change(net):
    with client_of(net) as c:
        sb = c.create(image="busybox", ttl=300, network={"mode": "egress", "rules": [
            {"cidr": f"{SERVER}/32", "protocol": "tcp", "ports": 9009}]})
        try:
            sb.exec(["sh", "-c", f"(while true; do echo ping; sleep 0.1; done) | nc {SERVER} 9009 > /tmp/echo "
                                 "2>/dev/null &"])

            def size() -> int:
                return int(sb.exec(["sh", "-c", "wc -c < /tmp/echo"]).stdout.strip() or 0)
            assert lib.wait_for(lambda: size() > 20, 10), "the echo never answered"
            assert sb.set_network("none") == {"mode": "none", "rules": []}
            time.sleep(0.5)
            before = size()
            time.sleep(1.5)
            assert size() == before, "the connection the new rules forbid still carries data"
            # While asleep, the rules change too, and hold after the wake.
            sb.sleep()
            sb.set_network("egress", rules=[{"cidr": f"{SERVER}/32", "protocol": "tcp", "ports": "8080"}])
            sb.wake()
            assert connect(sb, SERVER, 8080) and not connect(sb, SERVER, 9009, 2)
        finally:
            sb.destroy()


def test_a_sandbox_made_without_a_network_can_get_one(net):
    with client_of(net) as c:
        sb = c.create(image="busybox", ttl=300)
        try:
            assert not connect(sb, SERVER, 8080, 1)
            sb.set_network("egress", rules=[{"cidr": f"{SERVER}/32", "protocol": "tcp", "ports": "8080"}])
            assert connect(sb, SERVER, 8080)
        finally:
            sb.destroy()


def test_a_group_changes_phase_together(net):
    with client_of(net) as c:
        group = c.create_group(2, image="busybox", ttl=300, network={"mode": "egress", "rules": [
            {"cidr": f"{SERVER}/32", "protocol": "tcp", "ports": "8080"}]})
        try:
            assert all(connect(sb, SERVER, 8080) for sb in group)
            assert group.set_network("none") == [{"mode": "none", "rules": []}] * 2
            assert not any(connect(sb, SERVER, 8080, 2) for sb in group)
            assert [sb.network()["mode"] for sb in group] == ["none", "none"]
        finally:
            group.destroy()


READ = textwrap.dedent("""
    import socket, sys
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
        s.sendall(b"hi\\n")
        print(s.recv(100).decode().strip())
    except OSError as e:
        print("refused", e)
""")


def read_from(host: str, port: int, netns: str | None = None) -> str:
    """What a server answers a connection to host:port: from the host itself, or from the stand-in's namespace."""
    argv = ["/usr/bin/python3", "-c", READ, host, str(port)]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    return sh_host(*argv).stdout.strip()


def served(node_port: int, netns: str | None = None) -> bool:
    return bool(lib.wait_for(lambda: read_from(HOST_IP, node_port, netns) == "served", 10, interval=0.2))


def test_an_exposed_port_is_reached_from_outside_and_from_no_sandbox(net):
    with client_of(net) as c:
        # A sandbox without egress: exposing gives it a link that lets nothing out.
        sb = c.create(image="busybox", ttl=300)
        other = c.create(image="busybox", ttl=300, network="open")
        try:
            sb.exec(["sh", "-c", "(while true; do echo served | nc -l -p 8000; done) >/dev/null 2>&1 &"])
            address = sb.expose(8000)
            node_port = int(address.rsplit(":", 1)[1])
            assert sb.exposed() == {8000: address}
            # (The server is a loop of one-connection nc's: between two of them a connection may be refused.)
            assert served(node_port), "not reached from the host"
            assert served(node_port, netns=OUT_NS), "not reached from another machine"
            assert not connect(other, HOST_IP, node_port, 2), "a sandbox reached another's exposed port"
            assert not connect(sb, SERVER, 8080, 2), "exposing a port gave the sandbox egress"
            r = call(net, "POST", f"/v1/sandboxes/{sb.id}/ports", {"port": 8000})
            assert r.status == 400 and "exposed already" in r.json()["message"], r
            for bad in ({"port": 0}, {"port": 70000}, {"port": "80"}, {"port": 80, "proto": "udp"}, {}):
                r = call(net, "POST", f"/v1/sandboxes/{sb.id}/ports", bad)
                assert r.status == 400, (bad, r)
            sb.unexpose(8000)
            assert sb.exposed() == {}
            assert read_from(HOST_IP, node_port).startswith("refused")
            with pytest.raises(dsec.NotFound):
                sb.unexpose(8000)
            # Gone with the sandbox at once.
            address = sb.expose(8000)
            node_port = int(address.rsplit(":", 1)[1])
            assert served(node_port)
        finally:
            sb.destroy()
            other.destroy()
        assert read_from(HOST_IP, node_port).startswith("refused")
        assert f" {node_port} :" not in nft_text(net)


def nft_text(agent) -> str:
    return sh_host("nft", "list", "table", "inet", f"dsec_{agent.cgroup_name}".replace("-", "_"),
                   check=False).stdout


def test_destroy_leaves_no_link_element_address_or_connection(net):
    with client_of(net) as c:
        sb = c.create(image="busybox", ttl=300, network={"mode": "egress", "rules": [
            {"cidr": f"{DENIED}/32"}, {"host": "mirror.test"}]})
        addr = sb.exec(["sh", "-c", "ip -o -4 addr show eth0 | awk '{print $4}' | cut -d/ -f1"]).stdout.decode().strip()
        with open(os.path.join(net.home, "state", "sandboxes", sb.id + ".json")) as f:
            iface = json.load(f)["backend"]["net_interface"]
        counter = "r_" + iface.split("-", 1)[1]  # its refused-connections counter
        assert resolve(sb, "mirror.test") == [SERVER] and connect(sb, SERVER, 8080)
        text = nft_text(net)
        assert addr in text and counter in text and iface in sh_host("ip", "-o", "link").stdout
        pinned = text.split("set pinned", 1)[1].split("\n\t}", 1)[0]
        assert f"{addr} . {SERVER}" in pinned, f"no pin for the answer: {pinned}"
        sb.destroy()
        assert iface not in sh_host("ip", "-o", "link").stdout
        text = nft_text(net)
        assert addr not in text and iface not in text and counter not in text
        if shutil.which("conntrack"):
            left = sh_host("conntrack", "-L", "-s", addr, check=False).stdout
            assert addr not in left, left
        block = addr.rsplit(".", 1)
        first = f"{block[0]}.{int(block[1]) - 2}"
        claims = os.listdir("/run/dsec-net") if os.path.isdir("/run/dsec-net") else []
        # Claims are named by the /30's first address as a number.
        a, b2, c3, d = (int(x) for x in first.split("."))
        assert str(a << 24 | b2 << 16 | c3 << 8 | d) not in claims


def test_restart_keeps_the_rules(outside, image_home):
    h = tempfile.mkdtemp(prefix="dsec-it-net-restart-")
    a = start(h, image_home, "netrs")
    agents = [a]
    try:
        with client_of(a) as c:
            sb = c.create(image="busybox", ttl=300, network={"mode": "egress", "rules": [
                {"cidr": f"{SERVER}/32", "protocol": "tcp", "ports": "8080"}]})
            sid = sb.id
            assert connect(sb, SERVER, 8080)
            sb.exec(["sh", "-c", "(while true; do echo served | nc -l -p 8000; done) >/dev/null 2>&1 &"])
            node_port = int(sb.expose(8000).rsplit(":", 1)[1])
            assert served(node_port)
        os.kill(a.proc.pid, signal.SIGKILL)
        a.proc.wait(15)
        b = start(h, image_home, "netrs")
        agents.append(b)
        with client_of(b) as c:
            sb = c.attach(sid)
            assert sb.network()["rules"][0]["ports"] == "8080"
            assert connect(sb, SERVER, 8080) and not connect(sb, SERVER, 8081, 2)
            assert list(sb.exposed()) == [8000]
            assert served(node_port)  # the exposed port came back with it
            sb.destroy()
    finally:
        for agent in agents[:-1]:
            agent.stop()
        agents[-1].stop_and_check()
        shutil.rmtree(h, ignore_errors=True)


def call(agent, method: str, target: str, body) -> lib.RawResponse:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return lib.http_request(agent.socket_path, method, target, data, {"Content-Type": "application/json"})


def test_bad_link_limits_are_refused(net):
    for resources, field in [({"egress_mbps": 400001}, "resources.egress_mbps"),
                             ({"egress_mbps": -1}, "resources.egress_mbps"),
                             ({"connections": 1 << 21}, "resources.connections"),
                             ({"connections": "many"}, "resources.connections")]:
        r = call(net, "POST", "/v1/sandboxes", {"image": "busybox", "network": "open", "resources": resources})
        assert r.status == 400 and field in r.json()["message"], r
    with client_of(net) as c, pytest.raises(dsec.InvalidArgument, match="resources.egress_mbps"):
        c.create(image="busybox", egress_mbps=-5)


@pytest.mark.parametrize("policy,field", [
    ({"mode": "egress", "rules": [{"cidr": "10.0.0.1/8"}]}, "network.rules[0].cidr"),
    ({"mode": "egress", "rules": [{"cidr": "10.0.0.0/33"}]}, "network.rules[0].cidr"),
    ({"mode": "egress", "rules": [{"cidr": "example.org"}]}, "network.rules[0].cidr"),
    ({"mode": "egress", "rules": [{"cidr": "10.0.0.0/8", "protocol": "tcp", "ports": "70000"}]},
     "network.rules[0].ports"),
    ({"mode": "egress", "rules": [{"cidr": "10.0.0.0/8", "protocol": "icmp", "ports": "80"}]},
     "network.rules[0].ports"),
    ({"mode": "egress", "rules": [{"cidr": "10.0.0.0/8", "protocol": "sctp"}]}, "network.rules[0].protocol"),
    ({"mode": "egress", "rules": [{"cidr": "10.0.0.0/8", "via": "x"}]}, "network.rules[0]"),
    ({"mode": "egress", "rules": [{"host": "a..example.org"}]}, "network.rules[0].host"),
    ({"mode": "egress", "rules": [{"cidr": "10.0.0.0/8"}, {"host": "*.*.example.org"}]}, "network.rules[1].host"),
    ({"mode": "egress", "rules": [{"host": "10.1.2.3"}]}, "network.rules[0].host"),
    ({"mode": "egress", "rules": [{"host": "a.org", "cidr": "10.0.0.0/8"}]}, "network.rules[0]"),
    ({"mode": "sideways"}, "network.mode"),
    ({"mode": "open", "rules": [{"cidr": "10.0.0.0/8"}]}, "network.rules"),
    ("tunnel", "network.mode"),
])
def test_bad_policies_are_refused_and_change_nothing(net, policy, field):
    r = call(net, "POST", "/v1/sandboxes", {"image": "busybox", "network": policy})
    assert r.status == 400 and field in r.json()["message"], r
    with client_of(net) as c:
        sb = c.create(image="busybox", ttl=300, network={"mode": "egress", "rules": [{"cidr": f"{SERVER}/32"}]})
        try:
            r = call(net, "PUT", f"/v1/sandboxes/{sb.id}/network", policy)
            assert r.status == 400 and field in r.json()["message"], r
            assert sb.network()["rules"] == [{"allow": True, "cidr": f"{SERVER}/32", "protocol": "any"}]
            assert connect(sb, SERVER, 8080)
        finally:
            sb.destroy()
        r = call(net, "PUT", f"/v1/sandboxes/{sb.id}/network", "none")
        assert r.status == 404, r


def test_open_egress_can_be_forbidden(outside, image_home, tmp_path):
    a = start(str(tmp_path), image_home, "netno", "--no-open-egress")
    try:
        r = call(a, "POST", "/v1/sandboxes", {"image": "busybox", "network": "open"})
        assert r.status == 412 and "no-open-egress" in r.json()["message"], r
    finally:
        a.stop_and_check()


def test_an_exhausted_range_or_port_range_is_resource_exhausted_and_leaves_nothing(outside, image_home, tmp_path):
    """A node's /28 holds four sandbox networks and two node ports here: the next of each is RESOURCE_EXHAUSTED
    (429), nothing is half made, and what is given back is handed out again."""
    a = start(str(tmp_path), image_home, "netfull", "--network-range", f"10.86.{OCTET}.0/28",
              "--expose-ports", "31990-31991")
    try:
        with client_of(a) as c:
            made = []
            try:
                made = [c.create(image="busybox", ttl=300, network="open") for _ in range(4)]
                links = sh_host("ip", "-o", "link").stdout.count("dsh-")
                r = call(a, "POST", "/v1/sandboxes", {"image": "busybox", "network": "open"})
                assert r.status == 429 and "sandbox network addresses" in r.json()["message"], r
                assert sh_host("ip", "-o", "link").stdout.count("dsh-") == links, "a refused create left a link"
                made.append(c.create(image="busybox", ttl=300))  # a sandbox without a network needs no address
                assert made[0].expose(8000) and made[1].expose(8000)
                r = call(a, "POST", f"/v1/sandboxes/{made[2].id}/ports", {"port": 8000})
                assert r.status == 429 and "node ports" in r.json()["message"], r
                made[0].unexpose(8000)
                assert made[2].expose(8000).endswith(":31990")
                made.pop(0).destroy()
                made.append(c.create(image="busybox", ttl=300, network="open"))
            finally:
                for sb in made:
                    sb.destroy()
    finally:
        a.stop_and_check()
