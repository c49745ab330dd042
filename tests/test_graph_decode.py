"""The decode step captured per batch bucket (`launch.engine.graph_decoder`): padded to its bucket, static attention
over the cache, one graph per bucket on ge / aclgraph (traced with torchair's own code,
tests/tools/torchair_contract.py) and on CUDA (``torch.cuda.CUDAGraph``), the tokens of the eager
`launch.engine.generate`."""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import overlap
from launch.engine import DECODE_STEP, GraphDecoder, generate, new_cache
from launch.models import TransformersModel, build_model, preset
from microbatch import KVCache, KVCacheError, OffloadedKVCache
from microbatch.kv_cache import StaticKVStep
from microbatch.planning import DecodeCalibration
from overlap.multirank import run_ranks

H, D = 2, 8
CFG = dataclasses.replace(preset("tiny"), n_experts=12)  # over 1 or 2 ranks (as tests/test_decode.py)


def _prompts(lens, seed, vocab=CFG.vocab):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _prefilled(lens, slots=4, max_len=12):
    """A one-layer cache whose first ``len(lens)`` slots hold random prompts of ``lens`` rows."""
    torch.manual_seed(0)
    cache = KVCache(1, slots, max_len, (H, D))
    held = cache.admit(len(lens))
    rows = cache.rows(held, lens)
    cache.write(0, rows, torch.randn(sum(lens), H, D), torch.randn(sum(lens), H, D))
    cache.advance(rows)
    return cache, held


@pytest.mark.cpu_only
def test_padding_rows_change_no_row_and_static_attention_equals_the_eager_one():
    """A static step of two requests padded to four rows writes exactly the requests' new rows (every other row of
    the cache bitwise as it was: a padding row writes back row 0 of a slot), and each request's attention over the
    whole ``max_len`` with the device mask equals `KVCache.attend` over its own history."""
    cache, (a, b, c) = _prefilled([3, 1, 5])
    before_k, before_v = cache.k.clone(), cache.v.clone()
    rows = cache.static_rows([c, None, a, None])
    k, v, q = (torch.randn(4, H, D) for _ in range(3))
    cache.write_static(0, rows, k, v)
    for now, before in ((cache.k, before_k), (cache.v, before_v)):
        changed = (now != before).flatten(3).any(-1).nonzero().tolist()
        assert sorted(map(tuple, changed)) == sorted([(0, c, 5), (0, a, 3)]), changed
    assert torch.equal(cache.k[0, c, 5], k[0]) and torch.equal(cache.v[0, a, 3], v[2])
    got = cache.attend_static(0, rows, q)
    want = cache.attend(0, cache.rows([c, a]), q[[0, 2]])  # the same rows, written already
    torch.testing.assert_close(got[[0, 2]], want)
    assert torch.isfinite(got).all()  # a padding row attends to one row: no empty softmax
    cache.advance(rows)
    assert [cache.lengths[s] for s in (a, b, c)] == [4, 1, 6]


class _Counted(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.cpu_only
def test_a_static_step_builds_its_attention_mask_once_for_every_layer():
    """Before: every layer built the step's mask again (an arange and a compare a layer: kernels in a captured
    graph), though it depends on the step's rows only."""
    torch.manual_seed(0)
    layers = 3
    cache = KVCache(layers, 4, 16, (H, D))
    held = cache.admit(2)
    prompt = cache.rows(held, [3, 5])
    for layer in range(layers):
        cache.write(layer, prompt, torch.randn(8, H, D), torch.randn(8, H, D))
    cache.advance(prompt)
    rows = cache.static_rows([held[1], None, held[0]])
    step = StaticKVStep(cache, rows)
    kvq = [[torch.randn(3, H, D) for _ in range(3)] for _ in range(layers)]
    with _Counted() as counted:
        got = [step.attend(layer, q, k, v) for layer, (q, k, v) in enumerate(kvq)]
    assert counted.ops["arange"] == 1 and counted.ops["le"] == 1, counted.ops
    for layer, (q, _, _) in enumerate(kvq):  # the same attention as each layer's own mask gives
        torch.testing.assert_close(got[layer], cache.attend_static(layer, rows, q))


@pytest.mark.parametrize("slots, why", [
    ([0, 0], "slot 0 is named twice"), ([3], "not in use"), ([2], "holds no row yet"), ([1], "exceed its room")])
def test_a_static_step_refuses_rows_it_cannot_place(slots, why):
    cache, _ = _prefilled([3, 12])
    cache.admit(1)  # slot 2: admitted, no prompt yet
    with pytest.raises(KVCacheError, match=why):
        cache.static_rows(slots)


def _buckets_seen(decoder, calls):
    """Wrap ``decoder.step`` to append each step's bucket to ``calls``."""
    step = decoder.step

    def stepping(slots, tokens, widest=None, history=None):
        calls.append(decoder.bucket(decoder.widest(len(slots)) if widest is None else widest))
        return step(slots, tokens, widest, history)
    decoder.step = stepping


@pytest.mark.cpu_only
@pytest.mark.parametrize("mode, buckets, want_buckets", [
    ("serial", None, [8, 4, 2, 2, 1]),        # 5, 4, 2, 2, 1 active requests
    ("two-batch", None, [4, 2, 1, 1, 1]),     # micro-batches of at most 3, 2, 1, 1, 1 rows
    ("chunked-2", None, [8, 4, 2, 2, 1]),     # one batch, its MoE in two chunks of half the bucket
    ("serial", (3, 5), [5, 5, 3, 3, 3]),      # the user's buckets (and 5 rows: the batch)
])
def test_the_padded_static_step_generates_the_tokens_of_generate(mode, buckets, want_buckets):
    """One process: requests that finish at different steps shrink the step across buckets; every step padded to
    its bucket (the mode's micro-batches each padded), attention static over the cache, generates exactly the
    eager generate's tokens."""
    model = build_model(CFG, seed=4)
    prompts, limits = _prompts((6, 3, 9, 2, 5), seed=20), [2, 3, 3, 5, 6]
    want = generate(model, prompts, limits, mode=mode).tokens
    decoder = GraphDecoder(model, new_cache(model, prompts, limits), mode, "cpu", buckets)
    calls = []
    _buckets_seen(decoder, calls)
    got = generate(model, prompts, limits, decoder=decoder)
    assert got.tokens == want
    assert calls == want_buckets and decoder.compiled_buckets == sorted(set(want_buckets))
    assert decoder.cache.active == []  # every slot given back


PLANS = [((6, 3, 4), [3, 2, 5]), ((2, 7), [1, 4])]  # per rank: prompt lengths, new tokens; rank 1 ends first


def _count_expert_pairs(mp, pairs):
    """Record, on the device, how many (row, expert) pairs reach this rank's experts in each decode step's MoE."""
    from collectives import CapacityExchange

    run_experts = CapacityExchange.run_experts

    def counted(self, handle, experts):
        pairs.append((handle.recv_ids >= 0).sum())
        return run_experts(self, handle, experts)
    mp.setattr(CapacityExchange, "run_experts", counted)


def _ranks_body(ctx, mode):
    from launch.engine import make_expert_parallel
    from overlap import HostSyncs

    lens, limits = PLANS[ctx.rank]
    prompts = _prompts(lens, seed=30 + ctx.rank)
    model = make_expert_parallel(build_model(CFG, seed=5), ctx.group)
    eager, padded = [], []
    with pytest.MonkeyPatch.context() as mp:
        _count_expert_pairs(mp, eager)
        want = generate(model, prompts, limits, mode=mode).tokens
    with HostSyncs() as syncs, pytest.MonkeyPatch.context() as mp:
        _count_expert_pairs(mp, padded)
        decoder = GraphDecoder(model, new_cache(model, prompts, limits), mode, "cpu")
        calls = []
        _buckets_seen(decoder, calls)
        got = generate(model, prompts, limits, decoder=decoder, prefill_mode="serial")
    in_steps = [str(s) for s in syncs.inside() if (s.scope or "").startswith(DECODE_STEP)]
    pairs = [int(sum(p)) for p in (eager, padded)]
    blocking = GraphDecoder(model, new_cache(model, prompts, limits), mode, "cpu")
    waited = []
    _buckets_seen(blocking, waited)
    assert generate(model, prompts, limits, decoder=blocking, agreement="blocking").tokens == want
    return got.tokens, want, (calls, waited), in_steps, pairs


@pytest.mark.cpu_only
@pytest.mark.parametrize("mode", ["serial", "shared", "chunked-2", "two-batch"])
def test_two_ranks_pad_to_the_bucket_they_agree_on(mode):
    """Experts over two ranks with different requests (rank 1 done two steps early, taking part with padding rows
    only): each step padded to the bucket of the widest micro-batch over the ranks, the same on both, generates
    the eager step's tokens on each rank, with no host sync inside a step; the padding rows reach no expert (the
    experts compute the (row, expert) pairs of the eager steps, which have no padding). The ranks' agreement on a
    step travels under the next one, so a step pads to the widest of one step before (``agreement="blocking"``:
    of its own)."""
    out = run_ranks(_ranks_body, 2, mode, timeout=120)
    for rank, (got, want, (calls, waited), in_steps, (eager, padded)) in enumerate(out):
        assert got == want, (rank, mode, got, want)
        assert in_steps == [], (rank, in_steps)
        assert padded == eager > 0, (rank, mode, padded, eager)
        assert len(calls) == len(waited) and all(a >= b for a, b in zip(calls, waited)), (calls, waited)
        assert calls[1:] == waited[:-1] and calls[0] == waited[0], (calls, waited)  # one step behind
    assert out[0][2] == out[1][2], [o[2] for o in out]
    if mode in ("serial", "shared"):  # 3, 2, 1, 1 active requests on rank 0, the most of the two
        assert out[0][2] == ([4, 4, 2, 1], [4, 2, 1, 1]), out[0][2]


class _Gathered(TorchDispatchMode):
    """The elements each ``index_select`` materialises (the static attention's gathers of keys and values)."""

    def __init__(self):
        super().__init__()
        self.elements = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ == "index_select":
            self.elements.append(out.numel())
        return out


@pytest.mark.cpu_only
def test_a_static_step_with_a_length_reads_that_many_rows_and_attends_alike():
    """Attention over each slot's first ``length`` rows gathers those rows only, and gives what the whole room gives
    (the rows past every row's history are masked either way)."""
    cache, (a, b, c) = _prefilled([3, 1, 5], max_len=32)
    rows = cache.static_rows([c, None, a, None])
    k, v, q = (torch.randn(4, H, D) for _ in range(3))
    cache.write_static(0, rows, k, v)
    whole = cache.attend_static(0, rows, q)
    with _Gathered() as gathered:
        short = StaticKVStep(cache, rows, length=8).attend(0, q, k, v)  # writes the same rows again
    torch.testing.assert_close(short, whole)
    assert gathered.elements == [4 * 8 * H * D] * 2, gathered.elements  # keys and values: 8 rows, not 32
    with _Gathered() as gathered:
        StaticKVStep(cache, rows).attend(0, q, k, v)
    assert gathered.elements == [4 * 32 * H * D] * 2, gathered.elements
    for length in (0, 33):  # beyond the room, or none of it: one line, before any kernel
        with pytest.raises(KVCacheError, match=f"1 to 32 rows of each slot .* got length {length}"):
            StaticKVStep(cache, rows, length=length)


@pytest.mark.cpu_only
@pytest.mark.parametrize("mode", ["serial", "two-batch"])
def test_length_buckets_build_a_step_per_length_and_generate_the_tokens_of_generate(mode):
    """With length buckets the padded step attends over the room the histories use: one step per (bucket, length),
    lengths the powers of two (at least 16) up to the cache's room, and the eager generate's tokens."""
    from launch.engine import MIN_LENGTH

    model = build_model(CFG, seed=4)
    prompts, limits = _prompts((6, 3, 9, 2, 5), seed=20), [12, 3, 30, 5, 20]
    want = generate(model, prompts, limits, mode=mode).tokens
    decoder = GraphDecoder(model, new_cache(model, prompts, limits), mode, "cpu", length_buckets=True)
    room = decoder.cache.max_len
    assert (MIN_LENGTH, room) == (16, 39)  # the longest prompt and the most new tokens
    assert [decoder.length(h) for h in (0, 15, 16, 31, 32, 38)] == [16, 16, 32, 32, room, room]
    got = generate(model, prompts, limits, decoder=decoder)
    assert got.tokens == want
    assert sorted({length for _, length in decoder.compiled_steps}) == [16, 32, room], decoder.compiled_steps
    assert GraphDecoder(model, decoder.cache, mode, "cpu").length(5) == room  # without: the whole room


def _length_ranks_body(ctx):
    from launch.engine import make_expert_parallel

    lens, limits = [(3, 4), (12,)][ctx.rank], [(20, 6), (9,)][ctx.rank]  # rank 1's history is the longer at first
    prompts = _prompts(lens, seed=40 + ctx.rank)
    model = make_expert_parallel(build_model(CFG, seed=5), ctx.group)
    want = generate(model, prompts, limits, mode="serial").tokens
    cache = new_cache(model, [[0] * 12] * 2, [20, 20])  # the same room on both ranks: 32 rows, 2 slots
    decoder = GraphDecoder(model, cache, "serial", "cpu", length_buckets=True)
    lengths, step = [], decoder.step

    def stepping(slots, tokens, widest=None, history=None):
        own = max((cache.lengths[s] for s in slots), default=0)
        lengths.append(decoder.length(own if history is None else history))
        return step(slots, tokens, widest, history)
    decoder.step = stepping
    got = generate(model, prompts, limits, decoder=decoder)
    return got.tokens, want, lengths, decoder.compiled_steps


@pytest.mark.cpu_only
def test_two_ranks_with_length_buckets_attend_over_the_length_they_agree_on():
    """The length follows the longest history over the ranks (rank 1's at first, rank 0's later), so both ranks
    run the same length at every step and build the same steps (on a device their captures' warm-up exchanges
    pair up), and generate the eager tokens."""
    (got0, want0, len0, steps0), (got1, want1, len1, steps1) = run_ranks(_length_ranks_body, 2, timeout=120)
    assert (got0, got1) == (want0, want1)
    assert len0 == len1 and sorted(set(len0)) == [16, 32], (len0, len1)
    assert steps0 == steps1, (steps0, steps1)


@pytest.mark.cpu_only
@pytest.mark.parametrize("length_buckets, timed", [(False, [4]), (True, [4, 20])])
def test_a_calibration_of_steps_with_length_buckets_times_both_histories(tmp_path, length_buckets, timed):
    """A captured step over the whole room takes as long at any history: timed at the short one alone. With length
    buckets it attends over the room the history uses: timed at both, and cached under a key of its own."""
    from launch.engine import calibrate_decode, decode_calibration_key

    model = build_model(CFG, seed=4)
    prompts, limits = [[1] * 4] * 3, [24] * 3
    decoder = GraphDecoder(model, new_cache(model, prompts, limits), "serial", "cpu", length_buckets=length_buckets)
    seen, step = [], decoder.step
    decoder.step = lambda slots, tokens, widest=None, history=None: seen.append(history) or step(
        slots, tokens, widest, history)
    cal = calibrate_decode(model, max_tokens=2, histories=(4, 20), modes=("serial",), repeats=1, steps=1,
                           decoders={"serial": decoder}, cache=str(tmp_path))
    assert sorted(set(seen)) == timed and cal.padded
    key = decode_calibration_key(model, None, (1, 2), (4, 20), ("serial",), 1, 1, graph=("cpu", None, length_buckets))
    assert key["graph"].get("length_buckets", False) == length_buckets  # keys without them stay as they were


class _NotCaptured(torch.nn.Module):
    """Stands for a model whose attention reads the cache itself: it says so, as the transformers adapter does."""

    no_capture_reason = TransformersModel.no_capture_reason


@pytest.mark.parametrize("path, what, why", [
    ("npu", "model", "captures on ge, aclgraph or cuda"),
    ("cpu", "host cache", "needs a device KVCache, got OffloadedKVCache"),
    ("cpu", "other model", "runs the reference decoder"),
    ("ge", "dense moe", "needs every MoE block expert-parallel"),
    ("cpu", "buckets", "buckets must be positive"),
    ("cpu", "mode", "unknown decode mode"),
])
def test_what_it_refuses_it_says_in_one_line(path, what, why):
    model = build_model(CFG, seed=1)
    cache = new_cache(model, [[1, 2]], 2)
    args = dict(model=model, cache=cache, mode="serial", path=path, buckets=None)
    if what == "host cache":
        args["cache"] = OffloadedKVCache(CFG.n_layers, 1, 4, CFG.k_shape, CFG.v_shape)
    elif what == "other model":
        args["model"] = _NotCaptured()
    elif what == "buckets":
        args["buckets"] = [0, 4]
    elif what == "mode":
        args["mode"] = "five-batch"
    try:
        with pytest.raises(ValueError, match=why) as err:
            GraphDecoder(**args)
    finally:
        if what == "host cache":
            args["cache"].close()
    assert "\n" not in str(err.value)


class _Delegate:
    """A model of another class than the reference decoder, every member read through from one."""

    def __init__(self, model, no_capture_reason):
        self._model, self.no_capture_reason = model, no_capture_reason

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_the_models_capture_capability_decides_not_its_class():
    """A model that says its steps can be captured (``no_capture_reason`` None) is captured whatever its class, and
    generates the reference decoder's tokens; one that says why not, of whatever class, is refused with that
    reason in one line (before, the graph decoder asked for the reference decoder's class)."""
    model = build_model(CFG, seed=1)
    prompts = _prompts((3, 5), seed=8)
    want = generate(model, prompts, 4).tokens
    other = _Delegate(model, None)
    assert not isinstance(other, torch.nn.Module)
    decoder = GraphDecoder(other, new_cache(model, prompts, 4), "two-batch", "cpu")
    assert generate(other, prompts, 4, decoder=decoder).tokens == want and decoder.compiled_buckets
    assert generate(other, prompts, 4, graph="cpu").tokens == want
    why = "its attention is computed elsewhere (a test says so)"
    for refused in (_Delegate(model, why), _with_reason(build_model(CFG, seed=1), why)):
        with pytest.raises(ValueError) as err:
            GraphDecoder(refused, new_cache(model, prompts, 4), "serial", "cpu")
        assert str(err.value) == why
        with pytest.raises(ValueError, match="a test says so"):
            generate(refused, prompts, 4, graph="cpu")


def _with_reason(model, why):
    model.no_capture_reason = why  # the reference decoder's own object, saying it cannot be captured
    return model


# ---- captured on ge / aclgraph with torchair's own code, two gloo ranks ------------------------------------------

GRAPH_PLANS = [((5, 2, 3, 2), [2, 2, 4, 4]), ((2, 3, 1), [2, 3, 4])]  # two-batch widest 2, 1, 1: buckets 2, 2, 1
GRAPH_MODE = "two-batch"
GRAPH_PATHS = ("ge", "aclgraph")
AUTO_CALIBRATION = DecodeCalibration((1, 2, 4), (1, 20), {"serial": ((1.0, 1.0), (2.0, 2.0), (4.0, 4.0)),
                                                         GRAPH_MODE: ((3.0, 3.0), (3.0, 3.0), (3.0, 3.0))}, padded=True)


def _graphs_body(ctx):
    from launch.engine import make_expert_parallel
    from tools import torchair_contract as tc

    cfg = preset("tiny", n_dense_layers=0, n_layers=1)  # one MoE layer: each trace costs seconds
    model = make_expert_parallel(build_model(cfg, seed=7), ctx.group)
    lens, limits = GRAPH_PLANS[ctx.rank]
    prompts = _prompts(lens, seed=40 + ctx.rank, vocab=cfg.vocab)
    out = {"want": generate(model, prompts, limits).tokens}  # eager serial
    for path in GRAPH_PATHS:
        graphs = []

        def keep(gm, example_inputs, graphs=graphs):  # keeps the graph, runs it without its air ops
            graphs.append(gm)
            return tc.strip_air(gm)
        decoder = GraphDecoder(model, new_cache(model, prompts, limits), GRAPH_MODE, path, compile_backend=keep)
        with tc.installed(), tc._sanitizer_set_aside(), tc.schedule_checks() as checks:
            got = generate(model, prompts, limits, decoder=decoder)
        out[path] = dict(tokens=got.tokens, steps=got.steps, buckets=decoder.compiled_buckets,
                         graphs=[tc.contract_summary(gm, path) for gm in graphs], checks=checks)
    traced = []  # length buckets on ge: the attention's room a static slice of the cache inside the graph

    def trace(gm, example_inputs):
        traced.append(gm)
        return tc.strip_air(gm)
    decoder = GraphDecoder(model, new_cache(model, prompts, limits), GRAPH_MODE, "ge", compile_backend=trace,
                           length_buckets=True)
    with tc.installed(), tc._sanitizer_set_aside():
        got = generate(model, prompts, limits, decoder=decoder)
    out["lengths"] = dict(tokens=got.tokens, steps=decoder.compiled_steps, graphs=len(traced),
                          room=decoder.cache.max_len)
    graphs = []  # auto on ge: a decoder per mode over one cache, each step replaying the chosen mode's graph

    def count(gm, example_inputs):
        graphs.append(gm)
        return tc.strip_air(gm)
    cache = new_cache(model, prompts, limits)
    decoders = {m: GraphDecoder(model, cache, m, "ge", compile_backend=count) for m in AUTO_CALIBRATION.modes}
    with tc.installed(), tc._sanitizer_set_aside():
        got = generate(model, prompts, limits, mode="auto", calibration=AUTO_CALIBRATION, decoder=decoders,
                       guard=False)
    out["auto"] = dict(tokens=got.tokens, modes=got.modes, graphs=len(graphs),
                       buckets={m: d.compiled_buckets for m, d in decoders.items()})
    torch._dynamo.reset()
    return out


@pytest.fixture(scope="module")
def captured():
    from tools import torchair_contract as tc

    tc.load_torchair()  # skips when the torch_npu wheel cannot be had
    return run_ranks(_graphs_body, 2, timeout=300)


@pytest.mark.spawns_ranks
@pytest.mark.parametrize("path", GRAPH_PATHS)
def test_one_graph_per_bucket_replayed_for_the_steps_of_that_bucket(captured, path):
    """Three decode steps in buckets 2, 2, 1 (the widest micro-batch over the ranks one step before, 2, 1, 1: the
    ranks' agreement travels under the step after it): two graphs, the second step replays the first's; the
    stripped graphs generate eager serial's tokens on each rank."""
    for rank, out in enumerate(captured):
        got = out[path]
        assert got["steps"] == 3 and got["buckets"] == [1, 2], (rank, got["steps"], got["buckets"])
        assert len(got["graphs"]) == 2, (rank, len(got["graphs"]))
        # each bucket's schedule checked and lowered once, before its trace (the prefill's was, by the eager run)
        assert got["checks"] == [False, False], (rank, got["checks"])
        assert got["tokens"] == out["want"], (rank, path, got["tokens"], out["want"])


@pytest.mark.spawns_ranks
def test_length_buckets_trace_on_ge_and_generate_serials_tokens(captured):
    """With length buckets on ge the steps trace with the attention over a static slice of the cache (here the whole
    room: the histories stay under the shortest length), one graph per (bucket, length), the tokens eager serial's."""
    for rank, out in enumerate(captured):
        got = out["lengths"]
        assert got["steps"] == [(1, got["room"]), (2, got["room"])] and got["graphs"] == 2, (rank, got)
        assert got["tokens"] == out["want"], (rank, got["tokens"], out["want"])


@pytest.mark.spawns_ranks
def test_auto_on_ge_replays_the_graph_of_the_mode_it_chooses_for_the_steps_bucket(captured):
    """Auto over captured steps on ge: 4 tokens per rank at the first step (two-batch predicted faster), 2 at the
    next two (serial); each step chosen on the figures of the step before (the ranks' agreement travels under the
    step after it): one graph per mode for its bucket (2), the second step replays two-batch's, and the stripped
    graphs generate eager serial's tokens on each rank."""
    for rank, out in enumerate(captured):
        got = out["auto"]
        assert got["modes"] == [GRAPH_MODE, GRAPH_MODE, "serial"], (rank, got["modes"])
        assert got["buckets"] == {"serial": [2], GRAPH_MODE: [2]} and got["graphs"] == 2, (rank, got)
        assert got["tokens"] == out["want"], (rank, got["tokens"], out["want"])


@pytest.mark.spawns_ranks
@pytest.mark.parametrize("path", GRAPH_PATHS)
def test_decode_exchanges_run_in_the_comm_scope_and_every_cross_stream_read_is_ordered(captured, path):
    """Per micro-batch one dispatch (its metadata in the same exchange) and one combine, in the ``ep_comm``
    scope; every value read on another stream than its writer's ordered after the write (aclgraph: events; ge:
    data and wait_tensor edges), the exchanges in schedule order."""
    for out in captured:
        for g in out[path]["graphs"]:
            assert len(g["a2a_scopes"]) == 2 * 2, g["a2a_scopes"]
            assert all(s.get("_user_stream_label") == overlap.EP_COMM for s in g["a2a_scopes"]), g["a2a_scopes"]
            assert g["a2a_targets"] == ["_c10d_functional.all_to_all_single"]
            assert g["cross_stream_reads"] > 0
            assert g["unordered_reads"] == [], g["unordered_reads"][:5]
            assert g["unordered_exchanges"] == [], g["unordered_exchanges"][:5]


@pytest.mark.spawns_ranks
def test_aclgraph_records_before_every_wait_the_same_events_in_every_bucket(captured):
    for out in captured:
        graphs = out["aclgraph"]["graphs"]
        for g in graphs:
            assert g["namespaces"] == ["npugraph_ex"]
            assert g["event_pairs"] and not g["wait_tensor_streams"]
            for tag, recorded_on, waited_on in g["event_pairs"]:
                assert recorded_on is not None, f"wait for {tag} before any record"
                assert recorded_on == tag.split("@")[1] != waited_on, (tag, recorded_on, waited_on)
        # tagged events are process-wide: each bucket's graph records the same ones, once per (micro-batch, stage)
        tags = [collections.Counter(g["record_tags"]) for g in graphs]
        assert tags[0] == tags[1] and set(tags[0].values()) == {1}, tags
        assert {t.split(".")[0] for t in tags[0]} >= {"mb0", "mb1"}


@pytest.mark.spawns_ranks
def test_ge_orders_with_wait_tensor_and_has_no_events(captured):
    for out in captured:
        for g in out["ge"]["graphs"]:
            assert g["namespaces"] == ["air"]
            assert not any(op.startswith("tagged_event") for op in g["air"]), g["air"]
            assert not g["record_tagged_stream"]
            assert g["wait_tensor_streams"] and g["consumed_waits"] > 0
            assert any(op.startswith("scope_enter(_user_stream_label=ep_comm") for op in g["air"])


def _missing_paths_body(ctx):
    from launch.engine import capture_problem, make_expert_parallel

    model = make_expert_parallel(build_model(CFG, seed=6), ctx.group)
    out = {}
    for path in ("cuda", "ge", "aclgraph"):
        if capture_problem(path, "cpu") is None:
            continue  # this machine can capture on it
        try:
            GraphDecoder(model, new_cache(model, [[1, 2]], 2), "serial", path)
            out[path] = None
        except ValueError as exc:
            out[path] = str(exc)
    return out


def test_a_path_this_machine_cannot_capture_on_is_one_line_when_the_decoder_is_built():
    """On a machine without the path's device (this CPU one: all three), ``GraphDecoder(path=...)`` says so in one
    line when it is built, before any step or collective (before: built, then a RuntimeError, a
    ModuleNotFoundError or an InvalidBackend at the first step's capture)."""
    out = run_ranks(_missing_paths_body, 1, timeout=120)[0]
    if not out:
        pytest.skip("this machine captures on cuda, ge and aclgraph")
    why = {"cuda": "needs a CUDA device, and this machine has none",
           "ge": "needs an Ascend NPU, and this machine has none", "aclgraph": "needs an Ascend NPU"}
    for path, err in out.items():
        assert err is not None and err.startswith(f"GraphDecoder(path={path!r}): {why[path]}"), (path, err)
        assert "\n" not in err


# ---- CUDA graphs -------------------------------------------------------------------------------------------------

def _cuda_body(ctx):
    import torch.distributed as dist

    from launch.engine import make_expert_parallel

    group = ctx.group if dist.get_backend(ctx.group) == "nccl" else dist.new_group(backend="nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    prompts, limits = _prompts((6, 3, 9, 2, 5), seed=50), [2, 3, 3, 5, 6]
    out = {}
    with overlap.use_path("cuda"):
        model = make_expert_parallel(build_model(CFG, seed=6, device=device), group)
        for mode in ("serial", "two-batch"):
            want = generate(model, prompts, limits, mode=mode).tokens
            decoder = GraphDecoder(model, new_cache(model, prompts, limits), mode, "cuda")
            first = generate(model, prompts, limits, decoder=decoder).tokens
            captured = decoder.compiled_buckets
            again = generate(model, prompts, limits, decoder=decoder).tokens  # replays only
            out[mode] = (want, first, again, captured, decoder.compiled_buckets)
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_replay_the_tokens_of_eager_generate():
    """On CUDA each bucket's step is captured once as a CUDA graph (over NCCL) and replayed: the tokens of the
    eager generate, again when the same decoder generates a second time without capturing anything new."""
    out = run_ranks(_cuda_body, 1, timeout=300)[0]
    for mode, (want, first, again, captured, after) in out.items():
        assert first == want and again == want, (mode, first, again, want)
        assert captured == after and captured, (mode, captured, after)
