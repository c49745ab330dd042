"""Planning a prefill: its calibration (what each operation costs on this machine) and the choice it makes.

- `calibration`: what a prefill calibration holds (`Calibration`, `OpFit`, `TransferFit`), its cost model for
  the simulation, its JSON and its cache file checked (`check_cached`; ``load`` and ``save``);
- `fit`: recorded serial runs and the probes' samples fitted into it (`Run`, `fit_runs`, `fit_linear`,
  `fit_collective`);
- `measure`: the model's serial runs, in rounds over the token counts, the probes, the ranks' agreement and
  the cache (`calibrate`, `measure_costs`, `token_points`, `request_length`; ``agree``);
- `choice`: a mode's predicted prefill (`predict_mode`) and the fastest predicted mode, split and tail for
  every rank's batch (`choose` -> `Choice`); `gather_lens`.

Names that mean something else elsewhere (``agree``, ``load``, ``save``) are reached through their module.
"""
from .calibration import LAYER_ABS_S, LAYER_REL, Calibration, OpFit, TransferFit, check_cached, interconnect_of
from .fit import Run, fit_collective, fit_linear, fit_outside, fit_runs
from .measure import calibrate, measure_costs, request_length, token_points
from .choice import SPLIT_MARGIN, Candidate, Choice, ModelOrLayers, choose, gather_lens, layers_of, predict_mode

__all__ = [
    # calibration
    "LAYER_ABS_S", "LAYER_REL", "Calibration", "OpFit", "TransferFit", "check_cached", "interconnect_of",
    # fit
    "Run", "fit_collective", "fit_linear", "fit_outside", "fit_runs",
    # measure
    "calibrate", "measure_costs", "request_length", "token_points",
    # choice
    "SPLIT_MARGIN", "Candidate", "Choice", "ModelOrLayers", "choose", "gather_lens", "layers_of", "predict_mode",
]
