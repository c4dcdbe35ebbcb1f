#!/usr/bin/env python3
"""Writes the seed inputs of the fuzz targets into tests/fuzz/corpus/<target>/ (they are kept in the repository;
run this again after changing it). Each seed is a small, realistic input of the decoder the target drives, plus a
few hostile ones of the kinds the decoder must refuse; the fuzzer mutates from there.

    tests/fuzz/make_corpus.py
"""
import base64
import gzip
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def b64(data):
    return base64.b64encode(data).decode()


def sha(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


# --- http_request: byte 0 is how many bytes one read returns (minus one), then the connection's bytes ---------------
def http(method, target, body=b"", headers=(), chunked=False):
    lines = [f"{method} {target} HTTP/1.1", "Host: localhost"] + list(headers)
    if isinstance(body, str):
        body = body.encode()
    if chunked:
        lines.append("Transfer-Encoding: chunked")
        out = "\r\n".join(lines).encode() + b"\r\n\r\n"
        for i in range(0, len(body), 16):
            piece = body[i:i + 16]
            out += b"%x\r\n" % len(piece) + piece + b"\r\n"
        return out + b"0\r\n\r\n"
    if body or method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(body)}")
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + body


SPEC = {"image": "busybox", "kind": "container", "resources": {"cpu": 1, "memory": "512Mi", "disk": "1Gi"},
        "ttl": 600, "env": {"A": "1"}, "labels": {"team": "rl"}, "request_id": "r-1"}

http_seeds = {
    # What libFuzzer found: a chunked body whose chunk header arrives split over one-byte reads (Beast's parser asserts
    # on it with Boost's assertions on; the agent's build has them off, see CMakeLists.txt).
    "beast_chunk_header_split": b'\x00GET /v1/xec HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding:exec HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n, "timeout"\xb1\xb1\xb1\xb1\xb1\xb1\xb1\xb1\xb1\xb1\xb1\xb1\xb1\xb1\xb1\xb1\xb1\xb1\xb1\xb1\xb1.1\r\nH\nGET /he HTTP/0.1\r\n.1\r\nHost: localhost\r\nEeamection: close\r\n\r\n',
    "node": b"\xff" + http("GET", "/v1/node"),
    "create": b"\x07" + http("POST", "/v1/sandboxes", json.dumps(SPEC), ["Content-Type: application/json"]),
    "list_keepalive": b"\x00" + http("GET", "/v1/sandboxes?label=team%3Drl&label=a=b&tenant=t1") +
                      http("GET", "/healthz") + http("GET", "/metrics", headers=["Connection: close"]),
    "upload": b"\x1f" + http("PUT", "/v1/sandboxes/sb-0001/files?path=%2Fetc%2Fhosts&mode=0644", "127.0.0.1 x\n",
                             ["Expect: 100-continue"]),
    "exec_chunked": b"\x03" + http("POST", "/v1/sandboxes/sb-0001/exec",
                                   json.dumps({"argv": ["sh", "-c", "echo hi"], "timeout": 5, "stream": True}),
                                   chunked=True),
    "renew": b"\x40" + http("POST", "/v1/groups/g.1_x/renew", '{"ttl": 30}'),
    "fncall_batch": b"\x80" + http("POST", "/v1/fncall/batch",
                                   json.dumps({"calls": [{"language": "python", "code": "print(1)"}]})),
    "bad_escape": b"\x10" + http("DELETE", "/v1/sandboxes/sb%2F..%2x/?path=%zz&mode=99999"),
}

# --- protocol_json: request and answer bodies -----------------------------------------------------------------------
EXEC_RESULT = {"exit_code": 0, "signal": 0, "stdout": b64(b"hi\n"), "stderr": "", "stdout_truncated": False,
               "stderr_truncated": False, "timed_out": False, "duration": 0.012}
FNCALL_RESULT = dict(EXEC_RESULT, oom_killed=False, cpu_time=0.01, peak_memory=1 << 20, compile_exit_code=0,
                     compile_output="", compile_seconds=0.0, gpus=[], node="n1")
SANDBOX_INFO = {"id": "sb-0001", "node": "n1", "state": "running", "image": "busybox", "kind": "container",
                "tenant": "", "labels": {"team": "rl"}, "group": "",
                "resources": {"cpu": 1.0, "memory": 536870912, "disk": 1073741824, "pids": 512, "open_files": 1024,
                              "gpus": 0},
                "created_at": 1700000000.5, "expires_at": 1700000600.5, "message": "",
                "network": {"mode": "egress", "rules": [{"allow": True, "cidr": "10.0.0.0/8", "protocol": "tcp",
                                                         "ports": "443"}]}}
NODE_INFO = {"id": "n1", "version": "0.1.0", "protocol": "v1", "backends": ["container", "null"],
             "capacity": {"cores": 2, "memory": 8 << 30, "disk": 100 << 30, "gpus": 0}, "disk_free": 50 << 30,
             "gpus_free": 0, "labels": {"zone": "a"},
             "load": {"sandboxes": 3, "cpu_requested": 3.0, "memory_requested": 3 << 29, "load1": 0.5},
             "overcommit": {"cpu": 4.0, "memory": 1.5}, "cgroup_version": "v2", "images": ["busybox:latest"],
             "layer_mode": "lazy",
             "cached_layers": [{"digest": sha(b"l"), "size": 4096, "cached_bytes": 4096, "users": 1}],
             "swap": {"total": 0, "free": 0},
             "microvm": {"offered": True, "unavailable": "", "ready": True, "accelerator": "kvm",
                         "accelerator_reason": "", "kernel": "6.1", "vms": 1,
                         "pool": {"size": 2, "ready": 2, "claims": 10, "misses": 1},
                         "templates": {"count": 1, "bytes": 1 << 27}}}

json_seeds = {
    "spec": SPEC,
    "spec_group": dict(SPEC, group="g1", group_ttl=60, anti_affinity="team", node_selector={"zone": "a"},
                       hostname="box-1", workdir="/root", allow_ptrace=True, tenant="t1"),
    "exec_shell": {"shell": "echo hi; exit 3", "env": {"X": "y"}, "cwd": "/tmp", "timeout": 10, "max_output": 65536},
    "exec_argv": {"argv": ["/bin/cat"], "stdin": b64(b"input bytes"), "timeout": 1.5},
    "exec_user": {"argv": ["id"], "user": "1000:1000"},
    "spec_user": dict(SPEC, user="nobody", protected_paths=["/grader", "/srv/answers"]),
    "spec_network": dict(SPEC, network={"mode": "egress", "rules": [
        {"cidr": "10.20.9.0/24", "allow": False}, {"cidr": "10.20.0.0/16", "protocol": "tcp", "ports": "80-443"},
        {"cidr": "192.0.2.7", "protocol": "udp", "ports": 53}]}),
    "network_policy": {"mode": "egress", "rules": [{"cidr": "0.0.0.0/0", "protocol": "tcp", "ports": "25",
                                                     "allow": False}, {"cidr": "0.0.0.0/0"}]},
    "network_mode": "open",
    "network_names": {"mode": "egress", "rules": [{"host": "bad.example.org", "allow": False},
                                                    {"host": "*.example.org", "protocol": "tcp", "ports": "443"},
                                                    {"host": "pypi.mirror.internal"}, {"cidr": "10.0.0.0/8"}]},
    "fncall": {"language": "python", "code": "import sys\nprint(sys.argv)", "args": ["a", "b"],
               "files": {"data/in.txt": b64(b"x" * 10)}, "stdin": b64(b"1 2\n"), "env": {"K": "v"}, "timeout": 2,
               "cpu_time": 1, "memory": "256Mi", "pids": 64, "max_output_bytes": "1Mi", "gpu_mode": "shared",
               "gpus": 1, "image": "busybox@" + sha(b"m"), "request_id": "c-1"},
    "exec_result": EXEC_RESULT,
    "fncall_result": FNCALL_RESULT,
    "fncall_batch_results": {"results": [FNCALL_RESULT,
                                         {"error": {"code": "UNAVAILABLE", "message": "busy", "retryable": True}}]},
    "sandbox_info": SANDBOX_INFO,
    "sandbox_list": {"sandboxes": [SANDBOX_INFO, dict(SANDBOX_INFO, id="sb-0002", state="sleeping")]},
    "node_info": NODE_INFO,
    "error": {"code": "NOT_FOUND", "message": "no sandbox sb-9", "retryable": False},
    "wrong_types": {"exit_code": "0", "resources": {"cpu": "1", "memory": -1}, "ttl": 1e30, "labels": [1]},
}

# --- manifest: text up to a NUL (manifest, chunk index or reference), then a chunk data blob ------------------------
def manifest_json(layers, **extra):
    m = {"schema": 1, "name": "swe/task-17", "tag": "latest", "created_at": 1700000000.25,
         "source": "debootstrap:bookworm +python3", "parent": "", "notes": ["skipped 2 device nodes"],
         "layers": layers}
    m.update(extra)
    return json.dumps(m, sort_keys=True, separators=(",", ":"))


LAYER = {"role": "base", "digest": sha(b"layer"), "size": 8 << 20, "index": sha(b"index"), "data": sha(b"data"),
         "stored_size": 3 << 20, "files_size": 7 << 20}


def chunk_index_seed():
    chunk_size = 4096
    layer = bytes(range(256)) * 24  # 6144 bytes: one whole chunk and a short one
    chunks, blob = [], b""
    for i in range(0, len(layer), chunk_size):
        raw = layer[i:i + chunk_size]
        stored = raw
        if shutil.which("zstd"):
            stored = subprocess.run(["zstd", "-q", "-c", "-3"], input=raw, stdout=subprocess.PIPE, check=True).stdout
            if len(stored) >= len(raw):
                stored = raw
        chunks.append([len(blob), len(stored), hashlib.sha256(raw).hexdigest()])
        blob += stored
    index = {"schema": 1, "layer": sha(layer), "size": len(layer), "meta_size": 4096, "chunk_size": chunk_size,
             "data": sha(blob), "data_size": len(blob), "chunks": chunks, "prefetch": [0]}
    return json.dumps(index, sort_keys=True, separators=(",", ":")).encode() + b"\0" + blob


manifest_seeds = {
    "manifest": manifest_json([LAYER, dict(LAYER, role="task", digest=sha(b"task"))]),
    "manifest_snapshot": manifest_json([LAYER, dict(LAYER, role="snapshot", digest=sha(b"s"), files_size=0)],
                                       parent="swe/task-17:latest@" + sha(b"p")),
    "chunk_index": chunk_index_seed(),
    "reference": "swe/task-17:v1.2_rc@" + sha(b"m"),
    "reference_plain": "busybox",
    "bad_manifest": manifest_json([dict(LAYER, size=-1, role="middle")], schema=1.5),
    "manifest_with_config": manifest_json([LAYER], schema=2, config={
        "env": ["PATH=/opt/conda/bin:/usr/bin"], "entrypoint": ["/bin/sh", "-c"], "cmd": ["true"],
        "working_dir": "/testbed", "user": "1000:1000", "exposed_ports": ["8080/tcp"], "labels": {"k": "v"},
        "stop_signal": "SIGINT"}),
    "reference_registry": "registry.example:5000/swebench/sweb.eval.x86_64.django__django-11099:latest@" + sha(b"m"),
    # What a registry answers (image/registry/oci_image.hpp): an image manifest, an index, an image configuration.
    "oci_manifest": json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha(b"c"), "size": 2},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": sha(b"l"), "size": 9},
                   {"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd", "digest": sha(b"z"), "size": 7}]}),
    "oci_index": json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": sha(b"a"), "size": 5,
         "platform": {"os": "linux", "architecture": "arm64", "variant": "v8"}},
        {"mediaType": "application/vnd.docker.distribution.manifest.v2+json", "digest": sha(b"b"), "size": 6,
         "platform": {"os": "linux", "architecture": "amd64"}}]}),
    "oci_config": json.dumps({"architecture": "amd64", "os": "linux", "config": {
        "Env": ["PATH=/usr/bin", "A=b"], "Entrypoint": None, "Cmd": ["bash"], "WorkingDir": "/w", "User": "u",
        "ExposedPorts": {"80/tcp": {}}, "Labels": {"a": "b"}, "StopSignal": "SIGTERM"},
        "rootfs": {"type": "layers", "diff_ids": [sha(b"d")]}}),
}

# --- tar_import: byte 0 picks the importer (0 layer, 1 layer with overlay whiteouts, 2 OCI image tar, 3 upload,
# 4 an OCI layout directory given as parts) -------------------------------------------------------------------------
OUTSIDE = "/run/dsec-fuzz/tar_import/outside"


def tar_bytes(members, fmt=tarfile.GNU_FORMAT):
    """members: (name, kind, payload) with kind file/dir/symlink/hardlink/fifo."""
    tarfile.RECORDSIZE = tarfile.BLOCKSIZE  # no padding to 10 KiB after the end: small seeds mutate faster
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as t:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            info.mtime = 1700000000
            info.mode = 0o755 if kind == "dir" else 0o644
            data = None
            if kind == "file":
                data = payload.encode() if isinstance(payload, str) else payload
                info.size = len(data)
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, payload
            elif kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, payload
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


LAYER_TAR = tar_bytes([("etc", "dir", None), ("etc/hostname", "file", "box\n"), ("bin", "dir", None),
                       ("bin/sh", "file", b"\x7fELF" + b"\0" * 60), ("bin/ash", "hardlink", "bin/sh"),
                       ("usr/lib/libc.so", "symlink", "../../lib/libc.so.6"), ("dev/null", "fifo", None)])
WHITEOUT_TAR = tar_bytes([("etc/.wh.hostname", "file", ""), ("var/cache/.wh..wh..opq", "file", ""),
                          ("var/cache/new", "file", "new\n")])


def oci_image_tar():
    layer = gzip.compress(LAYER_TAR, mtime=0)
    config = json.dumps({"architecture": "amd64", "os": "linux"}).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha(config),
                                      "size": len(config)},
                           "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": sha(layer),
                                       "size": len(layer)}]}).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": sha(manifest), "size": len(manifest),
         "platform": {"architecture": "amd64", "os": "linux"}}]}).encode()
    blobs = [(sha(b)[7:], b) for b in (layer, config, manifest)]
    return tar_bytes([("oci-layout", "file", '{"imageLayoutVersion": "1.0.0"}'), ("index.json", "file", index),
                      ("blobs", "dir", None), ("blobs/sha256", "dir", None)] +
                     [(f"blobs/sha256/{h}", "file", b) for h, b in blobs])


def docker_save_tar():
    manifest = json.dumps([{"Config": "c.json", "RepoTags": ["x:latest"], "Layers": ["l1/layer.tar"]}])
    return tar_bytes([("manifest.json", "file", manifest), ("c.json", "file", "{}"), ("l1", "dir", None),
                      ("l1/layer.tar", "file", gzip.compress(WHITEOUT_TAR, mtime=0))])


PART = b"\n--part--\n"  # tar_import.cpp's kPartSeparator


def oci_layout_parts():
    """Mode 4: index.json, then the blobs it and they name as "@i" (see tar_import.cpp)."""
    index = {"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                                "digest": "@1", "size": 0,
                                                "platform": {"architecture": "amd64", "os": "linux"}}]}
    manifest = {"schemaVersion": 2, "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                               "digest": "@2"},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": "@3"},
                           {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": "@4"}]}
    parts = [json.dumps(index), json.dumps(manifest), '{"architecture":"amd64","os":"linux"}',
             gzip.compress(LAYER_TAR, mtime=0), gzip.compress(WHITEOUT_TAR, mtime=0)]
    return PART.join(p.encode() if isinstance(p, str) else p for p in parts)


def docker_layout_parts():
    manifest = [{"Config": "p1", "RepoTags": ["x:latest"], "Layers": ["@2", "@3"]}]
    parts = [json.dumps(manifest), "{}", gzip.compress(LAYER_TAR, mtime=0), gzip.compress(WHITEOUT_TAR, mtime=0)]
    return PART.join(p.encode() if isinstance(p, str) else p for p in parts)


def nested_index_parts():
    index = {"manifests": [{"mediaType": "application/vnd.oci.image.index.v1+json", "digest": "@1"}]}
    nested = {"manifests": [{"digest": "@2", "platform": {"architecture": "arm64", "os": "linux"}},
                            {"digest": "@2", "platform": {"architecture": "amd64", "os": "linux"}}]}
    manifest = {"layers": [{"digest": "@3"}]}
    parts = [json.dumps(index), json.dumps(nested), json.dumps(manifest), gzip.compress(LAYER_TAR, mtime=0)]
    return PART.join(p.encode() if isinstance(p, str) else p for p in parts)


tar_seeds = {
    "layer": b"\x00" + LAYER_TAR,
    "layer_whiteouts": b"\x01" + WHITEOUT_TAR,
    "layer_gzip": b"\x00" + gzip.compress(LAYER_TAR, mtime=0),
    "layer_escape": b"\x00" + tar_bytes([("etc", "symlink", "../../outside"), ("etc/passwd", "file", "x"),
                                         ("abs", "symlink", OUTSIDE), ("abs/secret", "hardlink", "etc/hostname"),
                                         ("h", "hardlink", "etc/secret"), ("h2", "hardlink", "abs/secret"),
                                         ("../up", "file", "x")]),
    "layer_whiteout_escape": b"\x01" + tar_bytes([("o", "symlink", "../../outside"), ("o/.wh.secret", "file", ""),
                                                  ("o/.wh..wh..opq", "file", "")]),
    "oci": b"\x02" + oci_image_tar(),
    "docker_save": b"\x02" + docker_save_tar(),
    "layout": b"\x04" + oci_layout_parts(),
    "layout_docker": b"\x04" + docker_layout_parts(),
    "layout_nested": b"\x04" + nested_index_parts(),
    "upload": b"\x03" + tar_bytes([("src", "dir", None), ("src/main.py", "file", "print('hi')\n"),
                                   ("src/link", "symlink", "/etc/passwd"), ("src/copy.py", "hardlink", "src/main.py")],
                                  fmt=tarfile.PAX_FORMAT),
    "upload_escape": b"\x03" + tar_bytes([("up", "symlink", "../.."), ("up/outside/secret", "file", "pwned"),
                                          ("abs", "symlink", OUTSIDE), ("abs/secret", "file", "pwned"),
                                          ("h", "hardlink", "abs/secret"), ("../../x", "file", "x")]),
}

# --- sandbox_path: operations (a byte, then a path up to '\n'; an extraction adds a name up to '\n') ---------------
# op % 8: 0 open_for_reading, 1 read_file, 2 mode_of, 3 is_directory, 4 open_for_writing, 5 write_file, 6 walk,
# 7 extract one entry (kind from (op >> 3) % 4: directory, regular, symlink, hard link; link target = the path).
def ops(*items):
    out = b""
    for item in items:
        op, path = item[0], item[1]
        out += bytes([op]) + path.encode() + b"\n"
        if len(item) > 2:
            out += item[2].encode() + b"\n"
    return out


path_seeds = {
    "reads": ops((0, "/etc/passwd"), (1, "/dir/file"), (1, "/dir/sub/../file"), (2, "/up"), (3, "/dir")),
    "escapes": ops((1, "/up/up/outside/secret"), (1, "/secret"), (1, "/secretabs"), (1, "/outabs/secret"),
                   (1, "/out/secret"), (0, "/dir/upup/outside/dir/file"), (1, "/dir/twisty/secret")),
    "specials": ops((1, "/fifo"), (4, "/fifo"), (1, "/loop"), (1, "/mounted"), (2, "/mnt/file"),
                    (1, "/hostroot/etc/passwd"), (1, "/proc/self/environ"), (3, "/proc/1/root")),
    "writes": ops((4, "/new/dir/file"), (5, "/secret"), (5, "/out/new"), (5, "/abs/tmp/x"), (4, "/up/outside/x"),
                  (4, "/passwd")),
    "walks": ops((6, "/"), (6, "/dir"), (6, "/up"), (6, "/mnt")),
    "extract": ops((7, "/etc/passwd", "hl"), (7 | 8, "", "f"), (7 | 16, "../../outside/secret", "s"),
                   (7 | 24, "s", "viasym"), (7 | 24, "up/outside/secret", "h2"), (7, "", "../../../escape")),
}

# --- wire_frames: byte 0 the wire (0 VM stream, 1 container StartRequest payload, 2 fork server frames, 3 the same
# given as lines of JSON headers), byte 1 the piece size the VM stream is fed in (or the blob size), then the bytes --------------------------------------------------------------
def u8(v): return struct.pack("<B", v)
def u32(v): return struct.pack("<I", v)
def u64(v): return struct.pack("<Q", v)
def s(v): v = v.encode() if isinstance(v, str) else v; return u32(len(v)) + v
def strs(v): return u32(len(v)) + b"".join(s(x) for x in v)
def frame(t, ch, payload=b""): return u32(len(payload) + 5) + u8(t) + u32(ch) + payload


def entry(kind, path, mode=0o644, link="", size=0):
    return u8(kind) + s(path) + u32(mode) + s(link) + u64(size) + u32(0) + u32(0) + u64(1700000000) + u64(1) + \
        u64(2) + u8(0)


def fork_frame(header, blob=b""):
    h = json.dumps(header).encode()
    return u32(len(h)) + u32(len(blob)) + h + blob


wire_seeds = {
    "guest_control": b"\x00\x07" + frame(1, 0, u64(1700000000 * 10**9) + s(b"\x01" * 32) +
                                         s("sb-1")) +
                     frame(2, 0, s("6.1.0-cloud-amd64") + u8(1) + u32(0)) +
                     frame(3, 0, u32(2) + s("layer0") + s("") + s("layer1") + s("data1") + s("disk")) +
                     frame(4, 0) + frame(6, 0) + frame(5, 0, u32(5) + s("no such disk")),
    "guest_exec": b"\x00\x40" + frame(10, 3, strs(["sh", "-c", "cat"]) + strs(["PATH=/bin"]) + s("/") +
                                      u64(1 << 20) + u8(1)) +
                  frame(15, 3, s("input")) + frame(15, 3, s("")) + frame(11, 3, u32(42)) +
                  frame(13, 3, u8(1) + s("out")) + frame(17, 3, u64(4096)) + frame(14, 3, u32(0) + u8(0) + u8(1)) +
                  frame(12, 4, u32(2) + u32(5)) + frame(16, 5),
    "guest_files": b"\x00\xff" + frame(20, 7, s("/etc/hosts") + u64(1 << 20)) + frame(27, 7, s("127.0.0.1\n")) +
                   frame(29, 7, u64(10)) + frame(21, 8, s("/tmp/x") + u32(0o644)) + frame(28, 8) +
                   frame(22, 9, s("/tmp")) + frame(23, 9, u32(0o40755)) + frame(24, 10, s("/up")) +
                   frame(26, 10, entry(2, "a/b", size=3)) + frame(27, 10, s("abc")) +
                   frame(26, 10, entry(3, "l", link="../x")) + frame(25, 11, s("/") + u64(1 << 20)) +
                   frame(30, 12, u64(1 << 30)),
    "guest_oversize": b"\x00\x03" + u32(1 << 24) + b"\x0a" + u32(1),
    "init_request": b"\x01\x00" + strs(["/bin/sh", "-c", "echo hi"]) + strs(["PATH=/usr/bin:/bin", "HOME=/root"]) +
                    s("/root"),
    "init_bad_count": b"\x01\x00" + u32(0xFFFFFFFF) + s("x"),
    "init_request_user": b"\x01\x00" + strs(["/bin/id"]) + strs(["HOME=/home/alice"]) + s("/") + u32(1001) +
                         u32(1001) + u32(2) + u32(1001) + u32(50),
    "fork_hello": b"\x02\x00" + fork_frame({"type": "hello", "failed": {"numpy": "ModuleNotFoundError"}}) +
                  fork_frame({"type": "ready"}),
    "fork_call": b"\x02\x00" + fork_frame({"type": "compiled", "exit_code": 0, "seconds": 0.25, "truncated": False},
                                          b"main.c: warning\n") +
                 fork_frame({"type": "status", "status": 256}) +
                 fork_frame({"type": "failed", "stage": "files", "message": "No space left on device"}),
    "fork_fatal": b"\x02\x00" + fork_frame({"type": "fatal", "message": "python3: not found"}),
    "fork_lines": b"\x03\x08" + b"\n".join(json.dumps(h).encode() for h in [
        {"type": "hello", "failed": {"torch": "ImportError"}}, {"type": "ready"},
        {"type": "compiled", "exit_code": 1, "seconds": 0.5, "truncated": True}, {"type": "status", "status": 9},
        {"type": "failed", "stage": "cgroup", "message": "short write"}, {"type": "fatal", "message": "no python"}]),
}


# e2b_wire: byte 0 picks the decoder (0 client stream, 1 server stream, 2 unary, 3 timeout header, 4 multipart with
# its Content-Type on the first line).
def envelope(flags, payload): return bytes([flags]) + struct.pack(">I", len(payload)) + payload


_e2b_start = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"], "envs": {"A": "1"},
                                     "cwd": "/tmp"}, "stdin": False}).encode()
e2b_seeds = {
    "client_stream": b"\x00" + envelope(0, b'{"start":{"process":{"pid":7}}}') +
                     envelope(0, b'{"data":{"input":{"stdin":"aGk="}}}') + envelope(0, b'{"keepalive":{}}'),
    "server_stream_start": b"\x01" + envelope(0, _e2b_start),
    "server_stream_short": b"\x01" + b"\x00\x00\x00\x00\x09{}",
    "unary_listdir": b"\x02" + b'{"path":"/home/user","depth":2}',
    "timeout": b"\x0360000",
    "multipart_two": b"\x04multipart/form-data; boundary=----formdata-undici-0123\n"
                     b"------formdata-undici-0123\r\nContent-Disposition: form-data; name=\"file\"; "
                     b"filename=\"/home/user/a.txt\"\r\nContent-Type: application/octet-stream\r\n\r\nhello\r\n"
                     b"------formdata-undici-0123\r\nContent-Disposition: form-data; name=\"file\"; "
                     b"filename=\"b.bin\"\r\n\r\n\x00\x01\x02\r\n------formdata-undici-0123--\r\n",
}


def main():
    if os.path.isdir(CORPUS):
        shutil.rmtree(CORPUS)
    for name, data in http_seeds.items():
        write("http_request", name, data)
    for name, value in json_seeds.items():
        write("protocol_json", name + ".json", json.dumps(value, indent=1))
    for name, data in manifest_seeds.items():
        write("manifest", name, data)
    for name, data in tar_seeds.items():
        write("tar_import", name, data)
    for name, data in path_seeds.items():
        write("sandbox_path", name, data)
    for name, data in wire_seeds.items():
        write("wire_frames", name, data)
    for name, data in e2b_seeds.items():
        write("e2b_wire", name, data)


if __name__ == "__main__":
    main()
