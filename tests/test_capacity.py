"""The static-shape layer (`capacity_expert_parallel`: the capacity exchange) on 1, 2 and 4 gloo ranks equals the
dense reference MoE, eager."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

import overlap
from collectives import (CapacityBatch, EPBatch, EPCombineHandle, EPDispatchHandle, ExpertParallelMoE, LayoutError,
                         MoE, MoEConfig, capacity_dispatch, capacity_expert_parallel)
from overlap.multirank import run_ranks
from support.protocols import protocol_problems

TOL = dict(rtol=1e-5, atol=1e-6)


def _moe(cfg: MoEConfig) -> MoE:
    torch.manual_seed(1234)  # the same weights on every rank
    return MoE(cfg).requires_grad_(False)


def _cases(world: int):
    """(name, cfg, tokens on each rank, capacity)."""
    cases = []
    for k in (1, 2, 3, 8):
        cfg = MoEConfig(hidden=16, ffn=8, n_experts=8, top_k=k, n_shared=k % 2,
                        score_func="sigmoid" if k == 3 else "softmax")
        cases.append((f"top{k}", cfg, [6] * world, None))
    base = MoEConfig(hidden=16, ffn=8, n_experts=4 * world, top_k=2)
    cases.append(("uneven_tokens", base, [3 + 2 * r for r in range(world)], 3 + 2 * (world - 1)))
    cases.append(("spare_capacity", base, [5] * world, 9))
    cases.append(("zero_tokens", base, [0] + [4] * (world - 1), 4))
    return cases


def _equal_body(ctx):
    out = []
    for name, cfg, tokens, capacity in _cases(ctx.world_size):
        moe = _moe(cfg)
        layer = capacity_expert_parallel(moe, ctx.group, capacity=capacity)
        torch.manual_seed(100 + ctx.rank)
        x = torch.randn(tokens[ctx.rank], cfg.hidden)
        got = layer(x)
        again = layer(x)
        with overlap.enabled(False):
            serial = layer(x)
        out.append((name, got, moe(x), again, serial))
    return out


@pytest.mark.cpu_only
@pytest.mark.parametrize("world", [1, 2, 4])
def test_capacity_layer_equals_dense(world):
    for rank, results in enumerate(run_ranks(_equal_body, world, timeout=120)):
        assert len(results) == len(_cases(world))
        for name, got, dense, again, serial in results:
            assert got.shape == dense.shape
            torch.testing.assert_close(got, dense, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")
            assert torch.equal(got, again), f"rank {rank} {name}: not deterministic"
            assert torch.equal(got, serial), f"rank {rank} {name}: overlapped differs from serial"


def _bad_capacity_body(ctx, case):
    cfg = MoEConfig(hidden=8, ffn=4, n_experts=2 * ctx.world_size, top_k=1, n_shared=0)
    torch.manual_seed(ctx.rank)
    if case == "mismatch":  # default capacity = own token count, which differs between the ranks
        layer, x = capacity_expert_parallel(_moe(cfg), ctx.group), torch.randn(4 + ctx.rank, 8)
    else:  # every token of every rank picks an expert on rank 0: 5 rows for a capacity of 3
        layer, x = capacity_expert_parallel(_moe(cfg), ctx.group, capacity=3), torch.randn(5, 8)
        layer.router.weight[:] = 0
        layer.router.weight[0, 0] = 1e4
        x[:, 0] = 1.0
    try:
        layer(x)
    except LayoutError as exc:
        return str(exc)
    return None


@pytest.mark.cpu_only
@pytest.mark.parametrize("case,message", [
    ("mismatch", "ranks disagree on the capacity: rank 0: 4; rank 1: 5; static split sizes need one capacity on "
                 "every rank: pass the same explicit capacity everywhere"),
    ("overflow", "ranks 0, 1: sends 5 tokens to one expert-parallel rank, more than the capacity 3; raise the "
                 "capacity"),
])
def test_bad_capacity_fails_on_every_rank_before_the_exchange(case, message):
    errors = run_ranks(_bad_capacity_body, 2, case, timeout=60)
    assert all(e is not None and message in e for e in errors), errors


def test_handle_and_batch_offer_the_interface_of_every_family():
    """`collectives.handles`: the portable code (wait, expand, experts on the group list, combine) equals dense."""
    cfg = MoEConfig(hidden=16, ffn=8, n_experts=4, top_k=2, n_shared=0)
    moe = _moe(cfg)
    experts = capacity_expert_parallel(moe).experts
    torch.manual_seed(5)
    x = torch.randn(6, cfg.hidden)
    idx, weights = moe.router(x)
    h = capacity_dispatch(x, idx, weights, cfg.n_experts, capacity=9)  # 3 padding rows
    assert isinstance(h, EPDispatchHandle) and protocol_problems(h, EPDispatchHandle) == []
    assert h.wait() is h
    batch = h.expand()
    assert isinstance(batch, CapacityBatch) and protocol_problems(batch, EPBatch) == []
    assert batch.x.shape == (9 * 2, cfg.hidden) and batch.group_list.dtype == torch.int64
    assert batch.group_list.tolist() == batch.counts and sum(batch.counts) == 6 * 2  # padding pairs last
    result = h.combine(experts(batch.x, batch.group_list), batch)
    assert isinstance(result, EPCombineHandle) and protocol_problems(result, EPCombineHandle) == []
    torch.testing.assert_close(result.wait(), moe(x), **TOL)


def test_overflow_cannot_be_checked_while_compiling_so_it_is_refused():
    x, idx, w = torch.randn(5, 8), torch.zeros(5, 1, dtype=torch.long), torch.ones(5, 1)
    with mock.patch("torch.compiler.is_compiling", return_value=True):
        with pytest.raises(LayoutError, match="under torch.compile"):
            capacity_dispatch(x, idx, w, 2, capacity=4)
        assert capacity_dispatch(x, idx, w, 2).recv_x.shape == (5, 8)  # default: the token count


def test_padding_rows_carry_no_expert_and_no_weight():
    x = torch.randn(3, 4)
    idx, w = torch.tensor([[1], [0], [1]]), torch.tensor([[0.5], [0.25], [0.75]])
    h = capacity_dispatch(x, idx, w, 2, capacity=5)
    assert h.recv_x.shape == (5, 4) and h.slot_token is None  # the capacity holds every token: rows in order
    assert h.recv_ids[:, 0].tolist() == [1, 0, 1, -1, -1]
    assert h.recv_weights[:, 0].tolist() == [0.5, 0.25, 0.75, 0.0, 0.0]
    assert torch.equal(h.recv_x[:3], x) and not h.recv_x[3:].any()


def test_stages_contract_is_that_of_expert_parallel_moe():
    cfg = MoEConfig(hidden=16, ffn=8, n_experts=4, top_k=2)
    moe = _moe(cfg)
    for overlap_shared in (True, False):
        cap = capacity_expert_parallel(moe, overlap_shared=overlap_shared)
        ref = ExpertParallelMoE.from_config(cfg, overlap_shared=overlap_shared)
        ref.two_step_dispatch = False  # no count exchange to issue apart: one dispatch stage
        assert [(s.name, s.stream, s.reads, s.writes) for s in cap.stages()] == \
               [(s.name, s.stream, s.reads, s.writes) for s in ref.stages()]
    x = torch.randn(7, 16)
    torch.testing.assert_close(cap(x), moe(x), **TOL)  # forward: the stages through the executor


def _one_rank_routes_out_of_range(ctx):
    from collectives import LayoutError
    from collectives.capacity import capacity_dispatch

    x = torch.randn(6, 8)
    idx = torch.randint(0, 4, (6, 2))
    if ctx.rank == 1:
        idx[0, 0] = 99  # an expert that does not exist
    try:
        capacity_dispatch(x, idx, torch.rand(6, 2), 4, ctx.group)
    except LayoutError as exc:
        return str(exc)
    return "no error"


def test_bad_input_on_one_rank_stops_every_rank_before_the_exchange():
    r0, r1 = run_ranks(_one_rank_routes_out_of_range, 2, timeout=60)
    assert r0.startswith("rank 1: LayoutError: expert id 99 in topk_idx is out of range"), r0
    assert r1.startswith("expert id 99 in topk_idx is out of range"), r1


def test_capacity_blocks_are_the_layouts_rows_padded():
    """The capacity send buffers hold exactly `compute_layout`'s rows and `pack_metadata`'s rows, in the
    same order, each block padded with zero rows that carry no expert and no weight."""
    from collectives.capacity import _pack_blocks, _slots
    from collectives.layout import compute_layout, pack_metadata, token_in_rank

    g = torch.Generator().manual_seed(3)
    world, experts, tokens, k = 4, 8, 10, 3
    x = torch.randn(tokens, 4, generator=g)
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=g)
    layout = compute_layout(idx, experts, world)
    slot_token = _slots(token_in_rank(idx, experts // world, world), tokens)
    send_x, send_meta = _pack_blocks(x, idx, w, slot_token, experts // world)
    real = slot_token.reshape(-1) < tokens
    assert (slot_token < tokens).sum(1).tolist() == layout.send_splits
    assert torch.equal(slot_token.reshape(-1)[real], layout.send_token)
    assert torch.equal(send_meta[real], pack_metadata(layout, idx, w))
    assert torch.equal(send_x[real], x[layout.send_token])
    assert (send_meta[~real, :k] == -1).all() and not send_meta[~real, k:].any() and not send_x[~real].any()


def test_whole_blocks_hold_the_placed_rows_at_their_tokens_and_nothing_for_the_others():
    """Where the capacity holds every token, block r of the send buffers is the tokens in order: the rows
    `_pack_blocks` places for rank r sit at their tokens' rows, with the same metadata; the tokens not sent to
    rank r carry no expert and no weight there, and the padding is zero rows."""
    from collectives.capacity import _pack_blocks, _slots, _whole_blocks
    from collectives.layout import token_in_rank

    g = torch.Generator().manual_seed(4)
    world, experts, tokens, k, cap = 4, 8, 10, 3, 12
    x = torch.randn(tokens, 4, generator=g)
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=g)
    slot_token = _slots(token_in_rank(idx, experts // world, world), cap)
    placed_x, placed_meta = _pack_blocks(x, idx, w, slot_token, experts // world)
    whole_x, whole_meta = _whole_blocks(x, idx, w, world, cap, experts // world)
    assert whole_x.shape == placed_x.shape and whole_meta.shape == placed_meta.shape
    sent = torch.zeros(world, cap, dtype=torch.bool)
    for r in range(world):
        for j, t in enumerate(slot_token[r].tolist()):
            if t < tokens:
                sent[r, t] = True
                assert torch.equal(whole_x[r * cap + t], placed_x[r * cap + j])
                assert torch.equal(whole_meta[r * cap + t], placed_meta[r * cap + j])
    rest = ~sent.reshape(-1)
    assert (whole_meta[rest, :k] == -1).all() and not whole_meta[rest, k:].any()
    assert torch.equal(whole_x.view(world, cap, 4)[:, :tokens], x.expand(world, tokens, 4))
    assert not whole_x.view(world, cap, 4)[:, tokens:].any()


# --- device-side grouping: expert work proportional to the routed rows -----------------------------------

class _Fixed(torch.nn.Module):
    """Slot j of token t picks expert (first(t) + j) % E, weights from the token (a router without weights:
    the same routing on every rank and in the dense reference)."""

    def __init__(self, cfg: MoEConfig, first):
        super().__init__()
        self.cfg, self.first = cfg, first

    def forward(self, x):
        t = torch.arange(x.shape[0])
        idx = (self.first(t)[:, None] + torch.arange(self.cfg.top_k)[None]) % self.cfg.n_experts
        return idx, x[:, : self.cfg.top_k].float().softmax(-1)


def _grouping_cases(world: int):
    """(name, cfg, routing, dtype): one and several local experts, empty experts, every row to one expert, bf16."""
    several = MoEConfig(hidden=16, ffn=8, n_experts=4 * world, top_k=2, n_shared=1)
    one = MoEConfig(hidden=16, ffn=8, n_experts=world, top_k=1, n_shared=0)
    one_k2 = MoEConfig(hidden=16, ffn=8, n_experts=2 * world, top_k=2, n_shared=0)
    to_one = MoEConfig(hidden=16, ffn=8, n_experts=4 * world, top_k=1, n_shared=0)
    return [("several", several, "router", torch.float32),
            ("one_local_expert", one, "router", torch.float32),
            ("two_local_experts_k2", one_k2, "router", torch.float32),
            ("empty_experts", several, "two_experts", torch.float32),  # only experts 0, 1 and 2 are ever chosen
            ("all_to_one_expert", to_one, "last_expert", torch.float32),
            ("bf16", several, "router", torch.bfloat16),
            ("bf16_one_local_expert", one, "router", torch.bfloat16)]


def _routed_moe(cfg: MoEConfig, routing: str, dtype) -> MoE:
    moe = _moe(cfg)
    if routing == "two_experts":
        moe.router = _Fixed(cfg, lambda t: t % 2)
    elif routing == "last_expert":
        moe.router = _Fixed(cfg, lambda t: torch.full_like(t, cfg.n_experts - 1))
    return moe.to(dtype)


def _grouping_body(ctx, npu: bool):
    from collectives.capacity import expert_path
    from support.fake_npu import calls, fake_npu, installed

    out = []
    for name, cfg, routing, dtype in _grouping_cases(ctx.world_size):
        moe = _routed_moe(cfg, routing, dtype)
        torch.manual_seed(200 + ctx.rank)
        x = torch.randn(5 + ctx.rank, cfg.hidden).to(dtype)
        grouped = capacity_expert_parallel(moe, ctx.group, capacity=6)
        every = capacity_expert_parallel(moe, ctx.group, capacity=6, expert_path="all")
        offs = []
        real = torch._grouped_mm

        def spy(a, b, offs_=None, **kw):
            offs.append(int(kw["offs"][-1]))
            return real(a, b, **kw)

        with installed(fake_npu() if npu else None), mock.patch.object(torch, "_grouped_mm", spy):
            path = expert_path("auto", x, grouped.experts)
            got, again = grouped(x), grouped(x)
            with overlap.enabled(False):
                serial = grouped(x)
            seen = {op: calls(op) for op in ("npu_moe_init_routing_v2", "npu_grouped_matmul",
                                             "npu_moe_finalize_routing")}
        idx, _ = moe.router(x)
        out.append(dict(name=name, dtype=dtype, path=path, got=got, again=again, serial=serial, dense=moe(x),
                        every=every(x), offs=offs, seen=seen, idx=idx, local=grouped.experts.num_local))
    return out


def _routed_pairs(results, rank: int, case: int) -> int:
    """(token, slot) pairs of every rank's tokens whose expert lives on ``rank``."""
    local = results[rank][case]["local"]
    return sum(int((r[case]["idx"] // local == rank).sum()) for r in results)


@pytest.mark.cpu_only
@pytest.mark.parametrize("npu", [False, True], ids=["torch", "fake_npu"])
@pytest.mark.parametrize("world", [1, 2])
def test_grouped_experts_equal_the_previous_path_and_dense(world, npu):
    results = run_ranks(_grouping_body, world, npu, timeout=120)
    for rank, per_case in enumerate(results):
        for case, r in enumerate(per_case):
            what = f"rank {rank} {r['name']}"
            tol = TOL if r["dtype"] == torch.float32 else dict(rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(r["got"], r["dense"], **tol, msg=lambda m: f"{what}: {m}")
            torch.testing.assert_close(r["got"], r["every"], **tol, msg=lambda m: f"{what} vs 'all': {m}")
            assert torch.equal(r["got"], r["again"]) and torch.equal(r["got"], r["serial"]), what
            pairs = _routed_pairs(results, rank, case)
            if r["local"] == 1:  # one local expert: a plain matmul, no grouped operator
                assert r["path"] == "all" and r["offs"] == [] and not any(r["seen"].values()), what
            elif not npu:
                # three forwards, two grouped matmuls each, over the routed pairs only
                assert r["path"] == "torch_grouped" and r["offs"] == [pairs] * 6, (what, r["offs"], pairs)
            else:
                assert r["path"] == "npu_grouped" and r["offs"] == [], what
                assert [c["expert_num"] for c in r["seen"]["npu_moe_init_routing_v2"]] == [r["local"] + 1] * 3
                gmm = [(c["group_list_type"], c["groups"], c["rows"]) for c in r["seen"]["npu_grouped_matmul"]]
                assert gmm == [(1, r["local"], pairs)] * 6, (what, gmm, pairs)
                assert [c["drop_pad_mode"] for c in r["seen"]["npu_moe_finalize_routing"]] == [2] * 3


@pytest.mark.parametrize("npu", [False, True], ids=["torch", "fake_npu"])
def test_a_nan_expert_spoils_only_the_rows_that_chose_it_on_the_grouped_path(npu):
    from support.fake_npu import fake_npu, installed

    cfg = MoEConfig(hidden=16, ffn=8, n_experts=4, top_k=2, n_shared=0)
    layer = capacity_expert_parallel(_moe(cfg), capacity=12)
    x = torch.randn(12, 16)
    with installed(fake_npu() if npu else None):
        clean = layer(x)
        layer.experts.gate_up.data[1] = float("nan")
        got = layer(x)
    chose = (layer.router(x)[0] == 1).any(1)
    assert chose.any() and (~chose).any()
    assert not torch.isfinite(got[chose]).all(1).any()
    assert torch.equal(got[~chose], clean[~chose])


def test_expert_path_setting():
    from collectives.capacity import expert_path

    cfg = MoEConfig(hidden=16, ffn=8, n_experts=4, top_k=2)
    layer = capacity_expert_parallel(_moe(cfg))
    x = torch.randn(3, 16)
    assert expert_path("all", x, layer.experts) == "all"
    with mock.patch("torch.compiler.is_compiling", return_value=True):  # float32 has no grouped kernel there
        assert expert_path("auto", x, layer.experts) == "all"
        with pytest.raises(LayoutError, match="expert_path='grouped'"):
            expert_path("grouped", x, layer.experts)
    with pytest.raises(ValueError, match="expert_path"):
        capacity_expert_parallel(_moe(cfg), expert_path="fast")


def _experts_disagree(ctx):
    """num_experts 8 on rank 0 and 4 on rank 1: caught in the validation all-reduce (one size on every rank)."""
    experts = 8 if ctx.rank == 0 else 4
    x, idx = torch.randn(6, 8), torch.randint(0, experts, (6, 2))
    try:
        capacity_dispatch(x, idx, torch.rand(6, 2), experts, ctx.group, capacity=6)
    except LayoutError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_pass_different_expert_counts_all_raise_naming_the_argument():
    for message in run_ranks(_experts_disagree, 2, timeout=60):
        assert "ranks disagree on the number of experts (num_experts): rank 0: 8; rank 1: 4; every rank of the " \
               "expert-parallel group must pass the same num_experts" in message, message


def test_combine_refuses_outputs_of_another_hidden_size():
    """Every rank sends back rows of the dispatched hidden size: another size is refused before the exchange."""
    from collectives import capacity_combine

    x, idx = torch.randn(5, 8), torch.randint(0, 4, (5, 2))
    h = capacity_dispatch(x, idx, torch.rand(5, 2), 4)
    batch = h.expand()
    wide = torch.cat([batch.x, batch.x], 1)
    with pytest.raises(LayoutError, match=r"grouped expert output must be \[10, 8\] .*got shape \(10, 16\)"):
        capacity_combine(wide, h, grouped=batch.grouped)
    with pytest.raises(LayoutError, match=r"expert output must be \[local experts, 5, 8\] .*got shape \(4, 5, 16\)"):
        capacity_combine(torch.randn(4, 5, 16), h)
    assert capacity_combine(batch.x, h, grouped=batch.grouped).wait().shape == (5, 8)


def _placed_body(ctx):
    cfg = MoEConfig(hidden=16, ffn=8, n_experts=8, top_k=1, n_shared=0)
    moe = _moe(cfg)
    moe.router = _Fixed(cfg, lambda t: t)  # token t to expert t % 8: four tokens to each rank
    layer = capacity_expert_parallel(moe, ctx.group, capacity=4)
    torch.manual_seed(300 + ctx.rank)
    x = torch.randn(8, cfg.hidden)
    from collectives.capacity import capacity_dispatch as dispatch_of

    idx, w = moe.router(x)
    placed = dispatch_of(x, idx, w, cfg.n_experts, ctx.group, capacity=4).slot_token is not None
    return placed, layer(x), moe(x)


def test_a_capacity_below_the_token_count_places_each_ranks_rows_and_equals_dense():
    """The placed layout (a slot per token and rank, `_slots`): what the capacity path runs where the capacity
    does not hold every token of the call (a decode step's always does)."""
    for placed, got, dense in run_ranks(_placed_body, 2, timeout=120):
        assert placed
        torch.testing.assert_close(got, dense, **TOL)
