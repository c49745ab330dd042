"""``--check`` of weights kept quantized: the run against the dequantized float model of the same weights.

The reference is the float model the quantized weights stand for (a checkpoint's, on each rank its own experts,
`launch.models.load_checkpoint(..., dequantize=True)`; ``--quantize``'s, the seeded model rounded by the same
rules, `launch.models.quantized.in_memory.quantize_in_memory(..., dequantize=True)`), made expert-parallel as the
run is and run serially on the same prompts. Every rank computes its figures (`launch.models.quantized.check`) and every rank gets them all
(one `overlap.agree`), so every rank judges alike.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from collectives import QuantizedExperts
from launch.engine import generate, prefill, split_for
from launch.models.quantized.check import LogitFigures, QuantizedCheck, TokenFigures, logit_figures, over_ranks, \
    token_figures
from microbatch.batch import Batch
from microbatch.model import DecodeModel, MoEModel
from overlap import GroupTransport, agree

__all__ = ["generation_check", "prefill_check"]


def _serial_logits(model: MoEModel, batch: Batch, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    return model.logits(prefill(model, batch, "serial", split_for("serial", batch, group, model=model)))


def _kernels(model: torch.nn.Module) -> List[str]:
    """The kernels the model's quantized experts last computed with (`QuantizedExperts.last_kernel`)."""
    return sorted({k for k in (getattr(m, "last_kernel", None) for m in model.modules()
                               if isinstance(m, QuantizedExperts)) if k})


def _over_every_rank(fmt: str, dtype: torch.dtype, logits: LogitFigures, tokens: Optional[TokenFigures],
                     model: torch.nn.Module, group: Optional[dist.ProcessGroup]) -> QuantizedCheck:
    """This rank's figures with every rank's (one exchange), as one check, bounded for the kernels any rank ran."""
    mine = {"logits": dataclasses.asdict(logits), "tokens": None if tokens is None else dataclasses.asdict(tokens),
            "kernels": _kernels(model)}
    posts = agree({"figures": mine}, GroupTransport(group, name="quantized check"), per_rank=("figures",))
    kernels = tuple(sorted({k for p in posts for k in p["figures"]["kernels"]}))
    return QuantizedCheck(fmt, dtype, *over_ranks([p["figures"] for p in posts]), kernels=kernels)


def prefill_check(model: MoEModel, reference: MoEModel, batch: Batch, fmt: str, dtype: torch.dtype,
                  group: Optional[dist.ProcessGroup]) -> QuantizedCheck:
    """``model`` (the quantized run, expert-parallel) against ``reference`` (its dequantized model, the same way):
    the serial prefill's logits of ``batch``. Every rank of ``group`` takes part."""
    with torch.no_grad():
        figures = logit_figures(_serial_logits(model, batch, group), _serial_logits(reference, batch, group))
    return _over_every_rank(fmt, dtype, figures, None, model, group)


def generation_check(model: DecodeModel, reference: DecodeModel, batch: Batch, prompts: Sequence[Sequence[int]],
                     limits: Sequence[int], tokens: Sequence[Sequence[int]], stop_token: Optional[int], fmt: str,
                     dtype: torch.dtype, group: Optional[dist.ProcessGroup]) -> QuantizedCheck:
    """The prefill's logits as `prefill_check`, and ``tokens`` (the quantized run's serial generation of
    ``prompts``) against the reference's greedy tokens, with its margins."""
    with torch.no_grad():
        logits = logit_figures(_serial_logits(model, batch, group), _serial_logits(reference, batch, group))
        want = generate(reference, prompts, list(limits), stop_token=stop_token, mode="serial", margins=True)
    return _over_every_rank(fmt, dtype, logits, token_figures(tokens, want.tokens, want.margins), model, group)
