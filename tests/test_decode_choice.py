"""Choosing a decode step's mode (`microbatch.planning.decode`): the calibration's table of step times, the choice
per step, and auto's guard over its choices."""
import math
import random
import statistics

import pytest

from microbatch.planning.decode import (DecodeCalibration, DecodeCalibrationError, DecodeGuard, choose_decode,
                                        relative_error)

TABLE = DecodeCalibration((1, 2, 4), (8, 24), {
    "serial": ((1.0, 2.0), (2.0, 3.0), (4.0, 6.0)),
    "two-batch": ((2.0, 3.0), (2.5, 3.5), (3.0, 4.0)),
    "shared": ((0.99, 1.99), (1.99, 2.99), (3.99, 5.99)),  # 1% faster than serial: within the margin
})


def test_a_prediction_is_linear_between_the_measured_points_and_extends_the_last_segment():
    assert TABLE.predict("serial", 1, 8) == 1.0 and TABLE.predict("serial", 4, 24) == 6.0
    assert TABLE.predict("serial", 3, 8) == pytest.approx(3.0)  # halfway between 2 and 4 tokens
    assert TABLE.predict("serial", 2, 16) == pytest.approx(2.5)  # halfway between the histories
    assert TABLE.predict("serial", 8, 8) == pytest.approx(8.0)  # past 4 tokens: the last segment's slope
    noisy = DecodeCalibration((1,), (8, 24), {"serial": ((2.0, 1.0),)})
    assert noisy.predict("serial", 1, 100) == pytest.approx(1.5)  # shorter at the longer history: no growth


def test_the_choice_is_the_fastest_but_serial_unless_another_is_clearly_faster():
    assert choose_decode(TABLE, 1, 8).mode == "serial"  # shared is 1% faster: not enough
    assert choose_decode(TABLE, 1, 8, margin=0.0).mode == "shared"
    for faster, mode in ((0.04, "serial"), (0.06, "shared")):  # the default margin: 5%
        close = DecodeCalibration((1,), (8, 24), {"serial": ((1.0, 1.0),), "shared": ((1 - faster, 1 - faster),)})
        assert choose_decode(close, 1, 8).mode == mode
    pick = choose_decode(TABLE, 4, 24)
    assert pick.mode == "two-batch" and pick.seconds == pytest.approx(4.0) and set(pick.predicted) == set(TABLE.modes)
    assert choose_decode(TABLE, 4, 24, modes=["serial", "shared"], margin=0.0).mode == "shared"
    with pytest.raises(ValueError, match="mode chunked-2 was not calibrated"):
        choose_decode(TABLE, 1, 8, modes=["serial", "chunked-2"])


def test_serial_stays_where_the_predicted_gain_is_inside_the_calibrations_noise():
    seconds = {"serial": ((1.0, 1.0), (2.0, 2.0)), "shared": ((0.9, 0.9), (1.8, 1.8))}  # shared 10% faster
    quiet = DecodeCalibration((1, 2), (8, 24), seconds, {"serial": ((0.01, 0.01), (0.01, 0.01)),
                                                         "shared": ((0.01, 0.01), (0.01, 0.01))})
    loud = DecodeCalibration((1, 2), (8, 24), seconds, {"serial": ((0.05, 0.01), (0.01, 0.01)),
                                                        "shared": ((0.01, 0.01), (0.01, 0.06))})
    assert loud.noise_at("serial", 1) == 0.05 and loud.noise_at("shared", 1) == 0.06  # the entries it reads
    assert choose_decode(quiet, 1, 8).mode == "shared"  # 1.5 x 1.4% of noise: the 5% margin decides
    assert choose_decode(loud, 1, 8).mode == "serial"  # 1.5 x hypot(5%, 6%) = 11.7% > 10%
    assert choose_decode(loud, 1, 8, confidence=1.0).mode == "shared"  # 7.8% < 10%
    assert choose_decode(DecodeCalibration((1, 2), (8, 24), seconds), 1, 8).mode == "shared"  # no noise figures
    # a noisy fastest gives way to a steadier mode that is clearly faster, not to serial
    three = DecodeCalibration((1,), (8, 24), {"serial": ((1.0, 1.0),), "two-batch": ((0.7, 0.7),),
                                              "chunked-2": ((0.8, 0.8),)},
                              {"serial": ((0.02, 0.02),), "two-batch": ((0.3, 0.3),), "chunked-2": ((0.02, 0.02),)})
    assert choose_decode(three, 1, 8).mode == "chunked-2"
    # the median's standard error from the interquartile range: one stray slow step barely moves it
    assert relative_error([1.0]) == 0.0
    assert relative_error([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(1.25 * 2 / 1.349 / 3 / 5 ** 0.5)
    assert relative_error([1.0] * 9 + [1.02] * 10 + [50.0]) < 0.01


def test_a_table_round_trips_and_a_bad_one_is_refused_in_one_line():
    assert DecodeCalibration.from_dict(TABLE.to_dict()) == TABLE
    noisy = DecodeCalibration(TABLE.tokens, TABLE.histories, TABLE.seconds,
                              {m: ((0.01, 0.02),) * 3 for m in TABLE.modes})
    assert DecodeCalibration.from_dict(noisy.to_dict()) == noisy and "noise" not in TABLE.to_dict()
    assert "noise (relative standard error of an entry's median): 1.0% to 2.0%" in noisy.format()
    bad = [({"tokens": [2, 1], "histories": [8, 24], "seconds": {"serial": [[1, 1], [1, 1]]}}, "increasing counts"),
           ({"tokens": [1], "histories": [8, 24], "seconds": {"shared": [[1, 1]]}}, "measures serial"),
           ({"tokens": [1], "histories": [8, 24], "seconds": {"serial": [[1, 0]]}}, "two positive times"),
           ({"tokens": [1], "histories": [8]}, "not a decode calibration"),
           ({"tokens": [1], "histories": [8, 24], "seconds": {"serial": [[1, 1]]}, "noise": {"serial": [[0.1, -1]]}},
            "two noise figures >= 0"),
           ({"tokens": [1], "histories": [8, 24], "seconds": {"serial": [[1, 1]]}, "noise": {"serial": [[0.1, "nan"]]}},
            "two noise figures >= 0"),
           ({"tokens": [1], "histories": [8, 24], "seconds": {"serial": [[1, 1]]}, "noise": {}}, "two noise figures")]
    # NaN, inf, a time a prediction overflows to inf from, an integer no float holds (before: NaN and 1e308 used,
    # "TPOT predicted 0.0 ms" / "inf ms"; 10**400 an OverflowError's traceback)
    bad += [({"tokens": [1], "histories": [8, 24], "seconds": {"serial": [[1, t]]}}, words)
            for t, words in ((math.nan, "two positive times"), (math.inf, "two positive times"),
                             (1e308, r"at most 3600 s"), (10 ** 400, "not a decode calibration: OverflowError"))]
    for data, words in bad:
        with pytest.raises(DecodeCalibrationError, match=words):
            DecodeCalibration.from_dict(data)


def test_a_cache_file_nested_too_deep_is_measured_again_with_a_warning(tmp_path, caplog):
    """(Before: json's RecursionError, a traceback.)"""
    from microbatch.planning import read_cache

    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with caplog.at_level("WARNING", logger="microbatch.planning"):
        assert read_cache(str(path)) is None
    assert "ignoring the unreadable calibration" in caplog.text and "measuring again" in caplog.text


def _guarded(guard, cost, steps, tokens=4, history=24):
    """Auto's modes over ``steps`` steps of TABLE's ``tokens`` and ``history`` ("probe": serial, to measure it), each
    step measured at ``cost[mode]`` times its prediction."""
    modes = []
    for _ in range(steps):
        c = guard.choose(TABLE, tokens, history)
        modes.append("probe" if c.probe else c.mode)
        guard.record(c.mode, c.seconds, c.seconds * cost[c.mode])
    return modes


def test_the_guard_sets_aside_a_mode_its_steps_measured_slower_than_serial():
    # at 4 tokens and 24 rows two-batch is predicted 4.0 s against serial's 6.0 (shared: within the margin)
    slow = DecodeGuard()
    modes = _guarded(slow, {"serial": 1.0, "shared": 1.0, "two-batch": 2.0}, 10)  # two-batch measured 8.0 s
    assert modes == ["probe"] * 3 + ["two-batch"] * 3 + ["serial"] * 4, modes
    assert slow.vetoed == {"two-batch": 4} and slow.probes == 3
    assert slow.summary() == ("guard: 3 serial probe step(s) of 10; set aside two-batch at 4 step(s) (measured "
                              "slower than serial)")
    # measured 4.8 s: still faster than serial, kept; serial probed again once every 32 steps
    kept = DecodeGuard()
    modes = _guarded(kept, {"serial": 1.0, "shared": 1.0, "two-batch": 1.2}, 40)
    assert modes[3:34] == ["two-batch"] * 31 and modes[34] == "probe" and modes[35:] == ["two-batch"] * 5, modes
    assert kept.vetoed == {} and kept.summary().endswith("no mode set aside")
    # a host twice as slow as when calibrated slows serial as much: no reason to set two-batch aside
    drift = DecodeGuard()
    assert _guarded(drift, {"serial": 2.0, "shared": 2.0, "two-batch": 2.0}, 10)[3:] == ["two-batch"] * 7
    # set aside for `hold` steps, serial running instead; then tried again, judged on new steps: set aside again
    held = DecodeGuard(hold=20)
    modes = _guarded(held, {"serial": 1.0, "shared": 1.0, "two-batch": 2.0}, 32)
    assert modes[6:26] == ["serial"] * 20 and modes[26:29] == ["two-batch"] * 3 and modes[29:] == ["serial"] * 3, modes
    # where the calibration's choice is set aside, serial runs, not its runner-up: a calibration found wrong for one
    # mode is not trusted for the next
    two = DecodeCalibration((1,), (8, 24), {"serial": ((6.0, 6.0),), "two-batch": ((4.0, 4.0),),
                                            "chunked-2": ((5.0, 5.0),)})
    second = DecodeGuard()
    modes = []
    for _ in range(8):
        c = second.choose(two, 1, 8)
        modes.append(c.mode)
        second.record(c.mode, c.seconds, c.seconds * {"serial": 1.0, "two-batch": 2.0, "chunked-2": 1.0}[c.mode])
    assert modes == ["serial"] * 3 + ["two-batch"] * 3 + ["serial"] * 2, modes
    # where the calibration keeps serial, the guard runs nothing else and probes nothing
    assert _guarded(DecodeGuard(), {"serial": 1.0, "shared": 0.1, "two-batch": 0.1}, 5, tokens=1, history=8) == \
        ["serial"] * 5
    # slower than serial by less than the steps' own spread explains: kept; by more: set aside
    for costs, aside in (([1.6, 1.1, 1.7], False), ([2.0, 2.1, 1.9], True)):
        noisy = DecodeGuard()
        for _ in range(3):  # serial's probes, each at its prediction
            c = noisy.choose(TABLE, 4, 24)
            noisy.record(c.mode, c.seconds, c.seconds)
        for cost in costs:  # median 1.6: 0.94x serial, the steps spread 20%; median 2.0: 0.75x, spread 5%
            c = noisy.choose(TABLE, 4, 24)
            noisy.record(c.mode, c.seconds, c.seconds * cost)
        assert noisy.choose(TABLE, 4, 24).mode == ("serial" if aside else "two-batch"), costs


def _noisy_run(guard, speedup, seed, steps=49, slows_at=None):
    """The share of ``steps`` auto steps that ran two-batch, and whether the guard set it aside: two-batch predicted
    1.32x serial, measured ``speedup``, every step's time off by a log-normal factor (sigma 0.19: steps spreading
    about 26%, as this host's do); from step ``slows_at`` on every mode takes 1.3 times as long."""
    rng = random.Random(seed)
    cal = DecodeCalibration((1,), (8, 24), {"serial": ((6.0, 6.0),), "two-batch": ((6.0 / 1.32, 6.0 / 1.32),)})
    ran = 0
    for step in range(steps):
        c = guard.choose(cal, 1, 8)
        ran += c.mode == "two-batch"
        host = 1.3 if slows_at is not None and step >= slows_at else 1.0
        true = 6.0 if c.mode == "serial" else 6.0 / speedup
        guard.record(c.mode, c.seconds, true * host * math.exp(rng.gauss(0.0, 0.19)))
    return ran / steps, bool(guard.vetoed)


def test_the_guard_judges_a_mode_against_serial_measured_beside_it_on_a_noisy_host():
    # the host slows by 30% after serial's first steps: a mode 18% faster than serial is not taken for a slower
    # one (measured against serial's old steps alone, it was set aside in 39% of these runs)
    runs = [_noisy_run(DecodeGuard(), 1.18, seed, slows_at=10) for seed in range(100)]
    assert sum(aside for _, aside in runs) <= 8, sum(aside for _, aside in runs)
    assert statistics.mean(share for share, _ in runs) >= 0.8
    # steady host: a faster mode is rarely set aside, a mode 20% slower mostly is, and runs a third of the steps at
    # most (the noise of each step's time, pooled over the modes, sizes the standard errors)
    fast = [_noisy_run(DecodeGuard(), 1.18, seed) for seed in range(100)]
    slow = [_noisy_run(DecodeGuard(), 0.8, seed) for seed in range(100)]
    assert sum(aside for _, aside in fast) <= 4 and sum(aside for _, aside in slow) >= 85
    assert statistics.mean(share for share, _ in slow) <= 0.33


def test_the_guard_rejects_settings_it_cannot_use():
    for bad, words in (({"min_samples": 0}, "min_samples must be between 1 and window"),
                       ({"confidence": float("nan")}, "confidence must be a number of standard errors >= 0"),
                       ({"window": 2, "min_samples": 3}, "min_samples must be between 1 and window"),
                       ({"hold": 0}, "hold, probe_every and forget must be at least one step")):
        with pytest.raises(ValueError, match=words):
            DecodeGuard(**bad)
