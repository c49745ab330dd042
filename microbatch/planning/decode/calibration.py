"""A decode calibration: a measured table of step times per mode, and its predictions for a step.

A decode step's shapes come from a few numbers: the tokens per rank (one per active request), which the
exchange pads to a bucket, the micro-batches of the mode, and how long the requests' histories are (what
attention reads). So its calibration is a table, not a fit of operations: every candidate mode's step time
measured (`launch.engine.calibrate_decode`) at each bucket of tokens per rank from 1 to the batch and
at two history lengths, the modes interleaved, each entry the median of its repeats and the largest over the
ranks (every rank holds the same table, so every rank predicts and chooses alike), with that median's noise
(`relative_error`).

`DecodeCalibration.predict` reads the table: linear in the tokens between the two buckets around them and
linear in the history between (or beyond) the two measured lengths. A table of captured steps (``padded``:
each step padded to its bucket, `launch.engine.graph_decoder`) costs a step what the first measured point at or above
its tokens costs: its time is a step function of the bucket, and the points are where the buckets end.
`DecodeCalibration.from_dict` checks what a cache file holds (`DecodeCalibrationError`). Pure Python: no
collective, no tensor.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

SERIAL = "serial"  # the reference mode, which every decode calibration measures
MAX_STEP_S = 3600.0  # the longest step time an entry may hold: more is a bad edit (NaN, inf, 1e308), no measurement


class DecodeCalibrationError(ValueError):
    """A table that does not describe a calibration (a cache file from another version, a bad hand edit)."""


@dataclasses.dataclass(frozen=True)
class DecodeCalibration:
    """Step seconds per mode at each ``tokens`` (per rank) and each of two ``histories`` (rows per request):
    ``seconds[mode][i][j]`` at ``tokens[i]``, ``histories[j]``; ``noise``, where measured, the relative standard
    error of each of those medians (`relative_error`), in the same layout; ``padded``: steps padded to their bucket
    and captured (`launch.engine.GraphDecoder`), read as a step function of the tokens (`predict`)."""

    tokens: Tuple[int, ...]
    histories: Tuple[int, int]
    seconds: Mapping[str, Tuple[Tuple[float, float], ...]]
    noise: Optional[Mapping[str, Tuple[Tuple[float, float], ...]]] = None
    padded: bool = False

    def __post_init__(self) -> None:
        if not self.tokens or list(self.tokens) != sorted(set(self.tokens)) or self.tokens[0] < 1:
            raise DecodeCalibrationError(f"tokens must be increasing counts >= 1, got {list(self.tokens)}")
        if len(self.histories) != 2 or not 0 <= self.histories[0] < self.histories[1]:
            raise DecodeCalibrationError(f"histories must be two increasing lengths, got {list(self.histories)}")
        if SERIAL not in self.seconds:
            raise DecodeCalibrationError(f"a decode calibration measures serial, the reference; it has "
                                         f"{', '.join(self.seconds) or 'no mode'}")
        for mode, rows in self.seconds.items():
            if len(rows) != len(self.tokens) or any(len(r) != 2 or not all(0 < x <= MAX_STEP_S for x in r)
                                                    for r in rows):
                raise DecodeCalibrationError(f"mode {mode}: need two positive times (at most {MAX_STEP_S:g} s, "
                                             f"finite) for each of {len(self.tokens)} token counts")
        if self.noise is not None:
            for mode in self.seconds:
                rows = self.noise.get(mode, ())
                if len(rows) != len(self.tokens) or any(len(r) != 2 or not all(0 <= x < math.inf for x in r)
                                                        for r in rows):
                    raise DecodeCalibrationError(f"mode {mode}: need two noise figures >= 0 for each of "
                                                 f"{len(self.tokens)} token counts")

    @property
    def modes(self) -> Tuple[str, ...]:
        return tuple(self.seconds)

    def predict(self, mode: str, tokens: int, history: float) -> float:
        """Predicted seconds of a step of ``mode`` with ``tokens`` per rank (the widest rank's) and requests of
        ``history`` rows (the longest): linear between the measured points, the end segments extended; in a
        ``padded`` table the first point at or above ``tokens`` (the last beyond): its step pads to the same
        bucket."""
        h0, h1 = self.histories
        # attention only grows with the history: a shorter time at the longer one is noise, read as no growth
        at = [r[0] + (r[1] - r[0]) * (history - h0) / (h1 - h0) if r[1] >= r[0] else (r[0] + r[1]) / 2
              for r in self.seconds[mode]]
        if self.padded:
            return max(1e-9, at[_at_or_above(self.tokens, tokens)])
        if len(at) == 1:
            return max(1e-9, at[0])
        i = min(_segment(self.tokens, tokens), len(at) - 2)
        t0, t1 = self.tokens[i], self.tokens[i + 1]
        return max(1e-9, at[i] + (at[i + 1] - at[i]) * (tokens - t0) / (t1 - t0))

    def noise_at(self, mode: str, tokens: int) -> float:
        """The relative standard error of ``mode``'s prediction for ``tokens`` per rank: the largest of the entries
        it reads (both histories'); 0 where the table has no noise figures."""
        if self.noise is None:
            return 0.0
        rows = self.noise[mode]
        if self.padded:
            return max(rows[_at_or_above(self.tokens, tokens)])
        i = min(_segment(self.tokens, tokens), max(len(rows) - 2, 0))
        return max(max(r) for r in rows[i:i + 2])

    def to_dict(self) -> Dict[str, Any]:
        out = {"tokens": list(self.tokens), "histories": list(self.histories),
               "seconds": {m: [list(r) for r in rows] for m, rows in self.seconds.items()}}
        if self.noise is not None:
            out["noise"] = {m: [list(r) for r in rows] for m, rows in self.noise.items()}
        if self.padded:
            out["padded"] = True
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DecodeCalibration":
        try:
            noise = data.get("noise")
            padded = data.get("padded", False)
            if not isinstance(padded, bool):
                raise DecodeCalibrationError(f"padded must be true or false, got {padded!r}")
            return cls(tuple(int(t) for t in data["tokens"]), tuple(int(h) for h in data["histories"]),
                       _table(data["seconds"]), None if noise is None else _table(noise), padded)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as exc:
            if isinstance(exc, DecodeCalibrationError):
                raise
            raise DecodeCalibrationError(f"not a decode calibration: {exc!r}") from None

    def format(self) -> str:
        """The table: a row per token count, a column per mode (ms, at the shorter / longer history), and the range
        of the entries' noise."""
        head = f"{'tokens':>6}  " + "  ".join(f"{m:>17}" for m in self.modes)
        what = "captured decode steps (padded to their buckets)" if self.padded else "decode calibration"
        lines = [f"{what}, ms at histories {self.histories[0]} / {self.histories[1]}", head]
        for i, t in enumerate(self.tokens):
            cells = [f"{r[i][0] * 1e3:8.2f}/{r[i][1] * 1e3:8.2f}" for r in self.seconds.values()]
            lines.append(f"{t:>6}  " + "  ".join(f"{c:>17}" for c in cells))
        if self.noise is not None:
            every = [x for rows in self.noise.values() for r in rows for x in r]
            lines.append(f"noise (relative standard error of an entry's median): {min(every):.1%} to {max(every):.1%}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return json.dumps(self.to_dict())


def _table(data: Mapping[str, Any]) -> Dict[str, Tuple[Tuple[float, float], ...]]:
    return {str(m): tuple((float(r[0]), float(r[1])) for r in rows) for m, rows in data.items()}


def relative_error(samples: Sequence[float]) -> float:
    """The relative standard error of the median of ``samples``: about 1.25 standard errors of a mean, the
    standard deviation read from the interquartile range (robust to the stray slow step a shared host throws),
    over the median; 0 for fewer than two samples."""
    if len(samples) < 2:
        return 0.0
    q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return 1.25 * (q3 - q1) / 1.349 / median / math.sqrt(len(samples)) if median > 0 else 0.0


def _at_or_above(points: Sequence[int], x: float) -> int:
    """The index of the first of ``points`` at or above ``x`` (the last where none is)."""
    return next((i for i, p in enumerate(points) if p >= x), len(points) - 1)


def _segment(points: Sequence[int], x: float) -> int:
    """The index ``i`` of the segment ``points[i] <= x < points[i + 1]`` (0 below the first, the last above)."""
    i = 0
    while i + 1 < len(points) and points[i + 1] <= x:
        i += 1
    return i


__all__ = ["SERIAL", "DecodeCalibration", "DecodeCalibrationError", "relative_error"]
