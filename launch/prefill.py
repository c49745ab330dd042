"""Prefill of a MoE model with expert parallelism over all ranks, in each mode, side by side.

    torchrun --nproc-per-node 2 launch/prefill.py                     # 2 CPU ranks, serial, shared, two-batch
    python launch/prefill.py --mode two-batch,three-batch --check      # one rank; serial runs too, as the reference
    torchrun --nproc-per-node 2 launch/prefill.py --model qwen3_moe   # a transformers model type, or a checkpoint

The model is the toolkit's reference decoder, a transformers MoE model type built small, or a
local checkpoint (``--model``). ``--mode`` takes a comma-separated list (given more than once,
the lists add up). Rank 0 prints one row per mode: time per prefill, tokens/s, speedup over
serial, the hidden share of communication and the largest difference from serial. ``--out DIR``
writes the results as JSON, and per mode the merged Chrome trace and PNG timeline of the round
at the median hidden share (the table's figure). Installed, the same command is
``overlap-prefill``.

This file is the command line and the job, top to bottom; the configuration checks are in
`launch.config`, rank health in `launch.health`, the models in `launch.models`, the measurement
in `launch.measure.prefill`, the prefill itself in `launch.engine.prefiller`, the planner of ``--mode auto`` in
`microbatch.planning` and the files written in `launch.outputs`.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import functools
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple, Union

import click
import torch
import torch.distributed as dist

import microbatch
from launch.build import build_model, holds_whole_model, no_own_check, quantize_job_model
from launch.config import JobConfig, ModeList, dry_run_config, job_config
from launch.job import (CalibrationSource, calibration_note, main as job_main, progress, say, script as job_script,
                        threads)
from launch.options import (batch_options, dry_run_options, model_options, refresh_option, run_options,
                            timing_options)

if TYPE_CHECKING:  # the launcher's parts are imported where the job needs them (a bad option fails first)
    from launch.build import QuantizedWeights
    from launch.health import Fault, Peers
    from launch.measure import ModeResult
    from launch.models.quantized.check import QuantizedCheck
    from microbatch import Batch, MoEModel
    from microbatch.planning import Choice
    from overlap import OffloadCache

OwnForward = Union[torch.Tensor, str, None]  # the model's own forward for --check, why there is none, or no check



@click.command("prefill", context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@model_options
@click.option("--path", "exec_path", type=click.Choice(["auto", "npu", "ge", "aclgraph"]), default="auto",
              help="NPU execution path (auto: eager streams on the device found).")
@click.option("--mode", type=ModeList(), multiple=True, default=["all"],
              help="Schedules to run, comma-separated, of " + ", ".join(list(microbatch.MODES) + ["all", "auto"])
                   + ": all = serial, shared, two-batch; auto = the planner's choice for this batch (calibrated, "
                   "cached), measured beside serial. Given more than once, the lists add up. With --check, serial "
                   "runs too, as the reference.")
@click.option("--auto-split-margin", type=float, default=microbatch.planning.SPLIT_MARGIN,
              help="With --mode auto: how much faster than the best single batch a split must be predicted to "
                   "be chosen (a fraction; 0: any gain). The simulation leaves out the ranks' jitter at a split's "
                   "extra exchanges.")
@refresh_option("--mode auto")
@click.option("--kv-offload/--no-kv-offload", default=False, help="Offload each layer's K/V on the copy stream.")
@click.option("--kv-store", type=click.Choice(["memory", "mmap"]), default="memory",
              help="Host tier of the KV offload (mmap: files under --out, or a temporary folder).")
@batch_options(seq_len=128)
@timing_options
@click.option("--check", is_flag=True,
              help="Compare every mode with serial (added to the modes if they leave it out), and serial with the "
                   "model's own forward where each rank holds the whole model; exit 1 if one differs.")
@run_options
@dry_run_options
def cli(mode: Tuple[Tuple[str, ...], ...], layers: Optional[int], dense_layers: Optional[int],
        hidden: Optional[int], experts: Optional[int], top_k: Optional[int], shared_experts: Optional[int],
        **options: Any) -> None:  # Any: click's values of every other option, each of its own type
    """Prefill of a MoE model (the toolkit's reference decoder, a transformers model type, or a checkpoint
    folder) with expert parallelism over all ranks, in each mode, compared side by side."""
    overrides = dict(n_layers=layers, n_dense_layers=dense_layers, hidden=hidden, n_experts=experts, top_k=top_k,
                     n_shared=shared_experts)
    dry = dry_run_config(*(options.pop(k) for k in ("dry_run", "nproc_per_node", "nnodes", "device_memory")))
    job = job_config(world=dry.world if dry else int(os.environ.get("WORLD_SIZE", "1")), overrides=overrides,
                     mode=[name for names in mode for name in names],  # every --mode, in order
                     local_world=dry.nproc_per_node if dry else int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                     full_size=dry is not None, **options)
    if dry is not None:
        from launch.memory import dry_run

        sys.exit(dry_run(job, dry, "prefill"))
    sys.exit(run_job(job))


def main(args: Optional[List[str]] = None, prog_name: str = "launch/prefill.py") -> None:
    """The command (`launch.job.main`): a bad option or configuration is printed once per node, before any rank
    joins a group; Ctrl-C and torchrun's SIGTERM end the run through its clean-up (exit 130 / 143)."""
    job_main(cli, args, prog_name)


def script(prog_name: str = "overlap-prefill") -> None:
    """`main` as a process's whole life (``overlap-prefill``, the console script; ``python
    launch/prefill.py``): it leaves with the job's status without the interpreter's teardown
    (`launch.job.script`). ``prog_name`` is the command the usage and error messages show."""
    job_script(functools.partial(main, prog_name=prog_name))


def run_job(job: JobConfig) -> int:
    """Join the group, agree on the job, build the model and batch, measure every mode, check, print
    and write; the exit status (0 fine, 1 a failure or a wrong answer, 2 a job the ranks cannot run)."""
    from launch.job import guarded, start

    started = start(job)
    if started is None:
        return 1
    dev, fault, peers = started
    return guarded(peers, functools.partial(_prefill_job, job, dev, fault, peers))


def _prefill_job(job: JobConfig, dev: torch.device, fault: Optional[Fault], peers: Peers) -> int:
    """The job once the group is joined (`run_job`): its exit status; what fails is said by `launch.job.guarded`."""
    from launch.agreement import agree, agree_ready
    from launch.job import finish
    from launch.engine import graph_prefill, make_capacity_expert_parallel, make_expert_parallel
    from launch.measure.prefill import (RECORDED, check_against_serial, measure_modes, near_tie_notes, not_finite,
                                        table)
    from launch.memory import check as check_memory
    from microbatch.batch import Batch
    from microbatch.planning import max_over_ranks
    from launch.outputs import check_kv_dir, check_out_dir, write_outputs

    rank, world = dist.get_rank(), dist.get_world_size()
    cache = None
    try:
        # before the first collective: every rank runs the same job, and each can
        problems = [p for p in (check_memory(job, world, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), dev),
                                check_out_dir(job.out_dir) if job.out_dir and rank == 0 else None,
                                check_kv_dir(_kv_dir(job), rank) if _kv_dir(job) else None) if p]
        tokens = sum(r["tokens"] for r in agree(job, {"tokens": sum(job.seq_lens)}, problems, job.timeout))
        model, weights = build_model(job, rank, world, dev)  # a rank that cannot load a checkpoint stops every rank
        batch = Batch.random(job.seq_lens, model.cfg.vocab, seed=job.seed * 1000 + rank + 1, device=dev)
        if fault is not None:
            fault.poison(rank, model)
        own = no_own_check(job, weights) or _own_forward(job, model, batch, world)
        compile_mode = None
        if job.graph:  # static shapes: every rank sends each rank `capacity` rows
            capacity = int(max_over_ranks([batch.seq.num_tokens], dist.group.WORLD)[0])
            make_capacity_expert_parallel(model, dist.group.WORLD, capacity, job.dispatch_dtype)
            compile_mode = functools.partial(graph_prefill, model, batch, path=job.path)
        else:
            make_expert_parallel(model, dist.group.WORLD, two_step_dispatch=job.dispatch == "two-step",
                                 dispatch_dtype=job.dispatch_dtype)
            weights = weights or quantize_job_model(job, model, world)
        if job.kv_offload:  # every rank creates its store, then all go on or all stop (exit 2), collective-free
            cache, problem = _offload_cache(job, model, batch, dev, rank)
            agree_ready("creating the KV store", problem, job.timeout)
        say(_headline(job, model, world, cache) + (f" | {weights.headline()}" if weights else ""))
        if job.serial_added:
            say(f"modes: {', '.join(job.modes)} (serial added: the reference of "
                f"{'--check' if job.check else 'auto'})")
        counter = iter(range(1 << 30))

        def before_iter(mode: str, i: int) -> None:
            progress(f"round {i + 1}/{job.warmup + job.iters + RECORDED} ({_phase(job, i)}): running {mode}",
                     stage=f"round {i + 1}")  # a log: a line a round
            if fault is not None:
                fault.maybe_fail(rank, next(counter))
            peers.beat(f"{mode} iteration {i + 1}")

        source = CalibrationSource()
        choice = _choose_auto(job, model, batch, source) if microbatch.AUTO in job.modes else None
        results = measure_modes(model, batch, job.modes, dist.group.WORLD, warmup=job.warmup, iters=job.iters,
                          cache=cache, before_iter=before_iter, compile_mode=compile_mode, choice=choice)
        progress("")
        failed = not_finite(results)  # a wrong answer whatever --check says
        ties: List[str] = []
        if job.check and not failed:
            failed = (check_against_serial(results, job.dtype) + _check_own_forward(job, results, own)
                      + _check_unquantized(job, model, batch, results))
            ties = near_tie_notes(results, job.dtype)
        quantized = _check_quantized(job, model, batch, weights, rank, world, dev) if job.check and weights else None
        if quantized is not None:
            failed += quantized.failures()
        say(table(results, tokens))
        for line in ties:
            say(line)
        for r in results:
            if r.mode == microbatch.AUTO or microbatch.mode(r.mode).micro_batches > 1:
                say(f"{r.mode} split: {r.split_reason}")
        if choice is not None:
            say(_auto_summary(choice, results))
            auto = next(r for r in results if r.mode == microbatch.AUTO)
            note = calibration_note("auto", choice.best.predicted_s, auto.median_s, auto.spread, source)
            if note is not None:
                say(note)
        for line in quantized.lines() if quantized is not None else []:
            say(f"check: {line}")
        if job.check or failed:
            say(("check: " if job.check else "") + ("FAILED: " + ", ".join(failed) if failed
                                                      else "every mode matches serial"
                                                      + (" and the dequantized model" if quantized else "")))
        if cache is not None:
            cache.close()
        finish()
        if job.out_dir and rank == 0:  # after the last collective: a failure here cannot stall the other ranks
            write_outputs(job.out_dir, job, results, tokens, world, failed, lambda m: say(m, err=True),
                          quantized=weights.row(quantized) if weights else None)
            if choice is not None:
                _write_prediction(job.out_dir, choice, model, results)
        return 1 if failed else 0
    finally:
        if cache is not None:
            cache.close()  # on every way out: its files and device slots go


def _own_forward(job: JobConfig, model: MoEModel, batch: Batch, world: int) -> OwnForward:
    """For ``--check`` on a transformers model: the model's own forward of this rank's batch, or why not."""
    from launch.models import TransformersModel

    if not (job.check and isinstance(model, TransformersModel)):
        return None
    if job.dispatch_dtype is not None:  # the own forward sends nothing quantized: see `_check_unquantized`
        return (f"the dispatch is quantized ({job.dispatch_dtype}); serial is compared with the unquantized dispatch "
                f"instead")
    if not holds_whole_model(job, world):
        experts = model.cfg.n_experts
        return (f"each of the {world} ranks holds {experts // world} of the checkpoint's {experts} routed experts "
                f"per MoE layer, so no rank can run the model's own forward (run on one rank to compare)")
    return model.reference(batch).float()


def _check_own_forward(job: JobConfig, results: Sequence[ModeResult], own: OwnForward) -> List[str]:
    """Serial against the model's own forward (every rank takes part: one all-reduce), as failure lines."""
    from microbatch.planning import max_over_ranks

    if own is None:
        return []
    if isinstance(own, str):
        say(f"check: not compared with the model's own forward: {own}")
        return []
    serial = next(r for r in results if r.mode == "serial")
    diff, scale = max_over_ranks([(serial.output - own).abs().max().item(), own.abs().max().item()],
                                 dist.group.WORLD)
    tol = (1e-4 if job.dtype == torch.float32 else 5e-2) * max(1.0, scale)
    if diff <= tol:
        say(f"check: serial matches {job.model_name}'s own forward (largest difference {diff:.2e})")
        return []
    return [f"serial differs from {job.model_name}'s own forward by {diff:.3e} (tolerance {tol:.1e})"]


def _check_quantized(job: JobConfig, model: MoEModel, batch: Batch, weights: QuantizedWeights, rank: int,
                     world: int, dev: torch.device) -> QuantizedCheck:
    """For ``--check`` of weights kept quantized: serial's logits against the dequantized model's (every rank)."""
    from launch.build import dequantized_model
    from launch.engine import make_expert_parallel
    from launch.measure.quantized import prefill_check

    reference = dequantized_model(job, rank, world, dev, functools.partial(
        make_expert_parallel, group=dist.group.WORLD, two_step_dispatch=job.dispatch == "two-step",
        dispatch_dtype=job.dispatch_dtype))
    return prefill_check(model, reference, batch, weights.format, job.dtype, dist.group.WORLD)


# --check of a quantized dispatch: serial's logits against the same prefill's with the dispatch unquantized. Per
# token, the largest logit difference; 90% of the tokens must be within this share of the largest logit (at least 1):
# per-token int8 rounds each element by at most 1/254 of its token's largest, fp8 e4m3 by 1/16 of itself. The other
# tokens may differ more where the rounding flips a router's near-tie in a later layer (docs/expert-parallel.md).
QUANTIZED_BOUNDS = {"int8": 2e-2, "fp8": 5e-2}
QUANTIZED_QUANTILE = 0.9


def _check_unquantized(job: JobConfig, model: MoEModel, batch: Batch, results: Sequence[ModeResult]) -> List[str]:
    """With a quantized dispatch: serial's logits against serial's with the dispatch unquantized (every rank runs it:
    its exchanges and one all-reduce), the largest difference printed; failure lines beyond `QUANTIZED_BOUNDS`."""
    from collectives import dispatch_dtype_of
    from launch.engine.prefiller import prefill, split_for
    from microbatch.planning import max_over_ranks

    if job.dispatch_dtype is None or job.graph:
        return []
    serial = next(r for r in results if r.mode == "serial")
    layers = [layer.moe for layer in model.moe_layers()]
    for ep in layers:
        ep.dispatch_dtype = None
    try:
        with torch.no_grad():
            plain = prefill(model, batch, "serial", split_for("serial", batch, dist.group.WORLD))
    finally:
        for ep in layers:
            ep.dispatch_dtype = dispatch_dtype_of(job.dispatch_dtype)
    with torch.no_grad():
        want, got = model.logits(plain).float(), model.logits(serial.output.to(plain.dtype)).float()
    per_token = (got - want).abs().amax(-1)
    most = torch.quantile(per_token, QUANTIZED_QUANTILE).item() if per_token.numel() else 0.0
    diff, most, scale = max_over_ranks([per_token.max().item() if per_token.numel() else 0.0, most,
                                        want.abs().max().item() if want.numel() else 0.0], dist.group.WORLD)
    bound = QUANTIZED_BOUNDS[job.dispatch_dtype] * max(1.0, scale)
    share = f"{QUANTIZED_QUANTILE:.0%} of the tokens"
    say(f"check: serial with the {job.dispatch_dtype} dispatch against the unquantized dispatch: largest logit "
        f"difference {diff:.2e}, {share} within {most:.2e} (bound {bound:.1e}, the largest logit {scale:.2e})")
    if most <= bound:
        return []
    return [f"serial with the {job.dispatch_dtype} dispatch differs from the unquantized dispatch by {most:.3e} in "
            f"the logits of {share} (bound {bound:.1e})"]


def _phase(job: JobConfig, i: int) -> str:
    """What round ``i`` (0: the first) of the measurement is for."""
    return "warm-up" if i < job.warmup else "timed" if i < job.warmup + job.iters else "recorded for the trace"


def _choose_auto(job: JobConfig, model: MoEModel, batch: Batch, source: CalibrationSource) -> Choice:
    """``--mode auto``: calibrate (cached per machine, model and dtype; measured again with
    ``--refresh-calibration``), the calibration's source said, and choose; the same on every rank."""
    from microbatch.forward import cut_refusal
    from microbatch.planning import calibrate, choose, gather_lens, request_length

    all_lens = gather_lens(batch.seq.seq_lens, dist.group.WORLD)
    cal = calibrate(model, dist.group.WORLD, max_tokens=max(sum(lens) for lens in all_lens),
                    seq_len=request_length(all_lens),  # attention's cost follows the requests' length
                    refresh=job.refresh_calibration, report=source,
                    progress=lambda line: progress(line, stage=line))  # a log: a line a stage
    progress("")
    choice = choose(cal, model, all_lens, allow_cut=cut_refusal(model) is None, split_margin=job.split_margin)
    say(choice.format())
    return choice


def _auto_summary(choice: Choice, results: Sequence[ModeResult]) -> str:
    from launch.measure import mark

    by = {r.mode: r for r in results}
    auto, serial = by[microbatch.AUTO], by.get("serial")
    measured = f"measured {auto.median_s * 1e3:.1f} ms"
    if serial is not None:  # the speedup as the table's column writes it (=serial, ~ noise, ? one round)
        measured += f" against serial's {serial.median_s * 1e3:.1f} ms ({mark(auto.speedup, auto.judged)})"
    return (f"auto: {choice.best.describe()}: predicted {choice.best.predicted_s * 1e3:.1f} ms, "
            f"{choice.speedup:.2f}x | {measured}")


def _write_prediction(out_dir: str, choice: Choice, model: MoEModel, results: Sequence[ModeResult]) -> None:
    """The chosen schedule's predicted timeline of rank 0's batch, beside its measured trace
    (compare them with ``overlap-report trace_auto.json --plan trace_auto.predicted.json``)."""
    split = next(r.split for r in results if r.mode == microbatch.AUTO and r.split is not None)
    choice.predict(model, split).save_chrome_trace(os.path.join(out_dir, "trace_auto.predicted.json"))
    say(f"wrote {out_dir}/trace_auto.predicted.json (overlap-report {out_dir}/trace_auto.json --plan "
        f"{out_dir}/trace_auto.predicted.json compares them)", err=True)


def _kv_dir(job: JobConfig) -> Optional[str]:
    """The folder of the mmap KV store's files (one per rank): ``--out/kv``, or None (a temporary file)."""
    return os.path.join(job.out_dir, "kv") if job.kv_offload and job.out_dir and job.kv_store == "mmap" else None


def _offload_cache(job: JobConfig, model: MoEModel, batch: Batch, dev: torch.device,
                   rank: int) -> Tuple[Optional[OffloadCache], Optional[str]]:
    """The KV offload cache of ``--kv-offload`` (mmap files under ``--out/kv`` when there is one), or None and
    why it cannot be made (a full disk, a file someone else holds: `OffloadError`'s line)."""
    from overlap import OffloadCache, OffloadError

    folder = _kv_dir(job)  # checked before the first collective (launch.outputs.check_kv_dir)
    cfg = model.cfg
    try:
        if folder is not None:
            stale = os.path.join(folder, f"kv-rank{rank}.kv")  # a scratch tier: start empty
            if os.path.isfile(stale):
                os.remove(stale)
        cache = OffloadCache(cfg.n_layers, batch.seq.num_tokens, cfg.k_shape, job.dtype, dev, v_shape=cfg.v_shape,
                             store=job.kv_store, file=folder, name="kv")
    except (OffloadError, OSError) as exc:
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0]
    try:
        cache.check_capacity(batch.seq.num_tokens)
    except OffloadError as exc:
        cache.close()
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0]
    return cache, None


def _headline(job: JobConfig, model: MoEModel, world: int, cache: Optional[OffloadCache]) -> str:
    import overlap
    from launch.models import family_name

    cfg = model.cfg
    name = f"{family_name(job.model_name)} " if job.transformers else ""  # a wrapper: with its text model
    layers = f"{cfg.n_layers} layers ({cfg.n_dense_layers} dense, {cfg.n_layers - cfg.n_dense_layers} MoE)"
    return (f"prefill: {name}{layers}, hidden {cfg.hidden}, {cfg.n_experts} experts top-{cfg.top_k}, "
            f"{cfg.n_shared} shared | {world} rank(s) on {job.device}, {threads(job)} | {len(job.seq_lens)} "
            f"requests / {sum(job.seq_lens)} tokens per rank | {str(job.dtype).replace('torch.', '')} | kv offload "
            f"{'on (' + job.kv_store + ')' if cache else 'off'}" + (f" | simulated link {job.link}" if job.link else "")
            + (f" | comm threads {overlap.describe_comm_priority()}" if job.device == "cpu" else "")
            + (f" | {job.path} graph" if job.graph else "")
            + (f" | dispatch {job.dispatch_dtype} (per-token scales)" if job.dispatch_dtype else "")
            + ("" if overlap.is_enabled() else f" | overlap off (${overlap.ENV_ENABLE}): every mode single-stream"))


if __name__ == "__main__":
    script("python -m launch.prefill" if __package__ else "launch/prefill.py")
