"""Events named by tags: ordering edges between streams on every path.

`event(tag)` returns the one event of that name (torchair's tagged events are unique per
process, so events are created once and reused across layers). ``ev.record(*guarded)`` records
on the current stream; ``ev.wait(*consumers)`` makes the current stream wait for it and returns
the consumers. On ``ge``, which has no events, the edge becomes ``npu_wait_tensor(consumer,
guarded)`` for each pair, so callers must use the returned tensors.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Tuple

import torch

from . import hooks
from .paths import _eager_in_trace, current_path, is_enabled
from .streams import _device_module, cpu_stream, current_stream_tag, join_other_streams, known_stream_tags


class Event:
    """An ordering edge between streams; see the module docstring."""

    def __init__(self, tag: str):
        self.tag = tag
        self._guarded: Tuple[torch.Tensor, ...] = ()
        self._cpu_pending: List[Any] = []
        self._device: Dict[str, Any] = {}

    def _device_event(self, path: str) -> Any:
        ev = self._device.get(path)
        if ev is None:
            ev = self._device[path] = _device_module(path).Event()
        return ev

    def record(self, *guarded: torch.Tensor) -> None:
        """Record on the current stream; ``guarded`` are the tensors the edge protects (used on ``ge``)."""
        if not is_enabled():
            return
        path = current_path()
        self._guarded = guarded
        tag = current_stream_tag()
        if path == "cpu":
            self._cpu_pending = cpu_stream(tag).snapshot()
        elif path in ("cuda", "npu"):
            self._device_event(path).record()
        elif path == "aclgraph":
            event_tag = _tagged_event(self.tag)  # first: it registers the air ops
            torch.ops.air.tagged_event_record(event_tag)
        hooks.event_recorded(self.tag, tag)

    def wait(self, *consumers: torch.Tensor) -> Any:
        """Make the current stream wait for the last record; returns ``consumers`` (one tensor, a tuple, or None)."""
        out = tuple(consumers)
        if is_enabled():
            path = current_path()
            if path == "cpu":
                for p in self._cpu_pending:
                    p.wait()
            elif path in ("cuda", "npu"):
                _device_module(path).current_stream().wait_event(self._device_event(path))
            elif path == "aclgraph":
                event_tag = _tagged_event(self.tag)
                torch.ops.air.tagged_event_wait(event_tag)
            elif path == "ge" and out:
                if not self._guarded:
                    raise ValueError(
                        f"event {self.tag!r} was recorded without the tensors it guards; on the ge path an "
                        f"ordering edge is npu_wait_tensor(consumer, guarded): call ev.record(tensor, ...)")
                out = tuple(wait_tensor(c, *self._guarded) for c in out)
            hooks.event_waited(self.tag, current_stream_tag())
        if not out:
            return None
        return out[0] if len(out) == 1 else out

    def synchronize(self) -> None:
        """Host waits for the last record."""
        path = current_path()
        if path == "cpu":
            for p in self._cpu_pending:
                p.wait()
        elif path in ("cuda", "npu") and path in self._device:
            self._device[path].synchronize()
        hooks.event_synchronized(self.tag)


_events: Dict[str, Event] = {}
_tagged_events: Dict[str, Any] = {}  # torchair's tagged event per tag (aclgraph)
_lock = threading.Lock()


def event(tag: str) -> Event:
    """The event named ``tag``, created on first use."""
    ev = _events.get(tag)
    if ev is None:  # setdefault is atomic, so concurrent first uses share one event (and Dynamo traces it)
        ev = _events.setdefault(tag, Event(tag))
    return ev


def release_events(prefix: str) -> int:
    """Forget the events whose tags start with ``prefix`` (e.g. a cache's, when it is closed).

    Their device events are freed with them. Tagged events already created on ``aclgraph`` stay
    registered with torchair, which has no way to remove them. Returns how many were released.
    """
    tags = [t for t in list(_events) if t.startswith(prefix)]
    for t in tags:
        _events.pop(t, None)
    return len(tags)


@_eager_in_trace
def _tagged_event(tag: str) -> str:
    """Create torchair's tagged event for ``tag`` once, as plain Python even under Dynamo; returns the tag.

    ``torchair.ops.npu_tagged_event_record/wait(event)`` map the event back to its tag and emit
    ``air.tagged_event_record/wait(tag)``; the lowering emits those ops with the tag itself, since
    Dynamo cannot trace torchair's lock-guarded event registry.
    """
    with _lock:
        if tag not in _tagged_events:
            from torchair.ops import npu_create_tagged_event

            _tagged_events[tag] = npu_create_tagged_event(tag)
    return tag


def wait_tensor(x: torch.Tensor, *deps: torch.Tensor) -> torch.Tensor:
    """An ordering edge: ``x`` is consumed only after ``deps`` are produced. Use the returned tensor.

    ``ge``: ``npu_wait_tensor`` per dependency (a control edge in the graph). Event-based paths
    have no per-tensor edge: the current stream joins every other stream that has work in
    flight, which is correct but coarse; prefer `Event` there.
    """
    if not (is_enabled() and deps):
        return x
    path = current_path()
    if path == "ge":
        from torchair.scope import npu_wait_tensor

        for d in deps:
            x = npu_wait_tensor(x, d)
        return x
    me = current_stream_tag()
    if path == "aclgraph":
        raise NotImplementedError("wait_tensor has no aclgraph lowering (npu_wait_tensor raises there): use event()")
    _report_join(me)
    join_other_streams(path)
    return x


def _report_join(me: str) -> None:
    """Tell observers that stream ``me`` now waits for every other stream's work so far."""
    if not hooks.active():
        return
    for tag in [t for t in known_stream_tags() if t != me]:
        hooks.event_recorded(f"join:{tag}->{me}", tag)
        hooks.event_waited(f"join:{tag}->{me}", me)
