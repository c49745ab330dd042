"""The command-line options `launch.prefill` and `launch.generate` share, as click decorators."""
from __future__ import annotations

from typing import Callable, List, TypeVar

import click

from launch.config import DTYPES

F = TypeVar("F", bound=Callable[..., object])


def _apply(options: List[Callable[[F], F]]) -> Callable[[F], F]:
    def decorate(f: F) -> F:
        for option in reversed(options):  # in --help in the order listed
            f = option(f)
        return f
    return decorate


def model_options(f: F) -> F:
    """``--model``, ``--device``, ``--preset``, the shape overrides (``--layers``, ``--hidden``, ...) and
    ``--indexer-stream``."""
    return _apply([
        click.option("--model", "model_name", default="reference", metavar="reference|NAME|PATH",
                     help="The toolkit's reference decoder, a transformers MoE model type built small from its "
                          "config with weights from --seed (qwen3_moe, deepseek_v3, mixtral, ...), or a local "
                          "checkpoint folder (config.json + safetensors: each rank reads only its experts)."),
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "npu"]), default="auto",
                     help="Where to run; auto picks npu, then cuda, then cpu."),
        click.option("--preset", "preset_name", type=click.Choice(["tiny", "small", "deepseek-v3"]), default="small",
                     help="Model shapes (deepseek-v3: use with --layers on devices)."),
        click.option("--layers", type=int, help="Override: number of decoder layers."),
        click.option("--dense-layers", type=int, help="Override: leading layers with a dense MLP instead of MoE."),
        click.option("--hidden", type=int, help="Override: hidden size."),
        click.option("--experts", type=int, help="Override: routed experts (a multiple of the number of ranks)."),
        click.option("--top-k", type=int, help="Override: experts per token."),
        click.option("--shared-experts", type=int, help="Override: shared experts (0: none)."),
        click.option("--indexer-stream/--no-indexer-stream", default=True,
                     help="DeepSeek sparse attention (deepseek_v32, glm_moe_dsa): the indexer's top-k selection on "
                          "its own stream beside the main attention branch; off: the family's attention module as "
                          "one operation."),
        click.option("--quantize", type=click.Choice(["fp8", "w8a8"]), default=None,
                     help="Quantize the reference decoder's or --model NAME's seeded weights in memory and keep "
                          "them quantized: the routed experts and the linear projections, fp8 per 128 x 128 block "
                          "or w8a8 int8 per channel, as a checkpoint of that format holds them "
                          "(docs/checkpoints.md)."),
    ])(f)


def batch_options(seq_len: int) -> Callable[[F], F]:
    """``--batch``, ``--seq-len`` (default ``seq_len``), ``--seq-lens``, ``--dtype``."""
    return _apply([
        click.option("--batch", type=int, default=8, help="Requests per rank (with --seq-len)."),
        click.option("--seq-len", type=int, default=seq_len,
                     help="Tokens per request (prompt tokens, in generation)."),
        click.option("--seq-lens",
                     help="Explicit comma-separated request lengths per rank; overrides --batch/--seq-len."),
        click.option("--dtype", type=click.Choice(list(DTYPES)), default="float32"),
    ])


def refresh_option(auto: str) -> Callable[[F], F]:
    """``--refresh-calibration``: measure the calibration of ``auto`` (``--mode auto``, ``--decode-mode auto``)
    again, whatever the cache holds."""
    return click.option("--refresh-calibration", is_flag=True,
                        help=f"With {auto}: measure its calibration again instead of reading the one cached for "
                             f"this machine, model and link (a line says where the one used came from and when it "
                             f"was measured, and a note where a cached one's prediction is far from the time "
                             f"measured).")


def timing_options(f: F) -> F:
    """``--warmup``, ``--iters``, ``--seed``."""
    return _apply([
        click.option("--warmup", type=int, default=1, help="Untimed iterations per mode."),
        click.option("--iters", type=int, default=5,
                     help="Timed iterations (rounds) per mode: the table shows their medians and spread."),
        click.option("--seed", type=int, default=0, help="Seed of the weights and the token ids."),
    ])(f)


def run_options(f: F) -> F:
    """``--out``, ``--cpu-link``, ``--cpu-comm-priority``, ``--dispatch``, ``--dispatch-dtype``, ``--timeout``."""
    return _apply([
        click.option("--out", "out_dir", type=click.Path(file_okay=False),
                     help="Write results.json, traces and timelines."),
        click.option("--cpu-link", default="0.1", envvar="OVERLAP_CPU_LINK", show_envvar=True,
                     help="CPU only: simulated interconnect 'GBPS[,LATENCY_US]' that collectives take at least as "
                          "long as (a sleep, so it overlaps like a real network); 'off' for plain loopback gloo."),
        click.option("--cpu-comm-priority", type=click.Choice(["off", "rt"]), default="off",
                     envvar="OVERLAP_CPU_COMM_PRIORITY", show_envvar=True,
                     help="CPU only: 'rt' runs gloo's communication threads real-time (SCHED_FIFO, where "
                          "permitted), as a device's comm engine that never waits for compute: faster on a host the "
                          "job has to itself, slower beside another such job; 'off' leaves them normal."),
        click.option("--dispatch", type=click.Choice(["two-step", "one-step"]), default="two-step",
                     help="The MoE layers' dispatch: its count exchange issued with the routing and read only where "
                          "the tokens go (the schedules issue the other micro-batches' work in between), or both at "
                          "once."),
        click.option("--dispatch-dtype", default=None, metavar="bf16|int8|fp8",
                     help="How tokens travel to their experts: int8 or fp8 (e4m3) quantized per token, each token's "
                          "scale in the same exchange (the experts dequantize it; the combine stays in the model's "
                          "dtype); bf16: unquantized, for a bf16 model. Default: the model's dtype, unquantized."),
        click.option("--timeout", type=float, default=120.0,
                     help="Seconds a rank waits for its peers before giving up."),
    ])(f)


def dry_run_options(f: F) -> F:
    """``--dry-run`` and what only it takes: torchrun's ``--nproc-per-node`` and ``--nnodes``, ``--device-memory``."""
    return _apply([
        click.option("--dry-run", is_flag=True,
                     help="Build nothing, run nothing: print each rank's bytes of weights (dense parts, its routed "
                          "experts), KV cache and exchange buffers for the model at full size (--preset, --model "
                          "NAME at its published config, or a checkpoint's config.json) over --nnodes x "
                          "--nproc-per-node ranks; exit 1 where a rank does not fit --device-memory."),
        click.option("--nproc-per-node", type=int, default=None, show_default=False,
                     help="With --dry-run: the ranks per node the job would run on (torchrun's option; default 1)."),
        click.option("--nnodes", type=int, default=None, show_default=False,
                     help="With --dry-run: the nodes the job would run on (torchrun's option; default 1)."),
        click.option("--device-memory", type=float, default=None, show_default=False, metavar="GIB",
                     help="With --dry-run: each rank's device memory in GiB (2**30 bytes), to say what does not fit."),
    ])(f)
