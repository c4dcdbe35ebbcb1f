"""Fixtures for dsec's integration tests: a real dsecd with real container sandboxes.

The session starts one agent on a temporary unix socket with its own run dir (/run/dsec-test-<pid>), cgroup subtree
(dsec-test-<pid>) and image store (a temp home holding a busybox image built with `dsec image build`). On teardown it
SIGTERMs the agent and asserts that nothing is left: no mount under the run dir, no cgroup below the subtree root, no
process in the subtree or rooted in the run dir, no run dir entry, no socket file, no sandbox record.

Everything skips, with the reason, when not root or when the build ($DSEC_BUILD_DIR, else ./build) is missing.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

import dsec_testlib as lib

_SKIP = lib.skip_reason()


def pytest_collection_modifyitems(config, items):
    if _SKIP is None:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    marker = pytest.mark.skip(reason=_SKIP)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(marker)


def pytest_report_header(config):
    return [f"dsec build: {lib.BUILD}" + (f" (skipping: {_SKIP})" if _SKIP else "")]


@pytest.fixture(scope="session")
def image_home():
    """A temporary dsec home with a busybox image in its store."""
    home = tempfile.mkdtemp(prefix="dsec-it-home-")
    try:
        lib.build_busybox_image(home)
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def agent(image_home):
    """The session's dsecd. Teardown stops it and asserts it left nothing behind."""
    a = lib.Agent(image_home, tag="")
    try:
        a.start()
    except Exception:
        a.stop()
        a.remove_husks()
        raise
    try:
        yield a
    finally:
        status = a.stop()
        problems = a.leftovers()
        if os.path.exists(a.socket_path):
            problems.append(f"socket file left: {a.socket_path}")
        state = os.path.join(image_home, "state", "sandboxes")
        if os.path.isdir(state) and os.listdir(state):
            problems.append(f"sandbox records left in {state}: {sorted(os.listdir(state))}")
        log = a.log_tail()
        if not problems:
            a.remove_husks()
        assert status == 0, f"dsecd exited with {status} on SIGTERM:\n{log}"
        assert not problems, "dsecd left things behind:\n  " + "\n  ".join(problems) + f"\nlog:\n{log}"


@pytest.fixture(scope="session")
def client(agent):
    """A dsec.Client connected to the session's agent."""
    c = lib.dsec.Client(endpoints=[agent.endpoint])
    yield c
    c.close()


def _busybox_sandbox(client, agent, ttl: float):
    sb = client.create(image="busybox", ttl=ttl, memory="256Mi", pids=256)
    yield sb
    sb.destroy()
    problems = agent.leftovers(sb.id)
    assert not problems, f"sandbox {sb.id} left things behind after destroy:\n  " + "\n  ".join(problems)


@pytest.fixture
def sandbox(client, agent):
    """One busybox sandbox, destroyed (and checked gone from the host) after the test."""
    yield from _busybox_sandbox(client, agent, ttl=600)


@pytest.fixture(scope="module")
def module_sandbox(client, agent):
    """One busybox sandbox shared by a module's tests, destroyed (and checked gone) after the last of them: for
    tests that leave it as they found it (they end what they start)."""
    yield from _busybox_sandbox(client, agent, ttl=1800)


@pytest.fixture(scope="session")
def programs():
    """The helper programs under programs/, compiled static with the host's gcc: {name: path}."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: the static helper programs cannot be built (apt-get install gcc)")
    out = tempfile.mkdtemp(prefix="dsec-it-programs-")
    try:
        try:
            built = {"probe": lib.compile_program("probe", out)}
        except RuntimeError as e:
            pytest.skip(f"cannot build the static helper programs (libc6-dev with libc.a needed): {e}")
        yield built
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture
def probe(programs):
    """Uploads the probe program into a sandbox at /usr/local/bin/probe; returns its path there."""

    def upload(sb) -> str:
        with open(programs["probe"], "rb") as f:
            sb.write_file("/usr/local/bin/probe", f.read(), 0o755)
        return "/usr/local/bin/probe"

    return upload
