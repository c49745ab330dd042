"""Benchmark the quantized dispatch (``--dispatch-dtype``): bytes per token and step time against bf16, 2 CPU ranks.

One run measures, side by side on the same two gloo ranks and a simulated link (`overlap.set_link`, default
``--link``), a bf16 MoE layer (shared experts included) whose dispatch sends bf16, int8 or fp8 tokens:

1. bytes per token of the dispatch, counted from the tensors the exchange sends (values plus each token's 4-byte
   scale where quantized), against bf16: target at most 0.55x;
2. a prefill step (the layer over ``--tokens`` tokens per rank: the all-to-all, its count exchange) and a decode
   step (``--decode-tokens`` per rank through the layer's decode stages: the capacity exchange, nothing read on the
   host), in serial, each dispatch dtype interleaved with the others round by round, the median of the slowest
   rank's times: target the quantized step at most 0.85x the bf16 one, where the exchange is at least 40% of
   serial's step. That share is measured in the same run: serial bf16 without the link, interleaved with the rest
   (the link's cost is the share of serial's step it adds).

The combine stays in bf16, so the exchange's bytes fall by a quarter, not a half: the step gains most where the
link dominates. Example::

    python -m launch.bench.quantized --tokens 512 --decode-tokens 128 --link 0.005
"""
from __future__ import annotations

import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a file: the repository's collectives package, not this file, is `collectives`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from typing import Any, Callable, Dict, List
from unittest import mock

import click
import torch
import torch.distributed as dist

import microbatch
import overlap
from collectives import MOE_ACTIVE, MOE_CAPACITY, MOE_IN, MOE_OUT, MoE, MoEConfig, wrap_expert_parallel
from collectives.weight_quant import quantize
from launch.bench import COMMAND_SETTINGS, CPU_RANKS
from overlap.link import OFF, parse_link
from overlap.multirank import run_ranks

DISPATCHES = ("bf16", "int8", "fp8")
BYTES_TARGET = 0.55  # quantized bytes per token over bf16's, scales included
STEP_TARGET = 0.85  # quantized step over bf16's
SHARE_FLOOR = 0.40  # where the exchange is at least this share of serial's step
UNLINKED = "bf16 without link"


def _sent_bytes_per_token(step: Callable[[], Any]) -> float:
    """Bytes per row of the dispatch exchange in one ``step`` (its send tensors, all rows of every call)."""
    sent: List[torch.Tensor] = []
    real = overlap.all_to_all_single

    def recording(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("name") == "dispatch" and inp.shape[0]:
            sent.append(inp)
        return real(out, inp, *args, **kwargs)

    with mock.patch.object(overlap, "all_to_all_single", recording):
        step()
    rows = sum(t.shape[0] for t in sent)
    return sum(t.numel() * t.element_size() for t in sent) / max(1, rows)


def _timed(fn: Callable[[], Any], group: Any) -> float:
    """The slowest rank's seconds for one run between barriers."""
    dist.barrier(group)
    t0 = time.perf_counter()
    fn()
    dist.barrier(group)
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
    return float(took)


def _unlinked(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run with no simulated link (the link given back after)."""
    def run() -> Any:
        link = overlap.current_link()
        overlap.set_link(OFF)
        try:
            return fn()
        finally:
            overlap.set_link(link)
    return run


def _medians(fns: Dict[str, Callable[[], Any]], repeats: int, group: Any) -> Dict[str, float]:
    """The median seconds of each function over interleaved rounds after one warmup each, the order rotating."""
    for fn in fns.values():
        _timed(fn, group)
    names, runs = list(fns), {k: [] for k in fns}
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            runs[name].append(_timed(fns[name], group))
    return {k: statistics.median(v) for k, v in runs.items()}


def _steps(moe: MoE, group: Any, opts: Dict[str, Any], rank: int) -> Dict[str, Dict[str, Callable[[], Any]]]:
    """Per dispatch dtype, its prefill and decode step functions over the same layer weights."""
    torch.manual_seed(10 + rank)
    x = torch.randn(opts["tokens"], opts["hidden"]).to(torch.bfloat16)
    xd = torch.randn(opts["decode_tokens"], opts["hidden"]).to(torch.bfloat16)
    steps = {}
    for name in DISPATCHES:
        ep = wrap_expert_parallel(moe, group, dispatch_dtype=None if name == "bf16" else name)
        ops = ep.decode_stages()
        schedule = microbatch.schedule_for("serial", [ops], 1)
        inputs = [{MOE_IN: xd, MOE_CAPACITY: xd.shape[0], MOE_ACTIVE: None}]

        def decode(ops: Any = ops, schedule: Any = schedule, inputs: Any = inputs) -> Any:
            with overlap.no_host_sync():
                return microbatch.run(schedule, [ops], inputs, output=MOE_OUT)

        steps[name] = {"prefill": lambda ep=ep: ep(x), "decode": decode}
    return steps


def _expert_bytes(experts: Any) -> Dict[str, int]:
    """A rank's routed experts' bytes held in bf16, and kept quantized by each checkpoint format's rule (the weights
    and their scales: `collectives.weight_quant`)."""
    weights = [experts.gate_up.detach(), experts.down.detach()]
    held = {"bf16": sum(w.numel() * w.element_size() for w in weights)}
    for name, scheme in (("fp8", "fp8_block"), ("int8", "int8_channel")):
        held[name] = sum(t.numel() * t.element_size() for w in weights for t in quantize(w, scheme).values())
    return held


def _body(ctx: Any, opts: Dict[str, Any]) -> Dict[str, Any]:
    overlap.set_link(parse_link(opts["link"], "--link"))
    torch.set_num_threads(1)
    cfg = MoEConfig(hidden=opts["hidden"], ffn=opts["ffn"], n_experts=opts["experts"], top_k=opts["top_k"],
                    n_shared=1)
    torch.manual_seed(1234)  # the same weights on every rank
    moe = MoE(cfg).requires_grad_(False).to(torch.bfloat16)
    steps = _steps(moe, ctx.group, opts, ctx.rank)
    with torch.no_grad():
        for s in steps.values():  # the layers' first calls agree on the shapes
            s["prefill"](), s["decode"]()
        nbytes = {name: _sent_bytes_per_token(s["prefill"]) for name, s in steps.items()}
        times = {}
        for phase in ("prefill", "decode"):
            fns = {name: s[phase] for name, s in steps.items()}
            fns[UNLINKED] = _unlinked(steps["bf16"][phase])
            times[phase] = _medians(fns, opts["repeats"], ctx.group)
    return {"bytes": nbytes, "times": times, "experts": _expert_bytes(wrap_expert_parallel(moe, ctx.group).experts)}


def _verdict(ratio: float, target: float, share: float) -> str:
    if share < SHARE_FLOOR:
        return f"exchange {share:.0%} < {SHARE_FLOOR:.0%}: no target"
    return "met" if ratio <= target else "missed"


def _report(result: Dict[str, Any], opts: Dict[str, Any]) -> str:
    nbytes, times = result["bytes"], result["times"]
    shares = {p: max(0.0, 1 - t[UNLINKED] / t["bf16"]) for p, t in times.items()}
    lines = [f"quantized dispatch: 2 CPU ranks, link {opts['link']} GB/s, bf16 layer hidden {opts['hidden']}, "
             f"ffn {opts['ffn']}, {opts['experts']} experts top-{opts['top_k']}, 1 shared; prefill {opts['tokens']} "
             f"tokens per rank, decode {opts['decode_tokens']}; medians of {opts['repeats']} interleaved rounds",
             f"exchange share of serial's bf16 step (link on vs off): prefill {shares['prefill']:.0%}, decode "
             f"{shares['decode']:.0%}",
             "",
             f"{'dispatch':<8}  {'bytes/token':>11}  {'vs bf16':>7}  {'prefill ms':>10}  {'vs bf16':>7}  "
             f"{'decode ms':>9}  {'vs bf16':>7}"]
    for name in DISPATCHES:
        pre, dec = times["prefill"], times["decode"]
        lines.append(f"{name:<8}  {nbytes[name]:>11.0f}  {nbytes[name] / nbytes['bf16']:>6.3f}x  "
                     f"{pre[name] * 1e3:>10.2f}  {pre[name] / pre['bf16']:>6.3f}x  "
                     f"{dec[name] * 1e3:>9.2f}  {dec[name] / dec['bf16']:>6.3f}x")
    lines.append("")
    for name in DISPATCHES[1:]:
        b = nbytes[name] / nbytes["bf16"]
        verdicts = [f"bytes {b:.3f}x (target <= {BYTES_TARGET}x: {'met' if b <= BYTES_TARGET else 'missed'})"]
        for phase in ("prefill", "decode"):
            r = times[phase][name] / times[phase]["bf16"]
            verdicts.append(f"{phase} {r:.3f}x (target <= {STEP_TARGET}x: {_verdict(r, STEP_TARGET, shares[phase])})")
        lines.append(f"{name}: " + "; ".join(verdicts))
    held = result["experts"]
    lines += ["", "routed experts' memory per rank, kept quantized as a checkpoint holds them (weights + scales): "
              + ", ".join(f"{name} {held[name] / 2**20:.2f} MiB ({held[name] / held['bf16']:.3f}x)"
                          for name in ("bf16", "fp8", "int8"))]
    return "\n".join(lines)


@click.command(context_settings=COMMAND_SETTINGS)
@click.option("--tokens", default=512, help="prefill tokens per rank")
@click.option("--decode-tokens", default=128, help="decode step tokens per rank")
@click.option("--hidden", default=1024)
@click.option("--ffn", default=256, help="intermediate size of one routed expert")
@click.option("--experts", default=8)
@click.option("--top-k", default=2)
@click.option("--link", default="0.005", help="simulated link 'GB_PER_S[,LATENCY_US]' (overlap.link)")
@click.option("--repeats", default=7)
def main(**opts: Any) -> None:
    """Bytes per token and step time of the int8 / fp8 dispatch against bf16 (see the module docstring)."""
    results = run_ranks(_body, 2, opts, timeout=900, env=CPU_RANKS)
    click.echo(_report(results[0], opts))


if __name__ == "__main__":
    main()
