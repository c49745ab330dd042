"""Load a transformers MoE causal LM from a local safetensors checkpoint, each rank reading only what it keeps.

Rank ``r`` of ``W`` keeps experts ``[r*E/W, (r+1)*E/W)`` of every MoE layer and everything else
(embeddings, attention, norms, dense MLPs, routers, shared experts, lm_head) whole. The model is
built on the ``meta`` device from ``config.json``; each tensor this rank keeps is then allocated on
the requested device and dtype and filled from the safetensors files (``safe_open(...).get_slice``:
only the rows of this rank's experts), one file at a time. Nothing of the other ranks' experts is
read.

Routed experts are found by structure: a module whose ``experts`` child holds 3-D fused tensors
(``gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``) or is an ``nn.ModuleList`` of MLPs. The
checkpoint may store them per expert (``...experts.3.gate_proj.weight``, or Mixtral's
``...block_sparse_moe.experts.3.w1.weight``), which is what ``save_pretrained`` writes, or fused
(``...experts.gate_up_proj``). After loading, that ``experts`` child holds this rank's experts only
and carries ``ep_shard = (first_expert, total_experts)``.

A checkpoint is used whole or refused: before any read, every rank checks the config's fields, the
files and the whole checkpoint against the model (every rank's tensors, from the headers), and
refuses tensors the model has no place for; what the model does not use by design (a
multi-token-prediction layer, a tied copy, weights in another format beside the safetensors) is
not read and named in `LoadReport.skipped`. After reading, a tensor holding NaN or inf is refused.
See docs/checkpoints.md.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import glob
import json
import math
import os
import re
import stat
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from .common import one_line
from .errors import CheckpointError, json_object
from .quantized.formats import QuantFormat, checkpoint_format
from .transformers.fields import EXPERT_COUNTS, EXPERT_PROJECTIONS, MTP_LAYERS, TOP_K, stored_field

__all__ = ["CheckpointError", "GenerationSettings", "LoadReport", "check_checkpoint", "check_moe_config",
           "generation_settings", "load_checkpoint"]

CONFIG, SINGLE, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"  # transformers' generation settings: its eos_token_id wins over config's
# A part of an in-memory name -> the same part in older checkpoints (Mixtral's MoE block).
RENAMES = ((".mlp.", ".block_sparse_moe."),)
# Reopen a file after reading this much from it: its pages touched so far leave the process.
REOPEN_BYTES = 1 << 30
# The dtypes a model can be loaded in (a float8 or integer dtype would need a quantized format's scales).
HELD_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Values of a tensor checked for NaN / inf at a time (a bool mask of this many bytes).
FINITE_CHUNK = 1 << 26
# Files of a folder that hold weights; those the loader does not read are named (`LoadReport.skipped`).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_LAYER_KEY = re.compile(r"^(.*\blayers)\.(\d+)\.")

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What one rank read and holds."""

    rank: int
    world: int
    bytes_read: int          # tensor bytes read from the files, as stored
    bytes_held: int          # bytes of the parameters and buffers this rank holds, as loaded
    tensors_read: int        # checkpoint tensors read, whole or in part
    checkpoint_bytes: int    # tensor bytes of the whole checkpoint, from the file headers
    sharded: Dict[str, Tuple[int, int]]  # experts module -> its ep_shard (first_expert, total_experts)
    ignored: Tuple[str, ...]  # checkpoint tensors the model does not use by design (not read by any rank)
    skipped: Tuple[str, ...] = ()  # what no rank reads on purpose, one phrase per kind (tensors, files)
    quantization: Optional[str] = None  # the checkpoint's quantized format (fp8, w8a8), None for floats
    quantized_bytes: Dict[str, int] = dataclasses.field(default_factory=dict)  # experts / dense / scales, as held
    quantized_format: Optional[str] = None  # fp8, w8a8_dynamic or w8a8_static (`QuantFormat.variant`)


@dataclasses.dataclass(frozen=True)
class _Stored:
    """One tensor of the checkpoint, from its file's header."""

    file: str
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class _Read:
    """Copy ``key[index]`` (the whole tensor when ``index`` is empty) into ``dest``."""

    key: str
    index: Tuple[slice, ...]
    dest: torch.Tensor


Catalog = Dict[str, _Stored]


# ---------------------------------------------------------------- the folder


def _weight_files(path: str) -> Tuple[List[str], Optional[Dict[str, str]], List[str]]:
    """The safetensors files, the index's name -> file map when there is one, and the weight files of
    the folder that are not read (other formats; safetensors files beside the index or model.safetensors)."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        weight_map = _weight_map(index)
        names = sorted(set(weight_map.values()))
        for name in names:
            problem = _file_problem(os.path.join(path, name))
            if problem:
                raise CheckpointError(f"{index} names {name}, which {problem}")
        files = [os.path.join(path, n) for n in names]
    else:  # model.safetensors alone, as transformers reads it; else every safetensors file of the folder
        weight_map = None
        single = os.path.join(path, SINGLE)
        files = [single] if os.path.lexists(single) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
        for file in files:
            problem = _file_problem(file)
            if problem:
                raise CheckpointError(f"{file} {problem}")
    read = {os.path.realpath(f) for f in files}
    unread = sorted(n for n in os.listdir(path) if n.endswith(WEIGHT_SUFFIXES) and not n.startswith(".")
                    and os.path.realpath(os.path.join(path, n)) not in read)
    if not files:
        others = f" (it holds {', '.join(unread[:3])}{' ...' if len(unread) > 3 else ''}: the loader reads " \
                 f"safetensors only, convert them)" if unread else ""
        raise CheckpointError(f"{path}: no safetensors weights ({SINGLE}, or shards with {INDEX}){others}")
    return files, weight_map, unread


def _weight_map(index: str) -> Dict[str, str]:
    """The index's tensor name -> file name map, checked to be one."""
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({one_line(e)})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: its weight_map is a {type(weight_map).__name__}, not a map of tensor "
                              f"names to file names")
    if not weight_map:
        raise CheckpointError(f"{index}: its weight_map names no tensor")
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name or os.path.isabs(name) or \
                os.path.normpath(name).split(os.sep)[0] == os.pardir:
            raise CheckpointError(f"{index}: its weight_map places tensor {key} in {name!r}, which is not the name of "
                                  f"a file in the checkpoint's folder")
    return weight_map


def _file_problem(file: str) -> Optional[str]:
    """Why ``file`` cannot be read as a weights file (completing "... which ..."), or None."""
    try:
        os.lstat(file)
    except FileNotFoundError:
        return f"is not in {os.path.dirname(file)}"
    except OSError as e:
        return f"cannot be looked at ({e.strerror})"
    try:
        mode = os.stat(file).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symbolic link loop (following it never reaches a file)"
        if e.errno == errno.ENOENT:
            return f"is a symbolic link to {os.readlink(file)}, which does not exist"
        return f"cannot be looked at ({e.strerror})"
    if stat.S_ISDIR(mode):
        return "is a directory, not a safetensors file"
    if not stat.S_ISREG(mode):
        return "is not a regular file"
    if not os.access(file, os.R_OK):
        return "is not readable (permission denied)"
    return None


def _header(file: str) -> Catalog:
    """The tensors ``file`` holds, from its header (nothing of the data is read)."""
    from safetensors import safe_open

    out = {}
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                dtype = _DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise CheckpointError(f"{file}: tensor {key} has dtype {sl.get_dtype()}, which this loader "
                                          f"does not read")
                out[key] = _Stored(file, dtype, tuple(sl.get_shape()))
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises its own error types for a damaged header
        raise CheckpointError(f"{file}: not a readable safetensors file ({one_line(e)})") from None
    return out


class _Checkpoint:
    """The tensors of a checkpoint folder: file, dtype and shape of each, from the headers only."""

    def __init__(self, path: str):
        files, weight_map, self.unread = _weight_files(path)
        self.catalog: Catalog = {}
        for file in files:
            for key, stored in _header(file).items():
                if key in self.catalog:
                    raise CheckpointError(f"tensor {key} is in both {self.catalog[key].file} and {file}")
                self.catalog[key] = stored
        for key, name in (weight_map or {}).items():
            stored = self.catalog.get(key)
            if stored is None or os.path.basename(stored.file) != name:
                raise CheckpointError(f"{os.path.join(path, INDEX)} places tensor {key} in {name}, which does not "
                                      f"hold it")
        self.indexed = weight_map is not None
        self.where = os.path.join(path, INDEX) if weight_map is not None else \
            ", ".join(os.path.join(path, os.path.basename(f)) for f in files)

    def __contains__(self, key: str) -> bool:
        return key in self.catalog

    def __getitem__(self, key: str) -> _Stored:
        return self.catalog[key]

    def find(self, name: str) -> Optional[str]:
        """The checkpoint's key for the model's ``name``, or None."""
        return next((c for c in _candidates(name) if c in self.catalog), None)

    def missing(self, name: str) -> CheckpointError:
        return CheckpointError(f"tensor {name} is not in the checkpoint ({self.where})")

    def expect(self, key: str, shape: Sequence[int]) -> _Stored:
        """``key``'s entry, checked to be there with ``shape``."""
        stored = self.catalog.get(key)
        if stored is None:
            raise self.missing(key)
        if stored.shape != tuple(shape):
            raise CheckpointError(f"tensor {key} in {stored.file} has shape {list(stored.shape)}, the model "
                                  f"expects {list(shape)}")
        return stored


def _config(path: str) -> Any:
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a folder")
    if not os.path.isfile(os.path.join(path, CONFIG)):
        raise CheckpointError(f"{path}: no {CONFIG}")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers and its dataclass checks raise many kinds for a bad config
        raise CheckpointError(f"{os.path.join(path, CONFIG)}: not a transformers config ({one_line(e)})") from None
    return config


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    """What a checkpoint says of generation: its stop token (``eos_token_id``) and position limit
    (``max_position_embeddings``), each None where it says nothing, with the file each comes from."""

    stop_token: Optional[int] = None
    stop_file: Optional[str] = None
    max_positions: Optional[int] = None
    positions_file: Optional[str] = None


def generation_settings(path: Union[str, "os.PathLike[str]"], vocab: int, read_eos: bool = True
                        ) -> GenerationSettings:
    """The stop token and position limit of the checkpoint in ``path``: ``eos_token_id`` of generation_config.json
    where it sets one, else of config.json (transformers' rule; not read without ``read_eos``), and config.json's
    ``max_position_embeddings``.
    `CheckpointError` names the file and the value: an eos id outside ``[0, vocab)``, several different eos ids
    (a decode stops at one), a position limit below 1."""
    path = os.fspath(path)
    stop_token, stop_file = None, None
    config = os.path.join(path, CONFIG)
    for file in (config, os.path.join(path, GENERATION_CONFIG)) if read_eos else ():
        fields = _json_fields(file)
        if fields.get("eos_token_id") is not None:
            stop_token, stop_file = _eos_token(fields["eos_token_id"], file, vocab), file
    limit = _json_fields(config).get("max_position_embeddings")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise CheckpointError(f"{config}: max_position_embeddings is {limit!r}, must be an integer >= 1")
    return GenerationSettings(stop_token, stop_file, limit, config if limit is not None else None)


def _json_fields(file: str) -> Dict[str, Any]:
    """The JSON object of ``file``; empty where there is no such file."""
    return json_object(file) if os.path.isfile(file) else {}


def _eos_token(value: Any, file: str, vocab: int) -> Optional[int]:
    """The one stop token ``eos_token_id`` names (a list of one id, or of the same id, is that id; an empty list
    none); `CheckpointError` for anything else."""
    ids = value if isinstance(value, list) else [value]
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise CheckpointError(f"{file}: eos_token_id is {value!r}, must be a token id in [0, {vocab}) (the "
                                  f"vocabulary)")
    if len(set(ids)) > 1:
        raise CheckpointError(f"{file}: eos_token_id is {value!r}, several stop tokens: a decode here stops at one")
    return ids[0] if ids else None


def check_moe_config(config: Any, world: int = 1, where: str = "the config") -> None:
    """Check what the loader, the model's router and the toolkit assume of an MoE config and no tensor
    shape shows: counts of layers and heads, the routed experts (shared equally by ``world`` ranks),
    top-k within them, DeepSeek-style expert groups, the dense and multi-token-prediction layers.
    `CheckpointError` names ``where``, the field and its value; fields the family lacks are skipped."""
    def field(name: str, low: int, high: Optional[int] = None, rule: str = "") -> Optional[int]:
        value = getattr(config, name, None)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            bounds = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
            raise CheckpointError(f"{where}: {name} is {value!r}, must be {bounds}{rule}")
        return value

    layers = field("num_hidden_layers", 1)
    field("max_position_embeddings", 1)
    for name in ("hidden_size", "vocab_size"):
        field(name, 1)
    heads = field("num_attention_heads", 1)
    kv = field("num_key_value_heads", 1, heads)
    if heads and kv and heads % kv:
        raise CheckpointError(f"{where}: num_attention_heads is {heads} and num_key_value_heads {kv}: the query "
                              f"heads must be a multiple of the key-value heads")
    if heads and kv and kv != heads and getattr(config, "kv_lora_rank", None):
        raise CheckpointError(f"{where}: num_key_value_heads is {kv}, must equal num_attention_heads {heads} with "
                              f"multi-head latent attention (kv_lora_rank): the keys are expanded to every head")
    name = stored_field(config, EXPERT_COUNTS)
    experts = field(name, 1, rule=" (the routed experts per MoE layer)") if name else None
    if experts and experts % world:
        raise CheckpointError(f"{where}: {name} is {experts}, and {experts} experts cannot be shared equally by "
                              f"{world} ranks (the expert count must be a multiple of the ranks)")
    top_name = stored_field(config, TOP_K)
    top_k = field(top_name, 1, experts, f" (the experts each token is routed to, of {name} {experts})"
                  if experts else "") if top_name else None
    method = getattr(config, "topk_method", None)
    groups = field("n_group", 1, experts) if method != "greedy" else None  # greedy routing has no groups
    if groups and experts:
        # a group's score: its best expert (DeepSeek-V2's group_limited_greedy), else the sum of its best two
        per_group, least = experts // groups, 1 if method == "group_limited_greedy" else 2
        if experts % groups or per_group < least:
            raise CheckpointError(f"{where}: n_group is {groups}: the router splits the {experts} experts ({name}) "
                                  f"into n_group equal groups of at least {least}")
        chosen = field("topk_group", 1, groups, f" (of n_group {groups})")
        if chosen and top_k and top_k > chosen * per_group:
            raise CheckpointError(f"{where}: {top_name} is {top_k}, more than the {chosen * per_group} "
                                  f"experts of the topk_group {chosen} groups the router picks ({per_group} each)")
    if layers:
        field("first_k_dense_replace", 0, layers - 1, f" (the leading dense layers, of num_hidden_layers {layers})")
        field("decoder_sparse_step", 1, layers)
        dense = getattr(config, "mlp_only_layers", None)
        if dense is not None and (not isinstance(dense, (list, tuple)) or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in dense)):
            raise CheckpointError(f"{where}: mlp_only_layers is {dense!r}, must list layer indices in "
                                  f"0..{layers - 1} (num_hidden_layers {layers})")
    for name in MTP_LAYERS:
        field(name, 0)


def _skeleton(config: Any) -> nn.Module:
    """The model on the meta device: shapes and structure, no storage."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as e:
        first = (str(e).splitlines() or [""])[0]  # the rest lists every causal LM transformers has
        raise CheckpointError(f"model type {config.model_type!r} is not a causal LM transformers can build ({first})") \
            from None
    except Exception as e:  # a config value the family's modules cannot be built with
        raise CheckpointError(f"transformers cannot build a {config.model_type} model from this config "
                              f"({type(e).__name__}: {one_line(e)})") from None


# ---------------------------------------------------------------- ranks and dtypes


def _rank_world(rank: Optional[int], world: Optional[int], group: Any) -> Tuple[int, int]:
    if rank is None and world is None:
        if group is not None or dist.is_initialized():
            return dist.get_rank(group), dist.get_world_size(group)
        return 0, 1
    if rank is None or world is None:
        raise CheckpointError(f"give both rank and world, or neither (got rank={rank}, world={world})")
    if world < 1 or not 0 <= rank < world:
        raise CheckpointError(f"rank {rank} is not a rank of a group of {world}")
    return rank, world


def _as_dtype(dtype: Union[torch.dtype, str, None], where: str = "dtype") -> Optional[torch.dtype]:
    """``dtype`` as a torch dtype the model can be held in (a float of 16 bits or more), or None."""
    if dtype is None:
        return None
    found = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(found, torch.dtype):
        raise CheckpointError(f"{where}: {dtype!r} is not a torch dtype")
    if found not in HELD_DTYPES:
        raise CheckpointError(f"{where}: {str(found).replace('torch.', '')} is not a dtype to hold a model in "
                              f"(one of {', '.join(str(d).replace('torch.', '') for d in HELD_DTYPES)})")
    return found


def _fp32_patterns(model: nn.Module, dtype: Optional[torch.dtype]) -> List[re.Pattern]:
    """Names the model keeps in float32 at ``dtype``, as from_pretrained does."""
    names = set()
    if dtype in (torch.float16, torch.bfloat16):
        names |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        names |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return [re.compile(r"(^|\.)" + re.escape(n) + r"(\.|$)") for n in sorted(names)]


class _Alloc:
    """Allocates the tensors this rank keeps, on its device, in the dtype each gets."""

    def __init__(self, device: torch.device, dtype: Optional[torch.dtype], fp32: Sequence[re.Pattern]):
        self.device, self.dtype, self.fp32 = device, dtype, fp32

    def __call__(self, name: str, shape: Sequence[int], stored: torch.dtype) -> torch.Tensor:
        dtype = stored
        if stored.is_floating_point and stored.itemsize > 1:  # a float8 weight stays quantized, with its scales
            dtype = torch.float32 if any(p.search(name) for p in self.fp32) else (self.dtype or stored)
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)


def _param(t: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """``t`` as a parameter; an integer one (an int8 weight) never requires grad."""
    return nn.Parameter(t, requires_grad=requires_grad and t.is_floating_point())


# ---------------------------------------------------------------- names


def _candidates(name: str) -> Iterator[str]:
    """``name`` as the model has it, then as older checkpoints have it."""
    yield name
    for new, old in RENAMES:
        if new in name:
            yield name.replace(new, old)


def _owner(root: nn.Module, name: str) -> Tuple[nn.Module, str]:
    """The module holding ``name`` (a dotted parameter or buffer name) and the name's last part."""
    path, _, leaf = name.rpartition(".")
    return (root.get_submodule(path) if path else root), leaf


def _role(param: str) -> Tuple[int, str]:
    """Which of gate / up / down (0, 1, 2) an expert MLP's parameter (``w1.weight``) is, and the rest of its name."""
    head, _, tail = param.partition(".")
    for names in EXPERT_PROJECTIONS:
        if head in names:
            return names.index(head), tail
    raise CheckpointError(f"expert parameter {param} is none of the gated MLP's linears {EXPERT_PROJECTIONS}")


# ---------------------------------------------------------------- routed experts


def _experts_modules(model: nn.Module) -> List[Tuple[str, nn.Module, nn.Module]]:
    """``(path, parent, experts)`` of every routed-experts module, found by structure."""
    found = []
    for name, module in model.named_modules():
        experts = module._modules.get("experts")
        fused = getattr(experts, "gate_up_proj", None)
        if (isinstance(fused, torch.Tensor) and fused.dim() == 3) or \
                (isinstance(experts, nn.ModuleList) and len(experts)):
            found.append((f"{name}.experts" if name else "experts", module, experts))
    return found


def _shard(path: str, experts: nn.Module, rank: int, world: int) -> Tuple[int, int, int]:
    """``(lo, hi, total)``: the experts of ``path`` this rank keeps, and how many there are."""
    total = len(experts) if isinstance(experts, nn.ModuleList) else experts.gate_up_proj.shape[0]
    if total % world:
        raise CheckpointError(f"{path} has {total} experts, which {world} ranks cannot share equally: the expert "
                              f"count must be a multiple of the ranks")
    n = total // world
    return rank * n, (rank + 1) * n, total


def _prefix(path: str, ckpt: _Checkpoint, probes: Sequence[str]) -> Tuple[str, str]:
    """The experts' name in the checkpoint, and the first of ``probes`` (names under it) that it holds."""
    for prefix in _candidates(path):
        for probe in probes:
            if f"{prefix}.{probe}" in ckpt:
                return prefix, probe
    raise ckpt.missing(f"{path}.{probes[0]}")


def _fused_experts(path: str, experts: nn.Module, lo: int, hi: int, ckpt: _Checkpoint,
                   alloc: _Alloc) -> List[_Read]:
    """Give fused ``experts`` their rows [lo, hi) of gate_up_proj and down_proj; the reads that fill them."""
    gate_up, down = experts.gate_up_proj, getattr(experts, "down_proj", None)
    total, two_f, hidden = gate_up.shape
    f = two_f // 2
    if not isinstance(down, torch.Tensor) or tuple(down.shape) != (total, hidden, f) or two_f != 2 * f:
        got = list(down.shape) if isinstance(down, torch.Tensor) else "none"
        raise CheckpointError(f"{path}: fused experts must be gate_up_proj [E, 2F, H] and down_proj [E, H, F], got "
                              f"{list(gate_up.shape)} and {got}")
    probes = ["gate_up_proj"] + [f"{lo}.{g}.weight" for g, _, _ in EXPERT_PROJECTIONS]
    prefix, probe = _prefix(path, ckpt, probes)
    stored = ckpt[f"{prefix}.{probe}"].dtype
    local_gu = alloc(f"{path}.gate_up_proj", (hi - lo, two_f, hidden), stored)
    local_d = alloc(f"{path}.down_proj", (hi - lo, hidden, f), stored)
    if probe == "gate_up_proj":
        ckpt.expect(f"{prefix}.gate_up_proj", gate_up.shape)
        ckpt.expect(f"{prefix}.down_proj", down.shape)
        reads = [_Read(f"{prefix}.gate_up_proj", (slice(lo, hi),), local_gu),
                 _Read(f"{prefix}.down_proj", (slice(lo, hi),), local_d)]
    else:
        if not getattr(experts, "is_concatenated", True) or getattr(experts, "is_transposed", False):
            raise CheckpointError(f"{path}: per-expert weights cannot fill this layout of gate_up_proj "
                                  f"(interleaved or transposed)")
        g, u, d = next(n for n in EXPERT_PROJECTIONS if probe == f"{lo}.{n[0]}.weight")
        reads = []
        for i in range(lo, hi):
            for name, shape, dest in ((g, (f, hidden), local_gu[i - lo, :f]), (u, (f, hidden), local_gu[i - lo, f:]),
                                      (d, (hidden, f), local_d[i - lo])):
                key = f"{prefix}.{i}.{name}.weight"
                ckpt.expect(key, shape)
                reads.append(_Read(key, (), dest))
    experts.gate_up_proj = _param(local_gu, gate_up.requires_grad)
    experts.down_proj = _param(local_d, down.requires_grad)
    return reads


def _list_experts(path: str, experts: nn.ModuleList, lo: int, hi: int, ckpt: _Checkpoint,
                  alloc: _Alloc) -> Tuple[nn.ModuleList, List[_Read]]:
    """``experts[lo:hi]``, materialised; the reads that fill them."""
    role, tail = _role(next(n for n, _ in experts[lo].named_parameters()))
    probes = [f"{lo}.{names[role]}.{tail}" for names in EXPERT_PROJECTIONS] + ["gate_up_proj"]
    prefix, probe = _prefix(path, ckpt, probes)
    reads = []
    for i in range(lo, hi):
        for name, p in list(experts[i].named_parameters()):
            key, index = (_fused_rows if probe == "gate_up_proj" else _list_key)(prefix, name, p, i, ckpt)
            local = _param(alloc(f"{path}.{i}.{name}", p.shape, ckpt[key].dtype), p.requires_grad)
            owner, leaf = _owner(experts[i], name)
            owner._parameters[leaf] = local
            reads.append(_Read(key, index, local))
    return nn.ModuleList(experts[lo:hi]), reads


def _list_key(prefix: str, name: str, p: torch.Tensor, i: int, ckpt: _Checkpoint) -> Tuple[str, Tuple[slice, ...]]:
    """Expert ``i``'s ``name`` in a per-expert checkpoint, under either naming of the linears."""
    role, tail = _role(name)
    key = next((k for k in (f"{prefix}.{i}.{n[role]}.{tail}" for n in EXPERT_PROJECTIONS) if k in ckpt),
               f"{prefix}.{i}.{name}")
    ckpt.expect(key, p.shape)
    return key, ()


def _fused_rows(prefix: str, name: str, p: torch.Tensor, i: int, ckpt: _Checkpoint) -> Tuple[str, Tuple[slice, ...]]:
    """Where expert ``i``'s ``name`` (a linear's weight) lies in a fused checkpoint: key and index."""
    role, tail = _role(name)
    if tail != "weight":
        raise ckpt.missing(f"{prefix}.{i}.{name}")
    if role == 2:
        stored = ckpt[f"{prefix}.gate_up_proj"]
        ckpt.expect(f"{prefix}.down_proj", (stored.shape[0],) + tuple(p.shape))
        return f"{prefix}.down_proj", (slice(i, i + 1),)
    rows = p.shape[0]
    ckpt.expect(f"{prefix}.gate_up_proj", (ckpt[f"{prefix}.gate_up_proj"].shape[0], 2 * rows, p.shape[1]))
    return f"{prefix}.gate_up_proj", (slice(i, i + 1), slice(role * rows, (role + 1) * rows))


def _expert_reads(model: nn.Module, ckpt: _Checkpoint, rank: int, world: int,
                  alloc: _Alloc) -> Tuple[List[_Read], Dict[str, Tuple[int, int]]]:
    """Shard every routed-experts module to this rank's experts; the reads that fill them."""
    found = _experts_modules(model)
    if not found:
        raise CheckpointError(f"{type(model).__name__} has no routed experts (no module with an `experts` child "
                              f"of fused 3-D tensors or an nn.ModuleList): not an MoE model")
    shards = [_shard(path, experts, rank, world) for path, _, experts in found]  # all checked before any read
    reads: List[_Read] = []
    sharded = {}
    for (path, parent, experts), (lo, hi, total) in zip(found, shards):
        if isinstance(experts, nn.ModuleList):
            local, more = _list_experts(path, experts, lo, hi, ckpt, alloc)
            parent.experts = experts = local
        else:
            more = _fused_experts(path, experts, lo, hi, ckpt, alloc)
        experts.ep_shard = (lo, total)
        sharded[path] = (lo, total)
        reads += more
    return reads, sharded


# ---------------------------------------------------------------- everything else


def _replicated(model: nn.Module, skip: Sequence[str]) -> List[List[Tuple[str, torch.Tensor, bool]]]:
    """The parameters and buffers outside ``skip``, as ``(name, meta tensor, persistent)``, tied names together."""
    groups: Dict[int, List[Tuple[str, torch.Tensor, bool]]] = {}
    prefixes = tuple(p + "." for p in skip)
    for module_name, module in model.named_modules(remove_duplicate=False):
        if (module_name + ".").startswith(prefixes):
            continue
        own = [(n, t, True) for n, t in module._parameters.items()]
        own += [(n, t, n not in module._non_persistent_buffers_set) for n, t in module._buffers.items()]
        for leaf, tensor, persistent in own:
            if tensor is not None:
                name = f"{module_name}.{leaf}" if module_name else leaf
                groups.setdefault(id(tensor), []).append((name, tensor, persistent))
    return list(groups.values())


def _replicated_reads(model: nn.Module, ckpt: _Checkpoint, skip: Sequence[str],
                      alloc: _Alloc) -> Tuple[List[_Read], List[str]]:
    """Allocate every kept tensor outside the experts: the reads that fill them, and the buffers left to init."""
    reads, pending = [], []
    for names in _replicated(model, skip):
        first, meta, persistent = names[0]
        if not persistent:
            pending += [n for n, _, _ in names]
            continue
        key = next((k for k in (ckpt.find(n) for n, _, _ in names) if k), None)
        if key is None:
            raise ckpt.missing(first)
        ckpt.expect(key, meta.shape)
        local = alloc(first, meta.shape, ckpt[key].dtype)
        if isinstance(meta, nn.Parameter):
            local = _param(local, meta.requires_grad)
        for name, _, _ in names:  # tied names share the one tensor
            owner, leaf = _owner(model, name)
            (owner._parameters if leaf in owner._parameters else owner._buffers)[leaf] = local
        reads.append(_Read(key, (), local))
    return reads, pending


def _init_buffers(model: nn.Module, names: Sequence[str], device: torch.device) -> None:
    """Buffers the checkpoint does not hold (rotary ``inv_freq``...), set by the model's own init."""
    by_owner: Dict[int, Tuple[nn.Module, List[str]]] = {}
    for name in names:
        owner, leaf = _owner(model, name)
        by_owner.setdefault(id(owner), (owner, []))[1].append(leaf)
    for owner, leaves in by_owner.values():
        for leaf in leaves:
            meta = owner._buffers[leaf]
            fill = math.nan if meta.is_floating_point() else 0  # NaN left behind = the init did not set it
            owner._buffers[leaf] = torch.full(meta.shape, fill, dtype=meta.dtype, device=device)
        with _hidden(owner, keep=leaves), torch.no_grad():
            model._init_weights(owner)
        for leaf in leaves:
            if torch.isnan(owner._buffers[leaf]).any():
                raise CheckpointError(f"buffer {leaf} of {type(owner).__name__} is not in the checkpoint and the "
                                      f"model's init does not set it")


@contextlib.contextmanager
def _hidden(module: nn.Module, keep: Sequence[str]) -> Iterator[None]:
    """``module``'s own tensors but ``keep`` replaced by meta stand-ins, so that an init cannot touch them."""
    saved = []
    for store in (module._parameters, module._buffers):
        for name, t in list(store.items()):
            if t is not None and name not in keep:
                saved.append((store, name, t))
                stand_in = torch.empty_like(t, device="meta")
                store[name] = nn.Parameter(stand_in, requires_grad=False) if isinstance(t, nn.Parameter) else stand_in
    try:
        yield
    finally:
        for store, name, t in saved:
            store[name] = t


def _check_materialised(model: nn.Module) -> None:
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"the loader does not know how to fill {', '.join(left[:5])}"
                              f"{' ...' if len(left) > 5 else ''}")


# ---------------------------------------------------------------- reading


def _runs(reads: Sequence[_Read], ckpt: _Checkpoint) -> Iterator[Tuple[str, List[_Read]]]:
    """The reads grouped by file, each group cut into runs of about REOPEN_BYTES."""
    by_file: Dict[str, List[_Read]] = {}
    for r in reads:
        by_file.setdefault(ckpt[r.key].file, []).append(r)
    for file, group in by_file.items():
        run, size = [], 0
        for r in group:
            run.append(r)
            size += r.dest.numel() * ckpt[r.key].dtype.itemsize
            if size >= REOPEN_BYTES:
                yield file, run
                run, size = [], 0
        if run:
            yield file, run


def _execute(reads: Sequence[_Read], ckpt: _Checkpoint) -> int:
    """Fill every destination from the files, one file open at a time, and check each holds finite values;
    the bytes read."""
    from safetensors import safe_open

    total = 0
    with torch.no_grad():
        for file, run in _runs(reads, ckpt):
            try:
                opened = safe_open(file, framework="pt", device="cpu")
            except Exception as e:  # changed or gone since its header was read
                raise CheckpointError(f"{file}: cannot be read now ({one_line(e)})") from None
            with opened as f:
                for r in run:
                    try:
                        src = f.get_slice(r.key)[r.index] if r.index else f.get_tensor(r.key)
                    except Exception as e:
                        raise CheckpointError(f"{file}: cannot read tensor {r.key} ({one_line(e)})") from None
                    r.dest.copy_(src.reshape(r.dest.shape))
                    total += src.numel() * src.element_size()
                    del src  # it maps the file: let the mapping go with the file
        _check_finite(reads, ckpt)
    return total


def _finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every value of ``t`` is finite, as a 0-d tensor on its device (no synchronisation); a large
    tensor is looked at in chunks, so that the mask never needs more than FINITE_CHUNK bytes."""
    if t.is_floating_point() and t.element_size() == 1:  # float8: isfinite of its values, a chunk at a time
        return torch.stack([torch.isfinite(c.float()).all() for c in t.reshape(-1).split(FINITE_CHUNK)]).all()
    if t.numel() <= FINITE_CHUNK or not t.is_contiguous():
        return torch.isfinite(t).all()
    return torch.stack([torch.isfinite(c).all() for c in t.view(-1).split(FINITE_CHUNK)]).all()


def _check_finite(reads: Sequence[_Read], ckpt: _Checkpoint) -> None:
    """`CheckpointError` naming the first tensor read that holds NaN or inf, as stored or once cast (one
    device synchronisation when every value is finite)."""
    floating = [r for r in reads if r.dest.is_floating_point()]
    if not floating or bool(torch.stack([_finite(r.dest) for r in floating]).all()):
        return
    from safetensors import safe_open

    r = next(r for r in floating if not bool(_finite(r.dest)))
    stored = ckpt[r.key]
    bad = int((~torch.isfinite(r.dest)).sum())
    cast = ""
    if r.dest.dtype != stored.dtype:  # finite as stored, then? Read it again to say which (an error path only)
        with safe_open(stored.file, framework="pt", device="cpu") as f:
            src = f.get_slice(r.key)[r.index] if r.index else f.get_tensor(r.key)
            if bool(torch.isfinite(src).all()):
                cast = f" once cast to {str(r.dest.dtype).replace('torch.', '')} (stored " \
                       f"{str(stored.dtype).replace('torch.', '')}: out of its range)"
            del src
    raise CheckpointError(f"tensor {r.key} in {stored.file} holds {bad} NaN or inf value{'s' if bad > 1 else ''}"
                          f"{cast}: the model would compute NaN or inf")


# ---------------------------------------------------------------- quantized checkpoints


# A quantized weight's scales and static activation parameters, read beside it.
_Scales = Dict[str, Tuple[List[torch.Tensor], Dict[str, torch.Tensor]]]


def _scale_reads(reads: Sequence[_Read], fmt: Optional[QuantFormat], ckpt: _Checkpoint,
                 device: torch.device) -> Tuple[List[_Read], _Scales]:
    """The reads of the scales (and static activation parameters) of every quantized weight among ``reads``,
    each allocated as stored; weight key -> its scales and parameters. A quantized weight not stored in the
    format's dtype, or without its scales, is a `CheckpointError`."""
    if fmt is None:
        return [], {}
    more: List[_Read] = []
    found: _Scales = {}
    for r in reads:
        if r.key in found or not fmt.quantized(r.key, ckpt):
            continue
        stored = ckpt[r.key]
        if stored.dtype != fmt.dtype:
            raise CheckpointError(f"tensor {r.key} in {stored.file} is {str(stored.dtype).replace('torch.', '')}, "
                                  f"the {fmt.method} format stores its quantized weights in "
                                  f"{str(fmt.dtype).replace('torch.', '')}")
        held: List[torch.Tensor] = []
        extras: Dict[str, torch.Tensor] = {}
        for key in fmt.scales(r.key) + fmt.extras(r.key):
            if key not in ckpt:
                raise ckpt.missing(key)
            t = torch.empty(ckpt[key].shape, dtype=ckpt[key].dtype, device=device)
            more.append(_Read(key, (), t))
            if key in fmt.scales(r.key):
                held.append(t)
            else:
                extras[key.rpartition(".")[2]] = t
        found[r.key] = (held, extras)
    return more, found


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _keep_quantized(model: nn.Module, ckpt: _Checkpoint, fmt: QuantFormat, scales: _Scales,
                    sharded: Dict[str, Tuple[int, int]], dtype: Optional[torch.dtype], dequantize: bool
                    ) -> Dict[str, int]:
    """The quantized weights read put to use: routed experts as `collectives.QuantizedExperts`, linears as
    `collectives.QuantizedLinear` (or, with ``dequantize``, each weight dequantized to ``dtype`` in place); the
    bytes held, as ``experts`` / ``dense`` / ``scales``."""
    held = {"experts": 0, "dense": 0, "scales": 0}
    for path, (lo, total) in sharded.items():
        _quantized_experts(model, path, lo, total, ckpt, fmt, scales, dtype or torch.float32, dequantize, held)
    for name, module in list(model.named_modules()):
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or weight.dtype != fmt.dtype:
            continue
        key = ckpt.find(f"{name}.weight")
        if key not in scales:
            raise CheckpointError(f"tensor {key} is {str(fmt.dtype).replace('torch.', '')} without the scales of the "
                                  f"{fmt.method} format")
        _quantized_linear(model, name, module, scales[key], fmt, dtype or torch.float32, dequantize, held)
    return held if not dequantize else {}


def _quantized_linear(model: nn.Module, name: str, linear: nn.Linear, scales: Tuple[List[torch.Tensor],
                      Dict[str, torch.Tensor]], fmt: QuantFormat, dtype: torch.dtype, dequantize: bool,
                      held: Dict[str, int]) -> None:
    """``linear`` (its weight read quantized) replaced by a `collectives.QuantizedLinear`, or dequantized."""
    from collectives import QuantizedLinear

    quantized = QuantizedLinear(linear.weight.data, scales[0], fmt.scheme, fmt.block,
                                None if linear.bias is None else linear.bias.data, scales[1])
    if dequantize:
        linear.weight = nn.Parameter(quantized.dequantized(dtype), requires_grad=False)
        return
    parent, leaf = _owner(model, name)
    setattr(parent, leaf, quantized)
    held["dense"] += _nbytes([quantized.weight])
    held["scales"] += _nbytes(scales[0]) + _nbytes(list(scales[1].values()))


def _quantized_experts(model: nn.Module, path: str, lo: int, total: int, ckpt: _Checkpoint, fmt: QuantFormat,
                       scales: _Scales, dtype: torch.dtype, dequantize: bool, held: Dict[str, int]) -> None:
    """The fused experts of ``path`` (their weights read quantized from per-expert keys) as a
    `collectives.QuantizedExperts` carrying ``ep_shard``, or dequantized in place."""
    from collectives import QuantizedExperts

    experts = model.get_submodule(path)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or gate_up.dtype != fmt.dtype:
        if isinstance(experts, nn.ModuleList):
            raise CheckpointError(f"{path}: quantized experts are read into fused experts only (gate_up_proj "
                                  f"[E, 2F, H]); {type(experts).__name__} holds them as a list")
        return  # experts stored as floats (FLOAT in a W8A8 description)
    prefix, _ = _prefix(path, ckpt, [f"{lo}.{g}.weight" for g, _, _ in EXPERT_PROJECTIONS])
    names = next(n for n in EXPERT_PROJECTIONS if f"{prefix}.{lo}.{n[0]}.weight" in ckpt)
    n = gate_up.shape[0]
    stacked: Dict[str, List[torch.Tensor]] = {}
    for proj, stored in zip(("gate", "up", "down"), names):
        per_expert = [scales[f"{prefix}.{i}.{stored}.weight"][0] for i in range(lo, lo + n)]
        stacked[proj] = [torch.stack(list(group)) for group in zip(*per_expert)]
    quantized = QuantizedExperts(gate_up.data, down.data, stacked, fmt.scheme, lo, getattr(experts, "act_fn", None),
                                 fmt.block, dtype)
    if dequantize:
        pairs = [quantized.weights(e, dtype) for e in range(n)]
        experts.gate_up_proj = nn.Parameter(torch.stack([p[0] for p in pairs]), requires_grad=False)
        experts.down_proj = nn.Parameter(torch.stack([p[1] for p in pairs]), requires_grad=False)
        return
    quantized.ep_shard = (lo, total)
    parent, leaf = _owner(model, path)
    setattr(parent, leaf, quantized)
    weights, scale_bytes = quantized.quantized_bytes()
    held["experts"] += weights
    held["scales"] += scale_bytes


# ---------------------------------------------------------------- the whole checkpoint


@dataclasses.dataclass(frozen=True)
class _Unread:
    """What of a checkpoint no rank reads, on purpose: its tensors, and one phrase for each kind."""

    tensors: Tuple[str, ...]
    phrases: Tuple[str, ...]


def _whole(model: nn.Module, ckpt: _Checkpoint, config: Any, world: int, where: str,
           fmt: Optional[QuantFormat] = None) -> _Unread:
    """Check the whole checkpoint against ``model`` (left unchanged: the reads are listed on a copy), as every rank
    alike would: routed experts that ``world`` ranks share equally, every tensor of every rank there
    with its shape, and nothing left over but what the model does not use by design."""
    experts = _experts_modules(model)
    for path, _, module in experts:
        _shard(path, module, 0, world)
    trial = copy.deepcopy(model)
    alloc = _Alloc(torch.device("meta"), None, ())
    reads, sharded = _expert_reads(trial, ckpt, 0, 1, alloc)
    more, _ = _replicated_reads(trial, ckpt, list(sharded), alloc)
    scales, _ = _scale_reads(reads + more, fmt, ckpt, alloc.device)
    used = {r.key for r in reads + more + scales}
    return _left_over(model, ckpt, config, used, [p for p, _, _ in experts], where)


def _left_over(model: nn.Module, ckpt: _Checkpoint, config: Any, used: Set[str], experts: Sequence[str],
               where: str) -> _Unread:
    """The checkpoint's tensors outside ``used``: `CheckpointError` naming them, but for those the model
    does not use by design (a multi-token-prediction layer, a tied copy, a buffer it computes itself,
    what its class declares unused)."""
    layers = getattr(config, "num_hidden_layers", None)
    layers = layers if isinstance(layers, int) else math.inf  # a family that counts its layers otherwise
    n_mtp = next((int(getattr(config, f)) for f in MTP_LAYERS if getattr(config, f, None) is not None), 0)
    declared = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    tied: Dict[str, str] = {}
    computed: Set[str] = set()
    for names in _replicated(model, experts):
        keys = [k for n, _, _ in names for k in _candidates(n) if k in ckpt]
        if not names[0][2]:
            computed |= {k for n, _, _ in names for k in _candidates(n)}
        elif len(names) > 1 and keys:
            tied.update({k: next((u for u in keys if u in used), names[0][0]) for k in keys if k not in used})
    mtp: Dict[int, List[str]] = {}
    kinds: Dict[str, List[str]] = {"tied": [], "declared": [], "computed": []}
    unexpected = []
    for key in sorted(set(ckpt.catalog) - used):
        layer = _LAYER_KEY.match(key)
        if key in tied:
            kinds["tied"].append(key)
        elif layer and int(layer[2]) >= layers:
            i = int(layer[2])
            if i < layers + n_mtp and f"{layer[1]}.{i}.eh_proj.weight" in ckpt:  # the MTP layer's own projection
                mtp.setdefault(i, []).append(key)
            else:
                unexpected.append(key)
        elif any(p.search(key) for p in declared):
            kinds["declared"].append(key)
        elif key in computed or key.endswith("rotary_emb.inv_freq"):
            kinds["computed"].append(key)
        else:
            unexpected.append(key)
    if unexpected:
        beyond = sorted({int(m[2]) for m in map(_LAYER_KEY.match, unexpected) if m and int(m[2]) >= layers})
        hint = f" (num_hidden_layers is {layers}, yet the files hold layer{'s' if len(beyond) > 1 else ''} " \
               f"{', '.join(map(str, beyond[:5]))}{' ...' if len(beyond) > 5 else ''})" if beyond else ""
        n = len(unexpected)
        raise CheckpointError(f"{n} tensor{'s' if n > 1 else ''} of the checkpoint {'have' if n > 1 else 'has'} no "
                              f"place in the model {where} describes{hint}: {', '.join(unexpected[:3])}"
                              f"{f' and {n - 3} more' if n > 3 else ''}; a checkpoint is used whole or not at all")
    phrases = [f"{len(keys)} tensor{'s' if len(keys) > 1 else ''} of multi-token-prediction layer {i} "
               f"({_LAYER_KEY.match(keys[0])[1]}.{i}.*), which the model does not run" for i, keys in mtp.items()]
    if kinds["tied"]:
        phrases.append(", ".join(f"{k} (tied to {tied[k]}, which is read)" for k in kinds["tied"]))
    if kinds["declared"]:
        phrases.append(_some(kinds["declared"], f"that {type(model).__name__} declares unused"))
    if kinds["computed"]:
        phrases.append(_some(kinds["computed"], "that the model computes itself"))
    other = [n for n in ckpt.unread if not n.endswith(".safetensors")]
    if other:
        phrases.append(_files(other, "of weights in another format (the safetensors files are read)"))
    if len(other) < len(ckpt.unread):
        phrases.append(_files([n for n in ckpt.unread if n not in other],
                              f"that {INDEX} does not name" if ckpt.indexed else f"beside {SINGLE}"))
    tensors = [k for keys in mtp.values() for k in keys] + [k for keys in kinds.values() for k in keys]
    return _Unread(tuple(sorted(tensors)), tuple(phrases))


def _files(names: Sequence[str], what: str) -> str:
    n = len(names)
    return f"{n} file{'s' if n > 1 else ''} {what}: {', '.join(names[:3])}{' ...' if n > 3 else ''}"


def _some(keys: Sequence[str], what: str) -> str:
    n = len(keys)
    return f"{n} tensor{'s' if n > 1 else ''} {what} ({', '.join(keys[:2])}{' ...' if n > 2 else ''})"


def _open(path: str, world: int) -> Tuple[Any, _Checkpoint, nn.Module, _Unread, Optional[QuantFormat]]:
    """The config, the files' catalog and the model's skeleton, each checked, then the whole checkpoint
    against the skeleton: what every rank finds alike, without reading a weight."""
    config = _config(path)
    where = os.path.join(path, CONFIG)
    _as_dtype(getattr(config, "dtype", None), f"{where}: dtype")  # the model is built in it
    check_moe_config(config, world, where)
    ckpt = _Checkpoint(path)
    model = _skeleton(config)
    fmt = checkpoint_format(path, config)
    return config, ckpt, model, _whole(model, ckpt, config, world, where, fmt), fmt


# ---------------------------------------------------------------- the entry points


def check_checkpoint(path: Union[str, "os.PathLike[str]"], world: int = 1) -> Any:
    """The checkpoint's transformers config, after the checks every rank makes alike without reading a
    weight: a readable, unquantized ``config.json`` whose MoE fields hold (`check_moe_config`, with
    experts ``world`` ranks share equally); safetensors files with readable headers that agree with the
    index; every tensor the model needs, on any rank, there with its shape; and no tensor the model has
    no place for, but those it does not use by design. Raises `CheckpointError` (what `load_checkpoint`
    would raise first)."""
    return _open(os.fspath(path), world)[0]


def load_checkpoint(path: Union[str, "os.PathLike[str]"], *, rank: Optional[int] = None,
                    world: Optional[int] = None, group: Any = None, dtype: Union[torch.dtype, str, None] = None,
                    device: Union[str, torch.device] = "cpu", dequantize: bool = False) -> Tuple[nn.Module, LoadReport]:
    """The transformers MoE causal LM saved in ``path``, holding this rank's routed experts only.

    ``rank`` / ``world`` default to ``group``'s (or the default group's, when one is initialised),
    else 0 / 1. ``dtype`` defaults to the config's, else each tensor's stored dtype. Raises
    `CheckpointError` for anything it cannot load: what `check_checkpoint` finds before any read; a
    file that cannot be read, or a tensor that holds NaN or inf (as stored or in ``dtype``), after.
    A quantized checkpoint (`launch.models.quantized`) stays quantized: its routed experts become
    `collectives.QuantizedExperts`, its quantized linears `collectives.QuantizedLinear`, with their scales;
    ``dequantize``: every quantized weight is dequantized to ``dtype`` instead (the float model it stands for).
    """
    path = os.fspath(path)
    rank, world = _rank_world(rank, world, group)
    dtype = _as_dtype(dtype)
    config, ckpt, model, unread, fmt = _open(path, world)
    dtype = dtype or _as_dtype(getattr(config, "dtype", None))
    device = torch.device(device)
    alloc = _Alloc(device, dtype, _fp32_patterns(model, dtype))
    reads, sharded = _expert_reads(model, ckpt, rank, world, alloc)
    more, pending = _replicated_reads(model, ckpt, list(sharded), alloc)
    reads += more
    scale_reads, scales = _scale_reads(reads, fmt, ckpt, device)
    bytes_read = _execute(reads + scale_reads, ckpt)
    _init_buffers(model, pending, device)
    _check_materialised(model)
    quantized_bytes = _keep_quantized(model, ckpt, fmt, scales, sharded, dtype, dequantize) if fmt else {}
    if dtype is not None:
        model.config.dtype = dtype
    model.eval()
    held = {id(t): t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())}
    return model, LoadReport(rank=rank, world=world, bytes_read=bytes_read, bytes_held=sum(held.values()),
                             tensors_read=len({r.key for r in reads + scale_reads}),
                             checkpoint_bytes=sum(s.nbytes for s in ckpt.catalog.values()), sharded=sharded,
                             ignored=unread.tensors, skipped=unread.phrases,
                             quantization=fmt.method if fmt else None, quantized_bytes=quantized_bytes,
                             quantized_format=fmt.variant if fmt else None)
