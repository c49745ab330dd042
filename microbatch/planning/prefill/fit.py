"""Fitting a prefill calibration: recorded serial runs and probe samples fitted into lines.

`fit_runs` reads the spans of serial prefills (`Run`: a `Timeline`'s spans of one run, with what an observer saw of
its collectives) and fits, per operation (pooled over the layers of its kind, and per layer), its seconds of work
``a + b * tokens`` over the medians of the repeats; per collective, its bytes and what it takes beyond the
interconnect per token of its launch (through the origin); the executor's host overhead per operation (the median
gap between launches); and the frame around the launches. `fit_collective` and `fit_outside` fit the probes' sweep
(`microbatch.planning.probes.sweep`) of a collective's cost by size. `fit_linear` is the least-squares line under
them all, clamped to what a cost can be.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import overlap
from overlap import Span

from ..simulation import Interconnect, Linear
from .calibration import Calibration, OpFit, TransferFit


def fit_linear(xs: Sequence[float], ys: Sequence[float], relative: bool = False) -> Linear:
    """Least-squares ``a + b * x`` through the points, clamped so that ``a, b >= 0``.

    ``relative``: minimise the errors relative to the mean ``y`` at each ``x`` rather than absolute
    ones, so that a few per cent of noise at the largest ``x`` does not swamp the intercept that
    small ``x`` rest on (points pooled from several layers keep equal weight at one ``x``).
    """
    if not xs:
        return Linear()
    at: Dict[float, List[float]] = {}
    for x, y in zip(xs, ys):
        at.setdefault(x, []).append(y)
    scale = {x: max(abs(sum(v) / len(v)), 1e-12) for x, v in at.items()}
    ws = [1.0 / scale[x] ** 2 if relative else 1.0 for x in xs]
    a, b, my = _least_squares(xs, ys, ws)
    if b < 0:
        return Linear(max(0.0, my), 0.0)
    if a < 0:  # through the origin instead
        sx2 = sum(k * x * x for k, x in zip(ws, xs))
        return Linear(0.0, max(0.0, sum(k * x * y for k, x, y in zip(ws, xs, ys)) / sx2) if sx2 > 0 else 0.0)
    return Linear(a, b)


@dataclasses.dataclass
class Run:
    """One recorded serial prefill: its token count, its spans, and what the observer saw of its collectives."""

    tokens: int
    spans: Sequence[Span]
    nbytes: Mapping[int, int] = dataclasses.field(default_factory=dict)  # comm span id -> bytes
    blocking: Set[int] = dataclasses.field(default_factory=set)  # comm span ids the host read back
    wall_s: Optional[float] = None  # the whole prefill, embedding to final norm: its frame is this less the launches'
    read_at: Mapping[int, str] = dataclasses.field(default_factory=dict)  # blocking ids read by the next operation


def _op_spans(spans: Sequence[Span]) -> List[Span]:
    """The executor's launches: spans with a layer that are not collectives nor nested in another such span."""
    cands = sorted((s for s in spans if s.kind != "comm" and s.end is not None and s.meta.get("layer") is not None),
                   key=lambda s: (s.start, -s.end))
    top: List[Span] = []
    for s in cands:
        if top and s.end <= top[-1].end and s.meta.get("layer") == top[-1].meta.get("layer"):
            continue
        top.append(s)
    return top


def _inside(comm: Span, op: Span) -> bool:
    return op.start <= comm.start <= op.end and comm.meta.get("layer") == op.meta.get("layer")


def _median_fit(samples: Mapping[Tuple[int, Optional[int]], List[float]], relative: bool = True) -> Linear:
    """Fit over per-(tokens, layer) medians: one slow repeat does not move the line."""
    points = [(k[0], statistics.median(v)) for k, v in sorted(samples.items())]
    return fit_linear([x for x, _ in points], [y for _, y in points], relative=relative)


Samples = Dict[Tuple[int, Optional[int]], List[float]]  # (tokens, layer or None) -> one value per repeat


@dataclasses.dataclass
class _Samples:
    """What the runs show, sorted for fitting."""

    group: Dict[Tuple[str, bool], Samples] = dataclasses.field(default_factory=dict)  # (op, moe)
    layer: Dict[Tuple[str, int], Samples] = dataclasses.field(default_factory=dict)  # (op, layer)
    sizes: Dict[Tuple[str, bool, str], Samples] = dataclasses.field(default_factory=dict)  # (op, moe, collective)
    spans: Dict[Tuple[str, bool, str], List[Tuple[int, float, float]]] = dataclasses.field(
        default_factory=dict)  # tokens, bytes, seconds
    order: Dict[Tuple[str, bool], List[str]] = dataclasses.field(default_factory=dict)  # collectives in issue order
    blocking: Set[Tuple[str, bool, str]] = dataclasses.field(default_factory=set)
    read_at: Dict[Tuple[str, bool, str], str] = dataclasses.field(default_factory=dict)
    gaps: List[float] = dataclasses.field(default_factory=list)
    frame: Samples = dataclasses.field(default_factory=dict)  # (tokens, None) -> wall time outside the launches

    def add_run(self, run: Run, moe_layers: Sequence[bool]) -> None:
        ops = _op_spans(run.spans)
        comms = [s for s in run.spans if s.kind == "comm" and s.end is not None]
        self.gaps += [max(0.0, nxt.start - prev.end) for prev, nxt in zip(ops, ops[1:])]
        if run.wall_s is not None and ops:
            inside = max(s.end for s in ops) - min(s.start for s in ops)
            self.frame.setdefault((run.tokens, None), []).append(max(0.0, run.wall_s - inside))
        for s in ops:
            li = int(s.meta["layer"])
            moe = bool(moe_layers[li])
            inner = [c for c in comms if _inside(c, s)]
            work = max(0.0, (s.end - s.start) - sum(c.end - c.start for c in inner))
            self.group.setdefault((s.name, moe), {}).setdefault((run.tokens, li), []).append(work)
            self.layer.setdefault((s.name, li), {}).setdefault((run.tokens, li), []).append(work)
            names = self.order.setdefault((s.name, moe), [])
            for c in inner:
                if c.name not in names:
                    names.append(c.name)
                key = (s.name, moe, c.name)
                self.sizes.setdefault(key, {}).setdefault((run.tokens, li), []).append(float(run.nbytes.get(c.id, 0)))
                self.spans.setdefault(key, []).append((run.tokens, float(run.nbytes.get(c.id, 0)), c.end - c.start))
                if c.id in run.blocking:
                    self.blocking.add(key)
                if c.id in run.read_at:
                    self.read_at[key] = run.read_at[c.id]


def fit_runs(runs: Sequence[Run], moe_layers: Sequence[bool], interconnect: Optional[Interconnect] = None
             ) -> Calibration:
    """Fit operation costs, transfer sizes and the host overhead from recorded serial runs (no key, no link);
    with ``interconnect``, also each collective's wait beyond it per token (`TransferFit.wait_per_token`)."""
    seen = _Samples()
    for run in runs:
        seen.add_run(run, moe_layers)

    def drift(key: Tuple[str, bool, str]) -> float:
        if interconnect is None or not seen.spans.get(key):
            return 0.0
        at: Dict[int, List[float]] = {}
        for tokens, n, sec in seen.spans[key]:
            at.setdefault(tokens, []).append(sec - interconnect.seconds(n))
        return _drift({x: statistics.median(v) for x, v in at.items()})

    ops = [OpFit(op, moe, *_ab(_median_fit(v))) for (op, moe), v in sorted(seen.group.items())]
    layer_ops = [OpFit(op, bool(moe_layers[li]), *_ab(_median_fit(v)), layer=li)
                 for (op, li), v in sorted(seen.layer.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
    transfers = [TransferFit(op, moe, name, *_ab(_median_fit(seen.sizes[op, moe, name], relative=False)),
                             (op, moe, name) in seen.blocking, wait_per_token=drift((op, moe, name)),
                             read_at=seen.read_at.get((op, moe, name), ""))
                 for (op, moe), names in sorted(seen.order.items()) for name in names]
    frame = _ab(_median_fit(seen.frame)) if seen.frame else (0.0, 0.0)
    return Calibration({}, [bool(m) for m in moe_layers], ops, layer_ops, transfers,
                       statistics.median(seen.gaps) if seen.gaps else 0.0, sorted({r.tokens for r in runs}),
                       frame=frame)


def _least_squares(xs: Sequence[float], ys: Sequence[float], ws: Sequence[float]) -> Tuple[float, float, float]:
    """Weighted least squares ``a + b * x``, unclamped: ``(a, b, weighted mean of y)``."""
    w = sum(ws)
    mx, my = sum(k * x for k, x in zip(ws, xs)) / w, sum(k * y for k, y in zip(ws, ys)) / w
    sxx = sum(k * (x - mx) ** 2 for k, x in zip(ws, xs))
    b = sum(k * (x - mx) * (y - my) for k, x, y in zip(ws, xs, ys)) / sxx if sxx > 0 else 0.0
    return my - b * mx, b, my


def _drift(points: Mapping[float, float]) -> float:
    """Least squares ``b * x`` through the points, ``b >= 0``: a collective's wait per token of its launch.

    The wait is the ranks' drift since they last met, which grows with the compute between; on 2 CPU
    ranks its fixed part, fitted to serial runs (and the largest of the ranks' fits), was 0.2-0.6 ms a
    collective, mostly one rank's noise, and charged to every micro-batch's exchange it predicted
    three and four micro-batches 11-27% too slow relative to serial at 64-256 tokens per rank."""
    xx = sum(x * x for x in points)
    return max(0.0, sum(x * y for x, y in points.items()) / xx) if xx else 0.0


def _ab(f: Linear) -> Tuple[float, float]:
    return f.a, f.b


def fit_collective(samples: Sequence[Tuple[int, float]], link: Optional[overlap.Link]) -> Tuple[float, float]:
    """A collective's cost beyond ``link`` from (bytes, seconds) samples: ``(a s, b s/byte)`` of the medians."""
    f = _fit_by_size((n, s - (link.seconds(n) if link is not None else 0.0)) for n, s in samples)
    return f.a, f.b


def _fit_by_size(samples: Iterable[Tuple[int, float]]) -> Linear:
    """`fit_linear` through the median per size of ``(bytes, value)`` samples."""
    by_size: Dict[int, List[float]] = {}
    for nbytes, value in samples:
        by_size.setdefault(nbytes, []).append(value)
    return fit_linear(list(by_size), [statistics.median(v) for v in by_size.values()])


def fit_outside(swept: Sequence[Tuple[int, float, float]]) -> Linear:
    """Host seconds of a synchronous collective's call outside its span, by bytes (from `probes.sweep`): the
    serial runs count them in the operation's own work."""
    return _fit_by_size((n, max(0.0, call - span)) for n, span, call in swept)


__all__ = ["Run", "fit_collective", "fit_linear", "fit_outside", "fit_runs"]
