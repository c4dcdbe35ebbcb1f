"""Helpers for dsec's integration tests: the build under test, a real dsecd, raw HTTP over its unix socket, and the
checks that an agent left nothing behind on the host."""

from __future__ import annotations

import json
import os
import pathlib
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

REPO = pathlib.Path(__file__).resolve().parents[2]
PROGRAMS = pathlib.Path(__file__).resolve().parent / "programs"


def find_build_dir() -> pathlib.Path:
    """$DSEC_BUILD_DIR, else ./build, else the repository's build/."""
    env = os.environ.get("DSEC_BUILD_DIR")
    if env:
        return pathlib.Path(env).resolve()
    for candidate in (pathlib.Path.cwd() / "build", REPO / "build"):
        if (candidate / "bin" / "dsecd").exists():
            return candidate.resolve()
    return (REPO / "build").resolve()


BUILD = find_build_dir()
PYTHON_DIR = BUILD / "python"
DSECD = BUILD / "bin" / "dsecd"
DSEC_CLI = BUILD / "bin" / "dsec"
DSEC_INIT = BUILD / "bin" / "dsec-init"
BUSYBOX = pathlib.Path("/bin/busybox")

if PYTHON_DIR.is_dir() and str(PYTHON_DIR) not in sys.path[:1]:
    sys.path.insert(0, str(PYTHON_DIR))

try:
    import dsec  # noqa: E402
    _IMPORT_ERROR = None
except ImportError as e:  # the build is missing or broken: every test skips with this reason
    dsec = None
    _IMPORT_ERROR = e


def skip_reason() -> str | None:
    """Why the integration tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "dsec integration tests need root (they create namespaces, cgroups and mounts): run them as root"
    missing = [str(p) for p in (DSECD, DSEC_INIT, DSEC_CLI) if not p.exists()]
    if missing:
        return (f"dsec build missing under {BUILD} ({', '.join(missing)}): build it with "
                f"`cmake -S . -B build -G Ninja && cmake --build build` or set DSEC_BUILD_DIR")
    if dsec is None:
        return f"cannot import the dsec Python binding from {PYTHON_DIR}: {_IMPORT_ERROR}"
    if not BUSYBOX.exists():
        return "no static busybox at /bin/busybox for the test image (apt-get install busybox-static)"
    return None


# --------------------------------------------------------------------------------------------------------------
# Raw HTTP over a unix socket, for what the client library would never send.

class RawResponse:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self):
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"RawResponse({self.status}, {self.body[:300]!r})"


def _parse_response(data: bytes) -> RawResponse:
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        raise AssertionError(f"no complete HTTP response from the agent: {data[:500]!r}")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    status = int(parts[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        rest = rest[: int(headers["content-length"])]
    return RawResponse(status, headers, rest)


def _read_response(sock: socket.socket, deadline: float) -> bytes:
    data = b""
    while time.monotonic() < deadline:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            for line in head.split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length" and len(rest) >= int(v.strip()):
                    return data
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            break
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def raw_http(socket_path: str, request: bytes, *, body_chunks=(), timeout: float = 15.0) -> RawResponse:
    """Sends `request` (and then each of `body_chunks`) on a fresh connection and reads one response.

    Writing stops quietly when the agent closes the connection early (it may answer before reading everything)."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        try:
            s.sendall(request)
            for chunk in body_chunks:
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            pass
        return _parse_response(_read_response(s, deadline))


def dechunk(body: bytes) -> bytes:
    """A chunked (Transfer-Encoding) body as the bytes it carries."""
    out = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return out
        out += body[:size]
        assert body[size:size + 2] == b"\r\n"
        body = body[size + 2:]


def http_request(socket_path: str, method: str, target: str, body: bytes = b"", headers: dict | None = None,
                 timeout: float = 15.0) -> RawResponse:
    lines = [f"{method} {target} HTTP/1.1", "Host: dsecd", "Connection: close", f"Content-Length: {len(body)}"]
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    return raw_http(socket_path, ("\r\n".join(lines) + "\r\n\r\n").encode() + body, timeout=timeout)


# --------------------------------------------------------------------------------------------------------------
# What an agent must not leave behind.

def file_tail(path, n: int = 4000) -> str:
    """The last n bytes of a log file, as text."""
    try:
        with open(path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")
    except OSError:
        return "(no log)"


def remove_cgroup_husks(cgroup_name: str) -> None:
    """Removes an agent's empty cgroup subtree roots (and their batch twins)."""
    for root in cgroup_roots(cgroup_name):
        for dirpath, _, _ in sorted(os.walk(root), key=lambda t: -len(t[0])):
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
        if os.path.basename(os.path.dirname(root)) == cgroup_name + ".batch":
            try:
                os.rmdir(os.path.dirname(root))
            except OSError:
                pass


def stop_process(proc, timeout: float = 60.0) -> int:
    """SIGTERM, and the exit status (SIGKILL after `timeout`, reported as -9); 0 for no process."""
    if proc is None:
        return 0
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def cgroup_roots(cgroup_name: str) -> list[str]:
    """Every directory that is this agent's cgroup subtree root: v1 (one per hierarchy) and v2."""
    roots = []
    base = "/sys/fs/cgroup"
    if os.path.isdir(os.path.join(base, cgroup_name)):
        roots.append(os.path.join(base, cgroup_name))
    for entry in sorted(os.listdir(base)):
        d = os.path.join(base, entry, cgroup_name)
        if os.path.isdir(d):
            roots.append(d)
    # Batch sandboxes' cpu groups are under <name>.batch, an idle group beside <name>: v2 <name>.batch/<id>, v1
    # <cpu>/<name>.batch/<name>/<id>.
    batch = cgroup_name + ".batch"
    if os.path.isdir(os.path.join(base, batch)) and not os.path.isdir(os.path.join(base, "cpu", batch)):
        roots.append(os.path.join(base, batch))
    for entry in sorted(os.listdir(base)):
        d = os.path.join(base, entry, batch, cgroup_name)
        if os.path.isdir(d):
            roots.append(d)
        elif os.path.isdir(os.path.dirname(d)) and entry != batch:
            roots.append(os.path.dirname(d))  # the idle group left without its inner group
    return roots


def _unescape_mountinfo(path: str) -> str:
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def processes_in_cgroup(cgroup_name: str) -> list[tuple[int, str]]:
    """Host processes whose cgroup path (in any hierarchy) is inside this agent's subtree (or its batch twin:
    <name>.batch/<rest> on v2, <name>.batch/<name>/<rest> in v1's cpu hierarchy)."""
    head, _, rest = cgroup_name.partition("/")
    subtrees = ["/" + cgroup_name, f"/{head}.batch" + (f"/{rest}" if rest else ""), f"/{head}.batch/{cgroup_name}"]
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                text = f.read()
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        for line in text.splitlines():
            path = line.split(":", 2)[-1]
            if any(_under(path, subtree) for subtree in subtrees):
                found.append((int(pid), comm))
                break
    return found


def leftovers(run_dir: str, cgroup_name: str, sandbox_id: str | None = None) -> list[str]:
    """Everything the agent (or one of its sandboxes, when `sandbox_id` is given) left on the host."""
    problems = []
    scope = os.path.join(run_dir, sandbox_id) if sandbox_id else run_dir
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mount_point = _unescape_mountinfo(line.split()[4])
            if _under(mount_point, scope):
                problems.append(f"mount left at {mount_point}")
    for root in cgroup_roots(cgroup_name):
        top = os.path.join(root, sandbox_id) if sandbox_id else root
        if sandbox_id:
            if os.path.exists(top):
                problems.append(f"cgroup left: {top}")
            continue
        for dirpath, dirnames, _ in os.walk(top):
            for d in dirnames:
                problems.append(f"cgroup left: {os.path.join(dirpath, d)}")
        try:
            with open(os.path.join(root, "cgroup.procs")) as f:
                pids = f.read().split()
            if pids:
                problems.append(f"processes left in {root}: {pids}")
        except OSError:
            pass
    for pid, comm in processes_in_cgroup(cgroup_name if not sandbox_id else f"{cgroup_name}/{sandbox_id}"):
        problems.append(f"process {pid} ({comm}) still in cgroup subtree {cgroup_name}")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        for link in ("cwd", "root"):
            try:
                target = os.readlink(f"/proc/{pid}/{link}")
            except OSError:
                continue
            if _under(target, scope):
                problems.append(f"process {pid} has its {link} at {target}")
    if sandbox_id:
        if os.path.lexists(scope):
            problems.append(f"run directory entry left: {scope}")
    elif os.path.isdir(run_dir):
        for entry in os.listdir(run_dir):
            problems.append(f"run directory entry left: {os.path.join(run_dir, entry)}")
    return problems


def process_argvs():
    """(pid, argv as a list of bytes) of every process on the host but this one."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        yield int(pid), argv


def wait_for(predicate, timeout: float, interval: float = 0.05):
    """Polls until predicate() is truthy; returns its last value."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


# --------------------------------------------------------------------------------------------------------------
# A real dsecd.

class Agent:
    """One dsecd started for the tests, with its own socket, run dir, cgroup subtree and image store."""

    def __init__(self, home: str, *, tag: str, extra_args=()) -> None:
        self.home = home
        self.tag = tag
        self.node_id = f"it{os.getpid()}{tag}"
        self.tmp = tempfile.mkdtemp(prefix="dsec-it-")
        self.socket_path = os.path.join(self.tmp, "dsecd.sock")
        self.log_path = os.path.join(self.tmp, "dsecd.log")
        self.run_dir = f"/run/dsec-test-{os.getpid()}{tag}"
        self.cgroup_name = f"dsec-test-{os.getpid()}{tag}"
        self.endpoint = "unix:" + self.socket_path
        self.max_body = 32 << 20
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> None:
        ready_r, ready_w = os.pipe()
        args = [str(DSECD), "--socket", self.socket_path, "--home", self.home, "--run-dir", self.run_dir,
                "--node-id", self.node_id, "--cgroup-name", self.cgroup_name, "--backends", "container",
                "--max-body", str(self.max_body), "--ready-fd", str(ready_w), *self.extra_args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         pass_fds=(ready_w,), start_new_session=True)
        os.close(ready_w)
        try:
            deadline = time.monotonic() + timeout
            got = b""
            while b"ready\n" not in got:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"dsecd did not get ready within {timeout}s:\n{self.log_tail()}")
                r, _, _ = select.select([ready_r], [], [], min(left, 0.5))
                if r:
                    chunk = os.read(ready_r, 64)
                    if not chunk:
                        raise RuntimeError(f"dsecd closed its ready fd without 'ready' (exit "
                                           f"{self.proc.poll()}):\n{self.log_tail()}")
                    got += chunk
                elif self.proc.poll() is not None:
                    raise RuntimeError(f"dsecd exited with {self.proc.returncode} before ready:\n{self.log_tail()}")
        finally:
            os.close(ready_r)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        return file_tail(self.log_path, n)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, and the exit status (SIGKILL after `timeout`, reported as -9)."""
        return stop_process(self.proc, timeout)

    def leftovers(self, sandbox_id: str | None = None) -> list[str]:
        return leftovers(self.run_dir, self.cgroup_name, sandbox_id)

    def start_refused(self, message: str) -> None:
        """start() must fail, saying `message` (a regular expression); what the attempt left is removed."""
        import pytest
        with pytest.raises(RuntimeError, match=message):
            self.start()
        self.stop()
        self.remove_husks()

    def start_or_clean(self) -> "Agent":
        """start(); when it fails, what the attempt left is removed and the error raised."""
        try:
            self.start()
        except Exception:
            self.stop()
            self.remove_husks()
            raise
        return self

    def stop_and_check(self, problems: Sequence[str] = ()) -> None:
        """SIGTERM; then the agent must have exited with 0 and left nothing on the host (nor any of `problems`, what
        the caller found itself). Removes the husks when it is clean. Nothing to check when it never started."""
        status = self.stop()
        found = self.leftovers() + list(problems)
        log = self.log_tail()
        if not found:
            self.remove_husks()
        if self.proc is None:
            return
        assert status == 0, f"dsecd exited with {status} on SIGTERM:\n{log}"
        assert not found, "dsecd left things behind:\n  " + "\n  ".join(found) + f"\nlog:\n{log}"

    def cgroup_dir(self, controller: str, sandbox_id: str) -> str:
        """A sandbox's cgroup directory for a v1 controller, or its v2 directory (a batch sandbox's cpu group is
        under <name>.batch where the kernel has cpu.idle)."""
        name = self.cgroup_name
        if os.path.isdir(f"/sys/fs/cgroup/{controller}/{name}"):
            batch = f"/sys/fs/cgroup/{controller}/{name}.batch/{name}/{sandbox_id}"
            return batch if os.path.isdir(batch) else f"/sys/fs/cgroup/{controller}/{name}/{sandbox_id}"
        batch = f"/sys/fs/cgroup/{name}.batch/{sandbox_id}"
        return batch if os.path.isdir(batch) else f"/sys/fs/cgroup/{name}/{sandbox_id}"

    def remove_husks(self) -> None:
        """After the checks: remove the (empty) cgroup subtree roots, the run dir and the temp dir."""
        remove_cgroup_husks(self.cgroup_name)
        for d in (self.run_dir,):
            try:
                os.rmdir(d)
            except OSError:
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)


def build_busybox_image(home: str) -> None:
    r = subprocess.run([str(DSEC_CLI), "image", "build", "busybox", "--from", "busybox-static", "--home", home],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"dsec image build busybox failed ({r.returncode}): {r.stdout}{r.stderr}")


def compile_program(name: str, out_dir: str) -> str:
    """Compiles programs/<name>.c statically with the host's gcc; returns the binary's path."""
    src = PROGRAMS / f"{name}.c"
    out = os.path.join(out_dir, name)
    r = subprocess.run(["gcc", "-static", "-O1", "-Wall", "-o", out, str(src)], capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"gcc -static {src} failed: {r.stderr}")
    return out
