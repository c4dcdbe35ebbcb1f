"""Processes that outlive the call that started them (:meth:`Sandbox.spawn`): a server, a REPL, a long build.

    p = sb.spawn("python3 -m http.server 8000", tag="web")
    for chunk in p.stdout:             # bytes as the process writes them, from its first byte, until it ends
        ...
    p = sb.spawn(["cat"])
    p.write_stdin(b"hello\\n")
    p.close_stdin()
    info = p.wait(timeout=10)          # a ProcessInfo: running, exit_code, signal, reason
"""

from __future__ import annotations

import signal as _signal
import time
from typing import TYPE_CHECKING, Iterator, Optional, Tuple, Union

from . import _dsec
from .errors import InvalidArgument
from ._types import BytesLike, ProcessInfo, ProcessOutput

if TYPE_CHECKING:  # annotations only: the sandbox module imports this one
    from .sandbox import Sandbox

# How long each read of an output iterator waits for more output, in seconds.
_READ_WAIT = 30.0
# Process.wait long-polls in slices of at most this many seconds (Ctrl-C is seen between them).
_WAIT_SLICE = 60.0


def _signal_number(sig: Union[int, str]) -> int:
    """A signal as its number: an int, or a name such as ``"SIGTERM"`` or ``"term"``."""
    if isinstance(sig, bool):
        raise InvalidArgument(f"signal: expected a signal number or name, got {sig!r}")
    if isinstance(sig, int):
        return int(sig)
    if isinstance(sig, str):
        name = sig.strip().upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        try:
            return int(_signal.Signals[name])
        except KeyError:
            raise InvalidArgument(f"signal: {sig!r} is not a signal name") from None
    raise InvalidArgument(f"signal: expected a signal number or name, got {type(sig).__name__}")


def _check_pid(pid: int) -> None:
    """A spawned process's pid as Sandbox.process and AsyncSandbox.process take it."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise InvalidArgument(f"pid: expected a positive int, got {pid!r}")


def _check_terminal_size(rows: int, cols: int) -> None:
    """A pty's size as spawn and resize take it: 1 to 1000 rows and columns."""
    for field, value in (("rows", rows), ("cols", cols)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
            raise InvalidArgument(f"{field}: expected an int from 1 to 1000, got {value!r}")


def _follow_start(stdout: bool, stderr: bool) -> dict[str, Optional[int]]:
    """Where an output iterator reads from first: byte 0 of each stream it follows, None for one it does not."""
    return {"stdout": 0 if stdout else None, "stderr": 0 if stderr else None}


def _follow_step(out: ProcessOutput, at: dict[str, Optional[int]]) -> Tuple[list[Tuple[str, bytes]], bool]:
    """One read of an output iterator (Process's and AsyncProcess's): the ``(stream, data)`` chunks it brought, and
    whether the process has ended with everything read. Moves ``at`` past what the read covered."""
    chunks: list[Tuple[str, bytes]] = []
    done = not out.running
    for name, data, start, end in (("stdout", out.stdout, out.stdout_offset, out.stdout_end),
                                   ("stderr", out.stderr, out.stderr_offset, out.stderr_end)):
        offset = at[name]
        if offset is None:
            continue
        if data:
            chunks.append((name, data))
        # Bytes no longer kept are skipped: the next read starts where this answer's ended.
        at[name] = offset = max(offset, start + len(data))
        if offset < end:
            done = False
    return chunks, done


class Process:
    """A process started by :meth:`Sandbox.spawn`, or found again with :meth:`Sandbox.process` (from any client).

    The sandbox's init keeps the process's output (the last 1 MiB of each stream), so it can be read from its
    start, by any number of readers, while it runs and after it ended, until :meth:`kill` forgets it. A handle
    owns nothing: dropping it leaves the process running. Safe to use from several threads at once.

    Reads (:meth:`info`, :meth:`wait`, the output iterators, :meth:`resize`, :meth:`kill`) are retried on transient
    errors; :meth:`write_stdin`, :meth:`close_stdin` and :meth:`signal` are not once they may have reached the
    agent, so they never act twice.
    """

    __slots__ = ("_p", "_sandbox")

    def __init__(self, handle: _dsec.Process, sandbox: "Sandbox") -> None:
        self._p = handle
        self._sandbox = sandbox

    @property
    def pid(self) -> int:
        """Its pid inside the sandbox."""
        return self._p.pid

    @property
    def sandbox_id(self) -> str:
        return self._p.sandbox_id

    @property
    def sandbox(self) -> "Sandbox":
        return self._sandbox

    def info(self) -> ProcessInfo:
        """Its state now: ``running``, ``exit_code``, ``signal``, ``reason``, bytes written, ``stdin_open``."""
        return self._p.info()

    @property
    def exit_code(self) -> Optional[int]:
        """Its exit status once it ended (-1 when a signal ended it), None while it runs. Asks the agent."""
        info = self._p.info()
        return None if info.running else info.exit_code

    def wait(self, timeout: Optional[float] = None) -> ProcessInfo:
        """Waits until the process ends, at most ``timeout`` seconds (None: no limit), and returns its info.

        Not an exception when the timeout passes first: the returned info then has ``running=True``.
        """
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
            raise InvalidArgument(f"timeout: expected seconds or None, got {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + max(0.0, float(timeout))
        while True:
            left = _WAIT_SLICE if deadline is None else max(0.0, deadline - time.monotonic())
            info = self._p.wait(min(left, _WAIT_SLICE))
            if not info.running or (deadline is not None and time.monotonic() >= deadline):
                return info

    @property
    def stdout(self) -> Iterator[bytes]:
        """A new iterator of its stdout: chunks of bytes from its first byte still kept, then live as it writes,
        ending when the process has ended and everything was read. Each access starts again from the start."""
        return (data for _, data in self._follow(stdout=True, stderr=False))

    @property
    def stderr(self) -> Iterator[bytes]:
        """Like :attr:`stdout`, for stderr. A pty process writes everything to stdout."""
        return (data for _, data in self._follow(stdout=False, stderr=True))

    def output(self) -> Iterator[Tuple[str, bytes]]:
        """Both streams as ``(stream, bytes)`` pairs (``"stdout"`` or ``"stderr"``), from the start until the
        process has ended and everything was read. The order between the two streams is per read, not per write."""
        return self._follow(stdout=True, stderr=True)

    def read(self, stdout_offset: Optional[int] = None, stderr_offset: Optional[int] = None, wait: float = 0,
             max_bytes: int = 1 << 20) -> ProcessOutput:
        """One read of its output from byte offsets of each stream (None: that stream is not read), at most
        ``max_bytes`` (at most 1 MiB) of each. Answers as soon as there is output past an offset, or the process
        has ended, or ``wait`` seconds (at most 300) passed. Reading does not consume: the next read asks from
        ``stdout_offset + len(stdout)``; an answer's ``stdout_offset`` past the one asked for means the bytes
        between were no longer kept."""
        return self._p.read(stdout_offset, stderr_offset, float(wait), max_bytes)

    def _follow(self, stdout: bool, stderr: bool) -> Iterator[Tuple[str, bytes]]:
        at = _follow_start(stdout, stderr)
        while True:
            chunks, done = _follow_step(self._p.read(at["stdout"], at["stderr"], _READ_WAIT), at)
            yield from chunks
            if done:
                return

    def write_stdin(self, data: BytesLike) -> None:
        """Writes bytes (a str as UTF-8) to its stdin, in order with earlier writes. Raises
        :class:`FailedPrecondition` once it ended or its stdin was closed, :class:`ResourceExhausted` while 1 MiB
        of earlier writes still waits to be read by it."""
        self._p.write_stdin(data)

    def close_stdin(self) -> None:
        """Closes its stdin: it reads end of file after what was written."""
        self._p.close_stdin()

    def signal(self, sig: Union[int, str], group: bool = False) -> ProcessInfo:
        """Sends a signal (a number, or a name: ``"SIGTERM"``, ``"TERM"``) to the process, or with ``group`` to
        its whole process group. Raises :class:`FailedPrecondition` once it ended."""
        return self._p.signal(_signal_number(sig), bool(group))

    def resize(self, rows: int, cols: int) -> ProcessInfo:
        """A pty process's terminal size (it gets SIGWINCH); :class:`FailedPrecondition` without a pty."""
        return self._p.resize(rows, cols)

    def kill(self) -> ProcessInfo:
        """Kills the process's group if it still runs (SIGKILL) and forgets it with its output; returns its last
        info. Later calls on it raise :class:`NotFound`."""
        return self._p.kill()

    def __repr__(self) -> str:
        return f"<dsec.Process {self.pid} in {self.sandbox_id}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Process) and (other.sandbox_id, other.pid) == (self.sandbox_id, self.pid)

    def __hash__(self) -> int:
        return hash((self.sandbox_id, self.pid))
