"""Benchmark the prefill schedules on 2 CPU ranks: serial, shared-expert overlap and two-batch.

Spawns the ranks itself (gloo), runs the three modes interleaved in one run and prints, from the
same run (`launch.measure.prefill.table`): each mode's median time per prefill and the rounds' spread,
speedup over serial, the hidden share of communication, the share of communication in serial time
and the ideal speedup (compute + comm) / max(compute, comm); then, in words, every difference
within the rounds' spread and every speedup more than the ideal or than the hidden communication
explains; then each overlapped mode's ceiling: the same modes run again with no link at all, interleaved round by
round with serial at the link (``--ceiling``, on by default with a link): serial's time over such a mode's is the
most it could reach here however much of the link it hid, and it splits the gap between the mode and the ideal
(which assumes a split batch computes as fast as a whole one) into the mode's own cost with no link (the split, its
launches and exchanges) and the link's time it did not hide (`gap`); then whether two-batch is not slower than
serial (`verdict`: met, missed, or inconclusive where the rounds' spread covers the difference); then, per mode, how
long the host spent in the exchanges' launches (on CPU the count exchange's host read is one) and how much of that
held back another micro-batch's work (`host_blocking`). Medians of 5 rounds by default: fewer leave the spread
unknown or the medians unsteady.
The default preset with the default simulated link puts communication at roughly 25-50% of
serial time, the share reported for prefill on NPU clusters. ``--model NAME`` runs a transformers
MoE family instead of the reference decoder, built from its config at the shapes of the preset
(layers, hidden size, experts, top-k) with random weights. Example::

    python -m launch.bench.pipeline --iters 5
    python -m launch.bench.pipeline --cpu-link off      # plain loopback gloo
    python -m launch.bench.pipeline --model qwen3_moe   # a transformers family (needs transformers)
    python -m launch.bench.pipeline --dispatch one-step # the count exchange read where it is issued
    python -m launch.bench.pipeline --no-ceiling        # half the time: no run without the link
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from typing import Any, Dict, List, Optional, Tuple

import click

from launch.bench import COMMAND_SETTINGS


def _build(preset_name: str, model_name: str, seed: int) -> Any:
    from launch.models import build_model, preset

    cfg = preset(preset_name)
    if model_name == "reference":
        return build_model(cfg, seed=seed)
    from launch.models import build_transformers_model

    shapes = dict(n_layers=cfg.n_layers, hidden=cfg.hidden, n_experts=cfg.n_experts, top_k=cfg.top_k)
    return build_transformers_model(model_name, seed=seed, overrides=shapes)


def _rank_body(ctx: Any, preset_name: str, seq_lens: List[int], warmup: int, iters: int, link: Optional[str],
               seed: int, model_name: str = "reference", two_step: bool = True, ceiling: bool = True) -> Optional[str]:
    import microbatch
    import overlap
    from launch.engine import make_expert_parallel
    from launch.measure.prefill import measure_modes, table
    from microbatch.batch import Batch

    overlap.keep_freed_memory()  # as the launchers on the CPU path (overlap.host_memory)
    overlap.set_link(overlap.parse_link(link) if link else None)
    model = make_expert_parallel(_build(preset_name, model_name, seed), ctx.group, two_step_dispatch=two_step)
    batch = Batch.random(seq_lens, model.cfg.vocab, seed=seed + ctx.rank + 1)
    modes = [name for name, m in microbatch.MODES.items() if m.in_all]
    results = measure_modes(model, batch, modes, ctx.group, warmup=warmup, iters=iters)
    unlinked = _unlinked(model, batch, modes, ctx.group, warmup, iters) if ceiling and link else None
    if ctx.rank != 0:
        return None
    lines = [table(results, batch.seq.num_tokens * ctx.world_size)]
    if unlinked is not None:
        lines += ceiling_lines(results, unlinked)
    return "\n".join(lines + [verdict({r.mode: r for r in results}), host_blocking_table(results)])


def _unlinked(model: Any, batch: Any, modes: List[str], group: Any, warmup: int, iters: int) -> List[Any]:
    """The modes again, serial at the link and the others with no link at all, interleaved round by round (not
    recorded): each overlapped mode's speedup there is its ceiling (`ceiling_lines`)."""
    import overlap
    from launch.measure.prefill import measure_modes
    from overlap.link import OFF

    linked = overlap.current_link()

    def link_for(mode: str, i: int) -> None:
        overlap.set_link(linked if mode == "serial" else OFF)

    try:
        return measure_modes(model, batch, modes, group, warmup=warmup, iters=iters, before_iter=link_for,
                             recorded=0)
    finally:
        overlap.set_link(linked)


def ceiling_lines(results: List[Any], unlinked: List[Any]) -> List[str]:
    """Each overlapped mode's ceiling (serial's time at the link over the mode's with no link at all, measured side
    by side: ``unlinked``, `_unlinked`), and the gap between its speedup and the ideal, split (`gap`)."""
    from launch.measure.prefill import noise

    by = {r.mode: r for r in unlinked}
    serial = by["serial"]
    rows = [r for r in unlinked if r is not serial and r.speedup is not None]
    if not rows:
        return []
    lines = ["ceiling: each mode with no link at all, interleaved round by round with serial at the link (the most it "
             "could reach here however much of the link it hid): "
             + ", ".join(f"{r.mode} {r.speedup:.2f}x (spread {_pct(noise(r, serial))})" for r in rows)]
    measured = {r.mode: r for r in results}
    main_serial = measured.get("serial")
    for r in rows:
        m = measured.get(r.mode)
        if m is None or m.speedup is None or m.ideal_speedup is None or main_serial is None:
            continue
        lines.append(gap(r.mode, m.speedup, noise(m, main_serial), r.speedup, noise(r, serial), m.ideal_speedup))
    return lines


def gap(mode: str, measured: float, measured_noise: Optional[float], ceiling: float, ceiling_noise: Optional[float],
        ideal: float) -> str:
    """The gap between a mode's speedup (``measured``) and the ideal, in words: the part below its ``ceiling`` (the
    link's time it did not hide: overlap that did not happen) and the part above it (the mode's own cost with no link
    at all: the split, its launches and exchanges, which the ideal leaves out). Each part is a figure only beyond the
    noise (the spreads, relative, of the speedup and the ceiling; None: one round)."""
    from launch.measure import cost
    from launch.measure.verdicts import NONE_MEASURED

    def points(*parts: Tuple[float, Optional[float]]) -> Optional[float]:  # the noise in speedup points
        return None if any(n is None for _, n in parts) else max(x * (n or 0.0) for x, n in parts)

    def x(v: float) -> str:
        return f"{v:.2f}x"

    own = cost(ideal - ceiling, points((ceiling, ceiling_noise)), x)
    not_hidden = cost(ceiling - measured, points((ceiling, ceiling_noise), (measured, measured_noise)), x)
    whole = ideal - measured
    if own.endswith("x") and not_hidden.endswith("x") and whole > 0:
        own += f" ({(ideal - ceiling) / whole:.0%})"
        not_hidden += f" ({(ceiling - measured) / whole:.0%})"
    what = "its launches and exchanges" if mode == "shared" else "the split, its launches and exchanges"
    if not_hidden == NONE_MEASURED:  # faster at the link than with none, beyond the noise: the rounds drifted
        not_hidden = (f"none: it measured above its ceiling by more than the noise (the host drifted between the "
                      f"runs; more --iters)")
    return (f"{mode}: {measured:.2f}x against the ideal {ideal:.2f}x and its ceiling {ceiling:.2f}x; of the gap, its "
            f"own cost with no link at all ({what}, which the ideal leaves out) {own}, overlap that did not happen "
            f"(the link's time it did not hide) {not_hidden}")


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.0%}"


def host_blocking(spans: List[Any]) -> Dict[int, Tuple[float, float]]:
    """Per rank: the host's seconds inside the exchanges' launches (the executor's ``issue`` spans: the
    count exchange's host read included), and how much of it held back another micro-batch's work (the
    host's next launch, within 0.2 ms of the exchange's end, was another micro-batch's)."""
    by_rank: Dict[int, List[Any]] = {}
    for sp in spans:
        if sp.kind in ("compute", "issue") and "mb" in sp.meta and sp.end is not None:
            by_rank.setdefault(sp.rank, []).append(sp)
    out = {}
    for rank, launches in by_rank.items():
        launches.sort(key=lambda sp: sp.start)
        blocked = held = 0.0
        for i, sp in enumerate(launches):
            if sp.kind != "issue":
                continue
            blocked += sp.end - sp.start
            nxt = next((n for n in launches[i + 1:] if n.start >= sp.end - 1e-9), None)  # not one inside it
            if nxt is not None and nxt.meta.get("mb") != sp.meta.get("mb") and nxt.start - sp.end < 2e-4:
                held += sp.end - sp.start
        out[rank] = (blocked, held)
    return out


def host_blocking_table(results: List[Any]) -> str:
    """`host_blocking` of each mode's median round, the slowest rank's, in milliseconds per prefill."""
    lines = ["host in exchange launches per prefill (slowest rank), and what held back another micro-batch:"]
    for r in results:
        per_rank = host_blocking(r.spans)
        if not per_rank:
            lines.append(f"  {r.mode:12} (no timeline)")
            continue
        blocked, held = max(per_rank.values())
        lines.append(f"  {r.mode:12} {blocked * 1e3:8.2f} ms in exchanges, {held * 1e3:8.2f} ms of it holding back "
                     f"another micro-batch")
    return "\n".join(lines)


def verdict(by: Dict[str, Any]) -> str:
    """Whether two-batch is not slower than serial: met, missed, or inconclusive where the rounds' spread covers the
    difference (`launch.measure.verdict`), with the figures."""
    from launch.measure import verdict as judged
    from launch.measure.prefill import noise

    two, serial = by["two-batch"], by["serial"]
    spread = noise(two, serial)
    said = judged(two.median_s / serial.median_s - 1.0, 0.0, spread)
    why = "one round" if spread is None else f"spread {spread:.0%}"
    return f"target: two-batch not slower than serial: {said} ({serial.median_s / two.median_s:.2f}x serial, {why})"


@click.command(context_settings=COMMAND_SETTINGS)
@click.option("--ranks", type=int, default=2)
@click.option("--preset", "preset_name", default="small")
@click.option("--batch", type=int, default=8)
@click.option("--seq-len", type=int, default=128)
@click.option("--warmup", type=int, default=1)
@click.option("--iters", type=int, default=5, help="Timed rounds per mode (medians and spread over them).")
@click.option("--cpu-link", default="0.1", help="Simulated link 'GBPS[,LATENCY_US]', or 'off'.")
@click.option("--seed", type=int, default=0)
@click.option("--model", "model_name", default="reference",
              help="'reference', or a transformers MoE model type (qwen3_moe, deepseek_v3, mixtral, qwen2_moe, "
                   "glm4_moe, ...) built at the preset's shapes.")
@click.option("--dispatch", "dispatch_steps", type=click.Choice(["two-step", "one-step"]), default="two-step",
              help="The MoE layers' dispatch: the count exchange and the tokens as two operations, so the schedules "
                   "issue other work between them, or one operation (the count exchange read at once).")
@click.option("--ceiling/--no-ceiling", default=True,
              help="Also run the overlapped modes with no link at all, interleaved with serial at the link: the most "
                   "each could reach however much of the link it hid (twice the run's time; none with --cpu-link off).")
def main(ranks: int, preset_name: str, batch: int, seq_len: int, warmup: int, iters: int, cpu_link: str,
         seed: int, model_name: str, dispatch_steps: str, ceiling: bool) -> None:
    """Serial vs shared-expert overlap vs two-batch prefill, side by side in one run."""
    from launch.bench import CPU_RANKS
    from overlap.multirank import run_ranks

    link = None if cpu_link.lower() in ("off", "none", "0") else cpu_link
    what = f"preset {preset_name}" if model_name == "reference" else f"{model_name} at the shapes of preset {preset_name}"
    click.echo(f"{ranks} CPU ranks, {what}, {batch} x {seq_len} tokens per rank, simulated link {link or 'off'}, "
               f"{dispatch_steps} dispatch")
    out = run_ranks(_rank_body, ranks, preset_name, [seq_len] * batch, warmup, iters, link, seed, model_name,
                    dispatch_steps == "two-step", ceiling, timeout=1800, env=CPU_RANKS)
    click.echo(out[0])


if __name__ == "__main__":
    main()
