"""A node that cannot run microVMs (no QEMU, no guest kernel) still serves its other backends: GET /v1/node says why
microvm is not offered, a microvm create is refused with a clear 400 and containers work as ever. No VM boots."""

from __future__ import annotations

import json
import shutil
import tempfile

import pytest

import dsec_testlib as lib


@pytest.mark.parametrize("flag,words", [
    (["--microvm-qemu", "/nonexistent/qemu-system-x86_64"], "is not an executable"),
    (["--microvm-kernel", "/nonexistent/vmlinux"], "/nonexistent/vmlinux"),
], ids=["no-qemu", "no-kernel"])
def test_microvm_not_offered_says_why(flag, words):
    home = tempfile.mkdtemp(prefix="dsec-it-nomvm-")
    agent = lib.Agent(home, tag="nomvm", extra_args=["--backends", "container,microvm", *flag])
    try:
        lib.build_busybox_image(home)
        agent.start()
        node = lib.http_request(agent.socket_path, "GET", "/v1/node").json()
        assert "microvm" not in node["backends"], node["backends"]
        assert "container" in node["backends"]
        m = node["microvm"]
        assert m["offered"] is False, m
        assert words in m["unavailable"], m
        res = lib.http_request(agent.socket_path, "POST", "/v1/sandboxes",
                               json.dumps({"image": "busybox", "kind": "microvm"}).encode())
        assert res.status == 400, res
        assert res.json()["code"] == "INVALID_ARGUMENT" and "microvm" in res.json()["message"], res.json()
        res = lib.http_request(agent.socket_path, "POST", "/v1/sandboxes",
                               json.dumps({"image": "busybox", "kind": "container"}).encode())
        assert res.status == 201, res
        sid = res.json()["id"]
        res = lib.http_request(agent.socket_path, "POST", f"/v1/sandboxes/{sid}/exec",
                               json.dumps({"argv": ["echo", "ok"]}).encode())
        assert res.status == 200 and res.json()["exit_code"] == 0, res
        assert lib.http_request(agent.socket_path, "DELETE", f"/v1/sandboxes/{sid}").status == 200
    finally:
        status = agent.stop()
        problems = agent.leftovers()
        if not problems:
            agent.remove_husks()
        shutil.rmtree(home, ignore_errors=True)
    assert status == 0
    assert not problems, problems
