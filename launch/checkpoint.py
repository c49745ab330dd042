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
and carries ``ep_shard = (first_expert, total_experts)``. See docs/checkpoints.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import json
import math
import os
import re
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["CheckpointError", "LoadReport", "check_checkpoint", "load_checkpoint"]

CONFIG, SINGLE, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
# A part of an in-memory name -> the same part in older checkpoints (Mixtral's MoE block).
RENAMES = ((".mlp.", ".block_sparse_moe."),)
# The per-expert linear names of a gated MLP: (gate, up, down).
PROJ_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
# Reopen a file after reading this much from it: its pages touched so far leave the process.
REOPEN_BYTES = 1 << 30

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CheckpointError(ValueError):
    """A checkpoint this loader cannot load; the message names the folder, file or tensor."""


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
    ignored: Tuple[str, ...]  # checkpoint tensors the model has no place for (not read)


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


def _weight_files(path: str) -> Tuple[List[str], Optional[Dict[str, str]]]:
    """The safetensors files, and the index's name -> file map when there is one."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({e})") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(path, name)):
                raise CheckpointError(f"{index} names {name}, which is not in {path}")
        return [os.path.join(path, n) for n in files], weight_map
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{path}: no safetensors weights ({SINGLE}, or shards with {INDEX})")
    return files, None


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
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
    return out


class _Checkpoint:
    """The tensors of a checkpoint folder: file, dtype and shape of each, from the headers only."""

    def __init__(self, path: str):
        files, weight_map = _weight_files(path)
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
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{os.path.join(path, CONFIG)}: not a transformers config ({e})") from None
    quantized = getattr(config, "quantization_config", None)
    if quantized:
        get = quantized.get if isinstance(quantized, dict) else functools.partial(getattr, quantized)
        method = get("quant_method", None) or "quantization_config"  # DeepSeek-V3 / R1: fp8
        raise CheckpointError(f"{os.path.join(path, CONFIG)}: a quantized checkpoint ({method}) is not supported: "
                              f"the loader reads float weights (convert it to bf16 first)")
    return config


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


def _as_dtype(dtype: Union[torch.dtype, str, None]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(found, torch.dtype):
        raise CheckpointError(f"{dtype!r} is not a torch dtype")
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
        if stored.is_floating_point:
            dtype = torch.float32 if any(p.search(name) for p in self.fp32) else (self.dtype or stored)
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)


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
    for names in PROJ_NAMES:
        if head in names:
            return names.index(head), tail
    raise CheckpointError(f"expert parameter {param} is none of the gated MLP's linears {PROJ_NAMES}")


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
    probes = ["gate_up_proj"] + [f"{lo}.{g}.weight" for g, _, _ in PROJ_NAMES]
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
        g, u, d = next(n for n in PROJ_NAMES if probe == f"{lo}.{n[0]}.weight")
        reads = []
        for i in range(lo, hi):
            for name, shape, dest in ((g, (f, hidden), local_gu[i - lo, :f]), (u, (f, hidden), local_gu[i - lo, f:]),
                                      (d, (hidden, f), local_d[i - lo])):
                key = f"{prefix}.{i}.{name}.weight"
                ckpt.expect(key, shape)
                reads.append(_Read(key, (), dest))
    experts.gate_up_proj = nn.Parameter(local_gu, requires_grad=gate_up.requires_grad)
    experts.down_proj = nn.Parameter(local_d, requires_grad=down.requires_grad)
    return reads


def _list_experts(path: str, experts: nn.ModuleList, lo: int, hi: int, ckpt: _Checkpoint,
                  alloc: _Alloc) -> Tuple[nn.ModuleList, List[_Read]]:
    """``experts[lo:hi]``, materialised; the reads that fill them."""
    role, tail = _role(next(n for n, _ in experts[lo].named_parameters()))
    probes = [f"{lo}.{names[role]}.{tail}" for names in PROJ_NAMES] + ["gate_up_proj"]
    prefix, probe = _prefix(path, ckpt, probes)
    reads = []
    for i in range(lo, hi):
        for name, p in list(experts[i].named_parameters()):
            key, index = (_fused_rows if probe == "gate_up_proj" else _list_key)(prefix, name, p, i, ckpt)
            local = nn.Parameter(alloc(f"{path}.{i}.{name}", p.shape, ckpt[key].dtype), requires_grad=p.requires_grad)
            owner, leaf = _owner(experts[i], name)
            owner._parameters[leaf] = local
            reads.append(_Read(key, index, local))
    return nn.ModuleList(experts[lo:hi]), reads


def _list_key(prefix: str, name: str, p: torch.Tensor, i: int, ckpt: _Checkpoint) -> Tuple[str, Tuple[slice, ...]]:
    """Expert ``i``'s ``name`` in a per-expert checkpoint, under either naming of the linears."""
    role, tail = _role(name)
    key = next((k for k in (f"{prefix}.{i}.{n[role]}.{tail}" for n in PROJ_NAMES) if k in ckpt),
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


def _plan_experts(model: nn.Module, ckpt: _Checkpoint, rank: int, world: int,
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


def _plan_replicated(model: nn.Module, ckpt: _Checkpoint, skip: Sequence[str],
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
            local = nn.Parameter(local, requires_grad=meta.requires_grad)
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
    """Fill every destination from the files, one file open at a time; the bytes read."""
    from safetensors import safe_open

    total = 0
    with torch.no_grad():
        for file, run in _runs(reads, ckpt):
            with safe_open(file, framework="pt", device="cpu") as f:
                for r in run:
                    src = f.get_slice(r.key)[r.index] if r.index else f.get_tensor(r.key)
                    r.dest.copy_(src.reshape(r.dest.shape))
                    total += src.numel() * src.element_size()
                    del src  # it maps the file: let the mapping go with the file
    return total


def _ignored(ckpt: _Checkpoint, reads: Sequence[_Read], experts: Sequence[str]) -> Tuple[str, ...]:
    """Checkpoint tensors neither read nor another rank's experts."""
    read = {r.key for r in reads}
    prefixes = {c for p in experts for c in _candidates(p)}
    return tuple(k for k in sorted(ckpt.catalog) if k not in read and k.rsplit(".", 1)[0] not in prefixes
                 and k.rsplit(".", 3)[0] not in prefixes)


# ---------------------------------------------------------------- the entry points


def check_checkpoint(path: Union[str, "os.PathLike[str]"]) -> Any:
    """The checkpoint's transformers config, after the checks every rank makes alike without reading a
    weight: a readable, unquantized ``config.json``; safetensors files with readable headers that agree
    with the index. Raises `CheckpointError` (what `load_checkpoint` would raise first)."""
    path = os.fspath(path)
    config = _config(path)
    _Checkpoint(path)
    return config



def load_checkpoint(path: Union[str, "os.PathLike[str]"], *, rank: Optional[int] = None,
                    world: Optional[int] = None, group: Any = None, dtype: Union[torch.dtype, str, None] = None,
                    device: Union[str, torch.device] = "cpu") -> Tuple[nn.Module, LoadReport]:
    """The transformers MoE causal LM saved in ``path``, holding this rank's routed experts only.

    ``rank`` / ``world`` default to ``group``'s (or the default group's, when one is initialised),
    else 0 / 1. ``dtype`` defaults to the config's, else each tensor's stored dtype. Raises
    `CheckpointError` for anything it cannot load; all but an unfillable tensor before any read.
    """
    path = os.fspath(path)
    rank, world = _rank_world(rank, world, group)
    config = _config(path)
    ckpt = _Checkpoint(path)
    dtype = _as_dtype(dtype) or _as_dtype(getattr(config, "dtype", None))
    device = torch.device(device)
    model = _skeleton(config)
    alloc = _Alloc(device, dtype, _fp32_patterns(model, dtype))
    reads, sharded = _plan_experts(model, ckpt, rank, world, alloc)
    more, pending = _plan_replicated(model, ckpt, list(sharded), alloc)
    reads += more
    bytes_read = _execute(reads, ckpt)
    _init_buffers(model, pending, device)
    _check_materialised(model)
    if dtype is not None:
        model.config.dtype = dtype
    model.eval()
    held = {id(t): t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())}
    return model, LoadReport(rank=rank, world=world, bytes_read=bytes_read, bytes_held=sum(held.values()),
                             tensors_read=len({r.key for r in reads}),
                             checkpoint_bytes=sum(s.nbytes for s in ckpt.catalog.values()), sharded=sharded,
                             ignored=_ignored(ckpt, reads, list(sharded)))
