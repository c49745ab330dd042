"""The reference model: a small DeepSeek-style decoder over packed variable-length requests.

Embedding, then per layer RMSNorm + causal self-attention (each request attends only to itself,
plus its prefix when a micro-batch split cut it) and RMSNorm + MLP (dense for the first
``n_dense_layers``, the MoE block of ``collectives.reference`` after), then a final RMSNorm, and
an LM head (`Model.logits`: its own weight, or the embedding's with ``cfg.tie_embeddings``).
Serial prefill of it (`Model.forward`) is the reference for every other mode. It implements
`microbatch.model.MoEModel`, as the transformers adapter does.

Each decoder layer is also a list of operations (`DecoderLayer.operations`) for the pipeline
executor. A layer reads the executor's ``HIDDEN`` ([tokens, hidden] of one micro-batch) and two
context values of the micro-batch (named in `microbatch.batch`): ``SEQ``, its `SeqInfo` (request
lengths and, for a cut request, its prefix length), and ``PREFIX_KV``, ``(k, v)`` of the prefix
tokens at this layer or None. It
writes the executor's ``OUT`` (the layer output) and ``K``, ``V`` ([tokens, heads, head_dim], keys
after the rotary embedding), for the later micro-batches' prefix and KV offload. In between:
``"attn"`` writes ``"resid"``, ``K``, ``V``; ``"ffn_norm"`` writes the MoE's input (``MOE_IN``);
the MoE operations (or the dense ``"mlp"``) write ``MOE_OUT``; ``"residual"`` writes ``OUT``.
Replace ``layer.moe`` (see `Model.replace_moe`) with a module that has ``stages()`` and its
stages become the layer's MoE operations.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

import overlap
from collectives import MOE_IN, MOE_OUT
from collectives.reference import MoE, Expert
from microbatch import HIDDEN, OUT, Operation, Split, State
from microbatch.batch import K, KV_STEP, PREFIX_KV, SEQ, V, Batch, SeqInfo
from microbatch.kv_cache import KVStep
from microbatch.forward import forward_layer_by_layer
from microbatch.model import KV

from .common import check_token_ids, module_stages, param_seed
from .presets import ModelConfig

__all__ = ["DecoderLayer", "Model", "RMSNorm", "build_model", "init_weights"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables ``(cos, sin)`` of ``positions [tokens]``, each ``[tokens, 1, head_dim]`` float32 (both
    halves alike), shared by a layer's queries and keys (`rope`), and in a decode step by every layer
    (`microbatch.KVStep.once`)."""
    half = head_dim // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32, device=positions.device) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    return angles.cos(), angles.sin()


def rope(x: torch.Tensor, tables: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary embedding of ``x`` [tokens, heads, head_dim] (rotate-half layout), in float32:
    ``(x1 cos - x2 sin, x2 cos + x1 sin)`` for the halves ``x1, x2``: ``x`` times cos plus ``x`` with its halves
    swapped (the first negated) times sin."""
    cos, sin = tables
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One request: q [Lq, H, D] are the last Lq of the Lk positions in k, v [Lk, H, D]."""
    lq, lk = q.shape[0], k.shape[0]
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    if lq == lk:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:  # causal mask aligned to the bottom right: query i sees keys up to lk - lq + i
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(0, 1)


class DecoderLayer(nn.Module):
    """RMSNorm + attention + residual, RMSNorm + MLP/MoE + residual; also a list of operations."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.cfg, self.index = cfg, index
        inner = cfg.n_heads * cfg.head_dim
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.q_proj = nn.Linear(cfg.hidden, inner, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, inner, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, inner, bias=False)
        self.o_proj = nn.Linear(inner, cfg.hidden, bias=False)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.is_moe = cfg.is_moe_layer(index)
        if self.is_moe:
            self.moe: nn.Module = MoE(cfg.moe_config())
        else:
            self.mlp = Expert(cfg.hidden, cfg.dense_ffn)

    def attention(self, hidden: torch.Tensor, seq: SeqInfo, prefix: Optional[KV] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, attention within each request (after its prefix), residual: ``(resid, k, v)``."""
        if hidden.shape[0] != seq.num_tokens:
            raise ValueError(f"layer {self.index}: hidden has {hidden.shape[0]} rows, seq has {seq.num_tokens} tokens")
        n_prefix = seq.num_prefix_tokens
        if n_prefix and (prefix is None or prefix[0].shape[0] != n_prefix or prefix[1].shape[0] != n_prefix):
            got = "none" if prefix is None else f"{prefix[0].shape[0]}/{prefix[1].shape[0]} rows"
            raise ValueError(f"layer {self.index}: seq has {n_prefix} prefix tokens but prefix_kv has {got}")
        t, h, d = hidden.shape[0], self.cfg.n_heads, self.cfg.head_dim
        x = self.attn_norm(hidden)
        q, k, v = (proj(x).view(t, h, d) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.cfg.rope_theta is not None:
            tables = rope_tables(seq.positions(hidden.device), d, self.cfg.rope_theta)
            q, k = rope(q, tables), rope(k, tables)
        out = torch.empty_like(q)
        start = pstart = 0
        for n, p in zip(seq.seq_lens, seq.prefix_lens):
            ki, vi = k[start:start + n], v[start:start + n]
            if p:
                ki = torch.cat([prefix[0][pstart:pstart + p], ki])
                vi = torch.cat([prefix[1][pstart:pstart + p], vi])
            if n:
                out[start:start + n] = _causal_attention(q[start:start + n], ki, vi)
            start, pstart = start + n, pstart + p
        return hidden + self.o_proj(out.reshape(t, h * d)), k, v

    def decode_attention(self, hidden: torch.Tensor, step: KVStep) -> torch.Tensor:
        """Decode: ``hidden [requests, hidden]``, one new token per request; its keys and values go into the
        cache and every request attends to its whole history there at once (`KVStep.attend`); ``resid``."""
        t, h, d = hidden.shape[0], self.cfg.n_heads, self.cfg.head_dim
        x = self.attn_norm(hidden)
        q, k, v = (proj(x).view(t, h, d) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.cfg.rope_theta is not None:
            theta = self.cfg.rope_theta
            tables = step.once(("rope", d, theta), lambda: rope_tables(step.positions, d, theta))
            q, k = rope(q, tables), rope(k, tables)
        return hidden + self.o_proj(step.attend(self.index, q, k, v).reshape(t, h * d))

    def decode_operations(self, chunks: int = 1) -> List[Operation]:
        """This layer for a decode step, from ``HIDDEN`` and ``KV_STEP`` to ``OUT``: `operations` with the
        cached attention, and an expert-parallel MoE's decode stages (its routed experts in ``chunks``)."""
        return ([Operation("attn", self.decode_attention, (HIDDEN, KV_STEP), ("resid",))]
                + self._after_attention(chunks))

    def _after_attention(self, decode_chunks: Optional[int] = None) -> List[Operation]:
        """From ``resid`` to ``OUT``: the norm, the MLP or MoE, the residual."""
        return ([Operation("ffn_norm", self.ffn_norm, ("resid",), (MOE_IN,))] + self.ffn_operations(decode_chunks)
                + [Operation("residual", torch.add, ("resid", MOE_OUT), (OUT,))])

    def _ffn(self) -> nn.Module:
        return self.moe if self.is_moe else self.mlp

    def ffn_operations(self, decode_chunks: Optional[int] = None) -> List[Operation]:
        """The operations from ``MOE_IN`` to ``MOE_OUT``: the MoE's stages (its decode stages with
        ``decode_chunks``: `launch.models.common.module_stages`), or one call of it."""
        staged = module_stages(self._ffn(), decode_chunks)
        if staged is not None:
            return staged
        return [Operation("moe" if self.is_moe else "mlp", self._ffn(), (MOE_IN,), (MOE_OUT,))]

    def operations(self) -> List[Operation]:
        """This layer as operations, from ``HIDDEN``, ``SEQ``, ``PREFIX_KV`` to ``OUT``, ``K``, ``V``."""
        return [Operation("attn", self.attention, (HIDDEN, SEQ, PREFIX_KV), ("resid", K, V))] + self._after_attention()

    def run(self, hidden: torch.Tensor, seq: SeqInfo, prefix: Optional[KV] = None, **meta: Any
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the operations in order on the current stream: ``(out, k, v)``; ``meta`` labels the spans."""
        state = State({HIDDEN: hidden, SEQ: seq, PREFIX_KV: prefix})
        for op in self.operations():
            with overlap.span(op.name, layer=self.index, **meta):
                op.run(state)
        return state[OUT], state[K], state[V]

    def forward(self, hidden: torch.Tensor, seq: SeqInfo, prefix: Optional[KV] = None) -> torch.Tensor:
        return self.run(hidden, seq, prefix)[0]


class Model(nn.Module):
    """Embedding, `DecoderLayer` x n_layers, final RMSNorm; returns the final hidden states; `logits` is its LM head.

    A `microbatch.model.MoEModel`: every layer is attention, so a cut request's later part always
    continues from its earlier parts (``no_cut_reason`` None).
    """

    no_cut_reason: Optional[str] = None
    no_capture_reason: Optional[str] = None  # its attention goes through the decode step's attend

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # built on the meta device and then filled by `init_weights` (`build_model`): given its weight, the
        # embedding skips its own normal_ init, which on meta imports Dynamo (over a second of CPU a process)
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden, _weight=torch.empty(cfg.vocab, cfg.hidden))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embedding of token ids; their range is checked on the host, except while compiling (no host reads)."""
        check_token_ids(tokens, self.cfg.vocab)
        return self.embed(tokens)

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of the last layer's output."""
        return self.final_norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [tokens, vocab] of final hidden states: the LM head's weight, or the embedding's when tied."""
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    def moe_layers(self) -> Iterator[DecoderLayer]:
        return (layer for layer in self.layers if layer.is_moe)

    def replace_moe(self, make: Callable[[DecoderLayer], nn.Module]) -> None:
        """Set each MoE layer's ``moe`` to ``make(layer)`` (e.g. an expert-parallel layer built from ``layer.moe``)."""
        for layer in self.moe_layers():
            layer.moe = make(layer)

    @torch.no_grad()
    def forward(self, batch: Batch, kv_sink: Optional[Callable[[int, torch.Tensor, torch.Tensor], None]] = None
                ) -> torch.Tensor:
        """Serial prefill of the whole batch: final hidden states [tokens, hidden].

        ``kv_sink(layer, k, v)`` receives every layer's keys and values as they are produced.
        """
        hidden = self.embed_tokens(batch.tokens)
        for layer in self.layers:
            hidden, k, v = layer.run(hidden, batch.seq, None)
            if kv_sink is not None:
                kv_sink(layer.index, k, v)
        return self.norm(hidden)

    @torch.no_grad()
    def forward_microbatches(self, batch: Batch, split: Split) -> torch.Tensor:
        """Prefill as the split's micro-batches, layer by layer (mb0, mb1, ...), without overlap.

        A cut request's later part attends to its earlier parts' keys and values of the same
        layer. The result equals `forward` up to rounding; a serial split runs `forward`
        (`microbatch.forward.forward_layer_by_layer`).
        """
        return forward_layer_by_layer(self, batch, split)

    def layer_operations(self) -> List[List[Operation]]:
        """Every layer's operations, for the pipeline executor (``microbatch.run``)."""
        return [layer.operations() for layer in self.layers]

    def decode_layer_operations(self, chunks: int = 1) -> List[List[Operation]]:
        """Every layer's operations for a decode step (`DecoderLayer.decode_operations`)."""
        return [layer.decode_operations(chunks) for layer in self.layers]


@torch.no_grad()
def init_weights(module: nn.Module, seed: int, prefix: str = "") -> None:
    """Fill every parameter from a generator seeded by ``(seed, prefix + its name)``.

    A parameter's values depend only on the seed, its full name and shape: not on the world
    size, the device, or which other parameters exist, so a module holding only some experts
    (named as in the dense model) gets the same values as the dense model. RMSNorm weights are
    ones, the embedding N(0, 1), matrices N(0, 1/fan_in) (the LM head's too), biases zero; drawn in
    float32 on the CPU.
    """
    for mod_name, mod in module.named_modules():
        for name, param in mod.named_parameters(recurse=False):
            full = prefix + (f"{mod_name}.{name}" if mod_name else name)
            if isinstance(mod, RMSNorm):
                values = torch.ones(param.shape)
            elif param.dim() == 1:
                values = torch.zeros(param.shape)
            else:
                gen = torch.Generator().manual_seed(param_seed(seed, full))
                std = 1.0 if isinstance(mod, nn.Embedding) else param.shape[-1] ** -0.5
                values = torch.randn(param.shape, generator=gen) * std
            param.copy_(values)


def build_model(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: Union[torch.device, str] = "cpu") -> Model:
    """The model of ``cfg`` with weights from ``seed`` (bitwise the same on every rank), for inference."""
    with torch.device("meta"):
        model = Model(cfg).to(dtype)
    for mod in model.modules():  # storage on ``device``; not `to_empty`, whose empty_like of a meta tensor imports
        for name, param in list(mod.named_parameters(recurse=False)):  # torch's symbolic shapes (0.4 s a process)
            setattr(mod, name, nn.Parameter(param.new_empty(param.shape, device=device)))
        for name, buf in list(mod.named_buffers(recurse=False)):  # none today; moved as `to_empty` would
            setattr(mod, name, buf.new_empty(buf.shape, device=device))
    init_weights(model, seed)
    return model.requires_grad_(False).eval()
