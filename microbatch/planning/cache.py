"""The calibration cache, shared by prefill and decode: its folder, a file per key, the keys, the JSON files.

A calibration is measured once per machine and kept: `calibration_key` says what it is valid for (machine, torch,
path, ranks, model shape, dtype, link, the CPU path's settings and the calibration's own), `cache_file` names its
file (a digest of the key) in `cache_dir` (``$OVERLAP_CALIBRATION_CACHE``, default
``~/.cache/npu-overlap/calibration/``), and `read_cache` / `write_cache` read and write that file's JSON object
(atomically; a file that cannot be read or written is named in a warning), and `measured_ago` says how old a
file's calibration is. The prefill calibration
(`microbatch.planning.prefill.calibration`: ``load``, ``save``) and the decode calibration (the launcher's
`calibrate_decode`, whose key is this key with decode's settings) both keep theirs here.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import socket
import tempfile
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

import overlap
from overlap import backends
from overlap.host_memory import freed_memory_setting

from ..model import MoEModel

logger = logging.getLogger(__name__)

ENV_CACHE = "OVERLAP_CALIBRATION_CACHE"
DEFAULT_CACHE = os.path.join("~", ".cache", "npu-overlap", "calibration")
# A key and a cache file are JSON: typed Any (whatever json.load gives back)
# The prefill calibration's format, in every key (a decode calibration's too: its key is this one extended), so a
# calibration measured as an older version did is measured again.
FORMAT = 12  # 2: link booked at issue (overlap.link); 3: waits; 5: contention per byte; 6: issue, notice, frame;
# 7: the CPU path's comm threads real-time (overlap.comm_threads), in the key; 8: read_at (a count exchange
# read by the next operation); 9: contention one collective at a time, notice as the host's wait; 10: residual
# `fit_residual` fits: the smallest token counts that split in two, how many, and each one's timed rounds;
# 11: a link's unobserved completions run no callback (overlap.link.DelayedWork): less contention to measure;
# 12: each collective's wait fitted through the origin (`prefill.fit`), no residual, the runs in rounds over the counts


def cache_dir(path: Optional[str] = None) -> str:
    """Where calibrations are kept: ``path``, else ``$OVERLAP_CALIBRATION_CACHE``, else the default."""
    return os.path.expanduser(path or os.environ.get(ENV_CACHE) or DEFAULT_CACHE)


def canonical(key: object) -> str:
    """``key`` (JSON) as text, its objects' fields sorted: equal keys give equal text, and one file."""
    return json.dumps(key, sort_keys=True, default=str)


def cache_file(key: Mapping[str, Any], directory: Optional[str] = None) -> str:
    """The file of the calibration whose key is ``key``."""
    digest = hashlib.sha256(canonical(key).encode()).hexdigest()[:24]
    return os.path.join(cache_dir(directory), f"{digest}.json")


def read_cache(path: str) -> Optional[Dict[str, object]]:
    """A cache file's JSON object; None where there is none, or, with a warning naming it, where it cannot be read
    or holds no JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError: ValueErrors; nesting
        logger.warning("ignoring the unreadable calibration %s (%s): measuring again", path, e)
        return None
    if not isinstance(data, dict):
        logger.warning("ignoring the calibration %s (%s, not an object): measuring again", path, type(data).__name__)
        return None
    return data


def write_cache(path: str, data: Mapping[str, object]) -> Optional[str]:
    """Write ``data`` as JSON to the cache file ``path`` (atomically: a reader sees the old file or the new one);
    None, with a warning, where it cannot be written."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, default=str)
        os.replace(tmp, path)
        return path
    except OSError as e:
        logger.warning("cannot write the calibration cache %s (%s)", path, e)
        return None


def measured_ago(path: str, now: Optional[float] = None) -> str:
    """When the calibration in the cache file ``path`` was measured (the file is written once, when it is), in
    words: ``measured 2026-05-01 14:02, 3.1 h ago``; "" where the file cannot be read. ``now``: the clock's time
    (`time.time`)."""
    try:
        written = os.path.getmtime(path)
    except OSError:
        return ""
    ago = max(0.0, (time.time() if now is None else now) - written)
    words = (f"{ago:.0f} s" if ago < 90 else f"{ago / 60:.0f} min" if ago < 90 * 60 else
             f"{ago / 3600:.1f} h" if ago < 48 * 3600 else f"{ago / 86400:.0f} days")
    return f"measured {time.strftime('%Y-%m-%d %H:%M', time.localtime(written))}, {words} ago"


def _config_fields(model: MoEModel) -> object:
    cfg = model.cfg
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    return repr(cfg)


def _device_name() -> str:
    backend = backends.current()
    if backend.device_type == "cpu":
        return platform.processor() or platform.machine()
    mod = getattr(torch, backend.device_type, None)
    getter = getattr(mod, "get_device_name", None)
    return str(getter()) if getter is not None else backend.device_type


def model_dtype(model: MoEModel) -> torch.dtype:
    """The dtype of ``model``'s weights (float32 where it has none): part of its calibrations' keys."""
    p = next(iter(model.parameters()), None)
    return p.dtype if p is not None else torch.float32


def _world(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def calibration_key(model: MoEModel, group: Optional[dist.ProcessGroup] = None, tokens: Sequence[int] = (),
                    repeats: int = 0, seq_len: int = 0) -> Dict[str, Any]:
    """What a calibration is valid for: machine, torch, path, ranks, model shape, dtype, link and settings."""
    link = overlap.current_link()
    key = {"format": FORMAT, "host": socket.gethostname(), "cpus": os.cpu_count(), "device": _device_name(),
            "torch": torch.__version__, "path": backends.current().name, "world": _world(group),
            "model": _config_fields(model), "dtype": str(model_dtype(model)),
            "link": None if link is None else {"gbps": link.gbps, "latency_us": link.latency_us},
            "comm_priority": overlap.comm_priority() if backends.current().name == "cpu" else None,
            # measured with freed host memory kept or not (overlap.host_memory): the CPU path's calibrations differ
            "host_memory": freed_memory_setting() if backends.current().name == "cpu" else None,
            "tokens": [int(n) for n in tokens], "repeats": int(repeats), "seq_len": int(seq_len)}
    quantized = _dispatch_dtypes(model)
    if quantized:  # a quantized dispatch moves other bytes (keys without one stay as they were)
        key["dispatch_dtype"] = quantized
    return json.loads(canonical(key))  # as it reads back from the cache


def _dispatch_dtypes(model: MoEModel) -> List[str]:
    """The dtypes the model's MoE layers quantize their dispatch to (`collectives.quantize`), if any."""
    layers = getattr(model, "moe_layers", None)
    if layers is None:
        return []
    return sorted({str(d) for d in (getattr(layer.moe, "dispatch_dtype", None) for layer in layers()) if d is not None})


__all__ = ["DEFAULT_CACHE", "ENV_CACHE", "FORMAT", "cache_dir", "cache_file", "calibration_key", "canonical",
           "measured_ago", "model_dtype", "read_cache", "write_cache"]
