"""The MoE layer's decode stages: a static-shape exchange with no host sync, optionally in chunks.

`ExpertParallelMoE.stages` learns how many rows each rank receives from a count exchange the host reads,
and groups them per expert with host counts: a host sync per layer, and shapes that a graph cannot
capture. A decode step needs neither. Its stages (`decode_stages`) exchange a fixed ``capacity`` rows with
every rank (`collectives.capacity_dispatch` without its checks: nothing read on the host; the rows' metadata
travels with them in the same all-to-all, so a dispatch is one exchange), group the
received (row, slot) pairs by local expert with a stable sort on the device, run the experts on a device
group list, and send the reduced rows back with the same static splits.

Capacity: the dispatch reads ``MOE_CAPACITY``, a value of the micro-batch that the caller sets the same on
every rank and at least the micro-batch's token count on each (`launch.decode` takes the step's bucket of the
widest micro-batch over the ranks): a token goes at most once to each rank, so no rank can send more than
its tokens to one rank and nothing can overflow. A capacity below this rank's tokens is refused before the
exchange (a host comparison of shapes, not of values).

Padding rows: the dispatch also reads ``MOE_ACTIVE``, None where every row is real, else a bool ``[T]`` on the
device, False for a padding row (a captured step pads its micro-batches to the bucket, `launch.graph_decode`).
A padding row takes no expert: the capacity exchange sends it with expert id -1 on every rank (the same bytes),
MC2 leaves it out (``x_active_mask``; the real rows first, as the bucket's layout puts them). Routed as a real
token it would cost expert rows, and since every padding row carries the same token and history they would all
choose the same experts: with half a bucket of padding, their ranks compute half a bucket's rows more.

Chunks: with ``chunks`` = K > 1 the tokens are cut into K slices of ``ceil(T / K)`` rows (the last ones may be
short or empty) after the gate, each with a capacity of ``ceil(capacity / K)``, and the stages are listed
as a pipeline: ``dispatch_0, dispatch_1, experts_0, combine_0, dispatch_2, experts_1, combine_1, ...``. On
the communication stream, chunk i+1's dispatch runs while the experts compute chunk i, and chunk i's
combine while they compute chunk i+1; attention and the gate see the whole batch, so their matmuls do not
shrink as they do when a small batch is split into micro-batches. Every rank runs K exchanges per layer,
whatever its token count.

The experts take the grouped matmul of the path (`collectives.experts.device_group_impl`); where there is
none (an unaligned shape, float32 on CUDA) experts of the plain form run every local expert over every
received row (the capacity layer's ``"all"`` path, still no host read), and other forms the loop over host
counts: one host sync per layer, which `overlap.HostSyncs` shows.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import torch

from microbatch import Operation
from overlap import DEFAULT, EP_COMM, SHARED_EXPERT

from ._grouping import ROUTING_OPS, GroupedRows, group_rows
from .capacity import CapacityDispatchHandle, _capacity_dispatch, all_local_experts, \
    capacity_combine, expert_path, grouped_experts
from .experts import device_group_impl, torch_npu_with
from .layout import LayoutError
from .values import MOE_ACTIVE, MOE_CAPACITY, MOE_IN

if TYPE_CHECKING:
    from .layer import ExpertParallelMoE

_ROUTED = ("moe_topk_idx", "moe_topk_weights")
_STEP = (MOE_CAPACITY, MOE_ACTIVE)  # what the caller gives each micro-batch of a decode step
_Chunk = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, Optional[torch.Tensor]]  # x, ids, weights, cap, active


def decode_stages(layer: "ExpertParallelMoE", chunks: int = 1) -> List[Operation]:
    """``layer``'s stages for a decode step (see the module docstring); ``chunks``: 1 to 8."""
    if not 1 <= int(chunks) <= 8:
        raise ValueError(f"the MoE runs in 1 to 8 chunks, got {chunks}")
    step = _StaticStep(layer)
    if chunks == 1:
        dispatch = [Operation("dispatch", step.dispatch, (MOE_IN,) + _ROUTED + _STEP, ("moe_dispatch",), EP_COMM)]
        return layer._compose(dispatch, step.experts, step.combine)
    return _chunked(layer, step, int(chunks))


def _chunked(layer: "ExpertParallelMoE", step: "_StaticStep", k: int) -> List[Operation]:
    """Gate, cut, then per chunk dispatch / experts / combine as a pipeline, the shared experts beside it."""
    side = SHARED_EXPERT if layer.overlap_shared else DEFAULT
    d, e, c = (lambda i: f"moe_dispatch_{i}"), (lambda i: f"moe_expert_out_{i}"), (lambda i: f"moe_combine_{i}")
    ops = [Operation("gate", layer._gate, (MOE_IN,), _ROUTED, DEFAULT),
           Operation("cut", _Cut(k), (MOE_IN,) + _ROUTED + _STEP, tuple(f"moe_chunk_{i}" for i in range(k)), DEFAULT)]

    def dispatch(i: int) -> Operation:
        return Operation(f"dispatch_{i}", step.dispatch_chunk, (f"moe_chunk_{i}",), (d(i),), EP_COMM)

    def experts(i: int) -> Operation:
        return Operation(f"experts_{i}", step.experts, (d(i),), (e(i), f"moe_expert_batch_{i}"), DEFAULT)

    def combine(i: int) -> Operation:
        return Operation(f"combine_{i}", step.combine, (e(i), f"moe_expert_batch_{i}", d(i)), (c(i),), EP_COMM)

    ops += [dispatch(0)]
    if layer.shared is not None:
        ops.append(Operation("shared_gate_up", layer._shared_gate_up, (MOE_IN, "moe_topk_idx"), ("moe_shared_h",),
                             side))
    ops += [dispatch(1)]
    for i in range(k):  # experts i, combine i, then the dispatch two ahead: the comm stream keeps this order
        ops += [experts(i), combine(i)] + ([dispatch(i + 2)] if i + 2 < k else [])
        if i == 0 and layer.shared is not None:
            ops.append(Operation("shared_act", layer._shared_act, ("moe_shared_h", d(0)), ("moe_shared_a",), side))
    return ops + layer._finish(side, e(k - 1), tuple(c(i) for i in range(k)))


class _Cut:
    """The tokens, their routing, the capacity and the real rows cut into ``k`` chunks of ``ceil(T / k)`` rows."""

    def __init__(self, k: int):
        self.k = k

    def __call__(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, capacity: int,
                 active: Optional[torch.Tensor]) -> Tuple[_Chunk, ...]:
        _check_capacity(capacity, x.shape[0])
        rows = math.ceil(x.shape[0] / self.k)
        cap = math.ceil(int(capacity) / self.k)
        cut = [slice(i * rows, (i + 1) * rows) for i in range(self.k)]
        return tuple((x[c], idx[c], weights[c], cap, None if active is None else active[c]) for c in cut)


def _check_capacity(capacity: Any, tokens: int) -> None:
    if not isinstance(capacity, int) or capacity < tokens:
        raise LayoutError(f"a decode step's capacity must be an int of at least its {tokens} tokens on every rank "
                          f"(the same on each: the widest micro-batch over the ranks), got {capacity!r}")


class _StaticStep:
    """The stage functions of `decode_stages`, bound to one layer (pure in their arguments)."""

    def __init__(self, layer: "ExpertParallelMoE"):
        self.layer = layer

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, capacity: int,
                 active: Optional[torch.Tensor]) -> Any:
        _check_capacity(capacity, x.shape[0])
        return self.layer._decode_dispatch(x, idx, weights, capacity, active)

    def dispatch_chunk(self, chunk: _Chunk) -> Any:
        return self.dispatch(*chunk)

    def experts(self, handle: Any) -> Tuple[torch.Tensor, Any]:
        if not isinstance(handle, CapacityDispatchHandle):  # another static exchange (MC2): the layer's own
            return self.layer._experts(handle)
        experts = self.layer.experts
        plain = getattr(experts, "plain", True)
        which = expert_path("auto", handle.recv_x, experts) if plain else _device_impl(handle.recv_x, experts)
        if which == "all":
            return all_local_experts(handle.recv_x, experts), (handle.recv_ids, handle.recv_weights)
        if plain:
            return grouped_experts(handle.recv_x, handle.recv_ids, handle.recv_weights, experts, which)
        npu = torch_npu_with(*ROUTING_OPS) if which == "npu_grouped" else None
        grouped = group_rows(handle.recv_x, handle.recv_ids, handle.recv_weights, experts.num_local, npu)
        return experts(grouped.x, grouped.group_list, impl=which or "loop"), grouped

    def combine(self, y: torch.Tensor, batch: Any, handle: Any) -> Any:
        if not isinstance(handle, CapacityDispatchHandle):
            return self.layer._combine(y, batch, handle)
        return capacity_combine(y, handle, grouped=batch if isinstance(batch, GroupedRows) else None)


def capacity_exchange(layer: "ExpertParallelMoE", x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                      capacity: int, active: Optional[torch.Tensor] = None) -> CapacityDispatchHandle:
    """A decode step's static exchange: ``capacity`` rows to every rank, the rows' metadata with them; ``active``
    False: a padding row, sent with no expert."""
    layer._check_shapes_once(x, idx)  # one all-reduce on the layer's first call: the prefill's, as a rule
    return _capacity_dispatch(x, idx, weights, layer.num_experts, layer.group, capacity, False, one_exchange=True,
                              active=active)


def _device_impl(x: torch.Tensor, experts: Any) -> Optional[str]:
    return device_group_impl(x, experts.gate_up, experts.down)


__all__ = ["capacity_exchange", "decode_stages"]
