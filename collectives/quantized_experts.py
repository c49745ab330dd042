"""This rank's routed experts kept quantized (`QuantizedExperts`), beside `collectives.experts.LocalExperts`.

The weights stay in their stored dtype (``float8_e4m3fn`` or int8) in the stacked layout of `LocalExperts`:
``gate_up_q [E_local, 2F, H]`` (gate rows first) and ``down_q [E_local, H, F]``, with each projection's scales
(`collectives.weight_quant`: per 128 x 128 block for FP8, per output channel for int8). The CPU reference
path dequantizes one expert's weights at a time, as its rows come, and computes ``down(act(gate(x)) * up(x))``
in the tokens' dtype: the result is the dequantized float model's, up to float rounding.

The layer and the exchanges use it as they use `LocalExperts` (``num_local``, ``first_expert``, ``act``, the
float ``gate_up`` / ``down`` as shape and dtype,
``plain`` (False: the static-shape paths call it with a device group list), ``forward(x, counts, impl)``);
the tokens it takes are float.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .weight_quant import Block, check_scheme, dequantize, scale_names

PROJECTIONS = ("gate", "up", "down")

__all__ = ["PROJECTIONS", "QuantizedExperts"]


class QuantizedExperts(nn.Module):
    """The routed experts of one rank, quantized by ``scheme`` (one of `collectives.weight_quant.SCHEMES`).

    ``gate_up [E, 2F, H]`` and ``down [E, H, F]`` in the quantized dtype; ``scales`` maps each of
    `PROJECTIONS` to its scales stacked per expert, as `collectives.weight_quant.scale_names` orders them
    (FP8: ``[E, ceil(F/bo), ceil(H/bi)]`` for gate and up; int8: ``[E, F, 1]`` scale and offset).
    ``dtype``: the float dtype the model runs in (what it takes and returns)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, scales: Dict[str, Sequence[torch.Tensor]],
                 scheme: str, first_expert: int = 0, act: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 block: Block = (128, 128), dtype: torch.dtype = torch.float32):
        super().__init__()
        check_scheme(scheme)
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0] \
                or gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
            raise ValueError(f"expert weights must be gate_up [E, 2F, H] and down [E, H, F], got "
                             f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
        if sorted(scales) != sorted(PROJECTIONS):
            raise ValueError(f"scales must name each of {PROJECTIONS}, got {sorted(scales)}")
        self.scheme, self.block, self.dtype = scheme, tuple(block), dtype
        self.register_buffer("gate_up_q", gate_up)
        self.register_buffer("down_q", down)
        for proj in PROJECTIONS:
            for name, t in zip(scale_names(scheme), scales[proj]):
                self.register_buffer(f"{proj}_{name}", t)
        self.first_expert = first_expert
        self.act = act or F.silu
        self.identity = 0

    @property
    def gate_up(self) -> torch.Tensor:
        """The float ``gate_up`` these experts stand for, as shape and dtype only (a meta tensor: what the layer
        and the exchanges check tokens and shapes against)."""
        return torch.empty(self.gate_up_q.shape, dtype=self.dtype, device="meta")

    @property
    def down(self) -> torch.Tensor:
        """The float ``down``, as shape and dtype only (see `gate_up`)."""
        return torch.empty(self.down_q.shape, dtype=self.dtype, device="meta")

    @property
    def num_local(self) -> int:
        return self.gate_up_q.shape[0]

    def extras(self) -> List[str]:
        """What these experts compute beyond the plain form: their weights are quantized."""
        return [f"{self.scheme} weights dequantized as they run"]

    @property
    def plain(self) -> bool:
        return False

    def scales(self, proj: str, e: int) -> Tuple[torch.Tensor, ...]:
        """Expert ``e``'s scales of projection ``proj``."""
        return tuple(getattr(self, f"{proj}_{n}")[e] for n in scale_names(self.scheme))

    def weights(self, e: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e``'s ``(gate_up [2F, H], down [H, F])`` dequantized to ``dtype``."""
        f = self.down_q.shape[2]
        gate = dequantize(self.gate_up_q[e, :f], self.scales("gate", e), self.scheme, dtype, self.block)
        up = dequantize(self.gate_up_q[e, f:], self.scales("up", e), self.scheme, dtype, self.block)
        down = dequantize(self.down_q[e], self.scales("down", e), self.scheme, dtype, self.block)
        return torch.cat([gate, up]), down

    def quantized_bytes(self) -> Tuple[int, int]:
        """``(weight bytes, scale bytes)`` these experts hold."""
        weights = sum(t.numel() * t.element_size() for t in (self.gate_up_q, self.down_q))
        held = sum(t.numel() * t.element_size() for t in self.buffers())
        return weights, held - weights

    def forward(self, x: torch.Tensor, counts, impl: Optional[str] = None) -> torch.Tensor:
        """The experts over rows grouped by ``counts`` (host ints, or a device group list whose padding rows
        come out zero); ``impl`` is accepted for `LocalExperts`' signature: the reference path is a loop."""
        padded = isinstance(counts, torch.Tensor)
        host = [int(c) for c in (counts.tolist() if padded else counts)]
        if len(host) != self.num_local or (not padded and sum(host) != x.shape[0]):
            raise ValueError(f"QuantizedExperts: counts {host} do not split {x.shape[0]} rows over "
                             f"{self.num_local} experts")
        out = x.new_zeros(x.shape[0], self.down_q.shape[1])
        start = 0
        for e, n in enumerate(host):
            if n:
                gate_up, down = self.weights(e, x.dtype)
                g, u = F.linear(x[start:start + n], gate_up).chunk(2, dim=-1)
                out[start:start + n] = F.linear(self.act(g) * u, down)
            start += n
        return out

    def extra_repr(self) -> str:
        e, f2, h = self.gate_up_q.shape
        return f"experts={e}, hidden={h}, ffn={f2 // 2}, scheme={self.scheme}, first_expert={self.first_expert}"
