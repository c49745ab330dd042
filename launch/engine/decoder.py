"""What runs a generation's decode steps: one interface (`Decoder`), and its eager implementation.

A generation's loop (`launch.engine.generation.generate`) asks the decoder of a step's mode two things: how it cuts
the step's requests into the mode's micro-batches (`Decoder.parts`: the widest one is what the ranks agree on), and
to run the step once the ranks agreed (`Decoder.run`: the picked token of each request, nothing read on the host).
Two implement it:

- `EagerDecoder` (here): the step through the executor each time (`launch.engine.step.decode_step`), the requests
  cut into N parts of about equal predicted cost (`split_by_cost`: a request's attention grows with its history,
  so balance is not a count), each micro-batch's exchange padded to the bucket of the widest over the ranks;
- `launch.engine.graph_decoder.GraphDecoder`: the step padded to its bucket, its requests in contiguous parts,
  captured once per bucket and replayed.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

import microbatch
import overlap
from collectives import MOE_ACTIVE, MOE_CAPACITY, ExpertParallelMoE, group_size
from microbatch import KV_STEP, DecodeModel, KVCache, KVStep

from .step import DECODE_STEP, TOKENS, Picked, bucket_of, checked_buckets, decode_step


@runtime_checkable
class Decoder(Protocol):
    """What a generation asks of the decode steps of one mode (``mode``, `microbatch.DECODE_MODES`) over
    ``cache``, where they write each step's keys and values (see the module docstring)."""

    mode: str
    cache: KVCache

    @property
    def micro_batches(self) -> int:
        """The micro-batches of every step (the mode's)."""

    @property
    def built(self) -> int:
        """The steps it built for itself so far (captured graphs); a step that builds pays for it once, so its
        time is no measurement. Lowered schedules are the process's (`microbatch.replay_stats`)."""

    def parts(self, history: Sequence[int]) -> List[List[int]]:
        """The requests of a step, holding ``history`` rows each, cut into `micro_batches` parts: each part's
        indices into ``history``, in order (a part may be empty)."""

    def run(self, slots: Sequence[int], tokens: Sequence[int], parts: Sequence[Sequence[int]], widest: int,
            history: int, number: Optional[int] = None, margins: bool = False) -> Picked:
        """One decode step of the requests in ``slots`` (in use in the cache) whose last tokens are ``tokens``,
        cut into ``parts`` (`parts`); ``widest``: the widest micro-batch over the ranks, ``history``: the longest
        history over the ranks (rows before this step's), ``number``: the step's in its generation. Returns the
        pick (``margins``: with the gap between each row's top two logits, where the step can), its rows in the
        order of ``parts``, and counts the step's rows in the cache."""


class EagerDecoder:
    """Decode steps of ``model`` over ``cache`` in ``mode`` through the executor (see the module docstring).
    ``buckets``: the sizes a micro-batch's exchange is padded to (`bucket_of`; default the powers of two);
    ``per_row``: the model's `history_weight`, the cost of a request's token in rows of its history (computed
    when not given)."""

    built = 0  # nothing of its own: the schedules it runs are lowered once per process

    def __init__(self, model: DecodeModel, cache: KVCache, mode: str = "serial",
                 buckets: Optional[Sequence[int]] = None, per_row: Optional[float] = None):
        self.model, self.cache, self.mode = model, cache, mode
        self.how = microbatch.decode_mode(mode)
        self.layers = model.decode_layer_operations(self.how.moe_chunks)  # a model that cannot decode says so here
        self.buckets = checked_buckets(buckets)
        self.per_row = history_weight(model) if per_row is None else per_row
        self.device = next(model.parameters()).device

    @property
    def micro_batches(self) -> int:
        """The micro-batches of every step (the mode's)."""
        return self.how.micro_batches

    def parts(self, history: Sequence[int]) -> List[List[int]]:
        """The requests cut into `micro_batches` parts of about equal predicted cost (`split_by_cost`)."""
        return split_by_cost(history, self.micro_batches, self.per_row)

    def run(self, slots: Sequence[int], tokens: Sequence[int], parts: Sequence[Sequence[int]], widest: int,
            history: int, number: Optional[int] = None, margins: bool = False) -> Picked:
        """One step through the executor in the mode's schedule, each part a micro-batch (an empty one takes part
        with zero tokens), its exchange padded to the bucket of ``widest`` (see `Decoder.run`)."""
        capacity = bucket_of(widest, self.buckets)
        steps, inputs = [], []
        for part in parts:
            steps.append(KVStep(self.cache, self.cache.rows([slots[j] for j in part])))
            ids = torch.tensor([tokens[j] for j in part], dtype=torch.long, device=self.device)
            inputs.append({TOKENS: ids, KV_STEP: steps[-1], MOE_CAPACITY: capacity, MOE_ACTIVE: None})
        with overlap.no_host_sync(DECODE_STEP if number is None else f"{DECODE_STEP} {number}"):
            picked = decode_step(self.model, self.layers, self.how.make, inputs, margins)
        for kv in steps:
            self.cache.advance(kv.rows)
        return picked


def eager_decoders(model: DecodeModel, cache: KVCache, modes: Sequence[str],
                   buckets: Optional[Sequence[int]] = None) -> Dict[str, EagerDecoder]:
    """An `EagerDecoder` of each of ``modes`` over ``cache``, keyed by its mode."""
    per_row = history_weight(model)
    return {m: EagerDecoder(model, cache, m, buckets, per_row) for m in modes}


def split_by_cost(history: Sequence[int], n: int, per_token: float = 1.0) -> List[List[int]]:
    """The indices of requests cut into ``n`` parts of about equal predicted cost: each request costs
    ``per_token + history`` (rows of history it attends to, with ``per_token`` the rows whose attention
    costs as much as the rest of its token's work); the costliest first, each to the cheapest part so far.
    Each part keeps the requests' order; a part may be empty."""
    parts: List[List[int]] = [[] for _ in range(n)]
    load = [0.0] * n
    for j in sorted(range(len(history)), key=lambda j: (-history[j], j)):
        k = min(range(n), key=lambda k: (load[k], len(parts[k]), k))
        parts[k].append(j)
        load[k] += per_token + history[j]
    return [sorted(p) for p in parts]


def history_weight(model: DecodeModel) -> float:
    """Rows of history whose attention costs about as much as the rest of one token's work in a decode step,
    from the model's shapes: the weights a token meets (its top-k experts' only) over the multiply-adds of
    attending to one row of history (its query against the cached key, its weights against the value)."""
    cfg = model.cfg
    experts, other = 0, 0
    for name, p in model.named_parameters():
        if ".layers." not in f".{name}":
            continue  # embedding, final norm, LM head: once per token, outside the layers
        if ".experts." in name:
            experts += p.numel()
        else:
            other += p.numel()
    group = expert_group(model)
    local = max(1, cfg.n_experts // (group_size(group) if group is not None else 1))
    per_token = other + experts / local * cfg.top_k  # each token meets top-k experts' weights
    heads = max(1, int(cfg.n_heads))
    per_row = heads * (cfg.k_shape[-1] + cfg.v_shape[-1]) * max(1, len(getattr(cfg, "attention_layers",
                                                                                range(cfg.n_layers))))
    return per_token / per_row


def expert_group(model: DecodeModel) -> Optional[dist.ProcessGroup]:
    """The group the model's experts are spread over (None: this process holds them all)."""
    spread = [m for m in model.modules() if isinstance(m, ExpertParallelMoE) and group_size(m.group) > 1]
    if not spread:
        return None
    return spread[0].group if spread[0].group is not None else dist.group.WORLD  # None: the default group


__all__ = ["Decoder", "EagerDecoder", "eager_decoders", "expert_group", "history_weight", "split_by_cost"]
