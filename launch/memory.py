"""How much memory a rank of the launcher needs, estimated before anything is allocated.

A run too big for the machine is otherwise killed by the kernel's OOM killer with no message, or
fails deep inside an allocation. The estimate is deliberately rough and errs high: this rank's
weights (its share of the routed experts, everything else whole), the activations of the largest
step (attention scores of the longest request, the MoE's expanded rows and exchange buffers, a
factor for the modes that hold two micro-batches and for what the measurement keeps), and the
host KV store of ``--kv-offload``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from launch.models.transformers.fields import TOP_K

from .config import JobConfig, ModelSettings


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes one rank needs, by part."""

    weights: int
    activations: int
    kv_store: int

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.kv_store


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _first(cfg: ModelSettings, *names: str, default: int = 0) -> int:
    """The first of ``names`` (the reference's field, then the transformers config's) set to a positive integer."""
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


def _param_counts(job: JobConfig) -> Tuple[int, int]:
    """(all parameters, routed-expert parameters) of the job's model, counted without building it."""
    cfg = job.model
    if not job.transformers:
        n_moe = cfg.n_layers - cfg.n_dense_layers
        return cfg.num_params(), n_moe * cfg.n_experts * 3 * cfg.hidden * cfg.moe_ffn
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    named = list(hf.named_parameters())
    return sum(p.numel() for _, p in named), sum(p.numel() for n, p in named if ".experts." in n)


def estimate(job: JobConfig, world: int) -> Estimate:
    """The bytes one of ``world`` ranks needs to run ``job`` (the reference model or a transformers one)."""
    cfg = job.model
    size = torch.empty((), dtype=job.dtype).element_size()
    total, experts = _param_counts(job)
    # each rank keeps its share of the routed experts; --check with a transformers model keeps the whole model
    whole = job.transformers and job.checkpoint is None
    weights = (total - experts + experts // world + (experts if whole else 0)) * size
    hidden = _first(cfg, "hidden", "hidden_size")
    heads = _first(cfg, "n_heads", "num_attention_heads", default=1)
    inner = heads * _first(cfg, "head_dim", "v_head_dim", default=max(1, hidden // heads))
    ffn = max(_first(cfg, "dense_ffn", "intermediate_size"),
              2 * _first(cfg, "moe_ffn", "moe_intermediate_size") * _first(cfg, "top_k", *TOP_K))
    top_k = _first(cfg, "top_k", *TOP_K, default=1)
    tokens, longest = sum(job.seq_lens), max(job.seq_lens)
    per_token = (hidden * 8 + inner * 6 + ffn * 3 + top_k * hidden * 4) * size
    scores = heads * longest * longest * 4  # the attention of the longest request, in float32
    # two micro-batches in flight, and each mode's output kept for the comparison
    activations = 2 * (tokens * per_token + scores) + len(job.modes) * tokens * hidden * 4
    layers = _first(cfg, "n_layers", "num_hidden_layers", default=1)
    kv = 2 * layers * tokens * inner * size if job.kv_offload else 0
    return Estimate(int(weights), int(activations), int(kv))


def available(device: torch.device) -> Optional[int]:
    """Bytes free for this rank on ``device`` (host memory on the CPU), or None when unknown."""
    try:
        if device.type == "cpu":
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
            return None
        mod = getattr(torch, device.type)  # torch.cuda, torch.npu: each has mem_get_info
        free, _total = mod.mem_get_info(device)
        return int(free)
    except Exception:  # no /proc, or a device API without mem_get_info
        return None


def check(job: JobConfig, world: int, local_ranks: int, device: torch.device) -> Optional[str]:
    """None when this rank's estimate fits what is free, else the problem with the numbers.

    On the CPU the ``local_ranks`` ranks of a node share its host memory, KV store included; on a
    device the weights and activations must fit its free memory (the KV store, on the host, checks
    its own size when it is opened).
    """
    need = estimate(job, world)
    free = available(device)
    if free is None:
        return None
    on_cpu = device.type == "cpu"
    share = free // max(1, local_ranks) if on_cpu else free
    kv = need.kv_store if on_cpu and job.kv_store == "memory" else 0
    total = need.weights + need.activations + kv
    if total <= share:
        return None
    where = "host memory" if on_cpu else f"{device} memory"
    return (f"needs about {gib(total)} of {where} (weights {gib(need.weights)}, activations "
            f"{gib(need.activations)}, KV store {gib(kv)}) but only {gib(share)} is free for it: use more "
            f"ranks, fewer --layers, shorter requests (--seq-len / --seq-lens) or a smaller --preset")
