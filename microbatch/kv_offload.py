"""Decode's KV cache in host memory: each layer's history prefetched on the ``kv_offload`` stream.

`OffloadedKVCache` is a `KVCache` (``admit``, ``release``, ``rows``, ``write``, ``history``, ``attend``,
``advance``), so `KVStep` and a model's decode attention use it unchanged. What lives where:

- The store, every layer's keys and values ``[n_layers, max_requests, max_len, *shape]``, is in host
  memory: pinned where the device is not the CPU; on the CPU a host tensor of its own.
- Each micro-batch of a step (the requests of one `KVRows`: a *lane*) has a ring of ``ring`` device
  buffers ``[its requests, max_len, *shape]``; layer L is staged in buffer ``L % ring``. A lane's
  buffers are its own, so one micro-batch never waits for another's prefetch, nor shares a buffer.
- Prefetch: placing a step's rows (`rows`) starts copying layer 0's history of them; reading layer L's
  history (`history`, before or after `write`) starts copying layer L+1's. The main stream records
  ``free`` (its reads and writes of what the buffer held are issued), the copy stream waits for it,
  copies the rows each request holds (one copy per request, contiguous on both sides: a strided copy
  between host and device would go through a temporary) and records ``ready``; layer L+1's `write` or
  `history` makes the main stream wait for ``ready`` first.
- Write-back: `write` puts the new rows in the buffer (this step's attention reads them there); once
  the step's rows of the layer are all there (a prefill split writes a request's rows from two
  micro-batches), the main stream records ``written``, the copy stream waits for it, copies them from
  the buffer to the host store (ahead of any later prefetch of that layer: same stream) and records
  ``stored``, which the main stream waits for before it writes the buffer again.

`prefetch_report` counts the prefetches and their bytes and says how much of their copy time was
hidden: the part during which the main stream was not waiting for it.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

import overlap
from overlap import KV_OFFLOAD, backends
from overlap.events import Event, release_events

from .kv_cache import KVCache, KVCacheError, KVRows

_names = itertools.count()
Pair = Tuple[torch.Tensor, torch.Tensor]  # (destination, source) of one copy
_LaneKey = Tuple[Tuple[int, ...], Tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class PrefetchReport:
    """The prefetches so far (one per layer, step and micro-batch with history to copy) and the write-backs.

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


@dataclasses.dataclass(eq=False)
class _Copy:
    """One prefetch: its bytes, whether it ran beside the main stream, and its stamps (set as they happen)."""

    nbytes: int
    asynchronous: bool
    start: Any = None
    end: Any = None
    waited: Any = None  # when the main stream first waited for it


class _Meter:
    """The prefetches' times folded into totals once they have finished (no host wait for it)."""

    def __init__(self) -> None:
        self.stamps = _Stamps()
        self.open: List[_Copy] = []
        self.count = self.bytes = self.stores = self.store_bytes = 0
        self.seconds = self.exposed = 0.0

    def fold(self) -> None:
        left = []
        for c in self.open:
            if not self.stamps.done(c.end):
                left.append(c)
                continue
            start, end = self.stamps.seconds(c.start), self.stamps.seconds(c.end)
            took = max(end - start, 0.0)
            if not c.asynchronous:
                exposed = took
            elif self.stamps.done(c.waited):  # else the main stream reaches its wait after the copy ended
                exposed = min(max(end - max(self.stamps.seconds(c.waited), start), 0.0), took)
            else:
                exposed = 0.0
            self.seconds += took
            self.exposed += exposed
        self.open = left


@dataclasses.dataclass(eq=False)
class _Lane:
    """The requests of one micro-batch of a step (one `KVRows`, or its parts: a prefill split writes a request's
    rows from two micro-batches) and what is known of them on the host, computed once for every layer."""

    slots: List[int]
    seq_lens: List[int]  # the step's rows per request
    index: int  # the number of its ring of buffers (and of their events)
    held: List[int]  # rows per request before this step's: what a prefetch copies
    table: torch.Tensor  # slot -> its request's row in the buffers (device)
    stored: Set[int] = dataclasses.field(default_factory=set)  # layers whose new rows went to the host


@dataclasses.dataclass(eq=False)
class _Buffer:
    """One device buffer of a lane's ring: what it holds, the prefetch into it the main stream has not waited
    for, the rows written to it since, and the write-back still reading it."""

    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    holds: Optional[Tuple[_Lane, int]] = None  # (lane, layer) staged here, or being copied here
    pending: Optional[_Copy] = None
    ready: Optional[Event] = None  # recorded on the copy stream after the pending prefetch
    written: int = 0  # rows written since it took ``holds``
    unstored: bool = False  # rows written since its last write-back
    storing: Optional[Event] = None  # recorded on the copy stream after its last write-back


class OffloadedKVCache(KVCache):
    """A `KVCache` whose store is in host memory, each layer's history prefetched into a ring of ``ring`` device
    buffers per micro-batch on the ``kv_offload`` stream while the layer before computes (module docstring).

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
        self._buffers: Dict[int, List[_Buffer]] = {}  # lane number -> its ring, kept for the next step's lane
        self._meter = _Meter()
        self._device_bytes = self._peak = 0
        self._done = overlap.event(f"{self.name}.done")  # recorded on the copy stream after each launch
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
        """Device bytes of the buffers now."""
        return self._device_bytes

    @property
    def peak_device_bytes(self) -> int:
        """The most device bytes the buffers have held."""
        return self._peak

    def prefetch_report(self) -> PrefetchReport:
        """The prefetches and write-backs so far (waits for the copies in flight first)."""
        self.finish()
        m = self._meter
        m.fold()
        return PrefetchReport(m.count, m.bytes, m.seconds, m.exposed, m.stores, m.store_bytes)

    def finish(self) -> None:
        """The host waits until every copy this cache issued has landed."""
        if not self._closed:
            self._done.synchronize()

    def close(self) -> None:
        """Wait for the copies, free the buffers and the events (twice is fine)."""
        if self._closed:
            return
        try:
            self.finish()
            self._meter.fold()
        finally:
            self._closed = True
            self._lanes.clear()
            self._buffers.clear()
            self._device_bytes = 0
            release_events(f"{self.name}.")

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
            if self._ring(lane)[0].holds != (lane, 0):
                self._prefetch(lane, 0)
        return rows

    def write(self, layer: int, rows: KVRows, k: torch.Tensor, v: torch.Tensor) -> None:
        """`KVCache.write`: into the layer's buffer (once its prefetch has landed); once the step's rows of the
        layer are all there, on the copy stream to the host store too. ``rows`` may be part of the rows that
        `rows` placed (a prefill micro-batch's tokens: ``where`` cut, the rest the same)."""
        self._check_usable()
        n = self._check_kv(rows, k, v)
        if n == 0:
            return
        lane = self._lane(rows)
        buf = self._staged(lane, layer)
        if buf.storing is not None:  # a write-back still reads what the buffer held
            self._wait_stored(buf)
            buf.storing = None
        at = (lane.table[rows.where[:, 0]], rows.where[:, 1])
        buf.k.index_put_(at, k.to(self.k.dtype))
        buf.v.index_put_(at, v.to(self.v.dtype))
        buf.written += n
        buf.unstored = True
        if buf.written >= sum(lane.seq_lens):
            self._store(buf)

    def history(self, layer: int, rows: KVRows) -> Tuple[torch.Tensor, torch.Tensor]:
        """`KVCache.history`, as views of the layer's buffer (read them before the layer ``ring`` further on
        starts); the copy of layer ``layer + 1``'s history of ``rows`` starts."""
        self._check_usable()
        n = len(rows.slots)
        if n == 0:
            return (torch.zeros((0, rows.longest) + tuple(self.k.shape[3:]), dtype=self.k.dtype, device=self.device),
                    torch.zeros((0, rows.longest) + tuple(self.v.shape[3:]), dtype=self.v.dtype, device=self.device))
        lane = self._lane(rows)
        buf = self._staged(lane, layer)
        out = buf.k[:n, :rows.longest], buf.v[:n, :rows.longest]
        if layer + 1 < self.n_layers and self._ring(lane)[(layer + 1) % self.ring].holds != (lane, layer + 1):
            self._prefetch(lane, layer + 1)
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

    # ---- lanes and buffers ------------------------------------------------------------------------------
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

    def _ring(self, lane: _Lane) -> List[_Buffer]:
        ring = self._buffers.get(lane.index)
        if ring is None:
            ring = self._buffers[lane.index] = [_Buffer() for _ in range(self.ring)]
        return ring

    def _take(self, lane: _Lane, layer: int) -> _Buffer:
        """Layer ``layer``'s buffer of ``lane``, now holding it: what it held and nobody sent to the host yet
        goes first; a buffer too small for the lane's requests is replaced."""
        buf = self._ring(lane)[layer % self.ring]
        if buf.unstored:
            self._store(buf)
        n = len(lane.slots)
        if buf.k is None or buf.k.shape[0] < n:
            if buf.k is not None:
                self._device_bytes -= sum(t.numel() * t.element_size() for t in (buf.k, buf.v))
            buf.k = torch.zeros((n,) + tuple(self.k.shape[2:]), dtype=self.k.dtype, device=self.device)
            buf.v = torch.zeros((n,) + tuple(self.v.shape[2:]), dtype=self.v.dtype, device=self.device)
            buf.pending = buf.storing = None  # what is in flight lands in, or reads, the buffer dropped
            self._device_bytes += sum(t.numel() * t.element_size() for t in (buf.k, buf.v))
            self._peak = max(self._peak, self._device_bytes)
        buf.holds, buf.written = (lane, layer), 0
        return buf

    def _flush(self, lane: _Lane) -> None:
        """Send the lane's rows written and not yet sent to the host."""
        for buf in self._ring(lane):
            if buf.unstored and buf.holds is not None and buf.holds[0] is lane:
                self._store(buf)

    def _tag(self, lane: _Lane, layer: int, what: str) -> str:
        return f"{self.name}.lane{lane.index}.{what}{layer % self.ring}"

    # ---- the copies -------------------------------------------------------------------------------------
    def _prefetch(self, lane: _Lane, layer: int) -> None:
        """Start copying ``layer``'s history of the lane's requests into its buffer, on the copy stream."""
        buf = self._take(lane, layer)
        # the rows each request held before this step; once this layer's were sent to the host, these too
        ends = [h + n for h, n in zip(lane.held, lane.seq_lens)] if layer in lane.stored else lane.held
        pairs: List[Pair] = []
        for i, (slot, end) in enumerate(zip(lane.slots, ends)):
            if end:
                pairs += [(buf.k[i, :end], self.k[layer, slot, :end]), (buf.v[i, :end], self.v[layer, slot, :end])]
        if not pairs:
            return  # nothing to copy (a prefill); a prefetch still in flight into the buffer is waited for
        nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        free, ready = overlap.event(self._tag(lane, layer, "free")), overlap.event(self._tag(lane, layer, "ready"))
        free.record(buf.k, buf.v)  # after the main stream's reads and writes of what the buffer held
        caller = overlap.current_stream_tag()
        with overlap.stream(KV_OFFLOAD) as tag:
            self._wait_free(free, buf)
            copy = _Copy(nbytes, asynchronous=tag != caller)
            self._issue("kv_prefetch", pairs, copy, layer=layer, lane=lane.index)
            ready.record(buf.k, buf.v)
            self._done.record()
        overlap.record_stream(buf.k, KV_OFFLOAD)
        overlap.record_stream(buf.v, KV_OFFLOAD)
        buf.pending, buf.ready = copy, ready
        m = self._meter
        m.count, m.bytes = m.count + 1, m.bytes + nbytes
        m.open.append(copy)

    def _staged(self, lane: _Lane, layer: int) -> _Buffer:
        """The buffer holding ``layer``'s history of the lane's requests, its prefetch landed."""
        buf = self._ring(lane)[layer % self.ring]
        if buf.holds != (lane, layer):
            self._prefetch(lane, layer)  # not started ahead: the main stream waits for all of it
        if buf.pending is not None:
            buf.pending.waited = self._meter.stamps.now()
            self._wait_ready(buf)
            buf.pending = None
        return buf

    def _store(self, buf: _Buffer) -> None:
        """Copy the new rows in ``buf`` to the host store on the copy stream."""
        lane, layer = buf.holds
        pairs: List[Pair] = []
        for i, (slot, start, n) in enumerate(zip(lane.slots, lane.held, lane.seq_lens)):
            if n:
                end = start + n
                pairs += [(self.k[layer, slot, start:end], buf.k[i, start:end]),
                          (self.v[layer, slot, start:end], buf.v[i, start:end])]
        written, stored = (overlap.event(self._tag(lane, layer, w)) for w in ("written", "stored"))
        written.record(buf.k, buf.v)  # after the main stream's writes of the rows
        with overlap.stream(KV_OFFLOAD):
            self._wait_written(written, buf)
            self._issue("kv_store", pairs, None, layer=layer, lane=lane.index)
            stored.record(buf.k, buf.v)
            self._done.record()
        overlap.record_stream(buf.k, KV_OFFLOAD)
        overlap.record_stream(buf.v, KV_OFFLOAD)
        buf.storing, buf.unstored = stored, False
        lane.stored.add(layer)
        m = self._meter
        m.stores, m.store_bytes = m.stores + 1, m.store_bytes + sum(s.numel() * s.element_size() for _, s in pairs)

    def _issue(self, name: str, pairs: List[Pair], copy: Optional[_Copy], **meta: Any) -> None:
        """The copies of ``pairs`` as one launch on the current stream, its start and end stamped in ``copy``."""
        stamps = self._meter.stamps

        def run() -> None:
            if copy is not None:
                copy.start = stamps.now()
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            if copy is not None:
                copy.end = stamps.now()

        overlap.issue_host(name, run, reads=[s for _, s in pairs], writes=[d for d, _ in pairs],
                           cache=self.name, **meta)

    # The four waits, one method each (a test takes each one out and expects the sanitizer to object).
    def _wait_free(self, free: Event, buf: _Buffer) -> None:
        """Copy stream: the main stream's reads and writes of what the buffer held are done."""
        free.wait(buf.k, buf.v)

    def _wait_ready(self, buf: _Buffer) -> None:
        """Main stream: the prefetch into the buffer has landed."""
        buf.ready.wait(buf.k, buf.v)

    def _wait_written(self, written: Event, buf: _Buffer) -> None:
        """Copy stream: the main stream's writes of the new rows are done."""
        written.wait(buf.k, buf.v)

    def _wait_stored(self, buf: _Buffer) -> None:
        """Main stream: the write-back has finished reading the buffer."""
        buf.storing.wait(buf.k, buf.v)

    def __repr__(self) -> str:
        return (f"OffloadedKVCache({self.name}: {self.n_layers} layers x {len(self.lengths)} requests x "
                f"{self.max_len} rows, k{tuple(self.k.shape[3:])} v{tuple(self.v.shape[3:])} {self.k.dtype}, "
                f"device={self.device}, ring={self.ring})")


def _lane_key(rows: KVRows) -> _LaneKey:
    return tuple(rows.slots), tuple(rows.seq_lens)


def _refuse_graph_paths() -> None:
    backend = backends.current()
    if backend.is_graph:
        raise KVCacheError(f"KV offload in decode is not available on the {backend.name!r} path: a copy between "
                           f"host memory and the device on its own stream cannot be expressed inside a compiled "
                           f"graph; decode eagerly (npu/cuda), or keep the cache on the device (KVCache)")


__all__ = ["OffloadedKVCache", "PrefetchReport"]
