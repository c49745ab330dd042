"""Finding a transformers decoder layer's parts by their names, not their classes: its norms by role, its token
mixer, its feed-forward block, a shared MLP beside it, and LongCat-Flash's shortcut layer.

``attn``   ``self_attn`` on full, sliding-window or chunked attention layers, else a token mixer
           (``linear_attn``, ``mamba``), after the input norm
norms      by role (`norm_roles`): the attention's and the feed-forward block's input and output norms;
           a layer with an input norm alone is parallel (Cohere)
FFN        ``mlp``, ``feed_forward`` or ``block_sparse_moe`` (a MoE where it has ``experts``), with a
           ``shared_mlp`` the layer adds beside its routed block (Granite-MoE-Shared)

A layer with a child none of these name is refused (`find_parts` raises TypeError): running without it
would compute something else. What the parts are made into (operations, attention calls) is `layers`'
and `attention`'s.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Sequence, Set, Tuple

from torch import nn

from .attention import ATTENTION_KINDS

__all__ = ["LayerParts", "ShortcutParts", "check_model_parts", "final_norm", "find_parts", "find_shortcut_parts",
           "is_shortcut", "layer_kind", "multiplier", "norm_roles"]

_MIXERS = ("linear_attn", "mamba")  # token mixers other than attention, called as mixer(hidden_states=x)
_NORMS = ("input_layernorm", "post_attention_layernorm")  # LongCat-Flash's, two of each
_PRE_FFN = ("pre_feedforward_layernorm", "pre_mlp_layernorm", "pre_ff_layernorm")  # the FFN's input norm, if named so
_POST_FFN = ("post_feedforward_layernorm", "post_mlp_layernorm")  # a norm of the FFN's output (sandwich norms)
_POST_ATTN = ("post_self_attn_layernorm",)  # a norm of the attention's output, where post_attention_layernorm is not
_FINAL_NORMS = ("norm", "final_layernorm", "norm_f", "final_norm")  # the model's last norm
_FFNS = ("mlp", "feed_forward", "block_sparse_moe")  # the layer's feed-forward block, one of these
_BESIDE = ("shared_mlp",)  # a shared MLP the layer adds beside its routed block (Granite-MoE-Shared)
_MODEL_PARTS = ("embed_tokens", "layers")


def _child(module: nn.Module, names: Sequence[str]) -> Optional[Tuple[str, nn.Module]]:
    return next(((n, getattr(module, n)) for n in names if isinstance(getattr(module, n, None), nn.Module)), None)


def check_model_parts(hf_model: nn.Module) -> None:
    """TypeError unless ``hf_model`` is a decoder-only causal LM the adapter knows: ``.model`` with its embedding,
    decoder layers and final norm, and ``.lm_head``."""
    base = getattr(hf_model, "model", None)
    missing = [n for n in _MODEL_PARTS if not isinstance(getattr(base, n, None), nn.Module)]
    if base is not None and _child(base, _FINAL_NORMS) is None:
        missing.append(" / ".join(_FINAL_NORMS))
    if missing or not isinstance(getattr(hf_model, "lm_head", None), nn.Module):
        raise TypeError(f"{type(hf_model).__name__} is not a decoder-only causal LM the adapter knows: it needs "
                        f".model.{{{', '.join(_MODEL_PARTS)}, {' / '.join(_FINAL_NORMS)}}} and .lm_head (missing: "
                        f"{missing or ['lm_head']})")


def final_norm(base: nn.Module) -> nn.Module:
    """The model's last norm (``base``: the causal LM's ``.model``, checked by `check_model_parts`)."""
    return _child(base, _FINAL_NORMS)[1]


def multiplier(obj: Any, name: str) -> float:
    """A scale the family sets on a module or config (Granite's ``residual_multiplier``, ...); 1.0 where unset."""
    value = getattr(obj, name, None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value else 1.0


def layer_kind(config: Any, index: int) -> str:
    """The layer's attention type as its model decides it: ``layer_types``, else a global sliding window."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def is_shortcut(hf_layer: nn.Module) -> bool:
    """Whether the layer is LongCat-Flash's shortcut layer (a list of attentions)."""
    return isinstance(getattr(hf_layer, "self_attn", None), nn.ModuleList)


def norm_roles(hf_layer: nn.Module) -> Dict[str, Optional[str]]:
    """The names of a layer's norms by role (None: none): ``attn_in`` / ``ffn_in`` normalise a sublayer's input,
    ``attn_out`` / ``ffn_out`` its output before the residual (sandwich norms, OLMo-2's post-norms).
    ``post_attention_layernorm`` is the FFN's input norm, unless the layer names that one otherwise
    (`_PRE_FFN`) or has norms of outputs only: then it normalises the attention's output."""
    has = lambda name: isinstance(getattr(hf_layer, name, None), nn.Module)  # noqa: E731
    first = lambda names: next((n for n in names if has(n)), None)  # noqa: E731
    attn_in = "input_layernorm" if has("input_layernorm") else None
    post_attn = "post_attention_layernorm" if has("post_attention_layernorm") else None
    pre_ffn, post_ffn, attn_out = first(_PRE_FFN), first(_POST_FFN), first(_POST_ATTN)
    if pre_ffn is not None or (attn_in is None and post_ffn is not None):
        ffn_in, attn_out = pre_ffn, attn_out or post_attn
    else:
        ffn_in = post_attn
    return dict(attn_in=attn_in, attn_out=attn_out, ffn_in=ffn_in, ffn_out=post_ffn)


@dataclasses.dataclass(frozen=True)
class LayerParts:
    """A decoder layer's parts: its norms by role (identities where it has none), its token mixer (``attention``
    is the same module where the layer attends, else None), its feed-forward block and what it adds beside."""

    input_norm: nn.Module
    attn_out_norm: nn.Module
    ffn_norm: nn.Module
    ffn_out_norm: nn.Module
    parallel: bool  # the FFN reads the attention's normed input, both added to the layer's input (Cohere)
    sandwich: bool  # a norm of the FFN's output before its residual
    mixer: nn.Module
    attention: Optional[nn.Module]
    ffn: nn.Module
    is_moe: bool  # the FFN has routed experts
    beside: Optional[Tuple[str, nn.Module]]  # a shared MLP added beside the routed block, by its name


def _norms(hf_layer: nn.Module, index: int) -> Tuple[Dict[str, nn.Module], bool, bool, Set[str]]:
    """The layer's norms by their roles (`norm_roles`; missing ones are identities), whether it is parallel,
    whether it has a sandwich norm, and the names of the norms it has."""
    roles = norm_roles(hf_layer)
    parallel = roles["attn_in"] is not None and not any(v for k, v in roles.items() if k != "attn_in")
    if parallel:
        roles["ffn_in"] = roles["attn_in"]
    if (roles["attn_in"] or roles["attn_out"]) is None or (roles["ffn_in"] or roles["ffn_out"]) is None:
        raise TypeError(f"layer {index} ({type(hf_layer).__name__}) lacks its norms ("
                        f"{' or '.join(('input_layernorm', 'post_attention_layernorm'))}, ...)")
    norm = {role: getattr(hf_layer, name) if name else nn.Identity() for role, name in roles.items()}
    return norm, parallel, roles["ffn_out"] is not None, {name for name in roles.values() if name}


def _mixer(hf_layer: nn.Module, kind: str, index: int) -> Tuple[str, nn.Module]:
    """The layer's token mixer, by its name: attention where the layer is of an attention kind, else another."""
    attn = getattr(hf_layer, "self_attn", None)
    if kind in ATTENTION_KINDS and isinstance(attn, nn.Module) and not isinstance(attn, nn.ModuleList):
        return "self_attn", attn
    found = _child(hf_layer, _MIXERS)
    if found is not None:
        return found
    kinds = ", ".join(k.replace("_attention", "") for k in ATTENTION_KINDS)
    parts = ", ".join(n for n, _ in hf_layer.named_children())
    what = f"is {kind}" if kind not in ATTENTION_KINDS else \
        f"has no attention module the adapter knows (its parts: {parts})"
    raise TypeError(f"layer {index} ({type(hf_layer).__name__}) {what}: the adapter runs attention "
                    f"(self_attn) of the kinds {kinds}, and the token mixers {', '.join(_MIXERS)}")


def _has_experts(block: nn.Module) -> bool:
    return isinstance(getattr(block, "experts", None), nn.Module)


def _refuse_unknown(hf_layer: nn.Module, index: int, known: Set[str]) -> None:
    unknown = {n for n, _ in hf_layer.named_children()} - known
    if unknown:  # e.g. extra post-norms: running without them would be silently wrong
        raise TypeError(f"layer {index} ({type(hf_layer).__name__}) has modules the adapter does not "
                        f"run: {sorted(unknown)}")


# What a layer may hold that the operations cannot carry (DeepSeek-V4; docs/model.md says what each would take)
_COMPRESSED = {"compressed_sparse_attention": "compressed sparse", "heavily_compressed_attention": "heavily compressed"}
_HYPER = ("attn_hc", "ffn_hc")  # hyper-connections: the residual as hc_mult streams, mixed around each sublayer


def _refuse_beyond(hf_layer: nn.Module, kind: str, index: int) -> None:
    """TypeError naming the parts of a layer whose state the operations do not carry (one hidden row per token, a
    cache of keys and values per token)."""
    found = [f"{_COMPRESSED[kind]} attention (its cache holds a compressor's state, not keys and values per "
             f"token)"] if kind in _COMPRESSED else []
    hyper = [n for n in _HYPER if isinstance(getattr(hf_layer, n, None), nn.Module)]
    if hyper:
        found.append(f"hyper-connections ({', '.join(hyper)}: its residual is several streams)")
    if found:
        raise TypeError(f"layer {index} ({type(hf_layer).__name__}): {' and '.join(found)}: the adapter's operations "
                        f"carry {'neither' if len(found) > 1 else 'it'} (docs/model.md, 'Refused')")


def find_parts(hf_layer: nn.Module, kind: str, index: int) -> LayerParts:
    """Layer ``index`` (of attention kind ``kind``, `layer_kind`)'s parts; TypeError naming what it lacks, or a
    child the adapter does not run."""
    _refuse_beyond(hf_layer, kind, index)
    ffn = _child(hf_layer, _FFNS)
    if ffn is None:
        raise TypeError(f"layer {index} ({type(hf_layer).__name__}) lacks {[' / '.join(_FFNS)]}")
    norm, parallel, sandwich, norms = _norms(hf_layer, index)
    mixer_name, mixer = _mixer(hf_layer, kind, index)
    beside = _child(hf_layer, _BESIDE)
    is_moe = _has_experts(ffn[1])
    if beside is not None and not is_moe:
        raise TypeError(f"layer {index} has a {beside[0]} beside a dense MLP")
    _refuse_unknown(hf_layer, index, {*norms, mixer_name, ffn[0], *([beside[0]] if beside else [])})
    return LayerParts(norm["attn_in"], norm["attn_out"], norm["ffn_in"], norm["ffn_out"], parallel, sandwich, mixer,
                      mixer if mixer_name == "self_attn" else None, ffn[1], is_moe, beside)


@dataclasses.dataclass(frozen=True)
class ShortcutParts:
    """A LongCat-Flash layer's parts: two attentions with their input norms, the two post-attention norms, two
    dense MLPs and the MoE."""

    attentions: Tuple[nn.Module, nn.Module]
    input_norms: Tuple[nn.Module, nn.Module]
    ffn_norms: Tuple[nn.Module, nn.Module]
    dense: Tuple[nn.Module, nn.Module]
    moe: nn.Module
    is_moe: bool


def find_shortcut_parts(hf_layer: nn.Module, kind: str, index: int) -> ShortcutParts:
    """A shortcut layer's parts (`is_shortcut`); TypeError where it is not one the adapter runs."""
    lists = {n: getattr(hf_layer, n, None) for n in ("self_attn", *_NORMS, "mlps")}
    if not all(isinstance(m, nn.ModuleList) and len(m) == 2 for m in lists.values()) \
            or not isinstance(getattr(hf_layer, "mlp", None), nn.Module):
        raise TypeError(f"layer {index} ({type(hf_layer).__name__}) is not a shortcut-MoE layer of two "
                        f"attentions (self_attn, input_layernorm, post_attention_layernorm and mlps: two each) "
                        f"and a MoE (mlp)")
    if kind not in ATTENTION_KINDS:
        raise TypeError(f"layer {index} ({type(hf_layer).__name__}) is {kind}, not attention")
    _refuse_unknown(hf_layer, index, {*lists, "mlp"})
    attn, norms_in, norms_ffn, mlps = (lists[n] for n in ("self_attn", *_NORMS, "mlps"))
    return ShortcutParts((attn[0], attn[1]), (norms_in[0], norms_in[1]), (norms_ffn[0], norms_ffn[1]),
                         (mlps[0], mlps[1]), hf_layer.mlp, _has_experts(hf_layer.mlp))
