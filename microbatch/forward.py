"""A model's forward through a schedule: split the batch, give each micro-batch its inputs, run, merge.

`run_schedule` is one prefill of a batch with the layers' operations the caller passes (the
launcher's, with the expert-parallel MoE and the KV offload in place: `launch.runner`), in any
schedule, on any number of micro-batches. It needs nothing of collectives: the split is decided
(and agreed between ranks) before, and of the model it needs only `microbatch.model.ForwardModel`.

A model whose layers cannot continue a request from a prefix says why in ``no_cut_reason``
(`cut_refusal`): a split that cuts a request is then refused before anything runs.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional

import torch

from .batch import K, PREFIX_KV, SEQ, V, Batch
from .executor import run
from .model import ForwardModel
from .operations import FromMicroBatch, Operation
from .planning.split import Split, merge_outputs, prefix_kv, prefix_sources, split_batch
from .schedules import HIDDEN, Schedule


def serial_split(batch: Batch, reason: str = "mode runs one batch") -> Split:
    """The split of a mode that runs ``batch`` as one micro-batch: none."""
    return Split(tuple(batch.seq.seq_lens), None, reason)


def cut_refusal(model: Any) -> Optional[str]:
    """Why ``model`` cannot continue a request cut across micro-batches (its ``no_cut_reason``), or None."""
    return getattr(model, "no_cut_reason", None)


def _check_cut(model: Any, plan: Split) -> None:
    refusal = cut_refusal(model)
    if plan.cut is not None and refusal:
        raise ValueError(f"the plan cuts request {plan.cut[0]} across micro-batches, but {refusal}; "
                         f"plan with split_for(..., model=model)")


def micro_batch_inputs(model: ForwardModel, batch: Batch, plan: Split) -> List[Dict[str, Any]]:
    """The executor's initial values of each micro-batch of ``plan`` (one when it is serial).

    A micro-batch whose first request was cut has a ``PREFIX_KV`` that reads ``K``, ``V`` of the
    same layer from the earlier micro-batches holding that request's earlier parts (their rows of
    it, concatenated: `prefix_kv`); the others' is None. A cut plan for a model that refuses
    cuts (`cut_refusal`) raises before anything runs.
    """
    _check_cut(model, plan)
    parts = [batch] if plan.serial else list(split_batch(batch, plan))
    return [{HIDDEN: model.embed_tokens(part.tokens), SEQ: part.seq, PREFIX_KV: _prefix_input(plan, i)}
            for i, part in enumerate(parts)]


def _prefix_input(plan: Split, mb: int) -> Optional[FromMicroBatch]:
    sources = prefix_sources(plan, mb)
    return FromMicroBatch(sources, K, V, fn=functools.partial(prefix_kv, plan, mb=mb)) if sources else None


def run_schedule(model: ForwardModel, batch: Batch, plan: Split, layers: List[List[Operation]],
                 make: Callable[[List[List[Operation]], int], Schedule]) -> torch.Tensor:
    """Final hidden states of ``batch`` when the schedule ``make(layers, micro-batches)`` runs ``layers``.

    Split the batch as ``plan`` says, give each micro-batch its inputs, build the schedule, run
    it, and merge the micro-batches' normed outputs back into packed order.
    """
    inputs = micro_batch_inputs(model, batch, plan)
    outputs = run(make(layers, len(inputs)), layers, inputs)
    finals = [model.norm(h) for h in outputs]
    return finals[0] if plan.serial else merge_outputs(plan, *finals)


__all__ = ["cut_refusal", "micro_batch_inputs", "run_schedule", "serial_split"]
