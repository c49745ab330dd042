"""The check of a quantized run against the dequantized float model of the same checkpoint: its figures and bounds.

A quantized run keeps each weight quantized and dequantizes it as it runs (the CPU reference path,
`collectives.QuantizedExperts` / `collectives.QuantizedLinear`); the reference is the float model the checkpoint
stands for (`launch.models.load_checkpoint(..., dequantize=True)`), run the same way. The figures:

- prefill: the largest logit difference, absolute and relative to the reference's largest logit
  (`logit_figures` -> `LogitFigures`);
- generation: the share of identical greedy tokens, and the first differing step with the reference's margin
  there, its top-1 minus top-2 logit (`token_figures` -> `TokenFigures`): a margin within twice the logit bound
  is a rounding flip (each of the two logits moved by at most the bound), a larger one a wrong answer.

`QuantizedCheck` holds them with the format's bound (`BOUNDS`, `bound`) and says what fails, one line each,
naming the figure and the bound. Where the experts' kernels quantize the activations too (`KERNEL_BOUNDS`), their
rounding may flip a router's near-tie, and a token routed to another expert differs by far more than the rounding:
then the logits are judged at the 90th percentile of the tokens (`LogitFigures.typical_abs`) and differing greedy
tokens are reported, not failed. How the bounds are derived: docs/checkpoints.md.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

FORMATS = ("fp8", "w8a8_dynamic", "w8a8_static")

# The reference path dequantizes each weight by the rule the dequantized load applies and keeps activations in the
# run's dtype, so a quantized run differs from its dequantized model by the float rounding of the same operations
# in another order, whatever the format: measured at the test sizes (tests/test_quantized_check.py) 1.5e-7 in
# float32 and 4.3e-3 (about 2^-8, bf16's unit roundoff) in bf16, relative to the largest logit. The bounds are
# these figures with room: 1e-5 in float32 (about 100x), 4 x 2^-8 in bf16 / fp16 (about 4x).
_FLOAT32_REL = 1e-5
_LOW_PRECISION_REL = 4 * 2.0 ** -8
BOUNDS: Dict[str, Dict[torch.dtype, float]] = {
    fmt: {torch.float32: _FLOAT32_REL, torch.bfloat16: _LOW_PRECISION_REL, torch.float16: _LOW_PRECISION_REL}
    for fmt in FORMATS}
# The experts' kernels that quantize the activations too (`collectives.quantized_kernels`) add the activations'
# rounding: int8 per token (W8A8: `int_mm`, `npu_w8a8`) and e4m3 per 128 columns (FP8: `scaled_mm`), measured at the
# test sizes (qwen3_moe and deepseek_v3, 3 prompts each) at most 5.1e-3 and 2.2e-2 of the largest logit; the
# bounds keep about 4x and 3x of room.
KERNEL_BOUNDS: Dict[str, float] = {"int_mm": 2e-2, "npu_w8a8": 2e-2, "scaled_mm": 6e-2}

__all__ = ["BOUNDS", "FORMATS", "KERNEL_BOUNDS", "TYPICAL", "LogitFigures", "QuantizedCheck", "TokenFigures", "bound", "logit_figures",
           "over_ranks", "token_figures"]


def bound(fmt: str, dtype: torch.dtype, kernels: Sequence[str] = ()) -> float:
    """The largest logit difference, relative to the largest logit, a run of format ``fmt`` (one of `FORMATS`) in
    ``dtype`` may show against its dequantized model, its experts computed by ``kernels`` (those that quantize the
    activations widen it: `KERNEL_BOUNDS`)."""
    if fmt not in BOUNDS:
        raise ValueError(f"quantized format must be one of {FORMATS}, got {fmt!r}")
    return max([BOUNDS[fmt].get(dtype, _LOW_PRECISION_REL)] + [KERNEL_BOUNDS.get(k, 0.0) for k in kernels])


TYPICAL = 0.9  # the share of tokens whose logits a kernel that quantizes the activations is judged on


@dataclasses.dataclass(frozen=True)
class LogitFigures:
    """The largest ``|quantized - dequantized|`` logit (``max_abs``), the reference's largest ``|logit|``, and the
    largest difference of the `TYPICAL` share of tokens that differ least (``typical_abs``; None: ``max_abs``)."""

    max_abs: float
    largest: float
    typical_abs: Optional[float] = None

    @property
    def relative(self) -> float:
        """``max_abs`` relative to the largest logit (inf where a difference is not finite)."""
        return self.max_abs / max(self.largest, 1e-30)

    @property
    def typical_relative(self) -> float:
        """``typical_abs`` relative to the largest logit."""
        return (self.max_abs if self.typical_abs is None else self.typical_abs) / max(self.largest, 1e-30)


def logit_figures(got: torch.Tensor, want: torch.Tensor) -> LogitFigures:
    """The figures of logits ``got`` (the quantized run) against ``want`` (the dequantized model); a shape that
    differs, or a NaN, makes the difference inf."""
    if got.shape != want.shape:
        return LogitFigures(float("inf"), float(want.abs().max()) if want.numel() else 0.0)
    if not got.numel():
        return LogitFigures(0.0, 0.0)
    per_token = (got.float() - want.float()).abs().reshape(-1, got.shape[-1]).amax(dim=-1)
    if not bool(torch.isfinite(per_token).all()):
        return LogitFigures(float("inf"), float(want.float().abs().max()), float("inf"))
    return LogitFigures(float(per_token.max()), float(want.float().abs().max()),
                        float(torch.quantile(per_token, TYPICAL, interpolation="higher")))


@dataclasses.dataclass(frozen=True)
class TokenFigures:
    """Greedy tokens against the reference's: ``identical`` of ``total`` positions, and the first position that
    differs (``first``: ``(request, step)``, None where none does) with the reference's ``margin`` there."""

    identical: int
    total: int
    first: Optional[Tuple[int, int]] = None
    margin: Optional[float] = None

    @property
    def share(self) -> float:
        return self.identical / self.total if self.total else 1.0


def token_figures(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]],
                  margins: Optional[Sequence[Sequence[float]]]) -> TokenFigures:
    """The figures of tokens ``got`` (per request) against ``want``; ``margins``: the reference's top-1 minus
    top-2 logit at each of its steps. A position one of them lacks (a request that stopped earlier) differs."""
    identical = total = 0
    first: Optional[Tuple[int, int]] = None
    for req, (a, b) in enumerate(zip(got, want)):
        for step in range(max(len(a), len(b))):
            same = step < len(a) and step < len(b) and a[step] == b[step]
            identical, total = identical + int(same), total + 1
            if not same and (first is None or step < first[1]):
                first = (req, step)
    margin = None
    if first is not None and margins is not None and first[1] < len(margins[first[0]]):
        margin = float(margins[first[0]][first[1]])
    return TokenFigures(identical, total, first, margin)


@dataclasses.dataclass(frozen=True)
class QuantizedCheck:
    """A quantized run's figures against its dequantized model, with the format's bound (relative to the largest
    logit); ``tokens`` only for a generation."""

    format: str
    dtype: torch.dtype
    logits: LogitFigures
    tokens: Optional[TokenFigures] = None
    kernels: Tuple[str, ...] = ()  # the experts' kernels that ran (`collectives.QuantizedExperts.last_kernel`)

    @property
    def relative_bound(self) -> float:
        return bound(self.format, self.dtype, self.kernels)

    @property
    def widened(self) -> bool:
        """Whether a kernel that quantizes the activations ran (`KERNEL_BOUNDS`): judged on the typical tokens."""
        return any(k in KERNEL_BOUNDS for k in self.kernels)

    @property
    def margin_bound(self) -> float:
        """The largest reference margin a rounding flip explains: twice the logit bound, in logits."""
        return 2 * self.relative_bound * self.logits.largest

    def failures(self) -> List[str]:
        """What the figures break, one line each naming the figure and its bound."""
        out = []
        if self.widened:
            if not self.logits.typical_relative <= self.relative_bound:  # `not <=`: inf and NaN fail
                out.append(f"{TYPICAL:.0%} of the tokens' logits differ from the dequantized model's by up to "
                           f"{self.logits.typical_relative:.2e} of the largest logit (bound {self.relative_bound:.1e} "
                           f"for {self._named()})")
            return out
        if not self.logits.relative <= self.relative_bound:  # `not <=`: inf and NaN fail
            out.append(f"the quantized run's logits differ from the dequantized model's by {self.logits.max_abs:.3e}, "
                       f"{self.logits.relative:.2e} of the largest logit (bound {self.relative_bound:.1e} for "
                       f"{self._named()})")
        t = self.tokens
        if t is not None and t.first is not None and not (t.margin is not None and t.margin <= self.margin_bound):
            there = "no margin known" if t.margin is None else f"the dequantized model's margin {t.margin:.3g}"
            out.append(f"the quantized run's tokens differ from the dequantized model's at step {t.first[1]} of "
                       f"request {t.first[0]}, where {there} is above what rounding flips (bound "
                       f"{self.margin_bound:.3g}, twice the logit bound, for {self._named()})")
        return out

    def lines(self) -> List[str]:
        """The figures in words."""
        judged = (f"; {TYPICAL:.0%} of the tokens within {self.logits.typical_relative:.2e}, bound "
                  f"{self.relative_bound:.1e}: a router's flipped near-tie may move the rest" if self.widened else
                  f"; bound {self.relative_bound:.1e}")
        out = [f"quantized ({self._named()}) against the dequantized model: largest logit difference "
               f"{self.logits.max_abs:.3e} ({self.logits.relative:.2e} of the largest logit {self.logits.largest:.3g}"
               f"{judged})"]
        t = self.tokens
        if t is not None:
            where = "no step differs" if t.first is None else (
                f"first differing step {t.first[1]} of request {t.first[0]}, the dequantized model's margin there "
                + ("unknown" if t.margin is None else f"{t.margin:.3g}") + f" (a rounding flip up to "
                f"{self.margin_bound:.3g})")
            out.append(f"quantized ({self._named()}) against the dequantized model: {t.share:.1%} of the greedy "
                       f"tokens identical ({t.identical} of {t.total}), {where}")
        return out

    def row(self) -> Dict[str, object]:
        """A JSON-friendly summary."""
        t = self.tokens
        return {"format": self.format, "max_logit_diff": self.logits.max_abs, "largest_logit": self.logits.largest,
                "relative_logit_diff": self.logits.relative, "typical_relative_logit_diff": self.logits.typical_relative,
                "kernels": list(self.kernels), "relative_bound": self.relative_bound,
                "identical_tokens": None if t is None else t.share,
                "first_differing": None if t is None or t.first is None else list(t.first),
                "margin": None if t is None else t.margin, "margin_bound": self.margin_bound,
                "passed": not self.failures()}

    def _named(self) -> str:
        widened = [k for k in self.kernels if k in KERNEL_BOUNDS]
        by = f" by {', '.join(widened)}" if widened else ""
        return f"{self.format.replace('_', ' ')} in {str(self.dtype).replace('torch.', '')}{by}"


def over_ranks(posts: Sequence[Mapping[str, Any]]) -> Tuple[LogitFigures, Optional[TokenFigures]]:
    """Every rank's figures (``{"logits": LogitFigures fields, "tokens": TokenFigures fields or None}``, as JSON
    gives them back) as one: the largest difference and logit; the tokens added up, and of the ranks' first
    differing positions the one with the largest margin (an unknown margin first): the worst the check judges."""
    typical = [p["logits"].get("typical_abs") for p in posts]
    logits = LogitFigures(max(float(p["logits"]["max_abs"]) for p in posts),
                          max(float(p["logits"]["largest"]) for p in posts),
                          None if None in typical else max(float(t) for t in typical))
    tokens = [TokenFigures(t["identical"], t["total"], tuple(t["first"]) if t["first"] is not None else None,
                           t["margin"]) for t in (p.get("tokens") for p in posts) if t is not None]
    if not tokens:
        return logits, None
    differing = [t for t in tokens if t.first is not None]
    worst = max(differing, key=lambda t: float("inf") if t.margin is None else t.margin, default=None)
    return logits, TokenFigures(sum(t.identical for t in tokens), sum(t.total for t in tokens),
                                worst.first if worst else None, worst.margin if worst else None)
