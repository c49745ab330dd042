"""Expert-parallel dispatch and combine over uneven ``all_to_all_single``, asynchronous in DeepEP's style.

``dispatch`` sends each token at most once to each rank that holds one of its experts and
returns a `DispatchHandle`; the receiver expands rows to its local experts (`DispatchHandle.expand`).
``combine`` reduces the expert outputs of each received row with its weights (slot order), sends
the rows back, and `CombineHandle.wait` sums them per token in rank order: deterministic.

Streams: with ``stream_tag`` (default the EP communication stream) the exchange is issued on that
stream after ``previous_event`` (or after the work issued so far on the calling stream) and the
handle carries an event recorded after it; ``async_finish=True`` returns at once and the caller
must ``wait()`` on the handle before touching the received tensors. With ``stream_tag=None`` the
exchange is issued on the current stream and ordering is the caller's job (the pipeline executor).

Host synchronisation: the receiver must know how many rows it gets before it can allocate and
issue the exchange, so ``dispatch`` first exchanges the counts and reads them on the host (it
blocks until every rank has reached its dispatch). Callers that know the split sizes pass
``send_splits`` and ``recv_splits`` and skip it; that is required under ``torch.compile``. The two
halves are separate calls too: `dispatch_counts` issues the count exchange without reading it and
returns a `PendingDispatch`, whose ``dispatch()`` reads the counts and issues the tokens, so work
issued in between is not held back by a slower rank.

The count exchange also carries each rank's hidden size, expert count, top-k, dtype and whether it
rejected its input, so that a mismatch or a bad input on one rank raises `LayoutError` on every rank
before any tokens travel, instead of a hang or a native abort (the rows received are the ranks'
posts to `overlap.compare_posts`: the one message of every agreement, with no extra collective;
the rejecting rank raises its own error). Its width is the same on every rank
whatever they pass (gloo aborts the process on a size mismatch, before a disagreement could be
read): the pairs per expert ride in a fixed number of slots (`_FOLDED_EXPERTS` over the group), and
beyond that (over 1024 experts) the receiver counts them in `DispatchHandle.expand` instead (a host
read after the exchange). With given split sizes agreement is the caller's job. ``combine`` sends
rows of the dispatched hidden size (agreed in the count exchange, checked locally); its ``dtype``
must be the same on every rank (not checked: that would take a collective per combine).

`AllToAllExchange` is this exchange as a `collectives.exchange.Exchange`: the layer's prefill exchange by default,
its count exchange a stage of its own.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import overlap
from overlap import EP_COMM, collective_device, compare_posts

from . import _buffers
from .exchange import ExpertLayer, RoutedTokens
from .experts import LocalExperts
from .group import group_size, has_peers, rank_in_group
from .layout import (AGREED_FIELDS, AGREED_HINTS, DispatchLayout, ExpertBatch, LayoutError, LocalBags,
                     ReceivedMetadata, check_routing, check_splits, compute_layout, expand, fields_by_name,
                     layer_fields, local_bags, pack_metadata, reduce_bags, reduce_local, reduce_ranks, sum_first,
                     wire_fields, wire_of)
from .quantize import received_hidden, received_tokens, tokens_for
from .side import call_event, exchange_event, on_side


def _others(splits: Sequence[int], me: int) -> List[int]:
    """Split sizes with this rank's own share set to zero: its rows never travel."""
    return [0 if r == me else n for r, n in enumerate(splits)]


def _exchange_into(out: torch.Tensor, x: torch.Tensor, recv_splits: List[int], send_splits: List[int],
                   group: Optional[dist.ProcessGroup], name: str, caller: str, **meta) -> None:
    """Rows for other ranks only (this rank's splits are zero); a no-op when nothing travels."""
    overlap.record_stream(out, caller)  # allocated on this stream, read on the caller's
    if not has_peers(group):
        return
    overlap.all_to_all_single(out, x, recv_splits, send_splits, group=group, name=name, **meta)
    overlap.record_stream(x, overlap.current_stream_tag())


def _own_event(exchanged: Optional[overlap.Event], event_tag: str,
               *guarded: torch.Tensor) -> Optional[overlap.Event]:
    """An event after the own rows (on the calling stream), for a waiter on a third stream; only where
    the exchange has its own event."""
    if exchanged is None:
        return None
    ev = call_event(f"{event_tag}.own")
    ev.record(*guarded)
    return ev


def _blocks(splits: Sequence[int], me: int) -> tuple:
    """Row ranges in the layout's send order: this rank's own ``(start, end)`` and the others' in rank order."""
    starts, at = [], 0
    for n in splits:
        starts.append(at)
        at += n
    own = (starts[me], starts[me] + splits[me])
    return own, [(starts[r], starts[r] + n) for r, n in enumerate(splits) if r != me]


def _cat_rows(t: torch.Tensor, ranges: Sequence[tuple]) -> torch.Tensor:
    parts = [t[a:b] for a, b in ranges if b > a]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else t[:0]


_N_FIELDS = len(AGREED_FIELDS)
_HEAD = 2 + _N_FIELDS  # a count row: the rows, the fields, the rejection flag; then the pairs per expert
# Pairs-per-expert slots of one rank's count exchange, over all destinations. The count rows must have one width
# on every rank whatever the ranks pass, or a disagreement on the expert count aborts in gloo before it can be
# read. 1024: the most experts MC2 documents on any Atlas product.
_FOLDED_EXPERTS = 1024
_REJECTED = "rejected its input (its own error says why); every rank of the expert-parallel group stops before " \
            "the exchange"  # what a rank learns of another's rejection from the count rows, which carry a flag


def _expert_slots(world: int) -> int:
    """Pairs-per-expert slots per destination in the count exchange: one number on every rank of the group."""
    return max(1, _FOLDED_EXPERTS // world)


def _count_rows(world: int, layout: Optional[DispatchLayout], fields: Sequence[int], rejected: bool,
                device: torch.device) -> torch.Tensor:
    """The count exchange's send tensor ``[W, _HEAD + slots]``: per destination the rows, this rank's fields
    and rejection, then the pairs per expert of that rank where they fit the slots (zeros otherwise, and
    without a ``layout``: a rank that rejected its input sends nothing)."""
    slots = _expert_slots(world)
    send = torch.zeros(world, _HEAD + slots, dtype=torch.int64, device=device)
    send[:, 1:_HEAD] = torch.tensor(list(fields) + [int(rejected)], dtype=torch.int64, device=device)
    if layout is not None:
        send[:, 0] = layout.num_tokens_per_rank
        epr = layout.experts_per_rank
        if epr <= slots:
            send[:, _HEAD:_HEAD + epr] = layout.num_tokens_per_expert.view(world, epr)
    return send


@dataclasses.dataclass
class PendingCounts:
    """A count exchange issued and not yet read on the host (`_issue_count_rows`): ``read`` waits for it."""

    send: torch.Tensor  # [W, _HEAD + slots] the rows this rank sent
    recv: Optional[torch.Tensor]  # the rows every rank sent us (None without peers: our own rows)
    used: int  # the columns read on the host: the head, and the pairs per expert where they fit
    event: Optional[overlap.Event]  # recorded on the issuing stream right after the exchange

    def read(self, rejected: Optional[BaseException] = None) -> tuple:
        """Wait for the exchange, check agreement (every rank raises alike; a rank passing ``rejected`` raises
        that) and return ``(recv_splits, recv_per_expert)``; ``recv_per_expert`` None where the pairs per
        expert did not fit the slots."""
        if self.recv is None:
            rows = self.send[:, :self.used].tolist()
        else:
            self.event.synchronize()
            rows = self.recv[:, :self.used].tolist()
        if rejected is not None:  # its words are in its own error; the others' posts say that it rejected
            raise rejected
        compare_posts([{"values": fields_by_name(r[1:_HEAD - 1]), "problems": [_REJECTED] if r[_HEAD - 1] else []}
                       for r in rows], hints=AGREED_HINTS, error=LayoutError)
        per_expert = None
        if self.used > _HEAD:  # the ranks agree on the expert count, so on the slots used
            per_expert = [sum(r[_HEAD + e] for r in rows) for e in range(self.used - _HEAD)]
        return [r[0] for r in rows], per_expert


def _issue_count_rows(send: torch.Tensor, epr: int, group: Optional[dist.ProcessGroup],
                      event_tag: str) -> PendingCounts:
    """Issue the exchange of `_count_rows` on the current stream, without reading it."""
    world = send.shape[0]
    used = _HEAD + (epr if 0 < epr <= _expert_slots(world) else 0)  # read on the host only what is needed
    if world == 1 and not dist.is_initialized():
        return PendingCounts(send, None, used, None)
    recv = torch.empty_like(send)
    overlap.all_to_all_single(recv, send, group=group, name="dispatch.counts")
    event = call_event(event_tag)  # one per exchange: two in flight are read apart
    event.record(recv)
    return PendingCounts(send, recv, used, event)


def _exchange_count_rows(send: torch.Tensor, epr: int, group: Optional[dist.ProcessGroup], event_tag: str,
                         rejected: Optional[BaseException]) -> tuple:
    """Exchange `_count_rows` and read them (`PendingCounts.read`)."""
    return _issue_count_rows(send, epr, group, event_tag).read(rejected)


def exchange_counts(layout: DispatchLayout, group: Optional[dist.ProcessGroup],
                    event_tag: str = "ep_dispatch.counts", fields: Optional[Sequence[int]] = None,
                    rejected: Optional[BaseException] = None) -> tuple:
    """Tell every rank how many rows, and how many (row, expert) pairs per local expert, it gets from us.

    Returns ``(recv_splits, recv_per_expert)`` as host lists (``recv_per_expert`` None beyond
    `_FOLDED_EXPERTS` experts: `expand` counts them). Blocks the host until the counts arrive.
    ``fields`` (`collectives.layout.layer_fields`; default: only the expert count and top-k) travel
    along, in rows of one width on every rank whatever it passes: every rank raises `LayoutError` if
    they differ between ranks (naming each rank's value) or if a rank passed its ``rejected`` error
    (a rank whose input failed its checks still takes part, then raises it).
    """
    w = layout.world_size
    if fields is None:
        fields = [0, layout.num_experts, layout.top_k, 0]
    send = _count_rows(w, layout, fields, rejected is not None, layout.num_tokens_per_rank.device)
    return _exchange_count_rows(send, layout.experts_per_rank, group, event_tag, rejected)


@dataclasses.dataclass
class DispatchHandle(ReceivedMetadata):
    """What a dispatch received, and what combine needs to send it back (a `collectives.handles.EPDispatchHandle`).

    Received rows: this rank's own rows first (they never travel), then the other ranks' rows by
    source rank, each in source token order.
    """

    layout: DispatchLayout
    recv_x: torch.Tensor  # [R, H] received tokens, own rows first, then by source rank
    recv_meta: torch.Tensor  # [R, 2k] float32: local expert ids (-1: elsewhere), then weights
    recv_splits: List[int]
    num_recv_tokens_per_expert: Optional[List[int]]  # from the count exchange (None: `expand` counts them)
    group: Optional[dist.ProcessGroup]
    dtype: torch.dtype
    event: Optional[overlap.Event] = None
    rank: int = 0  # this rank in the group: its rows are the first recv_splits[rank]
    spare: Optional[torch.Tensor] = None  # the dispatch's send buffer, free once waited: combine receives into it
    own_event: Optional[overlap.Event] = None  # the own rows, gathered on the calling stream
    quantized: Optional[torch.dtype] = None  # the dispatch dtype: rows are `collectives.quantize.pack`'s; None: dtype

    @property
    def hidden(self) -> int:
        """The tokens' hidden size (the received rows hold a scale's columns more where quantized)."""
        return received_hidden(self.recv_x, self.quantized)

    def wait(self) -> "DispatchHandle":
        """Make the current stream wait for the exchange; then the received tensors may be read."""
        if self.event is not None:
            # No consumer tensors: on ge the received tensors' own data edges order their readers.
            self.event.wait()
            self.event = None
        if self.own_event is not None:  # matters when another stream than the caller's waits
            self.own_event.wait()
            self.own_event = None
        return self

    def expand(self, counts: Optional[Sequence[int]] = None) -> ExpertBatch:
        """Received rows expanded to local experts; ``counts`` (rows per local expert) avoids a host read."""
        if self.event is not None:
            raise RuntimeError("DispatchHandle.expand before wait(): the exchange may still be in flight")
        given = counts is not None
        if not given:
            counts = self.num_recv_tokens_per_expert
        return expand(self.recv_x, self.recv_meta, self.layout.experts_per_rank, counts, verify=given)

    def combine(self, expert_out: torch.Tensor, batch: ExpertBatch, *, previous_event: Optional[overlap.Event] = None,
                async_finish: bool = False, stream_tag: Optional[str] = EP_COMM, event_tag: str = "ep_combine",
                dtype: Optional[torch.dtype] = None) -> "CombineHandle":
        """`combine` of ``expert_out`` (one row per row of ``batch``) back to this dispatch's tokens."""
        return combine(expert_out, batch, self, previous_event=previous_event, async_finish=async_finish,
                       stream_tag=stream_tag, event_tag=event_tag, dtype=dtype)


def _reuses_buffers(t: torch.Tensor) -> bool:
    """Whether internal send / receive buffers come from `collectives._buffers` (eager CPU)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def _gather_rows(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
    """``out[:] = src[index]``, straight into ``out`` outside tracing."""
    if torch.compiler.is_compiling():
        out.copy_(src.index_select(0, index))
    else:
        torch.index_select(src, 0, index, out=out)


@dataclasses.dataclass
class _SendLayout:
    """The send side of one dispatch, prepared on the calling stream before anything is exchanged."""

    layout: DispatchLayout
    rank: int
    own: Tuple[int, int]  # this rank's rows in the layout's send order: they never travel
    others: List[Tuple[int, int]]  # the other ranks' rows, in rank order
    meta: torch.Tensor  # [S, 2k] metadata of every row, own rows included
    send_x: torch.Tensor  # the rows that travel, in rank order
    send_meta: torch.Tensor
    recv_splits: Optional[List[int]]  # None: learnt from the count exchange
    pooled: bool  # send_x is a `_buffers` buffer: combine may receive into it
    fields: List[int]  # `collectives.layout.layer_fields`, checked in the count exchange
    wire: torch.Tensor  # the tokens as they travel: ``x`` detached, or packed quantized (`collectives.quantize`)
    quantized: Optional[torch.dtype]  # the dispatch dtype (None: the tokens' own)

    @property
    def n_own(self) -> int:
        return self.own[1] - self.own[0]


def _send_layout(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                   group: Optional[dist.ProcessGroup], world: int, send_splits: Optional[Sequence[int]],
                   recv_splits: Optional[Sequence[int]], check_ids: bool,
                   dispatch_dtype: Optional[torch.dtype] = None) -> _SendLayout:
    """Validate, lay out and pack what travels (quantized per token with ``dispatch_dtype``); raises
    `LayoutError` before any collective."""
    check_routing(x, topk_idx, topk_weights, num_experts, world, check_ids)
    wire = wire_of(x, dispatch_dtype)
    if (send_splits is None) != (recv_splits is None):
        raise LayoutError("pass both send_splits and recv_splits, or neither")
    if recv_splits is not None:
        recv_splits = check_splits("receive split sizes", recv_splits, world)
    layout = compute_layout(topk_idx, num_experts, world, send_splits)
    me = rank_in_group(group)
    if recv_splits is not None and recv_splits[me] != layout.send_splits[me]:
        raise LayoutError(f"receive split sizes {recv_splits} and send split sizes {layout.send_splits} disagree on "
                          f"the rows rank {me} keeps for itself")
    own, others = _blocks(layout.send_splits, me)
    meta = pack_metadata(layout, topk_idx, topk_weights)
    send_meta = _cat_rows(meta, others)
    send_rows = _cat_rows(layout.send_token, others)
    pooled = _reuses_buffers(x)
    if pooled:
        send_x = _buffers.take(send_rows.shape[0], wire.shape[1], wire.dtype)
        _gather_rows(send_x, wire, send_rows)
    else:
        send_x = wire.index_select(0, send_rows)
    return _SendLayout(layout, me, own, others, meta, send_x, send_meta, recv_splits, pooled,
                       wire_fields(x, topk_idx, num_experts, dispatch_dtype), wire, dispatch_dtype)


def _issue_dispatch(sending: _SendLayout, x: torch.Tensor, group: Optional[dist.ProcessGroup],
                    previous_event: Optional[overlap.Event], stream_tag: Optional[str],
                    event_tag: str, counts: Optional[PendingCounts] = None) -> DispatchHandle:
    """On ``stream_tag``: the count exchange's read (``counts``, issued before, else issued now; none where
    the splits are known), the receive buffers and the two exchanges (tokens, metadata) into all but
    their first ``n_own`` rows."""
    layout, me, n_own = sending.layout, sending.rank, sending.n_own
    with on_side(stream_tag, previous_event, event_tag) as caller:
        recv_splits, per_expert = sending.recv_splits, None
        if recv_splits is None:
            recv_splits, per_expert = (counts.read() if counts is not None
                                       else exchange_counts(layout, group, fields=sending.fields))
        rows = sum(recv_splits)
        recv_x = sending.wire.new_empty(rows, sending.wire.shape[1])
        recv_meta = sending.meta.new_empty(rows, sending.meta.shape[1])
        travel_in, travel_out = _others(recv_splits, me), _others(layout.send_splits, me)
        _exchange_into(recv_x[n_own:], sending.send_x, travel_in, travel_out, group, "dispatch", caller)
        _exchange_into(recv_meta[n_own:], sending.send_meta, travel_in, travel_out, group, "dispatch.meta", caller)
        handle = DispatchHandle(layout, recv_x, recv_meta, recv_splits, per_expert, group, x.dtype, rank=me,
                                spare=sending.send_x if sending.pooled else None, quantized=sending.quantized)
        handle.event = exchange_event(stream_tag, caller, event_tag, recv_x, recv_meta)
    return handle


def _keep_own_rows(sending: _SendLayout, x: torch.Tensor, handle: DispatchHandle, event_tag: str) -> None:
    """The rows this rank keeps, into the first rows of the receive buffers on the calling stream, beside
    the exchange (disjoint rows of the same buffers); detached, as the rows that travel are (the
    exchange is not differentiable)."""
    a, b = sending.own
    _gather_rows(handle.recv_x[:sending.n_own], sending.wire, sending.layout.send_token[a:b])
    handle.recv_meta[:sending.n_own].copy_(sending.meta[a:b].detach())
    handle.own_event = _own_event(handle.event, event_tag, handle.recv_x, handle.recv_meta)


def _join_as_rejected(err: LayoutError, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int,
                      group: Optional[dist.ProcessGroup], world: int, previous_event: Optional[overlap.Event],
                      stream_tag: Optional[str], event_tag: str) -> None:
    """Take part in the count exchange the other ranks are in, flagged as rejected, then raise ``err``:
    they raise too instead of waiting for this rank. The count rows have one width whatever this rank
    passed (a bad expert count included), so they always match the others'."""
    if world < 2 or torch.compiler.is_compiling():
        return
    fields = layer_fields(x, topk_idx, num_experts)
    with on_side(stream_tag, previous_event, event_tag):
        send = _count_rows(world, None, fields, True, collective_device(group))
        _exchange_count_rows(send, 0, group, "ep_dispatch.counts", err)  # exchange_counts's event


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
             group: Optional[dist.ProcessGroup] = None, *, send_splits: Optional[Sequence[int]] = None,
             recv_splits: Optional[Sequence[int]] = None, previous_event: Optional[overlap.Event] = None,
             async_finish: bool = False, stream_tag: Optional[str] = EP_COMM, event_tag: str = "ep_dispatch",
             check_ids: bool = True, dispatch_dtype: Optional[torch.dtype] = None) -> DispatchHandle:
    """Send tokens ``x [T, H]`` to the ranks holding their experts (once per rank); see the module docstring.

    ``send_splits`` / ``recv_splits``: rows sent to / received from each rank, when known; both
    skip the count exchange and its host synchronisation. Input is validated before any tokens travel;
    a rank that rejects its input still takes part in the count exchange, so that every rank raises.
    Rows a rank keeps are gathered straight into its receive buffer, while the exchange is in flight.
    Without the splits this is ``dispatch_counts(...).dispatch(async_finish)``. ``dispatch_dtype``: see
    `dispatch_counts` (the handle's ``recv_x`` then holds packed rows, `collectives.quantize.unpack`).
    """
    if send_splits is None and recv_splits is None:
        return dispatch_counts(x, topk_idx, topk_weights, num_experts, group, previous_event=previous_event,
                               stream_tag=stream_tag, event_tag=event_tag, check_ids=check_ids,
                               dispatch_dtype=dispatch_dtype).dispatch(async_finish=async_finish)
    world = group_size(group)  # a group this rank is not in: nothing to join
    sending = _send_layout(x, topk_idx, topk_weights, num_experts, group, world, send_splits, recv_splits, check_ids,
                           dispatch_dtype)
    return _finish_dispatch(sending, x, group, previous_event, stream_tag, event_tag, None, async_finish)


def _finish_dispatch(sending: _SendLayout, x: torch.Tensor, group: Optional[dist.ProcessGroup],
                     previous_event: Optional[overlap.Event], stream_tag: Optional[str], event_tag: str,
                     counts: Optional[PendingCounts], async_finish: bool) -> DispatchHandle:
    handle = _issue_dispatch(sending, x, group, previous_event, stream_tag, event_tag, counts)
    _keep_own_rows(sending, x, handle, event_tag)
    if not async_finish:
        handle.wait()
    return handle


@dataclasses.dataclass
class PendingDispatch:
    """A dispatch whose count exchange is in flight (`dispatch_counts`): nothing has been read on the host.

    `dispatch` reads the counts (the host waits until every rank has issued its count exchange),
    then issues the tokens and returns the `DispatchHandle`. Work issued in between, on any stream,
    does not wait for the other ranks: that is the point of the two steps. Call `dispatch` exactly
    once, and issue the same collectives in the same order on every rank in between.

    `issue_ahead` hands the read and the tokens to the exchange stream's own thread where the path
    has one (`overlap.issue_ahead`: the CPU path's side streams), which sends them as soon as the
    counts arrive, as a device's comm stream would; `dispatch` then takes that handle.
    """

    sending: _SendLayout
    x: torch.Tensor
    group: Optional[dist.ProcessGroup]
    counts: PendingCounts
    previous_event: Optional[overlap.Event]
    stream_tag: Optional[str]
    event_tag: str
    done: bool = False
    ahead: Optional[overlap.backends.Ahead] = None  # `issue_ahead`'s work

    def issue_ahead(self) -> bool:
        """Read the counts and issue the tokens on the exchange stream's own thread, as soon as the counts
        arrive, where the path has such a thread (`overlap.issue_ahead`); the caller goes on at once.
        False where it has none: `dispatch` does both, in place."""
        if self.done or self.ahead is not None:
            raise RuntimeError("this dispatch was already issued: issue_ahead() comes before dispatch(), once")
        tag = self.stream_tag or overlap.current_stream_tag()
        self.ahead = overlap.issue_ahead("dispatch.ahead", lambda: self._finish(async_finish=True), tag)
        return self.ahead is not None

    def dispatch(self, *, async_finish: bool = False) -> DispatchHandle:
        """Read the counts (`LayoutError` on every rank where the ranks disagree or one rejected its
        input), allocate the receive buffers and issue the tokens (or, after `issue_ahead`, take what it
        issued); see `dispatch` for ``async_finish``."""
        if self.done:
            raise RuntimeError("this dispatch was already issued: PendingDispatch.dispatch() runs once")
        self.done = True
        if self.ahead is None:
            return self._finish(async_finish)
        handle = self.ahead.result()
        return handle if async_finish else handle.wait()

    def _finish(self, async_finish: bool) -> DispatchHandle:
        return _finish_dispatch(self.sending, self.x, self.group, self.previous_event, self.stream_tag, self.event_tag,
                                self.counts, async_finish)


def dispatch_counts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                    group: Optional[dist.ProcessGroup] = None, *, previous_event: Optional[overlap.Event] = None,
                    stream_tag: Optional[str] = EP_COMM, event_tag: str = "ep_dispatch",
                    check_ids: bool = True, dispatch_dtype: Optional[torch.dtype] = None) -> PendingDispatch:
    """The first half of `dispatch`: validate and lay out ``x [T, H]`` and issue the count exchange on
    ``stream_tag`` without reading it; `PendingDispatch.dispatch` reads it and sends the tokens.
    ``dispatch_dtype`` (int8, float8_e4m3fn; None: the tokens' own): the tokens travel quantized per token,
    their scales in the same rows (`collectives.quantize`).

    A rank that rejects its input takes part in the count exchange and raises here; the other ranks
    raise the same `LayoutError` from `PendingDispatch.dispatch`.
    """
    world = group_size(group)  # a group this rank is not in: nothing to join
    try:
        sending = _send_layout(x, topk_idx, topk_weights, num_experts, group, world, None, None, check_ids,
                               dispatch_dtype)
    except LayoutError as err:
        _join_as_rejected(err, x, topk_idx, num_experts, group, world, previous_event, stream_tag, event_tag)
        raise
    layout = sending.layout
    with on_side(stream_tag, previous_event, event_tag):
        send = _count_rows(layout.world_size, layout, sending.fields, False, layout.num_tokens_per_rank.device)
        counts = _issue_count_rows(send, layout.experts_per_rank, group, f"{event_tag}.counts")
    return PendingDispatch(sending, x, group, counts, previous_event, stream_tag, event_tag)


@dataclasses.dataclass
class CombineHandle:
    """Rows sent back by every rank; `wait` sums them into their tokens.

    ``out`` (when set) already holds this rank's own contribution; ``blocks`` lists, in rank
    order, the tokens and the rows of ``returned`` still to add. Without ``out``, ``returned`` is
    every rank's rows in the layout's send order.
    """

    layout: DispatchLayout
    returned: torch.Tensor  # rows sent back by the other ranks, in the order they were sent
    dtype: torch.dtype
    event: Optional[overlap.Event] = None
    out: Optional[torch.Tensor] = None  # [T, H] float32
    blocks: List[tuple] = dataclasses.field(default_factory=list)  # (tokens, first row, end row)
    own_event: Optional[overlap.Event] = None  # ``out``'s own contribution, computed on the calling stream
    spent: List[torch.Tensor] = dataclasses.field(default_factory=list)  # reusable once the rows are added

    def wait(self) -> torch.Tensor:
        """Wait for the exchange on the current stream and return the combined tokens ``[T, H]``."""
        if self.event is not None:
            self.event.wait()
            self.event = None
        if self.own_event is not None:
            self.own_event.wait()
            self.own_event = None
        if self.out is None:
            return reduce_ranks(self.returned, self.layout, self.returned.shape[-1]).to(self.dtype)
        for tokens, a, b in self.blocks:
            if b > a:
                self.out.index_add_(0, tokens, self.returned[a:b].float())
        self.blocks = []
        for t in self.spent:  # the exchange that used them has completed
            _buffers.give(t)
        self.spent = []
        return self.out.to(self.dtype)


@dataclasses.dataclass
class _ReturnLayout:
    """The send side of one combine: the reduced rows that travel back, and how to reduce the own rows."""

    layout: DispatchLayout
    rank: int
    own: Tuple[int, int]  # the own rows, first in the received rows and in the layout's send order
    others: List[Tuple[int, int]]
    hidden: int
    travel: torch.dtype  # the dtype rows travel in
    local: Optional[LocalBags]  # None: the static-shape reduction (``full``)
    partial: torch.Tensor  # the reduced rows that travel back, in the order they were received
    full: Optional[torch.Tensor]  # static form: every received row reduced, own rows first
    spare: Optional[torch.Tensor]  # the dispatch's send buffer, to receive into

    @property
    def n_own(self) -> int:
        return self.own[1] - self.own[0]


def _return_layout(expert_out: torch.Tensor, batch: ExpertBatch, handle: DispatchHandle,
                  dtype: Optional[torch.dtype]) -> _ReturnLayout:
    """Validate, and reduce the rows that travel back (the own rows wait for `_reduce_own_rows`)."""
    if handle.event is not None:
        raise RuntimeError("combine before the dispatch handle was waited on")
    if batch.num_rows != handle.recv_x.shape[0]:
        raise LayoutError(f"the batch expands {batch.num_rows} received rows, but this dispatch received "
                          f"{handle.recv_x.shape[0]}: pass the batch of this handle's expand()")
    hidden_in = handle.hidden  # agreed in the count exchange: every rank sends rows of this size
    if expert_out.dim() != 2 or tuple(expert_out.shape) != (batch.rows.shape[0], hidden_in):
        raise LayoutError(f"expert output must be [{batch.rows.shape[0]}, {hidden_in}] (one row per expanded token, "
                          f"of the dispatched tokens' hidden size, which every rank's combine sends), got shape "
                          f"{tuple(expert_out.shape)}")
    layout, me, hidden = handle.layout, handle.rank, expert_out.shape[-1]
    own, others = _blocks(layout.send_splits, me)
    n_own = own[1] - own[0]
    local = local_bags(expert_out, batch, handle.recv_weights)
    travel = dtype or handle.dtype
    full = None
    if local is None:
        full = reduce_local(expert_out, batch, handle.recv_weights).to(travel)
        partial = full[n_own:]
    else:  # the rows that travel first; the own rows go straight into the result while they travel
        partial = reduce_bags(expert_out, local, n_own, batch.num_rows,
                              out=_buffers.take(batch.num_rows - n_own, hidden, travel))
    spare, handle.spare = handle.spare, None  # a fresh buffer for a second combine of the same dispatch
    return _ReturnLayout(layout, me, own, others, hidden, travel, local, partial, full, spare)


def _combine_receive_buffer(returning: _ReturnLayout) -> torch.Tensor:
    """Where the other ranks' rows come back: the dispatch's send buffer when it fits, else a pooled or fresh one."""
    rows, hidden = returning.layout.num_send - returning.n_own, returning.hidden
    spare = returning.spare
    if spare is not None and spare.dtype == returning.travel and tuple(spare.shape) == (rows, hidden):
        return spare
    if returning.local is not None:
        return _buffers.take(rows, hidden, returning.travel)
    return returning.partial.new_empty(rows, hidden)


def _issue_combine(returning: _ReturnLayout, handle: DispatchHandle, previous_event: Optional[overlap.Event],
                   stream_tag: Optional[str], event_tag: str) -> CombineHandle:
    """On ``stream_tag``: send the reduced rows back (the reverse of the dispatch's splits)."""
    me = returning.rank
    with on_side(stream_tag, previous_event, event_tag) as caller:
        returned = _combine_receive_buffer(returning)
        _exchange_into(returned, returning.partial, _others(returning.layout.send_splits, me),
                       _others(handle.recv_splits, me), handle.group, "combine", caller)
        result = CombineHandle(returning.layout, returned, handle.dtype,
                               spent=[returned, returning.partial] if returning.local is not None else [])
        result.event = exchange_event(stream_tag, caller, event_tag, returned)
    return result


def _reduce_own_rows(returning: _ReturnLayout, expert_out: torch.Tensor, result: CombineHandle, event_tag: str) -> None:
    """The own rows' contribution, straight into token order on the calling stream, beside the exchange:
    the first term of every token's sum (``result.out``)."""
    layout, (a, b) = returning.layout, returning.own
    own_tokens = layout.send_token[a:b]
    if returning.local is None:
        result.out = sum_first(own_tokens, returning.full[:returning.n_own], layout.num_tokens)
    else:
        result.out = reduce_bags(expert_out, returning.local, 0, returning.n_own, tokens=own_tokens,
                                 num_tokens=layout.num_tokens)
        if returning.travel != torch.float32:  # round as the other ranks' rows are
            result.out = result.out.to(returning.travel).float()
    result.own_event = _own_event(result.event, event_tag, result.out)


def _returned_blocks(returning: _ReturnLayout) -> List[tuple]:
    """Per other rank, in rank order: its tokens and its rows of ``returned`` (``CombineHandle.blocks``)."""
    blocks, at = [], 0
    for a, b in returning.others:
        blocks.append((returning.layout.send_token[a:b], at, at + b - a))
        at += b - a
    return blocks


def combine(expert_out: torch.Tensor, batch: ExpertBatch, handle: DispatchHandle, *,
            previous_event: Optional[overlap.Event] = None, async_finish: bool = False,
            stream_tag: Optional[str] = EP_COMM, event_tag: str = "ep_combine",
            dtype: Optional[torch.dtype] = None) -> CombineHandle:
    """Reduce local expert outputs per received row with their weights and send the rows back.

    ``expert_out`` is ``[N, H]`` in the order of ``batch`` (from `DispatchHandle.expand`). Rows
    travel in ``dtype`` (default: the dispatched tokens' dtype, as DeepEP does; float32 avoids
    one rounding for half-precision models) and must be the same on every rank: rows of another size
    would abort the exchange in gloo, and checking it would take a collective per combine. Each token's
    sum starts with this rank's own contribution, computed while the other rows travel; the other
    ranks' follow in rank order. ``expert_out`` of another hidden size than the dispatched tokens is a
    `LayoutError` before the exchange.
    """
    returning = _return_layout(expert_out, batch, handle, dtype)
    result = _issue_combine(returning, handle, previous_event, stream_tag, event_tag)
    _reduce_own_rows(returning, expert_out, result, event_tag)
    result.blocks = _returned_blocks(returning)
    if not async_finish and result.event is not None:
        result.event.wait()
        result.event = None
        result.own_event = None  # recorded on this very stream: already ordered
    return result


class AllToAllExchange:
    """The uneven all-to-all as an `collectives.exchange.Exchange`: `prepare` lays the tokens out and issues the
    count exchange (`dispatch_counts`), `dispatch` reads the counts and sends the tokens (`PendingDispatch.dispatch`),
    `run_experts` runs the experts over the received rows per local expert (host counts), `combine` sends them back;
    each on the stream the caller is on (the layer's stages: ``ep_comm``), the ordering the caller's."""

    name = "all_to_all"

    def two_step(self, layer: ExpertLayer) -> bool:
        """Always: the count exchange is a step of its own."""
        return True

    def prepare(self, tokens: RoutedTokens, layer: ExpertLayer, *, ahead: bool = False) -> PendingDispatch:
        """The ranks' agreement on the layer's shapes once, then `dispatch_counts`; ``ahead``: its
        `PendingDispatch.issue_ahead` (on the CPU path the stream's thread sends the tokens once the counts arrive)."""
        layer.shapes.check(tokens, layer)
        pending = dispatch_counts(tokens.x, tokens.topk_idx, tokens.topk_weights, layer.num_experts, layer.group,
                                  stream_tag=None, dispatch_dtype=tokens.dispatch_dtype)
        if ahead:
            pending.issue_ahead()
        return pending

    def dispatch(self, prepared: PendingDispatch) -> DispatchHandle:
        return prepared.dispatch(async_finish=True)

    def run_experts(self, handle: DispatchHandle, experts: LocalExperts) -> Tuple[torch.Tensor, ExpertBatch]:
        batch = handle.expand()
        return experts(tokens_for(experts, received_tokens(batch.x, handle.quantized), handle.dtype), batch.counts), \
            batch

    def combine(self, expert_out: torch.Tensor, batch: ExpertBatch, handle: DispatchHandle) -> CombineHandle:
        return combine(expert_out, batch, handle, stream_tag=None, async_finish=True)


__all__ = ["AllToAllExchange", "CombineHandle", "DispatchHandle", "PendingDispatch", "combine", "dispatch",
           "dispatch_counts", "exchange_counts"]
