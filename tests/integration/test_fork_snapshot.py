"""A fork's snapshot under a generated name goes with the last sandbox made from it: the copies carry the label
dsec.fork-snapshot, and the node removes the tag from its snapshot store when none of them is left. With keep=True,
or under a name of the caller's, it stays."""

from __future__ import annotations

import os
import uuid

import pytest

import dsec_testlib as lib

dsec = lib.dsec


@pytest.fixture
def store_client(agent):
    """A client that lists the agent's snapshot store (its home store)."""
    with dsec.Client(endpoints=[agent.endpoint], stores=[os.path.join(agent.home, "store")]) as c:
        yield c


def tags(store_client) -> set[str]:
    return {i.reference for i in store_client.images()}


def snapshot_of(copy) -> str:
    info = copy.info()
    tagged = info.labels.get("dsec.fork-snapshot", "")
    assert info.image.startswith(tagged + "@sha256:") if tagged else info.image.startswith("fork/")
    return tagged or info.image.split("@")[0]


def test_the_snapshot_goes_with_the_last_copy(sandbox, store_client):
    sandbox.exec("echo forked > /mark")
    copies = sandbox.fork(2)
    try:
        name = snapshot_of(copies[0])
        assert name.startswith("fork/") and snapshot_of(copies[1]) == name
        assert name in tags(store_client)
        assert copies[0].read_file("/mark") == b"forked\n"
        copies[0].destroy()
        assert name in tags(store_client), "a copy still lives"
        copies[1].destroy()
        assert name not in tags(store_client), "the last copy is gone, and so is the snapshot"
    finally:
        for c in copies:
            c.destroy()
    assert "busybox:latest" in tags(store_client)


def test_a_copy_of_a_copy_has_its_own_snapshot(sandbox, store_client):
    (child,) = sandbox.fork(1)
    made = [child]
    try:
        (grandchild,) = child.fork(1)
        made.append(grandchild)
        first, second = snapshot_of(child), snapshot_of(grandchild)
        assert first != second and {first, second} <= tags(store_client)
        child.destroy()
        assert first not in tags(store_client) and second in tags(store_client)
        grandchild.destroy()
        assert second not in tags(store_client)
    finally:
        for sb in made:
            sb.destroy()


@pytest.mark.parametrize("how", ["keep", "named"])
def test_a_kept_or_named_snapshot_stays(sandbox, store_client, how):
    name = f"it/fork-{uuid.uuid4().hex[:12]}:kept"
    copies = sandbox.fork(2, keep=True) if how == "keep" else sandbox.fork(2, name=name)
    try:
        info = copies[0].info()
        assert "dsec.fork-snapshot" not in info.labels
        kept = info.image.split("@")[0]
        if how == "named":
            assert kept == name
    finally:
        for c in copies:
            c.destroy()
    assert kept in tags(store_client), "a kept snapshot outlives its copies"
    store_client.remove_image(kept)
    assert kept not in tags(store_client)
