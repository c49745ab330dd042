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
    assert len(noise) == 1 and noise[0].startswith("shared: ") and "two-batch" not in noise[0]
    assert "20%" in noise[0] and "--iters 10" in noise[0]
    # every difference is real when the rounds agree
    assert not any("spread (" in line for line in notes(_compared([1.0] * 5, {"shared": ([0.95] * 5, 0.1)})))


def test_one_round_says_there_is_no_spread(one_rank):
    lines = notes(_compared([1.0], {"two-batch": ([0.9], 0.5)}))
    assert lines[0].startswith("medians of 1 timed round(s)")
    assert any("no spread" in line and "--iters" in line for line in lines)
    assert any("no spread" in line for line in table(_compared([1.0], {}), 100).splitlines())
    # a speedup above what its hidden communication explains is not called "not overlap" on one round
    beyond = [line for line in notes(_compared([1.01], {"auto": ([1.0], 0.0)}, comm_shares=(0.34,)))
              if line.startswith("auto:")]
    assert beyond == ["auto: 1.01x is more than hiding 0% of serial's 34% communication can give (1.00x at most): "
                      "one round, not a result"]


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
    # within the rounds' spread, the words say so instead
    results = _compared([1.0, 1.08, 1.2], {"two-batch": ([0.9, 1.0, 1.1], 0.16)})
    said = [line for line in notes(results) if line.startswith("two-batch: 1.08x")]
    assert len(said) == 1 and "within the rounds' spread" in said[0] and "likely noise" in said[0]
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


def test_the_pipeline_benchmarks_verdict_says_when_it_is_noise(one_rank):
    from launch.bench.pipeline import verdict

    serial, two = _compared([0.8, 0.9, 1.0, 1.1, 1.2], {"two-batch": ([0.95] * 5, 0.5)})
    assert verdict({"serial": serial, "two-batch": two}) == \
        "two-batch not slower than serial: yes (within the rounds' spread: not a result)"
    serial, two = _compared([1.0] * 5, {"two-batch": ([1.1] * 5, 0.5)})
    assert verdict({"serial": serial, "two-batch": two}) == "two-batch not slower than serial: NO"
    serial, two = _compared([1.0], {"two-batch": ([0.8], 0.5)})
    assert verdict({"serial": serial, "two-batch": two}).endswith("yes (one round: not a result)")


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
