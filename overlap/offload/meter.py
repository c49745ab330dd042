"""What an offload costs: the device bytes its rings hold, and its prefetches' bytes and copy time.

`DeviceBytes` counts the device bytes of a cache's slots (now, and the most ever held). `PrefetchMeter`
counts the prefetches (fills) and write-backs (drains) of the rings it is given to, times each prefetch's
copy and says how much of that time the main stream spent waiting for it: `PrefetchReport`.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, List, Optional

from .. import backends


class DeviceBytes:
    """Device bytes a cache holds now, and the most it has held."""

    def __init__(self, start: int = 0):
        self.now = self.peak = start

    def add(self, n: int) -> None:
        """``n`` more bytes held (fewer where ``n`` is negative)."""
        self.now += n
        self.peak = max(self.peak, self.now)

    def clear(self) -> None:
        """Nothing held any more (the peak stays)."""
        self.now = 0


@dataclasses.dataclass(frozen=True)
class PrefetchReport:
    """The prefetches so far (one per fill of a ring's slot) and the write-backs (one per drain).

    ``exposed_s`` is the part of the prefetches' copy time the main stream spent waiting for them
    (all of it for a copy made on the main stream, with overlap off).
    """

    count: int
    bytes: int
    seconds: float
    exposed_s: float
    stores: int
    store_bytes: int

    @property
    def hidden_share(self) -> Optional[float]:
        """The share of the prefetches' copy time the main stream did not wait for; None without any."""
        return 1.0 - self.exposed_s / self.seconds if self.seconds > 0 else None

    def __str__(self) -> str:
        hidden = "no copy time" if self.hidden_share is None else \
            f"{self.hidden_share:.0%} hidden ({self.exposed_s * 1e3:.2f} ms waited for)"
        return (f"KV prefetch: {self.count} copies, {self.bytes / 2**20:.2f} MiB in {self.seconds * 1e3:.2f} ms, "
                f"{hidden}; written back: {self.stores} copies, {self.store_bytes / 2**20:.2f} MiB")


class _Stamps:
    """Points in time on the current stream, in seconds of one clock: the host's on the CPU path (a copy runs
    on the copy stream's thread there, compute inline on the host), device timing events elsewhere."""

    def __init__(self) -> None:
        self._clock = backends.current().clock()  # None: host clocks are the launches' times

    def now(self) -> Any:
        if self._clock is None:
            return time.perf_counter()
        ev = self._clock.mod.Event(enable_timing=True)
        ev.record()
        return ev

    def done(self, stamp: Any) -> bool:
        """Whether the stream has passed ``stamp`` (without waiting for it)."""
        return stamp is not None and (self._clock is None or stamp.query())

    def seconds(self, stamp: Any) -> float:
        return stamp if self._clock is None else self._clock.ref.elapsed_time(stamp) / 1e3


class CopyTiming:
    """One prefetch's copy: its bytes, whether it ran beside the main stream, and its stamps, set as they happen
    (`mark_start` and `mark_end` inside the launch that copies, `mark_waited` where the main stream waits)."""

    def __init__(self, stamps: _Stamps, nbytes: int, asynchronous: bool):
        self._stamps = stamps
        self.nbytes, self.asynchronous = nbytes, asynchronous
        self.start: Any = None
        self.end: Any = None
        self.waited: Any = None  # when the main stream first waited for it

    def mark_start(self) -> None:
        """The copy starts now (call it inside its launch)."""
        self.start = self._stamps.now()

    def mark_end(self) -> None:
        """The copy has ended now (call it inside its launch)."""
        self.end = self._stamps.now()

    def mark_waited(self) -> None:
        """The main stream waits for the copy from now on."""
        self.waited = self._stamps.now()


class PrefetchMeter:
    """The prefetches' count, bytes and copy time, and the part of it the main stream waited for; the write-backs'
    count and bytes. A copy's times are folded into the totals once it has finished (no host wait for it)."""

    def __init__(self) -> None:
        self._stamps = _Stamps()
        self._open: List[CopyTiming] = []
        self.count = self.bytes = self.stores = self.store_bytes = 0
        self.seconds = self.exposed = 0.0

    def prefetch(self, nbytes: int, asynchronous: bool) -> CopyTiming:
        """Count a prefetch of ``nbytes``; returns its timing, for its launch to stamp."""
        copy = CopyTiming(self._stamps, nbytes, asynchronous)
        self.count, self.bytes = self.count + 1, self.bytes + nbytes
        self._open.append(copy)
        return copy

    def store(self, nbytes: int) -> None:
        """Count a write-back of ``nbytes``."""
        self.stores, self.store_bytes = self.stores + 1, self.store_bytes + nbytes

    def fold(self) -> None:
        """Add the finished copies' times to the totals."""
        left = []
        for c in self._open:
            if not self._stamps.done(c.end):
                left.append(c)
                continue
            start, end = self._stamps.seconds(c.start), self._stamps.seconds(c.end)
            took = max(end - start, 0.0)
            if not c.asynchronous:
                exposed = took
            elif self._stamps.done(c.waited):  # else the main stream reaches its wait after the copy ended
                exposed = min(max(end - max(self._stamps.seconds(c.waited), start), 0.0), took)
            else:
                exposed = 0.0
            self.seconds += took
            self.exposed += exposed
        self._open = left

    def report(self) -> PrefetchReport:
        """The totals so far, the copies finished by now folded in (wait for the copies first to count them all)."""
        self.fold()
        return PrefetchReport(self.count, self.bytes, self.seconds, self.exposed, self.stores, self.store_bytes)


__all__ = ["CopyTiming", "DeviceBytes", "PrefetchMeter", "PrefetchReport"]
