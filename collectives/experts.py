"""This rank's routed experts, computed through one function: a loop everywhere, a grouped matmul where there is one.

Weights are stacked per local expert, in the layout Hugging Face's fused experts use:
``gate_up [E_local, 2F, H]`` (gate rows first, then up rows) and ``down [E_local, H, F]``.
Each expert computes ``down(act(gate(x)) * up(x))``; optionally (`LocalExperts`, `grouped_mlp`)
with biases on both projections and another GLU of gate and up (`ClampedSwiGLU`: gpt-oss, or
`ClampedGLU`), and `LocalExperts` can add identity experts (LongCat-Flash's zero-compute experts)
and scale each row by its expert's router score before the MLP (Llama 4).

``impl``: ``"loop"`` (any path), ``"grouped"`` (``torch_npu.npu_grouped_matmul`` on the NPU
paths, a `ValueError` where torch_npu lacks it; ``torch._grouped_mm`` elsewhere), or ``"auto"``:
grouped on the NPU paths where torch_npu has it and on CUDA for bf16 where ``torch._grouped_mm``
exists, otherwise the loop.

``counts`` (rows per expert) are host ints, or a device **group list**: an int64 tensor of counts
(``group_list_type=1``), the form the static-shape paths produce on the device. With a group list
nothing is read on the host by the grouped kernels, rows past its sum are padding and come out as
zero (selected, never multiplied), and host counts are copied to the device once per distinct
value, device and stream (a small cache) instead of on every call. ``torch_npu.npu_grouped_matmul`` refuses a group
list of length 1, so one local expert is a plain matmul there.
"""
from __future__ import annotations

import sys

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

import overlap
from overlap.state import STATE

from .quantize import QuantizedTokens, as_float

IMPLS = ("auto", "loop", "grouped")
Counts = Union[Sequence[int], torch.Tensor]  # host counts per expert, or a device group list (int64 counts)
Act = Callable[[torch.Tensor], torch.Tensor]
Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> the input of down


class ClampedGLU(nn.Module):
    """``act(min(gate, limit)) * clamp(up, -limit, limit)`` (DeepSeek-V4's and Hunyuan-V4's clamped SwiGLU)."""

    def __init__(self, limit: float, act: Act = F.silu):
        super().__init__()
        self.limit, self.act = float(limit), act

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)

    def extra_repr(self) -> str:
        return f"limit={self.limit}"


class ClampedSwiGLU(nn.Module):
    """gpt-oss's GLU: ``g = min(gate, limit)``, ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = float(alpha), float(limit)

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"

_CACHE_SIZE = 32  # group lists kept
_POOL = "collectives.group_lists"  # their entry in the process state's pools: (key, tensor), oldest first


def torch_npu_with(*ops: str) -> Optional[Any]:
    """``torch_npu`` (imported here, lazily) when the current path has NPU operators and it provides every
    operator in ``ops``; None elsewhere (CPU, CUDA, or a torch_npu stand-in without them)."""
    if not overlap.backends.current().has_npu_ops:
        return None
    # an NPU path has imported torch_npu already; an import statement would break a graph being traced
    torch_npu = sys.modules.get("torch_npu")
    if torch_npu is None and not torch.compiler.is_compiling():
        try:
            import torch_npu
        except Exception:  # not installed, or a wheel without CANN
            return None
    if torch_npu is None:
        return None
    return torch_npu if all(callable(getattr(torch_npu, op, None)) for op in ops) else None


def group_list(counts: Counts, device: torch.device) -> torch.Tensor:
    """``counts`` as an int64 group list on ``device``: a tensor as it is, host counts copied once per
    distinct value, device and stream (a small LRU cache in the toolkit's process state, which
    ``overlap.reset`` forgets), so repeated calls do not copy them again. The stream is part of the
    key: a cached copy is only read on the stream that made it."""
    if isinstance(counts, torch.Tensor):
        return counts
    key = (tuple(int(c) for c in counts), str(device), overlap.current_stream_tag())
    if torch.compiler.is_compiling():  # a constant of the graph
        return torch.tensor(key[0], dtype=torch.int64, device=device)
    with STATE.lock:
        kept = STATE.pools.setdefault(_POOL, [])
        for i, (k, t) in enumerate(kept):
            if k == key:
                kept.append(kept.pop(i))  # most recently used last
                return t
    made = torch.tensor(key[0], dtype=torch.int64, device=device)
    with STATE.lock:
        kept = STATE.pools.setdefault(_POOL, [])
        kept.append((key, made))
        del kept[:-_CACHE_SIZE]
    return made


def _zero_padding(y: torch.Tensor, gl: torch.Tensor) -> torch.Tensor:
    """Rows of ``y`` past the group list's sum set to an exact zero (they were never computed)."""
    rows = torch.arange(y.shape[0], device=y.device)
    return torch.where((rows < gl.sum())[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))


def _host_counts(counts: Counts) -> List[int]:
    return [int(c) for c in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]


def row_experts(counts: Counts, rows: int, device: torch.device) -> torch.Tensor:
    """The (local) expert of each of ``rows`` rows grouped by ``counts``; rows past their sum get the last expert.
    Nothing is read on the host (a search in the group list's running sum)."""
    gl = group_list(counts, device)
    ends = gl.cumsum(0)
    return torch.searchsorted(ends, torch.arange(rows, device=device), right=True).clamp(max=gl.shape[0] - 1)


class _Form(NamedTuple):
    """What each expert computes besides its two matmuls: ``down(glu(gate, up) + down_bias)`` with
    ``gate, up = gate_up x + gate_up_bias``; ``glu`` None is ``act(gate) * up``."""

    act: Act
    glu: Optional[Glu] = None
    gate_up_bias: Optional[torch.Tensor] = None  # [E, 2F]
    down_bias: Optional[torch.Tensor] = None  # [E, H]

    def gated(self, h: torch.Tensor) -> torch.Tensor:
        g, u = h.chunk(2, dim=-1)
        return self.act(g) * u if self.glu is None else self.glu(g, u)

    def biased(self, h: torch.Tensor, bias: Optional[torch.Tensor], ids: Optional[torch.Tensor]) -> torch.Tensor:
        return h if bias is None else h + bias.index_select(0, ids).to(h.dtype)


def _loop(x: torch.Tensor, counts: Counts, gate_up: torch.Tensor, down: torch.Tensor, form: _Form) -> torch.Tensor:
    padded = isinstance(counts, torch.Tensor)  # rows past a group list's sum are padding: they stay zero
    out = x.new_zeros(x.shape[0], down.shape[1]) if padded else x.new_empty(x.shape[0], down.shape[1])
    b_gu, b_d = form.gate_up_bias, form.down_bias
    start = 0
    for e, n in enumerate(_host_counts(counts)):  # a host read where counts are a device group list
        if n:
            h = F.linear(x[start:start + n], gate_up[e], None if b_gu is None else b_gu[e])
            out[start:start + n] = F.linear(form.gated(h), down[e], None if b_d is None else b_d[e])
        start += n
    return out


def _torch_grouped_ok(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.shape[0] == 0:
        return False
    if (x.device.type == "cuda" or torch.compiler.is_compiling()) and x.dtype != torch.bfloat16:
        return False  # CUDA kernels, and the meta kernel a trace runs, take bf16 only
    size = x.element_size()
    # torch._grouped_mm wants 16-byte aligned strides on every operand.
    return all((d * size) % 16 == 0 for d in (x.shape[1], gate_up.shape[1], down.shape[2], down.shape[1]))


def _bias_rows(counts: Counts, x: torch.Tensor, form: _Form) -> Optional[torch.Tensor]:
    """Each row's expert, where a bias needs it (else None)."""
    if form.gate_up_bias is None and form.down_bias is None:
        return None
    return row_experts(counts, x.shape[0], x.device)


def _torch_grouped(x: torch.Tensor, counts: Counts, gate_up: torch.Tensor, down: torch.Tensor,
                   form: _Form) -> torch.Tensor:
    gl = group_list(counts, x.device)
    ids = _bias_rows(counts, x, form)
    offs = gl.cumsum(0).to(torch.int32)  # group ends, on the device: nothing read on the host
    h = form.biased(torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offs), form.gate_up_bias, ids)
    y = torch._grouped_mm(form.gated(h).contiguous(), down.transpose(1, 2), offs=offs)
    y = form.biased(y, form.down_bias, ids)
    return _zero_padding(y, gl) if isinstance(counts, torch.Tensor) else y


def _npu_grouped(x: torch.Tensor, counts: Counts, gate_up: torch.Tensor, down: torch.Tensor,
                 form: _Form) -> torch.Tensor:
    padded = isinstance(counts, torch.Tensor)
    gl = group_list(counts, x.device)
    ids = _bias_rows(counts, x, form)
    if gate_up.shape[0] == 1:  # npu_grouped_matmul refuses a group list of length 1: a plain matmul
        h = form.biased(F.linear(x, gate_up[0]), form.gate_up_bias, ids)
        y = form.biased(F.linear(form.gated(h), down[0]), form.down_bias, ids)
        return _zero_padding(y, gl) if padded else y
    import torch_npu

    # split_item=2: x and y are single tensors split along M by group_list (group_list_type=1: counts).
    h = torch_npu.npu_grouped_matmul([x], [gate_up.transpose(1, 2)], group_list=gl, split_item=2,
                                     group_type=0, group_list_type=1)[0]
    h = form.biased(h, form.gate_up_bias, ids)
    y = torch_npu.npu_grouped_matmul([form.gated(h)], [down.transpose(1, 2)], group_list=gl,
                                     split_item=2, group_type=0, group_list_type=1)[0]
    y = form.biased(y, form.down_bias, ids)
    return _zero_padding(y, gl) if padded else y  # rows past the group list were not computed


_IMPL_FNS = {"loop": _loop, "torch_grouped": _torch_grouped, "npu_grouped": _npu_grouped}


def resolve_impl(impl: str, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> str:
    """Which implementation ``grouped_mlp`` will use: "loop", "torch_grouped" or "npu_grouped"."""
    if impl in _IMPL_FNS:
        return impl
    if impl not in IMPLS:
        raise ValueError(f"expert implementation must be one of {IMPLS}, got {impl!r}")
    if impl == "loop":
        return "loop"
    if overlap.backends.current().has_npu_ops:
        if torch_npu_with("npu_grouped_matmul") is not None:
            return "npu_grouped"
        if impl == "grouped":
            raise ValueError("expert implementation 'grouped' on an NPU path needs torch_npu.npu_grouped_matmul, "
                             "which this torch_npu does not provide: upgrade torch_npu, or use impl='loop'")
        return "loop"  # auto: an older torch_npu without the grouped matmul
    if impl == "auto" and x.device.type != "cuda":
        return "loop"
    return "torch_grouped" if _torch_grouped_ok(x, gate_up, down) else "loop"


def device_group_impl(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> Optional[str]:
    """The grouped matmul that takes a device group list with static shapes here, or None:
    ``"npu_grouped"`` where torch_npu provides ``npu_grouped_matmul`` (NPU paths), ``"torch_grouped"``
    where ``torch._grouped_mm`` takes this dtype and these shapes (CPU / CUDA; bf16 only on CUDA and
    while compiling). Its work is proportional to the rows the group list counts."""
    if overlap.backends.current().has_npu_ops:
        return "npu_grouped" if torch_npu_with("npu_grouped_matmul") is not None else None
    return "torch_grouped" if _torch_grouped_ok(x, gate_up, down) else None


def _check_counts(x: torch.Tensor, counts: Counts, experts: int) -> Counts:
    if isinstance(counts, torch.Tensor):
        if counts.dim() != 1 or counts.shape[0] != experts or counts.is_floating_point() \
                or counts.device != x.device:
            raise ValueError(f"grouped_mlp: a group list must be a 1-D integer tensor of {experts} counts on "
                             f"{x.device}, got {tuple(counts.shape)} {counts.dtype} on {counts.device}")
        if counts.device.type == "cpu" and overlap.host_reads_allowed():
            if bool((counts < 0).any()) or int(counts.sum()) > x.shape[0]:
                raise ValueError(f"grouped_mlp: group list {counts.tolist()} does not fit {x.shape[0]} rows")
        return counts
    counts = [int(c) for c in counts]
    if len(counts) != experts or sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_mlp: counts {counts} do not split {x.shape[0]} rows over {experts} experts")
    return counts


def grouped_mlp(x: torch.Tensor, counts: Counts, gate_up: torch.Tensor, down: torch.Tensor,
                act: Act = F.silu, impl: str = "auto", *, glu: Optional[Glu] = None,
                gate_up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SwiGLU experts over rows grouped by expert: ``counts[e]`` consecutive rows go to expert ``e``.

    ``counts``: host ints that add up to the rows, or a device group list (int64 counts; rows past
    its sum are padding and come out zero). ``impl``: one of `IMPLS`, or a name `resolve_impl` returns.
    ``glu(gate, up)`` replaces ``act(gate) * up``; ``gate_up_bias [E, 2F]`` and ``down_bias [E, H]``
    are added after each projection.
    """
    counts = _check_counts(x, counts, gate_up.shape[0])
    if x.shape[0] == 0:
        return x.new_empty(0, down.shape[1])
    which = resolve_impl(impl, x, gate_up, down)
    return _IMPL_FNS[which](x, counts, gate_up, down, _Form(act, glu, gate_up_bias, down_bias))


class LocalExperts(nn.Module):
    """The routed experts of one rank, stacked (see the module docstring for the layout).

    Beyond ``down(act(gate(x)) * up(x))`` (the ``plain`` form, the only one the static-shape layer
    computes): ``gate_up_bias [E, 2F]`` / ``down_bias [E, H]``, ``glu(gate, up)`` in place of
    ``act(gate) * up``; ``identity`` experts after the weighted ones, whose output is their input
    (``num_local`` counts them); ``input_scale``, a module giving each row's router score per expert
    ``[rows, total experts]``, by which each row is scaled, for its expert ``first_expert + e``,
    before the MLP.
    """

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, first_expert: int = 0,
                 act: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, impl: str = "auto", *,
                 gate_up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None,
                 glu: Optional[Glu] = None, identity: int = 0, input_scale: Optional[nn.Module] = None):
        super().__init__()
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0] \
                or gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
            raise ValueError(f"expert weights must be gate_up [E, 2F, H] and down [E, H, F], got "
                             f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
        e, f2, h = gate_up.shape
        for name, bias, shape in (("gate_up_bias", gate_up_bias, (e, f2)), ("down_bias", down_bias, (e, h))):
            if bias is not None and tuple(bias.shape) != shape:
                raise ValueError(f"{name} must be {list(shape)}, got {tuple(bias.shape)}")
        if impl not in IMPLS:
            raise ValueError(f"expert implementation must be one of {IMPLS}, got {impl!r}")
        if identity < 0 or (identity and input_scale is not None):
            raise ValueError(f"identity experts must be a count >= 0 ({identity}), and are not scaled by input_scale")
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.gate_up_bias = None if gate_up_bias is None else nn.Parameter(gate_up_bias, requires_grad=False)
        self.down_bias = None if down_bias is None else nn.Parameter(down_bias, requires_grad=False)
        self.first_expert = first_expert
        self.act = act or F.silu
        self.glu = glu
        self.identity = int(identity)
        self.input_scale = input_scale
        self.impl = impl

    @property
    def num_local(self) -> int:
        return self.gate_up.shape[0] + self.identity

    def extras(self) -> List[str]:
        """What these experts compute beyond the plain form (empty: plain)."""
        return [what for what, on in (
            ("biases", self.gate_up_bias is not None or self.down_bias is not None),
            (f"the GLU {self.glu!r}" if self.glu is not None else "", self.glu is not None),
            (f"{self.identity} identity expert(s)", self.identity > 0),
            ("rows scaled by their router score", self.input_scale is not None)) if on]

    @property
    def plain(self) -> bool:
        """Whether each expert computes ``down(act(gate(x)) * up(x))`` and nothing else."""
        return not self.extras()

    def _mlp(self, x: torch.Tensor, counts: Counts, impl: Optional[str] = None) -> torch.Tensor:
        return grouped_mlp(x, counts, self.gate_up, self.down, self.act, impl or self.impl, glu=self.glu,
                           gate_up_bias=self.gate_up_bias, down_bias=self.down_bias)

    def _scaled(self, x: torch.Tensor, counts: Counts) -> torch.Tensor:
        """Each row times its expert's score (`input_scale`); rows past a group list's sum are left as they are."""
        scores = self.input_scale(x)
        ids = (row_experts(counts, x.shape[0], x.device) + self.first_expert)[:, None]
        return x * scores.gather(1, ids.clamp(max=scores.shape[1] - 1)).to(x.dtype)

    takes_quantized_tokens = True  # a quantized dispatch's rows as they arrive: dequantized per row in `forward`

    def forward(self, x: Union[torch.Tensor, QuantizedTokens], counts: Counts,
                impl: Optional[str] = None) -> torch.Tensor:
        """The experts over rows grouped by ``counts``; ``impl`` (`resolve_impl`'s names) overrides theirs. Rows
        of a quantized dispatch (`collectives.quantize.QuantizedTokens`) are dequantized per row first."""
        x = as_float(x, self.gate_up.dtype)
        if self.input_scale is not None and x.shape[0]:
            counts = _check_counts(x, counts, self.num_local)
            x = self._scaled(x, counts)
        if not self.identity:
            return self._mlp(x, counts, impl)
        counts = _check_counts(x, counts, self.num_local)
        n = self.gate_up.shape[0]
        if isinstance(counts, torch.Tensor):  # static shapes: identity rows selected from x, the rest computed
            rows = torch.arange(x.shape[0], device=x.device)
            ends = counts.cumsum(0)
            mine = (rows >= ends[n - 1]) & (rows < ends[-1]) if n else rows < ends[-1]
            y = self._mlp(x, counts[:n], impl) if n else torch.zeros_like(x)
            return torch.where(mine[:, None], x, y)
        m = sum(counts[:n])
        return torch.cat([self._mlp(x[:m], counts[:n]), x[m:]])
