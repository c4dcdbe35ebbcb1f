"""The sandboxes of one pulse under a lease (:class:`SandboxGroup`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Iterator, Mapping, Sequence, TypeVar, Union, overload

from . import _dsec
from .errors import InvalidArgument
from ._spec import _field_size, _network_dict, _network_policy, _policy_of, _str_map, _user
from ._types import ExecResult, Size, SleepResult
from .sandbox import Sandbox, Snapshot

if TYPE_CHECKING:  # annotations only: the client module imports this one
    from .client import Client


_Member = TypeVar("_Member")


class _Members(Generic[_Member]):
    """A group as a list of its members (SandboxGroup's :class:`Sandbox`, AsyncSandboxGroup's
    :class:`AsyncSandbox`): ``len``, iteration and indexing over ``_members``."""

    __slots__ = ()
    _members: list[_Member]

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self) -> Iterator[_Member]:
        return iter(self._members)

    @overload
    def __getitem__(self, i: int) -> _Member: ...

    @overload
    def __getitem__(self, i: slice) -> list[_Member]: ...

    def __getitem__(self, i: Union[int, slice]) -> Union[_Member, list[_Member]]:
        return self._members[i]


class SandboxGroup(_Members[Sandbox]):
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
