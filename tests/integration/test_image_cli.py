"""`dsec image` from the command line: build (directory, tar, tar on stdin, OCI layout, busybox-static, on a parent),
ls, inspect, rm, gc, push and pull between directory stores and an nginx HTTP store, and the errors a user sees.

Built images are checked the way a node reads them: each layer's chunks are read from the store, decompressed (the
system's libzstd through ctypes) and checked against the chunk index, the metadata part and the data device are
written to files and mounted as EROFS, and the layers of an image stacked with overlayfs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gzip
import hashlib
import io
import json
import os
import pathlib
import subprocess
import tarfile

import pytest

import dsec_testlib as lib

try:
    import nginx_store
except ImportError:  # written by another part of the test suite; the HTTP tests skip without it
    nginx_store = None

DSEC = str(lib.DSEC_CLI)

pytestmark = pytest.mark.skipif(not lib.DSEC_CLI.exists(), reason=f"no dsec binary at {lib.DSEC_CLI}")


# ---------------------------------------------------------------------------------------------------------------
# Running dsec

def dsec(*args, home=None, store=None, stdin=None, env=None, timeout=180) -> subprocess.CompletedProcess:
    cmd = [DSEC, "image", *[str(a) for a in args]]
    if home is not None:
        cmd += ["--home", str(home)]
    if store is not None:
        cmd += ["--store", str(store)]
    full_env = dict(os.environ)
    full_env.pop("DSEC_STORE", None)
    full_env.pop("DSEC_HOME", None)
    full_env.update(env or {})
    if isinstance(stdin, (str, os.PathLike)):
        with open(stdin, "rb") as f:
            return subprocess.run(cmd, stdin=f, capture_output=True, text=True, timeout=timeout, env=full_env)
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                          env=full_env)


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"{r.args} exited {r.returncode}:\nstdout: {r.stdout}\nstderr: {r.stderr}"
    return r


def fails(r: subprocess.CompletedProcess, code: str, *parts: str, status: int = 1) -> str:
    assert r.returncode == status, f"{r.args} exited {r.returncode}, not {status}:\n{r.stdout}\n{r.stderr}"
    assert f"dsec: {code}:" in r.stderr, r.stderr
    for p in parts:
        assert p in r.stderr, f"{p!r} not in: {r.stderr}"
    return r.stderr


def inspect(name, **kw) -> dict:
    return json.loads(ok(dsec("inspect", name, **kw)).stdout)


def ls_json(**kw) -> list[dict]:
    return json.loads(ok(dsec("ls", "--json", **kw)).stdout)


def blob_names(store: pathlib.Path) -> set[str]:
    d = store / "blobs" / "sha256"
    return set(os.listdir(d)) if d.is_dir() else set()


def scratch_left(store: pathlib.Path) -> list[str]:
    d = store / ".tmp"
    return sorted(os.listdir(d)) if d.is_dir() else []


@pytest.fixture
def home(tmp_path) -> pathlib.Path:
    h = tmp_path / "home"
    h.mkdir()
    return h


# ---------------------------------------------------------------------------------------------------------------
# Reading a built image back: chunks -> EROFS parts -> mounts

_libc = ctypes.CDLL(None, use_errno=True)
_zstd_name = ctypes.util.find_library("zstd") or "libzstd.so.1"
try:
    _zstd = ctypes.CDLL(_zstd_name)
    _zstd.ZSTD_decompress.restype = ctypes.c_size_t
    _zstd.ZSTD_decompress.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
    _zstd.ZSTD_isError.restype = ctypes.c_uint
    _zstd.ZSTD_isError.argtypes = [ctypes.c_size_t]
except OSError:
    _zstd = None

MS_RDONLY = 1
MNT_DETACH = 2


def _decompress(stored: bytes, length: int) -> bytes:
    if len(stored) == length:
        return stored  # stored raw
    out = ctypes.create_string_buffer(length)
    n = _zstd.ZSTD_decompress(out, length, stored, len(stored))
    assert not _zstd.ZSTD_isError(n) and n == length, f"chunk does not decompress to {length} bytes"
    return out.raw


def _mount(source: str, target: str, fstype: str, data: str, flags: int = MS_RDONLY) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {fstype} {source} on {target} ({data}): {os.strerror(e)}")


class MountedImage:
    """An image of a directory store, mounted read-only: each layer as EROFS, the layers stacked with overlayfs."""

    def __init__(self, store: pathlib.Path, manifest: dict, scratch: pathlib.Path):
        if _zstd is None:
            pytest.skip(f"cannot load libzstd ({_zstd_name}) to read layers back")
        self.mounts: list[str] = []
        lowers = []
        try:
            for i, layer in enumerate(manifest["layers"]):
                lowers.insert(0, self._mount_layer(store, layer, scratch / f"layer{i}"))
            if len(lowers) == 1:
                self.root = pathlib.Path(lowers[0])
            else:
                merged = scratch / "merged"
                merged.mkdir(parents=True)
                _mount("overlay", str(merged), "overlay", "lowerdir=" + ":".join(lowers))
                self.mounts.append(str(merged))
                self.root = merged
        except BaseException:
            self.close()
            raise

    def _mount_layer(self, store: pathlib.Path, layer: dict, dir: pathlib.Path) -> str:
        blobs = store / "blobs" / "sha256"
        index_bytes = (blobs / layer["index"][7:]).read_bytes()
        assert "sha256:" + hashlib.sha256(index_bytes).hexdigest() == layer["index"]
        index = json.loads(index_bytes)
        assert index["layer"] == layer["digest"] and index["data"] == layer["data"]
        data = (blobs / layer["data"][7:]).read_bytes()
        assert "sha256:" + hashlib.sha256(data).hexdigest() == layer["data"]
        whole = bytearray()
        for i, (offset, length, sha) in enumerate(index["chunks"]):
            plain = _decompress(data[offset:offset + length], min(index["chunk_size"], index["size"] - len(whole)))
            assert hashlib.sha256(plain).hexdigest() == sha, f"chunk {i} of layer {layer['digest']} is damaged"
            whole += plain
        assert len(whole) == layer["size"] and "sha256:" + hashlib.sha256(whole).hexdigest() == layer["digest"]
        dir.mkdir(parents=True)
        meta, dev, mnt = dir / "meta.img", dir / "data.img", dir / "mnt"
        meta.write_bytes(whole[:index["meta_size"]])
        dev.write_bytes(whole[index["meta_size"]:])
        mnt.mkdir()
        _mount(str(meta), str(mnt), "erofs", f"device={dev}")
        self.mounts.append(str(mnt))
        return str(mnt)

    def files(self) -> set[str]:
        out = set()
        for dirpath, dirnames, filenames in os.walk(self.root):
            for n in dirnames + filenames:
                out.add(os.path.relpath(os.path.join(dirpath, n), self.root))
        return out

    def close(self) -> None:
        for m in reversed(self.mounts):
            _libc.umount2(m.encode(), MNT_DETACH)
        self.mounts = []

    def __enter__(self) -> "MountedImage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def mounted(store: pathlib.Path, name: str, scratch: pathlib.Path, **kw) -> MountedImage:
    if os.geteuid() != 0:
        pytest.skip("mounting EROFS layers needs root")
    return MountedImage(store, inspect(name, store=store, **kw), scratch)


# ---------------------------------------------------------------------------------------------------------------
# Sources

def make_tree(root: pathlib.Path) -> pathlib.Path:
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hostname").write_text("box\n")
    (root / "bin").mkdir()
    (root / "bin" / "tool").write_text("#!/bin/sh\necho tool\n")
    os.chmod(root / "bin" / "tool", 0o755)
    (root / "data").mkdir()
    (root / "data" / "big").write_bytes(os.urandom(300_000))
    os.symlink("../bin/tool", root / "data" / "link")
    return root


def tar_bytes(entries, compress: bool = False) -> bytes:
    """A tar of (name, content) pairs; content None makes a directory, ("symlink", target) a symlink."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, content in entries:
            info = tarfile.TarInfo(name)
            info.mtime = 1_600_000_000
            if content is None:
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                t.addfile(info)
            elif isinstance(content, tuple):
                info.type = tarfile.SYMTYPE if content[0] == "symlink" else tarfile.LNKTYPE
                info.linkname = content[1]
                t.addfile(info)
            else:
                info.size = len(content)
                info.mode = 0o644
                t.addfile(info, io.BytesIO(content))
    data = buf.getvalue()
    return gzip.compress(data) if compress else data


def write_oci_layout(root: pathlib.Path) -> pathlib.Path:
    """An OCI image layout with two gzip layers: the second deletes etc/gone and makes data/ opaque while adding
    data/new."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": "sha256:" + digest, "size": len(data)}

    l1 = put(tar_bytes([("etc", None), ("etc/keep", b"kept\n"), ("etc/gone", b"gone\n"), ("data", None),
                        ("data/old", b"old"), ("data/sub", None), ("data/sub/x", b"x")], compress=True))
    l2 = put(tar_bytes([("etc/.wh.gone", b""), ("data/.wh..wh..opq", b""), ("data/new", b"new")], compress=True))
    config = put(json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers"}}).encode())
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **layer} for layer in (l1, l2)]}
    m = put(json.dumps(manifest).encode())
    (root / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (root / "index.json").write_text(json.dumps(
        {"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", **m}]}))
    return root


OCI_FILES = {"etc", "etc/keep", "data", "data/new"}


# ---------------------------------------------------------------------------------------------------------------
# Builds

BUILT = "built "


def test_build_from_a_directory_then_ls_and_inspect(home, tmp_path):
    src = make_tree(tmp_path / "src")
    r = ok(dsec("build", "app:v1", "--from", src, "-q", home=home))
    assert r.stdout.startswith("built app:v1@sha256:"), r.stdout
    assert "1 layer in all" in r.stdout
    assert r.stderr == "", "-q still printed: " + r.stderr

    store = home / "store"
    info = inspect("app:v1", home=home)
    assert info["reference"].startswith("app:v1@sha256:")
    assert info["digest"] == info["reference"].split("@")[1]
    assert r.stdout.startswith(f"built {info['reference']}")
    assert [layer["role"] for layer in info["layers"]] == ["base"]
    assert str(src) in info["source"]
    assert info["size"] == info["layers"][0]["size"] > 0
    assert info["layers"][0]["files_size"] == (len("box\n") + len("#!/bin/sh\necho tool\n") + 300_000 +
                                               len("../bin/tool"))
    assert scratch_left(store) == []

    listed = ls_json(home=home)
    assert [i["reference"] for i in listed] == [info["reference"]]
    table = ok(dsec("ls", home=home)).stdout.splitlines()
    assert table[0].split()[:6] == ["NAME", "DIGEST", "LAYERS", "SIZE", "STORED", "CREATED"]
    assert table[1].split()[0] == "app:v1" and table[1].split()[1] == info["digest"][7:19]
    assert len(table) == 2

    with mounted(store, "app:v1", tmp_path / "mnt") as image:
        assert image.files() == {"etc", "etc/hostname", "bin", "bin/tool", "data", "data/big", "data/link"}
        assert (image.root / "data" / "big").read_bytes() == (src / "data" / "big").read_bytes()
        assert os.readlink(image.root / "data" / "link") == "../bin/tool"
        assert os.stat(image.root / "bin" / "tool").st_mode & 0o7777 == 0o755


def test_build_from_a_tar_file_and_from_standard_input(home, tmp_path):
    tar = tmp_path / "layer.tar.gz"
    tar.write_bytes(tar_bytes([("etc", None), ("etc/motd", b"hello\n"), ("usr/bin/x", b"x" * 5000),
                               ("bin", ("symlink", "usr/bin"))], compress=True))
    ok(dsec("build", "fromfile", "--from", f"tar:{tar}", home=home))
    ok(dsec("build", "autodetect", "--from", tar, home=home))
    ok(dsec("build", "fromstdin", "--from", "-", "-q", home=home, stdin=tar))
    ok(dsec("build", "fromstdin2", "--from", "tar:-", "-q", home=home, stdin=tar))
    store = home / "store"
    infos = {n: inspect(n, home=home) for n in ("fromfile", "autodetect", "fromstdin", "fromstdin2")}
    assert infos["fromstdin"]["source"] == "tar from standard input"
    assert str(tar) in infos["fromfile"]["source"]
    # The same tree each time; whether mkfs.erofs writes identical bytes twice is not assumed.
    for name in infos:
        with mounted(store, name, tmp_path / f"mnt-{name}") as image:
            assert image.files() == {"etc", "etc/motd", "usr", "usr/bin", "usr/bin/x", "bin"}, name
            assert (image.root / "etc" / "motd").read_text() == "hello\n"
            assert os.readlink(image.root / "bin") == "usr/bin"
    assert scratch_left(store) == []
    # Standard input that is not a tar.
    junk = tmp_path / "junk"
    junk.write_bytes(os.urandom(5000))
    fails(dsec("build", "junk", "--from", "-", home=home, stdin=junk), "DATA_LOSS")
    assert "junk:latest" not in [i["reference"].split("@")[0] for i in ls_json(home=home)]
    assert scratch_left(store) == []


def test_build_from_an_oci_layout(home, tmp_path):
    layout = write_oci_layout(tmp_path / "oci")
    ok(dsec("build", "app:oci", "--from", f"oci:{layout}", home=home))
    info = inspect("app:oci", home=home)
    assert len(info["layers"]) == 1
    assert "2 layers" in info["source"], info["source"]
    with mounted(home / "store", "app:oci", tmp_path / "mnt") as image:
        assert image.files() == OCI_FILES
        assert (image.root / "data" / "new").read_text() == "new"

    # The same layout as a tar (docker save), named without a prefix.
    saved = tmp_path / "saved.tar"
    with tarfile.open(saved, "w") as t:
        for p in sorted(layout.rglob("*")):
            t.add(p, arcname=str(p.relative_to(layout)), recursive=False)
    ok(dsec("build", "app:saved", "--from", saved, home=home))
    with mounted(home / "store", "app:saved", tmp_path / "mnt2") as image:
        assert image.files() == OCI_FILES


def test_build_busybox_static(home, tmp_path):
    if not os.path.exists("/bin/busybox"):
        pytest.skip("busybox-static is not installed")
    r = ok(dsec("build", "busybox", "--from", "busybox-static", home=home))
    assert "applets linked" in r.stderr, r.stderr  # the build's notes, without -q
    info = inspect("busybox", home=home)
    assert info["reference"].startswith("busybox:latest@")
    assert any("applets" in n for n in info["notes"])
    with mounted(home / "store", "busybox", tmp_path / "mnt") as image:
        assert os.readlink(image.root / "bin" / "sh") == "busybox"
        r = subprocess.run(["chroot", str(image.root), "/bin/sh", "-c", "echo hi from busybox; exit 42"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 42 and r.stdout == "hi from busybox\n", r
    fails(dsec("build", "bb2", "--from", "busybox-static", "--busybox", "/bin/ls", home=home), "FAILED_PRECONDITION",
          "dynamically linked")


def test_build_on_a_parent_with_a_role(home, tmp_path):
    base = tmp_path / "base"
    (base / "etc").mkdir(parents=True)
    (base / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (base / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    (base / "opt" / "dir").mkdir(parents=True)
    (base / "opt" / "dir" / "a").write_text("a")
    ok(dsec("build", "base:v1", "--from", base, home=home))
    base_info = inspect("base:v1", home=home)

    task = tmp_path / "task.tar"
    task.write_bytes(tar_bytes([("etc/.wh.passwd", b""), ("opt/dir/.wh..wh..opq", b""), ("opt/dir/b", b"b"),
                                ("task/README", b"solve it")]))
    r = ok(dsec("build", "swe/task-1", "--from", f"tar:{task}", "--parent", "base:v1", home=home))
    assert "2 layers in all" in r.stdout
    info = inspect("swe/task-1", home=home)
    assert [layer["role"] for layer in info["layers"]] == ["base", "task"]
    assert info["layers"][0] == base_info["layers"][0]
    assert info["parent"] == base_info["reference"]

    ok(dsec("build", "py:dev", "--from", base, "--parent", "base:v1", "--role", "toolchain", home=home))
    assert [layer["role"] for layer in inspect("py:dev", home=home)["layers"]] == ["base", "toolchain"]

    with mounted(home / "store", "swe/task-1", tmp_path / "mnt") as image:
        assert image.files() == {"etc", "etc/hosts", "opt", "opt/dir", "opt/dir/b", "task", "task/README"}
    fails(dsec("build", "x", "--from", base, "--role", "boss", home=home), "INVALID_ARGUMENT", "boss")
    fails(dsec("build", "x", "--from", base, "--parent", "ghost", home=home), "NOT_FOUND", "ghost:latest")
    assert sorted(i["reference"].split("@")[0] for i in ls_json(home=home)) == \
        ["base:v1", "py:dev", "swe/task-1:latest"]


def test_hostile_and_oversized_tars_leave_nothing(home, tmp_path):
    store = home / "store"
    ok(dsec("build", "keep", "--from", make_tree(tmp_path / "keep"), "-q", home=home))
    before = blob_names(store)
    cases = [
        ("dotdot", tar_bytes([("ok", b"1"), ("../evil", b"evil")]), [], "INVALID_ARGUMENT"),
        ("abs", tar_bytes([(str(tmp_path / "abs-evil"), b"evil")]), [], "INVALID_ARGUMENT"),
        ("through", tar_bytes([("etc", ("symlink", str(tmp_path / "outside"))), ("etc/passwd", b"x")]), [],
         "INVALID_ARGUMENT"),
        ("hardlink", tar_bytes([("h", ("hardlink", "../../etc/passwd"))]), [], "INVALID_ARGUMENT"),
        ("big", tar_bytes([("big", os.urandom(2 << 20))]), ["--max-size", "1Mi"], "RESOURCE_EXHAUSTED"),
        ("cut", tar_bytes([("a", os.urandom(200_000))])[:100_000], [], "DATA_LOSS"),
    ]
    (tmp_path / "outside").mkdir()
    for name, data, extra, code in cases:
        tar = tmp_path / f"{name}.tar"
        tar.write_bytes(data)
        fails(dsec("build", name, "--from", f"tar:{tar}", *extra, home=home), code)
        assert [i["reference"].split("@")[0] for i in ls_json(home=home)] == ["keep:latest"], name
        assert scratch_left(store) == [], name
        assert blob_names(store) == before, name
    assert not (tmp_path / "abs-evil").exists()
    assert not (tmp_path / "evil").exists()
    assert os.listdir(tmp_path / "outside") == []


def test_a_full_store_disk(home, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    _mount("tmpfs", str(small), "tmpfs", "size=8m", flags=0)
    try:
        store = small / "store"
        ok(dsec("build", "little", "--from", make_tree(tmp_path / "little"), "-q", store=store))
        big = tmp_path / "big"
        big.mkdir()
        (big / "blob").write_bytes(os.urandom(12 << 20))
        fails(dsec("build", "big", "--from", big, "-q", store=store), "RESOURCE_EXHAUSTED", "No space")
        tar = tmp_path / "big.tar"
        tar.write_bytes(tar_bytes([("blob", os.urandom(12 << 20))]))
        fails(dsec("build", "big", "--from", "-", "-q", store=store, stdin=tar), "RESOURCE_EXHAUSTED")
        assert scratch_left(store) == []
        # The store still answers, with the other image whole.
        assert [i["reference"].split("@")[0] for i in ls_json(store=store)] == ["little:latest"]
        assert ok(dsec("ls", store=store)).stdout.splitlines()[1].startswith("little:latest")
        with mounted(store, "little", tmp_path / "mnt") as image:
            assert (image.root / "etc" / "hostname").read_text() == "box\n"
    finally:
        _libc.umount2(str(small).encode(), MNT_DETACH)


# ---------------------------------------------------------------------------------------------------------------
# rm, gc and errors

def test_rm_and_gc(home, tmp_path):
    store = home / "store"
    src = make_tree(tmp_path / "src")
    ok(dsec("build", "a", "--from", src, "-q", home=home))
    ok(dsec("build", "b", "--from", tmp_path / "src" / "etc", "-q", home=home))
    all_blobs = blob_names(store)
    a_blobs = {d[7:] for d in [inspect("a", home=home)["digest"]] +
               [x for layer in inspect("a", home=home)["layers"] for x in (layer["index"], layer["data"])]}

    r = ok(dsec("rm", "a", home=home))
    assert r.stdout == "removed a:latest\n"
    assert [i["reference"].split("@")[0] for i in ls_json(home=home)] == ["b:latest"]
    assert blob_names(store) == all_blobs, "rm removed blobs"

    # Fresh blobs are inside the default grace: nothing goes.
    r = ok(dsec("gc", home=home))
    assert r.stdout.strip().endswith(f"kept {len(all_blobs)}"), r.stdout
    assert r.stdout.startswith("removed 0 blobs")
    # A dry run without grace names a's blobs and removes nothing.
    r = ok(dsec("gc", "--dry-run", "--grace", "0", home=home))
    would = {line.split()[-1][7:] for line in r.stdout.splitlines() if line.startswith("would remove sha256:")}
    assert would == a_blobs, r.stdout
    assert blob_names(store) == all_blobs
    r = ok(dsec("gc", "--grace", "0", home=home))
    assert {line.split()[-1][7:] for line in r.stdout.splitlines() if line.startswith("removed sha256:")} == a_blobs
    assert blob_names(store) == all_blobs - a_blobs
    with mounted(store, "b", tmp_path / "mnt") as image:  # b is whole
        assert (image.root / "hostname").read_text() == "box\n"

    # rm of a missing image fails, but still removes the others named.
    fails(dsec("rm", "ghost", "b", home=home), "NOT_FOUND", "ghost:latest", str(store))
    assert ls_json(home=home) == []
    for grace in ("soon", "-1"):
        r = dsec("gc", "--grace", grace, home=home)
        assert r.returncode == 2 and "--grace" in r.stderr, r


def test_missing_images_and_bad_names(home, tmp_path):
    fails(dsec("inspect", "ghost", home=home), "NOT_FOUND", "ghost:latest", str(home / "store"))
    fails(dsec("inspect", "ghost@sha256:" + "0" * 64, home=home), "NOT_FOUND")
    fails(dsec("push", "ghost", tmp_path / "other", home=home), "NOT_FOUND", "ghost:latest")
    fails(dsec("pull", "ghost", tmp_path / "other", home=home), "NOT_FOUND", "ghost:latest")
    assert ls_json(home=home) == []  # an empty (even absent) store lists nothing

    src = make_tree(tmp_path / "src")
    for bad in ("Bad Name", "a//b", "_x", "x:y:z", "x:-tag", "x@sha256:1234"):
        r = dsec("build", bad, "--from", src, home=home)
        assert r.returncode in (1, 2), (bad, r)
        assert "invalid image name" in r.stderr, (bad, r.stderr)
        r = dsec("inspect", bad, home=home)
        assert r.returncode in (1, 2) and "invalid image name" in r.stderr, (bad, r.stderr)
    assert not (home / "store" / "refs").exists() or os.listdir(home / "store" / "refs") == []


def test_usage_errors_exit_2(home, tmp_path):
    src = make_tree(tmp_path / "src")
    for args in (["build", "x"], ["build", "--from", src], ["build", "x", "y", "--from", src],
                 ["build", "x", "--from", src, "--include", "python3"],
                 ["build", "x", "--from", src, "--max-size", "lots"], ["build", "x", "--from", src, "--bogus"],
                 ["frobnicate"], ["push", "x"], ["inspect"], ["rm"], ["ls", "extra"]):
        r = dsec(*args, home=home)
        assert r.returncode == 2, (args, r)
        assert r.stderr.strip(), args
    r = ok(dsec("build", "--help"))
    assert "--from SOURCE" in r.stdout
    r = dsec("build", "x", "--from", tmp_path / "nowhere", home=home)
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr and "nowhere" in r.stderr, r


# ---------------------------------------------------------------------------------------------------------------
# Stores: push, pull, --store and $DSEC_STORE

def test_push_to_another_directory_store_and_pull_back(home, tmp_path):
    src = make_tree(tmp_path / "src")
    ok(dsec("build", "app:v1", "--from", src, "-q", home=home))
    digest = inspect("app:v1", home=home)["digest"]
    remote = tmp_path / "remote"

    r = ok(dsec("push", "app:v1", remote, home=home))
    assert r.stdout.startswith(f"pushed app:v1 to {remote}"), r.stdout
    assert inspect("app:v1", store=remote)["digest"] == digest
    assert blob_names(remote) == blob_names(home / "store")
    # Again: the layers are there already.
    r = ok(dsec("push", "app:v1", f"file://{remote}", home=home))
    assert " KiB copied" in r.stdout or " B copied" in r.stdout, r.stdout

    # Pull into a fresh home, through $DSEC_STORE-less defaults and through --store.
    other = tmp_path / "other-home"
    r = ok(dsec("pull", "app:v1", remote, home=other))
    assert r.stdout.startswith(f"pulled app:v1 from {remote}"), r.stdout
    assert inspect("app:v1", home=other)["digest"] == digest
    with mounted(other / "store", "app:v1", tmp_path / "mnt") as image:
        assert (image.root / "data" / "big").read_bytes() == (src / "data" / "big").read_bytes()

    # $DSEC_STORE names the store when --store is not given.
    envd = ok(dsec("ls", "--json", env={"DSEC_STORE": str(remote)}))
    assert [i["digest"] for i in json.loads(envd.stdout)] == [digest]
    fails(dsec("ls", store="ftp://example/store"), "INVALID_ARGUMENT", "scheme")


@pytest.fixture
def http_store(tmp_path):
    if nginx_store is None:
        pytest.skip("tests/integration/nginx_store.py is not there yet")
    why = nginx_store.skip_reason()
    if why:
        pytest.skip(why)
    s = nginx_store.NginxStore(tmp_path / "http-root").start()
    try:
        yield s
    finally:
        s.stop()


def test_push_and_pull_through_an_http_store(home, tmp_path, http_store):
    src = make_tree(tmp_path / "src")
    ok(dsec("build", "app:v1", "--from", src, "-q", home=home))
    digest = inspect("app:v1", home=home)["digest"]

    r = ok(dsec("push", "app:v1", http_store.url, "-q", home=home))
    assert r.stdout.startswith(f"pushed app:v1 to {http_store.url}"), r.stdout
    # What nginx now serves is the same store layout, blob for blob.
    assert blob_names(http_store.root) == blob_names(home / "store")
    assert inspect("app:v1", store=http_store.url)["digest"] == digest
    assert [i["digest"] for i in ls_json(store=http_store.url)] == [digest]
    puts = [q for q in http_store.requests() if q["method"] == "PUT"]
    assert puts, "push sent no PUT"

    # A second push sends no layer again.
    http_store.clear_requests()
    ok(dsec("push", "app:v1", http_store.url, "-q", home=home))
    layer_puts = [q for q in http_store.wait_for_requests(1) if q["method"] == "PUT" and "/blobs/" in q["uri"]
                  and q["request_length"] > 100_000]
    assert layer_puts == [], layer_puts

    # Pull back into a fresh directory store; the image reads the same.
    other = tmp_path / "other"
    ok(dsec("pull", "app:v1", http_store.url, "-q", store=other))
    assert inspect("app:v1", store=other)["digest"] == digest
    with mounted(other, "app:v1", tmp_path / "mnt") as image:
        assert (image.root / "data" / "big").read_bytes() == (src / "data" / "big").read_bytes()

    # A build straight into the HTTP store, on the pushed parent.
    tar = tmp_path / "t.tar"
    tar.write_bytes(tar_bytes([("task/README", b"hi")]))
    ok(dsec("build", "app:task", "--from", f"tar:{tar}", "--parent", "app:v1", "-q", home=home,
            store=http_store.url))
    info = inspect("app:task", store=http_store.url)
    assert [layer["role"] for layer in info["layers"]] == ["base", "task"]
    fails(dsec("inspect", "ghost", store=http_store.url), "NOT_FOUND", "ghost:latest", http_store.url)

    # The store goes away: a clear UNAVAILABLE, not a hang.
    http_store.go_away()
    fails(dsec("inspect", "app:v1", store=http_store.url, timeout=120), "UNAVAILABLE")
