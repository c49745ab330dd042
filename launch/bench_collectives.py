"""Benchmark expert-parallel dispatch / combine and the MoE layer's overlap on 2 CPU (gloo) ranks.

One run prints, side by side (median of ``--repeats`` interleaved runs after one warmup each, timed
between barriers):

1. raw ``all_to_all_single`` of the same token bytes (there and back) vs ``dispatch`` + ``combine``
   (layout, count exchange, metadata and weighted reduction included; experts are the identity).
   Target: ratio <= 1.25 where the raw exchange takes at least 50 ms one way; the token count is
   doubled until it does (``--min-exchange-ms``). Both allocate their buffers per call, as a
   caller would. A ratio below 1 is possible: dispatch keeps a rank's own rows out of the
   collective, which the raw exchange copies through gloo. The expansion of received rows to
   local experts (the experts' input gather) is printed separately.
2. bytes a rank sends with per-rank deduplication (one row per token and destination rank, plus
   its metadata row) vs per-expert expansion (one row per token and chosen expert).
3. the layer (shared experts included) serial (overlap off), with the exchange on the EP stream
   but the shared experts on the main stream, and with full overlap: speedup over serial, and
   the hidden share of communication (communication time during which compute ran) from the
   timeline.

Example::

    python -m launch.bench_collectives --tokens 4096 --hidden 1024
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List

import click
import torch
import torch.distributed as dist

import overlap
from collectives import MoE, MoEConfig, combine, dispatch, wrap_expert_parallel
from overlap import Timeline
from overlap.multirank import run_ranks


def _timed(fn: Callable[[], Any], group: Any) -> float:
    dist.barrier(group)
    t0 = time.perf_counter()
    fn()
    dist.barrier(group)
    return time.perf_counter() - t0


def _best(fns: Dict[str, Callable[[], Any]], repeats: int, group: Any) -> Dict[str, float]:
    """Median time of each function over interleaved repeats after one warmup run each, the slowest
    rank's view of each repeat (all ranks agree). Each repeat starts one function later than the last."""
    for fn in fns.values():
        _timed(fn, group)
    runs: Dict[str, List[float]] = {k: [] for k in fns}
    names = list(fns)
    for i in range(repeats):
        for k in names[i % len(names):] + names[:i % len(names)]:
            t = torch.tensor([_timed(fns[k], group)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            runs[k].append(float(t))
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

    with torch.no_grad():
        torch.testing.assert_close(on(x), moe(x), rtol=1e-4, atol=1e-5)
        times = _best({"serial": serial, "comm_only": lambda: shared_main(x), "overlap": lambda: on(x)},
                      repeats, ctx.group)
        hidden_share = {}
        for name, fn in (("serial", serial), ("comm_only", lambda: shared_main(x)), ("overlap", lambda: on(x))):
            with Timeline() as tl:
                fn()
            hidden_share[name] = tl.metrics().hidden_share
    return dict(times=times, hidden_share=hidden_share)


def _body(ctx: Any, opts: Dict[str, Any]) -> Dict[str, Any]:
    torch.set_grad_enabled(False)
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
    lines = [f"2 gloo ranks, hidden {opts['hidden']}, {opts['experts']} experts, top-{opts['top_k']}, fp32",
             "",
             f"exchange ({ex['tokens']} tokens per rank, there and back)",
             f"  raw all_to_all_single      {t['raw'] * 1e3:9.1f} ms   (one way {t['one_way'] * 1e3:.1f} ms)",
             f"  dispatch + combine         {t['ours'] * 1e3:9.1f} ms   ratio {t['ours'] / t['raw']:.2f} "
             f"(target <= 1.25 where one way takes >= 50 ms)",
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
              f"  serial (overlap off)       {lt['serial'] * 1e3:9.1f} ms   hidden comm {_share(hs['serial'])}",
              f"  comm stream, shared on main{lt['comm_only'] * 1e3:9.1f} ms   speedup {lt['serial'] / lt['comm_only']:.2f}"
              f"   hidden comm {_share(hs['comm_only'])}",
              f"  shared-expert overlap on   {lt['overlap'] * 1e3:9.1f} ms   speedup {lt['serial'] / lt['overlap']:.2f}"
              f"   hidden comm {_share(hs['overlap'])}"]
    return "\n".join(lines)


@click.command()
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
    results = run_ranks(_body, 2, opts, timeout=900, threads=opts["threads"])
    click.echo(_report(results, opts))


if __name__ == "__main__":
    main()
