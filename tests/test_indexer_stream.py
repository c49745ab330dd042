"""DeepSeek sparse attention with its indexer on a stream of its own (`launch.models.transformers.indexed.IndexedLayer`,
the guide's Indexer Prolog): the layer's attention as ``attn_q``, ``indexer`` (on `overlap.INDEXER`), ``attn_kv`` and
``attn_sparse``, equal to the family's own forward and ``generate`` (float32) in every mode, with no race, a cut
request equal to the uncut one, its cache rows in the family's layout (latent; rotary key and indexer key), the
indexer's span beside the main branch's on the CPU timeline, and the switch that puts the family's module back.
"""
import pytest
import torch

import overlap
from launch.engine import greedy_generate, make_expert_parallel, new_cache, prefill, split_for
from launch.models.transformers.indexed import IndexedLayer
from microbatch import MODES
from microbatch.batch import Batch, SeqInfo
from overlap.multirank import run_ranks

transformers = pytest.importorskip("transformers")
from launch.models import build_transformers_model  # noqa: E402

pytestmark = pytest.mark.cpu_only

DSA = ("deepseek_v32", "glm_moe_dsa")
SEED = 7
TOPK = 4  # the small configs' index_topk: the requests below are longer, so the indexer really selects
TOL = dict(rtol=1e-4, atol=1e-4)
SPLIT = dict(min_tokens=4, max_imbalance=0.2)
NEW = 5


def _diff(a, b):
    return (a - b).abs().max().item()


def _close(got, want):
    return _diff(got, want) <= TOL["atol"] + TOL["rtol"] * want.abs().max().item()


def _prompts(vocab, lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _attention_ops(model):
    return [(op.name, op.stream) for op in model.layers[0].operations()][:4]


@pytest.mark.parametrize("on", [True, False], ids=["indexer-stream", "one-operation"])
@pytest.mark.parametrize("family", DSA)
def test_every_mode_equals_the_familys_own_forward_without_a_race(family, on):
    model = build_transformers_model(family, seed=SEED, indexer_stream=on)
    assert model.indexer_stream is on and model.hf.config.index_topk == TOPK
    assert all(isinstance(layer, IndexedLayer) for layer in model.layers)
    if on:
        assert _attention_ops(model) == [("attn_q", "default"), ("indexer", overlap.INDEXER),
                                         ("attn_kv", "default"), ("attn_sparse", "default")]
    else:
        assert _attention_ops(model)[0] == ("attn", "default")
    batch = Batch.random([6, 5, 7, 6], model.cfg.vocab, seed=100)
    ref = model.reference(batch)
    make_expert_parallel(model, None)
    for mode in MODES:
        split = split_for(mode, batch, None, model=model, **SPLIT)
        cache = overlap.OffloadCache(model.cfg.n_layers, batch.seq.num_tokens, model.cfg.k_shape,
                                     v_shape=model.cfg.v_shape)
        with overlap.Sanitizer(raise_on_race=False) as san:
            got = prefill(model, batch, mode, split, cache)
            overlap.synchronize()
        cache.close()
        assert _close(got, ref), (mode, _diff(got, ref))
        assert not san.races, (mode, [str(r) for r in san.races])


@pytest.mark.parametrize("family", DSA)
def test_the_cache_rows_are_the_familys_latent_rotary_key_and_indexer_key(family):
    """K: the family's cached latent; V: its rotary key, then the indexer's key (after k_norm and its rotary)."""
    model = build_transformers_model(family, seed=SEED)
    tokens = torch.tensor(_prompts(model.cfg.vocab, (9,))[0])
    assert model.cfg.k_shape == (1, model.hf.config.kv_lora_rank)
    assert model.cfg.v_shape == (1, model.hf.config.qk_rope_head_dim + model.hf.config.index_head_dim)
    got = {}
    model(Batch(tokens, SeqInfo.from_lens([9])), kv_sink=lambda i, k, v: got.setdefault(i, (k, v)))
    with torch.no_grad():
        own = model.hf.model(tokens[None], use_cache=True)
    cache = getattr(own, "cache", None) or own.past_key_values
    for i, (k, v) in got.items():
        held = cache.layers[i]
        want_v = torch.cat([held.values[0, 0], held.indexer_keys[0]], dim=-1)
        torch.testing.assert_close(k[:, 0], held.keys[0, 0], **TOL)
        torch.testing.assert_close(v[:, 0], want_v, **TOL)


@pytest.mark.parametrize("family", DSA)
def test_a_cut_request_equals_the_uncut_one(family):
    """A request cut across micro-batches: its later part reads the earlier part's latent, rotary and indexer keys
    (``PREFIX_KV``) and gives the uncut outputs, keys and values; two-batch cuts it and equals the family.

    8 indexer heads: with 2, many keys score exactly 0 (every head's relu), and the top-k among tied scores falls
    by how many keys torch's topk sees (the family's call sees the whole request, the cut's first part its own
    tokens); both selections are valid, but only one is the family's (docs/model.md)."""
    model = build_transformers_model(family, seed=SEED, index_n_heads=8)
    assert model.no_cut_reason is None
    layer = model.layers[0]
    batch = Batch.random([11, 7], model.cfg.vocab, seed=3)
    hidden = model.embed_tokens(batch.tokens)
    out, k, v = layer.run(hidden, batch.seq)
    cut, ck, cv = layer.run(hidden[5:], SeqInfo((6, 7), (5, 0)), (k[:5], v[:5]))
    assert _close(cut, out[5:]) and _close(cv, v[5:]) and _close(ck, k[5:])
    batch = Batch.random([3, 19, 2], model.cfg.vocab, seed=2)  # every boundary far off: a cut fits
    ref = model.reference(batch)
    make_expert_parallel(model, None)
    split = split_for("two-batch", batch, None, model=model, **SPLIT)
    assert split.cut is not None, split.reason
    with overlap.Sanitizer(raise_on_race=False) as san:
        got = prefill(model, batch, "two-batch", split)
        overlap.synchronize()
    assert _close(got, ref) and not san.races


@pytest.mark.parametrize("family", DSA)
def test_decode_equals_the_familys_own_generate_in_every_mode(family):
    """Prompts longer than the top-k, of different lengths (padded histories): the tokens of the family's own
    ``generate(do_sample=False)``, serial with the family's blocks and every mode expert-parallel on one rank, with
    no race; the cache on the host (``--kv-offload``) too."""
    model = build_transformers_model(family, seed=SEED)
    ops = model.decode_layer_operations()[0]
    assert [(op.name, op.stream) for op in ops][:4] == [("attn_q", "default"), ("indexer", overlap.INDEXER),
                                                         ("attn_kv", "default"), ("attn_sparse", "default")]
    prompts = _prompts(model.cfg.vocab, (7, 3, 10))
    want = model.own_generate(prompts, NEW)
    assert greedy_generate(model, prompts, NEW) == want
    make_expert_parallel(model, None)
    for mode in MODES:
        with overlap.Sanitizer(raise_on_race=False) as san:
            assert greedy_generate(model, prompts, NEW, mode=mode) == want, mode
        assert not san.races, (mode, [str(r) for r in san.races])
    offloaded = new_cache(model, prompts, NEW, offload=True)  # the host cache brings the indexer keys back too
    assert greedy_generate(model, prompts, NEW, cache=offloaded, mode="two-batch") == want


def test_with_the_switch_off_the_layer_is_the_familys_module_in_the_same_cache_layout():
    """``indexer_stream`` off: the family's module as one operation (prefill and decode), its cache rows the same, so
    the switch can change between a prefill and the decode that reads its cache."""
    model = build_transformers_model("deepseek_v32", seed=SEED, indexer_stream=False)
    assert [op.name for op in model.layers[0].operations()][0] == "attn"
    assert [op.name for op in model.decode_layer_operations()[0]][0] == "attn"
    batch = Batch.random([9, 6], model.cfg.vocab, seed=4)
    family = {}
    model(batch, kv_sink=lambda i, k, v: family.setdefault(i, (k, v)))
    model.indexer_stream = True
    assert [op.name for op in model.layers[0].operations()][1] == "indexer"
    ours = {}
    model(batch, kv_sink=lambda i, k, v: ours.setdefault(i, (k, v)))
    for i, (k, v) in ours.items():
        assert _close(k, family[i][0]) and _close(v, family[i][1]), i


def test_the_indexer_runs_beside_the_main_branch_on_the_timeline():
    """In ``shared`` mode on the CPU the indexer's work (its stream's worker thread) and ``attn_kv`` (the main
    stream) intersect: over a few repetitions, at least once (no time is asserted, only recorded spans)."""
    model = build_transformers_model("deepseek_v32", seed=SEED, overrides=dict(n_layers=1))
    batch = Batch.random([48, 40], model.cfg.vocab, seed=1)
    make_expert_parallel(model, None)
    split = split_for("shared", batch, None, model=model)
    for _ in range(6):
        with overlap.Timeline() as tl:
            prefill(model, batch, "shared", split)
            overlap.synchronize()
        side = tl.find(stream=overlap.INDEXER, layer=0)
        (main,) = tl.find(name="attn_kv", stream="default", layer=0)
        assert side and all(s.kind == "compute" for s in side)
        if any(overlap.observability.intersects(s, main) for s in side):
            return
    pytest.fail("the indexer's spans never intersected attn_kv's")


def _attention_graph(path):
    """The captured graph (torchair's own code from the wheel, tests/tools/torchair_contract.py) of one layer's
    attention operations in ``shared`` mode."""
    from microbatch import run, shared
    from tools import torchair_contract as tc

    tc.load_torchair()
    model = build_transformers_model("deepseek_v32", seed=SEED, overrides=dict(n_layers=1))
    ops = model.layers[0].operations()[:4]
    schedule, seq = shared([ops], 1), SeqInfo.from_lens([6, 5])

    def fn(hidden):
        return run(schedule, [ops], [{"hidden": hidden, "seq": seq, "prefix_kv": None}], output="resid")
    return tc, tc.capture_graph(fn, torch.randn(11, model.cfg.hidden), path=path)


@pytest.mark.parametrize("path", ["ge", "aclgraph"])
def test_the_graphs_carry_the_indexers_scope_and_the_wait_before_the_sparse_attention(path):
    tc, gm = _attention_graph(path)
    streams, at = tc.stream_of(gm), {n: i for i, n in enumerate(gm.graph.nodes)}
    labels = [tc.scope_attrs(n).get("_user_stream_label") for n in tc.nodes(gm, "scope_enter")]
    assert labels == [overlap.INDEXER], tc.ops_in_order(gm, air_only=True)
    tops = tc.node_by_target(gm, "topk")  # one per request
    assert len(tops) == 2 and {streams[n.name] for n in tops} == {overlap.INDEXER}
    reads = tc.cross_stream_reads(gm)
    assert {(streams[w.name], streams[r.name]) for w, r in reads} == {("default", overlap.INDEXER),
                                                                      (overlap.INDEXER, "default")}
    assert tc.unordered_reads(gm, path) == [] and tc.discarded_waits(gm) == []
    if path == "aclgraph":  # the join: the main stream waits for the indexer's event before reading its outputs
        (wait,) = [n for n in tc.nodes(gm, "tagged_event_wait") if n.args[0].endswith(f"@{overlap.INDEXER}")]
        assert streams[wait.name] == "default"
        assert all(at[wait] < at[r] for w, r in reads if streams[w.name] == overlap.INDEXER)


def test_the_npu_operators_it_names_are_the_wheels_with_those_arguments():
    from tools import npu_schema as ns
    from tools import torchair_contract as tc

    from launch.models.transformers.indexed import NPU_OPERATORS

    wheel = ns.Wheel(tc.wheel_path())
    try:
        for name, args in NPU_OPERATORS.items():
            (schema,) = wheel.ops["npu"][name].values()
            assert set(args) <= {p.name for p in schema.params}, (name, schema.origin)
    finally:
        wheel.close()


def _two_ranks(ctx):
    out = {}
    for family in DSA:
        model = build_transformers_model(family, seed=SEED)
        prompts = _prompts(model.cfg.vocab, (7, 3 + 4 * ctx.rank), seed=1 + ctx.rank)
        want = model.own_generate(prompts, NEW)
        make_expert_parallel(model, ctx.group)
        out[family] = {mode: greedy_generate(model, prompts, NEW, mode=mode) == want
                       for mode in ("serial", "two-batch")}
    return out


@pytest.mark.spawns_ranks
def test_decode_on_two_ranks_equals_the_familys_own_generate():
    for rank, runs in enumerate(run_ranks(_two_ranks, 2, timeout=240)):
        assert all(ok for family in runs.values() for ok in family.values()), (rank, runs)


def test_the_launcher_switch_reaches_the_job_its_agreement_and_the_model():
    from launch.agreement import fingerprint
    from launch.build import build_model
    from launch.config import job_config

    common = dict(world=1, device="cpu", exec_path="auto", mode="serial", kv_offload=False, kv_store="memory",
                  preset_name="tiny", overrides={}, batch=2, seq_len=8, seq_lens=None, dtype="float32", warmup=0,
                  iters=1, seed=0, check=False, out_dir=None, cpu_link="off", timeout=30.0, model_name="deepseek_v32")
    on, off = job_config(**common), job_config(**common, indexer_stream=False)
    assert (on.indexer_stream, off.indexer_stream) == (True, False)
    assert (fingerprint(on)["--indexer-stream"], fingerprint(off)["--indexer-stream"]) == (True, False)
    for job in (on, off):
        model, _ = build_model(job, 0, 1, torch.device("cpu"))
        assert model.indexer_stream is job.indexer_stream
        assert [op.name for op in model.layers[0].operations()][1] == ("indexer" if job.indexer_stream else "ffn_norm")


@pytest.mark.spawns_ranks
def test_the_launcher_checks_a_sparse_attention_model_with_the_indexer_on_its_stream():
    from support.launcher import run_launcher

    proc = run_launcher(["--warmup", "0", "--iters", "1", "--seq-lens", "9,6", "--model", "deepseek_v32", "--check",
                         "--mode", "shared,two-batch", "--indexer-stream"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "check: serial matches deepseek_v32's own forward" in proc.stdout
    assert "check: every mode matches serial" in proc.stdout


def test_a_sparse_attention_module_of_other_parts_stays_the_familys_module():
    """axk2's attention has no ``q_b_proj``, dots3's rotary takes the layer type: their layers stay the family's
    module, one operation (prefill only), as before."""
    from launch.models.transformers.indexed import not_as_operations
    from launch.models.transformers.layers import TransformersLayer

    axk2 = build_transformers_model("axk2", seed=SEED)
    layer = axk2.layers[0]
    assert type(layer) is TransformersLayer and layer.kind == "indexed_attention"
    assert "q_b_proj" in not_as_operations(layer.attns[0].module, axk2.hf.model.rotary_emb)
    assert [op.name for op in layer.operations()][0] == "attn"
