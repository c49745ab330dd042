"""The launchers' measurements: modes run side by side, interleaved round by round, their table and ``--check``.

- `prefill`: prefill modes timed side by side, each round on a timeline apart (`measure_modes`), their table and
  the check of every mode's output against serial's (`launch/prefill.py`);
- `generate`: generation runs (a prefill and a decode mode) timed side by side: TTFT, TPOT, tokens/s
  (`measure_generation`), their table and the check of every run's tokens against serial's (`launch/generate.py`);
- `rounds`: the order runs take, round by round, and the spread of their times, which both use (and the
  benchmarks).

They run the engine (`launch.engine`) and only time, compare and print it; the engine imports none of them. The
names both modules have (`table`, the checks) are reached through their module.
"""
from .generate import OBSERVE_EVERY, Run, RunResult, first_difference, measure_generation, observes
from .prefill import RECORDED, ModeResult, measure_modes
from .rounds import rounds, spread

__all__ = ["OBSERVE_EVERY", "RECORDED", "ModeResult", "Run", "RunResult", "first_difference", "measure_generation",
           "measure_modes", "observes", "rounds", "spread"]
