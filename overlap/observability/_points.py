"""Per parallel point: did the side stream's work really run beside the main stream's longest operation?

A stream switched right is not parallelism that happened: a graph compiler may issue a cheap consumer of a side
output (a cast, a silu) on the main stream ahead of the main path's long operation (the *dominator*), and the main
stream then waits for the side stream before it reaches the dominator. Per parallel point this module takes

- the **side window**: ``[first start, last end]`` of the point's side-stream operations;
- the **dominator window**: the main-stream operation the side work should hide behind;
- ``overlap_pct = overlap / min(side length, dominator length)``, and the verdict: ``real`` at or above
  `REAL_OVERLAP` (0.5), ``false`` at or below `SERIALIZED` (0.05), ``partial`` between;
- for a false or partial point the **barrier**: the first main-stream operation that consumes a side output and
  runs before the dominator.

Where the points come from:

- a trace of this toolkit (`overlap.Timeline`): every operation the schedule placed on a side stream (the
  shared experts, the indexer, an exchange ...) per layer, micro-batch and run; its dominator is the longest
  main-stream operation of the same layer and micro-batch with no data path to or from it, and its barrier is
  found from the data flow the spans carry (``op``, ``reads``, ``writes``: the names of the values);
- any trace, a profiler's included: points named by patterns (`PointSpec`: a name, a regular expression for the
  side operations and one for the dominator); each run of consecutive matches on a stream is an occurrence
  (one per layer), paired with the dominator's; with no data flow in the trace, the barrier is the first
  main-stream operation that started only once the side window ended, ahead of the dominator.

With ``kernel_details.csv`` two more checks per occurrence: the ``Block Dim`` of the operations running at the
same time on different streams, summed at its peak and compared with the core count (over-subscription named),
and an ``EVENT_WAIT`` on the main stream after the join longer than a threshold (named).
"""
from __future__ import annotations

import dataclasses
import re
import statistics
from typing import Dict, List, Optional, Pattern, Sequence, Set, Tuple

from ._intervals import COMM, COPY, REAL_OVERLAP, SERIALIZED, Interval
from ._traces import EVENT_WAIT_PATTERN, Task

MAIN = "default"  # the toolkit's main stream
REAL, PARTIAL, FALSE = "real", "partial", "false"
DEFAULT_WAIT_GAP_US = 20.0  # an EVENT_WAIT after a join longer than this is named
BLOCK_DIM = "Block Dim"


@dataclasses.dataclass(frozen=True)
class PointSpec:
    """A point named by the user: its side operations' and its dominator's names as regular expressions."""

    name: str
    side: Pattern[str]
    dominator: Pattern[str]


@dataclasses.dataclass
class Occurrence:
    """One occurrence of a parallel point (times in seconds since the trace's first event)."""

    point: str
    process: str
    side: Interval
    dominator: Optional[str] = None
    dominator_window: Optional[Interval] = None
    barrier: Optional[str] = None
    blocks: Optional[Tuple[float, List[str]]] = None  # peak Block Dim summed over streams, and what ran then
    waits: List[str] = dataclasses.field(default_factory=list)  # EVENT_WAIT gaps after the join

    @property
    def overlap_pct(self) -> Optional[float]:
        return None if self.dominator_window is None else overlap_pct(self.side, self.dominator_window)

    @property
    def verdict(self) -> str:
        pct = self.overlap_pct
        return "no dominator" if pct is None else point_verdict(pct)


def overlap_pct(side: Interval, dominator: Interval) -> float:
    """overlap / min(side length, dominator length); 0 when either window is empty."""
    return busy_overlap_pct([side], [dominator])


def busy_overlap_pct(side: Sequence[Interval], dominator: Sequence[Interval]) -> float:
    """`overlap_pct` of two branches given as the disjoint intervals their operations ran: the time both ran over
    the shorter one's busy time. One interval each: the window formula; branches that took turns on one thread
    (compute inline on a CPU host) read as false, where their windows would overlap."""
    low = min(sum(b - a for a, b in side), sum(b - a for a, b in dominator))
    both = sum(max(0.0, min(b, d) - max(a, c)) for a, b in side for c, d in dominator)
    return both / low if low > 0 else 0.0


def point_verdict(pct: float) -> str:
    """``real`` (>= `REAL_OVERLAP`), ``false`` (<= `SERIALIZED`, the two ran one after the other) or ``partial``."""
    if pct >= REAL_OVERLAP:
        return REAL
    if pct <= SERIALIZED:
        return FALSE
    return PARTIAL


def point_figures(occurrences: Sequence[Occurrence]) -> Dict[str, Tuple[int, Optional[float], Optional[float]]]:
    """Per point: its occurrences, the median and the worst overlap_pct (None where no occurrence has one)."""
    out: Dict[str, Tuple[int, Optional[float], Optional[float]]] = {}
    for name in dict.fromkeys(o.point for o in occurrences):
        mine = [o for o in occurrences if o.point == name]
        pcts = [o.overlap_pct for o in mine if o.overlap_pct is not None]
        out[name] = (len(mine), statistics.median(pcts) if pcts else None, min(pcts) if pcts else None)
    return out


# ---- the toolkit's own traces: the schedule's points, from the spans' data flow ----

@dataclasses.dataclass
class _Op:
    """One launch of an operation with its data flow and the window its work took."""

    name: str
    stream: str
    reads: Set[str]
    writes: Set[str]
    start: float
    end: float
    work: List[Interval] = dataclasses.field(default_factory=list)  # its collectives / copies, if any

    @property
    def window(self) -> Interval:
        if self.work:  # an exchange's host issue is not its stream's work: its collectives are
            return min(s for s, _ in self.work), max(e for _, e in self.work)
        return self.start, self.end


def _names(text: object) -> Set[str]:
    return {n for n in str(text or "").split(",") if n}


def _launch_groups(tasks: Sequence[Task]) -> Dict[Tuple[str, int, int, int], List[_Op]]:
    """The toolkit's launches per (process, layer, micro-batch, run), the collectives they issued attached."""
    groups: Dict[Tuple[str, int, int, int], List[_Op]] = {}
    runs: Dict[Tuple[str, int, int, str], List[_Op]] = {}
    flowing = sorted((t for t in tasks if "op" in t.fields and t.fields.get("layer") is not None
                      and t.fields.get("mb") is not None), key=lambda t: t.start)
    for t in flowing:
        key = (t.process, int(t.fields["layer"]), int(t.fields["mb"]), str(t.fields["op"]))
        last = runs[key][-1] if runs.get(key) else None
        if t.kind in (COMM, COPY) or t.name != key[3] or (last is not None and t.start < last.end):
            if last is not None:  # work the launch issued (a collective, its stream's worker): it inherited the meta
                last.work.append((t.start, t.end))
            continue
        op = _Op(key[3], str(t.fields.get("stream", t.lane)), _names(t.fields.get("reads")),
                 _names(t.fields.get("writes")), t.start, t.end)
        runs.setdefault(key, []).append(op)
        groups.setdefault((key[0], key[1], key[2], len(runs[key]) - 1), []).append(op)
    return groups


def _reach(ops: Sequence[_Op]) -> Dict[int, Set[int]]:
    """For each operation (by index) every operation reachable from it along the values it writes."""
    readers = {i: {j for j, b in enumerate(ops) if j != i and a.writes & b.reads} for i, a in enumerate(ops)}
    out: Dict[int, Set[int]] = {}
    for i in range(len(ops)):
        seen: Set[int] = set()
        todo = list(readers[i])
        while todo:
            j = todo.pop()
            if j not in seen:
                seen.add(j)
                todo += readers[j]
        out[i] = seen
    return out


def _group_points(process: str, layer: int, mb: int, ops: Sequence[_Op]) -> List[Occurrence]:
    reach = _reach(ops)
    out = []
    for i, side in enumerate(ops):
        if side.stream == MAIN:
            continue
        free = [j for j, m in enumerate(ops) if m.stream == MAIN and j not in reach[i] and i not in reach[j]]
        occ = Occurrence(f"L{layer}.mb{mb}.{side.name}@{side.stream}", process, side.window)
        if free:
            dom = ops[max(free, key=lambda j: ops[j].window[1] - ops[j].window[0])]
            occ.dominator, occ.dominator_window = dom.name, dom.window
            consumers = sorted((m for m in ops if m.stream == MAIN and m.reads & side.writes and m.start < dom.start),
                               key=lambda m: m.start)
            occ.barrier = consumers[0].name if consumers else None
        out.append(occ)
    return out


def toolkit_points(tasks: Sequence[Task]) -> List[Occurrence]:
    """The schedule's parallel points in a trace of this toolkit: one per side-stream operation, layer,
    micro-batch and run (see the module docstring)."""
    out: List[Occurrence] = []
    for (process, layer, mb, _run), ops in sorted(_launch_groups(tasks).items()):
        out += _group_points(process, layer, mb, ops)
    return out


# ---- points named by patterns: any trace ----

def _is_wait(t: Task) -> bool:
    return bool(EVENT_WAIT_PATTERN.search(t.name) or EVENT_WAIT_PATTERN.search(str(t.fields.get("Type", ""))))


def _runs(tasks: Sequence[Task], pattern: Pattern[str], breaks: Sequence[float] = ()) -> List[List[Task]]:
    """Runs of consecutive matches of ``pattern`` on each lane (waits ignored), by their first start; a run also
    ends where one of ``breaks`` (the dominators' ends: a side stream may carry nothing else from one layer to
    the next) falls between two matches."""
    runs: List[List[Task]] = []
    for lane in sorted({t.lane for t in tasks}):
        current: List[Task] = []
        for t in sorted((t for t in tasks if t.lane == lane and not _is_wait(t)), key=lambda t: t.start):
            if current and any(current[-1].end < b <= t.start for b in breaks):
                runs.append(current)
                current = []
            if pattern.search(t.name):
                current.append(t)
            elif current:
                runs.append(current)
                current = []
        if current:
            runs.append(current)
    return sorted(runs, key=lambda r: r[0].start)


def _window(run: Sequence[Task]) -> Interval:
    return min(t.start for t in run), max(t.end for t in run)


def _timed_barrier(tasks: Sequence[Task], lane: str, side: Interval, dominator: Interval,
                   dominator_names: Set[str]) -> Optional[str]:
    """The first main-lane operation that started only once the side window ended, ahead of the dominator."""
    ahead = sorted((t for t in tasks if t.lane == lane and not _is_wait(t) and t.name not in dominator_names
                    and side[1] <= t.start < dominator[0] and t.start >= side[0]), key=lambda t: t.start)
    return ahead[0].name if ahead else None


def _block_peak(tasks: Sequence[Task], window: Interval) -> Optional[Tuple[float, List[str]]]:
    """The peak of ``Block Dim`` summed over the tasks running at once in ``window``, and those tasks."""
    timed = [t for t in tasks if t.fields.get(BLOCK_DIM, "") not in ("", None) and not _is_wait(t)
             and t.start < window[1] and t.end > window[0]]
    if not timed:
        return None
    best: Tuple[float, List[str]] = (0.0, [])
    for at in sorted({max(t.start, window[0]) for t in timed}):
        running = [t for t in timed if t.start <= at < t.end]
        total = sum(_block_dim(t) for t in running)
        if total > best[0] and len({t.lane for t in running}) > 1:
            best = (total, [f"{t.name} {_block_dim(t):g} on {t.lane}" for t in running])
    return best if best[1] else None


def _block_dim(t: Task) -> float:
    try:
        return float(t.fields[BLOCK_DIM])
    except (TypeError, ValueError):
        return 0.0


def _join_waits(tasks: Sequence[Task], lane: str, occurrence: Interval, gap_us: float) -> List[str]:
    """``EVENT_WAIT``s on the main lane starting within the occurrence (side and dominator windows), longer than
    ``gap_us``: the main stream held at the join."""
    return [f"EVENT_WAIT {(t.end - t.start) * 1e6:.2f} us on {t.lane} at {t.start * 1e6:.2f} us"
            for t in sorted(tasks, key=lambda t: t.start) if t.lane == lane and _is_wait(t)
            and occurrence[0] <= t.start <= occurrence[1] and (t.end - t.start) * 1e6 > gap_us]


def _pair(side: Sequence[List[Task]], dominators: Sequence[List[Task]], k: int) -> Optional[List[Task]]:
    """The dominator run of the ``k``-th side run: by index when the counts agree, else the nearest in time."""
    if not dominators:
        return None
    if len(side) == len(dominators):
        return dominators[k]
    start = side[k][0].start
    return min(dominators, key=lambda r: abs(r[0].start - start))


def spec_points(tasks: Sequence[Task], specs: Sequence[PointSpec],
                wait_gap_us: float = DEFAULT_WAIT_GAP_US) -> List[Occurrence]:
    """Each occurrence of each named point, per process (see the module docstring)."""
    out: List[Occurrence] = []
    for spec in specs:
        for process in sorted({t.process for t in tasks}):
            mine = [t for t in tasks if t.process == process]
            doms = _runs(mine, spec.dominator)
            side = _runs(mine, spec.side, [_window(r)[1] for r in doms])
            for k, run in enumerate(side):
                occ = Occurrence(spec.name, process, _window(run))
                dom = _pair(side, doms, k)
                if dom is not None:
                    occ.dominator, occ.dominator_window = dom[0].name, _window(dom)
                    lane, whole = dom[0].lane, (min(occ.side[0], occ.dominator_window[0]),
                                                max(occ.side[1], occ.dominator_window[1]))
                    occ.barrier = _timed_barrier(mine, lane, occ.side, occ.dominator_window, {t.name for t in dom})
                    occ.blocks = _block_peak(mine, whole)
                    occ.waits = _join_waits(mine, lane, whole, wait_gap_us)
                out.append(occ)
    return out


def parse_spec(name: str, side: str, dominator: str) -> PointSpec:
    """A `PointSpec`; `ValueError` naming the pattern that is not a regular expression."""
    compiled = []
    for what, text in (("SIDE_REGEX", side), ("DOMINATOR_REGEX", dominator)):
        try:
            compiled.append(re.compile(text))
        except re.error as e:
            raise ValueError(f"--point {name}: {what} {text!r} is not a regular expression ({e})") from None
    if not name.strip():
        raise ValueError("--point: an empty NAME")
    return PointSpec(name, compiled[0], compiled[1])


def read_specs(path: str, text: str) -> List[PointSpec]:
    """Points from a file: one ``NAME SIDE_REGEX DOMINATOR_REGEX`` per line (``#`` comments, blank lines skipped);
    `ValueError` naming the line that is not one."""
    specs = []
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3:
            raise ValueError(f"--points-file {path}: line {i} has {len(parts)} field(s), not NAME SIDE_REGEX "
                             f"DOMINATOR_REGEX: {line[:60]!r}")
        try:
            specs.append(parse_spec(*parts))
        except ValueError as e:
            raise ValueError(f"--points-file {path}: line {i}: {e}") from None
    if not specs:
        raise ValueError(f"--points-file {path}: no point in it (one 'NAME SIDE_REGEX DOMINATOR_REGEX' a line)")
    return specs


def cores_from(value: str) -> int:
    """``--cores``: a count, or CANN's platform ini file holding ``ai_core_cnt=N``; `ValueError` otherwise."""
    if value.strip().isdigit():
        if int(value) <= 0:
            raise ValueError(f"--cores {value}: not a positive core count")
        return int(value)
    try:
        with open(value) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--cores {value}: neither a core count nor a readable platform ini ({e.strerror})") from None
    found = re.search(r"^\s*ai_core_cnt\s*=\s*(\d+)\s*$", text, re.MULTILINE)
    if not found or int(found.group(1)) <= 0:
        raise ValueError(f"--cores {value}: no 'ai_core_cnt=N' line in it (CANN's platform ini names it)")
    return int(found.group(1))


def gate_points(occurrences: Sequence[Occurrence], specs: Sequence[PointSpec], floor: float) -> List[str]:
    """The points whose median overlap_pct is below ``floor``, and the named points with no occurrence or no
    dominator (a side operation of the toolkit's with no dominator is no parallel point: not gated)."""
    failures = [f"point {s.name}: no occurrence (no operation matches {s.side.pattern!r})" for s in specs
                if not any(o.point == s.name for o in occurrences)]
    named = {s.name for s in specs}
    for name, (n, median, _worst) in point_figures(occurrences).items():
        if median is None and name in named:
            spec = next(s for s in specs if s.name == name)
            failures.append(f"point {name}: no dominator (no operation matches {spec.dominator.pattern!r})")
        elif median is not None and median < floor:
            failures.append(f"point {name}: overlap_pct {median:.2f} < {floor}" + (f" (median of {n})" if n > 1
                                                                                  else ""))
    if not occurrences and not specs:
        failures.append("no parallel point in the trace, so no overlap is proven")
    return failures
