"""Checking a caller's arguments and building the native spec and policy objects from them (sizes, maps, a
sandbox's spec, its network policy, a user)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

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
    display: str = "",
    priority: str = "standard",
    ksm: bool = False,
    reclaim: bool = True,
    queue_timeout: float = 0,
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
    if priority not in ("latency", "standard", "batch"):
        raise InvalidArgument(f"priority: expected 'latency', 'standard' or 'batch', got {priority!r}")
    r.priority = priority
    for field, value in (("ksm", ksm), ("reclaim", reclaim)):
        if not isinstance(value, bool):
            raise InvalidArgument(f"{field}: expected True or False, got {value!r}")
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
    if not isinstance(display, str):
        raise InvalidArgument(f"display: expected \"WIDTHxHEIGHT\" or \"none\", got {display!r}")
    s.display = display
    if isinstance(queue_timeout, bool) or not isinstance(queue_timeout, (int, float)) or not 0 <= queue_timeout <= 3600:
        raise InvalidArgument(f"queue_timeout: expected seconds from 0 to 3600, got {queue_timeout!r}")
    s.queue_timeout = float(queue_timeout)
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
