"""``--check`` of a quantized checkpoint: the run against the dequantized float model of the same checkpoint
(launch/models/quantized/check.py, launch/measure/quantized.py), its bounds per format, the quantized bytes in
results.json and the headline, and ``--dry-run``'s bytes of a quantized checkpoint (launch/memory.py).

Small models of qwen3_moe and deepseek_v3 are quantized by each format's own rules (`save_quantized`): FP8 in
blocks of 128 (hidden 160: an edge of 32), W8A8 dynamic, and W8A8 static (the dense projections with their
activation parameters).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from collectives import QuantizedExperts
from launch.models.quantized.check import (FORMATS, LogitFigures, QuantizedCheck, TokenFigures, bound, logit_figures,
                                           over_ranks, token_figures)

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from launch.models.checkpoint import load_checkpoint  # noqa: E402
from launch.models.quantized import save_quantized  # noqa: E402
from support.launcher import GENERATE, run_launcher  # noqa: E402
from support.quantized import FAMILIES, small_model, wrapped  # noqa: E402

WRITTEN = {"fp8": ("fp8", False), "w8a8_dynamic": ("w8a8", False), "w8a8_static": ("w8a8", True)}
SMALL = ["--batch", "2", "--seq-len", "8", "--iters", "1", "--warmup", "0", "--new-tokens", "4"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(family, format) -> the checkpoint's folder."""
    out = {}
    for family in FAMILIES:
        model = small_model(family)
        for fmt, (method, static) in WRITTEN.items():
            path = str(tmp_path_factory.mktemp(f"{family}-{fmt}"))
            save_quantized(model, path, method, static=static)
            out[(family, fmt)] = path
    return out


IDS = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _greedy(model, steps: int = 6):
    """Each request's greedy tokens over ``steps`` and the top-1 minus top-2 logit at each."""
    ids, tokens, margins = IDS, [[] for _ in IDS], [[] for _ in IDS]
    for _ in range(steps):
        top = model(ids).logits[:, -1].float().topk(2, dim=-1)
        for r in range(len(ids)):
            tokens[r].append(int(top.indices[r, 0]))
            margins[r].append(float(top.values[r, 0] - top.values[r, 1]))
        ids = torch.cat([ids, top.indices[:, :1]], dim=1)
    return tokens, margins


def _check(quantized, floats, fmt: str) -> QuantizedCheck:
    """``quantized`` (wrapped) against ``floats``: the prompts' logits and 6 greedy tokens."""
    with torch.no_grad():
        logits = logit_figures(quantized(IDS).logits, floats(IDS).logits)
    want, margins = _greedy(floats)
    kernels = tuple(sorted({m.last_kernel for m in quantized.modules() if isinstance(m, QuantizedExperts)}))
    return QuantizedCheck(fmt, torch.float32, logits, token_figures(_greedy(quantized)[0], want, margins), kernels)


# ------------------------------------------------------------------------------------------- the figures


def test_identical_runs_pass_with_every_figure_at_its_best():
    logits = torch.randn(3, 5, 128)
    check = QuantizedCheck("fp8", torch.float32, logit_figures(logits, logits.clone()),
                           token_figures([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]], [[1.0] * 3, [1.0] * 2]))
    assert check.logits.max_abs == 0 and check.tokens.share == 1 and check.tokens.first is None
    assert check.failures() == [] and "100.0% of the greedy tokens identical (5 of 5), no step differs" in \
        check.lines()[1]


def test_a_flip_at_step_k_is_found_with_its_margin_and_judged_by_it():
    want, margins = [[7, 8, 9, 10], [1, 2, 3, 4]], [[5.0, 4.0, 3.0, 2.0], [5.0, 5.0, 1e-6, 5.0]]
    t = token_figures([[7, 8, 9, 10], [1, 2, 6, 6]], want, margins)
    assert (t.identical, t.total, t.first, t.margin) == (6, 8, (1, 2), 1e-6)
    logits = LogitFigures(max_abs=1e-6, largest=2.0)
    assert QuantizedCheck("w8a8_dynamic", torch.float32, logits, t).failures() == []  # a rounding flip
    wide = token_figures([[7, 8, 0, 10], [1, 2, 3, 4]], want, margins)  # margin 3.0 at step 2: not rounding
    (line,) = QuantizedCheck("w8a8_dynamic", torch.float32, logits, wide).failures()
    assert "differ from the dequantized model's at step 2 of request 0" in line and "margin 3" in line
    assert "bound 4e-05" in line and "w8a8 dynamic in float32" in line  # twice 1e-5 of the largest logit, 2.0


def test_logits_beyond_the_bound_fail_in_one_line_naming_the_figure_and_the_bound():
    want = torch.zeros(2, 4, 8)
    want[0, 0, 0] = 10.0
    got = want.clone()
    got[1, 2, 3] = 0.5  # 5e-2 of the largest logit
    check = QuantizedCheck("w8a8_static", torch.bfloat16, logit_figures(got, want))
    (line,) = check.failures()
    assert "differ from the dequantized model's by 5.000e-01, 5.00e-02 of the largest logit" in line
    assert "bound 1.6e-02 for w8a8 static in bfloat16" in line
    nan = got.clone()
    nan[0, 0, 1] = float("nan")
    assert QuantizedCheck("fp8", torch.float32, logit_figures(nan, want)).failures()  # NaN never passes
    assert QuantizedCheck("fp8", torch.float32, logit_figures(got[:1], want)).failures()  # nor another shape
    with pytest.raises(ValueError, match="quantized format must be one of"):
        bound("int4", torch.float32)


def test_a_kernel_that_quantizes_the_activations_is_judged_on_the_typical_tokens():
    """With int_mm (npu_w8a8, scaled_mm) a router's near-tie may flip and one token's logits move far: the logits
    are judged at the 90th percentile of the tokens against the kernel's wider bound, tokens that differ are
    reported; a difference in more than a tenth of the tokens fails, and the exact kernels keep the largest."""
    want = torch.zeros(1, 20, 8)
    want[0, 0, 0] = 10.0
    one = want.clone()
    one[0, 5, 3] = 3.0  # one token of 20 rerouted: 0.3 of the largest logit
    figures = logit_figures(one, want)
    assert figures.relative == pytest.approx(0.3) and figures.typical_relative == 0
    flipped = token_figures([[1, 2, 9]], [[1, 2, 3]], [[5.0, 5.0, 5.0]])  # a large margin: no rounding flip
    widened = QuantizedCheck("w8a8_dynamic", torch.float32, figures, flipped, ("int_mm",))
    assert widened.widened and widened.relative_bound == 2e-2 and widened.failures() == []
    assert "90% of the tokens within 0.00e+00, bound 2.0e-02" in widened.lines()[0]
    assert len(QuantizedCheck("w8a8_dynamic", torch.float32, figures, flipped, ("reference",)).failures()) == 2
    many = want.clone()
    many[0, :3, 3] = 0.5  # 3 tokens of 20 off by 5e-2: beyond the 90th percentile
    (line,) = QuantizedCheck("w8a8_dynamic", torch.float32, logit_figures(many, want), None, ("int_mm",)).failures()
    assert line.startswith("90% of the tokens' logits differ from the dequantized model's by up to 5.00e-02")
    assert "(bound 2.0e-02 for w8a8 dynamic in float32 by int_mm)" in line
    nan = one.clone()
    nan[0, 1, 1] = float("nan")
    assert QuantizedCheck("w8a8_dynamic", torch.float32, logit_figures(nan, want), None, ("int_mm",)).failures()


def test_every_ranks_figures_as_one_judge_the_worst_first_difference():
    posts = [{"logits": {"max_abs": 1e-7, "largest": 3.0},
              "tokens": {"identical": 4, "total": 4, "first": None, "margin": None}},
             {"logits": {"max_abs": 2e-7, "largest": 2.0},
              "tokens": {"identical": 1, "total": 4, "first": [0, 1], "margin": 9.0}}]
    logits, tokens = over_ranks(posts)
    assert logits == LogitFigures(2e-7, 3.0)
    assert tokens == TokenFigures(5, 8, (0, 1), 9.0)
    assert QuantizedCheck("fp8", torch.float32, logits, tokens).failures()  # rank 1's flip is no rounding


# ------------------------------------------------------------------------------ the test checkpoints


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_formats_bound_holds_on_the_test_checkpoints(written, family, fmt):
    path = written[(family, fmt)]
    model, report = load_checkpoint(path)
    floats, _ = load_checkpoint(path, dequantize=True)
    assert report.quantized_format == fmt
    check = _check(wrapped(model), floats, fmt)
    assert check.failures() == [], check.lines()
    assert check.kernels == ("reference",)  # CPU's: the weights dequantized, float rounding only
    assert check.logits.relative <= bound(fmt, torch.float32, check.kernels) and check.tokens.share == 1.0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_scale_doubled_on_one_expert_is_caught(written, family):
    """Each expert's down-projection scales x2 in turn: the check fails, or the prompts route no token to that
    expert and the logits are the same bits; at least one expert is caught (a wrong answer never passes)."""
    path = written[(family, "fp8")]
    floats, _ = load_checkpoint(path, dequantize=True)
    model = wrapped(load_checkpoint(path)[0])
    (experts,) = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
    with torch.no_grad():
        right = model(IDS).logits
    caught = []
    for e in range(experts.num_local):
        experts.down_weight_scale_inv[e] *= 2
        with torch.no_grad():
            same = torch.equal(model(IDS).logits, right)
        failures = _check(model, floats, "fp8").failures()
        experts.down_weight_scale_inv[e] /= 2
        assert same or failures, f"expert {e}: a doubled scale passed"
        caught += failures
    assert caught and "of the largest logit (bound 1.0e-05 for fp8 in float32)" in caught[0]


def test_a_sharded_checkpoints_experts_are_not_replicated_weights(written):
    """The transformers model's own tree still holds a loader's shard of the experts beside its expert-parallel
    layers: they differ between ranks by design (before: every generation from a checkpoint on 2 ranks stopped
    at `ranks hold different weights: ...experts.gate_up_proj`)."""
    from launch.engine.alike import replicated_parameters

    model, _ = load_checkpoint(written[("qwen3_moe", "fp8")], rank=1, world=2, dequantize=True)
    names = [n for n, _ in replicated_parameters(model)]
    assert names and not [n for n in names if ".experts." in n]


def test_a_quantized_transformers_model_refuses_captured_decode_steps(written):
    """``--decode-graph cpu``: the static decode runs the reference decoder only; a quantized checkpoint's model is
    refused in one line (the launcher's ValueError -> exit 2 on every rank), as every transformers model."""
    from launch.engine import GraphDecoder, new_cache
    from launch.models import adapt

    model = adapt(load_checkpoint(written[("deepseek_v3", "w8a8_static")])[0], check=False)
    with pytest.raises(ValueError, match="GraphDecoder runs the reference decoder") as err:
        GraphDecoder(model, new_cache(model, [[1, 2, 3]], 2), "serial", path="cpu")
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------- --dry-run's bytes


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("fmt", ["fp8", "w8a8_static"])
def test_the_dry_runs_bytes_of_a_quantized_checkpoint_equal_what_a_rank_holds(written, family, fmt):
    """1 byte a quantized weight plus its scales (FP8's per block of 128, edges included; W8A8's per channel, and
    static W8A8's activation parameters), the rest in the run's dtype: rank 0 of 2 holds exactly that (before: 4
    bytes a weight, as a float32 checkpoint)."""
    from collectives import QuantizedLinear
    from launch.config import job_config
    from launch.memory import estimate

    path = written[(family, fmt)]
    job = job_config(world=2, device="cpu", exec_path="auto", mode="serial", kv_offload=False, kv_store="memory",
                     preset_name="tiny", overrides={}, batch=2, seq_len=8, seq_lens=None, dtype="float32", warmup=0,
                     iters=1, seed=0, check=False, out_dir=None, cpu_link="off", timeout=30.0, model_name=path)
    need = estimate(job, 2, deployed=True)
    model, _ = load_checkpoint(path, rank=0, world=2)
    kept = [m for m in model.modules() if isinstance(m, (QuantizedExperts, QuantizedLinear))]
    held = sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for m in kept for b in m.buffers())
    experts = sum(b.numel() * b.element_size() for m in kept if isinstance(m, QuantizedExperts) for b in m.buffers())
    assert (need.weights, need.expert_weights) == (held, experts)


# ---------------------------------------------------------------------------------------- the launcher


@pytest.mark.spawns_ranks  # starts the launcher: processes of its own
def test_generation_from_a_quantized_checkpoint_on_2_ranks_checks_every_mode_and_writes_its_bytes(written, tmp_path):
    """W8A8 static, 2 ranks, every decode mode through the capacity exchange: the modes generate serial's tokens,
    serial the dequantized model's; the headline and results.json carry the format and each rank's bytes (before:
    the reference's sharded experts stopped the generation, ranks holding different weights)."""
    out = str(tmp_path / "out")
    proc = run_launcher(["--model", written[("deepseek_v3", "w8a8_static")], "--check", "--decode-mode", "all",
                         "--out", out] + SMALL, ranks=2, script=GENERATE, timeout=240)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert "weights w8a8 static kept quantized, per rank at most experts" in proc.stdout
    assert "check: quantized (w8a8 static in float32) against the dequantized model: 100.0% of the greedy " \
           "tokens identical" in proc.stdout
    assert "every mode generates serial's tokens and serial the dequantized model's" in proc.stdout
    with open(os.path.join(out, "results.json")) as f:
        quantized = json.load(f)["quantized"]
    assert quantized["format"] == "w8a8_static" and len(quantized["bytes_per_rank"]) == 2
    assert all(r["experts"] > 0 and r["dense"] > 0 and r["scales"] > 0 for r in quantized["bytes_per_rank"])
    assert quantized["check"]["passed"] and quantized["check"]["identical_tokens"] == 1.0


@pytest.mark.spawns_ranks  # starts the launcher: processes of its own
def test_a_doubled_scale_fails_the_launchers_check_in_one_line(written, tmp_path):
    """One rank computing with expert 0's down scales x2 (``$OVERLAP_FAULT`` ``kind=scale``; a doubled scale in the
    checkpoint's file is the dequantized model's too, so the check cannot see it): exit 1 naming the figure and the
    bound (before: the model's own forward ran on the quantized experts, a TypeError and a traceback)."""
    proc = run_launcher(["--model", written[("qwen3_moe", "fp8")], "--check", "--out", str(tmp_path / "out")] + SMALL,
                        script=GENERATE, timeout=240, env={"OVERLAP_FAULT": "rank=0,kind=scale"})
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "the quantized run's logits differ from the dequantized model's by" in proc.stdout
    assert "(bound 1.0e-05 for fp8 in float32)" in proc.stdout
    with open(os.path.join(tmp_path / "out", "results.json")) as f:
        assert json.load(f)["quantized"]["check"]["passed"] is False


# ------------------------------------------------------------------ --quantize: the seeded models in memory


def _reference(method=None, dequantize=False):
    """The tiny reference decoder, expert-parallel on one rank, quantized in memory by ``method`` (or not)."""
    from launch.engine import make_expert_parallel
    from launch.models import preset
    from launch.models.quantized.in_memory import quantize_in_memory
    from launch.models.reference import build_model

    model = make_expert_parallel(build_model(preset("tiny"), seed=3), None)
    if method is not None:
        quantize_in_memory(model, method, dequantize=dequantize)
    return model


@pytest.mark.parametrize("method,fmt", [("fp8", "fp8"), ("w8a8", "w8a8_dynamic")])
def test_the_reference_decoder_quantized_in_memory_stays_quantized_and_decodes_in_every_mode(method, fmt):
    """Its experts and projections kept float8 / int8 with their scales (the router, embedding and LM head as they
    are); within the format's bound of the dequantized model it came from, the same greedy tokens in every decode
    mode, eager and as the static decode (``--decode-graph cpu``: a padded step, a device group list)."""
    from collectives import QuantizedLinear
    from launch.engine import GraphDecoder, generate, new_cache, prefill, split_for
    from microbatch import DECODE_MODES
    from microbatch.batch import Batch

    model, floats = _reference(method), _reference(method, dequantize=True)
    dtype = torch.float8_e4m3fn if method == "fp8" else torch.int8
    experts = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(experts) == 2 and all(e.gate_up_q.dtype == dtype for e in experts)
    assert linears and all(m.weight.dtype == dtype for m in linears)
    assert model.lm_head.weight.dtype == model.embed.weight.dtype == torch.float32
    batch = Batch.random([6, 5], model.cfg.vocab, seed=1)
    with torch.no_grad():
        got, want = (m.logits(prefill(m, batch, "serial", split_for("serial", batch, None, model=m)))
                     for m in (model, floats))
    prompts, n = [[1, 2, 3], [4, 5, 6, 7]], 5
    reference = generate(floats, prompts, n, mode="serial", margins=True)
    serial = generate(model, prompts, n, mode="serial")
    kernels = tuple(sorted({e.last_kernel for e in experts}))
    assert kernels == ("reference",)  # CPU's
    check = QuantizedCheck(fmt, torch.float32, logit_figures(got, want),
                           token_figures(serial.tokens, reference.tokens, reference.margins), kernels)
    assert check.failures() == [], check.lines()
    for mode in [m for m in DECODE_MODES if m != "serial"]:
        assert generate(model, prompts, n, mode=mode).tokens == serial.tokens, mode
    captured = GraphDecoder(model, new_cache(model, prompts, n), "two-batch", path="cpu")
    assert generate(model, prompts, n, decoder=captured).tokens == serial.tokens


def test_quantize_in_memory_refuses_what_it_cannot_keep_quantized():
    from launch.models.quantized.in_memory import quantize_in_memory
    from launch.models.reference import build_model
    from launch.models import preset

    with pytest.raises(ValueError, match="the format must be one of"):
        quantize_in_memory(_reference(), "int4")
    with pytest.raises(ValueError, match="no expert-parallel MoE layer"):
        quantize_in_memory(build_model(preset("tiny"), seed=0), "fp8")


def _job(model_name="reference", world=2, **more):
    from launch.config import job_config

    options = dict(world=world, device="cpu", exec_path="auto", mode="serial", kv_offload=False, kv_store="memory",
                   preset_name="tiny", overrides={}, batch=2, seq_len=8, seq_lens=None, dtype="float32", warmup=0,
                   iters=1, seed=0, check=False, out_dir=None, cpu_link="off", timeout=30.0, model_name=model_name)
    return job_config(**{**options, **more})


def test_quantize_refuses_a_checkpoint_in_one_line(written):
    from launch.config import ConfigError

    path = written[("qwen3_moe", "fp8")]
    with pytest.raises(ConfigError) as err:
        _job(path, world=1, quantize="w8a8")
    assert str(err.value).startswith(f"--quantize w8a8: --model {path} is a checkpoint, whose weights are what it "
                                     f"holds") and "\n" not in str(err.value)


@pytest.mark.parametrize("method", ["fp8", "w8a8"])
def test_the_dry_runs_bytes_with_quantize_equal_what_a_rank_holds(method):
    """The reference decoder over 2 ranks with ``--quantize``: 1 byte a quantized weight plus its scales, the
    embedding, norms, routers and LM head in the run's dtype (before: 4 bytes a weight)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from collectives import QuantizedLinear
    from launch.build import build_model
    from launch.engine import make_expert_parallel
    from launch.memory import estimate
    from launch.models.quantized.in_memory import quantize_in_memory

    job = _job(quantize=method)
    try:
        torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    except ValueError:  # under torchrun the job's group is this process's default
        pytest.skip("a process group is already set up in this process")
    try:
        model, _ = build_model(job, 0, 2, torch.device("cpu"))
        make_expert_parallel(model, torch.distributed.group.WORLD)
        quantize_in_memory(model, method)
    finally:
        torch.distributed.destroy_process_group()
    kept = [m for m in model.modules() if isinstance(m, (QuantizedExperts, QuantizedLinear))]
    held = sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for m in kept for b in m.buffers())
    experts = sum(b.numel() * b.element_size() for m in kept if isinstance(m, QuantizedExperts) for b in m.buffers())
    need = estimate(job, 2, deployed=True)
    assert (need.weights, need.expert_weights) == (held, experts)
