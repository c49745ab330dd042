"""What a figure measured in interleaved rounds says, read against the rounds' spread.

The launchers and the benchmarks time their modes round by round (`launch.measure.rounds`) and know each figure's
spread (the rounds' interquartile range over their median). From the figures alone, these decide what a table may
call a result:

- a mode's speedup over serial (`judge`, written by `mark`): ``same schedule`` where the mode runs serial's
  schedule (`overlaps_nothing`: one batch, nothing beside its exchanges), ``noise`` where the difference is within
  the spread or where nothing could overlap (one rank: no communication), ``speedup`` / ``slowdown`` only beyond
  the spread, ``one round`` where there is no spread to judge by;
- a target ``value <= limit`` (`verdict`): met, missed, or inconclusive where the spread covers the margin;
- a cost that cannot be negative, such as an overhead (`cost`): its figure only beyond the noise, else in words.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from microbatch import Operation, Schedule
from overlap import DEFAULT, EP_COMM

# what a mode's speedup over serial is (`judge`)
REFERENCE = "reference"  # serial itself
SAME = "same schedule"  # runs serial's schedule: any difference is noise, or the cost of what it does beside it
NOISE = "noise"  # within the rounds' spread, or nothing to overlap (one rank)
SPEEDUP = "speedup"
SLOWDOWN = "slowdown"
UNJUDGED = "one round"  # no spread to judge by
# a target's verdict (`verdict`)
MET, MISSED, INCONCLUSIVE = "met", "missed", "inconclusive (noise)"
# a cost that is not a figure (`cost`)
BELOW_NOISE, NONE_MEASURED = "below the noise", "none measured"


def judge(ratio: float, noise: Optional[float], *, same: bool = False, alone: bool = False) -> str:
    """What a mode's speedup over serial (``ratio``: serial's time over the mode's) is.

    ``noise``: the rounds' spread the difference is read against (the larger of the two modes'; None with one
    round); ``same``: the mode runs serial's schedule; ``alone``: one rank, so no communication to overlap.
    """
    if same:
        return SAME
    if alone:
        return NOISE
    if noise is None:
        return UNJUDGED
    if abs(ratio - 1.0) <= noise:
        return NOISE
    return SPEEDUP if ratio > 1.0 else SLOWDOWN


def mark(ratio: Optional[float], label: Optional[str]) -> str:
    """A speedup as a table's column writes it: ``1.23x`` beyond the spread (or serial's own ``1.00x``),
    ``1.23x~`` noise, ``1.23x?`` one round, ``=serial`` serial's schedule, ``-`` none."""
    if ratio is None:
        return "-"
    if label == SAME:
        return "=serial"
    return f"{ratio:.2f}x" + {NOISE: "~", UNJUDGED: "?"}.get(label or "", "")


@dataclasses.dataclass(frozen=True)
class Compared:
    """A mode's speedup over serial as a table's notes read it."""

    name: str  # the mode's (or the run's) name in the table
    ratio: float  # serial's time over the mode's
    noise: Optional[float]  # the spread it was judged against (None: one round)
    label: str  # `judge`'s
    serial_schedule: Optional[str] = None  # why it runs serial's schedule, in words
    alone: bool = False  # one rank: no communication


def speedup_notes(compared: Sequence[Compared], rounds: int, more: str) -> List[str]:
    """The lines under a table that say what its speedups are, each marker's once: ``?`` (one round), ``=serial``
    (a line per mode, with the figure it measured), ``~`` (one rank; or within the rounds' spread, with ``more``,
    the option that runs more rounds)."""
    lines = []
    if rounds < 2:
        lines.append(f"?: one timed round: no spread to tell a difference from noise; run {more} or more")
    for c in compared:
        if c.label == SAME:
            lines.append(f"=serial: {c.name} runs serial's schedule ({c.serial_schedule}): {_same_figure(c)}")
    if any(c.alone and c.label != SAME for c in compared):
        lines.append("~: one rank: no communication to overlap, so no difference from serial is a speedup")
    noisy = [c for c in compared if c.label == NOISE and not c.alone]
    if noisy:
        lines.append(f"~: {', '.join(c.name for c in noisy)}: the difference from serial is within the rounds' "
                     f"spread ({max(c.noise or 0.0 for c in noisy):.0%}): noise, not a speedup; rerun with more "
                     f"rounds ({more}) or on a quieter host")
    return lines


def _same_figure(c: Compared) -> str:
    """What a mode that runs serial's schedule measured, in words: noise, or slower than serial beyond the spread
    (the cost of what it does beside that schedule)."""
    if c.noise is not None and not c.alone and c.ratio < 1.0 - c.noise:
        return (f"{c.ratio:.2f}x, slower than serial beyond the rounds' spread ({c.noise:.0%}): what it does beside "
                f"that schedule costs this much")
    return f"its {c.ratio:.2f}x is noise"


def verdict(value: float, limit: float, noise: Optional[float]) -> str:
    """A target ``value <= limit``, ``noise`` in the value's units (None: one round): met where the value is
    below the limit by more than the noise, missed where above it by more, else inconclusive."""
    if noise is None:
        return INCONCLUSIVE
    if value + noise <= limit:
        return MET
    if value - noise > limit:
        return MISSED
    return INCONCLUSIVE


def cost(value: float, noise: Optional[float], fmt: Callable[[float], str]) -> str:
    """A cost that cannot be negative (an overhead, the time a step adds), ``noise`` in its units: ``fmt(value)``
    beyond the noise (or, with one round, where it is positive), "below the noise" within it, "none measured"
    where it came out negative beyond it (the host's noise, not a gain)."""
    if noise is None:
        return fmt(value) if value > 0 else NONE_MEASURED
    if abs(value) <= noise:
        return BELOW_NOISE
    return fmt(value) if value > 0 else NONE_MEASURED


def overlaps_nothing(schedule: Schedule, layers: Sequence[Sequence[Operation]]) -> bool:
    """Whether ``schedule`` runs serial's schedule in effect: one micro-batch, all compute on the main stream, and
    each main-stream launch after an exchange waiting for every exchange still in flight (it reads their outputs,
    directly or through another exchange), so nothing ever runs beside communication.

    ``shared`` on a model with no shared experts is such a schedule; a launch on another stream, a second
    micro-batch or compute issued under an exchange (the chunked MoE's next chunk) is not.
    """
    ops: Dict[Tuple[int, str], Operation] = {(li, op.name): op for li, layer in enumerate(layers) for op in layer}
    writer: Dict[Tuple[int, str], int] = {}  # (layer, value) -> the launch that wrote it
    waits_for: Dict[int, Set[int]] = {}  # per launch: the exchanges it waits for, directly or not
    in_flight: Set[int] = set()
    for i, launch in enumerate(schedule.launches):
        if launch.mb != 0 or launch.stream not in (DEFAULT, EP_COMM):
            return False
        op = ops[(launch.layer, launch.op)]
        waits: Set[int] = set()
        for name in op.reads:
            w = writer.get((launch.layer, name))
            if w is not None:
                waits |= waits_for[w] | ({w} if schedule.launches[w].stream == EP_COMM else set())
        waits_for[i] = waits
        for name in op.writes:
            writer[(launch.layer, name)] = i
        if launch.stream == EP_COMM:
            in_flight.add(i)
        elif not in_flight <= waits:
            return False
        else:
            in_flight = set()
    return True


__all__ = ["BELOW_NOISE", "Compared", "INCONCLUSIVE", "MET", "MISSED", "NOISE", "NONE_MEASURED", "REFERENCE", "SAME",
           "SLOWDOWN", "SPEEDUP", "UNJUDGED", "cost", "judge", "mark", "overlaps_nothing", "speedup_notes", "verdict"]
