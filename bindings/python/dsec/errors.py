"""dsec's exceptions: one class per error code of dsec's error model.

Every error an agent or the client reports is a :class:`DsecError` with ``.code`` (the code's name, e.g.
``"NOT_FOUND"``) and ``.retryable`` (whether the same call may succeed if simply tried again). The classes also
derive from the built-in exception a Python user would expect: ``NotFound`` is a ``KeyError``,
``InvalidArgument`` a ``ValueError``, ``DeadlineExceeded`` a ``TimeoutError``, ``PermissionDenied`` a
``PermissionError``, ``Unavailable`` a ``ConnectionError``.

A command that runs past its timeout is not an exception: ``exec`` returns a result with ``timed_out=True``.
"""

from __future__ import annotations

__all__ = [
    "DsecError",
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
    "Unauthenticated",
    "error_class",
]


class DsecError(Exception):
    """Base of every dsec error. ``code`` is the error code's name, ``retryable`` whether retrying may help."""

    code: str = "UNKNOWN"
    retryable: bool = False

    def __init__(self, message: str = "", *, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.message = message
        if retryable is not None:
            self.retryable = retryable

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, retryable={self.retryable})"


class Cancelled(DsecError):
    code = "CANCELLED"


class Unknown(DsecError):
    code = "UNKNOWN"


class InvalidArgument(DsecError, ValueError):
    """A bad spec, path, size or request: fix the call, retrying will not help."""

    code = "INVALID_ARGUMENT"


class DeadlineExceeded(DsecError, TimeoutError):
    """The call's deadline passed (through all its retries)."""

    code = "DEADLINE_EXCEEDED"


class NotFound(DsecError, KeyError):
    """No such sandbox, file or image."""

    code = "NOT_FOUND"

    # KeyError quotes its argument in str(); keep dsec's message readable.
    __str__ = DsecError.__str__


class AlreadyExists(DsecError):
    code = "ALREADY_EXISTS"


class PermissionDenied(DsecError, PermissionError):
    code = "PERMISSION_DENIED"


class ResourceExhausted(DsecError):
    """The node is full (cpu, memory, disk, pids) or a limit was hit; may succeed later."""

    code = "RESOURCE_EXHAUSTED"
    retryable = True


class FailedPrecondition(DsecError):
    """The system is not in a state that allows the call (a closed client, a destroyed sandbox, ...)."""

    code = "FAILED_PRECONDITION"


class Aborted(DsecError):
    code = "ABORTED"
    retryable = True


class OutOfRange(DsecError):
    code = "OUT_OF_RANGE"


class Unimplemented(DsecError, NotImplementedError):
    """The backend does not support this operation."""

    code = "UNIMPLEMENTED"


class Internal(DsecError):
    code = "INTERNAL"


class Unavailable(DsecError, ConnectionError):
    """The node agent could not be reached or is shutting down."""

    code = "UNAVAILABLE"
    retryable = True


class NodeLost(Unavailable):
    """The sandbox's node is gone (it left the cluster or stopped answering): raised at once, not retried."""

    code = "UNAVAILABLE"
    retryable = False


class DataLoss(DsecError):
    code = "DATA_LOSS"


class Unauthenticated(DsecError):
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


def _make(code: str, message: str, retryable: bool, node_lost: bool = False) -> DsecError:
    """Called by the C++ binding to build the exception it raises."""
    if node_lost:
        return NodeLost(message, retryable=retryable)
    return error_class(code)(message, retryable=retryable)
