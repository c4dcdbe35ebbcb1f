"""Bad input gets a clear error with the right code, and never hurts the agent or another sandbox.

Every test here ends by checking that the agent still serves and that a witness sandbox, made before any bad input,
still has its file and its background process and still runs commands."""

from __future__ import annotations

import json
import uuid

import pytest

import dsec_testlib as lib

dsec = lib.dsec


@pytest.fixture(scope="module")
def witness(client):
    sb = client.create(image="busybox", ttl=900, labels={"role": "witness"})
    sb.write_file("/root/witness.txt", b"untouched")
    sb.exec("sleep 3000 >/dev/null 2>&1 &")
    yield sb
    sb.destroy()


@pytest.fixture
def still_fine(agent, client, witness):
    """Runs after the test body: the agent serves, the witness sandbox is intact."""
    yield
    assert agent.alive(), f"dsecd died:\n{agent.log_tail()}"
    assert client.nodes()[0].id == agent.node_id
    assert witness.read_file("/root/witness.txt") == b"untouched"
    r = witness.exec("cat /root/witness.txt; ps -o args | grep -c '^sleep 3000'")
    assert r.stdout == b"untouched1\n", r
    res = lib.http_request(agent.socket_path, "GET", "/healthz")
    assert res.status == 200


def _error(res: lib.RawResponse, status: int, code: str) -> dict:
    assert res.status == status, res
    assert res.headers.get("content-type", "").startswith("application/json"), res.headers
    body = res.json()
    assert body["code"] == code, body
    assert isinstance(body["message"], str) and body["message"], body
    assert "retryable" in body
    return body


# ------------------------------------------------------------------------------------------------- raw HTTP

def test_malformed_json_bodies(agent, witness, still_fine):
    for body in (b"{not json", b"", b"[1,2", b"\xff\xfe\x00", b'{"image": "busybox"'):
        res = lib.http_request(agent.socket_path, "POST", "/v1/sandboxes", body,
                               {"Content-Type": "application/json"})
        if body == b"":
            # An empty body is an empty spec: the defaults, which name no image the store has or a default one.
            assert res.status in (200, 201, 400, 404), res
            if res.status in (200, 201):
                lib.http_request(agent.socket_path, "DELETE", f"/v1/sandboxes/{res.json()['id']}")
            continue
        body_json = _error(res, 400, "INVALID_ARGUMENT")
        assert "JSON" in body_json["message"], body_json
    res = lib.http_request(agent.socket_path, "POST", f"/v1/sandboxes/{witness.id}/exec", b'{"argv": ["true"',
                           {"Content-Type": "application/json"})
    _error(res, 400, "INVALID_ARGUMENT")
    # JSON of the wrong shape names the field.
    res = lib.http_request(agent.socket_path, "POST", f"/v1/sandboxes/{witness.id}/exec", b'{"argv": "true"}')
    assert "argv" in _error(res, 400, "INVALID_ARGUMENT")["message"]
    res = lib.http_request(agent.socket_path, "POST", "/v1/sandboxes", b'["busybox"]')
    _error(res, 400, "INVALID_ARGUMENT")


def test_malformed_http(agent, still_fine):
    res = lib.raw_http(agent.socket_path, b"THIS IS NOT HTTP\r\n\r\n")
    assert res.status == 400, res
    res = lib.raw_http(agent.socket_path, b"GET /v1/node HTTP/1.1\r\nContent-Length: banana\r\n\r\n")
    assert res.status == 400, res
    res = lib.http_request(agent.socket_path, "GET", "/v1/nowhere")
    _error(res, 404, "NOT_FOUND")
    res = lib.http_request(agent.socket_path, "PATCH", "/v1/node")
    assert res.status in (405, 501), res


def test_oversized_header(agent, still_fine):
    req = (b"GET /v1/node HTTP/1.1\r\nHost: dsecd\r\nX-Filler: " + b"a" * (64 << 10) + b"\r\n\r\n")
    res = lib.raw_http(agent.socket_path, req)
    body = _error(res, 431, "RESOURCE_EXHAUSTED")
    assert "header" in body["message"]


def test_oversized_body_declared(agent, witness, still_fine):
    target = f"/v1/sandboxes/{witness.id}/files?path=/tmp/big"
    req = (f"PUT {target} HTTP/1.1\r\nHost: dsecd\r\nContent-Length: {agent.max_body + 1}\r\n\r\n").encode()
    res = lib.raw_http(agent.socket_path, req, body_chunks=[b"x" * 65536])
    body = _error(res, 413, "RESOURCE_EXHAUSTED")
    assert "body" in body["message"]
    with pytest.raises(dsec.NotFound):
        witness.read_file("/tmp/big")


def test_oversized_body_chunked(agent, witness, still_fine):
    target = f"/v1/sandboxes/{witness.id}/files?path=/tmp/big-chunked"
    req = f"PUT {target} HTTP/1.1\r\nHost: dsecd\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    chunk = b"%x\r\n" % (1 << 20) + b"y" * (1 << 20) + b"\r\n"
    n = agent.max_body // (1 << 20) + 2
    res = lib.raw_http(agent.socket_path, req, body_chunks=[chunk] * n + [b"0\r\n\r\n"], timeout=30)
    _error(res, 413, "RESOURCE_EXHAUSTED")
    with pytest.raises(dsec.NotFound):
        witness.read_file("/tmp/big-chunked")


def test_raw_create_with_bad_field(agent, still_fine):
    spec = {"image": "busybox", "resources": {"memory": "lots"}}
    res = lib.http_request(agent.socket_path, "POST", "/v1/sandboxes", json.dumps(spec).encode())
    assert "resources.memory" in _error(res, 400, "INVALID_ARGUMENT")["message"]
    spec = {"image": "busybox", "resources": {"cpu": "two"}}
    res = lib.http_request(agent.socket_path, "POST", "/v1/sandboxes", json.dumps(spec).encode())
    assert "resources.cpu" in _error(res, 400, "INVALID_ARGUMENT")["message"]
    spec = {"image": "busybox", "ttl": -5}
    res = lib.http_request(agent.socket_path, "POST", "/v1/sandboxes", json.dumps(spec).encode())
    assert "ttl" in _error(res, 400, "INVALID_ARGUMENT")["message"]


def test_raw_numbers_beyond_any_node(agent, still_fine):
    """Sizes past what any node could grant, numbers the parser cannot hold, counts that would wrap: 400 naming the
    field, or a RESOURCE_EXHAUSTED that says no retry can help; never a 500."""
    def create(spec) -> lib.RawResponse:
        return lib.http_request(agent.socket_path, "POST", "/v1/sandboxes", json.dumps(spec).encode()
                                if isinstance(spec, dict) else spec)
    for field, value in [("memory", "17Ti"), ("disk", "17Ti"), ("memory", "18446744073709551616"),
                         ("memory", 18446744073709551615), ("disk", "99999999999999999999Ti")]:
        res = create({"image": "busybox", "resources": {field: value}})
        assert f"resources.{field}" in _error(res, 400, "INVALID_ARGUMENT")["message"], (field, value)
    res = create(b'{"image": "busybox", "resources": {"memory": 1e400}}')
    assert res.status == 400, res
    res = create(b'{"image": "busybox", "ttl": 1e308}')
    assert "ttl" in _error(res, 400, "INVALID_ARGUMENT")["message"]
    res = create({"image": "busybox", "resources": {"cpu": 1000}})  # far past this node's cores x overcommit
    err = _error(res, 429, "RESOURCE_EXHAUSTED")
    assert "could never fit" in err["message"] and err.get("retryable") is False, err


def test_raw_unknown_sandbox(agent, still_fine):
    sid = f"{agent.node_id}-{uuid.uuid4().hex[:12]}"
    _error(lib.http_request(agent.socket_path, "GET", f"/v1/sandboxes/{sid}"), 404, "NOT_FOUND")
    _error(lib.http_request(agent.socket_path, "POST", f"/v1/sandboxes/{sid}/exec", b'{"argv":["true"]}'),
           404, "NOT_FOUND")
    _error(lib.http_request(agent.socket_path, "GET", f"/v1/sandboxes/{sid}/files?path=/etc/passwd"),
           404, "NOT_FOUND")


# ------------------------------------------------------------------------------------------------- through the binding

def test_unknown_sandbox(client, agent, still_fine):
    ghost = client.attach(f"{agent.node_id}-{uuid.uuid4().hex[:12]}")
    with pytest.raises(dsec.NotFound):
        ghost.exec("true")
    with pytest.raises(dsec.NotFound):
        ghost.info()
    with pytest.raises(dsec.NotFound):
        ghost.read_file("/etc/passwd")
    with pytest.raises(dsec.NotFound):
        ghost.write_file("/tmp/x", b"x")


def test_invalid_spec_field_is_named(client, still_fine):
    with pytest.raises(dsec.InvalidArgument) as e:
        client.create(image="busybox", memory="lots")
    assert "resources.memory" in str(e.value), str(e.value)
    with pytest.raises(dsec.InvalidArgument) as e:
        client.create(image="busybox", cpu=-1)
    assert "resources.cpu" in str(e.value), str(e.value)
    with pytest.raises(dsec.InvalidArgument) as e:
        client.create(image="busybox", hostname="not a hostname!")
    assert "hostname" in str(e.value)
    with pytest.raises(dsec.InvalidArgument) as e:
        client.create(image="../etc")
    assert "image" in str(e.value)


def test_missing_image(client, still_fine):
    name = "no-such-image-" + uuid.uuid4().hex[:8]
    with pytest.raises(dsec.NotFound) as e:
        client.create(image=name)
    assert name in str(e.value)


def test_unknown_kind(client, still_fine):
    with pytest.raises(dsec.InvalidArgument) as e:
        client.create(image="busybox", kind="teleporter")
    assert "teleporter" in str(e.value) or "kind" in str(e.value)


def test_exec_missing_binary(witness, still_fine):
    r = witness.exec(["/no/such/binary", "arg"])
    assert (r.exit_code, r.reason) == (127, "executable_not_found") and b"/no/such/binary" in r.stderr, r
    assert witness.exec(["no-such-binary-on-path"]).exit_code == 127
    assert witness.exec(["true"], cwd="/no/such/dir").reason == "cwd_not_found"


def test_exec_bad_arguments(witness, still_fine):
    with pytest.raises(dsec.InvalidArgument):
        witness.exec(["echo"], env={"A=B": "x"})
    with pytest.raises(dsec.InvalidArgument):
        witness.exec(["echo"], cwd="relative/dir")
    with pytest.raises(dsec.InvalidArgument):
        witness.exec(["echo"], timeout=-1)
    with pytest.raises(dsec.InvalidArgument):
        witness.exec([])


def test_read_missing_file(witness, still_fine):
    with pytest.raises(dsec.NotFound):
        witness.read_file("/no/such/file")
    with pytest.raises(dsec.InvalidArgument):
        witness.read_file("relative/path")
    with pytest.raises(dsec.DsecError):
        witness.read_file("/root")  # a directory is not a file
    with pytest.raises(dsec.DsecError):
        witness.write_file("/root/witness.txt/below", b"x")  # a file is not a directory
