"""The decode benchmark (launch/bench/decode.py): its table and targets from given figures, and a run at a tiny size."""
import os
import re
import sys

import pytest

from support import zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _point(tokens, link, share, ms):
    """A point as `launch.bench.decode._point` returns it: TPOT in ms per mode (no spread)."""
    return {"tokens": tokens, "link": link, "comm_share": share, "rounds": 5, "steps": 7,
            "rows": {m: (t / 1e3, None) for m, t in ms.items()}}


def test_the_table_and_the_overlap_target_from_given_figures():
    from launch.bench.decode_targets import report, target_overlap_pays

    pays = _point(256, 0.1, 0.4, {"serial": 100.0, "shared": 95.0, "two-batch": 80.0})
    text = report([pays, _point(8, 0.1, 0.5, {"serial": 10.0, "shared": 12.0, "two-batch": 20.0})])
    assert re.search(r"^ +256 +0\.1 +40% +100\.00 +95\.00 +80\.00 +1\.05x +1\.25x +two-batch +- +5 x 7 +-$", text, re.M)
    assert re.search(r"^ +8 +0\.1 +50% .* serial ", text, re.M)
    what, met, detail = target_overlap_pays([pays])  # no ceiling measured: the gain cannot be judged
    assert met is None and detail == "two-batch 1.25x at 0.1 GB/s (comm 40%; no ceiling measured: not judged)"
    pays["unlinked"] = {"serial": 100.0, "shared": 90.0, "two-batch": 70.0}  # at most 1.43x: 1.25x is 58% of its gain
    what, met, detail = target_overlap_pays([pays])
    assert met is True and "two-batch 1.25x at 0.1 GB/s" in detail and "at most 1.43x (two-batch)" in detail
    assert "58% of its gain" in detail
    loses = dict(_point(256, 0.03, 0.5, {"serial": 100.0, "shared": 99.0, "two-batch": 110.0}),
                 unlinked={"serial": 100.0, "shared": 95.0, "two-batch": 80.0})
    assert target_overlap_pays([pays, loses])[1] is False  # every qualifying point must pay
    assert target_overlap_pays([_point(256, 1.0, 0.2, {"serial": 100.0, "shared": 99.0})])[1] is None  # comm < 30%
    # without auto and its calibration, those two targets say they checked nothing
    assert "not checked (no auto row)" in text and "not checked (no prediction" in text and "MISSED" not in text
    assert "not checked (no point at 32 tokens/rank)" in text


def test_the_gain_is_judged_against_the_ceiling_never_above_it():
    """The issue's figures: two-batch 1.04x where hiding the whole link could give at most 1.11x is not judged
    against 1.15x (named with both figures); under a ceiling of 1.15x the best mode needs half its gain; a share
    within two standard errors of half is inconclusive."""
    from launch.bench.decode_targets import INCONCLUSIVE, ceilings, report, target_overlap_pays

    p = _point(256, 0.1, 0.33, {"serial": 60.0, "two-batch": 55.0, "chunked-2": 54.0})
    assert ceilings(p) == {}  # not measured at this point
    p["unlinked"] = {"serial": 61.0, "two-batch": 53.0, "chunked-2": 55.0}  # serial's at the link, beside them
    assert ceilings(p) == pytest.approx({"two-batch": 61 / 53, "chunked-2": 61 / 55})
    what, met, detail = target_overlap_pays([p])
    assert met is True and detail == ("chunked-2 1.11x at 0.1 GB/s (comm 33%; at most 1.15x (two-batch) with no link "
                                      "at all: 74% of its gain)"), detail
    issue = dict(_point(256, 0.1, 0.4, {"serial": 8.82, "two-batch": 8.48}),
                 unlinked={"serial": 8.82, "two-batch": 7.95})  # 1.04x under a ceiling of 1.11x
    what, met, detail = target_overlap_pays([issue])
    assert met is None and detail == ("two-batch 1.04x at 0.1 GB/s (comm 40%; at most 1.11x (two-batch) with no link "
                                      "at all, below 1.15x: not judged)"), detail
    assert "not checked (two-batch 1.04x" in report([issue])
    short = dict(_point(256, 0.1, 0.4, {"serial": 100.0, "two-batch": 96.0}),
                 unlinked={"serial": 100.0, "two-batch": 80.0})  # 1.04x of at most 1.25x: 17% of its gain
    assert target_overlap_pays([short])[1] is False
    near = dict(short, rows={"serial": (0.1, None), "two-batch": (0.089, None)})  # 1.12x: 49% of its gain
    assert target_overlap_pays([near])[1] is False
    near["noise"] = {"serial": 0.01, "two-batch": 0.01}  # ±2 x 6% of the gain: the noise covers 50%
    what, met, detail = target_overlap_pays([near])
    assert met == INCONCLUSIVE and "49% of its gain ±" in detail, detail
    assert f"MISSED" not in report([near]) and f": {INCONCLUSIVE} (" in report([near])
    text = report([p, _point(8, 0.1, 0.5, {"serial": 10.0, "two-batch": 20.0, "chunked-2": 15.0})])
    assert ("\n  at 256 tokens/rank with no link at all (serial at 0.1 GB/s beside them): two-batch 1.15x, chunked-2 1.11x: "
            "the most each could reach here, hiding the whole link\n") in text, text
    assert "at 8 tokens/rank with no link" not in text


def test_the_executors_host_time_is_judged_against_serials_tpot_at_32_tokens():
    from launch.bench.decode_targets import report, target_host

    quick = dict(_point(32, 0.1, 0.4, {"serial": 20.0, "shared": 19.0}), executor_s=0.0015)
    slow = dict(_point(32, 1.0, 0.3, {"serial": 20.0, "shared": 19.0}), executor_s=0.0025)
    assert target_host([quick])[1] is True and "7.5% (1.50 of 20.0 ms)" in target_host([quick])[2]
    assert target_host([quick, slow])[1] is False  # 12.5% at 1 GB/s
    assert re.search(r" 5 x 7 +8%$", report([quick]), re.M)


def test_auto_is_judged_on_its_own_time_and_predictions_by_their_ratio_to_serial():
    from launch.bench.decode_targets import (INCONCLUSIVE, auto_as_fixed, prediction_errors, report, target_auto,
                                             target_prediction)

    p = _point(64, 0.1, 0.4, {"serial": 100.0, "shared": 90.0, "two-batch": 80.0, "auto": 95.0})
    p["chosen"] = {"two-batch": 7}
    p["predicted"] = {"serial": 0.1, "shared": 0.1 / 1.2, "two-batch": 0.1 / 1.25}  # predicted 1.2x and 1.25x
    assert auto_as_fixed(p) == ("two-batch", 0.08)  # what its choices alone would give: a second column
    # its own row (95 ms), not its choices costed at two-batch's TPOT, is judged: 19% above the best
    what, met, detail = target_auto([p])
    assert met is False and what.startswith("auto's own TPOT") and detail == (
        "not met at 1 of 1 points (± two standard errors of the comparison): 64 @ 0.1: auto 1.05x, best two-batch "
        "1.25x: missed"), detail
    assert target_auto([dict(p, rows={**p["rows"], "auto": (0.082, None)})])[1] is True  # 82 ms: within 5%
    errors = prediction_errors(p)
    assert errors["two-batch"] == pytest.approx(0.0) and errors["shared"] == pytest.approx(1.2 / (100 / 90) - 1)
    assert target_prediction([p])[1] is True  # 8% and 0%: both within 10%
    mixed = dict(p, chosen={"two-batch": 5, "shared": 2}, choosing_s=0.0005)
    assert auto_as_fixed(mixed) == ("mixed", pytest.approx((5 * 0.08 + 2 * 0.09) / 7 + 0.0005))
    # 84.9 ms is 1.1% past 5% above two-batch's 80: a miss where the comparison's standard error is well under it,
    # inconclusive where two of them cover it (hypot(3%, 2%) = 3.6%), met where it is well inside
    own = {**p["rows"], "auto": (0.0849, None)}
    steady = dict(p, rows=own, noise={"serial": 0.001, "shared": 0.003, "two-batch": 0.002, "auto": 0.003})
    assert target_auto([steady])[1] is False
    noisy = dict(p, rows=own, noise={"serial": 0.01, "shared": 0.03, "two-batch": 0.02, "auto": 0.03})
    what, met, detail = target_auto([noisy])
    assert met == INCONCLUSIVE and detail.endswith("best two-batch 1.25x (±7.2%): inconclusive: noise"), detail
    assert f"auto's own TPOT within 5% of the best fixed mode and <= 2% above serial at every point: {INCONCLUSIVE}" \
        in report([noisy])
    inside = dict(noisy, rows={**p["rows"], "auto": (0.081, None)}, noise={m: 0.005 for m in noisy["noise"]})
    assert target_auto([inside])[1] is True  # 3.75% inside the margin, ±1.4%
    assert target_auto([inside, noisy])[1] == INCONCLUSIVE and target_auto([inside, steady])[1] is False
    assert re.search(r"two-batch 71%, shared 29% +1\.20x \(mixed\) ", report([mixed]), re.M)
    above_serial = _point(8, 0.1, 0.5, {"serial": 10.0, "shared": 10.3, "auto": 10.3})
    above_serial["chosen"] = {"shared": 7}
    assert target_auto([above_serial])[1] is False  # within 5% of the best but 3% above serial
    wrong = dict(p, predicted={"serial": 0.1, "shared": 0.05, "two-batch": 0.1 / 1.25})  # predicted 2x, measured 1.11x
    assert target_prediction([wrong])[1] is False  # 1 of 2 within 10%
    text = report([p])
    assert "auto costed at its modes x" in text and "auto x: serial's TPOT over auto's own" in text
    assert re.search(r"two-batch 100% +1\.25x \(two-batch\) +shared 1\.20x \(\+8%\) two-batch 1\.25x \(\+0%\)$", text,
                     re.M), text


def test_a_blocking_row_is_measured_beside_its_mode_and_judged_by_no_target():
    from launch.bench import decode
    from launch.bench.decode_targets import best_mode, target_auto

    point = decode.Point(None, None, 8, 0.1)
    assert decode.generate_arguments("two-batch@blocking", point) == {"prefill_mode": "serial", "mode": "two-batch",
                                                                      "agreement": "blocking"}
    p = _point(64, 0.1, 0.4, {"serial": 100.0, "serial@blocking": 70.0, "two-batch": 80.0, "auto": 82.0})
    assert best_mode(p) == "two-batch" and target_auto([p])[1] is True  # not 70 ms
    from click.testing import CliRunner

    for modes, said in (("auto@blocking", "a fixed mode only takes @blocking"), ("three@blocking", "unknown decode mode")):
        result = CliRunner().invoke(decode.main, ["--modes", modes])
        assert result.exit_code == 2 and said in result.output, result.output


def test_a_mode_with_its_own_argument_is_one_maker(monkeypatch):
    from launch.bench import decode

    assert decode.decode_modes()[0] == "serial"
    point = decode.Point(None, None, 8, 0.1)
    assert decode.generate_arguments("two-batch", point) == {"prefill_mode": "serial", "mode": "two-batch"}
    monkeypatch.setitem(decode.MODE_ARGUMENTS, "chunked-", lambda name, p: {"mode": "chunked", "chunks": int(name[8:])})
    assert decode.generate_arguments("chunked-4", point) == {"prefill_mode": "serial", "mode": "chunked", "chunks": 4}


@pytest.mark.spawns_ranks
def test_the_decode_benchmark_runs_at_a_tiny_size():
    proc = zygote.run([sys.executable, "-m", "launch.bench.decode", "--preset", "tiny", "--tokens", "1,2",
                       "--links", "0.1", "--warmup", "0", "--iters", "1", "--min-seconds", "0", "--modes",
                       "two-batch,auto", "--calibrate-at", "0.1", "--calibration-rounds", "1", "--ceiling-at", "2"],
                      timeout=300, env=dict(os.environ, PYTHONPATH=ROOT, OVERLAP_FORKSERVER_PRELOAD=""), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    n = 3  # serial, two-batch, auto: a time per mode, then a speedup per mode but serial's
    row = r" +\d+% +" + r"[0-9.]+ +" * n + r"[0-9.]+x +" * (n - 1) + r"\S+ "
    for tokens in (1, 2):
        assert re.search(rf"^ +{tokens} +0\.1{row}", proc.stdout, re.M), proc.stdout
    assert "serial ms" in proc.stdout and "two-batch x" in proc.stdout and "targets:" in proc.stdout
    assert re.search(r"calibrated decode at 0\.1 GB/s in [0-9.]+ s \(1 round; entries' noise [0-9.]+% to [0-9.]+%, "
                     r"median [0-9.]+%\)", proc.stdout), proc.stdout
    assert "predicted x (error)" in proc.stdout
    assert "auto's calibration measured once, at 0.1 GB/s, for every link" in proc.stdout
    assert "auto costed at its modes x: serial's TPOT over auto's steps each costed" in proc.stdout
    # at --ceiling-at's size only, two-batch also ran with no link beside serial at the link (auto is no fixed mode)
    assert re.search(r"^  at 2 tokens/rank with no link at all \(serial at 0\.1 GB/s beside them\): two-batch "
                     r"[0-9.]+x: the most", proc.stdout, re.M), proc.stdout
    assert "at 1 tokens/rank with no link" not in proc.stdout


def test_the_guard_is_named_under_the_table_where_it_set_a_mode_aside_and_a_bad_calibration_link_is_refused():
    from click.testing import CliRunner

    from launch.bench.decode import main
    from launch.bench.decode_targets import report

    said = "guard: 3 serial probe step(s) of 28; set aside two-batch at 22 step(s) (measured slower than serial)"
    p = dict(_point(256, 1.0, 0.2, {"serial": 100.0, "two-batch": 120.0, "auto": 100.0}), chosen={"serial": 28},
             guard=said, vetoed={"two-batch": 22})
    quiet = dict(p, tokens=128, guard="guard: 0 serial probe step(s) of 28; no mode set aside", vetoed={})
    text = report([quiet, p])
    assert f"\n  auto at 256 tokens/rank, {said}\n" in text and "auto at 128" not in text, text
    refused = CliRunner().invoke(main, ["--calibrate-at", "0"])
    assert refused.exit_code == 2 and "--calibrate-at must be a link speed > 0 GB/s, got 0" in refused.output
    refused = CliRunner().invoke(main, ["--calibration-rounds", "0"])
    assert refused.exit_code == 2 and "--calibration-rounds must be at least 1, got 0" in refused.output
    refused = CliRunner().invoke(main, ["--calibrate-at", "0.1", "--modes", "two-batch"])
    assert refused.exit_code == 2 and "--calibrate-at sets auto's calibration: add auto to --modes" in refused.output
