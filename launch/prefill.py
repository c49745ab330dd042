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
in `launch.measure`, the prefill itself in `launch.runner`, the planner of ``--mode auto`` in
`microbatch.planning` and the files written in `launch.outputs`.
"""
from __future__ import annotations

import atexit
import os
import sys

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import functools
import signal
import tempfile
import time
import traceback
from types import FrameType
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple, Union

import click
import torch
import torch.distributed as dist

import microbatch
from launch.config import AUTO, DTYPES, JobConfig, ModeList, job_config

if TYPE_CHECKING:  # the launcher's parts are imported where the job needs them (a bad option fails first)
    from launch.measure import ModeResult
    from microbatch import Batch, MoEModel
    from microbatch.planning import Choice
    from overlap import OffloadCache

OwnForward = Union[torch.Tensor, str, None]  # the model's own forward for --check, why there is none, or no check


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def say(msg: str, err: bool = False) -> None:
    """Print on rank 0 only."""
    if _rank() == 0:
        click.echo(msg, err=err)


def _progress(msg: str, first: bool = False) -> None:
    """Progress on rank 0: a line rewritten in place on a terminal, one line per mode in a log."""
    if _rank() != 0:
        return
    if sys.stderr.isatty():
        sys.stderr.write("\r" + msg.ljust(60) + ("\r" if not msg else ""))
        sys.stderr.flush()
    elif first:
        click.echo(f"running {msg}", err=True)


@click.command("prefill", context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--model", "model_name", default="reference", metavar="reference|NAME|PATH",
              help="The toolkit's reference decoder, a transformers MoE model type built small from its config with "
                   "weights from --seed (qwen3_moe, deepseek_v3, mixtral, ...), or a local checkpoint folder "
                   "(config.json + safetensors: each rank reads only its experts).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "npu"]), default="auto",
              help="Where to run; auto picks npu, then cuda, then cpu.")
@click.option("--path", "exec_path", type=click.Choice(["auto", "npu", "ge", "aclgraph"]), default="auto",
              help="NPU execution path (auto: eager streams on the device found).")
@click.option("--mode", type=ModeList(), multiple=True, default=["all"],
              help="Schedules to run, comma-separated, of " + ", ".join(list(microbatch.MODES) + ["all", "auto"])
                   + ": all = serial, shared, two-batch; auto = the planner's choice for this batch (calibrated, "
                   "cached), measured beside serial. Given more than once, the lists add up. With --check, serial "
                   "runs too, as the reference.")
@click.option("--kv-offload/--no-kv-offload", default=False, help="Offload each layer's K/V on the copy stream.")
@click.option("--kv-store", type=click.Choice(["memory", "mmap"]), default="memory",
              help="Host tier of the KV offload (mmap: files under --out, or a temporary folder).")
@click.option("--preset", "preset_name", type=click.Choice(["tiny", "small", "deepseek-v3"]), default="small",
              help="Model shapes (deepseek-v3: use with --layers on devices).")
@click.option("--layers", type=int, help="Override: number of decoder layers.")
@click.option("--dense-layers", type=int, help="Override: leading layers with a dense MLP instead of MoE.")
@click.option("--hidden", type=int, help="Override: hidden size.")
@click.option("--experts", type=int, help="Override: routed experts (a multiple of the number of ranks).")
@click.option("--top-k", type=int, help="Override: experts per token.")
@click.option("--shared-experts", type=int, help="Override: shared experts (0: none).")
@click.option("--batch", type=int, default=8, help="Requests per rank (with --seq-len).")
@click.option("--seq-len", type=int, default=128, help="Tokens per request.")
@click.option("--seq-lens", help="Explicit comma-separated request lengths per rank; overrides --batch/--seq-len.")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="float32")
@click.option("--warmup", type=int, default=1, help="Untimed iterations per mode.")
@click.option("--iters", type=int, default=5,
              help="Timed iterations (rounds) per mode: the table shows their medians and spread.")
@click.option("--seed", type=int, default=0, help="Seed of the weights and the token ids.")
@click.option("--check", is_flag=True,
              help="Compare every mode with serial (added to the modes if they leave it out), and serial with the "
                   "model's own forward where each rank holds the whole model; exit 1 if one differs.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Write results.json, traces and timelines.")
@click.option("--cpu-link", default="0.1", envvar="OVERLAP_CPU_LINK", show_envvar=True,
              help="CPU only: simulated interconnect 'GBPS[,LATENCY_US]' that collectives take at least as long "
                   "as (a sleep, so it overlaps like a real network); 'off' for plain loopback gloo.")
@click.option("--cpu-comm-priority", type=click.Choice(["off", "rt"]), default="off",
              envvar="OVERLAP_CPU_COMM_PRIORITY", show_envvar=True,
              help="CPU only: 'rt' runs gloo's communication threads real-time (SCHED_FIFO, where permitted), as a "
                   "device's comm engine that never waits for compute: faster on a host the job has to itself, "
                   "slower beside another such job; 'off' leaves them normal.")
@click.option("--dispatch", type=click.Choice(["two-step", "one-step"]), default="two-step",
              help="The MoE layers' dispatch: its count exchange issued with the routing and read only where the "
                   "tokens go (the schedules issue the other micro-batches' work in between), or both at once.")
@click.option("--timeout", type=float, default=120.0, help="Seconds a rank waits for its peers before giving up.")
def cli(mode: Tuple[Tuple[str, ...], ...], layers: Optional[int], dense_layers: Optional[int],
        hidden: Optional[int], experts: Optional[int], top_k: Optional[int], shared_experts: Optional[int],
        **options: Any) -> None:  # Any: click's values of every other option, each of its own type
    """Prefill of a MoE model (the toolkit's reference decoder, a transformers model type, or a checkpoint
    folder) with expert parallelism over all ranks, in each mode, compared side by side."""
    overrides = dict(n_layers=layers, n_dense_layers=dense_layers, hidden=hidden, n_experts=experts, top_k=top_k,
                     n_shared=shared_experts)
    job = job_config(world=int(os.environ.get("WORLD_SIZE", "1")), overrides=overrides,
                     mode=[name for names in mode for name in names], **options)  # every --mode, in order
    sys.exit(run_job(job))


def main(args: Optional[List[str]] = None, prog_name: str = "launch/prefill.py") -> None:
    """The command: a bad option or configuration is printed once per node, before any rank joins a
    group; Ctrl-C and torchrun's SIGTERM end the run through its clean-up (exit 130 / 143)."""
    signal.signal(signal.SIGTERM, _terminated)
    try:
        cli.main(args=args, prog_name=prog_name, standalone_mode=False)
    except click.ClickException as exc:  # ConfigError and click's usage errors
        _leaving()  # the other ranks fail too, and torchrun's SIGTERM must not cut the one report short
        if _first_to_report_on_this_node():
            exc.show()
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, click.exceptions.Abort):
        click.echo(f"rank {_rank()}: interrupted", err=True)
        sys.exit(130)


def script(prog_name: str = "overlap-prefill") -> None:
    """`main` as a process's whole life (``overlap-prefill``, the console script; ``python
    launch/prefill.py``): once the job is done, its outputs written and the atexit handlers run, the
    process leaves with the job's status without the interpreter's teardown. Gloo's threads sometimes
    abort that teardown on CPU ("terminate called without an active exception", SIGABRT) after a run
    that succeeded, which torchrun then reports as a failed job. ``prog_name`` is the command the
    usage and error messages show."""
    try:
        main(prog_name=prog_name)
        code = 0
    except SystemExit as exc:
        code = exc.code
    _leaving()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _terminated(signum: int, frame: Optional[FrameType]) -> None:
    raise SystemExit(128 + signum)


def _leaving() -> None:
    """From here the process is on its way out with a status of its own: torchrun's SIGTERM (sent when
    another rank exits first) is let pass instead of raising inside an atexit handler or the error
    report, which printed a traceback and could lose the report. Ctrl-C still interrupts; torchrun
    follows with SIGKILL if the exit does not come."""
    signal.signal(signal.SIGTERM, _ignored)


def _ignored(signum: int, frame: Optional[FrameType]) -> None:
    pass


def _first_to_report_on_this_node() -> bool:
    """True on the first rank of this node to ask: a configuration error is printed once, by whichever
    rank finds it first (there is no process group yet, and torchrun stops the other ranks as soon as
    one exits). The ranks of a node share their parent (torchrun's agent) and the job's port."""
    if "LOCAL_RANK" not in os.environ:
        return True
    folder = os.path.join(tempfile.gettempdir(), "overlap-config-errors")
    try:
        started = open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[19]  # the parent's start
    except (OSError, IndexError):
        started = "0"
    marker = os.path.join(folder, f"{os.getppid()}-{started}-{os.environ.get('MASTER_PORT', '')}")
    try:
        os.makedirs(folder, exist_ok=True)
        for old in os.listdir(folder):  # markers of jobs long gone
            if time.time() - os.path.getmtime(os.path.join(folder, old)) > 3600:
                os.remove(os.path.join(folder, old))
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:  # no writable temporary folder: rank 0 speaks
        return _rank() == 0
    return True


def run_job(job: JobConfig) -> int:
    """Join the group, agree on the job, build the model and batch, measure every mode, check, print
    and write; the exit status (0 fine, 1 a failure or a wrong answer, 2 a job the ranks cannot run)."""
    import overlap
    from launch.agreement import JobMismatch, agree, agree_ready
    from launch.health import BEFORE_JOINING, Fault, Peers, StartError, is_peer_failure, join_group
    from launch.measure import check_against_serial, measure_modes, not_finite, table
    from launch.memory import check as check_memory
    from microbatch.batch import Batch
    from microbatch.planning import max_over_ranks
    from launch.outputs import OutputError, check_kv_dir, check_out_dir, write_outputs
    from launch.runner import graph_prefill, make_capacity_expert_parallel, make_expert_parallel
    from overlap.link import OFF

    overlap.set_path(job.device)
    overlap.set_link(job.link or OFF)  # --cpu-link off is off, whatever $OVERLAP_CPU_LINK says
    overlap.set_comm_priority(job.comm_priority)
    overlap.set_wait_timeout(job.timeout)  # every wait of the toolkit, as the collectives' own timeout
    overlap.sanitize_from_env()
    fault = Fault.from_env()
    if fault is not None:
        fault.maybe_fail(_rank(), BEFORE_JOINING)
    try:
        dev = join_group(job.timeout)
    except StartError as exc:
        click.echo(f"rank {_rank()}: {exc}", err=True)
        return 1
    peers = Peers()
    rank, world = dist.get_rank(), dist.get_world_size()
    cache = None
    try:
        # before the first collective: every rank runs the same job, and each can
        problems = [p for p in (check_memory(job, world, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), dev),
                                check_out_dir(job.out_dir) if job.out_dir and rank == 0 else None,
                                check_kv_dir(_kv_dir(job), rank) if _kv_dir(job) else None) if p]
        tokens = sum(agree(job, sum(job.seq_lens), problems, job.timeout))
        model = _build_model(job, rank, world, dev)  # a rank that cannot load a checkpoint stops every rank
        batch = Batch.random(job.seq_lens, model.cfg.vocab, seed=job.seed * 1000 + rank + 1, device=dev)
        if fault is not None:
            fault.poison(rank, model)
        own = _own_forward(job, model, batch, world)  # before the MoE blocks become expert-parallel
        compile_mode = None
        if job.graph:  # static shapes: every rank sends each rank `capacity` rows
            capacity = int(max_over_ranks([batch.seq.num_tokens], dist.group.WORLD)[0])
            make_capacity_expert_parallel(model, dist.group.WORLD, capacity)
            compile_mode = functools.partial(graph_prefill, model, batch, path=job.path)
        else:
            make_expert_parallel(model, dist.group.WORLD, two_step_dispatch=job.dispatch == "two-step")
        if job.kv_offload:  # every rank creates its store, then all go on or all stop (exit 2), collective-free
            cache, problem = _offload_cache(job, model, batch, dev, rank)
            agree_ready("creating the KV store", problem, job.timeout)
        say(_headline(job, model, world, cache))
        if job.serial_added:
            say(f"modes: {', '.join(job.modes)} (serial added: the reference of "
                f"{'--check' if job.check else 'auto'})")
        counter = iter(range(1 << 30))

        def before_iter(mode: str, i: int) -> None:
            _progress(f"{mode}: iteration {i + 1}/{job.warmup + job.iters}", first=i == 0)
            if fault is not None:
                fault.maybe_fail(rank, next(counter))
            peers.beat(f"{mode} iteration {i + 1}")

        choice = _plan_auto(job, model, batch) if AUTO in job.modes else None
        results = measure_modes(model, batch, job.modes, dist.group.WORLD, warmup=job.warmup, iters=job.iters,
                          cache=cache, before_iter=before_iter, compile_mode=compile_mode, choice=choice)
        _progress("")
        failed = not_finite(results)  # a wrong answer whatever --check says
        if job.check and not failed:
            failed = check_against_serial(results, job.dtype) + _check_own_forward(job, results, own)
        say(table(results, tokens))
        for r in results:
            if r.mode == AUTO or microbatch.mode(r.mode).micro_batches > 1:
                say(f"{r.mode} split: {r.split}")
        if choice is not None:
            say(_auto_summary(choice, results))
        if job.check or failed:
            say(("check: " if job.check else "") + ("FAILED: " + ", ".join(failed) if failed
                                                      else "every mode matches serial"))
        if cache is not None:
            cache.close()
        overlap.synchronize()  # no launch still in flight on a side stream (and no gloo callback) at teardown
        dist.barrier()
        dist.destroy_process_group()
        if job.out_dir and rank == 0:  # after the last collective: a failure here cannot stall the other ranks
            write_outputs(job.out_dir, job, results, tokens, world, failed, lambda m: say(m, err=True))
            if choice is not None:
                _write_prediction(job.out_dir, choice, model, results)
        return 1 if failed else 0
    except JobMismatch as exc:  # every rank has the same message: the first to get here prints it
        if peers.first_to_report("job"):
            click.echo(f"Error: {exc}", err=True)
        return exc.exit_code
    except OutputError as exc:
        click.echo(f"rank {rank}: {exc.strerror}", err=True)
        return 1
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        peer_failure = world > 1 and is_peer_failure(exc)
        detail = peers.diagnose() if peer_failure else ""
        peers.failed(msg)
        click.echo(f"rank {rank}: {msg}" + (f"\nrank {rank}: {detail}" if detail else ""), err=True)
        if not (peer_failure or isinstance(exc, overlap.WaitTimeout)):  # a bug: show where it came from, once
            if peers.first_to_report():
                click.echo(f"rank {rank}: unexpected error; traceback (please include it in a report):\n"
                           + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip(),
                           err=True)
            else:
                click.echo(f"rank {rank}: (another rank printed the traceback of the first unexpected error)",
                           err=True)
        return 1
    except SystemExit as exc:  # torchrun's SIGTERM, sent when another rank exited first: say why, if it said
        if world > 1 and exc.code == 128 + signal.SIGTERM:
            _leaving()
            detail = peers.diagnose()
            if " failed: " in detail:
                click.echo(f"rank {rank}: stopped by torchrun after another rank's failure: {detail}", err=True)
        raise
    finally:
        if cache is not None:
            cache.close()  # on every way out: its files and device slots go


def _build_model(job: JobConfig, rank: int, world: int, dev: torch.device) -> MoEModel:
    """The job's model on ``dev``: the reference decoder, a small transformers model, or a checkpoint's."""
    if not job.transformers:
        from launch.models.reference import build_model

        return build_model(job.model, seed=job.seed, dtype=job.dtype, device=dev)
    from launch.models.transformers_adapter import adapt, from_config

    if job.checkpoint is None:
        return from_config(job.model, seed=job.seed, dtype=job.dtype, device=dev)
    from launch.agreement import agree_ready
    from launch.models.checkpoint import CheckpointError, load_checkpoint

    try:
        hf, report = load_checkpoint(job.checkpoint, rank=rank, world=world, dtype=job.dtype, device=dev)
        problem = None
    except CheckpointError as exc:  # what this rank found in its part (a missing expert...): exit 2 on every rank
        problem = str(exc).splitlines()[0]
    agree_ready("loading the checkpoint", problem, job.timeout)  # the store only: no rank is left in a collective
    held = torch.tensor([report.bytes_held, report.bytes_read], dtype=torch.float64)
    every = [torch.zeros_like(held) for _ in range(world)]
    dist.all_gather(every, held)  # every rank reaches this point: it is after the job agreement
    say("weights: " + ", ".join(f"rank {r} holds {_mib(h[0])} (read {_mib(h[1])})" for r, h in enumerate(every))
        + f" of a {_mib(report.checkpoint_bytes)} checkpoint")
    if report.skipped:  # what the checkpoint holds that no rank reads, by design: said, never silently
        say("weights: not read, by design: " + "; ".join(report.skipped))
    # with several ranks its blocks hold only this rank's experts: no forward of the whole model to check
    return adapt(hf, check=_holds_whole_model(job, world))


def _mib(n: Union[float, torch.Tensor]) -> str:
    return f"{float(n) / 2**20:.1f} MiB"


def _holds_whole_model(job: JobConfig, world: int) -> bool:
    """Whether each rank holds the whole transformers model: one built from ``--model NAME`` always, a
    checkpoint's only on one rank (each of several ranks reads its own experts only)."""
    return job.transformers and (job.checkpoint is None or world == 1)


def _own_forward(job: JobConfig, model: MoEModel, batch: Batch, world: int) -> OwnForward:
    """For ``--check`` on a transformers model: the model's own forward of this rank's batch, or why not."""
    from launch.models.transformers_adapter import TransformersModel

    if not (job.check and isinstance(model, TransformersModel)):
        return None
    if not _holds_whole_model(job, world):
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


def _plan_auto(job: JobConfig, model: MoEModel, batch: Batch) -> Choice:
    """``--mode auto``: calibrate (cached per machine, model and dtype) and choose; the same on every rank."""
    from microbatch.forward import cut_refusal
    from microbatch.planning import calibrate, choose, gather_lens, request_length

    all_lens = gather_lens(batch.seq.seq_lens, dist.group.WORLD)
    cal = calibrate(model, dist.group.WORLD, max_tokens=max(sum(lens) for lens in all_lens),
                    seq_len=request_length(all_lens),  # attention's cost follows the requests' length
                    report=lambda msg: say(msg, err=True))
    choice = choose(cal, model, all_lens, allow_cut=cut_refusal(model) is None)
    say(choice.format())
    return choice


def _auto_summary(choice: Choice, results: Sequence[ModeResult]) -> str:
    by = {r.mode: r for r in results}
    auto, serial = by[AUTO], by.get("serial")
    measured = f"measured {auto.median_s * 1e3:.1f} ms"
    if serial is not None:
        measured += f", {serial.median_s / auto.median_s:.2f}x serial's measured {serial.median_s * 1e3:.1f} ms"
    return (f"auto: {choice.best.describe()}: predicted {choice.best.predicted_s * 1e3:.1f} ms, "
            f"{choice.speedup:.2f}x | {measured}")


def _write_prediction(out_dir: str, choice: Choice, model: MoEModel, results: Sequence[ModeResult]) -> None:
    """The chosen schedule's predicted timeline of rank 0's batch, beside its measured trace
    (compare them with ``overlap-report trace_auto.json --plan trace_auto.predicted.json``)."""
    plan = next(r.plan for r in results if r.mode == AUTO and r.plan is not None)
    choice.predict(model, plan).save_chrome_trace(os.path.join(out_dir, "trace_auto.predicted.json"))
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

    cfg = model.cfg
    name = f"{job.model_name} " if job.transformers else ""
    layers = f"{cfg.n_layers} layers ({cfg.n_dense_layers} dense, {cfg.n_layers - cfg.n_dense_layers} MoE)"
    return (f"prefill: {name}{layers}, hidden {cfg.hidden}, {cfg.n_experts} experts top-{cfg.top_k}, "
            f"{cfg.n_shared} shared | {world} rank(s) on {job.device} | {len(job.seq_lens)} requests / "
            f"{sum(job.seq_lens)} tokens per rank | {str(job.dtype).replace('torch.', '')} | kv offload "
            f"{'on (' + job.kv_store + ')' if cache else 'off'}" + (f" | simulated link {job.link}" if job.link else "")
            + (f" | comm threads {overlap.describe_comm_priority()}" if job.device == "cpu" else "")
            + (f" | {job.path} graph" if job.graph else "")
            + ("" if overlap.is_enabled() else f" | overlap off (${overlap.ENV_ENABLE}): every mode single-stream"))


if __name__ == "__main__":
    script("python -m launch.prefill" if __package__ else "launch/prefill.py")
