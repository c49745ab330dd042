"""Ranks that generate together hold alike what shapes their collectives, and the same replicated weights.

`check_alike` runs once at the start of `launch.engine.generate`, before the prefill's first exchange, in one
agreement over the expert group (`overlap.agree`): every argument that shapes a collective (the decode and prefill
modes, the buckets, the graph path, the decode exchanges, the model's layer count and dims) must be equal on every
rank, else one line on every rank naming the argument and each rank's value (``ranks disagree on buckets: rank 0:
[1, 2, 4]; rank 1: [8]``), where gloo would have aborted on a size mismatch or a step named only a missing post.

The replicated weights (every parameter but the routed experts an expert-parallel layer holds for this rank,
which differ by design) travel as a digest (`weight_digests`: per parameter its bit patterns summed as integers, and
their squares, kept per model until a parameter changes in place). The digests ride the same agreement as one short CRC (none
where a rank's weights hold NaN or inf: its logits will, and the steps' check names the rank); where it differs, a few more agreements, on every rank alike, narrow it to the first parameter that differs (``ranks hold
different weights: layers.0.attn.wq differs: rank 0: digest ...``).
"""
from __future__ import annotations

import json
import weakref
import zlib
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import overlap
from collectives import ExpertParallelMoE
from microbatch import DecodeModel

Digest = Optional[str]  # a parameter's bit patterns summed and their squares (`_digest`); None: NaN or inf in it
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}  # an integer view of each element size
_CHUNK = 1 << 22  # elements digested at a time
_KEPT: "weakref.WeakKeyDictionary[torch.nn.Module, Tuple[Tuple[Any, ...], List[Tuple[str, Digest]]]]" = \
    weakref.WeakKeyDictionary()
_GROUPS = 32  # digests compared per narrowing agreement (each a CRC: it fits a rank's post)
_LABEL = "generate.start"


def replicated_parameters(model: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """The model's parameters every rank holds alike, by name: all but the routed experts of its expert-parallel
    layers (`ExpertParallelMoE.experts`: this rank's share) and of the modules a checkpoint's loader sharded (those
    with an ``ep_shard``, which a transformers model's own tree still holds beside its expert-parallel layers)."""
    local = {id(p) for m in model.modules() if isinstance(m, ExpertParallelMoE) for p in m.experts.parameters()}
    local |= {id(p) for m in model.modules() if getattr(m, "ep_shard", None) is not None for p in m.parameters()}
    return [(n, p) for n, p in model.named_parameters() if id(p) not in local]


def weight_digests(model: torch.nn.Module) -> List[Tuple[str, Digest]]:
    """Each replicated parameter's name and digest (`Digest`), computed once and kept while no parameter is
    replaced or changed in place (its version counter)."""
    params = replicated_parameters(model)
    key = tuple((n, id(p), p._version) for n, p in params)
    kept = _KEPT.get(model)
    if kept is not None and kept[0] == key:
        return kept[1]
    digests = [(n, _digest(p)) for n, p in params]
    _KEPT[model] = (key, digests)
    return digests


def _digest(param: torch.Tensor) -> Digest:
    """``param``'s bit patterns summed, and their squares, modulo 2**64 (integer sums: the same on every rank
    whatever order a device or thread count adds them in, where float sums may differ in the last bits), or None
    where it holds NaN or inf; a chunk at a time, so that no copy of a large parameter is made whole."""
    flat = param.detach().reshape(-1)
    bits = flat.view(_BITS[flat.element_size()]) if flat.element_size() in _BITS else flat.view(torch.uint8)
    total = squares = 0
    with torch.no_grad():
        for start in range(0, flat.numel(), _CHUNK):
            if flat.is_floating_point() and not bool(torch.isfinite(flat[start:start + _CHUNK]).all()):
                return None
            chunk = bits[start:start + _CHUNK].to(torch.int64)
            total, squares = total + int(chunk.sum()), squares + int((chunk * chunk).sum())
    return f"{total % 2 ** 64:016x}{squares % 2 ** 64:016x}"


def _crc(items: Sequence[Any]) -> str:
    return f"{zlib.crc32(json.dumps(list(items), separators=(',', ':')).encode()):08x}"


def collective_settings(model: DecodeModel, **arguments: Any) -> Dict[str, Any]:
    """What must match on every rank for the ranks' collectives to line up: ``arguments`` (mode, buckets, ...) and
    the model's layer count, dims and decode exchanges."""
    cfg = model.cfg
    exchanges = sorted({getattr(getattr(m, "decode_exchange", None), "name", "none")
                        for m in model.modules() if isinstance(m, ExpertParallelMoE)})
    return {**arguments, "layers": cfg.n_layers, "dense layers": cfg.n_dense_layers,
            "model dims": {"vocab": cfg.vocab, "hidden": cfg.hidden, "experts": cfg.n_experts, "top_k": cfg.top_k,
                           "shared": cfg.n_shared, "k_shape": list(cfg.k_shape), "v_shape": list(cfg.v_shape)},
            "decode exchange": exchanges}


def check_alike(model: DecodeModel, group: Optional[dist.ProcessGroup], settings: Mapping[str, Any],
                error: type, check_weights: bool = True) -> None:
    """Raise ``error`` on every rank of ``group`` where ``settings`` (`collective_settings`) differ, or, with
    ``check_weights``, where the replicated weights do (naming the first parameter that differs); nothing alone."""
    if group is None:
        return
    digests = weight_digests(model) if check_weights else []
    values = dict(settings)
    if check_weights:
        finite = all(d is not None for _, d in digests)
        values.update({"replicated parameters": len(digests), "weights": _crc(d for _, d in digests) if finite else ""})
    transport = overlap.GroupTransport(group, _LABEL)
    posts = overlap.agree(values, transport, per_rank=["weights"], error=error)
    weights = {p["weights"] for p in posts} if check_weights else set()
    if len(weights) > 1 and "" not in weights:  # NaN or inf weights: the steps' NaN check names them
        raise error(_weights_line(digests, transport, error))


def _weights_line(digests: List[Tuple[str, Digest]], transport: overlap.GroupTransport, error: type) -> str:
    """The first parameter whose digest differs between the ranks, narrowed in agreements of `_GROUPS` CRCs each
    (the same posts, so the same steps, on every rank), and each rank's digest of it."""
    lo, hi = 0, len(digests)
    while hi - lo > 1:
        size = -(-(hi - lo) // _GROUPS)
        starts = list(range(lo, hi, size))
        crcs = [_crc(d for _, d in digests[s:min(s + size, hi)]) for s in starts]
        posts = overlap.agree({"crcs": crcs}, transport, per_rank=["crcs"], error=error)
        first = next(i for i in range(len(starts)) if len({tuple(p["crcs"])[i] for p in posts}) > 1)
        lo, hi = starts[first], min(starts[first] + size, hi)
    name, digest = digests[lo]
    posts = overlap.agree({"digest": digest}, transport, per_rank=["digest"], error=error)
    ranks = "; ".join(f"rank {r}: digest {p['digest']}" for r, p in enumerate(posts))
    return (f"ranks hold different weights: {name} differs: {ranks} (build the model alike on every rank, or pass "
            f"check_weights=False where they differ by design)")


__all__ = ["Digest", "check_alike", "collective_settings", "replicated_parameters", "weight_digests"]
