"""Quantized checkpoints: the formats the loader reads and keeps quantized, and writers of small ones.

- `formats`: which format a checkpoint folder declares (`checkpoint_format`: DeepSeek's block FP8 from
  ``quantization_config``, msModelSlim's W8A8 from ``quant_model_description.json``), which of its tensors are
  quantized and the scales each brings (`QuantFormat`); any other declared quantization is a `CheckpointError`;
- `writer`: a float transformers model saved in either format by the format's own rules (`save_quantized`);
- `in_memory`: a seeded model (the reference decoder, ``--model NAME``) quantized in memory by the same rules and
  kept quantized (`quantize_in_memory`, ``--quantize``);
- `check`: a quantized run's figures against its dequantized model and their bounds per format (``--check``).

The loader (`launch.models.checkpoint`) reads the quantized tensors and their scales as stored; the weights stay
quantized in `collectives.QuantizedExperts` and `collectives.QuantizedLinear` (see docs/checkpoints.md).
"""
from .formats import DESCRIPTION, METHODS, QuantFormat, checkpoint_format
from .writer import quantizes, save_quantized

__all__ = ["DESCRIPTION", "METHODS", "QuantFormat", "checkpoint_format", "quantizes", "save_quantized"]
