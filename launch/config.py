"""The launcher's job configuration: parsed and checked from the command line before anything runs.

Every check here runs on each rank before the process group exists, so an invalid configuration
is reported once (per node) and every rank exits with status 2 before any collective.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import click
import torch

import microbatch
import overlap

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(click.ClickException):
    """An invalid configuration: reported once per node, before any collective."""

    exit_code = 2


REFERENCE = "reference"
AUTO = "auto"  # --mode auto: the planner's choice (launch/planner.py), measured beside serial
ALL_MODES = tuple(name for name, m in microbatch.MODES.items() if m.in_all)
MODE_NAMES = tuple(microbatch.MODES) + ("all", AUTO)  # what --mode takes, in a comma-separated list


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """One launcher run: the model, the batch per rank, the modes and where and how to run them."""

    model: Any  # launch.presets.ModelConfig, or the transformers config of --model NAME|PATH
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
    model_name: str = REFERENCE  # --model: "reference", a transformers model type, or a checkpoint folder
    comm_priority: str = "off"  # --cpu-comm-priority: gloo's threads real-time ("rt") or not ("off"); CPU only
    asked_modes: Tuple[str, ...] = ()  # the modes --mode names, expanded ("all"), before serial is added

    @property
    def serial_added(self) -> bool:
        """Whether serial runs only as the reference (of ``--check``, or beside ``auto``), not asked for."""
        return "serial" in self.modes and "serial" not in (self.asked_modes or self.modes)

    @property
    def checkpoint(self) -> Optional[str]:
        """The checkpoint folder of ``--model PATH``, else None."""
        return self.model_name if self.model_name != REFERENCE and os.path.isdir(self.model_name) else None

    @property
    def transformers(self) -> bool:
        """Whether the model is a transformers causal LM (``--model NAME|PATH``)."""
        return self.model_name != REFERENCE

    def model_fields(self) -> Dict[str, Any]:
        """The model's configuration as plain values (what every rank must agree on)."""
        if not self.transformers:
            return dataclasses.asdict(self.model)
        return json.loads(self.model.to_json_string(use_diff=False))

    @property
    def graph(self) -> bool:
        """Whether each mode runs as one compiled torchair graph (``--path ge|aclgraph``)."""
        return self.path is not None and overlap.backends.get(self.path).is_graph


class ModeList(click.ParamType):
    """``--mode``: a comma-separated list of modes (``serial,three-batch``), as a tuple of names."""

    name = "mode list"

    def get_metavar(self, param: Any, ctx: Any = None) -> str:
        return "MODE[,MODE...]"

    def convert(self, value: Any, param: Any, ctx: Any) -> Tuple[str, ...]:
        if isinstance(value, tuple):
            return value
        try:
            return split_modes(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def split_modes(text: str) -> Tuple[str, ...]:
    """The mode names of one comma-separated ``--mode`` value; ValueError naming an unknown one."""
    names = tuple(n.strip() for n in text.split(","))
    for n in names:
        if n not in MODE_NAMES:
            what = f"unknown mode {n!r}" if n else f"an empty mode name in {text!r}"
            raise ValueError(f"{what} (valid: {', '.join(MODE_NAMES)}; a comma-separated list)")
    return names


def resolve_modes(asked: Sequence[str], check: bool) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """``(modes to run, modes asked for)``: ``all`` expanded, repeats dropped, order kept; serial put first
    when ``--check`` or ``auto`` needs it as the reference and the list leaves it out."""
    expanded: List[str] = []
    for name in asked:
        for m in (ALL_MODES if name == "all" else (name,)):
            if m not in expanded:
                expanded.append(m)
    needs_serial = check or AUTO in expanded
    run = tuple(expanded) if "serial" in expanded or not needs_serial else ("serial",) + tuple(expanded)
    return run, tuple(expanded)


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
        hint = " (--dense-layers sets the leading dense layers)" if "n_dense_layers" in str(exc) else ""
        raise ConfigError(str(exc) + hint) from None


def transformers_config(model_name: str, overrides: Dict[str, Any]) -> Any:
    """The transformers config of ``--model NAME`` (small, with the overrides) or ``--model PATH`` (as saved)."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"--model {model_name} needs transformers: pip install 'npu-overlap[transformers]'") from None
    given = {k: v for k, v in overrides.items() if v is not None}
    if os.path.isdir(model_name):
        if given:
            raise ConfigError(f"--model {model_name} is a checkpoint: its shapes are its own "
                              f"(drop {', '.join('--' + _OPTION_OF.get(k, k) for k in given)})")
        if not os.path.isfile(os.path.join(model_name, "config.json")):
            raise ConfigError(f"--model {model_name}: a checkpoint folder needs a config.json")
        from launch.checkpoint import CheckpointError, check_checkpoint

        try:  # its config and the headers of its files: what every rank finds alike, before any group
            return check_checkpoint(model_name)
        except CheckpointError as exc:
            raise ConfigError(str(exc).splitlines()[0]) from None  # it names the folder or file
    if model_name not in transformers.CONFIG_MAPPING:
        raise ConfigError(f"--model {model_name}: neither 'reference', a folder, nor a transformers model type "
                          f"(e.g. qwen3_moe, deepseek_v3, mixtral, qwen2_moe, glm4_moe)")
    from launch.transformers_model import small_config

    try:
        return small_config(model_name, given)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"--model {model_name}: {str(exc).splitlines()[0]}") from None


_OPTION_OF = {"n_layers": "layers", "n_dense_layers": "dense-layers", "n_experts": "experts", "top_k": "top-k",
              "n_shared": "shared-experts"}


def n_experts(job_model: Any) -> int:
    """Routed experts per MoE layer of a model config (the reference's or a transformers one); 0 if none."""
    if hasattr(job_model, "n_experts"):
        return int(job_model.n_experts)
    for field in ("n_routed_experts", "num_local_experts", "num_experts"):
        if getattr(job_model, field, None):
            return int(getattr(job_model, field))
    return 0


def job_config(*, world: int, device: str, exec_path: str, mode: Union[str, Sequence[str]], kv_offload: bool,
               kv_store: str,
               preset_name: str, overrides: Dict[str, Any], batch: int, seq_len: int, seq_lens: Optional[str],
               dtype: str, warmup: int, iters: int, seed: int, check: bool, out_dir: Optional[str], cpu_link: str,
               timeout: float, model_name: str = REFERENCE, cpu_comm_priority: str = "off") -> JobConfig:
    """The job of the command-line options, checked; `ConfigError` names the first problem.

    ``mode`` is one comma-separated list, or several (``--mode`` given more than once: they add up).
    """
    path = None if exec_path == "auto" else exec_path
    try:
        asked = [n for text in ([mode] if isinstance(mode, str) else mode) for n in split_modes(text)]
    except ValueError as exc:
        raise ConfigError(f"--mode: {exc}") from None
    model = (build_model_config(preset_name, overrides) if model_name == REFERENCE
             else transformers_config(model_name, overrides))
    lens = parse_seq_lens(seq_lens, batch, seq_len)
    experts = n_experts(model)
    if experts < 1:
        raise ConfigError(f"--model {model_name} has no routed experts: the toolkit runs MoE models")
    if experts % world:
        raise ConfigError(f"{experts} experts cannot be split evenly over {world} ranks "
                          f"(--experts must be a multiple of the number of ranks)")
    if iters < 1 or warmup < 0:
        raise ConfigError(f"--iters must be >= 1 and --warmup >= 0, got {iters} and {warmup}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ConfigError(f"--timeout must be a positive number of seconds, got {timeout}")
    device = resolve_device(device, path)
    link = parse_cpu_link(cpu_link, device)
    modes, expanded = resolve_modes(asked, check)
    job = JobConfig(model, tuple(lens), modes, device, path,
                    kv_offload, kv_store, DTYPES[dtype], warmup, iters, seed, check, out_dir, link, timeout,
                    model_name, cpu_comm_priority, expanded)
    if job.graph and AUTO in modes:
        raise ConfigError(f"--mode auto plans the eager paths; on --path {path} pick a mode")
    if job.graph and job.transformers:
        raise ConfigError(f"--path {path} compiles the reference model only; run --model {model_name} on the "
                          f"eager path (--path npu)")
    if job.graph and kv_offload:
        raise ConfigError(f"--kv-offload runs on the eager paths only: a copy to host memory on its own "
                          f"stream cannot be expressed inside a {path} graph")
    return job
