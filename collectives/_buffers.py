"""Reused CPU send buffers for dispatch / combine.

A fresh CPU tensor of tens of MiB costs a page fault per 4 KiB page on first touch (glibc maps
large blocks anew for every allocation and unmaps them on free): at the sizes of a prefill that
is as much time as the exchange itself. Device paths have caching allocators; on the CPU path
dispatch and combine keep their internal send / receive buffers here instead. A buffer comes
back only once the exchange that used it has completed, and never one handed to the caller.
"""
from __future__ import annotations

import threading
from typing import List

import torch

_KEEP = 4  # buffers kept at most: two exchanges in flight, each with a send and a receive buffer
_lock = threading.Lock()
_free: List[torch.Tensor] = []  # flat uint8 CPU tensors


def take(rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``[rows, hidden]`` CPU tensor of ``dtype`` with undefined contents, reused when one is free."""
    nbytes = rows * hidden * dtype.itemsize
    if nbytes == 0:
        return torch.empty(rows, hidden, dtype=dtype)
    with _lock:
        fits = [i for i, b in enumerate(_free) if b.numel() >= nbytes]
        if fits:
            buf = _free.pop(min(fits, key=lambda i: _free[i].numel()))
            return buf[:nbytes].view(dtype).view(rows, hidden)
    return torch.empty(rows, hidden, dtype=dtype)


def give(t: torch.Tensor) -> None:
    """Return a tensor from `take` (or any contiguous CPU tensor no one reads any more) for reuse."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return
    storage = t.untyped_storage()
    buf = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
    with _lock:
        if any(b.untyped_storage().data_ptr() == storage.data_ptr() for b in _free):
            return
        _free.append(buf)
        if len(_free) > _KEEP:
            _free.pop(min(range(len(_free)), key=lambda i: _free[i].numel()))


def release() -> None:
    """Drop every kept buffer (their memory goes back to the allocator)."""
    with _lock:
        _free.clear()
