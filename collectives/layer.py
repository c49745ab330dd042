"""The expert-parallel MoE layer, described as stages so that a pipeline can interleave micro-batches.

Stages (value names in brackets; ``moe_in`` is ``[tokens, hidden]``, ``moe_out`` the result):

==================  ==========  =============================================  ===================
stage               stream      reads                                          writes
==================  ==========  =============================================  ===================
gate                main        moe_in                                         moe_topk_idx, moe_topk_weights
dispatch_counts     ep_comm     moe_in, moe_topk_idx, moe_topk_weights         moe_counts
dispatch            ep_comm     moe_counts                                     moe_dispatch
shared_gate_up      shared      moe_in, moe_topk_idx*                          moe_shared_h
experts             main        moe_dispatch                                   moe_expert_out, moe_expert_batch
shared_act          shared      moe_shared_h, moe_dispatch*                    moe_shared_a
combine             ep_comm     moe_expert_out, moe_expert_batch, moe_dispatch moe_combine
shared_down         shared      moe_shared_a, moe_in, moe_expert_out*          moe_shared_out
finalize            main        moe_combine, moe_shared_out                    moe_out
==================  ==========  =============================================  ===================

Reads marked * are ordering edges only, as production code places them: the shared experts'
gate/up runs beside the dispatch, their activation beside the routed experts and their down
projection beside the combine. Without shared experts the shared stages are left out; with
``overlap_shared=False`` they run on the main stream.

The stages are `microbatch.Operation` s. Their functions keep no state on the module:
everything, including the in-flight exchange (the exchange's dispatch and combine handles), travels as
a value, so two micro-batches can interleave. They do not enter streams or wait: the micro-batch
executor places each on its ``stream`` and derives the events where a value crosses streams,
for ``forward`` (the stages in order) as for a pipeline schedule. The one host block is the
dispatch's count exchange (see `collectives.dispatch`), and it is its own stage: ``dispatch_counts``
issues the count exchange without reading it (`collectives.dispatch_counts`) and ``dispatch`` reads
the counts and sends the tokens (`PendingDispatch.dispatch`), so a schedule can issue the other
micro-batches' work in between and the host does not hold it back while it waits for the slower
rank. Where the exchange stream has a thread of its own (the CPU path), ``dispatch_counts`` hands
the read and the tokens to it (`PendingDispatch.issue_ahead`), which sends them as soon as the
counts arrive, under the compute issued meanwhile, as a device's comm stream would; ``dispatch``
takes the handle (``two_step_dispatch=False``, or setting the attribute, gives the one ``dispatch`` stage that
reads ``moe_in, moe_topk_idx, moe_topk_weights``; the capacity and MC2 exchanges have no count
exchange and always take one stage).

On its first dispatch over more than one rank the layer checks, with one small all-reduce before
any exchange, that every rank agrees on the hidden size, expert count, top-k and tokens' dtype,
and that every rank's experts take tokens of that hidden size (`collectives.exchange.LayerShapes`; an
exchange with an agreement of its own folds it in); otherwise every rank raises
`LayoutError` naming the field instead of hanging or aborting in the exchange. Skipped while
compiling (nothing can be read on the host there): agreement is then the caller's job. The gate
refuses tokens of another dtype than this rank's experts (`LayoutError` naming both dtypes, before
any collective; a dtype comparison per call), which would otherwise fail in a matmul after the exchange.

Exchanges: the layer holds one for its stages (``exchange``: `stages` and `forward`, a prefill; default the
all-to-all, `collectives.dispatch.AllToAllExchange`) and one for its decode steps (``decode_exchange``: default
the capacity exchange, `collectives.capacity.CapacityExchange.for_decode`), and one experts object
(`collectives.LocalExperts`). Each stage calls one method of its exchange (`collectives.exchange.Exchange`:
``prepare`` / ``dispatch`` / ``run_experts`` / ``combine``), so a new exchange is one new class, plugged in as it is.

Decode stages (`ExpertParallelMoE.decode_stages`): a decode step reads nothing on the host and keeps every shape
static, so that it can be captured. Its dispatch also reads ``MOE_CAPACITY``, rows per destination rank: a value of
the micro-batch that the caller sets the same on every rank and at least the micro-batch's token count on each
(`launch.engine` takes the step's bucket of the widest micro-batch over the ranks): a token goes at most once to
each rank, so no rank can send more than its tokens to one rank and nothing can overflow. A capacity below this
rank's tokens is refused before the exchange (a host comparison of shapes, not of values). It also reads
``MOE_ACTIVE``, None where every row is real, else a bool ``[T]`` on the device, False for a padding row (a
captured step pads its micro-batches to the bucket, `launch.engine.graph_decoder`): the decode exchange sends such a row
to no expert (the capacity exchange with expert id -1 on every rank, the same bytes; MC2 leaves it out with
``x_active_mask``, the real rows first, as the bucket's layout puts them). Routed as a real token it would cost
expert rows, and since every padding row carries the same token and history they would all choose the same
experts: with half a bucket of padding, their ranks compute half a bucket's rows more.

Chunks: with ``chunks`` = K > 1 the tokens are cut into K slices of ``ceil(T / K)`` rows (the last ones may be
short or empty) after the gate, each with a capacity of ``ceil(capacity / K)``, and the stages are listed
as a pipeline: ``dispatch_0, dispatch_1, experts_0, combine_0, dispatch_2, experts_1, combine_1, ...``. On
the communication stream, chunk i+1's dispatch runs while the experts compute chunk i, and chunk i's
combine while they compute chunk i+1; attention and the gate see the whole batch, so their matmuls do not
shrink as they do when a small batch is split into micro-batches. Every rank runs K exchanges per layer,
whatever its token count.
"""
from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import microbatch
from microbatch import Operation
from overlap import DEFAULT, EP_COMM, SHARED_EXPERT

from .capacity import CapacityExchange
from .dispatch import AllToAllExchange
from .exchange import Exchange, LayerShapes, RoutedTokens
from .experts import LocalExperts
from .group import group_size
from .layout import LayoutError
from .quantize import DispatchDtype, dispatch_dtype_of
from .reference import MoEConfig, Router
from .values import MOE_ACTIVE, MOE_CAPACITY, MOE_IN, MOE_OUT

_ROUTED = ("moe_topk_idx", "moe_topk_weights")
_STEP = (MOE_CAPACITY, MOE_ACTIVE)  # what the caller gives each micro-batch of a decode step
_Chunk = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, Optional[torch.Tensor]]  # x, ids, weights, cap, active


class SharedExperts(nn.Module):
    """Shared experts split into the three steps that overlap the routed path.

    Wraps an MLP with ``gate_proj``, ``up_proj`` and ``down_proj`` (no copy of its weights);
    ``output_gate`` (Qwen2-MoE's ``shared_expert_gate``) scales the output by ``sigmoid(gate(x))``.
    """

    def __init__(self, mlp: nn.Module, act: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 output_gate: Optional[nn.Module] = None):
        super().__init__()
        for name in ("gate_proj", "up_proj", "down_proj"):
            if not isinstance(getattr(mlp, name, None), nn.Module):
                raise TypeError(f"shared experts need a {name} module; {type(mlp).__name__} has none")
        self.mlp = mlp
        self.act = act or getattr(mlp, "act_fn", None) or F.silu
        self.output_gate = output_gate

    def gate_up(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.mlp.gate_proj(x), self.mlp.up_proj(x)

    def activation(self, h: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.act(h[0]) * h[1]

    def down(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp.down_proj(a)
        if self.output_gate is not None:
            out = torch.sigmoid(self.output_gate(x)) * out
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(self.gate_up(x)), x)


class ExpertParallelMoE(nn.Module):
    """Router, routed experts sharded over the EP group, optional shared experts on a side stream.

    ``router(x)`` returns ``(topk_idx [T, k], topk_weights [T, k])``; ``experts`` holds this rank's
    ``num_experts / group size`` experts, placed contiguously. ``forward`` composes `stages`.
    ``two_step_dispatch``: the count exchange and the tokens as two stages where the exchange has a count
    exchange (see the module docstring). ``exchange``: what `stages` and ``forward`` exchange through (default
    the all-to-all); ``decode_exchange``: what `decode_stages` do (default the capacity exchange): any
    `collectives.exchange.Exchange`. ``dispatch_dtype``: how tokens travel to their experts in both
    (`collectives.quantize`): ``"int8"`` / ``"fp8"`` (or their torch dtypes) quantized per token, their scales in
    the same exchange; None or ``"bf16"``: in the tokens' own dtype. The combine stays in the tokens' dtype.
    """

    def __init__(self, router: nn.Module, experts: LocalExperts, num_experts: int,
                 group: Optional[dist.ProcessGroup] = None, shared: Optional[SharedExperts] = None,
                 overlap_shared: bool = True, *, two_step_dispatch: bool = True, exchange: Optional[Exchange] = None,
                 decode_exchange: Optional[Exchange] = None, dispatch_dtype: DispatchDtype = None):
        super().__init__()
        world = group_size(group)
        if num_experts % world:
            raise LayoutError(f"{num_experts} experts cannot be sharded over an expert-parallel group of "
                              f"{world} ranks: the expert count must be a multiple of the group size")
        if experts.num_local * world != num_experts:
            raise LayoutError(f"this rank holds {experts.num_local} experts, but {num_experts} experts over "
                              f"{world} ranks means {num_experts // world} per rank")
        self.router = router
        self.experts = experts
        self.shared = shared
        self.num_experts = num_experts
        self.group = group
        self.overlap_shared = overlap_shared
        self.two_step_dispatch = two_step_dispatch
        self.exchange: Exchange = AllToAllExchange() if exchange is None else exchange
        self.decode_exchange: Exchange = CapacityExchange.for_decode() if decode_exchange is None else decode_exchange
        self.shapes = LayerShapes()  # the ranks' agreement on the layer's shapes (see the module docstring)
        self.dispatch_dtype: Optional[torch.dtype] = dispatch_dtype_of(dispatch_dtype)

    @classmethod
    def from_config(cls, cfg: MoEConfig, group: Optional[dist.ProcessGroup] = None, *, rank: Optional[int] = None,
                    overlap_shared: bool = True, impl: str = "auto", exchange: Optional[Exchange] = None,
                    decode_exchange: Optional[Exchange] = None,
                    dispatch_dtype: DispatchDtype = None) -> "ExpertParallelMoE":
        """A freshly initialised layer with the reference router (softmax / sigmoid top-k, optional norm)."""
        world = group_size(group)
        if cfg.n_experts % world:
            raise LayoutError(f"{cfg.n_experts} experts are not divisible by the group size {world}")
        if rank is None:
            rank = dist.get_rank(group) if dist.is_initialized() else 0
        n = cfg.n_experts // world
        gate_up = torch.randn(n, 2 * cfg.ffn, cfg.hidden) * cfg.hidden ** -0.5
        down = torch.randn(n, cfg.hidden, cfg.ffn) * cfg.ffn ** -0.5
        shared = None
        if cfg.n_shared:
            from .reference import Expert

            shared = SharedExperts(Expert(cfg.hidden, cfg.ffn * cfg.n_shared), act=F.silu)
        return cls(Router(cfg), LocalExperts(gate_up, down, rank * n, F.silu, impl), cfg.n_experts, group, shared,
                   overlap_shared, exchange=exchange, decode_exchange=decode_exchange, dispatch_dtype=dispatch_dtype)

    # --- stage functions: pure in their arguments (the exchange's are `_Stages`') -------------------
    def _gate(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        self._check_dtype(x)
        return self.router(x)

    def _check_dtype(self, x: torch.Tensor) -> None:
        """Tokens of another dtype than this rank's experts would fail in a matmul after the exchange: refuse
        them in the gate, before any collective (not under autocast, which casts them)."""
        weights = getattr(self.experts, "gate_up", None)
        if not isinstance(weights, torch.Tensor) or x.dtype == weights.dtype:
            return
        if torch.is_autocast_enabled(x.device.type):
            return
        raise LayoutError(f"the tokens are {x.dtype} but this layer's experts are {weights.dtype}: cast the tokens "
                          f"(x.to({weights.dtype})) or the layer (layer.to({x.dtype})) first")

    def _shared_gate_up(self, x: torch.Tensor, _order: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.shared.gate_up(x)

    def _shared_act(self, h: Tuple[torch.Tensor, torch.Tensor], _order: Any) -> torch.Tensor:
        return self.shared.activation(h)

    def _shared_down(self, a: torch.Tensor, x: torch.Tensor, _order: Any) -> torch.Tensor:
        return self.shared.down(a, x)

    def _finalize(self, combined: Any, shared_out: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = combined.wait()
        return out if shared_out is None else out + shared_out

    # --- the stages -------------------------------------------------------------------------------
    def stages(self) -> List[Operation]:
        """The layer as operations for one micro-batch, in an order that is valid to run serially."""
        over = _Stages(self, self.exchange)
        routed = (MOE_IN,) + _ROUTED
        if self.two_step_dispatch and self.exchange.two_step(self):
            dispatch = [Operation("dispatch_counts", over.prepare, routed, ("moe_counts",), EP_COMM),
                        Operation("dispatch", over.dispatch_prepared, ("moe_counts",), ("moe_dispatch",), EP_COMM)]
        else:
            dispatch = [Operation("dispatch", over.dispatch, routed, ("moe_dispatch",), EP_COMM)]
        return self._compose(dispatch, over)

    def decode_stages(self, chunks: int = 1) -> List[Operation]:
        """The layer for a decode step, over its ``decode_exchange``: no host sync, static shapes.

        The dispatch also reads ``MOE_CAPACITY`` (rows per destination rank, the same on every rank and at
        least the micro-batch's tokens on each, so nothing can overflow) and ``MOE_ACTIVE`` (None, or bool
        ``[tokens]``: False for a padding row, which no expert computes); ``chunks`` (1 to 8) > 1 runs the routed
        experts in that many chunks of the tokens, each dispatched and combined under the others' experts (see
        the module docstring).
        """
        if not 1 <= int(chunks) <= 8:
            raise ValueError(f"the MoE runs in 1 to 8 chunks, got {chunks}")
        over = _Stages(self, self.decode_exchange)
        if chunks == 1:
            dispatch = [Operation("dispatch", over.dispatch_step, (MOE_IN,) + _ROUTED + _STEP, ("moe_dispatch",),
                                  EP_COMM)]
            return self._compose(dispatch, over)
        return self._chunked(over, int(chunks))

    def _compose(self, dispatch: List[Operation], over: "_Stages") -> List[Operation]:
        """Gate, ``dispatch`` (writing ``moe_dispatch``), shared experts, routed experts, combine, finalize."""
        side = SHARED_EXPERT if self.overlap_shared else DEFAULT
        st = [Operation("gate", self._gate, (MOE_IN,), _ROUTED, DEFAULT)] + dispatch
        if self.shared is not None:
            st.append(Operation("shared_gate_up", self._shared_gate_up, (MOE_IN, "moe_topk_idx"), ("moe_shared_h",),
                                side))
        st.append(Operation("experts", over.experts, ("moe_dispatch",), ("moe_expert_out", "moe_expert_batch"),
                            DEFAULT))
        if self.shared is not None:
            st.append(Operation("shared_act", self._shared_act, ("moe_shared_h", "moe_dispatch"), ("moe_shared_a",),
                                side))
        st.append(Operation("combine", over.combine, ("moe_expert_out", "moe_expert_batch", "moe_dispatch"),
                            ("moe_combine",), EP_COMM))
        return st + self._finish(side, "moe_expert_out", ("moe_combine",))

    def _chunked(self, over: "_Stages", k: int) -> List[Operation]:
        """Gate, cut, then per chunk dispatch / experts / combine as a pipeline, the shared experts beside it."""
        side = SHARED_EXPERT if self.overlap_shared else DEFAULT
        d, e, c = (lambda i: f"moe_dispatch_{i}"), (lambda i: f"moe_expert_out_{i}"), (lambda i: f"moe_combine_{i}")
        ops = [Operation("gate", self._gate, (MOE_IN,), _ROUTED, DEFAULT),
               Operation("cut", _Cut(k), (MOE_IN,) + _ROUTED + _STEP, tuple(f"moe_chunk_{i}" for i in range(k)),
                         DEFAULT)]

        def dispatch(i: int) -> Operation:
            return Operation(f"dispatch_{i}", over.dispatch_chunk, (f"moe_chunk_{i}",), (d(i),), EP_COMM)

        def experts(i: int) -> Operation:
            return Operation(f"experts_{i}", over.experts, (d(i),), (e(i), f"moe_expert_batch_{i}"), DEFAULT)

        def combine(i: int) -> Operation:
            return Operation(f"combine_{i}", over.combine, (e(i), f"moe_expert_batch_{i}", d(i)), (c(i),), EP_COMM)

        ops += [dispatch(0)]
        if self.shared is not None:
            ops.append(Operation("shared_gate_up", self._shared_gate_up, (MOE_IN, "moe_topk_idx"), ("moe_shared_h",),
                                 side))
        ops += [dispatch(1)]
        for i in range(k):  # experts i, combine i, then the dispatch two ahead: the comm stream keeps this order
            ops += [experts(i), combine(i)] + ([dispatch(i + 2)] if i + 2 < k else [])
            if i == 0 and self.shared is not None:
                ops.append(Operation("shared_act", self._shared_act, ("moe_shared_h", d(0)), ("moe_shared_a",), side))
        return ops + self._finish(side, e(k - 1), tuple(c(i) for i in range(k)))

    def _finish(self, side: str, last_expert_out: str, combined: Tuple[str, ...]) -> List[Operation]:
        """The shared experts' down projection (beside the last combine) and the finalize that sums ``combined``
        (one combine's handle, or several chunks' in token order) and the shared output."""
        st = []
        if self.shared is not None:
            st.append(Operation("shared_down", self._shared_down, ("moe_shared_a", MOE_IN, last_expert_out),
                                ("moe_shared_out",), side))
        reads = combined + (("moe_shared_out",) if self.shared is not None else ())
        finalize = self._finalize if len(combined) == 1 else _ChunksFinalize(len(combined))
        st.append(Operation("finalize", finalize, reads, (MOE_OUT,), DEFAULT))
        return st

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The stages in order, each on its stream, through the micro-batch executor."""
        shape = x.shape
        ops = self.stages()
        (out,) = microbatch.run(microbatch.as_listed([ops]), [ops], [{MOE_IN: x.reshape(-1, shape[-1])}],
                                output=MOE_OUT)
        return out.reshape(shape)


class _Stages:
    """The stage functions of one layer over one of its exchanges (pure in their arguments: what is in flight
    travels as a value)."""

    def __init__(self, layer: ExpertParallelMoE, exchange: Exchange):
        self.layer, self.exchange = layer, exchange

    def _routed(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, capacity: Optional[int] = None,
                active: Optional[torch.Tensor] = None) -> RoutedTokens:
        return RoutedTokens(x, idx, weights, capacity, active, dispatch_dtype=self.layer.dispatch_dtype)

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> object:
        return self.exchange.dispatch(self.exchange.prepare(self._routed(x, idx, weights), self.layer))

    def prepare(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> object:
        return self.exchange.prepare(self._routed(x, idx, weights), self.layer, ahead=True)

    def dispatch_prepared(self, prepared: object) -> object:
        return self.exchange.dispatch(prepared)

    def dispatch_step(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, capacity: int,
                      active: Optional[torch.Tensor]) -> object:
        """A decode step's dispatch: ``capacity`` rows to every rank, padding rows (``active`` False) to no expert."""
        _check_step_capacity(capacity, x.shape[0])
        tokens = self._routed(x, idx, weights, capacity, active)
        return self.exchange.dispatch(self.exchange.prepare(tokens, self.layer))

    def dispatch_chunk(self, chunk: _Chunk) -> object:
        return self.dispatch_step(*chunk)

    def experts(self, handle: object) -> Tuple[torch.Tensor, object]:
        return self.exchange.run_experts(handle, self.layer.experts)

    def combine(self, y: torch.Tensor, batch: object, handle: object) -> Any:
        return self.exchange.combine(y, batch, handle)


class _Cut:
    """The tokens, their routing, the capacity and the real rows cut into ``k`` chunks of ``ceil(T / k)`` rows."""

    def __init__(self, k: int):
        self.k = k

    def __call__(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, capacity: int,
                 active: Optional[torch.Tensor]) -> Tuple[_Chunk, ...]:
        _check_step_capacity(capacity, x.shape[0])
        rows = math.ceil(x.shape[0] / self.k)
        cap = math.ceil(int(capacity) / self.k)
        cut = [slice(i * rows, (i + 1) * rows) for i in range(self.k)]
        return tuple((x[c], idx[c], weights[c], cap, None if active is None else active[c]) for c in cut)


def _check_step_capacity(capacity: Any, tokens: int) -> None:
    if not isinstance(capacity, int) or capacity < tokens:
        raise LayoutError(f"a decode step's capacity must be an int of at least its {tokens} tokens on every rank "
                          f"(the same on each: the widest micro-batch over the ranks), got {capacity!r}")


class _ChunksFinalize:
    """The finalize of a layer whose routed experts ran in ``n`` chunks: their combined rows in token order, plus
    the shared experts' output where there is one."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, *handles: Any) -> torch.Tensor:
        out = torch.cat([h.wait() for h in handles[:self.n]])
        return out if len(handles) == self.n else out + handles[self.n]
