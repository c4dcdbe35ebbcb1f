"""Client.create_many and Client.create_group with a list of specs: one sandbox per spec in one pulse."""

from __future__ import annotations

import pytest

import dsec


def test_create_many_with_two_specs(client, container_backend):
    specs = [{"image": "busybox", "env": {"TASK": "one"}, "memory": "64Mi", "ttl": 120, "labels": {"t": "1"}},
             {"image": "busybox", "env": {"TASK": "two"}, "memory": "96Mi", "ttl": 120, "labels": {"t": "2"}},
             {"image": "busybox", "env": {"TASK": "one"}, "memory": "64Mi", "ttl": 120, "labels": {"t": "1"}}]
    made = client.create_many(specs)
    try:
        assert len(made) == 3 and len({sb.id for sb in made}) == 3
        assert [sb.exec("echo $TASK").stdout for sb in made] == [b"one\n", b"two\n", b"one\n"]
        infos = [sb.info() for sb in made]
        assert [i.labels["t"] for i in infos] == ["1", "2", "1"]
        assert [i.resources.memory_bytes for i in infos] == [64 << 20, 96 << 20, 64 << 20]
    finally:
        for sb in made:
            sb.destroy()


def test_create_group_with_two_specs(client, container_backend):
    with client.create_group([{"env": {"TASK": "a"}, "memory": "64Mi"}, {"env": {"TASK": "b"}, "memory": "64Mi"}],
                             lease=30) as group:
        assert [sb.exec("echo $TASK").stdout for sb in group] == [b"a\n", b"b\n"]


def test_bad_specs_are_named(client):
    assert client.create_many([]) == []
    with pytest.raises(dsec.InvalidArgument, match=r"specs\[1\]"):
        client.create_many([{"image": "busybox"}, {"imag": "busybox"}])
    with pytest.raises(dsec.InvalidArgument, match=r"specs\[0\]"):
        client.create_many([{"memory": "lots"}])
    with pytest.raises(dsec.InvalidArgument, match="list of specs"):
        client.create_many("busybox")
    with pytest.raises(dsec.InvalidArgument, match=r"specs\[0\]"):
        client.create_many(["busybox"])
