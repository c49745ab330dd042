"""The reference model: deterministic weights, packed attention, and micro-batch-by-micro-batch prefill.

Micro-batch results are compared with the whole-batch forward at a tight float32 tolerance, not
bitwise: CPU GEMMs of one or two rows (an expert that gets one token) take other kernels than
larger ones, so the same row can round differently in a smaller batch.
"""
import collections
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from launch.models import PRESETS, build_model, preset
from microbatch import HIDDEN, OUT, ForwardModel, Layer, MoELayer, MoEModel, ModelShape
from microbatch.batch import K, PREFIX_KV, SEQ, V, Batch, SeqInfo
from microbatch.operations import State
from microbatch.planning.split import propose_split
from microbatch.split import split_batch
from overlap.multirank import run_ranks
from support.launcher import ROOT
from support.protocols import Without, protocol_members, protocol_problems

TINY = PRESETS["tiny"]
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def model():
    return build_model(TINY, seed=3)


def _state_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_weights_are_deterministic_from_the_seed(model):
    assert _state_equal(model, build_model(TINY, seed=3))
    assert not _state_equal(model, build_model(TINY, seed=4))
    batch = Batch.random([5, 9], TINY.vocab, seed=1)
    assert torch.equal(model(batch), build_model(TINY, seed=3)(batch))
    # a parameter's values depend on its name, not on which other parameters exist
    deeper = build_model(dataclasses.replace(TINY, n_layers=TINY.n_layers + 1), seed=3)
    assert _state_equal(model.layers[1], deeper.layers[1])


def _weights_checksum(ctx):
    m = build_model(TINY, seed=3)
    return [float(p.double().sum()) for p in m.parameters()]


def test_weights_are_the_same_on_every_rank(model):
    local = [float(p.double().sum()) for p in model.parameters()]
    assert run_ranks(_weights_checksum, 2, timeout=60) == [local, local]


def test_the_reference_decoder_implements_the_model_contract(model):
    """`microbatch.model.MoEModel`: every member, with a signature that takes the contract's calls; its shapes
    (`ModelShape`), each layer (`Layer`) and each MoE layer (`MoELayer`) too."""
    assert protocol_problems(model, MoEModel) == []
    assert protocol_problems(model.cfg, ModelShape) == []
    assert [protocol_problems(layer, Layer) for layer in model.layers] == [[]] * TINY.n_layers
    moe = list(model.moe_layers())
    assert len(moe) == TINY.n_layers - TINY.n_dense_layers and all(protocol_problems(la, MoELayer) == [] for la in moe)
    assert model.no_cut_reason is None  # every layer is attention: a request may be cut


@pytest.mark.parametrize("member", sorted(protocol_members(MoEModel)))
def test_the_contract_check_fails_on_a_member_removed(model, member):
    """The check sees each member: the reference decoder without one of them fails it, naming that one."""
    assert protocol_problems(Without(model, member), MoEModel, "Model") == [
        f"Model.{member}: missing (MoEModel has this {protocol_members(MoEModel)[member]})"]


@pytest.mark.parametrize("proto,member", [(ModelShape, "k_shape"), (ModelShape, "is_moe_layer"), (Layer, "run"),
                                          (Layer, "is_moe"), (MoELayer, "moe")])
def test_the_contract_check_fails_on_a_member_removed_from_a_part(model, proto, member):
    """The check reaches the model's parts: its shapes, its layers (each one), its MoE layers."""
    moe = next(model.moe_layers())
    part = {ModelShape: model.cfg, Layer: model.layers[0], MoELayer: moe}[proto]
    assert protocol_problems(Without(part, member), proto, "part") == [
        f"part.{member}: missing ({proto.__name__} has this {protocol_members(proto)[member]})"]
    if proto is Layer:  # through the model: its layers are checked one by one

        class Shallow:
            def __getattr__(self, name):
                return [Without(model.layers[0], member)] + list(model.layers[1:]) if name == "layers" else \
                    getattr(model, name)

        assert protocol_problems(Shallow(), MoEModel, "Model") == [
            f"Model.layers[0].{member}: missing (Layer has this {protocol_members(Layer)[member]})"]


def test_the_contract_check_sees_signatures_and_kinds(model):
    """Names alone pass ``isinstance``; an LM head that takes no hidden states, a norm with a required extra
    argument, or an embedding that is not a method do not pass the check."""

    class Off(type(model)):
        def logits(self):
            return None

        def norm(self, hidden, extra):
            return hidden

    off = build_model(TINY, seed=3)
    off.__class__ = Off
    assert all(hasattr(off, m) for m in protocol_members(MoEModel))  # every name is there: isinstance's check
    assert protocol_problems(off, MoEModel) == [
        "Off.logits: takes no positional parameter 1 (hidden)",
        "Off.norm: requires ['extra'], which the protocol does not pass"]
    off.__class__ = type(model)
    off.no_cut_reason = 3
    assert protocol_problems(off, MoEModel) == ["Model.no_cut_reason: an int, not str or NoneType"]


def test_the_forward_needs_only_its_part_of_the_contract(model):
    """`run_schedule` reads `ForwardModel` alone (embedding, final norm, whether a request can be cut): an
    object of those three runs the model's layers through a schedule."""
    from microbatch import run_schedule, serial, two_batch

    class Ends:
        no_cut_reason = None
        embed_tokens, norm = model.embed_tokens, model.norm

    assert protocol_problems(Ends(), ForwardModel) == [] and not isinstance(Ends(), MoEModel)
    batch = Batch.random([40, 24], TINY.vocab, seed=2)
    split = propose_split(batch.seq.seq_lens, min_tokens=4)
    with torch.no_grad():
        want = run_schedule(model, batch, split, model.layer_operations(), two_batch)
        got = run_schedule(Ends(), batch, split, model.layer_operations(), two_batch)
        assert torch.equal(got, want)
        torch.testing.assert_close(run_schedule(Ends(), batch, split.as_serial("one"), model.layer_operations(),
                                                serial), model(batch), **TOL)


@pytest.mark.parametrize("tied", [False, True])
def test_the_lm_head(tied):
    """Logits of the final hidden states: a head of its own drawn from the seed like every weight, or the
    embedding's weight with ``tie_embeddings``; the greedy token is their argmax."""
    cfg = dataclasses.replace(TINY, tie_embeddings=tied)
    model = build_model(cfg, seed=3)
    batch = Batch.random([5, 9], cfg.vocab, seed=1)
    hidden = model(batch)
    logits = model.logits(hidden)
    assert logits.shape == (batch.seq.num_tokens, cfg.vocab) and torch.isfinite(logits).all()
    head = model.embed.weight if tied else model.lm_head.weight
    torch.testing.assert_close(logits, hidden @ head.T, **TOL)
    assert (model.lm_head is None) == tied and ("lm_head.weight" in dict(model.named_parameters())) != tied
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    again = build_model(cfg, seed=3)
    assert torch.equal(again.logits(hidden), logits)  # from the seed: the same on every rank
    if not tied:
        assert not torch.equal(build_model(cfg, seed=4).logits(hidden), logits)
        assert not torch.equal(model.lm_head.weight, model.embed.weight)
    greedy = logits.argmax(-1)
    assert greedy.shape == (batch.seq.num_tokens,) and 0 <= int(greedy.min()) and int(greedy.max()) < cfg.vocab


def test_presets_and_parameter_count():
    for name, cfg in PRESETS.items():
        assert cfg.num_params() > 0, name
    for cfg in (TINY, preset("small", n_layers=2)):
        built = build_model(cfg, seed=0)
        assert sum(p.numel() for p in built.parameters()) == cfg.num_params()
    v3 = preset("deepseek-v3", n_layers=4)  # shapes only, never built here
    assert v3.n_layers == 4 and v3.hidden == PRESETS["deepseek-v3"].hidden
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("huge")
    with pytest.raises(ValueError, match="n_dense_layers"):
        dataclasses.replace(TINY, n_dense_layers=TINY.n_layers + 1)


def test_build_in_another_dtype():
    m = build_model(TINY, seed=3, dtype=torch.bfloat16)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    out = m(Batch.random([4, 3], TINY.vocab))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_building_and_sanitizing_in_a_fresh_process_leaves_dynamo_unloaded():
    """Every launcher, benchmark and documentation example is such a process: building the model on the meta
    device (nn.init.normal_ and to_empty there go through torch's Python decompositions) and the sanitizer's
    dispatch mode (torch wraps it in torch._disable_dynamo) each imported Dynamo, over a second of CPU a process."""
    code = ("import sys, torch, overlap\n"
            "from launch.models import build_model, preset\n"
            "with overlap.Sanitizer():\n"
            "    model = build_model(preset('tiny'), seed=3)\n"
            "    assert torch.isfinite(model.embed.weight).all() and model.embed.weight.device.type == 'cpu'\n"
            "loaded = [m for m in ('torch._dynamo', 'torch.fx.experimental.symbolic_shapes') if m in sys.modules]\n"
            "assert not loaded, loaded\n")
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_requests_do_not_see_each_other(model):
    gen = torch.Generator().manual_seed(0)
    requests = [torch.randint(0, TINY.vocab, (n,), generator=gen) for n in (7, 1, 12)]
    packed = model(Batch.pack(requests))
    alone = torch.cat([model(Batch.pack([r])) for r in requests])
    torch.testing.assert_close(packed, alone, **TOL)


def test_attention_is_causal(model):
    batch = Batch.random([10], TINY.vocab, seed=2)
    changed = batch.tokens.clone()
    changed[6] = (changed[6] + 1) % TINY.vocab
    a, b = model(batch), model(Batch(changed, batch.seq))
    torch.testing.assert_close(a[:6], b[:6], **TOL)
    assert not torch.allclose(a[6:], b[6:])


@pytest.mark.parametrize("lens,cut", [
    ([6, 3, 8, 5, 7, 4, 6, 5], False),   # many short requests: split at a request boundary
    ([41], True),                        # one long request: cut inside, mb1 attends to mb0's K/V
    ([3, 30, 2], True),                  # boundaries too unbalanced: cut inside the middle request
])
def test_micro_batches_match_the_whole_batch(model, lens, cut):
    split = propose_split(lens, min_tokens=4)
    assert not split.serial and (split.cut is not None) == cut
    batch = Batch.random(lens, TINY.vocab, seed=5)
    torch.testing.assert_close(model.forward_microbatches(batch, split), model(batch), **TOL)


def test_cut_request_needs_its_prefix(model):
    split = propose_split([41], min_tokens=4)
    b0, b1 = split_batch(Batch.random([41], TINY.vocab), split)
    hidden = model.embed_tokens(b1.tokens)
    with pytest.raises(ValueError, match="prefix"):
        model.layers[0].run(hidden, b1.seq, None)


def test_one_token_batch_runs_serially(model, caplog):
    from microbatch.planning.split import agree_split

    split = propose_split([1])
    with caplog.at_level("INFO", logger="microbatch.planning.split"):
        split = agree_split(split)
    assert split.serial and "1 token" in caplog.text
    batch = Batch.random([1], TINY.vocab, seed=5)
    assert torch.equal(model.forward_microbatches(batch, split), model(batch))


def test_operations_chain_from_inputs_to_outputs(model):
    for layer in model.layers:
        available = {HIDDEN, SEQ, PREFIX_KV}
        for op in layer.operations():
            assert set(op.reads) <= available, f"{op.name} reads {op.reads}, only {available} exist"
            available |= set(op.writes)
        assert {OUT, K, V} <= available


def test_kv_sink_gets_every_layer(model):
    batch = Batch.random([4, 6], TINY.vocab, seed=1)
    seen = collections.OrderedDict()
    model(batch, kv_sink=lambda i, k, v: seen.__setitem__(i, (k.shape, v.shape)))
    shape = torch.Size([10, TINY.n_heads, TINY.head_dim])
    assert list(seen) == list(range(TINY.n_layers)) and all(s == (shape, shape) for s in seen.values())


Stage = collections.namedtuple("Stage", "name fn reads writes stream")


class _StagedMoE(torch.nn.Module):
    """The dense MoE split into two stages, as the expert-parallel layer plugs in."""

    def __init__(self, dense):
        super().__init__()
        self.dense = dense
        self.calls = 0

    def _experts(self, x, routed):
        from collectives.reference import combine_dense

        self.calls += 1
        idx, weights = routed
        return combine_dense(x, idx, weights, self.dense.experts) + self.dense.shared_experts(x)

    def stages(self):
        return [Stage("route", self.dense.router, ("moe_in",), ("routed",), "default"),
                Stage("experts", self._experts, ("moe_in", "routed"), ("moe_out",), "default")]


def test_moe_with_stages_replaces_the_moe_operation(model):
    batch = Batch.random([5, 7, 9], TINY.vocab, seed=6)
    expected = model(batch)
    staged = build_model(TINY, seed=3)
    staged.replace_moe(lambda layer: _StagedMoE(layer.moe))
    layer = next(staged.moe_layers())
    assert [op.name for op in layer.operations()] == ["attn", "ffn_norm", "route", "experts", "residual"]
    torch.testing.assert_close(staged(batch), expected, rtol=0, atol=0)
    assert all(layer.moe.calls == 1 for layer in staged.moe_layers())


def test_layer_operations_run_by_hand_match_run(model):
    layer = model.layers[-1]
    seq = SeqInfo.from_lens([3, 5])
    hidden = torch.randn(8, TINY.hidden, generator=torch.Generator().manual_seed(0))
    state = State(hidden=hidden, seq=seq, prefix_kv=None)
    for op in layer.operations():
        op.run(state)
    out, k, v = layer.run(hidden, seq)
    assert torch.equal(state["out"], out) and torch.equal(state["k"], k) and torch.equal(state["v"], v)


def _ep_body(ctx, per_rank_lens):
    from collectives import wrap_expert_parallel
    from microbatch.planning.split import decide_split

    lens = per_rank_lens[ctx.rank]
    batch = Batch.random(lens, TINY.vocab, seed=10 + ctx.rank)
    dense = build_model(TINY, seed=3)
    expected = dense(batch)
    ep = build_model(TINY, seed=3)
    ep.replace_moe(lambda layer: wrap_expert_parallel(layer.moe, ctx.group))
    assert "dispatch" in [op.name for op in next(ep.moe_layers()).operations()]
    serial = ep(batch)
    split = decide_split(lens, ctx.group, min_tokens=4)
    per_micro_batch = ep.forward_microbatches(batch, split)
    return expected, serial, per_micro_batch, split.serial


def test_expert_parallel_moe_plugs_in():
    """The EP layer's stages, run serially and per micro-batch on 2 ranks, give the dense result."""
    results = run_ranks(_ep_body, 2, [[9, 4, 11], [30]], timeout=90)
    for expected, serial, per_micro_batch, was_serial in results:
        assert not was_serial
        torch.testing.assert_close(serial, expected, **TOL)
        torch.testing.assert_close(per_micro_batch, expected, **TOL)


@pytest.mark.parametrize("lens", [[41], [6, 3, 8, 5, 7, 4, 6, 5], [1]])
def test_pipeline_executor_runs_the_layers(model, lens):
    """The layers' operations under the two-batch schedule give the whole-batch result."""
    from microbatch.forward import run_schedule
    from microbatch import serial, two_batch

    split = propose_split(lens, min_tokens=4)
    batch = Batch.random(lens, TINY.vocab, seed=5)
    with torch.no_grad():
        got = run_schedule(model, batch, split, model.layer_operations(), serial if split.serial else two_batch)
    torch.testing.assert_close(got, model(batch), **TOL)
