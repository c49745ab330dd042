"""A lowered schedule compiled to the one form that runs, and the one function that runs it.

`Program` compiles a `Lowering` (`microbatch.lowering.lower`, the one place that derives edges):

- values live in slots (a list), numbered at compile time: no keys are built or hashed while
  running, and nothing is validated again;
- events are resolved once (`overlap.event` objects);
- on an eager path a run of launches on one stream enters its stream once; for a graph compiler
  (``ge``, ``aclgraph``, or any path while Dynamo traces) every launch enters its stream, one
  stream scope per launch in the graph.

`interpret` runs a program with one call's operation functions and inputs; every run of a schedule
goes through it (`microbatch.run` with a kept program or a fresh one, `execute`, `Lowered.run`).
A launch is its waits, its ``record_stream`` calls, its operation, its record and the values it
frees. While someone observes (a `Timeline`, the sanitizer) each launch is a span too, its meta naming
the operation and the values it reads and writes (``op``, ``reads``, ``writes``: the data flow
``overlap-report --points`` reads; the events report their records and waits themselves); while a profiler records (`overlap.hooks.profiling`) each
launch is a ``record_function`` range named ``overlap:mb1.L3.experts@default`` (`overlap.hooks.launch_name`;
not while Dynamo traces, which drops such ranges); while neither, nothing else is built. Outside a
trace the path (the one lowered for) and the switch are pinned for the run, so that the primitives
inside, the operations' own included, read neither the environment nor the detection.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

import overlap
from overlap import EP_COMM, backends, hooks, tensors_in
from overlap.backends import Backend
from overlap.context import pin, swap_stream_tag
from overlap.events import Event

from .lowering import Lowering
from .operations import split_outputs
from .schedules import Flow, Key

Positions = Mapping[Tuple[int, str], int]  # (layer, operation name) -> its function's place in interpret's fns


class _Launch:
    """One launch compiled to slots."""

    __slots__ = ("op", "fn", "mb", "layer", "stream", "enters", "kind", "waits", "record", "crossing", "args", "reads",
                 "after", "writes", "names", "frees", "flow")

    def __init__(self, op: str, fn: int, mb: int, layer: int, stream: str, kind: str, waits: Tuple[Event, ...],
                 record: Optional[Event], crossing: Tuple[int, ...], reads: Tuple[Tuple[Any, ...], ...],
                 after: Tuple[int, ...], writes: Tuple[int, ...], names: Tuple[str, ...], frees: Tuple[int, ...]):
        self.op, self.fn, self.mb, self.layer, self.stream, self.kind = op, fn, mb, layer, stream, kind
        self.enters = True  # whether it enters its stream (else the launch before it entered it; see Program)
        self.waits, self.record, self.crossing = waits, record, crossing
        plain = not after and all(not packed and src is None and len(slots) == 1 for slots, packed, src in reads)
        self.args = tuple(slots[0] for slots, _, _ in reads) if plain else None  # each read one plain value
        self.reads = reads  # else: per read (slots, packed, (mb, name) of a FromMicroBatch with a fn, or None)
        self.after = after  # and the slots of the ordering intents' values (wait_tensor, ge)
        self.writes, self.names, self.frees = writes, names, frees  # names: for the error of a wrong return
        self.flow: Dict[str, str] = {}  # the span's data flow: the names of the values it reads and writes


class Program:
    """A `Lowering` compiled for `interpret` (see the module docstring)."""

    def __init__(self, lowering: Lowering, flow: Flow, positions: Optional[Positions] = None):
        """``positions``: where each (layer, operation)'s function is in the list `interpret` gets (default: the
        order the launches first meet them, the order of `functions`)."""
        self.lowering = lowering
        self.path, self.caller = lowering.path, lowering.caller
        self.backend: Backend = backends.get(lowering.path)
        self.record_streams = _records_streams(self.backend)
        if positions is None:
            positions = {}
            for step in lowering.steps:
                positions.setdefault((step.scheduled.layer, step.scheduled.op), len(positions))
        self.positions = positions
        slots: Dict[Key, int] = {}

        def slot(key: Key) -> int:
            return slots.setdefault(key, len(slots))

        launches = []
        for step in lowering.steps:
            l, op = step.scheduled, flow.ops[step.index]
            reads = tuple((tuple(slot(k) for k in r.keys), r.packed,
                           (l.mb, r.name) if r.fn is not None else None) for r in flow.reads[step.index])
            after = tuple(slot((lowering.steps[b].scheduled.mb, lowering.steps[b].scheduled.layer, w))
                          for b in step.after for w in flow.ops[b].writes)
            launches.append(_Launch(
                op=l.op, fn=positions[l.layer, l.op], mb=l.mb, layer=l.layer, stream=l.stream,
                kind="issue" if op.stream == EP_COMM else "compute",
                waits=tuple(overlap.event(t) for t in step.waits),
                record=overlap.event(step.record) if step.record else None,
                crossing=tuple(slot(k) for k in step.crossing), reads=reads, after=after,
                writes=tuple(slot((l.mb, l.layer, w)) for w in op.writes), names=op.writes,
                frees=tuple(slot(k) for k in step.frees)))
            launches[-1].flow = {"op": l.op, "reads": ",".join(op.reads), "writes": ",".join(op.writes)}
        if not (self.backend.is_graph or torch.compiler.is_compiling()):  # a run on one stream enters it once
            for before, launch in zip(launches, launches[1:]):
                launch.enters = launch.stream != before.stream
        self.launches = tuple(launches)
        self.outputs = tuple(slot(k) for k in flow.outputs)
        self.inputs = tuple((s, k[1], k[2]) for k, s in slots.items() if k[0] == "in")
        self.n_slots = len(slots)
        self.input_event = overlap.event(lowering.input_event) if lowering.input_event else None
        self.final_waits = tuple(overlap.event(t) for t in lowering.final_waits)

    def functions(self, flow: Flow) -> List[Callable[..., Any]]:
        """The functions of ``flow``'s operations (the flow it was compiled from, or one of the same
        schedule and layers) at this program's positions."""
        fns: List[Callable[..., Any]] = [None] * len(self.positions)  # type: ignore[list-item]
        for i, launch in enumerate(self.launches):
            fns[launch.fn] = flow.ops[i].fn
        return fns


def _records_streams(backend: Backend) -> bool:
    """Whether ``backend``'s ``record_stream`` does anything (not on cpu or ge): where it does not, a run visits
    no tensor for it."""
    return type(backend).record_stream is not Backend.record_stream


def interpret(program: Program, fns: Sequence[Callable[..., Any]], inputs: Sequence[Mapping[str, Any]]) -> List[Any]:
    """Run ``program``: ``fns`` are its operations' functions (at its positions), ``inputs`` each micro-batch's
    initial values, of the names and links it was lowered for; returns each micro-batch's output. Each launch is
    a span while someone observes; nobody observing, it is its waits, its operation and its record."""
    slots: List[Any] = [None] * program.n_slots
    for s, mb, name in program.inputs:
        slots[s] = inputs[mb][name]
    backend, caller = program.backend, program.caller
    enabled = overlap.is_enabled()
    observed = hooks.active()
    compiling = torch.compiler.is_dynamo_compiling()
    profiled = not compiling and hooks.profiling()
    seen = observed or profiled
    record_streams = enabled and program.record_streams
    pinned = None if compiling else pin(program.path, enabled)
    scope: Any = None  # the stream scope entered
    try:
        if enabled and program.input_event is not None:
            program.input_event.record()
        for launch in program.launches:
            if enabled and launch.enters:
                if scope is not None:
                    scope, left = None, scope
                    left.__exit__(None, None, None)
                swap_stream_tag(launch.stream)
                scope = backend.stream_scope(launch.stream, 0, caller)
                if scope is not None:
                    scope.__enter__()
            for ev in launch.waits:
                ev.wait()
            if record_streams:
                for s in launch.crossing:
                    for t in tensors_in(slots[s]):
                        backend.record_stream(t, launch.stream)
            if launch.args is not None:
                args = [slots[s] for s in launch.args]
            else:
                args = [_read(r, slots, inputs) for r in launch.reads]
                if launch.after:
                    args = _wait_tensors(args, [t for s in launch.after for t in tensors_in(slots[s])])
            fn = fns[launch.fn]
            if not seen:
                out = fn(*args)
            elif not profiled:
                with overlap.span(launch.op, kind=launch.kind, mb=launch.mb, layer=launch.layer, **launch.flow):
                    out = fn(*args)
            else:
                with _profiled(launch, observed):
                    out = fn(*args)
            writes = launch.writes
            if len(writes) == 1:
                slots[writes[0]] = out
            elif writes:
                for s, v in zip(writes, split_outputs(launch.op, launch.names, out)):
                    slots[s] = v
            if launch.record is not None:
                launch.record.record()
            for s in launch.frees:
                slots[s] = None
        if scope is not None:
            scope, left = None, scope
            left.__exit__(None, None, None)
        if enabled:
            swap_stream_tag(caller)
        for ev in program.final_waits:
            ev.wait()
    except BaseException:  # an operation (or a wait) raised: leave its stream for the caller's
        if scope is not None:
            scope.__exit__(None, None, None)
        if enabled:
            swap_stream_tag(caller)
        raise
    finally:
        if pinned is not None:
            pinned.restore()
    return [slots[s] for s in program.outputs]


@contextlib.contextmanager
def _profiled(launch: _Launch, observed: bool) -> Iterator[None]:
    """The launch's profiler range, holding its span when ``observed``."""
    with hooks.profiler_range(hooks.launch_name(launch.op, launch.mb, launch.layer, launch.stream, launch.kind)):
        if not observed:
            yield
            return
        with overlap.span(launch.op, kind=launch.kind, mb=launch.mb, layer=launch.layer, **launch.flow):
            yield


def _read(read: Tuple[Any, ...], slots: List[Any], inputs: Sequence[Mapping[str, Any]]) -> Any:
    keys, packed, src = read
    if src is not None:
        return inputs[src[0]][src[1]].fn(*[slots[s] for s in keys])
    return tuple(slots[s] for s in keys) if packed else slots[keys[0]]


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


__all__ = ["Positions", "Program", "interpret"]
