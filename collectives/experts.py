"""This rank's routed experts, computed through one function: a loop everywhere, a grouped matmul where there is one.

Weights are stacked per local expert, in the layout Hugging Face's fused experts use:
``gate_up [E_local, 2F, H]`` (gate rows first, then up rows) and ``down [E_local, H, F]``.
Each expert computes ``down(act(gate(x)) * up(x))``.

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

from typing import Any, Callable, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

import overlap
from overlap.state import STATE

IMPLS = ("auto", "loop", "grouped")
Counts = Union[Sequence[int], torch.Tensor]  # host counts per expert, or a device group list (int64 counts)
Act = Callable[[torch.Tensor], torch.Tensor]

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


def _loop(x: torch.Tensor, counts: Counts, gate_up: torch.Tensor, down: torch.Tensor, act: Act) -> torch.Tensor:
    padded = isinstance(counts, torch.Tensor)  # rows past a group list's sum are padding: they stay zero
    out = x.new_zeros(x.shape[0], down.shape[1]) if padded else x.new_empty(x.shape[0], down.shape[1])
    start = 0
    for e, n in enumerate(_host_counts(counts)):  # a host read where counts are a device group list
        if n:
            g, u = F.linear(x[start:start + n], gate_up[e]).chunk(2, dim=-1)
            out[start:start + n] = F.linear(act(g) * u, down[e])
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


def _torch_grouped(x: torch.Tensor, counts: Counts, gate_up: torch.Tensor, down: torch.Tensor,
                   act: Act) -> torch.Tensor:
    gl = group_list(counts, x.device)
    offs = gl.cumsum(0).to(torch.int32)  # group ends, on the device: nothing read on the host
    g, u = torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm((act(g) * u).contiguous(), down.transpose(1, 2), offs=offs)
    return _zero_padding(y, gl) if isinstance(counts, torch.Tensor) else y


def _npu_grouped(x: torch.Tensor, counts: Counts, gate_up: torch.Tensor, down: torch.Tensor,
                 act: Act) -> torch.Tensor:
    padded = isinstance(counts, torch.Tensor)
    gl = group_list(counts, x.device)
    if gate_up.shape[0] == 1:  # npu_grouped_matmul refuses a group list of length 1: a plain matmul
        g, u = F.linear(x, gate_up[0]).chunk(2, dim=-1)
        y = F.linear(act(g) * u, down[0])
        return _zero_padding(y, gl) if padded else y
    import torch_npu

    # split_item=2: x and y are single tensors split along M by group_list (group_list_type=1: counts).
    h = torch_npu.npu_grouped_matmul([x], [gate_up.transpose(1, 2)], group_list=gl, split_item=2,
                                     group_type=0, group_list_type=1)[0]
    g, u = h.chunk(2, dim=-1)
    y = torch_npu.npu_grouped_matmul([act(g) * u], [down.transpose(1, 2)], group_list=gl,
                                     split_item=2, group_type=0, group_list_type=1)[0]
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
        if counts.device.type == "cpu" and not torch.compiler.is_compiling():
            if bool((counts < 0).any()) or int(counts.sum()) > x.shape[0]:
                raise ValueError(f"grouped_mlp: group list {counts.tolist()} does not fit {x.shape[0]} rows")
        return counts
    counts = [int(c) for c in counts]
    if len(counts) != experts or sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_mlp: counts {counts} do not split {x.shape[0]} rows over {experts} experts")
    return counts


def grouped_mlp(x: torch.Tensor, counts: Counts, gate_up: torch.Tensor, down: torch.Tensor,
                act: Act = F.silu, impl: str = "auto") -> torch.Tensor:
    """SwiGLU experts over rows grouped by expert: ``counts[e]`` consecutive rows go to expert ``e``.

    ``counts``: host ints that add up to the rows, or a device group list (int64 counts; rows past
    its sum are padding and come out zero). ``impl``: one of `IMPLS`, or a name `resolve_impl` returns.
    """
    counts = _check_counts(x, counts, gate_up.shape[0])
    if x.shape[0] == 0:
        return x.new_empty(0, down.shape[1])
    which = resolve_impl(impl, x, gate_up, down)
    return _IMPL_FNS[which](x, counts, gate_up, down, act)


class LocalExperts(nn.Module):
    """The routed experts of one rank, stacked (see the module docstring for the layout)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, first_expert: int = 0,
                 act: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, impl: str = "auto"):
        super().__init__()
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0] \
                or gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
            raise ValueError(f"expert weights must be gate_up [E, 2F, H] and down [E, H, F], got "
                             f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
        if impl not in IMPLS:
            raise ValueError(f"expert implementation must be one of {IMPLS}, got {impl!r}")
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.first_expert = first_expert
        self.act = act or F.silu
        self.impl = impl

    @property
    def num_local(self) -> int:
        return self.gate_up.shape[0]

    def forward(self, x: torch.Tensor, counts: Counts) -> torch.Tensor:
        return grouped_mlp(x, counts, self.gate_up, self.down, self.act, self.impl)
