"""dsec.AsyncClient against the session's real dsecd: every call end to end, many execs from one loop on one I/O
thread, cancellation and a later fetch by request id, streaming order, error classes, the embedded agent.

Plain test functions running asyncio.run(...), so no pytest plugin is needed.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

import dsec_testlib as lib

dsec = lib.dsec


def _native_threads() -> int:
    """Threads of this process as the kernel counts them (native threads included, unlike threading's count)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads: line in /proc/self/status")


async def _no_call_in_flight(aclient) -> bool:
    """Whether the I/O thread has let go of every call within a second (a cancel reaches it asynchronously)."""
    for _ in range(100):
        if aclient.in_flight == 0:
            return True
        await asyncio.sleep(0.01)
    return False


@pytest.fixture(scope="module")
def aclient(agent):
    c = dsec.AsyncClient(endpoints=[agent.endpoint])
    yield c
    c.close_now()


def _sandbox(aclient, module_sandbox):
    return aclient.attach(module_sandbox.id)


def test_exec_files_info_and_errors(aclient, module_sandbox):
    async def main():
        sb = _sandbox(aclient, module_sandbox)
        r = await sb.exec("echo out; echo err >&2; exit 3", env={"A": "1"})
        assert (r.exit_code, r.stdout, r.stderr) == (3, b"out\n", b"err\n"), r
        r = await sb.exec(["cat"], stdin=b"piped")
        assert r.stdout == b"piped", r
        assert (await sb.exec("sleep 5", timeout=0.5)).timed_out

        await sb.write_file("/tmp/aio.txt", "hello", 0o600)
        assert await sb.read_file("/tmp/aio.txt") == b"hello"
        tar = await sb.download_tar("/tmp")
        await sb.upload_tar("/tmp/aio-copy", tar)
        assert await sb.read_file("/tmp/aio-copy/aio.txt") == b"hello"
        info = await sb.info()
        assert info.id == sb.id and info.state == "running"

        with pytest.raises(dsec.NotFound):
            await sb.read_file("/tmp/no-such-file")
        with pytest.raises(dsec.InvalidArgument):
            await sb.read_file("/tmp")  # a directory
        with pytest.raises(dsec.NotFound):
            await aclient.attach("vm-000000000000").exec("true")
        with pytest.raises(dsec.InvalidArgument):
            await sb.exec("true", timeout=-1)
        # The same request id with another command is refused; with the same command it is answered again.
        first = await sb.exec("echo once", request_id="aio-same-id")
        again = await sb.exec("echo once", request_id="aio-same-id")
        assert first.stdout == again.stdout == b"once\n"
        with pytest.raises(dsec.InvalidArgument):
            await sb.exec("echo other", request_id="aio-same-id")

    asyncio.run(main())


def test_many_concurrent_execs_use_few_threads(aclient, module_sandbox):
    async def main():
        sb = _sandbox(aclient, module_sandbox)
        peak = {"py": 0, "native": 0}
        done = asyncio.Event()

        async def watch():
            while not done.is_set():
                peak["py"] = max(peak["py"], threading.active_count())
                peak["native"] = max(peak["native"], _native_threads())
                await asyncio.sleep(0.01)

        watcher = asyncio.ensure_future(watch())
        results = await asyncio.gather(*(sb.exec(f"echo {i}") for i in range(200)))
        done.set()
        await watcher
        assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(200)]
        assert peak["py"] < 50 and peak["native"] < 50, peak
        assert await _no_call_in_flight(aclient)

    asyncio.run(main())


def test_cancel_leaves_the_command_running_and_its_result_is_fetched_by_id(aclient, module_sandbox):
    async def main():
        sb = _sandbox(aclient, module_sandbox)
        rid = f"aio-cancel-{os.getpid()}-{time.monotonic_ns()}"
        task = asyncio.ensure_future(sb.exec("sleep 1.5; echo finished >/tmp/aio-cancel; echo done", request_id=rid))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError) as caught:
            await task
        assert time.monotonic() - started < 0.5
        assert await _no_call_in_flight(aclient)
        assert rid in str(caught.value) or caught.value.args == ()  # the message names the id where it survives
        # The command ran on in the sandbox; the same request id returns its result instead of running it again.
        r = await sb.exec("sleep 1.5; echo finished >/tmp/aio-cancel; echo done", request_id=rid)
        assert r.exit_code == 0 and r.stdout == b"done\n", r
        assert await sb.read_file("/tmp/aio-cancel") == b"finished\n"

        # asyncio.wait_for cancels the same way.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sb.exec("sleep 3"), 0.2)

    asyncio.run(main())


def test_streaming_runs_on_the_loop_in_order(aclient, module_sandbox):
    async def main():
        sb = _sandbox(aclient, module_sandbox)
        loop_thread = threading.get_ident()
        got = []

        def on_output(stream, data):
            assert threading.get_ident() == loop_thread
            got.append((stream, data))

        r = await sb.exec("i=0; while [ $i -lt 50 ]; do echo line$i; i=$((i+1)); done; echo bad >&2",
                          on_output=on_output)
        assert r.exit_code == 0 and r.stdout == b""
        out = b"".join(d for s, d in got if s == "stdout")
        assert out == b"".join(f"line{i}\n".encode() for i in range(50))
        assert b"".join(d for s, d in got if s == "stderr") == b"bad\n"

        class Stop(Exception):
            pass

        def refuse(stream, data):
            raise Stop()

        with pytest.raises(Stop):
            await sb.exec("echo x; sleep 2", on_output=refuse)
        assert await _no_call_in_flight(aclient)

    asyncio.run(main())


def test_sessions_and_processes(aclient, module_sandbox):
    async def main():
        sb = _sandbox(aclient, module_sandbox)
        async with await sb.shell() as sh:
            await sh.run("cd /tmp && export AIO=7")
            r = await sh.run("pwd; echo $AIO")
            assert r.stdout == b"/tmp\n7\n", r
            streamed = []
            r = await sh.run("echo a; echo b", on_output=lambda s, d: streamed.append(d))
            assert b"".join(streamed) == b"a\nb\n"
            assert (await sh.info()).alive
            assert any(s.name == sh.name for s in await sb.sessions())
            assert (await sh.restart()).alive
            assert (await sh.run("echo ${AIO:-gone}")).stdout == b"gone\n"
        assert all(s.name != sh.name for s in await sb.sessions())

        p = await sb.spawn(["cat"])
        await p.write_stdin(b"hello\n")
        await p.close_stdin()
        info = await p.wait(10)
        assert not info.running and info.exit_code == 0
        assert [c async for c in p.stdout] == [b"hello\n"]
        out = await p.read(0, 0)
        assert out.stdout == b"hello\n" and out.stderr == b""
        assert any(x.pid == p.pid for x in await sb.processes())
        await p.kill()

        q = await sb.spawn("sleep 30")
        assert (await q.info()).running
        assert (await q.wait(0.2)).running
        ended = await q.signal("TERM")
        info = await q.wait(10)
        assert not info.running and info.signal == 15, (ended, info)
        await q.kill()
        with pytest.raises(dsec.NotFound):
            await q.info()

        missing = await sb.spawn(["/no/such/program"])
        assert missing.pid == 0 and not (await missing.wait()).running
        with pytest.raises(dsec.FailedPrecondition):
            await missing.write_stdin(b"x")

    asyncio.run(main())


def test_create_sleep_snapshot_destroy(aclient, agent):
    async def main():
        async with await aclient.create(image="busybox", ttl=300, memory="128Mi") as sb:
            assert (await sb.exec("echo made")).stdout == b"made\n"
            slept = await sb.sleep()
            assert slept.info.state == "sleeping"
            with pytest.raises(dsec.FailedPrecondition):
                await sb.exec("true")
            assert (await sb.wake()).info.state == "running"
            many = await aclient.create_many(2, image="busybox", ttl=300, memory="128Mi")
            results = await asyncio.gather(*(m.exec("hostname") for m in many))
            assert [r.stdout for r in results] == [f"{m.id}\n".encode() for m in many]
            await asyncio.gather(*(m.destroy() for m in many))
        assert sb.destroyed
        try:
            assert (await aclient.attach(sb.id).info()).state == "destroyed"
        except dsec.NotFound:
            pass

    asyncio.run(main())


def test_embedded_agent(image_home, monkeypatch):
    monkeypatch.setenv("DSEC_HOME", image_home)

    async def main():
        async with dsec.AsyncClient(agent=str(lib.DSECD),
                                    agent_args=["--cgroup-name", f"dsec-test-{os.getpid()}-aio",
                                                "--node-id", f"aio{os.getpid()}"]) as client:
            assert client.endpoint.startswith("unix:")
            async with await client.create(image="busybox", ttl=300) as sb:
                r = await sb.exec("echo embedded")
                assert r.stdout == b"embedded\n"
        assert client.closed

    asyncio.run(main())
