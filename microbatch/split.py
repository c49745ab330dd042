"""Splitting a packed prefill batch into two balanced micro-batches, agreed by every rank.

A packed batch is the tokens of several requests laid end to end; `SeqInfo` describes it.
`plan_split` decides, from the request lengths alone, where micro-batch 1 starts:

1. at the request boundary that balances the token counts best;
2. if that leaves an imbalance ``|n0 - n1| / (n0 + n1)`` above ``max_imbalance``, at the middle
   token, cutting one request in two: its second part (in micro-batch 1) attends to the keys
   and values of its first part (the last tokens of micro-batch 0, see `prefix_kv`);
3. a batch of one token, or of fewer than ``min_tokens``, is not split (``plan.serial``), and
   the plan says why. With ``allow_cut=False`` (a model whose layers cannot continue a request
   from a prefix) there is no step 2: a batch without a balanced enough boundary runs serially.

Micro-batch 0 is always a prefix of the packed tokens and micro-batch 1 the rest, so slicing
and merging are a cut along the token dimension. `agree_split` makes every rank of a group take
the same decision with one small all-reduce: ranks that split and ranks that do not would issue
different collectives and hang.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_MIN_TOKENS = 32
DEFAULT_MAX_IMBALANCE = 0.1


def _check_lens(name: str, lens: Sequence[int]) -> Tuple[int, ...]:
    out = tuple(int(n) for n in lens)
    if any(n < 0 for n in out):
        raise ValueError(f"{name} must be non-negative token counts, got {list(out)}")
    return out


@dataclasses.dataclass(frozen=True)
class SeqInfo:
    """The requests packed in one (micro-)batch.

    ``seq_lens[i]`` tokens of request ``i`` are in this batch; ``prefix_lens[i]`` tokens of the same
    request came before them (computed in an earlier micro-batch; their keys and values are passed
    to attention as ``prefix_kv``, packed in request order). Positions continue after the prefix.
    """

    seq_lens: Tuple[int, ...]
    prefix_lens: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        lens = _check_lens("seq_lens", self.seq_lens)
        prefix = _check_lens("prefix_lens", self.prefix_lens) if self.prefix_lens else (0,) * len(lens)
        if len(prefix) != len(lens):
            raise ValueError(f"prefix_lens {list(prefix)} and seq_lens {list(lens)} differ in length")
        object.__setattr__(self, "seq_lens", lens)
        object.__setattr__(self, "prefix_lens", prefix)

    @classmethod
    def from_lens(cls, seq_lens: Sequence[int]) -> "SeqInfo":
        """A batch of new requests (no prefixes)."""
        return cls(tuple(seq_lens))

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)

    @property
    def num_prefix_tokens(self) -> int:
        return sum(self.prefix_lens)

    @property
    def cu_seqlens(self) -> Tuple[int, ...]:
        """Cumulative token offsets ``(0, n0, n0 + n1, ...)`` of the requests in the packed batch."""
        return (0,) + tuple(itertools.accumulate(self.seq_lens))

    def cu_seqlens_tensor(self, device: Any = None) -> torch.Tensor:
        return torch.tensor(self.cu_seqlens, dtype=torch.int32, device=device)

    def positions(self, device: Any = None) -> torch.Tensor:
        """Position of every packed token within its request ([num_tokens] int64)."""
        parts = [torch.arange(p, p + n, dtype=torch.int64) for n, p in zip(self.seq_lens, self.prefix_lens)]
        pos = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        return pos.to(device) if device is not None else pos


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """Where micro-batch 1 starts in a packed batch (``split_at``), or None to run serially.

    ``reason`` says why, in words (logged by `agree_split`). ``cut`` is ``(request, offset)`` when
    the split point falls inside a request: its first ``offset`` tokens are in micro-batch 0.
    """

    seq_lens: Tuple[int, ...]
    split_at: Optional[int]
    reason: str

    @property
    def serial(self) -> bool:
        return self.split_at is None

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def token_counts(self) -> Tuple[int, int]:
        """Tokens in micro-batch 0 and 1 (all in the first one when serial)."""
        if self.split_at is None:
            return self.num_tokens, 0
        return self.split_at, self.num_tokens - self.split_at

    @property
    def imbalance(self) -> float:
        return _imbalance(self.split_at, self.num_tokens) if self.split_at is not None else 1.0

    @property
    def cut(self) -> Optional[Tuple[int, int]]:
        if self.split_at is None:
            return None
        cu = SeqInfo(self.seq_lens).cu_seqlens
        r = _request_at(cu, self.split_at)
        offset = self.split_at - cu[r]
        return (r, offset) if offset else None

    def as_serial(self, reason: str) -> "SplitPlan":
        return dataclasses.replace(self, split_at=None, reason=reason)


def _imbalance(split_at: int, total: int) -> float:
    return abs(total - 2 * split_at) / total


def plan_split(seq_lens: Sequence[int], *, min_tokens: int = DEFAULT_MIN_TOKENS,
               max_imbalance: float = DEFAULT_MAX_IMBALANCE, allow_cut: bool = True) -> SplitPlan:
    """Plan two micro-batches for requests of ``seq_lens`` tokens; pure, no collectives.

    Balanced at the best request boundary; cut inside a request (``allow_cut``) when that boundary
    leaves an imbalance above ``max_imbalance``; serial below ``min_tokens`` tokens or for one token.
    """
    lens = _check_lens("seq_lens", seq_lens)
    if not 0.0 <= max_imbalance < 1.0:
        raise ValueError(f"max_imbalance must be in [0, 1), got {max_imbalance}")
    if min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
    total = sum(lens)
    if total < 2:
        return SplitPlan(lens, None, f"a batch of {total} token{'s' if total != 1 else ''} cannot be split")
    if total < min_tokens:
        return SplitPlan(lens, None, f"a batch of {total} tokens is below min_tokens={min_tokens}")

    boundaries = [b for b in SeqInfo(lens).cu_seqlens if 0 < b < total]
    best = min(boundaries, key=lambda b: (_imbalance(b, total), -b), default=None)
    if best is not None and _imbalance(best, total) <= max_imbalance:
        return SplitPlan(lens, best, f"request boundary: {best}/{total - best} tokens "
                                     f"(imbalance {_imbalance(best, total):.1%})")
    found = ("no request boundary" if best is None
             else f"best request boundary {best}/{total - best} is {_imbalance(best, total):.1%} unbalanced")
    if not allow_cut:
        return SplitPlan(lens, None, f"{found} (limit {max_imbalance:.0%}) and cutting a request is disabled")
    mid = total - total // 2
    plan = SplitPlan(lens, mid, "")
    where = f"cut request {plan.cut[0]} at token {plan.cut[1]}" if plan.cut else "request boundary"
    return dataclasses.replace(plan, reason=f"{where}: {mid}/{total - mid} tokens ({found})")


_INVALID = 2  # a vote: this rank's batch could not be planned


def _grouped(group: Optional[dist.ProcessGroup]) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _vote(mine: int, group: Optional[dist.ProcessGroup], device: Optional[torch.device]) -> List[int]:
    """Every rank's vote (0 split, 1 serial, 2 invalid) through one all-reduce."""
    import overlap
    from overlap import collective_device

    votes = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=device or collective_device(group))
    votes[dist.get_rank(group)] = mine
    with overlap.stream(overlap.DEFAULT):  # synchronous: the decision is needed right away
        overlap.all_reduce(votes, group=group, name="agree_split")
    return votes.tolist()


def agree_split(plan: SplitPlan, group: Optional[dist.ProcessGroup] = None,
                device: Optional[torch.device] = None) -> SplitPlan:
    """Every rank of ``group`` splits only if all can: one all-reduce of a per-rank vote vector.

    Returns this rank's plan, or a serial plan naming the ranks that could not split. Ranks keep
    their own split points (batches differ per rank); only split-or-serial must be the same.
    Without an initialized process group the plan is returned as it is.
    """
    if not isinstance(plan, SplitPlan):
        raise TypeError(f"agree_split needs a SplitPlan, got {type(plan).__name__}")
    if _grouped(group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        votes = _vote(int(plan.serial), group, device)
        invalid = [r for r, v in enumerate(votes) if v == _INVALID]
        if invalid:
            raise ValueError(f"rank(s) {invalid} of {world} could not plan a split of their batch (see their "
                             f"error); every rank stops here instead of hanging in a later collective")
        serial_ranks = [r for r, v in enumerate(votes) if v]
        if serial_ranks and not plan.serial:
            plan = plan.as_serial(f"rank{'s' if len(serial_ranks) > 1 else ''} "
                                  f"{', '.join(map(str, serial_ranks))} of {world} cannot split its batch")
        elif serial_ranks:
            others = [r for r in serial_ranks if r != rank]
            also = f" (also ranks {others})" if others else ""
            plan = plan.as_serial(f"{plan.reason}{also}")
    if plan.serial:
        logger.info("running serially: %s", plan.reason)
    else:
        logger.debug("two micro-batches: %s", plan.reason)
    return plan


def decide_split(seq_lens: Sequence[int], group: Optional[dist.ProcessGroup] = None, *,
                 device: Optional[torch.device] = None, allow_cut: bool = True, **plan_kwargs: Any) -> SplitPlan:
    """`plan_split` on this rank's batch (``allow_cut`` and ``plan_kwargs`` go to it), then `agree_split`
    across ``group``.

    ``allow_cut=False`` splits at request boundaries only (for a model that cannot continue a
    request from the keys and values of its first part); pass the same value on every rank.
    A batch that cannot be planned (bad lengths or arguments) still takes part in the one
    all-reduce, so every rank raises instead of the others waiting for it forever.
    """
    try:
        plan = plan_split(seq_lens, allow_cut=allow_cut, **plan_kwargs)
    except ValueError:
        if _grouped(group):
            _vote(_INVALID, group, device)
        raise
    return agree_split(plan, group, device=device)


def _request_at(cu: Sequence[int], token: int) -> int:
    """The request holding packed position ``token`` (``bisect_right(cu, token) - 1``), in plain Python so
    that Dynamo traces it: a prefill compiled with its split calls it."""
    return sum(1 for c in cu if c <= token) - 1


def micro_batches(plan: SplitPlan) -> Tuple[SeqInfo, SeqInfo]:
    """The two micro-batches' `SeqInfo`; a cut request's second part has its first part as prefix."""
    if plan.serial:
        raise ValueError(f"the plan is serial ({plan.reason}); there are no micro-batches")
    cu = SeqInfo(plan.seq_lens).cu_seqlens
    r = _request_at(cu, plan.split_at)
    offset = plan.split_at - cu[r]
    first = plan.seq_lens[:r] + ((offset,) if offset else ())
    rest = plan.seq_lens[r:]
    second = (rest[0] - offset,) + rest[1:]
    return SeqInfo(first), SeqInfo(second, (offset,) + (0,) * (len(second) - 1))


def _check_rows(plan: SplitPlan, x: torch.Tensor, what: str) -> None:
    if x.shape[0] != plan.num_tokens:
        raise ValueError(f"{what} has {x.shape[0]} rows but the plan is for {plan.num_tokens} tokens "
                         f"(seq_lens {list(plan.seq_lens)})")


def split_tokens(plan: SplitPlan, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Slice a packed per-token tensor (tokens first) into the two micro-batches' rows (views)."""
    if plan.serial:
        raise ValueError(f"the plan is serial ({plan.reason}); there is nothing to split")
    _check_rows(plan, x, "the tensor to split")
    return x[:plan.split_at], x[plan.split_at:]


def merge_outputs(plan: SplitPlan, y0: torch.Tensor, y1: torch.Tensor) -> torch.Tensor:
    """Concatenate the two micro-batches' per-token outputs back into packed order."""
    n0, n1 = plan.token_counts
    if plan.serial or y0.shape[0] != n0 or y1.shape[0] != n1:
        raise ValueError(f"outputs of {y0.shape[0]} and {y1.shape[0]} rows do not match the plan's "
                         f"micro-batches of {n0} and {n1} tokens")
    return torch.cat([y0, y1], dim=0)


def prefix_kv(plan: SplitPlan, k0: torch.Tensor, v0: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batch 1's prefix keys and values: micro-batch 0's last rows when a request was cut, else None."""
    cut = plan.cut
    if cut is None:
        return None
    if k0.shape[0] != plan.split_at or v0.shape[0] != plan.split_at:
        raise ValueError(f"micro-batch 0 keys/values have {k0.shape[0]}/{v0.shape[0]} rows, "
                         f"expected {plan.split_at}")
    return k0[-cut[1]:], v0[-cut[1]:]
