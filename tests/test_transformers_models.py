"""transformers MoE causal LMs through the toolkit's schedules with expert parallelism.

Every rank builds the same small model of each family from one seed; each rank prefills its own
packed batch in every mode of ``--mode all`` (serial, shared, two-batch), and qwen3_moe also in
three-batch, on 1, 2 and 4 CPU ranks, once split at a request boundary and once cut inside a long
request (three-batch cuts it twice), with the KV offload and the sanitizer on.
The final hidden states, logits and offloaded keys / values are compared with the model's own
forward (each request alone); all families and modes of one world size share one `run_ranks`.
"""
import functools
import os
import subprocess
import sys
import time

import pytest
import torch

import overlap
from launch.engine import continue_prefill, layer_operations, make_expert_parallel, split_for, prefill
from microbatch import MODES, Layer, MoELayer, MoEModel, ModelShape
from microbatch.batch import Batch, SeqInfo
from microbatch.forward import serial_split
from microbatch.planning.split import propose_split
from overlap.multirank import run_ranks
from support.protocols import Without, protocol_members, protocol_problems

transformers = pytest.importorskip("transformers")
from launch.models import (adapt, build_transformers_model, check_family, family_name,  # noqa: E402
                           is_moe_config, moe_families, small_config, text_model_type)

pytestmark = pytest.mark.cpu_only

FAMILIES = ("deepseek_v3", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe")
ALL = [name for name, m in MODES.items() if m.in_all]  # what the launcher's --mode all runs
MODES_OF = {"qwen3_moe": ALL + ["three-batch"]}  # the N-batch modes on one family keep the test short
SEED = 7
SPLIT = dict(min_tokens=4, max_imbalance=0.2)
BATCHES = {  # per rank: the best boundary is within 20% / every boundary is far off, so a request is cut
    "boundary": lambda r: [6, 5 + r, 7, 6],
    "cut": lambda r: [3, 17 + 2 * r, 2],
}
TOL = dict(rtol=1e-4, atol=1e-4)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _max_diff(a, b):
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


class _Recorder:
    """Every layer's keys and values of a run without offload."""

    def __init__(self):
        self.kv = {}

    def __call__(self, layer, k, v):
        self.kv[layer] = (k.clone(), v.clone())


def _mode(model, batch, mode, group, ref, ref_kv, plain):
    """One prefill in ``mode`` with the KV offload, under the sanitizer: what the parent checks."""
    cfg = model.cfg
    split = split_for(mode, batch, group, model=model, **SPLIT)
    cache = overlap.OffloadCache(cfg.n_layers, batch.seq.num_tokens, cfg.k_shape, v_shape=cfg.v_shape)
    with overlap.Sanitizer(raise_on_race=False) as san:
        out = prefill(model, batch, mode, split, cache)
        overlap.synchronize()
    held = {i: cache.host_kv(i) for i in ref_kv}
    cache.close()
    return dict(
        hidden=_max_diff(out, ref), logits=_max_diff(model.logits(out), model.logits(ref)),
        scale=ref.abs().max().item(),
        kv=max(_max_diff(h, r) for i in ref_kv for h, r in zip(held[i], ref_kv[i])),
        kv_equals_plain=all(torch.equal(h, p) for i in ref_kv for h, p in zip(held[i], plain[i])),
        races=[str(r) for r in san.races], serial=split.serial, cut=split.cut, reason=split.reason,
        points=split.points, cuts=split.cuts)


def _family(ctx, family):
    model = build_transformers_model(family, seed=SEED)
    try:
        make_expert_parallel(model, ctx.group)
    except TypeError as exc:  # every rank raises alike: the family's block is not supported by wrap yet
        return f"{type(exc).__name__}: {exc}"
    out = {}
    for case, lens in BATCHES.items():
        batch = Batch.random(lens(ctx.rank), model.cfg.vocab, seed=100 + ctx.rank)
        ref, ref_kv = model.reference(batch), model.reference_kv(batch)
        plain = _Recorder()
        model(batch, kv_sink=plain)
        for mode in MODES_OF.get(family, ALL):
            out[case, mode] = _mode(model, batch, mode, ctx.group, ref, ref_kv, plain.kv)
    return out


def _every_family(ctx):
    return {family: _family(ctx, family) for family in FAMILIES}


@functools.lru_cache(maxsize=None)
def _results(world):
    """Per rank, per family: the checks of every batch and mode, or why the family could not run.

    A failure is kept too, so that the tests sharing it do not start the ranks again."""
    try:
        return run_ranks(_every_family, world, timeout=300)
    except Exception as exc:  # noqa: BLE001 (re-raised by every test of this world size)
        return exc


def _runs(world, family):
    results = _results(world)
    if isinstance(results, Exception):
        raise results
    per_rank = [r[family] for r in results]
    for rank, got in enumerate(per_rank):
        if isinstance(got, str):
            pytest.fail(f"{family} on {world} ranks, rank {rank}: {got}")
    return per_rank


WORLDS = pytest.mark.parametrize("world", [2])  # 4 ranks: tests/test_wrap.py (the families' blocks), test_decode.py
EACH = pytest.mark.parametrize("family", FAMILIES)


@WORLDS
@EACH
def test_every_mode_equals_the_models_own_forward(world, family):
    for rank, runs in enumerate(_runs(world, family)):
        for (case, mode), r in runs.items():
            where = f"{family}, {world} ranks, rank {rank}, {case}, {mode}"
            assert r["hidden"] <= TOL["atol"] + TOL["rtol"] * r["scale"], (where, r)
            assert r["logits"] <= 1e-3, (where, r)


@WORLDS
@EACH
def test_two_batch_splits_at_a_boundary_and_inside_a_request(world, family):
    for runs in _runs(world, family):
        boundary, cut = runs["boundary", "two-batch"], runs["cut", "two-batch"]
        assert not boundary["serial"] and boundary["cut"] is None, boundary["reason"]
        assert not cut["serial"] and cut["cut"] is not None and cut["cut"][0] == 1, cut["reason"]
        assert all(runs[case, mode]["serial"] for case in BATCHES for mode in ("serial", "shared"))


@WORLDS
def test_three_batch_cuts_a_long_request_twice(world):
    for runs in _runs(world, "qwen3_moe"):
        boundary, cut = runs["boundary", "three-batch"], runs["cut", "three-batch"]
        assert not boundary["serial"] and len(boundary["points"]) == 2, boundary["reason"]
        assert [c[0] for c in cut["cuts"]] == [1, 1], cut["reason"]  # its third part's prefix spans two parts


@WORLDS
@EACH
def test_kv_offload_holds_the_models_keys_and_values(world, family):
    for rank, runs in enumerate(_runs(world, family)):
        for (case, mode), r in runs.items():
            assert r["kv"] <= 1e-4, (family, world, rank, case, mode, r["kv"])
            if mode == "serial":  # the same operations in the same order as the run without offload
                assert r["kv_equals_plain"], (family, world, rank, case)


@WORLDS
@EACH
def test_no_race_in_any_mode(world, family):
    for runs in _runs(world, family):
        assert not any(r["races"] for r in runs.values()), {k: r["races"] for k, r in runs.items() if r["races"]}


# --- one process: config, weights, fallbacks --------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_next():
    model = build_transformers_model("qwen3_next", seed=SEED)  # linear attention + full attention layers
    return make_expert_parallel(model, None)


def test_hybrid_model_splits_only_at_request_boundaries(qwen3_next):
    model = qwen3_next
    assert model.cfg.attention_layers == (1,) and "linear_attention" in model.no_cut_reason
    for lens, serial in (([6, 5, 7, 6], False), ([3, 17, 2], True)):
        batch = Batch.random(lens, model.cfg.vocab, seed=3)
        ref = model.reference(batch)
        for mode in MODES:
            split = split_for(mode, batch, None, model=model, **SPLIT)
            assert split.cut is None
            if mode == "two-batch":
                assert split.serial == serial and model.no_cut_reason in split.reason
            torch.testing.assert_close(prefill(model, batch, mode, split), ref, **TOL)
    cut = propose_split([3, 17, 2], **SPLIT)
    with pytest.raises(ValueError, match="cuts request 1.*linear_attention"):
        prefill(model, Batch.random([3, 17, 2], model.cfg.vocab), "two-batch", cut)


def test_hybrid_model_offloads_only_its_attention_layers(qwen3_next):
    model = qwen3_next
    batch = Batch.random([6, 5, 7, 6], model.cfg.vocab, seed=4)
    names = [[op.name for op in ops] for ops in layer_operations(model, cache=object())]
    assert "kv_offload" not in names[0] and names[1][1] == "kv_offload"
    cache = overlap.OffloadCache(model.cfg.n_layers, batch.seq.num_tokens, model.cfg.k_shape)
    prefill(model, batch, "two-batch", split_for("two-batch", batch, None, model=model, **SPLIT), cache)
    assert cache.tokens(0) == 0 and cache.tokens(1) == batch.seq.num_tokens
    for got, want in zip(cache.host_kv(1), model.reference_kv(batch)[1]):
        torch.testing.assert_close(got, want, **TOL)
    with pytest.raises(ValueError, match="continues 6 prefix tokens"):
        continue_prefill(model, Batch(batch.tokens[:4], SeqInfo((4,), (6,))), cache)
    cache.close()


def test_sliding_window_layers_take_a_prefix():
    model = make_expert_parallel(build_transformers_model("mixtral", seed=SEED, sliding_window=5), None)
    assert model.no_cut_reason is None and all(layer.window == 5 for layer in model.layers)
    batch = Batch.random([3, 17, 2], model.cfg.vocab, seed=5)
    split = split_for("two-batch", batch, None, model=model, **SPLIT)
    assert split.cut is not None
    torch.testing.assert_close(prefill(model, batch, "two-batch", split), model.reference(batch), **TOL)


def test_chunked_attention_layers_take_a_prefix():
    """Llama 4's chunked attention: a cut request's later part sees only the keys of its own chunk."""
    model = make_expert_parallel(build_transformers_model("llama4_text", seed=SEED, attention_chunk_size=5), None)
    assert all(layer.attns[0].chunk == 5 for layer in model.layers)
    batch = Batch.random([3, 17, 2], model.cfg.vocab, seed=5)
    for n in (2, 3):
        split = propose_split(batch.seq.seq_lens, n, **SPLIT)
        assert split.cut is not None
        torch.testing.assert_close(prefill(model, batch, "two-batch" if n == 2 else "three-batch", split),
                                   model.reference(batch), **TOL)


def test_continuing_from_an_offloaded_prefix_equals_the_whole_prefill():
    model = make_expert_parallel(build_transformers_model("deepseek_v3", seed=SEED), None)
    cfg = model.cfg
    full = Batch.random([14, 9], cfg.vocab, seed=6)
    ref = model.reference(full)
    t = full.tokens
    first = Batch(torch.cat([t[:8], t[14:19]]), SeqInfo((8, 5)))
    second = Batch(torch.cat([t[8:14], t[19:23]]), SeqInfo((6, 4), (8, 5)))
    cache = overlap.OffloadCache(cfg.n_layers, 23, cfg.k_shape, v_shape=cfg.v_shape)
    prefill(model, first, "serial", serial_split(first), cache)
    out = continue_prefill(model, second, cache)
    cache.close()
    torch.testing.assert_close(out, torch.cat([ref[8:14], ref[19:23]]), **TOL)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "longcat_flash"])
def test_the_adapter_implements_the_model_contract(family):
    """`microbatch.model.MoEModel`, as the reference decoder does: every member with a signature that takes the
    contract's calls, its shapes, layers (attention, linear attention, LongCat's shortcut layers) and MoE
    layers, before and after the MoE blocks become expert-parallel; a hybrid says why it cannot be cut."""
    model = build_transformers_model(family, seed=SEED)
    for expert_parallel in (False, True):
        if expert_parallel:
            make_expert_parallel(model, None)
        assert protocol_problems(model, MoEModel) == []
        assert protocol_problems(model.cfg, ModelShape) == []
        assert [protocol_problems(layer, Layer) for layer in model.layers] == [[]] * len(model.layers)
        moe = list(model.moe_layers())
        assert moe and [protocol_problems(layer, MoELayer) for layer in moe] == [[]] * len(moe)
    assert (model.no_cut_reason is None) == (family == "qwen3_moe")


@pytest.fixture(scope="module")
def qwen3():
    return build_transformers_model("qwen3_moe", seed=SEED)


@pytest.mark.parametrize("member", sorted(protocol_members(MoEModel)))
def test_the_contract_check_fails_on_a_member_removed_from_the_adapter(qwen3, member):
    assert protocol_problems(Without(qwen3, member), MoEModel, "TransformersModel") == [
        f"TransformersModel.{member}: missing (MoEModel has this {protocol_members(MoEModel)[member]})"]


def test_micro_batches_layer_by_layer_equal_the_models_own_forward():
    model = build_transformers_model("qwen2_moe", seed=SEED)
    batch = Batch.random([3, 17, 2], model.cfg.vocab, seed=8)
    split = propose_split(batch.seq.seq_lens, **SPLIT)
    assert split.cut is not None
    torch.testing.assert_close(model.forward_microbatches(batch, split), model.reference(batch), **TOL)
    three = propose_split(batch.seq.seq_lens, 3, **SPLIT)  # request 1 cut twice: its last part's prefix spans two
    assert three.n_parts == 3 and [c[0] for c in three.cuts] == [1, 1]
    torch.testing.assert_close(model.forward_microbatches(batch, three), model.reference(batch), **TOL)
    hf_logits = model.hf(input_ids=batch.tokens[None, :3]).logits[0]
    torch.testing.assert_close(model.logits(model(batch))[:3], hf_logits, **TOL)


def test_eager_attention_equals_sdpa():
    eager = build_transformers_model("glm4_moe", seed=SEED, attn_implementation="eager")
    sdpa = build_transformers_model("glm4_moe", seed=SEED)
    batch = Batch.random([3, 17, 2], eager.cfg.vocab, seed=9)
    split = propose_split(batch.seq.seq_lens, **SPLIT)
    torch.testing.assert_close(eager.forward_microbatches(batch, split), sdpa.reference(batch), **TOL)


def test_weights_come_from_the_seed():
    a, b = (build_transformers_model("mixtral", seed=s).hf.state_dict() for s in (1, 1))
    c = build_transformers_model("mixtral", seed=2).hf.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_moe"])
def test_bfloat16_modes_equal_the_models_own_forward(family):
    model = build_transformers_model(family, seed=SEED, dtype=torch.bfloat16)
    batch = Batch.random([3, 17, 2], model.cfg.vocab, seed=1)
    ref = model.reference(batch)
    make_expert_parallel(model, None)
    for mode in MODES:
        out = prefill(model, batch, mode, split_for(mode, batch, None, model=model, **SPLIT))
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("family,fields", [
    ("deepseek_v3", dict(num_hidden_layers=4, first_k_dense_replace=2, hidden_size=96, n_routed_experts=16,
                         num_experts_per_tok=3, n_shared_experts=2)),
    ("glm4_moe", dict(num_hidden_layers=4, first_k_dense_replace=2, hidden_size=96, n_routed_experts=16,
                      num_experts_per_tok=3, n_shared_experts=2)),
    ("qwen3_moe", dict(num_hidden_layers=4, mlp_only_layers=[0, 1], hidden_size=96, num_local_experts=16,
                       num_experts_per_tok=3)),
    ("qwen2_moe", dict(num_hidden_layers=4, mlp_only_layers=[0, 1], hidden_size=96, num_experts=16,
                       num_experts_per_tok=3, shared_expert_intermediate_size=64)),
    ("mixtral", dict(num_hidden_layers=4, hidden_size=96, num_local_experts=16, num_experts_per_tok=3)),
])
def test_overrides_set_the_familys_own_fields(family, fields):
    overrides = dict(n_layers=4, n_dense_layers=2, hidden=96, n_experts=16, top_k=3, n_shared=2)
    if family in ("qwen3_moe", "mixtral"):
        overrides["n_shared"] = 0
    if family == "mixtral":
        overrides["n_dense_layers"] = 0
    config = small_config(family, overrides)
    assert {k: getattr(config, k) for k in fields} == fields


def test_overrides_a_family_cannot_take_are_refused():
    with pytest.raises(ValueError, match="no dense layers"):
        small_config("mixtral", dict(n_dense_layers=1))
    with pytest.raises(ValueError, match="no shared experts"):
        small_config("qwen3_moe", dict(n_shared=1))
    with pytest.raises(ValueError, match="unknown overrides"):
        small_config("mixtral", dict(n_heads=2))


def test_adapter_counts_the_models_shapes():
    model = build_transformers_model("deepseek_v3", seed=SEED, overrides=dict(n_layers=4, n_dense_layers=2))
    cfg = model.cfg
    assert (cfg.n_layers, cfg.n_dense_layers, cfg.moe_layers) == (4, 2, (2, 3))
    assert cfg.k_shape == (1, 16) and cfg.v_shape == (1, 8)  # MLA caches its latent and its rotary key
    assert [layer.is_moe for layer in model.layers] == [False, False, True, True]


def test_adapt_refuses_an_attention_without_explicit_masks():
    hf = transformers.AutoModelForCausalLM.from_config(small_config("mixtral"), attn_implementation="sdpa")
    hf.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa"):
        adapt(hf)


def test_adapt_refuses_a_model_whose_layers_do_more_than_the_adapter_runs():
    hf = transformers.AutoModelForCausalLM.from_config(small_config("mixtral"), attn_implementation="sdpa")
    layer = hf.model.layers[0]  # the last one would vanish in the final norm
    plain = layer.forward
    layer.forward = lambda *args, **kwargs: plain(*args, **kwargs) * 2  # as a residual multiplier would
    with pytest.raises(TypeError, match="do not compute the model's own forward"):
        adapt(hf)
    layer.forward = plain
    assert adapt(hf).check_against_own_forward() <= 1e-5


def test_the_package_imports_without_transformers():
    code = ("import sys, launch.models, launch.engine, collectives, microbatch\n"
            "assert 'transformers' not in sys.modules\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# --- the families users bring -----------------------------------------------------------------------

# what users run most, and the seed guide's own multi-stream case (LongCat-Flash's shortcut MoE): each must run
BROUGHT = ("deepseek_v2", "gpt_oss", "llama4_text", "granitemoe", "granitemoeshared", "longcat_flash")
NOT_CAUSAL = ("glm4v_moe_text", "qwen3_vl_moe_text", "switch_transformers")  # MoE configs, not causal LMs
# multimodal wrappers of a MoE text model: None where it runs as its text model, else the start of the refusal
WRAPPERS = {"kimi_k25": None, "aria": None,
            "step3p7": "step3p7 runs as its text model, step3p5, which is not a causal LM AutoModelForCausalLM builds "
                       "(transformers has no step3p5 model with an lm_head): the adapter runs decoder-only causal LMs"}


DECODE_NEW = 3  # the walk's decode steps per request


def _decode_refusal(model):
    """Why the family's small model (expert-parallel on one rank) cannot decode, in one line, as the generate
    launcher refuses it; None where it decodes: serial greedy steps give its own ``generate``'s tokens (the
    tokens are compared by the caller)."""
    try:
        model.decode_layer_operations()
    except (AttributeError, TypeError, ValueError) as exc:
        return f"{type(model).__name__} cannot decode: {exc}".splitlines()[0]
    return None


def _decodes_as_its_own_generate(model):
    """A few greedy decode steps of one prompt (serial, float32): (ours, the model's own
    ``generate(do_sample=False)``); tests/test_decode_transformers.py decodes several, in every mode."""
    from launch.engine import greedy_generate

    prompts = [[t % model.cfg.vocab for t in (3, 1, 4, 1, 5)]]
    return greedy_generate(model, prompts, DECODE_NEW), model.own_generate(prompts, DECODE_NEW)


def _walk(families):
    """Per family: prefill (None: runs, else why not), decode (the same), and anything that broke instead."""
    prefill, decode, broken = {}, {}, {}
    for family in families:
        try:
            model = check_family(family)
            prefill[family] = None
        except ValueError as exc:
            prefill[family] = str(exc)
            continue
        except Exception as exc:  # noqa: BLE001 (anything else is a bug: a traceback where one line was due)
            broken[family] = f"{type(exc).__name__}: {exc}"
            continue
        decode[family] = _decode_refusal(model)
        if decode[family] is None:
            try:
                ours, own = _decodes_as_its_own_generate(model)
            except Exception as exc:  # noqa: BLE001
                broken[family] = f"decode: {type(exc).__name__}: {exc}"
                continue
            if ours != own:
                broken[family] = f"decode: tokens {ours}, its own generate {own}"
    return prefill, decode, broken


def _table(prefill, decode):
    """The walk as docs/model.md's table: family, prefill, decode, the reason where refused."""
    rows = ["| family | prefill | decode | reason where refused |", "|---|---|---|---|"]
    for family, why in sorted(prefill.items()):
        name = family_name(family)
        if why is not None:
            rows.append(f"| `{name}` | refused | - | {why} |")
        else:
            refused = decode.get(family)
            rows.append(f"| `{name}` | runs | {'refused' if refused else 'runs'} | {refused or ''} |")
    return "\n".join(rows)


def test_every_moe_family_runs_or_is_refused_in_one_line():
    """Every MoE causal-LM family of the installed transformers (from its auto mappings: a new release cannot
    add one unseen), and every multimodal wrapper of one, either runs, small, through the adapter and
    expert-parallel layers on one rank and equals its own forward (`check_family`), then decodes a few greedy
    steps with its own ``generate``'s tokens or is refused for decode in one line (as the generate launcher
    refuses it); or is refused with one line saying why. The families users bring run."""
    start = time.monotonic()
    families = moe_families()
    assert set(BROUGHT) | set(FAMILIES) | set(WRAPPERS) <= set(families), sorted(set(BROUGHT) - set(families))
    prefill, decode, broken = _walk(families)
    runs = [f for f, why in prefill.items() if why is None]
    refused = {f: why for f, why in prefill.items() if why is not None}
    took = time.monotonic() - start
    print(f"\n{len(families)} MoE causal-LM families in {took:.1f} s; {len(runs)} run: {', '.join(runs)}")
    print(f"{len(refused)} refused:\n" + "\n".join(f"  {f}: {why}" for f, why in sorted(refused.items())))
    print(_table(prefill, decode))
    assert not broken, broken
    assert all(why and "\n" not in why for why in refused.values()), refused
    assert all("\n" not in why for why in decode.values() if why), decode
    assert not set(BROUGHT) & set(refused), {f: refused[f] for f in BROUGHT if f in refused}
    assert {f: prefill[f] for f in WRAPPERS} == WRAPPERS, {f: prefill[f] for f in WRAPPERS}
    assert all(decode[f] is None for f, why in WRAPPERS.items() if why is None), decode
    assert all(decode[f] is None for f in FAMILIES + BROUGHT), decode


def test_a_multimodal_wrapper_runs_as_its_text_model_with_the_overrides():
    """kimi_k25 keeps a deepseek_v3 model in its text_config: ``--model kimi_k25`` is that text model, named so,
    with the overrides on its config; step3p7's text model (step3p5) has no causal LM in transformers."""
    assert text_model_type("kimi_k25") == "deepseek_v3" and text_model_type("deepseek_v3") is None
    assert family_name("kimi_k25") == "kimi_k25 (its text model, deepseek_v3)" and family_name("mixtral") == "mixtral"
    config = small_config("kimi_k25", dict(n_layers=3, hidden=96, n_experts=16, top_k=3))
    assert config.model_type == "deepseek_v3"
    assert (config.num_hidden_layers, config.hidden_size, config.n_routed_experts, config.num_experts_per_tok) == (
        3, 96, 16, 3)
    assert type(check_family("kimi_k25", dict(n_experts=16))).__name__ == "TransformersModel"
    with pytest.raises(ValueError, match="^step3p7 runs as its text model, step3p5, which is not a causal LM"):
        check_family("step3p7")


def test_a_multimodal_checkpoint_is_refused_in_one_line_naming_what_the_loader_lacks(tmp_path):
    from launch.config import ConfigError
    from launch.config.model import transformers_config

    wrapper = transformers.AutoConfig.for_model("kimi_k25", text_config=small_config("kimi_k25").to_dict())
    wrapper.save_pretrained(str(tmp_path))
    with pytest.raises(ConfigError, match=f"^--model {tmp_path}: a kimi_k25 checkpoint is a multimodal model: the "
                                          f"loader does not take its text model's \\(deepseek_v3\\) weights") as err:
        transformers_config(str(tmp_path), {})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", NOT_CAUSAL)
def test_a_moe_model_type_that_is_no_causal_lm_is_refused_in_one_line(family):
    with pytest.raises(ValueError, match=f"^{family} is not a causal LM AutoModelForCausalLM builds") as err:
        check_family(family)
    assert "\n" not in str(err.value)


def test_a_family_the_adapter_cannot_run_is_refused_naming_what_it_lacks():
    """DeepSeek-V4 by its two parts the operations cannot carry (docs/model.md says what each would take); a layer
    kind the adapter does not know by the kinds it runs."""
    with pytest.raises(ValueError, match=r"^the adapter cannot run deepseek_v4: TypeError: layer 0 "
                                         r"\(DeepseekV4DecoderLayer\): heavily compressed attention \(its cache "
                                         r"holds a compressor's state, not keys and values per token\) and "
                                         r"hyper-connections \(attn_hc, ffn_hc: its residual is several streams\): "
                                         r"the adapter's operations carry neither") as err:
        check_family("deepseek_v4")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="the adapter cannot run zaya: .*is hybrid: "
                                         "the adapter runs attention \\(self_attn\\) of the kinds full, sliding"):
        check_family("zaya")
    with pytest.raises(ValueError, match="top-k 9 must pick between 1 and the 8 routed experts"):
        check_family("qwen3_moe", dict(top_k=9))


def test_moe_configs_are_told_by_their_expert_count_field():
    from transformers import AutoConfig

    assert is_moe_config(AutoConfig.for_model("longcat_flash"))  # n_routed_experts
    assert is_moe_config(AutoConfig.for_model("dots1"))  # its n_routed_experts is unset (None)
    assert is_moe_config(AutoConfig.for_model("aria_text"))  # moe_num_experts
    assert not is_moe_config(AutoConfig.for_model("llama"))
    assert not is_moe_config(AutoConfig.for_model("qwen2"))


@pytest.mark.parametrize("family, overrides, fields", [
    ("dots1", {}, dict(n_shared_experts=1, num_experts_per_tok=2, n_routed_experts=8)),  # unset in its default
    ("dots1", dict(n_shared=2), dict(n_shared_experts=2)),
    ("deepseek_v2", {}, dict(num_experts_per_tok=2, num_key_value_heads=4)),  # MLA: as many K/V heads as heads
    ("flex_olmo", {}, dict(pad_token_id=None)),  # its pad id 100277 is past the small vocabulary
    ("longcat_flash", dict(n_layers=3, n_experts=8), dict(num_layers=3, zero_expert_num=4, head_dim=8)),
    ("deepseek_v32", dict(n_layers=2), dict(first_k_dense_replace=1)),  # its default 3 leaves no MoE layer
    ("zaya", {}, dict(num_experts_per_tok=1)),  # built for top-1 only
])
def test_a_default_config_gets_its_unset_fields_from_the_overrides_or_a_sensible_default(family, overrides, fields):
    config = small_config(family, overrides)
    assert {k: getattr(config, k) for k in fields} == fields


def _every_mode(ctx, families):
    """Each family built alike on every rank, its MoE blocks expert-parallel over the group: every mode (and the
    KV offload in serial and two-batch) against its own forward, per rank."""
    transformers.logging.set_verbosity_error()
    out = {}
    for family in families:
        model = build_transformers_model(family, seed=SEED)
        batch = Batch.random(BATCHES["boundary"](ctx.rank), model.cfg.vocab, seed=100 + ctx.rank)
        ref, ref_kv = model.reference(batch), model.reference_kv(batch)
        make_expert_parallel(model, ctx.group)
        plain = _Recorder()
        model(batch, kv_sink=plain)
        for mode in MODES:
            if mode in ("serial", "two-batch"):
                out[family, mode] = _mode(model, batch, mode, ctx.group, ref, ref_kv, plain.kv)
            else:
                got = prefill(model, batch, mode, split_for(mode, batch, ctx.group, model=model, **SPLIT))
                out[family, mode] = dict(hidden=_max_diff(got, ref), scale=ref.abs().max().item(), races=[])
    return out


def test_the_families_users_bring_run_every_mode_on_two_ranks_and_equal_their_own_forward():
    """deepseek_v2, gpt-oss (sinks, sliding windows, biased clamped-SwiGLU experts), Llama 4 (tokens scaled by
    the router before the experts, chunked attention), Granite (multipliers, a shared MLP beside the routed
    block) and LongCat-Flash (zero-compute experts, the shortcut MoE under the dense path)."""
    for rank, runs in enumerate(run_ranks(_every_mode, 2, BROUGHT, timeout=300)):
        assert {f for f, _ in runs} == set(BROUGHT)
        for (family, mode), r in runs.items():
            where = f"{family}, rank {rank}, {mode}"
            assert r["hidden"] <= TOL["atol"] + TOL["rtol"] * r["scale"], (where, r)
            assert not r["races"], (where, r["races"])
            if "kv" in r:
                assert r["kv"] <= 1e-4 and (mode != "serial" or r["kv_equals_plain"]), (where, r["kv"])


def test_longcat_flash_runs_its_dense_path_under_the_moe_exchange():
    model = make_expert_parallel(build_transformers_model("longcat_flash", seed=SEED), None)
    names = [op.name for op in model.layers[0].operations()]
    dispatch, combine = names.index("dispatch"), names.index("combine")
    assert names.index("dense0") == dispatch + 1 and names.index("attn1") < names.index("experts") < combine
    assert names.index("dense1") == combine + 1
    assert model.cfg.k_shape[0] == 2 and "not cut" in model.no_cut_reason  # both attentions' latents, side by side
