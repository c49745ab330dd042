"""The runtime that prefills and decodes a model, as a library: what the launchers run, and what a program may.

- `prefiller`: a prefill in one mode (`prefill`; compiled as one graph, `graph_prefill`; continued from an offloaded
  prefix, `continue_prefill`; writing a generation's KV cache, `prefill_cache`), the split every rank agrees on
  (`split_for`), and the model's MoE blocks made expert-parallel (`make_expert_parallel`);
- `generation`: greedy generation, the loop over the decode steps (`generate`, `greedy_generate`, `Generated`), the
  decoders it runs settled once before it (`make_decoders`), and its errors;
- `decoder`: what runs the decode steps of one mode (`Decoder`), eagerly through the executor (`EagerDecoder`,
  `eager_decoders`);
- `graph_decoder`: the same padded to a bucket and captured once per bucket (`GraphDecoder`, `graph_decoders`, `capture_problem`);
- `step`: one decode step on the device (`decode_step`, `Picked`) and its bucket (`bucket_of`);
- `decode_calibration`: every candidate mode's decode step timed, for ``--decode-mode auto`` (`calibrate_decode`).

It imports nothing of the launchers (`launch/` top floor), of their measurements (`launch.measure`) or of the
benchmarks (`tests/test_architecture.py` checks it).
"""
from .decode_calibration import (DECODE_AUTO_MODES, DECODE_CALIBRATION_ROUNDS, DECODE_FORMAT, calibrate_decode,
                                 calibration_histories, calibration_ids, decode_calibration_key, graph_token_points,
                                 token_points)
from .decoder import Decoder, EagerDecoder, eager_decoders, expert_group, history_weight, split_by_cost
from .generation import (DecodeError, Decoders, Generated, NonFiniteLogits, OnStep, generate, greedy_generate,
                       make_decoders, new_cache)
from .graph_decoder import MIN_LENGTH, GraphDecoder, capture_problem, decoders_of, graph_decoders
from .prefiller import (after_attention, continue_prefill, graph_prefill, layer_operations,
                      make_capacity_expert_parallel, make_expert_parallel, prefill, prefill_cache, split_for)
from .step import DECODE_STEP, TOKENS, Picked, bucket_of, checked_buckets, decode_step, lower_step, read_picked

__all__ = [
    # prefill
    "after_attention", "continue_prefill", "graph_prefill", "layer_operations",
    "make_capacity_expert_parallel", "make_expert_parallel", "prefill", "prefill_cache", "split_for",
    # generation and its decoders
    "DecodeError", "Decoders", "Generated", "NonFiniteLogits", "OnStep", "generate", "greedy_generate",
    "make_decoders", "new_cache",
    "Decoder", "EagerDecoder", "eager_decoders", "expert_group", "history_weight", "split_by_cost",
    "MIN_LENGTH", "GraphDecoder", "capture_problem", "decoders_of", "graph_decoders",
    # one decode step
    "DECODE_STEP", "TOKENS", "Picked", "bucket_of", "checked_buckets", "decode_step", "lower_step", "read_picked",
    # the decode calibration
    "DECODE_AUTO_MODES", "DECODE_CALIBRATION_ROUNDS", "DECODE_FORMAT", "calibrate_decode", "calibration_histories",
    "calibration_ids", "decode_calibration_key", "graph_token_points", "token_points",
]
