"""A layer's parallel points, from its operations' data flow, and candidate orchestrations for each.

A *parallel point* is a group of operations of one layer with no path between them in the data flow (what each
reads and writes): the shared experts beside the routed path and its exchange, the indexer beside the query /
latent projections, LongCat-Flash's dense path beside its shortcut MoE. `parallel_points` finds them: two
operations are concurrent when neither is an ancestor of the other; a point is a connected group of concurrent
operations, cut into branches (no two operations of a branch concurrent). The *side* branch is the one the model
places on a side stream, else the one without communication, else the shorter; the other is the *main* branch,
whose window is the dominator's.

For each point `orchestrations` derives candidates, each a `Schedule` the executor runs (stream per launch,
issue order, ordering intents) and, for a core split, the per-stream core shares (`overlap.limit_cores`):

- ``side``: the side branch on a side stream, issued where the model lists it, joined where its outputs are read;
- ``side, early join``: the side branch issued at once after its inputs, the main branch's next operation
  waiting for its end;
- ``main on side``: the main branch's compute on the side stream, the side branch on the main stream;
- ``two side streams``: each branch on a side stream of its own;
- ``side, core split``: ``side`` with the main stream limited to 2/3 of the core budget and the side stream to the
  rest (the simulation does not model a core split: it predicts ``side``'s time).

Everything outside the point stays on the main stream (communication on its own), so a row measures one point.
`point_overlap` gives the measured ``overlap_pct`` of a point from a run's spans and its verdict (real >= 0.5,
false <= 0.05, partial between).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import overlap
from overlap import DEFAULT, EP_COMM, Span
from overlap.observability import FALSE, PARTIAL, REAL, busy_overlap_pct, point_verdict

from ..executor import run
from ..operations import Operation, as_operation
from ..schedules import Schedule, ScheduledOp

SIDE = "point_side"  # the side stream of a branch the model places on the main stream
SIDE2 = "point_side2"  # the second side stream (``two side streams``)
DEFAULT_BUDGET = overlap.CoreBudget(24, 48, "a 24|48 device (no budget found here)")


@dataclasses.dataclass(frozen=True)
class ParallelPoint:
    """Operations of one layer with no path between them: the ``side`` branch beside the ``main`` branch."""

    name: str
    side: Tuple[str, ...]
    main: Tuple[str, ...]
    side_stream: str  # the model's side stream for the side branch, or `SIDE`


@dataclasses.dataclass(frozen=True)
class Orchestration:
    """One way to run a point: a schedule of one layer and, for a core split, the (aic, aiv) shares of the main
    and the side streams."""

    point: str
    name: str
    schedule: Schedule
    side: Tuple[str, ...]
    cores: Optional[Tuple[Tuple[int, int], Tuple[int, int]]] = None

    def layer(self, ops: Sequence[Any]) -> List[Operation]:
        """The layer's operations as this orchestration runs them: the side branch's under its core share."""
        ops = [as_operation(o) for o in ops]
        if self.cores is None:
            return ops
        side_share = self.cores[1]
        return [dataclasses.replace(o, fn=_limited(o.fn, side_share)) if o.name in self.side else o for o in ops]

    def run(self, ops: Sequence[Any], inputs: Sequence[Mapping[str, Any]]) -> List[Any]:
        """This orchestration of the layer ``ops`` run by the executor on micro-batch ``inputs`` (one), the main stream
        under its core share; the core limits are forgotten before and after."""
        layers = [self.layer(ops)]
        if self.cores is None:
            return run(self.schedule, layers, inputs)
        overlap.reset_core_limits()
        try:
            with overlap.limit_cores(*self.cores[0]):
                return run(self.schedule, layers, inputs)
        finally:
            overlap.reset_core_limits()


def _limited(fn: Callable[..., Any], share: Tuple[int, int]) -> Callable[..., Any]:
    def limited(*args: Any) -> Any:
        with overlap.limit_cores(*share):
            return fn(*args)

    limited.__name__ = getattr(fn, "__name__", "op")
    return limited


# ---- finding the points ------------------------------------------------------------------------


def _ancestors(ops: Sequence[Operation]) -> List[Set[int]]:
    """Per operation, the indices of every operation it depends on through the data flow (ops in a valid order)."""
    writer: Dict[str, int] = {}
    out: List[Set[int]] = []
    for i, op in enumerate(ops):
        anc: Set[int] = set()
        for r in op.reads:
            if r in writer:
                anc |= {writer[r]} | out[writer[r]]
        out.append(anc)
        for w in op.writes:
            writer[w] = i
    return out


def concurrent_pairs(ops: Sequence[Any]) -> List[Tuple[str, str]]:
    """Every pair of operations of a layer (listed in a valid serial order) with no path between them."""
    ops = [as_operation(o) for o in ops]
    anc = _ancestors(ops)
    return [(ops[i].name, ops[j].name) for j in range(len(ops)) for i in range(j) if i not in anc[j]]


def _groups(n: int, pairs: Set[Tuple[int, int]]) -> List[List[int]]:
    """The connected groups of the concurrency graph, each in listed order."""
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in pairs:
        parent[root(i)] = root(j)
    members: Dict[int, List[int]] = {}
    for i in sorted({k for p in pairs for k in p}):
        members.setdefault(root(i), []).append(i)
    return sorted(members.values())


def _branches(group: List[int], pairs: Set[Tuple[int, int]]) -> List[List[int]]:
    """A group cut into branches, in listed order: each operation joins the first branch it is not concurrent with."""
    branches: List[List[int]] = []
    for i in group:
        home = next((b for b in branches if not any((min(i, k), max(i, k)) in pairs for k in b)), None)
        if home is None:
            branches.append([i])
        else:
            home.append(i)
    return branches


def _side_first(branches: List[List[Operation]]) -> List[List[Operation]]:
    """The branches, the side one first: the model's side stream, else no communication, else the shorter."""
    def rank(b: List[Operation]) -> Tuple[int, int, int]:
        tagged = any(o.stream not in (DEFAULT, EP_COMM) for o in b)
        comm = any(o.stream == EP_COMM for o in b)
        return (0 if tagged else 1, 1 if comm else 0, len(b))

    return sorted(branches, key=rank)


def _span_name(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def parallel_points(ops: Sequence[Any]) -> List[ParallelPoint]:
    """The parallel points of one layer's operations (listed in a valid serial order), in listed order.

    A group of more than two branches gives its first branch (side) beside the union of the others (main)."""
    ops = [as_operation(o) for o in ops]
    anc = _ancestors(ops)
    pairs = {(i, j) for j in range(len(ops)) for i in range(j) if i not in anc[j]}
    points = []
    for group in _groups(len(ops), pairs):
        branches = _side_first([[ops[i] for i in b] for b in _branches(group, pairs)])
        side = tuple(o.name for o in branches[0])
        main = tuple(o.name for o in ops if any(o in b for b in branches[1:]))
        tag = next((o.stream for o in branches[0] if o.stream not in (DEFAULT, EP_COMM)), SIDE)
        points.append(ParallelPoint(f"{_span_name(side)} beside {_span_name(main)}", side, main, tag))
    return points


# ---- orchestrations ----------------------------------------------------------------------------


def _home(op: Operation) -> str:
    """Where an operation runs outside the point: communication on its stream, everything else on the main one."""
    return EP_COMM if op.stream == EP_COMM else DEFAULT


def _schedule(name: str, ops: Sequence[Operation], streams: Dict[str, str],
              orders: Tuple[Tuple[int, int], ...] = ()) -> Schedule:
    launches = tuple(ScheduledOp(0, 0, o.name, streams.get(o.name, _home(o))) for o in ops)
    return Schedule(name, launches, orders)


def _placed(ops: Sequence[Operation], names: Sequence[str], tag: str) -> Dict[str, str]:
    """``names``'s compute on stream ``tag`` (their communication stays on its own stream)."""
    return {o.name: tag for o in ops if o.name in names and o.stream != EP_COMM}


def _early(ops: Sequence[Operation], side: Sequence[str]) -> Tuple[List[Operation], int]:
    """The operations with the side branch issued together right after its last producer, and the index of the
    first launch after it (len when none)."""
    rest = [o for o in ops if o.name not in side]
    branch = [o for o in ops if o.name in side]
    needed = {r for o in branch for r in o.reads}
    at = max((i + 1 for i, o in enumerate(rest) if needed & set(o.writes)), default=0)
    order = rest[:at] + branch + rest[at:]
    return order, at + len(branch)


def core_shares(budget: Optional[overlap.CoreBudget] = None) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """The (aic, aiv) shares of the main and the side stream: 2/3 and 1/3 of ``budget`` (default: the device's,
    else `DEFAULT_BUDGET`), at least one core each where the device has them."""
    budget = budget or overlap.core_budget() or DEFAULT_BUDGET
    side = (max(1, budget.aic // 3), max(1, budget.aiv // 3) if budget.aiv else 0)
    return (budget.aic - side[0], budget.aiv - side[1]), side


def orchestrations(ops: Sequence[Any], point: ParallelPoint,
                   budget: Optional[overlap.CoreBudget] = None) -> List[Orchestration]:
    """The candidate orchestrations of ``point`` in a layer of ``ops`` (see the module docstring), each a schedule of
    that one layer for one micro-batch."""
    ops = [as_operation(o) for o in ops]
    side_on = _placed(ops, point.side, point.side_stream)
    other = SIDE if point.side_stream != SIDE else SIDE2
    early, after = _early(ops, point.side)
    last_side = after - 1
    cands = [Orchestration(point.name, "side", _schedule("side", ops, side_on), point.side)]
    if after < len(ops):
        cands.append(Orchestration(point.name, "side, early join",
                                   _schedule("side-early-join", early, side_on, ((last_side, after),)), point.side))
    cands += [
        Orchestration(point.name, "main on side", _schedule("main-on-side", ops, _placed(ops, point.main, other)),
                      point.side),
        Orchestration(point.name, "two side streams",
                      _schedule("two-side-streams", ops, {**side_on, **_placed(ops, point.main, other)}), point.side),
        Orchestration(point.name, "side, core split", _schedule("side-core-split", ops, side_on), point.side,
                      cores=core_shares(budget)),
    ]
    return cands


def single_stream(ops: Sequence[Any]) -> Schedule:
    """The layer on the main stream alone (communication on its own): the reference every orchestration is checked
    against."""
    ops = [as_operation(o) for o in ops]
    return _schedule("single-stream", ops, {})


# ---- measured overlap --------------------------------------------------------------------------


Intervals = List[Tuple[float, float]]


def _busy(spans: Sequence[Span], names: Sequence[str]) -> Intervals:
    """When the operations ``names`` ran in ``spans``: their spans merged into disjoint intervals, in order."""
    merged: Intervals = []
    for s in sorted((s for s in spans if s.name in names and s.end is not None), key=lambda s: s.start):
        if merged and s.start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], s.end))
        else:
            merged.append((s.start, s.end))
    return merged


@dataclasses.dataclass(frozen=True)
class PointOverlap:
    """A point's measured windows (host seconds: when the side branch's and the main branch's operations ran),
    overlap_pct and verdict."""

    side: Intervals
    dominator: Intervals
    pct: float
    verdict: str


def point_overlap(spans: Sequence[Span], point: ParallelPoint) -> Optional[PointOverlap]:
    """The side branch's window against the main branch's (the dominator's) in ``spans`` (None if one is missing)."""
    side, dominator = _busy(spans, point.side), _busy(spans, point.main)
    if not side or not dominator:
        return None
    pct = busy_overlap_pct(side, dominator)
    return PointOverlap(side, dominator, pct, point_verdict(pct))


__all__ = ["DEFAULT_BUDGET", "FALSE", "Orchestration", "PARTIAL", "ParallelPoint", "PointOverlap", "REAL", "SIDE",
           "SIDE2", "concurrent_pairs", "core_shares", "orchestrations", "parallel_points", "point_overlap",
           "single_stream"]
