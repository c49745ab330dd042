"""Greedy generation with the device KV cache: prefill writes it, each decode step appends to it.

Groundwork for issue 28 (its generation launcher does not exist yet): serial
prefill, then one decode step per new token, every step a batch of one token per active request
run through the executor (`microbatch.run`) in a mode's schedule (``serial``, ``shared``,
``two-batch``, ...: the active requests cut into the mode's micro-batches by count, in order)
with the reference decoder's cached attention. A request that is done frees its slot; the others
go on.

With expert-parallel layers over several ranks, each rank brings its own prompts (none is fine)
and its own lengths; a rank with no active request keeps taking part in every step with zero
tokens until every rank is done, which the ranks agree on every step with one small all-reduce.
NaN or inf in a rank's logits stops every rank at that step (`NonFiniteLogits`), through the same
all-reduce: no token is taken from them.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import microbatch
import overlap
from collectives import ExpertParallelMoE, group_size
from microbatch import HIDDEN, KV_STEP, Batch, DecodeModel, KVCache, KVStep, SeqInfo


class NonFiniteLogits(RuntimeError):
    """NaN or inf in the logits of a request (on this rank or, named, another)."""


def new_cache(model: DecodeModel, prompts: Sequence[Sequence[int]], new_tokens: int) -> KVCache:
    """A cache with one slot per prompt, room for the longest prompt plus ``new_tokens``."""
    cfg = model.cfg
    longest = max((len(p) for p in prompts), default=1)
    weight = next(model.parameters())
    return KVCache(cfg.n_layers, max(1, len(prompts)), longest + new_tokens, cfg.k_shape, cfg.v_shape,
                   dtype=weight.dtype, device=weight.device)


@torch.no_grad()
def greedy_generate(model: DecodeModel, prompts: Sequence[Sequence[int]], new_tokens: int,
                    stop_token: Optional[int] = None, cache: Optional[KVCache] = None,
                    mode: str = "serial") -> List[List[int]]:
    """Each prompt's greedy continuation (argmax of the LM head), at most ``new_tokens`` long, ending at
    ``stop_token`` (included) where it comes; the cache (default `new_cache`) holds every request; the
    decode steps run in ``mode`` (`microbatch.MODES`; every rank passes the same)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    how = microbatch.mode(mode)
    group = _expert_group(model)
    cache = cache or new_cache(model, prompts, new_tokens)
    slots = cache.admit(len(prompts))
    device = next(model.parameters()).device
    tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    lens = [len(p) for p in prompts]
    prefill = cache.rows(slots, lens)
    hidden = model(Batch(tokens, SeqInfo.from_lens(lens)), kv_sink=lambda li, k, v: cache.write(li, prefill, k, v))
    cache.advance(prefill)
    last = torch.tensor(lens, dtype=torch.long, device=device).cumsum(0) - 1
    out: List[List[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    nxt, problem = _greedy(model.logits(hidden[last]), active, 0)
    layers = model.decode_layer_operations()
    step_no = 0
    while True:
        still = []
        for i, t in zip(active, nxt):
            out[i].append(t)
            if len(out[i]) < new_tokens and t != stop_token:
                still.append(i)
        cache.release([slots[i] for i in active if i not in still])
        if not _step_status(len(still), problem, group):
            return out
        step_no += 1
        steps, inputs = [], []
        for part in _parts(still, how.micro_batches):  # contiguous, by count; a part may be empty
            step_tokens = torch.tensor([out[i][-1] for i in part], dtype=torch.long, device=device)
            steps.append(KVStep(cache, cache.rows([slots[i] for i in part])))
            inputs.append({HIDDEN: model.embed_tokens(step_tokens), KV_STEP: steps[-1]})
        hidden = torch.cat(microbatch.run(how.make(layers, len(inputs)), layers, inputs))
        for step in steps:
            cache.advance(step.rows)
        active = still
        nxt, problem = _greedy(model.logits(model.norm(hidden)), active, step_no)


def _parts(items: List[int], n: int) -> List[List[int]]:
    """``items`` cut into ``n`` contiguous parts whose sizes differ by at most one (the first ones larger)."""
    size, extra = divmod(len(items), n)
    out, at = [], 0
    for k in range(n):
        take = size + (k < extra)
        out.append(items[at:at + take])
        at += take
    return out


def _expert_group(model: DecodeModel) -> Optional[dist.ProcessGroup]:
    """The group the model's experts are spread over (None: one process)."""
    spread = [m for m in model.modules() if isinstance(m, ExpertParallelMoE) and group_size(m.group) > 1]
    return spread[0].group if spread else None


def _greedy(logits: torch.Tensor, requests: List[int], step: int) -> Tuple[List[int], Optional[str]]:
    """Each row's argmax, and what is wrong where a row holds NaN or inf (naming its request and the step)."""
    bad = (~torch.isfinite(logits)).any(-1).nonzero().flatten().tolist()
    problem = None
    if bad:
        problem = (f"NaN or inf in the logits of request {requests[bad[0]]} at decode step {step} (0: the prefill's)"
                   + (f" and of {len(bad) - 1} more" if len(bad) > 1 else ""))
    return logits.argmax(-1).tolist(), problem


def _step_status(mine: int, problem: Optional[str], group: Optional[dist.ProcessGroup]) -> bool:
    """Whether any rank of ``group`` still has an active request; `NonFiniteLogits` on every rank, naming the
    rank, where one found NaN or inf (`overlap.agree`: one small all-reduce; none without a group)."""
    if group is None:
        if problem:
            raise NonFiniteLogits(problem)
        return mine > 0
    posts = overlap.agree({"active": mine}, overlap.GroupTransport(group, "decode.step"),
                          problems=[problem] if problem else [], per_rank=["active"], error=NonFiniteLogits)
    return any(p["active"] for p in posts)


__all__ = ["NonFiniteLogits", "greedy_generate", "new_cache"]
