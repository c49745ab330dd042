"""The transformers adapter checked against the family's own forward and generate: what `adapt(check=True)`,
the launcher's ``--check`` and the tests compare the adapter with.

`check_against_own_forward` runs a few tokens through the adapter and through the model's own forward
(`own_forward`: each request on its own); `own_kv` reads each attention layer's keys and values from the
cache of the model's own forward; `own_generate` is the family's own greedy ``generate``, in the shape of
`launch.engine.greedy_generate`'s tokens. They run the model's own blocks, so call them where they hold
every expert (before `TransformersModel.replace_moe` or a loader's expert-parallel shard; one rank).

transformers is imported only inside the functions here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence

import torch

from microbatch.batch import Batch, SeqInfo
from microbatch.model import KV

from ..common import check_token_ids
from .attention import cache_keyword

if TYPE_CHECKING:
    from .model import TransformersModel

__all__ = ["check_against_own_forward", "own_forward", "own_generate", "own_kv"]


@torch.no_grad()
def check_against_own_forward(model: TransformersModel, n_tokens: int = 4, rtol: float = 1e-2) -> float:
    """Largest difference between the adapter's and the model's own forward on one short request.

    Raises TypeError when it is above ``rtol`` of the output's magnitude. Run it before
    `TransformersModel.replace_moe`: the expert-parallel layer would exchange tokens with the other ranks.
    """
    weight = model.hf.model.embed_tokens.weight
    tokens = torch.arange(n_tokens, device=weight.device) % model.cfg.vocab
    batch = Batch(tokens, SeqInfo((n_tokens,)))
    got, want = model.forward(batch).float(), own_forward(model, batch).float()
    diff, scale = (got - want).abs().max().item(), want.abs().max().item()
    if not diff <= rtol * max(scale, 1.0):
        raise TypeError(f"{model.cfg.model_type}: the adapter's layers do not compute the model's own forward "
                        f"(difference {diff:.3g} at magnitude {scale:.3g}); its decoder layers do more than "
                        f"input norm, attention, post-attention norm, MLP and the two residuals")
    return diff


@torch.no_grad()
def own_generate(model: TransformersModel, prompts: Sequence[Sequence[int]], new_tokens: int,
                 stop_token: Optional[int] = None) -> List[List[int]]:
    """Each prompt's greedy continuation by the model's own ``generate`` (each prompt alone: its own cache,
    masks and positions), at most ``new_tokens`` long, cut after ``stop_token``: the reference for
    `launch.engine.greedy_generate`, in its shape. Only greedy argmax steers it: the model's generation config
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
    hf = model.hf
    device = hf.model.embed_tokens.weight.device
    own, hf.generation_config = hf.generation_config, GenerationConfig()  # its defaults fill nothing
    try:
        out = []
        for prompt in prompts:
            ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
            check_token_ids(ids, model.cfg.vocab)
            new = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            tokens = new[0, ids.shape[1]:].tolist()
            if stop_token in tokens:
                tokens = tokens[:tokens.index(stop_token) + 1]
            out.append(tokens)
        return out
    finally:
        hf.generation_config = own


def _requests(batch: Batch) -> Iterator[torch.Tensor]:
    if batch.seq.num_prefix_tokens:
        raise ValueError("the reference runs whole requests; this batch continues prefixes")
    cu = batch.seq.cu_seqlens
    return (batch.tokens[cu[i]:cu[i + 1]] for i in range(batch.seq.num_requests) if cu[i + 1] > cu[i])


@torch.no_grad()
def own_forward(model: TransformersModel, batch: Batch) -> torch.Tensor:
    """Final hidden states by the model's own forward, each request on its own."""
    outs = [model.hf.model(input_ids=t[None], use_cache=False).last_hidden_state[0] for t in _requests(batch)]
    return torch.cat(outs) if outs else model.embed_tokens(batch.tokens)


@torch.no_grad()
def own_kv(model: TransformersModel, batch: Batch) -> Dict[int, KV]:
    """Each attention layer's keys and values, packed, from the cache of the model's own forward."""
    from transformers import DynamicCache

    per_layer: Dict[int, List[KV]] = {i: [] for i in model.cfg.attention_layers}
    for t in _requests(batch):
        cache = DynamicCache(config=model.hf.config)
        keyword = cache_keyword(model.hf.model)
        model.hf.model(input_ids=t[None], use_cache=True, **{keyword: cache})
        for i in per_layer:
            held = model.layers[i].cached_kv(cache, t.shape[0])
            if held is None:
                raise ValueError(f"layer {i} keeps only its sliding window or chunk in the model's own cache; "
                                 f"compare requests that fit in it")
            per_layer[i].append(held)
    return {i: (torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv])) for i, kv in per_layer.items() if kv}
