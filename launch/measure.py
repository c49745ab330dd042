"""Time prefill modes side by side in one run, with the last iteration's timeline.

Used by the launcher and the benchmarks. The modes run interleaved, one iteration of each per
round (`rounds`), so that a change of load on the host biases no mode. Every figure is a ratio of
times measured in the same run: speedup over serial (the slowest rank's medians), the hidden share
of communication (from the timeline), the communication share of serial time (`comm_share`), and
the ideal speedup (compute + comm) / max(compute, comm) (`ideal_speedup`).
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
from overlap import Span, Timeline
from overlap.observability import gather, metrics

from .model import Batch, Model
from .probes import max_over_ranks  # one all-reduce helper for the launcher, calibration and probes
from .config import AUTO
from .runner import cut_refusal, plan_for, prefill


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
    plan: Any = None  # this rank's split (microbatch.split.SplitPlan)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    def row(self, tokens: int) -> Dict[str, Any]:
        """A JSON-friendly summary."""
        return {"mode": self.mode, "times_s": self.times_s, "split": self.split,
                "tokens_per_s": tokens / self.median_s, "hidden_comm_share": self.hidden_comm_share,
                "comm_share": self.comm_share, "speedup": self.speedup, "ideal_speedup": self.ideal_speedup,
                "max_diff": self.max_diff}


def rounds(modes: Sequence[str], warmup: int, iters: int) -> List[List[str]]:
    """The order ``measure`` runs the modes in: one list per round, every mode once per round.

    The ``warmup`` rounds come first; each timed round starts one mode later than the one before,
    so that a change of load on the host falls on every mode alike and on no position in the round.
    """
    n = len(modes)
    return [list(modes) for _ in range(warmup)] + [[modes[(i + j) % n] for j in range(n)] for i in range(iters)]


def measure(model: Model, batch: Batch, modes: Sequence[str], group: Any, *, warmup: int = 1, iters: int = 3,
            cache: Any = None, before_iter: Optional[Callable[[str, int], None]] = None,
            compile_mode: Optional[Callable[[str, Any], Callable[[], torch.Tensor]]] = None,
            choice: Any = None) -> List[ModeResult]:
    """Run each mode ``warmup + iters`` times, interleaved (see `rounds`); the last round is recorded on a timeline.

    ``before_iter(mode, i)`` is called before every run with the mode's own iteration index.
    ``compile_mode(mode, plan)`` returns a compiled prefill to run instead of the eager executor
    (the graph paths); a compiled graph's launches are not seen one by one, so it gets no timeline
    (profile it with the device profiler and ``overlap-report``). A mode named ``"auto"`` runs the
    planner's ``choice`` (`launch.planner.Choice`): its split and its schedule.
    """
    plans, steps = {}, {}
    for mode in modes:  # every rank agrees on the splits in the same order (one all-reduce each)
        make = None
        if mode == AUTO:
            plans[mode] = plan = choice.plan(batch.seq.seq_lens, group, allow_cut=cut_refusal(model) is None)
            make = choice.best.make()
        else:
            plans[mode] = plan = plan_for(mode, batch, group, model=model)
        if compile_mode is not None:
            steps[mode] = compile_mode(mode, plan)
        else:
            def step(mode: str = mode, plan: Any = plan, make: Any = make) -> torch.Tensor:
                return prefill(model, batch, mode, plan, cache, make=make)
            steps[mode] = step
    times: Dict[str, List[float]] = {m: [] for m in modes}
    timelines = {m: Timeline() for m in modes}
    outputs: Dict[str, torch.Tensor] = {}
    order = rounds(modes, warmup, iters)
    for r, round_modes in enumerate(order):
        last = r == len(order) - 1 and compile_mode is None
        for mode in round_modes:
            if before_iter is not None:
                before_iter(mode, r)
            if cache is not None:
                cache.reset()
            dist.barrier(group=group)
            if last:
                timelines[mode].start()
            t0 = time.perf_counter()
            outputs[mode] = steps[mode]()
            overlap.synchronize()
            dt = time.perf_counter() - t0
            if last:
                timelines[mode].stop()
            if r >= warmup:
                times[mode].append(dt)
    results = []
    for mode in modes:
        out = outputs[mode]
        spans = gather(timelines[mode].spans, group)
        # one all-reduce: the slowest rank's times, and whether any rank's output is not finite
        *slowest, bad = max_over_ranks(times[mode] + [0.0 if bool(torch.isfinite(out).all()) else 1.0], group)
        results.append(ModeResult(mode, slowest, plans[mode].reason, spans, out.float(),
                                  hidden_comm_share=metrics(spans).hidden_share, finite=bad == 0.0,
                                  plan=plans[mode]))
    _compare(results, group)
    return results


def comm_share(spans: Sequence[Span]) -> Optional[float]:
    """Communication's share of a recorded iteration: the most communication time on any rank over the
    longest rank's iteration (from its first span's start to its last span's end); None without spans.

    Each rank's figures come from its own spans, so ranks whose clocks disagree do not stretch it.
    """
    per_rank = metrics(spans).per_rank
    extent: Dict[Any, List[float]] = {}
    for s in spans:
        if s.end is not None:
            lo, hi = extent.setdefault(s.rank, [s.start, s.end])
            extent[s.rank] = [min(lo, s.start), max(hi, s.end)]
    length = max((hi - lo for lo, hi in extent.values()), default=0.0)
    if not length > 0:
        return None
    comm = max((m.comm_time for m in per_rank.values()), default=0.0)
    return min(comm / length, 1.0)


def ideal_speedup(share: float) -> float:
    """(compute + comm) / max(compute, comm) for communication ``share`` of the time (compute the rest)."""
    compute = 1.0 - share
    return 1.0 / max(compute, share)


def _compare(results: List[ModeResult], group: Any) -> None:
    serial = next((r for r in results if r.mode == "serial"), None)
    if serial is None:
        return
    # the recorded iteration's own length: its spans, not the timed median, share its clock
    serial.comm_share = comm_share(serial.spans)
    if serial.comm_share is not None:
        serial.ideal_speedup = ideal_speedup(serial.comm_share)
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
