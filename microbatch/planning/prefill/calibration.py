"""A prefill calibration: what each operation of a model costs on this machine, as data, and its cache file.

`microbatch.planning.prefill.measure` measures it (serial runs of the model at a few token counts, the link and the
busy host probed), `microbatch.planning.prefill.fit` fits it; what it holds:

- per operation (by name and whether its layer is MoE, and per layer), ``cost(tokens) = a + b * tokens``
  seconds of work (`OpFit`). A communication operation's cost is its host part: its span less the
  collectives inside it;
- per communication operation, its collectives in order, the bytes each moves (``a + b * tokens``), whether
  the host reads it back (in the same operation or, ``read_at``, in the next one), and what each takes beyond
  the interconnect's time per token of its launch (`TransferFit`: the ranks' drift);
- the executor's own host overhead per operation, the interconnect (the simulated link in use plus what a
  collective costs beyond it), the CPU path's host costs of an asynchronous collective (taken from the compute
  it completes under, to issue it, and how late a busy host notices it), and the frame: what a prefill spends
  outside the executor's launches, ``a + b * tokens``.

`Calibration.cost_model` gives the costs as `microbatch.planning.simulation` takes them; ``values`` and
``with_values`` its numbers flat, for the ranks' agreement. A calibration is kept as JSON in the calibration
cache (`microbatch.planning.cache`): ``save`` writes it, ``load`` reads it back, and `check_cached` checks that
a file holds what a calibration can (a file that does not is measured again).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..cache import FORMAT, cache_file, canonical, read_cache, write_cache
from ..probes import PEER_QUANTILES
from ..simulation import CostModel, Interconnect, Linear, OpCost, Transfer
from ...model import MoEModel

# The largest figures a cached calibration may hold: more is a bad edit (1e308), whose predictions would be inf.
MAX_SECONDS = 86400.0  # a time, or a time per token or byte: no operation of a calibration takes a day
MAX_BYTES = float(1 << 50)  # a collective's bytes, or bytes per token: a pebibyte

logger = logging.getLogger(__name__)

# A layer keeps its own fit where it differs from its group's at the largest token count by more than this.
LAYER_REL, LAYER_ABS_S = 0.5, 10e-6
# A calibration's key and its cache file are JSON: typed Any (whatever json.load gives back; `check_cached`
# checks what a file holds)


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
    every micro-batch's exchange a whole batch's drift (see `microbatch.planning.prefill.fit`)."""

    op: str
    moe: bool
    name: str
    a: float
    b: float
    blocking: bool
    wait_s: float = 0.0
    wait_per_token: float = 0.0
    read_at: str = ""


def interconnect_of(link: Optional[Mapping[str, float]], collective: Tuple[float, float]) -> Interconnect:
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
        return interconnect_of(self.link, self.collective)

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


def load(key: Mapping[str, Any], directory: Optional[str] = None,
         model: Optional[MoEModel] = None) -> Optional[Calibration]:
    """The cached calibration of ``key``, or None (none there, another key, unreadable, or holding what a
    calibration cannot: `check_cached`; with ``model``, also one whose layers or operations are not the
    model's). A file that is there but not usable is named in a warning."""
    path = cache_file(key, directory)
    data = read_cache(path)
    if data is None:
        return None
    if data.get("format") != FORMAT or canonical(data.get("key", {})) != canonical(key):
        return None  # another format or key (a digest shared by chance): not this calibration, nothing wrong
    try:
        cal = check_cached(data, key)
        if model is not None:
            _check_model(cal, model)
    except ValueError as e:
        logger.warning("ignoring the calibration %s: %s; measuring again", path, e)
        return None
    return cal


def save(cal: Calibration, directory: Optional[str] = None) -> Optional[str]:
    """Write ``cal`` under its key (atomically); None, with a warning, where the cache cannot be written."""
    return write_cache(cache_file(cal.key, directory), {"format": FORMAT, "key": cal.key,
                                                        "calibration": cal.to_dict()})


def check_cached(data: Any, key: Mapping[str, Any]) -> Calibration:
    """The `Calibration` a cache file's JSON ``data`` holds for ``key``, checked; ValueError saying what no
    calibration can hold: another structure, a value that is not a finite number (or one below what a fit
    gives: costs, sizes and times are >= 0), lengths that do not agree (layers, token counts, quantiles)."""
    if not isinstance(data, dict):
        raise ValueError(f"it holds {_json_kind(data)}, not an object with a calibration")
    if data.get("format") != FORMAT or canonical(data.get("key", {})) != canonical(key):
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
    if canonical(raw["key"]) != canonical(key):
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
    if canonical(link) != canonical(key.get("link")):
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
    moe = [bool(model.layers[i].is_moe) for i in range(len(layers))]
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


def _number(value: Any, what: str, low: Optional[float] = 0.0, high: float = MAX_SECONDS) -> float:
    """``value`` as a float: a finite JSON number (not a boolean), at least ``low`` (None: any) and at most
    ``high`` in magnitude (more is an edit that would predict inf, no measurement)."""
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
    if abs(value) > high:
        raise ValueError(f"'{what}' is {value:g}, above {high:g}: no measurement gives that")
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
    return TransferFit(d["op"], d["moe"], d["name"], _number(d["a"], f"{what}.a", high=MAX_BYTES),
                       _number(d["b"], f"{what}.b", high=MAX_BYTES),
                       d["blocking"], _number(d.get("wait_s", 0.0), f"{what}.wait_s", None),
                       _number(d.get("wait_per_token", 0.0), f"{what}.wait_per_token"), _read_at(d, what))


def _read_at(d: Mapping[str, Any], what: str) -> str:
    read_at = d.get("read_at", "")
    if not isinstance(read_at, str):
        raise ValueError(f"'{what}.read_at' is {read_at!r}, not an operation's name")
    return read_at


__all__ = ["LAYER_ABS_S", "LAYER_REL", "Calibration", "OpFit", "TransferFit", "check_cached", "interconnect_of", "load",
           "save"]
