"""KV-cache offload: copy each layer's keys and values off the device on the copy stream.

The production pattern (DeepSeek-V3.2): attention writes a layer's keys and values into a small
device-side working buffer (a ring of ``ring`` slots); the copy stream waits on an event
recorded after that write, copies the slot to the host store and records a copy-done event; the
main stream waits on that event before it writes the slot again. So the device holds ``ring``
slots instead of every layer's keys and values, and the copy runs under the next layer's compute.

The reverse direction, `OffloadCache.prefetch` / `OffloadCache.get`, copies a layer's keys and
values back into a ring of prefetch slots while the current layer computes, with the same two
events per slot (slot free -> copy -> slot ready). Both rings are `overlap.offload.Ring`s, the one
mechanism decode's host KV cache stages through as well: the cache says what is copied where.

On ``npu`` / ``cuda`` the host store is pinned memory and the copies are ``non_blocking``; on
``cpu`` they run on the copy stream's worker thread, into memory or a memory-mapped file. The
``ge`` and ``aclgraph`` paths are refused: a copy into host memory on a separate stream cannot
be expressed inside a compiled graph (run the offload eagerly, or pass ``enabled=False``).

The parts: `_geometry` (checks), `ring` (the device slots, their events and copies), `meter` (the
device bytes), `_offload` and `_prefetch` (one direction each), `_keep` (``store="device"``),
`_stores` (the host stores).
"""
from __future__ import annotations

import itertools
import weakref
from typing import List, Optional, Tuple, Union

import torch

from .. import backends
from ..context import is_enabled
from ..streams import synchronize
from ._geometry import (Geometry, OffloadError, Shape, as_int, check_args, check_held, check_path, geometry,
                        resolve_device)
from ._keep import Keep
from ._offload import Offloader
from ._prefetch import Prefetcher
from ._stores import KVStore, StoreError, open_store
from .meter import DeviceBytes
from .ring import Ring

__all__ = ["OffloadCache", "OffloadError"]

_names = itertools.count()
_open_caches: "weakref.WeakValueDictionary[str, OffloadCache]" = weakref.WeakValueDictionary()


def _name(name: Optional[str]) -> str:
    """``name``, or a fresh ``kv<n>``; refused while an open cache has it (they would share events)."""
    if not name:
        name = f"kv{next(_names)}"
        while name in _open_caches:
            name = f"kv{next(_names)}"
    elif not isinstance(name, str):
        raise OffloadError(f"name must be a string, got {name!r}")
    elif name in _open_caches:
        raise OffloadError(f"a cache named {name!r} is open already: its events and files would be shared; "
                           f"close it first or pass another name")
    return name


def _open(store: str, g: Geometry, file: Optional[str], name: str, prefix_tokens: int) -> KVStore:
    pin = store == "memory" and g.device.type in ("cuda", "npu")
    try:
        return open_store(store, g.n_layers, g.max_tokens, g.k_shape, g.v_shape, g.dtype, g.device, file, name, pin,
                          prefix_tokens)
    except StoreError as e:
        raise OffloadError(str(e)) from None


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
        self._closed = True  # until the store is open
        n_layers, max_tokens, ring, chunk_tokens, prefix_tokens = check_args(
            n_layers, max_tokens, ring, chunk_tokens, prefix_tokens, store, dtype)
        self.asynchronous = bool(enabled) and is_enabled() and store != "device"
        check_path(self.asynchronous)
        device = resolve_device(device if device is not None else backends.current().device())
        self._geometry = g = geometry(n_layers, max_tokens, chunk_tokens, kv_shape, v_shape, dtype, device)
        self.n_layers, self.max_tokens, self.chunk_tokens = g.n_layers, g.max_tokens, g.chunk_tokens
        self.k_shape, self.v_shape, self.dtype, self.device = g.k_shape, g.v_shape, g.dtype, g.device
        self.name = _name(name)
        self._store = _open(store, g, file, self.name, prefix_tokens)
        self._tokens = [prefix_tokens] * self.n_layers
        self._ring_size = ring
        self._bytes = DeviceBytes(self._store.nbytes if store == "device" else 0)
        self._out: Union[Offloader, Keep]
        self._in: Union[Prefetcher, Keep]
        self._rings: List[Ring] = []
        try:
            if store == "device":
                self._out = self._in = Keep(self._store)
            else:
                # every row read was written first: the slots need no zero fill
                slots = (ring, g.k_shape, g.v_shape, g.dtype, g.device, self._bytes)
                out = Ring(f"{self.name}.offload", *slots, fills=False, asynchronous=self.asynchronous, zeroed=False)
                back = Ring(f"{self.name}.prefetch", *slots, drains=False, asynchronous=self.asynchronous, zeroed=False)
                self._rings = [out, back]
                self._out = Offloader(out, self._store, chunk_tokens)
                self._in = Prefetcher(back, self._store, self.max_tokens)
        except BaseException:
            self._store.close()
            raise
        self._closed = False
        _open_caches[self.name] = self

    # ----------------------------------------------------------------- properties
    @property
    def store(self) -> str:
        """The kind of store: ``"memory"``, ``"mmap"`` or ``"device"``."""
        return self._store.kind

    @property
    def file(self) -> Optional[str]:
        """The file behind an mmap store; None for a temporary one (unlinked once mapped) and other stores."""
        return self._store.file

    @property
    def closed(self) -> bool:
        """Whether `close` was called; every method but `finish` and `close` then raises `OffloadError`."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError(f"OffloadCache {self.name!r} is closed")

    @property
    def rings(self) -> Tuple[Ring, ...]:
        """The rings of device slots the cache stages keys and values through: the offload's and the
        prefetch's (none for ``store="device"``)."""
        return tuple(self._rings)

    @property
    def host_bytes(self) -> int:
        """Bytes of the store (on the host unless ``store="device"``)."""
        return 0 if self.store == "device" else self._store.nbytes

    @property
    def device_bytes(self) -> int:
        """Device bytes the cache holds now: its slots, or the whole store when ``store="device"``."""
        return self._bytes.now

    @property
    def peak_device_bytes(self) -> int:
        """The most device bytes the cache has held."""
        return self._bytes.peak

    def tokens(self, layer: int) -> int:
        """Tokens of ``layer`` written to the store so far (the end of the furthest offload)."""
        self._check_open()
        return self._tokens[self._geometry.check_layer(layer)]

    def check_capacity(self, tokens: int) -> None:
        """Raise `OffloadError` unless a prefill of ``tokens`` tokens per layer fits the store."""
        self._check_open()
        self._geometry.check_capacity(tokens, self._store.nbytes)

    # ----------------------------------------------------------------- offload
    def acquire(self, layer: int, tokens: int, offset: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Device buffers safe to write now: let attention write ``tokens`` keys and values into the
        returned views, then pass them to `offload` (with the same ``offset``). Saves `offload`'s
        staging copy. With ``store="device"`` the views are the store itself, at ``offset``."""
        self._check_open()
        layer = self._geometry.check_layer(layer)
        tokens = self._geometry.check_chunk(layer, tokens)
        return self._out.acquire(layer, tokens, self._start(layer, offset, tokens))

    def offload(self, layer: int, k: torch.Tensor, v: torch.Tensor, offset: Optional[int] = None) -> None:
        """Copy ``k`` / ``v`` (``[tokens, *shape]``) of ``layer`` to the store at token ``offset``.

        Call it right after attention wrote them; it returns once the copy is issued. ``offset``
        defaults to the end of what ``layer`` holds already, so micro-batch 1 lands after
        micro-batch 0. Inputs are checked before anything is issued.
        """
        self._check_open()
        check_path(self.asynchronous)
        layer = self._geometry.check_layer(layer)
        n = self._geometry.check_kv(layer, k, v)
        start = self._start(layer, offset, n)
        self._out.offload(layer, k, v, start)
        self._tokens[layer] = max(self._tokens[layer], start + n)

    def _start(self, layer: int, offset: Optional[int], n: int) -> int:
        """Where ``n`` tokens of ``layer`` land: ``offset``, or after what the layer holds."""
        start = self._tokens[layer] if offset is None else as_int("offset", offset)
        self._geometry.check_range(layer, start, start + n)
        return start

    # ----------------------------------------------------------------- prefetch
    def prefetch(self, layer: int, start: int = 0, end: Optional[int] = None) -> None:
        """Start copying tokens ``[start, end)`` of ``layer`` back to a device slot (on the copy stream).

        `get` waits for it. A slot is reused ``ring`` prefetches later: read what `get` returned
        before then.
        """
        self._in.prefetch(*self._held(layer, start, end))

    def get(self, layer: int, start: int = 0, end: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[start, end)`` of ``layer`` on the device (prefetching now if not done before)."""
        return self._in.get(*self._held(layer, start, end))

    def _held(self, layer: int, start: int, end: Optional[int]) -> Tuple[int, int, int]:
        """``layer, start, end`` (``end``: all it holds), checked against what the store holds."""
        self._check_open()
        check_path(self.asynchronous)
        layer = self._geometry.check_layer(layer)
        start = as_int("start", start)
        end = self._tokens[layer] if end is None else as_int("end", end)
        check_held(layer, start, end, self._tokens[layer])
        return layer, start, end

    # ----------------------------------------------------------------- host side
    def finish(self) -> None:
        """Host waits until every issued copy has landed (nothing to wait for once closed)."""
        if self._closed:
            return
        if self.asynchronous:
            for ring in self._rings:
                ring.synchronize()
        elif self.device.type != "cpu":
            synchronize()

    def host_kv(self, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The stored keys and values of ``layer`` (``[tokens, *shape]``), after `finish`."""
        self._check_open()
        layer = self._geometry.check_layer(layer)
        self.finish()
        return self._store.rows(layer, 0, self._tokens[layer])

    def reset(self) -> None:
        """Start a new prefill into the same store and slots (waits for the copies in flight)."""
        self._check_open()
        self.finish()
        self._tokens = [0] * self.n_layers
        self._in.forget()
        self._out.forget()

    def close(self) -> None:
        """Wait for the copies, free the slots and release the store (twice is fine)."""
        if self._closed:
            return
        try:
            self.finish()
        finally:  # an interrupted wait still releases everything
            self._closed = True
            for ring in self._rings:
                ring.close()  # its buffers and events
            self._bytes.clear()  # the device store closed below
            self._store.close()
            if _open_caches.get(self.name) is self:
                del _open_caches[self.name]

    def __enter__(self) -> "OffloadCache":
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"OffloadCache({self.name}: {self.n_layers} layers x {self.max_tokens} tokens, k{self.k_shape} "
                f"v{self.v_shape} {self.dtype}, store={self.store}, ring={self._ring_size}, "
                f"asynchronous={self.asynchronous})")
