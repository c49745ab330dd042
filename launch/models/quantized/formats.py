"""Which quantized format a checkpoint folder declares, and what that means for each of its tensors.

- DeepSeek's FP8 (every DeepSeek-V3 / V3.2 / R1 release): ``config.json`` holds ``quantization_config``
  ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}``;
  a quantized weight is ``float8_e4m3fn`` with a float32 ``<name>_scale_inv`` beside it
  (``...weight_scale_inv``), one per block; what has no scale (embedding, norms, router, LM head) is stored
  as it runs.
- msModelSlim's W8A8 (Ascend deployments): no ``quantization_config``; ``quant_model_description.json``
  names each tensor's type: ``W8A8_DYNAMIC`` (int8 weight, ``weight_scale`` / ``weight_offset`` per output
  channel; activations quantized per token as it runs), ``W8A8`` (the same, plus the static activation
  parameters ``input_scale``, ``input_offset``, ``quant_bias``, ``deq_scale``) or ``FLOAT``.

Anything else that declares quantization is refused in one line naming the method and what is supported.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Optional, Tuple

import torch

from collectives.weight_quant import scale_names

from ..errors import CheckpointError, json_object

DESCRIPTION = "quant_model_description.json"  # msModelSlim's per-tensor types
METHODS = ("fp8", "w8a8")
QUANTIZED_TYPES = ("W8A8_DYNAMIC", "W8A8")
W8A8_TYPES = QUANTIZED_TYPES + ("FLOAT",)
STATIC_EXTRAS = ("input_scale", "input_offset", "quant_bias", "deq_scale")  # static W8A8's activation parameters
_SUPPORTED = (f"supported: quant_method fp8 (DeepSeek's, fmt e4m3, weight_block_size) and msModelSlim's W8A8 "
              f"({DESCRIPTION} with types {', '.join(W8A8_TYPES)})")

__all__ = ["DESCRIPTION", "METHODS", "QUANTIZED_TYPES", "QuantFormat", "STATIC_EXTRAS", "checkpoint_format"]


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """A checkpoint's quantized format: ``method`` (one of `METHODS`), the weights' ``scheme``
    (`collectives.weight_quant.SCHEMES`), FP8's ``block``, W8A8's per-tensor ``types``."""

    method: str
    block: Tuple[int, int] = (128, 128)
    types: Dict[str, str] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def scheme(self) -> str:
        return "fp8_block" if self.method == "fp8" else "int8_channel"

    @property
    def variant(self) -> str:
        """The format as `launch.models.quantized.check` bounds it: ``fp8``, ``w8a8_dynamic`` or, where a tensor is
        typed ``W8A8`` (static activation parameters), ``w8a8_static``."""
        if self.method == "fp8":
            return "fp8"
        return "w8a8_static" if "W8A8" in self.types.values() else "w8a8_dynamic"

    @property
    def dtype(self) -> torch.dtype:
        """The dtype its quantized weights are stored in."""
        return torch.float8_e4m3fn if self.method == "fp8" else torch.int8

    def quantized(self, key: str, catalog: Any) -> bool:
        """Whether the checkpoint's tensor ``key`` is a quantized weight (``catalog``: the keys it holds)."""
        if not key.endswith(".weight"):
            return False
        if self.method == "fp8":
            return f"{key}_scale_inv" in catalog
        return self.types.get(key) in QUANTIZED_TYPES

    def scales(self, key: str) -> Tuple[str, ...]:
        """The keys of quantized weight ``key``'s scales, in `collectives.weight_quant.scale_names` order."""
        base = key[: -len("weight")]
        return tuple(base + n for n in scale_names(self.scheme))

    def extras(self, key: str) -> Tuple[str, ...]:
        """The keys of the static activation parameters of ``key`` (static W8A8 only), held as they are."""
        base = key[: -len("weight")]
        return tuple(base + n for n in STATIC_EXTRAS) if self.types.get(key) == "W8A8" else ()


def _field(qc: Any, name: str) -> Any:
    return qc.get(name) if isinstance(qc, dict) else getattr(qc, name, None)


def _fp8(qc: Any, where: str) -> QuantFormat:
    """DeepSeek's FP8 ``quantization_config``, checked."""
    fmt, scheme, block = _field(qc, "fmt"), _field(qc, "activation_scheme"), _field(qc, "weight_block_size")
    if fmt not in (None, "e4m3"):
        raise CheckpointError(f"{where}: quantization_config fmt is {fmt!r}: only e4m3 (float8_e4m3fn) FP8 weights "
                              f"are read")
    if scheme not in (None, "dynamic"):
        raise CheckpointError(f"{where}: quantization_config activation_scheme is {scheme!r}: only dynamic FP8 is "
                              f"read (static activation scales are not)")
    if not isinstance(block, (list, tuple)) or len(block) != 2 or \
            any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block):
        raise CheckpointError(f"{where}: quantization_config weight_block_size is {block!r}, must be two block sizes "
                              f"[rows, columns] (DeepSeek's [128, 128]; per-tensor FP8 is not read)")
    return QuantFormat("fp8", (int(block[0]), int(block[1])))


def _w8a8(file: str) -> QuantFormat:
    """msModelSlim's description, checked: a map of tensor names to its types."""
    types = json_object(file)
    tensors = {k: v for k, v in types.items() if "." in k}  # model_quant_type, version...: not tensor names
    other = sorted({str(v) for v in tensors.values()} - set(W8A8_TYPES))
    if other:
        first = next(k for k, v in tensors.items() if str(v) == other[0])
        raise CheckpointError(f"{file}: quantization type {other[0]} (e.g. {first}) is not supported; {_SUPPORTED}")
    if not any(v in QUANTIZED_TYPES for v in tensors.values()):
        raise CheckpointError(f"{file}: names no quantized tensor ({', '.join(QUANTIZED_TYPES)})")
    return QuantFormat("w8a8", types={k: str(v) for k, v in tensors.items()})


def checkpoint_format(path: str, config: Any) -> Optional[QuantFormat]:
    """The quantized format of the checkpoint in ``path`` (``config``: its transformers config), or None for a
    float checkpoint. `CheckpointError` in one line for a quantization it does not read, naming the method."""
    where = os.path.join(path, "config.json")
    qc = getattr(config, "quantization_config", None)
    description = os.path.join(path, DESCRIPTION)
    if qc:
        method = _field(qc, "quant_method")
        if method == "fp8":
            return _fp8(qc, where)
        named = method or "quantization_config without a quant_method"
        raise CheckpointError(f"{where}: a quantized checkpoint ({named}) is not supported; {_SUPPORTED}")
    if os.path.isfile(description):
        return _w8a8(description)
    return None
