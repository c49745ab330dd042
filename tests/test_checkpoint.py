"""launch/models/checkpoint.py: each rank loads a transformers MoE checkpoint holding its own routed experts only.

Tiny checkpoints of five families are written with ``save_pretrained`` (no downloads), whole and
in several shards, and in the fused layout; every rank of 1, 2 and 4 must hold exactly the
original's tensors (its experts' rows only) and read no more than that. Damaged copies of them
(files, index, config fields, tensors left over, NaN) must each be refused in one line, by
`check_checkpoint` and every rank's `load_checkpoint`, and by the launcher with exit 2 on every rank.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

from launch.models.checkpoint import CheckpointError, LoadReport, check_checkpoint, load_checkpoint
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
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4),
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
    """Cast like from_pretrained, parameter by parameter (DeepSeek-V3's router and bias kept in float32 where this
    transformers keeps them: 5.25 does, 5.17 does not)."""
    _, path, _ = written[family]
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    loaded, report = load_checkpoint(path, dtype=str(dtype).split(".")[1])
    want = dict(list(ref.named_parameters()) + list(ref.named_buffers()))
    got = dict(list(loaded.named_parameters()) + list(loaded.named_buffers()))
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    assert report.bytes_held < report.bytes_read  # float32 on disk, half precision held


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
    from launch.models import checkpoint

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
    monkeypatch.setattr("launch.models.checkpoint._skeleton", _list_skeleton(names))
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


def test_a_file_is_reopened_after_reopen_bytes(written, monkeypatch):
    """Each run of reads of about REOPEN_BYTES gets its own mapping of the file, released after."""
    import safetensors

    original, path, _ = written["mixtral"]
    opened = []
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    load_checkpoint(path, rank=1, world=2)
    assert len(opened) == 2  # its header, then its tensors
    monkeypatch.setattr("launch.models.checkpoint.REOPEN_BYTES", 1)
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
    """A copy of the checkpoint ``src`` whose config.json says its weights are AWQ (a format the loader does not
    read; FP8 and W8A8 are read: tests/test_quantized_checkpoints.py)."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def test_a_quantized_checkpoint_is_refused_before_any_read(written, tmp_path):
    path = _quantized(written["qwen3_moe"][1], str(tmp_path / "awq"))
    for load in (load_checkpoint, check_checkpoint):
        with pytest.raises(CheckpointError, match=r"config\.json: a quantized checkpoint \(awq\) is not supported; "
                                                  r"supported: quant_method fp8"):
            load(path)
    assert check_checkpoint(written["qwen3_moe"][2]).model_type == "qwen3_moe"


def _launch_two_ranks(path: str, *more: str):
    """The launcher on 2 ranks started by hand (each rank's own exit status) on the checkpoint ``path``."""
    from support.launcher import all_text, by_hand

    outs = by_hand([["--model", path, "--warmup", "0", "--iters", "1", "--batch", "2", "--seq-len", "8", *more]] * 2)
    return [rc for rc, _, _ in outs], all_text(outs)


@pytest.mark.spawns_ranks
def test_the_launcher_refuses_a_quantized_checkpoint_in_one_line(tmp_path):
    model = _model("qwen3_moe")
    path = _quantized(_save(model, str(tmp_path / "bf16")), str(tmp_path / "awq"))
    codes, text = _launch_two_ranks(path)
    assert codes == [2, 2], text[-3000:]
    assert text.count("quantized") == 1 and "a quantized checkpoint (awq) is not supported" in text, text[-3000:]
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
    for rank in range(2):  # rank 0 does not read expert 5, but a checkpoint is used whole or not at all
        with pytest.raises(CheckpointError, match=re.escape(expert) + ".*" + re.escape(path)):
            load_checkpoint(path, rank=rank, world=2)
    with pytest.raises(CheckpointError, match=re.escape(expert)):
        check_checkpoint(path)
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


# ---------------------------------------------------------------- damaged checkpoints (issue 25)


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _with_config(src: str, dst: str, **fields) -> str:
    """A copy of the checkpoint ``src`` whose config.json has ``fields`` changed."""
    _copy(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config.update(fields)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def _rank1_only(src: str, dst: str) -> str:
    """``src``'s tensors in two files with an index, the second holding only rank 1's experts (4-7 of 8)."""
    from safetensors.torch import save_file

    tensors = _state(src)
    second = {k for k in tensors if (m := _EXPERT_KEY.search(k)) and int(m.group(1)) >= 4}
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    weight_map = {}
    for name, keys in (("model-00001-of-00002.safetensors", set(tensors) - second),
                       ("model-00002-of-00002.safetensors", second)):
        save_file({k: tensors[k].contiguous() for k in sorted(keys)}, os.path.join(dst, name))
        weight_map.update(dict.fromkeys(keys, name))
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return dst


def _truncate(file: str, keep: float = 0.5) -> None:
    os.truncate(file, int(os.path.getsize(file) * keep))


def _write_index(path: str, text: str) -> None:
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        f.write(text)


def _damaged(kind: str, written, tmp_path) -> str:
    """A checkpoint folder damaged as ``kind`` says (qwen3_moe, 8 experts, top-2, 3 layers, hidden 64)."""
    whole, dst = written["qwen3_moe"][1], str(tmp_path / kind.replace(" ", "_"))
    split = os.path.join(dst, "model-00002-of-00002.safetensors")  # rank 1's experts only, in _rank1_only
    single = os.path.join(dst, "model.safetensors")
    if kind == "truncated file":
        _truncate(os.path.join(_copy(whole, dst), "model.safetensors"))
    elif kind == "empty file":
        _copy(whole, dst)
        open(single, "w").close()
    elif kind == "garbage header":
        _copy(whole, dst)
        with open(single, "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header!!}" + bytes(64))
    elif kind == "truncated shard of rank 1's experts":
        _rank1_only(whole, dst)
        _truncate(split, 0.9)
    elif kind == "missing shard":
        _rank1_only(whole, dst)
        os.remove(split)
    elif kind == "shard is a directory":
        _rank1_only(whole, dst)
        os.remove(split)
        os.mkdir(split)
    elif kind == "shard is a symlink loop":
        _rank1_only(whole, dst)
        os.remove(split)
        os.symlink(os.path.basename(split), split)
    elif kind == "file is a symlink loop":
        _copy(whole, dst)
        os.remove(single)
        os.symlink("model.safetensors", single)
    elif kind == "dangling symlink":
        _copy(whole, dst)
        os.remove(single)
        os.symlink("nowhere.safetensors", single)
    elif kind.startswith("index "):
        _rank1_only(whole, dst)
        _write_index(dst, {"index not json": "{not json", "index map is a list": '{"weight_map": []}',
                           "index names no file": '{"weight_map": {"lm_head.weight": null}}',
                           "index leaves the folder": '{"weight_map": {"lm_head.weight": "../x.safetensors"}}',
                           "index names nothing": '{"weight_map": {}}'}[kind])
    elif kind == "pytorch weights only":
        _copy(whole, dst)
        os.remove(single)
        torch.save(_state(whole), os.path.join(dst, "pytorch_model.bin"))
    else:
        raise ValueError(kind)
    return dst


DAMAGED = {
    "truncated file": r"model\.safetensors: not a readable safetensors file \(.*incomplete metadata",
    "empty file": r"model\.safetensors: not a readable safetensors file \(.*header too small",
    "garbage header": r"model\.safetensors: not a readable safetensors file",
    "truncated shard of rank 1's experts": r"model-00002-of-00002\.safetensors: not a readable safetensors file",
    "missing shard": r"index\.json names model-00002-of-00002\.safetensors, which is not in ",
    "shard is a directory": r"names model-00002-of-00002\.safetensors, which is a directory, not a safetensors file",
    "shard is a symlink loop": r"names model-00002-of-00002\.safetensors, which is a symbolic link loop",
    "file is a symlink loop": r"model\.safetensors is a symbolic link loop",
    "dangling symlink": r"model\.safetensors is a symbolic link to nowhere\.safetensors, which does not exist",
    "index not json": r"index\.json: not a safetensors index with a weight_map \(Expecting",
    "index map is a list": r"index\.json: its weight_map is a list, not a map of tensor names to file names",
    "index names no file": r"index\.json: its weight_map places tensor lm_head\.weight in None, which is not the "
                           r"name of a file",
    "index leaves the folder": r"places tensor lm_head\.weight in '\.\./x\.safetensors', which is not the name",
    "index names nothing": r"index\.json: its weight_map names no tensor",
    "pytorch weights only": r"no safetensors weights .*\(it holds pytorch_model\.bin: the loader reads safetensors "
                            r"only",
}


def _refused(path: str, pattern: str, world: int = 2) -> None:
    """``check_checkpoint`` and every rank's ``load_checkpoint`` refuse ``path`` in one line matching ``pattern``."""
    for load in [lambda: check_checkpoint(path, world=world)] + [
            lambda r=r: load_checkpoint(path, rank=r, world=world) for r in range(world)]:
        with pytest.raises(CheckpointError, match=pattern) as info:
            load()
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("kind", list(DAMAGED))
def test_damaged_files_are_refused_in_one_line_naming_the_problem(written, tmp_path, kind):
    _refused(_damaged(kind, written, tmp_path), DAMAGED[kind])


BAD_CONFIGS = {  # config.json fields -> what the one line says (qwen3_moe unless deepseek_v3 is named)
    "top-k 0": (dict(num_experts_per_tok=0), r"config\.json: num_experts_per_tok is 0, must be an integer in 1\.\.8 "
                                             r"\(the experts each token is routed to, of num_local_experts 8\)"),
    "top-k 9": (dict(num_experts_per_tok=9), r"config\.json: num_experts_per_tok is 9, must be an integer in 1\.\.8"),
    "top-k a string": (dict(num_experts_per_tok="2"), r"config\.json: not a transformers config \(.*"
                                                      r"num_experts_per_tok"),
    "layers a string": (dict(num_hidden_layers="x"), r"config\.json: not a transformers config \(.*num_hidden_layers"),
    "dtype unknown": (dict(dtype="bogus"), r"config\.json: not a transformers config \(.*bogus"),
    "no experts": (dict(num_local_experts=0), r"config\.json: num_local_experts is 0, must be an integer >= 1"),
    "decoder_sparse_step 0": (dict(decoder_sparse_step=0), r"config\.json: decoder_sparse_step is 0, must be an "
                                                           r"integer in 1\.\.3"),
    "mlp_only_layers out of range": (dict(mlp_only_layers=[5]), r"config\.json: mlp_only_layers is \[5\], must list "
                                                                r"layer indices in 0\.\.2"),
    "key-value heads": (dict(num_key_value_heads=3), r"config\.json: num_attention_heads is 4 and "
                                                     r"num_key_value_heads 3"),
    "deepseek_v3 groups of one expert": (dict(n_group=8, topk_group=1), r"config\.json: n_group is 8: the router "
                                                                        r"splits the 8 experts"),
    "deepseek_v3 uneven groups": (dict(n_group=3, topk_group=1), r"config\.json: n_group is 3"),
    "deepseek_v3 topk_group": (dict(n_group=2, topk_group=3), r"config\.json: topk_group is 3, must be an integer in "
                                                              r"1\.\.2"),
    "deepseek_v3 top-k over the groups": (dict(n_group=4, topk_group=1, num_experts_per_tok=3),
                                          r"num_experts_per_tok is 3, more than the 2 experts of the topk_group 1 "
                                          r"groups"),
    "deepseek_v3 latent attention with fewer key-value heads": (dict(num_key_value_heads=2), r"config\.json: "
                                                                r"num_key_value_heads is 2, must equal "
                                                                r"num_attention_heads 4 with multi-head latent "
                                                                r"attention"),
    "deepseek_v3 all dense": (dict(first_k_dense_replace=3), r"config\.json: first_k_dense_replace is 3, must be an "
                                                             r"integer in 0\.\.2"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_a_config_the_router_or_the_loader_cannot_run_names_its_field(written, tmp_path, case):
    """top-k 0 / 9 failed inside the forward (`cannot reshape tensor of 0 elements`, `selected index k out
    of range`); each is refused before any read, naming the field and its value."""
    family = "deepseek_v3" if case.startswith("deepseek_v3") else "qwen3_moe"
    fields, pattern = BAD_CONFIGS[case]
    _refused(_with_config(written[family][1], str(tmp_path / "bad"), **fields), pattern)


def test_experts_the_ranks_cannot_share_are_refused_by_the_check(written):
    with pytest.raises(CheckpointError, match=r"config\.json: num_local_experts is 8, and 8 experts cannot be shared "
                                              r"equally by 3 ranks"):
        check_checkpoint(written["qwen3_moe"][1], world=3)
    assert check_checkpoint(written["qwen3_moe"][1], world=4).num_local_experts == 8


WRONG_MODELS = {  # config.json fields that do not describe the weights -> what the one line says
    "hidden size": (dict(hidden_size=32), r"tensor model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight in .* has "
                                          r"shape \[32, 64\], the model expects \[32, 32\]"),
    "more experts": (dict(num_local_experts=16), r"tensor model\.layers\.1\.mlp\.experts\.8\.gate_proj\.weight is not "
                                                 r"in the checkpoint"),
    "fewer experts": (dict(num_local_experts=4), r"model\.layers\.1\.mlp\.gate\.weight in .* has shape \[8, 64\], "
                                                 r"the model expects \[4, 64\]"),
    "more layers": (dict(num_hidden_layers=4), r"tensor model\.layers\.3\..* is not in the checkpoint"),
    "fewer layers": (dict(num_hidden_layers=2), r"33 tensors of the checkpoint have no place in the model .*config"
                                                r"\.json describes \(num_hidden_layers is 2, yet the files hold layer "
                                                r"2\): model\.layers\.2\.input_layernorm\.weight, .* and 30 more; a "
                                                r"checkpoint is used whole or not at all"),
    "another family": (dict(model_type="mixtral", architectures=["MixtralForCausalLM"]),
                       r"tensor model\.layers\.0\.mlp\.experts\..* is not in the checkpoint"),
}


@pytest.mark.parametrize("case", list(WRONG_MODELS))
def test_a_config_that_does_not_describe_the_weights_is_refused_before_any_read(written, tmp_path, case):
    """`check_checkpoint` (what the launcher runs before any rank joins) finds it, on every rank alike."""
    fields, pattern = WRONG_MODELS[case]
    _refused(_with_config(written["qwen3_moe"][1], str(tmp_path / "wrong"), **fields), pattern)


def _add(tensors, extra):
    tensors.update(extra)


EXTRA = {  # tensors added to a qwen3_moe checkpoint that the model has no place for -> what the line names
    "an attention bias": ({"model.layers.1.self_attn.q_proj.bias": torch.ones(64)},
                          r"^1 tensor of the checkpoint has no place in the model .* describes: "
                          r"model\.layers\.1\.self_attn\.q_proj\.bias; a checkpoint is used whole"),
    "quantization scales": ({f"model.layers.{i}.self_attn.{p}_proj.weight_scale_inv": torch.ones(1, 1)
                             for i in range(3) for p in "qk"},
                            r"^6 tensors .*: model\.layers\.0\.self_attn\.k_proj\.weight_scale_inv, "
                            r"model\.layers\.0\.self_attn\.q_proj\.weight_scale_inv, .* and 3 more"),
    "an expert beyond the count": ({f"model.layers.2.mlp.experts.8.{p}.weight": torch.ones(32, 64) for p in
                                    ("gate_proj", "up_proj")},
                                   r"^2 tensors .*: model\.layers\.2\.mlp\.experts\.8\.gate_proj\.weight, "
                                   r"model\.layers\.2\.mlp\.experts\.8\.up_proj\.weight;"),
    "a layer beyond the count": ({"model.layers.3.input_layernorm.weight": torch.ones(64)},
                                 r"\(num_hidden_layers is 3, yet the files hold layer 3\): "
                                 r"model\.layers\.3\.input_layernorm\.weight"),
}


@pytest.mark.parametrize("case", list(EXTRA))
def test_tensors_the_model_has_no_place_for_are_refused_not_ignored(written, tmp_path, case):
    """The loader used to skip them without a word (a bias, scales of a quantized format, an expert or a
    layer the config does not count): a model without them computes something else."""
    extra, pattern = EXTRA[case]
    _refused(_rewrite(written["qwen3_moe"][1], str(tmp_path / "extra"), lambda t: _add(t, extra)), pattern)


def _mtp_layer(i: int, hidden: int = 64):
    """The tensors of a DeepSeek-V3 style multi-token-prediction layer ``i`` (its own projection and norms)."""
    return {f"model.layers.{i}.eh_proj.weight": torch.ones(hidden, 2 * hidden),
            f"model.layers.{i}.enorm.weight": torch.ones(hidden), f"model.layers.{i}.hnorm.weight": torch.ones(hidden),
            f"model.layers.{i}.shared_head.norm.weight": torch.ones(hidden),
            f"model.layers.{i}.input_layernorm.weight": torch.ones(hidden),
            f"model.layers.{i}.mlp.experts.0.gate_proj.weight": torch.ones(32, hidden)}


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_a_multi_token_prediction_layer_is_not_read_and_said(written, tmp_path, family):
    """DeepSeek-V3 and GLM-4.5 store one MTP layer after the model's own (``num_nextn_predict_layers``):
    the model does not run it; no rank reads it, and the report says so."""
    original, src, _ = written[family]
    mtp = _mtp_layer(3)
    path = _rewrite(src, str(tmp_path / "mtp"), lambda t: _add(t, mtp))
    for rank in range(2):
        loaded, report = load_checkpoint(path, rank=rank, world=2)
        _check_holds(original, loaded, report, rank, 2)
        assert report.ignored == tuple(sorted(mtp)) and report.bytes_read == _expected_read(src, rank, 2)
        assert report.skipped == ("6 tensors of multi-token-prediction layer 3 (model.layers.3.*), which the model "
                                  "does not run",)
    check_checkpoint(path)
    no_mtp = _with_config(path, str(tmp_path / "no_mtp"), num_nextn_predict_layers=0)
    _refused(no_mtp, r"^6 tensors of the checkpoint have no place .*\(num_hidden_layers is 3, yet the files hold "
                     r"layer 3\)")
    not_mtp = _rewrite(src, str(tmp_path / "not_mtp"), lambda t: _add(t, {k: v for k, v in mtp.items()
                                                                           if "eh_proj" not in k}))
    _refused(not_mtp, r"^5 tensors of the checkpoint have no place")  # a layer without eh_proj is no MTP layer


def test_tied_copies_computed_buffers_and_other_formats_are_not_read_and_said(tmp_path):
    original = _model("qwen3_moe", tie_word_embeddings=True)
    src = _save(original, str(tmp_path / "tied"))
    embed = _state(src)["model.embed_tokens.weight"]
    path = _rewrite(src, str(tmp_path / "more"), lambda t: _add(t, {"lm_head.weight": embed,
                                                                    "model.rotary_emb.inv_freq": torch.ones(8)}))
    torch.save({}, os.path.join(path, "pytorch_model.bin"))
    loaded, report = load_checkpoint(path, rank=1, world=2)
    _check_holds(original, loaded, report, 1, 2)
    assert report.ignored == ("lm_head.weight", "model.rotary_emb.inv_freq")
    assert report.skipped == (
        "lm_head.weight (tied to model.embed_tokens.weight, which is read)",
        "1 tensor that the model computes itself (model.rotary_emb.inv_freq)",
        "1 file of weights in another format (the safetensors files are read): pytorch_model.bin")


@pytest.mark.parametrize("layout", ["sharded", "whole"])
def test_safetensors_files_beside_the_checkpoint_are_not_read_and_said(written, tmp_path, layout):
    """A consolidated.safetensors beside the index, or beside model.safetensors (as Mistral's releases
    ship): transformers reads only what the index names, or model.safetensors; so does the loader."""
    path = _copy(written["qwen3_moe"][2 if layout == "sharded" else 1], str(tmp_path / layout))
    stray = os.path.join(path, "consolidated.safetensors")
    shutil.copy(os.path.join(written["qwen3_moe"][1], "model.safetensors"), stray)
    _, report = load_checkpoint(path, rank=0, world=2)
    where = "that model.safetensors.index.json does not name" if layout == "sharded" else "beside model.safetensors"
    assert report.ignored == () and report.skipped == (f"1 file {where}: consolidated.safetensors",)


def test_a_dtype_no_model_is_held_in_is_refused(written, tmp_path):
    """An integer or float8 dtype (given, or the config's) would cast the weights without a quantized
    format's scales: garbage, or a model that cannot run."""
    src = written["qwen3_moe"][1]
    with pytest.raises(CheckpointError, match=r"^dtype: int8 is not a dtype to hold a model in \(one of float32, "):
        load_checkpoint(src, dtype="int8")
    with pytest.raises(CheckpointError, match=r"^dtype: 'bogus' is not a torch dtype$"):
        load_checkpoint(src, dtype="bogus")
    path = _with_config(src, str(tmp_path / "fp8"), dtype="float8_e4m3fn")  # transformers builds the model in it
    _refused(path, r"config\.json: dtype: float8_e4m3fn is not a dtype to hold a model in")
    assert load_checkpoint(src, dtype=torch.bfloat16)[0].model.norm.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("chunk", [None, 7])
def test_non_finite_weights_are_refused_by_the_rank_that_reads_them(written, tmp_path, monkeypatch, chunk):
    """NaN in a stored weight, or a value beyond the loading dtype's range (inf once cast): one line
    naming the tensor, from the rank that reads it (the launcher stops every rank with it); the same
    when large tensors are looked at in chunks."""
    if chunk:
        monkeypatch.setattr("launch.models.checkpoint.FINITE_CHUNK", chunk)
    key = "model.layers.1.mlp.experts.5.up_proj.weight"  # rank 1 of 2 holds experts 4-7

    def poison(t, value):
        t[key] = t[key].clone()
        t[key][3, 4] = value
    path = _rewrite(written["qwen3_moe"][1], str(tmp_path / "nan"), lambda t: poison(t, math.nan))
    load_checkpoint(path, rank=0, world=2)  # what it holds is finite
    with pytest.raises(CheckpointError, match=re.escape(key) + r" in .*model\.safetensors holds 1 NaN or inf value: "
                                                               r"the model would compute NaN or inf$"):
        load_checkpoint(path, rank=1, world=2)
    path = _rewrite(written["qwen3_moe"][1], str(tmp_path / "big"), lambda t: poison(t, 1e6))
    load_checkpoint(path, rank=1, world=2, dtype=torch.float32)
    with pytest.raises(CheckpointError, match=re.escape(key) + r" .* holds 1 NaN or inf value once cast to float16 "
                                                               r"\(stored float32: out of its range\)"):
        load_checkpoint(path, rank=1, world=2, dtype=torch.float16)
    path = _rewrite(written["qwen3_moe"][1], str(tmp_path / "inf"), lambda t: poison(t, math.inf))
    with pytest.raises(CheckpointError, match=re.escape(key) + r" .* holds 1 NaN or inf value: the model"):
        load_checkpoint(path, rank=1, world=2, dtype=torch.float16)  # inf as stored: not the cast's doing


def test_a_file_that_cannot_be_read_when_loading_is_one_line(written, monkeypatch):
    """Changed or gone between its header and its tensors (another process rewrote the folder)."""
    import safetensors

    real, opened = safetensors.safe_open, []

    def flaky(file, *a, **k):
        opened.append(file)
        if len(opened) > 1:  # its header was read
            raise OSError(5, "Input/output error")
        return real(file, *a, **k)
    monkeypatch.setattr(safetensors, "safe_open", flaky)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot be read now \(.*Input/output error\)$"):
        load_checkpoint(written["qwen3_moe"][1], rank=1, world=2)


LAUNCHER_CASES = {  # a damaged checkpoint -> what the one line says (once), on 2 ranks, both exiting 2
    "truncated shard of rank 1's experts": DAMAGED["truncated shard of rank 1's experts"],
    "shard is a directory": DAMAGED["shard is a directory"],
    "top-k 9": BAD_CONFIGS["top-k 9"][1],
    "fewer layers": WRONG_MODELS["fewer layers"][1],
    "missing expert of rank 1": r"tensor model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight is not in the checkpoint",
    "NaN in an expert of rank 1": r"rank 1: tensor model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight in .* holds 64 "
                                  r"NaN or inf values",
}


def _launcher_case(case: str, written, tmp_path) -> str:
    src, dst, expert = written["qwen3_moe"][1], str(tmp_path / "ckpt"), "model.layers.1.mlp.experts.5.up_proj.weight"
    if case in DAMAGED:
        return _damaged(case, written, tmp_path)
    if case in BAD_CONFIGS:
        return _with_config(src, dst, **BAD_CONFIGS[case][0])
    if case in WRONG_MODELS:
        return _with_config(src, dst, **WRONG_MODELS[case][0])
    if case == "missing expert of rank 1":
        return _rewrite(src, dst, lambda t: t.pop(expert))
    return _rewrite(src, dst, lambda t: t.update({expert: t[expert].index_fill(0, torch.tensor([3]), math.nan)}))


@pytest.mark.spawns_ranks
@pytest.mark.parametrize("case", list(LAUNCHER_CASES))
def test_the_launcher_refuses_a_damaged_checkpoint_in_one_line_on_every_rank(written, tmp_path, case):
    """`--model PATH` on 2 ranks: each case is one line, once, exit 2 on both ranks, no traceback (a
    rank-1-only NaN is found only by rank 1, while loading: every rank stops with it before a collective)."""
    codes, text = _launch_two_ranks(_launcher_case(case, written, tmp_path))
    assert codes == [2, 2], text[-3000:]
    lines = [line for line in text.splitlines() if re.search(LAUNCHER_CASES[case], line)]
    assert len(lines) == 1 and lines[0].startswith("Error: "), text[-3000:]
    assert "unexpected error" not in text and "Traceback" not in text, text[-3000:]


@pytest.mark.spawns_ranks
def test_the_launcher_says_what_it_does_not_read(written, tmp_path):
    path = _rewrite(written["deepseek_v3"][1], str(tmp_path / "mtp"), lambda t: _add(t, _mtp_layer(3)))
    codes, text = _launch_two_ranks(path, "--mode", "serial")
    assert codes == [0, 0], text[-3000:]
    assert text.count("weights: not read, by design: 6 tensors of multi-token-prediction layer 3 (model.layers.3.*), "
                      "which the model does not run\n") == 1, text[-3000:]


# ---------------------------------------------------------------- memory

_MEASURE = r"""
import re, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
from launch.models.checkpoint import load_checkpoint

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


def test_a_checkpoint_of_a_family_the_adapter_does_not_run_is_refused_before_the_load(tmp_path):
    """--model PATH passes the family check that --model NAME does: one line, not a failure halfway through."""
    from launch.config import ConfigError, job_config
    from launch.models import small_config

    torch.manual_seed(0)
    config = small_config("minimax", {"n_layers": 2, "hidden": 64, "n_experts": 4, "top_k": 2})
    path = _save(transformers.AutoModelForCausalLM.from_config(config), str(tmp_path / "minimax"))
    with pytest.raises(ConfigError, match=r"a minimax checkpoint: the adapter cannot run minimax") as err:
        job_config(world=1, device="cpu", exec_path="auto", mode="serial", kv_offload=False, kv_store="memory",
                   preset_name="tiny", overrides={}, batch=1, seq_len=8, seq_lens=None, dtype="float32", warmup=0,
                   iters=1, seed=0, check=False, out_dir=None, cpu_link="0.1", timeout=30.0, model_name=path)
    assert "\n" not in str(err.value.message)


@pytest.mark.parametrize("family, field", [("mixtral", "num_local_experts"), ("deepseek_v3", "n_routed_experts")])
def test_a_checkpoint_whose_experts_the_ranks_cannot_share_names_its_count_and_the_ranks(written, family, field):
    """8 experts on 3 ranks: the checkpoint's count (and its config.json's field) and the rank counts that run it,
    not --experts, an option a checkpoint does not take (it is refused with one)."""
    from launch.config import ConfigError, job_config

    path = written[family][1]
    with pytest.raises(ConfigError) as err:
        job_config(world=3, device="cpu", exec_path="auto", mode="serial", kv_offload=False, kv_store="memory",
                   preset_name="tiny", overrides={}, batch=1, seq_len=8, seq_lens=None, dtype="float32", warmup=0,
                   iters=1, seed=0, check=False, out_dir=None, cpu_link="0.1", timeout=30.0, model_name=path)
    assert err.value.message == (f"--model {path}: the checkpoint has 8 routed experts per MoE layer ({field} in its "
                                 f"config.json), which 3 ranks cannot share equally: run it on 1, 2, 4 or 8 ranks")


# ---------------------------------------------------------------- generation settings


def _settings_folder(tmp_path, config=None, generation=None):
    """A folder holding only the JSON files `generation_settings` reads."""
    (tmp_path / "config.json").write_text(json.dumps(config or {}))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


@pytest.mark.parametrize("config, generation, stop, source", [
    ({"eos_token_id": 2}, None, 2, "config.json"),
    ({"eos_token_id": 2}, {"eos_token_id": 5}, 5, "generation_config.json"),
    ({"eos_token_id": 2}, {"do_sample": False}, 2, "config.json"),
    ({}, {"eos_token_id": [7]}, 7, "generation_config.json"),
    ({}, {"eos_token_id": [7, 7]}, 7, "generation_config.json"),
    ({}, None, None, None),
], ids=["config", "generation-config-wins", "generation-config-without-eos", "a-list-of-one", "a-list-of-one-id",
        "none"])
def test_a_checkpoints_stop_token_follows_transformers_rule(tmp_path, config, generation, stop, source):
    """eos_token_id of generation_config.json where it sets one, else config.json's (before: neither was read)."""
    from launch.models import generation_settings

    got = generation_settings(_settings_folder(tmp_path, config, generation), vocab=128)
    assert got.stop_token == stop
    assert (os.path.basename(got.stop_file) if got.stop_file else None) == source
    assert generation_settings(tmp_path, vocab=128, read_eos=False).stop_token is None  # --stop-token given: unread


@pytest.mark.parametrize("config, generation, words", [
    ({}, {"eos_token_id": [1, 2]}, ["generation_config.json", "eos_token_id is [1, 2]", "several stop tokens"]),
    ({"eos_token_id": 500}, None, ["config.json", "eos_token_id is 500", "[0, 128)"]),
    ({"eos_token_id": "2"}, None, ["config.json", "eos_token_id is '2'"]),
    ({"eos_token_id": True}, None, ["config.json", "eos_token_id is True"]),
    ({"max_position_embeddings": 0}, None, ["config.json", "max_position_embeddings is 0", ">= 1"]),
    ({"max_position_embeddings": -4}, None, ["config.json", "max_position_embeddings is -4"]),
    ({"max_position_embeddings": 16.5}, None, ["config.json", "max_position_embeddings is 16.5"]),
], ids=["several-eos", "eos-outside-vocab", "eos-string", "eos-bool", "positions-0", "positions-negative",
        "positions-float"])
def test_generation_settings_a_decode_cannot_honour_are_refused_naming_file_and_value(tmp_path, config, generation,
                                                                                      words):
    from launch.models import generation_settings

    with pytest.raises(CheckpointError) as err:
        generation_settings(_settings_folder(tmp_path, config, generation), vocab=128)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def _edited(written, tmp_path, config=None, generation=None):
    """A copy of the qwen2_moe checkpoint with ``config`` merged into its config.json and ``generation`` written as
    its generation_config.json."""
    folder = str(tmp_path / "edited")
    shutil.copytree(written["qwen2_moe"][1], folder)
    with open(os.path.join(folder, "config.json")) as f:
        data = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**data, **(config or {})}, f)
    if generation is not None:
        with open(os.path.join(folder, "generation_config.json"), "w") as f:
            json.dump(generation, f)
    return folder


GENERATE_SMALL = ["--batch", "2", "--seq-len", "12", "--iters", "1", "--warmup", "0"]


@pytest.mark.parametrize("config, generation, args, words", [
    ({"max_position_embeddings": 16}, None, ["--new-tokens", "8"],
     ["12 prompt tokens + 8 new tokens = 20 positions, beyond max_position_embeddings 16 in", "config.json"]),
    ({"max_position_embeddings": 0}, None, ["--new-tokens", "2"], ["config.json", "max_position_embeddings is 0"]),
    ({}, {"eos_token_id": [1, 2]}, ["--new-tokens", "2"],
     ["generation_config.json", "eos_token_id is [1, 2]", "choose one with --stop-token"]),
], ids=["prompt-and-new-tokens-beyond-the-positions", "no-positions", "several-eos"])
def test_a_generation_the_checkpoint_cannot_run_is_one_line_before_any_rank_joins(written, tmp_path, config,
                                                                                   generation, args, words, capsys,
                                                                                   monkeypatch):
    """(before: 20 positions of a 16-position model, a 0-position model and the first of two eos ids all ran)"""
    from launch.generate import main
    from support.launcher import run_here

    folder = _edited(written, tmp_path, config, generation)
    code, out, err = run_here(main, ["--model", folder] + GENERATE_SMALL + args, capsys, monkeypatch)
    assert code == 2, out + err
    assert len((out + err).strip().splitlines()) == 1, out + err
    for w in words:
        assert w in out + err, (w, out + err)


def test_a_prefill_prompt_beyond_the_checkpoints_positions_is_one_line_before_any_rank_joins(written, tmp_path,
                                                                                              capsys, monkeypatch):
    """(before: a 12-token prompt of an 8-position checkpoint ran)"""
    from launch.prefill import main
    from support.launcher import run_here

    folder = _edited(written, tmp_path, {"max_position_embeddings": 8}, None)
    code, out, err = run_here(main, ["--model", folder] + GENERATE_SMALL, capsys, monkeypatch)
    assert code == 2, out + err
    assert len((out + err).strip().splitlines()) == 1, out + err
    assert "a prompt of 12 tokens, beyond max_position_embeddings 8 in" in out + err, out + err


@pytest.mark.spawns_ranks
def test_the_checkpoints_stop_token_ends_our_run_and_its_own_generate_alike(written, tmp_path):
    """eos_token_id of generation_config.json, a token the greedy continuation holds, is the run's stop token, said
    in the headline, and `--check` compares with the family's own generate() stopping at the same token: a run or
    a reference that stopped elsewhere would differ (before: the checkpoint's eos was not read)."""
    from microbatch.batch import Batch
    from support.launcher import GENERATE, run_launcher

    model = written["qwen2_moe"][0]
    prompt = Batch.random([12, 12], 128, seed=0 * 1000 + 0 + 1).tokens[:12]  # the launcher's request 0 of rank 0
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        greedy = model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]),
                                generation_config=config)[0, 12:].tolist()
    stop = greedy[2]
    folder = _edited(written, tmp_path, generation={"eos_token_id": stop})
    proc = run_launcher(["--model", folder, "--check", "--new-tokens", "6"] + GENERATE_SMALL, script=GENERATE,
                        timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"stop token {stop} (from generation_config.json)" in proc.stdout, proc.stdout
    assert "own generate(do_sample=False) tokens" in proc.stdout, proc.stdout
