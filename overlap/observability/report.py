"""``overlap-report SOURCE``: per-stream busy time and overlap from a trace, with a CI gate.

SOURCE is a Chrome trace from `overlap.Timeline` or ``torch.profiler`` (``.json`` or ``.json.gz``), a
folder of them (one per rank, as ``torch.profiler.tensorboard_trace_handler`` writes them), or a
torch_npu profiler output folder (or one of its ``trace_view.json`` / ``kernel_details.csv`` /
``step_trace_time.csv``). Prints, per rank or device: busy time per stream, overlap per pair of
streams, overlap / min(busy) with a verdict (>= 0.5 real overlap, <= 0.05 serialized) and the hidden
share of communication (the launcher's "hidden comm"), all as `overlap.observability._intervals`
defines them; in a profiler trace of this toolkit's executor, per operation its launches, busy time
and the communication hidden under it (`overlap.observability._operations`).

With ``--plan PREDICTED`` (a trace written from `microbatch.planning.simulation`'s prediction) it compares
instead: per operation the measured and the planned duration and start, and the operations that
drift most from the plan (`overlap.observability._compare`). A plan that is not one (a measured
trace), or of another schedule than the measured trace, is refused.

Only regular files and folders are read, each file at most to the size it has when opened: a
named pipe or a device is refused rather than waited on.

Exit status: 0 fine, 1 below ``--min-overlap`` / ``--min-hidden``, 2 unreadable input or bad options.
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional, Tuple

import click

from . import _compare
from ._intervals import ISSUE, Metrics, compute_metrics, verdict
from ._operations import RankOperations, operation_figures
from ._traces import Trace, TraceError, load

EXIT_BELOW, EXIT_BAD_INPUT = 1, 2


class _BadInput(click.ClickException):
    exit_code = EXIT_BAD_INPUT


def analyse(source: str) -> Tuple[Trace, Metrics]:
    """Load ``source`` and compute its metrics; `TraceError` when the input is unusable."""
    trace = load(source)
    if not trace.items and not trace.profiler_overlap:
        raise TraceError(f"{source}: no timed events (complete 'X' slices or task rows) found in it")
    if not trace.profiler_overlap and all(end <= start for *_, start, end in trace.items):
        raise TraceError(f"{source}: all {len(trace.items)} timed events have zero duration: no busy time to report")
    return trace, compute_metrics(trace.items)


def _pct(x: Optional[float]) -> str:
    return "n/a (no communication)" if x is None else f"{x:.1%}"


def _operation_lines(ro: RankOperations) -> List[str]:
    lines = []
    for op in ro.operations:
        head = f"  op    {op.label:<24} {op.launches:4d} launches {op.span * 1e3:10.3f} ms"
        where = ", ".join(f"{lane} {t * 1e3:.3f} ms" for lane, t in sorted(op.busy.items(), key=lambda kv: -kv[1])
                          if t > 0)
        if op.kind == ISSUE:  # on a host trace its ops are the host issuing an exchange; on a device, its kernels
            lines.append(f"{head}  issue: " + (f"busy {where}" if where else "the host's time, no busy time"))
        else:
            lines.append(f"{head}  busy {where or 'nowhere'}, hides {_pct(ro.hidden_share(op))} of communication")
    outside = ", ".join(f"{lane} {t * 1e3:.3f} ms" for lane, t in sorted(ro.outside.items(), key=lambda kv: -kv[1])
                        if t > 0)
    lines.append(f"  op    (outside the operations): busy {outside or 'nowhere'}")
    return lines


def render(trace: Trace, m: Metrics) -> str:
    """The report as text."""
    lines = [f"{trace.source} ({trace.format})"]
    if trace.left_out:
        lines.append(f"left out: {', '.join(trace.left_out)}")
    operations = operation_figures(trace.items, trace.launches)
    for proc, rm in sorted(m.per_rank.items(), key=lambda kv: str(kv[0])):
        lines.append(f"{proc}:")
        for stream, busy in sorted(rm.busy.items(), key=lambda kv: -kv[1]):
            lines.append(f"  busy  {stream:<24} {busy * 1e3:12.3f} ms")
        for (a, b), ov in sorted(rm.overlap.items(), key=lambda kv: -kv[1]):
            r = rm.ratio(a, b)
            lines.append(f"  pair  {a} | {b}: overlap {ov * 1e3:.3f} ms, overlap/min(busy) {r:.2f}  {verdict(r)}")
        lines.append(f"  hidden share of communication: {_pct(rm.hidden_share)}")
        if proc in operations:
            lines += _operation_lines(operations[proc])
    for proc, (comm, hidden) in sorted(trace.profiler_overlap.items()):
        share = hidden / comm if comm > 0 else None
        lines.append(f"{proc}: profiler's own analysis: communication {comm * 1e3:.3f} ms, "
                     f"overlapped {hidden * 1e3:.3f} ms ({_pct(share)})")
    if len(m.per_rank) > 1:
        lines.append(f"all: hidden share of communication {_pct(m.hidden_share)} (the launcher's \"hidden comm\")")
    return "\n".join(lines)


def gate(m: Metrics, min_overlap: Optional[float], pair: Optional[Tuple[str, str]],
         min_hidden: Optional[float]) -> List[str]:
    """The reasons the trace fails the thresholds (empty when it passes)."""
    failures = []
    if min_overlap is not None:
        if pair is not None and not any(set(pair) <= set(rm.busy) for rm in m.per_rank.values()):
            streams = sorted({s for rm in m.per_rank.values() for s in rm.busy})
            raise _BadInput(f"--pair {pair[0]} {pair[1]}: no rank has both streams; streams: {', '.join(streams)}")
        checked = 0
        for proc, rm in sorted(m.per_rank.items(), key=lambda kv: str(kv[0])):
            p = pair if pair is not None else rm.busiest_pair()
            if p is None or not set(p) <= set(rm.busy):
                continue
            checked += 1
            r = rm.ratio(*p)
            if r < min_overlap:
                failures.append(f"{proc}: overlap/min(busy) of {p[0]} | {p[1]} is {r:.2f} < {min_overlap}")
        if not checked:
            failures.append("no rank has two busy streams, so no overlap is proven")
    if min_hidden is not None:
        share = m.hidden_share
        if share is None or share < min_hidden:
            failures.append(f"hidden share of communication {_pct(share)} < {min_hidden:.1%}")
    return failures


def _operations_json(ro: Optional[RankOperations]) -> Dict[str, Any]:
    if ro is None:
        return {}
    return {"operations": [{"operation": op.op, "stream": op.stream, "kind": op.kind, "launches": op.launches,
                            "span_s": op.span, "busy_s": op.busy, "hidden_comm_s": op.hidden_comm,
                            "hidden_share": ro.hidden_share(op)} for op in ro.operations],
            "busy_outside_operations_s": ro.outside}


def _as_json(trace: Trace, m: Metrics, failures: List[str]) -> Dict[str, Any]:
    operations = operation_figures(trace.items, trace.launches)
    return {"source": trace.source, "format": trace.format, "files": trace.files, "left_out": trace.left_out,
            "hidden_share": m.hidden_share, "failures": failures,
            "ranks": {str(p): {"busy_s": rm.busy, "hidden_share": rm.hidden_share,
                               "pairs": [{"a": a, "b": b, "overlap_s": ov, "ratio": rm.ratio(a, b),
                                          "verdict": verdict(rm.ratio(a, b))} for (a, b), ov in rm.overlap.items()],
                               **_operations_json(operations.get(p))}
                      for p, rm in m.per_rank.items()},
            "profiler_overlap": {p: {"communication_s": c, "overlapped_s": h}
                                 for p, (c, h) in trace.profiler_overlap.items()}}


def _not_nan(ctx: click.Context, param: click.Parameter, value: Optional[float]) -> Optional[float]:
    # FloatRange lets NaN through, and every comparison with NaN is false: the gate would never fail
    if value is not None and math.isnan(value):
        raise click.BadParameter(f"{value} is not a number in the range 0<=x<=1.")
    return value


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("source", type=click.Path())
@click.option("--min-overlap", type=click.FloatRange(0, 1), default=None, callback=_not_nan,
              help="Fail (exit 1) when overlap/min(busy) of the checked pair is below this on any rank.")
@click.option("--pair", nargs=2, type=str, default=None,
              help="The two streams to check, as printed (default: each rank's two busiest streams).")
@click.option("--min-hidden", type=click.FloatRange(0, 1), default=None, callback=_not_nan,
              help="Fail (exit 1) when the hidden share of communication is below this.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON instead of text.")
@click.option("--plan", type=click.Path(), default=None,
              help="Compare SOURCE with this predicted trace of the same schedule (both written by this toolkit) "
                   "instead.")
def main(source: str, min_overlap: Optional[float], pair: Optional[Tuple[str, str]], min_hidden: Optional[float],
         as_json: bool, plan: Optional[str]) -> None:
    """Report per-stream busy time and overlap of the trace at SOURCE (or compare it with --plan)."""
    if plan is not None:
        _compare_with_plan(source, plan, as_json, [o for o, v in (("--min-overlap", min_overlap), ("--pair", pair),
                                                                  ("--min-hidden", min_hidden)) if v is not None])
        return
    if pair is not None and min_overlap is None:
        raise _BadInput(f"--pair {pair[0]} {pair[1]}: only used with --min-overlap, which is not given")
    if pair is not None and pair[0] == pair[1]:
        raise _BadInput(f"--pair {pair[0]} {pair[1]}: names one stream twice; give two different streams")
    trace, m = _read(source, lambda: analyse(source))
    failures = gate(m, min_overlap, pair, min_hidden)
    if as_json:
        click.echo(json.dumps(_as_json(trace, m, failures), indent=2))
    else:
        click.echo(render(trace, m))
        for f in failures:
            click.echo(f"FAIL: {f}", err=True)
    if failures:
        click.get_current_context().exit(EXIT_BELOW)


def _read(source: str, read: Any) -> Any:
    """``read()``; a bad input, or a reader bug, as one line and exit status 2."""
    try:
        return read()
    except TraceError as e:
        raise _BadInput(str(e)) from None
    except Exception as e:  # a reader bug must not pass for a gate failure (exit 1) or print a traceback
        what = " ".join(f"{type(e).__name__}: {e}".split())
        raise _BadInput(f"{source}: cannot read it ({what}); a bug in overlap-report, please report it") from None


def _compare_with_plan(source: str, plan: str, as_json: bool, gates: List[str]) -> None:
    if gates:
        raise _BadInput(f"--plan compares two traces; {', '.join(gates)} gate(s) one trace: run them separately")
    c = _read(f"{source} or {plan}", lambda: _compare.compare(source, plan))
    click.echo(json.dumps(_compare.as_json(c), indent=2) if as_json else _compare.render(c))


if __name__ == "__main__":
    main()
