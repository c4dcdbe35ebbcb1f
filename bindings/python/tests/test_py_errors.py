"""The exception classes: one per code, the built-in bases users catch, and what the binding raises."""

import pytest

import dsec
from dsec import errors

CODES = {
    "CANCELLED": dsec.Cancelled,
    "UNKNOWN": dsec.Unknown,
    "INVALID_ARGUMENT": dsec.InvalidArgument,
    "DEADLINE_EXCEEDED": dsec.DeadlineExceeded,
    "NOT_FOUND": dsec.NotFound,
    "ALREADY_EXISTS": dsec.AlreadyExists,
    "PERMISSION_DENIED": dsec.PermissionDenied,
    "RESOURCE_EXHAUSTED": dsec.ResourceExhausted,
    "FAILED_PRECONDITION": dsec.FailedPrecondition,
    "ABORTED": dsec.Aborted,
    "OUT_OF_RANGE": dsec.OutOfRange,
    "UNIMPLEMENTED": dsec.Unimplemented,
    "INTERNAL": dsec.Internal,
    "UNAVAILABLE": dsec.Unavailable,
    "DATA_LOSS": dsec.DataLoss,
    "UNAUTHENTICATED": dsec.Unauthenticated,
}


@pytest.mark.parametrize("code,cls", sorted(CODES.items()))
def test_one_class_per_code(code, cls):
    assert issubclass(cls, dsec.DsecError)
    assert dsec.error_class(code) is cls
    e = errors._make(code, "what happened", True)
    assert type(e) is cls and e.code == code and e.retryable is True
    assert str(e) == f"{code}: what happened"


def test_builtin_bases():
    assert issubclass(dsec.NotFound, KeyError)
    assert issubclass(dsec.InvalidArgument, ValueError)
    assert issubclass(dsec.DeadlineExceeded, TimeoutError)
    assert issubclass(dsec.PermissionDenied, PermissionError)
    assert issubclass(dsec.Unavailable, ConnectionError)
    assert issubclass(dsec.Unimplemented, NotImplementedError)


def test_default_retryable_follows_the_code():
    assert dsec.Unavailable("x").retryable
    assert dsec.ResourceExhausted("x").retryable
    assert not dsec.NotFound("x").retryable
    assert not dsec.Unavailable("x", retryable=False).retryable


def test_unknown_code_maps_to_unknown():
    assert dsec.error_class("NO_SUCH_CODE") is dsec.Unknown


def test_binding_raises_the_python_classes():
    with pytest.raises(dsec.InvalidArgument) as info:
        dsec.parse_size("12 parsecs")
    assert info.value.code == "INVALID_ARGUMENT" and not info.value.retryable
    assert "12 parsecs" in str(info.value)
    with pytest.raises(ValueError):
        dsec.Client(endpoints=["tcp://nowhere:1"])


def test_parse_size():
    assert dsec.parse_size("512Mi") == 512 << 20
    assert dsec.parse_size("2G") == 2_000_000_000
    assert dsec.parse_size(4096) == 4096
    for bad in ("", "-1", "1X", True, 1.5, None):
        with pytest.raises(dsec.InvalidArgument):
            dsec.parse_size(bad)


# Whose failure each code is (docs/errors.md); the C++ side's fault_of is the same table.
INFRA_CODES = {"UNKNOWN", "DEADLINE_EXCEEDED", "ABORTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}


@pytest.mark.parametrize("code,cls", sorted(CODES.items()))
def test_every_error_is_the_infrastructures_or_the_requests(code, cls):
    infra = code in INFRA_CODES
    assert issubclass(cls, dsec.InfraError) is infra and issubclass(cls, dsec.RequestError) is not infra
    e = errors._make(code, "x", False)
    assert e.infra is infra
    # What an agent says of one error overrides the code's usual fault only towards the infrastructure.
    lost = errors._make(code, "x", False, infra=True)
    assert lost.infra and isinstance(lost, dsec.InfraError) and not isinstance(lost, dsec.RequestError)
    assert lost.code == code


def test_a_lost_sandbox_is_an_infra_error_with_its_wire_code():
    e = errors._make("FAILED_PRECONDITION", "sandbox s is not running: its init process has exited", False, infra=True)
    assert type(e) is dsec.SandboxLost and e.code == "FAILED_PRECONDITION"
    assert str(e) == "FAILED_PRECONDITION: sandbox s is not running: its init process has exited"
    try:
        raise e
    except dsec.InfraError as caught:  # what a trainer writes to mask the rollout
        assert caught is e
    assert isinstance(errors._make("UNAVAILABLE", "gone", False, node_lost=True), dsec.InfraError)
