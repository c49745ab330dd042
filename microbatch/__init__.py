"""Micro-batch pipelining: layers as operations, schedules as data, and the executor that runs them.

`MODES` (``serial``, ``shared``, ``two-batch``, and the opt-in ``three-batch`` and
``four-batch``) are the schedules the launcher compares; `run` executes any schedule, deriving
every cross-stream event from the data flow; `split` cuts a packed batch into N balanced
micro-batches that every rank agrees on.
"""
from .executor import Plan, Step, event_tag, execute, lower, run
from .operations import FromMicroBatch, Operation, State, as_operation
from .schedules import (HIDDEN, MODES, OUT, Mode, Schedule, ScheduledOp, ScheduleError, as_listed, mode,
                        n_batch, n_batch_name, normalize_layers, schedule_for, serial, shared, two_batch,
                        validate)

__all__ = [
    "HIDDEN", "MODES", "OUT", "FromMicroBatch", "Mode", "Operation", "Plan", "Schedule", "ScheduleError", "ScheduledOp",
    "State", "Step", "as_listed", "as_operation", "event_tag", "execute", "lower", "mode", "n_batch", "n_batch_name",
    "normalize_layers", "run", "schedule_for", "serial", "shared", "two_batch", "validate",
]

# forecasting a schedule's timeline from a cost model, without running it
from .simulate import CostModel, Interconnect, Linear, OpCost, Prediction, Transfer, predict, simulate  # noqa: E402

__all__ += ["CostModel", "Interconnect", "Linear", "OpCost", "Prediction", "Transfer", "predict", "simulate"]
