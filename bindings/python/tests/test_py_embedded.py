"""dsec.Client() with no endpoints: the private agent it starts, finds, stops, and the ways that can go wrong."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import dsec
from binding_testlib import make_home, tool


def agent_pids(socket_path: str) -> list[int]:
    """Processes whose command line names this socket (the embedded dsecd)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if socket_path.encode() in argv and state != "Z":
            pids.append(int(entry))
    return pids


def wait_gone(socket_path: str, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not agent_pids(socket_path):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def home(short_tmp):
    return make_home(os.path.join(short_tmp, "embedded-home"))


def test_embedded_agent_starts_serves_and_stops(home):
    tool("dsecd")
    c = dsec.Client(home=home, agent_args=["--backends", "null"])
    ep = c.endpoint
    assert ep.startswith("unix:") and ep.endswith("/dsecd.sock")
    sock = ep[len("unix:"):]
    assert os.path.exists(sock)
    assert len(agent_pids(sock)) == 1
    sb = c.create(image="busybox", kind="null", cpu=0.1)
    assert sb.info().state == "running"
    c.close()
    assert not agent_pids(sock), "the embedded agent outlived close()"
    assert not os.path.exists(os.path.dirname(sock)), "the private directory was left behind"
    with pytest.raises(dsec.FailedPrecondition):
        sb.info()


def test_explicit_agent_binary_is_used(home):
    with dsec.Client(agent=tool("dsecd"), home=home, agent_args=["--backends", "null"]) as c:
        assert c.nodes()[0].backends == ["null"]


def test_dsec_agent_env_is_used(home, monkeypatch):
    monkeypatch.setenv("DSEC_AGENT", tool("dsecd"))
    monkeypatch.setenv("DSEC_HOME", home)
    with dsec.Client(agent_args=["--backends", "null"]) as c:
        assert "busybox:latest" in c.nodes()[0].images


def test_missing_agent_binary_is_not_found(tmp_path, monkeypatch):
    with pytest.raises(dsec.NotFound) as info:
        dsec.Client(agent=str(tmp_path / "no-dsecd"))
    assert "no-dsecd" in str(info.value)
    monkeypatch.setenv("DSEC_AGENT", str(tmp_path / "nope"))
    with pytest.raises(dsec.NotFound) as info:
        dsec.Client()
    assert "DSEC_AGENT" in str(info.value)


def test_agent_that_dies_at_start_reports_its_log(tmp_path):
    fake = tmp_path / "dsecd"
    fake.write_text("#!/bin/sh\necho \"dsecd: cannot open the image store: disk on fire\" >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(dsec.FailedPrecondition) as info:
        dsec.Client(agent=str(fake))
    msg = str(info.value)
    assert "disk on fire" in msg and "status 3" in msg, msg


def test_agent_that_never_gets_ready_times_out(tmp_path):
    fake = tmp_path / "dsecd"
    fake.write_text("#!/bin/sh\necho starting >&2\nexec sleep 30\n")
    fake.chmod(0o755)
    start = time.monotonic()
    with pytest.raises(dsec.DeadlineExceeded) as info:
        dsec.Client(agent=str(fake), agent_start_timeout=0.5, agent_stop_grace=1.0)
    assert time.monotonic() - start < 5
    assert "starting" in str(info.value)


def test_agent_bad_flags_fail_clearly(home):
    with pytest.raises(dsec.FailedPrecondition) as info:
        dsec.Client(home=home, agent_args=["--backends", "no-such-backend"])
    assert "no-such-backend" in str(info.value)


def test_agent_dies_with_the_trainer(home, tmp_path):
    # A trainer killed with SIGKILL gets no chance to stop its agent: PR_SET_PDEATHSIG must.
    script = textwrap.dedent(f"""
        import sys, threading, time
        import dsec
        box = {{}}
        def start():  # from a thread that ends at once: the agent must outlive it
            box["c"] = dsec.Client(home={home!r}, agent_args=["--backends", "null"])
        t = threading.Thread(target=start); t.start(); t.join()
        c = box["c"]
        c.create(image="busybox", kind="null", cpu=0.1)
        print(c.endpoint, flush=True)
        time.sleep(60)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    try:
        line = trainer.stdout.readline().strip()
        assert line.startswith("unix:"), line
        sock = line[len("unix:"):]
        time.sleep(0.3)
        assert len(agent_pids(sock)) == 1, "the agent died with the thread that started it"
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        assert wait_gone(sock), "the embedded agent outlived its trainer"
        # Nobody was left to remove the dead trainer's private directory: the next embedded client does.
        private_dir = os.path.dirname(sock)
        assert os.path.basename(private_dir).startswith(f"dsec-client-{trainer.pid}-")
        with dsec.Client(home=home, agent_args=["--backends", "null"]) as c:
            assert not os.path.exists(private_dir), os.listdir(private_dir)
            assert c.endpoint != line
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


def test_a_crashed_agent_is_reported(home):
    c = dsec.Client(home=home, agent_args=["--backends", "null"])
    sock = c.endpoint[len("unix:"):]
    (pid,) = agent_pids(sock)
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.3)
    with pytest.raises(dsec.Unavailable) as info:
        c.nodes()
    assert "SIGKILL" in str(info.value)
    c.close()
    # What the killed agent left mounted (its layer file system) goes with its private directory.
    private_dir = os.path.dirname(sock)
    assert not os.path.exists(private_dir), os.listdir(private_dir)


def test_forked_child_leaves_the_agent_alone(home):
    c = dsec.Client(home=home, agent_args=["--backends", "null"])
    pid = os.fork()
    if pid == 0:  # child: the client refuses to work, and dropping it must not stop the parent's agent
        code = 0
        try:
            c.nodes()
            code = 1
        except dsec.FailedPrecondition:
            pass
        except BaseException:
            code = 2
        c.close()
        del c
        import gc

        gc.collect()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert c.nodes()[0].backends == ["null"]
    c.close()


def test_agent_log_goes_where_asked(home, tmp_path, monkeypatch):
    log = tmp_path / "agent.log"
    monkeypatch.setenv("DSEC_AGENT_LOG", str(log))
    with dsec.Client(home=home, agent_args=["--backends", "null", "--node-id", "logged"]) as c:
        c.nodes()
    assert "logged" in log.read_text()  # the agent's startup line names its node
