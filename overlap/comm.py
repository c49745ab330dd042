"""Collectives that follow the current stream: asynchronous on a CPU side stream, stream-ordered on devices."""
from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from .streams import issue_collective


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where tensors for ``group``'s collectives must live: the current CUDA / NPU device for NCCL /
    HCCL (which reject CPU tensors), else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "hccl" in backend:
        return torch.device("npu", torch.npu.current_device())  # torch_npu is loaded when hccl is in use
    return torch.device("cpu")


def _group_size(group: Optional[dist.ProcessGroup], what: str) -> int:
    """The size of ``group``; a `ValueError` naming the group and this rank where this rank is not in it."""
    world = dist.get_world_size(group)
    if world < 1:  # torch's answer for a group this rank is not in
        raise ValueError(f"{what}: this rank (global rank {dist.get_rank()} of {dist.get_world_size()}) is not in "
                         f"the group it was given, GroupMember.NON_GROUP_MEMBER (what torch.distributed.new_group "
                         f"returns on the ranks it leaves out); issue it on the group's ranks only")
    return world


def _check_splits(what: str, tensor: torch.Tensor, splits: Optional[Sequence[int]], world: int) -> Optional[List[int]]:
    if splits is None:
        if tensor.shape[0] % world:
            raise ValueError(f"all_to_all_single: {what} has {tensor.shape[0]} rows, not divisible by the "
                             f"group size {world}; pass {what}_split_sizes")
        return None
    splits = [int(s) for s in splits]
    if len(splits) != world:
        raise ValueError(f"all_to_all_single: {len(splits)} {what} split sizes for a group of {world} ranks")
    if any(s < 0 for s in splits) or sum(splits) != tensor.shape[0]:
        raise ValueError(f"all_to_all_single: {what} split sizes {splits} do not add up to its "
                         f"{tensor.shape[0]} rows")
    return splits


def _described(splits: Optional[List[int]], tensor: torch.Tensor, world: int) -> str:
    return str(splits) if splits is not None else f"None: {tensor.shape[0]} rows in {world} even parts"


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Optional[Sequence[int]] = None,
                      input_split_sizes: Optional[Sequence[int]] = None,
                      group: Optional[dist.ProcessGroup] = None, name: str = "all_to_all", **meta: Any) -> None:
    """``dist.all_to_all_single`` on the current stream, checked before it is issued.

    Shapes and splits are validated locally first (a `ValueError` naming them), because a malformed
    collective hangs or aborts the whole job instead of failing: each split list against its
    tensor's rows, and the rows this rank sends itself against those it expects from itself. What
    cannot be seen on one rank is whether the ranks' splits match each other (what rank a sends
    rank b is what b expects from a): that would take an exchange of the splits first, a collective.
    Callers that do not know the peers' splits exchange them first (as `collectives.dispatch`'s count
    exchange does). On gloo a mismatch aborts the receiving process (``gloo::EnforceNotMet``) where
    more rows arrive than it expects, and passes silently where fewer arrive: the rows that did not
    come keep what ``output`` held. On a CPU side stream the exchange is in flight when this
    returns: wait on an event recorded after it before reading ``output``.
    """
    world = _group_size(group, "all_to_all_single")
    if output.dim() == 0 or input.dim() == 0:
        raise ValueError(f"all_to_all_single: output and input need a first dimension to split, got shapes "
                         f"{tuple(output.shape)} and {tuple(input.shape)}")
    if output.dtype != input.dtype or output.shape[1:] != input.shape[1:]:
        raise ValueError(f"all_to_all_single: output {tuple(output.shape)} {output.dtype} does not match "
                         f"input {tuple(input.shape)} {input.dtype} beyond the first dimension")
    out_splits = _check_splits("output", output, output_split_sizes, world)
    in_splits = _check_splits("input", input, input_split_sizes, world)
    me = dist.get_rank(group)
    own_in = in_splits[me] if in_splits is not None else input.shape[0] // world
    own_out = out_splits[me] if out_splits is not None else output.shape[0] // world
    if own_in != own_out:
        raise ValueError(f"all_to_all_single: rank {me} sends itself {own_in} rows (input split sizes "
                         f"{_described(in_splits, input, world)}) but expects {own_out} from itself (output split "
                         f"sizes {_described(out_splits, output, world)}); a rank's own split must be the same on "
                         f"both sides")

    def issue(async_op: bool) -> Any:
        return dist.all_to_all_single(output, input, out_splits, in_splits, group=group, async_op=async_op)

    row = math.prod(input.shape[1:]) * input.element_size()
    sent, received = input.shape[0] - own_in, output.shape[0] - own_out
    issue_collective(name, issue, reads=(input,), writes=(output,), nbytes=max(sent, received) * row, **meta)


def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Optional[dist.ProcessGroup] = None,
               name: str = "all_reduce", **meta: Any) -> None:
    """``dist.all_reduce`` on the current stream (asynchronous on a CPU side stream)."""

    def issue(async_op: bool) -> Any:
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    world = _group_size(group, "all_reduce")
    ring = 2 * (world - 1) * tensor.numel() * tensor.element_size() // world
    issue_collective(name, issue, reads=(tensor,), writes=(tensor,), nbytes=ring, **meta)
