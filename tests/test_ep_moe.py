"""ExpertParallelMoE on 1, 2 and 4 gloo ranks equals the dense reference MoE of the same weights."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import overlap
import microbatch
from collectives import ExpertParallelMoE, LayoutError, MoE, MoEConfig, wrap_expert_parallel
from collectives.experts import LocalExperts, grouped_mlp, resolve_impl
from overlap.multirank import run_ranks

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


class _FixedRouter(nn.Module):
    """Slot j of token t picks expert (first(t) + j) % E, with softmax weights from the token."""

    def __init__(self, cfg: MoEConfig, first):
        super().__init__()
        self.cfg, self.first = cfg, first

    def forward(self, x):
        t = torch.arange(x.shape[0], device=x.device)
        idx = (self.first(t)[:, None] + torch.arange(self.cfg.top_k, device=x.device)[None]) % self.cfg.n_experts
        return idx, x[:, : self.cfg.top_k].float().softmax(-1)


def _moe(cfg: MoEConfig, routing: str, dtype) -> MoE:
    torch.manual_seed(1234)  # the same weights on every rank
    moe = MoE(cfg)
    if routing == "round_robin":
        moe.router = _FixedRouter(cfg, lambda t: t)
    elif routing == "one_expert":
        moe.router = _FixedRouter(cfg, lambda t: torch.full_like(t, cfg.n_experts - 1))
    return moe.to(dtype)


def _cases(world: int):
    """(name, cfg, routing, tokens on each rank)."""
    cases = []
    for k in range(1, 9):
        cases.append((f"top{k}", MoEConfig(hidden=16, ffn=8, n_experts=8, top_k=k, n_shared=k % 2,
                                            score_func="sigmoid" if k % 3 == 0 else "softmax",
                                            norm_topk=k != 2), "router", [5] * world))
    base = MoEConfig(hidden=16, ffn=8, n_experts=4 * world, top_k=2)
    cases.append(("round_robin", base, "round_robin", [12] * world))
    cases.append(("one_expert", base, "one_expert", [9] * world))
    cases.append(("zero_tokens", base, "router", [0] + [7] * (world - 1) if world > 1 else [0]))
    return cases


def _equal_body(ctx):
    out = []
    for name, cfg, routing, tokens in _cases(ctx.world_size):
        for dtype in (torch.float32, torch.bfloat16):
            moe = _moe(cfg, routing, dtype).to(ctx.device)
            ep = wrap_expert_parallel(moe, ctx.group)
            torch.manual_seed(ctx.rank)
            x = torch.randn(tokens[ctx.rank], cfg.hidden).to(ctx.device, dtype)
            dense = moe(x)
            got = ep(x)
            with overlap.enabled(False):
                serial = ep(x)
            ep.overlap_shared = False
            no_shared_overlap = ep(x)
            out.append((name, dtype) + tuple(t.cpu() for t in (got, dense, serial, no_shared_overlap)))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_expert_parallel_equals_dense(world):
    for rank, results in enumerate(run_ranks(_equal_body, world, timeout=120)):
        assert len(results) == 2 * len(_cases(world))
        for name, dtype, got, dense, serial, no_shared_overlap in results:
            assert got.shape == dense.shape and got.dtype == dense.dtype
            torch.testing.assert_close(got, dense, **TOL[dtype],
                                       msg=lambda m: f"rank {rank} {name} {dtype}: {m}")
            assert torch.equal(got, serial), f"rank {rank} {name} {dtype}: overlapped differs from serial"
            assert torch.equal(got, no_shared_overlap), f"rank {rank} {name} {dtype}: shared overlap changes output"


def _interleaved(stages, xs):
    """Micro-batches ``xs`` through the stages interleaved stage by stage, by the executor; their outputs."""
    schedule = microbatch.Schedule("interleaved", tuple(microbatch.ScheduledOp(mb, 0, s.name, s.stream)
                                                        for s in stages for mb in range(len(xs))))
    return microbatch.run(schedule, [stages], [{"moe_in": x} for x in xs], output="moe_out")


def _overlap_body(ctx):
    from overlap.observability.sanitizer import Sanitizer
    from overlap.observability.timeline import Timeline, intersects

    cfg = MoEConfig(hidden=256, ffn=32, n_experts=2 * ctx.world_size, top_k=2, n_shared=4)
    moe = _moe(cfg, "router", torch.float32)
    ep = wrap_expert_parallel(moe, ctx.group)
    torch.manual_seed(10 + ctx.rank)
    x = torch.randn(2048, cfg.hidden)  # enough bytes that the exchange is still in flight when the shared experts start
    dense = moe(x)
    with Sanitizer(raise_on_race=True) as san:
        checked = ep(x)
        # two interleaved micro-batches through the same (re-entrant) stage functions
        halves = x[:900], x[900:]
        mbs = torch.cat(_interleaved(ep.stages(), halves))
    races = list(san.races)
    def timeline_hit(flag):
        with overlap.enabled(flag), Timeline() as tl:
            ep(x)
        dispatch = [s for s in tl.spans if s.kind == "comm" and s.name in ("dispatch", "dispatch.meta")]
        shared = [s for s in tl.spans if s.name.startswith("shared_")]
        return any(intersects(a, b) for a in shared for b in dispatch), len(dispatch), shared

    # Plain gloo on one loaded host can finish a 2 MB exchange before the shared experts get a core
    # (CI saw it miss three times in a row). A simulated link keeps every exchange in flight for at
    # least 0.1 s after its issue, as an interconnect would; gloo still moves the bytes.
    overlap.set_link(overlap.Link(gbps=1000.0, latency_us=100_000))
    try:
        serial_hit = timeline_hit(False)[0]  # control: serial code never overlaps, even on a slow link
        hit, n_dispatch, shared = timeline_hit(True)
    finally:
        overlap.set_link(None)
    return dict(dense=dense, checked=checked, mbs=mbs, races=[str(r) for r in races], hit=hit, serial_hit=serial_hit,
                n_dispatch=n_dispatch, n_shared=len(shared), shared_streams={s.stream for s in shared})


def test_overlap_is_race_free_reentrant_and_real():
    for rank, r in enumerate(run_ranks(_overlap_body, 2, timeout=120)):
        torch.testing.assert_close(r["checked"], r["dense"], **TOL[torch.float32])
        torch.testing.assert_close(r["mbs"], r["dense"], **TOL[torch.float32])
        assert r["races"] == [], r["races"]
        assert r["n_dispatch"] == 2 and r["n_shared"] == 3 and r["shared_streams"] == {overlap.SHARED_EXPERT}
        assert r["hit"], f"rank {rank}: no shared-expert span intersects the dispatch span"
        assert not r["serial_hit"], "with overlap off the dispatch must end before the shared experts start"


def _run_without_waits(stages, values):
    for st in stages:
        with overlap.stream(st.stream):
            out = st.fn(*[values[r] for r in st.reads])
            out = out if len(st.writes) > 1 else (out,)
            values.update(zip(st.writes, out))
    return values


def _missing_wait_body(ctx):
    from overlap.observability.sanitizer import Sanitizer

    cfg = MoEConfig(hidden=16, ffn=8, n_experts=2 * ctx.world_size, top_k=2)
    ep = wrap_expert_parallel(_moe(cfg, "router", torch.float32), ctx.group)
    x = torch.randn(32, cfg.hidden)
    with Sanitizer(raise_on_race=False, log_races=False) as san:
        _run_without_waits(ep.stages(), {"moe_in": x})
        overlap.synchronize()
    return len(san.races)


def test_sanitizer_sees_a_missing_wait_in_the_stages():
    """Control for the race-free check above: the same stages without the cross-stream waits race."""
    assert all(n > 0 for n in run_ranks(_missing_wait_body, 2))


def test_stages_contract():
    cfg = MoEConfig(hidden=16, ffn=8, n_experts=4, top_k=2)
    ep = wrap_expert_parallel(MoE(cfg))
    st = ep.stages()
    assert [s.name for s in st] == ["gate", "dispatch_counts", "dispatch", "shared_gate_up", "experts", "shared_act",
                                    "combine", "shared_down", "finalize"]
    assert st[0].reads == ("moe_in",) and st[-1].writes == ("moe_out",)
    streams = {s.name: s.stream for s in st}
    assert streams["dispatch_counts"] == streams["dispatch"] == overlap.EP_COMM
    assert {s.name: s.reads for s in st}["dispatch"] == ("moe_counts",)
    ep.two_step_dispatch = False  # the switch: one dispatch stage that reads the routed tokens
    one = {s.name: s for s in ep.stages()}
    assert "dispatch_counts" not in one and one["dispatch"].reads == ("moe_in", "moe_topk_idx", "moe_topk_weights")
    ep.two_step_dispatch = True
    assert {s.name: s.stream for s in st}["shared_act"] == overlap.SHARED_EXPERT
    written = {"moe_in"}
    for s in st:
        assert set(s.reads) <= written, f"{s.name} reads a value not yet written"
        written |= set(s.writes)
    ep.overlap_shared = False
    assert all(s.stream != overlap.SHARED_EXPERT for s in ep.stages())
    cfg.n_shared = 0
    assert "shared_act" not in [s.name for s in wrap_expert_parallel(MoE(cfg)).stages()]


def test_from_config_and_group_mismatch():
    cfg = MoEConfig(hidden=16, ffn=8, n_experts=4, top_k=2, score_func="sigmoid")
    layer = ExpertParallelMoE.from_config(cfg)
    x = torch.randn(6, 16)
    assert layer(x).shape == x.shape
    with pytest.raises(LayoutError, match="4 experts over 1 ranks"):
        ExpertParallelMoE(layer.router, LocalExperts(layer.experts.gate_up[:2], layer.experts.down[:2]), 4)


def test_layer_with_grouped_matmul_equals_dense():
    cfg = MoEConfig(hidden=16, ffn=8, n_experts=4, top_k=2)
    torch.manual_seed(0)
    moe = MoE(cfg)
    ep = wrap_expert_parallel(moe, impl="grouped")
    x = torch.randn(10, 16)
    assert resolve_impl(ep.experts.impl, x, ep.experts.gate_up, ep.experts.down) == "torch_grouped"
    torch.testing.assert_close(ep(x), moe(x), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_equals_loop(dtype):
    torch.manual_seed(0)
    gate_up, down = torch.randn(3, 32, 16).to(dtype), torch.randn(3, 16, 16).to(dtype)
    x, counts = torch.randn(11, 16).to(dtype), [4, 0, 7]
    loop = grouped_mlp(x, counts, gate_up, down, impl="loop")
    assert resolve_impl("grouped", x, gate_up, down) == "torch_grouped"
    grouped = grouped_mlp(x, counts, gate_up, down, impl="grouped")
    torch.testing.assert_close(grouped, loop, **TOL[dtype])
    one = torch.nn.functional.linear(torch.nn.functional.silu(x[4:] @ gate_up[2, :16].T) * (x[4:] @ gate_up[2, 16:].T),
                                     down[2])
    torch.testing.assert_close(loop[4:], one, **TOL[dtype])
    assert resolve_impl("auto", x, gate_up, down) == "loop"  # CPU default: the loop
    with pytest.raises(ValueError, match="do not split"):
        grouped_mlp(x, [1, 2, 3], gate_up, down)


def _float64_tokens_body(ctx, kind: str):
    """float64 tokens into a float32 layer on every rank: refused in the gate, before any collective."""
    from collectives import capacity_expert_parallel
    from support.spans import comm_span_names

    cfg = MoEConfig(hidden=16, ffn=8, n_experts=4, top_k=2, n_shared=1)
    layer = wrap_expert_parallel(MoE(cfg), ctx.group) if kind == "eager" else \
        capacity_expert_parallel(MoE(cfg), ctx.group)
    comm = comm_span_names()
    try:
        layer(torch.randn(5, 16, dtype=torch.float64))
        message = "no error"
    except Exception as err:  # the old code failed in an expert's matmul, after the exchange
        message = f"{type(err).__name__}: {err}"
    return message, list(comm)


@pytest.mark.parametrize("kind", ["eager", "capacity"])
def test_tokens_of_another_dtype_than_the_layer_are_refused_before_any_collective(kind):
    for message, comm in run_ranks(_float64_tokens_body, 2, kind, timeout=60):
        assert message == ("LayoutError: the tokens are torch.float64 but this layer's experts are torch.float32: "
                           "cast the tokens (x.to(torch.float32)) or the layer (layer.to(torch.float64)) "
                           "first"), message
        assert comm == [], comm


def _other_batch_not_held_back_body(ctx):
    """Two-batch over the EP layer's stages, one layer. Rank 1 starts micro-batch 0's attention only once rank 0
    has started micro-batch 1's (a key in the store, waited for at most 30 s): were rank 0's host to read its
    micro-batch 0 counts before issuing micro-batch 1's attention, it would wait for rank 1, and rank 1 for it.
    Rank 1 goes on anyway after the bound, so nothing hangs, and says whether the key came. The serial run
    first gives the reference output and gets the layer's one-time agreement (an all-reduce) out of the way."""
    import datetime

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    key = "test_ep_moe/mb1-attention-started"
    cfg = MoEConfig(hidden=16, ffn=8, n_experts=4, top_k=2, n_shared=1)
    ep = wrap_expert_parallel(_moe(cfg, "router", torch.float32), ctx.group)
    came, armed = [], []

    def attention(h, mb):
        if armed and ctx.rank == 0 and mb == 1:
            store.set(key, "1")
        if armed and ctx.rank == 1 and mb == 0 and not came:
            try:
                store.wait([key], datetime.timedelta(seconds=30))
                came.append(True)
            except Exception:  # the bound: rank 0 is still waiting for micro-batch 0's counts
                came.append(False)
        return torch.tanh(h)

    layer = [microbatch.Operation("attn", attention, ("hidden", "mb"), ("moe_in",))] + ep.stages() + [
        microbatch.Operation("residual", lambda a, b: a + b, ("moe_in", "moe_out"), ("out",))]
    torch.manual_seed(ctx.rank)
    inputs = [{"hidden": torch.randn(6 + mb, cfg.hidden), "mb": mb} for mb in range(2)]
    want = microbatch.run(microbatch.serial([layer], 2), [layer], inputs)  # also the layer's one-time agreement
    armed.append(True)
    got = microbatch.run(microbatch.two_batch([layer], 2), [layer], inputs)
    return bool(came and came[0]), all(torch.equal(g, w) for g, w in zip(got, want))


def test_two_batch_issues_the_other_microbatch_before_reading_the_counts():
    (_, equal0), (came, equal1) = run_ranks(_other_batch_not_held_back_body, 2, timeout=180)
    assert came, "rank 0 read micro-batch 0's counts before it issued micro-batch 1's attention"
    assert equal0 and equal1
