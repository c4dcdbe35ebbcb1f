#!/usr/bin/python3
"""E2B's official SDK through dsec-e2b against `import dsec` on the same machine, in one run.

    /usr/bin/python3 benchmarks/e2b_sdk.py [--home DIR] [--template IMAGE] [-n 200] [--concurrency 1,2,4,8,16]
                                           [--window 5] [--markdown]

1. Create-to-first-command: create a sandbox, run `true` in it (the SDK runs it as `/bin/bash -l -c true`, so the
   dsec side runs the same argv), kill it untimed; n times after a warm-up, one at a time.
2. Creates a second in a closed loop at each concurrency: C workers each create then kill for --window seconds; a
   create counts when it completed inside the window.
3. An agent loop: in one sandbox, --steps commands, each after a think time (--think, ms): what a step costs when the
   trainer thinks between steps, not only back to back.

The SDK side is the pinned `e2b` npm package (tests/e2b/package-lock.json, installed as the tests install it, under
<build>/e2b-node) running benchmarks/e2b_sdk.mjs against a dsec-e2b gateway with an embedded agent; the dsec side is
a dsec.Client with an embedded agent of its own, started after the gateway stopped. Both use --home's images.
E2B's own cloud publishes about 150 ms per create and plan limits of 1 to 5 creates a second (the outside reference).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def percentile(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))] if s else float("nan")


def sdk_dir(build: pathlib.Path) -> pathlib.Path:
    """A directory holding node_modules/e2b as tests/e2b pins it (installed with npm ci when missing)."""
    e2b = ROOT / "tests" / "e2b"
    key = hashlib.sha256((e2b / "package.json").read_bytes() + b"\0" +
                         (e2b / "package-lock.json").read_bytes()).hexdigest()[:16]
    dest = build / "e2b-node" / key
    if not (dest / ".installed").exists():
        dest.mkdir(parents=True, exist_ok=True)
        for f in ("package.json", "package-lock.json"):
            shutil.copy(e2b / f, dest / f)
        subprocess.run(["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"], cwd=dest,
                       check=True, stdin=subprocess.DEVNULL)
        (dest / ".installed").write_text("bench\n")
    return dest


class Gateway:
    def __init__(self, build: pathlib.Path, home: str):
        self.proc = subprocess.Popen([str(build / "bin" / "dsec-e2b"), "--listen", "127.0.0.1:0", "--home", home],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("listening on "):
            self.stop()
            raise SystemExit(f"dsec-e2b did not start: {line!r}")
        self.url = "http://" + line.split()[-1]

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def run_node(script: pathlib.Path, url: str, *args: str) -> dict:
    env = dict(os.environ, E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY="e2b_" + "0" * 40)
    r = subprocess.run(["node", str(script), *args], env=env, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"e2b_sdk.mjs {' '.join(args)} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def dsec_latency(client, template: str, n: int, warmup: int) -> dict:
    create, first = [], []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        sb = client.create(template, ttl=300)
        t1 = time.perf_counter()
        r = sb.exec(["/bin/bash", "-l", "-c", "true"])
        t2 = time.perf_counter()
        assert r.exit_code == 0, r
        sb.destroy()
        if i >= warmup:
            create.append((t1 - t0) * 1000)
            first.append((t2 - t1) * 1000)
    return {"create": create, "first": first, "total": [a + b for a, b in zip(create, first)]}


def dsec_loop(client, template: str, steps: int, think_ms: float) -> dict:
    sb = client.create(template, ttl=300)
    step = []
    try:
        for i in range(steps + 3):
            time.sleep(think_ms / 1000)
            t0 = time.perf_counter()
            r = sb.exec(["/bin/bash", "-l", "-c", f"echo step {i}"])
            assert r.stdout == f"step {i}\n".encode(), r
            if i >= 3:
                step.append((time.perf_counter() - t0) * 1000)
    finally:
        sb.destroy()
    return {"step": step}


def dsec_rate(client, template: str, c: int, seconds: float) -> dict:
    end = time.monotonic() + seconds
    done, latencies, lock = [0], [], threading.Lock()

    def worker():
        while time.monotonic() < end:
            t0 = time.perf_counter()
            sb = client.create(template, ttl=300)
            if time.monotonic() <= end:
                with lock:
                    done[0] += 1
                    latencies.append((time.perf_counter() - t0) * 1000)
            sb.destroy()

    threads = [threading.Thread(target=worker) for _ in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"completed": done[0], "seconds": seconds, "latencies": latencies}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=str(ROOT / "build"))
    ap.add_argument("--home", default=os.environ.get("DSEC_HOME", str(ROOT / "build" / "test-home")))
    ap.add_argument("--template", default="bookworm-python")
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--window", type=float, default=5)
    ap.add_argument("--steps", type=int, default=100, help="steps of the agent loop")
    ap.add_argument("--think", default="0,100", help="think times of the agent loop, ms")
    ap.add_argument("--markdown", action="store_true")
    o = ap.parse_args()
    build = pathlib.Path(o.build).resolve()
    levels = [int(c) for c in o.concurrency.split(",")]
    thinks = [float(t) for t in o.think.split(",")]
    sys.path.insert(0, str(build / "python"))
    import dsec  # noqa: E402  (the build's binding)

    node_dir = sdk_dir(build)
    script = node_dir / f"e2b_sdk-{os.getpid()}.mjs"
    shutil.copy(ROOT / "benchmarks" / "e2b_sdk.mjs", script)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()
    try:
        gw = Gateway(build, o.home)
        try:
            sdk_lat = run_node(script, gw.url, "latency", o.template, str(o.n), str(o.warmup))
            sdk_rates = {c: run_node(script, gw.url, "rate", o.template, str(c), str(o.window)) for c in levels}
            sdk_loops = {t: run_node(script, gw.url, "loop", o.template, str(o.steps), str(t)) for t in thinks}
        finally:
            gw.stop()
    finally:
        script.unlink(missing_ok=True)
    client = dsec.Client(home=o.home)
    try:
        dsec_lat = dsec_latency(client, o.template, o.n, o.warmup)
        dsec_rates = {c: dsec_rate(client, o.template, c, o.window) for c in levels}
        dsec_loops = {t: dsec_loop(client, o.template, o.steps, t) for t in thinks}
    finally:
        client.close()

    def row(name, values):
        return (f"| {name} | {statistics.median(values):.1f} ms | {percentile(values, 99):.1f} ms | "
                f"{max(values):.1f} ms |")

    lines = [f"E2B SDK (e2b {json.loads((node_dir / 'node_modules' / 'e2b' / 'package.json').read_text())['version']})"
             f" through dsec-e2b against `import dsec`, template `{o.template}`, {os.cpu_count()} cores, started "
             f"{started}, load average {load[0]:.2f}.", "",
             f"Create to first command (n = {o.n}, {o.warmup} warm-up, one at a time):", "",
             "| what | p50 | p99 | max |", "| --- | --- | --- | --- |",
             row("E2B SDK: `Sandbox.create`", sdk_lat["create"]),
             row("E2B SDK: first `commands.run('true')`", sdk_lat["first"]),
             row("E2B SDK: create + first command", sdk_lat["total"]),
             row("`import dsec`: `client.create`", dsec_lat["create"]),
             row("`import dsec`: first `exec(['/bin/bash', '-l', '-c', 'true'])`", dsec_lat["first"]),
             row("`import dsec`: create + first command", dsec_lat["total"]), "",
             f"Creates a second, closed loop (create then kill; {o.window:.0f} s per cell):", "",
             "| concurrency | E2B SDK creates/s | SDK create p50 | `import dsec` creates/s | dsec create p50 |",
             "| --- | --- | --- | --- | --- |"]
    for c in levels:
        s, d = sdk_rates[c], dsec_rates[c]
        lines.append(f"| {c} | {s['completed'] / s['seconds']:.1f} | {statistics.median(s['latencies']):.1f} ms | "
                     f"{d['completed'] / d['seconds']:.1f} | {statistics.median(d['latencies']):.1f} ms |")
    lines += ["", f"An agent loop: one sandbox, {o.steps} steps (`echo step N` through `/bin/bash -l -c`), each after a "
              "think time:", "",
              "| think time | E2B SDK step p50 | p99 | `import dsec` step p50 | p99 |", "| --- | --- | --- | --- | --- |"]
    for t in thinks:
        s_, d_ = sdk_loops[t]["step"], dsec_loops[t]["step"]
        lines.append(f"| {t:.0f} ms | {statistics.median(s_):.1f} ms | {percentile(s_, 99):.1f} ms | "
                     f"{statistics.median(d_):.1f} ms | {percentile(d_, 99):.1f} ms |")
    lines += ["", "E2B's cloud, for reference (its published figures): about 150 ms per create, 1 to 5 creates a "
              "second by plan."]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
