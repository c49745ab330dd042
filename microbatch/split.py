"""A micro-batch split of a packed batch (`Split`) and applying it: cut the batch, its tokens and outputs, merge back.

A `Split` says where micro-batches 1..N-1 start in a packed batch (``points``), or that the batch
runs as one (``serial``). Micro-batch ``i`` is always the packed tokens ``[points[i-1], points[i])``,
so cutting (`split_batch`, `split_tokens`, `micro_batches`) and merging (`merge_outputs`) are cuts
along the token dimension. A split point inside a request cuts it: the request's later part
attends to the keys and values of its earlier parts (`prefix_sources` names the micro-batches
holding them, `prefix_kv` gathers their rows).

Where to split, and the agreement of every rank on it, are planning's
(`microbatch.planning.split`: `propose_split`, `decide_split`); running a split is the forward's
(`microbatch.forward`). Both import the data type from here, so neither imports the other.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import torch

from .batch import Batch, SeqInfo


@dataclasses.dataclass(frozen=True)
class Split:
    """Where micro-batches 1..N-1 start in a packed batch (``points``), or serial (``split_at`` None).

    ``split_at`` is the first split point (where micro-batch 1 starts), ``points`` all N-1 of them
    (a split built with ``split_at`` alone has two parts). ``reason`` says why, in words (logged by
    `microbatch.planning.agree_split`). ``cut`` is ``(request, offset)`` of the first split point
    that falls inside a request (its first ``offset`` tokens are in earlier micro-batches), ``cuts``
    every such point.
    ``fewer`` are this batch's splits with fewer micro-batches, most first, that `agree_split`
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



def _request_at(cu: Sequence[int], token: int) -> int:
    """The request holding packed position ``token`` (``bisect_right(cu, token) - 1``), in plain Python so
    that Dynamo traces it: a prefill compiled with its split calls it."""
    return sum(1 for c in cu if c <= token) - 1


def _position(cu: Sequence[int], token: int) -> Tuple[int, int]:
    """``(request, offset)`` of packed position ``token``: the request holding it and its tokens before it."""
    r = _request_at(cu, token)
    return r, token - cu[r]


def _serial_error(split: Split, what: str) -> ValueError:
    return ValueError(f"the split is serial ({split.reason}); {what}")


def micro_batches(split: Split) -> Tuple[SeqInfo, ...]:
    """Each micro-batch's `SeqInfo`; a cut request's later part has its earlier parts as prefix."""
    if split.serial:
        raise _serial_error(split, "there are no micro-batches")
    lens, cu = split.seq_lens, SeqInfo(split.seq_lens).cu_seqlens
    starts = [_position(cu, p) for p in split.points]
    out = []
    for (r0, o0), (r1, o1) in zip([(0, 0)] + starts, starts + [(len(lens), 0)]):
        if r0 == r1:  # one piece of one request
            part: Tuple[int, ...] = (o1 - o0,)
        else:
            part = (lens[r0] - o0,) + lens[r0 + 1:r1] + ((o1,) if o1 else ())
        out.append(SeqInfo(part, (o0,) + (0,) * (len(part) - 1)))
    return tuple(out)


def _check_rows(split: Split, x: torch.Tensor, what: str) -> None:
    if x.shape[0] != split.num_tokens:
        raise ValueError(f"{what} has {x.shape[0]} rows but the split is for {split.num_tokens} tokens "
                         f"(seq_lens {list(split.seq_lens)})")


def split_tokens(split: Split, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Slice a packed per-token tensor (tokens first) into each micro-batch's rows (views)."""
    if split.serial:
        raise _serial_error(split, "there is nothing to split")
    _check_rows(split, x, "the tensor to split")
    edges = split.edges
    return tuple(x[a:b] for a, b in zip(edges, edges[1:]))


def split_batch(batch: Batch, split: Split) -> Tuple[Batch, ...]:
    """The micro-batches of ``batch`` that ``split`` says (two, or N): token ids and `SeqInfo` of each."""
    if split.seq_lens != batch.seq.seq_lens:
        raise ValueError(f"the split is for seq_lens {list(split.seq_lens)}, the batch has {list(batch.seq.seq_lens)}")
    return tuple(Batch(t, s) for t, s in zip(split_tokens(split, batch.tokens), micro_batches(split)))


def _and(items: Sequence[object]) -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def merge_outputs(split: Split, *outputs: torch.Tensor) -> torch.Tensor:
    """Concatenate the micro-batches' per-token outputs back into packed order."""
    counts = split.token_counts
    if split.serial or tuple(y.shape[0] for y in outputs) != counts:
        raise ValueError(f"outputs of {_and([y.shape[0] for y in outputs])} rows do not match the split's "
                         f"micro-batches of {_and(counts)} tokens")
    return torch.cat(list(outputs), dim=0)


def prefix_sources(split: Split, mb: int) -> Tuple[int, ...]:
    """The earlier micro-batches holding the start of micro-batch ``mb``'s first request, in order.

    Empty when that request starts in ``mb`` (no prefix); ``(mb - 1,)`` for a request cut once;
    more for a request cut several times, which spans them all.
    """
    if split.serial or mb <= 0:
        return ()
    edges, cu = split.edges, SeqInfo(split.seq_lens).cu_seqlens
    first = cu[_request_at(cu, edges[mb])]  # where the request starts in the packed batch
    return tuple(j for j in range(mb) if edges[j + 1] > first)


def prefix_kv(split: Split, *kv: torch.Tensor, mb: int = 1) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batch ``mb``'s prefix keys and values, or None when its first request starts in it.

    ``kv`` are the keys and values of each micro-batch of `prefix_sources` in order
    (``k0, v0`` for micro-batch 1 of two parts): the rows of the cut request, concatenated.
    """
    sources = prefix_sources(split, mb)
    if not sources:
        return None
    if len(kv) != 2 * len(sources):
        raise ValueError(f"micro-batch {mb}'s prefix is in micro-batches {list(sources)}: pass their keys and "
                         f"values ({2 * len(sources)} tensors), got {len(kv)}")
    edges, cu = split.edges, SeqInfo(split.seq_lens).cu_seqlens
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


__all__ = ["Split", "merge_outputs", "micro_batches", "prefix_kv", "prefix_sources", "split_batch", "split_tokens"]
