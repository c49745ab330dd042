"""Micro-batch pipelining: layers as operations, schedules as data, and the executor that runs them.

`MODES` (``serial``, ``shared``, ``two-batch``, and the opt-in ``three-batch`` and
``four-batch``) are the schedules the launcher compares; `run` executes any schedule, deriving
every cross-stream event from the data flow; `run_schedule` (`microbatch.forward`) runs a model's
forward through one, on a `Batch` split as `microbatch.planning` decides: cut into N balanced
micro-batches that every rank agrees on, or into the mode and split the planner predicts fastest.
"""
from .batch import K, KV_STEP, PREFIX_KV, SEQ, V, Batch, SeqInfo
from .executor import Lowered, execute, lower_ahead, run, run_made
from .lowering import Lowering, Step, event_tag, lower
from .kv_cache import KVCache, KVCacheError, KVRows, KVStep
from .kv_offload import OffloadedKVCache
from .forward import cut_refusal, forward_layer_by_layer, micro_batch_inputs, run_schedule, serial_split
from .model import DecodeModel, ForwardModel, Layer, MoELayer, MoEModel, ModelShape
from .operations import FromMicroBatch, Operation, State, as_operation
from .replay import replay_stats
from .planning import CostModel, Interconnect, Linear, OpCost, Prediction, Transfer, predict, simulate
from .schedules import (AUTO, CHUNKS, DECODE_MODES, HIDDEN, MODES, OUT, Mode, Schedule, ScheduledOp, ScheduleError,
                        as_listed, chunked, decode_mode, mode, n_batch, n_batch_name, normalize_layers, schedule_for, serial, shared, two_batch,
                        validate)
from .split import Split, merge_outputs, micro_batches, prefix_kv, prefix_sources, split_batch, split_tokens

__all__ = [
    # the executor and the schedules
    "AUTO", "CHUNKS", "DECODE_MODES", "HIDDEN", "MODES", "OUT", "FromMicroBatch", "Mode", "Operation", "Lowering", "Schedule",
    "ScheduleError", "ScheduledOp", "State", "Step", "as_listed", "as_operation", "chunked", "decode_mode", "event_tag", "execute", "lower", "lower_ahead", "Lowered", "mode", "n_batch", "n_batch_name",
    "normalize_layers", "replay_stats", "run", "run_made", "schedule_for", "serial", "shared", "two_batch", "validate",
    # a packed batch, a split of it, and the model contract
    "Batch", "K", "KV_STEP", "PREFIX_KV", "SEQ", "SeqInfo", "V",
    # decode: the keys and values of every active request, on the device or in host memory
    "KVCache", "KVCacheError", "KVRows", "KVStep", "OffloadedKVCache",
    "Split", "merge_outputs", "micro_batches", "prefix_kv", "prefix_sources", "split_batch", "split_tokens",
    "DecodeModel", "ForwardModel", "Layer", "MoELayer", "MoEModel", "ModelShape",
    # a model's forward through a schedule
    "cut_refusal", "forward_layer_by_layer", "micro_batch_inputs", "run_schedule", "serial_split",
    # the simulation (`microbatch.planning`)
    "CostModel", "Interconnect", "Linear", "OpCost", "Prediction", "Transfer", "predict", "simulate",
]
