"""dsec/_dsec.pyi against the built dsec._dsec: the stubs type-checkers and editors read must describe the module.

Every class, function, method, property and attribute the stubs declare exists in the module as the same kind of
thing (a read-only property stays read-only), the module has nothing public the stubs leave out, a class is
constructible in both or neither, and every function and method takes as many arguments as the stubs say (how many
in all, how many required) and, where the binding names its arguments (py::arg), by the same names. The module's
side of the arguments comes from the signatures pybind11 writes into the docstrings ("1. name(...)" for each overload).
A failure lists every mismatch, in both directions."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re
import types
from dataclasses import dataclass, field
from typing import Any, Optional

from dsec import _dsec

STUBS = pathlib.Path(__file__).resolve().parents[1] / "dsec" / "_dsec.pyi"

# One argument: its name and whether it has a default. A signature: its arguments after self, or None when it takes
# *args or **kwargs (any number).
Param = tuple[str, bool]
Signature = Optional[tuple[Param, ...]]


@dataclass
class Declared:
    """What the stubs declare under one name."""
    kind: str  # "class", "function", "read-only property" or "attribute" (read-write, or a constant)
    signatures: list[Signature] = field(default_factory=list)  # a function's, one per overload
    members: dict[str, Declared] = field(default_factory=dict)  # a class's


def _decorators(node: ast.FunctionDef) -> list[str]:
    return [ast.unparse(d) for d in node.decorator_list]


def _stub_signature(node: ast.FunctionDef, method: bool) -> Signature:
    a = node.args
    if a.vararg or a.kwarg:
        return None
    positional = a.posonlyargs + a.args
    if method and positional and positional[0].arg == "self":
        positional = positional[1:]
    first_default = len(positional) - len(a.defaults)
    params = [(p.arg, i >= first_default) for i, p in enumerate(positional)]
    params += [(p.arg, d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    return tuple(params)


def read_stubs(body: list[ast.stmt], in_class: bool) -> dict[str, Declared]:
    out: dict[str, Declared] = {}
    for node in body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = Declared("class", members=read_stubs(node.body, True))
        elif isinstance(node, ast.FunctionDef):
            decorators = _decorators(node)
            if "property" in decorators:
                out[node.name] = Declared("read-only property")
            elif f"{node.name}.setter" in decorators:
                out[node.name].kind = "attribute"
            else:
                out.setdefault(node.name, Declared("function")).signatures.append(_stub_signature(node, in_class))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = Declared("attribute")
        # Anything else is the stubs' own: their docstrings, and type aliases such as _Bytes.
    return out


def _split_params(text: str) -> list[str]:
    """The arguments of a pybind11 signature, split at the commas outside brackets and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text):
        if quote:
            if c == quote and text[i - 1] != "\\":
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([{<":
            depth += 1
        elif c in ")]}>":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:].strip())
    return parts


def module_signatures(name: str, function: Any) -> Optional[list[Signature]]:
    """The signatures pybind11 wrote into ``function``'s docstring (one per overload), or None without any."""
    doc = getattr(function, "__doc__", None) or ""
    numbered = "\nOverloaded function.\n" in doc
    number = r"[0-9]+\. " if numbered else ""
    pattern = re.compile(rf"^{number}{re.escape(name)}\((.*)\) -> .*$")
    lines = doc.splitlines() if numbered else doc.splitlines()[:1]
    signatures: list[Signature] = []
    for line in lines:
        m = pattern.match(line)
        if not m:
            continue
        params = []
        for text in _split_params(m.group(1)):
            if text.startswith("*"):
                params = None
                break
            param_name, _, rest = text.partition(":")
            params.append((param_name.strip(), " = " in rest))
        if params is not None and params and params[0][0] == "self":
            params = params[1:]
        signatures.append(None if params is None else tuple(params))
    return signatures or None


def _unnamed(signature: Signature) -> bool:
    """pybind11 calls the arguments a binding does not name arg0, arg1, ..."""
    return signature is not None and all(re.fullmatch(r"arg[0-9]+", name) for name, _ in signature)


def _shape(signature: Signature) -> tuple[int, int]:
    assert signature is not None
    return len(signature), sum(1 for _, has_default in signature if not has_default)


def _describe(signatures: list[Signature]) -> str:
    return " | ".join("(...)" if s is None else "(" + ", ".join(n + ("=..." if d else "") for n, d in s) + ")"
                      for s in signatures)


def compare_signatures(where: str, declared: list[Signature], function: Any, name: str) -> list[str]:
    found = module_signatures(name, function)
    if found is None or any(s is None for s in declared) or any(s is None for s in found):
        return []  # nothing to compare: no signature in the docstring, or one that takes any arguments
    mismatch = f"{where}: the stubs declare {_describe(declared)}, the module has {_describe(found)}"
    if sorted(map(_shape, declared)) != sorted(map(_shape, found)):
        return [mismatch]
    if not all(_unnamed(s) for s in found):
        named = [s for s in found if not _unnamed(s)]
        if not all(any(s == d for d in declared) for s in named):
            return [mismatch]
    return []


def _kind_in_module(owner: Any, name: str) -> str:
    value = inspect.getattr_static(owner, name)
    if inspect.isclass(value):
        return "class"
    if isinstance(value, property):
        return "attribute" if value.fset is not None else "read-only property"
    if callable(value) or callable(getattr(owner, name)):
        return "function"
    return "attribute"  # a constant: a module's __version__, an enum's member


def _constructible(cls: type) -> bool:
    """Whether the binding gave ``cls`` a constructor (py::init): one it did not has only the slot that refuses."""
    return not isinstance(vars(cls).get("__init__"), (types.WrapperDescriptorType, type(None)))


def compare(where: str, declared: dict[str, Declared], owner: Any, is_class: bool) -> list[str]:
    problems = []
    for name, d in declared.items():
        at = f"{where}.{name}"
        if not hasattr(owner, name):
            problems.append(f"{at}: declared in the stubs ({d.kind}), missing from the module")
            continue
        kind = _kind_in_module(owner, name)
        if name == "__init__" and is_class:
            if not _constructible(owner):
                problems.append(f"{at}: declared in the stubs, but the module's {where} has no constructor")
            else:
                problems += compare_signatures(at, d.signatures, getattr(owner, name), name)
        elif kind != d.kind:
            problems.append(f"{at}: {d.kind} in the stubs, {kind} in the module")
        elif d.kind == "class":
            problems += compare(at, d.members, getattr(owner, name), True)
        elif d.kind == "function":
            problems += compare_signatures(at, d.signatures, getattr(owner, name), name)
    public = [n for n in (vars(owner) if is_class else dir(owner)) if not n.startswith("_")]
    if is_class and _constructible(owner):
        public.append("__init__")
    for name in public:
        if name not in declared:
            problems.append(f"{where}.{name}: in the module ({_kind_in_module(owner, name)}), missing from the stubs")
    return problems


def stub_mismatches() -> list[str]:
    return compare("_dsec", read_stubs(ast.parse(STUBS.read_text()).body, False), _dsec, False)


def test_the_stubs_describe_the_module():
    problems = stub_mismatches()
    assert not problems, f"{STUBS} and {_dsec.__file__} disagree:\n  " + "\n  ".join(problems)


def test_each_kind_of_mismatch_is_reported():
    """Stubs that say too much, too little or something else: a class, a method and a property the module lacks, a
    class and a method the stubs lack, a read-write attribute declared read-only, a constructor too many and one too
    few, an argument too many, a renamed one."""
    declared = read_stubs(ast.parse(STUBS.read_text()).body, False)
    declared["NoSuchClass"] = Declared("class")
    sandbox = declared["Sandbox"].members
    sandbox["no_such_method"] = Declared("function", [()])
    sandbox["no_such_property"] = Declared("read-only property")
    del declared["SessionInfo"]
    del sandbox["read_file"]
    declared["Resources"].members["cpu"] = Declared("read-only property")
    declared["ExecResult"].members["__init__"] = Declared("function", [()])
    del declared["NetworkRule"].members["__init__"]
    declared["parse_size"] = Declared("function", [(("text", False), ("base", True))])
    sandbox["session"] = Declared("function", [(("session_name", False),)])
    problems = compare("_dsec", declared, _dsec, False)
    expected = [
        "_dsec.NoSuchClass: declared in the stubs (class), missing from the module",
        "_dsec.Sandbox.no_such_method: declared in the stubs (function), missing from the module",
        "_dsec.Sandbox.no_such_property: declared in the stubs (read-only property), missing from the module",
        "_dsec.SessionInfo: in the module (class), missing from the stubs",
        "_dsec.Sandbox.read_file: in the module (function), missing from the stubs",
        "_dsec.Resources.cpu: read-only property in the stubs, attribute in the module",
        "_dsec.ExecResult.__init__: declared in the stubs, but the module's _dsec.ExecResult has no constructor",
        "_dsec.NetworkRule.__init__: in the module (function), missing from the stubs",
    ]
    for line in expected:
        assert line in problems, (line, problems)
    assert any(p.startswith("_dsec.parse_size: the stubs declare (text, base=...)") for p in problems), problems
    assert any(p.startswith("_dsec.Sandbox.session: the stubs declare (session_name)") for p in problems), problems
