#!/usr/bin/python3
"""Agent restart with lazily streamed layers: what a kill -9 and restart of dsecd costs a sandbox on EROFS-over-FUSE.

For each trial: a fresh dsecd on its own home (empty layer cache) and run dir, one container sandbox of IMAGE that
runs `python3 -c 'import json'`; then kill -9 of the agent, a restart on the same home and run dir (it takes the
layer file system over from the keeper and the sandbox over from its record), and in the same sandbox an exec that
imports modules no earlier exec read, after a `true` (its reads go to the layer file system the new agent serves,
and the chunks it lacks to the store), then the same exec again (page cache warm). Each trial also runs the same steps without the
kill and restart, for the cold exec's baseline. Prints per trial and the medians:

  fresh start         dsecd start to ready on an empty run dir
  restart+takeover    dsecd start to ready after the kill: layer file system, layer mounts and sandbox taken over
  first cold exec     the exec reading files never read before, right after the restart
  cold, no restart    the same exec on an agent that was never killed (same steps otherwise)
  warm exec           the same exec again
  keeper RSS          resident memory of dsec-layer-keeper

    DSEC_BUILD_DIR=build /usr/bin/python3 benchmarks/layer_restart.py --store /srv/dsec-store --image bookworm-python
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import pathlib
import shutil
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests" / "integration"))
import dsec_testlib as lib  # noqa: E402

COLD = "python3 -c 'import email.mime.multipart, http.client, xml.dom.minidom, sqlite3, decimal'"


def call(agent, method, target, body=None):
    return lib.http_request(agent.socket_path, method, target, json.dumps(body).encode() if body else b"",
                            timeout=120)


def run(agent, sid, shell):
    j = call(agent, "POST", f"/v1/sandboxes/{sid}/exec", {"shell": shell, "timeout": 60}).json()
    if j["exit_code"] != 0:
        raise RuntimeError(f"{shell}: {base64.b64decode(j['stderr']).decode(errors='replace')}")


def timed(f) -> float:
    t = time.monotonic()
    f()
    return time.monotonic() - t


def trial(n: int, store: str, image: str, kill: bool) -> tuple[float, float, float, float, int]:
    home = tempfile.mkdtemp(prefix="dsec-layer-restart-")
    agent = lib.Agent(home, tag=f"lr{n}{int(kill)}", extra_args=["--store", store, "--layer-mode", "lazy"])
    try:
        fresh = timed(agent.start)
        sid = call(agent, "POST", "/v1/sandboxes", {"image": image, "kind": "container", "ttl": 600,
                                                    "resources": {"cpu": 0.5, "memory": 256 << 20,
                                                                  "pids": 64}}).json()["id"]
        run(agent, sid, "python3 -c 'import json'")
        with open(os.path.join(agent.run_dir, ".layers", "keeper")) as f:
            keeper = int(f.read().split()[1])
        with open(f"/proc/{keeper}/status") as f:
            rss = int(next(line for line in f if line.startswith("VmRSS")).split()[1])
        restart = 0.0
        if kill:
            agent.proc.send_signal(signal.SIGKILL)
            agent.proc.wait()
            restart = timed(agent.start)
            if "layer file system taken over" not in agent.log_tail(20000):
                raise RuntimeError(f"the restarted agent did not take the layers over:\n{agent.log_tail()}")
        run(agent, sid, "true")  # whatever the agent's first exec costs it is paid here, not by the cold exec
        cold = timed(lambda: run(agent, sid, COLD))
        warm = timed(lambda: run(agent, sid, COLD))
        call(agent, "DELETE", f"/v1/sandboxes/{sid}")
        return fresh, restart, cold, warm, rss
    finally:
        agent.stop()
        agent.remove_husks()
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True, help="image store holding IMAGE")
    p.add_argument("--image", default="bookworm-python", help="an image with python3 (default: bookworm-python)")
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args()
    rows, baseline = [], []
    for n in range(args.trials):
        r = trial(n, args.store, args.image, kill=True)
        b = trial(n, args.store, args.image, kill=False)
        rows.append(r)
        baseline.append(b[2])
        print(f"trial {n}: fresh start {r[0] * 1000:.0f} ms, restart+takeover {r[1] * 1000:.0f} ms, "
              f"first cold exec {r[2] * 1000:.0f} ms (no restart: {b[2] * 1000:.0f} ms), warm exec "
              f"{r[3] * 1000:.0f} ms, keeper RSS {r[4]} KiB")
    for i, name in enumerate(["fresh start", "restart+takeover", "first cold exec", "warm exec"]):
        print(f"{name}: median {statistics.median(r[i] for r in rows) * 1000:.0f} ms")
    print(f"cold, no restart: median {statistics.median(baseline) * 1000:.0f} ms")
    print(f"keeper RSS: {max(r[4] for r in rows)} KiB")


if __name__ == "__main__":
    main()
