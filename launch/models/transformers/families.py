"""The transformers MoE families the toolkit runs: their configs made small, and which families the adapter runs.

`small_config` makes a family's config small for the CPU (``FAMILIES`` holds the sizes of the
families users bring most; every other MoE family of the installed transformers gets the common
small sizes), with the toolkit's overrides (``n_layers``, ``hidden``, ``n_experts``, ...) in the
family's own field names (`fields`); `build_transformers_model` builds and adapts a model of it
(`model`). `is_moe_config` and `moe_families` say which model types
are MoEs; `check_family` says, before any process group exists, whether the adapter runs a family
with given overrides, in one line (`refused_families` walks every MoE family).

transformers is imported only inside the functions here.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from microbatch.batch import Batch

from ..common import one_line
from .fields import (EXPERT_COUNTS, IDENTITY_EXPERTS, LAYER_COUNTS, SHARED_COUNTS, SHARED_SIZES, TOP_K, first_field,
                     held_field)
from .model import TransformersModel, attention_for, from_config

__all__ = ["FAMILIES", "build_transformers_model", "check_family", "family_name", "is_moe_config", "moe_families",
           "refused_families", "small_config", "text_model_type"]

_COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
               moe_intermediate_size=32, vocab_size=128, num_experts_per_tok=2, max_position_embeddings=512,
               num_hidden_layers=2)

# Per family: the config fields that make it small on the CPU (every family gets 8 experts, top-2).
FAMILIES: Dict[str, Dict[str, Any]] = {
    "deepseek_v3": dict(_COMMON, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1, n_shared_experts=1,
                        num_hidden_layers=3, first_k_dense_replace=1),
    "glm4_moe": dict(_COMMON, head_dim=16, use_qk_norm=True, n_group=1, topk_group=1, n_shared_experts=1,
                     num_hidden_layers=3, first_k_dense_replace=1),
    "qwen3_moe": dict(_COMMON, head_dim=16),
    "qwen2_moe": dict(_COMMON, shared_expert_intermediate_size=32),
    "mixtral": dict(_COMMON),
    "qwen3_next": dict(_COMMON, head_dim=16, shared_expert_intermediate_size=32, full_attention_interval=2,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=8),
    "gpt_oss": dict(_COMMON, head_dim=16, sliding_window=8),  # layers alternate sliding (8 tokens) and full
    "llama4_text": dict(_COMMON, head_dim=16, attention_chunk_size=8, interleave_moe_layer_step=1),
    # DeepSeek sparse attention: the indexer picks 4 keys per query, so a request of more tokens really selects.
    # Its score sums ReLUs over its heads: with few heads many keys score exactly 0, and the top-k breaks such ties
    # by the scored length (a decode step's padding changes it); 16 heads make ties rare, as 64 do at full size
    "deepseek_v32": dict(_COMMON, index_n_heads=16, index_head_dim=16, index_topk=4),
    "glm_moe_dsa": dict(_COMMON, index_n_heads=16, index_head_dim=16, index_topk=4),
}
# Sizes of a full-size model under other names, made small wherever a family's config has them (after
# _COMMON, before FAMILIES); a field whose default is None (no such part) stays None.
_SMALL_IF_PRESENT = dict(
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    intermediate_size_mlp=96, shared_intermediate_size=32, shared_expert_intermediate_size=32,
    shared_experts_intermediate_size=32, moe_shared_expert_intermediate_size=32, ffn_hidden_size=96,
    expert_ffn_hidden_size=32, vocab_size_per_layer_input=128, hidden_size_per_layer_input=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    n_group=1, topk_group=1, num_expert_group=1)
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
_OVERRIDES = ("n_layers", "n_dense_layers", "hidden", "n_experts", "top_k", "n_shared")
_PROBE_LAYERS = 4  # `check_family` builds at most this many layers


# --- the family's config --------------------------------------------------------------------------

def text_model_type(model_type: str) -> Optional[str]:
    """The model type of the text model a multimodal wrapper keeps in its ``text_config`` (``kimi_k25``:
    ``deepseek_v3``), where the wrapper is no causal LM itself; None for any other model type."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    try:
        text = getattr(AutoConfig.for_model(model_type), "text_config", None)
    except Exception:  # noqa: BLE001 (no such model type, or its default config does not build: no wrapper)
        return None
    return getattr(text, "model_type", None)


def family_name(model_type: str) -> str:
    """``model_type`` as a headline names it: a wrapper with the text model it runs as (`text_model_type`)."""
    text = text_model_type(model_type)
    return f"{model_type} (its text model, {text})" if text else model_type


def _has(config: Any, name: str) -> bool:
    """``hasattr``, where a config's own accessor may raise anything (a per-layer field read globally: it has it)."""
    try:
        return hasattr(config, name)
    except Exception:  # noqa: BLE001
        return True


def _layers_field(base: Any) -> str:
    """The family's field for its decoder layers (LongCat-Flash derives ``num_hidden_layers`` from ``num_layers``)."""
    saved = base.to_dict()
    return next((n for n in LAYER_COUNTS if n in saved), LAYER_COUNTS[0])


def _override_fields(base: Any, overrides: Mapping[str, Any], expert_ffn: int) -> Dict[str, Any]:
    """The toolkit's override names in the family's own field names (``base``: its default config)."""
    unknown = sorted(set(overrides) - set(_OVERRIDES))
    if unknown:
        raise ValueError(f"unknown overrides {unknown}; known: {list(_OVERRIDES)}")
    out: Dict[str, Any] = {}
    simple = {"n_layers": _layers_field(base), "hidden": "hidden_size", "top_k": first_field(base, TOP_K) or TOP_K[0],
              "n_experts": first_field(base, EXPERT_COUNTS)}
    for name, field in simple.items():
        if name in overrides and field is None:
            raise ValueError(f"{base.model_type} has no expert count field ({', '.join(EXPERT_COUNTS)})")
        if name in overrides:
            out[field] = int(overrides[name])
    if "n_dense_layers" in overrides:
        out.update(_dense_fields(base, int(overrides["n_dense_layers"])))
    if "n_shared" in overrides:
        out.update(_shared_fields(base, int(overrides["n_shared"]), expert_ffn))
    return out


def _dense_fields(base: Any, n: int) -> Dict[str, Any]:
    if hasattr(base, "first_k_dense_replace"):
        return {"first_k_dense_replace": n}
    if hasattr(base, "mlp_only_layers"):
        return {"mlp_only_layers": list(range(n))}
    if n:
        raise ValueError(f"{base.model_type} has no dense layers (n_dense_layers must be 0)")
    return {}


def _shared_fields(base: Any, n: int, expert_ffn: int) -> Dict[str, Any]:
    field = first_field(base, SHARED_COUNTS)
    if field is not None:
        return {field: n}
    for field in SHARED_SIZES:
        if hasattr(base, field):
            if n < 1 and field == SHARED_SIZES[0]:  # Qwen2-MoE's: the family always builds its shared expert
                raise ValueError(f"{base.model_type} has one gated shared expert; n_shared sets its size and must "
                                 f"be >= 1")
            return {field: n * expert_ffn}
    if n:
        raise ValueError(f"{base.model_type} has no shared experts (n_shared must be 0)")
    return {}


def _small_fields(base: Any, model_type: str) -> Dict[str, Any]:
    """`_COMMON`, then the sizes of `_SMALL_IF_PRESENT` the family has, then the family's own `FAMILIES` entry."""
    saved = base.to_dict()
    # only the fields the family has: a dense family gets no expert fields (the launcher then says it has no experts)
    small = {k: v for k, v in _COMMON.items() if k != "num_hidden_layers" and (k in saved or _has(base, k))}
    small[_layers_field(base)] = _COMMON["num_hidden_layers"]
    small.update({k: v for k, v in _SMALL_IF_PRESENT.items() if saved.get(k) is not None})
    top_field = first_field(base, TOP_K)
    top_k = saved.get(top_field, getattr(base, top_field, None)) if top_field else None
    if isinstance(top_k, int) and 0 < top_k < small.get(top_field, 0):
        small[top_field] = top_k  # a family built for fewer (ZAYA takes top-1 only)
    small.update(FAMILIES.get(model_type, {}))
    experts = first_field(base, EXPERT_COUNTS)
    if experts is not None:
        small[experts] = 8
    return small


def _fill_unset(base: Any, fields: Dict[str, Any], overrides: Mapping[str, Any]) -> Dict[str, Any]:
    """Fields the family's default config leaves unset (None) but its model needs, from the overrides or a
    sensible default, and the small model's consistency: MLA attention (``kv_lora_rank``) has as many
    key / value heads as heads, identity experts are half the routed ones, token ids fit the vocabulary,
    an unset ``head_dim`` is ``hidden / heads``, sizes the default derives from others (MLA's rotary
    ``head_dim`` and ``qk_head_dim``) follow them, and the default's leading dense layers leave at least
    one MoE layer (unless ``n_dense_layers`` says otherwise)."""
    saved = base.to_dict()
    out = dict(fields)
    get = lambda name: out.get(name, saved.get(name))  # noqa: E731
    shared = first_field(base, SHARED_COUNTS)
    if shared in saved and get(shared) is None:
        out[shared] = int(overrides.get("n_shared", 1))
    if "head_dim" in saved and get("head_dim") is None and get("num_attention_heads"):
        out["head_dim"] = int(get("hidden_size")) // int(get("num_attention_heads"))
    if saved.get("kv_lora_rank") is not None and "num_key_value_heads" in saved:
        out["num_key_value_heads"] = get("num_attention_heads")
    rope, nope = saved.get("qk_rope_head_dim"), saved.get("qk_nope_head_dim")
    if rope is not None and saved.get("head_dim") == rope:  # the rotary part's size, under another name
        out["head_dim"] = get("qk_rope_head_dim")
    if rope is not None and nope is not None and saved.get("qk_head_dim") == rope + nope:
        out["qk_head_dim"] = get("qk_rope_head_dim") + get("qk_nope_head_dim")
    experts = first_field(base, EXPERT_COUNTS)
    layers = get(_layers_field(base))
    if "n_dense_layers" not in overrides and isinstance(layers, int) and layers > 0:
        # the family's leading dense layers (a full-size default), cut to leave a MoE layer in the small model
        dense = get("first_k_dense_replace")
        if isinstance(dense, int) and dense >= layers:
            out["first_k_dense_replace"] = layers - 1
        only = get("mlp_only_layers")
        if isinstance(only, (list, tuple)) and any(isinstance(i, int) and i >= layers - 1 for i in only):
            out["mlp_only_layers"] = [i for i in only if isinstance(i, int) and i < layers - 1]
    for field in IDENTITY_EXPERTS:  # zero-compute experts beside the routed ones: half as many
        if saved.get(field) and experts is not None:
            out[field] = max(1, int(get(experts)) // 2)
    vocab = get("vocab_size")
    for field in _TOKEN_IDS:
        value = get(field)
        if isinstance(value, int) and isinstance(vocab, int) and not 0 <= value < vocab:
            out[field] = None
    return out


def small_config(model_type: str, overrides: Optional[Mapping[str, Any]] = None, **fields: Any) -> Any:
    """The family's config made small for the CPU, then ``overrides`` (toolkit names) and ``fields`` (its own);
    a multimodal wrapper's (`text_model_type`) is its text model's config.

    A field the family's default leaves unset (None) gets a value from the overrides or a sensible
    default (`_fill_unset`), so that its model can be built.
    """
    from transformers import AutoConfig

    overrides = dict(overrides or {})
    model_type = text_model_type(model_type) or model_type  # a wrapper's: its text model's small config
    base = AutoConfig.for_model(model_type)
    small = _small_fields(base, model_type)
    expert_ffn = fields.get("moe_intermediate_size",
                            small.get("moe_intermediate_size", _COMMON["moe_intermediate_size"]))
    chosen = {**small, **_override_fields(base, overrides, expert_ffn), **fields}
    return AutoConfig.for_model(model_type, **_fill_unset(base, chosen, overrides))


def is_moe_config(config: Any) -> bool:
    """Whether a transformers config describes a mixture of experts: it has a routed-expert count field
    (`fields.EXPERT_COUNTS`, or any other name ending in ``experts`` that is not about shared experts, nor per
    token) holding a number, or left unset."""
    for name, value in config.to_dict().items():
        if re.search(r"(^|_)experts$", name) and "shared" not in name and "per_tok" not in name \
                and (value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0)):
            return True
    return False


def moe_families() -> List[str]:
    """Every causal-LM model type of the installed transformers (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) whose
    default config is a MoE (`is_moe_config`), and every multimodal model type
    (``MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES``) whose text config is one (`text_model_type`): those ``--model
    NAME`` may name (`check_family` refuses any other model type in one line, without building it)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES)

    out = []
    candidates = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES)
    for model_type in sorted(candidates & set(CONFIG_MAPPING_NAMES)):
        try:
            moe = is_moe_config(_default_config(model_type))
        except Exception:  # noqa: BLE001 (its default config does not build: no family to bring)
            continue
        if moe:
            out.append(model_type)
    return out


def _default_config(model_type: str) -> Any:
    """The default config of the causal LM ``model_type`` names: a wrapper's text config, else its own."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    return config.text_config if text_model_type(model_type) else config


def build_transformers_model(model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                             device: Any = "cpu", overrides: Optional[Mapping[str, Any]] = None,
                             attn_implementation: str = "sdpa", indexer_stream: bool = True,
                             **fields: Any) -> TransformersModel:
    """A small ``model_type`` causal LM (`small_config`) with weights from ``seed`` (the same on every rank),
    adapted.

    ``overrides`` take the toolkit's names (``n_layers``, ``n_dense_layers``, ``hidden``,
    ``n_experts``, ``top_k``, ``n_shared``); ``fields`` set the family's own config fields.
    ``indexer_stream``: sparse attention's indexer as an operation on its own stream
    (`TransformersModel.indexer_stream`).
    """
    model = from_config(small_config(model_type, overrides, **fields), seed=seed, dtype=dtype, device=device,
                        attn_implementation=attn_implementation)
    model.indexer_stream = indexer_stream
    return model


# --- which families the adapter runs ---------------------------------------------------------------

def _probe_overrides(overrides: Mapping[str, Any]) -> Dict[str, Any]:
    """The overrides of a small model of the same structure: the family's small hidden size, at most
    `_PROBE_LAYERS` layers (the leading dense ones kept where they fit)."""
    out = {k: v for k, v in overrides.items() if k != "hidden" and v is not None}
    if int(out.get("n_layers", 0)) > _PROBE_LAYERS:
        out["n_layers"] = _PROBE_LAYERS
        if "n_dense_layers" in out:
            out["n_dense_layers"] = min(int(out["n_dense_layers"]), _PROBE_LAYERS - 1)
    return out


def _check_routing(config: Any) -> None:
    """Top-k must pick between 1 and the routed experts (else the family's router fails with an unclear error)."""
    experts, chosen = held_field(config, EXPERT_COUNTS), held_field(config, TOP_K)
    n, k = (getattr(config, experts) if experts else None), (getattr(config, chosen) if chosen else None)
    if n is not None and k is not None and not 1 <= k <= n:
        raise ValueError(f"top-k {k} must pick between 1 and the {n} routed experts per token")


@torch.no_grad()
def _runs_small(config: Any) -> TransformersModel:
    """Build ``config``'s model, adapt it (checked against its own forward), make every MoE block expert-parallel
    on one rank (checked by `collectives.wrap_expert_parallel`'s probe) and prefill two requests: the result
    must be the model's own forward. The model, expert-parallel on one rank."""
    from collectives import wrap_expert_parallel

    model = from_config(config, seed=0)
    batch = Batch.random([5, 3], model.cfg.vocab, seed=1)
    want = model.reference(batch)
    model.replace_moe(lambda layer: wrap_expert_parallel(layer.moe, None))
    got = model(batch)
    diff, scale = (got - want).abs().max().item(), want.abs().max().item()
    if not diff <= 1e-3 * max(scale, 1.0):
        raise TypeError(f"its expert-parallel layers do not compute its MoE blocks (difference {diff:.3g} at "
                        f"magnitude {scale:.3g})")
    return model


def check_family(model_type: str, overrides: Optional[Mapping[str, Any]] = None) -> Optional[TransformersModel]:
    """Whether the adapter runs the MoE family ``model_type`` with ``overrides`` (the toolkit's names), decided
    before any process group exists: a ValueError of one line naming what it lacks, else the small model it
    ran (expert-parallel on one rank), or None for a model type that is no MoE (nothing to check). A
    multimodal wrapper (`text_model_type`) runs as its text model.

    The config with the overrides must build a model (checked on the meta device, at no cost); a small model
    of the same structure (`_probe_overrides`) must then run through the adapter and the expert-parallel
    layers on one rank and equal its own forward (`_runs_small`: a second or so on a CPU).
    """
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    text = text_model_type(model_type)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and text is None:
        raise ValueError(f"{model_type} is not a causal LM AutoModelForCausalLM builds (the text part of a "
                         f"multimodal model, an encoder-decoder or an encoder): the adapter runs decoder-only causal "
                         f"LMs")
    if text is not None and text not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{model_type} runs as its text model, {text}, which is not a causal LM "
                         f"AutoModelForCausalLM builds (transformers has no {text} model with an lm_head): the "
                         f"adapter runs decoder-only causal LMs")
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    try:
        config = small_config(model_type, overrides)
    except Exception as exc:  # noqa: BLE001 (transformers' own config errors are not all ValueErrors)
        raise ValueError(f"the family's config does not take these sizes ({one_line(exc, typed=True)})") from None
    if not is_moe_config(config):
        return None  # not a MoE: the launcher says so in its own words
    _check_routing(config)
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config, attn_implementation=attention_for(config, "sdpa"))
    except Exception as exc:  # noqa: BLE001 (any failure of the family's own code is a one-line refusal)
        raise ValueError(f"the family's model cannot be built from this config ({one_line(exc, typed=True)})") from None
    try:
        return _runs_small(small_config(model_type, _probe_overrides(overrides)))
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"the adapter cannot run {model_type}: {one_line(exc, typed=True)}") from None


def refused_families(families: Optional[Sequence[str]] = None) -> Dict[str, Optional[str]]:
    """Per MoE family (default: `moe_families`), None where the adapter runs it, else the one-line reason."""
    out: Dict[str, Optional[str]] = {}
    for model_type in moe_families() if families is None else families:
        try:
            check_family(model_type)
            out[model_type] = None
        except ValueError as exc:
            out[model_type] = str(exc)
    return out
