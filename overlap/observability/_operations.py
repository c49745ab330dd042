"""The toolkit's operations in a profiler trace: busy time and hidden communication per operation.

A profiled run of the executor names each launch (`overlap.hooks.launch_name`); the readers find those
ranges (`overlap.observability._traces.ProfiledLaunch`). Per rank, each operation (its name and stream,
``experts@default``, over every micro-batch and layer) gets:

- its launches and their **span**: the length of the union of its ranges (on a host trace the host's time
  in it, on a device trace the window from its first kernel to its last, per stream);
- its **busy** time per lane: the lane's busy time (as `_intervals` defines it) inside its ranges on that lane;
- the **communication hidden under it**: the rank's communication time during which compute inside its
  ranges ran, over the rank's communication time (the hidden share of communication, by operation; two
  operations on two compute streams may hide the same communication, so these need not add up).

What ran outside every launch is reported per lane as busy time outside the operations.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ._intervals import COMM, COMPUTE, HOST_KINDS, Interval, intersect, length, union
from ._traces import Item, ProfiledLaunch


@dataclasses.dataclass
class Operation:
    """One operation's figures on one rank; times in seconds."""

    op: str
    stream: str
    kind: str  # the kind of its launches: "compute", or "issue" (the host issuing an exchange)
    launches: int
    span: float
    busy: Dict[str, float]  # per lane
    hidden_comm: float

    @property
    def label(self) -> str:
        return f"{self.op}@{self.stream}"


@dataclasses.dataclass
class RankOperations:
    """The operations of one rank (heaviest first), the busy time outside them per lane, the rank's
    communication time."""

    operations: List[Operation]
    outside: Dict[str, float]
    comm_time: float

    def hidden_share(self, op: Operation) -> Optional[float]:
        return op.hidden_comm / self.comm_time if self.comm_time > 0 else None


def _lanes(items: Iterable[Item], kinds: Optional[Tuple[str, ...]] = None) -> Dict[str, Dict[str, List[Interval]]]:
    """Per process and lane, the union of the busy items (of ``kinds`` only, when given)."""
    out: Dict[str, Dict[str, List[Interval]]] = {}
    for process, lane, kind, start, end in items:
        if kind not in HOST_KINDS and (kinds is None or kind in kinds):
            out.setdefault(process, {}).setdefault(lane, []).append((start, end))
    return {p: {lane: union(iv) for lane, iv in lanes.items()} for p, lanes in out.items()}


def operation_figures(items: Sequence[Item], launches: Sequence[ProfiledLaunch]) -> Dict[str, RankOperations]:
    """Per process holding any of the toolkit's launches, its operations' figures (see the module docstring)."""
    busy, compute = _lanes(items), _lanes(items, (COMPUTE,))
    comm: Dict[str, List[Interval]] = {}
    for process, _lane, kind, start, end in items:
        if kind == COMM:
            comm.setdefault(process, []).append((start, end))
    grouped: Dict[str, Dict[Tuple[str, str, str], Dict[str, List[Interval]]]] = {}
    counts: Dict[Tuple[str, Tuple[str, str, str]], int] = {}
    for x in launches:
        key = (x.name.op, x.name.stream, x.name.kind)
        grouped.setdefault(x.process, {}).setdefault(key, {}).setdefault(x.lane, []).append((x.start, x.end))
        counts[x.process, key] = counts.get((x.process, key), 0) + 1
    out: Dict[str, RankOperations] = {}
    for process, ops in grouped.items():
        lanes, comp, rank_comm = busy.get(process, {}), compute.get(process, {}), union(comm.get(process, ()))
        figures, inside = [], {lane: [] for lane in lanes}  # type: ignore[var-annotated]
        for (op, stream, kind), ranges in ops.items():
            ranges = {lane: union(iv) for lane, iv in ranges.items()}
            spans = union(iv for rs in ranges.values() for iv in rs)
            hidden = union(iv for lane, rs in ranges.items() for iv in intersect(comp.get(lane, []), rs))
            figures.append(Operation(op, stream, kind, counts[process, (op, stream, kind)], length(spans),
                                     {lane: length(intersect(lanes[lane], rs)) for lane, rs in ranges.items()
                                      if lane in lanes},
                                     length(intersect(rank_comm, hidden))))
            for lane, rs in ranges.items():
                inside.setdefault(lane, []).extend(rs)
        outside = {lane: length(u) - length(intersect(u, union(inside.get(lane, [])))) for lane, u in lanes.items()}
        figures.sort(key=lambda o: (-sum(o.busy.values()), -o.span, o.label))
        out[process] = RankOperations(figures, outside, length(rank_comm))
    return out
