"""Expert-parallel token exchanges, the expert-parallel MoE layer, and wrapping of existing MoE modules.

An exchange moves tokens to their experts' ranks and back: one class per family behind one `typing.Protocol`
(`Exchange`: ``prepare`` / ``dispatch`` / ``run_experts`` / ``combine``): the uneven all-to-all
(`AllToAllExchange`, over `dispatch` / `combine`, which return handles to wait on in the style of DeepEP), the
static-shape capacity exchange (`CapacityExchange`, over `capacity_dispatch` / `capacity_combine`: it traces under
``torch.compile(fullgraph=True)``) and torch_npu's fused MC2 operators (`MC2Exchange`, over `mc2_dispatch` /
`mc2_combine`; ``ep_dispatch`` / ``ep_combine`` choose between MC2 and the all-to-all). Every family's handles and
batches also offer one interface (`collectives.handles`: `EPDispatchHandle`, `EPBatch`, `EPCombineHandle`).
Every family can send the tokens quantized per token (`collectives.quantize`: ``dispatch_dtype`` int8 / fp8, the
scales in the same exchange, the combine in the tokens' dtype).

`ExpertParallelMoE` is the one layer: an exchange for its stages (prefill), one for its decode steps, and one
experts object (`LocalExperts`); it exposes its stages as micro-batch operations (and runs them through the
micro-batch executor). `wrap_expert_parallel` shards an existing MoE block, recognised by its parts
(`find_moe_blocks` lists a model's candidates); `capacity_expert_parallel` is its static-shape form (graph
prefill), `mc2_expert_parallel` its MC2 form.
"""
from ._buffers import release as release_buffers
from .capacity import (CapacityBatch, CapacityCombineHandle, CapacityDispatchHandle, CapacityExchange,
                       capacity_combine, capacity_dispatch)
from .dispatch import (AllToAllExchange, CombineHandle, DispatchHandle, PendingDispatch, combine, dispatch,
                       dispatch_counts, exchange_counts)
from .exchange import Exchange, ExpertLayer, LayerShapes, RoutedTokens
from .experts import LocalExperts, grouped_mlp, resolve_impl
from .group import group_size
from .handles import EPBatch, EPCombineHandle, EPDispatchHandle
from .layer import ExpertParallelMoE, SharedExperts
from .layout import (DispatchLayout, ExpertBatch, LayoutError, check_routing, compute_layout, expand, reduce_local,
                     reduce_ranks)
from .mc2 import (DECODE_EXCHANGES, MC2_EXCHANGES, MC2Batch, MC2CombineHandle, MC2DispatchHandle, MC2Error,
                  MC2Exchange, check_mc2_buffer, choose_exchange, decode_exchange_named, ep_combine, ep_dispatch,
                  mc2_buffer_mb, mc2_combine, mc2_dispatch)
from .quantize import (DISPATCH_DTYPES, NonFiniteTokens, QuantizedTokens, dequantize, dispatch_dtype_name,
                       dispatch_dtype_of, quantize_per_token, wire_bytes_per_token)
from .reference import MoE, MoEConfig, combine_dense
from .quantized_experts import QuantizedExperts
from .values import MOE_ACTIVE, MOE_CAPACITY, MOE_IN, MOE_OUT
from .weight_quant import QuantizedLinear
from .wrap import TransformersRouter, capacity_expert_parallel, find_moe_blocks, mc2_expert_parallel, \
    wrap_expert_parallel

__all__ = [
    "AllToAllExchange", "CapacityBatch", "CapacityCombineHandle", "CapacityDispatchHandle", "CapacityExchange",
    "CombineHandle", "DECODE_EXCHANGES", "DISPATCH_DTYPES", "DispatchHandle", "DispatchLayout", "EPBatch",
    "EPCombineHandle", "EPDispatchHandle", "Exchange", "ExpertBatch", "ExpertLayer", "ExpertParallelMoE",
    "LayerShapes", "LayoutError", "LocalExperts", "MC2Batch", "MC2CombineHandle", "MC2DispatchHandle", "MC2Error",
    "MC2Exchange", "MC2_EXCHANGES", "MOE_ACTIVE", "MOE_CAPACITY", "MOE_IN", "MOE_OUT", "MoE", "MoEConfig",
    "NonFiniteTokens", "PendingDispatch", "QuantizedExperts", "QuantizedLinear", "QuantizedTokens", "RoutedTokens",
    "SharedExperts", "TransformersRouter", "capacity_combine", "capacity_dispatch", "capacity_expert_parallel",
    "check_mc2_buffer", "check_routing", "choose_exchange", "combine", "combine_dense", "compute_layout",
    "decode_exchange_named", "dequantize", "dispatch", "dispatch_counts", "dispatch_dtype_name", "dispatch_dtype_of",
    "ep_combine", "ep_dispatch", "exchange_counts", "expand", "find_moe_blocks", "group_size", "grouped_mlp",
    "mc2_buffer_mb", "mc2_combine", "mc2_dispatch", "mc2_expert_parallel", "quantize_per_token", "reduce_local",
    "reduce_ranks", "release_buffers", "resolve_impl", "wire_bytes_per_token", "wrap_expert_parallel",
]
