"""Snapshots of microVMs: the guest's writable layer (read by dsec-init inside, every command frozen) becomes an image
layer exactly as a container's does, and sandboxes of either kind start from it with the VM's files, deletions
included. One VM and two sandboxes from its snapshot; the agent is test_microvm.py's (its fixtures, imported)."""

from __future__ import annotations

import json

import dsec_testlib as lib
from test_microvm import mclient, mvm  # noqa: F401  (fixtures)

dsec = lib.dsec

CHANGES = """set -e
mkdir -p /work/d
echo hello > /work/d/a
ln /work/d/a /work/d/b
ln -s a /work/d/c
mkfifo /work/d/p
chmod 0750 /work/d
rm /bin/ls
rm -rf /etc && mkdir /etc && echo fresh > /etc/only
head -c 3145728 /dev/urandom > /work/big
md5sum /work/big | cut -d' ' -f1
"""

CHECK = """stat -c '%h %a' /work/d/a; stat -c %a /work/d; cat /work/d/b; readlink /work/d/c
test -p /work/d/p && echo fifo
test -e /bin/ls || echo ls-gone
ls /etc
md5sum /work/big | cut -d' ' -f1
"""


def test_a_vm_snapshot_starts_containers_and_vms(mvm, mclient):  # noqa: F811
    vm = mclient.create(image="busybox", kind="microvm", memory="192Mi", ttl=600)
    made = []
    try:
        r = vm.exec(CHANGES, timeout=60)
        assert r.exit_code == 0, r
        digest = r.stdout.decode().strip()
        # A process keeps running through the snapshot (it is frozen for the copy, not stopped).
        vm.exec("(while :; do date > /tmp/tick; sleep 0.2; done) >/dev/null 2>&1 &")
        image = vm.snapshot("snap/microvm-it:1")
        assert image.startswith("snap/microvm-it:1@sha256:"), image
        before = vm.exec("cat /tmp/tick").stdout
        assert lib.wait_for(lambda: vm.exec("cat /tmp/tick").stdout != before, 10, 0.3)
        expected = f"2 644\n750\nhello\na\nfifo\nls-gone\nonly\n{digest}\n"
        for kind in ("container", "microvm"):
            sb = mclient.create(image=image, kind=kind, memory="192Mi", ttl=600)
            made.append(sb)
            got = sb.exec(CHECK, timeout=60)
            assert got.exit_code == 0, (kind, got)
            assert got.stdout.decode() == expected, (kind, got.stdout, got.stderr)
        # Sleeping VMs are snapshotted awake: refused with a clear error, no 500.
        vm.sleep()
        res = lib.http_request(mvm.socket_path, "POST", f"/v1/sandboxes/{vm.id}/snapshot",
                               json.dumps({"name": "snap/microvm-it:2"}).encode())
        assert res.status == 412, res
        assert res.json()["code"] == "FAILED_PRECONDITION", res
        vm.wake()
    finally:
        for sb in made:
            sb.destroy()
        vm.destroy()
