"""Profile a shared-mode and a two-batch prefill of the reference model with torch.profiler, one rank, and write each
Chrome trace: what `overlap-report --points` reads in .ci/device-smoke (on CUDA: the shared experts beside the routed
experts on the GPU's own engines). Usage: python .ci/profile_points.py OUT_DIR [cuda|cpu] [small|tiny]."""
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import overlap
from launch.engine import make_expert_parallel, prefill, split_for
from launch.models import build_model, preset
from microbatch.batch import Batch


LENS = {"small": [512, 384, 128, 256], "tiny": [24, 16, 8, 12]}  # requests per preset: two-batch splits them


def main(out: str, device: str, size: str) -> None:
    os.makedirs(out, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = make_expert_parallel(build_model(preset(size), seed=0, dtype=dtype, device=device), dist.group.WORLD)
    batch = Batch.random(LENS[size], model.cfg.vocab, seed=1, device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for mode in ("shared", "two-batch"):
        split = split_for(mode, batch, dist.group.WORLD, model=model)
        with torch.no_grad():
            for _ in range(2):  # warm-up: allocations, the exchange's first calls
                prefill(model, batch, mode, split)
            overlap.synchronize()
            with profile(activities=activities) as prof:
                prefill(model, batch, mode, split)
                overlap.synchronize()
        path = os.path.join(out, f"profile_{mode}.json")
        prof.export_chrome_trace(path)
        print(f"{mode}: {path}")
    overlap.exit_rank()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cuda", sys.argv[3] if len(sys.argv) > 3 else "small")
