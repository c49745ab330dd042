"""The executor: runs a schedule over layers of operations, on the current execution path.

`run` (and `run_made`, for a schedule generator) checks a schedule and lowers it
(`microbatch.lowering`: every cross-stream edge, from the data flow), compiles the lowering into a
program (`microbatch.program`) and runs it with `microbatch.program.interpret`, the one function
that runs a schedule. On the eager paths the program is kept and replayed by later calls
(`microbatch.replay`); the graph paths and tracing compile it every call. `lower_ahead` does the
check, the lowering and the compiling before a trace, and `Lowered.run` interprets inside it;
`execute` runs a lowering once.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Mapping, Sequence, Tuple

import overlap

from . import replay
from .lowering import Lowering, lower
from .program import Program, interpret
from .schedules import OUT, Flow, Layers, Schedule, ScheduleError, normalize_layers


@dataclasses.dataclass(frozen=True)
class Lowered:
    """A schedule checked, lowered and compiled before a trace (`lower_ahead`); `run` interprets it on each call's
    values.

    A compiler (``torch.compile``) traces whatever Python runs inside the compiled function: with `run`
    there, that is the schedule's generator, its check, its lowering and its program too, work whose
    result depends on the schedule alone and which took about half of a capture's tracing time. Made
    ahead, the trace holds the launches only.
    """

    program: Program
    functions: Tuple[Callable[..., Any], ...]  # the operations' functions, at the program's positions
    structure: Tuple[Any, ...]  # per micro-batch, the inputs' names and links it was lowered for

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> List[Any]:
        """`run`'s result for ``inputs``, which must have the names and links the schedule was lowered for,
        on the path and caller stream it was lowered for (else `ScheduleError`, before any launch)."""
        where = (overlap.current_path(), overlap.current_stream_tag())
        if where != (self.program.path, self.program.caller):
            raise ScheduleError(f"a schedule lowered for path {self.program.path!r} on stream "
                                f"{self.program.caller!r} runs on path {where[0]!r} on stream {where[1]!r}")
        if replay.input_structure(inputs) != self.structure:
            raise ScheduleError(f"a schedule lowered for the inputs {_names(self.structure)} got "
                                f"{_names(replay.input_structure(inputs))} (names per micro-batch)")
        return interpret(self.program, self.functions, inputs)


def lower_ahead(make: Callable[[Layers, int], Schedule], layers: Layers, inputs: Sequence[Mapping[str, Any]],
                path: str, output: str = OUT) -> Lowered:
    """``make(layers, len(inputs))`` checked, lowered and compiled for ``path`` on the current stream, outside any
    trace: a compiled function then calls `Lowered.run` instead of `run_made`. ``inputs``: one mapping per
    micro-batch with the names (and `microbatch.FromMicroBatch` links) its calls will pass; other values are not
    read."""
    with overlap.use_path(path):
        lowering, flow = lower(make(layers, len(inputs)), normalize_layers(layers), inputs, output=output)
        program = Program(lowering, flow)
    return Lowered(program, tuple(program.functions(flow)), replay.input_structure(inputs))


def _names(structure: Tuple[Any, ...]) -> str:
    return ", ".join("[" + ", ".join(name for name, _ in mb) + "]" for mb in structure)


def run(schedule: Schedule, layers: Layers, inputs: Sequence[Mapping[str, Any]], output: str = OUT) -> List[Any]:
    """Run ``schedule`` over ``layers`` for micro-batches starting from ``inputs``; their outputs in order.

    ``layers[L]`` is layer L's operation list (shared by all micro-batches); ``inputs[mb]`` holds
    micro-batch ``mb``'s ``"hidden"`` and its context values (`FromMicroBatch` for another
    micro-batch's values). Each micro-batch's result is the last layer's ``output`` value. The
    schedule is checked completely before the first launch, so a bad schedule fails with
    `ScheduleError` on every rank before any collective is issued.

    On the eager paths the check, the lowering and its program are made once per schedule, layer
    signature, inputs' structure, path and caller stream, and replayed by later calls (`microbatch.replay`).
    """
    if not replay.keeps_programs():
        return _compile_and_interpret(schedule, layers, inputs, output)
    fns, sig = replay.layer_signature(layers)
    return _replay(schedule, layers, fns, sig, inputs, output)


def run_made(make: Callable[[Layers, int], Schedule], layers: Layers, inputs: Sequence[Mapping[str, Any]],
             output: str = OUT) -> List[Any]:
    """`run` of the schedule ``make(layers, len(inputs))``. Where the path keeps programs, that schedule is kept
    per generator, micro-batch count and layer signature (`replay.schedule_of`), and the signature is computed
    once for both: `run_schedule`'s call on every prefill or decode step."""
    if not replay.keeps_programs():
        return _compile_and_interpret(make(layers, len(inputs)), layers, inputs, output)
    fns, sig = replay.layer_signature(layers)
    schedule = replay.schedule_of(make, layers, len(inputs), sig)
    return _replay(schedule, layers, fns, sig, inputs, output)


def _compile_and_interpret(schedule: Schedule, layers: Layers, inputs: Sequence[Mapping[str, Any]],
                           output: str) -> List[Any]:
    lowering, flow = lower(schedule, normalize_layers(layers), inputs, output=output)
    return execute(lowering, flow, inputs)


def _replay(schedule: Schedule, layers: Layers, fns: List[Callable[..., Any]], sig: Tuple[Any, ...],
            inputs: Sequence[Mapping[str, Any]], output: str) -> List[Any]:
    program = replay.program_for(schedule, sig, inputs, output,
                                 lambda: lower(schedule, normalize_layers(layers), inputs, output=output))
    return interpret(program, fns, inputs)


def execute(lowering: Lowering, flow: Flow, inputs: Sequence[Mapping[str, Any]]) -> List[Any]:
    """Run a `Lowering` (see `lower`) once, compiled for this call; returns each micro-batch's final value."""
    program = Program(lowering, flow)
    return interpret(program, program.functions(flow), inputs)


__all__ = ["Lowered", "execute", "lower_ahead", "run", "run_made"]
