"""``--decode-mode auto`` over captured decode steps: a calibration of the captured steps, and a decoder per mode."""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from launch.engine import DECODE_STEP, generate, new_cache
from launch.engine import calibrate_decode, graph_token_points
from launch.engine import GraphDecoder
from launch.models import build_model, preset
from microbatch.planning import DecodeCalibration, DecodeCalibrationError, choose_decode
from overlap.multirank import run_ranks

CFG = dataclasses.replace(preset("tiny"), n_experts=4)
MODES = ("serial", "two-batch", "chunked-2")
PADDED = DecodeCalibration((1, 2, 4, 6), (4, 20), {
    "serial": ((1.0, 1.0), (2.0, 2.0), (4.0, 4.0), (6.0, 6.0)),
    "two-batch": ((3.0, 3.0), (3.0, 3.0), (3.5, 3.5), (4.0, 4.0)),  # pays from 3 tokens on
    "chunked-2": ((2.0, 2.0), (1.5, 1.5), (4.5, 4.5), (7.0, 7.0)),  # pays at 2 tokens alone
}, padded=True)


def test_a_padded_table_costs_a_step_what_the_first_point_at_or_above_it_costs():
    """A captured step of 3 tokens pads to the bucket of 4: it costs the 4-token entry, not a line from 2 to 4."""
    assert PADDED.predict("serial", 3, 4) == 4.0 and PADDED.predict("serial", 5, 4) == 6.0
    assert PADDED.predict("serial", 9, 4) == 6.0  # past the last point: the last entry
    linear = dataclasses.replace(PADDED, padded=False)
    assert linear.predict("serial", 3, 4) == pytest.approx(3.0)
    assert [choose_decode(PADDED, t, 4).mode for t in (1, 2, 3, 4, 6)] == ["serial", "chunked-2", "two-batch",
                                                                          "two-batch", "two-batch"]
    assert DecodeCalibration.from_dict(PADDED.to_dict()) == PADDED and "padded" not in linear.to_dict()
    assert PADDED.format().startswith("captured decode steps (padded to their buckets)")
    with pytest.raises(DecodeCalibrationError, match="padded must be true or false"):
        DecodeCalibration.from_dict(dict(PADDED.to_dict(), padded="yes"))


def test_the_points_of_captured_steps_are_where_a_modes_buckets_end():
    assert graph_token_points(6, [1, 2]) == (1, 2, 4, 6)  # 5 and 6 tokens pad to 8 in serial, to 4 in two-batch
    assert graph_token_points(10, [1, 2], (3, 6)) == (3, 6, 10)
    assert graph_token_points(1, [1, 2]) == (1,)
    assert graph_token_points(16, [1, 4]) == (1, 2, 4, 8, 16)


def _prompts(n, seed, length=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab, (length,), generator=g).tolist() for _ in range(n)]


def _graph_auto_body(ctx):
    from launch.engine import make_expert_parallel
    from overlap import HostSyncs

    model = make_expert_parallel(build_model(CFG, seed=3), ctx.group)
    prompts = _prompts(3, seed=40 + ctx.rank)
    counts = [2, 4, 6] if ctx.rank == 0 else [6, 3, 3]  # the batch shrinks as requests finish: 3, 3, 2, 1, 1
    want = generate(model, prompts, counts).tokens  # eager serial
    cache = new_cache(model, prompts, counts)
    decoders = {m: GraphDecoder(model, cache, m, "cpu") for m in MODES}
    stepped = []
    for m, d in decoders.items():
        real = d.step
        d.step = lambda slots, tokens, widest=None, history=None, m=m, real=real: stepped.append(
            (m, len(slots))) or real(slots, tokens, widest, history)
    cal = calibrate_decode(model, max_tokens=3, histories=(4, 9), repeats=1, steps=1, decoders=decoders)
    left = (list(cache.active), list(cache.lengths))
    calibrated = sorted(collections.Counter(stepped).items())
    stepped.clear()
    with HostSyncs() as syncs:
        auto = generate(model, prompts, counts, mode="auto", calibration=PADDED, decoder=decoders, guard=False)
    in_steps = [str(s) for s in syncs.inside() if (s.scope or "").startswith(DECODE_STEP)]
    built = generate(model, prompts, counts, mode="auto", calibration=cal, graph="cpu")  # its own decoders
    return cal, left, calibrated, auto, sorted(set(stepped)), in_steps, built.tokens, want


@pytest.mark.cpu_only
def test_auto_over_captured_steps_times_them_and_generates_serials_tokens():
    """On two ranks: the calibration times each mode's captured step (padded to its bucket) at the points where the
    buckets end, at one history (a captured step attends over the whole cache: one untimed and one timed step per
    mode and point), on scratch slots of the decoders' cache that it gives back, the same table on both ranks; auto then
    replays the decoder of the mode it chooses each step, alike on both ranks as the batch shrinks (each step chosen on
    the batch of the step before: the ranks' agreement travels under the step after it), with no host sync inside a
    step, and generates eager serial's tokens."""
    out = run_ranks(_graph_auto_body, 2, timeout=240)
    (cal0, *_), (cal1, *_) = out
    assert cal0 == cal1 and cal0.padded and cal0.modes == MODES and cal0.tokens == (1, 2, 3), cal0
    assert all(r[0] == r[1] for rows in cal0.seconds.values() for r in rows), cal0.seconds
    for cal, left, calibrated, auto, stepped, in_steps, built, want in out:
        assert left == ([], [0, 0, 0]), left  # the scratch slots given back, their rows not counted
        assert calibrated == sorted(((m, n), 2) for m in MODES for n in (1, 2, 3)), calibrated
        assert auto.tokens == want and built == want
        assert {m for m, _ in stepped} == {"serial", "two-batch", "chunked-2"}, auto.modes
        assert in_steps == [], in_steps
    # steps of 3, 3, 2, 1, 1 tokens chosen on 3, 3, 3, 2, 1
    assert out[0][3].modes == out[1][3].modes == ["two-batch", "two-batch", "two-batch", "chunked-2", "serial"], \
        out[0][3].modes


def test_auto_with_steps_of_another_kind_than_its_calibration_is_refused_in_one_line():
    model = build_model(CFG, seed=3)
    prompts = _prompts(2, seed=1)
    eager = dataclasses.replace(PADDED, padded=False)
    cache = new_cache(model, prompts, 2)
    decoders = {m: GraphDecoder(model, cache, m, "cpu") for m in MODES}
    cases = [
        (dict(calibration=eager, graph="cpu"), "with captured steps chooses from a calibration of them"),
        (dict(calibration=PADDED), "this decode calibration timed captured steps: pass their decoders"),
        (dict(calibration=PADDED, decoder=decoders["serial"]), "takes one decoder per calibrated mode"),
        (dict(calibration=PADDED, decoder={"serial": decoders["serial"]}),
         "no decoder for the calibrated mode 'two-batch'"),
        (dict(calibration=PADDED, decoder=dict(decoders, serial=GraphDecoder(model, new_cache(model, prompts, 2)))),
         "must share one cache, path, buckets and length buckets"),
        (dict(calibration=PADDED, decoder=dict(decoders, serial=decoders["two-batch"])),
         "the decoder for 'serial' runs mode"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as err:
            generate(model, prompts, 2, mode="auto", **kwargs)
        assert message in str(err.value) and "\n" not in str(err.value), (kwargs, str(err.value))
    with pytest.raises(ValueError, match="must share one cache, path, buckets and length buckets"):
        calibrate_decode(model, max_tokens=2, histories=(4, 5), decoders=dict(
            decoders, serial=GraphDecoder(model, new_cache(model, prompts, 2))))
    with pytest.raises(ValueError, match="needs a decoder for serial"):
        calibrate_decode(model, max_tokens=2, histories=(4, 5), decoders={"two-batch": decoders["two-batch"]})
    with pytest.raises(RuntimeError, match="the decoders' cache has 2 free slots, the calibration takes 3"):
        calibrate_decode(model, max_tokens=3, histories=(4, 5), decoders=decoders)
