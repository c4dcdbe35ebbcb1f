"""Images straight from OCI registries (docs/images.md): a real docker-registry on loopback (oci_registry.py), images
built here as OCI layouts and pushed with skopeo, imported by the agent on first use or by `dsec image pull`.

What is checked: a create of a registry image runs with the image's configuration (Env, WorkingDir, User) under the
spec's own; whiteouts and opaque directories of upper layers hide lower files; layers shared by two images are
converted and fetched once; concurrent creates of an image not yet imported import it once; zstd layers, Docker
media types and multi-platform indexes; basic auth, bearer tokens and TLS with the CLI; and each failure (a missing
tag or platform, bad credentials, a corrupted blob, a registry that dies mid-pull, a hostile layer, a full disk)
gives its own error, leaves no tag and no scratch file, and a rerun then succeeds.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import tarfile
import tempfile
import time

import pytest

import dsec_testlib as lib
import oci_registry as oci

pytestmark = pytest.mark.skipif(oci.skip_reason() is not None, reason=oci.skip_reason() or "")

DSEC = str(lib.DSEC_CLI)
BUSYBOX = pathlib.Path("/bin/busybox").read_bytes()


def base_entries(marker: str):
    """A tiny system: busybox with the applets the tests call, /etc/passwd with alice, and directories the upper
    layers change."""
    entries = [oci.directory("bin"), oci.file("bin/busybox", BUSYBOX, mode=0o755)]
    entries += [oci.symlink(f"bin/{a}", "busybox") for a in ("sh", "ls", "cat", "id", "pwd", "env", "echo", "test")]
    entries += [oci.directory("etc"),
                oci.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\n"),
                oci.file("etc/group", b"root:x:0:\nalice:x:1000:\n"),
                oci.directory("tmp", mode=0o1777), oci.directory("root", mode=0o700),
                oci.directory("home"), oci.directory("home/alice", uid=1000, gid=1000),
                oci.file("base-marker", marker.encode()),
                oci.directory("old"), oci.file("old/gone", b"x"), oci.file("old/kept", b"kept"),
                oci.directory("olddir"), oci.file("olddir/f", b"x"),
                oci.directory("opq"), oci.file("opq/lower", b"lower"),
                oci.file("replaced", b"lower version")]
    return entries


TOOL = b"#!/bin/sh\necho tool from conda\n"
CONFIG = {"Env": ["PATH=/opt/conda/bin:/bin", "GREETING=from-image", "LANG=C.UTF-8"], "WorkingDir": "/work",
          "User": "alice", "Entrypoint": ["/bin/sh", "-c"], "Cmd": ["echo hello"], "ExposedPorts": {"8080/tcp": {}},
          "Labels": {"suite": "registry"}, "StopSignal": "SIGINT"}


@pytest.fixture(scope="module")
def layout():
    d = tempfile.mkdtemp(prefix="dsec-oci-layout-")
    lay = oci.OciLayout(d)
    base = lay.add_layer(base_entries("base-1"))
    upper = lay.add_layer([oci.whiteout("old/gone"), oci.whiteout("olddir"), oci.opaque("opq"),
                           oci.file("opq/upper", b"upper"), oci.file("replaced", b"upper version"),
                           oci.directory("work", uid=1000, gid=1000), oci.directory("opt"),
                           oci.directory("opt/conda"), oci.directory("opt/conda/bin"),
                           oci.file("opt/conda/bin/tool", TOOL, mode=0o755)])
    lay.add_image([base, upper], CONFIG, tag="app")
    # A second image on the same base: only its own layer is new.
    other = lay.add_layer([oci.file("other.txt", b"other image\n")], compression="zstd")
    lay.add_image([base, other], {"Env": ["PATH=/bin"]}, tag="other")
    # Docker's media types, and a multi-platform index (amd64 and arm64), and an index with arm64 only.
    lay.add_image([base, lay.add_layer([oci.file("docker.txt", b"docker types\n")])], {"Env": ["PATH=/bin"]},
                  tag="docker", media_types="docker")
    amd = lay.add_image([base, lay.add_layer([oci.file("arch", b"amd64\n")])], {"Env": ["PATH=/bin"]})
    arm = lay.add_image([base, lay.add_layer([oci.file("arch", b"arm64\n")])], {"Env": ["PATH=/bin"]},
                        platform=("linux", "arm64", "v8"))
    lay.add_index([amd, arm], tag="multi")
    lay.add_index([arm], tag="armonly")
    lay.base = base  # type: ignore[attr-defined]
    lay.upper = upper  # type: ignore[attr-defined]
    yield lay
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def registry(layout):
    r = oci.Registry().start()
    for tag in ("app", "other", "docker", "multi", "armonly"):
        oci.push(layout.dir, tag, r, "team/app", dest_tag=tag)
    yield r
    r.stop()


def blob_gets(registry, digest: str) -> int:
    return sum(1 for q in registry.requests() if q["method"] == "GET" and q["uri"].endswith(f"/blobs/{digest}")
               and q["status"] in (200, 206))


def run(sb, cmd: str, **kw) -> str:
    r = sb.exec(["/bin/sh", "-c", cmd], **kw)
    assert r.exit_code == 0, (cmd, r.exit_code, r.stdout, r.stderr)
    return r.stdout.decode()


def test_a_registry_image_runs_with_its_config_and_its_layers_stacked(client, registry, layout):
    ref = f"{registry.host}/team/app:app"
    with client.create(image=ref, ttl=300, memory="128Mi") as sb:
        assert sb.info().image.startswith(ref + "@sha256:")
        assert sb.info().image_command == ["/bin/sh", "-c", "echo hello"]
        assert run(sb, "pwd; id -u; echo $GREETING; tool") == "/work\n1000\nfrom-image\ntool from conda\n"
        # Whiteouts, an opaque directory and a replaced file of the upper layer hide the base's files.
        out = run(sb, "ls /old; test -e /olddir || echo no-olddir; ls /opq; cat /replaced /base-marker")
        assert out == "kept\nno-olddir\nupper\nupper versionbase-1"
        # An exec's own user and cwd still win.
        r = sb.exec(["id", "-u"], user="root", cwd="/tmp")
        assert r.stdout == b"0\n"
    # The spec's own env, workdir and user win over the image's.
    with client.create(image=ref, ttl=300, memory="128Mi", env={"GREETING": "mine"}, workdir="/tmp",
                       user="root") as sb:
        assert run(sb, "pwd; id -u; echo $GREETING; echo $PATH") == "/tmp\n0\nmine\n/opt/conda/bin:/bin\n"


def test_dsec_run_without_a_command_runs_the_images_entrypoint_and_cmd(agent, registry):
    out = cli("--endpoint", agent.endpoint, "run", "--memory", "64Mi", f"{registry.host}/team/app:app")
    assert out.stdout == "hello\n"
    # An image that names no command: the usage error says so.
    out = cli("--endpoint", agent.endpoint, "run", "--memory", "64Mi", f"{registry.host}/team/app:other", check=False)
    assert out.returncode == 2 and "names none (no Entrypoint or Cmd)" in out.stderr, out


def test_shared_layers_are_converted_and_fetched_once(client, registry, layout, image_home):
    # The app image (test above, or now) and then the other image share the base layer.
    with client.create(image=f"{registry.host}/team/app:app", ttl=120, memory="128Mi"):
        pass
    with client.create(image=f"{registry.host}/team/app:other", ttl=120, memory="128Mi") as sb:
        assert run(sb, "cat /other.txt /base-marker") == "other image\nbase-1"
    assert blob_gets(registry, layout.base.digest) == 1
    refs = os.listdir(os.path.join(image_home, "store", "refs"))
    base_hex = layout.base.digest.split(":")[1]
    assert sum(1 for r in refs if base_hex in r) == 1, refs


def test_concurrent_creates_of_a_new_image_import_it_once(client, registry, layout):
    lay = oci.OciLayout(tempfile.mkdtemp(prefix="dsec-oci-burst-"))
    layer = lay.add_layer(base_entries("burst") + [oci.zeros("big", 4 << 20)])
    lay.add_image([layer], {"Env": ["PATH=/bin"]}, tag="burst")
    oci.push(lay.dir, "burst", registry, "team/burst")
    ref = f"{registry.host}/team/burst:burst"

    def create_one(_):
        sb = client.create(image=ref, ttl=120, memory="64Mi", cpu=0.05)
        try:
            return sb.exec(["cat", "/base-marker"]).stdout
        finally:
            sb.destroy()

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        outs = list(pool.map(create_one, range(20)))
    assert outs == [b"burst"] * 20
    assert blob_gets(registry, layer.digest) == 1


def test_docker_media_types_zstd_and_indexes(client, registry):
    with client.create(image=f"{registry.host}/team/app:docker", ttl=120, memory="64Mi") as sb:
        assert run(sb, "cat /docker.txt") == "docker types\n"
    with client.create(image=f"{registry.host}/team/app:multi", ttl=120, memory="64Mi") as sb:
        assert run(sb, "cat /arch") == "amd64\n"
    with pytest.raises(lib.dsec.NotFound, match=r"no linux/amd64 image; it has: linux/arm64/v8"):
        client.create(image=f"{registry.host}/team/app:armonly", ttl=60)


def test_a_missing_tag_or_repository_is_not_found_naming_it(client, registry):
    with pytest.raises(lib.dsec.NotFound, match=r"team/app:nope"):
        client.create(image=f"{registry.host}/team/app:nope", ttl=60)
    with pytest.raises(lib.dsec.NotFound, match=r"nobody/here"):
        client.create(image=f"{registry.host}/nobody/here:v1", ttl=60)


def cli(*args, env=None, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run([DSEC, *args], capture_output=True, text=True, timeout=300, env=env)
    if check:
        assert r.returncode == 0, (args, r.returncode, r.stdout, r.stderr)
    return r


@pytest.fixture
def store():
    d = tempfile.mkdtemp(prefix="dsec-it-pull-store-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def no_scratch_left(store_dir: str) -> None:
    tmp = pathlib.Path(store_dir) / ".tmp"
    left = [p.name for p in tmp.iterdir()] if tmp.exists() else []
    assert left == [], f"scratch files left in {tmp}: {left}"


def test_pull_with_basic_auth_and_a_docker_config(layout, store, tmp_path):
    r = oci.Registry(auth="htpasswd", users={"alice": "s3cret"}).start()
    try:
        oci.push(layout.dir, "app", r, "team/app", creds=("alice", "s3cret"))
        ref = f"{r.host}/team/app:app"
        home = tmp_path / "home"
        home.mkdir()
        env = dict(os.environ, HOME=str(home), DOCKER_CONFIG="")
        env.pop("DOCKER_CONFIG")
        out = cli("--store", store, "image", "pull", ref, env=env, check=False)
        assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr and "wants credentials" in out.stderr, out
        out = cli("--store", store, "image", "pull", ref, "--registry-auth", f"{r.host}=alice:wrong", env=env,
                  check=False)
        assert out.returncode == 1 and "refused the credentials" in out.stderr, out
        assert "s3cret" not in out.stderr and "wrong" not in out.stderr
        assert ref not in cli("--store", store, "image", "ls", env=env).stdout
        no_scratch_left(store)
        # Docker's own file.
        (home / ".docker").mkdir()
        auth = base64.b64encode(b"alice:s3cret").decode()
        (home / ".docker" / "config.json").write_text(json.dumps({"auths": {r.host: {"auth": auth}}}))
        out = cli("--store", store, "image", "pull", ref, env=env)
        assert f"pulled {ref}" in out.stdout
        inspect = json.loads(cli("--store", store, "image", "inspect", ref, env=env).stdout)
        assert inspect["config"]["working_dir"] == "/work" and inspect["config"]["user"] == "alice"
        assert inspect["config"]["exposed_ports"] == ["8080/tcp"] and inspect["schema"] == 2
        no_scratch_left(store)
    finally:
        r.stop()


def test_pull_through_a_bearer_token_service_over_tls(layout, store):
    r = oci.Registry(auth="token", users={"bob": "pw"}, tls=True).start()
    try:
        oci.push(layout.dir, "app", r, "team/app", creds=("bob", "pw"))
        ref = f"{r.host}/team/app:app"
        asked = r.token_requests
        # Without the CA the registry's certificate is not trusted: no plain-HTTP fallback hides that.
        out = cli("--store", store, "image", "pull", ref, "--registry-auth", f"{r.host}=bob:pw", check=False)
        assert out.returncode == 1 and "UNAVAILABLE" in out.stderr, out
        out = cli("--store", store, "image", "pull", ref, "--registry-auth", f"{r.host}=bob:pw", "--registry-ca",
                  r.ca_file)
        assert "2 layers (2 converted" in out.stdout, out.stdout
        assert r.token_requests > asked
        grants = [t for t in r.token_log if t.get("user") == "bob"]
        assert grants, r.token_log
    finally:
        r.stop()


def test_a_corrupted_blob_is_refused_and_a_rerun_succeeds(store):
    r = oci.Registry().start()
    try:
        lay = oci.OciLayout(tempfile.mkdtemp(prefix="dsec-oci-corrupt-"))
        layer = lay.add_layer(base_entries("corrupt"))
        lay.add_image([layer], {"Env": ["PATH=/bin"]}, tag="v1")
        oci.push(lay.dir, "v1", r, "team/corrupt")
        ref = f"{r.host}/team/corrupt:v1"
        blob = r.blob_path(layer.digest)
        good = blob.read_bytes()
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0xFF
        blob.write_bytes(bytes(bad))
        out = cli("--store", store, "image", "pull", ref, check=False)
        assert out.returncode == 1 and "FAILED_PRECONDITION" in out.stderr and layer.digest in out.stderr, out
        assert "not to the digest the manifest names" in out.stderr, out
        assert ref not in cli("--store", store, "image", "ls", "--all").stdout
        no_scratch_left(store)
        blob.write_bytes(good)
        assert f"pulled {ref}" in cli("--store", store, "image", "pull", ref).stdout
    finally:
        r.stop()


def test_a_cut_download_resumes_and_a_dead_registry_is_unavailable(layout, store):
    hostile = oci.HostileRegistry(layout).start()
    try:
        ref = f"{hostile.host}/team/app:app"
        base = layout.base
        hostile.on(f"*/blobs/{base.digest}", oci.Cut(after=base.size // 3), times=2, method="GET")
        out = cli("--store", store, "image", "pull", ref)
        assert "pulled" in out.stdout
        ranges = [q["range"] for q in hostile.requests if q["path"].endswith(base.digest) and q["method"] == "GET"]
        assert len(ranges) == 3 and ranges[0] in ("", None) and all(r.startswith("bytes=") for r in ranges[1:]), ranges
        no_scratch_left(store)
        # Overloaded and failing answers are retried (Retry-After honoured) until the real one comes.
        hostile.on("*/manifests/other", oci.Status(429, headers={"Retry-After": "1"}), times=1)
        hostile.on("*/manifests/other", oci.Status(503), times=1)
        assert "pulled" in cli("--store", store, "image", "pull", f"{hostile.host}/team/app:other").stdout
        asked = [q["status"] for q in hostile.requests if q["path"].endswith("/manifests/other")]
        assert asked[:3] == [429, 503, 200], asked
        # A registry that goes away for good: UNAVAILABLE after the retries, no tag, no scratch.
        hostile.stop()
        out = cli("--store", store, "image", "pull", f"{hostile.host}/team/app:docker", check=False)
        assert out.returncode == 1 and "UNAVAILABLE" in out.stderr, out
        no_scratch_left(store)
    finally:
        hostile.stop()


def test_hostile_layers_and_redirects_are_refused(store):
    lay = oci.OciLayout(tempfile.mkdtemp(prefix="dsec-oci-hostile-"))
    evil = tarfile.TarInfo("../escape")
    evil.size = 1
    lay.add_image([lay.add_layer([oci.raw(evil, b"x")])], {}, tag="dotdot")
    bomb = lay.add_layer([oci.zeros("bomb", 256 << 20)])
    lay.add_image([bomb], {}, tag="bomb")
    good = lay.add_layer(base_entries("good"))
    lay.add_image([good], {}, tag="redirect")
    hostile = oci.HostileRegistry(lay).start()
    other = oci.HostileRegistry(lay).start()
    try:
        out = cli("--store", store, "image", "pull", f"{hostile.host}/x/y:dotdot", check=False)
        assert out.returncode == 1 and "INVALID_ARGUMENT" in out.stderr and ".." in out.stderr, out
        out = cli("--store", store, "image", "pull", f"{hostile.host}/x/y:bomb", "--max-size", "16Mi", check=False)
        assert out.returncode == 1 and "RESOURCE_EXHAUSTED" in out.stderr, out
        hostile.on(f"*/blobs/{good.digest}", oci.Redirect(f"http://{other.host}/v2/x/y/blobs/{good.digest}"))
        out = cli("--store", store, "image", "pull", f"{hostile.host}/x/y:redirect", check=False)
        assert out.returncode == 1 and "redirected" in out.stderr, out
        assert other.count("*", method="GET") == 0
        assert "x/y" not in cli("--store", store, "image", "ls", "--all").stdout
        no_scratch_left(store)
    finally:
        hostile.stop()
        other.stop()


def test_a_full_disk_leaves_no_tag_and_no_scratch(layout, registry):
    small = tempfile.mkdtemp(prefix="dsec-it-small-store-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "dsec-it-small", small], check=True)
    try:
        ref = f"{registry.host}/team/app:app"
        out = cli("--store", small, "image", "pull", ref, check=False)
        assert out.returncode == 1 and "RESOURCE_EXHAUSTED" in out.stderr, out
        assert ref not in cli("--store", small, "image", "ls", "--all").stdout
        no_scratch_left(small)
    finally:
        subprocess.run(["umount", small], check=False)
        os.rmdir(small)


def test_an_embedded_agent_imports_with_the_clients_credentials(layout, image_home):
    r = oci.Registry(auth="htpasswd", users={"carol": "pw!"}).start()
    try:
        oci.push(layout.dir, "other", r, "team/private", creds=("carol", "pw!"))
        ref = f"{r.host}/team/private:other"
        with lib.dsec.Client(home=image_home, registry_auth={r.host: ("carol", "pw!")}) as c:
            with c.create(image=ref, ttl=120, memory="64Mi") as sb:
                assert run(sb, "cat /other.txt") == "other image\n"
        # Without them, the agent says what is missing.
        with lib.dsec.Client(home=image_home) as c:
            with pytest.raises(lib.dsec.DsecError, match="wants credentials"):
                c.create(image=f"{r.host}/team/private:v9", ttl=60)
    finally:
        r.stop()


def test_a_moved_tag_is_imported_again_and_a_pinned_digest_stays(layout, registry, image_home):
    first = oci.push(layout.dir, "app", registry, "team/moving", dest_tag="v1")
    ref = f"{registry.host}/team/moving:v1"
    with lib.dsec.Client(home=image_home, agent_args=["--image-cache-ttl", "1"]) as c:
        with c.create(image=ref, ttl=120, memory="64Mi") as sb:
            assert run(sb, "cat /replaced") == "upper version"
        oci.push(layout.dir, "other", registry, "team/moving", dest_tag="v1")
        time.sleep(1.2)
        with c.create(image=ref, ttl=120, memory="64Mi") as sb:
            assert run(sb, "cat /other.txt /replaced") == "other image\nlower version"
        # The first image, by the registry's digest: imported under a tag of its own, never asked again.
        with c.create(image=f"{registry.host}/team/moving@{first}", ttl=120, memory="64Mi") as sb:
            assert run(sb, "cat /replaced") == "upper version"
            assert sb.info().image.startswith(f"{registry.host}/team/moving:sha256-{first[7:]}@sha256:")


def test_lying_sizes_and_an_endless_blob_are_refused(store):
    lay = oci.OciLayout(tempfile.mkdtemp(prefix="dsec-oci-lies-"))
    layer = lay.add_layer(base_entries("lies"))
    lay.add_image([dataclasses.replace(layer, size=layer.size - 1)], {}, tag="short")
    lay.add_image([dataclasses.replace(layer, size=layer.size + 4096)], {}, tag="long")
    endless = lay.add_layer([oci.file("x", b"endless")])
    lay.add_image([endless], {}, tag="endless")
    hostile = oci.HostileRegistry(lay).start()
    try:
        for tag, words in (("short", "longer than"), ("long", "ended at byte"), ("endless", "longer than")):
            if tag == "endless":
                hostile.on(f"*/blobs/{endless.digest}", oci.Endless(), method="GET")
            out = cli("--store", store, "image", "pull", f"{hostile.host}/x/y:{tag}", check=False)
            assert out.returncode == 1 and "FAILED_PRECONDITION" in out.stderr and words in out.stderr, (tag, out)
        assert "x/y" not in cli("--store", store, "image", "ls", "--all").stdout
        no_scratch_left(store)
    finally:
        hostile.stop()


def test_mirrors_default_registries_and_lists_of_images(layout, registry, store):
    # A host that does not answer, mirrored by the registry that has the image.
    dead = "127.0.0.1:1"
    out = cli("--store", store, "image", "pull", f"{dead}/team/app:app", "--registry-mirror",
              f"{dead}={registry.url}")
    assert f"pulled {dead}/team/app:app" in out.stdout
    # A bare name goes to the default registry only when one is named, expanded under it.
    out = cli("--store", store, "image", "pull", "team/app:other", check=False)
    assert out.returncode == 2 and "names no registry host" in out.stderr, out
    out = cli("--store", store, "image", "pull", "team/app:other", "--default-registry", registry.host)
    assert f"pulled {registry.host}/team/app:other" in out.stdout
    # A dataset's list, imported two at a time; a bad line fails alone.
    listing = pathlib.Path(store) / "images.txt"
    listing.write_text(f"# the dataset\n{registry.host}/team/app:docker\n\n{registry.host}/team/app:multi  # index\n"
                       f"{registry.host}/team/app:nope\n")
    out = cli("--store", store, "image", "pull", "--from-file", str(listing), "-j", "2", "-q", check=False)
    assert out.returncode == 1 and "team/app:nope" in out.stderr, out
    assert out.stdout.count("pulled ") == 2, out.stdout
    names = cli("--store", store, "image", "ls").stdout
    for tag in ("app", "other", "docker", "multi"):
        assert f"/team/app:{tag}" in names, names
    no_scratch_left(store)


def test_a_deep_image_has_its_top_layers_merged_and_stacks_as_docker_would(client, registry, image_home):
    lay = oci.OciLayout(tempfile.mkdtemp(prefix="dsec-oci-deep-"))
    layers = [lay.add_layer(base_entries("deep"))]
    # 39 more layers (40 in all, past the 32 dsec stacks): each adds a file; near the top, merged ones delete and
    # bring back files of each other and of the layers below.
    for i in range(1, 40):
        entries = [oci.file(f"layer-{i:02}", f"{i}\n".encode())]
        if i == 35:
            entries += [oci.whiteout("layer-01"), oci.whiteout("layer-34"), oci.opaque("opq"),
                        oci.file("opq/from-35", b"35")]
        if i == 37:
            entries += [oci.file("layer-34", b"back\n")]
        layers.append(lay.add_layer(entries, compression="none"))
    lay.add_image(layers, {"Env": ["PATH=/bin"]}, tag="deep")
    oci.push(lay.dir, "deep", registry, "team/deep")
    with client.create(image=f"{registry.host}/team/deep:deep", ttl=120, memory="64Mi") as sb:
        out = run(sb, "ls / | grep -c '^layer-'; test -e /layer-01 || echo no-01; cat /layer-34 /layer-39; ls /opq")
        assert out == "38\nno-01\nback\n39\nfrom-35\n", out
    inspect = json.loads(cli("--store", os.path.join(image_home, "store"), "image", "inspect",
                             f"{registry.host}/team/deep:deep").stdout)
    assert len(inspect["layers"]) == 32
    assert any("40 layers are stored as 32" in n for n in inspect["notes"]), inspect["notes"]
