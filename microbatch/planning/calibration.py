"""Calibration: what each operation of a model costs on this machine, as a function of its token count.

`calibrate` runs the model's layers serially through the executor (overlap on, `microbatch.serial`)
at a few token counts, records each run on a `Timeline`, and fits:

- per operation (by name and whether its layer is MoE, and per layer), ``cost(tokens) = a + b * tokens``
  seconds of work, by least squares clamped to >= 0. A communication operation's cost is its host
  part: its span less the collectives inside it;
- per communication operation, its collectives in order, the bytes each moves (``a + b * tokens``)
  and whether the host reads it back (the dispatch's count exchange), in the same operation or in the
  next one (the dispatch in two steps: ``dispatch`` reads what ``dispatch_counts`` issued), and what each
  takes beyond the interconnect's time per token of its launch (`TransferFit`: the ranks' drift);
- the executor's own host overhead per operation: the median gap between consecutive operations;
- the interconnect, ``latency + bytes * seconds_per_byte``: the simulated link in use
  (`overlap.current_link`, CPU path) plus what a collective costs beyond it, from a sweep of
  `overlap.all_to_all_single` sizes (on a device, the sweep is the whole cost);
- CPU path only: the host time an asynchronous collective takes from the compute it completes
  under (`microbatch.planning.probes.contention`): gloo's threads finish it on the cores that compute;
- CPU path only: the host time to issue an asynchronous collective, beyond what a synchronous
  call spends outside its span (timed in `contention` and `sweep`);
- CPU path only: how late an asynchronous collective completes on a busy host (`probes.notice`): after
  a wait that begins once its link time ran out under compute, and beyond its link time while
  another rank still computes;
- the frame: each serial run is the whole prefill as the launcher runs it (embedding to final
  norm), timed; what lies outside the executor's launches is fitted ``a + b * tokens``.

The result is a `Calibration` (JSON), cached per machine, model shape, dtype, link and settings
in ``$OVERLAP_CALIBRATION_CACHE`` (default ``~/.cache/npu-overlap/calibration/``). Every rank of the
group runs the same collectives in the same order, and every rank ends with the same numbers:
the element-wise maximum over the ranks. `Calibration.cost_model` feeds `microbatch.planning.simulation`;
`predict_mode` predicts one mode's prefill for given micro-batch token counts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import socket
import statistics
import tempfile
import time
import zlib
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist

import overlap
from overlap import Span, Timeline, backends
from overlap.host_memory import freed_memory_setting, keep_on_host_path

from ..batch import Batch
from ..forward import run_schedule, serial_split
from ..model import MoEModel
from ..operations import Operation
from ..schedules import Schedule, serial
from ..split import Split
from .probes import PEER_QUANTILES, barrier, contention_fit, grouped, max_over_ranks, notice, sweep
from .simulation import CostModel, Interconnect, Linear, OpCost, Prediction, Transfer, predict

logger = logging.getLogger(__name__)

ENV_CACHE = "OVERLAP_CALIBRATION_CACHE"
DEFAULT_CACHE = os.path.join("~", ".cache", "npu-overlap", "calibration")
FORMAT = 12  # 2: link booked at issue (overlap.link); 3: waits; 5: contention per byte; 6: issue, notice, frame;
# 7: the CPU path's comm threads real-time (overlap.comm_threads), in the key; 8: read_at (a count exchange
# read by the next operation); 9: contention one collective at a time, notice as the host's wait; 10: residual
# `fit_residual` fits: the smallest token counts that split in two, how many, and each one's timed rounds;
# 11: a link's unobserved completions run no callback (overlap.link.DelayedWork): less contention to measure;
# 12: each collective's wait fitted through the origin (`_drift`), no residual, the runs in rounds over the counts
# A layer keeps its own fit where it differs from its group's at the largest token count by more than this.
LAYER_REL, LAYER_ABS_S = 0.5, 10e-6

# What a prediction reads of a model: its layers' operations (`MoEModel.layer_operations`), or those lists
ModelOrLayers = Union[MoEModel, Sequence[Sequence[Operation]]]
# A calibration's key and its cache file are JSON: typed Any (whatever json.load gives back; `check_cached`
# checks what a file holds)


# ---- the result --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpFit:
    """Seconds of work of operation ``op`` in MoE (``moe``) or dense layers: ``a + b * tokens``."""

    op: str
    moe: bool
    a: float
    b: float
    layer: Optional[int] = None  # set: this layer's own fit

    @property
    def cost(self) -> Linear:
        return Linear(self.a, self.b)


@dataclasses.dataclass(frozen=True)
class TransferFit:
    """Collective ``name`` inside operation ``op``: ``a + b * tokens`` bytes; ``blocking``: read on the host,
    by ``op`` itself or (``read_at``) by the operation of that name that follows it;
    ``wait_s + wait_per_token * tokens``: what it takes beyond the interconnect's time for its bytes,
    mostly waiting for the slower rank, which drifts further from the faster one over longer compute.
    `fit_runs` fits it through the origin (``wait_s`` 0): an intercept fitted to serial runs would charge
    every micro-batch's exchange a whole batch's drift (see `_drift`)."""

    op: str
    moe: bool
    name: str
    a: float
    b: float
    blocking: bool
    wait_s: float = 0.0
    wait_per_token: float = 0.0
    read_at: str = ""


def _interconnect(link: Optional[Mapping[str, float]], collective: Tuple[float, float]) -> Interconnect:
    """The simulated ``link`` (gbps, latency_us; None: none) plus a collective's own cost ``a + b * bytes``."""
    latency, per_byte = collective
    if link:
        latency += link["latency_us"] * 1e-6
        per_byte += 1.0 / (link["gbps"] * 1e9)
    return Interconnect(max(0.0, latency), max(0.0, per_byte))


@dataclasses.dataclass
class Calibration:
    """The fitted costs of one model on one machine (see the module docstring); JSON via `to_dict`."""

    key: Dict[str, Any]  # JSON: `calibration_key`
    layers: List[bool]  # whether each layer is MoE
    ops: List[OpFit]  # per (op, moe), all layers of that kind pooled
    layer_ops: List[OpFit]  # per (op, layer)
    transfers: List[TransferFit]  # per (op, moe), in issue order
    host_overhead_s: float
    tokens: List[int]  # the token counts measured
    link: Optional[Dict[str, float]] = None  # the simulated link (gbps, latency_us) the runs used
    collective: Tuple[float, float] = (0.0, 0.0)  # seconds per collective beyond the link: a + b * bytes
    elapsed_s: float = 0.0
    async_host_s: float = 0.0  # CPU path: host time an asynchronous collective takes from compute (`probes`)
    async_host_per_byte: float = 0.0  # ... and per byte it moves
    async_issue_s: float = 0.0  # CPU path: host time to issue an asynchronous collective, beyond a synchronous one's
    async_issue_per_byte: float = 0.0
    async_notice_s: float = 0.0  # CPU path: `probes.notice`'s busy
    async_peer_s: List[float] = dataclasses.field(default_factory=list)  # CPU path: `probes.notice`'s peer quantiles
    frame: Tuple[float, float] = (0.0, 0.0)  # seconds outside the executor's launches per prefill: a + b * tokens

    @property
    def interconnect(self) -> Interconnect:
        """The link plus a collective's own cost."""
        return _interconnect(self.link, self.collective)

    def op_cost(self, layer: int, op: str) -> Linear:
        """The work of ``op`` in ``layer``: the layer's own fit where it differs from its kind's (see `LAYER_REL`)."""
        moe = self.layers[layer]
        group = next((f.cost for f in self.ops if f.op == op and f.moe == moe), None)
        own = next((f.cost for f in self.layer_ops if f.op == op and f.layer == layer), None)
        if group is None or own is None:
            return own or group or Linear()
        n = max(self.tokens, default=0)
        g, o = group(n), own(n)
        return own if abs(o - g) > max(LAYER_REL * g, LAYER_ABS_S) else group

    def cost_model(self) -> CostModel:
        """The costs as `microbatch.planning.simulation` takes them, for every calibrated layer."""
        per_layer: Dict[Tuple[int, str], OpCost] = {}
        names = {(f.op, f.layer) for f in self.layer_ops}
        for op, layer in sorted(names, key=lambda k: (k[1], k[0])):
            moe = self.layers[layer]
            transfers = tuple(Transfer(t.name, Linear(t.a, t.b), t.blocking, t.wait_s, t.wait_per_token, t.read_at)
                              for t in self.transfers if t.op == op and t.moe == moe)
            per_layer[layer, op] = OpCost(self.op_cost(layer, op), transfers)
        by_name: Dict[str, OpCost] = {}
        for (layer, op), cost in per_layer.items():  # for other layers: the MoE layers' cost first
            if op not in by_name or self.layers[layer]:
                by_name[op] = cost
        return CostModel(by_name, self.interconnect, self.host_overhead_s, per_layer=per_layer,
                         async_host_s=self.async_host_s,
                         async_host_per_byte=self.async_host_per_byte,
                         async_issue_s=self.async_issue_s, async_issue_per_byte=self.async_issue_per_byte,
                         async_notice_s=self.async_notice_s, async_peer_s=tuple(self.async_peer_s),
                         frame=Linear(*self.frame))

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Calibration":
        d = dict(data)
        d["ops"] = [OpFit(**f) for f in d["ops"]]
        d["layer_ops"] = [OpFit(**f) for f in d["layer_ops"]]
        d["transfers"] = [TransferFit(**t) for t in d["transfers"]]
        d["collective"] = tuple(d["collective"])
        d["frame"] = tuple(d.get("frame", (0.0, 0.0)))
        return cls(**d)

    # the numbers every rank agrees on, flat, and back
    def values(self) -> List[float]:
        out: List[float] = []
        for f in self.ops + self.layer_ops:
            out += [f.a, f.b]
        for t in self.transfers:
            out += [t.a, t.b, float(t.blocking), t.wait_s, t.wait_per_token]
        return out + [self.host_overhead_s, *self.collective, self.elapsed_s, self.async_host_s,
                      self.async_host_per_byte, self.async_issue_s, self.async_issue_per_byte, *self.frame,
                      self.async_notice_s, *self.async_peer_s]

    def with_values(self, values: Sequence[float]) -> "Calibration":
        it = iter(values)
        ops = [dataclasses.replace(f, a=next(it), b=next(it)) for f in self.ops]
        layer_ops = [dataclasses.replace(f, a=next(it), b=next(it)) for f in self.layer_ops]
        transfers = [dataclasses.replace(t, a=next(it), b=next(it), blocking=next(it) > 0.5, wait_s=next(it),
                                         wait_per_token=next(it))
                     for t in self.transfers]
        host, ca, cb, elapsed, contended, per_byte, issue, issue_per_byte, fa, fb, notice, *peer = it
        return dataclasses.replace(self, ops=ops, layer_ops=layer_ops, transfers=transfers, host_overhead_s=host,
                                   collective=(ca, cb), elapsed_s=elapsed, async_host_s=contended,
                                   async_host_per_byte=per_byte, async_issue_s=issue,
                                   async_issue_per_byte=issue_per_byte, frame=(fa, fb), async_notice_s=notice,
                                   async_peer_s=sorted(peer))

    def structure(self) -> str:
        """What must be the same on every rank for `values` to line up."""
        parts = [(f.op, f.moe, f.layer) for f in self.ops + self.layer_ops]
        parts += [(t.op, t.moe, t.name, t.read_at) for t in self.transfers]
        return json.dumps([self.layers, parts, len(self.async_peer_s)])


# ---- fitting -----------------------------------------------------------------------------------


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


def _outside(swept: Sequence[Tuple[int, float, float]]) -> Linear:
    """Host seconds of a synchronous collective's call outside its span, by bytes (from `probes.sweep`): the
    serial runs count them in the operation's own work."""
    return _fit_by_size((n, max(0.0, call - span)) for n, span, call in swept)


# ---- the cache ---------------------------------------------------------------------------------


def cache_dir(path: Optional[str] = None) -> str:
    """Where calibrations are kept: ``path``, else ``$OVERLAP_CALIBRATION_CACHE``, else the default."""
    return os.path.expanduser(path or os.environ.get(ENV_CACHE) or DEFAULT_CACHE)


def _canonical(key: Mapping[str, Any]) -> str:
    return json.dumps(key, sort_keys=True, default=str)


def cache_file(key: Mapping[str, Any], directory: Optional[str] = None) -> str:
    """The file of the calibration whose key is ``key``."""
    digest = hashlib.sha256(_canonical(key).encode()).hexdigest()[:24]
    return os.path.join(cache_dir(directory), f"{digest}.json")


def load(key: Mapping[str, Any], directory: Optional[str] = None,
         model: Optional[MoEModel] = None) -> Optional[Calibration]:
    """The cached calibration of ``key``, or None (none there, another key, unreadable, or holding what a
    calibration cannot: `check_cached`; with ``model``, also one whose layers or operations are not the
    model's). A file that is there but not usable is named in a warning."""
    path = cache_file(key, directory)
    data = read_cache(path)
    if data is None:
        return None
    if data.get("format") != FORMAT or _canonical(data.get("key", {})) != _canonical(key):
        return None  # another format or key (a digest shared by chance): not this calibration, nothing wrong
    try:
        cal = check_cached(data, key)
        if model is not None:
            _check_model(cal, model)
    except ValueError as e:
        logger.warning("ignoring the calibration %s: %s; measuring again", path, e)
        return None
    return cal


# ---- checking a cached calibration -------------------------------------------------------------


def check_cached(data: Any, key: Mapping[str, Any]) -> Calibration:
    """The `Calibration` a cache file's JSON ``data`` holds for ``key``, checked; ValueError saying what no
    calibration can hold: another structure, a value that is not a finite number (or one below what a fit
    gives: costs, sizes and times are >= 0), lengths that do not agree (layers, token counts, quantiles)."""
    if not isinstance(data, dict):
        raise ValueError(f"it holds {_json_kind(data)}, not an object with a calibration")
    if data.get("format") != FORMAT or _canonical(data.get("key", {})) != _canonical(key):
        raise ValueError("it holds another key or format")
    raw = data.get("calibration")
    if not isinstance(raw, dict):
        raise ValueError(f"its 'calibration' is {_json_kind(raw)}, not an object")
    fields = {f.name: f for f in dataclasses.fields(Calibration)}
    unknown = sorted(set(raw) - set(fields))
    missing = sorted(n for n, f in fields.items() if n not in raw)
    if unknown or missing:
        raise ValueError("its calibration has " + ", ".join(
            ([f"unknown fields {unknown}"] if unknown else []) + ([f"no {missing}"] if missing else [])))
    if _canonical(raw["key"]) != _canonical(key):
        raise ValueError("its calibration holds another key than the file")
    layers = _list(raw["layers"], "layers")
    if not layers or not all(isinstance(m, bool) for m in layers):
        raise ValueError(f"'layers' is {raw['layers']!r}, not a non-empty list of true / false")
    ops = [_op_fit(f, f"ops[{i}]", None) for i, f in enumerate(_list(raw["ops"], "ops"))]
    layer_ops = [_op_fit(f, f"layer_ops[{i}]", layers) for i, f in enumerate(_list(raw["layer_ops"], "layer_ops"))]
    transfers = [_transfer_fit(t, f"transfers[{i}]") for i, t in enumerate(_list(raw["transfers"], "transfers"))]
    kinds = {(f.op, f.moe) for f in ops}
    for what, names in (("ops", [(f.op, f.moe) for f in ops]), ("layer_ops", [(f.op, f.layer) for f in layer_ops]),
                        ("transfers", [(t.op, t.moe, t.name) for t in transfers])):
        if len(set(names)) != len(names):
            raise ValueError(f"'{what}' holds an entry twice")
    if {(f.op, f.moe) for f in layer_ops} != kinds:
        raise ValueError("'ops' and 'layer_ops' name different operations: they are fitted from the same runs")
    if any((t.op, t.moe) not in kinds for t in transfers):
        raise ValueError("'transfers' name an operation 'ops' does not have")
    tokens = _list(raw["tokens"], "tokens")
    if tokens != list(key.get("tokens", tokens)) or not all(isinstance(n, int) and n >= 1 for n in tokens):
        raise ValueError(f"'tokens' is {tokens!r}, not the token counts of its key {key.get('tokens')!r}")
    link = raw["link"]
    if _canonical(link) != _canonical(key.get("link")):
        raise ValueError(f"'link' is {link!r}, not the link of its key {key.get('link')!r}")
    pair = {name: [_number(v, f"{name}[{i}]") for i, v in enumerate(_list(raw[name], name))]
            for name in ("collective", "frame")}
    if any(len(v) != 2 for v in pair.values()):
        raise ValueError("'collective' and 'frame' must each hold 2 numbers (a + b * x)")
    peer = [_number(v, f"async_peer_s[{i}]") for i, v in enumerate(_list(raw["async_peer_s"], "async_peer_s"))]
    if len(peer) not in (0, PEER_QUANTILES) or peer != sorted(peer):
        raise ValueError(f"'async_peer_s' holds {len(peer)} value(s), not 0 or {PEER_QUANTILES} in increasing order")
    scalars = {name: _number(raw[name], name) for name in ("host_overhead_s", "elapsed_s", "async_host_s",
                                                           "async_host_per_byte", "async_issue_s",
                                                           "async_issue_per_byte", "async_notice_s")}
    return Calibration(dict(raw["key"]), list(layers), ops, layer_ops, transfers, tokens=list(tokens),
                       link=None if link is None else dict(link), collective=tuple(pair["collective"]),
                       frame=tuple(pair["frame"]), async_peer_s=peer, **scalars)


def _check_model(cal: Calibration, model: MoEModel) -> None:
    """ValueError unless ``cal``'s layers and operations are ``model``'s (a cache of this key is of this
    model's shape; this catches a file edited, or written by another version of a layer)."""
    layers = model.layer_operations()
    moe = [_is_moe(model, i) for i in range(len(layers))]
    if cal.layers != moe:
        raise ValueError(f"its layers (MoE: {cal.layers}) are not the model's ({moe})")
    for f in cal.layer_ops:
        if f.op not in {op.name for op in layers[f.layer]}:
            raise ValueError(f"layer {f.layer} has no operation {f.op!r}")


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _list(value: Any, what: str) -> List[Any]:
    if not isinstance(value, list):
        raise ValueError(f"'{what}' is {_json_kind(value)}, not a list")
    return value


def _number(value: Any, what: str, low: Optional[float] = 0.0) -> float:
    """``value`` as a float: a finite JSON number (not a boolean), at least ``low`` (None: any)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"'{what}' is {value!r}, not a number")
    try:
        value = float(value)
    except OverflowError:  # an integer of hundreds of digits
        value = math.inf
    if not math.isfinite(value):
        raise ValueError(f"'{what}' is {value}, not a finite number")
    if low is not None and value < low:
        raise ValueError(f"'{what}' is {value}, below {low:g}: no measurement gives that")
    return value


def _entry(value: Any, what: str, cls: type) -> Dict[str, Any]:
    """A JSON object with exactly the fields of the dataclass ``cls`` (those with a default may be left out)."""
    if not isinstance(value, dict):
        raise ValueError(f"'{what}' is {_json_kind(value)}, not an object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    needed = {n for n, f in fields.items() if f.default is dataclasses.MISSING}
    if set(value) - set(fields) or needed - set(value):
        raise ValueError(f"'{what}' has the fields {sorted(value)}, not those of a {cls.__name__} {sorted(fields)}")
    for name in ("op", "name"):
        if name in fields and not (isinstance(value[name], str) and value[name]):
            raise ValueError(f"'{what}.{name}' is {value[name]!r}, not a name")
    for name in ("moe", "blocking"):
        if name in fields and not isinstance(value[name], bool):
            raise ValueError(f"'{what}.{name}' is {value[name]!r}, not true / false")
    return value


def _op_fit(value: Any, what: str, layers: Optional[List[bool]]) -> OpFit:
    d = _entry(value, what, OpFit)
    layer = d.get("layer")
    if layers is None and layer is not None:
        raise ValueError(f"'{what}.layer' is {layer!r}: a fit of every layer of a kind has none")
    if layers is not None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(layers):
            raise ValueError(f"'{what}.layer' is {layer!r}, not a layer of the {len(layers)} in 'layers'")
        if d["moe"] != layers[layer]:
            raise ValueError(f"'{what}.moe' is {d['moe']}, but 'layers' says layer {layer} is "
                             f"{'' if layers[layer] else 'not '}MoE")
    return OpFit(d["op"], d["moe"], _number(d["a"], f"{what}.a"), _number(d["b"], f"{what}.b"), layer)


def _transfer_fit(value: Any, what: str) -> TransferFit:
    d = _entry(value, what, TransferFit)
    # a collective's wait beyond the interconnect may be less than the link's time: wait_s of either sign
    return TransferFit(d["op"], d["moe"], d["name"], _number(d["a"], f"{what}.a"), _number(d["b"], f"{what}.b"),
                       d["blocking"], _number(d.get("wait_s", 0.0), f"{what}.wait_s", None),
                       _number(d.get("wait_per_token", 0.0), f"{what}.wait_per_token"), _read_at(d, what))


def _read_at(d: Mapping[str, Any], what: str) -> str:
    read_at = d.get("read_at", "")
    if not isinstance(read_at, str):
        raise ValueError(f"'{what}.read_at' is {read_at!r}, not an operation's name")
    return read_at


def save(cal: Calibration, directory: Optional[str] = None) -> Optional[str]:
    """Write ``cal`` under its key (atomically); None, with a warning, where the cache cannot be written."""
    return write_cache(cache_file(cal.key, directory), {"format": FORMAT, "key": cal.key,
                                                        "calibration": cal.to_dict()})


def read_cache(path: str) -> Optional[Dict[str, object]]:
    """A cache file's JSON object; None where there is none, or, with a warning naming it, where it cannot be read
    or holds no JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        logger.warning("ignoring the unreadable calibration %s (%s): measuring again", path, e)
        return None
    if not isinstance(data, dict):
        logger.warning("ignoring the calibration %s (%s, not an object): measuring again", path, type(data).__name__)
        return None
    return data


def write_cache(path: str, data: Mapping[str, object]) -> Optional[str]:
    """Write ``data`` as JSON to the cache file ``path`` (atomically: a reader sees the old file or the new one);
    None, with a warning, where it cannot be written."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, default=str)
        os.replace(tmp, path)
        return path
    except OSError as e:
        logger.warning("cannot write the calibration cache %s (%s)", path, e)
        return None


def _config_fields(model: MoEModel) -> object:
    cfg = model.cfg
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    return repr(cfg)


def _device_name() -> str:
    backend = backends.current()
    if backend.device_type == "cpu":
        return platform.processor() or platform.machine()
    mod = getattr(torch, backend.device_type, None)
    getter = getattr(mod, "get_device_name", None)
    return str(getter()) if getter is not None else backend.device_type


def _model_dtype(model: MoEModel) -> torch.dtype:
    p = next(iter(model.parameters()), None)
    return p.dtype if p is not None else torch.float32


def _world(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def calibration_key(model: MoEModel, group: Optional[dist.ProcessGroup] = None, tokens: Sequence[int] = (),
                    repeats: int = 0, seq_len: int = 0) -> Dict[str, Any]:
    """What a calibration is valid for: machine, torch, path, ranks, model shape, dtype, link and settings."""
    link = overlap.current_link()
    key = {"format": FORMAT, "host": socket.gethostname(), "cpus": os.cpu_count(), "device": _device_name(),
            "torch": torch.__version__, "path": backends.current().name, "world": _world(group),
            "model": _config_fields(model), "dtype": str(_model_dtype(model)),
            "link": None if link is None else {"gbps": link.gbps, "latency_us": link.latency_us},
            "comm_priority": overlap.comm_priority() if backends.current().name == "cpu" else None,
            # measured with freed host memory kept or not (overlap.host_memory): the CPU path's calibrations differ
            "host_memory": freed_memory_setting() if backends.current().name == "cpu" else None,
            "tokens": [int(n) for n in tokens], "repeats": int(repeats), "seq_len": int(seq_len)}
    return json.loads(_canonical(key))  # as it reads back from the cache


# ---- measuring ---------------------------------------------------------------------------------


def token_points(max_tokens: int, points: int = 5, low: int = 32) -> List[int]:
    """``points`` token counts spread geometrically from ``low`` (or ``max_tokens`` if smaller) to ``max_tokens``.

    Geometric, so that small batches, whose cost is mostly the fixed part, are measured as well as
    the large ones.
    """
    if max_tokens < 1:
        raise ValueError(f"calibration needs max_tokens >= 1, got {max_tokens}")
    lo = min(low, max_tokens)
    if points <= 1 or lo == max_tokens:
        return [max_tokens]
    return sorted({round(lo * (max_tokens / lo) ** (i / (points - 1))) for i in range(points)})


class _Collectives:
    """An observer: the bytes of each collective as it starts, and those the host reads back right after,
    in the same operation or at the start of the next one (``read_at``: that operation's name)."""

    def __init__(self) -> None:
        self.nbytes: Dict[int, int] = {}
        self.blocking: Set[int] = set()
        self.read_at: Dict[int, str] = {}
        self._last: Optional[int] = None  # the last collective, while no other span has started since
        self._prior: Optional[int] = None  # the collective that ended the previous operation
        self._op = ""  # the operation running now

    def on_span_start(self, span: Span) -> None:
        if span.kind != "comm":
            self._prior, self._last, self._op = self._last, None, span.name
            return
        size = [sum(t.numel() * t.element_size() for t in ts) for ts in (span.reads, span.writes)]
        self.nbytes[span.id] = max(size)
        self._last, self._prior = span.id, None

    def on_event_synchronize(self, name: str) -> None:
        if self._last is not None:
            self.blocking.add(self._last)
        elif self._prior is not None:
            self.blocking.add(self._prior)
            self.read_at[self._prior] = self._op
            self._prior = None


def request_length(all_lens: Sequence[Sequence[int]]) -> int:
    """The request length to calibrate with for batches of these request lengths (one list per rank).

    Attention's work per token grows with its request's length, so a calibration in requests of
    another length mis-predicts it. The token-weighted mean, sum(len^2) / sum(len), is the length
    whose per-token attention equals the batches' on average (exact where the lengths are equal).
    """
    lens = [int(n) for rank in all_lens for n in rank if n > 0]
    total = sum(lens)
    return max(1, round(sum(n * n for n in lens) / total)) if total else 64


def _batch(model: MoEModel, tokens: int, seq_len: int, seed: int) -> Batch:
    lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    device = next(iter(model.parameters())).device
    return Batch.random(lens, model.cfg.vocab, seed=seed, device=device)


def _timed(model: MoEModel, layers: List[List[Operation]], batch: Batch, plan: Optional[Split] = None,
           make: Callable[..., Schedule] = serial) -> float:
    """One prefill as the launcher runs it (embedding to final norm), split as ``plan`` says (default: one batch)
    and scheduled by ``make``; its wall seconds."""
    t0 = time.perf_counter()
    run_schedule(model, batch, plan or serial_split(batch, "calibration"), layers, make)
    overlap.synchronize()
    return time.perf_counter() - t0


def _recorded(model: MoEModel, layers: List[List[Operation]], batch: Batch,
              group: Optional[dist.ProcessGroup]) -> Run:
    seen, tl = _Collectives(), Timeline()
    barrier(group)
    overlap.add_observer(seen)
    tl.start()
    try:
        wall = _timed(model, layers, batch)
    finally:
        tl.stop()
        overlap.remove_observer(seen)
    return Run(batch.seq.num_tokens, tl.spans, seen.nbytes, seen.blocking, wall, seen.read_at)


def _is_moe(model: MoEModel, index: int) -> bool:
    return bool(model.layers[index].is_moe)


def measure_costs(model: MoEModel, group: Optional[dist.ProcessGroup] = None,
                  tokens: Sequence[int] = (32, 64, 128, 256), repeats: int = 3, seq_len: int = 64) -> Calibration:
    """Measure this rank's calibration (a collective: every rank of ``group`` calls it with the same arguments)."""
    if backends.current().is_graph:
        raise ValueError(f"calibrate on an eager path: inside a compiled graph ({backends.current().name}) the "
                         f"launches are not seen one by one")
    t0 = time.perf_counter()
    rank = dist.get_rank(group) if grouped(group) else 0
    layers = model.layer_operations()
    with torch.no_grad(), overlap.enabled(True):
        for n in tokens:
            barrier(group)
            _timed(model, layers, _batch(model, n, seq_len, seed=rank))  # warm-up: agreement, buffers of this size
        # the repeats in rounds over the counts, so that a slow spell of a shared host raises every count a little
        # rather than a few counts much, which bends each fit's fixed part against its part per token
        runs = [_recorded(model, layers, _batch(model, n, seq_len, seed=1000 * rank + i), group)
                for i in range(repeats) for n in tokens]
        hidden = int(model.cfg.hidden)
        swept = sweep(group, sorted({1, *tokens}), hidden, _model_dtype(model), repeats)
        contended, issued = contention_fit(group, (max(1, min(tokens)), max(tokens)), hidden, _model_dtype(model),
                                           max(3, repeats))
        noticed, peer = notice(group, hidden, _model_dtype(model))
    link = overlap.current_link()
    used = None if link is None else {"gbps": link.gbps, "latency_us": link.latency_us}
    collective = fit_collective([(n, s) for n, s, _ in swept], link)
    # an asynchronous issue's host time beyond what a synchronous call spends outside its span (which
    # the serial runs count in the operation's own work)
    outside = _outside(swept)
    issue = (max(0.0, issued[0] - outside.a), max(0.0, issued[1] - outside.b))
    cal = fit_runs(runs, [_is_moe(model, i) for i in range(len(layers))], _interconnect(used, collective))
    cal = dataclasses.replace(cal, key=calibration_key(model, group, tokens, repeats, seq_len), link=used,
                              collective=collective, async_host_s=contended[0], async_host_per_byte=contended[1],
                              async_issue_s=issue[0], async_issue_per_byte=issue[1], async_notice_s=noticed,
                              async_peer_s=peer)
    cal.elapsed_s = time.perf_counter() - t0
    return cal


def agree(cal: Calibration, group: Any = None) -> Calibration:
    """The element-wise maximum of ``cal``'s numbers over the ranks of ``group`` (a collective).

    `overlap.agree` first checks that every rank holds the same structure (layers, numbers, operations
    and collectives) and only finite numbers, `RuntimeError` on every rank otherwise, naming each
    rank's value; a second all-reduce takes the maximum (a reduction, not an agreement: it is only
    checked to line up).
    """
    if not grouped(group):
        return cal
    numbers = cal.values()
    bad = sum(not math.isfinite(v) for v in numbers)
    checksum = f"{zlib.crc32(cal.structure().encode()):08x}"
    structure = {"the calibrated layers": len(cal.layers), "the calibrated numbers": len(numbers),
                 "the calibrated operations and collectives (a checksum)": checksum}
    overlap.agree(structure, overlap.GroupTransport(group, "calibrate.agree"),
                  problems=[f"its calibration holds {bad} NaN or infinite number(s)"] if bad else [],
                  hints=dict.fromkeys(structure, "every rank must pass the same model"), error=RuntimeError)
    return cal.with_values(max_over_ranks(numbers, group))


# what decides which collectives a measurement issues: every rank must pass the same
_COLLECTIVE_SETTINGS = ("world", "model", "dtype", "tokens", "repeats", "seq_len")


def _everyone_has(cached: Optional[Calibration], key: Mapping[str, Any],
                  group: Optional[dist.ProcessGroup]) -> Tuple[bool, bool]:
    """``(every rank found the calibration, the ranks' cached calibrations differ in structure)``: one
    all-reduce, which also checks that the settings agree."""
    if not grouped(group):
        return cached is not None, False
    tag = zlib.crc32(_canonical({k: key.get(k) for k in _COLLECTIVE_SETTINGS}).encode())
    shape = zlib.crc32(cached.structure().encode()) if cached is not None else 0
    missing, hi, lo, shape_hi, shape_lo = max_over_ranks([0 if cached is not None else 1, tag, -tag, shape, -shape],
                                                         group, torch.int64)
    if (hi, -lo) != (tag, tag):
        raise ValueError("the ranks asked for different calibrations (model, dtype, token counts, repeats or "
                         "request length differ): every rank must call calibrate with the same model and arguments")
    return missing == 0, missing == 0 and shape_hi != -shape_lo


def calibrate(model: MoEModel, group: Optional[dist.ProcessGroup] = None, *, max_tokens: int = 256, points: int = 5,
              repeats: int = 3, seq_len: int = 64, refresh: bool = False, cache: Optional[str] = None,
              report: Optional[Callable[[str], None]] = None) -> Calibration:
    """This machine's calibration of ``model`` over ``group``, from the cache when every rank has it.

    Measures at `token_points` ``(max_tokens, points)``, ``repeats`` runs each, in requests of
    ``seq_len`` tokens; ``refresh`` measures again whatever the cache holds; ``cache`` overrides
    the cache folder. A collective: every rank of ``group`` calls it with the same arguments, and
    every rank returns the same numbers. ``report`` is told, in a line, whether the numbers come
    from the cache (and its file) or are measured now.
    """
    tokens = token_points(max_tokens, points)
    key = calibration_key(model, group, tokens, repeats, seq_len)
    cached = None if refresh else load(key, cache, model)
    everyone, differ = _everyone_has(cached, key, group)
    if everyone and not differ:
        if report is not None:
            report(f"calibration: cached ({cache_file(key, cache)})")
        return agree(cached, group)
    if differ:  # each file is a calibration, but not of one model on every rank: none can be trusted
        logger.warning("ignoring the calibration %s: the ranks' cached files of this key differ in their "
                       "operations or collectives; measuring again on every rank", cache_file(key, cache))
    if report is not None:
        why = "refreshing" if refresh else "none cached for this machine and model" if cached is None else \
            "the ranks' cached files differ" if differ else "not cached on every rank"
        report(f"calibrating the operations and the interconnect ({why}; cached after this run in "
               f"{cache_file(key, cache)})")
    keep_on_host_path()
    cal = agree(measure_costs(model, group, tokens, repeats, seq_len), group)
    save(cal, cache)
    return cal


def layers_of(model: ModelOrLayers) -> Sequence[Sequence[Operation]]:
    """The layers' operations a prediction runs on: ``model.layer_operations()``, or ``model`` when it is the lists."""
    return model if isinstance(model, Sequence) else model.layer_operations()


def predict_mode(cal: Calibration, model: ModelOrLayers, mode: str, tokens: Sequence[int],
                 device: Optional[bool] = None) -> Prediction:
    """Predicted prefill of ``mode`` for micro-batches of ``tokens`` tokens each (one count for a serial mode).

    ``model`` is the model (its ``layer_operations()``) or the layers' operation lists; ``device``
    selects device semantics (default: where the current path runs compute off the host).
    """
    layers = layers_of(model)
    if device is None:
        device = backends.current().device_type != "cpu"
    return predict(mode, layers, list(tokens), cal.cost_model(), device=device)


__all__ = ["Calibration", "ENV_CACHE", "ModelOrLayers", "OpFit", "Run", "TransferFit", "agree", "cache_dir",
           "cache_file", "calibrate", "check_cached", "calibration_key", "request_length", "fit_collective",
           "fit_linear", "fit_runs", "layers_of", "load", "measure_costs", "predict_mode", "read_cache", "save",
           "token_points", "write_cache"]
