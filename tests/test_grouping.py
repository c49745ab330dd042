"""Static-shape grouping by local expert, the grouped matmul with a device group list, and the NPU branch
checked on CPU against a fake torch_npu with the documented semantics and the wheel's argument names."""
from __future__ import annotations

import contextlib
import importlib.machinery
import inspect
import re
import sys
import types
import zipfile
from typing import Dict, Iterator, List, Optional
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import overlap
from collectives import experts as experts_mod
from collectives._grouping import group_rows, reduce_rows
from collectives.experts import device_group_impl, group_list, grouped_mlp

SCHEMA = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
UNDEFINED = float("nan")  # what the fake leaves in rows an operator documents as undefined


# --- the fake torch_npu ------------------------------------------------------------------------------

def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       tuning_config=None, output_dtype=None, x_dtype=None, weight_dtype=None, scale_dtype=None,
                       per_token_scale_dtype=None):
    """One x split along M by a tensor group list (split_item 2/3, group_type 0), one stacked weight [E, K, N];
    rows past the group list are undefined (NaN). Refuses a group list of length 1."""
    assert split_item in (2, 3) and group_type == 0 and group_list_type in (0, 1), (split_item, group_type)
    assert len(x) == 1 and len(weight) == 1 and x[0].dim() == 2 and weight[0].dim() == 3
    assert isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64 and group_list.dim() == 1
    (a,), (w,) = x, weight
    assert a.dtype == w.dtype and w.shape[1] == a.shape[1] and group_list.shape[0] == w.shape[0]
    if group_list.shape[0] == 1:
        raise RuntimeError("npu_grouped_matmul: a group list of length 1 is not supported")
    ends = group_list.cumsum(0) if group_list_type == 1 else group_list
    y = torch.full((a.shape[0], w.shape[2]), UNDEFINED, dtype=a.dtype)
    start = 0
    for e, end in enumerate(ends.tolist()):
        y[start:end] = (a[start:end].float() @ w[e].float()).to(a.dtype)
        start = end
    CALLS.append(("npu_grouped_matmul", dict(group_list_type=group_list_type, groups=group_list.shape[0],
                                             rows=start, list_ptr=group_list.data_ptr())))
    return [y]


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=-1, active_expert_range=[], row_idx_type=0, x_dtype=None):
    """Dropless routing: keyValueSort of the flattened ids (stable), ``expanded_row_idx[sorted[i]] = i``
    (gather type), -1 for ids outside the active range; counts per active expert (count mode)."""
    assert x.dim() == 2 and expert_idx.dim() == 2 and expert_idx.dtype == torch.int32
    assert x.shape[0] == expert_idx.shape[0] and drop_pad_mode == 0 and quant_mode == -1 and row_idx_type == 0
    assert expert_tokens_num_type == 1 and expert_tokens_num_flag is True
    assert 0 <= int(expert_idx.min()) and int(expert_idx.max()) < expert_num, "expert ids beyond expert_num"
    lo, hi = active_expert_range or [0, expert_num]
    assert 0 <= lo < hi <= expert_num
    rows, k = expert_idx.shape
    flat = expert_idx.reshape(-1).long()
    active = (flat >= lo) & (flat < hi)
    order = torch.argsort(torch.where(active, flat, torch.full_like(flat, hi)), stable=True)
    n = int(active.sum()) if active_num <= 0 else min(int(active.sum()), active_num)
    expanded_x = torch.full((rows * k, x.shape[1]), UNDEFINED, dtype=x.dtype)
    expanded_x[:n] = x[order[:n] // k]
    row_idx = torch.full((rows * k,), -1, dtype=torch.int32)
    row_idx[order[:n]] = torch.arange(n, dtype=torch.int32)
    counts = torch.bincount(flat[active] - lo, minlength=hi - lo).to(torch.int64)
    CALLS.append(("npu_moe_init_routing_v2", dict(expert_num=expert_num, active_num=active_num, range=[lo, hi])))
    return expanded_x, row_idx, counts, torch.full((rows * k,), UNDEFINED)


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0, k=1):
    """out[i] = skip1 + skip2 + sum_k scales[i, k] * (rows[idx] + bias[expert]); idx = i + k * NUM_ROWS
    (drop_pad_mode 0) or i * K + k (2: row-major, what init_routing_v2 returns); idx in [0, NUM_ROWS * K)."""
    assert drop_pad_mode in (0, 2) and expanded_src_to_dst_row.dtype == torch.int32
    rows_k = expanded_src_to_dst_row.shape[0]
    assert scales is not None and scales.dtype == expanded_permuted_rows.dtype, "scales must take the rows' dtype"
    n, kk = scales.shape
    idx = expanded_src_to_dst_row.long()
    assert rows_k == n * kk and bool(((idx >= 0) & (idx < rows_k)).all()), "expanded_src_to_dst_row out of range"
    at = idx.view(n, kk) if drop_pad_mode == 2 else idx.view(kk, n).t()
    out = torch.zeros(n, expanded_permuted_rows.shape[1])
    for s in range(kk):
        out += scales[:, s, None].float() * expanded_permuted_rows[at[:, s]].float()
    CALLS.append(("npu_moe_finalize_routing", dict(drop_pad_mode=drop_pad_mode)))
    return out.to(expanded_permuted_rows.dtype)


CALLS: List[tuple] = []
GROUPING_OPS = (npu_grouped_matmul, npu_moe_init_routing_v2, npu_moe_finalize_routing)


def fake_npu(*extra) -> types.ModuleType:
    """A torch_npu stand-in holding the grouping operators (and ``extra`` functions)."""
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)  # path detection may look it up
    for fn in GROUPING_OPS + tuple(extra):
        setattr(mod, fn.__name__, fn)
    return mod


@contextlib.contextmanager
def installed(mod: Optional[types.ModuleType]) -> Iterator[List[tuple]]:
    """``mod`` as torch_npu on an NPU-capable CPU path (the cpu backend's has_npu_ops set) inside the block;
    with None, the plain CPU path. Yields the calls the fake operators record."""
    del CALLS[:]
    if mod is None:
        yield CALLS
        return
    with overlap.use_path("cpu"), mock.patch.object(overlap.backends.get("cpu"), "has_npu_ops", True), \
            mock.patch.dict(sys.modules, {"torch_npu": mod}):
        yield CALLS


def calls(name: str) -> List[dict]:
    return [kw for op, kw in CALLS if op == name]


# --- the fakes take the wheel's argument names ---------------------------------------------------------

def _schema_params(text: str, op: str) -> Dict[str, object]:
    """``{name: (keyword_only, default text or None)}`` of ``op``'s Tensor overload in the schema yaml."""
    line = next(m for m in re.finditer(rf"func: {op}\((.*)\) ->", text) if "int[]? group_list" not in m.group(1))
    params, kw = {}, False
    for item in line.group(1).split(", "):
        if item == "*":
            kw = True
            continue
        decl, _, default = item.partition("=")
        params[decl.split()[-1]] = (kw, default or None)
    return params


def _python_params(fn) -> Dict[str, object]:
    out = {}
    for p in inspect.signature(fn).parameters.values():
        default = None if p.default is inspect.Parameter.empty else p.default
        out[p.name] = (p.kind == inspect.Parameter.KEYWORD_ONLY, default)
    return out


def wheel_schema() -> str:
    try:
        import torchair_contract as tc

        wheel = tc.find_wheel()
        with zipfile.ZipFile(wheel) as zf:
            return zf.read(SCHEMA).decode()
    except Exception as exc:  # no wheel here and none to download
        pytest.skip(f"no torch_npu wheel to read the schema from: {exc}")


def check_against_schema(fns) -> None:
    text = wheel_schema()
    for fn in fns:
        want, got = _schema_params(text, fn.__name__), _python_params(fn)
        assert list(got) == list(want), (fn.__name__, list(got), list(want))
        for name, (kw, default) in want.items():
            assert got[name][0] == kw, (fn.__name__, name, "keyword-only" if kw else "positional")
            if default is not None:
                norm = {"None": None, "False": False, "True": True, "[]": [], '""': ""}.get(default, default)
                norm = int(norm) if isinstance(norm, str) and re.fullmatch(r"-?\d+", norm) else norm
                assert got[name][1] == norm, (fn.__name__, name, got[name][1], default)


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

def _weights(local: int, dtype=torch.float32, hidden=16, ffn=8):
    g = torch.Generator().manual_seed(local)
    return ((torch.randn(local, 2 * ffn, hidden, generator=g) * hidden ** -0.5).to(dtype),
            (torch.randn(local, hidden, ffn, generator=g) * ffn ** -0.5).to(dtype))


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
    gate_up, down = _weights(local, dtype)
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
    gate_up, down = _weights(1)
    with pytest.raises(RuntimeError, match="length 1"):
        npu_grouped_matmul([torch.randn(3, 16)], [gate_up.transpose(1, 2)], group_list=torch.tensor([3]),
                           split_item=2, group_type=0, group_list_type=1)


def test_host_counts_are_copied_to_the_device_once():
    gate_up, down = _weights(3)
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
    gate_up, down = _weights(4)
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
    gate_up, down = _weights(3)
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

    gate_up, down = _weights(4, torch.bfloat16)

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


@cuda
def test_cuda_grouped_matmul_takes_a_device_group_list():
    dev = torch.device("cuda")
    gate_up, down = (t.to(dev) for t in _weights(4, torch.bfloat16, hidden=64, ffn=32))
    x = torch.randn(40, 64, device=dev).to(torch.bfloat16)
    x[9:] = float("inf")
    gl = torch.tensor([3, 0, 5, 1], device=dev)
    assert device_group_impl(x, gate_up, down) == "torch_grouped"
    assert device_group_impl(x.float(), gate_up.float(), down.float()) is None  # CUDA's kernel takes bf16 only
    y = grouped_mlp(x, gl, gate_up, down, impl="torch_grouped")
    torch.testing.assert_close(y[:9].float(), _per_expert(x[:9], [3, 0, 5, 1], gate_up, down), rtol=2e-2, atol=2e-2)
    assert not y[9:].any()


@cuda
def test_cuda_grouping_reduces_like_the_reference_and_compiles():
    import torch._dynamo

    dev = torch.device("cuda")
    gate_up, down = (t.to(dev) for t in _weights(4, torch.bfloat16, hidden=64, ffn=32))

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
def test_cuda_capacity_layer_groups_on_the_device():
    from collectives import CapacityExpertParallelMoE, MoE, MoEConfig
    from collectives.capacity import expert_path

    torch.manual_seed(0)
    moe = MoE(MoEConfig(hidden=64, ffn=32, n_experts=8, top_k=2)).requires_grad_(False).cuda().to(torch.bfloat16)
    x = torch.randn(50, 64, device="cuda").to(torch.bfloat16)
    grouped = CapacityExpertParallelMoE.wrap(moe)
    every = CapacityExpertParallelMoE.wrap(moe, expert_path="all")
    assert expert_path("auto", x, grouped.experts) == "torch_grouped"
    got = grouped(x)
    torch.testing.assert_close(got, moe(x), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got, every(x), rtol=3e-2, atol=3e-2)


def test_a_torch_npu_without_the_grouped_matmul_runs_the_loop_or_says_so():
    """An older torch_npu without ``npu_grouped_matmul``: ``auto`` computes with the loop (same answer);
    ``grouped`` asked for explicitly is refused with the operator's name, not an AttributeError mid-layer."""
    from collectives.experts import resolve_impl

    gate_up, down = _weights(3)
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
