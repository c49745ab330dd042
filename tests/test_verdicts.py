"""What a figure measured in rounds says against their spread (`launch.measure.verdicts`), decided from given figures:
a speedup, noise, a mode that runs serial's schedule; a target met, missed or inconclusive; a cost or words."""
import types

import pytest

import microbatch
from launch.measure.verdicts import (BELOW_NOISE, INCONCLUSIVE, MET, MISSED, NOISE, NONE_MEASURED, SAME, SLOWDOWN,
                                     SPEEDUP, UNJUDGED, Compared, cost, judge, mark, overlaps_nothing, speedup_notes,
                                     verdict)
from microbatch import Operation
from overlap import DEFAULT, EP_COMM, SHARED_EXPERT


def test_a_speedup_is_one_only_beyond_the_spread_and_never_for_serials_schedule_or_one_rank():
    assert judge(1.30, 0.10) == SPEEDUP and judge(0.80, 0.10) == SLOWDOWN
    assert judge(1.08, 0.10) == NOISE and judge(0.92, 0.10) == NOISE and judge(1.09, 0.10) == NOISE
    assert judge(1.30, None) == UNJUDGED  # one round: no spread to judge by
    assert judge(2.20, 0.01, same=True) == SAME  # serial's schedule: whatever it measured
    assert judge(2.20, 0.01, alone=True) == NOISE  # one rank: nothing to overlap
    assert judge(2.20, None, alone=True) == NOISE


def test_the_column_says_what_a_speedup_is():
    assert mark(1.234, SPEEDUP) == "1.23x" and mark(0.8, SLOWDOWN) == "0.80x" and mark(1.0, "reference") == "1.00x"
    assert mark(1.234, NOISE) == "1.23x~" and mark(1.234, UNJUDGED) == "1.23x?" and mark(1.64, SAME) == "=serial"
    assert mark(None, None) == "-"


def test_a_target_is_met_missed_or_inconclusive_where_the_spread_covers_the_margin():
    assert verdict(0.01, 0.05, 0.02) == MET  # 1% +- 2% is under 5%
    assert verdict(0.10, 0.05, 0.02) == MISSED  # 10% +- 2% is over it
    assert verdict(0.04, 0.05, 0.02) == INCONCLUSIVE and verdict(0.06, 0.05, 0.02) == INCONCLUSIVE
    assert verdict(-0.30, 0.05, 0.10) == MET  # measured below the limit by more than the noise
    assert verdict(0.0, 0.05, None) == INCONCLUSIVE  # one round
    assert verdict(0.05, 0.05, 0.0) == MET


def test_a_negative_or_noisy_cost_is_not_a_figure():
    pct = "{:+.1%}".format
    assert cost(0.252, 0.05, pct) == "+25.2%"
    assert cost(-0.466, 0.10, pct) == NONE_MEASURED  # "-46.6% (met)" no more
    assert cost(-0.005, 0.03, pct) == BELOW_NOISE and cost(0.02, 0.03, pct) == BELOW_NOISE
    assert cost(-1336.85, 5.0, "{:.2f}".format) == NONE_MEASURED  # the executor's timeline-replay
    assert cost(0.02, None, pct) == "+2.0%" and cost(-0.02, None, pct) == NONE_MEASURED  # one round


def test_the_notes_name_each_marker_once():
    lines = speedup_notes([Compared("shared", 1.64, 0.05, SAME, "the model has no shared experts: nothing runs "
                                                                 "beside its exchanges"),
                           Compared("two-batch", 1.05, 0.08, NOISE), Compared("three-batch", 1.04, 0.06, NOISE),
                           Compared("four-batch", 1.5, 0.06, SPEEDUP)], 5, "--iters 10")
    assert lines == ["=serial: shared runs serial's schedule (the model has no shared experts: nothing runs beside its "
                     "exchanges): its 1.64x is noise",
                     "~: two-batch, three-batch: the difference from serial is within the rounds' spread (8%): noise, "
                     "not a speedup; rerun with more rounds (--iters 10) or on a quieter host"]
    # serial's schedule measured slower beyond the spread: the cost of what it does beside it, not noise
    slow = speedup_notes([Compared("serial / auto", 0.58, 0.10, SAME, "every decode step ran serial")], 5, "--iters 10")
    assert slow == ["=serial: serial / auto runs serial's schedule (every decode step ran serial): 0.58x, slower than "
                    "serial beyond the rounds' spread (10%): what it does beside that schedule costs this much"]
    alone = speedup_notes([Compared("shared", 2.2, None, NOISE, alone=True)], 1, "--iters 10")
    assert alone == ["?: one timed round: no spread to tell a difference from noise; run --iters 10 or more",
                     "~: one rank: no communication to overlap, so no difference from serial is a speedup"]


def _op(name, reads, writes, stream=DEFAULT):
    return Operation(name, lambda *a: a, tuple(reads), tuple(writes), stream)


def _moe_layer(shared_experts=True):
    ops = [_op("attn", ["hidden"], ["a"]), _op("gate", ["a"], ["g"]),
           _op("dispatch_counts", ["g"], ["counts"], EP_COMM), _op("dispatch", ["counts", "a"], ["recv"], EP_COMM)]
    if shared_experts:
        ops.append(_op("shared", ["a"], ["s"], SHARED_EXPERT))
    ops += [_op("experts", ["recv"], ["e"]), _op("combine", ["e"], ["c"], EP_COMM),
            _op("finalize", ["c"] + (["s"] if shared_experts else []), ["out"])]
    return ops


def test_a_schedule_overlaps_nothing_where_each_launch_after_an_exchange_waits_for_it():
    plain, with_shared = [_moe_layer(False)] * 2, [_moe_layer(True)] * 2
    assert overlaps_nothing(microbatch.serial(with_shared), with_shared)
    assert overlaps_nothing(microbatch.shared(plain), plain)  # no shared experts: serial's schedule in effect
    assert not overlaps_nothing(microbatch.shared(with_shared), with_shared)  # the shared experts beside the dispatch
    assert not overlaps_nothing(microbatch.two_batch(plain, 2), plain)  # a second micro-batch
    assert overlaps_nothing(microbatch.two_batch(plain, 1), plain)  # a split that ran one batch
    assert not overlaps_nothing(microbatch.two_batch(with_shared, 1), with_shared)  # its shared experts, main stream
    # compute issued under an exchange it does not wait for (a chunked MoE's next chunk)
    chunked = [[_op("attn", ["hidden"], ["a"]), _op("dispatch0", ["a"], ["r0"], EP_COMM),
                _op("dispatch1", ["a"], ["r1"], EP_COMM), _op("experts0", ["r0"], ["e0"]),
                _op("experts1", ["r1"], ["e1"]), _op("out", ["e0", "e1"], ["out"])]]
    assert not overlaps_nothing(microbatch.shared(chunked), chunked)


@pytest.fixture(scope="module")
def models():
    """The tiny reference decoder (shared experts) and mixtral (none), expert-parallel on this process alone."""
    from launch.engine import make_expert_parallel
    from launch.models import build_model, build_transformers_model, preset

    cfg = preset("tiny")
    mixtral = build_transformers_model("mixtral", overrides=dict(n_layers=cfg.n_layers, hidden=cfg.hidden,
                                                                 n_experts=cfg.n_experts, top_k=cfg.top_k))
    return {name: make_expert_parallel(m, None) for name, m in (("reference", build_model(cfg)), ("mixtral", mixtral))}


def test_which_prefill_modes_run_serials_schedule_on_a_model(models):
    from launch.measure.prefill import serial_schedule
    from microbatch import Batch, serial_split
    from microbatch.planning import decide_split

    batch = Batch.random([16, 16], models["reference"].cfg.vocab)
    whole, halves = serial_split(batch, "one batch (serial)"), decide_split(batch.seq.seq_lens, None, n=2)
    assert serial_schedule(models["reference"], "shared", whole) is None
    assert serial_schedule(models["reference"], "two-batch", halves) is None
    assert serial_schedule(models["mixtral"], "shared", whole) == \
        "the model has no shared experts: nothing runs beside its exchanges"
    assert serial_schedule(models["mixtral"], "two-batch", halves) is None
    assert serial_schedule(models["mixtral"], "two-batch", whole) == \
        "its split runs one batch (one batch (serial)), the model has no shared experts: nothing runs beside its exchanges"

    def chose(mode):
        best = types.SimpleNamespace(mode=mode, make=lambda: microbatch.mode(mode).make)
        return types.SimpleNamespace(best=best)

    auto = chose("serial")
    assert serial_schedule(models["reference"], "auto", whole, auto.best.make(), auto) == "auto chose serial"
    auto = chose("shared")
    assert serial_schedule(models["reference"], "auto", whole, auto.best.make(), auto) is None
    assert serial_schedule(models["mixtral"], "auto", whole, auto.best.make(), auto) == \
        "auto chose shared, the model has no shared experts: nothing runs beside its exchanges"


def test_which_decode_runs_ran_serials_schedule(models):
    from launch.engine import Generated
    from launch.measure.generate import Run, RunResult, decode_serial_schedule

    def run(decode, chosen=()):
        return RunResult(Run("serial", decode), [0.1], [0.2], [0.01], 3, Generated([[1]], None, 1),
                         chosen=list(chosen))

    assert decode_serial_schedule(models["reference"], run("shared")) is None
    assert decode_serial_schedule(models["mixtral"], run("shared")) == \
        "the model has no shared experts: nothing runs beside its exchanges"
    for model in models.values():
        assert decode_serial_schedule(model, run("chunked-2")) is None
        assert decode_serial_schedule(model, run("two-batch")) is None
        assert decode_serial_schedule(model, run("auto", ["serial"] * 45)) == "every decode step ran serial"
        assert decode_serial_schedule(model, run("auto", ["serial"] * 40 + ["two-batch"] * 5)) is None
        assert decode_serial_schedule(model, run("auto")) is None  # no step: nothing to say
    assert decode_serial_schedule(models["mixtral"], run("auto", ["serial", "shared"])) == \
        "every decode step ran serial or shared: one batch, nothing beside its exchanges"
