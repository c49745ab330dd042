"""launch/checkpoint.py: each rank loads a transformers MoE checkpoint holding its own routed experts only.

Tiny checkpoints of five families are written with ``save_pretrained`` (no downloads), whole and
in several shards, and in the fused layout; every rank of 1, 2 and 4 must hold exactly the
original's tensors (its experts' rows only) and read no more than that.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

from launch.checkpoint import CheckpointError, LoadReport, load_checkpoint
from overlap.multirank import default_device, run_ranks

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              intermediate_size=96, max_position_embeddings=128)
FAMILIES = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0],
                      head_dim=16),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0],
                      shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                     first_k_dense_replace=1, n_group=1, topk_group=1, head_dim=16),
}
_EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.")
_FUSED_KEY = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def _config(family: str, **over):
    return transformers.AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family], **over})


def _model(family: str, **over) -> nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, **over)).eval()
    with torch.no_grad():
        for b in model.buffers():  # DeepSeek-V3 / GLM's score correction bias is zeros at init
            if b.is_floating_point() and b.abs().sum() == 0:
                b.normal_(0, 0.1)
    return model


def _save(model: nn.Module, path: str, **kw) -> str:
    model.save_pretrained(path, **kw)
    return path


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """family -> (original model, whole checkpoint, sharded checkpoint)."""
    out = {}
    for family in FAMILIES:
        model = _model(family)
        base = tmp_path_factory.mktemp(family)
        out[family] = (model, _save(model, str(base / "whole")), _save(model, str(base / "sharded"),
                                                                          max_shard_size="100KB"))
    return out


# ---------------------------------------------------------------- what the files hold


def _headers(path: str):
    """key -> (bytes, shape) of every tensor in the checkpoint, read from the files' headers."""
    from safetensors import safe_open

    out = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    shape = tuple(sl.get_shape())
                    size = {"F32": 4, "BF16": 2, "F16": 2}[sl.get_dtype()]
                    out[key] = (size * int(torch.Size(shape).numel()), shape)
    return out


def _expected_read(path: str, rank: int, world: int) -> int:
    """Bytes of everything but the routed experts, plus this rank's share of them."""
    total = 0
    for key, (size, shape) in _headers(path).items():
        m = _EXPERT_KEY.search(key)
        if m:
            n = 8 // world
            total += size if rank * n <= int(m.group(1)) < (rank + 1) * n else 0
        elif _FUSED_KEY.search(key):
            total += size // world
        else:
            total += size
    return total


def _files_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))


def _experts_size(path: str) -> int:
    return sum(s for k, (s, _) in _headers(path).items() if _EXPERT_KEY.search(k) or _FUSED_KEY.search(k))


def _check_holds(original: nn.Module, loaded: nn.Module, report: LoadReport, rank: int, world: int) -> None:
    """``loaded`` holds the original's tensors, and of the experts rows [lo, hi) only, ep_shard set."""
    ref, got = original.state_dict(), loaded.state_dict()
    assert set(got) == set(ref)
    n_moe = 0
    for name, module in loaded.named_modules():
        if name.endswith(".experts"):
            n_moe += 1
            lo, hi = rank * 8 // world, (rank + 1) * 8 // world
            assert module.ep_shard == (lo, 8) and report.sharded[name] == (lo, 8)
            for leaf in ("gate_up_proj", "down_proj"):
                assert torch.equal(getattr(module, leaf), ref[f"{name}.{leaf}"][lo:hi])
    assert n_moe == len(report.sharded) and n_moe >= 1
    for key, value in got.items():
        if ".experts." not in key:
            assert value.dtype == ref[key].dtype and torch.equal(value, ref[key]), key
    for key, value in loaded.named_buffers():  # the rotary inv_freq is not in the checkpoint
        assert torch.equal(value, dict(original.named_buffers())[key]), key


# ---------------------------------------------------------------- five families, 1 / 2 / 4 ranks


@pytest.mark.parametrize("layout", ["whole", "sharded"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_rank_holds_its_experts_and_reads_only_those(written, family, layout):
    original, whole, sharded = written[family]
    path = whole if layout == "whole" else sharded
    files = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    assert (len(files) > 2) == (layout == "sharded")
    others_share = _experts_size(path)
    for world in (1, 2, 4):
        for rank in range(world):
            loaded, report = load_checkpoint(path, rank=rank, world=world)
            _check_holds(original, loaded, report, rank, world)
            assert (report.rank, report.world, report.ignored) == (rank, world, ())
            assert report.bytes_read == _expected_read(path, rank, world)
            assert report.bytes_read < _files_size(path) - others_share * (world - 1) // world
            assert report.checkpoint_bytes == sum(s for s, _ in _headers(path).values())
            assert report.bytes_held == report.bytes_read + sum(
                b.numel() * b.element_size() for n, b in loaded.named_buffers() if "inv_freq" in n)


def test_what_save_pretrained_writes_is_per_expert(written):
    """transformers 5 writes routed experts one key per expert (Mixtral under its old names)."""
    for family, (_, path, _) in written.items():
        keys = set(_headers(path))
        assert not any(_FUSED_KEY.search(k) for k in keys)
        mlp = "block_sparse_moe" if family == "mixtral" else "mlp"
        gate = "w1" if family == "mixtral" else "gate_proj"
        assert f"model.layers.1.{mlp}.experts.7.{gate}.weight" in keys


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_rank_computes_what_the_original_computes(written, family):
    original, path, _ = written[family]
    loaded, _ = load_checkpoint(path)
    assert not loaded.training
    ids = torch.randint(0, COMMON["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, original(ids).logits)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtypes_are_those_from_pretrained_gives(written, family, dtype):
    """Cast like from_pretrained, DeepSeek-V3's router and bias kept in float32."""
    _, path, _ = written[family]
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    loaded, report = load_checkpoint(path, dtype=str(dtype).split(".")[1])
    want = dict(list(ref.named_parameters()) + list(ref.named_buffers()))
    got = dict(list(loaded.named_parameters()) + list(loaded.named_buffers()))
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    assert report.bytes_held < report.bytes_read  # float32 on disk, half precision held
    if family == "deepseek_v3":
        assert got["model.layers.1.mlp.gate.weight"].dtype == torch.float32


# ---------------------------------------------------------------- other layouts


def _write(tensors, path: str, config_from: str, shards: int = 1) -> str:
    """``tensors`` as a checkpoint in ``shards`` files (with an index when more than one)."""
    from safetensors.torch import save_file

    os.makedirs(path)
    shutil.copy(os.path.join(config_from, "config.json"), path)
    keys = sorted(tensors)
    if shards == 1:
        save_file({k: tensors[k].contiguous() for k in keys}, os.path.join(path, "model.safetensors"))
        return path
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: tensors[k].contiguous() for k in part}, os.path.join(path, name))
        weight_map.update(dict.fromkeys(part, name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


def _state(path: str):
    from safetensors.torch import load_file

    out = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_fused_checkpoints_are_read_by_rows(written, tmp_path, family, shards):
    """Experts stored as [E, ...] tensors: each rank reads its rows of them."""
    original, path, _ = written[family]
    fused = _write(original.state_dict(), str(tmp_path / "fused"), path, shards)
    assert any(_FUSED_KEY.search(k) for k in _headers(fused))
    for rank in range(4):
        loaded, report = load_checkpoint(fused, rank=rank, world=4)
        _check_holds(original, loaded, report, rank, 4)
        assert report.bytes_read == _expected_read(fused, rank, 4)


class _MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, names=("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.names = names
        for name, (i, o) in zip(names, ((hidden, ffn), (hidden, ffn), (ffn, hidden))):
            setattr(self, name, nn.Linear(i, o, bias=False))


def _list_skeleton(names):
    """The loader's skeleton with every fused experts module replaced by an nn.ModuleList of MLPs."""
    from launch import checkpoint

    build = checkpoint._skeleton

    def skeleton(config):
        model = build(config)
        with torch.device("meta"):
            for layer in model.model.layers:
                if hasattr(layer.mlp, "experts"):
                    layer.mlp.experts = nn.ModuleList(_MLP(config.hidden_size, config.moe_intermediate_size, names)
                                                      for _ in range(8))
        return model
    return skeleton


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")])
@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_experts_held_as_a_list_of_mlps(written, tmp_path, monkeypatch, layout, names):
    original, path, _ = written["qwen3_moe"]
    if layout == "fused":
        path = _write(original.state_dict(), str(tmp_path / "fused"), path)
    monkeypatch.setattr("launch.checkpoint._skeleton", _list_skeleton(names))
    ref = original.state_dict()
    for rank in range(2):
        loaded, report = load_checkpoint(path, rank=rank, world=2)
        lo = 4 * rank
        for layer in (1, 2):
            experts = loaded.model.layers[layer].mlp.experts
            assert isinstance(experts, nn.ModuleList) and len(experts) == 4 and experts.ep_shard == (lo, 8)
            gate_up = ref[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
            down = ref[f"model.layers.{layer}.mlp.experts.down_proj"]
            for j, mlp in enumerate(experts):
                g, u, d = (getattr(mlp, n).weight for n in names)
                assert torch.equal(torch.cat([g, u]), gate_up[lo + j]) and torch.equal(d, down[lo + j])
        assert report.bytes_read == _expected_read(path, rank, 2)


def test_tied_embeddings_share_one_tensor(tmp_path):
    original = _model("qwen3_moe", tie_word_embeddings=True)
    path = _save(original, str(tmp_path / "tied"))
    assert "lm_head.weight" not in _headers(path)
    loaded, report = load_checkpoint(path, rank=1, world=2)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    _check_holds(original, loaded, report, 1, 2)


def test_tensors_the_model_has_no_place_for_are_reported_not_read(written, tmp_path):
    original, src, _ = written["glm4_moe"]
    extra = "model.layers.3.mlp.gate.weight"  # e.g. a multi-token-prediction layer the model does not build
    path = _rewrite(src, str(tmp_path / "extra"), lambda t: t.update({extra: torch.ones(8, 64)}))
    loaded, report = load_checkpoint(path, rank=0, world=2)
    assert report.ignored == (extra,) and report.bytes_read == _expected_read(path, 0, 2) - 8 * 64 * 4
    _check_holds(original, loaded, report, 0, 2)


def test_a_file_is_reopened_after_reopen_bytes(written, monkeypatch):
    """Each run of reads of about REOPEN_BYTES gets its own mapping of the file, released after."""
    import safetensors

    original, path, _ = written["mixtral"]
    opened = []
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    load_checkpoint(path, rank=1, world=2)
    assert len(opened) == 2  # its header, then its tensors
    monkeypatch.setattr("launch.checkpoint.REOPEN_BYTES", 1)
    loaded, report = load_checkpoint(path, rank=1, world=2)
    assert len(opened) == 2 + 1 + report.tensors_read  # its header, then every tensor on its own
    _check_holds(original, loaded, report, 1, 2)


def test_loads_onto_the_accelerator(written):
    device = default_device()
    if device.type == "cpu":
        pytest.skip("no accelerator on this path")
    _, path, _ = written["deepseek_v3"]
    on_cpu, _ = load_checkpoint(path, rank=1, world=2, dtype=torch.bfloat16)
    on_device, _ = load_checkpoint(path, rank=1, world=2, dtype=torch.bfloat16, device=device)
    want = dict(list(on_cpu.named_parameters()) + list(on_cpu.named_buffers()))
    for key, value in list(on_device.named_parameters()) + list(on_device.named_buffers()):
        assert value.device.type == device.type and torch.equal(value.cpu(), want[key]), key


def _group_body(ctx, path):
    model, report = load_checkpoint(path, group=ctx.group)
    return report.rank, report.world, report.sharded, model.model.layers[1].mlp.experts.gate_up_proj.shape[0]


@pytest.mark.cpu_only
def test_rank_and_world_come_from_the_group(written):
    _, path, _ = written["deepseek_v3"]
    results = run_ranks(_group_body, 2, path, timeout=120)
    assert [r[:2] for r in results] == [(0, 2), (1, 2)]
    assert results[1][2]["model.layers.2.mlp.experts"] == (4, 8) and results[1][3] == 4


# ---------------------------------------------------------------- errors


def _rewrite(src: str, dst: str, change) -> str:
    tensors = _state(src)
    change(tensors)
    return _write(tensors, dst, src)


def test_a_folder_without_config_or_weights(tmp_path, written):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(str(tmp_path))
    shutil.copy(os.path.join(written["qwen3_moe"][1], "config.json"), tmp_path)
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        load_checkpoint(str(tmp_path))
    assert issubclass(CheckpointError, ValueError)


def _quantized(src: str, dst: str) -> str:
    """A copy of the checkpoint ``src`` whose config.json says its weights are FP8, as DeepSeek-V3's does."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def test_a_quantized_checkpoint_is_refused_before_any_read(written, tmp_path):
    from launch.checkpoint import check_checkpoint

    path = _quantized(written["qwen3_moe"][1], str(tmp_path / "fp8"))
    for load in (load_checkpoint, check_checkpoint):
        with pytest.raises(CheckpointError, match=r"config\.json: a quantized checkpoint \(fp8\) is not supported"):
            load(path)
    assert check_checkpoint(written["qwen3_moe"][2]).model_type == "qwen3_moe"


def _launch_two_ranks(path: str):
    """The launcher on 2 ranks started by hand (each rank's own exit status) on the checkpoint ``path``."""
    from test_launcher_faults import _all_text, _by_hand

    outs = _by_hand([["--model", path, "--warmup", "0", "--iters", "1", "--batch", "2", "--seq-len", "8"]] * 2)
    return [rc for rc, _, _ in outs], _all_text(outs)


@pytest.mark.spawns_ranks
def test_the_launcher_refuses_a_quantized_checkpoint_in_one_line(tmp_path):
    model = _model("qwen3_moe")
    path = _quantized(_save(model, str(tmp_path / "bf16")), str(tmp_path / "fp8"))
    codes, text = _launch_two_ranks(path)
    assert codes == [2, 2], text[-3000:]
    assert text.count("quantized") == 1 and "a quantized checkpoint (fp8) is not supported" in text, text[-3000:]
    assert "unexpected error" not in text and "Traceback" not in text, text[-3000:]


@pytest.mark.spawns_ranks
def test_a_tensor_one_rank_misses_stops_every_rank_in_one_line(written, tmp_path):
    expert = "model.layers.1.mlp.experts.5.up_proj.weight"  # rank 1 of 2 holds experts 4-7
    path = _rewrite(written["qwen3_moe"][1], str(tmp_path / "no_expert"), lambda t: t.pop(expert))
    codes, text = _launch_two_ranks(path)
    assert codes == [2, 2], text[-3000:]
    assert text.count(f"rank 1: tensor {expert} is not in the checkpoint") == 1, text[-3000:]
    assert "unexpected error" not in text and "Traceback" not in text, text[-3000:]


def test_configs_that_are_not_an_moe_causal_lm(tmp_path):
    llama = transformers.AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, vocab_size=64)
    path = _save(transformers.AutoModelForCausalLM.from_config(llama), str(tmp_path / "llama"))
    with pytest.raises(CheckpointError, match="no routed experts"):
        load_checkpoint(path)
    t5 = transformers.AutoConfig.for_model("t5", d_model=32, num_layers=1, num_heads=2, d_ff=64, d_kv=16,
                                           vocab_size=64)
    os.makedirs(tmp_path / "t5")
    t5.save_pretrained(str(tmp_path / "t5"))
    shutil.copy(os.path.join(path, "model.safetensors"), tmp_path / "t5")
    with pytest.raises(CheckpointError, match="'t5' is not a causal LM") as info:
        load_checkpoint(str(tmp_path / "t5"))
    assert "\n" not in str(info.value)


def test_experts_that_the_ranks_cannot_share(written):
    with pytest.raises(CheckpointError, match="8 experts.*3 ranks.*multiple"):
        load_checkpoint(written["mixtral"][1], rank=0, world=3)


def test_bad_ranks(written):
    path = written["mixtral"][1]
    with pytest.raises(CheckpointError, match="rank 2 is not a rank of a group of 2"):
        load_checkpoint(path, rank=2, world=2)
    with pytest.raises(CheckpointError, match="give both"):
        load_checkpoint(path, rank=1)


def test_missing_tensors_name_the_tensor_and_the_files(written, tmp_path):
    src = written["qwen3_moe"][1]
    expert = "model.layers.1.mlp.experts.5.up_proj.weight"
    path = _rewrite(src, str(tmp_path / "no_expert"), lambda t: t.pop(expert))
    load_checkpoint(path, rank=0, world=2)  # rank 0 does not need expert 5: it never looks at it
    with pytest.raises(CheckpointError, match=re.escape(expert) + ".*" + re.escape(path)):
        load_checkpoint(path, rank=1, world=2)
    path = _rewrite(src, str(tmp_path / "no_norm"), lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight is not in the checkpoint"):
        load_checkpoint(path)
    path = _rewrite(src, str(tmp_path / "no_experts"),
                    lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.2.mlp.experts.")])
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.gate_up_proj is not in"):
        load_checkpoint(path)


def test_mis_shaped_tensors_name_the_tensor_and_the_file(written, tmp_path):
    src = written["deepseek_v3"][2]
    key = "model.layers.1.self_attn.q_b_proj.weight"
    path = _rewrite(src, str(tmp_path / "bad"), lambda t: t.update({key: t[key][:-1]}))
    with pytest.raises(CheckpointError, match=re.escape(key) + r" in .*model\.safetensors has shape \[63, 24\], "
                                               r"the model expects \[64, 24\]"):
        load_checkpoint(path)
    key = "model.layers.2.mlp.experts.6.down_proj.weight"
    path = _rewrite(src, str(tmp_path / "bad_expert"), lambda t: t.update({key: t[key][:, :-1]}))
    with pytest.raises(CheckpointError, match=re.escape(key) + ".* has shape"):
        load_checkpoint(path, rank=3, world=4)


def test_an_index_naming_a_missing_shard(written, tmp_path):
    path = str(tmp_path / "sharded")
    shutil.copytree(written["glm4_moe"][2], path)
    shard = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))[-1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(CheckpointError, match=f"names {shard}, which is not in"):
        load_checkpoint(path)


# ---------------------------------------------------------------- memory

_MEASURE = r"""
import re, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
from launch.checkpoint import load_checkpoint

def peak():
    return int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

path = sys.argv[1]
with torch.device("meta"):  # import the family's modules before measuring
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
for rank in range(4):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident size restarts from the current one
    before = peak()
    model, report = load_checkpoint(path, rank=rank, world=4)
    print(peak() - before, report.bytes_read, report.checkpoint_bytes, flush=True)
    del model
"""


def test_a_ranks_peak_memory_stays_below_the_checkpoint(tmp_path):
    """Peak resident growth while loading, per rank of 4: its weights plus the file pages it touched."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to restart the peak resident size")
    original = _model("qwen3_moe", hidden_size=256, num_hidden_layers=2, head_dim=64, vocab_size=256,
                      intermediate_size=512, moe_intermediate_size=1024, mlp_only_layers=[])
    path = _save(original, str(tmp_path / "big"))
    del original
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _MEASURE, path], capture_output=True, text=True, env=env,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [tuple(map(int, line.split())) for line in out.stdout.split("\n") if line.strip()]
    assert len(rows) == 4
    for grew, read, whole in rows:
        assert whole > 48 * 2**20 and read < whole * 0.3
        # the tensors it keeps, and the pages of the file it copied them from (released with the file)
        assert grew < whole and grew < 2 * read + 8 * 2**20, rows
