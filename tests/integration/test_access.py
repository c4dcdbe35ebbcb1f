"""Who may drive a node: TLS on the TCP listener, bearer tokens, tenants that see only their own sandboxes and
groups, mutual TLS, the audit log, and the refusals at start for a listener anyone could drive.

Everything runs against real dsecd processes on 127.0.0.1 with a certificate authority the test makes with the
openssl command (a server certificate for IP 127.0.0.1, client certificates of that CA and of a stranger CA, one that
expired), and tokens made by `dsec token new`."""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import uuid

import pytest

import dsec_testlib as lib

dsec = lib.dsec

OPENSSL = shutil.which("openssl")
DSEC_CLI = os.path.join(os.path.dirname(str(lib.DSECD)), "dsec")


def run(*argv, cwd=None, input=None):
    r = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, input=input, timeout=60)
    assert r.returncode == 0, f"{argv}: {r.stderr}"
    return r.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pki:
    """A test CA, a server certificate for 127.0.0.1, client certificates (ours, a stranger CA's) and an expired
    server certificate, all under `dir`."""

    def __init__(self, dir: str) -> None:
        self.dir = dir
        p = lambda *n: os.path.join(dir, *n)  # noqa: E731
        self.path = p
        for name in ("ca", "stranger"):
            run(OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", p(f"{name}.key"), "-out",
                p(f"{name}.pem"), "-days", "2", "-subj", f"/CN=dsec test {name} CA")
        ext = p("server.ext")
        with open(ext, "w") as f:
            # etcd dials itself (its gateway) with its server certificate: it must be good for both ends.
            f.write("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
        self.sign("server", "ca", ext)
        with open(p("client.ext"), "w") as f:
            f.write("extendedKeyUsage=clientAuth\n")
        self.sign("client", "ca", p("client.ext"))
        self.sign("outsider", "stranger", p("client.ext"))
        # A server certificate whose dates are over (openssl ca takes explicit dates).
        with open(p("ca.cnf"), "w") as f:
            f.write(f"""[ca]
default_ca = test
[test]
database = {p('index.txt')}
new_certs_dir = {dir}
serial = {p('serial')}
default_md = sha256
policy = any
copy_extensions = copy
[any]
commonName = supplied
""")
        open(p("index.txt"), "w").close()
        with open(p("serial"), "w") as f:
            f.write("1000\n")
        run(OPENSSL, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", p("expired.key"), "-out", p("expired.csr"),
            "-subj", "/CN=127.0.0.1")
        run(OPENSSL, "ca", "-batch", "-config", p("ca.cnf"), "-cert", p("ca.pem"), "-keyfile", p("ca.key"),
            "-in", p("expired.csr"), "-out", p("expired.pem"), "-startdate", "20200101000000Z", "-enddate",
            "20200102000000Z", "-notext")

    def sign(self, name: str, ca: str, ext: str) -> None:
        p = self.path
        run(OPENSSL, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", p(f"{name}.key"), "-out", p(f"{name}.csr"),
            "-subj", f"/CN=dsec test {name}")
        run(OPENSSL, "x509", "-req", "-in", p(f"{name}.csr"), "-CA", p(f"{ca}.pem"), "-CAkey", p(f"{ca}.key"),
            "-CAcreateserial", "-out", p(f"{name}.pem"), "-days", "2", "-extfile", ext)


def new_token(tenant: str, admin: bool = False) -> tuple[str, str]:
    out = run(DSEC_CLI, "token", "new", tenant, *(["--admin"] if admin else []))
    token = out.split("token:")[1].split()[0]
    line = out.split("line:")[1].strip()
    return token, line


@pytest.fixture(scope="module")
def pki():
    if not OPENSSL:
        pytest.skip("the openssl command is not installed (Debian package openssl)")
    d = tempfile.mkdtemp(prefix="dsec-it-pki-")
    try:
        yield Pki(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def tokens(pki):
    t = {name: new_token(name) for name in ("team-a", "team-b")}
    t["ops"] = new_token("-", admin=True)
    path = pki.path("tokens")
    with open(path, "w") as f:
        f.write("# tenant role sha256\n" + "\n".join(line for _, line in t.values()) + "\n")
    os.chmod(path, 0o600)
    return {name: tok for name, (tok, _) in t.items()} | {"file": path}


def start_agent(home, tag, args, backends="container", **kw):
    a = lib.Agent(home, tag=tag, extra_args=["--backends", backends, *args])
    a.start(**kw)
    return a


@pytest.fixture(scope="module")
def secure(pki, tokens):
    """An agent on TLS + tokens, with its audit log in a known place."""
    home = tempfile.mkdtemp(prefix="dsec-it-access-")
    lib.build_busybox_image(home)
    port = free_port()
    audit = os.path.join(home, "audit.log")
    a = start_agent(home, "acc", ["--listen", f"127.0.0.1:{port}", "--tls-cert", pki.path("server.pem"),
                                  "--tls-key", pki.path("server.key"), "--tokens", tokens["file"],
                                  "--audit-log", audit, "--tenant-quota", "team-b=sandboxes:2,cpu:1.5,memory:1Gi"],
                    backends="container,fncall")
    a.home = home
    a.url = f"https://127.0.0.1:{port}"
    a.audit = audit
    try:
        yield a
    finally:
        try:
            a.stop_and_check()
        finally:
            shutil.rmtree(home, ignore_errors=True)


def client(agent, pki, token=None, **kw):
    return dsec.Client(endpoints=[agent.url], token=token, tls_ca_file=pki.path("ca.pem"), **kw)


def test_a_tcp_listener_anyone_could_drive_is_refused_at_start(pki, tokens, tmp_path):
    home = str(tmp_path)
    port = free_port()
    cases = [
        ([], "--insecure-no-tls"),                                             # plain TCP, not asked for
        (["--tls-cert", pki.path("server.pem"), "--tls-key", pki.path("server.key")], "--tokens"),  # nobody known
        (["--tls-cert", pki.path("server.pem")], "--tls-key"),
        (["--tls-cert", pki.path("nope.pem"), "--tls-key", pki.path("server.key"), "--tokens", tokens["file"]],
         "nope.pem"),
        (["--tls-cert", pki.path("expired.pem"), "--tls-key", pki.path("expired.key"), "--tokens", tokens["file"]],
         "expired"),
        (["--tls-cert", pki.path("server.pem"), "--tls-key", pki.path("client.key"), "--tokens", tokens["file"]],
         "is not the key"),
    ]
    for extra, says in cases:
        r = subprocess.run([str(lib.DSECD), "--home", home, "--run-dir", os.path.join(home, "run"),
                            "--listen", f"127.0.0.1:{port}", "--backends", "null", *extra],
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert r.returncode != 0 and says in r.stderr, (extra, r.returncode, r.stderr)

    def with_tokens(text: str, mode: int = 0o600):
        path = os.path.join(home, f"tokens-{uuid.uuid4().hex[:6]}")
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, mode)
        return subprocess.run([str(lib.DSECD), "--home", home, "--run-dir", os.path.join(home, "run"),
                               "--socket", os.path.join(home, "s.sock"), "--tokens", path, "--backends", "null",
                               "--tokens-on-unix"],
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    good = open(tokens["file"]).read()
    for text, says in [("team-a tenant abc\n", "line 1"), ("team-a root " + "0" * 64 + "\n", "role"),
                       ("bad/tenant tenant " + "0" * 64 + "\n", "not allowed"),
                       ("x tenant " + "0" * 64 + "\ny tenant " + "0" * 64 + "\n", "twice")]:
        r = with_tokens(text)
        assert r.returncode != 0 and says in r.stderr, (text, r.stderr)
    r = with_tokens(good, 0o644)
    assert r.returncode != 0 and "chmod 600" in r.stderr, r.stderr


def test_calls_over_tcp_need_a_token_of_the_node(secure, pki, tokens):
    with client(secure, pki) as anonymous:
        with pytest.raises(dsec.Unauthenticated, match="bearer token"):
            anonymous.list()
    with client(secure, pki, token="dsec_" + "x" * 43) as stranger:
        with pytest.raises(dsec.Unauthenticated, match="not one of this node's"):
            stranger.create(image="busybox", ttl=60)
    # Health checks need no token; plain HTTP to the TLS port gets no answer; a client that does not trust the
    # node's CA does not talk to it.
    host, port = "127.0.0.1", int(secure.url.rsplit(":", 1)[1])
    ctx = ssl.create_default_context(cafile=pki.path("ca.pem"))
    with socket.create_connection((host, port)) as raw, ctx.wrap_socket(raw, server_hostname=host) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    with socket.create_connection((host, port)) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        s.settimeout(10)
        try:
            answer = s.recv(4096)
        except (ConnectionResetError, TimeoutError):
            answer = b""
        assert not answer.startswith(b"HTTP/1.1 200"), answer
    with dsec.Client(endpoints=[secure.url], token=tokens["team-a"], request_timeout=5, call_deadline=5) as naive:
        with pytest.raises(dsec.DsecError):
            naive.list()
    metrics = lib.http_request(secure.socket_path, "GET", "/metrics").body.decode()
    refused = [line for line in metrics.splitlines() if line.startswith("dsec_requests_unauthenticated_total ")]
    assert refused and int(refused[0].split()[1]) >= 2, metrics
    assert "dsec_tls_handshakes_failed_total" in metrics


def test_a_tenant_sees_and_touches_only_its_own_sandboxes(secure, pki, tokens):
    with client(secure, pki, tokens["team-a"]) as a, client(secure, pki, tokens["team-b"]) as b, \
            client(secure, pki, tokens["ops"]) as ops:
        sa = a.create(image="busybox", ttl=120, labels={"t": "access"})
        sb = b.create(image="busybox", ttl=120, labels={"t": "access"})
        try:
            assert sa.info().tenant == "team-a" and sb.info().tenant == "team-b"
            assert {s.id for s in a.list()} == {sa.id}
            assert {s.id for s in b.list()} == {sb.id}
            assert {s.id for s in ops.list()} >= {sa.id, sb.id}
            assert sa.exec("echo mine").stdout == b"mine\n"
            # Another tenant's sandbox answers as one that does not exist: the same error, the same words.
            foreign = b.attach(sa.id)
            missing = b.attach(sa.id[:-4] + "0000")
            for call in (lambda s: s.info(), lambda s: s.exec("true"), lambda s: s.read_file("/etc/hostname"),
                         lambda s: s.write_file("/tmp/x", b"x"), lambda s: s.sleep()):
                with pytest.raises(dsec.NotFound) as seen:
                    call(foreign)
                with pytest.raises(dsec.NotFound) as unknown:
                    call(missing)
                assert str(seen.value).replace(sa.id, "ID") == str(unknown.value).replace(missing.id, "ID")
            res = raw_call(secure, pki, tokens["team-b"], "DELETE", f"/v1/sandboxes/{sa.id}")
            assert res[0] == 404, res
            assert sa.info().state == "running"
            with pytest.raises(dsec.PermissionDenied, match="tenant"):
                b.create(image="busybox", ttl=60, tenant="team-a")
            with pytest.raises(dsec.InvalidArgument, match="tenant"):
                ops.create(image="busybox", ttl=60, tenant="bad tenant\x01")
            # Admin reaches everyone's.
            assert ops.attach(sb.id).exec("echo ops").stdout == b"ops\n"
        finally:
            sa.destroy()
            sb.destroy()


def test_a_tenants_snapshots_and_request_ids_are_its_own(secure, pki, tokens):
    """A tenant's snapshot goes under tenants/<tenant>/: it starts sandboxes from it, another tenant cannot (in the
    words of a snapshot that does not exist) nor see it in node info; request ids are per tenant."""
    with client(secure, pki, tokens["team-a"]) as a, client(secure, pki, tokens["team-b"]) as b, \
            client(secure, pki, tokens["ops"]) as ops:
        sa = a.create(image="busybox", ttl=120, request_id="same-id")
        made = []
        try:
            sa.write_file("/tmp/secret", b"a's answer\n")
            snap = sa.snapshot("answers:v1")
            assert snap.image.startswith("tenants/team-a/answers:v1@sha256:"), snap.image
            own = a.create(image=snap.image, ttl=120)
            made.append(own)
            assert own.read_file("/tmp/secret") == b"a's answer\n"
            with pytest.raises(dsec.NotFound) as seen:
                b.create(image=snap.image, ttl=60, cpu=0.25, memory="64Mi")
            with pytest.raises(dsec.NotFound) as unknown:
                b.create(image="tenants/team-a/nothing:v9", ttl=60, cpu=0.25, memory="64Mi")
            assert str(seen.value).replace(snap.image, "IMG") == str(unknown.value).replace(
                "tenants/team-a/nothing:v9", "IMG")
            with pytest.raises(dsec.InvalidArgument, match="another tenant"):
                b.create(image="busybox", ttl=60, cpu=0.25, memory="64Mi").snapshot("tenants/team-a/mine:v1")

            def theirs(c):
                return [i for i in c.nodes()[0].images if i.startswith("tenants/team-a/")]
            assert theirs(b) == [] and theirs(a) and theirs(ops), (theirs(a), theirs(b), theirs(ops))
            # The same request id from another tenant is another request: a sandbox of its own.
            sb = b.create(image="busybox", ttl=120, request_id="same-id", cpu=0.25, memory="64Mi")
            made.append(sb)
            assert sb.id != sa.id and sb.info().tenant == "team-b"
            assert a.create(image="busybox", ttl=120, request_id="same-id").id == sa.id  # a replay of a's
        finally:
            for s in made:
                s.destroy()
            for info in b.list():
                b.attach(info.id).destroy()
            sa.destroy()


def _stored_blob(home: str, digest: str) -> bytes:
    """A blob of one of the agent's directory stores, read from disk."""
    name = digest.split(":", 1)[1]
    for root, _dirs, files in os.walk(home):
        if name in files and root.endswith(os.path.join("blobs", "sha256")):
            with open(os.path.join(root, name), "rb") as f:
                return f.read()
    raise AssertionError(f"no store under {home} holds {digest}")


def test_another_tenants_snapshot_layers_are_out_of_reach_by_digest(secure, pki, tokens):
    """Tenant B knows tenant A's snapshot (its manifest digest, its layer digests) and tries every way past the
    name check: A's digest pinned to a name B may use, a manifest of its own making that lists A's layer under a
    public name, a function call over A's image. Each is answered as an image that does not exist; B's node info
    lists none of A's layers, A's lists them with the image that holds them."""
    import hashlib

    with client(secure, pki, tokens["team-a"]) as a, client(secure, pki, tokens["team-b"]) as b, \
            client(secure, pki, tokens["ops"]) as ops:
        sa = a.create(image="busybox", ttl=120)
        try:
            sa.write_file("/tmp/secret", b"a's answer\n")
            snap = sa.snapshot("layers:v1")
            a.create(image=snap.image, ttl=120).destroy()  # A's layer is on the node, in its cache
            digest = snap.image.rsplit("@", 1)[1]
            manifest = json.loads(_stored_blob(secure.home, digest))
            assert manifest["layers"][-1]["role"] == "snapshot", manifest
            a_layer = manifest["layers"][-1]["digest"]

            def layers_seen(c):
                return {layer.digest: list(layer.images) for layer in c.nodes()[0].cached_layers}
            assert a_layer not in layers_seen(b), layers_seen(b)
            assert layers_seen(a).get(a_layer) == ["tenants/team-a/layers:v1"], layers_seen(a)
            assert a_layer in layers_seen(ops)
            assert all(not i.startswith("tenants/") for imgs in layers_seen(b).values() for i in imgs)

            def refused(status, body, image):
                assert status == 404 and "NOT_FOUND" in body, (image, status, body)
                assert "is not in any of the node's stores" in body or "not found" in body, body

            # A's manifest digest pinned to public names, and to a name of B's own.
            for name in ("busybox:latest", "x/y:z", "tenants/team-b/mine:v1"):
                image = f"{name}@{digest}"
                status, body = raw_call(secure, pki, tokens["team-b"], "POST", "/v1/sandboxes",
                                        json.dumps({"image": image, "ttl": 60}).encode())
                refused(status, body, image)
            # A manifest B made: a public image's name over A's layers, sent along with the create.
            forged = dict(manifest, name="busybox", tag="latest")
            forged_json = json.dumps(forged, sort_keys=True)
            forged_digest = "sha256:" + hashlib.sha256(forged_json.encode()).hexdigest()
            for name in ("busybox:latest", "tenants/team-b/mine:v1"):
                image = f"{name}@{forged_digest}"
                status, body = raw_call(secure, pki, tokens["team-b"], "POST", "/v1/sandboxes",
                                        json.dumps({"image": image, "ttl": 60, "image_manifest": forged_json}).encode())
                refused(status, body, image)
            # Function calls: A's image by name, by pinned digest under another name, and with the forged manifest.
            for call in ({"image": snap.image}, {"image": f"busybox:latest@{digest}"},
                         {"image": f"busybox:latest@{forged_digest}", "image_manifest": forged_json}):
                status, body = raw_call(secure, pki, tokens["team-b"], "POST", "/v1/fncall",
                                        json.dumps({"language": "shell", "code": "cat /tmp/secret", **call}).encode())
                refused(status, body, call["image"])
                assert "a's answer" not in body
            assert [s for s in b.list()] == []  # nothing was made for B
            # The same forged manifest is refused to the operator too: no store holds it.
            status, body = raw_call(secure, pki, tokens["ops"], "POST", "/v1/sandboxes",
                                    json.dumps({"image": f"busybox:latest@{forged_digest}", "ttl": 60,
                                                "image_manifest": forged_json}).encode())
            refused(status, body, "forged, as the operator")
            # A's own snapshot, pinned, still starts for A.
            own = a.create(image=snap.image, ttl=60)
            try:
                assert own.read_file("/tmp/secret") == b"a's answer\n"
            finally:
                own.destroy()
        finally:
            sa.destroy()


def test_the_agents_home_is_closed_to_other_uids(tmp_path):
    """The home holds every tenant's images and snapshots, the layer cache and the records: an agent running as root
    keeps it to root, so QEMU's uid (2000000000 + n, which reads its VM's files through descriptors the agent opens)
    or any other uid of the node opens nothing there, whatever mode the home was made with."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed: cannot act as another uid")
    home = str(tmp_path / "home")
    os.makedirs(home, mode=0o755)
    os.chmod(home, 0o755)
    lib.build_busybox_image(home)
    blobs = os.path.join(home, "store", "blobs", "sha256")
    blob = os.path.join(blobs, sorted(os.listdir(blobs))[0])

    def as_qemu(*argv):
        return subprocess.run(["setpriv", "--reuid=2000000001", "--regid=2000000001", "--clear-groups", *argv],
                              capture_output=True, text=True)
    a = start_agent(home, "home", [])
    try:
        assert os.stat(home).st_mode & 0o077 == 0, oct(os.stat(home).st_mode)
        for argv in (["cat", blob], ["ls", os.path.join(home, "store")], ["ls", home]):
            r = as_qemu(*argv)
            assert r.returncode != 0 and "Permission denied" in r.stderr, (argv, r)
        with open(blob, "rb") as f:  # root reads it as before
            assert f.read(1)
    finally:
        a.stop_and_check()


def test_a_tenants_group_is_its_own(secure, pki, tokens):
    with client(secure, pki, tokens["team-a"]) as a:
        g = a.create_group(1, image="busybox", lease=120, ttl=120)
        group = g.id
        try:
            assert raw_call(secure, pki, tokens["team-a"], "GET", f"/v1/groups/{group}")[0] == 200
            code, body = raw_call(secure, pki, tokens["team-b"], "GET", f"/v1/groups/{group}")
            assert code == 404, body
            assert raw_call(secure, pki, tokens["team-b"], "POST", f"/v1/groups/{group}/renew", b"{}")[0] == 404
            assert raw_call(secure, pki, tokens["team-b"], "DELETE", f"/v1/groups/{group}")[0] == 404
            groups = json.loads(raw_call(secure, pki, tokens["team-b"], "GET", "/v1/groups")[1])["groups"]
            assert group not in [x["id"] for x in groups]
            assert group in [x["id"] for x in json.loads(
                raw_call(secure, pki, tokens["team-a"], "GET", "/v1/groups")[1])["groups"]]
            # The same id from team-b is team-b's own group: created as a free id would be (no oracle of which ids
            # team-a uses), and nothing team-b does with it reaches team-a's (no squatting either).
            join = json.dumps({"image": "busybox", "ttl": 60, "group": group, "group_ttl": 60,
                               "cpu": 0.25, "memory": 64 << 20}).encode()
            code, body = raw_call(secure, pki, tokens["team-b"], "POST", "/v1/sandboxes", join)
            assert code == 201, (code, body)
            b_sandbox = json.loads(body)
            assert b_sandbox["group"] == group and b_sandbox["tenant"] == "team-b", b_sandbox
            code, body = raw_call(secure, pki, tokens["team-b"], "GET", f"/v1/groups/{group}")
            assert code == 200 and [x["id"] for x in json.loads(body)["sandboxes"]] == [b_sandbox["id"]], body
            assert json.loads(body)["id"] == group, body
            assert [x["id"] for x in json.loads(raw_call(secure, pki, tokens["team-b"], "GET", "/v1/groups")[1])
                    ["groups"]] == [group]
            code, body = raw_call(secure, pki, tokens["team-b"], "DELETE", f"/v1/groups/{group}")
            assert code == 200 and json.loads(body)["destroyed"] == 1, body
            code, body = raw_call(secure, pki, tokens["team-b"], "POST", "/v1/sandboxes",
                                  json.dumps({"image": "busybox", "group": "a:b", "group_ttl": 60}).encode())
            assert code == 400 and "is not a group id" in body, (code, body)
            assert all(sb.info().state == "running" for sb in g)
            assert [sb.info().group for sb in g] == [group]
            # The operator sees both, each under its tenant's name.
            ids = [x["id"] for x in json.loads(raw_call(secure, pki, tokens["ops"], "GET", "/v1/groups")[1])["groups"]]
            assert f"team-a:{group}" in ids, ids
        finally:
            g.destroy()


def test_a_tenant_quota_holds_and_the_others_are_not_held_by_it(secure, pki, tokens):
    """team-b may hold 2 sandboxes, 1.5 cores and 1 GiB on the node; team-a has no quota."""
    with client(secure, pki, tokens["team-b"]) as b, client(secure, pki, tokens["team-a"]) as a:
        first = b.create(image="busybox", ttl=120, cpu=1, memory="256Mi")
        made = [first]
        try:
            with pytest.raises(dsec.ResourceExhausted, match="quota of tenant 'team-b'.*cpu"):
                b.create(image="busybox", ttl=60, cpu=1, memory="256Mi")
            with pytest.raises(dsec.ResourceExhausted, match="quota of tenant 'team-b'.*memory"):
                b.create(image="busybox", ttl=60, cpu=0.25, memory="900Mi")
            made.append(b.create(image="busybox", ttl=120, cpu=0.25, memory="256Mi"))
            with pytest.raises(dsec.ResourceExhausted, match="quota of tenant 'team-b'.*sandboxes"):
                b.create(image="busybox", ttl=60, cpu=0.1, memory="128Mi")
            # A batch that would pass the quota is refused whole, before any of it is made.
            with pytest.raises(dsec.ResourceExhausted, match="quota"):
                b.create_many(3, image="busybox", ttl=60, cpu=0.1, memory="128Mi")
            assert len(b.list()) == 2
            # Another tenant is not held by team-b's quota.
            others = a.create_many(3, image="busybox", ttl=60, cpu=1, memory="256Mi")
            for s in others:
                s.destroy()
            # A destroyed sandbox gives its share back.
            made.pop().destroy()
            made.append(b.create(image="busybox", ttl=120, cpu=0.25, memory="256Mi"))
        finally:
            for s in made:
                s.destroy()


def test_the_audit_log_names_who_did_what_and_never_a_token(secure, pki, tokens):
    with client(secure, pki, tokens["team-a"]) as a:
        s = a.create(image="busybox", ttl=60)
        s.exec("true")
        s.destroy()
    lines = [json.loads(line) for line in open(secure.audit)]
    mine = [entry for entry in lines if entry["target"] == s.id]
    routes = {(e["method"], e["route"], e["who"], e["status"]) for e in mine}
    assert ("POST", "/v1/sandboxes/{id}/exec", "tenant:team-a", 200) in routes, mine
    assert ("DELETE", "/v1/sandboxes/{id}", "tenant:team-a", 200) in routes, mine
    assert any(e["who"] == "tenant:team-b" and e["code"] == "NOT_FOUND" for e in lines)
    assert any(e["code"] == "UNAUTHENTICATED" for e in lines)
    everything = open(secure.audit).read() + secure.log_tail(1 << 20)
    for name in ("team-a", "team-b", "ops"):
        assert tokens[name] not in everything, f"the {name} token appears in the audit log or the agent's log"


def test_mutual_tls_and_tokens_on_the_unix_socket(pki, tokens, tmp_path):
    home = str(tmp_path)
    lib.build_busybox_image(home)
    port = free_port()
    a = start_agent(home, "mtls", ["--listen", f"127.0.0.1:{port}", "--tls-cert", pki.path("server.pem"),
                                   "--tls-key", pki.path("server.key"), "--tls-client-ca", pki.path("ca.pem"),
                                   "--tokens", tokens["file"], "--tokens-on-unix"])
    a.url = f"https://127.0.0.1:{port}"
    try:
        with client(a, pki, tokens["team-a"], tls_client_cert=pki.path("client.pem"),
                    tls_client_key=pki.path("client.key")) as ok:
            assert ok.list() == []
        for cert in (None, "outsider"):
            extra = {} if cert is None else {"tls_client_cert": pki.path(f"{cert}.pem"),
                                             "tls_client_key": pki.path(f"{cert}.key")}
            with client(a, pki, tokens["team-a"], request_timeout=5, call_deadline=5, **extra) as refused:
                with pytest.raises(dsec.DsecError):
                    refused.list()
        # The unix socket asks for a token as well.
        res = lib.http_request(a.socket_path, "GET", "/v1/sandboxes")
        assert res.status == 401, res
        res = lib.http_request(a.socket_path, "GET", "/v1/sandboxes",
                               headers={"Authorization": f"Bearer {tokens['ops']}"})
        assert res.status == 200, res
        metrics = lib.http_request(a.socket_path, "GET", "/metrics",
                                   headers={"Authorization": f"Bearer {tokens['ops']}"}).body.decode()
        failed = [line for line in metrics.splitlines() if line.startswith("dsec_tls_handshakes_failed_total ")]
        assert failed and int(failed[0].split()[1]) >= 2, metrics
    finally:
        a.stop_and_check()


def raw_call(agent, pki, token, method, target, body=b""):
    """One HTTPS exchange with the agent, outside the client (to see the status as sent)."""
    host, port = "127.0.0.1", int(agent.url.rsplit(":", 1)[1])
    ctx = ssl.create_default_context(cafile=pki.path("ca.pem"))
    with socket.create_connection((host, port), timeout=15) as raw, ctx.wrap_socket(raw, server_hostname=host) as s:
        head = (f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {token}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        s.sendall(head + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1].decode(errors="replace")


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


def test_a_caller_without_a_token_is_answered_before_its_body(secure, pki, tokens):
    """A request without a valid token is answered 401 from its header: the agent reads none of its body, so
    callers that may not call cannot make it buffer bodies (three bodies of the agent's largest size, 4 MiB of each
    sent, cost it nothing)."""
    host, port = "127.0.0.1", int(secure.url.rsplit(":", 1)[1])
    ctx = ssl.create_default_context(cafile=pki.path("ca.pem"))
    before = _rss_kib(secure.proc.pid)
    conns = []
    try:
        for auth in ("", f"Authorization: Bearer {'x' * 40}\r\n", ""):
            raw = socket.create_connection((host, port), timeout=15)
            s = ctx.wrap_socket(raw, server_hostname=host)
            conns.append(s)
            s.sendall((f"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                       f"Content-Length: {secure.max_body}\r\n\r\n").encode() + b"{" + b" " * (4 << 20))
        for s in conns:
            s.settimeout(10)  # the 401 comes without the rest of the body: no waiting for it
            data = b""
            while b"UNAUTHENTICATED" not in data and (chunk := s.recv(65536)):
                data += chunk
            assert data.startswith(b"HTTP/1.1 401 "), data[:600]
            assert b"UNAUTHENTICATED" in data, data[:400]
        grown = _rss_kib(secure.proc.pid) - before
        assert grown < 64 << 10, f"the agent grew by {grown} KiB for bodies it must not read"
    finally:
        for s in conns:
            s.close()
    # The same request with a valid token is read and answered as usual.
    status, body = raw_call(secure, pki, tokens["team-a"], "POST", "/v1/sandboxes", b"{")
    assert status == 400 and "INVALID_ARGUMENT" in body, (status, body)


def test_tls_all_the_way_agent_and_client_find_each_other_through_etcd(pki, tokens, tmp_path):
    """etcd that asks for client certificates, an agent on TLS with tokens registering in it, and a client that finds
    the agent there and drives it: every hop verified; a client without an etcd certificate finds nobody."""
    import cluster_lib
    if not os.path.exists(cluster_lib.ETCD):
        pytest.skip(f"{cluster_lib.ETCD} is not installed (Debian package etcd-server)")
    etcd = cluster_lib.Etcd(tls={"cert": pki.path("server.pem"), "key": pki.path("server.key"),
                                 "ca": pki.path("ca.pem"), "client_cert": pki.path("client.pem"),
                                 "client_key": pki.path("client.key")})
    etcd.start()
    home = str(tmp_path)
    lib.build_busybox_image(home)
    port = free_port()
    prefix = f"/dsec-it-{uuid.uuid4().hex[:8]}/"
    agent = None
    try:
        agent = start_agent(home, "etls", [
            "--listen", f"127.0.0.1:{port}", "--tls-cert", pki.path("server.pem"), "--tls-key", pki.path("server.key"),
            "--tokens", tokens["file"], "--etcd", etcd.url(), "--etcd-prefix", prefix,
            "--etcd-ca", pki.path("ca.pem"), "--etcd-cert", pki.path("client.pem"),
            "--etcd-key", pki.path("client.key")])
        etcd_tls = dict(etcd_tls_ca_file=pki.path("ca.pem"), etcd_tls_client_cert=pki.path("client.pem"),
                        etcd_tls_client_key=pki.path("client.key"))
        with dsec.Client(etcd=[etcd.url()], etcd_prefix=prefix, token=tokens["team-a"], tls_ca_file=pki.path("ca.pem"),
                         **etcd_tls) as c:
            nodes = lib.wait_for(lambda: c.nodes(), 15, 0.2)
            assert nodes and nodes[0].id == agent.node_id, (nodes, agent.log_tail(), etcd.log_tail())
            with c.create(image="busybox", ttl=60) as sb:
                assert sb.exec("echo over tls").stdout == b"over tls\n"
                assert sb.info().tenant == "team-a"
        with dsec.Client(etcd=[etcd.url()], etcd_prefix=prefix, token=tokens["team-a"], tls_ca_file=pki.path("ca.pem"),
                         etcd_tls_ca_file=pki.path("ca.pem"), call_deadline=3, request_timeout=2) as stranger:
            with pytest.raises(dsec.DsecError):
                stranger.create(image="busybox", ttl=60)
    finally:
        if agent is not None:
            agent.stop_and_check()
        etcd.kill()
        shutil.rmtree(etcd.tmp, ignore_errors=True)
