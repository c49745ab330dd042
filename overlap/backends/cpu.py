"""The ``cpu`` path: logical streams, with real asynchrony where a device would have an engine.

Compute runs inline on the host thread whatever its stream. A collective issued on a side
stream runs asynchronously on gloo's threads (``async_op=True``), and host work (a copy) on the
stream's own worker thread, in launch order. The work pending on a `CpuStream` is what an event
recorded there waits for, so reading a side stream's output before the wait is a real race.
Host work that issues collectives (`overlap.issue_ahead`: a count exchange's read and the tokens
it sizes) runs on the stream's worker too, as a device's comm stream would run it by itself; any
other thread's next collective waits until it has returned, so every rank issues its collectives
in one order.
With a simulated link (`overlap.link`) a collective completes no earlier than its transfer time.
Every wait here is bounded by `overlap.wait_timeout()`: past it, `WaitTimeout` names the launch.
"""
from __future__ import annotations

import concurrent.futures
import contextvars
import datetime
import os
import sys
import threading
from typing import Any, Callable, List, Optional, Sequence

import torch

from .. import hooks
from ..comm_threads import prioritize_comm_threads
from ..context import DEFAULT, current_stream_tag, is_enabled
from ..hooks import Span
from ..link import DelayedWork, current_link, reserve, transfer_seconds, wait_until
from ..peers import late_peers
from ..state import STATE, WaitTimeout, raise_hint, wait_timeout
from .base import Ahead, Backend


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.device == b.device
    except (RuntimeError, NotImplementedError):  # e.g. fake or sparse tensors
        return False


def _intersects(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> bool:
    return any(_same_storage(x, y) for x in xs for y in ys)


class _Pending:
    """One asynchronous launch on a CPU stream: a gloo work or a worker-thread future."""

    def __init__(self, name: str, stream: str, kind: str, waitable: Any, reads: Sequence[torch.Tensor],
                 writes: Sequence[torch.Tensor]):
        self.name = name
        self.stream = stream
        self.kind = kind  # "collective" or "host"
        self.waitable = waitable
        self.reads = tuple(reads)  # keeping references is also the CPU form of record_stream
        self.writes = tuple(writes)
        self._done = False

    def done(self) -> bool:
        if self._done:
            return True
        w = self.waitable
        return w.done() if isinstance(w, concurrent.futures.Future) else w.is_completed()

    def wait(self) -> None:
        """Wait for the launch, at most the wait bound; `WaitTimeout` past it."""
        if self._done:
            return
        bound = wait_timeout()
        w = self.waitable
        if isinstance(w, concurrent.futures.Future):
            try:
                w.result(timeout=bound)
            except concurrent.futures.TimeoutError:
                if not w.done():
                    raise self._timed_out(bound) from None
                w.result()  # the work itself raised TimeoutError, or finished just now
        elif isinstance(w, DelayedWork):
            if not w.wait(bound):
                raise self._timed_out(bound)
        else:
            # gloo's Work.wait raises on timeout; a zero timedelta would mean "no timeout"
            td = datetime.timedelta(seconds=max(bound, 1e-3))
            try:
                w.wait(timeout=td)
            except Exception as exc:
                if not w.is_completed():
                    raise self._timed_out(bound) from exc
                w.wait(timeout=td)  # completed meanwhile: its own outcome, an error or none
        self._done = True

    def _timed_out(self, bound: float) -> WaitTimeout:
        if self.kind == "host":
            what, why = "host work", "the work is blocked or needs longer"
        else:
            what, why = "a collective", (late_peers() or "another rank may have failed or stopped, or the exchange "
                                                          "needs longer")
        return WaitTimeout(f"waited {bound:g} s for {self.name!r} on stream {self.stream!r} ({what}) and it has "
                           f"not completed: {why}; {raise_hint()}")


_AHEAD = threading.local()  # ``running``: this thread runs host work that issues collectives (`issue_ahead`)


class _AheadWork:
    """`Ahead` on a CPU stream's worker thread: a future, waited for within the wait bound."""

    def __init__(self, name: str, stream: str, future: concurrent.futures.Future):
        self.name, self.stream, self.future = name, stream, future

    def result(self) -> Any:
        bound = wait_timeout()
        try:
            return self.future.result(timeout=bound)
        except concurrent.futures.TimeoutError:
            if self.future.done():
                return self.future.result()  # finished just now, or raised TimeoutError itself
            raise WaitTimeout(f"waited {bound:g} s for {self.name!r} on stream {self.stream!r} (host work that issues "
                              f"collectives) and it has not returned: "
                              f"{late_peers() or 'another rank may have failed or stopped'}; {raise_hint()}") from None


class _AheadRegistry:
    """The `issue_ahead` work not yet returned, of every stream: another thread's collective waits for it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: List[_AheadWork] = []

    def add(self, work: _AheadWork) -> None:
        with self.lock:
            self.pending = [w for w in self.pending if not w.future.done()] + [work]

    def wait_all(self) -> None:
        """Wait, within the wait bound, until every one has returned (what it raised is its reader's);
        nothing from inside one, which issues its own collectives in order."""
        if getattr(_AHEAD, "running", False):
            return
        with self.lock:
            pending, self.pending = self.pending, []
        for work in pending:
            if concurrent.futures.wait([work.future], timeout=wait_timeout()).not_done:
                with self.lock:
                    self.pending = pending + self.pending
                work.result()  # raises WaitTimeout naming it


_AHEAD_WORK = _AheadRegistry()


def _wait_on_current_stream(name: str, tag: str, work: Any, reads: Sequence[torch.Tensor],
                            writes: Sequence[torch.Tensor]) -> None:
    """Wait for a collective issued on the current (synchronous) stream, within the wait bound; past it,
    `WaitTimeout` naming it, and the process made to leave at once if that error goes uncaught (`_ABANDONED`)."""
    pending = _Pending(name, tag, "collective", work, reads, writes)
    try:
        pending.wait()
    except WaitTimeout:
        _ABANDONED.add(pending)
        raise


class _Abandoned:
    """Collectives given up on past the wait bound, still in flight in gloo. The interpreter's teardown would wait
    for them (gloo's threads are joined when the group goes, up to the group's own timeout), so an exception that
    nobody catches ends the process at once, after its traceback, with status 1 (`sys.excepthook`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: List[_Pending] = []
        self.hooked = False

    def add(self, pending: _Pending) -> None:
        with self.lock:
            self.pending.append(pending)
            if not self.hooked:
                self.hooked = True
                previous = sys.excepthook

                def leave_now(kind: Any, value: Any, tb: Any) -> None:
                    previous(kind, value, tb)
                    if self.in_flight():
                        sys.stdout.flush()
                        sys.stderr.flush()
                        os._exit(1)

                sys.excepthook = leave_now

    def in_flight(self) -> bool:
        with self.lock:
            return any(not p.done() for p in self.pending)


_ABANDONED = _Abandoned()


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

    def issue_collective(self, name: str, issue: Callable[[bool], Any], reads: Sequence[torch.Tensor],
                          writes: Sequence[torch.Tensor], span: Optional[Span], delay: float = 0.0) -> None:
        with self._lock:
            self._prune()
            self._order_after_hazards(reads, writes)
            until = reserve(delay) if delay > 0 else None  # a simulated link, booked at issue (see overlap.link)
            work = issue(True)
            if until is not None:
                work = DelayedWork(work, until, None if span is None else lambda end: hooks.end_span(span, end))
            elif span is not None:
                work.get_future().add_done_callback(lambda _f: hooks.end_span(span))
            self._pending.append(_Pending(name, self.tag, "collective", work, reads, writes))

    def issue_host(self, name: str, fn: Callable[[], Any], reads: Sequence[torch.Tensor],
                    writes: Sequence[torch.Tensor], span: Optional[Span]) -> concurrent.futures.Future:
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
            self._pending.append(_Pending(name, self.tag, "host", fut, reads, writes))
        return fut

    def issue_ahead(self, name: str, fn: Callable[[], Any]) -> _AheadWork:
        """``fn`` on this stream's worker, after the host work launched here before, in the caller's context
        (its stream, path and span meta); see `overlap.issue_ahead`."""
        context = contextvars.copy_context()

        def run() -> Any:
            _AHEAD.running = True
            try:
                return context.run(fn)
            finally:
                _AHEAD.running = False

        with self._lock:
            self._prune()
            if self._worker is None:
                self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"overlap-{self.tag}")
            fut = self._worker.submit(run)
            self._pending.append(_Pending(name, self.tag, "host", fut, (), ()))
        work = _AheadWork(name, self.tag, fut)
        _AHEAD_WORK.add(work)
        return work

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
    """The logical stream named ``tag`` (created on first use)."""
    with STATE.lock:
        s = STATE.cpu_streams.get(tag)
        if s is None:
            s = STATE.cpu_streams[tag] = CpuStream(tag)
        return s


class CpuBackend(Backend):
    name = "cpu"

    def get_stream(self, tag: str, priority: int = 0) -> CpuStream:
        return cpu_stream(tag)

    def stream_tags(self) -> List[str]:
        with STATE.lock:
            return sorted({DEFAULT} | set(STATE.cpu_streams))

    def record(self, event: Any) -> None:
        event.payload["cpu"] = cpu_stream(current_stream_tag()).snapshot()

    def wait(self, event: Any, consumers: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        self.synchronize_event(event)
        return consumers

    def synchronize_event(self, event: Any) -> None:
        for p in event.payload.get("cpu", ()):
            p.wait()

    def join_other_streams(self) -> None:
        me = current_stream_tag()
        with STATE.lock:
            others = [s for tag, s in STATE.cpu_streams.items() if tag != me]
        for s in others:
            for p in s.snapshot():
                p.wait()

    def is_asynchronous(self, tag: str) -> bool:
        return is_enabled() and tag != DEFAULT

    def issue_collective(self, name: str, issue: Callable[[bool], Any], reads: Sequence[torch.Tensor],
                         writes: Sequence[torch.Tensor], span: Optional[Span], nbytes: int) -> None:
        tag = current_stream_tag()
        _AHEAD_WORK.wait_all()  # every rank issues its collectives in one order (see the module docstring)
        prioritize_comm_threads()  # gloo's threads as a device's comm engine (overlap.comm_threads)
        if self.is_asynchronous(tag):
            try:
                cpu_stream(tag).issue_collective(name, issue, reads, writes, span, self._delay(nbytes))
            except BaseException:  # not in flight: its span ends here (in flight, on completion)
                hooks.end_span(span)
                raise
            return
        try:
            delay = self._delay(nbytes)
            until = reserve(delay) if delay else None  # refused before the collective, the span still closed
            work = issue(True)  # waited for here, within the wait bound: gloo's own wait is the group's timeout
            if work is not None:
                _wait_on_current_stream(name, tag, work, reads, writes)
            if until is not None:
                wait_until(until)
        finally:
            hooks.end_span(span)

    @staticmethod
    def _delay(nbytes: int) -> float:
        """The simulated link's time for ``nbytes``; `WaitTimeout` before anything is issued if too long."""
        link = current_link()
        return transfer_seconds(link, nbytes) if link is not None and nbytes else 0.0

    def issue_host(self, name: str, fn: Callable[[], Any], reads: Sequence[torch.Tensor],
                   writes: Sequence[torch.Tensor], span: Optional[Span]) -> None:
        tag = current_stream_tag()
        if self.is_asynchronous(tag):
            cpu_stream(tag).issue_host(name, fn, reads, writes, span)
            return
        super().issue_host(name, fn, reads, writes, span)

    def issue_ahead(self, name: str, fn: Callable[[], Any], tag: str) -> Optional[Ahead]:
        if not self.is_asynchronous(tag):
            return None
        return cpu_stream(tag).issue_ahead(name, fn)

    def synchronize(self) -> None:
        with STATE.lock:
            streams = list(STATE.cpu_streams.values())
        for s in streams:
            s.synchronize()
