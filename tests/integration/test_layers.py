"""Image layers on the node: streamed on demand through the agent's blob cache, EROFS over FUSE, and what happens when
the store or the cache's disk misbehaves.

Each test runs its own dsecd with an empty layer cache, reading images from a store built once for the module with
`dsec image build`: "busybox" (one base layer: 1 MiB of EROFS metadata, 2 MiB of busybox) and "blobby" (busybox
plus a task layer holding /data/blob.bin, 6 MiB of random bytes, and /data/small.txt). Chunks are 1 MiB. Every
agent is stopped at the end and must leave nothing behind: no mount (layer mounts and the FUSE mount live under its
run dir), no run dir entry, no cgroup, no process.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import pytest

import dsec_testlib as lib

try:
    import nginx_store
except ImportError:  # pragma: no cover
    nginx_store = None

BLOB_SIZE = 6 * (1 << 20) + 12345
SMALL_TEXT = b"a small file in the task layer\n"


# --------------------------------------------------------------------------------------------------------------
# The store and its blobs.

class Store:
    def __init__(self, root: pathlib.Path, blob_md5: str, blob: bytes = b""):
        self.root = root
        self.blob_md5 = blob_md5
        self.blob = blob  # /data/blob.bin of "blobby"

    def blob_path(self, digest: str) -> pathlib.Path:
        return self.root / "blobs" / "sha256" / digest.split(":", 1)[1]

    def read_blob(self, digest: str) -> bytes:
        return self.blob_path(digest).read_bytes()

    def manifest_digest(self, tagged: str) -> str:
        return (self.root / "refs" / tagged.replace("/", "%2F").replace(":", "%3A")).read_text().strip()

    def manifest_json(self, tagged: str) -> bytes:
        return self.read_blob(self.manifest_digest(tagged))

    def manifest(self, tagged: str) -> dict:
        return json.loads(self.manifest_json(tagged))

    def index(self, layer: dict) -> dict:
        return json.loads(self.read_blob(layer["index"]))

    def copy(self, dest: pathlib.Path) -> "Store":
        shutil.copytree(self.root, dest, symlinks=True)
        return Store(dest, self.blob_md5, self.blob)


def dsec_image(*args: str) -> str:
    r = subprocess.run([str(lib.DSEC_CLI), "image", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=180)
    if r.returncode != 0:
        raise RuntimeError(f"dsec image {' '.join(args)} failed ({r.returncode}): {r.stdout}{r.stderr}")
    return r.stdout


@pytest.fixture(scope="module")
def store():
    work = pathlib.Path(tempfile.mkdtemp(prefix="dsec-it-layers-"))
    try:
        home = work / "home"
        dsec_image("build", "busybox", "--from", "busybox-static", "--home", str(home), "-q")
        tree = work / "tree"
        (tree / "data").mkdir(parents=True)
        blob = os.urandom(BLOB_SIZE)
        (tree / "data" / "blob.bin").write_bytes(blob)
        (tree / "data" / "small.txt").write_bytes(SMALL_TEXT)
        dsec_image("build", "blobby", "--from", str(tree), "--parent", "busybox", "--home", str(home), "-q")
        yield Store(home / "store", hashlib.md5(blob).hexdigest(), blob)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------------------------------------------
# Agents and calls over raw HTTP.

@contextlib.contextmanager
def layered_agent(tag: str, *args: str, home: str | None = None):
    """A dsecd with its own home (an empty layer cache) and `args`; stopped and checked for leftovers at the end."""
    own_home = home is None
    home = home or tempfile.mkdtemp(prefix="dsec-it-layers-home-")
    a = lib.Agent(home, tag=tag, extra_args=list(args))
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
        log = a.log_tail()
        if not problems:
            a.remove_husks()
        if own_home:
            shutil.rmtree(home, ignore_errors=True)
        assert status == 0, f"dsecd exited with {status} on SIGTERM:\n{log}"
        assert not problems, "dsecd left things behind:\n  " + "\n  ".join(problems) + f"\nlog:\n{log}"


def create(agent, image: str, timeout: float = 60, **extra) -> lib.RawResponse:
    body = {"image": image, "kind": "container", "ttl": 600,
            "resources": {"cpu": 0.1, "memory": 64 << 20, "pids": 64}}
    body.update(extra)
    return lib.http_request(agent.socket_path, "POST", "/v1/sandboxes", json.dumps(body).encode(), timeout=timeout)


def create_ok(agent, image: str, **extra) -> str:
    r = create(agent, image, **extra)
    assert r.status == 201, f"{r}\n{agent.log_tail()}"
    return r.json()["id"]


def run(agent, sid: str, shell: str, timeout: float = 60) -> tuple[int, bytes, bytes]:
    body = json.dumps({"shell": shell, "timeout": timeout}).encode()
    r = lib.http_request(agent.socket_path, "POST", f"/v1/sandboxes/{sid}/exec", body, timeout=timeout + 15)
    assert r.status == 200, r
    j = r.json()
    return j["exit_code"], base64.b64decode(j["stdout"]), base64.b64decode(j["stderr"])


def destroy(agent, sid: str) -> None:
    r = lib.http_request(agent.socket_path, "DELETE", f"/v1/sandboxes/{sid}")
    assert r.status == 200, r


def node(agent) -> dict:
    r = lib.http_request(agent.socket_path, "GET", "/v1/node")
    assert r.status == 200, r
    return r.json()


def metric(agent, name: str) -> int:
    text = lib.http_request(agent.socket_path, "GET", "/metrics").body.decode()
    m = re.search(rf"^{name} (\d+)$", text, re.M)
    assert m, f"{name} is not in /metrics"
    return int(m.group(1))


def layer_mounts(agent) -> list[str]:
    """EROFS layer mounts of this agent (not its FUSE mount)."""
    base = os.path.join(agent.run_dir, ".layers") + "/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p.startswith(base) and not p.endswith("/blobs")]


def present_chunks(home: str) -> int:
    """Chunks the agent's cache marks present, over all layers."""
    total = 0
    cache = pathlib.Path(home) / "cache" / "layers"
    for present in cache.glob("*/present"):
        total += present.read_bytes().count(1)
    return total


def layers_of(store: Store, tagged: str) -> list[dict]:
    return store.manifest(tagged)["layers"]


def lazy_skip_reason() -> str | None:
    with open("/proc/filesystems") as f:
        if "erofs" not in f.read():
            return "the kernel has no EROFS"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return None


needs_lazy = pytest.mark.skipif(lazy_skip_reason() is not None, reason=str(lazy_skip_reason()))


# --------------------------------------------------------------------------------------------------------------

@needs_lazy
def test_a_cold_node_streams_only_what_a_sandbox_reads(store):
    with layered_agent("lc", "--store", str(store.root)) as agent:
        info = node(agent)
        assert info["layer_mode"] == "erofs-lazy", info
        assert info["cached_layers"] == [], info
        assert sorted(info["images"]) == ["blobby:latest", "busybox:latest"], info

        sid = create_ok(agent, "blobby")
        digest = store.manifest_digest("blobby:latest")
        assert lib.http_request(agent.socket_path, "GET", f"/v1/sandboxes/{sid}").json()["image"] == \
            f"blobby:latest@{digest}"
        code, out, err = run(agent, sid, "cat /data/small.txt")
        assert (code, out) == (0, SMALL_TEXT), err
        task = layers_of(store, "blobby:latest")[-1]
        cached = {layer["digest"]: layer for layer in node(agent)["cached_layers"]}
        assert set(cached) == {layer["digest"] for layer in layers_of(store, "blobby:latest")}, cached
        assert all(layer["users"] == 1 for layer in cached.values()), cached
        # The big file was not read: most of the task layer was never fetched.
        assert cached[task["digest"]]["cached_bytes"] < task["size"] // 2, cached[task["digest"]]

        code, out, err = run(agent, sid, "md5sum /data/blob.bin")
        assert code == 0 and out.split()[0].decode() == store.blob_md5, (out, err)
        assert metric(agent, "dsec_layer_chunk_refetches_total") == 0
        assert metric(agent, "dsec_layer_chunk_errors_total") == 0
        assert metric(agent, "dsec_layer_chunk_fetches_total") == present_chunks(agent.home)
        assert len(layer_mounts(agent)) == 2

        destroy(agent, sid)
        assert lib.wait_for(lambda: not layer_mounts(agent), timeout=10), layer_mounts(agent)
        assert all(layer["users"] == 0 for layer in node(agent)["cached_layers"])
        # The cache keeps the layers for the next sandbox: nothing is fetched again.
        fetched = metric(agent, "dsec_layer_chunk_fetches_total")
        sid = create_ok(agent, "blobby")
        code, out, _ = run(agent, sid, "md5sum /data/blob.bin; cat /data/small.txt")
        assert code == 0 and store.blob_md5.encode() in out and SMALL_TEXT in out
        assert metric(agent, "dsec_layer_chunk_fetches_total") == fetched


@needs_lazy
def test_32_concurrent_creates_of_a_cold_image_fetch_each_chunk_once(store):
    with layered_agent("lp", "--store", str(store.root)) as agent:
        ids: list[str] = []
        errors: list[str] = []
        lock = threading.Lock()

        def one():
            try:
                sid = create_ok(agent, "blobby")
                code, out, err = run(agent, sid, "md5sum /data/blob.bin")
                with lock:
                    ids.append(sid)
                    if code != 0 or out.split()[0].decode() != store.blob_md5:
                        errors.append(f"{sid}: {code} {out!r} {err!r}")
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(repr(e))

        threads = [threading.Thread(target=one) for _ in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not errors, errors[:5]
        assert len(ids) == 32
        fetches = metric(agent, "dsec_layer_chunk_fetches_total")
        assert metric(agent, "dsec_layer_chunk_refetches_total") == 0
        # Every chunk fetched was fetched exactly once: as many fetches as chunks in the cache.
        assert fetches == present_chunks(agent.home), (fetches, present_chunks(agent.home))
        total_chunks = sum(len(store.index(layer)["chunks"]) for layer in layers_of(store, "blobby:latest"))
        assert 0 < fetches <= total_chunks
        assert len(layer_mounts(agent)) == 2  # one mount per layer, however many sandboxes
        assert {layer["users"] for layer in node(agent)["cached_layers"]} == {32}
        for sid in ids:
            destroy(agent, sid)


@needs_lazy
def test_a_damaged_chunk_is_eio_inside_and_an_error_in_the_agent(store, tmp_path):
    damaged = store.copy(tmp_path / "store")
    task = layers_of(damaged, "blobby:latest")[-1]
    index = damaged.index(task)
    data = damaged.blob_path(index["data"])
    os.chmod(data, 0o644)
    with open(data, "r+b") as f:
        # Every chunk of file data in the task layer; its metadata stays intact, so the sandbox starts.
        for i, (offset, length, _) in enumerate(index["chunks"]):
            if i * index["chunk_size"] >= index["meta_size"]:
                f.seek(offset + length // 2)
                b = f.read(1)
                f.seek(offset + length // 2)
                f.write(bytes([b[0] ^ 0x5A]))
    with layered_agent("ld", "--store", str(damaged.root)) as agent:
        sid = create_ok(agent, "blobby")
        code, out, err = run(agent, sid, "md5sum /data/blob.bin; echo rc=$?")
        assert b"rc=0" not in out, (out, err)
        assert store.blob_md5.encode() not in out
        assert re.search(rb"I/O error|Input/output error", err), err
        # Only an error, never other bytes: nothing of the file reads back at all.
        code, out, err = run(agent, sid, "head -c 100 /data/blob.bin | wc -c")
        assert out.strip() == b"0", (out, err)
        # The sandbox's own image (the base layer) is fine.
        code, out, _ = run(agent, sid, "echo alive")
        assert (code, out) == (0, b"alive\n")
        assert metric(agent, "dsec_layer_chunk_errors_total") >= 1
        assert metric(agent, "dsec_layer_read_errors_total") >= 1
        log = agent.log_tail(20000)
        assert "dsecd error: layer file system: read of" in log and "answered EIO" in log, log
        assert "sha256 mismatch" in log or "decompress" in log, log
        # Nothing damaged was marked present.
        layer_dir = pathlib.Path(agent.home) / "cache" / "layers" / task["digest"].split(":")[1]
        present = (layer_dir / "present").read_bytes()
        data_chunks = [i for i in range(len(index["chunks"])) if i * index["chunk_size"] >= index["meta_size"]]
        assert all(present[i] == 0 for i in data_chunks), present
        destroy(agent, sid)


def _store_goes_away(agent, store_ctl, sid: str, blob_md5: str) -> None:
    code, out, _ = run(agent, sid, "cat /data/small.txt")
    assert (code, out) == (0, SMALL_TEXT)
    store_ctl.go_away()
    started = time.monotonic()
    code, out, err = run(agent, sid, "md5sum /data/blob.bin; echo rc=$?", timeout=120)
    elapsed = time.monotonic() - started
    assert b"rc=0" not in out, (out, err)
    assert re.search(rb"I/O error|Input/output error", err), err
    assert elapsed < 60, f"a read from a store that went away took {elapsed:.1f}s"
    # The agent itself answers at once, and new sandboxes of cached layers still start.
    t = time.monotonic()
    assert node(agent)["id"] == agent.node_id
    assert time.monotonic() - t < 2
    store_ctl.come_back()
    code, out, err = run(agent, sid, "md5sum /data/blob.bin")
    assert code == 0 and out.split()[0].decode() == blob_md5, (out, err)


@needs_lazy
def test_a_directory_store_that_goes_away_gives_bounded_errors(store, tmp_path):
    copy = store.copy(tmp_path / "store")

    class Ctl:
        def go_away(self):
            os.rename(copy.root, tmp_path / "away")

        def come_back(self):
            os.rename(tmp_path / "away", copy.root)

    with layered_agent("lg", "--store", str(copy.root)) as agent:
        sid = create_ok(agent, "blobby")
        _store_goes_away(agent, Ctl(), sid, store.blob_md5)
        destroy(agent, sid)


@needs_lazy
def test_an_http_store_that_goes_away_gives_bounded_errors(store, tmp_path):
    if nginx_store is None or nginx_store.skip_reason():
        pytest.skip(nginx_store.skip_reason() if nginx_store else "nginx_store.py is missing")
    copy = store.copy(tmp_path / "store")
    server = nginx_store.NginxStore(copy.root).start()

    class Ctl:
        def go_away(self):
            server.go_away()

        def come_back(self):
            server.start()

    try:
        with layered_agent("lh", "--store", server.url) as agent:
            assert "blobby:latest" in node(agent)["images"]
            sid = create_ok(agent, "blobby")
            ranges = [r for r in server.requests() if r["range"]]
            assert ranges, "chunks are fetched with Range requests"
            _store_goes_away(agent, Ctl(), sid, store.blob_md5)
            destroy(agent, sid)
    finally:
        server.stop()


@needs_lazy
def test_a_manifest_naming_a_missing_blob_is_a_clear_error(store, tmp_path):
    broken = store.copy(tmp_path / "store")
    task = layers_of(broken, "blobby:latest")[-1]
    index_path = broken.blob_path(task["index"])
    os.unlink(index_path)
    with layered_agent("lm", "--store", str(broken.root)) as agent:
        r = create(agent, "blobby")
        assert r.status == 404 and r.json()["code"] == "NOT_FOUND", r
        assert "blobby:latest" in r.json()["message"] and task["index"] in r.json()["message"], r
        # Nothing is left held or half-made (the reaper unmounts the base layer the failed create mounted), and the
        # layer whose index is missing is not in the cache.
        assert lib.wait_for(lambda: not layer_mounts(agent), timeout=10), layer_mounts(agent)
        cached = node(agent)["cached_layers"]
        assert all(layer["users"] == 0 for layer in cached) and task["digest"] not in {c["digest"] for c in cached}
        cache = pathlib.Path(agent.home) / "cache" / "layers"
        assert not [p.name for p in cache.iterdir() if p.name.startswith(".")], list(cache.iterdir())
        # Other images still work.
        sid = create_ok(agent, "busybox")
        assert run(agent, sid, "echo ok")[:2] == (0, b"ok\n")
        destroy(agent, sid)

        # The index back, the chunk data gone.
        shutil.copy(store.blob_path(task["index"]), index_path)
        os.unlink(broken.blob_path(task["data"]))
        r = create(agent, "blobby")
        assert r.status == 404 and r.json()["code"] == "NOT_FOUND", r
        assert "chunk 0" in r.json()["message"] and str(broken.root) in r.json()["message"], r
        assert lib.wait_for(lambda: not layer_mounts(agent), timeout=10), layer_mounts(agent)
        assert not [p.name for p in cache.iterdir() if p.name.startswith(".")], list(cache.iterdir())


@needs_lazy
def test_pinned_references_and_client_manifests(store):
    digest = store.manifest_digest("blobby:latest")
    manifest = store.manifest_json("blobby:latest").decode()
    with layered_agent("lr", "--store", str(store.root)) as agent:
        sid = create_ok(agent, f"blobby:latest@{digest}", image_manifest=manifest)
        assert run(agent, sid, "cat /data/small.txt")[:2] == (0, SMALL_TEXT)
        destroy(agent, sid)
        sid = create_ok(agent, f"blobby@{digest}")
        destroy(agent, sid)

        other = "sha256:" + hashlib.sha256(b"another manifest").hexdigest()
        r = create(agent, f"blobby:latest@{other}", image_manifest=manifest)
        assert r.status == 400 and r.json()["code"] == "INVALID_ARGUMENT", r
        assert digest in r.json()["message"] and other in r.json()["message"], r
        r = create(agent, "blobby:latest", image_manifest=manifest)
        assert r.status == 400 and "pinned" in r.json()["message"], r
        r = create(agent, f"blobby:latest@{other}")
        assert r.status == 404 and r.json()["code"] == "NOT_FOUND", r
        r = create(agent, "blobby:latest@sha256:1234")
        assert r.status == 400 and r.json()["code"] == "INVALID_ARGUMENT", r
        r = create(agent, "blobby:latest", image_manifest=7)
        assert r.status == 400 and "image_manifest" in r.json()["message"], r


@needs_lazy
def test_a_damaged_manifest_blob_is_data_loss(store, tmp_path):
    broken = store.copy(tmp_path / "store")
    path = broken.blob_path(broken.manifest_digest("blobby:latest"))
    os.chmod(path, 0o644)
    path.write_bytes(path.read_bytes().replace(b'"blobby"', b'"bobby!"'))
    with layered_agent("lx", "--store", str(broken.root)) as agent:
        r = create(agent, "blobby")
        assert r.status >= 400 and r.json()["code"] == "DATA_LOSS", r


@needs_lazy
def test_a_full_cache_disk_is_a_clear_error_and_the_cache_stays_consistent(store, tmp_path):
    disk = tmp_path / "cache"
    disk.mkdir()
    # Room for the busybox layer (3 MiB), not for the task layer's metadata beside it.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3584k", "dsec-test-cache", str(disk)], check=True)
    try:
        with layered_agent("lf", "--store", str(store.root), "--layer-cache", str(disk)) as agent:
            busy = create_ok(agent, "busybox")
            assert run(agent, busy, "busybox true && echo ok")[:2] == (0, b"ok\n")
            # The busybox layer is in use, so nothing can be evicted to make room.
            r = create(agent, "blobby")
            assert r.status == 429 and r.json()["code"] == "RESOURCE_EXHAUSTED", r
            assert "is full" in r.json()["message"] and str(disk) in r.json()["message"], r
            assert len(layer_mounts(agent)) == 1
            assert run(agent, busy, "echo still")[:2] == (0, b"still\n")
            destroy(agent, busy)
        # The cache reads back whole after a restart, and what it holds serves without a fetch.
        with layered_agent("lf", "--store", str(store.root), "--layer-cache", str(disk)) as agent:
            assert node(agent)["cached_layers"], "the cache is read back after a restart"
            sid = create_ok(agent, "busybox")
            assert run(agent, sid, "busybox true && echo ok")[:2] == (0, b"ok\n")
            assert metric(agent, "dsec_layer_chunk_fetches_total") == 0
            destroy(agent, sid)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@needs_lazy
def test_a_full_cache_disk_mid_run_is_eio_inside(store, tmp_path):
    disk = tmp_path / "cache"
    disk.mkdir()
    # Room for busybox, the task layer's metadata and a chunk or two of its data: not for the 6 MiB file.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "dsec-test-cache", str(disk)], check=True)
    try:
        with layered_agent("lF", "--store", str(store.root), "--layer-cache", str(disk)) as agent:
            sid = create_ok(agent, "blobby")
            assert run(agent, sid, "cat /data/small.txt")[:2] == (0, SMALL_TEXT)
            code, out, err = run(agent, sid, "md5sum /data/blob.bin; echo rc=$?")
            assert b"rc=0" not in out and re.search(rb"I/O error|Input/output error", err), (out, err)
            assert store.blob_md5.encode() not in out
            assert "is full" in agent.log_tail(20000)
            # What was cached before still serves.
            assert run(agent, sid, "cat /data/small.txt")[:2] == (0, SMALL_TEXT)
            destroy(agent, sid)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_extract_mode_unpacks_layers_whole(store):
    with layered_agent("le", "--store", str(store.root), "--layer-mode", "extract") as agent:
        info = node(agent)
        assert info["layer_mode"].startswith("extract ("), info
        sid = create_ok(agent, "blobby")
        code, out, err = run(agent, sid, "md5sum /data/blob.bin; cat /data/small.txt")
        assert code == 0 and store.blob_md5.encode() in out and SMALL_TEXT in out, (out, err)
        assert not layer_mounts(agent)
        cached = node(agent)["cached_layers"]
        assert len(cached) == 2 and all(layer["cached_bytes"] > 0 for layer in cached), cached
        destroy(agent, sid)


# --------------------------------------------------------------------------------------------------------------
# Restart: a killed agent's layer mounts keep working; the next agent on the same run dir serves them again.

def keeper_of(agent) -> tuple[int, int]:
    """(pid, start time) of the layer keeper the agent's record names."""
    with open(os.path.join(agent.run_dir, ".layers", "keeper")) as f:
        record = dict(line.split(None, 1) for line in f.read().splitlines())
    return int(record["pid"]), int(record["start_time"])


def keeper_running(keeper: tuple[int, int]) -> bool:
    """The keeper process still runs: same pid and start time, not a zombie, still dsec-layer-keeper."""
    pid, start = keeper
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2:].split()
    return (fields[0] not in ("Z", "X") and int(fields[19]) == start
            and stat[stat.index("(") + 1:stat.rindex(")")] == "dsec-layer-keep")


def end_keeper(keeper: tuple[int, int] | None) -> None:
    """After a failed test: the keeper (only if it is still that process) ends, and its connection with it."""
    if keeper is not None and keeper_running(keeper):
        os.kill(keeper[0], signal.SIGKILL)


def task_layer_dir(agent) -> str:
    return next(m for m in layer_mounts(agent) if os.path.exists(os.path.join(m, "data", "blob.bin")))


def pread_all(fd: int, offset: int) -> bytes:
    out = b""
    while True:
        chunk = os.pread(fd, 1 << 20, offset + len(out))
        if not chunk:
            return out
        out += chunk


@needs_lazy
def test_a_killed_agents_layer_mounts_keep_serving_after_a_restart(store):
    home = tempfile.mkdtemp(prefix="dsec-it-layers-home-")
    first = lib.Agent(home, tag="lk", extra_args=["--store", str(store.root)])
    keeper = None
    fd = None
    try:
        first.start()
        sid = create_ok(first, "blobby")
        assert run(first, sid, "cat /data/small.txt")[:2] == (0, SMALL_TEXT)
        mounts = sorted(layer_mounts(first))
        assert len(mounts) == 2
        keeper = keeper_of(first)
        assert keeper_running(keeper)
        # The host reads the task layer where the sandboxes' overlays read it: the first MiB now, the rest later.
        fd = os.open(os.path.join(task_layer_dir(first), "data", "blob.bin"), os.O_RDONLY)
        head = os.pread(fd, 1 << 20, 0)
        assert head == store.blob[:len(head)]
        chunks_before = present_chunks(home)

        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        assert keeper_running(keeper), "the keeper died with its agent"
        assert sorted(layer_mounts(first)) == mounts, "a killed agent's layer mounts stay"

        with layered_agent("lk", "--store", str(store.root), home=home) as agent:
            log = agent.log_tail(20000)
            assert re.search(r"layer file system taken over from the earlier agent \(keeper pid %d, FUSE connection "
                             r"\d+\): 2 layer mounts kept" % keeper[0], log), log
            assert node(agent)["layer_mode"] == "erofs-lazy"
            # The sandbox the dead agent made, taken over, reads the whole file: most of it was never fetched.
            code, out, err = run(agent, sid, "md5sum /data/blob.bin")
            assert code == 0 and out.split()[0].decode() == store.blob_md5, (out, err, agent.log_tail())
            assert present_chunks(home) >= chunks_before + 4, "the new agent fetched the chunks the read wanted"
            # The host's descriptor, opened before the kill, reads the rest as well.
            rest = pread_all(fd, len(head))
            assert hashlib.md5(head + rest).hexdigest() == store.blob_md5
            os.close(fd)
            fd = None
            assert keeper_of(agent) == keeper, "the first agent's keeper holds the connection for the second"
            # A new sandbox of the image stands on the same layer mounts (acquired again, or mounted again at the
            # same place once the reaper pruned them).
            sid = create_ok(agent, "blobby")
            code, out, _ = run(agent, sid, "md5sum /data/blob.bin")
            assert code == 0 and out.split()[0].decode() == store.blob_md5
            assert sorted(layer_mounts(agent)) == mounts
            destroy(agent, sid)
        # layered_agent checked that the clean stop left no mount and no run dir entry; no keeper either.
        assert lib.wait_for(lambda: not keeper_running(keeper), timeout=5), "the keeper outlived a clean stop"
        shutil.rmtree(first.tmp, ignore_errors=True)
    finally:
        if fd is not None:
            os.close(fd)
        first.stop()
        end_keeper(keeper)
        shutil.rmtree(home, ignore_errors=True)


@needs_lazy
def test_a_read_in_flight_when_the_agent_dies_completes_after_the_restart(store, tmp_path):
    if nginx_store is None or nginx_store.skip_reason():
        pytest.skip(nginx_store.skip_reason() if nginx_store else "nginx_store.py is missing")
    copy = store.copy(tmp_path / "store")
    data = layers_of(copy, "blobby:latest")[-1]["data"].split(":", 1)[1]
    # The task layer's chunks trickle (a 1 MiB chunk of random bytes takes about 3 s), so that a read is still
    # being fetched when the agent is killed.
    server = nginx_store.NginxStore(
        copy.root, extra_server_config=f"    location = /blobs/sha256/{data} {{ limit_rate 320k; }}").start()
    home = tempfile.mkdtemp(prefix="dsec-it-layers-home-")
    first = lib.Agent(home, tag="lt", extra_args=["--store", server.url])
    keeper = None
    fd = None
    try:
        first.start()
        sid = create_ok(first, "blobby")
        keeper = keeper_of(first)
        # A process in the sandbox reads 64 KiB at 4 MiB in the background (it outlives its exec and the agent)...
        in_sandbox = 4 << 20
        code, _, err = run(first, sid, f"(dd if=/data/blob.bin bs=65536 skip={in_sandbox >> 16} count=1 2>/dev/null "
                                       "| md5sum > /held.tmp && mv /held.tmp /held.md5) >/dev/null 2>&1 &")
        assert code == 0, err
        # ... and the host 64 KiB at 3 MiB, through the layer mount the sandbox's overlay stands on.
        fd = os.open(os.path.join(task_layer_dir(first), "data", "blob.bin"), os.O_RDONLY)
        at = 3 << 20
        got: dict = {}

        def read():
            try:
                got["bytes"] = os.pread(fd, 1 << 16, at)
            except OSError as e:
                got["error"] = e

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        time.sleep(1.5)  # the agent is fetching the chunk now (it takes ~3 s)
        assert reader.is_alive(), got
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        reader.join(1.0)
        assert reader.is_alive(), f"the read ended with its agent: {got}"

        with layered_agent("lt", "--store", server.url, home=home) as agent:
            reader.join(30)
            assert not reader.is_alive(), "the read the dead agent took was never answered"
            assert got.get("bytes") == store.blob[at:at + (1 << 16)], got.get("error")
            assert "unanswered reads resent" in agent.log_tail(20000)
            expected = hashlib.md5(store.blob[in_sandbox:in_sandbox + (1 << 16)]).hexdigest()
            assert lib.wait_for(lambda: run(agent, sid, "cat /held.md5")[0] == 0, timeout=30), agent.log_tail()
            assert run(agent, sid, "cat /held.md5")[1].split()[0].decode() == expected
            # The dead agent's fetch was cut; the new one fetched the chunk again.
            wanted = [r["range"] for r in server.requests() if r["uri"].endswith(data) and r["range"]]
            assert any(wanted.count(r) >= 2 for r in wanted), wanted
            os.close(fd)
            fd = None
        assert lib.wait_for(lambda: not keeper_running(keeper), timeout=5), "the keeper outlived a clean stop"
        shutil.rmtree(first.tmp, ignore_errors=True)
    finally:
        if fd is not None:
            os.close(fd)
        first.stop()
        end_keeper(keeper)
        server.stop()
        shutil.rmtree(home, ignore_errors=True)


@needs_lazy
def test_without_its_keeper_a_killed_agents_mounts_are_detached_by_the_next_one(store):
    home = tempfile.mkdtemp(prefix="dsec-it-layers-home-")
    first = lib.Agent(home, tag="lk", extra_args=["--store", str(store.root)])
    keeper = None
    try:
        first.start()
        sid = create_ok(first, "blobby")
        assert run(first, sid, "cat /data/small.txt")[:2] == (0, SMALL_TEXT)
        assert len(layer_mounts(first)) == 2
        keeper = keeper_of(first)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        assert layer_mounts(first), "a killed agent leaves its layer mounts"
        os.kill(keeper[0], signal.SIGKILL)  # and the keeper is gone too: the connection is aborted
        assert lib.wait_for(lambda: not keeper_running(keeper), timeout=5)
        with layered_agent("lk", "--store", str(store.root), home=home) as agent:
            log = agent.log_tail(20000)
            assert re.search(rf"detached, not taken over: the layer keeper \(pid {keeper[0]}\) (is gone|has ended)",
                             log), log
            assert not layer_mounts(agent)
            sid = create_ok(agent, "blobby")
            code, out, _ = run(agent, sid, "md5sum /data/blob.bin")
            assert code == 0 and out.split()[0].decode() == store.blob_md5
            destroy(agent, sid)
        shutil.rmtree(first.tmp, ignore_errors=True)
    finally:
        first.stop()
        end_keeper(keeper)
        shutil.rmtree(home, ignore_errors=True)
