"""Prefill of the reference model in every mode equals serial, on 1, 2 and 4 CPU ranks, race-free,
with one micro-batch's exchange running under the other's compute."""
import pytest
import torch

import overlap
from launch.model import Batch, build_model, preset
from microbatch import MODES
from launch.runner import layer_operations, make_expert_parallel, plan_for, prefill
from overlap.multirank import run_ranks
from overlap.observability.timeline import intersects

CFG = preset("tiny")
BATCHES = {
    "many short requests": lambda r: [5 + r, 3, 9, 4, 7, 6 + 2 * r, 8, 5],
    "one long request": lambda r: [70 + 9 * r],
    "mixed sizes per rank": lambda r: [[40, 3], [9, 9, 9, 9], [61], [12, 30, 2]][r % 4],
    "one-token batch": lambda r: [1] if r == 0 else [20, 20],
}


def _modes_equal_serial(ctx, case):
    lens = BATCHES[case](ctx.rank)
    batch = Batch.random(lens, CFG.vocab, seed=100 + ctx.rank, device=ctx.device)
    model = make_expert_parallel(build_model(CFG, seed=5, device=ctx.device), ctx.group)
    out, plans, races = {}, {}, {}
    for mode in MODES:
        plan = plan_for(mode, batch, ctx.group, min_tokens=8)
        with overlap.Sanitizer(raise_on_race=False) as san:
            out[mode] = prefill(model, batch, mode, plan)
            overlap.synchronize()
        plans[mode], races[mode] = plan, [str(r) for r in san.races]
    return {m: (out[m] - out["serial"]).abs().max().item() for m in MODES}, plans["two-batch"], races


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("case", list(BATCHES))
def test_every_mode_equals_serial(world, case):
    per_rank = run_ranks(_modes_equal_serial, world, case, timeout=240)
    decisions = {plan.serial for _, plan, _ in per_rank}
    assert len(decisions) == 1, "ranks took different split decisions"
    if case == "one-token batch":
        assert decisions == {True}  # rank 0 cannot split, so nobody does
        assert "rank 0" in per_rank[-1][1].reason or world == 1
    elif case == "one long request":
        assert decisions == {False} and all(plan.cut is not None for _, plan, _ in per_rank)
    for diffs, _, races in per_rank:
        # the same arithmetic per token; a 1-row matmul may use another CPU kernel than a many-row one
        assert diffs["shared"] == 0.0
        assert diffs["two-batch"] <= 1e-5, diffs
        assert not any(races.values()), races


def _microbatches_overlap(ctx):
    # A link latency makes every exchange last long enough to be seen on a loaded machine;
    # what is checked is only which spans run at the same time, never how long they take.
    overlap.set_link(overlap.Link(gbps=10.0, latency_us=30_000))
    batch = Batch.random([20, 12, 17, 15], CFG.vocab, seed=ctx.rank)
    model = make_expert_parallel(build_model(CFG, seed=5), ctx.group)
    plan = plan_for("two-batch", batch, ctx.group, min_tokens=8)
    with overlap.Timeline() as tl:
        prefill(model, batch, "two-batch", plan)
    comm = [s for s in tl.find(kind="comm") if s.meta.get("mb") in (0, 1) and s.meta.get("layer") is not None]
    compute = tl.find(kind="compute")
    hidden = {}
    for c in comm:
        other = 1 - c.meta["mb"]
        hidden.setdefault((c.meta["mb"], c.meta["layer"]), False)
        if any(s.meta.get("mb") == other and intersects(c, s) for s in compute):
            hidden[c.meta["mb"], c.meta["layer"]] = True
    return hidden


@pytest.mark.cpu_only  # the simulated link and host-clock spans are the CPU path's
def test_each_microbatch_exchange_runs_under_the_other_microbatch_compute():
    moe_layers = set(i for i in range(CFG.n_layers) if CFG.is_moe_layer(i))
    for _ in range(3):  # a host descheduled for longer than the link latency can miss one; look again
        found = [{mb: {layer for (m, layer), ok in hidden.items() if m == mb and ok} for mb in (0, 1)}
                 for hidden in run_ranks(_microbatches_overlap, 2, timeout=240)]
        if all(f[mb] == moe_layers for f in found for mb in (0, 1)):
            return
    pytest.fail(f"exchanges hidden under the other micro-batch's compute, per rank and micro-batch: {found}")


def test_kv_offload_operation_follows_attention():
    model = build_model(CFG, seed=5)

    class _Cache:
        def offload(self, layer, k, v):
            pass

    for ops in layer_operations(model, _Cache()):
        names = [op.name for op in ops]
        assert names[names.index("attn") + 1] == "kv_offload"


class _Recorder:
    """Keeps every layer's keys and values as the run produces them: the run without offload."""

    def __init__(self):
        self.kv = {}

    def offload(self, layer, k, v):
        self.kv.setdefault(layer, []).append((k.clone(), v.clone()))

    def finish(self):
        pass

    def host_kv(self, layer):
        return tuple(torch.cat([kv[i] for kv in self.kv[layer]]) for i in (0, 1))


def _offloaded_equals_plain(ctx):
    from overlap import OffloadCache

    batch = Batch.random([30, 7, 19][: 2 + ctx.rank], CFG.vocab, seed=40 + ctx.rank)
    model = make_expert_parallel(build_model(CFG, seed=5), ctx.group)
    ok = {}
    for mode in MODES:
        plan = plan_for(mode, batch, ctx.group, min_tokens=8)
        plain = _Recorder()
        ref = prefill(model, batch, mode, plan, plain)
        cache = OffloadCache(CFG.n_layers, batch.seq.num_tokens, (CFG.n_heads, CFG.head_dim))
        out = prefill(model, batch, mode, plan, cache)
        same = all(torch.equal(a, b) for layer in range(CFG.n_layers)
                   for a, b in zip(cache.host_kv(layer), plain.host_kv(layer)))
        ok[mode] = (torch.equal(out, ref), same, plan.cut is not None)
        cache.close()
    return ok


@pytest.mark.cpu_only
@pytest.mark.parametrize("world", [1, 2])
def test_offloaded_cache_equals_the_keys_and_values_of_a_plain_run(world):
    per_rank = run_ranks(_offloaded_equals_plain, world, timeout=240)
    assert any(ok["two-batch"][2] for ok in per_rank), "no request was cut across micro-batches"
    for ok in per_rank:
        for mode, (same_out, same_kv, _) in ok.items():
            assert same_kv, f"{mode}: offloaded K/V differ from the run without offload"
            assert same_out, f"{mode}: offload changed the output"


def _continue_from_offloaded_prefix(ctx):
    from launch.model import Batch as B
    from launch.runner import continue_prefill, serial_plan
    from microbatch.split import SeqInfo
    from overlap import OffloadCache

    full = Batch.random([30, 20], CFG.vocab, seed=7 + ctx.rank)
    model = make_expert_parallel(build_model(CFG, seed=5), ctx.group)
    ref = prefill(model, full, "serial", serial_plan(full))
    t = full.tokens
    first = B(torch.cat([t[0:18], t[30:42]]), SeqInfo((18, 12)))
    second = B(torch.cat([t[18:30], t[42:50]]), SeqInfo((12, 8), (18, 12)))
    with overlap.Sanitizer(raise_on_race=True):
        cache = OffloadCache(CFG.n_layers, 50, (CFG.n_heads, CFG.head_dim), ring=2)
        prefill(model, first, "serial", serial_plan(first), cache)
        out = continue_prefill(model, second, cache)
        held = cache.tokens(0)
        cache.close()
    want = torch.cat([ref[18:30], ref[42:50]])
    return (out - want).abs().max().item(), held


@pytest.mark.cpu_only
@pytest.mark.parametrize("world", [1, 2])
def test_continuing_a_prefill_from_an_offloaded_prefix_equals_one_prefill(world):
    for diff, held in run_ranks(_continue_from_offloaded_prefix, world, timeout=240):
        assert diff <= 1e-5
        assert held == 50  # the continuation's keys and values were appended


def test_continuing_needs_the_prefix_the_cache_holds():
    from launch.runner import continue_prefill
    from microbatch.split import SeqInfo
    from overlap import OffloadCache

    model = build_model(CFG, seed=5)
    cache = OffloadCache(CFG.n_layers, 16, (CFG.n_heads, CFG.head_dim))
    batch = Batch(torch.zeros(4, dtype=torch.long), SeqInfo((4,), (6,)))
    with pytest.raises(ValueError, match="continues 6 prefix tokens, but the cache holds"):
        continue_prefill(model, batch, cache)
