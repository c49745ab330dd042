"""Benchmark the CPU path's communication-thread priority settings (`overlap.comm_threads`) side by side.

On 2 CPU ranks, interleaved round by round in one run (each round runs every setting under every
load, the orders alternating), it measures:

- a small all-to-all right after some compute on both ranks: its time after the later rank
  entered it (both ranks' clocks are the host's), as median, 90th and 99th percentile, and the
  share over 2 ms; this is the wake-up of gloo's threads while the other rank's compute holds a core;
- the prefill of the reference model in each mode asked for (``--modes``, default serial and
  two-batch) on the simulated link: median, middle half, and the ratio of the medians.

Each is measured under every load asked for (``--loads``): ``none``, a quiet host; ``compute``,
beside a process computing on one core; ``job``, beside another 2-rank prefill job of this toolkit
(its comm threads at the default), as on a shared machine. Each competitor is started once and
paused (SIGSTOP) while another load is measured, so the loads interleave as the settings do. The
default of ``--cpu-comm-priority`` is the setting that holds up under all of them.

By default it runs the launchers' setting alone (``--cpu-comm-priority``'s default, normal priority), under each
load; ``--settings rt,off`` adds real-time threads, where the process may raise them, and compares the two.

Example::

    python -m launch.bench.comm_threads                  # normal priority, quiet and under load
    python -m launch.bench.comm_threads --settings rt,off # real-time against normal, side by side
    python -m launch.bench.comm_threads --settings rt,off --tokens 1024 --rounds 10 --loads none,job
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from typing import Any, Dict, List, Sequence, Tuple

import click

from launch.bench import COMMAND_SETTINGS
from overlap.comm_threads import DEFAULT_MODE

SETTINGS = ("rt", "off")
LOADS = ("none", "compute", "job")
# a competing compute process: single-threaded matrix products until its parent is gone
_COMPUTE = """
import os
import numpy as np
parent = os.getppid()
a = np.random.default_rng(0).standard_normal((256, 256))
while os.getppid() == parent:
    for _ in range(20):
        a = np.tanh(a @ a)
"""


def _job_command() -> List[str]:
    """Another job of this toolkit: a 2-rank two-batch prefill that runs until stopped, comm threads at the default."""
    launcher = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "prefill.py")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", launcher,
            "--preset", "tiny", "--batch", "4", "--seq-len", "64", "--mode", "two-batch", "--warmup", "0",
            "--iters", "1000000", "--timeout", "3600"]


class Competitors:
    """The competing loads, each started once and paused (SIGSTOP, its whole process group) while not measured."""

    def __init__(self, loads: Sequence[str]) -> None:
        import subprocess

        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        env.pop("OVERLAP_CPU_COMM_PRIORITY", None)
        self.procs: Dict[str, Any] = {}
        self._log = tempfile.TemporaryFile("w+")
        for load in loads:
            if load == "none":
                continue
            cmd = [sys.executable, "-c", _COMPUTE] if load == "compute" else _job_command()
            self.procs[load] = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=self._log,
                                                stderr=subprocess.STDOUT)
        if "job" in self.procs:
            self._wait_started(self.procs["job"], timeout=300.0)
        self.set("none")

    def _wait_started(self, proc: Any, timeout: float) -> None:
        """Until the job prints its headline (it then measures), or a clear error."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._log.seek(0)
            text = self._log.read()
            if "prefill:" in text:
                return
            if proc.poll() is not None:
                raise RuntimeError(f"the competing job exited ({proc.returncode}) before it ran:\n{text[-2000:]}")
            time.sleep(0.2)
        raise RuntimeError(f"the competing job did not start within {timeout:.0f} s")

    def set(self, load: str) -> None:
        """Let ``load`` run, pause the others."""
        import signal

        for name, p in self.procs.items():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGCONT if name == load else signal.SIGSTOP)

    def close(self) -> None:
        import signal

        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
        self._log.close()


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


def _alternate(items: Sequence[Any], r: int) -> List[Any]:
    return list(items) if r % 2 else list(items)[::-1]


def _rank_body(ctx: Any, preset_name: str, tokens: int, seq_len: int, link: float, modes: List[str], rounds: int,
               compute_ms: float, exchanges: int, seed: int, settings: List[str],
               loads: List[str]) -> Dict[str, Any]:
    import torch.distributed as dist

    import overlap
    from launch.models import build_model, preset
    from launch.engine import make_expert_parallel, prefill, split_for
    from microbatch.batch import Batch

    overlap.keep_freed_memory()  # as the launchers on the CPU path (overlap.host_memory)
    overlap.set_link(overlap.Link(link))
    model = make_expert_parallel(build_model(preset(preset_name), seed=seed), ctx.group)
    full, rest = divmod(tokens, seq_len)
    batch = Batch.random([seq_len] * full + ([rest] if rest else []), model.cfg.vocab, seed=seed + ctx.rank)
    splits = {m: split_for(m, batch, ctx.group, model=model) for m in modes}
    probe: Dict[Tuple[str, str], List[Tuple[float, float]]] = {(n, s): [] for n in loads for s in settings}
    times: Dict[Tuple[str, str, str], List[float]] = {(n, s, m): [] for n in loads for s in settings for m in modes}
    said = {}
    competitors = Competitors(loads) if ctx.rank == 0 else None
    try:
        for r in range(rounds + 1):  # round 0 warms up
            for i, load in enumerate(_alternate(loads, r)):
                if competitors is not None:
                    competitors.set(load)
                for setting in _alternate(settings, r + i):
                    overlap.set_comm_priority(setting)
                    said[setting] = overlap.describe_comm_priority()
                    dist.barrier(group=ctx.group)
                    pairs = _exchange_times(ctx, compute_ms * 1e-3, exchanges)
                    for mode in modes:
                        dist.barrier(group=ctx.group)
                        t0 = time.perf_counter()
                        prefill(model, batch, mode, splits[mode], None)
                        overlap.synchronize()
                        if r:
                            times[(load, setting, mode)].append(time.perf_counter() - t0)
                    if r:
                        probe[(load, setting)] += pairs
    finally:
        if competitors is not None:
            competitors.close()
        overlap.set_comm_priority(None)
    return {"probe": probe, "times": times, "said": said}


def _after_entry(per_rank: List[List[Tuple[float, float]]]) -> List[float]:
    """Each exchange's time after the later rank entered it."""
    return sorted(max(p[1] for p in pair) - max(p[0] for p in pair) for pair in zip(*per_rank))


def _exchange_row(setting: str, per_rank: List[List[Tuple[float, float]]]) -> str:
    after = _after_entry(per_rank)
    n = len(after)
    q = statistics.quantiles(after, n=100) if n > 1 else after * 99
    return (f"    {setting:4s} median {statistics.median(after) * 1e3:6.2f} ms   p90 {q[89] * 1e3:6.2f} ms   "
            f"p99 {q[98] * 1e3:6.2f} ms   over 2 ms: {sum(a > 2e-3 for a in after) / n:4.0%} of {n}")


def _load_name(load: str) -> str:
    return {"none": "quiet host", "compute": "beside a competing compute process",
            "job": "beside another 2-rank prefill job of this toolkit"}[load]


def prefill_medians(results: List[Dict[str, Any]], load: str, setting: str, mode: str) -> List[float]:
    """The slower rank's prefill time of each round under ``load`` and ``setting``."""
    return [max(ts) for ts in zip(*(r["times"][(load, setting, mode)] for r in results))]


def report(results: List[Dict[str, Any]], modes: List[str], settings: Sequence[str] = SETTINGS,
           loads: Sequence[str] = ("none",)) -> str:
    """The side-by-side table of one run (ranks' results as `_rank_body` returns them)."""
    said = results[0]["said"]
    lines = ["communication threads: " + "; ".join(f"{s} = {said[s]}" for s in settings)]
    verdict = []
    for load in loads:
        lines.append(f"{_load_name(load)}:")
        lines.append("  small all-to-all after compute, time after the later rank entered it:")
        for s in settings:
            lines.append(_exchange_row(s, [r["probe"][(load, s)] for r in results]))
        lines.append("  prefill (the slower rank's time per round):")
        for mode in modes:
            med = {}
            for s in settings:
                slowest = prefill_medians(results, load, s, mode)
                med[s] = statistics.median(slowest)
                q = statistics.quantiles(slowest, n=4) if len(slowest) > 1 else slowest * 3
                lines.append(f"    {mode:12s} {s:4s} median {med[s] * 1e3:8.1f} ms   middle half "
                             f"{q[0] * 1e3:.1f}-{q[2] * 1e3:.1f} ms")
            base = settings[-1]
            for s in settings[:-1]:
                lines.append(f"    {mode:12s} {base} / {s}: {med[base] / med[s]:.2f}x")
                verdict.append(f"{mode} {_load_name(load)}: {base} / {s} {med[base] / med[s]:.2f}x")
    if len(loads) > 1 and verdict:  # one setting alone: nothing to compare
        lines.append("summary (above 1.00x: the first setting is faster): " + "; ".join(verdict))
    return "\n".join(lines)


def _parse_list(text: str, valid: Sequence[str], option: str) -> List[str]:
    items = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    unknown = [x for x in items if x not in valid]
    if unknown or not items:
        raise click.BadParameter(f"{', '.join(unknown) or 'none given'}: expected values among {', '.join(valid)}",
                                 param_hint=option)
    return items


@click.command(context_settings=COMMAND_SETTINGS)
@click.option("--preset", "preset_name", default="small")
@click.option("--tokens", type=int, default=64, help="Tokens per rank.")
@click.option("--seq-len", type=int, default=128, help="Tokens per request.")
@click.option("--link", type=float, default=0.5, help="Simulated link in GB/s.")
@click.option("--modes", default="serial,two-batch", help="Prefill modes, comma-separated.")
@click.option("--settings", "settings_text", default=DEFAULT_MODE,
              help="Communication-thread settings, comma-separated (the last is the baseline): by default the "
                   "launchers' own, off (normal priority); rt,off runs real-time threads too (SCHED_FIFO where "
                   "permitted: root, CAP_SYS_NICE or RLIMIT_RTPRIO) and compares the two.")
@click.option("--loads", "loads_text", default=",".join(LOADS),
              help="What to measure beside, comma-separated: none (a quiet host), compute (a process computing on "
                   "one core), job (another 2-rank prefill job of this toolkit).")
@click.option("--rounds", type=int, default=20, help="Rounds; each runs every setting under every load.")
@click.option("--compute-ms", type=float, default=2.0, help="Compute before each probe exchange.")
@click.option("--exchanges", type=int, default=20, help="Probe exchanges per round and setting.")
@click.option("--seed", type=int, default=0)
def main(preset_name: str, tokens: int, seq_len: int, link: float, modes: str, settings_text: str, loads_text: str,
         rounds: int, compute_ms: float, exchanges: int, seed: int) -> None:
    """Communication-thread priority settings side by side in one run, on a quiet host and beside other jobs."""
    from launch.bench import CPU_RANKS
    from overlap import comm_threads
    from overlap.multirank import run_ranks

    import microbatch

    mode_list = _parse_list(modes, list(microbatch.MODES), "--modes")
    settings = _parse_list(settings_text, comm_threads.MODES, "--settings")
    loads = _parse_list(loads_text, LOADS, "--loads")
    if rounds < 1 or exchanges < 2:
        raise click.BadParameter("--rounds must be >= 1 and --exchanges >= 2")
    click.echo(f"2 CPU ranks, preset {preset_name}, {tokens} tokens per rank, simulated link {link:g} GB/s, "
               f"{rounds} rounds interleaved, settings {', '.join(settings)}, loads "
               f"{', '.join(_load_name(n) for n in loads)}")
    results = run_ranks(_rank_body, 2, preset_name, tokens, seq_len, link, mode_list, rounds, compute_ms, exchanges,
                        seed, settings, loads, timeout=3600, env=CPU_RANKS)
    click.echo(report(results, mode_list, settings, loads))


if __name__ == "__main__":
    main()
