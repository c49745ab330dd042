"""Prefill of the reference model in one mode: eagerly through the micro-batch executor, or
compiled as one torchair graph (`graph_prefill`), or continued from an offloaded prefix
(`continue_prefill`).

Modes: ``serial`` (everything on the main stream: the reference), ``shared`` (one batch, shared
experts on their side stream beside dispatch / experts / combine on the EP stream) and
``two-batch`` (two micro-batches: one's dispatch and combine under the other's compute). With a
KV offload cache every layer's keys and values are offloaded right after its attention.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

import microbatch
import overlap
from collectives import CapacityExpertParallelMoE, wrap_expert_parallel
from microbatch import Operation
from microbatch.split import DEFAULT_MAX_IMBALANCE, DEFAULT_MIN_TOKENS, SplitPlan, decide_split

from .model import Batch, Model

MODES: Dict[str, Callable[..., microbatch.Schedule]] = {
    "serial": microbatch.serial,
    "shared": microbatch.shared_overlap,
    "two-batch": microbatch.two_batch,
}


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    return mode


def make_expert_parallel(model: Model, group: Optional[dist.ProcessGroup], impl: str = "auto") -> Model:
    """Replace every MoE block of ``model`` by its expert-parallel form over ``group`` (in place)."""
    model.replace_moe(lambda layer: wrap_expert_parallel(layer.moe, group, impl=impl))
    return model


def make_capacity_expert_parallel(model: Model, group: Optional[dist.ProcessGroup], capacity: int) -> Model:
    """Replace every MoE block by its static-shape expert-parallel form (graph paths; in place)."""
    model.replace_moe(lambda layer: CapacityExpertParallelMoE.wrap(layer.moe, group, capacity=capacity))
    return model


def serial_plan(batch: Batch, reason: str = "mode runs one batch") -> SplitPlan:
    return SplitPlan(tuple(batch.seq.seq_lens), None, reason)


def _offload(cache: Any, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    cache.offload(layer, k, v)  # appends after what the layer holds: micro-batch 0 is issued first


def layer_operations(model: Model, cache: Any = None) -> List[List[Operation]]:
    """The model's layers as operations; with ``cache``, an offload right after each attention.

    The offload operation runs on the main stream: the cache itself switches to the copy stream
    and places the events that order the copy after attention and the next write after the copy.
    """
    layers = model.layer_operations()
    if cache is None:
        return layers
    out = []
    for li, ops in enumerate(layers):
        at = next(i for i, op in enumerate(ops) if op.name == "attn") + 1
        offload = Operation("kv_offload", functools.partial(_offload, cache, li), ("k", "v"), ())
        out.append(ops[:at] + [offload] + ops[at:])
    return out


def plan_for(mode: str, batch: Batch, group: Optional[dist.ProcessGroup], *,
             min_tokens: int = DEFAULT_MIN_TOKENS, max_imbalance: float = DEFAULT_MAX_IMBALANCE) -> SplitPlan:
    """The micro-batch split of ``mode``: agreed by every rank of ``group`` for two-batch (one all-reduce)."""
    if check_mode(mode) != "two-batch":
        return serial_plan(batch)
    return decide_split(batch.seq.seq_lens, group, min_tokens=min_tokens, max_imbalance=max_imbalance)


@torch.no_grad()
def prefill(model: Model, batch: Batch, mode: str, plan: SplitPlan, cache: Any = None) -> torch.Tensor:
    """Final hidden states of ``batch`` computed with the schedule of ``mode`` (see the module docstring)."""
    layers = layer_operations(model, cache)
    inputs = model.pipeline_inputs(batch, plan)
    schedule = MODES[check_mode(mode)](layers, len(inputs))
    outputs = microbatch.run(schedule, layers, inputs)
    if cache is not None:
        cache.finish()
    return model.pipeline_output(outputs, plan)


@torch.no_grad()
def continue_prefill(model: Model, batch: Batch, cache: Any, offload: bool = True) -> torch.Tensor:
    """Prefill ``batch``'s new tokens after prefixes whose keys and values ``cache`` holds.

    ``batch.seq.prefix_lens`` are the tokens each request already prefilled, in the order an
    earlier prefill offloaded them. Layer ``L + 1``'s prefix is prefetched on the copy stream
    while layer ``L`` computes; with ``offload`` the new keys and values are appended to the cache.
    Runs layer by layer on the main stream (the expert-parallel exchanges synchronously).
    """
    n_prefix = batch.seq.num_prefix_tokens
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


def graph_prefill(model: Model, batch: Batch, mode: str, plan: SplitPlan, path: str,
                  backend: Any = None) -> Callable[[], torch.Tensor]:
    """The prefill of ``mode`` compiled as one graph on a torchair path (``ge`` or ``aclgraph``).

    The model's MoE blocks must have static shapes (`make_capacity_expert_parallel`). ``backend``
    defaults to torchair's NPU backend in max-autotune (``ge``) or reduce-overhead (``aclgraph``)
    mode. Returns a callable; its first call traces and compiles under ``path``.
    """
    if path not in ("ge", "aclgraph"):
        raise ValueError(f"graph_prefill compiles for the ge or aclgraph path, not {path!r}")
    layers = layer_operations(model)
    schedule = MODES[check_mode(mode)](layers, 1 if plan.serial else 2)

    def run(tokens: torch.Tensor) -> torch.Tensor:
        outputs = microbatch.run(schedule, layers, model.pipeline_inputs(Batch(tokens, batch.seq), plan))
        return model.pipeline_output(outputs, plan)

    compiled = torch.compile(run, backend=backend or torchair_backend(path), fullgraph=True, dynamic=False)

    @torch.no_grad()
    def call() -> torch.Tensor:
        with overlap.use_path(path):
            return compiled(batch.tokens)
    return call


def torchair_backend(path: str) -> Any:
    """torchair's NPU backend for ``path``: GE graph (max-autotune) or ACL graph (reduce-overhead)."""
    import torch_npu  # noqa: F401  (torchair needs it)
    import torchair

    config = torchair.CompilerConfig()
    config.mode = "max-autotune" if path == "ge" else "reduce-overhead"
    return torchair.get_npu_backend(compiler_config=config)
