"""Schedules as data: the ordered launches of (micro-batch, layer, operation), their check, and the modes.

A `Schedule` lists `ScheduledOp` s in issue order; each names a micro-batch, a layer, an operation
of that layer and the stream it is placed on. ``orders`` are ordering intents without a data edge
(``(before, after)`` indices); the executor lowers them to ``wait_tensor`` where the graph orders
data edges itself (``ge``) and to events across streams elsewhere. The generators read each
layer's operation list by role: operations on `EP_COMM` are communication (the compute before
one is its producer), operations on `SHARED_EXPERT` are shared experts, everything else is compute.

`MODES` names the generators once, with the names the launcher, the JSON results and the traces
use: ``serial``, ``shared``, ``two-batch``, and the opt-in ``three-batch`` and ``four-batch``
(`Mode.in_all` is False: the launcher's ``--mode all`` leaves them out). `DECODE_MODES` adds the decode
steps' ``chunked-2`` .. ``chunked-4``: one batch, its MoE in K chunks (`chunked`). `AUTO` names no schedule:
it takes each prefill's or decode step's mode from a calibration (`microbatch.planning`).

Values flow by name: a layer starts with its micro-batch's inputs (``"hidden"`` at layer 0, any
context values at every layer) and layer ``L``'s ``"hidden"`` is layer ``L-1``'s ``"out"``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from overlap import DEFAULT, EP_COMM, SHARED_EXPERT

from .operations import FromMicroBatch, Operation, as_operation

HIDDEN = "hidden"  # a layer's input
OUT = "out"  # a layer's output, the next layer's "hidden"

# Where a value lives: ("in", mb, name) for an input, (mb, layer, name) for a value an operation wrote.
Key = Tuple[Any, ...]


class ScheduleError(ValueError):
    """A schedule that does not fit its layers (raised before anything is launched)."""


@dataclasses.dataclass(frozen=True)
class ScheduledOp:
    """One issue of an operation: micro-batch ``mb``'s operation ``op`` of layer ``layer`` on ``stream``."""

    mb: int
    layer: int
    op: str
    stream: str = DEFAULT

    def __str__(self) -> str:
        return f"mb{self.mb} L{self.layer} {self.op} @{self.stream}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Operations in issue order plus ordering intents ``(before, after)`` between their indices."""

    name: str
    launches: Tuple[ScheduledOp, ...]
    orders: Tuple[Tuple[int, int], ...] = ()

    def format(self) -> str:
        """One line per launch; ordering intents are shown as ``after #i``."""
        after: Dict[int, List[int]] = {}
        for b, a in self.orders:
            after.setdefault(a, []).append(b)
        lines = [f"schedule {self.name}: {len(self.launches)} launches"]
        for i, l in enumerate(self.launches):
            extra = f"  (after #{', #'.join(map(str, after[i]))})" if i in after else ""
            lines.append(f"{i:4d}  {l}{extra}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


Layers = Sequence[Sequence[Any]]


def normalize_layers(layers: Layers) -> List[List[Operation]]:
    """Each layer's operations as `Operation` s, checked: unique names, each value written once."""
    out: List[List[Operation]] = []
    for li, layer in enumerate(layers):
        ops = [as_operation(o) for o in layer]
        names: Dict[str, int] = {}
        writers: Dict[str, str] = {}
        for op in ops:
            if op.name in names:
                raise ScheduleError(f"layer {li} has two operations named {op.name!r}")
            names[op.name] = 1
            for w in op.writes:
                if w in writers:
                    raise ScheduleError(f"layer {li}: {writers[w]!r} and {op.name!r} both write {w!r}; "
                                        f"a value is written once")
                if w == HIDDEN:
                    raise ScheduleError(f"layer {li}: {op.name!r} writes {HIDDEN!r}, the layer's input")
                writers[w] = op.name
        out.append(ops)
    return out


@dataclasses.dataclass(frozen=True)
class Read:
    """Where one read of a launch comes from: the keys, and whether they are packed into a tuple."""

    name: str
    keys: Tuple[Key, ...]
    packed: bool = False
    fn: Optional[Callable[..., Any]] = None  # from `FromMicroBatch.fn`


@dataclasses.dataclass
class Flow:
    """The data flow of a checked schedule: per launch its reads; per key its writer and last reader."""

    ops: List[Operation]  # the operation of each launch
    reads: List[List[Read]]
    writer: Dict[Key, int]  # launch index that wrote the key
    last_read: Dict[Key, int]
    outputs: List[Key]  # per micro-batch, the key of its final value


def _resolve(mb: int, layer: int, name: str, inputs: Sequence[Mapping[str, Any]]) -> Read:
    if name == HIDDEN and layer > 0:
        return Read(name, ((mb, layer - 1, OUT),))
    if name in inputs[mb]:
        v = inputs[mb][name]
        if isinstance(v, FromMicroBatch):
            keys = tuple((m, layer, n) for m in v.mbs for n in v.names)
            return Read(name, keys, packed=len(keys) > 1, fn=v.fn)
        return Read(name, (("in", mb, name),))
    return Read(name, ((mb, layer, name),))


def _describe(key: Key) -> str:
    if key[0] == "in":
        return f"input {key[2]!r} of mb{key[1]}"
    return f"mb{key[0]}'s {key[2]!r} of layer {key[1]}"


def validate(schedule: Schedule, layers: Layers, inputs: Sequence[Mapping[str, Any]], output: str = OUT) -> Flow:
    """Check that ``schedule`` runs ``layers`` on micro-batches with ``inputs`` and return its data flow.

    Each micro-batch's result is the last layer's ``output`` (`OUT` by default).

    Every operation of every layer of every micro-batch is launched exactly once, each value is
    written before it is read (also across layers and micro-batches), no operation overwrites an
    input, and ordering intents point forward. Raises `ScheduleError` naming the first problem.
    """
    layers = normalize_layers(layers)
    n_mb, n_layers = len(inputs), len(layers)
    if n_mb == 0:
        raise ScheduleError("no micro-batches: pass one input mapping per micro-batch")
    by_name = [{op.name: op for op in ops} for ops in layers]
    for mb, inp in enumerate(inputs):
        for name, v in inp.items():
            bad = [m for m in v.mbs if not (0 <= m < n_mb and m != mb)] if isinstance(v, FromMicroBatch) else []
            if bad:
                raise ScheduleError(f"input {name!r} of mb{mb} refers to micro-batch {bad[0]}, which is not "
                                    f"another of the {n_mb} micro-batches")
    seen: Dict[Tuple[int, int, str], int] = {}
    ops: List[Operation] = []
    for i, l in enumerate(schedule.launches):
        if not (0 <= l.mb < n_mb and 0 <= l.layer < n_layers):
            raise ScheduleError(f"launch #{i} ({l}) is outside {n_mb} micro-batches x {n_layers} layers")
        op = by_name[l.layer].get(l.op)
        if op is None:
            raise ScheduleError(f"launch #{i} ({l}): layer {l.layer} has no operation {l.op!r} "
                                f"(it has {', '.join(by_name[l.layer])})")
        if (l.mb, l.layer, l.op) in seen:
            raise ScheduleError(f"launch #{i} ({l}) repeats launch #{seen[l.mb, l.layer, l.op]}")
        seen[l.mb, l.layer, l.op] = i
        ops.append(op)
    missing = [f"mb{mb} L{li} {op.name}" for li, lops in enumerate(layers) for mb in range(n_mb) for op in lops
               if (mb, li, op.name) not in seen]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ScheduleError(f"schedule {schedule.name!r} never launches {', '.join(missing[:5])}{more}")

    writer: Dict[Key, int] = {}
    last_read: Dict[Key, int] = {}
    reads: List[List[Read]] = []
    for i, (l, op) in enumerate(zip(schedule.launches, ops)):
        rs = [_resolve(l.mb, l.layer, name, inputs) for name in op.reads]
        for r in rs:
            for key in r.keys:
                if key[0] == "in" or key in writer:
                    last_read[key] = i
                    continue
                producer = [o.name for o in layers[key[1]] if key[2] in o.writes]
                if not producer:
                    raise ScheduleError(f"launch #{i} ({l}) reads {key[2]!r}: no operation of layer {key[1]} "
                                        f"writes it and it is not an input of mb{key[0]}")
                raise ScheduleError(f"launch #{i} ({l}) reads {_describe(key)} before it is written, "
                                    f"which {producer[0]!r} writes later")
        for w in op.writes:
            if w in inputs[l.mb]:
                raise ScheduleError(f"launch #{i} ({l}) writes {w!r}, which is an input of mb{l.mb}")
            writer[(l.mb, l.layer, w)] = i
        reads.append(rs)
    outputs = [(mb, n_layers - 1, output) if n_layers else ("in", mb, HIDDEN) for mb in range(n_mb)]
    for mb, key in enumerate(outputs):
        if key[0] == "in" and HIDDEN not in inputs[mb]:
            raise ScheduleError(f"mb{mb} has no {HIDDEN!r} input")
        if key[0] != "in" and key not in writer:
            raise ScheduleError(f"the last layer writes no {output!r}: mb{mb} would have no output")
    for b, a in schedule.orders:
        if not (0 <= b < a < len(schedule.launches)):
            raise ScheduleError(f"ordering intent ({b}, {a}) must name two launches, the first one earlier")
    return Flow(ops, reads, writer, last_read, outputs)


# ---- generators -------------------------------------------------------------------------------


def _is_comm(op: Operation) -> bool:
    return op.stream == EP_COMM


def _fifo_orders(launches: Sequence[ScheduledOp], comm: Sequence[bool]) -> Tuple[Tuple[int, int], ...]:
    """Keep the communication launches of each side stream in schedule order (for graph compilers)."""
    last: Dict[str, int] = {}
    orders = []
    for i, (l, c) in enumerate(zip(launches, comm)):
        if c and l.stream != DEFAULT:
            if l.stream in last:
                orders.append((last[l.stream], i))
            last[l.stream] = i
    return tuple(orders)


def _build(name: str, items: Sequence[Tuple[int, int, Operation, str]]) -> Schedule:
    launches = tuple(ScheduledOp(mb, li, op.name, stream) for mb, li, op, stream in items)
    return Schedule(name, launches, _fifo_orders(launches, [_is_comm(op) for _, _, op, _ in items]))


def as_listed(layers: Layers, n_micro: int = 1) -> Schedule:
    """Each layer's operations in their listed order, each on its own stream, micro-batch after micro-batch."""
    layers = normalize_layers(layers)
    return _build("as-listed", [(mb, li, op, op.stream) for li, ops in enumerate(layers)
                                for mb in range(n_micro) for op in ops])


def serial(layers: Layers, n_micro: int = 1) -> Schedule:
    """Everything on the main stream, layer by layer, micro-batch after micro-batch: the reference."""
    layers = normalize_layers(layers)
    return _build("serial", [(mb, li, op, DEFAULT) for li, ops in enumerate(layers)
                             for mb in range(n_micro) for op in ops])


def _written_before(ops: Sequence[Operation], stop: int) -> set:
    return {w for op in ops[:stop] for w in op.writes}


def _float_shared(ops: Sequence[Operation]) -> Tuple[List[Operation], List[Operation], int]:
    """Split off the shared-expert operations that can run right after the first communication.

    Returns ``(others, floating, at)``: ``floating`` go after ``others[at - 1]``, the end of the first
    run of comm ops (a count exchange and the payload it sizes: the shared experts cover the payload).
    A shared operation that reads a value written from the first comm op on stays where it is.
    """
    first = next((i for i, op in enumerate(ops) if _is_comm(op)), None)
    if first is None:
        return list(ops), [], 0
    layer_writes = {w for op in ops for w in op.writes}
    ready = _written_before(ops, first)  # not the comm output: waiting for it would serialise the exchange
    floating = [op for op in ops if op.stream == SHARED_EXPERT
                and all(r in ready or r not in layer_writes for r in op.reads)]
    names = {op.name for op in floating}
    others = [op for op in ops if op.name not in names]
    at = next(i for i, op in enumerate(others) if _is_comm(op)) + 1
    while at < len(others) and _is_comm(others[at]):
        at += 1
    return others, floating, at


def shared(layers: Layers, n_micro: int = 1) -> Schedule:
    """One batch at a time; the shared experts on their side stream right after the dispatch is issued.

    Communication runs on its stream and the shared experts overlap it on theirs; the rest
    keeps the layer's order on the main stream.
    """
    layers = normalize_layers(layers)
    items = []
    for li, ops in enumerate(layers):
        others, floating, at = _float_shared(ops)
        order = others[:at] + floating + others[at:]
        items += [(mb, li, op, op.stream) for mb in range(n_micro) for op in order]
    return _build("shared", items)


def _segments(ops: Sequence[Operation]) -> Tuple[List[List[Operation]], List[Operation]]:
    """Cut a layer after each comm op: segments ending in communication, and the tail after the last."""
    segments, cur = [], []
    for op in ops:
        cur.append(op)
        if _is_comm(op):
            segments.append(cur)
            cur = []
    return segments, cur


def _pipelined_stream(op: Operation) -> str:
    # Production prefill keeps all compute, shared experts included, on the main stream.
    return op.stream if _is_comm(op) or op.stream not in (DEFAULT, SHARED_EXPERT) else DEFAULT


_Item = Tuple[int, int, Operation, str]


def _segment_order(segments: List[List[Operation]], floating: List[Operation], n_micro: int
                   ) -> List[Tuple[int, List[Operation]]]:
    """One layer's segments and floating shared experts as ``(mb, operations)`` in issue order: each segment
    for every micro-batch in turn, the shared experts after the first segment's exchanges.

    A comm-only second segment reads the first's exchange on the host (a count exchange, then the payload
    it sizes): mb0's once every micro-batch's first segment is issued, so their compute covers the count
    exchange, then the shared experts, which cover mb0's payload; micro-batch m's after micro-batch m-1's
    next compute and before its exchange (which the stream would otherwise put ahead of m's payload).
    """
    last = n_micro - 1
    reads = len(segments) > 1 and all(map(_is_comm, segments[1]))
    float_after = (1, 0) if reads else (0, last)
    out: List[Tuple[int, List[Operation]]] = []
    for k, seg in enumerate(segments):
        for mb in range(n_micro):
            if reads and k == 1 and mb > 0:
                continue  # behind micro-batch mb-1's next compute, below
            if reads and k == 2 and mb < last:
                out += [(mb, seg[:-1]), (mb + 1, segments[1]), (mb, seg[-1:])]
            else:
                out.append((mb, seg))
            if (k, mb) == float_after:
                out += [(m, floating) for m in range(n_micro)]
    if reads and len(segments) == 2:
        out += [(mb, segments[1]) for mb in range(1, n_micro)]
    return out


def _pipelined(name: str, layers: Layers, n_micro: int, defer_tail: bool) -> Schedule:
    """The N-batch schedule (see `n_batch`) called ``name``."""
    layers = normalize_layers(layers)
    if n_micro < 1:
        raise ScheduleError(f"{name} needs at least one micro-batch, got {n_micro}")
    last = n_micro - 1
    items: List[_Item] = []
    deferred: List[_Item] = []

    def emit(mb: int, li: int, ops: Sequence[Operation]) -> List[_Item]:
        return [(mb, li, op, _pipelined_stream(op)) for op in ops]

    for li, ops in enumerate(layers):
        others, floating, _ = _float_shared(ops)
        segments, tail = _segments(others)
        body: List[_Item] = []
        if not segments:  # nothing to hide in this layer: micro-batch after micro-batch
            for mb in range(n_micro):
                body += emit(mb, li, ops)
            anchor: Optional[str] = ops[-1].name if ops else None
        else:
            for mb, part in _segment_order(segments, floating, n_micro):
                body += emit(mb, li, part)
            for mb in range(last):
                body += emit(mb, li, tail)
            compute = [op for op in segments[0] if not _is_comm(op)]
            # behind mb0's attention: its first-segment compute except the comm op's producer
            anchor = compute[-2].name if len(compute) >= 2 else (compute[0].name if compute else None)
        if deferred:
            pos = next(i + 1 for i, (mb, _, op, _) in enumerate(body) if mb == 0 and op.name == anchor) \
                if anchor is not None else 0
            body[pos:pos] = deferred
            deferred = []
        if segments and defer_tail and li + 1 < len(layers) and n_micro > 1:
            deferred = emit(last, li, tail)
        elif segments:
            body += emit(last, li, tail)
        items += body
    items += deferred
    return _build(name, items)


_COUNT_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}


def n_batch_name(n_micro: int) -> str:
    """The name of the `n_batch` schedule of ``n_micro`` micro-batches: ``two-batch``, ``three-batch``..."""
    return f"{_COUNT_WORDS.get(n_micro, n_micro)}-batch"


def n_batch(layers: Layers, n_micro: int = 2, defer_tail: bool = True) -> Schedule:
    """N-batch prefill: compute on the main stream, communication on its side stream, N micro-batches.

    Per layer, each segment (compute up to and including a comm op) is issued for micro-batch 0,
    then 1, ..., then N-1, so each micro-batch's dispatch / combine runs under the others'
    compute; the shared experts follow the first dispatches. The tails after the last comm op
    (finalize) follow the last segment, except the last micro-batch's, which is deferred into
    the next layer behind micro-batch 0's attention, so its combine is hidden too. For a MoE
    layer ``attn, gate, dispatch, experts, combine, shared, finalize`` and N = 3 this is: attn0
    gate0 dispatch0 attn1 gate1 dispatch1 attn2 gate2 dispatch2 shared0 shared1 shared2
    experts0 combine0 experts1 combine1 experts2 combine2 finalize0 finalize1 | attn0' finalize2
    gate0' ... With the dispatch in two steps (``counts``, then ``dispatch``, which reads them on the
    host and sends the tokens) each micro-batch's count exchange is issued with its first segment,
    and the host reads micro-batch 0's once the others' attention is issued, each other one's after
    the previous one's experts: attn0 gate0 counts0 attn1 gate1 counts1 attn2 gate2 counts2
    dispatch0 shared0 shared1 shared2 experts0 dispatch1 combine0 experts1 dispatch2 combine1
    experts2 combine2 ... The schedule is named `n_batch_name` (n_micro).
    """
    return _pipelined(n_batch_name(n_micro), layers, n_micro, defer_tail)


def two_batch(layers: Layers, n_micro: int = 2, defer_tail: bool = True) -> Schedule:
    """Two-batch prefill: `n_batch` for two micro-batches, named ``two-batch`` whatever ``n_micro``.

    For a MoE layer ``attn, gate, dispatch, experts, combine, shared, finalize`` this is: attn0
    gate0 dispatch0 attn1 gate1 dispatch1 shared0 shared1 experts0 combine0 experts1 combine1
    finalize0 | attn0' finalize1 gate0' ...
    """
    return _pipelined("two-batch", layers, n_micro, defer_tail)


def chunked(layers: Layers, n_micro: int = 1) -> Schedule:
    """`shared` for layers whose MoE runs in chunks (`collectives.ExpertParallelMoE.decode_stages`): their listed
    order already issues chunk i+1's dispatch before chunk i's experts and chunk i's combine before chunk i+1's,
    so on the communication stream each runs under the experts of another chunk."""
    return dataclasses.replace(shared(layers, n_micro), name="chunked")


@dataclasses.dataclass(frozen=True)
class Mode:
    """A named way to run a prefill or a decode step: its schedule generator and how many micro-batches it wants.

    ``in_all``: the launcher's ``--mode all`` runs it (the N-batch modes for N > 2 are opt-in).
    ``moe_chunks``: the chunks a decode step's routed experts run in (one batch, its MoE as a pipeline of
    chunks: the ``chunked-K`` modes of `DECODE_MODES`).
    """

    name: str
    make: Callable[..., Schedule]
    micro_batches: int
    in_all: bool = True
    moe_chunks: int = 1


MODES: Dict[str, Mode] = {m.name: m for m in (
    Mode("serial", serial, 1), Mode("shared", shared, 1), Mode("two-batch", two_batch, 2),
    Mode("three-batch", n_batch, 3, in_all=False), Mode("four-batch", n_batch, 4, in_all=False))}
CHUNKS = (2, 3, 4)  # the chunked decode modes' chunk counts
# Decode steps run every prefill mode and, for small batches, one batch with its MoE in K chunks.
DECODE_MODES: Dict[str, Mode] = {**MODES, **{f"chunked-{k}": Mode(f"chunked-{k}", chunked, 1, in_all=False,
                                                                   moe_chunks=k) for k in CHUNKS}}
# not a schedule: the mode that takes each batch's (prefill) or each step's (decode) mode from a calibration
AUTO = "auto"


def mode(name: str) -> Mode:
    """The `Mode` called ``name``; a ValueError listing the modes otherwise."""
    try:
        return MODES[name]
    except KeyError:
        hint = " (a decode mode: it runs decode steps only)" if name in DECODE_MODES else ""
        raise ValueError(f"unknown mode {name!r}{hint}; expected one of {', '.join(MODES)}") from None


def decode_mode(name: str) -> Mode:
    """The decode `Mode` called ``name`` (`DECODE_MODES`); a ValueError listing them otherwise."""
    try:
        return DECODE_MODES[name]
    except KeyError:
        raise ValueError(f"unknown decode mode {name!r}; expected one of {', '.join(DECODE_MODES)}") from None


def schedule_for(name: str, layers: Layers, n_micro: int) -> Schedule:
    """The schedule of mode ``name`` for ``layers`` and ``n_micro`` micro-batches."""
    return mode(name).make(layers, n_micro)


__all__ = ["AUTO", "CHUNKS", "DECODE_MODES", "HIDDEN", "MODES", "OUT", "Flow", "Mode", "Read", "Schedule", "ScheduleError",
           "ScheduledOp", "as_listed", "chunked", "decode_mode", "mode", "n_batch", "n_batch_name", "normalize_layers", "schedule_for", "serial", "shared", "two_batch",
           "validate"]
