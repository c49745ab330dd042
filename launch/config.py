"""The launcher's job configuration: parsed and checked from the command line before anything runs.

Every check here runs on each rank before the process group exists, so an invalid configuration
is reported once (per node) and every rank exits with status 2 before any collective.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Tuple

import click
import torch

import microbatch
import overlap

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(click.ClickException):
    """An invalid configuration: reported once per node, before any collective."""

    exit_code = 2


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """One launcher run: the model, the batch per rank, the modes and where and how to run them."""

    model: Any  # launch.presets.ModelConfig
    seq_lens: Tuple[int, ...]
    modes: Tuple[str, ...]
    device: str  # cpu, cuda or npu
    path: Optional[str]  # an execution path forced by --path, else None (the device's eager path)
    kv_offload: bool
    kv_store: str
    dtype: torch.dtype
    warmup: int
    iters: int
    seed: int
    check: bool
    out_dir: Optional[str]
    link: Optional[overlap.Link]
    timeout: float

    @property
    def graph(self) -> bool:
        """Whether each mode runs as one compiled torchair graph (``--path ge|aclgraph``)."""
        return self.path is not None and overlap.backends.get(self.path).is_graph


def parse_seq_lens(text: Optional[str], batch: int, seq_len: int) -> List[int]:
    if text is not None:
        if not text.strip(" ,"):
            raise ConfigError("--seq-lens is empty: give comma-separated request lengths, e.g. 512,128")
        try:
            lens = [int(x) for x in text.replace(" ", "").split(",") if x]
        except ValueError:
            raise ConfigError(f"--seq-lens must be comma-separated integers, got {text!r}") from None
    else:
        lens = [seq_len] * batch
    if not lens or any(n < 1 for n in lens):
        raise ConfigError(f"every request needs at least one token; got seq lens {lens}")
    return lens


def resolve_device(device: str, path: Optional[str]) -> str:
    """The device to run on: ``auto`` is npu if torch_npu sees one, else cuda, else cpu."""
    found = overlap.backends.get(overlap.detect_path()).device_type
    if device == "auto":
        device = found
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available on this machine")
    if device == "npu" and found != "npu":
        raise ConfigError("--device npu: torch_npu with an available NPU is required (install torch_npu "
                          "matching your torch and CANN)")
    if path is not None and overlap.backends.get(path).device_type != device:
        raise ConfigError(f"--path {path} runs on Ascend NPUs only; this run's device is {device}")
    return device


def parse_cpu_link(text: str, device: str) -> Optional[overlap.Link]:
    if device != "cpu" or text.strip().lower() in ("off", "none", "0", ""):
        return None
    try:
        return overlap.parse_link(text, "--cpu-link")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def build_model_config(preset_name: str, overrides: Dict[str, Any]) -> Any:
    from launch.presets import preset

    try:
        return preset(preset_name, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def job_config(*, world: int, device: str, exec_path: str, mode: str, kv_offload: bool, kv_store: str,
               preset_name: str, overrides: Dict[str, Any], batch: int, seq_len: int, seq_lens: Optional[str],
               dtype: str, warmup: int, iters: int, seed: int, check: bool, out_dir: Optional[str], cpu_link: str,
               timeout: float) -> JobConfig:
    """The job of the command-line options, checked; `ConfigError` names the first problem."""
    path = None if exec_path == "auto" else exec_path
    model = build_model_config(preset_name, overrides)
    lens = parse_seq_lens(seq_lens, batch, seq_len)
    if model.n_experts % world:
        raise ConfigError(f"{model.n_experts} experts cannot be split evenly over {world} ranks "
                          f"(--experts must be a multiple of the number of ranks)")
    if iters < 1 or warmup < 0:
        raise ConfigError(f"--iters must be >= 1 and --warmup >= 0, got {iters} and {warmup}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ConfigError(f"--timeout must be a positive number of seconds, got {timeout}")
    if check and mode not in ("all", "serial"):
        raise ConfigError(f"--check compares every mode with serial, but --mode {mode} does not run serial: "
                          f"use --mode all (or leave --check out)")
    device = resolve_device(device, path)
    link = parse_cpu_link(cpu_link, device)
    job = JobConfig(model, tuple(lens), tuple(microbatch.MODES) if mode == "all" else (mode,), device, path,
                    kv_offload, kv_store, DTYPES[dtype], warmup, iters, seed, check, out_dir, link, timeout)
    if job.graph and kv_offload:
        raise ConfigError(f"--kv-offload runs on the eager paths only: a copy to host memory on its own "
                          f"stream cannot be expressed inside a {path} graph")
    return job
