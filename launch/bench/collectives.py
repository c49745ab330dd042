"""Benchmark expert-parallel dispatch / combine and the MoE layer's overlap on 2 CPU (gloo) ranks.

One run prints, side by side (median of ``--repeats`` interleaved runs after one warmup each, timed
between barriers):

1. raw ``all_to_all_single`` of the same token bytes (there and back) vs ``dispatch`` + ``combine``
   (layout, count exchange, metadata and weighted reduction included; experts are the identity).
   Target: ratio <= 1.25 where the raw exchange takes at least 50 ms one way (`TARGET_MS`; below,
   the fixed costs of the count exchange and the layout dominate and no target is printed); the
   token count is doubled until it takes ``--min-exchange-ms``. Both allocate their buffers per
   call, as a caller would. A ratio below 1 is possible: dispatch keeps a rank's own rows out of the
   collective, which the raw exchange copies through gloo. The expansion of received rows to
   local experts (the experts' input gather) is printed separately.
2. bytes a rank sends with per-rank deduplication (one row per token and destination rank, plus
   its metadata row) vs per-expert expansion (one row per token and chosen expert).
3. the layer (shared experts included) serial (overlap off), with the exchange on the EP stream
   but the shared experts on the main stream, and with the shared experts on their own stream:
   speedup over serial, and the hidden share of communication (communication time during which
   compute ran, every rank pooled) from timelines of the same timed runs, their median. On CPU
   the last two run the same host order (compute on any stream runs on the one host thread),
   so they differ by noise only; on a device the shared experts' stream also runs beside the
   routed experts.

Example::

    python -m launch.bench.collectives --tokens 4096 --hidden 1024
"""
from __future__ import annotations

import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a file: the repository's collectives package, not this file, is `collectives`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from typing import Any, Callable, Dict, List, Optional

import click
import torch
import torch.distributed as dist

import overlap
from collectives import MoE, MoEConfig, combine, dispatch, wrap_expert_parallel
from launch.bench import COMMAND_SETTINGS, CPU_RANKS
from overlap import Timeline
from overlap.multirank import run_ranks
from overlap.observability import gather, metrics

TARGET_MS = 50.0  # dispatch + combine within TARGET_RATIO of the raw exchange where one way takes this long
TARGET_RATIO = 1.25


def _timed(fn: Callable[[], Any], group: Any, timeline: Optional[Timeline] = None) -> float:
    """Seconds of one run between barriers, recorded on ``timeline`` when one is given."""
    dist.barrier(group)
    if timeline is not None:
        timeline.start()
    t0 = time.perf_counter()
    fn()
    dist.barrier(group)
    dt = time.perf_counter() - t0
    if timeline is not None:
        timeline.stop()
    return dt


def _best(fns: Dict[str, Callable[[], Any]], repeats: int, group: Any,
          hidden: Optional[Dict[str, List[float]]] = None) -> Dict[str, float]:
    """Median time of each function over interleaved repeats after one warmup run each, the slowest
    rank's view of each repeat (all ranks agree). Each repeat starts one function later than the last.

    With ``hidden``, every timed run is recorded on a timeline and its hidden share of communication
    (every rank's spans) appended to ``hidden[name]``: the figure comes from the runs that are timed.
    """
    for fn in fns.values():
        _timed(fn, group)
    runs: Dict[str, List[float]] = {k: [] for k in fns}
    names = list(fns)
    for i in range(repeats):
        for k in names[i % len(names):] + names[:i % len(names)]:
            tl = Timeline() if hidden is not None else None
            t = torch.tensor([_timed(fns[k], group, tl)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            runs[k].append(float(t))
            if tl is not None:
                share = metrics(gather(tl.spans, group)).hidden_share
                hidden[k].append(0.0 if share is None else share)
    return {k: statistics.median(v) for k, v in runs.items()}


def _routing(rank: int, tokens: int, hidden: int, experts: int, k: int):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g)
    idx = torch.rand(tokens, experts, generator=g).topk(k, dim=-1).indices
    return x, idx, torch.rand(tokens, k, generator=g)


def _exchange(ctx: Any, tokens: int, hidden: int, experts: int, k: int, repeats: int,
              min_ms: float) -> Dict[str, Any]:
    while True:
        x, idx, w = _routing(ctx.rank, tokens, hidden, experts, k)
        h = dispatch(x, idx, w, experts, ctx.group)
        send_splits, recv_splits = h.layout.send_splits, h.recv_splits
        send_x = x[h.layout.send_token]
        batch = h.expand()  # the experts' input; the identity expert's output has the same layout

        def there() -> torch.Tensor:
            recv_x = send_x.new_empty(sum(recv_splits), hidden)
            dist.all_to_all_single(recv_x, send_x, recv_splits, send_splits, group=ctx.group)
            return recv_x

        def raw() -> None:
            back = send_x.new_empty(send_x.shape)
            dist.all_to_all_single(back, there(), send_splits, recv_splits, group=ctx.group)

        def ours() -> None:
            hd = dispatch(x, idx, w, experts, ctx.group)
            combine(batch.x, batch, hd).wait()

        def with_expansion() -> None:
            hd = dispatch(x, idx, w, experts, ctx.group)
            b = hd.expand()
            combine(b.x, b, hd).wait()

        there()
        probe = torch.tensor([min(_timed(there, ctx.group) for _ in range(2))])  # one way
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=ctx.group)
        if float(probe) * 1e3 >= min_ms or tokens >= (1 << 20):
            break
        tokens *= 2
    times = _best({"one_way": there, "raw": raw, "ours": ours, "expand": with_expansion}, repeats, ctx.group)
    item = x.element_size()
    meta = h.layout.top_k * 2 * 4
    return dict(tokens=tokens, times=times, dedup_rows=h.layout.num_send, expanded_rows=tokens * k,
                dedup_bytes=h.layout.num_send * (hidden * item + meta), expanded_bytes=tokens * k * hidden * item)


def _layer(ctx: Any, tokens: int, hidden: int, experts: int, k: int, ffn: int, repeats: int) -> Dict[str, Any]:
    torch.manual_seed(0)
    moe = MoE(MoEConfig(hidden=hidden, ffn=ffn, n_experts=experts, top_k=k, n_shared=2))
    on = wrap_expert_parallel(moe, ctx.group)
    shared_main = wrap_expert_parallel(moe, ctx.group, overlap_shared=False)
    x, _, _ = _routing(ctx.rank, tokens, hidden, experts, k)

    def serial() -> None:
        with overlap.enabled(False):
            on(x)

    fns = {"serial": serial, "comm_only": lambda: shared_main(x), "overlap": lambda: on(x)}
    hidden: Dict[str, List[float]] = {k: [] for k in fns}
    with torch.no_grad():
        torch.testing.assert_close(on(x), moe(x), rtol=1e-4, atol=1e-5)
        times = _best(fns, repeats, ctx.group, hidden)
    return dict(times=times, hidden_share={k: statistics.median(v) for k, v in hidden.items()})


def _body(ctx: Any, opts: Dict[str, Any]) -> Dict[str, Any]:
    torch.set_grad_enabled(False)
    overlap.keep_freed_memory()  # as the launchers on the CPU path (overlap.host_memory)
    ex = _exchange(ctx, opts["tokens"], opts["hidden"], opts["experts"], opts["top_k"], opts["repeats"],
                   opts["min_exchange_ms"])
    layer = _layer(ctx, opts["layer_tokens"], opts["hidden"], opts["experts"], opts["top_k"], opts["ffn"],
                   opts["repeats"])
    return dict(exchange=ex, layer=layer)


def _share(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _report(rank_results: List[Dict[str, Any]], opts: Dict[str, Any]) -> str:
    ex, layer = rank_results[0]["exchange"], rank_results[0]["layer"]
    t = ex["times"]
    lines = [f"2 gloo ranks, hidden {opts['hidden']}, {opts['experts']} experts, top-{opts['top_k']}, fp32, "
             f"median of {opts['repeats']} interleaved run(s)",
             "",
             f"exchange ({ex['tokens']} tokens per rank, there and back)",
             f"  raw all_to_all_single      {t['raw'] * 1e3:9.1f} ms   (one way {t['one_way'] * 1e3:.1f} ms)",
             f"  dispatch + combine         {t['ours'] * 1e3:9.1f} ms   ratio {t['ours'] / t['raw']:.2f} "
             f"{_target(t['ours'] / t['raw'], t['one_way'])}",
             f"  ... plus expansion to experts {t['expand'] * 1e3:6.1f} ms   ratio {t['expand'] / t['raw']:.2f} "
             f"(the experts' input gather, not part of the exchange)",
             "",
             "bytes each rank's dispatch addresses (its own rows included; those no longer travel)"]
    for r, res in enumerate(rank_results):
        e = res["exchange"]
        lines.append(f"  rank {r}: deduplicated {e['dedup_rows']:7d} rows {e['dedup_bytes'] / 2**20:8.1f} MiB "
                     f"(with metadata) | per expert {e['expanded_rows']:7d} rows "
                     f"{e['expanded_bytes'] / 2**20:8.1f} MiB | saved {1 - e['dedup_bytes'] / e['expanded_bytes']:.0%}")
    lt, hs = layer["times"], layer["hidden_share"]
    lines += ["",
              f"MoE layer ({opts['layer_tokens']} tokens per rank, ffn {opts['ffn']}, 2 shared experts)",
              f"  serial (overlap off)              {lt['serial'] * 1e3:9.1f} ms   hidden comm {_share(hs['serial'])}",
              f"  exchange on ep_comm, shared on main {lt['comm_only'] * 1e3:7.1f} ms   "
              f"speedup {lt['serial'] / lt['comm_only']:.2f}   hidden comm {_share(hs['comm_only'])}",
              f"  ... shared on their own stream    {lt['overlap'] * 1e3:9.1f} ms   "
              f"speedup {lt['serial'] / lt['overlap']:.2f}   hidden comm {_share(hs['overlap'])}",
              "  (hidden comm: median over the timed runs; on CPU the last two rows run the same host order, "
              "so they differ by noise only)"]
    return "\n".join(lines)


def _target(ratio: float, one_way_s: float) -> str:
    """The target and whether the ratio meets it, where it applies (the exchange long enough)."""
    if one_way_s * 1e3 < TARGET_MS:
        return f"(no target: one way under {TARGET_MS:.0f} ms, where the fixed costs dominate)"
    return f"(target <= {TARGET_RATIO}: {'met' if ratio <= TARGET_RATIO else 'MISSED'})"


@click.command(context_settings=COMMAND_SETTINGS)
@click.option("--tokens", default=4096, show_default=True, help="tokens per rank for the exchange (start value)")
@click.option("--hidden", default=1024, show_default=True)
@click.option("--experts", default=8, show_default=True)
@click.option("--top-k", default=2, show_default=True)
@click.option("--ffn", default=256, show_default=True, help="intermediate size of one routed expert")
@click.option("--layer-tokens", default=2048, show_default=True, help="tokens per rank for the layer")
@click.option("--repeats", default=5, show_default=True)
@click.option("--min-exchange-ms", default=50.0, show_default=True,
              help="double the tokens until the raw exchange takes this long one way")
@click.option("--threads", default=1, show_default=True, help="torch threads per rank")
def main(**opts: Any) -> None:
    """Dispatch/combine vs raw all_to_all, deduplicated bytes, and the MoE layer's overlap (2 CPU ranks)."""
    results = run_ranks(_body, 2, opts, timeout=900, threads=opts["threads"], env=CPU_RANKS)
    click.echo(_report(results, opts))


if __name__ == "__main__":
    main()
