"""Prefill of the reference MoE model with expert parallelism over all ranks.

    torchrun --nproc-per-node 2 launch/prefill.py            # 2 CPU ranks, every mode
    python launch/prefill.py --mode two-batch --check         # one rank

Rank 0 prints one row per mode: time per prefill, tokens/s, speedup over serial, the hidden
share of communication and the largest difference from serial. ``--out DIR`` writes the results
as JSON, and per mode the merged Chrome trace and PNG timeline of the last iteration.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dataclasses
import datetime
import functools
import json
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import click
import torch
import torch.distributed as dist

from launch.runner import MODES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(click.ClickException):
    """An invalid configuration: reported once, by rank 0, before any collective."""

    exit_code = 2


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def say(msg: str, err: bool = False) -> None:
    """Print on rank 0 only."""
    if _rank() == 0:
        click.echo(msg, err=err)


def _parse_seq_lens(text: Optional[str], batch: int, seq_len: int) -> List[int]:
    if text:
        try:
            lens = [int(x) for x in text.replace(" ", "").split(",") if x]
        except ValueError:
            raise ConfigError(f"--seq-lens must be comma-separated integers, got {text!r}") from None
    else:
        lens = [seq_len] * batch
    if not lens or any(n < 1 for n in lens):
        raise ConfigError(f"every request needs at least one token; got seq lens {lens}")
    return lens


def _resolve_device(device: str, path: Optional[str]) -> str:
    from overlap.paths import detect_path

    found = detect_path()  # npu if torch_npu sees one, else cuda, else cpu
    if device == "auto":
        device = found
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available on this machine")
    if device == "npu" and found != "npu":
        raise ConfigError("--device npu: torch_npu with an available NPU is required (install torch_npu "
                          "matching your torch and CANN)")
    if path in ("npu", "ge", "aclgraph") and device != "npu":
        raise ConfigError(f"--path {path} runs on Ascend NPUs only; this run's device is {device}")
    return device


def _fault() -> Optional[Dict[str, Any]]:
    """Fault injection for the dead-rank tests: ``OVERLAP_FAULT="rank=1,iter=2,kind=exit|hang|raise"``."""
    text = os.environ.get("OVERLAP_FAULT")
    if not text:
        return None
    spec = dict(kv.split("=", 1) for kv in text.split(","))
    return {"rank": int(spec.get("rank", 1)), "iter": int(spec.get("iter", 0)), "kind": spec.get("kind", "exit")}


def _maybe_fail(fault: Optional[Dict[str, Any]], it: int) -> None:
    if fault is None or fault["rank"] != _rank() or fault["iter"] != it:
        return
    if fault["kind"] == "exit":
        os._exit(17)
    if fault["kind"] == "hang":
        time.sleep(3600)
    raise RuntimeError(f"injected fault on rank {_rank()} at iteration {it}")


class _Peers:
    """Heartbeats in the store, so that a rank stuck in a collective can name the rank that is gone."""

    def __init__(self) -> None:
        self.store = dist.distributed_c10d._get_default_store()
        self.world = dist.get_world_size()

    def beat(self, what: str) -> None:
        self.store.set(f"overlap/progress/{_rank()}", f"{what}@{time.time():.3f}")

    def failed(self, msg: str) -> None:
        try:
            self.store.set(f"overlap/failed/{_rank()}", msg[:500])
        except Exception:
            pass

    def first_to_report(self) -> bool:
        """True on the first rank to ask (the one that prints a traceback); True if the store is gone."""
        try:
            return self.store.add("overlap/traceback", 1) == 1
        except Exception:
            return True

    def diagnose(self) -> str:
        """Which ranks failed or stopped making progress, in words."""
        try:
            failed = [r for r in range(self.world) if r != _rank() and self.store.check([f"overlap/failed/{r}"])]
            if failed:
                return "; ".join(f"rank {r} failed: {self.store.get(f'overlap/failed/{r}').decode()}" for r in failed)
            beats = {}
            for r in range(self.world):
                if self.store.check([f"overlap/progress/{r}"]):
                    what, at = self.store.get(f"overlap/progress/{r}").decode().rsplit("@", 1)
                    beats[r] = (float(at), what)
            if not beats:
                return "no rank reported progress"
            oldest = min(beats.values())[0]
            stale = [r for r in range(self.world) if r not in beats or beats[r][0] <= oldest + 1e-3]
            return ", ".join(f"rank {r} stopped responding (last seen at {beats[r][1] if r in beats else 'start'})"
                             for r in stale if r != _rank()) or "peers are alive; the collective itself timed out"
        except Exception as exc:  # the store lives on rank 0: if that is gone, say so
            return f"the rendezvous store is unreachable ({type(exc).__name__}): rank 0 is probably gone"


def _init_distributed(timeout: float) -> torch.device:
    """Join torchrun's group, or make a group of one, on this rank's device (which it returns)."""
    from overlap.multirank import default_backend, default_device

    device = default_device()  # LOCAL_RANK picks the card on NPU / CUDA
    td = datetime.timedelta(seconds=timeout)
    if "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group(default_backend(device), timeout=td)
    else:
        dist.init_process_group(default_backend(device), store=dist.HashStore(), rank=0, world_size=1, timeout=td)
    return device


def _progress(msg: str, first: bool = False) -> None:
    """Progress on rank 0: a line rewritten in place on a terminal, one line per mode in a log."""
    if _rank() != 0:
        return
    if sys.stderr.isatty():
        sys.stderr.write("\r" + msg.ljust(60) + ("\r" if not msg else ""))
        sys.stderr.flush()
    elif first:
        click.echo(f"running {msg}", err=True)


def _parse_cpu_link(text: str, device: str) -> Any:
    from overlap.link import parse_link

    if device != "cpu" or text.strip().lower() in ("off", "none", "0", ""):
        return None
    try:
        return parse_link(text, "--cpu-link")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _validate(cfg: Any, world: int, warmup: int, iters: int) -> None:
    if cfg.n_experts % world:
        raise ConfigError(f"{cfg.n_experts} experts cannot be split evenly over {world} ranks "
                          f"(--experts must be a multiple of the number of ranks)")
    if iters < 1 or warmup < 0:
        raise ConfigError(f"--iters must be >= 1 and --warmup >= 0, got {iters} and {warmup}")


def _build_config(preset_name: str, overrides: Dict[str, Any]) -> Any:
    from launch.presets import preset

    try:
        return preset(preset_name, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "npu"]), default="auto",
              help="Where to run; auto picks npu, then cuda, then cpu.")
@click.option("--path", "exec_path", type=click.Choice(["auto", "npu", "ge", "aclgraph"]), default="auto",
              help="NPU execution path (auto: eager streams on the device found).")
@click.option("--mode", type=click.Choice(list(MODES) + ["all"]), default="all", help="Schedule(s) to run.")
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
@click.option("--iters", type=int, default=3, help="Timed iterations per mode.")
@click.option("--seed", type=int, default=0, help="Seed of the weights and the token ids.")
@click.option("--check", is_flag=True, help="Compare every mode with serial; exit 1 if one differs.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Write results.json, traces and timelines.")
@click.option("--cpu-link", default="0.1",
              help="CPU only: simulated interconnect 'GBPS[,LATENCY_US]' that collectives take at least as long "
                   "as (a sleep, so it overlaps like a real network); 'off' for plain loopback gloo.")
@click.option("--timeout", type=float, default=120.0, help="Seconds a rank waits for its peers before giving up.")
def main(device: str, exec_path: str, mode: str, kv_offload: bool, kv_store: str, preset_name: str,
         layers: Optional[int], dense_layers: Optional[int], hidden: Optional[int], experts: Optional[int],
         top_k: Optional[int], shared_experts: Optional[int], batch: int, seq_len: int, seq_lens: Optional[str],
         dtype: str, warmup: int, iters: int, seed: int, check: bool, out_dir: Optional[str], cpu_link: str,
         timeout: float) -> None:
    """Prefill of the reference MoE model with expert parallelism over all ranks, in each mode."""
    try:
        path = None if exec_path == "auto" else exec_path
        cfg = _build_config(preset_name, dict(n_layers=layers, n_dense_layers=dense_layers, hidden=hidden,
                                              n_experts=experts, top_k=top_k, n_shared=shared_experts))
        lens = _parse_seq_lens(seq_lens, batch, seq_len)
        modes = list(MODES) if mode == "all" else [mode]
        _validate(cfg, _world(), warmup, iters)
        device = _resolve_device(device, path)
        link = _parse_cpu_link(cpu_link, device)
        if path in ("ge", "aclgraph") and kv_offload:
            raise ConfigError(f"--kv-offload runs on the eager paths only: a copy to host memory on its own "
                              f"stream cannot be expressed inside a {path} graph")
    except ConfigError as exc:
        if _rank() == 0:
            exc.show()
        sys.exit(exc.exit_code)
    sys.exit(_run(cfg, lens, modes, device, path, kv_offload, kv_store, DTYPES[dtype], warmup, iters, seed,
                  check, out_dir, link, timeout))


def _run(cfg: Any, lens: List[int], modes: List[str], device: str, path: Optional[str], kv_offload: bool,
         kv_store: str,
         dtype: torch.dtype, warmup: int, iters: int, seed: int, check: bool, out_dir: Optional[str],
         link: Any, timeout: float) -> int:
    import overlap
    from launch.model import Batch, build_model
    from launch.measure import max_over_ranks, measure, table
    from launch.runner import graph_prefill, make_capacity_expert_parallel, make_expert_parallel

    overlap.set_path(device)
    overlap.set_link(link)
    dev = _init_distributed(timeout)
    peers = _Peers()
    rank, world = dist.get_rank(), dist.get_world_size()
    fault = _fault()
    try:
        batch = Batch.random(lens, cfg.vocab, seed=seed * 1000 + rank + 1, device=dev)
        model = build_model(cfg, seed=seed, dtype=dtype, device=dev)
        compile_mode: Optional[Callable[[str, Any], Any]] = None
        if path in ("ge", "aclgraph"):  # static shapes: every rank sends each rank `capacity` rows
            capacity = int(max_over_ranks([batch.seq.num_tokens], dist.group.WORLD)[0])
            make_capacity_expert_parallel(model, dist.group.WORLD, capacity)
            compile_mode = functools.partial(graph_prefill, model, batch, path=path)
        else:
            make_expert_parallel(model, dist.group.WORLD)
        cache = None
        if kv_offload:
            from overlap.offload import OffloadCache

            store_path = None
            if out_dir and kv_store == "mmap":  # a folder: one file per rank in it
                store_path = os.path.join(out_dir, "kv")
                os.makedirs(store_path, exist_ok=True)
                stale = os.path.join(store_path, f"kv-rank{rank}.kv")  # a scratch tier: start empty
                if os.path.exists(stale):
                    os.remove(stale)
            cache = OffloadCache(cfg.n_layers, batch.seq.num_tokens, (cfg.n_heads, cfg.head_dim), dtype, dev,
                                 store=kv_store, path=store_path, name="kv")
            cache.check_capacity(batch.seq.num_tokens)
        tokens = batch.seq.num_tokens * world
        say(f"prefill: {cfg.n_layers} layers, hidden {cfg.hidden}, {cfg.n_experts} experts top-{cfg.top_k}, "
            f"{cfg.n_shared} shared | {world} rank(s) on {device} | {len(lens)} requests / {sum(lens)} tokens per "
            f"rank | {str(dtype).replace('torch.', '')} | kv offload {'on (' + kv_store + ')' if cache else 'off'}"
            + (f" | simulated link {link}" if link else "") + (f" | {path} graph" if compile_mode else ""))
        counter = iter(range(1 << 30))

        def before_iter(mode: str, i: int) -> None:
            _progress(f"{mode}: iteration {i + 1}/{warmup + iters}", first=i == 0)
            _maybe_fail(fault, next(counter))
            peers.beat(f"{mode} iteration {i + 1}")

        results = measure(model, batch, modes, dist.group.WORLD, warmup=warmup, iters=iters, cache=cache,
                          before_iter=before_iter, compile_mode=compile_mode)
        _progress("")
        failed = _check(results, check, dtype)
        say(table(results, tokens))
        for r in results:
            if r.mode == "two-batch":
                say(f"two-batch split: {r.split}")
        if check:
            say("check: " + ("FAILED: " + ", ".join(failed) if failed else "every mode matches serial"))
        if cache is not None:
            cache.close()
        overlap.synchronize()  # no launch still in flight on a side stream (and no gloo callback) at teardown
        dist.barrier()
        dist.destroy_process_group()
        if out_dir and rank == 0:  # after the last collective: a failure here cannot stall the other ranks
            _write_outputs(out_dir, results, tokens, world, device, dtype, lens, cfg, cache, link, check, failed)
        return 1 if failed else 0
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        peer_failure = world > 1 and _is_peer_failure(exc)
        detail = peers.diagnose() if peer_failure else ""
        peers.failed(msg)
        click.echo(f"rank {rank}: {msg}" + (f"\nrank {rank}: {detail}" if detail else ""), err=True)
        if not peer_failure:  # a bug, not a peer's fault: show where it came from, once per job
            if peers.first_to_report():
                click.echo(f"rank {rank}: unexpected error; traceback (please include it in a report):\n"
                           + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip(),
                           err=True)
            else:
                click.echo(f"rank {rank}: (another rank printed the traceback of the first unexpected error)",
                           err=True)
        return 1


def _is_peer_failure(exc: BaseException) -> bool:
    """A collective that failed because of another rank (timeout, closed connection), not this rank's bug."""
    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or any(
        w in text for w in ("timed out", "timeout", "connection closed", "connection reset", "gloo", "nccl", "hccl"))


def _check(results: Sequence[Any], check: bool, dtype: torch.dtype) -> List[str]:
    """The modes whose output differs from serial by more than the dtype's tolerance."""
    if not check:
        return []
    serial = next((r for r in results if r.mode == "serial"), None)
    if serial is None:
        return ["--check needs the serial mode (use --mode all)"]
    tol = (1e-4 if dtype == torch.float32 else 5e-2) * max(1.0, serial.ref_scale or 0.0)
    # `not <=`: a NaN or infinite difference fails too
    return [f"{r.mode} differs from serial by {r.max_diff:.3e} (tolerance {tol:.1e})"
            for r in results if r.max_diff is not None and not r.max_diff <= tol]


def _write_outputs(out_dir: str, results: Sequence[Any], tokens: int, world: int, device: str, dtype: torch.dtype,
                   lens: List[int], cfg: Any, cache: Any, link: Any, check: bool, failed: List[str]) -> None:
    from overlap.timeline import save_chrome_trace, save_png

    os.makedirs(out_dir, exist_ok=True)
    pngs = True
    for r in results:
        save_chrome_trace(r.spans, os.path.join(out_dir, f"trace_{r.mode}.json"))
        if pngs:
            try:
                save_png(r.spans, os.path.join(out_dir, f"timeline_{r.mode}.png"),
                         title=f"{r.mode}: {world} rank(s), {tokens} tokens")
            except ImportError:
                pngs = False
                say("(matplotlib is not installed: no PNG timelines; pip install 'npu-overlap[plot]')", err=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"world_size": world, "device": device, "dtype": str(dtype).replace("torch.", ""),
                   "seq_lens": lens, "config": dataclasses.asdict(cfg), "kv_offload": cache is not None,
                   "cpu_link": str(link) if link else None, "rows": [r.row(tokens) for r in results],
                   "check": None if not check else ("failed" if failed else "passed")}, f, indent=2)
    say(f"wrote {out_dir}/results.json, trace_<mode>.json" + (" and timeline_<mode>.png" if pngs else ""))


if __name__ == "__main__":
    main()
