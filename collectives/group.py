"""The expert-parallel group as the exchanges see it: its size, this rank in it, and whether it has anyone to
exchange with."""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from .layout import LayoutError


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Size of the expert-parallel group (1 without an initialised process group); `LayoutError` where this
    rank is not in ``group``."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise LayoutError("an expert-parallel group was given but torch.distributed is not initialised")
        return 1
    world = dist.get_world_size(group)
    if world < 1:  # torch's answer for a group this rank is not in
        raise LayoutError(f"this rank (global rank {dist.get_rank()} of {dist.get_world_size()}) is not in the "
                          f"expert-parallel group it was given, GroupMember.NON_GROUP_MEMBER (what "
                          f"torch.distributed.new_group returns on the ranks it leaves out); run the expert-parallel "
                          f"calls only on the group's own ranks")
    return world


def rank_in_group(group: Optional[dist.ProcessGroup]) -> int:
    """This rank in ``group`` (0 without an initialised process group)."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def has_peers(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether there is another rank to exchange with (False without a process group, or in a group of one)."""
    return dist.is_initialized() and group_size(group) > 1


__all__ = ["group_size", "has_peers", "rank_in_group"]
