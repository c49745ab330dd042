"""The models the launcher runs: the reference decoder, transformers MoE models, checkpoints.

- `reference`: the toolkit's small DeepSeek-style decoder (`Model`, `build_model`), serial prefill
  of which is the reference for every mode; `presets`: its shapes (`ModelConfig`, `preset`);
- `transformers_adapter`: a transformers MoE causal LM seen as the same model (`adapt`,
  `from_config`, `TransformersModel`); `families`: the families it runs, their configs made small
  (`small_config`, `build_transformers_model`) and the check that refuses the others (`check_family`);
- `checkpoint`: a local safetensors checkpoint loaded with each rank reading only its experts.

Each model offers the runner its embedding, its layers as operations and its final norm
(`microbatch.model.ForwardModel`, and `launch.runner`). transformers and safetensors are imported
only inside the functions that need them.
"""
from .presets import PRESETS, ModelConfig, preset
from .reference import DecoderLayer, Model, RMSNorm, build_model, forward_layer_by_layer, init_weights, param_seed
from .transformers_adapter import (ShortcutLayer, TransformersConfig, TransformersLayer, TransformersModel, adapt,
                                   causal_mask, from_config, seed_weights)
from .families import (FAMILIES, build_transformers_model, check_family, is_moe_config, moe_families,
                       refused_families, small_config)
from .checkpoint import CheckpointError, LoadReport, check_checkpoint, check_moe_config, load_checkpoint

__all__ = [
    "PRESETS", "ModelConfig", "preset",
    "DecoderLayer", "Model", "RMSNorm", "build_model", "forward_layer_by_layer", "init_weights", "param_seed",
    "ShortcutLayer", "TransformersConfig", "TransformersLayer", "TransformersModel", "adapt", "causal_mask",
    "from_config", "seed_weights",
    "FAMILIES", "build_transformers_model", "check_family", "is_moe_config", "moe_families", "refused_families",
    "small_config",
    "CheckpointError", "LoadReport", "check_checkpoint", "check_moe_config", "load_checkpoint",
]
