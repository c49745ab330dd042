"""Measured against predicted: match two of this toolkit's Chrome traces span by span (``overlap-report --plan``).

Spans are matched by (rank, stream, name, micro-batch, layer); where a key holds several spans
(an operation and a collective of the same name), spans of the same kind pair first, each in
start order. Starts are relative to the first span of the same rank in each trace.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._traces import TraceError, _events, _load_json, _meta, _names, _slices
from .timeline import GENERATOR

Key = Tuple[Any, str, str, Any, Any]  # rank, stream, name, mb, layer


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


def read_spans(source: str) -> List[TraceSpan]:
    """The spans of a Chrome trace written by this toolkit; `TraceError` for anything else."""
    data = _load_json(source)
    events = _events(data, source)
    if _meta(data, "otherData").get("generator") != GENERATOR:
        raise TraceError(f"{source}: not a trace of this toolkit (no otherData.generator {GENERATOR!r}): --plan "
                         f"compares two traces written by overlap's save_chrome_trace")
    threads = _names(events, "thread_name")
    raw = []
    for e, s, t in _slices(events, source):
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
    return [dataclasses.replace(sp, start=sp.start - first[sp.rank], end=sp.end - first[sp.rank]) for sp in raw]


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
    """Match the spans of the trace ``measured`` with those of ``predicted``; `TraceError` when nothing matches."""
    ms, ps = read_spans(measured), read_spans(predicted)
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
