"""The job's model, built on each rank: the reference decoder, a transformers model type built small, or a
local checkpoint of which each rank reads only its own experts."""
from __future__ import annotations

from typing import Union

import torch
import torch.distributed as dist

import overlap
from launch.config import JobConfig
from launch.job import say
from microbatch.model import MoEModel


def build_model(job: JobConfig, rank: int, world: int, dev: torch.device) -> MoEModel:
    """The job's model on ``dev``: the reference decoder, a small transformers model, or a checkpoint's."""
    if not job.transformers:
        from launch.models.reference import build_model as build_reference

        return build_reference(job.model, seed=job.seed, dtype=job.dtype, device=dev)
    from launch.models import adapt, from_config

    if job.checkpoint is None:
        model = from_config(job.model, seed=job.seed, dtype=job.dtype, device=dev)
        model.indexer_stream = job.indexer_stream
        return model
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
    model = adapt(hf, check=holds_whole_model(job, world) and report.quantization is None)
    model.indexer_stream = job.indexer_stream
    return model


QUANTIZED_PARTS = ("experts", "dense", "scales")  # a quantized checkpoint's bytes per rank, as held


def _mib(n: Union[float, torch.Tensor]) -> str:
    return f"{float(n) / 2**20:.1f} MiB"


def holds_whole_model(job: JobConfig, world: int) -> bool:
    """Whether each rank holds the whole transformers model: one built from ``--model NAME`` always, a
    checkpoint's only on one rank (each of several ranks reads its own experts only)."""
    return job.transformers and (job.checkpoint is None or world == 1)
