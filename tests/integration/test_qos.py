"""Classes of service on a node (docs/qos.md) against the session's dsecd: a sandbox's `priority` sets its CPU weight
and memory policy in its cgroup, and a batch sandbox's processes run SCHED_IDLE, which none of them can leave; under
contention for one core, a batch sandbox gets what a standard one leaves over."""

from __future__ import annotations

import os
import threading

import pytest

import dsec_testlib as lib

dsec = lib.dsec

SCHED_OTHER, SCHED_IDLE = 0, 5


def policy_of_self(sb) -> int:
    """The scheduling policy of a process the sandbox runs (/proc/self/stat, field 41)."""
    stat = sb.exec("cat /proc/self/stat").stdout.decode()
    return int(stat[stat.rindex(")") + 2:].split()[38])


def cpu_setting(agent, sandbox_id: str) -> tuple[str, int]:
    """("cpu.shares", n) on a v1 host, ("cpu.weight", n) on v2."""
    d = agent.cgroup_dir("cpu", sandbox_id)
    for name in ("cpu.shares", "cpu.weight"):
        path = os.path.join(d, name)
        if os.path.exists(path):
            return name, int(open(path).read())
    raise AssertionError(f"no CPU weight file in {d}")


def test_each_class_gets_its_weight_and_policy(client, agent):
    made = {}
    try:
        for priority in ("latency", "standard", "batch"):
            made[priority] = client.create("busybox", priority=priority, memory="64Mi", ttl=300)
        weights = {p: cpu_setting(agent, sb.id) for p, sb in made.items()}
        name = weights["standard"][0]
        expected = {"cpu.shares": (4096, 1024, 2), "cpu.weight": (400, 100, 1)}[name]
        assert (weights["latency"][1], weights["standard"][1], weights["batch"][1]) == expected, weights
        assert policy_of_self(made["batch"]) == SCHED_IDLE
        assert policy_of_self(made["standard"]) == SCHED_OTHER
        assert policy_of_self(made["latency"]) == SCHED_OTHER
        # Nothing inside may raise its priority: RLIMIT_NICE is 0 (and it holds no CAP_SYS_NICE on the host).
        limits = made["batch"].exec("cat /proc/self/limits").stdout.decode()
        assert any(l.startswith("Max nice priority") and l.split()[3:5] == ["0", "0"] for l in limits.splitlines()), \
            limits
        renice = made["batch"].exec("renice -n -5 -p $$ || nice -n -5 true")
        assert renice.exit_code != 0, renice
        # A child of a child still runs SCHED_IDLE.
        stat = made["batch"].exec("sh -c 'sh -c \"cat /proc/self/stat\"'").stdout.decode()
        assert int(stat[stat.rindex(")") + 2:].split()[38]) == SCHED_IDLE
        info = made["batch"].info()
        assert info.resources.priority == "batch", info
    finally:
        for sb in made.values():
            sb.destroy()


def test_batch_yields_the_core_to_standard(client):
    """A standard and a batch sandbox spin on the same core for 3 s: the batch one gets the scraps."""
    std = client.create("busybox", memory="64Mi", ttl=300)
    batch = client.create("busybox", memory="64Mi", ttl=300, priority="batch")
    try:
        # The spinner's own CPU time (utime + stime, in 1/100 s) after 3 s on core 0.
        spin = ("taskset -c 0 sh -c 'while :; do :; done' & p=$!; sleep 3; "
                "cut -d' ' -f14,15 /proc/$p/stat; kill $p")
        results = {}

        def run(sb):
            results[sb.id] = sb.exec(spin, timeout=30)

        threads = [threading.Thread(target=run, args=(sb,)) for sb in (std, batch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        used = {}
        for sb in (std, batch):
            r = results[sb.id]
            assert r.exit_code == 0, r
            used[sb.id] = sum(int(x) for x in r.stdout.split()) / 100
        s, b = used[std.id], used[batch.id]
        print(f"\none core, 3 s: standard {s:.2f} s of CPU, batch {b:.2f} s")
        assert s > 2.0, (s, b)
        assert b < s / 5, (s, b)
    finally:
        std.destroy()
        batch.destroy()


def test_an_unknown_class_is_refused(client, agent):
    with pytest.raises(dsec.InvalidArgument, match="priority"):
        client.create("busybox", priority="urgent")
    res = lib.http_request(agent.socket_path, "POST", "/v1/sandboxes",
                           b'{"image": "busybox", "priority": "realtime"}', {"Content-Type": "application/json"})
    assert res.status == 400 and b"priority" in res.body, res
    res = lib.http_request(agent.socket_path, "POST", "/v1/sandboxes",
                           b'{"image": "busybox", "priority": 3}', {"Content-Type": "application/json"})
    assert res.status == 400 and b"priority" in res.body, res
