"""Decode's KV cache in host memory: each layer's history prefetched on the ``kv_offload`` stream.

`OffloadedKVCache` is a `KVCache` (``admit``, ``release``, ``rows``, ``write``, ``history``, ``attend``,
``advance``), so `KVStep` and a model's decode attention use it unchanged. It stages keys and values through
`overlap.offload`'s one mechanism, a `Ring` of device slots filled and drained on the copy stream (the ring
owns the slots' buffers, their events, the `record_stream` calls and the meters); this module says what is
copied where and when. What lives where:

- The store, every layer's keys and values ``[n_layers, max_requests, max_len, *shape]``, is in host
  memory: pinned where the device is not the CPU; on the CPU a host tensor of its own.
- Each micro-batch of a step (the requests of one `KVRows`: a *lane*) has a ring of ``ring`` slots
  ``[its requests, max_len, *shape]``; layer L is staged in slot ``L % ring``. A lane's ring is its own,
  so one micro-batch never waits for another's prefetch, nor shares a buffer.
- Prefetch: placing a step's rows (`rows`) starts filling layer 0's slot with their history; reading layer
  L's history (`history`, before or after `write`) starts filling layer L+1's. The fill (`Ring.fill`:
  ``free``, the copy, ``ready``) copies the rows each request holds (one copy per request, contiguous on
  both sides: a strided copy between host and device would go through a temporary), as one launch; layer
  L+1's `write` or `history` makes the main stream wait for it first (`Ring.wait_filled`).
- Write-back: `write` puts the new rows in the slot (this step's attention reads them there); once the
  step's rows of the layer are all there (a prefill split writes a request's rows from two micro-batches),
  the slot is drained (`Ring.drain`: ``written``, the copy to the host store, ``stored``), ahead of any
  later prefetch of that layer (same stream); the main stream waits for the drain before it writes the
  slot again (`Ring.wait_drained`).

`prefetch_report` counts the prefetches and their bytes and says how much of their copy time was
hidden: the part during which the main stream was not waiting for it (`overlap.offload.PrefetchMeter`).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch

from overlap import backends
from overlap.offload import CopyTiming, DeviceBytes, PrefetchMeter, PrefetchReport, Ring, issue_copies

from .kv_cache import KVCache, KVCacheError, KVRows

_names = itertools.count()
_LaneKey = Tuple[Tuple[int, ...], Tuple[int, ...]]


@dataclasses.dataclass(eq=False)
class _Lane:
    """The requests of one micro-batch of a step (one `KVRows`, or its parts: a prefill split writes a request's
    rows from two micro-batches) and what is known of them on the host, computed once for every layer."""

    slots: List[int]
    seq_lens: List[int]  # the step's rows per request
    index: int  # the number of its ring
    held: List[int]  # rows per request before this step's: what a prefetch copies
    table: torch.Tensor  # slot -> its request's row in the buffers (device)
    stored: Set[int] = dataclasses.field(default_factory=set)  # layers whose new rows went to the host


@dataclasses.dataclass(eq=False)
class _Slots:
    """A lane number's ring (kept for the next step's lane of that number), a slot holding ``(lane, layer)``, and
    what the main stream wrote into each slot."""

    ring: Ring
    written: List[int]  # rows written since the slot took what it holds
    unstored: List[bool]  # rows written since its last write-back


class OffloadedKVCache(KVCache):
    """A `KVCache` whose store is in host memory, each layer's history prefetched into a `overlap.offload.Ring` of
    ``ring`` device slots per micro-batch on the ``kv_offload`` stream while the layer before computes (module
    docstring).

    ``device`` is where attention runs (default: the current path's device). `prefetch_report` says what the
    prefetches cost and hid; `finish` waits for the copies, `close` (or ``with``) frees the buffers and events.
    """

    def __init__(self, n_layers: int, max_requests: int, max_len: int, k_shape: Sequence[int],
                 v_shape: Optional[Sequence[int]] = None, *, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None, ring: int = 2):
        _refuse_graph_paths()
        if not isinstance(ring, int) or ring < 2:
            raise KVCacheError(f"ring must be an integer of at least 2, got {ring!r}: layer L+1's prefetch goes to "
                               f"another buffer than the one layer L reads")
        device = torch.device(device) if device is not None else backends.current().device()
        super().__init__(n_layers, max_requests, max_len, k_shape, v_shape, dtype=dtype, device=device)
        self.device = device
        self.n_layers, self.ring = n_layers, ring
        self.name = f"kvdecode{next(_names)}"
        self._lanes: Dict[_LaneKey, _Lane] = {}  # a step's (slots, lengths) -> its lane, until they are counted
        self._slots: Dict[int, _Slots] = {}  # lane number -> its ring, kept for the next step's lane
        self._meter = PrefetchMeter()
        self._device_bytes = DeviceBytes()
        self._closed = False

    @classmethod
    def like(cls, cache: KVCache, ring: int = 2) -> "OffloadedKVCache":
        """An offloaded cache of ``cache``'s layers, slots, room, shapes, dtype and device (empty)."""
        return cls(cache.k.shape[0], cache.k.shape[1], cache.max_len, cache.k.shape[3:], cache.v.shape[3:],
                   dtype=cache.k.dtype, device=cache.device, ring=ring)

    def _allocate(self, shape: Tuple[int, ...], dtype: torch.dtype, device: Optional[torch.device]) -> torch.Tensor:
        pin = device is not None and device.type != "cpu"
        try:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)
        except (RuntimeError, MemoryError) as e:
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            raise KVCacheError(f"cannot allocate the host store ({n} bytes{' pinned' if pin else ''}): "
                               f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

    # ---- memory and the report -----------------------------------------------------------------
    @property
    def host_bytes(self) -> int:
        """Bytes of the host store."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v))

    @property
    def device_bytes(self) -> int:
        """Device bytes of the slots now."""
        return self._device_bytes.now

    @property
    def peak_device_bytes(self) -> int:
        """The most device bytes the slots have held."""
        return self._device_bytes.peak

    @property
    def rings(self) -> Tuple[Ring, ...]:
        """The rings of device slots the cache stages keys and values through, one per micro-batch lane so far."""
        return tuple(s.ring for s in self._slots.values())

    def prefetch_report(self) -> PrefetchReport:
        """The prefetches and write-backs so far (waits for the copies in flight first)."""
        self.finish()
        return self._meter.report()

    def finish(self) -> None:
        """The host waits until every copy this cache issued has landed."""
        if not self._closed:
            for s in self._slots.values():
                s.ring.synchronize()

    def close(self) -> None:
        """Wait for the copies, free the slots and their events (twice is fine)."""
        if self._closed:
            return
        try:
            self.finish()
            self._meter.fold()
        finally:
            self._closed = True
            self._lanes.clear()
            for s in self._slots.values():
                s.ring.close()
            self._slots.clear()

    def __enter__(self) -> "OffloadedKVCache":
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise KVCacheError(f"OffloadedKVCache {self.name!r} is closed")

    def _check_usable(self) -> None:
        self._check_open()
        _refuse_graph_paths()  # made eagerly, then used inside a compiled region

    # ---- the KVCache interface ---------------------------------------------------------------------
    def rows(self, slots: Sequence[int], seq_lens: Optional[Sequence[int]] = None) -> KVRows:
        """`KVCache.rows`; the copy of layer 0's history of them starts."""
        self._check_usable()
        rows = super().rows(slots, seq_lens)
        if rows.slots:
            lane = self._lane(rows)
            if self._slots_of(lane).ring.held(0) != (lane, 0):
                self._prefetch(lane, 0)
        return rows

    def write(self, layer: int, rows: KVRows, k: torch.Tensor, v: torch.Tensor) -> None:
        """`KVCache.write`: into the layer's slot (once its prefetch has landed); once the step's rows of the
        layer are all there, on the copy stream to the host store too. ``rows`` may be part of the rows that
        `rows` placed (a prefill micro-batch's tokens: ``where`` cut, the rest the same)."""
        self._check_usable()
        n = self._check_kv(layer, rows, k, v)
        if n == 0:
            return
        lane = self._lane(rows)
        bk, bv = self._staged(lane, layer)
        s, slot = self._slots_of(lane), layer % self.ring
        s.ring.wait_drained(slot)  # a write-back still reads what the slot held
        at = (lane.table[rows.where[:, 0]], rows.where[:, 1])
        bk.index_put_(at, k.to(self.k.dtype))
        bv.index_put_(at, v.to(self.v.dtype))
        s.written[slot] += n
        s.unstored[slot] = True
        if s.written[slot] >= sum(lane.seq_lens):
            self._store(s, slot)

    def history(self, layer: int, rows: KVRows) -> Tuple[torch.Tensor, torch.Tensor]:
        """`KVCache.history`, as views of the layer's slot (read them before the layer ``ring`` further on
        starts); the copy of layer ``layer + 1``'s history of ``rows`` starts."""
        self._check_usable()
        n = len(rows.slots)
        if n == 0:
            return (torch.zeros((0, rows.longest) + tuple(self.k.shape[3:]), dtype=self.k.dtype, device=self.device),
                    torch.zeros((0, rows.longest) + tuple(self.v.shape[3:]), dtype=self.v.dtype, device=self.device))
        lane = self._lane(rows)
        bk, bv = self._staged(lane, layer)
        out = bk[:n, :rows.longest], bv[:n, :rows.longest]
        nxt = layer + 1
        if nxt < self.n_layers and self._slots_of(lane).ring.held(nxt % self.ring) != (lane, nxt):
            self._prefetch(lane, nxt)
        return out

    def advance(self, rows: KVRows) -> None:
        """`KVCache.advance`; rows written but not yet sent to the host go now, and the lane is free."""
        super().advance(rows)
        lane = self._lanes.pop(_lane_key(rows), None)
        if lane is not None:
            self._flush(lane)
        self._meter.fold()

    def release(self, slots: Sequence[int]) -> None:
        """`KVCache.release`; a lane holding these slots whose rows were never counted ends."""
        super().release(slots)
        gone = set(slots)
        for key, lane in list(self._lanes.items()):
            if gone & set(lane.slots):
                del self._lanes[key]
                self._flush(lane)

    # ---- lanes and slots --------------------------------------------------------------------------------
    def _lane(self, rows: KVRows) -> _Lane:
        key = _lane_key(rows)
        lane = self._lanes.get(key)
        if lane is not None:
            return lane
        taken = {ln.index for ln in self._lanes.values()}
        table = torch.zeros(len(self.lengths), dtype=torch.long, device=self.device)
        table[rows.index] = torch.arange(len(rows.slots), device=self.device)
        lane = _Lane(list(rows.slots), list(rows.seq_lens), next(i for i in itertools.count() if i not in taken),
                     [self.lengths[s] for s in rows.slots], table)
        self._lanes[key] = lane
        return lane

    def _slots_of(self, lane: _Lane) -> _Slots:
        s = self._slots.get(lane.index)
        if s is None:
            ring = Ring(f"{self.name}.lane{lane.index}", self.ring, self.k.shape[2:], self.v.shape[2:], self.k.dtype,
                        self.device, self._device_bytes, prefetches=self._meter)
            s = self._slots[lane.index] = _Slots(ring, [0] * self.ring, [False] * self.ring)
        return s

    def _take(self, lane: _Lane, layer: int) -> int:
        """Layer ``layer``'s slot of ``lane``, now holding it: what it held and nobody sent to the host yet goes
        first; buffers too small for the lane's requests are replaced."""
        s, slot = self._slots_of(lane), layer % self.ring
        if s.unstored[slot]:
            self._store(s, slot)
        s.ring.buffers(slot, len(lane.slots))
        s.ring.hold(slot, (lane, layer))
        s.written[slot] = 0
        return slot

    def _flush(self, lane: _Lane) -> None:
        """Send the lane's rows written and not yet sent to the host."""
        s = self._slots_of(lane)
        for slot in range(self.ring):
            held = s.ring.held(slot)
            if s.unstored[slot] and held is not None and held[0] is lane:
                self._store(s, slot)

    # ---- the copies -------------------------------------------------------------------------------------
    def _prefetch(self, lane: _Lane, layer: int) -> None:
        """Start filling ``layer``'s slot with the history of the lane's requests, on the copy stream."""
        slot = self._take(lane, layer)
        # the rows each request held before this step; once this layer's were sent to the host, these too
        ends = [h + n for h, n in zip(lane.held, lane.seq_lens)] if layer in lane.stored else lane.held
        held = [(i, s, end) for i, (s, end) in enumerate(zip(lane.slots, ends)) if end]
        if not held:
            return  # nothing to copy (a prefill); a prefetch still in flight into the slot is waited for
        sources = [(i, end, self.k[layer, s, :end], self.v[layer, s, :end]) for i, s, end in held]

        def copy(bk: torch.Tensor, bv: torch.Tensor, timing: Optional[CopyTiming]) -> None:
            pairs = [pair for i, end, hk, hv in sources for pair in ((bk[i, :end], hk), (bv[i, :end], hv))]
            issue_copies("kv_prefetch", pairs, timing, cache=self.name, layer=layer, lane=lane.index)

        self._slots_of(lane).ring.fill(slot, copy, sum(_nbytes(hk) + _nbytes(hv) for _, _, hk, hv in sources))

    def _staged(self, lane: _Lane, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The buffers of the slot holding ``layer``'s history of the lane's requests, its prefetch landed."""
        s, slot = self._slots_of(lane), layer % self.ring
        if s.ring.held(slot) != (lane, layer):
            self._prefetch(lane, layer)  # not started ahead: the main stream waits for all of it
        return s.ring.wait_filled(slot)

    def _store(self, s: _Slots, slot: int) -> None:
        """Drain the new rows in ``slot`` to the host store on the copy stream."""
        lane, layer = s.ring.held(slot)
        rows = [(i, slot_, start, start + n) for i, (slot_, start, n) in
                enumerate(zip(lane.slots, lane.held, lane.seq_lens)) if n]

        def copy(bk: torch.Tensor, bv: torch.Tensor) -> None:
            pairs = [pair for i, r, a, b in rows
                     for pair in ((self.k[layer, r, a:b], bk[i, a:b]), (self.v[layer, r, a:b], bv[i, a:b]))]
            issue_copies("kv_store", pairs, cache=self.name, layer=layer, lane=lane.index)

        s.ring.drain(slot, copy, sum(_nbytes(self.k[layer, r, a:b]) + _nbytes(self.v[layer, r, a:b])
                                     for _, r, a, b in rows))
        s.unstored[slot] = False
        lane.stored.add(layer)

    def __repr__(self) -> str:
        return (f"OffloadedKVCache({self.name}: {self.n_layers} layers x {len(self.lengths)} requests x "
                f"{self.max_len} rows, k{tuple(self.k.shape[3:])} v{tuple(self.v.shape[3:])} {self.k.dtype}, "
                f"device={self.device}, ring={self.ring})")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _lane_key(rows: KVRows) -> _LaneKey:
    return tuple(rows.slots), tuple(rows.seq_lens)


def _refuse_graph_paths() -> None:
    backend = backends.current()
    if backend.is_graph:
        raise KVCacheError(f"KV offload in decode is not available on the {backend.name!r} path: a copy between "
                           f"host memory and the device on its own stream cannot be expressed inside a compiled "
                           f"graph; decode eagerly (npu/cuda), or keep the cache on the device (KVCache)")


__all__ = ["OffloadedKVCache"]
