"""Greedy generation with the device KV cache: prefill writes it, each decode step appends to it.

`generate` prefills the prompts through the executor in a mode's schedule (each layer's keys and
values written to the cache right after its attention, micro-batch by micro-batch), takes the
argmax of the LM head, then runs one decode step per new token: a batch of one token per active
request, through the executor (`microbatch.run_made`) in the decode mode's schedule (``serial``,
``shared``, ``two-batch``, ...), with the model's cached attention (`microbatch.DecodeModel`). A
mode of N micro-batches cuts the active requests into N parts of about equal predicted cost
(`split_by_cost`: a request's attention grows with its history, so balance is not a count). A
request that is done frees its slot; the others go on.

With expert-parallel layers over several ranks, each rank brings its own prompts (none is fine)
and its own lengths; a rank with no active request keeps taking part in every step with zero
tokens until every rank is done. The ranks agree every step, in one small all-reduce
(`overlap.agree`), on whether any request is still active, on the number of micro-batches, and on
whether any rank's logits hold NaN or inf (`NonFiniteLogits` on every rank: no token is taken from them).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

import microbatch
import overlap
from collectives import MOE_ACTIVE, MOE_CAPACITY, ExpertParallelMoE, group_size
from microbatch import (KV_STEP, K, V, Batch, DecodeModel, KVCache, KVRows, KVStep, OffloadedKVCache, Operation,
                        SeqInfo)
from microbatch.forward import micro_batch_inputs
from microbatch.planning.decode import DEFAULT_MARGIN, DecodeCalibration, choose_decode
from microbatch.planning import DecodeGuard
from microbatch.split import merge_outputs

from .decode_step import DECODE_STEP, TOKENS, Picked, bucket_of, decode_step, read_picked
from .graph_decode import GraphDecoder, decoders_of
from .runner import after_attention, split_for

AUTO = "auto"  # the decode mode that chooses each step's mode from a decode calibration
# (step, active requests on every rank) -> whether the caller observes the next step (step 0: the prefill's token)
OnStep = Callable[[int, int], Optional[bool]]
Decoders = Union[GraphDecoder, Mapping[str, GraphDecoder]]  # one decoder, or auto's: one per candidate mode
_PREFILL_ROWS = "kv_prefill_rows"  # a prefill micro-batch's rows of the cache (its tokens' slice of the batch's)


class DecodeError(RuntimeError):
    """The ranks of a generation disagree on a step (its number of micro-batches), or one found it wrong."""

    expected = True  # reported in one line on every rank, not a bug (`launch.job.guarded`)


class NonFiniteLogits(DecodeError):
    """NaN or inf in the logits of a request (on this rank or, named, another)."""


@dataclasses.dataclass
class Generated:
    """What `generate` produced on this rank: each request's new tokens and, with ``margins=True``, the gap
    between the top two logits where each was taken (how near a tie it was)."""

    tokens: List[List[int]]
    margins: Optional[List[List[float]]] = None
    steps: int = 0  # decode steps after the prefill (the same on every rank)
    modes: List[str] = dataclasses.field(default_factory=list)  # each decode step's mode (auto's choices)
    predicted: List[float] = dataclasses.field(default_factory=list)  # with auto: each step's predicted seconds


def new_cache(model: DecodeModel, prompts: Sequence[Sequence[int]], new_tokens: Union[int, Sequence[int]], *,
              offload: bool = False) -> KVCache:
    """A cache with one slot per prompt, room for the longest prompt plus its new tokens, of the model's own
    per-token key and value shapes (``cfg.k_shape``, ``cfg.v_shape``); with ``offload``, on the host, each
    layer's history prefetched on the ``kv_offload`` stream while the layer before computes
    (`microbatch.OffloadedKVCache`: close it when done)."""
    cfg = model.cfg
    limits = _limits(prompts, new_tokens)
    longest = max((len(p) + n for p, n in zip(prompts, limits)), default=1)
    weight = next(model.parameters())
    kind = OffloadedKVCache if offload else KVCache
    return kind(cfg.n_layers, max(1, len(prompts)), longest, cfg.k_shape, cfg.v_shape,
                dtype=weight.dtype, device=weight.device)


def _limits(prompts: Sequence[Sequence[int]], new_tokens: Union[int, Sequence[int]]) -> List[int]:
    limits = [int(new_tokens)] * len(prompts) if isinstance(new_tokens, int) else [int(n) for n in new_tokens]
    if len(limits) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(limits)} new-token counts")
    if any(n < 1 for n in limits):
        raise ValueError(f"every request generates at least one token, got {min(limits)}")
    return limits


@torch.no_grad()
def greedy_generate(model: DecodeModel, prompts: Sequence[Sequence[int]], new_tokens: Union[int, Sequence[int]],
                    stop_token: Optional[int] = None, cache: Optional[KVCache] = None,
                    mode: str = "serial") -> List[List[int]]:
    """Each prompt's greedy continuation (argmax of the LM head), at most ``new_tokens`` long (one count, or one
    per prompt), ending at ``stop_token`` (included) where it comes; the decode steps run in ``mode``
    (`microbatch.DECODE_MODES`; every rank passes the same). `generate`'s tokens."""
    return generate(model, prompts, new_tokens, stop_token=stop_token, cache=cache, mode=mode).tokens


@torch.no_grad()
def generate(model: DecodeModel, prompts: Sequence[Sequence[int]], new_tokens: Union[int, Sequence[int]], *,
             stop_token: Optional[int] = None, cache: Optional[KVCache] = None, mode: Optional[str] = None,
             prefill_mode: str = "serial", on_step: Optional[OnStep] = None, margins: bool = False,
             buckets: Optional[Sequence[int]] = None, plan: Optional[DecodeCalibration] = None,
             margin: float = DEFAULT_MARGIN, guard: Union[bool, DecodeGuard] = True, graph: Optional[str] = None,
             decoder: Optional[Decoders] = None, length_buckets: bool = False) -> Generated:
    """Greedy generation (see the module docstring): prefill in ``prefill_mode``, decode steps in ``mode``.

    ``prompts``: this rank's requests' token ids (none is fine with several ranks); ``new_tokens``: the most
    each generates (one count, or one per prompt); ``cache``: where the keys and values go (default
    `new_cache`; its slots are taken and freed here); ``on_step(step, active)`` is called once each step's
    tokens are taken, with the number of requests still active on every rank; where it returns True the caller
    observes the next step (a timeline), whose time the guard then does not count; ``buckets``: the sizes a step's
    exchange is padded to (`bucket_of`; default the powers of two). ``mode="auto"`` chooses each step's mode
    from ``plan`` (`launch.decode_plan.calibrate_decode`; the same on every rank), serial unless another is
    predicted at least ``margin`` faster (`microbatch.planning.choose_decode`), and checks its choices with
    ``guard`` (`microbatch.planning.DecodeGuard`: each step timed, the slowest rank's time agreed with the step; a
    mode measured slower than serial is set aside): True for a new one, one of your own to keep what it measured
    across generations, False for none. ``graph``: decode steps padded to
    their bucket and captured once per bucket on that path (`launch.graph_decode.GraphDecoder`: ``ge``,
    ``aclgraph``, ``cuda``; ``cpu`` runs the padded step eagerly; ``length_buckets``: attention over the room
    the histories use, a graph per bucket and length), or through ``decoder`` (its cache, mode and graphs, kept
    across generations). With ``mode="auto"`` the steps are captured too: ``decoder`` is then a
    mapping of each mode of ``plan`` to its decoder over one cache (``graph`` builds them), and ``plan`` a
    calibration of those captured steps (`launch.decode_plan.calibrate_decode` with ``decoders``).
    """
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    limits = _limits(prompts, new_tokens)
    if mode is None:
        mode = AUTO if isinstance(decoder, Mapping) else decoder.mode if decoder is not None else "serial"
    if mode == AUTO and plan is None:
        raise ValueError("decode mode 'auto' chooses each step's mode from a decode calibration: pass "
                         "plan=launch.decode_plan.calibrate_decode(model, ...)")
    captured = graph is not None or decoder is not None
    if mode == AUTO and plan.padded != captured:
        raise ValueError("decode mode 'auto' with captured steps chooses from a calibration of them "
                         "(calibrate_decode(model, decoders=...))" if captured else
                         "this decode calibration timed captured steps: pass their decoders (decoder=...)")
    hows = {m: microbatch.decode_mode(m) for m in (plan.modes if mode == AUTO else (mode,))}
    layers = {m: model.decode_layer_operations(h.moe_chunks) for m, h in hows.items()}  # a model that cannot decode
    group = expert_group(model)  # says so first
    if decoder is None and graph is not None:
        shared = cache or new_cache(model, prompts, limits)
        decoder = GraphDecoder(model, shared, mode, graph, buckets, length_buckets=length_buckets) \
            if mode != AUTO else {m: GraphDecoder(model, shared, m, graph, buckets, length_buckets=length_buckets)
                                  for m in plan.modes}
    decoders = _decoders_for(decoder, mode, hows, cache)
    if decoders:
        cache = next(iter(decoders.values())).cache
    cache = cache or new_cache(model, prompts, limits)
    slots = cache.admit(len(prompts))
    device = next(model.parameters()).device
    lens = [len(p) for p in prompts]
    tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    hidden = _prefill(model, Batch(tokens, SeqInfo.from_lens(lens)), cache, slots, prefill_mode, group)
    last = torch.tensor(lens, dtype=torch.long, device=device).cumsum(0) - 1
    out = Generated([[] for _ in prompts], [[] for _ in prompts] if margins else None)
    active = list(range(len(prompts)))
    nxt, gaps, problem = _greedy(model.logits(hidden[last]), active, 0, margins)
    per_row = history_weight(model)
    counts = sorted({h.micro_batches for h in hows.values()})
    checks = _guard_for(mode, guard)
    ran: Optional[_Ran] = None  # auto's last step
    while True:
        still = []
        for j, (i, t) in enumerate(zip(active, nxt)):
            out.tokens[i].append(t)
            if out.margins is not None and gaps:  # a captured step picks without margins
                out.margins[i].append(gaps[j])
            if len(out.tokens[i]) < limits[i] and t != stop_token:
                still.append(i)
        going = set(still)
        cache.release([slots[i] for i in active if i not in going])
        history = [lens[i] + len(out.tokens[i]) - 1 for i in still]  # rows held before this step's
        if not decoders:
            splits = {n: split_by_cost(history, n, per_row) for n in counts}
            widest = {n: max(map(len, p)) for n, p in splits.items()}
        else:  # its static step attends over the whole cache: a contiguous cut, no cost to balance
            widest = {d.micro_batches: d.widest(len(still)) for d in decoders.values()}
        took = time.perf_counter() - ran.start if ran is not None else 0.0
        built = ran is not None and _builds(decoders) != ran.builds
        step = _step_status(_Post(len(still), widest, max(history, default=0), mode, took, built), problem, group)
        if ran is not None and checks is not None and not ran.observed and not step.built:
            checks.record(ran.mode, ran.predicted, step.seconds)  # a step that lowered or captured is no measurement
        observed = bool(on_step(out.steps, step.active)) if on_step is not None else False
        if not step.active:
            return out
        out.steps += 1
        name = mode
        if mode == AUTO:
            if checks is not None:
                choice = checks.choose(plan, step.tokens, step.history, margin=margin)
            else:
                choice = choose_decode(plan, step.tokens, step.history, margin=margin)
            name = choice.mode
            out.predicted.append(choice.seconds)
            ran = _Ran(name, choice.seconds, time.perf_counter(), observed, _builds(decoders))
        out.modes.append(name)
        if decoders:  # padded to the bucket, the bucket's graph replayed; it counts the rows itself
            run = decoders[name]
            ids = run.step([slots[i] for i in still], [out.tokens[i][-1] for i in still],
                           widest=step.widest[run.micro_batches], history=step.history)
            active = still
            nxt, gaps, problem = read_picked(Picked(ids), active, out.steps)
            continue
        how = hows[name]
        parts = splits[how.micro_batches]
        capacity = bucket_of(step.widest[how.micro_batches], buckets)
        order = [still[j] for part in parts for j in part]
        steps, inputs = [], []
        for part in parts:  # a part may be empty: its micro-batch takes part with zero tokens
            requests = [still[j] for j in part]
            steps.append(KVStep(cache, cache.rows([slots[i] for i in requests])))
            step_tokens = torch.tensor([out.tokens[i][-1] for i in requests], dtype=torch.long, device=device)
            inputs.append({TOKENS: step_tokens, KV_STEP: steps[-1], MOE_CAPACITY: capacity, MOE_ACTIVE: None})
        with overlap.no_host_sync(f"{DECODE_STEP} {out.steps}"):
            picked = decode_step(model, layers[name], how.make, inputs, margins)
        for kv in steps:
            cache.advance(kv.rows)
        active = order
        nxt, gaps, problem = read_picked(picked, active, out.steps)


def _decoders_for(decoder: Optional[Decoders], mode: str, hows: Mapping[str, microbatch.Mode],
                  cache: Optional[KVCache]) -> Dict[str, GraphDecoder]:
    """The decoder of each mode a generation may run (none: eager steps), checked against ``mode`` (auto: every
    calibrated mode's, over one cache) and ``cache``; a one-line ValueError for what does not fit."""
    if decoder is None:
        return {}
    if mode != AUTO:
        if not isinstance(decoder, GraphDecoder) or decoder.mode != mode or cache not in (None, decoder.cache):
            raise ValueError(f"the decoder runs its own mode over its own cache: pass neither another mode ({mode!r}) "
                             f"nor another cache")
        return {mode: decoder}
    if not isinstance(decoder, Mapping):
        raise ValueError("decode mode 'auto' takes one decoder per calibrated mode: decoder={mode: GraphDecoder}")
    chosen = decoders_of(decoder, list(hows))
    if cache not in (None, next(iter(chosen.values())).cache):
        raise ValueError("auto's decoders run over their own cache: pass no other cache")
    return chosen


def _guard_for(mode: str, guard: Union[bool, DecodeGuard]) -> Optional[DecodeGuard]:
    """Auto's guard: a new one for True, the caller's own kept across generations, none for False or a fixed mode."""
    if mode != AUTO or guard is False:
        return None
    return DecodeGuard() if guard is True else guard


def _prefill(model: DecodeModel, batch: Batch, cache: KVCache, slots: List[int], mode: str,
             group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Final (normed) hidden states of the prompts through ``mode``'s schedule, every layer's keys and values
    written to the cache right after its attention (the split agreed by every rank where it cuts)."""
    plan = split_for(mode, batch, group, model=model, alone=group is None)
    rows = cache.rows(slots, batch.seq.seq_lens)
    layers = [after_attention(ops, Operation("kv_write", functools.partial(_write, cache, li),
                                             (K, V, _PREFILL_ROWS), ()))
              for li, ops in enumerate(model.layer_operations())]
    inputs = micro_batch_inputs(model, batch, plan)
    bounds = (0,) + tuple(plan.points) + (batch.seq.num_tokens,)
    for mb, values in enumerate(inputs):  # each micro-batch's tokens are a contiguous slice of the batch
        values[_PREFILL_ROWS] = dataclasses.replace(rows, where=rows.where[bounds[mb]:bounds[mb + 1]])
    finals = [model.norm(h) for h in microbatch.run_made(microbatch.mode(mode).make, layers, inputs)]
    cache.advance(rows)
    return finals[0] if plan.serial else merge_outputs(plan, *finals)


def _write(cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor, rows: KVRows) -> None:
    cache.write(layer, rows, k, v)


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


def _greedy(logits: torch.Tensor, requests: List[int], step: int, margins: bool
            ) -> Tuple[List[int], List[float], Optional[str]]:
    """Each row's argmax, the gap to its runner-up (with ``margins``), and what is wrong where a row holds NaN or
    inf (naming its request and the step)."""
    bad = (~torch.isfinite(logits)).any(-1).nonzero().flatten().tolist()
    problem = None
    if bad:
        problem = (f"NaN or inf in the logits of request {requests[bad[0]]} at decode step {step} (0: the prefill's)"
                   + (f" and of {len(bad) - 1} more" if len(bad) > 1 else ""))
    gaps: List[float] = []
    if margins and logits.shape[0] and logits.shape[-1] > 1:
        top = logits.float().topk(2, dim=-1).values
        gaps = (top[:, 0] - top[:, 1]).tolist()
    return logits.argmax(-1).tolist(), gaps, problem


class _Ran(NamedTuple):
    """Auto's last step, as its guard needs it once the step is done."""

    mode: str
    predicted: float  # seconds
    start: float  # perf_counter
    observed: bool  # the caller recorded its launches (`OnStep`)
    builds: Tuple[int, int]  # `_builds` before it


@dataclasses.dataclass(frozen=True)
class _Post:
    """What a rank posts before a step: its active requests, its widest micro-batch for each micro-batch count a
    candidate mode uses, its longest history, and the decode mode (which every rank must share)."""

    active: int
    widest: Dict[int, int]
    history: int
    mode: str
    seconds: float = 0.0  # the last step's time on this rank (auto's guard; 0 before the first)
    built: bool = False  # the last step lowered a schedule or captured a bucket on this rank


@dataclasses.dataclass(frozen=True)
class _Step:
    """A step as every rank agreed it: requests active on all ranks, the most on one rank (``tokens``), the widest
    micro-batch of any rank per micro-batch count, and the longest history."""

    active: int
    tokens: int
    widest: Dict[int, int]
    history: int
    seconds: float = 0.0  # the last step's time on the slowest rank
    built: bool = False  # the last step lowered a schedule or captured a bucket on some rank


def _step_status(post: _Post, problem: Optional[str], group: Optional[dist.ProcessGroup]) -> _Step:
    """The step every rank of ``group`` agreed (`_Step`), once they agree on the decode mode; `NonFiniteLogits` on
    every rank, naming the rank, where one found NaN or inf (`overlap.agree`: one small all-reduce; none without a
    group)."""
    if group is None:
        if problem:
            raise NonFiniteLogits(problem)
        return _Step(post.active, post.active, dict(post.widest), post.history, post.seconds, post.built)
    mine = {"active": post.active, "widest": [post.widest[n] for n in sorted(post.widest)],
            "history": post.history, "decode mode": post.mode, "seconds": post.seconds, "built": post.built}
    posts = overlap.agree(mine, overlap.GroupTransport(group, "decode.step"), problems=[problem] if problem else [],
                          per_rank=["active", "widest", "history", "seconds", "built"], error=DecodeError,
                          problem_error=NonFiniteLogits)
    widest = {n: max(p["widest"][i] for p in posts) for i, n in enumerate(sorted(post.widest))}
    return _Step(sum(p["active"] for p in posts), max(p["active"] for p in posts), widest,
                 max(p["history"] for p in posts), max(float(p["seconds"]) for p in posts),
                 any(p["built"] for p in posts))


def _builds(decoders: Mapping[str, GraphDecoder]) -> Tuple[int, int]:
    """What this process has built so far: schedules lowered (`microbatch.replay_stats`), buckets captured. A step
    that builds pays for it once (a lowering; on a device a capture or a compile): its time is no measurement."""
    return microbatch.replay_stats()["lowered"], sum(len(d.compiled_steps) for d in decoders.values())


def first_difference(tokens: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]
                     ) -> Optional[Tuple[int, int]]:
    """``(request, step)`` of the first token (by step, then request) where ``tokens`` differ from ``reference``
    (a missing or extra token counts), or None."""
    first: Optional[Tuple[int, int]] = None
    for i, (a, b) in enumerate(zip(tokens, reference)):
        at = next((s for s, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is None and len(a) != len(b):
            at = min(len(a), len(b))
        if at is not None and (first is None or at < first[1]):
            first = (i, at)
    if len(tokens) != len(reference):
        first = first or (min(len(tokens), len(reference)), 0)
    return first


__all__ = ["AUTO", "DECODE_STEP", "TOKENS", "DecodeError", "Decoders", "Generated", "NonFiniteLogits", "Picked",
           "bucket_of", "decode_step", "expert_group", "first_difference", "generate", "greedy_generate",
           "history_weight", "new_cache", "split_by_cost"]
