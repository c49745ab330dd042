"""Observer hooks: how the timeline and the sanitizer see what the primitives launch.

Every launch through the toolkit's primitives becomes a `Span`. Inline work (compute on the
host thread, or any work on a device stream) starts and ends on the launching thread;
asynchronous CPU work (a collective on gloo's threads, a copy on a copy thread) ends on the
thread that completes it, so `on_span_end` may be called from another thread.
Event records and waits and host synchronisation are reported too, so that a happens-before
checker can follow the ordering edges. With no observer installed every call is a cheap no-op.

A profiler (``torch.profiler``, torch_npu's) sees the executor's launches by name: while one records
(`profiling`), each launch runs inside a ``record_function`` range named by `launch_name`
(``overlap:mb1.L3.dispatch@ep_comm``), which `parse_launch_name` reads back from a trace.
"""
from __future__ import annotations

import contextvars
import dataclasses
import itertools
import re
import time
from typing import Any, ContextManager, Dict, NamedTuple, Optional, Sequence

import torch

from .context import current_stream_tag
from .state import STATE

_ids = itertools.count()
# Meta of the enclosing `span` blocks (mb, layer, ...), inherited by the launches inside them.
_context_meta: contextvars.ContextVar[Dict[str, Any]] = contextvars.ContextVar("overlap_span_meta", default={})


@dataclasses.dataclass
class Span:
    """One launch: where it ran, what it was, when it started and ended (host seconds)."""

    name: str
    stream: str
    kind: str  # "compute", "comm", "copy" or "issue" (overlap.observability._intervals.KINDS)
    rank: int = 0
    start: float = 0.0
    end: Optional[float] = None
    meta: Dict[str, Any] = dataclasses.field(default_factory=dict)
    reads: Sequence[torch.Tensor] = ()
    writes: Sequence[torch.Tensor] = ()
    asynchronous: bool = False
    id: int = dataclasses.field(default_factory=lambda: next(_ids))


def add_observer(observer: Any) -> None:
    """Install an observer; it may define any of the ``on_*`` methods called below."""
    with STATE.lock:
        if observer not in STATE.observers:
            STATE.observers = STATE.observers + [observer]  # copy on write: readers iterate without the lock


def remove_observer(observer: Any) -> None:
    with STATE.lock:
        if observer in STATE.observers:
            STATE.observers = [o for o in STATE.observers if o is not observer]


def active() -> bool:
    """Whether any observer is installed (without one, every hook is a no-op)."""
    return bool(STATE.observers)


def _notify(method: str, *args: Any) -> None:
    for obs in STATE.observers:
        fn = getattr(obs, method, None)
        if fn is not None:
            fn(*args)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def start_span(name: str, stream: str, kind: str, *, reads: Sequence[torch.Tensor] = (),
               writes: Sequence[torch.Tensor] = (), asynchronous: bool = False,
               meta: Optional[Dict[str, Any]] = None) -> Optional[Span]:
    """Open a span and tell the observers; None when nobody observes."""
    if not STATE.observers:
        return None
    span = Span(name=name, stream=stream, kind=kind, rank=_rank(), start=time.perf_counter(),
                meta={**_context_meta.get(), **(meta or {})}, reads=tuple(reads), writes=tuple(writes),
                asynchronous=asynchronous)
    _notify("on_span_start", span)
    return span


def end_span(span: Optional[Span], end: Optional[float] = None) -> None:
    """Close a span (possibly from a completion thread) at ``end`` (default: now) and tell the observers."""
    if span is None:
        return
    span.end = time.perf_counter() if end is None else end
    _notify("on_span_end", span)


class _SpanBlock:
    """The block of `span`: a class rather than a generator, as it wraps every observed launch."""

    __slots__ = ("name", "kind", "meta", "span", "token")

    def __init__(self, name: str, kind: str, meta: Dict[str, Any]):
        self.name, self.kind, self.meta = name, kind, meta
        self.span: Optional[Span] = None
        self.token: Any = None

    def __enter__(self) -> Optional[Span]:
        if not STATE.observers:
            return None
        self.span = start_span(self.name, current_stream_tag(), self.kind, meta=self.meta)
        self.token = _context_meta.set({**_context_meta.get(), **self.meta})
        return self.span

    def __exit__(self, *exc: Any) -> None:
        if self.token is not None:
            _context_meta.reset(self.token)
            end_span(self.span)


def span(name: str, kind: str = "compute", **meta: Any) -> ContextManager[Optional[Span]]:
    """Mark a block of inline work on the current stream, e.g. ``with span("attn", mb=0, layer=3)``."""
    return _SpanBlock(name, kind, meta)


def event_recorded(event_name: str, stream: str) -> None:
    if STATE.observers:
        _notify("on_event_record", event_name, stream)


def event_waited(event_name: str, stream: str) -> None:
    if STATE.observers:
        _notify("on_event_wait", event_name, stream)


def synchronized() -> None:
    """The host waited for all work on all streams."""
    if STATE.observers:
        _notify("on_synchronize")


def event_synchronized(event_name: str) -> None:
    """The host waited for one event; observers without ``on_event_synchronize`` see a full synchronisation."""
    for obs in STATE.observers:
        fn = getattr(obs, "on_event_synchronize", None)
        if fn is not None:
            fn(event_name)
        elif getattr(obs, "on_synchronize", None) is not None:
            obs.on_synchronize()


# --- the launches as a profiler sees them -------------------------------------------------------------------
PROFILER_PREFIX = "overlap:"
_LAUNCH_NAME = re.compile(r"overlap:mb(?P<mb>\d+)\.L(?P<layer>\d+)\.(?P<op>[^@]+)@(?P<stream>[^@ ]+)"
                          r"(?: \((?P<kind>\w+)\))?")


class LaunchName(NamedTuple):
    """What a launch's profiler name says: micro-batch, layer, operation, stream, and the kind of its span."""

    mb: int
    layer: int
    op: str
    stream: str
    kind: str  # "compute", or "issue": the host's time issuing a communication stream's operation


def profiling() -> bool:
    """Whether a profiler records this thread's operators: ``torch.profiler``, or torch_npu's, which registers
    its state as torch's (``torch.autograd._profiler_enabled()``, a C++ flag, read once per run)."""
    return torch.autograd._profiler_enabled()


def launch_name(op: str, mb: int, layer: int, stream: str, kind: str = "compute") -> str:
    """A launch's name in a profiler: ``overlap:mb1.L3.experts@default``; a span kind other than compute follows
    in brackets: ``overlap:mb1.L3.dispatch@ep_comm (issue)``."""
    name = f"{PROFILER_PREFIX}mb{mb}.L{layer}.{op}@{stream}"
    return name if kind == "compute" else f"{name} ({kind})"


def parse_launch_name(name: str) -> Optional[LaunchName]:
    """The fields of a `launch_name`; None for any other name."""
    m = _LAUNCH_NAME.fullmatch(name)
    if m is None:
        return None
    return LaunchName(int(m["mb"]), int(m["layer"]), m["op"], m["stream"], m["kind"] or "compute")


def profiler_range(name: str) -> ContextManager[Any]:
    """A ``record_function`` range named ``name``: what a profiler shows (costs microseconds: only while
    `profiling`)."""
    return torch.autograd.profiler.record_function(name)
