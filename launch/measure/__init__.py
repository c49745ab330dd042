"""The launchers' measurements: modes run side by side, interleaved round by round, their table and ``--check``.

- `prefill`: prefill modes timed side by side, each round on a timeline apart (`measure_modes`), their table and
  the check of every mode's output against serial's (`launch/prefill.py`);
- `generate`: generation runs (a prefill and a decode mode) timed side by side: TTFT, TPOT, tokens/s
  (`measure_generation`), their table and the check of every run's tokens against serial's (`launch/generate.py`);
- `quantized`: ``--check`` of a quantized checkpoint, the run against its dequantized model (`prefill_check`,
  `generation_check`);
- `rounds`: the order runs take, round by round, and the spread of their times, which both use (and the
  benchmarks);
- `verdicts`: what a figure measured in rounds says against their spread: a speedup, noise, or a mode that runs
  serial's schedule; a target met, missed or inconclusive; a cost or "below the noise" (both tables and the
  benchmarks).

They run the engine (`launch.engine`) and only time, compare and print it; the engine imports none of them. The
names both modules have (`table`, the checks) are reached through their module.
"""
from .generate import OBSERVE_EVERY, Run, RunResult, first_difference, measure_generation, observes
from .prefill import RECORDED, ModeResult, measure_modes
from .rounds import rounds, spread
from .verdicts import cost, mark, overlaps_nothing, verdict

__all__ = ["OBSERVE_EVERY", "RECORDED", "ModeResult", "Run", "RunResult", "cost", "first_difference", "mark",
           "measure_generation", "measure_modes", "observes", "overlaps_nothing", "rounds", "spread", "verdict"]
