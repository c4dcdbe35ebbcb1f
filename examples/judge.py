#!/usr/bin/env python3
"""Judging a policy's solutions with dsec function calls: the reward step of RL on programming problems.

A set of small programming problems, each with test cases (stdin and the expected stdout), and N candidate solutions
as a policy's samples would be: mostly correct ones written in different ways, and wrong, crashing, slow, hanging,
memory-hungry and syntactically broken ones. Every solution runs against its problem's tests in dsec's warm Python
pools with a time and memory limit per run (client.run_code_many, one batch per test round: a solution stops at its
first failed test, as a judge does), and the summary gives each problem's verdicts, the pass rate, and the calls per
second. Each solution was generated with an intended verdict, so the summary also says how many were judged as
intended.

    sudo PYTHONPATH=build/python /usr/bin/python3 examples/judge.py                    # embedded agent, 1,000 samples
    sudo PYTHONPATH=build/python /usr/bin/python3 examples/judge.py --endpoint unix:/run/dsec/dsecd.sock

It needs an image with python3 (the quickstart builds `bookworm-python`; --image names another, --store the store
it is in).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import dsec

VERDICTS = ("AC", "WA", "RE", "TLE", "MLE", "CE", "SE")
VERDICT_NAMES = {
    "AC": "accepted",
    "WA": "wrong answer",
    "RE": "runtime error",
    "TLE": "time limit",
    "MLE": "memory limit",
    "CE": "syntax error",
    "SE": "could not run",
}


@dataclass(frozen=True)
class Problem:
    name: str
    tests: tuple[tuple[str, str], ...]  # (stdin, expected stdout)
    correct: tuple[str, ...]            # correct solutions, in different styles
    wrong: tuple[str, ...]              # plausible wrong answers
    slow: str | None = None             # correct but far too slow on the larger tests


def _fizz(n: int) -> str:
    return "".join(("FizzBuzz" if i % 15 == 0 else "Fizz" if i % 3 == 0 else "Buzz" if i % 5 == 0 else str(i)) + "\n"
                   for i in range(1, n + 1))


def _primes(n: int) -> str:
    return " ".join(str(p) for p in range(2, n + 1) if all(p % d for d in range(2, int(p ** 0.5) + 1))) + "\n"


def _fib(n: int) -> str:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return f"{a}\n"


def _inversions_case(n: int, seed: int) -> tuple[str, str]:
    r = random.Random(seed)
    xs = [r.randrange(10 ** 6) for _ in range(n)]
    # Counted by merge sort here, so the test data needs no quadratic time either.
    def count(a):
        if len(a) < 2:
            return a, 0
        m = len(a) // 2
        left, x = count(a[:m])
        right, y = count(a[m:])
        merged, inv, i, j = [], x + y, 0, 0
        while i < len(left) and j < len(right):
            if left[i] <= right[j]:
                merged.append(left[i])
                i += 1
            else:
                merged.append(right[j])
                inv += len(left) - i
                j += 1
        return merged + left[i:] + right[j:], inv
    return f"{n}\n{' '.join(map(str, xs))}\n", f"{count(xs)[1]}\n"


PROBLEMS: tuple[Problem, ...] = (
    Problem(
        "sum-of-list",
        (("3\n1 2 3\n", "6\n"), ("1\n-5\n", "-5\n"), ("5\n10 20 30 40 50\n", "150\n"), ("0\n\n", "0\n")),
        ("n = int(input())\nnums = list(map(int, input().split()))\nprint(sum(nums))\n",
         "import sys\ndata = sys.stdin.read().split()\nprint(sum(int(x) for x in data[1:]))\n"),
        ("n = int(input())\nnums = list(map(int, input().split()))\nprint(sum(nums[1:]))\n",
         "import sys\ndata = sys.stdin.read().split()\nprint(sum(int(x) for x in data))\n"),
    ),
    Problem(
        "reverse-words",
        (("hello world\n", "world hello\n"), ("a\n", "a\n"), ("the quick  brown fox\n", "fox brown quick the\n")),
        ("print(' '.join(reversed(input().split())))\n",
         "words = input().split()\nwords.reverse()\nprint(*words)\n"),
        ("print(input()[::-1])\n", "print(' '.join(reversed(input().split(' '))))\n"),
    ),
    Problem(
        "fizzbuzz",
        (("5\n", _fizz(5)), ("15\n", _fizz(15)), ("1\n", _fizz(1)), ("100\n", _fizz(100))),
        ("n = int(input())\nfor i in range(1, n + 1):\n    s = ('Fizz' if i % 3 == 0 else '') + ('Buzz' if i % 5 == 0 else '')\n"
         "    print(s or i)\n",
         "n = int(input())\nfor i in range(1, n + 1):\n    if i % 15 == 0:\n        print('FizzBuzz')\n"
         "    elif i % 3 == 0:\n        print('Fizz')\n    elif i % 5 == 0:\n        print('Buzz')\n    else:\n"
         "        print(i)\n"),
        ("n = int(input())\nfor i in range(1, n):\n    s = ('Fizz' if i % 3 == 0 else '') + ('Buzz' if i % 5 == 0 else '')\n"
         "    print(s or i)\n",
         "n = int(input())\nfor i in range(1, n + 1):\n    if i % 3 == 0:\n        print('Fizz')\n"
         "    elif i % 5 == 0:\n        print('Buzz')\n    elif i % 15 == 0:\n        print('FizzBuzz')\n    else:\n"
         "        print(i)\n"),
    ),
    Problem(
        "primes-up-to-n",
        (("10\n", _primes(10)), ("2\n", _primes(2)), ("30\n", _primes(30)), ("200000\n", _primes(200000))),
        ("n = int(input())\nsieve = bytearray([1]) * (n + 1)\nsieve[0:2] = b'\\x00\\x00'\n"
         "for i in range(2, int(n ** 0.5) + 1):\n    if sieve[i]:\n        sieve[i * i::i] = bytes(len(range(i * i, n + 1, i)))\n"
         "print(' '.join(str(i) for i in range(n + 1) if sieve[i]))\n",),
        ("n = int(input())\nprint(' '.join(str(p) for p in range(2, n) if all(p % d for d in range(2, p))))\n",
         "n = int(input())\nprint(' '.join(str(p) for p in range(1, n + 1) if all(p % d for d in range(2, int(p ** 0.5) + 1))))\n"),
        slow="n = int(input())\nprint(' '.join(str(p) for p in range(2, n + 1) if all(p % d for d in range(2, p))))\n",
    ),
    Problem(
        "balanced-brackets",
        (("([]{})\n", "YES\n"), ("([)]\n", "NO\n"), ("((\n", "NO\n"), ("{[()()]}\n", "YES\n"), (")(\n", "NO\n")),
        ("s = input().strip()\nstack = []\npairs = {')': '(', ']': '[', '}': '{'}\nok = True\nfor c in s:\n"
         "    if c in '([{':\n        stack.append(c)\n    elif not stack or stack.pop() != pairs[c]:\n"
         "        ok = False\n        break\nprint('YES' if ok and not stack else 'NO')\n",
         "s = input().strip()\nprev = None\nwhile prev != s:\n    prev = s\n"
         "    s = s.replace('()', '').replace('[]', '').replace('{}', '')\nprint('NO' if s else 'YES')\n"),
        ("s = input().strip()\nok = all(s.count(a) == s.count(b) for a, b in ('()', '[]', '{}'))\nprint('YES' if ok else 'NO')\n",),
    ),
    Problem(
        "max-subarray",
        (("5\n-2 1 -3 4 -1\n", "4\n"), ("3\n-3 -1 -2\n", "-1\n"), ("8\n-2 1 -3 4 -1 2 1 -5\n", "6\n"), ("1\n7\n", "7\n")),
        ("input()\nbest = cur = None\nfor x in map(int, input().split()):\n    cur = x if cur is None or cur < 0 else cur + x\n"
         "    best = cur if best is None else max(best, cur)\nprint(best)\n",),
        ("input()\nprint(max(map(int, input().split())))\n",
         "input()\nbest = cur = 0\nfor x in map(int, input().split()):\n    cur = max(0, cur + x)\n    best = max(best, cur)\n"
         "print(best)\n"),
    ),
    Problem(
        "gcd-and-lcm",
        (("12 18\n", "6 36\n"), ("7 5\n", "1 35\n"), ("100 10\n", "10 100\n"), ("21 6\n", "3 42\n")),
        ("import math\na, b = map(int, input().split())\ng = math.gcd(a, b)\nprint(g, a * b // g)\n",
         "a, b = map(int, input().split())\nx, y = a, b\nwhile y:\n    x, y = y, x % y\nprint(x, a // x * b)\n"),
        ("import math\na, b = map(int, input().split())\nprint(math.gcd(a, b), a * b)\n",),
    ),
    Problem(
        "fibonacci",
        (("10\n", _fib(10)), ("1\n", _fib(1)), ("50\n", _fib(50)), ("90\n", _fib(90))),
        ("n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)\n",),
        ("n = int(input())\na, b = 1, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)\n",),
        slow="import sys\nsys.setrecursionlimit(10000)\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
             "print(fib(int(input())))\n",
    ),
    Problem(
        "palindrome",
        (("A man, a plan, a canal: Panama\n", "YES\n"), ("race a car\n", "NO\n"), ("Was it a car or a cat I saw?\n", "YES\n"),
         ("x\n", "YES\n")),
        ("s = [c.lower() for c in input() if c.isalnum()]\nprint('YES' if s == s[::-1] else 'NO')\n",),
        ("s = input().strip()\nprint('YES' if s == s[::-1] else 'NO')\n",),
    ),
    Problem(
        "most-common-word",
        (("b a b a c\n", "a\n"), ("x\n", "x\n"), ("the cat and the hat\n", "the\n"), ("z y x y z\n", "y\n")),
        ("from collections import Counter\nc = Counter(input().split())\nbest = max(c.values())\n"
         "print(min(w for w, k in c.items() if k == best))\n",),
        ("from collections import Counter\nprint(Counter(input().split()).most_common(1)[0][0])\n",),
    ),
    Problem(
        "count-inversions",
        (("5\n2 4 1 3 5\n", "3\n"), ("3\n3 2 1\n", "3\n"), _inversions_case(8000, 1)),
        ("import sys\nsys.setrecursionlimit(10000)\ndef count(a):\n    if len(a) < 2:\n        return a, 0\n"
         "    m = len(a) // 2\n    l, x = count(a[:m])\n    r, y = count(a[m:])\n    out, inv, i, j = [], x + y, 0, 0\n"
         "    while i < len(l) and j < len(r):\n        if l[i] <= r[j]:\n            out.append(l[i]); i += 1\n"
         "        else:\n            out.append(r[j]); j += 1; inv += len(l) - i\n"
         "    return out + l[i:] + r[j:], inv\ninput()\nprint(count(list(map(int, input().split())))[1])\n",),
        ("input()\na = list(map(int, input().split()))\nprint(sum(1 for i in range(len(a) - 1) if a[i] > a[i + 1]))\n",),
        slow="input()\na = list(map(int, input().split()))\n"
             "print(sum(1 for i in range(len(a)) for j in range(i + 1, len(a)) if a[i] > a[j]))\n",
    ),
    Problem(
        "roman-numerals",
        (("4\n", "IV\n"), ("1994\n", "MCMXCIV\n"), ("3999\n", "MMMCMXCIX\n"), ("58\n", "LVIII\n")),
        ("n = int(input())\nout = ''\nfor v, s in ((1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'),\n"
         "             (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I')):\n"
         "    while n >= v:\n        out += s\n        n -= v\nprint(out)\n",),
        ("n = int(input())\nout = ''\nfor v, s in ((1000, 'M'), (500, 'D'), (100, 'C'), (50, 'L'), (10, 'X'), (5, 'V'), (1, 'I')):\n"
         "    while n >= v:\n        out += s\n        n -= v\nprint(out)\n",),
    ),
)

# Defects a sampled program may carry, with the verdict each one should get. {body} is a correct solution.
CRASH = "import sys\ndata = sys.stdin.read()\nraise ValueError('unexpected input: ' + data[:20])\n"
# Passes the first (sample) test and crashes on the others.
CRASH_LATE = ("import io\nimport sys\n_data = sys.stdin.read()\nif _data != {first!r}:\n    print([][0])\n"
              "sys.stdin = io.StringIO(_data)\n{body}")
HANG_BUSY = "while True:\n    pass\n{body}"
HANG_SLEEP = "import time\ntime.sleep(3600)\n{body}"
MEMORY_HOG = "hog = [b'x' * (1 << 20) for _ in range(4096)]\n{body}"
SYNTAX = "def solve(:\n{body}"
EXIT_CODE = "import sys\nsys.exit(3)\n"


@dataclass
class Solution:
    problem: Problem
    code: str
    intent: str  # the verdict it was generated to get


def generate(n: int, seed: int) -> list[Solution]:
    """n samples over the problems: 56% correct, 20% wrong, 13% crashing, 4% slow or hanging, 3% memory-hungry,
    4% syntactically broken."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = PROBLEMS[i % len(PROBLEMS)]
        body = rng.choice(p.correct)
        roll = rng.random()
        if roll < 0.56:
            code, intent = body, "AC"
        elif roll < 0.76:
            code, intent = rng.choice(p.wrong), "WA"
        elif roll < 0.84:
            code, intent = rng.choice((CRASH, EXIT_CODE)), "RE"
        elif roll < 0.89:
            code, intent = CRASH_LATE.format(body=body, first=p.tests[0][0]), "RE"
        elif roll < 0.91:
            code, intent = (p.slow, "TLE") if p.slow else (HANG_BUSY.format(body=body), "TLE")
        elif roll < 0.92:
            code, intent = HANG_BUSY.format(body=body), "TLE"
        elif roll < 0.93:
            code, intent = HANG_SLEEP.format(body=body), "TLE"
        elif roll < 0.96:
            code, intent = MEMORY_HOG.format(body=body), "MLE"
        else:
            code, intent = SYNTAX.format(body=body), "CE"
        # Samples differ in more than their logic, as a policy's do.
        out.append(Solution(p, f"# sample {i} for {p.name}\n{code}", intent))
    return out


def normalise(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def verdict_of(result: dsec.FnCallResult, expected: str) -> str:
    if result.error:
        return "SE"
    # The OOM killer's kill is a memory verdict even when the wall clock ran out too while the kernel reclaimed.
    if result.oom_killed or b"MemoryError" in result.stderr:
        return "MLE"
    if result.timed_out:
        return "TLE"
    if result.exit_code != 0:
        return "CE" if b"SyntaxError" in result.stderr else "RE"
    return "AC" if normalise(result.stdout_text) == normalise(expected) else "WA"


def judge(client: dsec.Client, solutions: list[Solution], args: argparse.Namespace) -> dict:
    verdicts: list[str | None] = [None] * len(solutions)
    first_failure: list[tuple[int, dsec.FnCallResult] | None] = [None] * len(solutions)
    active = list(range(len(solutions)))
    durations: list[float] = []
    calls = 0
    errors: list[str] = []
    start = time.monotonic()
    for t in range(max(len(p.tests) for p in PROBLEMS)):
        batch = [i for i in active if t < len(solutions[i].problem.tests)]
        if not batch:
            break
        results = client.run_code_many([
            {
                "code": solutions[i].code,
                "stdin": solutions[i].problem.tests[t][0],
                "timeout": args.wall_limit,
                "cpu_time": args.time_limit,
                "memory": args.memory,
                "max_output_bytes": 1 << 20,
                "image": args.image,
            }
            for i in batch
        ])
        calls += len(batch)
        if t == 0 and all(r.error for r in results):
            raise SystemExit(f"judge: no run could start: {results[0].error_code}: {results[0].error}\n"
                             f"(is {args.image!r} an image with python3 in the store? --image and --store choose it)")
        for i, r in zip(batch, results):
            v = verdict_of(r, solutions[i].problem.tests[t][1])
            if not r.error:
                durations.append(r.duration)
            elif len(errors) < 5:
                errors.append(f"{r.error_code}: {r.error}")
            if v != "AC" and verdicts[i] is None:
                verdicts[i] = v
                first_failure[i] = (t, r)
        if not args.all_tests:
            active = [i for i in active if verdicts[i] is None]
        if args.verbose:
            print(f"  test round {t + 1}: {len(batch)} calls, {time.monotonic() - start:.1f} s", file=sys.stderr)
    wall = time.monotonic() - start
    final = [v or "AC" for v in verdicts]
    return {"verdicts": final, "first_failure": first_failure, "durations": durations, "calls": calls, "wall": wall,
            "errors": errors}


def summarise(solutions: list[Solution], outcome: dict, args: argparse.Namespace) -> dict:
    verdicts = outcome["verdicts"]
    per_problem: dict[str, Counter] = defaultdict(Counter)
    for s, v in zip(solutions, verdicts):
        per_problem[s.problem.name][v] += 1
    total = Counter(verdicts)
    as_intended = sum(1 for s, v in zip(solutions, verdicts) if s.intent == v)
    d = sorted(outcome["durations"])

    def pct(p: float) -> float:
        return d[min(len(d) - 1, max(0, int(round(p / 100 * len(d))) - 1))] * 1000 if d else float("nan")

    return {
        "solutions": len(solutions),
        "per_problem": {name: dict(c) for name, c in per_problem.items()},
        "total": dict(total),
        "pass_rate": total["AC"] / len(solutions) if solutions else 0.0,
        "as_intended": as_intended,
        "mismatches": [
            {"problem": s.problem.name, "intent": s.intent, "verdict": v}
            for s, v in zip(solutions, verdicts) if s.intent != v
        ],
        "calls": outcome["calls"],
        "wall_seconds": outcome["wall"],
        "calls_per_second": outcome["calls"] / outcome["wall"] if outcome["wall"] > 0 else 0.0,
        "run_p50_ms": pct(50),
        "run_p99_ms": pct(99),
        "errors": outcome["errors"],
    }


def print_summary(summary: dict, solutions: list[Solution], outcome: dict, args: argparse.Namespace) -> None:
    width = max(len(p.name) for p in PROBLEMS)
    print(f"\n{'problem':<{width}} {'samples':>8} " + " ".join(f"{v:>5}" for v in VERDICTS) + "   pass rate")
    for p in PROBLEMS:
        c = summary["per_problem"].get(p.name, {})
        n = sum(c.values())
        if not n:
            continue
        print(f"{p.name:<{width}} {n:>8} " + " ".join(f"{c.get(v, 0):>5}" for v in VERDICTS) +
              f"   {c.get('AC', 0) / n:>8.1%}")
    t = summary["total"]
    print(f"{'all':<{width}} {summary['solutions']:>8} " + " ".join(f"{t.get(v, 0):>5}" for v in VERDICTS) +
          f"   {summary['pass_rate']:>8.1%}")
    print("\n" + ", ".join(f"{v} = {VERDICT_NAMES[v]}" for v in VERDICTS))
    print(f"\n{summary['solutions']} solutions judged in {summary['wall_seconds']:.1f} s: {summary['calls']} runs "
          f"({summary['calls_per_second']:.0f} runs/s); a run's own time p50 {summary['run_p50_ms']:.1f} ms, "
          f"p99 {summary['run_p99_ms']:.0f} ms (limits: {args.time_limit} s CPU, {args.wall_limit} s wall, "
          f"{args.memory} memory)")
    print(f"verdicts as the samples were generated to get: {summary['as_intended']} of {summary['solutions']}")
    for m in summary["mismatches"][:10]:
        print(f"  {m['problem']}: meant {m['intent']}, judged {m['verdict']}")
    for e in summary["errors"]:
        print(f"  a call could not run: {e}")
    if args.verbose:
        for s, v, ff in zip(solutions, outcome["verdicts"], outcome["first_failure"]):
            if ff is None:
                continue
            test, r = ff
            tail = r.error or (r.stderr_text.strip().splitlines() or [""])[-1]
            print(f"  {s.problem.name} test {test + 1}: {v} "
                  f"(exit {r.exit_code}, {r.duration * 1000:.0f} ms, {r.peak_memory >> 20} MiB) {tail[:100]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--solutions", type=int, default=1000, help="samples to judge (default 1000)")
    ap.add_argument("--seed", type=int, default=7, help="seed of the sampled solutions (default 7)")
    ap.add_argument("--image", default="bookworm-python", help="an image with python3 (default: bookworm-python)")
    ap.add_argument("--endpoint", action="append", default=[],
                    help="a running agent (unix:/path or http://host:port; repeatable); default: an embedded agent")
    ap.add_argument("--store", action="append", default=[], help="image store to resolve --image in (repeatable)")
    ap.add_argument("--home", default=None, help="the embedded agent's home (default $DSEC_HOME, then /var/lib/dsec)")
    ap.add_argument("--time-limit", type=float, default=1.0, help="CPU seconds per run (default 1)")
    ap.add_argument("--wall-limit", type=float, default=2.0, help="wall seconds per run (default 2)")
    ap.add_argument("--memory", default="128Mi", help="memory per run (default 128Mi)")
    ap.add_argument("--all-tests", action="store_true", help="run every test, not only up to the first failure")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON as well")
    ap.add_argument("--verbose", action="store_true", help="progress and every failed solution's first failure")
    args = ap.parse_args()
    if args.solutions < 1:
        ap.error("--solutions must be at least 1")

    solutions = generate(args.solutions, args.seed)
    # No --endpoint: an embedded agent serves this process alone (and stops with it).
    with dsec.Client(args.endpoint or None, stores=args.store or None, home=args.home) as client:
        outcome = judge(client, solutions, args)
    summary = summarise(solutions, outcome, args)
    print_summary(summary, solutions, outcome, args)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
