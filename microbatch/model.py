"""What microbatch needs of a model, as a `typing.Protocol`: the contract between a model and the runner.

`microbatch.forward` runs a model's layers through a schedule; of the model itself it needs only
`ForwardModel`. The layers' operations are passed beside it, so that the caller can change them
(an expert-parallel MoE, a KV offload after attention) without touching the model.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ForwardModel(Protocol):
    """What `microbatch.forward` uses of a model: the embedding before the layers and the final norm after.

    A model whose layers cannot continue a request from a prefix (a cut request's later part) also
    has ``no_cut_reason``, a string saying why; `microbatch.forward.cut_refusal` reads it, and a
    model without it (or with None) can.
    """

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states [tokens, hidden] of token ids [tokens]."""

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm of the last layer's output."""


__all__ = ["ForwardModel"]
