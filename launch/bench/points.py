"""Candidate orchestrations per parallel point of a model's layer, predicted and measured.

One process, no ranks (the MoE's exchange has no peers): for every parallel point the layers' data flow shows
(`microbatch.planning.points`: the shared experts beside the routed path, the indexer beside the latent
projections, LongCat-Flash's dense path beside its shortcut MoE), each candidate orchestration of the first layer
holding it is run on one micro-batch and printed as one row: its layer time predicted (the simulation, with a
calibration fitted from the single-stream layer's recorded runs) and measured (the median of ``--rounds``
interleaved with the single-stream layer), both relative to the single-stream layer; the point's ``overlap_pct``
(the side branch's window against the main branch's, from the measured timeline) and its verdict; whether its
outputs equal the single-stream layer's; the races the sanitizer found. On the CPU path compute on a side stream
runs inline on the host thread: only host work (the indexer's, `overlap.issue_host`) and collectives run beside
it, and the verdict says so. Example::

    python -m launch.bench.points --preset tiny
    python -m launch.bench.points --model deepseek_v32 --tokens 32
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import click
import torch

import microbatch
import overlap
from launch.bench import COMMAND_SETTINGS
from launch.engine import make_expert_parallel
from microbatch import Batch, serial_split
from microbatch.planning import predict
from microbatch.planning.points import (REAL, Orchestration, ParallelPoint, orchestrations, parallel_points,
                                        point_overlap, single_stream)
from microbatch.planning.prefill.fit import Run, fit_runs
from overlap import EP_COMM, Sanitizer, Timeline

COLUMNS = ("point", "orchestration", "predicted", "measured", "overlap_pct", "verdict", "outputs", "races")
TOL = 1e-5


@dataclasses.dataclass(frozen=True)
class Row:
    """One orchestration of one point: times relative to the single-stream layer, the measured overlap."""

    point: str
    orchestration: str
    predicted: float
    measured: float
    overlap_pct: Optional[float]
    verdict: str
    max_diff: float
    races: int
    note: str = ""


def build(model_name: str, preset_name: str, seed: int = 0) -> Any:
    """The reference decoder at ``preset_name`` (``model_name`` 'reference') or a transformers family, its MoE blocks
    in their expert-parallel form on this process alone."""
    if model_name == "reference":
        from launch.models import build_model, preset

        model = build_model(preset(preset_name), seed=seed)
    else:
        from launch.models import build_transformers_model

        model = build_transformers_model(model_name, seed=seed)
    return make_expert_parallel(model, None)


def layer_points(model: Any) -> List[Tuple[int, ParallelPoint]]:
    """Each distinct parallel point of the model's layers (by name), with the first layer that holds it."""
    seen: Dict[str, Tuple[int, ParallelPoint]] = {}
    for li, ops in enumerate(model.layer_operations()):
        for p in parallel_points(ops):
            seen.setdefault(p.name, (li, p))
    return list(seen.values())


def _inputs(model: Any, tokens: int, seed: int) -> List[Dict[str, Any]]:
    lens = [tokens] if tokens < 8 else [tokens // 2, tokens - tokens // 2]
    batch = Batch.random(lens, model.cfg.vocab, seed=seed)
    return microbatch.micro_batch_inputs(model, batch, serial_split(batch))


def _timed(run: Callable[[], List[Any]]) -> Tuple[float, List[Any], List[Any]]:
    """Wall seconds, outputs and spans of one run under a `Timeline`."""
    with Timeline() as tl:
        t0 = time.perf_counter()
        out = run()
        overlap.synchronize()
        wall = time.perf_counter() - t0
    return wall, out, tl.spans


def _runner(orch: Optional[Orchestration], ops: List[Any], inputs: List[Dict[str, Any]]) -> Callable[[], List[Any]]:
    if orch is None:
        return lambda: microbatch.run(single_stream(ops), [ops], inputs)
    return lambda: orch.run(ops, inputs)


def _predicted(ops: List[Any], schedules: Sequence[microbatch.Schedule], runs: List[Run], tokens: int
               ) -> List[float]:
    """Each schedule's predicted layer time, relative to the single-stream layer's (the first schedule), from a
    calibration fitted on ``runs``."""
    moe = [any(o.stream == EP_COMM for o in microbatch.normalize_layers([ops])[0])]
    costs = fit_runs(runs, moe).cost_model()
    device = not _on_host()
    times = [predict(s, [ops], [tokens], costs, device=device).total_s for s in schedules]
    return [t / times[0] if times[0] > 0 else float("nan") for t in times]


def _races(orch: Orchestration, ops: List[Any], inputs: List[Dict[str, Any]]) -> int:
    with Sanitizer(raise_on_race=False) as san:
        orch.run(ops, inputs)
        overlap.synchronize()
    return len(san.races)


def _diff(got: List[Any], want: List[Any]) -> float:
    return max(float((g - w).abs().max()) for g, w in zip(got, want))


def _on_host() -> bool:
    """Whether compute runs on the host thread whatever its stream (the CPU path)."""
    return overlap.backends.current().device_type == "cpu"


def _note(verdict: str) -> str:
    if verdict != REAL and _on_host():
        return "cpu: side-stream compute runs inline; only host work and collectives run beside"
    return ""


def measure_point(ops: List[Any], point: ParallelPoint, inputs: List[Dict[str, Any]], tokens: int,
                  rounds: int) -> List[Row]:
    """Every orchestration of ``point`` in the layer of ``ops``, measured ``rounds`` times interleaved with the
    single-stream layer (after one warm-up round), predicted from a calibration of the single-stream runs."""
    cands = orchestrations(ops, point)
    runners = [_runner(None, ops, inputs)] + [_runner(o, ops, inputs) for o in cands]
    walls: List[List[float]] = [[] for _ in runners]
    last: List[Tuple[List[Any], List[Any]]] = [([], [])] * len(runners)
    runs: List[Run] = []
    for r in range(rounds + 1):
        for k, run in enumerate(runners):
            wall, out, spans = _timed(run)
            if r:
                walls[k].append(wall)
                if k == 0:  # the executor's launches (layer 0 of its schedule), not host work named by the model's layer
                    runs.append(Run(tokens, [s for s in spans if s.meta.get("layer") == 0]))
            last[k] = (out, spans)
    predicted = _predicted(ops, [single_stream(ops)] + [o.schedule for o in cands], runs, tokens)
    base = statistics.median(walls[0])
    rows = []
    for k, o in enumerate(cands, start=1):
        out, spans = last[k]
        seen = point_overlap(spans, point)
        verdict = seen.verdict if seen else "not measured"
        rows.append(Row(point.name, o.name, predicted[k], statistics.median(walls[k]) / base,
                        seen.pct if seen else None, verdict, _diff(out, last[0][0]), _races(o, ops, inputs),
                        _note(verdict)))
    return rows


def bench(model: Any, tokens: int, rounds: int, seed: int = 0) -> List[Row]:
    """The rows of every point of ``model`` (see `measure_point`), at ``tokens`` tokens."""
    rows: List[Row] = []
    inputs = _inputs(model, tokens, seed)
    with torch.no_grad():
        for li, point in layer_points(model):
            rows += measure_point(model.layer_operations()[li], point, inputs, tokens, rounds)
    return rows


def table(rows: Sequence[Row]) -> str:
    """One line per (point, orchestration) under `COLUMNS`; the notes after."""
    cells = [COLUMNS] + [(r.point, r.orchestration, f"{r.predicted:.2f}", f"{r.measured:.2f}",
                          "-" if r.overlap_pct is None else f"{r.overlap_pct:.2f}", r.verdict,
                          "equal" if r.max_diff <= TOL else f"DIFFER {r.max_diff:.1e}", str(r.races))
                         for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]
    notes = sorted({r.note for r in rows if r.note})
    return "\n".join(lines + [f"note: {n}" for n in notes])


@click.command(context_settings=COMMAND_SETTINGS)
@click.option("--model", "model_name", default="reference",
              help="'reference' (the reference decoder, --preset), or a transformers family (longcat_flash, "
                   "deepseek_v32, ...)")
@click.option("--preset", "preset_name", default="tiny", help="the reference decoder's shapes")
@click.option("--tokens", default=16, help="tokens of the batch (two requests from 8 on)")
@click.option("--rounds", default=5, help="measured rounds per orchestration, interleaved (the median is printed)")
@click.option("--seed", default=0, help="weights and tokens")
def main(model_name: str, preset_name: str, tokens: int, rounds: int, seed: int) -> None:
    """Each parallel point's candidate orchestrations: predicted and measured layer time relative to the
    single-stream layer, overlap_pct and verdict, outputs against the single-stream layer, races."""
    if tokens < 1 or rounds < 1:
        raise click.UsageError(f"--tokens and --rounds must be at least 1, got {tokens} and {rounds}")
    try:
        model = build(model_name, preset_name, seed)
    except ValueError as e:  # an unknown family or preset: its first sentence, not transformers' list of every type
        raise click.UsageError(f"--model {model_name!r} --preset {preset_name!r}: {str(e).split('. ')[0]}") from None
    rows = bench(model, tokens, rounds, seed)
    if not rows:
        print(f"{model_name}: no parallel point in its layers' data flow")
        return
    print(f"{model_name if model_name != 'reference' else 'reference ' + preset_name}, {tokens} tokens, path "
          f"{overlap.current_path()}; times relative to the single-stream layer (predicted: the simulation with a "
          f"calibration of the single-stream runs; measured: median of {rounds}); overlap_pct: the side branch's window "
          f"against the main branch's (verdict real >= 0.5, false <= 0.05)")
    print(table(rows))
    if any(r.max_diff > TOL or r.races for r in rows):
        raise SystemExit(1)


__all__ = ["COLUMNS", "Row", "bench", "build", "layer_points", "measure_point", "table"]

if __name__ == "__main__":
    main()
