"""Time prefill modes side by side in one run, with the last iteration's timeline.

Used by the launcher and the benchmarks. Every figure is a ratio of times measured in the same
run: speedup over serial, the hidden share of communication (from the timeline), the
communication share of serial time, and the ideal speedup (compute + comm) / max(compute, comm).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

import overlap
from overlap import Span, Timeline, collective_device
from overlap.observability import gather

from .model import Batch, Model
from .runner import plan_for, prefill


@dataclasses.dataclass
class ModeResult:
    """One mode's measurements (times are the slowest rank's, per iteration)."""

    mode: str
    times_s: List[float]
    split: str
    spans: List[Span]
    output: torch.Tensor
    hidden_comm_share: Optional[float] = None
    comm_share: Optional[float] = None  # serial only: communication / prefill time
    speedup: Optional[float] = None
    ideal_speedup: Optional[float] = None
    max_diff: Optional[float] = None  # largest |output - serial output| over all ranks (inf if not finite)
    ref_scale: Optional[float] = None  # serial only: largest |output| over all ranks
    finite: bool = True  # no NaN or inf in the output on any rank

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    def row(self, tokens: int) -> Dict[str, Any]:
        """A JSON-friendly summary."""
        return {"mode": self.mode, "times_s": self.times_s, "split": self.split,
                "tokens_per_s": tokens / self.median_s, "hidden_comm_share": self.hidden_comm_share,
                "comm_share": self.comm_share, "speedup": self.speedup, "ideal_speedup": self.ideal_speedup,
                "max_diff": self.max_diff}


def max_over_ranks(values: Sequence[float], group: Any) -> List[float]:
    """Element-wise maximum of ``values`` over the ranks of ``group`` (e.g. the slowest rank's times)."""
    # float32 on the collective's device: NCCL / HCCL take no CPU tensors, HCCL little float64
    t = torch.tensor(list(values), dtype=torch.float32, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def measure(model: Model, batch: Batch, modes: Sequence[str], group: Any, *, warmup: int = 1, iters: int = 3,
            cache: Any = None, before_iter: Optional[Callable[[str, int], None]] = None,
            compile_mode: Optional[Callable[[str, Any], Callable[[], torch.Tensor]]] = None) -> List[ModeResult]:
    """Run each mode ``warmup + iters`` times; the last iteration is recorded on a timeline.

    ``compile_mode(mode, plan)`` returns a compiled prefill to run instead of the eager executor
    (the graph paths); a compiled graph's launches are not seen one by one, so it gets no timeline
    (profile it with the device profiler and ``overlap-report``).
    """
    results = []
    for mode in modes:
        plan = plan_for(mode, batch, group, model=model)
        if compile_mode is not None:
            step = compile_mode(mode, plan)
        else:
            def step(mode: str = mode, plan: Any = plan) -> torch.Tensor:
                return prefill(model, batch, mode, plan, cache)
        times, tl = [], Timeline()
        for i in range(warmup + iters):
            if before_iter is not None:
                before_iter(mode, i)
            if cache is not None:
                cache.reset()
            dist.barrier(group=group)
            last = i == warmup + iters - 1 and compile_mode is None
            if last:
                tl.start()
            t0 = time.perf_counter()
            out = step()
            overlap.synchronize()
            dt = time.perf_counter() - t0
            if last:
                tl.stop()
            if i >= warmup:
                times.append(dt)
        spans = gather(tl.spans, group)
        # one all-reduce: the slowest rank's times, and whether any rank's output is not finite
        *slowest, bad = max_over_ranks(times + [0.0 if bool(torch.isfinite(out).all()) else 1.0], group)
        results.append(ModeResult(mode, slowest, plan.reason, spans, out.float(),
                                  hidden_comm_share=tl.metrics(spans).hidden_share, finite=bad == 0.0))
    _compare(results, group)
    return results


def _compare(results: List[ModeResult], group: Any) -> None:
    serial = next((r for r in results if r.mode == "serial"), None)
    if serial is None:
        return
    per_rank = Timeline().metrics(serial.spans).per_rank.values()
    comm = max((m.comm_time for m in per_rank), default=0.0)
    # the recorded iteration's own length: its spans, not the timed median, share its clock
    length = max((s.end for s in serial.spans), default=0.0) - min((s.start for s in serial.spans), default=0.0)
    if length > 0:
        serial.comm_share = min(comm / length, 1.0)
        compute = 1.0 - serial.comm_share
        serial.ideal_speedup = 1.0 / max(compute, serial.comm_share)
    # the reference's magnitude over all ranks, so that every rank judges with the same tolerance
    serial.ref_scale = max_over_ranks([_finite_or_inf(serial.output.abs().max().item())
                                       if serial.output.numel() else 0.0], group)[0]
    for r in results:
        r.speedup = serial.median_s / r.median_s
        diff = (r.output - serial.output).abs().max().item() if serial.output.numel() else 0.0
        r.max_diff = max_over_ranks([_finite_or_inf(diff)], group)[0]
        r.ideal_speedup = serial.ideal_speedup


def _finite_or_inf(v: float) -> float:
    # a NaN would vanish in a MAX all-reduce and compare False with any tolerance: make it loud
    return v if math.isfinite(v) else float("inf")


def not_finite(results: Sequence[ModeResult]) -> List[str]:
    """The modes whose output holds NaN or inf on some rank, in words (a wrong answer, whatever --check says)."""
    return [f"{r.mode}'s output holds NaN or inf on some rank" for r in results if not r.finite]


def check_against_serial(results: Sequence[ModeResult], dtype: torch.dtype) -> List[str]:
    """The modes whose output differs from serial by more than the dtype's tolerance, or is not finite, in words.

    A serial output that is not finite fails every mode: with an infinite reference any
    difference would be within a tolerance scaled by it.
    """
    serial = next((r for r in results if r.mode == "serial"), None)
    if serial is None:
        return ["--check needs the serial mode (use --mode all)"]
    if not serial.finite or not math.isfinite(serial.ref_scale or 0.0):
        return ["serial's output holds NaN or inf on some rank: there is no reference to compare with"]
    tol = (1e-4 if dtype == torch.float32 else 5e-2) * max(1.0, serial.ref_scale or 0.0)
    # `not <=`: a NaN or infinite difference fails too
    return [f"{r.mode} differs from serial by {r.max_diff:.3e} (tolerance {tol:.1e})"
            for r in results if r.max_diff is not None and not r.max_diff <= tol]


def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(results: Sequence[ModeResult], tokens: int) -> str:
    """The results as an aligned text table."""
    head = ("mode", "ms/prefill median [min-max]", "tokens/s", "speedup", "hidden comm", "max diff vs serial")
    body = []
    for r in results:
        ms = [t * 1e3 for t in r.times_s]
        body.append((r.mode, f"{statistics.median(ms):.1f} [{min(ms):.1f}-{max(ms):.1f}]",
                     f"{tokens / r.median_s:.0f}", _fmt(r.speedup, ".2f") + ("x" if r.speedup else ""),
                     _fmt(r.hidden_comm_share, ".0%"), _fmt(r.max_diff, ".2e")))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*b) for b in body]
    serial = next((r for r in results if r.mode == "serial" and r.comm_share is not None), None)
    if serial is not None:
        lines.append(f"serial: communication {serial.comm_share:.0%} of prefill time -> ideal speedup "
                     f"(compute + comm) / max(compute, comm) = {serial.ideal_speedup:.2f}x")
    return "\n".join(lines)
