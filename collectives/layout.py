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
from typing import List, Optional, Sequence

import torch


class LayoutError(ValueError):
    """Input that would make the expert-parallel exchange wrong or hang; raised before any collective."""


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
    if topk_idx.shape[1] < 1:
        raise LayoutError("topk_idx has k = 0 experts per token")
    if num_experts < 1 or world_size < 1 or num_experts % world_size:
        raise LayoutError(f"{num_experts} experts cannot be placed contiguously over an expert-parallel group "
                          f"of {world_size} ranks: the expert count must be a positive multiple of the group size")
    if check_ids and topk_idx.numel() and not torch.compiler.is_compiling():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < 0 or hi >= num_experts:
            bad = lo if lo < 0 else hi
            raise LayoutError(f"expert id {bad} in topk_idx is out of range [0, {num_experts})")


def check_splits(what: str, splits: Sequence[int], world_size: int) -> List[int]:
    """Split sizes as a list of non-negative ints, one per rank."""
    out = [int(s) for s in splits]
    if len(out) != world_size:
        raise LayoutError(f"{len(out)} {what} for an expert-parallel group of {world_size} ranks")
    if any(s < 0 for s in out):
        raise LayoutError(f"{what} {out} contain a negative size")
    return out


def compute_layout(topk_idx: torch.Tensor, num_experts: int, world_size: int,
                   send_splits: Optional[Sequence[int]] = None) -> DispatchLayout:
    """Tokens per destination rank and per expert, and the order rows are sent in.

    Without ``send_splits`` the row counts are read on the host (a device synchronisation);
    with them the layout has static shapes. On CPU tensors given splits are checked against
    the routing, since a wrong split would corrupt or hang the exchange.
    """
    tokens, k = topk_idx.shape
    epr = num_experts // world_size
    idx = topk_idx.long()
    dest = torch.div(idx, epr, rounding_mode="floor")
    in_rank = torch.zeros(tokens, world_size, dtype=torch.bool, device=idx.device)
    in_rank.scatter_(1, dest, True)
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
    epr = layout.experts_per_rank
    ids = topk_idx.long()[layout.send_token]
    dest = layout.send_rank[:, None]
    here = torch.div(ids, epr, rounding_mode="floor") == dest
    local = torch.where(here, ids - dest * epr, torch.full_like(ids, -1))
    weights = torch.where(here, topk_weights[layout.send_token].float(), torch.zeros((), dtype=torch.float32,
                                                                                  device=ids.device))
    return torch.cat([local.float(), weights], dim=1)


@dataclasses.dataclass
class ExpertBatch:
    """Received tokens expanded to local experts: rows grouped by expert, in expert then arrival order."""

    x: torch.Tensor  # [N, H]
    counts: List[int]  # rows per local expert
    rows: torch.Tensor  # [N] received row of each expanded row
    slots: torch.Tensor  # [N] top-k slot of each expanded row
    num_rows: int  # received rows R
    top_k: int


def expand(recv_x: torch.Tensor, recv_meta: torch.Tensor, num_local: int,
           counts: Optional[Sequence[int]] = None) -> ExpertBatch:
    """Expand each received row to the local experts it chose (static shapes when ``counts`` is given)."""
    rows_n, k = recv_meta.shape[0], recv_meta.shape[1] // 2
    ids = recv_meta[:, :k].long().reshape(-1)
    key = torch.where(ids >= 0, ids, torch.full_like(ids, num_local))
    if counts is None:
        per = torch.zeros(num_local + 1, dtype=torch.int64, device=ids.device)
        per.scatter_add_(0, key, torch.ones_like(key))
        counts = per[:num_local].tolist()
    counts = [int(c) for c in counts]
    if len(counts) != num_local:
        raise LayoutError(f"{len(counts)} expert counts for {num_local} local experts")
    pairs = torch.argsort(key, stable=True)[: sum(counts)]
    rows, slots = torch.div(pairs, k, rounding_mode="floor"), pairs % k
    return ExpertBatch(recv_x.index_select(0, rows), counts, rows, slots, rows_n, k)


def reduce_local(expert_out: torch.Tensor, batch: ExpertBatch, recv_weights: torch.Tensor) -> torch.Tensor:
    """Per received row, the weighted sum of its local experts' outputs in slot order 0..k-1, in float32.

    Slots whose expert lives elsewhere add zero, as in `collectives.reference.combine_dense`.
    """
    plan = local_plan(expert_out, batch, recv_weights)
    if plan is None:
        return _reduce_local_dense(expert_out, batch, recv_weights)
    out = torch.empty(batch.num_rows, expert_out.shape[-1], dtype=torch.float32, device=expert_out.device)
    reduce_rows_into(out, expert_out, plan, 0, batch.num_rows)
    return out


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
    where = where.clamp(max=n - 1)
    weights = torch.where(here, recv_weights, torch.zeros((), dtype=recv_weights.dtype, device=here.device))
    out = None
    for s in range(batch.top_k):
        term = expert_out.index_select(0, where[:, s]).float().mul_(weights[:, s, None])
        out = term if out is None else out.add_(term)  # 0 + first term is the first term: start from it
    return out


@dataclasses.dataclass
class LocalPlan:
    """Which expanded rows make up each received row (eager CPU form of `reduce_local`).

    Row r is ``expert_out[first[r]] * first_w[r]`` plus, for each later slot s holding a local
    expert, ``expert_out[later_src[s][i]] * later_w[s][i]`` added at row ``later_rows[s][i]``
    (sorted), in slot order.
    """

    first: torch.Tensor  # [R]
    first_w: torch.Tensor  # [R, 1] float32
    later_rows: List[torch.Tensor]
    later_src: List[torch.Tensor]
    later_w: List[torch.Tensor]


def _eager_cpu(t: torch.Tensor) -> bool:
    """Whether the fast paths apply: they read sizes on the host (never while tracing) and write into
    preallocated outputs (not differentiable)."""
    return (t.device.type == "cpu" and not torch.compiler.is_compiling()
            and not (t.requires_grad and torch.is_grad_enabled()))


def local_plan(expert_out: torch.Tensor, batch: ExpertBatch, recv_weights: torch.Tensor) -> Optional[LocalPlan]:
    """The plan of `reduce_rows_into`, or None where the static-shape form must be used instead (not
    eager CPU, no expanded rows, or a received row without any local expert)."""
    if not _eager_cpu(expert_out) or expert_out.shape[0] == 0:
        return None
    where = _slot_rows(expert_out, batch)
    here = where < expert_out.shape[0]
    if not bool(here.any(dim=1).all()):  # not produced by dispatch, but allowed: the dense form zeroes them
        return None
    first = here.to(torch.int8).argmax(dim=1)  # first local slot of each row
    plan = LocalPlan(where.gather(1, first[:, None]).squeeze(1), recv_weights.gather(1, first[:, None]).float(),
                     [], [], [])
    later = here.clone()
    later.scatter_(1, first[:, None], False)
    for s in range(1, batch.top_k):
        sel = later[:, s].nonzero().squeeze(1)
        if sel.numel():
            plan.later_rows.append(sel)
            plan.later_src.append(where[sel, s])
            plan.later_w.append(recv_weights[sel, s, None].float())
    return plan


_CHUNK_BYTES = 1 << 19


def reduce_rows_into(out: torch.Tensor, expert_out: torch.Tensor, plan: LocalPlan, lo: int, hi: int,
                     dest: Optional[torch.Tensor] = None) -> None:
    """Rows ``lo:hi`` of `reduce_local` written into ``out`` (cast to its dtype): row ``r`` to ``out[r - lo]``,
    or to ``out[dest[r - lo]]`` when ``dest`` is given.

    Works through cache-sized chunks of rows, gathering, scaling and adding each chunk's slots
    while it is in cache: one memory pass. Same float32 operations, in the same order, as the
    static-shape form, whose absent slots add an exact zero.
    """
    hidden = expert_out.shape[-1]
    step = max(16, _CHUNK_BYTES // max(1, hidden * 4))
    bounds = list(range(lo, hi, step)) + [hi]
    edges = torch.tensor(bounds, dtype=torch.int64)
    cuts = [torch.searchsorted(rows, edges).tolist() for rows in plan.later_rows]
    in_place = out.dtype == torch.float32 and dest is None
    scratch = None if in_place else torch.empty(step, hidden, dtype=torch.float32)
    for i in range(len(bounds) - 1):
        a, b = bounds[i], bounds[i + 1]
        acc = out[a - lo:b - lo] if in_place else scratch[: b - a]
        if expert_out.dtype == torch.float32:
            torch.index_select(expert_out, 0, plan.first[a:b], out=acc)
        else:
            acc.copy_(expert_out.index_select(0, plan.first[a:b]))
        acc.mul_(plan.first_w[a:b])
        for rows, src, w, cut in zip(plan.later_rows, plan.later_src, plan.later_w, cuts):
            p, q = cut[i], cut[i + 1]
            if q > p:
                term = expert_out.index_select(0, src[p:q]).float().mul_(w[p:q])
                acc.index_add_(0, rows[p:q] - a, term)
        if dest is not None:
            out.index_copy_(0, dest[a - lo:b - lo], acc.to(out.dtype))
        elif not in_place:
            out[a - lo:b - lo].copy_(acc)


def zero_missing(out: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Zero the rows of ``out`` not listed in ``tokens``; returns ``out``."""
    if tokens.numel() < out.shape[0]:
        hit = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
        hit[tokens] = True
        out.index_fill_(0, (~hit).nonzero().squeeze(1), 0.0)
    return out


def sum_first(tokens: torch.Tensor, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """A float32 ``[num_tokens, H]`` holding ``rows`` at ``tokens`` (unique) and zero elsewhere: the
    first term of a per-token sum, written once instead of added to zeros (same values)."""
    hidden = rows.shape[-1]
    if not _eager_cpu(rows):
        out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=rows.device)
        out.index_add_(0, tokens, rows.float())
        return out
    out = torch.empty(num_tokens, hidden, dtype=torch.float32, device=rows.device)
    out.index_copy_(0, tokens, rows.float())
    return zero_missing(out, tokens)


def reduce_ranks(returned: torch.Tensor, layout: DispatchLayout, hidden: int) -> torch.Tensor:
    """Sum the rows returned by each rank into their tokens, rank 0 first (a fixed order), in float32."""
    out = torch.zeros(layout.num_tokens, hidden, dtype=torch.float32, device=returned.device)
    start = 0
    for n in layout.send_splits:
        if n:
            out.index_add_(0, layout.send_token[start:start + n], returned[start:start + n].float())
        start += n
    return out
