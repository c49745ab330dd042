"""A transformers decoder layer as the toolkit's operations (`microbatch.Operation`), for prefill and decode.

`TransformersLayer` runs each part the layer has (`discovery.find_parts`) with the family's own modules:

``attn``      input norm, then per request (batch 1, positions after the request's prefix) the
              family's attention module (`attention.Attention`); residual (times the layer's
              ``residual_multiplier``, Granite). Writes ``"resid"``, ``K``, ``V`` (packed
              ``[tokens, kv_heads, head_dim]``, in whatever layout the family caches). A layer whose
              token mixer is not attention (a hybrid's linear attention) runs it per request and
              writes no keys or values
``ffn_norm``  post-attention norm -> ``MOE_IN``
MoE / MLP     the expert-parallel layer's stages after `TransformersModel.replace_moe`, else the
              family's block (plus a ``shared_mlp`` beside it) as one operation -> ``MOE_OUT``
``residual``  -> ``OUT``

A LongCat-Flash layer (two attention sublayers, two dense MLPs and a shortcut MoE that reads the
first MLP's input and is added at the end) is `ShortcutLayer`: its MoE exchange runs under the first
MLP and the second attention, its keys and values are both sublayers' side by side.

Decode (`TransformersLayer.decode_operations`): ``attn`` reads ``HIDDEN`` (one new token per request)
and ``KV_STEP`` and calls the family's attention module once for every request of the step; the
operations after it are prefill's. A LongCat-Flash layer decodes as it prefills: its second cached
attention under the MoE's dispatch, each attention over its own half of the layer's cache. A layer that
is not attention (linear attention) says why it cannot decode (`TransformersLayer.decode_refusal`).

transformers is imported only inside the functions of `attention`.
"""
from __future__ import annotations

from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

import overlap
from collectives import MOE_IN, MOE_OUT
from microbatch import HIDDEN, OUT, Operation, State
from microbatch.batch import K, KV_STEP, PREFIX_KV, SEQ, V, SeqInfo
from microbatch.kv_cache import KVStep
from microbatch.model import KV
from overlap import EP_COMM

from ..common import module_stages
from .attention import Attention, first_output
from .discovery import find_parts, find_shortcut_parts, layer_kind, multiplier

__all__ = ["ShortcutLayer", "TransformersLayer", "packed_requests"]


def packed_requests(seq: SeqInfo) -> Iterator[Tuple[int, int, int, int]]:
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


class _Beside(nn.Module):
    """A layer's routed block and the shared MLP it adds beside it (Granite-MoE-Shared's ``shared_mlp``), summed:
    one block for `collectives.wrap_expert_parallel`, which finds the routed block in ``moe``."""

    def __init__(self, moe: nn.Module, name: str, shared: nn.Module):
        super().__init__()
        self.moe = moe
        self.add_module(name, shared)
        self._shared = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return first_output(self.moe(x)).reshape(x.shape) + getattr(self, self._shared)(x)


def _split_heads(prefix: Optional[KV], at: Sequence[Tuple[int, int]], i: int) -> Optional[KV]:
    """Sublayer ``i``'s part of a layer's packed keys / values (``at``: its key heads and value heads slices)."""
    if prefix is None:
        return None
    (k0, k1), (v0, v1) = at[i]
    return prefix[0][:, k0:k1], prefix[1][:, v0:v1]


class TransformersLayer(nn.Module):
    """One decoder layer of a transformers model as the toolkit's operations (see the module docstring)."""

    def __init__(self, hf_model: nn.Module, index: int):
        super().__init__()
        hf_layer, config = hf_model.model.layers[index], hf_model.config
        self.index, self.kind = index, layer_kind(config, index)
        self.residual_scale = multiplier(hf_layer, "residual_multiplier")  # Granite scales both branches
        self._rotary = getattr(hf_model.model, "rotary_emb", None)
        self.attns: List[Attention] = self._take_parts(hf_layer, config)
        self.is_attention = bool(self.attns)
        self.attn_index = self.attns[-1].index if self.attns else index
        self.window = self.attns[0].window if self.attns else None

    def _attention(self, module: nn.Module, norm: nn.Module, config: Any,
                   out_norm: Optional[nn.Module] = None) -> Attention:
        return Attention(module, norm, self.kind, config, self._rotary, self.index, out_norm)

    def _take_parts(self, hf_layer: nn.Module, config: Any) -> List[Attention]:
        """Hold the layer's parts (`discovery.find_parts`): its norms, token mixer and feed-forward block; its
        attentions. A layer with an input norm alone is parallel (Cohere): its feed-forward block reads the same
        normed input as its attention, and both are added to the layer's input."""
        parts = find_parts(hf_layer, self.kind, self.index)
        self.parallel = parts.parallel
        self.input_norm, self.attn_out_norm = parts.input_norm, parts.attn_out_norm
        self.ffn_norm, self.ffn_out_norm = parts.ffn_norm, parts.ffn_out_norm
        self._sandwich = parts.sandwich
        attns = [] if parts.attention is None else \
            [self._attention(parts.attention, self.input_norm, config, self.attn_out_norm)]
        self.mixer = parts.mixer
        self._set_ffn(parts.ffn if parts.beside is None else _Beside(parts.ffn, *parts.beside), parts.is_moe)
        return attns

    def _set_ffn(self, block: nn.Module, is_moe: bool) -> None:
        self.is_moe = is_moe
        if is_moe:
            self.moe: nn.Module = block
        else:
            self.mlp = block

    # --- attention ---------------------------------------------------------------------------------
    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        return branch if self.residual_scale == 1.0 else branch * self.residual_scale

    def _sublayer(self, att: Attention, hidden: torch.Tensor, seq: SeqInfo, prefix: Optional[KV]
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, one attention within each request (after its prefix), residual: ``(resid, k, v)``."""
        x = att.norm(hidden)
        outs, ks, vs = [], [], []
        for start, n, pstart, p in packed_requests(seq):
            out, k, v = att.attend(x[start:start + n], p, _rows(prefix, pstart, p))
            outs.append(out)
            ks.append(k)
            vs.append(v)
        resid = hidden + self._scaled(att.out_norm(torch.cat(outs))) if outs else hidden.clone()
        return resid, _pack(ks, att.k_shape, hidden), _pack(vs, att.v_shape, hidden)

    def _mix(self, x: torch.Tensor) -> torch.Tensor:
        return first_output(self.mixer(hidden_states=x[None]))[0]

    def attention(self, hidden: torch.Tensor, seq: SeqInfo, prefix: Optional[KV] = None
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Norm, the token mixer within each request (after its prefix), residual: ``(resid, k, v)``.

        ``k``, ``v`` are packed ``[tokens, *k_shape]``, ``[tokens, *v_shape]``; None on a layer that
        is not attention."""
        self._check(hidden, seq, prefix)
        if self.is_attention:
            return self._sublayer(self.attns[0], hidden, seq, prefix)
        x = self.input_norm(hidden)
        outs = [self._mix(x[start:start + n]) for start, n, _, _ in packed_requests(seq)]
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
        return first_output(self._ffn()(x[None])).reshape(x.shape)

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
        reason = next((r for r in (a.decode_refusal() for a in self.attns) if r is not None), None)
        return None if reason is None else f"layer {self.index}: {reason}"

    def _check_decodes(self) -> None:
        """ValueError naming why this layer cannot decode (`decode_refusal`), if it cannot."""
        reason = self.decode_refusal()
        if reason is not None:
            raise ValueError(f"cannot decode: {reason}")

    def _decode_sublayer(self, i: int, hidden: torch.Tensor, step: KVStep
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention ``i`` of a decode step (``hidden [requests, hidden]``, one new token per request), one call of the
        family's module for all of them over their history in its own heads of the cache: ``(resid, k, v)``, the
        keys and values not yet written."""
        rows, att = step.rows, self.attns[i]
        if hidden.shape[0] != len(rows.slots) or any(n != 1 for n in rows.seq_lens):
            raise ValueError(f"layer {self.index}: a decode step takes one token per request, got {hidden.shape[0]} "
                             f"tokens for rows {rows.seq_lens}")
        if not rows.slots:  # an idle rank's empty micro-batch
            return hidden.clone(), hidden.new_zeros(0, *att.k_shape), hidden.new_zeros(0, *att.v_shape)
        heads = self._heads[i] if len(self.attns) > 1 else None
        out, k, v = att.decode(att.norm(hidden), step, self.index, heads)
        return hidden + self._scaled(att.out_norm(out)), k, v

    def decode_attention(self, hidden: torch.Tensor, step: KVStep) -> torch.Tensor:
        """Decode: the cached attention of every request of the step (`_decode_sublayer`), its keys and values
        written to the cache; ``resid``."""
        resid, k, v = self._decode_sublayer(0, hidden, step)
        if step.rows.slots:
            step.cache.write(self.index, step.rows, k, v)
        return resid

    def decode_operations(self, chunks: int = 1) -> List[Operation]:
        """This layer for a decode step, from ``HIDDEN`` and ``KV_STEP`` to ``OUT``: the cached attention, then what
        `operations` runs after attention, an expert-parallel MoE's decode stages (its routed experts in
        ``chunks``). ValueError where it cannot (`decode_refusal`)."""
        self._check_decodes()
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

    def _take_parts(self, hf_layer: nn.Module, config: Any) -> List[Attention]:
        """Hold the shortcut layer's parts (`discovery.find_shortcut_parts`); its two attentions."""
        parts = find_shortcut_parts(hf_layer, self.kind, self.index)
        attns = [self._attention(parts.attentions[i], parts.input_norms[i], config) for i in range(2)]
        self.input_norm, (self.ffn_norm, self.ffn_norm1) = parts.input_norms[0], parts.ffn_norms
        self.dense0, self.dense1 = parts.dense
        self._set_ffn(parts.moe, parts.is_moe)
        return attns

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

    def _dense0(self, resid: torch.Tensor, moe_in: torch.Tensor) -> torch.Tensor:
        return resid + self.dense0(moe_in)

    def _dense1(self, resid: torch.Tensor) -> torch.Tensor:
        return resid + self.dense1(self.ffn_norm1(resid))

    def _under_exchange(self, moe: List[Operation], attn: Operation, attn1: Operation) -> List[Operation]:
        """The layer's operations around the MoE's ``moe``: ``attn`` and the norm before it, the first MLP and
        ``attn1`` after its dispatch (its count exchange and tokens, where it has two steps), the second MLP after
        its combine, the shortcut's residual last (a MoE without an exchange: all of them after it)."""
        comm = [i for i, op in enumerate(moe) if op.stream == EP_COMM]
        first = second = len(moe)
        if comm:
            first = comm[0] + 1
            while first < len(moe) and moe[first].stream == EP_COMM:
                first += 1
            second = next((i + 1 for i in comm if i >= first), len(moe))
            if second == len(moe):
                first = len(moe)
        under_dispatch = [Operation("dense0", self._dense0, ("resid", MOE_IN), ("resid1",)), attn1]
        under_combine = [Operation("dense1", self._dense1, ("resid2",), ("resid3",))]
        return ([attn, Operation("ffn_norm", self.ffn_norm, ("resid",), (MOE_IN,))]
                + moe[:first] + under_dispatch + moe[first:second] + under_combine + moe[second:]
                + [Operation("residual", torch.add, ("resid3", MOE_OUT), (OUT,))])

    def operations(self) -> List[Operation]:
        return self._under_exchange(
            self.ffn_operations(),
            Operation("attn", self.attention, (HIDDEN, SEQ, PREFIX_KV), ("resid", "k0", "v0")),
            Operation("attn1", self.second_attention, ("resid1", SEQ, PREFIX_KV, "k0", "v0"), ("resid2", K, V)))

    # --- decode ------------------------------------------------------------------------------------
    def first_decode_attention(self, hidden: torch.Tensor, step: KVStep
                               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode: the first attention sublayer over its half of the cache: ``(resid, k0, v0)``, not yet written."""
        return self._decode_sublayer(0, hidden, step)

    def decode_second_attention(self, hidden: torch.Tensor, step: KVStep, k0: torch.Tensor, v0: torch.Tensor
                                ) -> torch.Tensor:
        """Decode: the second attention sublayer over its half of the cache; both sublayers' keys and values
        written side by side, as prefill caches them: ``resid2``."""
        resid, k1, v1 = self._decode_sublayer(1, hidden, step)
        if step.rows.slots:
            step.cache.write(self.index, step.rows, torch.cat([k0, k1], dim=1), torch.cat([v0, v1], dim=1))
        return resid

    def decode_operations(self, chunks: int = 1) -> List[Operation]:
        """This layer for a decode step, placed as in prefill (`operations`): the first cached attention, the MoE's
        decode stages (its routed experts in ``chunks``) with the first MLP and the second cached attention under
        its dispatch and the second MLP under its combine. ValueError where it cannot (`decode_refusal`)."""
        self._check_decodes()
        return self._under_exchange(
            self.ffn_operations(chunks),
            Operation("attn", self.first_decode_attention, (HIDDEN, KV_STEP), ("resid", "k0", "v0")),
            Operation("attn1", self.decode_second_attention, ("resid1", KV_STEP, "k0", "v0"), ("resid2",)))
