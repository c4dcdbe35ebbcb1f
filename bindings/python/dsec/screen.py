"""A full VM's screen (``kind="vm"``, docs/vm.md): what a computer-use agent sees and does.

:class:`Sandbox` has these methods; on a sandbox without a screen (other kinds, or ``display="none"``) and while it
sleeps they raise :class:`FailedPrecondition`. Pixels are the screen's (``screen()["width"]`` x ``["height"]``);
keys are named as people and models name them ("ctrl+s", "Return", "alt+F4", "a"); text is typed on a US keyboard
layout (printable ASCII, newline, tab). Input is never retried once sent (a lost answer would press keys twice).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from . import _dsec
from .errors import InvalidArgument

_TYPES = {
    "move": _dsec.InputAction.Type.MOVE,
    "click": _dsec.InputAction.Type.CLICK,
    "scroll": _dsec.InputAction.Type.SCROLL,
    "drag": _dsec.InputAction.Type.DRAG,
    "key": _dsec.InputAction.Type.KEY,
    "type": _dsec.InputAction.Type.TYPE,
    "wait": _dsec.InputAction.Type.WAIT,
}
_FIELDS = {"x", "y", "to_x", "to_y", "button", "count", "dy", "keys", "text", "interval_ms"}


def _action(spec: Mapping[str, Any], at: str) -> _dsec.InputAction:
    if not isinstance(spec, Mapping):
        raise InvalidArgument(f"{at}: expected a dict such as {{'type': 'click', 'x': 10, 'y': 20}}, got {spec!r}")
    kind = spec.get("type")
    if kind not in _TYPES:
        raise InvalidArgument(f"{at}.type: {kind!r} is not one of {', '.join(_TYPES)}")
    unknown = set(spec) - _FIELDS - {"type"}
    if unknown:
        raise InvalidArgument(f"{at}: unknown fields {sorted(unknown)}")
    a = _dsec.InputAction()
    a.type = _TYPES[kind]
    for name, value in spec.items():
        if name == "type":
            continue
        if name in ("button", "keys", "text"):
            if not isinstance(value, str):
                raise InvalidArgument(f"{at}.{name}: expected a str, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"{at}.{name}: expected an int, got {value!r}")
        elif value < 0 and name != "dy":
            raise InvalidArgument(f"{at}.{name}: must not be negative, got {value}")
        try:
            setattr(a, name, value)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"{at}.{name}: {value!r} is out of range ({e})") from None
    return a


def _actions(actions: Sequence[Mapping[str, Any]]) -> list[_dsec.InputAction]:
    if isinstance(actions, (str, bytes, Mapping)) or not isinstance(actions, Sequence):
        raise InvalidArgument(f"actions: expected a list of dicts, got {type(actions).__name__}")
    return [_action(a, f"actions[{i}]") for i, a in enumerate(actions)]


def _point(x: Optional[int], y: Optional[int]) -> dict:
    if (x is None) != (y is None):
        raise InvalidArgument("x and y go together")
    return {} if x is None else {"x": x, "y": y}


class ScreenMethods:
    """The screen's calls of :class:`Sandbox` (``self._sb`` is the native sandbox)."""

    __slots__ = ()
    _sb: _dsec.Sandbox

    def screenshot(self) -> bytes:
        """PNG bytes of the screen now."""
        return self._sb.screenshot()

    def screen(self) -> dict:
        """{"width", "height", "cursor": (x, y) or None}: the screen's size as the guest draws it, and where the
        pointer was last put (None before the first pointer action: QEMU cannot read the guest's cursor)."""
        return self._sb.screen()

    def cursor(self) -> Optional[tuple[int, int]]:
        """Where the pointer was last put, or None."""
        return self._sb.screen()["cursor"]

    def input(self, actions: Sequence[Mapping[str, Any]]) -> dict:
        """Sends actions in order, each a dict: {"type": "move", "x", "y"}, {"type": "click", "x", "y", "button",
        "count"}, {"type": "scroll", "dy", "x", "y"}, {"type": "drag", "x", "y", "to_x", "to_y", "button"},
        {"type": "key", "keys": "ctrl+s"}, {"type": "type", "text", "interval_ms"}, {"type": "wait",
        "interval_ms"}. Answers :meth:`screen`'s dict after them. A failing action ends the call (the error names
        it; those before it took effect)."""
        return self._sb.input(_actions(actions))

    def mouse_move(self, x: int, y: int) -> dict:
        return self.input([{"type": "move", "x": x, "y": y}])

    def click(self, x: Optional[int] = None, y: Optional[int] = None, button: str = "left",
              double: bool = False) -> dict:
        """Clicks ``button`` at (x, y), or where the pointer is when they are not given; ``double`` clicks twice."""
        return self.input([{"type": "click", **_point(x, y), "button": button, "count": 2 if double else 1}])

    def double_click(self, x: Optional[int] = None, y: Optional[int] = None) -> dict:
        return self.click(x, y, double=True)

    def right_click(self, x: Optional[int] = None, y: Optional[int] = None) -> dict:
        return self.click(x, y, button="right")

    def scroll(self, dy: int, x: Optional[int] = None, y: Optional[int] = None) -> dict:
        """Turns the wheel ``dy`` notches (negative: up), at (x, y) when given."""
        return self.input([{"type": "scroll", "dy": dy, **_point(x, y)}])

    def drag(self, x: int, y: int, to_x: int, to_y: int, button: str = "left") -> dict:
        """Presses ``button`` at (x, y), moves to (to_x, to_y) in steps, releases it there."""
        return self.input([{"type": "drag", "x": x, "y": y, "to_x": to_x, "to_y": to_y, "button": button}])

    def key(self, keys: str) -> dict:
        """Presses a key combination: "ctrl+s", "Return", "alt+F4", "ctrl+shift+t"."""
        return self.input([{"type": "key", "keys": keys}])

    def vnc(self) -> str:
        """A VNC endpoint, ``"host:port"`` on the sandbox's node, for a person to watch the screen (a VNC viewer
        there drives it too). The same one while it lasts. A viewer gives its password: see vnc_endpoint()."""
        return self._sb.vnc()

    def vnc_endpoint(self) -> tuple[str, str]:
        """The VNC endpoint and its password, ``("host:port", password)``: a viewer must give the password (VNC
        authentication; 8 characters, new for each endpoint)."""
        return self._sb.vnc_endpoint()

    def stop_vnc(self) -> None:
        """Ends the VNC endpoint (viewers connected stay until they close)."""
        self._sb.stop_vnc()

    def type_text(self, text: str, interval_ms: int = 0) -> dict:
        """Types ``text`` a character every ``interval_ms`` (0: the agent's pace, 30 ms)."""
        return self.input([{"type": "type", "text": text, "interval_ms": interval_ms}])
