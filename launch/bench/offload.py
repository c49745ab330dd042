"""Benchmark the KV-cache offload stream: prefill time and device memory with and without offload.

One run measures, side by side and interleaved, a synthetic prefill (attention projections and an
MLP per layer) in these modes:

- ``keep``: keys and values stay on the device (``store="device"``), the baseline;
- ``offload sync``: copied to the host store on the main stream (``enabled=False``);
- ``offload``: copied on the copy stream under the next layer's compute (the tool under test).

The modes run in ``--repeats`` rounds after a warm-up one, each round every mode once, the order rotating
(`launch.measure.rounds`). It prints each mode's median, the rounds' spread (interquartile range over the median)
and its ratio to ``keep``, the peak device memory held by keys and values, and then, judged against the spread
(`launch.measure.verdicts`):

- the offload overhead (``offload`` over ``keep``) and its target, at most 5% when one layer's copy is shorter than
  one layer's compute (which it also measures): met, missed, or inconclusive where the spread covers the margin; an
  overhead within the spread is "below the noise", a negative one beyond it "none measured", never a figure;
- the share of the copies' time the stream hid: (``offload sync`` - ``offload``) / (``offload sync`` - ``keep``).
  Its denominator is the copies' time, which at the default sizes is about 1% of a prefill (a copy of 0.5 ms beside
  32 ms of compute a layer): far inside a busy host's spread, so the share flapped between its bounds, 0% and 100%,
  from run to run. It is a figure only where the copies' time is beyond the spread, with its error (the spread over
  the copies' time); else inconclusive.

Example::

    python -m launch.bench.offload --layers 8 --tokens 1024 --store mmap
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional

import click
import torch

import overlap
from launch.bench import COMMAND_SETTINGS
from launch.measure import cost, rounds, spread, verdict
from launch.measure.verdicts import INCONCLUSIVE
from overlap import OffloadCache


def _weights(layers: int, hidden: int, kv: int, seed: int = 0) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g) / s[0] ** 0.5  # noqa: E731
    return [dict(wq=mk(hidden, kv), wk=mk(hidden, kv), wv=mk(hidden, kv), wo=mk(kv, hidden),
                 w1=mk(hidden, 2 * hidden), w2=mk(2 * hidden, hidden)) for _ in range(layers)]


def _layer(h: torch.Tensor, w: Dict[str, torch.Tensor], heads: int,
           cache: Optional[OffloadCache] = None, layer: int = 0) -> torch.Tensor:
    """One layer's compute: projections, an attention stand-in, an MLP. With a cache, the key and
    value projections are written straight into the buffers it hands out, then offloaded."""
    t, kv = h.shape[0], w["wk"].shape[1]
    if cache is None:
        k, v = torch.empty(t, kv, device=h.device), torch.empty(t, kv, device=h.device)
    else:
        k, v = (b.view(t, kv) for b in cache.acquire(layer, t))
    q = h @ w["wq"]
    torch.matmul(h, w["wk"], out=k)
    torch.matmul(h, w["wv"], out=v)
    if cache is not None:
        cache.offload(layer, k.view(t, heads, -1), v.view(t, heads, -1))
    a = (q * k).softmax(-1) * v  # element-wise stand-in: the projections dominate, as in prefill
    h = h + a @ w["wo"]
    return h + torch.relu(h @ w["w1"]) @ w["w2"]


def _prefill(x: torch.Tensor, weights: List[Dict[str, torch.Tensor]], heads: int, cache: OffloadCache) -> float:
    t0 = time.perf_counter()
    h = x
    for layer, w in enumerate(weights):
        h = _layer(h, w, heads, cache, layer)
    cache.finish()  # the prefill is done when the last copy has landed
    overlap.synchronize()  # ... and the main stream's last layer has run (device paths)
    return time.perf_counter() - t0


def _best_time(fn: Callable[[], float], repeats: int) -> float:
    return min(fn() for _ in range(repeats))


def overhead_line(keep: float, offload: float, noise: Optional[float], limit: float = 0.05) -> str:
    """The offload overhead (``offload``'s median time over ``keep``'s, less 1) and its target, judged against the
    rounds' spread (``noise``, relative; None with one round)."""
    over = offload / keep - 1.0
    said = verdict(over, limit, noise)
    spread = "one round" if noise is None else f"spread {noise:.1%}"
    return (f"offload overhead {cost(over, noise, lambda v: f'{v:+.1%}')} ({spread}); target <= {limit:.0%}: {said}")


def hidden_line(keep: float, sync: float, offload: float, noise: Optional[float]) -> str:
    """The share of the copies' time the stream hid, (``sync`` - ``offload``) / (``sync`` - ``keep``), the medians:
    a figure with its error (the spread over the copies' time) only where the copies' time is beyond the rounds'
    spread (``noise``, relative to ``keep``); else inconclusive, with why."""
    copies = sync - keep
    spread = None if noise is None else noise * max(keep, sync, offload)
    said = cost(copies / keep, None if spread is None else spread / keep, lambda v: f"{v:+.1%}")
    if spread is None or copies <= spread:
        why = "one round" if spread is None else f"the rounds' spread is {noise:.1%}"
        return (f"copy time hidden by the stream: {INCONCLUSIVE}: the copies' time (offload sync over keep) is "
                f"{said} ({why}; more --repeats, or larger K/V against the compute)")
    hidden = (sync - offload) / copies
    return (f"copy time hidden by the stream: {min(max(hidden, 0.0), 1.0):.0%} +- {spread / copies:.0%} (the "
            f"rounds' spread over the copies' time; on the main stream the copies add {said} to a prefill)")


@click.command(context_settings=COMMAND_SETTINGS)
@click.option("--layers", default=8, show_default=True)
@click.option("--tokens", default=1024, show_default=True)
@click.option("--hidden", default=512, show_default=True)
@click.option("--heads", default=8, show_default=True)
@click.option("--head-dim", default=64, show_default=True)
@click.option("--store", type=click.Choice(["memory", "mmap"]), default="memory", show_default=True,
              help="host tier of the offload modes")
@click.option("--ring", default=2, show_default=True, help="device slots of the offload ring")
@click.option("--repeats", default=5, show_default=True, help="timed rounds, every mode once a round (medians and "
              "spread over them)")
@click.option("--threads", default=1, show_default=True, help="torch threads for the compute")
def main(layers: int, tokens: int, hidden: int, heads: int, head_dim: int, store: str, ring: int, repeats: int,
         threads: int) -> None:
    """Prefill time and peak device memory of keys and values, with and without KV offload."""
    torch.set_num_threads(threads)
    path = overlap.current_path()
    modes = {"keep": dict(store="device"), "offload sync": dict(store=store, enabled=False),
             "offload": dict(store=store)}
    caches = {m: OffloadCache(layers, tokens, (heads, head_dim), torch.float32, ring=ring, **kw)
              for m, kw in modes.items()}
    device = caches["keep"].device
    weights = [{n: t.to(device) for n, t in w.items()} for w in _weights(layers, hidden, heads * head_dim)]
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(device)

    def run(mode: str) -> float:
        cache = caches[mode]
        cache.reset()  # rewrite the same store each repeat
        return _prefill(x, weights, heads, cache)

    times: Dict[str, List[float]] = {m: [] for m in modes}
    # the warm-up round first (first touch of host pages and of the mmap file), then each round one mode later
    for i, order in enumerate(rounds(list(modes), 1, repeats)):
        for mode in order:
            took = run(mode)
            if i:
                times[mode].append(took)
    median = {m: statistics.median(ts) for m, ts in times.items()}
    spreads = {m: spread(ts) for m, ts in times.items()}

    def noise(*names: str) -> Optional[float]:  # the spread a ratio of these modes is read against
        got = [spreads[m] for m in names]
        return None if any(x is None for x in got) else max(x or 0.0 for x in got)

    compute = _best_time(lambda: _timed(lambda: _layer(x, weights[0], heads)), repeats)
    sync = caches["offload sync"]
    copy = _best_time(lambda: _timed(lambda: (sync.offload(0, *sync.acquire(0, tokens, 0), 0), sync.finish())),
                      repeats)

    click.echo(f"path={path} device={device} layers={layers} tokens={tokens} hidden={hidden} "
               f"kv=({heads}x{head_dim}) store={store} ring={ring} threads={threads} rounds={repeats}")
    click.echo(f"one layer: compute {compute * 1e3:.2f} ms, K/V copy {copy * 1e3:.2f} ms "
               f"(copy/compute {copy / compute:.2f}; the 5% target applies below 1)")
    click.echo(f"{'mode':<14}{'prefill ms':>12}{'spread':>8}{'vs keep':>10}{'device KV MiB':>16}{'host KV MiB':>14}")
    for mode in modes:
        c = caches[mode]
        s = spreads[mode]
        click.echo(f"{mode:<14}{median[mode] * 1e3:>12.2f}{'-' if s is None else f'{s:.1%}':>8}"
                   f"{median[mode] / median['keep']:>10.3f}{c.peak_device_bytes / 2**20:>16.2f}"
                   f"{c.host_bytes / 2**20:>14.2f}")
    click.echo(f"medians of {repeats} round(s), the modes interleaved; spread: the rounds' interquartile range over "
               f"their median")
    click.echo(overhead_line(median["keep"], median["offload"], noise("keep", "offload")))
    click.echo(hidden_line(median["keep"], median["offload sync"], median["offload"],
                           noise("keep", "offload sync", "offload")))
    click.echo(f"device KV memory {caches['offload'].peak_device_bytes / caches['keep'].peak_device_bytes:.2f}x "
               f"of keeping it")
    for c in caches.values():
        c.close()


def _timed(fn: Callable[[], object]) -> float:
    overlap.synchronize()
    t0 = time.perf_counter()
    fn()
    overlap.synchronize()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
