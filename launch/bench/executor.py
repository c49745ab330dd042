"""Benchmark the executor's host cost: microseconds per launch, first call and replayed, beside a plain loop.

One process, no ranks: what the host spends to issue each operation of a schedule. For serial,
shared and two-batch, measured side by side with the modes interleaved round by round (medians):

- ``first``: a call that finds no kept lowering (checked, lowered and compiled, then run);
- ``replayed``: a later call with new inputs (`microbatch.replay`);
- ``timeline``: replayed with a `Timeline` attached (every launch a span);
- ``loop``: a plain Python loop calling the same operations' functions in the same order.

Two workloads: ``synthetic``, ``--layers`` layers of ``--ops`` operations that return their input
(so the figures are the host's cost alone, as in DeepSeek-V3's 61 layers), and ``reference``, the
reference decoder's real operations (``--preset``) at 1 and 64 tokens, where ``loop`` runs each
operation on a plain dict of values. Each table prints the rounds' spread (the largest of the four measures'
interquartile range over their median) and the differences it compares (``replay-loop``, ``timeline-replay``) as
figures only beyond the noise (`launch.measure.verdicts.cost`: "below the noise" within it, "none measured" where one
came out negative beyond it). Targets on a 2-core host, judged on the synthetic workload (met, missed, or
inconclusive where the noise covers the margin): a replayed launch at most 3 us more than the loop in serial and
5 us in two-batch; a `Timeline` at most 10 us more per launch. It also prints the prefill's work outside the executor
(split, merge, embedding, final norm, building the layers' operations) as a share of a 64-token serial prefill
(target: at most 5%). Example::

    python -m launch.bench.executor --layers 61 --rounds 20
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import click
import torch

import microbatch
import overlap
from launch.bench import COMMAND_SETTINGS
from launch.measure import cost, spread, verdict
from launch.measure.verdicts import BELOW_NOISE, INCONCLUSIVE, MET, MISSED, NONE_MEASURED
from microbatch import Batch, Operation, replay, serial_split
from microbatch.planning import propose_split
from overlap import EP_COMM, Timeline

MODES = ("serial", "shared", "two-batch")
MEASURES = ("first", "replayed", "timeline", "loop")


def synthetic_layers(n_layers: int, n_ops: int) -> List[List[Operation]]:
    """``n_layers`` layers of ``n_ops`` (at least 6) operations that return their input, in the shape of a
    MoE layer: attention, gate, a dispatch and a combine on the exchange stream around the experts, then
    ``n_ops - 6`` more compute operations and the output."""
    names = ["attn", "gate", "dispatch", "experts", "combine"] + [f"op{i}" for i in range(n_ops - 6)] + ["out"]

    def ident(x: Any) -> Any:
        return x

    def layer() -> List[Operation]:
        reads = ["hidden"] + names[:-1]
        return [Operation(n, ident, (r,), (n,), EP_COMM if n in ("dispatch", "combine") else overlap.DEFAULT)
                for n, r in zip(names, reads)]

    return [layer() for _ in range(n_layers)]


def _loop(schedule: microbatch.Schedule, layers: Sequence[Sequence[Operation]],
          inputs: Sequence[Mapping[str, Any]]) -> Callable[[], None]:
    """The same operations in the schedule's order, values in plain dicts: the floor of any executor."""
    by_name = [{o.name: o for o in layer} for layer in layers]
    launches = [(l.mb, l.layer, by_name[l.layer][l.op]) for l in schedule.launches]
    n_layers = len(layers)

    def run() -> None:
        states: List[List[Dict[str, Any]]] = [[dict(inp) for _ in range(n_layers)] for inp in inputs]
        for mb, li, op in launches:
            state = states[mb][li]
            if li and "hidden" not in state:
                state["hidden"] = states[mb][li - 1]["out"]
            out = op.fn(*[_value(states, mb, li, r) for r in op.reads])
            if len(op.writes) == 1:
                state[op.writes[0]] = out
            else:
                state.update(zip(op.writes, out))

    return run


def _value(states: List[List[Dict[str, Any]]], mb: int, li: int, name: str) -> Any:
    v = states[mb][li][name]
    if isinstance(v, microbatch.FromMicroBatch):
        vals = [states[m][li][n] for m in v.mbs for n in v.names]
        return v.fn(*vals) if v.fn is not None else (tuple(vals) if len(vals) > 1 else vals[0])
    return v


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    overlap.synchronize()
    return time.perf_counter() - t0


def measure(layers_of: Callable[[], List[List[Operation]]], inputs_of: Callable[[int], List[Dict[str, Any]]],
            rounds: int, modes: Sequence[str] = MODES) -> Dict[str, Dict[str, Any]]:
    """Median microseconds per launch of every mode and measure, the modes interleaved round by round; under
    ``"spread"`` each measure's rounds' spread (None with one round), under ``"launches"`` the schedule's."""
    samples: Dict[str, Dict[str, List[float]]] = {m: {k: [] for k in MEASURES} for m in modes}
    launches: Dict[str, int] = {}
    for _ in range(rounds + 1):  # the first round warms up every path
        for m in modes:
            layers = layers_of()
            mode = microbatch.mode(m)
            inputs = inputs_of(mode.micro_batches)
            schedule = mode.make(layers, len(inputs))
            launches[m] = n = len(schedule.launches)
            replay.forget()
            first = _timed(lambda: microbatch.run(schedule, layers, inputs))
            replayed = _timed(lambda: microbatch.run(schedule, layers, inputs))
            with Timeline():
                timeline = _timed(lambda: microbatch.run(schedule, layers, inputs))
            loop = _timed(_loop(schedule, layers, inputs))
            for k, v in zip(MEASURES, (first, replayed, timeline, loop)):
                samples[m][k].append(v / n * 1e6)
    return {m: {k: statistics.median(v[1:]) for k, v in samples[m].items()}
            | {"launches": launches[m], "spread": {k: spread(v[1:]) for k, v in samples[m].items()}} for m in modes}


def difference(figures: Dict[str, Any], more: str, less: str) -> Tuple[float, Optional[float]]:
    """``figures[more] - figures[less]`` (us per launch) and its noise in us: the larger of the two measures'
    spread times its median (None with one round)."""
    spreads = figures["spread"]
    if spreads[more] is None or spreads[less] is None:
        return figures[more] - figures[less], None
    return figures[more] - figures[less], max(spreads[more] * figures[more], spreads[less] * figures[less])


def _us(v: float) -> str:
    return f"{v:.2f}"


def targets(figures: Dict[str, Dict[str, Any]]) -> List[str]:
    """The targets on the synthetic workload's ``figures`` (`measure`), each met, missed or inconclusive."""
    lines = []
    for mode, limit in (("serial", 3.0), ("two-batch", 5.0)):
        if mode in figures:
            d, noise = difference(figures[mode], "replayed", "loop")
            lines.append(f"target: a replayed launch at most {limit:g} us above the loop in {mode}: "
                         f"{verdict(d, limit, noise)} ({_with_noise(d, noise)})")
    timeline = {m: difference(f, "timeline", "replayed") for m, f in figures.items()}
    said = [verdict(d, 10.0, noise) for d, noise in timeline.values()]
    overall = MISSED if MISSED in said else INCONCLUSIVE if INCONCLUSIVE in said else MET
    worst = max(timeline, key=lambda m: timeline[m][0])
    lines.append(f"target: a Timeline at most 10 us more per launch, every mode: {overall} (largest in {worst}: "
                 f"{_with_noise(*timeline[worst])})")
    return lines


def _with_noise(value: float, noise: Optional[float]) -> str:
    """A difference in us per launch: its figure beyond the noise, with it; else in words."""
    said = cost(value, noise, lambda v: f"{v:.2f} us")
    return said + ("" if noise is None or said in (BELOW_NOISE, NONE_MEASURED) else f" +- {noise:.2f}")


def _reference(preset_name: str, tokens: int) -> Tuple[Any, Callable[[], List[List[Operation]]],
                                                      Callable[[int], List[Dict[str, Any]]]]:
    from launch.models import build_model, preset

    model = build_model(preset(preset_name))
    lens = [tokens] if tokens < 4 else [tokens // 2, tokens - tokens // 2]
    batch = Batch.random(lens, model.cfg.vocab)

    def inputs_of(n: int) -> List[Dict[str, Any]]:
        split = serial_split(batch) if n == 1 else propose_split(batch.seq.seq_lens, n, min_tokens=1)
        if not split.serial and len(split.points) + 1 != n:
            split = serial_split(batch)
        return microbatch.micro_batch_inputs(model, batch, split)

    return model, model.layer_operations, inputs_of


def outside_share(preset_name: str, tokens: int, rounds: int) -> Tuple[float, float, Optional[float]]:
    """Milliseconds of a serial prefill of ``tokens`` tokens (`run_schedule`, building the layers' operations
    included), the share of it outside the executor's run (the same prefill minus the run alone on inputs built
    beforehand, the two interleaved round by round), and that share's noise: the larger of the two times' spread
    (None with one round)."""
    from launch.models import build_model, preset

    model = build_model(preset(preset_name))
    batch = Batch.random([tokens], model.cfg.vocab)
    split = serial_split(batch)
    make = microbatch.mode("serial").make
    totals, inside = [], []
    with torch.no_grad():
        layers = model.layer_operations()
        inputs = microbatch.micro_batch_inputs(model, batch, split)
        for _ in range(rounds + 1):
            totals.append(_timed(lambda: microbatch.run_schedule(model, batch, split, model.layer_operations(),
                                                                 make)))
            inside.append(_timed(lambda: microbatch.run_made(make, layers, inputs)))
    total = statistics.median(totals[1:])
    spreads = [spread(totals[1:]), spread(inside[1:])]
    noise = None if None in spreads else max(x or 0.0 for x in spreads)
    return total * 1e3, 1 - statistics.median(inside[1:]) / total, noise


def _table(title: str, figures: Dict[str, Dict[str, Any]]) -> None:
    print(f"\n{title}: us per launch (median)")
    print(f"{'mode':10} {'launches':>8} " + " ".join(f"{k:>9}" for k in MEASURES) + f" {'spread':>7} "
          f"{'replay-loop':>16} {'timeline-replay':>16}")
    for m, f in figures.items():
        spreads = list(f["spread"].values())
        widest = "-" if None in spreads else f"{max(spreads):.0%}"
        print(f"{m:10} {int(f['launches']):8d} " + " ".join(f"{f[k]:9.2f}" for k in MEASURES) + f" {widest:>7} "
              + f"{cost(*difference(f, 'replayed', 'loop'), _us):>16} "
              + f"{cost(*difference(f, 'timeline', 'replayed'), _us):>16}")


@click.command(context_settings=COMMAND_SETTINGS)
@click.option("--layers", default=61, show_default=True, help="synthetic layers (DeepSeek-V3 has 61)")
@click.option("--ops", default=6, show_default=True, help="operations per synthetic layer")
@click.option("--preset", "preset_name", default="small", show_default=True, help="the reference decoder's shapes")
@click.option("--tokens", default="1,64", show_default=True, help="tokens of the reference workload, comma-separated")
@click.option("--rounds", default=10, show_default=True, help="interleaved rounds (the median is printed)")
def main(layers: int, ops: int, preset_name: str, tokens: str, rounds: int) -> None:
    """Microseconds per launch of the executor, first call and replayed, beside a plain loop."""
    if layers < 1 or ops < 6 or rounds < 1:
        raise click.UsageError("--layers and --rounds must be at least 1, --ops at least 6")
    try:
        token_counts = [int(t) for t in tokens.split(",") if t.strip()]
    except ValueError:
        raise click.UsageError(f"--tokens {tokens!r}: expected comma-separated counts, e.g. 1,64") from None
    if not token_counts or min(token_counts) < 1:
        raise click.UsageError(f"--tokens {tokens!r}: expected counts of at least 1")
    x = torch.zeros(4)
    synthetic = measure(lambda: synthetic_layers(layers, ops), lambda n: [{"hidden": x} for _ in range(n)], rounds)
    _table(f"synthetic: {layers} layers x {ops} operations that return their input", synthetic)
    for t in token_counts:
        with torch.no_grad():
            _, layers_of, inputs_of = _reference(preset_name, t)
            _table(f"reference decoder ({preset_name}), {t} tokens", measure(layers_of, inputs_of, rounds))
    print(f"\nmedians of {rounds} round(s), the modes interleaved; spread: the largest of the four measures' "
          f"interquartile range over their median; a difference is a figure only beyond the noise (the larger of its "
          f"two measures' spread times its median): '{BELOW_NOISE}' within it, '{NONE_MEASURED}' where it came out "
          f"negative beyond it (the host's noise: more --rounds)")
    for line in targets(synthetic):
        print(line)
    print(outside_line(preset_name, *outside_share(preset_name, 64, rounds)))


def outside_line(preset_name: str, ms: float, share: float, noise: Optional[float]) -> str:
    """The share of a serial prefill of 64 tokens outside the executor's launches and its target (at most 5%), the
    share a figure only beyond the noise."""
    said = cost(share, noise, lambda v: f"{v:.1%}") + ("" if noise is None else f" (noise {noise:.1%})")
    return (f"serial prefill of 64 tokens ({preset_name}): {ms:.2f} ms; the share outside the executor's launches "
            f"(split, merge, embedding, final norm, the layers' operations): {said}; target at most 5%: "
            f"{verdict(share, 0.05, noise)}")


if __name__ == "__main__":
    main()
