"""Static-shape ("capacity") expert parallelism: every shape is fixed by a capacity, so it traces.

`collectives.dispatch` learns how many rows it receives from a count exchange read on the host,
and groups received rows per expert with host counts: data-dependent shapes, which
``torch.compile(fullgraph=True)`` cannot capture. Here every rank sends every rank exactly
``capacity`` rows, so the split sizes are ``[capacity] * world`` on both sides and nothing is
read on the host:

- dispatch: a token goes at most once to each rank that holds one of its experts (as in
  `collectives.dispatch`); the rows for rank ``r`` fill block ``r`` of the send buffer in token
  order, and the rest of the block is padding (a zero row, expert ids -1, weights 0). Own rows
  travel too (the all-to-all copies them locally). Where the capacity holds every token of the call
  (a decode step's: its bucket), each block is simply the tokens in order, those with no expert on
  rank ``r`` sent with ids -1 and weights 0 (the same bytes: ``capacity`` rows a block either way),
  which saves placing them (`_whole_blocks`: no slot per token to compute, nothing to scatter, and a
  combine that adds the ranks' blocks row by row).
- experts (``expert_path``): ``"grouped"`` sorts the ``world * capacity * k`` (row, slot) pairs by
  local expert on the device, with static shapes (`collectives._grouping`: stable sort, pairs
  without a local expert last), and runs a grouped matmul driven by a device group list, so the
  expert work is proportional to the routed pairs: ``npu_moe_init_routing_v2`` +
  ``npu_grouped_matmul`` (``group_list_type=1``) + ``npu_moe_finalize_routing`` on the NPU paths,
  ``argsort`` + ``torch._grouped_mm`` with device offsets on CPU / CUDA. ``"all"`` (the reference
  form) runs every local expert over every received row and keeps, per row, the weighted outputs
  of the experts it chose: ``experts_per_rank`` times the work, but any dtype and shape traces.
  ``"auto"`` (default) takes ``"grouped"`` where such a grouped matmul exists for the tokens'
  dtype and shapes (`collectives.experts.device_group_impl`; ``torch._grouped_mm`` takes only bf16
  on CUDA and while compiling), ``"all"`` otherwise; one local expert is always ``"all"``, which
  is then a plain matmul over the received rows (the grouped operator refuses a group list of one).
- combine: the reduced rows go back with the same static splits and each token sums what the
  ranks return in rank order, with static indices: deterministic.

Capacity: by default the number of tokens of the call, which can never overflow (a token goes at
most once to each rank). The same capacity must be used on every rank (the splits must match),
so ranks with different token counts pass an explicit one (e.g. the largest micro-batch). In
eager mode the layer checks with one small all-reduce (`overlap.agree`) before the exchange that the ranks
agree on it and on the hidden size, expert count, top-k and dtype, that none rejected its input and
that no rank sends more than ``capacity`` rows to one rank, and raises `LayoutError` on every rank
otherwise (``validate=False`` skips it; the layer then checks the shapes once, on its first call).
While compiling nothing can be read on the host: the capacity must then be at least the call's
token count (checked at trace time) and agreement across ranks is the caller's job.

A masked slot (an expert elsewhere, a padding row) contributes an exact zero, selected rather than
multiplied by a zero weight, so a non-finite expert output spoils only the rows that chose it.

`CapacityDispatchHandle` has the interface of every family (`collectives.handles`): ``wait()``
(nothing to wait for), ``expand()`` (the grouped pairs as a `CapacityBatch`) and ``combine()``.
`CapacityExchange` is this exchange as a `collectives.exchange.Exchange`: the static-shape layer's
(`collectives.capacity_expert_parallel`, graph prefill) and every decode step's (`CapacityExchange.for_decode`:
the step's capacity, the rows' metadata in the same all-to-all).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

import overlap
from overlap import GroupTransport, agree

from ._grouping import ROUTING_OPS, GroupedRows, group_rows, reduce_rows
from .exchange import ExpertLayer, RoutedTokens
from .experts import LocalExperts, device_group_impl, grouped_mlp, torch_npu_with
from .group import group_size, has_peers
from .layout import AGREED_HINTS, LayoutError, ReceivedMetadata, check_active, check_routing, fields_by_name, \
    local_metadata, token_in_rank, wire_fields, wire_of
from .quantize import as_float, received_hidden, received_tokens


@dataclasses.dataclass
class CapacityBatch:
    """The received (row, slot) pairs grouped by local expert on the device (a `collectives.handles.EPBatch`):
    ``x [W*C*k, H]``, ``group_list[e]`` pairs of expert ``e`` first, the pairs without a local expert last
    (padding: their outputs are never read). ``grouped`` is the grouping the combine reduces with."""

    grouped: GroupedRows

    @property
    def x(self) -> torch.Tensor:
        return self.grouped.x

    @property
    def group_list(self) -> torch.Tensor:
        return self.grouped.group_list

    @property
    def counts(self) -> List[int]:
        """Pairs per local expert on the host (a device synchronisation; experts take ``group_list``)."""
        return [int(c) for c in self.group_list.tolist()]


@dataclasses.dataclass
class CapacityDispatchHandle(ReceivedMetadata):
    """What a capacity dispatch received (``world * capacity`` rows, block ``r`` from rank ``r``)
    and where this rank's tokens went (for the combine); a `collectives.handles.EPDispatchHandle`."""

    recv_x: torch.Tensor  # [W*C, H]
    recv_meta: torch.Tensor  # [W*C, 2k] float32: local expert ids (-1: elsewhere or padding), then weights
    # [W, C] int64: token sent in each row of block r, num_tokens for padding; None: row t of every block is
    # token t (the capacity holds every token: `_whole_blocks`)
    slot_token: Optional[torch.Tensor]
    num_tokens: int
    capacity: int
    group: Optional[dist.ProcessGroup]
    dtype: torch.dtype
    num_local: int  # experts on this rank
    quantized: Optional[torch.dtype] = None  # the dispatch dtype: rows are `collectives.quantize.pack`'s; None: dtype

    @property
    def hidden(self) -> int:
        """The tokens' hidden size (the received rows hold a scale's columns more where quantized)."""
        return received_hidden(self.recv_x, self.quantized)

    def tokens(self) -> torch.Tensor:
        """The received rows in the tokens' dtype (dequantized per row where the dispatch quantized them)."""
        return as_float(received_tokens(self.recv_x, self.quantized), self.dtype)

    @property
    def top_k(self) -> int:
        return self.recv_meta.shape[1] // 2

    def wait(self) -> "CapacityDispatchHandle":
        """Nothing to wait for: the exchange was issued on the calling stream (ordering is the caller's job)."""
        return self

    def expand(self) -> CapacityBatch:
        """The received (row, slot) pairs grouped by local expert on the device, static shapes (torch_npu's
        routing operators on the NPU paths, a stable sort elsewhere; `collectives._grouping`)."""
        npu = torch_npu_with(*ROUTING_OPS)
        return CapacityBatch(group_rows(self.tokens(), self.recv_ids, self.recv_weights, self.num_local, npu))

    def combine(self, expert_out: torch.Tensor, batch: CapacityBatch, *, async_finish: bool = False,
                dtype: Optional[torch.dtype] = None) -> "CapacityCombineHandle":
        """`capacity_combine` of ``expert_out`` (one row per row of ``batch.x``), on the calling stream
        (``async_finish`` changes nothing: there is no side stream to wait for)."""
        return capacity_combine(expert_out, self, dtype, grouped=batch.grouped)


@dataclasses.dataclass
class CapacityCombineHandle:
    """Rows returned by every rank (block ``r`` from rank ``r``, in the order they were sent); `wait` sums them."""

    returned: torch.Tensor  # [W*C, H]
    slot_token: Optional[torch.Tensor]  # [W, C], or None: row t of every block is token t
    num_tokens: int
    dtype: torch.dtype
    world: int  # ranks of the group (the blocks of ``returned``)

    def wait(self) -> torch.Tensor:
        """The combined tokens ``[T, H]``: each token's rows summed in rank order, in float32."""
        if self.slot_token is None:  # a rank a token did not go to returned an exact zero for it
            rows, hidden = self.returned.shape
            blocks = self.returned.view(self.world, rows // self.world, hidden)[:, :self.num_tokens].float()
            out = blocks[0]
            for r in range(1, self.world):
                out = out + blocks[r]
            return out.to(self.dtype)
        world, cap = self.slot_token.shape
        out = torch.zeros(self.num_tokens + 1, self.returned.shape[-1], dtype=torch.float32,
                          device=self.returned.device)  # the last row collects the padding
        for r in range(world):
            out.index_add_(0, self.slot_token[r], self.returned[r * cap:(r + 1) * cap].float())
        return out[: self.num_tokens].to(self.dtype)


def _slots(in_rank: torch.Tensor, capacity: int) -> torch.Tensor:
    """``[W, C]``: the token in each row of each destination's block (token order), ``T`` for padding."""
    tokens, world = in_rank.shape
    dev = in_rank.device
    pos = in_rank.long().cumsum(0) - 1  # row of token t in block r, where it goes there
    flat = torch.arange(world, device=dev)[None, :] * capacity + pos
    spill = world * capacity  # one extra slot for every (token, rank) pair that is not sent
    flat = torch.where(in_rank & (pos < capacity), flat, torch.full_like(flat, spill))
    who = torch.arange(tokens, device=dev)[:, None].expand(tokens, world)
    slots = torch.full((spill + 1,), tokens, dtype=torch.int64, device=dev)
    slots.scatter_(0, flat.reshape(-1), who.reshape(-1))  # real slots are unique; the spill slot is dropped
    return slots[:spill].view(world, capacity)


_CAPACITY = "the capacity"
_CAPACITY_HINTS = {**AGREED_HINTS, _CAPACITY: "static split sizes need one capacity on every rank: pass the same "
                                              "explicit capacity everywhere"}


def _check_capacity(capacity: Optional[int], need: int, tokens: int, group: Optional[dist.ProcessGroup],
                    validate: bool, fields: Sequence[int], rejected: Optional[LayoutError] = None) -> None:
    """Raise `LayoutError` on every rank, before the exchange, if the ranks' capacities or ``fields``
    (`collectives.layout.layer_fields`) differ, one rejected its input or one sends more than
    ``capacity`` rows (``need``) to one rank: one all-reduce (`overlap.agree`).

    ``rejected``: this rank's own error (``capacity`` None: not known); it still takes part in the
    all-reduce, so that the other ranks raise too instead of waiting for it, then raises it.
    """
    if torch.compiler.is_compiling():
        if capacity is not None and capacity < tokens:
            raise LayoutError(f"capacity {capacity} is below the {tokens} tokens of this call: under torch.compile "
                              f"an overflow cannot be detected, so the capacity must be at least the token count")
        return
    if not validate:
        return
    values = fields_by_name(fields)
    problems = []
    if capacity is not None:
        values[_CAPACITY] = capacity
        if need > capacity:
            problems.append(f"sends {need} tokens to one expert-parallel rank, more than the capacity {capacity}; "
                            f"raise the capacity (the token count per rank always suffices)")
    agree(values, GroupTransport(group, "dispatch.capacity"), problems=problems, own_error=rejected,
          hints=_CAPACITY_HINTS, error=LayoutError)


def _exchange(x: torch.Tensor, capacity: int, group: Optional[dist.ProcessGroup], name: str) -> torch.Tensor:
    """Block ``r`` of ``x`` to rank ``r``, and rank ``r``'s block for us into block ``r`` of the result."""
    if not has_peers(group):
        return x
    out = torch.empty_like(x)
    splits = [capacity] * group_size(group)
    overlap.all_to_all_single(out, x, splits, splits, group=group, name=name)
    return out


def _exchange_with_metadata(send_x: torch.Tensor, send_meta: torch.Tensor, capacity: int,
                            group: Optional[dist.ProcessGroup]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The rows ``[W*C, H]`` and their float32 metadata ``[W*C, 2k]`` in one all-to-all: the metadata's bytes
    reinterpreted as the rows' dtype (not converted: ids and weights arrive bit for bit) and sent as extra columns,
    so a latency-bound step pays one exchange for its dispatch instead of two. What it returns are views of the
    received buffer, not read here (the exchange may still be in flight: its readers wait for it); where the
    shapes do not allow such views (decided from shapes alone, so every rank decides alike), two exchanges."""
    size, width = send_x.element_size(), send_x.shape[1]
    extra = send_meta.shape[1] * send_meta.element_size()
    if extra % size or (width * size) % 4:
        return _exchange(send_x, capacity, group, "dispatch"), _exchange(send_meta, capacity, group, "dispatch.meta")
    both = _exchange(torch.cat([send_x, send_meta.view(send_x.dtype)], dim=1), capacity, group, "dispatch")
    return both[:, :width], both[:, width:].view(torch.float32)


def _pack_blocks(x: torch.Tensor, idx: torch.Tensor, topk_weights: torch.Tensor, slot_token: torch.Tensor,
                 experts_per_rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The send buffers ``[W*C, H]`` and ``[W*C, 2k]`` (`collectives.layout.pack_metadata` rows): block
    ``r`` holds the tokens of ``slot_token[r]``, the padding slot (token ``T``) a zero row with no expert."""
    world, cap = slot_token.shape
    k = idx.shape[1]
    rows = slot_token.reshape(-1)
    ids = torch.cat([idx, idx.new_full((1, k), -1)]).index_select(0, rows).view(world, cap, k)
    w = torch.cat([topk_weights.float(), topk_weights.new_zeros(1, k, dtype=torch.float32)]).index_select(0, rows)
    owner = torch.arange(world, device=x.device)[:, None, None]  # the destination of every row of block r
    # Padding ids (-1) lie on rank -1, never an owner: their metadata is id -1, weight 0.
    send_meta = local_metadata(ids, w.view(world, cap, k), owner, experts_per_rank).view(world * cap, 2 * k)
    send_x = torch.cat([x.detach(), x.new_zeros(1, x.shape[1])]).index_select(0, rows)
    return send_x, send_meta


def _whole_blocks(x: torch.Tensor, idx: torch.Tensor, topk_weights: torch.Tensor, world: int, capacity: int,
                  experts_per_rank: int, active: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """`_pack_blocks` where ``capacity`` holds every token: block ``r`` is the tokens in order (then zero rows),
    each with its local expert ids on rank ``r`` (-1 where none: the row is sent and not used) and weights.
    ``active`` False: a padding token, -1 on every rank (no expert computes it)."""
    tokens, k = idx.shape
    x = x.detach()
    weights = topk_weights.float()
    if active is not None:
        idx = torch.where(active.view(tokens, 1), idx, -1)  # rank -1: not here anywhere, so its weights go to 0
    if capacity > tokens:
        pad = capacity - tokens
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        idx = torch.cat([idx, idx.new_full((pad, k), -1)])
        weights = torch.cat([weights, weights.new_zeros(pad, k)])
    owner = torch.arange(world, device=x.device)[:, None, None]  # the destination of every row of block r
    send_meta = local_metadata(idx[None], weights[None], owner, experts_per_rank).view(world * capacity, 2 * k)
    return x.repeat(world, 1), send_meta


def capacity_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                      group: Optional[dist.ProcessGroup] = None, capacity: Optional[int] = None, *,
                      validate: bool = True, dispatch_dtype: Optional[torch.dtype] = None) -> CapacityDispatchHandle:
    """Send tokens ``x [T, H]`` to the ranks holding their experts, ``capacity`` rows per rank (default ``T``).

    Issued on the current stream; ordering with the readers is the caller's job (as for
    `collectives.dispatch` with ``stream_tag=None``). Bad input raises before any tokens travel, on
    every rank when ``validate`` (see the module docstring). ``dispatch_dtype`` (int8, float8_e4m3fn): the rows
    travel quantized per token (`collectives.quantize`; ``tokens()`` of the handle dequantizes them).
    """
    return _capacity_dispatch(x, topk_idx, topk_weights, num_experts, group, capacity, validate,
                              dispatch_dtype=dispatch_dtype)


def _capacity_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                       group: Optional[dist.ProcessGroup], capacity: Optional[int], validate: bool,
                       precheck: Optional[Callable[[], None]] = None, one_exchange: bool = False,
                       active: Optional[torch.Tensor] = None,
                       dispatch_dtype: Optional[torch.dtype] = None) -> CapacityDispatchHandle:
    """`capacity_dispatch`; ``precheck`` (the layer's own checks) raises `LayoutError` like bad routing does;
    ``one_exchange``: the rows and their metadata travel in one all-to-all (`_exchange_with_metadata`);
    ``active`` (bool ``[T]``, `collectives.MOE_ACTIVE`; a capacity of at least ``T``): False for a padding row,
    sent to no expert; ``dispatch_dtype`` (int8, float8_e4m3fn; None: the tokens' own): the rows travel
    quantized per token, their scales as extra columns (`collectives.quantize`)."""
    world = group_size(group)
    fields = wire_fields(x, topk_idx, num_experts, dispatch_dtype)
    try:
        check_routing(x, topk_idx, topk_weights, num_experts, world)
        check_active(x, active)
        wire = wire_of(x, dispatch_dtype)
        tokens = topk_idx.shape[0]
        cap = tokens if capacity is None else int(capacity)
        if cap < 0:
            raise LayoutError(f"capacity must be >= 0, got {cap}")
        if active is not None and cap < tokens:
            raise LayoutError(f"a real-row mask needs a capacity of at least the {tokens} tokens, got {cap}")
        if precheck is not None:
            precheck()
    except LayoutError as err:
        if validate and not torch.compiler.is_compiling():
            _check_capacity(None, 0, 0, group, validate, fields, rejected=err)  # the others are in this all-reduce
        raise
    epr = num_experts // world
    idx = topk_idx.long()
    whole = cap >= tokens  # every token fits every block: nothing can overflow, nothing to place
    in_rank = None if whole else token_in_rank(idx, epr, world)
    need = 0 if whole or torch.compiler.is_compiling() or not validate or tokens == 0 else int(in_rank.sum(0).max())
    _check_capacity(cap, need, tokens, group, validate, fields)
    if whole:
        slot_token = None
        send_x, send_meta = _whole_blocks(wire, idx, topk_weights, world, cap, epr, active)
    else:
        slot_token = _slots(in_rank, cap)
        send_x, send_meta = _pack_blocks(wire, idx, topk_weights, slot_token, epr)
    if one_exchange:
        recv_x, recv_meta = _exchange_with_metadata(send_x, send_meta, cap, group)
    else:
        recv_x = _exchange(send_x, cap, group, "dispatch")
        recv_meta = _exchange(send_meta, cap, group, "dispatch.meta")
    return CapacityDispatchHandle(recv_x, recv_meta, slot_token, tokens, cap, group, x.dtype, epr, dispatch_dtype)


def all_local_experts(x: torch.Tensor, experts: LocalExperts) -> torch.Tensor:
    """Every local expert over every row: ``[E_local, R, H]`` (static shapes, see the module docstring)."""
    h = torch.matmul(x.unsqueeze(0), experts.gate_up.transpose(1, 2))
    g, u = h.chunk(2, dim=-1)
    return torch.matmul(experts.act(g) * u, experts.down.transpose(1, 2))


def reduce_slots(expert_out: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per row, the weighted outputs of its chosen local experts summed in slot order, in float32.

    ``expert_out [E_local, R, H]``; ``ids [R, k]`` local expert ids (-1: none), ``weights [R, k]``.
    A slot without a local expert adds an exact zero (selected, not multiplied by 0: NaN * 0 is NaN).
    """
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
    chosen = expert_out[ids.clamp(min=0), rows].float()  # [R, k, H]: every slot's expert over its row, at once
    zero = torch.zeros((), dtype=torch.float32, device=ids.device)
    terms = torch.where((ids >= 0)[..., None], chosen * weights.float()[..., None], zero)
    out = terms[:, 0]
    for s in range(1, ids.shape[1]):  # one slot after another, the reference's order
        out = out + terms[:, s]
    return out


EXPERT_PATHS = ("auto", "grouped", "all")


def expert_path(setting: str, x: torch.Tensor, experts: LocalExperts) -> str:
    """How the capacity exchange computes plain experts on rows ``x``: ``"all"`` (every local expert over every
    row), or the grouped matmul of `collectives.experts.device_group_impl` (``"npu_grouped"`` /
    ``"torch_grouped"``). ``setting``: one of `EXPERT_PATHS` (see the module docstring)."""
    if setting not in EXPERT_PATHS:
        raise ValueError(f"expert_path must be one of {EXPERT_PATHS}, got {setting!r}")
    if setting == "all" or experts.num_local == 1:
        return "all"
    which = device_group_impl(x, experts.gate_up, experts.down)
    if which is None and setting == "grouped":
        raise LayoutError(f"expert_path='grouped': no grouped matmul with a device group list on the "
                          f"{overlap.current_path()} path for {x.dtype} tokens of hidden size {x.shape[-1]} "
                          f"(torch_npu on NPU paths; torch._grouped_mm elsewhere: bf16 on CUDA and while "
                          f"compiling, 16-byte aligned rows); use 'auto' or 'all'")
    return which or "all"


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: LocalExperts,
                    impl: str) -> Tuple[torch.Tensor, GroupedRows]:
    """The local experts over received rows ``x [R, H]`` grouped on the device: ``(y [R*k, H], grouping)``,
    ``y`` in `GroupedRows` order, zero past the group list (see `collectives._grouping`)."""
    npu = torch_npu_with(*ROUTING_OPS) if impl == "npu_grouped" else None
    g = group_rows(x, ids, weights, experts.num_local, npu)
    return grouped_mlp(g.x, g.group_list, experts.gate_up, experts.down, experts.act, impl), g


def capacity_combine(expert_out: torch.Tensor, handle: CapacityDispatchHandle,
                     dtype: Optional[torch.dtype] = None, *, grouped: Optional[GroupedRows] = None
                     ) -> CapacityCombineHandle:
    """Reduce the expert outputs per received row and send the rows back (static splits).

    ``expert_out``: ``[E_local, W*C, H]`` (every expert over every received row), or with ``grouped``
    the ``[W*C*k, H]`` outputs of `grouped_experts`. Rows travel in ``dtype`` (default: the
    dispatched tokens' dtype, which must be the same on every rank: not checked, that would take a
    collective); `CapacityCombineHandle.wait` sums them. An output of another hidden size than the
    dispatched tokens is a `LayoutError` before the exchange.
    """
    rows, hidden = handle.recv_x.shape[0], handle.hidden
    # every rank sends back rows of the dispatched hidden size (agreed in the dispatch): checked here, locally
    if grouped is not None:
        pairs = grouped.x.shape[0]
        if expert_out.dim() != 2 or tuple(expert_out.shape) != (pairs, hidden) or grouped.num_rows != rows:
            raise LayoutError(f"grouped expert output must be [{pairs}, {hidden}] (one row per received (row, slot) "
                              f"pair, of the dispatched hidden size), got shape {tuple(expert_out.shape)}")
        partial = reduce_rows(expert_out, grouped).to(dtype or handle.dtype)
    elif expert_out.dim() != 3 or expert_out.shape[1:] != (rows, hidden):
        raise LayoutError(f"expert output must be [local experts, {rows}, {hidden}] (every expert over every "
                          f"received row, of the dispatched hidden size), got shape {tuple(expert_out.shape)}")
    else:
        partial = reduce_slots(expert_out, handle.recv_ids, handle.recv_weights).to(dtype or handle.dtype)
    returned = _exchange(partial, handle.capacity, handle.group, "combine")
    return CapacityCombineHandle(returned, handle.slot_token, handle.num_tokens, handle.dtype, group_size(handle.group))


# What the capacity exchange's experts ran over: the grouped pairs, or (every expert over every row) the received
# rows' local expert ids and weights
ExpertRows = Union[GroupedRows, Tuple[torch.Tensor, torch.Tensor]]


class CapacityExchange:
    """The capacity exchange as a `collectives.exchange.Exchange`: static shapes, nothing read on the host (see the
    module docstring); what graph prefill and every decode step take.

    ``capacity``: rows per destination rank where the call gives none (`RoutedTokens.capacity`; None: the call's
    token count). ``validate``: the ranks' agreement all-reduce on every call, the layer's shapes folded in on its
    first (else the layer's own on its first call only). ``expert_path``: one of `EXPERT_PATHS`, for plain experts;
    other forms take the grouped matmul of the path where there is one, else the loop over host counts (one
    host read). ``one_exchange``: the rows' metadata travels with them in the same all-to-all (one exchange per
    dispatch instead of two: a latency-bound step's), `for_decode`.
    """

    name = "capacity"

    def __init__(self, capacity: Optional[int] = None, *, validate: bool = True, expert_path: str = "auto",
                 one_exchange: bool = False):
        if capacity is not None and int(capacity) < 0:
            raise LayoutError(f"capacity must be >= 0, got {capacity}")
        if expert_path not in EXPERT_PATHS:
            raise ValueError(f"expert_path must be one of {EXPERT_PATHS}, got {expert_path!r}")
        self.capacity, self.validate = capacity, validate
        self.expert_path, self.one_exchange = expert_path, one_exchange

    @classmethod
    def for_decode(cls) -> "CapacityExchange":
        """A decode step's: the step's capacity (its bucket), the metadata with the rows, agreement on the layer's
        first call only (a step reads nothing on the host)."""
        return cls(validate=False, one_exchange=True)

    def two_step(self, layer: ExpertLayer) -> bool:
        """Never: there is no count exchange to issue apart."""
        return False

    def prepare(self, tokens: RoutedTokens, layer: ExpertLayer, *,
                ahead: bool = False) -> Tuple[RoutedTokens, ExpertLayer]:
        """Nothing to issue before the tokens: they are checked and sent in `dispatch`."""
        return tokens, layer

    def dispatch(self, prepared: Tuple[RoutedTokens, ExpertLayer]) -> CapacityDispatchHandle:
        """`capacity_dispatch` of the tokens, on the calling stream, the ranks' agreement as ``validate`` says."""
        tokens, layer = prepared
        capacity = self.capacity if tokens.capacity is None else tokens.capacity
        sent = (tokens.x, tokens.topk_idx, tokens.topk_weights, layer.num_experts, layer.group, capacity)
        if not self.validate:
            layer.shapes.check(tokens, layer)  # one all-reduce on the layer's first call: the prefill's, as a rule
            return _capacity_dispatch(*sent, False, one_exchange=self.one_exchange, active=tokens.active,
                                      dispatch_dtype=tokens.dispatch_dtype)
        precheck = layer.shapes.first_check(tokens, layer)  # the shapes ride in the capacity's own all-reduce
        handle = _capacity_dispatch(*sent, True, precheck, one_exchange=self.one_exchange, active=tokens.active,
                                    dispatch_dtype=tokens.dispatch_dtype)
        if precheck is not None:
            layer.shapes.checked = True
        return handle

    def run_experts(self, handle: CapacityDispatchHandle, experts: LocalExperts) -> Tuple[torch.Tensor, ExpertRows]:
        """The experts over the received rows: ``(every expert over every row, (ids, weights))`` on the ``"all"``
        path, else the grouped pairs' outputs and their `GroupedRows`."""
        plain = getattr(experts, "plain", True)
        x = handle.tokens()  # dequantized per row where the dispatch quantized them
        which = expert_path(self.expert_path, x, experts) if plain else device_group_impl(x, experts.gate_up,
                                                                                           experts.down)
        if which == "all":
            return all_local_experts(x, experts), (handle.recv_ids, handle.recv_weights)
        if plain:
            return grouped_experts(x, handle.recv_ids, handle.recv_weights, experts, which)
        npu = torch_npu_with(*ROUTING_OPS) if which == "npu_grouped" else None
        grouped = group_rows(x, handle.recv_ids, handle.recv_weights, experts.num_local, npu)
        return experts(grouped.x, grouped.group_list, impl=which or "loop"), grouped

    def combine(self, expert_out: torch.Tensor, batch: ExpertRows,
                handle: CapacityDispatchHandle) -> CapacityCombineHandle:
        """`capacity_combine` of ``expert_out``, grouped or every expert's as `run_experts` returned it."""
        return capacity_combine(expert_out, handle, grouped=batch if isinstance(batch, GroupedRows) else None)


__all__ = [
    "CapacityBatch", "CapacityCombineHandle", "CapacityDispatchHandle", "CapacityExchange", "EXPERT_PATHS",
    "all_local_experts", "capacity_combine", "capacity_dispatch", "expert_path", "grouped_experts", "reduce_slots",
]
