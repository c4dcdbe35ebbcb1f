"""Exactly-once execs against a real dsecd: a request id runs its command once however often it is sent, a repeat
while it runs waits for its result, another command under the same id is refused, and session runs take ids too.
(After an agent restart: test_recovery.py.)"""

from __future__ import annotations

import base64
import json
import threading

import pytest

import dsec_testlib as lib


def post(agent: lib.Agent, target: str, body: dict, timeout: float = 30.0) -> lib.RawResponse:
    return lib.http_request(agent.socket_path, "POST", target, json.dumps(body).encode(),
                            {"Content-Type": "application/json"}, timeout=timeout)


def exec_(agent, sid, body, timeout=30.0):
    return post(agent, f"/v1/sandboxes/{sid}/exec", body, timeout)


COUNT = "echo run >> /tmp/runs-{tag}; wc -l < /tmp/runs-{tag}"


def test_a_repeat_returns_the_first_result_and_runs_nothing(agent, module_sandbox):
    sid = module_sandbox.id
    body = {"shell": COUNT.format(tag="a"), "request_id": "once-a"}
    first = exec_(agent, sid, body)
    assert first.status == 200, first
    again = exec_(agent, sid, body)
    assert again.status == 200 and again.json() == first.json()
    assert base64.b64decode(first.json()["stdout"]) == b"1\n"
    # The command really ran once: a third run under a new id counts 2.
    third = exec_(agent, sid, {"shell": COUNT.format(tag="a"), "request_id": "once-a2"})
    assert base64.b64decode(third.json()["stdout"]) == b"2\n"


def test_a_repeat_while_the_first_runs_waits_for_it(agent, module_sandbox):
    sid = module_sandbox.id
    body = {"shell": COUNT.format(tag="b") + "; sleep 1", "request_id": "once-b"}
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(exec_(agent, sid, body))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(answers) == 3 and all(a.status == 200 for a in answers), answers
    assert {base64.b64decode(a.json()["stdout"]) for a in answers} == {b"1\n"}


def test_the_same_id_with_another_command_is_invalid(agent, module_sandbox):
    sid = module_sandbox.id
    assert exec_(agent, sid, {"shell": "true", "request_id": "once-c"}).status == 200
    r = exec_(agent, sid, {"shell": "false", "request_id": "once-c"})
    assert r.status == 400 and r.json()["code"] == "INVALID_ARGUMENT" and "once-c" in r.json()["message"], r
    r = exec_(agent, sid, {"shell": "true", "request_id": "x" * 129})
    assert r.status == 400 and "request_id" in r.json()["message"], r


def test_a_streamed_repeat_streams_the_first_output(agent, module_sandbox):
    sid = module_sandbox.id
    body = {"shell": "printf 'a\\377'; echo err >&2; " + COUNT.format(tag="d"), "request_id": "once-d",
            "stream": True}
    bodies = []
    for _ in range(2):
        r = exec_(agent, sid, body)
        assert r.status == 200, r
        lines = [json.loads(line) for line in lib.dechunk(r.body).split(b"\n") if line]
        out = b"".join(base64.b64decode(x["stdout"]) for x in lines if "stdout" in x)
        err = b"".join(base64.b64decode(x["stderr"]) for x in lines if "stderr" in x)
        bodies.append((out, err, lines[-1]["result"]["exit_code"]))
    assert bodies[0] == bodies[1] == (b"a\xff1\n", b"err\n", 0)


def test_session_runs_take_request_ids(agent, module_sandbox):
    sid = module_sandbox.id
    r = post(agent, f"/v1/sandboxes/{sid}/sessions", {"name": "once"})
    assert r.status == 200, r
    try:
        body = {"command": "N=$((${N:-0} + 1)); echo $N", "request_id": "run-1"}
        first = post(agent, f"/v1/sandboxes/{sid}/sessions/once/run", body)
        again = post(agent, f"/v1/sandboxes/{sid}/sessions/once/run", body)
        assert first.status == again.status == 200
        assert base64.b64decode(first.json()["stdout"]) == base64.b64decode(again.json()["stdout"]) == b"1\n"
        nxt = post(agent, f"/v1/sandboxes/{sid}/sessions/once/run", {"command": "echo $N"})
        assert base64.b64decode(nxt.json()["stdout"]) == b"1\n"  # the repeat did not run it a second time
    finally:
        lib.http_request(agent.socket_path, "DELETE", f"/v1/sandboxes/{sid}/sessions/once")


def test_the_client_sends_ids_and_repeats_answer_alike(module_sandbox):
    sb = module_sandbox
    first = sb.exec(COUNT.format(tag="py"), request_id="py-1")
    again = sb.exec(COUNT.format(tag="py"), request_id="py-1")
    assert first.stdout == again.stdout == b"1\n"
    # Without an id the client makes one per call: two calls run twice.
    assert sb.exec(COUNT.format(tag="py")).stdout == b"2\n"
    assert sb.exec(COUNT.format(tag="py")).stdout == b"3\n"
    with pytest.raises(lib.dsec.InvalidArgument):
        sb.exec("true", request_id="py-1")
    with pytest.raises(lib.dsec.InvalidArgument):
        sb.exec("true", request_id="x" * 200)
    # Streamed, the repeat's output comes once, as the first call's was.
    chunks = []
    r = sb.exec("printf 'a'; " + COUNT.format(tag="py"), request_id="py-2", on_output=lambda s, d: chunks.append(d))
    again = []
    sb.exec("printf 'a'; " + COUNT.format(tag="py"), request_id="py-2", on_output=lambda s, d: again.append(d))
    assert b"".join(chunks) == b"".join(again) == b"a4\n" and r.exit_code == 0


def test_spawns_stdin_writes_and_signals_take_request_ids(agent, module_sandbox):
    sid = module_sandbox.id
    base = f"/v1/sandboxes/{sid}/processes"
    # A spawn repeated with its id answers the first process and starts no second one.
    body = {"shell": "echo started >> /tmp/spawns; cat", "request_id": "spawn-1"}
    first = post(agent, base, body)
    again = post(agent, base, body)
    assert first.status == again.status == 200, (first, again)
    pid = first.json()["pid"]
    assert pid > 0 and again.json()["pid"] == pid
    other = post(agent, base, {"shell": "true", "request_id": "spawn-1"})
    assert other.status == 400 and "request_id" in other.json()["message"], other
    try:
        # A write repeated with its id reaches the process once.
        for _ in range(2):
            r = lib.http_request(agent.socket_path, "POST", f"{base}/{pid}/stdin?request_id=w-1", b"hello\n",
                                 {"Content-Type": "application/octet-stream"})
            assert r.status == 200 and r.json()["written"] == 6, r
        r = lib.http_request(agent.socket_path, "POST", f"{base}/{pid}/stdin?request_id=w-1", b"other\n",
                             {"Content-Type": "application/octet-stream"})
        assert r.status == 400, r
        r = lib.http_request(agent.socket_path, "POST", f"{base}/{pid}/stdin?close=true&request_id=w-2", b"",
                             {"Content-Type": "application/octet-stream"})
        assert r.status == 200, r
        ended = lib.http_request(agent.socket_path, "GET", f"{base}/{pid}?wait=10").json()
        assert not ended["running"] and ended["exit_code"] == 0, ended
        out = lib.http_request(agent.socket_path, "GET", f"{base}/{pid}/output?stdout=0").json()
        assert base64.b64decode(out["stdout"]) == b"hello\n"
        runs = module_sandbox.exec("cat /tmp/spawns").stdout
        assert runs == b"started\n", runs
        # A signal repeated with its id is sent once: the trap counts what arrives.
        trap = post(agent, base, {"shell": "trap 'echo usr1 >> /tmp/sigs' USR1; while :; do sleep 0.05; done",
                                  "request_id": "spawn-2"}).json()["pid"]
        module_sandbox.exec("sleep 0.3")
        for _ in range(2):
            r = post(agent, f"{base}/{trap}/signal", {"signal": "SIGUSR1", "request_id": "sig-1"})
            assert r.status == 200 and r.json()["running"], r
        module_sandbox.exec("sleep 0.5")
        assert module_sandbox.exec("cat /tmp/sigs").stdout == b"usr1\n"
        r = post(agent, f"{base}/{trap}/signal", {"signal": "SIGUSR1", "request_id": "sig-2"})
        module_sandbox.exec("sleep 0.5")
        assert module_sandbox.exec("cat /tmp/sigs").stdout == b"usr1\nusr1\n"
        lib.http_request(agent.socket_path, "DELETE", f"{base}/{trap}")
    finally:
        lib.http_request(agent.socket_path, "DELETE", f"{base}/{pid}")


def test_the_clients_spawn_is_exactly_once_by_its_id(module_sandbox):
    sb = module_sandbox
    p1 = sb.spawn("echo one >> /tmp/client-spawns; sleep 30", request_id="client-spawn-1")
    p2 = sb.spawn("echo one >> /tmp/client-spawns; sleep 30", request_id="client-spawn-1")
    try:
        assert p1.pid == p2.pid > 0
        with pytest.raises(lib.dsec.InvalidArgument):
            sb.spawn("true", request_id="client-spawn-1")
        sb.exec("while [ ! -s /tmp/client-spawns ]; do sleep 0.05; done", timeout=10)
        p1.write_stdin(b"x")  # writes and signals carry ids of their own
        p1.signal("SIGTERM")
        assert p1.wait(10).signal == 15
        assert sb.exec("cat /tmp/client-spawns").stdout == b"one\n"
    finally:
        p1.kill()
