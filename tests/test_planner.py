"""The planner: the fastest predicted candidate wins, every rank decides alike, auto runs and equals serial."""
import os
import re
import sys

import pytest

import microbatch
from microbatch.planning import CostModel, Interconnect, Linear, OpCost, Transfer, choose
from overlap.multirank import run_ranks

from support import zygote
from support.launcher import ROOT, SCRIPT
from support.ports import free_port


def _layers(n=2):
    f = lambda *xs: xs[0]  # noqa: E731
    ops = [microbatch.Operation("attn", f, ("hidden",), ("a",)),
           microbatch.Operation("dispatch", f, ("a",), ("d",), "ep_comm"),
           microbatch.Operation("experts", f, ("d",), ("e",)),
           microbatch.Operation("combine", f, ("e",), ("c",), "ep_comm"),
           microbatch.Operation("finalize", f, ("c",), ("out",))]
    return [ops] * n


class _Cal:
    """A stand-in calibration: the planner only asks it for its cost model."""

    def __init__(self, seconds_per_byte, host_overhead=0.0):
        compute = OpCost(Linear(0.0, 1e-4))
        comm = OpCost(Linear(0.0, 0.0), (Transfer("x", Linear(0.0, 4096.0)),))
        self.costs = CostModel({"attn": compute, "experts": compute, "finalize": OpCost(Linear(0.0, 1e-6)),
                                "dispatch": comm, "combine": comm}, Interconnect(0.0, seconds_per_byte),
                               host_overhead)

    def cost_model(self):
        return self.costs


def test_the_fastest_prediction_wins_and_ties_go_to_fewer_micro_batches():
    lens = [(64, 64, 64, 64)]
    free = choose(_Cal(0.0), _layers(), lens, device=False)
    assert free.best.mode == "serial"  # nothing to hide: every mode predicts the same, serial has fewest parts
    slow = choose(_Cal(2.5e-8), _layers(), lens, device=False)  # exchanges as long as the compute
    assert slow.best.micro_batches >= 2 and slow.best.predicted_s < slow.serial_s
    assert slow.best.predicted_s == min(c.predicted_s for c in slow.candidates)
    assert slow.speedup == pytest.approx(slow.serial_s / slow.best.predicted_s)
    assert "auto: chose" in slow.format() and slow.best.describe() in slow.format()


def test_a_split_wins_over_one_batch_only_by_more_than_the_margin():
    lens = [(64, 64, 64, 64)]
    # a link where splitting gains a few per cent: the split is the fastest prediction, one batch the choice
    for spb in (2e-10, 5e-10, 1e-9, 2e-9):
        free = choose(_Cal(spb), _layers(), lens, device=False, split_margin=0.0)
        whole = min(c.predicted_s for c in free.candidates if c.micro_batches == 1)
        if free.best.micro_batches > 1 and free.best.predicted_s > whole * 0.90:
            break
    else:
        pytest.fail("no link put a split within 10% of one batch")
    kept = choose(_Cal(spb), _layers(), lens, device=False)
    assert kept.best.micro_batches == 1 and kept.best.predicted_s == pytest.approx(whole)
    assert kept.candidates == free.candidates  # the same predictions, another decision
    assert "within the 10% a split must gain" in kept.format() and "split must gain" not in free.format()
    slow = choose(_Cal(2.5e-8), _layers(), lens, device=False)  # a split far ahead is still taken
    assert slow.best.micro_batches >= 2
    with pytest.raises(ValueError, match="split_margin must be in"):
        choose(_Cal(0.0), _layers(), lens, device=False, split_margin=1.0)


def test_a_rank_that_cannot_split_removes_the_split_candidates():
    lens = [(64, 64, 64, 64), (1,)]
    choice = choose(_Cal(2.5e-8), _layers(), lens, device=False)
    assert {c.micro_batches for c in choice.candidates} == {1}


def test_a_model_that_cannot_cut_gets_boundary_splits_only():
    choice = choose(_Cal(2.5e-8), _layers(), [(200, 56)], allow_cut=False, device=False)
    assert all(c.max_imbalance is None for c in choice.candidates if c.micro_batches > 1)


def test_a_choices_split_reason_says_its_split_once():
    lens = (64, 64, 64, 64)
    one = choose(_Cal(0.0), _layers(), [lens], device=False)
    assert one.split(lens, None).reason == "one batch (serial)"
    several = choose(_Cal(2.5e-8), _layers(), [lens], device=False)
    reason = several.split(lens, None).reason
    assert reason.startswith(several.best.describe() + "; request boundar") and "auto" not in reason, reason


def _decide_and_run(ctx, lens):
    import overlap
    from microbatch.planning import calibrate
    from launch.measure.prefill import measure_modes
    from launch.models import build_model, preset
    from launch.engine import make_expert_parallel
    from microbatch.batch import Batch
    from microbatch.planning import gather_lens

    overlap.set_link(overlap.Link(0.05))
    model = make_expert_parallel(build_model(preset("tiny"), seed=3), ctx.group)
    batch = Batch.random(lens[ctx.rank], model.cfg.vocab, seed=11 + ctx.rank)
    all_lens = gather_lens(batch.seq.seq_lens, ctx.group)
    cal = calibrate(model, ctx.group, max_tokens=128, repeats=1)
    choice = choose(cal, model, all_lens)
    results = measure_modes(model, batch, ["serial", "auto"], ctx.group, warmup=0, iters=1, choice=choice)
    out = {r.mode: r.output for r in results}
    return all_lens, choice.best, (out["auto"] - out["serial"]).abs().max().item()


def test_every_rank_takes_the_same_decision_and_auto_equals_serial(tmp_path, monkeypatch):
    monkeypatch.setenv("OVERLAP_CALIBRATION_CACHE", str(tmp_path))
    lens = [[40, 24, 33], [90, 7]]
    (l0, best0, d0), (l1, best1, d1) = run_ranks(_decide_and_run, 2, lens,
                                                  env={"OVERLAP_CALIBRATION_CACHE": str(tmp_path)}, timeout=180)
    assert l0 == l1 == [tuple(x) for x in lens]
    assert best0 == best1
    assert d0 <= 1e-4 and d1 <= 1e-4


@pytest.mark.spawns_ranks
def test_the_launcher_plans_runs_and_writes_the_prediction(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OVERLAP_CALIBRATION_CACHE=str(tmp_path / "cal"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()), SCRIPT,
           "--preset", "tiny", "--mode", "auto", "--check", "--warmup", "0", "--iters", "1", "--seq-lens", "48,30,20",
           "--out", str(tmp_path / "out")]
    proc = zygote.run(cmd, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("auto: chose") == 1 and "predicted" in out and "measured" in out
    assert "check: every mode matches serial" in out
    assert (tmp_path / "out" / "trace_auto.json").exists() and (tmp_path / "out" / "trace_auto.predicted.json").exists()
    from click.testing import CliRunner

    from overlap.observability.report import main as report  # here: a process of its own costs torch's import

    compared = CliRunner().invoke(report, [str(tmp_path / "out" / "trace_auto.json"), "--plan",
                                           str(tmp_path / "out" / "trace_auto.predicted.json")], catch_exceptions=False)
    assert compared.exit_code == 0, compared.output[-2000:]


@pytest.mark.spawns_ranks
def test_auto_in_a_mode_list_says_whether_its_calibration_is_cached(tmp_path):
    """`--mode two-batch,auto`: serial runs beside auto, the first run says it calibrates and where it
    caches, the second that it read that file; the split line names auto's split, not `auto: ...`."""
    env = dict(os.environ, PYTHONPATH=ROOT, OVERLAP_CALIBRATION_CACHE=str(tmp_path / "cal"))
    cmd = [sys.executable, SCRIPT, "--preset", "tiny", "--mode", "two-batch,auto", "--warmup", "0", "--iters", "1",
           "--seq-lens", "48,30,20"]
    runs = [zygote.run(cmd, timeout=300, env=env, cwd=ROOT) for _ in range(2)]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    (cached,) = (tmp_path / "cal").glob("*.json")
    first, second = (proc.stdout for proc in runs)  # the calibration's source is said with the results
    assert f"cached after this run in {cached})" in first and "calibration: cached" not in first, first
    assert f"calibration: cached ({cached})" in second and "calibrating" not in second, second
    for out in (proc.stdout for proc in runs):
        assert re.findall(r"^(serial|two-batch|auto) +[0-9.]+ \[", out, re.M) == ["serial", "two-batch", "auto"], out
        chose = re.search(r"^auto: chose (.+?): predicted", out, re.M).group(1)
        split = re.search(r"^auto split: (.+)$", out, re.M).group(1)
        assert split == f"one batch ({chose})" if chose in microbatch.MODES else split.startswith(chose + "; "), out


@pytest.mark.spawns_ranks
def test_the_planning_benchmark_runs_at_a_tiny_size(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OVERLAP_CALIBRATION_CACHE=str(tmp_path))
    env.pop("OVERLAP_FORKSERVER_PRELOAD", None)  # the suite's preloads transformers, which these ranks never use
    proc = zygote.run([sys.executable, "-m", "launch.bench.plan", "--preset", "tiny", "--tokens", "48", "--links", "0.1",
                       "--warmup", "0", "--iters", "1", "--min-seconds", "0", "--repeats", "2"],
                      timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "48 tokens per rank" in proc.stdout and "auto chose" in proc.stdout and "targets:" in proc.stdout
    for mode in ("serial", "shared", "two-batch", "three-batch", "four-batch", "auto"):
        assert f"  {mode} " in proc.stdout


def _point(tokens, link, times, same_as=None, predicted=None):
    """A benchmark point as `launch.bench.plan._point` returns it: measured (and predicted) ms per mode."""
    predicted = predicted or times
    rows = [(m, times[m] / 1e3, predicted[m] / 1e3, (times[m] / 1e3, times[m] / 1e3)) for m in times]
    return {"tokens": tokens, "link": link, "choice": same_as or "two-batch", "comm_share": 0.4, "rounds": 5,
            "async_host_s": 0.0, "async_host_per_byte": 0.0, "two_batch": {}, "same_as": same_as, "rows": rows}


def test_the_planning_benchmark_judges_auto_by_the_schedule_it_ran():
    from launch.bench.plan import _report

    modes = dict(serial=100.0, shared=90.0, **{"two-batch": 95.0, "three-batch": 120.0, "four-batch": 130.0})
    # auto ran shared's schedule and split: its own rounds were 10% slower, a second sample of the same schedule
    text, misses = _report([_point(64, 0.1, dict(modes, auto=99.0), same_as="shared")])
    assert "auto ran shared's schedule and split" in text and "+10.0% apart" in text
    assert not [m for m in misses if m.startswith("auto")], misses
    # a schedule no fixed mode ran is judged by auto's own row
    text, misses = _report([_point(64, 0.1, dict(modes, auto=99.0))])
    assert "auto +10.0% against shared at 64 tokens" in "\n".join(misses)
    # a wrong choice is a miss even when auto's own rounds were lucky
    wrong = dict(modes, serial=80.0, auto=81.0)
    text, misses = _report([_point(64, 0.1, wrong, same_as="shared")])
    assert "auto +12.5% against serial at 64 tokens" in "\n".join(misses)
    # predictions: judged relative to serial at 90% of the rows (4 of 5 misses), and the default point's speedup
    off = dict(modes, auto=90.0)
    text, misses = _report([_point(1024, 0.1, off, "shared", predicted=dict(off, **{"two-batch": 76.0}))])
    assert "predictions relative to serial's within 10% at 4 of 5 points (target: 90%)" in "\n".join(misses)
    assert "two-batch reaches 80% of its predicted speedup" in "\n".join(misses)
    # relative to serial, the host's drift between calibration and measurement cancels: all 10% slow is no error,
    # and the absolute error is shown, not judged
    slow = {m: t * 1.1 for m, t in off.items()}
    text, misses = _report([_point(1024, 0.1, off, "shared", predicted=slow)])
    assert "5 of 5 within 10% (worst +0.0%)" in text and "+10.0%" in text
    assert "worst absolute prediction error, 10.0%, is information" in text
    assert not [m for m in misses if "prediction" in m], misses
    text, _ = _report([_point(1024, 0.1, off, "shared", predicted=dict(off, **{"two-batch": 76.0}))])
    assert "4 of 5 within 10% (worst -20.0%)" in text
