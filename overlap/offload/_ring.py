"""A ring of device slots, each a K and a V buffer with two events, and the device bytes they hold."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..events import Event, event
from ._geometry import Geometry


class DeviceBytes:
    """Device bytes a cache holds now, and the most it has held."""

    def __init__(self, start: int = 0):
        self.now = self.peak = start

    def add(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def clear(self) -> None:
        self.now = 0


class Ring:
    """``size`` device slots of ``tokens`` rows of keys and values, taken in turn.

    Slot ``i`` has the events ``{name}.{before}{i}`` (recorded before the copy stream touches it)
    and ``{name}.{after}{i}`` (recorded by the copy stream when done). Buffers are allocated on
    first use and counted in ``meter``; ``used[i]`` says whether slot ``i`` has a copy issued.
    """

    def __init__(self, name: str, size: int, tokens: int, geometry: Geometry, meter: DeviceBytes,
                 before: str, after: str):
        self.tokens, self.geometry, self.meter = tokens, geometry, meter
        self.buffers: List[Optional[Tuple[torch.Tensor, torch.Tensor]]] = [None] * size
        self.before: List[Event] = [event(f"{name}.{before}{i}") for i in range(size)]
        self.after: List[Event] = [event(f"{name}.{after}{i}") for i in range(size)]
        self.used = [False] * size
        self._next = 0

    def __len__(self) -> int:
        return len(self.buffers)

    def take(self) -> int:
        """The next slot, round robin."""
        slot = self._next
        self._next = (slot + 1) % len(self.buffers)
        return slot

    def slot(self, slot: int, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` rows of the slot's K and V buffers, allocated on first use."""
        bufs = self.buffers[slot]
        if bufs is None:
            g = self.geometry
            bufs = (torch.empty(self.tokens, *g.k_shape, dtype=g.dtype, device=g.device),
                    torch.empty(self.tokens, *g.v_shape, dtype=g.dtype, device=g.device))
            self.buffers[slot] = bufs
            self.meter.add(sum(t.numel() * t.element_size() for t in bufs))
        return bufs[0][:n], bufs[1][:n]

    def synchronize(self) -> None:
        """Host waits for the ``after`` event of every slot with a copy issued."""
        for slot, used in enumerate(self.used):
            if used:
                self.after[slot].synchronize()

    def free(self) -> None:
        """Drop the buffers (the owner clears the meter)."""
        self.buffers = [None] * len(self.buffers)
