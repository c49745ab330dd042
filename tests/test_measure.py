"""The launcher's figures against timelines whose answers are computed by hand, and the order `measure_modes` runs in.

Speedup, ideal speedup, hidden share and communication share are checked on hand-built spans and
results; `measure_modes` itself runs on two gloo ranks with a stand-in prefill, so that only its
bookkeeping is under test (interleaving, the recorded round, the slowest rank's times).
"""
import statistics
import time
import types

import pytest
import torch

import overlap
import launch.measure.prefill as measure_mod
from launch.measure.prefill import (ModeResult, _compare, comm_share, explained_speedup, ideal_speedup, measure_modes,
                                    notes, table)
from launch.measure.rounds import rounds, spread
from microbatch import Operation
from overlap import DEFAULT, EP_COMM, SHARED_EXPERT, Span
from overlap.multirank import run_ranks
from overlap.observability import metrics

MS = 1e-3


def _s(kind, start_ms, end_ms, rank=0, stream=None, name=None):
    stream = stream or {"comm": EP_COMM, "copy": "kv_offload"}.get(kind, DEFAULT)
    return Span(name=name or kind, stream=stream, kind=kind, rank=rank, start=start_ms * MS, end=end_ms * MS)


# --- busy time, overlap and hidden share (overlap/observability/_intervals.py) ---

def test_comm_half_under_compute():
    m = metrics([_s("comm", 0, 4), _s("compute", 2, 6)])
    r = m.per_rank[0]
    assert r.busy == {EP_COMM: pytest.approx(4 * MS), DEFAULT: pytest.approx(4 * MS)}
    assert m.overlap(EP_COMM, DEFAULT) == pytest.approx(2 * MS)
    assert r.comm_time == pytest.approx(4 * MS) and r.hidden_comm_time == pytest.approx(2 * MS)
    assert r.hidden_share == pytest.approx(0.5) and m.hidden_share == pytest.approx(0.5)


def test_two_ranks_of_different_lengths_pool_their_communication():
    spans = [_s("comm", 0, 4), _s("compute", 2, 6),  # rank 0: 2 of 4 ms hidden
             _s("comm", 0, 2, rank=1), _s("compute", 10, 30, rank=1)]  # rank 1: 0 of 2 ms
    m = metrics(spans)
    assert m.per_rank[0].hidden_share == pytest.approx(0.5)
    assert m.per_rank[1].hidden_share == 0.0
    assert m.busy(DEFAULT, rank=1) == pytest.approx(20 * MS)
    assert m.hidden_share == pytest.approx(2 / 6)  # hidden time over communication time, all ranks together


def test_nested_and_overlapping_spans_on_one_stream_count_once():
    spans = [_s("compute", 0, 10), _s("compute", 2, 4), _s("compute", 8, 12),  # union 0-12
             _s("comm", 3, 9), _s("comm", 4, 5), _s("comm", 20, 22)]  # union 3-9 and 20-22: 8 ms
    m = metrics(spans)
    assert m.busy(DEFAULT) == pytest.approx(12 * MS) and m.busy(EP_COMM) == pytest.approx(8 * MS)
    assert m.overlap(DEFAULT, EP_COMM) == pytest.approx(6 * MS)
    assert m.ratio(DEFAULT, EP_COMM) == pytest.approx(6 / 8)
    assert m.hidden_share == pytest.approx(6 / 8)


def test_comm_across_gaps_in_compute():
    m = metrics([_s("compute", 0, 2), _s("compute", 4, 6), _s("compute", 7, 8), _s("comm", 1, 5), _s("comm", 5.5, 9)])
    assert m.overlap(DEFAULT, EP_COMM) == pytest.approx(3.5 * MS)  # 1-2, 4-5, 5.5-6, 7-8
    assert m.hidden_share == pytest.approx(3.5 / 7.5)


def test_communication_on_two_streams_counts_once():
    m = metrics([_s("comm", 0, 4), _s("comm", 2, 6, stream=DEFAULT), _s("compute", 5, 7, stream=SHARED_EXPERT)])
    r = m.per_rank[0]
    assert r.comm_time == pytest.approx(6 * MS)
    assert r.hidden_comm_time == pytest.approx(1 * MS)  # compute on any stream of the same rank hides it


def test_comm_without_compute_is_not_hidden():
    m = metrics([_s("comm", 0, 4), _s("copy", 0, 4), _s("issue", 0, 4, stream=EP_COMM)])
    assert m.hidden_share == 0.0  # a copy or an issue span is no compute
    m = metrics([_s("comm", 0, 4), _s("compute", 0, 4, rank=1)])
    assert m.per_rank[0].hidden_share == 0.0 and m.hidden_share == 0.0  # another rank's compute hides nothing
    assert m.per_rank[1].hidden_share is None
    assert metrics([_s("compute", 0, 4)]).hidden_share is None  # no communication: no share


# --- communication share, ideal speedup, speedup (launch/measure/prefill.py) ---

def test_comm_share_of_one_rank():
    spans = [_s("comm", 0, 4), _s("compute", 4, 10)]
    assert comm_share(spans) == pytest.approx(0.4)
    assert ideal_speedup(0.4) == pytest.approx((0.6 + 0.4) / 0.6)
    spans = [_s("compute", 0, 3), _s("comm", 3, 10)]
    assert comm_share(spans) == pytest.approx(0.7)
    assert ideal_speedup(0.7) == pytest.approx(1 / 0.7)
    assert ideal_speedup(0.5) == 2.0 and ideal_speedup(1.0) == 1.0 and ideal_speedup(0.0) == 1.0
    assert comm_share([]) is None


def test_comm_share_is_the_longest_ranks_comm_over_the_longest_ranks_iteration():
    spans = [_s("comm", 0, 3), _s("compute", 3, 10),  # rank 0: 3 ms of comm in 10
             _s("comm", 0, 5, rank=1), _s("compute", 5, 8, rank=1)]  # rank 1: 5 ms of comm in 8
    assert comm_share(spans) == pytest.approx(5 / 10)
    assert ideal_speedup(comm_share(spans)) == pytest.approx(2.0)
    # ranks' clocks need not agree: rank 1 an hour ahead changes nothing
    shifted = spans[:2] + [_s(s.kind, s.start / MS + 3.6e6, s.end / MS + 3.6e6, rank=1) for s in spans[2:]]
    assert comm_share(shifted) == pytest.approx(5 / 10)
    # nested comm and idle gaps: the iteration runs from a rank's first start to its last end
    spans = [_s("compute", 1, 2), _s("comm", 2, 6), _s("comm", 3, 4, stream=DEFAULT), _s("compute", 8, 11)]
    assert comm_share(spans) == pytest.approx(4 / 10)


def _result(mode, times, spans=(), out=None, comm_shares=None):
    """A mode's result whose every timed round has ``spans``' communication share (or ``comm_shares``)."""
    if comm_shares is None:
        comm_shares = [comm_share(spans)] * len(times) if spans else []
    return ModeResult(mode, list(times), "", list(spans), torch.ones(3) if out is None else out,
                      comm_shares=list(comm_shares))


@pytest.fixture
def one_rank(monkeypatch):
    """`max_over_ranks` as on a single rank (no process group needed)."""
    monkeypatch.setattr(measure_mod, "max_over_ranks", lambda values, group: [float(v) for v in values])


def test_compare_by_hand(one_rank):
    serial = _result("serial", [0.10, 0.30, 0.20], [_s("comm", 0, 4), _s("compute", 4, 10)])
    shared = _result("shared", [0.25, 0.20, 0.30], out=torch.tensor([1.0, 1.5, 1.0]))
    two = _result("two-batch", [0.16, 0.10, 0.20, 0.18], out=-torch.ones(3))  # even count: the mean of the middle two
    _compare([serial, shared, two], None)
    assert serial.comm_share == pytest.approx(0.4)
    assert serial.ideal_speedup == pytest.approx(1 / 0.6)
    assert shared.ideal_speedup == two.ideal_speedup == serial.ideal_speedup
    assert shared.comm_share is None and two.comm_share is None
    assert serial.speedup == 1.0
    assert shared.speedup == pytest.approx(0.20 / 0.25)
    assert two.speedup == pytest.approx(0.20 / 0.17)
    assert serial.max_diff == 0.0 and shared.max_diff == pytest.approx(0.5) and two.max_diff == pytest.approx(2.0)
    assert serial.ref_scale == 1.0


def test_comm_share_is_the_median_over_the_rounds_as_the_times_are(one_rank):
    serial = _result("serial", [0.30, 0.10, 0.20], comm_shares=[0.5, 0.2, 0.3])  # one round's share is not it
    two = _result("two-batch", [0.1, 0.1, 0.1])
    _compare([serial, two], None)
    assert serial.comm_share == pytest.approx(0.3)
    assert serial.ideal_speedup == two.ideal_speedup == pytest.approx(1 / 0.7)
    serial = _result("serial", [0.2, 0.2], comm_shares=[None, 0.4])  # a round without spans counts for nothing
    _compare([serial], None)
    assert serial.comm_share == pytest.approx(0.4)


def test_compare_without_timeline_or_serial(one_rank):
    serial, two = _result("serial", [0.2]), _result("two-batch", [0.1])
    _compare([serial, two], None)  # a compiled graph: no spans, so no shares
    assert serial.comm_share is None and serial.ideal_speedup is None and two.ideal_speedup is None
    assert two.speedup == pytest.approx(2.0)
    lone = _result("two-batch", [0.1])
    _compare([lone], None)
    assert lone.speedup is None and lone.max_diff is None


def test_table_prints_the_figures(one_rank):
    serial = _result("serial", [0.2, 0.2, 0.2], [_s("comm", 0, 4), _s("compute", 4, 10)])
    two = _result("two-batch", [0.16, 0.1, 0.17])
    two.hidden_comm_share = 0.5
    _compare([serial, two], None)
    text = table([serial, two], tokens=1000)
    lines = text.splitlines()
    assert lines[0].split()[:6] == ["mode", "ms/prefill", "median", "[min-max]", "spread", "tokens/s"]
    assert lines[2].split()[:4] == ["serial", "200.0", "[200.0-200.0]", "0%"] and "1.00x" in lines[2]
    assert "5000" in lines[2]
    # inclusive quartiles of 100, 160, 170: 130 and 165, over the median 160
    assert lines[3].split()[:5] == ["two-batch", "160.0", "[100.0-170.0]", f"{35 / 160:.0%}", "6250"]
    assert "1.25x" in lines[3] and "50%" in lines[3]
    assert lines[4] == ("serial: communication 40% of prefill time -> ideal speedup "
                        "(compute + comm) / max(compute, comm) = 1.67x")
    assert lines[5].startswith("medians of 3 timed round(s) per mode")
    row = two.row(1000)
    assert row["tokens_per_s"] == pytest.approx(6250) and row["speedup"] == pytest.approx(1.25)
    assert row["spread"] == pytest.approx(35 / 160)


# --- spread, and the words for figures not to be read as results (launch/measure/rounds.py, prefill.py notes) ---

def test_spread_is_the_interquartile_range_over_the_median():
    assert spread([0.2]) is None and spread([]) is None
    assert spread([0.1, 0.3]) == pytest.approx(0.1 / 0.2)  # quartiles 0.15 and 0.25
    assert spread([1.0, 1.0, 1.0, 1.0, 9.0]) == 0.0  # one slow round does not make the whole run noise
    assert spread([2.0, 3.0, 4.0, 5.0, 6.0]) == pytest.approx(2.0 / 4.0)


def _compared(serial_times, others, comm_shares=(0.25,)):
    """Results compared with serial: ``others`` maps a mode to (times, hidden share)."""
    serial = _result("serial", serial_times, comm_shares=list(comm_shares) * len(serial_times))
    serial.hidden_comm_share = 0.0
    rest = []
    for mode, (times, hidden) in others.items():
        r = _result(mode, times)
        r.hidden_comm_share = hidden
        rest.append(r)
    _compare([serial] + rest, None)
    return [serial] + rest


def test_a_difference_within_the_spread_is_called_noise(one_rank):
    # serial's rounds spread 20% (IQR 0.9-1.1 over 1.0); shared is 5% faster, two-batch 40%
    results = _compared([0.8, 0.9, 1.0, 1.1, 1.2], {"shared": ([0.95] * 5, 0.1), "two-batch": ([0.6] * 5, 0.9)},
                        comm_shares=(0.5,))
    lines = notes(results)
    noise = [line for line in lines if "within the rounds' spread" in line]
    assert len(noise) == 1 and noise[0].startswith("~: shared: ") and "two-batch" not in noise[0]
    assert "20%" in noise[0] and "noise, not a speedup" in noise[0] and "--iters 10" in noise[0]
    assert [r.judged for r in results] == ["reference", "noise", "speedup"]
    rows = table(results, 100).splitlines()
    assert "1.05x~" in rows[3].split() and "1.67x" in rows[4].split()  # the column says it too
    assert results[1].row(100)["speedup_label"] == "noise" and results[1].row(100)["speedup"] == pytest.approx(1 / .95)
    # every difference is real when the rounds agree
    steady = _compared([1.0] * 5, {"shared": ([0.95] * 5, 0.1)})
    assert not any("spread (" in line for line in notes(steady)) and steady[1].judged == "speedup"


def test_one_round_says_there_is_no_spread(one_rank):
    results = _compared([1.0], {"two-batch": ([0.9], 0.5)})
    lines = notes(results)
    assert lines[0].startswith("medians of 1 timed round(s)")
    assert any(line.startswith("?: one timed round: no spread") and "--iters" in line for line in lines)
    assert results[1].judged == "one round" and "1.11x?" in table(results, 100).splitlines()[3].split()
    # a speedup above what its hidden communication explains names no cause on one round
    said = notes(_compared([1.5], {"auto": ([1.0], 0.0)}, comm_shares=(0.34,)))
    assert not any(line.startswith("auto:") for line in said), said


def test_a_speedup_above_the_ideal_is_said_in_words(one_rank):
    # serial: communication 8% -> ideal 1.09x; two-batch measured 1.18x with steady rounds
    results = _compared([1.18] * 3, {"two-batch": ([1.0] * 3, 1.0)}, comm_shares=(0.08,))
    two = results[1]
    assert two.ideal_speedup == pytest.approx(1 / 0.92) and two.speedup == pytest.approx(1.18)
    said = [line for line in notes(results) if line.startswith("two-batch:")]
    assert said == ["two-batch: 1.18x is above the ideal 1.09x: the rest is not overlap "
                    "(this mode's compute or waits took less time than serial's)"]


def test_a_speedup_its_hidden_communication_cannot_explain_is_said_in_words(one_rank):
    # launch.bench.pipeline's case: 16% of a 25% share hidden explains 1/(1 - 0.04) = 1.04x, not 1.26x
    assert explained_speedup(0.16, 0.25) == pytest.approx(1 / 0.96)
    assert explained_speedup(1.0, 1.0) == float("inf") and explained_speedup(0.0, 0.4) == 1.0
    results = _compared([1.26] * 3, {"two-batch": ([1.0] * 3, 0.16)})
    said = [line for line in notes(results) if line.startswith("two-batch:")]
    assert len(said) == 1
    assert said[0].startswith("two-batch: 1.26x is more than hiding 16% of serial's 25% communication can give "
                              "(1.04x at most): the rest is not overlap")
    # a difference from serial within the rounds' spread is noise: no cause named
    results = _compared([1.0, 1.08, 1.2], {"two-batch": ([0.9, 1.0, 1.1], 0.16)})
    assert results[1].judged == "noise"
    assert not any(line.startswith("two-batch") for line in notes(results))
    # a speedup beyond the spread whose excess over what its hidden communication explains is within it
    results = _compared([1.28, 1.32, 1.36], {"two-batch": ([0.98, 1.0, 1.02], 0.9)})
    said = [line for line in notes(results) if line.startswith("two-batch: 1.32x")]
    assert results[1].judged == "speedup" and len(said) == 1
    assert "(1.29x at most), within the rounds' spread (3%): likely noise" in said[0]
    # a speedup its hidden communication explains gets no words
    results = _compared([1.03] * 3, {"two-batch": ([1.0] * 3, 0.16)})
    assert not any(line.startswith("two-batch") for line in notes(results))


# --- the order `measure_modes` runs the modes in ---

def test_rounds_interleave_and_rotate():
    assert rounds(["a", "b", "c"], 2, 4) == [["a", "b", "c"], ["a", "b", "c"],  # warmup
                                             ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert rounds(["a"], 1, 2) == [["a"], ["a"], ["a"]]
    assert rounds(["a", "b"], 0, 1) == [["a", "b"]]


SLOW_MODE_S = 0.03  # rank 1 sleeps this long in mode "x": the slowest rank's times hold it


def _measure_rank(ctx):
    """`measure_modes` with a stand-in split and prefill: what ran when, and the results."""
    calls, count = [], {}

    def split_for(mode, batch, group, model=None):
        return types.SimpleNamespace(reason=f"split of {mode}")

    def prefill(model, batch, mode, split, cache=None, make=None):
        i = count[mode] = count.get(mode, -1) + 1
        calls.append(("run", mode, i, overlap.hooks.active()))
        with overlap.span("work", it=i):
            if mode == "x" and ctx.rank == 1:
                time.sleep(SLOW_MODE_S)
            t = torch.full((4,), float(ctx.rank + 1))
        if mode == "serial":
            overlap.all_reduce(t, group=ctx.group)  # a comm span after the compute span
        return t

    real = measure_mod.split_for, measure_mod.prefill
    measure_mod.split_for, measure_mod.prefill = split_for, prefill
    try:
        results = measure_modes(None, None, ["serial", "x", "y"], ctx.group, warmup=1, iters=3,
                          before_iter=lambda mode, i: calls.append(("before", mode, i)))
    finally:  # under torchrun the rank's process goes on to other tests
        measure_mod.split_for, measure_mod.prefill = real
    return calls, [dict(mode=r.mode, times=r.times_s, split=r.split_reason, spans=r.spans, hidden=r.hidden_comm_share,
                        comm_share=r.comm_share, comm_shares=r.comm_shares, ideal=r.ideal_speedup,
                        speedup=r.speedup, median=r.median_s)
                   for r in results]


@pytest.mark.cpu_only
def test_measure_interleaves_rounds_times_them_unobserved_and_records_one_round_apart():
    expected = []
    for r, order in enumerate([["serial", "x", "y"], ["serial", "x", "y"], ["x", "y", "serial"], ["y", "serial", "x"],
                               ["serial", "x", "y"]]):  # warmup, three timed rounds, one recorded
        for mode in order:
            expected += [("before", mode, r), ("run", mode, r, r == 4)]  # observed in the recorded round only
    for calls, results in run_ranks(_measure_rank, 2, timeout=120):
        assert calls == expected
        by = {r["mode"]: r for r in results}
        assert [r["mode"] for r in results] == ["serial", "x", "y"]
        for r in results:
            assert r["split"] == f"split of {r['mode']}" and len(r["times"]) == 3
            work = [s for s in r["spans"] if s.name == "work"]
            assert sorted(s.rank for s in work) == [0, 1]  # every rank's spans, of one round
            assert {s.meta["it"] for s in work} == {4}  # the recorded round, after the warmup and the timed ones
            assert r["speedup"] == pytest.approx(by["serial"]["median"] / r["median"])
            assert r["ideal"] == by["serial"]["ideal"]
        assert all(t >= SLOW_MODE_S for t in by["x"]["times"])  # the slowest rank's time, on every rank
        assert by["serial"]["hidden"] == 0.0 and by["x"]["hidden"] is None
        assert len(by["serial"]["comm_shares"]) == 1  # the recorded round's
        assert all(0 < c <= 1 for c in by["serial"]["comm_shares"])
        assert by["serial"]["comm_share"] == pytest.approx(statistics.median(by["serial"]["comm_shares"]))
        assert by["x"]["comm_shares"] == [0.0]
        assert by["serial"]["ideal"] == pytest.approx(ideal_speedup(by["serial"]["comm_share"]))


def test_the_pipeline_benchmarks_verdict_is_met_missed_or_inconclusive(one_rank):
    from launch.bench.pipeline import verdict

    serial, two = _compared([0.8, 0.9, 1.0, 1.1, 1.2], {"two-batch": ([0.95] * 5, 0.5)})
    assert verdict({"serial": serial, "two-batch": two}) == \
        "target: two-batch not slower than serial: inconclusive (noise) (1.05x serial, spread 20%)"
    serial, two = _compared([1.0] * 5, {"two-batch": ([1.1] * 5, 0.5)})
    assert verdict({"serial": serial, "two-batch": two}) == \
        "target: two-batch not slower than serial: missed (0.91x serial, spread 0%)"
    serial, two = _compared([0.98, 1.0, 1.02], {"two-batch": ([0.8] * 3, 0.5)})
    assert verdict({"serial": serial, "two-batch": two}).endswith(": met (1.25x serial, spread 2%)")
    serial, two = _compared([1.0], {"two-batch": ([0.8], 0.5)})
    assert verdict({"serial": serial, "two-batch": two}).endswith(": inconclusive (noise) (1.25x serial, one round)")


def test_the_pipeline_benchmark_splits_the_gap_to_the_ideal_at_the_ceiling(one_rank):
    from launch.bench.pipeline import ceiling_lines, gap

    # ideal 1.76x, ceiling 1.45x, measured 1.20x: 0.31x the mode's own cost, 0.25x link time not hidden
    said = gap("two-batch", 1.20, 0.02, 1.45, 0.02, 1.76)
    assert said.startswith("two-batch: 1.20x against the ideal 1.76x and its ceiling 1.45x")
    assert "leaves out) 0.31x (55%)" in said and "not hide) 0.25x (45%)" in said
    # a part within the noise is not a figure; a measured speedup above its ceiling beyond it is none measured
    said = gap("two-batch", 1.40, 0.05, 1.45, 0.05, 1.76)
    assert "leaves out) 0.31x," in said and "not hide) below the noise" in said
    assert "not hide) none: it measured above its ceiling by more than the noise" in gap("shared", 1.60, 0.01, 1.45,
                                                                                          0.01, 1.50)
    assert "(its launches and exchanges, which" in gap("shared", 1.2, None, 1.4, None, 1.5)
    assert "(the split, its launches and exchanges, which" in gap("two-batch", 1.2, None, 1.4, None, 1.5)
    assert "leaves out) below the noise" in gap("shared", 1.0, 0.01, 1.48, 0.05, 1.50)
    assert gap("shared", 1.2, None, 1.4, None, 1.5).endswith("leaves out) 0.10x (33%), overlap that did not happen "
                                                             "(the link's time it did not hide) 0.20x (67%)")
    # the ceiling: serial at the link over each mode with no link, measured side by side
    results = _compared([1.0] * 3, {"two-batch": ([0.8] * 3, 0.5)}, comm_shares=(0.5,))
    unlinked = _compared([1.0] * 3, {"two-batch": ([0.625] * 3, None)})
    lines = ceiling_lines(results, unlinked)
    assert lines[0].endswith("hid): two-batch 1.60x (spread 0%)")
    assert lines[1] == gap("two-batch", 1.25, 0.0, 1.60, 0.0, 2.0)


def test_the_pipeline_benchmark_names_the_host_time_in_exchanges_and_what_it_held_back():
    from launch.bench.pipeline import host_blocking, host_blocking_table

    def launch(name, kind, mb, start, end, rank=0):
        return Span(name, DEFAULT if kind == "compute" else EP_COMM, kind, rank=rank, start=start, end=end,
                    meta={"mb": mb, "layer": 0})

    spans = [launch("attn", "compute", 0, 0.000, 0.010),
             launch("dispatch", "issue", 0, 0.010, 0.015),  # then mb1's attention: held back 5 ms
             launch("attn", "compute", 1, 0.015, 0.025),
             launch("dispatch", "issue", 1, 0.025, 0.027),  # then mb1's own experts: not another's
             launch("experts", "compute", 1, 0.027, 0.030),
             Span("dispatch", EP_COMM, "comm", start=0.010, end=0.020, meta={"mb": 0, "layer": 0}),  # not a launch
             launch("dispatch", "issue", 0, 0.0, 0.001, rank=1)]
    blocked = host_blocking(spans)
    assert blocked[0] == pytest.approx((0.007, 0.005))
    assert blocked[1] == pytest.approx((0.001, 0.0))
    result = types.SimpleNamespace(mode="two-batch", spans=spans)
    assert "two-batch        7.00 ms in exchanges,     5.00 ms of it holding back" in host_blocking_table([result])


# --- the generation table (launch/measure/generate.py) ---

def _generation(label, ttft, step_rounds, chosen=()):
    """A run's result from its rounds' step times (seconds), as `measure_generation` makes it on one process."""
    from launch.engine import Generated
    from launch.measure.generate import Run, _Round, _result

    prefill, _, decode = label.partition(" / ")
    kept = []
    for steps in step_rounds:
        stamps = [0.0, ttft]
        for dt in steps:
            stamps.append(stamps[-1] + dt)
        kept.append(_Round(stamps, [], Generated([[1] * (len(steps) + 1)] * 2, None, len(steps), list(chosen))))
    return _result(Run(prefill, decode or prefill), kept, kept[-1].generated, None)


def test_the_generation_table_prints_tpots_spread_defines_tokens_per_second_and_says_what_each_speedup_is():
    from launch.measure.generate import _compare, table

    serial = _generation("serial", 0.05, [[0.010, 0.010, 0.012]] * 2 + [[0.011, 0.011, 0.013]])
    assert serial.round_tpot_s == pytest.approx([0.010, 0.010, 0.011])  # each round's median step
    assert serial.spread == pytest.approx(0.0005 / 0.010)  # inclusive quartiles 0.010 and 0.0105
    two = _generation("two-batch", 0.05, [[0.007, 0.007, 0.007]] * 3)
    shared = _generation("shared", 0.05, [[0.0108, 0.0108, 0.0108]] * 3)
    auto = _generation("serial / auto", 0.05, [[0.005, 0.005, 0.005]] * 3, chosen=["serial"] * 3)
    results = [serial, two, shared, auto]
    moe = [Operation("dispatch", lambda x: x, ("hidden",), ("recv",), EP_COMM),
           Operation("shared", lambda x: x, ("hidden",), ("s",), SHARED_EXPERT),
           Operation("experts", lambda x, s: x, ("recv", "s"), ("out",))]  # shared experts beside the dispatch
    model = types.SimpleNamespace(decode_layer_operations=lambda chunks=1: [moe])
    _compare(results, model, alone=False)
    assert [r.judged for r in results] == ["reference", "speedup", "noise", "same schedule"]
    assert serial.tpot_s == pytest.approx(0.011)  # the median of every step of every round
    assert auto.serial_schedule == "every decode step ran serial" and auto.speedup == pytest.approx(2.2)
    text = table(results)
    lines = text.splitlines()
    assert lines[0].split()[:10] == ["mode", "TTFT", "ms", "TPOT", "ms", "median", "TPOT", "p90", "spread", "tokens/s"]
    assert lines[2].split()[4:7] == ["5%", "98", "1.00x"]  # 8 tokens over 82 ms, the median round's generation
    assert "1.57x" in lines[3].split() and "1.02x~" in lines[4].split() and "=serial" in lines[5].split()
    assert ("tokens/s: every rank's generated tokens (each request's first, the prefill's, included) over the "
            "generation's time (the prefill and every decode step), the median round's") in text
    assert ("=serial: serial / auto runs serial's schedule (every decode step ran serial): its 2.20x is noise"
            in lines)
    assert any(line.startswith("~: shared: the difference from serial is within the rounds' spread (5%)")
               for line in lines)
    row = auto.row()
    assert row["speedup"] == pytest.approx(2.2) and row["speedup_label"] == "same schedule"
    assert row["serial_schedule"] == "every decode step ran serial"
    assert serial.row()["tpot_spread"] == pytest.approx(0.05) and serial.row()["step_spread"] > 0.05
    # one rank: nothing to overlap, every difference is noise; one round: no spread
    one = [_generation("serial", 0.05, [[0.010] * 3]), _generation("shared", 0.05, [[0.005] * 3])]
    _compare(one, model, alone=True)
    assert one[1].judged == "noise" and "2.00x~" in table(one).splitlines()[3].split()
    assert "~: one rank: no communication to overlap, so no difference from serial is a speedup" in table(one)
    assert "?: one timed round: no spread" in table(one)
