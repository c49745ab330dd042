"""Tagged streams: place work on a stream, issue collectives and host work there, synchronise.

A tag names one stream per device, created once and reused. `stream(tag)` places work on it:
a torchair stream switch on the graph paths, a device stream on ``npu`` / ``cuda``, a logical
stream on ``cpu`` (see `overlap.backends`). Work issued through `issue_collective` and
`issue_host` is seen by the observers (timeline, sanitizer) as one span each.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from . import backends, hooks
from .context import DEFAULT, current_stream_tag, is_enabled, swap_stream_tag

EP_COMM = "ep_comm"  # expert-parallel dispatch / combine
SHARED_EXPERT = "shared_expert"  # shared experts beside the routed path
KV_OFFLOAD = "kv_offload"  # KV-cache offload and prefetch
INDEXER = "indexer"  # sparse attention's indexer (its top-k selection) beside the main attention branch


def get_stream(tag: str, priority: int = 0) -> Any:
    """The stream object behind ``tag`` on an eager path (created once per device and tag)."""
    return backends.current().get_stream(tag, priority)


@contextlib.contextmanager
def stream(tag: str = EP_COMM, priority: int = 0, enabled: bool = True) -> Iterator[str]:
    """Place the work launched inside the block on the stream named ``tag``.

    With ``enabled=False`` or overlap switched off globally the block runs on the current stream
    unchanged: the single-stream fallback.
    """
    if not (enabled and is_enabled()):
        yield current_stream_tag()
        return
    prev = swap_stream_tag(tag)
    try:
        scope = backends.current().stream_scope(tag, priority, prev)
        if scope is None:
            yield tag
        else:
            with scope:
                yield tag
    finally:
        swap_stream_tag(prev)


def issue_collective(name: str, issue: Callable[[bool], Any], reads: Sequence[torch.Tensor] = (),
                     writes: Sequence[torch.Tensor] = (), nbytes: int = 0, **meta: Any) -> None:
    """Issue a collective on the current stream; ``issue(async_op)`` calls torch.distributed.

    On a CPU side stream it is issued with ``async_op=True`` and completes on gloo's threads; an
    event recorded on this stream afterwards waits for it. Everywhere else it is issued in order
    on the current (device) stream. ``nbytes`` (bytes this rank exchanges with others) sets its
    transfer time when a simulated link is on (`overlap.link`, CPU only).
    """
    backend = backends.current()
    tag = current_stream_tag()
    span = hooks.start_span(name, tag, "comm", reads=reads, writes=writes,
                            asynchronous=backend.is_asynchronous(tag), meta=meta)
    backend.issue_collective(name, issue, reads, writes, span, nbytes)


def issue_host(name: str, fn: Callable[[], Any], reads: Sequence[torch.Tensor] = (),
               writes: Sequence[torch.Tensor] = (), kind: str = "copy", **meta: Any) -> None:
    """Run host work (a copy) on the current stream: on a CPU side stream, on its worker thread."""
    backend = backends.current()
    tag = current_stream_tag()
    span = hooks.start_span(name, tag, kind, reads=reads, writes=writes,
                            asynchronous=backend.is_asynchronous(tag), meta=meta)
    backend.issue_host(name, fn, reads, writes, span)


def issue_ahead(name: str, fn: Callable[[], Any], tag: Optional[str] = None) -> Optional[backends.Ahead]:
    """Run ``fn``, host work that issues collectives on stream ``tag`` (default: the current stream), on that
    stream's own thread where the path has one: a CPU side stream's worker, as a device's comm stream runs
    by itself. The caller goes on at once; ``fn`` runs in the caller's context (stream, path, span meta)
    after the host work launched on the stream before, and any other thread's next collective waits
    until it has returned, so every rank issues its collectives in one order. Returns the `Ahead` whose
    ``result()`` is what ``fn`` returned; None where the path has no such thread (eager devices, the
    graph paths, a synchronous stream, overlap off): the caller runs the work itself, in place.

    `collectives.PendingDispatch.issue_ahead` reads a count exchange and sends the tokens this way.
    """
    if not is_enabled():
        return None
    return backends.current().issue_ahead(name, fn, current_stream_tag() if tag is None else tag)


def record_stream(tensor: torch.Tensor, tag: str) -> None:
    """Tell the allocator that ``tensor`` is used on stream ``tag`` (memory safety across streams).

    Nothing on ``cpu`` (an asynchronous launch holds its own inputs and outputs until it
    completes) and on ``ge`` (the graph's memory planner sees every stream).
    """
    if is_enabled():
        backends.current().record_stream(tensor, tag)


def synchronize() -> None:
    """Host waits for all work on all streams of the current path."""
    backends.current().synchronize()
    hooks.synchronized()


__all__ = ["DEFAULT", "EP_COMM", "INDEXER", "KV_OFFLOAD", "SHARED_EXPERT", "get_stream", "issue_ahead", "issue_collective",
           "issue_host",
           "record_stream", "stream", "synchronize"]
