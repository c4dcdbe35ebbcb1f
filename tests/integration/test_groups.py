"""Lease groups against a real dsecd: a group whose lease is not renewed is reaped within its TTL plus the reaper's
period (a real container sandbox with it, leaving nothing on the host), renewed groups survive, DELETE destroys a
group, bad requests are refused; node labels and the node-side checks of node_selector and GPUs."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid

import pytest

import dsec_testlib as lib

REAPER_PERIOD = 1.0  # dsecd's reaper_interval
SLACK = 1.5          # a loaded 2-core machine


@pytest.fixture(scope="module")
def node(image_home):
    """A dsecd of its own (home, state, cache) serving container and null, with labels; images from the session's
    store."""
    home = tempfile.mkdtemp(prefix="dsec-it-groups-")
    a = lib.Agent(home, tag="g", extra_args=["--backends", "container,null", "--store",
                                             os.path.join(image_home, "store"), "--label", "zone=a",
                                             "--label", "pool=rl"])
    try:
        a.start()
    except Exception:
        a.stop()
        a.remove_husks()
        shutil.rmtree(home, ignore_errors=True)
        raise
    try:
        yield a
    finally:
        status = a.stop()
        problems = a.leftovers()
        state = os.path.join(home, "state", "sandboxes")
        if os.path.isdir(state) and os.listdir(state):
            problems.append(f"records or group leases left in {state}: {sorted(os.listdir(state))}")
        log = a.log_tail()
        if not problems:
            a.remove_husks()
        shutil.rmtree(home, ignore_errors=True)
        assert status == 0, f"dsecd exited with {status} on SIGTERM:\n{log}"
        assert not problems, "dsecd left things behind:\n  " + "\n  ".join(problems) + f"\nlog:\n{log}"


def call(node, method: str, target: str, body=None):
    data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    return lib.http_request(node.socket_path, method, target, data,
                            {"Content-Type": "application/json"} if data else None)


def create(node, group: str, group_ttl: float, count: int = 1, kind: str = "null", **extra) -> list[str]:
    spec = {"kind": kind, "resources": {"memory": "64Mi", "cpu": 0.1}, "ttl": 600, "group": group,
            "group_ttl": group_ttl, "count": count, **extra}
    r = call(node, "POST", "/v1/sandboxes", spec)
    assert r.status == 201, r
    return [s["id"] for s in r.json()["sandboxes"]]


def state_of(node, sandbox_id: str) -> str:
    r = call(node, "GET", f"/v1/sandboxes/{sandbox_id}")
    assert r.status == 200, r
    return r.json()["state"]


def group_name() -> str:
    return "g-" + uuid.uuid4().hex[:12]


def lease_file(node, group: str) -> str:
    return os.path.join(node.home, "state", "sandboxes", "groups", group + ".json")


def test_a_group_not_renewed_is_reaped_within_its_ttl_and_the_reaper_period(node):
    g = group_name()
    ttl = 2
    container = create(node, g, ttl, kind="container", image="busybox")[0]
    before = time.monotonic()
    ids = create(node, g, ttl, count=3)  # the last create into the group sets the deadline
    after = time.monotonic()
    ids.append(container)
    bystander = create(node, group_name(), 60)[0]  # another group, renewed by nobody but far from expiry
    loose = call(node, "POST", "/v1/sandboxes", {"kind": "null", "resources": {"memory": "64Mi"}}).json()["id"]

    info = call(node, "GET", f"/v1/groups/{g}").json()
    assert info["sandbox_count"] == 4 and info["ttl"] == ttl, info
    assert sorted(s["id"] for s in info["sandboxes"]) == sorted(ids)
    assert all(s["group"] == g for s in info["sandboxes"])
    assert 0 < info["expires_in"] <= ttl
    with open(lease_file(node, g)) as f:
        assert json.load(f)["expires_at"] == pytest.approx(info["expires_at"])

    gone = lib.wait_for(lambda: all(state_of(node, i) == "destroyed" for i in ids), ttl + REAPER_PERIOD + SLACK + 5)
    seen = time.monotonic()
    assert gone, [state_of(node, i) for i in ids]
    assert seen - after <= ttl + REAPER_PERIOD + SLACK, f"reaped {seen - after:.2f} s after the last renewal"
    assert seen - before >= ttl - 0.05, f"reaped {seen - before:.2f} s after the last renewal, before the lease ran out"
    for i in ids:
        assert call(node, "GET", f"/v1/sandboxes/{i}").json()["message"] == f"group '{g}' lease expired"
    # The real container is gone from the host as well.
    assert node.leftovers(container) == []
    # The group is forgotten: a trainer that comes back learns its sandboxes are gone.
    r = call(node, "POST", f"/v1/groups/{g}/renew", {"ttl": 10})
    assert r.status == 404 and r.json()["code"] == "NOT_FOUND", r
    assert call(node, "GET", f"/v1/groups/{g}").status == 404
    assert not os.path.exists(lease_file(node, g))
    assert state_of(node, bystander) == "running"
    assert state_of(node, loose) == "running"
    call(node, "DELETE", f"/v1/sandboxes/{loose}")
    call(node, "DELETE", f"/v1/sandboxes/{bystander}")


def test_a_renewed_group_survives_and_is_reaped_once_renewals_stop(node):
    g = group_name()
    ids = create(node, g, 2, count=4)
    until = time.monotonic() + 5
    while time.monotonic() < until:  # 2.5 lease lengths
        r = call(node, "POST", f"/v1/groups/{g}/renew", {"ttl": 2})
        assert r.status == 200, r
        body = r.json()
        assert body["sandbox_count"] == 4 and body["expires_in"] == pytest.approx(2, abs=0.2), body
        time.sleep(0.5)
    assert [state_of(node, i) for i in ids] == ["running"] * 4
    stopped = time.monotonic()
    assert lib.wait_for(lambda: all(state_of(node, i) == "destroyed" for i in ids), 2 + REAPER_PERIOD + SLACK + 5)
    assert time.monotonic() - stopped <= 2 + REAPER_PERIOD + SLACK


def test_a_renewal_without_a_ttl_uses_the_groups_own(node):
    g = group_name()
    create(node, g, 30)
    r = call(node, "POST", f"/v1/groups/{g}/renew")
    assert r.status == 200 and r.json()["ttl"] == 30 and r.json()["expires_in"] == pytest.approx(30, abs=1), r
    assert call(node, "DELETE", f"/v1/groups/{g}").json()["destroyed"] == 1


def test_delete_group_destroys_all_its_sandboxes(node):
    g = group_name()
    ids = create(node, g, 60, count=5)
    container = create(node, g, 60, kind="container", image="busybox")[0]
    other = create(node, group_name(), 60)[0]
    r = call(node, "DELETE", f"/v1/groups/{g}")
    assert r.status == 200, r
    assert r.json() == {"id": g, "node": node.node_id, "destroyed": 6}
    for i in ids + [container]:
        info = call(node, "GET", f"/v1/sandboxes/{i}").json()
        assert info["state"] == "destroyed" and info["message"] == f"group '{g}' deleted", info
    assert node.leftovers(container) == []
    assert call(node, "DELETE", f"/v1/groups/{g}").status == 404
    assert call(node, "POST", f"/v1/groups/{g}/renew", {"ttl": 5}).status == 404
    assert state_of(node, other) == "running"
    listed = call(node, "GET", "/v1/groups").json()["groups"]
    assert g not in [x["id"] for x in listed]
    call(node, "DELETE", f"/v1/sandboxes/{other}")


def test_bad_group_requests_are_refused_with_the_field_named(node):
    r = call(node, "POST", "/v1/sandboxes", {"kind": "null", "group": "g"})
    assert r.status == 400 and r.json()["message"].startswith("group_ttl:"), r
    r = call(node, "POST", "/v1/sandboxes", {"kind": "null", "group": "a/b", "group_ttl": 5})
    assert r.status == 400 and r.json()["message"].startswith("group:"), r
    r = call(node, "POST", "/v1/sandboxes", {"kind": "null", "group": "g", "group_ttl": 86401})
    assert r.status == 400 and r.json()["message"].startswith("group_ttl:"), r
    g = group_name()
    create(node, g, 30)
    for body in ({"ttl": 0}, {"ttl": "5"}, {"ttl": 86401}, {"ttl": 5, "extra": 1}, [5]):
        r = call(node, "POST", f"/v1/groups/{g}/renew", body)
        assert r.status == 400 and r.json()["code"] == "INVALID_ARGUMENT", (body, r)
    assert call(node, "GET", "/v1/groups/bad%20id").status == 400
    assert call(node, "GET", f"/v1/groups/{'x' * 129}").status == 400
    assert call(node, "PUT", f"/v1/groups/{g}").status == 501
    assert call(node, "POST", "/v1/groups/never-seen/renew", {"ttl": 5}).status == 404
    assert call(node, "DELETE", f"/v1/groups/{g}").status == 200


def test_node_labels_and_node_side_placement_checks(node):
    info = call(node, "GET", "/v1/node").json()
    assert info["labels"] == {"zone": "a", "pool": "rl"}
    assert info["capacity"]["gpus"] == 0 and info["gpus_free"] == 0
    base = {"kind": "null", "resources": {"memory": "64Mi"}}
    r = call(node, "POST", "/v1/sandboxes", {**base, "node_selector": {"zone": "b"}})
    assert r.status == 412 and r.json()["code"] == "FAILED_PRECONDITION", r
    assert "label zone=a, not zone=b" in r.json()["message"]
    r = call(node, "POST", "/v1/sandboxes", {**base, "resources": {"memory": "64Mi", "gpus": 1}})
    assert r.status == 429 and r.json()["code"] == "RESOURCE_EXHAUSTED", r
    r = call(node, "POST", "/v1/sandboxes", {**base, "node_selector": {"zone": "a", "pool": "rl"}})
    assert r.status == 201, r
    assert call(node, "DELETE", f"/v1/sandboxes/{r.json()['id']}").status == 200


def test_dsecd_refuses_a_malformed_label():
    import subprocess

    r = subprocess.run([str(lib.DSECD), "--label", "novalue"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--label: 'novalue' is not KEY=VALUE" in r.stderr, r
