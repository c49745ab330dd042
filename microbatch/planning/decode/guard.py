"""Auto's check of its own choices: the decode steps it ran, measured against the calibration's predictions.

A decode calibration is measured once and cached, and the host, the link or what else runs beside the job can
change after. `DecodeGuard` keeps, per mode, the last steps' measured seconds over their predicted ones (how far
the calibration is off for that mode now). Where the calibration's choice, each prediction so corrected, comes
out slower than serial by more than the steps' own spread explains (``confidence`` standard errors of the
medians), the guard sets that mode aside for ``hold`` steps and runs serial instead; then it lets the mode be
tried again, judged afresh on ``min_samples`` new steps. So on a device, whose steps repeat within a few
percent, a mode a few percent slower than serial is set aside, and on a host whose steps spread by tens of
percent only a mode clearly slower is. Setting a mode aside is sticky, so noise in
the measurements does not flip the choice step by step, and the steps go to serial, not to the calibration's
next choice: a calibration found wrong once is not trusted for the runner-up. The guard only vetoes: a mode
the calibration does not choose is never run to find out whether it would be faster.

How it judges:
- The spread of a step's time is the host's, whatever the mode, so it is pooled: the standard deviation of the
  log ratios about each mode's mean, over every mode's kept steps. A mode judged on 3 steps borrows the others'
  to size its standard error, rather than trusting the spread of its own 3 (which comes out less than half the
  true one about one time in five).
- A mode is set aside only on serial's steps measured beside its own: from ``min_samples`` steps before its
  oldest kept step on. Where only older serial steps say it is slower (a host that slowed since them looks
  just like a slower mode), serial runs first, as a probe, until it has enough recent steps.
- To compare with serial it needs serial's steps: where the calibration chooses another mode, it runs serial (a
  probe) until serial has ``min_samples`` measured steps, once every ``probe_every`` steps after, and once
  every ``probe_every // 4`` while the verdict is not clear either way (within ``confidence`` standard errors
  of serial's speed). Measurements older than ``forget`` steps are dropped.

Pure Python: the caller times each step and records the slowest rank's time, so every rank's guard holds the
same figures and chooses alike.
"""
from __future__ import annotations

import collections
import math
import statistics
from typing import Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from .calibration import SERIAL, DecodeCalibration
from .choice import DEFAULT_MARGIN, DecodeChoice, choose_decode


_KEEP, _PROBE, _SLOWER = "keep", "probe", "slower"  # the guard's verdicts on the calibration's choice


class DecodeGuard:
    """Sets aside the overlapped modes that auto's own steps measured slower than serial (see the module docstring).

    ``window``: the steps per mode whose ratios are kept; ``min_samples``: the steps a mode (and serial) needs
    before it is judged; ``confidence``: how many standard errors below serial a mode's measured speedup must be
    to be set aside; ``hold``: the steps a mode is set aside for; ``probe_every``: steps between serial probes
    once serial has its samples (a quarter of it while the verdict is not clear); ``forget``: steps after which a
    measurement is dropped."""

    def __init__(self, *, window: int = 8, min_samples: int = 3, confidence: float = 1.5, hold: int = 64,
                 probe_every: int = 32, forget: int = 256):
        if not 1 <= min_samples <= window:
            raise ValueError(f"min_samples must be between 1 and window ({window}), got {min_samples}")
        if min(hold, probe_every, forget) < 1:
            raise ValueError(f"hold, probe_every and forget must be at least one step, got {hold}, {probe_every} "
                             f"and {forget}")
        if not (math.isfinite(confidence) and confidence >= 0):
            raise ValueError(f"confidence must be a number of standard errors >= 0, got {confidence}")
        self.window, self.min_samples, self.confidence, self.hold = window, min_samples, confidence, hold
        self.probe_every, self.forget = probe_every, forget
        self.steps = 0  # steps chosen
        self.probes = 0  # steps run in serial to measure it, where the calibration chose another mode
        self.vetoed: Dict[str, int] = {}  # by mode: steps where the calibration chose it and serial ran instead
        self._ratios: Dict[str, Deque[Tuple[int, float]]] = {}  # by mode: (step, log of measured / predicted seconds)
        self._held: Dict[str, int] = {}  # by mode set aside: the last step it is

    def choose(self, cal: DecodeCalibration, tokens: int, history: float, modes: Optional[Sequence[str]] = None,
               margin: float = DEFAULT_MARGIN) -> DecodeChoice:
        """`choose_decode`'s choice for the step, or serial where that mode is set aside (or is found slower than
        serial now, and set aside from this step) or where a probe is due (``probe=True`` in the choice)."""
        self.steps += 1
        self._drop_old()
        choice = choose_decode(cal, tokens, history, modes, margin)
        mode = choice.mode
        if mode == SERIAL or SERIAL not in choice.predicted:
            return choice
        verdict = _KEEP if mode in self._held else self._verdict(mode, choice.predicted)
        if verdict == _SLOWER:
            self._held[mode] = self.steps + self.hold - 1
        if mode in self._held:
            self.vetoed[mode] = self.vetoed.get(mode, 0) + 1
            return DecodeChoice(SERIAL, choice.predicted)
        if verdict == _PROBE:
            self.probes += 1
            return DecodeChoice(SERIAL, choice.predicted, probe=True)
        return choice

    def record(self, mode: str, predicted: float, measured: float) -> None:
        """A step of ``mode`` predicted to take ``predicted`` seconds took ``measured`` (the slowest rank's)."""
        if predicted > 0 and measured > 0:
            kept = self._ratios.setdefault(mode, collections.deque(maxlen=self.window))
            kept.append((self.steps, math.log(measured / predicted)))

    def speedup(self, mode: str, predicted: Mapping[str, float]) -> Optional[float]:
        """``mode``'s speedup over serial for a step of ``predicted`` seconds per mode, each prediction corrected
        by its mode's measured ratio (the median); None until both have ``min_samples`` measured steps."""
        judged = self._judge(mode, predicted)
        return None if judged is None else math.exp(judged[0])

    def summary(self) -> str:
        """What the guard did, in one line."""
        aside = ", ".join(f"{m} at {n} step(s)" for m, n in sorted(self.vetoed.items()))
        return (f"guard: {self.probes} serial probe step(s) of {self.steps}; "
                + (f"set aside {aside} (measured slower than serial)" if aside else "no mode set aside"))

    def _logs(self, mode: str, since: int = 0) -> List[float]:
        return [r for step, r in self._ratios.get(mode, ()) if step >= since]

    def _spread(self) -> Optional[float]:
        """The standard deviation of a step's log ratio, pooled over every mode's kept steps (each about its own
        mean): the host's step-to-step noise, the same whatever the mode, so a mode of 3 steps borrows the
        others' to judge it; None below two steps of freedom."""
        squares, free = 0.0, 0
        for kept in self._ratios.values():
            logs = [r for _, r in kept]
            if len(logs) > 1:
                mean = statistics.fmean(logs)
                squares += sum((x - mean) ** 2 for x in logs)
                free += len(logs) - 1
        return math.sqrt(squares / free) if free >= 2 else None

    def _judge(self, mode: str, predicted: Mapping[str, float], since: int = 0
               ) -> Optional[Tuple[float, float]]:
        """``mode``'s corrected log speedup over serial and its standard error, serial's steps from step ``since``
        on; None until both have ``min_samples`` measured steps."""
        own, serial, spread = self._logs(mode), self._logs(SERIAL, since), self._spread()
        if len(own) < self.min_samples or len(serial) < self.min_samples or spread is None \
                or mode not in predicted or SERIAL not in predicted:
            return None
        log_speedup = (math.log(predicted[SERIAL]) + statistics.median(serial)
                       - math.log(predicted[mode]) - statistics.median(own))
        # a median's standard error is about 1.25 times a mean's
        return log_speedup, 1.25 * spread * math.sqrt(1.0 / len(own) + 1.0 / len(serial))

    def _verdict(self, mode: str, predicted: Mapping[str, float]) -> str:
        """``_SLOWER``: ``mode``'s corrected speedup over serial is below 1 by more than ``confidence`` standard errors,
        judged on serial's steps from ``min_samples`` before ``mode``'s oldest kept one on; ``_PROBE``: serial should
        run now, because only older serial steps say so (a host that slowed since them would look like a slower
        mode), or neither verdict is clear yet and serial has not run for ``probe_every`` // 4 steps, or serial's
        probe is due; else ``_KEEP``."""
        kept, serial = self._ratios.get(mode), self._ratios.get(SERIAL)
        if not serial or len(serial) < self.min_samples:
            return _PROBE
        since = self.steps - serial[-1][0]
        if since >= self.probe_every:
            return _PROBE
        if not kept:
            return _KEEP
        beside = self._judge(mode, predicted, kept[0][0] - self.min_samples)  # serial's steps beside the mode's
        judged = beside if beside is not None else self._judge(mode, predicted)
        if judged is None:
            return _KEEP
        log_speedup, error = judged
        if log_speedup < -self.confidence * error:
            return _SLOWER if beside is not None else _PROBE
        unsure = log_speedup < self.confidence * error and since >= max(1, self.probe_every // 4)
        return _PROBE if unsure else _KEEP

    def _drop_old(self) -> None:
        for kept in self._ratios.values():
            while kept and self.steps - kept[0][0] > self.forget:
                kept.popleft()
        for mode in [m for m, last in self._held.items() if self.steps > last]:
            del self._held[mode]  # tried again, judged on new steps only
            self._ratios.pop(mode, None)


__all__ = ["DecodeGuard"]
