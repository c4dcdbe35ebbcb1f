"""The examples in README.md and docs/*.md run as written: every fenced block whose info string is
`python example` runs with Debian's python3 and the build's `dsec` package, and every `cpp example` is compiled
against the build's libraries and run, each as root on a private embedded agent over the test store (so an example
that stops working fails the suite). Examples use the images the quickstart builds: busybox and bookworm-python
(scripts/test.sh builds both into the test store)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

import pytest

import dsec_testlib as lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```([a-z+]+) example\s*\n(.*?)^```\s*$", re.M | re.S)


def examples() -> list[tuple[str, str, str]]:
    """(id, language, code) of every marked block, in file order."""
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for n, m in enumerate(FENCE.finditer(text)):
            line = text.count("\n", 0, m.start()) + 1
            found.append((f"{doc.relative_to(ROOT)}:{line}", m.group(1), m.group(2)))
    return found


EXAMPLES = examples()


def test_the_docs_have_examples():
    langs = {lang for _, lang, _ in EXAMPLES}
    assert {"python", "cpp"} <= langs, f"no marked Python or C++ examples found: {EXAMPLES}"


def _image_missing(home: str, name: str) -> bool:
    return not os.path.exists(os.path.join(home, "store", "refs", f"{name}%3Alatest"))


@pytest.fixture(scope="module")
def example_home():
    """The test store, which must hold the images the examples name."""
    home = os.environ.get("DSEC_HOME", "")
    if not home:
        pytest.skip("DSEC_HOME is not set (scripts/test.sh sets it to the test store)")
    missing = [n for n in ("busybox", "bookworm-python") if _image_missing(home, n)]
    if missing:
        pytest.fail(f"the test store {home} lacks {missing}: scripts/test.sh builds them "
                    f"(dsec image build bookworm-python --from debootstrap:bookworm --include python3)")
    return home


def _env(home: str) -> dict[str, str]:
    env = dict(os.environ)
    env["DSEC_HOME"] = home
    env["PYTHONPATH"] = str(lib.BUILD / "python")
    return env


@pytest.mark.parametrize("where,lang,code", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_example_runs(where, lang, code, example_home, tmp_path):
    if lang == "python":
        script = tmp_path / "example.py"
        script.write_text(code)
        r = subprocess.run(["/usr/bin/python3", str(script)], env=_env(example_home), capture_output=True,
                           timeout=900, stdin=subprocess.DEVNULL)
    elif lang == "cpp":
        source = tmp_path / "example.cpp"
        source.write_text(code)
        binary = tmp_path / "example"
        libdir = lib.BUILD / "lib"
        # As the README says to link it.
        compile_ = subprocess.run(
            ["g++", "-std=c++20", "-O1", f"-I{ROOT / 'libdsec' / 'include'}", str(source), "-o", str(binary),
             str(libdir / "libdsec.a"), str(libdir / "libdsec_imagestore.a"), str(libdir / "libdsec_cluster.a"),
             str(libdir / "libdsec_http_client.a"), str(libdir / "libdsec_common.a"),
             "-lfmt", "-lcurl", "-lcrypto", "-lzstd", "-pthread"],
            capture_output=True, text=True, timeout=600)
        assert compile_.returncode == 0, f"{where} does not compile:\n{compile_.stderr[-4000:]}"
        r = subprocess.run([str(binary)], env=_env(example_home), capture_output=True, timeout=900,
                           stdin=subprocess.DEVNULL)
    else:
        pytest.fail(f"{where}: no runner for `{lang} example` blocks (python and cpp run)")
    assert r.returncode == 0, (f"{where} failed with status {r.returncode}:\n--- stdout\n"
                               f"{r.stdout.decode(errors='replace')[-3000:]}\n--- stderr\n"
                               f"{r.stderr.decode(errors='replace')[-3000:]}")
