"""Copies that follow the current stream: on a CPU side stream they run on its copy thread."""
from __future__ import annotations

from typing import Any

import torch

from .streams import issue_host


def copy_(dst: torch.Tensor, src: torch.Tensor, name: str = "copy", **meta: Any) -> torch.Tensor:
    """``dst.copy_(src, non_blocking=True)`` on the current stream; returns ``dst``.

    The copy may still be running when this returns (device copy engines, or the CPU copy
    thread): record an event after it and wait on it before reading ``dst`` or writing ``src``.
    """
    if dst.shape != src.shape:
        raise ValueError(f"copy_: destination shape {tuple(dst.shape)} differs from source {tuple(src.shape)}")
    issue_host(name, lambda: dst.copy_(src, non_blocking=True), reads=(src,), writes=(dst,), **meta)
    return dst
