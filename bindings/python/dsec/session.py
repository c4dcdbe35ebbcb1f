"""Persistent shell sessions (:meth:`Sandbox.shell`): every run executes in the same shell process, so ``cd``,
``export``, functions, aliases, sourced files and shell options carry over from run to run.

    with sb.shell() as sh:
        sh.run("cd /repo && export PYTHONPATH=src")
        r = sh.run("pwd; python -m pytest -q", timeout=300)   # an ExecResult, as exec gives it
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from . import _dsec
from .errors import InvalidArgument
from ._spec import _field_size
from ._types import ExecResult, SessionInfo, Size

if TYPE_CHECKING:  # annotations only: the sandbox module imports this one
    from .sandbox import Sandbox


def _run_limit(command: str, max_output: Size | None) -> int:
    """Session.run's and AsyncSession.run's arguments checked: the output cap in bytes (16 MiB when None)."""
    if not isinstance(command, str):
        raise InvalidArgument(f"command: expected shell text (a str), got {type(command).__name__}")
    return 16 << 20 if max_output is None else _field_size(max_output, "max_output")


def _check_session_name(name: str) -> None:
    """A session's name as Sandbox.session and AsyncSandbox.session take it."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"name: expected a session's name, got {name!r}")


class Session:
    """A shell session of a sandbox, started by :meth:`Sandbox.shell` or found again by :meth:`Sandbox.session`.

    A handle owns nothing: dropping it leaves the shell running; :meth:`close` (or the end of a ``with`` block)
    ends it. One run at a time per session: a run while another runs raises :class:`FailedPrecondition`.
    """

    __slots__ = ("_s", "_sandbox")

    def __init__(self, handle: _dsec.Session, sandbox: "Sandbox") -> None:
        self._s = handle
        self._sandbox = sandbox

    @property
    def name(self) -> str:
        return self._s.name

    @property
    def sandbox_id(self) -> str:
        return self._s.sandbox_id

    @property
    def sandbox(self) -> "Sandbox":
        return self._sandbox

    def run(
        self,
        command: str,
        timeout: float = 600,
        on_output: Callable[[str, bytes], object] | None = None,
        max_output: Size | None = None,
    ) -> ExecResult:
        """Runs shell text (several lines too) in the session's shell and returns an :class:`ExecResult`, as
        :meth:`Sandbox.exec` does: ``exit_code`` is the command's ``$?``, ``stdout``/``stderr`` (bytes) what was
        written during the run, at most ``max_output`` each (default 16 MiB). The command's stdin is /dev/null.

        After ``timeout`` seconds the processes the run started are killed and the result has ``timed_out=True``;
        the session stays usable. A command that ends the shell (``exit 3``) returns ``reason ==
        "session_ended"`` with the shell's status; :meth:`restart` starts a new shell. ``on_output`` streams the
        output as :meth:`Sandbox.exec` does. Never retried once it may have reached the agent.
        """
        limit = _run_limit(command, max_output)
        return self._s.run(command, float(timeout), limit, on_output)

    def info(self) -> SessionInfo:
        """Its state now: the shell's pid, ``alive``, ``busy``, how many runs."""
        return self._s.info()

    def restart(self) -> SessionInfo:
        """Kills the shell (and its process group) if it still runs and starts a new one with the session's
        original shell, env, cwd and user; what earlier runs set is gone."""
        return self._s.restart()

    def close(self) -> None:
        """Ends the shell and everything in its process group, and forgets the session. Idempotent."""
        self._s.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<dsec.Session {self.name!r} in {self.sandbox_id}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Session) and (other.sandbox_id, other.name) == (self.sandbox_id, self.name)

    def __hash__(self) -> int:
        return hash((self.sandbox_id, self.name))
