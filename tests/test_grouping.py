"""Static-shape grouping by local expert, the grouped matmul with a device group list, and the NPU branch
checked on CPU against a fake torch_npu with the documented semantics and the wheel's argument names."""
from __future__ import annotations

import types
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from collectives import experts as experts_mod
from collectives._grouping import group_rows, reduce_rows
from collectives.experts import device_group_impl, group_list, grouped_mlp
from support.fake_npu import (GROUPING_OPS, calls, check_against_schema, expert_weights, fake_npu, installed,
                              npu_grouped_matmul)


# --- the fake torch_npu (support/fake_npu.py) takes the wheel's argument names -------------------------------

def test_fake_grouping_operators_take_the_wheels_argument_names():
    check_against_schema(GROUPING_OPS)


def test_schema_check_can_fail():
    def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_row_idx,
                                 export_for_source_row, drop_pad_mode=0, k=1):
        pass

    with pytest.raises(AssertionError):
        check_against_schema([npu_moe_finalize_routing])


# --- grouping --------------------------------------------------------------------------------------------

def _routing(rows: int, k: int, local: int, seed: int, empty=(), every_to=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, local, (rows, k), generator=g)
    for e in empty:
        ids[ids == e] = -1
    if every_to is not None:
        ids[:, 0], ids[:, 1:] = every_to, -1
    weights = torch.where(ids >= 0, torch.rand(rows, k, generator=g), torch.zeros(()))
    return torch.randn(rows, 16, generator=g), ids, weights


def _expected(x, ids, weights, fn):
    """Per row, sum over slots of weight * fn(expert, row), slot order, float32 (the reference)."""
    out = torch.zeros(x.shape[0], x.shape[1])
    for r in range(x.shape[0]):
        for s in range(ids.shape[1]):
            if ids[r, s] >= 0:
                out[r] += weights[r, s] * fn(int(ids[r, s]), x[r])
    return out


@pytest.mark.parametrize("case", ["mixed", "empty_experts", "all_to_one", "no_rows"])
def test_grouping_sorts_pairs_by_expert_and_reduces_back(case):
    local = 4
    rows = 0 if case == "no_rows" else 13
    x, ids, w = _routing(rows, 3, local, 5, empty=(1, 3) if case == "empty_experts" else (),
                         every_to=2 if case == "all_to_one" else None)
    scale = torch.arange(1.0, local + 1)
    forms = {"torch": None, "npu": fake_npu()}
    got = {}
    for name, npu in forms.items():
        with installed(npu):
            g = group_rows(x, ids, w, local, npu)
            routed = int((ids >= 0).sum())
            assert g.x.shape == (rows * 3, 16)
            assert g.group_list.tolist() == [int((ids == e).sum()) for e in range(local)]
            key = torch.where(ids >= 0, ids, local).reshape(-1)
            assert torch.equal(torch.argsort(g.dst.long()), torch.argsort(key, stable=True))  # a stable sort
            valid = torch.arange(rows * 3) < routed
            expert_of = torch.repeat_interleave(torch.arange(local), g.group_list)
            y = torch.zeros_like(g.x)  # what the grouped matmul returns: expert e scales its rows, zero past the list
            y[valid] = g.x[valid] * scale[expert_of][:, None]
            got[name] = reduce_rows(y, g)
            if npu is not None and rows:
                assert calls("npu_moe_init_routing_v2")[-1] == dict(expert_num=local + 1, active_num=rows * 3,
                                                                    range=[0, local + 1])
                assert calls("npu_moe_finalize_routing")[-1] == dict(drop_pad_mode=2)
    want = _expected(x, ids, w, lambda e, row: row * scale[e])
    for name, out in got.items():
        torch.testing.assert_close(out.float(), want, rtol=1e-5, atol=1e-6, msg=name)


def test_rows_with_no_local_expert_add_an_exact_zero_even_next_to_bad_rows():
    x, ids, w = _routing(12, 2, 3, 8)
    ids[0] = -1
    x[0] = float("nan")  # a padding row full of NaN: no local slot, so nothing of it may leak
    g = group_rows(x, ids, w, 3)
    out = reduce_rows(g.x, g)  # the pairs without a local expert hold row 0's NaN: selected away, not multiplied
    assert torch.isfinite(out).all() and not out[0].any()


# --- grouped matmul with a device group list -----------------------------------------------------------

def _per_expert(x, counts, gate_up, down):
    """The experts one by one, in x's dtype (what the loop computes)."""
    out, start = [], 0
    for e, n in enumerate(counts):
        g, u = F.linear(x[start:start + n], gate_up[e]).chunk(2, dim=-1)
        out.append(F.linear(F.silu(g) * u, down[e]))
        start += n
    return torch.cat(out).float()


@pytest.mark.parametrize("impl", ["loop", "torch_grouped", "npu_grouped"])
@pytest.mark.parametrize("local", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mlp_with_a_device_group_list_zeroes_the_padding(impl, local, dtype):
    gate_up, down = expert_weights(local, dtype)
    counts = [4, 0, 3][:local] if local > 1 else [5]
    x = torch.randn(sum(counts) + 6, 16).to(dtype)
    x[sum(counts):] = float("inf")  # padding rows: never computed, so never spoil anything
    gl = torch.tensor(counts, dtype=torch.int64)
    with installed(fake_npu() if impl == "npu_grouped" else None):
        y = grouped_mlp(x, gl, gate_up, down, impl=impl)
        gmm = calls("npu_grouped_matmul")
    n = sum(counts)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y[:n].float(), _per_expert(x, counts, gate_up, down), **tol)
    assert y.dtype == dtype and not y[n:].any(), "rows past the group list must be exact zeros"
    if impl == "npu_grouped":  # one expert: a plain matmul, since the operator refuses a list of one
        assert [(c["group_list_type"], c["groups"], c["rows"]) for c in gmm] == \
               ([] if local == 1 else [(1, local, n)] * 2)


def test_npu_grouped_matmul_refuses_a_group_list_of_one():
    gate_up, down = expert_weights(1)
    with pytest.raises(RuntimeError, match="length 1"):
        npu_grouped_matmul([torch.randn(3, 16)], [gate_up.transpose(1, 2)], group_list=torch.tensor([3]),
                           split_item=2, group_type=0, group_list_type=1)


def test_host_counts_are_copied_to_the_device_once():
    gate_up, down = expert_weights(3)
    x = torch.randn(7, 16)
    assert group_list([4, 0, 3], x.device) is group_list([4, 0, 3], x.device)
    with installed(fake_npu()):
        grouped_mlp(x, [4, 0, 3], gate_up, down, impl="npu_grouped")
        grouped_mlp(x, [4, 0, 3], gate_up, down, impl="npu_grouped")
        ptrs = {c["list_ptr"] for c in calls("npu_grouped_matmul")}
    assert len(ptrs) == 1, "every call copied the counts again"
    with mock.patch.object(torch, "tensor", side_effect=AssertionError("host -> device copy")):
        grouped_mlp(x, [4, 0, 3], gate_up, down, impl="torch_grouped")


def test_grouped_matmul_work_is_the_routed_rows():
    gate_up, down = expert_weights(4)
    x = torch.randn(40, 16)
    gl = torch.tensor([3, 0, 5, 1])
    seen = []
    real = torch._grouped_mm

    def spy(a, b, offs=None, **kw):
        seen.append(int(offs[-1]))
        return real(a, b, offs=offs, **kw)

    with mock.patch.object(torch, "_grouped_mm", spy):
        grouped_mlp(x, gl, gate_up, down, impl="torch_grouped")
    assert seen == [9, 9]  # 9 routed rows of 40 (4 experts x 40 rows before)


def test_which_grouped_matmul_takes_a_device_group_list():
    gate_up, down = expert_weights(3)
    x = torch.randn(5, 16)
    assert device_group_impl(x, gate_up, down) == "torch_grouped"
    assert device_group_impl(torch.randn(5, 10), torch.randn(3, 16, 10), torch.randn(3, 10, 8)) is None  # unaligned
    with mock.patch("torch.compiler.is_compiling", return_value=True):  # the meta kernel takes bf16 only
        assert device_group_impl(x, gate_up, down) is None
        assert device_group_impl(x.bfloat16(), gate_up.bfloat16(), down.bfloat16()) == "torch_grouped"
    with installed(fake_npu()):
        assert device_group_impl(x, gate_up, down) == "npu_grouped"
    with installed(types.ModuleType("torch_npu")):  # a stand-in without the operators (the graph-contract tests')
        assert device_group_impl(x, gate_up, down) is None and experts_mod.torch_npu_with("x") is None


def test_grouping_and_grouped_matmul_trace_with_static_shapes():
    """Under torch.compile(fullgraph=True) nothing is read on the host; a new routing does not recompile."""
    import torch._dynamo

    gate_up, down = expert_weights(4, torch.bfloat16)

    def layer(x, ids, w):
        g = group_rows(x, ids, w, 4)
        return reduce_rows(grouped_mlp(g.x, g.group_list, gate_up, down, impl="torch_grouped"), g)

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (1, 2, 3):
            x, ids, w = _routing(10, 2, 4, seed, empty=(3,) if seed == 2 else ())
            x = x.bfloat16()
            torch.testing.assert_close(compiled(x, ids, w), layer(x, ids, w), rtol=2e-2, atol=2e-2)


# --- CUDA: torch._grouped_mm with device offsets (run where a GPU is present) -----------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def cuda_path(monkeypatch):
    """The CUDA path, which the suite's default (``OVERLAP_PATH=cpu``, tests/conftest.py) is not."""
    monkeypatch.setenv("OVERLAP_PATH", "cuda")


@cuda
def test_cuda_grouped_matmul_takes_a_device_group_list(cuda_path):
    dev = torch.device("cuda")
    gate_up, down = (t.to(dev) for t in expert_weights(4, torch.bfloat16, hidden=64, ffn=32))
    x = torch.randn(40, 64, device=dev).to(torch.bfloat16)
    x[9:] = float("inf")
    gl = torch.tensor([3, 0, 5, 1], device=dev)
    assert device_group_impl(x, gate_up, down) == "torch_grouped"
    assert device_group_impl(x.float(), gate_up.float(), down.float()) is None  # CUDA's kernel takes bf16 only
    y = grouped_mlp(x, gl, gate_up, down, impl="torch_grouped")
    torch.testing.assert_close(y[:9].float(), _per_expert(x[:9], [3, 0, 5, 1], gate_up, down), rtol=2e-2, atol=2e-2)
    assert not y[9:].any()


@cuda
def test_cuda_grouping_reduces_like_the_reference_and_compiles(cuda_path):
    import torch._dynamo

    dev = torch.device("cuda")
    gate_up, down = (t.to(dev) for t in expert_weights(4, torch.bfloat16, hidden=64, ffn=32))

    def layer(x, ids, w):
        g = group_rows(x, ids, w, 4)
        return reduce_rows(grouped_mlp(g.x, g.group_list, gate_up, down, impl="torch_grouped"), g)

    cpu_gate_up, cpu_down = gate_up.cpu(), down.cpu()

    def reference(x, ids, w):  # on the CPU, row by row
        return _expected(x.float(), ids, w, lambda e, row: _per_expert(row[None].to(torch.bfloat16), [1],
                                                                       cpu_gate_up[e:e + 1], cpu_down[e:e + 1])[0])

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (1, 2):
            x, ids, w = _routing(24, 2, 4, seed, empty=(3,) if seed == 2 else ())
            x = torch.randn(24, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
            want = reference(x, ids, w)
            for fn in (layer, compiled):
                got = fn(x.to(dev), ids.to(dev), w.to(dev)).cpu()
                torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)


@cuda
def test_cuda_capacity_layer_groups_on_the_device(cuda_path):
    from collectives import MoE, MoEConfig, capacity_expert_parallel
    from collectives.capacity import expert_path

    torch.manual_seed(0)
    moe = MoE(MoEConfig(hidden=64, ffn=32, n_experts=8, top_k=2)).requires_grad_(False).cuda().to(torch.bfloat16)
    x = torch.randn(50, 64, device="cuda").to(torch.bfloat16)
    grouped = capacity_expert_parallel(moe)
    every = capacity_expert_parallel(moe, expert_path="all")
    assert expert_path("auto", x, grouped.experts) == "torch_grouped"
    got = grouped(x)
    torch.testing.assert_close(got, moe(x), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got, every(x), rtol=3e-2, atol=3e-2)


def test_a_torch_npu_without_the_grouped_matmul_runs_the_loop_or_says_so():
    """An older torch_npu without ``npu_grouped_matmul``: ``auto`` computes with the loop (same answer);
    ``grouped`` asked for explicitly is refused with the operator's name, not an AttributeError mid-layer."""
    from collectives.experts import resolve_impl

    gate_up, down = expert_weights(3)
    x = torch.randn(7, 16)
    bare = fake_npu()
    del bare.npu_grouped_matmul
    with installed(bare):
        assert resolve_impl("auto", x, gate_up, down) == "loop"
        assert device_group_impl(x, gate_up, down) is None
        y = grouped_mlp(x, [4, 0, 3], gate_up, down, impl="auto")
        with pytest.raises(ValueError, match="npu_grouped_matmul"):
            grouped_mlp(x, [4, 0, 3], gate_up, down, impl="grouped")
    torch.testing.assert_close(y, _per_expert(x, [4, 0, 3], gate_up, down), rtol=1e-5, atol=1e-5)
    with installed(fake_npu()):
        assert resolve_impl("auto", x, gate_up, down) == "npu_grouped"
