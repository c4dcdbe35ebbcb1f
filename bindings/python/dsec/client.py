"""The entry point (:class:`Client`): an embedded or remote agent, creates, lists, function calls."""

from __future__ import annotations

import atexit
import builtins
import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence, Tuple, Union

from . import _dsec
from .errors import FailedPrecondition, InvalidArgument
from ._spec import (DEFAULT_IMAGE, DEFAULT_KIND, SPEC_DEFAULTS, SpecKeywords, _spec, _str_map, check_spec_keywords,
                    takes_spec_keywords)
from ._types import BytesLike, FnCallRequest, FnCallResult, ImageInfo, NodeInfo, SandboxInfo, Size
from .fncall import fncall_request
from .group import SandboxGroup
from .sandbox import Sandbox

if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        from typing import Unpack
    else:
        from typing_extensions import Unpack

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def agent_binary() -> str:
    """The ``dsecd`` shipped inside this package (``dsec/bin/dsecd``); it may not exist in a source checkout."""
    return os.path.join(_PACKAGE_DIR, "bin", "dsecd")


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


def _specs(specs: object) -> list[_dsec.SandboxSpec]:
    """A list of dicts of Client.create's arguments as SandboxSpecs, with create's defaults."""
    if isinstance(specs, bool) or not isinstance(specs, Sequence) or isinstance(specs, (str, bytes)):
        raise InvalidArgument(f"n: expected an int or a list of specs (dicts), got {type(specs).__name__}")
    out = []
    for i, s in enumerate(specs):
        if not isinstance(s, Mapping):
            raise InvalidArgument(f"specs[{i}]: expected a dict of create()'s arguments, got {type(s).__name__}")
        keywords = dict(s)
        image = keywords.pop("image", DEFAULT_IMAGE)
        kind = keywords.pop("kind", DEFAULT_KIND)
        unknown = [name for name in keywords if name not in SPEC_DEFAULTS]
        if unknown:
            raise InvalidArgument(f"specs[{i}]: got an unexpected keyword argument {unknown[0]!r}")
        try:
            out.append(_spec("Client.create", image, kind, **keywords))
        except InvalidArgument as e:
            raise InvalidArgument(f"specs[{i}]: {e.message}") from None
    return out


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

    ``create(image="registry.example:5000/swe/task:v1")`` runs an image of an OCI registry (a name whose first part
    is a host): the agent imports it on first use and keeps its Env, WorkingDir and User (docs/images.md). For the
    embedded agent, ``registry_auth={"ghcr.io": ("user", "token")}`` gives credentials (handed over in a private
    file; ``~/.docker/config.json`` is read too), ``registry_mirrors={"docker.io": "http://mirror:5000"}`` mirrors,
    ``insecure_registries`` hosts spoken to over plain HTTP, ``registry_ca_file`` a CA bundle, and
    ``default_registry`` where bare names no store has come from (``"docker.io"``).

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
        registry_auth: Optional[Mapping[str, Tuple[str, str]]] = None,
        registry_mirrors: Optional[Mapping[str, str]] = None,
        insecure_registries: Iterable[str] = (),
        registry_ca_file: str | os.PathLike | None = None,
        default_registry: str = "",
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
            registry_auth={str(h): (str(c[0]), str(c[1])) for h, c in (registry_auth or {}).items()},
            registry_mirrors={str(h): str(u) for h, u in (registry_mirrors or {}).items()},
            insecure_registries=[str(h) for h in insecure_registries],
            registry_ca_file=os.fspath(registry_ca_file) if registry_ca_file else "",
            default_registry=str(default_registry),
        )
        self._pid = os.getpid()
        with _live_lock:
            _live_clients.add(self)

    @takes_spec_keywords
    def create(self, image: str = DEFAULT_IMAGE, kind: str = DEFAULT_KIND, **spec: Unpack[SpecKeywords]) -> Sandbox:
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

        ``display`` is a full VM's screen (``kind="vm"``): "1280x800" (from 320x200 to 3840x2160), or "none";
        a vm gets 1024x768 when it is not given, other kinds have none (docs/vm.md).

        ``priority`` is its class of service on the node: "latency" (more CPU weight, memory protected), "standard",
        or "batch" (SCHED_IDLE: only CPU nobody else wants; memory throttled before its limit) (docs/qos.md).
        ``ksm`` offers its memory to the kernel's same-page merging; ``reclaim=False`` keeps the node's cold-memory
        reclaimer away from it (latency sandboxes are never reclaimed). ``info().qos`` says what the node gave.

        ``queue_timeout`` is how long, in seconds, the create may wait on a node that is full for room (creates
        wait in the order they came; a sandbox that ends or sleeps makes room); 0 refuses it at once.

        The sandbox is not destroyed by garbage collection: call ``destroy()`` or use ``with``.
        """
        return Sandbox(self._c().create(_spec("Client.create", image, kind, **spec)), self)

    @takes_spec_keywords
    def create_many(self, n: int | Sequence[Mapping[str, Any]], image: str = DEFAULT_IMAGE, kind: str = DEFAULT_KIND,
                    **spec: Unpack[SpecKeywords]) -> list[Sandbox]:
        """``n`` sandboxes from one spec, created concurrently (``create_concurrency`` at a time).

        Placed over the nodes by the client's placement policy, one batch request per node, all at once; a node
        that refuses or fails has its share made on others. All or nothing: if the sandboxes cannot all be made,
        the ones made are destroyed and the error is raised. With one node, calling again with the same
        ``request_id`` returns the same sandboxes instead of making new ones.

        ``n`` may instead be a list of specs, one sandbox each (``[{"image": "task-1", "env": {...}}, ...]``: each
        a dict of :meth:`create`'s arguments), made as one pulse (equal specs share their batches); the first
        spec's ``request_id`` names the pulse. The other arguments are not used then.
        """
        check_spec_keywords("Client.create_many", spec)
        if not isinstance(n, int):
            return [Sandbox(h, self) for h in self._c().create_many(_specs(n))]
        if n < 0:
            raise InvalidArgument(f"n: must be a non-negative int, got {n!r}")
        return [Sandbox(h, self) for h in self._c().create_many(n, _spec("Client.create_many", image, kind, **spec))]

    @takes_spec_keywords
    def create_group(self, n: int | Sequence[Mapping[str, Any]], image: str = DEFAULT_IMAGE, kind: str = DEFAULT_KIND,
                     *, lease: float = 30.0, **spec: Unpack[SpecKeywords]) -> SandboxGroup:
        """``n`` sandboxes as one :class:`SandboxGroup` under a lease of ``lease`` seconds.

        Placed over the nodes by the client's placement policy and sent as one batch request per node, all at once;
        a node that refuses or fails has its share made on others. All or nothing. The lease is renewed in the
        background; when this process dies, the agents destroy the group's sandboxes once it runs out.

        ``n`` may instead be a list of specs, one member each, as in :meth:`create_many`.
        """
        check_spec_keywords("Client.create_group", spec)
        if not isinstance(n, int):
            return SandboxGroup(self._c().create_group(_specs(n), float(lease)), self)
        if n < 0:
            raise InvalidArgument(f"n: must be a non-negative int, got {n!r}")
        native = _spec("Client.create_group", image, kind, **spec)
        return SandboxGroup(self._c().create_group(n, native, float(lease)), self)

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
                kw: dict[str, Any] = dict(c)
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

    def nodes(self) -> builtins.list[NodeInfo]:
        """Each node's capacity, load, backends and images."""
        return self._c().nodes()

    def images(self) -> builtins.list[ImageInfo]:
        """The images in this client's stores (``stores``; with an embedded agent and none given, the agent's
        ``<home>/store``), as ``dsec image ls`` lists them: ``reference`` ("name:tag"), ``digest``, ``layers``
        (each with ``role``, ``digest``, ``size``, ``stored_size``), ``size``, ``created_at``, ``source`` and the
        ``store`` that holds it. Raises :class:`FailedPrecondition` for a client without stores (its agents
        resolve images in their own)."""
        return self._c().images()

    def remove_image(self, name: str) -> None:
        """Removes the image tag ``name`` ("name[:tag]") from every store of this client that has it, as
        ``dsec image rm`` does: running sandboxes are not touched and the blobs stay until ``dsec image gc``.
        Raises :class:`NotFound` (a ``KeyError``) when no store has it."""
        if not isinstance(name, str):
            raise InvalidArgument(f"name: expected a str such as 'repo:tag', got {type(name).__name__}")
        self._c().remove_image(name)

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
