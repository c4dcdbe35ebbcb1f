"""Snapshots and forks from Python: Sandbox.snapshot returns a dsec.Snapshot (a str holding the pinned reference,
with the report as attributes) that Client.create takes as image=; Sandbox.fork(n) returns n dsec.Sandbox; a group
snapshots every member under numbered tags; errors are the dsec exception classes. Skipped where the host cannot
run container sandboxes."""

from __future__ import annotations

import pickle
import uuid

import pytest

import dsec


def unique(prefix: str) -> str:
    return f"pyt/{prefix}:{uuid.uuid4().hex[:12]}"


@pytest.fixture
def sb(client, container_backend):
    with client.create(image="busybox", kind="container", cpu=0.5, memory="96Mi", pids=64, ttl=300,
                       env={"MODE": "py"}) as s:
        yield s


def test_snapshot_is_a_str_that_create_takes(client, sb):
    sb.exec("echo from-python > /note && rm /bin/true")
    name = unique("snap")
    snap = sb.snapshot(name)
    assert isinstance(snap, dsec.Snapshot) and isinstance(snap, str)
    assert snap.startswith(name + "@sha256:") and snap.image == str(snap)
    assert snap.sandbox_id == sb.id and snap.parent.startswith("busybox:latest@sha256:")
    assert snap.layer_digest.startswith("sha256:") and snap.layer_bytes > 0 and snap.stored_bytes > 0
    assert snap.entries >= 2 and 0 <= snap.frozen_seconds <= snap.seconds
    assert isinstance(snap.result, dsec.SnapshotResult) and snap.result.spec.env == {"MODE": "py"}
    assert "Snapshot(" in repr(snap)
    assert pickle.loads(pickle.dumps(snap)) == str(snap)
    with client.create(image=snap, kind="container", memory="96Mi", ttl=120) as copy:
        assert copy.read_file("/note") == b"from-python\n"
        assert copy.exec("test -e /bin/true").exit_code == 1, "a deleted file stays deleted"


def test_fork_returns_sandboxes_with_the_spec(client, sb):
    sb.exec("echo 41 > /counter")
    forks = sb.fork(3)
    try:
        assert len(forks) == 3 and all(isinstance(f, dsec.Sandbox) for f in forks)
        for i, f in enumerate(forks):
            f.exec(f"echo {i} >> /counter")
        for i, f in enumerate(forks):
            assert f.read_file("/counter") == f"41\n{i}\n".encode()
            assert f.exec("echo $MODE").stdout == b"py\n"
            assert f.info().image.startswith("fork/")
        assert sb.read_file("/counter") == b"41\n"
    finally:
        for f in forks:
            f.destroy()
    named = sb.fork(1, name=unique("named"))
    try:
        assert named[0].info().image.startswith("pyt/named:")
    finally:
        named[0].destroy()


def test_group_snapshot_numbers_the_members(client, container_backend):
    with client.create_group(2, image="busybox", kind="container", memory="64Mi", pids=32, lease=60) as g:
        g.exec("hostname > /who")
        base = unique("group")
        snaps = g.snapshot(base)
        assert [s.split("@")[0] for s in snaps] == [f"{base}-0", f"{base}-1"]
        for member, snap in zip(g, snaps):
            assert snap.sandbox_id == member.id
        untagged = g.snapshot(base.split(":")[0] + "-untagged")
        assert [s.split("@")[0].rsplit(":", 1)[1] for s in untagged] == ["0", "1"]


def test_errors(client, sb, agent):
    name = unique("err")
    sb.snapshot(name)
    with pytest.raises(dsec.AlreadyExists):
        sb.snapshot(name)
    with pytest.raises(dsec.InvalidArgument):
        sb.snapshot("Not A Name")
    with pytest.raises(dsec.InvalidArgument):
        sb.snapshot(42)  # type: ignore[arg-type]
    with pytest.raises(dsec.InvalidArgument):
        sb.fork(0)
    with client.create(image="busybox", kind="null") as nb:
        with pytest.raises(dsec.Unimplemented):
            nb.snapshot(unique("null"))
    gone = client.create(image="busybox", kind="container", memory="64Mi", ttl=60)
    gone.destroy()
    with pytest.raises(dsec.NotFound):
        client.attach(gone.id).snapshot(unique("gone"))
