"""A simulated interconnect for the CPU path: a collective takes at least latency + bytes / bandwidth.

On one host, gloo moves bytes through loopback with the same cores that compute, so a 2-core
machine has no idle engine left to overlap with; a real interconnect moves them with its own.
With a link set, each collective on the ``cpu`` path books the link when it is issued, and
completes when both its bytes have arrived (gloo) and its booking has ended. The link carries one
transfer at a time per process (a FIFO, as a NIC does): a booking starts after the ones before
it, so two exchanges in flight share the link rather than each getting the full bandwidth. The
wait is a sleep, so it costs no CPU and overlaps with compute like a real network transfer; and
the completion time is the booking's end, not when a loaded host gets round to noticing it.
Nothing of the link runs on another thread while nobody observes: the thread that waits (or polls) for a
transfer notices its arrival and sleeps to its booking's end (a timeline, which needs the completion's time,
gets it from a callback on gloo's thread and the link's clock thread: `DelayedWork`).
What this leaves out: a peer that issues later delays a rank only once its bytes arrive, so rank
skew shorter than the transfer is absorbed in the link time rather than added to it.
A transfer longer than the wait bound (`overlap.set_wait_timeout`) is refused before it is issued.
Off by default (tests run plain gloo); the launcher and the benchmarks turn it on and print it. Set
by `set_link` or ``$OVERLAP_CPU_LINK="GBPS[,LATENCY_US]"`` (e.g. "2,20"); ``set_link(OFF)`` turns it
off whatever the environment says.
"""
from __future__ import annotations

import dataclasses
import datetime
import heapq
import itertools
import logging
import math
import os
import threading
import time
from typing import Any, Callable, List, Optional, Tuple, Union

from .comm_threads import enrol_current_thread
from .state import STATE, WaitTimeout, wait_timeout

ENV_LINK = "OVERLAP_CPU_LINK"
OFF = "off"  # set_link(OFF): plain gloo, even where $OVERLAP_CPU_LINK names a link
_OFF_WORDS = ("off", "none")
_LOG = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Link:
    """Bandwidth per rank in GB/s (1e9 bytes) and per-message latency in microseconds."""

    gbps: float
    latency_us: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gbps) and self.gbps > 0):
            raise ValueError(f"a link needs a finite gbps > 0, got {self.gbps}")
        if not (math.isfinite(self.latency_us) and self.latency_us >= 0):
            raise ValueError(f"a link needs a finite latency_us >= 0, got {self.latency_us}")

    def seconds(self, nbytes: int) -> float:
        """Transfer time of ``nbytes`` over this link."""
        return self.latency_us * 1e-6 + nbytes / (self.gbps * 1e9)

    def __str__(self) -> str:
        return f"{self.gbps:g} GB/s" + (f", {self.latency_us:g} us" if self.latency_us else "")


def parse_link(text: str, source: str = ENV_LINK) -> Link:
    """Parse "GBPS[,LATENCY_US]"."""
    try:
        parts = [float(p) for p in text.split(",")]
        if not 1 <= len(parts) <= 2:
            raise ValueError
        return Link(*parts)
    except (TypeError, ValueError):
        raise ValueError(f"{source}: expected 'GBPS[,LATENCY_US]' with a finite GBPS > 0 and a finite "
                         f"LATENCY_US >= 0, e.g. '2,20'; got {text!r}") from None


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def transfer_seconds(link: Link, nbytes: int) -> float:
    """The simulated time of ``nbytes`` over ``link``; `WaitTimeout` if that exceeds the wait bound.

    Called before the collective is issued, so a link too slow for the bound fails at once
    instead of sleeping until the bound.
    """
    seconds = link.seconds(nbytes)
    bound = wait_timeout()
    if not seconds <= bound:  # NaN fails too
        # no "timeout" in the text: launch.health would take it for a peer that stopped
        raise WaitTimeout(f"the simulated link {link} needs {seconds:.2g} s for this {_size(nbytes)} transfer, "
                          f"more than the {bound:g} s wait bound: use a faster --cpu-link (overlap.set_link), "
                          f"or raise the wait bound")
    return seconds


def reserve(seconds: float) -> float:
    """Book the link for ``seconds`` after the transfers already booked; returns when this one ends.

    `WaitTimeout`, with nothing booked, when the transfers queued before this one would hold the
    link past the wait bound. Times are `time.perf_counter`'s, as the timeline's spans.
    """
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"a link booking needs a finite number of seconds >= 0, got {seconds}")
    bound = wait_timeout()
    with STATE.lock:
        now = time.perf_counter()
        start = max(now, STATE.link_busy_until)
        end = start + seconds
        if not math.isfinite(end):
            raise ValueError(f"a link booking of {seconds:g} s after {start:g} s is out of range")
        if end - now > bound:
            raise WaitTimeout(f"the simulated link is busy for another {start - now:.2g} s with the transfers "
                              f"queued before this {seconds:.2g} s one, more than the {bound:g} s wait bound: use "
                              f"a faster --cpu-link, or raise the wait bound")
        STATE.link_busy_until = end
        return end


def wait_until(until: float) -> None:
    """Block the calling thread until ``until`` (a `reserve` result): a synchronous collective's booking."""
    time.sleep(max(0.0, until - time.perf_counter()))


def set_link(link: Union[Link, str, None]) -> None:
    """Simulate ``link`` for CPU collectives; `OFF` (``"off"``): plain gloo whatever ``$OVERLAP_CPU_LINK``
    says; None: ``$OVERLAP_CPU_LINK``'s link, plain gloo where it is unset."""
    if not (link is None or isinstance(link, Link) or link == OFF):
        raise ValueError(f"set_link takes a Link, {OFF!r} or None, got {link!r}")
    STATE.link = link


def env_link() -> Optional[Link]:
    """``$OVERLAP_CPU_LINK``'s link: None when it is unset, empty, ``off`` or ``none``; ValueError naming it
    for anything but ``GBPS[,LATENCY_US]``."""
    env = os.environ.get(ENV_LINK, "")
    return None if env.strip().lower() in _OFF_WORDS + ("",) else parse_link(env)


def current_link() -> Optional[Link]:
    """The simulated link in use: `set_link`'s (None after ``set_link(OFF)``), else ``$OVERLAP_CPU_LINK``'s,
    else None."""
    if STATE.link is not None:
        return STATE.link if isinstance(STATE.link, Link) else None
    return env_link()


class _Clock:
    """One daemon thread per process that runs each callback at its time, in time order.

    A transfer whose bytes arrive before its booking ends completes at the booking's end. Starting
    a `threading.Timer` for each took about 0.2 ms of the host, partly holding the interpreter the
    compute needs, for every asynchronous collective; the clock takes a heap push.
    """

    _IDLE_S = 1.0  # an idle clock re-checks its heap this often (no wait in the toolkit is unbounded)

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: List[Tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._pid = 0

    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the clock's thread at ``when`` (`time.perf_counter` seconds), or at once if past."""
        with self._cv:
            order = next(self._order)
            heapq.heappush(self._heap, (when, order, fn))
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()  # a forked child has the heap but not the thread
                self._thread = threading.Thread(target=self._run, name="overlap-link-clock", daemon=True)
                self._thread.start()
            elif self._heap[0][1] == order:  # the new first: wake the clock to sleep less; else it sleeps on
                self._cv.notify()

    def pending(self) -> int:
        """Callbacks not yet run."""
        with self._cv:
            return len(self._heap)

    def _run(self) -> None:
        enrol_current_thread()  # it completes transfers: a comm thread (overlap.comm_threads)
        while True:
            with self._cv:
                while True:
                    now = time.perf_counter()
                    if self._heap and self._heap[0][0] <= now:
                        fn = heapq.heappop(self._heap)[2]
                        break
                    self._cv.wait(min(self._heap[0][0] - now, self._IDLE_S) if self._heap else self._IDLE_S)
            try:
                fn()
            except Exception:  # a failed completion is logged and must not stop the others'
                _LOG.exception("a simulated link completion failed")


_CLOCK = _Clock()


class DelayedWork:
    """A gloo work that completes once its bytes have arrived and its link booking (``until``) has ended.

    With ``on_done`` (a span to end: an observer records it), ``on_done(end)`` runs once, with the completion time
    ``max(arrival, until)``: an arrival callback on gloo's thread notes the time, and whoever notices the completion
    first runs it, the link's clock thread or a thread that waits, so a loaded host waking the clock late does not
    make the transfer late. Without it (nobody records), nothing runs on another thread: whoever waits or polls
    notices the completion. Those callbacks are Python, and take the interpreter from the thread that computes (two
    hand-offs a collective; measured 2026-12-05, two-batch decode at 256 tokens per rank and 0.1 GB/s, 12
    exchanges a step: 58.1 ms a step with them, 54.3 without, serial 63.2), which a device's communication engine
    never does: they run only where a timeline needs the completion's time.
    """

    def __init__(self, work: Any, until: float, on_done: Optional[Callable[[float], None]] = None):
        self._work = work
        self._until = until
        self._on_done = on_done
        self._arrived = threading.Event()
        self._arrived_at = math.inf
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None
        if on_done is None:
            return

        def arrived(fut: Any) -> None:
            try:
                fut.value()
            except BaseException as exc:  # surfaced by wait()
                self._error = exc
            self._arrived_at = time.perf_counter()
            self._arrived.set()
            if self._until <= self._arrived_at:
                self._finish()
                return
            _CLOCK.at(self._until, self._finish)

        work.get_future().add_done_callback(arrived)

    def _finish(self) -> None:
        with self._lock:
            if self._done.is_set():
                return
            try:
                if self._on_done is not None:
                    self._on_done(max(self._arrived_at, self._until))
            finally:
                self._done.set()

    def _has_arrived(self) -> bool:
        return self._arrived.is_set() if self._on_done is not None else self._work.is_completed()

    def is_completed(self) -> bool:
        if not self._done.is_set() and self._has_arrived() and time.perf_counter() >= self._until:
            self._finish()
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait at most ``timeout`` seconds (None: the wait bound); False if it has not completed by then."""
        bound = wait_timeout() if timeout is None else timeout
        deadline = time.perf_counter() + bound
        if self._on_done is not None:
            if not self._arrived.wait(bound):
                return False
        elif not self._work_waited(bound):
            return False
        if self._until > deadline:  # the bound was lowered after the booking was accepted
            wait_until(deadline)
            return False
        wait_until(self._until)
        self._finish()
        if self._error is not None:
            raise self._error
        return True

    def _work_waited(self, bound: float) -> bool:
        """gloo's own wait, at most ``bound`` seconds: False where the bytes have not arrived by then; a failed
        exchange raises its error."""
        td = datetime.timedelta(seconds=max(bound, 1e-3))  # a zero timedelta would mean "no timeout"
        try:
            self._work.wait(timeout=td)
        except Exception:
            if not self._work.is_completed():
                return False
            self._work.wait(timeout=td)  # completed meanwhile: its own outcome, an error or none
        return True
