"""`launch/prefill.py --model NAME|PATH` and `launch.bench.pipeline --model NAME` on transformers MoE models (no downloads)."""
import json
import os
import re
import sys

import pytest

from support import zygote
from support.launcher import ROOT, TINY, run_here, run_launcher

pytest.importorskip("transformers")
pytestmark = pytest.mark.spawns_ranks
SMALL = ["--warmup", "0", "--iters", "1", "--batch", "3", "--seq-len", "12"]


def _in_this_process(args, capsys, monkeypatch):
    """``launch.prefill.main(args)`` here (`run_here`), for a refusal found before any rank joins a group
    (tests/test_prefill_cli.py runs one end to end): its exit status, what it printed."""
    from launch.prefill import main

    code, out, err = run_here(main, args, capsys, monkeypatch)
    return code, out + err


def test_a_model_type_runs_every_mode_and_matches_its_own_forward():
    proc = run_launcher(SMALL + ["--model", "qwen3_moe", "--check"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prefill: qwen3_moe" in proc.stdout
    assert "check: serial matches qwen3_moe's own forward" in proc.stdout
    assert "check: every mode matches serial" in proc.stdout


def test_two_ranks_expert_parallel_with_kv_offload_and_overrides(tmp_path):
    proc = run_launcher(SMALL + ["--model", "deepseek_v3", "--check", "--kv-offload", "--experts", "4", "--top-k", "2",
                                 "--seq-lens", "20,7,9", "--out", str(tmp_path)], ranks=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("check: serial matches deepseek_v3's own forward") == 1
    assert "4 experts top-2" in proc.stdout and "kv offload on" in proc.stdout
    assert "prefill: deepseek_v3 3 layers (1 dense, 2 MoE)," in proc.stdout  # first_k_dense_replace=1
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["check"] == "passed" and [r["mode"] for r in res["rows"]] == ["serial", "shared", "two-batch"]


def _checkpoint(folder, model_type="qwen2_moe"):
    """Written in this process (as tests/test_checkpoint.py writes its own): a process of its own cost an
    interpreter with torch and transformers, ~4 s, for a model of a few hundred KB."""
    from launch.models import build_transformers_model

    build_transformers_model(model_type, seed=5).hf.save_pretrained(str(folder), max_shard_size="200KB")
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """One sharded qwen2_moe checkpoint for the tests that only read it (building one takes a process)."""
    return _checkpoint(tmp_path_factory.mktemp("ckpt") / "ckpt")


def test_a_checkpoint_folder_is_read_per_rank(checkpoint):
    folder = checkpoint
    assert len(list(folder.glob("*.safetensors"))) > 1  # sharded
    proc = run_launcher(SMALL + ["--model", str(folder), "--check"], ranks=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("weights: rank 0 holds") == 1 and "rank 1 holds" in out
    assert "not compared with the model's own forward: each of the 2 ranks holds 4 of the checkpoint's 8 routed " \
           "experts" in out
    assert "check: every mode matches serial" in out


def test_a_checkpoint_on_one_rank_is_compared_with_its_own_forward(checkpoint):
    folder = checkpoint
    proc = run_launcher(SMALL + ["--model", str(folder), "--check"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"check: serial matches {folder}'s own forward" in proc.stdout, proc.stdout[-3000:]
    assert "not compared" not in proc.stdout and "check: every mode matches serial" in proc.stdout


_SKEWED = """
import sys
import launch.prefill as p

own = p._own_forward


def skewed(*args):  # the model's own forward, moved by 0.01: the check must see it
    out = own(*args)
    return out if out is None or isinstance(out, str) else out + 0.01


p._own_forward = skewed
sys.argv = ["launch/prefill.py"] + sys.argv[1:]
p.script()
"""


def test_the_comparison_with_a_checkpoints_own_forward_catches_a_difference(checkpoint):
    folder = checkpoint
    proc = zygote.run([sys.executable, "-c", _SKEWED] + SMALL + ["--model", str(folder), "--check"],
                      timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"check: FAILED: serial differs from {folder}'s own forward by 1.0" in proc.stdout, proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--model", "no_such_family"], "neither 'reference', a folder, nor a transformers model type"),
    (["--model", "llama"], "has no routed experts"),
])
def test_bad_models_are_one_line(args, message, capsys, monkeypatch):
    returncode, out = _in_this_process(TINY + args, capsys, monkeypatch)
    assert returncode == 2 and out.count(message) == 1 and "Traceback" not in out, out[-3000:]


BROUGHT = ["--layers", "2", "--hidden", "128", "--experts", "8", "--top-k", "2", "--batch", "2", "--seq-len", "32",
           "--mode", "all", "--check", "--warmup", "0", "--iters", "1"]


@pytest.mark.parametrize("family", ["gpt_oss", "longcat_flash"])
def test_a_family_users_bring_runs_every_mode_on_two_ranks(family):
    """The command of issue 25 end to end: before, gpt-oss had no scaled-dot-product attention and
    LongCat-Flash modules the adapter did not run. (Llama 4, dots1 and the other families it names run
    every mode on two ranks in-process: tests/test_transformers_models.py, which costs a launch less each.)"""
    proc = run_launcher(BROUGHT + ["--model", family], ranks=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count(f"check: serial matches {family}'s own forward") == 1, proc.stdout[-3000:]
    assert "check: every mode matches serial" in proc.stdout


@pytest.mark.parametrize("family, ranks, message", [
    ("deepseek_v4", 2, re.escape("--model deepseek_v4: the adapter cannot run deepseek_v4: TypeError: layer 0 "
                                 "(DeepseekV4DecoderLayer): heavily compressed attention (its cache holds a "
                                 "compressor's state, not keys and values per token) and hyper-connections")),
    ("glm4v_moe_text", None, re.escape("--model glm4v_moe_text: glm4v_moe_text is not a causal LM "
                                       "AutoModelForCausalLM builds")),
])
def test_a_family_the_adapter_cannot_run_is_one_line_before_any_collective(family, ranks, message, capsys,
                                                                           monkeypatch):
    """Once per node (torchrun's status is 1 when a rank exits 2, and its agent prints its own traceback), exit
    2 on its own (in this process: found before any rank joins a group); no traceback of ours, no rank joins a
    group."""
    if ranks is None:
        returncode, out = _in_this_process(BROUGHT + ["--model", family], capsys, monkeypatch)
    else:
        proc = run_launcher(BROUGHT + ["--model", family], ranks=ranks)
        returncode, out = proc.returncode, proc.stdout + proc.stderr
    assert returncode == (2 if ranks is None else 1), out[-3000:]
    assert len(re.findall(message, out)) == 1, out[-3000:]
    assert ("Traceback" not in out) if ranks is None else not re.search(r'File ".*/(launch|collectives)/', out), \
        out[-3000:]
    assert "unexpected error" not in out and "prefill:" not in out  # no headline: no group was joined


def test_a_checkpoint_keeps_its_shapes(checkpoint, capsys, monkeypatch):
    folder = checkpoint
    returncode, out = _in_this_process(TINY + ["--model", str(folder), "--layers", "3"], capsys, monkeypatch)
    assert returncode == 2 and "is a checkpoint: its shapes are its own (drop --layers)" in out, out[-3000:]


def test_a_family_that_cannot_cut_a_request_says_so():
    proc = run_launcher(SMALL + ["--model", "qwen3_next", "--mode", "two-batch", "--seq-lens", "30,6"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "requests are not cut across micro-batches" in proc.stdout


def test_the_pipeline_benchmark_runs_a_family():
    proc = zygote.run([sys.executable, "-m", "launch.bench.pipeline", "--model", "mixtral", "--preset", "tiny",
                       "--batch", "2", "--seq-len", "16", "--warmup", "0", "--iters", "1"], cwd=ROOT,
                      env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mixtral at the shapes of preset tiny" in proc.stdout
    for mode in ("serial", "shared", "two-batch"):
        assert f"\n{mode} " in proc.stdout
    # mixtral has no shared experts: shared runs serial's schedule, whatever it measured
    assert re.search(r"^shared .* =serial ", proc.stdout, re.M), proc.stdout
    assert ("=serial: shared runs serial's schedule (the model has no shared experts: nothing runs beside its "
            "exchanges)") in proc.stdout
    # the ceiling: each mode with no link at all beside serial at the link, and the gap to the ideal split by it
    assert re.search(r"^ceiling: each mode with no link at all, .*: shared [0-9.]+x \(spread -\), two-batch [0-9.]+x",
                     proc.stdout, re.M), proc.stdout
    assert re.search(r"^two-batch: [0-9.]+x against the ideal [0-9.]+x and its ceiling [0-9.]+x; of the gap, its own "
                     r"cost with no link at all", proc.stdout, re.M), proc.stdout
    assert "target: two-batch not slower than serial: inconclusive (noise) (" in proc.stdout  # one round
