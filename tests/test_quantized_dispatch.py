"""The quantized dispatch (`collectives.quantize`, ``dispatch_dtype`` / ``--dispatch-dtype``): tokens quantized per
token, their scales in the same exchange, the experts dequantizing them, on every exchange family and mode."""
from __future__ import annotations

import importlib
import json
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

import microbatch
import overlap
from collectives import (MOE_ACTIVE, MOE_CAPACITY, MOE_IN, MOE_OUT, LayoutError, MoE, MoEConfig, NonFiniteTokens,
                         capacity_dispatch, capacity_expert_parallel, combine_dense, dequantize, mc2,
                         quantize_per_token, wire_bytes_per_token, wrap_expert_parallel)
from collectives.capacity import all_local_experts, capacity_combine
from collectives.quantize import pack, unpack
from overlap import no_host_sync
from overlap.multirank import run_ranks
from support.launcher import TINY, run_here

DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
CFG = MoEConfig(hidden=16, ffn=8, n_experts=4, top_k=2, n_shared=1)


# --- one process: the quantization itself ---------------------------------------------------------------------

@pytest.mark.parametrize("name", DTYPES)
def test_round_trip_within_the_dtypes_rounding(name):
    dtype = DTYPES[name]
    torch.manual_seed(0)
    x = torch.randn(9, 64) * torch.logspace(-3, 3, 9)[:, None]  # tokens of very different magnitudes
    x[4] = 0
    q = quantize_per_token(x, dtype)
    assert q.values.dtype == dtype and q.values.shape == x.shape
    assert q.scales.dtype == torch.float32 and q.scales.shape == (9,)
    assert q.scales[4] == 1 and torch.equal(dequantize(q, torch.float32)[4], x[4])  # a zero token: scale 1, exact
    err = (dequantize(q, torch.float32) - x).abs()
    absmax = x.abs().amax(1, keepdim=True)
    if dtype == torch.int8:  # half a step of absmax / 127
        bound = absmax / 127 / 2 * (1 + 1e-5)
    else:  # e4m3: 3 mantissa bits (half an ulp: 1/16 of the value), subnormals below 2**-6 in steps of 2**-9
        bound = x.abs() / 16 + absmax / 448 * 2 ** -10 + 1e-30
    assert bool((err <= bound).all()), float((err - bound).max())
    assert torch.equal(q.values.float().abs().amax(1)[absmax[:, 0] > 0],
                       torch.full((8,), 127.0 if dtype == torch.int8 else 448.0))  # each token's largest: the top


@pytest.mark.parametrize("name", DTYPES)
def test_packed_rows_hold_values_and_scales_bit_for_bit(name):
    q = quantize_per_token(torch.randn(5, 12), DTYPES[name])
    packed = pack(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 12 + 4)
    back = unpack(packed, DTYPES[name])
    assert torch.equal(back.values.view(torch.uint8), q.values.view(torch.uint8))
    assert torch.equal(back.scales, q.scales)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_token_holding_nan_or_inf_is_refused_in_one_line(bad):
    x = torch.randn(4, 8)
    x[2, 5] = bad
    with pytest.raises(NonFiniteTokens, match=r"token 2 of the dispatch holds NaN or inf") as err:
        quantize_per_token(x, torch.int8)
    assert "\n" not in str(err.value)


def test_where_the_host_may_not_read_a_nan_token_dequantizes_to_nan():
    """A captured step cannot raise: the NaN travels on as the token's scale, so its row is NaN (the step's
    non-finite check sees it) instead of a finite wrong answer."""
    x = torch.randn(3, 8)
    x[1, 0] = float("nan")
    with no_host_sync():
        q = quantize_per_token(x, torch.int8)
    out = dequantize(q, torch.float32)
    assert bool(out[1].isnan().all()) and bool(out[[0, 2]].isfinite().all())


def test_bytes_per_token_with_the_scales_are_about_half_of_bf16():
    hidden = 7168  # DeepSeek-V3's
    bf16 = wire_bytes_per_token(hidden, None, torch.bfloat16)
    assert bf16 == 2 * hidden
    for dtype in DTYPES.values():
        assert wire_bytes_per_token(hidden, dtype, torch.bfloat16) == hidden + 4
        assert wire_bytes_per_token(hidden, dtype, torch.bfloat16) / bf16 <= 0.55


def test_a_bad_dispatch_dtype_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"dispatch_dtype must be one of bf16, int8, fp8 .*got 'int4'"):
        wrap_expert_parallel(MoE(CFG), dispatch_dtype="int4")


def test_a_nan_token_is_refused_by_the_layer_before_any_exchange():
    ep = wrap_expert_parallel(MoE(CFG).requires_grad_(False), dispatch_dtype="int8")
    x = torch.randn(5, CFG.hidden)
    x[3, 1] = float("nan")
    with pytest.raises(LayoutError, match="token 3 of the dispatch holds NaN or inf"):
        ep(x)


class _FloatRowsOnly(torch.nn.Module):
    """An experts object that takes float rows only (as a quantized-weights experts object does): it says nothing
    of ``takes_quantized_tokens``."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.gate_up, self.down, self.num_local = inner, inner.gate_up, inner.down, inner.num_local
        self.seen = []

    def forward(self, x, counts, impl=None):
        self.seen.append(type(x))
        return self.inner(x, counts, impl)


def test_experts_that_take_float_rows_get_them_dequantized_and_local_experts_get_quantized_tokens():
    torch.manual_seed(0)
    moe = MoE(CFG).requires_grad_(False)
    ep = wrap_expert_parallel(moe, dispatch_dtype="fp8")
    x = torch.randn(7, CFG.hidden)
    idx, weights = moe.router(x)
    want = combine_dense(dequantize(quantize_per_token(x, torch.float8_e4m3fn), x.dtype), idx, weights, moe.experts)
    want = want + moe.shared_experts(x)
    assert ep.experts.takes_quantized_tokens  # LocalExperts: the rows as they arrive, dequantized in its forward
    torch.testing.assert_close(ep(x), want, rtol=1e-5, atol=1e-5)
    ep.experts = float_rows = _FloatRowsOnly(ep.experts)
    torch.testing.assert_close(ep(x), want, rtol=1e-5, atol=1e-5)
    assert float_rows.seen == [torch.Tensor]


def test_the_capacity_exchange_quantized_traces_fullgraph():
    torch.manual_seed(0)
    ep = capacity_expert_parallel(MoE(CFG).requires_grad_(False), dispatch_dtype="int8")
    x = torch.randn(6, CFG.hidden)
    idx, weights = ep.router(x)

    def step(x, idx, weights):
        handle = capacity_dispatch(x, idx, weights, CFG.n_experts, None, capacity=6, validate=False,
                                   dispatch_dtype=torch.int8)
        return capacity_combine(all_local_experts(handle.tokens(), ep.experts), handle).wait()

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="eager")(x, idx, weights)
    q = dequantize(quantize_per_token(x, torch.int8), torch.float32)
    torch.testing.assert_close(got, step(x, idx, weights), rtol=0, atol=0)
    torch.testing.assert_close(got, combine_dense(q, idx, weights, _dense(ep)), rtol=1e-5, atol=1e-5)


def _dense(ep):
    """The layer's experts as the dense reference's list (one rank holds them all)."""
    experts = []
    for e in range(ep.experts.num_local):
        gate, up = ep.experts.gate_up[e].chunk(2)
        experts.append(lambda t, g=gate, u=up, d=ep.experts.down[e]: (torch.nn.functional.silu(t @ g.T) * (t @ u.T))
                       @ d.T)
    return experts


# --- MC2: quant_mode=2, its dynamic scales; no fp8 mode ---------------------------------------------------------

def _fake_mc2_dispatch(seen):
    """One rank's MC2 dispatch (every pair local), quantizing as ``quant_mode=2`` does: int8 rows and their
    per-row ``dynamic_scales``."""
    def dispatch(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, x_active_mask=None,
                 quant_mode=0, global_bs=0, expert_token_nums_type=1):
        seen.append(quant_mode)
        order = torch.argsort(expert_ids.reshape(-1).long(), stable=True)
        rows = x[order // expert_ids.shape[1]]
        q = quantize_per_token(rows, torch.int8) if quant_mode == 2 else None
        counts = torch.bincount(expert_ids.reshape(-1).long(), minlength=moe_expert_num)
        return (rows if q is None else q.values, None if q is None else q.scales, order, counts,
                counts.to(torch.int32), None, None)
    return dispatch


def test_mc2_quantizes_with_quant_mode_2_and_the_experts_take_its_dynamic_scales():
    torch.manual_seed(0)
    moe = MoE(CFG).requires_grad_(False).to(torch.bfloat16)
    x = torch.randn(4, CFG.hidden, dtype=torch.bfloat16)
    idx, weights = moe.router(x)
    seen = []
    npu = SimpleNamespace(npu_moe_distribute_dispatch_v2=_fake_mc2_dispatch(seen))
    with mock.patch.object(mc2, "_require", lambda: npu), mock.patch.object(mc2, "_validated", lambda *a: None), \
            mock.patch.object(mc2, "_group_name", lambda g: "ep"):
        handle = mc2.mc2_dispatch(x, idx, weights, CFG.n_experts, None, max_tokens_per_rank=4, chip="a3",
                                  stream_tag=None, dispatch_dtype=torch.int8)
        batch = handle.expand()
        tokens = handle.tokens(batch)
        with pytest.raises(mc2.MC2Error, match=r"int8 only \(quant_mode=2\), not torch.float8_e4m3fn") as err:
            mc2.mc2_dispatch(x, idx, weights, CFG.n_experts, None, max_tokens_per_rank=4, chip="a3",
                             stream_tag=None, dispatch_dtype=torch.float8_e4m3fn)
    assert seen == [2] and "\n" not in str(err.value)
    assert tokens.values.dtype == torch.int8 and tokens.scales.shape == (8,)
    want = quantize_per_token(x[torch.argsort(idx.reshape(-1), stable=True) // 2], torch.int8)
    torch.testing.assert_close(dequantize(tokens, torch.bfloat16), dequantize(want, torch.bfloat16))


# --- two ranks: every family, every mode, the bytes on the wire ---------------------------------------------

def _modes(ops, x, split, capacity=None, modes=("serial", "shared", "two-batch")):
    """``ops`` run in each mode, in ``split`` micro-batches where the mode takes several: the outputs by mode."""
    out = {}
    for mode in modes:
        n = microbatch.mode(mode).micro_batches
        parts = [x[:split], x[split:]] if n == 2 else [x]
        inputs = [{MOE_IN: p, MOE_CAPACITY: capacity, MOE_ACTIVE: None} if capacity else {MOE_IN: p} for p in parts]
        outs = microbatch.run(microbatch.schedule_for(mode, [ops], n), [ops], inputs, output=MOE_OUT)
        out[mode] = torch.cat(outs)
    return out


def _sent_bytes(calls, name):
    """Bytes per row of the collectives named ``name`` (their send tensors' rows)."""
    return {t.element_size() * t.shape[1] for n, t in calls if n == name and t.shape[0]}


def _quantized_body(ctx):
    torch.manual_seed(1234)
    moe = MoE(CFG).requires_grad_(False)
    torch.manual_seed(10 + ctx.rank)
    x = torch.randn(6 + ctx.rank, CFG.hidden)  # the ranks' token counts differ
    idx, weights = moe.router(x)
    calls = []
    real = overlap.all_to_all_single

    def recording(out, inp, *args, **kwargs):
        calls.append((kwargs.get("name"), inp))
        return real(out, inp, *args, **kwargs)

    results = {}
    with mock.patch.object(overlap, "all_to_all_single", recording):
        for name, dtype in DTYPES.items():
            q = dequantize(quantize_per_token(x, dtype), x.dtype)
            dense = combine_dense(q, idx, weights, moe.experts) + moe.shared_experts(x)
            ep = wrap_expert_parallel(moe, ctx.group, dispatch_dtype=name)
            calls.clear()
            a2a = _modes(ep.stages(), x, 3)
            a2a_bytes = _sent_bytes(calls, "dispatch")
            ep.two_step_dispatch = False
            a2a["one-step"] = ep(x)
            cap = capacity_expert_parallel(moe, ctx.group, capacity=8, dispatch_dtype=name)
            calls.clear()
            capacity = _modes(cap.stages(), x, 3)
            cap_bytes = _sent_bytes(calls, "dispatch")
            decode = {}
            for chunks in (1, 2):
                ops = ep.decode_stages(chunks)
                _modes(ops, x, 3, capacity=8, modes=("serial",))  # the first call agrees on the shapes
                with no_host_sync():
                    for mode, out in _modes(ops, x, 3, capacity=8).items():
                        decode[f"{mode} chunks {chunks}"] = out
            results[name] = dict(dense=dense, a2a=a2a, capacity=capacity, decode=decode, a2a_bytes=a2a_bytes,
                                 cap_bytes=cap_bytes)
    mixed = wrap_expert_parallel(moe, ctx.group, dispatch_dtype="int8" if ctx.rank == 0 else "fp8")
    try:
        mixed(x)
        results["mixed"] = None
    except LayoutError as err:
        results["mixed"] = str(err)
    return results


@pytest.mark.timeout(300)
def test_every_family_and_mode_equals_the_dense_layer_on_dequantized_tokens_on_two_ranks():
    """On each rank: each family's output equals the dense computation on the tokens quantized and dequantized as
    the dispatch does (the router and shared experts on the tokens themselves), every mode equals serial exactly,
    (bitwise where the batch is not split), and each token's row in the dispatch is the bytes the planner counts
    (H values + a 4-byte scale)."""
    for rank, results in enumerate(run_ranks(_quantized_body, 2, timeout=240)):
        mixed = results.pop("mixed")  # ranks quantizing to different dtypes stop before any token travels
        assert mixed is not None and "ranks disagree on the dtype of the tokens" in mixed, mixed
        assert "torch.int8" in mixed and "torch.float8_e4m3fn" in mixed and "\n" not in mixed, mixed
        for name, r in results.items():
            where = f"rank {rank} {name}"
            for family in ("a2a", "capacity", "decode"):
                runs = r[family]
                serial = runs.get("serial", runs.get("serial chunks 1"))
                torch.testing.assert_close(serial, r["dense"], rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{where} {family}: {m}")
                for mode, out in runs.items():  # a split changes the matmuls' shapes, so their rounding only
                    if "two-batch" in mode:
                        torch.testing.assert_close(out, serial, rtol=1e-6, atol=1e-6,
                                                   msg=lambda m: f"{where} {family} {mode}: {m}")
                    else:
                        assert torch.equal(out, serial), f"{where} {family} {mode} differs from serial"
            row = wire_bytes_per_token(CFG.hidden, DTYPES[name], torch.float32)
            assert r["a2a_bytes"] == {row} and r["cap_bytes"] == {row}, where
            assert row / wire_bytes_per_token(CFG.hidden, None, torch.float32) <= 0.55 / 2 + 0.1  # vs float32


# --- the launchers ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("launcher", ["prefill", "generate"])
def test_a_bad_dispatch_dtype_is_one_line_and_exit_2(launcher, capsys, monkeypatch):
    main = importlib.import_module(f"launch.{launcher}").main
    code, _, err = run_here(main, TINY + ["--dispatch-dtype", "int4"], capsys, monkeypatch)
    assert code == 2
    assert err.strip() == ("Error: --dispatch-dtype must be one of bf16, int8, fp8 (default: the model's dtype, "
                           "unquantized), got 'int4'"), err


def test_bf16_on_a_float32_model_is_refused_in_one_line(capsys, monkeypatch):
    from launch.prefill import main

    code, _, err = run_here(main, TINY + ["--dispatch-dtype", "bf16"], capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--dispatch-dtype bf16 sends a bfloat16 model's tokens unquantized, but --dtype is float32" in err


@pytest.mark.spawns_ranks  # starts the launcher: processes of its own
def test_prefill_check_compares_serial_with_the_unquantized_dispatch_and_results_say_the_dtype(
        tmp_path, capsys, monkeypatch):
    from launch.prefill import main

    args = TINY + ["--dispatch-dtype", "int8", "--mode", "two-batch", "--check", "--cpu-link", "off",
                   "--out", str(tmp_path)]
    code, out, err = run_here(main, args, capsys, monkeypatch)
    assert code == 0, out + err
    assert "| dispatch int8 (per-token scales)" in out
    line = next(x for x in out.splitlines() if "against the unquantized dispatch" in x)
    assert line.startswith("check: serial with the int8 dispatch against the unquantized dispatch: largest logit "
                           "difference "), line
    assert "90% of the tokens within" in line and "check: every mode matches serial" in out
    with open(tmp_path / "results.json") as f:
        assert json.load(f)["dispatch_dtype"] == "int8"


def test_the_benchmark_counts_a_ranks_experts_kept_quantized():
    """launch.bench.quantized's expert memory: bf16 two bytes a weight; fp8 one byte plus a float32 scale per 128 x 128
    block (edges included); int8 one byte plus a float32 scale and offset per output channel."""
    from collectives import LocalExperts
    from launch.bench.quantized import _expert_bytes

    e, f, h = 2, 96, 160  # 2F = 192 rows (2 blocks), H = 160 columns (2 blocks)
    experts = LocalExperts(torch.randn(e, 2 * f, h).bfloat16(), torch.randn(e, h, f).bfloat16())
    held = _expert_bytes(experts)
    weights = e * (2 * f * h + h * f)
    assert held["bf16"] == 2 * weights
    assert held["fp8"] == weights + 4 * e * (2 * 2 + 2 * 1)  # gate_up 2x2 blocks, down 2x1
    assert held["int8"] == weights + 8 * e * (2 * f + h)
