"""One live sandbox (:class:`Sandbox`) and what a snapshot of one made (:class:`Snapshot`)."""

from __future__ import annotations

import io
import os
import posixpath
import tarfile
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, Union

from . import _dsec
from .errors import InvalidArgument
from ._spec import _field_size, _network_dict, _network_policy, _policy_of, _request_id, _str_map, _user
from ._types import BytesLike, ExecResult, ProcessInfo, SandboxInfo, SessionInfo, Size, SleepResult
from .process import Process, _check_pid, _check_terminal_size
from .screen import ScreenMethods
from .session import Session, _check_session_name

if TYPE_CHECKING:  # annotations only: the client module imports this one
    from .client import Client


class Snapshot(str):
    """The image a snapshot made: a ``str``, the image's pinned reference (``"repo:tag@sha256:..."``), to pass as
    ``image=`` to :meth:`Client.create` (on any node that reads the store it is in), with what the snapshot took.

    Attributes: ``image`` (the same reference), ``sandbox_id``, ``parent`` (the sandbox's image, pinned), ``store``,
    ``layer_digest``, ``layer_bytes``, ``stored_bytes``, ``file_bytes``, ``entries``, ``frozen_seconds`` (how long
    the sandbox stood still), ``seconds`` (the whole snapshot), and ``result`` (the :class:`SnapshotResult`).
    """

    result: _dsec.SnapshotResult
    image: str
    sandbox_id: str
    parent: str
    store: str
    layer_digest: str
    layer_bytes: int
    stored_bytes: int
    file_bytes: int
    entries: int
    frozen_seconds: float
    seconds: float

    def __new__(cls, result: _dsec.SnapshotResult) -> "Snapshot":
        self = super().__new__(cls, result.image)
        self.result = result
        for name in ("image", "sandbox_id", "parent", "store", "layer_digest", "layer_bytes", "stored_bytes",
                     "file_bytes", "entries", "frozen_seconds", "seconds"):
            setattr(self, name, getattr(result, name))
        return self

    def __reduce__(self) -> tuple[type[str], tuple[str]]:
        return (str, (str(self),))

    def __repr__(self) -> str:
        return (f"Snapshot({str.__repr__(self)}, file_bytes={self.file_bytes}, "
                f"frozen_seconds={self.frozen_seconds:.3f}, seconds={self.seconds:.3f})")


class Sandbox(ScreenMethods):
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
        request_id: str | None = None,
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
        An exec runs exactly once: it carries ``request_id`` (one is made when None; at most 128 bytes), so the
        client retries a lost answer safely and the agent answers a repeat with the first call's result, even after
        it restarted. When no retry can learn what became of the command (its agent restarted while it ran, or its
        node is gone), :class:`OutcomeUnknown` (an :class:`InfraError`) says so with the id; the command is never
        run twice. The same id with another command is :class:`InvalidArgument`. A command killed by the OOM killer
        is a result with ``oom_killed=True``.

        With ``on_output``, the output is streamed instead: ``on_output(stream, data)`` is called on this thread with
        ``stream`` ``"stdout"`` or ``"stderr"`` and ``data`` (bytes) as the command writes it, and the result's
        ``stdout``/``stderr`` are empty (``max_output`` still caps what is delivered; the truncation flags tell).
        An exception raised by ``on_output`` aborts the call and is re-raised; the command itself runs on in the
        sandbox until it ends or times out.
        """
        argv, shell = _command(command)
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
            request_id=_request_id(request_id),
        )

    def spawn(
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
    ) -> Process:
        """Starts a command that outlives this call (a server, a REPL, a long build) and returns its
        :class:`Process` at once. ``command``, ``env``, ``cwd`` and ``user`` are as for :meth:`exec`.

        The sandbox's init keeps its output, so it can be read from the start later, from any client
        (``process.stdout``, ``process.output()``); its stdin stays open for :meth:`Process.write_stdin` until
        :meth:`Process.close_stdin`. ``pty=True`` gives it a terminal of ``rows`` x ``cols`` (1 to 1000 each) as
        stdin, stdout and stderr, so interactive programs work (everything arrives as stdout). ``tag`` (at most 128
        bytes) is a label listed with it. A command that cannot start is a process that ended at once, as exec
        gives it (exit code 127 with ``reason="executable_not_found"``, ...). At most 64 processes run in a sandbox
        (:class:`ResourceExhausted`). ``request_id`` (at most 128 bytes; one is made when not given) makes the
        spawn exactly-once on the agent: a retry after a lost answer, or a call repeated with the same id, gets
        the first spawn's process and starts nothing; :class:`OutcomeUnknown` when that cannot be known.
        """
        argv, shell = _command(command)
        _check_terminal_size(rows, cols)
        handle = self._sb.spawn(argv=argv, shell=shell, env=_str_map(env, "env"), cwd=cwd or "", user=_user(user),
                                pty=bool(pty), rows=rows, cols=cols, tag=tag or "",
                                request_id=_request_id(request_id))
        return Process(handle, self)

    def process(self, pid: int) -> Process:
        """The spawned process ``pid`` of this sandbox (started by any client); no call is made until it is used."""
        _check_pid(pid)
        return Process(self._sb.process(pid), self)

    def processes(self) -> list[ProcessInfo]:
        """Every spawned process not forgotten yet, running and ended, by pid (sessions' shells are not listed)."""
        return self._sb.processes()

    def shell(
        self,
        shell: str | None = None,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        name: str | None = None,
    ) -> Session:
        """Starts a persistent shell session and returns its :class:`Session`: each :meth:`Session.run` executes in
        the same shell, so ``cd``, ``export``, functions and aliases carry over. ``shell`` defaults to /bin/bash
        where the sandbox has it, else /bin/sh; ``env``, ``cwd`` and ``user`` are as for :meth:`exec`. ``name`` (1
        to 64 letters, digits, ``.``, ``_``, ``-``) must be new in the sandbox (:class:`AlreadyExists`); None lets
        the agent name it. At most 16 sessions per sandbox (:class:`ResourceExhausted`)."""
        handle = self._sb.shell(name=name or "", shell=shell or "", env=_str_map(env, "env"), cwd=cwd or "",
                                user=_user(user))
        return Session(handle, self)

    def session(self, name: str) -> Session:
        """The session named ``name`` of this sandbox (started by any client); no call is made until it is used."""
        _check_session_name(name)
        return Session(self._sb.session(name), self)

    def sessions(self) -> list[SessionInfo]:
        """Every session of the sandbox, alive or ended (until closed or restarted)."""
        return self._sb.sessions()

    def write_file(self, path: str, data: BytesLike, mode: int = 0o644) -> None:
        """Writes one file (``str`` data is UTF-8), creating parent directories. ``path`` is absolute inside the
        sandbox."""
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
        self._sb.upload_tar(remote_dir, _tar_of(os.fspath(local_path)))

    def download(self, remote_dir: str, local_dir: str | os.PathLike) -> None:
        """Copies ``remote_dir``'s contents into ``local_dir`` (created if missing).

        Members that would land outside ``local_dir`` (absolute paths, ``..``, links leading out) and device
        files are refused with :class:`InvalidArgument`.
        """
        _safe_extract(self._sb.download_tar(remote_dir), os.fspath(local_dir))

    def info(self) -> SandboxInfo:
        """The agent's record of this sandbox (state, image, resources, labels, expiry)."""
        return self._sb.info()

    def set_ttl(self, seconds: int) -> SandboxInfo:
        """Sets the sandbox's deadline to ``seconds`` from now (0: none), earlier or later than it was, and returns
        its info with the new ``expires_at``. More than one year raises :class:`InvalidArgument`."""
        if isinstance(seconds, bool) or not isinstance(seconds, int) or not 0 <= seconds <= 365 * 86400:
            raise InvalidArgument(f"seconds: {seconds!r} is not a whole number of seconds from 0 to one year")
        return self._sb.set_ttl(seconds)

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

    def fork(self, n: int, name: str | None = None, keep: bool = False) -> list["Sandbox"]:
        """Branches the sandbox: snapshots it (under ``name``, else ``fork/<sandbox id>:<random>``) and creates
        ``n`` sandboxes from the snapshot with this sandbox's spec (resources, env, labels, workdir, ttl; not its
        group), placed by the client like :meth:`Client.create_many`, all or nothing. Each starts with this
        sandbox's files as they were and diverges on its own.

        A snapshot under a generated name goes when the last of the copies is destroyed (they carry the label
        ``dsec.fork-snapshot``; their node removes the tag when none of them is left there). With ``keep=True``,
        or under a ``name`` of your own, it stays in the store (:meth:`Client.remove_image` removes it)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidArgument(f"n: expected a positive int, got {n!r}")
        return [Sandbox(h, self._client) for h in self._sb.fork(n, name or "", bool(keep))]

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


def _command(command: Union[str, Sequence[str]]) -> tuple[list[str] | None, str | None]:
    """A command as exec and spawn take it: a str is shell text (``/bin/sh -c``), a list an argv. Returns (argv,
    shell)."""
    if isinstance(command, str):
        return None, command
    if isinstance(command, (list, tuple)):
        argv = list(command)
        for a in argv:
            if not isinstance(a, str):
                raise InvalidArgument(f"argv: every argument must be a str, got {a!r}")
        return argv, None
    raise InvalidArgument(f"command: expected a str (shell) or a list of str (argv), got {type(command).__name__}")


def _tar_of(local_path: str) -> bytes:
    """What upload sends (Sandbox's and AsyncSandbox's): a local directory's contents, or one local file, as a tar
    stream."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        if os.path.isdir(local_path):
            for name in sorted(os.listdir(local_path)):
                tar.add(os.path.join(local_path, name), arcname=name)
        elif os.path.exists(local_path):
            tar.add(local_path, arcname=os.path.basename(local_path))
        else:
            raise InvalidArgument(f"upload: {local_path} does not exist")
    return buf.getvalue()


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
                assert src is not None  # a regular file's member always has its data
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
