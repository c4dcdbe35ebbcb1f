"""Test bodies for exec, streaming exec and the files API that hold for every sandbox kind, run by test_microvm.py
against a container and a microVM alike (the same bodies, so a VM is held to what a container does).

A body is a function of some of `sandbox`, `agent` (a dsec_testlib.Agent) and `client`; call it with run(). It may
use a long-lived sandbox that other bodies share: whatever it leaves (files under /scratch, /tmp and /root, background
processes) the caller's cleanup removes. The sandbox's spec has env SPEC_A=spec, SPEC_B=spec and workdir /tmp.

CONTAINER_SUITE_CASES are test_exec.py's, test_exec_stream.py's, test_api.py's and test_isolation.py's own bodies,
imported unchanged (only those that need a running sandbox and nothing of their own); CASES are the ones written
here, for what those suites check only with a fresh sandbox or not at all.
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import io
import json
import os
import tarfile
import threading
import time
import uuid

import pytest

import dsec_testlib as lib
import test_api
import test_exec
import test_exec_stream
import test_isolation

dsec = lib.dsec

SPEC_ENV = {"SPEC_A": "spec", "SPEC_B": "spec"}
WORKDIR = "/tmp"

# What a shared sandbox must not keep between bodies; the cleanup removes it (and kills every process but pid 1).
CLEANUP = ("kill -9 -1 2>/dev/null; rm -rf /scratch /data /srv /opt/a /opt/private /tmp/* /tmp/.[!.]* /root/* "
           "/root/.[!.]*; echo cleaned")


def run(case, *, sandbox, agent, client):
    """Calls a body with the fixtures it names."""
    have = {"sandbox": sandbox, "agent": agent, "client": client}
    params = inspect.signature(case).parameters
    missing = [p for p in params if p not in have]
    assert not missing, f"{case.__name__} needs {missing}, which exec_cases.run does not provide"
    return case(**{p: have[p] for p in params})


def id_of(case) -> str:
    mod = case.__module__.removeprefix("test_")
    return f"{mod}.{case.__name__.removeprefix('test_').removeprefix('case_')}"


def raw(agent, method: str, target: str, body: bytes = b"", headers: dict | None = None, timeout: float = 60.0):
    return lib.http_request(agent.socket_path, method, target, body, headers, timeout=timeout)


def expect_error(res: lib.RawResponse, status: int, code: str) -> dict:
    assert res.status == status, res
    body = res.json()
    assert body["code"] == code, body
    assert isinstance(body["message"], str) and body["message"], body
    return body


def user_processes(sandbox) -> list[str]:
    """`ps -o pid,args` of the sandbox without kernel threads, pid 1 and the ps pipeline itself."""
    out = sandbox.exec("ps -o pid,args").stdout.decode()
    lines = []
    for line in out.strip().splitlines()[1:]:
        pid, _, args = line.strip().partition(" ")
        args = args.strip()
        if pid == "1" or args.startswith("[") or "ps -o pid,args" in args:
            continue
        lines.append(line.strip())
    return lines


# ---------------------------------------------------------------------------------------------------- reused bodies

CONTAINER_SUITE_CASES = [
    test_exec.test_exit_codes,
    test_exec.test_signal_ends_command,
    test_exec.test_commands_start_with_default_signal_state,
    test_exec.test_stdout_stderr_are_separate_bytes,
    test_exec.test_binary_output_round_trips,
    test_exec.test_stdin_is_fed_then_closed,
    test_exec.test_argv_is_not_a_shell,
    test_exec.test_shell_command_not_found_is_a_result,
    test_exec.test_concurrent_execs_in_one_sandbox,
    test_exec.test_state_persists_between_execs,
    test_exec.test_output_cap_truncates,
    test_exec.test_timeout_returns_near_the_deadline,
    test_exec.test_timed_out_exec_leaves_no_process,
    test_exec.test_timed_out_exec_kills_setsid_children,
    test_exec_stream.test_chunks_arrive_before_the_command_ends,
    test_exec_stream.test_binary_output_and_separate_streams,
    test_exec_stream.test_the_output_cap_applies_to_what_is_delivered,
    test_exec_stream.test_timeout_still_ends_with_a_result,
    test_exec_stream.test_a_missing_executable_is_a_result,
    test_exec_stream.test_a_raising_callback_aborts_the_call_and_the_agent_keeps_serving,
    test_exec_stream.test_a_bad_callback_argument_is_refused,
    test_exec_stream.test_wire_format_is_chunked_ndjson,
    test_exec_stream.test_a_client_that_disconnects_mid_stream_does_not_stop_the_command,
    test_exec_stream.test_cli_exec_prints_output_live,
    test_exec_stream.test_a_client_that_stops_reading_does_not_hold_the_timeout,
    test_api.test_write_read_binary_file,
    test_api.test_write_file_creates_parent_dirs_and_sets_mode,
    test_api.test_tar_upload_and_download_of_a_directory,
    test_isolation.test_host_files_invisible,
    test_isolation.test_host_mounts_invisible,
    test_isolation.test_planted_symlinks_do_not_reach_the_host,
]


# ---------------------------------------------------------------------------------------------------- exec

def case_argv_and_shell_forms(sandbox):
    r = sandbox.exec(["printf", "%s|", "a b", "", "$X", "*"])
    assert (r.exit_code, r.stdout) == (0, b"a b||$X|*|"), r
    r = sandbox.exec("X=1; printf '%s|' \"$X\" $((X + 41)); exit 3")
    assert (r.exit_code, r.stdout) == (3, b"1|42|"), r
    r = sandbox.exec(["sh", "-c", "exit 200"])
    assert r.exit_code == 200 and r.signal == 0 and not r.timed_out, r


def case_exec_as_a_user(sandbox):
    # A name of the image's /etc/passwd, and a uid:gid it does not have: the ids, groups and HOME they get.
    r = sandbox.exec('id -u; id -g; id -G; echo "$HOME"; echo "$USER"', user="nobody")
    assert r.stdout == b"65534\n65534\n65534\n/nonexistent\nnobody\n", r
    r = sandbox.exec('id -u; id -g; id -G; echo "$HOME"', user="1000:1000")
    assert r.stdout == b"1000\n1000\n1000\n/\n", r
    assert sandbox.exec("id -u", user="root").stdout == b"0\n"
    # Another user has no capability, and a file only root may read stays unread (exit 42 only on that path).
    r = sandbox.exec(["grep", "CapEff", "/proc/self/status"], user="1000:1000")
    assert r.stdout == b"CapEff:\t0000000000000000\n", r
    assert sandbox.exec("echo s > /tmp/root-only && chmod 600 /tmp/root-only").exit_code == 0
    r = sandbox.exec("cat /tmp/root-only 2>/dev/null || exit 42", user="nobody")
    assert r.exit_code == 42 and r.stdout == b"", r
    with pytest.raises(dsec.InvalidArgument, match="'mallory' is not a user of this sandbox"):
        sandbox.exec("true", user="mallory")


def case_signals(sandbox):
    r = sandbox.exec("kill -9 $$")
    assert (r.exit_code, r.signal, r.timed_out) == (-1, 9, False), r
    r = sandbox.exec(["sh", "-c", "kill -SEGV $$"])
    assert r.signal == 11, r
    # A signal to a child is the child's: the shell reports it as 128 + n.
    r = sandbox.exec("sh -c 'kill -TERM $$'; echo $?")
    assert r.stdout == b"143\n" and r.signal == 0, r


def case_env_spec_and_exec(sandbox):
    r = sandbox.exec('echo "$SPEC_A $SPEC_B ${EXEC_C-unset}"')
    assert r.stdout == b"spec spec unset\n", r
    r = sandbox.exec('echo "$SPEC_A $SPEC_B $EXEC_C"', env={"SPEC_B": "exec", "EXEC_C": "exec"})
    assert r.stdout == b"spec exec exec\n", r
    env = dict(line.split("=", 1) for line in sandbox.exec(["env"]).stdout.decode().splitlines() if "=" in line)
    assert env["SPEC_A"] == "spec" and env["HOME"] == "/root", env
    assert "/bin" in env["PATH"].split(":"), env
    assert env.get("HOSTNAME") == sandbox.id, env
    assert env.get("LANG") == "C.UTF-8", env  # UTF-8 unless the spec or the exec says otherwise
    assert sandbox.exec('echo "$LANG"', env={"LANG": "en_US.UTF-8"}).stdout == b"en_US.UTF-8\n"
    # The request's env overrides the defaults too, and values keep their bytes.
    assert sandbox.exec('echo "$HOME"', env={"HOME": "/tmp"}).stdout == b"/tmp\n"
    assert sandbox.exec(["sh", "-c", 'printf %s "$V"'], env={"V": "a b=c;'\"$x"}).stdout == b"a b=c;'\"$x"


def case_cwd(sandbox, agent):
    assert sandbox.exec(["pwd"]).stdout == f"{WORKDIR}\n".encode()
    assert sandbox.exec("pwd").stdout == f"{WORKDIR}\n".encode()
    assert sandbox.exec(["pwd"], cwd="/etc").stdout == b"/etc\n"
    sandbox.exec("mkdir -p /scratch/sub")
    assert sandbox.exec("pwd", cwd="/scratch/sub").stdout == b"/scratch/sub\n"
    # A working directory that is not there is what the command named: a result, as a shell would give it.
    r = sandbox.exec(["true"], cwd="/no/such/dir")
    assert (r.exit_code, r.reason) == (127, "cwd_not_found") and b"/no/such/dir" in r.stderr, r
    res = raw(agent, "POST", f"/v1/sandboxes/{sandbox.id}/exec",
              json.dumps({"argv": ["true"], "cwd": "/no/such/dir"}).encode())
    assert res.status == 200 and json.loads(res.body)["reason"] == "cwd_not_found", res
    # A file is not a directory to run in.
    sandbox.write_file("/scratch/file", b"x")
    r = sandbox.exec(["true"], cwd="/scratch/file")
    assert (r.exit_code, r.reason) == (127, "cwd_not_found"), r
    with pytest.raises(dsec.InvalidArgument):
        sandbox.exec(["true"], cwd="relative/dir")


def case_missing_binary_is_a_result(sandbox, agent):
    """What the task's command names is the task's: a missing executable is exit code 127 with a reason, as a shell
    gives it, never an exception (a trainer must not mask it as the infrastructure's fault)."""
    for argv0 in ("/no/such/binary", "no-such-binary-on-path"):
        r = sandbox.exec([argv0, "arg"])
        assert (r.exit_code, r.reason) == (127, "executable_not_found"), r
        assert argv0.encode() in r.stderr and not r.timed_out, r
        res = raw(agent, "POST", f"/v1/sandboxes/{sandbox.id}/exec", json.dumps({"argv": [argv0]}).encode())
        assert res.status == 200 and json.loads(res.body)["exit_code"] == 127, res
    # Not executable: a file without x bits.
    sandbox.write_file("/scratch/noexec", b"#!/bin/sh\necho ran\n", 0o644)
    r = sandbox.exec(["/scratch/noexec"])
    assert (r.exit_code, r.reason) == (126, "not_executable") and r.stdout == b"", r
    # A command that ran has no reason.
    assert sandbox.exec("echo still").stdout == b"still\n" and sandbox.exec("exit 127").reason == ""


def case_stdin_megabytes_round_trip(sandbox):
    data = os.urandom(5 << 20) + b"\x00" * 4096 + os.urandom(12345)
    r = sandbox.exec(["cat"], stdin=data, timeout=120)
    assert r.exit_code == 0 and not r.stdout_truncated, r
    assert len(r.stdout) == len(data) and hashlib.sha256(r.stdout).digest() == hashlib.sha256(data).digest()
    r = sandbox.exec(["sha256sum"], stdin=data, timeout=120)
    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest(), r
    # Stdin the command stops reading part-way is dropped, not a hang.
    r = sandbox.exec("head -c 10 >/dev/null; echo read", stdin=os.urandom(3 << 20), timeout=30)
    assert r.stdout == b"read\n" and not r.timed_out, r


def case_output_cap_is_exact(sandbox):
    payload = os.urandom(1 << 20)
    sandbox.write_file("/scratch/payload", payload)
    r = sandbox.exec("cat /scratch/payload; cat /scratch/payload >&2", max_output=12345)
    assert r.exit_code == 0, r
    assert r.stdout == payload[:12345] and r.stdout_truncated, (len(r.stdout), r)
    assert r.stderr == payload[:12345] and r.stderr_truncated, (len(r.stderr), r)
    # Exactly at the cap: all of it, not truncated; one byte over: truncated.
    r = sandbox.exec("head -c 4096 /scratch/payload", max_output=4096)
    assert r.stdout == payload[:4096] and not r.stdout_truncated, r
    r = sandbox.exec("head -c 4097 /scratch/payload", max_output=4096)
    assert r.stdout == payload[:4096] and r.stdout_truncated, r
    # A cap of 0 keeps nothing.
    r = sandbox.exec("echo x; echo y >&2", max_output=0)
    assert (r.stdout, r.stderr, r.stdout_truncated, r.stderr_truncated) == (b"", b"", True, True), r


def case_large_output(sandbox):
    n = 8 << 20
    line = b"0123456789abcdef\n"
    expected = (line * (n // len(line) + 1))[:n]
    t0 = time.monotonic()
    r = sandbox.exec(f"yes 0123456789abcdef | head -c {n}", timeout=120)
    assert r.exit_code == 0 and not r.stdout_truncated, r
    assert len(r.stdout) == n and hashlib.sha256(r.stdout).digest() == hashlib.sha256(expected).digest()
    # Random bytes, both streams at once.
    payload = os.urandom(8 << 20)
    sandbox.write_file("/scratch/big", payload)
    r = sandbox.exec("cat /scratch/big & cat /scratch/big >&2; wait", timeout=120)
    assert r.exit_code == 0, r
    assert hashlib.sha256(r.stdout).digest() == hashlib.sha256(payload).digest(), len(r.stdout)
    assert hashlib.sha256(r.stderr).digest() == hashlib.sha256(payload).digest(), len(r.stderr)
    assert time.monotonic() - t0 < 90


def case_background_process_survives_its_exec(sandbox):
    t0 = time.monotonic()
    r = sandbox.exec("sleep 3131 & echo started", timeout=30)
    assert r.stdout == b"started\n" and r.exit_code == 0 and not r.timed_out, r
    assert time.monotonic() - t0 < 3, "an exec waited for its background process"
    assert any("sleep 3131" in p for p in user_processes(sandbox))
    # Still there a little later, after other execs came and went.
    for i in range(3):
        assert sandbox.exec(f"echo {i}").stdout == f"{i}\n".encode()
    assert any("sleep 3131" in p for p in user_processes(sandbox))


def case_timeout_kills_the_whole_tree(sandbox):
    t0 = time.monotonic()
    r = sandbox.exec("for i in 1 2 3; do sh -c 'sleep 3301 & sleep 3302' & done; (sleep 3303 &); "
                     "setsid sleep 3304 & echo forked; sleep 3305", timeout=2)
    elapsed = time.monotonic() - t0
    assert r.timed_out and not r.ok, r
    assert r.stdout == b"forked\n", r
    assert 1.9 <= elapsed < 6, f"timeout 2 s returned after {elapsed:.2f}s"

    def gone():
        return not [p for p in user_processes(sandbox) if "sleep 330" in p]

    assert lib.wait_for(gone, 3, 0.2), user_processes(sandbox)


def case_concurrent_execs_with_their_own_bytes(sandbox):
    inputs = [os.urandom(256 << 10) + str(i).encode() for i in range(8)]
    results, errors = {}, []

    def run_one(i):
        try:
            results[i] = sandbox.exec(f"cat; echo err{i} >&2; exit {i}", stdin=inputs[i], timeout=120)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run_one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not errors, errors
    assert sorted(results) == list(range(8))
    for i, r in results.items():
        assert r.exit_code == i and r.stdout == inputs[i] and r.stderr == f"err{i}\n".encode(), (i, r)


# ---------------------------------------------------------------------------------------------------- files

def case_binary_file_round_trip(sandbox):
    payload = b"\x00" * 1000 + os.urandom(5 << 20) + b"\x00\x00\xff"
    sandbox.write_file("/scratch/blob.bin", payload, 0o640)
    assert sandbox.read_file("/scratch/blob.bin") == payload
    r = sandbox.exec("sha256sum /scratch/blob.bin; stat -c %a:%s /scratch/blob.bin")
    digest, _, rest = r.stdout.decode().partition(" ")
    assert digest == hashlib.sha256(payload).hexdigest(), r
    assert rest.split()[-1] == f"640:{len(payload)}", r
    sandbox.write_file("/scratch/blob.bin", b"short")
    assert sandbox.read_file("/scratch/blob.bin") == b"short"
    sandbox.write_file("/scratch/empty", b"")
    assert sandbox.read_file("/scratch/empty") == b""


def case_missing_file_is_404(sandbox, agent):
    with pytest.raises(dsec.NotFound):
        sandbox.read_file("/scratch/no/such/file")
    res = raw(agent, "GET", f"/v1/sandboxes/{sandbox.id}/files?path=/scratch/no-such-file")
    expect_error(res, 404, "NOT_FOUND")
    with pytest.raises(dsec.NotFound):
        sandbox.download_tar("/scratch/no-such-dir")
    with pytest.raises(dsec.InvalidArgument):
        sandbox.read_file("relative/path")


def case_directory_read_answers_a_tar(sandbox, agent):
    sandbox.exec("mkdir -p /scratch/d/sub && printf one > /scratch/d/a && printf two > /scratch/d/sub/b")
    res = raw(agent, "GET", f"/v1/sandboxes/{sandbox.id}/files?path=/scratch/d")
    assert res.status == 200, res
    assert res.headers["content-type"].startswith("application/x-tar"), res.headers
    with tarfile.open(fileobj=io.BytesIO(res.body), mode="r:*") as tar:
        files = {m.name.removeprefix("./"): tar.extractfile(m).read() for m in tar if m.isfile()}
    assert files == {"a": b"one", "sub/b": b"two"}, files
    # format=tar of a directory is the same; format=raw insists on one file.
    res = raw(agent, "GET", f"/v1/sandboxes/{sandbox.id}/files?path=/scratch/d&format=tar")
    assert res.status == 200 and res.headers["content-type"].startswith("application/x-tar"), res
    res = raw(agent, "GET", f"/v1/sandboxes/{sandbox.id}/files?path=/scratch/d&format=raw")
    assert 400 <= res.status < 500, res
    # The binding refuses a directory for read_file.
    with pytest.raises(dsec.InvalidArgument):
        sandbox.read_file("/scratch/d")


def _tree_tar() -> tuple[bytes, dict]:
    buf = io.BytesIO()
    files = {"bin/run.sh": (b"#!/bin/sh\necho ran\n", 0o755), "etc/secret": (b"s3cret\x00", 0o600),
             "data/blob": (os.urandom(300_000), 0o644)}
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d, mode in (("bin", 0o755), ("etc", 0o750), ("data", 0o700)):
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = mode
            tar.addfile(info)
        for name, (data, mode) in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = mode
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("data/hard")
        info.type = tarfile.LNKTYPE
        info.linkname = "data/blob"
        tar.addfile(info)
        for name, target in (("bin/link", "run.sh"), ("abs", "/etc/passwd")):
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return buf.getvalue(), files


def case_tar_round_trip_with_modes_and_links(sandbox):
    tar_bytes, files = _tree_tar()
    sandbox.upload_tar("/scratch/tree", tar_bytes)
    r = sandbox.exec("cd /scratch/tree && stat -c '%n %a' bin etc data && "
                     "stat -c '%n %a %h' bin/run.sh etc/secret data/blob data/hard && "
                     "readlink bin/link && readlink abs && "
                     "test $(stat -c %i data/blob) = $(stat -c %i data/hard) && bin/link")
    assert r.exit_code == 0, r
    assert r.stdout.decode().splitlines() == [
        "bin 755", "etc 750", "data 700", "bin/run.sh 755 1", "etc/secret 600 1", "data/blob 644 2",
        "data/hard 644 2", "run.sh", "/etc/passwd", "ran"], r.stdout
    assert sandbox.read_file("/scratch/tree/data/hard") == files["data/blob"][0]

    got, modes, links, hard = {}, {}, {}, {}
    with tarfile.open(fileobj=io.BytesIO(sandbox.download_tar("/scratch/tree")), mode="r:*") as tar:
        for m in tar:
            name = m.name.removeprefix("./")
            modes[name] = m.mode & 0o7777
            if m.isfile():
                got[name] = tar.extractfile(m).read()
            elif m.issym():
                links[name] = m.linkname
            elif m.islnk():
                hard[name] = m.linkname.removeprefix("./")
    for name, (data, mode) in files.items():
        assert modes[name] == mode, (name, oct(modes[name]))
    assert (modes["bin"], modes["etc"], modes["data"]) == (0o755, 0o750, 0o700), modes
    assert links == {"bin/link": "run.sh", "abs": "/etc/passwd"}, links
    # The second name of a hard link comes back as a link to the first (or, from a tier that does not track
    # links, as the same bytes).
    if hard:
        assert set(hard.items()) in ({("data/hard", "data/blob")}, {("data/blob", "data/hard")}), hard
        assert len(got) == 3
    else:
        assert got["data/hard"] == files["data/blob"][0]
    assert {k: v for k, v in got.items() if k != "data/hard"} == {k: v[0] for k, v in files.items()
                                                                  if k in got}


def case_links_resolve_inside_the_sandbox(sandbox):
    with open("/etc/passwd", "rb") as f:
        host_passwd = f.read()
    own = sandbox.exec(["cat", "/etc/passwd"]).stdout
    assert own and own != host_passwd
    marker = f"dsec-marker-{uuid.uuid4().hex[:8]}"
    sandbox.exec("mkdir -p /scratch && ln -s /etc/passwd /scratch/pw && ln -s / /scratch/root && "
                 "ln -s ../../../../../../../tmp /scratch/up && ln -s /etc /scratch/etc")
    for path in ("/scratch/pw", "/scratch/root/etc/passwd", "/scratch/../../../../etc/passwd",
                 "/../../../etc/passwd", "/scratch/etc/passwd", "/scratch/up/../etc/passwd"):
        assert sandbox.read_file(path) == own, path
    # Writes through the links land in the sandbox's /tmp, never in the host's.
    for path in (f"/scratch/up/{marker}", f"/scratch/root/tmp/{marker}", f"/../../tmp/{marker}"):
        sandbox.write_file(path, path.encode())
        assert sandbox.exec(["cat", f"/tmp/{marker}"]).stdout == path.encode(), path
        assert not os.path.exists(f"/tmp/{marker}"), f"write_file({path!r}) reached the host"
    tar = sandbox.download_tar("/scratch/etc")
    assert b"root:x:0:0" in tar and host_passwd not in tar


def case_proc_and_sys_are_refused(sandbox, agent):
    before = sandbox.exec(["hostname"]).stdout
    for path in ("/proc/sys/kernel/hostname", "/sys/kernel/uevent_helper", "/proc/self/fd/0"):
        with pytest.raises(dsec.InvalidArgument) as e:
            sandbox.write_file(path, b"evil")
        assert "crosses a mount" in str(e.value), str(e.value)
        res = raw(agent, "PUT", f"/v1/sandboxes/{sandbox.id}/files?path={path}", b"evil")
        assert "crosses a mount" in expect_error(res, 400, "INVALID_ARGUMENT")["message"]
    with pytest.raises(dsec.InvalidArgument):
        sandbox.upload_tar("/proc/sys/kernel", test_isolation._one_file_tar("hostname", b"evil"))
    # A link planted to reach them is refused the same way.
    sandbox.exec("mkdir -p /scratch && ln -s /proc/sys/kernel /scratch/k")
    with pytest.raises(dsec.InvalidArgument):
        sandbox.write_file("/scratch/k/hostname", b"evil")
    with pytest.raises(dsec.DsecError):
        sandbox.read_file("/proc/self/environ")
    assert sandbox.exec(["hostname"]).stdout == before


def case_fifo_does_not_block_the_agent(sandbox, agent):
    sandbox.exec("mkdir -p /scratch/f && mkfifo /scratch/f/fifo && printf x > /scratch/f/file")
    for op in (lambda: sandbox.read_file("/scratch/f/fifo"), lambda: sandbox.write_file("/scratch/f/fifo", b"x")):
        t0 = time.monotonic()
        with pytest.raises(dsec.DsecError) as e:
            op()
        assert not isinstance(e.value, (dsec.Internal, dsec.Unavailable, dsec.DeadlineExceeded)), e.value
        assert time.monotonic() - t0 < 3
    # A tree with a FIFO in it downloads (the FIFO left out or as an entry), without hanging on it.
    t0 = time.monotonic()
    with tarfile.open(fileobj=io.BytesIO(sandbox.download_tar("/scratch/f")), mode="r:*") as tar:
        names = {m.name.removeprefix("./"): m for m in tar}
    assert time.monotonic() - t0 < 5
    assert names["file"].isfile() and ("fifo" not in names or names["fifo"].isfifo()), names
    assert sandbox.exec("echo fine").stdout == b"fine\n"
    assert raw(agent, "GET", "/healthz").status == 200


def case_processes_and_sessions(sandbox, agent):
    """A shell session keeps its directory, exports and functions; a run's timeout leaves it usable; a spawned
    process takes stdin after it started and is read when it ended; a pty process sees its terminal's size."""
    base = f"/v1/sandboxes/{sandbox.id}"

    def post(target, body):
        r = raw(agent, "POST", base + target, json.dumps(body).encode(), {"Content-Type": "application/json"})
        assert r.status == 200, r
        return r.json()

    assert post("/sessions", {"name": "case"})["alive"]
    try:
        run = post("/sessions/case/run", {"command": "mkdir -p /srv/w && cd /srv/w; export X=7; f() { echo fn$1; }"})
        assert run["exit_code"] == 0, run
        run = post("/sessions/case/run", {"command": "pwd; echo $X; f 2; printf 'no newline'"})
        assert base64.b64decode(run["stdout"]) == b"/srv/w\n7\nfn2\nno newline", run
        run = post("/sessions/case/run", {"command": "sleep 30", "timeout": 1})
        assert run["timed_out"] and run.get("reason", "") == "", run
        run = post("/sessions/case/run", {"command": "echo $X; pwd"})
        assert base64.b64decode(run["stdout"]) == b"7\n/srv/w\n", run
    finally:
        raw(agent, "DELETE", base + "/sessions/case")

    pid = post("/processes", {"shell": "read a; echo got $a; exit 5"})["pid"]
    r = raw(agent, "POST", base + f"/processes/{pid}/stdin?close=true", b"hi\n")
    assert r.status == 200, r
    r = raw(agent, "GET", base + f"/processes/{pid}?wait=30")
    assert r.status == 200 and r.json()["exit_code"] == 5, r
    out = raw(agent, "GET", base + f"/processes/{pid}/output?stdout=0").json()
    assert base64.b64decode(out["stdout"]) == b"got hi\n", out
    assert raw(agent, "DELETE", base + f"/processes/{pid}").status == 200

    pid = post("/processes", {"argv": ["sh", "-c", "stty size; tty"], "pty": True, "rows": 33, "cols": 77})["pid"]
    assert raw(agent, "GET", base + f"/processes/{pid}?wait=30").json()["running"] is False
    out = raw(agent, "GET", base + f"/processes/{pid}/output?stdout=0").json()
    assert base64.b64decode(out["stdout"]).startswith(b"33 77\r\n/dev/pts/"), out
    assert raw(agent, "DELETE", base + f"/processes/{pid}").status == 200


CASES = [obj for name, obj in list(globals().items()) if name.startswith("case_") and callable(obj)]
