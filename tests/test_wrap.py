"""wrap_expert_parallel on Hugging Face transformers MoE blocks (small configs, no downloads) and its errors.

Every causal-LM family of the installed transformers is built small with random weights; its MoE blocks
(found by structure, `find_moe_blocks`) must either wrap and equal the block on 1, 2 and 4 ranks, or be
refused with a TypeError naming the part that does not fit.
"""
from __future__ import annotations

import functools
import os
import re
import time
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from collectives import ExpertParallelMoE, LayoutError, MoE, MoEConfig, find_moe_blocks, wrap_expert_parallel
from collectives._recognise import CapturedRouter, folds_identity, shared_part
from collectives.wrap import IdentitySlots
from overlap.multirank import run_ranks

pytestmark = pytest.mark.cpu_only

transformers = pytest.importorskip("transformers")

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "expert-parallel.md")


def _block(kind: str) -> nn.Module:
    """A small transformers MoE block with random weights, the same on every rank."""
    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock

        cls, cfg = MixtralSparseMoeBlock, MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=8,
                                                        num_experts_per_tok=2)
    elif kind == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeConfig, Qwen2MoeSparseMoeBlock

        cls, cfg = Qwen2MoeSparseMoeBlock, Qwen2MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=8,
                                                          shared_expert_intermediate_size=12, num_experts_per_tok=3,
                                                          norm_topk_prob=False)
    elif kind == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssConfig, GptOssMLP

        cls, cfg = GptOssMLP, GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=8,
                                           num_experts_per_tok=2)
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Config, DeepseekV3MoE

        cls, cfg = DeepseekV3MoE, DeepseekV3Config(hidden_size=16, moe_intermediate_size=8, n_routed_experts=8,
                                                   num_experts_per_tok=2, n_group=2, topk_group=1,
                                                   n_shared_experts=1, routed_scaling_factor=2.5)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    block = cls(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
        for b in block.buffers():  # DeepSeek-V3's expert score correction bias
            b.normal_(0, 0.1)
    return block.eval()


KINDS = ("mixtral", "qwen2_moe", "deepseek_v3")


# --- every MoE family of the installed transformers, built small ---------------------------------------------------
LAYERS = 2
MAX_PARAMS = 20_000_000  # a config that stays larger than this could not be made small
SIZES = dict(
    hidden_size=64, d_model=64, n_embd=64,
    intermediate_size=64, ffn_hidden_size=64, moe_intermediate_size=32, expert_intermediate_size=32,
    expert_ffn_hidden_size=32, shared_expert_intermediate_size=48, shared_experts_intermediate_size=48,
    moe_shared_expert_intermediate_size=48, shared_intermediate_size=48,
    num_hidden_layers=LAYERS, num_layers=LAYERS, n_layers=LAYERS, n_layer=LAYERS,
    num_attention_heads=4, n_heads=4, n_head=4, num_key_value_heads=2, kv_n_heads=2, num_kv_heads=2,
    head_dim=16, kv_channels=16, vocab_size=128, max_position_embeddings=128, max_seq_len=128,
    vocab_size_per_layer_input=128, hidden_size_per_layer_input=16,
    num_experts=8, num_local_experts=8, n_routed_experts=8, moe_num_experts=8, zero_expert_num=2,
    num_experts_per_tok=2, num_experts_per_token=2, moe_top_k=2, moe_topk=2, top_k_experts=2, moe_k=2,
    n_group=2, num_expert_group=2, topk_group=1,
    first_k_dense_replace=1, num_dense_layers=1, decoder_sparse_step=1, mlp_only_layers=[0],
    kv_lora_rank=16, q_lora_rank=16, o_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    index_n_heads=2, index_head_dim=16, index_topk=16,
    linear_num_heads=4, linear_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16,
    mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
    enable_moe_block=True, per_layer_config=None,
)
FILL = dict(n_shared_experts=1)  # where the default is None
IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
# tried in order when the config or model rejects the sizes above (None: the family's default;
# FIRST_LAYERS: per-layer lists cut to their first entries)
FIRST_LAYERS = "_first_layers"
VARIANTS = ({}, {"num_key_value_heads": 4}, {"num_experts_per_tok": None}, {FIRST_LAYERS: True})
# families that must wrap whenever transformers has them
MUST_FIT = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "longcat_flash")


def _per_layer(values: list, first: bool) -> list:
    """A per-layer list cut to LAYERS entries, keeping each kind of layer where it can (e.g. dense, then sparse)."""
    if first:
        return values[:LAYERS]
    kinds = list(dict.fromkeys(map(str, values)))
    first = {str(v): v for v in reversed(values)}
    picked = [first[k] for k in kinds[:LAYERS]]
    return picked + [picked[-1]] * (LAYERS - len(picked))


def _shrink(d: dict, variant: dict) -> dict:
    layers = next((d[k] for k in ("num_hidden_layers", "num_layers", "n_layers", "n_layer") if isinstance(d.get(k), int)),
                  None)
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and ("hidden_size" in v or "d_model" in v or "model_type" in v):
            out[k] = _shrink(v, variant)
        elif k in variant:
            out[k] = variant[k] if variant[k] is not None else v
        elif k in SIZES:
            out[k] = SIZES[k]
        elif k in FILL and v is None:
            out[k] = FILL[k]
        elif k in IDS and isinstance(v, int):
            out[k] = IDS.index(k)
        elif k.endswith("_per_layer") and isinstance(v, list) and k[: -len("_per_layer")] in SIZES:
            out[k] = [SIZES[k[: -len("_per_layer")]]] * LAYERS
        elif isinstance(v, list) and v and layers and len(v) == layers:
            out[k] = _per_layer(v, FIRST_LAYERS in variant)
        else:
            out[k] = v
    return out


def _small_config(model_type: str, variant: dict):
    """The family's default config with the sizes made small."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    base = cls().to_dict()
    for key in ("transformers_version", "architectures", "_name_or_path", "model_type"):
        base.pop(key, None)
    return cls(**_shrink(base, variant))


def _build(model_type: str, device: str = "cpu"):
    """The family's causal LM, small (random weights from a fixed seed on CPU): (model, None) or (None, why not)."""
    from transformers import AutoModelForCausalLM

    first = None
    for variant in VARIANTS:
        try:
            cfg = _small_config(model_type, variant)
            cfg._experts_implementation = "eager"
            with torch.device("meta"):
                meta = AutoModelForCausalLM.from_config(cfg)
            n = sum(p.numel() for p in meta.parameters())
            if n > MAX_PARAMS:
                return None, f"its config cannot be made small ({n / 1e6:.0f}M parameters left)"
            if device == "meta":
                return meta, None
            torch.manual_seed(0)
            return AutoModelForCausalLM.from_config(cfg).eval(), None
        except Exception as err:  # a config that rejects the small sizes or a model that cannot be built
            first = first or f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
    return None, f"cannot be built small on CPU ({first})"


@functools.lru_cache(maxsize=None)
def _census() -> Tuple[Tuple[str, ...], Dict[str, str]]:
    """The causal-LM families of the installed transformers with MoE blocks, and the families skipped (why)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers.logging.set_verbosity_error()
    moe, skipped = [], {}
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if model_type not in CONFIG_MAPPING_NAMES:
            skipped[model_type] = "no config class"
            continue
        model, why = _build(model_type, "meta")
        if model is None:
            skipped[model_type] = why
        elif any(True for _ in find_moe_blocks(model)):
            moe.append(model_type)
    return tuple(moe), skipped


def _tokens(ctx) -> int:
    return 6 if ctx.rank else 0 if ctx.world_size > 1 else 5


def _family_results(ctx, families) -> List[tuple]:
    """(family, block name, block class, got, expected, same routing, TypeError message or None) for every MoE
    block found; the block name is empty where the model could not be built."""
    transformers.logging.set_verbosity_error()
    out = []
    for model_type in families:
        model, why = _build(model_type)
        if model is None:
            out.append((model_type, "", "", None, None, False, why))
            continue
        for name, block in find_moe_blocks(model):
            try:
                ep = wrap_expert_parallel(block, ctx.group)
            except TypeError as err:
                out.append((model_type, name, type(block).__name__, None, None, False, str(err)))
                continue
            torch.manual_seed(100 + ctx.rank)
            x = torch.randn(2, 3 if _tokens(ctx) else 0, ep.experts.gate_up.shape[-1])
            with torch.no_grad():
                expected, got = block(x), ep(x)
                # a block may return (output, router logits), and its output [tokens, hidden] (Llama 4)
                expected = (expected[0] if isinstance(expected, tuple) else expected).reshape(got.shape)
                # the router child alone, where the block passes its output on unchanged, is the captured routing
                # (before identity experts are placed on the token's own rank; where router scores scale the
                # tokens, the experts of the largest scores, the scores scaling their input)
                flat = x.reshape(-1, x.shape[-1])
                router = ep.router.router if isinstance(ep.router, IdentitySlots) else ep.router
                capture = CapturedRouter(block, shared_part(block)[1])
                if ep.experts.input_scale is not None:
                    seen = capture.observe(flat[None], ep.experts.gate_up.shape[0] * ctx.world_size)
                    same = torch.equal(router(flat)[0], seen.index) if flat.numel() else True
                else:
                    # a block that adds its identity experts itself (LongCat-Flash from transformers 5.25) passes
                    # its experts the router's picks with those taken out
                    mine, theirs = router(flat), capture(flat)
                    same = all(torch.equal(a, b) for a, b in zip(mine, theirs)) or (
                        isinstance(ep.router, IdentitySlots) and folds_identity(mine, theirs, ep.router.n))
            out.append((model_type, name, type(block).__name__, got, expected, same, None))
    return out


def _wrap_body(ctx, families):
    out = []
    for kind in KINDS:
        for dtype in (torch.float32, torch.bfloat16):
            block = _block(kind).to(dtype)
            ep = wrap_expert_parallel(block, ctx.group)
            torch.manual_seed(100 + ctx.rank)
            x = torch.randn(2, _tokens(ctx), 16).to(dtype)
            with torch.no_grad():
                expected, got = block(x), ep(x)
            local = ep.experts.gate_up
            shares = local.untyped_storage().data_ptr() == block.experts.gate_up_proj.untyped_storage().data_ptr()
            out.append((kind, dtype, got, expected, local.shape[0], shares))
    return out, _family_results(ctx, families)


def _documented() -> Tuple[set, set]:
    """The families docs/expert-parallel.md lists as wrapping and as refused."""
    with open(DOCS, encoding="utf-8") as f:
        text = f.read()
    fit = re.search(r"Families checked with transformers ([\d.]+)[^:]*:(.*?)\n\n", text, re.S)
    refused = re.search(r"Families whose MoE blocks do not fit[^:]*:(.*?)\n\n", text, re.S)
    assert fit and refused, "docs/expert-parallel.md lists the families checked"
    heads = re.findall(r"^- (.*?):", refused.group(1), re.M)  # "- `a`, `b`: why"
    return set(re.findall(r"`([\w.-]+)`", fit.group(2))), {n for h in heads for n in re.findall(r"`([\w.-]+)`", h)}


@pytest.mark.parametrize("world", [2, 4])  # (one rank: the same wrapping with no exchange, in test_wrap's unit tests)
def test_wrapped_transformers_blocks_equal_the_original(world):
    families, skipped = _census()
    skipped = dict(skipped)
    start = time.monotonic()
    results = run_ranks(_wrap_body, world, families, timeout=600)
    fits: Dict[str, set] = {}
    refused: Dict[str, str] = {}
    for rank, (kinds, found) in enumerate(results):
        assert [r[0] for r in kinds[::2]] == list(KINDS)
        for kind, dtype, got, expected, n_local, shares in kinds:
            torch.testing.assert_close(got, expected, **TOL[dtype], msg=lambda m: f"rank {rank} {kind} {dtype}: {m}")
            assert n_local == 8 // world, "only this rank's experts are kept"
            assert not shares, "the local experts must not keep the full expert tensor alive"
        for family, name, cls, got, expected, same, err in found:
            if not name:  # the model could not be built in the rank (it could on the meta device)
                skipped[family] = err
            elif err is None:
                assert same, f"{family} {name}: the layer's router differs from the captured routing"
                scale = float(expected.abs().max()) if expected.numel() else 0.0
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * max(scale, 1.0),
                                           msg=lambda m: f"rank {rank} {family} {name} ({cls}): {m}")
                fits.setdefault(family, set()).add(cls)
            else:
                assert err.startswith(f"wrap_expert_parallel: {cls} does not fit: "), err
                refused[family] = err
    # a family may mix blocks that fit with blocks whose forward needs more than the tokens (DeepSeek-V4's
    # hash-routed layers need the token ids): it counts as refused; any other mix is a recognition bug
    mixed = set(fits) & set(refused)
    assert all("does not run on the tokens alone" in refused[f] for f in mixed), \
        f"families with blocks that both fit and do not: {sorted(mixed)}"
    for family in mixed:
        fits.pop(family)
    assert not [f for f in MUST_FIT if f in families and f not in fits], refused
    print(f"\n{world} rank(s), {time.monotonic() - start:.1f} s: {len(fits)} families wrap and equal the block: "
          f"{', '.join(sorted(fits))}")
    print(f"{len(refused)} families do not fit:\n" + "\n".join(f"  {f}: {e}" for f, e in sorted(refused.items())))
    print(f"{len(skipped)} families skipped (those built without MoE blocks are not listed):\n"
          + "\n".join(f"  {f}: {why}" for f, why in sorted(skipped.items())))
    if transformers.__version__.startswith("5.25."):  # the version docs/expert-parallel.md lists
        doc_fit, doc_refused = _documented()
        assert (doc_fit, doc_refused) == (set(fits), set(refused)), "update docs/expert-parallel.md"


# --- recognition details -----------------------------------------------------------------------------------------
def test_wrapped_qwen2_keeps_its_shared_expert_gate():
    block = _block("qwen2_moe")
    ep = wrap_expert_parallel(block)
    assert isinstance(ep, ExpertParallelMoE) and ep.shared.output_gate is block.shared_expert_gate
    assert ep.router.gate is block.gate  # the router is reused, not copied


def test_the_users_block_is_left_as_it_was():
    block = _block("qwen2_moe")
    children = dict(block.named_children())
    wrap_expert_parallel(block)
    assert dict(block.named_children()) == children
    x = torch.randn(1, 4, 16)
    with torch.no_grad():
        torch.testing.assert_close(block(x), _block("qwen2_moe")(x))


class _RoutesItself(nn.Module):
    """A block that computes its routing in its own forward (as transformers 4 did), with a gated shared expert."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.gate, self.experts = block.gate, block.experts
        self.shared_expert, self.shared_expert_gate = block.shared_expert, block.shared_expert_gate

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        weights, idx = F.linear(flat, self.gate.weight).softmax(-1).topk(3, dim=-1)
        return (self.experts(flat, idx, weights / weights.sum(-1, keepdim=True)) + shared).reshape(x.shape)


@pytest.mark.parametrize("own_routing", [False, True])
def test_the_router_computes_neither_experts_nor_shared_experts(own_routing):
    block = _RoutesItself(_block("qwen2_moe")) if own_routing else _block("qwen2_moe")
    ep = wrap_expert_parallel(block)
    assert isinstance(ep.router, CapturedRouter) == own_routing  # else the router child alone, as it is
    calls = []
    for name in ("experts", "shared_expert", "shared_expert_gate"):
        getattr(block, name).register_forward_hook(lambda *a, name=name: calls.append(name))
    x = torch.randn(1, 7, 16)
    with torch.no_grad():
        idx, weights = ep.router(x[0])
        assert idx.shape == weights.shape == (7, 3) and not calls
        torch.testing.assert_close(ep(x), block(x), rtol=1e-5, atol=1e-5)


def test_unsupported_module_names_what_is_expected():
    with pytest.raises(TypeError, match="unsupported module Linear.*MixtralSparseMoeBlock.*DeepseekV3MoE"):
        wrap_expert_parallel(nn.Linear(4, 4))


class _ScalesTokens(nn.Module):
    """A block whose router scales the tokens before its experts (as Llama 4 does)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.gate, self.experts = block.gate, block.experts

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _, weights, idx = self.gate(flat)
        # by the top expert's score (Llama 4 scales by its sigmoid score); a sum of normalized weights is 1
        return self.experts(flat * weights[:, :1], idx, weights).reshape(x.shape)


class _ScalesOutput(_ScalesTokens):
    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _, weights, idx = self.gate(flat)
        return 2.5 * self.experts(flat, idx, weights).reshape(x.shape)


@pytest.mark.parametrize("case, message", [
    ("tokens", "router transforms the tokens before the experts"),
    ("output", "scales the routed experts' output by 2.5"),
    ("bias", "experts .* have biases \\(extra_bias\\) that belong to none of their projections"),
    ("ignored_bias", "do not compute down\\(act\\(gate\\) \\* up\\) of their weights \\(and biases\\)"),
    ("ungated", "not gated"),
    ("clamp", "do not compute down\\(act\\(gate\\) \\* up\\)"),
    ("no_experts", "no routed experts found"),
])
def test_blocks_that_do_not_fit_are_refused_naming_the_part(case, message):
    block = _block("mixtral")
    if case == "tokens":
        block = _ScalesTokens(block)
    elif case == "output":
        block = _ScalesOutput(block)
    elif case == "bias":
        block.experts.extra_bias = nn.Parameter(torch.zeros(8, 16))
    elif case == "ignored_bias":  # a projection's bias that the experts' forward does not add
        block.experts.gate_up_proj_bias = nn.Parameter(torch.ones(8, 16))
    elif case == "ungated":
        block.experts.up_proj = block.experts.gate_up_proj
        del block.experts.gate_up_proj
    elif case == "clamp":
        block.experts.__class__ = type("ClampedExperts", (type(block.experts),), {"forward": _clamped_forward})
    else:
        block.experts = nn.Linear(16, 16)
    with pytest.raises(TypeError, match=f"does not fit: .*{message}"):
        wrap_expert_parallel(block)


def _clamped_forward(self, hidden_states, top_k_index, top_k_weights):
    out = torch.zeros_like(hidden_states)
    for t in range(hidden_states.shape[0]):
        for k in range(top_k_index.shape[1]):
            e = int(top_k_index[t, k])
            g, u = F.linear(hidden_states[t], self.gate_up_proj[e]).chunk(2)
            out[t] += top_k_weights[t, k] * F.linear(self.act_fn(g.clamp(max=7.0)) * u, self.down_proj[e])
    return out


def test_check_false_skips_the_probe():
    block = _ScalesOutput(_block("mixtral"))
    ep = wrap_expert_parallel(block, check=False)  # wrong, but not verified: the caller asked for that
    assert isinstance(ep, ExpertParallelMoE)


def test_reference_moe_keeps_its_router():
    moe = MoE(MoEConfig(hidden=16, ffn=8, n_experts=4, top_k=2))
    ep = wrap_expert_parallel(moe)
    assert ep.router is moe.router
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(ep(x), moe(x), rtol=1e-5, atol=1e-5)


def test_find_moe_blocks_finds_each_block_once():
    moe = MoE(MoEConfig(hidden=16, ffn=8, n_experts=4, top_k=2))
    model = nn.Sequential(nn.Linear(16, 16), moe, nn.ModuleDict({"inner": _block("mixtral")}))
    assert [(n, type(m).__name__) for n, m in find_moe_blocks(model)] == [("1", "MoE"),
                                                                         ("2.inner", "MixtralSparseMoeBlock")]


# --- experts sharded by a checkpoint loader ------------------------------------------------------------------------
def _sharded(block: nn.Module, first: int, n: int) -> nn.Module:
    """``block`` with its experts cut to ``first .. first + n - 1``, as a per-rank loader hands them over."""
    import copy

    block = copy.deepcopy(block)
    with torch.no_grad():
        block.experts.gate_up_proj = nn.Parameter(block.experts.gate_up_proj[first:first + n].clone())
        block.experts.down_proj = nn.Parameter(block.experts.down_proj[first:first + n].clone())
    block.experts.ep_shard = (first, 8)
    return block


def _shard_body(ctx):
    out = []
    for kind in ("qwen2_moe", "deepseek_v3"):
        full = _block(kind)
        n = 8 // ctx.world_size
        block = _sharded(full, ctx.rank * n, n)
        ep = wrap_expert_parallel(block, ctx.group)
        shares = ep.experts.gate_up.untyped_storage().data_ptr() == \
            block.experts.gate_up_proj.untyped_storage().data_ptr()
        torch.manual_seed(100 + ctx.rank)
        x = torch.randn(2, 3 + ctx.rank, 16)
        with torch.no_grad():
            out.append((kind, ep(x), full(x), ep.experts.first_expert, shares))
    wrong = _sharded(_block("mixtral"), 0 if ctx.rank else 8 // ctx.world_size, 8 // ctx.world_size)
    try:
        wrap_expert_parallel(wrong, ctx.group)
        out.append(None)
    except LayoutError as err:
        out.append(str(err))
    return out


@pytest.mark.parametrize("world", [2])
def test_experts_sharded_by_a_loader_are_used_as_they_are(world):
    for rank, out in enumerate(run_ranks(_shard_body, world, timeout=120)):
        for kind, got, expected, first, shares in out[:-1]:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} {kind}: {m}")
            assert first == rank * 8 // world and shares, "the loader's tensors are this rank's experts, not copied"
        assert out[-1] is not None and "ep_shard" in out[-1], out[-1]


# --- what experts compute besides down(act(gate) * up): biases, clamped GLUs, scaled tokens, identity experts ------
def _gpt_oss_block():
    return _block("gpt_oss")


def test_gpt_oss_experts_keep_their_biases_and_clamped_swiglu():
    from collectives.experts import ClampedSwiGLU

    block = _gpt_oss_block()
    ep = wrap_expert_parallel(block)
    assert isinstance(ep.experts.glu, ClampedSwiGLU) and ep.experts.gate_up_bias is not None
    x = torch.randn(1, 9, 16) * 8  # large enough to reach the clamp at 7
    with torch.no_grad():
        torch.testing.assert_close(ep(x), block(x)[0], rtol=1e-5, atol=1e-5)


def test_experts_whose_clamp_is_not_modelled_are_refused():
    block = _gpt_oss_block()
    block.experts.limit = 100.0  # said, but its forward clamps at 7 (read before: set on the instance)
    forward = type(block.experts)._apply_gate
    type(block.experts)._apply_gate = lambda self, h: forward(type("E", (), {"limit": 7.0, "alpha": self.alpha})(), h)
    try:
        with pytest.raises(TypeError, match="do not compute down\\(ClampedSwiGLU\\(alpha=1.702, limit=100.0\\)"):
            wrap_expert_parallel(block)
    finally:
        type(block.experts)._apply_gate = forward


def test_static_shape_layer_refuses_experts_it_does_not_compute():
    from collectives import capacity_expert_parallel

    with pytest.raises(TypeError, match="static-shape layer computes plain experts .* these have biases, the GLU"):
        capacity_expert_parallel(_gpt_oss_block())


class _Llama4Like(nn.Module):
    """Llama 4's MoE: the router's dense scores (sigmoid of the top-k logits, 0 elsewhere) scale each expert's
    copy of the tokens, every expert runs over all copies in one call, the outputs are summed (and a shared
    expert added); ``power`` 2 scales by the squared score instead, which no router output gives."""

    def __init__(self, power: int = 1):
        super().__init__()
        from transformers.models.llama4.modeling_llama4 import (Llama4Router, Llama4TextConfig, Llama4TextExperts,
                                                                Llama4TextMLP)

        cfg = Llama4TextConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
        torch.manual_seed(0)
        self.router, self.experts, self.shared_expert = Llama4Router(cfg), Llama4TextExperts(cfg), Llama4TextMLP(cfg)
        self.power = power
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0, 0.3)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        scores, _ = self.router(flat)
        routed = self.experts(flat.repeat(scores.shape[1], 1) * scores.transpose(0, 1).reshape(-1, 1) ** self.power)
        return self.shared_expert(flat) + routed.reshape(scores.shape[1], -1, flat.shape[-1]).sum(0)


def test_tokens_scaled_by_the_router_before_the_experts_are_scaled_on_the_experts_rank():
    block = _Llama4Like()
    ep = wrap_expert_parallel(block)
    assert ep.experts.input_scale is not None and ep.router.k == 2
    x = torch.randn(1, 7, 16)
    with torch.no_grad():
        idx, weights = ep.router(x[0])
        assert torch.equal(weights, torch.ones_like(weights))  # the score scales the expert's input, not its output
        torch.testing.assert_close(ep(x).reshape(7, 16), block(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="one tensor .*which is not, for each of its 4 experts, the tokens times"):
        wrap_expert_parallel(_Llama4Like(power=2))


def test_identity_experts_stay_on_the_tokens_own_rank():
    from collectives.wrap import IdentitySlots

    class Fixed(nn.Module):
        def forward(self, x):
            return torch.tensor([[0, 8], [5, 9]]), torch.ones(2, 2)

    idx, _ = IdentitySlots(Fixed(), n=8, world=2, rank=1)(torch.zeros(2, 4))
    # rank 0 holds experts 0-3 then its identity expert (ids 0-4), rank 1 experts 4-7 then its own (5-9)
    assert idx.tolist() == [[0, 9], [6, 9]]


def _longcat_block() -> nn.Module:
    """LongCat-Flash's MoE block, small: 8 weighted experts and 4 identity (zero-compute) experts, top-2."""
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashConfig, LongcatFlashMoE

    cfg = LongcatFlashConfig(hidden_size=16, expert_ffn_hidden_size=8, n_routed_experts=8, zero_expert_num=4,
                             moe_topk=2)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    block = LongcatFlashMoE(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


def _unpicked(block: nn.Module) -> None:
    """The router never picks the identity experts (their score correction bias far below the scores)."""
    with torch.no_grad():
        block.router.e_score_correction_bias[8:] = -10.0


def _equal_with_identity_picks(ep: ExpertParallelMoE, block: nn.Module) -> None:
    """``ep`` equals ``block`` on a batch that picks identity experts (the router's bias reset)."""
    with torch.no_grad():
        block.router.e_score_correction_bias.zero_()
        x = torch.randn(1, 9, 16)
        assert int(block.router(x.reshape(9, 16))[2].max()) >= 8
        torch.testing.assert_close(ep(x), block(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("unpicked", [False, True])
def test_longcat_flash_identity_experts_equal_the_block(unpicked):
    """Its identity experts, in its experts module (transformers < 5.25) or added by the block itself (5.25 on):
    one identity expert per rank, the router child as the routing; recognised also where the probe's tokens
    pick none."""
    block = _longcat_block()
    if unpicked:
        _unpicked(block)
    ep = wrap_expert_parallel(block)
    assert ep.experts.identity == 1 and ep.num_experts == 9  # 8 weighted experts, one identity expert here
    assert isinstance(ep.router, IdentitySlots) and ep.router.router.gate is block.router
    _equal_with_identity_picks(ep, block)


def test_identity_experts_that_do_not_return_the_token_are_refused():
    block = _longcat_block()
    if not isinstance(getattr(block.experts, "identity_expert", None), nn.Identity):
        pytest.skip("transformers >= 5.25: the block adds its identity experts itself (test_a_block_that_adds_...)")
    block.experts.identity_expert = nn.Tanh()  # no identity any more, though the router still picks those ids
    block.experts.add_module("spare", nn.Identity())
    with pytest.raises(TypeError, match="past its 8 weighted experts, and its experts do not return the token"):
        wrap_expert_parallel(block)


class _AddsIdentity(nn.Module):
    """A block that adds its identity experts itself, as LongCat-Flash's does from transformers 5.25: its experts
    get the identity picks (ids past the weighted experts) with weight 0, on the id ``dummy`` maps them to, and
    it adds ``identity(token)`` times their weight."""

    def __init__(self, block: nn.Module, identity=lambda h: h, dummy=lambda idx, n: idx % n):
        super().__init__()
        self.router, self.experts = block.router, block.experts
        self.identity, self.dummy, self.n = identity, dummy, block.experts.down_proj.shape[0]

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _, w, idx = self.router(flat)
        past = idx >= self.n
        routed = self.experts(flat, torch.where(past, self.dummy(idx, self.n), idx), w.masked_fill(past, 0.0))
        return (routed + self.identity(flat) * w.masked_fill(~past, 0.0).sum(-1, keepdim=True)).reshape(x.shape)


@pytest.mark.parametrize("unpicked", [False, True])
def test_a_block_that_adds_its_identity_experts_itself(unpicked):
    """Recognised by what it does, with any transformers 5 (LongCat-Flash's experts module before 5.25 also holds
    an identity expert, unused here), also where the probe's tokens pick no identity expert."""
    block = _AddsIdentity(_longcat_block())
    if unpicked:
        _unpicked(block)
    ep = wrap_expert_parallel(block)
    assert ep.experts.identity == 1 and ep.num_experts == 9 and ep.router.router.gate is block.router
    _equal_with_identity_picks(ep, block)


@pytest.mark.parametrize("case", ["zero", "tanh", "zero_unpicked", "out_of_range"])
def test_a_block_whose_identity_picks_add_other_than_the_token_is_refused(case):
    """Zero-compute experts that return zeros (also where the probe's tokens pick none) or anything but the
    token, or identity picks passed on past the weighted experts: refused in one line."""
    dummy = (lambda idx, n: idx) if case == "out_of_range" else (lambda idx, n: idx % n)
    identity = {"tanh": torch.tanh, "out_of_range": lambda h: h}.get(case, torch.zeros_like)
    block = _AddsIdentity(_longcat_block(), identity, dummy)
    if case == "zero_unpicked":
        _unpicked(block)
    # (ids passed on past the weighted experts: refused as any block whose output or forward does not fit)
    message = "" if case == "out_of_range" else (
        "its output is not routed experts \\+ shared part on a probe batch .*: it takes its router's picks past its "
        "8 weighted experts out of its experts' and adds other than the token times their weight")
    with pytest.raises(TypeError, match=f"^wrap_expert_parallel: _AddsIdentity does not fit: {message}") as err:
        wrap_expert_parallel(block)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_local_experts_with_biases_a_glu_and_identity_experts(impl):
    from collectives.experts import ClampedSwiGLU, LocalExperts

    gen = torch.Generator().manual_seed(3)
    gate_up, down = torch.randn(2, 8, 16, generator=gen), torch.randn(2, 16, 4, generator=gen)
    b_gu, b_d = torch.randn(2, 8, generator=gen), torch.randn(2, 16, generator=gen)
    glu = ClampedSwiGLU(1.702, 7.0)
    experts = LocalExperts(gate_up, down, impl=impl, gate_up_bias=b_gu, down_bias=b_d, glu=glu, identity=1)
    x = torch.randn(7, 16, generator=gen)
    counts = [2, 3, 2]  # the last two rows go to the identity expert

    def one(row, e):
        g, u = F.linear(row, gate_up[e], b_gu[e]).chunk(2, dim=-1)
        return F.linear(glu(g, u), down[e], b_d[e])

    want = torch.stack([one(x[i], 0) for i in range(2)] + [one(x[i], 1) for i in range(2, 5)] + [x[5], x[6]])
    torch.testing.assert_close(experts(x, counts), want, rtol=1e-5, atol=1e-5)
    padded = torch.cat([x, torch.full((3, 16), float("nan"))])  # rows past a group list's sum are padding
    got = experts(padded, torch.tensor(counts))
    torch.testing.assert_close(got[:7], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[7:], torch.zeros(3, 16))
