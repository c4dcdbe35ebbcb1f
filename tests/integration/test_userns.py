"""User namespaces: root inside a container sandbox is not root outside.

Each sandbox's processes run in a user namespace of their own whose ids 0..65535 are a block of 65,536 unprivileged
host ids; no two live sandboxes share a block (also across agents on one host), an agent restart takes the blocks of
its sandboxes back, and files keep the ids the sandbox sees through the files API, snapshots and forks.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile

import pytest

import dsec_testlib as lib

BLOCK = 65536
CLAIMS = "/run/dsec-userns"


def call(agent: lib.Agent, method: str, target: str, body=None, timeout: float = 60.0) -> lib.RawResponse:
    data = b"" if body is None else json.dumps(body).encode()
    return lib.http_request(agent.socket_path, method, target, data,
                            {"Content-Type": "application/json"} if data else None, timeout=timeout)


def create(agent: lib.Agent, **fields) -> dict:
    spec = {"image": "busybox", "ttl": 600, "resources": {"memory": "64Mi", "cpu": 0.1}}
    spec.update(fields)
    r = call(agent, "POST", "/v1/sandboxes", spec)
    assert r.status in (200, 201), r
    return r.json()


def destroy(agent: lib.Agent, sid: str) -> None:
    r = call(agent, "DELETE", f"/v1/sandboxes/{sid}")
    assert r.status in (200, 204), r


def sh(agent: lib.Agent, sid: str, command: str) -> tuple[int, str, str]:
    r = call(agent, "POST", f"/v1/sandboxes/{sid}/exec", {"shell": command, "timeout": 30})
    assert r.status == 200, r
    j = r.json()
    return j["exit_code"], base64.b64decode(j["stdout"]).decode(), base64.b64decode(j["stderr"]).decode()


def uid_map(agent: lib.Agent, sid: str) -> tuple[int, int, int]:
    code, out, err = sh(agent, sid, "cat /proc/self/uid_map")
    assert code == 0, err
    inside, outside, count = (int(x) for x in out.split())
    return inside, outside, count


def init_pid(home: str, sid: str) -> int:
    with open(os.path.join(home, "state", "sandboxes", sid + ".json")) as f:
        return int(json.load(f)["backend"]["init_pid"])


def host_ids_of(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["Uid"].split()[0]), int(fields["Gid"].split()[0])


def node(agent: lib.Agent) -> dict:
    r = call(agent, "GET", "/v1/node")
    assert r.status == 200, r
    return r.json()


@pytest.fixture(scope="module")
def home(image_home):
    h = tempfile.mkdtemp(prefix="dsec-it-userns-")
    yield h
    shutil.rmtree(h, ignore_errors=True)


def start(home: str, image_home: str, tag: str, *extra: str) -> lib.Agent:
    a = lib.Agent(home, tag=tag, extra_args=["--store", os.path.join(image_home, "store"), *extra])
    a.start()
    return a


@pytest.fixture(scope="module")
def on(home, image_home):
    """An agent that must give user namespaces (--userns on: it refuses to start without them)."""
    if not os.path.exists("/proc/self/ns/user"):
        pytest.skip("the kernel has no user namespaces")
    a = start(home, image_home, "uson", "--userns", "on")
    yield a
    a.stop_and_check()


@pytest.fixture(scope="module")
def off(image_home):
    h = tempfile.mkdtemp(prefix="dsec-it-userns-off-")
    a = start(h, image_home, "usoff", "--userns", "off")
    yield a, h
    a.stop_and_check()
    shutil.rmtree(h, ignore_errors=True)


def test_root_inside_is_an_unprivileged_block_of_host_ids(on):
    info = node(on)
    assert info["userns"].startswith("idmapped"), info["userns"]
    sb = create(on)
    sid = sb["id"]
    inside, first, count = uid_map(on, sid)
    assert inside == 0 and count == BLOCK and first >= 268435456, (inside, first, count)
    code, out, err = sh(on, sid, "id -u; id -g; echo data > /tmp/made-inside; mkdir /tmp/d; "
                                 "stat -c '%u:%g' /tmp/made-inside /bin/sh")
    assert code == 0, err
    assert out.split() == ["0", "0", "0:0", "0:0"], out
    # On the host: the sandbox's init runs as the block's first id, and its files are the block's ids.
    pid = init_pid(on.home, sid)
    assert host_ids_of(pid) == (first, first)
    root = f"/proc/{pid}/root"
    assert os.stat(f"{root}/tmp/made-inside").st_uid == first
    assert os.stat(f"{root}/bin/sh").st_uid == first  # the image's layers, idmapped
    # Host id first + 1000 is user 1000 inside.
    os.chown(f"{root}/tmp/d", first + 1000, first + 1000)
    assert sh(on, sid, "stat -c '%u:%g' /tmp/d")[1].split() == ["1000:1000"]
    # The block is claimed on the host for as long as the sandbox lives.
    claim = os.path.join(CLAIMS, str(first))
    with open(claim) as f:
        assert int(f.read().split()[0]) == on.proc.pid
    destroy(on, sid)
    assert lib.wait_for(lambda: not os.path.exists(claim), 5), f"claim {claim} left after destroy"


BIND_HOST_FILE = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
host_file, pid, target = sys.argv[1], int(sys.argv[2]), sys.argv[3]
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC, AT_EMPTY_PATH, MOVE_MOUNT_F_EMPTY_PATH = 1, 0o2000000, 0x1000, 0x4
tree = libc.syscall(428, -100, host_file.encode(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)
if tree < 0: sys.exit("open_tree: " + os.strerror(ctypes.get_errno()))
ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
if libc.setns(ns, 0x00020000) != 0: sys.exit("setns: " + os.strerror(ctypes.get_errno()))
if libc.syscall(429, tree, b"", -100, target.encode(), MOVE_MOUNT_F_EMPTY_PATH) != 0:
    sys.exit("move_mount: " + os.strerror(ctypes.get_errno()))
"""


def bind_host_file_into(pid: int, host_file: str, target: str) -> None:
    """Mounts a host file over `target` in the sandbox's mount namespace: a host object the sandbox can reach."""
    r = subprocess.run([sys.executable, "-c", BIND_HOST_FILE, host_file, str(pid), target],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_root_owned_host_file_is_not_roots_inside(mode, request, tmp_path):
    """A sandbox whose root is the host's could write a root-owned host file it reaches; in a user namespace, the
    file's owner is nobody inside and the write is refused."""
    if mode == "on":
        agent = request.getfixturevalue("on")
        home = agent.home
    else:
        agent, home = request.getfixturevalue("off")
        assert node(agent)["userns"].startswith("off"), node(agent)["userns"]
    host_file = tmp_path / "host-owned"
    host_file.write_text("host\n")
    os.chown(host_file, 0, 0)
    os.chmod(host_file, 0o644)
    sb = create(agent)
    sid = sb["id"]
    try:
        assert sh(agent, sid, "touch /tmp/target")[0] == 0
        bind_host_file_into(init_pid(home, sid), str(host_file), "/tmp/target")
        code, out, err = sh(agent, sid, "stat -c %u /tmp/target; echo sandbox >> /tmp/target")
        if mode == "on":
            assert out.split() == ["65534"], out  # the host's root has no id inside
            assert code != 0 and "ermission denied" in err, (code, err)
            assert host_file.read_text() == "host\n"
        else:
            assert out.split() == ["0"] and code == 0, (code, out, err)
            assert host_file.read_text() == "host\nsandbox\n"
    finally:
        destroy(agent, sid)


def test_no_two_sandboxes_share_a_block_and_blocks_come_back(on, off):
    sbs = [create(on) for _ in range(3)]
    firsts = [uid_map(on, s["id"])[1] for s in sbs]
    assert len(set(firsts)) == 3, firsts
    assert all(abs(a - b) >= BLOCK for a in firsts for b in firsts if a != b), firsts
    for s in sbs:
        destroy(on, s["id"])
    for first in firsts:
        assert lib.wait_for(lambda: not os.path.exists(os.path.join(CLAIMS, str(first))), 5)
    # Without user namespaces the map is the identity.
    agent, _ = off
    sb = create(agent)
    try:
        assert uid_map(agent, sb["id"]) == (0, 0, 4294967295)
    finally:
        destroy(agent, sb["id"])


def test_files_api_snapshot_and_fork_keep_the_ids_inside(on):
    client = lib.dsec.Client(endpoints=[on.endpoint])
    sb = client.create(image="busybox", ttl=600)
    sid = sb.id
    copies = []
    try:
        sb.write_file("/tmp/uploaded", b"up\n")
        r = sb.exec(["sh", "-c", "stat -c '%u:%g' /tmp/uploaded; mkdir -p /home/agent; echo x > /home/agent/f"])
        assert r.exit_code == 0 and r.stdout.split() == [b"0:0"], r
        # User 1000 inside (root inside holds no CAP_CHOWN: the host gives the files away).
        first = uid_map(on, sid)[1]
        root = f"/proc/{init_pid(on.home, sid)}/root"
        for p in ("/home/agent", "/home/agent/f"):
            os.chown(root + p, first + 1000, first + 1000)
        # A download carries the ids the sandbox sees.
        got = lib.http_request(on.socket_path, "GET", f"/v1/sandboxes/{sid}/files?path=/home/agent&format=tar")
        assert got.status == 200, got
        with tarfile.open(fileobj=io.BytesIO(got.body)) as tar:
            owners = {m.name.lstrip("./"): (m.uid, m.gid) for m in tar.getmembers()}
        assert owners.get("f") == (1000, 1000), owners
        # Copies run in blocks of their own and see the same owners.
        copies = sb.fork(1)
        r = copies[0].exec(["stat", "-c", "%u:%g", "/home/agent", "/home/agent/f", "/tmp/uploaded"])
        assert r.exit_code == 0 and r.stdout.split() == [b"1000:1000", b"1000:1000", b"0:0"], r
        assert uid_map(on, copies[0].id)[1] != uid_map(on, sid)[1]
    finally:
        for c in copies:
            c.destroy()
        sb.destroy()


def test_restart_takes_the_blocks_back(home, image_home):
    a = start(home, image_home, "usrestart")
    agents = [a]
    try:
        sb = create(a)
        sid = sb["id"]
        first = uid_map(a, sid)[1]
        assert sh(a, sid, "echo kept > /tmp/kept")[0] == 0
        os.kill(a.proc.pid, signal.SIGKILL)
        a.proc.wait(15)
        b = start(home, image_home, "usrestart")
        agents.append(b)
        # Taken over with its block: the claim is the new agent's, and a new sandbox gets another block.
        assert uid_map(b, sid)[1] == first
        code, out, _ = sh(b, sid, "cat /tmp/kept; stat -c %u /tmp/kept")
        assert (code, out.split()) == (0, ["kept", "0"])
        with open(os.path.join(CLAIMS, str(first))) as f:
            assert int(f.read().split()[0]) == b.proc.pid
        other = create(b)
        assert uid_map(b, other["id"])[1] != first
        destroy(b, other["id"])
        destroy(b, sid)
        assert lib.wait_for(lambda: not os.path.exists(os.path.join(CLAIMS, str(first))), 5)
    finally:
        for agent in agents[:-1]:
            agent.stop()
        agents[-1].stop_and_check()


def test_a_node_out_of_blocks_says_so_and_makes_nothing(image_home, tmp_path):
    """One block (and none made ahead for later): the second sandbox is RESOURCE_EXHAUSTED, nothing of it is left,
    and the block serves again once the first is gone."""
    h = str(tmp_path / "home")
    os.mkdir(h)
    # A block of its own, far from the default range, so that no other agent of the tests holds it.
    a = start(h, image_home, "us1", "--userns", "on", "--userns-range", "3000000000:1")
    try:
        first = create(a)
        r = call(a, "POST", "/v1/sandboxes", {"image": "busybox", "resources": {"memory": "64Mi"}})
        assert r.json()["code"] == "RESOURCE_EXHAUSTED" and "user namespace ids" in r.json()["message"], r
        listed = call(a, "GET", "/v1/sandboxes").json()["sandboxes"]
        assert [s["id"] for s in listed] == [first["id"]]
        destroy(a, first["id"])
        again = create(a)
        assert uid_map(a, again["id"])[1] == 3000000000
        destroy(a, again["id"])
    finally:
        a.stop_and_check()


@pytest.mark.parametrize("flags,words", [
    (["--userns", "maybe"], "--userns"),
    (["--userns-range", "12:x"], "--userns-range"),
    (["--userns-range", "4294000000:100"], "--userns-range"),
    (["--userns-range", "0:10"], "--userns-range"),
])
def test_bad_userns_flags_are_refused_at_start(flags, words, tmp_path):
    r = subprocess.run([str(lib.DSECD), "--socket", str(tmp_path / "s.sock"), "--home", str(tmp_path),
                        "--run-dir", str(tmp_path / "run"), *flags], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and words in r.stderr, (r.returncode, r.stderr)
