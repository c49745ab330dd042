"""Ranks that generate together hold alike what shapes their collectives and the same replicated weights (issue 57):
one line on every rank naming what differs, before the prefill's first exchange; a valid call still generates."""
import dataclasses

import pytest
import torch

import overlap

from launch.engine import DecodeError, GraphDecoder, generate, make_expert_parallel, new_cache
from launch.engine.alike import replicated_parameters, weight_digests
from launch.job import error_line
from launch.models import build_model, preset
from microbatch import KVCache, KVCacheError
from overlap import compare_posts


def _posts(values):
    return [{"values": v, "problems": []} for v in values]


def test_a_rank_says_every_difference_of_an_agreement_in_its_one_line():
    """On 4 ranks with two values differing the agreement's message is a header and a line per difference; a rank
    printed its first line alone (``DecodeError: the ranks cannot go on together:``, nothing after it)."""
    values = [{"max_tokens": 2, "histories": [8, 11]}] * 2 + [{"max_tokens": 1, "histories": [30, 33]}] * 2
    with pytest.raises(DecodeError) as caught:
        compare_posts(_posts(values), error=DecodeError)
    line = error_line(caught.value)
    assert "\n" not in line and line.startswith("DecodeError: the ranks cannot go on together: ranks disagree on "
                                                "max_tokens: ranks 0, 1: 2; ranks 2, 3: 1; ranks disagree on histories")
    assert error_line(ValueError("one line\n  C++ frame")) == "ValueError: one line"  # no header: its first line
    assert error_line(ValueError("x" * 700)).endswith("...") and len(error_line(ValueError("x" * 700))) == 600


def test_the_replicated_weights_leave_out_the_local_experts_and_their_digest_notices_an_update():
    model = make_expert_parallel(build_model(dataclasses.replace(preset("tiny"), n_experts=4), seed=0), None)
    names = [n for n, _ in replicated_parameters(model)]
    experts = {n for n, _ in model.named_parameters()} - set(names)
    assert experts and all(".experts." in n for n in experts) and any("router" in n or "gate" in n for n in names)
    first = weight_digests(model)
    assert weight_digests(model) is first  # kept
    name, param = replicated_parameters(model)[0]
    with torch.no_grad():
        param.add_(1.0)  # in place: its version moves
    again = weight_digests(model)
    assert again is not first and again[0][0] == name and again[0][1] != first[0][1] and again[1:] == first[1:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_digest_is_exact_and_chunked_and_none_for_a_non_finite_weight(dtype, monkeypatch):
    """Integer sums of bit patterns: one flipped low bit changes the digest (a float sum may not see it), a
    digest taken in chunks equals the whole one, and NaN or inf gives None (left to the steps' NaN check)."""
    from launch.engine import alike

    w = torch.randn(1000, dtype=torch.float64).to(dtype)
    whole = alike._digest(w)
    monkeypatch.setattr(alike, "_CHUNK", 7)
    assert alike._digest(w) == whole
    flipped = w.clone()
    flipped.view(alike._BITS[w.element_size()])[3] ^= 1  # the last bit of one element
    assert alike._digest(flipped) != whole
    for bad in (float("nan"), float("inf")):
        poisoned = w.clone()
        poisoned[500] = bad
        assert alike._digest(poisoned) is None


def test_a_decoders_cache_of_another_dtype_is_refused_in_one_line():
    model = build_model(preset("tiny"), seed=0)
    prompts = [[1, 2, 3]]
    half = KVCache(model.cfg.n_layers, 1, 8, model.cfg.k_shape, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^GraphDecoder's cache holds torch.float16, the model computes in "
                                         r"torch.float32"):
        GraphDecoder(model, half, "serial", "cpu")
    decoder = GraphDecoder(model, new_cache(model, prompts, 2), "serial", "cpu")
    other = build_model(preset("tiny"), seed=0).to(torch.float64)
    with pytest.raises(ValueError, match=r"^decoder's cache holds torch.float32, the model computes in torch.float64"):
        generate(other, prompts, 2, decoder=decoder)
    assert generate(model, prompts, 2, decoder=decoder).tokens == generate(model, prompts, 2).tokens


@pytest.mark.parametrize("call, message", [
    (lambda c, rows, q: c.attend_static(0, rows, q[:, :1]), r"^queries \(2, 1, 8\) do not go with 2 rows of keys "
                                                             r"\(2, 8\)"),
    (lambda c, rows, q: c.attend_static(0, rows, q, length=9), r"^length 9 is more than the cache's room"),
    (lambda c, rows, q: c.attend_static(0, rows, q, length=0), r"^length must be an integer of at least 1, got 0"),
    (lambda c, rows, q: c.attend_static(0, rows, q, mask=torch.ones(2, 4, dtype=torch.bool)),
     r"^mask \(2, 4\) does not go with 2 rows over length 8"),
    (lambda c, rows, q: c.attend_static(5, rows, q), r"^layer must be an integer in \[0, 2\)"),
])
def test_attend_static_names_what_does_not_fit(call, message):
    cache = KVCache(2, 3, 8, (2, 8))
    slots = cache.admit(2)
    rows = cache.rows(slots, [1, 1])
    cache.write(0, rows, torch.ones(2, 2, 8), torch.ones(2, 2, 8))
    cache.advance(rows)
    static = cache.static_rows(slots)
    assert cache.attend_static(0, static, torch.ones(2, 2, 8)).shape == (2, 2, 8)
    with pytest.raises(KVCacheError, match=message):
        call(cache, static, torch.ones(2, 2, 8))


def _alike_body(ctx):
    def model_of(seed=2, **cfg):
        return make_expert_parallel(build_model(dataclasses.replace(preset("tiny"), n_experts=4, **cfg), seed=seed),
                                    ctx.group)

    def said(**kw):
        try:
            generate(kw.pop("model", None) or model_of(), [[1, 2, 3]], 2, **kw)
            return None
        except DecodeError as err:
            return str(err)

    same = model_of()
    overlap.set_peer_watch(False)  # the switch: generate starts no watch
    off = said(model=same)
    watched = overlap.watch_peers() is not None
    overlap.set_peer_watch(True)
    said(model=same)
    return {"watch": [off is None and not watched, overlap.watch_peers() is not None],
            "buckets": said(model=same, buckets=[1, 2, 4] if ctx.rank == 0 else [8]),
            "layers": said(model=model_of(n_layers=2 + ctx.rank)),
            "weights": said(model=model_of(seed=2 + ctx.rank)),
            "unchecked": said(model=model_of(seed=2 + ctx.rank), check_weights=False),
            "alike": said(model=same)}


def test_ranks_that_differ_in_what_shapes_a_collective_or_in_their_weights_say_so_in_one_line():
    """On two ranks: different buckets (gloo aborted on a size mismatch), different layer counts (a step said only
    ``decode mode: rank 1: nothing``) and different seeds (other tokens, without a word) each raise one line on
    both ranks naming the argument (the parameter) and each rank's value; ``check_weights=False`` lets different
    weights run; the local experts, which differ by design, are not compared."""
    from overlap.multirank import run_ranks

    r0, r1 = run_ranks(_alike_body, 2, timeout=180)
    assert r0 == r1, (r0, r1)
    assert r0["watch"] == [True, True]  # off with set_peer_watch(False), started by generate once on again
    assert r0["buckets"] == "ranks disagree on buckets: rank 0: [1, 2, 4]; rank 1: [8]"
    assert "ranks disagree on layers: rank 0: 2; rank 1: 3" in r0["layers"], r0["layers"]
    assert r0["weights"].startswith("ranks hold different weights: ") and " differs: rank 0: digest " in r0["weights"]
    assert "\n" not in r0["weights"] and "experts" not in r0["weights"].split(" differs")[0]
    assert r0["unchecked"] is None and r0["alike"] is None


@pytest.mark.spawns_ranks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("graph", ["off", "cpu"])
def test_the_launchers_auto_decode_runs_ranks_with_uneven_batches(tmp_path, graph):
    """Issue 57's run: ``--decode-mode auto`` with rank 0 bringing ``--seq-lens 30,8`` and rank 1 ``8`` (the docs
    allow uneven batches) refused them (``ranks disagree on histories``, ``on max_tokens``); now the calibration is
    the job's, every mode generates serial's tokens (``--check``) and both ranks exit 0. With captured steps the
    decoders' cache holds the job's most requests and longest history, which the calibration measures."""
    from support.launcher import GENERATE, TINY, all_text, by_hand

    common = TINY + ["--new-tokens", "3", "--decode-mode", "auto", "--decode-calibration-rounds", "1", "--check",
                     "--decode-graph", graph]
    outs = by_hand([common + ["--seq-lens", "30,8"], common + ["--seq-lens", "8"]], script=GENERATE,
                   env={"OVERLAP_CALIBRATION_CACHE": str(tmp_path)}, timeout=240)
    text = all_text(outs)
    assert [code for code, _, _ in outs] == [0, 0], text
    assert "check: every mode generates serial's tokens" in text and "disagree" not in text, text
