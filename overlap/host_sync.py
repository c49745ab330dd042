"""Steps that must not read the device on the host: a scope that says so, and a counter that checks it.

A host sync is the host waiting for the device: reading a tensor's values (``.item()``, ``.tolist()``,
``bool(t)``, ``int(t)``, ``.numpy()``), an operator whose output shape depends on the values
(``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing, ``repeat_interleave`` with tensor
repeats and no ``output_size``), or a synchronize (an event's, a stream's, the device's,
`overlap.synchronize`). A step with one cannot be captured as a graph, and in eager mode it stalls the
host until the device has caught up, so the host no longer runs ahead.

`no_host_sync` marks a step that must have none (a decode step, a captured step): inside it
`host_reads_allowed` is False, and the toolkit's own checks that read values (expert ids in range,
token ids in the vocabulary, a group list that fits) are skipped as they are while compiling; the
values come from the step's own device work. `HostSyncs` counts the host syncs made while it is
active, each with the caller's file and line and whether it came inside a `no_host_sync` scope
(``inside``): the test that a decode step has none, and a tool to find where one hides.

Not counted: copies from the host to the device, and the CPU path's stand-in for a stream waiting on a
collective (its handle's ``wait``; on a device that is a stream wait, which the host does not block on).
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

_LOCAL = threading.local()  # the open no_host_sync scopes' labels on this thread
_COUNTING = threading.Lock()  # one HostSyncs patches torch at a time


@contextlib.contextmanager
def no_host_sync(label: str = "step") -> Iterator[None]:
    """A scope whose work must not read the device on the host (see the module docstring)."""
    scopes = _LOCAL.__dict__.setdefault("scopes", [])
    scopes.append(label)
    try:
        yield
    finally:
        scopes.pop()


def host_reads_allowed() -> bool:
    """Whether a check may read tensor values on the host here: not while compiling, not in `no_host_sync`."""
    return not torch.compiler.is_compiling() and not getattr(_LOCAL, "scopes", None)


def _scope() -> Optional[str]:
    scopes = getattr(_LOCAL, "scopes", None)
    return scopes[-1] if scopes else None


@dataclasses.dataclass(frozen=True)
class HostSync:
    """One host sync: what (``"Tensor.item"``...), where (``file:line`` of the first caller outside torch), and
    the label of the `no_host_sync` scope it came in (None: outside every one)."""

    what: str
    where: str
    scope: Optional[str]

    @property
    def inside(self) -> bool:
        return self.scope is not None

    def __str__(self) -> str:
        return f"{self.what} at {self.where}" + (f" (in {self.scope})" if self.scope else "")


def _caller() -> str:
    here = __file__
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename != here and f"{'/'}torch{'/'}" not in frame.filename.replace("\\", "/"):
            return f"{frame.filename}:{frame.lineno}"
    return "?"


def _bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _tensor_repeats(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
    return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None


_ALWAYS: Callable[..., bool] = lambda *a, **k: True  # noqa: E731

# (owner, attribute, when it syncs given the call's arguments)
_TENSOR_METHODS = [(name, _ALWAYS) for name in (
    "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere",
    "masked_select", "unique")] + [
    ("__getitem__", lambda self, index, *a, **k: _bool_index(index)),
    ("__setitem__", lambda self, index, *a, **k: _bool_index(index)),
    ("repeat_interleave", lambda self, *a, **k: _tensor_repeats((self,) + a, k)),
]
_TORCH_FUNCTIONS = [(name, _ALWAYS) for name in ("nonzero", "argwhere", "masked_select", "unique")] + [
    ("repeat_interleave", lambda *a, **k: _tensor_repeats(a, k))]


def _synchronizers() -> List[Tuple[Any, str]]:
    """Every ``synchronize`` there is to patch here: the toolkit's, torch's events, streams and devices."""
    import overlap

    from . import events, streams

    found: List[Tuple[Any, str]] = [(overlap, "synchronize"), (streams, "synchronize"), (events.Event, "synchronize")]
    for owner in (getattr(torch, "Event", None), getattr(torch, "Stream", None)):
        if owner is not None:
            found.append((owner, "synchronize"))
    for module in (torch.cuda, sys.modules.get("torch.npu")):
        if module is None:
            continue
        found += [(module, "synchronize")] + [(getattr(module, c), "synchronize") for c in ("Event", "Stream")
                                              if hasattr(getattr(module, c, None), "synchronize")]
    return found


class HostSyncs:
    """Count host syncs while active (``with HostSyncs() as syncs: ...``; ``syncs.found`` lists them).

    Patches torch's value-reading methods and the synchronizes for the duration (any thread counts), so use it
    in tests and diagnosis, not in a timed run.
    """

    def __init__(self) -> None:
        self.found: List[HostSync] = []
        self._saved: List[Tuple[Any, str, Any]] = []
        self._lock = threading.Lock()
        self._busy = threading.local()  # inside a counted call on this thread: the calls it makes are not counted

    def inside(self, scope: Optional[str] = None) -> List[HostSync]:
        """The syncs made inside `no_host_sync` scopes (only those labelled ``scope``, if given)."""
        return [s for s in self.found if s.inside and (scope is None or s.scope == scope)]

    def _record(self, what: str) -> None:
        with self._lock:
            self.found.append(HostSync(what, _caller(), _scope()))

    def _patch(self, owner: Any, name: str, when: Callable[..., bool], label: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        record, busy = self._record, self._busy

        def counted(*args: Any, **kwargs: Any) -> Any:
            if getattr(busy, "on", False) or not when(*args, **kwargs):
                return original(*args, **kwargs)
            busy.on = True  # what this sync calls (overlap.synchronize: the device's) is part of it, not another
            try:
                record(label)
                return original(*args, **kwargs)
            finally:
                busy.on = False

        own = name in vars(owner)  # else inherited (a C base's method): removed again on exit, not set
        try:
            setattr(owner, name, counted)
        except (TypeError, AttributeError):  # an immutable C type (torch.Event): its wrappers in Python are patched
            return
        self._saved.append((owner, name, original if own else None))

    def __enter__(self) -> "HostSyncs":
        if not _COUNTING.acquire(timeout=60):
            raise RuntimeError("another HostSyncs is counting in this process")
        try:
            for name, when in _TENSOR_METHODS:
                self._patch(torch.Tensor, name, when, f"Tensor.{name}")
            for name, when in _TORCH_FUNCTIONS:
                self._patch(torch, name, when, f"torch.{name}")
            for owner, name in _synchronizers():
                what = getattr(owner, "__name__", type(owner).__name__)
                self._patch(owner, name, _ALWAYS, f"{what}.{name}")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._saved.clear()
        _COUNTING.release()


__all__ = ["HostSync", "HostSyncs", "host_reads_allowed", "no_host_sync"]
