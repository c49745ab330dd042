"""A Hugging Face transformers MoE causal LM as the toolkit's model: the same schedules, EP and KV offload.

`from_config` builds the model of a family's config (``deepseek_v3``, ``qwen3_moe``, ``gpt_oss``,
``llama4_text``, ``longcat_flash``, ...) with seeded weights and adapts it; `adapt` wraps a model
the user already has. Which families it runs, and their configs made small, are `families`. The
adapter (`TransformersModel`) implements the model contract `microbatch.model.MoEModel` and
`microbatch.DecodeModel`, as the reference decoder does, with the same value names (`microbatch.batch`):
its layers are `layers`' operations over the parts `discovery` finds, its ``logits`` the family's
``lm_head``. What it reads of the config's shapes is `TransformersConfig` (the field names: `fields`).

Layers that are not attention (a hybrid model's linear-attention layers) keep no keys or values: such
a model cannot continue a request from a prefix, so its batches are split at request boundaries only
(`TransformersModel.no_cut_reason`). The comparisons with the family's own forward and generate
(`adapt(check=True)`, `TransformersModel.reference`, `own_generate`) are `checks`.

transformers is imported only inside the functions here.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from microbatch import Operation, Split
from microbatch.batch import Batch
from microbatch.forward import forward_layer_by_layer
from microbatch.model import KV

from ..common import check_token_ids, param_seed
from . import checks
from .attention import INDEXED
from .discovery import check_model_parts, final_norm, is_shortcut, layer_kind, multiplier
from .fields import expert_count, shared_count, top_k
from .indexed import IndexedLayer, not_as_operations
from .layers import ShortcutLayer, TransformersLayer

__all__ = ["TransformersConfig", "TransformersModel", "adapt", "attention_for", "from_config", "seed_weights"]


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

    With ``check``, a few tokens through the adapter must give what the model's own forward gives
    (`checks.check_against_own_forward`): a family whose layers do more than the adapter runs (a
    residual multiplier the layer does not name, an embedding scale) raises TypeError here instead of
    computing something else later.
    """
    check_model_parts(hf_model)
    model = TransformersModel(hf_model)
    if check:
        model.check_against_own_forward()
    return model


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
        self.final_norm = final_norm(hf_model.model)
        self.embed_scale = multiplier(config, "embedding_multiplier")
        self.logits_scale = multiplier(config, "logits_scaling")
        self.layers = nn.ModuleList(_layer_class(hf_model, i)(hf_model, i) for i in range(len(hf_model.model.layers)))
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

    @property
    def indexer_stream(self) -> bool:
        """Whether the sparse-attention layers run their indexer as an operation on `overlap.INDEXER`
        (`IndexedLayer`); False: the family's attention module as one operation."""
        return all(layer.indexer_stream for layer in self.layers if isinstance(layer, IndexedLayer))

    @indexer_stream.setter
    def indexer_stream(self, on: bool) -> None:
        for layer in self.layers:
            if isinstance(layer, IndexedLayer):
                layer.indexer_stream = bool(on)

    def _config(self) -> TransformersConfig:
        c = self.hf.config
        attention = [layer for layer in self.layers if layer.is_attention]
        weight = self.hf.model.embed_tokens.weight
        shapes = [layer.probe_kv_shapes(weight.dtype, weight.device, c.hidden_size) for layer in attention]
        k_shape, v_shape = shapes[0] if shapes else ((), ())
        return TransformersConfig(
            model_type=c.model_type, vocab=c.vocab_size, n_layers=len(self.layers), hidden=c.hidden_size,
            n_heads=c.num_attention_heads, n_experts=expert_count(c), top_k=top_k(c), n_shared=shared_count(c),
            moe_layers=tuple(layer.index for layer in self.layers if layer.is_moe),
            attention_layers=tuple(layer.index for layer in attention), k_shape=k_shape, v_shape=v_shape)

    # --- what launch.engine uses -------------------------------------------------------------------
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
        line naming the layers a decode cannot run (a hybrid's linear attention, layers caching other shapes),
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
    def forward_microbatches(self, batch: Batch, split: Split) -> torch.Tensor:
        """The split's micro-batches layer by layer, without overlap (`microbatch.forward.forward_layer_by_layer`;
        a split that cuts a request is refused when the model cannot continue one, ``no_cut_reason``)."""
        return forward_layer_by_layer(self, batch, split)


    # --- the family's own forward and generate (`checks`) --------------------------------------------
    def check_against_own_forward(self, n_tokens: int = 4, rtol: float = 1e-2) -> float:
        """Largest difference between the adapter's and the model's own forward on one short request; TypeError
        above ``rtol`` of the output's magnitude (`checks.check_against_own_forward`). Run it before
        `replace_moe`: the expert-parallel layer would exchange tokens with the other ranks."""
        return checks.check_against_own_forward(self, n_tokens, rtol)

    def own_generate(self, prompts: Sequence[Sequence[int]], new_tokens: int,
                     stop_token: Optional[int] = None) -> List[List[int]]:
        """Each prompt's greedy continuation by the model's own ``generate`` (`checks.own_generate`)."""
        return checks.own_generate(self, prompts, new_tokens, stop_token)

    def reference(self, batch: Batch) -> torch.Tensor:
        """Final hidden states by the model's own forward, each request on its own (`checks.own_forward`)."""
        return checks.own_forward(self, batch)

    def reference_kv(self, batch: Batch) -> Dict[int, KV]:
        """Each attention layer's keys and values, packed, from the cache of the model's own forward
        (`checks.own_kv`)."""
        return checks.own_kv(self, batch)


def _layer_class(hf_model: nn.Module, index: int) -> type:
    """A layer's class: `ShortcutLayer` (LongCat-Flash), `IndexedLayer` (DeepSeek sparse attention whose module has
    DeepSeek-V3.2's parts: `indexed.not_as_operations`) or `TransformersLayer`."""
    if is_shortcut(hf_model.model.layers[index]):
        return ShortcutLayer
    if layer_kind(hf_model.config, index) != INDEXED:
        return TransformersLayer
    module = getattr(hf_model.model.layers[index], "self_attn", None)
    rotary = getattr(hf_model.model, "rotary_emb", None)
    return TransformersLayer if module is None or not_as_operations(module, rotary) else IndexedLayer
