"""The job's model, built on each rank: the reference decoder, a transformers model type built small, or a
local checkpoint of which each rank reads only its own experts."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

import overlap
from launch.config import JobConfig
from launch.job import say
from launch.models.quantized.check import QuantizedCheck
from microbatch.model import MoEModel


QUANTIZED_PARTS = ("experts", "dense", "scales")  # a quantized checkpoint's bytes per rank, as held


@dataclasses.dataclass(frozen=True)
class QuantizedWeights:
    """A quantized checkpoint's weights as the ranks hold them: its ``format`` (`launch.models.quantized.check`'s
    ``fp8``, ``w8a8_dynamic``, ``w8a8_static``) and each rank's bytes of `QUANTIZED_PARTS`."""

    format: str
    per_rank: List[Dict[str, int]]

    def row(self, check: Optional[QuantizedCheck] = None) -> Dict[str, object]:
        """results.json's ``quantized``: the format, the bytes per rank and ``--check``'s figures (None without)."""
        return {"format": self.format, "bytes_per_rank": self.per_rank,
                "check": None if check is None else check.row()}

    @property
    def no_own_forward(self) -> str:
        """Why ``--check`` compares no run with the model's own forward or generate(): it is the dequantized model's."""
        return (f"its experts kept quantized ({self.format.replace('_', ' ')}) have no transformers forward: "
                f"compared with the dequantized model instead")

    def headline(self) -> str:
        """The weights in a headline's words: the format and the most bytes a rank holds of each part."""
        most = {k: max(r[k] for r in self.per_rank) for k in QUANTIZED_PARTS}
        return (f"weights {self.format.replace('_', ' ')} kept quantized, per rank at most "
                + " + ".join(f"{k} {_mib(v)}" for k, v in most.items()))


def build_model(job: JobConfig, rank: int, world: int, dev: torch.device
                ) -> Tuple[MoEModel, Optional[QuantizedWeights]]:
    """The job's model on ``dev``: the reference decoder, a small transformers model, or a checkpoint's; and a
    quantized checkpoint's weights as every rank holds them (None for float weights)."""
    if not job.transformers:
        from launch.models.reference import build_model as build_reference

        return build_reference(job.model, seed=job.seed, dtype=job.dtype, device=dev), None
    from launch.models import adapt, from_config

    if job.checkpoint is None:
        return from_config(job.model, seed=job.seed, dtype=job.dtype, device=dev), None
    from launch.agreement import agree_ready
    from launch.models.checkpoint import CheckpointError, load_checkpoint

    try:
        hf, report = load_checkpoint(job.checkpoint, rank=rank, world=world, dtype=job.dtype, device=dev)
        problem = None
    except CheckpointError as exc:  # what this rank found in its part (a missing expert...): exit 2 on every rank
        problem = str(exc).splitlines()[0]
    agree_ready("loading the checkpoint", problem, job.timeout)  # the store only: no rank is left in a collective
    kept = [report.quantized_bytes.get(k, 0) for k in QUANTIZED_PARTS]
    held = torch.tensor([report.bytes_held, report.bytes_read, *kept], dtype=torch.float64,
                        device=overlap.collective_device())
    every = [torch.zeros_like(held) for _ in range(world)]
    dist.all_gather(every, held)  # every rank reaches this point: it is after the job agreement
    say("weights: " + ", ".join(f"rank {r} holds {_mib(h[0])} (read {_mib(h[1])})" for r, h in enumerate(every))
        + f" of a {_mib(report.checkpoint_bytes)} checkpoint")
    if report.quantization:
        say(f"weights: {report.quantization}, kept quantized: " + ", ".join(
            f"rank {r} " + " + ".join(f"{k} {_mib(v)}" for k, v in zip(QUANTIZED_PARTS, h[2:]))
            for r, h in enumerate(every)))
    if report.skipped:  # what the checkpoint holds that no rank reads, by design: said, never silently
        say("weights: not read, by design: " + "; ".join(report.skipped))
    # with several ranks its blocks hold only this rank's experts, and quantized experts have no transformers
    # forward: no forward of the whole model to check
    weights = None if report.quantized_format is None else QuantizedWeights(
        report.quantized_format, [{k: int(v) for k, v in zip(QUANTIZED_PARTS, h[2:].tolist())} for h in every])
    return adapt(hf, check=holds_whole_model(job, world) and report.quantization is None), weights


def dequantized_model(job: JobConfig, rank: int, world: int, dev: torch.device) -> MoEModel:
    """The float model ``job``'s quantized checkpoint stands for, this rank's experts dequantized (the reference
    of ``--check``); the checkpoint loaded once already, so no rank fails here that did not before."""
    from launch.models import adapt
    from launch.models.checkpoint import load_checkpoint

    hf, _ = load_checkpoint(job.checkpoint, rank=rank, world=world, dtype=job.dtype, device=dev, dequantize=True)
    return adapt(hf, check=False)


def _mib(n: Union[float, torch.Tensor]) -> str:
    return f"{float(n) / 2**20:.1f} MiB"


def holds_whole_model(job: JobConfig, world: int) -> bool:
    """Whether each rank holds the whole transformers model: one built from ``--model NAME`` always, a
    checkpoint's only on one rank (each of several ranks reads its own experts only)."""
    return job.transformers and (job.checkpoint is None or world == 1)
