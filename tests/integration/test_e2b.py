"""dsec-e2b driven by the official E2B JavaScript SDK, unmodified: the SDK pinned in tests/e2b/package.json runs the
scenarios of tests/e2b/scenarios.mjs (commands, files, lifecycle, reconnecting from another process, concurrency,
errors, API keys) against a real gateway over a real agent, and each scenario's JSON result is checked here.

The SDK is installed with `npm ci` into $DSEC_BUILD_DIR/e2b-node/<hash of package.json and package-lock.json>, once
per lock file. The module's gateway runs an embedded agent on the test store ($DSEC_HOME, which holds the
bookworm-python image that scripts/test.sh builds) with a cgroup subtree and node id of its own; at the end it is
stopped with SIGTERM and nothing of its sandboxes may be left. Two more gateways: one over two agents found through
a private etcd, one with --tokens.

Everything skips, with the reason, without node/npm (or when the pinned SDK cannot be installed) and without the
dsec-e2b binary.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import os
import pathlib
import re
import select
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

import cluster_lib as cl
import dsec_testlib as lib

E2B_DIR = lib.REPO / "tests" / "e2b"
GATEWAY = lib.BUILD / "bin" / "dsec-e2b"
SDK_VERSION = "2.51.0"
TEMPLATE = "bookworm-python"
API_KEY = "e2b_0123456789abcdef0123456789abcdef01234567"
WRONG_KEY = "e2b_fedcba9876543210fedcba9876543210fedcba98"
ENVD_VERSION = "0.6.4"

pytestmark = pytest.mark.skipif(not GATEWAY.exists(), reason=f"no dsec-e2b gateway at {GATEWAY} (build it)")


# ------------------------------------------------------------------------------------------------- the SDK

def _node_version() -> tuple[int, ...] | None:
    try:
        r = subprocess.run(["node", "--version"], capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    m = re.match(r"v(\d+)\.(\d+)\.(\d+)", r.stdout.strip())
    return tuple(int(x) for x in m.groups()) if m else None


@pytest.fixture(scope="module")
def scenarios():
    """The path of scenarios.mjs beside an installed copy of the pinned SDK (ESM imports resolve from the script's
    own directory, so the script is copied next to node_modules)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed to run the E2B JavaScript SDK (apt-get install nodejs npm)")
    version = _node_version()
    # e2b 2.51.0's engines: node >=20.18.1 <21 || >=22.
    if version is None or version < (20, 18, 1) or (21,) <= version[:1] < (22,):
        pytest.skip(f"the E2B SDK {SDK_VERSION} needs node >= 20.18.1 (<21) or >= 22; this node is {version}")
    pkg = (E2B_DIR / "package.json").read_bytes()
    lock = (E2B_DIR / "package-lock.json").read_bytes()
    key = hashlib.sha256(pkg + b"\0" + lock).hexdigest()[:16]
    root = lib.BUILD / "e2b-node"
    dest = root / key
    if not (dest / ".installed").exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"tmp-{key}-", dir=root))
        try:
            shutil.copy(E2B_DIR / "package.json", tmp / "package.json")
            shutil.copy(E2B_DIR / "package-lock.json", tmp / "package-lock.json")
            env = dict(os.environ, NPM_CONFIG_UPDATE_NOTIFIER="false", NPM_CONFIG_FUND="false",
                       NPM_CONFIG_AUDIT="false")
            try:
                r = subprocess.run(["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
                                   cwd=tmp, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                   timeout=600)
            except subprocess.TimeoutExpired:
                pytest.skip("npm ci of the pinned E2B SDK did not finish within 600 s")
            if r.returncode != 0:
                pytest.skip(f"npm ci of the pinned E2B SDK failed ({r.returncode}): {(r.stderr or r.stdout)[-1500:]}")
            got = json.loads((tmp / "node_modules" / "e2b" / "package.json").read_text())["version"]
            assert got == SDK_VERSION, f"npm ci installed e2b {got}, not the pinned {SDK_VERSION}"
            (tmp / ".installed").write_text(SDK_VERSION + "\n")
            try:
                os.rename(tmp, dest)
            except OSError:
                pass  # another run installed the same lock file first; use its copy
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        # Copies for older lock files go.
        for old in root.iterdir():
            if old.name != key and not old.name.startswith("tmp-") and (old / ".installed").exists():
                shutil.rmtree(old, ignore_errors=True)
    script = dest / f"scenarios-{os.getpid()}.mjs"
    shutil.copy(E2B_DIR / "scenarios.mjs", script)
    yield script
    try:
        script.unlink()
    except OSError:
        pass


@pytest.fixture(scope="module")
def dsec_home():
    home = os.environ.get("DSEC_HOME", "")
    if not home:
        pytest.skip("DSEC_HOME is not set (scripts/test.sh sets it to the test store, which holds bookworm-python)")
    if not os.path.exists(os.path.join(home, "store", "refs", f"{TEMPLATE}%3Alatest")):
        pytest.fail(f"the test store {home} has no {TEMPLATE} image: scripts/test.sh builds it "
                    f"(dsec image build {TEMPLATE} --from debootstrap:bookworm --include python3)")
    return home


# ------------------------------------------------------------------------------------------------- the gateway

class Gateway:
    """One dsec-e2b on 127.0.0.1:<free port>. With `embedded` (no --endpoint/--etcd among `extra_args`) it runs its
    own dsecd, given a cgroup subtree and node id of this test's through --agent-arg."""

    def __init__(self, home: str, *, tag: str, embedded: bool = True, extra_args=()) -> None:
        self.home = home
        self.embedded = embedded
        self.tmp = tempfile.mkdtemp(prefix="dsec-it-e2b-")
        self.log_path = os.path.join(self.tmp, "dsec-e2b.log")
        self.cgroup_name = f"dsec-test-{os.getpid()}-e2b{tag}"
        self.node_id = f"e2b{os.getpid()}{tag}"
        self.args = [str(GATEWAY), "--listen", "127.0.0.1:0", "--home", home]
        if embedded:
            self.args += ["--agent-arg=--cgroup-name", f"--agent-arg={self.cgroup_name}",
                          "--agent-arg=--node-id", f"--agent-arg={self.node_id}"]
        self.args += list(extra_args)
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.agent_pid: int | None = None
        self.run_dir: str | None = None
        self.agent_socket: str | None = None
        self._drain: threading.Thread | None = None

    def start(self, timeout: float = 90.0) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"dsec-e2b printed no 'listening on' line within {timeout}s:\n{self.log_tail()}")
            r, _, _ = select.select([self.proc.stdout], [], [], min(left, 0.5))
            if r:
                b = os.read(self.proc.stdout.fileno(), 1)
                if not b:
                    self.proc.wait(10)
                    raise RuntimeError(f"dsec-e2b exited with {self.proc.returncode} before serving "
                                       f"(stdout {line!r}):\n{self.log_tail()}")
                line += b
            elif self.proc.poll() is not None:
                raise RuntimeError(f"dsec-e2b exited with {self.proc.returncode} before serving:\n{self.log_tail()}")
        m = re.fullmatch(r"listening on 127\.0\.0\.1:(\d+)", line.decode().strip())
        assert m, f"dsec-e2b's first line is not 'listening on 127.0.0.1:PORT': {line!r}"
        self.url = f"http://127.0.0.1:{m.group(1)}"
        self._drain = threading.Thread(target=self._drain_stdout, daemon=True)
        self._drain.start()
        if self.embedded:
            self._find_agent()

    def _drain_stdout(self) -> None:
        with open(self.log_path, "ab") as log:
            for chunk in iter(lambda: os.read(self.proc.stdout.fileno(), 65536), b""):
                log.write(b"[stdout] " + chunk)

    def _find_agent(self) -> None:
        """The embedded dsecd: the process whose argv names our cgroup subtree; its (last) --run-dir and --socket."""
        def find():
            for pid, argv in lib.process_argvs():
                if self.cgroup_name.encode() in argv and any(a.endswith(b"dsecd") for a in argv[:1]):
                    return pid, [a.decode(errors="replace") for a in argv if a]
            return None
        found = lib.wait_for(find, 30, 0.2)
        assert found, (f"dsec-e2b serves, but no embedded dsecd with --cgroup-name {self.cgroup_name} runs (was "
                       f"--agent-arg passed on?):\n{self.log_tail()}")
        self.agent_pid, argv = found

        def last(flag):
            values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
            return values[-1] if values else None
        self.run_dir = last("--run-dir")
        self.agent_socket = last("--socket")

    def env(self, api_key: str = API_KEY) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
        env.update(E2B_API_URL=self.url, E2B_SANDBOX_URL=self.url, E2B_API_KEY=api_key, E2B_TEMPLATE=TEMPLATE)
        return env

    def rest(self, method: str, path: str, body=None, api_key: str | None = API_KEY):
        """(status, parsed JSON body or text, headers) of one control-plane call."""
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if api_key is not None:
            headers["X-API-KEY"] = api_key
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                status, raw, hdrs = r.status, r.read(), dict(r.headers)
        except urllib.error.HTTPError as e:
            status, raw, hdrs = e.code, e.read(), dict(e.headers)
        try:
            return status, json.loads(raw) if raw else None, hdrs
        except ValueError:
            return status, raw.decode(errors="replace"), hdrs

    def agent_sandboxes(self) -> list[dict]:
        """The embedded agent's sandboxes, asked of it directly."""
        res = lib.http_request(self.agent_socket, "GET", "/v1/sandboxes")
        assert res.status == 200, res
        return res.json()["sandboxes"]

    def log_tail(self, n: int = 4000) -> str:
        return lib.file_tail(self.log_path, n)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, and the exit status (SIGKILL after `timeout`, reported as -9)."""
        code = lib.stop_process(self.proc, timeout)
        if self._drain is not None:
            self._drain.join(5)
        return code

    def leftovers(self) -> list[str]:
        if not self.embedded or self.proc is None:
            return []
        problems = []
        if self.agent_pid is not None and not lib.wait_for(lambda: _gone(self.agent_pid), 15):
            problems.append(f"the embedded dsecd {self.agent_pid} still runs after dsec-e2b exited")
        problems += lib.leftovers(self.run_dir or os.path.join(self.tmp, "no-run-dir"), self.cgroup_name)
        return problems

    def remove_husks(self) -> None:
        lib.remove_cgroup_husks(self.cgroup_name)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def stop_and_check(self) -> None:
        """Nothing may be listed any more (every scenario kills what it makes), then SIGTERM: exit 0, and nothing of
        the gateway's agent left on the host."""
        if self.proc is None:
            return
        listed = None
        if self.proc.poll() is None:
            status, listed, _ = self.rest("GET", "/v2/sandboxes")
            if status != 200:
                listed = f"GET /v2/sandboxes answered {status}: {listed}"
        on_agent = []
        if self.embedded and self.agent_socket and self.proc.poll() is None:
            try:
                on_agent = [s["id"] for s in self.agent_sandboxes() if s.get("state") != "destroyed"]
            except (OSError, AssertionError) as e:
                on_agent = [f"(cannot ask the agent: {e})"]
        status = self.stop()
        problems = self.leftovers()
        log = self.log_tail()
        if not problems:
            self.remove_husks()
        assert status == 0, f"dsec-e2b exited with {status} on SIGTERM:\n{log}"
        assert listed == [], f"sandboxes still listed through the gateway at the end: {listed}"
        assert not on_agent, f"sandboxes still on the gateway's agent at the end: {on_agent}"
        assert not problems, "dsec-e2b's agent left things behind:\n  " + "\n  ".join(problems) + f"\nlog:\n{log}"


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("Z", "X")
    except OSError:
        return True


def start_gateway(home: str, **kw) -> Gateway:
    gw = Gateway(home, **kw)
    try:
        gw.start()
    except Exception:
        gw.stop()
        gw.remove_husks()
        raise
    return gw


@pytest.fixture(scope="module")
def gateway(dsec_home):
    """The module's gateway, with an embedded agent on the test store."""
    gw = start_gateway(dsec_home, tag="")
    try:
        yield gw
    finally:
        gw.stop_and_check()


# ------------------------------------------------------------------------------------------------- running scenarios

def _describe(name: str, proc_stdout: str, proc_stderr: str, gw: Gateway) -> str:
    lines = [line for line in proc_stdout.splitlines() if line.strip()]
    try:
        result = json.loads(lines[-1]) if lines else {}
        pretty = "\n".join(f"{k}: {json.dumps(v)[:2000]}" for k, v in result.items()) or "(no JSON line)"
    except ValueError:
        pretty = proc_stdout[-4000:]
    return (f"scenario {name}:\n--- stderr\n{proc_stderr[-4000:]}\n--- result\n{pretty}\n"
            f"--- dsec-e2b log\n{gw.log_tail(3000)}")


def run_scenario(gw: Gateway, script, name: str, *args: str, api_key: str = API_KEY, timeout: float = 300,
                 env: dict | None = None) -> dict:
    """Runs one scenario to its end; it must succeed. Its JSON result."""
    e = gw.env(api_key)
    e["SCENARIO_TIMEOUT_MS"] = str(int((timeout - 20) * 1000))
    e.update(env or {})
    try:
        r = subprocess.run(["node", str(script), name, *args], env=e, cwd=str(script.parent), capture_output=True,
                           text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as t:
        def text(x):
            return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
        pytest.fail(f"scenario {name} did not end within {timeout}s:\n" + _describe(name, text(t.stdout),
                                                                                    text(t.stderr), gw))
    assert r.returncode == 0, f"exit status {r.returncode}\n" + _describe(name, r.stdout, r.stderr, gw)
    return json.loads(r.stdout.strip().splitlines()[-1])


def err(result: dict) -> dict:
    """The error a step expected its call to raise (and not a value)."""
    assert "error" in result, f"expected an error, the call returned {result.get('returned')!r}"
    return result["error"]


# ------------------------------------------------------------------------------------------------- scenarios

def test_basic_commands(gateway, scenarios):
    r = run_scenario(gateway, scenarios, "basic")
    assert r["echo"] == {"stdout": "hello\n", "stderr": "warn\n", "exitCode": 0, "error": None}

    s = r["stream"]
    assert (s["stdout"], s["stderr"], s["exitCode"]) == ("out1\nout2\nout3\nout4\ndone\n",
                                                         "err1\nerr2\nerr3\nerr4\n", 0), s
    # The callbacks saw everything, in order, and as it was printed (not in one piece at the end).
    assert "".join(s["stdoutChunks"]) == s["stdout"] and "".join(s["stderrChunks"]) == s["stderr"], s
    assert len(s["stdoutChunks"]) >= 3 and len(s["stderrChunks"]) >= 3, s
    assert s["stdoutMs"][-1] - s["stdoutMs"][0] >= 800, f"the output came at once, not while the loop ran: {s}"
    assert s["stdoutMs"] == sorted(s["stdoutMs"])

    assert r["bigOutput"] == {"length": 300001, "allX": True, "exitCode": 0}
    assert r["envs"] == {"createLevel": "foo-create|bar-create|unset\n",
                         "perCall": "foo-create|bar-call|baz-call\n",
                         "afterPerCall": "foo-create|bar-create|unset\n"}
    # bookworm-python has no user `user`: commands run as root, in root's home.
    assert r["cwd"] == {"tmp": "/tmp\n", "default": "/root\n/root\n", "made": "/srv/work\n", "srv": "/srv/work\n"}

    f = err(r["failing"])
    assert f["name"] == "CommandExitError" and f["exitCode"] == 3, f
    assert (f["stdout"], f["stderr"]) == ("partial\n", "oops\n"), f

    t = r["timeout"]
    assert err(t)["name"] == "TimeoutError", t
    assert 1500 <= t["elapsedMs"] < 10000, t
    assert t["goneFromList"], f"the timed-out command is still listed: {t}"

    b = r["background"]
    assert b["listedWhileRunning"] and not b["listedAfterWait"], b
    assert (b["stdout"], b["exitCode"]) == ("bg-done\n", 0), b

    found = r["list"]["found"]
    assert found is not None, f"a background command is not in commands.list: {r['list']}"
    assert found["pid"] == r["list"]["pid"]
    assert found["cmd"] == "/bin/bash" and found["args"] == ["-l", "-c", "sleep 60"], found

    k = r["kill"]
    assert k["killed"] is True and k["killUnknownPid"] is False, k
    assert k["killAgain"] == {"returned": False}, k
    assert not k["listedAfterKill"], k
    w = err(k["waited"])
    assert w["name"] == "CommandExitError" and w["exitCode"] != 0, w

    assert r["stdin"]["stdout"] == "hello\nworld\n[cat done]\n" and r["stdin"]["exitCode"] == 0, r["stdin"]
    assert r["user"] == {"root": "root\n", "default": "root\n0\n"}
    assert r["kill sandbox"] is True
    # commands.list reports each process's command as it was started, its working directory, and its environment
    # (the whole of it, read from /proc: it holds the envs the command was given).
    assert found["cmd"] == "/bin/bash" and found["args"] == ["-l", "-c", "sleep 60"], found
    assert (found["envs"] or {}).get("LISTED") == "yes" and found["cwd"] == "/tmp", found


def test_files(gateway, scenarios):
    r = run_scenario(gateway, scenarios, "files")
    assert r["writeText"] == {"relative": {"name": "hello.txt", "type": "file", "path": "/root/hello.txt"},
                              "absolute": {"name": "abs.txt", "type": "file", "path": "/tmp/abs.txt"}}
    assert r["readText"] == {"absolute": "hello world\n", "relative": "hello world\n",
                             "unicode": "absolute ünïcødé ✓\n", "viaCommand": "hello world\n"}

    b = r["bytes"]
    assert b["length"] == 512 and b["equal"], b
    assert b["sha256"] == b["sha256InSandbox"], b
    assert b["bigLength"] == 1 << 20 and b["bigEqual"] and b["bigSha256"] == b["bigSha256InSandbox"], b
    assert r["readMadeByCommand"] == "made by bash"

    m = r["writeMultiple"]
    assert [i["path"] for i in m["infos"]] == ["/tmp/tree/a.txt", "/tmp/tree/sub/b.txt", "/tmp/tree/sub/deeper/c.txt"]
    assert [i["name"] for i in m["infos"]] == ["a.txt", "b.txt", "c.txt"]
    assert m["contents"] == "ABBCCC"

    def summary(entries):
        return [(e["path"], e["name"], e["type"]) + ((e["size"],) if e["type"] == "file" else ()) for e in entries]
    lst = r["list"]
    assert summary(lst["depth1"]) == [("/tmp/tree/a.txt", "a.txt", "file", 1), ("/tmp/tree/sub", "sub", "dir")]
    assert summary(lst["depth2"]) == [("/tmp/tree/a.txt", "a.txt", "file", 1), ("/tmp/tree/sub", "sub", "dir"),
                                      ("/tmp/tree/sub/b.txt", "b.txt", "file", 2),
                                      ("/tmp/tree/sub/deeper", "deeper", "dir")]
    assert summary(lst["depth3"]) == summary(lst["depth2"]) + [("/tmp/tree/sub/deeper/c.txt", "c.txt", "file", 3)]

    assert r["exists"] == {"file": True, "dir": True, "missing": False, "missingParent": False}

    g = r["getInfo"]
    assert (g["file"]["name"], g["file"]["type"], g["file"]["path"], g["file"]["size"]) == \
        ("b.txt", "file", "/tmp/tree/sub/b.txt", 2), g
    assert g["file"]["permissions"].startswith("-rw") and g["file"]["owner"] == "root", g
    mtime = datetime.datetime.fromisoformat(g["file"]["modifiedTime"].replace("Z", "+00:00")).timestamp()
    assert abs(mtime - time.time()) < 600, g
    assert g["dir"]["type"] == "dir" and g["dir"]["permissions"].startswith("d"), g
    assert err(g["missing"])["is"]["NotFoundError"], g

    assert r["makeDir"] == {"first": True, "second": False, "type": "dir", "viaCommand": "isdir\n"}

    rn = r["rename"]
    assert (rn["entry"]["path"], rn["entry"]["name"], rn["entry"]["type"]) == \
        ("/tmp/tree/renamed.txt", "renamed.txt", "file"), rn
    assert (rn["oldExists"], rn["newExists"], rn["content"]) == (False, True, "A"), rn

    rm = r["remove"]
    assert (rm["dirExists"], rm["fileExists"]) == (False, False), rm
    assert "No such file" in rm["viaCommand"] and "status 2" in rm["viaCommand"], rm

    missing = err(r["readMissing"])
    assert missing["name"] in ("FileNotFoundError", "NotFoundError") and missing["is"]["NotFoundError"], missing

    wd = r["watchDir"]
    assert wd["sawFilesWrite"] and wd["sawBashWrite"], wd
    for name in ("w.txt", "v.txt"):
        types = {e["type"] for e in wd["events"] if e["name"] == name}
        assert types & {"create", "write"}, f"no create/write event for {name}: {wd['events']}"
    assert not [e for e in wd["eventsAfterStop"] if e["name"] == "late.txt"], f"events after stop(): {wd}"
    assert r["kill sandbox"] is True


def test_lifecycle(gateway, scenarios):
    r = run_scenario(gateway, scenarios, "lifecycle")
    run = r["run"]
    ids = r["create"]
    every = sorted(ids.values())
    assert len(set(every)) == 3

    for key, role in (("getInfo", "a"), ("getInfoStatic", "b")):
        i = r[key]
        assert i["sandboxId"] == ids[role] and i["templateId"] == TEMPLATE, i
        assert i["metadata"] == {"suite": run, "role": role}, i
        assert i["state"] == "running" and i["envdVersion"] == ENVD_VERSION, i
        assert abs(i["lifetime"] - 300) <= 5 and 270 < i["secondsLeft"] <= 302, i
    assert 140 < r["setTimeout"]["secondsLeft"] <= 152, r["setTimeout"]

    lm = r["listByMetadata"]
    assert lm["suite"] == every and lm["roleA"] == [ids["a"]] and lm["none"] == [], lm
    assert sorted(i["sandboxId"] for i in lm["items"]) == every
    for i in lm["items"]:
        assert i["templateId"] == TEMPLATE and i["state"] == "running" and i["metadata"]["suite"] == run, i

    pg = r["pagination"]
    assert all(len(p) <= 1 for p in pg["pages"]), pg
    flat = [x for p in pg["pages"] for x in p]
    assert sorted(flat) == every and len(flat) == 3, pg
    assert not pg["hasNextAtEnd"], pg

    p = r["pause"]
    assert p["first"] is True and p["state"] == "paused", p
    assert p["second"] == {"returned": False}, f"pausing a paused sandbox should give false (409): {p}"

    ls = r["listByState"]
    assert ls["paused"] == [ids["a"]], ls
    assert ls["running"] == sorted([ids["b"], ids["c"]]), ls
    assert ls["both"] == every and ls["dflt"] == every, ls

    c = r["connectResumes"]
    assert c["sandboxId"] == ids["a"] and c["state"] == "running", c
    assert c["file"] == "kept across pause", c
    assert c["sleeperListed"] and "sleep 1000" in c["sleeperArgs"], c
    assert c["echo"] == "resumed\n", c

    k = r["connectRunningKeepsTtl"]
    assert k["state"] == "running" and k["echo"] == "connected\n", k
    assert k["shortenedBySeconds"] <= 1, f"connect shortened a running sandbox's timeout: {k}"

    assert r["kill"] == {"first": True, "second": False, "unknown": False}
    ak = r["afterKill"]
    for key in ("getInfo", "getInfoUnknown"):
        e = err(ak[key])
        assert e["is"]["NotFoundError"], e
    assert ak["list"] == sorted([ids["b"], ids["c"]]), ak
    assert r["killRest"] == {"b": True, "c": True, "listAfter": []}


def test_reconnect_from_another_process(gateway, scenarios):
    first = run_scenario(gateway, scenarios, "reconnect-create")
    sid, pid = first["sandboxId"], first["pid"]
    assert first["ticker"]["lastTickSeen"] >= 2, first
    assert first["write"]["path"] == "/root/state.txt"

    r = run_scenario(gateway, scenarios, "reconnect-use", sid, str(pid))
    assert r["connect"] == {"sandboxId": sid}
    assert r["read"] == f"written by {first['run']}"
    assert r["list"] is not None and r["list"]["pid"] == pid, r["list"]
    assert r["list"]["args"][:2] == ["-l", "-c"] and "tick" in r["list"]["args"][2], r["list"]
    cp = r["connectProcess"]
    ticks = cp["ticks"]
    assert cp["handlePid"] == pid, cp
    assert len(ticks) >= 3 and ticks == list(range(ticks[0], ticks[0] + len(ticks))), cp
    # commands.connect gives the output from now on: the ticker had gone on while nobody was connected.
    assert ticks[0] > first["ticker"]["lastTickSeen"], cp
    assert cp["killed"] is True, cp
    assert err(cp["waited"])["name"] == "CommandExitError", cp
    assert r["listAfterKill"] is False
    assert r["kill sandbox"] is True


def test_the_docs_e2b_examples_run(gateway, scenarios):
    """The SDK snippets of docs/e2b.md (a module) and README.md (a `node -e` line) run as written against the
    gateway, beside the pinned SDK."""
    doc = (lib.REPO / "docs" / "e2b.md").read_text()
    module = re.search(r"^```js\n(.*?)^```", doc, re.M | re.S).group(1)
    script = scenarios.parent / f"doc-example-{os.getpid()}.mjs"
    script.write_text(module + "console.log(JSON.stringify({stdout: r.stdout, exitCode: r.exitCode}))\n")
    try:
        out = subprocess.run(["node", str(script)], env=gateway.env(), cwd=str(scenarios.parent),
                             capture_output=True, text=True, timeout=120)
    finally:
        script.unlink()
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"stdout": "42\n", "exitCode": 0}, out.stdout

    readme = (lib.REPO / "README.md").read_text()
    block = readme[readme.index("## E2B's SDK"):]
    node_line = re.search(r'^(node -e ".*?\)\(\)")\s*$', block, re.M | re.S).group(1)
    out = subprocess.run(["bash", "-c", node_line], env=gateway.env(), cwd=str(scenarios.parent),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "42", (out.stdout, out.stderr)
    assert gateway.rest("GET", "/v2/sandboxes")[1] == []  # both killed what they made


def _concurrent_held(gw: Gateway, script, agents_sandboxes) -> tuple[dict, dict, list]:
    """Runs `concurrent hold`; while its sandboxes live, calls agents_sandboxes() (what the dsec side holds); then
    lets it kill them. (held result, final result, what agents_sandboxes returned)."""
    e = gw.env()
    e["SCENARIO_TIMEOUT_MS"] = "280000"
    p = subprocess.Popen(["node", str(script), "concurrent", "hold"], env=e, cwd=str(script.parent),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        held_line = ""
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            r, _, _ = select.select([p.stdout], [], [], 1)
            if r:
                held_line = p.stdout.readline()
                break
            if p.poll() is not None:
                break
        seen = None
        held = json.loads(held_line) if held_line.startswith("{") else None
        if held is not None and held.get("hold"):
            seen = agents_sandboxes()
        out, errout = p.communicate("go\n", timeout=120)
    except BaseException:
        p.kill()
        p.wait()
        raise
    assert held is not None and held.get("hold"), \
        f"no hold line ({p.returncode}):\n" + _describe("concurrent", held_line + out, errout, gw)
    assert p.returncode == 0, f"exit status {p.returncode}\n" + _describe("concurrent", out, errout, gw)
    return held, json.loads(out.strip().splitlines()[-1]), seen


def _check_concurrent(held: dict, final: dict) -> list[str]:
    ids = final["create"]["ids"]
    assert len(ids) == 8 and len(set(ids)) == 8, final["create"]
    cmds = final["commands"]
    assert [c["line"] for c in cmds] == [f"sandbox-{i}" for i in range(8)], cmds
    assert all(c["exitCode"] == 0 and c["hostname"] for c in cmds), cmds
    assert final["listed"] == sorted(ids), final["listed"]
    assert final["kill"] == [True] * 8
    assert final["listedAfterKill"] == []
    assert held["listed"] == sorted(ids)
    return [c["hostname"] for c in cmds]


def test_concurrent(gateway, scenarios):
    def on_agent():
        return [s for s in gateway.agent_sandboxes() if s.get("state") == "running"]
    held, final, seen = _concurrent_held(gateway, scenarios, on_agent)
    hostnames = _check_concurrent(held, final)
    # On the dsec side: 8 sandboxes of bookworm-python, each the one its command ran in (a sandbox's hostname is
    # its dsec id), carrying the metadata as labels and the timeout as their TTL.
    mine = [s for s in seen if held["run"] in (s.get("labels") or {}).values()]
    assert sorted(s["id"] for s in mine) == sorted(hostnames), (hostnames, seen)
    for s in mine:
        assert s["image"].startswith(TEMPLATE), s
        assert abs(s["expires_at"] - s["created_at"] - 300) <= 10, f"the timeout (300 s) is not the TTL: {s}"
    assert not [s for s in gateway.agent_sandboxes() if s["id"] in hostnames and s.get("state") == "running"]


def test_errors(gateway, scenarios):
    r = run_scenario(gateway, scenarios, "errors")
    ut = err(r["unknownTemplate"])
    assert r["unknownTemplateName"] in ut["message"], ut
    assert ut["is"]["SandboxError"] and ut.get("statusCode") in (400, 404), ut
    for key in ("connectUnknown", "getInfoUnknown", "setTimeoutUnknown"):
        e = err(r[key])
        assert e["name"] == "SandboxNotFoundError" and e["is"]["NotFoundError"], (key, e)
    assert r["killUnknown"] == {"returned": False}
    ua = r["useAfterKill"]
    assert err(ua["run"])["name"] in ("SandboxNotFoundError", "NotFoundError", "TimeoutError"), ua
    assert "error" in ua["read"], ua
    assert ua["isRunning"] == {"returned": False}, ua
    print(f"\nunknown template: {ut['name']} ({ut.get('statusCode')}): {ut['message']}")


def _envelope(flags: int, payload: bytes) -> bytes:
    return bytes([flags]) + len(payload).to_bytes(4, "big") + payload


def _envelopes(raw: bytes) -> list[tuple[int, dict]]:
    out = []
    while len(raw) >= 5:
        n = int.from_bytes(raw[1:5], "big")
        out.append((raw[0], json.loads(raw[5:5 + n])))
        raw = raw[5 + n:]
    return out


class _Envd:
    """Raw calls to one sandbox's envd through the gateway: (status, content type, body), or with read=False the
    open connection and response."""

    def __init__(self, gateway, made: dict):
        self.host, self.port = gateway.url[len("http://"):].split(":")
        self.sid, self.token = made["sandboxID"], made["envdAccessToken"]

    def __call__(self, path, body, content_type="application/json", headers=None, read=True, method="POST"):
        import http.client
        c = http.client.HTTPConnection(self.host, int(self.port), timeout=30)
        h = {"E2b-Sandbox-Id": self.sid, "X-Access-Token": self.token, "Content-Type": content_type,
             "Connect-Protocol-Version": "1", **(headers or {})}
        c.request(method, path, body=body, headers=h)
        r = c.getresponse()
        if not read:
            return c, r
        data = r.read()
        c.close()
        return r.status, r.getheader("Content-Type"), data

    def unary(self, path, message: dict):
        status, _, data = self(path, json.dumps(message).encode())
        return status, json.loads(data) if data else None


def test_polling_watchers_and_client_streamed_stdin(gateway):
    """The calls only E2B's Python SDK (watchers) or no SDK (StreamInput) makes, raw."""
    status, made, _ = gateway.rest("POST", "/v2/sandboxes", {"templateID": TEMPLATE, "timeout": 120})
    assert status == 201, made
    envd = _Envd(gateway, made)
    try:
        status, body = envd.unary("/filesystem.Filesystem/CreateWatcher", {"path": "/tmp/w"})
        assert status == 404 and body["code"] == "not_found", body
        assert envd.unary("/filesystem.Filesystem/MakeDir", {"path": "/tmp/w"})[0] == 200
        status, body = envd.unary("/filesystem.Filesystem/CreateWatcher", {"path": "/tmp/w", "includeEntry": True})
        assert status == 200 and body["watcherId"], body
        wid = body["watcherId"]
        assert envd("/files?path=/tmp/w/a.txt", b"hello", "application/octet-stream")[0] == 200

        def events():
            status, body = envd.unary("/filesystem.Filesystem/GetWatcherEvents", {"watcherId": wid})
            assert status == 200, body
            return body["events"]

        got = events()
        assert [(e["name"], e["type"]) for e in got] == [("a.txt", "EVENT_TYPE_CREATE")], got
        assert got[0]["entry"]["size"] == "5" and got[0]["entry"]["type"] == "FILE_TYPE_FILE", got
        assert events() == []  # nothing changed since the last look
        assert envd.unary("/filesystem.Filesystem/Remove", {"path": "/tmp/w/a.txt"})[0] == 200
        assert [(e["name"], e["type"]) for e in events()] == [("a.txt", "EVENT_TYPE_REMOVE")]
        assert envd.unary("/filesystem.Filesystem/RemoveWatcher", {"watcherId": wid})[0] == 200
        status, body = envd.unary("/filesystem.Filesystem/GetWatcherEvents", {"watcherId": wid})
        assert status == 404 and body["code"] == "not_found", body
        status, body = envd.unary("/filesystem.Filesystem/GetWatcherEvents", {"watcherId": "../etc/passwd"})
        assert status == 400 and body["code"] == "invalid_argument", body

        # StreamInput: start, data, keepalive, data; the command sees the bytes in order once stdin closes.
        msg = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", "cat > /tmp/got"]}, "stdin": True}).encode()
        c, r = envd("/process.Process/Start", _envelope(0, msg), "application/connect+json", read=False)
        head = r.read(5)
        pid = json.loads(r.read(int.from_bytes(head[1:5], "big")))["event"]["start"]["pid"]
        c.close()
        stream = b"".join(_envelope(0, json.dumps(m).encode()) for m in (
            {"start": {"process": {"pid": pid}}},
            {"data": {"input": {"stdin": base64.b64encode(b"hello ").decode()}}},
            {"keepalive": {}},
            {"data": {"input": {"stdin": base64.b64encode(b"world").decode()}}}))
        status, ctype, data = envd("/process.Process/StreamInput", stream, "application/connect+json")
        assert status == 200 and _envelopes(data) == [(0, {}), (2, {})], data
        assert envd.unary("/process.Process/CloseStdin", {"process": {"pid": pid}})[0] == 200

        def written():
            status, _, data = envd("/files?path=/tmp/got", None, method="GET")
            return data if status == 200 else None

        assert lib.wait_for(lambda: written() == b"hello world", 10, 0.2), written()
    finally:
        assert gateway.rest("DELETE", f"/sandboxes/{made['sandboxID']}")[0] == 204


def test_bad_input_gets_the_answer_the_sdk_expects(gateway):
    """Malformed requests on both planes, and streams their callers abandon (envd's rules: without a timeout the
    command runs on, with one it is killed when the timeout passes)."""
    for body in (b"not json", b"[1, 2]"):
        req = urllib.request.Request(gateway.url + "/v2/sandboxes", data=body, method="POST",
                                     headers={"X-API-KEY": API_KEY, "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 400 and json.loads(e.value.read())["code"] == 400
    status, body, _ = gateway.rest("POST", "/v2/sandboxes", {"templateID": 5})
    assert status == 400 and "templateID" in body["message"], body
    status, body, _ = gateway.rest("GET", "/v2/sandboxes?limit=-1")
    assert status == 400 and body["code"] == 400, body

    status, made, _ = gateway.rest("POST", "/v2/sandboxes", {"templateID": TEMPLATE, "timeout": 120})
    assert status == 201, made
    sid = made["sandboxID"]
    envd = _Envd(gateway, made)
    try:
        status, ctype, data = envd("/filesystem.Filesystem/Stat", b"{")
        assert status == 400 and json.loads(data)["code"] == "invalid_argument", data
        status, ctype, data = envd("/process.Process/Nope", b"{}")
        assert status == 501 and json.loads(data)["code"] == "unimplemented", data
        # A stream's error keeps status 200 and comes in the end-stream envelope.
        status, ctype, data = envd("/process.Process/Start", b"garbage", "application/connect+json")
        assert status == 200 and ctype == "application/connect+json", (status, ctype, data)
        assert _envelopes(data) == [(2, {"error": {"code": "invalid_argument", "message": _envelopes(data)[0][1]
                                                   ["error"]["message"]}})], data
        status, ctype, data = envd("/filesystem.Filesystem/ListDir", b'{"path": "/nope"}')
        assert status == 404 and json.loads(data)["code"] == "not_found", data
        # Fields of the wrong type are the caller's error, in a unary call and in a stream.
        status, ctype, data = envd("/filesystem.Filesystem/ListDir", b'{"path": "/tmp", "depth": "two"}')
        assert status == 400 and json.loads(data)["code"] == "invalid_argument", data
        msg = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", "true"]}, "stdin": "yes"}).encode()
        status, ctype, data = envd("/process.Process/Start", _envelope(0, msg), "application/connect+json")
        assert status == 200 and _envelopes(data)[-1][1]["error"]["code"] == "invalid_argument", data

        def start(cmd, timeout_ms=None):
            msg = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", cmd]}, "stdin": False}).encode()
            headers = {"Connect-Timeout-Ms": str(timeout_ms)} if timeout_ms else {}
            c, r = envd("/process.Process/Start", _envelope(0, msg), "application/connect+json", headers, read=False)
            head = r.read(5)
            first = json.loads(r.read(int.from_bytes(head[1:5], "big")))
            c.close()  # the caller goes away mid-stream
            return first["event"]["start"]["pid"]

        def running():
            status, _, data = envd("/process.Process/List", b"{}")
            assert status == 200, data
            return {p["pid"] for p in json.loads(data)["processes"]}

        kept = start("sleep 300")
        timed = start("sleep 300", timeout_ms=1500)
        assert {kept, timed} <= running()
        assert lib.wait_for(lambda: timed not in running(), 10, 0.2), "a command outlived its timeout"
        time.sleep(0.5)
        assert kept in running(), "a command without a timeout died with its abandoned stream"
    finally:
        assert gateway.rest("DELETE", f"/sandboxes/{sid}")[0] == 204


def test_network_lists_become_the_sandboxs_egress_policy(gateway):
    """E2B's allowOut with denyOut ["0.0.0.0/0"] is dsec's egress allowlist; what dsec cannot say is refused."""
    status, made, _ = gateway.rest("POST", "/v2/sandboxes", {
        "templateID": TEMPLATE, "timeout": 60,
        "network": {"denyOut": ["0.0.0.0/0"], "allowOut": ["192.0.2.7", "10.20.0.0/16", "pypi.mirror.internal"]}})
    if status == 501:
        pytest.skip(f"this agent gives sandboxes no network: {made}")
    assert status == 201, made
    try:
        mine = [x for x in gateway.agent_sandboxes() if x["id"] == made["sandboxID"]]
        assert len(mine) == 1, mine
        net = mine[0]["network"]
        assert net["mode"] == "egress", net
        assert [(r.get("cidr") or r.get("host"), r.get("allow", True)) for r in net["rules"]] == \
            [("192.0.2.7", True), ("10.20.0.0/16", True), ("pypi.mirror.internal", True)], net
    finally:
        assert gateway.rest("DELETE", f"/sandboxes/{made['sandboxID']}")[0] == 204
    # Internet off is a deny-all (allowOut still wins, as in E2B); updateNetwork changes a running sandbox's policy.
    status, made, _ = gateway.rest("POST", "/v2/sandboxes", {"templateID": TEMPLATE, "timeout": 60,
                                                             "allow_internet_access": False})
    assert status == 201, made
    sid = made["sandboxID"]

    def mode():
        return [x for x in gateway.agent_sandboxes() if x["id"] == sid][0]["network"]

    try:
        assert mode()["mode"] == "none", mode()
        status, body, _ = gateway.rest("PUT", f"/sandboxes/{sid}/network",
                                       {"allow_internet_access": False, "allowOut": ["*.example.org"]})
        assert status == 204, body
        assert mode()["mode"] == "egress" and [r.get("host") for r in mode()["rules"]] == ["*.example.org"], mode()
        assert gateway.rest("PUT", f"/sandboxes/{sid}/network", {"allow_internet_access": True})[0] == 204
        assert mode()["mode"] == "open", mode()
        status, body, _ = gateway.rest("PUT", "/sandboxes/no-such-sandbox/network", {"allow_internet_access": True})
        assert status == 404 and body["code"] == 404, body
    finally:
        assert gateway.rest("DELETE", f"/sandboxes/{sid}")[0] == 204
    # Lists without a deny-all, header rules and proxies are refused with why.
    for network, word in (({"denyOut": ["10.0.0.0/8"]}, "allowlist"),
                          ({"rules": {"api.example.com": [{"transform": {"headers": {"A": "b"}}}]}}, "rules"),
                          ({"egressProxy": {"address": "127.0.0.1:3128"}}, "egressProxy")):
        status, body, _ = gateway.rest("POST", "/v2/sandboxes", {"templateID": TEMPLATE, "network": network})
        assert status == 400 and word in body["message"], (network, status, body)
    assert not [x for x in gateway.agent_sandboxes() if x.get("state") == "running"]


def test_two_nodes_through_etcd(dsec_home, scenarios):
    """A gateway given only --etcd finds two agents registered there and spreads sandboxes over both."""
    reason = cl.etcd_skip_reason() or cl.netns_skip_reason()
    if reason:
        pytest.skip(reason)
    net = cl.NetnsAgents(dsec_home, count=2)
    etcd = None
    gw = None
    try:
        etcd = cl.Etcd(hosts=[net.host_address])
        etcd.start()
        agents = [net.start(i, backends="container", etcd=etcd.url(net.host_address)) for i in range(2)]
        assert lib.wait_for(lambda: len(etcd.nodes()) == 2, 15), etcd.nodes()
        gw = start_gateway(dsec_home, tag="etcd", embedded=False, extra_args=["--etcd", etcd.url()])

        def per_agent():
            return {a.node_id: [s["id"] for s in lib.http_request(a.socket_path, "GET", "/v1/sandboxes").json()
                                ["sandboxes"] if s.get("state") == "running"] for a in agents}
        held, final, seen = _concurrent_held(gw, scenarios, per_agent)
        hostnames = _check_concurrent(held, final)
        assert sorted(x for ids in seen.values() for x in ids) == sorted(hostnames), (seen, hostnames)
        assert all(seen[a.node_id] for a in agents), f"not every node got sandboxes: {seen}"
        assert per_agent() == {a.node_id: [] for a in agents}

        # The gateway keeps nothing a restart would lose: a sandbox made through one gateway, with a command
        # running, is driven by the next one (the agents are not the gateway's, so the sandbox lives on).
        first = run_scenario(gw, scenarios, "reconnect-create")
        assert gw.stop() == 0, gw.log_tail()
        gw = start_gateway(dsec_home, tag="etcd2", embedded=False, extra_args=["--etcd", etcd.url()])
        r = run_scenario(gw, scenarios, "reconnect-use", first["sandboxId"], str(first["pid"]))
        assert r["read"] == f"written by {first['run']}", r
        assert r["list"] is not None and r["list"]["pid"] == first["pid"], r
        assert r["connectProcess"]["ticks"] and r["kill sandbox"] is True, r
        assert per_agent() == {a.node_id: [] for a in agents}
        gw.stop_and_check()
        gw = None
        problems = net.stop_all()
        assert not problems, "agents left things behind:\n  " + "\n  ".join(problems)
    finally:
        try:
            if gw is not None:
                gw.stop()
                gw.remove_husks()
            if etcd is not None:
                etcd.close()
        finally:
            net.close()


def test_api_keys(dsec_home, scenarios, tmp_path):
    """With --tokens, only a known API key reaches the control plane, and only the sandbox's access token its
    envd API."""
    tokens = tmp_path / "tokens"
    other_key = "e2b_" + "ab" * 20
    tokens.write_text(f"# dsec-e2b test keys\ne2b-test tenant {hashlib.sha256(API_KEY.encode()).hexdigest()}\n"
                      f"e2b-other tenant {hashlib.sha256(other_key.encode()).hexdigest()}\n")
    os.chmod(tokens, 0o600)
    gw = start_gateway(dsec_home, tag="tok", extra_args=["--tokens", str(tokens)])
    try:
        status, body, _ = gw.rest("GET", "/v2/sandboxes", api_key=None)
        assert status == 401 and isinstance(body, dict) and body.get("code") == 401, (status, body)
        status, body, _ = gw.rest("GET", "/v2/sandboxes", api_key=WRONG_KEY)
        assert status == 401 and isinstance(body, dict) and body.get("code") == 401, (status, body)
        status, body, _ = gw.rest("GET", "/v2/sandboxes")
        assert status == 200 and body == [], (status, body)

        r = run_scenario(gw, scenarios, "auth", env={"E2B_BAD_API_KEY": WRONG_KEY})
        assert r["goodRun"] == "authorized\n"
        for key in ("badList", "badCreate", "badGetInfo", "badKill", "badConnect"):
            e = err(r[key])
            assert e["name"] == "AuthenticationError", (key, e)
        assert r["stillRunning"] == "running"
        for key in ("envdWithoutToken", "envdWrongToken"):
            assert r[key]["status"] in (401, 403), f"{key}: the envd API answered without the access token: {r[key]}"
        assert r["goodKill"] is True

        # Another tenant's key: the sandbox is not there for it (404, worded as an id that does not exist), nor in
        # its list, and it cannot kill it; its owner can.
        status, made, _ = gw.rest("POST", "/v2/sandboxes", {"templateID": "bookworm-python", "timeout": 120})
        assert status == 201, (status, made)
        sid = made["sandboxID"]
        for method, path in (("GET", f"/sandboxes/{sid}"), ("DELETE", f"/sandboxes/{sid}"),
                             ("POST", f"/sandboxes/{sid}/pause"), ("POST", f"/v2/sandboxes/{sid}/connect")):
            status, body, _ = gw.rest(method, path, {} if method == "POST" else None, api_key=other_key)
            assert status == 404 and body["code"] == 404, (method, path, status, body)
        status, listed, _ = gw.rest("GET", "/v2/sandboxes", api_key=other_key)
        assert status == 200 and listed == [], listed
        status, listed, _ = gw.rest("GET", "/v2/sandboxes")
        assert status == 200 and [x["sandboxID"] for x in listed] == [sid], listed
        status, _, _ = gw.rest("DELETE", f"/sandboxes/{sid}")
        assert status == 204

        # A sandbox made through dsec's own API has no envd access token: its envd API answers no anonymous call
        # (sandbox ids are not secrets) and no other tenant's key, only its own tenant's API key.
        res = lib.http_request(gw.agent_socket, "POST", "/v1/sandboxes",
                               json.dumps({"image": "bookworm-python", "tenant": "e2b-test"}).encode(),
                               {"Content-Type": "application/json"})
        assert res.status == 201, res
        own = res.json()["id"]
        envd = _Envd(gw, {"sandboxID": own, "envdAccessToken": ""})
        stat = json.dumps({"path": "/etc/hostname"}).encode()

        # A caller without credentials is answered from its header: the gateway reads none of its body (two
        # 400 MiB uploads, 4 MiB of each sent, cost it nothing).
        import http.client
        host, port = gw.url[len("http://"):].split(":")
        with open(f"/proc/{gw.proc.pid}/status") as f:
            before = int(next(line for line in f if line.startswith("VmRSS:")).split()[1])
        envd_headers = {"E2b-Sandbox-Id": own, "X-Access-Token": "made-up"}
        gone_headers = {"E2b-Sandbox-Id": own + "x", "X-Access-Token": "made-up"}
        for path, headers in (("/v2/sandboxes", {}), ("/files?path=/tmp/x", envd_headers),
                              ("/files?path=/tmp/x", gone_headers)):
            c = http.client.HTTPConnection(host, int(port), timeout=10)
            c.putrequest("POST", path)
            for k, v in {**headers, "Content-Type": "application/octet-stream",
                         "Content-Length": str(400 << 20)}.items():
                c.putheader(k, v)
            c.endheaders()
            try:
                c.send(b"x" * (4 << 20))
            except OSError:
                pass  # the answer came first and the gateway stopped reading
            r = c.getresponse()
            want = 502 if headers is gone_headers else 401  # E2B's "not running" for a sandbox not there
            assert r.status == want, (path, headers, r.status, r.read()[:300])
            c.close()
        with open(f"/proc/{gw.proc.pid}/status") as f:
            grown = int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) - before
        assert grown < 64 << 10, f"the gateway grew by {grown} KiB for bodies it must not read"

        def stat_with(headers):
            c, r = envd("/filesystem.Filesystem/Stat", stat, headers=headers, read=False)
            data = r.read()
            c.close()
            return r.status, data

        for headers in ({"X-Access-Token": ""}, {"X-Access-Token": "made-up"}, {"X-API-KEY": WRONG_KEY},
                        {"X-API-KEY": other_key}):
            status, data = stat_with({k: v for k, v in headers.items()})
            assert status in (401, 404), f"envd of a dsec-made sandbox answered {status} to {headers}: {data!r}"
        # No credentials at all: `_Envd` always sends X-Access-Token, so this one goes out by hand.
        c = http.client.HTTPConnection(host, int(port), timeout=30)
        c.request("POST", "/filesystem.Filesystem/Stat", body=stat,
                  headers={"E2b-Sandbox-Id": own, "Content-Type": "application/json", "Connect-Protocol-Version": "1"})
        r = c.getresponse()
        assert r.status == 401, (r.status, r.read())
        c.close()
        status, data = stat_with({"X-API-KEY": API_KEY})
        assert status == 200 and json.loads(data)["entry"]["name"] == "hostname", (status, data)
        res = lib.http_request(gw.agent_socket, "DELETE", f"/v1/sandboxes/{own}")
        assert res.status in (200, 204), res
    finally:
        gw.stop_and_check()
