"""Quantized weights kept in their stored dtype: the rules of the two formats the loader reads, and a linear.

Two schemes (`SCHEMES`):

- ``"fp8_block"`` (DeepSeek-V3's FP8 checkpoints): a ``float8_e4m3fn`` weight ``[out, in]`` and a float32
  ``weight_scale_inv [ceil(out/bo), ceil(in/bi)]``, one per block of ``bo x bi`` (128 x 128 in the releases;
  the last row and column of blocks cover what is left); the weight is ``w * scale_inv`` of its block.
- ``"int8_channel"`` (msModelSlim's W8A8 and W8A8_DYNAMIC): an int8 weight ``[out, in]`` with
  ``weight_scale`` and ``weight_offset`` ``[out, 1]`` per output channel; the weight is ``(q - offset) * scale``.

`quantize` / `dequantize` apply them to a 2-D weight (or a stack of them, leading dimensions first);
`QuantizedLinear` holds one weight quantized and computes with it dequantized as it runs (the CPU reference
path).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

SCHEMES = ("fp8_block", "int8_channel")
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INT8_MAX = 127.0
Block = Tuple[int, int]

__all__ = ["FP8_MAX", "INT8_MAX", "QuantizedLinear", "SCHEMES", "block_scale_shape", "check_scheme", "dequantize",
           "quantize", "scale_names"]


def check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"quantization scheme must be one of {SCHEMES}, got {scheme!r}")


def scale_names(scheme: str) -> Tuple[str, ...]:
    """The names of a quantized weight's scales, as its checkpoint names them beside ``weight``."""
    check_scheme(scheme)
    return ("weight_scale_inv",) if scheme == "fp8_block" else ("weight_scale", "weight_offset")


def block_scale_shape(out: int, inp: int, block: Block) -> Tuple[int, int]:
    """``[ceil(out / bo), ceil(in / bi)]``: the FP8 scales of an ``[out, in]`` weight."""
    return math.ceil(out / block[0]), math.ceil(inp / block[1])


def _expand_blocks(scale: torch.Tensor, out: int, inp: int, block: Block) -> torch.Tensor:
    """Each block's scale repeated over the block's values, cut to ``[..., out, in]``."""
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., :out, :inp]


def quantize(w: torch.Tensor, scheme: str, block: Block = (128, 128)) -> Dict[str, torch.Tensor]:
    """``w [..., out, in]`` quantized by ``scheme``'s rule: ``{"weight": ..., <scale_names>: ...}``.
    FP8: each block's scale makes its largest magnitude 448; int8: each channel's makes it 127 (offset 0)."""
    check_scheme(scheme)
    w = w.float()
    out, inp = w.shape[-2:]
    if scheme == "fp8_block":
        rows, cols = block_scale_shape(out, inp, block)
        padded = F.pad(w, (0, cols * block[1] - inp, 0, rows * block[0] - out))
        tiles = padded.reshape(*w.shape[:-2], rows, block[0], cols, block[1])
        amax = tiles.abs().amax(dim=(-3, -1)).clamp(min=1e-12)
        scale_inv = (amax / FP8_MAX).float()
        q = (w / _expand_blocks(scale_inv, out, inp, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": scale_inv}
    scale = (w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / INT8_MAX).float()
    q = torch.round(w / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return {"weight": q, "weight_scale": scale, "weight_offset": torch.zeros_like(scale)}


def dequantize(q: torch.Tensor, scales: Sequence[torch.Tensor], scheme: str, dtype: torch.dtype,
               block: Block = (128, 128)) -> torch.Tensor:
    """The weight ``q [..., out, in]`` stands for, in ``dtype``: ``scales`` as `scale_names` orders them
    (computed in float32, then cast)."""
    check_scheme(scheme)
    out, inp = q.shape[-2:]
    if scheme == "fp8_block":
        (scale_inv,) = scales
        return (q.float() * _expand_blocks(scale_inv.float(), out, inp, block)).to(dtype)
    scale, offset = scales
    return ((q.float() - offset.float()) * scale.float()).to(dtype)


class QuantizedLinear(nn.Module):
    """A linear whose weight stays quantized (``weight``, and its scales as buffers named as the checkpoint
    names them); its forward dequantizes the weight to the input's dtype and applies it (the CPU reference
    path). Static W8A8's activation parameters (``input_scale``, ``input_offset``, ``quant_bias``,
    ``deq_scale``), where given, are held as they are."""

    def __init__(self, weight: torch.Tensor, scales: Sequence[torch.Tensor], scheme: str, block: Block = (128, 128),
                 bias: Optional[torch.Tensor] = None, extras: Optional[Dict[str, torch.Tensor]] = None):
        super().__init__()
        check_scheme(scheme)
        if weight.dim() != 2:
            raise ValueError(f"a quantized linear's weight must be [out, in], got {tuple(weight.shape)}")
        self.scheme, self.block = scheme, tuple(block)
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        for name, scale in zip(scale_names(scheme), scales):
            self.register_buffer(name, scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        for name, t in (extras or {}).items():
            self.register_buffer(name, t)

    def scales(self) -> Tuple[torch.Tensor, ...]:
        return tuple(getattr(self, n) for n in scale_names(self.scheme))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype``."""
        return dequantize(self.weight, self.scales(), self.scheme, dtype, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"
