"""dsec's exceptions: one class per error code of dsec's error model.

Every error an agent or the client reports is a :class:`DsecError` with ``.code`` (the code's name, e.g.
``"NOT_FOUND"``), ``.retryable`` (whether the same call may succeed if simply tried again) and ``.infra``: whose
failure it is. Every error is either an :class:`InfraError` (the infrastructure failed: a node lost, an agent
unavailable, a sandbox that vanished, dsec's own fault; mask the rollout's loss or run it again) or a
:class:`RequestError` (the call was wrong, named something that does not exist, or was not allowed: fix the call).
What the task's command did is never an exception: ``exec`` returns it (exit code, signal, ``timed_out``,
``reason``). docs/errors.md lists every code. The classes also
derive from the built-in exception a Python user would expect: ``NotFound`` is a ``KeyError``,
``InvalidArgument`` a ``ValueError``, ``DeadlineExceeded`` a ``TimeoutError``, ``PermissionDenied`` a
``PermissionError``, ``Unavailable`` a ``ConnectionError``.

A command that runs past its timeout is not an exception: ``exec`` returns a result with ``timed_out=True``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DsecError",
    "InfraError",
    "RequestError",
    "SandboxLost",
    "Cancelled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "NodeLost",
    "DataLoss",
    "OutcomeUnknown",
    "Unauthenticated",
    "error_class",
]


class DsecError(Exception):
    """Base of every dsec error. ``code`` is the error code's name, ``retryable`` whether retrying may help."""

    code: str = "UNKNOWN"
    retryable: bool = False
    infra: bool = False

    def __init__(self, message: str = "", *, retryable: bool | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if retryable is not None:
            self.retryable = retryable
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, retryable={self.retryable})"


class InfraError(DsecError):
    """The infrastructure failed, not the request and not the task: a node lost, an agent unavailable, a sandbox
    that vanished, a deadline the call could not meet, dsec's own fault. A trainer masks the rollout's loss (or runs
    it again elsewhere) with one ``except dsec.InfraError``."""

    infra = True


class RequestError(DsecError):
    """The request was wrong: a bad argument, a name that does not exist, a call not allowed, a quota or a state
    that does not permit it. Retrying the same call does not help (``retryable`` says when waiting might)."""

    infra = False


class SandboxLost(InfraError):
    """The sandbox is gone for reasons that are not the caller's: its init died (the host's OOM killer, a crash)
    or its VM stopped. ``code`` is the wire's (``FAILED_PRECONDITION``); the sandbox's info says why."""

    code = "FAILED_PRECONDITION"


class Cancelled(RequestError):
    code = "CANCELLED"


class Unknown(InfraError):
    code = "UNKNOWN"


class InvalidArgument(RequestError, ValueError):
    """A bad spec, path, size or request: fix the call, retrying will not help."""

    code = "INVALID_ARGUMENT"


class DeadlineExceeded(InfraError, TimeoutError):
    """The call's deadline passed (through all its retries)."""

    code = "DEADLINE_EXCEEDED"


class NotFound(RequestError, KeyError):
    """No such sandbox, file or image."""

    code = "NOT_FOUND"

    # KeyError quotes its argument in str(); keep dsec's message readable.
    __str__ = DsecError.__str__


class AlreadyExists(RequestError):
    code = "ALREADY_EXISTS"


class PermissionDenied(RequestError, PermissionError):
    code = "PERMISSION_DENIED"


class ResourceExhausted(RequestError):
    """The node is full (cpu, memory, disk, pids) or a limit was hit; may succeed later."""

    code = "RESOURCE_EXHAUSTED"
    retryable = True


class FailedPrecondition(RequestError):
    """The system is not in a state that allows the call (a closed client, a destroyed sandbox, ...)."""

    code = "FAILED_PRECONDITION"


class Aborted(InfraError):
    code = "ABORTED"
    retryable = True


class OutOfRange(RequestError):
    code = "OUT_OF_RANGE"


class Unimplemented(RequestError, NotImplementedError):
    """The backend does not support this operation."""

    code = "UNIMPLEMENTED"


class Internal(InfraError):
    code = "INTERNAL"


class Unavailable(InfraError, ConnectionError):
    """The node agent could not be reached or is shutting down."""

    code = "UNAVAILABLE"
    retryable = True


class NodeLost(Unavailable):
    """The sandbox's node is gone (it left the cluster or stopped answering): raised at once, not retried."""

    code = "UNAVAILABLE"
    retryable = False


class DataLoss(InfraError):
    code = "DATA_LOSS"


class OutcomeUnknown(DataLoss):
    """An exec or a session run whose outcome cannot be known: its answer was lost and no retry could learn what
    became of its command (the node's agent restarted while it ran, or the node stopped answering). The command is
    never run a second time for it. ``request_id`` names the call. A trainer masks the rollout."""

    code = "DATA_LOSS"

    def __init__(self, message: str = "", *, retryable: bool = False, request_id: str = "", **kwargs: Any) -> None:
        super().__init__(message, retryable=retryable, **kwargs)
        self.request_id = request_id


class Unauthenticated(RequestError):
    code = "UNAUTHENTICATED"


_BY_CODE: dict[str, type[DsecError]] = {
    cls.code: cls
    for cls in (
        Cancelled,
        Unknown,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    )
}


def error_class(code: str) -> type[DsecError]:
    """The exception class for an error code name such as ``"NOT_FOUND"`` (``Unknown`` for names it does not know)."""
    return _BY_CODE.get(code, Unknown)


def _make(code: str, message: str, retryable: bool, node_lost: bool = False, infra: bool | None = None,
          outcome_unknown: str | None = None) -> DsecError:
    """Called by the C++ binding to build the exception it raises; ``infra`` is the error's fault where it differs
    from its code's usual one (an agent says a FAILED_PRECONDITION is the infrastructure's: the sandbox is lost);
    ``outcome_unknown`` is the request id of an exec whose outcome is unknown."""
    if outcome_unknown is not None:
        return OutcomeUnknown(message, retryable=retryable, request_id=outcome_unknown)
    if node_lost:
        return NodeLost(message, retryable=retryable)
    cls = error_class(code)
    if infra and not cls.infra:
        return SandboxLost(message, retryable=retryable, code=code)
    return cls(message, retryable=retryable)
