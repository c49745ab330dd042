"""A simulated interconnect for the CPU path: a collective takes at least latency + bytes / bandwidth.

On one host, gloo moves bytes through loopback with the same cores that compute, so a 2-core
machine has no idle engine left to overlap with; a real interconnect moves them with its own.
With a link set, each collective on the ``cpu`` path completes no earlier than its transfer
time over that link, and the link carries one transfer at a time per process (a FIFO, as a NIC
does): two exchanges in flight share it rather than each getting the full bandwidth. The extra
wait is a sleep, so it costs no CPU and overlaps with compute like a real network transfer.
A transfer longer than the wait bound (`overlap.set_wait_timeout`) is refused when it is issued.
Off by default (tests run plain gloo); the launcher and the benchmarks turn it on and print it. Set by `set_link` or ``$OVERLAP_CPU_LINK="GBPS[,LATENCY_US]"`` (e.g. "2,20").
"""
from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from typing import Any, Callable, Optional

from .state import STATE, WaitTimeout, wait_timeout

ENV_LINK = "OVERLAP_CPU_LINK"


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
    """Book the link for ``seconds`` after the transfers already booked; returns when this one ends."""
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"a link booking needs a finite number of seconds >= 0, got {seconds}")
    with STATE.lock:
        start = max(time.monotonic(), STATE.link_busy_until)
        end = start + seconds
        if not math.isfinite(end):
            raise ValueError(f"a link booking of {seconds:g} s after {start:g} s is out of range")
        STATE.link_busy_until = end
        return end


def wait_transfer(seconds: float) -> None:
    """Block the calling thread for a transfer of ``seconds`` on the link (a synchronous collective)."""
    left = reserve(seconds) - time.monotonic()
    bound = wait_timeout()
    if left > bound:  # transfers booked before this one hold the link that long
        raise WaitTimeout(f"the simulated link is busy for another {left:.2g} s with the transfers queued before "
                          f"this {seconds:.2g} s one, more than the {bound:g} s wait bound: use a faster --cpu-link, "
                          f"or raise the wait bound")
    time.sleep(max(0.0, left))


def set_link(link: Optional[Link]) -> None:
    """Simulate ``link`` for CPU collectives (None: plain gloo, unless ``$OVERLAP_CPU_LINK`` is set)."""
    STATE.link = link


def current_link() -> Optional[Link]:
    """The simulated link in use: `set_link`'s, else ``$OVERLAP_CPU_LINK``'s, else None."""
    if STATE.link is not None:
        return STATE.link
    env = os.environ.get(ENV_LINK)
    return parse_link(env) if env else None


class DelayedWork:
    """A gloo work that completes ``delay`` seconds after the transfer itself (see the module docstring)."""

    def __init__(self, work: Any, delay: float, on_done: Callable[[], None]):
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._on_done = on_done

        def transferred(fut: Any) -> None:
            try:
                fut.value()
            except BaseException as exc:  # surfaced by wait()
                self._error = exc
            try:
                left = reserve(delay) - time.monotonic()
            except ValueError as exc:  # on gloo's thread: surface it in wait() rather than lose it
                self._error = self._error or exc
                left = 0.0
            timer = threading.Timer(min(max(0.0, left), threading.TIMEOUT_MAX), self._finish)
            timer.daemon = True
            timer.start()

        work.get_future().add_done_callback(transferred)

    def _finish(self) -> None:
        try:
            self._on_done()
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait at most ``timeout`` seconds (None: the wait bound); False if it has not completed by then."""
        if not self._done.wait(wait_timeout() if timeout is None else timeout):
            return False
        if self._error is not None:
            raise self._error
        return True
