"""The job's model, built on each rank: the reference decoder, a transformers model type built small, or a
local checkpoint of which each rank reads only its own experts."""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

import overlap
from launch.config import JobConfig
from launch.job import say
from launch.models.quantized.check import QuantizedCheck
from microbatch.model import MoEModel


QUANTIZED_PARTS = ("experts", "dense", "scales")  # the bytes per rank of weights kept quantized, as held


@dataclasses.dataclass(frozen=True)
class QuantizedWeights:
    """Weights kept quantized (a quantized checkpoint's, or ``--quantize``'s) as the ranks hold them: their
    ``format`` (`launch.models.quantized.check`'s ``fp8``, ``w8a8_dynamic``, ``w8a8_static``) and each rank's bytes
    of `QUANTIZED_PARTS`."""

    format: str
    per_rank: List[Dict[str, int]]

    def row(self, check: Optional[QuantizedCheck] = None) -> Dict[str, object]:
        """results.json's ``quantized``: the format, the bytes per rank and ``--check``'s figures (None without)."""
        return {"format": self.format, "bytes_per_rank": self.per_rank,
                "check": None if check is None else check.row()}

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
        model = from_config(job.model, seed=job.seed, dtype=job.dtype, device=dev)
        model.indexer_stream = job.indexer_stream
        return model, None
    from launch.agreement import agree_ready
    from launch.models.checkpoint import CheckpointError, load_checkpoint

    try:
        hf, report = load_checkpoint(job.checkpoint, rank=rank, world=world, dtype=job.dtype, device=dev)
        problem = None
    except CheckpointError as exc:  # what this rank found in its part (a missing expert...): exit 2 on every rank
        problem = str(exc).splitlines()[0]
    agree_ready("loading the checkpoint", problem, job.timeout)  # the store only: no rank is left in a collective
    kept = [report.quantized_bytes.get(k, 0) for k in QUANTIZED_PARTS]
    every = _every_rank([report.bytes_held, report.bytes_read, *kept], world)  # after the job agreement
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
    model = adapt(hf, check=holds_whole_model(job, world) and report.quantization is None)
    model.indexer_stream = job.indexer_stream
    return model, weights


def _every_rank(values: List[float], world: int) -> List[torch.Tensor]:
    """This rank's ``values`` with every rank's (one all-gather; every rank calls it at the same point)."""
    held = torch.tensor(values, dtype=torch.float64, device=overlap.collective_device())
    every = [torch.zeros_like(held) for _ in range(world)]
    dist.all_gather(every, held)
    return every


_IN_MEMORY_FORMATS = {"fp8": "fp8", "w8a8": "w8a8_dynamic"}  # --quantize's rules are the writer's: W8A8_DYNAMIC


def quantize_job_model(job: JobConfig, model: MoEModel, world: int) -> Optional[QuantizedWeights]:
    """With ``--quantize``: the expert-parallel ``model``'s weights quantized in memory (this rank's experts and
    the projections), and what every rank holds of them; None without."""
    if job.quantize is None:
        return None
    from launch.models.quantized.in_memory import quantize_in_memory

    held = quantize_in_memory(model, job.quantize)
    every = _every_rank([held[k] for k in QUANTIZED_PARTS], world)
    say(f"weights: {job.quantize}, quantized in memory: " + ", ".join(
        f"rank {r} " + " + ".join(f"{k} {_mib(v)}" for k, v in zip(QUANTIZED_PARTS, h)) for r, h in enumerate(every)))
    return QuantizedWeights(_IN_MEMORY_FORMATS[job.quantize],
                            [{k: int(v) for k, v in zip(QUANTIZED_PARTS, h.tolist())} for h in every])


def no_own_check(job: JobConfig, weights: Optional[QuantizedWeights]) -> Optional[str]:
    """Why ``--check`` compares no run with a transformers model's own forward or generate(): quantized weights,
    whose reference is the dequantized model; None otherwise."""
    fmt = weights.format if weights is not None else _IN_MEMORY_FORMATS.get(job.quantize or "")
    if fmt is None or not job.transformers:  # the reference decoder has no forward of its own to compare with
        return None
    return (f"its weights kept quantized ({fmt.replace('_', ' ')}) have no transformers forward: compared with "
            f"the dequantized model instead")


def dequantized_model(job: JobConfig, rank: int, world: int, dev: torch.device,
                      expert_parallel: Callable[[MoEModel], MoEModel]) -> MoEModel:
    """The float model ``job``'s quantized weights stand for, made expert-parallel by ``expert_parallel`` as the run
    was (the reference of ``--check``): a checkpoint's, this rank's experts dequantized (loaded once already, so no
    rank fails here that did not before); with ``--quantize``, the same seeded model with every weight rounded by
    the format's rules and kept in ``--dtype``."""
    if job.checkpoint is None:
        from launch.models.quantized.in_memory import quantize_in_memory

        model = expert_parallel(build_model(job, rank, world, dev)[0])
        quantize_in_memory(model, job.quantize or "", dequantize=True)
        return model
    from launch.models import adapt
    from launch.models.checkpoint import load_checkpoint

    hf, _ = load_checkpoint(job.checkpoint, rank=rank, world=world, dtype=job.dtype, device=dev, dequantize=True)
    model = adapt(hf, check=False)
    model.indexer_stream = job.indexer_stream
    return expert_parallel(model)


def _mib(n: Union[float, torch.Tensor]) -> str:
    return f"{float(n) / 2**20:.1f} MiB"


def holds_whole_model(job: JobConfig, world: int) -> bool:
    """Whether each rank holds the whole transformers model: one built from ``--model NAME`` always, a
    checkpoint's only on one rank (each of several ranks reads its own experts only)."""
    return job.transformers and (job.checkpoint is None or world == 1)
