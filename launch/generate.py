"""Greedy generation of a MoE model with expert parallelism over all ranks, in each mode, side by side.

    torchrun --nproc-per-node 2 launch/generate.py                   # 2 CPU ranks: serial, shared, two-batch
    torchrun --nproc-per-node 2 launch/generate.py --new-tokens 64 --new-tokens-spread 0.5 --check
    python launch/generate.py --model qwen3_moe --check               # one rank: also against its own generate()

Each rank brings its own prompts (``--batch`` x ``--seq-len``, or ``--seq-lens``), prefills them in
the run's ``--mode``, then runs greedy decode steps (the argmax of the LM head, one token per active
request per step) in its ``--decode-mode`` until every request on every rank is done (``--new-tokens``,
each request's own count with ``--new-tokens-spread``, or ``--stop-token``). A rank whose requests are
done keeps taking part in every exchange with zero tokens. The keys and values live in a cache on
the device (`microbatch.KVCache`), or on the host with ``--kv-offload``, the next layer's prefetched
on the ``kv_offload`` stream while this one computes.

Rank 0 prints one row per mode: time to first token, time per output token (median and p90 over
the decode steps), output tokens per second, speedup over serial and the hidden share of
communication during decode. ``--check`` compares every mode's tokens with serial's, and serial's
with the model's own ``generate`` where one rank holds the whole model. ``--out DIR`` writes
results.json and per mode a Chrome trace and PNG timeline of one decode step. Installed, the same
command is ``overlap-generate``.

The job's life is `launch.job` (shared with `launch.prefill`), the configuration checks `launch.config`,
the generation `launch.engine`, its measurement `launch.measure.generate`.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import functools
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import click
import torch
import torch.distributed as dist

import microbatch
from launch.build import build_model, holds_whole_model, no_own_check, quantize_job_model
from launch.config import (DECODE_AUTO_MODES, DECODE_CALIBRATION_ROUNDS, DECODE_EXCHANGES, DECODE_MODE_NAMES,
                           DecodeConfig, JobConfig, ModeList, check_generation_options, decode_config,
                           dry_run_config, job_config, prefill_modes)
from launch.job import (CalibrationSource, calibration_note, main as job_main, progress, say, script as job_script,
                        threads)
from launch.options import (batch_options, dry_run_options, model_options, refresh_option, run_options,
                            timing_options)

if TYPE_CHECKING:  # the launcher's parts are imported where the job needs them (a bad option fails first)
    from launch.build import QuantizedWeights
    from launch.engine import Decoders
    from launch.health import Fault, Peers
    from launch.measure import Run, RunResult
    from launch.models.quantized.check import QuantizedCheck
    from microbatch import Batch, DecodeModel, KVCache
    from microbatch.planning import DecodeCalibration

OwnTokens = Union[List[List[int]], str, None]  # the model's own generate() for --check, why there is none, or no check


@click.command("generate", context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@model_options
@click.option("--mode", type=ModeList(), multiple=True, show_default=False,
              help="Prefill schedules, comma-separated, of " + ", ".join(list(microbatch.MODES) + ["all"])
                   + ": all = serial, shared, two-batch. Given more than once, the lists add up. Default: all; "
                     "serial where --decode-mode is given, so that the runs compare its decode modes after one "
                     "prefill (--decode-mode auto: serial, and serial / auto).")
@click.option("--decode-mode", type=ModeList(DECODE_MODE_NAMES), multiple=True,
              help="Decode schedules, comma-separated (default: the same as --mode): as many as --mode names, "
                   "paired in order, or one for every --mode (or one --mode for every decode mode); besides the "
                   "prefill modes, chunked-2, chunked-3 and chunked-4 (one batch, its MoE in K chunks), and auto: "
                   "each step's fastest predicted mode from a decode calibration made first, run beside serial.")
@click.option("--path", "exec_path", type=click.Choice(["auto", "npu", "ge", "aclgraph"]), default="auto",
              help="The prefill's NPU execution path: auto or npu, the eager streams (generation prefills its KV "
                   "cache eagerly; ge and aclgraph are refused: --decode-graph captures the decode steps).")
@click.option("--auto-split-margin", type=float, default=None, show_default=False,
              help="Prefill's --mode auto only, which generation does not run: refused (--decode-mode auto chooses "
                   "each decode step's mode).")
@click.option("--new-tokens", type=int, default=16, help="New tokens per request (the most, with a spread).")
@click.option("--new-tokens-spread", type=float, default=0.0,
              help="Each request's new tokens drawn from [ceil(N*(1-F)), N] with the seed, differently on each rank.")
@click.option("--stop-token", type=int, help="A token id that ends a request (it is kept); default: a checkpoint's "
                                            "eos_token_id (its generation_config.json's, else its config.json's).")
@click.option("--kv-offload/--no-kv-offload", default=False,
              help="Keep the KV cache on the host, the next layer's keys and values prefetched on the copy stream.")
@click.option("--kv-store", type=click.Choice(["memory", "mmap"]), default="memory",
              help="Host tier of --kv-offload's cache: memory (pinned on a device); mmap, prefill's files, is "
                   "refused.")
@click.option("--decode-graph", type=click.Choice(["auto", "off", "cpu", "ge", "aclgraph", "cuda"]), default="auto",
              help="Pad each decode step to its bucket and capture it once per bucket on this path, then replay "
                   "(cpu: the padded static step, eager); off: eager steps; auto: cuda with --device cuda where the "
                   "run can (no --kv-offload, the reference model), else off.")
@click.option("--decode-buckets", type=str, default=None,
              help="The sizes a decode step's micro-batches (their exchange, and a captured step) are padded to, "
                   "comma-separated (default: the powers of two).")
@click.option("--decode-length-buckets/--no-decode-length-buckets", default=False,
              help="With --decode-graph: a captured step attends over the room its requests' histories use (a "
                   "power of two of rows, at least 16, the ranks agreeing), one graph per bucket and length, "
                   "instead of every request's whole room (prompt and new tokens): less read and copied a step, "
                   "more graphs.")
@click.option("--decode-guard/--no-decode-guard", default=True,
              help="With --decode-mode auto: time every step and set aside a mode whose steps measure slower than "
                   "serial's (running serial now and then to compare); off: the calibration's choice alone.")
@refresh_option("--decode-mode auto")
@click.option("--decode-calibration-rounds", type=int, default=DECODE_CALIBRATION_ROUNDS,
              help="With --decode-mode auto: rounds of every candidate mode behind each entry of its calibration "
                   "(4 steps each); more rounds, steadier predictions and a longer calibration (cached).")
@click.option("--decode-auto-modes", type=ModeList(DECODE_MODE_NAMES), default=",".join(DECODE_AUTO_MODES),
              help="With --decode-mode auto: the modes it chooses from, comma-separated (serial is always one); "
                   "fewer modes, a shorter calibration and, with --decode-graph, fewer graphs (one per mode and "
                   "bucket).")
@click.option("--decode-exchange", type=click.Choice(list(DECODE_EXCHANGES)), default="capacity",
              help="What decode steps exchange through: capacity (a static all-to-all of one capacity per bucket), "
                   "mc2 (torch_npu's fused MC2 dispatch / combine, on Ascend) or auto (MC2 where torch_npu has it, "
                   "for buckets up to 256 tokens; capacity elsewhere). Prefill keeps its all-to-all.")
@batch_options(seq_len=64)
@timing_options
@click.option("--check", is_flag=True,
              help="Compare every mode's tokens with serial's (added to the modes if they leave it out), and "
                   "serial's with the model's own generate() where one rank holds the whole model; exit 1 if one "
                   "differs.")
@run_options
@dry_run_options
def cli(mode: Tuple[Tuple[str, ...], ...], decode_mode: Tuple[Tuple[str, ...], ...], auto_split_margin: Optional[float],
        new_tokens: int, new_tokens_spread: float, stop_token: Optional[int], decode_graph: str,
        decode_buckets: Optional[str], decode_length_buckets: bool, decode_guard: bool, decode_calibration_rounds: int,
        decode_auto_modes: Tuple[str, ...], decode_exchange: str, layers: Optional[int], dense_layers: Optional[int],
        hidden: Optional[int], experts: Optional[int], top_k: Optional[int], shared_experts: Optional[int],
        **options: Any) -> None:  # Any: click's values of every other option, each of its own type
    """Greedy generation of a MoE model (the toolkit's reference decoder, a transformers model type, or a
    checkpoint folder) with expert parallelism over all ranks, in each mode, compared side by side."""
    check_generation_options(options["exec_path"], options["kv_offload"], options["kv_store"], auto_split_margin)
    overrides = dict(n_layers=layers, n_dense_layers=dense_layers, hidden=hidden, n_experts=experts, top_k=top_k,
                     n_shared=shared_experts)
    decode_modes = [name for names in decode_mode for name in names]
    dry = dry_run_config(*(options.pop(k) for k in ("dry_run", "nproc_per_node", "nnodes", "device_memory")))
    job = job_config(world=dry.world if dry else int(os.environ.get("WORLD_SIZE", "1")), overrides=overrides,
                     mode=prefill_modes([name for names in mode for name in names], decode_modes),
                     local_world=dry.nproc_per_node if dry else int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                     full_size=dry is not None, **options)
    decode = decode_config(job, new_tokens=new_tokens, spread=new_tokens_spread, stop_token=stop_token,
                           decode_modes=decode_modes, graph=decode_graph,
                           buckets=decode_buckets, guard=decode_guard,
                           calibration_rounds=decode_calibration_rounds, auto_modes=decode_auto_modes,
                           exchange=decode_exchange, length_buckets=decode_length_buckets)
    if dry is not None:
        from launch.memory import dry_run

        sys.exit(dry_run(job, dry, "generate", _kv_cache_bytes(job, decode)))
    sys.exit(run_job(job, decode))


def main(args: Optional[List[str]] = None, prog_name: str = "launch/generate.py") -> None:
    """The command (`launch.job.main`)."""
    job_main(cli, args, prog_name)


def script(prog_name: str = "overlap-generate") -> None:
    """`main` as a process's whole life (`launch.job.script`)."""
    job_script(functools.partial(main, prog_name=prog_name))


def run_job(job: JobConfig, decode: DecodeConfig) -> int:
    """Join the group, agree on the job, build the model and prompts, generate in every mode, check, print and
    write; the exit status (0 fine, 1 a failure or a wrong answer, 2 a job the ranks cannot run)."""
    from launch.job import guarded, start

    started = start(job)
    if started is None:
        return 1
    dev, fault, peers = started
    return guarded(peers, functools.partial(_generate_job, job, decode, dev, fault, peers))


def _generate_job(job: JobConfig, decode: DecodeConfig, dev: torch.device, fault: Optional[Fault],
                  peers: Peers) -> int:
    from launch.agreement import agree, agree_ready
    from launch.engine import make_expert_parallel
    from launch.job import finish
    from launch.measure import spread
    from launch.measure.generate import Run, check, measure_generation, table
    from launch.memory import check as check_memory
    from launch.outputs import check_out_dir, write_generation_outputs
    from microbatch.batch import Batch

    rank, world = dist.get_rank(), dist.get_world_size()
    kv_cache = _kv_cache_bytes(job, decode)
    problems = [p for p in (check_memory(job, world, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), dev, kv_cache),
                            check_out_dir(job.out_dir) if job.out_dir and rank == 0 else None,
                            _exchange_problem(decode, world)) if p]
    sizes = agree(job, {"tokens": sum(job.seq_lens), "requests": len(job.seq_lens),
                        "room": max(job.seq_lens, default=0) + decode.new_tokens}, problems, job.timeout,
                  extra=decode.fingerprint())
    model, weights = build_model(job, rank, world, dev)
    agree_ready("checking that the model decodes", _decode_refusal(model), job.timeout)
    batch = Batch.random(job.seq_lens, model.cfg.vocab, seed=job.seed * 1000 + rank + 1, device=dev)
    cu = batch.seq.cu_seqlens
    prompts = [batch.tokens[cu[i]:cu[i + 1]].tolist() for i in range(len(job.seq_lens))]
    limits = _new_tokens(job, decode, rank)
    if fault is not None:
        fault.poison(rank, model)
    own = no_own_check(job, weights) or _own_tokens(job, model, prompts, limits, decode.stop_token, world)
    make_expert_parallel(model, dist.group.WORLD, two_step_dispatch=job.dispatch == "two-step",
                         decode_exchange=decode.exchange, dispatch_dtype=job.dispatch_dtype)
    weights = weights or quantize_job_model(job, model, world)
    runs = [Run(p, d) for p, d in decode.runs]
    say(_headline(job, decode, model, world, limits) + (f" | {weights.headline()}" if weights else ""))
    make_cache = functools.partial(_new_cache, job, model, prompts, limits)
    job_cache = functools.partial(_new_cache, job, model, prompts, limits, requests=max(r["requests"] for r in sizes),
                                  room=max(r["room"] for r in sizes))  # the job's: auto's calibration is the job's
    decoders = _decoders(job, decode, model, runs, job_cache)
    auto = next((r.label for r in runs if r.decode == microbatch.AUTO), None)
    source = CalibrationSource()
    calibration = _calibrate(job, decode, model, peers, source, decoders.get(auto)) if auto is not None else None
    results = measure_generation(model, prompts, limits, runs, dist.group.WORLD, make_cache,
                                 stop_token=decode.stop_token, warmup=job.warmup, iters=job.iters,
                                 margins=job.check and job.dtype != torch.float32,
                                 progress=functools.partial(_progress, peers, fault,
                                                            MeasuredSteps(job.warmup * len(runs))),
                                 calibration=calibration,
                                 decoders=decoders, buckets=decode.buckets, guard=decode.guard)
    progress("")
    failed: List[str] = []
    notes: List[str] = []
    if job.check:
        failed, notes = check(results, job.dtype, dist.group.WORLD)
        own_failed, own_notes = _check_own_tokens(job, results, own)
        failed, notes = failed + own_failed, notes + own_notes + _unquantized_tokens(job, decode, model, prompts,
                                                                                     limits, results, make_cache)
    quantized = _check_quantized(job, decode, model, batch, prompts, limits, results, weights, dev) \
        if job.check and weights else None
    if quantized is not None:
        failed, notes = failed + quantized.failures(), notes + quantized.lines()
    say(table(results))
    for r in results:
        if r.predicted_tpot_s is not None and r.tpot_s:
            note = calibration_note(f"{r.run.label} (TPOT)", r.predicted_tpot_s, r.tpot_s, spread(r.step_s), source)
            if note is not None:
                say(note)
    if job.check:
        for line in notes:
            say(f"check: {line}")
        say("check: " + ("FAILED: " + "; ".join(failed) if failed else "every mode generates serial's tokens"
                         + (" and serial the dequantized model's" if quantized else "")))
    finish()
    if job.out_dir and rank == 0:  # after the last collective: a failure here cannot stall the other ranks
        write_generation_outputs(job.out_dir, job, decode, results, world, failed, lambda m: say(m, err=True),
                                 quantized=weights.row(quantized) if weights else None)
    return 1 if failed else 0


def _kv_cache_bytes(job: JobConfig, decode: DecodeConfig) -> int:
    """The bytes of the generation's KV caches on each rank (`launch.memory.decode_kv_cache`): one per run kept
    with ``--decode-graph``, with the room a captured step gathers."""
    from launch.memory import decode_kv_cache

    return decode_kv_cache(job, decode.new_tokens, caches=len(decode.runs) if decode.graph else 1,
                           padded=decode.graph is not None)


def _decoders(job: JobConfig, decode: DecodeConfig, model: DecodeModel, runs: Sequence["Run"],
              make_cache: Callable[[], "KVCache"]) -> Dict[str, "Decoders"]:
    """With ``--decode-graph``, a `GraphDecoder` per run (its cache and graphs kept across the rounds), and for an
    auto run one per candidate mode over one cache; what one refuses (a transformers model, say) is one line on
    every rank before any exchange."""
    if decode.graph is None:
        return {}
    from launch.agreement import agree_ready
    from launch.engine import GraphDecoder, graph_decoders

    decoders: Dict[str, "Decoders"] = {}
    problem = None
    try:
        for r in runs:
            cache = make_cache()
            graphs = dict(path=decode.graph, buckets=decode.buckets, length_buckets=decode.length_buckets)
            decoders[r.label] = GraphDecoder(model, cache, r.decode, **graphs) if r.decode != microbatch.AUTO else \
                graph_decoders(model, cache, decode.auto_modes, **graphs)
    except ValueError as err:
        problem = f"--decode-graph {decode.graph}: {err}"
    agree_ready("building the decode graphs", problem, job.timeout)
    return decoders


def _calibrate(job: JobConfig, decode: DecodeConfig, model: DecodeModel, peers: Peers, source: CalibrationSource,
               decoders: Optional["Decoders"] = None) -> "DecodeCalibration":
    """The decode calibration ``--decode-mode auto`` chooses from: every candidate mode's step time at 1 to the
    most requests a rank brings and the shortest and longest histories of any rank (the job's, alike on every rank), cached
    (measured again with ``--refresh-calibration``), its source said through ``source``; with ``--decode-graph``,
    of the captured steps of auto's ``decoders``."""
    from launch.engine import calibrate_decode, calibration_histories
    from microbatch.planning import DEFAULT_CONFIDENCE, DEFAULT_MARGIN

    def heard(line: str) -> None:
        peers.beat(line)
        progress(line, stage=line.split(",")[0])  # a log: a line a round of the calibration

    start = time.perf_counter()
    cal = calibrate_decode(model, max_tokens=len(job.seq_lens),
                           histories=calibration_histories(job.seq_lens, decode.new_tokens),
                           modes=decode.auto_modes, repeats=decode.calibration_rounds, progress=heard,
                           refresh=job.refresh_calibration, report=source,
                           decoders=decoders if isinstance(decoders, dict) else None)
    progress("")
    say(f"{cal.format()}\n(in {time.perf_counter() - start:.1f} s; auto takes serial unless another mode is "
        f"predicted at least {DEFAULT_MARGIN:.0%} faster, and by {DEFAULT_CONFIDENCE:g} standard errors of the two "
        f"entries)")
    return cal


class MeasuredSteps:
    """The decode steps of the measured rounds, numbered from 0 in the order they run (``$OVERLAP_FAULT``'s
    ``iter``): the first ``warmup_generations`` generations (``--warmup`` rounds of one generation per run, as
    `launch.measure.rounds` orders them) and the calibration's steps are not counted."""

    def __init__(self, warmup_generations: int) -> None:
        self.warmup_generations = warmup_generations
        self.generations = 0
        self.counted = 0

    def number(self, generation_starts: bool) -> Optional[int]:
        """This decode step's number (``generation_starts``: its generation's first), None in a warmup round."""
        self.generations += int(generation_starts)
        if self.generations <= self.warmup_generations:
            return None
        self.counted += 1
        return self.counted - 1


def _progress(peers: Peers, fault: Optional[Fault], steps: MeasuredSteps, line: str, round_start: bool,
              first_round: bool) -> None:
    """Every step on a terminal, in a log a line per run and round (its first step); the rank's heartbeat at every
    round's start; at every decode step of the measured rounds, the injected fault's turn (`MeasuredSteps`: before
    `generate` counts the step for the peers' watch, so a rank that hangs here stays a step behind)."""
    step = steps.number(round_start)
    if fault is not None and step is not None:
        fault.maybe_fail(peers.rank, step)
    if round_start:
        peers.beat(line)
    progress(line, stage=line if round_start else None)


def _decode_refusal(model: DecodeModel) -> Optional[str]:
    """Why ``model`` cannot decode (a layer without a key-value cache...), in one line; None when it can."""
    try:
        model.decode_layer_operations()
    except (AttributeError, TypeError, ValueError) as exc:
        return f"{type(model).__name__} cannot decode: {exc}".splitlines()[0]
    return None


def _new_tokens(job: JobConfig, decode: DecodeConfig, rank: int) -> List[int]:
    """Each of this rank's requests' most new tokens: ``--new-tokens``, or drawn with the seed from
    ``[ceil(N * (1 - spread)), N]``, differently on each rank."""
    low, high = decode.min_new_tokens(), decode.new_tokens
    if low == high:
        return [high] * len(job.seq_lens)
    g = torch.Generator().manual_seed(job.seed * 1000 + rank + 1 + (1 << 40))  # not the prompts' stream
    return torch.randint(low, high + 1, (len(job.seq_lens),), generator=g).tolist()


def _new_cache(job: JobConfig, model: DecodeModel, prompts: Sequence[Sequence[int]], limits: Sequence[int],
               requests: int = 0, room: int = 0) -> KVCache:
    """A fresh cache for one generation: on the device, or on the host with ``--kv-offload``; with at least
    ``requests`` slots of ``room`` rows (the job's most over the ranks, for decoders that calibrate the job)."""
    from launch.engine import new_cache

    return new_cache(model, prompts, list(limits), offload=job.kv_offload, requests=requests, room=room)


def _own_tokens(job: JobConfig, model: DecodeModel, prompts: Sequence[Sequence[int]], limits: Sequence[int],
                stop_token: Optional[int], world: int) -> OwnTokens:
    """For ``--check`` on a transformers model: the tokens of the model's own ``generate``, or why there are none."""
    from launch.models import TransformersModel

    if not (job.check and isinstance(model, TransformersModel)):
        return None
    if not holds_whole_model(job, world) or world > 1:
        return (f"each of the {world} ranks holds {model.cfg.n_experts // world} of the {model.cfg.n_experts} routed "
                f"experts per MoE layer once they are spread, so serial is compared with the model's own generate() "
                f"on one rank only (run python launch/generate.py --model {job.model_name} --check)")
    return [model.own_generate([p], n, stop_token)[0] for p, n in zip(prompts, limits)]


def _unquantized_tokens(job: JobConfig, decode: DecodeConfig, model: DecodeModel, prompts: Sequence[Sequence[int]],
                        limits: Sequence[int], results: Sequence["RunResult"], make_cache: Callable[[], "KVCache"]
                        ) -> List[str]:
    """With a quantized dispatch: serial's tokens against a serial generation with the dispatch unquantized (every
    rank runs it), as a note: the share of the same tokens (the worst rank's) and the first token that differs. A
    note, not a failure: greedy tokens part at a near-tie and differ after it (prefill's --check bounds the
    logits)."""
    from collectives import dispatch_dtype_of
    from launch.engine import generate
    from launch.measure.generate import first_difference
    from microbatch.planning import max_over_ranks

    if job.dispatch_dtype is None:
        return []
    layers = [layer.moe for layer in model.moe_layers()]
    for ep in layers:
        ep.dispatch_dtype = None
    try:
        plain = generate(model, prompts, list(limits), stop_token=decode.stop_token, cache=make_cache(),
                         mode="serial", buckets=decode.buckets).tokens
    finally:
        for ep in layers:
            ep.dispatch_dtype = dispatch_dtype_of(job.dispatch_dtype)
    serial = next(r for r in results if r.run.label == "serial").generated.tokens
    total = sum(len(t) for t in plain)
    same = sum(a == b for s, p in zip(serial, plain) for a, b in zip(s, p))
    at = first_difference(serial, plain)
    (worst,) = max_over_ranks([1.0 - same / max(1, total)], dist.group.WORLD)
    where = ("none differs" if at is None
             else f"the first differs at token {at[1]} of request {at[0]} (0: the prefill's)")
    return [f"serial with the {job.dispatch_dtype} dispatch against the unquantized dispatch: {1 - worst:.1%} of "
            f"the tokens the same (the worst rank's); on this rank {where}"]


def _check_own_tokens(job: JobConfig, results: Sequence[RunResult], own: OwnTokens) -> Tuple[List[str], List[str]]:
    """Serial's tokens against the model's own generate(): ``(failures, notes)`` (one rank: no collective)."""
    from launch.measure.generate import first_difference, judge

    if own is None:
        return [], []
    if isinstance(own, str):
        return [], [f"not compared with the model's own generate(): {own}"]
    serial = next(r for r in results if r.run.label == "serial")
    at = first_difference(serial.generated.tokens, own)
    if at is None:
        return [], [f"serial generates {job.model_name}'s own generate(do_sample=False) tokens"]
    req, step = at
    if job.dispatch_dtype is not None:  # own generate() sends no quantized tokens: a difference is no failure
        return [], [f"serial's tokens with the {job.dispatch_dtype} dispatch first differ from {job.model_name}'s own "
                    f"generate() (unquantized) at step {step} of request {req}"]
    margins = serial.generated.margins
    failures: List[str] = []
    notes: List[str] = []
    judge(f"serial's tokens differ from {job.model_name}'s own generate() at step {step} of request {req}", job.dtype,
          margins[req][step] if margins and step < len(margins[req]) else None, failures, notes)
    return failures, notes


def _check_quantized(job: JobConfig, decode: DecodeConfig, model: DecodeModel, batch: Batch,
                     prompts: Sequence[Sequence[int]], limits: Sequence[int], results: Sequence[RunResult],
                     weights: QuantizedWeights, dev: torch.device) -> QuantizedCheck:
    """For ``--check`` of weights kept quantized: serial's prefill logits and tokens against the dequantized
    model's (every rank)."""
    from launch.build import dequantized_model
    from launch.engine import make_expert_parallel
    from launch.measure.quantized import generation_check

    group = dist.group.WORLD
    reference = dequantized_model(job, dist.get_rank(), dist.get_world_size(), dev, functools.partial(
        make_expert_parallel, group=group, two_step_dispatch=job.dispatch == "two-step",
        decode_exchange=decode.exchange, dispatch_dtype=job.dispatch_dtype))
    serial = next(r for r in results if r.run.label == "serial")
    return generation_check(model, reference, batch, prompts, limits, serial.generated.tokens, decode.stop_token,
                            weights.format, job.dtype, group)


def _headline(job: JobConfig, decode: DecodeConfig, model: DecodeModel, world: int, limits: Sequence[int]) -> str:
    import overlap
    from launch.models import family_name

    cfg = model.cfg
    name = f"{family_name(job.model_name)} " if job.transformers else ""  # a wrapper: with its text model
    layers = f"{cfg.n_layers} layers ({cfg.n_dense_layers} dense, {cfg.n_layers - cfg.n_dense_layers} MoE)"
    tokens = (f"{decode.new_tokens} new tokens each" if decode.spread == 0 else
              f"{decode.min_new_tokens()}-{decode.new_tokens} new tokens each (spread {decode.spread:g})")
    return (f"generate: {name}{layers}, hidden {cfg.hidden}, {cfg.n_experts} experts top-{cfg.top_k}, "
            f"{cfg.n_shared} shared | {world} rank(s) on {job.device}, {threads(job)} | {len(job.seq_lens)} "
            f"requests of {_lens(job.seq_lens)} prompt tokens per rank, {tokens}"
            + (f", stop token {decode.stop_token}" if decode.stop_token is not None else "")
            + (f" (from {decode.stop_file})" if decode.stop_file else "")
            + f" | {str(job.dtype).replace('torch.', '')}"
            + f" | kv cache {'host, prefetched' if job.kv_offload else 'device'}"
            + (f" | decode steps captured per bucket{' and length' if decode.length_buckets else ''} on "
               f"{decode.graph}" if decode.graph else "")
            + (f" | buckets {','.join(map(str, decode.buckets))}" if decode.buckets else "")
            + (f" | decode exchange {decode.exchange}" if decode.exchange != "capacity" else "")
            + (f" | dispatch {job.dispatch_dtype} (per-token scales)" if job.dispatch_dtype else "")
            + (f" | simulated link {job.link}" if job.link else "")
            + ("" if overlap.is_enabled() else f" | overlap off (${overlap.ENV_ENABLE}): every mode single-stream"))


def _exchange_problem(decode: DecodeConfig, world: int) -> Optional[str]:
    """Why ``--decode-exchange mc2`` cannot run here (None where it can): MC2 needs torch_npu's fused operators on
    the npu path and at least two ranks."""
    if decode.exchange != "mc2":
        return None
    from collectives.mc2 import mc2_available

    if not mc2_available():
        return ("--decode-exchange mc2 needs torch_npu with npu_moe_distribute_dispatch_v2 / combine_v2 on the npu "
                "path: use capacity, or auto (MC2 where it runs)")
    return None if world > 1 else "--decode-exchange mc2 needs at least 2 ranks (MC2 exchanges between ranks)"


def _lens(lens: Sequence[int]) -> str:
    return str(lens[0]) if len(set(lens)) == 1 else f"{min(lens)}-{max(lens)}"


if __name__ == "__main__":
    script("python -m launch.generate" if __package__ else "launch/generate.py")
