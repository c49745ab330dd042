"""Benchmark the CPU path's real-time communication threads (`overlap.comm_threads`) against normal ones.

On 2 CPU ranks, interleaved round by round in one run (each round runs both settings, the order
alternating), it measures:

- a small all-to-all right after some compute on both ranks: its time after the later rank
  entered it (both ranks' clocks are the host's), as median, 90th and 99th percentile, and the
  share over 2 ms; this is the wake-up of gloo's threads while the other rank's compute holds a core;
- the prefill of the reference model in each mode asked for (``--modes``, default serial and
  two-batch) on the simulated link: median, middle half, and the ratio of the medians.

Example::

    python -m launch.bench_comm_threads
    python -m launch.bench_comm_threads --tokens 1024 --rounds 10
"""
from __future__ import annotations

import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from typing import Any, Dict, List, Tuple

import click

SETTINGS = ("rt", "off")


def _busy(seconds: float, x: Any) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x @ x


def _exchange_times(ctx: Any, compute_s: float, count: int) -> List[Tuple[float, float]]:
    """(entered, left) of ``count`` small all-to-alls, each after ``compute_s`` of compute."""
    import torch

    import overlap

    x = torch.randn(128, 128)
    src = torch.ones(4 * ctx.world_size)
    dst = torch.empty_like(src)
    out = []
    for _ in range(count):
        _busy(compute_s, x)
        t0 = time.perf_counter()
        overlap.all_to_all_single(dst, src, group=ctx.group, name="probe")
        out.append((t0, time.perf_counter()))
    return out


def _rank_body(ctx: Any, preset_name: str, tokens: int, seq_len: int, link: float, modes: List[str], rounds: int,
               compute_ms: float, exchanges: int, seed: int) -> Dict[str, Any]:
    import torch.distributed as dist

    import overlap
    from launch.model import Batch, build_model, preset
    from launch.runner import make_expert_parallel, plan_for, prefill

    overlap.set_link(overlap.Link(link))
    model = make_expert_parallel(build_model(preset(preset_name), seed=seed), ctx.group)
    full, rest = divmod(tokens, seq_len)
    batch = Batch.random([seq_len] * full + ([rest] if rest else []), model.cfg.vocab, seed=seed + ctx.rank)
    plans = {m: plan_for(m, batch, ctx.group, model=model) for m in modes}
    probe: Dict[str, List[Tuple[float, float]]] = {s: [] for s in SETTINGS}
    times: Dict[Tuple[str, str], List[float]] = {(s, m): [] for s in SETTINGS for m in modes}
    said = {}
    for r in range(rounds + 1):  # round 0 warms up
        for setting in (SETTINGS if r % 2 else SETTINGS[::-1]):
            overlap.set_comm_priority(setting)
            said[setting] = overlap.describe_comm_priority()
            dist.barrier(group=ctx.group)
            pairs = _exchange_times(ctx, compute_ms * 1e-3, exchanges)
            for mode in modes:
                dist.barrier(group=ctx.group)
                t0 = time.perf_counter()
                prefill(model, batch, mode, plans[mode], None)
                overlap.synchronize()
                if r:
                    times[(setting, mode)].append(time.perf_counter() - t0)
            if r:
                probe[setting] += pairs
    overlap.set_comm_priority(None)
    return {"probe": probe, "times": times, "said": said}


def _exchange_row(setting: str, per_rank: List[List[Tuple[float, float]]]) -> str:
    after = sorted(max(p[1] for p in pair) - max(p[0] for p in pair) for pair in zip(*per_rank))
    n = len(after)
    q = statistics.quantiles(after, n=100) if n > 1 else after * 99
    return (f"  {setting:4s} median {statistics.median(after) * 1e3:6.2f} ms   p90 {q[89] * 1e3:6.2f} ms   "
            f"p99 {q[98] * 1e3:6.2f} ms   over 2 ms: {sum(a > 2e-3 for a in after) / n:4.0%} of {n}")


def report(results: List[Dict[str, Any]], modes: List[str]) -> str:
    """The side-by-side table of one run (ranks' results as `_rank_body` returns them)."""
    lines = [f"communication threads: rt = {results[0]['said']['rt']}; off = {results[0]['said']['off']}",
             "small all-to-all after compute, time after the later rank entered it:"]
    for s in SETTINGS:
        lines.append(_exchange_row(s, [r["probe"][s] for r in results]))
    lines.append("prefill (the slower rank's time per round):")
    for mode in modes:
        med = {}
        for s in SETTINGS:
            slowest = [max(ts) for ts in zip(*(r["times"][(s, mode)] for r in results))]
            med[s] = statistics.median(slowest)
            q = statistics.quantiles(slowest, n=4) if len(slowest) > 1 else slowest * 3
            lines.append(f"  {mode:12s} {s:4s} median {med[s] * 1e3:8.1f} ms   middle half "
                         f"{q[0] * 1e3:.1f}-{q[2] * 1e3:.1f} ms")
        lines.append(f"  {mode:12s} off / rt: {med['off'] / med['rt']:.2f}x")
    return "\n".join(lines)


@click.command(context_settings={"show_default": True})
@click.option("--preset", "preset_name", default="small")
@click.option("--tokens", type=int, default=64, help="Tokens per rank.")
@click.option("--seq-len", type=int, default=128, help="Tokens per request.")
@click.option("--link", type=float, default=0.5, help="Simulated link in GB/s.")
@click.option("--modes", default="serial,two-batch", help="Prefill modes, comma-separated.")
@click.option("--rounds", type=int, default=20, help="Rounds; each runs both settings.")
@click.option("--compute-ms", type=float, default=2.0, help="Compute before each probe exchange.")
@click.option("--exchanges", type=int, default=20, help="Probe exchanges per round and setting.")
@click.option("--seed", type=int, default=0)
def main(preset_name: str, tokens: int, seq_len: int, link: float, modes: str, rounds: int, compute_ms: float,
         exchanges: int, seed: int) -> None:
    """Real-time against normal communication threads, side by side in one run."""
    from overlap.multirank import run_ranks

    import microbatch

    mode_list = [m for m in modes.split(",") if m]
    unknown = [m for m in mode_list if m not in microbatch.MODES]
    if unknown or not mode_list:
        raise click.BadParameter(f"{', '.join(unknown) or 'none given'}: expected modes among "
                                 f"{', '.join(microbatch.MODES)}", param_hint="--modes")
    if rounds < 1 or exchanges < 2:
        raise click.BadParameter("--rounds must be >= 1 and --exchanges >= 2")
    click.echo(f"2 CPU ranks, preset {preset_name}, {tokens} tokens per rank, simulated link {link:g} GB/s, "
               f"{rounds} rounds interleaved")
    results = run_ranks(_rank_body, 2, preset_name, tokens, seq_len, link, mode_list, rounds, compute_ms, exchanges,
                        seed, timeout=1800)
    click.echo(report(results, mode_list))


if __name__ == "__main__":
    main()
