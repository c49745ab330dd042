"""KV-cache offload: copy each layer's keys and values off the device on the copy stream.

The production pattern (DeepSeek-V3.2): attention writes a layer's keys and values into a small
device-side working buffer (a ring of ``ring`` slots); the copy stream waits on an event
recorded after that write, copies the slot to the host store and records a copy-done event; the
main stream waits on that event before it writes the slot again. So the device holds ``ring``
slots instead of every layer's keys and values, and the copy runs under the next layer's compute.

The reverse direction, `OffloadCache.prefetch` / `OffloadCache.get`, copies a layer's keys and
values back into a ring of prefetch slots while the current layer computes, with the same two
events per slot (slot free -> copy -> slot ready).

On ``npu`` / ``cuda`` the host store is pinned memory and the copies are ``non_blocking``; on
``cpu`` they run on the copy stream's worker thread, into memory or a memory-mapped file. The
``ge`` and ``aclgraph`` paths are refused: a copy into host memory on a separate stream cannot
be expressed inside a compiled graph (run the offload eagerly, or pass ``enabled=False``).
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import backends
from ..context import is_enabled
from ..copy import copy_
from ..events import Event, event, release_events
from ..streams import KV_OFFLOAD, record_stream, stream, synchronize
from ._stores import STORES, KVStore, StoreError, open_store, store_bytes

_names = itertools.count()
Shape = Union[int, Sequence[int]]


class OffloadError(ValueError):
    """An offload request that cannot be served; raised before any copy is issued."""


def _shape(s: Shape, what: str) -> Tuple[int, ...]:
    out = (int(s),) if isinstance(s, int) else tuple(int(d) for d in s)
    if any(d < 1 for d in out):
        raise OffloadError(f"{what} {out} must have positive sizes")
    return out


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class _Ring:
    """Device-side slots (K and V buffers of ``tokens`` rows each) and their two events per slot."""

    def __init__(self, name: str, size: int, tokens: int, before: str, after: str):
        self.tokens = tokens
        self.buffers: List[Optional[Tuple[torch.Tensor, torch.Tensor]]] = [None] * size
        self.before: List[Event] = [event(f"{name}.{before}{i}") for i in range(size)]
        self.after: List[Event] = [event(f"{name}.{after}{i}") for i in range(size)]
        self.used = [False] * size
        self._next = 0

    def take(self) -> int:
        slot = self._next
        self._next = (slot + 1) % len(self.buffers)
        return slot


class OffloadCache:
    """Keys and values of every layer in a host store, staged through a ring of device slots.

    ``kv_shape`` is the per-token shape of the keys (e.g. ``(heads, head_dim)``); ``v_shape``
    that of the values when it differs. ``store`` is ``"memory"`` (pinned on a device),
    ``"mmap"`` (a file: ``file``, a folder for one file per rank, or a temporary file) or
    ``"device"`` (no offload: every layer stays on the device, the baseline to compare with).
    ``enabled=False`` keeps the same data placement but copies synchronously on the current
    stream. ``chunk_tokens`` is the most tokens one `offload` call carries (default ``max_tokens``);
    ``prefix_tokens`` says how many tokens per layer an existing mmap file already holds.
    """

    def __init__(self, n_layers: int, max_tokens: int, kv_shape: Shape, dtype: torch.dtype = torch.float32,
                 device: Union[str, torch.device, None] = None, *, v_shape: Optional[Shape] = None, ring: int = 2,
                 chunk_tokens: Optional[int] = None, store: str = "memory", file: Optional[str] = None,
                 prefix_tokens: int = 0, enabled: bool = True, name: Optional[str] = None):
        for what, val in (("n_layers", n_layers), ("max_tokens", max_tokens), ("ring", ring)):
            if int(val) < 1:
                raise OffloadError(f"{what} must be >= 1, got {val}")
        chunk_tokens = max_tokens if chunk_tokens is None else int(chunk_tokens)
        if not 1 <= chunk_tokens <= max_tokens:
            raise OffloadError(f"chunk_tokens={chunk_tokens} must lie in [1, max_tokens={max_tokens}]")
        if not 0 <= prefix_tokens <= max_tokens:
            raise OffloadError(f"prefix_tokens={prefix_tokens} must lie in [0, max_tokens={max_tokens}]")
        if store not in STORES:
            raise OffloadError(f"unknown store {store!r}; expected one of {', '.join(STORES)}")
        if not (isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype == torch.int8)):
            raise OffloadError(f"dtype must be a floating point torch.dtype (or int8), got {dtype!r}")
        backend = backends.current()
        self.asynchronous = bool(enabled) and is_enabled() and store != "device"
        self._check_path(backend)
        self.n_layers, self.max_tokens, self.chunk_tokens = int(n_layers), int(max_tokens), chunk_tokens
        self.k_shape = _shape(kv_shape, "kv_shape")
        self.v_shape = self.k_shape if v_shape is None else _shape(v_shape, "v_shape")
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else backend.device()
        self.name = name or f"kv{next(_names)}"
        pin = store == "memory" and self.device.type in ("cuda", "npu")
        try:
            self._store: KVStore = open_store(store, self.n_layers, self.max_tokens, self.k_shape, self.v_shape,
                                              dtype, self.device, file, self.name, pin)
        except StoreError as e:
            raise OffloadError(str(e)) from None
        if prefix_tokens and not self._store.existed:
            raise OffloadError(f"prefix_tokens={prefix_tokens} needs an existing mmap file holding that prefix")
        self._tokens = [int(prefix_tokens)] * self.n_layers
        self._out = _Ring(f"{self.name}.offload", ring, chunk_tokens, "written", "copied")
        self._in = _Ring(f"{self.name}.prefetch", ring, self.max_tokens, "free", "ready")
        self._fetched: Dict[int, Tuple[int, int, int]] = {}  # prefetch slot -> (layer, start, end)
        self._acquired: Optional[Tuple[int, int, int]] = None  # (slot, layer, tokens) handed out by acquire
        self._device_bytes = self._store.nbytes if store == "device" else 0
        self.peak_device_bytes = self._device_bytes

    # ----------------------------------------------------------------- properties
    @property
    def store(self) -> str:
        return self._store.kind

    @property
    def file(self) -> Optional[str]:
        """The file behind an mmap store."""
        return self._store.file

    @property
    def host_bytes(self) -> int:
        """Bytes of the store (on the host unless ``store="device"``)."""
        return 0 if self.store == "device" else self._store.nbytes

    @property
    def device_bytes(self) -> int:
        """Device bytes the cache holds now: its slots, or the whole store when ``store="device"``."""
        return self._device_bytes

    def tokens(self, layer: int) -> int:
        """Tokens of ``layer`` written to the store so far (the end of the furthest offload)."""
        self._check_layer(layer)
        return self._tokens[layer]

    # ----------------------------------------------------------------- validation
    def _check_path(self, backend: Optional[backends.Backend] = None) -> None:
        backend = backend or backends.current()
        if self.asynchronous and backend.is_graph:
            raise OffloadError(
                f"KV offload is not available on the {backend.name!r} path: a copy into host memory on a separate "
                f"copy stream cannot be expressed inside a compiled graph. Run the offload on the eager "
                f"path (npu/cuda), or pass enabled=False for plain synchronous copies outside the graph")

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.n_layers:
            raise OffloadError(f"layer {layer} out of range for a cache of {self.n_layers} layers")

    def _check_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, offset: Optional[int]) -> Tuple[int, int]:
        self._check_path()
        self._check_layer(layer)
        for what, t, shape in (("keys", k, self.k_shape), ("values", v, self.v_shape)):
            if not isinstance(t, torch.Tensor):
                raise OffloadError(f"{what} must be a tensor, got {type(t).__name__}")
            if t.dtype != self.dtype:
                raise OffloadError(f"{what} of layer {layer} are {t.dtype}, the cache holds {self.dtype}")
            if t.dim() != 1 + len(shape) or tuple(t.shape[1:]) != shape:
                raise OffloadError(f"{what} of layer {layer} have shape {tuple(t.shape)}, expected "
                                   f"(tokens, {', '.join(map(str, shape))})")
            if t.device != self.device:
                raise OffloadError(f"{what} of layer {layer} are on {t.device}, the cache works on {self.device}")
        n = k.shape[0]
        if v.shape[0] != n:
            raise OffloadError(f"layer {layer}: {n} key tokens but {v.shape[0]} value tokens")
        if n > self.chunk_tokens:
            raise OffloadError(f"layer {layer}: {n} tokens in one offload, the device slots hold chunk_tokens="
                               f"{self.chunk_tokens}")
        offset = self._tokens[layer] if offset is None else int(offset)
        self._check_range(layer, offset, offset + n)
        return n, offset

    def _check_range(self, layer: int, start: int, end: int) -> None:
        if start < 0 or end > self.max_tokens or start > end:
            raise OffloadError(f"layer {layer}: tokens [{start}, {end}) do not fit a host store of max_tokens="
                               f"{self.max_tokens}")

    def check_capacity(self, tokens: int) -> None:
        """Raise `OffloadError` unless a prefill of ``tokens`` tokens per layer fits the store."""
        if tokens > self.max_tokens:
            need = store_bytes(self.n_layers, tokens, self.k_shape, self.v_shape, self.dtype)
            raise OffloadError(f"host store too small: {tokens} tokens per layer requested, it holds max_tokens="
                               f"{self.max_tokens} ({self._store.nbytes} bytes; {need} needed)")

    # ----------------------------------------------------------------- slots
    def _alloc(self, ring: _Ring, slot: int) -> Tuple[torch.Tensor, torch.Tensor]:
        bufs = ring.buffers[slot]
        if bufs is None:
            bufs = (torch.empty(ring.tokens, *self.k_shape, dtype=self.dtype, device=self.device),
                    torch.empty(ring.tokens, *self.v_shape, dtype=self.dtype, device=self.device))
            ring.buffers[slot] = bufs
            self._device_bytes += _nbytes(*bufs)
            self.peak_device_bytes = max(self.peak_device_bytes, self._device_bytes)
        return bufs

    def _wait_copied(self, slot: int) -> None:
        """Main stream: the slot's previous copy to the host has finished reading it."""
        if self.asynchronous and self._out.used[slot]:
            self._out.after[slot].wait()

    def _wait_written(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Copy stream: attention's write of the slot has finished."""
        return self._out.before[slot].wait(k, v)

    def _take_out_slot(self) -> int:
        slot = self._out.take()
        self._wait_copied(slot)
        self._alloc(self._out, slot)
        return slot

    def acquire(self, layer: int, tokens: int, offset: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Device buffers safe to write now: let attention write ``tokens`` keys and values into the
        returned views, then pass them to `offload` (with the same ``offset``). Saves `offload`'s
        staging copy. With ``store="device"`` the views are the store itself, at ``offset``."""
        self._check_layer(layer)
        if not 1 <= tokens <= self.chunk_tokens:
            raise OffloadError(f"layer {layer}: {tokens} tokens requested, the device slots hold chunk_tokens="
                               f"{self.chunk_tokens}")
        offset = self._tokens[layer] if offset is None else int(offset)
        self._check_range(layer, offset, offset + tokens)
        if self.store == "device":
            self._acquired = (-1, layer, tokens)
            return self._store.k[layer, offset:offset + tokens], self._store.v[layer, offset:offset + tokens]
        slot = self._take_out_slot()
        self._acquired = (slot, layer, tokens)
        k, v = self._out.buffers[slot]
        return k[:tokens], v[:tokens]

    # ----------------------------------------------------------------- offload
    def offload(self, layer: int, k: torch.Tensor, v: torch.Tensor, offset: Optional[int] = None) -> None:
        """Copy ``k`` / ``v`` (``[tokens, *shape]``) of ``layer`` to the store at token ``offset``.

        Call it right after attention wrote them; it returns once the copy is issued. ``offset``
        defaults to the end of what ``layer`` holds already, so micro-batch 1 lands after
        micro-batch 0. Inputs are checked before anything is issued.
        """
        n, offset = self._check_kv(layer, k, v, offset)
        if self.store == "device":
            dk, dv = self._store.k[layer, offset:offset + n], self._store.v[layer, offset:offset + n]
            self._acquired = None
            if not (k.data_ptr() == dk.data_ptr() and v.data_ptr() == dv.data_ptr()):
                copy_(dk, k, name="kv_keep", layer=layer)
                copy_(dv, v, name="kv_keep", layer=layer)
            self._tokens[layer] = max(self._tokens[layer], offset + n)
            return
        slot = self._staged_slot(layer, k, v)
        sk, sv = (b[:n] for b in self._out.buffers[slot])
        hk = self._store.k[layer, offset:offset + n]
        hv = self._store.v[layer, offset:offset + n]
        self._out.used[slot] = True
        if self.asynchronous:
            self._out.before[slot].record(sk, sv)
            with stream(KV_OFFLOAD):
                sk, sv = self._wait_written(slot, sk, sv)
                copy_(hk, sk, name="kv_offload", layer=layer, slot=slot, offset=offset)
                copy_(hv, sv, name="kv_offload", layer=layer, slot=slot, offset=offset)
                self._out.after[slot].record(hk, hv)
            record_stream(self._out.buffers[slot][0], KV_OFFLOAD)
            record_stream(self._out.buffers[slot][1], KV_OFFLOAD)
        else:
            copy_(hk, sk, name="kv_offload", layer=layer, offset=offset)
            copy_(hv, sv, name="kv_offload", layer=layer, offset=offset)
        self._tokens[layer] = max(self._tokens[layer], offset + n)

    def _staged_slot(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """The slot holding ``k`` / ``v``: the acquired one, or a fresh one they are copied into."""
        acquired, self._acquired = self._acquired, None
        if acquired is not None:
            slot, a_layer, a_tokens = acquired
            bk, bv = self._out.buffers[slot]
            if (k.data_ptr() == bk.data_ptr() and v.data_ptr() == bv.data_ptr()
                    and a_layer == layer and k.shape[0] == a_tokens):
                return slot
        slot = self._take_out_slot()
        bk, bv = self._out.buffers[slot]
        n = k.shape[0]
        copy_(bk[:n], k, name="kv_stage", layer=layer, slot=slot)
        copy_(bv[:n], v, name="kv_stage", layer=layer, slot=slot)
        return slot

    # ----------------------------------------------------------------- prefetch
    def _resolve(self, layer: int, start: int, end: Optional[int]) -> Tuple[int, int]:
        self._check_path()
        self._check_layer(layer)
        end = self._tokens[layer] if end is None else int(end)
        if not 0 <= start < end <= self._tokens[layer]:
            raise OffloadError(f"layer {layer}: tokens [{start}, {end}) requested, the store holds "
                               f"{self._tokens[layer]} tokens of it")
        return start, end

    def prefetch(self, layer: int, start: int = 0, end: Optional[int] = None) -> None:
        """Start copying tokens ``[start, end)`` of ``layer`` back to a device slot (on the copy stream).

        `get` waits for it. A slot is reused ``ring`` prefetches later: read what `get` returned
        before then.
        """
        start, end = self._resolve(layer, start, end)
        if self.store == "device":
            return
        slot = self._in.take()
        bk, bv = self._alloc(self._in, slot)
        n = end - start
        dk, dv = bk[:n], bv[:n]
        hk, hv = self._store.k[layer, start:end], self._store.v[layer, start:end]
        self._fetched = {s: key for s, key in self._fetched.items() if s != slot and key != (layer, start, end)}
        self._fetched[slot] = (layer, start, end)
        self._in.used[slot] = True
        if not self.asynchronous:
            copy_(dk, hk, name="kv_prefetch", layer=layer)
            copy_(dv, hv, name="kv_prefetch", layer=layer)
            return
        self._in.before[slot].record(dk, dv)  # after the main stream's reads of the slot's last contents
        with stream(KV_OFFLOAD):
            dk, dv = self._wait_free(slot, dk, dv)
            copy_(dk, hk, name="kv_prefetch", layer=layer, slot=slot, start=start)
            copy_(dv, hv, name="kv_prefetch", layer=layer, slot=slot, start=start)
            self._in.after[slot].record(dk, dv)

    def get(self, layer: int, start: int = 0, end: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[start, end)`` of ``layer`` on the device (prefetching now if not done before)."""
        start, end = self._resolve(layer, start, end)
        if self.store == "device":
            return self._store.k[layer, start:end], self._store.v[layer, start:end]
        key = (layer, start, end)
        slot = next((s for s, k in self._fetched.items() if k == key), None)
        if slot is None:
            self.prefetch(layer, start, end)
            slot = next(s for s, k in self._fetched.items() if k == key)
        n = end - start
        dk, dv = (b[:n] for b in self._in.buffers[slot])
        if self.asynchronous:
            dk, dv = self._wait_ready(slot, dk, dv)
        return dk, dv

    def _wait_free(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Copy stream: the main stream has finished reading the prefetch slot's last contents."""
        return self._in.before[slot].wait(k, v)

    def _wait_ready(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Main stream: the prefetch into the slot has landed."""
        return self._in.after[slot].wait(k, v)

    # ----------------------------------------------------------------- host side
    def finish(self) -> None:
        """Host waits until every issued copy has landed."""
        if self.asynchronous:
            for ring in (self._out, self._in):
                for slot, used in enumerate(ring.used):
                    if used:
                        ring.after[slot].synchronize()
        elif self.device.type != "cpu":
            synchronize()

    def host_kv(self, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The stored keys and values of ``layer`` (``[tokens, *shape]``), after `finish`."""
        self._check_layer(layer)
        self.finish()
        n = self._tokens[layer]
        return self._store.k[layer, :n], self._store.v[layer, :n]

    def reset(self) -> None:
        """Start a new prefill into the same store and slots (waits for the copies in flight)."""
        self.finish()
        self._tokens = [0] * self.n_layers
        self._fetched.clear()
        self._acquired = None

    def close(self) -> None:
        """Wait for the copies, free the slots and remove a temporary store file."""
        self.finish()
        for ring in (self._out, self._in):
            ring.buffers = [None] * len(ring.buffers)
        self._device_bytes = 0
        self._store.close()
        release_events(f"{self.name}.")

    def __enter__(self) -> "OffloadCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"OffloadCache({self.name}: {self.n_layers} layers x {self.max_tokens} tokens, k{self.k_shape} "
                f"v{self.v_shape} {self.dtype}, store={self.store}, ring={len(self._out.buffers)}, "
                f"asynchronous={self.asynchronous})")
