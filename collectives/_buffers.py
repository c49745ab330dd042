"""Reused CPU send buffers for dispatch / combine.

A fresh CPU tensor of tens of MiB costs a page fault per 4 KiB page on first touch (glibc maps
large blocks anew for every allocation and unmaps them on free): at the sizes of a prefill that
is as much time as the exchange itself. Device paths have caching allocators; on the CPU path
dispatch and combine keep their internal send / receive buffers here instead. A buffer comes
back only once the exchange that used it has completed, and never one handed to the caller.
"""
from __future__ import annotations

from typing import List

import torch

from overlap.state import STATE

_KEEP = 4  # buffers kept at most: two exchanges in flight, each with a send and a receive buffer


def _free() -> List[torch.Tensor]:
    """The kept buffers (flat uint8 CPU tensors), in the toolkit's process state (call with its lock)."""
    return STATE.pools.setdefault("collectives.dispatch", [])


def take(rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``[rows, hidden]`` CPU tensor of ``dtype`` with undefined contents, reused when one is free."""
    nbytes = rows * hidden * dtype.itemsize
    if nbytes == 0:
        return torch.empty(rows, hidden, dtype=dtype)
    with STATE.lock:
        free = _free()
        fits = [i for i, b in enumerate(free) if b.numel() >= nbytes]
        if fits:
            buf = free.pop(min(fits, key=lambda i: free[i].numel()))
            return buf[:nbytes].view(dtype).view(rows, hidden)
    return torch.empty(rows, hidden, dtype=dtype)


def give(t: torch.Tensor) -> None:
    """Return a tensor from `take` (or any contiguous CPU tensor no one reads any more) for reuse."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return
    storage = t.untyped_storage()
    buf = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
    with STATE.lock:
        free = _free()
        if any(b.untyped_storage().data_ptr() == storage.data_ptr() for b in free):
            return
        free.append(buf)
        if len(free) > _KEEP:
            free.pop(min(range(len(free)), key=lambda i: free[i].numel()))


def release() -> None:
    """Drop every kept buffer (their memory goes back to the allocator)."""
    with STATE.lock:
        _free().clear()
