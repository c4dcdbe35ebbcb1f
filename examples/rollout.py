#!/usr/bin/env python3
"""An RL-style rollout over many dsec sandboxes: the main job of the quickstart.

Each of N concurrent sandboxes plays one scripted "agent episode" of a software-engineering task, the way a trainer
drives a coding agent step by step:

  1. the environment writes a buggy module and its unit tests into the sandbox,
  2. the agent runs the tests (they fail),
  3. the agent reads the module, edits it (here: a scripted patch in place of a model's edit) and writes it back,
  4. the agent reruns the tests (they pass), and the episode is scored.

Sandboxes come from one `create_many` pulse on the embedded local agent (dsec.Client() with no endpoints), and every
step is an exec or a file call. The summary reports the reward and where the time went.

    sudo PYTHONPATH=build/python /usr/bin/python3 examples/rollout.py --sandboxes 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import dsec

# Small tasks: (module name, buggy source, the fix as (old, new), unit tests).
TASKS = [
    (
        "fib",
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n - 1):\n        a, b = b, a + b\n    return a\n",
        ("range(n - 1)", "range(n)"),
        "from fib import fib\n\ndef test():\n    assert [fib(i) for i in range(8)] == [0, 1, 1, 2, 3, 5, 8, 13]\n",
    ),
    (
        "clamp",
        "def clamp(x, lo, hi):\n    return max(lo, min(x, lo))\n",
        ("min(x, lo)", "min(x, hi)"),
        "from clamp import clamp\n\ndef test():\n    assert clamp(5, 0, 10) == 5\n    assert clamp(-1, 0, 10) == 0\n"
        "    assert clamp(11, 0, 10) == 10\n",
    ),
    (
        "palindrome",
        "def is_palindrome(s):\n    s = ''.join(c for c in s.lower() if c.isalnum())\n    return s == s[1:]\n",
        ("s[1:]", "s[::-1]"),
        "from palindrome import is_palindrome\n\ndef test():\n    assert is_palindrome('A man, a plan, a canal: Panama')\n"
        "    assert not is_palindrome('dsec')\n",
    ),
    (
        "wordcount",
        "def word_count(text):\n    counts = {}\n    for w in text.split(' '):\n        counts[w] = counts.get(w, 0) + 1\n"
        "    return counts\n",
        ("text.split(' ')", "text.split()"),
        "from wordcount import word_count\n\ndef test():\n    assert word_count('a b  a\\n') == {'a': 2, 'b': 1}\n",
    ),
]

RUN_TESTS = (
    # -B: the edit can keep the file's size and land in the same second as the first run, and Python would then
    # reuse the stale bytecode of the buggy version.
    "cd /work && python3 -B -c \"import sys, importlib; m = importlib.import_module(sys.argv[1]); m.test(); print('PASS')\" "
)


@dataclass
class Episode:
    index: int
    task: str
    reward: float = 0.0
    steps: int = 0
    failed_first: bool = False
    error: str = ""
    step_seconds: list[float] = field(default_factory=list)


def play(sb: dsec.Sandbox, index: int) -> Episode:
    name, buggy, (old, new), tests = TASKS[index % len(TASKS)]
    ep = Episode(index=index, task=name)

    def step(fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            ep.step_seconds.append(time.perf_counter() - t0)
            ep.steps += 1

    try:
        step(sb.write_file, f"/work/{name}.py", buggy.encode())
        step(sb.write_file, f"/work/test_{name}.py", tests.encode())
        first = step(sb.exec, RUN_TESTS + f"test_{name}", timeout=60)
        ep.failed_first = first.exit_code != 0
        source = step(sb.read_file, f"/work/{name}.py").decode()
        step(sb.write_file, f"/work/{name}.py", source.replace(old, new).encode())
        second = step(sb.exec, RUN_TESTS + f"test_{name}", timeout=60)
        passed = second.exit_code == 0 and b"PASS" in second.stdout
        # The episode's reward: the tests pass after the edit, and they had failed before it.
        ep.reward = 1.0 if (passed and ep.failed_first) else 0.0
        if not passed:
            ep.error = second.stderr.decode(errors="replace")[-300:]
    except dsec.DsecError as e:
        ep.error = f"{type(e).__name__}: {e}"
    return ep


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sandboxes", type=int, default=64)
    parser.add_argument("--image", default="bookworm-python", help="an image with python3 (default: bookworm-python)")
    parser.add_argument("--endpoint", action="append", default=[], help="use running agents instead of an embedded one")
    parser.add_argument("--memory", default="256Mi")
    args = parser.parse_args()

    t_start = time.perf_counter()
    with dsec.Client(endpoints=args.endpoint) as client:
        t_client = time.perf_counter()
        sandboxes = client.create_many(
            args.sandboxes, image=args.image, kind="container", cpu=0.5, memory=args.memory, ttl=900,
            labels={"job": "rollout-example"},
        )
        t_created = time.perf_counter()
        try:
            with ThreadPoolExecutor(max_workers=args.sandboxes) as pool:
                episodes = list(pool.map(play, sandboxes, range(len(sandboxes))))
        finally:
            t_played = time.perf_counter()
            with ThreadPoolExecutor(max_workers=16) as pool:
                list(pool.map(lambda sb: sb.destroy(), sandboxes))
            t_destroyed = time.perf_counter()

    steps = [s for ep in episodes for s in ep.step_seconds]
    rewards = [ep.reward for ep in episodes]
    print(f"dsec rollout: {len(episodes)} sandboxes, image {args.image}")
    print(f"  agent start        {t_client - t_start:8.3f} s")
    print(f"  create_many        {t_created - t_client:8.3f} s  ({len(sandboxes) / (t_created - t_client):.0f} sandboxes/s)")
    print(f"  episodes           {t_played - t_created:8.3f} s  ({len(steps)} steps, {len(steps) / (t_played - t_created):.0f} steps/s)")
    print(f"  step latency       p50 {1000 * pct(steps, 0.5):.1f} ms, p95 {1000 * pct(steps, 0.95):.1f} ms, "
          f"max {1000 * max(steps):.1f} ms")
    print(f"  destroy            {t_destroyed - t_played:8.3f} s")
    print(f"  mean reward        {statistics.mean(rewards):.3f}  "
          f"({sum(1 for r in rewards if r == 1.0)}/{len(rewards)} episodes solved)")
    by_task: dict[str, list[float]] = {}
    for ep in episodes:
        by_task.setdefault(ep.task, []).append(ep.reward)
    for task, rs in sorted(by_task.items()):
        print(f"    {task:<12} {statistics.mean(rs):.2f} over {len(rs)}")
    failures = [ep for ep in episodes if ep.reward != 1.0]
    for ep in failures[:5]:
        print(f"  episode {ep.index} ({ep.task}) failed: {ep.error or 'tests did not fail before the fix'}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
