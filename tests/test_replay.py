"""Lower once, replay (`microbatch.replay`): a kept program is replayed with new values and this call's
functions, anything that changes the lowering lowers anew, the programs are microbatch's and go with
`overlap.reset`, and nothing is observed unless someone observes."""
import re

import pytest
import torch

import microbatch
import overlap
from microbatch import FromMicroBatch, Operation, ScheduleError, execute, lower, normalize_layers, run
from microbatch import replay as replay_mod
from microbatch.schedules import serial, shared, two_batch
from overlap import EP_COMM, SHARED_EXPERT, Timeline


def _layers(n_layers=3, scale=1.0, read="g"):
    def layer(li):
        return [Operation("attn", lambda h, li=li: h * scale + li, ("hidden",), ("a",)),
                Operation("gate", lambda a: a + 1, ("a",), ("g",)),
                Operation("dispatch", lambda g: g * 2, (read,), ("d",), EP_COMM),
                Operation("shared", lambda a: a - 1, ("a",), ("s",), SHARED_EXPERT),
                Operation("experts", lambda d: d + 3, ("d",), ("e",)),
                Operation("combine", lambda e: e / 2, ("e",), ("c",), EP_COMM),
                Operation("out", lambda c, s: c + s, ("c", "s"), ("out",))]
    return [layer(li) for li in range(n_layers)]


def _inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"hidden": torch.randn(4, 8, generator=g)} for _ in range(n)]


def _fresh(schedule, layers, inputs):
    """The result without any kept lowering: checked and lowered now."""
    lowering, flow = lower(schedule, normalize_layers(layers), inputs)
    return execute(lowering, flow, inputs)


def _lowered():
    return replay_mod.replay_stats()["lowered"]


@pytest.mark.parametrize("make, n", [(serial, 1), (shared, 1), (two_batch, 2)])
def test_a_second_run_replays_with_new_values_and_equals_a_fresh_lowering(make, n):
    layers = _layers()
    schedule = make(layers, n)
    run(schedule, layers, _inputs(n, 0))
    before = _lowered()
    for seed in (1, 2):
        out = run(schedule, layers, _inputs(n, seed))
        ref = _fresh(schedule, layers, _inputs(n, seed))
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert _lowered() == before  # replayed, not lowered again


def test_rebuilt_operations_with_the_same_signature_replay_with_this_calls_functions():
    schedule = two_batch(_layers(), 2)
    run(schedule, _layers(scale=1.0), _inputs(2))
    before = _lowered()
    out = run(schedule, _layers(scale=3.0), _inputs(2))  # new functions, same names, reads and writes
    assert _lowered() == before
    ref = _fresh(schedule, _layers(scale=3.0), _inputs(2))
    stale = _fresh(schedule, _layers(scale=1.0), _inputs(2))
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert not any(torch.equal(a, b) for a, b in zip(out, stale))


def test_another_layer_signature_lowers_anew_and_is_checked_again():
    layers = _layers()
    schedule = two_batch(layers, 2)
    run(schedule, layers, _inputs(2))
    before = _lowered()
    with pytest.raises(ScheduleError, match="reads 'nothing'"):
        run(schedule, _layers(read="nothing"), _inputs(2))  # the same schedule, a read nobody writes
    renamed = [[Operation(o.name, o.fn, o.reads, o.writes, _on_main(o)) for o in layer] for layer in layers]
    run(schedule, renamed, _inputs(2))  # another stream for the exchanges: lowered anew
    assert _lowered() == before + 1


def _on_main(op):
    """The operation's stream, with the exchanges moved to the main stream."""
    return overlap.DEFAULT if op.stream == EP_COMM else op.stream


def test_another_count_of_micro_batches_caller_stream_or_inputs_lowers_anew():
    layers = _layers()
    run(two_batch(layers, 2), layers, _inputs(2))
    before = _lowered()
    run(two_batch(layers, 3), layers, _inputs(3))
    assert _lowered() == before + 1
    with overlap.stream("other"):
        out = run(two_batch(layers, 2), layers, _inputs(2))
    overlap.synchronize()
    assert _lowered() == before + 2
    assert all(torch.equal(a, b) for a, b in zip(out, _fresh(two_batch(layers, 2), layers, _inputs(2))))
    linked = _inputs(2)
    linked[1]["extra"] = FromMicroBatch(0, "a")
    run(two_batch(layers, 2), layers, linked)
    assert _lowered() == before + 3


def test_reset_forgets_the_kept_lowerings_and_the_cache_is_bounded(monkeypatch):
    layers = _layers(1)
    run(serial(layers, 1), layers, _inputs(1))
    assert replay_mod.replay_stats()["kept"] >= 1
    overlap.reset()
    assert replay_mod.replay_stats()["kept"] == 0
    monkeypatch.setattr(replay_mod, "CACHE_SIZE", 3)
    for n in range(1, 6):
        run(serial(layers, n), layers, _inputs(n))
    assert replay_mod.replay_stats()["kept"] == 3


def test_the_kept_programs_are_microbatchs_and_a_reset_drops_them(monkeypatch):
    """The cache is `microbatch.replay`'s own: overlap's process state holds no program, and `overlap.reset` drops
    the programs (which hold events it forgets) through `overlap.on_reset`, after forgetting its own state."""
    from overlap.state import STATE

    monkeypatch.setattr(STATE, "reset_callbacks", list(STATE.reset_callbacks))  # this test's callback goes with it
    layers = _layers(1)
    run(two_batch(layers, 2), layers, _inputs(2))
    kept = replay_mod.kept()
    assert kept and replay_mod.replay_stats()["kept"] == len(kept)
    assert not hasattr(STATE, "programs")
    assert replay_mod.forget in STATE.reset_callbacks
    events_then = []
    overlap.on_reset(lambda: events_then.append(dict(STATE.events)))
    overlap.on_reset(replay_mod.forget)  # registered again: still called once
    assert STATE.reset_callbacks.count(replay_mod.forget) == 1
    overlap.reset()
    assert replay_mod.kept() == [] and replay_mod.replay_stats()["kept"] == 0
    assert events_then == [{}]  # told after overlap's own state was forgotten
    run(two_batch(layers, 2), layers, _inputs(2))  # lowered again, with the events overlap has now
    waits = [ev for p in replay_mod.kept() for launch in p.launches for ev in launch.waits]
    assert waits and all(ev is overlap.event(ev.tag) for ev in waits)


def test_a_replay_pins_the_path_and_restores_the_caller_even_when_an_operation_raises(monkeypatch):
    seen = []

    def look(h):
        seen.append((overlap.current_path(), overlap.current_stream_tag()))
        return h

    def boom(h):
        raise RuntimeError("boom")

    layers = [[Operation("look", look, ("hidden",), ("x",), EP_COMM), Operation("out", boom, ("x",), ("out",))]]
    schedule = microbatch.as_listed(layers)
    for _ in range(2):  # lowered, then replayed
        with pytest.raises(RuntimeError, match="boom"):
            run(schedule, layers, _inputs(1))
        assert overlap.current_stream_tag() == overlap.DEFAULT
        with monkeypatch.context() as env:  # nothing pinned is left: the path and the switch follow the environment
            env.setenv(overlap.ENV_PATH, "cuda")
            env.setenv(overlap.ENV_ENABLE, "0")
            assert overlap.current_path() == "cuda" and not overlap.is_enabled()
    assert seen == [("cpu", EP_COMM)] * 2


def test_without_an_observer_no_span_is_built_and_with_one_every_launch_is_seen(monkeypatch):
    layers = _layers()
    schedule = two_batch(layers, 2)
    run(schedule, layers, _inputs(2))
    built = []
    real = overlap.hooks.Span.__init__

    def counting(self, *a, **k):
        built.append(1)
        real(self, *a, **k)

    monkeypatch.setattr(overlap.hooks.Span, "__init__", counting)
    run(schedule, layers, _inputs(2))
    assert built == []
    with Timeline() as tl:
        run(schedule, layers, _inputs(2))
        overlap.synchronize()
    assert built  # observed: the launches are spans again
    names = sorted((s.meta["mb"], s.meta["layer"], s.name) for s in tl.spans)
    assert names == sorted((l.mb, l.layer, l.op) for l in schedule.launches)


def test_off_runs_the_operations_in_order_on_the_callers_stream():
    layers = _layers()
    schedule = two_batch(layers, 2)
    ref = _fresh(schedule, layers, _inputs(2))
    with overlap.enabled(False):
        for _ in range(2):
            out = run(schedule, layers, _inputs(2))
            assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert overlap.current_stream_tag() == overlap.DEFAULT


def test_run_schedule_keeps_one_schedule_per_generator_layers_and_count():
    a = replay_mod.schedule_of(two_batch, _layers(), 2)
    assert replay_mod.schedule_of(two_batch, _layers(scale=2.0), 2) is a  # the same signature
    assert replay_mod.schedule_of(two_batch, _layers(), 3) is not a
    assert replay_mod.schedule_of(two_batch, _layers(read="a"), 2) is not a
    assert replay_mod.schedule_of(shared, _layers(), 2) is not a


def test_the_executor_benchmark_runs_at_a_tiny_size_and_refuses_a_bad_option():
    from click.testing import CliRunner

    from launch.bench.executor import main

    result = CliRunner().invoke(main, ["--layers", "2", "--preset", "tiny", "--tokens", "1,8", "--rounds", "3"])
    assert result.exit_code == 0, result.output
    for words in ("synthetic: 2 layers x 6 operations", "reference decoder (tiny), 8 tokens", "two-batch",
                  "replay-loop", "outside the executor", "medians of 3 round(s)",
                  "target: a replayed launch at most 3 us above the loop in serial: ",
                  "target: a Timeline at most 10 us more per launch, every mode: "):
        assert words in result.output
    head = next(line for line in result.output.splitlines() if line.startswith("mode"))
    assert head.split()[6:] == ["spread", "replay-loop", "timeline-replay"]
    assert not re.search(r" -[0-9]+\.[0-9]+$", result.output, re.M)  # no negative difference printed as a figure
    bad = CliRunner().invoke(main, ["--ops", "5"])
    assert bad.exit_code == 2 and "--ops at least 6" in bad.output


def test_a_share_outside_the_executor_that_noise_made_negative_says_so(monkeypatch):
    """One round on a busy host can time the run alone longer than the whole prefill (CI printed -976.4%): not a
    figure."""
    from click.testing import CliRunner

    from launch.bench import executor

    monkeypatch.setattr(executor, "outside_share", lambda *a: (7.93, -9.764, None))
    result = CliRunner().invoke(executor.main, ["--layers", "2", "--preset", "tiny", "--tokens", "1", "--rounds", "1"])
    assert result.exit_code == 0, result.output
    assert "-976.4%" not in result.output
    assert "operations): none measured; target at most 5%: inconclusive (noise)" in result.output
