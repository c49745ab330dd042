"""A packed batch of requests (`SeqInfo`, `Batch`) and the value names a model's layers and the runner share.

A packed batch is the tokens of several requests laid end to end: `SeqInfo` says how many tokens
of each request it holds (and, for a micro-batch that continues a request cut by the splitter,
how many came before), `Batch` pairs it with the token ids. The model, the splitter
(`microbatch.planning.split`) and the runner (`microbatch.forward`) all import them from here.

The executor's values of a micro-batch, beside ``HIDDEN`` and ``OUT`` (`microbatch.schedules`):
``SEQ`` is its `SeqInfo` and ``PREFIX_KV`` the ``(k, v)`` of a cut request's earlier tokens at the
current layer (or None), both read by attention at every layer; ``K`` and ``V`` are a layer's
keys and values, written by attention (for the later micro-batches' prefix and the KV offload).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence, Tuple

import torch

SEQ, PREFIX_KV = "seq", "prefix_kv"  # a micro-batch's context values, read by attention at every layer
K, V = "k", "v"  # a layer's keys and values, written by attention
KV_STEP = "kv_step"  # a decode step's context value: its `microbatch.kv_cache.KVStep`, read by attention


def check_lens(name: str, lens: Sequence[int]) -> Tuple[int, ...]:
    """``lens`` as a tuple of ints; a ValueError naming ``name`` if one is negative."""
    out = tuple(int(n) for n in lens)
    if any(n < 0 for n in out):
        raise ValueError(f"{name} must be non-negative token counts, got {list(out)}")
    return out


@dataclasses.dataclass(frozen=True)
class SeqInfo:
    """The requests packed in one (micro-)batch.

    ``seq_lens[i]`` tokens of request ``i`` are in this batch; ``prefix_lens[i]`` tokens of the same
    request came before them (computed in an earlier micro-batch; their keys and values are passed
    to attention as ``prefix_kv``, packed in request order). Positions continue after the prefix.
    """

    seq_lens: Tuple[int, ...]
    prefix_lens: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        lens = check_lens("seq_lens", self.seq_lens)
        prefix = check_lens("prefix_lens", self.prefix_lens) if self.prefix_lens else (0,) * len(lens)
        if len(prefix) != len(lens):
            raise ValueError(f"prefix_lens {list(prefix)} and seq_lens {list(lens)} differ in length")
        object.__setattr__(self, "seq_lens", lens)
        object.__setattr__(self, "prefix_lens", prefix)

    @classmethod
    def from_lens(cls, seq_lens: Sequence[int]) -> "SeqInfo":
        """A batch of new requests (no prefixes)."""
        return cls(tuple(seq_lens))

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)

    @property
    def num_prefix_tokens(self) -> int:
        return sum(self.prefix_lens)

    @property
    def cu_seqlens(self) -> Tuple[int, ...]:
        """Cumulative token offsets ``(0, n0, n0 + n1, ...)`` of the requests in the packed batch."""
        return (0,) + tuple(itertools.accumulate(self.seq_lens))

    def cu_seqlens_tensor(self, device: Any = None) -> torch.Tensor:
        return torch.tensor(self.cu_seqlens, dtype=torch.int32, device=device)

    def positions(self, device: Any = None) -> torch.Tensor:
        """Position of every packed token within its request ([num_tokens] int64)."""
        parts = [torch.arange(p, p + n, dtype=torch.int64) for n, p in zip(self.seq_lens, self.prefix_lens)]
        pos = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        return pos.to(device) if device is not None else pos


@dataclasses.dataclass(frozen=True)
class Batch:
    """Token ids of packed requests ([num_tokens] int64) and their `SeqInfo`.

    `microbatch.split.split_batch` cuts it into the micro-batches of a split.
    """

    tokens: torch.Tensor
    seq: SeqInfo

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.tokens.shape[0] != self.seq.num_tokens:
            raise ValueError(f"tokens {tuple(self.tokens.shape)} do not match seq_lens {list(self.seq.seq_lens)} "
                             f"({self.seq.num_tokens} tokens)")

    @classmethod
    def random(cls, seq_lens: Sequence[int], vocab: int, seed: int = 0, device: Any = None) -> "Batch":
        """Random token ids for requests of ``seq_lens`` tokens, deterministic from ``seed``."""
        seq = SeqInfo.from_lens(seq_lens)
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab, (seq.num_tokens,), generator=gen)
        return cls(tokens.to(device) if device is not None else tokens, seq)

    @classmethod
    def pack(cls, requests: Sequence[torch.Tensor]) -> "Batch":
        """Pack the token ids of several requests into one batch."""
        return cls(torch.cat(list(requests)), SeqInfo.from_lens([r.shape[0] for r in requests]))


__all__ = ["Batch", "K", "PREFIX_KV", "SEQ", "SeqInfo", "V", "check_lens"]
