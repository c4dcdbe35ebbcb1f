"""Spawned processes against real container sandboxes: output kept by the sandbox and readable from the start by
any client while the process runs and after it ended, stdin written and closed, signals, waits with and without a
timeout, start failures as results, terminals with a size, and the errors for what cannot be done."""

from __future__ import annotations

import re
import signal
import time

import pytest

import dsec_testlib as lib

dsec = lib.dsec


@pytest.fixture
def sb(module_sandbox):
    return module_sandbox


def read_until(p, pattern: bytes, timeout: float = 10) -> bytes:
    """p's stdout from the start until `pattern` (a regex) matches it; fails after `timeout` seconds."""
    seen = b""
    at = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = p.read(stdout_offset=at, wait=min(1.0, max(0.0, deadline - time.monotonic())))
        seen += out.stdout
        at = out.stdout_offset + len(out.stdout)
        if re.search(pattern, seen):
            return seen
        if not out.running and at >= out.stdout_end:
            break
    pytest.fail(f"{pattern!r} never appeared in the process's output: {seen!r}")


def test_spawn_answers_at_once_and_stdout_follows_live_output(sb):
    started = time.monotonic()
    p = sb.spawn("echo first; sleep 1; echo second", tag="live")
    assert time.monotonic() - started < 1, "spawn waited for the command"
    assert isinstance(p, dsec.Process) and p.pid > 1 and p.sandbox_id == sb.id
    chunks = []
    for chunk in p.stdout:
        chunks.append((time.monotonic(), chunk))
    assert b"".join(c for _, c in chunks) == b"first\nsecond\n"
    assert chunks[-1][0] - chunks[0][0] > 0.7, "the output came all at once, not as it was written"
    info = p.wait(timeout=10)
    assert not info.running and info.exit_code == 0 and info.signal == 0, info
    assert info.tag == "live" and info.argv and info.stdout_bytes == 13 and info.ended_at >= info.started_at > 0
    assert p.exit_code == 0


def test_argv_env_cwd_and_both_streams(sb):
    p = sb.spawn(["sh", "-c", "echo $K; pwd; echo oops >&2; exit 4"], env={"K": "V"}, cwd="/tmp")
    got = {"stdout": b"", "stderr": b""}
    for stream, data in p.output():
        got[stream] += data
    assert got == {"stdout": b"V\n/tmp\n", "stderr": b"oops\n"}
    info = p.wait(10)
    assert (info.running, info.exit_code) == (False, 4), info
    assert info.argv == ["sh", "-c", "echo $K; pwd; echo oops >&2; exit 4"]
    assert b"".join(p.stderr) == b"oops\n"


def test_stdin_writes_then_close(sb):
    p = sb.spawn(["cat"])
    assert p.info().stdin_open
    p.write_stdin(b"hello\n")
    p.write_stdin("wörld\n")  # str as UTF-8
    p.write_stdin(b"\x00\xff")
    assert read_until(p, rb"\x00\xff$") == "hello\nwörld\n".encode() + b"\x00\xff"
    assert p.exit_code is None
    p.close_stdin()
    info = p.wait(timeout=10)
    assert not info.running and info.exit_code == 0 and not info.stdin_open, info
    assert b"".join(p.stdout) == "hello\nwörld\n".encode() + b"\x00\xff"
    with pytest.raises(dsec.FailedPrecondition):
        p.write_stdin(b"too late")


def test_closed_stdin_refuses_writes_while_running(sb):
    p = sb.spawn("exec 0<&-; sleep 30")
    try:
        p.close_stdin()
        with pytest.raises(dsec.FailedPrecondition):
            p.write_stdin(b"x")
    finally:
        p.kill()


def test_stdin_of_a_finished_process_is_a_failed_precondition(sb):
    p = sb.spawn("true")
    assert p.wait(10).exit_code == 0
    with pytest.raises(dsec.FailedPrecondition):
        p.write_stdin(b"x")
    with pytest.raises(dsec.FailedPrecondition):
        p.signal("TERM")


def test_signals_by_name_and_number(sb):
    p = sb.spawn(["sleep", "30"])
    assert p.info().running
    p.signal("SIGTERM")
    info = p.wait(timeout=10)
    assert (info.running, info.exit_code, info.signal) == (False, -1, signal.SIGTERM), info

    q = sb.spawn(["sleep", "30"])
    q.signal(9)
    assert q.wait(10).signal == 9

    # group=True reaches what the process started too.
    g = sb.spawn("sleep 30 & sleep 30; wait")
    time.sleep(0.3)
    g.signal("kill", group=True)
    assert not g.wait(10).running
    deadline = time.monotonic() + 5
    while True:
        r = sb.exec("ps -o args | grep -c '^sleep 30' || true")
        if r.stdout.strip() == b"0" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.stdout.strip() == b"0", f"the group's background sleep outlived the signal: {r}"

    with pytest.raises(dsec.InvalidArgument):
        q.signal("SIGNOPE")


def test_wait_with_a_timeout_returns_a_running_info(sb):
    p = sb.spawn(["sleep", "30"])
    try:
        started = time.monotonic()
        info = p.wait(timeout=0.5)
        took = time.monotonic() - started
        assert info.running and info.exit_code == -1, info
        assert 0.4 < took < 3, f"wait(timeout=0.5) took {took:.2f} s"
        assert p.wait(timeout=0).running
        assert p.exit_code is None
    finally:
        assert p.kill().pid == p.pid


def test_output_replays_from_the_start_after_the_end(sb):
    p = sb.spawn("printf 'a\\nb'; printf 'E' >&2")
    assert p.wait(10).exit_code == 0
    for _ in range(2):  # reading does not consume
        assert b"".join(p.stdout) == b"a\nb"
        assert b"".join(p.stderr) == b"E"
    out = p.read(stdout_offset=2, stderr_offset=0)
    assert (out.stdout, out.stdout_offset, out.stdout_end, out.stderr, out.stderr_end) == (b"b", 2, 3, b"E", 1), out
    assert not out.running and out.exit_code == 0
    only_err = p.read(stderr_offset=0)
    assert only_err.stdout == b"" and only_err.stderr == b"E"


def test_only_the_last_mib_is_kept(sb):
    p = sb.spawn("head -c 3000000 /dev/zero | tr '\\0' a; echo end")
    info = p.wait(30)
    assert info.exit_code == 0 and info.stdout_bytes == 3000004, info
    first = p.read(stdout_offset=0)
    assert first.stdout_offset > 0 and first.stdout_end == 3000004, (first.stdout_offset, first.stdout_end)
    data = b"".join(p.stdout)
    assert 0 < len(data) <= 1 << 20 and data.endswith(b"aaaend\n")
    assert len(data) == 3000004 - first.stdout_offset


def test_another_client_reattaches_by_pid(sb, agent):
    p = sb.spawn("echo from-the-first; cat", tag="shared")
    other = dsec.Client(endpoints=[agent.endpoint])
    try:
        q = other.attach(sb.id).process(p.pid)
        assert q.info().tag == "shared"
        assert read_until(q, rb"from-the-first\n") == b"from-the-first\n"
        q.write_stdin(b"via the second client\n")
        q.close_stdin()
        assert q.wait(10).exit_code == 0
        assert b"".join(p.stdout) == b"from-the-first\nvia the second client\n"
    finally:
        other.close()


def test_a_missing_binary_is_a_result(sb):
    p = sb.spawn(["/no/such/binary", "x"])
    info = p.wait(10)
    assert (info.running, info.exit_code, info.reason) == (False, 127, "executable_not_found"), info
    assert b"/no/such/binary" in b"".join(p.stderr)
    p = sb.spawn(["true"], cwd="/no/such/dir")
    info = p.wait(10)
    assert (info.exit_code, info.reason) == (127, "cwd_not_found"), info


def test_pty_gives_a_terminal_with_a_size(sb):
    p = sb.spawn(["tty"], pty=True)
    assert p.wait(10).exit_code == 0
    out = b"".join(p.stdout)
    assert re.fullmatch(rb"/dev/pts/\d+\r?\n", out), out
    assert b"".join(p.stderr) == b""
    assert p.info().pty

    sh = sb.spawn(["sh"], pty=True, rows=30, cols=100)
    try:
        sh.write_stdin(b"stty size\n")
        read_until(sh, rb"30 100")
        info = sh.resize(40, 120)
        assert info.running and info.pty
        sh.write_stdin(b"stty size; echo mark$((6*7))\n")
        read_until(sh, rb"40 120\s+mark42")
        sh.write_stdin(b"exit 6\n")
        assert sh.wait(10).exit_code == 6
    finally:
        sh.kill()


def test_resize_without_a_pty_is_refused(sb):
    p = sb.spawn(["sleep", "30"])
    try:
        with pytest.raises(dsec.FailedPrecondition):
            p.resize(40, 120)
        with pytest.raises(dsec.InvalidArgument):
            p.resize(0, 80)
    finally:
        p.kill()


def test_listing_kill_and_unknown_pids(sb):
    p = sb.spawn(["sleep", "30"], tag="listed")
    listed = {i.pid: i for i in sb.processes()}
    assert p.pid in listed and listed[p.pid].tag == "listed" and listed[p.pid].running
    last = p.kill()
    assert last.pid == p.pid
    assert p.pid not in {i.pid for i in sb.processes()}
    with pytest.raises(dsec.NotFound):
        p.info()
    with pytest.raises(dsec.NotFound):
        sb.process(999999).info()
    with pytest.raises(dsec.InvalidArgument):
        sb.process(0)


def test_bad_spawns_are_refused_before_they_leave(sb):
    with pytest.raises(dsec.InvalidArgument):
        sb.spawn([])
    with pytest.raises(dsec.InvalidArgument):
        sb.spawn("true", pty=True, rows=0)
    with pytest.raises(dsec.InvalidArgument):
        sb.spawn("true", tag="t" * 129)
    with pytest.raises(dsec.InvalidArgument):
        sb.spawn("true", cwd="relative")
