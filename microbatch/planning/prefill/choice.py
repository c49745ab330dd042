"""Choose how to run a prefill before running it: the mode, the number of micro-batches, the split, the tails.

From a calibration (`microbatch.planning.prefill.calibration`: each operation's cost as a function of its
tokens, the interconnect as latency + bandwidth) the simulation of the streams (`microbatch.planning.simulation`)
predicts a mode's prefill (`predict_mode`) and every candidate's prefill time on every rank's batch:

- the modes of `microbatch.MODES` (serial, shared, two-, three- and four-batch);
- for the N-batch modes, the split: at request boundaries only, or cut inside a request where
  the boundaries leave more than 10% or more than 0% imbalance (`propose_split`'s ``max_imbalance``),
  so a cut is taken only where the prediction says it pays;
- whether the last micro-batch's tail (finalize) is deferred into the next layer.

A candidate's time is the slowest rank's (the exchanges hold every rank to the slowest). The
fastest wins; ties go to fewer micro-batches, and a split wins over one batch only where it is predicted
more than ``split_margin`` (`SPLIT_MARGIN`, 10%) faster: the simulation leaves out the ranks' jitter at a
split's extra exchanges, and on 2 CPU ranks it predicted the split modes 5-22% too fast relative to
serial at 64-256 tokens per rank. The inputs are every rank's request lengths (one
all-gather) and a calibration every rank holds alike (`calibrate` agrees it), so every rank takes
the same decision, with no further agreement needed.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

import overlap

from ... import schedules
from ...forward import MakeSchedule
from ...model import MoEModel
from ...operations import Operation
from ..simulation import Prediction, predict
from ..split import DEFAULT_MIN_TOKENS, Split, decide_split, propose_split
from .calibration import Calibration

# What a prediction reads of a model: its layers' operations (`MoEModel.layer_operations`), or those lists
ModelOrLayers = Union[MoEModel, Sequence[Sequence[Operation]]]
SPLIT_MARGIN = 0.10  # a split's predicted gain over the best single batch must exceed this to be chosen
# propose_split's max_imbalance per candidate split: boundaries only (no cut), cut above 10%, cut whenever uneven
_SPLITS = ((None, "at request boundaries"), (0.1, "cut inside a request above 10% imbalance"),
           (0.0, "cut inside a request whenever boundaries are uneven"))


def layers_of(model: ModelOrLayers) -> Sequence[Sequence[Operation]]:
    """The layers' operations a prediction runs on: ``model.layer_operations()``, or ``model`` when it is the lists."""
    return model if isinstance(model, Sequence) else model.layer_operations()


def predict_mode(cal: Calibration, model: ModelOrLayers, mode: str, tokens: Sequence[int],
                 device: Optional[bool] = None) -> Prediction:
    """Predicted prefill of ``mode`` for micro-batches of ``tokens`` tokens each (one count for a serial mode).

    ``model`` is the model (its ``layer_operations()``) or the layers' operation lists; ``device``
    selects device semantics (default: where the current path runs compute off the host).
    """
    layers = layers_of(model)
    if device is None:
        device = overlap.backends.current().device_type != "cpu"
    return predict(mode, layers, list(tokens), cal.cost_model(), device=device)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run the batch and its predicted time (the slowest rank's, seconds)."""

    mode: str
    max_imbalance: Optional[float]  # None: split at request boundaries only
    defer_tail: bool
    predicted_s: float
    micro_batches: int

    def describe(self) -> str:
        if self.micro_batches == 1:
            return self.mode
        split = dict(_SPLITS)[self.max_imbalance]
        return f"{self.mode}, {split}, {'tail deferred' if self.defer_tail else 'tail in its layer'}"

    def make(self) -> MakeSchedule:
        """The schedule generator this candidate runs (``make(layers, n_micro)``)."""
        spec = schedules.mode(self.mode)
        if self.micro_batches == 1:
            return spec.make
        return functools.partial(_named, self.mode, self.defer_tail)


def _named(name: str, defer_tail: bool, layers: List[List[Operation]], n_micro: int) -> schedules.Schedule:
    return dataclasses.replace(schedules.n_batch(layers, n_micro, defer_tail=defer_tail), name=name)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The decision: the best candidate, every candidate considered, and serial's predicted time."""

    best: Candidate
    candidates: Tuple[Candidate, ...]
    serial_s: float
    calibration: Optional[Calibration] = None  # what the predictions came from
    device: bool = False  # device semantics in the simulation (compute off the host)
    split_margin: float = SPLIT_MARGIN  # what a split had to gain over one batch to be chosen

    def predict(self, model: ModelOrLayers, split: Split) -> Prediction:
        """The chosen schedule's predicted timeline (`simulation.Prediction`) for this rank's ``split``."""
        if self.calibration is None:
            raise ValueError("this choice holds no calibration to predict from")
        layers = layers_of(model)
        tokens = [split.num_tokens] if split.serial else list(split.token_counts)
        schedule = self.best.make()(layers, len(tokens))
        return predict(schedule, layers, tokens, self.calibration.cost_model(), device=self.device)

    @property
    def speedup(self) -> float:
        return self.serial_s / self.best.predicted_s if self.best.predicted_s > 0 else 1.0

    def split(self, seq_lens: Sequence[int], group: Optional[dist.ProcessGroup], allow_cut: bool = True) -> Split:
        """This rank's split for the chosen candidate, agreed as `decide_split` does (one all-reduce); its
        reason is the split: ``one batch (shared)``, or the candidate and where it splits."""
        b = self.best
        if b.micro_batches == 1:
            return Split(tuple(seq_lens), None, f"one batch ({b.mode})")
        imbalance = 0.999 if b.max_imbalance is None else b.max_imbalance
        split = decide_split(seq_lens, group, n=b.micro_batches, max_imbalance=imbalance,
                             allow_cut=allow_cut and b.max_imbalance is not None)
        return dataclasses.replace(split, reason=f"{b.describe()}; {split.reason}")

    def format(self, top: int = 6) -> str:
        """The choice and the best candidates with their predicted times, as text."""
        lines = [f"auto: chose {self.best.describe()}: predicted {self.best.predicted_s * 1e3:.1f} ms, "
                 f"{self.speedup:.2f}x serial's predicted {self.serial_s * 1e3:.1f} ms"]
        fastest = self.candidates[0] if self.candidates else self.best
        if fastest.predicted_s < self.best.predicted_s:
            lines[0] += (f" ({fastest.mode} predicted {1 - fastest.predicted_s / self.best.predicted_s:.1%} faster, "
                         f"within the {self.split_margin:.0%} a split must gain)")
        for c in self.candidates[:top]:
            lines.append(f"  {c.predicted_s * 1e3:9.1f} ms  {c.describe()}")
        return "\n".join(lines)


def gather_lens(seq_lens: Sequence[int], group: Optional[dist.ProcessGroup] = None) -> List[Tuple[int, ...]]:
    """Every rank's request lengths, in rank order (two small all-gathers; no group: this rank's alone)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [tuple(int(n) for n in seq_lens)]
    device = overlap.collective_device(group)
    world = dist.get_world_size(group)
    count = torch.tensor([len(seq_lens)], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    width = max(int(c) for c in counts)
    mine = torch.zeros(width, dtype=torch.int64, device=device)
    mine[:len(seq_lens)] = torch.tensor(list(seq_lens), dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return [tuple(int(x) for x in t[:int(c)].tolist()) for t, c in zip(every, counts)]


def _splits(all_lens: Sequence[Tuple[int, ...]], n: int, max_imbalance: Optional[float], allow_cut: bool,
            min_tokens: int) -> Optional[List[Split]]:
    """Every rank's split into ``n`` micro-batches, or None when some rank cannot take exactly ``n``."""
    cut = allow_cut and max_imbalance is not None
    imbalance = 0.999 if max_imbalance is None else max_imbalance
    splits = [propose_split(lens, n, min_tokens=min_tokens, max_imbalance=imbalance, allow_cut=cut)
              for lens in all_lens]
    return splits if all(s.n_parts == n for s in splits) else None


def choose(cal: Calibration, model: ModelOrLayers, all_lens: Sequence[Tuple[int, ...]], *, allow_cut: bool = True,
           min_tokens: int = DEFAULT_MIN_TOKENS, device: Optional[bool] = None,
           modes: Optional[Sequence[str]] = None, split_margin: float = SPLIT_MARGIN) -> Choice:
    """The fastest predicted way to run batches of ``all_lens`` (one tuple of request lengths per rank).

    Pure and deterministic: every rank given the same inputs returns the same `Choice`.
    ``allow_cut=False`` for models that cannot continue a request from a prefix. A split is chosen over
    the fastest single batch only where it is predicted more than ``split_margin`` faster (0: any gain).
    """
    if not 0.0 <= split_margin < 1.0:
        raise ValueError(f"split_margin must be in [0, 1), got {split_margin}")
    layers = layers_of(model)
    if device is None:
        device = overlap.backends.current().device_type != "cpu"
    costs = cal.cost_model()
    found: List[Candidate] = []
    seen = set()  # (mode, tail, every rank's split): knobs that give the same splits are one candidate
    for name in modes or list(schedules.MODES):
        spec = schedules.mode(name)
        if spec.micro_batches == 1:
            t = max(predict_mode(cal, layers, name, [sum(lens)], device=device).total_s for lens in all_lens)
            found.append(Candidate(name, None, True, t, 1))
            continue
        for imbalance, _ in _SPLITS:
            splits = _splits(all_lens, spec.micro_batches, imbalance, allow_cut, min_tokens)
            if splits is None:
                continue
            points = tuple(s.points for s in splits)
            for defer in (True, False):
                if (name, defer, points) in seen:
                    continue
                seen.add((name, defer, points))
                cand = Candidate(name, imbalance, defer, 0.0, spec.micro_batches)
                schedule = cand.make()(layers, spec.micro_batches)
                t = max(predict(schedule, layers, list(s.token_counts), costs, device=device).total_s
                        for s in splits)
                found.append(dataclasses.replace(cand, predicted_s=t))
    found.sort(key=lambda c: (c.predicted_s, c.micro_batches, c.mode != "serial"))
    serial = next(c for c in found if c.mode == "serial")
    best = found[0]
    whole = next((c for c in found if c.micro_batches == 1), None)
    if best.micro_batches > 1 and whole is not None and best.predicted_s > whole.predicted_s * (1.0 - split_margin):
        best = whole
    return Choice(best, tuple(found), serial.predicted_s, cal, device, split_margin)


__all__ = ["SPLIT_MARGIN", "Candidate", "Choice", "ModelOrLayers", "choose", "gather_lens", "layers_of",
           "predict_mode"]
