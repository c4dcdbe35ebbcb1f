"""A dsecd killed with SIGKILL and started again on the same home, run dir and cgroup subtree keeps its sandboxes.

The main test kills the agent while threads hammer it with creates (with request ids) and execs, kills one
sandbox's processes while no agent runs, restarts it, and checks: the surviving sandboxes answer exec and keep their
files and background processes; their info, labels and group are intact; the sleeping one still sleeps and wakes;
an exec in flight at the kill was killed; the sandbox that died is "failed"; creates cut short are gone; every
request id retried after the restart yields one sandbox, never two. After destroying everything and stopping the
agent nothing is left: no mount, cgroup, network namespace, loop device or process of any sandbox.

Each test runs its own dsecd (own home, socket, run dir, cgroup subtree), never the session's, once with layers
extracted and once streamed lazily (EROFS over the agent's FUSE file system, whose connection must outlive the agent).
"""

from __future__ import annotations

import base64
import glob
import json
import os
import shutil
import signal
import tempfile
import threading
import time

import pytest

import dsec_testlib as lib


def lazy_layers_skip_reason() -> str | None:
    with open("/proc/filesystems") as f:
        if "\terofs\n" not in f.read():
            return "the kernel has no EROFS: layers can only be extracted here"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse: layers can only be extracted here"
    return None


@pytest.fixture(params=["extract", "lazy"])
def own_home(request, image_home):
    """A home of its own (records, layer cache), with the session's busybox image as its store; the layer mode."""
    if request.param == "lazy" and lazy_layers_skip_reason():
        pytest.skip(lazy_layers_skip_reason())
    home = tempfile.mkdtemp(prefix="dsec-it-recovery-")
    yield home, os.path.join(image_home, "store"), request.param
    shutil.rmtree(home, ignore_errors=True)


def start_agent(setup, *extra: str) -> lib.Agent:
    home, store, layer_mode = setup
    a = lib.Agent(home, tag="rec", extra_args=["--store", store, "--backends", "container,null",
                                               "--layer-mode", layer_mode, *extra])
    a.start()
    return a


def call(agent: lib.Agent, method: str, target: str, body=None, timeout: float = 30.0) -> lib.RawResponse:
    """One request on a fresh connection; a dict body goes as JSON, bytes as they are."""
    if isinstance(body, bytes):
        return lib.http_request(agent.socket_path, method, target, body, timeout=timeout)
    data = b"" if body is None else json.dumps(body).encode()
    return lib.http_request(agent.socket_path, method, target, data,
                            {"Content-Type": "application/json"} if data else None, timeout=timeout)


def spec(**fields) -> dict:
    out = {"image": "busybox", "ttl": 900, "resources": {"memory": "96Mi", "cpu": 0.1}}
    out.update(fields)
    return out


def client_cpu_idle(agent: lib.Agent) -> bool:
    """Whether the node idle-schedules batch groups (cgroup cpu.idle)."""
    return call(agent, "GET", "/v1/node").json()["qos"]["cpu_idle"]


def create(agent: lib.Agent, **fields) -> dict:
    r = call(agent, "POST", "/v1/sandboxes", spec(**fields))
    assert r.status in (200, 201), r
    return r.json()


def sh(agent: lib.Agent, sid: str, command: str, timeout: float = 30.0) -> tuple[int, str]:
    r = call(agent, "POST", f"/v1/sandboxes/{sid}/exec", {"shell": command, "timeout": timeout}, timeout=timeout + 15)
    assert r.status == 200, r
    result = r.json()
    return result["exit_code"], base64.b64decode(result["stdout"]).decode()


def info(agent: lib.Agent, sid: str) -> dict:
    r = call(agent, "GET", f"/v1/sandboxes/{sid}")
    assert r.status == 200, r
    return r.json()


# The counter renames a whole file into place: a reader never sees it truncated between two writes.
COUNTER = ("sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; "
           "sleep 0.1; done' >/dev/null 2>&1 &")


def count(agent: lib.Agent, sid: str) -> int:
    code, out = sh(agent, sid, "cat /tmp/count")
    assert code == 0, out
    return int(out.strip())


def counter_runs(agent: lib.Agent, sid: str) -> bool:
    first = count(agent, sid)
    return bool(lib.wait_for(lambda: count(agent, sid) > first, 10, interval=0.2))


# --------------------------------------------------------------------------------------------------------------
# What the host holds of the sandboxes: read from the records (pids, start times, namespaces), checked at the end.

def records(home: str) -> dict[str, dict]:
    """The sandbox records in the agent's state directory, by id (<id>.json, or <id>.destroying during a destroy)."""
    out = {}
    for pattern in ("*.json", "*.destroying"):
        for path in glob.glob(os.path.join(home, "state", "sandboxes", pattern)):
            try:
                with open(path) as f:
                    out[os.path.splitext(os.path.basename(path))[0]] = json.load(f)
            except (OSError, ValueError):
                pass
    return out


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat, or None when there is no such process (zombies count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return None if fields[0] == "Z" else int(fields[19])


class HostTracker:
    """Collects the identities of every sandbox the agent made (from its records) and says what of them is left."""

    def __init__(self, home: str, run_dir: str, cgroup_name: str) -> None:
        self.home, self.run_dir, self.cgroup_name = home, run_dir, cgroup_name
        self.inits: dict[str, tuple[int, int]] = {}
        self.netns: set[int] = set()

    def collect(self) -> None:
        for sid, rec in records(self.home).items():
            backend = rec.get("backend") or {}
            if "init_pid" in backend:
                self.inits[sid] = (int(backend["init_pid"]), int(backend["init_start_time"]))
                self.netns.add(int(backend["netns_inode"]))

    def leftovers(self) -> list[str]:
        problems = lib.leftovers(self.run_dir, self.cgroup_name)
        for sid, (pid, started) in self.inits.items():
            if start_time(pid) == started:
                problems.append(f"init of sandbox {sid} (pid {pid}) still runs")
        wanted = {f"net:[{ino}]" for ino in self.netns}
        for proc in glob.glob("/proc/[0-9]*"):
            links = [os.path.join(proc, "ns", "net")] + glob.glob(os.path.join(proc, "fd", "*"))
            for link in links:
                try:
                    target = os.readlink(link)
                except OSError:
                    continue
                if target in wanted:
                    problems.append(f"{link} holds a sandbox's network namespace {target}")
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                fstype = parts[parts.index("-") + 1]
                if fstype == "nsfs" and parts[3] in wanted:
                    problems.append(f"nsfs mount of a sandbox's network namespace at {parts[4]}")
        for backing in glob.glob("/sys/block/loop*/loop/backing_file"):
            try:
                with open(backing) as f:
                    path = f.read().strip()
            except OSError:
                continue
            if path.startswith((self.home, self.run_dir)):
                problems.append(f"loop device {backing.split('/')[3]} backed by {path}")
        return problems


def cgroup_file(agent: lib.Agent, sid: str, v1: tuple[str, str], v2: str) -> str:
    """A sandbox's cgroup file: v1 = (controller, file), v2 = file."""
    d = agent.cgroup_dir(v1[0], sid)
    path = os.path.join(d, v1[1])
    return path if os.path.exists(path) else os.path.join(agent.cgroup_dir("", sid), v2)


def set_frozen(agent: lib.Agent, sid: str, frozen: bool) -> None:
    """Freezes or thaws a sandbox from the host, as a sleep, wake or snapshot cut short by a kill leaves it."""
    path = cgroup_file(agent, sid, ("freezer", "freezer.state"), "cgroup.freeze")
    with open(path, "w") as f:
        f.write(("FROZEN" if frozen else "THAWED") if path.endswith("freezer.state") else ("1" if frozen else "0"))
    assert lib.wait_for(lambda: is_frozen(agent, sid) == frozen, 5)


def is_frozen(agent: lib.Agent, sid: str) -> bool:
    path = cgroup_file(agent, sid, ("freezer", "freezer.state"), "cgroup.freeze")
    with open(path) as f:
        state = f.read().strip()
    return state == "FROZEN" if path.endswith("freezer.state") else state == "1"


def memory_limit_file(agent: lib.Agent, sid: str) -> str:
    return cgroup_file(agent, sid, ("memory", "memory.limit_in_bytes"), "memory.max")


def read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read().strip())


def kill_sandbox_processes(agent: lib.Agent, sid: str) -> None:
    """What the OOM killer or an operator might do while no agent runs: every process of the sandbox dies."""
    for _ in range(100):
        pids = [pid for pid, _ in lib.processes_in_cgroup(f"{agent.cgroup_name}/{sid}")]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
    raise AssertionError(f"the processes of sandbox {sid} do not die")


def kill_everything_left(agent: lib.Agent) -> None:
    for pid, _ in lib.processes_in_cgroup(agent.cgroup_name):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# --------------------------------------------------------------------------------------------------------------

class Hammer:
    """Threads that keep the agent busy until it dies: creates with fresh request ids, short execs, and one long
    exec whose caller goes with the agent."""

    def __init__(self, agent: lib.Agent, exec_targets: list[str], long_target: str) -> None:
        self.agent = agent
        self.exec_targets = exec_targets
        self.long_target = long_target
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.answered: dict[str, str] = {}  # request id -> sandbox id, for creates that answered
        self.sent: list[str] = []           # every request id sent
        self.execs_done = 0
        self.threads: list[threading.Thread] = []

    def create_loop(self, n: int) -> None:
        i = 0
        while not self.stop.is_set():
            rid = f"hammer-{n}-{i}"
            i += 1
            with self.lock:
                self.sent.append(rid)
            try:
                r = call(self.agent, "POST", "/v1/sandboxes", spec(request_id=rid, labels={"hammer": rid}), timeout=20)
            except Exception:
                return  # the agent died under the request
            if r.status in (200, 201):
                with self.lock:
                    self.answered[rid] = r.json()["id"]
            elif r.status != 429:
                return

    def exec_loop(self, sid: str) -> None:
        while not self.stop.is_set():
            try:
                r = call(self.agent, "POST", f"/v1/sandboxes/{sid}/exec", {"shell": "echo hammer", "timeout": 10},
                         timeout=20)
            except Exception:
                return
            if r.status != 200:
                return
            with self.lock:
                self.execs_done += 1

    def long_exec(self) -> None:
        try:
            call(self.agent, "POST", f"/v1/sandboxes/{self.long_target}/exec", {"shell": "sleep 3111", "timeout": 600},
                 timeout=700)
        except Exception:
            pass

    def start_long_exec(self) -> None:
        self.threads.append(threading.Thread(target=self.long_exec, daemon=True))
        self.threads[-1].start()

    def start(self) -> None:
        more = [threading.Thread(target=self.create_loop, args=(n,), daemon=True) for n in range(3)]
        more += [threading.Thread(target=self.exec_loop, args=(sid,), daemon=True) for sid in self.exec_targets]
        for t in more:
            t.start()
        self.threads += more

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
            assert not t.is_alive(), "a hammer thread hangs on a dead agent"


def test_kill_9_and_restart_keeps_the_sandboxes(own_home):
    home = own_home[0]
    names = lib.Agent(home, tag="rec")  # only its names, for the host's state before anything starts
    shutil.rmtree(names.tmp)
    tracker = HostTracker(home, names.run_dir, names.cgroup_name)
    assert tracker.leftovers() == [], "the host is not clean before the test"
    a = start_agent(own_home)
    restarted = None
    try:
        # The second is batch-class: its cpu group is in the idle group beside the agent's subtree, and is taken
        # over from there.
        counters = [create(a, labels={"role": "counter", "n": str(i)}, **({"priority": "batch"} if i else {}))
                    for i in range(2)]
        for sb in counters:
            call(a, "PUT", f"/v1/sandboxes/{sb['id']}/files?path=/data/note", b"written before the crash\n")
            assert sh(a, sb["id"], COUNTER)[0] == 0
        sleeper = create(a, labels={"role": "sleeper"})
        assert sh(a, sleeper["id"], COUNTER)[0] == 0
        assert call(a, "POST", f"/v1/sandboxes/{sleeper['id']}/sleep").status == 200
        grouped = create(a, labels={"role": "grouped"}, group="crash-g", group_ttl=300)
        doomed = create(a, labels={"role": "doomed"})
        cut_sleep = create(a, labels={"role": "cut-sleep"})
        assert sh(a, cut_sleep["id"], COUNTER)[0] == 0
        cut_destroy = create(a, labels={"role": "cut-destroy"})
        simulated = create(a, kind="null", labels={"role": "simulated"})
        first = create(a, request_id="before-kill", labels={"role": "idempotent"})
        assert counter_runs(a, counters[0]["id"]) and counter_runs(a, counters[1]["id"])

        # A long exec runs at the kill, and creates and execs are under way.
        hammer = Hammer(a, [counters[1]["id"], grouped["id"]], counters[0]["id"])
        hammer.start_long_exec()
        assert lib.wait_for(lambda: "sleep 3111" in sh(a, counters[0]["id"], "ps")[1], 10)
        hammer.start()
        assert lib.wait_for(lambda: len(hammer.answered) >= 6 and hammer.execs_done >= 4, 30), \
            (hammer.answered, hammer.execs_done)
        tracker.collect()
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait()
        hammer.join()
        tracker.collect()  # records written up to the kill

        # While no agent runs: one sandbox dies, the others run on.
        kill_sandbox_processes(a, doomed["id"])
        assert lib.processes_in_cgroup(f"{a.cgroup_name}/{counters[0]['id']}"), "a sandbox died with its agent"
        # Operations the kill cut short, as they leave the host: a sleep that froze a sandbox and lowered its memory
        # limit but never recorded "sleeping"; a wake that thawed the sleeping one but never recorded "running"; a
        # destroy that renamed the record (<id>.destroying) but had not yet killed anything.
        limit = read_int(memory_limit_file(a, cut_sleep["id"]))
        set_frozen(a, cut_sleep["id"], True)
        with open(memory_limit_file(a, cut_sleep["id"]), "w") as f:
            f.write(str(64 << 20))
        set_frozen(a, sleeper["id"], False)
        state_dir = os.path.join(home, "state", "sandboxes")
        os.rename(os.path.join(state_dir, cut_destroy["id"] + ".json"),
                  os.path.join(state_dir, cut_destroy["id"] + ".destroying"))

        restarted = start_agent(own_home)
        log = restarted.log_tail()
        assert "taken over" in log, log
        r = call(restarted, "GET", "/v1/sandboxes")
        listed = {s["id"]: s for s in r.json()["sandboxes"]}

        # Surviving sandboxes: the same info, files and background processes; exec works; the exec in flight at
        # the kill is gone with its caller.
        for before in counters + [grouped, first, cut_sleep]:
            now = listed[before["id"]]
            assert now["state"] == "running", now
            for k in ("labels", "group", "created_at", "expires_at", "image", "resources"):
                assert now[k] == before[k], (k, now, before)
        for sb in counters:
            r = call(restarted, "GET", f"/v1/sandboxes/{sb['id']}/files?path=/data/note")
            assert r.status == 200 and r.body == b"written before the crash\n", r
            assert counter_runs(restarted, sb["id"]), f"the background counter of {sb['id']} stopped"
            assert sh(restarted, sb["id"], "echo alive") == (0, "alive\n")
        assert "sleep 3111" not in sh(restarted, counters[0]["id"], "ps")[1]
        assert info(restarted, counters[1]["id"])["priority"] == "batch"
        if client_cpu_idle(restarted):
            batch_dir = restarted.cgroup_dir("cpu", counters[1]["id"])
            assert ".batch/" in batch_dir and os.path.isdir(batch_dir), batch_dir
        # Sleep and wake work on a sandbox taken over.
        sid = counters[1]["id"]
        own_limit = read_int(memory_limit_file(restarted, sid))
        assert call(restarted, "POST", f"/v1/sandboxes/{sid}/sleep").status == 200
        assert is_frozen(restarted, sid)
        assert call(restarted, "POST", f"/v1/sandboxes/{sid}/wake").status == 200
        assert not is_frozen(restarted, sid)
        assert read_int(memory_limit_file(restarted, sid)) == own_limit
        assert counter_runs(restarted, sid)

        # The sleep cut short is undone: thawed, its memory limit its own again.
        assert listed[cut_sleep["id"]]["state"] == "running"
        assert not is_frozen(restarted, cut_sleep["id"])
        assert read_int(memory_limit_file(restarted, cut_sleep["id"])) == limit
        assert counter_runs(restarted, cut_sleep["id"])
        # The destroy cut short is finished.
        assert cut_destroy["id"] not in listed
        assert info(restarted, cut_destroy["id"])["state"] == "destroyed"
        assert not restarted.leftovers(cut_destroy["id"]), restarted.leftovers(cut_destroy["id"])

        # The sleeping one still sleeps (frozen again after the wake cut short), and wakes with its processes and
        # its own memory limit.
        assert listed[sleeper["id"]]["state"] == "sleeping"
        assert is_frozen(restarted, sleeper["id"])
        r = call(restarted, "POST", f"/v1/sandboxes/{sleeper['id']}/exec", {"shell": "true"})
        assert r.status == 412 and "sleeping" in r.json()["message"], r
        assert call(restarted, "POST", f"/v1/sandboxes/{sleeper['id']}/wake").status == 200
        assert counter_runs(restarted, sleeper["id"])
        assert read_int(memory_limit_file(restarted, sleeper["id"])) == limit

        # The group's lease carried over, and renews.
        r = call(restarted, "GET", "/v1/groups/crash-g")
        assert r.status == 200, r
        assert [s["id"] for s in r.json()["sandboxes"]] == [grouped["id"]]
        assert call(restarted, "POST", "/v1/groups/crash-g/renew", {"ttl": 300}).status == 200

        # The sandbox that died while the agent was down.
        gone = info(restarted, doomed["id"])
        assert gone["state"] == "failed", gone
        assert "died while the agent was down" in gone["message"], gone
        r = call(restarted, "POST", f"/v1/sandboxes/{doomed['id']}/exec", {"shell": "true"})
        assert r.status == 412, r

        # The simulated one is back too (its files lived in the old agent's memory).
        assert info(restarted, simulated["id"])["state"] == "running"

        # Request ids: answered creates come back as they were; every id yields at most one sandbox, and a retry
        # of one cut short by the kill yields exactly one.
        r = call(restarted, "POST", "/v1/sandboxes", spec(request_id="before-kill", labels={"role": "idempotent"}))
        assert r.status == 200 and r.json()["id"] == first["id"], r
        for rid, sid in hammer.answered.items():
            r = call(restarted, "POST", "/v1/sandboxes", spec(request_id=rid, labels={"hammer": rid}))
            assert r.status == 200 and r.json()["id"] == sid, (rid, r)
        cut_short = [rid for rid in hammer.sent if rid not in hammer.answered]
        for rid in cut_short:
            r = call(restarted, "POST", "/v1/sandboxes", spec(request_id=rid, labels={"hammer": rid}))
            assert r.status in (200, 201), (rid, r)
        for rid in hammer.sent:
            r = call(restarted, "GET", f"/v1/sandboxes?label=hammer={rid}")
            assert len(r.json()["sandboxes"]) == 1, (rid, r.json())

        # Nothing of the creates cut short is left: cgroups, run dirs and records are those of live sandboxes.
        live = {s["id"] for s in call(restarted, "GET", "/v1/sandboxes").json()["sandboxes"]}
        containers = {sid for sid, rec in records(home).items() if rec["info"]["kind"] == "container"}
        for root in lib.cgroup_roots(restarted.cgroup_name):
            groups = {d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))}
            assert groups <= containers, f"cgroups of no sandbox in {root}: {sorted(groups - containers)}"
        run_entries = {e for e in os.listdir(restarted.run_dir) if not e.startswith(".")}
        assert run_entries <= containers, f"run dirs of no sandbox: {sorted(run_entries - containers)}"
        assert set(records(home)) == live

        # The image layers are held again, once per sandbox taken over (the failed one holds none).
        holders = sum(1 for sid in live if info(restarted, sid)["state"] in ("running", "sleeping"))

        def users() -> list[int]:  # the layer code keeps what it took over until the reaper's first prune
            return [layer["users"] for layer in call(restarted, "GET", "/v1/node").json()["cached_layers"]]
        assert users() and lib.wait_for(lambda: set(users()) == {holders}, 5), (users(), holders)

        metrics = call(restarted, "GET", "/metrics").body.decode()
        assert 'dsec_sandboxes_recovered_total{kind="container",outcome="adopted"}' in metrics, metrics

        # Destroy everything, stop: nothing of any sandbox is left on the host.
        tracker.collect()
        assert len(tracker.inits) >= 8 and len(tracker.netns) >= 8, tracker.inits
        for sid in live:
            assert call(restarted, "DELETE", f"/v1/sandboxes/{sid}").status == 200
        assert restarted.stop() == 0, restarted.log_tail()
        assert lib.wait_for(lambda: not tracker.leftovers(), 10), "\n".join(tracker.leftovers())
        assert records(home) == {}
    finally:
        for agent in (a, restarted):
            if agent is not None:
                agent.stop()
                kill_everything_left(agent)
                agent.remove_husks()
        shutil.rmtree(a.run_dir, ignore_errors=True)


def test_sigusr2_leaves_the_sandboxes_for_the_next_start(own_home):
    """SIGUSR2 stops the agent and leaves its sandboxes running (a restart for an upgrade); a start with
    --on-restart remove destroys what an earlier run left."""
    home = own_home[0]
    a = start_agent(own_home)
    tracker = HostTracker(home, a.run_dir, a.cgroup_name)
    agents = [a]
    try:
        sb = create(a, request_id="kept")
        assert sh(a, sb["id"], COUNTER)[0] == 0
        tracker.collect()
        a.proc.send_signal(signal.SIGUSR2)
        assert a.proc.wait(15) == 0, a.log_tail()
        assert not os.path.exists(a.socket_path), "socket file left"
        assert lib.processes_in_cgroup(f"{a.cgroup_name}/{sb['id']}"), "SIGUSR2 took the sandbox down"

        b = start_agent(own_home)
        agents.append(b)
        assert info(b, sb["id"])["state"] == "running"
        assert counter_runs(b, sb["id"])
        b.proc.send_signal(signal.SIGUSR2)
        assert b.proc.wait(15) == 0, b.log_tail()

        c = start_agent(own_home, "--on-restart", "remove")
        agents.append(c)
        gone = info(c, sb["id"])
        assert gone["state"] == "destroyed", gone
        r = call(c, "POST", "/v1/sandboxes", spec(request_id="kept"))
        assert r.status == 200 and r.json()["id"] == sb["id"], r  # not made a second time
        assert call(c, "GET", "/v1/sandboxes").json()["sandboxes"] == []
        assert c.stop() == 0, c.log_tail()
        assert lib.wait_for(lambda: not tracker.leftovers(), 10), "\n".join(tracker.leftovers())
    finally:
        for agent in agents:
            agent.stop()
            kill_everything_left(agent)
            agent.remove_husks()
        shutil.rmtree(a.run_dir, ignore_errors=True)


def test_kill_9_during_a_snapshot(own_home):
    """An agent killed while it snapshots a sandbox (frozen for the copy of its writable layer, or packing the copy
    into a layer) leaves no tag, no staging file and no frozen sandbox: the next start takes the sandbox over awake,
    and a snapshot of the same name then succeeds."""
    home = own_home[0]
    snap_store = os.path.join(home, "snapshots")
    a = start_agent(own_home, "--snapshot-store", snap_store, "--store", snap_store)
    restarted = None
    tracker = HostTracker(home, a.run_dir, a.cgroup_name)
    staging = os.path.join(a.run_dir, ".snapshots")
    try:
        sb = create(a, resources={"memory": "512Mi", "cpu": 0.5})
        sid = sb["id"]
        # 192 MiB of random files in its writable layer: the copy takes long enough to be caught frozen.
        code, out = sh(a, sid, "for i in 1 2 3 4 5 6; do head -c 33554432 /dev/urandom > /f$i || exit 1; done; "
                               "md5sum /f1 /f6", timeout=120)
        assert code == 0, out
        assert sh(a, sid, COUNTER)[0] == 0
        tracker.collect()

        answer: dict = {}

        def snapshot() -> None:
            try:
                answer["r"] = call(a, "POST", f"/v1/sandboxes/{sid}/snapshot", {"name": "cut/short:1"}, timeout=300)
            except Exception as e:  # the agent dies under it
                answer["error"] = e

        t = threading.Thread(target=snapshot, daemon=True)
        t.start()
        # Kill it while the sandbox is frozen for the copy; failing that, once the copy is on the staging disk.
        caught_frozen = lib.wait_for(lambda: is_frozen(a, sid), 20, interval=0.002)
        if not caught_frozen:
            assert lib.wait_for(lambda: os.path.isdir(staging) and os.listdir(staging), 20, interval=0.005), \
                "the snapshot never started"
        a.proc.kill()
        a.proc.wait(15)
        t.join(60)
        assert "r" not in answer or answer["r"].status >= 300, "the snapshot finished before the kill"

        restarted = start_agent(own_home, "--snapshot-store", snap_store, "--store", snap_store)
        got = info(restarted, sid)
        assert got["state"] == "running", got
        assert not is_frozen(restarted, sid), "the sandbox was left frozen"
        assert counter_runs(restarted, sid)
        assert not os.path.isdir(staging) or os.listdir(staging) == [], os.listdir(staging)
        code, again = sh(restarted, sid, "md5sum /f1 /f6")
        assert code == 0 and again == out, (again, out)

        # No tag was written by the snapshot cut short: the same name is free, and the sandbox taken over snapshots.
        r = call(restarted, "POST", f"/v1/sandboxes/{sid}/snapshot", {"name": "cut/short:1"}, timeout=300)
        assert r.status == 201, r
        made = create(restarted, image=r.json()["image"], resources={"memory": "512Mi", "cpu": 0.5})
        code, copy = sh(restarted, made["id"], "md5sum /f1 /f6")
        assert code == 0 and copy == out, (copy, out)

        tracker.collect()
        for s in (sid, made["id"]):
            assert call(restarted, "DELETE", f"/v1/sandboxes/{s}").status == 200
        assert restarted.stop() == 0, restarted.log_tail()
        assert lib.wait_for(lambda: not tracker.leftovers(), 10), "\n".join(tracker.leftovers())
    finally:
        for agent in (a, restarted):
            if agent is not None:
                agent.stop()
                kill_everything_left(agent)
                agent.remove_husks()
        shutil.rmtree(a.run_dir, ignore_errors=True)


def test_processes_and_sessions_survive_kill_9(own_home):
    """A sandbox's init keeps its processes and shell sessions: after kill -9 of the agent, the next agent reads a
    process's output from the start, writes its stdin, and runs in the session with its directory and exports."""
    a = start_agent(own_home)
    agents = [a]
    try:
        sb = create(a)
        sid = sb["id"]
        r = call(a, "POST", f"/v1/sandboxes/{sid}/sessions", {"name": "main"})
        assert r.status == 200 and r.json()["alive"], r
        r = call(a, "POST", f"/v1/sandboxes/{sid}/sessions/main/run", {"command": "cd /tmp && export KEPT=yes"})
        assert r.status == 200 and r.json()["exit_code"] == 0, r
        r = call(a, "POST", f"/v1/sandboxes/{sid}/processes",
                 {"shell": "echo before; read line; echo got $line; exit 7"})
        assert r.status == 200 and r.json()["running"], r
        pid = r.json()["pid"]
        # Exactly-once execs: one finished before the kill, one under way at it.
        done = call(a, "POST", f"/v1/sandboxes/{sid}/exec", {"shell": "echo once >> /tmp/once; cat /tmp/once",
                                                             "request_id": "before"})
        assert done.status == 200, done

        def cut_exec():
            try:
                call(a, "POST", f"/v1/sandboxes/{sid}/exec",
                     {"shell": "sleep 300", "request_id": "cut", "timeout": 600}, timeout=5)
            except Exception:
                pass  # the agent is killed under it

        cut = threading.Thread(target=cut_exec, daemon=True)
        cut.start()
        assert lib.wait_for(lambda: "sleep 300" in sh(a, sid, "ps")[1], 10)

        a.proc.kill()
        a.proc.wait(15)
        b = start_agent(own_home)
        agents.append(b)
        assert info(b, sid)["state"] == "running"

        sessions = call(b, "GET", f"/v1/sandboxes/{sid}/sessions").json()["sessions"]
        assert [s["name"] for s in sessions] == ["main"] and sessions[0]["alive"], sessions
        r = call(b, "POST", f"/v1/sandboxes/{sid}/sessions/main/run", {"command": "pwd; echo $KEPT"})
        assert r.status == 200, r
        assert base64.b64decode(r.json()["stdout"]) == b"/tmp\nyes\n", r.json()

        r = call(b, "POST", f"/v1/sandboxes/{sid}/processes/{pid}/stdin?close=true", b"after the restart\n")
        assert r.status == 200, r
        r = call(b, "GET", f"/v1/sandboxes/{sid}/processes/{pid}?wait=10")
        assert r.status == 200 and not r.json()["running"] and r.json()["exit_code"] == 7, r
        out = call(b, "GET", f"/v1/sandboxes/{sid}/processes/{pid}/output?stdout=0").json()
        assert base64.b64decode(out["stdout"]) == b"before\ngot after the restart\n", out

        again = call(b, "POST", f"/v1/sandboxes/{sid}/exec", {"shell": "echo once >> /tmp/once; cat /tmp/once",
                                                              "request_id": "before"})
        assert again.status == 200 and again.json() == done.json(), again
        unknown = call(b, "POST", f"/v1/sandboxes/{sid}/exec",
                       {"shell": "sleep 300", "request_id": "cut", "timeout": 600})
        assert unknown.status == 500 and unknown.json()["code"] == "DATA_LOSS", unknown
        assert "outcome unknown" in unknown.json()["message"] and unknown.json()["fault"] == "infrastructure"
        client = lib.dsec.Client(endpoints=[b.endpoint])
        try:
            with pytest.raises(lib.dsec.OutcomeUnknown) as raised:
                client.attach(sid).exec("sleep 300", timeout=600, request_id="cut")
            assert raised.value.request_id == "cut" and raised.value.infra
            assert client.attach(sid).exec("echo once >> /tmp/once; cat /tmp/once", request_id="before").stdout == \
                base64.b64decode(done.json()["stdout"])
        finally:
            client.close()
        assert sh(b, sid, "cat /tmp/once")[1] == "once\n"  # the finished one did not run again
        assert b.stop() == 0, b.log_tail()
    finally:
        for agent in agents:
            agent.stop()
            kill_everything_left(agent)
            agent.remove_husks()
        shutil.rmtree(a.run_dir, ignore_errors=True)
