"""Time prefill modes side by side in one run, then record a round of each on a timeline.

Used by the launcher and the benchmarks. The modes run interleaved, one iteration of each per
round (`launch.measure.rounds.rounds`), so that a change of load on the host biases no mode. The timed rounds run with
nobody observing; a round after them (`RECORDED`) is recorded on a timeline and not timed. Every
figure is a ratio of times measured in the same run, each the same statistic over the timed rounds:

- speedup over serial: the ratio of the medians of the slowest rank's times;
- spread: the rounds' interquartile range over their median (`launch.measure.rounds.spread`);
- hidden comm: the hidden share of communication (`overlap.observability._intervals`) of the
  recorded round at its median; that round's spans are the mode's trace;
- serial's communication share (`comm_share`, median over the recorded rounds) and from it the ideal
  speedup (compute + comm) / max(compute, comm) (`ideal_speedup`) and, per mode, the speedup its
  hidden communication can explain (`explained_speedup`).

`table` prints them. What each speedup is (`launch.measure.verdicts.judge`) is said in its column and in words
under the table (`notes`): a mode that runs serial's schedule (``=serial``: one batch with nothing beside its
exchanges, such as ``shared`` on a model with no shared experts, or ``auto`` that chose serial), a difference within
the rounds' spread or on one rank with no communication (``~``: noise), one round (``?``: no spread); only a
difference beyond the spread is a speedup, and only then do the notes name what it rests on (more than the ideal, or
than its hidden communication explains).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

import microbatch
import overlap
from overlap import SHARED_EXPERT, Span, Timeline
from overlap.observability import gather, metrics

from launch.engine import prefill, split_for
from microbatch import AUTO, Split
from microbatch.batch import Batch
from microbatch.forward import MakeSchedule, cut_refusal
from microbatch.model import MoEModel
from microbatch.planning import Choice, max_over_ranks  # one all-reduce helper for the launcher, calibration and probes
from overlap import OffloadCache

from .rounds import rounds, spread
from .verdicts import REFERENCE, SPEEDUP, Compared, judge, mark, overlaps_nothing, speedup_notes

CompileMode = Callable[[str, Split], Callable[[], torch.Tensor]]  # (mode, split) -> a compiled prefill
RECORDED = 1  # rounds per mode recorded on a timeline after the timed ones (`measure_modes`)


@dataclasses.dataclass
class ModeResult:
    """One mode's measurements (times are the slowest rank's, per timed round)."""

    mode: str
    times_s: List[float]
    split_reason: str  # the split's, in words
    spans: List[Span]  # every rank's spans of the recorded round at the median hidden share
    output: torch.Tensor
    hidden_comm_share: Optional[float] = None  # of the round whose spans are kept: the median
    comm_shares: List[Optional[float]] = dataclasses.field(default_factory=list)  # per recorded round
    comm_share: Optional[float] = None  # serial only: communication / prefill time, median over the rounds
    speedup: Optional[float] = None
    ideal_speedup: Optional[float] = None
    max_diff: Optional[float] = None  # largest |output - serial output| over all ranks (inf if not finite)
    rows_over: Optional[float] = None  # the largest share over the ranks of output rows beyond the tolerance
    ref_scale: Optional[float] = None  # serial only: largest |output| over all ranks
    finite: bool = True  # no NaN or inf in the output on any rank
    split: Optional[Split] = None  # this rank's
    serial_schedule: Optional[str] = None  # why the mode runs serial's schedule, in words; None: it does not
    alone: bool = False  # one rank: no communication, nothing to overlap
    judged: Optional[str] = None  # what its speedup is (`launch.measure.verdicts.judge`)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def spread(self) -> Optional[float]:
        return spread(self.times_s)

    def row(self, tokens: int) -> Dict[str, object]:
        """A JSON-friendly summary."""
        return {"mode": self.mode, "times_s": self.times_s, "spread": self.spread, "split": self.split_reason,
                "tokens_per_s": tokens / self.median_s, "hidden_comm_share": self.hidden_comm_share,
                "comm_share": self.comm_share, "speedup": self.speedup, "speedup_label": self.judged,
                "serial_schedule": self.serial_schedule, "ideal_speedup": self.ideal_speedup,
                "max_diff": self.max_diff}


def measure_modes(model: MoEModel, batch: Batch, modes: Sequence[str], group: Optional[dist.ProcessGroup], *,
                  warmup: int = 1, iters: int = 3, cache: Optional[OffloadCache] = None,
                  before_iter: Optional[Callable[[str, int], None]] = None,
                  compile_mode: Optional[CompileMode] = None, choice: Optional[Choice] = None,
                  recorded: int = RECORDED) -> List[ModeResult]:
    """Run each mode ``warmup + iters + recorded`` times, interleaved (see `rounds`): the ``iters`` rounds are timed,
    the last ``recorded`` ones recorded on a timeline and not timed.

    A timeline observes every launch (a span each, and on the CPU path's simulated link the completions' times from
    callbacks on other threads, `overlap.link.DelayedWork`), which a run nobody observes does not pay; so the times
    come from rounds nobody observes, and the spans, the hidden share and the communication share from rounds apart.
    ``before_iter(mode, i)`` is called before every run with the mode's own iteration index.
    ``compile_mode(mode, split)`` returns a compiled prefill to run instead of the eager executor
    (the graph paths); a compiled graph's launches are not seen one by one, so it gets no timeline
    (profile it with the device profiler and ``overlap-report``). A mode named ``"auto"`` runs the
    planner's ``choice`` (`microbatch.planning.Choice`): its split and its schedule.
    """
    splits: Dict[str, Split] = {}
    steps: Dict[str, Callable[[], torch.Tensor]] = {}
    same: Dict[str, Optional[str]] = {}
    for mode in modes:  # every rank agrees on the splits in the same order (one all-reduce each)
        make: Optional[MakeSchedule] = None
        if mode == AUTO:
            if choice is None:
                raise ValueError("the mode 'auto' runs the planner's choice: pass choice=")
            splits[mode] = split = choice.split(batch.seq.seq_lens, group, allow_cut=cut_refusal(model) is None)
            make = choice.best.make()
        else:
            splits[mode] = split = split_for(mode, batch, group, model=model)
        if model is not None:
            same[mode] = serial_schedule(model, mode, split, make, choice)
        if compile_mode is not None:
            steps[mode] = compile_mode(mode, split)
        else:
            def step(mode: str = mode, split: Split = split, make: Optional[MakeSchedule] = make) -> torch.Tensor:
                return prefill(model, batch, mode, split, cache, make=make)
            steps[mode] = step
    times: Dict[str, List[float]] = {m: [] for m in modes}
    timelines: Dict[str, List[Timeline]] = {m: [] for m in modes}
    recorded_s: Dict[str, List[float]] = {m: [] for m in modes}
    outputs: Dict[str, torch.Tensor] = {}
    recorded = max(0, int(recorded)) if compile_mode is None else 0
    for r, round_modes in enumerate(rounds(modes, warmup, iters + recorded)):
        record = r >= warmup + iters
        for mode in round_modes:
            if before_iter is not None:
                before_iter(mode, r)
            if cache is not None:
                cache.reset()
            dist.barrier(group=group)
            tl = Timeline().start() if record else None
            t0 = time.perf_counter()
            outputs[mode] = steps[mode]()
            overlap.synchronize()
            dt = time.perf_counter() - t0
            if tl is not None:
                timelines[mode].append(tl.stop())
                recorded_s[mode].append(dt)
            elif r >= warmup:
                times[mode].append(dt)
    results = []
    for mode in modes:
        out = outputs[mode]
        # one all-reduce: the slowest rank's times, and whether any rank's output is not finite
        *slowest, bad = max_over_ranks(times[mode] + [0.0 if bool(torch.isfinite(out).all()) else 1.0], group)
        result = ModeResult(mode, slowest, splits[mode].reason, [], out.float(), finite=bad == 0.0, split=splits[mode],
                            serial_schedule=same.get(mode), alone=dist.get_world_size(group) == 1)
        _keep_median_round([gather(tl.spans, group) for tl in timelines[mode]], recorded_s[mode], result)
        results.append(result)
    _compare(results, group)
    return results


def serial_schedule(model: MoEModel, mode: str, split: Split, make: Optional[MakeSchedule] = None,
                    choice: Optional[Choice] = None) -> Optional[str]:
    """Why ``mode`` (``make``'s schedule where given: auto's) over ``split`` runs serial's schedule, in words: one
    batch with nothing beside its exchanges (`launch.measure.verdicts.overlaps_nothing`); None where it does not."""
    if mode == "serial":
        return None
    layers = model.layer_operations()
    make = make or microbatch.mode(mode).make
    if not split.serial or not overlaps_nothing(make(layers, 1), layers):
        return None
    chosen = choice.best.mode if mode == AUTO and choice is not None else mode
    if chosen == "serial":
        return "auto chose serial"
    why = []
    if mode == AUTO:
        why.append(f"auto chose {chosen}")
    if microbatch.mode(chosen).micro_batches > 1:
        why.append(f"its split runs one batch ({split.reason})")
    if not any(op.stream == SHARED_EXPERT for layer in layers for op in layer):
        why.append("the model has no shared experts")
    return ", ".join(why or ["one batch"]) + ": nothing runs beside its exchanges"


def _keep_median_round(per_round: List[List[Span]], seconds: List[float], result: ModeResult) -> None:
    """Each recorded round's communication share; the hidden share and the spans of the round at the median.

    The median is the lower middle one (a round that ran), by hidden share, then its time (``seconds``, this rank's),
    so that ``overlap-report`` on the mode's trace prints the table's figure.
    """
    if not per_round:
        return
    result.comm_shares = [comm_share(spans) for spans in per_round]
    hidden = [metrics(spans).hidden_share for spans in per_round]
    order = sorted(range(len(per_round)), key=lambda i: (-1.0 if hidden[i] is None else hidden[i], seconds[i]))
    k = order[(len(order) - 1) // 2]
    result.spans, result.hidden_comm_share = per_round[k], hidden[k]


def comm_share(spans: Sequence[Span]) -> Optional[float]:
    """Communication's share of a recorded iteration: the most communication time on any rank over the
    longest rank's iteration (from its first span's start to its last span's end); None without spans.

    Each rank's figures come from its own spans, so ranks whose clocks disagree do not stretch it.
    """
    per_rank = metrics(spans).per_rank
    extent: Dict[int, List[float]] = {}
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


def explained_speedup(hidden: float, share: float) -> float:
    """The most a mode gains by hiding ``hidden`` of serial's communication ``share``: 1 / (1 - hidden * share).

    Hiding that communication saves at most ``hidden * share`` of serial's time.
    """
    saved = hidden * share
    return 1.0 / (1.0 - saved) if saved < 1.0 else math.inf


def _compare(results: List[ModeResult], group: Optional[dist.ProcessGroup]) -> None:
    serial = next((r for r in results if r.mode == "serial"), None)
    if serial is None:
        return
    # each round's share on its own clock (its spans' length), then the median, as for the times
    shares = [c for c in serial.comm_shares if c is not None]
    serial.comm_share = statistics.median(shares) if shares else None
    if serial.comm_share is not None:
        serial.ideal_speedup = ideal_speedup(serial.comm_share)
    # the reference's magnitude over all ranks, so that every rank judges with the same tolerance
    serial.ref_scale = max_over_ranks([_finite_or_inf(serial.output.abs().max().item())
                                       if serial.output.numel() else 0.0], group)[0]
    tol = tolerance(serial.output.dtype, serial.ref_scale)
    for r in results:
        r.speedup = serial.median_s / r.median_s
        diff = (r.output - serial.output).abs().max().item() if serial.output.numel() else 0.0
        r.max_diff, r.rows_over = max_over_ranks([_finite_or_inf(diff), _rows_over(r.output, serial.output, tol)],
                                                 group)
        r.ideal_speedup = serial.ideal_speedup
        r.judged = REFERENCE if r is serial else judge(r.speedup, noise(r, serial), same=r.serial_schedule is not None,
                                                       alone=r.alone)


def noise(r: ModeResult, serial: ModeResult) -> Optional[float]:
    """The spread ``r``'s difference from serial is read against: the larger of the two modes' (None with fewer
    than two timed rounds)."""
    if len(r.times_s) < 2 or len(serial.times_s) < 2:
        return None
    return max(r.spread or 0.0, serial.spread or 0.0)


def _finite_or_inf(v: float) -> float:
    # a NaN would vanish in a MAX all-reduce and compare False with any tolerance: make it loud
    return v if math.isfinite(v) else float("inf")


def not_finite(results: Sequence[ModeResult]) -> List[str]:
    """The modes whose output holds NaN or inf on some rank, in words (a wrong answer, whatever --check says)."""
    return [f"{r.mode}'s output holds NaN or inf on some rank" for r in results if not r.finite]


# in bf16 / fp16 a few rows may differ by more than the tolerance and be right: another batch shape rounds a
# router's near-tie the other way (seen on an H200: two-batch, 3 of 8192 rows of the small preset in bf16)
NEAR_TIE_ROWS = 0.001


def tolerance(dtype: torch.dtype, ref_scale: Optional[float]) -> float:
    """How far a mode's output may be from serial's: 1e-4 in float32, 5e-2 in a lower precision, times the
    largest magnitude of serial's output (at least 1)."""
    return (1e-4 if dtype == torch.float32 else 5e-2) * max(1.0, ref_scale or 0.0)


def _rows_over(out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    """The share of ``out``'s rows (first dimension) with an element more than ``tol`` from ``ref`` (1 where the
    shapes differ; NaN counts as over)."""
    if out.shape != ref.shape:
        return 1.0
    if out.dim() < 1 or not out.numel():
        return 0.0
    near = ((out - ref).abs() <= tol).reshape(out.shape[0], -1).all(1)
    return 1.0 - float(near.float().mean())


def _near_ties(r: ModeResult, dtype: torch.dtype) -> bool:
    """A difference over the tolerance that a low precision explains: few rows, every value finite."""
    return (dtype != torch.float32 and r.rows_over is not None and r.rows_over <= NEAR_TIE_ROWS
            and r.max_diff is not None and math.isfinite(r.max_diff))


def check_against_serial(results: Sequence[ModeResult], dtype: torch.dtype) -> List[str]:
    """The modes whose output differs from serial by more than the dtype's tolerance, or is not finite, in words.

    A serial output that is not finite fails every mode: with an infinite reference any
    difference would be within a tolerance scaled by it. In bf16 / fp16 at most `NEAR_TIE_ROWS` of the rows
    (on every rank) may differ by more (`near_tie_notes` says so): a router's near-tie rounded the other way.
    """
    serial = next((r for r in results if r.mode == "serial"), None)
    if serial is None:
        return ["--check needs the serial mode in the list of modes (add serial to --mode)"]
    if not serial.finite or not math.isfinite(serial.ref_scale or 0.0):
        return ["serial's output holds NaN or inf on some rank: there is no reference to compare with"]
    tol = tolerance(dtype, serial.ref_scale)
    # `not <=`: a NaN or infinite difference fails too
    return [f"{r.mode} differs from serial by {r.max_diff:.3e} (tolerance {tol:.1e}{_share(r)})"
            for r in results if r.max_diff is not None and not r.max_diff <= tol and not _near_ties(r, dtype)]


def near_tie_notes(results: Sequence[ModeResult], dtype: torch.dtype) -> List[str]:
    """The modes `check_against_serial` passes with a few rows over the tolerance, in words."""
    serial = next((r for r in results if r.mode == "serial"), None)
    tol = tolerance(dtype, serial.ref_scale if serial is not None else None)
    return [f"{r.mode}: {r.rows_over:.3%} of the rows differ from serial by more than {tol:.1e} (at most "
            f"{r.max_diff:.3e}): in {str(dtype).split('.')[-1]} a router's near-tie, rounded the other way in "
            f"another batch shape; within the {NEAR_TIE_ROWS:.1%} allowed"
            for r in results if r.max_diff is not None and not r.max_diff <= tol and _near_ties(r, dtype)]


def _share(r: ModeResult) -> str:
    return "" if r.rows_over is None else f"; {r.rows_over:.3%} of the rows"


def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(results: Sequence[ModeResult], tokens: int) -> str:
    """The results as an aligned text table, then the lines of `notes`."""
    head = ("mode", "ms/prefill median [min-max]", "spread", "tokens/s", "speedup", "hidden comm", "max diff vs serial")
    body = []
    for r in results:
        ms = [t * 1e3 for t in r.times_s]
        body.append((r.mode, f"{statistics.median(ms):.1f} [{min(ms):.1f}-{max(ms):.1f}]", _fmt(r.spread, ".0%"),
                     f"{tokens / r.median_s:.0f}", mark(r.speedup, r.judged), _fmt(r.hidden_comm_share, ".0%"),
                     _fmt(r.max_diff, ".2e")))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*row).rstrip() for row in [head, tuple("-" * w for w in widths)] + body]
    serial = next((r for r in results if r.mode == "serial" and r.comm_share is not None), None)
    if serial is not None:
        lines.append(f"serial: communication {serial.comm_share:.0%} of prefill time -> ideal speedup "
                     f"(compute + comm) / max(compute, comm) = {serial.ideal_speedup:.2f}x")
    return "\n".join(lines + notes(results))


def notes(results: Sequence[ModeResult]) -> List[str]:
    """What the table's figures rest on, and in words every speedup that is not to be read as a result: a mode that
    runs serial's schedule, one rank, one round, a difference within the rounds' spread; for a speedup beyond the
    spread, one above the ideal or more than the mode's hidden communication explains."""
    if not results:
        return []
    n = len(results[0].times_s)
    lines = [f"medians of {n} timed round(s) per mode, the modes interleaved; "
             f"spread: the rounds' interquartile range over their median"]
    serial = next((r for r in results if r.mode == "serial"), None)
    if serial is None:
        return lines
    lines += speedup_notes([_compared(r, serial) for r in results if r is not serial and r.speedup is not None], n,
                           f"--iters {max(10, 2 * n)}")
    for r in results:  # what a speedup beyond the spread rests on
        if r is not serial and r.judged == SPEEDUP:
            said = _beyond_overlap(r, serial, noise(r, serial) or 0.0)
            if said:
                lines.append(said)
    return lines


def _compared(r: ModeResult, serial: ModeResult) -> Compared:
    """``r``'s speedup over serial as `launch.measure.verdicts.speedup_notes` reads it."""
    return Compared(r.mode, r.speedup or 0.0, noise(r, serial), r.judged or "", r.serial_schedule, r.alone)


def _beyond_overlap(r: ModeResult, serial: ModeResult, noise: float) -> Optional[str]:
    """Words for a speedup (beyond the rounds' spread, ``noise``) above the ideal, or above what hiding the mode's
    communication can give; else None."""
    c, ideal, s = serial.comm_share, serial.ideal_speedup, r.speedup
    if c is None or ideal is None or s is None:
        return None
    h = r.hidden_comm_share
    if round(s, 2) > round(ideal, 2):
        limit, text = ideal, f"{r.mode}: {s:.2f}x is above the ideal {ideal:.2f}x"
    elif h is not None and round(s, 2) > round(explained_speedup(h, c), 2):
        limit = explained_speedup(h, c)
        text = (f"{r.mode}: {s:.2f}x is more than hiding {h:.0%} of serial's {c:.0%} communication can give "
                f"({limit:.2f}x at most)")
    else:
        return None
    if s / limit - 1.0 <= noise:
        return text + f", within the rounds' spread ({noise:.0%}): likely noise"
    return text + ": the rest is not overlap (this mode's compute or waits took less time than serial's)"


__all__ = ["NEAR_TIE_ROWS", "RECORDED", "CompileMode", "ModeResult", "check_against_serial", "comm_share",
           "explained_speedup", "ideal_speedup", "measure_modes", "near_tie_notes", "noise", "not_finite", "notes",
           "serial_schedule", "table", "tolerance"]
