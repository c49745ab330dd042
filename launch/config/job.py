"""The job of a launcher run: its options and environment parsed and checked into a `JobConfig`.

Every check here runs on each rank before the process group exists, so an invalid configuration
is reported once (per node) and every rank exits with status 2 before any collective. The model's
checks are `launch.config.model`'s, the modes' `launch.config.modes`', the environment's
`launch.config.environment`'s.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

import microbatch
import overlap
from overlap.state import MAX_WAIT_TIMEOUT

from launch.models.transformers.fields import EXPERT_COUNTS, held_field

from .environment import EnvValue, compute_threads, environment
from collectives import DISPATCH_DTYPES

from .errors import ConfigError
from .model import (REFERENCE, ModelSettings, Overrides, build_model_config, check_transformers_model,
                    check_transformers_overrides, n_experts, transformers_config)
from .modes import AUTO, resolve_modes, split_modes

__all__ = ["DTYPES", "JobConfig", "MAX_SEED", "job_config", "parse_cpu_link", "parse_seq_lens", "resolve_device",
           "vocab_size"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """One launcher run: the model, the batch per rank, the modes and where and how to run them."""

    model: ModelSettings  # the reference's ModelConfig, or the transformers config of --model NAME|PATH
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
    environment: Tuple[Tuple[str, EnvValue], ...] = ()  # ("$NAME", value) of the variables that shape the run
    dispatch: str = "two-step"  # --dispatch: the MoE layers' count exchange apart from the tokens, or not
    split_margin: float = microbatch.planning.SPLIT_MARGIN  # --auto-split-margin: what a split must gain to be chosen
    refresh_calibration: bool = False  # --refresh-calibration: measure auto's calibration again, whatever is cached
    threads: int = 1  # each rank's compute threads (`launch.config.environment.compute_threads`)
    threads_from: str = ""  # where that number comes from, for the headline
    indexer_stream: bool = True  # --indexer-stream: sparse attention's indexer on its own stream (IndexedLayer)
    dispatch_dtype: Optional[str] = None  # --dispatch-dtype: "int8" / "fp8" (quantized per token), None: the model's
    quantize: Optional[str] = None  # --quantize: fp8 or w8a8, the seeded model's weights quantized in memory

    @property
    def dispatch_name(self) -> str:
        """How the tokens travel to their experts, as results say it: int8, fp8, or the model's dtype."""
        return self.dispatch_dtype or str(self.dtype).replace("torch.", "")

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
        """The model's configuration as plain values (what every rank must agree on): JSON, hence Any."""
        if not self.transformers:
            return dataclasses.asdict(self.model)
        return json.loads(self.model.to_json_string(use_diff=False))

    @property
    def graph(self) -> bool:
        """Whether each mode runs as one compiled torchair graph (``--path ge|aclgraph``)."""
        return self.path is not None and overlap.backends.get(self.path).is_graph


def parse_seq_lens(text: Optional[str], batch: int, seq_len: int) -> List[int]:
    if text is not None:
        if not text.strip(" ,"):
            raise ConfigError("--seq-lens is empty: give comma-separated request lengths, e.g. 512,128")
        items = text.replace(" ", "").split(",")
        if "" in items:
            raise ConfigError(f"--seq-lens has an empty item (two commas, or one at an end): {text!r}")
        try:
            lens = [int(x) for x in items]
        except ValueError:
            raise ConfigError(f"--seq-lens must be comma-separated integers, got {text!r}") from None
    else:
        if batch < 1 or seq_len < 1:
            raise ConfigError(f"--batch and --seq-len must be at least 1 (or give --seq-lens), got --batch {batch} "
                              f"and --seq-len {seq_len}")
        lens = [seq_len] * batch
    if not lens or any(n < 1 for n in lens):
        raise ConfigError(f"every request needs at least one token; got seq lens {lens}")
    return lens


def resolve_device(device: str, path: Optional[str]) -> str:
    """The device to run on: ``auto`` is npu if torch_npu sees one, else cuda, else cpu; or the device of the path
    ``$OVERLAP_PATH`` names, where that is the CPU or the device found (``OVERLAP_PATH=cpu``: the CPU path on a
    machine with a GPU)."""
    try:
        found = overlap.backends.get(overlap.detect_path()).device_type
        forced = overlap.context.env_path()
    except ValueError as exc:  # $OVERLAP_GRAPH_PATH or $OVERLAP_PATH, read on the way
        raise ConfigError(str(exc)) from None
    if device == "auto":
        wanted = overlap.backends.get(forced).device_type if forced else found
        device = wanted if wanted in ("cpu", found) else found  # else `environment` names $OVERLAP_PATH
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available on this machine")
    if device == "npu" and found != "npu":
        raise ConfigError("--device npu: torch_npu with an available NPU is required (install torch_npu "
                          "matching your torch and CANN)")
    if path is not None and overlap.backends.get(path).device_type != device:
        raise ConfigError(f"--path {path} runs on Ascend NPUs only; this run's device is {device}")
    return device


def parse_cpu_link(text: str, device: str) -> Optional[overlap.Link]:
    """The simulated link of ``--cpu-link`` (None: ``off``, or a device that is not the CPU); a number that is
    not a finite rate > 0 (``0`` included: ``off`` says no link) is a `ConfigError`."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        link = overlap.parse_link(text, "--cpu-link")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return link if device == "cpu" else None


MAX_SEED = 2 ** 32 - 1  # the weights' and tokens' generators are seeded from it and the rank, within 64 bits


def _check_numbers(seed: int, timeout: float, warmup: int, iters: int, out_dir: Optional[str]) -> None:
    """The options that are plain numbers (and ``--out``), each against its valid range."""
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"--seed must be an integer between 0 and {MAX_SEED}, got {seed}")
    if iters < 1 or warmup < 0:
        raise ConfigError(f"--iters must be >= 1 and --warmup >= 0, got {iters} and {warmup}")
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_WAIT_TIMEOUT):
        raise ConfigError(f"--timeout must be a positive number of seconds, got {timeout:g}"
                          + (f" (at most {MAX_WAIT_TIMEOUT:.3g}: the waits it bounds overflow beyond)"
                             if timeout > MAX_WAIT_TIMEOUT else ""))
    if out_dir is not None and not out_dir.strip():
        raise ConfigError("--out is empty: give the folder to write the results to (or leave --out out)")
    if out_dir is not None and os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"--out {out_dir} is not a directory: give a folder to write the results to")


def job_config(*, world: int, device: str, exec_path: str, mode: Union[str, Sequence[str]], kv_offload: bool,
               kv_store: str,
               preset_name: str, overrides: Overrides, batch: int, seq_len: int, seq_lens: Optional[str],
               dtype: str, warmup: int, iters: int, seed: int, check: bool, out_dir: Optional[str], cpu_link: str,
               timeout: float, model_name: str = REFERENCE, cpu_comm_priority: str = "off",
               dispatch: str = "two-step", auto_split_margin: float = microbatch.planning.SPLIT_MARGIN,
               refresh_calibration: bool = False, local_world: int = 1, full_size: bool = False,
               indexer_stream: bool = True, dispatch_dtype: Optional[str] = None,
               quantize: Optional[str] = None) -> JobConfig:
    """The job of the command-line options and the environment, checked; `ConfigError` names the first problem.

    ``mode`` is one comma-separated list, or several (``--mode`` given more than once: they add up);
    ``local_world``: the ranks on this node (torchrun's ``$LOCAL_WORLD_SIZE``), which share its cores;
    ``full_size`` (``--dry-run``): ``--model NAME`` at its family's published config, not made small.
    """
    path = None if exec_path == "auto" else exec_path
    try:
        asked = [n for text in ([mode] if isinstance(mode, str) else mode) for n in split_modes(text)]
    except ValueError as exc:
        raise ConfigError(f"--mode: {exc}") from None
    _check_numbers(seed, timeout, warmup, iters, out_dir)
    quantized = check_dispatch_dtype(dispatch_dtype, DTYPES[dtype])
    if not (math.isfinite(auto_split_margin) and 0.0 <= auto_split_margin < 1.0):
        raise ConfigError(f"--auto-split-margin must be a fraction in [0, 1) (0.1: a split must be predicted 10% "
                          f"faster than one batch), got {auto_split_margin:g}")
    if model_name != REFERENCE and not os.path.isdir(model_name) and not full_size:
        check_transformers_overrides(model_name, overrides, DTYPES[dtype])  # before transformers_config builds one
    model = (build_model_config(preset_name, overrides) if model_name == REFERENCE
             else transformers_config(model_name, overrides, full_size))
    lens = parse_seq_lens(seq_lens, batch, seq_len)
    experts = n_experts(model)
    if experts < 1:
        raise ConfigError(f"--model {model_name} has no routed experts: the toolkit runs MoE models")
    if experts % world:
        raise ConfigError(_uneven_experts(model_name, model, experts, world,
                                          given=overrides.get("n_experts") is not None, preset_name=preset_name))
    if model_name != REFERENCE and os.path.isdir(model_name):
        check_transformers_model(model_name, model, DTYPES[dtype])  # the checkpoint's own config.json
        _check_prompt_positions(model_name, lens)
    device = resolve_device(device, path)
    env = environment(device, path)  # first: a bad $OVERLAP_CPU_LINK (--cpu-link's default) is named as such
    link = parse_cpu_link(cpu_link, device)
    threads, threads_from = compute_threads(local_world)
    modes, expanded = resolve_modes(asked, check)
    job = JobConfig(model, tuple(lens), modes, device, path,
                    kv_offload, kv_store, DTYPES[dtype], warmup, iters, seed, check, out_dir, link, timeout,
                    model_name, cpu_comm_priority, expanded, env, dispatch, auto_split_margin,
                    bool(refresh_calibration), threads, threads_from, bool(indexer_stream), quantized,
                    quantize)
    _check_quantize(job)
    if job.graph and AUTO in modes:
        raise ConfigError(f"--mode auto plans the eager paths; on --path {path} pick a mode")
    if job.graph and job.transformers:
        raise ConfigError(f"--path {path} compiles the reference model only; run --model {model_name} on the "
                          f"eager path (--path npu)")
    if job.graph and kv_offload:
        raise ConfigError(f"--kv-offload runs on the eager paths only: a copy to host memory on its own "
                          f"stream cannot be expressed inside a {path} graph")
    return job


def _check_quantize(job: JobConfig) -> None:
    """``--quantize`` quantizes seeded weights on the eager paths: not a checkpoint's, not inside a graph."""
    if job.quantize is None:
        return
    if job.checkpoint is not None:
        raise ConfigError(f"--quantize {job.quantize}: --model {job.model_name} is a checkpoint, whose weights are "
                          f"what it holds (a quantized checkpoint stays quantized; a float one is quantized with "
                          f"launch.models.quantized.save_quantized)")
    if job.graph:
        raise ConfigError(f"--quantize {job.quantize} runs on the eager paths: the static-shape graph prefill "
                          f"of --path {job.path} does not take quantized experts")


def check_dispatch_dtype(name: Optional[str], dtype: torch.dtype) -> Optional[str]:
    """``--dispatch-dtype``: the quantized dispatch it asks for (``int8`` / ``fp8``), or None (unquantized: left out,
    or ``bf16`` for a bf16 model); `ConfigError` naming the value otherwise."""
    if name is None:
        return None
    if name not in DISPATCH_DTYPES:
        raise ConfigError(f"--dispatch-dtype must be one of {', '.join(DISPATCH_DTYPES)} (default: the model's dtype, "
                          f"unquantized), got {name!r}")
    if DISPATCH_DTYPES[name] is not None:
        return name
    if dtype != torch.bfloat16:
        raise ConfigError(f"--dispatch-dtype {name} sends a bfloat16 model's tokens unquantized, but --dtype is "
                          f"{str(dtype).replace('torch.', '')}: leave --dispatch-dtype out (tokens travel in the "
                          f"model's dtype), or pass int8 / fp8")
    return None


def _uneven_experts(model_name: str, model: ModelSettings, experts: int, world: int, given: bool,
                    preset_name: str) -> str:
    """Why ``world`` ranks cannot share the model's ``experts`` routed experts, naming where that count comes from:
    a checkpoint's config.json, ``--experts``, or the model's default (which ``--experts`` overrides)."""
    counts = [n for n in range(1, experts + 1) if experts % n == 0]
    fits = ", ".join(map(str, counts[:-1])) + f" or {counts[-1]}" if len(counts) > 1 else str(counts[0])
    if model_name != REFERENCE and os.path.isdir(model_name):
        field = held_field(model, EXPERT_COUNTS)
        return (f"--model {model_name}: the checkpoint has {experts} routed experts per MoE layer ({field} in its "
                f"config.json), which {world} ranks cannot share equally: run it on {fits} ranks")
    if given:
        return f"--experts {experts} cannot be split evenly over {world} ranks: give a multiple of {world}"
    whose = f"the {preset_name} preset's" if model_name == REFERENCE else f"--model {model_name}'s"
    return (f"{whose} {experts} routed experts cannot be split evenly over {world} ranks: run on {fits} ranks, or "
            f"set --experts to a multiple of {world}")


def vocab_size(job: JobConfig) -> int:
    """The model's vocabulary size, from its configuration."""
    return int(job.model.vocab_size if job.transformers else job.model.vocab)


def _check_prompt_positions(checkpoint: str, seq_lens: Sequence[int]) -> None:
    """The longest prompt within the checkpoint's ``max_position_embeddings`` (`check_positions`)."""
    from launch.models import CheckpointError, generation_settings

    try:
        settings = generation_settings(checkpoint, vocab=1, read_eos=False)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    if settings.max_positions is not None:
        check_positions(seq_lens, 0, settings.max_positions, settings.positions_file)


def check_positions(seq_lens: Sequence[int], new_tokens: int, limit: int, source: Optional[str]) -> None:
    """A `ConfigError` with the numbers where the longest prompt and its ``new_tokens`` pass the model's position
    limit (a checkpoint's ``max_position_embeddings``, read from ``source``); the reference model has none (its
    rotary tables are computed at any position)."""
    prompt = max(seq_lens, default=0)
    if prompt + new_tokens > limit:
        positions = (f"{prompt} prompt tokens + {new_tokens} new tokens = {prompt + new_tokens} positions"
                     if new_tokens else f"a prompt of {prompt} tokens")
        more = " or --new-tokens" if new_tokens else ""
        raise ConfigError(f"{positions}, beyond max_position_embeddings {limit} in {source}: shorten --seq-len / "
                          f"--seq-lens{more}")
