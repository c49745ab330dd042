"""What the link and a busy host cost, measured with small collectives on every rank at once.

`microbatch.planning.prefill.measure` runs these probes beside the model's serial runs and fits their results:

- `sweep`: synchronous all-to-alls of a few sizes on the main stream, each one's span and call;
- `contention` / `contention_fit`: what asynchronous all-to-alls take from compute that runs while
  they complete, and what issuing them takes from the host (CPU path);
- `notice`: how late an asynchronous all-to-all completes on a busy host (CPU path).

Every rank of the group must call a probe with the same arguments: they issue the same collectives
in the same order. Off the CPU path, or without peers, the CPU probes measure nothing and return 0.
"""
from __future__ import annotations

import statistics
import time
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import overlap
from overlap import Timeline, backends, collective_device

SWEEP = "calibrate.sweep"  # the name of the probes' collectives on the timeline
NOTICE_SAMPLES = 20  # `notice`'s samples
PEER_QUANTILES = 10  # how many quantiles of `notice`'s peer samples it returns


def grouped(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether ``group`` has peers to exchange with (an initialised process group of more than one rank)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def barrier(group: Optional[dist.ProcessGroup]) -> None:
    """A barrier over ``group`` when it has peers."""
    if grouped(group):
        dist.barrier(group=group)


def max_over_ranks(values: Sequence[float], group: Optional[dist.ProcessGroup],
                   dtype: torch.dtype = torch.float64) -> List[float]:
    """The element-wise maximum of ``values`` over the ranks of ``group`` (one all-reduce)."""
    device = collective_device(group)
    if device.type != "cpu" and dtype == torch.float64:
        dtype = torch.float32  # device collectives take little float64
    t = torch.tensor(list(values), dtype=dtype, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def cpu_async(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether ``group``'s exchanges are asynchronous on CPU threads that share the cores with compute
    (the CPU probes measure something): peers, gloo on the CPU, asynchronous side streams."""
    return (grouped(group) and collective_device(group).type == "cpu"
            and backends.current().is_asynchronous(overlap.EP_COMM))


def sweep(group: Optional[dist.ProcessGroup], rows: Sequence[int], hidden: int, dtype: torch.dtype, repeats: int
           ) -> List[Tuple[int, float, float]]:
    """(bytes to other ranks, seconds, seconds of the call) of `overlap.all_to_all_single` on the main
    stream, per size and repeat: the call takes a little longer than the collective's span."""
    if not grouped(group):
        return []
    world, device = dist.get_world_size(group), collective_device(group)
    samples = []
    for r in rows:
        x = torch.zeros(world * r, hidden, dtype=dtype, device=device)
        out = torch.empty_like(x)
        nbytes = (world - 1) * r * hidden * x.element_size()
        barrier(group)
        overlap.all_to_all_single(out, x, group=group, name=SWEEP)  # warm-up
        calls = []
        with Timeline() as tl:
            for _ in range(repeats):
                t0 = time.perf_counter()
                overlap.all_to_all_single(out, x, group=group, name=SWEEP)
                calls.append(time.perf_counter() - t0)
            overlap.synchronize()
        spans = sorted(tl.find(name=SWEEP), key=lambda s: s.start)
        samples += [(nbytes, s.end - s.start, c) for s, c in zip(spans, calls)]
    return samples


def contention_fit(group: Optional[dist.ProcessGroup], rows: Tuple[int, int], hidden: int, dtype: torch.dtype,
                   repeats: int) -> Tuple[Tuple[float, float], Tuple[float, float]]:
    """What an asynchronous collective takes from the host: from the compute it completes under, and
    to issue it, each ``(seconds, seconds per byte)``, from `contention` at two sizes (``rows`` per
    rank, small and large). Zeros off the CPU path."""
    small, large = min(rows), max(rows)
    world = dist.get_world_size(group) if grouped(group) else 1
    row_bytes = (world - 1) * hidden * torch.empty((), dtype=dtype).element_size()  # one row to every peer
    link = overlap.current_link()
    if link is not None and row_bytes:  # keep the large one's booking near 20 ms, so the measurement stays short
        large = max(small, min(large, int(20e-3 / (link.seconds(row_bytes) - link.seconds(0)))))
    small_c = _contention(group, small, hidden, dtype, repeats)
    if large == small or row_bytes == 0:
        return (small_c[0], 0.0), (small_c[1], 0.0)
    large_c = _contention(group, large, hidden, dtype, repeats)

    def line(i: int) -> Tuple[float, float]:
        b = max(0.0, (large_c[i] - small_c[i]) / ((large - small) * row_bytes))
        return max(0.0, small_c[i] - b * small * row_bytes), b

    return line(0), line(1)


def contention(group: Optional[dist.ProcessGroup], rows: int, hidden: int, dtype: torch.dtype, repeats: int,
               in_flight: int = 8) -> float:
    """Host seconds each asynchronous collective takes from compute that runs while it completes (CPU path).

    On a CPU host gloo's threads move the bytes and finish the collective on the cores that compute,
    so a rank's compute runs slower while its side-stream exchanges complete. Measured as the
    difference between a fixed piece of work run alone and run while one all-to-all of ``rows`` rows
    per rank, issued just before on the communication stream, completes, the host waiting for it after
    the piece: ``in_flight`` such pieces one after another per repeat, as a schedule issues them (medians
    over ``repeats``; 0 when the difference is within noise). Issued all at once instead, their threads'
    wake-ups were shared: 0.02-0.05 ms each against 0.12 ms one at a time (2 CPU ranks). 0 off the CPU
    path or without a group: a device's collectives run on an engine of their own.
    """
    return _contention(group, rows, hidden, dtype, repeats, in_flight)[0]


def _contention(group: Optional[dist.ProcessGroup], rows: int, hidden: int, dtype: torch.dtype, repeats: int,
                in_flight: int = 8) -> Tuple[float, float]:
    """`contention`, and the host seconds each of those asynchronous collectives took to issue."""
    if not cpu_async(group):
        return 0.0, 0.0
    world = dist.get_world_size(group)
    x = torch.zeros(world * rows, hidden, dtype=dtype)
    out = torch.empty_like(x)
    a, w = torch.randn(64, hidden, dtype=dtype), torch.randn(hidden, hidden, dtype=dtype)
    link = overlap.current_link()
    booked = link.seconds((world - 1) * rows * hidden * x.element_size()) if link is not None else 0.0

    def work(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            torch.mm(a, w)
        return time.perf_counter() - t

    unit = min(work(50) for _ in range(3)) / 50
    # long enough that the exchange completes inside it, and at least 1 ms
    n = max_over_ranks([max(1e-3, 2 * booked + 0.5e-3) / max(unit, 1e-7)], group)[0]
    n = int(min(n, 1e6))
    alone, loaded, issue = [], [], []
    for _ in range(repeats):
        barrier(group)
        alone.append(statistics.median(work(n) for _ in range(in_flight)))
        barrier(group)
        pieces, issued = [], []
        for _ in range(in_flight):
            ev = overlap.event("calibrate.contention")
            t0 = time.perf_counter()
            with overlap.stream(overlap.EP_COMM):
                overlap.all_to_all_single(out, x, group=group, name=SWEEP)
                ev.record()
            issued.append(time.perf_counter() - t0)
            pieces.append(work(n))
            ev.synchronize()
        loaded.append(statistics.median(pieces))
        issue.append(statistics.median(issued))
    return max(0.0, statistics.median(loaded) - statistics.median(alone)), statistics.median(issue)


def notice(group: Optional[dist.ProcessGroup], hidden: int, dtype: torch.dtype, samples: int = NOTICE_SAMPLES
           ) -> Tuple[float, List[float]]:
    """How late an asynchronous collective completes on a busy CPU host: ``(busy, peer)`` (CPU path;
    ``(0, [])`` off it or without a group).

    gloo's threads that complete a side-stream exchange need a core and the interpreter that compute
    holds, on this rank and on the others. Measured on a one-row exchange (its link time is next to
    nothing) issued on the communication stream, ``samples`` times each:

    - ``busy``: every rank computes 5 ms after issuing, then waits; the mean time the wait takes to
      return (the host's to see a completion, even one that came under the compute: 0.04 ms on 2
      CPU ranks, where the collective's own end had measured 0);
    - ``peer``: one rank (in turn) computes 5 ms after issuing while the others wait at once; the
      seconds from issue to completion on the waiting ranks, as `PEER_QUANTILES` quantiles (a longer
      transfer hides what the other rank's compute delays).
    """
    if not cpu_async(group):
        return 0.0, []
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    x = torch.zeros(world, hidden, dtype=dtype)
    out = torch.empty_like(x)
    a, w = torch.randn(64, hidden, dtype=dtype), torch.randn(hidden, hidden, dtype=dtype)

    def exchange(compute: bool) -> Tuple[float, float]:
        """(span, seconds the wait took) of one exchange issued before ``compute`` or an immediate wait."""
        barrier(group)
        with Timeline() as tl:
            ev = overlap.event("calibrate.notice")
            t0 = time.perf_counter()
            with overlap.stream(overlap.EP_COMM):
                overlap.all_to_all_single(out, x, group=group, name=SWEEP)
                ev.record()
            while compute and time.perf_counter() - t0 < 5e-3:
                torch.mm(a, w)
            t1 = time.perf_counter()
            ev.synchronize()
            waited = time.perf_counter() - t1
        (s,) = tl.find(name=SWEEP)
        return s.end - s.start, waited  # spans keep their own clock: compare durations

    busy, waiting = [], []
    for i in range(samples):
        _, waited = exchange(True)
        busy.append(waited)
        span, _ = exchange(i % world == rank)
        if i % world != rank:
            waiting.append(span)
    waiting.sort()
    n = len(waiting)  # the same number of quantiles on every rank, whatever its share of the samples
    peer = [waiting[min(n - 1, int((k + 0.5) * n / PEER_QUANTILES))] for k in range(PEER_QUANTILES)] if n else []
    return statistics.mean(busy), peer


__all__ = ["NOTICE_SAMPLES", "PEER_QUANTILES", "SWEEP", "barrier", "contention", "contention_fit", "cpu_async",
           "grouped", "max_over_ranks", "notice", "sweep"]
