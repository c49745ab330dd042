"""DeepSeek sparse attention (``indexed_attention``: DeepSeek-V3.2, GLM-5) as the toolkit's operations, the indexer on
a stream of its own (the Indexer Prolog split across streams).

`IndexedLayer` computes the family's attention from the family module's own weights, as four operations:

``attn_q``      (main)      input norm, ``q_a_layernorm(q_a_proj(x))`` -> ``q_resid``
``indexer``     (`overlap.INDEXER`) the indexer's query (``wq_b(q_resid)``) and key (``wk``, ``k_norm``), their
                rotary, scores against the prefix's and the request's own indexer keys, the head weights, the
                causal mask, the top-k: indices ``[tokens, index_topk]`` (a query with fewer keys repeats its own
                position: selecting it again changes nothing) and the new indexer keys ``[tokens, index_head_dim]``
``attn_kv``     (main)      ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, the interleaved rotary
``attn_sparse`` (main)      the latent expanded by ``kv_b_proj``, attention over the selected causal keys, ``o_proj``,
                the residual: the join of both branches (the executor puts the event before it, from the data flow)

``indexer`` and ``attn_kv`` read only ``attn_q``'s values, so on a CPU side stream the indexer's arithmetic runs on
that stream's worker thread (`overlap.issue_host`, kind ``compute``) while the main branch computes. Its cache
holds per token the family's latent as K ``[1, kv_lora_rank]`` and, as V ``[1, qk_rope_head_dim +
index_head_dim]``, the rotary key beside the indexer's key (after ``k_norm`` and its rotary; `attention.pack_indexed`,
the family-module path's layout), so a cut request's later part and a decode step read the earlier tokens' indexer
keys from the prefix / the cache.

With ``indexer_stream`` False (`TransformersModel.indexer_stream`) the layer is a `TransformersLayer`: the family's
own module, one operation.

On the NPU the indexer's scores and top-k are torch_npu's ``npu_lightning_indexer`` and the sparse attention its
``npu_sparse_flash_attention`` (`NPU_OPERATORS`, checked against the wheel's schemas). Neither is called yet: their
semantics against the family's (the indexer's relu and head weights, its top-k ties, ``sparse_mode``'s causal
band, the latent split into ``query`` / ``query_rope``) cannot be confirmed without an NPU, so every path computes
with PyTorch (docs/model.md).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

import overlap
from microbatch import HIDDEN, Operation
from microbatch.batch import K, KV_STEP, PREFIX_KV, SEQ, V, SeqInfo
from microbatch.kv_cache import KVStep
from microbatch.model import KV

from .attention import causal_mask, decode_mask, pack_indexed, unpack_indexed
from .layers import TransformersLayer, packed_requests

__all__ = ["NPU_OPERATORS", "IndexedLayer", "not_as_operations"]

# What the NPU path would call for the indexer's scores + top-k and for the sparse attention: torch_npu's operators
# and the arguments each would be given (tests/test_indexer_stream.py checks them against the wheel's schemas).
NPU_OPERATORS = {
    "npu_lightning_indexer": ("query", "key", "weights", "actual_seq_lengths_query", "actual_seq_lengths_key",
                              "layout_query", "layout_key", "sparse_count", "sparse_mode"),
    "npu_sparse_flash_attention": ("query", "key", "value", "sparse_indices", "scale_value", "query_rope", "key_rope",
                                   "actual_seq_lengths_query", "actual_seq_lengths_kv", "layout_query", "layout_kv",
                                   "sparse_mode"),
}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _half_split_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The non-interleaved rotary (DeepSeek-V3.2's indexer); ``cos`` / ``sin`` broadcast to ``x``."""
    return x * cos + _rotate_half(x) * sin


def _interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rotary: pairs ``(x0, x1), (x2, x3), ...``, each turned by one frequency."""
    cos, sin = cos[..., :cos.shape[-1] // 2], sin[..., :sin.shape[-1] // 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _indexer_rotary(indexer: nn.Module) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The rotary the family's indexer applies: interleaved (GLM-5) or half-split (DeepSeek-V3.2)."""
    forward = inspect.unwrap(type(indexer).forward)
    return _interleaved_rotary if "apply_rotary_pos_emb_interleave" in forward.__code__.co_names \
        else _half_split_rotary


def _own_position_padded(top: torch.Tensor, allowed: torch.Tensor, own: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k indices ``[..., q, j]`` with every key the query may not see (``allowed`` False) replaced by the query's
    own key ``own`` ``[..., q, 1]``, and padded with it to ``k`` columns."""
    top = torch.where(allowed.gather(-1, top), top, own)
    if top.shape[-1] < k:
        top = torch.cat([top, own.expand(*top.shape[:-1], k - top.shape[-1])], dim=-1)
    return top


# What `IndexedLayer` reads of a family's attention module and of its indexer (DeepSeek-V3.2's and GLM-5's names).
_MODULE_PARTS = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                 "o_proj", "scaling", "indexer")
_INDEXER_PARTS = ("wq_b", "wk", "k_norm", "weights_proj", "softmax_scale")


def not_as_operations(module: nn.Module, rotary: Optional[nn.Module]) -> Optional[str]:
    """Why a sparse-attention module cannot be written as `IndexedLayer`'s operations (None: it can): a part it
    lacks, or a rotary embedding that takes the layer's type. Such a layer stays the family's module, one
    operation (`TransformersLayer`)."""
    missing = [p for p in _MODULE_PARTS if getattr(module, p, None) is None]
    indexer = getattr(module, "indexer", None)
    missing += [f"indexer.{p}" for p in _INDEXER_PARTS if indexer is not None and getattr(indexer, p, None) is None]
    if missing:
        return f"{type(module).__name__} has no {', '.join(missing)}"
    if rotary is None or "layer_type" in inspect.signature(rotary.forward).parameters:
        return "its rotary embedding is not the model's one table of positions"
    return None


def _fill(outs: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    for out, value in zip(outs, values):
        out.copy_(value)


class IndexedLayer(TransformersLayer):
    """A DeepSeek-sparse-attention decoder layer, its indexer on `overlap.INDEXER` (see the module docstring)."""

    def __init__(self, hf_model: nn.Module, index: int, indexer_stream: bool = True):
        super().__init__(hf_model, index)
        self.indexer_stream = indexer_stream
        config = hf_model.config
        self.n_heads, self.kv_lora_rank = config.num_attention_heads, config.kv_lora_rank
        self.rope, self.nope = config.qk_rope_head_dim, config.qk_nope_head_dim
        self.v_head = config.v_head_dim
        self.index_heads, self.index_dim, self.index_topk = (config.index_n_heads, config.index_head_dim,
                                                              config.index_topk)
        self._index_rotary = _indexer_rotary(self._indexer)

    @property
    def _mla(self) -> nn.Module:
        """The family's attention module, whose weights the operations use (held by its `Attention`)."""
        return self.attns[0].module

    @property
    def _indexer(self) -> nn.Module:
        return self.attns[0].module.indexer

    # --- shared arithmetic ---------------------------------------------------------------------------
    def _turn(self, x: torch.Tensor, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[tokens, rope]`` of each token's position."""
        cos, sin = self._rotary(x[None], positions[None])
        return cos[0], sin[0]

    def _index_query_key(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The indexer's queries ``[tokens, heads, dim]`` and keys ``[tokens, dim]``, rotary applied."""
        ix, r = self._indexer, self.rope
        q = ix.wq_b(q_resid).view(x.shape[0], self.index_heads, self.index_dim)
        k = ix.k_norm(ix.wk(x))
        q = torch.cat([self._index_rotary(q[..., :r], cos[:, None], sin[:, None]), q[..., r:]], dim=-1)
        k = torch.cat([self._index_rotary(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        return q, k

    def _index_scores(self, x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """The indexer's scores ``[..., q, keys]`` as the family computes them: the heads' relu'd dot products
        weighed by ``weights_proj``; ``x`` ``[..., q, hidden]``, ``q`` ``[..., q, heads, dim]``, ``keys``
        ``[..., keys, dim]``."""
        ix = self._indexer
        scores = F.relu(torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(-3)) * ix.softmax_scale)
        weights = ix.weights_proj(x).float() * (self.index_heads ** -0.5)
        return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)

    def _query_key_value(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The main branch: queries ``[tokens, heads, nope + rope]``, the latent ``[tokens, kv_lora_rank]`` and the
        rotary key ``[tokens, rope]``."""
        m = self._mla
        q = m.q_b_proj(q_resid).view(x.shape[0], self.n_heads, self.nope + self.rope)
        q = torch.cat([q[..., :self.nope], _interleaved_rotary(q[..., self.nope:], cos[:, None], sin[:, None])], -1)
        kv = m.kv_a_proj_with_mqa(x)
        latent = m.kv_a_layernorm(kv[..., :self.kv_lora_rank])
        return q, latent, _interleaved_rotary(kv[..., self.kv_lora_rank:], cos, sin)

    def _attend(self, q: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor, allowed: torch.Tensor
                ) -> torch.Tensor:
        """Attention of ``q`` ``[..., q, heads, d]`` to the keys of ``latent`` ``[..., keys, rank]`` / ``k_rot``,
        where ``allowed`` ``[..., q, keys]``; the output through ``o_proj``: ``[..., q, hidden]``."""
        m = self._mla
        kv = m.kv_b_proj(latent).view(*latent.shape[:-1], self.n_heads, self.nope + self.v_head)
        k_rot = k_rot.unsqueeze(-2).expand(*k_rot.shape[:-1], self.n_heads, self.rope)
        keys, values = torch.cat([kv[..., :self.nope], k_rot], dim=-1), kv[..., self.nope:]
        scores = torch.matmul(q.transpose(-2, -3), keys.transpose(-2, -3).transpose(-1, -2)) * m.scaling
        scores = scores.masked_fill(~allowed.unsqueeze(-3), torch.finfo(scores.dtype).min)
        out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values.transpose(-2, -3))
        return m.o_proj(out.transpose(-2, -3).reshape(*q.shape[:-2], self.n_heads * self.v_head))

    def _selected(self, top: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        """The keys each query attends to: its top-k ones it may see."""
        return torch.zeros_like(causal).scatter(-1, top, True) & causal

    def _prefix_rows(self, prefix: Optional[KV], pstart: int, p: int
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A request's prefix: its latent ``[p, rank]``, rotary keys ``[p, rope]`` and indexer keys ``[p, dim]``."""
        rotary, keys = unpack_indexed(prefix[1][pstart:pstart + p], self.rope)
        return prefix[0][pstart:pstart + p, 0], rotary[:, 0], keys

    # --- prefill -------------------------------------------------------------------------------------
    def query_residual(self, hidden: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``attn_q``: the normed input and ``q_a_layernorm(q_a_proj(x))``."""
        x = self.input_norm(hidden)
        return x, self._mla.q_a_layernorm(self._mla.q_a_proj(x))

    def _positions(self, seq: SeqInfo, device: Any) -> torch.Tensor:
        """Each packed token's position in its request (after its prefix)."""
        parts = [torch.arange(p, p + n, device=device) for n, p in zip(seq.seq_lens, seq.prefix_lens)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)

    def _select_prefill(self, x: torch.Tensor, q_resid: torch.Tensor, seq: SeqInfo, prefix: Optional[KV]
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The indexer's branch of a packed batch: ``(top-k [tokens, index_topk], indexer keys [tokens, dim])``."""
        cos, sin = self._turn(x, self._positions(seq, x.device))
        q, keys = self._index_query_key(x, q_resid, cos, sin)
        tops = []
        for start, n, pstart, p in packed_requests(seq):
            own = keys[start:start + n]
            if p:
                own = torch.cat([self._prefix_rows(prefix, pstart, p)[2].to(own.dtype), own])
            mask = causal_mask(n, p, None, x.dtype, x.device)[0, 0]  # added, as the family adds it (the same ties)
            scores = self._index_scores(x[start:start + n], q[start:start + n], own) + mask
            causal = mask == 0
            top = scores.topk(min(self.index_topk, p + n), dim=-1).indices
            mine = torch.arange(p, p + n, device=x.device)[:, None]
            tops.append(_own_position_padded(top, causal, mine, self.index_topk))
        top = torch.cat(tops) if tops else torch.zeros(0, self.index_topk, dtype=torch.long, device=x.device)
        return top, keys

    def indexer(self, x: torch.Tensor, q_resid: torch.Tensor, seq: SeqInfo, prefix: Optional[KV]
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``indexer`` in prefill: `_select_prefill` issued as host work on the current stream (its worker thread on a
        CPU side stream), into outputs made here."""
        top = torch.empty(x.shape[0], self.index_topk, dtype=torch.long, device=x.device)
        keys = x.new_empty(x.shape[0], self.index_dim)
        reads = [x, q_resid] + ([] if prefix is None else [prefix[1]])
        overlap.issue_host("indexer", lambda: _fill((top, keys), self._select_prefill(x, q_resid, seq, prefix)),
                           reads=reads, writes=(top, keys), kind="compute", layer=self.index)
        return top, keys

    def main_branch(self, x: torch.Tensor, q_resid: torch.Tensor, seq: SeqInfo
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``attn_kv`` in prefill: queries, latent and rotary key of the packed batch."""
        cos, sin = self._turn(x, self._positions(seq, x.device))
        return self._query_key_value(x, q_resid, cos, sin)

    def sparse_attention(self, hidden: torch.Tensor, q: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor,
                         top: torch.Tensor, index_keys: torch.Tensor, seq: SeqInfo, prefix: Optional[KV]
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``attn_sparse`` in prefill: each request's attention to its selected keys (after its prefix), ``o_proj``,
        the residual: ``(resid, K, V)`` in the layout of the cache (module docstring)."""
        outs = []
        for start, n, pstart, p in packed_requests(seq):
            lat, rot = latent[start:start + n], k_rot[start:start + n]
            if p:
                plat, prot, _ = self._prefix_rows(prefix, pstart, p)
                lat, rot = torch.cat([plat.to(lat.dtype), lat]), torch.cat([prot.to(rot.dtype), rot])
            allowed = self._selected(top[start:start + n], _causal(n, p, hidden.device))
            outs.append(self._attend(q[start:start + n], lat, rot, allowed))
        resid = hidden + self._scaled(self.attns[0].out_norm(torch.cat(outs))) if outs else hidden.clone()
        return resid, latent[:, None], pack_indexed(k_rot[:, None], index_keys)

    def operations(self) -> List[Operation]:
        """``attn_q``, ``indexer`` (on `overlap.INDEXER`), ``attn_kv``, ``attn_sparse``, then the feed-forward part;
        the family's module as one operation with ``indexer_stream`` off."""
        if not self.indexer_stream:
            return super().operations()
        return [Operation("attn_q", self._checked_query_residual, (HIDDEN, SEQ, PREFIX_KV), ("attn_x", "q_resid")),
                Operation("indexer", self.indexer, ("attn_x", "q_resid", SEQ, PREFIX_KV), ("index_top", "index_k"),
                          stream=overlap.INDEXER),
                Operation("attn_kv", self.main_branch, ("attn_x", "q_resid", SEQ), ("attn_qs", "latent", "k_rot")),
                Operation("attn_sparse", self.sparse_attention,
                          (HIDDEN, "attn_qs", "latent", "k_rot", "index_top", "index_k", SEQ, PREFIX_KV),
                          ("resid", K, V))] + self._after_attention()

    def _checked_query_residual(self, hidden: torch.Tensor, seq: SeqInfo, prefix: Optional[KV]
                                ) -> Tuple[torch.Tensor, torch.Tensor]:
        self._check(hidden, seq, prefix)
        return self.query_residual(hidden)

    # --- decode --------------------------------------------------------------------------------------
    def _decode_turn(self, x: torch.Tensor, step: KVStep) -> Tuple[torch.Tensor, torch.Tensor]:
        return self._turn(x, step.positions)

    def _select_decode(self, x: torch.Tensor, q_resid: torch.Tensor, step: KVStep, history: torch.Tensor,
                       lengths: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """The indexer's branch of a decode step over the indexer keys ``history`` ``[requests, held, dim]`` (padded;
        request i holds ``lengths[i]`` rows): the top-k among its rows and column ``held`` (the new token), and the
        new indexer keys. Each request's top-k is taken over its own rows alone, as the family's cache holds them,
        so ties between equal scores fall as they fall there."""
        cos, sin = self._decode_turn(x, step)
        q, key = self._index_query_key(x, q_resid, cos, sin)
        held = history.shape[1]
        keys = torch.cat([history.to(key.dtype), key[:, None]], dim=1)  # [requests, held + 1, dim]
        scores = self._index_scores(x[:, None], q[:, None], keys)[:, 0]  # [requests, held + 1]
        tops = []
        for i, n in enumerate(lengths):
            own = torch.cat([scores[i, :n], scores[i, held:]])  # its n rows, then its new token
            top = own.topk(min(self.index_topk, n + 1)).indices
            top = torch.where(top == n, held, top)
            tops.append(torch.cat([top, top.new_full((self.index_topk - top.shape[0],), held)]))
        return torch.stack(tops), key

    def decode_indexer(self, x: torch.Tensor, q_resid: torch.Tensor, step: KVStep) -> Tuple[torch.Tensor, torch.Tensor]:
        """``indexer`` of a decode step, issued as host work like prefill's (`indexer`)."""
        top = torch.empty(x.shape[0], self.index_topk, dtype=torch.long, device=x.device)
        keys = x.new_empty(x.shape[0], self.index_dim)
        if not step.rows.slots:
            return top, keys
        history = unpack_indexed(step.cache.history(self.index, step.rows)[1][:, :step.rows.longest - 1], self.rope)[1]
        lengths = [step.cache.lengths[s] for s in step.rows.slots]
        overlap.issue_host("indexer",
                           lambda: _fill((top, keys), self._select_decode(x, q_resid, step, history, lengths)),
                           reads=(x, q_resid, history), writes=(top, keys), kind="compute", layer=self.index)
        return top, keys

    def decode_main_branch(self, x: torch.Tensor, q_resid: torch.Tensor, step: KVStep
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``attn_kv`` of a decode step."""
        cos, sin = self._decode_turn(x, step)
        return self._query_key_value(x, q_resid, cos, sin)

    def decode_sparse_attention(self, hidden: torch.Tensor, q: torch.Tensor, latent: torch.Tensor,
                                k_rot: torch.Tensor, top: torch.Tensor, index_keys: torch.Tensor, step: KVStep
                                ) -> torch.Tensor:
        """``attn_sparse`` of a decode step: every request's attention to its selected keys of its history and its new
        token; the new rows written to the cache; ``resid``."""
        rows = step.rows
        if not rows.slots:
            return hidden.clone()
        k_hist, v_hist = step.cache.history(self.index, rows)
        held = rows.longest - 1
        lat = torch.cat([k_hist[:, :held, 0].to(latent.dtype), latent[:, None]], dim=1)
        rot = torch.cat([unpack_indexed(v_hist[:, :held], self.rope)[0][:, :, 0].to(k_rot.dtype), k_rot[:, None]], 1)
        causal = decode_mask(step.positions, held, None, hidden.dtype)[:, 0] == 0  # [requests, 1, held + 1]
        out = self._attend(q[:, None], lat, rot, self._selected(top[:, None], causal))[:, 0]
        step.cache.write(self.index, rows, latent[:, None], pack_indexed(k_rot[:, None], index_keys))
        return hidden + self._scaled(self.attns[0].out_norm(out))

    def decode_operations(self, chunks: int = 1) -> List[Operation]:
        """A decode step's ``attn_q``, ``indexer`` (on `overlap.INDEXER`), ``attn_kv``, ``attn_sparse``, then the
        feed-forward part (the MoE's decode stages in ``chunks``); `TransformersLayer`'s with ``indexer_stream``
        off."""
        if not self.indexer_stream:
            return super().decode_operations(chunks)
        self._check_decodes()
        return [Operation("attn_q", self.query_residual, (HIDDEN,), ("attn_x", "q_resid")),
                Operation("indexer", self.decode_indexer, ("attn_x", "q_resid", KV_STEP), ("index_top", "index_k"),
                          stream=overlap.INDEXER),
                Operation("attn_kv", self.decode_main_branch, ("attn_x", "q_resid", KV_STEP),
                          ("attn_qs", "latent", "k_rot")),
                Operation("attn_sparse", self.decode_sparse_attention,
                          (HIDDEN, "attn_qs", "latent", "k_rot", "index_top", "index_k", KV_STEP), ("resid",))
                ] + self._after_attention(chunks)


def _causal(n: int, n_prefix: int, device: Any) -> torch.Tensor:
    """``[n, n_prefix + n]`` bool: query i (position n_prefix + i) sees keys up to its position."""
    return causal_mask(n, n_prefix, None, torch.float32, device)[0, 0] == 0
