"""Turn an existing MoE block into an `ExpertParallelMoE` holding only this rank's experts.

Blocks are recognised by their parts, not by class name (`collectives._recognise`): a child ``experts``
(fused 3-D expert tensors or an ``nn.ModuleList`` of gated MLPs), the routing the block's own forward
computes, and optional shared experts with an optional sigmoid output gate; or a routed block as a child
with shared experts beside it (summed). This covers the toolkit's `collectives.reference.MoE` and the sparse
MoE blocks of Hugging Face transformers (the families checked are listed in docs/expert-parallel.md). The
router and the shared experts are reused as they are (no copy); this rank's experts are copied once into the
stacked layout, and nothing else of the full expert weights is kept. A block whose experts a checkpoint
loader already sharded (``block.experts.ep_shard = (first_expert, total_experts)``) is used as it is.

What the experts compute is checked, not assumed: their biases, the GLU their attributes suggest (a clamped
SwiGLU for a ``limit``), identity experts past the weighted ones (`IdentitySlots`), and tokens scaled by
dense router scores before the experts (`collectives._recognise.DenseTopK`) are each modelled only where
the experts' own forward, run on a probe, computes exactly that. Identity experts the block adds itself, its
experts getting those picks with weight 0 (`collectives._recognise.folds_identity`: LongCat-Flash from
transformers 5.25; before, its experts module returned the token), are modelled where the block's own output,
with identity picks forced into its router's, is exactly that.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ._recognise import (PROBE_RTOL, ROUTED, ROUTER_NAMES, SHARED_GATE_NAMES, SHARED_NAMES, CapturedRouter, Observed,
                         RoutedExperts, call_experts, child_router, find_moe_blocks, forced_block, misfit, shared_part)
from .capacity import CapacityExchange
from .dispatch import AllToAllExchange
from .exchange import Exchange
from .experts import LocalExperts
from .group import group_size
from .layer import ExpertParallelMoE, SharedExperts
from .layout import LayoutError
from .mc2 import MC2_EXCHANGES, MC2_MAX_TOKENS, MC2Exchange, decode_exchange_named
from .quantize import DispatchDtype, dispatch_dtype_of
from .quantized_experts import QuantizedExperts

PROBE_TOKENS = 16
_EXAMPLES = ("collectives.reference.MoE or a transformers sparse MoE block (MixtralSparseMoeBlock, "
             "Qwen2MoeSparseMoeBlock, Qwen3MoeSparseMoeBlock, DeepseekV3MoE, ...; see docs/expert-parallel.md)")

__all__ = ["IdentitySlots", "TransformersRouter", "capacity_expert_parallel", "find_moe_blocks", "mc2_expert_parallel",
           "wrap_expert_parallel"]


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


def _output(out):
    """A block's output tensor: itself, or the first item of the ``(output, router logits)`` some blocks return."""
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return out


def _expert(x: torch.Tensor, routed: RoutedExperts, e: int, glu) -> torch.Tensor:
    """Expert ``e`` (counted within the module) on rows ``x``; ``glu`` None is ``act(gate) * up``."""
    gu, d = routed.weights(e)
    b_gu, b_d = routed.bias(e)
    g, u = F.linear(x, gu, b_gu).chunk(2, dim=-1)
    return F.linear(routed.act(g) * u if glu is None else glu(g, u), d, b_d)


def _differs(want: torch.Tensor, got: torch.Tensor, dtype: torch.dtype) -> Optional[str]:
    """None if ``got`` equals ``want`` within ``dtype``'s tolerance (relative to ``want``'s largest value)."""
    want, got = want.float(), got.float()
    scale = float(want.abs().max()) if want.numel() else 0.0
    err = float((want - got).abs().max()) if want.numel() else 0.0
    if err <= PROBE_RTOL.get(dtype, 1e-2) * max(scale, 1e-30):  # False for NaN
        return None
    return f"max difference {err:.3g} against a largest value of {scale:.3g}"


def _dense_routed(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, routed: RoutedExperts, glu,
                  scores: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Every token's routed experts, weighted, from the full expert weights (float32); ids past the weighted
    experts are identity experts; with ``scores``, each expert's input is the token times its score."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(idx).tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        rows = x[tok] if scores is None else x[tok] * scores[tok, e, None].to(x.dtype)
        y = rows if e >= routed.count else _expert(rows, routed, e, glu)
        out.index_add_(0, tok, y.float() * w[tok, slot, None].float())
    return out


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _their_experts(routed: RoutedExperts, roles, x: torch.Tensor, ids: List[int], idx_dtype: torch.dtype,
                   w_dtype: torch.dtype, dense: bool, k: int = 1) -> torch.Tensor:
    """The experts' own forward, row ``i`` of ``x`` through expert ``ids[i]`` alone (weight 1)."""
    if routed.layout == "list":
        return torch.cat([routed.module[e](x[i:i + 1]) for i, e in enumerate(ids)])
    if dense:  # one tensor: expert after expert, each its block of rows (zero rows elsewhere)
        outs = []
        for i, e in enumerate(ids):
            h = x.new_zeros(routed.count, 1, x.shape[1])
            h[e, 0] = x[i]
            outs.append(routed.module(h.reshape(-1, x.shape[1])).reshape(routed.count, 1, -1)[e])
        return torch.cat(outs)
    # as many slots as the block passes (some experts' forward assumes k > 1), all on the expert, the first of weight 1
    idx = torch.tensor(ids, device=x.device, dtype=idx_dtype)[:, None].repeat(1, k)
    w = torch.zeros(len(ids), k, device=x.device, dtype=w_dtype)
    w[:, 0] = 1
    return call_experts(routed.module, roles, x, idx, w)


def _check_experts(block: nn.Module, routed: RoutedExperts, roles, idx_dtype: torch.dtype, w_dtype: torch.dtype,
                   identity_ids: Sequence[int] = (), dense: bool = False, k: int = 1):
    """The experts' own forward, on a few experts and on tokens large enough to reach any clamp, must be one of
    the GLUs their attributes suggest (`glu_candidates`) of the weights (and biases) we take: the one that
    matches is returned. Ids past the weighted experts (``identity_ids``) must return their token."""
    picks = sorted({round(i * (routed.count - 1) / 3) for i in range(4)})
    gen = torch.Generator().manual_seed(1)
    ref = routed.weight
    x = torch.randn(2 * len(picks), routed.hidden, generator=gen).to(device=ref.device, dtype=ref.dtype)
    ids = [e for e in picks for _ in range(2)]
    for i, e in enumerate(ids):
        gu, _ = routed.weights(e)
        x[i] *= 16.0 / max(float(F.linear(x[i].float(), gu.float()).abs().max()), 1e-30)
    theirs = _their_experts(routed, roles, x, ids, idx_dtype, w_dtype, dense, k)
    diffs = []
    for glu in routed.glus:
        ours = torch.cat([_expert(x[i:i + 1], routed, e, glu) for i, e in enumerate(ids)])
        diff = _differs(theirs, ours, ref.dtype)
        if diff is None:
            break
        diffs.append(diff)
    else:
        forms = ", nor ".join("down(act(gate) * up)" if glu is None else f"down({glu!r}(gate, up))"
                              for glu in routed.glus)
        bias = " (and biases)" if routed.biases else ""
        raise misfit(block, f"its experts ({type(routed.module).__name__}) do not compute {forms} of their weights"
                            f"{bias} with act = {_name(routed.act)} ({diffs[-1]} on large tokens): a clamped or "
                            f"custom activation, or a norm, is not modelled")
    for e in identity_ids:
        y = _their_experts(routed, roles, x[:1], [e], idx_dtype, w_dtype, dense, k)
        if _differs(x[:1], y, ref.dtype) is not None:
            raise misfit(block, f"its router picks expert {e}, past its {routed.count} weighted experts, and its "
                                f"experts do not return the token there (an identity expert)")
    return glu


def _why_not(block: nn.Module, want: torch.Tensor, routed: torch.Tensor, shared: Optional[torch.Tensor],
             dtype: torch.dtype, folded: Optional[int] = None) -> str:
    """What the probe saw, where the block's output is not routed + shared (``folded``: the weighted experts of a
    block that takes the identity picks out of its experts')."""
    rest = want - (shared if shared is not None else 0)
    scale = float((rest * routed).sum() / (routed * routed).sum().clamp_min(1e-30))
    if _differs(rest, scale * routed, dtype) is None:
        return f"it scales the routed experts' output by {scale:.4g} after them, which we do not model"
    known = {ROUTED, *ROUTER_NAMES, *SHARED_NAMES, *SHARED_GATE_NAMES}
    others = [n for n in block._modules if n not in known]
    hint = "its shared experts may be combined in a way we do not model, or " if shared is not None else ""
    if folded is not None:
        hint += (f"it takes its router's picks past its {folded} weighted experts out of its experts' and adds "
                 f"other than the token times their weight (not identity experts), or ")
    hint += "the block transforms the experts' output or adds something else"
    return hint + (f" (its other parts: {', '.join(others)})" if others else "")


def _runs(block: nn.Module, fn):
    """``fn()``, with an error of the block's own forward turned into a TypeError saying so."""
    try:
        return fn()
    except Exception as err:
        if isinstance(err, TypeError) and str(err).startswith("wrap_expert_parallel:"):
            raise
        raise misfit(block, f"its forward does not run on the tokens alone ({type(err).__name__}: {err}); it may "
                            f"need other inputs (e.g. position embeddings, or token ids for hash routing)") from err


def _probe(block: nn.Module, routed: RoutedExperts, router: nn.Module, shared: Optional[SharedExperts],
           x: torch.Tensor, seen: Optional[Observed]):
    """The block's own output on the probe batch ``x`` (with identity picks forced in, where it adds identity
    experts itself) must be routed experts + shared part; returns the GLU its experts compute (see
    `_check_experts`)."""
    h = x.shape[-1]
    flat = x.reshape(-1, h)
    dtype = routed.weight.dtype
    folded = _folded(seen)
    target = block if seen is None else forced_block(block, seen)
    with torch.no_grad():
        if seen is not None:
            hs, idx, w, roles = seen.hidden, seen.index, seen.weights, seen.roles
        else:
            (idx, w), hs, roles = _runs(block, lambda: router(flat)), flat, None
        if hs.shape[-1] != h or hs.numel() != flat.numel() or not torch.equal(hs.reshape(-1, h), flat):
            raise misfit(block, "its router transforms the tokens before the experts (they get other hidden "
                                "states than the block's input, e.g. scaled by the router scores)")
        want = _output(_runs(block, lambda: target(x)))
        if not isinstance(want, torch.Tensor):
            raise misfit(block, f"its forward returns {type(want).__name__}, not the output tensor")
        idx, w = idx.reshape(-1, idx.shape[-1]), w.reshape(-1, w.shape[-1])
        top = int(idx.max()) if idx.numel() else 0
        if idx.numel() and (int(idx.min()) < 0 or (top >= routed.total and not (routed.has_identity or folded))):
            raise misfit(block, f"its router picks expert ids outside 0..{routed.total - 1} (e.g. zero or identity "
                                f"experts), which have no weights to shard")
        identity = [] if folded else sorted({e for e in idx.unique().tolist() if e >= routed.count})
        glu = _check_experts(block, routed, roles, idx.dtype, w.dtype, identity,
                             seen is not None and seen.scale is not None, idx.shape[-1])
        got = _dense_routed(flat, idx, w, routed, glu, None if seen is None else seen.scores)
        extra = shared(flat).float() if shared is not None else None
        want = want.reshape(-1, h).float()
        diff = _differs(want, got if extra is None else got + extra, dtype)
        if diff is not None:
            raise misfit(block, f"its output is not routed experts + shared part on a probe batch ({diff}): "
                                + _why_not(block, want, got, extra, dtype, routed.count if folded else None))
    return glu


def _folded(seen: Optional[Observed]) -> bool:
    """Whether the block adds its identity experts itself (`Observed.forced`)."""
    return seen is not None and seen.forced is not None


def _settled_glu(block: nn.Module, routed: RoutedExperts, roles, dense: bool):
    """The GLU of experts the probe did not check (a loader's shard, ``check=False``): verified on the experts'
    own forward where it can run, else the first candidate."""
    if len(routed.glus) == 1:
        return routed.glus[0]
    try:
        with torch.no_grad():
            return _check_experts(block, routed, roles, torch.int64, routed.weight.dtype, (), dense)
    except Exception:  # their forward needs more than we can give it here, or matches none: not verified
        return routed.glus[0]


class IdentitySlots(nn.Module):
    """Routing for a block with identity (zero-compute) experts past its ``n`` weighted ones, over ``world``
    ranks: each rank holds its ``n / world`` weighted experts and, after them, one identity expert. A weighted
    expert ``e`` becomes ``(e // per) * (per + 1) + e % per``; any identity pick becomes this rank's own
    identity expert, so those slots never travel and cost no compute."""

    def __init__(self, router: nn.Module, n: int, world: int, rank: int):
        super().__init__()
        self.router, self.n, self.world, self.rank = router, n, world, rank
        self.per = n // world

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        idx, w = self.router(x)
        per = self.per
        mapped = (idx // per) * (per + 1) + idx % per
        return torch.where(idx < self.n, mapped, torch.full_like(idx, self.rank * (per + 1) + per)), w


def _routed_child(module: nn.Module) -> Optional[Tuple[str, nn.Module]]:
    """The one child of ``module`` that has routed experts (a routed block inside a block), or None."""
    found = [(n, m) for n, m in module.named_children() if isinstance(m._modules.get(ROUTED), nn.Module)]
    return found[0] if len(found) == 1 else None


def _wrap_beside(module: nn.Module, name: str, inner: nn.Module, group, overlap_shared: bool, impl: str,
                 check: bool, exchange: Optional[Exchange], decode_exchange: Optional[Exchange]) -> ExpertParallelMoE:
    """A block made of a routed block (its child ``name``) and shared experts beside it, summed (e.g. Granite's
    ``block_sparse_moe`` with its layer's ``shared_mlp``)."""
    ep = wrap_expert_parallel(inner, group, overlap_shared=overlap_shared, impl=impl, check=check)
    shared, names = shared_part(module)
    others = [n for n in module._modules if n not in {name, *names}]
    if ep.shared is not None or others:
        raise misfit(module, f"beside its routed block {name} it has "
                             + ("shared experts of its own inside that block" if ep.shared is not None
                                else f"other parts ({', '.join(others)})"))
    if check:
        gen = torch.Generator().manual_seed(0)
        ref = ep.experts.gate_up
        x = torch.randn(1, PROBE_TOKENS, ref.shape[-1], generator=gen).to(device=ref.device, dtype=ref.dtype)
        with torch.no_grad():
            want = _output(_runs(module, lambda: module(x)))
            got = _output(inner(x)).float() + (shared(x.reshape(-1, x.shape[-1])).reshape(x.shape).float()
                                               if shared is not None else 0)
        diff = _differs(want, got, ref.dtype) if isinstance(want, torch.Tensor) else "not a tensor"
        if diff is not None:
            raise misfit(module, f"its output is not its routed block {name} plus its shared experts ({diff})")
    return ExpertParallelMoE(ep.router, ep.experts, ep.num_experts, group, shared, overlap_shared,
                             exchange=exchange, decode_exchange=decode_exchange)


def _wrap_quantized(module: nn.Module, experts: QuantizedExperts, group, overlap_shared: bool,
                    exchange: Optional[Exchange], decode_exchange: Optional[Exchange]) -> ExpertParallelMoE:
    """A block whose experts a loader left quantized (`QuantizedExperts`, with its ``ep_shard``): its routing
    captured from its own forward, its shared part, and those experts as they are (not copied, not probed:
    their own forward is the reference path)."""
    world = group_size(group)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    first, total = getattr(experts, "ep_shard", (experts.first_expert, experts.num_local * world))
    n = _per_rank(total, world)
    lo = rank * n
    if first != lo or experts.num_local != n:
        raise LayoutError(f"the quantized experts loaded on rank {rank} are {first}..{first + experts.num_local - 1} "
                          f"of {total} (ep_shard), but rank {rank} of {world} holds experts {lo}..{lo + n - 1}")
    shared, shared_names = shared_part(module)
    router = CapturedRouter(module, shared_names)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, PROBE_TOKENS, experts.down_q.shape[1], generator=gen).to(device=experts.down_q.device,
                                                                                dtype=experts.dtype)
    with torch.no_grad():
        seen = _runs(module, lambda: router.observe(x, total, total))
    if seen.scale is not None or _folded(seen):
        raise misfit(module, "its quantized experts get scaled tokens or identity experts, which the quantized "
                             "experts do not compute")
    return ExpertParallelMoE(seen.shortcut or router, experts, total, group, shared, overlap_shared,
                             exchange=exchange, decode_exchange=decode_exchange)


def wrap_expert_parallel(module: nn.Module, group: Optional[dist.ProcessGroup] = None, *,
                         overlap_shared: bool = True, impl: str = "auto", check: bool = True,
                         exchange: Optional[Exchange] = None, decode_exchange: Optional[Exchange] = None,
                         dispatch_dtype: DispatchDtype = None) -> ExpertParallelMoE:
    """An `ExpertParallelMoE` computing what ``module`` computes, with this rank's experts only.

    ``check``: verify once, on a probe batch of 16 tokens, that the block's output is the routed experts
    (from the routing it computes) plus its shared part (skipped for a loader's shard, ``ep_shard``). Experts a
    loader left quantized (`QuantizedExperts`) are used as they are.
    Raises TypeError naming the part of the block that is missing or not supported. ``exchange`` /
    ``decode_exchange``: the layer's (None: the all-to-all, and the capacity exchange for decode steps).
    ``dispatch_dtype``: ``"int8"`` / ``"fp8"`` quantize the tokens per token for the dispatch (None / ``"bf16"``:
    the model's dtype); see `ExpertParallelMoE`.
    """
    dispatch_dtype = dispatch_dtype_of(dispatch_dtype)  # a bad value refused before the block is looked at
    world = group_size(group)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    experts = getattr(module, "_modules", {}).get(ROUTED)
    if isinstance(experts, QuantizedExperts):  # quantized weights take float rows: a quantized dispatch's dequantized
        ep = _wrap_quantized(module, experts, group, overlap_shared, exchange, decode_exchange)
        ep.dispatch_dtype = dispatch_dtype
        return ep
    if not isinstance(experts, nn.Module):
        inner = _routed_child(module) if isinstance(module, nn.Module) else None
        if inner is not None:
            ep = _wrap_beside(module, *inner, group, overlap_shared, impl, check, exchange, decode_exchange)
            ep.dispatch_dtype = dispatch_dtype
            return ep
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
                seen = _runs(module, lambda: router.observe(x, routed.count, routed.total))
        except TypeError:
            if probe:
                raise
        if seen is not None and seen.shortcut is not None:
            router = seen.shortcut
    scale = None if seen is None else seen.scale
    lo, n = _placement(routed, rank, world)
    if probe:
        glu = _probe(module, routed, router, shared, x, seen)
    else:
        glu = _settled_glu(module, routed, None if seen is None else seen.roles, scale is not None)
    gate_up, down = routed.stacked(lo - routed.first, n)
    gate_up_bias, down_bias = routed.stacked_biases(lo - routed.first, n)
    total, first = routed.total, lo
    identity = (routed.has_identity or _folded(seen)) and scale is None
    if identity:  # one identity expert after each rank's weighted ones
        router, total, first = IdentitySlots(router, routed.total, world, rank), routed.total + world, rank * (n + 1)
    local = LocalExperts(gate_up, down, first, routed.act, impl, gate_up_bias=gate_up_bias, down_bias=down_bias,
                         glu=glu, identity=int(identity), input_scale=scale)
    return ExpertParallelMoE(router, local, total, group, shared, overlap_shared, exchange=exchange,
                             decode_exchange=decode_exchange, dispatch_dtype=dispatch_dtype)


def capacity_expert_parallel(module: nn.Module, group: Optional[dist.ProcessGroup] = None, *,
                             capacity: Optional[int] = None, overlap_shared: bool = True, validate: bool = True,
                             expert_path: str = "auto", dispatch_dtype: DispatchDtype = None) -> ExpertParallelMoE:
    """The static-shape layer of ``module``: `wrap_expert_parallel` with the capacity exchange for its stages too
    (`CapacityExchange` of ``capacity``, ``validate`` and ``expert_path``), so that it traces under
    ``torch.compile(fullgraph=True)`` (graph prefill). Its experts must compute the plain form
    ``down(act(gate) * up)``, which its expert paths compute (TypeError otherwise, when it is built).
    ``dispatch_dtype``: as `wrap_expert_parallel`'s."""
    exchange = CapacityExchange(capacity, validate=validate, expert_path=expert_path)
    ep = wrap_expert_parallel(module, group, overlap_shared=overlap_shared, impl="loop", exchange=exchange,
                              dispatch_dtype=dispatch_dtype)
    if not ep.experts.plain:
        raise TypeError(f"the static-shape layer computes plain experts down(act(gate) * up) only; these have "
                        f"{', '.join(ep.experts.extras())}: use wrap_expert_parallel (the eager paths)")
    return ep


def mc2_expert_parallel(module: nn.Module, group: Optional[dist.ProcessGroup] = None, *, exchange: str = "auto",
                        max_tokens_per_rank: Optional[int] = None, mc2_threshold: int = MC2_MAX_TOKENS,
                        validate: bool = True, decode_exchange: Optional[str] = None,
                        overlap_shared: bool = True, dispatch_dtype: DispatchDtype = None) -> ExpertParallelMoE:
    """`wrap_expert_parallel` whose exchanges take MC2 (`MC2Exchange`), each named by one of `MC2_EXCHANGES`.

    ``exchange``: its stages' (a prefill's), with ``max_tokens_per_rank`` as MC2's bound (``"auto"`` without one
    keeps the all-to-all and its count stage); ``decode_exchange`` (None: ``exchange``): its decode steps', with
    the step's capacity as the bound, the capacity exchange where that is ``"all_to_all"`` or auto does not take
    MC2. ``validate``: MC2's agreement all-reduce on every prefill call (else on the layer's first only); a decode
    step never runs one after the layer's first call. ``dispatch_dtype``: as `wrap_expert_parallel`'s (MC2 takes
    int8 only: its ``quant_mode=2``).
    """
    decode = decode_exchange or exchange
    for name, value in (("exchange", exchange), ("decode_exchange", decode)):
        if value not in MC2_EXCHANGES:
            raise ValueError(f"{name} must be one of {MC2_EXCHANGES}, got {value!r}")
    prefill = AllToAllExchange() if exchange == "all_to_all" else MC2Exchange(
        AllToAllExchange(), auto=exchange == "auto", max_tokens_per_rank=max_tokens_per_rank,
        mc2_threshold=mc2_threshold, validate=validate)
    steps = decode_exchange_named("capacity" if decode == "all_to_all" else decode, mc2_threshold)
    return wrap_expert_parallel(module, group, overlap_shared=overlap_shared, exchange=prefill, decode_exchange=steps,
                                dispatch_dtype=dispatch_dtype)
