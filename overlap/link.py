"""A simulated interconnect for the CPU path: a collective takes at least latency + bytes / bandwidth.

On one host, gloo moves bytes through loopback with the same cores that compute, so a 2-core
machine has no idle engine left to overlap with; a real interconnect moves them with its own.
With a link set, each collective on the ``cpu`` path completes no earlier than its transfer
time over that link, and the link carries one transfer at a time per process (a FIFO, as a NIC
does): two exchanges in flight share it rather than each getting the full bandwidth. The extra
wait is a sleep, so it costs no CPU and overlaps with compute like a real network transfer.
Off by default (tests run plain gloo); the launcher and the benchmarks turn it on and print it. Set by `set_link` or ``$OVERLAP_CPU_LINK="GBPS[,LATENCY_US]"`` (e.g. "2,20").
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any, Callable, Optional

from .state import STATE

ENV_LINK = "OVERLAP_CPU_LINK"


@dataclasses.dataclass(frozen=True)
class Link:
    """Bandwidth per rank in GB/s (1e9 bytes) and per-message latency in microseconds."""

    gbps: float
    latency_us: float = 0.0

    def __post_init__(self) -> None:
        if not self.gbps > 0 or self.latency_us < 0:
            raise ValueError(f"a link needs gbps > 0 and latency_us >= 0, got {self.gbps} and {self.latency_us}")

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
        raise ValueError(f"{source}: expected 'GBPS[,LATENCY_US]' with GBPS > 0, e.g. '2,20'; got {text!r}") from None


def reserve(seconds: float) -> float:
    """Book the link for ``seconds`` after the transfers already booked; returns when this one ends."""
    with STATE.lock:
        start = max(time.monotonic(), STATE.link_busy_until)
        STATE.link_busy_until = start + seconds
        return STATE.link_busy_until


def wait_transfer(seconds: float) -> None:
    """Block the calling thread for a transfer of ``seconds`` on the link (a synchronous collective)."""
    time.sleep(max(0.0, reserve(seconds) - time.monotonic()))


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
            timer = threading.Timer(max(0.0, reserve(delay) - time.monotonic()), self._finish)
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

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error
