"""Prefill of a model in one mode: eagerly through the micro-batch executor, or compiled as one
torchair graph (`graph_prefill`), or continued from an offloaded prefix (`continue_prefill`), or
writing a generation's KV cache (`prefill_cache`).

The model is any `microbatch.model.MoEModel`: the reference decoder (`launch.models.reference.Model`)
or a transformers MoE model adapted by `launch.models.transformers`. A model whose
layers cannot continue a request from a prefix says why in ``no_cut_reason``: `split_for` (given
the model) then splits only at request boundaries, and a split that cuts a request is refused
before it runs. Running the layers through a schedule is `microbatch.forward.run_schedule`; this
module adds what needs collectives or the launcher: the expert-parallel MoE, the agreed split,
the KV offload, the compiled graph.

Modes are `microbatch.MODES`: ``serial`` (everything on the main stream: the reference),
``shared`` (one batch, shared experts on their side stream beside dispatch / experts / combine
on the EP stream), ``two-batch`` (two micro-batches: one's dispatch and combine under the
other's compute) and ``three-batch`` / ``four-batch`` (the same with N micro-batches, each
one's exchanges under the others' compute). With a KV offload cache every layer's keys and
values are offloaded right after its attention.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, List, Optional, Union

import torch
import torch.distributed as dist

import microbatch
import overlap
from collectives import ExpertParallelMoE, capacity_expert_parallel, decode_exchange_named, wrap_expert_parallel
from microbatch import DecodeModel, KVCache, KVRows, Operation, Split
from microbatch.batch import K, V, Batch
from microbatch.forward import MakeSchedule, cut_refusal, micro_batch_inputs, run_schedule, serial_split
from microbatch.model import ForwardModel, MoELayer, MoEModel
from microbatch.planning import DEFAULT_MAX_IMBALANCE, DEFAULT_MIN_TOKENS, decide_split, propose_split
from microbatch.split import merge_outputs
from overlap import OffloadCache

_PREFILL_ROWS = "kv_prefill_rows"  # a prefill micro-batch's rows of the cache (its tokens' slice of the batch's)


def make_expert_parallel(model: MoEModel, group: Optional[dist.ProcessGroup], impl: str = "auto", *,
                         two_step_dispatch: bool = True, decode_exchange: str = "capacity",
                         dispatch_dtype: Optional[str] = None) -> MoEModel:
    """Replace every MoE block of ``model`` by its expert-parallel form over ``group`` (in place);
    ``two_step_dispatch``: the count exchange and the tokens as two operations (`ExpertParallelMoE`);
    ``decode_exchange`` (one of `collectives.DECODE_EXCHANGES`): what decode steps exchange through, the capacity
    exchange, MC2 (prefill keeps the all-to-all), or ``"auto"``: MC2 where torch_npu has it, for buckets up to 256
    tokens (`collectives.decode_exchange_named`); ``dispatch_dtype``: ``"int8"`` / ``"fp8"`` quantize the tokens per
    token for the dispatch of prefill and decode (`collectives.quantize`; None: the model's dtype)."""
    steps = decode_exchange_named(decode_exchange)

    def wrap(layer: MoELayer) -> ExpertParallelMoE:
        ep = wrap_expert_parallel(layer.moe, group, impl=impl, decode_exchange=steps, dispatch_dtype=dispatch_dtype)
        ep.two_step_dispatch = two_step_dispatch
        return ep

    model.replace_moe(wrap)
    return model


def make_capacity_expert_parallel(model: MoEModel, group: Optional[dist.ProcessGroup], capacity: int,
                                  dispatch_dtype: Optional[str] = None) -> MoEModel:
    """Replace every MoE block by its static-shape expert-parallel form (graph paths; in place), its dispatch
    quantized as ``dispatch_dtype`` says."""
    model.replace_moe(lambda layer: capacity_expert_parallel(layer.moe, group, capacity=capacity,
                                                             dispatch_dtype=dispatch_dtype))
    return model


def _offload(cache: OffloadCache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    cache.offload(layer, k, v)  # appends after what the layer holds: micro-batch 0 is issued first


def layer_operations(model: MoEModel, cache: Optional[OffloadCache] = None) -> List[List[Operation]]:
    """The model's layers as operations; with ``cache``, an offload right after each attention.

    The offload operation runs on the main stream: the cache itself switches to the copy stream
    and places the events that order the copy after attention and the next write after the copy.
    A layer whose operations write no keys and values (a hybrid model's linear attention) offloads nothing.
    """
    layers = model.layer_operations()
    if cache is None:
        return layers
    return [after_attention(ops, Operation("kv_offload", functools.partial(_offload, cache, li), (K, V), ()))
            for li, ops in enumerate(layers)]


def after_attention(ops: List[Operation], op: Operation) -> List[Operation]:
    """``ops`` with ``op`` right after the operation that writes the layer's keys and values (``K``, ``V``);
    ``ops`` as they are in a layer without one (a hybrid model's linear attention)."""
    at = next((i + 1 for i, o in enumerate(ops) if K in o.writes and V in o.writes), None)
    return ops if at is None else ops[:at] + [op] + ops[at:]


def split_for(mode: str, batch: Batch, group: Optional[dist.ProcessGroup], *,
              model: Optional[ForwardModel] = None, min_tokens: int = DEFAULT_MIN_TOKENS,
              max_imbalance: float = DEFAULT_MAX_IMBALANCE, alone: bool = False) -> Split:
    """The micro-batch split of ``mode``: agreed by every rank of ``group`` where it splits (one all-reduce),
    or by this process alone with ``alone`` (its model exchanges nothing; the default group's other ranks may
    be running something else).

    A mode of N micro-batches gets N where every rank's batch can take them, else the most that
    every rank can take, else serial (`decide_split`). With ``model``, a model that cannot take a
    cut request (`cut_refusal`) is split at request boundaries only, or runs serially; the split's
    reason says why.
    """
    n = microbatch.mode(mode).micro_batches
    if n == 1:
        return serial_split(batch)
    refusal = cut_refusal(model)
    kwargs = dict(n=n, min_tokens=min_tokens, max_imbalance=max_imbalance, allow_cut=refusal is None)
    split = (propose_split(batch.seq.seq_lens, **kwargs) if alone
             else decide_split(batch.seq.seq_lens, group, **kwargs))
    return split if refusal is None else dataclasses.replace(split, reason=f"{split.reason}; {refusal}")


@torch.no_grad()
def prefill(model: MoEModel, batch: Batch, mode: str, split: Split, cache: Optional[OffloadCache] = None,
            make: Optional[MakeSchedule] = None) -> torch.Tensor:
    """Final hidden states of ``batch`` computed with the schedule of ``mode`` (see the module docstring),
    or of ``make(layers, micro-batches)`` when given (the planner's choice)."""
    out = run_schedule(model, batch, split, layer_operations(model, cache), make or microbatch.mode(mode).make)
    if cache is not None:
        cache.finish()
    return out


def prefill_cache(model: DecodeModel, batch: Batch, cache: KVCache, slots: List[int], mode: str,
                  group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """A generation's prefill: final (normed) hidden states of the prompts in ``batch`` through ``mode``'s
    schedule, every layer's keys and values written to ``slots`` of the cache right after its attention (the split
    agreed by every rank of ``group`` where it cuts)."""
    split = split_for(mode, batch, group, model=model, alone=group is None)
    rows = cache.rows(slots, batch.seq.seq_lens)
    layers = [after_attention(ops, Operation("kv_write", functools.partial(_write, cache, li),
                                             (K, V, _PREFILL_ROWS), ()))
              for li, ops in enumerate(model.layer_operations())]
    inputs = micro_batch_inputs(model, batch, split)
    bounds = (0,) + tuple(split.points) + (batch.seq.num_tokens,)
    for mb, values in enumerate(inputs):  # each micro-batch's tokens are a contiguous slice of the batch
        values[_PREFILL_ROWS] = dataclasses.replace(rows, where=rows.where[bounds[mb]:bounds[mb + 1]])
    finals = [model.norm(h) for h in microbatch.run_made(microbatch.mode(mode).make, layers, inputs)]
    cache.advance(rows)
    return finals[0] if split.serial else merge_outputs(split, *finals)


def _write(cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor, rows: KVRows) -> None:
    cache.write(layer, rows, k, v)


@torch.no_grad()
def continue_prefill(model: MoEModel, batch: Batch, cache: OffloadCache, offload: bool = True) -> torch.Tensor:
    """Prefill ``batch``'s new tokens after prefixes whose keys and values ``cache`` holds.

    ``batch.seq.prefix_lens`` are the tokens each request already prefilled, in the order an
    earlier prefill offloaded them. Layer ``L + 1``'s prefix is prefetched on the copy stream
    while layer ``L`` computes; with ``offload`` the new keys and values are appended to the cache.
    Runs layer by layer on the main stream (the expert-parallel exchanges synchronously).
    """
    n_prefix = batch.seq.num_prefix_tokens
    refusal = cut_refusal(model)
    if n_prefix and refusal:
        raise ValueError(f"the batch continues {n_prefix} prefix tokens, but {refusal}")
    held = [cache.tokens(i) for i in range(len(model.layers))]
    if any(h != n_prefix for h in held):
        raise ValueError(f"the batch continues {n_prefix} prefix tokens, but the cache holds {held} per layer")
    hidden = model.embed_tokens(batch.tokens)
    n_layers = len(model.layers)
    if n_prefix:
        cache.prefetch(0, 0, n_prefix)
    for layer in model.layers:
        i = layer.index
        if n_prefix and i + 1 < n_layers:
            cache.prefetch(i + 1, 0, n_prefix)  # lands while this layer computes
        prefix = cache.get(i, 0, n_prefix) if n_prefix else None
        hidden, k, v = layer.run(hidden, batch.seq, prefix)
        if offload:
            cache.offload(i, k, v)
    cache.finish()
    return model.norm(hidden)


def graph_prefill(model: MoEModel, batch: Batch, mode: str, split: Split, path: str,
                  compile_backend: Optional[Union[str, Callable[..., object]]] = None) -> Callable[[], torch.Tensor]:
    """The prefill of ``mode`` compiled as one graph on a torchair path (``ge`` or ``aclgraph``).

    The model's MoE blocks must have static shapes (`make_capacity_expert_parallel`). ``compile_backend``,
    what ``torch.compile`` uses, defaults to the path's own (`overlap.backends.Backend.compile_backend`:
    torchair's NPU backend in max-autotune for ``ge``, the ``npugraph_ex`` backend for ``aclgraph``).
    Returns a callable; its first call traces and compiles under ``path``.
    """
    if overlap.backends.get(path).torchair_mode is None:
        raise ValueError(f"graph_prefill compiles for a torchair graph path (ge or aclgraph), not {path!r}")
    layers = layer_operations(model)
    make = microbatch.mode(mode).make
    # checked and lowered here, once: the trace then holds the launches, not the lowering
    lowered = microbatch.lower_ahead(make, layers, micro_batch_inputs(model, batch, split), path)

    def run(tokens: torch.Tensor) -> torch.Tensor:
        return run_schedule(model, Batch(tokens, batch.seq), split, layers, make, lowered)

    compiled = torch.compile(run, backend=compile_backend or overlap.backends.get(path).compile_backend(),
                             fullgraph=True, dynamic=False)

    @torch.no_grad()
    def call() -> torch.Tensor:
        with overlap.use_path(path):
            return compiled(batch.tokens)
    return call


__all__ = ["after_attention", "continue_prefill", "graph_prefill", "layer_operations",
           "make_capacity_expert_parallel", "make_expert_parallel", "prefill", "prefill_cache", "split_for"]
