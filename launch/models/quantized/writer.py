"""A float transformers MoE model saved as a quantized checkpoint, by the format's own rules (for tests and users
who want a small one): `save_quantized`.

Which weights are quantized: every 2-D ``.weight`` of a linear projection (attention, dense MLPs, shared and
routed experts); the embedding, the norms, the router (``mlp.gate``), the shared-expert gate and the LM head
stay as they are, as in DeepSeek's FP8 releases and msModelSlim's MoE exports.
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, Tuple

import torch
from torch import nn

from collectives.weight_quant import quantize

from .formats import DESCRIPTION, METHODS, STATIC_EXTRAS

_KEPT = re.compile(r"(embed_tokens|lm_head|norm|\.gate\.weight$|shared_expert_gate|e_score_correction_bias)")
_EXPERT = re.compile(r"\.experts\.\d+\.")

__all__ = ["quantizes", "save_quantized"]


def quantizes(key: str, t: torch.Tensor) -> bool:
    """Whether the formats' rule quantizes tensor ``key`` (``t``: its value, or a meta tensor of its shape): a 2-D
    float ``.weight`` of a linear projection, not the embedding, a norm, a router or the LM head."""
    return key.endswith(".weight") and t.dim() == 2 and t.is_floating_point() and not _KEPT.search(key)


def _fp8_tensors(state: Dict[str, torch.Tensor], block: Tuple[int, int]) -> Dict[str, torch.Tensor]:
    out = {}
    for key, t in state.items():
        if quantizes(key, t):
            q = quantize(t, "fp8_block", block)
            out[key], out[f"{key}_scale_inv"] = q["weight"], q["weight_scale_inv"]
        else:
            out[key] = t
    return out


def _static_extras(q: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Static W8A8's activation parameters for a symmetric per-tensor int8 input of scale 1/127 (inputs in
    [-1, 1]), offset 0, no bias: ``deq_scale = input_scale * weight_scale``, ``quant_bias`` 0."""
    out_features = q["weight"].shape[0]
    input_scale = torch.tensor([1.0 / 127])
    values = (input_scale, torch.zeros(1), torch.zeros(out_features, dtype=torch.int32),
              (input_scale * q["weight_scale"].flatten()).float())
    return dict(zip(STATIC_EXTRAS, values))


def _w8a8_tensors(state: Dict[str, torch.Tensor], static: bool) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    out, types = {}, {}
    for key, t in state.items():
        if not quantizes(key, t):
            out[key], types[key] = t, "FLOAT"
            continue
        kind = "W8A8" if static and not _EXPERT.search(key) else "W8A8_DYNAMIC"
        q = quantize(t, "int8_channel")
        base = key[: -len("weight")]
        for name, value in {**q, **(_static_extras(q) if kind == "W8A8" else {})}.items():
            out[base + name], types[base + name] = value, kind
    return out, types


def save_quantized(model: nn.Module, path: str, method: str, block: Tuple[int, int] = (128, 128),
                   static: bool = False) -> None:
    """Save transformers ``model`` (float) in ``path`` as a ``method`` checkpoint (one of `METHODS`): ``fp8``
    (DeepSeek's: ``quantization_config``, ``float8_e4m3fn`` weights, float32 ``weight_scale_inv`` per ``block``)
    or ``w8a8`` (msModelSlim's: int8 weights with ``weight_scale`` / ``weight_offset`` per channel, typed
    ``W8A8_DYNAMIC`` in quant_model_description.json; with ``static``, the dense projections ``W8A8`` with
    their activation parameters)."""
    from safetensors.torch import load_file, save_file

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    model.save_pretrained(path, max_shard_size="100GB")
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    if method == "fp8":
        tensors = _fp8_tensors(state, block)
    else:
        tensors, types = _w8a8_tensors(state, static)
        with open(os.path.join(path, DESCRIPTION), "w", encoding="utf-8") as f:
            json.dump({"model_quant_type": "W8A8" if static else "W8A8_DYNAMIC", **types}, f, indent=1)
    save_file({k: v.contiguous() for k, v in tensors.items()}, file, metadata={"format": "pt"})
    if method == "fp8":
        config_file = os.path.join(path, "config.json")
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(block)}
        with open(config_file, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
