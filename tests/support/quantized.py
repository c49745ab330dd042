"""Small MoE models of two transformers families for the quantized checkpoints' tests, and the one-rank
expert-parallel form the launcher runs them in (needs the transformers extra)."""
from __future__ import annotations

import torch

from collectives import wrap_expert_parallel

# hidden 160: FP8's blocks of 128 leave an edge of 32 (not a multiple of 128), as do the experts' 48 rows
COMMON = dict(hidden_size=160, num_hidden_layers=2, num_attention_heads=4, vocab_size=128, intermediate_size=96,
              max_position_embeddings=64)
FAMILIES = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, num_key_value_heads=2,
                      head_dim=16, mlp_only_layers=[0]),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4),
}


def small_model(family: str) -> torch.nn.Module:
    """A seeded float model of ``family`` (one of `FAMILIES`) at the small sizes, in eval mode."""
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, **COMMON, **FAMILIES[family])
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for b in model.buffers():  # DeepSeek-V3's score correction bias is zeros at init
            if b.is_floating_point() and b.abs().sum() == 0:
                b.normal_(0, 0.1)
    return model


def wrapped(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with each MoE block as the expert-parallel layer (one rank), as the launcher runs it."""
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp = wrap_expert_parallel(layer.mlp)
    return model
