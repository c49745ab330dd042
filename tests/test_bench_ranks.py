"""Every benchmark's ranks run the CPU path (gloo), whatever devices the machine has and whatever $OVERLAP_PATH says:
they measure the CPU stand-in and its simulated link (on a GPU machine the detected path would put their two ranks
on its one card, and their CPU tensors into NCCL)."""
import importlib

import pytest
from click.testing import CliRunner

import overlap.multirank
from launch.bench import CPU_RANKS


class _Started(Exception):
    pass


@pytest.mark.parametrize("name", ["collectives", "comm_threads", "decode", "pipeline", "plan", "quantized"])
def test_a_benchmarks_ranks_run_the_cpu_path(name, monkeypatch):
    module = importlib.import_module(f"launch.bench.{name}")
    seen = {}

    def run_ranks(fn, world_size, *args, env=None, **kwargs):
        seen.update(env or {})
        raise _Started

    monkeypatch.setattr(overlap.multirank, "run_ranks", run_ranks)
    if hasattr(module, "run_ranks"):
        monkeypatch.setattr(module, "run_ranks", run_ranks)
    monkeypatch.setenv("OVERLAP_PATH", "cuda")
    result = CliRunner().invoke(module.main, [])
    assert isinstance(result.exception, _Started), result.output
    assert CPU_RANKS == {"OVERLAP_PATH": "cpu"} and seen == CPU_RANKS, seen
