"""`CapacityExpertParallelMoE`: the expert-parallel layer with static shapes, which traces as a whole graph.

The exchange, the grouping and the combine it runs are `collectives.capacity`'s (see there for the capacity
and the expert paths); this module is the layer: its stages are `ExpertParallelMoE`'s with the dispatch in one
step, its checks agreed by the ranks in one all-reduce before the exchange.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ._grouping import GroupedRows
from .capacity import EXPERT_PATHS, CapacityCombineHandle, CapacityDispatchHandle, _capacity_dispatch, \
    all_local_experts, capacity_combine, capacity_dispatch, expert_path, grouped_experts
from .experts import LocalExperts
from .layer import ExpertParallelMoE, SharedExperts
from .layout import LayoutError
from .wrap import wrap_expert_parallel


class CapacityExpertParallelMoE(ExpertParallelMoE):
    """`ExpertParallelMoE` with static shapes: traceable under ``torch.compile(fullgraph=True)``.

    Same stages (names, streams, reads, writes) as `ExpertParallelMoE` with its dispatch in one step
    (there is no count exchange to issue apart); ``moe_dispatch`` is a
    `CapacityDispatchHandle`; ``moe_expert_out`` and ``moe_expert_batch`` are the grouped pairs'
    outputs and their `GroupedRows`, or (``"all"``) every local expert over every received row and
    the received expert ids and weights; ``moe_combine`` a `CapacityCombineHandle`. ``capacity``:
    rows per destination rank (None: the call's token count). ``expert_path``: one of `EXPERT_PATHS`.
    """

    def __init__(self, router: nn.Module, experts: LocalExperts, num_experts: int,
                 group: Optional[dist.ProcessGroup] = None, shared: Optional[SharedExperts] = None,
                 overlap_shared: bool = True, capacity: Optional[int] = None, validate: bool = True,
                 expert_path: str = "auto"):
        super().__init__(router, experts, num_experts, group, shared, overlap_shared)
        if not getattr(experts, "plain", True):  # its expert paths compute act(gate) * up with the weights alone
            raise TypeError(f"the static-shape layer computes plain experts down(act(gate) * up) only; these have "
                            f"{', '.join(experts.extras())}: use ExpertParallelMoE (the eager paths)")
        if capacity is not None and int(capacity) < 0:
            raise LayoutError(f"capacity must be >= 0, got {capacity}")
        if expert_path not in EXPERT_PATHS:
            raise ValueError(f"expert_path must be one of {EXPERT_PATHS}, got {expert_path!r}")
        self.capacity = capacity
        self.validate = validate
        self.expert_path = expert_path

    @classmethod
    def wrap(cls, module: nn.Module, group: Optional[dist.ProcessGroup] = None, *, capacity: Optional[int] = None,
             overlap_shared: bool = True, validate: bool = True, expert_path: str = "auto"
             ) -> "CapacityExpertParallelMoE":
        """The capacity layer of ``module`` (anything `wrap_expert_parallel` accepts), this rank's experts only."""
        ep = wrap_expert_parallel(module, group, overlap_shared=overlap_shared, impl="loop")
        return cls(ep.router, ep.experts, ep.num_experts, group, ep.shared, overlap_shared, capacity, validate,
                   expert_path)

    def _dispatch(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> CapacityDispatchHandle:
        if not self.validate:  # else the shapes are checked in the capacity all-reduce, at no extra collective
            self._check_shapes_once(x, idx)
            return capacity_dispatch(x, idx, weights, self.num_experts, self.group, self.capacity, validate=False)
        first = self._shapes_unchecked()
        check = (lambda: self._check_experts(x)) if first else None
        handle = _capacity_dispatch(x, idx, weights, self.num_experts, self.group, self.capacity, True, check)
        if first:
            self._shapes_checked = True
        return handle

    def _experts(self, handle: CapacityDispatchHandle) -> Tuple[torch.Tensor, Any]:
        which = expert_path(self.expert_path, handle.recv_x, self.experts)
        if which == "all":
            return all_local_experts(handle.recv_x, self.experts), (handle.recv_ids, handle.recv_weights)
        return grouped_experts(handle.recv_x, handle.recv_ids, handle.recv_weights, self.experts, which)

    def _combine(self, y: torch.Tensor, batch: Any, handle: CapacityDispatchHandle) -> CapacityCombineHandle:
        return capacity_combine(y, handle, grouped=batch if isinstance(batch, GroupedRows) else None)


__all__ = ["CapacityExpertParallelMoE"]
