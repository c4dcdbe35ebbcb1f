"""Function calls (the fncall backend) against a real dsecd over HTTP: each language, nothing of one call visible to
the next, limits that end only their own call, crashes that do not poison a pool, concurrency, bad input, GPUs from
a fake device list.

The calls run over an image with python3, gcc and g++, built once with debootstrap into a store kept between runs
($DSEC_TEST_IMAGE_HOME, default /var/tmp/dsec-test-images: a few minutes the first time, then reused). The test
skips, saying why, when that image cannot be built here.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time

import pytest

import dsec_testlib as lib

IMAGE = "fncall-test:1"
IMAGE_PACKAGES = "python3,gcc,g++,libc6-dev"
IMAGE_HOME = os.environ.get("DSEC_TEST_IMAGE_HOME", "/var/tmp/dsec-test-images")


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def unb64(text: str) -> str:
    return base64.b64decode(text).decode(errors="replace")


@pytest.fixture(scope="module")
def image_store():
    """The store holding IMAGE, built on first use and kept for later runs."""
    store = os.path.join(IMAGE_HOME, "store")
    os.makedirs(IMAGE_HOME, exist_ok=True)
    with open(os.path.join(IMAGE_HOME, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time, across sessions
        ls = subprocess.run([str(lib.DSEC_CLI), "image", "ls", "--home", IMAGE_HOME], capture_output=True, text=True)
        if IMAGE not in ls.stdout:
            if shutil.which("debootstrap") is None:
                pytest.skip("debootstrap is not installed: the fncall test image cannot be built "
                            "(apt-get install debootstrap)")
            r = subprocess.run([str(lib.DSEC_CLI), "image", "build", IMAGE, "--from", "debootstrap:bookworm",
                                "--include", IMAGE_PACKAGES, "--home", IMAGE_HOME, "-q"],
                               stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1800)
            if r.returncode != 0:
                pytest.skip(f"cannot build the fncall test image {IMAGE} with debootstrap: {r.stderr[-2000:]}")
    return store


@pytest.fixture(scope="module")
def fc(image_store, image_home):
    """A dsecd serving function calls over IMAGE (warm python and shell pools) and containers; fake GPUs 0 and 1,
    two shares each. Teardown checks that it left nothing behind, its fncall cgroups and servers included."""
    home = tempfile.mkdtemp(prefix="dsec-it-fncall-")
    a = lib.Agent(home, tag="fc", extra_args=[
        "--backends", "container,fncall", "--store", image_store, "--store", os.path.join(image_home, "store"),
        "--fncall-image", IMAGE, "--fncall-warm", "python,shell", "--fncall-pool", "python=2:6",
        "--fncall-gpus", "0,1", "--fncall-gpu-shares", "2", "--fncall-queue-wait", "30"])
    try:
        a.start(timeout=60)
    except Exception:
        a.stop()
        shutil.rmtree(home, ignore_errors=True)
        raise
    try:
        yield a
    finally:
        status = a.stop()
        problems = a.leftovers() + lib.leftovers(a.run_dir, a.cgroup_name + "-fncall")
        problems += [f"fncall cgroup root left: {r}" for r in lib.cgroup_roots(a.cgroup_name + "-fncall")]
        log = a.log_tail()
        if not problems:
            a.remove_husks()
        shutil.rmtree(home, ignore_errors=True)
        assert status == 0, f"dsecd exited with {status} on SIGTERM:\n{log}"
        assert not problems, "dsecd left things behind:\n  " + "\n  ".join(problems) + f"\nlog:\n{log}"


def post(agent, path: str, body, timeout: float = 120) -> lib.RawResponse:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return lib.http_request(agent.socket_path, "POST", path, data, {"Content-Type": "application/json"},
                            timeout=timeout)


def run(agent, **call) -> dict:
    """POST /v1/fncall; the answer with stdout, stderr and compile_output decoded."""
    r = post(agent, "/v1/fncall", call)
    assert r.status == 200, r
    out = r.json()
    for k in ("stdout", "stderr", "compile_output"):
        out[k] = unb64(out[k])
    return out


def error_of(r: lib.RawResponse) -> tuple[int, str, str]:
    j = r.json()
    return r.status, j.get("code"), j.get("message", "")


def test_node_reports_warm_pools(fc):
    n = lib.http_request(fc.socket_path, "GET", "/v1/node").json()
    assert "fncall" in n["backends"] and "container" in n["backends"]
    f = n["fncall"]
    assert sorted(f["languages"]) == ["c", "cpp", "python", "shell"]
    assert f["default_image"] == IMAGE
    assert f["gpus"] == ["0", "1"] and f["gpu_shares"] == 2
    # The warm pools come up in the background; the python one keeps its minimum of 2 armed servers.

    def warm():
        pools = lib.http_request(fc.socket_path, "GET", "/v1/node").json()["fncall"]["pools"]
        by_lang = {p["language"]: p for p in pools}
        armed = by_lang.get("python", {}).get("idle", 0) >= 2 and by_lang.get("shell", {}).get("idle")
        return by_lang if armed else None
    pools = lib.wait_for(warm, 60, 0.2)
    assert pools, lib.http_request(fc.socket_path, "GET", "/v1/node").json()["fncall"]
    assert pools["python"]["image"].startswith(IMAGE + "@sha256:")
    assert (pools["python"]["min"], pools["python"]["max"]) == (2, 6)


def test_python_stdin_args_files_and_env(fc):
    code = (
        "import sys, os\n"
        "data = sys.stdin.read()\n"
        "print(data.upper(), sys.argv[1:], open('inputs/a.txt').read(), os.environ['GREETING'], os.getcwd())\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(42)\n")
    out = run(fc, code=code, stdin=b64("hello"), args=["one", "two words"], files={"inputs/a.txt": b64("file-a")},
              env={"GREETING": "hi"})
    assert out["exit_code"] == 42 and out["signal"] == 0, out
    assert out["stdout"] == "HELLO ['one', 'two words'] file-a hi /tmp\n"
    assert out["stderr"] == "to stderr\n"
    assert not out["timed_out"] and not out["oom_killed"]
    assert out["node"] == fc.node_id and out["gpus"] == []
    assert out["duration"] > 0 and out["cpu_time"] > 0 and out["peak_memory"] > 0
    # An uncaught exception: Python's traceback, exit status 1.
    out = run(fc, code="def f():\n    raise ValueError('boom')\nf()\n")
    assert out["exit_code"] == 1
    assert "ValueError: boom" in out["stderr"] and 'File "main.py", line 3' in out["stderr"], out["stderr"]
    # The runtime's identity: an unprivileged user without capabilities, that sees no other user's processes.
    out = run(fc, code="import os\nst = open('/proc/self/status').read()\n"
                       "print(os.getuid(), [p for p in os.listdir('/proc') if p.isdigit()] == [str(os.getpid())], "
                       "[l for l in st.splitlines() if l.startswith(('CapEff', 'NoNewPrivs', 'Seccomp:'))])")
    assert out["stdout"] == "65534 True ['CapEff:\\t0000000000000000', 'NoNewPrivs:\\t1', 'Seccomp:\\t2']\n", out


def test_shell(fc):
    out = run(fc, language="shell", code='read line; echo "$line|$1|$2|$#"; echo oops >&2; exit 3',
              args=["a", "b c"], stdin=b64("input line\n"))
    assert (out["exit_code"], out["stdout"], out["stderr"]) == (3, "input line|a|b c|2\n", "oops\n"), out
    out = run(fc, language="shell", code="cat data.csv | wc -l", files={"data.csv": b64("1\n2\n3\n")})
    assert out["stdout"].strip() == "3"


def test_c_and_cpp(fc):
    c = ("#include <math.h>\n#include <stdio.h>\n"
         "int main(int argc, char** argv) { int n; scanf(\"%d\", &n); printf(\"%s %.3f\\n\", argv[1], sqrt(n)); "
         "return 5; }\n")
    out = run(fc, language="c", code=c, stdin=b64("16"), args=["arg"])
    assert (out["compile_exit_code"], out["exit_code"], out["stdout"]) == (0, 5, "arg 4.000\n"), out
    assert out["compile_seconds"] > 0 and out["duration"] > 0
    cpp = ("#include <iostream>\n#include <vector>\n#include <numeric>\n"
           "int main() { std::vector<long> v(1000, 2); std::cout << std::accumulate(v.begin(), v.end(), 0L) "
           "<< std::endl; }\n")
    out = run(fc, language="cpp", code=cpp)
    assert (out["compile_exit_code"], out["exit_code"], out["stdout"]) == (0, 0, "2000\n"), out
    # The program's own numbers: not the compiler's hundreds of MiB.
    assert 0 < out["peak_memory"] < 64 << 20, out["peak_memory"]
    # A compile error: the compiler's messages, nothing run.
    out = run(fc, language="cpp", code="int main() { return undefined_name; }\n")
    assert out["compile_exit_code"] != 0 and out["exit_code"] == -1 and out["stdout"] == "", out
    assert "undefined_name" in out["compile_output"] and "main.cpp:1" in out["compile_output"]


def test_nothing_of_a_call_reaches_the_next(fc):
    marker = f"dsec-residue-{os.getpid()}"
    leave = (
        "import os, json, subprocess\n"
        "open('/tmp/left.txt', 'w').write('x')\n"
        "os.makedirs('/tmp/sub', exist_ok=True)\n"
        "open('/dev/shm/left', 'w').write('x')\n"
        "os.environ['LEFT'] = '1'\n"
        "os.putenv('LEFT2', '1')\n"
        "json.dumps = lambda *a, **k: 'PATCHED'\n"
        "import math\n"
        "math.pi = 3\n"
        f"subprocess.Popen(['python3', '-c', 'import time; time.sleep(300)', '{marker}'], start_new_session=True)\n"
        "print('left')\n")
    check = (
        "import os, json, math\n"
        "print(sorted(os.listdir('/tmp')), sorted(os.listdir('/dev/shm')), os.environ.get('LEFT'), "
        "os.environ.get('LEFT2'), json.dumps([1]), math.pi == 3, [p for p in os.listdir('/proc') if p.isdigit()] "
        "== [str(os.getpid())])\n")
    for _ in range(4):  # enough calls to land on every armed server of the pool
        assert run(fc, code=leave)["stdout"] == "left\n"
        out = run(fc, code=check)
        assert out["stdout"] == "[] [] None None [1] False True\n", out
    # The background processes died with their calls: none is left anywhere on the host.

    def stragglers():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(pid)
            except OSError:
                pass
        return found
    lib.wait_for(lambda: not stragglers(), 5)
    assert not stragglers()


def test_limits_end_only_their_own_call(fc):
    started = time.monotonic()
    out = run(fc, code="while True: pass", timeout=1)
    assert out["timed_out"] and out["signal"] == 9 and out["exit_code"] == -1, out
    assert 0.9 < out["duration"] < 5
    out = run(fc, code="while True: pass", timeout=20, cpu_time=0.5)
    assert out["timed_out"] and out["signal"] == 9, out
    assert 0.4 < out["cpu_time"] < 2 and out["duration"] < 15, out
    out = run(fc, code="x = []\nwhile True: x.append(bytearray(10**7))", memory="64Mi")
    assert out["oom_killed"] and out["signal"] == 9, out
    assert out["peak_memory"] <= 64 << 20
    out = run(fc, language="shell", code="f() { f | f & }; f; sleep 1; echo contained", pids=32, timeout=5)
    assert "contained" in out["stdout"] and "fork" in out["stderr"].lower(), out
    out = run(fc, code="import sys\nwhile True: sys.stdout.write('y' * 65536)", max_output_bytes=100000, timeout=10)
    assert out["stdout_truncated"] and out["stdout"] == "y" * 100000 and not out["timed_out"], out
    out = run(fc, language="c", code="#include <stdio.h>\nint main(){ for(;;) fputs(\"zzzzzzzz\", stdout); }",
              max_output_bytes=4096, timeout=10)
    assert out["stdout_truncated"] and len(out["stdout"]) == 4096 and out["signal"] == 13, out  # SIGPIPE
    assert time.monotonic() - started < 60
    # The node and its pools are fine.
    assert run(fc, code="print('still here')")["stdout"] == "still here\n"
    assert run(fc, language="shell", code="echo ok")["stdout"] == "ok\n"


def test_crashes_do_not_poison_the_pool(fc):
    crashes = [
        ("import ctypes\nctypes.string_at(0)", -1, 11),                  # segfault
        ("import os\nos.abort()", -1, 6),                                 # SIGABRT
        ("import os\nos.kill(os.getpid(), 15)", -1, 15),                  # a signal to itself ends it as usual
        ("import os\nos._exit(3)", 3, 0),
        # Everything it can reach: its own processes only (the server and other calls are another user's).
        ("import os\nfor p in range(1, 4096):\n    try: os.kill(p, 9)\n    except OSError: pass\nprint('x')", -1, 9),
        ("import os\ntry:\n    os.kill(-1, 9)\nexcept OSError:\n    pass\nprint('still here')", 0, 0),
    ]
    for code, exit_code, signal in crashes:
        out = run(fc, code=code)
        assert (out["exit_code"], out["signal"]) == (exit_code, signal), (code, out)
    for _ in range(6):
        assert run(fc, code="print(6 * 7)")["stdout"] == "42\n"


def test_many_calls_at_once(fc):
    # A batch, run concurrently within the pools: results in order, each its own.
    calls = [{"code": f"import time\ntime.sleep(0.2)\nprint({i} * {i})"} for i in range(24)]
    calls += [{"language": "shell", "code": f"echo $(({i} + 1))"} for i in range(8)]
    started = time.monotonic()
    r = post(fc, "/v1/fncall/batch", {"calls": calls})
    elapsed = time.monotonic() - started
    assert r.status == 200, r
    results = r.json()["results"]
    assert [unb64(x["stdout"]) for x in results[:24]] == [f"{i * i}\n" for i in range(24)]
    assert [unb64(x["stdout"]) for x in results[24:]] == [f"{i + 1}\n" for i in range(8)]
    assert elapsed < 24 * 0.2, f"the batch's calls did not run concurrently ({elapsed:.1f}s)"
    # The python pool grew with the load, within its max.
    pools = lib.http_request(fc.socket_path, "GET", "/v1/node").json()["fncall"]["pools"]
    py = [p for p in pools if p["language"] == "python"][0]
    assert 2 < py["idle"] + py["busy"] + py["starting"] <= 6, py
    # Separate requests at once, from threads.
    got = {}

    def one(i):
        got[i] = run(fc, code=f"print({i})")["stdout"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {i: f"{i}\n" for i in range(12)}


def test_bad_input(fc):
    st, code, msg = error_of(post(fc, "/v1/fncall", {"language": "cobol", "code": "x"}))
    assert (st, code) == (400, "INVALID_ARGUMENT") and "language" in msg
    st, code, msg = error_of(post(fc, "/v1/fncall", {"code": "#" * (5 << 20)}))
    assert (st, code) == (400, "INVALID_ARGUMENT") and "code" in msg
    st, code, msg = error_of(post(fc, "/v1/fncall", {"code": "1", "files": {"../etc/passwd": b64("x")}}))
    assert (st, code) == (400, "INVALID_ARGUMENT")
    st, code, msg = error_of(post(fc, "/v1/fncall", b"{not json"))
    assert (st, code) == (400, "INVALID_ARGUMENT")
    st, code, msg = error_of(post(fc, "/v1/fncall", {"code": "1", "image": "no-such-image:7"}))
    assert (st, code) == (404, "NOT_FOUND") and "no-such-image" in msg
    # An image without python3 cannot hold fork servers.
    st, code, msg = error_of(post(fc, "/v1/fncall", {"code": "1", "language": "shell", "image": "busybox"}))
    assert code == "FAILED_PRECONDITION" and "python3" in msg, msg
    # More GPUs than the node has: refused at once, not queued.
    st, code, msg = error_of(post(fc, "/v1/fncall", {"code": "1", "gpu_mode": "exclusive", "gpus": 3}))
    assert code == "FAILED_PRECONDITION", msg
    # A batch: a bad element is that element's error; the others run.
    r = post(fc, "/v1/fncall/batch", {"calls": [{"code": "print(1)"}, {"language": "cobol", "code": ""},
                                                {"code": "print(3)"}]})
    assert r.status == 200, r
    results = r.json()["results"]
    assert unb64(results[0]["stdout"]) == "1\n" and unb64(results[2]["stdout"]) == "3\n"
    assert results[1]["error"]["code"] == "INVALID_ARGUMENT" and "calls[1]" in results[1]["error"]["message"]
    st, code, msg = error_of(post(fc, "/v1/fncall/batch", {"calls": []}))
    assert (st, code) == (400, "INVALID_ARGUMENT")
    st, code, msg = error_of(lib.http_request(fc.socket_path, "GET", "/v1/fncall"))
    assert st == 405 or code == "INVALID_ARGUMENT" or code == "UNIMPLEMENTED", (st, code, msg)


def test_gpus_from_a_fake_device_list(fc):
    # This host has no /dev/nvidia*: calls get their devices' CUDA_VISIBLE_DEVICES and no device node.
    code = "import os\nprint(os.environ.get('CUDA_VISIBLE_DEVICES'), os.path.exists('/dev/nvidia0'))"
    out = run(fc, code=code, gpu_mode="exclusive", gpus=2)
    assert out["gpus"] == ["0", "1"] and out["stdout"] == "0,1 False\n", out
    out = run(fc, code=code, gpu_mode="shared")
    assert len(out["gpus"]) == 1 and out["stdout"] == f"{out['gpus'][0]} False\n", out
    assert run(fc, code=code)["stdout"] == "None False\n"
    # Two exclusive calls for both GPUs: the second waits for the first, then runs.
    results = {}

    def hold(i):
        results[i] = run(fc, code="import time, os\ntime.sleep(0.5)\nprint(os.environ['CUDA_VISIBLE_DEVICES'])",
                         gpu_mode="exclusive", gpus=2, timeout=20)

    threads = [threading.Thread(target=hold, args=(i,)) for i in range(2)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r["stdout"] == "0,1\n" for r in results.values()), results
    assert time.monotonic() - started >= 1.0  # one after the other


def test_a_retried_call_is_answered_once(fc):
    body = {"code": "import random\nprint(random.random())", "request_id": f"retry-{os.getpid()}"}
    first = post(fc, "/v1/fncall", body).json()
    again = post(fc, "/v1/fncall", body).json()
    assert first == again
    other = post(fc, "/v1/fncall", {"code": body["code"]}).json()
    assert unb64(other["stdout"]) != unb64(first["stdout"])  # a fresh call draws fresh numbers


def test_a_crashed_agent_leaves_nothing_after_its_restart(image_store):
    home = tempfile.mkdtemp(prefix="dsec-it-fncall-crash-")
    args = ["--backends", "fncall", "--store", image_store, "--fncall-image", IMAGE, "--fncall-warm", "python",
            "--fncall-pool", "python=1:2"]
    crashed = lib.Agent(home, tag="fck", extra_args=args)
    subtree = crashed.cgroup_name + "-fncall"
    restarted = None
    try:
        crashed.start(timeout=60)
        assert run(crashed, code="print(1)")["stdout"] == "1\n"
        assert lib.processes_in_cgroup(subtree), "no fork server processes in the fncall cgroups"
        crashed.proc.kill()
        crashed.proc.wait()
        # Its fork servers end on their own: the agent's end of their control sockets closed with it.
        assert lib.wait_for(lambda: not lib.processes_in_cgroup(subtree), 10), lib.processes_in_cgroup(subtree)
        # What they left (empty cgroups, run directories) goes when an agent starts on the same names again.
        restarted = lib.Agent(home, tag="fck", extra_args=["--backends", "fncall", "--store", image_store,
                                                           "--fncall-image", IMAGE, "--fncall-idle", "1",
                                                           "--fncall-pool", "python=0:3"])
        restarted.start(timeout=60)

        def stale():
            left = [p for p in lib.leftovers(restarted.run_dir, subtree) if "cgroup" in p or "process" in p]
            fncall_dir = os.path.join(restarted.run_dir, "fncall")
            return left + [f"run dir entry: {e}" for e in (os.listdir(fncall_dir) if os.path.isdir(fncall_dir) else [])]
        assert lib.wait_for(lambda: not stale(), 10), stale()
        assert run(restarted, code="print(2)")["stdout"] == "2\n"
        # A pool with no minimum gives its servers up once they idled past --fncall-idle.

        def servers():
            pools = lib.http_request(restarted.socket_path, "GET", "/v1/node").json()["fncall"]["pools"]
            return sum(p["idle"] + p["busy"] + p["starting"] for p in pools)
        assert servers() >= 1
        assert lib.wait_for(lambda: servers() == 0, 15, 0.2), servers()
        # A retired server leaves the pool's count at once; its process is killed by a cleanup worker just after.
        assert lib.wait_for(lambda: not lib.processes_in_cgroup(subtree), 10), lib.processes_in_cgroup(subtree)
        assert run(restarted, code="print(3)")["stdout"] == "3\n"  # and starts them again on the next call
        status = restarted.stop()
        assert status == 0, restarted.log_tail()
        problems = restarted.leftovers() + lib.leftovers(restarted.run_dir, subtree)
        problems += [f"fncall cgroup root left: {r}" for r in lib.cgroup_roots(subtree)]
        assert not problems, "\n".join(problems) + "\n" + restarted.log_tail()
    finally:
        for a in (crashed, restarted):
            if a is not None:
                a.stop()
        for pid, _ in lib.processes_in_cgroup(subtree):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        crashed.remove_husks()
        for root in lib.cgroup_roots(subtree):
            for dirpath, _, _ in sorted(os.walk(root), key=lambda t: -len(t[0])):
                try:
                    os.rmdir(dirpath)
                except OSError:
                    pass
        shutil.rmtree(crashed.run_dir, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
