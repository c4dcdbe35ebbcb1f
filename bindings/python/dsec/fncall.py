"""Function calls: one request for :meth:`Client.run_code_many`, checked and built."""

from __future__ import annotations

from typing import Mapping, Sequence

from .errors import InvalidArgument
from ._spec import _field_size, _str_map
from ._types import BytesLike, FnCallRequest, Size


_LANGUAGES = ("python", "shell", "c", "cpp")


def fncall_request(
    code: str,
    language: str = "python",
    *,
    stdin: BytesLike | None = None,
    files: Mapping[str, BytesLike] | None = None,
    args: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 10,
    cpu_time: float | None = None,
    memory: Size = "256Mi",
    pids: int = 64,
    max_output_bytes: Size = 1 << 20,
    image: str | None = None,
    gpus: int = 0,
    gpu_mode: str | None = None,
    request_id: str | None = None,
) -> FnCallRequest:
    """One function call for :meth:`Client.run_code_many` (the arguments are :meth:`Client.run_code`'s)."""
    if not isinstance(code, str):
        raise InvalidArgument(f"code: expected the program's source as a str, got {type(code).__name__}")
    if language not in _LANGUAGES:
        raise InvalidArgument(f"language: {language!r} is not a language of function calls ({', '.join(_LANGUAGES)})")
    r = FnCallRequest()
    r.language = language
    r.code = code
    if stdin is not None:
        if not isinstance(stdin, (bytes, bytearray, memoryview, str)):
            raise InvalidArgument(f"stdin: expected bytes or str, got {type(stdin).__name__}")
        r.stdin = stdin  # type: ignore[assignment]  # the setter takes str too (mypy 1.0 reads the getter)
    if files is not None:
        if not isinstance(files, Mapping):
            raise InvalidArgument(
                f"files: expected a dict of relative path to bytes or str, got {type(files).__name__}")
        r.files = dict(files)  # type: ignore[arg-type]  # the setter takes str values too (mypy 1.0 reads the getter)
    if args is not None:
        if isinstance(args, (str, bytes)) or not all(isinstance(a, str) for a in args):
            raise InvalidArgument("args: expected a list of str")
        r.args = list(args)
    r.env = _str_map(env, "env")
    for name, value in (("timeout", timeout), ("cpu_time", cpu_time or 0)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidArgument(f"{name}: expected a number of seconds, got {value!r}")
    r.timeout = float(timeout)
    r.cpu_time = float(cpu_time or 0)
    r.memory = _field_size(memory, "memory")
    if isinstance(pids, bool) or not isinstance(pids, int) or pids < 1:
        raise InvalidArgument(f"pids: must be a positive int, got {pids!r}")
    r.pids = pids
    r.max_output_bytes = _field_size(max_output_bytes, "max_output_bytes")
    r.image = image or ""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise InvalidArgument(f"gpus: must be a non-negative int, got {gpus!r}")
    r.gpus = gpus
    r.gpu_mode = gpu_mode if gpu_mode is not None else ("exclusive" if gpus else "none")
    r.request_id = request_id or ""
    return r
