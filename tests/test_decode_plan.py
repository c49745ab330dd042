"""Decode's planner: a measured table of step times (`DecodeCalibration`), the choice per step, and auto."""
import pytest
import torch

from microbatch.planning import DecodeCalibration, DecodeCalibrationError, choose_decode

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


def test_a_table_round_trips_and_a_bad_one_is_refused_in_one_line():
    assert DecodeCalibration.from_dict(TABLE.to_dict()) == TABLE
    bad = [({"tokens": [2, 1], "histories": [8, 24], "seconds": {"serial": [[1, 1], [1, 1]]}}, "increasing counts"),
           ({"tokens": [1], "histories": [8, 24], "seconds": {"shared": [[1, 1]]}}, "measures serial"),
           ({"tokens": [1], "histories": [8, 24], "seconds": {"serial": [[1, 0]]}}, "two positive times"),
           ({"tokens": [1], "histories": [8]}, "not a decode calibration")]
    for data, words in bad:
        with pytest.raises(DecodeCalibrationError, match=words):
            DecodeCalibration.from_dict(data)


def _auto_body(ctx):
    import dataclasses

    from launch.decode import DecodeError, generate
    from launch.decode_plan import calibrate_decode
    from launch.models import build_model, preset
    from launch.runner import make_expert_parallel

    model = make_expert_parallel(build_model(dataclasses.replace(preset("tiny"), n_experts=4), seed=2), ctx.group)
    measured = calibrate_decode(model, max_tokens=3, histories=(4, 6), modes=("serial", "chunked-2"), repeats=1,
                                steps=1)
    # two-batch only pays from 3 tokens on: as requests finish and the batch shrinks, auto turns to serial
    plan = DecodeCalibration((1, 2, 3), (4, 20), {"serial": ((1.0, 1.0), (2.0, 2.0), (3.0, 3.0)),
                                                 "two-batch": ((2.0, 2.0), (2.5, 2.5), (2.0, 2.0))})
    g = torch.Generator().manual_seed(ctx.rank)
    prompts = [torch.randint(0, model.cfg.vocab, (4,), generator=g).tolist() for _ in range(3)]
    counts = [2, 4, 6] if ctx.rank == 0 else [6, 6, 3]
    auto = generate(model, prompts, counts, mode="auto", plan=plan)
    serial = generate(model, prompts, counts)
    try:  # the ranks call with different batches: both say so, neither waits for the other
        calibrate_decode(model, max_tokens=2 + ctx.rank, histories=(4, 6), repeats=1, steps=1)
        refused = None
    except DecodeError as err:
        refused = str(err)
    return measured, auto, serial.tokens, refused


def test_auto_chooses_per_step_alike_on_every_rank_and_generates_serials_tokens():
    """On two ranks: the calibration's table is the same on both (the slowest rank's times); auto's choice changes
    as requests finish, is the same on every rank, and its tokens are serial's; ranks that calibrate different
    batches get one error naming the difference instead of a hang."""
    from overlap.multirank import run_ranks

    (cal0, auto0, serial0, refused0), (cal1, auto1, serial1, refused1) = run_ranks(_auto_body, 2, timeout=180)
    assert cal0 == cal1 and cal0.tokens == (1, 2, 3) and cal0.modes == ("serial", "chunked-2")
    assert auto0.modes == auto1.modes and auto0.modes[0] == "two-batch" and auto0.modes[-1] == "serial"
    assert len(auto0.predicted) == auto0.steps == len(auto0.modes)
    assert auto0.tokens == serial0 and auto1.tokens == serial1
    for refused in (refused0, refused1):
        assert refused is not None and "max_tokens" in refused and "rank 0: 2" in refused, refused


def _cache_body(ctx, root):
    import json
    import os

    from launch.decode_plan import calibrate_decode
    from launch.models import build_model, preset
    from launch.runner import make_expert_parallel

    model = make_expert_parallel(build_model(preset("tiny"), seed=2), ctx.group)
    mine = os.path.join(root, f"rank{ctx.rank}")

    def run(**kw):
        lines, measured = [], []
        cal = calibrate_decode(model, max_tokens=2, histories=(4, 6), modes=("serial", "chunked-2"), repeats=1,
                               steps=1, cache=kw.pop("cache", mine), report=lines.append, progress=measured.append,
                               **kw)
        return cal, lines, bool(measured)

    first = run()
    again = run()
    (path,) = [os.path.join(mine, f) for f in os.listdir(mine)]
    with open(path) as f:
        data = json.load(f)
    if ctx.rank == 0:  # rank 0's file says its steps took longer: both ranks read the slowest rank's numbers
        data["calibration"]["seconds"]["serial"][0] = [1.0, 2.0]
        with open(path, "w") as f:
            json.dump(data, f)
    edited = run()
    refreshed = run(refresh=True)
    one_rank = run(cache=mine if ctx.rank == 0 else mine + "-empty")  # only rank 0 has it
    with open(path, "w") as f:
        f.write("{not json")
    damaged = run()
    return first, again, edited, refreshed, one_rank, damaged


def test_the_decode_calibration_is_cached_and_read_back_alike_on_every_rank(tmp_path):
    """A second calibration of the same job reads the cache (nothing measured) and every rank holds the same table,
    whatever its own file says; refresh, a file on one rank only, or a damaged file measure again."""
    from overlap.multirank import run_ranks

    out = run_ranks(_cache_body, 2, str(tmp_path), timeout=180)
    for first, again, edited, refreshed, one_rank, damaged in out:
        assert first[2] and "calibrating decode (none cached" in first[1][0]
        assert not again[2] and again[0] == first[0] and again[1][0].startswith("decode calibration: cached (")
        assert not edited[2] and edited[0].seconds["serial"][0] == (1.0, 2.0)
        assert refreshed[2] and "calibrating decode (refreshing" in refreshed[1][0]
        assert damaged[2] and "none cached" in damaged[1][0]
    assert out[0][4][2] and out[1][4][2] and "not cached on every rank" in out[0][4][1][0]
    assert out[0][2][0] == out[1][2][0]
