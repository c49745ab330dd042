"""Where each token goes, and how received tokens are spread over local experts: no collectives here.

Experts are placed contiguously: rank ``r`` of a group of ``W`` holds experts
``r * E/W ... (r + 1) * E/W - 1``. A token is sent at most once to each destination rank, however
many of its k experts live there (DeepEP's deduplication); with it travels a small metadata row
telling the receiver which of its local experts the token chose, and with which weight.

Every function here is plain tensor code with shapes that are static once the split sizes are
known, so it traces under ``torch.compile(fullgraph=True)`` when the caller passes them.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F

import overlap

from .experts import group_list
from .quantize import NonFiniteTokens, wire_tokens


class LayoutError(ValueError):
    """Input that would make the expert-parallel exchange wrong or hang; raised before any tokens are exchanged."""


# What every rank of an expert-parallel group must agree on, in the order `layer_fields` lists them,
# and the argument of `collectives.dispatch.dispatch` each comes from (named in the messages).
AGREED_FIELDS = ("hidden size", "number of experts", "top-k", "dtype of the tokens")
AGREED_ARGS = ("x.shape[1]", "num_experts", "topk_idx.shape[1]", "x.dtype")
# Every dtype of this torch, in a fixed order, so that ranks can compare dtypes as integers.
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
# Local expert ids travel as float32 in the metadata rows: exact below 2**24.
_MAX_LOCAL_EXPERTS = 1 << 24
_FIELD_LIMIT = 1 << 62  # fields travel as int64: an absurd expert count is clamped, still unequal to a sane one


def dtype_code(dtype: torch.dtype) -> int:
    """``dtype`` as a positive integer, the same on every rank running the same torch."""
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else len(_DTYPES) + 1


def layer_fields(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int) -> List[int]:
    """The `AGREED_FIELDS` of one call, as integers (0 where a shape is too malformed to tell)."""
    hidden = x.shape[-1] if x.dim() else 0
    k = topk_idx.shape[-1] if topk_idx.dim() else 0
    experts = max(-_FIELD_LIMIT, min(_FIELD_LIMIT, int(num_experts)))
    return [int(hidden), experts, int(k), dtype_code(x.dtype)]


def wire_fields(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int,
                dispatch_dtype: Optional[torch.dtype]) -> List[int]:
    """`layer_fields`, the dtype the tokens travel in (``dispatch_dtype``, else their own) as the dtype: ranks that
    quantize differently disagree on it before any token travels."""
    fields = layer_fields(x, topk_idx, num_experts)
    if dispatch_dtype is not None:
        fields[-1] = dtype_code(dispatch_dtype)
    return fields


def wire_of(x: torch.Tensor, dispatch_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """`collectives.quantize.wire_tokens`: what a dispatch sends for ``x``; a token holding NaN or inf where it
    quantizes is a `LayoutError` (raised before any token travels, so every rank's exchange refuses it)."""
    try:
        return wire_tokens(x, dispatch_dtype)
    except NonFiniteTokens as err:
        raise LayoutError(str(err)) from None


def _field_value(i: int, code: int) -> Union[int, str]:
    """Field ``i``'s value as the user wrote it (a dtype's name for the dtype's code)."""
    if AGREED_ARGS[i] == "x.dtype":
        return str(_DTYPES[code - 1]) if 0 < code <= len(_DTYPES) else "another dtype"
    return int(code)


def fields_by_name(fields: Sequence[int]) -> Dict[str, Union[int, str]]:
    """`layer_fields` by the names `overlap.agree` says when ranks differ (`AGREED_HINTS` says what to do)."""
    return {f"the {name} ({arg})": _field_value(i, code)
            for i, (name, arg, code) in enumerate(zip(AGREED_FIELDS, AGREED_ARGS, fields))}


AGREED_HINTS = {f"the {name} ({arg})": f"every rank of the expert-parallel group must pass the same {arg} (build the "
                                       f"same layer, pass tokens of one hidden size and dtype)"
                for name, arg in zip(AGREED_FIELDS, AGREED_ARGS)}


@dataclasses.dataclass
class DispatchLayout:
    """The send side of one dispatch.

    ``send_token[i]`` is the local token index of the i-th row sent; rows are ordered by
    destination rank, then by token index. ``send_splits[r]`` rows go to rank ``r``.
    """

    world_size: int
    num_experts: int
    num_tokens: int
    top_k: int
    num_tokens_per_rank: torch.Tensor  # [W] int64, deduplicated rows per destination rank
    num_tokens_per_expert: torch.Tensor  # [E] int64, (token, slot) pairs per expert
    is_token_in_rank: torch.Tensor  # [T, W] bool
    send_token: torch.Tensor  # [S] int64
    send_rank: torch.Tensor  # [S] int64, destination of each row
    send_splits: List[int]

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def num_send(self) -> int:
        return sum(self.send_splits)


def check_routing(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                  world_size: int, check_ids: bool = True) -> None:
    """Reject malformed routing with a message naming the problem (call before any collective).

    ``check_ids`` reads the ids on the host (a device synchronisation); it is skipped while tracing.
    """
    if x.dim() != 2:
        raise LayoutError(f"tokens must be [tokens, hidden], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise LayoutError(f"tokens must be floating point, got {x.dtype}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise LayoutError(f"topk_idx must be [tokens, k] = [{x.shape[0]}, k], got shape {tuple(topk_idx.shape)}")
    if topk_idx.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise LayoutError(f"topk_idx must hold integer expert ids, got {topk_idx.dtype}")
    if topk_weights.shape != topk_idx.shape:
        raise LayoutError(f"topk_weights shape {tuple(topk_weights.shape)} differs from topk_idx "
                          f"shape {tuple(topk_idx.shape)}")
    if not topk_weights.is_floating_point():
        raise LayoutError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if topk_idx.device != x.device or topk_weights.device != x.device:
        raise LayoutError(f"tokens, topk_idx and topk_weights must be on one device, got {x.device}, "
                          f"{topk_idx.device} and {topk_weights.device}")
    if topk_idx.shape[1] < 1:
        raise LayoutError("topk_idx has k = 0 experts per token")
    if num_experts < 1 or world_size < 1 or num_experts % world_size:
        raise LayoutError(f"{num_experts} experts cannot be placed contiguously over an expert-parallel group "
                          f"of {world_size} ranks: the expert count must be a positive multiple of the group size")
    if num_experts // world_size > _MAX_LOCAL_EXPERTS:
        raise LayoutError(f"{num_experts // world_size} experts per rank: local expert ids travel as float32, "
                          f"exact only up to {_MAX_LOCAL_EXPERTS}")
    if check_ids and topk_idx.numel() and overlap.host_reads_allowed():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < 0 or hi >= num_experts:
            bad = lo if lo < 0 else hi
            raise LayoutError(f"expert id {bad} in topk_idx is out of range [0, {num_experts})")


def check_active(x: torch.Tensor, active: Optional[torch.Tensor]) -> None:
    """Reject a malformed real-row mask (`collectives.MOE_ACTIVE`): None, or bool ``[tokens]`` on the tokens'
    device (shapes only: nothing read on the host)."""
    if active is None:
        return
    if not isinstance(active, torch.Tensor) or active.dtype != torch.bool or tuple(active.shape) != (x.shape[0],):
        got = f"{active.dtype} {tuple(active.shape)}" if isinstance(active, torch.Tensor) else type(active).__name__
        raise LayoutError(f"the real-row mask must be a bool tensor [{x.shape[0]}] (one flag per token), got {got}")
    if active.device != x.device:
        raise LayoutError(f"the real-row mask is on {active.device}, the tokens on {x.device}")


def check_splits(what: str, splits: Sequence[int], world_size: int) -> List[int]:
    """Split sizes as a list of non-negative ints, one per rank."""
    out = [int(s) for s in splits]
    if len(out) != world_size:
        raise LayoutError(f"{len(out)} {what} for an expert-parallel group of {world_size} ranks")
    if any(s < 0 for s in out):
        raise LayoutError(f"{what} {out} contain a negative size")
    return out


def expert_rank(ids: torch.Tensor, experts_per_rank: int) -> torch.Tensor:
    """The rank holding each expert id (contiguous placement); the padding id -1 maps to rank -1."""
    return torch.div(ids, experts_per_rank, rounding_mode="floor")


def token_in_rank(idx: torch.Tensor, experts_per_rank: int, world_size: int) -> torch.Tensor:
    """``[T, W]`` bool: whether token t chose an expert on rank r (it is sent there once). ``idx`` is int64."""
    in_rank = torch.zeros(idx.shape[0], world_size, dtype=torch.bool, device=idx.device)
    return in_rank.scatter_(1, expert_rank(idx, experts_per_rank), True)


def compute_layout(topk_idx: torch.Tensor, num_experts: int, world_size: int,
                   send_splits: Optional[Sequence[int]] = None) -> DispatchLayout:
    """Tokens per destination rank and per expert, and the order rows are sent in.

    Without ``send_splits`` the row counts are read on the host (a device synchronisation);
    with them the layout has static shapes. On CPU tensors given splits are checked against
    the routing, since a wrong split would corrupt or hang the exchange.
    """
    tokens, k = topk_idx.shape
    idx = topk_idx.long()
    in_rank = token_in_rank(idx, num_experts // world_size, world_size)
    per_rank = in_rank.sum(0)
    per_expert = torch.zeros(num_experts, dtype=torch.int64, device=idx.device)
    per_expert.scatter_add_(0, idx.reshape(-1), torch.ones_like(idx.reshape(-1)))
    if send_splits is None:
        splits = [int(s) for s in per_rank.tolist()]
    else:
        splits = check_splits("send split sizes", send_splits, world_size)
        if idx.device.type == "cpu" and not torch.compiler.is_compiling() and splits != per_rank.tolist():
            raise LayoutError(f"send split sizes {splits} disagree with the routing, which sends "
                              f"{per_rank.tolist()} deduplicated tokens to the ranks")
    # Valid (rank, token) pairs first, in rank-major then token order; a stable sort keeps shapes static.
    flat = in_rank.t().reshape(-1)
    order = torch.argsort((~flat).to(torch.int32), stable=True)[: sum(splits)]
    if tokens:
        send_token, send_rank = order % tokens, torch.div(order, tokens, rounding_mode="floor")
    else:
        send_token = send_rank = order
    return DispatchLayout(world_size, num_experts, tokens, k, per_rank, per_expert, in_rank, send_token, send_rank,
                          splits)


def pack_metadata(layout: DispatchLayout, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """One float32 row per sent token: the k local expert ids on its destination (-1: not there), then the k weights.

    Ids travel as float32, exact below 2**24 experts; one metadata tensor keeps the dispatch at
    two exchanges (tokens, metadata).
    """
    return local_metadata(topk_idx.long()[layout.send_token], topk_weights[layout.send_token],
                          layout.send_rank[:, None], layout.experts_per_rank)


def local_metadata(ids: torch.Tensor, weights: torch.Tensor, dest: torch.Tensor,
                   experts_per_rank: int) -> torch.Tensor:
    """Metadata rows (see `pack_metadata`) for rows with expert ids ``ids [..., k]`` (int64; -1 for none)
    and ``weights [..., k]`` sent to rank ``dest`` (broadcast against them): ``[..., 2k]`` float32."""
    here = expert_rank(ids, experts_per_rank) == dest
    local = torch.where(here, ids - dest * experts_per_rank, torch.full_like(ids, -1))
    weights = torch.where(here, weights.float(), torch.zeros((), dtype=torch.float32, device=ids.device))
    return torch.cat([local.float(), weights], dim=-1)


def metadata_ids(meta: torch.Tensor) -> torch.Tensor:
    """The local expert ids ``[R, k]`` (int64, -1: not on this rank) of metadata rows ``[R, 2k]``."""
    return meta[:, : meta.shape[1] // 2].long()


def metadata_weights(meta: torch.Tensor) -> torch.Tensor:
    """The weights ``[R, k]`` (float32, 0 where the expert is not on this rank) of metadata rows ``[R, 2k]``."""
    return meta[:, meta.shape[1] // 2:]


class ReceivedMetadata:
    """For dispatch handles: the local expert ids and weights of the received rows (``self.recv_meta``)."""

    recv_meta: torch.Tensor

    @property
    def recv_ids(self) -> torch.Tensor:
        return metadata_ids(self.recv_meta)

    @property
    def recv_weights(self) -> torch.Tensor:
        return metadata_weights(self.recv_meta)


@dataclasses.dataclass
class ExpertBatch:
    """Received tokens expanded to local experts: rows grouped by expert, in expert then arrival order."""

    x: torch.Tensor  # [N, H]
    counts: List[int]  # rows per local expert
    rows: torch.Tensor  # [N] received row of each expanded row
    slots: torch.Tensor  # [N] top-k slot of each expanded row
    num_rows: int  # received rows R
    top_k: int

    @property
    def group_list(self) -> torch.Tensor:
        """``counts`` as an int64 tensor ``[E_local]`` on ``x``'s device (`collectives.handles.EPBatch`): copied
        from the host counts, once per distinct value, device and stream (`collectives.experts.group_list`)."""
        return group_list(self.counts, self.x.device)


def expand(recv_x: torch.Tensor, recv_meta: torch.Tensor, num_local: int,
           counts: Optional[Sequence[int]] = None, verify: bool = True) -> ExpertBatch:
    """Expand each received row to the local experts it chose (static shapes when ``counts`` is given).

    Given ``counts`` are checked against the metadata on eager CPU tensors (``verify=False``: they
    are known to be right, e.g. from the count exchange).
    """
    rows_n, k = recv_meta.shape[0], recv_meta.shape[1] // 2
    ids = metadata_ids(recv_meta).reshape(-1)
    key = torch.where(ids >= 0, ids, torch.full_like(ids, num_local))
    given = counts is not None
    if given:
        counts = [int(c) for c in counts]
        if len(counts) != num_local:
            raise LayoutError(f"{len(counts)} expert counts for {num_local} local experts")
    if not given or (verify and ids.device.type == "cpu" and not torch.compiler.is_compiling()):
        per = torch.zeros(num_local + 1, dtype=torch.int64, device=ids.device)
        per.scatter_add_(0, key, torch.ones_like(key))
        actual = per[:num_local].tolist()
        if given and counts != actual:  # a wrong count would silently drop or misassign rows
            raise LayoutError(f"expert counts {counts} disagree with the received rows, which hold {actual} "
                              f"rows per local expert")
        counts = actual
    pairs = torch.argsort(key, stable=True)[: sum(counts)]
    rows, slots = torch.div(pairs, k, rounding_mode="floor"), pairs % k
    return ExpertBatch(recv_x.index_select(0, rows), counts, rows, slots, rows_n, k)


def reduce_local(expert_out: torch.Tensor, batch: ExpertBatch, recv_weights: torch.Tensor) -> torch.Tensor:
    """Per received row, the weighted sum of its local experts' outputs in slot order 0..k-1, in float32.

    Slots whose expert lives elsewhere add an exact zero, as in `collectives.reference.combine_dense`:
    a non-finite expert output spoils only the rows that chose that expert.
    """
    bags = local_bags(expert_out, batch, recv_weights)
    if bags is None:
        return _reduce_local_dense(expert_out, batch, recv_weights)
    return reduce_bags(expert_out, bags, 0, batch.num_rows)


def _slot_rows(expert_out: torch.Tensor, batch: ExpertBatch) -> torch.Tensor:
    """``where[r, s]``: the expanded row holding row r's slot s (``N``: the expert lives elsewhere)."""
    n = expert_out.shape[0]
    where = torch.full((batch.num_rows, batch.top_k), n, dtype=torch.int64, device=expert_out.device)
    where[batch.rows, batch.slots] = torch.arange(n, device=expert_out.device)
    return where


def _reduce_local_dense(expert_out: torch.Tensor, batch: ExpertBatch, recv_weights: torch.Tensor) -> torch.Tensor:
    """Static-shape form (tracing, devices, autograd): one gather per slot over all rows."""
    hidden, n = expert_out.shape[-1], expert_out.shape[0]
    if n == 0:
        return torch.zeros(batch.num_rows, hidden, dtype=torch.float32, device=expert_out.device)
    where = _slot_rows(expert_out, batch)
    here = where < n
    where = where.clamp(max=n - 1)  # slots elsewhere read some row: selected away below, never multiplied by 0
    zero = torch.zeros((), dtype=torch.float32, device=expert_out.device)
    out = None
    for s in range(batch.top_k):
        term = expert_out.index_select(0, where[:, s]).float().mul_(recv_weights[:, s, None])
        term = torch.where(here[:, s, None], term, zero)  # NaN * 0 is NaN: select instead
        out = term if out is None else out.add_(term)  # 0 + first term is the first term: start from it
    return out


@dataclasses.dataclass
class LocalBags:
    """Each received row's local slots as a bag of expanded rows (eager CPU form of `reduce_local`).

    Row r is the sum of ``weight[i] * expert_out[src[i]]`` for ``i`` in ``start[r]:start[r + 1]``,
    in slot order; a row without a local slot is an empty bag (zero).
    """

    src: torch.Tensor  # [P] expanded row of each (received row, local slot) pair, row-major
    weight: torch.Tensor  # [P] float32
    start: torch.Tensor  # [R + 1] int64


def _eager_cpu(t: torch.Tensor) -> bool:
    """Whether the fast path applies: it reads sizes on the host (never while tracing) and is not
    differentiable."""
    return (t.device.type == "cpu" and not torch.compiler.is_compiling()
            and not (t.requires_grad and torch.is_grad_enabled()))


def local_bags(expert_out: torch.Tensor, batch: ExpertBatch, recv_weights: torch.Tensor) -> Optional[LocalBags]:
    """The bags `reduce_bags` reduces, or None where the static-shape form must be used instead (not
    eager CPU, or no expanded rows)."""
    if not _eager_cpu(expert_out) or expert_out.shape[0] == 0:
        return None
    where = _slot_rows(expert_out, batch)
    here = where < expert_out.shape[0]
    start = torch.zeros(batch.num_rows + 1, dtype=torch.int64)
    torch.cumsum(here.sum(1), 0, out=start[1:])
    pairs = here.reshape(-1)
    return LocalBags(where.reshape(-1)[pairs], recv_weights.reshape(-1)[pairs].float(), start)


_CHUNK_BYTES = 1 << 20


def reduce_bags(expert_out: torch.Tensor, bags: LocalBags, lo: int, hi: int,
                tokens: Optional[torch.Tensor] = None, num_tokens: int = 0,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows ``lo:hi`` of `reduce_local`, one pass over the expert outputs (``embedding_bag``).

    With ``tokens`` (ascending, one per row) the result is ``[num_tokens, H]`` instead: row r lands
    at ``tokens[r - lo]``, every other token is zero. Weights and sums are float32 at any dtype of
    ``expert_out``; the result is float32, or written into ``out`` (rounded to its dtype).
    """
    a, b = int(bags.start[lo]), int(bags.start[hi])
    counts = bags.start[lo + 1:hi + 1] - bags.start[lo:hi]
    if tokens is not None:
        per_token = torch.zeros(num_tokens, dtype=torch.int64)
        per_token[tokens] = counts
        counts = per_token
    offsets = torch.zeros_like(counts)
    torch.cumsum(counts[:-1], 0, out=offsets[1:])
    src, weight = bags.src[a:b], bags.weight[a:b]
    if expert_out.dtype == torch.float32 and out is None:
        return F.embedding_bag(src, expert_out, offsets, mode="sum", per_sample_weights=weight)
    # A cache-sized chunk of bags at a time: widened to float32 where needed, summed, then stored.
    hidden, bags = expert_out.shape[-1], counts.shape[0]
    if out is None:
        out = torch.empty(bags, hidden, dtype=torch.float32)
    step = max(16, _CHUNK_BYTES // max(1, hidden * 4))
    edges = offsets[::step].tolist() + [b - a]
    for i, c in enumerate(range(0, bags, step)):
        p, q = edges[i], edges[i + 1]
        if expert_out.dtype == torch.float32:
            part = F.embedding_bag(src[p:q], expert_out, offsets[c:c + step] - p, mode="sum",
                                   per_sample_weights=weight[p:q])
        else:
            rows = expert_out.index_select(0, src[p:q]).float()
            part = F.embedding_bag(torch.arange(q - p), rows, offsets[c:c + step] - p, mode="sum",
                                   per_sample_weights=weight[p:q])
        out[c:c + step] = part
    return out


def sum_first(tokens: torch.Tensor, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """A float32 ``[num_tokens, H]`` holding ``rows`` at ``tokens`` (unique) and zero elsewhere: the
    first term of a per-token sum."""
    out = torch.zeros(num_tokens, rows.shape[-1], dtype=torch.float32, device=rows.device)
    out.index_add_(0, tokens, rows.float())
    return out


def reduce_ranks(returned: torch.Tensor, layout: DispatchLayout, hidden: int) -> torch.Tensor:
    """Sum the rows returned by each rank into their tokens, rank 0 first (a fixed order), in float32."""
    out = torch.zeros(layout.num_tokens, hidden, dtype=torch.float32, device=returned.device)
    start = 0
    for n in layout.send_splits:
        if n:
            out.index_add_(0, layout.send_token[start:start + n], returned[start:start + n].float())
        start += n
    return out
