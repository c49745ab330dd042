"""The lowering: a checked schedule's data flow turned into the cross-stream edges of one execution path.

This is the one place that derives cross-stream edges, and they come from the data flow, never
from the schedule's author: where a value written on one stream is read on another, the
writer's stream records the writer's event and the reader's stream waits for it before the read
(where the graph compiler orders data edges itself, ``ge``, nothing is added), and every tensor
of the value is `record_stream` ed for the reader's stream. A forgotten wait is therefore
impossible here. Ordering intents without data (``Schedule.orders``) become ``wait_tensor`` on
every tensor argument of the later launch where data edges order (``ge``), and events across
streams elsewhere. Events are named per (micro-batch, operation, stream) and reused by every layer.
What runs a lowering is `microbatch.program`.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import overlap
from overlap import backends

from .schedules import OUT, Flow, Key, Layers, Schedule, ScheduledOp, validate


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


__all__ = ["Lowering", "Step", "event_tag", "lower"]
