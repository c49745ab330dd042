"""A decode step's operations: on a device each is a kernel launch, and an eager step is bound by them."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from collectives._grouping import group_rows, reduce_rows
from launch.engine import greedy_generate
from launch.models import build_model, preset
from launch.models.reference import rope, rope_tables


class _Ops(TorchDispatchMode):
    """Counts the aten operations run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _reduce_ops(k: int) -> int:
    g = torch.Generator().manual_seed(k)
    rows, local = 24, 3
    ids = torch.randint(-1, local, (rows, k), generator=g)
    weights = torch.where(ids >= 0, torch.rand(rows, k, generator=g), torch.zeros(()))
    grouped = group_rows(torch.randn(rows, 16, generator=g), ids, weights, local)
    with _Ops() as ops:
        reduce_rows(grouped.x, grouped)
    return sum(ops.count.values())


def test_reducing_the_slots_costs_a_few_operations_and_an_add_per_slot():
    """The weighted sum over a row's k slots is a handful of operations over all slots at once and an add per
    slot in slot order (with the view it reads), not a select, cast, multiply, select and add per slot: 19
    operations at k = 2 before, 11 now."""
    few = _reduce_ops(2)
    assert few <= 12, few
    assert _reduce_ops(8) - few <= 6 * 2, (few, _reduce_ops(8))  # two more a slot


def test_rotary_embedding_turns_each_pair_by_its_angle():
    """Against complex multiplication: (x1 + i x2) e^(i p f_j), f_j = theta^(-j / half), rotate-half layout."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, generator=g, dtype=torch.float64)
    pos = torch.tensor([0, 1, 7, 100, 4095])
    got = rope(x.float(), rope_tables(pos, 8, 10000.0)).double()
    freq = 10000.0 ** (-torch.arange(4, dtype=torch.float64) / 4)
    turned = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones(5, 1, 4, dtype=torch.float64),
                                                                  pos.double()[:, None, None] * freq)
    want = torch.cat([turned.real, turned.imag], dim=-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    assert torch.equal(got[0], x[0].float().double())  # position 0 is no turn at all


def test_a_decode_steps_rotary_tables_are_made_once_for_every_layer():
    """By the step's first layer (`KVStep.once`), for its queries and keys and every layer after it."""
    model = build_model(preset("tiny"), seed=3)
    counts = []
    for layer in model.layers:  # each layer's decode attention, counted call by call
        def counted(hidden, step, _inner=layer.decode_attention):
            with _Ops() as ops:
                out = _inner(hidden, step)
            counts.append(ops.count)
            return out
        layer.decode_attention = counted
    greedy_generate(model, [[1, 2, 3], [4, 5]], 3)
    layers = model.cfg.n_layers
    assert len(counts) == 2 * layers  # two decode steps
    for step in (counts[:layers], counts[layers:]):
        assert [c["aten.cos"] for c in step] == [1] + [0] * (layers - 1), [dict(c) for c in step]


def test_a_transformers_models_rotary_embedding_and_mask_are_made_once_a_decode_step():
    """The adapter's decode (every layer a call of the family's attention) asks the model's rotary embedding and
    builds the mask once a step, not once a layer; the tokens stay the model's own `generate`'s."""
    pytest.importorskip("transformers")
    from launch.models import build_transformers_model
    from launch.models.transformers import attention

    model = build_transformers_model("qwen3_moe", seed=7)
    rotary = model.hf.model.rotary_emb
    calls = collections.Counter()
    inner_rotary, inner_mask = rotary.forward, attention.decode_mask

    def rotary_forward(*args, **kwargs):
        calls["rotary"] += 1
        return inner_rotary(*args, **kwargs)

    def mask(*args, **kwargs):
        calls["mask"] += 1
        return inner_mask(*args, **kwargs)

    rotary.forward = rotary_forward
    prompts = [[3, 1, 4, 1], [5, 9]]
    want = model.own_generate(prompts, 4)
    calls.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "decode_mask", mask)
        got = greedy_generate(model, prompts, 4)
    steps = 3  # 4 new tokens: the prefill's and three decode steps
    assert got == want
    assert calls["mask"] == steps, calls
    prefill = len(prompts) * len(model.hf.model.layers)  # the prefill's: once per request and layer
    assert calls["rotary"] == steps + prefill, calls


@pytest.mark.parametrize("k", [1, 4])
def test_reduce_rows_of_one_slot_and_of_several_equal_the_slot_by_slot_sum(k):
    g = torch.Generator().manual_seed(5)
    rows, local = 9, 4
    ids = torch.randint(-1, local, (rows, k), generator=g)
    weights = torch.where(ids >= 0, torch.rand(rows, k, generator=g), torch.zeros(()))
    grouped = group_rows(torch.randn(rows, 16, generator=g), ids, weights, local)
    y = torch.randn(grouped.x.shape, generator=g)
    pairs = y[grouped.dst]
    want = torch.zeros(rows, 16)
    for r in range(rows):
        for s in range(k):
            if ids[r, s] >= 0:
                want[r] = want[r] + pairs[r * k + s] * weights[r, s]
    assert torch.equal(reduce_rows(y, grouped), want)


def test_reduce_slots_of_every_expert_over_every_row_is_the_slot_by_slot_sum_in_a_few_operations():
    """The capacity layer's "all" expert path (every local expert over every received row, where no grouped
    matmul takes the dtype: CUDA in float32): the same sums bit for bit, not a gather, multiply, select and add
    per slot."""
    from collectives.capacity import reduce_slots

    g = torch.Generator().manual_seed(9)
    local, rows, k = 3, 11, 4
    out = torch.randn(local, rows, 16, generator=g)
    ids = torch.randint(-1, local, (rows, k), generator=g)
    weights = torch.where(ids >= 0, torch.rand(rows, k, generator=g), torch.zeros(()))
    out[:, 0] = float("nan")  # row 0's experts are NaN: only its chosen slots may carry it, none where it chose none
    ids[0] = -1
    want = torch.zeros(rows, 16)
    for r in range(rows):
        for s in range(k):
            if ids[r, s] >= 0:
                want[r] = want[r] + out[ids[r, s], r] * weights[r, s]
    with _Ops() as ops:
        got = reduce_slots(out, ids, weights)
    assert torch.equal(got, want)
    assert sum(ops.count.values()) <= 2 * k + 10, dict(ops.count)


_VIEWS = {"aten.view", "aten._unsafe_view", "aten.slice", "aten.select", "aten.expand", "aten.t", "aten.transpose",
          "aten.unsqueeze", "aten.squeeze", "aten.permute", "aten.as_strided", "aten.alias", "aten.detach",
          "aten.reshape", "aten.split", "aten.split_with_sizes", "aten.unbind", "aten.chunk", "aten.narrow"}


def _step_ops_body(ctx, mode):
    import launch.engine.decoder as decoder
    from launch.engine import generate, make_expert_parallel

    model = make_expert_parallel(build_model(preset("tiny"), seed=3), ctx.group)
    counts, inner = [], decoder.decode_step

    def counted(*args, **kwargs):
        with _Ops() as ops:
            out = inner(*args, **kwargs)
        counts.append(sum(n for op, n in ops.count.items() if op not in _VIEWS))
        return out

    decoder.decode_step = counted  # what the eager decoder runs a step with
    try:
        generate(model, [[1, 2, 3, 4]] * 8, 4, mode=mode, prefill_mode="serial")
    finally:
        decoder.decode_step = inner
    return counts


@pytest.mark.parametrize("mode, budget", [("serial", 260), ("chunked-2", 350)])
def test_a_decode_step_of_the_tiny_preset_stays_within_its_operations(mode, budget):
    """Aten operations a decode step issues (views left out; 8 requests, the expert-parallel layers on one rank):
    354 and 498 before the launch diet of docs/decode.md, 247 and 335 after; a step that grows past the budget
    is a regression of every eager device step."""
    from overlap.multirank import run_ranks

    (counts,) = run_ranks(_step_ops_body, 1, mode, timeout=120)
    assert len(counts) == 3 and max(counts) <= budget, counts
