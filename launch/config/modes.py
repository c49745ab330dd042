"""The schedule modes the launchers take: the names ``--mode`` and ``--decode-mode`` accept, how a
comma-separated list of them is parsed (`split_modes`, the click type `ModeList`) and resolved into the modes
that run (`resolve_modes`), and decode's candidates and exchanges."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import click

import microbatch
from collectives import DECODE_EXCHANGES  # --decode-exchange: the decode exchanges' names
from launch.engine import DECODE_AUTO_MODES, DECODE_CALIBRATION_ROUNDS  # --decode-auto-modes' and its rounds' defaults
from microbatch import AUTO  # --mode auto, --decode-mode auto: the planner's choice

__all__ = ["ALL_MODES", "AUTO", "DECODE_AUTO_MODES", "DECODE_CALIBRATION_ROUNDS", "DECODE_EXCHANGES",
           "DECODE_MODE_NAMES", "MODE_NAMES", "ModeList", "resolve_modes", "split_modes"]

ALL_MODES = tuple(name for name, m in microbatch.MODES.items() if m.in_all)
MODE_NAMES = tuple(microbatch.MODES) + ("all", AUTO)  # what --mode takes, in a comma-separated list
DECODE_MODE_NAMES = tuple(microbatch.DECODE_MODES) + ("all", AUTO)  # what --decode-mode takes


class ModeList(click.ParamType):
    """``--mode``: a comma-separated list of modes (``serial,three-batch``), as a tuple of names; ``names``: the
    valid ones (`DECODE_MODE_NAMES` for ``--decode-mode``)."""

    name = "mode list"

    def __init__(self, names: Sequence[str] = MODE_NAMES):
        self.names = tuple(names)

    def get_metavar(self, param: click.Parameter, ctx: Optional[click.Context] = None) -> str:
        return "MODE[,MODE...]"

    def convert(self, value: Union[str, Tuple[str, ...]], param: Optional[click.Parameter],
                ctx: Optional[click.Context]) -> Tuple[str, ...]:
        if isinstance(value, tuple):
            return value
        try:
            return split_modes(str(value), self.names)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def split_modes(text: str, valid: Sequence[str] = MODE_NAMES) -> Tuple[str, ...]:
    """The mode names of one comma-separated ``--mode`` value; ValueError naming an unknown one."""
    names = tuple(n.strip() for n in text.split(","))
    for n in names:
        if n not in valid:
            what = f"unknown mode {n!r}" if n else f"an empty mode name in {text!r}"
            hint = " (a decode mode: give it to --decode-mode)" if n in DECODE_MODE_NAMES else ""
            raise ValueError(f"{what}{hint} (valid: {', '.join(valid)}; a comma-separated list)")
    return names


def resolve_modes(asked: Sequence[str], check: bool) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """``(modes to run, modes asked for)``: ``all`` expanded, repeats dropped, order kept; serial put first
    when ``--check`` or ``auto`` needs it as the reference and the list leaves it out."""
    expanded: List[str] = []
    for name in asked:
        for m in (ALL_MODES if name == "all" else (name,)):
            if m not in expanded:
                expanded.append(m)
    needs_serial = check or AUTO in expanded
    run = tuple(expanded) if "serial" in expanded or not needs_serial else ("serial",) + tuple(expanded)
    return run, tuple(expanded)
