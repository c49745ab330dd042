"""The launcher's graph path (`launch.engine.graph_prefill`): every mode of the reference model compiles as one
graph on ge (on aclgraph: every mode with a second stream) and, without its torchair nodes, computes what eager
does. two-batch is compiled (on both paths, and with overlap off) by tests/test_graph_prefill.py, whose graphs
are the launcher's too: compiling it here again cost ~40% of this file's CPU."""
import pytest
import torch
import torch.distributed as dist

from launch.models import build_model, preset
from launch.engine import graph_prefill, make_capacity_expert_parallel, split_for, prefill
from microbatch import MODES
from microbatch.batch import Batch
from overlap.multirank import run_ranks

pytestmark = pytest.mark.spawns_ranks


def _compiled_equals_eager(ctx, path, modes):
    from tools import torchair_contract as tc

    cfg = preset("tiny", n_dense_layers=0, n_layers=2)
    batch = Batch.random([5, 9, 4 + ctx.rank], cfg.vocab, seed=20 + ctx.rank)
    capacity = torch.tensor([batch.seq.num_tokens])
    dist.all_reduce(capacity, op=dist.ReduceOp.MAX, group=ctx.group)
    model = make_capacity_expert_parallel(build_model(cfg, seed=3), ctx.group, int(capacity))
    out = {}
    for mode in modes:
        split = split_for(mode, batch, ctx.group, min_tokens=2)
        eager = prefill(model, batch, mode, split)
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return tc.strip_air(gm)  # the real graph minus torchair's nodes, which have no CPU kernels

        torch._dynamo.reset()
        with tc.installed(), tc.schedule_checks() as checks:
            compiled = graph_prefill(model, batch, mode, split, path, compile_backend=backend)()
        torch._dynamo.reset()
        air = tc.ops_in_order(graphs[0], air_only=True) if graphs else []
        out[mode] = ((compiled - eager).abs().max().item(), len(graphs), split.serial, air, checks)
    return out


ALL = [name for name, m in MODES.items() if m.in_all]
IN_GRAPH_PREFILL = "two-batch"  # tests/test_graph_prefill.py: graph_prefill of two-batch, its graphs' contract
HERE = [m for m in ALL if m != IN_GRAPH_PREFILL]


# ge compiles every mode (two-batch: in tests/test_graph_prefill.py). aclgraph differs from ge in how a
# cross-stream edge is lowered (a tagged event record / wait), which only the modes with a second stream show:
# shared (the shared experts' stream beside the communication's) and two-batch (two micro-batches crossing both
# ways). serial has one stream, nothing for aclgraph to lower differently: it is compiled and compared on ge (on
# aclgraph it cost ~15% of this file's CPU).
@pytest.mark.parametrize("path, modes", [("ge", HERE), ("aclgraph", [m for m in HERE if m != "serial"])],
                         ids=["ge", "aclgraph"])
def test_every_mode_compiles_to_one_graph_equal_to_eager(path, modes):
    from tools import torchair_contract as tc

    assert IN_GRAPH_PREFILL in ALL and modes  # every mode of ALL is compiled, here or there
    tc.load_torchair()  # skips when the torch_npu wheel cannot be had
    results = run_ranks(_compiled_equals_eager, 2, path, modes, timeout=400)
    assert [list(per_mode) for per_mode in results] == [modes, modes]
    for per_mode in results:
        for mode, (diff, n_graphs, serial, air, checks) in per_mode.items():
            assert n_graphs == 1, f"{mode}: {n_graphs} graphs"
            # lowered once, before the trace: the graph's tracing time goes to the launches alone
            assert checks == [False], f"{mode}: schedule checks {checks} (True: inside the trace)"
            assert diff <= 1e-5, f"{mode}: compiled differs from eager by {diff}"
            if mode == "serial":
                assert not any("ep_comm" in a for a in air)  # the reference: one stream
            else:
                assert any("scope_enter" in a and "ep_comm" in a for a in air), air[:5]
            if mode == "two-batch":
                assert not serial
                events = [a for a in air if "tagged_event" in a]
                assert bool(events) == (path == "aclgraph")
