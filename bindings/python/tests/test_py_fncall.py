"""Function calls from Python (Client.run_code, run_code_many) against a real dsecd serving the fncall backend.

The calls run over an image assembled from this host's own python3, sh, gcc and g++ (binding_testlib
.build_fncall_image; no network needed). Every call names it, so the agent needs no default image.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

import dsec
from binding_testlib import Agent, build_fncall_image, fncall_image_reason, make_home

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples")


@pytest.fixture(scope="module")
def fncall_home(short_tmp):
    why = fncall_image_reason()
    if why:
        pytest.skip(why)
    home = make_home(os.path.join(short_tmp, "fhome"))
    return home, build_fncall_image(home)


@pytest.fixture(scope="module")
def fncall_agent(short_tmp, fncall_home):
    home, image = fncall_home
    # A cgroup subtree of its own: other agents of the session must not see its fork servers as leftovers.
    a = Agent(os.path.join(short_tmp, "f1"), "pyf-n1", backends="container,fncall", home=home,
              extra_args=("--cgroup-name", "dsec-pyf1"))
    try:
        with dsec.Client(endpoints=[a.endpoint]) as c:
            if "fncall" not in c.nodes()[0].backends:
                pytest.skip("the agent does not serve the fncall backend")
            try:
                r = c.run_code("print('ready')", image=image, timeout=60)
            except (dsec.Unimplemented, dsec.FailedPrecondition, dsec.PermissionDenied) as e:
                pytest.skip(f"function calls cannot run on this host: {e}")
            assert r.stdout == b"ready\n", (r, r.stderr, a.log())
        yield a, image
    finally:
        a.stop()


@pytest.fixture
def fc(fncall_agent):
    """(client, image) for the module's agent."""
    agent, image = fncall_agent
    with dsec.Client(endpoints=[agent.endpoint]) as c:
        yield c, image


def test_python_call_fields(fc):
    client, image = fc
    code = ("import os, sys\n"
            "data = sys.stdin.read()\n"
            "print(data.upper(), open('in/x.txt').read(), sys.argv[1:], os.environ['GREETING'])\n"
            "print('to stderr', file=sys.stderr)\n"
            "sys.exit(3)\n")
    r = client.run_code(code, stdin=b"abc", files={"in/x.txt": "file text"}, args=["-v", "two words"],
                        env={"GREETING": "hello"}, image=image, timeout=10)
    assert isinstance(r, dsec.FnCallResult)
    assert r.exit_code == 3 and r.signal == 0 and not r.ok
    assert r.stdout == b"ABC file text ['-v', 'two words'] hello\n"
    assert r.stdout_text == "ABC file text ['-v', 'two words'] hello\n"
    assert r.stderr == b"to stderr\n" and r.stderr_text == "to stderr\n"
    assert not r.stdout_truncated and not r.stderr_truncated
    assert not r.timed_out and not r.oom_killed
    assert 0 < r.duration < 10
    assert r.cpu_time >= 0 and r.peak_memory > 0
    assert r.node == "pyf-n1"
    assert r.compile_exit_code == 0 and r.compile_output == b""
    assert r.error == "" and r.error_code == "" and r.exception() is None
    assert "exit_code=3" in repr(r)
    # Bytes that are not UTF-8 stay bytes; the text accessor replaces them.
    r = client.run_code("import sys; sys.stdout.buffer.write(b'\\xff\\xfeok')", image=image)
    assert r.ok and r.stdout == b"\xff\xfeok" and r.stdout_text == "\ufffd\ufffdok"


def test_shell_call(fc):
    client, image = fc
    r = client.run_code('echo "$1|$GREETING"; cat data.txt; exit 4', language="shell", args=["arg one"],
                        env={"GREETING": "hi"}, files={"data.txt": b"from a file\n"}, image=image)
    assert r.exit_code == 4
    assert r.stdout == b"arg one|hi\nfrom a file\n"


@pytest.mark.parametrize("language, code", [
    ("c", '#include <stdio.h>\nint main(int argc, char **argv) {\n  int a, b;\n'
          '  if (scanf("%d %d", &a, &b) != 2) return 9;\n'
          '  printf("%d %s\\n", a + b, argv[1]);\n  return 5;\n}\n'),
    ("cpp", '#include <iostream>\n#include <vector>\nint main(int argc, char **argv) {\n  int a, b;\n'
            '  if (!(std::cin >> a >> b)) return 9;\n  std::vector<int> v{a, b};\n'
            '  std::cout << v[0] + v[1] << " " << argv[1] << std::endl;\n  return 5;\n}\n'),
])
def test_compiled_calls(fc, language, code):
    client, image = fc
    r = client.run_code(code, language=language, stdin="40 2", args=["x"], image=image, timeout=10)
    assert r.compile_exit_code == 0, r.compile_output
    assert r.compile_seconds > 0
    assert r.exit_code == 5, (r, r.stderr)
    assert r.stdout == b"42 x\n"


def test_compile_errors_are_results(fc):
    client, image = fc
    r = client.run_code("int main( { return 0; }", language="c", image=image)
    assert r.compile_exit_code != 0
    assert b"error" in r.compile_output
    assert r.exit_code == -1 and not r.ok and r.error == ""


def test_limits_end_the_call_not_the_client(fc):
    client, image = fc
    r = client.run_code("while True: pass", image=image, timeout=5, cpu_time=0.5)
    assert r.timed_out and not r.ok
    r = client.run_code("import time; time.sleep(30)", image=image, timeout=0.5)
    assert r.timed_out and r.duration < 5
    r = client.run_code("x = [b'y' * (1 << 20) for _ in range(1024)]", image=image, memory="64Mi", timeout=20)
    assert r.oom_killed or b"MemoryError" in r.stderr, (r, r.stderr)
    assert not r.ok
    r = client.run_code("import sys\nfor _ in range(200): sys.stdout.write('x' * 65536)\n", image=image,
                        max_output_bytes=1000, timeout=20)
    assert r.stdout_truncated and len(r.stdout) == 1000
    # The pool still serves.
    assert client.run_code("print(6 * 7)", image=image).stdout == b"42\n"


def test_errors_are_exceptions(fc, fncall_agent):
    client, image = fc
    with pytest.raises(dsec.InvalidArgument) as info:
        client.run_code("x", language="cobol")
    assert isinstance(info.value, ValueError) and "language" in str(info.value)
    for kw, field in [({"timeout": -1}, "timeout"), ({"files": {"/etc/passwd": b"x"}}, "files"),
                      ({"memory": "lots"}, "memory"), ({"env": {"A=B": "x"}}, "env"), ({"stdin": 7}, "stdin"),
                      ({"args": "not a list"}, "args"), ({"gpu_mode": "half"}, "gpu_mode")]:
        with pytest.raises(dsec.InvalidArgument) as info:
            client.run_code("print(1)", image=image, **kw)
        assert field in str(info.value), (kw, str(info.value))
    with pytest.raises(dsec.NotFound) as info:
        client.run_code("print(1)", image="no-such-image")
    assert isinstance(info.value, KeyError)
    with dsec.Client(endpoints=["unix:" + os.path.join(os.path.dirname(fncall_agent[0].socket), "none.sock")],
                     call_deadline=2, max_attempts=2) as down:
        with pytest.raises(dsec.Unavailable):
            down.run_code("print(1)", image=image)
        with pytest.raises(dsec.Unavailable) as info:
            down.run_code_many([{"code": "print(1)", "image": image}] * 3)
        assert "no node could run any of the 3 calls" in str(info.value)
    closed = dsec.Client(endpoints=[fncall_agent[0].endpoint])
    closed.close()
    with pytest.raises(dsec.FailedPrecondition):
        closed.run_code("print(1)", image=image)


def test_run_code_many_order_and_per_call_errors(fc):
    client, image = fc
    calls: list = [{"code": f"print({i} * {i})", "image": image} for i in range(40)]
    calls[7] = {"code": "print(1)", "image": "no-such-image"}
    calls[11] = dsec.fncall_request("echo shell $1", language="shell", args=["eleven"], image=image)
    calls[13] = {"code": "print(1)", "image": image, "timeout": -1}
    calls[17] = {"code": "import sys; sys.exit(2)", "image": image}
    results = client.run_code_many(calls)
    assert len(results) == 40
    for i, r in enumerate(results):
        if i == 7:
            assert r.error_code == "NOT_FOUND" and "no-such-image" in r.error, r
            assert isinstance(r.exception(), dsec.NotFound)
            assert "NOT_FOUND" in repr(r)
        elif i == 11:
            assert r.stdout == b"shell eleven\n"
        elif i == 13:
            assert r.error_code == "INVALID_ARGUMENT" and "timeout" in r.error
            assert isinstance(r.exception(), ValueError)
        elif i == 17:
            assert r.exit_code == 2 and r.error == ""  # a failing program is a result
        else:
            assert r.ok and r.stdout == f"{i * i}\n".encode(), (i, r, r.stderr)
            assert r.node == "pyf-n1"
    assert client.run_code_many([]) == []
    with pytest.raises(dsec.InvalidArgument):
        client.run_code_many(["print(1)"])
    with pytest.raises(dsec.InvalidArgument) as info:
        client.run_code_many([{"code": "print(1)"}, {"code": "x", "bogus": 1}])
    assert "calls[1]" in str(info.value)


def test_run_code_many_spreads_over_nodes_and_survives_a_dead_one(fncall_agent, fncall_home, short_tmp):
    agent, image = fncall_agent
    home, _ = fncall_home
    root = os.path.join(short_tmp, "f2")
    own_home = os.path.join(root, "home")
    os.makedirs(own_home, exist_ok=True)
    second = Agent(root, "pyf-n2", backends="container,fncall", home=own_home,
                   extra_args=("--store", os.path.join(home, "store"), "--cgroup-name", "dsec-pyf2"))
    try:
        with dsec.Client(endpoints=[agent.endpoint, second.endpoint]) as client:
            calls = [{"code": f"print({i})", "image": image} for i in range(120)]
            results = client.run_code_many(calls)
            assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(120)]
            by_node = Counter(r.node for r in results)
            assert set(by_node) == {"pyf-n1", "pyf-n2"} and min(by_node.values()) >= 30, by_node
            # The second node dies: its share runs on the first, nothing is lost or answered twice.
            second.stop()
            results = client.run_code_many(calls)
            assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(120)], \
                [r.error for r in results if r.error][:3]
            assert {r.node for r in results} == {"pyf-n1"}
            assert client.run_code("print(7)", image=image).node == "pyf-n1"
    finally:
        second.stop()


def test_calls_from_many_threads(fc):
    """Blocking calls release the GIL: calls from threads overlap."""
    client, image = fc
    out: list = [None] * 6

    def work(i: int) -> None:
        out[i] = client.run_code(f"import time; time.sleep(0.5); print({i})", image=image, timeout=20)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(out))]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - start
    assert [r.stdout for r in out] == [f"{i}\n".encode() for i in range(len(out))]
    assert took < 0.5 * len(out) - 0.5, f"6 calls of 0.5 s from 6 threads took {took:.2f} s: they did not overlap"


def test_judge_example_small(fncall_home, short_tmp):
    """examples/judge.py on 50 samples, with its default embedded agent: every sample judged as it was meant."""
    home, image = fncall_home
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    # A home of its own (the agent's records, layer cache and cgroups), images from the module's store.
    own_home = os.path.join(short_tmp, "jhome")
    os.makedirs(own_home, exist_ok=True)
    # A wall limit above the default 2 s: on 2 cores, a dozen memory hogs at once take up to 2 s each to reach
    # their limit (the kernel reclaims before its OOM killer acts), and one that has not by then is judged TLE.
    p = subprocess.run([sys.executable, os.path.join(EXAMPLES, "judge.py"), "--solutions", "50", "--image", image,
                        "--home", own_home, "--store", os.path.join(home, "store"), "--json", "--wall-limit", "5"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["solutions"] == 50
    assert summary["as_intended"] == 50, (summary["mismatches"], p.stdout)
    assert summary["total"].get("AC", 0) > 10 and summary["total"].get("WA", 0) > 0
    assert summary["calls"] > 50 and not summary["errors"]
