"""Decode at its edges, each test one that a realistic bug in the decode code fails (issue 57, "Tests that would
not notice"): a NaN that first appears after the prefill, eager and captured; each step's attention length with
length buckets; a cache filled exactly to its room; auto's ``margin`` on its way to the choice."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from launch.engine import MIN_LENGTH, GraphDecoder, NonFiniteLogits, generate, new_cache
from launch.models import build_model, preset
from microbatch import KVCache, KVCacheError
from microbatch.planning import DecodeCalibration, DecodeGuard

CFG = dataclasses.replace(preset("tiny"), n_experts=12)  # over 1 or 2 ranks (as tests/test_decode.py)
POISON_AFTER = 1  # the step after whose tokens the last rank's LM head turns NaN: its logits go NaN at the next


def _prompts(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab, (n,), generator=g).tolist() for n in lens]


def _poison_after(model, step):
    """An ``on_step`` that turns one row of ``model``'s LM head NaN once step ``step``'s tokens are taken, so
    every logit row of the steps after it holds a NaN (and none before)."""
    head = model.embed if model.lm_head is None else model.lm_head

    def on_step(number, active):
        if number == step:
            with torch.no_grad():
                head.weight[7, 0] = float("nan")
    return on_step


def _late_nan_body(ctx, graph):
    """This rank's error where the last rank's logits first go NaN at decode step 2."""
    from launch.engine import make_expert_parallel

    model = build_model(CFG, seed=5)
    if ctx.world_size > 1:
        model = make_expert_parallel(model, ctx.group)
    last = ctx.rank == ctx.world_size - 1
    on_step = _poison_after(model, POISON_AFTER) if last else None
    try:
        generate(model, _prompts((3, 2), seed=ctx.rank), 6, mode="two-batch", graph=graph, on_step=on_step)
    except NonFiniteLogits as err:
        return str(err)
    return "no error"


@pytest.mark.cpu_only
@pytest.mark.parametrize("graph", [None, "cpu"])
@pytest.mark.parametrize("world", [1, 2])
def test_nan_first_at_a_decode_step_stops_every_rank_naming_rank_request_and_step(world, graph):
    """The prefill's and step 1's logits are finite, step 2's hold NaN on the last rank, in the eager step and in
    the padded, captured one (``cpu`` runs it eagerly): every rank raises `NonFiniteLogits` naming the rank, the
    request and the step (on two ranks once the lagged agreement carries it), none takes a token from them."""
    from overlap.multirank import run_ranks

    messages = run_ranks(_late_nan_body, world, graph, timeout=180)
    named = f"NaN or inf in the logits of request 0 at decode step {POISON_AFTER + 1}"
    assert all(named in m and (world == 1 or f"rank {world - 1}: " in m) for m in messages), messages


def _length_of(history, room):
    """The length a step attends over with length buckets: the smallest power of two (at least `MIN_LENGTH`, at
    most the room) that holds ``history`` rows and the step's own."""
    length = MIN_LENGTH
    while length < history + 1:
        length *= 2
    return min(length, room)


@pytest.mark.cpu_only
def test_each_step_with_length_buckets_attends_over_the_bucket_of_the_longest_history_it_holds():
    """Step by step (not the set of lengths): each step attends over the smallest length bucket holding the longest
    history held at that step and its new row, across 16 and 32 (a step holding 15 rows attends over 16)."""
    model = build_model(CFG, seed=4)
    prompts, limits = _prompts((11, 4), seed=30), [24, 6]
    decoder = GraphDecoder(model, new_cache(model, prompts, limits), "serial", "cpu", length_buckets=True)
    room, cache, seen, step = decoder.cache.max_len, decoder.cache, [], decoder.step

    def stepping(slots, tokens, widest=None, history=None):
        longest = max(cache.lengths[s] for s in slots)
        seen.append((longest, decoder.length(longest if history is None else history)))
        return step(slots, tokens, widest, history)
    decoder.step = stepping
    got = generate(model, prompts, limits, decoder=decoder)
    assert got.tokens == generate(model, prompts, limits).tokens
    assert [held for held, _ in seen] == list(range(11, 11 + 23)), seen  # one step per row of request 0
    assert [length for _, length in seen] == [_length_of(held, room) for held, _ in seen], seen


def _exact_cache(model, rows):
    """A one-slot cache of the model's shapes with room for exactly ``rows`` rows."""
    weight = next(model.parameters())
    return KVCache(model.cfg.n_layers, 1, rows, model.cfg.k_shape, model.cfg.v_shape, dtype=weight.dtype,
                   device=weight.device)


@pytest.mark.cpu_only
@pytest.mark.parametrize("graph", [None, "cpu"])
def test_a_cache_takes_its_last_row_and_refuses_one_more(graph):
    """A prompt of 5 rows and 4 new tokens write 8 rows (the last token is never fed back): a cache of room 8 holds
    them, eager and captured, with the tokens of a roomier cache; a fifth token's row is refused in one line."""
    model = build_model(CFG, seed=4)
    prompts = _prompts((5,), seed=31)
    want = generate(model, prompts, 5).tokens
    got = generate(model, prompts, 4, cache=_exact_cache(model, 8), graph=graph).tokens
    assert got == [want[0][:4]]
    with pytest.raises(KVCacheError) as err:
        generate(model, prompts, 5, cache=_exact_cache(model, 8), graph=graph)
    assert "exceed its room of 8" in str(err.value) and "\n" not in str(err.value), str(err.value)


# two-batch predicted 8% faster than serial everywhere, with no noise: a margin of 5% takes it, one of 10% does not
EIGHT_PERCENT = DecodeCalibration((1, 2, 3), (4, 20), {"serial": ((1.0, 1.0), (2.0, 2.0), (3.0, 3.0)),
                                                       "two-batch": ((0.92, 0.92), (1.84, 1.84), (2.76, 2.76))})


@pytest.mark.cpu_only
@pytest.mark.parametrize("guard", [False, True])
def test_autos_margin_reaches_the_choice_with_the_guard_and_without(guard):
    """``generate(mode="auto", margin=...)``: a mode predicted 8% faster than serial is taken at a margin of 5% and
    never at 10%, through the guard (its serial probes aside) as without it."""
    model = build_model(CFG, seed=4)
    prompts = _prompts((4, 3, 5), seed=32)

    def modes(margin):
        checks = DecodeGuard(min_samples=1) if guard else False
        return set(generate(model, prompts, 8, mode="auto", calibration=EIGHT_PERCENT, margin=margin,
                            guard=checks).modes)
    assert "two-batch" in modes(0.05)
    assert modes(0.10) == {"serial"}
