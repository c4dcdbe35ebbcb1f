"""dsec for asyncio programs (:class:`AsyncClient`): the sync API's names and arguments, with ``await``.

    async with dsec.AsyncClient() as client:
        async with await client.create(image="busybox") as sb:
            results = await asyncio.gather(*(sb.exec(f"echo {i}") for i in range(1000)))

How it runs. The calls about one sandbox (exec, streamed exec, session runs, process reads, waits, stdin and
signals, files, info, destroy, sleep and wake) are single HTTP exchanges on the client's **asyncio core**: one
libcurl multi handle driven by ONE native I/O thread per client, however many calls are in flight (no thread per
call). A finished exchange resolves its asyncio future through ``loop.call_soon_threadsafe``; streamed output
(``on_output``) is scheduled the same way, in order, so ``on_output`` runs on the event loop's thread, before the
call returns. Retries (same request id, same body, one deadline), ``dsec.OutcomeUnknown`` and the error classes are
those of the sync client; retry backoffs are timers of the I/O thread.

Calls whose logic is big and rare run the sync client's code on a small executor of at most 4 threads
(``AsyncClient.EXECUTOR_THREADS``), made on first use: :meth:`AsyncClient.create`, ``create_many``,
``create_group`` (placement and failover), ``run_code`` and ``run_code_many`` (node choice, batching), ``list``,
``nodes``, :meth:`AsyncSandbox.snapshot`, ``fork``, the network calls (``network``, ``set_network``, ``expose``,
``unexpose``, ``exposed``, ``network_usage``), building and unpacking the tar streams of ``upload``/``download``,
group calls, and :meth:`AsyncClient.close` (stopping the embedded agent).

Cancellation. Cancelling a task that awaits a call takes the call's transfer off the multi handle: the client stops
waiting at once. What the request started on the agent goes on: a command keeps running in the sandbox to its end or
its timeout (the agent never stops a command for a client that went away), and because an exec carries a request id,
``await sb.exec(command, request_id=same_id)`` later returns its result instead of running it again. The
``CancelledError`` raised from a cancelled exec says so and names the id.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import functools
import os
import sys
import time
import uuid
from typing import (TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, Mapping, Optional, Sequence, Tuple, Union,
                    overload)

from . import _dsec
from .client import Client
from .errors import FailedPrecondition, InvalidArgument, NotFound
from .group import SandboxGroup, _Members
from .process import (_READ_WAIT, _WAIT_SLICE, _check_pid, _check_terminal_size, _follow_start, _follow_step,
                      _signal_number)
from ._spec import (DEFAULT_IMAGE, DEFAULT_KIND, SpecKeywords, _field_size, _request_id, _str_map, _user,
                    takes_spec_keywords)
from ._types import (BytesLike, ExecResult, FnCallResult, ImageInfo, NodeInfo, ProcessInfo, ProcessOutput, SandboxInfo,
                     SessionInfo, Size, SleepResult)
from .sandbox import Sandbox, Snapshot, _command, _safe_extract, _tar_of
from .session import _check_session_name, _run_limit

if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        from typing import Unpack
    else:
        from typing_extensions import Unpack

__all__ = ["AsyncClient", "AsyncSandbox", "AsyncSandboxGroup", "AsyncSession", "AsyncProcess"]


def _resolve(future: asyncio.Future, exc: Optional[BaseException], value: Any) -> None:
    """Run on the loop by the I/O thread (call_soon_threadsafe) when a call ends."""
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)


def _deliver(future: asyncio.Future, on_output: Callable[[str, bytes], object], stream: str, data: bytes) -> None:
    """Run on the loop by the I/O thread for each piece of streamed output, in order, before _resolve."""
    if future.done():
        return
    try:
        on_output(stream, data)
    except BaseException as e:  # ends the call as the sync client's on_output does; the command runs on
        future.set_exception(e)


def _run_batch(calls: list) -> None:
    """Run on the loop once per round of the I/O thread: the _resolve and _deliver calls it queued, in order."""
    for fn, *args in calls:
        fn(*args)


@overload
def _bytes(data: None, what: str) -> None: ...


@overload
def _bytes(data: BytesLike, what: str) -> bytes: ...


def _bytes(data: BytesLike | None, what: str) -> Optional[bytes]:
    if data is None:
        return None
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise InvalidArgument(f"{what}: expected bytes or str")


async def _await(start: Callable[..., Any], *args: Any, cancelled: Optional[str] = None) -> Any:
    """Starts a call on the asyncio core and awaits it; cancelling takes its transfer off the multi handle."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    ticket = start(loop, future, *args)
    try:
        return await future
    except asyncio.CancelledError:
        ticket.cancel()
        if cancelled:
            raise asyncio.CancelledError(cancelled) from None
        raise
    except BaseException:
        ticket.cancel()  # on_output raised: the client stops waiting
        raise


class AsyncClient:
    """:class:`dsec.Client` for asyncio: the same arguments (``AsyncClient()`` starts an embedded agent,
    ``AsyncClient(endpoints=[...])`` talks to running ones), every call a coroutine. Use ``async with`` or
    ``await client.close()``.

    Per-sandbox calls run on the client's asyncio core (one native I/O thread, a libcurl multi handle); create,
    create_many, create_group, run_code, run_code_many, list, nodes and close run the sync client's code on a
    bounded executor of ``EXECUTOR_THREADS`` threads (see :mod:`dsec.aio`). Constructing the client starts the
    embedded agent, which blocks for as long as that takes (about a second).
    """

    EXECUTOR_THREADS = 4

    def __init__(self, endpoints: Union[str, Iterable[str], None] = None, **options: Any) -> None:
        self._sync = Client(endpoints, **options)
        self._core = _dsec.AsyncCore(self._sync._client, _resolve, _deliver, _run_batch)
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None

    @property
    def sync(self) -> Client:
        """The blocking :class:`dsec.Client` this one stands on (same agent, same nodes)."""
        return self._sync

    @property
    def endpoint(self) -> str:
        return self._sync.endpoint

    @property
    def closed(self) -> bool:
        return self._sync.closed

    @property
    def in_flight(self) -> int:
        """Calls on the asyncio core not finished yet."""
        return self._core.in_flight

    async def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A sync call on the bounded executor."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(self.EXECUTOR_THREADS, thread_name_prefix="dsec-aio")
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    @takes_spec_keywords
    async def create(self, image: str = DEFAULT_IMAGE, kind: str = DEFAULT_KIND,
                     **spec: Unpack[SpecKeywords]) -> "AsyncSandbox":
        """:meth:`Client.create` (same arguments); on the bounded executor."""
        return AsyncSandbox(await self._run(self._sync.create, image, kind, **spec), self)

    @takes_spec_keywords
    async def create_many(self, n: int | Sequence[Mapping[str, Any]], image: str = DEFAULT_IMAGE,
                          kind: str = DEFAULT_KIND, **spec: Unpack[SpecKeywords]) -> list["AsyncSandbox"]:
        """:meth:`Client.create_many` (same arguments); on the bounded executor."""
        return [AsyncSandbox(s, self) for s in await self._run(self._sync.create_many, n, image, kind, **spec)]

    @takes_spec_keywords
    async def create_group(self, n: int | Sequence[Mapping[str, Any]], image: str = DEFAULT_IMAGE,
                           kind: str = DEFAULT_KIND, *, lease: float = 30.0,
                           **spec: Unpack[SpecKeywords]) -> "AsyncSandboxGroup":
        """:meth:`Client.create_group` (same arguments); on the bounded executor."""
        return AsyncSandboxGroup(await self._run(self._sync.create_group, n, image, kind, lease=lease, **spec), self)

    async def run_code(self, code: str, language: str = "python", **kwargs: Any) -> FnCallResult:
        """:meth:`Client.run_code` (same arguments); on the bounded executor."""
        return await self._run(self._sync.run_code, code, language, **kwargs)

    async def run_code_many(self, calls: Iterable[Any]) -> list[FnCallResult]:
        """:meth:`Client.run_code_many`; on the bounded executor."""
        return await self._run(self._sync.run_code_many, list(calls))

    def attach(self, sandbox_id: str) -> "AsyncSandbox":
        """A handle on an existing sandbox by id; no call is made until it is used."""
        return AsyncSandbox(self._sync.attach(sandbox_id), self)

    async def list(self, labels: Mapping[str, str] | None = None, tenant: str = "") -> list[SandboxInfo]:
        return await self._run(self._sync.list, labels, tenant)

    async def nodes(self) -> builtins.list[NodeInfo]:
        return await self._run(self._sync.nodes)

    async def images(self) -> builtins.list[ImageInfo]:
        return await self._run(self._sync.images)

    async def remove_image(self, name: str) -> None:
        await self._run(self._sync.remove_image, name)

    async def close(self) -> None:
        """Ends the I/O thread (calls still in flight raise :class:`FailedPrecondition`), then stops the embedded
        agent (destroying its sandboxes) off the loop. Idempotent."""
        self._core.close()
        if not self._sync.closed:
            await asyncio.get_running_loop().run_in_executor(None if self._executor is None else self._executor,
                                                             self._sync.close)
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    def close_now(self) -> None:
        """:meth:`close` for code outside the loop (blocks while the embedded agent stops)."""
        self._core.close()
        self._sync.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return "<dsec.AsyncClient closed>" if self.closed else f"<dsec.AsyncClient {self.endpoint}>"


class AsyncSandbox:
    """:class:`dsec.Sandbox` for asyncio: the same methods as coroutines. ``async with`` destroys it at the end.
    Not destroyed by garbage collection."""

    __slots__ = ("_sb", "_client", "_destroyed")

    def __init__(self, sandbox: Sandbox, client: AsyncClient) -> None:
        self._sb = sandbox
        self._client = client
        self._destroyed = False

    @property
    def id(self) -> str:
        return self._sb.id

    @property
    def client(self) -> AsyncClient:
        return self._client

    @property
    def sync(self) -> Sandbox:
        """The blocking :class:`dsec.Sandbox` handle on the same sandbox."""
        return self._sb

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def _core(self) -> _dsec.AsyncCore:
        if self._destroyed:
            raise FailedPrecondition(f"sandbox {self.id} was destroyed through this handle")
        return self._client._core

    async def exec(
        self,
        command: Union[str, Sequence[str]],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: BytesLike | None = None,
        timeout: float = 600,
        max_output: Size = 16 << 20,
        on_output: Callable[[str, bytes], object] | None = None,
        user: str | int | None = None,
        request_id: str | None = None,
    ) -> ExecResult:
        """:meth:`Sandbox.exec`, awaited. ``on_output(stream, data)`` runs on the event loop's thread, in order,
        before the result. Cancelling leaves the command running in the sandbox to its end or timeout; the
        ``CancelledError`` names the request id (one is made when None) with which ``exec`` fetches its result."""
        argv, shell = _command(command)
        rid = _request_id(request_id) or uuid.uuid4().hex
        return await _await(
            self._core().exec, self.id, argv, shell, _str_map(env, "env"), cwd or "", _bytes(stdin, "stdin"),
            float(timeout), _field_size(max_output, "max_output"), on_output, _user(user), rid,
            cancelled=(f"exec in sandbox {self.id} cancelled: the client stopped waiting, the command runs on in the "
                       f"sandbox to its end or timeout; exec(..., request_id={rid!r}) returns its result"))

    async def write_file(self, path: str, data: BytesLike, mode: int = 0o644) -> None:
        if not isinstance(mode, int) or mode < 0 or mode > 0o7777:
            raise InvalidArgument(f"mode: {mode!r} is not a file mode (0 to 0o7777)")
        await _await(self._core().write_file, self.id, path, _bytes(data, "data"), mode)

    async def read_file(self, path: str) -> bytes:
        return await _await(self._core().read_file, self.id, path)

    async def upload_tar(self, remote_dir: str, tar_bytes: BytesLike) -> None:
        await _await(self._core().upload_tar, self.id, remote_dir, _bytes(tar_bytes, "tar_bytes"))

    async def download_tar(self, remote_dir: str) -> bytes:
        return await _await(self._core().download_tar, self.id, remote_dir)

    async def upload(self, local_path: str | os.PathLike, remote_dir: str) -> None:
        """:meth:`Sandbox.upload`: the tar stream is built on the bounded executor, sent on the asyncio core."""
        await self.upload_tar(remote_dir, await self._client._run(_tar_of, os.fspath(local_path)))

    async def download(self, remote_dir: str, local_dir: str | os.PathLike) -> None:
        """:meth:`Sandbox.download`: fetched on the asyncio core, unpacked on the bounded executor."""
        await self._client._run(_safe_extract, await self.download_tar(remote_dir), os.fspath(local_dir))

    async def info(self) -> SandboxInfo:
        return await _await(self._core().info, self.id)

    async def sleep(self) -> SleepResult:
        return await _await(self._core().sleep, self.id)

    async def wake(self) -> SleepResult:
        return await _await(self._core().wake, self.id)

    async def snapshot(self, name: str) -> Snapshot:
        """:meth:`Sandbox.snapshot`; on the bounded executor."""
        return await self._client._run(self._sb.snapshot, name)

    async def fork(self, n: int, name: str | None = None, keep: bool = False) -> list["AsyncSandbox"]:
        """:meth:`Sandbox.fork`; on the bounded executor."""
        return [AsyncSandbox(s, self._client) for s in await self._client._run(self._sb.fork, n, name, keep)]

    async def network(self) -> dict:
        return await self._client._run(self._sb.network)

    async def set_network(self, mode: Any = "egress", rules: Any = None) -> dict:
        return await self._client._run(self._sb.set_network, mode, rules)

    async def expose(self, port: int) -> str:
        return await self._client._run(self._sb.expose, port)

    async def unexpose(self, port: int) -> None:
        await self._client._run(self._sb.unexpose, port)

    async def exposed(self) -> dict[int, str]:
        return await self._client._run(self._sb.exposed)

    async def network_usage(self) -> dict:
        return await self._client._run(self._sb.network_usage)

    # A full VM's screen (dsec.screen): the same calls as Sandbox's.
    async def screenshot(self) -> bytes:
        return await self._client._run(self._sb.screenshot)

    async def screen(self) -> dict:
        return await self._client._run(self._sb.screen)

    async def cursor(self) -> Optional[tuple[int, int]]:
        return await self._client._run(self._sb.cursor)

    async def input(self, actions: Sequence[Mapping[str, Any]]) -> dict:
        return await self._client._run(self._sb.input, actions)

    async def mouse_move(self, x: int, y: int) -> dict:
        return await self._client._run(self._sb.mouse_move, x, y)

    async def click(self, x: Optional[int] = None, y: Optional[int] = None, button: str = "left",
                    double: bool = False) -> dict:
        return await self._client._run(self._sb.click, x, y, button, double)

    async def scroll(self, dy: int, x: Optional[int] = None, y: Optional[int] = None) -> dict:
        return await self._client._run(self._sb.scroll, dy, x, y)

    async def drag(self, x: int, y: int, to_x: int, to_y: int, button: str = "left") -> dict:
        return await self._client._run(self._sb.drag, x, y, to_x, to_y, button)

    async def key(self, keys: str) -> dict:
        return await self._client._run(self._sb.key, keys)

    async def type_text(self, text: str, interval_ms: int = 0) -> dict:
        return await self._client._run(self._sb.type_text, text, interval_ms)

    async def vnc(self) -> str:
        return await self._client._run(self._sb.vnc)

    async def vnc_endpoint(self) -> tuple[str, str]:
        return await self._client._run(self._sb.vnc_endpoint)

    async def stop_vnc(self) -> None:
        await self._client._run(self._sb.stop_vnc)

    async def spawn(
        self,
        command: Union[str, Sequence[str]],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        pty: bool = False,
        rows: int = 24,
        cols: int = 80,
        tag: str | None = None,
        request_id: str | None = None,
    ) -> "AsyncProcess":
        """:meth:`Sandbox.spawn`, awaited: an :class:`AsyncProcess`. Exactly-once by ``request_id`` (made when not
        given), so a lost answer is retried without starting the command twice."""
        argv, shell = _command(command)
        _check_terminal_size(rows, cols)
        info = await _await(self._core().spawn, self.id, argv, shell, _str_map(env, "env"), cwd or "", _user(user),
                            bool(pty), rows, cols, tag or "", _request_id(request_id))
        return AsyncProcess(self, info.pid, info if info.pid == 0 else None)

    def process(self, pid: int) -> "AsyncProcess":
        """The spawned process ``pid`` of this sandbox; no call is made until it is used."""
        _check_pid(pid)
        return AsyncProcess(self, pid)

    async def processes(self) -> list[ProcessInfo]:
        return await _await(self._core().processes, self.id)

    async def shell(
        self,
        shell: str | None = None,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        name: str | None = None,
    ) -> "AsyncSession":
        """:meth:`Sandbox.shell`, awaited: an :class:`AsyncSession` (``async with`` closes it)."""
        info = await _await(self._core().shell, self.id, name or "", shell or "", _str_map(env, "env"), cwd or "",
                            _user(user))
        return AsyncSession(self, info.name)

    def session(self, name: str) -> "AsyncSession":
        """The session named ``name`` of this sandbox; no call is made until it is used."""
        _check_session_name(name)
        return AsyncSession(self, name)

    async def sessions(self) -> list[SessionInfo]:
        return await _await(self._core().sessions, self.id)

    async def destroy(self) -> None:
        """Destroys the sandbox. Idempotent."""
        if self._destroyed:
            return
        try:
            await _await(self._core().destroy, self.id)
        except NotFound:
            pass
        self._destroyed = True

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.destroy()

    def __repr__(self) -> str:
        return f"<dsec.AsyncSandbox {self.id}{' destroyed' if self._destroyed else ''}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AsyncSandbox) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)


class AsyncSandboxGroup(_Members[AsyncSandbox]):
    """:class:`dsec.SandboxGroup` for asyncio: a list of :class:`AsyncSandbox`; its lease is renewed in the
    background as the sync group's is. Group-wide calls run on the bounded executor, per-member calls on the
    asyncio core."""

    def __init__(self, group: SandboxGroup, client: AsyncClient) -> None:
        self._g = group
        self._client = client
        self._members = [AsyncSandbox(s, client) for s in group]

    @property
    def id(self) -> str:
        return self._g.id

    @property
    def lease(self) -> float:
        return self._g.lease

    @property
    def sync(self) -> SandboxGroup:
        return self._g

    async def exec(self, command: Union[str, Sequence[str]], **kwargs: Any) -> list[ExecResult]:
        """The same command in every member, concurrently on the asyncio core; results in member order. Errors
        raise (unlike the sync group's, which folds them into results)."""
        return list(await asyncio.gather(*(m.exec(command, **kwargs) for m in self._members)))

    async def sleep(self) -> list[SleepResult]:
        return await self._client._run(self._g.sleep)

    async def wake(self) -> list[SleepResult]:
        return await self._client._run(self._g.wake)

    async def snapshot(self, name: str) -> list[Snapshot]:
        return await self._client._run(self._g.snapshot, name)

    async def renew(self) -> None:
        await self._client._run(self._g.renew)

    async def destroy(self) -> None:
        await self._client._run(self._g.destroy)
        self._members = []

    def release(self) -> list[str]:
        self._members = []
        return self._g.release()

    async def __aenter__(self) -> "AsyncSandboxGroup":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.destroy()

    def __repr__(self) -> str:
        return f"AsyncSandboxGroup(id={self.id!r}, size={len(self)}, lease={self.lease})"


class _InAsyncSandbox:
    """What AsyncSession and AsyncProcess share: the :class:`AsyncSandbox` they belong to."""

    __slots__ = ()
    _sandbox: AsyncSandbox

    @property
    def sandbox_id(self) -> str:
        return self._sandbox.id

    @property
    def sandbox(self) -> AsyncSandbox:
        return self._sandbox


class AsyncSession(_InAsyncSandbox):
    """:class:`dsec.Session` for asyncio. ``async with`` closes it."""

    __slots__ = ("_sandbox", "_name")

    def __init__(self, sandbox: AsyncSandbox, name: str) -> None:
        self._sandbox = sandbox
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    async def run(self, command: str, timeout: float = 600, on_output: Callable[[str, bytes], object] | None = None,
                  max_output: Size | None = None) -> ExecResult:
        """:meth:`Session.run`, awaited (exactly once under a request id of its own, as the sync run). Cancelling
        leaves the command running in the shell to its end or timeout; the session stays busy until then."""
        limit = _run_limit(command, max_output)
        return await _await(
            self._sandbox._core().session_run, self._sandbox.id, self._name, command, float(timeout), limit,
            on_output,
            cancelled=(f"run in session {self._name!r} of sandbox {self._sandbox.id} cancelled: the client stopped "
                       f"waiting, the command runs on in the shell to its end or timeout"))

    async def info(self) -> SessionInfo:
        return await _await(self._sandbox._core().session_info, self._sandbox.id, self._name)

    async def restart(self) -> SessionInfo:
        return await _await(self._sandbox._core().restart_session, self._sandbox.id, self._name)

    async def close(self) -> None:
        """Ends the shell and forgets the session. Idempotent."""
        try:
            await _await(self._sandbox._core().close_session, self._sandbox.id, self._name)
        except NotFound:
            pass

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<dsec.AsyncSession {self._name!r} in {self.sandbox_id}>"


class AsyncProcess(_InAsyncSandbox):
    """:class:`dsec.Process` for asyncio; ``stdout``, ``stderr`` and ``output()`` are async iterators."""

    __slots__ = ("_sandbox", "_pid", "_never_started")

    def __init__(self, sandbox: AsyncSandbox, pid: int, never_started: Optional[ProcessInfo] = None) -> None:
        self._sandbox = sandbox
        self._pid = pid
        self._never_started = never_started  # a spawn whose command could not start: it ended at once

    @property
    def pid(self) -> int:
        return self._pid

    def _check_started(self, what: str) -> None:
        if self._never_started is not None:
            info = self._never_started
            raise FailedPrecondition(f"{what}: the command never started ({info.reason})")

    async def info(self) -> ProcessInfo:
        if self._never_started is not None:
            return self._never_started
        return await _await(self._sandbox._core().process_info, self._sandbox.id, self._pid)

    async def wait(self, timeout: Optional[float] = None) -> ProcessInfo:
        """Waits until the process ends, at most ``timeout`` seconds (None: no limit), long-polling the agent in
        slices; returns its info (``running=True`` when the timeout passed first)."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
            raise InvalidArgument(f"timeout: expected seconds or None, got {timeout!r}")
        if self._never_started is not None:
            return self._never_started
        deadline = None if timeout is None else time.monotonic() + max(0.0, float(timeout))
        while True:
            left = _WAIT_SLICE if deadline is None else max(0.0, deadline - time.monotonic())
            slice_ = min(left, _WAIT_SLICE)
            info = await _await(self._sandbox._core().process_wait, self._sandbox.id, self._pid, slice_)
            if not info.running or slice_ <= 0 or (deadline is not None and time.monotonic() >= deadline):
                return info

    async def read(self, stdout_offset: Optional[int] = None, stderr_offset: Optional[int] = None, wait: float = 0,
                   max_bytes: int = 1 << 20) -> ProcessOutput:
        """:meth:`Process.read`, awaited."""
        self._check_started("read")
        return await _await(self._sandbox._core().process_read, self._sandbox.id, self._pid, stdout_offset,
                            stderr_offset, float(wait), int(max_bytes))

    async def _follow(self, stdout: bool, stderr: bool) -> AsyncIterator[Tuple[str, bytes]]:
        if self._never_started is not None:
            if stderr and self._never_started.reason:
                yield "stderr", self._never_started.reason.encode()
            return
        at = _follow_start(stdout, stderr)
        while True:
            chunks, done = _follow_step(await self.read(at["stdout"], at["stderr"], _READ_WAIT), at)
            for chunk in chunks:
                yield chunk
            if done:
                return

    @property
    def stdout(self) -> AsyncIterator[bytes]:
        """``async for chunk in process.stdout``: its stdout from the first byte kept until it ended."""
        return _data_of(self._follow(stdout=True, stderr=False))

    @property
    def stderr(self) -> AsyncIterator[bytes]:
        return _data_of(self._follow(stdout=False, stderr=True))

    def output(self) -> AsyncIterator[Tuple[str, bytes]]:
        """``async for stream, data in process.output()``: both streams until it ended."""
        return self._follow(stdout=True, stderr=True)

    async def write_stdin(self, data: BytesLike) -> None:
        self._check_started("stdin")
        await _await(self._sandbox._core().write_stdin, self._sandbox.id, self._pid, _bytes(data, "data"))

    async def close_stdin(self) -> None:
        self._check_started("stdin")
        await _await(self._sandbox._core().close_stdin, self._sandbox.id, self._pid)

    async def signal(self, sig: Union[int, str], group: bool = False) -> ProcessInfo:
        number = _signal_number(sig)
        if number < 0:
            raise InvalidArgument(f"signal: {number} is not a signal number")
        self._check_started("signal")
        return await _await(self._sandbox._core().signal, self._sandbox.id, self._pid, number, bool(group))

    async def resize(self, rows: int, cols: int) -> ProcessInfo:
        _check_terminal_size(rows, cols)
        self._check_started("resize")
        return await _await(self._sandbox._core().resize, self._sandbox.id, self._pid, rows, cols)

    async def kill(self) -> ProcessInfo:
        if self._never_started is not None:
            return self._never_started
        return await _await(self._sandbox._core().kill, self._sandbox.id, self._pid)

    def __repr__(self) -> str:
        return f"<dsec.AsyncProcess {self._pid} in {self.sandbox_id}>"


async def _data_of(pairs: AsyncIterator[Tuple[str, bytes]]) -> AsyncIterator[bytes]:
    async for _, data in pairs:
        yield data
