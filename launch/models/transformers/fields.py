"""The transformers config fields the toolkit reads where families name one thing differently: one list each.

The launcher's checks (`launch.config`), the memory estimate (`launch.memory`), the families' small
configs (`families`), the adapter (`model`) and the checkpoint loader (`launch.models.checkpoint`)
read these lists and nothing else for these things, so that a family's name for them is known
everywhere at once. Fields every family names alike (``hidden_size``, ``first_k_dense_replace``,
``n_group``, ...) are read by their name where they are read.

transformers is not imported here: the lists are names, the functions read any config object.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

__all__ = ["EXPERT_COUNTS", "EXPERT_PROJECTIONS", "IDENTITY_EXPERTS", "LAYER_COUNTS", "MTP_LAYERS", "SHARED_COUNTS",
           "SHARED_SIZES", "TOP_K", "expert_count", "first_field", "held_field", "shared_count", "stored_field",
           "top_k"]

# the routed experts per MoE layer
EXPERT_COUNTS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
# the experts each token is routed to
TOP_K = ("num_experts_per_tok", "moe_topk", "top_k_experts", "moe_top_k")
# the shared experts beside the routed ones, as a count ...
SHARED_COUNTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
# ... or as the size of one shared MLP (0: none), in families that count none
SHARED_SIZES = ("shared_expert_intermediate_size", "shared_intermediate_size")
# zero-compute experts beside the routed ones (LongCat-Flash)
IDENTITY_EXPERTS = ("zero_expert_num",)
# the decoder layers (LongCat-Flash derives num_hidden_layers from num_layers)
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layers", "n_layer")
# the multi-token-prediction layers, stored in a checkpoint after the model's own layers
MTP_LAYERS = ("num_nextn_predict_layers", "num_mtp_layers")
# an expert's gated MLP, by its linears' names: (gate, up, down)
EXPERT_PROJECTIONS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def first_field(config: Any, names: Sequence[str]) -> Optional[str]:
    """The first of ``names`` that ``config`` has (set or not), or None."""
    return next((n for n in names if hasattr(config, n)), None)


def held_field(config: Any, names: Sequence[str]) -> Optional[str]:
    """The first of ``names`` that ``config`` holds an integer in, or None."""
    return next((n for n in names if isinstance(getattr(config, n, None), int)), None)


def stored_field(config: Any, names: Sequence[str]) -> Optional[str]:
    """The first of ``names`` that ``config`` stores itself (as its config.json names it), else the first it has
    (an alias of a stored one), or None."""
    stored = vars(config)
    return next((n for n in names if n in stored), None) or first_field(config, names)


def expert_count(config: Any) -> int:
    """The routed experts per MoE layer of a transformers config (`EXPERT_COUNTS`); 0 where it names none."""
    field = held_field(config, EXPERT_COUNTS)
    return int(getattr(config, field)) if field else 0


def top_k(config: Any) -> int:
    """The experts each token is routed to, of a transformers config (`TOP_K`); 0 where it names none."""
    field = held_field(config, TOP_K)
    return int(getattr(config, field)) if field else 0


def shared_count(config: Any) -> int:
    """The shared experts of a transformers config: its count (`SHARED_COUNTS`), else one where it sizes a shared
    MLP (`SHARED_SIZES`), else 0."""
    field = first_field(config, SHARED_COUNTS)
    if field is not None:
        return int(getattr(config, field) or 0)
    size = next((getattr(config, f, 0) for f in SHARED_SIZES if hasattr(config, f)), 0) or 0
    return 1 if size else 0
