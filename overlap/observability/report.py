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

With ``--points`` it prints instead one row per parallel point (`overlap.observability._points`): the side
window, the dominator's, ``overlap_pct = overlap / min(side, dominator)`` with the verdict (real >= 0.5, false
<= 0.05, partial between) and, for a false or partial point, the barrier. On this toolkit's traces the points
are the schedule's; on any trace ``--point NAME SIDE_REGEX DOMINATOR_REGEX`` (repeatable) or ``--points-file``
names them, with the median and worst per point; with ``kernel_details.csv``, the peak ``Block Dim`` summed over
streams against ``--cores`` and the ``EVENT_WAIT`` gaps after a join longer than ``--wait-gap-us``.
``--min-point-overlap F`` fails naming each point whose overlap_pct (median of its occurrences) is below F.

Exit status: 0 fine, 1 below ``--min-overlap`` / ``--min-hidden`` / ``--min-point-overlap``, 2 unreadable input
or bad options.
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import click

from . import _compare, _points
from ._intervals import ISSUE, REAL_OVERLAP, SERIALIZED, Metrics, compute_metrics, verdict
from ._operations import RankOperations, operation_figures
from ._traces import Trace, TraceError, load, named_tasks

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
@click.option("--points", "by_point", is_flag=True,
              help="Report per parallel point instead: side and dominator windows, overlap_pct, verdict, barrier.")
@click.option("--point", "point_args", nargs=3, multiple=True, metavar="NAME SIDE_REGEX DOMINATOR_REGEX",
              help="With --points: a point named by patterns of its side operations and its dominator (repeatable).")
@click.option("--points-file", type=click.Path(), default=None,
              help="With --points: points from a file, one 'NAME SIDE_REGEX DOMINATOR_REGEX' a line.")
@click.option("--cores", default=None, metavar="N|PLATFORM_INI",
              help="With --points: the AI core count (or CANN's platform ini with ai_core_cnt) Block Dim is held to.")
@click.option("--wait-gap-us", type=click.FloatRange(min=0), default=None, callback=_not_nan,
              help=f"With --points: name an EVENT_WAIT after a join longer than this "
                   f"(default {_points.DEFAULT_WAIT_GAP_US:g} us).")
@click.option("--min-point-overlap", type=click.FloatRange(0, 1), default=None, callback=_not_nan,
              help="With --points: fail (exit 1) naming each point whose overlap_pct is below this.")
def main(source: str, min_overlap: Optional[float], pair: Optional[Tuple[str, str]], min_hidden: Optional[float],
         as_json: bool, plan: Optional[str], by_point: bool, point_args: Tuple[Tuple[str, str, str], ...],
         points_file: Optional[str], cores: Optional[str], wait_gap_us: Optional[float],
         min_point_overlap: Optional[float]) -> None:
    """Report per-stream busy time and overlap of the trace at SOURCE (or compare it with --plan, or per point)."""
    _refuse_mixed(by_point, {"--point": point_args or None, "--points-file": points_file, "--cores": cores,
                             "--wait-gap-us": wait_gap_us, "--min-point-overlap": min_point_overlap},
                  {"--plan": plan, "--min-overlap": min_overlap, "--pair": pair, "--min-hidden": min_hidden})
    if by_point:
        _report_points(source, as_json, point_args, points_file, cores, wait_gap_us, min_point_overlap)
        return
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


# ---- --points ----

def _refuse_mixed(by_point: bool, point_options: Dict[str, Any], stream_options: Dict[str, Any]) -> None:
    """`_BadInput` for a point option without ``--points``, or ``--points`` with an option of the whole trace."""
    given = [o for o, v in (stream_options if by_point else point_options).items() if v is not None]
    if given and by_point:
        raise _BadInput(f"--points reports per point; {', '.join(given)} read(s) the streams as a whole: "
                        f"run them separately")
    if given:
        raise _BadInput(f"{', '.join(given)}: only used with --points, which is not given")

def _specs(point_args: Sequence[Tuple[str, str, str]], points_file: Optional[str]) -> List[_points.PointSpec]:
    try:
        specs = [_points.parse_spec(*a) for a in point_args]
        if points_file is not None:
            specs += _points.read_specs(points_file, _read_points_file(points_file))
    except ValueError as e:
        raise _BadInput(str(e)) from None
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise _BadInput(f"--point {twice[0]}: named twice; give each point its own NAME")
    return specs


def _read_points_file(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise _BadInput(f"--points-file {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


def _us(window: Optional[Tuple[float, float]]) -> str:
    return "-" if window is None else f"[{window[0] * 1e6:.2f}, {window[1] * 1e6:.2f}] us"


def _occurrence_line(o: _points.Occurrence, cores: Optional[int], width: int) -> str:
    pct = o.overlap_pct
    line = (f"  point {o.point:<{width}} side {_us(o.side)}  dominator {o.dominator or '(none)'} {_us(o.dominator_window)}"
            f"  overlap_pct {'-' if pct is None else f'{pct:.2f}'}  {o.verdict}")
    if o.barrier is not None and o.verdict in (_points.FALSE, _points.PARTIAL):
        line += f"  barrier: {o.barrier}"
    if o.blocks is not None:
        total, running = o.blocks
        over = cores is not None and total > cores
        line += (f"  Block Dim peak {total:g}" + (f"/{cores}" if cores is not None else "")
                 + (f" OVER-SUBSCRIBED ({'; '.join(running)})" if over else ""))
    for wait in o.waits:
        line += f"  after the join: {wait}"
    return line


def render_points(source: str, occurrences: Sequence[_points.Occurrence], cores: Optional[int]) -> str:
    """The per-point report as text: a row per occurrence, then median and worst of points seen more than once."""
    lines = [f"{source}: parallel points (overlap_pct = overlap / min(side, dominator); "
             f"real >= {REAL_OVERLAP}, false <= {SERIALIZED})"]
    for process in sorted({o.process for o in occurrences}):
        lines.append(f"{process}:")
        mine = [o for o in occurrences if o.process == process]
        width = max(len(o.point) for o in mine)
        lines += [_occurrence_line(o, cores, width) for o in mine]
    for name, (n, median, worst) in _points.point_figures(occurrences).items():
        if n > 1:
            figures = "no dominator in any" if median is None else f"overlap_pct median {median:.2f}, worst {worst:.2f}"
            lines.append(f"point {name}: {n} occurrences, {figures}")
    if not occurrences:
        lines.append("no parallel point found")
    return "\n".join(lines)


def _points_json(source: str, occurrences: Sequence[_points.Occurrence], cores: Optional[int],
                 failures: List[str]) -> Dict[str, Any]:
    rows = [{"point": o.point, "process": o.process, "side_s": list(o.side), "dominator": o.dominator,
             "dominator_s": None if o.dominator_window is None else list(o.dominator_window),
             "overlap_pct": o.overlap_pct, "verdict": o.verdict, "barrier": o.barrier,
             "block_dim_peak": None if o.blocks is None else o.blocks[0],
             "over_subscribed": o.blocks is not None and cores is not None and o.blocks[0] > cores,
             "join_waits": o.waits} for o in occurrences]
    figures = {name: {"occurrences": n, "median": med, "worst": worst}
               for name, (n, med, worst) in _points.point_figures(occurrences).items()}
    return {"source": source, "cores": cores, "points": rows, "per_point": figures, "failures": failures}


def _report_points(source: str, as_json: bool, point_args: Sequence[Tuple[str, str, str]],
                   points_file: Optional[str], cores_text: Optional[str], wait_gap_us: Optional[float],
                   floor: Optional[float]) -> None:
    specs = _specs(point_args, points_file)
    try:
        cores = None if cores_text is None else _points.cores_from(cores_text)
    except ValueError as e:
        raise _BadInput(str(e)) from None
    whose, tasks = _read(source, lambda: named_tasks(source))
    if not specs and whose != "toolkit":
        raise _BadInput(f"{source}: a profiler's trace does not name its parallel points: give them with --point "
                        f"NAME SIDE_REGEX DOMINATOR_REGEX or --points-file")
    gap = _points.DEFAULT_WAIT_GAP_US if wait_gap_us is None else wait_gap_us
    occurrences = _points.spec_points(tasks, specs, gap) if specs else _points.toolkit_points(tasks)
    failures = [] if floor is None else _points.gate_points(occurrences, specs, floor)
    if as_json:
        click.echo(json.dumps(_points_json(source, occurrences, cores, failures), indent=2))
    else:
        click.echo(render_points(source, occurrences, cores))
        for f in failures:
            click.echo(f"FAIL: {f}", err=True)
    if failures:
        click.get_current_context().exit(EXIT_BELOW)


if __name__ == "__main__":
    main()
