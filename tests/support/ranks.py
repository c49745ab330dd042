"""Rank bodies for `overlap.multirank.run_ranks` shared by tests and the scripts they write (importable as
``support.ranks`` wherever tests/ is on the path, so spawned and torchrun ranks find them)."""
from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist


def sum_ranks(ctx, scale: float) -> Tuple[int, int, float]:
    """(rank, world size, the sum of the ranks over the group times ``scale``): one all-reduce per call."""
    t = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(t, group=ctx.group)
    return ctx.rank, ctx.world_size, t.item() * scale
