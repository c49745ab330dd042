"""Benchmark greedy decode: time per output token of every decode mode, over batch sizes and link speeds.

On 2 CPU ranks (gloo, started here) with the expert-parallel reference decoder and the simulated
link (`overlap.set_link`), each point is a number of active requests per rank (one new token each
per decode step, every request with a short prompt) at one link speed. At each point the decode
modes of `decode_modes` run interleaved round by round (`launch.measure.rounds`): every round
generates the same prompts once in each mode (`launch.decode.generate`, the prefill serial and not
timed), and each decode step is timed. Per point it prints:

- ``comm/serial``: communication's share of a serial decode step (the exchanges' time on the timeline of
  one extra serial generation, over each step's time; the slowest rank's median step);
- per mode, TPOT: the median decode-step time (the slowest rank's, over every step of every timed
  round), and its speedup (serial's TPOT over the mode's);
- the best mode, the spread of the step times (the largest of the modes' interquartile range over
  median), and the rounds and steps the medians rest on.

The defaults, the ``small`` preset at 0.03, 0.1 and 1 GB/s, put communication at about 50%, 33% and
25% of a serial step at 256 tokens per rank on a 2-core host (gloo's own cost per exchange is the
floor); smaller batches are latency-bound, 45-60% at any link. (``tiny`` is 50-75% at any link.)

Before a link's points it calibrates decode (`launch.decode_plan.calibrate_decode`, as the launcher's
``--decode-mode auto`` does, with ``--calibration-rounds`` rounds: 16 by default, four times the launcher's), and
``auto`` runs as a mode, with its guard (`microbatch.planning.DecodeGuard`, one per point, kept over its rounds;
``--no-decode-guard``: none): the table shows what it chose and its speedup as measured by the fixed modes that ran
the same schedules, and each mode's predicted speedup with its error. Auto's speedup in ``auto as chosen x`` (the
one the targets judge) costs each of its steps at the TPOT of the fixed mode it chose there, plus its own host time
per step for choosing: its own row (``auto x``) is a second, independent sample of the same schedules, as noisy as
any mode's. ``--calibrate-at GBPS`` calibrates once, at that link, for every link: a stale calibration on purpose,
to see what the guard makes of it. Each point runs at least ``--iters`` rounds, and more at small batches (until
serial's steps add up to about ``--min-seconds``), since their times spread widely on a shared host. The last lines
check the targets (issue 29): the best overlapped mode at least 1.15x serial at 256 tokens per rank where
communication is at least 30% of serial's step; auto within 5% of the best fixed mode and at most 2% above serial at
every point (each miss named with the standard error of its comparison, from the steps' spread, and the misses by
more than two of them counted: the rest this host's noise alone could make); predicted speedups within 10% of the
measured ones at 90% of the points. Example::

    python -m launch.bench.decode
    python -m launch.bench.decode --tokens 8,64 --links 0.05,0.2 --iters 3
"""
from __future__ import annotations

import collections
import dataclasses
import math
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import click

SERIAL = "serial"
AUTO = "auto"
TARGET_TOKENS, TARGET_SHARE, TARGET_SPEEDUP = 256, 0.30, 1.15  # issue 29: overlap pays where comm is large
MAX_ROUNDS = 200
HOST_TOKENS, TARGET_HOST = 32, 0.10  # the executor's own host time per decode step, against TPOT
# rounds behind each entry of auto's calibration: four times the launcher's default, about half its noise (the
# predictions target compares two measurements; the calibration's would otherwise carry most of the error)
CALIBRATION_ROUNDS = 16


def decode_modes() -> Tuple[str, ...]:
    """The decode modes every point measures, serial first (the reference of every speedup).

    A new mode is one more name here; one that needs more than its name passed to
    `launch.decode.generate` gets a maker in `MODE_ARGUMENTS`.
    """
    return (SERIAL, "shared", "two-batch", "chunked-2", "chunked-4", AUTO)


@dataclasses.dataclass(frozen=True)
class Point:
    """What a mode's arguments may depend on: the model, its expert group, the point's size and link."""

    model: Any
    group: Any
    tokens: int  # active requests per rank
    gbps: float
    plan: Any = None  # the link's decode calibration (`launch.decode_plan.calibrate_decode`), for auto
    guard: bool = True  # auto checks its choices with a `microbatch.planning.DecodeGuard` kept over the point


ModeArguments = Callable[[str, Point], Dict[str, Any]]  # (mode name, point) -> generate()'s keyword arguments

# Per name prefix (e.g. "chunked-" for "chunked-4"), a maker of generate()'s keyword arguments for a mode that needs
# more than ``mode=name`` (a chunk count, a calibration for "auto"); the first prefix that matches is used.
def _auto_arguments(name: str, point: Point) -> Dict[str, Any]:
    """Auto's: the point's calibration, and a guard of its own, kept over the point's rounds."""
    from microbatch.planning import DecodeGuard

    return {"mode": AUTO, "plan": point.plan, "guard": DecodeGuard() if point.guard else False}


MODE_ARGUMENTS: Dict[str, ModeArguments] = {AUTO: _auto_arguments}


def generate_arguments(name: str, point: Point) -> Dict[str, Any]:
    """`launch.decode.generate`'s keyword arguments that run decode mode ``name`` at ``point`` (the prefill serial)."""
    maker = next((make for prefix, make in MODE_ARGUMENTS.items() if name.startswith(prefix)), None)
    extra = maker(name, point) if maker is not None else {"mode": name}
    return {"prefill_mode": SERIAL, **extra}


def _prompts(requests: int, prompt_len: int, vocab: int, seed: int) -> List[List[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (requests, prompt_len), generator=gen).tolist()


def _step_times(model: Any, prompts: List[List[int]], new_tokens: int, kwargs: Dict[str, Any], group: Any,
                record: bool = False) -> Tuple[List[float], List[Any], Any]:
    """One generation: each decode step's seconds on this rank, with ``record`` each step's timeline, and what
    `generate` returned."""
    import torch.distributed as dist

    import overlap
    from launch.decode import generate
    from overlap import Timeline

    stamps: List[float] = []
    timelines: List[Any] = []

    def on_step(step: int, active: int) -> None:
        stamps.append(time.perf_counter())
        if timelines:
            timelines[-1].stop()
        if record and active:
            timelines.append(Timeline().start())  # the next decode step's launches

    overlap.synchronize()
    dist.barrier(group=group)
    out = generate(model, prompts, new_tokens, on_step=on_step, **kwargs)
    for tl in timelines:
        tl.stop()
    return [b - a for a, b in zip(stamps, stamps[1:])], timelines, out


def _comm_share(model: Any, prompts: List[List[int]], new_tokens: int, kwargs: Dict[str, Any], group: Any
                ) -> Optional[float]:
    """Communication's share of a serial decode step: this rank's exchange time on the step's timeline over the
    step's time, median over the steps, the largest of the ranks (one generation, recorded, not timed)."""
    from microbatch.planning import max_over_ranks
    from overlap.observability import metrics

    steps, timelines, _ = _step_times(model, prompts, new_tokens, kwargs, group, record=True)
    shares = []
    for dt, tl in zip(steps, timelines):
        per_rank = metrics(tl.spans).per_rank
        comm = max((m.comm_time for m in per_rank.values()), default=0.0)
        shares.append(min(comm / dt, 1.0) if dt > 0 else 0.0)
    share = max_over_ranks([statistics.median(shares) if shares else -1.0], group)[0]
    return share if share >= 0 else None


def _executor_host(model: Any, tokens: int, history: int, group: Any, steps: int = 12) -> float:
    """The executor's own host time in a serial decode step of ``tokens`` requests holding ``history`` rows: the
    time `microbatch.run_made` takes less the time inside the operations' functions (serial waits for nothing:
    its exchanges are synchronous inside their operations), median over ``steps`` steps, the larger rank's."""
    import dataclasses as dc

    import microbatch
    from collectives import MOE_CAPACITY
    from launch.decode import split_by_cost
    from launch.decode_step import bucket_of
    from microbatch import HIDDEN, KV_STEP, KVCache, KVStep
    from microbatch.planning import max_over_ranks

    inside = [0.0]

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                inside[0] += time.perf_counter() - start
        return run

    layers = [[dc.replace(op, fn=timed(op.fn)) for op in layer] for layer in model.decode_layer_operations()]
    cfg, weight = model.cfg, next(model.parameters())
    cache = KVCache(cfg.n_layers, tokens, history + 1, cfg.k_shape, cfg.v_shape, dtype=weight.dtype,
                    device=weight.device)
    slots = cache.admit(tokens)
    for s in slots:
        cache.lengths[s] = history
    (part,) = split_by_cost([history] * tokens, 1)
    ids = _ids(tokens, cfg.vocab)
    make = microbatch.decode_mode(SERIAL).make
    host = []
    for _ in range(steps + 1):  # the first step lowers the program: not counted
        staged = [{HIDDEN: model.embed_tokens(ids), KV_STEP: KVStep(cache, cache.rows([slots[j] for j in part])),
                   MOE_CAPACITY: bucket_of(tokens)}]
        inside[0] = 0.0
        start = time.perf_counter()
        microbatch.run_made(make, layers, staged)
        host.append(time.perf_counter() - start - inside[0])
    return max_over_ranks([statistics.median(host[1:])], group)[0]


def _choosing(point: Point, history: float, group: Any, calls: int = 200) -> float:
    """Auto's own host time per step beyond its mode's: choosing the step's mode (its guard's ``choose`` and
    ``record``, or `choose_decode` without a guard), median over ``calls`` steps of a fresh guard, the larger rank's."""
    from microbatch.planning import DecodeGuard, choose_decode, max_over_ranks

    guard = DecodeGuard() if point.guard else None
    took = []
    for _ in range(calls):
        start = time.perf_counter()
        if guard is not None:
            choice = guard.choose(point.plan, point.tokens, history)
            guard.record(choice.mode, choice.seconds, choice.seconds)
        else:
            choose_decode(point.plan, point.tokens, history)
        took.append(time.perf_counter() - start)
    return max_over_ranks([statistics.median(took)], group)[0]


def _ids(n: int, vocab: int) -> Any:
    """``n`` token ids, the same on every call."""
    import torch

    return torch.arange(n) % vocab


def _enough(serial_steps: List[float], timed: int, iters: int, min_seconds: float, group: Any) -> bool:
    """Whether a point has run enough rounds: ``iters``, and serial's steps about ``min_seconds`` in all (the
    slowest rank's sum, so every rank stops at the same round)."""
    from microbatch.planning import max_over_ranks

    if timed < iters:
        return False
    if min_seconds <= 0 or timed >= MAX_ROUNDS:
        return True
    return max_over_ranks([sum(serial_steps)], group)[0] >= min_seconds


def _point(ctx: Any, model: Any, point: Point, modes: Sequence[str], prompt_len: int, new_tokens: int, warmup: int,
           iters: int, min_seconds: float, seed: int) -> Dict[str, Any]:
    """Every mode's decode-step times at one point, interleaved round by round; serial's comm share."""
    from launch.measure import rounds, spread
    from microbatch.planning import max_over_ranks
    from microbatch.planning.decode import relative_error

    prompts = _prompts(point.tokens, prompt_len, model.cfg.vocab, seed + 1009 * ctx.rank + point.tokens)
    kwargs = {m: generate_arguments(m, point) for m in modes}
    steps: Dict[str, List[float]] = {m: [] for m in modes}
    chosen: List[str] = []  # auto's modes, every timed step
    timed = 0
    for i, order in enumerate(rounds(list(modes), warmup, MAX_ROUNDS)):
        for m in order:
            got, _, out = _step_times(model, prompts, new_tokens, kwargs[m], ctx.group)
            if i >= warmup:
                steps[m].extend(got)
                chosen += out.modes if m == AUTO else []
        timed += i >= warmup
        if i >= warmup and _enough(steps[SERIAL], timed, iters, min_seconds, ctx.group):
            break
    share = _comm_share(model, prompts, new_tokens, kwargs[SERIAL], ctx.group)
    host = _executor_host(model, point.tokens, prompt_len + new_tokens // 2, ctx.group)
    rows, noise = {}, {}
    for m in modes:  # the ranks step together: per step, the slowest rank's time
        slowest = max_over_ranks(steps[m], ctx.group) if steps[m] else []
        rows[m] = (statistics.median(slowest) if slowest else math.nan, spread(slowest))
        noise[m] = relative_error(slowest)
    history = prompt_len + (new_tokens - 1) / 2  # the middle step's rows held: its prediction is the median's
    predicted = {} if point.plan is None else {m: point.plan.predict(m, point.tokens, history)
                                               for m in point.plan.modes}
    guard = kwargs.get(AUTO, {}).get("guard")
    choosing = {} if AUTO not in modes else {"choosing_s": _choosing(point, history, ctx.group)}
    return {"tokens": point.tokens, "link": point.gbps, "comm_share": share, "rounds": timed, **choosing,
            "steps": len(steps[SERIAL]) // max(timed, 1), "rows": rows, "noise": noise, "predicted": predicted,
            "executor_s": host,
            "chosen": dict(collections.Counter(chosen)), "guard": guard.summary() if guard else None,
            "vetoed": dict(guard.vetoed) if guard else {}}


def _rank_body(ctx: Any, preset_name: str, modes: List[str], tokens: List[int], links: List[float], prompt_len: int,
               new_tokens: int, warmup: int, iters: int, min_seconds: float, seed: int, comm_priority: str,
               guard: bool = True, calibrate_at: Optional[float] = None, calibration_rounds: int = CALIBRATION_ROUNDS
               ) -> Any:
    import overlap
    from launch.models import build_model, preset
    from launch.runner import make_expert_parallel

    overlap.set_comm_priority(comm_priority)
    model = make_expert_parallel(build_model(preset(preset_name), seed=seed), ctx.group)
    out = []
    fixed = None  # --calibrate-at: one calibration, at that link, for every link's points
    if AUTO in modes and calibrate_at is not None:
        overlap.set_link(overlap.Link(calibrate_at))
        fixed = _calibrate(ctx, model, max(tokens), prompt_len, new_tokens, calibrate_at, calibration_rounds)
    for gbps in links:
        overlap.set_link(overlap.Link(gbps))
        plan = fixed or (_calibrate(ctx, model, max(tokens), prompt_len, new_tokens, gbps, calibration_rounds)
                         if AUTO in modes else None)
        for n in tokens:
            out.append(_point(ctx, model, Point(model, ctx.group, n, gbps, plan, guard), modes, prompt_len,
                              new_tokens, warmup, iters, min_seconds, seed))
    return out if ctx.rank == 0 else None


def _calibrate(ctx: Any, model: Any, max_tokens: int, prompt_len: int, new_tokens: int, gbps: float,
               rounds: int) -> Any:
    """The link's decode calibration, as the launcher's ``--decode-mode auto`` makes it (progress on rank 0)."""
    from launch.decode_plan import calibrate_decode, calibration_histories

    start = time.perf_counter()
    plan = calibrate_decode(model, max_tokens=max_tokens, histories=calibration_histories([prompt_len], new_tokens),
                            repeats=rounds, refresh=True)  # measured in this run, as the modes it is judged against
    if ctx.rank == 0:
        noise = sorted(x for rows in (plan.noise or {}).values() for r in rows for x in r) or [0.0]
        print(f"calibrated decode at {gbps:g} GB/s in {time.perf_counter() - start:.1f} s "
              f"({rounds} round{'s' if rounds != 1 else ''}; entries' noise {noise[0]:.1%} to {noise[-1]:.1%}, "
              f"median {statistics.median(noise):.1%})", flush=True)
    return plan


def speedups(point: Dict[str, Any]) -> Dict[str, float]:
    """Each mode's speedup at a point: serial's TPOT over the mode's."""
    serial = point["rows"][SERIAL][0]
    return {m: serial / row[0] for m, row in point["rows"].items()}


def best_mode(point: Dict[str, Any]) -> str:
    """The fixed mode with the smallest TPOT at a point (auto is judged against it)."""
    return min((m for m in point["rows"] if m != AUTO), key=lambda m: point["rows"][m][0])


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.0%}"


def table(points: Sequence[Dict[str, Any]]) -> str:
    """One link's points as an aligned text table: a row per batch size."""
    modes = list(points[0]["rows"])
    auto = AUTO in modes
    head = (["tokens/rank", "link GB/s", "comm/serial"] + [f"{m} ms" for m in modes]
            + [f"{m} x" for m in modes if m != SERIAL] + ["best", "spread", "rounds x steps", "executor/TPOT"]
            + (["auto chose", "auto as chosen x", "predicted x (error)"] if auto else []))
    body = []
    for p in points:
        ups = speedups(p)
        spreads = [row[1] for row in p["rows"].values() if row[1] is not None]
        row = ([str(p["tokens"]), f"{p['link']:g}", _pct(p["comm_share"])]
               + [f"{p['rows'][m][0] * 1e3:.2f}" for m in modes]
               + [f"{ups[m]:.2f}x" for m in modes if m != SERIAL]
               + [best_mode(p), _pct(max(spreads, default=None)), f"{p['rounds']} x {p['steps']}",
                  _pct(executor_share(p))])
        if auto:
            total = sum((p.get("chosen") or {}).values()) or 1
            chose = ", ".join(f"{m} {n / total:.0%}" for m, n in sorted((p.get("chosen") or {}).items(),
                                                                        key=lambda kv: -kv[1]))
            mode, seconds = auto_as_fixed(p)
            pred = p.get("predicted") or {}
            errs = prediction_errors(p)
            row += [chose or "-", f"{p['rows'][SERIAL][0] / seconds:.2f}x" + (f" ({mode})" if mode else ""),
                    " ".join(f"{m} {pred[SERIAL] / pred[m]:.2f}x ({errs[m]:+.0%})" for m in errs) or "-"]
        body.append(row)
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join(fmt.format(*row).rstrip() for row in [head, ["-" * w for w in widths]] + body)


Target = Tuple[str, Optional[bool], str]  # what, met (None: not checked), the figures behind it


def target_overlap_pays(points: Sequence[Dict[str, Any]]) -> Target:
    """The best overlapped mode at least 1.15x serial at every 256-token point whose comm share is at least 30%."""
    what = (f"best overlapped mode >= {TARGET_SPEEDUP:.2f}x serial at {TARGET_TOKENS} tokens/rank where comm >= "
            f"{TARGET_SHARE:.0%}")
    found = []
    for p in points:
        if p["tokens"] != TARGET_TOKENS or p["comm_share"] is None or p["comm_share"] < TARGET_SHARE:
            continue
        ups = {m: s for m, s in speedups(p).items() if m not in (SERIAL, AUTO)}  # the fixed overlapped modes
        if ups:
            mode = max(ups, key=lambda m: ups[m])
            found.append((ups[mode], f"{mode} {ups[mode]:.2f}x at {p['link']:g} GB/s (comm {_pct(p['comm_share'])})"))
    if not found:
        return what, None, f"no point at {TARGET_TOKENS} tokens/rank with comm >= {TARGET_SHARE:.0%}"
    return what, all(s >= TARGET_SPEEDUP for s, _ in found), "; ".join(text for _, text in found)


MIXED = "mixed"  # auto's label where its steps ran in more than one mode


def auto_as_fixed(point: Dict[str, Any]) -> Tuple[Optional[str], Optional[float]]:
    """Auto's TPOT at a point as the fixed modes that ran its schedule measured it: each of its steps costed at the
    TPOT of the fixed mode it chose (its own row is a second, independent sample of those schedules), plus its own
    host time per step for choosing (``choosing_s``). ``(the mode, or "mixed", seconds)``; auto's own row,
    ``(None, seconds)``, where it chose a mode the point did not measure."""
    if AUTO not in point["rows"]:
        return None, None
    chosen = point.get("chosen") or {}  # steps per mode (a Counter's: none at 0)
    if not chosen or any(m not in point["rows"] for m in chosen):
        return None, point["rows"][AUTO][0]
    steps = sum(chosen.values())
    seconds = sum(point["rows"][m][0] * n for m, n in chosen.items()) / steps + point.get("choosing_s", 0.0)
    return (next(iter(chosen)) if len(chosen) == 1 else MIXED), seconds


def executor_share(point: Dict[str, Any]) -> Optional[float]:
    """The executor's own host time in a serial decode step over serial's TPOT at a point."""
    host = point.get("executor_s")
    return None if host is None else host / point["rows"][SERIAL][0]


def target_host(points: Sequence[Dict[str, Any]]) -> Target:
    """The executor's host time per decode step at most 10% of the time per output token at 32 tokens per rank."""
    what = f"executor's host time per decode step <= {TARGET_HOST:.0%} of TPOT at {HOST_TOKENS} tokens/rank"
    found = [(executor_share(p), p) for p in points if p["tokens"] == HOST_TOKENS and executor_share(p) is not None]
    if not found:
        return what, None, f"no point at {HOST_TOKENS} tokens/rank"
    return what, all(sh <= TARGET_HOST for sh, _ in found), "; ".join(
        f"{sh:.1%} ({p['executor_s'] * 1e3:.2f} of {p['rows'][SERIAL][0] * 1e3:.1f} ms) at {p['link']:g} GB/s"
        for sh, p in found)


def target_auto(points: Sequence[Dict[str, Any]]) -> Target:
    """Auto (as the fixed modes it ran measured it, `auto_as_fixed`) within 5% of the best fixed mode and at most 2%
    above serial at every point. A miss is named with the standard error of its comparison (from the steps' spread,
    ``noise`` per mode), and the detail counts the misses by more than two of them: the others the benchmark's own
    noise could make."""
    what = "auto within 5% of the best fixed mode and <= 2% above serial at every point"
    judged = []
    for p in points:
        mode, auto = auto_as_fixed(p)
        if auto is None:
            continue
        fixed = {m: row[0] for m, row in p["rows"].items() if m != AUTO}
        best = min(fixed, key=fixed.get)
        noise = p.get("noise") or {}
        costed = list(p.get("chosen") or ()) if mode is not None else [AUTO]  # the rows auto's TPOT was read from
        mine = max(noise.get(m, 0.0) for m in costed)
        misses = [(auto / fixed[ref] - 1.0 - allowed, math.hypot(mine, noise.get(ref, 0.0)))
                  for ref, allowed in ((best, 0.05), (SERIAL, 0.02)) if auto > fixed[ref] * (1.0 + allowed)]
        se = max((e for _, e in misses), default=0.0)
        label = "" if mode is None else " as its modes" if mode == MIXED else f" as {mode}"
        judged.append((not misses, any(by > 2 * e for by, e in misses),
                       f"{p['tokens']} @ {p['link']:g}: auto{label} {fixed[SERIAL] / auto:.2f}x, best {best} "
                       f"{fixed[SERIAL] / fixed[best]:.2f}x" + (f" (±{se:.1%})" if misses and se else "")))
    if not judged:
        return what, None, "no auto row"
    missed = [text for ok, _, text in judged if not ok]
    beyond = sum(clear for ok, clear, _ in judged if not ok)
    return what, not missed, (f"missed at {len(missed)} of {len(judged)} points, {beyond} of them by more than two "
                              f"standard errors of the measurement (±): " + "; ".join(missed)) if missed \
        else f"{len(judged)} points"


def prediction_errors(point: Dict[str, Any]) -> Dict[str, float]:
    """Per calibrated mode but serial: the predicted speedup relative to serial over the measured one, less 1."""
    pred, rows = point.get("predicted") or {}, point["rows"]
    if SERIAL not in pred:
        return {}
    return {m: (pred[SERIAL] / pred[m]) / (rows[SERIAL][0] / rows[m][0]) - 1.0
            for m in pred if m != SERIAL and m in rows}


def target_prediction(points: Sequence[Dict[str, Any]]) -> Target:
    """Predicted speedups relative to serial within 10% of the measured ones at 90% of the (point, mode) pairs."""
    what = "predicted speedup vs serial within 10% of the measured one at >= 90% of points"
    errors = [(p, m, e) for p in points for m, e in prediction_errors(p).items()]
    if not errors:
        return what, None, "no prediction (no auto mode, so no calibration)"
    good = sum(abs(e) <= 0.10 for _, _, e in errors)
    worst = max(errors, key=lambda x: abs(x[2]))
    return what, good >= 0.9 * len(errors), (f"{good} of {len(errors)} within 10%; worst {worst[1]} at "
                                             f"{worst[0]['tokens']} @ {worst[0]['link']:g} GB/s: {worst[2]:+.0%}")


TARGETS: Tuple[Callable[[Sequence[Dict[str, Any]]], Target], ...] = (target_overlap_pays, target_auto,
                                                                      target_prediction, target_host)


def report(points: Sequence[Dict[str, Any]]) -> str:
    """A table per link, what the figures are, then a line per target."""
    lines = []
    for gbps in dict.fromkeys(p["link"] for p in points):
        lines += [f"\nlink {gbps:g} GB/s", table([p for p in points if p["link"] == gbps])]
        lines += [f"  auto at {p['tokens']} tokens/rank, {p['guard']}" for p in points
                  if p["link"] == gbps and p.get("vetoed")]
    lines.append("\ncomm/serial: communication's share of a serial decode step; ms: TPOT, the median "
                 "decode-step time (slowest rank); x: serial's TPOT over the mode's; spread: the largest of the "
                 "modes' interquartile range of step times over their median; rounds x steps: timed rounds per mode "
                 "x decode steps per round, the modes interleaved round by round; executor/TPOT: the executor's own "
                 "host time in a serial decode step (its run less its operations' time) over serial's TPOT"
                 + ("; auto as chosen x: serial's TPOT over auto's steps each costed at the TPOT of the fixed mode "
                    "it chose, plus its host time per step for choosing (mixed: more than one mode)"
                    if any(AUTO in p["rows"] for p in points) else ""))
    lines.append("\ntargets:")
    for target in TARGETS:
        what, met, detail = target(points)
        verdict = "not checked" if met is None else "met" if met else "MISSED"
        lines.append(f"  {what}: {verdict} ({detail})")
    return "\n".join(lines)


def _numbers(text: str, kind: Callable[[str], Any]) -> List[Any]:
    return [kind(x) for x in text.split(",") if x.strip()]


@click.command(context_settings={"show_default": True})
@click.option("--preset", "preset_name", default="small")
@click.option("--tokens", default="1,8,32,64,128,256", help="Active requests (tokens per decode step) per rank.")
@click.option("--links", default="0.03,0.1,1", help="Simulated link speeds in GB/s, comma-separated.")
@click.option("--prompt-len", type=int, default=8, help="Tokens of each request's prompt.")
@click.option("--new-tokens", type=int, default=8, help="New tokens per request (decode steps per round: one fewer).")
@click.option("--warmup", type=int, default=1)
@click.option("--iters", type=int, default=5, help="Rounds per point, at least.")
@click.option("--min-seconds", type=float, default=2.0,
              help="More rounds at a point until serial's decode steps add up to about this (0: --iters only).")
@click.option("--seed", type=int, default=0)
@click.option("--modes", default=",".join(decode_modes()),
              help="The decode modes to measure, comma-separated (serial is always first; auto calibrates first).")
@click.option("--cpu-comm-priority", "comm_priority", type=click.Choice(["off", "rt"]), default="off",
              envvar="OVERLAP_CPU_COMM_PRIORITY", show_envvar=True,
              help="gloo's communication threads real-time (overlap.comm_threads) or normal.")
@click.option("--decode-guard/--no-decode-guard", "guard", default=True,
              help="Auto sets aside a mode its own steps measured slower than serial (as the launcher's).")
@click.option("--calibrate-at", type=float, default=None,
              help="Calibrate auto once, at this link speed (GB/s), for every link's points: a calibration gone "
                   "stale on purpose, to see what auto (and its guard) make of it. Default: each link its own.")
@click.option("--calibration-rounds", type=int, default=CALIBRATION_ROUNDS,
              help="Rounds of every mode behind each entry of auto's calibration (the launcher's "
                   "--decode-calibration-rounds, default 4 there): more, steadier predictions.")
def main(preset_name: str, tokens: str, links: str, prompt_len: int, new_tokens: int, warmup: int, iters: int,
         min_seconds: float, seed: int, modes: str, comm_priority: str, guard: bool,
         calibrate_at: Optional[float], calibration_rounds: int) -> None:
    """Time per output token of every decode mode over tokens per rank and link speeds, on 2 CPU ranks."""
    from overlap.multirank import run_ranks

    if new_tokens < 2 or prompt_len < 1:
        raise click.BadParameter("a round needs --new-tokens >= 2 (one decode step) and --prompt-len >= 1")
    token_points, link_points = _numbers(tokens, int), _numbers(links, float)
    if not token_points or not link_points or min(token_points) < 1:
        raise click.BadParameter("--tokens and --links each need at least one value, tokens >= 1")
    mode_list = [SERIAL] + [m for m in dict.fromkeys(_numbers(modes, str)) if m != SERIAL]
    unknown = [m for m in mode_list if m not in decode_modes()]
    if unknown:
        raise click.BadParameter(f"unknown decode mode {unknown[0]!r} (these: {', '.join(decode_modes())})")
    if calibrate_at is not None and not calibrate_at > 0:
        raise click.BadParameter(f"--calibrate-at must be a link speed > 0 GB/s, got {calibrate_at:g}")
    if calibration_rounds < 1:
        raise click.BadParameter(f"--calibration-rounds must be at least 1, got {calibration_rounds}")
    if calibrate_at is not None and AUTO not in mode_list:
        raise click.BadParameter("--calibrate-at sets auto's calibration: add auto to --modes")
    click.echo(f"2 CPU ranks, preset {preset_name}, prompts of {prompt_len} tokens, {new_tokens} new tokens each, "
               f"{warmup} warmup + at least {iters} rounds (and about {min_seconds:g} s of serial decode steps) per "
               f"point; modes {', '.join(mode_list)} interleaved round by round")
    if calibrate_at is not None:
        click.echo(f"auto's calibration measured once, at {calibrate_at:g} GB/s, for every link (its predictions "
                   f"and the targets' checks of them are for that link)")
    points = run_ranks(_rank_body, 2, preset_name, mode_list, token_points, link_points, prompt_len, new_tokens,
                       warmup, iters, min_seconds, seed, comm_priority, guard, calibrate_at, calibration_rounds,
                       timeout=3600)[0]
    click.echo(report(points))


if __name__ == "__main__":
    main()
