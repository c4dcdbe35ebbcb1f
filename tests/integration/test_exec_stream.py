"""Streaming exec against real container sandboxes: output arrives while the command runs, bytes and streams stay
apart, timeouts and start failures keep their meaning, a failing callback aborts only its own call, and the wire
format is chunked NDJSON."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import time

import pytest

import dsec_testlib as lib

dsec = lib.dsec


class Recorder:
    def __init__(self) -> None:
        self.chunks: list[tuple[float, str, bytes]] = []

    def __call__(self, stream: str, data: bytes) -> None:
        assert isinstance(stream, str) and isinstance(data, bytes)
        self.chunks.append((time.monotonic(), stream, data))

    def joined(self, stream: str) -> bytes:
        return b"".join(d for _, s, d in self.chunks if s == stream)


def test_chunks_arrive_before_the_command_ends(sandbox):
    rec = Recorder()
    r = sandbox.exec("echo first; sleep 1; echo second", on_output=rec, timeout=30)
    returned = time.monotonic()
    assert r.exit_code == 0 and not r.timed_out, r
    assert rec.joined("stdout") == b"first\nsecond\n"
    assert r.stdout == b"" and r.stderr == b""  # streamed, not repeated in the result
    first_at = rec.chunks[0][0]
    assert rec.chunks[0][2].startswith(b"first")
    assert returned - first_at > 0.7, f"the first chunk came only {returned - first_at:.3f} s before the result"


def test_binary_output_and_separate_streams(sandbox):
    payload = bytes(range(256)) * 1024 + b"\x00\r\n\xff"
    sandbox.write_file("/tmp/bin.dat", payload)
    rec = Recorder()
    r = sandbox.exec("cat /tmp/bin.dat; printf 'err\\0bytes' >&2; cat /tmp/bin.dat >&2", on_output=rec)
    assert r.exit_code == 0, r
    assert rec.joined("stdout") == payload
    assert rec.joined("stderr") == b"err\x00bytes" + payload
    assert {s for _, s, _ in rec.chunks} == {"stdout", "stderr"}
    assert not r.stdout_truncated and not r.stderr_truncated


def test_the_output_cap_applies_to_what_is_delivered(sandbox):
    rec = Recorder()
    r = sandbox.exec("head -c 200000 /dev/zero; echo small >&2", max_output=1000, on_output=rec)
    assert r.exit_code == 0, r
    assert rec.joined("stdout") == b"\0" * 1000
    assert rec.joined("stderr") == b"small\n"
    assert r.stdout_truncated and not r.stderr_truncated


def test_timeout_still_ends_with_a_result(sandbox):
    rec = Recorder()
    t0 = time.monotonic()
    r = sandbox.exec("echo started; sleep 30", timeout=1, on_output=rec)
    assert r.timed_out, r
    assert r.signal != 0 or r.exit_code != 0
    assert rec.joined("stdout") == b"started\n"
    assert time.monotonic() - t0 < 15


def test_a_missing_executable_is_a_result(sandbox):
    rec = Recorder()
    r = sandbox.exec(["/no/such/binary"], on_output=rec)
    assert (r.exit_code, r.reason) == (127, "executable_not_found"), r
    # Streamed: the line comes through the callback, like any other output.
    assert b"/no/such/binary: command not found" in rec.joined("stderr"), rec.chunks
    rec = Recorder()
    # An exec that never prints and fails in the shell is a result, not an error.
    r = sandbox.exec("exit 7", on_output=rec)
    assert r.exit_code == 7 and rec.chunks == []


def test_a_raising_callback_aborts_the_call_and_the_agent_keeps_serving(sandbox, client, agent):
    class Stop(Exception):
        pass

    calls = []

    def boom(stream, data):
        calls.append(data)
        raise Stop("enough")

    t0 = time.monotonic()
    with pytest.raises(Stop, match="enough"):
        sandbox.exec("echo one; sleep 2; echo two", on_output=boom, timeout=30)
    assert len(calls) == 1
    assert time.monotonic() - t0 < 1.5, "the call must end at the exception, not when the command ends"
    # The same sandbox, the same client: plain and streamed execs go on working.
    assert sandbox.exec("echo ok").stdout == b"ok\n"
    rec = Recorder()
    assert sandbox.exec("echo again", on_output=rec).exit_code == 0
    assert rec.joined("stdout") == b"again\n"
    # The abandoned command ran to its end in the agent, whose handler was not left stuck.
    time.sleep(2.5)
    assert agent.alive()
    assert lib.http_request(agent.socket_path, "GET", "/healthz").status == 200
    assert sandbox.exec("echo still").stdout == b"still\n"


def test_a_bad_callback_argument_is_refused(sandbox):
    with pytest.raises(dsec.InvalidArgument):
        sandbox.exec("echo x", on_output=42)


def test_wire_format_is_chunked_ndjson(sandbox, agent):
    body = json.dumps({"shell": "printf 'a'; printf 'b' >&2; sleep 0.3; printf 'c'", "stream": True}).encode()
    res = lib.http_request(agent.socket_path, "POST", f"/v1/sandboxes/{sandbox.id}/exec", body,
                           {"Content-Type": "application/json"})
    assert res.status == 200, res
    assert res.headers["content-type"] == "application/x-ndjson"
    assert res.headers["transfer-encoding"] == "chunked"
    lines = [json.loads(line) for line in lib.dechunk(res.body).split(b"\n") if line]
    assert all(len(line) == 1 for line in lines), lines
    out = b"".join(base64.b64decode(line["stdout"]) for line in lines if "stdout" in line)
    err = b"".join(base64.b64decode(line["stderr"]) for line in lines if "stderr" in line)
    assert (out, err) == (b"ac", b"b")
    assert "result" in lines[-1] and sum("result" in line for line in lines) == 1
    result = lines[-1]["result"]
    assert result["exit_code"] == 0 and result["stdout"] == "" and result["stderr"] == ""
    assert result["stdout_truncated"] is False and result["timed_out"] is False

    # A missing executable is a streamed result like any other: its line on stderr, then exit code 127 and why.
    missing = json.dumps({"argv": ["/no/such/binary"], "stream": True}).encode()
    res = lib.http_request(agent.socket_path, "POST", f"/v1/sandboxes/{sandbox.id}/exec", missing)
    assert res.status == 200, res
    lines = [json.loads(line) for line in lib.dechunk(res.body).split(b"\n") if line]
    assert (lines[-1]["result"]["exit_code"], lines[-1]["result"]["reason"]) == (127, "executable_not_found"), lines
    assert b"command not found" in b"".join(base64.b64decode(line["stderr"]) for line in lines if "stderr" in line)
    # Errors before any output keep the plain error answer; a non-boolean stream is refused.
    bad = json.dumps({"argv": ["true"], "user": "no-such-user", "stream": True}).encode()
    res = lib.http_request(agent.socket_path, "POST", f"/v1/sandboxes/{sandbox.id}/exec", bad)
    assert res.status == 400 and res.json()["code"] == "INVALID_ARGUMENT", res
    res = lib.http_request(agent.socket_path, "POST", f"/v1/sandboxes/{sandbox.id}/exec",
                           json.dumps({"shell": "true", "stream": "yes"}).encode())
    assert res.status == 400 and "stream" in res.json()["message"], res
    res = lib.http_request(agent.socket_path, "POST", "/v1/sandboxes/no-such-sandbox/exec",
                           json.dumps({"shell": "true", "stream": True}).encode())
    assert res.status == 404, res


def test_a_client_that_disconnects_mid_stream_does_not_stop_the_command(sandbox, agent):
    body = json.dumps({"shell": "echo go; sleep 1; echo done > /tmp/finished; yes | head -c 300000",
                       "stream": True}).encode()
    req = (f"POST /v1/sandboxes/{sandbox.id}/exec HTTP/1.1\r\nHost: dsecd\r\nContent-Length: {len(body)}\r\n\r\n"
           .encode() + body)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(agent.socket_path)
        s.sendall(req)
        got = b""
        while b"\r\n\r\n" not in got:
            got += s.recv(4096)
        assert got.startswith(b"HTTP/1.1 200"), got
    # The command runs on to its end; the agent answers others meanwhile and afterwards.
    assert lib.http_request(agent.socket_path, "GET", "/healthz").status == 200
    assert lib.wait_for(lambda: sandbox.exec("cat /tmp/finished").stdout == b"done\n", timeout=10)
    assert sandbox.exec("echo fine").stdout == b"fine\n"


def test_cli_exec_prints_output_live(sandbox, agent):
    proc = subprocess.Popen([str(lib.DSEC_CLI), "--endpoint", agent.endpoint, "exec", sandbox.id, "--", "sh", "-c",
                             "echo first; echo to-stderr >&2; sleep 1.5; echo second; exit 3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    t0 = time.monotonic()
    first = proc.stdout.readline()
    first_at = time.monotonic()
    rest, err = proc.communicate(timeout=30)
    ended = time.monotonic()
    assert first == b"first\n"
    assert rest == b"second\n"
    assert err == b"to-stderr\n"
    assert proc.returncode == 3
    assert ended - first_at > 1.0, f"first line {first_at - t0:.2f} s, end {ended - t0:.2f} s: not live"


def test_a_client_that_stops_reading_does_not_hold_the_timeout(sandbox, agent):
    # `yes` fills the socket's buffers at once; this client never reads. The command must still be killed at its
    # timeout (plus a short grace), not kept blocked on its pipe for the agent's idle timeout.
    body = json.dumps({"shell": "yes streaming-output", "timeout": 2, "stream": True}).encode()
    req = (f"POST /v1/sandboxes/{sandbox.id}/exec HTTP/1.1\r\nHost: dsecd\r\nContent-Length: {len(body)}\r\n\r\n"
           .encode() + body)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(agent.socket_path)
        s.sendall(req)
        time.sleep(1)
        assert b"yes streaming-output" in sandbox.exec("ps -o args").stdout  # running, blocked on its output
        t0 = time.monotonic()
        assert lib.wait_for(lambda: b"streaming-output" not in sandbox.exec("ps -o args").stdout, timeout=10)
        assert time.monotonic() - t0 < 5
    assert sandbox.exec("echo fine").stdout == b"fine\n"


def test_cli_run_takes_options_after_the_image(agent):
    """`dsec run IMAGE [options] CMD`, as its usage line says: options after the image are options, the first word
    that is not one starts the command, and "--" still ends the options for a command that starts with "-"."""
    cli = subprocess.run([str(lib.DSEC_CLI), "--endpoint", agent.endpoint, "run", "busybox", "--workdir", "/tmp",
                          "--env", "X=1", "sh", "-c", 'pwd; echo "$X"'], capture_output=True, timeout=60)
    assert (cli.returncode, cli.stdout) == (0, b"/tmp\n1\n"), cli
    cli = subprocess.run([str(lib.DSEC_CLI), "--endpoint", agent.endpoint, "run", "busybox", "--env", "Y=2", "--",
                          "sh", "-c", 'echo "$Y"'], capture_output=True, timeout=60)
    assert (cli.returncode, cli.stdout) == (0, b"2\n"), cli
    cli = subprocess.run([str(lib.DSEC_CLI), "--endpoint", agent.endpoint, "run", "busybox", "--no-such-option",
                          "true"], capture_output=True, timeout=60)
    assert cli.returncode != 0 and b"unknown option --no-such-option" in cli.stderr, cli


def test_cli_run_prints_output_live(agent):
    proc = subprocess.Popen([str(lib.DSEC_CLI), "--endpoint", agent.endpoint, "run", "busybox", "--", "sh", "-c",
                             "echo first; sleep 1.5; echo second >&2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    first_at = time.monotonic()
    rest, err = proc.communicate(timeout=60)
    ended = time.monotonic()
    assert (first, rest, err, proc.returncode) == (b"first\n", b"", b"second\n", 0)
    assert ended - first_at > 1.0, "dsec run printed its output only at the end"
