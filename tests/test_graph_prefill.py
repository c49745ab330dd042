"""The reference model's whole two-micro-batch prefill, captured under torch.compile(fullgraph=True) on ge / aclgraph.

Two gloo ranks each build the tiny model (both layers MoE), replace its MoE by the static-shape
`capacity_expert_parallel` over the two ranks (one capacity: the ranks' batches differ by a token), split a
batch into two micro-batches and capture ``embed -> microbatch.run(two_batch) -> final norm`` through the
launcher's `launch.engine.graph_prefill` with torchair's own scope / ops code (see
tests/tools/torchair_contract.py). The captured FX graphs are checked for the lowering's contract, and the graph
without its ``air`` nodes is run (collectives included) and compared with eager serial and with the launcher's
eager two-batch prefill. (tests/test_launcher_graph.py compiles the launcher's other modes.)
"""
from __future__ import annotations

import collections
import re

import pytest
import torch
import torch.distributed as dist

import overlap
from launch.models import build_model, preset
from launch.engine import graph_prefill, make_capacity_expert_parallel, prefill, split_for
from microbatch import lower, serial, two_batch
from microbatch.batch import Batch
from microbatch.forward import micro_batch_inputs, run_schedule
from overlap.multirank import run_ranks

pytestmark = pytest.mark.spawns_ranks

SEQ_LENS = (5, 9, 4)  # rank r's batch: (5, 9, 4 + r); cut inside request 1: micro-batch 1 reads micro-batch 0's
# keys and values
N_LAYERS = 2
SEED = 7


def _prefill_body(ctx):
    from tools import torchair_contract as tc

    cfg = preset("tiny", n_dense_layers=0, n_layers=N_LAYERS)
    batch = Batch.random(SEQ_LENS[:-1] + (SEQ_LENS[-1] + ctx.rank,), cfg.vocab, seed=100 + ctx.rank)
    capacity = torch.tensor([batch.seq.num_tokens])
    dist.all_reduce(capacity, op=dist.ReduceOp.MAX, group=ctx.group)  # the ranks' token counts differ: one capacity
    model = make_capacity_expert_parallel(build_model(cfg, seed=SEED), ctx.group, int(capacity))
    dense = build_model(cfg, seed=SEED)  # the reference MoE, every expert on this rank
    split = split_for("two-batch", batch, ctx.group, min_tokens=2)
    assert not split.serial and split.cut, split
    layers = model.layer_operations()
    schedule = two_batch(layers, 2)

    with overlap.use_path("cpu"), overlap.enabled(False):
        eager_serial = run_schedule(model, batch, split, layers, lambda _layers, _n: serial(layers, 2))
    eager_two_batch = prefill(model, batch, "two-batch", split)  # what the launcher's eager path computes
    dense_out = dense.forward_microbatches(batch, split)

    out = dict(eager_dense_diff=(eager_serial - dense_out).abs().max().item(), graphs={}, n_graphs={},
               stripped_diff={}, launcher_diff={})
    for name, path, on in (("ge", "ge", True), ("aclgraph", "aclgraph", True), ("off", "ge", False)):
        graphs = []

        def keep(gm, example_inputs, graphs=graphs):  # keeps the graph, runs it without its air ops
            graphs.append(gm)
            return tc.strip_air(gm)
        torch._dynamo.reset()  # the path is read at trace time without a guard
        with overlap.enabled(on), tc.installed(), tc._sanitizer_set_aside():
            # issues the stripped graph's all_to_alls: every rank runs the same graphs
            got = graph_prefill(model, batch, "two-batch", split, path, compile_backend=keep)()
        torch._dynamo.reset()
        out["n_graphs"][name] = len(graphs)
        out["graphs"][name] = tc.contract_summary(graphs[0], path)
        out["stripped_diff"][name] = (got - eager_serial).abs().max().item()
        out["launcher_diff"][name] = (got - eager_two_batch).abs().max().item()
    with overlap.use_path("aclgraph"):
        lowering_acl, _ = lower(schedule, layers, micro_batch_inputs(model, batch, split), path="aclgraph")
    out["lowering_events"] = lowering_acl.events()
    out["orders"] = len(schedule.orders)
    return out


@pytest.fixture(scope="module")
def captured():
    from tools import torchair_contract as tc

    tc.load_torchair()  # skips when the torch_npu wheel cannot be had
    return run_ranks(_prefill_body, 2, timeout=400)


def test_collectives_run_in_the_comm_scope(captured):
    for out in captured:
        for name in ("ge", "aclgraph"):
            scopes = out["graphs"][name]["a2a_scopes"]
            # per micro-batch and MoE layer: tokens and metadata out, reduced rows back
            assert len(scopes) == 3 * 2 * N_LAYERS, scopes
            assert all(s.get("_user_stream_label") == overlap.EP_COMM for s in scopes), scopes
            # Dynamo rewrites dist.all_to_all_single into the functional collective: no setting needed
            assert out["graphs"][name]["a2a_targets"] == ["_c10d_functional.all_to_all_single"]


def test_aclgraph_records_on_the_producer_before_every_wait(captured):
    for out in captured:
        g = out["graphs"]["aclgraph"]
        assert g["event_pairs"] and not g["wait_tensor_streams"]
        for tag, recorded_on, waited_on in g["event_pairs"]:
            assert recorded_on is not None, f"wait for {tag} before any record"
            assert recorded_on == tag.split("@")[1] != waited_on, (tag, recorded_on, waited_on)
        assert g["record_tagged_stream"] > 0


def test_aclgraph_one_event_per_microbatch_and_stage_reused_across_layers(captured):
    for out in captured:
        g = out["graphs"]["aclgraph"]
        tags = collections.Counter(g["record_tags"])
        assert set(tags) == set(out["lowering_events"])
        layer_tags = [t for t in tags if re.fullmatch(r"mb[01]\.\w+@\w+", t)]
        assert layer_tags and all(tags[t] == N_LAYERS for t in layer_tags), tags
        assert {t.split(".")[0] for t in layer_tags} == {"mb0", "mb1"}
        assert all(s == t.split("@")[1] for t, s in zip(g["record_tags"], g["record_streams"]) if t in layer_tags)


@pytest.mark.parametrize("name", ["ge", "aclgraph"])
def test_every_cross_stream_read_is_ordered(captured, name):
    """For every value read on another stream than its writer's, an ordering edge reaches the reader:
    on aclgraph a record after the writer and a wait for it before the reader, on ge data dependence;
    and the exchanges stay in schedule order (ge: through the wait_tensor results the readers consume;
    a wait on an argument the operation does not use is pruned, harmlessly)."""
    for out in captured:
        g = out["graphs"][name]
        assert g["cross_stream_reads"] > 0
        assert g["unordered_reads"] == [], g["unordered_reads"][:5]
        assert g["unordered_exchanges"] == [], g["unordered_exchanges"][:5]
        assert g["consumed_waits"] >= (out["orders"] if name == "ge" else 0)


def test_aclgraph_is_npugraph_ex_and_ge_is_air(captured):
    for out in captured:
        assert out["graphs"]["aclgraph"]["namespaces"] == ["npugraph_ex"]
        assert out["graphs"]["ge"]["namespaces"] == ["air"]


def test_ge_orders_with_wait_tensor_and_has_no_events(captured):
    for out in captured:
        g = out["graphs"]["ge"]
        assert not any(op.startswith("tagged_event") for op in g["air"]), g["air"]
        assert not g["record_tagged_stream"]
        assert len(g["wait_tensor_streams"]) >= out["orders"] > 0
        assert any(op.startswith("scope_enter(_user_stream_label=ep_comm") for op in g["air"])


def test_overlap_off_has_no_air_ops(captured):
    for out in captured:
        g = out["graphs"]["off"]
        assert g["air"] == []
        assert len(g["a2a_scopes"]) == 3 * 2 * N_LAYERS  # the exchange is still in the graph


def test_stripped_graph_computes_eager_serial(captured):
    for rank, out in enumerate(captured):
        assert out["eager_dense_diff"] < 1e-5, f"rank {rank}: capacity EP model differs from the dense model"
        for name, diff in out["stripped_diff"].items():
            assert diff < 1e-5, f"rank {rank} {name}: the captured graph differs from eager serial by {diff}"


def test_the_launchers_graph_prefill_is_one_graph_equal_to_its_eager_two_batch(captured):
    """`launch.engine.graph_prefill` of two-batch (the mode tests/test_launcher_graph.py leaves to this file): one
    graph on each path, overlap on or off, computing the launcher's eager two-batch prefill."""
    for rank, out in enumerate(captured):
        for name in ("ge", "aclgraph", "off"):
            assert out["n_graphs"][name] == 1, f"rank {rank} {name}: {out['n_graphs'][name]} graphs"
            diff = out["launcher_diff"][name]
            assert diff <= 1e-5, f"rank {rank} {name}: compiled differs from the eager two-batch prefill by {diff}"
