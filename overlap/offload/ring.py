"""The one offload mechanism: a ring of device slots, filled from the host and drained to it on the copy stream.

A slot is a K and a V buffer on the device. Both KV caches that live on the host stage their keys and
values through rings: the prefill `OffloadCache` drains each layer's new keys and values through one ring
and fills another when it prefetches them back; decode's `microbatch.OffloadedKVCache` has a ring per
micro-batch, fills a slot with a layer's history and drains the step's new rows from it.

Per slot, two events per direction, on the ``kv_offload`` stream (`overlap.KV_OFFLOAD`):

- fill (host to device): the main stream records ``free`` once its reads and writes of what the slot held
  are issued; the copy stream waits for it, runs the fill's copy and records ``ready``; `Ring.wait_filled`
  makes the main stream wait for ``ready`` (once per fill) before it reads the slot.
- drain (device to host): the main stream records ``written`` once the slot holds what goes to the host;
  the copy stream waits for it, runs the drain's copy and records ``stored``; `Ring.wait_drained` makes
  the main stream wait for ``stored`` (once per drain) before it writes the slot again.

After each fill and drain the slot's buffers are marked as used on the copy stream (`record_stream`), so
dropping them never hands their memory out while a copy still runs. Buffers are allocated on first use
(zeroed, where the ring is ``zeroed``) and counted in a `DeviceBytes`; a `PrefetchMeter`, where the ring
has one, counts and times the fills and counts the drains. A ring that is not ``asynchronous`` runs every copy on the current stream,
with no event.

What is copied is the caller's: `fill` and `drain` take a function of the slot's buffers that issues the
copies on the current stream (`overlap.copy_`, or `issue_copies`: several as one launch).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Set, Tuple

import torch

from ..context import current_stream_tag
from ..events import Event, event, release_events
from ..streams import KV_OFFLOAD, issue_host, record_stream, stream
from .meter import CopyTiming, DeviceBytes, PrefetchMeter

Pair = Tuple[torch.Tensor, torch.Tensor]
FillCopy = Callable[[torch.Tensor, torch.Tensor, Optional[CopyTiming]], None]  # (k, v, the fill's timing)
DrainCopy = Callable[[torch.Tensor, torch.Tensor], None]  # (k, v)


def issue_copies(name: str, pairs: Sequence[Pair], timing: Optional[CopyTiming] = None, **meta: Any) -> None:
    """The copies of ``pairs`` (destination, source) as one launch on the current stream, ``timing`` (a fill's)
    stamped at its start and end, where the launch runs."""

    def run() -> None:
        if timing is not None:
            timing.mark_start()
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        if timing is not None:
            timing.mark_end()

    issue_host(name, run, reads=[s for _, s in pairs], writes=[d for d, _ in pairs], **meta)


def _nbytes(buffers: Pair) -> int:
    return sum(t.numel() * t.element_size() for t in buffers)


class Ring:
    """``size`` device slots of K and V buffers (``[rows, *k_shape]`` and ``[rows, *v_shape]``), filled and drained
    on the copy stream (module docstring).

    Slot ``i``'s events are ``{name}.free{i}`` and ``{name}.ready{i}`` where the ring ``fills``, ``{name}.written{i}``
    and ``{name}.stored{i}`` where it ``drains``; `close` releases them. ``device_bytes`` counts the buffers (a
    cache's rings may share one); ``prefetches`` counts and times the fills and counts the drains. A ``zeroed``
    ring's buffers start as zeros (a zero fill on the current stream), for a user that reads rows it never wrote.
    """

    def __init__(self, name: str, size: int, k_shape: Sequence[int], v_shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device, device_bytes: DeviceBytes, *, fills: bool = True, drains: bool = True,
                 asynchronous: bool = True, prefetches: Optional[PrefetchMeter] = None, zeroed: bool = True):
        self.name, self.asynchronous, self.zeroed = name, asynchronous, zeroed
        self.k_shape, self.v_shape, self.dtype, self.device = tuple(k_shape), tuple(v_shape), dtype, device
        self._bytes, self._prefetches = device_bytes, prefetches
        self._buffers: List[Optional[Pair]] = [None] * size
        self._holds: List[Optional[Hashable]] = [None] * size
        self._next = 0
        self._free, self._ready = self._events("free", size, fills), self._events("ready", size, fills)
        self._written, self._stored = self._events("written", size, drains), self._events("stored", size, drains)
        self._filling: Dict[int, Optional[CopyTiming]] = {}  # slot -> its fill the main stream has not waited for
        self._draining: Set[int] = set()  # slots whose drain the main stream has not waited for
        self._recorded: Dict[str, Event] = {}  # the events recorded on the copy stream, for `synchronize`

    def _events(self, what: str, size: int, wanted: bool) -> List[Event]:
        return [event(f"{self.name}.{what}{i}") for i in range(size)] if wanted else []

    def __len__(self) -> int:
        return len(self._buffers)

    # ---- the slots -------------------------------------------------------------------------------------
    def take(self) -> int:
        """The next slot, round robin."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        return slot

    def buffers(self, slot: int, rows: int) -> Pair:
        """The slot's K and V buffers, of ``rows`` rows at least: allocated on first use, replaced where they are
        smaller (a fill or drain still in flight lands in, or reads, the buffers dropped: not waited for)."""
        bufs = self._buffers[slot]
        if bufs is None or bufs[0].shape[0] < rows:
            if bufs is not None:
                self._bytes.add(-_nbytes(bufs))
            new = torch.zeros if self.zeroed else torch.empty
            bufs = (new((rows,) + self.k_shape, dtype=self.dtype, device=self.device),
                    new((rows,) + self.v_shape, dtype=self.dtype, device=self.device))
            self._buffers[slot] = bufs
            self._bytes.add(_nbytes(bufs))
            self._filling.pop(slot, None)
            self._draining.discard(slot)
        return bufs

    def hold(self, slot: int, key: Hashable) -> None:
        """Say that ``slot`` holds (or is being filled with) what ``key`` names; no other slot holds it any more."""
        self._holds = [None if held == key else held for held in self._holds]
        self._holds[slot] = key

    def held(self, slot: int) -> Optional[Hashable]:
        """What ``slot`` holds (the key given to `hold`), or None."""
        return self._holds[slot]

    def find(self, key: Hashable) -> Optional[int]:
        """The slot holding what ``key`` names, or None."""
        return next((slot for slot, held in enumerate(self._holds) if held == key), None)

    def forget(self) -> None:
        """Forget what the slots hold."""
        self._holds = [None] * len(self._holds)

    # ---- the copies ------------------------------------------------------------------------------------
    def fill(self, slot: int, copy: FillCopy, nbytes: int) -> None:
        """Fill ``slot`` (its buffers allocated) on the copy stream: once the main stream is done with what it held,
        ``copy(k, v, timing)`` issues the ``nbytes`` of copies into its buffers; `wait_filled` waits for them."""
        k, v = self._allocated(slot)
        meter = self._prefetches
        if not self.asynchronous:
            copy(k, v, None if meter is None else meter.prefetch(nbytes, asynchronous=False))
            return
        self._free[slot].record(k, v)  # after the main stream's reads and writes of what the slot held
        caller = current_stream_tag()
        with stream(KV_OFFLOAD) as tag:
            k, v = self._wait_free(slot, k, v)
            timing = None if meter is None else meter.prefetch(nbytes, asynchronous=tag != caller)
            copy(k, v, timing)
            self._record(self._ready[slot], k, v)
        self._used_on_copy_stream(k, v)
        self._filling[slot] = timing

    def wait_filled(self, slot: int) -> Pair:
        """The slot's buffers, the main stream made to wait for the fill into them (where it has not yet)."""
        k, v = self._allocated(slot)
        if slot in self._filling:
            timing = self._filling.pop(slot)
            if timing is not None:
                timing.mark_waited()
            k, v = self._wait_ready(slot, k, v)
        return k, v

    def drain(self, slot: int, copy: DrainCopy, nbytes: int) -> None:
        """Drain ``slot`` on the copy stream: once the main stream's writes of it are done, ``copy(k, v)`` issues
        the ``nbytes`` of copies out of its buffers; `wait_drained` waits for them."""
        k, v = self._allocated(slot)
        if self._prefetches is not None:
            self._prefetches.store(nbytes)
        if not self.asynchronous:
            copy(k, v)
            return
        self._written[slot].record(k, v)  # after the main stream's writes of the slot
        with stream(KV_OFFLOAD):
            k, v = self._wait_written(slot, k, v)
            copy(k, v)
            self._record(self._stored[slot], k, v)
        self._used_on_copy_stream(k, v)
        self._draining.add(slot)

    def wait_drained(self, slot: int) -> None:
        """Make the main stream wait until the drain of ``slot`` has finished reading it (where it has not yet)."""
        if slot in self._draining:
            self._draining.discard(slot)
            self._wait_stored(slot, *self._allocated(slot))

    def synchronize(self) -> None:
        """The host waits until every copy the ring issued has landed."""
        for ev in self._recorded.values():
            ev.synchronize()

    def close(self) -> None:
        """Drop the buffers (their bytes leave the meter) and release the events; wait for the copies first."""
        for bufs in self._buffers:
            if bufs is not None:
                self._bytes.add(-_nbytes(bufs))
        self._buffers = [None] * len(self._buffers)
        self._filling.clear()
        self._draining.clear()
        self._recorded.clear()
        self.forget()
        release_events(f"{self.name}.")

    def _allocated(self, slot: int) -> Pair:
        bufs = self._buffers[slot]
        if bufs is None:
            raise ValueError(f"ring {self.name!r}: slot {slot} has no buffers yet (call buffers first)")
        return bufs

    def _record(self, ev: Event, k: torch.Tensor, v: torch.Tensor) -> None:
        ev.record(k, v)
        self._recorded[ev.tag] = ev

    def _used_on_copy_stream(self, k: torch.Tensor, v: torch.Tensor) -> None:
        record_stream(k, KV_OFFLOAD)
        record_stream(v, KV_OFFLOAD)

    # The four waits, one method each (the tests take each one out and expect the sanitizer to object).
    def _wait_free(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> Pair:
        """Copy stream: the main stream's reads and writes of what the slot held are done."""
        return self._free[slot].wait(k, v)

    def _wait_ready(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> Pair:
        """Main stream: the fill of the slot has landed."""
        return self._ready[slot].wait(k, v)

    def _wait_written(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> Pair:
        """Copy stream: the main stream's writes of the slot are done."""
        return self._written[slot].wait(k, v)

    def _wait_stored(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> Pair:
        """Main stream: the drain of the slot has finished reading it."""
        return self._stored[slot].wait(k, v)

    def __repr__(self) -> str:
        return (f"Ring({self.name}: {len(self)} slots of k{self.k_shape} v{self.v_shape} {self.dtype} on "
                f"{self.device}, asynchronous={self.asynchronous})")


__all__ = ["DrainCopy", "FillCopy", "Pair", "Ring", "issue_copies"]
