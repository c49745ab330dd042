"""Every side stream of a decode step ends joined to the caller's stream, in every decode mode.

A device graph (``torch.cuda.CUDAGraph``, `launch.engine.graph_decoder`) is captured on the caller's stream: work
forked to another stream that the caller has not waited for by the end of the capture fails it ("unjoined"). The executor
places its waits from the data flow; this checks, on the lowerings the CPU path keeps, that they also join every
stream, directly or through another stream's wait, before the step returns (the same lowering on every eager path).
"""
from __future__ import annotations

import dataclasses
from typing import Dict

import pytest

from overlap.multirank import run_ranks
from overlap.observability.sanitizer import _StreamClocks

pytestmark = pytest.mark.spawns_ranks


def unjoined(lowering) -> Dict[str, int]:
    """The streams whose last launch the caller has not waited for by the end, with that launch's number on its
    stream (the sanitizer's vector clocks, `overlap.observability.sanitizer._StreamClocks`, over the lowering)."""
    clocks = _StreamClocks()
    if lowering.input_event:
        clocks.record(lowering.input_event, lowering.caller)
    last: Dict[str, int] = {}
    for step in lowering.steps:
        stream = step.scheduled.stream
        for tag in step.waits:
            clocks.wait(tag, stream)
        last[stream] = clocks.tick(stream)
        if step.record:
            clocks.record(step.record, stream)
    for tag in lowering.final_waits:
        clocks.wait(tag, lowering.caller)
    end = clocks.clock(lowering.caller)
    return {s: n for s, n in last.items() if s != lowering.caller and end.get(s, 0) < n}


def _lowerings_body(ctx):
    from launch.engine import generate
    from launch.models import build_model, preset
    from launch.engine import make_expert_parallel
    from microbatch import DECODE_MODES, replay

    model = make_expert_parallel(build_model(preset("tiny"), seed=0), ctx.group)
    out = {}
    for mode in DECODE_MODES:
        for graph in (None, "cpu"):  # eager steps, and the padded static step a device graph captures
            replay.forget()
            generate(model, [[1, 2, 3], [4, 5], [6, 7, 8, 9]][:2 + ctx.rank], 3, mode=mode, graph=graph)
            out[mode, graph] = [p.lowering for p in replay.kept()]
    return out


@pytest.fixture(scope="module")
def lowerings():
    return run_ranks(_lowerings_body, 2, timeout=300)


def test_every_side_stream_is_joined_to_the_caller_by_the_end_of_a_decode_step(lowerings):
    for out in lowerings:
        sides = set()
        for (mode, graph), kept in out.items():
            assert kept, (mode, graph)
            for lowering in kept:
                assert unjoined(lowering) == {}, (mode, graph, lowering.format())
                sides |= {s.scheduled.stream for s in lowering.steps} - {lowering.caller}
        assert {"ep_comm", "shared_expert"} <= sides  # the overlapped modes did fork work


def test_the_check_finds_a_stream_left_forked(lowerings):
    cuts = 0
    for (mode, graph), kept in lowerings[0].items():
        for lowering in kept:
            forked = [s for s in lowering.steps if s.scheduled.stream != lowering.caller]
            if forked:  # cut the step right after its first launch on another stream: that stream's first
                cut = dataclasses.replace(lowering, steps=lowering.steps[:lowering.steps.index(forked[0]) + 1])
                assert unjoined(cut) == {forked[0].scheduled.stream: 1}, (mode, graph)
                cuts += 1
    assert cuts >= 2 * 7  # every overlapped mode, eager and padded
