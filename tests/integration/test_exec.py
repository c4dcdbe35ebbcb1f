"""exec against real container sandboxes: exit codes, signals, bytes, stdin, env, cwd, argv vs shell, concurrency,
state that persists between execs, output caps and timeouts."""

from __future__ import annotations

import os
import signal
import threading
import time

import dsec_testlib as lib

dsec = lib.dsec


def test_exit_codes(sandbox):
    for code in (0, 1, 42, 255):
        r = sandbox.exec(f"exit {code}")
        assert r.exit_code == code, r
        assert r.signal == 0 and not r.timed_out
    assert sandbox.exec(["true"]).exit_code == 0
    assert sandbox.exec(["false"]).exit_code == 1


def test_signal_ends_command(sandbox):
    r = sandbox.exec("kill -TERM $$; sleep 5")
    assert r.signal == signal.SIGTERM, r
    assert r.exit_code == -1
    assert not r.timed_out
    r = sandbox.exec("kill -KILL $$")
    assert r.signal == signal.SIGKILL, r


def test_commands_start_with_default_signal_state(sandbox):
    # Nothing of the agent's own signal handling (it blocks SIGTERM and SIGINT to sigwait for them) may leak into the
    # commands: a command must be killable by `kill`, `timeout` and its own children.
    r = sandbox.exec(["grep", "-E", "^Sig(Blk|Ign):", "/proc/self/status"])
    assert r.stdout == b"SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n", r.stdout
    r = sandbox.exec("timeout -s TERM 1 sleep 20; echo $?", timeout=15)
    assert r.stdout.strip() == b"143" and not r.timed_out, r


def test_stdout_stderr_are_separate_bytes(sandbox):
    r = sandbox.exec("printf 'out\\n'; printf 'err\\n' >&2; printf 'more out'")
    assert r.stdout == b"out\nmore out"
    assert r.stderr == b"err\n"
    assert isinstance(r.stdout, bytes) and isinstance(r.stderr, bytes)
    assert r.duration > 0


def test_binary_output_round_trips(sandbox):
    payload = bytes(range(256)) * 64
    sandbox.write_file("/tmp/bin.dat", payload)
    r = sandbox.exec(["cat", "/tmp/bin.dat"])
    assert r.exit_code == 0
    assert r.stdout == payload
    r = sandbox.exec("cat /tmp/bin.dat >&2")
    assert r.stderr == payload and r.stdout == b""


def test_stdin_is_fed_then_closed(sandbox):
    data = os.urandom(3 << 20) + b"\x00end"
    r = sandbox.exec(["cat"], stdin=data)
    assert r.exit_code == 0
    assert r.stdout == data
    r = sandbox.exec(["wc", "-c"], stdin=b"12345")
    assert r.stdout.strip() == b"5"
    # No stdin: reading it sees end of file at once instead of hanging.
    r = sandbox.exec(["cat"], timeout=10)
    assert r.exit_code == 0 and r.stdout == b"" and not r.timed_out
    # A command that ignores its stdin does not block the exec.
    r = sandbox.exec("true", stdin=os.urandom(1 << 20), timeout=10)
    assert r.exit_code == 0 and not r.timed_out


def test_env_precedence(client, agent):
    with client.create(image="busybox", ttl=300, env={"A": "spec", "B": "spec"}) as sb:
        r = sb.exec('echo "$A $B $C"', env={"B": "exec", "C": "exec"})
        assert r.stdout == b"spec exec exec\n"
        r = sb.exec('echo "$A $B ${C-unset}"')
        assert r.stdout == b"spec spec unset\n"
        r = sb.exec('echo "$HOME|$PATH"')
        home, path = r.stdout.decode().strip().split("|")
        assert home == "/root"
        assert "/bin" in path.split(":")
        # The request's env overrides the defaults too.
        assert sb.exec('echo "$HOME"', env={"HOME": "/tmp"}).stdout == b"/tmp\n"


def test_cwd(client):
    with client.create(image="busybox", ttl=300, workdir="/tmp") as sb:
        assert sb.exec(["pwd"]).stdout == b"/tmp\n"
        assert sb.exec(["pwd"], cwd="/etc").stdout == b"/etc\n"
        sb.exec("mkdir -p /work/sub")
        assert sb.exec("pwd", cwd="/work/sub").stdout == b"/work/sub\n"


def test_argv_is_not_a_shell(sandbox):
    r = sandbox.exec(["echo", "$HOME", "a;b", "*"])
    assert r.stdout == b"$HOME a;b *\n"
    r = sandbox.exec("echo $HOME")
    assert r.stdout == b"/root\n"
    r = sandbox.exec(["sh", "-c", 'printf "%s|" "$@"', "argv0", "a b", "", "c"])
    assert r.stdout == b"a b||c|"
    # argv[0] is looked up on PATH.
    assert sandbox.exec(["busybox", "echo", "ok"]).stdout == b"ok\n"


def test_shell_command_not_found_is_a_result(sandbox):
    r = sandbox.exec("no-such-command-xyz")
    assert r.exit_code == 127
    assert b"not found" in r.stderr


def test_concurrent_execs_in_one_sandbox(sandbox):
    results = {}
    errors = []

    def run(i):
        try:
            results[i] = sandbox.exec(f"sleep 1; echo {i}; echo e{i} >&2")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    elapsed = time.monotonic() - start
    assert not errors, errors
    assert sorted(results) == list(range(8))
    for i, r in results.items():
        assert r.exit_code == 0 and r.stdout == f"{i}\n".encode() and r.stderr == f"e{i}\n".encode(), r
    # They ran at once, not one after another (8 x 1 s).
    assert elapsed < 5, f"8 concurrent 1 s execs took {elapsed:.1f}s"


def test_state_persists_between_execs(sandbox):
    assert sandbox.exec("echo hello > /root/state.txt").exit_code == 0
    assert sandbox.exec("cat /root/state.txt").stdout == b"hello\n"
    assert sandbox.read_file("/root/state.txt") == b"hello\n"
    # A background process started by one exec is still there for the next; the first exec does not wait for it.
    start = time.monotonic()
    r = sandbox.exec("sleep 777 >/dev/null 2>&1 &", timeout=30)
    assert r.exit_code == 0 and time.monotonic() - start < 5
    r = sandbox.exec("ps -o pid,args")
    assert b"sleep 777" in r.stdout, r.stdout
    # One that keeps the output pipes open does not hold the exec either.
    start = time.monotonic()
    r = sandbox.exec("sleep 778 & echo started", timeout=30)
    assert r.stdout == b"started\n" and not r.timed_out
    assert time.monotonic() - start < 5
    assert b"sleep 778" in sandbox.exec("ps -o args").stdout


def test_output_cap_truncates(sandbox):
    r = sandbox.exec("head -c 100000 /dev/zero; head -c 50000 /dev/zero >&2", max_output=1000)
    assert r.exit_code == 0
    assert len(r.stdout) == 1000 and r.stdout_truncated
    assert len(r.stderr) == 1000 and r.stderr_truncated
    r = sandbox.exec("head -c 1000 /dev/zero", max_output=1000)
    assert len(r.stdout) == 1000 and not r.stdout_truncated
    # A command that writes far more than the cap still runs to its end and reports its own exit code.
    r = sandbox.exec("yes | head -c 50000000; exit 7", max_output=4096, timeout=60)
    assert r.exit_code == 7 and len(r.stdout) == 4096 and r.stdout_truncated


def test_timeout_returns_near_the_deadline(sandbox):
    start = time.monotonic()
    r = sandbox.exec("echo before; sleep 30", timeout=1.0)
    elapsed = time.monotonic() - start
    assert r.timed_out, r
    assert 0.9 <= elapsed < 4, f"timeout 1 s returned after {elapsed:.2f}s"
    assert r.stdout == b"before\n"
    assert not r.ok
    # The sandbox is fine afterwards.
    assert sandbox.exec("echo after").stdout == b"after\n"


def test_timed_out_exec_leaves_no_process(sandbox):
    r = sandbox.exec("sleep 1001 & sleep 1002", timeout=1)
    assert r.timed_out
    ps = sandbox.exec("ps -o args").stdout
    assert b"sleep 100" not in ps, ps


def test_timed_out_exec_kills_setsid_children(sandbox):
    # setsid'd and double-forked children leave the exec's session and process group; they are killed anyway.
    r = sandbox.exec("setsid sleep 1003 & (setsid sh -c 'sleep 1004 & sleep 1005' &) ; sleep 1006", timeout=1.5)
    assert r.timed_out
    ps = lib.wait_for(lambda: b"sleep 100" not in sandbox.exec("ps -o args").stdout, 3)
    assert ps, sandbox.exec("ps -o pid,args").stdout
    # Processes started in the background by an earlier, finished exec are not touched by a later timeout.
    sandbox.exec("sleep 1007 >/dev/null 2>&1 &")
    assert sandbox.exec("sleep 30", timeout=0.5).timed_out
    assert b"sleep 1007" in sandbox.exec("ps -o args").stdout
