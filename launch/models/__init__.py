"""The models the launcher runs: the reference decoder, transformers MoE models, checkpoints.

- `reference`: the toolkit's small DeepSeek-style decoder (`Model`, `build_model`), serial prefill
  of which is the reference for every mode; `presets`: its shapes (`ModelConfig`, `preset`);
- `common`: what the models share (`param_seed`, the seed of each weight; `check_token_ids`; `one_line`);
- `transformers`: a transformers MoE causal LM seen as the same model (`adapt`, `from_config`,
  `TransformersModel`), the families it runs, their configs made small (`small_config`,
  `build_transformers_model`) and the check that refuses the others (`check_family`); its modules, one
  job each, are listed in its docstring (the config fields read, `transformers.fields`, among them);
- `checkpoint`: a local safetensors checkpoint loaded with each rank reading only its experts.

Both models implement the model contract `microbatch.model.MoEModel` (embedding, layers as
operations, final norm, LM head, whether a request can be cut, shapes): what the runner, the
launcher and planning use of a model. transformers and safetensors are imported only inside the
functions that need them.
"""
from .presets import PRESETS, ModelConfig, preset
from .common import check_token_ids, param_seed
from .reference import DecoderLayer, Model, RMSNorm, build_model, init_weights
from .transformers import (FAMILIES, ShortcutLayer, TransformersConfig, TransformersLayer, TransformersModel, adapt,
                           build_transformers_model, causal_mask, check_family, family_name, from_config,
                           is_moe_config, moe_families, refused_families, seed_weights, small_config,
                           text_model_type)
from .checkpoint import (CheckpointError, GenerationSettings, LoadReport, check_checkpoint, check_moe_config,
                         generation_settings, load_checkpoint)

__all__ = [
    "PRESETS", "ModelConfig", "preset",
    "check_token_ids", "param_seed",
    "DecoderLayer", "Model", "RMSNorm", "build_model", "init_weights",
    "ShortcutLayer", "TransformersConfig", "TransformersLayer", "TransformersModel", "adapt", "causal_mask",
    "from_config", "seed_weights",
    "FAMILIES", "build_transformers_model", "check_family", "family_name", "is_moe_config", "moe_families",
    "refused_families", "small_config", "text_model_type",
    "CheckpointError", "GenerationSettings", "LoadReport", "check_checkpoint", "check_moe_config",
    "generation_settings", "load_checkpoint",
]
