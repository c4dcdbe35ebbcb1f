"""The microvm backend against a real dsecd: every sandbox a QEMU microvm with its own guest kernel, dsec-init as its
pid 1, exec and files over the guest wire.

Boots are slow where there is no usable KVM (TCG: 1.5-3 s a boot on a small machine), so most tests share one
long-lived VM (and its container twin: the exec, stream and files bodies of exec_cases.py run against both kinds, so a
VM is held to what a container does); after each test a cleanup kills every process of the shared sandbox but its
pid 1 and removes what the test wrote. Only what destroys, limits or compares VMs gets VMs of its own: the disk
limit (then destroy), TTL expiry, a VM with protected paths, two VMs side by side, and a VM that stops under its
sandbox (QEMU killed, the guest powering off, a guest panic). All but the disk-limit VM have the shared VM's shape
(image, memory, vCPUs, disk), so the agent makes them as clones of its template of that shape (one frozen guest)
rather than boots of their own: four boots in all, the shared VM and the disk-limit VM and the agent's template of
each. At most three of the tests' VMs run at once (and a template boot beside them), but for the fork test's five (a
VM, three copies, a copy of a copy).

The last section sleeps and wakes VMs, forks them and kills the agent: a VM's processes (a background counter) stand
still while it sleeps, run on in each copy of a fork, and go on while no agent runs; the restarted agent takes its VMs
back. None of it boots (sleep, wake and fork save and restore; every VM there has the shared VM's shape) but the
restarted agent's template (a restart drops the templates of the agent's earlier run): five boots in the module. The
restart test comes last, as it kills the module's agent (or a dedicated one when the module runs on the session's).

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
    return [pid for pid, argv in lib.process_argvs() if any(sandbox_id.encode() in a for a in argv)]


def run_dir_entries(agent) -> set[str]:
    try:
        return {e for e in os.listdir(agent.run_dir) if not e.startswith(".")}
    except FileNotFoundError:
        return set()


def assert_gone(agent, client, sandbox_id: str) -> None:
    """A destroyed VM left nothing: no QEMU, no run dir, no cgroup, no mount; destroy again is fine."""
    assert lib.wait_for(lambda: not qemu_pids(sandbox_id), 10), \
        f"QEMU of {sandbox_id} still runs: {qemu_pids(sandbox_id)}"
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
        own.stop()
        husk = os.path.join(own.run_dir, ".microvm")
        try:
            own.stop_and_check([f"{husk} (the microvm backend's work directory, left at shutdown)"]
                               if os.path.isdir(husk) else [])
        finally:
            shutil.rmtree(home, ignore_errors=True)


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


# ---------------------------------------------------------------------------------------------- the same as a container

@pytest.mark.parametrize("case", exec_cases.CONTAINER_SUITE_CASES + exec_cases.CASES, ids=exec_cases.id_of)
def test_same_as_a_container(case, sb, mvm, mclient):
    exec_cases.run(case, sandbox=sb, agent=mvm, client=mclient)


# --------------------------------------------------------------------------------------------------- node and isolation

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
    assert r.oom_killed, r  # reported as an OOM kill, as a container's is
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
    small = vmc.exec(["probe", "memhog", "16"], timeout=60)
    assert small.exit_code == 0 and not small.oom_killed
    # A SIGKILL the command sends itself after that is not an OOM kill.
    assert not vmc.exec("kill -9 $$").oom_killed
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


def test_protected_paths_and_a_default_user_in_a_vm(mvm, mclient):
    # The shared VM's shape (a clone of its template), with nobody as the default user and a protected path made at
    # create: what root puts there stays out of nobody's reach (exit 42 only on that path), root inside reads it.
    sb = mclient.create(image="busybox", kind="microvm", ttl=300, memory=VM_MEMORY, user="nobody",
                        protected_paths=["/grader"])
    sid = sb.id
    try:
        sb.write_file("/grader/secret.txt", b"s3cret\n", 0o644)
        assert sb.exec("stat -c '%u:%g %a' /grader", user="root").stdout == b"0:0 700\n"
        r = sb.exec("id -u; cat /grader/secret.txt 2>/dev/null || cat /proc/1/root/grader/secret.txt 2>/dev/null || "
                    "ls /grader 2>/dev/null || exit 42")
        assert (r.exit_code, r.stdout) == (42, b"65534\n"), r
        assert sb.exec(["cat", "/grader/secret.txt"], user="root").stdout == b"s3cret\n"
    finally:
        sb.destroy()
    assert_gone(mvm, mclient, sid)


def test_a_batch_vm_runs_sched_idle_and_says_what_it_got(mvm, mclient):
    """Every thread of a batch VM's QEMU runs SCHED_IDLE (docs/qos.md); the sandbox's info says so."""
    sb = mclient.create(image="busybox", kind="microvm", ttl=300, memory=VM_MEMORY, priority="batch")
    sid = sb.id
    try:
        assert sb.exec("true").exit_code == 0
        (pid,) = qemu_pids(sid)
        policies = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            policies[int(tid)] = int(stat[stat.rindex(")") + 2:].split()[38])
        assert policies and set(policies.values()) == {5}, policies  # 5: SCHED_IDLE
        assert "SCHED_IDLE (its QEMU)" in sb.info().qos.granted
    finally:
        sb.destroy()
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
    # QEMU itself out of memory: the VM's cgroup (guest RAM plus QEMU's overhead) is lowered to just above what it
    # holds, and the guest fills its RAM: the kernel's OOM killer ends QEMU, and the sandbox says so.
    "qemu-oom": "head -c 100000000 /dev/zero > /dev/shm/fill",
}


def lower_memory_limit_to_its_charge(agent, sandbox_id: str, headroom: int) -> None:
    d = agent.cgroup_dir("memory", sandbox_id)
    v1 = os.path.exists(os.path.join(d, "memory.limit_in_bytes"))
    with open(os.path.join(d, "memory.usage_in_bytes" if v1 else "memory.current")) as f:
        charged = int(f.read())
    with open(os.path.join(d, "memory.limit_in_bytes" if v1 else "memory.max"), "w") as f:
        f.write(str(charged + headroom))


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
            if how == "qemu-oom":
                lower_memory_limit_to_its_charge(mvm, sid, 16 << 20)
            run(STOPS[how], 20)
        assert time.monotonic() - t0 < 15, f"the exec that stopped the VM took {time.monotonic() - t0:.1f}s"
        if "error" in outcome:
            e = outcome["error"]
            assert isinstance(e, (dsec.FailedPrecondition, dsec.Unavailable, dsec.SandboxLost)), repr(e)
        else:
            r = outcome["result"]
            assert r.signal or r.exit_code != 0, r

        assert lib.wait_for(lambda: sb.info().state == "failed", 10, 0.2), sb.info()
        info = sb.info()
        assert info.message, info
        if how == "qemu-oom":
            assert "out-of-memory killer" in info.message, info.message
        # QEMU, the cgroup and the uid go as soon as the VM is found stopped; the record stays until destroy.
        assert lib.wait_for(lambda: not qemu_pids(sid), 10), qemu_pids(sid)
        assert node_info(mvm)["microvm"]["vms"] == vms
        res = lib.http_request(mvm.socket_path, "POST", f"/v1/sandboxes/{sid}/exec",
                               json.dumps({"argv": ["true"]}).encode())
        exec_cases.expect_error(res, 412, "FAILED_PRECONDITION")
        res = lib.http_request(mvm.socket_path, "GET", f"/v1/sandboxes/{sid}/files?path=/etc/passwd")
        exec_cases.expect_error(res, 412, "FAILED_PRECONDITION")
        # The VM stopped: the infrastructure's failure, not the caller's (a trainer masks this rollout).
        with pytest.raises(dsec.SandboxLost):
            sb.exec("true")
        with pytest.raises(dsec.InfraError):
            sb.write_file("/tmp/x", b"x")
        assert metric(mvm, "dsec_sandboxes_failed_total", kind="microvm") == failed + 1
        assert sid in {i.id for i in mclient.list()}
        # The shared VM did not notice.
        assert vm.exec("echo other").stdout == b"other\n"
    finally:
        sb.destroy()
    assert_gone(mvm, mclient, sid)


def test_a_guest_cannot_grow_its_console_log_without_bound(vmc, mvm):
    """A guest writing its serial console without pause grows the host's console.log (on /run, memory on most hosts)
    only to its bound: the reaper cuts it to its last lines, after a line that says so."""
    logs = [os.path.join(d, "console.log") for d, _, files in os.walk(mvm.run_dir)
            if vmc.id in d and "console.log" in files]
    assert len(logs) == 1, logs
    # 1.6 MiB of lines, past the 1 MiB bound (about 11 s under TCG).
    r = vmc.exec("i=0; while [ $i -lt 1600 ]; do head -c 1023 /dev/zero | tr '\\0' x; echo; i=$((i+1)); done "
                 ">/dev/console", timeout=300)
    assert r.exit_code == 0, r
    assert lib.wait_for(lambda: os.path.getsize(logs[0]) <= 1 << 20, 10), os.path.getsize(logs[0])
    with open(logs[0], "rb") as f:
        text = f.read()
    assert b"earlier bytes of this log dropped" in text, text[:200]
    assert b"x" * 1023 + b"\r\n" in text, "the guest's last lines stay (its tty writes CR LF)"


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


# ------------------------------------------------------------------------------------------------- sleep, fork, restart
#
# A background counter (about ten steps a second, /tmp/c) tells whether a guest's processes ran: it stands still while
# its VM sleeps, runs on in each copy of a fork, and keeps going while the agent is down. Every VM here has the shared
# VM's shape (a clone of the agent's template); the restart test comes last, as it kills the module's agent.

COUNTER = "(i=0; while :; do i=$((i+1)); echo $i > /tmp/c; sleep 0.1; done) >/dev/null 2>&1 &"
MiB = 1 << 20


def new_vm(mclient, **labels):
    return mclient.create(image="busybox", kind="microvm", ttl=600, memory=VM_MEMORY, labels=labels or None)


def read_counter(sb) -> int:
    """The counter's value (the file is empty for a moment while the loop rewrites it)."""
    deadline = time.monotonic() + 10
    while True:
        out = sb.exec(["cat", "/tmp/c"]).stdout.strip()
        if out:
            return int(out)
        assert time.monotonic() < deadline, f"/tmp/c of {sb.id} stayed empty"
        time.sleep(0.02)


def start_counter(sb) -> int:
    assert sb.exec(COUNTER).exit_code == 0
    assert lib.wait_for(lambda: sb.exec("cat /tmp/c 2>/dev/null").stdout.strip(), 10, 0.1), "the counter did not start"
    return read_counter(sb)


def counter_advances(sb, timeout: float = 10) -> int:
    """Waits until the counter moved on by a few steps; its new value."""
    first = read_counter(sb)
    last = lib.wait_for(lambda: (lambda n: n if n >= first + 3 else 0)(read_counter(sb)), timeout, 0.1)
    assert last, f"the counter of {sb.id} stayed at {read_counter(sb)} (was {first})"
    return last


def counter_processes(sb) -> list[str]:
    return [p for p in exec_cases.user_processes(sb) if "while :" in p]


def raw_json(agent, method: str, target: str, body=None, timeout: float = 60.0) -> lib.RawResponse:
    data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    return lib.http_request(agent.socket_path, method, target, data,
                            {"Content-Type": "application/json"} if data else None, timeout=timeout)


def cgroup_memory(agent, sandbox_id: str) -> dict:
    """The anonymous and shmem bytes charged to a sandbox's memory cgroup (v1 rss/shmem, v2 anon/shmem)."""
    with open(os.path.join(agent.cgroup_dir("memory", sandbox_id), "memory.stat")) as f:
        stat = dict(line.split() for line in f if len(line.split()) == 2)
    return {"anon": int(stat.get("rss", stat.get("anon", 0))), "shmem": int(stat.get("shmem", 0))}


def guest_clock_skew(sb) -> float:
    t0 = time.time()
    guest = int(sb.exec(["date", "+%s"]).stdout)
    t1 = time.time()
    # `date +%s` truncates: the guest's second lies in [guest, guest + 1).
    return max(0.0, guest - t1, t0 - (guest + 1))


def test_sleep_and_wake_keep_processes_and_memory(mvm, mclient):
    sb = new_vm(mclient)
    sid = sb.id
    try:
        start_counter(sb)
        r = sb.exec("dd if=/dev/urandom of=/dev/shm/blob bs=1M count=32 2>/dev/null && md5sum /dev/shm/blob",
                    timeout=60)
        assert r.exit_code == 0, r
        digest = r.stdout.split()[0]
        sb.write_file("/root/before", b"written before the sleep")
        qemu = qemu_pids(sid)
        assert len(qemu) == 1, qemu
        with pytest.raises(dsec.FailedPrecondition, match="not sleeping"):
            sb.wake()

        for round_, asleep_for in ((1, 3.0), (2, 1.0)):
            before, read_at = read_counter(sb), time.monotonic()
            s = sb.sleep()
            awake_around = time.monotonic() - read_at  # the counter may step until the guest stops, and...
            print(f"\nround {round_}: sleep took {s.seconds:.2f} s; "
                  f"cgroup memory {s.memory_before_bytes / MiB:.1f} MiB "
                  f"-> {s.memory_after_bytes / MiB:.1f} MiB (released {s.memory_released_bytes / MiB:.1f} MiB)")
            slept_at = time.monotonic()
            assert s.info.state == "sleeping" and s.info.id == sid, s
            assert sb.info().state == "sleeping"
            res = lib.http_request(mvm.socket_path, "GET", f"/v1/sandboxes/{sid}")
            assert res.status == 200 and res.json()["state"] == "sleeping", res
            # Its QEMU is gone, and so is the memory it held (the 32 MiB in /dev/shm among it).
            assert lib.wait_for(lambda: not qemu_pids(sid), 5), qemu_pids(sid)
            assert s.memory_before_bytes >= 32 * MiB, s
            assert s.memory_released_bytes == max(0, s.memory_before_bytes - s.memory_after_bytes), s
            left = cgroup_memory(mvm, sid)
            assert left["anon"] < 4 * MiB, f"the sleeping VM's cgroup still holds anonymous memory: {left}"
            # The template's RAM is allocated whole before it is sealed: the save's reads of a clone's RAM add
            # nothing to it, and the clone's cgroup keeps none of it.
            assert left["shmem"] < 4 * MiB, f"the sleeping VM's cgroup still holds shared memory: {left}"
            assert s.memory_released_bytes >= 32 * MiB, (s, left)
            assert s.memory_after_bytes < 16 * MiB, (s, left)
            assert 0 <= s.seconds < 30, s

            # Asleep: no exec, no files (they live inside the stopped guest), no second sleep.
            with pytest.raises(dsec.FailedPrecondition, match="sleeping"):
                sb.exec("true")
            res = raw_json(mvm, "POST", f"/v1/sandboxes/{sid}/exec", {"argv": ["true"]})
            exec_cases.expect_error(res, 412, "FAILED_PRECONDITION")
            with pytest.raises(dsec.FailedPrecondition, match="sleeping"):
                sb.read_file("/root/before")
            res = lib.http_request(mvm.socket_path, "GET", f"/v1/sandboxes/{sid}/files?path=/root/before")
            exec_cases.expect_error(res, 412, "FAILED_PRECONDITION")
            with pytest.raises(dsec.FailedPrecondition, match="sleeping"):
                sb.write_file("/root/while", b"x")
            with pytest.raises(dsec.FailedPrecondition, match="already sleeping"):
                sb.sleep()
            assert sb.info().state == "sleeping"

            time.sleep(max(0.0, asleep_for - (time.monotonic() - slept_at)))
            t0 = time.monotonic()
            w = sb.wake()
            after = read_counter(sb)
            first_exec = time.monotonic() - t0
            awake_around += first_exec  # ...from the restore on
            print(f"round {round_}: wake took {w.seconds:.2f} s, wake to first exec {first_exec:.2f} s; counter "
                  f"{before} before the sleep, {after} after the wake ({asleep_for:.0f} s asleep)")
            assert w.info.state == "running", w
            assert sb.info().state == "running"
            assert first_exec < 10, f"wake to first exec took {first_exec:.1f}s"
            # The counter stood still while the VM slept: it stepped (ten a second at most) only around the save and
            # the restore.
            assert before <= after <= before + 2 + 10 * awake_around, (before, after, awake_around)
            # A new QEMU runs it, and the counter runs on from where it was.
            now = qemu_pids(sid)
            assert len(now) == 1 and now != qemu, (qemu, now)
            qemu = now
            assert counter_advances(sb) > after
            assert len(counter_processes(sb)) == 1, exec_cases.user_processes(sb)
            r = sb.exec("md5sum /dev/shm/blob", timeout=60)
            assert r.exit_code == 0 and r.stdout.split()[0] == digest, (r, digest)
            assert sb.read_file("/root/before") == b"written before the sleep"
            # The clock was set again at the wake: the host's, not the moment the guest stopped.
            skew = guest_clock_skew(sb)
            assert skew <= 2, f"the guest's clock is {skew:.1f}s off the host's after a wake"
            assert sb.exec("hostname").stdout.decode().strip() == sid
        with pytest.raises(dsec.FailedPrecondition, match="not sleeping"):
            sb.wake()
        # A woken VM (its RAM anonymous memory now) can be forked like any other.
        copies = sb.fork(1)
        try:
            assert copies[0].read_file("/root/before") == b"written before the sleep"
            counter_advances(copies[0])
        finally:
            copies[0].destroy()
            assert_gone(mvm, mclient, copies[0].id)
        assert sb.info().state == "running"
        counter_advances(sb)
    finally:
        sb.destroy()
    assert_gone(mvm, mclient, sid)


def fork_over_http(agent, sandbox_id: str, body) -> lib.RawResponse:
    return raw_json(agent, "POST", f"/v1/sandboxes/{sandbox_id}/fork", body, timeout=120)


def forks_dir_entries(agent) -> list[str]:
    try:
        return sorted(os.listdir(os.path.join(agent.run_dir, ".microvm", "forks")))
    except FileNotFoundError:
        return []


def test_fork_copies_a_running_vm_with_its_processes(mvm, mclient, suite):
    parent = new_vm(mclient, suite=suite, role="fork-parent")
    made = [parent]
    try:
        start_counter(parent)
        parent.write_file("/root/mark", b"marked before the fork")
        parent_qemu = qemu_pids(parent.id)
        vms = node_info(mvm)["microvm"]["vms"]

        t0 = time.monotonic()
        children = parent.fork(3)
        took = time.monotonic() - t0
        made += children
        print(f"\nfork(3) of a running VM took {took:.2f} s")
        assert len(children) == 3 and all(isinstance(c, dsec.Sandbox) for c in children), children
        ids = [c.id for c in children]
        assert len(set(ids + [parent.id])) == 4, ids
        assert node_info(mvm)["microvm"]["vms"] == vms + 3
        # The fork's frozen copy goes once its copies started from it (they and the parent map its RAM themselves).
        assert lib.wait_for(lambda: not forks_dir_entries(mvm), 5), forks_dir_entries(mvm)
        # The parent runs on in a QEMU of its own (a clone of the frozen copy, like its children).
        assert len(qemu_pids(parent.id)) == 1 and qemu_pids(parent.id) != parent_qemu

        # While an exec runs in the parent, it cannot be forked.
        busy = {}

        def run_busy():
            try:
                busy["r"] = parent.exec("sleep 5", timeout=30)
            except Exception as e:  # reported below
                busy["error"] = e

        t = threading.Thread(target=run_busy)
        t.start()
        try:
            assert lib.wait_for(lambda: any("sleep 5" in p for p in exec_cases.user_processes(parent)), 5, 0.1)
            body = exec_cases.expect_error(fork_over_http(mvm, parent.id, {"count": 1}), 412, "FAILED_PRECONDITION")
            assert "exec" in body["message"], body

            pinfo = parent.info()
            uuids = {parent.id: parent.exec(["cat", "/proc/sys/kernel/random/uuid"]).stdout.strip()}
            for c in children:
                info = c.info()
                assert (info.kind, info.state) == ("microvm", "running"), info
                assert info.image == pinfo.image, (info.image, pinfo.image)  # the VM itself, not a snapshot
                assert info.labels == pinfo.labels and info.resources.memory_bytes == 192 << 20, info
                assert c.exec("hostname").stdout.decode().strip() == c.id
                assert c.read_file("/root/mark") == b"marked before the fork"
                assert len(qemu_pids(c.id)) == 1, qemu_pids(c.id)
                # The counter came along: one loop, running on from the parent's value.
                assert len(counter_processes(c)) == 1, exec_cases.user_processes(c)
                counter_advances(c)
                uuids[c.id] = c.exec(["cat", "/proc/sys/kernel/random/uuid"]).stdout.strip()
            assert len(set(uuids.values())) == 4, uuids
            # The exec in the parent is its own: the copies were made before it started.
            for c in children:
                assert not any("sleep 5" in p for p in exec_cases.user_processes(c))
        finally:
            t.join(30)
        assert busy.get("r") is not None and busy["r"].exit_code == 0, busy

        # Each copy diverges on its own: files, processes.
        children[0].write_file("/root/only-in-0", b"zero")
        for other in (children[1], children[2], parent):
            assert other.exec("test -e /root/only-in-0 || exit 42").exit_code == 42, other.id
        loop = [p.split()[0] for p in counter_processes(children[0])]
        assert children[0].exec(["kill", *loop]).exit_code == 0
        assert lib.wait_for(lambda: not counter_processes(children[0]), 5, 0.1)
        stopped = read_counter(children[0])
        for other in (children[1], children[2], parent):
            counter_advances(other)
        time.sleep(0.3)
        assert read_counter(children[0]) == stopped

        # A fork of a fork.
        grandchild = children[1].fork(1)
        made += grandchild
        assert len(grandchild) == 1 and grandchild[0].id not in {s.id for s in made[:-1]}
        g = grandchild[0]
        assert g.exec("hostname").stdout.decode().strip() == g.id
        assert g.read_file("/root/mark") == b"marked before the fork"
        assert g.exec("test -e /root/only-in-0 || exit 42").exit_code == 42
        counter_advances(g)
        counter_advances(children[1])

        # Bad input: no copies, too many, not a count; a sleeping sandbox; an unknown one.
        for body in ({"count": 0}, {"count": 1000}, {"count": -1}, {"count": "2"}, {"copies": 2}, b"[]"):
            exec_cases.expect_error(fork_over_http(mvm, parent.id, body), 400, "INVALID_ARGUMENT")
        with pytest.raises(dsec.InvalidArgument):
            parent.fork(0)
        exec_cases.expect_error(fork_over_http(mvm, "no-such-sandbox", {"count": 1}), 404, "NOT_FOUND")
        assert lib.http_request(mvm.socket_path, "GET", f"/v1/sandboxes/{parent.id}/fork").status in (405, 501)
        parent.sleep()
        body = exec_cases.expect_error(fork_over_http(mvm, parent.id, {"count": 1}), 412, "FAILED_PRECONDITION")
        assert "sleeping" in body["message"], body
        with pytest.raises(dsec.FailedPrecondition):
            parent.fork(1)
        assert node_info(mvm)["microvm"]["vms"] == vms + 4  # no copy was made by a refused fork

        # The parent goes (asleep); its copies run on.
        parent.destroy()
        assert_gone(mvm, mclient, parent.id)
        for c in children + grandchild:
            assert c.exec("echo alive").stdout == b"alive\n", c.id
    finally:
        for s in made:
            s.destroy()
    for s in made:
        assert_gone(mvm, mclient, s.id)
    assert not forks_dir_entries(mvm)


def test_python_fork_gives_sandboxes_and_node_info(mvm, mclient):
    with new_vm(mclient) as parent:
        parent.write_file("/root/p", b"from the parent")
        kids = parent.fork(2)
        assert len(kids) == 2 and all(type(k) is dsec.Sandbox for k in kids), kids
        with kids[0] as k0, kids[1] as k1:
            assert len({k0, k1, parent}) == 3 and k0 != k1
            assert mclient.attach(k0.id) == k0 and k0.id in repr(k0)
            assert k0.client is mclient
            for k in (k0, k1):
                assert k.info().kind == "microvm" and k.info().state == "running"
                assert k.read_file("/root/p") == b"from the parent"
                assert k.exec(["hostname"]).stdout.decode().strip() == k.id
                assert not k.destroyed
        assert k0.destroyed and k1.destroyed
        for k in (k0, k1):
            assert_gone(mvm, mclient, k.id)
        assert parent.exec("cat /root/p").stdout == b"from the parent"
        assert not parent.destroyed
    assert parent.destroyed
    assert_gone(mvm, mclient, parent.id)

    # GET /v1/node as the binding gives it.
    raw = node_info(mvm)
    nodes = mclient.nodes()
    assert len(nodes) == 1, nodes
    node = nodes[0]
    assert node.id == raw["id"] and sorted(node.backends) == sorted(raw["backends"]), (node, raw["backends"])
    assert "microvm" in node.backends
    assert node.sandboxes == raw["load"]["sandboxes"] and node.cores == raw["capacity"]["cores"], node
    micro = node.microvm
    for field in ("offered", "ready", "accelerator", "kernel", "vms", "unavailable", "accelerator_reason"):
        assert getattr(micro, field) == raw["microvm"][field], (field, micro, raw["microvm"])


@pytest.fixture
def restartable(mvm, mclient, agent):
    """The agent the restart test kills, and a client of it: the module's own (with every VM of the module on it,
    which it must take back too), or, when the module runs on the session's agent, a dedicated one (killing the
    session's agent would break the other modules)."""
    if mvm is not agent:
        yield mvm, mclient
        return
    home = tempfile.mkdtemp(prefix="dsec-it-mvm-restart-")
    own = lib.Agent(home, tag="mvmrs", extra_args=["--backends", "container,microvm"])
    client = None
    try:
        lib.build_busybox_image(home)
        own.start()
        assert lib.wait_for(lambda: (node_info(own).get("microvm") or {}).get("ready"), 120, 0.2), node_info(own)
        client = dsec.Client(endpoints=[own.endpoint])
        yield own, client
    finally:
        if client is not None:
            client.close()
        try:
            own.stop_and_check()
        finally:
            shutil.rmtree(home, ignore_errors=True)


def test_agent_killed_and_restarted_takes_its_vms_back(restartable, request):
    """kill -9 of the agent, a restart on the same home, run dir and cgroup subtree: the running VM ran on without
    it (its guest never stopped) and is the same QEMU, answering again; an exec in flight at the kill is gone from
    the guest; the sleeping VM is still asleep and wakes with its processes. Last in the module: it kills the
    module's agent, whose VMs (the shared one among them) it must take back too."""
    a, client = restartable
    shared = request.getfixturevalue("vm") if a is request.getfixturevalue("mvm") else None
    running = client.create(image="busybox", kind="microvm", ttl=600, memory=VM_MEMORY)
    made = [running]
    try:
        sleeper = client.create(image="busybox", kind="microvm", ttl=600, memory=VM_MEMORY)
        made.append(sleeper)
        for sb in (running, sleeper):
            start_counter(sb)
            sb.write_file("/root/keep", f"kept by {sb.id}".encode())
        asleep_at, read_at = read_counter(sleeper), time.monotonic()
        assert sleeper.sleep().info.state == "sleeping"
        awake_around = time.monotonic() - read_at
        # The counter's pace on this host (TCG: slower than ten a second).
        c0, t0 = read_counter(running), time.monotonic()
        time.sleep(1.5)
        rate = (read_counter(running) - c0) / (time.monotonic() - t0)
        assert rate > 1, rate
        vms = node_info(a)["microvm"]["vms"]

        # An exec in flight at the kill.
        inflight = {}

        def run():
            try:
                inflight["r"] = running.exec("sleep 30", timeout=60)
            except dsec.DsecError as e:
                inflight["error"] = e

        t = threading.Thread(target=run)
        t.start()
        assert lib.wait_for(lambda: any("sleep 30" in p for p in exec_cases.user_processes(running)), 5, 0.1)
        qemu = qemu_pids(running.id)
        assert len(qemu) == 1, qemu
        at_kill = read_counter(running)
        killed_at = time.monotonic()
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)
        t.join(30)
        assert not t.is_alive(), "an exec whose agent was killed did not return"
        assert "error" in inflight, inflight
        # The VM runs on without its agent: its QEMU is there, and the sleeping one has none.
        assert qemu_pids(running.id) == qemu
        assert not qemu_pids(sleeper.id)
        time.sleep(2)
        assert qemu_pids(running.id) == qemu

        a.start()
        restarted = time.monotonic() - killed_at
        info = running.info()
        assert info.state == "running", info
        after = read_counter(running)
        down = time.monotonic() - killed_at
        print(f"\nagent down {restarted:.1f} s; the counter went {at_kill} -> {after} at {rate:.1f}/s "
              f"({rate * down:.0f} expected)")
        # The guest did not stop while the agent was down: the counter grew by about the downtime.
        assert after - at_kill >= 0.5 * rate * down, (at_kill, after, rate, down)
        assert qemu_pids(running.id) == qemu, "the restarted agent did not take the running QEMU over"
        assert running.exec("echo back").stdout == b"back\n"
        assert running.read_file("/root/keep") == f"kept by {running.id}".encode()
        # The old agent's exec is gone from the guest; the counter is not.
        assert lib.wait_for(lambda: not any("sleep 30" in p for p in exec_cases.user_processes(running)), 5, 0.2), \
            exec_cases.user_processes(running)
        assert len(counter_processes(running)) == 1, exec_cases.user_processes(running)
        counter_advances(running)
        assert node_info(a)["microvm"]["vms"] == vms

        # Still asleep; it wakes with its processes where they were.
        assert sleeper.info().state == "sleeping"
        with pytest.raises(dsec.FailedPrecondition, match="sleeping"):
            sleeper.exec("true")
        t0 = time.monotonic()
        w = sleeper.wake()
        assert w.info.state == "running", w
        woke_at = read_counter(sleeper)
        awake_around += time.monotonic() - t0
        assert asleep_at <= woke_at <= asleep_at + 2 + 10 * awake_around, (asleep_at, woke_at, awake_around)
        counter_advances(sleeper)
        assert sleeper.read_file("/root/keep") == f"kept by {sleeper.id}".encode()
        assert len(qemu_pids(sleeper.id)) == 1
        assert abs(int(sleeper.exec(["date", "+%s"]).stdout) - time.time()) < 3

        # A VM taken over can be forked (its RAM is its template's, which it found again in its QEMU).
        copy = running.fork(1)
        made += copy
        assert copy[0].read_file("/root/keep") == f"kept by {running.id}".encode()
        counter_advances(copy[0])
        counter_advances(running)

        # A new VM of the same shape: the restart dropped the old run's templates, so this boots a new one.
        fresh = client.create(image="busybox", kind="microvm", ttl=600, memory=VM_MEMORY)
        made.append(fresh)
        assert fresh.exec("hostname").stdout.decode().strip() == fresh.id
        assert fresh.exec("test -e /root/keep || exit 42").exit_code == 42

        if shared is not None:
            assert shared.info().state == "running"
            assert shared.exec("echo shared").stdout == b"shared\n"
    finally:
        if not a.alive():  # the restart failed: an agent for the teardown to stop (and to check what it left)
            a.start()
        for sb in made:
            sb.destroy()
    for sb in made:
        assert_gone(a, client, sb.id)
