"""Greedy decode with the device KV cache equals recomputing the whole sequence at every step."""
import dataclasses

import pytest
import torch

from launch.engine import DECODE_STEP, bucket_of, generate, greedy_generate, split_by_cost
from launch.measure.generate import first_difference
from launch.models import build_model, preset
from microbatch import DECODE_MODES, MODES, Batch, SeqInfo


def _recomputed(model, prompts, new_tokens, stop_token=None):
    """The oracle: every step runs the model over prompt + tokens so far and takes the last token's argmax."""
    out = []
    for p in prompts:
        seq = list(p)
        gen = []
        while len(gen) < new_tokens:
            hidden = model(Batch(torch.tensor(seq), SeqInfo.from_lens([len(seq)])))
            t = int(model.logits(hidden[-1:]).argmax(-1))
            gen.append(t)
            seq.append(t)
            if t == stop_token:
                break
        out.append(gen)
    return out


def test_cached_decode_generates_the_tokens_of_recomputing_every_step():
    model = build_model(preset("tiny"), seed=3)  # dense and MoE layers
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.vocab, (n,), generator=g).tolist() for n in (7, 1, 12)]
    want = _recomputed(model, prompts, 6)
    assert greedy_generate(model, prompts, 6) == want
    stop = want[0][2]  # request 0 stops at its third token; the others go on past it (or stop there too)
    got = greedy_generate(model, prompts, 6, stop_token=stop)
    assert got == _recomputed(model, prompts, 6, stop_token=stop) and len(got[0]) == 3


PLANS = {  # per world size, per rank: (prompt lengths, new tokens)
    2: [((6, 3), 5), ((4,), 1)],  # rank 1's only request ends at prefill: it takes part with zero tokens
    3: [((5,), 6), ((), 4), ((3, 8, 2), 2)],  # rank 1 brings nothing; rank 2 is done after two tokens
    4: [((2,), 3), ((), 2), ((7, 1), 4), ((3,), 1)],
}
CFG = dataclasses.replace(preset("tiny"), n_experts=12)  # over 2, 3 or 4 ranks


def _ranks_body(ctx):
    from launch.engine import make_expert_parallel
    from overlap import HostSyncs, Sanitizer

    lens, new_tokens = PLANS[ctx.world_size][ctx.rank]
    g = torch.Generator().manual_seed(10 + ctx.rank)
    dense = build_model(CFG, seed=3)
    prompts = [torch.randint(0, dense.cfg.vocab, (n,), generator=g).tolist() for n in lens]
    want = _recomputed(dense, prompts, new_tokens)
    model = make_expert_parallel(build_model(CFG, seed=3), ctx.group)
    modes = DECODE_MODES if ctx.world_size == 2 else ("serial",)  # every mode once, on two ranks
    got, synced = {}, {}
    for mode in modes:
        prefill = mode if mode in MODES else "serial"
        with Sanitizer(), HostSyncs() as syncs:  # the sanitizer raises on the first race between streams
            got[mode] = generate(model, prompts, new_tokens, mode=mode, prefill_mode=prefill).tokens
        synced[mode] = [str(s) for s in syncs.inside() if s.scope != f"{DECODE_STEP} 1"]
    return got, want, synced


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_that_finish_at_different_steps_take_part_until_every_rank_is_done(world):
    """Experts over 2, 3 and 4 ranks; a rank with no prompt, one whose request ends at prefill, one that finishes
    steps before the others: each rank's tokens equal recomputing its requests on one process, and no rank
    is left in an exchange (the test's timeout bounds a hang). On two ranks in every decode mode (prefill and
    decode in its schedule, some micro-batches empty on the rank with fewer requests; the chunked modes after a
    serial prefill, their chunks empty where a rank has fewer tokens than chunks), race-free under the sanitizer.
    No decode step after the first reads the device on the host (`overlap.HostSyncs`: its exchange has static
    shapes, its checks and its pick stay on the device)."""
    from overlap.multirank import run_ranks

    for rank, (got, want, synced) in enumerate(run_ranks(_ranks_body, world, timeout=240)):
        assert set(got) == (set(DECODE_MODES) if world == 2 else {"serial"})
        for mode, tokens in got.items():
            assert tokens == want, (rank, mode, tokens, want)
            assert synced[mode] == [], (rank, mode, synced[mode])


def test_every_mode_generates_serials_tokens():
    """Prefill and decode steps in every mode's schedule on one process (the prompts split as prefill splits
    them, each micro-batch writing its rows of the cache; the active requests cut into the mode's micro-batches)
    generate serial's tokens, race-free under the sanitizer. (Two ranks: the ranks test above.)"""
    from overlap import Sanitizer

    g = torch.Generator().manual_seed(20)
    model = build_model(CFG, seed=4)
    prompts = [torch.randint(0, CFG.vocab, (n,), generator=g).tolist() for n in (6, 3, 9, 2, 5)]
    got = {}
    for mode in MODES:
        with Sanitizer():  # raises on the first race between streams
            got[mode] = generate(model, prompts, 5, mode=mode, prefill_mode=mode).tokens
    for mode, tokens in got.items():
        assert tokens == got["serial"], (mode, tokens, got["serial"])


def _poisoned_body(ctx):
    from launch.engine import NonFiniteLogits
    from launch.engine import make_expert_parallel

    model = build_model(CFG, seed=5)
    if ctx.world_size > 1:
        model = make_expert_parallel(model, ctx.group)
    if ctx.rank == ctx.world_size - 1:  # this rank's LM head turns one vocabulary row into NaN
        head = model.embed if model.lm_head is None else model.lm_head
        with torch.no_grad():
            head.weight[7, 0] = float("nan")
    try:
        greedy_generate(model, [[1, 2, 3]], 4)
    except NonFiniteLogits as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("world", [1, 2])
def test_nan_in_one_ranks_logits_stops_every_rank_naming_it(world):
    from overlap.multirank import run_ranks

    messages = run_ranks(_poisoned_body, world, timeout=120)
    named = "NaN or inf in the logits of request 0 at decode step 0" if world == 1 else \
        f"rank {world - 1}: NaN or inf in the logits of request 0 at decode step 0"
    assert all(named in m for m in messages), messages  # every rank stops, naming the rank that found it


def test_each_request_stops_at_its_own_count():
    model = build_model(preset("tiny"), seed=3)
    prompts = [[1, 2, 3], [4, 5], [6]]
    want = _recomputed(model, prompts, 5)
    got = greedy_generate(model, prompts, [5, 1, 3])
    assert got == [want[0], want[1][:1], want[2][:3]]


def test_requests_are_split_by_their_cost_not_their_count():
    """A request with a long history costs as much as several short ones: the parts balance the cost."""
    parts = split_by_cost([100, 1, 1, 1, 1], 2, per_token=1.0)
    assert parts == [[0], [1, 2, 3, 4]]
    assert split_by_cost([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]  # equal costs: equal counts
    assert split_by_cost([3], 3) == [[0], [], []]  # fewer requests than parts: some empty
    assert sorted(j for p in split_by_cost([7, 2, 9, 4, 4, 1], 4, 3.0) for j in p) == list(range(6))


def test_margins_are_the_gap_between_the_top_two_logits():
    model = build_model(preset("tiny"), seed=3)
    out = generate(model, [[1, 2, 3], [4]], 3, margins=True)
    assert [len(m) for m in out.margins] == [len(t) for t in out.tokens] and out.steps == 2
    hidden = model(Batch(torch.tensor([1, 2, 3]), SeqInfo.from_lens([3])))
    top = model.logits(hidden[-1:]).topk(2).values[0]
    assert out.margins[0][0] == pytest.approx(float(top[0] - top[1]), rel=1e-5) and out.margins[0][0] >= 0


def test_first_difference_is_the_earliest_step():
    assert first_difference([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) is None
    assert first_difference([[1, 2, 9], [4, 7]], [[1, 2, 3], [4, 5]]) == (1, 1)
    assert first_difference([[1, 2], [4, 5]], [[1, 2, 3], [4, 5]]) == (0, 2)  # a missing token counts


def test_the_reference_decoder_implements_the_decode_contract():
    from microbatch import DecodeModel
    from support.protocols import protocol_problems

    model = build_model(preset("tiny"), seed=3)
    assert protocol_problems(model, DecodeModel) == []
    model.decode_layer_operations = None  # the check fails on a decoder without it
    assert protocol_problems(model, DecodeModel) == ["Model.decode_layer_operations: not callable (DecodeModel has "
                                                     "this method)"]


@pytest.mark.parametrize("kind", ["eager", "captured"])
def test_both_decoders_implement_the_decoder_interface(kind):
    """The generation's loop runs every decode step through a `Decoder`: the eager one and the captured one
    implement it member by member (name and signature), and the check fails on one without a member."""
    from launch.engine import Decoder, EagerDecoder, GraphDecoder, new_cache
    from support.protocols import Without, protocol_problems

    model = build_model(preset("tiny"), seed=3)
    cache = new_cache(model, [[1, 2, 3]], 2)
    decoder = EagerDecoder(model, cache, "two-batch") if kind == "eager" else GraphDecoder(model, cache, "two-batch")
    assert protocol_problems(decoder, Decoder) == []
    name = type(decoder).__name__
    assert protocol_problems(Without(decoder, "parts"), Decoder, name) == [
        f"{name}.parts: missing (Decoder has this method)"]
    assert protocol_problems(Without(decoder, "built"), Decoder, name) == [
        f"{name}.built: missing (Decoder has this property)"]
    assert protocol_problems(Without(decoder, "cache"), Decoder, name) == [
        f"{name}.cache: missing (Decoder has this data)"]


def test_a_steps_exchange_is_padded_to_the_bucket_of_its_widest_micro_batch():
    assert [bucket_of(n) for n in (0, 1, 2, 3, 5, 8, 9, 200)] == [1, 1, 2, 4, 8, 8, 16, 256]
    assert [bucket_of(n, (4, 16)) for n in (1, 4, 5, 16, 17)] == [4, 4, 16, 16, 17]  # past the largest: itself


def _placement_body(ctx, agreement):
    """Each agreement sent and read, and each step run, in order on this rank; the agreements' spans."""
    import overlap
    from launch.engine import EagerDecoder, make_expert_parallel
    from overlap import Timeline
    from overlap.observability import _png

    model = make_expert_parallel(build_model(CFG, seed=3), ctx.group)
    g = torch.Generator().manual_seed(50 + ctx.rank)
    prompts = [torch.randint(0, CFG.vocab, (n,), generator=g).tolist() for n in ((4, 6, 3) if ctx.rank == 0 else (5,))]
    events = []
    real_send, real_run = overlap.agree_later, EagerDecoder.run

    def send(*args, **kwargs):
        pending, n = real_send(*args, **kwargs), len([e for e in events if e[0] == "sent"])
        events.append(("sent", n))
        read = pending.result

        def result():
            if ("read", n) not in events:
                events.append(("read", n))
            return read()
        pending.result = result
        return pending

    def run(self, *args, number=None, **kwargs):
        events.append(("run", number))
        return real_run(self, *args, number=number, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(overlap, "agree_later", send)
        mp.setattr(EagerDecoder, "run", run)
        with Timeline() as tl:
            out = generate(model, prompts, [5, 3, 6] if ctx.rank == 0 else [2], mode="two-batch",
                           agreement=agreement)
        overlap.synchronize()
    labelled = [(s.stream, text) for s, text in _png.layer_labels(tl.spans, 0.0) if s.name == "decode.step"]
    return events, out.steps, labelled, out.tokens


def _blocking_waits(events):
    """Each step after the first that waited, before it ran, for an agreement sent after the step before it ran:
    a blocking collective between two steps."""
    bad, last_run_at = [], None
    for i, (what, n) in enumerate(events):
        if what == "run":
            sent_after = [m for w, m in events[last_run_at:i] if w == "sent"] if last_run_at is not None else []
            read_now = [m for w, m in events[last_run_at:i] if w == "read"] if last_run_at is not None else []
            bad += [n] if set(sent_after) & set(read_now) else []
            last_run_at = i
    return bad


def test_a_steps_agreement_travels_under_the_next_step():
    """On two ranks (one with three requests finishing apart, one with one): no step waits for an agreement sent
    after the step before it ran: the agreement on step N is read once step N+1 has run, on its own side stream
    (`launch.engine.step.AGREEMENT`, its span labelled ``decode.step`` in the PNG timeline), and every agreement
    sent is read before the generation returns. With ``agreement="blocking"`` every step waits for its own, on the
    current stream (the check fails there), and the tokens are the same."""
    import overlap
    from launch.engine.step import AGREEMENT
    from overlap.multirank import run_ranks

    lagged = run_ranks(_placement_body, 2, "lagged", timeout=120)
    blocking = run_ranks(_placement_body, 2, "blocking", timeout=120)
    for (events, steps, spans, tokens), (b_events, b_steps, b_spans, b_tokens) in zip(lagged, blocking):
        assert tokens == b_tokens and steps == b_steps == 5, (steps, b_steps)  # no stop token: no extra step
        runs = [n for what, n in events if what == "run"]
        assert runs == list(range(1, steps + 1)), events
        assert _blocking_waits(events) == [], events
        assert _blocking_waits(b_events) == list(range(2, steps + 1)), b_events  # the check can fail
        sent = [n for what, n in events if what == "sent"]
        assert sorted(n for what, n in events if what == "read") == sent == list(range(steps + 1)), events
        assert set(spans) == {(AGREEMENT, "decode.step")} and len(spans) == steps + 1, spans
        assert {stream for stream, _ in b_spans} == {overlap.DEFAULT}, b_spans


def _late_nan_body(ctx, at):
    """This rank's error where the last rank's logits turn NaN at decode step ``at`` (its first request's row)."""
    from launch.engine import NonFiniteLogits, make_expert_parallel

    model = build_model(CFG, seed=5)
    if ctx.world_size > 1:
        model = make_expert_parallel(model, ctx.group)
    if ctx.rank == ctx.world_size - 1:
        real, calls = model.logits, []

        def logits(hidden):  # call 0 is the prefill's
            out = real(hidden)
            calls.append(1)
            if len(calls) == at + 1:
                out = out.clone()
                out[0, 3] = float("nan")
            return out
        model.logits = logits
    try:
        generate(model, [[1, 2, 3], [4, 5]], 6, mode="two-batch")
    except NonFiniteLogits as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("world", [1, 2])
def test_nan_at_a_later_step_stops_every_rank_naming_its_step(world):
    """NaN in one rank's logits at decode step 2: that rank takes no token from them, every rank stops with
    `NonFiniteLogits` naming the rank, the request and the step (on two ranks once the agreement that carries it
    arrives, a step later, with no rank left in a collective: the test's timeout bounds a hang)."""
    from overlap.multirank import run_ranks

    messages = run_ranks(_late_nan_body, world, 2, timeout=120)
    named = "NaN or inf in the logits of request 0 at decode step 2"
    assert all(named in m and (world == 1 or f"rank {world - 1}: " in m) for m in messages), messages


STOP_PLANS = [((6, 3, 4), 6), ((2, 5), 6)]  # per rank: prompt lengths, new tokens


def _stop_body(ctx):
    from launch.engine import make_expert_parallel

    def prompts_of(rank):
        g = torch.Generator().manual_seed(60 + rank)
        return [torch.randint(0, CFG.vocab, (n,), generator=g).tolist() for n in STOP_PLANS[rank][0]]

    dense = build_model(CFG, seed=3)
    stop = _recomputed(dense, prompts_of(0), 6)[0][1]  # rank 0's first request stops at its second token
    prompts, new_tokens = prompts_of(ctx.rank), STOP_PLANS[ctx.rank][1]
    want = _recomputed(dense, prompts, new_tokens, stop_token=stop)
    model = make_expert_parallel(build_model(CFG, seed=3), ctx.group)
    got = {a: generate(model, prompts, new_tokens, stop_token=stop, mode="two-batch", agreement=a)
           for a in ("lagged", "blocking")}
    return want, {a: (g.tokens, g.steps) for a, g in got.items()}


def test_a_stop_token_costs_at_most_one_step_more_and_the_tokens_stay():
    """On two ranks, requests that end at a stop token nobody could foresee: each rank's tokens equal recomputing
    its requests on one process, and the generation takes at most one step more than with each step's own
    agreement (the last one, every rank empty)."""
    from overlap.multirank import run_ranks

    for want, got in run_ranks(_stop_body, 2, timeout=120):
        (lagged, steps), (blocking, waited) = got["lagged"], got["blocking"]
        assert lagged == blocking == want, (lagged, blocking, want)
        assert waited <= steps <= waited + 1, (steps, waited)
