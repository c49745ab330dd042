"""Measuring a prefill calibration: the model's serial runs, the probes, the ranks' agreement, and the cache.

`calibrate` runs the model's layers serially through the executor (overlap on, `microbatch.serial`) at a few
token counts (`token_points`), the repeats in rounds over the counts, each run the whole prefill as the launcher
runs it (embedding to final norm), recorded on a `Timeline` with the bytes of each collective and those the host
reads back; it probes the link and the busy host (`microbatch.planning.probes`: a sweep of collective sizes, the
host time an asynchronous collective takes from compute and to issue, how late a busy host notices it), and fits
it all (`microbatch.planning.prefill.fit`) into a `Calibration`.

Every rank of the group runs the same collectives in the same order, and every rank ends with the same numbers
(``agree``: the element-wise maximum over the ranks, once `overlap.agree` has checked that their structures line
up). The result is cached (`microbatch.planning.cache`) per machine, model shape, dtype, link and settings, and
read back instead of measured when every rank has it.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
import zlib
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

import overlap
from overlap import Span, Timeline, backends
from overlap.host_memory import keep_on_host_path

from ...batch import Batch
from ...forward import run_schedule, serial_split
from ...model import MoEModel
from ...operations import Operation
from ...schedules import Schedule, serial
from ...split import Split
from ..cache import cache_file, calibration_key, canonical, measured_ago, model_dtype
from ..probes import barrier, contention_fit, grouped, max_over_ranks, notice, sweep
from .calibration import Calibration, interconnect_of, load, save
from .fit import Run, fit_collective, fit_outside, fit_runs

logger = logging.getLogger(__name__)


def token_points(max_tokens: int, points: int = 5, low: int = 32) -> List[int]:
    """``points`` token counts spread geometrically from ``low`` (or ``max_tokens`` if smaller) to ``max_tokens``.

    Geometric, so that small batches, whose cost is mostly the fixed part, are measured as well as
    the large ones.
    """
    if max_tokens < 1:
        raise ValueError(f"calibration needs max_tokens >= 1, got {max_tokens}")
    lo = min(low, max_tokens)
    if points <= 1 or lo == max_tokens:
        return [max_tokens]
    return sorted({round(lo * (max_tokens / lo) ** (i / (points - 1))) for i in range(points)})


class _Collectives:
    """An observer: the bytes of each collective as it starts, and those the host reads back right after,
    in the same operation or at the start of the next one (``read_at``: that operation's name)."""

    def __init__(self) -> None:
        self.nbytes: Dict[int, int] = {}
        self.blocking: Set[int] = set()
        self.read_at: Dict[int, str] = {}
        self._last: Optional[int] = None  # the last collective, while no other span has started since
        self._prior: Optional[int] = None  # the collective that ended the previous operation
        self._op = ""  # the operation running now

    def on_span_start(self, span: Span) -> None:
        if span.kind != "comm":
            self._prior, self._last, self._op = self._last, None, span.name
            return
        size = [sum(t.numel() * t.element_size() for t in ts) for ts in (span.reads, span.writes)]
        self.nbytes[span.id] = max(size)
        self._last, self._prior = span.id, None

    def on_event_synchronize(self, name: str) -> None:
        if self._last is not None:
            self.blocking.add(self._last)
        elif self._prior is not None:
            self.blocking.add(self._prior)
            self.read_at[self._prior] = self._op
            self._prior = None


def request_length(all_lens: Sequence[Sequence[int]]) -> int:
    """The request length to calibrate with for batches of these request lengths (one list per rank).

    Attention's work per token grows with its request's length, so a calibration in requests of
    another length mis-predicts it. The token-weighted mean, sum(len^2) / sum(len), is the length
    whose per-token attention equals the batches' on average (exact where the lengths are equal).
    """
    lens = [int(n) for rank in all_lens for n in rank if n > 0]
    total = sum(lens)
    return max(1, round(sum(n * n for n in lens) / total)) if total else 64


def _batch(model: MoEModel, tokens: int, seq_len: int, seed: int) -> Batch:
    lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    device = next(iter(model.parameters())).device
    return Batch.random(lens, model.cfg.vocab, seed=seed, device=device)


def _timed(model: MoEModel, layers: List[List[Operation]], batch: Batch, split: Optional[Split] = None,
           make: Callable[..., Schedule] = serial) -> float:
    """One prefill as the launcher runs it (embedding to final norm), split as ``split`` says (default: one batch)
    and scheduled by ``make``; its wall seconds."""
    t0 = time.perf_counter()
    run_schedule(model, batch, split or serial_split(batch, "calibration"), layers, make)
    overlap.synchronize()
    return time.perf_counter() - t0


def _recorded(model: MoEModel, layers: List[List[Operation]], batch: Batch,
              group: Optional[dist.ProcessGroup]) -> Run:
    seen, tl = _Collectives(), Timeline()
    barrier(group)
    overlap.add_observer(seen)
    tl.start()
    try:
        wall = _timed(model, layers, batch)
    finally:
        tl.stop()
        overlap.remove_observer(seen)
    return Run(batch.seq.num_tokens, tl.spans, seen.nbytes, seen.blocking, wall, seen.read_at)


def _is_moe(model: MoEModel, index: int) -> bool:
    return bool(model.layers[index].is_moe)


def measure_costs(model: MoEModel, group: Optional[dist.ProcessGroup] = None,
                  tokens: Sequence[int] = (32, 64, 128, 256), repeats: int = 3, seq_len: int = 64,
                  progress: Optional[Callable[[str], None]] = None) -> Calibration:
    """Measure this rank's calibration (a collective: every rank of ``group`` calls it with the same arguments);
    ``progress`` hears a line as each stage starts (the warm-up, each round of the operations, the link's probes)."""
    said = progress or (lambda line: None)
    if backends.current().is_graph:
        raise ValueError(f"calibrate on an eager path: inside a compiled graph ({backends.current().name}) the "
                         f"launches are not seen one by one")
    t0 = time.perf_counter()
    rank = dist.get_rank(group) if grouped(group) else 0
    layers = model.layer_operations()
    with torch.no_grad(), overlap.enabled(True):
        said(f"calibrating: warm-up at {len(tokens)} token counts")
        for n in tokens:
            barrier(group)
            _timed(model, layers, _batch(model, n, seq_len, seed=rank))  # warm-up: agreement, buffers of this size
        # the repeats in rounds over the counts, so that a slow spell of a shared host raises every count a little
        # rather than a few counts much, which bends each fit's fixed part against its part per token
        runs = []
        for i in range(repeats):
            said(f"calibrating: the operations, round {i + 1}/{repeats}")
            runs += [_recorded(model, layers, _batch(model, n, seq_len, seed=1000 * rank + i), group) for n in tokens]
        said("calibrating: the link and the host's contention")
        hidden = int(model.cfg.hidden)
        swept = sweep(group, sorted({1, *tokens}), hidden, model_dtype(model), repeats)
        contended, issued = contention_fit(group, (max(1, min(tokens)), max(tokens)), hidden, model_dtype(model),
                                           max(3, repeats))
        noticed, peer = notice(group, hidden, model_dtype(model))
    link = overlap.current_link()
    used = None if link is None else {"gbps": link.gbps, "latency_us": link.latency_us}
    collective = fit_collective([(n, s) for n, s, _ in swept], link)
    # an asynchronous issue's host time beyond what a synchronous call spends outside its span (which
    # the serial runs count in the operation's own work)
    outside = fit_outside(swept)
    issue = (max(0.0, issued[0] - outside.a), max(0.0, issued[1] - outside.b))
    cal = fit_runs(runs, [_is_moe(model, i) for i in range(len(layers))], interconnect_of(used, collective))
    cal = dataclasses.replace(cal, key=calibration_key(model, group, tokens, repeats, seq_len), link=used,
                              collective=collective, async_host_s=contended[0], async_host_per_byte=contended[1],
                              async_issue_s=issue[0], async_issue_per_byte=issue[1], async_notice_s=noticed,
                              async_peer_s=peer)
    cal.elapsed_s = time.perf_counter() - t0
    return cal


def agree(cal: Calibration, group: Optional[dist.ProcessGroup] = None) -> Calibration:
    """The element-wise maximum of ``cal``'s numbers over the ranks of ``group`` (a collective).

    `overlap.agree` first checks that every rank holds the same structure (layers, numbers, operations
    and collectives) and only finite numbers, `RuntimeError` on every rank otherwise, naming each
    rank's value; a second all-reduce takes the maximum (a reduction, not an agreement: it is only
    checked to line up).
    """
    if not grouped(group):
        return cal
    numbers = cal.values()
    bad = sum(not math.isfinite(v) for v in numbers)
    checksum = f"{zlib.crc32(cal.structure().encode()):08x}"
    structure = {"the calibrated layers": len(cal.layers), "the calibrated numbers": len(numbers),
                 "the calibrated operations and collectives (a checksum)": checksum}
    overlap.agree(structure, overlap.GroupTransport(group, "calibrate.agree"),
                  problems=[f"its calibration holds {bad} NaN or infinite number(s)"] if bad else [],
                  hints=dict.fromkeys(structure, "every rank must pass the same model"), error=RuntimeError)
    return cal.with_values(max_over_ranks(numbers, group))


# what decides which collectives a measurement issues: every rank must pass the same
_COLLECTIVE_SETTINGS = ("world", "model", "dtype", "tokens", "repeats", "seq_len")


def _everyone_has(cached: Optional[Calibration], key: Mapping[str, Any],
                  group: Optional[dist.ProcessGroup]) -> Tuple[bool, bool]:
    """``(every rank found the calibration, the ranks' cached calibrations differ in structure)``: one
    all-reduce, which also checks that the settings agree."""
    if not grouped(group):
        return cached is not None, False
    tag = zlib.crc32(canonical({k: key.get(k) for k in _COLLECTIVE_SETTINGS}).encode())
    shape = zlib.crc32(cached.structure().encode()) if cached is not None else 0
    missing, hi, lo, shape_hi, shape_lo = max_over_ranks([0 if cached is not None else 1, tag, -tag, shape, -shape],
                                                         group, torch.int64)
    if (hi, -lo) != (tag, tag):
        raise ValueError("the ranks asked for different calibrations (model, dtype, token counts, repeats or "
                         "request length differ): every rank must call calibrate with the same model and arguments")
    return missing == 0, missing == 0 and shape_hi != -shape_lo


def calibrate(model: MoEModel, group: Optional[dist.ProcessGroup] = None, *, max_tokens: int = 256, points: int = 5,
              repeats: int = 3, seq_len: int = 64, refresh: bool = False, cache: Optional[str] = None,
              report: Optional[Callable[[str], None]] = None,
              progress: Optional[Callable[[str], None]] = None) -> Calibration:
    """This machine's calibration of ``model`` over ``group``, from the cache when every rank has it.

    Measures at `token_points` ``(max_tokens, points)``, ``repeats`` runs each, in requests of
    ``seq_len`` tokens; ``refresh`` measures again whatever the cache holds; ``cache`` overrides
    the cache folder. A collective: every rank of ``group`` calls it with the same arguments, and
    every rank returns the same numbers. ``report`` is told, in a line, whether the numbers come
    from the cache (its file, and when they were measured) or are measured now; ``progress`` hears
    each stage of a measurement as it starts.
    """
    tokens = token_points(max_tokens, points)
    key = calibration_key(model, group, tokens, repeats, seq_len)
    cached = None if refresh else load(key, cache, model)
    everyone, differ = _everyone_has(cached, key, group)
    if everyone and not differ:
        if report is not None:
            path = cache_file(key, cache)
            report(f"calibration: cached ({path}), {measured_ago(path)}")
        return agree(cached, group)
    if differ:  # each file is a calibration, but not of one model on every rank: none can be trusted
        logger.warning("ignoring the calibration %s: the ranks' cached files of this key differ in their "
                       "operations or collectives; measuring again on every rank", cache_file(key, cache))
    if report is not None:
        why = "refreshing" if refresh else "none cached for this machine and model" if cached is None else \
            "the ranks' cached files differ" if differ else "not cached on every rank"
        report(f"calibrating the operations and the interconnect ({why}; cached after this run in "
               f"{cache_file(key, cache)})")
    keep_on_host_path()
    cal = agree(measure_costs(model, group, tokens, repeats, seq_len, progress), group)
    save(cal, cache)
    return cal


__all__ = ["agree", "calibrate", "measure_costs", "request_length", "token_points"]
