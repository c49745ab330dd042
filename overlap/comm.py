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


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Optional[Sequence[int]] = None,
                      input_split_sizes: Optional[Sequence[int]] = None,
                      group: Optional[dist.ProcessGroup] = None, name: str = "all_to_all", **meta: Any) -> None:
    """``dist.all_to_all_single`` on the current stream, checked before it is issued.

    Shapes and splits are validated locally first, because a malformed collective hangs the
    whole job instead of failing. On a CPU side stream the exchange is in flight when this
    returns: wait on an event recorded after it before reading ``output``.
    """
    world = dist.get_world_size(group)
    if output.dtype != input.dtype or output.shape[1:] != input.shape[1:]:
        raise ValueError(f"all_to_all_single: output {tuple(output.shape)} {output.dtype} does not match "
                         f"input {tuple(input.shape)} {input.dtype} beyond the first dimension")
    out_splits = _check_splits("output", output, output_split_sizes, world)
    in_splits = _check_splits("input", input, input_split_sizes, world)

    def issue(async_op: bool) -> Any:
        return dist.all_to_all_single(output, input, out_splits, in_splits, group=group, async_op=async_op)

    me = dist.get_rank(group)
    row = math.prod(input.shape[1:]) * input.element_size()
    sent = input.shape[0] - (in_splits[me] if in_splits else input.shape[0] // world)
    received = output.shape[0] - (out_splits[me] if out_splits else output.shape[0] // world)
    issue_collective(name, issue, reads=(input,), writes=(output,), nbytes=max(sent, received) * row, **meta)


def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Optional[dist.ProcessGroup] = None,
               name: str = "all_reduce", **meta: Any) -> None:
    """``dist.all_reduce`` on the current stream (asynchronous on a CPU side stream)."""

    def issue(async_op: bool) -> Any:
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    world = dist.get_world_size(group)
    ring = 2 * (world - 1) * tensor.numel() * tensor.element_size() // world
    issue_collective(name, issue, reads=(tensor,), writes=(tensor,), nbytes=ring, **meta)
