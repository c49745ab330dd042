"""The offload direction: each chunk of keys and values drained from a ring's slot to the host store.

The chunk is in a slot (written there through `Offloader.acquire`, or staged into one on the main
stream); the ring drains it on the copy stream (``written`` / ``stored``) and the main stream waits for
that drain before it writes the slot again.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..copy import copy_
from ._stores import KVStore
from .ring import Ring


class Offloader:
    """Copies chunks of up to ``tokens`` rows from the slots of ``ring`` to ``store``."""

    def __init__(self, ring: Ring, store: KVStore, tokens: int):
        self.ring, self.store, self.tokens = ring, store, tokens
        self._acquired: Optional[Tuple[int, int, int]] = None  # (slot, layer, tokens) handed out by acquire

    def acquire(self, layer: int, tokens: int, offset: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The next slot, safe to write now (``offset`` does not matter: `offload` places the chunk)."""
        slot = self._take()
        self._acquired = (slot, layer, tokens)
        return self._rows(slot, tokens)

    def offload(self, layer: int, k: torch.Tensor, v: torch.Tensor, offset: int) -> None:
        """Copy checked ``k`` / ``v`` of ``layer`` to the store at ``offset``; returns once issued."""
        n = k.shape[0]
        slot = self._staged_slot(layer, k, v)
        hk, hv = self.store.rows(layer, offset, offset + n)

        def copy(sk: torch.Tensor, sv: torch.Tensor) -> None:
            copy_(hk, sk[:n], name="kv_offload", layer=layer, slot=slot, offset=offset)
            copy_(hv, sv[:n], name="kv_offload", layer=layer, slot=slot, offset=offset)

        self.ring.drain(slot, copy, hk.numel() * hk.element_size() + hv.numel() * hv.element_size())

    def forget(self) -> None:
        """Drop a slot handed out by `acquire` and not offloaded."""
        self._acquired = None

    def _take(self) -> int:
        """The next slot, its last drain done reading it."""
        slot = self.ring.take()
        self.ring.wait_drained(slot)
        return slot

    def _rows(self, slot: int, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        k, v = self.ring.buffers(slot, self.tokens)
        return k[:n], v[:n]

    def _staged_slot(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """The slot holding ``k`` / ``v``: the acquired one, or a fresh one they are copied into."""
        acquired, self._acquired = self._acquired, None
        n = k.shape[0]
        if acquired is not None:
            slot, a_layer, a_tokens = acquired
            bk, bv = self._rows(slot, n)
            if k.data_ptr() == bk.data_ptr() and v.data_ptr() == bv.data_ptr() and (a_layer, a_tokens) == (layer, n):
                return slot
        slot = self._take()
        bk, bv = self._rows(slot, n)
        copy_(bk, k, name="kv_stage", layer=layer, slot=slot)
        copy_(bv, v, name="kv_stage", layer=layer, slot=slot)
        return slot
