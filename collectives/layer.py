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
everything, including the in-flight exchange (a `DispatchHandle` / `CombineHandle`), travels as
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
reads ``moe_in, moe_topk_idx, moe_topk_weights``; the static-shape and MC2 layers have no count
exchange and always take one stage).

On its first dispatch over more than one rank the layer checks, with one small all-reduce before
any exchange, that every rank agrees on the hidden size, expert count, top-k and tokens' dtype,
and that every rank's experts take tokens of that hidden size; otherwise every rank raises
`LayoutError` naming the field instead of hanging or aborting in the exchange. Skipped while
compiling (nothing can be read on the host there): agreement is then the caller's job. The gate
refuses tokens of another dtype than this rank's experts (`LayoutError` naming both dtypes, before
any collective; a dtype comparison per call), which would otherwise fail in a matmul after the exchange.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import microbatch
from microbatch import Operation
from overlap import DEFAULT, EP_COMM, SHARED_EXPERT, GroupTransport, agree

from .dispatch import CombineHandle, DispatchHandle, PendingDispatch, _peers, combine, dispatch, dispatch_counts, \
    group_size
from .experts import LocalExperts
from .layout import AGREED_HINTS, ExpertBatch, LayoutError, fields_by_name, layer_fields
from .reference import MoEConfig, Router
from .static_step import capacity_exchange, decode_stages
from .values import MOE_IN, MOE_OUT




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
    ``two_step_dispatch``: the count exchange and the tokens as two stages (see the module docstring).
    """

    def __init__(self, router: nn.Module, experts: LocalExperts, num_experts: int,
                 group: Optional[dist.ProcessGroup] = None, shared: Optional[SharedExperts] = None,
                 overlap_shared: bool = True, *, two_step_dispatch: bool = True):
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
        self._shapes_checked = False  # set once the ranks agreed on the layer's shapes (see the module docstring)

    @classmethod
    def from_config(cls, cfg: MoEConfig, group: Optional[dist.ProcessGroup] = None, *, rank: Optional[int] = None,
                    overlap_shared: bool = True, impl: str = "auto") -> "ExpertParallelMoE":
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
                   overlap_shared)

    # --- stage functions: pure in their arguments -------------------------------------------------
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

    def _check_experts(self, x: torch.Tensor) -> None:
        """This rank's experts must take the tokens' hidden size (else they fail on this rank only, mid-layer)."""
        weights = getattr(self.experts, "gate_up", None)
        hidden = weights.shape[-1] if isinstance(weights, torch.Tensor) else None
        if hidden is not None and (x.dim() != 2 or x.shape[1] != hidden):
            raise LayoutError(f"this rank's experts take hidden size {hidden}, but the tokens are "
                              f"{tuple(x.shape)}")

    def _shapes_unchecked(self) -> bool:
        """Whether the ranks have yet to check that they pass this layer the same shapes (never while compiling)."""
        return not self._shapes_checked and not torch.compiler.is_compiling() and _peers(self.group)

    def _check_shapes_once(self, x: torch.Tensor, idx: torch.Tensor) -> None:
        """On the first dispatch over more than one rank: one all-reduce (`overlap.agree`), `LayoutError` on
        every rank unless they agree (see the module docstring)."""
        if not self._shapes_unchecked():
            return
        try:
            self._check_experts(x)
            problem = None
        except LayoutError as err:
            problem = err
        agree(fields_by_name(layer_fields(x, idx, self.num_experts)), GroupTransport(self.group, "moe.agree"),
              own_error=problem, hints=AGREED_HINTS, error=LayoutError)
        self._shapes_checked = True

    def _dispatch(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> DispatchHandle:
        self._check_shapes_once(x, idx)
        return dispatch(x, idx, weights, self.num_experts, self.group, stream_tag=None, async_finish=True)

    @property
    def decode_exchange(self) -> str:
        """What its decode steps exchange through: ``"capacity"`` (`collectives.static_step`); an MC2 layer's
        ``"mc2"`` or ``"auto"`` (MC2 where it runs, for buckets up to its threshold)."""
        return "capacity"

    def _decode_dispatch(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, capacity: int,
                         active: Optional[torch.Tensor] = None) -> Any:
        """A decode step's dispatch (`decode_stages`): a static exchange of ``capacity`` rows per rank, with no
        host sync, padding rows (``active`` False) sent to no expert; its handle goes to this layer's ``_experts`` /
        ``_combine`` unless it is the capacity one."""
        return capacity_exchange(self, x, idx, weights, capacity, active)

    def _dispatch_counts(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> PendingDispatch:
        self._check_shapes_once(x, idx)
        pending = dispatch_counts(x, idx, weights, self.num_experts, self.group, stream_tag=None)
        pending.issue_ahead()  # on the CPU path the stream's thread sends the tokens once the counts arrive
        return pending

    def _dispatch_tokens(self, pending: PendingDispatch) -> DispatchHandle:
        return pending.dispatch(async_finish=True)

    def _has_count_stage(self) -> bool:
        """Whether `stages` issues the count exchange as a stage of its own (only this layer's dispatch has one)."""
        return self.two_step_dispatch and type(self)._dispatch is ExpertParallelMoE._dispatch

    def _experts(self, handle: DispatchHandle) -> Tuple[torch.Tensor, ExpertBatch]:
        batch = handle.expand()
        return self.experts(batch.x, batch.counts), batch

    def _combine(self, y: torch.Tensor, batch: ExpertBatch, handle: DispatchHandle) -> CombineHandle:
        return combine(y, batch, handle, stream_tag=None, async_finish=True)

    def _shared_gate_up(self, x: torch.Tensor, _order: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.shared.gate_up(x)

    def _shared_act(self, h: Tuple[torch.Tensor, torch.Tensor], _order: Any) -> torch.Tensor:
        return self.shared.activation(h)

    def _shared_down(self, a: torch.Tensor, x: torch.Tensor, _order: Any) -> torch.Tensor:
        return self.shared.down(a, x)

    def _finalize(self, combined: CombineHandle, shared_out: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = combined.wait()
        return out if shared_out is None else out + shared_out

    def stages(self) -> List[Operation]:
        """The layer as operations for one micro-batch, in an order that is valid to run serially."""
        routed = (MOE_IN, "moe_topk_idx", "moe_topk_weights")
        if self._has_count_stage():
            dispatch = [Operation("dispatch_counts", self._dispatch_counts, routed, ("moe_counts",), EP_COMM),
                        Operation("dispatch", self._dispatch_tokens, ("moe_counts",), ("moe_dispatch",), EP_COMM)]
        else:
            dispatch = [Operation("dispatch", self._dispatch, routed, ("moe_dispatch",), EP_COMM)]
        return self._compose(dispatch, self._experts, self._combine)

    def decode_stages(self, chunks: int = 1) -> List[Operation]:
        """The layer for a decode step: no host sync, static shapes (`collectives.static_step`).

        The dispatch also reads ``MOE_CAPACITY`` (rows per destination rank, the same on every rank and at
        least the micro-batch's tokens on each, so nothing can overflow) and ``MOE_ACTIVE`` (None, or bool
        ``[tokens]``: False for a padding row, which no expert computes); ``chunks`` > 1 runs the routed
        experts in that many chunks of the tokens, each dispatched and combined under the others' experts.
        """
        return decode_stages(self, chunks)

    def _compose(self, dispatch: List[Operation], experts: Callable[..., Any], combine_fn: Callable[..., Any],
                 ) -> List[Operation]:
        """Gate, ``dispatch`` (writing ``moe_dispatch``), shared experts, routed experts, combine, finalize."""
        side = SHARED_EXPERT if self.overlap_shared else DEFAULT
        st = [Operation("gate", self._gate, (MOE_IN,), ("moe_topk_idx", "moe_topk_weights"), DEFAULT)] + dispatch
        if self.shared is not None:
            st.append(Operation("shared_gate_up", self._shared_gate_up, (MOE_IN, "moe_topk_idx"), ("moe_shared_h",),
                                side))
        st.append(Operation("experts", experts, ("moe_dispatch",), ("moe_expert_out", "moe_expert_batch"), DEFAULT))
        if self.shared is not None:
            st.append(Operation("shared_act", self._shared_act, ("moe_shared_h", "moe_dispatch"), ("moe_shared_a",),
                                side))
        st.append(Operation("combine", combine_fn, ("moe_expert_out", "moe_expert_batch", "moe_dispatch"),
                            ("moe_combine",), EP_COMM))
        return st + self._finish(side, "moe_expert_out", ("moe_combine",))

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


class _ChunksFinalize:
    """The finalize of a layer whose routed experts ran in ``n`` chunks: their combined rows in token order, plus
    the shared experts' output where there is one."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, *handles: Any) -> torch.Tensor:
        out = torch.cat([h.wait() for h in handles[:self.n]])
        return out if len(handles) == self.n else out + handles[self.n]
