"""The decode benchmark's table and its targets (issue 29), from the points `launch.bench.decode` measured.

A point is what `launch.bench.decode` measured at one batch size and link, a dict: ``tokens`` per rank, ``link``
(GB/s), ``comm_share`` (communication's share of a serial step), ``rows`` (per mode: median TPOT in seconds and its
spread), ``noise``, ``predicted``, ``executor_s``, ``chosen`` and the guard's summary, and at the ceiling's batch
size ``unlinked`` (per mode, TPOT with no link at all, serial's at the point's link; `ceilings`). Each target is
``(what, met, figures)``, met None where no point could judge it.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from microbatch import AUTO

SERIAL = "serial"
TARGET_TOKENS, TARGET_SHARE, TARGET_SPEEDUP = 256, 0.30, 1.15  # issue 29: overlap pays where comm is large
HOST_TOKENS, TARGET_HOST = 32, 0.10  # the executor's own host time per decode step, against TPOT


def speedups(point: Dict[str, Any]) -> Dict[str, float]:
    """Each mode's speedup at a point: serial's TPOT over the mode's."""
    serial = point["rows"][SERIAL][0]
    return {m: serial / row[0] for m, row in point["rows"].items()}


def best_mode(point: Dict[str, Any]) -> str:
    """The fixed mode with the smallest TPOT at a point (auto is judged against it)."""
    return min((m for m in point["rows"] if m != AUTO), key=lambda m: point["rows"][m][0])


def ceilings(point: Dict[str, Any]) -> Dict[str, float]:
    """Per overlapped fixed mode, the most it could reach at a point: serial's TPOT at the point's link over the
    mode's with no link at all, measured side by side (``unlinked``); empty where the point has no such figures.
    Hiding every byte of the link still leaves a split's own cost (more launches, exchanges and weight reads)."""
    unlinked = point.get("unlinked") or {}
    if SERIAL not in unlinked:
        return {}
    return {m: unlinked[SERIAL] / t for m, t in unlinked.items() if m != SERIAL}


def _ceiling_text(point: Dict[str, Any]) -> str:
    ups = ceilings(point)
    if not ups:
        return ""
    best = max(ups, key=lambda m: ups[m])
    return f"; at most {ups[best]:.2f}x ({best}) with no link at all"


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.0%}"


def table(points: Sequence[Dict[str, Any]]) -> str:
    """One link's points as an aligned text table: a row per batch size."""
    modes = list(points[0]["rows"])
    auto = AUTO in modes
    head = (["tokens/rank", "link GB/s", "comm/serial"] + [f"{m} ms" for m in modes]
            + [f"{m} x" for m in modes if m != SERIAL] + ["best", "spread", "rounds x steps", "executor/TPOT"]
            + (["auto chose", "auto as chosen x", "predicted x (error)"] if auto else []))
    body = []
    for p in points:
        ups = speedups(p)
        spreads = [row[1] for row in p["rows"].values() if row[1] is not None]
        row = ([str(p["tokens"]), f"{p['link']:g}", _pct(p["comm_share"])]
               + [f"{p['rows'][m][0] * 1e3:.2f}" for m in modes]
               + [f"{ups[m]:.2f}x" for m in modes if m != SERIAL]
               + [best_mode(p), _pct(max(spreads, default=None)), f"{p['rounds']} x {p['steps']}",
                  _pct(executor_share(p))])
        if auto:
            total = sum((p.get("chosen") or {}).values()) or 1
            chose = ", ".join(f"{m} {n / total:.0%}" for m, n in sorted((p.get("chosen") or {}).items(),
                                                                        key=lambda kv: -kv[1]))
            mode, seconds = auto_as_fixed(p)
            pred = p.get("predicted") or {}
            errs = prediction_errors(p)
            row += [chose or "-", f"{p['rows'][SERIAL][0] / seconds:.2f}x" + (f" ({mode})" if mode else ""),
                    " ".join(f"{m} {pred[SERIAL] / pred[m]:.2f}x ({errs[m]:+.0%})" for m in errs) or "-"]
        body.append(row)
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join(fmt.format(*row).rstrip() for row in [head, ["-" * w for w in widths]] + body)


Target = Tuple[str, Optional[bool], str]  # what, met (None: not checked), the figures behind it


def target_overlap_pays(points: Sequence[Dict[str, Any]]) -> Target:
    """The best overlapped mode at least 1.15x serial at every 256-token point whose comm share is at least 30%."""
    what = (f"best overlapped mode >= {TARGET_SPEEDUP:.2f}x serial at {TARGET_TOKENS} tokens/rank where comm >= "
            f"{TARGET_SHARE:.0%}")
    found = []
    for p in points:
        if p["tokens"] != TARGET_TOKENS or p["comm_share"] is None or p["comm_share"] < TARGET_SHARE:
            continue
        ups = {m: s for m, s in speedups(p).items() if m not in (SERIAL, AUTO)}  # the fixed overlapped modes
        if ups:
            mode = max(ups, key=lambda m: ups[m])
            found.append((ups[mode], f"{mode} {ups[mode]:.2f}x at {p['link']:g} GB/s (comm {_pct(p['comm_share'])}"
                                     f"{_ceiling_text(p)})"))
    if not found:
        return what, None, f"no point at {TARGET_TOKENS} tokens/rank with comm >= {TARGET_SHARE:.0%}"
    return what, all(s >= TARGET_SPEEDUP for s, _ in found), "; ".join(text for _, text in found)


MIXED = "mixed"  # auto's label where its steps ran in more than one mode


def auto_as_fixed(point: Dict[str, Any]) -> Tuple[Optional[str], Optional[float]]:
    """Auto's TPOT at a point as the fixed modes that ran its schedule measured it: each of its steps costed at the
    TPOT of the fixed mode it chose (its own row is a second, independent sample of those schedules), plus its own
    host time per step for choosing (``choosing_s``). ``(the mode, or "mixed", seconds)``; auto's own row,
    ``(None, seconds)``, where it chose a mode the point did not measure."""
    if AUTO not in point["rows"]:
        return None, None
    chosen = point.get("chosen") or {}  # steps per mode (a Counter's: none at 0)
    if not chosen or any(m not in point["rows"] for m in chosen):
        return None, point["rows"][AUTO][0]
    steps = sum(chosen.values())
    seconds = sum(point["rows"][m][0] * n for m, n in chosen.items()) / steps + point.get("choosing_s", 0.0)
    return (next(iter(chosen)) if len(chosen) == 1 else MIXED), seconds


def executor_share(point: Dict[str, Any]) -> Optional[float]:
    """The executor's own host time in a serial decode step over serial's TPOT at a point."""
    host = point.get("executor_s")
    return None if host is None else host / point["rows"][SERIAL][0]


def target_host(points: Sequence[Dict[str, Any]]) -> Target:
    """The executor's host time per decode step at most 10% of the time per output token at 32 tokens per rank."""
    what = f"executor's host time per decode step <= {TARGET_HOST:.0%} of TPOT at {HOST_TOKENS} tokens/rank"
    found = [(executor_share(p), p) for p in points if p["tokens"] == HOST_TOKENS and executor_share(p) is not None]
    if not found:
        return what, None, f"no point at {HOST_TOKENS} tokens/rank"
    return what, all(sh <= TARGET_HOST for sh, _ in found), "; ".join(
        f"{sh:.1%} ({p['executor_s'] * 1e3:.2f} of {p['rows'][SERIAL][0] * 1e3:.1f} ms) at {p['link']:g} GB/s"
        for sh, p in found)


def target_auto(points: Sequence[Dict[str, Any]]) -> Target:
    """Auto (as the fixed modes it ran measured it, `auto_as_fixed`) within 5% of the best fixed mode and at most 2%
    above serial at every point. A miss is named with the standard error of its comparison (from the steps' spread,
    ``noise`` per mode), and the detail counts the misses by more than two of them: the others the benchmark's own
    noise could make."""
    what = "auto within 5% of the best fixed mode and <= 2% above serial at every point"
    judged = []
    for p in points:
        mode, auto = auto_as_fixed(p)
        if auto is None:
            continue
        fixed = {m: row[0] for m, row in p["rows"].items() if m != AUTO}
        best = min(fixed, key=fixed.get)
        noise = p.get("noise") or {}
        costed = list(p.get("chosen") or ()) if mode is not None else [AUTO]  # the rows auto's TPOT was read from
        mine = max(noise.get(m, 0.0) for m in costed)
        misses = [(auto / fixed[ref] - 1.0 - allowed, math.hypot(mine, noise.get(ref, 0.0)))
                  for ref, allowed in ((best, 0.05), (SERIAL, 0.02)) if auto > fixed[ref] * (1.0 + allowed)]
        se = max((e for _, e in misses), default=0.0)
        label = "" if mode is None else " as its modes" if mode == MIXED else f" as {mode}"
        judged.append((not misses, any(by > 2 * e for by, e in misses),
                       f"{p['tokens']} @ {p['link']:g}: auto{label} {fixed[SERIAL] / auto:.2f}x, best {best} "
                       f"{fixed[SERIAL] / fixed[best]:.2f}x" + (f" (±{se:.1%})" if misses and se else "")))
    if not judged:
        return what, None, "no auto row"
    missed = [text for ok, _, text in judged if not ok]
    beyond = sum(clear for ok, clear, _ in judged if not ok)
    return what, not missed, (f"missed at {len(missed)} of {len(judged)} points, {beyond} of them by more than two "
                              f"standard errors of the measurement (±): " + "; ".join(missed)) if missed \
        else f"{len(judged)} points"


def prediction_errors(point: Dict[str, Any]) -> Dict[str, float]:
    """Per calibrated mode but serial: the predicted speedup relative to serial over the measured one, less 1."""
    pred, rows = point.get("predicted") or {}, point["rows"]
    if SERIAL not in pred:
        return {}
    return {m: (pred[SERIAL] / pred[m]) / (rows[SERIAL][0] / rows[m][0]) - 1.0
            for m in pred if m != SERIAL and m in rows}


def target_prediction(points: Sequence[Dict[str, Any]]) -> Target:
    """Predicted speedups relative to serial within 10% of the measured ones at 90% of the (point, mode) pairs."""
    what = "predicted speedup vs serial within 10% of the measured one at >= 90% of points"
    errors = [(p, m, e) for p in points for m, e in prediction_errors(p).items()]
    if not errors:
        return what, None, "no prediction (no auto mode, so no calibration)"
    good = sum(abs(e) <= 0.10 for _, _, e in errors)
    worst = max(errors, key=lambda x: abs(x[2]))
    return what, good >= 0.9 * len(errors), (f"{good} of {len(errors)} within 10%; worst {worst[1]} at "
                                             f"{worst[0]['tokens']} @ {worst[0]['link']:g} GB/s: {worst[2]:+.0%}")


TARGETS: Tuple[Callable[[Sequence[Dict[str, Any]]], Target], ...] = (target_overlap_pays, target_auto,
                                                                      target_prediction, target_host)


def report(points: Sequence[Dict[str, Any]]) -> str:
    """A table per link, what the figures are, then a line per target."""
    lines = []
    for gbps in dict.fromkeys(p["link"] for p in points):
        lines += [f"\nlink {gbps:g} GB/s", table([p for p in points if p["link"] == gbps])]
        lines += [f"  auto at {p['tokens']} tokens/rank, {p['guard']}" for p in points
                  if p["link"] == gbps and p.get("vetoed")]
        lines += [f"  at {p['tokens']} tokens/rank with no link at all (serial at {gbps:g} GB/s beside them): "
                  + ", ".join(f"{m} {x:.2f}x" for m, x in ceilings(p).items())
                  + ": the most each could reach here, hiding the whole link" for p in points
                  if p["link"] == gbps and ceilings(p)]
    lines.append("\ncomm/serial: communication's share of a serial decode step; ms: TPOT, the median "
                 "decode-step time (slowest rank); x: serial's TPOT over the mode's; spread: the largest of the "
                 "modes' interquartile range of step times over their median; rounds x steps: timed rounds per mode "
                 "x decode steps per round, the modes interleaved round by round; executor/TPOT: the executor's own "
                 "host time in a serial decode step (its run less its operations' time) over serial's TPOT"
                 + ("; auto as chosen x: serial's TPOT over auto's steps each costed at the TPOT of the fixed mode "
                    "it chose, plus its host time per step for choosing (mixed: more than one mode)"
                    if any(AUTO in p["rows"] for p in points) else ""))
    lines.append("\ntargets:")
    for target in TARGETS:
        what, met, detail = target(points)
        verdict = "not checked" if met is None else "met" if met else "MISSED"
        lines.append(f"  {what}: {verdict} ({detail})")
    return "\n".join(lines)
