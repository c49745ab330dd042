"""The expert-parallel MoE layer, described as stages so that a pipeline can interleave micro-batches.

Stages (value names in brackets; ``moe_in`` is ``[tokens, hidden]``, ``moe_out`` the result):

==================  ==========  =============================================  ===================
stage               stream      reads                                          writes
==================  ==========  =============================================  ===================
gate                main        moe_in                                         moe_topk_idx, moe_topk_weights
dispatch            ep_comm     moe_in, moe_topk_idx, moe_topk_weights         moe_dispatch
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

Stage functions keep no state on the module: everything, including the in-flight exchange
(a `DispatchHandle` / `CombineHandle`), travels as a value, so two micro-batches can interleave.
They do not enter streams or wait: whoever runs them places each on its ``stream`` and makes a
consumer wait for a producer on another stream (`run_stages` does that for ``forward``). The one
host block is the dispatch's count exchange (see `collectives.dispatch`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import overlap
from overlap._tree import tensors_in
from overlap.streams import COMM, MAIN, SHARED

from .dispatch import CombineHandle, DispatchHandle, combine, dispatch, group_size
from .experts import LocalExperts
from .layout import ExpertBatch, LayoutError
from .reference import MoEConfig, Router


class Stage(NamedTuple):
    """One launch of the layer: ``fn(*values_of_reads)`` returns one value per write (a tuple if several)."""

    name: str
    fn: Callable[..., Any]
    reads: Tuple[str, ...]
    writes: Tuple[str, ...]
    stream: str = MAIN


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
    """

    def __init__(self, router: nn.Module, experts: LocalExperts, num_experts: int,
                 group: Optional[dist.ProcessGroup] = None, shared: Optional[SharedExperts] = None,
                 overlap_shared: bool = True):
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
        with overlap.span("gate"):
            return self.router(x)

    def _dispatch(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> DispatchHandle:
        return dispatch(x, idx, weights, self.num_experts, self.group, stream_tag=None, async_finish=True)

    def _experts(self, handle: DispatchHandle) -> Tuple[torch.Tensor, ExpertBatch]:
        with overlap.span("experts"):
            batch = handle.expand()
            return self.experts(batch.x, batch.counts), batch

    def _combine(self, y: torch.Tensor, batch: ExpertBatch, handle: DispatchHandle) -> CombineHandle:
        return combine(y, batch, handle, stream_tag=None, async_finish=True)

    def _shared_gate_up(self, x: torch.Tensor, _order: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        with overlap.span("shared_gate_up"):
            return self.shared.gate_up(x)

    def _shared_act(self, h: Tuple[torch.Tensor, torch.Tensor], _order: Any) -> torch.Tensor:
        with overlap.span("shared_act"):
            return self.shared.activation(h)

    def _shared_down(self, a: torch.Tensor, x: torch.Tensor, _order: Any) -> torch.Tensor:
        with overlap.span("shared_down"):
            return self.shared.down(a, x)

    def _finalize(self, combined: CombineHandle, shared_out: Optional[torch.Tensor] = None) -> torch.Tensor:
        with overlap.span("finalize"):
            out = combined.wait()
            return out if shared_out is None else out + shared_out

    def stages(self) -> List[Stage]:
        """The layer as stages for one micro-batch, in an order that is valid to run serially."""
        side = SHARED if self.overlap_shared else MAIN
        st = [Stage("gate", self._gate, ("moe_in",), ("moe_topk_idx", "moe_topk_weights"), MAIN),
              Stage("dispatch", self._dispatch, ("moe_in", "moe_topk_idx", "moe_topk_weights"), ("moe_dispatch",),
                    COMM)]
        if self.shared is not None:
            st.append(Stage("shared_gate_up", self._shared_gate_up, ("moe_in", "moe_topk_idx"), ("moe_shared_h",),
                            side))
        st.append(Stage("experts", self._experts, ("moe_dispatch",), ("moe_expert_out", "moe_expert_batch"), MAIN))
        if self.shared is not None:
            st.append(Stage("shared_act", self._shared_act, ("moe_shared_h", "moe_dispatch"), ("moe_shared_a",), side))
        st.append(Stage("combine", self._combine, ("moe_expert_out", "moe_expert_batch", "moe_dispatch"),
                        ("moe_combine",), COMM))
        if self.shared is not None:
            st.append(Stage("shared_down", self._shared_down, ("moe_shared_a", "moe_in", "moe_expert_out"),
                            ("moe_shared_out",), side))
            st.append(Stage("finalize", self._finalize, ("moe_combine", "moe_shared_out"), ("moe_out",), MAIN))
        else:
            st.append(Stage("finalize", self._finalize, ("moe_combine",), ("moe_out",), MAIN))
        return st

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = run_stages(self.stages(), {"moe_in": x.reshape(-1, shape[-1])})["moe_out"]
        return out.reshape(shape)


def run_stages(stages: Sequence[Stage], values: Dict[str, Any], event_prefix: str = "moe") -> Dict[str, Any]:
    """Run stages in order, each on its stream, waiting where a value crosses streams.

    A minimal form of the micro-batch executor's rule: after a stage, an event is recorded on its
    stream; before a stage reads a value produced on another stream, its stream waits on it.
    ``values`` seeds the inputs (produced on the main stream); returns all values.
    """
    values = dict(values)
    caller = overlap.current_stream_tag()
    seeded = overlap.event(f"{event_prefix}.inputs")
    seeded.record(*[v for v in values.values() if isinstance(v, torch.Tensor)])
    made_on: Dict[str, Tuple[str, overlap.Event]] = {k: (caller, seeded) for k in values}
    waited = set()
    for st in stages:
        with overlap.stream(st.stream):
            for r in st.reads:
                if r not in values:
                    raise KeyError(f"stage {st.name!r} reads {r!r} before any stage wrote it")
                src, ev = made_on[r]
                if src != st.stream:
                    if (ev, st.stream) not in waited:
                        ev.wait()
                        waited.add((ev, st.stream))
                    for t in tensors_in(values[r]):  # the allocator must not reuse it under this stream
                        overlap.record_stream(t, st.stream)
            out = st.fn(*[values[r] for r in st.reads])
            if len(st.writes) == 1:
                out = (out,)
            if not isinstance(out, tuple) or len(out) != len(st.writes):
                raise TypeError(f"stage {st.name!r} must return {len(st.writes)} values for {st.writes}")
            ev = overlap.event(f"{event_prefix}.{st.name}")
            ev.record(*[v for v in out if isinstance(v, torch.Tensor)])
            for k, v in zip(st.writes, out):
                values[k] = v
                made_on[k] = (st.stream, ev)
    return values
