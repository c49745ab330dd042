"""MC2: torch_npu's fused dispatch / combine, an expert-parallel exchange behind the handle API of `dispatch`.

``npu_moe_distribute_dispatch_v2`` sends every (token, expert) pair straight into the receivers'
HCCL window and returns the rows grouped by local expert with a device count per expert (the
group list of a grouped matmul); ``npu_moe_distribute_combine_v2`` sends the expert outputs back
and sums each token's k weighted rows. No count exchange, nothing read on the host: the
production choice on Ascend for small (decode) batches. ``mc2_dispatch`` / ``mc2_combine`` return
handles with the interface of every family (`collectives.handles`: ``wait()``, ``expand()``,
``combine()``, and the combine handle's ``wait()``), asynchronous on a tagged stream (``stream_tag``,
default ``ep_comm``), so code written for `collectives.dispatch` runs on MC2 unchanged.

Choosing the exchange (`choose_exchange`, `ep_dispatch` / `ep_combine`; `MC2_EXCHANGES`): ``"all_to_all"``
(`collectives.dispatch`), ``"mc2"`` (an `MC2Error` on CPU / CUDA, before any collective: MC2
needs torch_npu on the NPU paths), or ``"auto"`` (default): MC2 where torch_npu provides it, the
group has at least two ranks and ``max_tokens_per_rank`` is at most ``mc2_threshold`` (default
`MC2_MAX_TOKENS` = 256, the largest batch MC2 takes on every Atlas product: Bs <= 256 on A2,
<= 512 on A3); all_to_all otherwise. ``max_tokens_per_rank`` is a bound every rank passes alike
(MC2 needs it as ``global_bs``), so every rank picks the same exchange.

`MC2Exchange` is MC2 as a `collectives.exchange.Exchange`, for the layer: ``auto`` falls back to another
exchange where MC2 does not run (the all-to-all for prefill, the capacity exchange for decode steps, whose bound
is the step's capacity). `decode_exchange_named` gives a decode step's exchange by the launcher's word
(`DECODE_EXCHANGES`: ``capacity``, ``mc2``, ``auto``).

Before the first call the HCCL window MC2 needs is computed from Ascend's formula
(`mc2_buffer_mb`) and compared with ``HCCL_BUFFSIZE`` (MB, default 200): too small is an
`MC2Error` naming the value to set, not a device fault. Ranks with fewer tokens than
``max_tokens_per_rank`` are padded to it and pass ``x_active_mask`` (padding is not sent; on A2 with HCCL's
"hierarchy" algorithm, which takes no mask, the padding is sent as tokens and its outputs dropped), so every
rank calls the operators with the same batch size. With ``validate`` (eager, more than one rank)
one small all-reduce before the fused operator makes every rank raise `LayoutError` / `MC2Error`
if any rank rejects its input or the ranks disagree; Ascend wants MC2's communicator to hold MC2
operators only, so production code validates once and then passes ``validate=False``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

import overlap
from overlap import EP_COMM, GroupTransport, agree, hooks

from .capacity import CapacityExchange
from .dispatch import DispatchHandle, dispatch
from .exchange import Exchange, ExpertLayer, RoutedTokens
from .experts import LocalExperts, torch_npu_with
from .group import group_size, has_peers, rank_in_group
from .handles import EPBatch, EPCombineHandle, EPDispatchHandle
from .layout import AGREED_HINTS, LayoutError, check_active, check_routing, fields_by_name, layer_fields
from .quantize import QuantizedTokens, tokens_for
from .side import exchange_event, on_side

MC2_EXCHANGES = ("auto", "all_to_all", "mc2")  # what `choose_exchange` and `ep_dispatch` take
DECODE_EXCHANGES = ("capacity", "mc2", "auto")  # a decode step's exchange by name (`decode_exchange_named`)
MC2_MAX_TOKENS = 256  # default threshold of "auto": tokens per rank at or below it take MC2
ENV_BUFFSIZE = "HCCL_BUFFSIZE"
DEFAULT_BUFFSIZE_MB = 200  # HCCL's default when HCCL_BUFFSIZE is unset
SHARED_EXPERT_NUM = 1  # the operators' shared_expert_num, left at its default (no shared-expert ranks)
OPS = ("npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2")
CHIPS = ("a2", "a3")
_MB = 1 << 20
# Documented limits per chip: tokens per rank, experts, local experts (None: no limit documented).
_LIMITS = {"a2": dict(bs=256, experts=512, local=24), "a3": dict(bs=512, experts=1024, local=None)}


class MC2Error(RuntimeError):
    """MC2 cannot run here or as configured (no torch_npu, an HCCL buffer too small, a shape it refuses)."""


def _align(v: int, to: int) -> int:
    return (v + to - 1) // to * to


def chip_of(soc: Optional[str]) -> Optional[str]:
    """``"a3"`` (Ascend910_93xx), ``"a2"`` (Ascend910B*) or None for a SoC name (`Backend.soc_version`)."""
    if not soc:
        return None
    if soc.startswith("Ascend910_93"):
        return "a3"
    return "a2" if soc.startswith("Ascend910B") else None


def _a2_alg(comm_alg: str) -> str:
    """The A2 algorithm: ``comm_alg``, or with none the one HCCL's environment selects."""
    if comm_alg:
        return comm_alg
    pcie = os.environ.get("HCCL_INTRA_PCIE_ENABLE") == "1" and os.environ.get("HCCL_INTRA_ROCE_ENABLE") == "0"
    return "hierarchy" if pcie else "fullmesh"


def mc2_buffer_bytes(max_tokens_per_rank: int, hidden: int, top_k: int, num_experts: int, world_size: int,
                     dtype: torch.dtype = torch.bfloat16, *, chip: Optional[str] = None, comm_alg: str = "") -> int:
    """HCCL window bytes MC2 needs (aclnnMoeDistributeDispatchV2, constraint "HCCL_BUFFSIZE"); "/" is integer
    division, ``Bs`` = ``max_tokens_per_rank``, ``L`` = experts per rank, ``S`` = shared_expert_num (1):

    - A3: ``2 * (L * Bs * W * Align512(Align32(2 * H) + 64) + (K + S) * Bs * Align512(2 * H))``
    - A2 ``fullmesh``: ``2 * (Bs * W * min(L, K) * H * 2 + 2 MB)``
    - A2 ``hierarchy``: ``E * Bs * (H * sizeof(x) + 4 * ((K + 7) / 8 * 8) * 4) + 4 MB + 100 MB``

    ``chip`` None (unknown): the larger of A3 and A2 (A2's algorithm from ``comm_alg`` or HCCL's env).
    """
    if chip not in (None,) + CHIPS:
        raise ValueError(f"chip must be one of {CHIPS} or None, got {chip!r}")
    bs, h, k, w = int(max_tokens_per_rank), int(hidden), int(top_k), int(world_size)
    local = int(num_experts) // w
    size = torch.tensor([], dtype=dtype).element_size()
    a3 = 2 * (local * bs * w * _align(_align(2 * h, 32) + 64, 512) + (k + SHARED_EXPERT_NUM) * bs * _align(2 * h, 512))
    if _a2_alg(comm_alg) == "hierarchy":
        a2 = int(num_experts) * bs * (h * size + 4 * ((k + 7) // 8 * 8) * 4) + 4 * _MB + 100 * _MB
    else:
        a2 = 2 * (bs * w * min(local, k) * h * 2 + 2 * _MB)
    return {"a3": a3, "a2": a2, None: max(a2, a3)}[chip]


def mc2_buffer_mb(*args: Any, **kwargs: Any) -> int:
    """`mc2_buffer_bytes` in MB (rounded up): the smallest ``HCCL_BUFFSIZE`` MC2 takes."""
    return -(-mc2_buffer_bytes(*args, **kwargs) // _MB)


def hccl_buffsize_mb() -> Tuple[int, str]:
    """``HCCL_BUFFSIZE`` in MB and how it was set (HCCL's default 200 when unset)."""
    raw = os.environ.get(ENV_BUFFSIZE)
    if raw is None or not raw.strip():
        return DEFAULT_BUFFSIZE_MB, f"{ENV_BUFFSIZE} is unset (HCCL's default {DEFAULT_BUFFSIZE_MB} MB)"
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise MC2Error(f"{ENV_BUFFSIZE}={raw!r} is not a whole number of MB >= 1")
    return value, f"{ENV_BUFFSIZE}={value}"


def check_mc2_buffer(max_tokens_per_rank: int, hidden: int, top_k: int, num_experts: int, world_size: int,
                     dtype: torch.dtype = torch.bfloat16, *, chip: Optional[str] = None, comm_alg: str = "") -> int:
    """Raise `MC2Error` naming the value to set unless ``HCCL_BUFFSIZE`` holds MC2's window; returns the MB needed."""
    need = mc2_buffer_mb(max_tokens_per_rank, hidden, top_k, num_experts, world_size, dtype, chip=chip,
                         comm_alg=comm_alg)
    have, how = hccl_buffsize_mb()
    if have < need:
        raise MC2Error(f"MC2 needs an HCCL buffer of at least {need} MB for {max_tokens_per_rank} tokens per rank, "
                       f"hidden size {hidden}, top-{top_k}, {num_experts} experts on {world_size} ranks "
                       f"({chip or 'A2/A3'} formula), but {how}: set {ENV_BUFFSIZE}={need} (MB) on every rank "
                       f"before the process group is created, or use exchange='all_to_all' or fewer tokens per rank")
    return need


def mc2_available() -> bool:
    """Whether MC2 can run here: an NPU path with a torch_npu that has both fused operators."""
    return torch_npu_with(*OPS) is not None


def _require() -> Any:
    npu = torch_npu_with(*OPS)
    if npu is None:
        raise MC2Error(f"MC2 needs torch_npu on the npu path (npu_moe_distribute_dispatch_v2 / combine_v2); this "
                       f"is the {overlap.current_path()} path: use exchange='all_to_all' or 'auto'")
    return npu


def choose_exchange(exchange: str = "auto", max_tokens_per_rank: Optional[int] = None,
                    mc2_threshold: int = MC2_MAX_TOKENS, world_size: int = 2) -> str:
    """``"all_to_all"`` or ``"mc2"`` for ``exchange`` (one of `MC2_EXCHANGES`; see the module docstring).

    ``"mc2"`` raises `MC2Error` where MC2 cannot run (CPU, CUDA), before any collective.
    """
    if exchange not in MC2_EXCHANGES:
        raise ValueError(f"exchange must be one of {MC2_EXCHANGES}, got {exchange!r}")
    if exchange == "mc2":
        _require()
        return "mc2"
    if exchange == "auto" and world_size > 1 and max_tokens_per_rank is not None \
            and 0 < int(max_tokens_per_rank) <= int(mc2_threshold) and mc2_available():
        return "mc2"
    return "all_to_all"


def _group_name(group: Optional[dist.ProcessGroup]) -> str:
    """The HCCL communicator name of ``group`` (MC2's ``group_ep``)."""
    pg = group if group is not None else dist.group.WORLD
    return pg._get_backend(torch.device("npu")).get_hccl_comm_name(dist.get_rank())


def _check_call(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, world: int, max_tokens: int,
                chip: Optional[str]) -> None:
    """What the fused operators refuse, as errors here (A2 / A3 documented limits where the chip is known)."""
    if world < 2:
        raise MC2Error(f"MC2 needs an expert-parallel group of at least 2 ranks, got {world}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise MC2Error(f"MC2 dispatches float16 / bfloat16 tokens, got {x.dtype}")
    limits = _LIMITS.get(chip, dict(bs=max(v["bs"] for v in _LIMITS.values()), experts=None, local=None))
    if not 0 < max_tokens <= limits["bs"]:
        raise MC2Error(f"max_tokens_per_rank must be in [1, {limits['bs']}] for MC2, got {max_tokens}")
    if x.shape[0] > max_tokens:
        raise LayoutError(f"{x.shape[0]} tokens on this rank, more than max_tokens_per_rank={max_tokens}")
    k = topk_idx.shape[1]
    if not 0 < k <= min(16, num_experts):
        raise MC2Error(f"MC2 takes top-k in [1, min(16, experts)], got {k} for {num_experts} experts")
    if limits["experts"] is not None and num_experts > limits["experts"]:
        raise MC2Error(f"MC2 on {chip} takes at most {limits['experts']} experts, got {num_experts}")
    if limits["local"] is not None and num_experts // world > limits["local"]:
        raise MC2Error(f"MC2 on {chip} takes at most {limits['local']} experts per rank, got {num_experts // world}")


_MAX_TOKENS = "max_tokens_per_rank"
_MC2_HINTS = {**AGREED_HINTS, _MAX_TOKENS: "MC2's global batch size needs one value on every rank"}


def _check_ranks(max_tokens: int, fields: Sequence[int], group: Optional[dist.ProcessGroup],
                 rejected: Optional[BaseException]) -> None:
    """One small all-reduce (`overlap.agree`): every rank raises if one rejected its input (that rank its own
    error, the others `LayoutError` naming it) or the ranks disagree."""
    agree({_MAX_TOKENS: max_tokens, **fields_by_name(fields)}, GroupTransport(group, "mc2.agree"),
          own_error=rejected, hints=_MC2_HINTS, error=LayoutError)


@dataclasses.dataclass
class _Call:
    """The attributes every MC2 operator of one dispatch takes, the same on every rank."""

    group_ep: str
    world: int
    rank: int
    num_experts: int
    global_bs: int


@dataclasses.dataclass
class MC2Batch:
    """Received rows grouped by local expert: ``group_list[e]`` rows of expert ``e``, then padding rows
    (a `collectives.handles.EPBatch`)."""

    x: torch.Tensor  # [A, H]
    group_list: torch.Tensor  # [E_local] int64 counts, on the device

    @property
    def counts(self) -> List[int]:
        """Rows per local expert on the host (a device synchronisation; experts take ``group_list``)."""
        return [int(c) for c in self.group_list.tolist()]


@dataclasses.dataclass
class MC2CombineHandle:
    """The combined tokens, once the fused combine is waited for."""

    out: torch.Tensor  # [Bs, H], padding rows last
    num_tokens: int
    event: Optional[overlap.Event] = None

    def wait(self) -> torch.Tensor:
        """Wait for the combine on the current stream; the combined tokens ``[T, H]``."""
        if self.event is not None:
            self.event.wait()
            self.event = None
        return self.out[: self.num_tokens]


@dataclasses.dataclass
class MC2DispatchHandle:
    """What the fused dispatch returned, and what the fused combine needs (a `collectives.handles.EPDispatchHandle`)."""

    expand_x: torch.Tensor  # [A, H] rows grouped by local expert
    group_list: torch.Tensor  # [E_local] int64 rows per local expert
    expert_ids: torch.Tensor  # [Bs, k] int32, padded
    expert_scales: torch.Tensor  # [Bs, k] float32, padded
    assist_info: torch.Tensor
    ep_recv_counts: torch.Tensor
    x_active_mask: Optional[torch.Tensor]
    call: _Call
    num_tokens: int
    event: Optional[overlap.Event] = None
    dynamic_scales: Optional[torch.Tensor] = None  # [A] float32 per received row where MC2 quantized (quant_mode=2)

    @property
    def recv_x(self) -> torch.Tensor:
        return self.expand_x

    def tokens(self, batch: MC2Batch) -> Union[torch.Tensor, QuantizedTokens]:
        """``batch``'s rows as the experts take them: the rows, or with MC2's int8 quantization their
        `collectives.quantize.QuantizedTokens` (the operator's ``dynamic_scales``)."""
        if self.dynamic_scales is None:
            return batch.x
        return QuantizedTokens(batch.x, self.dynamic_scales.reshape(-1)[: batch.x.shape[0]].float())

    def wait(self) -> "MC2DispatchHandle":
        """Make the current stream wait for the dispatch; then the received rows may be read."""
        if self.event is not None:
            self.event.wait()
            self.event = None
        return self

    def expand(self, counts: Optional[Sequence[int]] = None) -> MC2Batch:
        """The received rows as a batch for the local experts (already grouped; ``counts`` is not needed)."""
        if self.event is not None:
            raise RuntimeError("MC2DispatchHandle.expand before wait(): the dispatch may still be in flight")
        return MC2Batch(self.expand_x, self.group_list)

    def combine(self, expert_out: torch.Tensor, batch: Optional[MC2Batch] = None, *,
                previous_event: Optional[overlap.Event] = None, async_finish: bool = False,
                stream_tag: Optional[str] = EP_COMM, event_tag: str = "ep_mc2_combine") -> "MC2CombineHandle":
        """`mc2_combine` of ``expert_out`` (one row per row of ``batch.x``) back to this dispatch's tokens."""
        return mc2_combine(expert_out, batch, self, previous_event=previous_event, async_finish=async_finish,
                           stream_tag=stream_tag, event_tag=event_tag)


def _pad(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, rows: int, active: Optional[torch.Tensor] = None
         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Tokens, int32 ids and float32 weights padded to ``rows``, and the active mask (None: every row active):
    ``active``'s rows, then the padding's."""
    ids, weights = idx.to(torch.int32), weights.float()
    extra = rows - x.shape[0]
    if extra == 0:
        return x, ids, weights, active
    if active is None:
        mask = torch.arange(rows, device=x.device) < x.shape[0]  # active tokens first, as the operators want
    else:
        mask = torch.cat([active, active.new_zeros(extra)])
    k = ids.shape[1]
    pad_ids = torch.arange(k, dtype=ids.dtype, device=ids.device).expand(extra, k)  # distinct in a row, as required
    return (torch.cat([x, x.new_zeros(extra, x.shape[1])]), torch.cat([ids, pad_ids]),
            torch.cat([weights, weights.new_zeros(extra, k)]), mask)


def _takes_active_mask(chip: Optional[str]) -> bool:
    """Whether the operators take ``x_active_mask`` here: not A2's "hierarchy" algorithm (HCCL's environment picks
    it where no ``comm_alg`` is passed, as here), which sends the padding as tokens instead (outputs unused)."""
    return not (chip == "a2" and _a2_alg("") == "hierarchy")


@contextlib.contextmanager
def _comm_span(name: str, reads: Sequence[torch.Tensor]) -> Iterator[None]:
    """A fused MC2 operator on the current stream, seen by observers as a communication span."""
    span = hooks.start_span(name, overlap.current_stream_tag(), "comm", reads=reads)
    try:
        yield
    finally:
        hooks.end_span(span)


def _validated(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
               group: Optional[dist.ProcessGroup], max_tokens: int, validate: bool, check_ids: bool,
               chip: Optional[str], precheck: Any = None, active: Optional[torch.Tensor] = None) -> None:
    """Every check before the fused dispatch; with ``validate`` every rank raises if one does."""
    world = group_size(group)
    rejected = None
    try:
        check_routing(x, topk_idx, topk_weights, num_experts, world, check_ids)
        check_active(x, active)
        _check_call(x, topk_idx, num_experts, world, max_tokens, chip)
        check_mc2_buffer(max_tokens, x.shape[1], topk_idx.shape[1], num_experts, world, x.dtype, chip=chip)
        if precheck is not None:
            precheck()
    except (LayoutError, MC2Error) as err:
        rejected = err
    if validate and has_peers(group) and not torch.compiler.is_compiling():
        _check_ranks(max_tokens, layer_fields(x, topk_idx, num_experts), group, rejected)
    elif rejected is not None:
        raise rejected


def mc2_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                 group: Optional[dist.ProcessGroup] = None, *, max_tokens_per_rank: int,
                 previous_event: Optional[overlap.Event] = None, async_finish: bool = False,
                 stream_tag: Optional[str] = EP_COMM, event_tag: str = "ep_mc2_dispatch", validate: bool = True,
                 check_ids: bool = True, chip: Optional[str] = None, group_name: Optional[str] = None,
                 precheck: Any = None, active: Optional[torch.Tensor] = None,
                 dispatch_dtype: Optional[torch.dtype] = None) -> MC2DispatchHandle:
    """Send tokens ``x [T, H]`` (T <= ``max_tokens_per_rank``, the same bound on every rank) to their experts
    with ``npu_moe_distribute_dispatch_v2``; streams and events as `collectives.dispatch.dispatch`.
    ``active`` (bool ``[T]``, the active tokens first; None: all): the tokens sent, the others left out
    (``x_active_mask``).

    ``chip`` (``"a2"`` / ``"a3"``; None: from the SoC name) picks the buffer formula and limits;
    ``group_name``: the group's HCCL communicator name, when known (None: asked from the group, eagerly);
    ``precheck`` (the layer's own checks) raises like bad routing does, on every rank with ``validate``.
    ``dispatch_dtype`` int8: the operator quantizes each token (``quant_mode=2``, its ``dynamic_scales`` per
    row); MC2 has no fp8 mode, so float8_e4m3fn is an `MC2Error` before any collective.
    """
    npu = _require()  # CPU / CUDA: an MC2Error before any collective
    quant_mode = _quant_mode(dispatch_dtype)
    max_tokens = int(max_tokens_per_rank)
    chip = chip or chip_of(overlap.backends.current().soc_version())
    _validated(x, topk_idx, topk_weights, num_experts, group, max_tokens, validate, check_ids, chip, precheck, active)
    world = group_size(group)
    call = _Call(group_name or _group_name(group), world, rank_in_group(group), num_experts, max_tokens * world)
    xs, ids, weights, mask = _pad(x.detach(), topk_idx, topk_weights, max_tokens, active)
    if not _takes_active_mask(chip):
        mask = None
    with on_side(stream_tag, previous_event, event_tag) as caller:
        with _comm_span("mc2.dispatch", (xs, ids)):
            out = npu.npu_moe_distribute_dispatch_v2(
                x=xs, expert_ids=ids, group_ep=call.group_ep, ep_world_size=call.world, ep_rank_id=call.rank,
                moe_expert_num=call.num_experts, x_active_mask=mask, quant_mode=quant_mode, global_bs=call.global_bs,
                expert_token_nums_type=1)
        expand_x, scales, assist_info, group_list, ep_recv_counts, _tp_recv, _expand_scales = out
        for t in (expand_x, group_list, assist_info, ep_recv_counts):
            overlap.record_stream(t, caller)  # allocated on this stream, read on the caller's
        handle = MC2DispatchHandle(expand_x, group_list, ids, weights, assist_info, ep_recv_counts, mask, call,
                                   x.shape[0], dynamic_scales=scales if quant_mode else None)
        handle.event = exchange_event(stream_tag, caller, event_tag, expand_x, group_list)
    if not async_finish:
        handle.wait()
    return handle


_QUANT_MODES = {None: 0, torch.int8: 2}  # MC2's quant_mode per dispatch dtype: 2 is int8 per token (dynamic)


def _quant_mode(dispatch_dtype: Optional[torch.dtype]) -> int:
    """MC2's ``quant_mode`` for ``dispatch_dtype``; an `MC2Error` for a dtype it cannot send."""
    if dispatch_dtype not in _QUANT_MODES:
        raise MC2Error(f"MC2 (npu_moe_distribute_dispatch_v2) quantizes tokens to int8 only (quant_mode=2), not "
                       f"{dispatch_dtype}: use dispatch_dtype int8, or the all-to-all / capacity exchange for fp8")
    return _QUANT_MODES[dispatch_dtype]


def mc2_combine(expert_out: torch.Tensor, batch: Optional[MC2Batch], handle: MC2DispatchHandle, *,
                previous_event: Optional[overlap.Event] = None, async_finish: bool = False,
                stream_tag: Optional[str] = EP_COMM, event_tag: str = "ep_mc2_combine") -> MC2CombineHandle:
    """Send the expert outputs ``expert_out [A, H]`` (in `MC2Batch` order) back with
    ``npu_moe_distribute_combine_v2``, which sums each token's k rows times its weights."""
    npu = _require()
    if handle.event is not None:
        raise RuntimeError("combine before the dispatch handle was waited on")
    if tuple(expert_out.shape) != tuple(handle.expand_x.shape):
        raise LayoutError(f"expert output must be {tuple(handle.expand_x.shape)} (one row per received row), got "
                          f"{tuple(expert_out.shape)}")
    with on_side(stream_tag, previous_event, event_tag) as caller:
        call = handle.call
        with _comm_span("mc2.combine", (expert_out,)):
            out = npu.npu_moe_distribute_combine_v2(
                expand_x=expert_out, expert_ids=handle.expert_ids, assist_info_for_combine=handle.assist_info,
                ep_send_counts=handle.ep_recv_counts, expert_scales=handle.expert_scales, group_ep=call.group_ep,
                ep_world_size=call.world, ep_rank_id=call.rank, moe_expert_num=call.num_experts,
                x_active_mask=handle.x_active_mask, global_bs=call.global_bs)
        overlap.record_stream(out, caller)
        result = MC2CombineHandle(out, handle.num_tokens)
        result.event = exchange_event(stream_tag, caller, event_tag, out)
    if not async_finish:
        result.wait()
    return result


AnyDispatch = Union[DispatchHandle, MC2DispatchHandle]


def ep_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                group: Optional[dist.ProcessGroup] = None, *, exchange: str = "auto",
                max_tokens_per_rank: Optional[int] = None, mc2_threshold: int = MC2_MAX_TOKENS,
                **kwargs: Any) -> AnyDispatch:
    """`collectives.dispatch.dispatch` or `mc2_dispatch`, as `choose_exchange` says; ``kwargs`` go to it."""
    which = choose_exchange(exchange, max_tokens_per_rank, mc2_threshold, group_size(group))
    if which == "mc2":
        if max_tokens_per_rank is None:
            raise LayoutError("exchange='mc2' needs max_tokens_per_rank (the same bound on every rank)")
        return mc2_dispatch(x, topk_idx, topk_weights, num_experts, group, max_tokens_per_rank=max_tokens_per_rank,
                            **kwargs)
    return dispatch(x, topk_idx, topk_weights, num_experts, group, **kwargs)


def ep_combine(expert_out: torch.Tensor, batch: EPBatch, handle: EPDispatchHandle, **kwargs: Any) -> EPCombineHandle:
    """The combine of the family that made ``handle``: ``handle.combine(expert_out, batch, **kwargs)``."""
    return handle.combine(expert_out, batch, **kwargs)


@dataclasses.dataclass
class _Through:
    """What `MC2Exchange` prepared or dispatched, and through which exchange: MC2 (``fallback`` None) or its
    fallback, whose own value ``value`` is."""

    fallback: Optional[Exchange]
    value: Any


class MC2Exchange:
    """MC2 as a `collectives.exchange.Exchange`: `mc2_dispatch` / `mc2_combine` on the calling stream, the experts
    on the batch's device group list; with ``auto``, only where `choose_exchange` takes MC2 for the call's bound,
    ``fallback`` otherwise (as it is: its stages, its count exchange).

    The bound (MC2's ``max_tokens_per_rank``, the same on every rank): the call's capacity
    (`RoutedTokens.capacity`: a decode step's bucket), else ``max_tokens_per_rank`` (a prefill's; ``auto``
    without one keeps the fallback). ``validate``: MC2's agreement all-reduce on every call (else on the layer's
    first only, the layer's shapes folded in); a decode step's passes False (it reads nothing on the host).
    """

    def __init__(self, fallback: Exchange, *, auto: bool = True, max_tokens_per_rank: Optional[int] = None,
                 mc2_threshold: int = MC2_MAX_TOKENS, validate: bool = True):
        self.fallback, self.auto = fallback, auto
        self.max_tokens_per_rank, self.mc2_threshold, self.validate = max_tokens_per_rank, mc2_threshold, validate
        self._group_names: Dict[Optional[dist.ProcessGroup], str] = {}  # HCCL communicator names, asked once

    @property
    def name(self) -> str:
        """``"auto"`` (MC2 where it runs) or ``"mc2"``."""
        return "auto" if self.auto else "mc2"

    def exchange_for(self, layer: ExpertLayer, capacity: Optional[int] = None) -> str:
        """What a dispatch of ``layer`` with ``capacity`` rows per rank (None: a prefill's) takes: ``"mc2"``, or
        the fallback's name; ``"mc2"`` raises `MC2Error` where MC2 cannot run."""
        bound = self.max_tokens_per_rank if capacity is None else capacity
        taken = choose_exchange(self.name, bound, self.mc2_threshold, group_size(layer.group))
        return "mc2" if taken == "mc2" else self.fallback.name

    def two_step(self, layer: ExpertLayer) -> bool:
        """The fallback's, where a prefill takes it; MC2 has no count exchange."""
        return self.exchange_for(layer) != "mc2" and self.fallback.two_step(layer)

    def prepare(self, tokens: RoutedTokens, layer: ExpertLayer, *, ahead: bool = False) -> _Through:
        """The fallback's `prepare` where it takes the call; MC2 has nothing to issue before the tokens."""
        if self.exchange_for(layer, tokens.capacity) != "mc2":
            return _Through(self.fallback, self.fallback.prepare(tokens, layer, ahead=ahead))
        if tokens.capacity is None and self.max_tokens_per_rank is None:
            raise LayoutError("exchange='mc2' needs max_tokens_per_rank (the same bound on every rank)")
        return _Through(None, (tokens, layer))

    def dispatch(self, prepared: _Through) -> _Through:
        """`mc2_dispatch` with the call's bound, the ranks' agreement checked where ``validate`` or on the layer's
        first dispatch; padding rows (``active`` False, after the real ones) left out (``x_active_mask``)."""
        if prepared.fallback is not None:
            return _Through(prepared.fallback, prepared.fallback.dispatch(prepared.value))
        tokens, layer = prepared.value
        bound = self.max_tokens_per_rank if tokens.capacity is None else tokens.capacity
        group_name = self._group_names.get(layer.group)
        if group_name is None and mc2_available():
            group_name = self._group_names[layer.group] = _group_name(layer.group)
        precheck = layer.shapes.first_check(tokens, layer)
        handle = mc2_dispatch(tokens.x, tokens.topk_idx, tokens.topk_weights, layer.num_experts, layer.group,
                              max_tokens_per_rank=bound, stream_tag=None, async_finish=True,
                              validate=self.validate or precheck is not None, group_name=group_name,
                              precheck=precheck, active=tokens.active, dispatch_dtype=tokens.dispatch_dtype)
        if precheck is not None:
            layer.shapes.checked = True
        return _Through(None, handle)

    def run_experts(self, handle: _Through, experts: LocalExperts) -> Tuple[torch.Tensor, object]:
        """MC2's rows come grouped by local expert with a device group list, which the experts take (or the
        fallback's `run_experts`)."""
        if handle.fallback is not None:
            return handle.fallback.run_experts(handle.value, experts)
        batch = handle.value.expand()
        dtype = batch.x.dtype if handle.value.dynamic_scales is None else experts.gate_up.dtype
        return experts(tokens_for(experts, handle.value.tokens(batch), dtype), batch.group_list), batch

    def combine(self, expert_out: torch.Tensor, batch: object, handle: _Through) -> EPCombineHandle:
        """`mc2_combine` on the calling stream (or the fallback's `combine`)."""
        if handle.fallback is not None:
            return handle.fallback.combine(expert_out, batch, handle.value)
        return handle.value.combine(expert_out, batch, stream_tag=None, async_finish=True)


def decode_exchange_named(name: str, mc2_threshold: int = MC2_MAX_TOKENS) -> Exchange:
    """A decode step's exchange by name (one of `DECODE_EXCHANGES`, the launcher's ``--decode-exchange``): the
    capacity exchange, MC2 with the step's capacity as the bound, or ``"auto"``: MC2 where it runs, for buckets up
    to ``mc2_threshold``, else the capacity exchange."""
    if name not in DECODE_EXCHANGES:
        raise ValueError(f"decode_exchange must be one of {DECODE_EXCHANGES}, got {name!r}")
    capacity = CapacityExchange.for_decode()
    if name == "capacity":
        return capacity
    return MC2Exchange(capacity, auto=name == "auto", mc2_threshold=mc2_threshold, validate=False)


__all__ = ["CHIPS", "DECODE_EXCHANGES", "DEFAULT_BUFFSIZE_MB", "ENV_BUFFSIZE", "MC2Batch", "MC2CombineHandle",
           "MC2DispatchHandle", "MC2Error", "MC2Exchange", "MC2_EXCHANGES", "MC2_MAX_TOKENS", "OPS",
           "check_mc2_buffer", "chip_of", "choose_exchange", "decode_exchange_named", "ep_combine", "ep_dispatch",
           "hccl_buffsize_mb", "mc2_available", "mc2_buffer_bytes", "mc2_buffer_mb", "mc2_combine", "mc2_dispatch"]
