"""Checking a caller's arguments and building the native spec and policy objects from them (sizes, maps, a
sandbox's spec from its keywords, its network policy, a user). The spec keywords, with their types and defaults, are
defined once here (:class:`SpecKeywords`) for every create call of the sync and asyncio clients."""

from __future__ import annotations

import inspect
from typing import Annotated, Any, Callable, Mapping, Optional, Sequence, TypedDict, TypeVar, Union, get_type_hints

from . import _dsec
from .errors import InvalidArgument
from ._types import Size


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


DEFAULT_IMAGE = "busybox"
DEFAULT_KIND = "container"


class SpecKeywords(TypedDict, total=False):
    """A sandbox's spec besides its image and kind: each keyword with its type, Annotated with its default.

    :meth:`Client.create`, ``create_many`` and ``create_group`` (and :class:`AsyncClient`'s) take these as keyword
    arguments, and a list of specs as the keys of its dicts (with ``image`` and ``kind``); :meth:`Client.create` says
    what each means. The types are spelled for Python 3.9 (no ``X | Y``): they are evaluated at import.
    """

    cpu: Annotated[float, 1.0]
    memory: Annotated[Size, "512Mi"]
    disk: Annotated[Size, "1Gi"]
    pids: Annotated[int, 512]
    open_files: Annotated[int, 4096]
    ttl: Annotated[float, 3600]
    env: Annotated[Optional[Mapping[str, str]], None]
    labels: Annotated[Optional[Mapping[str, str]], None]
    tenant: Annotated[str, ""]
    hostname: Annotated[str, ""]
    workdir: Annotated[str, ""]
    allow_ptrace: Annotated[bool, False]
    request_id: Annotated[Optional[str], None]
    node_selector: Annotated[Optional[Mapping[str, str]], None]
    anti_affinity: Annotated[str, ""]
    gpus: Annotated[int, 0]
    user: Annotated[Union[str, int, None], None]
    protected_paths: Annotated[Optional[Sequence[str]], None]
    network: Annotated[Union[str, Mapping[str, Any], None], None]
    egress_mbps: Annotated[int, 0]
    connections: Annotated[int, 0]
    display: Annotated[str, ""]
    priority: Annotated[str, "standard"]
    ksm: Annotated[bool, False]
    reclaim: Annotated[bool, True]
    queue_timeout: Annotated[float, 0]


SPEC_DEFAULTS: dict[str, Any] = {
    name: hint.__metadata__[0] for name, hint in get_type_hints(SpecKeywords, include_extras=True).items()}

_SPEC_PARAMETERS = [
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=SPEC_DEFAULTS[name],
                      annotation=inspect.formatannotation(hint))
    for name, hint in get_type_hints(SpecKeywords).items()]

_Method = TypeVar("_Method", bound=Callable[..., Any])


def takes_spec_keywords(method: _Method) -> _Method:
    """Shows the spec keywords (:class:`SpecKeywords`, with their defaults) in the signature of ``method`` in place of
    its ``**spec``, for help(), inspect and editors that read signatures at run time."""
    signature = inspect.signature(method)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    setattr(method, "__signature__", signature.replace(parameters=own + _SPEC_PARAMETERS))
    return method


def check_spec_keywords(caller: str, keywords: Mapping[str, Any]) -> None:
    """Raises TypeError for a keyword that is not a spec keyword, as Python would for ``caller``'s own."""
    for name in keywords:
        if name not in SPEC_DEFAULTS:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")


def _spec(caller: str, image: str, kind: str, **keywords: Any) -> _dsec.SandboxSpec:
    """The native spec of ``image``, ``kind`` and spec keywords by name (:class:`SpecKeywords`; those not given take
    their defaults). Raises TypeError for a keyword that is not one (:func:`check_spec_keywords`).

    Checked here: what the native fields cannot hold (types, negative counts) and the shapes of maps, lists, ``user``
    and ``network``. Ranges and formats are the client library's to check (dsec::protocol::validate, when the spec
    is sent; the ttl and queue_timeout fields check theirs when set), raising :class:`InvalidArgument` naming the
    field. The exceptions: ``pids`` and ``open_files`` of at least 1 (so that a list of specs names the spec that
    has 0) and ``priority`` (its native field raises a plain ValueError).
    """
    check_spec_keywords(caller, keywords)
    k = {**SPEC_DEFAULTS, **keywords}
    s = _dsec.SandboxSpec()
    s.image = image
    s.kind = kind
    r = _dsec.Resources()
    cpu = k["cpu"]
    if isinstance(cpu, bool) or not isinstance(cpu, (int, float)):
        raise InvalidArgument(f"resources.cpu: expected a number of cores, got {cpu!r}")
    r.cpu = float(cpu)
    r.memory_bytes = _field_size(k["memory"], "resources.memory")
    r.disk_bytes = _field_size(k["disk"], "resources.disk")
    for field in ("pids", "open_files"):
        value = k[field]
        if not isinstance(value, int) or value < 1:
            raise InvalidArgument(f"resources.{field}: must be a positive int, got {value!r}")
        setattr(r, field, value)
    gpus = k["gpus"]
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
        raise InvalidArgument(f"resources.gpus: must be a non-negative int, got {gpus!r}")
    r.gpus = gpus
    for field in ("egress_mbps", "connections"):
        value = k[field]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidArgument(f"resources.{field}: must be a non-negative int (0: unlimited), got {value!r}")
        setattr(r, field, value)
    priority = k["priority"]
    if priority not in ("latency", "standard", "batch"):
        raise InvalidArgument(f"priority: expected 'latency', 'standard' or 'batch', got {priority!r}")
    r.priority = priority
    for field in ("ksm", "reclaim"):
        value = k[field]
        if not isinstance(value, bool):
            raise InvalidArgument(f"{field}: expected True or False, got {value!r}")
        setattr(r, field, value)
    s.resources = r
    ttl = k["ttl"]
    if ttl is None:
        raise InvalidArgument("ttl: expected seconds (0 = no TTL), got None")
    s.ttl = ttl  # the field refuses a negative ttl (InvalidArgument)
    s.env = _str_map(k["env"], "env")
    s.labels = _str_map(k["labels"], "labels")
    s.tenant = k["tenant"]
    s.hostname = k["hostname"]
    s.workdir = k["workdir"]
    s.allow_ptrace = bool(k["allow_ptrace"])
    s.request_id = k["request_id"] or ""
    s.node_selector = _str_map(k["node_selector"], "node_selector")
    s.anti_affinity = k["anti_affinity"] or ""
    s.user = _user(k["user"])
    protected_paths = k["protected_paths"]
    if protected_paths is not None:
        if isinstance(protected_paths, (str, bytes)) or not all(isinstance(p, str) for p in protected_paths):
            raise InvalidArgument(f"protected_paths: expected a list of absolute paths (str), got {protected_paths!r}")
        s.protected_paths = list(protected_paths)
    network = k["network"]
    if network is not None:
        s.network = _network_policy(network)
    display = k["display"]
    if not isinstance(display, str):
        raise InvalidArgument(f"display: expected \"WIDTHxHEIGHT\" or \"none\", got {display!r}")
    s.display = display
    queue_timeout = k["queue_timeout"]
    if isinstance(queue_timeout, bool) or not isinstance(queue_timeout, (int, float)):
        raise InvalidArgument(f"queue_timeout: expected seconds from 0 to 3600, got {queue_timeout!r}")
    s.queue_timeout = float(queue_timeout)  # the field refuses one outside 0 to 3600 (InvalidArgument)
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


def _request_id(request_id: str | None) -> str:
    """A ``request_id`` argument as the wire has it (None is "": the client makes one)."""
    if request_id is None:
        return ""
    if not isinstance(request_id, str) or not request_id or len(request_id.encode()) > 128 or "\0" in request_id:
        raise InvalidArgument(f"request_id: expected a non-empty str of at most 128 bytes, got {request_id!r}")
    return request_id
