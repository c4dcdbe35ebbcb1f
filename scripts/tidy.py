#!/usr/bin/python3
"""clang-tidy over dsec's sources, with the tree's .clang-tidy; fails on any finding.

    scripts/tidy.py                 every C++ file of libdsec/src, bindings/python and benchmarks in the build's
                                    compile_commands.json ($BUILD_DIR, default ./build)
    scripts/tidy.py FILE...         just these

Tests are left out: their functions are long by nature (a test reads as one story), and the checks here are about
the code that runs. A translation unit clang-tidy passed is remembered by a hash of what it checked (its
preprocessed source with line markers, its flags, .clang-tidy and clang-tidy's version, with the checkout's own paths taken
out) in $DSEC_TIDY_CACHE (default
/var/cache/dsec/tidy, or ~/.cache/dsec/tidy when that is not writable), so a second run checks only what changed
since: a file whose preprocessed text is the same cannot have a new finding. Findings are never cached.
"""

import concurrent.futures
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED_DIRS = ("libdsec/src/", "bindings/python/", "benchmarks/")


def cache_dir() -> Path:
    configured = os.environ.get("DSEC_TIDY_CACHE")
    candidates = [Path(configured)] if configured else [Path("/var/cache/dsec/tidy"), Path.home() / ".cache/dsec/tidy"]
    for c in candidates:
        try:
            c.mkdir(parents=True, exist_ok=True)
            if os.access(c, os.W_OK):
                return c
        except OSError:
            continue
    raise SystemExit("tidy: no writable cache directory (set $DSEC_TIDY_CACHE)")


def preprocess_key(entry: dict, build: Path, salt: bytes) -> str:
    """A hash of everything clang-tidy's verdict on this translation unit depends on: its preprocessed text (line
    markers kept, as line counts matter to the function-size check) and its flags, with the checkout's and the build's
    paths taken out, so that another clone of the same tree finds the same keys."""
    args = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    out: list[str] = []
    skip = False
    for a in args:  # drop the output and the compile-only flag; preprocess to stdout instead
        if skip:
            skip = False
            continue
        if a == "-o":
            skip = True
            continue
        if a == "-c":
            continue
        out.append(a)
    text = subprocess.run(out + ["-E", "-o", "-"], cwd=entry["directory"], capture_output=True, check=False)

    def local(b: bytes) -> bytes:
        return b.replace(str(build).encode(), b"@build").replace(str(ROOT).encode(), b"@src")

    h = hashlib.sha256(salt)
    h.update(local(" ".join(out).encode()))
    h.update(local(text.stdout))
    h.update(local(text.stderr))
    return h.hexdigest()


def tidy_one(entry: dict, build: Path, cache: Path, salt: bytes) -> tuple[str, bool, str]:
    path = entry["file"]
    key = preprocess_key(entry, build, salt)
    mark = cache / key
    if mark.exists():
        return path, True, ""
    r = subprocess.run(["clang-tidy", "--quiet", "-p", str(build), path], capture_output=True, text=True, check=False)
    ok = r.returncode == 0
    if ok:
        mark.touch()
    # clang-tidy prints "N warnings generated." and suppression counts on stderr even when clean.
    return path, ok, r.stdout


def main() -> int:
    build = Path(os.environ.get("BUILD_DIR", "build"))
    if not build.is_absolute():
        build = ROOT / build
    db_path = build / "compile_commands.json"
    if not db_path.exists():
        print(f"tidy: {db_path} is missing: build first (scripts/build.sh)", file=sys.stderr)
        return 2
    db = json.loads(db_path.read_text())
    wanted = {str((ROOT / f).resolve()) for f in sys.argv[1:]}
    entries = []
    seen = set()
    for e in db:
        f = str(Path(e["directory"], e["file"]).resolve())
        rel = os.path.relpath(f, ROOT)
        if f in seen or not f.endswith(".cpp"):
            continue
        if wanted and f not in wanted:
            continue
        if not wanted and not rel.startswith(CHECKED_DIRS):
            continue
        seen.add(f)
        entries.append({**e, "file": f})
    version = subprocess.run(["clang-tidy", "--version"], capture_output=True, text=True, check=True).stdout
    salt = (version + (ROOT / ".clang-tidy").read_text()).encode()
    cache = cache_dir()
    jobs = int(os.environ.get("JOBS", os.cpu_count() or 1))
    failed = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for path, ok, report in pool.map(lambda e: tidy_one(e, build, cache, salt), entries):
            if not ok:
                failed.append(path)
                sys.stdout.write(report)
    if failed:
        print(f"tidy: {len(failed)} of {len(entries)} files have findings:", *failed, sep="\n  ", file=sys.stderr)
        return 1
    print(f"tidy: {len(entries)} files clean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
