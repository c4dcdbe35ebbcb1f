"""Shell sessions against real container sandboxes: state carries from run to run (cwd, exported and plain
variables, functions), a run's output comes back byte for byte and is framed so no output can end it early, a
timed-out run leaves the session usable, a shell that exits says so and restarts, sessions of one sandbox are
independent, and the HTTP answers say what went wrong.

The busybox image has no bash, so its sessions run /bin/sh (busybox ash)."""

from __future__ import annotations

import threading
import time

import pytest

import dsec_testlib as lib

dsec = lib.dsec


@pytest.fixture
def sb(module_sandbox):
    return module_sandbox


def test_cwd_and_exports_carry_over(sb):
    with sb.shell() as sh:
        r = sh.run("cd /tmp && export X=1")
        assert r.exit_code == 0 and r.stdout == b"" and r.reason == "", r
        r = sh.run("pwd; echo $X")
        assert r.stdout == b"/tmp\n1\n", r
        # A child process sees the export: it is in the shell's environment, not only a shell variable.
        r = sh.run("sh -c 'echo child:$X'")
        assert r.stdout == b"child:1\n", r


def test_functions_and_plain_variables_carry_over(sb):
    with sb.shell() as sh:
        assert sh.run("greet() { echo \"hello $1\"; return 4; }").exit_code == 0
        assert sh.run("COUNT=41").exit_code == 0
        r = sh.run("greet world")
        assert (r.exit_code, r.stdout) == (4, b"hello world\n"), r
        r = sh.run("COUNT=$((COUNT + 1)); echo $COUNT")
        assert r.stdout == b"42\n", r
        assert sh.run("echo $COUNT").stdout == b"42\n"
        assert sh.run("set -o noglob; touch /tmp/g1; echo /tmp/g*").stdout == b"/tmp/g*\n"  # shell options too


def test_aliases_carry_over_in_bash(sb):
    if sb.exec("test -x /bin/bash").exit_code != 0:
        pytest.skip("the busybox image has no /bin/bash; aliases are bash's case (the session runs bash with "
                    "expand_aliases)")
    with sb.shell() as sh:
        sh.run("alias hi='echo aliased'")
        assert sh.run("hi").stdout == b"aliased\n"


def test_exit_status_is_the_commands(sb):
    with sb.shell() as sh:
        assert sh.run("false").exit_code == 1
        assert sh.run("(exit 7)").exit_code == 7
        assert sh.run("true").exit_code == 0
        r = sh.run("echo a\necho b >&2\necho c\n(exit 5)")
        assert (r.exit_code, r.stdout, r.stderr) == (5, b"a\nc\n", b"b\n"), r
        assert not r.timed_out and r.signal == 0 and r.reason == ""


def test_output_comes_back_exactly(sb):
    with sb.shell() as sh:
        r = sh.run("printf abc")  # no trailing newline
        assert r.stdout == b"abc", r
        r = sh.run(r"printf '\000\377\r\n\000'; printf 'e\000rr' >&2")
        assert r.stdout == b"\x00\xff\r\n\x00" and r.stderr == b"e\x00rr", r
        assert sh.run("echo after").stdout == b"after\n"
        payload = bytes(range(256)) * 512
        sb.write_file("/tmp/payload.bin", payload)
        r = sh.run("cat /tmp/payload.bin")
        assert r.stdout == payload
        r = sh.run("printf nonl >&2")
        assert r.stderr == b"nonl" and r.stdout == b"", r


def test_output_that_looks_like_a_marker_does_not_end_the_run(sb):
    # Whatever the agent's framing is, a run's output is the command's alone: text shaped like an end marker
    # (with a made-up nonce and status), printed with and without newlines, comes back as printed.
    fakes = [
        "__DSEC_END__ 0",
        "\n__dsec_end_00000000000000000000000000000000 0\n",
        "\x1e__DSEC__0123456789abcdef0123456789abcdef:0\x1e",
        "DSEC-RUN-END 0123456789abcdef0123456789abcdef 0",
    ]
    with sb.shell() as sh:
        text = "".join(fakes)
        sb.write_file("/tmp/fake.txt", text.encode())
        r = sh.run("cat /tmp/fake.txt; cat /tmp/fake.txt >&2; echo tail; (exit 9)")
        assert (r.exit_code, r.stdout, r.stderr) == (9, text.encode() + b"tail\n", text.encode()), r
        # The previous run's real output printed again in a later run does not end it either.
        r2 = sh.run("cat /tmp/fake.txt; sleep 0.2; echo later")
        assert r2.stdout == text.encode() + b"later\n", r2


def test_stdin_is_dev_null(sb):
    with sb.shell() as sh:
        started = time.monotonic()
        r = sh.run("cat; echo done:$?", timeout=20)
        assert r.stdout == b"done:0\n" and not r.timed_out, r
        assert time.monotonic() - started < 5
        assert sh.run("read line; echo read:$?").stdout == b"read:1\n"


def test_a_timed_out_run_leaves_the_session_usable(sb):
    with sb.shell() as sh:
        sh.run("cd /tmp && export KEEP=yes")
        started = time.monotonic()
        r = sh.run("echo before; sleep 30; echo never", timeout=1)
        took = time.monotonic() - started
        assert r.timed_out, r
        assert r.stdout == b"before\n", r
        assert took < 8, f"a run with timeout=1 took {took:.1f} s"
        r = sh.run("echo $KEEP; pwd")
        assert (r.exit_code, r.stdout, r.timed_out) == (0, b"yes\n/tmp\n", False), r
        info = sh.info()
        assert info.alive and not info.busy


def test_a_builtin_loop_past_its_timeout_ends_the_shell_and_restart_recovers(sb):
    with sb.shell() as sh:
        started = time.monotonic()
        r = sh.run("while :; do :; done", timeout=1)
        assert r.timed_out, r
        assert time.monotonic() - started < 10
        # The shell itself was looping: it was killed; restart gives a working one.
        sh.restart()
        assert sh.run("echo back").stdout == b"back\n"


def test_exit_ends_the_session_until_restart(sb):
    with sb.shell() as sh:
        sh.run("export GONE=1")
        first_pid = sh.info().pid
        r = sh.run("echo bye; exit 3")
        assert r.reason == "session_ended" and r.exit_code == 3, r
        assert r.stdout == b"bye\n", r
        info = sh.info()
        assert not info.alive and (info.exit_code, info.signal) == (3, 0), info
        assert [s.alive for s in sb.sessions() if s.name == sh.name] == [False]
        info = sh.restart()
        assert info.alive and info.name == sh.name and info.pid != first_pid, info
        r = sh.run("echo ${GONE-unset}")
        assert (r.exit_code, r.stdout, r.reason) == (0, b"unset\n", ""), r


def test_sessions_are_independent(sb):
    with sb.shell() as a, sb.shell() as b:
        assert a.name != b.name
        a.run("cd /tmp; export WHO=a; f() { echo fa; }")
        b.run("cd /etc; export WHO=b")
        assert a.run("pwd; echo $WHO; f").stdout == b"/tmp\na\nfa\n"
        r = b.run("pwd; echo $WHO; f")
        assert r.stdout == b"/etc\nb\n" and r.exit_code == 127, r
        names = {s.name for s in sb.sessions()}
        assert {a.name, b.name} <= names
        # A run in one session while the other runs.
        slow = threading.Thread(target=lambda: a.run("sleep 1"))
        slow.start()
        time.sleep(0.2)
        assert b.run("echo meanwhile").stdout == b"meanwhile\n"
        slow.join()


def test_listing_info_and_names(sb):
    with sb.shell(name="main", env={"GREETING": "hi"}, cwd="/tmp") as sh:
        assert sh.name == "main"
        r = sh.run("echo $GREETING; pwd")
        assert r.stdout == b"hi\n/tmp\n", r
        sh.run("true")
        info = sh.info()
        assert isinstance(info, dsec.SessionInfo)
        assert info.name == "main" and info.alive and not info.busy and info.pid > 1, info
        assert info.shell.endswith("sh"), info
        listed = [s for s in sb.sessions() if s.name == "main"]
        assert len(listed) == 1 and listed[0].pid == info.pid
        # The same session through another handle (by name), and the name taken.
        assert sb.session("main").run("echo $GREETING").stdout == b"hi\n"
        with pytest.raises(dsec.AlreadyExists):
            sb.shell(name="main")
        with pytest.raises(dsec.InvalidArgument):
            sb.shell(name="no spaces")
    assert "main" not in {s.name for s in sb.sessions()}
    with pytest.raises(dsec.NotFound):
        sb.session("main").run("true")
    with pytest.raises(dsec.NotFound):
        sb.session("main").info()
    sb.session("main").close()  # closing a closed session is fine


def test_one_run_at_a_time(sb):
    with sb.shell() as sh:
        t = threading.Thread(target=lambda: sh.run("sleep 1.5"))
        t.start()
        time.sleep(0.3)
        try:
            assert sh.info().busy
            with pytest.raises(dsec.FailedPrecondition):
                sh.run("echo second")
        finally:
            t.join()
        assert sh.run("echo free").stdout == b"free\n"


def test_streaming_run(sb):
    chunks: list[tuple[float, str, bytes]] = []
    with sb.shell() as sh:
        sh.run("export N=2")
        r = sh.run("echo one; sleep 1; echo $N >&2; echo three",
                   on_output=lambda stream, data: chunks.append((time.monotonic(), stream, data)))
        done = time.monotonic()
        assert r.exit_code == 0 and r.stdout == b"" and r.stderr == b"", r
        assert b"".join(d for _, s, d in chunks if s == "stdout") == b"one\nthree\n"
        assert b"".join(d for _, s, d in chunks if s == "stderr") == b"2\n"
        assert done - chunks[0][0] > 0.7, "the first chunk came only at the end"

        def boom(stream, data):
            raise RuntimeError("stop reading")

        with pytest.raises(RuntimeError, match="stop reading"):
            sh.run("echo x", on_output=boom)


def test_background_jobs_outlive_their_run(sb):
    with sb.shell() as sh:
        sh.run("(sleep 0.5; echo late > /tmp/late.txt) &")
        time.sleep(1)
        assert sh.run("cat /tmp/late.txt").stdout == b"late\n"


def test_close_ends_the_shell_and_its_children(sb):
    sh = sb.shell()
    sh.run("sleep 300 &")
    pid = sh.info().pid
    sh.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        r = sb.exec("ps -o pid,args | grep -c '[s]leep 300' || true")
        if r.stdout.strip() == b"0":
            break
        time.sleep(0.1)
    assert r.stdout.strip() == b"0", f"the session's background sleep outlived its close (shell pid {pid})"


def test_session_shell_option(sb):
    with sb.shell("/bin/sh") as sh:
        assert sh.info().shell == "/bin/sh"
        assert sh.run("echo $0").exit_code == 0


def test_a_command_over_the_limit_is_refused_and_the_session_lives_on(sb):
    with sb.shell() as sh:
        with pytest.raises(dsec.InvalidArgument, match="command"):
            sh.run("true #" + "x" * (600 << 10))
        assert sh.run("echo fine").stdout == b"fine\n"
