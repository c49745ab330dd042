"""Tokens quantized per token for the dispatch exchange, as DeepEP and torch_npu's MC2 (``quant_mode=2``) send them.

A dispatch dtype (`DISPATCH_DTYPES`: ``bf16``, ``int8``, ``fp8``) says how tokens travel to their experts:
``bf16`` is the unquantized exchange (tokens travel in the model's own dtype, whatever it is); ``int8`` and
``fp8`` (``float8_e4m3fn``) quantize each token symmetrically by its largest magnitude (scale ``absmax / 127``,
``absmax / 448``; a zero token gets scale 1) into `QuantizedTokens`: the values ``[n, H]`` and one float32 scale
per token ``[n]``. On the wire the scale's 4 bytes ride as extra columns of the values' bytes (`pack`: one
``[n, H + 4]`` uint8 tensor), so the values and their scales take one exchange; the receiver reads them back
(`unpack`) and the experts take the `QuantizedTokens` (the float experts dequantize each row before their
matmul, `dequantize`). The combine stays in the model's dtype.

A token holding NaN or inf is refused (`NonFiniteTokens` naming the token; the exchanges raise it as
`collectives.LayoutError`, on every rank) where the host may read the
device; where it may not (a captured or compiled step) its scale is NaN, so its dequantized row is NaN and the
step's non-finite check sees it: a wrong answer never passes silently.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

import overlap

# the names a user passes (``--dispatch-dtype``) and the dtype each sends (None: the model's own, unquantized)
DISPATCH_DTYPES = {"bf16": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
_LARGEST = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # the largest magnitude each dtype holds
_SCALE_BYTES = 4  # one float32 scale per token


class NonFiniteTokens(ValueError):
    """Tokens holding NaN or inf cannot be quantized (the exchanges raise it as `collectives.LayoutError`)."""


class QuantizedTokens(NamedTuple):
    """Tokens quantized per token: ``values [n, H]`` (int8 or float8_e4m3fn) and ``scales [n]`` float32, so that
    token ``i`` is ``values[i] * scales[i]``."""

    values: torch.Tensor
    scales: torch.Tensor


DispatchDtype = Union[None, str, torch.dtype]


def dispatch_dtype_of(value: DispatchDtype) -> Optional[torch.dtype]:
    """The quantized dtype ``value`` names (None: unquantized): a name of `DISPATCH_DTYPES`, one of their dtypes,
    or None. Anything else is a ValueError naming the value and what is accepted."""
    if value is None or value in _LARGEST:
        return value  # type: ignore[return-value]
    if isinstance(value, str) and value in DISPATCH_DTYPES:
        return DISPATCH_DTYPES[value]
    raise ValueError(f"dispatch_dtype must be one of {', '.join(DISPATCH_DTYPES)} (or None: the model's dtype), "
                     f"got {value!r}")


def dispatch_dtype_name(dtype: Optional[torch.dtype], model_dtype: torch.dtype) -> str:
    """How results name a dispatch: ``int8`` / ``fp8``, or the model's own dtype (``bfloat16``) unquantized."""
    for name, d in DISPATCH_DTYPES.items():
        if d is not None and d == dtype:
            return name
    return str(model_dtype).replace("torch.", "")


def wire_bytes_per_token(hidden: int, dtype: Optional[torch.dtype], model_dtype: torch.dtype) -> int:
    """The bytes one token takes in the dispatch: ``H`` values plus a 4-byte scale quantized, ``H`` elements of the
    model's dtype otherwise."""
    if dtype is None:
        return hidden * torch.empty((), dtype=model_dtype).element_size()
    return hidden * torch.empty((), dtype=dtype).element_size() + _SCALE_BYTES


def _check_finite(absmax: torch.Tensor) -> None:
    """Refuse tokens holding NaN or inf, where the host may read the device."""
    if torch.compiler.is_compiling() or not overlap.host_reads_allowed() or absmax.numel() == 0:
        return
    bad = ~torch.isfinite(absmax)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise NonFiniteTokens(f"token {first} of the dispatch holds NaN or inf: it cannot be quantized per token "
                          f"(dispatch_dtype int8 / fp8); {int(bad.sum())} such token(s) in {absmax.numel()}")


def quantize_per_token(x: torch.Tensor, dtype: torch.dtype) -> QuantizedTokens:
    """``x [n, H]`` quantized symmetrically per token into ``dtype`` (int8 or float8_e4m3fn); see the module."""
    largest = _LARGEST.get(dtype)
    if largest is None:
        raise ValueError(f"quantize_per_token takes int8 or float8_e4m3fn, got {dtype}")
    xf = x.detach().float()
    absmax = xf.abs().amax(dim=-1) if xf.shape[-1] else xf.new_zeros(xf.shape[:-1])
    _check_finite(absmax)
    scales = torch.where(absmax == 0, torch.ones_like(absmax), absmax / largest)
    scaled = (xf / scales.unsqueeze(-1)).clamp(-largest, largest)
    values = scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return QuantizedTokens(values, scales)


def dequantize(q: QuantizedTokens, dtype: torch.dtype) -> torch.Tensor:
    """The tokens ``q`` holds, ``values * scales`` per row, in ``dtype``."""
    return (q.values.float() * q.scales.float().unsqueeze(-1)).to(dtype)


def pack(q: QuantizedTokens) -> torch.Tensor:
    """``[n, H + 4]`` uint8: each token's value bytes, then its scale's 4 bytes (one tensor, one exchange)."""
    scales = q.scales.float().contiguous().unsqueeze(-1).view(torch.uint8)
    return torch.cat([q.values.view(torch.uint8), scales], dim=-1)


def unpack(packed: torch.Tensor, dtype: torch.dtype) -> QuantizedTokens:
    """`pack`'s inverse: the `QuantizedTokens` of ``packed [n, H + 4]`` uint8, values of ``dtype``."""
    hidden = packed.shape[-1] - _SCALE_BYTES
    scales = packed[:, hidden:].contiguous().view(torch.float32).squeeze(-1)
    return QuantizedTokens(packed[:, :hidden].view(dtype), scales)


def wire_tokens(x: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """What the dispatch sends for tokens ``x``: ``x`` itself unquantized, else `pack` of its `quantize_per_token`."""
    return x.detach() if dtype is None else pack(quantize_per_token(x, dtype))


def received_hidden(recv_x: torch.Tensor, dtype: Optional[torch.dtype]) -> int:
    """The tokens' hidden size of received rows (without the scale's columns where quantized)."""
    return recv_x.shape[-1] - (_SCALE_BYTES if dtype is not None else 0)


def received_tokens(recv_x: torch.Tensor, dtype: Optional[torch.dtype]
                    ) -> Union[torch.Tensor, QuantizedTokens]:
    """Received rows as the experts take them: the rows themselves, or their `QuantizedTokens`."""
    return recv_x if dtype is None else unpack(recv_x, dtype)


def tokens_for(experts: object, tokens: Union[torch.Tensor, QuantizedTokens], dtype: torch.dtype
               ) -> Union[torch.Tensor, QuantizedTokens]:
    """Received ``tokens`` as ``experts`` take them: `QuantizedTokens` as they are where the experts say they take
    them (``takes_quantized_tokens``: `collectives.LocalExperts`, which dequantizes each row before its matmul),
    else dequantized into ``dtype`` first (any other experts object, which takes float rows)."""
    if isinstance(tokens, QuantizedTokens) and not getattr(experts, "takes_quantized_tokens", False):
        return dequantize(tokens, dtype)
    return tokens


def as_float(tokens: Union[torch.Tensor, QuantizedTokens], dtype: torch.dtype) -> torch.Tensor:
    """Rows the float experts compute on: ``tokens`` themselves, or their `dequantize` into ``dtype``."""
    return dequantize(tokens, dtype) if isinstance(tokens, QuantizedTokens) else tokens


__all__ = ["DISPATCH_DTYPES", "NonFiniteTokens", "QuantizedTokens", "as_float", "dequantize", "dispatch_dtype_name",
           "dispatch_dtype_of", "pack", "quantize_per_token", "received_hidden", "received_tokens", "tokens_for",
           "unpack",
           "wire_bytes_per_token", "wire_tokens"]
