"""One decode step on the device: its inputs' names, the step from tokens to picked ids, and its bucket.

`decode_step` is what every decoder runs, eager (`launch.engine.decoder.EagerDecoder`) or captured per
bucket (`launch.engine.graph_decoder.GraphDecoder`), in a generation or timed by the decode calibration: each
micro-batch's ``TOKENS`` embedded, the layers in a schedule, the final norm, the LM head and the greedy pick,
nothing read on the host (`Picked`: the ids stay on the device until the caller reads them between steps).
`bucket_of` is the size a step's exchange, or a captured step, is padded to.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import microbatch
from microbatch import HIDDEN, DecodeModel, Operation

DECODE_STEP = "decode step"  # the label of a decode step's `overlap.no_host_sync` scope, with its number
AGREEMENT = "agreement"  # the side stream the ranks' agreement on a decode step (``decode.step``) travels on
TOKENS = "tokens"  # a decode micro-batch's input: its requests' last tokens, embedded in the step


def decode_step(model: DecodeModel, layers: Sequence[Sequence[Operation]], make: Callable[..., Any],
                inputs: Sequence[Dict[str, Any]], margins: bool = False,
                lowered: Optional[microbatch.Lowered] = None) -> "Picked":
    """One decode step on the device, nothing read on the host: each micro-batch's ``TOKENS`` embedded, the
    layers in ``make``'s schedule (each micro-batch also reads its ``KV_STEP`` and ``MOE_CAPACITY``), the final
    norm, the LM head and the greedy pick (`Picked`). ``lowered``: that schedule lowered ahead (`lower_step`),
    for a step a compiler traces."""
    staged = [{HIDDEN: model.embed_tokens(v[TOKENS]), **{k: x for k, x in v.items() if k != TOKENS}} for v in inputs]
    hidden = microbatch.run_made(make, layers, staged) if lowered is None else lowered.run(staged)
    logits = model.logits(model.norm(torch.cat(hidden)))
    finite = torch.isfinite(logits).all(-1)
    ids = torch.where(finite, logits.argmax(-1), torch.full_like(finite, -1, dtype=torch.long))
    gaps = None
    if margins and logits.shape[0] and logits.shape[-1] > 1:
        top = logits.float().topk(2, dim=-1).values
        gaps = top[:, 0] - top[:, 1]
    return Picked(ids, gaps)


def lower_step(layers: Sequence[Sequence[Operation]], make: Callable[..., Any], parts: int, path: str,
               names: Sequence[str]) -> microbatch.Lowered:
    """The schedule of `decode_step` over ``parts`` micro-batches whose inputs are ``names`` (``TOKENS``
    among them), checked and lowered for ``path`` ahead of a trace (`microbatch.lower_ahead`)."""
    staged = dict.fromkeys([HIDDEN] + [n for n in names if n != TOKENS])
    return microbatch.lower_ahead(make, layers, [staged] * parts, path)


@dataclasses.dataclass
class Picked:
    """A step's greedy pick on the device: each row's argmax, -1 where its logits hold NaN or inf, and (with
    margins) the gap between its top two logits."""

    ids: torch.Tensor  # [rows] int64
    gaps: Optional[torch.Tensor] = None  # [rows] float32


def read_picked(picked: Picked, requests: List[int], step: int) -> Tuple[List[int], List[float], Optional[str]]:
    """The tokens of a step on the host (the step's one read), the margins, and what is wrong where a row was not
    finite (as the prefill's pick says it)."""
    ids = picked.ids.tolist()
    bad = [j for j, t in enumerate(ids) if t < 0]
    problem = None
    if bad:
        problem = (f"NaN or inf in the logits of request {requests[bad[0]]} at decode step {step} (0: the prefill's)"
                   + (f" and of {len(bad) - 1} more" if len(bad) > 1 else ""))
    return ids, ([] if picked.gaps is None else picked.gaps.tolist()), problem


def check_cache_dtype(model: DecodeModel, cache: Optional["microbatch.KVCache"], what: str) -> None:
    """A one-line ValueError where ``cache`` (``what``: the argument it came from) holds another dtype than the
    model computes in (its keys would be cast without a word)."""
    weight = next(model.parameters(), None)
    if cache is not None and weight is not None and cache.k.dtype != weight.dtype:
        raise ValueError(f"{what} holds {cache.k.dtype}, the model computes in {weight.dtype}: make the cache of the "
                         f"model's dtype (new_cache)")


def checked_buckets(buckets: Optional[Sequence[int]]) -> Optional[Tuple[int, ...]]:
    """``buckets`` (None: the powers of two) as increasing positive row counts, repeats dropped; a one-line
    ValueError naming the value otherwise (``[0]``, ``[-4]``, ``[1.5]``, a string, an empty list)."""
    if buckets is None:
        return None
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence) or not buckets or not all(
            _is_size(b) for b in buckets):
        raise ValueError(f"buckets must be positive row counts (integers of at least 1), got {buckets!r}")
    return tuple(sorted({int(b) for b in buckets}))


def _is_size(value: Any) -> bool:
    """Whether ``value`` is an integer (not a bool) of at least 1."""
    try:
        return not isinstance(value, bool) and operator.index(value) >= 1
    except TypeError:
        return False


def bucket_of(tokens: int, buckets: Optional[Sequence[int]] = None) -> int:
    """The bucket a step of ``tokens`` rows per micro-batch pads its exchange to: the smallest of ``buckets``
    (default: the powers of two) that holds them; past the largest, the tokens themselves."""
    tokens = max(1, int(tokens))
    if buckets is None:
        return 1 << (tokens - 1).bit_length()
    return min((b for b in buckets if b >= tokens), default=tokens)


__all__ = ["AGREEMENT", "DECODE_STEP", "TOKENS", "Picked", "bucket_of", "checked_buckets", "decode_step", "lower_step",
           "read_picked"]
