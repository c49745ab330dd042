"""DeepSeek sparse attention (DSA: `deepseek_v32`, `glm_moe_dsa`) in prefill: the family's own attention module, its
indexer selecting ``index_topk`` keys per query, through every schedule on one rank and on two (expert parallel),
equal to the family's own forward (float32). Decode and cut requests are refused in one line: the adapter's
keys and values hold the latent and the rotary key, not the indexer's keys the top-k selection reads.
"""
import pytest
import torch

import overlap
from launch.engine import make_expert_parallel, prefill, split_for
from microbatch import MODES
from microbatch.batch import Batch
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


@pytest.mark.parametrize("family", DSA)
def test_a_request_is_not_cut_and_decode_is_refused_naming_the_indexer_keys(family):
    model = build_transformers_model(family, seed=SEED)
    assert "indexed_attention" in model.no_cut_reason and "indexer's keys" in model.no_cut_reason
    batch = Batch.random([3, 19, 2], model.cfg.vocab, seed=2)  # every boundary far off: a cut is what would fit
    split = split_for("two-batch", batch, None, model=model, **SPLIT)
    assert split.cut is None and model.no_cut_reason in split.reason
    with pytest.raises(ValueError, match=f"^{family}: layer 0: it is indexed_attention: its top-k selection reads "
                                         f"the indexer keys of every earlier token, which the KV cache does not "
                                         f"hold") as err:
        model.decode_layer_operations()
    assert "\n" not in str(err.value)
    attn = model.layers[0].attns[0]
    x = torch.zeros(2, model.cfg.hidden)
    with pytest.raises(ValueError, match="^layer 0 is indexed_attention: continuing a request after 3 prefix tokens "
                                         "needs their indexer keys"):
        attn.attend(x, 3, (torch.zeros(3, *attn.k_shape), torch.zeros(3, *attn.v_shape)))


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
        make_expert_parallel(model, ctx.group)
        out[family] = _every_mode(model, batch, ctx.group, ref)
    return out


def test_every_mode_on_two_ranks_equals_the_models_own_forward():
    for rank, runs in enumerate(run_ranks(_two_ranks, 2, timeout=240)):
        for family in DSA:
            _check_modes(runs[family], f"{family}, rank {rank}")
            assert not runs[family]["two-batch"][3].serial  # split at a request boundary
