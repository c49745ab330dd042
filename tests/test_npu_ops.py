"""torch_npu's fused MoE operators on the NPUs themselves: skipped on every other path.

On CPU the NPU branches are tested with fakes that follow the wheel's schemas (test_grouping.py,
test_capacity.py, test_mc2.py). This file is what runs them for real: `.ci/npu-smoke` runs it as
torchrun ranks, one NPU per rank (``torchrun --nproc-per-node N -m pytest tests/test_npu_ops.py``).
Each result is compared with the dense computation of the same weights on the same device.
"""
from __future__ import annotations

from typing import List

import pytest
import torch

import overlap
from collectives import MoE, MoEConfig, capacity_expert_parallel, mc2_expert_parallel
from overlap.multirank import run_ranks

BF16 = dict(rtol=3e-2, atol=3e-2)


def _on_npu() -> torch.device:
    if overlap.current_path() != "npu":
        pytest.skip(f"needs the npu path (an Ascend NPU with torch_npu; .ci/npu-smoke runs it), "
                    f"this run is on {overlap.current_path()}")
    return overlap.backends.current().device()


def _moe(cfg: MoEConfig, device: torch.device) -> MoE:
    torch.manual_seed(1234)
    return MoE(cfg).requires_grad_(False).to(device=device, dtype=torch.bfloat16)


def test_grouped_matmul_with_a_device_group_list_equals_the_loop():
    from collectives.experts import grouped_mlp, group_list

    from support.fake_npu import expert_weights

    dev = _on_npu()
    gate_up, down = (t.to(dev) for t in expert_weights(4, torch.bfloat16, hidden=64, ffn=32))
    x = torch.randn(40, 64, device=dev).to(torch.bfloat16)
    counts = [10, 0, 25, 3]  # 2 padding rows past the group list's sum
    got = grouped_mlp(x, group_list(counts, dev), gate_up, down, impl="npu_grouped")
    want = grouped_mlp(x[:38], counts, gate_up, down, impl="loop")
    torch.testing.assert_close(got[:38], want, **BF16)
    assert not got[38:].any()  # padding comes out zero


def test_static_shape_layer_groups_on_the_device_and_equals_dense():
    from collectives.capacity import expert_path

    dev = _on_npu()
    moe = _moe(MoEConfig(hidden=64, ffn=32, n_experts=8, top_k=2), dev)
    x = torch.randn(50, 64, device=dev).to(torch.bfloat16)
    grouped = capacity_expert_parallel(moe)
    every = capacity_expert_parallel(moe, expert_path="all")
    assert expert_path("auto", x, grouped.experts) == "npu_grouped"
    got = grouped(x)
    torch.testing.assert_close(got, moe(x), **BF16)
    torch.testing.assert_close(got, every(x), **BF16)


def _mc2_body(ctx, tokens: List[int], max_tokens: int):
    cfg = MoEConfig(hidden=1024, ffn=256, n_experts=8 * ctx.world_size, top_k=8, n_shared=1)
    moe = _moe(cfg, ctx.device)
    torch.manual_seed(10 + ctx.rank)
    x = torch.randn(tokens[ctx.rank], cfg.hidden, device=ctx.device).to(torch.bfloat16)
    layer = mc2_expert_parallel(moe, ctx.group, exchange="mc2", max_tokens_per_rank=max_tokens)
    return layer(x).cpu(), moe(x).cpu()


@pytest.mark.parametrize("tokens,max_tokens", [([16, 16], 16), ([9, 3], 16)], ids=["even", "uneven"])
def test_mc2_equals_dense_on_two_npus(tokens, max_tokens):
    _on_npu()
    for rank, (got, dense) in enumerate(run_ranks(_mc2_body, 2, tokens, max_tokens, timeout=300)):
        assert got.shape == (tokens[rank], 1024) and torch.isfinite(got).all()
        torch.testing.assert_close(got, dense, **BF16, msg=lambda m: f"rank {rank}: {m}")
