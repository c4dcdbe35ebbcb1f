"""The Python client driving real container sandboxes (busybox image). Skipped where the host cannot run them."""

from __future__ import annotations

import threading
import time

import pytest

import dsec


@pytest.fixture
def sb(client, container_backend):
    with client.create(image="busybox", kind="container", cpu=0.5, memory="128Mi", ttl=300,
                       env={"GREETING": "hello"}) as s:
        yield s


def test_exec_shell_and_argv(sb):
    r = sb.exec("echo hi; echo oops >&2; exit 7")
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.signal) == (7, b"hi\n", b"oops\n", False, 0)
    assert not r.ok and r.duration > 0
    r = sb.exec(["printf", "%s|", "a b", "$HOME"])  # argv: no shell expansion
    assert r.ok and r.stdout == b"a b|$HOME|"


def test_exec_env_cwd_stdin(sb):
    assert sb.exec("echo $GREETING $EXTRA", env={"EXTRA": "there"}).stdout == b"hello there\n"
    sb.exec("mkdir -p /work/sub")
    assert sb.exec("pwd", cwd="/work/sub").stdout == b"/work/sub\n"
    data = bytes(range(256)) * 64
    r = sb.exec(["cat"], stdin=data)
    assert r.ok and r.stdout == data


def test_exec_timeout_is_a_result(sb):
    start = time.monotonic()
    r = sb.exec("sleep 30", timeout=0.5)
    assert r.timed_out and not r.ok
    assert time.monotonic() - start < 10


def test_exec_output_cap(sb):
    r = sb.exec("head -c 100000 /dev/zero", max_output=1000)
    assert r.ok and len(r.stdout) == 1000 and r.stdout_truncated and not r.stderr_truncated


def test_exec_signal(sb):
    r = sb.exec("kill -9 $$")
    assert r.exit_code == -1 and r.signal == 9


def test_missing_executable_is_a_result_not_an_error(sb):
    r = sb.exec(["/no/such/binary"])
    assert (r.exit_code, r.reason, r.ok) == (127, "executable_not_found", False), r
    assert "reason='executable_not_found'" in repr(r)


def test_files_seen_by_commands(sb, tmp_path):
    sb.write_file("/work/in.txt", b"from python\n", mode=0o600)
    r = sb.exec("cat /work/in.txt; stat -c %a /work/in.txt")
    assert r.stdout == b"from python\n600\n"
    sb.exec("mkdir -p /work/out/deep && echo made > /work/out/deep/f && ln -s f /work/out/deep/l")
    assert sb.read_file("/work/out/deep/f") == b"made\n"
    sb.download("/work/out", tmp_path / "out")
    assert (tmp_path / "out" / "deep" / "f").read_bytes() == b"made\n"
    assert (tmp_path / "out" / "deep" / "l").is_symlink()
    src = tmp_path / "src"
    src.mkdir()
    (src / "script.sh").write_text("echo uploaded\n")
    sb.upload(src, "/work/up")
    assert sb.exec("sh /work/up/script.sh").stdout == b"uploaded\n"


def test_parallel_exec_runs_concurrently(sb):
    # Four one-second sleeps from four Python threads take about one second: calls release the GIL and the
    # client keeps several connections.
    results = []

    def run():
        results.append(sb.exec("sleep 1; echo done"))

    threads = [threading.Thread(target=run) for _ in range(4)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    assert [r.stdout for r in results] == [b"done\n"] * 4
    assert elapsed < 3, f"4 parallel 1 s execs took {elapsed:.1f}s"


def test_sandboxes_are_isolated(client, container_backend):
    with client.create(image="busybox") as a, client.create(image="busybox") as b:
        a.write_file("/tmp/secret", b"a's")
        assert b.exec("cat /tmp/secret").exit_code != 0
        assert a.exec("hostname").stdout.strip() != b.exec("hostname").stdout.strip()


def test_create_many_containers(client, container_backend):
    sbs = client.create_many(8, image="busybox", cpu=0.1, memory="64Mi")
    try:
        outs = {s.exec(["echo", s.id]).stdout.strip().decode() for s in sbs}
        assert outs == {s.id for s in sbs}
    finally:
        for s in sbs:
            s.destroy()


def test_destroy_while_other_threads_exec(client, container_backend):
    sb = client.create(image="busybox", cpu=0.2)
    outcomes = []
    lock = threading.Lock()

    def hammer():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                sb.exec(["true"])
            except dsec.DsecError as e:  # NotFound (gone on the agent) or FailedPrecondition (destroyed here)
                with lock:
                    outcomes.append(type(e))
                return
            except Exception as e:  # noqa: BLE001 - anything else is a bug
                with lock:
                    outcomes.append(e)
                return

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    sb.destroy()
    for t in threads:
        t.join()
    assert len(outcomes) == 4
    assert all(isinstance(o, type) and issubclass(o, dsec.DsecError) for o in outcomes), outcomes
    assert client.attach(sb.id).info().state == "destroyed"
