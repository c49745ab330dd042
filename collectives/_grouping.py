"""Static-shape grouping of received rows by local expert, and the weighted reduction back to rows.

The capacity path receives ``R`` rows, each with ``k`` slots holding a local expert id (-1: the
expert lives elsewhere, or the row is padding) and a weight. Every (row, slot) pair becomes one row
of a grouped matmul: ``R * k`` pairs, a static count, sorted by local expert with a **stable**
sort, so that the pairs of expert ``e`` are consecutive and in arrival order, and pairs without a
local expert come last. The group list (pairs per local expert, int64 counts on the device) drives
a grouped matmul whose work is proportional to the routed pairs; the pairs past its sum are never
computed and come out as zero. No shape depends on the routing, nothing is read on the host.

Two forms, the same result:

- NPU (torch_npu with the routing operators): ``npu_moe_init_routing_v2`` sorts and gathers the
  rows and counts the pairs per expert; ``npu_moe_finalize_routing`` (``drop_pad_mode=2``: the
  row-major gather index init_routing_v2 returns) sums each row's weighted pairs.
- everywhere else: ``torch.argsort(stable=True)``, ``index_select`` and a sum over the slots in slot
  order in float32, each slot without a local expert selected away (never multiplied by 0).

Pairs without a local expert are not dropped from the sort (``active_expert_range`` would mark them
-1, which ``npu_moe_finalize_routing`` does not take): they form one extra group after the local
experts, outside the group list, so their rows are exact zeros with weight 0.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

ROUTING_OPS = ("npu_moe_init_routing_v2", "npu_moe_finalize_routing")


@dataclasses.dataclass
class GroupedRows:
    """Received rows' (row, slot) pairs sorted by local expert (see the module docstring)."""

    x: torch.Tensor  # [R*k, H] the row of every pair, in expert order; pairs without a local expert last
    group_list: torch.Tensor  # [E] int64 pairs per local expert (counts: group_list_type=1)
    dst: torch.Tensor  # [R*k] sorted position of pair r*k + s (init_routing_v2's gather-type expanded_row_idx)
    ids: torch.Tensor  # [R, k] local expert ids, -1 for none
    weights: torch.Tensor  # [R, k] float32, 0 for none
    npu: Optional[Any] = None  # torch_npu when its routing operators sorted the pairs (and will reduce them)

    @property
    def num_rows(self) -> int:
        return self.ids.shape[0]


def _keys(ids: torch.Tensor, num_local: int) -> torch.Tensor:
    """The sort key of every slot: its local expert, ``num_local`` (one group after the others) for none."""
    return torch.where(ids >= 0, ids, torch.full_like(ids, num_local))


def group_rows(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_local: int,
               npu: Optional[Any] = None) -> GroupedRows:
    """Sort the ``[R, k]`` pairs of rows ``x [R, H]`` by local expert; ``npu``: torch_npu, to use its operators."""
    rows, k = ids.shape
    keys = _keys(ids.long(), num_local)
    if npu is not None and rows:
        expanded_x, dst, per_expert, _ = npu.npu_moe_init_routing_v2(
            x, keys.to(torch.int32), active_num=rows * k, expert_num=num_local + 1, drop_pad_mode=0,
            expert_tokens_num_type=1, expert_tokens_num_flag=True, quant_mode=-1,
            active_expert_range=[0, num_local + 1], row_idx_type=0)
        return GroupedRows(expanded_x, per_expert[:num_local], dst, ids, weights, npu)
    flat = keys.reshape(-1)
    order = torch.argsort(flat, stable=True)
    per_expert = torch.zeros(num_local + 1, dtype=torch.int64, device=x.device)
    per_expert.scatter_add_(0, flat, torch.ones_like(flat))
    dst = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=x.device))
    src = torch.div(order, k, rounding_mode="floor")
    return GroupedRows(x.index_select(0, src), per_expert[:num_local], dst, ids, weights)


def reduce_rows(y: torch.Tensor, g: GroupedRows) -> torch.Tensor:
    """Per received row, its pairs' outputs ``y [R*k, H]`` (in `group_rows` order) times their weights,
    summed in slot order: ``[R, H]``, float32 (the NPU operator returns ``y``'s dtype).

    A slot without a local expert adds an exact zero: selected here, and on the NPU its row is one of
    the zero rows past the group list, with weight 0.
    """
    rows, k = g.ids.shape
    if g.npu is not None and rows:
        return g.npu.npu_moe_finalize_routing(expanded_permuted_rows=y, skip1=None, skip2=None, bias=None,
                                              scales=g.weights.to(y.dtype), expanded_src_to_dst_row=g.dst,
                                              export_for_source_row=None, drop_pad_mode=2)
    if rows == 0:
        return torch.zeros(rows, y.shape[-1], dtype=torch.float32, device=y.device)
    pairs = y.index_select(0, g.dst.long()).view(rows, k, y.shape[-1]).float()
    zero = torch.zeros((), dtype=torch.float32, device=y.device)
    terms = torch.where((g.ids >= 0)[..., None], pairs * g.weights.float()[..., None], zero)
    out = terms[:, 0]
    for s in range(1, k):  # one slot after another, the reference's order (a sum kernel may associate otherwise)
        out = out + terms[:, s]
    return out


__all__ = ["GroupedRows", "ROUTING_OPS", "group_rows", "reduce_rows"]
