"""Creates that wait for room (a spec's queue_timeout, docs/qos.md) on a node of its own with room for two 1-core
sandboxes (--cpu-overcommit 1 on this 2-core machine, or as many cores as it has).

Checked: a create of a full node waits and goes, in the order the creates came, once a sandbox is destroyed or put
to sleep; past its queue_timeout it is refused saying how long it waited; one that could never fit is refused at
once; without queue_timeout nothing waits; a waiting create whose client hangs up makes nothing."""

from __future__ import annotations

import json
import os
import socket
import shutil
import tempfile
import threading
import time

import pytest

import dsec_testlib as lib

dsec = lib.dsec

CORES = os.cpu_count() or 1


@pytest.fixture(scope="module")
def queue_agent(image_home):
    home = tempfile.mkdtemp(prefix="dsec-it-queue-")
    a = lib.Agent(home, tag="queue", extra_args=["--store", os.path.join(image_home, "store"),
                                                 "--cpu-overcommit", "1"]).start_or_clean()
    yield a
    a.stop_and_check()
    shutil.rmtree(home, ignore_errors=True)


def post(agent, spec: dict, timeout: float = 60) -> lib.RawResponse:
    return lib.http_request(agent.socket_path, "POST", "/v1/sandboxes", json.dumps(spec).encode(),
                            {"Content-Type": "application/json"}, timeout=timeout)


def spec(**fields) -> dict:
    out = {"image": "busybox", "ttl": 300, "resources": {"cpu": 1, "memory": "32Mi"}}
    out.update(fields)
    return out


def fill(agent) -> list[str]:
    """As many 1-core sandboxes as the node has room for."""
    ids = []
    for _ in range(CORES):
        r = post(agent, spec())
        assert r.status == 201, r
        ids.append(r.json()["id"])
    assert post(agent, spec()).status == 429
    return ids


def destroy(agent, sid: str) -> None:
    r = lib.http_request(agent.socket_path, "DELETE", f"/v1/sandboxes/{sid}")
    assert r.status == 200, r


def live(agent) -> list[str]:
    return [s["id"] for s in lib.http_request(agent.socket_path, "GET", "/v1/sandboxes").json()["sandboxes"]]


def test_waiting_creates_go_in_order_as_room_frees(queue_agent):
    ids = fill(queue_agent)
    done: list[tuple[str, float, int]] = []

    def wait_for_room(name: str) -> None:
        r = post(queue_agent, spec(queue_timeout=30, labels={"who": name}))
        done.append((name, time.monotonic(), r.status))
        if r.status == 201:
            ids.append(r.json()["id"])

    first = threading.Thread(target=wait_for_room, args=("first",))
    first.start()
    time.sleep(0.3)
    second = threading.Thread(target=wait_for_room, args=("second",))
    second.start()
    try:
        time.sleep(0.7)
        assert done == [], "a create went ahead on a full node"
        destroy(queue_agent, ids.pop(0))
        assert lib.wait_for(lambda: len(done) == 1, 10)
        assert done[0][0] == "first" and done[0][2] == 201, done
        time.sleep(0.5)
        assert len(done) == 1, "the second create went ahead without room"
        # A sleep frees the cpu a sandbox held: room for the second.
        r = lib.http_request(queue_agent.socket_path, "POST", f"/v1/sandboxes/{ids[0]}/sleep", b"")
        assert r.status == 200, r
        assert lib.wait_for(lambda: len(done) == 2, 10)
        assert done[1][0] == "second" and done[1][2] == 201, done
    finally:
        first.join(40)
        second.join(40)
        for sid in ids:
            destroy(queue_agent, sid)


def test_past_its_queue_timeout_a_create_is_refused_saying_so(queue_agent):
    ids = fill(queue_agent)
    try:
        t0 = time.monotonic()
        r = post(queue_agent, spec(queue_timeout=1.0))
        took = time.monotonic() - t0
        assert r.status == 429, r
        body = r.json()
        assert body["code"] == "RESOURCE_EXHAUSTED" and "waited 1." in body["message"], body
        assert 0.9 < took < 5, took
        # Without a queue_timeout nothing waits.
        t0 = time.monotonic()
        assert post(queue_agent, spec()).status == 429
        assert time.monotonic() - t0 < 0.5
        # One that could never fit is refused at once, waiting or not.
        t0 = time.monotonic()
        r = post(queue_agent, spec(queue_timeout=30, resources={"cpu": CORES + 1, "memory": "32Mi"}))
        assert r.status == 429 and "could never fit" in r.json()["message"], r
        assert time.monotonic() - t0 < 0.5
        assert post(queue_agent, spec(queue_timeout=-1)).status == 400
        assert post(queue_agent, spec(queue_timeout=3601)).status == 400
    finally:
        for sid in ids:
            destroy(queue_agent, sid)


def test_a_waiting_create_whose_client_hangs_up_makes_nothing(queue_agent):
    ids = fill(queue_agent)
    try:
        body = json.dumps(spec(queue_timeout=30, labels={"who": "gone"})).encode()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(queue_agent.socket_path)
        s.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: dsecd\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.5)
        s.close()
        time.sleep(0.5)  # it notices within 100 ms
        destroy(queue_agent, ids.pop(0))
        time.sleep(1.0)
        assert sorted(live(queue_agent)) == sorted(ids), "the abandoned create made a sandbox"
        # The room it did not take is there for the next create.
        r = post(queue_agent, spec())
        assert r.status == 201, r
        ids.append(r.json()["id"])
    finally:
        for sid in ids:
            destroy(queue_agent, sid)


def test_the_client_library_waits_too(queue_agent):
    ids = fill(queue_agent)
    c = dsec.Client(endpoints=[queue_agent.endpoint])
    made = []
    try:
        t = threading.Thread(target=lambda: made.append(c.create("busybox", cpu=1, memory="32Mi", ttl=300,
                                                                 queue_timeout=20)))
        t.start()
        time.sleep(0.5)
        assert not made
        destroy(queue_agent, ids.pop(0))
        t.join(20)
        assert made and made[0].exec("true").exit_code == 0
    finally:
        for sb in made:
            sb.destroy()
        for sid in ids:
            destroy(queue_agent, sid)
        c.close()
