"""``--dry-run``: the job sized on paper over ``--nnodes`` x ``--nproc-per-node`` ranks, building nothing; its bytes
are `launch.memory`'s estimates, which must equal what a small run of the same model allocates."""
import pytest
import torch
import torch.distributed as dist

from support.launcher import GENERATE, run_here, run_launcher

WORLD = 2
DEEPSEEK_V3 = ["--preset", "deepseek-v3", "--dry-run", "--nproc-per-node", "8", "--nnodes", "4", "--batch", "8",
               "--seq-len", "4096", "--new-tokens", "256", "--dtype", "bfloat16"]


def _job(model_name, world=WORLD):
    from launch.config import job_config

    return job_config(world=world, device="cpu", exec_path="auto", mode="serial", kv_offload=False,
                      kv_store="memory", preset_name="tiny", overrides={}, batch=2, seq_len=8, seq_lens=None,
                      dtype="float32", warmup=0, iters=1, seed=0, check=False, out_dir=None, cpu_link="off",
                      timeout=30.0, model_name=model_name)


def _built_rank(job):
    """Rank 0 of ``WORLD``'s expert-parallel model, built in this process over torch's fake process group (no
    peers: only the group's size and this rank are read), and its real KV cache for 2 prompts of 8 and 4 new
    tokens: (parameter bytes, cache bytes)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from launch.build import build_model
    from launch.engine import make_expert_parallel, new_cache

    try:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    except ValueError:  # under torchrun the job's group is this process's default (hidden outside run_ranks bodies)
        pytest.skip("a process group is already set up in this process")
    try:
        model, _ = build_model(job, 0, WORLD, torch.device("cpu"))
        make_expert_parallel(model, dist.group.WORLD)
        cache = new_cache(model, [[1] * 8, [1] * 8], 4)
    finally:
        dist.destroy_process_group()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params, sum(t.numel() * t.element_size() for t in (cache.k, cache.v))


def test_the_reference_ranks_bytes_equal_the_estimate():
    """The tiny preset over 2 ranks: the dry run's dense weights and experts add up to the rank's parameters, and its
    KV cache is the cache the rank allocates (before: the cache was estimated from every head and ``head_dim``)."""
    from launch.memory import decode_kv_cache, estimate

    job = _job("reference")
    params, cache = _built_rank(job)
    need = estimate(job, WORLD, deployed=True)
    assert need.dense_weights + need.expert_weights == params
    assert need.expert_weights == 2 * 8 // WORLD * 3 * 64 * 32 * 4  # 2 MoE layers, its 4 of 8 experts, float32
    assert decode_kv_cache(job, 4) == cache


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32", "qwen2_moe"])
def test_a_transformers_ranks_bytes_equal_the_estimate(family):
    """deepseek_v3 (MLA: the cache holds its latent and rotary key), deepseek_v32 (its indexer's key beside them)
    and qwen2_moe (key-value heads x head_dim),
    made small, over 2 ranks: the rank's parameters are the dry run's dense weights and its experts plus the whole
    model's routed experts, which ``--model NAME`` keeps in the family's own blocks for ``--check`` (a checkpoint
    does not; a dry run sizes that); its cache is the dry run's KV cache (before: every head of K and V)."""
    from launch.memory import decode_kv_cache, estimate

    job = _job(family)
    params, cache = _built_rank(job)
    need = estimate(job, WORLD, deployed=True)
    routed = need.expert_weights * WORLD  # every routed expert of every layer
    assert need.dense_weights + need.expert_weights + routed == params == estimate(job, WORLD).weights
    assert decode_kv_cache(job, 4) == cache


def test_deepseek_v3_at_full_size_over_4_nodes_of_8_is_a_table(capsys, monkeypatch):
    from launch.generate import main
    from launch.memory import gib

    code, out, err = run_here(main, DEEPSEEK_V3, capsys, monkeypatch)
    assert code == 0 and err == "", err
    head, row = out.splitlines()[1:3]
    assert "routed experts (8 of 256 a layer)" in head and row.split()[:2] == ["0-31,", "each"], out
    experts = 58 * 8 * 3 * 7168 * 2048 * 2  # 58 MoE layers, 8 experts of 3 x hidden x moe_ffn, bfloat16
    kv = 61 * 8 * (4096 + 256) * 2 * 128 * 128 * 2  # 61 layers, 8 slots of 4352 rows, K and V of 128 heads x 128
    assert f" {gib(experts)} " in row and f" {gib(kv)} " in row, row


def test_a_rank_that_does_not_fit_the_device_memory_is_a_finding_in_one_line(capsys, monkeypatch):
    from launch.generate import main

    code, out, err = run_here(main, DEEPSEEK_V3 + ["--device-memory", "64"], capsys, monkeypatch)
    assert code == 1 and "device total" in out and len(err.splitlines()) == 1, (out, err)
    assert err.startswith("does not fit: each of the 32 ranks needs ") and "--device-memory is 64.00 GiB" in err
    code, out, err = run_here(main, DEEPSEEK_V3 + ["--device-memory", "4096"], capsys, monkeypatch)
    assert code == 0 and "fits: each rank needs " in out and err == "", (out, err)


@pytest.mark.parametrize("args, words", [
    (["--nnodes", "4"], "--nnodes 4 is taken with --dry-run only"),
    (["--nproc-per-node", "8"], "--nproc-per-node 8 is taken with --dry-run only"),
    (["--device-memory", "64"], "--device-memory 64 is taken with --dry-run only"),
    (["--dry-run", "--nproc-per-node", "0"], "--nproc-per-node must be at least 1, got 0"),
    (["--dry-run", "--nnodes", "-1"], "--nnodes must be at least 1, got -1"),
    (["--dry-run", "--device-memory", "0"], "--device-memory must be a positive number of GiB, got 0"),
    (["--dry-run", "--nproc-per-node", "3"], "8 routed experts cannot be split evenly over 3 ranks"),
    (["--dry-run", "--model", "qwen2_moe", "--layers", "2"],
     "--model qwen2_moe --dry-run sizes the family's published config: drop --layers"),
])
@pytest.mark.parametrize("launcher", ["prefill", "generate"])
def test_bad_input_is_one_line_and_exit_2(launcher, args, words, capsys, monkeypatch):
    import importlib

    main = importlib.import_module(f"launch.{launcher}").main
    code, out, err = run_here(main, ["--preset", "tiny"] + args, capsys, monkeypatch)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and words in lines[0] and out == "", err


def test_a_family_at_its_published_config(capsys, monkeypatch):
    """--model qwen2_moe --dry-run: AutoConfig.for_model's defaults (60 experts, 24 layers), not the small model."""
    from launch.prefill import main

    code, out, err = run_here(main, ["--model", "qwen2_moe", "--dry-run", "--nproc-per-node", "4"], capsys,
                              monkeypatch)
    assert code == 0 and "routed experts (15 of 60 a layer)" in out, (out, err)


def test_a_multimodal_wrapper_is_sized_as_its_text_model_or_refused_in_one_line(capsys, monkeypatch):
    """kimi_k25's text model (deepseek_v3's published config: 256 experts) is what runs, so it is what is sized; a
    wrapper whose text model transformers cannot build as a causal LM (step3p7) is one line, exit 2 (before: "has no
    routed experts" for both, and a traceback from the meta build once the text config was read)."""
    from launch.prefill import main

    code, out, err = run_here(main, ["--model", "kimi_k25", "--dry-run", "--nproc-per-node", "8"], capsys, monkeypatch)
    assert code == 0 and "routed experts (32 of 256 a layer)" in out, (out, err)
    code, out, err = run_here(main, ["--model", "step3p7", "--dry-run", "--nproc-per-node", "8"], capsys, monkeypatch)
    assert code == 2 and "transformers cannot build a step3p5 causal LM" in err, (out, err)
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.spawns_ranks
def test_the_dry_run_as_users_run_it_is_a_plain_python_process():
    proc = run_launcher(DEEPSEEK_V3, script=GENERATE, timeout=120)
    assert proc.returncode == 0 and "4 node(s) x 8 rank(s) = 32 ranks" in proc.stdout, proc.stderr[-2000:]


def test_a_checkpoints_config_json_alone(tmp_path, capsys, monkeypatch):
    """--model PATH --dry-run reads the folder's config.json and no weight (a checkpoint needs its safetensors
    otherwise): qwen2_moe's published config saved alone, over 2 nodes of 2."""
    from transformers import AutoConfig

    from launch.prefill import main

    AutoConfig.for_model("qwen2_moe").save_pretrained(tmp_path)
    code, out, err = run_here(main, ["--model", str(tmp_path), "--dry-run", "--nproc-per-node", "2", "--nnodes", "2"],
                              capsys, monkeypatch)
    assert code == 0 and "routed experts (15 of 60 a layer)" in out and "0-3, each" in out, (out, err)


def test_a_quantized_dispatch_sizes_its_exchange_buffers_by_the_bytes_it_sends():
    """--dispatch-dtype int8: the dispatched and received rows take a byte a value and the token's 4-byte scale (as
    collectives.quantize packs them), the computed and combined rows the model's dtype (before: all four in it)."""
    import dataclasses

    from launch.memory import estimate

    job = _job("reference")  # tiny: hidden 64, top-2, float32, 2 requests of 8 tokens
    plain, quantized = (estimate(dataclasses.replace(job, dispatch_dtype=d), WORLD).exchange for d in (None, "int8"))
    rows = 2 * 16 * 2  # two micro-batches in flight, 16 tokens, top-2
    assert plain == rows * 4 * 64 * 4
    assert quantized == rows * (2 * (64 + 4) + 2 * 64 * 4)
