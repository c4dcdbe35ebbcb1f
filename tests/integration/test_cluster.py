"""The client driving several real dsecd, each in a network namespace of its own with its own address, found through
a real etcd: placement spreads and packs, prefers nodes that cache the image, moves a batch off a node that times
out without leaving duplicates behind, stops using a node whose registration lapsed, and says NodeLost for the
sandboxes of a node that is gone. The null backend (a control-plane simulation) keeps the pulses cheap."""

from __future__ import annotations

import collections
import os
import signal
import time

import pytest

import cluster_lib as cl
import dsec
import dsec_testlib as lib

TTL = 3  # the agents' etcd lease, seconds

pytestmark = pytest.mark.skipif(cl.etcd_skip_reason() is not None or cl.netns_skip_reason() is not None,
                                reason=f"{cl.etcd_skip_reason() or cl.netns_skip_reason()}")


@pytest.fixture(scope="module")
def net(image_home):
    n = cl.NetnsAgents(image_home, count=3)
    etcd = None
    try:
        etcd = cl.Etcd(hosts=[n.host_address])
        etcd.start()
        n.etcd = etcd
        yield n
    finally:
        try:
            if etcd is not None:
                etcd.close()
        finally:
            n.close()


@pytest.fixture
def cluster(net, request):
    """Three agents registered under a prefix of this test's own; stopped and checked after the test."""
    prefix = f"/cl-{request.node.name}/"
    etcd_url = net.etcd.url(net.host_address)
    agents = [net.start(i, etcd=etcd_url, etcd_prefix=prefix, lease_ttl=TTL,
                        extra_args=["--label", f"slot={i}", "--cpu-overcommit", "64"]) for i in range(3)]
    assert lib.wait_for(lambda: len(net.etcd.nodes(prefix)) == 3, 15), net.etcd.nodes(prefix)
    net.prefix = prefix
    net.agents_now = agents
    yield net
    for a in agents:
        if a.proc is not None and a.proc.poll() is None and a.proc.returncode is None:
            try:
                os.kill(a.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    problems = net.stop_all()
    assert not problems, "agents left things behind:\n  " + "\n  ".join(problems)


def client(net, **kw) -> dsec.Client:
    kw.setdefault("etcd", [net.etcd.url()])
    return dsec.Client(etcd_prefix=net.prefix, **kw)


def per_node(sandboxes) -> collections.Counter:
    return collections.Counter(sb.id.rsplit("-", 1)[0] for sb in sandboxes)


def live(c: dsec.Client) -> list:
    return [s for s in c.list() if s.state != "destroyed"]


def test_a_pulse_spreads_over_the_discovered_nodes(cluster):
    with client(cluster) as c:
        assert len(c.nodes()) == 3
        g = c.create_group(60, kind="null", cpu=0.05, memory="16Mi", lease=30)
        counts = per_node(g)
        assert sorted(counts.values()) == [20, 20, 20], counts
        assert len({sb.id for sb in g}) == 60
        g.destroy()
        assert live(c) == []


def test_pack_fills_one_node_first(cluster):
    with client(cluster, placement="pack") as c:
        sandboxes = c.create_many(30, kind="null", cpu=0.05, memory="16Mi", ttl=120)
        try:
            assert len(per_node(sandboxes)) == 1, per_node(sandboxes)
        finally:
            for sb in sandboxes:
                sb.destroy()


def test_placement_prefers_the_node_that_caches_the_image(cluster, image_home):
    store = os.path.join(image_home, "store")
    with client(cluster, stores=[store]) as c:
        # Warm one node's layer cache: a sandbox there, by its label.
        warm = c.create("busybox", kind="null", node_selector={"slot": "1"}, ttl=120)
        warm_node = warm.id.rsplit("-", 1)[0]

        def cached() -> bool:
            return any(n.id == warm_node and n.cached_layers for n in c.nodes())

        assert lib.wait_for(cached, 10), [(n.id, n.cached_layers) for n in c.nodes()]
        # The agents' registrations carry it too (renewed every TTL/3); give the client's view time to follow.
        time.sleep(TTL)
        placed = [c.create("busybox", kind="null", ttl=120) for _ in range(3)]
        try:
            assert {sb.id.rsplit("-", 1)[0] for sb in placed} == {warm_node}, [sb.id for sb in placed]
        finally:
            for sb in placed + [warm]:
                sb.destroy()


def test_a_node_that_times_out_mid_pulse_loses_nothing_and_keeps_no_duplicate(cluster):
    frozen = cluster.agents_now[2]
    os.kill(frozen.proc.pid, signal.SIGSTOP)  # accepts connections (the kernel does), answers nothing
    try:
        with client(cluster, request_timeout=2.0, max_attempts=2, initial_backoff=0.05, max_backoff=0.1) as c:
            started = time.monotonic()
            g = c.create_group(30, kind="null", cpu=0.05, memory="16Mi", lease=TTL)
            took = time.monotonic() - started
            assert len(g) == 30 and len({sb.id for sb in g}) == 30
            nodes = set(per_node(g))
            assert frozen.node_id not in nodes, per_node(g)
            assert took < 15, f"the pulse waited {took:.1f}s for a frozen node"
            # The frozen node comes back and makes what it was asked for: a group lease nobody renews there.
            os.kill(frozen.proc.pid, signal.SIGCONT)
            ids = {sb.id for sb in g}

            def only_the_group_is_left() -> bool:
                return {s.id for s in live(c)} == ids

            assert lib.wait_for(only_the_group_is_left, TTL + 8), \
                sorted({s.id for s in live(c)} - ids)
            g.destroy()
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)


def test_a_killed_agent_leaves_placement_and_its_sandboxes_are_lost(cluster):
    with client(cluster) as c:
        g = c.create_group(9, kind="null", cpu=0.05, memory="16Mi", lease=30)
        victim = cluster.agents_now[0]
        on_victim = [sb for sb in g if sb.id.startswith(victim.node_id + "-")]
        assert on_victim
        cluster.kill(0)
        # Its registration lapses within the lease; then the client's table drops it.
        assert lib.wait_for(lambda: victim.node_id not in cluster.etcd.nodes(cluster.prefix), TTL + 5)
        assert lib.wait_for(lambda: victim.node_id not in {n.id for n in c.nodes()}, 5)
        with pytest.raises(dsec.NodeLost):
            on_victim[0].info()
        more = c.create_many(6, kind="null", cpu=0.05, memory="16Mi", ttl=60)
        assert victim.node_id not in per_node(more)
        for sb in more:
            sb.destroy()
        survivors = [sb for sb in g if not sb.id.startswith(victim.node_id + "-")]
        assert all(sb.info().state == "running" for sb in survivors)
        g.release()
        for sb in survivors:
            sb.destroy()


def test_an_agent_that_stops_renewing_leaves_placement(net, request):
    prefix = f"/cl-{request.node.name}/"
    etcd_url = net.etcd.url(net.host_address)
    stale = net.start(0, etcd=etcd_url, etcd_prefix=prefix, lease_ttl=TTL,
                      extra_args=["--etcd-stop-renewing-after", "1"])
    fresh = net.start(1, etcd=etcd_url, etcd_prefix=prefix, lease_ttl=TTL)
    try:
        net.prefix = prefix
        with client(net) as c:
            assert lib.wait_for(lambda: stale.node_id not in net.etcd.nodes(prefix), 1 + TTL + 5)
            assert lib.wait_for(lambda: {n.id for n in c.nodes()} == {fresh.node_id}, 5)
            sandboxes = c.create_many(8, kind="null", cpu=0.05, memory="16Mi", ttl=60)
            assert set(per_node(sandboxes)) == {fresh.node_id}
            for sb in sandboxes:
                sb.destroy()
            # The stale agent still serves; only the cluster stopped sending it work.
            assert stale.http_get("/v1/node")["id"] == stale.node_id
    finally:
        problems = net.stop_all()
        assert not problems, problems
