"""Tagged streams on every execution path.

A tag names one stream per device, created once and reused. `stream(tag)` places work on it:
a torchair stream switch on the graph paths, a device stream on ``npu`` / ``cuda``. On ``cpu`` a
stream is an engine as on a device: compute runs inline on the host thread, a collective issued
on a side stream runs asynchronously on gloo's threads and a host function (a copy) runs on the
stream's own worker thread, in launch order. Work pending on a CPU stream is what an event
recorded there waits for.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from . import hooks
from .link import DelayedWork, current_link, wait_transfer
from .paths import _eager_in_trace, current_path, is_enabled

MAIN = "default"  # torchair's name for the main stream
COMM = "ep_comm"  # expert-parallel dispatch / combine
SHARED = "shared_expert"  # shared experts beside the routed path
COPY = "kv_offload"  # KV-cache offload and prefetch

_current_tag: contextvars.ContextVar[str] = contextvars.ContextVar("overlap_stream", default=MAIN)
_device_streams: Dict[Tuple[str, int, str], Any] = {}
_cpu_streams: Dict[str, "CpuStream"] = {}
_registry_lock = threading.Lock()


@_eager_in_trace
def current_stream_tag() -> str:
    """The tag of the stream work is placed on now (``"default"`` outside any `stream` block)."""
    return _current_tag.get()


@_eager_in_trace
def _swap_stream_tag(tag: str) -> str:
    """Make ``tag`` the current stream tag; returns the previous one (a constant while tracing)."""
    prev = _current_tag.get()
    _current_tag.set(tag)
    return prev


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.device == b.device
    except (RuntimeError, NotImplementedError):  # e.g. fake or sparse tensors
        return False


def _intersects(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> bool:
    return any(_same_storage(x, y) for x in xs for y in ys)


class _Pending:
    """One asynchronous launch on a CPU stream: a gloo work or a worker-thread future."""

    def __init__(self, name: str, waitable: Any, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]):
        self.name = name
        self.waitable = waitable
        self.reads = tuple(reads)  # keeping references is also the CPU form of record_stream
        self.writes = tuple(writes)
        self._done = False

    def done(self) -> bool:
        if self._done:
            return True
        w = self.waitable
        finished = w.done() if isinstance(w, concurrent.futures.Future) else w.is_completed()
        return finished

    def wait(self) -> None:
        if self._done:
            return
        w = self.waitable
        if isinstance(w, concurrent.futures.Future):
            w.result()
        else:
            w.wait()
        self._done = True


class CpuStream:
    """A logical stream on the CPU path: the asynchronous work launched on it, in order."""

    def __init__(self, tag: str):
        self.tag = tag
        self._pending: List[_Pending] = []
        self._lock = threading.Lock()
        self._worker: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def _prune(self) -> None:
        self._pending = [p for p in self._pending if not p.done()]

    def _order_after_hazards(self, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor],
                             host: bool = False) -> None:
        # Stream order on a device serialises a launch after earlier launches on the same stream.
        # Async CPU work is only ordered when it touches the same memory, so wait for those.
        for p in list(self._pending):
            if host and isinstance(p.waitable, concurrent.futures.Future):
                continue  # the stream's one worker thread runs host launches in launch order already
            if _intersects(p.writes, list(reads) + list(writes)) or _intersects(p.reads, writes):
                p.wait()

    def launch_collective(self, name: str, issue: Callable[[bool], Any], reads: Sequence[torch.Tensor],
                          writes: Sequence[torch.Tensor], span: Optional[hooks.Span], delay: float = 0.0) -> None:
        with self._lock:
            self._prune()
            self._order_after_hazards(reads, writes)
            work = issue(True)
            if delay > 0:  # a simulated link: completes after the transfer time (see overlap.link)
                work = DelayedWork(work, delay, lambda: hooks.end_span(span))
            elif span is not None:
                work.get_future().add_done_callback(lambda _f: hooks.end_span(span))
            self._pending.append(_Pending(name, work, reads, writes))

    def launch_host(self, name: str, fn: Callable[[], Any], reads: Sequence[torch.Tensor],
                    writes: Sequence[torch.Tensor], span: Optional[hooks.Span]) -> concurrent.futures.Future:
        def run() -> Any:
            try:
                return fn()
            finally:
                hooks.end_span(span)

        with self._lock:
            self._prune()
            self._order_after_hazards(reads, writes, host=True)
            if self._worker is None:
                self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"overlap-{self.tag}")
            fut = self._worker.submit(run)
            self._pending.append(_Pending(name, fut, reads, writes))
        return fut

    def snapshot(self) -> List[_Pending]:
        """The launches an event recorded now must wait for."""
        with self._lock:
            self._prune()
            return list(self._pending)

    def synchronize(self) -> None:
        for p in self.snapshot():
            p.wait()
        with self._lock:
            self._prune()


def cpu_stream(tag: str) -> CpuStream:
    with _registry_lock:
        s = _cpu_streams.get(tag)
        if s is None:
            s = _cpu_streams[tag] = CpuStream(tag)
        return s


def _device_module(path: str) -> Any:
    if path == "cuda":
        return torch.cuda
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu


def get_stream(tag: str, priority: int = 0, path: Optional[str] = None) -> Any:
    """The stream object behind ``tag`` on an eager path (created once per device and tag)."""
    path = path or current_path()
    if path == "cpu":
        return cpu_stream(tag)
    if path not in ("cuda", "npu"):
        raise ValueError(f"path {path!r} has no stream objects: streams are graph labels there")
    mod = _device_module(path)
    if tag == MAIN:
        return mod.default_stream()
    key = (path, mod.current_device(), tag)
    with _registry_lock:
        s = _device_streams.get(key)
        if s is None:
            s = _device_streams[key] = mod.Stream(priority=priority)
        return s


@contextlib.contextmanager
def stream(tag: str = COMM, priority: int = 0, enabled: bool = True) -> Iterator[str]:
    """Place the work launched inside the block on the stream named ``tag``.

    With ``enabled=False`` or overlap switched off globally the block runs on the current stream
    unchanged: the single-stream fallback.
    """
    if not (enabled and is_enabled()):
        yield current_stream_tag()
        return
    path = current_path()
    prev = _swap_stream_tag(tag)
    try:
        if path == "cpu":
            yield tag
        elif path in ("cuda", "npu"):
            with _device_module(path).stream(get_stream(tag, priority, path)):
                yield tag
        elif tag == MAIN:  # graph paths: outside any switch is the main stream already
            if prev != MAIN:
                raise ValueError(f"on the {path} path the main stream cannot be entered inside the {prev!r} "
                                 f"stream scope (torchair scopes only nest); end the side-stream block first")
            yield tag
        else:
            from torchair.scope import npu_stream_switch

            with npu_stream_switch(tag, priority):
                yield tag
    finally:
        _swap_stream_tag(prev)


def _is_async_cpu() -> bool:
    return current_path() == "cpu" and is_enabled() and current_stream_tag() != MAIN


def launch_collective(name: str, issue: Callable[[bool], Any], reads: Sequence[torch.Tensor] = (),
                      writes: Sequence[torch.Tensor] = (), nbytes: int = 0, **meta: Any) -> None:
    """Issue a collective on the current stream; ``issue(async_op)`` calls torch.distributed.

    On a CPU side stream it is issued with ``async_op=True`` and completes on gloo's threads; an
    event recorded on this stream afterwards waits for it. Everywhere else it is issued in order
    on the current (device) stream. ``nbytes`` (bytes this rank exchanges with others) sets its
    transfer time when a simulated link is on (`overlap.link`, CPU only).
    """
    tag = current_stream_tag()
    asynchronous = _is_async_cpu()
    link = current_link() if current_path() == "cpu" else None
    delay = link.seconds(nbytes) if link is not None and nbytes else 0.0
    span = hooks.start_span(name, tag, "comm", reads=reads, writes=writes, asynchronous=asynchronous, meta=meta)
    if asynchronous:
        cpu_stream(tag).launch_collective(name, issue, reads, writes, span, delay)
        return
    try:
        issue(False)
        if delay:
            wait_transfer(delay)
    finally:
        hooks.end_span(span)


def launch_host(name: str, fn: Callable[[], Any], reads: Sequence[torch.Tensor] = (),
                writes: Sequence[torch.Tensor] = (), kind: str = "copy", **meta: Any) -> None:
    """Run host work (a copy) on the current stream: on a CPU side stream, on its worker thread."""
    tag = current_stream_tag()
    asynchronous = _is_async_cpu()
    span = hooks.start_span(name, tag, kind, reads=reads, writes=writes, asynchronous=asynchronous, meta=meta)
    if asynchronous:
        cpu_stream(tag).launch_host(name, fn, reads, writes, span)
        return
    try:
        fn()
    finally:
        hooks.end_span(span)


def record_stream(tensor: torch.Tensor, tag: str) -> None:
    """Tell the allocator that ``tensor`` is used on stream ``tag`` (memory safety across streams)."""
    if not is_enabled():
        return
    path = current_path()
    if path in ("cuda", "npu"):
        if tensor.device.type == path:
            tensor.record_stream(get_stream(tag, path=path))
    elif path == "aclgraph":
        from torchair.ops import npu_record_tagged_stream

        npu_record_tagged_stream(tensor, tag)
    # cpu: every asynchronous launch holds its own inputs and outputs until it completes, so there
    # is nothing to record. ge: the graph's memory planner sees every stream.


def known_stream_tags() -> List[str]:
    """Every stream tag created so far on any path, the main stream included."""
    return sorted({MAIN} | set(_cpu_streams) | {t for (_, _, t) in _device_streams})


def join_other_streams(path: str) -> None:
    """The current stream waits for the work issued so far on every other stream of ``path``."""
    me = current_stream_tag()
    if path == "cpu":
        for tag, s in list(_cpu_streams.items()):
            if tag != me:
                for p in s.snapshot():
                    p.wait()
    elif path in ("cuda", "npu"):
        mod = _device_module(path)
        cur = mod.current_stream()
        for s in [mod.default_stream()] + [s for (p, _, _), s in _device_streams.items() if p == path]:
            if s != cur:
                cur.wait_stream(s)


def synchronize() -> None:
    """Host waits for all work on all streams of the current path."""
    path = current_path()
    if path == "cpu":
        for s in list(_cpu_streams.values()):
            s.synchronize()
    elif path in ("cuda", "npu"):
        _device_module(path).synchronize()
    hooks.synchronized()
