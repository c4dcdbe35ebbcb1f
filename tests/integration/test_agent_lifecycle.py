"""An agent's own life: shutdown with work in flight, and a restart after a crash. Each test runs its own dsecd (own
home, socket, run dir and cgroup subtree), never the session's."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time

import pytest

import dsec_testlib as lib

dsec = lib.dsec


@pytest.fixture
def own_home():
    home = tempfile.mkdtemp(prefix="dsec-it-home-")
    lib.build_busybox_image(home)
    yield home
    shutil.rmtree(home, ignore_errors=True)


def _records(home: str) -> list[str]:
    d = os.path.join(home, "state", "sandboxes")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def test_sigterm_with_work_in_flight(own_home):
    a = lib.Agent(own_home, tag="term")
    a.start()
    try:
        client = dsec.Client(endpoints=[a.endpoint], max_attempts=1)
        sbs = [client.create(image="busybox", ttl=300) for _ in range(3)]
        for sb in sbs:
            sb.exec("sleep 1000 >/dev/null 2>&1 & setsid sleep 1001 >/dev/null 2>&1 &")
        outcome = {}

        def run():
            try:
                outcome["result"] = sbs[0].exec("sleep 60", timeout=90)
            except dsec.DsecError as e:
                outcome["error"] = e

        t = threading.Thread(target=run)
        t.start()
        time.sleep(0.5)
        start = time.monotonic()
        status = a.stop(timeout=30)
        took = time.monotonic() - start
        t.join(30)
        assert status == 0, f"dsecd exited with {status}:\n{a.log_tail()}"
        assert took < 15, f"SIGTERM took {took:.1f}s with an exec running"
        assert not t.is_alive(), "an exec in flight did not return when its agent stopped"
        if "result" in outcome:
            assert outcome["result"].duration < 30, outcome["result"]
        problems = a.leftovers()
        assert not os.path.exists(a.socket_path), "socket file left"
        assert not problems, "\n".join(problems)
        assert _records(own_home) == []
        client.close()
    finally:
        a.stop()
        a.remove_husks()


def test_restart_after_crash_leaves_nothing_behind(own_home):
    crashed = lib.Agent(own_home, tag="crash")
    crashed.start()
    try:
        client = dsec.Client(endpoints=[crashed.endpoint], max_attempts=1)
        sbs = [client.create(image="busybox", ttl=300) for _ in range(2)]
        for sb in sbs:
            sb.exec("sleep 1000 >/dev/null 2>&1 &")
        client.close()
        crashed.proc.send_signal(signal.SIGKILL)
        crashed.proc.wait()

        # A new agent on the same home, run dir and cgroup subtree takes over the node.
        restarted = lib.Agent(own_home, tag="crash")
        restarted.start()
        try:
            client = dsec.Client(endpoints=[restarted.endpoint])
            # It serves, and nothing of the crashed agent's sandboxes keeps running unaccounted for.
            with client.create(image="busybox", ttl=300) as sb:
                assert sb.exec("echo fresh").stdout == b"fresh\n"
            known = {i.id for i in client.list()}
            for old in sbs:
                if old.id in known:
                    continue  # taken over: it must then still work
                pids = [p for p, comm in lib.processes_in_cgroup(f"{restarted.cgroup_name}/{old.id}")]
                assert not pids, f"crashed agent's sandbox {old.id} still runs processes {pids} nobody manages"
            for sb in client.list():
                client.attach(sb.id).destroy()
            client.close()
        finally:
            status = restarted.stop()
        assert status == 0
        problems = restarted.leftovers()
        assert not problems, "after crash, restart and stop:\n  " + "\n  ".join(problems)
        assert _records(own_home) == [], f"sandbox records of the crashed agent left: {_records(own_home)}"
    finally:
        crashed.stop()
        for pid, _ in lib.processes_in_cgroup(crashed.cgroup_name):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        crashed.remove_husks()
        shutil.rmtree(crashed.run_dir, ignore_errors=True)
