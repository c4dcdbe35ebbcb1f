"""Discovery through etcd with several real dsecd on this machine, each in a network namespace of its own with its
own address, and a real etcd started by the tests: agents register with a lease and appear, their values follow
their load, a killed agent and one that stops renewing disappear when the lease expires, a clean shutdown removes
the key at once, and an agent registers again when etcd comes back without its data. Agents serve while etcd is
away, and container sandboxes still get their own network namespaces when dsecd itself runs inside one.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time

import pytest

import cluster_lib as cl
import dsec_testlib as lib

TTL = 3  # seconds: the agents' lease; they renew every second

pytestmark = pytest.mark.skipif(cl.etcd_skip_reason() is not None or cl.netns_skip_reason() is not None,
                                reason=f"{cl.etcd_skip_reason() or cl.netns_skip_reason()}")


class Cluster:
    def __init__(self, net: cl.NetnsAgents, etcd: cl.Etcd) -> None:
        self.net = net
        self.etcd = etcd

    @property
    def etcd_url(self) -> str:
        """etcd as the namespaced agents reach it: through the bridge."""
        return self.etcd.url(self.net.host_address)


@pytest.fixture(scope="module")
def cluster(image_home):
    net = cl.NetnsAgents(image_home, count=3)
    etcd = None
    try:
        etcd = cl.Etcd(hosts=[net.host_address])
        etcd.start()
        yield Cluster(net, etcd)
    finally:
        try:
            if etcd is not None:
                etcd.close()
        finally:
            net.close()


@pytest.fixture
def nodes(cluster, request):
    """The cluster, with a key prefix of this test's own; every agent is stopped after the test and checked."""
    cluster.prefix = f"/it-{request.node.name}/"
    if not cluster.etcd.alive():
        cluster.etcd.start()
    yield cluster
    problems = cluster.net.stop_all()
    assert not problems, "agents left things behind:\n  " + "\n  ".join(problems)
    if not cluster.etcd.alive():
        cluster.etcd.start()
    left = cluster.etcd.range_prefix(cluster.prefix)
    assert not left, f"registrations left in etcd after every agent stopped: {sorted(left)}"


def start(c: Cluster, i: int, **kw) -> cl.NetnsAgent:
    kw.setdefault("lease_ttl", TTL)
    return c.net.start(i, etcd=c.etcd_url, etcd_prefix=c.prefix, **kw)


def registered(c: Cluster) -> dict:
    return c.etcd.nodes(c.prefix)


def test_agents_register_and_appear(nodes):
    agents = [start(nodes, i) for i in range(3)]
    assert lib.wait_for(lambda: len(registered(nodes)) == 3, 10), f"registered: {registered(nodes)}"
    regs = registered(nodes)
    for a in agents:
        rec = regs[a.node_id]
        assert rec["endpoint"] == f"http://{a.address}:7070"
        # The value is the agent's GET /v1/node, fetched here over TCP from the host, through the bridge.
        live = a.http_get("/v1/node")
        assert rec["node"]["id"] == live["id"] == a.node_id
        assert rec["node"]["backends"] == live["backends"] == ["null"]
        assert rec["node"]["capacity"] == live["capacity"]
        assert rec["lease"] != 0
        assert 0 < nodes.etcd.lease_ttl(rec["lease"]) <= TTL
    # Each agent has its own lease, and the addresses are distinct.
    assert len({r["lease"] for r in regs.values()}) == 3
    assert len({r["endpoint"] for r in regs.values()}) == 3
    # Registered keys stay while their agents live, for several TTLs.
    time.sleep(2 * TTL)
    assert set(registered(nodes)) == {a.node_id for a in agents}


def test_values_refresh_with_load(nodes):
    a = start(nodes, 0)
    assert lib.wait_for(lambda: a.node_id in registered(nodes), 10)
    assert registered(nodes)[a.node_id]["node"]["load"]["sandboxes"] == 0
    client = lib.dsec.Client(endpoints=[a.url])
    try:
        made = [client.create(image="busybox", kind="null", ttl=300, cpu=0.5, memory="64Mi") for _ in range(3)]
        # Renewed every TTL/3 with the current load.
        assert lib.wait_for(lambda: registered(nodes)[a.node_id]["node"]["load"]["sandboxes"] == 3, TTL + 2), \
            registered(nodes)[a.node_id]["node"]["load"]
        load = registered(nodes)[a.node_id]["node"]["load"]
        assert load["cpu_requested"] == pytest.approx(1.5)
        assert load["memory_requested"] == 3 * (64 << 20)
        for sb in made:
            sb.destroy()
        assert lib.wait_for(lambda: registered(nodes)[a.node_id]["node"]["load"]["sandboxes"] == 0, TTL + 2)
    finally:
        client.close()


def test_killed_agent_disappears_after_its_lease_ttl(nodes):
    a0 = start(nodes, 0)
    a1 = start(nodes, 1)
    assert lib.wait_for(lambda: len(registered(nodes)) == 2, 10)
    nodes.net.kill(0)
    killed_at = time.monotonic()
    # Nobody revoked the lease: the key stays until it expires...
    assert a0.node_id in registered(nodes)
    assert lib.wait_for(lambda: a0.node_id not in registered(nodes), TTL + 4), "the dead agent's key stayed"
    gone_after = time.monotonic() - killed_at
    # ...which takes a good part of the TTL (the last renewal was at most TTL/3 before the kill).
    assert gone_after >= TTL * 2 / 3 - 0.5, f"the key went after {gone_after:.1f}s, sooner than its lease"
    assert set(registered(nodes)) == {a1.node_id}


def test_agent_that_stops_renewing_disappears(nodes):
    a = start(nodes, 0, extra_args=["--etcd-stop-renewing-after", "2"])
    assert lib.wait_for(lambda: a.node_id in registered(nodes), 10)
    assert lib.wait_for(lambda: a.node_id not in registered(nodes), 2 + TTL + 4), "the key outlived its lease"
    # The agent itself is fine and serving; only its registration lapsed.
    assert a.alive()
    assert a.http_get("/v1/node")["id"] == a.node_id
    assert "no longer renewing" in a.log_tail()


def test_clean_shutdown_removes_the_key_at_once(nodes):
    a0 = start(nodes, 0)
    a1 = start(nodes, 1)
    assert lib.wait_for(lambda: len(registered(nodes)) == 2, 10)
    assert nodes.net.stop(0) == 0
    assert a0.node_id not in registered(nodes), "the key stayed after a clean shutdown"
    assert "revoked the lease" in a0.log_tail()
    assert set(registered(nodes)) == {a1.node_id}


def test_agents_keep_serving_while_etcd_is_away_and_register_again(nodes):
    agents = [start(nodes, i) for i in range(2)]
    assert lib.wait_for(lambda: len(registered(nodes)) == 2, 10)
    old_leases = {k: v["lease"] for k, v in registered(nodes).items()}
    nodes.etcd.kill()
    time.sleep(TTL + 1)
    for a in agents:
        assert a.alive()
        assert a.http_get("/v1/node")["id"] == a.node_id
        assert "cannot renew" in a.log_tail()
    # etcd comes back without its data (a new cluster, or one restored from an old backup): the agents notice that
    # their leases are unknown and register again under new ones.
    nodes.etcd.start(wipe=True)
    assert lib.wait_for(lambda: len(registered(nodes)) == 2, 15), registered(nodes)
    for a in agents:
        rec = registered(nodes)[a.node_id]
        assert rec["endpoint"] == a.url
        assert rec["lease"] not in (0, old_leases[a.node_id])
        assert "registered again" in a.log_tail()


def test_container_sandboxes_inside_a_namespaced_agent(nodes):
    """dsecd in a network namespace makes its sandboxes' namespaces from there: each sandbox sees only its own
    loopback, not the agent's eth0, and everything is gone after."""
    a = start(nodes, 2, backends="container")
    assert lib.wait_for(lambda: a.node_id in registered(nodes), 10)
    agent_links = cl._run("ip", "-n", a.netns, "-o", "link", "show").stdout
    assert "eth0" in agent_links
    client = lib.dsec.Client(endpoints=[a.url])
    try:
        sb = client.create(image="busybox", ttl=300, memory="128Mi", pids=64)
        r = sb.exec("cat /proc/net/dev")
        assert r.exit_code == 0, r
        interfaces = [line.split(":")[0].strip() for line in r.stdout.decode().splitlines()[2:]]
        assert interfaces == ["lo"], r.stdout
        r = sb.exec("cat /proc/net/fib_trie")
        assert a.address not in r.stdout.decode()
        assert registered(nodes)[a.node_id]["node"]["load"]["sandboxes"] in (0, 1)
        assert lib.wait_for(lambda: registered(nodes)[a.node_id]["node"]["load"]["sandboxes"] == 1, TTL + 2)
        sb.destroy()
        assert not a.leftovers(sb.id)
    finally:
        client.close()


# ----------------------------------------------------------------------------------------------------------------
# Flags, on a plain agent in the host's namespace and etcd on loopback.

def _dsecd(args, tmp, timeout=15):
    return subprocess.run([str(lib.DSECD), "--home", os.path.join(tmp, "home"), "--run-dir",
                           os.path.join(tmp, "run"), "--backends", "null", "--node-id", "flagtest", *args],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


def test_registration_needs_an_address_clients_can_use(nodes):
    with tempfile.TemporaryDirectory(prefix="dsec-it-flags-") as tmp:
        r = _dsecd(["--socket", os.path.join(tmp, "s.sock"), "--etcd", nodes.etcd.url()], tmp)
        assert r.returncode == 2 and "--advertise" in r.stderr, r.stderr
        r = _dsecd(["--listen", "0.0.0.0:0", "--insecure-no-tls", "--etcd", nodes.etcd.url()], tmp)
        assert r.returncode == 2 and "every address" in r.stderr, r.stderr
        r = _dsecd(["--listen", "127.0.0.1:0", "--insecure-no-tls", "--etcd", "127.0.0.1:2379"], tmp)
        assert r.returncode == 2 and "http://" in r.stderr, r.stderr
        r = _dsecd(["--listen", "127.0.0.1:0", "--insecure-no-tls", "--etcd", nodes.etcd.url(),
                    "--etcd-lease-ttl", "1"], tmp)
        assert r.returncode == 2 and "--etcd-lease-ttl" in r.stderr, r.stderr
        r = _dsecd(["--listen", "127.0.0.1:0", "--insecure-no-tls", "--etcd", nodes.etcd.url(),
                    "--advertise", "10.0.0.1:7070"], tmp)
        assert r.returncode == 2 and "advertise" in r.stderr, r.stderr


def test_advertised_endpoint_is_what_gets_registered(nodes):
    with tempfile.TemporaryDirectory(prefix="dsec-it-adv-") as tmp:
        home = os.path.join(tmp, "home")
        proc = subprocess.Popen([str(lib.DSECD), "--home", home, "--run-dir", os.path.join(tmp, "run"),
                                 "--backends", "null", "--node-id", "advtest", "--socket", os.path.join(tmp, "s.sock"),
                                 "--etcd", nodes.etcd.url(), "--etcd-prefix", nodes.prefix, "--etcd-lease-ttl",
                                 str(TTL), "--advertise", "http://node7.example:7070"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            assert lib.wait_for(lambda: "advtest" in registered(nodes), 10)
            assert registered(nodes)["advtest"]["endpoint"] == "http://node7.example:7070"
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "advtest" not in registered(nodes)
