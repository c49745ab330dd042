"""DeepSeek sparse attention (DSA: `deepseek_v32`, `glm_moe_dsa`): the family's own attention module, its indexer
selecting ``index_topk`` keys per query, through every schedule on one rank and on two (expert parallel), equal to
the family's own forward (float32) in prefill, a cut request included, and to its own ``generate`` in decode, the
cache on the device or on the host. The cache holds per token the latent (K) and the rotary key beside the
indexer's key (V: `pack_indexed`), the model's own three.
"""
import pytest
import torch

import overlap
from launch.engine import greedy_generate, make_expert_parallel, new_cache, prefill, split_for
from microbatch import MODES
from microbatch.batch import Batch, SeqInfo
from overlap.multirank import run_ranks

transformers = pytest.importorskip("transformers")
from launch.models import build_transformers_model  # noqa: E402

pytestmark = pytest.mark.cpu_only

DSA = ("deepseek_v32", "glm_moe_dsa")
SEED = 7
TOPK = 4  # the small configs' index_topk (launch/models/transformers/families.py): every request below is longer
SPLIT = dict(min_tokens=4, max_imbalance=0.2)
TOL = dict(rtol=1e-4, atol=1e-4)


def _lens(rank):
    return [6, 5 + rank, 7, 6]  # the best boundary within 20%: two-batch splits between requests


def _diff(a, b):
    return (a - b).abs().max().item()


def _every_mode(model, batch, group, ref):
    """Per mode: (the largest difference from ``ref``, ``ref``'s magnitude, the races the sanitizer saw, the
    split)."""
    cfg, out = model.cfg, {}
    for mode in MODES:
        split = split_for(mode, batch, group, model=model, **SPLIT)
        cache = overlap.OffloadCache(cfg.n_layers, batch.seq.num_tokens, cfg.k_shape, v_shape=cfg.v_shape)
        with overlap.Sanitizer(raise_on_race=False) as san:
            got = prefill(model, batch, mode, split, cache)
            overlap.synchronize()
        cache.close()
        out[mode] = (_diff(got, ref), ref.abs().max().item(), [str(r) for r in san.races], split)
    return out


def _check_modes(runs, where):
    for mode, (diff, scale, races, _) in runs.items():
        assert diff <= TOL["atol"] + TOL["rtol"] * scale, (where, mode, diff)
        assert not races, (where, mode, races)


@pytest.mark.parametrize("family", DSA)
def test_every_mode_on_one_rank_equals_the_models_own_forward(family):
    model = build_transformers_model(family, seed=SEED)
    assert model.hf.config.index_topk == TOPK
    batch = Batch.random(_lens(0), model.cfg.vocab, seed=100)
    ref = model.reference(batch)
    make_expert_parallel(model, None)
    _check_modes(_every_mode(model, batch, None, ref), family)


@pytest.mark.parametrize("family", DSA)
def test_the_indexer_really_selects_a_requests_top_k_keys(family):
    """A request longer than ``index_topk`` attends to other keys with a larger top-k: the sparse path runs, not the
    dense fallback; with either, the adapter equals the family's own forward."""
    batch = Batch.random([9, 3], 128, seed=1)
    sparse, dense = (build_transformers_model(family, seed=SEED, index_topk=k) for k in (TOPK, 64))
    got_sparse, got_dense = sparse(batch), dense(batch)
    assert _diff(got_sparse, sparse.reference(batch)) <= 1e-4 and _diff(got_dense, dense.reference(batch)) <= 1e-4
    short = slice(9, 12)  # the 3-token request: never more keys than the top-k, the same either way
    assert _diff(got_sparse[short], got_dense[short]) <= 1e-5
    assert _diff(got_sparse[:9], got_dense[:9]) > 1e-2


NEW = 6


def _prompts(vocab, lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _check_cache_holds_the_models_own_three(model, cache, prompts, out):
    """Each request's rows (slot i: request i) are the model's own latent, rotary key and indexer key of its prompt
    and generated tokens (the last one is never fed back)."""
    rotary = model.hf.config.qk_rope_head_dim
    for slot, (prompt, tokens) in enumerate(zip(prompts, out)):
        seq = prompt + tokens[:-1]
        own = model.reference_kv(Batch(torch.tensor(seq), SeqInfo.from_lens([len(seq)])))
        for layer, (k, v) in own.items():
            assert v.shape[-1] == rotary + model.hf.config.index_head_dim
            torch.testing.assert_close(cache.k[layer, slot, :len(seq)], k, **TOL)
            torch.testing.assert_close(cache.v[layer, slot, :len(seq)], v, **TOL)


@pytest.mark.parametrize("family", DSA)
def test_decode_equals_the_familys_own_generate_with_the_indexer_keys_in_the_cache(family):
    """Prompts of 3, 9 and 6 tokens (longer and shorter than the top-k of 4; a step pads them to the longest): serial
    decode gives the model's own ``generate``'s tokens and its cache holds the model's own three per token; with
    its MoE expert-parallel (one rank) every mode gives them; the cache on the host (prefetched) too."""
    model = build_transformers_model(family, seed=SEED)
    prompts = _prompts(model.cfg.vocab, (3, 9, 6))
    want = model.own_generate(prompts, NEW)
    cache = new_cache(model, prompts, NEW)
    assert greedy_generate(model, prompts, NEW, cache=cache) == want
    _check_cache_holds_the_models_own_three(model, cache, prompts, want)
    make_expert_parallel(model, None)
    for mode in MODES:
        with overlap.Sanitizer():  # raises on the first race between streams
            assert greedy_generate(model, prompts, NEW, mode=mode) == want, mode
    for mode in ("serial", "two-batch"):
        with new_cache(model, prompts, NEW, offload=True) as host, overlap.Sanitizer():
            assert greedy_generate(model, prompts, NEW, mode=mode, cache=host) == want, mode


@pytest.mark.parametrize("family", DSA)
def test_a_request_cut_across_micro_batches_equals_the_models_own_forward(family):
    """Every boundary far off, so the two-batch split cuts the 19-token request: its second part continues from the
    first's latent, rotary keys and indexer keys; the output is the family's own forward's."""
    model = build_transformers_model(family, seed=SEED)
    assert model.no_cut_reason is None
    batch = Batch.random([3, 19, 2], model.cfg.vocab, seed=2)
    split = split_for("two-batch", batch, None, model=model, **SPLIT)
    assert split.cut is not None, split.reason
    ref = model.reference(batch)
    cfg = model.cfg
    cache = overlap.OffloadCache(cfg.n_layers, batch.seq.num_tokens, cfg.k_shape, v_shape=cfg.v_shape)
    with overlap.Sanitizer():
        got = prefill(model, batch, "two-batch", split, cache)
        overlap.synchronize()
    cache.close()
    assert _diff(got, ref) <= TOL["atol"] + TOL["rtol"] * ref.abs().max().item()


def test_a_glm_layer_that_reuses_an_earlier_layers_top_k_is_refused_in_one_line():
    with pytest.raises(TypeError, match=r"^layer 1 \(GlmMoeDsaAttention\) reuses an earlier layer's top-k "
                                        r"selection \(indexer_types 'shared'\)") as err:
        build_transformers_model("glm_moe_dsa", indexer_types=["full", "shared"])
    assert "\n" not in str(err.value)


def _two_ranks(ctx):
    out = {}
    for family in DSA:
        model = build_transformers_model(family, seed=SEED)
        batch = Batch.random(_lens(ctx.rank), model.cfg.vocab, seed=100 + ctx.rank)
        ref = model.reference(batch)
        prompts = _prompts(model.cfg.vocab, (3, 9, 6)[:2 + ctx.rank], seed=20 + ctx.rank)
        want = model.own_generate(prompts, NEW)
        make_expert_parallel(model, ctx.group)
        decoded = {mode: greedy_generate(model, prompts, NEW, mode=mode) == want for mode in ("serial", "two-batch")}
        out[family] = _every_mode(model, batch, ctx.group, ref), decoded
    return out


def test_every_mode_on_two_ranks_equals_the_models_own_forward_and_generate():
    """Experts over two ranks: prefill in every mode equals the family's forward; decode (2 and 3 requests, one rank
    done first) its ``generate``."""
    for rank, runs in enumerate(run_ranks(_two_ranks, 2, timeout=240)):
        for family in DSA:
            prefilled, decoded = runs[family]
            _check_modes(prefilled, f"{family}, rank {rank}")
            assert not prefilled["two-batch"][3].serial  # split at a request boundary
            assert decoded == {"serial": True, "two-batch": True}, (family, rank)
