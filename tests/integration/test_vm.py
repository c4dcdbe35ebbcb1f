"""The full VM tier (kind "vm", docs/vm.md) against a real dsecd: a q35 machine booting the desktop image's own
kernel and systemd, dsec-init as its service, a screen driven through QEMU's monitor.

A desktop boot under TCG takes about a minute, so the module boots one: the shared VM (its create boots the agent's
template of its shape, frozen once the desktop is up, and starts from it); every other VM of the module (the
example's, the restart test's) is a clone of that template, which starts in seconds. The tests read and drive the
shared VM and leave it as they found it; the last test kills the agent with SIGKILL and checks the restarted one
takes the VM back.

The image is the desktop recipe's (scripts/desktop-image.sh, built into the test store by scripts/test.sh). The agent
is this module's own (--backends container,vm on the test store, with sandbox records of its own). Everything skips,
with the reason, where the node cannot run QEMU.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib

import pytest

import dsec_testlib as lib

dsec = lib.dsec

IMAGE = "desktop"
MEMORY = "1Gi"
WIDTH, HEIGHT = 1024, 768
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------------------------------- helpers

def node_info(agent) -> dict:
    res = lib.http_request(agent.socket_path, "GET", "/v1/node")
    assert res.status == 200, res
    return res.json()


def qemu_pids(sandbox_id: str) -> list[int]:
    return [pid for pid, argv in lib.process_argvs() if any(sandbox_id.encode() in a for a in argv)]


def png_pixels(png: bytes) -> tuple[int, int, bytes]:
    """Width, height and the raw (filtered) scanlines of a PNG: enough to compare two screenshots."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n", png[:16]
    width, height = struct.unpack(">II", png[16:24])
    data, at = b"", 8
    while at < len(png):
        length, kind = struct.unpack(">I4s", png[at:at + 8])
        if kind == b"IDAT":
            data += png[at + 8:at + 8 + length]
        at += 12 + length
    return width, height, zlib.decompress(data)


def wait_for_screen_change(sb, before: bytes, timeout: float = 30) -> bytes:
    """The first screenshot whose pixels differ from `before`'s (the guest draws at its own pace under TCG)."""
    _, _, old = png_pixels(before)
    found = lib.wait_for(lambda: (lambda png: png if png_pixels(png)[2] != old else None)(sb.screenshot()),
                         timeout, 0.5)
    assert found, f"the screen did not change within {timeout} s"
    return found


# ---------------------------------------------------------------------------------------------------- fixtures

def _vm_problem(info: dict) -> str | None:
    v = info.get("vm") or {}
    if not v.get("offered"):
        return f"this node does not offer vm: {v.get('unavailable') or 'not among its backends'}"
    if v.get("unavailable"):
        return f"this node cannot run full VMs: {v['unavailable']}"
    return None


@pytest.fixture(scope="module")
def vm_agent():
    home = os.environ.get("DSEC_HOME", "")
    if not home:
        pytest.skip("DSEC_HOME is not set (scripts/test.sh sets it to the test store, which holds the desktop image)")
    if not shutil.which("qemu-system-x86_64"):
        pytest.skip("qemu-system-x86_64 is not installed: this node cannot run full VMs")
    if not os.path.exists(os.path.join(home, "store", "refs", f"{IMAGE}%3Alatest")):
        pytest.fail(f"the test store {home} has no {IMAGE} image: scripts/test.sh builds it "
                    f"(scripts/desktop-image.sh)")
    state = tempfile.mkdtemp(prefix="dsec-it-vm-state-")
    a = lib.Agent(home, tag="vm", extra_args=["--backends", "container,vm", "--state-dir", state])
    try:
        a.start()
        info = lib.wait_for(lambda: (lambda i: i if (i.get("vm") or {}).get("ready") or _vm_problem(i) else None)(
            node_info(a)), 60, 0.2)
        problem = _vm_problem(info or node_info(a))
        if problem:
            pytest.skip(problem)
        yield a
    finally:
        try:
            a.stop_and_check()
        finally:
            shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def vm_client(vm_agent):
    c = dsec.Client(endpoints=[vm_agent.endpoint])
    yield c
    c.close()


@pytest.fixture(scope="module")
def desktop(vm_client, vm_agent):
    """The shared VM: the desktop image booted with a 1024x768 screen, handed out once its desktop is up."""
    t0 = time.monotonic()
    # The shape of examples/computer_use.py's VM, whose create then starts from this one's template.
    sb = vm_client.create(IMAGE, "vm", cpu=2, memory=MEMORY, display=f"{WIDTH}x{HEIGHT}", ttl=0)
    accel = node_info(vm_agent)["vm"]["accelerator"]
    print(f"\nfull VM {sb.id}: created in {time.monotonic() - t0:.1f} s ({accel}, a boot and a template)")
    yield sb
    sb.destroy()


# ---------------------------------------------------------------------------------------------------- the system

def test_boots_the_images_kernel_and_systemd(desktop, vm_agent):
    """The image's own kernel and systemd as pid 1, started all the way (create waits for it and for the desktop's
    ready file); dsec-init serves exec and files as its service, commands in its delegated cgroup."""
    kernels = os.listdir(os.path.join(os.environ["DSEC_HOME"], "vm", vm_agent.cgroup_name, "kernels"))
    assert len(kernels) == 1, kernels
    release = desktop.exec("uname -r").stdout.decode().strip()
    assert kernels[0].startswith(release + "-"), (release, kernels)
    assert desktop.exec("cat /proc/1/comm").stdout == b"systemd\n"
    state = desktop.exec("systemctl is-system-running").stdout.decode().strip()
    assert state in ("running", "degraded"), state
    assert desktop.exec("test -e /run/dsec-desktop-ready").exit_code == 0
    cgroup = desktop.exec("cat /proc/self/cgroup").stdout.decode()
    assert "/dsec-guest.service/dsec/" in cgroup, cgroup
    assert desktop.exec("pgrep -x Xorg").exit_code == 0
    desktop.write_file("/root/note.txt", b"through the files API\n")
    assert desktop.exec("cat /root/note.txt").stdout == b"through the files API\n"
    assert desktop.read_file("/etc/hostname") is not None
    # No network device: the VM reaches neither the host nor other VMs.
    assert desktop.exec("ls /sys/class/net").stdout.split() == [b"lo"]
    info = node_info(vm_agent)["vm"]
    assert info["accelerator"] in ("kvm", "tcg") and info["accelerator_reason"], info
    assert info["vms"] >= 1 and info["templates"]["count"] == 1, info


def test_qemu_is_confined(desktop):
    """QEMU runs as a uid of its own, under its seccomp sandbox, with no file of the node open by path."""
    pids = qemu_pids(desktop.id)
    assert len(pids) == 1, pids
    status = open(f"/proc/{pids[0]}/status").read()
    uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
    assert uid >= 2000000000, status
    assert next(line for line in status.splitlines() if line.startswith("Seccomp:")).split()[1] == "2", status
    argv = open(f"/proc/{pids[0]}/cmdline", "rb").read().split(b"\0")
    assert b"-sandbox" in argv, argv
    assert b"q35" in b" ".join(argv), argv


# ---------------------------------------------------------------------------------------------------- the screen

def test_screenshot_is_a_png_of_the_screen(desktop, vm_agent, tmp_path):
    t0 = time.monotonic()
    png = desktop.screenshot()
    took = time.monotonic() - t0
    width, height, pixels = png_pixels(png)
    assert (width, height) == (WIDTH, HEIGHT)
    assert len(set(pixels)) > 8, "the screen is blank"
    state = desktop.screen()
    assert (state["width"], state["height"]) == (WIDTH, HEIGHT), state
    print(f"\nscreenshot: {len(png)} bytes in {took * 1000:.0f} ms")
    # The CLI's: dsec screenshot ID FILE.
    out = tmp_path / "cli.png"
    r = subprocess.run([str(lib.DSEC_CLI), "--endpoint", vm_agent.endpoint, "screenshot", desktop.id, str(out)],
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert png_pixels(out.read_bytes())[:2] == (WIDTH, HEIGHT)


def test_keys_reach_the_focused_terminal(desktop):
    """Text typed on the screen goes to the desktop's terminal, whose shell runs it: a file appears, and the screen
    changes."""
    desktop.click(300, 250)  # inside the terminal's window: it has the focus
    before = desktop.screenshot()
    desktop.type_text("echo typed-by-dsec > /tmp/typed.txt\n")
    assert lib.wait_for(lambda: desktop.exec("cat /tmp/typed.txt").stdout == b"typed-by-dsec\n", 30, 0.5), \
        desktop.exec("cat /tmp/typed.txt; ls /tmp")
    wait_for_screen_change(desktop, before)
    desktop.key("ctrl+l")
    desktop.exec("rm -f /tmp/typed.txt")


def test_pointer_clicks_scrolls_and_drags(desktop):
    """Pointer actions land where they are sent: a right click on the desktop's background opens openbox's menu
    (the screen changes), Escape closes it; the cursor is where the agent last put it."""
    assert desktop.mouse_move(WIDTH - 20, HEIGHT // 2)["cursor"] == (WIDTH - 20, HEIGHT // 2)
    before = desktop.screenshot()
    desktop.right_click(WIDTH - 200, HEIGHT - 200)
    opened = wait_for_screen_change(desktop, before)
    desktop.key("Escape")
    wait_for_screen_change(desktop, opened)
    assert desktop.cursor() == (WIDTH - 200, HEIGHT - 200)
    state = desktop.input([{"type": "scroll", "dy": -2}, {"type": "drag", "x": 10, "y": 10, "to_x": 60, "to_y": 40},
                           {"type": "wait", "interval_ms": 50}, {"type": "click", "x": 5, "y": 5, "count": 2}])
    assert state["cursor"] == (5, 5), state


def recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def vnc_response(password: str, challenge: bytes) -> bytes:
    """VNC authentication's answer: the 16-byte challenge under DES with the password (8 bytes, each bit-reversed)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    key = bytes(int(f"{b:08b}"[::-1], 2) for b in password.encode().ljust(8, b"\0")[:8])
    encryptor = Cipher(algorithms.TripleDES(key), modes.ECB()).encryptor()  # one 8-byte key: single DES
    return encryptor.update(challenge) + encryptor.finalize()


def vnc_handshake(port: int, password: str | None) -> tuple[int, bytes]:
    """RFB 3.8 up to the SecurityResult: the security types offered, then VNC authentication with `password` (a
    wrong one when None). Answers the result (0: OK) and, when OK, the ServerInit's first 4 bytes (the size)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        assert recv_exactly(s, 12).startswith(b"RFB 003.")
        s.sendall(b"RFB 003.008\n")
        count = recv_exactly(s, 1)[0]
        types = recv_exactly(s, count)
        assert list(types) == [2], types  # VNC authentication only: no None
        s.sendall(b"\x02")
        challenge = recv_exactly(s, 16)
        s.sendall(vnc_response(password if password is not None else "wrong-pw", challenge))
        result = struct.unpack(">I", recv_exactly(s, 4))[0]
        if result != 0:
            return result, b""
        s.sendall(b"\x01")  # ClientInit: shared
        return result, recv_exactly(s, 4)


def test_a_person_can_watch_through_vnc(desktop, vm_agent):
    """A VNC endpoint on a port of the node: QEMU's VNC server answers on it (RFB 3.8) and asks for the endpoint's
    password (VNC authentication, never None), then gives the screen's size; a wrong password is refused; the same
    endpoint twice; gone once stopped."""
    address, password = desktop.vnc_endpoint()
    assert desktop.vnc() == address and desktop.vnc_endpoint() == (address, password)
    assert len(password) == 8 and password.isalnum(), password
    port = int(address.rsplit(":", 1)[1])
    result, size = vnc_handshake(port, password)
    assert result == 0 and struct.unpack(">HH", size) == (WIDTH, HEIGHT), (result, size)
    assert vnc_handshake(port, None)[0] != 0  # a viewer without the password sees nothing
    # The CLI names the same endpoint and password, and stops it.
    cli = [str(lib.DSEC_CLI), "--endpoint", vm_agent.endpoint, "vnc", desktop.id]
    r = subprocess.run(cli, capture_output=True, timeout=60)
    assert r.returncode == 0 and r.stdout.decode().split() == [address, password], r
    r = subprocess.run(cli + ["--stop"], capture_output=True, timeout=60)
    assert r.returncode == 0, r
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    desktop.stop_vnc()  # stopping what is stopped is fine
    assert desktop.vnc_endpoint()[1] != password  # a new endpoint has a new password
    desktop.stop_vnc()


def test_bad_screen_input_is_refused_and_changes_nothing(desktop, vm_client, vm_agent):
    at = desktop.cursor()
    for bad, match in [
        ({"type": "click", "x": WIDTH, "y": 0}, "outside"),
        ({"type": "key", "keys": "ctrl+nosuchkey"}, "nosuchkey"),
        ({"type": "type", "text": "caf\u00e9"}, "US keymap"),
        ({"type": "scroll", "dy": 0}, "dy"),
        ({"type": "teleport"}, "type"),
        ({"type": "move", "x": 1}, "x and y"),
    ]:
        with pytest.raises(dsec.InvalidArgument, match=match):
            desktop.input([bad])
    assert desktop.cursor() == at
    # The wire refuses what the client would not send: malformed JSON, no actions, unknown fields.
    for body in (b"{", b"{}", b'{"actions": []}', b'{"actions": [{"type": "move", "x": 1, "y": 2, "z": 3}]}',
                 b'{"actions": "click"}'):
        res = lib.http_request(vm_agent.socket_path, "POST", f"/v1/sandboxes/{desktop.id}/screen/input", body,
                               {"Content-Type": "application/json"})
        assert res.status == 400, (body, res)
    res = lib.http_request(vm_agent.socket_path, "DELETE", f"/v1/sandboxes/{desktop.id}/screen")
    assert res.status == 501 and b"use GET" in res.body, res
    # Sizes a screen cannot have, and screens on kinds without one.
    for display in ("99999x99999", "100x100", "1024", "axb"):
        with pytest.raises(dsec.InvalidArgument, match="display"):
            vm_client.create(IMAGE, "vm", memory=MEMORY, display=display)
    with pytest.raises(dsec.InvalidArgument, match="no screen"):
        vm_client.create("busybox", "container", display="800x600")
    # GPU passthrough on a node without GPUs: admission refuses it (the node reports none).
    with pytest.raises(dsec.ResourceExhausted, match="gpus wanted.*0 free of 0"):
        vm_client.create(IMAGE, "vm", memory=MEMORY, gpus=1)
    # A container has no screen.
    with vm_client.create("busybox", "container") as c:
        with pytest.raises(dsec.FailedPrecondition, match="no screen"):
            c.screenshot()
        with pytest.raises(dsec.FailedPrecondition, match="no screen"):
            c.click(1, 1)


def test_an_image_without_a_kernel_fails_and_leaves_nothing(vm_client, vm_agent, desktop):
    before = {s.id for s in vm_client.list()}
    runs = set(os.listdir(vm_agent.run_dir))
    with pytest.raises(dsec.FailedPrecondition, match="vmlinuz"):
        vm_client.create("busybox", "vm", memory=MEMORY)
    assert {s.id for s in vm_client.list()} == before
    assert set(os.listdir(vm_agent.run_dir)) == runs


def test_asleep_it_has_no_screen_and_wakes_with_it(desktop):
    desktop.exec("sh -c 'echo before-sleep > /root/sleep.txt'")
    r = desktop.sleep()
    assert r.info.state == "sleeping", r
    assert not qemu_pids(desktop.id)
    with pytest.raises(dsec.FailedPrecondition, match="sleeping"):
        desktop.screenshot()
    with pytest.raises(dsec.FailedPrecondition, match="sleeping"):
        desktop.click(10, 10)
    w = desktop.wake()
    assert w.info.state == "running", w
    print(f"\nfull VM sleep {r.seconds:.2f} s ({r.memory_before_bytes >> 20} -> {r.memory_after_bytes >> 20} MiB), "
          f"wake {w.seconds:.2f} s")
    assert desktop.read_file("/root/sleep.txt") == b"before-sleep\n"
    assert png_pixels(desktop.screenshot())[:2] == (WIDTH, HEIGHT)
    assert desktop.exec("pgrep -x Xorg").exit_code == 0


def test_a_snapshot_of_the_running_system(desktop, vm_client):
    """The writable layer as the running system has it (its services writing beside the frozen commands, its file
    system frozen while it is read), as an image a container starts from; the system runs on."""
    desktop.exec("mkdir -p /srv/work && echo from-the-vm > /srv/work/result.txt")
    name = f"snap/vm-it-{os.getpid()}:1"
    try:
        image = desktop.snapshot(name)
        assert image.startswith(name + "@sha256:"), image
        assert image.entries > 0 and image.layer_bytes > 0, image.result
        with vm_client.create(image, "container") as c:
            assert c.exec("cat /srv/work/result.txt").stdout == b"from-the-vm\n"
        # Thawed: the system writes again, and its screen answers.
        assert desktop.exec("echo after > /srv/work/after.txt && cat /srv/work/after.txt").stdout == b"after\n"
        assert png_pixels(desktop.screenshot())[:2] == (WIDTH, HEIGHT)
    finally:
        subprocess.run([str(lib.DSEC_CLI), "image", "rm", name, "--home", os.environ["DSEC_HOME"]],
                       capture_output=True, timeout=60)
        desktop.exec("rm -rf /srv/work")


def test_an_image_that_cannot_boot_fails_with_its_console(desktop, vm_client, vm_agent):
    """An image whose kernel boots but that has no init to hand over to (a snapshot of the desktop without
    /sbin/init): the create fails within its boot, quoting the guest's console, and leaves nothing."""
    name = f"snap/vm-it-noinit-{os.getpid()}:1"
    desktop.exec("mv /sbin/init /sbin/init.kept")
    try:
        image = desktop.snapshot(name)
    finally:
        desktop.exec("mv /sbin/init.kept /sbin/init")
    try:
        before, runs = {s.id for s in vm_client.list()}, set(os.listdir(vm_agent.run_dir))
        t0 = time.monotonic()
        with pytest.raises(dsec.FailedPrecondition) as failure:  # not retried: it would only fail again
            vm_client.create(image, "vm", cpu=2, memory=MEMORY)
        took = time.monotonic() - t0
        message = str(failure.value)
        assert "/sbin/init" in message and "console" in message, message
        assert took < 60, took
        assert {s.id for s in vm_client.list()} == before
        assert set(os.listdir(vm_agent.run_dir)) == runs
        assert lib.wait_for(lambda: len([p for p, argv in lib.process_argvs()
                                         if argv and argv[0].endswith(b"qemu-system-x86_64")]) == 1, 10)
        print(f"\nan image without /sbin/init: refused in {took:.1f} s")
    finally:
        subprocess.run([str(lib.DSEC_CLI), "image", "rm", name, "--home", os.environ["DSEC_HOME"]],
                       capture_output=True, timeout=60)


def test_processes_sessions_and_asyncio(desktop, vm_agent):
    """A full VM serves processes and shell sessions as every tier does, and the asyncio client drives its screen."""
    p = desktop.spawn("sleep 0.2; echo spawned")
    assert p.wait(timeout=30).exit_code == 0
    with desktop.shell() as sh:
        assert sh.run("cd /tmp && X=kept").exit_code == 0
        assert sh.run("echo $PWD $X").stdout == b"/tmp kept\n"

    async def drive():
        async with dsec.AsyncClient(endpoints=[vm_agent.endpoint]) as ac:
            sb = ac.attach(desktop.id)
            png = await sb.screenshot()
            state = await sb.mouse_move(7, 9)
            return png, state

    import asyncio
    png, state = asyncio.run(drive())
    assert png_pixels(png)[:2] == (WIDTH, HEIGHT)
    assert state["cursor"] == (7, 9)


# ---------------------------------------------------------------------------------------------------- the example

def test_computer_use_example(vm_agent, desktop, tmp_path):
    """examples/computer_use.py end to end on a clone of the shared VM's template: it opens the editor by keyboard,
    types, saves, screenshots each step and scores the episode by reading the saved file."""
    out = tmp_path / "shots"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, os.path.join(REPO, "examples", "computer_use.py"), "--endpoint",
                        vm_agent.endpoint, "--out", str(out), "--display", f"{WIDTH}x{HEIGHT}", "--memory", MEMORY],
                       env={**os.environ, "PYTHONPATH": str(lib.BUILD / "python")}, capture_output=True,
                       timeout=900, stdin=subprocess.DEVNULL)
    took = time.monotonic() - t0
    assert r.returncode == 0, f"stdout:\n{r.stdout.decode()[-3000:]}\nstderr:\n{r.stderr.decode()[-3000:]}"
    assert b"score 1.0" in r.stdout, r.stdout
    shots = sorted(out.glob("*.png"))
    assert len(shots) >= 4, shots
    frames = [png_pixels(p.read_bytes()) for p in shots]
    assert all((w, h) == (WIDTH, HEIGHT) for w, h, _ in frames), [(w, h) for w, h, _ in frames]
    # Opening the editor, typing and closing it change the screen; a click on a focused terminal and the last
    # pointer move may not.
    changed = sum(1 for a, b in zip(frames, frames[1:]) if a[2] != b[2])
    assert changed >= max(3, len(frames) - 3), f"only {changed} of {len(frames) - 1} steps changed the screen"
    print(f"\ncomputer_use.py: {took:.1f} s, {len(shots)} screenshots")


def test_fork_copies_the_running_desktop(desktop):
    """A running full VM forked: the copy starts where the parent stood (its files, its X session, its screen) and
    diverges on its own; the parent runs on."""
    desktop.exec("echo parent > /root/fork.txt")
    t0 = time.monotonic()
    copies = desktop.fork(1)
    took = time.monotonic() - t0
    try:
        (copy,) = copies
        assert copy.info().kind == "vm"
        assert copy.read_file("/root/fork.txt") == b"parent\n"
        assert copy.exec("pgrep -x Xorg").exit_code == 0
        assert png_pixels(copy.screenshot())[:2] == (WIDTH, HEIGHT)
        copy.exec("echo copy > /root/fork.txt")
        assert desktop.read_file("/root/fork.txt") == b"parent\n"
        assert desktop.exec("pgrep -x Xorg").exit_code == 0
        print(f"\nfull VM fork: a copy in {took:.1f} s")
    finally:
        for c in copies:
            c.destroy()
        desktop.exec("rm -f /root/fork.txt")


# ---------------------------------------------------------------------------------------------------- restart

def test_agent_killed_and_restarted_takes_the_vm_back(vm_agent, vm_client, desktop):
    """kill -9 of the agent and a restart: the same QEMU, answering exec and screen calls again (the record keeps
    the image kernel and the screen); destroy then leaves no QEMU. Last: it kills the module's agent."""
    qemu = qemu_pids(desktop.id)
    assert len(qemu) == 1, qemu
    vm_agent.proc.send_signal(signal.SIGKILL)
    vm_agent.proc.wait(10)
    assert qemu_pids(desktop.id) == qemu
    vm_agent.start()
    assert desktop.info().state == "running"
    assert qemu_pids(desktop.id) == qemu, "the restarted agent did not take the running QEMU over"
    assert desktop.exec("cat /proc/1/comm").stdout == b"systemd\n"
    assert png_pixels(desktop.screenshot())[:2] == (WIDTH, HEIGHT)
    desktop.mouse_move(3, 3)
    # A sleep and wake after the restart starts QEMU with the recorded kernel and screen.
    desktop.sleep()
    desktop.wake()
    assert png_pixels(desktop.screenshot())[:2] == (WIDTH, HEIGHT)
