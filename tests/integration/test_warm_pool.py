"""Warm pools of container sandboxes (dsecd --warm-pool, docs/qos.md).

The module's dsecd keeps 3 busybox sandboxes (0.5 cores, 64 MiB) started ahead of creates. Checked: the pool fills
and reports itself; a create of that shape claims one and gets what a cold create gets (its id as hostname and in
its run directory and cgroups, its env and limits, a fresh writable layer, the same mounts, capabilities and
seccomp); a create of another shape is made cold and is no miss; a pulse larger than the pool takes the pool and
makes the rest, and the pool refills; a claimed sandbox is taken over by the next agent after a kill -9 and the
pool's unclaimed ones are removed; a pool that cannot exist stops the start with why."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

import pytest

import dsec_testlib as lib

dsec = lib.dsec

SHAPE = dict(cpu=0.5, memory="64Mi")
POOL = "busybox,size=3,cpu=0.5,memory=64Mi"


@pytest.fixture(scope="module")
def pool_home(image_home):
    home = tempfile.mkdtemp(prefix="dsec-it-warm-")
    yield home
    shutil.rmtree(home, ignore_errors=True)


def start(home: str, image_home: str, tag: str = "warm", *args: str) -> lib.Agent:
    return lib.Agent(home, tag=tag, extra_args=["--store", os.path.join(image_home, "store"), *args]).start_or_clean()


@pytest.fixture(scope="module")
def warm_agent(pool_home, image_home):
    a = start(pool_home, image_home, "warm", "--warm-pool", POOL)
    yield a
    a.stop_and_check()


@pytest.fixture(scope="module")
def wclient(warm_agent):
    c = dsec.Client(endpoints=[warm_agent.endpoint])
    yield c
    c.close()


def node(c):
    return c.nodes()[0]


def wait_full(c, timeout: float = 60) -> None:
    assert lib.wait_for(lambda: node(c).warm_pool_ready == 3, timeout, interval=0.1), node(c).warm_pool_ready


def fingerprint(sb) -> dict:
    """What a sandbox looks like from inside, with its own id taken out."""
    def sh(cmd: str) -> str:
        r = sb.exec(cmd)
        assert r.exit_code == 0, (cmd, r)
        return r.stdout.decode().replace(sb.id, "<id>")
    return {
        "hostname": sh("hostname"),
        "env": sh("echo $TASK"),
        "ids": sh("id"),
        "status": sh("grep -E '^(Cap|NoNewPrivs|Seccomp)' /proc/self/status"),
        "limits": sh("cat /proc/self/limits"),
        "mounts": sh("awk '{print $5, $9}' /proc/self/mountinfo"),
        "tmp": sh("ls -A /tmp /root"),
        # Counted by the shell alone: a pipeline's own processes come and go while ls reads /proc.
        "procs": sh("set -- /proc/[0-9]*; echo $#"),
    }


def test_a_create_of_the_pools_shape_claims_one_like_a_cold_create(warm_agent, wclient):
    wait_full(wclient)
    before = node(wclient)
    assert before.warm_pool_size == 3 and before.warm_pool_ready == 3
    t0 = time.monotonic()
    warm = wclient.create("busybox", env={"TASK": "t-17"}, ttl=300, **SHAPE)
    took = (time.monotonic() - t0) * 1000
    after = node(wclient)
    assert after.warm_pool_claims == before.warm_pool_claims + 1
    cold = wclient.create("busybox", env={"TASK": "t-17"}, ttl=300, cpu=0.5, memory="65Mi")
    try:
        assert node(wclient).warm_pool_claims == after.warm_pool_claims  # another shape: made cold
        assert node(wclient).warm_pool_misses == after.warm_pool_misses  # and no miss
        print(f"\nclaimed create: {took:.2f} ms (client round trip)")
        w, c = fingerprint(warm), fingerprint(cold)
        assert w["hostname"] == "<id>\n", w["hostname"]
        assert w == c
        # Its names on the host are its id's.
        assert os.path.isdir(os.path.join(warm_agent.run_dir, warm.id))
        assert len([d for d in os.listdir(warm_agent.run_dir) if d.startswith("w-")]) <= 3
        mem = warm_agent.cgroup_dir("memory", warm.id)
        if os.path.exists(os.path.join(mem, "memory.limit_in_bytes")):  # v1 renames groups; v2 cannot
            assert int(open(os.path.join(mem, "memory.limit_in_bytes")).read()) == 64 << 20
        # A file written in one claimed sandbox is in no other.
        warm.write_file("/tmp/mark", b"x")
        other = wclient.create("busybox", ttl=300, **SHAPE)
        try:
            assert other.exec("ls -A /tmp").stdout == b""
            assert other.exec("hostname").stdout.decode().strip() == other.id
        finally:
            other.destroy()
        info = warm.info()
        assert info.resources.cpu == 0.5 and info.resources.memory_bytes == 64 << 20
    finally:
        warm.destroy()
        cold.destroy()
    wait_full(wclient)


def test_a_pulse_larger_than_the_pool_takes_it_and_makes_the_rest(wclient):
    wait_full(wclient)
    before = node(wclient)
    made = wclient.create_many(6, "busybox", ttl=300, **SHAPE)
    try:
        after = node(wclient)
        assert after.warm_pool_claims - before.warm_pool_claims == 3, after
        assert after.warm_pool_misses - before.warm_pool_misses == 3, after
        hosts = {sb.exec("hostname").stdout.decode().strip() for sb in made}
        assert hosts == {sb.id for sb in made}
    finally:
        for sb in made:
            sb.destroy()
    wait_full(wclient)


def test_a_claimed_sandbox_outlives_a_killed_agent(image_home):
    home = tempfile.mkdtemp(prefix="dsec-it-warmk-")
    try:
        a = start(home, image_home, "warmk", "--warm-pool", POOL)
        c = dsec.Client(endpoints=[a.endpoint])
        wait_full(c)
        sb = c.create("busybox", ttl=300, **SHAPE)
        assert sb.exec("echo hi > /tmp/kept").exit_code == 0
        c.close()
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)
        b = start(home, image_home, "warmk", "--warm-pool", POOL)
        try:
            c = dsec.Client(endpoints=[b.endpoint])
            try:
                again = c.attach(sb.id)
                info = again.info()
                assert info.state == "running", (info.message, b.log_tail())
                assert again.read_file("/tmp/kept") == b"hi\n"
                assert again.exec("hostname").stdout.decode().strip() == sb.id
                wait_full(c)
                # The pool's sandboxes of the killed agent were removed; the new pool's are its own.
                pre_made = [d for d in os.listdir(b.run_dir) if d.startswith("w-")]
                assert len(pre_made) == 3, pre_made
                again.destroy()
            finally:
                c.close()
        finally:
            b.stop_and_check()
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize("pool, message", [
    ("busybox", "needs size=N"),
    ("busybox,size=2,gpu=1", "unknown key 'gpu'"),
    ("busybox,size=2,priority=urgent", "priority=urgent"),
    ("nosuchimage,size=1", "nosuchimage"),
    ("busybox,size=4000,memory=64Gi", "above the node's"),
])
def test_a_pool_that_cannot_be_stops_the_start(pool_home, image_home, pool, message):
    lib.Agent(pool_home, tag="warmbad", extra_args=["--store", os.path.join(image_home, "store"),
                                                    "--warm-pool", pool]).start_refused(message)
