"""What the reference decoder and the transformers adapter share: seeded weights, the token-id check.

Neither model imports the other; both import this. (Their forward micro-batch by micro-batch,
without the executor, is `microbatch.forward.forward_layer_by_layer`; the contract both
implement is `microbatch.model.MoEModel`.)
"""
from __future__ import annotations

import hashlib

import torch


def param_seed(seed: int, name: str) -> int:
    """The seed of parameter ``name``'s generator: a hash of ``(seed, name)``, the same on every rank and machine."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def check_token_ids(tokens: torch.Tensor, vocab: int) -> None:
    """ValueError unless every token id is in ``[0, vocab)``; checked on the host, except while compiling
    (a compiled graph reads nothing back)."""
    if tokens.numel() and not torch.compiler.is_compiling() and (
            int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"token ids must be in [0, {vocab}), got [{int(tokens.min())}, {int(tokens.max())}]")


__all__ = ["check_token_ids", "param_seed"]
