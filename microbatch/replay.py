"""Lower once, replay: the programs kept for the eager paths, and the schedules kept for their generators.

The executor (`microbatch.run`) checks a schedule and lowers it (`microbatch.lowering.lower`: the
data flow, every event, wait, ``record_stream`` and free) the first time it meets it for a given
layer signature, inputs' structure, execution path, caller stream and output, compiles that
lowering into a `microbatch.program.Program` and keeps it here; later calls replay the program
(`microbatch.program.interpret`, the one function that runs every program) with their own values.

What identifies a program (`_Key`): the schedule (its launches and ordering intents), each
layer's operations by name, reads, writes and stream (not their functions: a model builds its
operations anew on every call, and the functions of *this* call run), the inputs' names and
`FromMicroBatch` links (their functions are this call's too), the path, the caller's stream and
the output name. Anything else lowers anew, so a stale lowering is never replayed. The programs
are this module's (with their lock) and go with `overlap.reset()` (`overlap.on_reset`: they hold
events that a reset forgets); at most `CACHE_SIZE` are kept, the least recently used dropped first.

Graph paths (``ge``, ``aclgraph``) and tracing (`torch.compile`) keep no program: they compile one
every call, as a compiler captures the launches once anyway.
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import torch

import overlap
from overlap import backends

from .lowering import Lowering
from .operations import FromMicroBatch, Operation, as_operation
from .program import Positions, Program
from .schedules import Flow, Schedule

CACHE_SIZE = 64
_STATS = {"lowered": 0, "replayed": 0}
_PROGRAMS: "collections.OrderedDict[_Key, Program]" = collections.OrderedDict()  # least recently used first
_PROGRAMS_LOCK = threading.Lock()


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


def _fn_positions(sig: Tuple[Any, ...]) -> Positions:
    out: Dict[Tuple[int, str], int] = {}
    for li, ops in enumerate(sig):
        for op in ops:
            out[li, op[0]] = len(out)
    return out


def input_structure(inputs: Sequence[Mapping[str, Any]]) -> Tuple[Any, ...]:
    """`_input_signature` with each micro-batch's names sorted: what a lowering depends on, in any order."""
    return tuple(tuple(sorted(mb)) for mb in _input_signature(inputs))


def keeps_programs() -> bool:
    """Whether the current path keeps programs (eager paths, outside tracing)."""
    backend = backends.current()
    return not (backend.is_graph or backend.data_edges_order_streams or torch.compiler.is_compiling())


def program_for(schedule: Schedule, sig: Tuple[Any, ...], inputs: Sequence[Mapping[str, Any]], output: str,
                lower: Callable[[], Tuple[Lowering, Flow]]) -> Program:
    """The kept program of this schedule, layer signature, inputs' structure, path, caller and output (one
    replay more); lowered with ``lower()``, compiled and kept when there is none."""
    key = _Key((_fingerprint(schedule), sig, _input_signature(inputs), overlap.current_path(),
                overlap.current_stream_tag(), output))
    with _PROGRAMS_LOCK:  # another thread may evict it between the lookup and the move
        program = _PROGRAMS.get(key)
        if program is not None:
            _PROGRAMS.move_to_end(key)
    if program is None:
        lowering, flow = lower()
        program = Program(lowering, flow, _fn_positions(sig))
        _STATS["lowered"] += 1
        overlap.on_reset(forget)  # the program holds events that a reset forgets (registered once)
        with _PROGRAMS_LOCK:
            _PROGRAMS[key] = program
            while len(_PROGRAMS) > CACHE_SIZE:
                _PROGRAMS.popitem(last=False)
    _STATS["replayed"] += 1  # a statistic: an increment lost between threads is no harm
    return program


def forget() -> None:
    """Drop every kept program (the next run of each lowers again); `overlap.reset` does it too."""
    with _PROGRAMS_LOCK:
        _PROGRAMS.clear()


def kept() -> List[Program]:
    """The programs kept now, the least recently used first."""
    with _PROGRAMS_LOCK:
        return list(_PROGRAMS.values())


def replay_stats() -> Dict[str, int]:
    """How many programs were lowered and how many runs replayed one, since the process started, and how many
    are kept now."""
    return dict(_STATS, kept=len(_PROGRAMS))


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


__all__ = ["CACHE_SIZE", "forget", "input_structure", "keeps_programs", "kept", "layer_signature", "program_for",
           "replay_stats", "schedule_of"]
