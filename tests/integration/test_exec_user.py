"""Execs as a user inside container sandboxes, and protected paths, against the session's real dsecd.

A command runs as a name of the sandbox's own /etc/passwd (groups from its /etc/group, HOME/USER/LOGNAME from the
entry), a uid or uid:gid, or the spec's user by default; an unknown one is INVALID_ARGUMENT. No command has any
capability, root's neither. A protected path (spec.protected_paths) is root's 0700 directory before the sandbox is
handed out: what root puts there is out of reach of a command run as another user by every route a sandbox offers
(direct, symlinks, /proc/*/root, hard links, '..'), while root inside still reads it; a path the image does not allow
fails the create and leaves nothing behind.

The adversarial commands exit 42 only on the path under test (nsjail's trick), so a stray 0 cannot pass. The module
shares two sandboxes (one with protected paths and extra users, one whose spec user is nobody); the failed creates,
a one-member group and a fork add three short-lived ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest

import dsec_testlib as lib

dsec = lib.dsec

OK = 42
SECRET = b"the-answer-is-41\n"
CAPS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")

# Users the module adds to the image's /etc/passwd and /etc/group (busybox has root and nobody only).
EXTRA_PASSWD = "alice:x:1001:1001:Alice:/home/alice:/bin/sh\nbob:x:1002:100::/home/bob:/bin/sh\n"
EXTRA_GROUP = "alice:x:1001:\nusers:x:100:\nstaff:x:50:bob,alice\ndev:x:60:alice\n"


def run42(sb, command, **kw):
    r = sb.exec(command, **kw)
    assert r.exit_code == OK, f"{command!r} {kw} -> {r}\nstdout: {r.stdout!r}\nstderr: {r.stderr!r}"
    return r


def test_a_protected_path_under_a_directory_a_user_can_change_is_refused(client, agent):
    """A protected path under a directory another user could rename in (one of its own, or one open to all and not
    sticky) could be moved away and replaced by the user's own, where root's later writes would land: such a create
    is refused naming the directory. A sticky directory root's entries cannot be moved out of (/tmp) is fine."""
    base = client.create(image="busybox", ttl=120, memory="64Mi", pids=32)
    try:
        assert base.exec("mkdir -p /srv/open && chmod 0777 /srv/open").exit_code == 0
        assert base.exec("mkdir /tmp/home-1000", user="1000:1000").exit_code == 0
        image = base.snapshot(f"protect-test:{uuid.uuid4().hex[:8]}").image
    finally:
        base.destroy()
    for paths, message in ((["/srv/open/answers"], r"/srv/open can be written by users other than root"),
                           (["/tmp/home-1000/answers"], r"/tmp/home-1000 belongs to uid 1000, not root"),
                           (["/grader", "/srv/open/x/y"], r"/srv/open can be written")):
        with pytest.raises(dsec.InvalidArgument, match=message):
            client.create(image=image, ttl=60, memory="64Mi", pids=32, protected_paths=paths)
    ok = client.create(image=image, ttl=60, memory="64Mi", pids=32, protected_paths=["/tmp/answers", "/srv/a"])
    try:
        ok.write_file("/tmp/answers/key", b"42\n", 0o600)
        r = ok.exec("mv /tmp/answers /tmp/mine || cat /tmp/answers/key", user="1000:1000")
        assert r.exit_code != 0 and b"42" not in r.stdout, r
        assert ok.read_file("/tmp/answers/key") == b"42\n"
    finally:
        ok.destroy()


def ids(sb, **kw) -> list[str]:
    """`id -u`, `id -g`, `id -G`, $HOME, $USER, $LOGNAME of a command run with these exec arguments."""
    r = sb.exec('id -u; id -g; id -G; echo "$HOME"; echo "$USER"; echo "$LOGNAME"', **kw)
    assert r.exit_code == 0, r
    return r.stdout.decode().split("\n")[:6]


def capabilities(sb, **kw) -> dict[str, str]:
    r = sb.exec(["grep", "-E", "^(Cap|NoNewPrivs)", "/proc/self/status"], **kw)
    assert r.exit_code == 0, r
    return dict(line.split(":\t") for line in r.stdout.decode().splitlines())


@pytest.fixture(scope="module")
def sb(client, agent):
    """A sandbox with protected paths /grader and /srv/answers, alice and bob added to its user database, and a
    secret root wrote into /grader through the files API and one more through a root exec."""
    s = client.create(image="busybox", ttl=600, memory="256Mi", pids=256,
                      protected_paths=["/grader", "/srv/answers"])
    try:
        s.write_file("/etc/passwd", s.read_file("/etc/passwd") + EXTRA_PASSWD.encode(), 0o644)
        s.write_file("/etc/group", s.read_file("/etc/group") + EXTRA_GROUP.encode(), 0o644)
        s.write_file("/grader/secret.txt", SECRET, 0o600)
        assert s.exec("echo exec-secret > /grader/by-exec.txt && chmod 644 /grader/by-exec.txt").exit_code == 0
        yield s
    finally:
        s.destroy()
    problems = agent.leftovers(s.id)
    assert not problems, f"sandbox {s.id} left things behind:\n  " + "\n  ".join(problems)


@pytest.fixture(scope="module")
def nobody_sb(client, agent):
    """A sandbox whose spec makes nobody the default user."""
    s = client.create(image="busybox", ttl=600, memory="128Mi", pids=64, user="nobody", workdir="/tmp")
    try:
        yield s
    finally:
        s.destroy()
    assert not agent.leftovers(s.id)


# ------------------------------------------------------------------------------------------------- who runs

def test_a_name_from_the_images_passwd(sb):
    assert ids(sb, user="nobody") == ["65534", "65534", "65534", "/nonexistent", "nobody", "nobody"]


def test_a_name_gets_its_groups_from_etc_group_and_env_may_override_home(sb):
    assert ids(sb, user="alice") == ["1001", "1001", "1001 50 60", "/home/alice", "alice", "alice"]
    assert ids(sb, user="bob") == ["1002", "100", "100 50", "/home/bob", "bob", "bob"]
    assert ids(sb, user="alice", env={"HOME": "/tmp", "USER": "x"})[3:5] == ["/tmp", "x"]


def test_numeric_uid_and_uid_gid(sb):
    # No passwd entry: its own gid, no other group, HOME=/ and no USER.
    assert ids(sb, user="1000:1000") == ["1000", "1000", "1000", "/", "", ""]
    assert ids(sb, user="1000") == ["1000", "1000", "1000", "/", "", ""]
    assert ids(sb, user="1234:5678")[:3] == ["1234", "5678", "5678"]
    # A uid with an entry takes its home and groups; an int is a uid.
    assert ids(sb, user=1001) == ["1001", "1001", "1001 50 60", "/home/alice", "alice", "alice"]
    assert ids(sb, user="1001:60")[:3] == ["1001", "60", "60 50"]
    # root by name and by number, and nobody named: root as before.
    assert ids(sb, user="root")[:2] == ["0", "0"]
    assert ids(sb, user="0:0")[:2] == ["0", "0"]
    root = ids(sb)
    assert root[:2] == ["0", "0"] and root[3:] == ["/root", "", ""], root


def test_a_user_is_the_owner_of_what_it_writes_and_cannot_write_roots_files(sb):
    run42(sb, "echo x > /tmp/mine && [ \"$(stat -c %u:%g /tmp/mine)\" = 1000:1000 ] && "
              "! echo y >> /etc/passwd 2>/dev/null && ! touch /root/x 2>/dev/null && exit 42", user="1000:1000")
    assert sb.exec("rm -f /tmp/mine").exit_code == 0


def test_unknown_or_malformed_users_are_invalid_argument(sb, agent):
    with pytest.raises(dsec.InvalidArgument, match="user: 'mallory' is not a user of this sandbox"):
        sb.exec("true", user="mallory")
    with pytest.raises(dsec.InvalidArgument, match="user: .*uid 70000 is out of range"):
        sb.exec("true", user="70000")
    with pytest.raises(dsec.InvalidArgument, match="user: .*gid 65536 is out of range"):
        sb.exec("true", user="1:65536")
    for bad in ("a b", "1:", ":1", "x:y", "-rf"):
        with pytest.raises(dsec.InvalidArgument, match="^INVALID_ARGUMENT: user: "):
            sb.exec("true", user=bad)
    with pytest.raises(dsec.InvalidArgument, match="user: expected"):
        sb.exec("true", user=1.5)
    # The agent's own answer, past the client's check: 400 with the field named, never a 500.
    for bad in ("mallory", "a b", "99999", 12):
        res = lib.http_request(agent.socket_path, "POST", f"/v1/sandboxes/{sb.id}/exec",
                               json.dumps({"shell": "true", "user": bad}).encode())
        assert res.status == 400, res
        body = res.json()
        assert body["code"] == "INVALID_ARGUMENT" and body["message"].startswith("user: "), body
    # A user that cannot enter the working directory: a result (126) naming it, as a shell would give it.
    r = sb.exec("true", user="nobody", cwd="/grader")
    assert (r.exit_code, r.reason) == (126, "cwd_not_accessible") and b"/grader" in r.stderr, r


def test_no_command_has_a_capability_whoever_it_runs_as(sb):
    for user in ("nobody", "1000:1000", "alice", "root", "0", None):
        caps = capabilities(sb, user=user)
        for name in CAPS:
            assert caps[name] == "0000000000000000", (user, caps)
        assert caps["NoNewPrivs"] == "1", (user, caps)
    # And none comes back through a child or a setuid bit on something root made.
    run42(sb, "mkdir /tmp/suid && cp /bin/busybox /tmp/suid/ && chmod 4755 /tmp/suid/busybox && exit 42")
    r = sb.exec("/tmp/suid/busybox id -u; /tmp/suid/busybox grep CapEff /proc/self/status", user="nobody")
    assert r.stdout == b"65534\nCapEff:\t0000000000000000\n", r
    assert sb.exec("rm -rf /tmp/suid").exit_code == 0


def test_the_specs_user_is_the_default_and_an_exec_can_name_another(nobody_sb):
    assert ids(nobody_sb)[:4] == ["65534", "65534", "65534", "/nonexistent"]
    assert ids(nobody_sb, user="root")[:2] == ["0", "0"]
    assert ids(nobody_sb, user="0")[:2] == ["0", "0"]
    assert ids(nobody_sb, user="1000:1000")[:2] == ["1000", "1000"]
    assert nobody_sb.info().state == "running"


def test_streaming_group_and_cli_execs_carry_the_user(sb, nobody_sb, client, agent):
    chunks = []
    r = sb.exec("id -u", user="nobody", on_output=lambda stream, data: chunks.append((stream, data)))
    assert r.exit_code == 0 and b"".join(d for s, d in chunks if s == "stdout") == b"65534\n", (r, chunks)

    g = client.create_group(1, image="busybox", ttl=300, memory="64Mi", pids=32, lease=60, user="1000:1000")
    try:
        results = g.exec("id -u; id -g")
        assert [x.stdout for x in results] == [b"1000\n1000\n"], results
        results = g.exec("id -u", user="nobody")
        assert [x.stdout for x in results] == [b"65534\n"], results
    finally:
        g.destroy()

    cli = subprocess.run([str(lib.DSEC_CLI), "--endpoint", agent.endpoint, "exec", "--user", "root", nobody_sb.id,
                          "--", "id", "-u"], capture_output=True, timeout=60)
    assert (cli.returncode, cli.stdout) == (0, b"0\n"), cli
    cli = subprocess.run([str(lib.DSEC_CLI), "--endpoint", agent.endpoint, "exec", nobody_sb.id, "--", "id", "-u"],
                         capture_output=True, timeout=60)
    assert (cli.returncode, cli.stdout) == (0, b"65534\n"), cli
    cli = subprocess.run([str(lib.DSEC_CLI), "--endpoint", agent.endpoint, "run", "--user", "nobody",
                          "--protect", "/grader", "--protect", "/answers", "--memory", "64Mi", "busybox", "--",
                          "sh", "-c", "id -u; stat -c %u:%a /grader /answers; ls /grader 2>/dev/null || exit 42"],
                         capture_output=True, timeout=60)
    assert (cli.returncode, cli.stdout) == (42, b"65534\n0:700\n0:700\n"), cli


# ------------------------------------------------------------------------------------------------- protected paths

def test_protected_paths_are_roots_0700_directories(sb):
    r = sb.exec("stat -c '%u:%g %a %F' /grader /srv/answers /srv")
    assert r.stdout == b"0:0 700 directory\n0:0 700 directory\n0:0 755 directory\n", r


@pytest.mark.parametrize("user", ["nobody", "1000:1000", "alice"])
def test_another_user_cannot_reach_what_root_put_there(sb, user):
    attempts = {
        "read": "cat /grader/secret.txt",
        "read a world-readable file": "cat /grader/by-exec.txt",
        "list": "ls /grader",
        "enter": "cd /grader",
        "stat": "stat /grader/secret.txt",
        "a symlink it makes": "ln -sf /grader/secret.txt /tmp/l-$$ && cat /tmp/l-$$",
        "a symlink to the directory": "ln -sfn /grader /tmp/d-$$ && cat /tmp/d-$$/secret.txt",
        "/proc/1/root": "cat /proc/1/root/grader/secret.txt",
        "/proc/self/root": "cat /proc/self/root/grader/secret.txt",
        "/proc/$$/root": "cat /proc/$$/root/grader/secret.txt",
        "/proc/1/cwd": "cat /proc/1/cwd/grader/secret.txt",
        "a hard link": "ln /grader/secret.txt /tmp/h-$$ && cat /tmp/h-$$",
        "dot-dot": "cat /tmp/../grader/./secret.txt",
        "dot-dot from inside": "cd /srv && cat ../grader/secret.txt",
        "find": "find /grader -type f | grep -q . && cat $(find /grader -type f)",
        "chmod it open": "chmod 777 /grader",
        "rename it away": "mv /grader /tmp/g-$$",
        "remove it": "rm -rf /grader/secret.txt",
        "replace a file in it": "echo evil > /grader/by-exec.txt",
        "the nested path": "ls /srv/answers",
    }
    for what, command in attempts.items():
        r = sb.exec(f"{{ {command}; }} >/tmp/out-$$ 2>&1; rc=$?; cat /tmp/out-$$; rm -f /tmp/out-$$ /tmp/?-$$; "
                    f"[ $rc -ne 0 ] && exit 42; exit 1", user=user)
        assert r.exit_code == OK, f"{what} as {user} succeeded: {r}\n{r.stdout!r}"
        assert SECRET.strip() not in r.stdout and b"exec-secret" not in r.stdout, (what, r.stdout)
    # Nothing of it changed.
    assert sb.read_file("/grader/secret.txt") == SECRET
    assert sb.exec(["cat", "/grader/by-exec.txt"]).stdout == b"exec-secret\n"


def test_root_inside_still_reads_and_writes_them(sb):
    assert sb.exec(["cat", "/grader/secret.txt"]).stdout == SECRET
    assert sb.exec(["cat", "/grader/secret.txt"], user="root").stdout == SECRET
    assert sb.exec(["cat", "/proc/self/root/grader/secret.txt"], user="0").stdout == SECRET
    run42(sb, "echo ans > /srv/answers/a && [ \"$(cat /srv/answers/a)\" = ans ] && ls /grader | grep -q secret.txt "
              "&& exit 42")
    assert sb.read_file("/srv/answers/a") == b"ans\n"


def test_a_fork_keeps_them(sb, client, agent):
    # The fork is a snapshot and a create from it: the files carry the ownership, and the create sets it again.
    c = dsec.Client(endpoints=[agent.endpoint], stores=[os.path.join(agent.home, "store")], call_deadline=120)
    try:
        (copy,) = c.attach(sb.id).fork(1)
        try:
            assert copy.exec("stat -c '%u:%g %a' /grader").stdout == b"0:0 700\n"
            assert copy.exec(["cat", "/grader/secret.txt"]).stdout == SECRET
            run42(copy, "cat /grader/secret.txt || exit 42", user="alice")
        finally:
            copy.destroy()
        assert not agent.leftovers(copy.id)
    finally:
        c.close()


def test_bad_protected_paths_are_invalid_argument_naming_the_field(client, agent):
    for paths, message in ((["grader"], r"protected_paths\[0\]: 'grader' is not an absolute path"),
                           (["/"], r"protected_paths\[0\]: '/' itself"),
                           (["/ok", "/a/../etc"], r"protected_paths\[1\]: .*'\.\.'"),
                           (["/grader/"], r"not normalized \(write '/grader'\)"),
                           (["/proc/1"], "under /proc"), (["/dev/shm"], "under /dev"),
                           ([f"/p{i}" for i in range(33)], "at most 32")):
        with pytest.raises(dsec.InvalidArgument, match=message):
            client.create(image="busybox", ttl=60, protected_paths=paths)
    with pytest.raises(dsec.InvalidArgument, match="protected_paths: expected a list"):
        client.create(image="busybox", ttl=60, protected_paths="/grader")
    res = lib.http_request(agent.socket_path, "POST", "/v1/sandboxes",
                           json.dumps({"image": "busybox", "protected_paths": ["/sys"]}).encode())
    assert res.status == 400 and res.json()["code"] == "INVALID_ARGUMENT", res
    assert res.json()["message"].startswith("protected_paths[0]: "), res.json()


def test_a_path_the_image_does_not_allow_fails_the_create_and_leaves_nothing(client, agent):
    before = {i.id for i in client.list()}
    left_before = set(agent.leftovers())  # what the live sandboxes hold
    # /sbin is a symbolic link in the busybox image; /etc/passwd is a file, so nothing can be made under it.
    for paths, message in ((["/sbin"], "/sbin is a symbolic link"),
                           (["/grader", "/sbin/x"], "/sbin is a symbolic link"),
                           (["/usr/bin/g"], "/usr/bin is a symbolic link"),
                           (["/etc/passwd/x"], "protected_paths: ")):
        with pytest.raises(dsec.InvalidArgument, match=message):
            client.create(image="busybox", ttl=60, memory="64Mi", pids=32, protected_paths=paths)
    assert {i.id for i in client.list()} == before
    assert lib.wait_for(lambda: set(agent.leftovers()) <= left_before, 5), set(agent.leftovers()) - left_before
