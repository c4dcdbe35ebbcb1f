"""Sleep and wake of container sandboxes in place: a sleeping sandbox's processes stop (a background counter does not
advance) while its files stay readable, exec is refused, its page cache is released and its cpu is free on the node;
after a wake the counter runs on from where it stopped and what was written before the sleep is intact. Errors for
the wrong state, over the Python client and over raw HTTP.

The module runs its own dsecd on a home holding "busybox" and "sleepy" (busybox plus /data/blob.bin, 48 MiB, read by
the sandbox to charge it page cache)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import time

import pytest

import dsec_testlib as lib

dsec = lib.dsec

BLOB_MIB = 48
COUNTER = "/tmp/counter"


def dsec_image(*args: str) -> None:
    r = subprocess.run([str(lib.DSEC_CLI), "image", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=180)
    if r.returncode != 0:
        raise RuntimeError(f"dsec image {' '.join(args)} failed ({r.returncode}): {r.stdout}{r.stderr}")


@pytest.fixture(scope="module")
def sleep_agent():
    home = tempfile.mkdtemp(prefix="dsec-it-sleep-")
    agent = None
    try:
        lib.build_busybox_image(home)
        tree = pathlib.Path(home) / "tree"
        (tree / "data").mkdir(parents=True)
        with open(tree / "data" / "blob.bin", "wb") as f:
            for _ in range(BLOB_MIB):
                f.write(os.urandom(1 << 20))
        dsec_image("build", "sleepy", "--from", str(tree), "--parent", "busybox", "--home", home, "-q")
        shutil.rmtree(tree)
        agent = lib.Agent(home, tag="sleep")
        agent.start()
        yield agent
    finally:
        if agent is not None:
            status = agent.stop()
            problems = agent.leftovers()
            log = agent.log_tail()
            if not problems:
                agent.remove_husks()
            shutil.rmtree(home, ignore_errors=True)
            assert status == 0, f"dsecd exited with {status}:\n{log}"
            assert not problems, "dsecd left things behind:\n  " + "\n  ".join(problems) + f"\nlog:\n{log}"
        else:
            shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def sclient(sleep_agent):
    c = dsec.Client(endpoints=[sleep_agent.endpoint])
    yield c
    c.close()


@pytest.fixture
def sb(sclient, sleep_agent):
    s = sclient.create(image="sleepy", ttl=600, memory="256Mi", pids=64, cpu=1.5)
    yield s
    s.destroy()
    problems = sleep_agent.leftovers(s.id)
    assert not problems, f"sandbox {s.id} left things behind:\n  " + "\n  ".join(problems)


def counter(s) -> int:
    return int(s.read_file(COUNTER).decode().strip() or "0")


def start_counter(s) -> None:
    s.exec(f"(i=0; while :; do i=$((i+1)); echo $i > {COUNTER}.new; mv {COUNTER}.new {COUNTER}; usleep 50000; "
           f"done) >/dev/null 2>&1 &")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if counter(s) >= 3:
                return
        except dsec.NotFound:
            pass
        time.sleep(0.05)
    raise AssertionError("the background counter did not start")


def wait_advance(s, past: int, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = counter(s)
        if n > past + 3:
            return n
        time.sleep(0.05)
    raise AssertionError(f"the counter stayed at {counter(s)} (was {past})")


def test_sleep_freezes_and_wake_resumes(sb, sclient):
    sb.write_file("/tmp/before.txt", b"written before the sleep\n")
    start_counter(sb)
    cpu_awake = sclient.nodes()[0].cpu_requested

    r = sb.sleep()
    assert r.info.state == "sleeping", r
    assert r.seconds >= 0 and r.memory_before_bytes > 0, r
    assert sb.info().state == "sleeping"
    # The sleeping sandbox's cpu is free on the node.
    assert abs(sclient.nodes()[0].cpu_requested - (cpu_awake - 1.5)) < 1e-6

    asleep_at = counter(sb)
    time.sleep(0.6)  # twelve ticks of the counter, were it running
    assert counter(sb) == asleep_at, "the counter advanced while its sandbox slept"
    # Files stay readable and writable while it sleeps.
    assert sb.read_file("/tmp/before.txt") == b"written before the sleep\n"
    sb.write_file("/tmp/while.txt", b"written while asleep")

    with pytest.raises(dsec.FailedPrecondition, match="is already sleeping"):
        sb.sleep()
    with pytest.raises(dsec.FailedPrecondition, match=f"sandbox {sb.id} is sleeping; wake it first"):
        sb.exec("true")

    w = sb.wake()
    assert w.info.state == "running", w
    assert sb.info().state == "running"
    assert abs(sclient.nodes()[0].cpu_requested - cpu_awake) < 1e-6
    n = wait_advance(sb, asleep_at)
    # It ran on from where it stopped, not from scratch.
    assert n > asleep_at
    with pytest.raises(dsec.FailedPrecondition, match="not sleeping"):
        sb.wake()
    r = sb.exec("cat /tmp/before.txt /tmp/while.txt")
    assert r.exit_code == 0 and r.stdout == b"written before the sleep\nwritten while asleep", r

    # A second round works the same.
    sb.sleep()
    at = counter(sb)
    time.sleep(0.3)
    assert counter(sb) == at
    sb.wake()
    wait_advance(sb, at)


def test_sleep_releases_page_cache(sb):
    r = sb.exec("cat /data/blob.bin > /dev/null && echo read", timeout=60)
    assert r.stdout == b"read\n", r
    s = sb.sleep()
    assert s.memory_before_bytes >= (BLOB_MIB // 2) << 20, s
    # The page cache of the file it read goes; what stays is its few processes' memory.
    assert s.memory_released_bytes >= (BLOB_MIB // 2) << 20, s
    assert s.memory_after_bytes == s.memory_before_bytes - s.memory_released_bytes
    w = sb.wake()
    assert w.memory_before_bytes < s.memory_before_bytes, w
    r = sb.exec("cat /data/blob.bin | wc -c", timeout=60)
    assert r.stdout.strip() == str(BLOB_MIB << 20).encode(), r


def test_destroy_while_sleeping(sclient, sleep_agent):
    s = sclient.create(image="busybox", ttl=600, memory="64Mi")
    s.exec("sleep 1000 >/dev/null 2>&1 &")
    s.sleep()
    sid = s.id
    s.destroy()
    assert not sleep_agent.leftovers(sid)


def test_group_sleep_and_wake(sclient):
    g = sclient.create_group(2, image="busybox", memory="64Mi", lease=60)
    try:
        rs = g.sleep()
        assert [r.info.state for r in rs] == ["sleeping", "sleeping"]
        assert all(m.info().state == "sleeping" for m in g)
        with pytest.raises(dsec.FailedPrecondition):
            g.sleep()
        rs = g.wake()
        assert [r.info.state for r in rs] == ["running", "running"]
        assert all(r.exit_code == 0 for r in g.exec("true"))
    finally:
        g.destroy()


def test_sleep_over_http(sleep_agent, sclient):
    s = sclient.create(image="busybox", ttl=600, memory="64Mi")
    try:
        path = f"/v1/sandboxes/{s.id}"
        r = lib.http_request(sleep_agent.socket_path, "GET", path + "/sleep")
        assert r.status == 501, r
        r = lib.http_request(sleep_agent.socket_path, "POST", path + "/sleep")
        assert r.status == 200, r
        body = r.json()
        assert body["state"] == "sleeping" and body["id"] == s.id
        for key in ("memory_before_bytes", "memory_after_bytes", "memory_released_bytes", "seconds"):
            assert key in body, body
        with open(os.path.join(sleep_agent.home, "state", "sandboxes", s.id + ".json")) as f:
            assert json.load(f)["info"]["state"] == "sleeping"
        r = lib.http_request(sleep_agent.socket_path, "POST", path + "/sleep")
        assert r.status == 412 and "FAILED_PRECONDITION" in r.body.decode(), r
        r = lib.http_request(sleep_agent.socket_path, "POST", path + "/wake")
        assert r.status == 200 and r.json()["state"] == "running", r
        r = lib.http_request(sleep_agent.socket_path, "POST", "/v1/sandboxes/nope/wake")
        assert r.status == 404, r
    finally:
        s.destroy()
