"""Snapshots and forks of container sandboxes, end to end: a real dsecd, real sandboxes, a real directory store.

A sandbox started from "snapbase" (busybox plus /data and /etc/app.conf) changes its files in every way a task can:
it deletes a file of the image, replaces a directory of the image by a new one with other contents, changes a file,
writes files with modes, symlinks, hard links, an empty file, a FIFO, a big file, a sparse file and a name with odd
bytes. A sandbox created from its snapshot sees exactly that, on the agent that took it (layers streamed lazily
through EROFS over FUSE) and on a second agent that extracts layers whole (fsck.erofs). A process running in the
background is not part of a snapshot (files only); an exec running during the snapshot pauses and completes; a
sleeping sandbox stays asleep. fork(16) gives 16 sandboxes that see the files and then diverge on their own. The bad
inputs: unknown and destroyed sandboxes, taken and malformed names, request ids, concurrent snapshots, a full store
(nothing tagged, the blobs left for `dsec image gc`), and the null backend.

The module runs its own agents; each is stopped at the end and checked to have left nothing behind."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import time

import pytest

import dsec_testlib as lib

dsec = lib.dsec

ODD = "odd\\nname\\377"  # printf escapes: a newline and a byte that is not UTF-8


def dsec_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(lib.DSEC_CLI), *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def stop_agent(agent: lib.Agent) -> None:
    status = agent.stop()
    problems = agent.leftovers()
    log = agent.log_tail()
    if not problems:
        agent.remove_husks()
    assert status == 0, f"dsecd exited with {status}:\n{log}"
    assert not problems, "dsecd left things behind:\n  " + "\n  ".join(problems) + f"\nlog:\n{log}"


@pytest.fixture(scope="module")
def home():
    h = tempfile.mkdtemp(prefix="dsec-it-snap-")
    try:
        lib.build_busybox_image(h)
        tree = pathlib.Path(h) / "tree"
        (tree / "data" / "dir").mkdir(parents=True)
        (tree / "data" / "keep.txt").write_text("kept from the image\n")
        (tree / "data" / "gone.txt").write_text("deleted by the sandbox\n")
        (tree / "data" / "dir" / "a").write_text("old a\n")
        (tree / "data" / "dir" / "b").write_text("old b\n")
        (tree / "etc").mkdir()
        (tree / "etc" / "app.conf").write_text("setting=1\n")
        r = dsec_cli("image", "build", "snapbase", "--from", str(tree), "--parent", "busybox", "--home", h, "-q")
        assert r.returncode == 0, r.stdout + r.stderr
        shutil.rmtree(tree)
        yield h
    finally:
        shutil.rmtree(h, ignore_errors=True)


@pytest.fixture(scope="module")
def agent(home):
    a = lib.Agent(home, tag="snap")
    a.start()
    try:
        yield a
    finally:
        stop_agent(a)


@pytest.fixture(scope="module")
def client(agent, home):
    # The client resolves names (and the snapshots' pinned references) in the store the agent commits them to.
    c = dsec.Client(endpoints=[agent.endpoint], stores=[os.path.join(home, "store")], call_deadline=120)
    yield c
    c.close()


@pytest.fixture
def made(client, agent):
    """Sandboxes a test creates; destroyed (and checked gone) after it."""
    sandboxes = []

    def create(image="snapbase", **kw):
        kw.setdefault("ttl", 600)
        kw.setdefault("memory", "192Mi")
        kw.setdefault("pids", 128)
        sb = client.create(image=image, **kw)
        sandboxes.append(sb)
        return sb

    create.track = sandboxes.extend
    yield create
    for sb in sandboxes:
        sb.destroy()
    for sb in sandboxes:
        problems = agent.leftovers(sb.id)
        assert not problems, f"sandbox {sb.id} left things behind:\n  " + "\n  ".join(problems)


def sh(sb, command: str, **kw) -> bytes:
    r = sb.exec(command, **kw)
    assert r.exit_code == 0, f"{command!r} in {sb.id}: exit {r.exit_code}\n{r.stdout!r}\n{r.stderr!r}"
    return r.stdout


CHANGES = f"""
set -e
rm /data/gone.txt
rm -rf /data/dir && mkdir /data/dir && echo new c > /data/dir/c
echo setting=2 > /etc/app.conf
mkdir -p /work/sub
printf '#!/bin/sh\\necho script\\n' > /work/script.sh && chmod 0750 /work/script.sh
echo private > /work/sub/private && chmod 0600 /work/sub/private && chmod 0711 /work/sub
ln -s ../etc/app.conf /work/link-rel
ln -s /nonexistent/target /work/link-dangling
echo linked > /work/h1 && ln /work/h1 /work/h2
: > /work/empty
mkfifo /work/fifo
dd if=/dev/urandom of=/work/big bs=1048576 count=8 2>/dev/null
dd if=/dev/zero of=/work/sparse bs=1 count=1 seek=67108863 2>/dev/null
printf 'x' | dd of=/work/sparse bs=1 seek=33554432 conv=notrunc 2>/dev/null
echo odd > "$(printf '/work/{ODD}')"
"""

# What a sandbox made from the snapshot must show, checked inside it; exits 3 at the first difference.
CHECKS = f"""
fail() {{ echo "FAIL: $*"; exit 3; }}
test ! -e /data/gone.txt || fail gone.txt is back
test "$(ls /data/dir)" = c || fail "/data/dir holds: $(ls /data/dir | tr '\\n' ' ')"
test "$(cat /data/dir/c)" = "new c" || fail dir/c
test "$(cat /data/keep.txt)" = "kept from the image" || fail keep.txt
test "$(cat /etc/app.conf)" = setting=2 || fail app.conf
test "$(stat -c %a /work/script.sh)" = 750 || fail script mode $(stat -c %a /work/script.sh)
test "$(/work/script.sh)" = script || fail script runs
test "$(stat -c %a /work/sub)" = 711 || fail sub mode
test "$(stat -c %a /work/sub/private)" = 600 || fail private mode
test "$(readlink /work/link-rel)" = ../etc/app.conf || fail link-rel
test "$(cat /work/link-rel)" = setting=2 || fail link-rel target
test "$(readlink /work/link-dangling)" = /nonexistent/target || fail dangling
test "$(stat -c %i /work/h1)" = "$(stat -c %i /work/h2)" || fail hard link
test "$(stat -c %h /work/h1)" = 2 || fail link count
test -f /work/empty -a ! -s /work/empty || fail empty
test -p /work/fifo || fail fifo
test "$(stat -c %s /work/big)" = 8388608 || fail big size
test "$(stat -c %s /work/sparse)" = 67108864 || fail sparse size
test "$(dd if=/work/sparse bs=1 skip=33554432 count=1 2>/dev/null)" = x || fail sparse byte
test "$(cat "$(printf '/work/{ODD}')")" = odd || fail odd name
md5sum /work/big
"""


def take(sb, name):
    snap = sb.snapshot(name)
    assert isinstance(snap, str) and snap.startswith(name + "@sha256:"), snap
    assert snap.image == str(snap) and snap.sandbox_id == sb.id
    assert snap.parent.startswith("snapbase:latest@sha256:") or snap.parent.startswith("busybox:latest@sha256:")
    assert 0 <= snap.frozen_seconds <= snap.seconds
    return snap


def test_a_sandbox_made_from_a_snapshot_has_its_files(made, home, tmp_path):
    src = made()
    sh(src, CHANGES)
    big_md5 = sh(src, "md5sum /work/big")
    snap = take(src, "it/snap:files")
    assert snap.file_bytes >= (8 << 20) + (64 << 20), "the sparse file counts whole"
    assert snap.entries >= 15
    # The source runs on, unchanged by the snapshot.
    assert sh(src, "cat /etc/app.conf") == b"setting=2\n"

    # The manifest: the image's layers plus one snapshot layer, and the store holds its tag.
    r = dsec_cli("image", "inspect", "it/snap:files", "--home", home)
    assert r.returncode == 0, r.stderr
    manifest = json.loads(r.stdout)
    manifest = manifest.get("manifest", manifest)
    roles = [layer["role"] for layer in manifest["layers"]]
    assert roles[-1] == "snapshot" and len(roles) == 3, roles
    assert manifest["parent"] == snap.parent and snap.parent.startswith("snapbase:latest@sha256:")

    copy = made(image=snap)
    assert copy.info().image == str(snap)
    out = sh(copy, CHECKS)
    assert out == big_md5, (out, big_md5)
    # The copy is writable on its own and does not touch its source.
    sh(copy, "echo mine > /work/only-in-copy && rm /data/keep.txt")
    assert src.exec("test -e /work/only-in-copy").exit_code == 1
    assert sh(src, "cat /data/keep.txt") == b"kept from the image\n"


def test_a_node_that_extracts_layers_shows_the_same_files(made, home, client):
    """fsck.erofs drops xattrs and hard links; the agent puts them back, so opaque directories still hide."""
    src = made()
    sh(src, CHANGES)
    big_md5 = sh(src, "md5sum /work/big")
    snap = take(src, "it/snap:extract")
    other_home = tempfile.mkdtemp(prefix="dsec-it-snapx-")
    agent2 = lib.Agent(other_home, tag="snapx",
                       extra_args=["--store", os.path.join(home, "store"), "--layer-mode", "extract"])
    agent2.start()
    try:
        with dsec.Client(endpoints=[agent2.endpoint], stores=[os.path.join(home, "store")]) as c2:
            node = c2.nodes()[0]
            assert node.layer_mode.startswith("extract"), node.layer_mode
            copy = c2.create(image=snap, ttl=300, memory="192Mi", pids=128)
            try:
                assert sh(copy, CHECKS) == big_md5
            finally:
                copy.destroy()
    finally:
        stop_agent(agent2)
        shutil.rmtree(other_home, ignore_errors=True)


def test_processes_are_not_part_of_a_snapshot(made):
    src = made(image="busybox")
    sh(src, "mkdir -p /w && (while true; do echo t >> /w/ticks; sleep 0.05; done) >/dev/null 2>&1 &")
    assert lib.wait_for(lambda: src.exec("test -s /w/ticks").exit_code == 0, 5)
    snap = take(src, "it/snap:procs")
    assert snap.frozen_seconds > 0
    copy = made(image=snap)
    # The file is there, as it was; nothing appends to it in the copy.
    size = int(sh(copy, "stat -c %s /w/ticks"))
    assert size > 0
    time.sleep(0.4)
    assert int(sh(copy, "stat -c %s /w/ticks")) == size
    assert b"sleep" not in sh(copy, "ps -o args"), "no process of the source runs in the copy"
    # The source was thawed: its loop goes on.
    before = int(sh(src, "stat -c %s /w/ticks"))
    assert lib.wait_for(lambda: int(sh(src, "stat -c %s /w/ticks")) > before, 5)


def test_an_exec_running_during_a_snapshot_pauses_and_completes(made):
    src = made(image="busybox")
    result = {}

    def run():
        result["r"] = src.exec("i=0; while [ $i -lt 40 ]; do echo $i >> /tmp/count; i=$((i+1)); sleep 0.05; done; "
                               "echo done", timeout=60)

    t = threading.Thread(target=run)
    t.start()
    assert lib.wait_for(lambda: src.exec("test -s /tmp/count").exit_code == 0, 5)
    snap = take(src, "it/snap:during-exec")
    t.join(60)
    r = result["r"]
    assert r.exit_code == 0 and r.stdout == b"done\n", r
    lines = sh(src, "cat /tmp/count").split()
    assert lines == [str(i).encode() for i in range(40)]
    copy = made(image=snap)
    seen = sh(copy, "cat /tmp/count").split()
    assert 1 <= len(seen) <= 40 and seen == [str(i).encode() for i in range(len(seen))], seen


def test_a_sleeping_sandbox_stays_asleep(made):
    src = made(image="busybox")
    sh(src, "echo asleep > /note")
    src.sleep()
    snap = take(src, "it/snap:asleep")
    assert snap.frozen_seconds == 0
    assert src.info().state == "sleeping"
    src.wake()
    copy = made(image=snap)
    assert sh(copy, "cat /note") == b"asleep\n"


def test_fork_of_16(made, client):
    src = made(image="busybox", memory="64Mi", pids=32, labels={"task": "fork"}, env={"ROLE": "branch"})
    sh(src, "mkdir /state && echo step-7 > /state/progress")
    t0 = time.monotonic()
    forks = src.fork(16)
    made.track(forks)
    assert len(forks) == 16 and len({f.id for f in forks}) == 16
    results = [None] * 16

    def check(i):
        f = forks[i]
        results[i] = f.exec(f"cat /state/progress && echo $ROLE && echo {i} > /state/mine && ls /state")

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(check, range(16)))
    elapsed = time.monotonic() - t0
    for i, r in enumerate(results):
        assert r.exit_code == 0 and r.stdout == b"step-7\nbranch\nmine\nprogress\n", (i, r)
    for i, f in enumerate(forks):
        assert sh(f, "cat /state/mine") == f"{i}\n".encode(), "each fork diverged on its own"
        info = f.info()
        assert info.labels.get("task") == "fork" and info.resources.memory_bytes == 64 << 20
        assert info.image.startswith("fork/")
    assert src.exec("test -e /state/mine").exit_code == 1, "the source did not see its forks' writes"
    print(f"fork of 16: {elapsed:.2f} s to all 16 answering")


def test_the_cli_takes_a_snapshot(made, agent):
    src = made(image="busybox")
    sh(src, "echo cli > /made-by")
    r = dsec_cli("--endpoint", agent.endpoint, "snapshot", src.id, "it/cli:1")
    assert r.returncode == 0, r.stdout + r.stderr
    ref = r.stdout.strip()
    assert ref.startswith("it/cli:1@sha256:"), ref
    copy = made(image=ref)
    assert sh(copy, "cat /made-by") == b"cli\n"
    r = dsec_cli("--endpoint", agent.endpoint, "snapshot", src.id, "it/cli:2", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    answer = json.loads(r.stdout)
    assert answer["image"].startswith("it/cli:2@sha256:") and answer["sandbox"] == src.id
    r = dsec_cli("--endpoint", agent.endpoint, "snapshot", src.id, "it/cli:1")
    assert r.returncode == 1 and "ALREADY_EXISTS" in r.stderr, r.stdout + r.stderr
    r = dsec_cli("--endpoint", agent.endpoint, "snapshot", src.id)
    assert r.returncode == 2, r.stdout + r.stderr
    # `dsec ps --json` prints the agent's own encoding of each sandbox (GET /v1/sandboxes).
    r = dsec_cli("--endpoint", agent.endpoint, "ps", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    listed = {s["id"]: s for s in json.loads(r.stdout)}
    assert listed[src.id]["image"].startswith("busybox:latest@sha256:") and listed[src.id]["state"] == "running"
    assert listed[src.id]["resources"]["memory"] == src.info().resources.memory_bytes


def test_bad_inputs(made, client, agent, home):
    src = made(image="busybox")
    sock = agent.socket_path
    target = f"/v1/sandboxes/{src.id}/snapshot"

    def post(body, path=target):
        return lib.http_request(sock, "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"},
                                timeout=60)

    # Names: malformed, pinned, taken (by a built image and by an earlier snapshot). Nothing is tagged or moved.
    busybox_ref = (pathlib.Path(home) / "store" / "refs" / "busybox%3Alatest").read_text()
    for bad in ("Bad Name", "x:", "/lead", "a:b:c", "a" * 300):
        with pytest.raises(dsec.InvalidArgument):
            src.snapshot(bad)
    with pytest.raises(dsec.InvalidArgument, match="pins a digest"):
        src.snapshot("it/x:1@sha256:" + "a" * 64)
    with pytest.raises(dsec.AlreadyExists):
        src.snapshot("busybox")
    assert (pathlib.Path(home) / "store" / "refs" / "busybox%3Alatest").read_text() == busybox_ref
    take(src, "it/snap:taken")
    with pytest.raises(dsec.AlreadyExists, match="never moves a tag"):
        src.snapshot("it/snap:taken")

    # A request id: a repeat answers with the first snapshot (200); the same id for another name is refused.
    first = post({"name": "it/snap:rid", "request_id": "rid-1"})
    assert first.status == 201, first
    again = post({"name": "it/snap:rid", "request_id": "rid-1"})
    assert again.status == 200 and again.json()["image"] == first.json()["image"], again
    other = post({"name": "it/snap:rid2", "request_id": "rid-1"})
    assert other.status == 400 and other.json()["code"] == "INVALID_ARGUMENT", other

    # Concurrent snapshots of one sandbox: serialised, all made; concurrent ones of one name: one wins.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        names = [f"it/snap:conc-{i}" for i in range(4)]
        snaps = list(pool.map(src.snapshot, names))
    assert [s.split("@")[0] for s in snaps] == names
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(src.snapshot, "it/snap:same") for _ in range(4)]
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result())
            except dsec.AlreadyExists:
                outcomes.append("exists")
    assert sum(1 for o in outcomes if o != "exists") == 1, outcomes

    # Unknown and destroyed sandboxes.
    r = post({"name": "it/snap:none"}, f"/v1/sandboxes/{agent.node_id}-000000000000/snapshot")
    assert r.status == 404 and r.json()["code"] == "NOT_FOUND", r
    gone = made(image="busybox")
    gone_id = gone.id
    gone.destroy()
    r = post({"name": "it/snap:none"}, f"/v1/sandboxes/{gone_id}/snapshot")
    assert r.status == 404 and r.json()["code"] == "NOT_FOUND", r
    assert not (pathlib.Path(home) / "store" / "refs" / "it%2Fsnap%3Anone").exists()
    staging = pathlib.Path(agent.run_dir) / ".snapshots"
    assert not staging.exists() or not list(staging.iterdir()), "no staging left"


@pytest.fixture
def small_store():
    """A 6 MiB tmpfs as a snapshot store: room for busybox's layers, not for a snapshot of 12 MiB of noise."""
    d = tempfile.mkdtemp(prefix="dsec-it-small-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "dsec-small", d], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", d], check=False)
        os.rmdir(d)


def test_a_full_store_tags_nothing_and_leaves_blobs_to_gc(home, small_store):
    other_home = tempfile.mkdtemp(prefix="dsec-it-snapfull-")
    agent = lib.Agent(other_home, tag="snapfull", extra_args=[
        "--store", os.path.join(home, "store"), "--snapshot-store", small_store, "--backends", "container,null"])
    agent.start()
    blobs = pathlib.Path(small_store) / "blobs" / "sha256"
    refs = pathlib.Path(small_store) / "refs"
    try:
        with dsec.Client(endpoints=[agent.endpoint]) as c:
            sb = c.create(image="busybox", ttl=300, memory="128Mi")
            try:
                sh(sb, "dd if=/dev/urandom of=/noise bs=1048576 count=12 2>/dev/null")
                with pytest.raises(dsec.ResourceExhausted) as e:
                    sb.snapshot("it/full:1")
                assert not e.value.retryable
                assert "full" in str(e.value), str(e.value)
                assert not refs.exists() or not list(refs.iterdir()), "no tag"
                tmp = pathlib.Path(small_store) / ".tmp"
                assert not tmp.exists() or not list(tmp.iterdir()), "nothing half-written"
                # busybox's layers went in first: blobs without a manifest, for gc.
                orphans = set(os.listdir(blobs))
                assert orphans
                r = dsec_cli("--store", small_store, "image", "gc", "--grace", "0")
                assert r.returncode == 0, r.stdout + r.stderr
                assert not set(os.listdir(blobs)) & orphans, "gc collected them"
                # The sandbox runs on, thawed; a small snapshot fits (and brings busybox's layers back).
                assert sh(sb, "echo alive") == b"alive\n"
                sh(sb, "rm /noise && echo small > /small")
                snap = sb.snapshot("it/full:2")
                assert snap.store == small_store
                r = dsec_cli("--store", small_store, "image", "gc", "--grace", "0")
                assert r.returncode == 0, r.stdout + r.stderr
                r = dsec_cli("--store", small_store, "image", "inspect", "it/full:2")
                assert r.returncode == 0, "gc keeps a tagged snapshot: " + r.stdout + r.stderr
            finally:
                sb.destroy()
            # The null backend cannot snapshot.
            nb = c.create(image="busybox", kind="null")
            try:
                with pytest.raises(dsec.Unimplemented, match="null backend"):
                    nb.snapshot("it/null:1")
            finally:
                nb.destroy()
        staging = pathlib.Path(agent.run_dir) / ".snapshots"
        assert not staging.exists() or not list(staging.iterdir()), "no staging left"
    finally:
        stop_agent(agent)
        shutil.rmtree(other_home, ignore_errors=True)
