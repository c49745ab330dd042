"""The offload direction: a device slot's keys and values to the host store, on the copy stream.

Per slot: the main stream records ``written`` once the slot holds the chunk; the copy stream
waits for it, copies the slot to the store and records ``copied``; the main stream waits for
``copied`` before it writes the slot again.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..copy import copy_
from ..streams import KV_OFFLOAD, record_stream, stream
from ._ring import Ring
from ._stores import KVStore


class Offloader:
    """Copies chunks from a ring of device slots (``written`` / ``copied`` events) to ``store``."""

    def __init__(self, ring: Ring, store: KVStore, asynchronous: bool):
        self.ring, self.store, self.asynchronous = ring, store, asynchronous
        self._acquired: Optional[Tuple[int, int, int]] = None  # (slot, layer, tokens) handed out by acquire

    def acquire(self, layer: int, tokens: int, offset: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The next slot, safe to write now (``offset`` does not matter: `offload` places the chunk)."""
        slot = self._take()
        self._acquired = (slot, layer, tokens)
        return self.ring.slot(slot, tokens)

    def offload(self, layer: int, k: torch.Tensor, v: torch.Tensor, offset: int) -> None:
        """Copy checked ``k`` / ``v`` of ``layer`` to the store at ``offset``; returns once issued."""
        n = k.shape[0]
        slot = self._staged_slot(layer, k, v)
        sk, sv = self.ring.slot(slot, n)
        hk, hv = self.store.rows(layer, offset, offset + n)
        self.ring.used[slot] = True
        if not self.asynchronous:
            copy_(hk, sk, name="kv_offload", layer=layer, offset=offset)
            copy_(hv, sv, name="kv_offload", layer=layer, offset=offset)
            return
        self.ring.before[slot].record(sk, sv)
        with stream(KV_OFFLOAD):
            sk, sv = self._wait_written(slot, sk, sv)
            copy_(hk, sk, name="kv_offload", layer=layer, slot=slot, offset=offset)
            copy_(hv, sv, name="kv_offload", layer=layer, slot=slot, offset=offset)
            self.ring.after[slot].record(hk, hv)
        for buf in self.ring.buffers[slot]:
            record_stream(buf, KV_OFFLOAD)

    def forget(self) -> None:
        """Drop a slot handed out by `acquire` and not offloaded."""
        self._acquired = None

    def _take(self) -> int:
        slot = self.ring.take()
        self._wait_copied(slot)
        return slot

    def _staged_slot(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """The slot holding ``k`` / ``v``: the acquired one, or a fresh one they are copied into."""
        acquired, self._acquired = self._acquired, None
        n = k.shape[0]
        if acquired is not None:
            slot, a_layer, a_tokens = acquired
            bk, bv = self.ring.slot(slot, n)
            if k.data_ptr() == bk.data_ptr() and v.data_ptr() == bv.data_ptr() and (a_layer, a_tokens) == (layer, n):
                return slot
        slot = self._take()
        bk, bv = self.ring.slot(slot, n)
        copy_(bk, k, name="kv_stage", layer=layer, slot=slot)
        copy_(bv, v, name="kv_stage", layer=layer, slot=slot)
        return slot

    def _wait_copied(self, slot: int) -> None:
        """Main stream: the slot's previous copy to the host has finished reading it."""
        if self.asynchronous and self.ring.used[slot]:
            self.ring.after[slot].wait()

    def _wait_written(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Copy stream: the main stream's write of the slot has finished."""
        return self.ring.before[slot].wait(k, v)
