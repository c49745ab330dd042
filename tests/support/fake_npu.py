"""A fake torch_npu for CPU tests: the grouping operators with their documented semantics and the wheel's argument
names (`check_against_schema` compares them with the torch_npu wheel's schema), the calls they record, and expert
weights for the grouped matmul."""
from __future__ import annotations

import contextlib
import importlib.machinery
import inspect
import re
import sys
import types
import zipfile
from typing import Callable, Dict, Iterable, Iterator, List, Optional
from unittest import mock

import pytest
import torch

import overlap

SCHEMA = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
UNDEFINED = float("nan")  # what the fake leaves in rows an operator documents as undefined


# --- the fake torch_npu ------------------------------------------------------------------------------

def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       tuning_config=None, output_dtype=None, x_dtype=None, weight_dtype=None, scale_dtype=None,
                       per_token_scale_dtype=None):
    """One x split along M by a tensor group list (split_item 2/3, group_type 0), one stacked weight [E, K, N];
    rows past the group list are undefined (NaN). Refuses a group list of length 1. Per-token quantized (the
    torch_npu docs' table): int8 x and weight, ``scale`` [E, N] float32 / bf16, ``per_token_scale`` [M] float32,
    ``output_dtype`` bf16 / fp16; ``y = (x @ w) * scale[e] * per_token_scale``."""
    assert split_item in (2, 3) and group_type == 0 and group_list_type in (0, 1), (split_item, group_type)
    assert len(x) == 1 and len(weight) == 1 and x[0].dim() == 2 and weight[0].dim() == 3
    assert isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64 and group_list.dim() == 1
    (a,), (w,) = x, weight
    assert a.dtype == w.dtype and w.shape[1] == a.shape[1] and group_list.shape[0] == w.shape[0]
    quantized = a.dtype == torch.int8
    if quantized:
        _check_per_token_args(a, w, scale, per_token_scale, output_dtype, offset)
    else:
        assert scale is None and per_token_scale is None, "scales are for int8 x and weight"
    if group_list.shape[0] == 1:
        raise RuntimeError("npu_grouped_matmul: a group list of length 1 is not supported")
    ends = group_list.cumsum(0) if group_list_type == 1 else group_list
    out_dtype = output_dtype if quantized else a.dtype
    y = torch.full((a.shape[0], w.shape[2]), UNDEFINED, dtype=out_dtype)
    start = 0
    for e, end in enumerate(ends.tolist()):
        part = a[start:end].double() @ w[e].double()
        if quantized:
            part = part * scale[0][e].double() * per_token_scale[0][start:end, None].double()
        y[start:end] = part.to(out_dtype)
        start = end
    CALLS.append(("npu_grouped_matmul", dict(group_list_type=group_list_type, groups=group_list.shape[0],
                                             rows=start, list_ptr=group_list.data_ptr(), x_dtype=a.dtype,
                                             scale=None if scale is None else scale[0],
                                             per_token_scale=None if per_token_scale is None else per_token_scale[0],
                                             group_list=group_list.clone(), output_dtype=output_dtype)))
    return [y]


def _check_per_token_args(a, w, scale, per_token_scale, output_dtype, offset) -> None:
    """The per-token quantized form's arguments, as the torch_npu docs' table allows them."""
    assert offset is None, "offset: only None is supported"
    assert scale is not None and len(scale) == 1 and scale[0].dtype in (torch.float32, torch.bfloat16)
    assert tuple(scale[0].shape) == (w.shape[0], w.shape[2]), ("scale must be [E, N]", tuple(scale[0].shape))
    assert per_token_scale is not None and len(per_token_scale) == 1
    assert per_token_scale[0].dtype == torch.float32 and tuple(per_token_scale[0].shape) == (a.shape[0],)
    assert output_dtype in (torch.bfloat16, torch.float16), f"output_dtype {output_dtype}"


def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                      dst_type_max=0.0):
    """Per-token symmetric int8: ``(round(x / s).clamp(-127, 127) int8, s = absmax / 127 float32 [rows])``."""
    assert smooth_scales is None and group_index is None and dst_type is None and quant_mode == "pertoken"
    absmax = input.double().abs().amax(dim=-1)
    s = torch.where(absmax == 0, torch.ones_like(absmax), absmax / 127.0)
    q = torch.round(input.double() / s[:, None]).clamp(-127, 127).to(torch.int8)
    CALLS.append(("npu_dynamic_quant", dict(rows=input.shape[0], dtype=input.dtype)))
    return q, s.float()


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
    """The keyword records of the calls of operator ``name`` since the last `installed`."""
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
    """The native operator schema yaml of the torch_npu wheel for the installed torch; skips the test without one."""
    try:
        from tools import torchair_contract as tc

        wheel = tc.find_wheel()
        with zipfile.ZipFile(wheel) as zf:
            return zf.read(SCHEMA).decode()
    except Exception as exc:  # no wheel here and none to download
        pytest.skip(f"no torch_npu wheel to read the schema from: {exc}")


def check_against_schema(fns: Iterable[Callable]) -> None:
    """Each of ``fns`` (named for an operator) takes the wheel schema's arguments, kinds and defaults, in order."""
    text = wheel_schema()
    for fn in fns:
        want, got = _schema_params(text, fn.__name__), _python_params(fn)
        assert list(got) == list(want), (fn.__name__, list(got), list(want))
        for name, (kw, default) in want.items():
            assert got[name][0] == kw, (fn.__name__, name, "keyword-only" if kw else "positional")
            if default is not None:
                norm = {"None": None, "False": False, "True": True, "[]": [], '""': ""}.get(default, default)
                norm = int(norm) if isinstance(norm, str) and re.fullmatch(r"-?\d+", norm) else norm
                norm = float(norm) if isinstance(norm, str) and re.fullmatch(r"-?\d+\.\d*", norm) else norm
                norm = norm[1:-1] if isinstance(norm, str) and re.fullmatch(r'"[^"]*"', norm) else norm
                assert got[name][1] == norm, (fn.__name__, name, got[name][1], default)


# --- expert weights for the grouped matmul ---------------------------------------------------------------

def expert_weights(local: int, dtype: torch.dtype = torch.float32, hidden: int = 16, ffn: int = 8) -> tuple:
    """Stacked expert weights for ``local`` experts, seeded by ``local``: gate_up [E, 2 * ffn, hidden] and
    down [E, hidden, ffn], scaled so that the outputs stay near unit size."""
    g = torch.Generator().manual_seed(local)
    return ((torch.randn(local, 2 * ffn, hidden, generator=g) * hidden ** -0.5).to(dtype),
            (torch.randn(local, hidden, ffn, generator=g) * ffn ** -0.5).to(dtype))
