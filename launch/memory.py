"""How much memory a rank of the launcher needs, estimated before anything is allocated.

A run too big for the machine is otherwise killed by the kernel's OOM killer with no message, or
fails deep inside an allocation. The estimate is deliberately rough and errs high: this rank's
weights (its share of the routed experts, everything else whole), the activations of the largest
step (attention scores of the longest request, the MoE's expanded rows and exchange buffers, a
factor for the modes that hold two micro-batches and for what the measurement keeps), the
host KV store of ``--kv-offload``, and in generation the KV cache of the prompts and new tokens
(`decode_kv_cache`).
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
    kv_cache: int = 0  # generation's KV cache: the prompts' and new tokens' keys and values (`decode_kv_cache`)

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.kv_store + self.kv_cache


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


def _kv_row_bytes(job: JobConfig) -> int:
    """The bytes of one token's keys and values over every layer (every head, as the estimate errs high)."""
    cfg = job.model
    hidden = _first(cfg, "hidden", "hidden_size")
    heads = _first(cfg, "n_heads", "num_attention_heads", default=1)
    inner = heads * _first(cfg, "head_dim", "v_head_dim", default=max(1, hidden // heads))
    layers = _first(cfg, "n_layers", "num_hidden_layers", default=1)
    return 2 * layers * inner * torch.empty((), dtype=job.dtype).element_size()


def _padded_slots(slots: int) -> int:
    """The rows a captured step pads ``slots`` requests to: the power of two at or above, for two micro-batches."""
    return 2 * (1 << max(0, slots - 1).bit_length())


def decode_kv_cache(job: JobConfig, new_tokens: int, caches: int = 1, padded: bool = False) -> int:
    """The bytes of generation's KV caches: ``caches`` of them (one per run kept with ``--decode-graph``), each a
    slot per request with room for the longest prompt and ``new_tokens``; ``padded`` (a captured step, ``--decode-
    graph``): and the room a step gathers for its padded rows. On the host with ``--kv-offload``, where the device
    holds a layer or two."""
    slots, room = len(job.seq_lens), max(job.seq_lens) + new_tokens
    rows = caches * slots * room + (_padded_slots(slots) * room if padded else 0)
    return rows * _kv_row_bytes(job)


def estimate(job: JobConfig, world: int, kv_cache: int = 0) -> Estimate:
    """The bytes one of ``world`` ranks needs to run ``job`` (the reference model or a transformers one);
    ``kv_cache``: generation's KV cache (`decode_kv_cache`), 0 for a prefill job."""
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
    kv = 2 * layers * tokens * inner * size if job.kv_offload and not kv_cache else 0
    return Estimate(int(weights), int(activations), int(kv), int(kv_cache))


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


def check(job: JobConfig, world: int, local_ranks: int, device: torch.device, kv_cache: int = 0) -> Optional[str]:
    """None when this rank's estimate fits what is free, else the problem with the numbers.

    On the CPU the ``local_ranks`` ranks of a node share its host memory, KV store and cache included;
    on a device the weights, activations and generation's KV cache (``kv_cache``, `decode_kv_cache`;
    not with ``--kv-offload``, whose cache is on the host) must fit its free memory (the KV store, on
    the host, checks its own size when it is opened).
    """
    need = estimate(job, world, kv_cache)
    free = available(device)
    if free is None:
        return None
    on_cpu = device.type == "cpu"
    share = free // max(1, local_ranks) if on_cpu else free
    kv = need.kv_store if on_cpu and job.kv_store == "memory" else 0
    cache = need.kv_cache if on_cpu or not job.kv_offload else 0
    total = need.weights + need.activations + kv + cache
    if total <= share:
        return None
    where = "host memory" if on_cpu else f"{device} memory"
    return (f"needs about {gib(total)} of {where} (weights {gib(need.weights)}, activations "
            f"{gib(need.activations)}, KV store {gib(kv)}"
            + (f", KV cache {gib(cache)}" if cache else "")
            + f") but only {gib(share)} is free for it: use more ranks, fewer --layers, shorter requests (--seq-len / "
              f"--seq-lens)" + (", fewer --new-tokens" if cache else "") + " or a smaller --preset")
