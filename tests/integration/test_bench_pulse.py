"""`dsec-bench pulse` end to end at a small size: it starts a private etcd and agents (null backend, then container),
a client that finds them through etcd creates one pulse, and the run reports every figure, checks the sandboxes,
and leaves nothing behind: no process, no scratch directory, no cgroup. Bad flags are usage errors."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

import cluster_lib as cl
import dsec_testlib as lib

BENCH = lib.BUILD / "bin" / "dsec-bench"

pytestmark = pytest.mark.skipif(
    lib.skip_reason() is not None or cl.etcd_skip_reason() is not None or not BENCH.exists(),
    reason=lib.skip_reason() or cl.etcd_skip_reason() or f"{BENCH} is not built")


def scratch_dirs() -> set[str]:
    return {d for d in os.listdir("/dev/shm") if d.startswith("dsec-bench-pulse-")}


def processes_with(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def pulse_cgroups(bench_pid: int) -> list[str]:
    out = []
    for root, dirs, _ in os.walk("/sys/fs/cgroup"):
        for d in dirs:
            if d.startswith(f"dsec-bench-pulse-{bench_pid}-"):
                out.append(os.path.join(root, d))
        dirs[:] = [d for d in dirs if root == "/sys/fs/cgroup" or d.startswith("dsec")]
    return out


def test_small_pulse_reports_and_leaves_nothing():
    before = scratch_dirs()
    proc = subprocess.Popen([str(BENCH), "pulse", "--sandboxes", "300", "--agents", "3", "--real-sandboxes", "6",
                             "--real-agents", "2", "--markdown"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"

    # Both pulses ran over every agent, the agents hold exactly what was asked (plus one warm-up each), every
    # container has a live process, and nothing is left after the destroy.
    assert ("null backend (control-plane simulation: nothing started): 300 sandboxes over 3 agents with create_group"
            in out)
    assert "per agent: 100 to 100 sandboxes (3 of 3 agents used); the agents report 303 live (with 3 warm-up)" in out
    assert "container backend: 6 sandboxes over 2 agents with create_group" in out
    assert "the agents report 8 live (with 2 warm-up)" in out
    assert "6 sandboxes with a live process in /proc" in out
    assert len(re.findall(r"destroy: [0-9.]+ s .*; 0 left", out)) == 2, out
    created = re.findall(r"create: ([0-9.]+) s until all acknowledged, ([0-9]+) creates/s", out)
    assert len(created) == 2 and all(float(s) > 0 and int(rate) > 0 for s, rate in created), out
    peaks = re.findall(r"client: [0-9.]+ CPU s .* peak ([0-9.]+) MiB overall", out)
    assert len(peaks) == 2 and all(float(p) > 1 for p in peaks), out
    assert "| `null` (control-plane simulation) | 300 / 3 | `create_group` |" in out
    assert "| `container` (busybox) | 6 / 2 | `create_group` |" in out
    assert "left" not in "".join(line for line in out.splitlines() if line.strip().startswith("note:")), out

    assert scratch_dirs() == before
    assert processes_with("/dev/shm/dsec-bench-pulse-") == []
    assert pulse_cgroups(proc.pid) == []


def test_create_many_pulse():
    proc = subprocess.run([str(BENCH), "pulse", "--pulse-api", "many", "--sandboxes", "50", "--agents", "2",
                           "--real-sandboxes", "0"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "50 sandboxes over 2 agents with create_many" in proc.stdout
    assert "per agent: 25 to 25 sandboxes (2 of 2 agents used); the agents report 52 live" in proc.stdout
    assert "container backend" not in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--pulse-api", "one"], "--pulse-api: 'one' is not group or many"),
    (["--agents", "0"], "--agents: '0' is not an integer >= 1"),
    (["--real-agents", "300"], "--real-agents: at most 256"),
    (["--pulse-dir", "/nonexistent/dsec-bench"], "--pulse-dir /nonexistent/dsec-bench"),
])
def test_bad_flags(args, message):
    proc = subprocess.run([str(BENCH), "pulse", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr
