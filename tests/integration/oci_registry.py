"""OCI images and registries for tests of dsec's registry client: image layouts built from Python, a private
docker-registry they are pushed to with skopeo, and a registry that lies.

Image layouts (the OCI image-layout spec: oci-layout, index.json, blobs/sha256/<hex>):

    layout = OciLayout("/tmp/some-dir")
    base = layout.add_layer([directory("etc"), file("etc/hosts", b"127.0.0.1 localhost\\n"),
                             file("bin/tool", b"...", mode=0o755), symlink("bin/sh", "tool")])
    top = layout.add_layer([whiteout("etc/hosts"), opaque("var/cache"), hardlink("bin/alias", "bin/tool")],
                           compression="zstd")          # "gzip" (the default), "zstd" or "none"
    image = layout.add_image([base, top], {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"], "WorkingDir": "/"},
                             platform=("linux", "amd64"), tag="v1")          # media_types="docker": schema 2
    arm = layout.add_image([base], platform=("linux", "arm64", "v8"))      # untagged: reachable from an index
    layout.add_index([image, arm], tag="multi")

A layer is a tar (PAX format) of the entries given: file(), zeros() (a file of that many zero bytes, streamed, so
that a gzip bomb never sits in memory), directory(), symlink(), hardlink(), device(), whiteout() (".wh.NAME"),
opaque() (".wh..wh..opq") and raw(tarinfo, data) for hostile members ("../x", "/etc/x", absolute link targets).
Entries may come from a generator (a layer with a million members). The config blob carries rootfs.diff_ids (the
sha256 of each uncompressed tar), os/architecture/variant, one history entry per layer and the runtime config given
(OCI keys: Env, Entrypoint, Cmd, WorkingDir, User, ExposedPorts, Volumes, Labels, StopSignal). Descriptors are frozen
dataclasses, so a lie is dataclasses.replace(layer, size=layer.size - 1) handed to add_image() (the registry takes
such a manifest too); config_overrides replaces top-level config fields (say a wrong rootfs).

A private docker-registry (Debian's, the CNCF distribution server 2.8) on 127.0.0.1:

    registry = Registry().start()                                        # anonymous push and pull
    registry = Registry(auth="htpasswd", users={"alice": "secret"}).start()
    registry = Registry(auth="token", users={"alice": "secret"}, anonymous_pull=True, tls=True).start()
    digest = push(layout.dir, "v1", registry, "team/app", creds=("alice", "secret"))   # the manifest's digest
    registry.host, registry.url, registry.ca_file     # "127.0.0.1:41234", "https://127.0.0.1:41234", the CA's PEM
    registry.blob_path(layer.digest)                  # the registry's own file of that blob, to corrupt it
    registry.requests()                               # what it answered (its access log): method, uri, status...
    registry.token_requests, registry.token_log       # what the token issuer was asked and answered
    registry.kill(); registry.start()                 # dies at once (SIGKILL), comes back on the same port
    registry.stop()                                   # nothing of it runs afterwards; its temp dirs are removed

Its configuration, storage (unless storage_dir is given), logs and certificates live in a private temp directory;
/etc/docker/registry and the package's service are never used, and the process gets no REGISTRY_* variable from the
environment. The port is bound here first (SO_REUSEADDR, not listening) and held until stop(), so it is known before
the registry starts, the kernel never hands it out as an ephemeral port, and the registry binds it again after
kill(). The registry runs in its own process group under `setpriv --pdeathsig KILL` (it dies with the thread that
started it, so start it from the test's main thread), stop() kills the group and an atexit hook stops whatever a
test left running. With auth="token" a token issuer runs in a thread on another loopback port (the realm): it takes
HTTP basic credentials (none: anonymous), grants per `access` (default: a user gets every action asked for,
anonymous gets pull if anonymous_pull) and answers a JWT (ES256, header x5c = the signing certificate, which is the
registry's rootcertbundle). With tls=True the registry and the issuer serve https with a certificate for 127.0.0.1
signed by a throwaway CA (ca_file; cert_dir holds it as ca.crt for skopeo's --dest-cert-dir). htpasswd lines are
bcrypt hashes from glibc's libcrypt (bcrypt_hash()).

push() runs `skopeo copy --preserve-digests` (plus --all for an index): every blob and manifest reaches the registry
byte for byte (zstd layers stay zstd, Docker media types stay Docker's), or the push fails.

A registry that lies, serving the images of a layout (any repository name) over plain http:

    hostile = HostileRegistry(layout).start()
    hostile.on(f"*/blobs/{layer.digest}", Cut(after=1000), times=2, method="GET")   # cut twice, then the truth
    hostile.on("*/manifests/v1", Status(429, headers={"Retry-After": "1"}), times=1)
    hostile.on("*", Unauthorized())               # a bearer challenge its own /token never satisfies
    hostile.count(f"*/blobs/{layer.digest}", method="GET"), hostile.requests   # who asked what (with Range)
    hostile.stop()

Behaviours: Status (any status, N times then the truth), Unauthorized, Redirect (307 to another URL, e.g. another
HostileRegistry), Body (other bytes under that path: a blob that does not match its digest, any manifest), Corrupt
(one byte flipped, same length), Cut (closes after N bytes, FIN or RST), Endless (200 without a length, bytes forever,
at a rate or flat out), Stall (N bytes, then nothing until the client goes), Throttle (the real body, slowly),
IgnoreRange (200 and the whole body whatever the Range). GET and HEAD of /v2/, manifests (by tag or digest, as the
layout's index.json and blobs have them; index.json is read at each request) and blobs (Range: bytes=A- and A-B,
206/416) are served, PUT and the like get 405; a rule's pattern is an fnmatch pattern of the request path, the first
rule that matches and has times left applies, and /token (Unauthorized's realm) is served whatever the rules.
"""

from __future__ import annotations

import atexit
import base64
import ctypes
import dataclasses
import datetime
import fnmatch
import hashlib
import http.client
import http.server
import io
import ipaddress
import json
import os
import pathlib
import posixpath
import re
import secrets
import select
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.parse
import zlib
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import jwt
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

REGISTRY = "/usr/bin/docker-registry"
SKOPEO = "/usr/bin/skopeo"
SETPRIV = "/usr/bin/setpriv"
ZSTD = "/usr/bin/zstd"

OCI_LAYOUT_VERSION = "1.0.0"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
REF_NAME = "org.opencontainers.image.ref.name"

LAYER_MEDIA_TYPES = {"none": OCI_LAYER, "gzip": OCI_LAYER_GZIP, "zstd": OCI_LAYER_ZSTD}
_DOCKER_FOR_OCI = {OCI_LAYER: DOCKER_LAYER, OCI_LAYER_GZIP: DOCKER_LAYER_GZIP, OCI_CONFIG: DOCKER_CONFIG,
                   OCI_MANIFEST: DOCKER_MANIFEST, OCI_INDEX: DOCKER_LIST}
_INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)

MTIME = 1_700_000_000  # every member's mtime unless given: a layer's digest depends only on its entries
CREATED = "2023-11-14T22:13:20Z"
_CHUNK = 1 << 20
_LOOPBACK = ipaddress.ip_address("127.0.0.1")


def skip_reason() -> str | None:
    """Why a private registry cannot run or be pushed to here, or None."""
    for path, package in ((REGISTRY, "docker-registry"), (SKOPEO, "skopeo"), (SETPRIV, "util-linux"),
                          (ZSTD, "zstd")):
        if not os.access(path, os.X_OK):
            return f"{path} is not installed (Debian: apt-get install {package})"
    return None


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _json_bytes(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


# --- tar entries -------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Entry:
    """One tar member: its header and its content, bytes or a count of zero bytes streamed into the tar."""
    info: tarfile.TarInfo
    data: bytes | int = b""


class _Zeros:
    """A file of `size` zero bytes that holds none of them."""

    def __init__(self, size: int):
        self.left = size

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        self.left -= n
        return bytes(n)


def _info(name: str, kind: bytes, mode: int, uid: int, gid: int, mtime: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.uid, info.gid = uid, gid
    info.uname = info.gname = ""
    info.mtime = mtime
    return info


def file(name: str, content: bytes = b"", *, mode: int = 0o644, uid: int = 0, gid: int = 0,
         mtime: int = MTIME) -> Entry:
    """A regular file."""
    info = _info(name, tarfile.REGTYPE, mode, uid, gid, mtime)
    info.size = len(content)
    return Entry(info, content)


def zeros(name: str, size: int, *, mode: int = 0o644, uid: int = 0, gid: int = 0, mtime: int = MTIME) -> Entry:
    """A regular file of `size` zero bytes, streamed through the compressor (a gzip bomb: zeros("x", 1 << 30) is
    about 1 MiB gzipped and takes some 4 s to build)."""
    info = _info(name, tarfile.REGTYPE, mode, uid, gid, mtime)
    info.size = size
    return Entry(info, size)


def directory(name: str, *, mode: int = 0o755, uid: int = 0, gid: int = 0, mtime: int = MTIME) -> Entry:
    return Entry(_info(name, tarfile.DIRTYPE, mode, uid, gid, mtime))


def symlink(name: str, target: str, *, uid: int = 0, gid: int = 0, mtime: int = MTIME) -> Entry:
    info = _info(name, tarfile.SYMTYPE, 0o777, uid, gid, mtime)
    info.linkname = target
    return Entry(info)


def hardlink(name: str, target: str, *, mtime: int = MTIME) -> Entry:
    """A hard link to `target`, a member earlier in the same layer (or, hostile, anywhere)."""
    info = _info(name, tarfile.LNKTYPE, 0o644, 0, 0, mtime)
    info.linkname = target
    return Entry(info)


def device(name: str, kind: str = "char", major: int = 0, minor: int = 0, *, mode: int = 0o666) -> Entry:
    """A device node or fifo: kind "char", "block" or "fifo"."""
    types = {"char": tarfile.CHRTYPE, "block": tarfile.BLKTYPE, "fifo": tarfile.FIFOTYPE}
    info = _info(name, types[kind], mode, 0, 0, MTIME)
    info.devmajor, info.devminor = major, minor
    return Entry(info)


def whiteout(path: str) -> Entry:
    """The OCI whiteout of `path` (a lower layer's file or directory): DIR/.wh.NAME."""
    parent, name = posixpath.split(path.rstrip("/"))
    return file(posixpath.join(parent, ".wh." + name))


def opaque(path: str) -> Entry:
    """The opaque marker of directory `path` (hides everything lower layers have in it): PATH/.wh..wh..opq."""
    return file(posixpath.join(path.rstrip("/"), ".wh..wh..opq"))


def raw(info: tarfile.TarInfo, data: bytes = b"") -> Entry:
    """Any member, as given (names with "..", absolute names, absolute link targets...); its size is len(data)."""
    info.size = len(data)
    return Entry(info, data)


# --- image layouts -----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor."""
    media_type: str
    digest: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


@dataclasses.dataclass(frozen=True)
class Layer(Descriptor):
    """A layer blob: diff_id is the sha256 of its uncompressed tar, uncompressed_size that tar's size."""
    diff_id: str
    uncompressed_size: int


@dataclasses.dataclass(frozen=True)
class Image(Descriptor):
    """An image manifest; platform is (os, architecture) or (os, architecture, variant)."""
    platform: tuple[str, ...]
    config: Descriptor
    layers: tuple[Descriptor, ...]

    def platform_json(self) -> dict[str, str]:
        return _platform_json(self.platform)


def _platform_json(platform: Sequence[str]) -> dict[str, str]:
    return dict(zip(("os", "architecture", "variant"), platform))


@dataclasses.dataclass(frozen=True)
class Index(Descriptor):
    """An image index (or Docker manifest list)."""
    images: tuple[Image, ...]


class _HashingWriter:
    """What tarfile writes into: hashed and counted (the uncompressed tar), then handed on."""

    def __init__(self, write: Callable[[bytes], Any]):
        self._write = write
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        self._write(data)
        return len(data)

    def tell(self) -> int:
        return self.size


def _write_tar(entries: Iterable[Entry], out: _HashingWriter) -> None:
    with tarfile.TarFile(fileobj=out, mode="w", format=tarfile.PAX_FORMAT,  # type: ignore[arg-type]
                         copybufsize=_CHUNK) as tar:
        for entry in entries:
            if isinstance(entry.data, int):
                tar.addfile(entry.info, _Zeros(entry.data))  # type: ignore[arg-type]
            elif entry.data:
                tar.addfile(entry.info, io.BytesIO(entry.data))
            else:
                tar.addfile(entry.info)


class OciLayout:
    """An OCI image layout directory, created if absent (see the module's doc). Every blob is written to a temporary
    file and renamed to blobs/sha256/<hex>; index.json is rewritten (atomically) at each tag."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.dir = pathlib.Path(directory).resolve()
        (self.dir / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        if not (self.dir / "oci-layout").exists():
            (self.dir / "oci-layout").write_bytes(_json_bytes({"imageLayoutVersion": OCI_LAYOUT_VERSION}))
        if not (self.dir / "index.json").exists():
            self._write_index([])

    def blob_path(self, digest: str) -> pathlib.Path:
        algorithm, hex_ = digest.split(":", 1)
        return self.dir / "blobs" / algorithm / hex_

    def add_blob(self, data: bytes, media_type: str) -> Descriptor:
        digest = sha256_digest(data)
        path = self.blob_path(digest)
        if not path.exists():
            tmp = path.with_name(f".tmp-{secrets.token_hex(8)}")
            tmp.write_bytes(data)
            tmp.rename(path)
        return Descriptor(media_type, digest, len(data))

    def add_layer(self, entries: Iterable[Entry], compression: str = "gzip") -> Layer:
        """A layer of these tar members, compressed with "gzip" (zlib, level 6, no name or time in the header),
        "zstd" (the zstd command, level 3) or "none"; its media type is the OCI one for that compression."""
        if compression not in LAYER_MEDIA_TYPES:
            raise ValueError(f"compression is gzip, zstd or none, not {compression!r}")
        tmp = self.dir / "blobs" / "sha256" / f".tmp-{secrets.token_hex(8)}"
        try:
            with open(tmp, "wb") as out:
                if compression == "zstd":
                    zstd = subprocess.Popen([ZSTD, "-q", "-c", "-3", "-"], stdin=subprocess.PIPE, stdout=out)
                    assert zstd.stdin is not None
                    tar = _HashingWriter(zstd.stdin.write)
                    try:
                        _write_tar(entries, tar)
                    finally:
                        zstd.stdin.close()
                        if zstd.wait() != 0:
                            raise RuntimeError(f"zstd exited with {zstd.returncode}")
                elif compression == "gzip":
                    gz = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
                    tar = _HashingWriter(lambda data: out.write(gz.compress(data)))
                    _write_tar(entries, tar)
                    out.write(gz.flush())
                else:
                    tar = _HashingWriter(out.write)
                    _write_tar(entries, tar)
            blob = hashlib.sha256()
            with open(tmp, "rb") as f:
                while chunk := f.read(_CHUNK):
                    blob.update(chunk)
            digest = "sha256:" + blob.hexdigest()
            size = tmp.stat().st_size
            tmp.rename(self.blob_path(digest))
        finally:
            tmp.unlink(missing_ok=True)
        return Layer(LAYER_MEDIA_TYPES[compression], digest, size, "sha256:" + tar.sha.hexdigest(), tar.size)

    def add_image(self, layers: Sequence[Descriptor], config: dict[str, Any] | None = None, *,
                  platform: tuple[str, ...] = ("linux", "amd64"), tag: str | None = None,
                  media_types: str = "oci", config_overrides: dict[str, Any] | None = None,
                  annotations: dict[str, str] | None = None) -> Image:
        """Writes the config blob and the manifest of an image of these layers (bottom first), and tags it in
        index.json when `tag` is given. config is the runtime config (OCI keys; ExposedPorts and Volumes may be
        lists). media_types "docker" makes a Docker schema 2 manifest (config and layer media types mapped; there is
        no Docker type for zstd). A layer that is not a Layer (a plain Descriptor) has no diff_id: give the config's
        rootfs in config_overrides."""
        types = self._media_types(media_types)
        runtime = dict(config or {})
        for key in ("ExposedPorts", "Volumes"):
            if isinstance(runtime.get(key), (list, tuple)):
                runtime[key] = {item: {} for item in runtime[key]}
        config_doc: dict[str, Any] = {
            "created": CREATED, **_platform_json(platform),
            "config": runtime,
            "rootfs": {"type": "layers", "diff_ids": [getattr(layer, "diff_id", "") for layer in layers]},
            "history": [{"created": CREATED, "created_by": f"dsec test layer {i}"} for i in range(len(layers))],
        }
        config_doc.update(config_overrides or {})
        config_desc = self.add_blob(_json_bytes(config_doc), types(OCI_CONFIG))
        manifest: dict[str, Any] = {
            "schemaVersion": 2, "mediaType": types(OCI_MANIFEST), "config": config_desc.to_json(),
            "layers": [dataclasses.replace(layer, media_type=types(layer.media_type)).to_json() for layer in layers],
        }
        if annotations:
            manifest["annotations"] = annotations
        desc = self.add_blob(_json_bytes(manifest), types(OCI_MANIFEST))
        image = Image(desc.media_type, desc.digest, desc.size, tuple(platform), config_desc, tuple(layers))
        if tag is not None:
            self.tag(image, tag)
        return image

    def add_index(self, images: Sequence[Image], *, tag: str | None = None, media_types: str = "oci",
                  annotations: dict[str, str] | None = None) -> Index:
        """Writes a multi-platform image index (media_types "docker": a manifest list) of these images, each with
        its platform, and tags it in index.json when `tag` is given."""
        types = self._media_types(media_types)
        doc: dict[str, Any] = {
            "schemaVersion": 2, "mediaType": types(OCI_INDEX),
            "manifests": [{**image.to_json(), "platform": image.platform_json()} for image in images],
        }
        if annotations:
            doc["annotations"] = annotations
        desc = self.add_blob(_json_bytes(doc), types(OCI_INDEX))
        index = Index(desc.media_type, desc.digest, desc.size, tuple(images))
        if tag is not None:
            self.tag(index, tag)
        return index

    def tag(self, descriptor: Descriptor, tag: str) -> None:
        """Points `tag` (index.json's org.opencontainers.image.ref.name) at this manifest or index, replacing the
        tag's previous entry."""
        entries = [e for e in self._read_index() if e.get("annotations", {}).get(REF_NAME) != tag]
        entry = {**descriptor.to_json(), "annotations": {REF_NAME: tag}}
        if isinstance(descriptor, Image):
            entry["platform"] = descriptor.platform_json()
        self._write_index(entries + [entry])

    def tags(self) -> dict[str, Descriptor]:
        """index.json's tagged entries."""
        out = {}
        for e in self._read_index():
            name = e.get("annotations", {}).get(REF_NAME)
            if name is not None:
                out[name] = Descriptor(e["mediaType"], e["digest"], e["size"])
        return out

    @staticmethod
    def _media_types(kind: str) -> Callable[[str], str]:
        if kind == "oci":
            return lambda media_type: media_type
        if kind == "docker":
            def docker(media_type: str) -> str:
                if media_type == OCI_LAYER_ZSTD:
                    raise ValueError("Docker schema 2 has no media type for a zstd layer")
                return _DOCKER_FOR_OCI.get(media_type, media_type)
            return docker
        raise ValueError(f"media_types is oci or docker, not {kind!r}")

    def _read_index(self) -> list[dict[str, Any]]:
        return list(json.loads((self.dir / "index.json").read_bytes()).get("manifests", []))

    def _write_index(self, manifests: list[dict[str, Any]]) -> None:
        tmp = self.dir / f".index.json.tmp-{secrets.token_hex(8)}"
        tmp.write_bytes(_json_bytes({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests}))
        tmp.rename(self.dir / "index.json")


# --- certificates, passwords, processes --------------------------------------------------------------------------

def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate | None,
                 issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool, server: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder()
               .subject_name(name).issuer_name(issuer.subject if issuer else name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=ca, crl_sign=ca,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, encipher_only=False,
                                            decipher_only=False), critical=True))
    if server:
        builder = (builder
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(_LOOPBACK),
                                                               x509.DNSName("localhost")]), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    return builder.sign(issuer_key, hashes.SHA256())


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_tls_material(directory: pathlib.Path) -> None:
    """ca.pem (a throwaway CA), cert.pem and key.pem (a server certificate it signed for 127.0.0.1 and localhost),
    and certs/ca.crt (the CA again, the way skopeo's --dest-cert-dir wants it)."""
    ca_key, key = _new_key(), _new_key()
    ca = _certificate("dsec test CA", ca_key, None, ca_key, ca=True, server=False)
    cert = _certificate("127.0.0.1", key, ca, ca_key, ca=False, server=True)
    (directory / "certs").mkdir(parents=True, exist_ok=True)
    for name in ("ca.pem", "certs/ca.crt"):
        (directory / name).write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "key.pem").write_bytes(_pem_key(key))


def bcrypt_hash(password: str, cost: int = 5) -> str:
    """A bcrypt hash ("$2b$...") for an htpasswd line, from glibc's libcrypt (libxcrypt: crypt_gensalt, crypt); no
    Python bcrypt module or apache2-utils needed."""
    lib = ctypes.CDLL("libcrypt.so.1")
    lib.crypt_gensalt.restype = ctypes.c_char_p
    lib.crypt_gensalt.argtypes = [ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p, ctypes.c_int]
    lib.crypt.restype = ctypes.c_char_p
    lib.crypt.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    salt = lib.crypt_gensalt(b"$2b$", cost, None, 0)
    hashed = lib.crypt(password.encode(), salt) if salt else None
    if not hashed or not hashed.startswith(b"$2b$"):
        raise RuntimeError("libcrypt made no bcrypt hash")
    return str(hashed.decode())


_LIVE: set[Registry | HostileRegistry] = set()  # started and not stopped: the atexit hook stops them


def _stop_leftovers() -> None:
    for server in list(_LIVE):
        try:
            server.stop()
        except Exception:  # noqa: BLE001 - at exit, stop the others whatever this one did
            pass


atexit.register(_stop_leftovers)


class _Server(http.server.ThreadingHTTPServer):
    """A threading HTTP server on a free loopback port that can end every connection it has open (stop() does, so
    that no handler thread is left blocked on a client); server_close() joins the handler threads."""

    daemon_threads = False

    def __init__(self, handler: type[http.server.BaseHTTPRequestHandler], context: ssl.SSLContext | None = None):
        super().__init__(("127.0.0.1", 0), handler)
        self.context = context
        self.connections: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        if self.context is not None:  # the handshake happens at the handler thread's first read
            sock = self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        with self.lock:
            self.connections.add(sock)
        return sock, addr

    def shutdown_request(self, request: Any) -> None:
        with self.lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client that went away is no news
            super().handle_error(request, client_address)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.shutdown()
        with self.lock:
            for sock in self.connections:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self.server_close()
        self.thread.join()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), "Content-Type": "application/json",
                            **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


# --- the registry ------------------------------------------------------------------------------------------------

AccessPolicy = Callable[[Optional[str], str, str, list[str]], list[str]]
"""(user or None for anonymous, resource type, resource name, actions asked for) -> actions granted."""

TOKEN_SERVICE = "dsec-test-registry"
TOKEN_ISSUER = "dsec-test-issuer"
READY_USER_AGENT = "dsec-ready-probe"  # start()'s own requests; requests() leaves them out
# The registry's access log: the combined log format (gorilla/handlers) on its stdout.
_ACCESS_LINE = re.compile(r'^\S+ \S+ \S+ \[[^\]]*\] "(?P<method>\S+) (?P<uri>\S+) [^"]*" (?P<status>\d{3}) '
                          r'(?P<bytes>\d+|-) "[^"]*" "(?P<user_agent>[^"]*)"$')


class _TokenIssuer:
    """The token server of an auth="token" registry (see the module's doc)."""

    def __init__(self, users: dict[str, str], access: AccessPolicy, lifetime: int, directory: pathlib.Path,
                 context: ssl.SSLContext | None):
        self.users = users
        self.access = access
        self.lifetime = lifetime
        self.log: list[dict[str, Any]] = []
        self.key = _new_key()
        self.pem_key = _pem_key(self.key).decode()
        self.cert = _certificate("dsec test token signer", self.key, None, self.key, ca=True, server=False)
        self.bundle = directory / "token-signer.pem"
        self.bundle.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        issuer = self

        class Handler(_Handler):
            def do_GET(self) -> None:
                issuer.answer(self)

        self.server = _Server(Handler, context)
        self.realm = f"{'https' if context else 'http'}://127.0.0.1:{self.server.server_address[1]}/token"
        self.server.start()

    def answer(self, request: _Handler) -> None:
        url = urllib.parse.urlsplit(request.path)
        if url.path != "/token":
            return request.reply(404, b'{"details":"not found"}')
        query = urllib.parse.parse_qs(url.query)
        scopes = query.get("scope", [])
        entry: dict[str, Any] = {"user": None, "scopes": scopes, "service": query.get("service", [""])[0]}
        with self.server.lock:
            self.log.append(entry)
        header = request.headers.get("Authorization", "")
        if header.lower().startswith("basic "):
            try:
                user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
            except ValueError:  # not base64, not UTF-8
                user, password = "", ""
            if user not in self.users or self.users[user] != password:
                entry.update(user=user, status=401)
                return request.reply(401, b'{"details":"incorrect username or password"}',
                                     {"WWW-Authenticate": 'Basic realm="dsec test token issuer"'})
            entry["user"] = user
        access = []
        for scope in scopes:
            for item in scope.split(" "):
                kind, _, rest = item.partition(":")
                name, _, actions = rest.rpartition(":")
                access.append({"type": kind, "name": name,
                               "actions": self.access(entry["user"], kind, name, actions.split(","))})
        now = int(time.time())
        claims = {"iss": TOKEN_ISSUER, "sub": entry["user"] or "", "aud": entry["service"] or TOKEN_SERVICE,
                  "exp": now + self.lifetime, "nbf": now - 1, "iat": now, "jti": secrets.token_hex(16),
                  "access": access}
        x5c = [base64.b64encode(self.cert.public_bytes(serialization.Encoding.DER)).decode()]
        token = jwt.encode(claims, self.pem_key, algorithm="ES256", headers={"x5c": x5c})
        entry.update(status=200, access=access)
        request.reply(200, _json_bytes({"token": token, "access_token": token, "expires_in": self.lifetime,
                                        "issued_at": datetime.datetime.fromtimestamp(now, datetime.timezone.utc)
                                        .strftime("%Y-%m-%dT%H:%M:%SZ")}))


class Registry:
    """A private docker-registry on 127.0.0.1 (see the module's doc)."""

    def __init__(self, *, auth: str | None = None, users: dict[str, str] | None = None, tls: bool = False,
                 anonymous_pull: bool = False, access: AccessPolicy | None = None, token_lifetime: int = 300,
                 storage_dir: str | os.PathLike[str] | None = None, registry: str = REGISTRY,
                 start_timeout: float = 10.0):
        """auth: None (anyone pushes and pulls), "htpasswd" (basic auth, the `users` given) or "token" (bearer
        tokens from the module's issuer; access decides what each is granted, default: users get whatever they ask
        for, anonymous gets pull on repositories if anonymous_pull). token_lifetime is the tokens' exp - iat in
        seconds (the registry allows 60 s of leeway past exp). storage_dir, when given, is kept at stop()."""
        if auth not in (None, "htpasswd", "token"):
            raise ValueError(f"auth is None, 'htpasswd' or 'token', not {auth!r}")
        if anonymous_pull and auth != "token":
            raise ValueError("anonymous_pull is for auth='token' (the registry's htpasswd mode has no anonymous)")
        self.auth = auth
        self.users = dict(users or {})
        self.tls = tls
        self.anonymous_pull = anonymous_pull
        self.access = access or self._default_access
        self.token_lifetime = token_lifetime
        self.registry = registry
        self.start_timeout = start_timeout
        self.prefix = pathlib.Path(tempfile.mkdtemp(prefix="dsec-registry-"))
        self._own_storage = storage_dir is None
        self.storage_dir = pathlib.Path(storage_dir).resolve() if storage_dir else self.prefix / "storage"
        self.process: subprocess.Popen[bytes] | None = None
        self.issuer: _TokenIssuer | None = None
        # The port, held (bound with SO_REUSEADDR, never listening) from here to stop(): see the module's doc.
        self._port_holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._port_holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._port_holder.bind(("127.0.0.1", 0))
        self.port: int = self._port_holder.getsockname()[1]

    def _default_access(self, user: str | None, kind: str, name: str, actions: list[str]) -> list[str]:
        if user is not None:
            return actions
        return [a for a in actions if a == "pull"] if self.anonymous_pull and kind == "repository" else []

    # --- where it is ---
    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}"

    @property
    def ca_file(self) -> str | None:
        """The CA certificate (PEM) a client trusts for this registry and its token issuer (tls=True), else None."""
        return str(self.prefix / "tls" / "ca.pem") if self.tls else None

    @property
    def cert_dir(self) -> str | None:
        """A directory holding the CA as ca.crt (skopeo's --*-cert-dir), tls=True only."""
        return str(self.prefix / "tls" / "certs") if self.tls else None

    @property
    def realm(self) -> str | None:
        """The token issuer's URL (auth="token"), after start()."""
        return self.issuer.realm if self.issuer else None

    @property
    def log_file(self) -> pathlib.Path:
        """The registry's own log (json lines, its stderr)."""
        return self.prefix / "registry.log"

    @property
    def access_log(self) -> pathlib.Path:
        return self.prefix / "access.log"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def blob_path(self, digest: str) -> pathlib.Path:
        """Where the registry keeps this blob's bytes (whether or not it has it)."""
        algorithm, hex_ = digest.split(":", 1)
        return self.storage_dir / "docker/registry/v2/blobs" / algorithm / hex_[:2] / hex_ / "data"

    # --- the token issuer ---
    @property
    def token_requests(self) -> int:
        """How many requests the token issuer has had (all answers, 401s included)."""
        return len(self.issuer.log) if self.issuer else 0

    @property
    def token_log(self) -> list[dict[str, Any]]:
        """One dict per issuer request, oldest first: user (None: anonymous), scopes (the scope parameters),
        service, status, access (what the token granted, 200s only)."""
        return list(self.issuer.log) if self.issuer else []

    # --- lifecycle ---
    def start(self) -> Registry:
        """Starts the registry (again, on the same port and storage, after kill()) and waits until GET /v2/
        answers 200 or 401."""
        if self.running:
            return self
        if self._port_holder.fileno() < 0:
            raise RuntimeError("this registry was stopped; make a new one")
        reason = skip_reason()
        if reason:
            raise RuntimeError(reason)
        config = self.prefix / "config.yml"
        if not config.exists():
            self._prepare()
            config.write_bytes(_json_bytes(self._config()))  # JSON is YAML
        _LIVE.add(self)
        with open(self.log_file, "ab") as log, open(self.access_log, "ab") as access:
            self.process = subprocess.Popen(
                [SETPRIV, "--pdeathsig", "KILL", "--", self.registry, "serve", str(config)],
                stdin=subprocess.DEVNULL, stdout=access, stderr=log, cwd=self.prefix, start_new_session=True,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(self.prefix)})
        self._wait_ready()
        return self

    def _prepare(self) -> None:
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        context = None
        if self.tls:
            _write_tls_material(self.prefix / "tls")
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(self.prefix / "tls" / "cert.pem", self.prefix / "tls" / "key.pem")
        if self.auth == "htpasswd":
            (self.prefix / "htpasswd").write_text("".join(f"{user}:{bcrypt_hash(password)}\n"
                                                          for user, password in self.users.items()))
        elif self.auth == "token":
            self.issuer = _TokenIssuer(self.users, self.access, self.token_lifetime, self.prefix, context)

    def _config(self) -> dict[str, Any]:
        http_config: dict[str, Any] = {"addr": self.host, "secret": secrets.token_hex(16),
                                       "headers": {"X-Content-Type-Options": ["nosniff"]}}
        if self.tls:
            http_config["tls"] = {"certificate": str(self.prefix / "tls" / "cert.pem"),
                                  "key": str(self.prefix / "tls" / "key.pem")}
        config: dict[str, Any] = {
            "version": "0.1",
            "log": {"level": "info", "formatter": "json", "accesslog": {"disabled": False}},
            "storage": {"filesystem": {"rootdirectory": str(self.storage_dir)}, "delete": {"enabled": True},
                        "maintenance": {"uploadpurging": {"enabled": False}}},
            "http": http_config,
            "health": {"storagedriver": {"enabled": False}},
        }
        if self.auth == "htpasswd":
            config["auth"] = {"htpasswd": {"realm": "dsec-test-registry", "path": str(self.prefix / "htpasswd")}}
        elif self.issuer is not None:
            config["auth"] = {"token": {"realm": self.issuer.realm, "service": TOKEN_SERVICE,
                                        "issuer": TOKEN_ISSUER, "rootcertbundle": str(self.issuer.bundle)}}
        return config

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"docker-registry exited with {self.process.returncode} at start:\n"
                                   f"{self.log_tail()}")
            try:
                if self.tls:
                    conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                        "127.0.0.1", self.port, timeout=1, context=ssl.create_default_context(cafile=self.ca_file))
                else:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1)
                try:
                    conn.request("GET", "/v2/", headers={"User-Agent": READY_USER_AGENT})
                    if conn.getresponse().status in (200, 401):
                        return
                finally:
                    conn.close()
            except OSError:
                pass
            time.sleep(0.01)
        self._kill_group()
        raise RuntimeError(f"docker-registry did not answer on {self.host} within {self.start_timeout}s:\n"
                           f"{self.log_tail()}")

    def kill(self) -> None:
        """The registry dies at once (SIGKILL): transfers in flight are cut, new connections refused. Storage,
        logs, the port and the token issuer stay; start() brings it back."""
        self._kill_group()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the process group after a few seconds; stops the token issuer, frees the port
        and removes the private directory (storage too, unless storage_dir was given)."""
        if self.running:
            assert self.process is not None
            try:
                self.process.send_signal(signal.SIGTERM)
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._kill_group()
        if self.issuer is not None:
            self.issuer.server.stop()
        self._port_holder.close()
        shutil.rmtree(self.prefix, ignore_errors=True)
        if self._own_storage:
            shutil.rmtree(self.storage_dir, ignore_errors=True)
        _LIVE.discard(self)

    def _kill_group(self) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.01)
        raise RuntimeError(f"docker-registry process group {self.process.pid} still has members after SIGKILL")

    def __enter__(self) -> Registry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- what it saw ---
    def requests(self) -> list[dict[str, Any]]:
        """One dict per request the registry answered (its access log, 401s included), oldest first: method, uri,
        status (int), bytes_sent (int, body bytes), user_agent. The line is written just after the response, so a
        client can have its answer a moment before it is there."""
        try:
            lines = self.access_log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            match = _ACCESS_LINE.match(line)
            if match and match["user_agent"] != READY_USER_AGENT:
                out.append({"method": match["method"], "uri": match["uri"], "status": int(match["status"]),
                            "bytes_sent": int(match["bytes"]) if match["bytes"].isdigit() else 0,
                            "user_agent": match["user_agent"]})
        return out

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


def _dir_transport_view(layout: OciLayout, top: Descriptor, directory: pathlib.Path) -> None:
    """skopeo's dir: transport layout of a manifest or index (manifest.json, <hex>.manifest.json per image of an
    index, <hex> per blob) made of symlinks to the layout's blobs."""
    directory.mkdir()
    (directory / "version").write_text("Directory Transport Version: 1.1\n")
    (directory / "manifest.json").symlink_to(layout.blob_path(top.digest))
    manifests = [top.digest]
    if top.media_type in _INDEX_TYPES:
        manifests = [m["digest"] for m in json.loads(layout.blob_path(top.digest).read_bytes())["manifests"]]
        for digest in manifests:
            (directory / f"{digest.split(':', 1)[1]}.manifest.json").symlink_to(layout.blob_path(digest))
    for digest in manifests:
        doc = json.loads(layout.blob_path(digest).read_bytes())
        for blob in [doc["config"], *doc["layers"]]:
            link = directory / blob["digest"].split(":", 1)[1]
            if not link.is_symlink():
                link.symlink_to(layout.blob_path(blob["digest"]))


def push(layout_dir: str | os.PathLike[str], tag: str, registry: Registry, repo: str, *,
         dest_tag: str | None = None, creds: tuple[str, str] | None = None, all_platforms: bool | None = None,
         extra_args: Sequence[str] = (), timeout: float = 120.0) -> str:
    """Pushes the layout's `tag` to registry/repo:dest_tag (default: the same tag) with skopeo and returns the
    manifest digest the registry has it under (skopeo's --digestfile). Blobs and manifests go as they are
    (--preserve-digests: skopeo fails rather than recompress or convert anything). An index goes with every image
    in it (--all; all_platforms=None decides from index.json's media type). creds are basic credentials (for
    htpasswd, or given to the token issuer); without them skopeo is anonymous. skopeo's own configuration (auth
    files, policy) is kept out: HOME is a temp dir and --insecure-policy is given.

    An OCI manifest or index is copied from oci:DIR:TAG. skopeo's oci: transport skips index.json entries of
    Docker media types, so a Docker one is copied from a dir: view of it (symlinks to the layout's blobs)."""
    layout = OciLayout(layout_dir)
    tags = layout.tags()
    if tag not in tags:
        raise KeyError(f"{layout.dir} has no tag {tag!r} (it has {sorted(tags)})")
    if all_platforms is None:
        all_platforms = tags[tag].media_type in _INDEX_TYPES
    with tempfile.TemporaryDirectory(prefix="dsec-skopeo-") as home:
        digest_file = pathlib.Path(home) / "digest"
        source = f"oci:{layout.dir}:{tag}"
        if tags[tag].media_type in (DOCKER_MANIFEST, DOCKER_LIST):
            _dir_transport_view(layout, tags[tag], pathlib.Path(home) / "dir")
            source = f"dir:{home}/dir"
        args = [SKOPEO, "--insecure-policy", "copy", "--quiet", "--preserve-digests",
                "--digestfile", str(digest_file), f"--dest-tls-verify={'true' if registry.tls else 'false'}"]
        if registry.cert_dir:
            args += ["--dest-cert-dir", registry.cert_dir]
        args += ["--dest-creds", f"{creds[0]}:{creds[1]}"] if creds else ["--dest-no-creds"]
        if all_platforms:
            args.append("--all")
        args += [*extra_args, source, f"docker://{registry.host}/{repo}:{dest_tag or tag}"]
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": home, "XDG_RUNTIME_DIR": home,
               "REGISTRY_AUTH_FILE": str(pathlib.Path(home) / "auth.json"), "TMPDIR": home}
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"skopeo copy failed ({done.returncode}): {' '.join(args)}\n{done.stderr}")
        return digest_file.read_text().strip()


# --- a registry that lies ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Status:
    """Answers this status (with these headers and body) instead of the truth: 429 with Retry-After, 5xx, 404..."""
    code: int
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    body: bytes = b""


@dataclasses.dataclass(frozen=True)
class Unauthorized:
    """401 with a bearer challenge (realm: the server's own /token, which hands out tokens nothing accepts)."""


@dataclasses.dataclass(frozen=True)
class Redirect:
    """A redirect (307 unless told) to `url`, e.g. the same path on another HostileRegistry."""
    url: str
    code: int = 307


@dataclasses.dataclass(frozen=True)
class Body:
    """These bytes (and headers, over the usual ones) instead of whatever the path holds, existing or not."""
    data: bytes
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Corrupt:
    """The real content with its middle byte flipped: same length, another digest."""


@dataclasses.dataclass(frozen=True)
class Cut:
    """The real headers (full Content-Length), `after` bytes of the body, then the connection closes: a FIN, or an
    RST with reset=True."""
    after: int
    reset: bool = False


@dataclasses.dataclass(frozen=True)
class Endless:
    """200 with no Content-Length and zero bytes forever, `rate` bytes a second (None: as fast as it goes), until
    the client goes away or the server stops."""
    rate: int | None = None


@dataclasses.dataclass(frozen=True)
class Stall:
    """The real headers and `after` bytes of the body, then nothing, until the client goes or the server stops."""
    after: int = 0


@dataclasses.dataclass(frozen=True)
class Throttle:
    """The real answer, `rate` bytes a second."""
    rate: int


@dataclasses.dataclass(frozen=True)
class IgnoreRange:
    """200 and the whole body, whatever Range asked for."""


Behaviour = Union[Status, Unauthorized, Redirect, Body, Corrupt, Cut, Endless, Stall, Throttle, IgnoreRange]


@dataclasses.dataclass
class Rule:
    """A behaviour for the requests whose path matches `pattern` (fnmatch) and whose method is `method` (None:
    any), `times` times (None: always). fired counts the requests it took."""
    pattern: str
    behaviour: Behaviour
    times: int | None = None
    method: str | None = None
    fired: int = 0


_PATH = re.compile(r"^/v2/(?P<name>.+)/(?P<kind>manifests|blobs)/(?P<ref>[^/]+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class _Content:
    """What a path holds: bytes, or a file read in chunks."""

    def __init__(self, media_type: str, digest: str, data: bytes | None = None, path: pathlib.Path | None = None):
        self.media_type, self.digest, self.data, self.path = media_type, digest, data, path
        self.size = len(data) if data is not None else (path.stat().st_size if path else 0)

    def chunks(self, start: int, end: int, flip: int | None) -> Iterable[bytes]:
        """Bytes [start, end), with byte `flip` inverted."""
        with open(self.path, "rb") if self.path else io.BytesIO(self.data or b"") as f:
            f.seek(start)
            pos = start
            while pos < end and (chunk := f.read(min(_CHUNK, end - pos))):
                if flip is not None and pos <= flip < pos + len(chunk):
                    mutable = bytearray(chunk)
                    mutable[flip - pos] ^= 0xFF
                    chunk = bytes(mutable)
                yield chunk
                pos += len(chunk)


class HostileRegistry:
    """A registry on 127.0.0.1 serving an OCI layout's images over http, and lying when told to (see the module's
    doc). Its port is bound when it is made. `requests` holds one dict per request, oldest first: method, path,
    range ("" when none), headers (lower-case names), status (the answer's, known when it begins: a stream that
    never ends is there while it runs). `rules` are the rules in force, in order."""

    def __init__(self, layout: OciLayout | str | os.PathLike[str]):
        self.layout = layout if isinstance(layout, OciLayout) else OciLayout(layout)
        self.rules: list[Rule] = []
        self.requests: list[dict[str, Any]] = []
        hostile = self

        class Handler(_Handler):
            def do_GET(self) -> None:
                hostile._serve(self)

            do_HEAD = do_GET

            def do_other(self) -> None:
                self.close_connection = True
                hostile._record(self, 405)
                self.reply(405, b'{"errors":[{"code":"UNSUPPORTED","message":"read-only"}]}',
                           {"Connection": "close"})

            do_PUT = do_POST = do_PATCH = do_DELETE = do_other

        self.server = _Server(Handler)
        self.port: int = self.server.server_address[1]
        self._started = False

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def start(self) -> HostileRegistry:
        if not self._started:
            self._started = True
            _LIVE.add(self)
            self.server.start()
        return self

    def stop(self) -> None:
        """Ends every connection (streams in flight too), stops serving and joins every thread it ran."""
        if self._started:
            self.server.stop()
        else:
            self.server.server_close()
        _LIVE.discard(self)

    def __enter__(self) -> HostileRegistry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def on(self, pattern: str, behaviour: Behaviour, *, times: int | None = None, method: str | None = None) -> Rule:
        """Adds a rule (after those already there) and returns it. A HEAD matches too unless method="GET"."""
        rule = Rule(pattern, behaviour, times, method)
        with self.server.lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Forgets every rule and request."""
        with self.server.lock:
            self.rules.clear()
            self.requests.clear()

    def count(self, pattern: str = "*", method: str | None = None) -> int:
        """How many requests had a path matching `pattern` (and that method)."""
        with self.server.lock:
            return sum(1 for r in self.requests
                       if fnmatch.fnmatchcase(r["path"], pattern) and method in (None, r["method"]))

    # --- serving ---
    def _record(self, request: _Handler, status: int) -> None:
        with self.server.lock:
            self.requests.append({"method": request.command, "path": urllib.parse.urlsplit(request.path).path,
                                  "range": request.headers.get("Range", ""), "status": status,
                                  "headers": {k.lower(): v for k, v in request.headers.items()}})

    def _rule(self, method: str, path: str) -> Behaviour | None:
        with self.server.lock:
            for rule in self.rules:
                if rule.method not in (None, method) or not fnmatch.fnmatchcase(path, rule.pattern):
                    continue
                if rule.times is not None and rule.fired >= rule.times:
                    continue
                rule.fired += 1
                return rule.behaviour
        return None

    def _content(self, path: str) -> _Content | None:
        match = _PATH.match(path)
        if not match:
            return None
        ref = match["ref"]
        if match["kind"] == "manifests" and not ref.startswith("sha256:"):
            desc = self.layout.tags().get(ref)
            return _Content(desc.media_type, desc.digest, path=self.layout.blob_path(desc.digest)) if desc else None
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", ref) or not self.layout.blob_path(ref).is_file():
            return None
        content = _Content("application/octet-stream", ref, path=self.layout.blob_path(ref))
        if match["kind"] == "manifests":
            content.media_type = OCI_MANIFEST
            if content.size < _CHUNK:  # a manifest's type is its mediaType field, if it has one
                try:
                    content.media_type = json.loads(self.layout.blob_path(ref).read_bytes())["mediaType"]
                except (ValueError, KeyError, TypeError):
                    pass
        return content

    def _serve(self, request: _Handler) -> None:
        path = urllib.parse.urlsplit(request.path).path
        if path == "/token":  # Unauthorized's realm: rules do not apply
            self._record(request, 200)
            return request.reply(200, b'{"token":"never-accepted","access_token":"never-accepted","expires_in":60}')
        behaviour = self._rule(request.command, path)
        api = {"Docker-Distribution-API-Version": "registry/2.0"}
        if isinstance(behaviour, Status):
            self._record(request, behaviour.code)
            return request.reply(behaviour.code, behaviour.body, {**api, **behaviour.headers})
        if isinstance(behaviour, Unauthorized):
            self._record(request, 401)
            match = _PATH.match(path)
            scope = f',scope="repository:{match["name"]}:pull"' if match else ""
            return request.reply(401, b'{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}',
                                 {**api, "WWW-Authenticate": f'Bearer realm="{self.url}/token",service="hostile"'
                                                             f'{scope}'})
        if isinstance(behaviour, Redirect):
            self._record(request, behaviour.code)
            return request.reply(behaviour.code, b"", {**api, "Location": behaviour.url})
        if path == "/v2/" and not isinstance(behaviour, Body):
            self._record(request, 200)
            return request.reply(200, b"{}", api)
        content = self._content(path)
        if isinstance(behaviour, Body):
            content = _Content(OCI_MANIFEST if "/manifests/" in path else "application/octet-stream",
                               sha256_digest(behaviour.data), data=behaviour.data)
        if content is None:
            self._record(request, 404)
            code = "MANIFEST_UNKNOWN" if "/manifests/" in path else "BLOB_UNKNOWN" if "/blobs/" in path else "NOT_FOUND"
            return request.reply(404, _json_bytes({"errors": [{"code": code, "message": "unknown"}]}), api)
        headers = {**api, "Content-Type": content.media_type, "Docker-Content-Digest": content.digest,
                   "Accept-Ranges": "bytes"}
        if isinstance(behaviour, Body):
            headers.update(behaviour.headers)
        status, start, end = 200, 0, content.size
        ranged = _RANGE.match(request.headers.get("Range", "").strip())
        if ranged and not isinstance(behaviour, (IgnoreRange, Endless)):
            start = int(ranged[1])
            end = min(int(ranged[2]) + 1, content.size) if ranged[2] else content.size
            if start >= content.size or start >= end:
                self._record(request, 416)
                return request.reply(416, b"", {**api, "Content-Range": f"bytes */{content.size}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{content.size}"
        self._record(request, status)
        request.send_response(status)
        if isinstance(behaviour, Endless):
            headers["Connection"] = "close"
            request.close_connection = True
        else:
            headers["Content-Length"] = str(end - start)
        for name, value in headers.items():
            request.send_header(name, value)
        request.end_headers()
        if request.command == "HEAD":
            return
        try:
            self._send_body(request, content, start, end, behaviour)
        except OSError:  # the client went away
            request.close_connection = True

    def _send_body(self, request: _Handler, content: _Content, start: int, end: int,
                   behaviour: Behaviour | None) -> None:
        stopping = self.server.stopping
        if isinstance(behaviour, Endless):
            chunk = bytes(65536 if behaviour.rate is None else max(1, min(65536, behaviour.rate // 10)))
            while not stopping.is_set():
                request.wfile.write(chunk)
                if behaviour.rate:
                    stopping.wait(len(chunk) / behaviour.rate)
            return
        limit = end
        if isinstance(behaviour, (Cut, Stall)):
            limit = min(end, start + behaviour.after)
        flip = content.size // 2 if isinstance(behaviour, Corrupt) and content.size else None
        step = max(1, behaviour.rate // 10) if isinstance(behaviour, Throttle) else _CHUNK
        for chunk in content.chunks(start, limit, flip):
            for i in range(0, len(chunk), step):
                request.wfile.write(chunk[i:i + step])
                if isinstance(behaviour, Throttle) and stopping.wait(step / behaviour.rate):
                    raise ConnectionAbortedError("the server is stopping")
        if isinstance(behaviour, Cut):
            request.close_connection = True
            if behaviour.reset:
                request.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                request.connection.close()
        elif isinstance(behaviour, Stall):
            request.close_connection = True
            while not stopping.is_set():  # until the client closes (readable at EOF) or the server stops
                readable, _, _ = select.select([request.connection], [], [], 0.05)
                if readable and not request.connection.recv(65536):
                    return
