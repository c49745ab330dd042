"""Events named by tags: ordering edges between streams on every path.

`event(tag)` returns the one event of that name (torchair's tagged events are unique per
process, so events are created once and reused across layers). ``ev.record(*guarded)`` records
on the current stream; ``ev.wait(*consumers)`` makes the current stream wait for it and returns
the consumers. On ``ge``, which has no events, the edge becomes ``npu_wait_tensor(consumer,
guarded)`` for each pair, so callers must use the returned tensors.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from . import backends, hooks
from .context import current_stream_tag, is_enabled
from .state import STATE


class Event:
    """An ordering edge between streams; see the module docstring."""

    def __init__(self, tag: str):
        self.tag = tag
        self.guarded: Tuple[torch.Tensor, ...] = ()  # the tensors the last record protects (ge)
        self.payload: Dict[str, Any] = {}  # per backend: what its last record left (CPU work, a device event)

    def record(self, *guarded: torch.Tensor) -> None:
        """Record on the current stream; ``guarded`` are the tensors the edge protects (used on ``ge``)."""
        if not is_enabled():
            return
        self.guarded = guarded
        backends.current().record(self)
        hooks.event_recorded(self.tag, current_stream_tag())

    def wait(self, *consumers: torch.Tensor) -> Any:
        """Make the current stream wait for the last record; returns ``consumers`` (one tensor, a tuple, or None)."""
        out = tuple(consumers)
        if is_enabled():
            out = tuple(backends.current().wait(self, out))
            hooks.event_waited(self.tag, current_stream_tag())
        if not out:
            return None
        return out[0] if len(out) == 1 else out

    def synchronize(self) -> None:
        """Host waits for the last record."""
        backends.current().synchronize_event(self)
        hooks.event_synchronized(self.tag)


def event(tag: str) -> Event:
    """The event named ``tag``, created on first use."""
    ev = STATE.events.get(tag)
    if ev is None:  # setdefault is atomic, so concurrent first uses share one event (and Dynamo traces it)
        ev = STATE.events.setdefault(tag, Event(tag))
    return ev


def release_events(prefix: str) -> int:
    """Forget the events whose tags start with ``prefix`` (e.g. a cache's, when it is closed).

    Their device events are freed with them. Tagged events already created on ``aclgraph`` stay
    registered with torchair, which has no way to remove them. Returns how many were released.
    """
    with STATE.lock:
        tags = [t for t in STATE.events if t.startswith(prefix)]
        for t in tags:
            del STATE.events[t]
    return len(tags)


def wait_tensor(x: torch.Tensor, *deps: torch.Tensor) -> torch.Tensor:
    """An ordering edge: ``x`` is consumed only after ``deps`` are produced. Use the returned tensor.

    ``ge``: ``npu_wait_tensor`` per dependency (a control edge in the graph). Event-based paths
    have no per-tensor edge: the current stream joins every other stream that has work in
    flight, which is correct but coarse; prefer `Event` there.
    """
    if not (is_enabled() and deps):
        return x
    return backends.current().wait_tensor(x, deps)
