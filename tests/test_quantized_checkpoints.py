"""FP8 (DeepSeek's) and W8A8 (msModelSlim's) checkpoints load and stay quantized (launch/models/quantized,
collectives/quantized_experts.py, collectives/weight_quant.py).

Small models of two families are quantized by each format's own rules (`save_quantized`) and loaded: the
experts and the dense projections stay in the stored dtype with their scales, a rank of 2 reads only its
experts, and the quantized model computes what the same checkpoint read dequantized computes.

The bound: the quantized path dequantizes each weight by the same rule (`collectives.weight_quant.dequantize`)
as the dequantized load, so the two differ only by float rounding of the same operations in another order:
float32, relative 1e-5 of the output's largest value. Against the original float weights, the formats' own
rounding: FP8 e4m3 keeps 3 mantissa bits (a relative step of 2^-3, so at most half of it, 2^-4, of the value,
and 2^-4 x the block's largest value); int8 at most half a step, ``scale / 2 = amax / 254`` of the channel.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from collectives import QuantizedExperts, QuantizedLinear
from collectives.weight_quant import FP8_MAX, INT8_MAX, dequantize, quantize
from launch.models.checkpoint import CheckpointError, check_checkpoint, load_checkpoint

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from launch.models.quantized import DESCRIPTION, save_quantized  # noqa: E402
from support.quantized import FAMILIES, small_model, wrapped  # noqa: E402

CASES = [("fp8", (128, 128)), ("fp8", (32, 32)), ("w8a8", None)]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """family -> (float model, {case: folder})."""
    out = {}
    for family in FAMILIES:
        model = small_model(family)
        folders = {}
        for method, block in CASES:
            path = str(tmp_path_factory.mktemp(f"{family}-{method}"))
            save_quantized(model, path, method, block or (128, 128), static=method == "w8a8")
            folders[(method, block)] = path
        out[family] = (model, folders)
    return out


@pytest.mark.parametrize("method,block", CASES)
def test_the_rules_of_each_format_round_trip_within_its_rounding(method, block):
    w = torch.randn(3, 160, 200) * torch.linspace(0.1, 4, 200)  # edges of 32 and 72 past the blocks of 128
    scheme = "fp8_block" if method == "fp8" else "int8_channel"
    q = quantize(w, scheme, block or (128, 128))
    back = dequantize(q["weight"], [v for k, v in q.items() if k != "weight"], scheme, torch.float32,
                      block or (128, 128))
    if method == "fp8":
        bo, bi = block
        assert q["weight"].dtype == torch.float8_e4m3fn
        assert q["weight_scale_inv"].shape == (3, -(-160 // bo), -(-200 // bi))
        scale = q["weight_scale_inv"].repeat_interleave(bo, 1).repeat_interleave(bi, 2)[:, :160, :200]
        assert bool(((back - w).abs() <= scale * FP8_MAX * 2 ** -4 + 1e-12).all())
    else:
        assert q["weight"].dtype == torch.int8 and q["weight_scale"].shape == (3, 160, 1)
        assert bool(((back - w).abs() <= w.abs().amax(-1, keepdim=True) / (2 * INT8_MAX) * (1 + 1e-5)).all())


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("method,block", CASES)
def test_a_quantized_checkpoint_loads_quantized_and_computes_the_dequantized_model(written, family, method, block):
    path = written[family][1][(method, block)]
    model, report = load_checkpoint(path)
    floats, _ = load_checkpoint(path, dequantize=True)
    dtype = torch.float8_e4m3fn if method == "fp8" else torch.int8
    experts = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(experts) == 1 and experts[0].gate_up_q.dtype == experts[0].down_q.dtype == dtype
    assert linears and all(m.weight.dtype == dtype for m in linears)
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
    assert report.quantization == method and report.quantized_bytes["experts"] == 4 * 3 * 48 * 160
    assert report.quantized_bytes["scales"] > 0 and report.quantized_bytes["dense"] > 0
    assert not any(t.dtype == dtype for t in floats.parameters())
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    experts[0].kernel = "reference"  # the dequantized weights computed as they are: float rounding only
    ep_model = wrapped(model)
    with torch.no_grad():
        want = floats(ids).logits
        got = ep_model(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    if method == "w8a8":  # the int_mm kernel (named) quantizes the activations too: W8A8_DYNAMIC's rounding
        experts[0].kernel = "int_mm"
        with torch.no_grad():
            got = ep_model(ids).logits
        assert experts[0].last_kernel == "int_mm"
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("method", ["fp8", "w8a8"])
def test_a_rank_of_two_reads_only_its_quantized_experts(written, family, method):
    block = (128, 128) if method == "fp8" else None
    path = written[family][1][(method, block)]
    whole, one = load_checkpoint(path)
    mine, two = load_checkpoint(path, rank=1, world=2)
    (all_experts,) = [m for m in whole.modules() if isinstance(m, QuantizedExperts)]
    (local,) = [m for m in mine.modules() if isinstance(m, QuantizedExperts)]
    assert local.ep_shard == (2, 4) and local.first_expert == 2 and local.num_local == 2
    assert torch.equal(local.gate_up_q.view(torch.uint8), all_experts.gate_up_q[2:].view(torch.uint8))
    per_expert = (3 * 48 * 160) + sum(t.numel() * t.element_size() for t in local.buffers()
                                      if t.dim() and t is not local.gate_up_q and t is not local.down_q) // 2
    assert one.bytes_read - two.bytes_read == 2 * per_expert
    x = torch.randn(5, 160)
    with torch.no_grad():
        got = local(x, [3, 2])
        want = torch.cat([all_experts(x[:3], [0, 0, 3, 0]), all_experts(x[3:], [0, 0, 0, 2])])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _described(path: str, types: dict) -> None:
    with open(os.path.join(path, DESCRIPTION)) as f:
        described = json.load(f)
    described.update(types)
    with open(os.path.join(path, DESCRIPTION), "w") as f:
        json.dump(described, f)


def test_an_msmodelslim_checkpoint_holds_the_static_parameters_and_loads_without_a_traceback(written, tmp_path):
    path = written["qwen3_moe"][1][("w8a8", None)]
    with open(os.path.join(path, DESCRIPTION)) as f:
        described = json.load(f)
    assert described["model.layers.0.self_attn.q_proj.weight"] == "W8A8"
    assert described["model.layers.1.mlp.experts.3.down_proj.weight"] == "W8A8_DYNAMIC"
    assert described["model.embed_tokens.weight"] == "FLOAT"
    model, _ = load_checkpoint(path)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, QuantizedLinear) and q_proj.weight_scale.shape == (64, 1)
    assert {"input_scale", "input_offset", "quant_bias", "deq_scale"} <= {n for n, _ in q_proj.named_buffers()}


@pytest.mark.parametrize("what,types,message", [
    ("W4A8", {"model.layers.1.mlp.experts.0.up_proj.weight": "W4A8_DYNAMIC"},
     r"quantization type W4A8_DYNAMIC \(e\.g\. model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight\) is not "
     r"supported; supported: quant_method fp8"),
])
def test_an_msmodelslim_type_it_does_not_read_is_refused_in_one_line(written, tmp_path, what, types, message):
    import shutil

    path = str(tmp_path / what)
    shutil.copytree(written["qwen3_moe"][1][("w8a8", None)], path)
    _described(path, types)
    for load in (load_checkpoint, check_checkpoint):
        with pytest.raises(CheckpointError, match=message):
            load(path)


def test_a_quantized_weight_not_in_the_formats_dtype_is_refused_naming_it(written, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil

    path = str(tmp_path / "fp8")
    shutil.copytree(written["qwen3_moe"][1][("fp8", (128, 128))], path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    key = "model.layers.1.mlp.experts.3.down_proj.weight"
    tensors[key] = tensors[key].float()  # a weight of the format without its float8 dtype
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight in "
                                              r".* is float32, the fp8 format stores its quantized weights in "
                                              r"float8_e4m3fn"):
        load_checkpoint(path, rank=0, world=2)
