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


class Agent:
    """One real dsecd on a unix socket, started with --ready-fd and stopped with SIGTERM."""

    def __init__(self, root: str, node_id: str, backends: str = "container,null") -> None:
        self.root = root
        self.node_id = node_id
        self.home = make_home(os.path.join(root, "home"))
        self.socket = os.path.join(root, "d.sock")
        self.run_dir = os.path.join(root, "run")
        self.log_path = os.path.join(root, "dsecd.log")
        os.makedirs(self.run_dir, exist_ok=True)
        r, w = os.pipe()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [tool("dsecd"), "--socket", self.socket, "--home", self.home, "--run-dir", self.run_dir,
                 "--node-id", node_id, "--backends", backends, "--ready-fd", str(w)],
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
