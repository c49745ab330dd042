"""This rank's routed experts kept quantized (`QuantizedExperts`), beside `collectives.experts.LocalExperts`.

The weights stay in their stored dtype (``float8_e4m3fn`` or int8) in the stacked layout of `LocalExperts`:
``gate_up_q [E_local, 2F, H]`` (gate rows first) and ``down_q [E_local, H, F]``, with each projection's scales
(`collectives.weight_quant`: per 128 x 128 block for FP8, per output channel for int8). The CPU reference
path dequantizes one expert's weights at a time, as its rows come, and computes ``down(act(gate(x)) * up(x))``
in the tokens' dtype: the result is the dequantized float model's, up to float rounding.

Which kernel computes them on each path (``torch._int_mm`` for W8A8 on CPU, ``torch_npu.npu_grouped_matmul``
on the NPU paths, ``torch._scaled_mm`` for FP8 on CUDA where the GPU has FP8, the reference elsewhere):
`collectives.quantized_kernels`; ``kernel`` picks one by name (``"auto"``: by path), ``last_kernel`` says which
ran.

The layer and the exchanges use it as they use `LocalExperts` (``num_local``, ``first_expert``, ``act``, the
float ``gate_up`` / ``down`` as shape and dtype,
``plain`` (False: the static-shape paths call it with a device group list), ``forward(x, counts, impl)``).
W8A8 experts take a quantized dispatch's `QuantizedTokens` as they arrive (``takes_quantized_tokens``: int8
tokens go to the integer matmul as they are); FP8 experts take float rows.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from . import quantized_kernels as qk
from .experts import group_list
from .quantize import QuantizedTokens, as_float
from .weight_quant import Block, check_scheme, dequantize, scale_names

PROJECTIONS = ("gate", "up", "down")

__all__ = ["PROJECTIONS", "QuantizedExperts"]


class QuantizedExperts(nn.Module):
    """The routed experts of one rank, quantized by ``scheme`` (one of `collectives.weight_quant.SCHEMES`).

    ``gate_up [E, 2F, H]`` and ``down [E, H, F]`` in the quantized dtype; ``scales`` maps each of
    `PROJECTIONS` to its scales stacked per expert, as `collectives.weight_quant.scale_names` orders them
    (FP8: ``[E, ceil(F/bo), ceil(H/bi)]`` for gate and up; int8: ``[E, F, 1]`` scale and offset).
    ``dtype``: the float dtype the model runs in (what it takes and returns). ``kernel``: one of
    `collectives.quantized_kernels.KERNELS` (``"auto"``: the path's)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, scales: Dict[str, Sequence[torch.Tensor]],
                 scheme: str, first_expert: int = 0, act: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 block: Block = (128, 128), dtype: torch.dtype = torch.float32, kernel: str = "auto"):
        super().__init__()
        check_scheme(scheme)
        if kernel not in qk.KERNELS:
            raise ValueError(f"QuantizedExperts: kernel must be one of {qk.KERNELS}, got {kernel!r}")
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
        self.kernel = kernel
        # read once here, not in a forward (which may be captured): the integer kernels skip a zero offset
        self.zero_offsets = scheme != "int8_channel" or all(not bool(t[1].any()) for t in scales.values())
        self.last_kernel: Optional[str] = None  # the kernel the last forward ran

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
        return [f"{self.scheme} weights computed by the {self.kernel} kernel"]

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

    @property
    def takes_quantized_tokens(self) -> bool:
        """W8A8 experts take a quantized dispatch's `QuantizedTokens` as they arrive (int8 ones natively)."""
        return self.scheme == "int8_channel"

    def kernel_for(self, device: torch.device) -> str:
        """The kernel a forward on ``device`` runs (`collectives.quantized_kernels.resolve_kernel`)."""
        return qk.resolve_kernel(self.kernel, self.scheme, device, self.zero_offsets)

    def _stacked(self, proj: str) -> Tuple[torch.Tensor, ...]:
        """Projection ``proj``'s scales for every expert, as `scale_names` orders them."""
        return tuple(getattr(self, f"{proj}_{n}") for n in scale_names(self.scheme))

    def _int8_stack(self) -> Tuple[Tuple[torch.Tensor, ...], Tuple[torch.Tensor, ...]]:
        """``(gate_up, down)`` as ``(weights, scales [E, N] float32, offsets [E, N] or None where all zero)``."""
        (gs, go), (us, uo), (ds, do) = (self._stacked(p) for p in PROJECTIONS)
        e, zero = self.num_local, self.zero_offsets
        gu = (self.gate_up_q, torch.cat([gs, us], dim=1).reshape(e, -1).float(),
              None if zero else torch.cat([go, uo], dim=1).reshape(e, -1))
        return gu, (self.down_q, ds.reshape(e, -1).float(), None if zero else do.reshape(e, -1))

    def _dequantized_stack(self, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every expert's ``(gate_up [E, 2F, H], down [E, H, F])`` dequantized to ``dtype``."""
        f = self.down_q.shape[2]
        gate = dequantize(self.gate_up_q[:, :f], self._stacked("gate"), self.scheme, dtype, self.block)
        up = dequantize(self.gate_up_q[:, f:], self._stacked("up"), self.scheme, dtype, self.block)
        down = dequantize(self.down_q, self._stacked("down"), self.scheme, dtype, self.block)
        return torch.cat([gate, up], dim=1), down

    def _fp8_expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return qk.fp8_expert(rows, (self.gate_up_q[e], self.scales("gate", e)[0], self.scales("up", e)[0]),
                             (self.down_q[e], self.scales("down", e)[0]), self.act, self.block)

    def _check_counts(self, rows: int, counts) -> List[int]:
        host = qk.host_counts(counts)
        if len(host) != self.num_local or (not isinstance(counts, torch.Tensor) and sum(host) != rows):
            raise ValueError(f"QuantizedExperts: counts {host} do not split {rows} rows over "
                             f"{self.num_local} experts")
        return host

    def _run(self, which: str, x: Union[torch.Tensor, QuantizedTokens], counts, host: List[int]) -> torch.Tensor:
        rows = x.values.shape[0] if isinstance(x, QuantizedTokens) else x.shape[0]
        if which == "int_mm":
            return qk.w8a8_loop(x, host, rows, *self._int8_stack(), self.act)
        if which == "npu_w8a8" and self.num_local > 1:  # the grouped matmul refuses a group list of length 1
            gl = counts if isinstance(counts, torch.Tensor) else group_list(host, self.gate_up_q.device)
            gu, d = self._int8_stack()
            return qk.zero_past(qk.npu_w8a8(x, gl, gu[:2], d[:2], self.act, self.dtype), gl)
        if which == "npu_w8a8":
            return qk.w8a8_loop(x, host, rows, *self._int8_stack(), self.act)
        xf = as_float(x, self.dtype)
        if which == "npu_dequant":
            return qk.npu_dequant(xf, counts, *self._dequantized_stack(xf.dtype), self.act)
        if which == "scaled_mm":
            return qk.fp8_loop(xf, host, self._fp8_expert, self.down_q.shape[1])
        return self.reference(xf, host)

    def reference(self, x: torch.Tensor, host: Sequence[int]) -> torch.Tensor:
        """The reference path: each expert's weights dequantized to ``x``'s dtype as its rows come."""
        out = x.new_zeros(x.shape[0], self.down_q.shape[1])
        start = 0
        for e, n in enumerate(host):
            if n:
                gate_up, down = self.weights(e, x.dtype)
                g, u = F.linear(x[start:start + n], gate_up).chunk(2, dim=-1)
                out[start:start + n] = F.linear(self.act(g) * u, down)
            start += n
        return out

    def routed(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' fused experts' call (the model's own forward): each token through its ``top_k_index``
        experts (global ids; those another rank holds add nothing), weighted by ``top_k_weights``."""
        k = top_k_index.shape[-1]
        local = top_k_index.reshape(-1) - self.first_expert
        mine = ((local >= 0) & (local < self.num_local)).nonzero().squeeze(-1)
        order = mine[torch.argsort(local[mine], stable=True)]
        counts = torch.bincount(local[order], minlength=self.num_local).tolist()
        y = self(hidden[order // k], counts).float() * top_k_weights.reshape(-1)[order, None].float()
        return torch.zeros_like(hidden).index_add_(0, order // k, y.to(hidden.dtype))

    def forward(self, x: Union[torch.Tensor, QuantizedTokens], counts, impl=None) -> torch.Tensor:
        """The experts over rows grouped by ``counts`` (host ints, or a device group list whose padding rows
        come out zero), by `kernel_for` the rows' device; ``impl`` is accepted for `LocalExperts`' signature.
        Called as transformers calls its experts (``x, top_k_index, top_k_weights``): `routed`."""
        if isinstance(impl, torch.Tensor):
            return self.routed(x, counts, impl)
        values = x.values if isinstance(x, QuantizedTokens) else x
        host = self._check_counts(values.shape[0], counts)
        which = self.kernel_for(values.device)
        self.last_kernel = which
        return self._run(which, x, counts, host).to(self.dtype)

    def extra_repr(self) -> str:
        e, f2, h = self.gate_up_q.shape
        return f"experts={e}, hidden={h}, ffn={f2 // 2}, scheme={self.scheme}, first_expert={self.first_expert}"
