"""Expert-parallel token dispatch and combine, the expert-parallel MoE layer, and wrapping of existing MoE modules.

Dispatch / combine (`dispatch`, `combine`) run over uneven ``all_to_all_single`` on the EP
communication stream and return handles to wait on, in the style of DeepEP; `ExpertParallelMoE`
exposes its stages as micro-batch operations (and runs them through the micro-batch executor);
`wrap_expert_parallel` shards an existing MoE block, recognised by its parts (`find_moe_blocks` lists a
model's candidates).
`CapacityExpertParallelMoE` is its static-shape form (a fixed per-rank capacity), which traces
under ``torch.compile(fullgraph=True)``. `collectives.mc2` is a second dispatch / combine backend:
torch_npu's fused MC2 operators behind the same handles (`ep_dispatch` / `ep_combine` choose). Every
family's handles and batches offer one interface (`collectives.handles`: `EPDispatchHandle`, `EPBatch`,
`EPCombineHandle`), so code written against it runs unchanged on each.
"""
from ._buffers import release as release_buffers
from .capacity import CapacityBatch, CapacityCombineHandle, CapacityDispatchHandle, capacity_combine, capacity_dispatch
from .capacity_layer import CapacityExpertParallelMoE
from .dispatch import (CombineHandle, DispatchHandle, PendingDispatch, combine, dispatch, dispatch_counts,
                       exchange_counts, group_size)
from .experts import LocalExperts, grouped_mlp, resolve_impl
from .handles import EPBatch, EPCombineHandle, EPDispatchHandle
from .layer import ExpertParallelMoE, SharedExperts
from .values import MOE_ACTIVE, MOE_CAPACITY, MOE_IN, MOE_OUT
from .layout import (DispatchLayout, ExpertBatch, LayoutError, check_routing, compute_layout, expand, reduce_local,
                     reduce_ranks)
from .mc2 import (MC2Batch, MC2CombineHandle, MC2DispatchHandle, MC2Error, MC2ExpertParallelMoE, check_mc2_buffer,
                  choose_backend, ep_combine, ep_dispatch, mc2_buffer_mb, mc2_combine, mc2_dispatch)
from .reference import MoE, MoEConfig, combine_dense
from .wrap import TransformersRouter, find_moe_blocks, wrap_expert_parallel

__all__ = [
    "CapacityBatch", "CapacityCombineHandle", "CapacityDispatchHandle", "CapacityExpertParallelMoE",
    "capacity_combine", "capacity_dispatch", "CombineHandle", "PendingDispatch", "DispatchHandle", "DispatchLayout", "EPBatch",
    "EPCombineHandle", "EPDispatchHandle", "ExpertBatch", "ExpertParallelMoE", "LayoutError", "LocalExperts",
    "MC2Batch", "MC2CombineHandle", "MC2DispatchHandle", "MC2Error", "MC2ExpertParallelMoE", "MOE_ACTIVE",
    "MOE_CAPACITY", "MOE_IN", "MOE_OUT",
    "MoE", "MoEConfig", "SharedExperts", "TransformersRouter", "check_mc2_buffer", "check_routing",
    "choose_backend", "combine", "combine_dense", "compute_layout", "dispatch", "ep_combine", "ep_dispatch",
    "dispatch_counts", "exchange_counts", "expand", "find_moe_blocks", "group_size", "grouped_mlp", "mc2_buffer_mb", "mc2_combine",
    "mc2_dispatch", "reduce_local", "reduce_ranks", "release_buffers", "resolve_impl", "wrap_expert_parallel",
]
