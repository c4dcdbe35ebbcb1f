"""dsec.Client() with no endpoints: a private agent started for the client, stopped with it."""

from __future__ import annotations

import os

import dsec_testlib as lib

dsec = lib.dsec


def _agent_pids(socket_path: str) -> list[int]:
    """Processes whose command line names this socket: the embedded dsecd."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if socket_path.encode() in argv:
            pids.append(int(pid))
    return pids


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("Z", "X")  # a zombie is dead, not yet reaped
    except OSError:
        return True


def test_embedded_agent_lives_and_dies_with_the_client(image_home, monkeypatch):
    monkeypatch.setenv("DSEC_HOME", image_home)
    cgroup_name = f"dsec-test-{os.getpid()}-emb"
    client = dsec.Client(agent=str(lib.DSECD),
                         agent_args=["--cgroup-name", cgroup_name, "--node-id", f"emb{os.getpid()}"])
    closed = False
    try:
        endpoint = client.endpoint
        assert endpoint.startswith("unix:")
        socket_path = endpoint[len("unix:"):]
        pids = _agent_pids(socket_path)
        assert len(pids) == 1, f"expected one embedded dsecd on {socket_path}, found {pids}"
        pid = pids[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0") if a]
        assert image_home in argv, argv  # DSEC_HOME reached the agent
        run_dir = argv[argv.index("--run-dir") + 1]

        assert client.nodes()[0].id == f"emb{os.getpid()}"
        sb = client.create(image="busybox", ttl=300)
        r = sb.exec("echo embedded; hostname")
        assert r.exit_code == 0 and r.stdout == f"embedded\n{sb.id}\n".encode(), r
        sb.exec("sleep 1000 >/dev/null 2>&1 &")
        # A sandbox left running is destroyed with the agent.
        client.close()
        closed = True
        assert client.closed
        assert lib.wait_for(lambda: _gone(pid), 15), f"embedded dsecd {pid} still runs after close()"
        assert not os.path.exists(socket_path)
        assert not os.path.exists(os.path.dirname(socket_path)), "the embedded agent's private directory is left"
        problems = lib.leftovers(run_dir, cgroup_name)
        assert not problems, "the embedded agent left things behind:\n  " + "\n  ".join(problems)
        try:
            sb.exec("true")
            raise AssertionError("exec through a closed client succeeded")
        except dsec.DsecError as e:
            assert isinstance(e, (dsec.FailedPrecondition, dsec.Unavailable, dsec.NotFound)), e
    finally:
        if not closed:
            client.close()
        for root in lib.cgroup_roots(cgroup_name):
            try:
                os.rmdir(root)
            except OSError:
                pass


def test_two_embedded_clients_do_not_disturb_each_other(image_home, monkeypatch):
    # Two trainer processes on one machine, each with its own dsec.Client(), each with all defaults: the second
    # agent's start must not touch the first one's sandboxes.
    # Each embedded agent keeps its records and cgroups under a private name, so neither takes the other's
    # sandboxes for leftovers of a crash.
    monkeypatch.setenv("DSEC_HOME", image_home)
    first = dsec.Client(agent=str(lib.DSECD))
    second = None
    try:
        sb = first.create(image="busybox", ttl=300)
        sb.exec("sleep 1000 >/dev/null 2>&1 &")
        second = dsec.Client(agent=str(lib.DSECD))
        other = second.create(image="busybox", ttl=300)
        assert other.exec("echo second").stdout == b"second\n"
        r = sb.exec("echo first; ps -o args | grep -c '^sleep 1000'")
        assert r.stdout == b"first\n1\n", r
        other.destroy()
        sb.destroy()
    finally:
        if second is not None:
            second.close()
        first.close()
