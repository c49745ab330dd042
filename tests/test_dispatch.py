"""Dispatch / combine: exchange correctness on 1, 2 and 4 gloo ranks, deduplication, async, validation."""
from __future__ import annotations

import pytest
import torch

import overlap
from collectives import (EPBatch, EPCombineHandle, EPDispatchHandle, LayoutError, combine, compute_layout, dispatch,
                         dispatch_counts)
from collectives.dispatch import DispatchHandle
from overlap.multirank import run_ranks
from support.protocols import protocol_problems

H = 16


def _routing(rank: int, tokens: int, experts: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(tokens, H, generator=g)
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]) if tokens else \
        torch.empty(0, k, dtype=torch.long)
    w = torch.rand(tokens, k, generator=g)
    return x, idx, w


def _scale_experts(handle: DispatchHandle, rank: int, epr: int):
    """Expert e multiplies its tokens by (e + 1): easy to compute densely."""
    batch = handle.expand()
    scale = torch.cat([torch.full((n,), float(rank * epr + e + 1), device=batch.x.device)
                       for e, n in enumerate(batch.counts)])
    return batch.x * scale[:, None], batch


def _dense(x, idx, w):
    out = torch.zeros_like(x)
    for s in range(idx.shape[1]):
        out += x * (idx[:, s, None] + 1).float() * w[:, s, None]
    return out


def _cases(world: int):
    # (tokens on this rank as a function of rank, experts, k)
    return [(lambda r: 24, 4 * world, 2),
            (lambda r: 0 if r == world - 1 else 9, 2 * world, 3),  # the last rank has no tokens
            (lambda r: 7, 8, 1),
            (lambda r: 11, 8, 8)]


def _exchange_body(ctx):
    results = []
    for case, (tokens_of, experts, k) in enumerate(_cases(ctx.world_size)):
        if experts % ctx.world_size:
            continue
        epr = experts // ctx.world_size
        x, idx, w = (t.to(ctx.device) for t in _routing(ctx.rank, tokens_of(ctx.rank), experts, k, case))
        outs = {}
        for mode in ("sync", "async", "off"):
            with overlap.enabled(mode != "off"):
                prev = None
                if mode == "async":  # ordered after an explicit event, as DeepEP's previous_event
                    prev = overlap.event("test.before_dispatch")
                    prev.record(x)
                h = dispatch(x, idx, w, experts, ctx.group, async_finish=(mode == "async"), previous_event=prev)
                if mode == "async":
                    assert h.event is not None, "an asynchronous dispatch hands back an event to wait on"
                    h.wait()
                y, batch = _scale_experts(h, ctx.rank, epr)
                ch = combine(y, batch, h, async_finish=(mode == "async"))
                outs[mode] = ch.wait().cpu()
        # deduplication: one row per (token, destination rank), however many experts it chose there
        pairs = len({(t, int(e) // epr) for t in range(idx.shape[0]) for e in idx[t]})
        results.append(dict(case=case, outs=outs, dense=_dense(x, idx, w).cpu(), sent=h.layout.num_send, pairs=pairs,
                            received=h.recv_x.shape[0], recv_splits=h.recv_splits,
                            send_splits=h.layout.send_splits))
    return results


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dispatch_combine_matches_dense(world):
    per_rank = run_ranks(_exchange_body, world)
    for rank, results in enumerate(per_rank):
        for r in results:
            for mode, out in r["outs"].items():
                torch.testing.assert_close(out, r["dense"], msg=lambda m: f"rank {rank} case {r['case']} {mode}: {m}")
            assert torch.equal(r["outs"]["sync"], r["outs"]["async"]), "async differs from sync"
            assert torch.equal(r["outs"]["sync"], r["outs"]["off"]), "overlap off differs"
            assert r["sent"] == r["pairs"]
    # what rank a sends to rank b is what b receives from a
    for case in range(len(per_rank[0])):
        for a in range(world):
            for b in range(world):
                assert per_rank[a][case]["send_splits"][b] == per_rank[b][case]["recv_splits"][a]


def _interleaved_body(ctx):
    """Two dispatch / combine pairs in flight at once, finished in reverse order, three times over:
    the reused send buffers (collectives._buffers) must never be handed out while in use."""
    epr = 8 // ctx.world_size
    ok = []
    for round_ in range(3):
        calls = [_routing(ctx.rank, 48 - 8 * i, 8, 2, 10 * round_ + i) for i in range(2)]  # 2nd fits 1st
        handles = [dispatch(x, idx, w, 8, ctx.group, async_finish=True) for x, idx, w in calls]
        combined = []
        for h in handles:
            h.wait()
            y, batch = _scale_experts(h, ctx.rank, epr)
            combined.append(combine(y, batch, h, async_finish=True))
        outs = [c.wait() for c in reversed(combined)][::-1]
        ok += [torch.allclose(o, _dense(*call), rtol=1e-5, atol=1e-5) for o, call in zip(outs, calls)]
    return ok


def test_interleaved_exchanges_reuse_buffers_safely():
    from collectives import _buffers, release_buffers

    assert all(all(r) for r in run_ranks(_interleaved_body, 2))
    a = _buffers.take(4, 8, torch.float32)
    _buffers.give(a)
    b = _buffers.take(2, 8, torch.bfloat16)  # fits in a's bytes: reused
    c = _buffers.take(2, 8, torch.float32)  # a is taken: a fresh one
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert c.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    _buffers.give(b)
    release_buffers()
    assert _buffers.take(2, 8, torch.float32).untyped_storage().data_ptr() != a.untyped_storage().data_ptr()


def _static_body(ctx):
    """Known split sizes skip the count exchange and give the same result."""
    w_ = ctx.world_size
    experts, tokens = 2 * w_, 5
    x, _, w = _routing(ctx.rank, tokens, experts, 2, 7)
    # every token picks expert 0 and the last expert: it goes to rank 0 and to the last rank
    idx = torch.tensor([[0, experts - 1]] * tokens)
    send = [tokens if r in (0, w_ - 1) else 0 for r in range(w_)]
    recv = [tokens] * w_ if ctx.rank in (0, w_ - 1) else [0] * w_
    spans = []

    class Obs:
        def on_span_start(self, s):
            spans.append(s.name)

    overlap.add_observer(Obs())
    h = dispatch(x, idx, w, experts, ctx.group, send_splits=send, recv_splits=recv)
    y, batch = _scale_experts(h, ctx.rank, 2)
    out = combine(y, batch, h).wait()
    return out, _dense(x, idx, w), spans


def test_static_splits_skip_count_exchange():
    for out, dense, spans in run_ranks(_static_body, 2):
        torch.testing.assert_close(out, dense)
        assert "dispatch.counts" not in spans and "dispatch" in spans


def test_handle_and_batch_offer_the_interface_of_every_family():
    """`collectives.handles`: wait / expand / combine, and a batch with x, host counts and a device group list;
    every member of each protocol there with a signature that takes the protocol's calls
    (`tests/support/protocols.py`)."""
    x, idx, w = _routing(0, 12, 4, 2, seed=3)
    h = dispatch(x, idx, w, 4, async_finish=True)
    assert isinstance(h, EPDispatchHandle) and protocol_problems(h, EPDispatchHandle) == []
    assert h.wait() is h
    y, batch = _scale_experts(h, 0, 4)
    assert isinstance(batch, EPBatch) and protocol_problems(batch, EPBatch) == []
    gl = batch.group_list
    assert gl.dtype == torch.int64 and gl.device == batch.x.device and gl.tolist() == batch.counts
    assert sum(batch.counts) == batch.x.shape[0] == 24
    result = h.combine(y, batch, async_finish=True)
    assert isinstance(result, EPCombineHandle) and protocol_problems(result, EPCombineHandle) == []
    torch.testing.assert_close(result.wait(), _dense(x, idx, w))


def test_the_handle_protocol_check_sees_more_than_names():
    """A handle with every name but a combine that takes no ``async_finish``, an ``expand`` that needs an
    argument, and a batch whose ``counts`` is a method: ``isinstance`` passes them, the signature check does not."""

    class Handle:
        def wait(self):
            return self

        def expand(self, counts):
            return Batch()

        def combine(self, expert_out, batch):
            return None

    class Batch:
        x = group_list = torch.zeros(1)

        def counts(self):
            return [1]

    assert isinstance(Handle(), EPDispatchHandle) and isinstance(Batch(), EPBatch)
    assert protocol_problems(Handle(), EPDispatchHandle) == [
        "Handle.combine: takes no keyword 'async_finish'",
        "Handle.expand: requires ['counts'], which the protocol does not pass"]
    assert protocol_problems(Batch(), EPBatch) == ["Batch.counts: a method, but EPBatch has this property"]


def _bad_input_body(ctx):
    """Every bad input raises LayoutError on every rank, and no tokens travelled: a rank that rejects its
    input only takes part in the count exchange (flagged), where there is one."""
    comm = []

    class Obs:
        def on_span_start(self, s):
            if s.kind == "comm":
                comm.append(s.name)

    overlap.add_observer(Obs())
    x, idx, w = _routing(ctx.rank, 6, 8, 2, 0)
    cases = {
        "out of range": (x, idx + 8, w, 8, {}),
        "negative id": (x, idx - 10, w, 8, {}),
        "weights shape": (x, idx, w[:, :1], 8, {}),
        "tokens vs ids": (x[:5], idx, w, 8, {}),
        "ids dtype": (x, idx.float(), w, 8, {}),
        "weights dtype": (x, idx, (w * 10).long(), 8, {}),
        "tokens dtype": (x.long(), idx, w, 8, {}),
        "not divisible": (x, idx % 3, w, 3, {}),
        "splits for another group": (x, idx, w, 8, dict(send_splits=[6] * 3, recv_splits=[6] * 3)),
        "splits disagree": (x, idx, w, 8, dict(send_splits=[0, 0], recv_splits=[0, 0])),
    }
    messages = {}
    for name, (xx, ii, ww, e, kw) in cases.items():
        try:
            dispatch(xx, ii, ww, e, ctx.group, **kw)
        except LayoutError as err:
            messages[name] = str(err)
    return messages, comm


def test_bad_input_rejected_before_any_collective():
    for messages, comm in run_ranks(_bad_input_body, 2):
        assert comm == ["dispatch.counts"] * 8, comm  # not for given splits (no count exchange to join)
        assert len(messages) == 10, sorted(messages)
        assert "out of range" in messages["out of range"]
        assert "multiple of the group size" in messages["not divisible"]
        assert "group of 2 ranks" in messages["splits for another group"]


def test_layout_counts_and_order():
    idx = torch.tensor([[0, 1], [3, 2], [1, 3], [0, 2]])
    lay = compute_layout(idx, 4, 2)
    assert lay.num_tokens_per_rank.tolist() == [3, 3]
    assert lay.num_tokens_per_expert.tolist() == [2, 2, 2, 2]
    assert lay.send_token.tolist() == [0, 2, 3, 1, 2, 3]  # rank-major, token order, each pair once
    assert lay.send_rank.tolist() == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_reduction_equals_the_static_form(dtype, monkeypatch):
    """The eager CPU reduction (bags of expanded rows) against the static-shape form, over several
    chunks, with rows that hold no local expert, and placed straight into token order."""
    from collectives import layout as L

    monkeypatch.setattr(L, "_CHUNK_BYTES", 16 * H * 4)  # 16 rows a chunk
    g = torch.Generator().manual_seed(5)
    rows, k, local = 100, 3, 4
    ids = torch.randint(-1, local, (rows, k), generator=g)
    ids[:7] = -1  # rows with no local slot (not produced by dispatch, but allowed): they sum to zero
    meta = torch.cat([ids.float(), torch.rand(rows, k, generator=g)], dim=1)
    batch = L.expand(torch.randn(rows, H, generator=g).to(dtype), meta, local)
    expert_out = batch.x * 2
    weights = meta[:, k:]
    dense = L._reduce_local_dense(expert_out, batch, weights)
    bags = L.local_bags(expert_out, batch, weights)
    torch.testing.assert_close(L.reduce_bags(expert_out, bags, 0, rows), dense, rtol=1e-6, atol=1e-6)
    assert not dense[:7].any()
    tokens = torch.sort(torch.randperm(300, generator=g)[: rows - 40]).values
    placed = L.reduce_bags(expert_out, bags, 40, rows, tokens=tokens, num_tokens=300)
    expected = torch.zeros(300, H)
    expected[tokens] = dense[40:]
    torch.testing.assert_close(placed, expected, rtol=1e-6, atol=1e-6)


def _traced(x, idx, w, send, recv, counts, group):
    h = dispatch(x, idx, w, 4, group, send_splits=send, recv_splits=recv, async_finish=True)
    h.wait()
    batch = h.expand(counts)
    return combine(batch.x * 2, batch, h, async_finish=True).wait()


def _compile_body(ctx):
    from tools import torchair_contract as tc

    tokens = 3
    x, idx, w = torch.randn(tokens, H), torch.tensor([[0, 3]] * tokens), torch.rand(tokens, 2)
    counts = [2 * tokens, 0] if ctx.rank == 0 else [0, 2 * tokens]
    out = {}
    for path in ("ge", "aclgraph"):
        gm = tc.capture_graph(_traced, x, idx, w, [tokens, tokens], [tokens, tokens], counts, ctx.group, path=path)
        streams = tc.stream_of(gm)
        a2a = [n.name for n in gm.graph.nodes if "all_to_all" in str(n.target)]
        out[path] = dict(a2a_streams=[streams[n] for n in a2a], ops=tc.ops_in_order(gm, air_only=True))
    return out


def test_traces_under_compile_fullgraph_with_static_splits():
    from tools import torchair_contract as tc

    tc.load_torchair()  # skips when the torch_npu wheel cannot be had
    for out in run_ranks(_compile_body, 2, timeout=240):
        for path in ("ge", "aclgraph"):
            assert out[path]["a2a_streams"] == [overlap.EP_COMM] * 3, out[path]  # tokens, metadata, combine
        acl = out["aclgraph"]["ops"]
        for tag in ("ep_dispatch", "ep_combine"):
            rec, wait = acl.index(f"tagged_event_record({tag})"), acl.index(f"tagged_event_wait({tag})")
            assert rec < wait


def _previous_event_does_not_skip_the_packing(ctx):
    """With previous_event the exchange must still wait for what dispatch / combine packed on the caller's stream."""
    from overlap.observability.sanitizer import Sanitizer

    x, idx, w = _routing(ctx.rank, 16, 4, 2, seed=1)
    with Sanitizer(raise_on_race=False) as san:
        x2 = x * 2
        before = overlap.event("user_before_dispatch")
        before.record()
        h = dispatch(x2, idx, w, 4, ctx.group, previous_event=before, async_finish=True).wait()
        b = h.expand()
        before_combine = overlap.event("user_before_combine")
        before_combine.record()
        out = combine(b.x * 1.0, b, h, previous_event=before_combine, async_finish=True).wait()
    return [str(r) for r in san.races], out.shape


@pytest.mark.parametrize("world", [1, 2])
def test_previous_event_keeps_the_exchange_after_the_packing(world):
    for races, shape in run_ranks(_previous_event_does_not_skip_the_packing, world):
        assert not races, races
        assert tuple(shape) == (16, H)


def _two_dispatches_in_flight_have_their_own_events(ctx):
    x, idx, w = _routing(ctx.rank, 8, 4, 1, seed=2)
    h1 = dispatch(x, idx, w, 4, ctx.group, async_finish=True)
    h2 = dispatch(x + 1, idx, w, 4, ctx.group, async_finish=True)
    return h1.event is not h2.event and h1.event.tag != h2.event.tag


def test_two_dispatches_in_flight_are_waited_for_separately():
    assert run_ranks(_two_dispatches_in_flight_have_their_own_events, 2) == [True, True]


def _wait_from_a_third_stream(ctx):
    from overlap.observability.sanitizer import Sanitizer

    x, idx, w = _routing(ctx.rank, 12, 4, 2, seed=3)
    with Sanitizer(raise_on_race=False) as san:
        h = dispatch(x, idx, w, 4, ctx.group, async_finish=True)
        with overlap.stream(overlap.SHARED_EXPERT):  # neither the caller's stream nor the exchange's
            h.wait()
            total = h.recv_x.sum()  # own rows (gathered on the caller's stream) included
        overlap.synchronize()
    return [str(r) for r in san.races], float(total)


def test_a_handle_waited_on_another_stream_orders_the_own_rows_too():
    for races, _ in run_ranks(_wait_from_a_third_stream, 2):
        assert not races, races


def _events_and_buffers(ctx):
    """Which events a handle carries in each mode, and the send buffer handed from dispatch to combine."""
    x, idx, w = _routing(ctx.rank, 12, 4, 2, seed=4)
    seen = {}
    for mode, kw in (("async", dict(async_finish=True)), ("sync", {}),
                     ("caller", dict(async_finish=True, stream_tag=None))):
        h = dispatch(x, idx, w, 4, ctx.group, **kw)
        seen[f"dispatch {mode}"] = (h.event is not None, h.own_event is not None)
        h.wait()
        seen[f"dispatch {mode} waited"] = (h.event is not None, h.own_event is not None)
        spare = h.spare is not None
        y, batch = _scale_experts(h, ctx.rank, 2)
        c = combine(y, batch, h, **kw)
        seen[f"combine {mode}"] = (c.event is not None, c.own_event is not None)
        seen[f"spare {mode}"] = (spare, h.spare is not None)
        ok = torch.allclose(c.wait(), _dense(x, idx, w), rtol=1e-5, atol=1e-5)
        seen[f"combine {mode} waited"] = (c.event is not None, c.own_event is not None, ok, c.spent == [])
    return seen


def test_handles_carry_events_only_for_a_side_stream_exchange():
    for seen in run_ranks(_events_and_buffers, 2):
        assert seen["dispatch async"] == (True, True)
        assert seen["dispatch sync"] == seen["dispatch caller"] == (False, False)
        for mode in ("async", "sync", "caller"):
            assert seen[f"dispatch {mode} waited"] == (False, False)
            assert seen[f"spare {mode}"] == (True, False)  # pooled on CPU, taken over by the combine
            assert seen[f"combine {mode} waited"] == (False, False, True, True)
        assert seen["combine async"] == (True, True)
        assert seen["combine sync"] == seen["combine caller"] == (False, False)


def _many_experts_body(ctx):
    """More experts per rank than the count exchange's fixed slots hold: `expand` counts them instead."""
    import sys

    module = sys.modules["collectives.dispatch"]  # `collectives.dispatch` is the function
    kept, module._FOLDED_EXPERTS = module._FOLDED_EXPERTS, 2  # 1 slot per destination on 2 ranks, 4 experts per rank
    try:  # torchrun mode: this process runs other tests afterwards
        x, idx, w = _routing(ctx.rank, 10, 8, 2, seed=6)
        h = dispatch(x, idx, w, 8, ctx.group)
        y, batch = _scale_experts(h, ctx.rank, 4)
        return h.num_recv_tokens_per_expert, combine(y, batch, h).wait(), _dense(x, idx, w)
    finally:
        module._FOLDED_EXPERTS = kept


def test_expert_counts_past_the_fixed_slots_are_counted_on_the_receiver():
    for counts, out, dense in run_ranks(_many_experts_body, 2, timeout=60):
        assert counts is None
        torch.testing.assert_close(out, dense)


def _outside_the_group(ctx):
    """Rank 1 calls on a group made of rank 0 alone: every entry point names the group and this rank."""
    import torch.distributed as dist

    from collectives import ExpertParallelMoE, MoEConfig, capacity_dispatch
    from overlap.multirank import under_torchrun

    x, idx, w = _routing(ctx.rank, 6, 4, 2, seed=7)
    if not under_torchrun():
        group = dist.new_group([0])  # rank 1 gets GroupMember.NON_GROUP_MEMBER
        if ctx.rank == 0:  # a group of one works
            return dispatch(x, idx, w, 4, group).recv_x.shape[1] == H
    elif ctx.rank == 0:  # under torchrun every rank of the job would have to create the group
        return True
    else:
        group = dist.GroupMember.NON_GROUP_MEMBER  # what new_group gives rank 1
    calls = {
        "dispatch": lambda: dispatch(x, idx, w, 4, group),
        "capacity_dispatch": lambda: capacity_dispatch(x, idx, w, 4, group),
        "layer": lambda: ExpertParallelMoE.from_config(MoEConfig(hidden=H, ffn=8, n_experts=4, top_k=2), group),
        "all_to_all_single": lambda: overlap.all_to_all_single(torch.empty(2, 1), torch.zeros(2, 1), group=group),
        "all_reduce": lambda: overlap.all_reduce(torch.zeros(1), group=group),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except ValueError as err:  # LayoutError is one
            out[name] = f"{type(err).__name__}: {err}"
    return out, f"global rank {dist.get_rank()} of {dist.get_world_size()}"


def test_a_rank_outside_the_group_is_told_so():
    ok, (out, me) = run_ranks(_outside_the_group, 2, timeout=60)
    assert ok
    for name, message in out.items():
        assert f"this rank ({me}) is not in the" in message, (name, message)
        assert "GroupMember.NON_GROUP_MEMBER" in message and "-1 ranks" not in message, (name, message)
        assert message.startswith("ValueError" if name.startswith("all_") else "LayoutError"), (name, message)


def _own_split_body(ctx):
    """Rank 0 passes splits that disagree on the rows it sends itself; rank 1 issues nothing."""
    out = {}
    cases = {
        "both given": ([2, 2], [1, 3]),
        "output even": (None, [1, 3]),
        "input even": ([3, 1], None),
    }
    if ctx.rank == 1:
        return out
    for name, (out_splits, in_splits) in cases.items():
        try:
            overlap.all_to_all_single(torch.empty(4, 2), torch.zeros(4, 2), out_splits, in_splits, group=ctx.group)
            overlap.synchronize()
            out[name] = "no error"
        except Exception as err:  # the old code failed inside gloo with a RuntimeError
            out[name] = f"{type(err).__name__}: {err}"
    return out


def test_an_inconsistent_own_split_is_refused_before_the_exchange():
    out, _ = run_ranks(_own_split_body, 2, timeout=60)
    assert out["both given"].startswith("ValueError: all_to_all_single: rank 0 sends itself 1 rows (input split "
                                        "sizes [1, 3]) but expects 2 from itself (output split sizes [2, 2])"), out
    assert "expects 2 from itself (output split sizes None: 4 rows in 2 even parts)" in out["output even"], out
    assert "sends itself 2 rows (input split sizes None: 4 rows in 2 even parts) but expects 3" in out["input even"]


def test_combine_refuses_outputs_of_another_hidden_size():
    """Every rank's combine sends rows of the dispatched hidden size (agreed in the count exchange), so an
    output of another size is refused on the rank that passes it, before the exchange."""
    x, idx, w = _routing(0, 6, 4, 2, seed=8)
    h = dispatch(x, idx, w, 4)
    batch = h.expand()
    with pytest.raises(LayoutError, match=rf"expert output must be \[12, {H}\] .*got shape \(12, {2 * H}\)"):
        combine(torch.cat([batch.x, batch.x], 1), batch, h)
    other = dispatch(x[:3], idx[:3], w[:3], 4).expand()
    with pytest.raises(LayoutError, match="the batch expands 3 received rows, but this dispatch received 6"):
        combine(other.x, other, h)
    torch.testing.assert_close(combine(batch.x, batch, h).wait(), x * w.sum(1, keepdim=True))


def _two_steps_body(ctx):
    """dispatch_counts then, after other work, PendingDispatch.dispatch: what dispatch gives, for two
    dispatches in flight at once (issued in the same order on every rank), sync and async, read in
    place or ahead (on the comm stream's thread)."""
    epr = 8 // ctx.world_size
    ok = []
    for async_finish, ahead in ((False, False), (True, False), (False, True), (True, True)):
        calls = [_routing(ctx.rank, 20 + 4 * i, 8, 2, 30 + i) for i in range(2)]
        pending = [dispatch_counts(x, idx, w, 8, ctx.group) for x, idx, w in calls]
        ok += [p.issue_ahead() for p in pending if ahead]  # the CPU path's ep_comm stream has a thread
        torch.randn(64, 64) @ torch.randn(64, 64)  # other work while the counts travel
        handles = [p.dispatch(async_finish=async_finish) for p in pending]
        for h, call in zip(handles, calls):
            ref = dispatch(*call, 8, ctx.group)
            h.wait()
            ok.append(torch.equal(h.recv_x, ref.recv_x) and h.recv_splits == ref.recv_splits)
            y, batch = _scale_experts(h, ctx.rank, epr)
            ok.append(torch.allclose(combine(y, batch, h).wait(), _dense(*call), rtol=1e-5, atol=1e-5))
    try:
        pending[0].dispatch()
        ok.append(False)
    except RuntimeError as err:
        ok.append("runs once" in str(err))
    return ok


@pytest.mark.parametrize("world", [1, 2])
def test_a_dispatch_in_two_steps_equals_one(world):
    for ok in run_ranks(_two_steps_body, world):
        assert ok and all(ok), ok


def _counts_do_not_hold_the_host_body(ctx):
    """Rank 1 issues its count exchange only once rank 0's dispatch_counts has returned (a key in the
    store, waited for at most 60 s): were the first step to read the counts, rank 0 would wait for rank 1
    and rank 1 for rank 0. Rank 1 then issues anyway, so that no rank is left waiting, and says whether the
    key came."""
    import datetime

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    key = f"test_dispatch/counts-returned/{ctx.world_size}"
    x, idx, w = _routing(ctx.rank, 12, 8, 2, 5)
    came = True
    if ctx.rank == 1:
        try:
            store.wait([key], datetime.timedelta(seconds=60))
        except Exception:  # a timeout: rank 0 is still inside dispatch_counts
            came = False
    pending = dispatch_counts(x, idx, w, 8, ctx.group)
    if ctx.rank == 0:
        store.set(key, "1")
    handle = pending.dispatch()
    return came, handle.recv_splits


def test_the_count_exchange_does_not_hold_the_host_until_it_is_read():
    (_, splits0), (came, splits1) = run_ranks(_counts_do_not_hold_the_host_body, 2, timeout=180)
    assert came  # rank 0's host went on before rank 1 had issued its counts
    assert splits0 and splits1


def _rejected_in_two_steps_body(ctx, ahead):
    x, idx, w = _routing(ctx.rank, 6, 8, 2, 0)
    if ctx.rank == 1:
        idx = idx + 8  # out of range on rank 1 only
    try:
        pending = dispatch_counts(x, idx, w, 8, ctx.group)
    except LayoutError as err:
        return "counts", str(err)
    if ahead:  # the read on the comm stream's thread: its error comes back at dispatch()
        assert pending.issue_ahead()
    try:
        pending.dispatch()
    except LayoutError as err:
        return "dispatch", str(err)
    return "none", ""


@pytest.mark.parametrize("ahead", [False, True], ids=["in-place", "ahead"])
def test_a_rank_that_rejects_its_input_stops_every_rank_in_the_two_steps(ahead):
    (where0, msg0), (where1, msg1) = run_ranks(_rejected_in_two_steps_body, 2, ahead)
    assert where1 == "counts" and "out of range" in msg1  # the rank at fault, with its own words
    assert where0 == "dispatch" and "rank 1" in msg0, msg0  # the other, when it reads the counts
