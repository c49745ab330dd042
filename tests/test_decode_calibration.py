"""Decode's planner: a measured table of step times (`DecodeCalibration`), the choice per step, and auto."""
import pytest
import torch

from microbatch.planning import DecodeCalibration, DecodeGuard


def _guard_body(ctx):
    import dataclasses

    from launch.engine import generate
    from launch.models import build_model, preset
    from launch.engine import make_expert_parallel

    class Scripted(DecodeGuard):
        """Each step measured at a scripted multiple of its prediction; the real (agreed) times kept."""

        def __init__(self, cost):
            super().__init__()
            self.cost, self.measured = cost, []

        def record(self, mode, predicted, measured):
            self.measured.append(measured)
            super().record(mode, predicted, predicted * self.cost[mode])

    model = make_expert_parallel(build_model(dataclasses.replace(preset("tiny"), n_experts=4), seed=2), ctx.group)
    # a calibration that says chunked-2 halves serial's step; its steps measure 1.5 times serial's
    calibration = DecodeCalibration((1, 2, 3), (4, 20), {"serial": ((1.0, 1.0), (2.0, 2.0), (3.0, 3.0)),
                                                        "chunked-2": ((0.5, 0.5), (1.0, 1.0), (1.5, 1.5))})
    g = torch.Generator().manual_seed(ctx.rank)
    prompts = [torch.randint(0, model.cfg.vocab, (4,), generator=g).tolist() for _ in range(3)]
    guard = Scripted({"serial": 1.0, "chunked-2": 3.0})
    auto = generate(model, prompts, 15, mode="auto", calibration=calibration, guard=guard)
    return auto.modes, auto.tokens, generate(model, prompts, 15).tokens, guard.measured, guard.summary()


def test_auto_sets_aside_a_mode_measured_slower_than_serial_alike_on_every_rank():
    """On two ranks: each step's time, agreed (the slowest rank's), reaches both ranks' guards (but the first step
    of each mode, which lowers its schedule); after serial's probes and chunked-2's own steps both set chunked-2
    aside at the same step, and the tokens are serial's. A step's time travels in the agreement that goes under the
    next step, so it reaches the guard one step later than the step after it is chosen."""
    from overlap.multirank import run_ranks

    (modes0, auto0, serial0, times0, said0), (modes1, auto1, serial1, times1, said1) = run_ranks(_guard_body, 2,
                                                                                                timeout=180)
    # serial's 3 samples after the step that lowers it, heard a step late (4 probes), chunked-2's likewise, two
    # probes of serial beside them (the first heard only after the second is chosen), then chunked-2 set aside
    assert modes0 == modes1 == ["serial"] * 5 + ["chunked-2"] * 5 + ["serial"] * 4, modes0
    assert auto0 == serial0 and auto1 == serial1
    assert times0 == times1 and len(times0) == len(modes0) - 2 and min(times0) > 0  # every measured step's, agreed
    assert said0 == said1 and "set aside chunked-2 at 2 step(s)" in said0 and said0.startswith("guard: 7 serial")


def _auto_body(ctx):
    import dataclasses

    from launch.engine import DecodeError, generate
    from launch.engine import calibrate_decode
    from launch.models import build_model, preset
    from launch.engine import make_expert_parallel

    import launch.engine.decoder as decoder
    from launch.engine import TOKENS

    model = make_expert_parallel(build_model(dataclasses.replace(preset("tiny"), n_experts=4), seed=2), ctx.group)
    stepped, real = [], decoder.decode_step

    def spy(model, layers, make, inputs, *rest):
        stepped.append(torch.cat([values[TOKENS] for values in inputs]).tolist())
        return real(model, layers, make, inputs, *rest)

    decoder.decode_step = spy  # this rank's process only: what the calibration's eager decoders run a step with
    try:
        measured = calibrate_decode(model, max_tokens=3, histories=(4, 6), modes=("serial", "chunked-2"), repeats=1,
                                    steps=1)
    finally:
        decoder.decode_step = real
    # two-batch only pays from 3 tokens on: as requests finish and the batch shrinks, auto turns to serial
    calibration = DecodeCalibration((1, 2, 3), (4, 20), {"serial": ((1.0, 1.0), (2.0, 2.0), (3.0, 3.0)),
                                                        "two-batch": ((2.0, 2.0), (2.5, 2.5), (2.0, 2.0))})
    g = torch.Generator().manual_seed(ctx.rank)
    prompts = [torch.randint(0, model.cfg.vocab, (4,), generator=g).tolist() for _ in range(3)]
    counts = [2, 4, 6] if ctx.rank == 0 else [6, 6, 3]
    # the calibration's choice alone
    auto = generate(model, prompts, counts, mode="auto", calibration=calibration, guard=False)
    serial = generate(model, prompts, counts)
    # uneven batches (the docs allow them): each rank calibrates its own, the table is the job's on every rank
    uneven = calibrate_decode(model, max_tokens=2 + ctx.rank, histories=(4 + ctx.rank, 6 + 2 * ctx.rank),
                              modes=("serial", "chunked-2"), repeats=1, steps=1)
    mine = prompts if ctx.rank == 0 else prompts[:1]
    uneven_auto = generate(model, mine, 3, mode="auto", calibration=uneven, guard=False)
    uneven_serial = generate(model, mine, 3).tokens
    try:  # the ranks call with different steps: both say so, neither waits for the other
        calibrate_decode(model, max_tokens=2, histories=(4, 6), repeats=1, steps=1 + ctx.rank)
        refused = None
    except DecodeError as err:
        refused = str(err)
    return measured, auto, serial.tokens, refused, sorted(stepped[-1]), (uneven, uneven_auto, uneven_serial)


def test_auto_chooses_per_step_alike_on_every_rank_and_generates_serials_tokens():
    """On two ranks: the calibration's table is the same on both (the slowest rank's times); auto's choice changes
    as requests finish, is the same on every rank, and its tokens are serial's; ranks with uneven
    batches calibrate the job's table (the most tokens, the shortest and longest history over the ranks: issue 57
    refused them, "ranks disagree on max_tokens") and auto over them chooses alike and generates serial's tokens;
    ranks that calibrate different steps get one error naming the difference instead of a hang. The calibration's
    steps carry other token ids on each rank, as a job's do (the same ids route alike on every rank, and the
    exchanges line up as no job's do)."""
    from overlap.multirank import run_ranks

    (cal0, auto0, serial0, refused0, ids0, uneven0), (cal1, auto1, serial1, refused1, ids1, uneven1) = run_ranks(
        _auto_body, 2, timeout=180)
    assert cal0 == cal1 and cal0.tokens == (1, 2, 3) and cal0.modes == ("serial", "chunked-2")
    assert len(ids0) == len(ids1) == 3 and ids0 != ids1, (ids0, ids1)
    assert auto0.modes == auto1.modes and auto0.modes[0] == "two-batch" and auto0.modes[-1] == "serial"
    assert len(auto0.predicted) == auto0.steps == len(auto0.modes)
    assert auto0.tokens == serial0 and auto1.tokens == serial1
    for refused in (refused0, refused1):
        assert refused is not None and "steps" in refused and "rank 0: 1; rank 1: 2" in refused, refused
    (table0, auto_u0, serial_u0), (table1, auto_u1, serial_u1) = uneven0, uneven1
    assert table0 == table1 and table0.tokens == (1, 2, 3) and table0.histories == (4, 8), table0
    assert auto_u0.modes == auto_u1.modes and auto_u0.steps == 2
    assert auto_u0.tokens == serial_u0 and auto_u1.tokens == serial_u1 and len(serial_u1) == 1


def _cache_body(ctx, root):
    import json
    import os

    from launch.engine import calibrate_decode
    from launch.models import build_model, preset
    from launch.engine import make_expert_parallel

    model = make_expert_parallel(build_model(preset("tiny"), seed=2), ctx.group)
    mine = os.path.join(root, f"rank{ctx.rank}")

    def run(**kw):
        lines, measured = [], []
        cal = calibrate_decode(model, max_tokens=2, histories=(4, 6), modes=("serial", "chunked-2"), repeats=2,
                               steps=2, cache=kw.pop("cache", mine), report=lines.append, progress=measured.append,
                               **kw)
        return cal, lines, bool(measured)

    first = run()
    again = run()
    (path,) = [os.path.join(mine, f) for f in os.listdir(mine)]
    with open(path) as f:
        data = json.load(f)
    if ctx.rank == 0:  # rank 0's file says its steps took longer: both ranks read the slowest rank's numbers
        data["calibration"]["seconds"]["serial"][0] = [1.0, 2.0]
        data["calibration"]["noise"]["serial"][0] = [5.0, 6.0]
        with open(path, "w") as f:
            json.dump(data, f)
    edited = run()
    refreshed = run(refresh=True)
    one_rank = run(cache=mine if ctx.rank == 0 else mine + "-empty")  # only rank 0 has it
    with open(path) as f:
        data = json.load(f)
    if ctx.rank == 1:  # a table without its noise on one rank: ignored there, measured again on both
        del data["calibration"]["noise"]
        with open(path, "w") as f:
            json.dump(data, f)
    noiseless = run()
    with open(path, "w") as f:
        f.write("{not json")
    damaged = run()
    return first, again, edited, refreshed, one_rank, damaged, noiseless


def test_the_decode_calibration_is_cached_and_read_back_alike_on_every_rank(tmp_path):
    """A second calibration of the same job reads the cache (nothing measured) and every rank holds the same table,
    whatever its own file says; refresh, a file on one rank only, or a damaged file measure again."""
    from overlap.multirank import run_ranks

    out = run_ranks(_cache_body, 2, str(tmp_path), timeout=180)
    for first, again, edited, refreshed, one_rank, damaged, noiseless in out:
        assert first[2] and "calibrating decode (none cached" in first[1][0]
        assert first[0].noise is not None and all(x > 0 for rows in first[0].noise.values() for r in rows
                                                  for x in r), first[0].noise
        assert edited[0].noise["serial"][0] == (5.0, 6.0)
        assert noiseless[2]  # measured again on both ranks, no hang
        assert not again[2] and again[0] == first[0] and again[1][0].startswith("decode calibration: cached (")
        assert not edited[2] and edited[0].seconds["serial"][0] == (1.0, 2.0)
        assert refreshed[2] and "calibrating decode (refreshing" in refreshed[1][0]
        assert damaged[2] and "none cached" in damaged[1][0]
    assert out[0][4][2] and out[1][4][2] and "not cached on every rank" in out[0][4][1][0]
    assert "not cached on every rank" in out[0][6][1][0] and "none cached" in out[1][6][1][0]  # rank 1 ignored its own
    assert out[0][2][0] == out[1][2][0]


def test_the_launchers_auto_run_keeps_one_guard_over_its_rounds_or_none():
    """`measure_generation` (what the generation launcher times): an auto run's guard lives over every round (its
    probes are counted once, not per round) and its summary is the run's; with ``guard=False`` there is none."""
    import functools

    from launch.engine import new_cache
    from launch.measure.generate import Run, measure_generation
    from launch.models import build_model, preset

    model = build_model(preset("tiny"), seed=1)
    prompts, limits = [[1, 2, 3], [4, 5, 6]], [6, 6]
    calibration = DecodeCalibration((1, 2), (3, 9), {"serial": ((1.0, 1.0), (2.0, 2.0)),
                                                    "two-batch": ((0.5, 0.5), (1.0, 1.0))})  # two-batch, every step
    runs = [Run("serial", "serial"), Run("serial", "auto")]
    make_cache = functools.partial(new_cache, model, prompts, limits)
    guarded, bare = (measure_generation(model, prompts, limits, runs, None, make_cache, warmup=1, iters=1,
                                        calibration=calibration, guard=guard)[1] for guard in (True, False))
    assert guarded.guard is not None and " serial probe step(s) of 10;" in guarded.guard, \
        guarded.guard  # 2 rounds of 5 steps, one guard
    assert guarded.row()["decode_guard"] == guarded.guard
    assert bare.guard is None and set(bare.chosen) == {"two-batch"} and bare.row()["decode_guard"] is None


def test_an_observed_decode_step_is_no_sample_of_the_tpot_nor_of_the_guard(monkeypatch):
    """A timed round records the launches of one decode step in `OBSERVE_EVERY` (its timeline); observing costs
    that step its events and clock synchronizes (on a GPU half of a small eager step), so neither the TPOT nor
    the guard counts it. A clock that ticks 1 per read and 100 more where a timeline starts stands in for that."""
    import functools

    import launch.measure.generate as generation
    from launch.engine import generate, new_cache
    from launch.measure.generate import Run, measure_generation, observes
    from launch.models import build_model, preset

    clock = [0.0]

    class Ticking:
        @staticmethod
        def perf_counter():
            clock[0] += 1.0
            return clock[0]

    class Observing:
        spans: list = []

        def start(self):
            clock[0] += 100.0
            return self

        def stop(self):
            return self

    class Counting(DecodeGuard):
        made: list = []

        def __init__(self):
            super().__init__()
            self.records = 0
            Counting.made.append(self)

        def record(self, mode, predicted, measured):
            self.records += 1
            super().record(mode, predicted, measured)

    monkeypatch.setattr(generation, "time", Ticking)
    monkeypatch.setattr(generation, "Timeline", Observing)
    monkeypatch.setattr(generation, "DecodeGuard", Counting)
    model = build_model(preset("tiny"), seed=1)
    prompts, limits = [[1, 2, 3], [4, 5, 6]], [10, 10]  # 9 decode steps a generation
    calibration = DecodeCalibration((1, 2), (3, 9), {"serial": ((1.0, 1.0), (2.0, 2.0)),
                                                    "two-batch": ((0.5, 0.5), (1.0, 1.0))})
    runs = [Run("serial", "serial"), Run("serial", "auto")]
    for mode in ("serial", "two-batch"):  # every schedule lowered ahead: a step that lowers is no guard sample
        generate(model, prompts, limits, mode=mode)
    results = measure_generation(model, prompts, limits, runs, None, functools.partial(new_cache, model, prompts, limits),
                                 warmup=0, iters=2, calibration=calibration)
    observed = len([s for s in range(9) if observes(s)])
    assert observed >= 1
    for r in results:
        assert len(r.step_s) == 2 * (9 - observed) and max(r.step_s) < 100, (r.run, r.step_s)
    assert [g.records for g in Counting.made] == [2 * (9 - observed)]


def test_a_decode_step_that_lowers_its_schedule_is_no_sample_of_the_guard():
    """The first step of a schedule lowers it (on a device, the first of a bucket captures or compiles it): it pays
    that once, so its time is no measurement and the guard does not count it; every other step it does."""
    import microbatch
    from launch.engine import generate
    from launch.models import build_model, preset

    class Counting(DecodeGuard):
        def __init__(self):
            super().__init__()
            self.records = 0

        def record(self, mode, predicted, measured):
            self.records += 1
            super().record(mode, predicted, measured)

    model = build_model(preset("tiny"), seed=1)
    # two-batch, after serial's probes
    calibration = DecodeCalibration((1, 2), (3, 9), {"serial": ((1.0, 1.0), (2.0, 2.0)),
                                                    "two-batch": ((0.5, 0.5), (1.0, 1.0))})
    lowered = [microbatch.replay_stats()["lowered"]]

    def on_step(step, active):
        lowered.append(microbatch.replay_stats()["lowered"])

    guard = Counting()
    out = generate(model, [[1, 2, 3], [4, 5, 6]], 10, mode="auto", calibration=calibration, guard=guard,
                   on_step=on_step)
    lowering = sum(b > a for a, b in zip(lowered[1:], lowered[2:]))  # decode steps that lowered a schedule
    assert set(out.modes) == {"serial", "two-batch"} and lowering >= 2  # each mode's first step at least
    assert guard.records == out.steps - lowering


def test_a_calibration_of_mc2_decode_steps_is_cached_apart_from_the_capacity_exchanges():
    from launch.engine import decode_calibration_key
    from launch.models import build_model, preset
    from launch.engine import make_expert_parallel

    keys = {}
    for exchange in ("capacity", "mc2", "auto"):
        model = make_expert_parallel(build_model(preset("tiny"), seed=0), None, decode_exchange=exchange)
        keys[exchange] = decode_calibration_key(model, None, (1, 2), (8, 24), ("serial", "shared"), 4, 4)
    assert "exchange" not in keys["capacity"]  # the keys of calibrations cached before stay valid
    assert keys["mc2"]["exchange"] == ["mc2"] and keys["auto"]["exchange"] == ["auto"]
    with pytest.raises(ValueError, match="decode_exchange must be one of"):
        make_expert_parallel(build_model(preset("tiny"), seed=0), None, decode_exchange="nccl")
