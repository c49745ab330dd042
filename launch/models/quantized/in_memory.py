"""A float model quantized in memory by a format's rules, kept quantized: the reference decoder and the small seeded
transformers models (``--model NAME``), which no checkpoint holds, run as a quantized checkpoint runs
(`quantize_in_memory`).

The rules are the writer's (`launch.models.quantized.save_quantized`): the routed experts, and every linear
projection that `quantizes` names (attention, dense MLPs, shared experts; not the embedding, the norms, the router
or the LM head), quantized per 128 x 128 block to ``float8_e4m3fn`` (``fp8``) or per output channel to int8
(``w8a8``, W8A8_DYNAMIC). The experts become `collectives.QuantizedExperts`, the projections
`collectives.QuantizedLinear`; with ``dequantize`` each weight is replaced by the float it stands for instead (the
dequantized model ``--check`` compares with).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn

from collectives import ExpertParallelMoE, LocalExperts, QuantizedExperts, QuantizedLinear
from collectives.weight_quant import dequantize as dequantized, quantize, scale_names

from .formats import METHODS
from .writer import quantizes

__all__ = ["quantize_in_memory"]


def _scheme(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"quantize: the format must be one of {METHODS}, got {method!r}")
    return "fp8_block" if method == "fp8" else "int8_channel"


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _rounded(w: torch.Tensor, scheme: str) -> Tuple[torch.Tensor, Tuple[torch.Tensor, ...]]:
    """``w`` quantized by ``scheme``: the quantized weight and its scales, in `scale_names` order."""
    q = quantize(w, scheme)
    return q["weight"], tuple(q[n] for n in scale_names(scheme))


def _experts(experts: LocalExperts, scheme: str, dequantize: bool, held: Dict[str, int]) -> nn.Module:
    """This rank's plain routed experts quantized (or, with ``dequantize``, rounded and back in their dtype)."""
    if not experts.plain:
        raise ValueError(f"quantize: only plain experts are quantized (down(act(gate(x)) * up(x))); these compute "
                         f"{', '.join(experts.extras())}")
    f = experts.down.shape[2]
    parts = {"gate": experts.gate_up[:, :f], "up": experts.gate_up[:, f:], "down": experts.down}
    rounded = {proj: _rounded(w.detach(), scheme) for proj, w in parts.items()}
    if dequantize:
        back = {p: dequantized(q, s, scheme, experts.gate_up.dtype) for p, (q, s) in rounded.items()}
        experts.gate_up.data = torch.cat([back["gate"], back["up"]], dim=1)
        experts.down.data = back["down"]
        return experts
    as_bytes = [rounded[p][0].view(torch.uint8) for p in ("gate", "up")]  # float8 has no cat on every device
    gate_up = torch.cat(as_bytes, dim=1).view(rounded["gate"][0].dtype)
    kept = QuantizedExperts(gate_up, rounded["down"][0], {p: rounded[p][1] for p in rounded}, scheme,
                            experts.first_expert, experts.act, dtype=experts.gate_up.dtype)
    weights, scales = kept.quantized_bytes()
    held["experts"] += weights
    held["scales"] += scales
    return kept


def _linears(model: nn.Module) -> List[Tuple[nn.Module, str, nn.Linear, str]]:
    """Every place a quantized projection sits: ``(parent, attribute, linear, its name)``, a module held in two
    places (a block's shared experts and the layer's) listed at each."""
    return [(parent, leaf, child, f"{name}.{leaf}" if name else leaf)
            for name, parent in model.named_modules(remove_duplicate=False)
            for leaf, child in parent.named_children()
            if isinstance(child, nn.Linear) and quantizes(f"{name}.{leaf}.weight", child.weight)]


def quantize_in_memory(model: nn.Module, method: str, dequantize: bool = False) -> Dict[str, int]:
    """Quantize ``model`` in place by ``method``'s rules (one of `METHODS`), kept quantized; its MoE blocks must be
    expert-parallel already (`ExpertParallelMoE`: each rank quantizes its own experts). Returns the bytes held
    quantized: ``experts``, ``dense``, ``scales`` (zeros with ``dequantize``, which rounds each weight by the same
    rules and keeps it in its dtype: the float model the quantized one stands for). A ValueError for experts
    that compute more than the plain form (biases, another GLU), which the quantized experts do not."""
    scheme = _scheme(method)
    held = {"experts": 0, "dense": 0, "scales": 0}
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    if not layers:
        raise ValueError("quantize: the model has no expert-parallel MoE layer (make it expert-parallel first)")
    for layer in layers:
        if isinstance(layer.experts, LocalExperts):
            layer.experts = _experts(layer.experts, scheme, dequantize, held)
    done: Dict[int, nn.Module] = {}
    for parent, leaf, linear, _ in _linears(model):
        if id(linear) not in done:
            q, scales = _rounded(linear.weight.detach(), scheme)
            if dequantize:
                linear.weight.data = dequantized(q, scales, scheme, linear.weight.dtype)
                done[id(linear)] = linear
            else:
                bias = None if linear.bias is None else linear.bias.detach()
                done[id(linear)] = QuantizedLinear(q, scales, scheme, bias=bias)
                held["dense"] += _nbytes(q)
                held["scales"] += _nbytes(*scales)
        setattr(parent, leaf, done[id(linear)])
    return held
