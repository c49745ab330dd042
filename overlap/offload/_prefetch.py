"""The prefetch direction: keys and values from the host store back to a device slot, on the copy stream.

Per slot: the main stream records ``free`` after its reads of the slot's last contents; the copy
stream waits for it, copies from the store and records ``ready``; `Prefetcher.get` makes the
main stream wait for ``ready``.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ..copy import copy_
from ..streams import KV_OFFLOAD, stream
from ._ring import Ring
from ._stores import KVStore

Key = Tuple[int, int, int]  # (layer, start, end)


class Prefetcher:
    """Copies token ranges of the store into a ring of device slots (``free`` / ``ready`` events)."""

    def __init__(self, ring: Ring, store: KVStore, asynchronous: bool):
        self.ring, self.store, self.asynchronous = ring, store, asynchronous
        self._fetched: Dict[int, Key] = {}  # slot -> what it holds (or is being copied into it)

    def prefetch(self, layer: int, start: int, end: int) -> None:
        """Start copying checked tokens ``[start, end)`` of ``layer`` into the next slot."""
        slot = self.ring.take()
        dk, dv = self.ring.slot(slot, end - start)
        hk, hv = self.store.rows(layer, start, end)
        key = (layer, start, end)
        self._fetched = {s: held for s, held in self._fetched.items() if s != slot and held != key}
        self._fetched[slot] = key
        self.ring.used[slot] = True
        if not self.asynchronous:
            copy_(dk, hk, name="kv_prefetch", layer=layer)
            copy_(dv, hv, name="kv_prefetch", layer=layer)
            return
        self.ring.before[slot].record(dk, dv)  # after the main stream's reads of the slot's last contents
        with stream(KV_OFFLOAD):
            dk, dv = self._wait_free(slot, dk, dv)
            copy_(dk, hk, name="kv_prefetch", layer=layer, slot=slot, start=start)
            copy_(dv, hv, name="kv_prefetch", layer=layer, slot=slot, start=start)
            self.ring.after[slot].record(dk, dv)

    def get(self, layer: int, start: int, end: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Checked tokens ``[start, end)`` of ``layer`` on the device, prefetching now if not done before."""
        key = (layer, start, end)
        slot = self._slot_of(key)
        if slot is None:
            self.prefetch(layer, start, end)
            slot = self._slot_of(key)
        dk, dv = self.ring.slot(slot, end - start)
        if self.asynchronous:
            dk, dv = self._wait_ready(slot, dk, dv)
        return dk, dv

    def forget(self) -> None:
        """Forget what the slots hold (a new prefill)."""
        self._fetched.clear()

    def _slot_of(self, key: Key) -> Optional[int]:
        return next((s for s, held in self._fetched.items() if held == key), None)

    def _wait_free(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Copy stream: the main stream has finished reading the slot's last contents."""
        return self.ring.before[slot].wait(k, v)

    def _wait_ready(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Main stream: the prefetch into the slot has landed."""
        return self.ring.after[slot].wait(k, v)
