"""The MoE layer's decode stages (`ExpertParallelMoE.decode_stages`): a static exchange, whole or in chunks."""
import pytest
import torch

import microbatch
from collectives import MOE_ACTIVE, MOE_CAPACITY, MOE_IN, MOE_OUT, ExpertParallelMoE, LayoutError, MoEConfig
from overlap import HostSyncs, no_host_sync

CFG = MoEConfig(hidden=32, ffn=16, n_experts=8, top_k=2, n_shared=1)


def _run(ops, x, capacity, mode="serial", active=None):
    (out,) = microbatch.run(microbatch.schedule_for(mode, [ops], 1), [ops],
                            [{MOE_IN: x, MOE_CAPACITY: capacity, MOE_ACTIVE: active}], output=MOE_OUT)
    return out


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_decode_stages_equal_the_layer_whole_or_in_chunks_without_a_host_sync(chunks):
    torch.manual_seed(0)
    layer = ExpertParallelMoE.from_config(CFG)
    x = torch.randn(7, CFG.hidden)
    want = layer(x)
    ops = layer.decode_stages(chunks)
    assert sum(op.name.startswith("dispatch") for op in ops) == chunks
    _run(ops, x, 8)  # the first call may check shapes once
    with HostSyncs() as syncs, no_host_sync():
        got = _run(ops, x, 8, mode="shared")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert syncs.found == []


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_padding_rows_take_no_expert_and_change_no_real_row(chunks):
    """``MOE_ACTIVE`` False (a captured step's padding, after the real rows): the row is routed to no expert, so its
    output is the shared experts' alone; the real rows equal the layer's on them alone."""
    torch.manual_seed(0)
    layer = ExpertParallelMoE.from_config(CFG)
    x = torch.randn(7, CFG.hidden)
    active = torch.arange(7) < 4
    ops = layer.decode_stages(chunks)
    with no_host_sync():
        got = _run(ops, x, 8, active=active)
    torch.testing.assert_close(got[:4], layer(x[:4]), rtol=1e-5, atol=1e-5)
    sh = layer.shared
    torch.testing.assert_close(got[4:], sh.down(sh.activation(sh.gate_up(x[4:])), x[4:]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("active, why", [
    (torch.ones(6, dtype=torch.bool), r"bool tensor \[7\] \(one flag per token\), got torch.bool \(6,\)"),
    (torch.ones(7), r"bool tensor \[7\] \(one flag per token\), got torch.float32 \(7,\)"),
])
def test_a_malformed_real_row_mask_is_refused_in_one_line(active, why):
    layer = ExpertParallelMoE.from_config(CFG)
    with pytest.raises(LayoutError, match=why) as err:
        _run(layer.decode_stages(), torch.randn(7, CFG.hidden), 8, active=active)
    assert "\n" not in str(err.value)


def test_a_capacity_below_the_tokens_is_refused_before_the_exchange():
    layer = ExpertParallelMoE.from_config(CFG)
    with pytest.raises(LayoutError, match="capacity must be an int of at least its 7 tokens"):
        _run(layer.decode_stages(), torch.randn(7, CFG.hidden), 4)
    with pytest.raises(ValueError, match="1 to 8 chunks"):
        layer.decode_stages(9)


def _chunked_body(ctx, chunks):
    import overlap
    from overlap.observability.timeline import Timeline, intersects

    cfg = MoEConfig(hidden=64, ffn=32, n_experts=4, top_k=2, n_shared=1)
    torch.manual_seed(ctx.rank)
    layer = ExpertParallelMoE.from_config(cfg, ctx.group)
    x = torch.randn(9 + ctx.rank, cfg.hidden)  # the ranks' token counts differ; one capacity for both
    want = layer(x)
    ops = layer.decode_stages(chunks)
    # a link slow enough that every exchange is still in flight while another chunk's experts run
    overlap.set_link(overlap.Link(gbps=1000.0, latency_us=40_000))
    try:
        runs = {}
        for on in (True, False):
            with overlap.enabled(on), Timeline() as tl:
                (out,) = microbatch.run(microbatch.chunked([ops], 1), [ops],
                                        [{MOE_IN: x, MOE_CAPACITY: 10, MOE_ACTIVE: None}], output=MOE_OUT)
            comm = [s for s in tl.spans if s.kind == "comm"]  # in issue order: d0, d1, c0, d2, c1, d3, ...
            experts = {s.name: s for s in tl.spans if s.name.startswith("experts_")}
            dispatches = [s for s in comm if s.name == "dispatch"]
            combines = [s for s in comm if s.name == "combine"]
            hidden = [intersects(dispatches[i + 1], experts[f"experts_{i}"]) for i in range(chunks - 1)]
            hidden += [intersects(combines[i], experts[f"experts_{i + 1}"]) for i in range(chunks - 1)]
            runs[on] = (out, hidden, len(dispatches), len(combines))
    finally:
        overlap.set_link(None)
    return want, runs


@pytest.mark.parametrize("chunks", [2, 4])
def test_each_chunks_exchange_runs_under_another_chunks_experts(chunks):
    """On two ranks: chunk i+1's dispatch is in flight while the experts compute chunk i, and chunk i's combine
    while they compute chunk i+1 (with overlap off, none is); one exchange per dispatch and per combine, per chunk;
    the output equals the layer's own (count-exchange) forward."""
    from overlap.multirank import run_ranks

    for rank, (want, runs) in enumerate(run_ranks(_chunked_body, 2, chunks, timeout=120)):
        for on, (out, hidden, n_dispatch, n_combine) in runs.items():
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
            assert (n_dispatch, n_combine) == (chunks, chunks)
            assert all(hidden) if on else not any(hidden), (rank, on, hidden)
