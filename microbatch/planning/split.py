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
   for, else runs serially (``split.serial``), and the split says why. With ``allow_cut=False`` (a
   model whose layers cannot continue a request from a prefix) there is no step 2: a batch
   without balanced enough boundaries for n parts tries fewer, else runs serially.

The split itself (`Split`) and what applies it (`split_batch`, `merge_outputs`, `prefix_kv`, ...)
are `microbatch.split`'s, which the forward imports too. `agree_split`
makes every rank of a group take the same decision, split-or-serial and the number of
micro-batches, with one small all-reduce: ranks that split differently would issue different
collectives and hang.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..batch import SeqInfo, check_lens
from ..split import Split

logger = logging.getLogger(__name__)

DEFAULT_MIN_TOKENS = 32
DEFAULT_MAX_IMBALANCE = 0.1
MAX_MICRO_BATCHES = 30  # the agreement votes one bit per micro-batch count


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


def _where(split: Split) -> str:
    """The split points in words: the requests cut, or that every point is a request boundary."""
    cuts = split.cuts
    if not cuts:
        return "request boundary" if split.n_parts == 2 else "request boundaries"
    return "cut " + ", ".join(f"request {r} at token {o}" for r, o in cuts)


def _split_into(lens: Tuple[int, ...], n: int, min_tokens: int, max_imbalance: float,
                allow_cut: bool) -> Split:
    """The split into exactly ``n`` micro-batches, or a serial split saying why there is none."""
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


def _described(split: Split, why: str) -> Split:
    """``split`` with its reason: where it splits, the tokens of each part, and ``why``."""
    shares = "/".join(map(str, split.token_counts))
    return dataclasses.replace(split, reason=f"{_where(split)}: {shares} tokens ({why})")


def propose_split(seq_lens: Sequence[int], n: int = 2, *, min_tokens: int = DEFAULT_MIN_TOKENS,
               max_imbalance: float = DEFAULT_MAX_IMBALANCE, allow_cut: bool = True) -> Split:
    """A split into ``n`` micro-batches for requests of ``seq_lens`` tokens; pure, no collectives.

    Balanced at the best request boundaries; cut inside requests (``allow_cut``) when they leave
    an imbalance above ``max_imbalance``. A batch that cannot take ``n`` parts (too few tokens,
    or no balanced boundaries without cuts) gets the most parts it can, with the reason for not
    ``n``; one that cannot take two is serial. ``split.fewer`` holds its splits into fewer parts.
    """
    lens = check_lens("seq_lens", seq_lens)
    if not 0.0 <= max_imbalance < 1.0:
        raise ValueError(f"max_imbalance must be in [0, 1), got {max_imbalance}")
    if min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
    if not 2 <= n <= MAX_MICRO_BATCHES:
        raise ValueError(f"n must be a number of micro-batches in [2, {MAX_MICRO_BATCHES}], got {n}")
    splits = [_split_into(lens, k, min_tokens, max_imbalance, allow_cut) for k in range(2, n + 1)]
    parted = [s for s in splits if not s.serial]
    if not parted:
        return splits[0]
    split = parted[-1]
    if split.n_parts < n:
        split = dataclasses.replace(split, reason=f"{split.reason}; not {n} micro-batches: {splits[-1].reason}")
    return dataclasses.replace(split, fewer=tuple(reversed(parted[:-1])))


_VOTE = "micro-batch counts"  # a rank's vote: the bit mask of the micro-batch counts it can split into


def _grouped(group: Optional[dist.ProcessGroup]) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _vote(mine: int, group: Optional[dist.ProcessGroup], device: Optional[torch.device],
          problem: Optional[ValueError] = None) -> List[int]:
    """Every rank's vote (`_VOTE`) in one all-reduce (`overlap.agree`); `ValueError` on every rank when one
    could not propose a split of its batch (``problem``: this rank's own error, raised here once the others
    know of it)."""
    import overlap

    words = [f"could not split its batch: {problem}"] if problem is not None else []
    with overlap.stream(overlap.DEFAULT):  # synchronous: the decision is needed right away
        posts = overlap.agree({_VOTE: mine}, overlap.GroupTransport(group, "agree_split", device), problems=words,
                              own_error=problem, per_rank=(_VOTE,))
    return [p[_VOTE] for p in posts]


def _options(split: Split) -> Dict[int, Split]:
    """This rank's splits by number of micro-batches (none when it cannot split)."""
    return {s.n_parts: s for s in (split,) + split.fewer if not s.serial}


def _ranks(ranks: Sequence[int], world: int) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world}"


def _common_split(split: Split, votes: Sequence[int], rank: int) -> Split:
    """This rank's split into the largest micro-batch count every rank can split into, or serial."""
    world, common = len(votes), -1
    for v in votes:
        common &= v
    if common:
        n = common.bit_length() - 1
        if n == split.n_parts:
            return split
        short = [r for r, v in enumerate(votes) if not v >> split.n_parts & 1]
        chosen = _options(split)[n]
        return dataclasses.replace(chosen, reason=f"{chosen.reason}; {n} micro-batches, as {_ranks(short, world)} "
                                                  f"cannot split into {split.n_parts}")
    serial_ranks = [r for r, v in enumerate(votes) if not v]
    if serial_ranks and not split.serial:
        return split.as_serial(f"{_ranks(serial_ranks, world)} cannot split its batch")
    if serial_ranks:
        others = [r for r in serial_ranks if r != rank]
        return split.as_serial(f"{split.reason} (also ranks {others})" if others else split.reason)
    counts = "; ".join(f"rank {r}: {', '.join(str(k) for k in range(2, MAX_MICRO_BATCHES + 1) if v >> k & 1)}"
                       for r, v in enumerate(votes))
    return split.as_serial(f"the ranks have no number of micro-batches in common ({counts})")


def agree_split(split: Split, group: Optional[dist.ProcessGroup] = None,
                device: Optional[torch.device] = None) -> Split:
    """Every rank of ``group`` splits, into the same number of micro-batches, only if all can: one all-reduce.

    Each rank votes the micro-batch counts its split offers (the split and ``split.fewer``); `overlap.agree`
    gathers the votes, and all take the largest count every rank offers (a decision every rank computes
    alike from the same votes, not an equality), falling back to this rank's split into that many parts,
    or run serially naming the ranks that could not split. Ranks keep their own split points
    (batches differ per rank); only the decision must be the same. Without an initialized
    process group the split is returned as it is.
    """
    if not isinstance(split, Split):
        raise TypeError(f"agree_split needs a Split, got {type(split).__name__}")
    if _grouped(group):
        votes = _vote(sum(1 << k for k in _options(split)), group, device)
        split = _common_split(split, votes, dist.get_rank(group))
    if split.serial:
        logger.info("running serially: %s", split.reason)
    else:
        logger.debug("%d micro-batches: %s", split.n_parts, split.reason)
    return split


def decide_split(seq_lens: Sequence[int], group: Optional[dist.ProcessGroup] = None, *, n: int = 2,
                 device: Optional[torch.device] = None, allow_cut: bool = True, **propose_kwargs: Any) -> Split:
    """`propose_split` of ``n`` micro-batches on this rank's batch (``allow_cut`` and ``propose_kwargs`` go to it),
    then `agree_split` across ``group``.

    ``allow_cut=False`` splits at request boundaries only (for a model that cannot continue a
    request from the keys and values of its earlier parts); pass the same ``n`` and ``allow_cut``
    on every rank. A batch whose split cannot be proposed (bad lengths or arguments) still takes part
    in the one all-reduce, so every rank raises instead of the others waiting for it forever.
    """
    try:
        split = propose_split(seq_lens, n, allow_cut=allow_cut, **propose_kwargs)
    except ValueError as err:
        if _grouped(group):
            _vote(0, group, device, err)  # raises err here, and a ValueError naming this rank on the others
        raise
    return agree_split(split, group, device=device)


__all__ = ["DEFAULT_MAX_IMBALANCE", "DEFAULT_MIN_TOKENS", "MAX_MICRO_BATCHES", "agree_split", "decide_split",
           "propose_split"]
