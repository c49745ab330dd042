"""The executor: lowers a schedule onto the current execution path and runs it.

This is the one place that derives cross-stream edges, and they come from the data flow, never
from the schedule's author: where a value written on one stream is read on another, the
writer's stream records the writer's event and the reader's stream waits for it before the read
(where the graph compiler orders data edges itself, ``ge``, nothing is added), and every tensor
of the value is `record_stream` ed for the reader's stream. A forgotten wait is therefore
impossible here. Ordering intents without data (``Schedule.orders``) become ``wait_tensor`` on
every tensor argument of the later launch where data edges order (``ge``), and events across
streams elsewhere. Events are named per (micro-batch, operation, stream) and reused by every layer.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

import overlap
from overlap import EP_COMM, backends, tensors_in

from . import replay
from .operations import State, split_outputs
from .schedules import OUT, Flow, Key, Layers, Schedule, ScheduledOp, ScheduleError, normalize_layers, validate


@dataclasses.dataclass(frozen=True)
class Step:
    """One launch as lowered: the events its stream waits for first, the one it records after."""

    index: int
    scheduled: ScheduledOp
    waits: Tuple[str, ...] = ()
    record: Optional[str] = None
    crossing: Tuple[Key, ...] = ()  # values read from another stream (record_stream for this one)
    after: Tuple[int, ...] = ()  # ordering intents lowered to wait_tensor (ge)
    frees: Tuple[Key, ...] = ()  # values no later launch reads


@dataclasses.dataclass(frozen=True)
class Lowering:
    """A schedule lowered for one path: steps in order, the input event and the final waits."""

    path: str
    caller: str  # stream the executor was called on; inputs come from it and outputs return to it
    steps: Tuple[Step, ...]
    input_event: Optional[str] = None
    final_waits: Tuple[str, ...] = ()

    def events(self) -> List[str]:
        """Tags of every event the lowering records, each once."""
        tags = [s.record for s in self.steps if s.record] + ([self.input_event] if self.input_event else [])
        return sorted(set(tags))

    def format(self) -> str:
        lines = [f"lowered on {self.path} (caller stream {self.caller})"]
        if self.input_event:
            lines.append(f"      record {self.input_event}")
        for s in self.steps:
            lines += [f"      wait {t} on {s.scheduled.stream}" for t in s.waits]
            after = f"  wait_tensor after #{', #'.join(map(str, s.after))}" if s.after else ""
            lines.append(f"{s.index:4d}  {s.scheduled}{after}")
            if s.record:
                lines.append(f"      record {s.record}")
        lines += [f"      wait {t} on {self.caller}" for t in self.final_waits]
        return "\n".join(lines)


def event_tag(op: ScheduledOp) -> str:
    """The event recorded after ``op``: one per (micro-batch, operation, stream), shared by all layers."""
    return f"mb{op.mb}.{op.op}@{op.stream}"


class _Edges:
    """Cross-stream waits, skipping those an earlier wait on the same stream pair already covers."""

    def __init__(self, launches: Sequence[ScheduledOp], caller: str, input_tag: str):
        self.launches, self.caller, self.input_tag = launches, caller, input_tag
        self.covered: Dict[Tuple[str, str], int] = {}  # (consumer, producer stream) -> latest waited writer
        self.recorded: set = set()
        self.input_used = False

    def stream_of(self, writer: Optional[int]) -> str:
        return self.caller if writer is None else self.launches[writer].stream

    def need(self, writer: Optional[int], consumer: str) -> Optional[str]:
        """The event ``consumer`` must wait for to see ``writer``'s work (None if ordered already)."""
        producer = self.stream_of(writer)
        if producer == consumer:
            return None
        pos = -1 if writer is None else writer
        if self.covered.get((consumer, producer), -2) >= pos:
            return None
        self.covered[(consumer, producer)] = pos
        if writer is None:
            self.input_used = True
            return self.input_tag
        self.recorded.add(writer)
        return event_tag(self.launches[writer])


def lower(schedule: Schedule, layers: Layers, inputs: Sequence[Mapping[str, Any]],
          path: Optional[str] = None, caller: Optional[str] = None, output: str = OUT) -> Tuple[Lowering, Flow]:
    """Check ``schedule`` against ``layers`` and ``inputs`` and lower it for ``path`` (default: current)."""
    flow = validate(schedule, layers, inputs, output)
    path = path or overlap.current_path()
    caller = caller or overlap.current_stream_tag()
    launches = schedule.launches
    graph = backends.get(path).data_edges_order_streams  # then ordering intents need wait_tensor
    edges = _Edges(launches, caller, f"inputs@{caller}")
    intents: Dict[int, List[int]] = defaultdict(list)
    for b, a in schedule.orders:
        intents[a].append(b)
    last_use = dict(flow.last_read)
    if graph:
        for b, a in schedule.orders:
            for w in flow.ops[b].writes:
                key = (launches[b].mb, launches[b].layer, w)
                last_use[key] = max(last_use.get(key, -1), a)
    frees: Dict[int, List[Key]] = defaultdict(list)
    outputs = set(flow.outputs)
    for key, i in flow.writer.items():
        if key not in outputs:
            frees[max(i, last_use.get(key, i))].append(key)

    partial = []
    for i, l in enumerate(launches):
        waits: List[str] = []
        crossing: List[Key] = []
        for r in flow.reads[i]:
            for key in r.keys:
                writer = flow.writer.get(key)
                if edges.stream_of(writer) != l.stream and key not in crossing:
                    crossing.append(key)
                if not graph:
                    tag = edges.need(writer, l.stream)
                    if tag and tag not in waits:
                        waits.append(tag)
        after: List[int] = []
        for b in intents.get(i, ()):
            if graph:
                after.append(b)
            else:
                tag = edges.need(b, l.stream)
                if tag and tag not in waits:
                    waits.append(tag)
        partial.append((i, l, tuple(waits), tuple(crossing), tuple(after), tuple(frees.get(i, ()))))
    final_waits = []
    if not graph:
        for key in flow.outputs:
            tag = edges.need(flow.writer.get(key), caller) if key[0] != "in" else None
            if tag and tag not in final_waits:
                final_waits.append(tag)
    steps = tuple(Step(i, l, w, event_tag(l) if i in edges.recorded else None, c, a, f)
                  for i, l, w, c, a, f in partial)
    lowering = Lowering(path, caller, steps, edges.input_tag if edges.input_used else None, tuple(final_waits))
    return lowering, flow


@dataclasses.dataclass(frozen=True)
class Lowered:
    """A schedule checked and lowered before a trace (`lower_ahead`); `run` executes it on each call's values.

    A compiler (``torch.compile``) traces whatever Python runs inside the compiled function: with `run`
    there, that is the schedule's generator, its check and its lowering too, work whose result depends
    on the schedule alone and which took about half of a capture's tracing time. Lowered ahead, the
    trace holds the launches only.
    """

    lowering: Lowering
    flow: Flow
    structure: Tuple[Any, ...]  # per micro-batch, the inputs' names and links it was lowered for

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> List[Any]:
        """`run`'s result for ``inputs``, which must have the names and links the schedule was lowered for,
        on the path and caller stream it was lowered for (else `ScheduleError`, before any launch)."""
        where = (overlap.current_path(), overlap.current_stream_tag())
        if where != (self.lowering.path, self.lowering.caller):
            raise ScheduleError(f"a schedule lowered for path {self.lowering.path!r} on stream "
                                f"{self.lowering.caller!r} runs on path {where[0]!r} on stream {where[1]!r}")
        if replay.input_structure(inputs) != self.structure:
            raise ScheduleError(f"a schedule lowered for the inputs {_names(self.structure)} got "
                                f"{_names(replay.input_structure(inputs))} (names per micro-batch)")
        return execute(self.lowering, self.flow, inputs)


def lower_ahead(make: Callable[[Layers, int], Schedule], layers: Layers, inputs: Sequence[Mapping[str, Any]],
                path: str, output: str = OUT) -> Lowered:
    """``make(layers, len(inputs))`` checked and lowered for ``path`` on the current stream, outside any trace:
    a compiled function then calls `Lowered.run` instead of `run_made`. ``inputs``: one mapping per micro-batch
    with the names (and `microbatch.FromMicroBatch` links) its calls will pass; other values are not read."""
    with overlap.use_path(path):
        lowering, flow = lower(make(layers, len(inputs)), normalize_layers(layers), inputs, output=output)
    return Lowered(lowering, flow, replay.input_structure(inputs))


def _names(structure: Tuple[Any, ...]) -> str:
    return ", ".join("[" + ", ".join(name for name, _ in mb) + "]" for mb in structure)


def run(schedule: Schedule, layers: Layers, inputs: Sequence[Mapping[str, Any]], output: str = OUT) -> List[Any]:
    """Run ``schedule`` over ``layers`` for micro-batches starting from ``inputs``; their outputs in order.

    ``layers[L]`` is layer L's operation list (shared by all micro-batches); ``inputs[mb]`` holds
    micro-batch ``mb``'s ``"hidden"`` and its context values (`FromMicroBatch` for another
    micro-batch's values). Each micro-batch's result is the last layer's ``output`` value. The
    schedule is checked completely before the first launch, so a bad schedule fails with
    `ScheduleError` on every rank before any collective is issued.

    On the eager paths the check and the lowering are done once per schedule, layer signature,
    inputs' structure, path and caller stream, and replayed by later calls (`microbatch.replay`).
    """
    if not replay.replays():
        return _lower_and_execute(schedule, layers, inputs, output)
    fns, sig = replay.layer_signature(layers)
    return _replay(schedule, layers, fns, sig, inputs, output)


def run_made(make: Callable[[Layers, int], Schedule], layers: Layers, inputs: Sequence[Mapping[str, Any]],
             output: str = OUT) -> List[Any]:
    """`run` of the schedule ``make(layers, len(inputs))``. Where the path replays, that schedule is kept per
    generator, micro-batch count and layer signature (`replay.schedule_of`), and the signature is computed
    once for both: `run_schedule`'s call on every prefill or decode step."""
    if not replay.replays():
        return _lower_and_execute(make(layers, len(inputs)), layers, inputs, output)
    fns, sig = replay.layer_signature(layers)
    schedule = replay.schedule_of(make, layers, len(inputs), sig)
    return _replay(schedule, layers, fns, sig, inputs, output)


def _lower_and_execute(schedule: Schedule, layers: Layers, inputs: Sequence[Mapping[str, Any]],
                       output: str) -> List[Any]:
    lowering, flow = lower(schedule, normalize_layers(layers), inputs, output=output)
    return execute(lowering, flow, inputs)


def _replay(schedule: Schedule, layers: Layers, fns: List[Callable[..., Any]], sig: Tuple[Any, ...],
            inputs: Sequence[Mapping[str, Any]], output: str) -> List[Any]:
    program = replay.program_for(schedule, sig, inputs, output,
                                 lambda: lower(schedule, normalize_layers(layers), inputs, output=output))
    return program.replay(fns, inputs)


def execute(lowering: Lowering, flow: Flow, inputs: Sequence[Mapping[str, Any]]) -> List[Any]:
    """Run a `Lowering` (see `lower`); returns each micro-batch's final value."""
    states: Dict[Tuple[int, int], State] = defaultdict(State)
    record_streams = replay.records_streams(backends.get(lowering.path))

    def get(key: Key) -> Any:
        return inputs[key[1]][key[2]] if key[0] == "in" else states[key[0], key[1]][key[2]]

    if lowering.input_event:
        overlap.event(lowering.input_event).record()
    for step in lowering.steps:
        l, op = step.scheduled, flow.ops[step.index]
        with overlap.stream(l.stream):
            for tag in step.waits:
                overlap.event(tag).wait()
            for key in step.crossing if record_streams else ():
                for t in tensors_in(get(key)):
                    overlap.record_stream(t, l.stream)
            args = [_read(r, get) for r in flow.reads[step.index]]
            if step.after:
                deps = [t for b in step.after for w in flow.ops[b].writes
                        for t in tensors_in(get((lowering.steps[b].scheduled.mb, lowering.steps[b].scheduled.layer, w)))]
                args = _wait_tensors(args, deps)
            kind = "issue" if op.stream == EP_COMM else "compute"
            with overlap.span(l.op, kind=kind, mb=l.mb, layer=l.layer):
                out = op.fn(*args)
            values = split_outputs(op.name, op.writes, out)
            state = states[l.mb, l.layer]
            for name, v in zip(op.writes, values):
                state[name] = v
            if step.record:
                overlap.event(step.record).record(*tensors_in(values))
        for key in step.frees:
            states[key[0], key[1]].pop(key[2], None)
    for tag in lowering.final_waits:
        overlap.event(tag).wait()
    return [get(key) for key in flow.outputs]


def _read(r: Any, get: Any) -> Any:
    if r.fn is not None:
        return r.fn(*[get(k) for k in r.keys])
    return tuple(get(k) for k in r.keys) if r.packed else get(r.keys[0])


def _wait_tensors(args: List[Any], deps: Sequence[torch.Tensor]) -> List[Any]:
    """Put ``wait_tensor(x, *deps)`` in place of every tensor ``x`` among the arguments (in tuples,
    lists and dicts too).

    Every tensor, not only the first: an operation may start from several inputs (a dispatch sends
    the tokens and, apart, the routing metadata), and GE orders only what depends on a waited tensor.
    """
    if not deps:
        return args

    def visit(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return overlap.wait_tensor(v, *deps)
        if isinstance(v, tuple):
            items = [visit(x) for x in v]
            return type(v)(*items) if hasattr(v, "_fields") else tuple(items)
        if isinstance(v, list):
            return [visit(x) for x in v]
        if isinstance(v, dict):
            return {k: visit(x) for k, x in v.items()}
        return v

    return [visit(a) for a in args]


__all__ = ["Lowered", "Lowering", "Step", "event_tag", "execute", "lower", "lower_ahead", "run", "run_made"]
