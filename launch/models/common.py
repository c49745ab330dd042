"""What the models share: seeded weights, the token-id check, an FFN's stages, an exception in one line.

Neither model imports the other; both import this. (Their forward micro-batch by micro-batch,
without the executor, is `microbatch.forward.forward_layer_by_layer`; the contract both
implement is `microbatch.model.MoEModel`.)
"""
from __future__ import annotations

import hashlib
from typing import Any, List, Optional

import torch

import overlap
from microbatch import Operation, as_operation


def param_seed(seed: int, name: str) -> int:
    """The seed of parameter ``name``'s generator: a hash of ``(seed, name)``, the same on every rank and machine."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def check_token_ids(tokens: torch.Tensor, vocab: int) -> None:
    """ValueError unless every token id is in ``[0, vocab)``; checked on the host, except while compiling
    (a compiled graph reads nothing back) and in a step without host syncs (`overlap.no_host_sync`: a decode
    step's tokens are its own argmax)."""
    if tokens.numel() and overlap.host_reads_allowed() and (
            int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"token ids must be in [0, {vocab}), got [{int(tokens.min())}, {int(tokens.max())}]")


def one_line(exc: BaseException, typed: bool = False, limit: Optional[int] = 300) -> str:
    """An exception's message on one line (a library's may span several: transformers puts the reason on the
    second), cut to ``limit`` characters (None: whole), after its type's name with ``typed``; its type's name
    where it says nothing."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    if limit is not None and len(text) > limit:
        text = text[:limit - 3] + "..."
    if not text:
        return type(exc).__name__
    return f"{type(exc).__name__}: {text}" if typed else text


def module_stages(ffn: Any, decode_chunks: Optional[int] = None) -> Optional[List[Operation]]:
    """An FFN module's operations where it has stages (an expert-parallel layer): its decode stages where
    ``decode_chunks`` is given and it has them (`collectives.ExpertParallelMoE.decode_stages`), else its
    ``stages()``; None for a module that is called whole."""
    decode = getattr(ffn, "decode_stages", None)
    if decode_chunks is not None and callable(decode):
        return [as_operation(s) for s in decode(decode_chunks)]
    stages = getattr(ffn, "stages", None)
    return [as_operation(s) for s in stages()] if callable(stages) else None


__all__ = ["check_token_ids", "module_stages", "one_line", "param_seed"]
