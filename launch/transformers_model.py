"""A Hugging Face transformers MoE causal LM as the toolkit's model: the same schedules, EP and KV offload.

`build_transformers_model` makes a small model of a family (``deepseek_v3``, ``qwen3_moe``,
``qwen2_moe``, ``mixtral``, ``glm4_moe``, ``qwen3_next``, ...) with seeded weights; `adapt` wraps a
model the user already has. The adapter (`TransformersModel`) offers what `launch.runner` needs of
`launch.model.Model`, with the same value names, and runs each decoder layer with the family's
own modules:

``attn``      input norm, then per request (batch 1, positions after the request's prefix) the
              family's attention module with its rotary embeddings and an explicit causal mask
              aligned to the bottom right (banded on sliding-window layers); the keys and values
              are read back from a `transformers.DynamicCache` handed to the module, pre-filled
              with the prefix for a cut request's later part (its rows in every earlier
              micro-batch, concatenated); residual. Writes ``"resid"``,
              ``K``, ``V`` (packed ``[tokens, kv_heads, head_dim]``, in whatever layout the family
              caches: DeepSeek-V3 caches its compressed latent and its rotary key, of two shapes)
``ffn_norm``  post-attention norm -> ``MOE_IN``
MoE / MLP     the expert-parallel layer's stages after `TransformersModel.replace_moe`, else the
              family's block as one operation -> ``MOE_OUT``
``residual``  -> ``OUT``

Layers that are not attention (a hybrid model's linear-attention layers) run their token mixer
per request and have no keys or values: such a model cannot continue a request from a prefix,
so its batches are split at request boundaries only (`TransformersModel.no_cut_reason`).

transformers is imported only inside the functions here.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

import overlap
from collectives import MOE_IN, MOE_OUT
from microbatch import HIDDEN, OUT, Operation, State, as_operation
from microbatch.split import SeqInfo, SplitPlan

from .model import K, PREFIX_KV, SEQ, V, Batch, _param_seed, forward_layer_by_layer

__all__ = ["FAMILIES", "TransformersConfig", "TransformersLayer", "TransformersModel", "adapt",
           "build_transformers_model", "causal_mask", "from_config", "seed_weights", "small_config"]

KV = Tuple[torch.Tensor, torch.Tensor]

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
}
_N_EXPERTS = ("n_routed_experts", "num_local_experts", "num_experts")
_OVERRIDES = ("n_layers", "n_dense_layers", "hidden", "n_experts", "top_k", "n_shared")
_ATTENTION_KINDS = ("full_attention", "sliding_attention")
_MIXERS = ("linear_attn",)  # token mixers other than attention, called as mixer(hidden_states=x)
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp")
_MODEL_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


# --- the family's config --------------------------------------------------------------------------

def _first_field(config: Any, names: Sequence[str]) -> Optional[str]:
    return next((n for n in names if hasattr(config, n)), None)


def _override_fields(base: Any, overrides: Mapping[str, Any], expert_ffn: int) -> Dict[str, Any]:
    """The toolkit's override names in the family's own field names (``base``: its default config)."""
    unknown = sorted(set(overrides) - set(_OVERRIDES))
    if unknown:
        raise ValueError(f"unknown overrides {unknown}; known: {list(_OVERRIDES)}")
    out: Dict[str, Any] = {}
    simple = {"n_layers": "num_hidden_layers", "hidden": "hidden_size", "top_k": "num_experts_per_tok",
              "n_experts": _first_field(base, _N_EXPERTS)}
    for name, field in simple.items():
        if name in overrides and field is None:
            raise ValueError(f"{base.model_type} has no expert count field ({', '.join(_N_EXPERTS)})")
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
    if hasattr(base, "n_shared_experts"):
        return {"n_shared_experts": n}
    if hasattr(base, "shared_expert_intermediate_size"):
        if n < 1:  # the family always builds its shared expert
            raise ValueError(f"{base.model_type} has one gated shared expert; n_shared sets its size and must be >= 1")
        return {"shared_expert_intermediate_size": n * expert_ffn}
    if n:
        raise ValueError(f"{base.model_type} has no shared experts (n_shared must be 0)")
    return {}


def small_config(model_type: str, overrides: Optional[Mapping[str, Any]] = None, **fields: Any) -> Any:
    """The family's config made small for the CPU, then ``overrides`` (toolkit names) and ``fields`` (its own)."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    small = dict(FAMILIES.get(model_type, _COMMON))
    experts = _first_field(base, _N_EXPERTS)
    if experts is not None:
        small[experts] = 8
    expert_ffn = fields.get("moe_intermediate_size", small["moe_intermediate_size"])
    return AutoConfig.for_model(model_type, **{**small, **_override_fields(base, overrides or {}, expert_ffn), **fields})


# --- weights ----------------------------------------------------------------------------------------

@torch.no_grad()
def seed_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter from a generator seeded by ``(seed, its name)``: the same on every rank.

    Matrices N(0, 1/fan_in), embeddings N(0, 1), biases N(0, 0.02^2), other vectors (norm weights)
    1 + N(0, 0.1^2); a router's score-correction bias buffer N(0, 0.1^2). Drawn in float32 on the CPU.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, param in model.named_parameters():
        gen = torch.Generator().manual_seed(_param_seed(seed, name))
        noise = torch.randn(param.shape, generator=gen)
        if id(param) in embeddings:
            values = noise
        elif name.endswith("bias"):
            values = noise * 0.02
        elif param.dim() == 1:
            values = 1.0 + noise * 0.1
        else:
            values = noise * param.shape[-1] ** -0.5
        param.copy_(values)
    for name, buf in model.named_buffers():
        if name.endswith("correction_bias") and buf.is_floating_point():
            gen = torch.Generator().manual_seed(_param_seed(seed, name))
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)


def build_transformers_model(model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                             device: Any = "cpu", overrides: Optional[Mapping[str, Any]] = None,
                             attn_implementation: str = "sdpa", **fields: Any) -> "TransformersModel":
    """A small ``model_type`` causal LM with weights from ``seed`` (the same on every rank), adapted.

    ``overrides`` take the toolkit's names (``n_layers``, ``n_dense_layers``, ``hidden``,
    ``n_experts``, ``top_k``, ``n_shared``); ``fields`` set the family's own config fields.
    """
    return from_config(small_config(model_type, overrides, **fields), seed=seed, dtype=dtype, device=device,
                       attn_implementation=attn_implementation)


def from_config(config: Any, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: Any = "cpu",
                attn_implementation: str = "sdpa") -> "TransformersModel":
    """The causal LM of a transformers ``config`` with weights from ``seed`` (the same on every rank), adapted."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):  # from_config draws its own init: leave the caller's RNG alone
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    seed_weights(hf, seed)
    return adapt(hf.to(device).requires_grad_(False))


def adapt(hf_model: nn.Module, check: bool = True) -> "TransformersModel":
    """The toolkit's view of a transformers causal LM (``.model`` with decoder layers, ``.lm_head``); no copy.

    With ``check``, a few tokens through the adapter must give what the model's own forward gives:
    a family whose layers do more than the adapter runs (a residual multiplier, an embedding
    scale) raises TypeError here instead of computing something else later.
    """
    base = getattr(hf_model, "model", None)
    missing = [n for n in _MODEL_PARTS if not isinstance(getattr(base, n, None), nn.Module)]
    if missing or not isinstance(getattr(hf_model, "lm_head", None), nn.Module):
        raise TypeError(f"{type(hf_model).__name__} is not a decoder-only causal LM the adapter knows: it needs "
                        f".model.{{{', '.join(_MODEL_PARTS)}}} and .lm_head (missing: {missing or ['lm_head']})")
    model = TransformersModel(hf_model)
    if check:
        model.check_against_own_forward()
    return model


# --- attention ---------------------------------------------------------------------------------------

def causal_mask(n: int, n_prefix: int, window: Optional[int], dtype: torch.dtype, device: Any) -> torch.Tensor:
    """Additive mask [1, 1, n, n_prefix + n]: query i (position n_prefix + i) sees keys up to its position,
    the last ``window`` of them on a sliding-window layer."""
    q = torch.arange(n_prefix, n_prefix + n, device=device)[:, None]
    k = torch.arange(n_prefix + n, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window
    mask = torch.zeros(n, n_prefix + n, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def _cache_keyword(module: nn.Module) -> str:
    """The name under which ``module.forward`` takes its cache (transformers renamed ``past_key_values``)."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _to_cache(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # packed [tokens, heads, dim] -> the cache's [1, heads, tokens, dim]


def _from_cache(x: torch.Tensor, n: int) -> torch.Tensor:
    return x[0, :, x.shape[-2] - n:].transpose(0, 1)  # the last n tokens, packed [n, heads, dim]


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _requests(seq: SeqInfo) -> Iterator[Tuple[int, int, int, int]]:
    """``(start, tokens, prefix start, prefix tokens)`` of each non-empty request in the packed batch."""
    start = pstart = 0
    for n, p in zip(seq.seq_lens, seq.prefix_lens):
        if n:
            yield start, n, pstart, p
        start, pstart = start + n, pstart + p


def _pack(parts: List[torch.Tensor], shape: Tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else like.new_zeros(0, *shape)


def _rows(prefix: Optional[KV], start: int, n: int) -> Optional[KV]:
    return None if prefix is None or not n else (prefix[0][start:start + n], prefix[1][start:start + n])


def _layer_kind(config: Any, index: int) -> str:
    """The layer's attention type as its model decides it: ``layer_types``, else a global sliding window."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


class TransformersLayer(nn.Module):
    """One decoder layer of a transformers model as the toolkit's operations (see the module docstring)."""

    def __init__(self, hf_model: nn.Module, index: int):
        super().__init__()
        hf_layer, config = hf_model.model.layers[index], hf_model.config
        missing = [n for n in _LAYER_PARTS if not isinstance(getattr(hf_layer, n, None), nn.Module)]
        if missing:
            raise TypeError(f"layer {index} ({type(hf_layer).__name__}) lacks {missing}")
        self.index, self.kind = index, _layer_kind(config, index)
        self.input_norm, self.ffn_norm = hf_layer.input_layernorm, hf_layer.post_attention_layernorm
        self.rotary = hf_model.model.rotary_emb
        self.window = config.sliding_window if self.kind == "sliding_attention" else None
        self.mixer, self.is_attention = self._find_mixer(hf_layer)
        unknown = {n for n, _ in hf_layer.named_children()} - set(_LAYER_PARTS) - {"self_attn", *_MIXERS}
        if unknown:  # e.g. extra post-norms: running without them would be silently wrong
            raise TypeError(f"layer {index} ({type(hf_layer).__name__}) has modules the adapter does not "
                            f"run: {sorted(unknown)}")
        self.cache_keyword = _cache_keyword(self.mixer) if self.is_attention else ""
        self.attn_index = getattr(self.mixer, "layer_idx", index)
        self.is_moe = isinstance(getattr(hf_layer.mlp, "experts", None), nn.Module)
        if self.is_moe:
            self.moe: nn.Module = hf_layer.mlp
        else:
            self.mlp = hf_layer.mlp

    def _find_mixer(self, hf_layer: nn.Module) -> Tuple[nn.Module, bool]:
        if self.kind in _ATTENTION_KINDS and isinstance(getattr(hf_layer, "self_attn", None), nn.Module):
            return hf_layer.self_attn, True
        for name in _MIXERS:
            if isinstance(getattr(hf_layer, name, None), nn.Module):
                return getattr(hf_layer, name), False
        raise TypeError(f"layer {self.index} ({type(hf_layer).__name__}, {self.kind}) has no attention or "
                        f"token mixer the adapter knows ({', '.join(('self_attn',) + _MIXERS)})")

    # --- attention ---------------------------------------------------------------------------------
    def _attend(self, x: torch.Tensor, n_prefix: int, prefix: Optional[KV]) -> Tuple[torch.Tensor, torch.Tensor,
                                                                                      torch.Tensor]:
        """One request: x [n, hidden] after ``n_prefix`` tokens whose keys / values are ``prefix``."""
        from transformers import DynamicCache

        n = x.shape[0]
        pos = torch.arange(n_prefix, n_prefix + n, device=x.device)[None]
        cache = DynamicCache()
        if n_prefix:
            cache.update(_to_cache(prefix[0]), _to_cache(prefix[1]), self.attn_index)
        mask = causal_mask(n, n_prefix, self.window, x.dtype, x.device)
        out = _first(self.mixer(hidden_states=x[None], position_embeddings=self.rotary(x[None], pos),
                                attention_mask=mask, position_ids=pos, **{self.cache_keyword: cache}))
        held = cache.layers[self.attn_index] if len(cache.layers) > self.attn_index else None
        if held is None or not held.is_initialized or held.keys.shape[-2] != n_prefix + n:
            raise RuntimeError(f"layer {self.index}: {type(self.mixer).__name__} did not cache the {n_prefix + n} "
                               f"keys and values of the request")
        return out[0], _from_cache(held.keys, n), _from_cache(held.values, n)

    def _mix(self, x: torch.Tensor) -> torch.Tensor:
        return _first(self.mixer(hidden_states=x[None]))[0]

    def attention(self, hidden: torch.Tensor, seq: SeqInfo, prefix: Optional[KV] = None
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Norm, the token mixer within each request (after its prefix), residual: ``(resid, k, v)``.

        ``k``, ``v`` are packed ``[tokens, *k_shape]``, ``[tokens, *v_shape]``; None on a layer that
        is not attention."""
        self._check(hidden, seq, prefix)
        x = self.input_norm(hidden)
        outs, ks, vs = [], [], []
        for start, n, pstart, p in _requests(seq):
            if self.is_attention:
                out, k, v = self._attend(x[start:start + n], p, _rows(prefix, pstart, p))
                ks.append(k)
                vs.append(v)
            else:
                out = self._mix(x[start:start + n])
            outs.append(out)
        resid = hidden + torch.cat(outs) if outs else hidden.clone()
        if not self.is_attention:
            return resid, None, None
        return resid, _pack(ks, self.k_shape, hidden), _pack(vs, self.v_shape, hidden)

    def _mixer_op(self, hidden: torch.Tensor, seq: SeqInfo, prefix: Optional[KV]) -> torch.Tensor:
        return self.attention(hidden, seq, prefix)[0]

    def _check(self, hidden: torch.Tensor, seq: SeqInfo, prefix: Optional[KV]) -> None:
        if hidden.shape[0] != seq.num_tokens:
            raise ValueError(f"layer {self.index}: hidden has {hidden.shape[0]} rows, seq has {seq.num_tokens} tokens")
        n_prefix = seq.num_prefix_tokens
        if n_prefix and not self.is_attention:
            raise ValueError(f"layer {self.index} is {self.kind}: it cannot continue a request after a prefix")
        if n_prefix and (prefix is None or prefix[0].shape[0] != n_prefix or prefix[1].shape[0] != n_prefix):
            got = "none" if prefix is None else f"{prefix[0].shape[0]}/{prefix[1].shape[0]} rows"
            raise ValueError(f"layer {self.index}: seq has {n_prefix} prefix tokens but prefix_kv has {got}")

    @torch.no_grad()
    def probe_kv_shapes(self, dtype: torch.dtype, device: Any, hidden: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """The per-token shapes of the keys and values this layer caches (one token through its attention)."""
        _, k, v = self._attend(torch.zeros(1, hidden, dtype=dtype, device=device), 0, None)
        self.k_shape, self.v_shape = tuple(k.shape[1:]), tuple(v.shape[1:])
        return self.k_shape, self.v_shape

    # --- feed-forward --------------------------------------------------------------------------------
    def _ffn(self) -> nn.Module:
        return self.moe if self.is_moe else self.mlp

    def _call_ffn(self, x: torch.Tensor) -> torch.Tensor:
        return _first(self._ffn()(x[None]))[0]  # transformers blocks take [batch, tokens, hidden]

    def ffn_operations(self) -> List[Operation]:
        """The operations from ``MOE_IN`` to ``MOE_OUT``: the EP layer's stages, or one call of the block."""
        stages = getattr(self._ffn(), "stages", None)
        if callable(stages):
            return [as_operation(s) for s in stages()]
        return [Operation("moe" if self.is_moe else "mlp", self._call_ffn, (MOE_IN,), (MOE_OUT,))]

    def operations(self) -> List[Operation]:
        """This layer as operations, from ``HIDDEN``, ``SEQ``, ``PREFIX_KV`` to ``OUT`` (and ``K``, ``V``)."""
        mix = (Operation("attn", self.attention, (HIDDEN, SEQ, PREFIX_KV), ("resid", K, V)) if self.is_attention
               else Operation("attn", self._mixer_op, (HIDDEN, SEQ, PREFIX_KV), ("resid",)))
        return ([mix, Operation("ffn_norm", self.ffn_norm, ("resid",), (MOE_IN,))]
                + self.ffn_operations()
                + [Operation("residual", torch.add, ("resid", MOE_OUT), (OUT,))])

    def run(self, hidden: torch.Tensor, seq: SeqInfo, prefix: Optional[KV] = None, **meta: Any
            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Run the operations in order on the current stream: ``(out, k, v)`` (k, v None without attention)."""
        state = State({HIDDEN: hidden, SEQ: seq, PREFIX_KV: prefix})
        for op in self.operations():
            with overlap.span(op.name, layer=self.index, **meta):
                op.run(state)
        return state[OUT], dict.get(state, K), dict.get(state, V)

    def forward(self, hidden: torch.Tensor, seq: SeqInfo, prefix: Optional[KV] = None) -> torch.Tensor:
        return self.run(hidden, seq, prefix)[0]


# --- the model ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TransformersConfig:
    """What the toolkit reads of a model's shapes; ``k_shape`` / ``v_shape`` are one token's cached K / V."""

    model_type: str
    vocab: int
    n_layers: int
    hidden: int
    n_heads: int
    n_experts: int
    top_k: int
    n_shared: int
    moe_layers: Tuple[int, ...]
    attention_layers: Tuple[int, ...]
    k_shape: Tuple[int, ...]
    v_shape: Tuple[int, ...]

    @property
    def n_dense_layers(self) -> int:
        return self.n_layers - len(self.moe_layers)

    @property
    def kv_heads(self) -> int:
        return self.k_shape[0]

    @property
    def head_dim(self) -> int:
        return self.k_shape[-1]

    @property
    def v_head_dim(self) -> int:
        return self.v_shape[-1]

    def is_moe_layer(self, index: int) -> bool:
        return index in self.moe_layers


def _n_shared(config: Any) -> int:
    if hasattr(config, "n_shared_experts"):
        return int(config.n_shared_experts or 0)
    size = getattr(config, "shared_expert_intermediate_size", 0) or 0
    return 1 if size else 0


class TransformersModel(nn.Module):
    """A transformers causal LM seen as `launch.model.Model`: ``embed_tokens``, ``layers``, ``norm``, ops.

    ``hf`` is the model itself (its MoE blocks stay in place for `reference`); `replace_moe` swaps
    the adapter's blocks only. ``no_cut_reason`` is None when every layer is attention (a cut
    request's later parts can attend to its earlier parts' keys and values), else why not.
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        impl = getattr(hf_model.config, "_attn_implementation", None)
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"the adapter passes explicit attention masks: use attn_implementation 'sdpa' or "
                             f"'eager', not {impl!r}")
        self.hf = hf_model.eval()
        self.layers = nn.ModuleList(TransformersLayer(hf_model, i) for i in range(len(hf_model.model.layers)))
        self.cfg = self._config()
        mixers = [f"{layer.index} ({layer.kind})" for layer in self.layers if not layer.is_attention]
        self.no_cut_reason: Optional[str] = (
            f"{self.cfg.model_type} layers {', '.join(mixers)} keep no keys and values to continue a request "
            f"from, so requests are not cut across micro-batches" if mixers else None)

    def _config(self) -> TransformersConfig:
        c = self.hf.config
        attention = [layer for layer in self.layers if layer.is_attention]
        weight = self.hf.model.embed_tokens.weight
        shapes = [layer.probe_kv_shapes(weight.dtype, weight.device, c.hidden_size) for layer in attention]
        k_shape, v_shape = shapes[0] if shapes else ((), ())
        experts = _first_field(c, _N_EXPERTS)
        return TransformersConfig(
            model_type=c.model_type, vocab=c.vocab_size, n_layers=len(self.layers), hidden=c.hidden_size,
            n_heads=c.num_attention_heads, n_experts=int(getattr(c, experts, 0) or 0) if experts else 0,
            top_k=int(getattr(c, "num_experts_per_tok", 0) or 0), n_shared=_n_shared(c),
            moe_layers=tuple(layer.index for layer in self.layers if layer.is_moe),
            attention_layers=tuple(layer.index for layer in attention), k_shape=k_shape, v_shape=v_shape)

    # --- what launch.runner uses -------------------------------------------------------------------
    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embedding of token ids; their range is checked on the host, except while compiling."""
        if tokens.numel() and not torch.compiler.is_compiling() and (
                int(tokens.min()) < 0 or int(tokens.max()) >= self.cfg.vocab):
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab}), got [{int(tokens.min())}, "
                             f"{int(tokens.max())}]")
        return self.hf.model.embed_tokens(tokens)

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.hf.model.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states, by the family's ``lm_head``."""
        return self.hf.lm_head(hidden)

    def moe_layers(self) -> Iterator[TransformersLayer]:
        return (layer for layer in self.layers if layer.is_moe)

    def replace_moe(self, make: Callable[[TransformersLayer], nn.Module]) -> None:
        """Set each MoE layer's ``moe`` to ``make(layer)`` (the transformers model keeps its own block)."""
        for layer in self.moe_layers():
            layer.moe = make(layer)

    def layer_operations(self) -> List[List[Operation]]:
        return [layer.operations() for layer in self.layers]

    @torch.no_grad()
    def forward(self, batch: Batch, kv_sink: Optional[Callable[[int, torch.Tensor, torch.Tensor], None]] = None
                ) -> torch.Tensor:
        """Serial prefill of the packed batch through the adapter: final hidden states [tokens, hidden]."""
        hidden = self.embed_tokens(batch.tokens)
        for layer in self.layers:
            hidden, k, v = layer.run(hidden, batch.seq, None)
            if kv_sink is not None and k is not None:
                kv_sink(layer.index, k, v)
        return self.norm(hidden)

    @torch.no_grad()
    def forward_microbatches(self, batch: Batch, plan: SplitPlan) -> torch.Tensor:
        """The plan's micro-batches layer by layer, without overlap (see `launch.model.Model.forward_microbatches`)."""
        if plan.cut and self.no_cut_reason:
            raise ValueError(f"the plan cuts a request, but {self.no_cut_reason}")
        return forward_layer_by_layer(self, batch, plan)

    # --- the model's own forward ------------------------------------------------------------------
    @torch.no_grad()
    def check_against_own_forward(self, n_tokens: int = 4, rtol: float = 1e-2) -> float:
        """Largest difference between the adapter's and the model's own forward on one short request.

        Raises TypeError when it is above ``rtol`` of the output's magnitude. Run it before
        `replace_moe`: the expert-parallel layer would exchange tokens with the other ranks.
        """
        weight = self.hf.model.embed_tokens.weight
        tokens = torch.arange(n_tokens, device=weight.device) % self.cfg.vocab
        batch = Batch(tokens, SeqInfo((n_tokens,)))
        got, want = self.forward(batch).float(), self.reference(batch).float()
        diff, scale = (got - want).abs().max().item(), want.abs().max().item()
        if not diff <= rtol * max(scale, 1.0):
            raise TypeError(f"{self.cfg.model_type}: the adapter's layers do not compute the model's own forward "
                            f"(difference {diff:.3g} at magnitude {scale:.3g}); its decoder layers do more than "
                            f"input norm, attention, post-attention norm, MLP and the two residuals")
        return diff

    def _requests(self, batch: Batch) -> Iterator[torch.Tensor]:
        if batch.seq.num_prefix_tokens:
            raise ValueError("the reference runs whole requests; this batch continues prefixes")
        cu = batch.seq.cu_seqlens
        return (batch.tokens[cu[i]:cu[i + 1]] for i in range(batch.seq.num_requests) if cu[i + 1] > cu[i])

    @torch.no_grad()
    def reference(self, batch: Batch) -> torch.Tensor:
        """Final hidden states by the model's own forward, each request on its own."""
        outs = [self.hf.model(input_ids=t[None], use_cache=False).last_hidden_state[0] for t in self._requests(batch)]
        return torch.cat(outs) if outs else self.embed_tokens(batch.tokens)

    @torch.no_grad()
    def reference_kv(self, batch: Batch) -> Dict[int, KV]:
        """Each attention layer's keys and values, packed, from the cache of the model's own forward."""
        from transformers import DynamicCache

        per_layer: Dict[int, List[KV]] = {i: [] for i in self.cfg.attention_layers}
        for t in self._requests(batch):
            cache = DynamicCache(config=self.hf.config)
            keyword = _cache_keyword(self.hf.model)
            self.hf.model(input_ids=t[None], use_cache=True, **{keyword: cache})
            for i in per_layer:
                held = cache.layers[self.layers[i].attn_index]
                if held.keys.shape[-2] < t.shape[0]:
                    raise ValueError(f"layer {i} keeps only its sliding window of {held.keys.shape[-2]} tokens in the "
                                     f"model's own cache; compare requests of at most that many tokens")
                per_layer[i].append((_from_cache(held.keys, t.shape[0]), _from_cache(held.values, t.shape[0])))
        return {i: (torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv])) for i, kv in per_layer.items() if kv}
