"""Time generation runs side by side in one job: prefill and decode modes, interleaved round by round.

A run is a prefill mode and a decode mode (`Run`); every round generates the same prompts once in
each run, in the order `launch.measure.rounds.rounds` gives (each timed round starts one run later). Per run,
over its timed rounds and every rank (the slowest rank's times):

- time to first token: from the start of the generation to its first token (the prefill's argmax);
- time per output token: each decode step's time (every active request gets one token per step),
  median and 90th percentile over all steps of all timed rounds;
- the spread of TPOT: the rounds' interquartile range of each round's median step time over its median (how far
  the TPOT moves from round to round: the noise a difference between runs is read against);
- output tokens per second: the tokens of every rank (each request's first, the prefill's, included) over the
  generation's time (from its start, the prefill included, to its last step's tokens), median of the rounds;
- the hidden share of communication during decode (the decode steps' spans, not the prefill's), of
  the round at its median; one decode step of that round is the run's trace.

`check` compares each run's tokens with serial's (`first_difference`), `table` prints the runs and says what each
speedup is (`launch.measure.verdicts`: a run whose decode steps run serial's schedule is ``=serial``, a difference
within the spread or on one rank ``~``, one round ``?``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import microbatch
import overlap
from launch.engine import Decoders, Generated, generate
from microbatch import AUTO, DecodeModel, KVCache, OffloadedKVCache
from microbatch.planning import DecodeCalibration, DecodeGuard, max_over_ranks
from overlap import SHARED_EXPERT, Span, Timeline
from overlap.observability import gather, metrics
from overlap.offload import PrefetchReport

from .rounds import rounds, spread
from . import verdicts
from .verdicts import REFERENCE, Compared, mark, overlaps_nothing, speedup_notes

MakeCache = Callable[[], KVCache]  # a fresh cache for one generation
Progress = Callable[[str, bool, bool], None]  # (line, a round's first step, the first round)
# a timed round records the launches of one decode step in this many, from the second on (`observes`: its timeline
# gives the trace and the hidden share) and leaves that step out of the TPOT: observing costs a device event per
# launch and two clock synchronizes, on a GPU half of the tiny preset's eager step (12.2 ms observed, 6.6 ms not)
OBSERVE_EVERY = 4


def observes(step: int) -> bool:
    """Whether a timed round records the launches of decode step ``step`` (0: the first)."""
    return step % OBSERVE_EVERY == 1


@dataclasses.dataclass(frozen=True)
class Run:
    """One way to generate: prefill in ``prefill``'s schedule, decode steps in ``decode``'s."""

    prefill: str
    decode: str

    @property
    def label(self) -> str:
        """The run's name in the table: the mode, or ``prefill / decode`` where they differ."""
        return self.prefill if self.prefill == self.decode else f"{self.prefill} / {self.decode}"

    @property
    def file_label(self) -> str:
        """`label` as a file name's part."""
        return self.label.replace(" / ", "__")


@dataclasses.dataclass
class RunResult:
    """One run's measurements (times: the slowest rank's) and this rank's tokens."""

    run: Run
    ttft_s: List[float]  # per timed round
    total_s: List[float]  # per timed round: the whole generation
    step_s: List[float]  # every decode step of every timed round
    output_tokens: int  # of every rank, per generation
    generated: Generated  # this rank's, of the last round
    prefetch: Optional[PrefetchReport] = None  # --kv-offload: this rank's prefetches over the timed rounds
    hidden_comm_share: Optional[float] = None  # during decode, of the round at its median
    spans: List[Span] = dataclasses.field(default_factory=list)  # one decode step of that round, every rank's
    speedup: Optional[float] = None  # serial's median time per output token over this run's
    chosen: List[str] = dataclasses.field(default_factory=list)  # auto: each timed step's mode, every round
    predicted_s: List[float] = dataclasses.field(default_factory=list)  # auto: each timed step's predicted time
    guard: Optional[str] = None  # auto: what its guard did over every round (`DecodeGuard.summary`)
    round_tpot_s: List[float] = dataclasses.field(default_factory=list)  # each timed round's median step
    serial_schedule: Optional[str] = None  # why its decode steps run serial's schedule, in words; None: they do not
    alone: bool = False  # one rank: no communication, nothing to overlap
    judged: Optional[str] = None  # what its speedup is (`launch.measure.verdicts.judge`)

    @property
    def steps_by_mode(self) -> Dict[str, int]:
        """Auto: how many timed decode steps ran in each mode (most first)."""
        counts: Dict[str, int] = {}
        for m in self.chosen:
            counts[m] = counts.get(m, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    @property
    def predicted_tpot_s(self) -> Optional[float]:
        return statistics.median(self.predicted_s) if self.predicted_s else None

    @property
    def tpot_s(self) -> Optional[float]:
        return statistics.median(self.step_s) if self.step_s else None

    @property
    def tpot_p90_s(self) -> Optional[float]:
        return _p90(self.step_s) if self.step_s else None

    @property
    def spread(self) -> Optional[float]:
        """TPOT's spread: the rounds' interquartile range of their median step over its median."""
        return spread(self.round_tpot_s)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / statistics.median(self.total_s)

    def row(self) -> Dict[str, object]:
        """A JSON-friendly summary."""
        return {"mode": self.run.label, "prefill_mode": self.run.prefill, "decode_mode": self.run.decode,
                "ttft_s": self.ttft_s, "ttft_median_s": statistics.median(self.ttft_s),
                "tpot_median_s": self.tpot_s, "tpot_p90_s": self.tpot_p90_s, "tpot_rounds_s": self.round_tpot_s,
                "tpot_spread": self.spread, "step_spread": spread(self.step_s),
                "decode_steps": self.generated.steps, "output_tokens": self.output_tokens,
                "tokens_per_s": self.tokens_per_s, "hidden_comm_share": self.hidden_comm_share,
                "speedup": self.speedup, "speedup_label": self.judged, "serial_schedule": self.serial_schedule,
                "tokens_sha1": _digest(self.generated.tokens),
                "steps_by_mode": self.steps_by_mode or None, "predicted_tpot_median_s": self.predicted_tpot_s,
                "decode_guard": self.guard,
                "kv_prefetch": None if self.prefetch is None else {
                    "copies": self.prefetch.count, "bytes": self.prefetch.bytes, "seconds": self.prefetch.seconds,
                    "exposed_s": self.prefetch.exposed_s, "hidden_share": self.prefetch.hidden_share}}


def _digest(tokens: Sequence[Sequence[int]]) -> str:
    """A fingerprint of rank 0's generated tokens (to compare runs, e.g. with and without --kv-offload)."""
    return hashlib.sha1(json.dumps([list(t) for t in tokens]).encode()).hexdigest()


def _p90(values: Sequence[float]) -> float:
    return values[0] if len(values) < 2 else statistics.quantiles(values, n=10, method="inclusive")[-1]


@dataclasses.dataclass
class _Round:
    """What one generation of a run recorded on this rank."""

    stamps: List[float]  # perf_counter at the start, then once each step's tokens are taken
    timelines: List[Timeline]  # one per observed decode step (timed rounds only)
    generated: Generated
    prefetch: Optional[PrefetchReport] = None  # the host cache's prefetches (--kv-offload)
    observed: Tuple[int, ...] = ()  # the decode steps (0: the first) whose launches the timelines hold

    @property
    def step_s(self) -> List[float]:
        """Each decode step's seconds but the observed ones' (a timeline's events and clock synchronizes are
        part of an observed step: on a device, half of a small step)."""
        out = [b - a for a, b in zip(self.stamps[1:], self.stamps[2:])]
        return [dt for j, dt in enumerate(out) if j not in self.observed]


def measure_generation(model: DecodeModel, prompts: Sequence[Sequence[int]], limits: Sequence[int],
                       runs: Sequence[Run], group: Optional[dist.ProcessGroup], make_cache: MakeCache, *,
                       stop_token: Optional[int] = None, warmup: int = 1, iters: int = 3, margins: bool = False,
                       progress: Optional[Progress] = None, calibration: Optional[DecodeCalibration] = None,
                       decoders: Optional[Mapping[str, Decoders]] = None,
                       buckets: Optional[Sequence[int]] = None, guard: bool = True) -> List[RunResult]:
    """Generate ``prompts`` (this rank's; ``limits``: each one's most new tokens) ``warmup + iters`` times in each
    run, interleaved (`launch.measure.rounds.rounds`); ``make_cache()`` gives each generation its cache;
    ``progress(line, round_start, first_round)`` hears of every step; ``calibration``: the decode calibration a
    run whose decode mode is ``auto`` chooses from (`launch.engine.calibrate_decode`); ``decoders``: by run
    label, the `GraphDecoder` whose captured steps (and cache) the run's generations use (an auto run's: one per
    mode of ``calibration``, over one cache); ``buckets``: the sizes
    eager steps pad their exchange to; ``guard``: an auto run checks its choices with a `DecodeGuard` kept across
    its rounds."""
    by_label = {r.label: r for r in runs}
    order = rounds([r.label for r in runs], warmup, iters)
    kept: Dict[str, List[_Round]] = {r.label: [] for r in runs}
    last: Dict[str, Generated] = {}
    guards = {r.label: DecodeGuard() for r in runs if r.decode == AUTO and guard}
    for i, labels in enumerate(order):
        timed = i >= warmup
        for label in labels:
            decoder = (decoders or {}).get(label)
            options = {"decoder": decoder} if decoder is not None else {"cache": make_cache(), "buckets": buckets}
            if by_label[label].decode == AUTO:
                options["calibration"] = calibration
                options["guard"] = guards.get(label, False)
            one = _generate_once(model, prompts, limits, by_label[label], stop_token, timed, margins, i, len(order),
                                 progress, options)
            last[label] = one.generated
            if timed:
                kept[label].append(one)
    results = [_result(by_label[label], kept[label], last[label], group) for label in kept]
    for r in results:
        if r.run.label in guards:
            r.guard = guards[r.run.label].summary()
    _compare(results, model, not dist.is_initialized() or dist.get_world_size(group) == 1)
    return results


def _compare(results: Sequence[RunResult], model: DecodeModel, alone: bool) -> None:
    """Each run's speedup (serial's TPOT over its) and what it is (`launch.measure.verdicts.judge`); ``alone``: one
    rank."""
    serial = next((r for r in results if r.run == Run("serial", "serial")), None)
    for r in results:
        r.alone = alone
        if serial is not None and serial.tpot_s and r.tpot_s:
            r.speedup = serial.tpot_s / r.tpot_s
            r.serial_schedule = None if r is serial else decode_serial_schedule(model, r)
            r.judged = REFERENCE if r is serial else verdicts.judge(r.speedup, noise(r, serial),
                                                                    same=r.serial_schedule is not None, alone=alone)


def noise(r: RunResult, serial: RunResult) -> Optional[float]:
    """The spread ``r``'s TPOT is compared with serial's against: the larger of the two runs' (None with fewer than
    two timed rounds)."""
    if len(r.round_tpot_s) < 2 or len(serial.round_tpot_s) < 2:
        return None
    return max(r.spread or 0.0, serial.spread or 0.0)


def decode_serial_schedule(model: DecodeModel, r: RunResult) -> Optional[str]:
    """Why ``r``'s decode steps ran serial's schedule, in words (one batch with nothing beside its exchanges,
    `launch.measure.verdicts.overlaps_nothing`: an auto run whose every step ran such a mode); None where they did
    not."""
    modes = list(r.steps_by_mode) if r.run.decode == AUTO else [r.run.decode]
    if not modes or not all(m == "serial" or _overlaps_nothing(model, m) for m in modes):
        return None
    if r.run.decode == AUTO:
        return ("every decode step ran serial" if modes == ["serial"] else
                f"every decode step ran {' or '.join(modes)}: one batch, nothing beside its exchanges")
    layers = model.decode_layer_operations()
    if not any(op.stream == SHARED_EXPERT for layer in layers for op in layer):
        return "the model has no shared experts: nothing runs beside its exchanges"
    return "one batch, nothing runs beside its exchanges"


def _overlaps_nothing(model: DecodeModel, name: str) -> bool:
    """Whether decode mode ``name`` runs serial's schedule on ``model`` (one batch, nothing beside its exchanges)."""
    how = microbatch.decode_mode(name)
    if how.micro_batches > 1:
        return False
    layers = model.decode_layer_operations(how.moe_chunks)
    return overlaps_nothing(how.make(layers, 1), layers)


def _generate_once(model: DecodeModel, prompts: Sequence[Sequence[int]], limits: Sequence[int], run: Run,
                   stop_token: Optional[int], timed: bool, margins: bool, round_no: int, n_rounds: int,
                   progress: Optional[Progress], options: Dict[str, Any]) -> _Round:
    """One generation of ``run`` (``options``: `generate`'s cache or decoder, buckets and calibration), timed per
    step."""
    stamps: List[float] = []
    timelines: List[Timeline] = []
    observed: List[int] = []

    def on_step(step: int, active: int) -> bool:
        stamps.append(time.perf_counter())
        if observed and observed[-1] == step - 1:
            timelines[-1].stop()
        observe = timed and bool(active) and observes(step)
        if observe:  # the next decode step's launches
            observed.append(step)
            timelines.append(Timeline().start())
        if progress is not None:
            progress(f"{run.label}: round {round_no + 1}/{n_rounds}, step {step}, {active} active request(s)",
                     step == 0, round_no == 0)
        return observe

    overlap.synchronize()
    if dist.is_initialized():
        dist.barrier()
    stamps.append(time.perf_counter())
    generated = generate(model, prompts, list(limits), stop_token=stop_token, mode=run.decode,
                         prefill_mode=run.prefill, on_step=on_step, margins=margins, **options)
    prefetch = None
    cache = options.get("cache")
    if isinstance(cache, OffloadedKVCache):
        prefetch = cache.prefetch_report()
        cache.close()
    return _Round(stamps, timelines, generated, prefetch, tuple(observed))


def _result(run: Run, kept: List[_Round], generated: Generated, group: Optional[dist.ProcessGroup]) -> RunResult:
    ttft = [r.stamps[1] - r.stamps[0] for r in kept]
    total = [r.stamps[-1] - r.stamps[0] for r in kept]
    steps = [r.step_s for r in kept]
    mine = sum(len(t) for t in generated.tokens)
    flat = ttft + total + [s for round_steps in steps for s in round_steps]
    if group is not None:  # one all-reduce: the slowest rank's times (the ranks step together)
        flat = max_over_ranks(flat, group)
        counts = torch.tensor([mine], dtype=torch.long, device=overlap.collective_device(group))
        dist.all_reduce(counts, group=group)
        mine = int(counts[0])
    n = len(kept)
    per_round, at = [], 2 * n
    for round_steps in steps:  # the slowest rank's steps, round by round (every rank runs the same steps)
        per_round.append(flat[at:at + len(round_steps)])
        at += len(round_steps)
    result = RunResult(run, flat[:n], flat[n:2 * n], flat[2 * n:], mine, generated, _sum([r.prefetch for r in kept]),
                       chosen=[m for r in kept for m in r.generated.modes] if run.decode == AUTO else [],
                       predicted_s=[p for r in kept for p in r.generated.predicted],
                       round_tpot_s=[statistics.median(x) for x in per_round if x])
    _keep_median_round(result, kept, group)
    return result


def _sum(reports: Sequence[Optional[PrefetchReport]]) -> Optional[PrefetchReport]:
    got = [r for r in reports if r is not None]
    if not got:
        return None
    return PrefetchReport(*(sum(getattr(r, f.name) for r in got) for f in dataclasses.fields(PrefetchReport)))


def _steps_counted(r: RunResult) -> str:
    """The decode steps a round whose times make the TPOT (the unobserved ones), in words."""
    counted = len(r.step_s) // max(1, len(r.ttft_s))
    if counted >= r.generated.steps:
        return f"{counted} steps a round"
    return (f"{counted} of the {r.generated.steps} steps a round (the other {r.generated.steps - counted} recorded "
            f"for the trace: observing slows a step)")


def _keep_median_round(result: RunResult, kept: List[_Round], group: Optional[dist.ProcessGroup]) -> None:
    """The decode hidden share of each timed round (every rank's spans of its observed steps); the round at the
    median keeps the spans of the middle one of its observed steps as the run's trace."""
    if not kept or not kept[0].timelines:
        return
    per_round = [gather([s for tl in r.timelines for s in tl.spans], group) for r in kept]
    hidden = [metrics(spans).hidden_share for spans in per_round]
    at = sorted(range(len(kept)), key=lambda i: (-1.0 if hidden[i] is None else hidden[i], result.total_s[i]))
    k = at[(len(at) - 1) // 2]
    result.hidden_comm_share = hidden[k]
    # the middle one of its observed steps (the ranks step together: the same step on every rank)
    result.spans = gather(kept[k].timelines[(len(kept[k].timelines) - 1) // 2].spans, group)


def check(results: Sequence[RunResult], dtype: torch.dtype, group: Optional[dist.ProcessGroup]
          ) -> Tuple[List[str], List[str]]:
    """Each run's tokens against serial's on every rank: ``(failures, notes)`` in words, the same on every rank.

    In float32 the tokens must be identical. In bf16 / fp16 a near-tie may flip: the first step and request
    that differ are reported with serial's logit margin there (the gap between its top two logits), and a
    difference fails only where that margin is above the dtype's rounding (0.05 x max(1, the logit))."""
    serial = next((r for r in results if r.run == Run("serial", "serial")), None)
    if serial is None:
        return ["--check needs serial among the modes"], []
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = []
    for r in results:
        if r is serial:
            continue
        at = first_difference(r.generated.tokens, serial.generated.tokens)
        if at is not None:
            req, step = at
            margins = serial.generated.margins
            gap = margins[req][step] if margins and step < len(margins[req]) else None
            mine.append((r.run.label, rank, req, step, gap))
    every: List[List[Tuple[str, int, int, int, Optional[float]]]] = [mine]
    if group is not None:
        every = [[] for _ in range(dist.get_world_size(group))]
        dist.all_gather_object(every, mine, group=group)
    failures, notes = [], []
    for label in [r.run.label for r in results if r is not serial]:
        found = sorted((d for part in every for d in part if d[0] == label), key=lambda d: (d[3], d[1], d[2]))
        if found:
            _, rank_, req, step, gap = found[0]
            judge(f"{label}: {len(found)} rank(s) differ from serial's tokens, first at decode step {step} "
                  f"(0: the prefill's token) of request {req} on rank {rank_}", dtype, gap, failures, notes)
    return failures, notes


def first_difference(tokens: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]
                     ) -> Optional[Tuple[int, int]]:
    """``(request, step)`` of the first token (by step, then request) where ``tokens`` differ from ``reference``
    (a missing or extra token counts), or None."""
    first: Optional[Tuple[int, int]] = None
    for i, (a, b) in enumerate(zip(tokens, reference)):
        at = next((s for s, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is None and len(a) != len(b):
            at = min(len(a), len(b))
        if at is not None and (first is None or at < first[1]):
            first = (i, at)
    if len(tokens) != len(reference):
        first = first or (min(len(tokens), len(reference)), 0)
    return first


NEAR_TIE = 0.05  # a logit margin that bf16 / fp16 rounding may flip


def judge(where: str, dtype: torch.dtype, gap: Optional[float], failures: List[str], notes: List[str]) -> None:
    """A difference between two runs' tokens at ``where``, with the reference's logit margin there (``gap``):
    a failure in float32 or above `NEAR_TIE`, else a note (a near-tie that half precision may flip)."""
    half = str(dtype).replace("torch.", "")
    if dtype == torch.float32 or gap is None:
        failures.append(where + (" (float32: the tokens must be identical)" if dtype == torch.float32 else ""))
    elif gap <= NEAR_TIE:
        notes.append(where + f": serial's logit margin there is {gap:.3g}, a near-tie in {half} (not a failure)")
    else:
        failures.append(where + f": serial's logit margin there is {gap:.3g}, above what {half} rounding flips")


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.0%}"


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def table(results: Sequence[RunResult]) -> str:
    """The runs as an aligned text table, then what the figures rest on and what each speedup is."""
    head = ("mode", "TTFT ms", "TPOT ms median", "TPOT p90", "spread", "tokens/s", "speedup", "hidden comm (decode)")
    body = [(r.run.label, _ms(statistics.median(r.ttft_s)), _ms(r.tpot_s), _ms(r.tpot_p90_s), _pct(r.spread),
             f"{r.tokens_per_s:.0f}", mark(r.speedup, r.judged), _pct(r.hidden_comm_share)) for r in results]
    offloaded = any(r.prefetch is not None for r in results)
    if offloaded:  # --kv-offload: how much of the prefetches' copy time compute hid (rank 0's)
        head += ("KV prefetch hidden",)
        body = [row + (_pct(None if r.prefetch is None else r.prefetch.hidden_share),) for row, r in zip(body, results)]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*row).rstrip() for row in [head, tuple("-" * w for w in widths)] + body]
    if results:
        r = results[0]
        n = len(r.ttft_s)
        lines.append(f"medians of {n} timed round(s) per mode, the modes interleaved; TPOT: each decode "
                     f"step's time (one token per active request), over {_steps_counted(r)}; spread: the rounds' "
                     f"interquartile range of TPOT (each round's median step) over its median; tokens/s: every "
                     f"rank's generated tokens (each request's first, the prefill's, included) over the generation's "
                     f"time (the prefill and every decode step), the median round's; speedup: serial's median TPOT "
                     f"over the mode's")
        serial = next((x for x in results if x.run == Run("serial", "serial")), None)
        if serial is not None:
            lines += speedup_notes([Compared(x.run.label, x.speedup, noise(x, serial), x.judged or "",
                                             x.serial_schedule, x.alone)
                                    for x in results if x is not serial and x.speedup is not None], n,
                                   f"--iters {max(10, 2 * n)}")
        for x in results:
            if x.chosen:
                lines.append(_auto_line(x, serial))
        if offloaded:
            lines.append("KV prefetch hidden: the share of the next layer's history copies (host to device, on the "
                         "kv_offload stream) that compute hid, rank 0's, over the timed rounds")
    return "\n".join(lines)


def _auto_line(r: RunResult, serial: Optional[RunResult]) -> str:
    """Auto's steps per mode, its predicted and measured TPOT, and serial's measured TPOT beside them."""
    modes = ", ".join(f"{n} {m}" for m, n in r.steps_by_mode.items())
    beside = f", serial measured {_ms(serial.tpot_s)} ms" if serial is not None else ""
    return (f"{r.run.label}: decode steps per mode {modes}; TPOT predicted {_ms(r.predicted_tpot_s)} ms, measured "
            f"{_ms(r.tpot_s)} ms{beside}" + (f"; {r.guard}" if r.guard else ""))


__all__ = ["NEAR_TIE", "OBSERVE_EVERY", "Run", "RunResult", "check", "decode_serial_schedule", "first_difference",
           "judge", "measure_generation", "noise", "observes", "table"]
