"""Benchmark the prefill schedules on 2 CPU ranks: serial, shared-expert overlap and two-batch.

Spawns the ranks itself (gloo), runs the three modes interleaved in one run and prints, from the
same run (`launch.measure.prefill.table`): each mode's median time per prefill and the rounds' spread,
speedup over serial, the hidden share of communication, the share of communication in serial time
and the ideal speedup (compute + comm) / max(compute, comm); then, in words, every difference
within the rounds' spread and every speedup more than the ideal or than the hidden communication
explains; then, per mode, how long the host spent in the exchanges' launches (on CPU the count
exchange's host read is one) and how much of that held back another micro-batch's work
(`host_blocking`). Medians of 5 rounds by default: fewer leave the spread unknown or the medians unsteady.
The default preset with the default simulated link puts communication at roughly 25-50% of
serial time, the share reported for prefill on NPU clusters. ``--model NAME`` runs a transformers
MoE family instead of the reference decoder, built from its config at the shapes of the preset
(layers, hidden size, experts, top-k) with random weights. Example::

    python -m launch.bench.pipeline --iters 5
    python -m launch.bench.pipeline --cpu-link off      # plain loopback gloo
    python -m launch.bench.pipeline --model qwen3_moe   # a transformers family (needs transformers)
    python -m launch.bench.pipeline --dispatch one-step # the count exchange read where it is issued
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
               seed: int, model_name: str = "reference", two_step: bool = True) -> Optional[str]:
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
    if ctx.rank != 0:
        return None
    return (table(results, batch.seq.num_tokens * ctx.world_size) + "\n" + verdict({r.mode: r for r in results})
            + "\n" + host_blocking_table(results))


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
    """Whether two-batch is not slower than serial: yes, NO, or too close to tell within the rounds' spread."""
    two, serial = by["two-batch"], by["serial"]
    answer = "yes" if two.median_s <= serial.median_s else "NO"
    noise = max(two.spread or 0.0, serial.spread or 0.0)
    if len(two.times_s) < 2:
        answer += " (one round: not a result)"
    elif abs(two.median_s / serial.median_s - 1.0) <= noise:
        answer += " (within the rounds' spread: not a result)"
    return f"two-batch not slower than serial: {answer}"


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
def main(ranks: int, preset_name: str, batch: int, seq_len: int, warmup: int, iters: int, cpu_link: str,
         seed: int, model_name: str, dispatch_steps: str) -> None:
    """Serial vs shared-expert overlap vs two-batch prefill, side by side in one run."""
    from launch.bench import CPU_RANKS
    from overlap.multirank import run_ranks

    link = None if cpu_link.lower() in ("off", "none", "0") else cpu_link
    what = f"preset {preset_name}" if model_name == "reference" else f"{model_name} at the shapes of preset {preset_name}"
    click.echo(f"{ranks} CPU ranks, {what}, {batch} x {seq_len} tokens per rank, simulated link {link or 'off'}, "
               f"{dispatch_steps} dispatch")
    out = run_ranks(_rank_body, ranks, preset_name, [seq_len] * batch, warmup, iters, link, seed, model_name,
                    dispatch_steps == "two-step", timeout=1800, env=CPU_RANKS)
    click.echo(out[0])


if __name__ == "__main__":
    main()
