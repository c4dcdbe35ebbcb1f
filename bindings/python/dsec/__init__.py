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

Errors are exceptions from :mod:`dsec.errors` (``dsec.NotFound``, ``dsec.Unavailable``, ...), each with ``.code``
and ``.retryable``. A command that runs past its timeout is a result (``timed_out=True``), not an exception.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import posixpath
import tarfile
import threading
import weakref
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

from . import _dsec, errors
from .errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    DsecError,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NodeLost,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
    error_class,
)

ExecResult = _dsec.ExecResult
FnCallRequest = _dsec.FnCallRequest
FnCallResult = _dsec.FnCallResult
SandboxInfo = _dsec.SandboxInfo
SleepResult = _dsec.SleepResult
SnapshotResult = _dsec.SnapshotResult
NodeInfo = _dsec.NodeInfo
CachedLayer = _dsec.CachedLayer
Resources = _dsec.Resources

__version__: str = _dsec.__version__
PROTOCOL_VERSION: str = _dsec.PROTOCOL_VERSION

__all__ = [
    "Client",
    "Sandbox",
    "ExecResult",
    "FnCallRequest",
    "FnCallResult",
    "fncall_request",
    "SandboxInfo",
    "SleepResult",
    "Snapshot",
    "SnapshotResult",
    "NodeInfo",
    "CachedLayer",
    "SandboxGroup",
    "Resources",
    "parse_size",
    "agent_binary",
    *errors.__all__,
]

Size = Union[int, str]
BytesLike = Union[bytes, bytearray, memoryview, str]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def agent_binary() -> str:
    """The ``dsecd`` shipped inside this package (``dsec/bin/dsecd``); it may not exist in a source checkout."""
    return os.path.join(_PACKAGE_DIR, "bin", "dsecd")


def parse_size(size: Size) -> int:
    """Bytes in ``size``: an int, or a string such as ``"512Mi"``, ``"2G"``, ``"1.5GiB"`` or ``"4096"``.

    SI suffixes (k, M, G, T) are powers of 1000, binary ones (Ki, Mi, Gi, Ti) powers of 1024.
    Raises :class:`InvalidArgument` for anything else.
    """
    if isinstance(size, bool):
        raise InvalidArgument(f"size: expected an int or a string such as '512Mi', got {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise InvalidArgument(f"size: {size} is negative")
        return size
    if isinstance(size, str):
        return _dsec.parse_size(size)
    raise InvalidArgument(f"size: expected an int or a string such as '512Mi', got {type(size).__name__}")


def _field_size(value: Size, field: str) -> int:
    try:
        return parse_size(value)
    except InvalidArgument as e:
        raise InvalidArgument(f"{field}: {e.message}") from None


def _str_map(value: Mapping[str, str] | None, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{what}: expected a dict of str to str, got {type(value).__name__}")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidArgument(f"{what}: keys and values must be str (got {k!r}: {v!r})")
        out[k] = v
    return out


def _spec(
    image: str,
    kind: str,
    cpu: float,
    memory: Size,
    disk: Size,
    pids: int,
    open_files: int,
    ttl: float,
    env: Mapping[str, str] | None,
    labels: Mapping[str, str] | None,
    tenant: str,
    hostname: str,
    workdir: str,
    allow_ptrace: bool,
    request_id: str | None,
    node_selector: Mapping[str, str] | None = None,
    anti_affinity: str = "",
    gpus: int = 0,
    user: str | int | None = None,
    protected_paths: Sequence[str] | None = None,
    network: str | Mapping[str, Any] | None = None,
    egress_mbps: int = 0,
    connections: int = 0,
) -> _dsec.SandboxSpec:
    s = _dsec.SandboxSpec()
    s.image = image
    s.kind = kind
    r = _dsec.Resources()
    if isinstance(cpu, bool) or not isinstance(cpu, (int, float)):
        raise InvalidArgument(f"resources.cpu: expected a number of cores, got {cpu!r}")
    r.cpu = float(cpu)
    r.memory_bytes = _field_size(memory, "resources.memory")
    r.disk_bytes = _field_size(disk, "resources.disk")
    if not isinstance(pids, int) or pids < 1:
        raise InvalidArgument(f"resources.pids: must be a positive int, got {pids!r}")
    if not isinstance(open_files, int) or open_files < 1:
        raise InvalidArgument(f"resources.open_files: must be a positive int, got {open_files!r}")
    r.pids = pids
    r.open_files = open_files
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
        raise InvalidArgument(f"resources.gpus: must be a non-negative int, got {gpus!r}")
    r.gpus = gpus
    for field, value in (("egress_mbps", egress_mbps), ("connections", connections)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidArgument(f"resources.{field}: must be a non-negative int (0: unlimited), got {value!r}")
        setattr(r, field, value)
    s.resources = r
    if ttl is None or ttl < 0:
        raise InvalidArgument(f"ttl: must be >= 0 seconds (0 = no TTL), got {ttl!r}")
    s.ttl = float(ttl)
    s.env = _str_map(env, "env")
    s.labels = _str_map(labels, "labels")
    s.tenant = tenant
    s.hostname = hostname
    s.workdir = workdir
    s.allow_ptrace = bool(allow_ptrace)
    s.request_id = request_id or ""
    s.node_selector = _str_map(node_selector, "node_selector")
    s.anti_affinity = anti_affinity or ""
    s.user = _user(user)
    if protected_paths is not None:
        if isinstance(protected_paths, (str, bytes)) or not all(isinstance(p, str) for p in protected_paths):
            raise InvalidArgument(f"protected_paths: expected a list of absolute paths (str), got {protected_paths!r}")
        s.protected_paths = list(protected_paths)
    if network is not None:
        s.network = _network_policy(network)
    return s


def _network_policy(network: str | Mapping[str, Any]) -> _dsec.NetworkPolicy:
    """A ``network`` argument: "none", "egress", "open", or {"mode": ..., "rules": [{"cidr" or "host", "protocol",
    "ports", "allow"}]} (docs/networking.md). The shape is checked here; the client library checks the policy itself."""
    p = _dsec.NetworkPolicy()
    if isinstance(network, str):
        p.mode = network
        return p
    if not isinstance(network, Mapping):
        raise InvalidArgument(f"network: expected a mode (str) or a policy (dict), got {network!r}")
    unknown = set(network) - {"mode", "rules"}
    if unknown:
        raise InvalidArgument(f"network: unknown field {sorted(unknown)[0]!r} (known: mode, rules)")
    p.mode = network.get("mode", "egress")
    if not isinstance(p.mode, str):
        raise InvalidArgument(f"network.mode: expected a str, got {p.mode!r}")
    rules = network.get("rules") or []
    if isinstance(rules, (str, bytes, Mapping)):
        raise InvalidArgument(f"network.rules: expected a list of rules, got {rules!r}")
    out = []
    for i, r in enumerate(rules):
        at = f"network.rules[{i}]"
        if not isinstance(r, Mapping):
            raise InvalidArgument(f"{at}: expected a dict such as {{'cidr': '10.0.0.0/8'}}, got {r!r}")
        unknown = set(r) - {"allow", "cidr", "host", "protocol", "ports"}
        if unknown:
            raise InvalidArgument(f"{at}: unknown field {sorted(unknown)[0]!r} "
                                  "(known: allow, cidr, host, protocol, ports)")
        rule = _dsec.NetworkRule()
        rule.allow = bool(r.get("allow", True))
        for field in ("cidr", "host"):
            value = r.get(field, "")
            if not isinstance(value, str):
                raise InvalidArgument(f"{at}.{field}: expected a str, got {value!r}")
            setattr(rule, field, value)
        protocol = r.get("protocol", "any")
        if not isinstance(protocol, str):
            raise InvalidArgument(f"{at}.protocol: expected a str, got {protocol!r}")
        rule.protocol = protocol
        ports = r.get("ports")
        if ports is not None:
            lo, hi = _port_range(ports, f"{at}.ports")
            rule.port_min, rule.port_max = lo, hi
        out.append(rule)
    p.rules = out
    return p


def _policy_of(mode: str | Mapping[str, Any], rules: Sequence[Mapping[str, Any]] | None) -> Any:
    """set_network's arguments as one policy: a policy dict, or a mode and its rules."""
    if isinstance(mode, Mapping):
        if rules is not None:
            raise InvalidArgument("network: give a policy dict or mode and rules, not both")
        return mode
    if rules is not None and (isinstance(rules, (str, bytes, Mapping))):
        raise InvalidArgument(f"network.rules: expected a list of rules, got {rules!r}")
    return {"mode": mode, "rules": list(rules or [])}


def _port_range(ports: Any, field: str) -> tuple[int, int]:
    if isinstance(ports, int) and not isinstance(ports, bool):
        lo = hi = ports
    elif isinstance(ports, str) and ports.replace("-", "", 1).isdigit():
        a, _, b = ports.partition("-")
        lo, hi = int(a), int(b or a)
    else:
        raise InvalidArgument(f"{field}: {ports!r} is not a port or a range such as \"80\" or \"8000-8100\"")
    if not (1 <= lo <= hi <= 65535):
        raise InvalidArgument(f"{field}: {ports!r} is not within 1-65535")
    return lo, hi


def _network_dict(p: _dsec.NetworkPolicy) -> dict:
    rules = []
    for r in p.rules:
        rule = {"allow": r.allow, "protocol": r.protocol}
        if r.host:
            rule["host"] = r.host
        else:
            rule["cidr"] = r.cidr
        if r.port_min or r.port_max:
            rule["ports"] = str(r.port_min) if r.port_min == r.port_max else f"{r.port_min}-{r.port_max}"
        rules.append(rule)
    return {"mode": p.mode, "rules": rules}


def _user(user: str | int | None) -> str:
    """A ``user`` argument as the wire has it: a name, "uid" or "uid:gid" (an int is a uid); None is ""."""
    if user is None:
        return ""
    if isinstance(user, int) and not isinstance(user, bool):
        return str(user)
    if not isinstance(user, str):
        raise InvalidArgument(f"user: expected a user name, a uid or \"uid:gid\", got {user!r}")
    return user


class Snapshot(str):
    """The image a snapshot made: a ``str``, the image's pinned reference (``"repo:tag@sha256:..."``), to pass as
    ``image=`` to :meth:`Client.create` (on any node that reads the store it is in), with what the snapshot took.

    Attributes: ``image`` (the same reference), ``sandbox_id``, ``parent`` (the sandbox's image, pinned), ``store``,
    ``layer_digest``, ``layer_bytes``, ``stored_bytes``, ``file_bytes``, ``entries``, ``frozen_seconds`` (how long
    the sandbox stood still), ``seconds`` (the whole snapshot), and ``result`` (the :class:`SnapshotResult`).
    """

    def __new__(cls, result: _dsec.SnapshotResult) -> "Snapshot":
        self = super().__new__(cls, result.image)
        self.result = result
        for name in ("image", "sandbox_id", "parent", "store", "layer_digest", "layer_bytes", "stored_bytes",
                     "file_bytes", "entries", "frozen_seconds", "seconds"):
            setattr(self, name, getattr(result, name))
        return self

    def __reduce__(self):
        return (str, (str(self),))

    def __repr__(self) -> str:
        return (f"Snapshot({str.__repr__(self)}, file_bytes={self.file_bytes}, frozen_seconds={self.frozen_seconds:.3f}, "
                f"seconds={self.seconds:.3f})")


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
        r.stdin = stdin
    if files is not None:
        if not isinstance(files, Mapping):
            raise InvalidArgument(f"files: expected a dict of relative path to bytes or str, got {type(files).__name__}")
        r.files = dict(files)
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


class Sandbox:
    """One live sandbox: run commands in it, read and write its files, destroy it.

    Not destroyed by garbage collection: call :meth:`destroy` or use ``with``. A sandbox left alone is destroyed
    by its agent when its TTL runs out. Safe to use from several threads at once.
    """

    __slots__ = ("_sb", "_client", "__weakref__")

    def __init__(self, handle: _dsec.Sandbox, client: "Client") -> None:
        self._sb = handle
        self._client = client

    @property
    def id(self) -> str:
        """``"<node>-<hex>"``: unique, and names the node that hosts the sandbox."""
        return self._sb.id

    @property
    def client(self) -> "Client":
        return self._client

    def exec(
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
    ) -> ExecResult:
        """Runs a command and waits for it.

        ``command`` as a str runs under ``/bin/sh -c``; a list is an argv (``argv[0]`` is looked up on PATH).
        ``env`` adds to the sandbox's environment, ``cwd`` defaults to its workdir, ``stdin`` is fed then closed.
        ``user`` is who it runs as: a user name of the sandbox's own /etc/passwd (its groups from /etc/group, HOME,
        USER and LOGNAME from its entry), a uid (int or str) or ``"uid:gid"``; None runs as the sandbox's ``user``
        (root by default). An unknown name is :class:`InvalidArgument`. No command has any capability, root's
        neither.
        After ``timeout`` seconds the command's processes are killed and the result has ``timed_out=True``.
        stdout and stderr (bytes) keep at most ``max_output`` bytes each; ``stdout_truncated`` tells.

        Raises :class:`NotFound` for an unknown sandbox and :class:`Unavailable` when its node cannot be reached.
        An exec is never retried once it may have reached the agent, so a command never runs twice.

        With ``on_output``, the output is streamed instead: ``on_output(stream, data)`` is called on this thread with
        ``stream`` ``"stdout"`` or ``"stderr"`` and ``data`` (bytes) as the command writes it, and the result's
        ``stdout``/``stderr`` are empty (``max_output`` still caps what is delivered; the truncation flags tell).
        An exception raised by ``on_output`` aborts the call and is re-raised; the command itself runs on in the
        sandbox until it ends or times out.
        """
        argv = None
        shell = None
        if isinstance(command, str):
            shell = command
        elif isinstance(command, (list, tuple)):
            argv = list(command)
            for a in argv:
                if not isinstance(a, str):
                    raise InvalidArgument(f"argv: every argument must be a str, got {a!r}")
        else:
            raise InvalidArgument(f"command: expected a str (shell) or a list of str (argv), got {type(command).__name__}")
        return self._sb.exec(
            argv=argv,
            shell=shell,
            env=_str_map(env, "env"),
            cwd=cwd or "",
            stdin=stdin,
            timeout=float(timeout),
            max_output=_field_size(max_output, "max_output"),
            on_output=on_output,
            user=_user(user),
        )

    def write_file(self, path: str, data: BytesLike, mode: int = 0o644) -> None:
        """Writes one file (``str`` data is UTF-8), creating parent directories. ``path`` is absolute inside the sandbox."""
        self._sb.write_file(path, data, mode)

    def read_file(self, path: str) -> bytes:
        """One file's bytes. Raises :class:`NotFound` if it is missing, :class:`InvalidArgument` for a directory."""
        return self._sb.read_file(path)

    def upload_tar(self, remote_dir: str, tar_bytes: BytesLike) -> None:
        """Extracts a tar stream into ``remote_dir`` (created if missing)."""
        self._sb.upload_tar(remote_dir, tar_bytes)

    def download_tar(self, remote_dir: str) -> bytes:
        """``remote_dir`` as a tar stream."""
        return self._sb.download_tar(remote_dir)

    def upload(self, local_path: str | os.PathLike, remote_dir: str) -> None:
        """Copies a local directory's contents (or one local file) into ``remote_dir``."""
        local_path = os.fspath(local_path)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            if os.path.isdir(local_path):
                for name in sorted(os.listdir(local_path)):
                    tar.add(os.path.join(local_path, name), arcname=name)
            elif os.path.exists(local_path):
                tar.add(local_path, arcname=os.path.basename(local_path))
            else:
                raise InvalidArgument(f"upload: {local_path} does not exist")
        self._sb.upload_tar(remote_dir, buf.getvalue())

    def download(self, remote_dir: str, local_dir: str | os.PathLike) -> None:
        """Copies ``remote_dir``'s contents into ``local_dir`` (created if missing).

        Members that would land outside ``local_dir`` (absolute paths, ``..``, links leading out) and device
        files are refused with :class:`InvalidArgument`.
        """
        _safe_extract(self._sb.download_tar(remote_dir), os.fspath(local_dir))

    def info(self) -> SandboxInfo:
        """The agent's record of this sandbox (state, image, resources, labels, expiry)."""
        return self._sb.info()

    def expose(self, port: int) -> str:
        """Exposes TCP port ``port`` of the sandbox at a port of its node and returns where: ``"host:port"``,
        reachable by whoever reaches the node (a grader, a browser, another machine) and by no sandbox. Gone with
        :meth:`unexpose` or the sandbox's destroy. Exposing a port twice raises :class:`InvalidArgument`."""
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise InvalidArgument(f"port: {port!r} is not a TCP port (1-65535)")
        return self._sb.expose(port)

    def unexpose(self, port: int) -> None:
        """Takes an exposed port back; :class:`NotFound` when it is not exposed."""
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise InvalidArgument(f"port: {port!r} is not a TCP port (1-65535)")
        self._sb.unexpose(port)

    def exposed(self) -> dict[int, str]:
        """The exposed ports: the sandbox's port -> ``"host:port"``."""
        return dict(self._sb.exposed())

    def network_usage(self) -> dict:
        """What its network carried: {"bytes_out", "packets_out", "bytes_in", "packets_in", "refused" (packets of
        new connections its rules refused), "resolved" (names the agent's resolver answered -> the addresses they
        admit now)}."""
        return self._sb.network_usage()

    def network(self) -> dict:
        """The network policy in force: {"mode": ..., "rules": [...]} (docs/networking.md)."""
        return _network_dict(self._sb.network())

    def set_network(self, mode: str | Mapping[str, Any] = "egress", rules: Sequence[Mapping[str, Any]] | None = None
                    ) -> dict:
        """Puts a new network policy in force at once, running or asleep, and returns it: ``set_network("none")``,
        ``set_network("egress", rules=[{"cidr": "10.0.0.0/8", "protocol": "tcp", "ports": "443"}])``, or a whole
        policy dict. Rules are tried in order, the first match decides, nothing else is allowed. Connections the new
        rules forbid are cut. A malformed policy raises :class:`InvalidArgument` and the old one stays."""
        return _network_dict(self._sb.set_network(_network_policy(_policy_of(mode, rules))))

    def sleep(self) -> SleepResult:
        """Freezes every process of the sandbox in place and releases the memory it can (page cache; anonymous
        memory only where the node has swap: dsecd --swap-file / --zram-size). Its state becomes ``"sleeping"`` and
        its cpu is free on the node. Files stay readable and writable; ``exec`` raises :class:`FailedPrecondition`
        until :meth:`wake`. Sleeping a sleeping sandbox, or one with an exec running, raises
        :class:`FailedPrecondition`; a retry of this call after a lost answer does not (it carries the same
        request id). The result's ``swap_bytes`` is the sandbox's memory in swap."""
        return self._sb.sleep()

    def wake(self) -> SleepResult:
        """Lets a sleeping sandbox's processes run on where they stopped (their pages come back from swap as they
        touch them); :class:`FailedPrecondition` when it is not sleeping."""
        return self._sb.wake()

    def snapshot(self, name: str) -> Snapshot:
        """Captures the sandbox's files as a new image named ``name`` (``"repo"`` or ``"repo:tag"``, tag
        ``latest`` when none) in its node's snapshot store, and returns it as a :class:`Snapshot`: a str holding the
        pinned reference, for ``client.create(image=...)``.

        The image is the sandbox's image plus one layer of what the sandbox changed: new and changed files, and
        files or directories it deleted or replaced stay deleted or replaced. Files only: processes, memory and open
        files are not captured, so nothing runs in a sandbox made from it until an exec starts it. The sandbox is
        frozen while its files are copied (a running exec pauses) and runs on; a sleeping one stays asleep.

        Raises :class:`AlreadyExists` when the name is taken (a snapshot never moves a tag), :class:`InvalidArgument`
        for a malformed name, :class:`NotFound` for a destroyed sandbox, :class:`Unimplemented` for a backend without
        snapshots (null), :class:`ResourceExhausted` when the store is full (nothing is tagged then).
        """
        if not isinstance(name, str):
            raise InvalidArgument(f"name: expected a str such as 'repo:tag', got {type(name).__name__}")
        return Snapshot(self._sb.snapshot(name))

    def fork(self, n: int, name: str | None = None) -> list["Sandbox"]:
        """Branches the sandbox: snapshots it (under ``name``, else ``fork/<sandbox id>:<random>``) and creates
        ``n`` sandboxes from the snapshot with this sandbox's spec (resources, env, labels, workdir, ttl; not its
        group), placed by the client like :meth:`Client.create_many`, all or nothing. Each starts with this
        sandbox's files as they were and diverges on its own. The snapshot stays in the store."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidArgument(f"n: expected a positive int, got {n!r}")
        return [Sandbox(h, self._client) for h in self._sb.fork(n, name or "")]

    def destroy(self) -> None:
        """Destroys the sandbox: its processes are killed and its files are gone. Idempotent."""
        self._sb.destroy()

    @property
    def destroyed(self) -> bool:
        """Whether :meth:`destroy` was called through this handle."""
        return self._sb.destroyed

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return f"<dsec.Sandbox {self.id}{' destroyed' if self.destroyed else ''}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sandbox) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)


def _safe_extract(tar_bytes: bytes, dest: str) -> None:
    os.makedirs(dest, exist_ok=True)
    root = os.path.realpath(dest)

    def inside(path: str) -> bool:
        return path == root or path.startswith(root + os.sep)

    with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:*") as tar:
        for m in tar:
            name = m.name
            while name.startswith("./"):
                name = name[2:]
            name = posixpath.normpath(name) if name else ""
            if name in (".", ""):
                continue
            if name.startswith("/") or name == ".." or name.startswith("../"):
                raise InvalidArgument(f"download: refusing tar member {m.name!r} outside the target directory")
            target = os.path.join(root, name)
            if not inside(os.path.realpath(os.path.dirname(target))):
                raise InvalidArgument(f"download: tar member {m.name!r} would be written through a link out of {dest}")
            if os.path.islink(target):
                os.unlink(target)
            if m.isdir():
                os.makedirs(target, exist_ok=True)
                os.chmod(target, (m.mode & 0o777) | 0o700)
            elif m.isfile():
                os.makedirs(os.path.dirname(target), exist_ok=True)
                src = tar.extractfile(m)
                with open(target, "wb") as f:
                    while True:
                        chunk = src.read(1 << 20)
                        if not chunk:
                            break
                        f.write(chunk)
                os.chmod(target, m.mode & 0o777)
            elif m.issym():
                link_target = posixpath.normpath(posixpath.join(posixpath.dirname(name), m.linkname))
                if m.linkname.startswith("/") or link_target == ".." or link_target.startswith("../"):
                    raise InvalidArgument(f"download: symlink {m.name!r} -> {m.linkname!r} leads out of {dest}")
                os.makedirs(os.path.dirname(target), exist_ok=True)
                if os.path.lexists(target):
                    os.unlink(target)
                os.symlink(m.linkname, target)
            elif m.islnk():
                source = os.path.join(root, posixpath.normpath(m.linkname))
                if not inside(os.path.realpath(source)):
                    raise InvalidArgument(f"download: hard link {m.name!r} -> {m.linkname!r} leads out of {dest}")
                os.makedirs(os.path.dirname(target), exist_ok=True)
                if os.path.lexists(target):
                    os.unlink(target)
                os.link(source, target)
            else:
                raise InvalidArgument(f"download: refusing special file {m.name!r} (device or fifo)")


_live_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()
_live_lock = threading.Lock()


@atexit.register
def _close_live_clients() -> None:
    # An embedded agent would die with the process anyway (it gets SIGTERM); closing here lets it finish cleanly.
    with _live_lock:
        clients = list(_live_clients)
    for c in clients:
        try:
            c.close()
        except Exception:
            pass


class SandboxGroup:
    """The sandboxes of one pulse, made by :meth:`Client.create_group` and held by a lease.

    Iterates, indexes and measures like a list of :class:`Sandbox`. The client renews the lease on every node that
    holds members, in the background; if the trainer dies, the agents destroy the members once the lease runs out.
    :meth:`destroy` (or leaving a ``with`` block) destroys them all, one request per node.
    """

    __slots__ = ("_g", "_client", "_members")

    def __init__(self, handle: _dsec.SandboxGroup, client: "Client") -> None:
        self._g = handle
        self._client = client
        self._members = [Sandbox(h, client) for h in handle.members]

    @property
    def id(self) -> str:
        return self._g.id

    @property
    def lease(self) -> float:
        """Seconds the agents keep the members after the last renewal."""
        return self._g.lease

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self):
        return iter(self._members)

    def __getitem__(self, i):
        return self._members[i]

    def exec(
        self,
        command: Union[str, Sequence[str]],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float = 600,
        max_output: Size = 16 << 20,
        user: str | int | None = None,
    ) -> list[ExecResult]:
        """The same command in every member, concurrently; results in member order. A member whose call fails gets a
        result with ``exit_code == -1`` and the error in ``stderr``."""
        argv = None
        shell = None
        if isinstance(command, str):
            shell = command
        elif isinstance(command, (list, tuple)) and all(isinstance(a, str) for a in command):
            argv = list(command)
        else:
            raise InvalidArgument("command: expected a str (shell) or a list of str (argv)")
        return self._g.exec(argv=argv, shell=shell, env=_str_map(env, "env"), cwd=cwd or "", timeout=float(timeout),
                            max_output=_field_size(max_output, "max_output"), user=_user(user))

    def sleep(self) -> list[SleepResult]:
        """Sleeps every member, concurrently (see :meth:`Sandbox.sleep`); every member is tried, then the first
        error is raised."""
        return self._g.sleep()

    def wake(self) -> list[SleepResult]:
        """Wakes every member, concurrently; every member is tried, then the first error is raised."""
        return self._g.wake()

    def set_network(self, mode: str | Mapping[str, Any] = "egress",
                    rules: Sequence[Mapping[str, Any]] | None = None) -> list[dict]:
        """Puts one network policy in force in every member, concurrently (see :meth:`Sandbox.set_network`): a
        phase change for the whole group. Every member is tried, then the first error is raised."""
        return [_network_dict(p) for p in self._g.set_network(_network_policy(_policy_of(mode, rules)))]

    def snapshot(self, name: str) -> list[Snapshot]:
        """Snapshots every member (:meth:`Sandbox.snapshot`), concurrently; member ``i`` is named ``name`` with
        ``-<i>`` added to its tag (``"swe/ep:step3"`` gives ``"swe/ep:step3-0"``, ...; without a tag ``"swe/ep:0"``,
        ...). Every member is tried, then the first error is raised."""
        return [Snapshot(r) for r in self._g.snapshot(name)]

    def renew(self) -> None:
        """Renews the lease now (it is renewed in the background too)."""
        self._g.renew()

    def destroy(self) -> None:
        """Destroys every member; idempotent."""
        self._g.destroy()
        self._members = []

    def release(self) -> list[str]:
        """Stops renewing and gives the members up (the agents reap them when the lease runs out); their ids."""
        self._members = []
        return self._g.release()

    def __enter__(self) -> "SandboxGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return f"SandboxGroup(id={self.id!r}, size={len(self)}, lease={self.lease})"


class Client:
    """The entry point: creates sandboxes and finds existing ones.

    ``Client()`` starts a private node agent (``dsecd``) for this process on a unix socket and stops it on
    :meth:`close`, which destroys its sandboxes. The agent binary is ``agent`` if given, else ``$DSEC_AGENT``, else
    the one of the build tree the module came from, else the one inside this package (``dsec/bin/dsecd``), else
    ``dsecd`` on PATH. Its image store and state live in ``home`` (default ``$DSEC_HOME``, then ``/var/lib/dsec``);
    ``agent_args`` are extra ``dsecd`` flags such as ``["--backends", "container,null"]``. The agent's output goes
    to ``$DSEC_AGENT_LOG`` when set (else to a private file removed with it); errors about the agent quote its tail.
    The agent also stops if this process dies, and a forked child cannot use (or stop) its parent's client.

    ``stores`` are the image stores names are resolved in (directories or ``http(s)://`` URLs; default: the
    embedded agent's ``<home>/store``): ``create(image="swe/task-17")`` looks the tag up here (cached for
    ``image_cache_ttl`` seconds) and sends the agent the exact manifest, whose layers the node streams on demand.

    ``Client(etcd=["http://10.0.0.2:2379"])`` finds its agents in etcd instead (agents started with ``dsecd --etcd``
    register under ``etcd_prefix``) and follows them as they come and go. ``request_timeout`` bounds one exchange
    with a node: a create whose node does not answer in time moves to another node with the same request id.

    ``token`` is the bearer token sent to every agent (default ``$DSEC_TOKEN``; agents started with ``dsecd
    --tokens``), ``tls_ca_file`` the CA bundle that signed ``https://`` agents' certificates (default: the
    system's), ``tls_client_cert`` and ``tls_client_key`` a client certificate for agents that ask for one;
    ``etcd_tls_*`` the same for ``https://`` etcd members.

    ``Client(endpoints=[...])`` talks to running agents ("unix:/path" or "http://host:port"); calls for a sandbox
    go to the node that made it. ``placement`` chooses the node for each new sandbox: ``"spread"`` (most free
    capacity first, so sandboxes spread over the nodes) or ``"pack"`` (the fullest node that still fits, so nodes
    fill one after another); both prefer nodes that already cache the image's layers. Idempotent calls are retried
    on transient errors with exponential backoff and full jitter, all within ``call_deadline`` seconds (an exec's
    own timeout comes on top).
    """

    def __init__(
        self,
        endpoints: Union[str, Iterable[str], None] = None,
        *,
        agent: str | os.PathLike | None = None,
        home: str | os.PathLike | None = None,
        agent_args: Sequence[str] = (),
        call_deadline: float = 60.0,
        create_concurrency: int = 32,
        max_attempts: int = 6,
        initial_backoff: float = 0.02,
        max_backoff: float = 2.0,
        agent_start_timeout: float = 30.0,
        agent_stop_grace: float = 10.0,
        stores: Union[str, Iterable[str], None] = None,
        image_cache_ttl: float = 10.0,
        placement: str = "spread",
        request_timeout: float = 15.0,
        etcd: Union[str, Iterable[str], None] = None,
        etcd_prefix: str = "/dsec/",
        token: str | None = None,
        tls_ca_file: str | os.PathLike | None = None,
        tls_client_cert: str | os.PathLike | None = None,
        tls_client_key: str | os.PathLike | None = None,
        etcd_tls_ca_file: str | os.PathLike | None = None,
        etcd_tls_client_cert: str | os.PathLike | None = None,
        etcd_tls_client_key: str | os.PathLike | None = None,
    ) -> None:
        if endpoints is None:
            eps: list[str] = []
        elif isinstance(endpoints, str):
            eps = [endpoints]
        else:
            eps = list(endpoints)
        self._lock = threading.Lock()
        self._client = _dsec.Client(
            endpoints=eps,
            agent_binary=os.fspath(agent) if agent else "",
            agent_candidates=[agent_binary()],
            home=os.fspath(home) if home else "",
            agent_args=list(agent_args),
            call_deadline=float(call_deadline),
            create_concurrency=int(create_concurrency),
            max_attempts=int(max_attempts),
            initial_backoff=float(initial_backoff),
            max_backoff=float(max_backoff),
            agent_start_timeout=float(agent_start_timeout),
            agent_stop_grace=float(agent_stop_grace),
            stores=[stores] if isinstance(stores, str) else [os.fspath(s) for s in (stores or ())],
            image_cache_ttl=float(image_cache_ttl),
            placement=str(placement),
            request_timeout=float(request_timeout),
            etcd=[etcd] if isinstance(etcd, str) else list(etcd or ()),
            token=str(token or ""),
            tls_ca_file=os.fspath(tls_ca_file) if tls_ca_file else "",
            tls_client_cert=os.fspath(tls_client_cert) if tls_client_cert else "",
            tls_client_key=os.fspath(tls_client_key) if tls_client_key else "",
            etcd_tls_ca_file=os.fspath(etcd_tls_ca_file) if etcd_tls_ca_file else "",
            etcd_tls_client_cert=os.fspath(etcd_tls_client_cert) if etcd_tls_client_cert else "",
            etcd_tls_client_key=os.fspath(etcd_tls_client_key) if etcd_tls_client_key else "",
            etcd_prefix=str(etcd_prefix),
        )
        self._pid = os.getpid()
        with _live_lock:
            _live_clients.add(self)

    def create(
        self,
        image: str = "busybox",
        kind: str = "container",
        *,
        cpu: float = 1.0,
        memory: Size = "512Mi",
        disk: Size = "1Gi",
        pids: int = 512,
        open_files: int = 4096,
        ttl: float = 3600,
        env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        tenant: str = "",
        hostname: str = "",
        workdir: str = "/",
        allow_ptrace: bool = False,
        request_id: str | None = None,
        node_selector: Mapping[str, str] | None = None,
        anti_affinity: str = "",
        gpus: int = 0,
        user: str | int | None = None,
        protected_paths: Sequence[str] | None = None,
        network: str | Mapping[str, Any] | None = None,
        egress_mbps: int = 0,
        connections: int = 0,
    ) -> Sandbox:
        """Creates a sandbox and returns once it can run commands.

        ``cpu`` in cores (fractions allowed), ``memory`` and ``disk`` in bytes or as "512Mi"/"2G", ``ttl`` in
        seconds after which the agent destroys it (0 = never). ``env`` is the environment of every exec, ``labels``
        and ``tenant`` are for :meth:`list`. ``node_selector`` names labels a node must carry (``dsecd --label``),
        ``anti_affinity`` a label key whose value sandboxes prefer not to share a node over, ``gpus`` how many GPUs
        the sandbox needs. ``request_id`` makes the create idempotent: the same id returns the same
        sandbox (a random one is used when omitted, so the client's own retries never make two).

        ``user`` is who every exec runs as unless it names its own (a user name of the image's /etc/passwd, a uid
        or ``"uid:gid"``; root by default). ``protected_paths`` (absolute paths, at most 32, e.g. ``["/grader"]``)
        are made root's own directories (mode 0700) before the sandbox is returned, so that what root puts there
        stays out of reach of execs run as another user (docs/security.md).

        ``network`` is "none" (loopback only, the default), "open", or {"mode": "egress", "rules": [...]}
        (docs/networking.md); ``egress_mbps`` shapes what it sends and ``connections`` caps the connections it holds
        to the outside at once (0: unlimited).

        The sandbox is not destroyed by garbage collection: call ``destroy()`` or use ``with``.
        """
        spec = _spec(image, kind, cpu, memory, disk, pids, open_files, ttl, env, labels, tenant, hostname, workdir,
                     allow_ptrace, request_id, node_selector, anti_affinity, gpus, user, protected_paths, network,
                     egress_mbps, connections)
        return Sandbox(self._c().create(spec), self)

    def create_many(
        self,
        n: int,
        image: str = "busybox",
        kind: str = "container",
        *,
        cpu: float = 1.0,
        memory: Size = "512Mi",
        disk: Size = "1Gi",
        pids: int = 512,
        open_files: int = 4096,
        ttl: float = 3600,
        env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        tenant: str = "",
        hostname: str = "",
        workdir: str = "/",
        allow_ptrace: bool = False,
        request_id: str | None = None,
        node_selector: Mapping[str, str] | None = None,
        anti_affinity: str = "",
        gpus: int = 0,
        user: str | int | None = None,
        protected_paths: Sequence[str] | None = None,
        network: str | Mapping[str, Any] | None = None,
        egress_mbps: int = 0,
        connections: int = 0,
    ) -> list[Sandbox]:
        """``n`` sandboxes from one spec, created concurrently (``create_concurrency`` at a time).

        Placed over the nodes by the client's placement policy, one batch request per node, all at once; a node
        that refuses or fails has its share made on others. All or nothing: if the sandboxes cannot all be made,
        the ones made are destroyed and the error is raised. With one node, calling again with the same
        ``request_id`` returns the same sandboxes instead of making new ones.
        """
        if not isinstance(n, int) or n < 0:
            raise InvalidArgument(f"n: must be a non-negative int, got {n!r}")
        spec = _spec(image, kind, cpu, memory, disk, pids, open_files, ttl, env, labels, tenant, hostname, workdir,
                     allow_ptrace, request_id, node_selector, anti_affinity, gpus, user, protected_paths, network,
                     egress_mbps, connections)
        return [Sandbox(h, self) for h in self._c().create_many(n, spec)]

    def create_group(
        self,
        n: int,
        image: str = "busybox",
        kind: str = "container",
        *,
        lease: float = 30.0,
        cpu: float = 1.0,
        memory: Size = "512Mi",
        disk: Size = "1Gi",
        pids: int = 512,
        open_files: int = 4096,
        ttl: float = 3600,
        env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        tenant: str = "",
        hostname: str = "",
        workdir: str = "/",
        allow_ptrace: bool = False,
        request_id: str | None = None,
        node_selector: Mapping[str, str] | None = None,
        anti_affinity: str = "",
        gpus: int = 0,
        user: str | int | None = None,
        protected_paths: Sequence[str] | None = None,
        network: str | Mapping[str, Any] | None = None,
        egress_mbps: int = 0,
        connections: int = 0,
    ) -> SandboxGroup:
        """``n`` sandboxes as one :class:`SandboxGroup` under a lease of ``lease`` seconds.

        Placed over the nodes by the client's placement policy and sent as one batch request per node, all at once;
        a node that refuses or fails has its share made on others. All or nothing. The lease is renewed in the
        background; when this process dies, the agents destroy the group's sandboxes once it runs out.
        """
        if not isinstance(n, int) or n < 0:
            raise InvalidArgument(f"n: must be a non-negative int, got {n!r}")
        spec = _spec(image, kind, cpu, memory, disk, pids, open_files, ttl, env, labels, tenant, hostname, workdir,
                     allow_ptrace, request_id, node_selector, anti_affinity, gpus, user, protected_paths, network,
                     egress_mbps, connections)
        return SandboxGroup(self._c().create_group(n, spec, float(lease)), self)

    def run_code(
        self,
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
    ) -> FnCallResult:
        """Runs ``code`` once in a node's warm pool and returns what it did: no sandbox to create or destroy.

        ``language`` is ``"python"`` (python3), ``"shell"`` (/bin/sh), ``"c"`` or ``"cpp"`` (compiled, then run;
        the compiler's status and messages are ``compile_exit_code`` and ``compile_output``). The call gets a fresh
        process of a pre-initialised server over the image's read-only root (``image``; default: the node's), a
        private writable ``/tmp`` where ``files`` (relative path -> bytes) are written and the program runs,
        ``stdin`` then EOF, ``args`` as its arguments and ``env`` added to a clean environment. Nothing of it is
        left for the next call.

        Limits: ``timeout`` wall seconds and ``cpu_time`` CPU seconds (``timed_out``), ``memory`` for its processes
        together (``oom_killed``), ``pids`` processes at once, ``max_output_bytes`` of stdout and of stderr each
        (``stdout_truncated``). ``gpus`` GPUs (or shares, with ``gpu_mode="shared"``) on a node that has them.

        A program that fails, crashes, times out or runs out of memory is a result; a call that cannot run raises
        (:class:`InvalidArgument`, :class:`NotFound` for an unknown image, :class:`Unavailable`, ...). Transient
        failures are retried with the same ``request_id`` (the node answers it once), then on another node.
        """
        request = fncall_request(code, language, stdin=stdin, files=files, args=args, env=env, timeout=timeout,
                                 cpu_time=cpu_time, memory=memory, pids=pids, max_output_bytes=max_output_bytes,
                                 image=image, gpus=gpus, gpu_mode=gpu_mode, request_id=request_id)
        return self._c().run_code(request)

    def run_code_many(self, calls: Iterable[Union[Mapping[str, object], FnCallRequest]]) -> list[FnCallResult]:
        """Many function calls at once, spread over the nodes; results in the order of ``calls``.

        Each call is a dict of :meth:`run_code`'s arguments (``{"code": ..., "stdin": ..., "timeout": 2}``) or a
        :class:`FnCallRequest` from :func:`fncall_request`. The calls travel as one batch per node (in chunks),
        run concurrently within the nodes' pools, and a node that fails has its calls run elsewhere. A call that
        could not run at all does not raise: its result has ``error`` and ``error_code`` set (``exception()``
        gives the matching :mod:`dsec.errors` exception). Raises only when no node could take any of them.
        """
        requests = []
        for i, c in enumerate(calls):
            if isinstance(c, FnCallRequest):
                requests.append(c)
            elif isinstance(c, Mapping):
                kw = dict(c)
                if "code" not in kw:
                    raise InvalidArgument(f"calls[{i}]: no 'code'")
                try:
                    requests.append(fncall_request(**kw))
                except TypeError as e:
                    raise InvalidArgument(f"calls[{i}]: {e}") from None
                except InvalidArgument as e:
                    raise InvalidArgument(f"calls[{i}]: {e.message}") from None
            else:
                raise InvalidArgument(f"calls[{i}]: expected a dict or a FnCallRequest, got {type(c).__name__}")
        return self._c().run_code_many(requests)

    def attach(self, sandbox_id: str) -> Sandbox:
        """A handle on an existing sandbox by id (made by any client). No call is made until it is used."""
        return Sandbox(self._c().attach(sandbox_id), self)

    def list(self, labels: Mapping[str, str] | None = None, tenant: str = "") -> list[SandboxInfo]:
        """Sandboxes on every node of this client that carry all of ``labels`` (and belong to ``tenant``)."""
        return self._c().list(_str_map(labels, "labels"), tenant)

    def nodes(self) -> list[NodeInfo]:
        """Each node's capacity, load, backends and images."""
        return self._c().nodes()

    @property
    def endpoint(self) -> str:
        """The embedded agent's endpoint ("unix:/.../dsecd.sock"), or the first configured one."""
        return self._c().endpoint

    def close(self) -> None:
        """Stops the embedded agent (destroying its sandboxes) and closes the client. Idempotent.

        Sandbox handles of this client raise :class:`FailedPrecondition` afterwards.
        """
        if os.getpid() != self._pid:
            return  # a forked child: the agent belongs to the parent
        with self._lock:
            self._client.close()

    @property
    def closed(self) -> bool:
        return self._client.closed

    def _c(self) -> _dsec.Client:
        if os.getpid() != self._pid:
            raise FailedPrecondition("a dsec.Client cannot be used in a forked child process: create a new one there")
        return self._client

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<dsec.Client closed>"
        return f"<dsec.Client {self._client.endpoint}>"
