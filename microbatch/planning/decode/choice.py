"""Choosing a decode step's mode: the fastest the calibration predicts, serial unless another is clearly faster.

`choose_decode` predicts every candidate for a step (the widest rank's tokens, the longest history) from a
`DecodeCalibration` and keeps serial unless another mode is predicted faster by at least ``margin`` and by at
least ``confidence`` standard errors of the two medians (each entry's ``noise``, measured with it): a wrong
choice between modes that close costs little, one against serial is what users see, and a gain the
calibration's own noise could make up is no gain. Pure Python: no collective, no tensor.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional, Sequence

from .calibration import SERIAL, DecodeCalibration

# another mode is taken over serial where predicted at least 5% faster. A smaller margin would miss a faster mode
# less often, but its misses are losses against serial; a larger margin's are gains left. Measured on 2 CPU ranks
# (docs/measurements.md, "Auto's noise"), margins of 2% and 5% missed as often; 2%'s misses included a step mix 2%
# slower than serial
DEFAULT_MARGIN = 0.05
# ... and by this many standard errors of the two entries' medians: a predicted gain that the calibration's noise
# alone would show one time in 15 is not taken (on a shared 2-core host an entry of 16 steps carries 3-8% of noise)
DEFAULT_CONFIDENCE = 1.5


@dataclasses.dataclass(frozen=True)
class DecodeChoice:
    """A step's mode and every candidate's predicted seconds; ``probe``: serial run to measure it, where the
    calibration chose another mode (`microbatch.planning.decode.guard.DecodeGuard`)."""

    mode: str
    predicted: Mapping[str, float]
    probe: bool = False

    @property
    def seconds(self) -> float:
        return self.predicted[self.mode]


def choose_decode(cal: DecodeCalibration, tokens: int, history: float, modes: Optional[Sequence[str]] = None,
                  margin: float = DEFAULT_MARGIN, confidence: float = DEFAULT_CONFIDENCE) -> DecodeChoice:
    """The fastest predicted of ``modes`` (default: the calibrated ones) for a step of ``tokens`` per rank (the
    widest rank's) and ``history`` rows (the longest); serial unless another is faster by at least ``margin`` and
    by at least ``confidence`` standard errors of its and serial's predictions (`DecodeCalibration.noise_at`)."""
    names = list(modes or cal.modes)
    unknown = [m for m in names if m not in cal.seconds]
    if unknown:
        raise ValueError(f"mode {unknown[0]} was not calibrated (calibrated: {', '.join(cal.modes)})")
    predicted = {m: cal.predict(m, tokens, history) for m in names}
    if SERIAL in predicted:
        serial_noise = cal.noise_at(SERIAL, tokens)

        def clear(m: str) -> bool:
            needed = max(margin, confidence * math.hypot(cal.noise_at(m, tokens), serial_noise))
            return m == SERIAL or predicted[m] <= predicted[SERIAL] * (1.0 - needed)

        names = [m for m in names if clear(m)]
    best = min(names, key=lambda m: (predicted[m], names.index(m)))
    return DecodeChoice(best, predicted)


__all__ = ["DEFAULT_CONFIDENCE", "DEFAULT_MARGIN", "DecodeChoice", "choose_decode"]
