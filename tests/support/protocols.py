"""Does an object implement a `typing.Protocol`: every member there, each method callable as the Protocol's is.

``isinstance`` with a ``runtime_checkable`` Protocol checks names only: a method that takes other
arguments, or a data member that is a method, passes it. `protocol_problems` checks each member:

- a method of the Protocol must be a callable of the object whose signature accepts every call
  the Protocol's accepts (`signature_problems`): the same positional parameters in order, each
  keyword the Protocol names (or ``**kwargs``), an optional parameter where the Protocol's is
  optional, ``*args`` / ``**kwargs`` where the Protocol has them, and no further required
  parameter. Annotations are not compared (the implementations name their own classes);
- a property or data member must be there and not be a method; where the Protocol's annotation
  is a class (or an Optional / Union of classes) the value must be an instance of it; where it is
  another Protocol (or a sequence of one), the value (each element) is checked the same way.

Shared by the tests of the model contract (`microbatch.model`) and of the dispatch handles
(`collectives.handles`); not a test file itself.
"""
import collections.abc
import inspect
import typing
from typing import Callable, Dict, List, Protocol

_PROTOCOL_INTERNALS = {"__init__", "__subclasshook__", "__class_getitem__", "__init_subclass__", "__parameters__",
                       "__protocol_attrs__", "__non_callable_proto_members__", "__annotations__", "__dict__",
                       "__weakref__", "__doc__", "__module__", "__qualname__", "__abstractmethods__", "__slots__",
                       "__orig_bases__", "__type_params__", "__static_attributes__", "__firstlineno__"}


def protocol_members(proto: type) -> Dict[str, str]:
    """The members a Protocol declares, its bases' included: name -> ``"method"``, ``"property"`` or ``"data"``."""
    members: Dict[str, str] = {}
    for cls in reversed(proto.__mro__):
        if cls is object or cls is Protocol or getattr(cls, "_is_protocol", False) is False:
            continue
        for name in vars(cls).get("__annotations__", {}):
            members[name] = "data"
        for name, value in vars(cls).items():
            if name in _PROTOCOL_INTERNALS or name.startswith("_abc") or name.startswith("_is_"):
                continue
            if isinstance(value, property):
                members[name] = "property"
            elif inspect.isfunction(value):
                members[name] = "method"
    return members


def _accepts_keyword(params: List[inspect.Parameter], name: str) -> bool:
    return any(p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params) or \
        any(p.kind == p.VAR_KEYWORD for p in params)


def signature_problems(impl: Callable, proto: Callable, what: str) -> List[str]:
    """Why ``impl`` (bound, or a function without ``self``) cannot be called as ``proto`` (a Protocol's
    function, ``self`` first), in words; empty when every call ``proto`` accepts, ``impl`` accepts."""
    try:
        have = list(inspect.signature(impl).parameters.values())
    except (TypeError, ValueError):
        return [f"{what}: its signature cannot be read"]
    want = list(inspect.signature(proto).parameters.values())[1:]  # without self
    problems = []
    positional = [p for p in have if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind == p.VAR_POSITIONAL for p in have)
    var_kw = any(p.kind == p.VAR_KEYWORD for p in have)
    matched = set()
    for i, w in enumerate(p for p in want if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)):
        h = positional[i] if i < len(positional) else None
        if h is None and not var_pos:
            problems.append(f"{what}: takes no positional parameter {i + 1} ({w.name})")
            continue
        if h is not None:
            matched.add(h.name)
            if w.kind == w.POSITIONAL_OR_KEYWORD and h.name != w.name and not var_kw:
                problems.append(f"{what}: parameter {i + 1} is {h.name!r}, not {w.name!r} (a call by keyword fails)")
            if w.default is not w.empty and h.default is h.empty:
                problems.append(f"{what}: {h.name!r} is required, but optional in the protocol")
    for w in want:
        if w.kind == w.KEYWORD_ONLY:
            if not _accepts_keyword(have, w.name):
                problems.append(f"{what}: takes no keyword {w.name!r}")
            else:
                h = next((p for p in have if p.name == w.name), None)
                if h is not None:
                    matched.add(h.name)
                    if w.default is not w.empty and h.default is h.empty:
                        problems.append(f"{what}: {h.name!r} is required, but optional in the protocol")
        elif w.kind == w.VAR_POSITIONAL and not var_pos:
            problems.append(f"{what}: takes no *{w.name}")
        elif w.kind == w.VAR_KEYWORD and not var_kw:
            problems.append(f"{what}: takes no **{w.name}")
    extra = [p.name for p in have if p.name not in matched and p.default is p.empty
             and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if extra:
        problems.append(f"{what}: requires {extra}, which the protocol does not pass")
    return problems


def _is_protocol(hint: object) -> bool:
    return isinstance(hint, type) and bool(getattr(hint, "_is_protocol", False))


def _value_problems(value: object, hint: object, what: str) -> List[str]:
    """Whether a data member's ``value`` is what its annotation ``hint`` says (see the module docstring)."""
    if _is_protocol(hint):
        return protocol_problems(value, hint, what)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (collections.abc.Sequence, list, tuple) and args and _is_protocol(args[0]):
        try:
            items = list(value)
        except TypeError:
            return [f"{what}: not a sequence"]
        return [p for i, item in enumerate(items) for p in protocol_problems(item, args[0], f"{what}[{i}]")]
    classes = args if origin is typing.Union else (hint,)
    if classes and all(isinstance(c, type) for c in classes) and not isinstance(value, classes):
        kind = type(value).__name__
        return [f"{what}: {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not {' or '.join(c.__name__ for c in classes)}"]
    return []


def protocol_problems(obj: object, proto: type, name: str = "") -> List[str]:
    """What ``obj`` lacks of ``proto``, one line per member (empty: it implements it); see the module docstring.
    ``name`` names ``obj`` in the lines (its class by default)."""
    name = name or type(obj).__name__
    hints = typing.get_type_hints(proto)
    problems = []
    for member, kind in sorted(protocol_members(proto).items()):
        what = f"{name}.{member}"
        try:
            value = getattr(obj, member)
        except AttributeError:
            problems.append(f"{what}: missing ({proto.__name__} has this {kind})")
            continue
        if kind == "method":
            if not callable(value):
                problems.append(f"{what}: not callable ({proto.__name__} has this method)")
            else:
                problems += signature_problems(value, getattr(proto, member), what)
        elif inspect.ismethod(value):
            problems.append(f"{what}: a method, but {proto.__name__} has this {kind}")
        elif kind == "data" and member in hints:
            problems += _value_problems(value, hints[member], what)
    return problems


class Without:
    """``obj`` with one member gone (every other attribute read through): what a model that lacks it looks like
    to `protocol_problems`, for the tests that show the check fails on a member removed."""

    def __init__(self, obj: object, member: str) -> None:
        self._obj, self._member = obj, member

    def __getattr__(self, name: str) -> object:
        if name == self._member:
            raise AttributeError(name)
        return getattr(self._obj, name)
