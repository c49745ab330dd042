"""Planning a prefill or a decode step before running it: the split into micro-batches, and the choice of schedule.

At its top:

- `split`: where a packed batch is cut into N balanced micro-batches (`propose_split`), agreed by
  every rank (`decide_split`);
- `simulation`: a schedule's timeline and prefill time predicted from a cost model (`predict`);
- `probes`: the link and the busy host measured with small collectives, for the calibration;
- `cache`: where calibrations are kept, prefill's and decode's, a file per key (`calibration_key`, `cache_file`),
  and how old one is (`measured_ago`).

Then prefill and decode, named in parallel:

- `prefill`: a prefill's calibration (`Calibration`: its types and cache file in `prefill.calibration`, its
  fitting in `prefill.fit`, its measuring in `prefill.measure`: `calibrate`), and its choice of mode, split
  and tail for every rank's batch (`prefill.choice`: `choose`);
- `decode`: a decode step's calibration (`DecodeCalibration`, a measured table of step times, measured by the
  launcher's `calibrate_decode`), its choice per step (`decode.choice`: `choose_decode`), and auto's guard
  vetoing a mode slower than serial (`decode.guard`: `DecodeGuard`).

Importable without the launcher: it needs the executor and the model's forward
(`microbatch.forward`), the primitives (`overlap`) and torch.distributed. Names that mean
something else elsewhere (the prefill calibration's ``agree``, ``load`` and ``save``) are
reached through their modules, `microbatch.planning.prefill.measure` and `microbatch.planning.prefill.calibration`.
"""
from .split import DEFAULT_MAX_IMBALANCE, DEFAULT_MIN_TOKENS, MAX_MICRO_BATCHES, agree_split, decide_split, propose_split
from .simulation import (CostModel, Interconnect, Linear, OpCost, Prediction, Transfer, cross_stream_edges,
                         placeholder_inputs, predict, simulate)
from .probes import barrier, contention, contention_fit, cpu_async, grouped, max_over_ranks, notice, sweep
from .cache import ENV_CACHE, cache_dir, cache_file, calibration_key, measured_ago, read_cache, write_cache
from .prefill import (Calibration, OpFit, Run, TransferFit, calibrate, check_cached, fit_collective, fit_linear,
                      fit_runs, predict_mode, request_length, token_points)
from .prefill import SPLIT_MARGIN, Candidate, Choice, choose, gather_lens
from .decode import (DEFAULT_CONFIDENCE, DEFAULT_MARGIN, SERIAL, DecodeCalibration, DecodeCalibrationError,
                     DecodeChoice, DecodeGuard, choose_decode, relative_error)

__all__ = [
    # split
    "DEFAULT_MAX_IMBALANCE", "DEFAULT_MIN_TOKENS", "MAX_MICRO_BATCHES", "agree_split", "decide_split", "propose_split",
    # simulation
    "CostModel", "Interconnect", "Linear", "OpCost", "Prediction", "Transfer", "cross_stream_edges",
    "placeholder_inputs", "predict", "simulate",
    # probes
    "barrier", "contention", "contention_fit", "cpu_async", "grouped", "max_over_ranks", "notice", "sweep",
    # the calibration cache
    "ENV_CACHE", "cache_dir", "cache_file", "calibration_key", "measured_ago", "read_cache", "write_cache",
    # prefill: the calibration
    "Calibration", "OpFit", "Run", "TransferFit", "calibrate", "check_cached", "fit_collective", "fit_linear",
    "fit_runs", "predict_mode", "request_length", "token_points",
    # prefill: the choice
    "SPLIT_MARGIN", "Candidate", "Choice", "choose", "gather_lens",
    # decode: the calibration, the choice, the guard
    "DEFAULT_CONFIDENCE", "DEFAULT_MARGIN", "SERIAL", "DecodeCalibration", "DecodeCalibrationError", "DecodeChoice",
    "choose_decode", "relative_error", "DecodeGuard",
]
