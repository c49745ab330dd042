"""Prefill of the reference model in every mode equals serial, on 1, 2 and 4 CPU ranks, race-free,
with each micro-batch's exchange running under another micro-batch's compute."""
import contextlib

import pytest
import torch

import microbatch
import overlap
from launch.models import build_model, preset
from launch.engine import layer_operations, make_expert_parallel, split_for, prefill
from microbatch import MODES
from microbatch.batch import Batch
from microbatch.forward import run_schedule
from overlap.multirank import run_ranks
from overlap.observability.timeline import intersects

CFG = preset("tiny")
ALL = [name for name, m in MODES.items() if m.in_all]  # what the launcher's --mode all runs
N_BATCH = [name for name, m in MODES.items() if m.micro_batches > 2]
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
    out, splits, races = {}, {}, {}
    for mode in ALL:
        split = split_for(mode, batch, ctx.group, min_tokens=8)
        with overlap.Sanitizer(raise_on_race=False) as san:
            out[mode] = prefill(model, batch, mode, split)
            overlap.synchronize()
        splits[mode], races[mode] = split, [str(r) for r in san.races]
    return {m: (out[m] - out["serial"]).abs().max().item() for m in ALL}, splits["two-batch"], races


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("case", list(BATCHES))
def test_every_mode_equals_serial(world, case):
    per_rank = run_ranks(_modes_equal_serial, world, case, timeout=240)
    decisions = {split.serial for _, split, _ in per_rank}
    assert len(decisions) == 1, "ranks took different split decisions"
    if case == "one-token batch":
        assert decisions == {True}  # rank 0 cannot split, so nobody does
        assert "rank 0" in per_rank[-1][1].reason or world == 1
    elif case == "one long request":
        assert decisions == {False} and all(split.cut is not None for _, split, _ in per_rank)
    for diffs, _, races in per_rank:
        # the same arithmetic per token; a 1-row matmul may use another CPU kernel than a many-row one
        assert diffs["shared"] == 0.0
        assert diffs["two-batch"] <= 1e-5, diffs
        assert not any(races.values()), races


def _hidden_exchanges(ctx, mode):
    """Per (micro-batch, layer) of ``mode``'s prefill: whether an exchange of it ran under another's compute."""
    batch = Batch.random([20, 12, 17, 15], CFG.vocab, seed=ctx.rank)
    model = make_expert_parallel(build_model(CFG, seed=5), ctx.group)
    split = split_for(mode, batch, ctx.group, min_tokens=8)
    assert split.n_parts == MODES[mode].micro_batches, split.reason
    with overlap.Timeline() as tl:
        prefill(model, batch, mode, split)
    comm = [s for s in tl.find(kind="comm") if s.meta.get("mb") is not None and s.meta.get("layer") is not None]
    compute = tl.find(kind="compute")
    hidden = {}
    for c in comm:
        mb = c.meta["mb"]
        hidden.setdefault((mb, c.meta["layer"]), False)
        if any(s.meta.get("mb") not in (None, mb) and intersects(c, s) for s in compute):
            hidden[mb, c.meta["layer"]] = True
    return hidden


def _microbatches_overlap(ctx, modes=("two-batch",)):
    # A link latency makes every exchange last long enough to be seen on a loaded machine;
    # what is checked is only which spans run at the same time, never how long they take.
    overlap.set_link(overlap.Link(gbps=10.0, latency_us=30_000))
    return {mode: _hidden_exchanges(ctx, mode) for mode in modes}


def _all_hidden(per_rank, n):
    moe_layers = set(i for i in range(CFG.n_layers) if CFG.is_moe_layer(i))
    found = [{mb: {layer for (m, layer), ok in hidden.items() if m == mb and ok} for mb in range(n)}
             for hidden in per_rank]
    return all(f[mb] == moe_layers for f in found for mb in range(n)), found


@pytest.mark.cpu_only  # the simulated link and host-clock spans are the CPU path's
def test_each_microbatch_exchange_runs_under_the_other_microbatch_compute():
    for _ in range(3):  # a host descheduled for longer than the link latency can miss one; look again
        ok, found = _all_hidden([r["two-batch"] for r in run_ranks(_microbatches_overlap, 2, timeout=240)], 2)
        if ok:
            return
    pytest.fail(f"exchanges hidden under the other micro-batch's compute, per rank and micro-batch: {found}")


@pytest.mark.cpu_only
def test_each_of_n_microbatches_exchanges_runs_under_another_microbatch_compute():
    for _ in range(3):
        per_rank = run_ranks(_microbatches_overlap, 2, tuple(N_BATCH), timeout=240)
        checks = {mode: _all_hidden([r[mode] for r in per_rank], MODES[mode].micro_batches) for mode in N_BATCH}
        if all(ok for ok, _ in checks.values()):
            return
    pytest.fail(f"exchanges hidden under another micro-batch's compute, per mode, rank and micro-batch: {checks}")


N_BATCHES = {  # per rank; three-batch cuts the long request of "cut once" once, of "cut twice" twice
    "many short requests": lambda r: [5 + r, 3, 9, 4, 7, 6 + 2 * r, 8, 5],
    "long request cut once": lambda r: [24, 30, 16],
    "long request cut twice": lambda r: [70 + 9 * r],
    "too small for N on rank 0": lambda r: [6, 5] if r == 0 else [20, 21, 19, 22],
}
SANITIZED = {("many short requests", "three-batch"), ("long request cut twice", "four-batch")}


def _n_batch_modes(ctx):
    """Per (case, mode): the split, the difference from serial, equality with the serial schedule of the
    same micro-batches and with the layer-by-layer forward, and the races found."""
    model = make_expert_parallel(build_model(CFG, seed=5, device=ctx.device), ctx.group)
    out = {}
    for case, lens in N_BATCHES.items():
        batch = Batch.random(lens(ctx.rank), CFG.vocab, seed=100 + ctx.rank, device=ctx.device)
        ref = prefill(model, batch, "serial", split_for("serial", batch, ctx.group))
        for mode in N_BATCH:
            split = split_for(mode, batch, ctx.group, min_tokens=8)
            san = overlap.Sanitizer(raise_on_race=False) if (case, mode) in SANITIZED else None
            with san or contextlib.nullcontext():
                got = prefill(model, batch, mode, split)
                overlap.synchronize()
            with torch.no_grad():
                same_parts = run_schedule(model, batch, split, layer_operations(model), microbatch.serial)
            by_layer = model.forward_microbatches(batch, split)
            out[case, mode] = dict(parts=split.n_parts, cuts=split.cuts, reason=split.reason,
                                   diff=(got - ref).abs().max().item(), bitwise=torch.equal(got, same_parts),
                                   by_layer=(by_layer - ref).abs().max().item(),
                                   races=[str(r) for r in san.races] if san else [])
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_n_batch_modes_equal_serial(world):
    per_rank = run_ranks(_n_batch_modes, world, timeout=240)
    for (case, mode) in per_rank[0]:
        runs = [r[case, mode] for r in per_rank]
        n = MODES[mode].micro_batches
        assert len({r["parts"] for r in runs}) == 1, (case, mode, "ranks took different numbers of micro-batches")
        for rank, r in enumerate(runs):
            where = (world, rank, case, mode, r["reason"])
            # the same arithmetic per micro-batch as the serial schedule; vs the whole batch as two-batch
            assert r["bitwise"] and r["diff"] <= 1e-5 and r["by_layer"] <= 1e-5, (where, r)
            assert not r["races"], (where, r["races"])
            if case == "many short requests":
                assert r["parts"] == n, where
            elif case == "long request cut once" and mode == "three-batch":
                assert r["parts"] == 3 and r["cuts"] == ((1, 23),), where
            elif case == "long request cut twice":
                assert r["parts"] == n and [c[0] for c in r["cuts"]] == [0] * (n - 1), where
            elif case == "too small for N on rank 0":
                assert r["parts"] == 2, where
                assert (f"not {n} micro-batches" if rank == 0 else f"as rank 0 of {world} cannot") in r["reason"]


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
        split = split_for(mode, batch, ctx.group, min_tokens=8)
        plain = _Recorder()
        ref = prefill(model, batch, mode, split, plain)
        cache = OffloadCache(CFG.n_layers, batch.seq.num_tokens, (CFG.n_heads, CFG.head_dim))
        out = prefill(model, batch, mode, split, cache)
        same = all(torch.equal(a, b) for layer in range(CFG.n_layers)
                   for a, b in zip(cache.host_kv(layer), plain.host_kv(layer)))
        ok[mode] = (torch.equal(out, ref), same, split.cut is not None)
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
    from launch.engine import continue_prefill
    from microbatch.batch import Batch as B, SeqInfo
    from microbatch.forward import serial_split
    from overlap import OffloadCache

    full = Batch.random([30, 20], CFG.vocab, seed=7 + ctx.rank)
    model = make_expert_parallel(build_model(CFG, seed=5), ctx.group)
    ref = prefill(model, full, "serial", serial_split(full))
    t = full.tokens
    first = B(torch.cat([t[0:18], t[30:42]]), SeqInfo((18, 12)))
    second = B(torch.cat([t[18:30], t[42:50]]), SeqInfo((12, 8), (18, 12)))
    with overlap.Sanitizer(raise_on_race=True):
        cache = OffloadCache(CFG.n_layers, 50, (CFG.n_heads, CFG.head_dim), ring=2)
        prefill(model, first, "serial", serial_split(first), cache)
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
    from launch.engine import continue_prefill
    from microbatch.batch import SeqInfo
    from overlap import OffloadCache

    model = build_model(CFG, seed=5)
    cache = OffloadCache(CFG.n_layers, 16, (CFG.n_heads, CFG.head_dim))
    batch = Batch(torch.zeros(4, dtype=torch.long), SeqInfo((4,), (6,)))
    with pytest.raises(ValueError, match="continues 6 prefix tokens, but the cache holds"):
        continue_prefill(model, batch, cache)
