"""One interface for every exchange: how tokens move to their experts' ranks and back.

An exchange (`Exchange`) is one class per family: the uneven all-to-all (`collectives.dispatch.AllToAllExchange`,
its count exchange a step of its own), the static-shape capacity exchange (`collectives.capacity.CapacityExchange`:
what graph prefill and every decode step take) and torch_npu's fused MC2 operators
(`collectives.mc2.MC2Exchange`, whose ``auto`` falls back to another exchange where MC2 does not run). The layer
(`collectives.ExpertParallelMoE`) holds one exchange for prefill and one for decode, and one experts object
(`collectives.LocalExperts`); each of its stages calls one method of its exchange::

    prepared = exchange.prepare(RoutedTokens(x, topk_idx, topk_weights), layer)  # stage dispatch_counts, or
    handle = exchange.dispatch(prepared)                                         # with it, stage dispatch
    y, batch = exchange.run_experts(handle, layer.experts)                       # stage experts
    combined = exchange.combine(y, batch, handle)                                # stage combine
    out = combined.wait()                                                        # stage finalize: [T, H]

as vLLM's modular kernel separates its prepare-and-finalize from its experts, and DeepEP's ``Buffer.dispatch``
hands a handle to its ``combine``. Every call is asynchronous: ``dispatch`` and ``combine`` return handles at once,
the exchange possibly still in flight on the stream it was issued on (the layer's stages run on ``ep_comm``, and
the micro-batch executor orders every reader after them); ``combine``'s handle gives the tokens on ``wait()``.
A new exchange (a quantized one, a send / receive between two groups of ranks) is one new class with these
members, plugged into the layer as it is (``ExpertParallelMoE(..., exchange=..., decode_exchange=...)``).

What an exchange reads of its layer is `ExpertLayer`: the expert count, the group, this rank's experts, and the
ranks' agreement on the layer's shapes (`LayerShapes`: one all-reduce on the layer's first dispatch over more than
one rank, or folded into an exchange's own).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Protocol, Tuple, runtime_checkable

import torch
import torch.distributed as dist

from overlap import GroupTransport, agree

from .experts import LocalExperts
from .group import has_peers
from .handles import EPCombineHandle
from .layout import AGREED_HINTS, LayoutError, fields_by_name, layer_fields


@dataclasses.dataclass
class RoutedTokens:
    """What an exchange moves: tokens and their routing, and for a static exchange its rows per rank."""

    x: torch.Tensor  # [T, H] the tokens
    topk_idx: torch.Tensor  # [T, k] the experts each token goes to (global ids)
    topk_weights: torch.Tensor  # [T, k] their weights
    # rows per destination rank, the same on every rank and at least T (a decode step's bucket); None: the
    # exchange's own (a static exchange's setting, else T); an exchange that counts its rows ignores it
    capacity: Optional[int] = None
    # bool [T] on the device, the real rows first (False: a padding row of a captured step, which no expert
    # computes); None: every row is real
    active: Optional[torch.Tensor] = None
    # how the tokens travel to their experts (`collectives.quantize`): int8 / float8_e4m3fn quantized per token,
    # their scales in the same exchange; None: in their own dtype. The combine travels in the tokens' dtype.
    dispatch_dtype: Optional[torch.dtype] = None


class LayerShapes:
    """The ranks' agreement on one layer's shapes: hidden size, expert count, top-k, tokens' dtype, and that every
    rank's experts take the tokens' hidden size.

    Checked once, on the layer's first dispatch over more than one rank, before any exchange: by one small
    all-reduce of its own (`check`), or folded into an exchange's own agreement (`first_check`); otherwise
    every rank raises `LayoutError` naming the field, instead of hanging or aborting in the exchange. Never
    while compiling (nothing can be read on the host there): agreement is then the caller's job.
    """

    def __init__(self) -> None:
        self.checked = False  # set once the ranks agreed

    def pending(self, layer: "ExpertLayer") -> bool:
        """Whether the ranks have yet to agree on ``layer``'s shapes (never while compiling, never alone)."""
        return not self.checked and not torch.compiler.is_compiling() and has_peers(layer.group)

    def check(self, tokens: RoutedTokens, layer: "ExpertLayer") -> None:
        """On ``layer``'s first call over more than one rank: one all-reduce (`overlap.agree`), `LayoutError` on
        every rank unless they agree (a rank whose experts refuse the tokens raises its own error)."""
        if not self.pending(layer):
            return
        try:
            _experts_take(tokens.x, layer.experts)
            problem = None
        except LayoutError as err:
            problem = err
        agree(fields_by_name(layer_fields(tokens.x, tokens.topk_idx, layer.num_experts)),
              GroupTransport(layer.group, "moe.agree"), own_error=problem, hints=AGREED_HINTS, error=LayoutError)
        self.checked = True

    def first_check(self, tokens: RoutedTokens, layer: "ExpertLayer") -> Optional[Callable[[], None]]:
        """For an exchange whose own all-reduce carries the layer's fields: on the layer's first call, this rank's
        own check (its experts take the tokens' hidden size), to raise inside that all-reduce as bad routing does;
        None once agreed. The exchange sets `checked` once its all-reduce has passed."""
        return (lambda: _experts_take(tokens.x, layer.experts)) if self.pending(layer) else None


def _experts_take(x: torch.Tensor, experts: LocalExperts) -> None:
    """This rank's experts must take the tokens' hidden size (else they fail on this rank only, mid-layer)."""
    weights = getattr(experts, "gate_up", None)
    hidden = weights.shape[-1] if isinstance(weights, torch.Tensor) else None
    if hidden is not None and (x.dim() != 2 or x.shape[1] != hidden):
        raise LayoutError(f"this rank's experts take hidden size {hidden}, but the tokens are {tuple(x.shape)}")


@runtime_checkable
class ExpertLayer(Protocol):
    """What an exchange reads of the layer it moves tokens for (`collectives.ExpertParallelMoE` has it)."""

    num_experts: int  # experts over the whole group, placed contiguously: rank r holds r * E / W ...
    group: Optional[dist.ProcessGroup]  # the expert-parallel group (None: the default group, or no group)
    experts: LocalExperts  # this rank's experts
    shapes: LayerShapes  # the ranks' agreement on the layer's shapes


@runtime_checkable
class Exchange(Protocol):
    """How tokens move to their experts' ranks and back (see the module docstring).

    ``name``: the word that chooses it (``--decode-exchange``, a decode calibration's key): ``"all_to_all"``,
    ``"capacity"``, ``"mc2"``, ``"auto"`` (MC2 where it runs). The handles are the exchange's own: only its
    `run_experts` and `combine` read them (the families' handles also offer `collectives.handles`' interface).
    """

    name: str

    def two_step(self, layer: ExpertLayer) -> bool:
        """Whether `prepare` issues a collective of its own for ``layer`` (the all-to-all's count exchange), so that
        the layer lists it as a stage of its own (``dispatch_counts``) and a schedule issues other work before the
        dispatch reads it."""
        ...

    def prepare(self, tokens: RoutedTokens, layer: ExpertLayer, *, ahead: bool = False) -> object:
        """Check and lay out ``tokens`` for ``layer``'s experts before any token travels; where the exchange has a
        count exchange, issue it without reading it. ``ahead``: hand what follows (the read and the tokens) to the
        exchange stream's own thread, where the path has one (`overlap.issue_ahead`). Returns what `dispatch` takes."""
        ...

    def dispatch(self, prepared: object) -> object:
        """Send the tokens `prepare` laid out to their experts' ranks, at once; the handle `run_experts` and
        `combine` take (the exchange may still be in flight)."""
        ...

    def run_experts(self, handle: object, experts: LocalExperts) -> Tuple[torch.Tensor, object]:
        """This rank's ``experts`` over the rows ``handle`` received: ``(expert_out, batch)``, ``expert_out`` one
        row per received (row, expert) pair in the exchange's order (``[rows, H]``; the capacity exchange's
        every-expert form ``[E_local, rows, H]``), ``batch`` what `combine` reduces them with."""
        ...

    def combine(self, expert_out: torch.Tensor, batch: object, handle: object) -> EPCombineHandle:
        """Send ``expert_out`` (with ``batch``, from `run_experts` of ``handle``) back to the tokens' ranks, at once;
        the handle's ``wait()`` gives each token's weighted sum ``[T, H]``."""
        ...


__all__ = ["Exchange", "ExpertLayer", "LayerShapes", "RoutedTokens"]
