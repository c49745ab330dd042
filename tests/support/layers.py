"""Toy MoE layers built from the overlap primitives, for the executor and graph-contract tests."""
from __future__ import annotations

from typing import List

import torch

import overlap
from microbatch import Operation


def weightless_layer() -> List[Operation]:
    """The toy MoE layer without captured weights, so a captured graph's only inputs are the hidden states:
    attn, gate -> dispatch (EP_COMM), experts -> combine (EP_COMM), shared (SHARED_EXPERT), finalize."""
    def exchange(x):
        return x.flip(0) * 2
    return [
        Operation("attn", lambda h: torch.tanh(h) + h, ("hidden",), ("x",)),
        Operation("gate", lambda x: x * 0.5 + 0.1, ("x",), ("moe_in",)),
        Operation("dispatch", exchange, ("moe_in",), ("recv",), overlap.EP_COMM),
        Operation("experts", torch.relu, ("recv",), ("y",)),
        Operation("combine", exchange, ("y",), ("back",), overlap.EP_COMM),
        Operation("shared", torch.sin, ("moe_in",), ("sh",), overlap.SHARED_EXPERT),
        Operation("finalize", lambda x, b, s: x + b + s, ("x", "back", "sh"), ("out",)),
    ]
