"""Predict a schedule's timeline and prefill time from a cost model, without running it (pure Python).

An event-driven simulation of the streams of one rank, in the executor's terms:

- one host thread issues the launches in schedule order, spending the cost model's host overhead
  before each;
- a launch waits for the launches it depends on across streams, the cross-stream edges the
  executor derives from the data flow (and the schedule's ordering intents);
- one operation at a time per stream; every transfer goes over one link, one transfer at a time
  (FIFO), taking ``latency + bytes * seconds_per_byte``;
- a host-blocking transfer (the dispatch's count exchange) blocks issuing until it completes: right
  after it is issued, or where a later operation of its micro-batch reads it (``Transfer.read_at``:
  the dispatch in two steps, whose second step reads the counts the first one issued).

CPU semantics (the default), as `overlap.backends.cpu` runs: compute runs inline on the host
thread whatever its stream, so the host is busy while it runs; an event wait blocks the host; a
collective on the main stream is synchronous, one on a side stream is asynchronous, and one of
those takes ``async_issue_s`` (plus ``async_issue_per_byte`` per byte) of host time to issue and,
if it ends while the host computes, ``async_host_s`` (plus ``async_host_per_byte`` for each byte
it moved) from that compute
(gloo's threads finish it on the same cores; a device has an engine of its own). A wait for an
asynchronous collective whose link time ran out while the host computed returns the cost model's
``async_notice_s`` after it begins (gloo's thread gets a core late); one that begins earlier
returns at the link time's end or ``async_peer_s`` after the issue, whichever is later, on
average over those quantiles (another rank may still compute). A launch that reads an earlier
launch's transfer (`Transfer.read_at`) on a side stream runs ahead on that stream's own thread, as
`overlap.issue_ahead` runs it: from when the read returns (as a wait begun at the transfer's issue),
its work and its transfers' issue run there and its transfers take the link then, the host's next
transfers wait until it has issued them, and the launch itself, in its place, only waits for that.
Its work still takes the cores: what of it falls inside the host's compute is added to that compute
(a host that waits meanwhile loses nothing). (Modelled in place instead, the link idled until the host
reached the reading launch: two-batch predicted 10-21% too slow relative to serial wherever the
link was slow, 2 CPU ranks, 256-4096 tokens per rank at 0.02 GB/s.) Device
semantics (``device=True``): every operation runs on its stream, the host only issues, and an
event wait makes the stream wait, not the host.

The predicted prefill time adds the cost model's ``frame``: the prefill's work outside the
launches (embedding, split, merge, final norm), a function of the batch's tokens.

Use `predict` for a schedule (or a mode's name) over layers, `simulate` for a schedule or a
`Lowering` (a lowered schedule) whose data flow you already have.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

from overlap import DEFAULT, Span

from ..lowering import Lowering
from ..schedules import HIDDEN, OUT, Flow, Layers, Schedule, ScheduledOp, normalize_layers, schedule_for, validate


@dataclasses.dataclass(frozen=True)
class Linear:
    """``a + b * tokens``, never below zero."""

    a: float = 0.0
    b: float = 0.0

    def __call__(self, tokens: float) -> float:
        return max(0.0, self.a + self.b * tokens)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One collective of a communication operation: its bytes per token count, and whether the host reads it."""

    name: str
    nbytes: Linear
    blocking: bool = False  # the host waits for it before issuing anything else (a count exchange)
    wait_s: float = 0.0  # beyond the link's time: waiting for the slower rank (may be < 0: less than the link)
    wait_per_token: float = 0.0  # ... and per token of the launch (the ranks drift apart over longer compute)
    read_at: str = ""  # blocking: the operation of its layer and micro-batch that reads it ("": its own, at once)

    def wait(self, tokens: int) -> float:
        return self.wait_s + self.wait_per_token * tokens


@dataclasses.dataclass(frozen=True)
class OpCost:
    """An operation's work in seconds (per token count) and, for communication, its transfers in order."""

    compute: Linear = Linear()
    transfers: Tuple[Transfer, ...] = ()

    @property
    def is_comm(self) -> bool:
        return bool(self.transfers)


@dataclasses.dataclass(frozen=True)
class Interconnect:
    """A transfer of ``n`` bytes takes ``latency_s + n * seconds_per_byte``."""

    latency_s: float = 0.0
    seconds_per_byte: float = 0.0

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + max(0.0, nbytes) * self.seconds_per_byte


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Costs by operation name (``per_layer`` overrides them for one layer), the link and the host overhead."""

    ops: Mapping[str, OpCost]
    link: Interconnect = Interconnect()
    host_overhead_s: float = 0.0  # the executor's own time per launch, on the host
    per_layer: Mapping[Tuple[int, str], OpCost] = dataclasses.field(default_factory=dict)
    async_host_s: float = 0.0  # CPU path: host time an asynchronous collective takes from the compute it ends in
    async_host_per_byte: float = 0.0  # ... and per byte it moves
    # CPU path: how long a wait for an asynchronous collective whose link time ran out while the host
    # computed takes to see it complete (gloo's thread must get a core the compute held)
    async_notice_s: float = 0.0
    # ... and, as quantiles, seconds from issue to completion while another rank still computes
    async_peer_s: Tuple[float, ...] = ()
    async_issue_s: float = 0.0  # CPU path: host time to issue an asynchronous collective (beyond a synchronous one)
    async_issue_per_byte: float = 0.0
    frame: Linear = Linear()  # the prefill's work outside these launches (embedding, split, merge, norm), by tokens

    def op(self, layer: int, name: str) -> OpCost:
        """The cost of operation ``name`` of layer ``layer``; `KeyError` when the model has none."""
        cost = self.per_layer.get((layer, name), self.ops.get(name))
        if cost is None:
            raise KeyError(f"the cost model has no cost for operation {name!r} (layer {layer}); "
                           f"it knows {', '.join(sorted(self.ops)) or 'none'}")
        return cost


@dataclasses.dataclass
class Prediction:
    """The predicted spans of rank 0 (seconds from the first launch) and the predicted prefill time: the
    launches' plus the cost model's ``frame`` (the work around them)."""

    spans: List[Span]
    total_s: float
    device: bool = False
    schedule: Optional[str] = None  # the predicted schedule's name, when it has one

    def save_chrome_trace(self, file: str) -> str:
        """Write the spans as a Chrome trace, comparable with a measured one (``overlap-report --plan``);
        the trace says it is a prediction, and of which schedule."""
        from overlap.observability import save_chrome_trace

        return save_chrome_trace(self.spans, file, prediction={"schedule": self.schedule, "total_s": self.total_s,
                                                               "device": self.device})


Source = Union[Schedule, Lowering]


def _shared_length(a: float, b: float, c: float, d: float) -> float:
    """The length of ``[a, b]`` inside ``[c, d]``."""
    return max(0.0, min(b, d) - max(a, c))


def _launches(source: Source) -> Tuple[ScheduledOp, ...]:
    if isinstance(source, Lowering):
        return tuple(s.scheduled for s in source.steps)
    return source.launches


def _lowering_edges(lowering: Lowering) -> List[Set[int]]:
    """The launches each step waits for through the lowering's events and ``wait_tensor`` edges."""
    last: Dict[str, int] = {}
    edges: List[Set[int]] = []
    for s in lowering.steps:
        edges.append({last[t] for t in s.waits if t in last} | set(s.after))
        if s.record:
            last[s.record] = s.index
    return edges


def cross_stream_edges(source: Source, flow: Flow) -> List[Tuple[int, ...]]:
    """Per launch, the earlier launches on other streams it must wait for.

    From the data flow (the writer of every value it reads), the schedule's ordering intents, and
    for a `Lowering` also its own event waits; edges within one stream are its order already.
    """
    launches = _launches(source)
    if len(launches) != len(flow.ops):
        raise ValueError(f"the flow has {len(flow.ops)} launches, the schedule {len(launches)}: "
                         f"pass the flow of this schedule")
    edges: List[Set[int]] = [set() for _ in launches]
    for i, reads in enumerate(flow.reads):
        for r in reads:
            for key in r.keys:
                w = flow.writer.get(key)
                if w is not None:
                    edges[i].add(w)
    if isinstance(source, Lowering):
        for i, extra in enumerate(_lowering_edges(source)):
            edges[i] |= extra
    else:
        for b, a in source.orders:
            edges[a].add(b)
    return [tuple(sorted(j for j in e if j < i and launches[j].stream != launches[i].stream))
            for i, e in enumerate(edges)]


class _Streams:
    """The simulated clocks: the host, each stream, the link; and the spans laid down so far."""

    def __init__(self, costs: CostModel, device: bool, main: str):
        self.costs, self.device, self.main = costs, device, main
        self.host = 0.0
        self.link_free = 0.0
        self.free: Dict[str, float] = defaultdict(float)
        self.spans: List[Span] = []
        self.in_flight: List[Tuple[float, float]] = []  # (end, bytes) of asynchronous transfers not yet charged
        self.pending: List[Tuple[float, float]] = []  # (issued, end) of the current launch's asynchronous transfers
        self.asynchronous: Dict[int, List[Tuple[float, float]]] = {}  # launch -> (issued, end) of those
        self.unread: Dict[Tuple[int, int, str], List[Tuple[float, float]]] = {}  # (mb, layer, reader) -> transfers
        # CPU path, (mb, layer, reader) -> its work run ahead: (start, end, its transfers' (issued, end))
        self.ahead: Dict[Tuple[int, int, str], Tuple[float, float, List[Tuple[float, float]]]] = {}
        self.ahead_until = 0.0  # the host's next transfers wait until the work run ahead has issued its own
        self.stolen: List[Tuple[float, float]] = []  # (start, end) of host work run ahead on a comm thread

    def completion(self, launch: int, done: float, wait_from: float) -> float:
        """When a wait for ``launch`` that begins at ``wait_from`` returns (CPU path): ``done``, or later
        for its asynchronous transfers: ``async_notice_s`` after ``wait_from`` for one whose link time
        ran out while the host was still computing; else its link time's end or, while another rank
        still computes, ``async_peer_s`` after its issue, on average over those quantiles."""
        out = done
        for issued, end in self.asynchronous.get(launch, ()):
            out = max(out, self._noticed(issued, end, wait_from))
        return out

    def _noticed(self, issued: float, end: float, wait_from: float) -> float:
        """When a host wait that begins at ``wait_from`` sees an asynchronous transfer (see `completion`)."""
        c = self.costs
        if wait_from > end:
            return wait_from + c.async_notice_s
        if c.async_peer_s:
            return sum(max(end, issued + x) for x in c.async_peer_s) / len(c.async_peer_s)
        return end

    def read_back(self, l: ScheduledOp, wait_from: float) -> float:
        """The host reads the transfers earlier launches left for ``l`` (`Transfer.read_at`): on the CPU path
        when the read returns (the launch is ready then), on a device the host waits and nothing else."""
        due = self.unread.pop((l.mb, l.layer, l.op), ())
        if self.device:
            self.host = max([self.host] + [end for _, end in due])
            return 0.0
        return max((self._noticed(issued, end, wait_from) for issued, end in due), default=0.0)

    def transfer(self, issued: float, stream: str, tr: Transfer, tokens: int, meta: Dict[str, Any]) -> float:
        """A transfer issued at ``issued`` on ``stream``: after the stream's and the link's earlier ones.

        It holds the link for the link's time; its wait (the slower rank's arrival) delays
        its end, not the transfers queued behind it."""
        start = max(issued, self.link_free, self.free[stream])
        self.link_free = start + self.costs.link.seconds(tr.nbytes(tokens))
        end = self.free[stream] = max(start, self.link_free + tr.wait(tokens))
        self.spans.append(Span(tr.name, stream, "comm", 0, issued, end, dict(meta),
                               asynchronous=not self.device and stream != self.main))
        return end

    def cpu_step(self, l: ScheduledOp, cost: OpCost, tokens: int, ready: float) -> float:
        """Compute inline on the host; a side stream's transfers run asynchronously. Returns when all is done."""
        meta = {"mb": l.mb, "layer": l.layer}
        self.host = max(self.host + self.costs.host_overhead_s, ready)  # an event wait blocks the host
        start = t = self.host
        t += self._contended(start, cost.compute(tokens))
        done = t
        c = self.costs
        if cost.transfers:
            t = max(t, self.ahead_until)
        for tr in cost.transfers:
            issued = t
            if l.stream != self.main:  # asynchronous: the host spends the issue, the transfer is under way
                t += c.async_issue_s + c.async_issue_per_byte * tr.nbytes(tokens)
            end = self.transfer(issued, l.stream, tr, tokens, meta)
            if l.stream != self.main and tr.blocking and tr.read_at and tr.read_at != l.op:
                self._run_ahead(l, tr, tokens, issued, end)
                self.in_flight.append((end, tr.nbytes(tokens)))
                self.pending.append((issued, end))
            elif l.stream == self.main or (tr.blocking and not self._read_later(l, tr, issued, end)):
                t = max(t, end)  # a synchronous collective, or one read on the host right away
            else:
                self.in_flight.append((end, tr.nbytes(tokens)))
                self.pending.append((issued, end))
            done = max(done, end, t)
        self._op_span(l, cost, start, t, meta)
        self.host = t
        return done

    def _run_ahead(self, l: ScheduledOp, tr: Transfer, tokens: int, issued: float, end: float) -> None:
        """The launch that reads ``tr`` (`Transfer.read_at`), run ahead on ``l``'s stream's thread once the read
        returns: its work, then each of its transfers issued (and booked on the link)."""
        c = self.costs
        cost = c.op(l.layer, tr.read_at)
        start = self._noticed(issued, end, issued)  # the thread waits for the read from the moment it is issued
        t = start + cost.compute(tokens)
        meta = {"mb": l.mb, "layer": l.layer}
        transfers = []
        for tr2 in cost.transfers:
            t += c.async_issue_s + c.async_issue_per_byte * tr2.nbytes(tokens)
            done = self.transfer(t, l.stream, tr2, tokens, meta)
            self.in_flight.append((done, tr2.nbytes(tokens)))
            transfers.append((t, done))
        self.ahead[(l.mb, l.layer, tr.read_at)] = (start, t, transfers)
        self.ahead_until = max(self.ahead_until, t)
        self.stolen.append((start, t))

    def collect_ahead(self, l: ScheduledOp, ready: float) -> Optional[float]:
        """A launch whose work ran ahead (`_run_ahead`): the host waits until it has issued its transfers;
        returns when all of it is done (None: it did not run ahead)."""
        run = self.ahead.pop((l.mb, l.layer, l.op), None)
        if run is None:
            return None
        start, issued, transfers = run
        self.host = max(self.host + self.costs.host_overhead_s, ready, issued)
        self.pending.extend(transfers)
        self._op_span(l, self.costs.op(l.layer, l.op), start, issued, {"mb": l.mb, "layer": l.layer})
        return max([issued] + [end for _, end in transfers])

    def _read_later(self, l: ScheduledOp, tr: Transfer, issued: float, end: float) -> bool:
        """Leave a transfer that a later launch reads on the host (`Transfer.read_at`) for `read_back`."""
        if not (tr.blocking and tr.read_at and tr.read_at != l.op):
            return False
        self.unread.setdefault((l.mb, l.layer, tr.read_at), []).append((issued, end))
        return True

    def _contended(self, start: float, work: float) -> float:
        """``work`` seconds of host compute from ``start``, plus what the asynchronous transfers that end
        meanwhile take from it (their completion runs on the same cores); one that ends while the host
        waits costs nothing."""
        c = self.costs
        if self.stolen:  # host work run ahead on a comm thread meanwhile takes the same cores
            end = start + work
            work += sum(_shared_length(a, b, start, end) for a, b in self.stolen)
            self.stolen = [(a, b) for a, b in self.stolen if b > end]
        if not (c.async_host_s or c.async_host_per_byte) or not self.in_flight:
            return work
        ended = [(e, n) for e, n in self.in_flight if e <= start + work]
        self.in_flight = [(e, n) for e, n in self.in_flight if e > start + work]
        return work + sum(c.async_host_s + c.async_host_per_byte * n for e, n in ended if e > start)

    def device_step(self, l: ScheduledOp, cost: OpCost, tokens: int, ready: float) -> float:
        """Everything on the stream; the host only issues, and waits for a host-blocking transfer."""
        meta = {"mb": l.mb, "layer": l.layer}
        self.host += self.costs.host_overhead_s
        start = max(self.host, self.free[l.stream], ready)
        t = self.free[l.stream] = start + cost.compute(tokens)
        for tr in cost.transfers:
            end = self.transfer(max(t, self.host), l.stream, tr, tokens, meta)
            t = end
            if tr.blocking and not self._read_later(l, tr, start, end):
                self.host = max(self.host, t)
        self._op_span(l, cost, start, t, meta)
        return t

    def _op_span(self, l: ScheduledOp, cost: OpCost, start: float, end: float, meta: Dict[str, Any]) -> None:
        kind = "issue" if cost.is_comm else "compute"  # as the executor labels its launches
        self.spans.append(Span(l.op, l.stream, kind, 0, start, end, dict(meta)))


def simulate(source: Source, flow: Flow, tokens: Sequence[int], costs: CostModel, *, device: bool = False,
             main: str = DEFAULT) -> Prediction:
    """Predict the timeline of ``source`` (a `Schedule` or a `Lowering`) whose data flow is ``flow``.

    ``tokens[mb]`` is micro-batch ``mb``'s token count; ``costs`` prices each operation;
    ``device`` selects device semantics instead of the CPU path's (see the module docstring);
    ``main`` is the stream whose collectives are synchronous on the CPU path.
    """
    launches = _launches(source)
    n_mb = 1 + max((l.mb for l in launches), default=-1)
    if len(tokens) < n_mb:
        raise ValueError(f"the schedule has {n_mb} micro-batches but {len(tokens)} token counts were given")
    edges = cross_stream_edges(source, flow)
    sim = _Streams(costs, device, main)
    step = sim.device_step if device else sim.cpu_step
    done: List[float] = []
    for i, l in enumerate(launches):
        wait_from = sim.host + costs.host_overhead_s
        ready = max((sim.completion(j, done[j], wait_from) for j in edges[i]), default=0.0)
        ready = max(ready, sim.read_back(l, wait_from))
        collected = None if device else sim.collect_ahead(l, ready)
        done.append(step(l, costs.op(l.layer, l.op), tokens[l.mb], ready) if collected is None else collected)
        if sim.pending:
            sim.asynchronous[i], sim.pending = sim.pending, []
    total = max([sim.host] + done) + costs.frame(sum(tokens[:n_mb]))
    spans = sorted(sim.spans, key=lambda s: (s.start, s.end))
    return Prediction(spans, total, device, source.name if isinstance(source, Schedule) else None)


def placeholder_inputs(layers: Layers, n_micro: int) -> List[Dict[str, Any]]:
    """Inputs for `validate` when only the data flow matters: every value the layers read and none writes."""
    layers = normalize_layers(layers)
    written = {w for ops in layers for op in ops for w in op.writes}
    names = {HIDDEN} | {r for ops in layers for op in ops for r in op.reads if r not in written}
    return [dict.fromkeys(sorted(names)) for _ in range(n_micro)]


def predict(schedule: Union[Schedule, str], layers: Layers, tokens: Sequence[int], costs: CostModel, *,
            inputs: Optional[Sequence[Mapping[str, Any]]] = None, device: bool = False,
            output: str = OUT) -> Prediction:
    """Predict ``schedule`` (or the schedule of the mode of that name) over ``layers`` for micro-batches
    of ``tokens`` tokens each; ``inputs`` (default: `placeholder_inputs`) and ``output`` only shape the
    data flow, as in `validate`."""
    layers = normalize_layers(layers)
    if isinstance(schedule, str):
        schedule = schedule_for(schedule, layers, len(tokens))
    inputs = list(inputs) if inputs is not None else placeholder_inputs(layers, len(tokens))
    flow = validate(schedule, layers, inputs, output)
    return simulate(schedule, flow, tokens, costs, device=device)


__all__ = ["CostModel", "Interconnect", "Linear", "OpCost", "Prediction", "Transfer", "cross_stream_edges",
           "placeholder_inputs", "predict", "simulate"]
