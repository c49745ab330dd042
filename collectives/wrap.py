"""Turn an existing MoE block into an `ExpertParallelMoE` holding only this rank's experts.

Blocks are recognised by their parts, not by class name (`collectives._recognise`): a child ``experts``
(fused 3-D expert tensors or an ``nn.ModuleList`` of gated MLPs), the routing the block's own forward
computes, and optional shared experts with an optional sigmoid output gate. This covers the toolkit's
`collectives.reference.MoE` and the sparse MoE blocks of Hugging Face transformers (the families checked
are listed in docs/expert-parallel.md). The router and the shared experts are reused as they are (no copy);
this rank's experts are copied once into the stacked layout, and nothing else of the full expert weights is
kept. A block whose experts a checkpoint loader already sharded (``block.experts.ep_shard = (first_expert,
total_experts)``) is used as it is.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ._recognise import (PROBE_RTOL, ROUTED, ROUTER_NAMES, SHARED_GATE_NAMES, SHARED_NAMES, CapturedRouter, Observed,
                         RoutedExperts, _fail, call_experts, child_router, find_moe_blocks, shared_part)
from .dispatch import group_size
from .experts import LocalExperts
from .layer import ExpertParallelMoE, SharedExperts
from .layout import LayoutError

PROBE_TOKENS = 16
_EXAMPLES = ("collectives.reference.MoE or a transformers sparse MoE block (MixtralSparseMoeBlock, "
             "Qwen2MoeSparseMoeBlock, Qwen3MoeSparseMoeBlock, DeepseekV3MoE, ...; see docs/expert-parallel.md)")

__all__ = ["TransformersRouter", "find_moe_blocks", "wrap_expert_parallel"]


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


def _per_rank(total: int, world: int) -> int:
    if total % world:
        raise LayoutError(f"{total} experts cannot be sharded over an expert-parallel group of {world} ranks: "
                          f"the expert count must be a multiple of the group size")
    return total // world


def _placement(routed: RoutedExperts, rank: int, world: int) -> Tuple[int, int]:
    """This rank's first expert and expert count; a loader's shard must be exactly that."""
    n = _per_rank(routed.total, world)
    lo = rank * n
    if routed.sharded and (routed.first != lo or routed.count != n):
        raise LayoutError(f"the experts loaded on rank {rank} are {routed.first}..{routed.first + routed.count - 1} "
                          f"of {routed.total} (ep_shard), but rank {rank} of {world} holds experts {lo}..{lo + n - 1}")
    return lo, n


def _glu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act) -> torch.Tensor:
    g, u = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(act(g) * u, down)


def _differs(want: torch.Tensor, got: torch.Tensor, dtype: torch.dtype) -> Optional[str]:
    """None if ``got`` equals ``want`` within ``dtype``'s tolerance (relative to ``want``'s largest value)."""
    want, got = want.float(), got.float()
    scale = float(want.abs().max()) if want.numel() else 0.0
    err = float((want - got).abs().max()) if want.numel() else 0.0
    if err <= PROBE_RTOL.get(dtype, 1e-2) * max(scale, 1e-30):  # False for NaN
        return None
    return f"max difference {err:.3g} against a largest value of {scale:.3g}"


def _dense_routed(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, routed: RoutedExperts) -> torch.Tensor:
    """Every token's routed experts, weighted, from the full expert weights (float32)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(idx).tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        gu, d = routed.weights(e)
        out.index_add_(0, tok, _glu(x[tok], gu, d, routed.act).float() * w[tok, slot, None].float())
    return out


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _check_experts(block: nn.Module, routed: RoutedExperts, roles, idx_dtype: torch.dtype,
                   w_dtype: torch.dtype) -> None:
    """The experts' own forward, on a few experts and on tokens large enough to reach any clamp, must be
    ``down(act(gate) * up)`` of the weights we take."""
    picks = sorted({round(i * (routed.count - 1) / 3) for i in range(4)})
    gen = torch.Generator().manual_seed(1)
    ref = routed.weight
    x = torch.randn(2 * len(picks), routed.hidden, generator=gen).to(device=ref.device, dtype=ref.dtype)
    ids = [e for e in picks for _ in range(2)]
    ours = []
    for i, e in enumerate(ids):
        gu, d = routed.weights(e)
        x[i] *= 16.0 / max(float(F.linear(x[i].float(), gu.float()).abs().max()), 1e-30)
        ours.append(_glu(x[i:i + 1], gu, d, routed.act))
    ours = torch.cat(ours)
    if routed.layout == "list":
        theirs = torch.cat([routed.module[e](x[i:i + 1]) for i, e in enumerate(ids)])
    else:
        idx = torch.tensor(ids, device=x.device, dtype=idx_dtype)[:, None]
        theirs = call_experts(routed.module, roles, x, idx, torch.ones(len(ids), 1, device=x.device, dtype=w_dtype))
    diff = _differs(theirs, ours, ref.dtype)
    if diff is not None:
        raise _fail(block, f"its experts ({type(routed.module).__name__}) do not compute down(act(gate) * up) of "
                           f"their weights with act = {_name(routed.act)} ({diff} on large tokens): a "
                           f"clamped or custom activation, or a norm, is not modelled")


def _why_not(block: nn.Module, want: torch.Tensor, routed: torch.Tensor, shared: Optional[torch.Tensor],
             dtype: torch.dtype) -> str:
    """What the probe saw, where the block's output is not routed + shared."""
    rest = want - (shared if shared is not None else 0)
    scale = float((rest * routed).sum() / (routed * routed).sum().clamp_min(1e-30))
    if _differs(rest, scale * routed, dtype) is None:
        return f"it scales the routed experts' output by {scale:.4g} after them, which we do not model"
    known = {ROUTED, *ROUTER_NAMES, *SHARED_NAMES, *SHARED_GATE_NAMES}
    others = [n for n in block._modules if n not in known]
    hint = "its shared experts may be combined in a way we do not model, or " if shared is not None else ""
    hint += "the block transforms the experts' output or adds something else"
    return hint + (f" (its other parts: {', '.join(others)})" if others else "")


def _runs(block: nn.Module, fn):
    """``fn()``, with an error of the block's own forward turned into a TypeError saying so."""
    try:
        return fn()
    except Exception as err:
        if isinstance(err, TypeError) and str(err).startswith("wrap_expert_parallel:"):
            raise
        raise _fail(block, f"its forward does not run on the tokens alone ({type(err).__name__}: {err}); it may "
                           f"need other inputs (e.g. position embeddings, or token ids for hash routing)") from err


def _probe(block: nn.Module, routed: RoutedExperts, router: nn.Module, shared: Optional[SharedExperts],
           x: torch.Tensor, seen: Optional[Observed]) -> None:
    """The block's own output on the probe batch ``x`` must be routed experts + shared part."""
    h = x.shape[-1]
    flat = x.reshape(-1, h)
    dtype = routed.weight.dtype
    with torch.no_grad():
        if seen is not None:
            hs, idx, w, roles = seen.hidden, seen.index, seen.weights, seen.roles
        else:
            (idx, w), hs, roles = _runs(block, lambda: router(flat)), flat, None
        if hs.shape[-1] != h or hs.numel() != flat.numel() or not torch.equal(hs.reshape(-1, h), flat):
            raise _fail(block, "its router transforms the tokens before the experts (they get other hidden "
                               "states than the block's input, e.g. scaled by the router scores)")
        want = _runs(block, lambda: block(x))
        if not isinstance(want, torch.Tensor):
            raise _fail(block, f"its forward returns {type(want).__name__}, not the output tensor")
        idx, w = idx.reshape(-1, idx.shape[-1]), w.reshape(-1, w.shape[-1])
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= routed.total):
            raise _fail(block, f"its router picks expert ids outside 0..{routed.total - 1} (e.g. zero or identity "
                               f"experts), which have no weights to shard")
        _check_experts(block, routed, roles, idx.dtype, w.dtype)
        got = _dense_routed(flat, idx, w, routed)
        extra = shared(flat).float() if shared is not None else None
        want = want.reshape(-1, h).float()
        diff = _differs(want, got if extra is None else got + extra, dtype)
        if diff is not None:
            raise _fail(block, f"its output is not routed experts + shared part on a probe batch ({diff}): "
                               + _why_not(block, want, got, extra, dtype))


def wrap_expert_parallel(module: nn.Module, group: Optional[dist.ProcessGroup] = None, *,
                         overlap_shared: bool = True, impl: str = "auto", check: bool = True) -> ExpertParallelMoE:
    """An `ExpertParallelMoE` computing what ``module`` computes, with this rank's experts only.

    ``check``: verify once, on a probe batch of 16 tokens, that the block's output is the routed experts
    (from the routing it computes) plus its shared part (skipped for a loader's shard, ``ep_shard``).
    Raises TypeError naming the part of the block that is missing or not supported.
    """
    world = group_size(group)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    experts = getattr(module, "_modules", {}).get(ROUTED)
    if not isinstance(experts, nn.Module):
        raise TypeError(f"wrap_expert_parallel: unsupported module {type(module).__name__}: no routed experts found "
                        f"(no child named {ROUTED!r}); expected an MoE block such as {_EXAMPLES}")
    routed = RoutedExperts(module, experts)
    shared, shared_names = shared_part(module)
    probe = not routed.sharded and check
    ref = routed.weight
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, PROBE_TOKENS, routed.hidden, generator=gen).to(device=ref.device, dtype=ref.dtype)
    seen = None
    if routed.layout == "list":
        router = child_router(module, x[0, :2])
    else:
        router = CapturedRouter(module, shared_names)
        try:
            with torch.no_grad():
                seen = _runs(module, lambda: router.observe(x))
        except TypeError:
            if probe:
                raise
        if seen is not None and seen.shortcut is not None:
            router = seen.shortcut
    lo, n = _placement(routed, rank, world)
    if probe:
        _probe(module, routed, router, shared, x, seen)
    gate_up, down = routed.stacked(lo - routed.first, n)
    return ExpertParallelMoE(router, LocalExperts(gate_up, down, lo, routed.act, impl), routed.total, group, shared,
                             overlap_shared)
