"""The toolkit's reference MoE layer: router, routed experts and shared experts, computed densely.

This single-process computation is the ground truth that the expert-parallel layer is compared
with, and the MoE block of the reference model in ``launch/``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class MoEConfig:
    """Shapes and routing of a DeepSeek-style MoE block."""

    hidden: int = 64
    ffn: int = 32  # intermediate size of one routed expert
    n_experts: int = 8
    top_k: int = 2
    n_shared: int = 1  # shared experts, fused into one MLP of n_shared * ffn
    score_func: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    norm_topk: bool = True

    def __post_init__(self) -> None:
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {self.score_func!r}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        if self.n_shared < 0:
            raise ValueError(f"n_shared must be >= 0, got {self.n_shared}")


class Expert(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Scores experts and picks the top-k per token."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.hidden))
        if not self.weight.is_meta:  # a skeleton's weights hold no values (and normal_ on meta imports Dynamo)
            nn.init.normal_(self.weight, std=cfg.hidden ** -0.5)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(topk_idx [T, k] int64, topk_weights [T, k] float32)``."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if self.cfg.score_func == "softmax" else logits.sigmoid()
        weights, idx = torch.topk(scores, self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk and self.cfg.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        return idx, weights


class MoE(nn.Module):
    """Dense reference MoE: every expert on this process."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = nn.ModuleList(Expert(cfg.hidden, cfg.ffn) for _ in range(cfg.n_experts))
        self.shared_experts: Optional[Expert] = Expert(cfg.hidden, cfg.ffn * cfg.n_shared) if cfg.n_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, weights = self.router(x)
        out = combine_dense(x, idx, weights, self.experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.reshape(shape)


def combine_dense(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """Sum over each token's k choices, in slot order 0..k-1, of weight * expert(token), in fp32."""
    per_slot = torch.zeros(idx.shape[0], idx.shape[1], x.shape[-1], dtype=torch.float32, device=x.device)
    for e, expert in enumerate(experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel():
            per_slot[tok, slot] = expert(x[tok]).float()
    out = torch.zeros(x.shape[0], x.shape[-1], dtype=torch.float32, device=x.device)
    for s in range(idx.shape[1]):
        out += per_slot[:, s] * weights[:, s, None].float()
    return out.to(x.dtype)
