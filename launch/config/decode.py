"""What the generation launcher adds to a job: the new tokens, the stop token, the decode modes paired with the
prefill modes, and how decode steps run (captured or eager, their buckets, the exchange), checked into a
`DecodeConfig`."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

import overlap
from launch.models import CheckpointError, GenerationSettings, generation_settings

from .errors import ConfigError
from .job import JobConfig, check_positions, vocab_size
from .modes import AUTO, DECODE_AUTO_MODES, DECODE_CALIBRATION_ROUNDS, DECODE_EXCHANGES, resolve_modes

__all__ = ["DecodeConfig", "captured_path", "check_exchange", "check_generation_options", "decode_config",
           "parse_buckets", "prefill_modes"]

# The most --new-tokens and a --decode-buckets size may be: a request's KV cache holds its prompt and new tokens,
# and a bucket is a step's tokens per rank; no machine holds 2**31 rows (the memory check refuses far fewer), and
# larger integers overflow the 64-bit sizes torch takes.
MAX_COUNT = 2 ** 31 - 1


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """What the generation launcher adds to a job: the new tokens, the stop token and the decode modes."""

    new_tokens: int
    spread: float  # each request's new tokens are drawn from [ceil(new_tokens * (1 - spread)), new_tokens]
    stop_token: Optional[int]  # --stop-token, else the checkpoint's eos_token_id
    runs: Tuple[Tuple[str, str], ...]  # (prefill mode, decode mode) of each run, serial's first with --check
    graph: Optional[str] = None  # --decode-graph: the path decode steps are captured on per bucket (None: eager)
    buckets: Optional[Tuple[int, ...]] = None  # --decode-buckets (None: the powers of two)
    guard: bool = True  # --decode-guard: auto sets aside a mode its steps measured slower than serial
    calibration_rounds: int = DECODE_CALIBRATION_ROUNDS  # --decode-calibration-rounds
    auto_modes: Tuple[str, ...] = DECODE_AUTO_MODES  # --decode-auto-modes: auto's candidates, serial first
    exchange: str = "capacity"  # --decode-exchange: one of DECODE_EXCHANGES
    length_buckets: bool = False  # --decode-length-buckets: captured steps attend over the room the histories use
    stop_file: Optional[str] = None  # the checkpoint's file the stop token comes from (None: --stop-token, or none)

    def fingerprint(self) -> Dict[str, Union[bool, int, float, str, None, List[int], List[str], List[List[str]]]]:
        """What must be equal on every rank, by option (`launch.agreement.agree`)."""
        return {"--new-tokens": self.new_tokens, "--new-tokens-spread": self.spread, "--stop-token": self.stop_token,
                "--decode-mode": [list(r) for r in self.runs], "--decode-graph": self.graph or "off",
                "--decode-buckets": list(self.buckets or ()), "--decode-guard": self.guard,
                "--decode-calibration-rounds": self.calibration_rounds, "--decode-auto-modes": list(self.auto_modes),
                "--decode-exchange": self.exchange, "--decode-length-buckets": self.length_buckets}

    def min_new_tokens(self) -> int:
        return max(1, math.ceil(self.new_tokens * (1.0 - self.spread) - 1e-9))  # 10 * (1 - 0.7) is 3.0000000000000004


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
    if new_tokens > MAX_COUNT:
        raise ConfigError(f"--new-tokens must be at most {MAX_COUNT} (each request's KV cache holds its prompt and "
                          f"new tokens: no machine holds that many rows), got {new_tokens}")
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
    settings = _checkpoint_settings(job, vocab, asked_stop=stop_token is not None)
    _check_positions(job, new_tokens, settings)
    stop_file = None
    if stop_token is None and settings.stop_token is not None:  # the user's --stop-token wins
        stop_token, stop_file = settings.stop_token, os.path.basename(settings.stop_file or "")
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
    if length_buckets and captured is None:
        raise ConfigError(f"--decode-length-buckets sizes the captured steps' attention; --decode-graph auto "
                          f"captures none here ({job.device}, the steps run eager): name a path (--decode-graph cpu) "
                          f"or leave --decode-length-buckets out")
    check_exchange(job, exchange)
    return DecodeConfig(new_tokens, float(spread), stop_token, tuple(runs), captured, parse_buckets(buckets),
                        bool(guard), int(calibration_rounds), candidates, exchange, bool(length_buckets), stop_file)


def _checkpoint_settings(job: JobConfig, vocab: int, asked_stop: bool) -> GenerationSettings:
    """The checkpoint's position limit and, unless ``--stop-token`` was given (it wins), its stop token (none for
    another model); a `ConfigError` naming the file and the value for one it cannot honour."""
    if job.checkpoint is None:
        return GenerationSettings()
    try:
        return generation_settings(job.checkpoint, vocab, read_eos=not asked_stop)
    except CheckpointError as exc:
        hint = "; choose one with --stop-token" if "eos_token_id" in str(exc) else ""
        raise ConfigError(f"{exc}{hint}") from None


def _check_positions(job: JobConfig, new_tokens: int, settings: GenerationSettings) -> None:
    """A `ConfigError` with the numbers where the longest prompt and its new tokens pass the checkpoint's
    ``max_position_embeddings`` (`check_positions`)."""
    if settings.max_positions is not None:
        check_positions(job.seq_lens, new_tokens, settings.max_positions, settings.positions_file)


def prefill_modes(mode: Sequence[str], decode_modes: Sequence[str]) -> List[str]:
    """Generation's prefill modes: ``mode`` (``--mode``'s names) where given; else all (serial, shared, two-batch)
    with decode steps in the same modes, or, where ``--decode-mode`` names the decode modes, serial alone: the runs
    then compare those decode modes after one prefill (``--decode-mode auto``: serial, and serial / auto)."""
    if mode:
        return list(mode)
    return ["serial"] if decode_modes else ["all"]


def check_generation_options(exec_path: str, kv_offload: bool, kv_store: str, split_margin: Optional[float]) -> None:
    """Prefill's options that generation takes where they apply: ``--path`` (``exec_path``: its prefill's path, the
    device's eager streams), ``--kv-store`` (the store of ``--kv-offload``'s host cache: memory); a `ConfigError`
    saying why for a value that does not apply (a graph path, mmap files) and for ``--auto-split-margin``
    (``split_margin``: None where not given), whose ``--mode auto`` generation does not run."""
    if exec_path != "auto" and overlap.backends.get(exec_path).is_graph:
        raise ConfigError(f"--path {exec_path} compiles a prefill job's modes as one graph each; generation prefills "
                          f"its KV cache on the eager path: leave --path out (or --path npu) and capture the decode "
                          f"steps with --decode-graph {exec_path}")
    if kv_store != "memory":
        where = "" if kv_offload else " (and without --kv-offload the cache stays on the device)"
        raise ConfigError(f"--kv-store {kv_store} keeps a prefill job's offloaded keys and values in files; "
                          f"generation's host cache (--kv-offload) is in host memory{where}: leave --kv-store out")
    if split_margin is not None:
        raise ConfigError("--auto-split-margin sets what a split must gain under prefill's --mode auto, which "
                          "generation does not run (its prefill runs the --mode named): --decode-mode auto chooses "
                          "each decode step's mode")


def captured_path(job: JobConfig, graph: str) -> Optional[str]:
    """``--decode-graph``: the path decode steps are captured on per bucket (None: eager steps). ``auto`` captures
    on CUDA where the run can (the device cache, the reference model: an eager step there is bound by its
    launches, 6-10 times a captured one on an H200) and runs eager steps elsewhere. A path named that cannot
    capture here (no such device, the run on another one, its compiler missing: `launch.engine.capture_problem`) is
    a `ConfigError`, before any rank joins."""
    if graph == "auto":
        return "cuda" if job.device == "cuda" and not job.kv_offload and not job.transformers else None
    captured = None if graph == "off" else graph
    if captured is not None and job.kv_offload:
        raise ConfigError("--decode-graph captures steps over the device cache: drop --kv-offload")
    if captured is not None:
        from launch.engine import capture_problem

        problem = capture_problem(captured, job.device)
        if problem is not None:
            raise ConfigError(f"--decode-graph {captured}: {problem}")
    return captured


def check_exchange(job: JobConfig, exchange: str) -> None:
    """``--decode-exchange``: MC2 runs torch_npu's fused operators, on Ascend, over bf16 / fp16 tokens."""
    if exchange not in DECODE_EXCHANGES:
        raise ConfigError(f"--decode-exchange must be one of {', '.join(DECODE_EXCHANGES)}, got {exchange!r}")
    if exchange == "mc2" and job.device != "npu":
        raise ConfigError(f"--decode-exchange mc2 runs torch_npu's fused MC2 operators on Ascend (--device npu), "
                          f"not on {job.device}: use capacity, or auto (MC2 where it runs)")
    if exchange == "mc2" and job.dtype not in (torch.bfloat16, torch.float16):
        raise ConfigError(f"--decode-exchange mc2 takes bfloat16 or float16 tokens, not "
                          f"{str(job.dtype).replace('torch.', '')}: pass --dtype bfloat16")
    if exchange == "mc2" and job.dispatch_dtype == "fp8":
        raise ConfigError("--decode-exchange mc2 quantizes tokens to int8 only (its quant_mode=2), not fp8: pass "
                          "--dispatch-dtype int8, or --decode-exchange capacity for fp8")


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
    if sizes[-1] > MAX_COUNT:
        raise ConfigError(f"--decode-buckets sizes must be at most {MAX_COUNT} (a bucket is a step's tokens per "
                          f"rank), got {sizes[-1]}")
    return sizes
