"""dsec: isolated, stateful sandboxes on demand, driven from a training loop.

    import dsec

    with dsec.Client() as client:                      # starts a private node agent for this process
        with client.create(image="busybox") as sb:     # destroyed when the block ends
            r = sb.exec("echo hi")
            assert r.exit_code == 0 and r.stdout == b"hi\\n"
            sb.write_file("/tmp/a.txt", b"x")
            assert sb.read_file("/tmp/a.txt") == b"x"

``dsec.Client()`` without endpoints starts a private ``dsecd`` on a unix socket and stops it (destroying its
sandboxes) on ``close()``; ``dsec.Client(endpoints=["unix:/run/dsec/dsecd.sock", "http://10.0.0.7:7070"])`` talks
to running agents instead. One client serves every thread: blocking calls release the GIL.

A :class:`Sandbox` is *not* destroyed when Python garbage-collects it: use ``destroy()`` or a ``with`` block. A
sandbox nobody destroys lives until its ``ttl`` (seconds, default one hour) runs out.

Short stateless runs of code go to the nodes' warm pools instead of a sandbox of their own::

        r = client.run_code("print(sum(map(int, input().split())))", stdin=b"1 2 3", timeout=2)
        assert r.ok and r.stdout_text == "6\n"
        results = client.run_code_many([{"code": src, "stdin": t} for t in tests])  # in order, spread over nodes

Commands that outlive a call, and shells whose state carries from one command to the next::

        p = sb.spawn("python3 -m http.server 8000")      # a dsec.Process: answers at once
        for chunk in p.stdout: ...                       # its output from the start, live until it ends
        with sb.shell() as sh:                           # a dsec.Session
            sh.run("cd /repo && export X=1")
            assert sh.run("pwd; echo $X").stdout == b"/repo\n1\n"

The package's modules: :mod:`dsec.client` (:class:`Client`), :mod:`dsec.sandbox` (:class:`Sandbox`,
:class:`Snapshot`), :mod:`dsec.process` (:class:`Process`), :mod:`dsec.session` (:class:`Session`),
:mod:`dsec.group` (:class:`SandboxGroup`), :mod:`dsec.fncall` (:func:`fncall_request`) and :mod:`dsec.errors`;
everything public is importable from ``dsec`` itself.

asyncio programs use :class:`AsyncClient` (:mod:`dsec.aio`): the same calls with ``await``, driven by one native
I/O thread per client however many are in flight::

        async with dsec.AsyncClient() as client:
            sb = await client.create(image="busybox")
            results = await asyncio.gather(*(sb.exec(f"echo {i}") for i in range(1000)))

Errors are exceptions from :mod:`dsec.errors` (``dsec.NotFound``, ``dsec.Unavailable``, ...), each with ``.code``
and ``.retryable``. A command that runs past its timeout is a result (``timed_out=True``), not an exception.
"""

from __future__ import annotations

from . import _dsec, errors
from ._spec import parse_size
from ._types import (
    CachedLayer,
    ExecResult,
    FnCallRequest,
    FnCallResult,
    ImageInfo,
    ImageLayerInfo,
    NodeInfo,
    ProcessInfo,
    ProcessOutput,
    Resources,
    SandboxInfo,
    SessionInfo,
    SleepResult,
    SnapshotResult,
)
from .aio import AsyncClient, AsyncProcess, AsyncSandbox, AsyncSandboxGroup, AsyncSession
from .client import Client, agent_binary
from .errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    DsecError,
    FailedPrecondition,
    InfraError,
    Internal,
    InvalidArgument,
    NodeLost,
    NotFound,
    OutcomeUnknown,
    OutOfRange,
    PermissionDenied,
    RequestError,
    ResourceExhausted,
    SandboxLost,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
    error_class,
)
from .fncall import fncall_request
from .group import SandboxGroup
from .process import Process
from .sandbox import Sandbox, Snapshot
from .session import Session

__version__: str = _dsec.__version__
PROTOCOL_VERSION: str = _dsec.PROTOCOL_VERSION

__all__ = [
    "Client",
    "AsyncClient",
    "AsyncSandbox",
    "AsyncSandboxGroup",
    "AsyncSession",
    "AsyncProcess",
    "Sandbox",
    "ExecResult",
    "Process",
    "ProcessInfo",
    "ProcessOutput",
    "Session",
    "SessionInfo",
    "FnCallRequest",
    "FnCallResult",
    "fncall_request",
    "SandboxInfo",
    "SleepResult",
    "Snapshot",
    "SnapshotResult",
    "NodeInfo",
    "CachedLayer",
    "ImageInfo",
    "ImageLayerInfo",
    "SandboxGroup",
    "Resources",
    "parse_size",
    "agent_binary",
    *errors.__all__,
]
