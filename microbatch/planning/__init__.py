"""Planning a prefill or a decode step before running it: the split into micro-batches, and the choice of schedule.

- `split`: where a packed batch is cut into N balanced micro-batches (`propose_split`), agreed by
  every rank (`decide_split`), and how a batch and its outputs are cut and merged by that split;
- `simulation`: a schedule's timeline and prefill time predicted from a cost model (`predict`);
- `calibration`: that cost model measured on this machine for a model (`calibrate`), cached;
- `probes`: the link and the busy host measured with small collectives, for the calibration;
- `choice`: the fastest predicted mode, split and tail for every rank's batch (`choose`);
- `decode`: a decode step's mode from a measured table of step times (`DecodeCalibration`, `choose_decode`);
- `guard`: auto's steps measured against their predictions, vetoing a mode slower than serial (`DecodeGuard`).

Importable without the launcher: it needs the executor and the model's forward
(`microbatch.forward`), the primitives (`overlap`) and torch.distributed. Names that mean
something else elsewhere (the calibration's ``agree``, ``load`` and ``save``) are
reached through their module, `microbatch.planning.calibration`.
"""
from .split import DEFAULT_MAX_IMBALANCE, DEFAULT_MIN_TOKENS, MAX_MICRO_BATCHES, agree_split, decide_split, propose_split
from .simulation import (CostModel, Interconnect, Linear, OpCost, Prediction, Transfer, cross_stream_edges,
                         placeholder_inputs, predict, simulate)
from .probes import barrier, contention, contention_fit, cpu_async, grouped, max_over_ranks, notice, sweep
from .calibration import (ENV_CACHE, Calibration, OpFit, Run, TransferFit, cache_dir, cache_file, calibrate,
                          calibration_key, check_cached, fit_collective, fit_linear, fit_runs,
                          predict_mode, read_cache, request_length, token_points, write_cache)
from .choice import SPLIT_MARGIN, Candidate, Choice, choose, gather_lens
from .decode import (DEFAULT_CONFIDENCE, DEFAULT_MARGIN, SERIAL, DecodeCalibration, DecodeCalibrationError,
                     DecodeChoice, choose_decode, relative_error)
from .guard import DecodeGuard

__all__ = [
    # split
    "DEFAULT_MAX_IMBALANCE", "DEFAULT_MIN_TOKENS", "MAX_MICRO_BATCHES", "agree_split", "decide_split", "propose_split",
    # simulation
    "CostModel", "Interconnect", "Linear", "OpCost", "Prediction", "Transfer", "cross_stream_edges",
    "placeholder_inputs", "predict", "simulate",
    # probes
    "barrier", "contention", "contention_fit", "cpu_async", "grouped", "max_over_ranks", "notice", "sweep",
    # calibration
    "ENV_CACHE", "Calibration", "OpFit", "Run", "TransferFit", "cache_dir", "cache_file", "calibrate",
    "calibration_key", "check_cached", "fit_collective", "fit_linear", "fit_runs", "predict_mode", "read_cache",
    "request_length", "token_points", "write_cache",
    # choice
    "SPLIT_MARGIN", "Candidate", "Choice", "choose", "gather_lens",
    # decode
    "DEFAULT_CONFIDENCE", "DEFAULT_MARGIN", "SERIAL", "DecodeCalibration", "DecodeCalibrationError", "DecodeChoice",
    "choose_decode", "relative_error",
    # guard
    "DecodeGuard",
]
