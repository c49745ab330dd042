"""transformers MoE families decode through `launch.engine.greedy_generate` with their own attention modules and
cache layouts, and generate the tokens of their own ``generate(do_sample=False)``.

Each family's small float32 model (`launch.models.build_transformers_model`): prompts of different lengths, a
stop token that ends one request early, serial with the family's own MoE blocks and every mode's schedule with
their expert-parallel form on one rank, the keys and values the decode writes against the model's own cache, the
families with sliding-window and chunked attention past their window, DeepSeek-V3's latent cache, LongCat-Flash's
two attentions per layer (the second under the MoE's dispatch, as in prefill), the layers a decode refuses, and
experts over two ranks (one of them with no prompt; LongCat-Flash too); the generation launcher on LongCat-Flash.
"""
import pytest
import torch

from launch.engine import greedy_generate, new_cache
from launch.engine import make_expert_parallel
from microbatch import MODES, Batch, DecodeModel, SeqInfo
from overlap import Sanitizer
from support.protocols import protocol_problems

transformers = pytest.importorskip("transformers")
from launch.models import build_transformers_model  # noqa: E402

pytestmark = pytest.mark.cpu_only

FAMILIES = ("deepseek_v3", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "longcat_flash")
SEED = 7
NEW = 6


def _prompts(vocab, lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _check_cache_holds_the_models_own_kv(model, cache, prompts, out):
    """Every request's rows in ``cache`` (slots 0, 1, ... in order) are the model's own keys and values of its
    prompt and generated tokens (the last one is never fed back)."""
    for slot, (prompt, tokens) in enumerate(zip(prompts, out)):
        seq = prompt + tokens[:-1]
        own = model.reference_kv(Batch(torch.tensor(seq), SeqInfo.from_lens([len(seq)])))
        for layer, (k, v) in own.items():
            torch.testing.assert_close(cache.k[layer, slot, :len(seq)], k, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(cache.v[layer, slot, :len(seq)], v, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decode_equals_the_familys_own_generate(family):
    """Serial decode's tokens are the model's own ``generate``'s, with and without a stop token; its cache holds
    the model's own keys and values; with the MoE blocks expert-parallel (on one rank), every mode gives serial's
    tokens (three requests in four micro-batches: one is empty; then two in four)."""
    model = build_transformers_model(family, seed=SEED)
    assert protocol_problems(model, DecodeModel) == []
    prompts = _prompts(model.cfg.vocab, (3, 7, 5))
    want = model.own_generate(prompts, NEW)
    cache = new_cache(model, prompts, NEW)
    assert greedy_generate(model, prompts, NEW, cache=cache) == want
    _check_cache_holds_the_models_own_kv(model, cache, prompts, want)
    stop = want[0][2]
    want_stop = model.own_generate(prompts, NEW, stop_token=stop)
    assert len(want_stop[0]) == 3 and max(map(len, want_stop)) == NEW  # one request stops, another goes on
    assert greedy_generate(model, prompts, NEW, stop_token=stop) == want_stop
    make_expert_parallel(model, None)
    for mode in MODES:
        assert greedy_generate(model, prompts, NEW, stop_token=stop, mode=mode) == want_stop, mode


@pytest.mark.parametrize("family, part", [("gpt_oss", "window"), ("llama4_text", "chunk")])
def test_sliding_window_and_chunked_layers_decode_past_their_span(family, part):
    """gpt-oss (layers alternate a sliding window of 8 and full attention) and Llama 4 (chunks of 8): requests
    longer than 8 tokens generate the tokens of the model's own ``generate``, whose cache keeps the window."""
    model = build_transformers_model(family, seed=SEED)
    assert {getattr(layer.attns[0], part) for layer in model.layers} >= {8}
    prompts = _prompts(model.cfg.vocab, (9, 4, 12), seed=2)
    want = model.own_generate(prompts, NEW)
    for mode in ("serial", "two-batch"):
        assert greedy_generate(model, prompts, NEW, mode=mode) == want, mode


@pytest.mark.parametrize("family, fields", [
    ("cohere2_moe", {}), ("flex_olmo", {}),
    ("granitemoe", dict(residual_multiplier=0.5, embedding_multiplier=2.0, logits_scaling=3.0)),
])
def test_parallel_sandwich_and_scaled_layers_decode_the_models_own_tokens(family, fields):
    """Cohere 2's parallel layers (the FFN reads the attention's input), FlexOlmo's norms of each branch's output,
    Granite's multipliers: the decode step's attention and what follows it are the layer's own."""
    model = build_transformers_model(family, seed=SEED, **fields)
    layer = model.layers[0]
    assert {"cohere2_moe": layer.parallel, "flex_olmo": layer._sandwich,
            "granitemoe": layer.residual_scale != 1.0}[family]
    prompts = _prompts(model.cfg.vocab, (3, 7, 5), seed=5)
    assert greedy_generate(model, prompts, NEW) == model.own_generate(prompts, NEW)


def test_the_decode_mask_lets_each_request_see_its_own_rows_and_new_row():
    """Requests holding 3 and 1 rows, a history padded to 3 rows, then the new row: the padding is masked, and a
    window of 2 / a chunk of 2 positions leave request 0 (its new token at position 3) position 2 and itself."""
    from launch.models.transformers import decode_mask

    def seen(**span):
        return (decode_mask(torch.tensor([3, 1]), 3, span.get("window"), torch.float32, span.get("chunk"))
                == 0).squeeze(1).squeeze(1).int().tolist()

    assert seen() == [[1, 1, 1, 1], [1, 0, 0, 1]]
    assert seen(window=2) == [[0, 0, 1, 1], [1, 0, 0, 1]]
    assert seen(chunk=2) == [[0, 0, 1, 1], [1, 0, 0, 1]]


def test_deepseek_v3_caches_its_compressed_latent_and_rotary_key():
    """The KV cache holds what DeepSeek-V3's attention caches: the latent (1, kv_lora_rank) as keys and the rotary
    key (1, qk_rope_head_dim) as values, not the expanded per-head keys and values."""
    model = build_transformers_model("deepseek_v3", seed=SEED)
    c = model.hf.config
    prompts = _prompts(model.cfg.vocab, (4, 2), seed=3)
    cache = new_cache(model, prompts, NEW)
    assert cache.k.shape[-2:] == (1, c.kv_lora_rank) and cache.v.shape[-2:] == (1, c.qk_rope_head_dim)
    out = greedy_generate(model, prompts, NEW, cache=cache)
    assert out == model.own_generate(prompts, NEW)
    _check_cache_holds_the_models_own_kv(model, cache, prompts, out)


@pytest.mark.parametrize("family, fields, says", [
    ("qwen3_next", {}, "qwen3_next: layer 0 is linear_attention: it keeps a state between tokens, not keys and "
                       "values a KV cache holds"),
    ("mimo_v2_flash", {}, "mimo_v2_flash: layer 1 caches keys / values of .*: one KV cache holds one shape"),
    ("llama4_text", dict(no_rope_layers=[1, 0]), "llama4_text: layer 1: its attention scales queries by one position "
                                                 "for the whole batch"),
])
def test_layers_a_decode_cannot_run_are_refused_in_one_line(family, fields, says):
    """A hybrid's linear attention, layers caching different shapes
    (MiMo-V2-Flash's sliding layers have more key heads), Llama 4's layers without rotary embeddings (their
    query scale follows one position for the whole batch): a ValueError of one line before any decode step."""
    from launch.generate import _decode_refusal

    model = build_transformers_model(family, seed=SEED, **fields)
    with pytest.raises(ValueError, match=says) as err:
        model.decode_layer_operations()
    assert "\n" not in str(err.value)
    assert _decode_refusal(model) == f"TransformersModel cannot decode: {err.value}"  # the launcher's line
    # MiMo's: its prefill's keys do not fit the cache, `launch.engine.generate` prefills first
    with pytest.raises(ValueError):
        greedy_generate(model, [[1, 2, 3]], 2)


def test_longcat_flash_decodes_its_second_attention_under_the_moe_exchange_over_its_half_of_the_cache():
    """As in prefill: the first MLP and the second attention after the dispatch, the second MLP after the combine;
    the cache holds both attentions' latents side by side (2, kv_lora_rank), each attention reading its own half and
    the second writing both (the cache against the model's own: `test_greedy_decode_equals_the_familys_own_generate`).
    (Before: ``longcat_flash: layer 0 attends twice``, a ValueError.)"""
    model = build_transformers_model("longcat_flash", seed=SEED)
    c = model.hf.config
    assert model.cfg.k_shape == (2, c.kv_lora_rank) and model.cfg.v_shape == (2, c.qk_rope_head_dim)
    serial = [op.name for op in model.decode_layer_operations()[0]]
    assert serial == ["attn", "ffn_norm", "moe", "dense0", "attn1", "dense1", "residual"]
    make_expert_parallel(model, None)
    for chunks in (1, 2):  # the routed experts in chunks: every chunk's dispatch first, then each one's combine
        names = [op.name for op in model.decode_layer_operations(chunks)[0]]
        assert names[:2] == ["attn", "ffn_norm"] and names[-1] == "residual", names
        dispatched = max(i for i, name in enumerate(names) if name.startswith("dispatch"))
        combine = min(i for i, name in enumerate(names) if name.startswith("combine"))
        assert dispatched + 1 == names.index("dense0") < names.index("attn1") < combine < names.index("dense1"), \
            names
        assert names[names.index("attn1") + 1].startswith("experts"), names


@pytest.mark.spawns_ranks  # a launcher of its own: under torchrun it would join the job
@pytest.mark.timeout(300)
def test_the_generation_launcher_checks_longcat_flash_against_its_own_generate():
    """``launch/generate.py --model longcat_flash --check`` on one rank: serial's tokens are the model's own
    ``generate``'s and every mode's serial's, exit 0 (before: ``TransformersModel cannot decode: longcat_flash:
    layer 0 attends twice``, exit 2)."""
    from support.launcher import GENERATE, TINY, run_launcher

    proc = run_launcher(TINY + ["--model", "longcat_flash", "--batch", "2", "--seq-len", "8", "--new-tokens", "4",
                                "--mode", "serial,two-batch", "--check"], timeout=240, script=GENERATE)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "check: serial generates longcat_flash's own generate(do_sample=False) tokens" in proc.stdout
    assert "check: every mode generates serial's tokens" in proc.stdout


def test_own_generate_takes_nothing_from_the_models_generation_config():
    """The model's generation config (its eos token, a minimum length, penalties, banned words, a length) changes
    nothing: greedy argmax alone, and the config is the model's again afterwards."""
    model = build_transformers_model("mixtral", seed=SEED)
    prompts = _prompts(model.cfg.vocab, (3, 5), seed=4)
    want = greedy_generate(model, prompts, NEW)
    own = model.hf.generation_config
    own.update(eos_token_id=want[0][1], repetition_penalty=20.0, no_repeat_ngram_size=1, min_new_tokens=3,
               bad_words_ids=[[want[1][0]]], max_new_tokens=2)
    assert model.own_generate(prompts, NEW) == want
    assert model.hf.generation_config is own and own.eos_token_id == want[0][1]  # given back as it was
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        model.own_generate([[1], []], NEW)


PLANS = [  # per round, per rank: (prompt lengths, new tokens)
    [((3, 7, 5), NEW), ((4,), 3)],  # rank 1 is done first and takes part with zero tokens
]  # (a rank that brings nothing: tests/test_decode.py)


RANK_FAMILIES = ("qwen3_moe", "longcat_flash")  # LongCat-Flash: its second attention under the MoE's dispatch


def _family_on_ranks(ctx, family):
    model = build_transformers_model(family, seed=SEED)
    mine = [plan[ctx.rank] for plan in PLANS]
    prompts = [_prompts(model.cfg.vocab, lens, seed=10 + 2 * i + ctx.rank) for i, (lens, _) in enumerate(mine)]
    want = [model.own_generate(p, new) if p else [] for p, (_, new) in zip(prompts, mine)]
    make_expert_parallel(model, ctx.group)
    got = []
    for p, (_, new) in zip(prompts, mine):
        with Sanitizer():  # raises on the first race between streams
            got.append({mode: greedy_generate(model, p, new, mode=mode) for mode in MODES})
    return got, want


def _ranks_body(ctx):
    return {family: _family_on_ranks(ctx, family) for family in RANK_FAMILIES}


def test_experts_over_two_ranks_decode_the_models_own_tokens_in_every_mode():
    """qwen3_moe's and longcat_flash's experts over two ranks with different prompt counts (one rank done first):
    each rank's tokens in every mode are its requests' own ``generate``'s on one process, with no race."""
    from overlap.multirank import run_ranks

    for rank, families in enumerate(run_ranks(_ranks_body, 2, timeout=240)):
        for family, (got, want) in families.items():
            for round_no, (modes, tokens) in enumerate(zip(got, want)):
                assert set(modes) == set(MODES)
                for mode, out in modes.items():
                    assert out == tokens, (family, rank, round_no, mode, out, tokens)


@pytest.mark.spawns_ranks
@pytest.mark.timeout(300)
def test_generate_runs_a_multimodal_wrapper_as_its_text_model_and_checks_its_tokens():
    """``--model kimi_k25``: its text model (deepseek_v3) prefills and decodes in every mode of ``--mode all``,
    named as such in the headline, with its own generate's tokens (one process, tiny sizes)."""
    from support.launcher import GENERATE, run_launcher

    proc = run_launcher(["--warmup", "0", "--iters", "1", "--batch", "2", "--seq-len", "8", "--new-tokens", "3",
                         "--model", "kimi_k25", "--check"], script=GENERATE, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generate: kimi_k25 (its text model, deepseek_v3) 3 layers" in proc.stdout
    assert "check: serial generates kimi_k25's own generate(do_sample=False) tokens" in proc.stdout
    assert "check: every mode generates serial's tokens" in proc.stdout
