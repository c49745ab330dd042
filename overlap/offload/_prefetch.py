"""The prefetch direction: a token range of the host store filled into a ring's slot, on the copy stream.

The ring fills the slot once the main stream is done with what it held (``free`` / ``ready``);
`Prefetcher.get` makes the main stream wait for the fill before it reads the slot.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..copy import copy_
from ._stores import KVStore
from .meter import CopyTiming
from .ring import Ring


class Prefetcher:
    """Copies token ranges (up to ``tokens`` rows) of ``store`` into the slots of ``ring``; a slot holds
    ``(layer, start, end)``."""

    def __init__(self, ring: Ring, store: KVStore, tokens: int):
        self.ring, self.store, self.tokens = ring, store, tokens

    def prefetch(self, layer: int, start: int, end: int) -> None:
        """Start copying checked tokens ``[start, end)`` of ``layer`` into the next slot."""
        slot = self.ring.take()
        n = end - start
        self.ring.buffers(slot, self.tokens)
        hk, hv = self.store.rows(layer, start, end)
        self.ring.hold(slot, (layer, start, end))

        def copy(dk: torch.Tensor, dv: torch.Tensor, timing: Optional[CopyTiming]) -> None:
            copy_(dk[:n], hk, name="kv_prefetch", layer=layer, slot=slot, start=start)
            copy_(dv[:n], hv, name="kv_prefetch", layer=layer, slot=slot, start=start)

        self.ring.fill(slot, copy, hk.numel() * hk.element_size() + hv.numel() * hv.element_size())

    def get(self, layer: int, start: int, end: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Checked tokens ``[start, end)`` of ``layer`` on the device, prefetching now if not done before."""
        key = (layer, start, end)
        slot = self.ring.find(key)
        if slot is None:
            self.prefetch(layer, start, end)
            slot = self.ring.find(key)
        dk, dv = self.ring.wait_filled(slot)
        return dk[:end - start], dv[:end - start]

    def forget(self) -> None:
        """Forget what the slots hold (a new prefill)."""
        self.ring.forget()
