"""Shapes of the reference model: `ModelConfig` and the named presets.

``tiny`` is for CPU tests, ``small`` the CPU default of the launcher and benchmarks, and
``deepseek-v3`` carries DeepSeek-V3's published shapes for devices (671B parameters: build it
only with fewer layers, e.g. ``preset("deepseek-v3", n_layers=6, n_dense_layers=1)``: 1 dense and 5 MoE
layers, where ``n_layers=4`` alone keeps V3's 3 dense layers and leaves 1 MoE layer; or expert-parallel).
Attention is plain multi-head attention, not DeepSeek's MLA, and routing is plain top-k, not
grouped; what the overlap work depends on (token counts, hidden size, experts, top-k) is kept.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

from collectives.reference import MoEConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-style decoder: the first ``n_dense_layers`` layers have a dense MLP, the rest a MoE."""

    vocab: int = 128
    hidden: int = 64
    n_layers: int = 3
    n_dense_layers: int = 1
    n_heads: int = 4
    head_dim: int = 16
    dense_ffn: int = 128
    moe_ffn: int = 32
    n_experts: int = 8
    top_k: int = 2
    n_shared: int = 1
    score_func: str = "softmax"
    rope_theta: Optional[float] = 10000.0  # None: no rotary embedding
    norm_eps: float = 1e-6
    tie_embeddings: bool = False  # the LM head reads the embedding's weight instead of a weight of its own

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "n_layers", "n_heads", "head_dim", "dense_ffn", "moe_ffn", "n_experts"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"n_dense_layers={self.n_dense_layers} must be between 0 and n_layers={self.n_layers}")
        if self.rope_theta is not None and self.head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {self.head_dim}")
        self.moe_config()  # validates top_k, n_shared and score_func

    def moe_config(self) -> MoEConfig:
        """The MoE block's config (`collectives.reference.MoEConfig`)."""
        return MoEConfig(hidden=self.hidden, ffn=self.moe_ffn, n_experts=self.n_experts, top_k=self.top_k,
                         n_shared=self.n_shared, score_func=self.score_func)

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.n_dense_layers

    @property
    def k_shape(self) -> Tuple[int, ...]:
        """Per-token shape of a layer's keys (and values): ``(heads, head_dim)``."""
        return (self.n_heads, self.head_dim)

    @property
    def v_shape(self) -> Tuple[int, ...]:
        return (self.n_heads, self.head_dim)

    def num_params(self) -> int:
        """Parameter count of the model these shapes build (checked against a built model in the tests)."""
        attn = 4 * self.hidden * self.n_heads * self.head_dim + 2 * self.hidden  # q, k, v, o and two norms
        dense = 3 * self.hidden * self.dense_ffn
        moe = (self.n_experts * self.hidden + 3 * self.hidden * self.moe_ffn * (self.n_experts + self.n_shared))
        n_moe = self.n_layers - self.n_dense_layers
        head = 0 if self.tie_embeddings else self.vocab * self.hidden
        return (self.vocab * self.hidden + self.hidden + self.n_layers * attn
                + self.n_dense_layers * dense + n_moe * moe + head)


PRESETS: Dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "small": ModelConfig(vocab=1024, hidden=256, n_layers=4, n_dense_layers=1, n_heads=8, head_dim=32,
                         dense_ffn=512, moe_ffn=128, n_experts=16, top_k=4, n_shared=1),
    "deepseek-v3": ModelConfig(vocab=129280, hidden=7168, n_layers=61, n_dense_layers=3, n_heads=128,
                               head_dim=128, dense_ffn=18432, moe_ffn=2048, n_experts=256, top_k=8,
                               n_shared=1, score_func="sigmoid"),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The preset ``name`` with some fields replaced, e.g. ``preset("deepseek-v3", n_layers=6, n_dense_layers=1)``."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
