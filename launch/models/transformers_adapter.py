"""A Hugging Face transformers MoE causal LM as the toolkit's model: the same schedules, EP and KV offload.

`from_config` builds the model of a family's config (``deepseek_v3``, ``qwen3_moe``, ``gpt_oss``,
``llama4_text``, ``longcat_flash``, ...) with seeded weights and adapts it; `adapt` wraps a model
the user already has. Which families it runs, and their configs made small, are
`launch.models.families`. The adapter (`TransformersModel`) implements the model contract
`microbatch.model.MoEModel`, as the reference decoder does, with the same value names
(`microbatch.batch`), and runs each decoder layer with the family's own modules, found by their
parts:

``attn``      input norm, then per request (batch 1, positions after the request's prefix) the
              family's attention module with its rotary embeddings (if it has any) and an explicit
              causal mask aligned to the bottom right (banded on sliding-window layers, blocked on
              chunked ones); the keys and values are read back from a `transformers.DynamicCache`
              handed to the module, pre-filled with the prefix for a cut request's later part (its
              rows in every earlier micro-batch, concatenated); residual (times the layer's
              ``residual_multiplier``, Granite). Writes ``"resid"``, ``K``, ``V`` (packed
              ``[tokens, kv_heads, head_dim]``, in whatever layout the family caches: DeepSeek-V3
              caches its compressed latent and its rotary key, of two shapes)
``ffn_norm``  post-attention norm -> ``MOE_IN``
MoE / MLP     the expert-parallel layer's stages after `TransformersModel.replace_moe`, else the
              family's block (``mlp``, ``feed_forward`` or ``block_sparse_moe``, plus the layer's
              ``shared_mlp`` beside it) as one operation -> ``MOE_OUT``
``residual``  -> ``OUT``

A LongCat-Flash layer (two attention sublayers, two dense MLPs and a shortcut MoE that reads the
first MLP's input and is added at the end) is `ShortcutLayer`: its MoE exchange runs under the first
MLP and the second attention, its keys and values are both sublayers' side by side.

Layers that are not attention (a hybrid model's linear-attention layers) run their token mixer
per request and have no keys or values: such a model cannot continue a request from a prefix,
so its batches are split at request boundaries only (`TransformersModel.no_cut_reason`).

Decode (`TransformersModel.decode_layer_operations`, a `microbatch.DecodeModel`): ``attn`` reads
``HIDDEN`` (one new token per request) and ``KV_STEP``, and calls the family's attention module
once for every request of the step: batch [requests, 1], each at its own position, a
`transformers.DynamicCache` holding the padded history of the layer from the `microbatch.KVCache`
and a mask of each request's own rows (its window or chunk); what the module appends to that cache
goes into the `KVCache`. The operations after it are prefill's. A model with layers that are not
plain attention (linear attention, LongCat-Flash's two attentions) is refused in one line.
`TransformersModel.own_generate` is the family's own greedy ``generate``, to compare with.

transformers is imported only inside the functions here.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

import overlap
from collectives import MOE_IN, MOE_OUT
from microbatch import HIDDEN, OUT, Operation, Split, State
from microbatch.batch import K, KV_STEP, PREFIX_KV, SEQ, V, Batch, SeqInfo
from microbatch.forward import forward_layer_by_layer
from microbatch.kv_cache import KVStep
from microbatch.model import KV
from overlap import EP_COMM

from .common import check_token_ids, module_stages, param_seed

__all__ = ["EXPERT_COUNTS", "SHARED_COUNTS", "ShortcutLayer", "TransformersConfig", "TransformersLayer",
           "TransformersModel", "adapt", "attention_for", "causal_mask", "decode_mask", "first_field", "from_config",
           "one_line", "seed_weights"]

EXPERT_COUNTS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")  # routed experts' count
SHARED_COUNTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")  # shared experts' count
_ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")
_MIXERS = ("linear_attn", "mamba")  # token mixers other than attention, called as mixer(hidden_states=x)
_NORMS = ("input_layernorm", "post_attention_layernorm")  # LongCat-Flash's, two of each
_PRE_FFN = ("pre_feedforward_layernorm", "pre_mlp_layernorm", "pre_ff_layernorm")  # the FFN's input norm, if named so
_POST_FFN = ("post_feedforward_layernorm", "post_mlp_layernorm")  # a norm of the FFN's output (sandwich norms)
_POST_ATTN = ("post_self_attn_layernorm",)  # a norm of the attention's output, where post_attention_layernorm is not
_FINAL_NORMS = ("norm", "final_layernorm", "norm_f", "final_norm")  # the model's last norm
_FFNS = ("mlp", "feed_forward", "block_sparse_moe")  # the layer's feed-forward block, one of these
_BESIDE = ("shared_mlp",)  # a shared MLP the layer adds beside its routed block (Granite-MoE-Shared)
_MODEL_PARTS = ("embed_tokens", "layers")


# --- reading a config ------------------------------------------------------------------------------

def first_field(config: Any, names: Sequence[str]) -> Optional[str]:
    """The first of ``names`` that ``config`` has (families name one thing differently), or None."""
    return next((n for n in names if hasattr(config, n)), None)


def one_line(exc: BaseException) -> str:
    """The exception as one line: its type and message, lines joined (transformers puts the reason on the second)."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


# --- weights ----------------------------------------------------------------------------------------

@torch.no_grad()
def seed_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter from a generator seeded by ``(seed, its name)``: the same on every rank.

    Matrices N(0, 1/fan_in), embeddings N(0, 1), biases N(0, 0.02^2), other vectors (norm weights)
    1 + N(0, 0.1^2); a router's score-correction bias buffer N(0, 0.1^2). Drawn in float32 on the CPU.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, param in model.named_parameters():
        gen = torch.Generator().manual_seed(param_seed(seed, name))
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
            gen = torch.Generator().manual_seed(param_seed(seed, name))
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)


def attention_for(config: Any, asked: str) -> str:
    """``asked`` (``sdpa`` or ``eager``), or ``eager`` for a family without scaled-dot-product attention (gpt-oss's
    sinks): both take the adapter's explicit masks."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if asked != "sdpa":
        return asked
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", False) else "eager"


def _build(config: Any, dtype: torch.dtype, attn_implementation: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):  # from_config draws its own init: leave the caller's RNG alone
        return AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                attn_implementation=attention_for(config, attn_implementation))


def from_config(config: Any, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: Any = "cpu",
                attn_implementation: str = "sdpa") -> "TransformersModel":
    """The causal LM of a transformers ``config`` with weights from ``seed`` (the same on every rank), adapted.

    ``attn_implementation`` ``sdpa`` falls back to ``eager`` for a family that has no scaled-dot-product
    attention (gpt-oss)."""
    hf = _build(config, dtype, attn_implementation)
    seed_weights(hf, seed)
    return adapt(hf.to(device).requires_grad_(False))


def adapt(hf_model: nn.Module, check: bool = True) -> "TransformersModel":
    """The toolkit's view of a transformers causal LM (``.model`` with decoder layers, ``.lm_head``); no copy.

    With ``check``, a few tokens through the adapter must give what the model's own forward gives:
    a family whose layers do more than the adapter runs (a residual multiplier the layer does not
    name, an embedding scale) raises TypeError here instead of computing something else later.
    """
    base = getattr(hf_model, "model", None)
    missing = [n for n in _MODEL_PARTS if not isinstance(getattr(base, n, None), nn.Module)]
    if base is not None and _child(base, _FINAL_NORMS) is None:
        missing.append(" / ".join(_FINAL_NORMS))
    if missing or not isinstance(getattr(hf_model, "lm_head", None), nn.Module):
        raise TypeError(f"{type(hf_model).__name__} is not a decoder-only causal LM the adapter knows: it needs "
                        f".model.{{{', '.join(_MODEL_PARTS)}, {' / '.join(_FINAL_NORMS)}}} and .lm_head (missing: "
                        f"{missing or ['lm_head']})")
    model = TransformersModel(hf_model)
    if check:
        model.check_against_own_forward()
    return model


# --- attention ---------------------------------------------------------------------------------------

def causal_mask(n: int, n_prefix: int, window: Optional[int], dtype: torch.dtype, device: Any,
                chunk: Optional[int] = None) -> torch.Tensor:
    """Additive mask [1, 1, n, n_prefix + n]: query i (position n_prefix + i) sees keys up to its position,
    the last ``window`` of them on a sliding-window layer, those of its own ``chunk`` of positions on a
    chunked-attention layer (Llama 4)."""
    q = torch.arange(n_prefix, n_prefix + n, device=device)[:, None]
    k = torch.arange(n_prefix + n, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window
    if chunk is not None:
        allowed &= q // chunk == k // chunk
    mask = torch.zeros(n, n_prefix + n, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def decode_mask(positions: torch.Tensor, held: int, window: Optional[int], dtype: torch.dtype,
                chunk: Optional[int] = None) -> torch.Tensor:
    """Additive mask [requests, 1, 1, held + 1] of a decode step over a history padded to ``held`` rows, then the
    step's new row: request i, its new token at position ``positions[i]``, sees its own ``positions[i]`` rows
    (the first of the history; the rest is padding) and its new row (the last), the last ``window`` positions of
    them on a sliding-window layer, those of its own ``chunk`` on a chunked-attention layer."""
    q = positions[:, None]
    j = torch.arange(held + 1, device=positions.device)[None, :]
    new = j == held
    k = torch.where(new, q, j)  # each row's position in its request
    allowed = (j < q) | new
    if window is not None:
        allowed &= q - k < window
    if chunk is not None:
        allowed &= q // chunk == k // chunk
    mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None, None]


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


def _child(module: nn.Module, names: Sequence[str]) -> Optional[Tuple[str, nn.Module]]:
    return next(((n, getattr(module, n)) for n in names if isinstance(getattr(module, n, None), nn.Module)), None)


class _Attention:
    """One attention (sub)layer: the module, its input norm, where its keys and values live in a cache, its mask
    and rotary embeddings (``rotary`` None: the family has none, e.g. Jamba)."""

    def __init__(self, module: nn.Module, norm: nn.Module, kind: str, config: Any, rotary: Optional[nn.Module],
                 layer: int, out_norm: Optional[nn.Module] = None):
        self.module, self.norm, self.kind, self.rotary, self.layer = module, norm, kind, rotary, layer
        self.out_norm = out_norm if out_norm is not None else nn.Identity()
        self.window = config.sliding_window if kind == "sliding_attention" else None
        self.chunk = getattr(config, "attention_chunk_size", None) if kind == "chunked_attention" else None
        self.cache_keyword = _cache_keyword(module)
        self.index = getattr(module, "layer_idx", layer)
        self.typed_rotary = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        self.k_shape: Tuple[int, ...] = ()
        self.v_shape: Tuple[int, ...] = ()

    def _position(self, x: torch.Tensor, pos: torch.Tensor) -> Any:
        if self.rotary is None:
            return None
        try:
            return self.rotary(x, pos, layer_type=self.kind) if self.typed_rotary else self.rotary(x, pos)
        except Exception as err:  # noqa: BLE001 (the family's own code: say which part the adapter drives wrong)
            raise TypeError(f"layer {self.layer}: the model's rotary embedding does not take a {self.kind} layer as "
                            f"the adapter calls it ({one_line(err)})") from err

    def attend(self, x: torch.Tensor, n_prefix: int, prefix: Optional[KV]) -> Tuple[torch.Tensor, torch.Tensor,
                                                                                      torch.Tensor]:
        """One request: x [n, hidden] (normed) after ``n_prefix`` tokens whose keys / values are ``prefix``."""
        from transformers import DynamicCache

        n = x.shape[0]
        pos = torch.arange(n_prefix, n_prefix + n, device=x.device)[None]
        cache = DynamicCache()
        if n_prefix:
            cache.update(_to_cache(prefix[0]), _to_cache(prefix[1]), self.index)
        mask = causal_mask(n, n_prefix, self.window, x.dtype, x.device, self.chunk)
        out = _first(self.module(hidden_states=x[None], position_embeddings=self._position(x[None], pos),
                                 attention_mask=mask, position_ids=pos, **{self.cache_keyword: cache}))
        held = cache.layers[self.index] if len(cache.layers) > self.index else None
        if held is None or not held.is_initialized or held.keys.shape[-2] != n_prefix + n:
            raise RuntimeError(f"layer {self.layer}: {type(self.module).__name__} did not cache the {n_prefix + n} "
                               f"keys and values of the request")
        return out[0], _from_cache(held.keys, n), _from_cache(held.values, n)

    def decode(self, x: torch.Tensor, step: KVStep, layer: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every request of a decode step at once: x [requests, hidden] (normed), one new token each, after the rows
        the cache's layer ``layer`` holds of it; ``(out, k, v)``, k / v packed [requests, *k_shape / v_shape]."""
        from transformers import DynamicCache

        rows = step.rows
        held = rows.longest - 1  # the history, padded to the longest; the new rows are not written yet
        keys, values = step.cache.history(layer, rows)
        cache = DynamicCache()
        if held:
            cache.update(keys[:, :held].transpose(1, 2).to(x.dtype), values[:, :held].transpose(1, 2).to(x.dtype),
                         self.index)
        pos = step.positions[:, None]  # [requests, 1]: each request's length so far
        # alike in every layer of a kind: made by the step's first (`KVStep.once`)
        mask = step.once(("mask", held, self.window, self.chunk, x.dtype),
                         lambda: decode_mask(step.positions, held, self.window, x.dtype, self.chunk))
        turn = step.once(("rotary", id(self.rotary), self.kind if self.typed_rotary else None, x.dtype),
                         lambda: self._position(x[:, None], pos))
        out = _first(self.module(hidden_states=x[:, None], position_embeddings=turn,
                                 attention_mask=mask, position_ids=pos, **{self.cache_keyword: cache}))
        got = cache.layers[self.index] if len(cache.layers) > self.index else None
        if got is None or not got.is_initialized or got.keys.shape[-2] != held + 1:
            raise RuntimeError(f"layer {self.layer}: {type(self.module).__name__} did not append one key and value "
                               f"per request to the cache")
        return out[:, 0], got.keys[:, :, -1], got.values[:, :, -1]

    def decode_refusal(self) -> Optional[str]:
        """Why one batched call of the module cannot decode requests at different positions (None: it can)."""
        if getattr(self.module, "attn_temperature_tuning", False) and not getattr(self.module, "use_rope", True):
            return ("its attention scales queries by one position for the whole batch (Llama 4's temperature "
                    "tuning without rotary embeddings): requests at different positions cannot decode together")
        return None

    @torch.no_grad()
    def probe(self, dtype: torch.dtype, device: Any, hidden: int) -> None:
        """Learn the per-token shapes of the keys and values it caches (one token through it)."""
        _, k, v = self.attend(torch.zeros(1, hidden, dtype=dtype, device=device), 0, None)
        self.k_shape, self.v_shape = tuple(k.shape[1:]), tuple(v.shape[1:])

    def cached(self, cache: Any, n: int) -> Optional[KV]:
        """The last ``n`` tokens' keys and values in the model's own ``cache`` (None if it kept fewer)."""
        held = cache.layers[self.index]
        if held.keys.shape[-2] < n:
            return None
        return _from_cache(held.keys, n), _from_cache(held.values, n)


def _norm_roles(hf_layer: nn.Module) -> Dict[str, Optional[str]]:
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


class _Beside(nn.Module):
    """A layer's routed block and the shared MLP it adds beside it (Granite-MoE-Shared's ``shared_mlp``), summed:
    one block for `collectives.wrap_expert_parallel`, which finds the routed block in ``moe``."""

    def __init__(self, moe: nn.Module, name: str, shared: nn.Module):
        super().__init__()
        self.moe = moe
        self.add_module(name, shared)
        self._shared = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _first(self.moe(x)).reshape(x.shape) + getattr(self, self._shared)(x)


def _split_heads(prefix: Optional[KV], at: Sequence[Tuple[int, int]], i: int) -> Optional[KV]:
    """Sublayer ``i``'s part of a layer's packed keys / values (``at``: its key heads and value heads slices)."""
    if prefix is None:
        return None
    (k0, k1), (v0, v1) = at[i]
    return prefix[0][:, k0:k1], prefix[1][:, v0:v1]


def _number(obj: Any, name: str) -> Optional[float]:
    value = getattr(obj, name, None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class TransformersLayer(nn.Module):
    """One decoder layer of a transformers model as the toolkit's operations (see the module docstring)."""

    def __init__(self, hf_model: nn.Module, index: int):
        super().__init__()
        hf_layer, config = hf_model.model.layers[index], hf_model.config
        self.index, self.kind = index, _layer_kind(config, index)
        self.residual_scale = _number(hf_layer, "residual_multiplier") or 1.0  # Granite scales both branches
        self._rotary = getattr(hf_model.model, "rotary_emb", None)
        self.attns: List[_Attention] = []
        known = self._find_parts(hf_layer, config)
        unknown = {n for n, _ in hf_layer.named_children()} - known
        if unknown:  # e.g. extra post-norms: running without them would be silently wrong
            raise TypeError(f"layer {index} ({type(hf_layer).__name__}) has modules the adapter does not "
                            f"run: {sorted(unknown)}")
        self.is_attention = bool(self.attns)
        self.attn_index = self.attns[-1].index if self.attns else index
        self.window = self.attns[0].window if self.attns else None

    def _attention(self, module: nn.Module, norm: nn.Module, config: Any,
                   out_norm: Optional[nn.Module] = None) -> _Attention:
        return _Attention(module, norm, self.kind, config, self._rotary, self.index, out_norm)

    def _find_norms(self, hf_layer: nn.Module) -> set:
        """The layer's norms by their roles (`_norm_roles`): missing ones are identities. A layer with an input
        norm alone is parallel (Cohere): its feed-forward block reads the same normed input as its attention,
        and both are added to the layer's input."""
        roles = _norm_roles(hf_layer)
        self.parallel = roles["attn_in"] is not None and not any(v for k, v in roles.items() if k != "attn_in")
        if self.parallel:
            roles["ffn_in"] = roles["attn_in"]
        if (roles["attn_in"] or roles["attn_out"]) is None or (roles["ffn_in"] or roles["ffn_out"]) is None:
            raise TypeError(f"layer {self.index} ({type(hf_layer).__name__}) lacks its norms ("
                            f"{' or '.join(('input_layernorm', 'post_attention_layernorm'))}, ...)")
        norm = {role: getattr(hf_layer, name) if name else nn.Identity() for role, name in roles.items()}
        self.input_norm, self.attn_out_norm = norm["attn_in"], norm["attn_out"]
        self.ffn_norm, self.ffn_out_norm = norm["ffn_in"], norm["ffn_out"]
        self._sandwich = roles["ffn_out"] is not None
        return {name for name in roles.values() if name}

    def _find_parts(self, hf_layer: nn.Module, config: Any) -> set:
        """Take the layer's norms, token mixer and feed-forward block; the names of the children it runs."""
        ffn = _child(hf_layer, _FFNS)
        if ffn is None:
            raise TypeError(f"layer {self.index} ({type(hf_layer).__name__}) lacks {[' / '.join(_FFNS)]}")
        norms = self._find_norms(hf_layer)
        mixer_name = self._find_mixer(hf_layer, config)
        beside = _child(hf_layer, _BESIDE)
        self._set_ffn(ffn[1], beside)
        return {*norms, mixer_name, ffn[0], *([beside[0]] if beside else [])}

    def _set_ffn(self, block: nn.Module, beside: Optional[Tuple[str, nn.Module]]) -> None:
        self.is_moe = isinstance(getattr(block, "experts", None), nn.Module)
        if beside is not None:
            if not self.is_moe:
                raise TypeError(f"layer {self.index} has a {beside[0]} beside a dense MLP")
            block = _Beside(block, *beside)
        if self.is_moe:
            self.moe: nn.Module = block
        else:
            self.mlp = block

    def _find_mixer(self, hf_layer: nn.Module, config: Any) -> str:
        attn = getattr(hf_layer, "self_attn", None)
        if self.kind in _ATTENTION_KINDS and isinstance(attn, nn.Module) and not isinstance(attn, nn.ModuleList):
            self.attns = [self._attention(attn, self.input_norm, config, self.attn_out_norm)]
            self.mixer = attn
            return "self_attn"
        for name in _MIXERS:
            if isinstance(getattr(hf_layer, name, None), nn.Module):
                self.mixer = getattr(hf_layer, name)
                return name
        kinds = ", ".join(k.replace("_attention", "") for k in _ATTENTION_KINDS)
        parts = ", ".join(n for n, _ in hf_layer.named_children())
        what = f"is {self.kind}" if self.kind not in _ATTENTION_KINDS else \
            f"has no attention module the adapter knows (its parts: {parts})"
        raise TypeError(f"layer {self.index} ({type(hf_layer).__name__}) {what}: the adapter runs attention "
                        f"(self_attn) of the kinds {kinds}, and the token mixers {', '.join(_MIXERS)}")

    # --- attention ---------------------------------------------------------------------------------
    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        return branch if self.residual_scale == 1.0 else branch * self.residual_scale

    def _sublayer(self, att: _Attention, hidden: torch.Tensor, seq: SeqInfo, prefix: Optional[KV]
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, one attention within each request (after its prefix), residual: ``(resid, k, v)``."""
        x = att.norm(hidden)
        outs, ks, vs = [], [], []
        for start, n, pstart, p in _requests(seq):
            out, k, v = att.attend(x[start:start + n], p, _rows(prefix, pstart, p))
            outs.append(out)
            ks.append(k)
            vs.append(v)
        resid = hidden + self._scaled(att.out_norm(torch.cat(outs))) if outs else hidden.clone()
        return resid, _pack(ks, att.k_shape, hidden), _pack(vs, att.v_shape, hidden)

    def _mix(self, x: torch.Tensor) -> torch.Tensor:
        return _first(self.mixer(hidden_states=x[None]))[0]

    def attention(self, hidden: torch.Tensor, seq: SeqInfo, prefix: Optional[KV] = None
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Norm, the token mixer within each request (after its prefix), residual: ``(resid, k, v)``.

        ``k``, ``v`` are packed ``[tokens, *k_shape]``, ``[tokens, *v_shape]``; None on a layer that
        is not attention."""
        self._check(hidden, seq, prefix)
        if self.is_attention:
            return self._sublayer(self.attns[0], hidden, seq, prefix)
        x = self.input_norm(hidden)
        outs = [self._mix(x[start:start + n]) for start, n, _, _ in _requests(seq)]
        return (hidden + self._scaled(self.attn_out_norm(torch.cat(outs))) if outs else hidden.clone()), None, None

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
        """The per-token shapes of the keys and values this layer caches (one token through its attention;
        a layer of several attentions caches theirs side by side, along the first axis)."""
        for att in self.attns:
            att.probe(dtype, device, hidden)
        first = self.attns[0]
        if any(a.k_shape[1:] != first.k_shape[1:] or a.v_shape[1:] != first.v_shape[1:] for a in self.attns):
            raise TypeError(f"layer {self.index}: its attentions cache keys / values of different shapes")
        self.k_shape = (sum(a.k_shape[0] for a in self.attns),) + first.k_shape[1:]
        self.v_shape = (sum(a.v_shape[0] for a in self.attns),) + first.v_shape[1:]
        self._heads, k, v = [], 0, 0
        for a in self.attns:
            self._heads.append(((k, k + a.k_shape[0]), (v, v + a.v_shape[0])))
            k, v = k + a.k_shape[0], v + a.v_shape[0]
        return self.k_shape, self.v_shape

    def cached_kv(self, cache: Any, n: int) -> Optional[KV]:
        """This layer's last ``n`` keys and values in the model's own cache, packed (None if it kept fewer)."""
        parts = [a.cached(cache, n) for a in self.attns]
        if any(p is None for p in parts):
            return None
        return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)

    # --- feed-forward --------------------------------------------------------------------------------
    def _ffn(self) -> nn.Module:
        return self.moe if self.is_moe else self.mlp

    def _call_ffn(self, x: torch.Tensor) -> torch.Tensor:
        # transformers blocks take [batch, tokens, hidden]; some return [tokens, hidden] (Llama 4)
        return _first(self._ffn()(x[None])).reshape(x.shape)

    def ffn_operations(self, decode_chunks: Optional[int] = None) -> List[Operation]:
        """The operations from ``MOE_IN`` to ``MOE_OUT``: the EP layer's stages (its decode stages with
        ``decode_chunks``: `launch.models.common.module_stages`), or one call of the block."""
        staged = module_stages(self._ffn(), decode_chunks)
        if staged is not None:
            return staged
        return [Operation("moe" if self.is_moe else "mlp", self._call_ffn, (MOE_IN,), (MOE_OUT,))]

    def _residual(self, resid: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        return resid + self._scaled(self.ffn_out_norm(branch))

    def _after_attention(self, decode_chunks: Optional[int] = None) -> List[Operation]:
        """From ``resid`` (and ``HIDDEN``, on a parallel layer) to ``OUT``: the FFN's norm, the FFN, the residual."""
        residual = torch.add if self.residual_scale == 1.0 and not self._sandwich else self._residual
        return ([Operation("ffn_norm", self.ffn_norm, (HIDDEN if self.parallel else "resid",), (MOE_IN,))]
                + self.ffn_operations(decode_chunks)
                + [Operation("residual", residual, ("resid", MOE_OUT), (OUT,))])

    def operations(self) -> List[Operation]:
        """This layer as operations, from ``HIDDEN``, ``SEQ``, ``PREFIX_KV`` to ``OUT`` (and ``K``, ``V``)."""
        mix = (Operation("attn", self.attention, (HIDDEN, SEQ, PREFIX_KV), ("resid", K, V)) if self.is_attention
               else Operation("attn", self._mixer_op, (HIDDEN, SEQ, PREFIX_KV), ("resid",)))
        return [mix] + self._after_attention()

    # --- decode ------------------------------------------------------------------------------------
    def decode_refusal(self) -> Optional[str]:
        """Why this layer cannot decode from the KV cache (None: it can)."""
        if not self.is_attention:
            return (f"layer {self.index} is {self.kind}: it keeps a state between tokens, not keys and values a KV "
                    f"cache holds")
        reason = self.attns[0].decode_refusal()
        return None if reason is None else f"layer {self.index}: {reason}"

    def decode_attention(self, hidden: torch.Tensor, step: KVStep) -> torch.Tensor:
        """Decode: ``hidden [requests, hidden]``, one new token per request; one call of the family's attention for
        all of them over their history in the cache, their keys and values written there; ``resid``."""
        rows = step.rows
        if hidden.shape[0] != len(rows.slots) or any(n != 1 for n in rows.seq_lens):
            raise ValueError(f"layer {self.index}: a decode step takes one token per request, got {hidden.shape[0]} "
                             f"tokens for rows {rows.seq_lens}")
        if not rows.slots:  # an idle rank's empty micro-batch
            return hidden.clone()
        att = self.attns[0]
        out, k, v = att.decode(att.norm(hidden), step, self.index)
        step.cache.write(self.index, rows, k, v)
        return hidden + self._scaled(att.out_norm(out))

    def decode_operations(self, chunks: int = 1) -> List[Operation]:
        """This layer for a decode step, from ``HIDDEN`` and ``KV_STEP`` to ``OUT``: the cached attention, then what
        `operations` runs after attention, an expert-parallel MoE's decode stages (its routed experts in
        ``chunks``). ValueError where it cannot (`decode_refusal`)."""
        reason = self.decode_refusal()
        if reason is not None:
            raise ValueError(f"cannot decode: {reason}")
        return ([Operation("attn", self.decode_attention, (HIDDEN, KV_STEP), ("resid",))]
                + self._after_attention(chunks))

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


class ShortcutLayer(TransformersLayer):
    """A LongCat-Flash layer (shortcut-connected MoE): two attention sublayers, each with a dense MLP, and a MoE
    that reads the first MLP's input and is added to the layer's output::

        resid  = x + attn0(ln0(x));            moe_in = post_ln0(resid)
        resid1 = resid + mlp0(moe_in)          (beside the MoE, which reads moe_in)
        resid2 = resid1 + attn1(ln1(resid1));  resid3 = resid2 + mlp1(post_ln1(resid2))
        out    = resid3 + moe(moe_in)

    As operations the first MLP and the second attention follow the MoE's first exchange, the second MLP its
    second, so they run while the tokens travel. ``K`` / ``V`` hold both attentions' keys / values side by
    side; they are written by the second attention, so a request is never cut across micro-batches (a later
    part's first attention would wait for the earlier part's second)."""

    NO_CUT = ("its layers attend twice, the second time after the MoE's dispatch, so a cut request's later part "
              "could not start before the earlier part's layer ended: requests are not cut across micro-batches")

    def _find_parts(self, hf_layer: nn.Module, config: Any) -> set:
        lists = {n: getattr(hf_layer, n, None) for n in ("self_attn", *_NORMS, "mlps")}
        if not all(isinstance(m, nn.ModuleList) and len(m) == 2 for m in lists.values()) \
                or not isinstance(getattr(hf_layer, "mlp", None), nn.Module):
            raise TypeError(f"layer {self.index} ({type(hf_layer).__name__}) is not a shortcut-MoE layer of two "
                            f"attentions (self_attn, input_layernorm, post_attention_layernorm and mlps: two each) "
                            f"and a MoE (mlp)")
        if self.kind not in _ATTENTION_KINDS:
            raise TypeError(f"layer {self.index} ({type(hf_layer).__name__}) is {self.kind}, not attention")
        norms_in, norms_ffn = hf_layer.input_layernorm, hf_layer.post_attention_layernorm
        self.attns = [self._attention(hf_layer.self_attn[i], norms_in[i], config) for i in range(2)]
        self.input_norm, self.ffn_norm, self.ffn_norm1 = norms_in[0], norms_ffn[0], norms_ffn[1]
        self.dense0, self.dense1 = hf_layer.mlps[0], hf_layer.mlps[1]
        self._set_ffn(hf_layer.mlp, None)
        return {*lists, "mlp"}

    def attention(self, hidden: torch.Tensor, seq: SeqInfo, prefix: Optional[KV] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first attention sublayer: ``(resid, k0, v0)``."""
        self._check(hidden, seq, prefix)
        return self._sublayer(self.attns[0], hidden, seq, _split_heads(prefix, self._heads, 0))

    def second_attention(self, hidden: torch.Tensor, seq: SeqInfo, prefix: Optional[KV], k0: torch.Tensor,
                         v0: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The second attention sublayer: ``(resid2, k, v)``, the keys / values of both sublayers side by side."""
        resid, k1, v1 = self._sublayer(self.attns[1], hidden, seq, _split_heads(prefix, self._heads, 1))
        return resid, torch.cat([k0, k1], dim=1), torch.cat([v0, v1], dim=1)

    def decode_refusal(self) -> Optional[str]:
        return (f"layer {self.index} attends twice (LongCat-Flash's shortcut layer, the second time under the MoE "
                f"exchange): a decode step runs one attention per layer")

    def _dense0(self, resid: torch.Tensor, moe_in: torch.Tensor) -> torch.Tensor:
        return resid + self.dense0(moe_in)

    def _dense1(self, resid: torch.Tensor) -> torch.Tensor:
        return resid + self.dense1(self.ffn_norm1(resid))

    def operations(self) -> List[Operation]:
        moe = self.ffn_operations()
        comm = [i for i, op in enumerate(moe) if op.stream == EP_COMM]
        first = second = len(moe)
        if comm:  # after the dispatch (its count exchange and tokens, where it has two steps), then the combine
            first = comm[0] + 1
            while first < len(moe) and moe[first].stream == EP_COMM:
                first += 1
            second = next((i + 1 for i in comm if i >= first), len(moe))
            if second == len(moe):
                first = len(moe)
        under_dispatch = [Operation("dense0", self._dense0, ("resid", MOE_IN), ("resid1",)),
                          Operation("attn1", self.second_attention, ("resid1", SEQ, PREFIX_KV, "k0", "v0"),
                                    ("resid2", K, V))]
        under_combine = [Operation("dense1", self._dense1, ("resid2",), ("resid3",))]
        return ([Operation("attn", self.attention, (HIDDEN, SEQ, PREFIX_KV), ("resid", "k0", "v0")),
                 Operation("ffn_norm", self.ffn_norm, ("resid",), (MOE_IN,))]
                + moe[:first] + under_dispatch + moe[first:second] + under_combine + moe[second:]
                + [Operation("residual", torch.add, ("resid3", MOE_OUT), (OUT,))])


def _layer_class(hf_layer: nn.Module) -> type:
    return ShortcutLayer if isinstance(getattr(hf_layer, "self_attn", None), nn.ModuleList) else TransformersLayer


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
    field = first_field(config, SHARED_COUNTS)
    if field is not None:
        return int(getattr(config, field) or 0)
    size = next((getattr(config, f, 0) for f in ("shared_expert_intermediate_size", "shared_intermediate_size")
                 if hasattr(config, f)), 0) or 0
    return 1 if size else 0


class TransformersModel(nn.Module):
    """A transformers causal LM as a `microbatch.model.MoEModel`, as the reference decoder is: ``embed_tokens``,
    ``layers`` and their operations, ``norm``, the family's ``lm_head`` (`logits`).

    ``hf`` is the model itself (its MoE blocks stay in place for `reference`); `replace_moe` swaps
    the adapter's blocks only. ``no_cut_reason`` is None when a cut request's later parts can attend
    to its earlier parts' keys and values (every layer is attention, one at a time), else why not.
    The model's ``embedding_multiplier`` and ``logits_scaling`` (Granite) are applied as its forward does.
    ``no_capture_reason``: its decode steps are not captured (its attention reads the cache in its own modules).
    """

    no_capture_reason: Optional[str] = ("GraphDecoder runs the reference decoder (its attention goes through the "
                                        "step's attend), not a TransformersModel")

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        impl = getattr(hf_model.config, "_attn_implementation", None)
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"the adapter passes explicit attention masks: use attn_implementation 'sdpa' or "
                             f"'eager', not {impl!r}")
        self.hf = hf_model.eval()
        config = hf_model.config
        self.final_norm = _child(hf_model.model, _FINAL_NORMS)[1]
        self.embed_scale = _number(config, "embedding_multiplier") or 1.0
        self.logits_scale = _number(config, "logits_scaling") or 1.0
        self.layers = nn.ModuleList(_layer_class(hf_model.model.layers[i])(hf_model, i)
                                    for i in range(len(hf_model.model.layers)))
        self.cfg = self._config()
        self.no_cut_reason = self._no_cut_reason()

    def _no_cut_reason(self) -> Optional[str]:
        mixers = [f"{layer.index} ({layer.kind})" for layer in self.layers if not layer.is_attention]
        if mixers:
            return (f"{self.cfg.model_type} layers {', '.join(mixers)} keep no keys and values to continue a "
                    f"request from, so requests are not cut across micro-batches")
        if any(isinstance(layer, ShortcutLayer) for layer in self.layers):
            return f"{self.cfg.model_type}: {ShortcutLayer.NO_CUT}"
        return None

    def _config(self) -> TransformersConfig:
        c = self.hf.config
        attention = [layer for layer in self.layers if layer.is_attention]
        weight = self.hf.model.embed_tokens.weight
        shapes = [layer.probe_kv_shapes(weight.dtype, weight.device, c.hidden_size) for layer in attention]
        k_shape, v_shape = shapes[0] if shapes else ((), ())
        experts = first_field(c, EXPERT_COUNTS)
        return TransformersConfig(
            model_type=c.model_type, vocab=c.vocab_size, n_layers=len(self.layers), hidden=c.hidden_size,
            n_heads=c.num_attention_heads, n_experts=int(getattr(c, experts, 0) or 0) if experts else 0,
            top_k=int(getattr(c, "num_experts_per_tok", 0) or 0), n_shared=_n_shared(c),
            moe_layers=tuple(layer.index for layer in self.layers if layer.is_moe),
            attention_layers=tuple(layer.index for layer in attention), k_shape=k_shape, v_shape=v_shape)

    # --- what launch.runner uses -------------------------------------------------------------------
    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embedding of token ids; their range is checked on the host, except while compiling."""
        check_token_ids(tokens, self.cfg.vocab)
        embedded = self.hf.model.embed_tokens(tokens)
        return embedded if self.embed_scale == 1.0 else embedded * self.embed_scale

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The family's final norm of the last layer's output."""
        return self.final_norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states, by the family's ``lm_head`` (and its ``logits_scaling``)."""
        out = self.hf.lm_head(hidden)
        return out if self.logits_scale == 1.0 else out / self.logits_scale

    def moe_layers(self) -> Iterator[TransformersLayer]:
        return (layer for layer in self.layers if layer.is_moe)

    def replace_moe(self, make: Callable[[TransformersLayer], nn.Module]) -> None:
        """Set each MoE layer's ``moe`` to ``make(layer)`` (the transformers model keeps its own block)."""
        for layer in self.moe_layers():
            layer.moe = make(layer)

    def layer_operations(self) -> List[List[Operation]]:
        """Every layer's operations, for the pipeline executor (``microbatch.run``)."""
        return [layer.operations() for layer in self.layers]

    def decode_layer_operations(self, chunks: int = 1) -> List[List[Operation]]:
        """Every layer's operations for a decode step (`TransformersLayer.decode_operations`, the routed experts of
        expert-parallel layers in ``chunks``); a ValueError of one
        line naming the layers a decode cannot run (a hybrid's linear attention, LongCat-Flash's two attentions),
        raised before any operation runs."""
        refused = [r for r in (layer.decode_refusal() for layer in self.layers) if r is not None]
        cfg = self.cfg
        refused += [f"layer {layer.index} caches keys / values of {layer.k_shape} / {layer.v_shape}, layer "
                    f"{cfg.attention_layers[0]} of {cfg.k_shape} / {cfg.v_shape}: one KV cache holds one shape"
                    for layer in self.layers
                    if layer.is_attention and (layer.k_shape, layer.v_shape) != (cfg.k_shape, cfg.v_shape)]
        if refused:
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            raise ValueError(f"{cfg.model_type}: {refused[0]}{more}")
        return [layer.decode_operations(chunks) for layer in self.layers]

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
    def forward_microbatches(self, batch: Batch, plan: Split) -> torch.Tensor:
        """The plan's micro-batches layer by layer, without overlap (`microbatch.forward.forward_layer_by_layer`;
        a plan that cuts a request is refused when the model cannot continue one, ``no_cut_reason``)."""
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

    @torch.no_grad()
    def own_generate(self, prompts: Sequence[Sequence[int]], new_tokens: int,
                     stop_token: Optional[int] = None) -> List[List[int]]:
        """Each prompt's greedy continuation by the model's own ``generate`` (each prompt alone: its own cache,
        masks and positions), at most ``new_tokens`` long, cut after ``stop_token``: the reference for
        `launch.decode.greedy_generate`, in its shape. Only greedy argmax steers it: the model's generation config
        (its eos and pad tokens, minimum length, penalties, ...) is left out. It runs the model's own blocks, so
        call it where they hold every expert (before a loader's expert-parallel shard; one rank)."""
        from transformers import GenerationConfig

        if new_tokens < 1:
            raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=new_tokens, min_new_tokens=0,
                                  eos_token_id=stop_token, pad_token_id=0 if stop_token is None else stop_token,
                                  repetition_penalty=1.0, no_repeat_ngram_size=0, use_cache=True)
        device = self.hf.model.embed_tokens.weight.device
        own, self.hf.generation_config = self.hf.generation_config, GenerationConfig()  # its defaults fill nothing
        try:
            out = []
            for prompt in prompts:
                ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
                check_token_ids(ids, self.cfg.vocab)
                new = self.hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
                tokens = new[0, ids.shape[1]:].tolist()
                if stop_token in tokens:
                    tokens = tokens[:tokens.index(stop_token) + 1]
                out.append(tokens)
            return out
        finally:
            self.hf.generation_config = own

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
                held = self.layers[i].cached_kv(cache, t.shape[0])
                if held is None:
                    raise ValueError(f"layer {i} keeps only its sliding window or chunk in the model's own cache; "
                                     f"compare requests that fit in it")
                per_layer[i].append(held)
        return {i: (torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv])) for i, kv in per_layer.items() if kv}

