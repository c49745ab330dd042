"""A model's forward through a schedule: split the batch, give each micro-batch its inputs, run, merge.

`run_schedule` is one prefill of a batch with the layers' operations the caller passes (the
launcher's, with the expert-parallel MoE and the KV offload in place: `launch.engine.prefiller`), in any
schedule, on any number of micro-batches. It needs nothing of collectives: the split is decided
(and agreed between ranks) before, and of the model it needs only `microbatch.model.ForwardModel`.

A model whose layers cannot continue a request from a prefix says why in ``no_cut_reason``
(`cut_refusal`): a split that cuts a request is then refused before anything runs.

`forward_layer_by_layer` is the same prefill without the executor, for checking it: every
micro-batch of a layer in turn, on the current stream (both models' ``forward_microbatches``).
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .batch import K, PREFIX_KV, SEQ, V, Batch
from .executor import Lowered, run_made
from .model import KV, ForwardModel, MoEModel
from .operations import FromMicroBatch, Operation
from .schedules import HIDDEN, Schedule
from .split import Split, merge_outputs, prefix_kv, prefix_sources, split_batch

MakeSchedule = Callable[[List[List[Operation]], int], Schedule]  # a schedule of (layers, micro-batches)


def serial_split(batch: Batch, reason: str = "mode runs one batch") -> Split:
    """The split of a mode that runs ``batch`` as one micro-batch: none."""
    return Split(tuple(batch.seq.seq_lens), None, reason)


def cut_refusal(model: Optional[ForwardModel]) -> Optional[str]:
    """Why ``model`` cannot continue a request cut across micro-batches (its ``no_cut_reason``), or None
    (also for no model: a caller that names none takes the split as it is)."""
    return None if model is None else model.no_cut_reason


def _check_cut(model: ForwardModel, split: Split) -> None:
    refusal = cut_refusal(model)
    if split.cut is not None and refusal:
        raise ValueError(f"the split cuts request {split.cut[0]} across micro-batches, but {refusal}; "
                         f"split with split_for(..., model=model)")


def micro_batch_inputs(model: ForwardModel, batch: Batch, split: Split) -> List[Dict[str, object]]:
    """The executor's initial values of each micro-batch of ``split`` (one when it is serial).

    A micro-batch whose first request was cut has a ``PREFIX_KV`` that reads ``K``, ``V`` of the
    same layer from the earlier micro-batches holding that request's earlier parts (their rows of
    it, concatenated: `prefix_kv`); the others' is None. A cut split for a model that refuses
    cuts (`cut_refusal`) raises before anything runs.
    """
    _check_cut(model, split)
    parts = [batch] if split.serial else list(split_batch(batch, split))
    return [{HIDDEN: model.embed_tokens(part.tokens), SEQ: part.seq, PREFIX_KV: _prefix_input(split, i)}
            for i, part in enumerate(parts)]


def _prefix_input(split: Split, mb: int) -> Optional[FromMicroBatch]:
    sources = prefix_sources(split, mb)
    return FromMicroBatch(sources, K, V, fn=functools.partial(prefix_kv, split, mb=mb)) if sources else None


def run_schedule(model: ForwardModel, batch: Batch, split: Split, layers: List[List[Operation]],
                 make: MakeSchedule, lowered: Optional[Lowered] = None) -> torch.Tensor:
    """Final hidden states of ``batch`` when the schedule ``make(layers, micro-batches)`` runs ``layers``.

    Split the batch as ``split`` says, give each micro-batch its inputs, build the schedule, run
    it, and merge the micro-batches' normed outputs back into packed order. ``lowered``: that
    schedule lowered ahead (`microbatch.lower_ahead`, for a function a compiler traces).
    """
    inputs = micro_batch_inputs(model, batch, split)
    outputs = run_made(make, layers, inputs) if lowered is None else lowered.run(inputs)
    finals = [model.norm(h) for h in outputs]
    return finals[0] if split.serial else merge_outputs(split, *finals)


def _prefix(split: Split, mb: int, kvs: Sequence[Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]
            ) -> Optional[KV]:
    """Micro-batch ``mb``'s prefix from the earlier micro-batches' ``(k, v)`` of this layer (None without)."""
    sources = prefix_sources(split, mb)
    if not sources or kvs[sources[0]][0] is None:  # no cut, or a layer without keys and values
        return None
    return prefix_kv(split, *[t for j in sources for t in kvs[j]], mb=mb)


@torch.no_grad()
def forward_layer_by_layer(model: MoEModel, batch: Batch, split: Split) -> torch.Tensor:
    """``model`` on the micro-batches of ``split``, layer by layer, without overlap (a serial split: its forward).

    Each layer runs micro-batch 0, 1, ... in turn, so a cut request's later parts find their
    prefix keys and values computed; the normed outputs are merged into packed order. A cut split
    for a model that refuses cuts (`cut_refusal`) raises before anything runs.
    """
    if split.serial:
        return model.forward(batch)
    _check_cut(model, split)
    parts = split_batch(batch, split)
    hidden = [model.embed_tokens(p.tokens) for p in parts]
    for layer in model.layers:
        kvs: List[Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = []
        for mb, part in enumerate(parts):
            hidden[mb], k, v = layer.run(hidden[mb], part.seq, _prefix(split, mb, kvs), mb=mb)
            kvs.append((k, v))
    return merge_outputs(split, *[model.norm(h) for h in hidden])


__all__ = ["MakeSchedule", "cut_refusal", "forward_layer_by_layer", "micro_batch_inputs", "run_schedule",
           "serial_split"]
