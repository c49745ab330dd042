"""Turn an existing MoE module into an `ExpertParallelMoE` holding only this rank's experts.

Supported: the toolkit's reference `collectives.reference.MoE`, and the sparse MoE blocks of
Hugging Face transformers for Mixtral (``MixtralSparseMoeBlock``), Qwen2-MoE
(``Qwen2MoeSparseMoeBlock``) and DeepSeek-V3 (``DeepseekV3MoE``), whose experts are stored fused
(``gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``) or as a list of MLPs. The router and the
shared experts are reused as they are (no copy); the local experts' weights are copied once into
the stacked layout, and nothing else of the full expert weights is copied.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .dispatch import group_size
from .experts import LocalExperts
from .layer import ExpertParallelMoE, SharedExperts
from .layout import LayoutError
from .reference import MoE

TRANSFORMERS_BLOCKS = ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "DeepseekV3MoE")
_EXPECTED = ("collectives.reference.MoE or a transformers sparse MoE block ("
             + ", ".join(TRANSFORMERS_BLOCKS) + ")")


class TransformersRouter(nn.Module):
    """Adapts a transformers router returning ``(logits, weights, idx)`` to ``(idx, weights)``."""

    def __init__(self, gate: nn.Module):
        super().__init__()
        self.gate = gate

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        out = self.gate(x)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise TypeError(f"{type(self.gate).__name__} returned {type(out).__name__}; expected the "
                            f"(router_logits, topk_weights, topk_idx) of transformers >= 5")
        return out[2], out[1]


def _mlp_weights(mlp: nn.Module) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    for g, u, d in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        if all(isinstance(getattr(mlp, n, None), nn.Linear) for n in (g, u, d)):
            return getattr(mlp, g).weight, getattr(mlp, u).weight, getattr(mlp, d).weight
    raise TypeError(f"expert {type(mlp).__name__} has neither gate_proj/up_proj/down_proj nor w1/w3/w2 linears")


def _local_experts(experts: nn.Module, rank: int, world: int, impl: str) -> Tuple[LocalExperts, int]:
    """This rank's contiguous slice of ``experts``, stacked; returns it and the total expert count."""
    fused = getattr(experts, "gate_up_proj", None)
    if isinstance(fused, torch.Tensor) and fused.dim() == 3:
        total = fused.shape[0]
        n = _per_rank(total, world)
        lo = rank * n
        down = experts.down_proj
        if down.dim() != 3 or down.shape[0] != total or down.shape[1] != fused.shape[2] \
                or 2 * down.shape[2] != fused.shape[1]:
            raise TypeError(f"fused experts must be gate_up_proj [E, 2F, H] and down_proj [E, H, F], got "
                            f"{tuple(fused.shape)} and {tuple(down.shape)}")
        gate_up = fused.detach()[lo:lo + n].clone()
        down_w = down.detach()[lo:lo + n].clone()
        act = getattr(experts, "act_fn", None) or F.silu
        return LocalExperts(gate_up, down_w, lo, act, impl), total
    if isinstance(experts, nn.ModuleList) and len(experts):
        total = len(experts)
        n = _per_rank(total, world)
        lo = rank * n
        g0, _, d0 = _mlp_weights(experts[lo])
        gate_up = g0.new_empty(n, 2 * g0.shape[0], g0.shape[1])
        down_w = d0.new_empty(n, d0.shape[0], d0.shape[1])
        with torch.no_grad():
            for i in range(n):
                g, u, d = _mlp_weights(experts[lo + i])
                gate_up[i, : g.shape[0]].copy_(g)
                gate_up[i, g.shape[0]:].copy_(u)
                down_w[i].copy_(d)
        act = getattr(experts[lo], "act_fn", None) or F.silu
        return LocalExperts(gate_up, down_w, lo, act, impl), total
    raise TypeError(f"experts of type {type(experts).__name__} are neither fused (gate_up_proj, down_proj) "
                    f"nor an nn.ModuleList of MLPs")


def _per_rank(total: int, world: int) -> int:
    if total % world:
        raise LayoutError(f"{total} experts cannot be sharded over an expert-parallel group of {world} ranks: "
                          f"the expert count must be a multiple of the group size")
    return total // world


def wrap_expert_parallel(module: nn.Module, group: Optional[dist.ProcessGroup] = None, *,
                         overlap_shared: bool = True, impl: str = "auto") -> ExpertParallelMoE:
    """An `ExpertParallelMoE` computing what ``module`` computes, with this rank's experts only.

    Raises TypeError naming the supported modules for anything else.
    """
    world = group_size(group)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    name = type(module).__name__
    if isinstance(module, MoE):
        experts, total = _local_experts(module.experts, rank, world, impl)
        shared = SharedExperts(module.shared_experts, act=F.silu) if module.shared_experts is not None else None
        return ExpertParallelMoE(module.router, experts, total, group, shared, overlap_shared)
    if name in TRANSFORMERS_BLOCKS:
        experts, total = _local_experts(module.experts, rank, world, impl)
        shared = None
        if name == "Qwen2MoeSparseMoeBlock":
            shared = SharedExperts(module.shared_expert, output_gate=module.shared_expert_gate)
        elif name == "DeepseekV3MoE":
            shared = SharedExperts(module.shared_experts)
        return ExpertParallelMoE(TransformersRouter(module.gate), experts, total, group, shared, overlap_shared)
    raise TypeError(f"wrap_expert_parallel: unsupported module {name}; expected {_EXPECTED}")
