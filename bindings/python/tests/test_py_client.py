"""The Python client against a real dsecd, on its `null` backend (control plane only: no processes run)."""

from __future__ import annotations

import gc
import io
import os
import socket
import tarfile
import threading
import time

import pytest

import dsec


def null(client: dsec.Client, **kw) -> dsec.Sandbox:
    kw.setdefault("image", "busybox")
    kw.setdefault("cpu", 0.05)  # the agent admits at most cores x cpu_overcommit requested cpu
    return client.create(kind="null", **kw)


def test_create_info_destroy(client):
    sb = null(client, cpu=0.5, memory="256Mi", disk="2Gi", ttl=120, labels={"suite": "py"}, tenant="t1")
    assert sb.id.startswith("pyt-n1-")
    info = sb.info()
    assert info.id == sb.id and info.state == "running" and info.kind == "null" and info.node == "pyt-n1"
    assert info.resources.cpu == 0.5
    assert info.resources.memory_bytes == 256 << 20
    assert info.resources.disk_bytes == 2 << 30
    assert info.labels == {"suite": "py"} and info.tenant == "t1"
    assert 100 < info.expires_at - info.created_at <= 121
    sb.destroy()
    sb.destroy()  # idempotent
    assert sb.destroyed
    assert client.attach(sb.id).info().state == "destroyed"
    with pytest.raises(dsec.FailedPrecondition):
        sb.read_file("/x")


def test_unknown_sandbox_is_not_found(client):
    with pytest.raises(dsec.NotFound) as info:
        client.attach("pyt-n1-000000000000").info()
    assert isinstance(info.value, KeyError)
    with pytest.raises(dsec.InvalidArgument):
        client.attach("../../etc")


def test_bad_specs_are_invalid_argument(client):
    cases = [({"memory": "lots"}, "resources.memory"), ({"disk": "-1"}, "resources.disk"),
             ({"cpu": 0}, "resources.cpu"), ({"cpu": "2"}, "resources.cpu"), ({"memory": 1}, "resources.memory"),
             ({"ttl": -1}, "ttl"), ({"env": {"A=B": "x"}}, "env"), ({"labels": {"k": 1}}, "labels"),
             ({"image": "../x"}, "image"), ({"hostname": "not a hostname!"}, "hostname"),
             ({"pids": 0}, "resources.pids")]
    for kw, field in cases:
        with pytest.raises(dsec.InvalidArgument) as info:
            null(client, **kw)
        assert field in str(info.value), (kw, str(info.value))


def test_same_request_id_same_sandbox(client):
    a = null(client, request_id="py-idem-1")
    b = null(client, request_id="py-idem-1")
    assert a.id == b.id
    c = null(client)
    d = null(client)
    assert c.id != d.id
    for s in (a, c, d):
        s.destroy()


def test_files_roundtrip(client):
    with null(client) as sb:
        data = bytes(range(256)) * 100
        sb.write_file("/work/data.bin", data)
        assert sb.read_file("/work/data.bin") == data
        sb.write_file("/work/text.txt", "héllo")  # str is UTF-8
        assert sb.read_file("/work/text.txt") == "héllo".encode()
        sb.write_file("/work/empty", b"")
        assert sb.read_file("/work/empty") == b""
        with pytest.raises(dsec.NotFound):
            sb.read_file("/work/missing")
        with pytest.raises(dsec.InvalidArgument):
            sb.read_file("relative/path")


def test_directories_as_tar(client, tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("print('x')\n")
    (src / "README").write_bytes(b"readme")
    with null(client) as sb:
        sb.upload(src, "/work/project")
        assert sb.read_file("/work/project/pkg/mod.py") == b"print('x')\n"
        assert sb.read_file("/work/project/README") == b"readme"
        with pytest.raises(dsec.InvalidArgument):
            sb.read_file("/work/project")  # a directory
        names = tarfile.open(fileobj=io.BytesIO(sb.download_tar("/work/project"))).getnames()
        assert any(n.endswith("pkg/mod.py") for n in names), names
        out = tmp_path / "out"
        sb.download("/work/project", out)
        assert (out / "pkg" / "mod.py").read_text() == "print('x')\n"
        assert (out / "README").read_bytes() == b"readme"


def test_download_refuses_members_outside_the_target(tmp_path):
    from dsec.sandbox import _safe_extract

    for name in ("../evil", "/abs/evil", "a/../../evil"):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as t:
            ti = tarfile.TarInfo(name)
            ti.size = 1
            t.addfile(ti, io.BytesIO(b"x"))
        with pytest.raises(dsec.InvalidArgument):
            _safe_extract(buf.getvalue(), str(tmp_path / "dest"))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        link = tarfile.TarInfo("link")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc"
        t.addfile(link)
    with pytest.raises(dsec.InvalidArgument):
        _safe_extract(buf.getvalue(), str(tmp_path / "dest2"))
    assert not (tmp_path / "evil").exists()


def test_exec_on_null_is_unimplemented(client):
    with null(client) as sb:
        with pytest.raises(dsec.Unimplemented):
            sb.exec("echo hi")
        with pytest.raises(dsec.InvalidArgument):
            sb.exec(["echo", 1])
        with pytest.raises(dsec.InvalidArgument):
            sb.exec("echo", timeout=-1)


def test_list_filters(client):
    tag = f"list-{os.getpid()}-{time.monotonic_ns()}"
    a = null(client, labels={"run": tag, "role": "a"}, tenant="ta")
    b = null(client, labels={"run": tag, "role": "b"}, tenant="tb")
    try:
        assert {s.id for s in client.list(labels={"run": tag})} == {a.id, b.id}
        assert [s.id for s in client.list(labels={"run": tag, "role": "b"})] == [b.id]
        assert [s.id for s in client.list(labels={"run": tag}, tenant="ta")] == [a.id]
    finally:
        a.destroy()
        b.destroy()
    assert client.list(labels={"run": tag}) == []


def test_create_many_and_its_request_ids(client):
    tag = f"many-{time.monotonic_ns()}"
    sbs = client.create_many(24, image="busybox", kind="null", cpu=0.05, labels={"run": tag}, request_id=tag)
    assert len({s.id for s in sbs}) == 24
    again = client.create_many(24, image="busybox", kind="null", cpu=0.05, labels={"run": tag}, request_id=tag)
    assert [s.id for s in again] == [s.id for s in sbs]  # the same batch, not a second one
    assert len(client.list(labels={"run": tag})) == 24
    for s in sbs:
        s.destroy()
    assert client.create_many(0, image="busybox", kind="null") == []


def test_create_many_is_all_or_nothing(client):
    tag = f"aon-{time.monotonic_ns()}"
    with pytest.raises(dsec.NotFound):
        client.create_many(8, image="no-such-image", kind="null", cpu=0.05, labels={"run": tag})
    # More cpu than the node admits: the first creates succeed, the rest are refused, and the made ones go again.
    (node,) = client.nodes()
    n = int(node.cores * node.cpu_overcommit) + 4
    with pytest.raises(dsec.ResourceExhausted):
        client.create_many(n, image="busybox", kind="null", cpu=1.0, labels={"run": tag})
    assert client.list(labels={"run": tag}) == []
    assert client.nodes()[0].cpu_requested == node.cpu_requested


def test_sandbox_is_not_destroyed_by_garbage_collection(client):
    sb = null(client)
    sid = sb.id
    del sb
    gc.collect()
    again = client.attach(sid)
    assert again.info().state == "running"
    again.destroy()


def test_context_manager_destroys(client):
    with null(client) as sb:
        assert sb.info().state == "running"
    assert client.attach(sb.id).info().state == "destroyed"


def test_nodes(client):
    (node,) = client.nodes()
    assert node.id == "pyt-n1"
    assert "null" in node.backends
    assert node.cores >= 1 and node.memory_bytes > 0
    assert "busybox:latest" in node.images


def test_closed_client(agent):
    c = dsec.Client(endpoints=[agent.endpoint])
    sb = null(c)
    c.close()
    c.close()
    assert c.closed
    with pytest.raises(dsec.FailedPrecondition):
        c.nodes()
    with pytest.raises(dsec.FailedPrecondition):
        sb.info()
    with dsec.Client(endpoints=[agent.endpoint]) as c2:
        c2.attach(sb.id).destroy()


def test_threads_share_one_client(client):
    errors = []
    ids = []
    lock = threading.Lock()

    def work():
        try:
            for _ in range(10):
                with null(client) as sb:
                    sb.write_file("/f", sb.id)
                    assert sb.read_file("/f") == sb.id.encode()
                    with lock:
                        ids.append(sb.id)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(ids)) == 80


def test_blocking_calls_release_the_gil(tmp_path):
    # A server that accepts and never answers: a call to it blocks until its deadline. While it blocks, other
    # Python threads must keep running.
    path = str(tmp_path / "silent.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    conns = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                pass

    acceptor = threading.Thread(target=accept)
    acceptor.start()
    try:
        c = dsec.Client(endpoints=["unix:" + path], call_deadline=1.0)
        ticks = 0
        done = threading.Event()

        def blocked():
            with pytest.raises(dsec.DeadlineExceeded):
                c.nodes()
            done.set()

        t = threading.Thread(target=blocked)
        start = time.monotonic()
        t.start()
        while not done.is_set():
            ticks += 1
            time.sleep(0.001)
        t.join()
        elapsed = time.monotonic() - start
        assert 0.8 < elapsed < 5
        assert ticks > 100, f"the main thread ran only {ticks} times in {elapsed:.2f}s: the GIL was held"
        c.close()
    finally:
        stop.set()
        acceptor.join()
        for s in conns:
            s.close()
        srv.close()


def test_routing_across_two_agents(short_tmp):
    from binding_testlib import Agent

    a = Agent(os.path.join(short_tmp, "ra"), "pyt-r", backends="null")
    b = Agent(os.path.join(short_tmp, "rb"), "pyt-r-2", backends="null")  # a node id that extends the other
    try:
        with dsec.Client(endpoints=[a.endpoint, b.endpoint]) as c:
            made = [null(c) for _ in range(6)]
            nodes = {s.info().node for s in made}
            assert nodes == {"pyt-r", "pyt-r-2"}  # creates were spread over both
            assert sorted(n.id for n in c.nodes()) == ["pyt-r", "pyt-r-2"]
        # A fresh client, endpoints in the other order, finds every sandbox on the node that made it.
        with dsec.Client(endpoints=[b.endpoint, a.endpoint]) as c:
            for s in made:
                info = c.attach(s.id).info()
                assert s.id.startswith(info.node + "-")
                c.attach(s.id).destroy()
            assert c.list() == []
            with pytest.raises(dsec.NotFound):
                c.attach("pyt-q-0123").info()
    finally:
        a.stop()
        b.stop()
