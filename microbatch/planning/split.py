"""Splitting a packed prefill batch into N balanced micro-batches (N = 2 by default), agreed by every rank.

A packed batch is the tokens of several requests laid end to end; `microbatch.batch.SeqInfo` describes it.
`propose_split` decides, from the request lengths alone, where micro-batches 1..N-1 start:

1. at the N-1 request boundaries that balance the token counts best (the smallest spread
   ``(largest - smallest) / total``; for two parts ``|n0 - n1| / (n0 + n1)``);
2. if those leave an imbalance above ``max_imbalance``, at evenly spaced tokens, cutting
   requests: a cut request's later part attends to the keys and values of its earlier parts
   (`prefix_kv`). A long request may be cut more than once and then spans several micro-batches:
   the prefix of its part in micro-batch ``i`` is its rows in every earlier micro-batch, in order
   (`prefix_sources`);
3. a batch of one token, or of fewer than ``min_tokens`` (two parts) or ``n * min_tokens / 2``
   (n parts) tokens, is not split into n parts: it falls back to the most parts it has tokens
   for, else runs serially (``plan.serial``), and the plan says why. With ``allow_cut=False`` (a
   model whose layers cannot continue a request from a prefix) there is no step 2: a batch
   without balanced enough boundaries for n parts tries fewer, else runs serially.

Micro-batch ``i`` is always the packed tokens ``[points[i-1], points[i])``, so slicing and
merging are cuts along the token dimension. `agree_split` makes every rank of a group take the
same decision, split-or-serial and the number of micro-batches, with one small all-reduce:
ranks that split differently would issue different collectives and hang.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..batch import Batch, SeqInfo, check_lens

logger = logging.getLogger(__name__)

DEFAULT_MIN_TOKENS = 32
DEFAULT_MAX_IMBALANCE = 0.1
MAX_MICRO_BATCHES = 30  # the agreement votes one bit per micro-batch count in an int32


@dataclasses.dataclass(frozen=True)
class Split:
    """Where micro-batches 1..N-1 start in a packed batch (``points``), or serial (``split_at`` None).

    ``split_at`` is the first split point (where micro-batch 1 starts), ``points`` all N-1 of them
    (a plan built with ``split_at`` alone has two parts). ``reason`` says why, in words (logged by
    `agree_split`). ``cut`` is ``(request, offset)`` of the first split point that falls inside a
    request (its first ``offset`` tokens are in earlier micro-batches), ``cuts`` every such point.
    ``fewer`` are this batch's plans with fewer micro-batches, most first, that `agree_split`
    falls back to when another rank cannot split into as many.
    """

    seq_lens: Tuple[int, ...]
    split_at: Optional[int]
    reason: str
    points: Tuple[int, ...] = ()
    fewer: Tuple["Split", ...] = dataclasses.field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.split_at is None:  # serial, whatever the other fields say
            object.__setattr__(self, "points", ())
            object.__setattr__(self, "fewer", ())
            return
        points = tuple(self.points) or (self.split_at,)
        total = sum(self.seq_lens)
        if points[0] != self.split_at or not all(a < b for a, b in zip((0,) + points, points + (total,))):
            raise ValueError(f"split points {list(points)} (split_at {self.split_at}) must increase strictly inside "
                             f"the batch's {total} tokens, starting at split_at")
        object.__setattr__(self, "points", points)

    @property
    def serial(self) -> bool:
        return self.split_at is None

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def n_parts(self) -> int:
        """The number of micro-batches (1 when serial)."""
        return len(self.points) + 1

    @property
    def edges(self) -> Tuple[int, ...]:
        """``(0, *points, num_tokens)``: micro-batch ``i`` holds the packed tokens ``[edges[i], edges[i + 1])``."""
        return (0,) + self.points + (self.num_tokens,)

    @property
    def token_counts(self) -> Tuple[int, ...]:
        """Tokens in each micro-batch (``(num_tokens, 0)`` when serial)."""
        if self.split_at is None:
            return self.num_tokens, 0
        edges = self.edges
        return tuple(b - a for a, b in zip(edges, edges[1:]))

    @property
    def imbalance(self) -> float:
        """``(largest - smallest) / total`` of the micro-batches' tokens (1.0 when serial)."""
        return _spread(self.token_counts) / self.num_tokens if self.split_at is not None else 1.0

    @property
    def cuts(self) -> Tuple[Tuple[int, int], ...]:
        """``(request, offset)`` of every split point inside a request, in order."""
        cu = SeqInfo(self.seq_lens).cu_seqlens
        return tuple(at for at in (_position(cu, p) for p in self.points) if at[1])

    @property
    def cut(self) -> Optional[Tuple[int, int]]:
        cuts = self.cuts
        return cuts[0] if cuts else None

    def as_serial(self, reason: str) -> "Split":
        return dataclasses.replace(self, split_at=None, reason=reason)


def _spread(counts: Sequence[int]) -> int:
    return max(counts) - min(counts)


def _counts(points: Sequence[int], total: int) -> Tuple[int, ...]:
    edges = (0,) + tuple(points) + (total,)
    return tuple(b - a for a, b in zip(edges, edges[1:]))


def _balanced_boundaries(bounds: Sequence[int], total: int, n: int) -> Optional[Tuple[int, ...]]:
    """The ``n - 1`` of the sorted request ``bounds`` whose parts have the smallest spread; None if too few.

    Exact branch and bound: each point is tried outward from its even share of the tokens left,
    and a side stops once the spread's lower bound (the parts so far and the mean of the rest)
    reaches the best found; the first best found wins (on a tie the later point, tried first).
    """
    if len(bounds) < n - 1:
        return None
    best: List[Any] = [None, ()]  # spread, points

    def search(chosen: Tuple[int, ...], parts: Tuple[int, ...], lo: int) -> None:
        left = n - len(chosen)  # parts still to size, the last one included
        prev = chosen[-1] if chosen else 0
        if left == 1:
            spread = _spread(parts + (total - prev,))
            if best[0] is None or spread < best[0]:
                best[:] = [spread, chosen]
            return
        k = left - 1  # parts after the next point; the bound is compared times k, in integers

        def lower_bound(b: int) -> int:
            scaled = [p * k for p in parts] + [(b - prev) * k, total - b]
            return max(scaled) - min(scaled)

        target = prev * left + (total - prev)  # the even share's end, times `left`
        top = len(bounds) - left + 1  # leave a boundary for each later point
        mid = bisect.bisect_left(bounds, -(-target // left))
        up, down = max(mid, lo), min(mid - 1, top)
        while up <= top or down >= lo:
            take_up = down < lo or (up <= top and bounds[up] * left - target <= target - bounds[down] * left)
            i = up if take_up else down
            if best[0] is not None and lower_bound(bounds[i]) >= best[0] * k:
                up, down = (top + 1, down) if take_up else (up, lo - 1)  # further out is no better
                continue
            up, down = (up + 1, down) if take_up else (up, down - 1)
            search(chosen + (bounds[i],), parts + (bounds[i] - prev,), i + 1)

    search((), (), 0)
    return best[1] if best[0] is not None else None


def _too_few_tokens(total: int, n: int, min_tokens: int) -> Optional[str]:
    """Why a batch of ``total`` tokens is not split into ``n`` parts (None if it has enough)."""
    if total < 2:
        return f"a batch of {total} token{'' if total == 1 else 's'} cannot be split"
    if total < n:
        return f"a batch of {total} tokens cannot be split into {n} micro-batches"
    if n == 2 and total < min_tokens:
        return f"a batch of {total} tokens is below min_tokens={min_tokens}"
    if 2 * total < n * min_tokens:
        return (f"a batch of {total} tokens is below {n} x min_tokens/2 = {-(-n * min_tokens // 2)} "
                f"for {n} micro-batches")
    return None


def _where(plan: Split) -> str:
    """The split points in words: the requests cut, or that every point is a request boundary."""
    cuts = plan.cuts
    if not cuts:
        return "request boundary" if plan.n_parts == 2 else "request boundaries"
    return "cut " + ", ".join(f"request {r} at token {o}" for r, o in cuts)


def _plan_parts(lens: Tuple[int, ...], n: int, min_tokens: int, max_imbalance: float,
                allow_cut: bool) -> Split:
    """The plan of exactly ``n`` micro-batches, or a serial plan saying why there is none."""
    total = sum(lens)
    few = _too_few_tokens(total, n, min_tokens)
    if few:
        return Split(lens, None, few)
    bounds = sorted({b for b in SeqInfo(lens).cu_seqlens if 0 < b < total})
    best = _balanced_boundaries(bounds, total, n)
    if best is None:
        found = (f"only {len(bounds)} request boundar{'y' if len(bounds) == 1 else 'ies'} for {n} micro-batches"
                 if bounds else "no request boundary")
    else:
        imbalance = _spread(_counts(best, total)) / total
        if imbalance <= max_imbalance:
            return _described(Split(lens, best[0], "", best), f"imbalance {imbalance:.1%}")
        shares = "/".join(map(str, _counts(best, total)))
        found = (f"best request boundary {shares} is {imbalance:.1%} unbalanced" if n == 2
                 else f"best request boundaries {shares} are {imbalance:.1%} unbalanced")
    if not allow_cut:
        return Split(lens, None, f"{found} (limit {max_imbalance:.0%}) and cutting a request is disabled")
    points = tuple(-(-k * total // n) for k in range(1, n))  # even shares, the larger first
    return _described(Split(lens, points[0], "", points), found)


def _described(plan: Split, why: str) -> Split:
    """``plan`` with its reason: where it splits, the tokens of each part, and ``why``."""
    shares = "/".join(map(str, plan.token_counts))
    return dataclasses.replace(plan, reason=f"{_where(plan)}: {shares} tokens ({why})")


def propose_split(seq_lens: Sequence[int], n: int = 2, *, min_tokens: int = DEFAULT_MIN_TOKENS,
               max_imbalance: float = DEFAULT_MAX_IMBALANCE, allow_cut: bool = True) -> Split:
    """Plan ``n`` micro-batches for requests of ``seq_lens`` tokens; pure, no collectives.

    Balanced at the best request boundaries; cut inside requests (``allow_cut``) when they leave
    an imbalance above ``max_imbalance``. A batch that cannot take ``n`` parts (too few tokens,
    or no balanced boundaries without cuts) gets the most parts it can, with the reason for not
    ``n``; one that cannot take two is serial. ``plan.fewer`` holds its plans with fewer parts.
    """
    lens = check_lens("seq_lens", seq_lens)
    if not 0.0 <= max_imbalance < 1.0:
        raise ValueError(f"max_imbalance must be in [0, 1), got {max_imbalance}")
    if min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
    if not 2 <= n <= MAX_MICRO_BATCHES:
        raise ValueError(f"n must be a number of micro-batches in [2, {MAX_MICRO_BATCHES}], got {n}")
    plans = [_plan_parts(lens, k, min_tokens, max_imbalance, allow_cut) for k in range(2, n + 1)]
    split = [p for p in plans if not p.serial]
    if not split:
        return plans[0]
    plan = split[-1]
    if plan.n_parts < n:
        plan = dataclasses.replace(plan, reason=f"{plan.reason}; not {n} micro-batches: {plans[-1].reason}")
    return dataclasses.replace(plan, fewer=tuple(reversed(split[:-1])))


_INVALID = -1  # a vote: this rank's batch could not be planned


def _grouped(group: Optional[dist.ProcessGroup]) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _vote(mine: int, group: Optional[dist.ProcessGroup], device: Optional[torch.device]) -> List[int]:
    """Every rank's vote (a bit mask of the micro-batch counts it can split into, or invalid) in one all-reduce."""
    import overlap
    from overlap import collective_device

    votes = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=device or collective_device(group))
    votes[dist.get_rank(group)] = mine
    with overlap.stream(overlap.DEFAULT):  # synchronous: the decision is needed right away
        overlap.all_reduce(votes, group=group, name="agree_split")
    return votes.tolist()


def _options(plan: Split) -> Dict[int, Split]:
    """This rank's plans by number of micro-batches (none when it cannot split)."""
    return {p.n_parts: p for p in (plan,) + plan.fewer if not p.serial}


def _ranks(ranks: Sequence[int], world: int) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world}"


def _agreed(plan: Split, votes: Sequence[int], rank: int) -> Split:
    """This rank's plan for the largest micro-batch count every rank can split into, or serial."""
    world, common = len(votes), -1
    for v in votes:
        common &= v
    if common:
        n = common.bit_length() - 1
        if n == plan.n_parts:
            return plan
        short = [r for r, v in enumerate(votes) if not v >> plan.n_parts & 1]
        chosen = _options(plan)[n]
        return dataclasses.replace(chosen, reason=f"{chosen.reason}; {n} micro-batches, as {_ranks(short, world)} "
                                                  f"cannot split into {plan.n_parts}")
    serial_ranks = [r for r, v in enumerate(votes) if not v]
    if serial_ranks and not plan.serial:
        return plan.as_serial(f"{_ranks(serial_ranks, world)} cannot split its batch")
    if serial_ranks:
        others = [r for r in serial_ranks if r != rank]
        return plan.as_serial(f"{plan.reason} (also ranks {others})" if others else plan.reason)
    counts = "; ".join(f"rank {r}: {', '.join(str(k) for k in range(2, MAX_MICRO_BATCHES + 1) if v >> k & 1)}"
                       for r, v in enumerate(votes))
    return plan.as_serial(f"the ranks have no number of micro-batches in common ({counts})")


def agree_split(plan: Split, group: Optional[dist.ProcessGroup] = None,
                device: Optional[torch.device] = None) -> Split:
    """Every rank of ``group`` splits, into the same number of micro-batches, only if all can: one all-reduce.

    Each rank votes the micro-batch counts its plan offers (the plan and ``plan.fewer``); all take
    the largest count every rank offers, falling back to this rank's plan with that many parts,
    or run serially naming the ranks that could not split. Ranks keep their own split points
    (batches differ per rank); only the decision must be the same. Without an initialized
    process group the plan is returned as it is.
    """
    if not isinstance(plan, Split):
        raise TypeError(f"agree_split needs a Split, got {type(plan).__name__}")
    if _grouped(group):
        world = dist.get_world_size(group)
        votes = _vote(sum(1 << k for k in _options(plan)), group, device)
        invalid = [r for r, v in enumerate(votes) if v == _INVALID]
        if invalid:
            raise ValueError(f"rank(s) {invalid} of {world} could not plan a split of their batch (see their "
                             f"error); every rank stops here instead of hanging in a later collective")
        plan = _agreed(plan, votes, dist.get_rank(group))
    if plan.serial:
        logger.info("running serially: %s", plan.reason)
    else:
        logger.debug("%d micro-batches: %s", plan.n_parts, plan.reason)
    return plan


def decide_split(seq_lens: Sequence[int], group: Optional[dist.ProcessGroup] = None, *, n: int = 2,
                 device: Optional[torch.device] = None, allow_cut: bool = True, **plan_kwargs: Any) -> Split:
    """`propose_split` of ``n`` micro-batches on this rank's batch (``allow_cut`` and ``plan_kwargs`` go to it),
    then `agree_split` across ``group``.

    ``allow_cut=False`` splits at request boundaries only (for a model that cannot continue a
    request from the keys and values of its earlier parts); pass the same ``n`` and ``allow_cut``
    on every rank. A batch that cannot be planned (bad lengths or arguments) still takes part in
    the one all-reduce, so every rank raises instead of the others waiting for it forever.
    """
    try:
        plan = propose_split(seq_lens, n, allow_cut=allow_cut, **plan_kwargs)
    except ValueError:
        if _grouped(group):
            _vote(_INVALID, group, device)
        raise
    return agree_split(plan, group, device=device)


def _request_at(cu: Sequence[int], token: int) -> int:
    """The request holding packed position ``token`` (``bisect_right(cu, token) - 1``), in plain Python so
    that Dynamo traces it: a prefill compiled with its split calls it."""
    return sum(1 for c in cu if c <= token) - 1


def _position(cu: Sequence[int], token: int) -> Tuple[int, int]:
    """``(request, offset)`` of packed position ``token``: the request holding it and its tokens before it."""
    r = _request_at(cu, token)
    return r, token - cu[r]


def _serial_error(plan: Split, what: str) -> ValueError:
    return ValueError(f"the plan is serial ({plan.reason}); {what}")


def micro_batches(plan: Split) -> Tuple[SeqInfo, ...]:
    """Each micro-batch's `SeqInfo`; a cut request's later part has its earlier parts as prefix."""
    if plan.serial:
        raise _serial_error(plan, "there are no micro-batches")
    lens, cu = plan.seq_lens, SeqInfo(plan.seq_lens).cu_seqlens
    starts = [_position(cu, p) for p in plan.points]
    out = []
    for (r0, o0), (r1, o1) in zip([(0, 0)] + starts, starts + [(len(lens), 0)]):
        if r0 == r1:  # one piece of one request
            part: Tuple[int, ...] = (o1 - o0,)
        else:
            part = (lens[r0] - o0,) + lens[r0 + 1:r1] + ((o1,) if o1 else ())
        out.append(SeqInfo(part, (o0,) + (0,) * (len(part) - 1)))
    return tuple(out)


def _check_rows(plan: Split, x: torch.Tensor, what: str) -> None:
    if x.shape[0] != plan.num_tokens:
        raise ValueError(f"{what} has {x.shape[0]} rows but the plan is for {plan.num_tokens} tokens "
                         f"(seq_lens {list(plan.seq_lens)})")


def split_tokens(plan: Split, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Slice a packed per-token tensor (tokens first) into each micro-batch's rows (views)."""
    if plan.serial:
        raise _serial_error(plan, "there is nothing to split")
    _check_rows(plan, x, "the tensor to split")
    edges = plan.edges
    return tuple(x[a:b] for a, b in zip(edges, edges[1:]))


def split_batch(batch: Batch, plan: Split) -> Tuple[Batch, ...]:
    """The micro-batches of ``batch`` that ``plan`` says (two, or N): token ids and `SeqInfo` of each."""
    if plan.seq_lens != batch.seq.seq_lens:
        raise ValueError(f"the plan is for seq_lens {list(plan.seq_lens)}, the batch has {list(batch.seq.seq_lens)}")
    return tuple(Batch(t, s) for t, s in zip(split_tokens(plan, batch.tokens), micro_batches(plan)))


def _and(items: Sequence[Any]) -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def merge_outputs(plan: Split, *outputs: torch.Tensor) -> torch.Tensor:
    """Concatenate the micro-batches' per-token outputs back into packed order."""
    counts = plan.token_counts
    if plan.serial or tuple(y.shape[0] for y in outputs) != counts:
        raise ValueError(f"outputs of {_and([y.shape[0] for y in outputs])} rows do not match the plan's "
                         f"micro-batches of {_and(counts)} tokens")
    return torch.cat(list(outputs), dim=0)


def prefix_sources(plan: Split, mb: int) -> Tuple[int, ...]:
    """The earlier micro-batches holding the start of micro-batch ``mb``'s first request, in order.

    Empty when that request starts in ``mb`` (no prefix); ``(mb - 1,)`` for a request cut once;
    more for a request cut several times, which spans them all.
    """
    if plan.serial or mb <= 0:
        return ()
    edges, cu = plan.edges, SeqInfo(plan.seq_lens).cu_seqlens
    first = cu[_request_at(cu, edges[mb])]  # where the request starts in the packed batch
    return tuple(j for j in range(mb) if edges[j + 1] > first)


def prefix_kv(plan: Split, *kv: torch.Tensor, mb: int = 1) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batch ``mb``'s prefix keys and values, or None when its first request starts in it.

    ``kv`` are the keys and values of each micro-batch of `prefix_sources` in order
    (``k0, v0`` for micro-batch 1 of two parts): the rows of the cut request, concatenated.
    """
    sources = prefix_sources(plan, mb)
    if not sources:
        return None
    if len(kv) != 2 * len(sources):
        raise ValueError(f"micro-batch {mb}'s prefix is in micro-batches {list(sources)}: pass their keys and "
                         f"values ({2 * len(sources)} tensors), got {len(kv)}")
    edges, cu = plan.edges, SeqInfo(plan.seq_lens).cu_seqlens
    first = cu[_request_at(cu, edges[mb])]
    ks, vs = [], []
    for j, k, v in zip(sources, kv[0::2], kv[1::2]):
        n = edges[j + 1] - edges[j]
        if k.shape[0] != n or v.shape[0] != n:
            raise ValueError(f"micro-batch {j} keys/values have {k.shape[0]}/{v.shape[0]} rows, expected {n}")
        skip = max(first - edges[j], 0)
        ks.append(k[skip:])
        vs.append(v[skip:])
    if len(sources) == 1:
        return ks[0], vs[0]
    return torch.cat(ks), torch.cat(vs)


__all__ = ["DEFAULT_MAX_IMBALANCE", "DEFAULT_MIN_TOKENS", "MAX_MICRO_BATCHES", "Split", "agree_split",
           "decide_split", "merge_outputs", "micro_batches", "propose_split", "prefix_kv", "prefix_sources", "split_batch",
           "split_tokens"]
