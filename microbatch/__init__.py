"""Micro-batch pipelining: layers as operations, schedules as data, and the executor that runs them."""
from .executor import Plan, Step, event_tag, execute, lower, run
from .operations import FromMicroBatch, Operation, State, as_operation
from .schedules import (HIDDEN, OUT, Launch, Schedule, ScheduleError, by_name, normalize_layers, serial,
                        shared_overlap, two_batch, validate)

__all__ = [
    "HIDDEN", "OUT", "FromMicroBatch", "Launch", "Operation", "Plan", "Schedule", "ScheduleError", "State", "Step",
    "as_operation", "by_name", "event_tag", "execute", "lower", "normalize_layers", "run", "serial",
    "shared_overlap", "two_batch", "validate",
]
