"""Fixtures for the binding's tests: real node agents (dsecd) on unix sockets. See binding_testlib.py."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import dsec
from binding_testlib import Agent


@pytest.fixture(scope="session")
def short_tmp():
    # Unix socket paths are at most 107 bytes: keep the agents' directories short.
    path = subprocess.run(["mktemp", "-d", "/tmp/dsec-py-XXXXXX"], check=True, capture_output=True,
                          text=True).stdout.strip()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def agent(short_tmp):
    a = Agent(os.path.join(short_tmp, "a1"), "pyt-n1")
    yield a
    a.stop()


@pytest.fixture
def client(agent):
    with dsec.Client(endpoints=[agent.endpoint]) as c:
        yield c


@pytest.fixture(scope="session")
def container_backend(agent):
    """Skips the test unless the agent can run container sandboxes on this host."""
    with dsec.Client(endpoints=[agent.endpoint]) as c:
        if "container" not in c.nodes()[0].backends:
            pytest.skip("the agent does not serve the container backend")
        try:
            c.create(image="busybox", kind="container").destroy()
        except dsec.DsecError as e:
            pytest.skip(f"container sandboxes cannot be created on this host: {e}")
    return True
