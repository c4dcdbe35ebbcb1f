"""Groups from Python: one batch per node, bulk exec and destroy, a lease that the client renews and that reaps the
group when its trainer dies; NodeLost for sandboxes of a node that is gone. Real agents, null backend (no processes
run) except where exec needs a container."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import dsec
from binding_testlib import Agent


@pytest.fixture
def two_null_agents(short_tmp, request):
    name = request.node.name[-12:].replace("[", "").replace("]", "")
    agents = [Agent(os.path.join(short_tmp, f"g1{name}"), "pyg-n1", backends="null"),
              Agent(os.path.join(short_tmp, f"g2{name}"), "pyg-n2", backends="null")]
    yield agents
    for a in agents:
        if a.proc.poll() is None:
            a.stop()
        else:
            detach_mounts_below(a.run_dir)  # killed outright: its layer mounts are the test's to remove


def detach_mounts_below(path: str) -> None:
    """Lazily detaches every mount at or below `path`, deepest first (what a killed agent leaves)."""
    with open("/proc/mounts") as f:
        points = [line.split()[1] for line in f]
    for p in sorted((m for m in points if m == path or m.startswith(path.rstrip("/") + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", p], check=False, capture_output=True)
    with open("/proc/mounts") as f:
        left = [line.split()[1] for line in f if line.split()[1].startswith(path)]
    assert not left, f"mounts left under {path}: {left}"


def node_of(sandbox_id: str) -> str:
    return sandbox_id.rsplit("-", 1)[0]


def live_ids(client) -> set[str]:
    return {s.id for s in client.list() if s.state != "destroyed"}


def test_a_group_spreads_over_the_nodes_and_is_destroyed_as_one(two_null_agents):
    with dsec.Client(endpoints=[a.endpoint for a in two_null_agents]) as c:
        g = c.create_group(10, kind="null", cpu=0.05, memory="16Mi", lease=30)
        assert len(g) == 10 and len({sb.id for sb in g}) == 10
        assert {node_of(sb.id) for sb in g} == {"pyg-n1", "pyg-n2"}
        assert {sb.info().group for sb in g} == {g.id}
        assert {sb.id for sb in g} <= live_ids(c)
        g.destroy()
        assert len(g) == 0
        assert live_ids(c) == set(), live_ids(c)


def test_the_client_renews_the_lease(two_null_agents):
    with dsec.Client(endpoints=[a.endpoint for a in two_null_agents]) as c:
        with c.create_group(4, kind="null", cpu=0.05, memory="16Mi", lease=2) as g:
            ids = {sb.id for sb in g}
            time.sleep(5)  # two and a half leases
            assert ids <= live_ids(c), "renewed members must not be reaped"
        assert not ids & live_ids(c)


def test_a_released_group_is_reaped_when_its_lease_runs_out(two_null_agents):
    with dsec.Client(endpoints=[a.endpoint for a in two_null_agents]) as c:
        g = c.create_group(4, kind="null", cpu=0.05, memory="16Mi", lease=2)
        ids = set(g.release())
        assert ids <= live_ids(c)
        deadline = time.monotonic() + 15
        while ids & live_ids(c) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert not ids & live_ids(c), "a group nobody renews is reaped"


def test_a_killed_trainers_group_is_reaped(two_null_agents):
    script = textwrap.dedent(f"""
        import sys, time, dsec
        c = dsec.Client(endpoints={[a.endpoint for a in two_null_agents]!r})
        g = c.create_group(6, kind="null", cpu=0.05, memory="16Mi", lease=2)
        print(" ".join(sb.id for sb in g), flush=True)
        time.sleep(60)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    try:
        ids = set(trainer.stdout.readline().split())
        assert len(ids) == 6
        with dsec.Client(endpoints=[a.endpoint for a in two_null_agents]) as c:
            assert ids <= live_ids(c)
            time.sleep(3)
            assert ids <= live_ids(c), "the live trainer renews its group"
            trainer.send_signal(signal.SIGKILL)
            trainer.wait()
            deadline = time.monotonic() + 15
            while ids & live_ids(c) and time.monotonic() < deadline:
                time.sleep(0.25)
            assert not ids & live_ids(c), "the dead trainer's group outlived its lease"
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


def test_calls_on_a_sandbox_of_a_dead_node_fail_fast_with_node_lost(two_null_agents):
    a, b = two_null_agents
    with dsec.Client(endpoints=[a.endpoint, b.endpoint], max_attempts=3, initial_backoff=0.01,
                     max_backoff=0.05) as c:
        sandboxes = c.create_many(4, kind="null", cpu=0.05, memory="16Mi")
        on_b = [sb for sb in sandboxes if node_of(sb.id) == "pyg-n2"]
        assert on_b, [sb.id for sb in sandboxes]
        b.proc.kill()
        b.proc.wait()
        # The first call finds the node unreachable (its retries count against the node's health) ...
        with pytest.raises(dsec.Unavailable):
            on_b[0].info()
        # ... and once the node is ejected, calls fail at once without retrying.
        start = time.monotonic()
        with pytest.raises(dsec.NodeLost):
            on_b[0].info()
        assert time.monotonic() - start < 0.5
        # Sandboxes on the live node are unaffected, and new creates go there.
        on_a = [sb for sb in sandboxes if node_of(sb.id) == "pyg-n1"]
        assert all(sb.info().state == "running" for sb in on_a)
        more = c.create_many(3, kind="null", cpu=0.05, memory="16Mi")
        assert {node_of(sb.id) for sb in more} == {"pyg-n1"}
