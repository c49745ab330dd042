"""Benchmarks, each a command that prints ratios measured side by side in one run (`python -m launch.bench.NAME`).

- `pipeline`: the prefill modes (serial, shared, two-batch) of the reference model or a transformers family;
- `collectives`: raw all-to-all vs dispatch + combine, deduplicated bytes, the EP layer's shared-expert overlap;
- `offload`: prefill with and without the KV offload stream, and the device memory it holds;
- `plan`: the planner's predictions against measured times over a sweep, and ``--mode auto`` against the best
  fixed mode;
- `decode`: time per output token of every decode mode and of ``--decode-mode auto`` over batch sizes and links
  (`decode_targets`: its table and issue 29's targets);
- `comm_threads`: the CPU path's communication threads at real-time and normal priority, quiet and under load.
- `quantized`: the int8 / fp8 dispatch against bf16: bytes per token, prefill and decode step time.
- `points`: each parallel point's candidate orchestrations in a layer: predicted and measured time relative to the
  single-stream layer, overlap_pct and verdict.
"""

# The environment of a benchmark's ranks (`overlap.run_ranks`): the CPU path, over gloo, whatever devices the machine
# has. The benchmarks measure the CPU stand-in with its simulated link; on a machine with a GPU the path detected
# would put their two ranks on its one card, and their CPU tensors into NCCL.
CPU_RANKS = {"OVERLAP_PATH": "cpu"}

# Every benchmark's command: -h as well as --help, as the launchers and overlap-report take, and each option's default
# in its help.
COMMAND_SETTINGS = {"help_option_names": ["-h", "--help"], "show_default": True}
