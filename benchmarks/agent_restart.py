#!/usr/bin/python3
"""Agent restart with many sandboxes: what taking N container sandboxes over costs after a kill -9 of dsecd.

For each trial: a fresh dsecd on its own home and run dir, N busybox sandboxes made in one batch request, each
running a background `sleep`; then kill -9 of the agent and a restart on the same home, run dir and cgroup subtree
(it reads every record, checks every sandbox's init through a pidfd, its start time, cgroup and network namespace,
asks it over its socket, and acquires the image's layers again). Prints per trial and the medians:

  fresh start        dsecd start to ready on an empty state directory
  restart+takeover   dsecd start to ready after the kill, N sandboxes taken over
  per sandbox        (restart+takeover - fresh start) / N
  all answer         from the restart's ready until an exec in every sandbox has answered (8 threads)
  stop               SIGTERM to exit: every sandbox destroyed (those taken over are not the agent's children)

    DSEC_BUILD_DIR=build /usr/bin/python3 benchmarks/agent_restart.py --count 1000 --trials 3

With --control-plane DSECD[,DSECD...] it measures instead what the records cost the paths that are not restarts:
p50 of create and of destroy of null sandboxes (the control plane alone: HTTP, registry, records on disk) over one
keep-alive connection, --pairs times per round, each agent binary in turn for --trials rounds (to compare builds):

    /usr/bin/python3 benchmarks/agent_restart.py --control-plane old/bin/dsecd,build/bin/dsecd --trials 3
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests" / "integration"))
import dsec_testlib as lib  # noqa: E402


def call(agent, method, target, body=None, timeout=300):
    return lib.http_request(agent.socket_path, method, target, json.dumps(body).encode() if body else b"",
                            {"Content-Type": "application/json"} if body else None, timeout=timeout)


def timed(f) -> float:
    t = time.monotonic()
    f()
    return time.monotonic() - t


def trial(n: int, count: int, home_image: str, layer_mode: str) -> dict[str, float]:
    home = tempfile.mkdtemp(prefix="dsec-agent-restart-")
    args = ["--store", os.path.join(home_image, "store"), "--layer-mode", layer_mode, "--memory-overcommit", "16"]
    agents = []

    def agent() -> lib.Agent:
        a = lib.Agent(home, tag=f"ar{n}", extra_args=args)
        agents.append(a)
        return a

    try:
        first = agent()
        fresh = timed(first.start)
        r = call(first, "POST", "/v1/sandboxes", {"image": "busybox", "count": count, "ttl": 3600,
                                                  "resources": {"memory": "32Mi", "cpu": 0.01}})
        if r.status != 201:
            raise RuntimeError(f"batch create: {r}")
        ids = [s["id"] for s in r.json()["sandboxes"]]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda sid: call(first, "POST", f"/v1/sandboxes/{sid}/exec",
                                           {"shell": "sleep 100000 >/dev/null 2>&1 &", "timeout": 30}), ids))
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()

        second = agent()
        restart = timed(second.start)
        if f"{count} sandboxes taken over, 0 failed" not in second.log_tail(100000):
            raise RuntimeError(f"not every sandbox was taken over:\n{second.log_tail()}")

        def answers(sid: str) -> None:
            r = call(second, "POST", f"/v1/sandboxes/{sid}/exec", {"shell": "true", "timeout": 30})
            if r.status != 200 or r.json()["exit_code"] != 0:
                raise RuntimeError(f"exec in {sid} after the restart: {r}")

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answer = timed(lambda: list(pool.map(answers, ids)))
        stop = timed(lambda: second.stop(timeout=600))
        left = second.leftovers()
        if left:
            raise RuntimeError("left behind:\n  " + "\n  ".join(left))
        return {"fresh start": fresh, "restart+takeover": restart, "per sandbox": (restart - fresh) / count,
                "all answer": answer, "stop": stop}
    finally:
        for a in agents:
            a.stop()
            for pid, _ in lib.processes_in_cgroup(a.cgroup_name):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            a.remove_husks()
        if agents:
            shutil.rmtree(agents[0].run_dir, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def control_plane(binary: str, image_home: str, pairs: int) -> tuple[float, float]:
    """p50 of create and of destroy of a null sandbox, in ms, on a fresh agent running `binary`."""
    home = tempfile.mkdtemp(prefix="dsec-control-plane-")
    shutil.copytree(os.path.join(image_home, "store"), os.path.join(home, "store"))
    sock = os.path.join(home, "d.sock")
    proc = subprocess.Popen([binary, "--socket", sock, "--home", home, "--run-dir", os.path.join(home, "run"),
                             "--backends", "null", "--node-id", "cp", "--cgroup-name", f"dsec-cp-{os.getpid()}"],
                            stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{binary} did not start")
            time.sleep(0.01)
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(sock)
        reader = conn.makefile("rb")

        def request(method: str, target: str, body: bytes = b"") -> tuple[int, bytes]:
            conn.sendall(f"{method} {target} HTTP/1.1\r\nHost: dsecd\r\nContent-Length: {len(body)}\r\n"
                         f"Content-Type: application/json\r\n\r\n".encode() + body)
            status, length = int(reader.readline().split()[1]), 0
            for line in iter(reader.readline, b"\r\n"):
                name, _, value = line.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            return status, reader.read(length)

        creates, destroys = [], []
        for i in range(pairs):
            body = json.dumps({"kind": "null", "image": "busybox", "request_id": f"cp-{i}",
                               "resources": {"memory": "16Mi", "cpu": 0.01}}).encode()
            t0 = time.perf_counter()
            status, answer = request("POST", "/v1/sandboxes", body)
            t1 = time.perf_counter()
            if status != 201:
                raise RuntimeError(f"create: {status} {answer[:200]!r}")
            sid = json.loads(answer)["id"]
            t2 = time.perf_counter()
            status, answer = request("DELETE", f"/v1/sandboxes/{sid}")
            t3 = time.perf_counter()
            if status != 200:
                raise RuntimeError(f"destroy: {status} {answer[:200]!r}")
            creates.append(t1 - t0)
            destroys.append(t3 - t2)
        conn.close()
        warm = pairs // 10  # the first ones warm the agent up
        return statistics.median(creates[warm:]) * 1e3, statistics.median(destroys[warm:]) * 1e3
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=1000, help="sandboxes to take over (default 1000)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--layer-mode", default="extract", choices=["extract", "lazy", "auto"])
    p.add_argument("--control-plane", metavar="DSECD[,DSECD...]", help="measure create and destroy of null "
                   "sandboxes with these agent binaries instead")
    p.add_argument("--pairs", type=int, default=1500, help="creates and destroys per round (--control-plane)")
    o = p.parse_args()
    reason = lib.skip_reason()
    if reason:
        sys.exit(f"agent_restart: {reason}")
    image_home = tempfile.mkdtemp(prefix="dsec-agent-restart-image-")
    try:
        lib.build_busybox_image(image_home)
        if o.control_plane:
            binaries = o.control_plane.split(",")
            for n in range(o.trials):
                for binary in binaries:
                    c, d = control_plane(binary, image_home, o.pairs)
                    print(f"round {n + 1}: {binary}: null create p50 {c:.3f} ms, destroy p50 {d:.3f} ms", flush=True)
            return
        rows = []
        for n in range(o.trials):
            row = trial(n, o.count, image_home, o.layer_mode)
            rows.append(row)
            print(f"trial {n + 1}: " + ", ".join(
                f"{k} {v * 1e3:.2f} ms" if k == "per sandbox" else f"{k} {v:.2f} s" for k, v in row.items()),
                flush=True)
        print(f"median of {o.trials} ({o.count} sandboxes, layers {o.layer_mode}): " + ", ".join(
            f"{k} {statistics.median(r[k] for r in rows) * (1e3 if k == 'per sandbox' else 1):.2f}"
            f"{' ms' if k == 'per sandbox' else ' s'}" for k in rows[0]))
    finally:
        shutil.rmtree(image_home, ignore_errors=True)


if __name__ == "__main__":
    main()
