"""``store="device"``: no offload, the baseline. Keys and values stay in a store on the device."""
from __future__ import annotations

from typing import Tuple

import torch

from ..copy import copy_
from ._stores import KVStore


class Keep:
    """Both directions of `OffloadCache` for a device store: no slots, no events, no copy stream."""

    def __init__(self, store: KVStore):
        self.store = store

    def acquire(self, layer: int, tokens: int, offset: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The store itself at ``offset``."""
        return self.store.rows(layer, offset, offset + tokens)

    def offload(self, layer: int, k: torch.Tensor, v: torch.Tensor, offset: int) -> None:
        """Keep ``k`` / ``v`` at ``offset`` (no copy when they were written there through `acquire`)."""
        dk, dv = self.store.rows(layer, offset, offset + k.shape[0])
        if not (k.data_ptr() == dk.data_ptr() and v.data_ptr() == dv.data_ptr()):
            copy_(dk, k, name="kv_keep", layer=layer)
            copy_(dv, v, name="kv_keep", layer=layer)

    def prefetch(self, layer: int, start: int, end: int) -> None:
        """Nothing to copy: the store is on the device."""

    def get(self, layer: int, start: int, end: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.store.rows(layer, start, end)

    def forget(self) -> None:
        """Nothing is held between calls."""
