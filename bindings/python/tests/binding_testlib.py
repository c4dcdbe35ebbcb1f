"""Helpers that run real node agents (dsecd) for the binding's tests.

Run against a build tree: ``PYTHONPATH=<build>/python /usr/bin/python3 -m pytest bindings/python/tests``. The agents
and the `dsec` CLI come from the package's own ``dsec/bin`` (CMake copies them there). Every agent gets its own
home with a busybox image built by ``dsec image build busybox --from busybox-static``.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import time

import pytest

try:
    import dsec
except ImportError:  # pragma: no cover - a hint for running from a checkout
    for candidate in (os.environ.get("DSEC_BUILD_DIR", ""), os.path.join(os.path.dirname(__file__), "../../../build")):
        if candidate and os.path.isdir(os.path.join(candidate, "python", "dsec")):
            sys.path.insert(0, os.path.join(candidate, "python"))
            break
    import dsec


BIN_DIR = os.path.join(os.path.dirname(dsec.__file__), "bin")


def tool(name: str) -> str:
    path = os.path.join(BIN_DIR, name)
    if not os.access(path, os.X_OK):
        pytest.skip(f"{path} is missing: build the _dsec target, which copies dsecd and dsec into the package")
    return path


def make_home(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    subprocess.run([tool("dsec"), "--home", path, "image", "build", "busybox", "--from", "busybox-static"],
                   check=True, capture_output=True, timeout=120)
    return path


# The host's Debian packages a function-call image is assembled from: python3 (the fork servers are Python), dash
# as /bin/sh, and gcc/g++ with binutils and the C and C++ headers and libraries; the shared libraries every binary
# needs are added by ldd.
_FNCALL_PACKAGES = (
    "python3-minimal", "python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib", "dash", "coreutils",
    "gcc", "g++", "cpp", "gcc-12", "g++-12", "cpp-12", "libgcc-12-dev", "libstdc++-12-dev", "binutils",
    "binutils-x86-64-linux-gnu", "libc6", "libc6-dev", "linux-libc-dev", "libcrypt-dev",
)
_SKIPPED_PREFIXES = ("/usr/share/doc", "/usr/share/man", "/usr/share/info", "/usr/share/locale", "/usr/share/lintian",
                     "/usr/lib/python3.11/test", "/usr/lib/python3.11/idlelib", "/usr/lib/python3.11/tkinter",
                     "/usr/lib/python3.11/ensurepip", "/usr/lib/python3.11/lib2to3")


def _real(path: str) -> str:
    """The path with its directories resolved (usrmerge: /bin/x is /usr/bin/x), the last component kept."""
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def fncall_image_reason() -> str | None:
    """Why this host cannot assemble the function-call test image, or None."""
    if shutil.which("dpkg") is None or shutil.which("ldd") is None:
        return "dpkg and ldd are needed to assemble the function-call image from the host's packages"
    missing = [p for p in _FNCALL_PACKAGES
               if subprocess.run(["dpkg", "-L", p], capture_output=True).returncode != 0]
    if missing:
        return f"host packages missing for the function-call image: {' '.join(missing)} (apt-get install python3 g++)"
    return None


def build_fncall_image(home: str, name: str = "fncall-host") -> str:
    """Builds `name` in home's store from the host's own python3, sh, gcc and g++ files (about 250 MB, no
    network), for function calls in every language. Returns the name."""
    files: set[str] = set()
    for pkg in _FNCALL_PACKAGES:
        out = subprocess.run(["dpkg", "-L", pkg], check=True, capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("/") and not line.startswith(_SKIPPED_PREFIXES) and os.path.lexists(line):
                if not os.path.isdir(line) or os.path.islink(line):
                    files.add(_real(line))
    # The shared libraries (and the loader) of every ELF file, by ldd on the host.
    libs: set[str] = set()
    for f in sorted(files):
        if os.path.islink(f) or not os.path.isfile(f) or not os.access(f, os.X_OK) and ".so" not in f:
            continue
        with open(f, "rb") as fh:
            if fh.read(4) != b"\x7fELF":
                continue
        out = subprocess.run(["ldd", f], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            for token in parts:
                if token.startswith("/") and os.path.exists(token):
                    libs.add(_real(token))
                    libs.add(os.path.realpath(token))
    files |= libs
    tree = os.path.join(home, "fncall-tree")
    os.makedirs(tree, exist_ok=True)
    listing = os.path.join(home, "fncall-files")
    with open(listing, "w") as fh:
        fh.write("\n".join(f.lstrip("/") for f in sorted(files)) + "\n")
    subprocess.run(f"tar -C / -cf - --no-recursion -T {listing} | tar -C {tree} -xf -", shell=True, check=True,
                   capture_output=True, timeout=300)
    for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"), ("sbin", "usr/sbin")):
        if not os.path.lexists(os.path.join(tree, link)):
            os.symlink(target, os.path.join(tree, link))
    for d in ("tmp", "proc", "dev", "sys", "etc", "root", "work"):
        os.makedirs(os.path.join(tree, d), exist_ok=True)
    with open(os.path.join(tree, "etc", "passwd"), "w") as fh:
        fh.write("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n")
    subprocess.run([tool("dsec"), "--home", home, "image", "build", name, "--from", "dir:" + tree, "-q"], check=True,
                   capture_output=True, timeout=600)
    shutil.rmtree(tree, ignore_errors=True)
    os.unlink(listing)
    return name


class Agent:
    """One real dsecd on a unix socket, started with --ready-fd and stopped with SIGTERM."""

    def __init__(self, root: str, node_id: str, backends: str = "container,null", home: str | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.root = root
        self.node_id = node_id
        self.home = home or make_home(os.path.join(root, "home"))
        self.socket = os.path.join(root, "d.sock")
        self.run_dir = os.path.join(root, "run")
        self.log_path = os.path.join(root, "dsecd.log")
        os.makedirs(self.run_dir, exist_ok=True)
        r, w = os.pipe()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [tool("dsecd"), "--socket", self.socket, "--home", self.home, "--run-dir", self.run_dir,
                 "--node-id", node_id, "--backends", backends, "--ready-fd", str(w), *extra_args],
                pass_fds=(w,), stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        os.close(w)
        try:
            got = b""
            deadline = time.monotonic() + 30
            while b"ready\n" not in got:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([r], [], [], left)[0]:
                    raise RuntimeError(f"dsecd {node_id} not ready in 30 s: {self.log()}")
                chunk = os.read(r, 64)
                if not chunk:
                    raise RuntimeError(f"dsecd {node_id} exited before it was ready: {self.log()}")
                got += chunk
        finally:
            os.close(r)

    @property
    def endpoint(self) -> str:
        return "unix:" + self.socket

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-4000:].decode(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
