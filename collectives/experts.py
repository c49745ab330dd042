"""This rank's routed experts, computed through one function: a loop everywhere, a grouped matmul where there is one.

Weights are stacked per local expert, in the layout Hugging Face's fused experts use:
``gate_up [E_local, 2F, H]`` (gate rows first, then up rows) and ``down [E_local, H, F]``.
Each expert computes ``down(act(gate(x)) * up(x))``.

``impl``: ``"loop"`` (any path), ``"grouped"`` (``torch_npu.npu_grouped_matmul`` on the NPU
paths, ``torch._grouped_mm`` elsewhere), or ``"auto"``: grouped on the NPU paths and on CUDA for
bf16 where ``torch._grouped_mm`` exists, otherwise the loop.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

import overlap

IMPLS = ("auto", "loop", "grouped")


def _loop(x: torch.Tensor, counts: List[int], gate_up: torch.Tensor, down: torch.Tensor,
          act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    out = x.new_empty(x.shape[0], down.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            g, u = F.linear(x[start:start + n], gate_up[e]).chunk(2, dim=-1)
            out[start:start + n] = F.linear(act(g) * u, down[e])
        start += n
    return out


def _torch_grouped_ok(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.shape[0] == 0:
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    size = x.element_size()
    # torch._grouped_mm wants 16-byte aligned strides on every operand.
    return all((d * size) % 16 == 0 for d in (x.shape[1], gate_up.shape[1], down.shape[2], down.shape[1]))


def _torch_grouped(x: torch.Tensor, counts: List[int], gate_up: torch.Tensor, down: torch.Tensor,
                   act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    g, u = torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm((act(g) * u).contiguous(), down.transpose(1, 2), offs=offs)


def _npu_grouped(x: torch.Tensor, counts: Union[List[int], torch.Tensor], gate_up: torch.Tensor,
                 down: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    import torch_npu

    group_list = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, dtype=torch.int64,
                                                                            device=x.device)
    # split_item=2: x and y are single tensors split along M by group_list (group_list_type=1: counts).
    h = torch_npu.npu_grouped_matmul([x], [gate_up.transpose(1, 2)], group_list=group_list, split_item=2,
                                     group_type=0, group_list_type=1)[0]
    g, u = h.chunk(2, dim=-1)
    return torch_npu.npu_grouped_matmul([act(g) * u], [down.transpose(1, 2)], group_list=group_list,
                                        split_item=2, group_type=0, group_list_type=1)[0]


def resolve_impl(impl: str, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> str:
    """Which implementation ``grouped_mlp`` will use: "loop", "torch_grouped" or "npu_grouped"."""
    if impl not in IMPLS:
        raise ValueError(f"expert implementation must be one of {IMPLS}, got {impl!r}")
    if impl == "loop":
        return "loop"
    if overlap.backends.current().has_npu_ops:
        return "npu_grouped"
    if impl == "auto" and x.device.type != "cuda":
        return "loop"
    return "torch_grouped" if _torch_grouped_ok(x, gate_up, down) else "loop"


def grouped_mlp(x: torch.Tensor, counts: Sequence[int], gate_up: torch.Tensor, down: torch.Tensor,
                act: Callable[[torch.Tensor], torch.Tensor] = F.silu, impl: str = "auto") -> torch.Tensor:
    """SwiGLU experts over rows grouped by expert: ``counts[e]`` consecutive rows go to expert ``e``."""
    counts = [int(c) for c in counts]
    if len(counts) != gate_up.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_mlp: counts {counts} do not split {x.shape[0]} rows over "
                         f"{gate_up.shape[0]} experts")
    if x.shape[0] == 0:
        return x.new_empty(0, down.shape[1])
    which = resolve_impl(impl, x, gate_up, down)
    fn = {"loop": _loop, "torch_grouped": _torch_grouped, "npu_grouped": _npu_grouped}[which]
    return fn(x, counts, gate_up, down, act)


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

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        return grouped_mlp(x, counts, self.gate_up, self.down, self.act, self.impl)
