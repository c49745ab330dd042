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
import math
from typing import List, Optional, Tuple

import click
import torch

from collectives.quantize import dispatch_dtype_of, wire_bytes_per_token
from launch.models.common import one_line
from launch.models.quantized import QuantFormat, checkpoint_format, quantizes
from launch.models.quantized.formats import QUANTIZED_TYPES
from launch.models.transformers.fields import TOP_K

from .config import ConfigError, DryRun, JobConfig, ModelSettings, n_experts


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes one rank needs, by part."""

    weights: int
    activations: int  # the exchange buffers (`exchange`) included
    kv_store: int
    kv_cache: int = 0  # generation's KV cache: the prompts' and new tokens' keys and values (`decode_kv_cache`)
    expert_weights: int = 0  # of ``weights``: this rank's routed experts (the rest: its dense parts)
    exchange: int = 0  # of ``activations``: the MoE's expanded rows and expert-parallel exchange buffers

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.kv_store + self.kv_cache

    @property
    def dense_weights(self) -> int:
        """Everything but the routed experts: embedding, attention, dense MLPs, shared experts, routers, LM head."""
        return self.weights - self.expert_weights


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
    named = _meta_parameters(job)
    return sum(p.numel() for _, p in named), sum(p.numel() for n, p in named if ".experts." in n)


def _meta_parameters(job: JobConfig) -> List[Tuple[str, torch.Tensor]]:
    """The transformers model's named parameters, built on the meta device (no memory)."""
    return list(_meta_model(job).named_parameters())


def _meta_model(job: JobConfig) -> torch.nn.Module:
    """The job's model (the reference decoder, or the transformers model) on the meta device (no memory)."""
    cfg = job.model
    if not job.transformers:
        from launch.models.reference import Model

        with torch.device("meta"):
            return Model(cfg)
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:  # noqa: BLE001 (a family checked by no small run: --dry-run)
        raise ConfigError(f"--model {job.model_name}: transformers cannot build a {cfg.model_type} causal LM "
                          f"({one_line(exc, limit=200)}): the adapter runs decoder-only causal LMs") from None
    return hf


def _scale_bytes(out: int, inp: int, fmt: QuantFormat) -> int:
    """The scales of one quantized ``[out, in]`` weight, float32 as stored: FP8 one per block, int8 a scale and an
    offset per output channel."""
    if fmt.method == "fp8":
        return math.ceil(out / fmt.block[0]) * math.ceil(inp / fmt.block[1]) * 4
    return out * 2 * 4


def _held_bytes(name: str, p: torch.Tensor, fmt: QuantFormat, size: int, in_memory: Optional[bool] = None) -> int:
    """The bytes a quantized checkpoint's parameter ``name`` is held in (`launch.models.load_checkpoint`): a fused
    experts' stack of gate, up and down weights 1 byte a weight plus each expert's scales; a quantized linear's
    weight the same, and static W8A8's activation parameters (input scale and offset, a bias and a scale per
    output channel); anything else in the run's dtype (``size`` bytes). ``in_memory`` (``--quantize``): whether
    ``name`` is quantized in memory (a linear's weight that `launch.models.quantized.quantizes`, or an expert's)."""
    if ".experts." in name and p.dim() == 3 and (in_memory or (in_memory is None and _experts_quantized(fmt))):
        e, rows, cols = p.shape  # gate_up [E, 2F, H] (two weights of [F, H] each) or down [E, H, F]
        halves = 2 if name.endswith("gate_up_proj") else 1
        return e * (rows * cols + halves * _scale_bytes(rows // halves, cols, fmt))
    quantized = in_memory if in_memory is not None else \
        quantizes(name, p) if fmt.method == "fp8" else fmt.types.get(name) in QUANTIZED_TYPES
    if not quantized:
        return p.numel() * size
    static = 4 + 4 + p.shape[0] * (4 + 4) if fmt.types.get(name) == "W8A8" else 0
    return p.numel() + _scale_bytes(p.shape[0], p.shape[1], fmt) + static


def _experts_quantized(fmt: QuantFormat) -> bool:
    """Whether a checkpoint keeps its routed experts quantized: FP8's always, W8A8's where its description types
    them so."""
    return fmt.method == "fp8" or any(".experts." in k and v in QUANTIZED_TYPES for k, v in fmt.types.items())


def _quantized_weight_bytes(job: JobConfig, world: int, whole: bool) -> Optional[Tuple[int, int]]:
    """(weights, routed experts' weights) in bytes one of ``world`` ranks holds of a quantized checkpoint, or with
    ``--quantize``, kept quantized (``whole``: and the float experts a ``--model NAME`` keeps for ``--check``);
    None for anything else."""
    if job.quantize is not None:
        return _in_memory_weight_bytes(job, world, whole)
    fmt = checkpoint_format(job.checkpoint, job.model) if job.checkpoint is not None else None
    if fmt is None:
        return None
    size = torch.empty((), dtype=job.dtype).element_size()
    held = [(".experts." in n, _held_bytes(n, p, fmt, size)) for n, p in _meta_parameters(job)]
    experts = sum(b for routed, b in held if routed) // world
    return sum(b for routed, b in held if not routed) + experts, experts


def _in_memory_weight_bytes(job: JobConfig, world: int, whole: bool) -> Tuple[int, int]:
    """(weights, routed experts' weights) in bytes one of ``world`` ranks holds with ``--quantize``
    (`launch.models.quantized.quantize_in_memory`): its routed experts and the linear projections quantized, the
    rest in the run's dtype; ``whole``: and every routed expert in it (what a ``--model NAME`` keeps)."""
    model, size = _meta_model(job), torch.empty((), dtype=job.dtype).element_size()
    fmt = QuantFormat(job.quantize or "fp8")
    linears = {id(m.weight) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and quantizes(f"{n}.weight", m.weight)}
    named = list(model.named_parameters())
    routed = [_held_bytes(n, p, fmt, size, in_memory=True) for n, p in named
              if ".experts." in n and (p.dim() == 3 or id(p) in linears)]
    rest = sum(_held_bytes(n, p, fmt, size, in_memory=id(p) in linears) for n, p in named
               if not (".experts." in n and (p.dim() == 3 or id(p) in linears)))
    experts = sum(routed) // world
    kept = sum(p.numel() for n, p in named if ".experts." in n) * size if whole else 0
    return rest + experts + kept, experts + kept


def _kv_token_elements(cfg: ModelSettings) -> Tuple[int, int]:
    """One token's cached key and value elements in one layer, as the model's cache holds them: ``cfg.k_shape`` /
    ``v_shape`` where the config knows them (the reference); else from a transformers config's fields, as its
    adapter's attention caches them: MLA (``kv_lora_rank``) its compressed latent and its rotary key
    (``qk_rope_head_dim``), once for every head, beside which sparse attention (``index_topk``) keeps its indexer's
    key (``index_head_dim``); else the key-value heads x ``head_dim``."""
    if hasattr(cfg, "k_shape"):
        return math.prod(cfg.k_shape), math.prod(cfg.v_shape)
    heads = _first(cfg, "num_attention_heads", default=1)
    if _first(cfg, "kv_lora_rank"):
        indexer = _first(cfg, "index_head_dim") if _first(cfg, "index_topk") else 0
        return _first(cfg, "kv_lora_rank"), _first(cfg, "qk_rope_head_dim") + indexer
    kv_heads = _first(cfg, "num_key_value_heads", default=heads)
    inner = kv_heads * _first(cfg, "head_dim", default=max(1, _first(cfg, "hidden_size") // heads))
    return inner, inner


def _kv_row_bytes(job: JobConfig) -> int:
    """The bytes of one token's keys and values over every layer, as the model's KV cache holds them."""
    layers = _first(job.model, "n_layers", "num_hidden_layers", default=1)
    return layers * sum(_kv_token_elements(job.model)) * torch.empty((), dtype=job.dtype).element_size()


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


def estimate(job: JobConfig, world: int, kv_cache: int = 0, deployed: bool = False) -> Estimate:
    """The bytes one of ``world`` ranks needs to run ``job`` (the reference model or a transformers one);
    ``kv_cache``: generation's KV cache (`decode_kv_cache`), 0 for a prefill job; ``deployed`` (``--dry-run``):
    the weights a rank holds as a checkpoint loads (its own experts only), even where ``--model NAME`` would
    build the whole model on every rank."""
    cfg = job.model
    size = torch.empty((), dtype=job.dtype).element_size()
    total, experts = _param_counts(job)
    # each rank keeps its share of the routed experts; --check with a transformers model keeps the whole model
    whole = job.transformers and job.checkpoint is None and not deployed
    weights = (total - experts + experts // world + (experts if whole else 0)) * size
    expert_weights = (experts // world + (experts if whole else 0)) * size
    weights, expert_weights = _quantized_weight_bytes(job, world, whole) or (weights, expert_weights)
    hidden = _first(cfg, "hidden", "hidden_size")
    heads = _first(cfg, "n_heads", "num_attention_heads", default=1)
    inner = heads * _first(cfg, "head_dim", "v_head_dim", default=max(1, hidden // heads))
    ffn = max(_first(cfg, "dense_ffn", "intermediate_size"),
              2 * _first(cfg, "moe_ffn", "moe_intermediate_size") * _first(cfg, "top_k", *TOP_K))
    top_k = _first(cfg, "top_k", *TOP_K, default=1)
    tokens, longest = sum(job.seq_lens), max(job.seq_lens)
    per_token = (hidden * 8 + inner * 6 + ffn * 3) * size
    scores = heads * longest * longest * 4  # the attention of the longest request, in float32
    # each token's top-k rows: dispatched and received (quantized with --dispatch-dtype: a byte a value and the
    # token's scale), computed and combined back (the model's dtype), two micro-batches in flight
    wire = wire_bytes_per_token(hidden, dispatch_dtype_of(job.dispatch_dtype), job.dtype)
    exchange = 2 * tokens * top_k * (2 * wire + 2 * hidden * size)
    # two micro-batches in flight, and each mode's output kept for the comparison
    activations = 2 * (tokens * per_token + scores) + exchange + len(job.modes) * tokens * hidden * 4
    layers = _first(cfg, "n_layers", "num_hidden_layers", default=1)
    kv = 2 * layers * tokens * inner * size if job.kv_offload and not kv_cache else 0
    return Estimate(int(weights), int(activations), int(kv), int(kv_cache), int(expert_weights), int(exchange))


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


def dry_run_table(job: JobConfig, nnodes: int, nproc_per_node: int, kv_cache: int = 0,
                  device_memory: Optional[int] = None) -> Tuple[List[str], Optional[str]]:
    """``--dry-run``'s table (`estimate` for the deployed job: each rank its own experts) over ``nnodes`` x
    ``nproc_per_node`` ranks, and where a rank does not fit ``device_memory`` bytes, the finding in one line
    (else None). Every rank brings the same batch and holds an equal share of the experts: one row for all."""
    world = nnodes * nproc_per_node
    need = estimate(job, world, kv_cache, deployed=True)
    cache = need.kv_cache if not job.kv_offload else 0  # --kv-offload keeps it on the host
    device = need.weights + need.activations + cache
    experts = n_experts(job.model)
    columns = [("ranks", f"0-{world - 1}, each" if world > 1 else "0"),
               ("dense weights", gib(need.dense_weights)),
               (f"routed experts ({experts // world} of {experts} a layer)", gib(need.expert_weights)),
               ("KV cache" + (" (host)" if job.kv_offload else ""), gib(need.kv_cache)),
               ("exchange buffers", gib(need.exchange)),
               ("other activations", gib(need.activations - need.exchange)),
               ("device total", gib(device))]
    widths = [max(len(head), len(cell)) for head, cell in columns]
    lines = ["  ".join(text.rjust(w) for (text, _), w in zip(columns, widths)),
             "  ".join(cell.rjust(w) for (_, cell), w in zip(columns, widths))]
    if device_memory is None:
        return lines, None
    if device <= device_memory:
        lines.append(f"fits: each rank needs {gib(device)} of its {gib(device_memory)} ({gib(device_memory - device)} "
                     f"left)")
        return lines, None
    return lines, (f"does not fit: each of the {world} ranks needs {gib(device)} (weights {gib(need.weights)}, "
                   f"KV cache {gib(cache)}, activations {gib(need.activations)}) but --device-memory is "
                   f"{gib(device_memory)}: over by {gib(device - device_memory)}")


def dry_run(job: JobConfig, dry: DryRun, kind: str, kv_cache: int = 0) -> int:
    """``--dry-run``: print the job's headline and `dry_run_table`; the exit status: 0, or 1 (and the finding in
    one line) where a rank does not fit ``--device-memory``."""
    model = f"--model {job.model_name}" if job.transformers else "the reference decoder"
    click.echo(f"dry run, {kind}: {model} over {dry.nnodes} node(s) x {dry.nproc_per_node} rank(s) = {dry.world} "
               f"ranks | {len(job.seq_lens)} requests of {max(job.seq_lens)} tokens per rank | "
               f"{str(job.dtype).replace('torch.', '')} | nothing built, nothing run")
    memory = None if dry.device_memory_gib is None else int(dry.device_memory_gib * 2**30)
    lines, problem = dry_run_table(job, dry.nnodes, dry.nproc_per_node, kv_cache, memory)
    for line in lines:
        click.echo(line)
    if problem is None:
        return 0
    click.echo(problem, err=True)
    return 1
