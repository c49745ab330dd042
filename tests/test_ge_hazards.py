"""The GE reorder hazard on graphs traced on the ``ge`` path with torchair's own scope code (tests/tools/
torchair_contract.py): the guide's ``silu(z)`` found and pinned into the side scope with the outputs unchanged,
the toolkit's prefill and decode graphs of the reference decoder checked, and the ``ge`` backend pinning by
default. Skipped, with the reason, when the torch_npu wheel cannot be had."""
import sys
import types

import pytest
import torch

import overlap
from overlap.backends.ge import GeBackend
from overlap.backends.ge_reorder import ge_hazards, pin_cheap_consumers
from tools import torchair_contract as tc


@pytest.fixture(scope="module", autouse=True)
def torchair():
    return tc.load_torchair()


def guide(x, w1, w2):
    """The guide's example: the side stream's ``z``, its ``silu`` (a cast, then Swish) consumed on the main stream
    beside a long matmul that does not need it."""
    with overlap.stream(overlap.SHARED_EXPERT):
        z = x @ w1
    y = x @ w2
    return y * torch.nn.functional.silu(z.float())


def joined(x, w1, w2):
    """No hazard: the side output's only main-stream reader needs the matmul too (a join, not a precompute)."""
    with overlap.stream(overlap.SHARED_EXPERT):
        z = x @ w1
    y = x @ w2
    return y * z


def _inputs():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(8, 8, generator=g) for _ in range(3))


def _run_stripped(gm, *args):
    out = tc.strip_air(gm)(*args)
    return out[0] if isinstance(out, (tuple, list)) else out


def test_the_guides_silu_is_found_and_pinned_into_the_side_scope():
    args = _inputs()
    gm = tc.capture_graph(guide, *args, path="ge")
    (found,) = ge_hazards(gm)
    assert (found.output, found.stream, found.operation, found.dominator) == ("z", overlap.SHARED_EXPERT, "float", "y")
    assert "may be issued ahead of y" in str(found)
    before = _run_stripped(gm, *args)
    moved = pin_cheap_consumers(gm)
    assert [h.operation for h in moved] == ["float", "silu"]  # the chain, link by link
    streams = tc.stream_of(gm)
    assert streams[found.consumer] == streams["silu"] == overlap.SHARED_EXPERT
    assert streams["y"] == streams["mul"] == overlap.DEFAULT
    assert ge_hazards(gm) == []
    assert torch.equal(_run_stripped(gm, *args), before) and torch.allclose(before, guide(*args))


def test_a_join_is_no_hazard_and_is_left_in_place():
    gm = tc.capture_graph(joined, *_inputs(), path="ge")
    order = tc.ops_in_order(gm)
    assert ge_hazards(gm) == [] and pin_cheap_consumers(gm) == [] and tc.ops_in_order(gm) == order


def test_the_ge_backend_pins_before_compiling_unless_switched_off(monkeypatch):
    """``GeBackend.compile_backend`` hands torchair's backend graphs with their cheap consumers pinned."""
    seen = []
    fake = types.SimpleNamespace(CompilerConfig=lambda: types.SimpleNamespace(mode=None),
                                 get_npu_backend=lambda compiler_config: lambda gm, ex: seen.append(ge_hazards(gm)))
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setitem(sys.modules, "torchair", fake)
    args = _inputs()
    gm = tc.capture_graph(guide, *args, path="ge")
    GeBackend().compile_backend()(gm, list(args))
    assert seen == [[]]
    gm = tc.capture_graph(guide, *args, path="ge")
    monkeypatch.setattr(GeBackend, "pin_cheap_consumers", False)
    GeBackend().compile_backend()(gm, list(args))
    assert [h.operation for h in seen[1]] == ["float"]


def _reference(tiny_layers=1):
    from launch.models import build_model, preset

    return build_model(preset("tiny", n_dense_layers=0, n_layers=tiny_layers), seed=7)


@pytest.mark.parametrize("mode, found", [("shared", []), ("two-batch", ["unsqueeze", "unsqueeze", "view", "view"])])
def test_the_reference_prefill_graph_is_pinned_to_no_hazard_with_the_same_output(mode, found):
    """``shared``: none. ``two-batch``: each micro-batch's received rows (``unsqueeze`` for the expert matmul) and
    combined rows (``view``) reshaped on the main stream, beside the other micro-batch's attention projections."""
    from launch.engine import graph_prefill, make_capacity_expert_parallel, split_for
    from microbatch.batch import Batch

    model = _reference()
    batch = Batch.random([5, 9, 4], model.cfg.vocab, seed=1)
    make_capacity_expert_parallel(model, None, batch.seq.num_tokens)
    split = split_for(mode, batch, None, min_tokens=2)
    out, seen, left = {}, {}, {}
    for pin in (False, True):
        def keep(gm, example_inputs, pin=pin):
            seen[pin] = sorted(h.operation for h in (pin_cheap_consumers(gm) if pin else ge_hazards(gm)))
            left[pin] = ge_hazards(gm)
            return tc.strip_air(gm)
        torch._dynamo.reset()
        with tc.installed(), tc._sanitizer_set_aside():
            out[pin] = graph_prefill(model, batch, mode, split, "ge", compile_backend=keep)()
        torch._dynamo.reset()
    assert seen == {False: found, True: found} and left[True] == []
    assert torch.equal(out[True], out[False])


def test_the_reference_decode_graph_is_pinned_to_no_hazard_with_the_same_tokens():
    from launch.engine import GraphDecoder, generate, make_expert_parallel, new_cache

    model = make_expert_parallel(_reference(), None)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.cfg.vocab, (n,), generator=g).tolist() for n in (5, 3)]
    want = generate(model, prompts, [2, 2]).tokens
    left, moved = [], []

    def keep(gm, example_inputs):
        moved.append(pin_cheap_consumers(gm))
        left.append(ge_hazards(gm))
        return tc.strip_air(gm)
    torch._dynamo.reset()
    decoder = GraphDecoder(model, new_cache(model, prompts, [2, 2]), "two-batch", "ge", compile_backend=keep)
    with tc.installed(), tc._sanitizer_set_aside():
        got = generate(model, prompts, [2, 2], decoder=decoder)
    torch._dynamo.reset()
    assert moved and all(moved) and all(h == [] for h in left) and got.tokens == want
