"""Measured against predicted: match two of this toolkit's Chrome traces span by span (``overlap-report --plan``).

The plan must say it is one (``otherData.prediction``, written by a prediction's
``save_chrome_trace``), the measured trace must not, and both must run the same schedule: on each
rank the plan covers, the same launches (operation, stream, micro-batch, layer), so the same
mode, micro-batches, layers and operations. Anything else is refused with one line naming what
differs: a drift table between two different schedules would be a wrong answer.

Spans are matched by (rank, stream, name, micro-batch, layer); where a key holds several spans
(an operation and a collective of the same name), spans of the same kind pair first, each in
start order. Starts are relative to the first span of the same rank in each trace.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Counter, Dict, Iterable, List, Optional, Sequence, Tuple

from ._traces import TraceError, complete_slices, is_toolkit_trace, named_ids, read_json, trace_events, trace_metadata
from .timeline import GENERATOR

Key = Tuple[Any, str, str, Any, Any]  # rank, stream, name, mb, layer
Launch = Tuple[Any, Any, str, str]  # mb, layer, operation, stream
# the executor's launches (one per scheduled operation); "comm" and "copy" spans are the work they start
_LAUNCH_KINDS = ("compute", "issue")


@dataclasses.dataclass(frozen=True)
class TraceSpan:
    """One complete event of a toolkit trace, start and end in seconds from the rank's first span."""

    rank: Any
    stream: str
    name: str
    kind: str
    mb: Any
    layer: Any
    start: float
    end: float

    @property
    def key(self) -> Key:
        return (self.rank, self.stream, self.name, self.mb, self.layer)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Match:
    """A measured span and its predicted counterpart."""

    measured: TraceSpan
    predicted: TraceSpan

    @property
    def duration_drift(self) -> float:
        return self.measured.duration - self.predicted.duration

    @property
    def start_drift(self) -> float:
        return self.measured.start - self.predicted.start


@dataclasses.dataclass
class Comparison:
    """Matched spans, what only one side has, and each side's length (first start to last end per rank, max)."""

    measured: str
    predicted: str
    matches: List[Match]
    only_measured: List[TraceSpan]
    only_predicted: List[TraceSpan]
    measured_s: float
    predicted_s: float

    def top(self, what: str, n: int = 5) -> List[Match]:
        """The ``n`` matches whose ``"duration"`` or ``"start"`` drifts most (absolute)."""
        drift = (lambda m: abs(m.duration_drift)) if what == "duration" else (lambda m: abs(m.start_drift))
        return sorted(self.matches, key=drift, reverse=True)[:n]


def _hashable(v: Any) -> Any:
    return v if isinstance(v, (str, int, float, bool)) or v is None else str(v)


@dataclasses.dataclass
class ToolkitTrace:
    """A toolkit trace's spans, and what its ``otherData.prediction`` says (None: a measured trace)."""

    source: str
    spans: List[TraceSpan]
    prediction: Optional[Dict[str, Any]]
    array_format: bool = False


def read_trace(source: str) -> ToolkitTrace:
    """A Chrome trace written by this toolkit (either JSON format); `TraceError` for anything else."""
    data = read_json(source)
    events = trace_events(data, source)
    if not is_toolkit_trace(data, events):
        raise TraceError(f"{source}: not a trace of this toolkit (no otherData.generator {GENERATOR!r}): --plan "
                         f"compares two traces written by overlap's save_chrome_trace")
    threads = named_ids(events, "thread_name")
    raw = []
    for e, s, t in complete_slices(events, source):
        args = e.get("args", {})
        rank = _hashable(args.get("rank", e.get("pid")))
        stream = str(args.get("stream", threads.get((e.get("pid"), e.get("tid")), e.get("tid"))))
        raw.append(TraceSpan(rank, stream, str(e.get("name", "")), str(e.get("cat", args.get("kind", ""))),
                             _hashable(args.get("mb")), _hashable(args.get("layer")), s, t))
    if not raw:
        raise TraceError(f"{source}: no timed events (complete 'X' slices) found in it")
    first: Dict[Any, float] = {}
    for sp in raw:
        first[sp.rank] = min(first.get(sp.rank, sp.start), sp.start)
    spans = [dataclasses.replace(sp, start=sp.start - first[sp.rank], end=sp.end - first[sp.rank]) for sp in raw]
    prediction = trace_metadata(data, "otherData").get("prediction")
    return ToolkitTrace(source, spans, prediction if isinstance(prediction, dict) else None, isinstance(data, list))


def read_spans(source: str) -> List[TraceSpan]:
    """The spans of a Chrome trace written by this toolkit; `TraceError` for anything else."""
    return read_trace(source).spans


def _launches(spans: Iterable[TraceSpan], rank: Any) -> Counter[Launch]:
    return collections.Counter((s.mb, s.layer, s.name, s.stream) for s in spans
                               if s.rank == rank and s.kind in _LAUNCH_KINDS and s.mb is not None
                               and s.layer is not None)


def _listed(values: Iterable[Any], prefix: str) -> str:
    """``values`` as ``N (mb0-mb3)`` when they are consecutive integers, else ``N (a, b, ...)``."""
    vs = sorted(set(values), key=lambda v: (not isinstance(v, int), str(v) if not isinstance(v, int) else v))
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in vs)
    if ints and len(vs) > 2 and vs[-1] - vs[0] == len(vs) - 1:
        return f"{len(vs)} ({prefix}{vs[0]}-{prefix}{vs[-1]})"
    shown = ", ".join(f"{prefix}{v}" for v in vs[:6]) + (", ..." if len(vs) > 6 else "")
    return f"{len(vs)} ({shown})"


def _launch_label(mb: Any, layer: Any, name: str) -> str:
    return f"{name} of mb{mb} L{layer}"


def _difference(m: Counter[Launch], p: Counter[Launch]) -> Optional[str]:
    """What differs between the measured launches ``m`` and the planned ``p`` of one rank, in words."""
    for what, at, prefix in (("micro-batches", 0, "mb"), ("layers", 1, "L")):
        a, b = {k[at] for k in m}, {k[at] for k in p}
        if a != b:
            return f"{what}: measured {_listed(a, prefix)}, planned {_listed(b, prefix)}"
    a, b = {k[2] for k in m}, {k[2] for k in p}
    if a != b:
        only = [f"only measured: {', '.join(sorted(a - b))}" if a - b else "",
                f"only planned: {', '.join(sorted(b - a))}" if b - a else ""]
        return f"operations: {'; '.join(x for x in only if x)}"
    where_m: Dict[Tuple[Any, Any, str], List[str]] = {}
    where_p: Dict[Tuple[Any, Any, str], List[str]] = {}
    for counts, where in ((m, where_m), (p, where_p)):
        for k in sorted(counts, key=str):
            where.setdefault(k[:3], []).append(k[3])
    for op in sorted(set(where_m) | set(where_p), key=str):
        a_streams, b_streams = where_m.get(op, []), where_p.get(op, [])
        if a_streams != b_streams:
            return (f"streams (another mode?): {_launch_label(*op)} runs on {', '.join(a_streams) or 'none'} "
                    f"measured, on {', '.join(b_streams) or 'none'} planned")
    for k in sorted(set(m) | set(p), key=str):
        if m[k] != p[k]:
            return f"launches: {_launch_label(*k[:3])} @{k[3]} {m[k]} time(s) measured, {p[k]} planned"
    return None


def check_pair(measured: ToolkitTrace, plan: ToolkitTrace) -> None:
    """`TraceError` unless ``plan`` is a plan, ``measured`` is not, and both run the same schedule."""
    if measured.prediction is not None:
        raise TraceError(f"{measured.source}: a plan (a predicted trace), not a measured one: overlap-report "
                         f"MEASURED --plan PREDICTED takes the measured trace first")
    if plan.prediction is None:
        layout = " (the JSON array format keeps no otherData)" if plan.array_format else ""
        raise TraceError(f"{plan.source}: not a plan but a measured trace: it has no otherData.prediction{layout}, "
                         f"which a prediction's save_chrome_trace writes (the launcher's trace_auto.predicted.json)")
    name = plan.prediction.get("schedule")
    of = f" ({name})" if name else ""
    ranks = sorted({s.rank for s in plan.spans}, key=str)
    for rank in ranks:
        p = _launches(plan.spans, rank)
        if not p:
            continue  # nothing scheduled to compare on this rank: the spans still match by key
        m = _launches(measured.spans, rank)
        where = f"rank {rank}: " if len(ranks) > 1 else ""
        if not m:
            have = ", ".join(map(str, sorted({s.rank for s in measured.spans}, key=str)))
            diff = f"{where}no launch of rank {rank} measured (ranks measured: {have})"
        else:
            diff = _difference(m, p)
            diff = diff and where + diff
        if diff:
            raise TraceError(f"{measured.source}: not the schedule of the plan {plan.source}{of}: {diff}; compare a "
                             f"trace with the plan of the same run (mode, micro-batches, layers, operations)")


def _length(spans: Sequence[TraceSpan]) -> float:
    ends: Dict[Any, float] = {}
    for s in spans:
        ends[s.rank] = max(ends.get(s.rank, 0.0), s.end)
    return max(ends.values(), default=0.0)


def _pair(measured: List[TraceSpan], predicted: List[TraceSpan]) -> Tuple[List[Match], List[TraceSpan],
                                                                         List[TraceSpan]]:
    """Spans of one key: the same kind first, each in start order; then what is left, in start order."""
    ms, ps = sorted(measured, key=lambda s: s.start), sorted(predicted, key=lambda s: s.start)
    matches: List[Match] = []
    for kind in dict.fromkeys(s.kind for s in ms):
        a, b = [s for s in ms if s.kind == kind], [s for s in ps if s.kind == kind]
        matches += [Match(x, y) for x, y in zip(a, b)]
    used = {id(m.measured) for m in matches} | {id(m.predicted) for m in matches}
    rest_m, rest_p = [s for s in ms if id(s) not in used], [s for s in ps if id(s) not in used]
    matches += [Match(x, y) for x, y in zip(rest_m, rest_p)]
    n = min(len(rest_m), len(rest_p))
    return matches, rest_m[n:], rest_p[n:]


def compare(measured: str, predicted: str) -> Comparison:
    """Match the spans of the trace ``measured`` with those of the plan ``predicted``; `TraceError` when either is
    not what its place needs (see `check_pair`) or nothing matches."""
    m_trace, p_trace = read_trace(measured), read_trace(predicted)
    check_pair(m_trace, p_trace)
    ms, ps = m_trace.spans, p_trace.spans
    by_key: Dict[Key, Tuple[List[TraceSpan], List[TraceSpan]]] = {}
    for s in ms:
        by_key.setdefault(s.key, ([], []))[0].append(s)
    for s in ps:
        by_key.setdefault(s.key, ([], []))[1].append(s)
    matches: List[Match] = []
    only_m: List[TraceSpan] = []
    only_p: List[TraceSpan] = []
    for a, b in by_key.values():
        got, left_m, left_p = _pair(a, b)
        matches += got
        only_m += left_m
        only_p += left_p
    if not matches:
        raise TraceError(f"{measured}: no span matches one of {predicted} by (rank, stream, name, mb, layer)")
    matches.sort(key=lambda m: (str(m.measured.rank), m.measured.start))
    return Comparison(measured, predicted, matches, only_m, only_p, _length(ms), _length(ps))


def _ms(x: float) -> str:
    return f"{x * 1e3:10.3f}"


def _label(s: TraceSpan) -> str:
    where = " ".join(f"{k}{v}" for k, v in (("mb", s.mb), ("L", s.layer)) if v is not None)
    return f"{s.name} ({s.kind}) {where} @{s.stream}".replace("  ", " ")


def render(c: Comparison) -> str:
    """The comparison as text: per operation measured and predicted duration and start, then the top drifts."""
    lines = [f"measured {c.measured} against the plan {c.predicted}",
             f"length: measured {c.measured_s * 1e3:.3f} ms, predicted {c.predicted_s * 1e3:.3f} ms"
             + (f" (measured / predicted {c.measured_s / c.predicted_s:.2f}x)" if c.predicted_s > 0 else ""),
             f"{'rank':<6} {'operation':<44} {'measured ms':>11} {'planned ms':>11} {'start ms':>10} "
             f"{'planned':>10}  (starts from the rank's first span)"]
    for m in c.matches:
        a, b = m.measured, m.predicted
        lines.append(f"{str(a.rank):<6} {_label(a):<44} {_ms(a.duration):>11} {_ms(b.duration):>11} "
                     f"{_ms(a.start)} {_ms(b.start)}")
    for what in ("duration", "start"):
        lines.append(f"largest {what} drift (measured - planned):")
        for m in c.top(what):
            d = m.duration_drift if what == "duration" else m.start_drift
            lines.append(f"  rank {m.measured.rank} {_label(m.measured)}: {d * 1e3:+.3f} ms")
    if c.only_measured or c.only_predicted:
        lines.append(f"unmatched: {len(c.only_measured)} measured span(s), {len(c.only_predicted)} planned span(s)")
    return "\n".join(lines)


def _span_json(s: Optional[TraceSpan]) -> Dict[str, Any]:
    return dataclasses.asdict(s) if s is not None else {}


def _match_json(m: Match) -> Dict[str, Any]:
    a, b = m.measured, m.predicted
    return {"rank": a.rank, "stream": a.stream, "name": a.name, "kind": a.kind, "mb": a.mb, "layer": a.layer,
            "measured_start_s": a.start, "measured_s": a.duration, "predicted_start_s": b.start,
            "predicted_s": b.duration, "duration_drift_s": m.duration_drift, "start_drift_s": m.start_drift}


def as_json(c: Comparison) -> Dict[str, Any]:
    """The comparison as JSON: the same figures as `render`."""
    return {"measured": c.measured, "plan": c.predicted, "measured_s": c.measured_s, "predicted_s": c.predicted_s,
            "operations": [_match_json(m) for m in c.matches],
            "top_duration_drift": [_match_json(m) for m in c.top("duration")],
            "top_start_drift": [_match_json(m) for m in c.top("start")],
            "only_measured": [_span_json(s) for s in c.only_measured],
            "only_planned": [_span_json(s) for s in c.only_predicted]}
