"""The kernels quantized experts compute with (collectives/quantized_kernels.py): W8A8 by ``torch._int_mm`` on CPU,
taking an int8 dispatch's tokens as they arrive; the NPU's per-token quantized grouped matmul (through the fake
torch_npu); FP8 by ``torch._scaled_mm`` (runs on CPU with rowwise scales) and which path each CUDA device gets.

Each result is compared with the dequantized float model (the reference path) within the format's rounding
bound, `_bound`: the activations' quantization error (int8 per token: ``absmax / 254``; fp8 per token and block
columns: ``max(|x| / 16, scale / 1024)``) carried through the expert exactly, in magnitudes:
``|W| e`` through each linear, ``L e_g (|u| + e_u) + |silu(g)| e_u`` through the SwiGLU (``L`` = 1.0998, the
largest slope of silu), the gated activations' own quantization error added before ``down``.
"""
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from collectives import QuantizedExperts, QuantizedTokens
from collectives import quantized_kernels as qk
from collectives.quantize import quantize_per_token, tokens_for
from collectives.weight_quant import quantize, scale_names
from support.fake_npu import calls, check_against_schema, expert_weights, fake_npu, installed, npu_dynamic_quant

SILU_SLOPE = 1.0998  # max |silu'(x)|
H, FF, E = 32, 16, 3
BLOCK = (16, 16)
COUNTS = [3, 0, 4]


def _experts(scheme: str, offsets: bool = False, dtype: torch.dtype = torch.float32) -> QuantizedExperts:
    gate_up, down = expert_weights(E, hidden=H, ffn=FF)
    parts = [quantize(w, scheme, BLOCK) for w in (gate_up[:, :FF], gate_up[:, FF:], down)]
    if offsets:  # asymmetric int8 weights: (q - offset) * scale
        for p in parts:
            p["weight"] = (p["weight"].int() // 2 + 3).to(torch.int8)
            p["weight_offset"] = torch.full_like(p["weight_scale"], 3.0)
    scales = {proj: [p[n] for n in scale_names(scheme)] for proj, p in zip(("gate", "up", "down"), parts)}
    weight = torch.cat([parts[0]["weight"], parts[1]["weight"]], dim=1)
    return QuantizedExperts(weight, parts[2]["weight"], scales, scheme, block=BLOCK, dtype=dtype)


def _tokens(rows: int = sum(COUNTS)) -> torch.Tensor:
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(7))


def _int8_error(m: torch.Tensor) -> torch.Tensor:
    return (m.amax(dim=-1, keepdim=True) / 254).expand_as(m)


def _fp8_error(m: torch.Tensor) -> torch.Tensor:
    cols = BLOCK[1]
    groups = m.reshape(m.shape[0], -1, cols)
    scale = groups.amax(dim=-1, keepdim=True) / 448
    return torch.maximum(groups / 16, (scale / 1024).expand_as(groups)).reshape(m.shape)


def _bound(experts: QuantizedExperts, x: torch.Tensor, error, exact_input: bool = False) -> torch.Tensor:
    """Per element: how far the quantized computation may be from the dequantized float model (module doc)."""
    out = torch.zeros(x.shape[0], H)
    start = 0
    for e, n in enumerate(COUNTS):
        if n:
            rows = x[start:start + n]
            gate_up, down = experts.weights(e, torch.float32)
            gate, up = gate_up[:FF], gate_up[FF:]
            ex = torch.zeros_like(rows) if exact_input else error(rows.abs())
            g, u = rows @ gate.t(), rows @ up.t()
            eg, eu = ex @ gate.abs().t(), ex @ up.abs().t()
            h = F.silu(g) * u
            eh = SILU_SLOPE * eg * (u.abs() + eu) + F.silu(g).abs() * eu
            reach = h.abs() + eh
            out[start:start + n] = (eh + error(reach)) @ down.abs().t() + 1e-5 * (reach @ down.abs().t()) + 1e-6
        start += n
    return out


def _counting(name: str):
    """``torch.<name>`` patched to count its calls (and still compute)."""
    real = getattr(torch, name)
    return mock.patch.object(torch, name, side_effect=real, create=False)


# ---- CPU: W8A8 by torch._int_mm ----------------------------------------------------------------------------

@pytest.mark.parametrize("offsets", [False, True], ids=["symmetric", "offsets"])
def test_w8a8_on_cpu_is_the_int_mm_kernel_within_the_int8_bound(offsets):
    experts = _experts("int8_channel", offsets)
    experts.kernel = "int_mm"  # named: on CPU "auto" is the reference (below)
    x = _tokens()
    want = experts.reference(x, COUNTS)
    with _counting("_int_mm") as int_mm:
        got = experts(x, COUNTS)
    assert experts.last_kernel == "int_mm" and int_mm.call_count == 2 * sum(1 for c in COUNTS if c)
    diff = (got - want).abs()
    bound = _bound(experts, x, _int8_error)
    assert bool((diff <= bound).all()), (diff - bound).max()
    assert float(diff.max()) > 0  # the activations were quantized: not the float model's computation


def test_int8_dispatch_tokens_are_taken_as_they_arrive():
    """An int8 dispatch's QuantizedTokens go to the integer matmul as they are: nothing dequantizes them."""
    experts = _experts("int8_channel")
    experts.kernel = "int_mm"
    q = quantize_per_token(_tokens(), torch.int8)
    assert experts.takes_quantized_tokens
    with mock.patch("collectives.quantize.dequantize", side_effect=AssertionError("dequantized")) as deq:
        taken = tokens_for(experts, q, torch.float32)
        assert taken is q
        with _counting("_int_mm") as int_mm:
            got = experts(taken, COUNTS)
    assert not deq.called and int_mm.called
    x = q.values.float() * q.scales[:, None]  # what the tokens stand for: the float model's input
    diff = (got - experts.reference(x, COUNTS)).abs()
    assert bool((diff <= _bound(experts, x, _int8_error, exact_input=True)).all())


def test_on_cpu_auto_is_the_reference_kernel_the_dequantized_model_to_float_rounding():
    """W8A8 on CPU without a kernel named: each expert's weights dequantized as its rows come, the activations as
    they are, so a quantized run's --check is bounded by float rounding (int_mm's rounding of the activations
    would flip a router's near-tie at real sizes)."""
    experts = _experts("int8_channel")
    x = _tokens()
    with _counting("_int_mm") as int_mm:
        got = experts(x, COUNTS)
    assert experts.last_kernel == "reference" and not int_mm.called
    torch.testing.assert_close(got, experts.reference(x, COUNTS), rtol=0, atol=0)
    assert qk.resolve_kernel("auto", "int8_channel", torch.device("cpu")) == "reference"


def test_fp8_experts_keep_taking_float_rows():
    experts = _experts("fp8_block")
    q = quantize_per_token(_tokens(), torch.int8)
    assert not experts.takes_quantized_tokens
    assert isinstance(tokens_for(experts, q, torch.float32), torch.Tensor)
    x = _tokens()
    torch.testing.assert_close(experts(x, COUNTS), experts.reference(x, COUNTS))
    assert experts.last_kernel == "reference"


def test_padding_rows_of_a_group_list_come_out_zero():
    experts = _experts("int8_channel")
    x = torch.cat([_tokens(), torch.full((2, H), 5.0)])
    got = experts(x, torch.tensor(COUNTS))
    assert bool((got[sum(COUNTS):] == 0).all())


# ---- NPU: the per-token quantized grouped matmul (fake torch_npu) -------------------------------------------

def _npu_run(experts, tokens, counts):
    with installed(fake_npu(npu_dynamic_quant)):
        return experts(tokens, counts), calls("npu_grouped_matmul"), calls("npu_dynamic_quant")


@pytest.mark.parametrize("dispatch", ["float", "int8"])
def test_w8a8_on_npu_is_one_grouped_matmul_per_projection_with_its_scales(dispatch):
    experts = _experts("int8_channel", dtype=torch.bfloat16)
    x = _tokens()
    q = quantize_per_token(x, torch.int8)
    tokens = q if dispatch == "int8" else x.bfloat16()
    gl = torch.tensor(COUNTS + [0])[:E]
    got, mm, dq = _npu_run(experts, tokens, gl)
    assert experts.last_kernel == "npu_w8a8" and len(mm) == 2
    assert len(dq) == (1 if dispatch == "int8" else 2)  # the gated activations always; the tokens if float
    gate_up, down = mm
    for call, want in ((gate_up, torch.cat([experts.gate_weight_scale, experts.up_weight_scale], 1)),
                       (down, experts.down_weight_scale)):
        assert call["x_dtype"] == torch.int8 and call["output_dtype"] == torch.bfloat16
        assert call["group_list"].tolist() == COUNTS and call["group_list_type"] == 1
        assert torch.equal(call["scale"], want.reshape(E, -1).float())
    if dispatch == "int8":
        assert torch.equal(gate_up["per_token_scale"], q.scales)
    want = experts.reference(x, COUNTS).float()  # the dequantized float model
    bound = _bound(experts, x, _int8_error, exact_input=False)
    diff = (got.float() - want).abs()
    assert bool((diff <= bound + 2 ** -7 * want.abs() + 1e-2).all())  # + the bf16 output's rounding


def test_npu_offsets_and_fp8_take_the_dequantized_grouped_matmul():
    for experts in (_experts("int8_channel", offsets=True), _experts("fp8_block")):
        x = _tokens()
        got, mm, _ = _npu_run(experts, x, COUNTS)
        assert experts.last_kernel == "npu_dequant" and len(mm) == 2 and mm[0]["scale"] is None
        torch.testing.assert_close(got, experts.reference(x, COUNTS), rtol=1e-5, atol=1e-5)


def test_one_local_expert_on_npu_is_not_a_grouped_matmul():
    gate_up, down = expert_weights(1, hidden=H, ffn=FF)
    parts = [quantize(w, "int8_channel") for w in (gate_up[:, :FF], gate_up[:, FF:], down)]
    scales = {p: [d[n] for n in scale_names("int8_channel")] for p, d in zip(("gate", "up", "down"), parts)}
    experts = QuantizedExperts(torch.cat([parts[0]["weight"], parts[1]["weight"]], 1), parts[2]["weight"], scales,
                               "int8_channel")
    x = _tokens(4)
    got, mm, _ = _npu_run(experts, x, [4])
    assert not mm and got.shape == (4, H)


def test_the_fake_dynamic_quant_takes_the_wheels_arguments():
    check_against_schema([npu_dynamic_quant])


# ---- CUDA: FP8 by torch._scaled_mm where the GPU has FP8 ----------------------------------------------------

@pytest.mark.parametrize("capability, want", [((8, 0), "reference"), ((8, 6), "reference"), ((8, 9), "scaled_mm"),
                                              ((9, 0), "scaled_mm"), ((10, 0), "scaled_mm")])
def test_fp8_on_cuda_takes_scaled_mm_from_compute_capability_8_9(capability, want):
    with mock.patch.object(torch.cuda, "get_device_capability", return_value=capability):
        assert qk.resolve_kernel("auto", "fp8_block", torch.device("cuda")) == want
        assert qk.resolve_kernel("auto", "int8_channel", torch.device("cuda")) == "int_mm"
    assert qk.resolve_kernel("auto", "fp8_block", torch.device("cpu")) == "reference"


def test_the_scaled_mm_kernel_equals_the_dequantized_model_within_the_fp8_bound():
    """The CUDA kernel's computation, run on CPU (torch._scaled_mm takes rowwise scales there)."""
    experts = _experts("fp8_block")
    experts.kernel = "scaled_mm"
    x = _tokens()
    with _counting("_scaled_mm") as scaled_mm:
        got = experts(x, COUNTS)
    assert experts.last_kernel == "scaled_mm"
    assert scaled_mm.call_count == sum(1 for c in COUNTS if c) * (2 * H // BLOCK[1] + FF // BLOCK[1])
    diff = (got - experts.reference(x, COUNTS)).abs()
    assert bool((diff <= _bound(experts, x, _fp8_error)).all())
    assert float(diff.max()) > 0


def test_a_kernel_name_is_checked():
    with pytest.raises(ValueError, match="kernel must be one of .* got 'fast'"):
        QuantizedExperts(*expert_weights(1, hidden=H, ffn=FF)[:2], {}, "int8_channel", kernel="fast")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_token_into_w8a8_experts_spoils_only_its_row(bad):
    experts = _experts("int8_channel")
    x = _tokens()
    x[1, 5] = bad
    got = experts(x, COUNTS)
    assert not bool(torch.isfinite(got[1]).any())
    clean = torch.cat([x[:1], x[2:]])
    torch.testing.assert_close(torch.cat([got[:1], got[2:]]), experts(clean, [2, 0, 4]))


def test_transformers_own_call_of_the_experts_routes_and_weights_each_token():
    """The model's own forward (``--check`` against its generate()) calls its experts as transformers does."""
    experts = _experts("fp8_block")
    x = _tokens(5)
    idx = torch.tensor([[0, 2], [2, 1], [1, 0], [2, 0], [0, 1]])
    w = torch.rand(5, 2, generator=torch.Generator().manual_seed(3))
    got = experts(x, idx, w)
    want = torch.zeros(5, H)
    for t in range(5):
        for j in range(2):
            e = int(idx[t, j])
            want[t] += w[t, j] * experts.reference(x[t:t + 1], [1 if i == e else 0 for i in range(E)])[0]
    torch.testing.assert_close(got, want)
