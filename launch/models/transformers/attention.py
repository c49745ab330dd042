"""A transformers family's attention module called as the adapter calls it: per request in prefill, every request
of a decode step at once, with explicit masks and a `transformers.DynamicCache` the keys and values are read from.

`Attention` is one attention (sub)layer: the module, its input norm, its mask (causal, banded on a
sliding-window layer, blocked on a chunked one: `causal_mask`, `decode_mask`) and the model's rotary
embeddings. In prefill it calls the module on one request (batch 1, positions after the request's
prefix) with a fresh cache pre-filled with the prefix, and reads the request's keys and values back
from it, packed ``[tokens, kv_heads, head_dim]`` in whatever layout the family caches (DeepSeek-V3
caches its compressed latent and its rotary key, of two shapes). In a decode step it calls the module
once for every request: batch [requests, 1], each at its own position, a cache holding the padded
history from the `microbatch.KVCache`, a mask of each request's own rows.

DeepSeek sparse attention (``indexed_attention``: DeepSeek-V3.2, GLM-5) runs the same way, its cache layer an
indexed one, so the family's own indexer picks each query's top-k keys from the indexer keys of every earlier
token. The adapter carries them in the value row: K is the compressed latent ``[1, kv_lora_rank]``, V the rotary
key and the indexer key side by side ``[1, qk_rope_head_dim + index_head_dim]`` (`pack_indexed`,
`unpack_indexed`), so a prefix, the decode cache, its offload and its prefetch hold all three.

transformers is imported only inside the functions here.
"""
from __future__ import annotations

import inspect
from typing import Any, Optional, Tuple

import torch
from torch import nn

from microbatch.kv_cache import KVStep
from microbatch.model import KV

from ..common import one_line

__all__ = ["ATTENTION_KINDS", "INDEXED", "KV_HEADS", "Attention", "cache_keyword", "causal_mask", "decode_mask",
           "first_output", "pack_indexed", "unpack_indexed"]

INDEXED = "indexed_attention"  # DeepSeek sparse attention (DSA): an indexer's top-k tokens per query, then MLA
ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention", INDEXED)
KV_HEADS = Tuple[Tuple[int, int], Tuple[int, int]]  # an attention's key heads and value heads of a layer's cache


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


def cache_keyword(module: nn.Module) -> str:
    """The name under which ``module.forward`` takes its cache (transformers renamed ``past_key_values``)."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def first_output(out: Any) -> torch.Tensor:
    """What a family's module returns first: its output alone, or the first of a tuple."""
    return out[0] if isinstance(out, tuple) else out


def pack_indexed(rotary_keys: torch.Tensor, indexer_keys: torch.Tensor) -> torch.Tensor:
    """An indexed layer's value rows: the rotary keys ``[..., 1, qk_rope_head_dim]`` and the indexer keys
    ``[..., index_head_dim]`` side by side, ``[..., 1, qk_rope_head_dim + index_head_dim]``."""
    return torch.cat([rotary_keys, indexer_keys.unsqueeze(-2).to(rotary_keys.dtype)], dim=-1)


def unpack_indexed(values: torch.Tensor, rotary_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """`pack_indexed` undone: ``(rotary keys [..., 1, rotary_dim], indexer keys [..., index_head_dim])``."""
    return values[..., :rotary_dim], values[..., 0, rotary_dim:]


def _to_cache(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # packed [tokens, heads, dim] -> the cache's [1, heads, tokens, dim]


def _from_cache(x: torch.Tensor, n: int) -> torch.Tensor:
    return x[0, :, x.shape[-2] - n:].transpose(0, 1)  # the last n tokens, packed [n, heads, dim]


class Attention:
    """One attention (sub)layer: the module, its input norm, where its keys and values live in a cache, its mask
    and rotary embeddings (``rotary`` None: the family has none, e.g. Jamba)."""

    def __init__(self, module: nn.Module, norm: nn.Module, kind: str, config: Any, rotary: Optional[nn.Module],
                 layer: int, out_norm: Optional[nn.Module] = None):
        self.module, self.norm, self.kind, self.rotary, self.layer = module, norm, kind, rotary, layer
        self.out_norm = out_norm if out_norm is not None else nn.Identity()
        self.window = config.sliding_window if kind == "sliding_attention" else None
        self.chunk = getattr(config, "attention_chunk_size", None) if kind == "chunked_attention" else None
        self.cache_keyword = cache_keyword(module)
        self.index = getattr(module, "layer_idx", layer)
        self.typed_rotary = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        self.k_shape: Tuple[int, ...] = ()
        self.v_shape: Tuple[int, ...] = ()
        self.indexed = kind == INDEXED
        if self.indexed and getattr(module, "indexer", None) is None:
            raise TypeError(f"layer {layer} ({type(module).__name__}) reuses an earlier layer's top-k selection "
                            f"(indexer_types 'shared'): the adapter calls each layer's attention on its own")

    def _fresh_cache(self) -> Any:
        """An empty cache whose layer ``self.index`` is of the kind the module writes (an indexed layer keeps the
        indexer's keys beside the latent and rotary key)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        if self.indexed:
            from transformers.cache_utils import DynamicIndexedLayer

            cache.layers = [DynamicIndexedLayer() for _ in range(self.index + 1)]
        return cache

    def _position(self, x: torch.Tensor, pos: torch.Tensor) -> Any:
        if self.rotary is None:
            return None
        try:
            return self.rotary(x, pos, layer_type=self.kind) if self.typed_rotary else self.rotary(x, pos)
        except Exception as err:  # noqa: BLE001 (the family's own code: say which part the adapter drives wrong)
            raise TypeError(f"layer {self.layer}: the model's rotary embedding does not take a {self.kind} layer as "
                            f"the adapter calls it ({one_line(err, typed=True)})") from err

    def attend(self, x: torch.Tensor, n_prefix: int, prefix: Optional[KV]) -> Tuple[torch.Tensor, torch.Tensor,
                                                                                      torch.Tensor]:
        """One request: x [n, hidden] (normed) after ``n_prefix`` tokens whose keys / values are ``prefix``."""
        n = x.shape[0]
        pos = torch.arange(n_prefix, n_prefix + n, device=x.device)[None]
        cache = self._fresh_cache()
        if n_prefix:
            self._fill(cache, prefix[0][None], prefix[1][None])
        mask = causal_mask(n, n_prefix, self.window, x.dtype, x.device, self.chunk)
        out = first_output(self.module(hidden_states=x[None], position_embeddings=self._position(x[None], pos),
                                       attention_mask=mask, position_ids=pos, **{self.cache_keyword: cache}))
        held = cache.layers[self.index] if len(cache.layers) > self.index else None
        if held is None or not held.is_initialized or held.keys.shape[-2] != n_prefix + n:
            raise RuntimeError(f"layer {self.layer}: {type(self.module).__name__} did not cache the {n_prefix + n} "
                               f"keys and values of the request")
        return out[0], _from_cache(held.keys, n), _from_cache(self._values(held), n)

    def _fill(self, cache: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Put a history into ``cache``'s layer: keys / values ``[batch, tokens, heads, dim]`` as the adapter
        carries them (an indexed layer's values holding its indexer keys: `pack_indexed`)."""
        if self.indexed:
            values, indexer_keys = unpack_indexed(values, self._rotary_dim)
            cache.layers[self.index].update_indexer(indexer_keys)
        cache.update(keys.transpose(1, 2), values.transpose(1, 2), self.index)

    @property
    def _rotary_dim(self) -> int:
        return self.module.qk_rope_head_dim

    def _values(self, held: Any) -> torch.Tensor:
        """The values of a cache layer ``[batch, heads, tokens, dim]`` as the adapter carries them (`_fill`)."""
        if not self.indexed:
            return held.values
        if held.indexer_keys is None or held.indexer_keys.shape[-2] != held.values.shape[-2]:
            raise RuntimeError(f"layer {self.layer}: {type(self.module).__name__} did not cache an indexer key per "
                               f"token")
        return pack_indexed(held.values.transpose(1, 2), held.indexer_keys).transpose(1, 2)

    def decode(self, x: torch.Tensor, step: KVStep, layer: int, heads: Optional[KV_HEADS] = None
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every request of a decode step at once: x [requests, hidden] (normed), one new token each, after the rows
        the cache's layer ``layer`` holds of it; ``(out, k, v)``, k / v packed [requests, *k_shape / v_shape].
        ``heads``: this attention's key and value heads of a layer that caches several side by side
        (``((k0, k1), (v0, v1))``, LongCat-Flash's two); None: all of them."""
        rows = step.rows
        held = rows.longest - 1  # the history, padded to the longest; the new rows are not written yet
        keys, values = step.cache.history(layer, rows)
        if heads is not None:
            (k0, k1), (v0, v1) = heads
            keys, values = keys[:, :, k0:k1], values[:, :, v0:v1]
        cache = self._fresh_cache()
        if held:
            self._fill(cache, keys[:, :held].to(x.dtype), values[:, :held].to(x.dtype))
        pos = step.positions[:, None]  # [requests, 1]: each request's length so far
        # alike in every layer of a kind: made by the step's first (`KVStep.once`)
        mask = step.once(("mask", held, self.window, self.chunk, x.dtype),
                         lambda: decode_mask(step.positions, held, self.window, x.dtype, self.chunk))
        turn = step.once(("rotary", id(self.rotary), self.kind if self.typed_rotary else None, x.dtype),
                         lambda: self._position(x[:, None], pos))
        out = first_output(self.module(hidden_states=x[:, None], position_embeddings=turn,
                                       attention_mask=mask, position_ids=pos, **{self.cache_keyword: cache}))
        got = cache.layers[self.index] if len(cache.layers) > self.index else None
        if got is None or not got.is_initialized or got.keys.shape[-2] != held + 1:
            raise RuntimeError(f"layer {self.layer}: {type(self.module).__name__} did not append one key and value "
                               f"per request to the cache")
        return out[:, 0], got.keys[:, :, -1], self._values(got)[:, :, -1]

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
        return _from_cache(held.keys, n), _from_cache(self._values(held), n)
