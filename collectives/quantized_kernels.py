"""How `collectives.QuantizedExperts` computes on each path: the kernels (`KERNELS`) and which one runs where.

- ``"int_mm"`` (W8A8, ``int8_channel``; CUDA, and CPU when named: on CPU ``"auto"`` is the reference, the path
  every quantized run is checked on): the tokens quantized per token to int8 (the dispatch's
  `QuantizedTokens` taken as they arrive, float tokens quantized first: W8A8_DYNAMIC's meaning), then
  ``torch._int_mm`` (int8 x int8 -> int32, exact) times the token scale and the channel scale, minus the
  weight offset's share; the gated activations are quantized per token again before ``down``. Where
  ``torch._int_mm`` does not take the shapes (CUDA: rows <= 16, or K, N not multiples of 8) the same integer
  product is taken in float32 (exact while ``K * 127 * 127 < 2**24``).
- ``"npu_w8a8"`` (W8A8 on the NPU paths): ``torch_npu.npu_grouped_matmul`` over all local experts at once, its
  ``scale`` the per-channel weight scales ``[E, N]``, ``per_token_scale`` the tokens' scales, ``group_list``
  the rows per expert; float activations quantized by ``torch_npu.npu_dynamic_quant``. The kernel takes no
  weight offset (``offset``: "only None" in the torch_npu docs), so experts with a non-zero offset take
  ``"npu_dequant"``.
- ``"npu_dequant"`` (FP8 on the NPU paths): the NPUs this toolkit runs on (Atlas A2 / A3) have no float8
  matmul and the ``antiquant_*`` form takes int8 / int4 weights only, so the stack is dequantized to the
  model's dtype as it runs and computed by `collectives.experts.grouped_mlp`'s ``npu_grouped``.
- ``"scaled_mm"`` (FP8 on CUDA with compute capability >= 8.9): per expert and per 128-column slice of K,
  ``torch._scaled_mm`` with rowwise scales (the activations quantized per token and 128 columns, DeepSeek's
  dynamic scheme; the weights' 128 x 128 block scales spread over their output channels), the slices summed
  in float32. Also runs on CPU (``torch._scaled_mm`` takes rowwise scales there), which is how it is tested.
- ``"reference"``: each expert's weights dequantized as its rows come (`QuantizedExperts.reference`).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from .experts import Counts, grouped_mlp, torch_npu_with
from .quantize import QuantizedTokens, as_float
from .weight_quant import FP8_MAX, INT8_MAX

KERNELS = ("auto", "int_mm", "npu_w8a8", "npu_dequant", "scaled_mm", "reference")
FP8_MIN_CAPABILITY = (8, 9)  # CUDA devices with float8 tensor cores (Ada, Hopper and later)
_EXACT_FLOAT_K = 1040  # K below which a float32 sum of int8 x int8 products is exact (K * 127**2 < 2**24)

Act = Callable[[torch.Tensor], torch.Tensor]
Tokens = Union[torch.Tensor, QuantizedTokens]

__all__ = ["FP8_MIN_CAPABILITY", "KERNELS", "fp8_expert", "fp8_loop", "host_counts", "int8_per_token", "npu_dequant",
           "npu_w8a8", "resolve_kernel", "scaled_mm_fp8", "w8a8_loop", "zero_past"]


def _cuda_has_fp8(device: torch.device) -> bool:
    return device.type == "cuda" and hasattr(torch, "_scaled_mm") \
        and tuple(torch.cuda.get_device_capability(device)) >= FP8_MIN_CAPABILITY


def resolve_kernel(kernel: str, scheme: str, device: torch.device, zero_offsets: bool = True) -> str:
    """The kernel ``kernel`` (one of `KERNELS`) stands for, for ``scheme`` weights computed on ``device``:
    ``"auto"`` picks by path (see the module), a named one is taken as it is."""
    if kernel not in KERNELS:
        raise ValueError(f"quantized expert kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel != "auto":
        return kernel
    if torch_npu_with("npu_grouped_matmul") is not None:
        if scheme == "int8_channel" and zero_offsets and torch_npu_with("npu_dynamic_quant") is not None:
            return "npu_w8a8"
        return "npu_dequant"
    if scheme == "int8_channel":  # on CPU the reference: exactly the dequantized model's, what --check bounds tightly
        return "int_mm" if torch.device(device).type == "cuda" else "reference"
    return "scaled_mm" if _cuda_has_fp8(device) else "reference"


def int8_per_token(x: torch.Tensor) -> QuantizedTokens:
    """``x [n, K]`` quantized symmetrically per row to int8 (scale ``absmax / 127``, 1 for a zero row); a row
    holding NaN gets a NaN scale, so its results are NaN (the step's non-finite check sees it)."""
    xf = x.float()
    absmax = xf.abs().amax(dim=-1) if xf.shape[-1] else xf.new_zeros(xf.shape[:-1])
    scales = torch.where(absmax == 0, torch.ones_like(absmax), absmax / INT8_MAX)
    values = (xf / scales.unsqueeze(-1)).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return QuantizedTokens(values, scales)


def _int8_tokens(tokens: Tokens) -> QuantizedTokens:
    """Tokens as int8 per-token `QuantizedTokens`: an int8 dispatch's as they are, others (float, fp8) quantized."""
    if isinstance(tokens, QuantizedTokens) and tokens.values.dtype == torch.int8:
        return tokens
    return int8_per_token(as_float(tokens, torch.float32))


def _int_mm_takes(a: torch.Tensor, w: torch.Tensor) -> bool:
    if a.device.type == "cpu":
        return True
    return a.device.type == "cuda" and a.shape[0] > 16 and a.shape[1] % 8 == 0 and w.shape[0] % 8 == 0


def _int8_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a [n, K] @ w [N, K].T`` of int8 values, as float32 (exact: `torch._int_mm`, or float32 for small K)."""
    if _int_mm_takes(a, w):
        return torch._int_mm(a, w.t()).float()
    return a.float() @ w.float().t()


def _w8a8_linear(q: QuantizedTokens, w: torch.Tensor, scale: torch.Tensor, offset: Optional[torch.Tensor]
                 ) -> torch.Tensor:
    """``(q.values * q.scales) @ ((w - offset) * scale).T`` in float32, the product taken in integers (``offset``
    None: zero)."""
    acc = _int8_matmul(q.values, w)
    if offset is not None:
        acc = acc - offset.float().reshape(1, -1) * q.values.sum(dim=-1, dtype=torch.int32).float().unsqueeze(-1)
    return acc * q.scales.float().unsqueeze(-1) * scale.float().reshape(1, -1)


def w8a8_loop(tokens: Tokens, counts: Sequence[int], rows: int, gate_up: Tuple[torch.Tensor, ...],
              down: Tuple[torch.Tensor, ...], act: Act) -> torch.Tensor:
    """The W8A8 experts over ``rows`` rows grouped by host ``counts`` (rows past their sum stay zero), float32.
    ``gate_up`` / ``down``: ``(weights [E, N, K] int8, scales [E, N], offsets [E, N] or None: zero)``."""
    q = _int8_tokens(tokens)
    w_gu, s_gu, o_gu = gate_up
    w_d, s_d, o_d = down
    out = torch.zeros(rows, w_d.shape[1], device=q.values.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            part = QuantizedTokens(q.values[start:start + n], q.scales[start:start + n])
            g, u = _w8a8_linear(part, w_gu[e], s_gu[e], None if o_gu is None else o_gu[e]).chunk(2, dim=-1)
            out[start:start + n] = _w8a8_linear(int8_per_token(act(g) * u), w_d[e], s_d[e],
                                                None if o_d is None else o_d[e])
        start += n
    return out


def _npu_dtype(dtype: torch.dtype) -> torch.dtype:
    """The output dtype the per-token quantized grouped matmul gives: bf16 / fp16 (bf16 for other dtypes)."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def npu_w8a8(tokens: Tokens, group_list: torch.Tensor, gate_up: Tuple[torch.Tensor, torch.Tensor],
             down: Tuple[torch.Tensor, torch.Tensor], act: Act, dtype: torch.dtype) -> torch.Tensor:
    """The W8A8 experts by ``torch_npu.npu_grouped_matmul`` (see the module): ``gate_up`` / ``down`` are
    ``(weights [E, N, K] int8, scales [E, N] float32)``; ``group_list`` int64 rows per expert. Rows past the
    group list are not computed (the caller zeroes them); the result is in ``dtype``'s NPU form (`_npu_dtype`)."""
    import torch_npu

    out_dtype = _npu_dtype(dtype)
    if isinstance(tokens, QuantizedTokens) and tokens.values.dtype == torch.int8:
        xq, xs = tokens.values, tokens.scales.float()
    else:
        xq, xs = torch_npu.npu_dynamic_quant(as_float(tokens, out_dtype))
    h = torch_npu.npu_grouped_matmul([xq], [gate_up[0].transpose(1, 2)], scale=[gate_up[1]], per_token_scale=[xs],
                                     group_list=group_list, split_item=2, group_type=0, group_list_type=1,
                                     output_dtype=out_dtype)[0]
    g, u = h.chunk(2, dim=-1)
    aq, as_ = torch_npu.npu_dynamic_quant(act(g) * u)
    return torch_npu.npu_grouped_matmul([aq], [down[0].transpose(1, 2)], scale=[down[1]], per_token_scale=[as_],
                                        group_list=group_list, split_item=2, group_type=0, group_list_type=1,
                                        output_dtype=out_dtype)[0]


def npu_dequant(x: torch.Tensor, counts: Counts, gate_up: torch.Tensor, down: torch.Tensor, act: Act
                ) -> torch.Tensor:
    """Experts whose weights the NPU cannot multiply as stored: ``gate_up`` / ``down`` dequantized (to ``x``'s
    dtype) by the caller, computed by `collectives.experts.grouped_mlp`'s NPU grouped matmul."""
    return grouped_mlp(x, counts, gate_up, down, act, impl="npu_grouped")


def _fp8_per_group(x: torch.Tensor, cols: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [n, K]`` as float8_e4m3fn per row and ``cols`` columns: ``(values [n, K], scales [n, ceil(K/cols)])``."""
    n, k = x.shape
    groups = -(-k // cols)
    padded = torch.nn.functional.pad(x.float(), (0, groups * cols - k)).reshape(n, groups, cols)
    absmax = padded.abs().amax(dim=-1)
    scales = torch.where(absmax == 0, torch.ones_like(absmax), absmax / FP8_MAX)
    values = (padded / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.reshape(n, groups * cols)[:, :k], scales


def _channel_scales(scale_inv: torch.Tensor, out: int, rows: int) -> torch.Tensor:
    """Block scales ``[ceil(out/rows), kb]`` spread over the output channels: ``[out, kb]``."""
    return scale_inv.float().repeat_interleave(rows, dim=0)[:out]


def scaled_mm_fp8(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: Tuple[int, int]
                  ) -> torch.Tensor:
    """``x [n, K] @ dequantize(w [N, K]).T`` with the activations quantized to fp8 per row and ``block[1]``
    columns, by ``torch._scaled_mm`` per ``block[1]``-column slice with rowwise scales; float32."""
    cols = block[1]
    xq, xs = _fp8_per_group(x, cols)
    ws = _channel_scales(scale_inv, w.shape[0], block[0])
    out_dtype = torch.bfloat16 if x.device.type == "cuda" else torch.float32  # CUDA's rowwise form gives bf16
    y = torch.zeros(x.shape[0], w.shape[0], device=x.device)
    for kb in range(xs.shape[1]):
        a = xq[:, kb * cols:(kb + 1) * cols].contiguous()
        b = w[:, kb * cols:(kb + 1) * cols].contiguous().t()
        y += torch._scaled_mm(a, b, xs[:, kb:kb + 1].contiguous(), ws[:, kb].reshape(1, -1).contiguous(),
                              out_dtype=out_dtype).float()
    return y


def fp8_expert(x: torch.Tensor, gate_up: Tuple[torch.Tensor, torch.Tensor, torch.Tensor],
               down: Tuple[torch.Tensor, torch.Tensor], act: Act, block: Tuple[int, int]) -> torch.Tensor:
    """One FP8 expert by `scaled_mm_fp8`: ``gate_up`` ``(weights [2F, H], gate scales, up scales)``, ``down``
    ``(weights [H, F], scales)``; float32."""
    w, s_gate, s_up = gate_up
    f = w.shape[0] // 2
    g = scaled_mm_fp8(x, w[:f], s_gate, block)
    u = scaled_mm_fp8(x, w[f:], s_up, block)
    return scaled_mm_fp8(act(g) * u, down[0], down[1], block)


def host_counts(counts: Counts) -> List[int]:
    """``counts`` as host ints (a device group list is read on the host)."""
    return [int(c) for c in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]


def zero_past(y: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
    """Rows of ``y`` past the group list's sum set to zero (never computed)."""
    rows = torch.arange(y.shape[0], device=y.device)
    return torch.where((rows < group_list.sum())[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))


def fp8_loop(x: torch.Tensor, counts: Sequence[int], expert: Callable[[int, torch.Tensor], torch.Tensor],
             hidden: int) -> torch.Tensor:
    """``expert(e, rows)`` over rows grouped by host ``counts``; rows past their sum stay zero; float32."""
    out = torch.zeros(x.shape[0], hidden, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start:start + n] = expert(e, x[start:start + n])
        start += n
    return out

