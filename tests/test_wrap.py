"""wrap_expert_parallel on Hugging Face transformers MoE blocks (small configs, no downloads) and its errors."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from collectives import ExpertParallelMoE, wrap_expert_parallel
from overlap.multirank import run_ranks

pytestmark = pytest.mark.cpu_only

transformers = pytest.importorskip("transformers")

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _block(kind: str) -> nn.Module:
    """A small transformers MoE block with random weights, the same on every rank."""
    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock

        cls, cfg = MixtralSparseMoeBlock, MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=8,
                                                        num_experts_per_tok=2)
    elif kind == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeConfig, Qwen2MoeSparseMoeBlock

        cls, cfg = Qwen2MoeSparseMoeBlock, Qwen2MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=8,
                                                          shared_expert_intermediate_size=12, num_experts_per_tok=3,
                                                          norm_topk_prob=False)
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Config, DeepseekV3MoE

        cls, cfg = DeepseekV3MoE, DeepseekV3Config(hidden_size=16, moe_intermediate_size=8, n_routed_experts=8,
                                                   num_experts_per_tok=2, n_group=2, topk_group=1,
                                                   n_shared_experts=1, routed_scaling_factor=2.5)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    block = cls(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
        for b in block.buffers():  # DeepSeek-V3's expert score correction bias
            b.normal_(0, 0.1)
    return block.eval()


KINDS = ("mixtral", "qwen2_moe", "deepseek_v3")


def _wrap_body(ctx):
    out = []
    for kind in KINDS:
        for dtype in (torch.float32, torch.bfloat16):
            block = _block(kind).to(dtype)
            ep = wrap_expert_parallel(block, ctx.group)
            torch.manual_seed(100 + ctx.rank)
            x = torch.randn(2, 6 if ctx.rank else 0 if ctx.world_size > 1 else 5, 16).to(dtype)
            with torch.no_grad():
                expected, got = block(x), ep(x)
            local = ep.experts.gate_up
            shares = local.untyped_storage().data_ptr() == block.experts.gate_up_proj.untyped_storage().data_ptr()
            out.append((kind, dtype, got, expected, local.shape[0], shares))
    return out


@pytest.mark.parametrize("world", [1, 2])  # 4 ranks are covered by test_ep_moe; transformers imports are slow
def test_wrapped_transformers_blocks_equal_the_original(world):
    for rank, results in enumerate(run_ranks(_wrap_body, world, timeout=120)):
        assert [r[0] for r in results[::2]] == list(KINDS)
        for kind, dtype, got, expected, n_local, shares in results:
            torch.testing.assert_close(got, expected, **TOL[dtype], msg=lambda m: f"rank {rank} {kind} {dtype}: {m}")
            assert n_local == 8 // world, "only this rank's experts are kept"
            assert not shares, "the local experts must not keep the full expert tensor alive"


def test_wrapped_qwen2_keeps_its_shared_expert_gate():
    block = _block("qwen2_moe")
    ep = wrap_expert_parallel(block)
    assert isinstance(ep, ExpertParallelMoE) and ep.shared.output_gate is block.shared_expert_gate
    assert ep.router.gate is block.gate  # the router is reused, not copied


def test_unsupported_module_names_what_is_expected():
    with pytest.raises(TypeError, match="unsupported module Linear.*MixtralSparseMoeBlock.*DeepseekV3MoE"):
        wrap_expert_parallel(nn.Linear(4, 4))
