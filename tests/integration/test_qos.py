"""Classes of service on a node (docs/qos.md) against the session's dsecd: a sandbox's `priority` sets its CPU weight
and memory policy in its cgroup, and a batch sandbox's processes run SCHED_IDLE, which none of them can leave; under
contention for one core, a batch sandbox gets what a standard one leaves over. The node says what its kernel gives
(core scheduling, PSI, KSM, the reclaimer) and each sandbox what its class got and what it could not get. An agent of
its own reserves a CPU for latency sandboxes (--latency-cpus): they run there only, every other sandbox elsewhere; a
reservation the node cannot honour stops the start. A sandbox that asks for KSM has its processes marked mergeable
and ksmd runs while it lives."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

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
        # A group of cpu.idle 1 reads back the kernel's idle weight (v1 shares 3) instead of the 2 written before.
        idle = os.path.join(agent.cgroup_dir("cpu", made["batch"].id), "cpu.idle")
        batch_idle = os.path.exists(idle) and open(idle).read().strip() == "1"
        assert batch_idle == client.nodes()[0].qos.cpu_idle
        if batch_idle:
            # The batch group sits in an idle group at the top of the hierarchy, beside the agent's subtree, so that
            # everything outside it (the agent's threads, the trainer) preempts it too.
            d = agent.cgroup_dir("cpu", made["batch"].id)
            top = d.split(".batch/")[0] + ".batch"
            assert ".batch/" in d and open(os.path.join(top, "cpu.idle")).read().strip() == "1", d
            assert ".batch/" not in agent.cgroup_dir("cpu", made["standard"].id)
        expected = {"cpu.shares": (4096, 1024, 3 if batch_idle else 2), "cpu.weight": (400, 100, 1)}[name]
        assert (weights["latency"][1], weights["standard"][1], weights["batch"][1]) == expected, weights
        for priority in ("latency", "standard"):
            path = os.path.join(agent.cgroup_dir("cpu", made[priority].id), "cpu.idle")
            assert not os.path.exists(path) or open(path).read().strip() == "0", priority
        assert policy_of_self(made["batch"]) == SCHED_IDLE
        assert policy_of_self(made["standard"]) == SCHED_OTHER
        assert policy_of_self(made["latency"]) == SCHED_OTHER
        # Nothing inside may raise its priority: RLIMIT_NICE is 0 (and it holds no CAP_SYS_NICE on the host).
        limits = made["batch"].exec("cat /proc/self/limits").stdout.decode()
        assert any(line.startswith("Max nice priority") and line.split()[3:5] == ["0", "0"]
                   for line in limits.splitlines()), limits
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


def cpu_seconds(agent, sb) -> float:
    """CPU time (user + system) of the sandbox's processes now, read on the host: an exec in a batch sandbox could
    wait while its SCHED_IDLE init gets no CPU."""
    total = 0
    for pid, _ in lib.processes_in_cgroup(f"{agent.cgroup_name}/{sb.id}"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def test_batch_yields_the_core_to_standard(client, agent):
    """A batch and a standard sandbox spin on the same core for 3 s: the batch one gets the scraps."""
    std = client.create("busybox", memory="64Mi", ttl=300)
    batch = client.create("busybox", memory="64Mi", ttl=300, priority="batch")
    try:
        spin = "taskset -c 0 sh -c 'while :; do :; done' >/dev/null 2>&1 &"
        # The batch one first: once the standard one spins, the batch sandbox's init itself gets no CPU on a busy
        # machine, and could not start anything.
        assert batch.exec(spin).exit_code == 0
        assert std.exec(spin).exit_code == 0
        time.sleep(0.3)
        before = {sb.id: cpu_seconds(agent, sb) for sb in (std, batch)}
        time.sleep(3)
        used = {sb.id: cpu_seconds(agent, sb) - before[sb.id] for sb in (std, batch)}
        s, b = used[std.id], used[batch.id]
        print(f"\none core, 3 s: standard {s:.2f} s of CPU, batch {b:.2f} s")
        assert s > 1.0, (s, b)  # the core is the standard one's (less of it when other work shares it)
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


def test_the_node_says_what_its_kernel_gives(client):
    node = client.nodes()[0]
    q = node.qos
    # This kernel has no core scheduling; a node that has it reports it, and then needs no reason.
    assert q.core_scheduling or q.core_scheduling_reason, q
    assert q.reclaim in ("idle", "off"), q.reclaim
    assert q.reclaim_reason, q
    assert node.memory_used_bytes > 0
    if os.path.exists("/proc/pressure/cpu"):
        assert node.pressure.psi
        assert 0 <= node.pressure.cpu_some <= 100 and 0 <= node.pressure.memory_full <= 100


def test_a_sandbox_says_what_its_class_got(client, agent):
    latency = client.create("busybox", priority="latency", memory="64Mi", ttl=300)
    batch = client.create("busybox", priority="batch", memory="64Mi", ttl=300)
    try:
        node = client.nodes()[0]
        got = latency.info().qos
        assert any(g.startswith(("cpu.shares 4096", "cpu.weight 400")) for g in got.granted), got.granted
        assert "never cold-reclaimed" in got.granted
        if not node.qos.core_scheduling:
            # Not honoured in silence: the info says what is missing and why.
            assert any(m.startswith("core scheduling: ") and node.qos.core_scheduling_reason in m
                       for m in got.missing), got.missing
        if not node.qos.latency_cpus:
            assert any("reserved CPUs" in m for m in got.missing), got.missing
        got = batch.info().qos
        assert "SCHED_IDLE (every process)" in got.granted, got.granted
        # cpu.idle where the kernel has it, and said to be missing where it has not.
        assert any(g.startswith("cpu.idle") for g in got.granted) == node.qos.cpu_idle, got.granted
        assert any(m.startswith("cpu.idle") for m in got.missing) != node.qos.cpu_idle, got.missing
        # The same through the protocol.
        res = lib.http_request(agent.socket_path, "GET", f"/v1/sandboxes/{batch.id}")
        body = res.json()
        assert body["qos"]["granted"] == list(got.granted) and "cold_memory" in body, body
    finally:
        latency.destroy()
        batch.destroy()


@pytest.fixture(scope="module")
def own_home(image_home):
    home = tempfile.mkdtemp(prefix="dsec-it-qos-")
    yield home
    shutil.rmtree(home, ignore_errors=True)


def allowed_cpus(sb) -> str:
    for line in sb.exec("cat /proc/self/status").stdout.decode().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split()[1]
    raise AssertionError("no Cpus_allowed_list")


@pytest.mark.skipif(os.cpu_count() < 2, reason="reserving a CPU for latency sandboxes needs two")
def test_reserved_cpus_keep_latency_sandboxes_apart(own_home, image_home):
    last = str(os.cpu_count() - 1)
    shared = "0" if last == "1" else f"0-{int(last) - 1}"
    a = lib.Agent(own_home, tag="lat", extra_args=["--store", os.path.join(image_home, "store"),
                                                   "--latency-cpus", last]).start_or_clean()
    try:
        c = dsec.Client(endpoints=[a.endpoint])
        try:
            assert c.nodes()[0].qos.latency_cpus == last
            latency = c.create("busybox", priority="latency", memory="64Mi", ttl=300)
            standard = c.create("busybox", memory="64Mi", ttl=300)
            batch = c.create("busybox", priority="batch", memory="64Mi", ttl=300)
            assert allowed_cpus(latency) == last
            assert allowed_cpus(standard) == shared
            assert allowed_cpus(batch) == shared
            # Commands of every later exec stay where their sandbox runs.
            assert latency.exec("sh -c 'grep Cpus_allowed_list /proc/self/status'").stdout.decode().split()[1] == last
            assert f"cpuset {last} (reserved for latency)" in latency.info().qos.granted
            assert not any("reserved CPUs" in m for m in latency.info().qos.missing)
            assert f"cpuset {shared} (off the latency CPUs)" in standard.info().qos.granted
            for sb in (latency, standard, batch):
                sb.destroy()
        finally:
            c.close()
    finally:
        a.stop_and_check()


@pytest.mark.parametrize("value, message", [
    ("0-1023", "is not one the agent may run on"),
    ("all", "is not a CPU number"),
    ("3-1", "runs backwards"),
])
def test_a_reservation_the_node_cannot_honour_stops_the_start(own_home, image_home, value, message):
    lib.Agent(own_home, tag="badlat", extra_args=["--store", os.path.join(image_home, "store"),
                                                  "--latency-cpus", value]).start_refused(message)


def test_reserving_every_cpu_is_refused_with_the_arithmetic(own_home, image_home):
    every = f"0-{os.cpu_count() - 1}" if os.cpu_count() > 1 else "0"
    lib.Agent(own_home, tag="alllat", extra_args=["--store", os.path.join(image_home, "store"),
                                                  "--latency-cpus", every]).start_refused(
        f"reserves all {os.cpu_count()} CPUs")


def ksm_run() -> str:
    with open("/sys/kernel/mm/ksm/run") as f:
        return f.read().strip()


def test_a_sandbox_that_asks_for_ksm_is_merged(client):
    node = client.nodes()[0]
    if not node.qos.ksm:
        pytest.skip("this kernel gives no PR_SET_MEMORY_MERGE or KSM")
    before = ksm_run()
    plain = client.create("busybox", memory="64Mi", ttl=300)
    merged = client.create("busybox", memory="64Mi", ttl=300, ksm=True)
    try:
        stat = merged.exec("cat /proc/self/ksm_stat").stdout.decode()
        # Every process it starts, across exec, is marked mergeable.
        assert "ksm_merge_any: yes" in stat, stat
        assert "ksm_merge_any: no" in plain.exec("cat /proc/self/ksm_stat").stdout.decode()
        assert "ksm" in merged.info().qos.granted
        assert ksm_run() == "1"
        assert client.nodes()[0].qos.ksm_sandboxes >= 1
    finally:
        merged.destroy()
        plain.destroy()
    # The last one gone: the host's own setting is back.
    assert ksm_run() == before
    with pytest.raises(dsec.InvalidArgument, match="ksm"):
        client.create("busybox", ksm="yes")
