"""Planning a decode step: its calibration (a measured table of step times per mode), the choice per step, the guard.

- `calibration`: the table (`DecodeCalibration`, measured by the launcher's `calibrate_decode`), its predictions
  for a step and the noise of its entries (`relative_error`);
- `choice`: the fastest predicted mode for a step, serial unless another is clearly faster (`choose_decode`);
- `guard`: auto's steps measured against their predictions, vetoing a mode slower than serial (`DecodeGuard`).

Pure Python: no collective, no tensor (the caller measures and agrees).
"""
from .calibration import SERIAL, DecodeCalibration, DecodeCalibrationError, relative_error
from .choice import DEFAULT_CONFIDENCE, DEFAULT_MARGIN, DecodeChoice, choose_decode
from .guard import DecodeGuard

__all__ = ["DEFAULT_CONFIDENCE", "DEFAULT_MARGIN", "SERIAL", "DecodeCalibration", "DecodeCalibrationError",
           "DecodeChoice", "DecodeGuard", "choose_decode", "relative_error"]
