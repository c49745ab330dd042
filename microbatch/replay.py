"""Lower once, replay: a schedule's lowering kept and replayed with new values.

The executor (`microbatch.run`) checks a schedule and lowers it (`executor.lower`: the data
flow, every event, wait, ``record_stream`` and free) the first time it meets it for a given
layer signature, inputs' structure, execution path, caller stream and output. It compiles that
lowering into a `Program` and keeps it; later calls replay the program with their own values:

- values live in slots (a list), numbered at compile time: no keys are built or hashed while
  replaying, and nothing is validated again;
- events are resolved once (`overlap.event` objects); a run of launches on one stream enters its
  stream once;
- without an observer (a `Timeline`, the sanitizer, ...) a launch is its waits, its operation
  and its record, called on the backend directly. With one, each launch is a span and every
  record and wait is reported, as before.

What identifies a program (`_Key`): the schedule (its launches and ordering intents), each
layer's operations by name, reads, writes and stream (not their functions: a model builds its
operations anew on every call, and the functions of *this* call run), the inputs' names and
`FromMicroBatch` links (their functions are this call's too), the path, the caller's stream and
the output name. Anything else lowers anew, so a stale lowering is never replayed. Programs live
in `overlap`'s process state and go with `overlap.reset()` (with the events they hold); at most
`CACHE_SIZE` are kept, the least recently used dropped first.

Graph paths (``ge``, ``aclgraph``) and tracing (`torch.compile`) do not replay: they lower every
call, as a compiler captures the launches once anyway.
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import torch

import overlap
from overlap import EP_COMM, backends, tensors_in
from overlap.backends import Backend
from overlap.context import _enable_override, _path_override, swap_stream_tag
from overlap.events import Event
from overlap.state import STATE

from .operations import FromMicroBatch, Operation, as_operation
from .schedules import Flow, Key, Schedule

CACHE_SIZE = 64
_STATS = {"lowered": 0, "replayed": 0}


class _Launch:
    """One launch compiled to slots."""

    __slots__ = ("op", "names", "pos", "mb", "layer", "stream", "kind", "waits", "record", "crossing", "args", "reads",
                 "writes", "frees")

    def __init__(self, op: str, pos: int, mb: int, layer: int, stream: str, kind: str, waits: Tuple[Event, ...],
                 record: Optional[Event], crossing: Tuple[int, ...], args: Optional[Tuple[int, ...]],
                 reads: Tuple[Tuple[Any, ...], ...], writes: Tuple[int, ...], frees: Tuple[int, ...],
                 names: Tuple[str, ...] = ()):
        self.names = names  # the values it writes (for the error of a wrong return)
        self.op, self.pos, self.mb, self.layer, self.stream, self.kind = op, pos, mb, layer, stream, kind
        self.waits, self.record, self.crossing = waits, record, crossing
        self.args = args  # the slots of the arguments when every read is one plain value, else None
        self.reads = reads  # else: per read (slots, packed, (mb, name) of a FromMicroBatch with a fn, or None)
        self.writes, self.frees = writes, frees


class Program:
    """A `Lowering` compiled to slots, replayed by `replay` with each call's values and functions."""

    def __init__(self, lowering: Any, flow: Flow, fn_positions: Mapping[Tuple[int, str], int]):
        self.lowering = lowering
        self.backend: Backend = backends.get(lowering.path)
        slots: Dict[Key, int] = {}

        def slot(key: Key) -> int:
            return slots.setdefault(key, len(slots))

        launches = []
        for step in lowering.steps:
            l, op = step.scheduled, flow.ops[step.index]
            reads = tuple((tuple(slot(k) for k in r.keys), r.packed,
                           (l.mb, r.name) if r.fn is not None else None) for r in flow.reads[step.index])
            plain = all(not packed and src is None and len(ks) == 1 for ks, packed, src in reads)
            launches.append(_Launch(
                op=l.op, pos=fn_positions[l.layer, l.op], mb=l.mb, layer=l.layer, stream=l.stream,
                kind="issue" if op.stream == EP_COMM else "compute",
                waits=tuple(overlap.event(t) for t in step.waits),
                record=overlap.event(step.record) if step.record else None,
                crossing=tuple(slot(k) for k in step.crossing),
                args=tuple(ks[0] for ks, _, _ in reads) if plain else None, reads=reads,
                writes=tuple(slot((l.mb, l.layer, w)) for w in op.writes), names=op.writes,
                frees=tuple(slot(k) for k in step.frees)))
        self.launches = tuple(launches)
        self.outputs = tuple(slot(k) for k in flow.outputs)
        self.inputs = tuple((s, k[1], k[2]) for k, s in slots.items() if k[0] == "in")
        self.n_slots = len(slots)
        self.caller = lowering.caller
        self.input_event = overlap.event(lowering.input_event) if lowering.input_event else None
        self.final_waits = tuple(overlap.event(t) for t in lowering.final_waits)
        self.record_streams = records_streams(self.backend)

    def replay(self, fns: Sequence[Callable[..., Any]], inputs: Sequence[Mapping[str, Any]]) -> List[Any]:
        """Run the program: ``fns`` are the operations' functions in layer order, ``inputs`` each
        micro-batch's initial values (of the structure it was lowered for); each micro-batch's output."""
        _STATS["replayed"] += 1  # a statistic: an increment lost between threads is no harm
        slots: List[Any] = [None] * self.n_slots
        for s, mb, name in self.inputs:
            slots[s] = inputs[mb][name]
        backend, caller = self.backend, self.caller
        # The path and the switch are pinned for the run (the path is the one lowered for): every
        # primitive inside, the operations' own included, then reads them without the environment.
        enabled = overlap.is_enabled()
        pins = (_path_override.set(self.lowering.path), _enable_override.set(enabled))
        observed = bool(STATE.observers)
        entered: Optional[str] = None  # the stream whose scope is entered
        scope: Any = None
        try:
            if enabled and self.input_event is not None:
                self.input_event.record()
            for st in self.launches:
                if enabled and st.stream != entered:
                    if scope is not None:
                        scope.__exit__(None, None, None)
                    swap_stream_tag(st.stream)
                    scope = backend.stream_scope(st.stream, 0, caller)
                    if scope is not None:
                        scope.__enter__()
                    entered = st.stream
                for ev in st.waits:
                    ev.wait()
                if self.record_streams and enabled:
                    for s in st.crossing:
                        for t in tensors_in(slots[s]):
                            backend.record_stream(t, st.stream)
                if st.args is not None:
                    args = [slots[s] for s in st.args]
                else:
                    args = [_read(r, slots, inputs) for r in st.reads]
                fn = fns[st.pos]
                if observed:
                    with overlap.span(st.op, kind=st.kind, mb=st.mb, layer=st.layer):
                        out = fn(*args)
                else:
                    out = fn(*args)
                writes = st.writes
                if len(writes) == 1:
                    slots[writes[0]] = out
                elif writes:
                    if not isinstance(out, tuple) or len(out) != len(writes):
                        raise TypeError(f"operation {st.op!r} must return {len(writes)} values for {st.names}")
                    for s, v in zip(writes, out):
                        slots[s] = v
                if st.record is not None:
                    st.record.record()
                for s in st.frees:
                    slots[s] = None
            if scope is not None:
                done, scope = scope, None
                done.__exit__(None, None, None)
            if entered is not None:
                entered = None
                swap_stream_tag(caller)
            for ev in self.final_waits:
                ev.wait()
        finally:
            if scope is not None:
                scope.__exit__(None, None, None)
            if entered is not None:
                swap_stream_tag(caller)
            _enable_override.reset(pins[1])
            _path_override.reset(pins[0])
        return [slots[s] for s in self.outputs]


def _read(read: Tuple[Any, ...], slots: List[Any], inputs: Sequence[Mapping[str, Any]]) -> Any:
    keys, packed, src = read
    if src is not None:
        return inputs[src[0]][src[1]].fn(*[slots[s] for s in keys])
    return tuple(slots[s] for s in keys) if packed else slots[keys[0]]


class _Key:
    """A hashable key whose hash is computed once (the tuples are long)."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: Tuple[Any, ...]):
        self.value, self._hash = value, hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, _Key) and self._hash == other._hash and self.value == other.value)


def layer_signature(layers: Sequence[Sequence[Any]]) -> Tuple[List[Callable[..., Any]], Tuple[Any, ...]]:
    """The operations' functions in layer order, and the layers' signature: each operation's name,
    reads, writes and stream, layer by layer (what a lowering depends on)."""
    fns: List[Callable[..., Any]] = []
    sig = []
    for layer in layers:
        ops = []
        for o in layer:
            if type(o) is not Operation:
                o = as_operation(o)
            fns.append(o.fn)
            ops.append((o.name, tuple(o.reads), tuple(o.writes), o.stream))
        sig.append(tuple(ops))
    return fns, tuple(sig)


def _fingerprint(schedule: Schedule) -> _Key:
    """The schedule's launches and intents as a key, kept on the schedule (it is frozen)."""
    fp = schedule.__dict__.get("_replay_key")
    if fp is None:
        fp = _Key((tuple((l.mb, l.layer, l.op, l.stream) for l in schedule.launches), tuple(schedule.orders)))
        object.__setattr__(schedule, "_replay_key", fp)
    return fp


def _input_signature(inputs: Sequence[Mapping[str, Any]]) -> Tuple[Any, ...]:
    return tuple(tuple((name, (v.mbs, v.names, v.fn is None) if isinstance(v, FromMicroBatch) else None)
                       for name, v in inp.items()) for inp in inputs)


def _fn_positions(sig: Tuple[Any, ...]) -> Dict[Tuple[int, str], int]:
    out: Dict[Tuple[int, str], int] = {}
    for li, ops in enumerate(sig):
        for op in ops:
            out[li, op[0]] = len(out)
    return out


def records_streams(backend: Backend) -> bool:
    """Whether ``backend``'s ``record_stream`` does anything (not on cpu or ge): where it does not, a run visits
    no tensor for it."""
    return type(backend).record_stream is not Backend.record_stream


def input_structure(inputs: Sequence[Mapping[str, Any]]) -> Tuple[Any, ...]:
    """`_input_signature` with each micro-batch's names sorted: what a lowering depends on, in any order."""
    return tuple(tuple(sorted(mb)) for mb in _input_signature(inputs))


def replays() -> bool:
    """Whether the current path replays kept lowerings (eager paths, outside tracing)."""
    backend = backends.current()
    return not (backend.is_graph or backend.data_edges_order_streams or torch.compiler.is_compiling())


def program_for(schedule: Schedule, sig: Tuple[Any, ...], inputs: Sequence[Mapping[str, Any]], output: str,
                lower: Callable[[], Tuple[Any, Flow]]) -> Program:
    """The kept program of this schedule, layer signature, inputs' structure, path, caller and output;
    lowered with ``lower()`` and kept when there is none."""
    key = _Key((_fingerprint(schedule), sig, _input_signature(inputs), overlap.current_path(),
                overlap.current_stream_tag(), output))
    with STATE.lock:  # another thread may evict it between the lookup and the move
        program = STATE.programs.get(key)
        if program is not None:
            STATE.programs.move_to_end(key)
            return program
    lowering, flow = lower()
    program = Program(lowering, flow, _fn_positions(sig))
    _STATS["lowered"] += 1
    with STATE.lock:
        STATE.programs[key] = program
        while len(STATE.programs) > CACHE_SIZE:
            STATE.programs.popitem(last=False)
    return program


def forget() -> None:
    """Drop every kept program (the next run of each lowers again); `overlap.reset` does it too."""
    with STATE.lock:
        STATE.programs.clear()


def replay_stats() -> Dict[str, int]:
    """How many programs were lowered and how many runs replayed one, since the process started."""
    return dict(_STATS, kept=len(STATE.programs))


_SCHEDULES: "collections.OrderedDict[Hashable, Schedule]" = collections.OrderedDict()
_SCHEDULES_LOCK = threading.Lock()


def schedule_of(make: Callable[[Any, int], Schedule], layers: Sequence[Sequence[Any]], n_micro: int,
                sig: Optional[Tuple[Any, ...]] = None) -> Schedule:
    """``make(layers, n_micro)``, kept per (``make``, ``n_micro``, layer signature ``sig``, computed when not
    given): a generator's schedule depends only on the operations' names, reads, writes and streams, so
    the same object comes back (and its program is found without hashing its launches again). Outside
    tracing only (`executor.run_made` checks)."""
    try:
        key = _Key((make, n_micro, layer_signature(layers)[1] if sig is None else sig))
    except TypeError:  # an unhashable generator: build it every time
        return make(layers, n_micro)
    with _SCHEDULES_LOCK:
        schedule = _SCHEDULES.get(key)
        if schedule is not None:
            _SCHEDULES.move_to_end(key)
            return schedule
    schedule = make(layers, n_micro)
    with _SCHEDULES_LOCK:
        _SCHEDULES[key] = schedule
        while len(_SCHEDULES) > CACHE_SIZE:
            _SCHEDULES.popitem(last=False)
    return schedule


__all__ = ["CACHE_SIZE", "Program", "forget", "layer_signature", "program_for", "replay_stats", "replays",
           "schedule_of"]
