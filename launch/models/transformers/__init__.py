"""A Hugging Face transformers MoE causal LM as the toolkit's model, by job:

- `fields`: the config fields the toolkit reads where families name one thing differently (the
  expert and shared-expert counts, top-k, the experts' projections, the MTP layers, ...), one list each;
- `discovery`: a decoder layer's parts found by their names (norms by role, the token mixer, the
  feed-forward block, a shared MLP beside it, LongCat-Flash's shortcut layer);
- `attention`: the family's attention module called as the adapter calls it (its masks, its cache);
- `layers`: a layer as `microbatch.Operation`s, prefill and decode (`TransformersLayer`, `ShortcutLayer`);
- `model`: the model (`TransformersModel`, `TransformersConfig`; `adapt`, `from_config`, `seed_weights`);
- `checks`: the adapter against the family's own forward and generate;
- `families`: the families the adapter runs, their configs made small (`small_config`,
  `build_transformers_model`; a multimodal wrapper's text model: `text_model_type`, `family_name`), and the
  check that refuses the others in one line (`check_family`).

transformers is imported only inside the functions that need it.
"""
from .attention import Attention, causal_mask, decode_mask
from .discovery import LayerParts, ShortcutParts
from .layers import ShortcutLayer, TransformersLayer
from .model import TransformersConfig, TransformersModel, adapt, attention_for, from_config, seed_weights
from .families import (FAMILIES, build_transformers_model, check_family, family_name, is_moe_config, moe_families,
                       refused_families, small_config, text_model_type)

__all__ = [
    "Attention", "causal_mask", "decode_mask",
    "LayerParts", "ShortcutParts",
    "ShortcutLayer", "TransformersLayer",
    "TransformersConfig", "TransformersModel", "adapt", "attention_for", "from_config", "seed_weights",
    "FAMILIES", "build_transformers_model", "check_family", "family_name", "is_moe_config", "moe_families",
    "refused_families", "small_config", "text_model_type",
]
