"""What the code inside a container sandbox must not see or do. Treat it as an adversary.

The commands exit 42 only on the path under test (nsjail's trick), so a stray 0 from a command that did not run, or
ran differently than meant, can never pass."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid

import pytest

import dsec_testlib as lib

dsec = lib.dsec

OK = 42


def run42(sb, command, **kw):
    r = sb.exec(command, **kw)
    assert r.exit_code == OK, f"{command!r} -> {r}\nstdout: {r.stdout!r}\nstderr: {r.stderr!r}"
    return r


# ------------------------------------------------------------------------------------------------- what it sees

def test_host_processes_invisible(sandbox):
    marker = f"dsec-host-marker-{uuid.uuid4().hex[:8]}"
    host = subprocess.Popen([marker, "60"], executable="/bin/sleep")
    try:
        r = sandbox.exec(["ps", "-o", "pid,args"])
        assert marker.encode() not in r.stdout
        lines = r.stdout.decode().strip().splitlines()[1:]
        assert len(lines) <= 2, r.stdout  # dsec-init and ps itself
        assert lines[0].split()[0] == "1" and "dsec-init" in lines[0], r.stdout
        run42(sandbox, f"""
            n=0; for d in /proc/[0-9]*; do n=$((n+1)); [ "$(cat $d/comm 2>/dev/null)" = sleep ] && exit 1; done
            kill -0 {host.pid} 2>/dev/null && [ "$(cat /proc/{host.pid}/comm 2>/dev/null)" = sleep ] && exit 2
            [ $n -le 4 ] && exit 42; echo "$n processes"; exit 3""")
    finally:
        host.kill()
        host.wait()


def test_host_files_invisible(sandbox):
    name = f"dsec-host-file-{uuid.uuid4().hex[:8]}"
    path = os.path.join("/tmp", name)
    with open(path, "w") as f:
        f.write("secret")
    try:
        run42(sandbox, f"test -e /tmp/{name} && exit 1; grep -rqs secret /tmp && exit 2; "
                       f"test -e /work -o -e /home/{name} && exit 3; exit 42")
        with pytest.raises(dsec.NotFound):
            sandbox.read_file(path)
    finally:
        os.unlink(path)


def test_host_mounts_invisible(sandbox):
    mnt = tempfile.mkdtemp(prefix="dsec-host-mnt-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "dsec-host-tmpfs", mnt], check=True)
    try:
        with open(os.path.join(mnt, "inside-host-mount"), "w") as f:
            f.write("x")
        run42(sandbox, f"""
            grep -q dsec-host-tmpfs /proc/self/mountinfo && exit 1
            grep -q {os.path.basename(mnt)} /proc/mounts && exit 2
            grep -qE ' /sys/fs/cgroup/(memory|pids|cpu) ' /proc/mounts && exit 3
            test -e {mnt}/inside-host-mount && exit 4
            exit 42""")
        # Only the sandbox's own mounts are there.
        mounts = sandbox.exec(["cat", "/proc/self/mounts"]).stdout.decode()
        points = {line.split()[1] for line in mounts.splitlines()}
        assert "/" in points and "/proc" in points
        assert not [p for p in points if p.startswith(("/work", "/home", "/var", "/boot", "/mnt"))], points
    finally:
        subprocess.run(["umount", mnt], check=True)
        os.rmdir(mnt)


# What exposes the host's physical memory and page state, keys, symbols, timers, firmware, tracing or memory
# management must read as empty inside (docs/security.md, "Masked paths").
MASKED_FILES = ["/proc/kcore", "/proc/kpagecgroup", "/proc/kpageflags", "/proc/kpagecount", "/proc/iomem",
                "/proc/ioports", "/proc/vmallocinfo", "/proc/pagetypeinfo", "/proc/zoneinfo", "/proc/buddyinfo",
                "/proc/slabinfo", "/proc/keys", "/proc/key-users", "/proc/kallsyms", "/proc/kmsg", "/proc/timer_list",
                "/proc/sched_debug", "/proc/latency_stats", "/proc/mtrr", "/sys/kernel/vmcoreinfo",
                "/proc/sysrq-trigger"]
MASKED_DIRS = ["/proc/acpi", "/proc/scsi", "/proc/driver", "/sys/firmware", "/sys/kernel/debug", "/sys/kernel/tracing",
               "/sys/kernel/security", "/sys/kernel/mm", "/sys/kernel/btf", "/sys/kernel/slab",
               "/sys/devices/virtual/powercap", "/sys/fs/bpf", "/sys/fs/pstore"]


def test_masked_proc_and_sys_paths(sandbox):
    present_on_host = [p for p in MASKED_FILES if os.path.exists(p)]
    assert "/proc/kpageflags" in present_on_host  # the host has them: the masks are what the test checks
    files = " ".join(MASKED_FILES)
    dirs = " ".join(MASKED_DIRS)
    run42(sandbox, f"""
        for p in {files}; do
            [ -e $p ] || continue
            n=$(timeout 5 cat $p 2>/dev/null | head -c 4096 | wc -c)
            [ "$n" -eq 0 ] || {{ echo "$p is readable: $n bytes"; exit 1; }}
            # Masked, not merely unreadable for want of a capability: /dev/null is bound over it.
            [ "$(stat -c %t:%T $p)" = "1:3" ] || [ $p = /proc/sysrq-trigger ] || {{ echo "$p is not masked"; exit 1; }}
        done
        for d in {dirs}; do
            [ -e $d ] || continue
            [ -z "$(ls -A $d 2>/dev/null)" ] || {{ echo "$d is not empty: $(ls -A $d | head -3)"; exit 1; }}
            grep -q " $d " /proc/self/mounts || {{ echo "$d is not masked"; exit 1; }}
        done
        exit 42""")
    for p in present_on_host:
        try:
            data = sandbox.read_file(p)
        except dsec.DsecError:
            continue
        assert data == b"", f"{p} read {len(data)} bytes through the files API"


def test_proc_sys_is_read_only(sandbox):
    run42(sandbox, """
        grep -E '^[^ ]+ /proc/sys ' /proc/mounts | grep -qE ' ro[ ,]' || { echo '/proc/sys not mounted ro'; exit 1; }
        echo evil > /proc/sys/kernel/hostname 2>/dev/null && exit 2
        echo 1 > /proc/sys/vm/drop_caches 2>/dev/null && exit 3
        grep -E '^[^ ]+ /sys ' /proc/mounts | grep -qE ' ro[ ,]' || { echo '/sys not mounted ro'; exit 4; }
        exit 42""")


def test_no_capabilities_no_new_privs_seccomp(sandbox):
    status = sandbox.exec(["cat", "/proc/self/status"]).stdout.decode()
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[cap].strip(), 16) == 0, f"{cap} = {fields[cap]}"
    assert fields["NoNewPrivs"].strip() == "1"
    assert fields["Seccomp"].strip() == "2"
    # pid 1 of the sandbox (dsec-init) holds nothing either.
    init = sandbox.exec(["cat", "/proc/1/status"]).stdout.decode()
    assert "CapEff:\t0000000000000000" in init and "Seccomp:\t2" in init


def test_hostname_is_the_sandbox_s(client, sandbox):
    assert sandbox.exec(["hostname"]).stdout.decode().strip() == sandbox.id
    assert sandbox.exec("echo $HOSTNAME").stdout.decode().strip() == sandbox.id
    r = sandbox.exec("hostname evil 2>/dev/null && exit 1; exit 42")
    assert r.exit_code == OK
    with client.create(image="busybox", ttl=300, hostname="box-7") as sb:
        assert sb.exec(["hostname"]).stdout == b"box-7\n"
        assert sb.exec(["cat", "/proc/sys/kernel/hostname"]).stdout == b"box-7\n"
    assert os.uname().nodename != sandbox.id


def test_network_has_only_loopback(sandbox):
    run42(sandbox, """
        ifs=$(awk -F: 'NR>2 {gsub(/ /, "", $1); print $1}' /proc/net/dev | sort | tr '\\n' ' ')
        [ "$ifs" = "lo " ] || { echo "interfaces: $ifs"; exit 1; }
        ip -o link | grep -qv ': lo:' && exit 2
        ip -o addr | grep -q 'inet 127.0.0.1' || exit 3
        ip route | grep -q . && exit 4
        exit 42""")
    # Loopback works, and only inside: a server in one sandbox is not reachable from another.
    r = sandbox.exec("(nc -l -p 7777 -e echo hello-lo &) ; sleep 0.3; nc 127.0.0.1 7777 </dev/null", timeout=10)
    assert b"hello-lo" in r.stdout, r


def test_sandboxes_do_not_share_a_network(client, sandbox):
    sandbox.exec("nc -lk -p 7778 -e echo from-a >/dev/null 2>&1 &")
    time.sleep(0.3)
    with client.create(image="busybox", ttl=300) as other:
        r = other.exec("nc -w 1 127.0.0.1 7778 </dev/null && exit 1; exit 42", timeout=10)
        assert r.exit_code == OK and b"from-a" not in r.stdout, r


# ------------------------------------------------------------------------------------------------- what it may not do

def test_mount_fails(sandbox, probe):
    run42(sandbox, "mkdir -p /mnt/x; mount -t tmpfs none /mnt/x 2>/dev/null && exit 1; "
                   "grep -q ' /mnt/x ' /proc/mounts && exit 2; umount /proc 2>/dev/null && exit 3; exit 42")
    run42(sandbox, [probe(sandbox), "mount"])


def test_raw_sockets_fail(sandbox, probe):
    run42(sandbox, [probe(sandbox), "rawsock"])
    r = sandbox.exec("ping -c 1 -W 1 127.0.0.1 >/dev/null 2>&1 && exit 1; exit 42", timeout=10)
    assert r.exit_code == OK, r


def test_module_loading_fails(sandbox, probe):
    run42(sandbox, [probe(sandbox), "modules"])
    run42(sandbox, "echo junk > /tmp/m.ko; insmod /tmp/m.ko 2>/dev/null && exit 1; exit 42")


def test_user_namespace_fails(sandbox, probe):
    run42(sandbox, [probe(sandbox), "userns"])
    run42(sandbox, "unshare -U -r true 2>/dev/null && exit 1; unshare -m true 2>/dev/null && exit 2; exit 42")


def test_x32_abi_kills_the_process(sandbox, probe):
    r = sandbox.exec([probe(sandbox), "x32"])
    assert r.signal == signal.SIGSYS, f"expected death by SIGSYS, got {r} stdout={r.stdout!r}"
    assert r.exit_code != 43
    assert sandbox.exec("echo alive").stdout == b"alive\n"


# ------------------------------------------------------------------------------------------------- limits

def test_fork_bomb_stops_at_pids_limit(client, agent, probe):
    pids = 64
    bombed = client.create(image="busybox", ttl=300, pids=pids, cpu=1)
    bystander = client.create(image="busybox", ttl=300)
    try:
        # Counted: forks are refused with EAGAIN before the limit is passed.
        r = bombed.exec([probe(bombed), "forks", "1000"], timeout=20)
        assert r.exit_code == OK, r
        made = int(r.stdout.split()[0])
        assert 1 <= made < pids, r.stdout
        assert bombed.exec("echo pids back").stdout == b"pids back\n"
        # The classic one. Its shell may die of a refused fork (exit 2) or run into the timeout; its children go on
        # forking in the background either way, until the sandbox is destroyed.
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", bombed.exec("b(){ b|b& }; b; sleep 60",
                                                                               timeout=6)))
        t.start()
        pids_current = agent.cgroup_dir("pids", bombed.id) + "/pids.current"
        peak = 0
        latencies = []
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            try:
                with open(pids_current) as f:
                    peak = max(peak, int(f.read()))
            except OSError:
                pass
            start = time.monotonic()
            assert bystander.exec("echo up").stdout == b"up\n"
            assert client.nodes()[0].id == agent.node_id
            latencies.append(time.monotonic() - start)
            time.sleep(0.1)
        t.join(60)
        assert not t.is_alive(), "the bombed exec did not come back"
        assert result["r"].timed_out or result["r"].exit_code != 0, result["r"]
        assert 0 < peak <= pids, f"pids.current peaked at {peak} (limit {pids})"
        assert max(latencies) < 3, f"the agent answered slowly during the fork bomb: {latencies}"
    finally:
        start = time.monotonic()
        bombed.destroy()
        took = time.monotonic() - start
        bystander_alive = bystander.exec("echo still").stdout
        bystander.destroy()
    assert took < 15, f"destroying the bombed sandbox took {took:.1f}s"
    assert bystander_alive == b"still\n"
    assert not agent.leftovers(bombed.id)


def test_memory_hog_is_oom_killed_inside_its_sandbox_only(client, agent, probe):
    hog = client.create(image="busybox", ttl=300, memory="64Mi")
    bystander = client.create(image="busybox", ttl=300, memory="64Mi")
    try:
        bystander.exec("sleep 999 >/dev/null 2>&1 &")
        r = hog.exec([probe(hog), "memhog", "512"], timeout=60)
        assert r.signal == signal.SIGKILL and r.oom_killed, f"{r} stdout={r.stdout[-200:]!r}"
        assert b"allocated 512 MiB" not in r.stdout
        # The sandbox survives and answers; its init was not the victim.
        assert hog.exec("echo alive").stdout == b"alive\n"
        assert hog.exec(["cat", "/proc/1/comm"]).stdout == b"dsec-init\n"
        assert hog.info().state == "running"
        # The kernel counted the kill in the hog's memory cgroup (v1: memory.oom_control; v2: memory.events).
        d = agent.cgroup_dir("memory", hog.id)
        for name in ("memory.oom_control", "memory.events"):
            path = os.path.join(d, name)
            if os.path.exists(path):
                with open(path) as f:
                    counters = dict(line.split() for line in f if len(line.split()) == 2)
                assert int(counters.get("oom_kill", "0")) >= 1, counters
                break
        # The result says so (the wire's oom_killed); a SIGKILL the command sent itself does not.
        body = json.dumps({"argv": [probe(hog), "memhog", "512"], "timeout": 60}).encode()
        again = lib.http_request(agent.socket_path, "POST", f"/v1/sandboxes/{hog.id}/exec", body,
                                 {"Content-Type": "application/json"}, timeout=90).json()
        assert again["signal"] == 9 and again.get("oom_killed") is True, again
        body = json.dumps({"shell": "kill -9 $$", "timeout": 60}).encode()
        own = lib.http_request(agent.socket_path, "POST", f"/v1/sandboxes/{hog.id}/exec", body,
                               {"Content-Type": "application/json"}).json()
        assert own["signal"] == 9 and not own.get("oom_killed", False), own
        # Neither the agent nor another sandbox felt it.
        assert agent.alive()
        assert b"sleep 999" in bystander.exec("ps -o args").stdout
        # A smaller allocation still works in the hog afterwards.
        assert hog.exec([probe(hog), "memhog", "16"], timeout=30).exit_code == 0
    finally:
        hog.destroy()
        bystander.destroy()


def test_disk_limit_is_enforced(client):
    with client.create(image="busybox", ttl=300, disk="16Mi") as sb:
        r = sb.exec("dd if=/dev/zero of=/root/fill bs=1M count=64 2>&1; echo rc=$?", timeout=60)
        assert b"No space left" in r.stdout or b"rc=1" in r.stdout, r.stdout
        size = int(sb.exec("stat -c %s /root/fill").stdout)
        assert size <= 16 << 20
        assert sb.exec("rm /root/fill && echo ok").stdout == b"ok\n"


# ------------------------------------------------------------------------------------------------- files API escapes

def test_planted_symlinks_do_not_reach_the_host(sandbox):
    name = f"dsec-host-marker-{uuid.uuid4().hex[:8]}"
    host_marker = os.path.join("/tmp", name)
    with open(host_marker, "wb") as f:
        f.write(b"host original")
    with open("/etc/shadow", "rb") as f:
        shadow = f.read()
    shadow_digest = hashlib.sha256(shadow).hexdigest()
    try:
        sandbox.exec(f"ln -s / /tmp/esc; ln -s /etc/shadow /tmp/x; ln -s {host_marker} /tmp/y; "
                     "ln -s /tmp /tmp/tmplink; ln -s ../../../../../../tmp /root/up")
        # Writes land inside the sandbox, whatever the links say.
        for path in (f"/tmp/esc/tmp/{name}", "/tmp/y", f"/tmp/tmplink/{name}", f"/root/up/{name}",
                     f"/../../../../tmp/{name}"):
            try:
                sandbox.write_file(path, b"pwned")
            except dsec.DsecError:
                pass  # refusing is fine too
            with open(host_marker, "rb") as f:
                assert f.read() == b"host original", f"write_file({path!r}) reached the host's {host_marker}"
        sandbox.exec("rm -f /tmp/y")  # the link, replaced by the file if it was written through
        sandbox.exec(f"ln -sf {host_marker} /tmp/y")
        try:
            sandbox.upload_tar("/tmp/esc/tmp", _one_file_tar(name, b"pwned-by-tar"))
        except dsec.DsecError:
            pass
        with open(host_marker, "rb") as f:
            assert f.read() == b"host original", "upload_tar through a planted link reached the host"
        # Reads never return the host's files.
        for path in ("/tmp/x", "/tmp/esc/etc/shadow", "/../../etc/shadow", "/tmp/y", f"/root/up/{name}"):
            try:
                data = sandbox.read_file(path)
            except dsec.DsecError:
                continue
            assert data != shadow and b"host original" not in data, f"read_file({path!r}) returned a host file"
        try:
            tar = sandbox.download_tar("/tmp/esc/etc")
            assert shadow not in tar
        except dsec.DsecError:
            pass
    finally:
        with open("/etc/shadow", "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == shadow_digest, "host /etc/shadow changed"
        os.unlink(host_marker)


def _one_file_tar(name: str, data: bytes) -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
