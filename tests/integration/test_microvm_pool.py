"""Pre-booted microVM pools (dsecd --microvm-pool): a create of a shape in use claims a VM that waits restored from
the shape's template and warmed up, and becomes a sandbox like any other: its own hostname, clock and entropy,
exec, files, sleep and wake, fork, destroy leaving nothing, and a restart of the agent that takes it back while the
pooled VMs nobody claimed are ended.

One agent of this module's own (--backends microvm --microvm-pool 1, a home of its own); one template boot before
the restart and one after it (a restart drops an agent's templates); every other VM is a restore. Skips, with the
reason, when the node cannot run microVMs."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

import pytest

import dsec_testlib as lib

dsec = lib.dsec

VM_MEMORY = "160Mi"
COUNTER = "(i=0; while :; do i=$((i+1)); echo $i > /tmp/c; sleep 0.1; done) >/dev/null 2>&1 &"


def node_microvm(agent) -> dict:
    res = lib.http_request(agent.socket_path, "GET", "/v1/node")
    assert res.status == 200, res
    return res.json().get("microvm") or {}


def qemu_pids(name: str) -> list[int]:
    """QEMU processes started as `-name <name>,...`."""
    return [pid for pid, argv in lib.process_argvs()
            if b"-name" in argv[:-1] and argv[argv.index(b"-name") + 1].split(b",")[0] == name.encode()]


def uid_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Uid:"):
                return int(line.split()[1])
    raise AssertionError(f"no Uid line for pid {pid}")


class Pool:
    """The module's agent and where its microVM files are."""

    def __init__(self, agent, client) -> None:
        self.agent = agent
        self.client = client
        self.data_dir = os.path.join(agent.home, "microvm", agent.cgroup_name)

    def pooled_names(self) -> list[str]:
        try:
            return sorted(os.listdir(os.path.join(self.data_dir, "pool")))
        except FileNotFoundError:
            return []

    def vm_name(self, sandbox_id: str) -> str:
        """The name a claimed VM's QEMU and cgroup kept from the pool (its data directory says which)."""
        with open(os.path.join(self.data_dir, sandbox_id, "cgroup")) as f:
            return f.read().strip()

    def wait_ready(self, n: int = 1, timeout: float = 90) -> dict:
        got = lib.wait_for(lambda: (lambda m: m if m.get("pool", {}).get("ready", 0) >= n else None)(
            node_microvm(self.agent)), timeout, 0.1)
        assert got, f"the pool did not get {n} VM(s) ready in {timeout}s: {node_microvm(self.agent)}\n" \
                    f"{self.agent.log_tail()}"
        return got

    def create(self, **kw):
        return self.client.create(image="busybox", kind="microvm", memory=VM_MEMORY, ttl=900, **kw)


@pytest.fixture(scope="module")
def pool():
    home = tempfile.mkdtemp(prefix="dsec-it-mvpool-home-")
    own = lib.Agent(home, tag="mvpool", extra_args=["--backends", "microvm", "--microvm-pool", "1"])
    client = None
    try:
        lib.build_busybox_image(home)
        own.start()
        info = lib.wait_for(lambda: (lambda m: m if m.get("ready") or not m.get("offered") else None)(
            node_microvm(own)), 120, 0.2) or node_microvm(own)
        if not info.get("offered") or info.get("unavailable"):
            pytest.skip(f"this node cannot run microVMs: {info.get('unavailable') or 'microvm not offered'}")
        assert info["pool"]["size"] == 1, info
        client = dsec.Client(endpoints=[own.endpoint])
        yield Pool(own, client)
    finally:
        if client is not None:
            client.close()
        own.stop()
        pooled_dir = os.path.join(home, "microvm", own.cgroup_name, "pool")
        left = os.listdir(pooled_dir) if os.path.isdir(pooled_dir) else []
        try:
            own.stop_and_check([f"pooled VMs' data directories left at shutdown: {left}"] if left else [])
        finally:
            shutil.rmtree(home, ignore_errors=True)


def assert_vm_gone(pool: Pool, sandbox_id: str, name: str) -> None:
    assert lib.wait_for(lambda: not qemu_pids(name), 10), f"QEMU {name} of {sandbox_id} still runs"
    assert lib.wait_for(lambda: not pool.agent.leftovers(sandbox_id) and not pool.agent.leftovers(name), 5), \
        pool.agent.leftovers(sandbox_id) + pool.agent.leftovers(name)
    assert not os.path.exists(os.path.join(pool.data_dir, sandbox_id)), "the VM's data directory is left"


def test_a_create_of_a_shape_in_use_claims_a_warm_pooled_vm(pool):
    first = pool.create()
    claimed = None
    try:
        # The shape's first create starts from its template (made now) and starts its pool.
        m = pool.wait_ready(1)
        assert m["pool"]["claims"] == 0 and m["pool"]["misses"] == 0, m
        waiting = pool.pooled_names()
        assert len(waiting) == 1, waiting
        assert len(qemu_pids(waiting[0])) == 1
        # A pooled VM is not a sandbox.
        assert [s.id for s in pool.client.list()] == [first.id]

        claimed = pool.create(hostname="agent-7", env={"TASK": "t7"})
        m = node_microvm(pool.agent)
        assert m["pool"]["claims"] == 1, m
        assert pool.vm_name(claimed.id) == waiting[0]
        assert waiting[0] not in pool.pooled_names()
        # It is the sandbox now: its name, its env, a clock that is the host's, entropy of its own.
        r = claimed.exec("hostname; echo $TASK; date +%s")
        assert r.exit_code == 0, r
        host, task, clock = r.stdout.decode().split()
        assert (host, task) == ("agent-7", "t7")
        assert abs(int(clock) - time.time()) < 5, f"the claimed VM's clock is {clock}, the host's {time.time():.0f}"
        rand = "head -c 16 /dev/urandom | od -An -tx1"
        assert claimed.exec(rand).stdout != first.exec(rand).stdout
        assert claimed.exec("cat /proc/sys/kernel/random/uuid").stdout != first.exec(
            "cat /proc/sys/kernel/random/uuid").stdout
        # A QEMU of its own, under a uid of its own, its sockets in the sandbox's run directory.
        (mine,) = qemu_pids(pool.vm_name(claimed.id))
        first_pid = qemu_pids(first.id)  # started from the template: not a pooled VM
        assert len(first_pid) == 1 and uid_of(mine) != uid_of(first_pid[0])
        assert os.path.exists(os.path.join(pool.agent.run_dir, claimed.id, "agent.sock"))
        # Files, and the writable disk the claimed VM brought along.
        claimed.write_file("/root/note", b"from the pool")
        assert claimed.read_file("/root/note") == b"from the pool"
        assert claimed.exec("cat /root/note").stdout == b"from the pool"
        assert first.exec("test -e /root/note || echo absent").stdout == b"absent\n"
        # The pool makes the next one.
        pool.wait_ready(1)
        assert len(pool.pooled_names()) == 1 and pool.pooled_names() != waiting
        # A create of another shape is no claim: it starts its own pool.
        other = pool.client.create(image="busybox", kind="microvm", memory="176Mi", ttl=300)
        try:
            assert node_microvm(pool.agent)["pool"]["claims"] == 1
            assert other.exec("echo ok").stdout == b"ok\n"
        finally:
            other.destroy()
    finally:
        name = pool.vm_name(claimed.id) if claimed is not None else None
        for sb in (claimed, first):
            if sb is not None:
                sb.destroy()
        if name:
            assert_vm_gone(pool, claimed.id, name)


def test_a_claimed_vm_sleeps_wakes_and_forks(pool):
    pool.wait_ready(1)
    vm = pool.create()
    made = [vm]
    try:
        assert node_microvm(pool.agent)["pool"]["claims"] >= 1
        name = pool.vm_name(vm.id)
        assert vm.exec(COUNTER).exit_code == 0
        vm.write_file("/root/kept", b"across sleep")
        assert lib.wait_for(lambda: vm.exec("cat /tmp/c 2>/dev/null").stdout.strip(), 10, 0.1)
        assert vm.sleep().info.state == "sleeping"
        assert not qemu_pids(name), "a sleeping VM's QEMU still runs"
        assert vm.wake().info.state == "running"
        # The woken VM is a QEMU named after the sandbox, from the state the claimed one saved.
        assert len(qemu_pids(vm.id)) == 1
        assert vm.read_file("/root/kept") == b"across sleep"
        c0 = int(vm.exec("cat /tmp/c").stdout)
        assert lib.wait_for(lambda: int(vm.exec("cat /tmp/c").stdout or b"0") >= c0 + 3, 10, 0.1), \
            "the counter did not run on after wake"
        (child,) = vm.fork(1)
        made.append(child)
        assert child.read_file("/root/kept") == b"across sleep"
        n0 = int(child.exec("cat /tmp/c").stdout)
        assert lib.wait_for(lambda: int(child.exec("cat /tmp/c").stdout or b"0") >= n0 + 3, 10, 0.1), \
            "the fork's counter does not run"
        assert vm.exec("echo parent").stdout == b"parent\n"
    finally:
        for sb in made:
            sb.destroy()
    assert_vm_gone(pool, vm.id, vm.id)


def test_a_restart_keeps_claimed_vms_and_ends_the_pooled_ones(pool):
    pool.wait_ready(1)
    vm = pool.create()
    try:
        name = pool.vm_name(vm.id)
        (qemu,) = qemu_pids(name)
        vm.write_file("/root/kept", b"across the restart")
        pool.wait_ready(1)
        waiting = pool.pooled_names()  # this shape's, and the other shape's of the first test
        assert waiting
        pooled_qemus = {n: qemu_pids(n) for n in waiting}
        assert all(len(p) == 1 for p in pooled_qemus.values()), pooled_qemus

        pool.agent.proc.send_signal(signal.SIGKILL)
        pool.agent.proc.wait(10)
        time.sleep(0.5)
        assert qemu_pids(name) == [qemu] and {n: qemu_pids(n) for n in waiting} == pooled_qemus, \
            "VMs stop when their agent is killed"
        pool.agent.start()
        # The claimed VM is taken back as it runs; the pooled ones (no sandbox of any record) are ended.
        assert vm.info().state == "running"
        assert vm.read_file("/root/kept") == b"across the restart"
        assert qemu_pids(name) == [qemu]
        for n in waiting:
            assert lib.wait_for(lambda: not qemu_pids(n), 10), f"the unclaimed pooled VM {n} runs on"
            assert not pool.agent.leftovers(n), pool.agent.leftovers(n)
        assert not pool.pooled_names()
        assert node_microvm(pool.agent)["pool"]["ready"] == 0
        # The restarted agent pools the shape again once it is created again.
        again = pool.create()
        try:
            assert again.exec("echo ok").stdout == b"ok\n"
            pool.wait_ready(1, timeout=120)
        finally:
            again.destroy()
    finally:
        vm.destroy()
    assert_vm_gone(pool, vm.id, name)
