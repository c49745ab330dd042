"""Runs timed side by side: the order they run in, round by round, and the spread of their times.

Both of the launchers' measurements (`launch.measure.prefill`, `launch.measure.generate`) and the benchmarks
run their modes interleaved, one run of each per round (`rounds`), so that a change of load on the host biases no
mode, and judge a difference against the rounds' spread (`spread`).
"""
from __future__ import annotations

import statistics
from typing import List, Optional, Sequence


def rounds(modes: Sequence[str], warmup: int, iters: int) -> List[List[str]]:
    """The order the modes run in: one list per round, every mode once per round.

    The ``warmup`` rounds come first; each timed round starts one mode later than the one before,
    so that a change of load on the host falls on every mode alike and on no position in the round.
    """
    n = len(modes)
    return [list(modes) for _ in range(warmup)] + [[modes[(i + j) % n] for j in range(n)] for i in range(iters)]


def spread(times: Sequence[float]) -> Optional[float]:
    """The rounds' interquartile range over their median; None for fewer than two rounds."""
    if len(times) < 2:
        return None
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(times)


__all__ = ["rounds", "spread"]
