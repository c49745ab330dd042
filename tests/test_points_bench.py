"""Issue 60 point 3: a layer's parallel points from its operations' data flow (`microbatch.planning.points`), the
candidate orchestrations of each run by the executor equal to the single-stream layer without a race, their measured
overlap, and the benchmark's table (`launch.bench.points`) at a tiny size.

Before this change `microbatch.planning.points` and `launch.bench.points` did not exist: every test here failed at
its import (ModuleNotFoundError)."""
import os
import sys

import pytest
import torch

import microbatch
import overlap
from microbatch.operations import Operation
from microbatch.planning.points import (FALSE, PARTIAL, REAL, concurrent_pairs, core_shares, orchestrations,
                                        parallel_points, point_overlap, single_stream)
from overlap import EP_COMM, SHARED_EXPERT, Span

from support import zygote

pytestmark = pytest.mark.cpu_only
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHARED = ("shared_gate_up..shared_down beside dispatch_counts..combine",
          ("shared_gate_up", "shared_act", "shared_down"), ("dispatch_counts", "dispatch", "experts", "combine"))
LONGCAT = ("dense0..dense1 beside gate..finalize", ("dense0", "attn1", "dense1"),
           ("gate", "dispatch_counts", "dispatch", "experts", "combine", "finalize"))
INDEXER = ("indexer beside attn_kv", ("indexer",), ("attn_kv",))
MODELS = {"reference": [SHARED], "longcat_flash": [LONGCAT], "deepseek_v32": [INDEXER, SHARED]}


def _model(name):
    from launch.bench.points import build

    if name != "reference":
        pytest.importorskip("transformers")
    return build(name, "tiny", seed=3)


def _inputs(model, tokens=10):
    batch = microbatch.Batch.random([tokens // 2, tokens - tokens // 2], model.cfg.vocab, seed=5)
    return microbatch.micro_batch_inputs(model, batch, microbatch.serial_split(batch))


@pytest.mark.parametrize("name", list(MODELS))
def test_the_points_of_the_three_layers_are_found_from_the_data_flow(name):
    from launch.bench.points import layer_points

    found = [(p.name, p.side, p.main) for _, p in layer_points(_model(name))]
    assert found == MODELS[name]


def test_a_point_is_operations_with_no_path_between_them():
    """A fork into two chains joined at the end: every cross pair is concurrent, nothing else; the side branch is
    the one without communication, on a side stream of its own."""
    f = lambda *xs: xs[0]  # noqa: E731
    ops = [Operation("fork", f, ("hidden",), ("a",)), Operation("comm", f, ("a",), ("b",), EP_COMM),
           Operation("left", f, ("a",), ("c",)), Operation("after_comm", f, ("b",), ("d",)),
           Operation("join", lambda x, y: x, ("c", "d"), ("out",))]
    assert sorted(concurrent_pairs(ops)) == [("comm", "left"), ("left", "after_comm")]
    [point] = parallel_points(ops)
    assert (point.side, point.main, point.side_stream) == (("left",), ("comm", "after_comm"), "point_side")
    chain = [Operation("x", f, ("hidden",), ("a",)), Operation("y", f, ("a",), ("out",))]
    assert parallel_points(chain) == []


def test_each_point_has_two_or_more_orchestrations_and_a_core_split_within_the_budget():
    budget = overlap.CoreBudget(24, 48, "test")
    main, side = core_shares(budget)
    assert main[0] + side[0] <= 24 and main[1] + side[1] <= 48 and min(main + side) >= 1
    model = _model("reference")
    ops = model.layer_operations()[1]
    [point] = parallel_points(ops)
    cands = orchestrations(ops, point, budget)
    assert len(cands) >= 2 and len({o.name for o in cands}) == len(cands)
    streams = {o.name: {l.op: l.stream for l in o.schedule.launches} for o in cands}
    assert streams["side"]["shared_act"] == SHARED_EXPERT and streams["side"]["experts"] == "default"
    assert streams["main on side"]["experts"] != "default" and streams["main on side"]["shared_act"] == "default"
    assert {streams["two side streams"][n] for n in ("experts", "shared_act")} == {SHARED_EXPERT, "point_side"}
    assert next(o for o in cands if o.name == "side, early join").schedule.orders  # joins before the main goes on
    assert next(o for o in cands if o.name == "side, core split").cores == (main, side)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_orchestration_equals_the_single_stream_layer_without_a_race(name):
    from launch.bench.points import layer_points

    model = _model(name)
    inputs = _inputs(model)
    with torch.no_grad():
        for li, point in layer_points(model):
            ops = model.layer_operations()[li]
            want = microbatch.run(single_stream(ops), [ops], inputs)
            for orch in orchestrations(ops, point):
                with overlap.Sanitizer(raise_on_race=False) as san:
                    got = orch.run(ops, inputs)
                    overlap.synchronize()
                assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-6), (point.name, orch.name)
                assert not san.races, (point.name, orch.name, [str(r) for r in san.races])
                assert overlap.stream_limits() == {}  # a core split forgets its limits


def _span(name, start, end):
    return Span(name, "default", "compute", start=start, end=end)


def test_overlap_pct_counts_the_time_both_branches_ran():
    """One side op beside a dominator: the guide's window formula; two branches that take turns are not parallel,
    though their windows [first start, last end] cover each other."""
    point = parallel_points([Operation("f", lambda x: x, ("hidden",), ("a",)),
                             Operation("s", lambda x: x, ("a",), ("b",), SHARED_EXPERT),
                             Operation("m", lambda x: x, ("a",), ("c",)),
                             Operation("j", lambda x, y: x, ("b", "c"), ("out",))])[0]
    assert (point.side, point.main) == (("s",), ("m",))
    real = point_overlap([_span("s", 0.0, 1.0), _span("m", 0.2, 3.0)], point)
    assert real.verdict == REAL and real.pct == pytest.approx(0.8)
    assert point_overlap([_span("s", 0.0, 1.0), _span("m", 0.8, 3.0)], point).verdict == PARTIAL
    turns = [_span("s", 0.0, 1.0), _span("m", 1.0, 2.0), _span("s", 2.0, 3.0), _span("m", 3.0, 4.0)]
    assert point_overlap(turns, point).verdict == FALSE
    assert point_overlap([_span("s", 0.0, 1.0)], point) is None


def test_the_benchmark_prints_a_row_per_point_and_orchestration_at_a_tiny_size():
    pytest.importorskip("transformers")
    proc = zygote.run([sys.executable, "-m", "launch.bench.points", "--model", "deepseek_v32", "--tokens", "8",
                       "--rounds", "1"], timeout=180,
                      env=dict(os.environ, PYTHONPATH=ROOT, OVERLAP_FORKSERVER_PRELOAD=""), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("point"))
    assert lines[header].split() == ["point", "orchestration", "predicted", "measured", "overlap_pct", "verdict",
                                     "outputs", "races"]
    rows = [line for line in lines[header + 1:] if not line.startswith("note:")]
    for point in ("indexer beside attn_kv", SHARED[0]):
        mine = [r for r in rows if r.startswith(point + " ")]
        assert len(mine) >= 2, (point, rows)
        for r in mine:
            cells = r[len(point):].split()
            assert cells[-2:] == ["equal", "0"], r
            assert cells[-3] in (REAL, PARTIAL, FALSE), r


def test_an_unknown_model_is_one_line_and_exit_2_before_anything_runs():
    from click.testing import CliRunner

    from launch.bench.points import main

    got = CliRunner().invoke(main, ["--preset", "nope"])
    assert got.exit_code == 2 and "--preset 'nope': unknown model preset 'nope'" in got.output
    assert CliRunner().invoke(main, ["--rounds", "0"]).exit_code == 2
