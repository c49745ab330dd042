"""Faults in expert-parallel input: a non-finite token or expert spoils only its own rows, and ranks that
disagree (layer shapes, bad input on one rank) raise LayoutError on every rank instead of hanging."""
from __future__ import annotations

import sys
from unittest import mock

import pytest
import torch
from torch import nn

from collectives import (ExpertParallelMoE, LayoutError, MoE, MoEConfig, capacity_expert_parallel, combine, dispatch,
                         expand, wrap_expert_parallel)
from collectives.capacity import reduce_slots
from collectives.experts import LocalExperts
from overlap.multirank import run_ranks
from support.spans import comm_span_names

pytestmark = pytest.mark.cpu_only  # CPU tensors and gloo-only fakes; run_ranks uses torchrun ranks where there are

BAD = {"inf": float("inf"), "nan": float("nan")}
TOKENS, BAD_TOKEN = 16, 15


class _RoundRobin(nn.Module):
    """Token t picks experts t, t+1 (mod E), with weights from the token. The ids never depend on the values, so
    a bad token changes no other token's layout; on 2 ranks rank 0's token 15 is rank 1's last expanded row."""

    def __init__(self, n_experts: int, k: int):
        super().__init__()
        self.n_experts, self.k = n_experts, k

    def forward(self, x):
        t = torch.arange(x.shape[0])
        return (t[:, None] + torch.arange(self.k)[None]) % self.n_experts, x[:, : self.k].float().softmax(-1)


def _layer(ctx, path: str):
    cfg = MoEConfig(hidden=16, ffn=8, n_experts=8, top_k=2, n_shared=1)
    torch.manual_seed(1234)
    moe = MoE(cfg).requires_grad_(False)
    moe.router = _RoundRobin(cfg.n_experts, cfg.top_k)
    if path == "capacity":
        return capacity_expert_parallel(moe, ctx.group)
    return wrap_expert_parallel(moe, ctx.group)


def _spoiled_rows(ctx, path: str, fault: str, value: float):
    """Rows that are not the fault's own yet are non-finite or changed by it, as ``[(rank, token)]``; and the
    number of non-finite values in the fault's own rows (to see that it took effect)."""
    layer = _layer(ctx, path)
    torch.manual_seed(ctx.rank)
    x = torch.randn(TOKENS, 16)
    clean = layer(x)
    own = torch.zeros(TOKENS, dtype=torch.bool)
    if fault == "token":
        if ctx.rank == 0:
            x[BAD_TOKEN] = value
            own[BAD_TOKEN] = True
    else:  # the weights of expert `fault` are non-finite: only tokens routed to it may be spoiled
        e = int(fault) - layer.experts.first_expert
        if 0 <= e < layer.experts.num_local:
            layer.experts.gate_up.data[e] = value
        idx, _ = layer.router(x)
        own = (idx == int(fault)).any(1)
    got = layer(x)
    ok = torch.isfinite(got).all(1) & (got == clean).all(1)
    return [(ctx.rank, t) for t in range(TOKENS) if not own[t] and not ok[t]], int((~torch.isfinite(got[own])).sum())


def _faults_body(ctx, path: str, faults):
    if path == "dense":  # the static-shape reduction that devices, graphs and autograd take
        sys.modules["collectives.layout"]._eager_cpu = lambda t: False
    return {(fault, str(value)): _spoiled_rows(ctx, path, fault, value) for fault, value in faults}


def _check_faults(world, path, faults):
    per_rank = run_ranks(_faults_body, world, path, faults, timeout=60)
    for fault, value in faults:
        key = (fault, str(value))
        assert [r for out in per_rank for r in out[key][0]] == [], key
        assert sum(out[key][1] for out in per_rank) > 0, key  # the fault took effect on its own rows


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("path", ["eager", "dense", "capacity"])
def test_an_inf_token_spoils_only_its_own_row(world, path):
    _check_faults(world, path, [("token", BAD["inf"])])


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("path", ["eager", "dense", "capacity"])
def test_a_nan_token_and_a_nan_expert_spoil_only_their_own_rows(world, path):
    # local expert 0 (what capacity's masked slots read) and the last one (dense's clamped slots on 2 ranks)
    _check_faults(world, path, [("token", BAD["nan"]), ("0", BAD["nan"]), ("7", BAD["inf"])])


@pytest.mark.parametrize("bad", sorted(BAD))
def test_static_shape_reductions_select_masked_slots(bad):
    """The reductions alone: a bad row read by masked slots (experts elsewhere, padding) adds an exact zero."""
    layout = sys.modules["collectives.layout"]
    g = torch.Generator().manual_seed(2)
    rows, k, local, hidden = 12, 3, 4, 8
    ids = torch.randint(-1, local, (rows, k), generator=g)
    ids[:3] = -1  # rows with no local slot
    ids[3, 0] = local - 1  # the last expert has a row, so the last expanded row is a real one
    meta = torch.cat([ids.float(), torch.rand(rows, k, generator=g)], dim=1)
    batch = expand(torch.randn(rows, hidden, generator=g), meta, local)
    expert_out, weights = batch.x * 2, meta[:, k:]
    spoiled = expert_out.clone()
    spoiled[-1] = BAD[bad]  # the row that slots elsewhere are clamped to
    keep = torch.arange(rows) != batch.rows[-1]
    for reduce in (layout._reduce_local_dense, layout.reduce_local):  # static-shape form, eager CPU form
        clean, got = reduce(expert_out, batch, weights), reduce(spoiled, batch, weights)
        assert torch.equal(got[keep], clean[keep]) and torch.isfinite(got[keep]).all(), reduce
        assert not torch.isfinite(got[~keep]).all()
    every = torch.randn(local, rows, hidden, generator=g)  # capacity: every local expert over every row
    clean = reduce_slots(every, ids, weights)
    every[0] = BAD[bad]  # local expert 0 is what masked slots read; rows that chose it may go bad
    got = reduce_slots(every, ids, weights)
    keep = ~(ids == 0).any(1)
    assert keep.sum() > 3 and torch.equal(got[keep], clean[keep]) and torch.isfinite(got[keep]).all()


# --- ranks that disagree ------------------------------------------------------------------------------

MISMATCHES = {  # field: (rank 0's value, rank 1's value, the message's name for it and the argument it names)
    "hidden": (64, 128, "hidden size (x.shape[1])"),
    "n_experts": (4, 8, "number of experts (num_experts)"),
    "top_k": (2, 1, "top-k (topk_idx.shape[1])"),
    "dtype": (torch.float32, torch.bfloat16, "dtype of the tokens (x.dtype)"),
}


def _build(kind: str, cfg: MoEConfig, group, dtype=torch.float32):
    torch.manual_seed(0)
    moe = MoE(cfg).requires_grad_(False).to(dtype)
    if kind == "eager":
        return wrap_expert_parallel(moe, group)
    if kind == "from_config":
        return ExpertParallelMoE.from_config(cfg, group).to(dtype)
    return capacity_expert_parallel(moe, group, capacity=8, validate=kind == "capacity")


def _mismatch_body(ctx, kind: str):
    comm = comm_span_names()
    out = {}
    for field, values in MISMATCHES.items():
        cfg = MoEConfig(hidden=64, ffn=16, n_experts=4, top_k=2, n_shared=1)
        dtype = torch.float32
        if field == "dtype":
            dtype = values[ctx.rank]
        else:
            setattr(cfg, field, values[ctx.rank])
        layer = _build(kind, cfg, ctx.group, dtype)
        del comm[:]
        try:
            layer(torch.randn(8, cfg.hidden).to(dtype))
            out[field] = ("no error", list(comm))
        except LayoutError as err:
            out[field] = (str(err), list(comm))
    # every rank stopped at the same point: the group is still usable
    layer = _build(kind, MoEConfig(hidden=64, ffn=16, n_experts=4, top_k=2), ctx.group)
    x = torch.randn(8, 64)
    out["after"] = torch.equal(layer(x), layer(x))
    return out


@pytest.mark.parametrize("kind", ["eager", "from_config", "capacity", "capacity_unvalidated"])
def test_ranks_that_build_different_layers_all_raise(kind):
    for rank, out in enumerate(run_ranks(_mismatch_body, 2, kind, timeout=60)):
        for field, (a, b, name) in MISMATCHES.items():
            message, comm = out[field]
            shown = (repr(str(a)), repr(str(b))) if field == "dtype" else (a, b)  # a dtype by its name
            assert f"ranks disagree on the {name}: rank 0: {shown[0]}; rank 1: {shown[1]}; every rank of the " \
                   f"expert-parallel group must pass the same" in message, (rank, field, message)
            assert comm == ["dispatch.capacity" if kind == "capacity" else "moe.agree"], (rank, field, comm)
        assert out["after"]


def _once_body(ctx, kind: str):
    comm = comm_span_names()
    layer = _build(kind, MoEConfig(hidden=32, ffn=16, n_experts=2 * ctx.world_size, top_k=2), ctx.group)
    x = torch.randn(6, 32)
    for _ in range(3):
        layer(x)
    with mock.patch("torch.compiler.is_compiling", return_value=True):
        fresh = _build(kind, MoEConfig(hidden=32), ctx.group)
        skipped_while_compiling = not fresh.shapes.pending(fresh)
    return list(comm), skipped_while_compiling


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", ["eager", "capacity", "capacity_unvalidated"])
def test_the_agreement_runs_once_and_folds_into_capacitys_check(world, kind):
    for comm, skipped in run_ranks(_once_body, world, kind, timeout=60):
        agree = 1 if world > 1 and kind != "capacity" else 0  # validated capacity: inside its own all-reduce
        assert comm.count("moe.agree") == agree, comm
        assert comm.count("dispatch.capacity") == (3 if kind == "capacity" and world > 1 else 0), comm
        assert skipped


def _experts_of_another_size(ctx, kind: str):
    cfg = MoEConfig(hidden=32, ffn=16, n_experts=4, top_k=2, n_shared=0)
    layer = _build(kind, cfg, ctx.group)
    if ctx.rank == 1:  # this rank's experts were built for hidden 16
        experts = LocalExperts(torch.randn(2, 32, 16), torch.randn(2, 16, 16), 2)
        layer.experts = experts
    try:
        layer(torch.randn(5, 32))
    except LayoutError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("kind", ["eager", "capacity", "capacity_unvalidated"])
def test_experts_that_do_not_fit_the_tokens_on_one_rank_stop_every_rank(kind):
    r0, r1 = run_ranks(_experts_of_another_size, 2, kind, timeout=60)
    # rank 1 raises its own error; rank 0 names rank 1 and says why (its words travel in the agreement)
    assert r0 == "rank 1: LayoutError: this rank's experts take hidden size 16, but the tokens are (5, 32)", r0
    assert r1 == "this rank's experts take hidden size 16, but the tokens are (5, 32)", r1


def _raw_dispatch_faults(ctx):
    out = {}
    cases = {  # (tokens, ids) -> (tokens, ids, num_experts) on this rank
        "bad id on one rank": lambda x, idx: (x, idx.index_fill(0, torch.tensor([0]), 99) if ctx.rank else idx, 4),
        "hidden": lambda x, idx: (torch.randn(6, 16 * (1 + ctx.rank)), idx, 4),
        "top-k": lambda x, idx: (x, idx[:, : 2 - ctx.rank], 4),
        "dtype": lambda x, idx: (x.to(torch.bfloat16) if ctx.rank else x, idx, 4),
        # count rows of another width on each rank: a native gloo abort before the expert count was agreed
        "experts": lambda x, idx: (x, idx if ctx.rank else idx * 2 + 1, 4 if ctx.rank else 8),
        "experts indivisible on one rank": lambda x, idx: (x, idx % 3 if ctx.rank else idx, 3 if ctx.rank else 4),
    }
    for name, change in cases.items():
        x, idx, experts = change(torch.randn(6, 16), torch.tensor([[0, 3]] * 6))
        try:
            dispatch(x, idx, torch.rand(idx.shape), experts, ctx.group)
            out[name] = "no error"
        except LayoutError as err:
            out[name] = str(err)
    x, idx = torch.randn(6, 16), torch.tensor([[0, 3]] * 6)  # afterwards the group is still usable
    h = dispatch(x, idx, torch.ones(6, 2), 4, ctx.group)
    b = h.expand()
    out["after"] = torch.allclose(combine(b.x, b, h).wait(), 2 * x)
    return out


def test_raw_dispatch_checks_agreement_in_its_count_exchange():
    r0, r1 = run_ranks(_raw_dispatch_faults, 2, timeout=60)
    # the count rows carry a rejection as a flag: the others name the rank, its own error says why
    assert r0["bad id on one rank"].startswith("rank 1: rejected its input (its own error says why); every rank "
                                               "of the expert-parallel group stops before the exchange")
    assert "99" in r1["bad id on one rank"]
    assert r0["experts indivisible on one rank"] == (
        "the ranks cannot go on together:\n  rank 1: rejected its input (its own error says why); every rank of the "
        "expert-parallel group stops before the exchange\n  ranks disagree on the number of experts (num_experts): "
        "rank 0: 4; rank 1: 3; every rank of the expert-parallel group must pass the same num_experts (build the "
        "same layer, pass tokens of one hidden size and dtype)")
    assert "3 experts cannot be placed" in r1["experts indivisible on one rank"]
    for r in (r0, r1):
        assert "ranks disagree on the hidden size (x.shape[1]): rank 0: 16; rank 1: 32" in r["hidden"]
        assert "ranks disagree on the top-k (topk_idx.shape[1]): rank 0: 2; rank 1: 1" in r["top-k"]
        assert ("ranks disagree on the dtype of the tokens (x.dtype): rank 0: 'torch.float32'; "
                "rank 1: 'torch.bfloat16'") in r["dtype"]
        assert ("ranks disagree on the number of experts (num_experts): rank 0: 8; rank 1: 4; every "
                "rank of the expert-parallel group must pass the same num_experts") in r["experts"]
        assert r["after"]


def test_wrong_expert_counts_and_devices_are_rejected():
    meta = torch.tensor([[0.0, 1.0, 0.5, 0.5], [1.0, -1.0, 1.0, 0.0]])
    x = torch.randn(2, 4)
    assert expand(x, meta, 2, [1, 2]).counts == [1, 2]
    with pytest.raises(LayoutError, match="disagree with the received rows"):
        expand(x, meta, 2, [2, 1])  # would have given expert 0 a row of expert 1, silently
    with pytest.raises(LayoutError, match="one device"):
        dispatch(x, torch.zeros(2, 1, dtype=torch.long, device="meta"), torch.ones(2, 1), 2)
