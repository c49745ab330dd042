"""The launcher's job configuration: parsed and checked from the command line before anything runs.

Every check here runs on each rank before the process group exists, so an invalid configuration
is reported once (per node) and every rank exits with status 2 before any collective.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import click
import torch

import microbatch
import overlap
from launch.engine import DECODE_AUTO_MODES, DECODE_CALIBRATION_ROUNDS, DECODE_EXCHANGES
from microbatch import AUTO
from overlap.state import MAX_WAIT_TIMEOUT

if TYPE_CHECKING:  # imported where they are used: transformers only for --model NAME|PATH
    from transformers import PretrainedConfig

    from launch.models.presets import ModelConfig

ModelSettings = Union["ModelConfig", "PretrainedConfig"]  # the reference's shapes, or a transformers config
Overrides = Dict[str, Optional[int]]  # --layers, --hidden, ... by ModelConfig field; None: not given
EnvValue = Union[str, int, None]  # the value of an environment variable that shapes the run, as agreed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(click.ClickException):
    """An invalid configuration: reported once per node, before any collective."""

    exit_code = 2


REFERENCE = "reference"
ALL_MODES = tuple(name for name, m in microbatch.MODES.items() if m.in_all)
MODE_NAMES = tuple(microbatch.MODES) + ("all", AUTO)  # what --mode takes, in a comma-separated list
DECODE_MODE_NAMES = tuple(microbatch.DECODE_MODES) + ("all", AUTO)  # what --decode-mode takes


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


class ModeList(click.ParamType):
    """``--mode``: a comma-separated list of modes (``serial,three-batch``), as a tuple of names; ``names``: the
    valid ones (`DECODE_MODE_NAMES` for ``--decode-mode``)."""

    name = "mode list"

    def __init__(self, names: Sequence[str] = MODE_NAMES):
        self.names = tuple(names)

    def get_metavar(self, param: click.Parameter, ctx: Optional[click.Context] = None) -> str:
        return "MODE[,MODE...]"

    def convert(self, value: Union[str, Tuple[str, ...]], param: Optional[click.Parameter],
                ctx: Optional[click.Context]) -> Tuple[str, ...]:
        if isinstance(value, tuple):
            return value
        try:
            return split_modes(str(value), self.names)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def split_modes(text: str, valid: Sequence[str] = MODE_NAMES) -> Tuple[str, ...]:
    """The mode names of one comma-separated ``--mode`` value; ValueError naming an unknown one."""
    names = tuple(n.strip() for n in text.split(","))
    for n in names:
        if n not in valid:
            what = f"unknown mode {n!r}" if n else f"an empty mode name in {text!r}"
            hint = " (a decode mode: give it to --decode-mode)" if n in DECODE_MODE_NAMES else ""
            raise ValueError(f"{what}{hint} (valid: {', '.join(valid)}; a comma-separated list)")
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


def environment(device: str, path: Optional[str]) -> Tuple[Tuple[str, EnvValue], ...]:
    """The toolkit's environment variables, checked for a run on ``device`` (``path``: ``--path``, None for
    the device's eager path): ``(("$NAME", value), ...)`` of those that shape the run, which every rank must
    agree on (`launch.agreement.fingerprint`); a `ConfigError` naming a variable with a bad value.

    Every ``OVERLAP_*`` variable the toolkit reads is checked here, bad values refused even where the
    launcher does not use them. Those left out of the agreement, and why:

    - ``OVERLAP_PATH``: must name this run's path, which ``--device`` / ``--path`` choose (and the ranks
      agree on); anything else is refused, so no thread of the job can lower on another path;
    - ``OVERLAP_GRAPH_PATH``: the lowering of a compiled region with no path set; the launcher compiles
      under ``--path`` (``overlap.use_path``);
    - ``OVERLAP_CPU_LINK``, ``OVERLAP_CPU_COMM_PRIORITY``: the defaults of ``--cpu-link`` and
      ``--cpu-comm-priority``, agreed on as those options;
    - ``OVERLAP_CALIBRATION_CACHE``: each rank's own folder; `microbatch.planning.calibrate` checks that
      every rank found the same calibration and measures again, on every rank, where they differ;
    - ``OVERLAP_FAULT``: the tests' fault injection, meant for one rank;
    - ``OVERLAP_RANK_TIMEOUT``, ``OVERLAP_TEST_TIMEOUT``, ``OVERLAP_START_METHOD``: the test harness's
      (`overlap.multirank`), not read by the launcher.
    """
    from overlap.comm_threads import env_comm_priority
    from overlap.context import ENV_PATH, env_enabled, env_graph_path, env_path
    from overlap.cores import ENV_BUDGET, ENV_SOC, env_core_budget
    from overlap.host_memory import ENV_KEEP_MEMORY, env_keep_memory
    from overlap.link import env_link
    from overlap.observability.sanitizer import ENV_SANITIZE, env_mode

    try:
        forced = env_path()
        env_graph_path()
        env_link()
        env_comm_priority()
        keep_memory = env_keep_memory()
        enabled = env_enabled()
        sanitize = env_mode() or "off"
        budget = env_core_budget()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    run_path = path or device
    if forced is not None and forced != run_path:
        raise ConfigError(f"{ENV_PATH}={forced} but this run's path is {run_path}: --device and --path choose the "
                          f"launcher's path (unset {ENV_PATH}, or pass --device / --path)")
    out: List[Tuple[str, EnvValue]] = [
        (f"${overlap.ENV_ENABLE}", "on" if enabled else "off"),  # off: every mode runs single-stream
        (f"${ENV_SANITIZE}", sanitize),  # a rank that checks ordering runs slower, and raise stops it
        # the core budget limit_cores checks against (the launcher sets no limit yet: the same job must
        # not pass on one rank and fail on another once it does)
        (f"${ENV_BUDGET}", None if budget is None else f"{budget.aic}|{budget.aiv}"),
        (f"${ENV_SOC}", os.environ.get(ENV_SOC, "").strip() or None),
        # the CPU path's freed host memory kept (overlap.host_memory): the steps' and calibrations' times differ
        (f"${ENV_KEEP_MEMORY}", None if device != "cpu" else "off" if keep_memory is False else "on"),
    ]
    if device == "npu":  # HCCL sizes every communicator's buffer from it, and MC2's window must fit alike
        from collectives.mc2 import ENV_BUFFSIZE, MC2Error, hccl_buffsize_mb

        try:
            out.append((f"${ENV_BUFFSIZE}", hccl_buffsize_mb()[0]))
        except MC2Error as exc:
            raise ConfigError(str(exc)) from None
    return tuple(out)


def build_model_config(preset_name: str, overrides: Overrides) -> ModelConfig:
    """The reference model's shapes: the preset with the options given; `ConfigError` naming a bad one."""
    from launch.models.presets import preset

    try:
        return preset(preset_name, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        hint = " (--dense-layers sets the leading dense layers)" if "n_dense_layers" in str(exc) else ""
        raise ConfigError(str(exc) + hint) from None


def transformers_config(model_name: str, overrides: Overrides) -> PretrainedConfig:
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
        from launch.models.checkpoint import CheckpointError, check_checkpoint
        from launch.models.families import check_family

        try:  # its config and the headers of its files: what every rank finds alike, before any group
            config = check_checkpoint(model_name)
        except CheckpointError as exc:
            raise ConfigError(str(exc).splitlines()[0]) from None  # it names the folder or file
        try:  # a family the adapter does not run is refused here, not halfway through the load
            check_family(config.model_type)
        except Exception as exc:  # noqa: BLE001 (transformers' own config errors are not all ValueErrors)
            why = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
            raise ConfigError(f"--model {model_name}: a {config.model_type} checkpoint: {why}") from None
        return config
    if model_name not in transformers.CONFIG_MAPPING:
        raise ConfigError(f"--model {model_name}: neither 'reference', a folder, nor a transformers model type "
                          f"(e.g. qwen3_moe, deepseek_v3, mixtral, qwen2_moe, glm4_moe)")
    from launch.models.families import check_family, small_config

    try:  # the family must run through the adapter (a small model of it, on this rank alone): else one line
        config = small_config(model_name, given)
        check_family(model_name, given)
    except Exception as exc:  # noqa: BLE001 (transformers' own config errors are not all ValueErrors)
        why = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
        raise ConfigError(f"--model {model_name}: {why}") from None
    return config


_OPTION_OF = {"n_layers": "layers", "n_dense_layers": "dense-layers", "n_experts": "experts", "top_k": "top-k",
              "n_shared": "shared-experts"}


def n_experts(job_model: ModelSettings) -> int:
    """Routed experts per MoE layer of a model config (the reference's or a transformers one); 0 if none."""
    if hasattr(job_model, "n_experts"):
        return int(job_model.n_experts)
    for field in ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts"):
        if getattr(job_model, field, None):
            return int(getattr(job_model, field))
    return 0


_TOP_K_FIELDS = ("num_experts_per_tok", "moe_topk", "top_k_experts", "moe_top_k")
_GROUPED_MM_BYTES = 16  # torch's grouped matmul (transformers' experts) takes rows of a multiple of 16 bytes


def check_transformers_model(model_name: str, cfg: PretrainedConfig, dtype: torch.dtype) -> None:
    """Routing, layer counts and sizes of the transformers config ``cfg`` that its model cannot run with,
    found before any rank builds it: a `ConfigError` naming the option (for a checkpoint, the field of its
    config.json) and the valid range, instead of an error from inside the model."""
    checkpoint = os.path.isdir(model_name)

    def name(option: str, field: str) -> str:
        return f"{field} in {model_name}/config.json" if checkpoint else f"--{option}"

    experts = n_experts(cfg)
    layers = getattr(cfg, "num_hidden_layers", None)
    if isinstance(layers, int) and layers < 1:
        raise ConfigError(f"{name('layers', 'num_hidden_layers')} must be >= 1, got {layers}")
    _check_dense_layers(cfg, layers, name)
    top_field = next((f for f in _TOP_K_FIELDS if isinstance(getattr(cfg, f, None), int)), None)
    top_k = getattr(cfg, top_field) if top_field else None
    most = _check_groups(model_name, cfg, experts, name)
    if top_k is not None and not 1 <= top_k <= most:
        why = f"the {experts} experts" if most == experts else \
            f"the experts of the topk_group={cfg.topk_group} of n_group={cfg.n_group} groups it routes within"
        raise ConfigError(f"{name('top-k', top_field)} must be between 1 and {most} ({why}), got {top_k}")
    per_row = _GROUPED_MM_BYTES // torch.empty((), dtype=dtype).element_size()
    for option, field in (("hidden", "hidden_size"), ("", "moe_intermediate_size")):
        size = getattr(cfg, field, None)
        if isinstance(size, int) and size % per_row:
            what = name(option, field) if option or checkpoint else f"{model_name}'s {field}"
            raise ConfigError(f"{what} must be a multiple of {per_row} with {str(dtype).replace('torch.', '')}: "
                              f"{model_name}'s experts run torch's grouped matmul, which takes rows of a multiple of "
                              f"{_GROUPED_MM_BYTES} bytes; got {size}")


def _check_transformers_overrides(model_name: str, overrides: Overrides, dtype: torch.dtype) -> None:
    """`check_transformers_model` on the small config of ``--model NAME`` with the overrides, before
    `transformers_config` builds and runs a model of it (whose failure would be the model's own words);
    nothing where that config cannot be made at all: `transformers_config` says why."""
    try:
        import transformers

        from launch.models.families import small_config

        if model_name not in transformers.CONFIG_MAPPING:
            return
        cfg = small_config(model_name, {k: v for k, v in overrides.items() if v is not None})
    except Exception:  # noqa: BLE001 - reported by transformers_config, with its own words
        return
    check_transformers_model(model_name, cfg, dtype)


def _check_dense_layers(cfg: PretrainedConfig, layers: Optional[int], name: Callable[[str, str], str]) -> None:
    """The leading dense layers fit the layers (the reference model refuses more, so does this)."""
    if not isinstance(layers, int):
        return
    dense = getattr(cfg, "first_k_dense_replace", None)
    if isinstance(dense, int) and not 0 <= dense <= layers:
        raise ConfigError(f"{name('dense-layers', 'first_k_dense_replace')} must be between 0 and the {layers} "
                          f"layers ({name('layers', 'num_hidden_layers')}), got {dense}")
    only = getattr(cfg, "mlp_only_layers", None)
    if isinstance(only, (list, tuple)) and any(not isinstance(i, int) or not 0 <= i < layers for i in only):
        raise ConfigError(f"{name('dense-layers', 'mlp_only_layers')} must be between 0 and the {layers} layers "
                          f"({name('layers', 'num_hidden_layers')}), got {len(only)} dense layer(s): {list(only)}")


def _check_groups(model_name: str, cfg: PretrainedConfig, experts: int, name: Callable[[str, str], str]) -> int:
    """DeepSeek-style group routing (``n_group`` groups, the best ``topk_group`` of them, top-k within those):
    the experts must split into the groups, each holding enough to score it; the most top-k can pick."""
    groups, chosen = getattr(cfg, "n_group", None), getattr(cfg, "topk_group", None)
    method = getattr(cfg, "topk_method", None)
    if not (isinstance(groups, int) and isinstance(chosen, int)) or method == "greedy" or experts < 1:
        return experts
    if groups < 1 or not 1 <= chosen <= groups:
        raise ConfigError(f"{model_name}: topk_group={chosen} must be between 1 and n_group={groups} (>= 1)")
    # a group's score: its best expert (DeepSeek-V2's group_limited_greedy), else the sum of its best two
    least = 1 if method == "group_limited_greedy" else 2
    if experts % groups or experts // groups < least:
        field = next(f for f in ("n_routed_experts", "num_local_experts", "num_experts") if getattr(cfg, f, None))
        raise ConfigError(f"{name('experts', field)} {experts}: {model_name} routes within "
                          f"n_group={groups} groups of experts, scoring each by its best {least}: the experts must "
                          f"be a multiple of {groups}, at least {least * groups}")
    return min(experts, chosen * (experts // groups))


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


def job_config(*, world: int, device: str, exec_path: str, mode: Union[str, Sequence[str]], kv_offload: bool,
               kv_store: str,
               preset_name: str, overrides: Overrides, batch: int, seq_len: int, seq_lens: Optional[str],
               dtype: str, warmup: int, iters: int, seed: int, check: bool, out_dir: Optional[str], cpu_link: str,
               timeout: float, model_name: str = REFERENCE, cpu_comm_priority: str = "off",
               dispatch: str = "two-step", auto_split_margin: float = microbatch.planning.SPLIT_MARGIN) -> JobConfig:
    """The job of the command-line options and the environment, checked; `ConfigError` names the first problem.

    ``mode`` is one comma-separated list, or several (``--mode`` given more than once: they add up).
    """
    path = None if exec_path == "auto" else exec_path
    try:
        asked = [n for text in ([mode] if isinstance(mode, str) else mode) for n in split_modes(text)]
    except ValueError as exc:
        raise ConfigError(f"--mode: {exc}") from None
    _check_numbers(seed, timeout, warmup, iters, out_dir)
    if not (math.isfinite(auto_split_margin) and 0.0 <= auto_split_margin < 1.0):
        raise ConfigError(f"--auto-split-margin must be a fraction in [0, 1) (0.1: a split must be predicted 10% "
                          f"faster than one batch), got {auto_split_margin:g}")
    if model_name != REFERENCE and not os.path.isdir(model_name):
        _check_transformers_overrides(model_name, overrides, DTYPES[dtype])  # before transformers_config builds one
    model = (build_model_config(preset_name, overrides) if model_name == REFERENCE
             else transformers_config(model_name, overrides))
    lens = parse_seq_lens(seq_lens, batch, seq_len)
    experts = n_experts(model)
    if experts < 1:
        raise ConfigError(f"--model {model_name} has no routed experts: the toolkit runs MoE models")
    if experts % world:
        raise ConfigError(f"{experts} experts cannot be split evenly over {world} ranks "
                          f"(--experts must be a multiple of the number of ranks)")
    if model_name != REFERENCE and os.path.isdir(model_name):
        check_transformers_model(model_name, model, DTYPES[dtype])  # the checkpoint's own config.json
    device = resolve_device(device, path)
    env = environment(device, path)  # first: a bad $OVERLAP_CPU_LINK (--cpu-link's default) is named as such
    link = parse_cpu_link(cpu_link, device)
    modes, expanded = resolve_modes(asked, check)
    job = JobConfig(model, tuple(lens), modes, device, path,
                    kv_offload, kv_store, DTYPES[dtype], warmup, iters, seed, check, out_dir, link, timeout,
                    model_name, cpu_comm_priority, expanded, env, dispatch, auto_split_margin)
    if job.graph and AUTO in modes:
        raise ConfigError(f"--mode auto plans the eager paths; on --path {path} pick a mode")
    if job.graph and job.transformers:
        raise ConfigError(f"--path {path} compiles the reference model only; run --model {model_name} on the "
                          f"eager path (--path npu)")
    if job.graph and kv_offload:
        raise ConfigError(f"--kv-offload runs on the eager paths only: a copy to host memory on its own "
                          f"stream cannot be expressed inside a {path} graph")
    return job


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """What the generation launcher adds to a job: the new tokens, the stop token and the decode modes."""

    new_tokens: int
    spread: float  # each request's new tokens are drawn from [ceil(new_tokens * (1 - spread)), new_tokens]
    stop_token: Optional[int]
    runs: Tuple[Tuple[str, str], ...]  # (prefill mode, decode mode) of each run, serial's first with --check
    graph: Optional[str] = None  # --decode-graph: the path decode steps are captured on per bucket (None: eager)
    buckets: Optional[Tuple[int, ...]] = None  # --decode-buckets (None: the powers of two)
    guard: bool = True  # --decode-guard: auto sets aside a mode its steps measured slower than serial
    calibration_rounds: int = DECODE_CALIBRATION_ROUNDS  # --decode-calibration-rounds
    auto_modes: Tuple[str, ...] = DECODE_AUTO_MODES  # --decode-auto-modes: auto's candidates, serial first
    exchange: str = "capacity"  # --decode-exchange: one of DECODE_EXCHANGES
    length_buckets: bool = False  # --decode-length-buckets: captured steps attend over the room the histories use

    def fingerprint(self) -> Dict[str, Union[bool, int, float, str, None, List[int], List[str], List[List[str]]]]:
        """What must be equal on every rank, by option (`launch.agreement.agree`)."""
        return {"--new-tokens": self.new_tokens, "--new-tokens-spread": self.spread, "--stop-token": self.stop_token,
                "--decode-mode": [list(r) for r in self.runs], "--decode-graph": self.graph or "off",
                "--decode-buckets": list(self.buckets or ()), "--decode-guard": self.guard,
                "--decode-calibration-rounds": self.calibration_rounds, "--decode-auto-modes": list(self.auto_modes),
                "--decode-exchange": self.exchange, "--decode-length-buckets": self.length_buckets}

    def min_new_tokens(self) -> int:
        return max(1, math.ceil(self.new_tokens * (1.0 - self.spread) - 1e-9))  # 10 * (1 - 0.7) is 3.0000000000000004


def vocab_size(job: JobConfig) -> int:
    """The model's vocabulary size, from its configuration."""
    return int(job.model.vocab_size if job.transformers else job.model.vocab)


def decode_config(job: JobConfig, *, new_tokens: int, spread: float, stop_token: Optional[int],
                  decode_modes: Sequence[str], graph: str = "off", buckets: Optional[str] = None,
                  guard: bool = True, calibration_rounds: int = DECODE_CALIBRATION_ROUNDS,
                  auto_modes: Sequence[str] = DECODE_AUTO_MODES, exchange: str = "capacity",
                  length_buckets: bool = False) -> DecodeConfig:
    """The generation options, checked against the job (`ConfigError` names the first problem).

    ``decode_modes``: the ``--decode-mode`` names (empty: the same as ``--mode``). Each prefill mode is paired
    with the decode mode at its place; one list of a single mode goes with every mode of the other."""
    if new_tokens < 1:
        raise ConfigError(f"--new-tokens must be at least 1, got {new_tokens}")
    if calibration_rounds < 1:
        raise ConfigError(f"--decode-calibration-rounds must be at least 1, got {calibration_rounds}")
    if not auto_modes or any(m in ("all", AUTO) for m in auto_modes):
        raise ConfigError(f"--decode-auto-modes names decode modes for auto to choose from (not all or auto), got "
                          f"{','.join(auto_modes) or 'none'}")
    candidates = tuple(dict.fromkeys(("serial",) + tuple(auto_modes)))  # serial: the reference, always a candidate
    if not (math.isfinite(spread) and 0.0 <= spread < 1.0):
        raise ConfigError(f"--new-tokens-spread must be in [0, 1), got {spread:g}")
    vocab = vocab_size(job)
    if stop_token is not None and not 0 <= stop_token < vocab:
        raise ConfigError(f"--stop-token must be a token id in [0, {vocab}), got {stop_token}")
    prefill = [m for m in (job.asked_modes or job.modes)]
    decode = resolve_modes(decode_modes, check=False)[1] if decode_modes else tuple(prefill)
    if AUTO in prefill:
        raise ConfigError("--mode auto is not available in generation (its prefill's planner chooses for prefill "
                          "jobs): name the prefill modes; --decode-mode auto chooses each decode step's mode")
    if len(decode) == 1:
        runs = [(p, decode[0]) for p in prefill]
    elif len(prefill) == 1:
        runs = [(prefill[0], d) for d in decode]
    elif len(decode) == len(prefill):
        runs = list(zip(prefill, decode))
    else:
        raise ConfigError(f"--decode-mode lists {len(decode)} modes and --mode {len(prefill)}: give as many, or one "
                          f"of either (it goes with every mode of the other)")
    runs = list(dict.fromkeys(runs))  # repeats dropped, order kept
    if (job.check or any(d == AUTO for _, d in runs)) and ("serial", "serial") not in runs:
        runs.insert(0, ("serial", "serial"))  # the reference of --check, and what auto is measured beside
    captured = captured_path(job, graph)
    if length_buckets and graph == "off":
        raise ConfigError("--decode-length-buckets sizes the captured steps' attention; with --decode-graph off the "
                          "eager steps attend over their histories already")
    _check_exchange(job, exchange)
    return DecodeConfig(new_tokens, float(spread), stop_token, tuple(runs), captured, parse_buckets(buckets),
                        bool(guard), int(calibration_rounds), candidates, exchange, bool(length_buckets))


def captured_path(job: JobConfig, graph: str) -> Optional[str]:
    """``--decode-graph``: the path decode steps are captured on per bucket (None: eager steps). ``auto`` captures
    on CUDA where the run can (the device cache, the reference model: an eager step there is bound by its
    launches, 6-10 times a captured one on an H200) and runs eager steps elsewhere."""
    if graph == "auto":
        return "cuda" if job.device == "cuda" and not job.kv_offload and not job.transformers else None
    captured = None if graph == "off" else graph
    if captured is not None and job.kv_offload:
        raise ConfigError("--decode-graph captures steps over the device cache: drop --kv-offload")
    return captured


def _check_exchange(job: JobConfig, exchange: str) -> None:
    """``--decode-exchange``: MC2 runs torch_npu's fused operators, on Ascend, over bf16 / fp16 tokens."""
    if exchange not in DECODE_EXCHANGES:
        raise ConfigError(f"--decode-exchange must be one of {', '.join(DECODE_EXCHANGES)}, got {exchange!r}")
    if exchange == "mc2" and job.device != "npu":
        raise ConfigError(f"--decode-exchange mc2 runs torch_npu's fused MC2 operators on Ascend (--device npu), "
                          f"not on {job.device}: use capacity, or auto (MC2 where it runs)")
    if exchange == "mc2" and job.dtype not in (torch.bfloat16, torch.float16):
        raise ConfigError(f"--decode-exchange mc2 takes bfloat16 or float16 tokens, not "
                          f"{str(job.dtype).replace('torch.', '')}: pass --dtype bfloat16")


def parse_buckets(text: Optional[str]) -> Optional[Tuple[int, ...]]:
    """``--decode-buckets``: increasing positive sizes, comma-separated (None: the powers of two)."""
    if text is None:
        return None
    try:
        sizes = tuple(sorted({int(x) for x in text.replace(" ", "").split(",") if x}))
    except ValueError:
        raise ConfigError(f"--decode-buckets must be comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"--decode-buckets must be positive sizes, got {text!r}")
    return sizes
