"""Interval arithmetic and the one definition of busy time, overlap and hidden share.

Shared by the timeline (`overlap.observability.metrics`), the launcher's table
(``launch/measure/prefill.py``) and ``overlap-report``, so that the three print the same figures for the
same trace. Everything works on ``(start, end)`` pairs in seconds grouped into lanes: a lane is
one stream of one rank (or one device of a profiler trace).

- **Busy time** of a stream: the length of the union of its spans, so nested or back-to-back
  launches on one stream are not counted twice. Spans of `HOST_KINDS` are the host's time, not
  the stream's work, and count nowhere: an ``issue`` span is an operation of a communication
  stream as the executor runs it (on CPU the host planning, waiting for the count exchange and
  issuing the collectives), whose collectives are ``comm`` spans of their own.
- **overlap / min(busy)** of two streams: the time both were busy, over the busy time of the
  less busy one (a verdict by `REAL_OVERLAP` / `SERIALIZED`).
- **Hidden share of communication** (the launcher's "hidden comm"): the time ``comm`` spans ran
  while ``compute`` spans ran on the same rank, over the ``comm`` time (on any streams; every
  rank pooled for the whole trace).

The two meet: for a compute stream and a communication stream that carry all of a rank's compute
and communication, overlap / min(busy) is the hidden share whenever communication is the less
busy of the two; when communication takes longer, it is the share of compute that ran under it.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

Interval = Tuple[float, float]

COMPUTE, COMM, COPY, ISSUE = "compute", "comm", "copy", "issue"
KINDS = (COMPUTE, COMM, COPY, ISSUE)  # every kind of span the toolkit writes
HOST_KINDS = frozenset({ISSUE})  # the host's time on behalf of a stream: not busy time

REAL_OVERLAP = 0.5  # overlap / min(busy) at or above this is real overlap
SERIALIZED = 0.05  # at or below this the two streams ran one after the other


def union(intervals: Iterable[Interval]) -> List[Interval]:
    """Sorted, disjoint intervals covering the same time as ``intervals``."""
    out: List[Interval] = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def length(disjoint: Sequence[Interval]) -> float:
    return sum(e - s for s, e in disjoint)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> List[Interval]:
    """Intersection of two sorted disjoint interval lists."""
    out: List[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def verdict(ratio: float) -> str:
    """Words for an overlap / min(busy) ratio (thresholds reported from NPU profiles in the field)."""
    if ratio >= REAL_OVERLAP:
        return "real overlap"
    if ratio <= SERIALIZED:
        return "serialized"
    return "partial overlap"


@dataclasses.dataclass
class RankMetrics:
    """Overlap figures of one rank (or one device of a profiler trace); times in seconds."""

    rank: object
    busy: Dict[str, float]  # per stream
    overlap: Dict[Tuple[str, str], float]  # per pair of streams, keys sorted
    comm_time: float = 0.0
    hidden_comm_time: float = 0.0

    def ratio(self, a: str, b: str) -> float:
        """overlap(a, b) / min(busy a, busy b); 0 when either stream is idle."""
        key = tuple(sorted((a, b)))
        low = min(self.busy.get(a, 0.0), self.busy.get(b, 0.0))
        return self.overlap.get(key, 0.0) / low if low > 0 else 0.0  # type: ignore[arg-type]

    @property
    def hidden_share(self) -> Optional[float]:
        """Share of communication time during which compute ran on this rank; None without communication."""
        return self.hidden_comm_time / self.comm_time if self.comm_time > 0 else None

    def busiest_pair(self) -> Optional[Tuple[str, str]]:
        """The two streams with the most busy time (the pair a regression gate looks at by default)."""
        streams = sorted(self.busy, key=lambda s: -self.busy[s])
        return tuple(sorted(streams[:2])) if len(streams) >= 2 else None  # type: ignore[return-value]


@dataclasses.dataclass
class Metrics:
    """Per-rank overlap figures plus the hidden share of communication over all ranks."""

    per_rank: Dict[object, RankMetrics]

    @property
    def hidden_share(self) -> Optional[float]:
        comm = sum(r.comm_time for r in self.per_rank.values())
        hidden = sum(r.hidden_comm_time for r in self.per_rank.values())
        return hidden / comm if comm > 0 else None

    def _one(self, rank: object) -> RankMetrics:
        if rank is None:
            if len(self.per_rank) != 1:
                raise ValueError(f"metrics cover ranks {sorted(map(str, self.per_rank))}: pass rank=")
            return next(iter(self.per_rank.values()))
        return self.per_rank[rank]

    def busy(self, stream: str, rank: object = None) -> float:
        return self._one(rank).busy.get(stream, 0.0)

    def overlap(self, a: str, b: str, rank: object = None) -> float:
        return self._one(rank).overlap.get(tuple(sorted((a, b))), 0.0)  # type: ignore[arg-type]

    def ratio(self, a: str, b: str, rank: object = None) -> float:
        return self._one(rank).ratio(a, b)


def compute_metrics(items: Iterable[Tuple[object, str, str, float, float]]) -> Metrics:
    """Metrics from ``(rank, stream, kind, start, end)`` tuples, as the module docstring defines them.

    Spans of `HOST_KINDS` are left out: they are no stream's busy time.
    """
    lanes: Dict[object, Dict[str, List[Interval]]] = {}
    comm: Dict[object, List[Interval]] = {}
    compute: Dict[object, List[Interval]] = {}
    for rank, stream, kind, start, end in items:
        if kind in HOST_KINDS:
            continue
        lanes.setdefault(rank, {}).setdefault(stream, []).append((start, end))
        if kind == COMM:
            comm.setdefault(rank, []).append((start, end))
        elif kind == COMPUTE:
            compute.setdefault(rank, []).append((start, end))
    per_rank: Dict[object, RankMetrics] = {}
    for rank, streams in lanes.items():
        unions = {s: union(iv) for s, iv in streams.items()}
        busy = {s: length(u) for s, u in unions.items()}
        overlap = {(a, b): length(intersect(unions[a], unions[b]))
                   for a, b in itertools.combinations(sorted(unions), 2)}
        c = union(comm.get(rank, ()))
        hidden = length(intersect(c, union(compute.get(rank, ()))))
        per_rank[rank] = RankMetrics(rank, busy, overlap, length(c), hidden)
    return Metrics(per_rank)
