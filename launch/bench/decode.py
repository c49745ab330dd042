"""Benchmark greedy decode: time per output token of every decode mode, over batch sizes and link speeds.

On 2 CPU ranks (gloo, started here) with the expert-parallel reference decoder and the simulated
link (`overlap.set_link`), each point is a number of active requests per rank (one new token each
per decode step, every request with a short prompt) at one link speed. At each point the decode
modes of `decode_modes` run interleaved round by round (`launch.measure.rounds.rounds`): every round
generates the same prompts once in each mode (`launch.engine.generate`, the prefill serial and not
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

Before a link's points it calibrates decode (`launch.engine.calibrate_decode`, as the launcher's
``--decode-mode auto`` does, with ``--calibration-rounds`` rounds: 16 by default, four times the launcher's), and
``auto`` runs as a mode, with its guard (`microbatch.planning.DecodeGuard`, one per point, kept over its rounds;
``--no-decode-guard``: none): the table shows what it chose and its speedup as measured by the fixed modes that ran
the same schedules, and each mode's predicted speedup with its error. The targets judge auto on its own row
(``auto x``, measured interleaved with the fixed modes); ``auto costed at its modes x`` beside it costs each of its
steps at the TPOT of the fixed mode it chose there, plus its own host time per step for choosing: what its choices
alone would give, less whatever auto's own steps add. ``--calibrate-at GBPS`` calibrates once, at that link, for
every link: a stale calibration on purpose,
to see what the guard makes of it. Each point runs at least ``--iters`` rounds, and more at small batches (until
serial's steps add up to about ``--min-seconds``), since their times spread widely on a shared host. The last lines
check the targets (issues 29 and 56): the best overlapped mode at least half of the ceiling's gain at 256 tokens
per rank where communication is at least 30% of serial's step and the ceiling is at least 1.15x (a lower ceiling is
named, not judged); auto's own TPOT within 5% of the best fixed mode and at most 2% above serial at every point;
predicted speedups within 10% of the measured ones at 90% of the points. A comparison whose two standard errors (from
the steps' spread) cover its margin makes its target ``inconclusive: noise``: more rounds (``--iters``,
``--min-seconds``) decide it. ``--modes serial,serial@blocking`` measures serial with each step waiting for its own
agreement between the ranks beside serial as it runs (the agreement travelling under the next step): ``serial@blocking
x`` is the TPOT ratio of the two. At ``--ceiling-at`` tokens per rank (default 256, the gain target's), the
overlapped modes also run with no link at all, interleaved round by round with serial at the point's link: serial's
TPOT over such a mode's is the most the mode could reach there however much of the link it hid (its split's own cost
is left), printed under the link's table and beside the gain target. Example::

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

from launch.bench import COMMAND_SETTINGS
from launch.bench.decode_targets import BLOCKED, SERIAL, TARGET_TOKENS, report
from microbatch import AUTO

MAX_ROUNDS = 200
# rounds behind each entry of auto's calibration: four times the launcher's default, about half its noise (the
# predictions target compares two measurements; the calibration's would otherwise carry most of the error)
CALIBRATION_ROUNDS = 16


def decode_modes() -> Tuple[str, ...]:
    """The decode modes every point measures, serial first (the reference of every speedup).

    A new mode is one more name here; one that needs more than its name passed to
    `launch.engine.generate` gets a maker in `MODE_ARGUMENTS`.
    """
    return (SERIAL, "shared", "two-batch", "chunked-2", "chunked-4", AUTO)


@dataclasses.dataclass(frozen=True)
class Point:
    """What a mode's arguments may depend on: the model, its expert group, the point's size and link."""

    model: Any
    group: Any
    tokens: int  # active requests per rank
    gbps: float
    calibration: Any = None  # the link's decode calibration (`launch.engine.calibrate_decode`), for auto
    guard: bool = True  # auto checks its choices with a `microbatch.planning.DecodeGuard` kept over the point


ModeArguments = Callable[[str, Point], Dict[str, Any]]  # (mode name, point) -> generate()'s keyword arguments

# Per name prefix (e.g. "chunked-" for "chunked-4"), a maker of generate()'s keyword arguments for a mode that needs
# more than ``mode=name`` (a chunk count, a calibration for "auto"); the first prefix that matches is used.
def _auto_arguments(name: str, point: Point) -> Dict[str, Any]:
    """Auto's: the point's calibration, and a guard of its own, kept over the point's rounds."""
    from microbatch.planning import DecodeGuard

    return {"mode": AUTO, "calibration": point.calibration, "guard": DecodeGuard() if point.guard else False}


MODE_ARGUMENTS: Dict[str, ModeArguments] = {AUTO: _auto_arguments}


def generate_arguments(name: str, point: Point) -> Dict[str, Any]:
    """`launch.engine.generate`'s keyword arguments that run decode mode ``name`` at ``point`` (the prefill serial);
    ``<mode>@blocking``: that mode with each step waiting for its own agreement between the ranks."""
    if name.endswith(BLOCKED):
        return {**generate_arguments(name[:-len(BLOCKED)], point), "agreement": "blocking"}
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
    from launch.engine import generate
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
    from collectives import MOE_ACTIVE, MOE_CAPACITY
    from launch.engine import bucket_of, split_by_cost
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
                   MOE_CAPACITY: bucket_of(tokens), MOE_ACTIVE: None}]
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
            choice = guard.choose(point.calibration, point.tokens, history)
            guard.record(choice.mode, choice.seconds, choice.seconds)
        else:
            choose_decode(point.calibration, point.tokens, history)
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
           iters: int, min_seconds: float, seed: int, ceiling_at: int = 0) -> Dict[str, Any]:
    """Every mode's decode-step times at one point, interleaved round by round; serial's comm share; at
    ``ceiling_at`` tokens per rank, the overlapped modes' with no link too (`_unlinked`)."""
    from launch.measure import spread
    from microbatch.planning import max_over_ranks, relative_error

    prompts = _prompts(point.tokens, prompt_len, model.cfg.vocab, seed + 1009 * ctx.rank + point.tokens)
    kwargs = {m: generate_arguments(m, point) for m in modes}
    chosen: List[str] = []  # auto's modes, every timed step

    def run(m: str, timed: bool) -> List[float]:
        got, _, out = _step_times(model, prompts, new_tokens, kwargs[m], ctx.group)
        chosen.extend(out.modes if timed and m == AUTO else ())
        return got

    steps, timed = _interleaved(list(modes), run, warmup, iters, min_seconds, ctx.group)
    unlinked = _unlinked(ctx, point, modes, prompts, new_tokens, kwargs, warmup, iters, min_seconds) \
        if point.tokens == ceiling_at else {}
    share = _comm_share(model, prompts, new_tokens, kwargs[SERIAL], ctx.group)
    host = _executor_host(model, point.tokens, prompt_len + new_tokens // 2, ctx.group)
    rows, noise = {}, {}
    for m in modes:  # the ranks step together: per step, the slowest rank's time
        slowest = max_over_ranks(steps[m], ctx.group) if steps[m] else []
        rows[m] = (statistics.median(slowest) if slowest else math.nan, spread(slowest))
        noise[m] = relative_error(slowest)
    history = prompt_len + (new_tokens - 1) / 2  # the middle step's rows held: its prediction is the median's
    predicted = {} if point.calibration is None else {m: point.calibration.predict(m, point.tokens, history)
                                                      for m in point.calibration.modes}
    guard = kwargs.get(AUTO, {}).get("guard")
    choosing = {} if AUTO not in modes else {"choosing_s": _choosing(point, history, ctx.group)}
    return {"tokens": point.tokens, "link": point.gbps, "comm_share": share, "rounds": timed, **choosing,
            "steps": len(steps[SERIAL]) // max(timed, 1), "rows": rows, "noise": noise, "predicted": predicted,
            "executor_s": host,
            "chosen": dict(collections.Counter(chosen)), "guard": guard.summary() if guard else None,
            "vetoed": dict(guard.vetoed) if guard else {}, **unlinked}


def _unlinked(ctx: Any, point: Point, modes: Sequence[str], prompts: List[List[int]], new_tokens: int,
              kwargs: Dict[str, Any], warmup: int, iters: int, min_seconds: float) -> Dict[str, Any]:
    """The overlapped fixed modes with no link at all, interleaved round by round with serial at the point's link:
    ``unlinked`` (per mode, the median TPOT of the slowest rank, serial's at the link) for the point's ``ceiling``
    (`launch.bench.decode_targets.ceilings`). A mode's steps cannot be faster over a link than with none, so serial's
    TPOT over such a mode's is the most it could reach here, however much of the link it hid."""
    import overlap
    from microbatch.planning import max_over_ranks
    from overlap.link import OFF

    linked = overlap.current_link() or OFF
    names = [SERIAL] + [m for m in modes if m not in (SERIAL, AUTO)]

    def run(m: str, timed: bool) -> List[float]:
        overlap.set_link(linked if m == SERIAL else OFF)
        return _step_times(point.model, prompts, new_tokens, kwargs[m], ctx.group)[0]

    try:
        steps, _ = _interleaved(names, run, warmup, iters, min_seconds, ctx.group)
    finally:
        overlap.set_link(linked)
    return {"unlinked": {m: statistics.median(max_over_ranks(steps[m], ctx.group)) for m in names}}


def _interleaved(names: List[str], run: Callable[[str, bool], List[float]], warmup: int, iters: int,
                 min_seconds: float, group: Any) -> Tuple[Dict[str, List[float]], int]:
    """Each of ``names`` once a round, in `launch.measure.rounds.rounds`' order, until `_enough` rounds are timed
    (serial first among ``names``): ``run(name, timed)`` generates once and returns its step seconds. Per name the timed
    rounds' steps, and how many rounds were timed."""
    from launch.measure import rounds

    steps: Dict[str, List[float]] = {m: [] for m in names}
    timed = 0
    for i, order in enumerate(rounds(names, warmup, MAX_ROUNDS)):
        for m in order:
            got = run(m, i >= warmup)
            if i >= warmup:
                steps[m].extend(got)
        timed += i >= warmup
        if i >= warmup and _enough(steps[SERIAL], timed, iters, min_seconds, group):
            break
    return steps, timed


def _rank_body(ctx: Any, preset_name: str, modes: List[str], tokens: List[int], links: List[float], prompt_len: int,
               new_tokens: int, warmup: int, iters: int, min_seconds: float, seed: int, comm_priority: str,
               guard: bool = True, calibrate_at: Optional[float] = None, calibration_rounds: int = CALIBRATION_ROUNDS,
               ceiling_at: int = 0) -> Any:
    import overlap
    from launch.models import build_model, preset
    from launch.engine import make_expert_parallel

    overlap.keep_freed_memory()  # as the launchers on the CPU path (overlap.host_memory)
    overlap.set_comm_priority(comm_priority)
    model = make_expert_parallel(build_model(preset(preset_name), seed=seed), ctx.group)
    out = []
    fixed = None  # --calibrate-at: one calibration, at that link, for every link's points
    if AUTO in modes and calibrate_at is not None:
        overlap.set_link(overlap.Link(calibrate_at))
        fixed = _calibrate(ctx, model, max(tokens), prompt_len, new_tokens, calibrate_at, calibration_rounds)
    for gbps in links:
        overlap.set_link(overlap.Link(gbps))
        calibration = fixed or (_calibrate(ctx, model, max(tokens), prompt_len, new_tokens, gbps, calibration_rounds)
                                if AUTO in modes else None)
        for n in tokens:
            out.append(_point(ctx, model, Point(model, ctx.group, n, gbps, calibration, guard), modes, prompt_len,
                              new_tokens, warmup, iters, min_seconds, seed, ceiling_at))
    return out if ctx.rank == 0 else None


def _calibrate(ctx: Any, model: Any, max_tokens: int, prompt_len: int, new_tokens: int, gbps: float,
               rounds: int) -> Any:
    """The link's decode calibration, as the launcher's ``--decode-mode auto`` makes it (progress on rank 0)."""
    from launch.engine import calibrate_decode, calibration_histories

    start = time.perf_counter()
    calibration = calibrate_decode(model, max_tokens=max_tokens,
                                   histories=calibration_histories([prompt_len], new_tokens), repeats=rounds,
                                   refresh=True)  # measured in this run, as the modes it is judged against
    if ctx.rank == 0:
        noise = sorted(x for rows in (calibration.noise or {}).values() for r in rows for x in r) or [0.0]
        print(f"calibrated decode at {gbps:g} GB/s in {time.perf_counter() - start:.1f} s "
              f"({rounds} round{'s' if rounds != 1 else ''}; entries' noise {noise[0]:.1%} to {noise[-1]:.1%}, "
              f"median {statistics.median(noise):.1%})", flush=True)
    return calibration


def _numbers(text: str, kind: Callable[[str], Any]) -> List[Any]:
    return [kind(x) for x in text.split(",") if x.strip()]


@click.command(context_settings=COMMAND_SETTINGS)
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
              help="The decode modes to measure, comma-separated (serial is always first; auto calibrates first); "
                   "<mode>@blocking: that fixed mode with each step waiting for its own agreement between the ranks, "
                   "to measure the agreement's cost beside it.")
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
@click.option("--ceiling-at", type=int, default=TARGET_TOKENS,
              help="At this many tokens per rank, also time the overlapped modes with no link at all, interleaved "
                   "with serial at the point's link: the most any overlap could reach there on this host (0: not).")
def main(preset_name: str, tokens: str, links: str, prompt_len: int, new_tokens: int, warmup: int, iters: int,
         min_seconds: float, seed: int, modes: str, comm_priority: str, guard: bool,
         calibrate_at: Optional[float], calibration_rounds: int, ceiling_at: int) -> None:
    """Time per output token of every decode mode over tokens per rank and link speeds, on 2 CPU ranks."""
    from launch.bench import CPU_RANKS
    from overlap.multirank import run_ranks

    if new_tokens < 2 or prompt_len < 1:
        raise click.BadParameter("a round needs --new-tokens >= 2 (one decode step) and --prompt-len >= 1")
    token_points, link_points = _numbers(tokens, int), _numbers(links, float)
    if not token_points or not link_points or min(token_points) < 1:
        raise click.BadParameter("--tokens and --links each need at least one value, tokens >= 1")
    mode_list = [SERIAL] + [m for m in dict.fromkeys(_numbers(modes, str)) if m != SERIAL]
    unknown = [m for m in mode_list if m not in decode_modes() and m.removesuffix(BLOCKED) not in decode_modes()]
    if unknown:
        raise click.BadParameter(f"unknown decode mode {unknown[0]!r} (these: {', '.join(decode_modes())}, each "
                                 f"but auto also as <mode>{BLOCKED})")
    if AUTO + BLOCKED in mode_list:
        raise click.BadParameter(f"{AUTO}{BLOCKED}: auto's guard times its steps in the agreement; a fixed mode "
                                 f"only takes {BLOCKED}")
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
                       ceiling_at, timeout=3600, env=CPU_RANKS)[0]
    click.echo(report(points))


if __name__ == "__main__":
    main()
