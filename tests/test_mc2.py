"""The MC2 exchange (torch_npu's fused dispatch / combine) on 2 gloo ranks, with a fake of the two operators over
gloo all_to_all (the wheel's argument names and return tuple); the HCCL buffer check; the exchange's choice."""
from __future__ import annotations

import os
from typing import Dict, List, Optional
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from collectives import EPBatch, EPCombineHandle, EPDispatchHandle, LayoutError, MoE, MoEConfig, combine_dense, mc2
from collectives import mc2_expert_parallel
from collectives.mc2 import (MC2_MAX_TOKENS, MC2Error, check_mc2_buffer, choose_exchange, ep_combine, ep_dispatch,
                             mc2_buffer_bytes, mc2_buffer_mb, mc2_dispatch)
from overlap.multirank import run_ranks
from support.fake_npu import CALLS, UNDEFINED, calls, check_against_schema, fake_npu, installed
from support.protocols import protocol_problems
from support.spans import comm_span_names

BF16 = dict(rtol=2e-2, atol=2e-2)
GROUPS: Dict[str, Optional[dist.ProcessGroup]] = {}  # group_ep name -> process group, for the fake


# --- the fake operators: documented semantics, exchanged over gloo -----------------------------------------

def _exchange(rows: torch.Tensor, meta: torch.Tensor, group) -> tuple:
    """Block r of ``rows`` / ``meta`` (fixed size) to rank r; rank r's blocks for us back."""
    out_rows, out_meta = torch.empty_like(rows), torch.empty_like(meta)
    dist.all_to_all_single(out_rows, rows.contiguous(), group=group)
    dist.all_to_all_single(out_meta, meta.contiguous(), group=group)
    return out_rows, out_meta


def npu_moe_distribute_dispatch_v2(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                                   scales=None, x_active_mask=None, expert_scales=None, elastic_info=None,
                                   performance_info=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                                   expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, quant_mode=0,
                                   global_bs=0, expert_token_nums_type=1, comm_alg="", zero_expert_num=0,
                                   copy_expert_num=0, const_expert_num=0, y_dtype=None, x_dtype=None,
                                   scales_dtype=None):
    """Every active (token, expert) pair to the expert's rank; rows grouped by local expert (then source rank,
    token, slot); rows past the received pairs undefined. Returns the 7 documented outputs."""
    group = GROUPS[group_ep]
    w, bs, k, h = ep_world_size, x.shape[0], expert_ids.shape[1], x.shape[1]
    assert x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16) and expert_ids.dtype == torch.int32
    assert w == dist.get_world_size(group) and ep_rank_id == dist.get_rank(group) and moe_expert_num % w == 0
    assert quant_mode == 0 and scales is None and expert_token_nums_type in (0, 1) and global_bs in (0, bs * w)
    assert all(len(set(row)) == k for row in expert_ids.tolist()), "the K ids of a row must differ"
    if x_active_mask is not None:  # 1-D bool, active tokens first
        assert x_active_mask.dtype == torch.bool and x_active_mask.shape == (bs,)
        assert torch.equal(x_active_mask, x_active_mask.sort(descending=True, stable=True).values)
    active = torch.ones(bs, dtype=torch.bool) if x_active_mask is None else x_active_mask
    local = moe_expert_num // w
    cap = bs * k  # pairs one rank can send another
    rows = torch.zeros(w, cap, h, dtype=x.dtype)
    meta = torch.full((w, cap, 4), -1, dtype=torch.int64)  # token, slot, local expert, valid
    fill = [0] * w
    for t in range(bs):
        for s in range(k):
            e = int(expert_ids[t, s])
            if active[t]:
                d = e // local
                rows[d, fill[d]], meta[d, fill[d]] = x[t], torch.tensor([t, s, e % local, 1])
                fill[d] += 1
    got_rows, got_meta = _exchange(rows.view(w * cap, h), meta.view(w * cap, 4), group)
    src = torch.arange(w).repeat_interleave(cap)
    valid = got_meta[:, 3] == 1
    order = sorted(torch.nonzero(valid).flatten().tolist(),
                   key=lambda i: (int(got_meta[i, 2]), int(src[i]), int(got_meta[i, 0]), int(got_meta[i, 1])))
    a = (global_bs or bs * w) * min(local, k)
    expand_x = torch.full((a, h), UNDEFINED, dtype=x.dtype)
    assist = torch.full((a * 128,), -1, dtype=torch.int32)  # the fake's own encoding: source rank, token, slot
    for j, i in enumerate(order):
        expand_x[j] = got_rows[i]
        assist[3 * j: 3 * j + 3] = torch.tensor([int(src[i]), int(got_meta[i, 0]), int(got_meta[i, 1])])
    counts = torch.bincount(got_meta[valid, 2], minlength=local).to(torch.int64)
    per_rank = torch.stack([torch.bincount(got_meta[(src == r) & valid, 2], minlength=local) for r in range(w)])
    CALLS.append(("npu_moe_distribute_dispatch_v2", dict(global_bs=global_bs, mask=x_active_mask is not None,
                                                          bs=bs)))
    return (expand_x, torch.full((a,), UNDEFINED), assist, counts if expert_token_nums_type else counts.cumsum(0),
            per_rank.flatten().to(torch.int32), torch.zeros(tp_world_size, dtype=torch.int32),
            torch.zeros(0, dtype=torch.float32))


def npu_moe_distribute_combine_v2(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales,
                                  group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None,
                                  x_active_mask=None, expand_scales=None, shared_expert_x=None, elastic_info=None,
                                  ori_x=None, const_expert_alpha_1=None, const_expert_alpha_2=None,
                                  const_expert_v=None, performance_info=None, group_tp="", tp_world_size=0,
                                  tp_rank_id=0, expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0,
                                  global_bs=0, comm_quant_mode=0, comm_alg="", zero_expert_num=0, copy_expert_num=0,
                                  const_expert_num=0):
    """Each expert output row back to its token's rank; ``out[t] = sum_k expert_scales[t, k] * row(t, k)``."""
    group = GROUPS[group_ep]
    w, (bs, k), h = ep_world_size, expert_ids.shape, expand_x.shape[1]
    assert expert_scales.dtype == torch.float32 and expert_scales.shape == (bs, k)
    assert ep_send_counts.dtype == torch.int32 and ep_send_counts.shape == (w * (moe_expert_num // w),)
    n = int(ep_send_counts.sum())  # rows received by the dispatch
    cap = bs * k
    rows = torch.zeros(w, cap, h, dtype=expand_x.dtype)
    meta = torch.full((w, cap, 3), -1, dtype=torch.int64)  # token, slot, valid
    fill = [0] * w
    for j in range(n):
        r, t, s = assist_info_for_combine[3 * j: 3 * j + 3].tolist()
        rows[r, fill[r]], meta[r, fill[r]] = expand_x[j], torch.tensor([t, s, 1])
        fill[r] += 1
    got_rows, got_meta = _exchange(rows.view(w * cap, h), meta.view(w * cap, 3), group)
    per_slot = torch.zeros(bs, k, h)
    for i in torch.nonzero(got_meta[:, 2] == 1).flatten().tolist():
        per_slot[got_meta[i, 0], got_meta[i, 1]] = got_rows[i].float()
    out = torch.zeros(bs, h)
    for s in range(k):
        out += expert_scales[:, s, None] * per_slot[:, s]
    CALLS.append(("npu_moe_distribute_combine_v2", dict(global_bs=global_bs)))
    return out.to(expand_x.dtype)


MC2_OPS = (npu_moe_distribute_dispatch_v2, npu_moe_distribute_combine_v2)


def test_fake_mc2_operators_take_the_wheels_argument_names():
    check_against_schema(MC2_OPS)


# --- MC2 against the dense reference on 2 ranks ----------------------------------------------------------

def _moe(cfg: MoEConfig) -> MoE:
    torch.manual_seed(1234)
    return MoE(cfg).requires_grad_(False).to(torch.bfloat16)


def _mc2_body(ctx, tokens: List[int], max_tokens: int, a2_hierarchy: bool = False):
    if not a2_hierarchy:
        return _mc2_run(ctx, tokens, max_tokens)
    # an A2 whose HCCL environment selects the "hierarchy" algorithm: no x_active_mask there (restored after: under
    # torchrun this process runs the other tests too)
    with mock.patch.dict(os.environ, HCCL_INTRA_PCIE_ENABLE="1", HCCL_INTRA_ROCE_ENABLE="0"), \
            mock.patch.object(mc2, "chip_of", lambda soc: "a2"):
        return _mc2_run(ctx, tokens, max_tokens)


def _mc2_run(ctx, tokens: List[int], max_tokens: int):
    GROUPS["ep"] = ctx.group
    CALLS.clear()  # a rank's process may have run other tests (torchrun mode)
    cfg = MoEConfig(hidden=64, ffn=16, n_experts=4 * ctx.world_size, top_k=2, n_shared=1)
    moe = _moe(cfg)
    torch.manual_seed(10 + ctx.rank)
    x = torch.randn(tokens[ctx.rank], cfg.hidden).to(torch.bfloat16)
    idx, weights = moe.router(x)
    layer = mc2_expert_parallel(moe, ctx.group, exchange="mc2", max_tokens_per_rank=max_tokens)
    with installed(fake_npu(*MC2_OPS)), mock.patch.object(mc2, "_group_name", lambda group: "ep"):
        h = ep_dispatch(x, idx, weights, cfg.n_experts, ctx.group, exchange="mc2", max_tokens_per_rank=max_tokens,
                        async_finish=True)
        h.wait()
        batch = h.expand()
        y = layer.experts(batch.x, batch.group_list)  # the grouped matmul on the device group list
        routed = ep_combine(y, batch, h).wait()
        whole = layer(x)
        seen = list(CALLS)
    return dict(routed=routed, dense_routed=combine_dense(x, idx, weights, moe.experts), whole=whole, dense=moe(x),
                seen=seen, counts=batch.counts)


@pytest.mark.cpu_only
@pytest.mark.parametrize("tokens,max_tokens", [([6, 6], 6), ([5, 3], 8), ([0, 4], 4)],
                         ids=["even", "uneven_padded", "rank_without_tokens"])
def test_mc2_equals_dense_on_two_ranks(tokens, max_tokens):
    results = run_ranks(_mc2_body, 2, tokens, max_tokens, timeout=120)
    for rank, r in enumerate(results):
        assert r["routed"].shape == (tokens[rank], 64) and r["routed"].dtype == torch.bfloat16
        torch.testing.assert_close(r["routed"], r["dense_routed"], **BF16, msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(r["whole"], r["dense"], **BF16, msg=lambda m: f"rank {rank} layer: {m}")
        ops = [op for op, _ in r["seen"]]
        assert ops.count("npu_moe_distribute_dispatch_v2") == 2 and ops.count("npu_moe_distribute_combine_v2") == 2
        gmm = calls_of(r["seen"], "npu_grouped_matmul")
        assert [c["group_list_type"] for c in gmm] == [1] * 4 and {c["groups"] for c in gmm} == {4}
        for c in calls_of(r["seen"], "npu_moe_distribute_dispatch_v2"):  # every rank sends the same batch size
            assert c == dict(global_bs=2 * max_tokens, mask=tokens[rank] < max_tokens, bs=max_tokens)
    # every (token, expert) pair arrived once: the group lists add up to the pairs routed to each rank
    assert sum(sum(r["counts"]) for r in results) == 2 * sum(tokens)


@pytest.mark.cpu_only
def test_on_a2_with_the_hierarchy_algorithm_padding_travels_as_tokens_without_a_mask():
    """A2's "hierarchy" algorithm takes no ``x_active_mask``: a padded rank sends its padding as tokens (ids distinct
    in a row, as the operators require), and the real rows still equal the dense reference."""
    results = run_ranks(_mc2_body, 2, [5, 3], 8, True, timeout=120)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["routed"], r["dense_routed"], **BF16, msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(r["whole"], r["dense"], **BF16, msg=lambda m: f"rank {rank} layer: {m}")
        dispatches = calls_of(r["seen"], "npu_moe_distribute_dispatch_v2")
        assert dispatches == [dict(global_bs=16, mask=False, bs=8)] * 2, (rank, dispatches)


def calls_of(seen, name):
    return [kw for op, kw in seen if op == name]


# --- one interface: the same code on every exchange (the MC2 example of docs/expert-parallel.md) ----------

def _portable_moe(x, topk_idx, topk_weights, num_experts, group, local_experts, exchange, max_tokens):
    """The MC2 example's code, written once against `collectives.handles`; what each object lacks of its protocol
    (`tests/support/protocols.py`: every member, with a signature that takes the protocol's calls)."""
    h = ep_dispatch(x, topk_idx, topk_weights, num_experts, group, exchange=exchange, max_tokens_per_rank=max_tokens,
                    async_finish=True)
    h.wait()
    batch = h.expand()
    y = local_experts(batch.x, batch.group_list)
    result = ep_combine(y, batch, h)
    met = [protocol_problems(h, EPDispatchHandle), protocol_problems(batch, EPBatch),
           protocol_problems(result, EPCombineHandle)]
    return result.wait(), met, type(h).__name__


def _portable_body(ctx):
    GROUPS["ep"] = ctx.group
    cfg = MoEConfig(hidden=64, ffn=16, n_experts=4 * ctx.world_size, top_k=2, n_shared=0)
    moe = _moe(cfg)
    experts = mc2_expert_parallel(moe, ctx.group).experts
    torch.manual_seed(20 + ctx.rank)
    x = torch.randn(5 + ctx.rank, cfg.hidden).to(torch.bfloat16)
    idx, weights = moe.router(x)
    out = {"all_to_all": _portable_moe(x, idx, weights, cfg.n_experts, ctx.group, experts, "all_to_all", 8)}
    with installed(fake_npu(*MC2_OPS)), mock.patch.object(mc2, "_group_name", lambda group: "ep"):
        out["mc2"] = _portable_moe(x, idx, weights, cfg.n_experts, ctx.group, experts, "mc2", 8)
    return out, combine_dense(x, idx, weights, moe.experts)


@pytest.mark.cpu_only
def test_the_same_code_runs_on_every_exchange():
    for rank, (out, dense) in enumerate(run_ranks(_portable_body, 2, timeout=120)):
        assert {b: o[2] for b, o in out.items()} == {"all_to_all": "DispatchHandle", "mc2": "MC2DispatchHandle"}
        for exchange, (got, met, _) in out.items():
            assert met == [[], [], []], (exchange, met)
            torch.testing.assert_close(got, dense, **BF16, msg=lambda m: f"rank {rank} {exchange}: {m}")


# --- errors before any collective ------------------------------------------------------------------------

def _refused_body(ctx, how: str):
    GROUPS["ep"] = ctx.group
    CALLS.clear()  # a rank's process may have run other tests (torchrun mode)
    comm = comm_span_names()
    x = torch.randn(4, 64).to(torch.bfloat16)
    experts = 4 if how == "experts" and ctx.rank == 1 else 8  # "experts": the ranks pass different num_experts
    idx, w = torch.randint(0, experts, (4, 2)), torch.rand(4, 2)
    env = {"HCCL_BUFFSIZE": "1" if (how == "small_buffer" or (how == "small_on_one_rank" and ctx.rank == 1))
           else "200"}
    try:
        if how == "cpu":  # no torch_npu: refused on the cpu path
            mc2_dispatch(x, idx, w, 8, ctx.group, max_tokens_per_rank=4)
        else:
            with installed(fake_npu(*MC2_OPS)), mock.patch.object(mc2, "_group_name", lambda g: "ep"), \
                    mock.patch.dict("os.environ", env), mock.patch.object(mc2, "mc2_buffer_mb", lambda *a, **k: 2):
                mc2_dispatch(x, idx, w, experts, ctx.group, max_tokens_per_rank=4)
        return "no error", comm, list(CALLS)
    except (MC2Error, LayoutError) as err:
        return f"{type(err).__name__}: {err}", comm, list(CALLS)


@pytest.mark.cpu_only
def test_mc2_on_cpu_is_refused_before_any_collective():
    for message, comm, seen in run_ranks(_refused_body, 2, "cpu", timeout=60):
        assert message.startswith("MC2Error") and "MC2 needs torch_npu on the npu path" in message, message
        assert comm == [] and seen == []
    with pytest.raises(MC2Error, match="MC2 needs torch_npu on the npu path"):
        choose_exchange("mc2")
    assert choose_exchange("auto", 4) == "all_to_all"  # auto never picks MC2 where it cannot run


@pytest.mark.cpu_only
@pytest.mark.parametrize("how", ["small_buffer", "small_on_one_rank"])
def test_an_undersized_buffer_stops_every_rank_before_the_fused_operator(how):
    (m0, comm0, seen0), (m1, comm1, seen1) = run_ranks(_refused_body, 2, how, timeout=60)
    needs = "MC2Error: MC2 needs an HCCL buffer of at least 2 MB"
    assert m1.startswith(needs) and "HCCL_BUFFSIZE=2" in m1 and "HCCL_BUFFSIZE=1" in m1, m1
    if how == "small_buffer":
        assert m0.startswith(needs), m0
    else:  # rank 0's buffer is fine: it stops because rank 1 rejected its input, and says why
        assert m0.startswith("LayoutError: rank 1: " + needs) and "HCCL_BUFFSIZE=1" in m0, m0
    for comm, seen in ((comm0, seen0), (comm1, seen1)):
        assert comm == ["mc2.agree"] and seen == [], (comm, seen)  # the agreement only: no fused operator


@pytest.mark.cpu_only
def test_ranks_that_pass_different_expert_counts_stop_before_the_fused_operator():
    for message, comm, seen in run_ranks(_refused_body, 2, "experts", timeout=60):
        assert message.startswith("LayoutError: ranks disagree on the number of experts (num_experts): rank 0: 8; "
                                  "rank 1: 4; every rank of the expert-parallel group must pass the same "
                                  "num_experts"), message
        assert comm == ["mc2.agree"] and seen == [], (comm, seen)


# --- the buffer formula and the selection rule ---------------------------------------------------------------

def test_buffer_formula():
    # DeepSeek-V3 decode on A3: 256 experts on 16 ranks (16 per rank), top-8, hidden 7168, 128 tokens per rank
    a3 = 2 * (16 * 128 * 16 * 14848 + (8 + 1) * 128 * 14336)  # Align512(Align32(2 * 7168) + 64) = 14848
    assert mc2_buffer_bytes(128, 7168, 8, 256, 16, chip="a3") == a3
    assert mc2_buffer_mb(128, 7168, 8, 256, 16, chip="a3") == -(-a3 // (1 << 20)) == 960
    # A2 fullmesh: 2 * (Bs * W * min(L, K) * H * 2 + 2 MB); hierarchy: E * Bs * (H * 2 + 4 * 8 * 4) + 104 MB
    assert mc2_buffer_bytes(128, 7168, 8, 256, 16, chip="a2", comm_alg="fullmesh") == \
        2 * (128 * 16 * 8 * 7168 * 2 + 2 * (1 << 20))
    assert mc2_buffer_bytes(128, 7168, 8, 256, 16, chip="a2", comm_alg="hierarchy") == \
        256 * 128 * (7168 * 2 + 4 * 8 * 4) + 104 * (1 << 20)
    assert mc2_buffer_bytes(2, 64, 2, 8, 2) == max(mc2_buffer_bytes(2, 64, 2, 8, 2, chip=c) for c in ("a2", "a3"))


def test_buffer_check_names_the_value_and_the_variable(monkeypatch):
    monkeypatch.delenv("HCCL_BUFFSIZE", raising=False)
    with pytest.raises(MC2Error, match=r"at least 960 MB .*HCCL_BUFFSIZE is unset \(HCCL's default 200 MB\).*"
                                       r"set HCCL_BUFFSIZE=960"):
        check_mc2_buffer(128, 7168, 8, 256, 16, chip="a3")
    monkeypatch.setenv("HCCL_BUFFSIZE", "959")
    with pytest.raises(MC2Error, match="HCCL_BUFFSIZE=959"):
        check_mc2_buffer(128, 7168, 8, 256, 16, chip="a3")
    monkeypatch.setenv("HCCL_BUFFSIZE", "960")
    assert check_mc2_buffer(128, 7168, 8, 256, 16, chip="a3") == 960
    monkeypatch.setenv("HCCL_BUFFSIZE", "lots")
    with pytest.raises(MC2Error, match="not a whole number"):
        check_mc2_buffer(4, 64, 2, 8, 2)


def test_selection_rule():
    with installed(fake_npu(*MC2_OPS)):
        assert MC2_MAX_TOKENS == 256
        assert choose_exchange("auto", 256) == "mc2"  # at the threshold: MC2
        assert choose_exchange("auto", 257) == "all_to_all"
        assert choose_exchange("auto", 64, mc2_threshold=32) == "all_to_all"
        assert choose_exchange("auto", None) == "all_to_all"  # no bound shared by the ranks: no MC2
        assert choose_exchange("auto", 4, world_size=1) == "all_to_all"
        assert choose_exchange("all_to_all", 4) == "all_to_all" and choose_exchange("mc2", 4096) == "mc2"
    with installed(fake_npu()):  # a torch_npu without the fused operators
        assert choose_exchange("auto", 4) == "all_to_all"
    with pytest.raises(ValueError, match="exchange must be one of"):
        choose_exchange("deepep")


def _auto_body(ctx, max_tokens: int):
    GROUPS["ep"] = ctx.group
    cfg = MoEConfig(hidden=64, ffn=16, n_experts=8, top_k=2, n_shared=0)
    moe = _moe(cfg)
    x = torch.randn(4, 64).to(torch.bfloat16)
    with installed(fake_npu(*MC2_OPS)), mock.patch.object(mc2, "_group_name", lambda g: "ep"):
        layer = mc2_expert_parallel(moe, ctx.group, max_tokens_per_rank=max_tokens, mc2_threshold=8)
        got = layer(x)
        return layer.exchange.exchange_for(layer), got, moe(x), [op for op, _ in CALLS]


@pytest.mark.cpu_only
@pytest.mark.parametrize("max_tokens,exchange", [(8, "mc2"), (9, "all_to_all")])
def test_auto_takes_mc2_for_small_batches_only(max_tokens, exchange):
    for chosen, got, dense, ops in run_ranks(_auto_body, 2, max_tokens, timeout=60):
        assert chosen == exchange
        assert ("npu_moe_distribute_dispatch_v2" in ops) == (exchange == "mc2"), ops
        torch.testing.assert_close(got, dense, **BF16)


def test_mc2_refuses_what_the_operators_refuse():
    x, idx, w = torch.randn(5, 64).to(torch.bfloat16), torch.randint(0, 8, (5, 2)), torch.rand(5, 2)
    with installed(fake_npu(*MC2_OPS)), mock.patch.object(mc2, "group_size", lambda g: 2):
        with pytest.raises(LayoutError, match="more than max_tokens_per_rank=4"):
            mc2_dispatch(x, idx, w, 8, max_tokens_per_rank=4, validate=False)
        with pytest.raises(MC2Error, match="float16 / bfloat16"):
            mc2_dispatch(x.float(), idx, w, 8, max_tokens_per_rank=8, validate=False)
        with pytest.raises(MC2Error, match=r"max_tokens_per_rank must be in \[1, 256\]"):
            mc2_dispatch(x, idx, w, 8, max_tokens_per_rank=300, validate=False, chip="a2")
        with pytest.raises(MC2Error, match="at most 24 experts per rank"):
            mc2_dispatch(x, idx, w, 64, max_tokens_per_rank=8, validate=False, chip="a2")
    assert not calls("npu_moe_distribute_dispatch_v2")


# --- decode: MC2 as a decode step's static exchange ------------------------------------------------------

def _decode_body(ctx, exchange: str, threshold: int):
    import microbatch
    from collectives import MOE_ACTIVE, MOE_CAPACITY, MOE_IN, MOE_OUT
    from overlap import HostSyncs, no_host_sync

    GROUPS["ep"] = ctx.group
    cfg = MoEConfig(hidden=64, ffn=16, n_experts=4 * ctx.world_size, top_k=2, n_shared=1)
    moe = _moe(cfg)
    torch.manual_seed(30 + ctx.rank)
    x = torch.randn(5 + ctx.rank, cfg.hidden).to(torch.bfloat16)  # 5 and 6 tokens: one capacity (8) for both
    layer = mc2_expert_parallel(moe, ctx.group, exchange=exchange, mc2_threshold=threshold)
    out = {}
    with installed(fake_npu(*MC2_OPS)), mock.patch.object(mc2, "_group_name", lambda group: "ep"):
        for chunks in (1, 2):
            ops = layer.decode_stages(chunks)

            def step(active=None):
                (y,) = microbatch.run(microbatch.schedule_for("shared", [ops], 1), [ops],
                                      [{MOE_IN: x, MOE_CAPACITY: 8, MOE_ACTIVE: active}], output=MOE_OUT)
                return y

            step()  # the layer's first call checks the ranks' shapes once
            CALLS.clear()
            with HostSyncs() as syncs, no_host_sync():
                y = step()
            # the fake operators read their inputs on the host; the toolkit's code around them must not
            ours = [str(s) for s in syncs.found if "/tests/" not in s.where]
            out[chunks] = (y, ours, list(CALLS))
            out["padded", chunks] = step(torch.arange(x.shape[0]) < 3)  # rows 3.. are padding
    sh = layer.shared
    return out, moe(x), sh.down(sh.activation(sh.gate_up(x)), x)


@pytest.mark.cpu_only
@pytest.mark.parametrize("exchange,threshold,uses_mc2", [("mc2", 256, True), ("auto", 256, True), ("auto", 2, False)],
                         ids=["mc2", "auto", "auto_over_threshold"])
def test_decode_stages_take_mc2_with_the_steps_capacity_and_no_host_sync(exchange, threshold, uses_mc2):
    """On 2 ranks: an MC2 layer's decode step, whole or in 2 chunks, sends through MC2 with the step's capacity as
    the batch bound (every rank the same ``global_bs``; a chunk half of it), equals the dense layer, and reads
    nothing on the host; where the capacity is over ``mc2_threshold``, ``auto`` takes the capacity exchange. Either
    exchange leaves padding rows out (``x_active_mask``, or expert id -1)."""
    for rank, (out, dense, shared) in enumerate(run_ranks(_decode_body, 2, exchange, threshold, timeout=120)):
        for chunks in (1, 2):  # padding rows (``MOE_ACTIVE`` False) reach no expert: the shared experts' output alone
            y = out.pop(("padded", chunks))
            torch.testing.assert_close(y[:3], dense[:3], **BF16, msg=lambda m: f"rank {rank}, padded {chunks}: {m}")
            torch.testing.assert_close(y[3:], shared[3:], **BF16, msg=lambda m: f"rank {rank}, padding {chunks}: {m}")
        for chunks, (y, ours, seen) in out.items():
            torch.testing.assert_close(y, dense, **BF16, msg=lambda m: f"rank {rank}, {chunks} chunk(s): {m}")
            assert ours == [], (rank, chunks, ours)
            dispatches = calls_of(seen, "npu_moe_distribute_dispatch_v2")
            if uses_mc2:
                bound = 8 // chunks
                assert dispatches == [dict(global_bs=2 * bound, mask=True, bs=bound)] * chunks, (rank, dispatches)
                assert len(calls_of(seen, "npu_moe_distribute_combine_v2")) == chunks
            else:
                assert dispatches == [] and calls_of(seen, "npu_moe_distribute_combine_v2") == []


def _generate_body(ctx):
    import dataclasses

    from launch.engine import generate
    from launch.models import build_model, preset
    from launch.engine import make_expert_parallel

    GROUPS["ep"] = ctx.group
    cfg = dataclasses.replace(preset("tiny"), n_experts=4)
    prompts = [[1 + ctx.rank, 2, 3], [4, 5, 6 + ctx.rank], [7, 8, 9]][:2 + ctx.rank]  # 2 and 3 requests
    out = {}
    for exchange in ("capacity", "mc2"):
        model = build_model(cfg, seed=3, dtype=torch.bfloat16)
        make_expert_parallel(model, ctx.group, decode_exchange=exchange)
        with installed(fake_npu(*MC2_OPS)), mock.patch.object(mc2, "_group_name", lambda group: "ep"):
            out[exchange] = {m: generate(model, prompts, 5, mode=m).tokens for m in ("serial", "two-batch",
                                                                                   "chunked-2")}
            out[exchange + " calls"] = [op for op, _ in CALLS]
        with installed(fake_npu(*MC2_OPS)), mock.patch.object(mc2, "_group_name", lambda group: "ep"):
            generate(model, prompts, 1)  # a prefill, no decode step
            out[exchange + " prefill calls"] = [op for op, _ in CALLS]
    return out


@pytest.mark.cpu_only
def test_generation_with_mc2_decode_steps_gives_the_capacity_exchanges_tokens():
    """On 2 ranks, the reference decoder in bf16 with ``make_expert_parallel(decode_exchange="mc2")``: its decode
    steps go through MC2 (prefill keeps the all-to-all), and every mode generates the tokens the capacity exchange
    does."""
    for rank, out in enumerate(run_ranks(_generate_body, 2, timeout=180)):
        want = out["capacity"]["serial"]
        assert all(tokens == want for tokens in out["capacity"].values()), (rank, out["capacity"])
        assert out["mc2"] == out["capacity"], (rank, out["mc2"], want)
        assert "npu_moe_distribute_dispatch_v2" not in out["capacity calls"]
        assert out["mc2 calls"].count("npu_moe_distribute_dispatch_v2") > 0
        assert out["mc2 prefill calls"] == out["capacity prefill calls"] and \
            "npu_moe_distribute_dispatch_v2" not in out["mc2 prefill calls"]
