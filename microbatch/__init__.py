"""Micro-batch pipelining: layers as operations, schedules as data, and the executor that runs them.

`MODES` (``serial``, ``shared``, ``two-batch``, and the opt-in ``three-batch`` and
``four-batch``) are the schedules the launcher compares; `run` executes any schedule, deriving
every cross-stream event from the data flow; `run_schedule` (`microbatch.forward`) runs a model's
forward through one, on a `Batch` split as `microbatch.planning` decides: cut into N balanced
micro-batches that every rank agrees on, or into the mode and split the planner predicts fastest.
"""
from .executor import Lowering, Step, event_tag, execute, lower, run
from .operations import FromMicroBatch, Operation, State, as_operation
from .schedules import (HIDDEN, MODES, OUT, Mode, Schedule, ScheduledOp, ScheduleError, as_listed, mode,
                        n_batch, n_batch_name, normalize_layers, schedule_for, serial, shared, two_batch,
                        validate)
from .batch import K, PREFIX_KV, SEQ, V, Batch, SeqInfo
from .model import ForwardModel

__all__ = [
    "HIDDEN", "MODES", "OUT", "FromMicroBatch", "Mode", "Operation", "Lowering", "Schedule", "ScheduleError", "ScheduledOp",
    "State", "Step", "as_listed", "as_operation", "event_tag", "execute", "lower", "mode", "n_batch", "n_batch_name",
    "normalize_layers", "run", "schedule_for", "serial", "shared", "two_batch", "validate",
    "Batch", "ForwardModel", "K", "PREFIX_KV", "SEQ", "SeqInfo", "V",
]

# planning before the forward: the calibration (in planning) runs the forward, which reads the split
# (`microbatch.planning.split`, loaded first by planning's own __init__)
from .planning import CostModel, Interconnect, Linear, OpCost, Prediction, Transfer, predict, simulate  # noqa: E402
from .forward import cut_refusal, micro_batch_inputs, run_schedule, serial_split  # noqa: E402

__all__ += ["CostModel", "Interconnect", "Linear", "OpCost", "Prediction", "Transfer", "predict", "simulate",
            "cut_refusal", "micro_batch_inputs", "run_schedule", "serial_split"]
