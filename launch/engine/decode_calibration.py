"""Calibrate decode: every candidate mode's step time measured on this machine, for ``--decode-mode auto``.

`calibrate_decode` runs real decode steps (`launch.engine.step.decode_step`, the exchanges included) of every
candidate mode at each bucket of tokens per rank from 1 to ``max_tokens`` (1, 2, 4, ... and ``max_tokens``) and
at two history lengths, on a scratch KV cache whose slots claim that history (attention reads that many rows;
their values do not matter for the time) and on token ids that differ from rank to rank (`calibration_ids`: as a
job's, since where the tokens route shapes the exchanges). The modes run interleaved: each round runs every point
once in every mode, the modes' order turning from point to point, so that the host's drift spreads over all of
them; each entry is the median of ``repeats`` rounds after one untimed round, with that median's relative standard
error (its noise: auto takes a mode over serial only where the gain is well outside it). Every rank runs the same
steps (they exchange), and the table ends the same on every rank: the largest time and noise of any rank, in one
all-reduce.

Each step runs through a mode's decoder (`launch.engine.decoder.Decoder`), as a generation runs it: eager ones of
its own by default, or with ``decoders`` (`launch.engine.GraphDecoder`, one per candidate mode over one cache) the
captured steps, the ones `launch.engine.generate(mode="auto", decoder=decoders)` replays: each mode's
step padded to its bucket, on scratch slots of the decoders' cache (left as it was). Such a step's time depends on
its bucket alone, so the token points are where a mode's buckets end (`graph_token_points`) and the table is read as
a step function (``padded``); a captured step attends over the cache's whole room, so it is timed at the short
history alone and that time stands for both (half the steps of an eager calibration), unless its decoders have
length buckets (it then attends over the room the history uses: timed at both).

The result is a `microbatch.planning.DecodeCalibration`, which `launch.engine.generate(mode="auto")` reads
every step (`microbatch.planning.choose_decode`). It is cached as the prefill's calibration is (in
``$OVERLAP_CALIBRATION_CACHE``, default ``~/.cache/npu-overlap/calibration/``), per machine, torch, path,
ranks, model shape, dtype, link, comm-thread priority and the calibration's own settings (token points,
histories, modes, rounds, steps; the graph path, buckets and length buckets of captured steps): a later run of
the same job reads it instead of measuring, when every rank has it. ``refresh=True`` (the benchmark) measures
again whatever the cache holds.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import microbatch
import overlap
from microbatch import DecodeModel, KVCache
from microbatch.planning import (SERIAL, DecodeCalibration, DecodeCalibrationError, cache_file, calibration_key,
                                 max_over_ranks, measured_ago, read_cache, relative_error, write_cache)
from overlap.host_memory import keep_on_host_path

from .decoder import Decoder, eager_decoders, expert_group
from .generation import DecodeError
from .graph_decoder import GraphDecoder, decoders_of
from .step import AGREEMENT

# the candidates of --decode-mode auto by default (--decode-auto-modes): one batch (whole, its shared experts beside,
# its MoE in chunks) and two micro-batches; three and four micro-batches halve a decode batch's matmuls again and
# rarely pay
DECODE_AUTO_MODES = ("serial", "shared", "two-batch", "chunked-2", "chunked-4")
Progress = Callable[[str], None]
DECODE_FORMAT = 4  # the decode calibration's cache files (2: the steps' token ids differ per rank; 3: with noise;
# 4: a link's unobserved completions run no callback, overlap.link.DelayedWork: the overlapped steps take less)
# rounds per entry (--decode-calibration-rounds), timed steps per round: 16 samples in each entry's median by
# default. Each entry's median carries about 3-12% of noise on a shared 2-core host (step times spread 10-30%), 2-6%
# with 8 rounds (as 1 / sqrt(rounds))
DECODE_CALIBRATION_ROUNDS, STEPS = 4, 4
_LOG = logging.getLogger(__name__)


def token_points(max_tokens: int) -> Tuple[int, ...]:
    """The tokens per rank a calibration measures: the powers of two below ``max_tokens``, and ``max_tokens``."""
    points, n = [], 1
    while n < max_tokens:
        points.append(n)
        n *= 2
    return tuple(points) + (max(1, int(max_tokens)),)


def graph_token_points(max_tokens: int, micro_batches: Sequence[int], buckets: Optional[Sequence[int]] = None
                       ) -> Tuple[int, ...]:
    """The tokens per rank a calibration of captured steps measures: where a bucket ends for a mode of each of
    ``micro_batches`` (``N x bucket``: a step of up to that many tokens pads to the same bucket; ``buckets``
    default the powers of two), up to ``max_tokens``, and ``max_tokens``."""
    top = max(1, int(max_tokens))
    sizes = sorted(set(buckets)) if buckets is not None else [1 << i for i in range(top.bit_length() + 1)]
    return tuple(sorted({n * b for n in set(micro_batches) for b in sizes if n * b < top} | {top}))


def calibrate_decode(model: DecodeModel, *, max_tokens: int, histories: Tuple[int, int],
                     modes: Sequence[str] = DECODE_AUTO_MODES, repeats: int = DECODE_CALIBRATION_ROUNDS,
                     steps: int = STEPS, seed: int = 0,
                     progress: Optional[Progress] = None, refresh: bool = False, cache: Optional[str] = None,
                     report: Optional[Progress] = None, decoders: Optional[Mapping[str, GraphDecoder]] = None
                     ) -> DecodeCalibration:
    """Every mode of ``modes`` (serial first or added) timed at each of `token_points` (``max_tokens``) and at the two
    ``histories`` (rows each request holds before the step): ``repeats`` rounds of ``steps`` steps in a row per
    mode and point, after one more step (see the module docstring). Read from the cache instead where every rank
    has it (``refresh``: measure anyway; ``cache``: the folder, else ``$OVERLAP_CALIBRATION_CACHE``'s); ``report``
    is told in a line which it was. ``decoders``: time the captured steps of these, one per mode (``modes`` is then
    theirs), over one cache with ``max_tokens`` free slots. Collective over the model's expert group: every rank
    calls it with the same modes, rounds, steps and decoders (checked first, in one all-reduce); ``max_tokens`` and
    ``histories`` are each rank's own (uneven batches): the table is the job's, the most tokens and the shortest and
    longest history over the ranks."""
    if decoders is not None:
        modes = _check_decoders(decoders)
    names = [SERIAL] + [m for m in modes if m != SERIAL]
    hows = {m: microbatch.decode_mode(m) for m in names}
    if max_tokens < 1 or repeats < 1 or steps < 1:
        raise ValueError(f"calibrate_decode needs max_tokens, repeats and steps >= 1, got {max_tokens}, {repeats} "
                         f"and {steps}")
    h0, h1 = int(histories[0]), int(histories[1])
    if not 1 <= h0 < h1:
        raise ValueError(f"histories must be two lengths 1 <= short < long, got {histories}")
    if decoders is None:  # a model decode cannot run is refused here, before any collective (captured steps were)
        for how in hows.values():
            model.decode_layer_operations(how.moe_chunks)
    group = expert_group(model)
    graph = next(iter(decoders.values())) if decoders else None
    free = len(graph.cache.lengths) - len(graph.cache.active) if graph is not None else None  # eager: a scratch cache
    settings = {"max_tokens": max_tokens, "histories": [h0, h1], "free": free, "modes": names, "repeats": repeats,
                "steps": steps, "graph": graph.path if graph is not None else "off",
                "buckets": list(graph.buckets or ()) if graph is not None else []}
    if group is not None:  # the ranks run these steps together: a rank with other ones would hang the others
        settings = _job_settings(overlap.agree(settings, overlap.GroupTransport(group, "decode.calibrate"),
                                               per_rank=_JOB_WIDE, error=DecodeError))
    max_tokens, (h0, h1) = settings["max_tokens"], settings["histories"]
    if settings["free"] is not None and settings["free"] < max_tokens:
        raise DecodeError(f"the decoders' cache has {settings['free']} free slots, the calibration takes {max_tokens} "
                          f"(max_tokens, the largest over the ranks)")
    if graph is None:
        points = token_points(max_tokens)
    else:
        points = graph_token_points(max_tokens, [d.micro_batches for d in decoders.values()], graph.buckets)
    key = decode_calibration_key(model, group, points, (h0, h1), names, repeats, steps,
                                 graph=None if graph is None else (graph.path, graph.buckets, graph.length_buckets))
    path = cache_file(key, cache)
    cached = None if refresh else _load(key, path)
    if _everyone_has(cached, group):
        if report is not None:
            report(f"decode calibration: cached ({path}), {measured_ago(path)}")
        return _alike(cached, group)
    if report is not None:
        why = "refreshing" if refresh else "none cached for this machine, model and link" if cached is None else \
            "not cached on every rank"
        report(f"calibrating decode ({why}; cached after this run in {path})")
    keep_on_host_path()
    if decoders is None:  # eager steps on a scratch cache whose slots hold up to the long history
        timer = _Timer(eager_decoders(model, _scratch_cache(model, points[-1], h1 + 1), names), points[-1], group)
    else:
        timer = _Timer(decoders, points[-1], group, padded=True, whole_room=not graph.length_buckets)
    try:
        cal = _measure(model, group, points, (h0, h1), names, timer, repeats, steps, seed, progress)
    finally:
        timer.close()
    write_cache(path, {"format": DECODE_FORMAT, "key": key, "calibration": cal.to_dict()})
    return cal


_JOB_WIDE = ("max_tokens", "histories", "free")  # each rank's own: the calibration measures the job's, over the ranks


def _job_settings(posts: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """The calibration's settings for the whole job from every rank's (`calibrate_decode`'s agreement): the most
    tokens any rank brings, the shortest and longest history of any rank, the fewest free slots of captured steps'
    caches; the rest agreed. A reduction, not an agreement: ranks with uneven batches calibrate the same table."""
    job = dict(posts[0])
    job["max_tokens"] = max(p["max_tokens"] for p in posts)
    job["histories"] = [min(p["histories"][0] for p in posts), max(p["histories"][1] for p in posts)]
    job["free"] = min((p["free"] for p in posts if p["free"] is not None), default=None)
    return job


def decode_calibration_key(model: DecodeModel, group: Optional[Any], points: Sequence[int],
                           histories: Tuple[int, int], modes: Sequence[str], repeats: int,
                           steps: int, graph: Optional[Tuple[str, Optional[Sequence[int]], bool]] = None
                           ) -> Dict[str, Any]:
    """What a decode calibration is valid for: the prefill calibration's key (machine, torch, path, ranks, model
    shape, dtype, link, comm-thread priority) with the decode calibration's own settings; ``graph``: the path,
    buckets and length buckets of captured steps."""
    key = calibration_key(model, group, points, repeats)  # type: ignore[arg-type]  # reads cfg and parameters only
    key.update({"kind": "decode", "decode_format": DECODE_FORMAT, "histories": list(histories), "modes": list(modes),
                "steps": int(steps)})
    if graph is not None:
        key["graph"] = {"path": graph[0], "buckets": list(graph[1] or ())}
        if graph[2]:  # keys without length buckets stay as they were
            key["graph"]["length_buckets"] = True
    exchanges = sorted({getattr(getattr(layer.moe, "decode_exchange", None), "name", "capacity")
                        for layer in model.moe_layers()})
    if exchanges != ["capacity"]:  # MC2's steps take their own time (the capacity exchange's keys stay as they were)
        key["exchange"] = exchanges
    return key


def _check_decoders(decoders: Mapping[str, GraphDecoder]) -> List[str]:
    """The modes of ``decoders``, serial among them, checked by `launch.engine.graph_decoder.decoders_of`."""
    if SERIAL not in decoders:
        raise ValueError(f"a calibration of captured steps needs a decoder for serial, the reference; got "
                         f"{', '.join(decoders) or 'none'}")
    return list(decoders_of(decoders, list(decoders)))


def _load(key: Dict[str, Any], path: str) -> Optional[DecodeCalibration]:
    """The cached decode calibration of ``key`` at ``path``, or None (none, another key, or not a calibration of
    ``key``'s points, histories and modes: named in a warning)."""
    data = read_cache(path)
    if data is None or data.get("format") != DECODE_FORMAT or data.get("key") != key:
        return None  # none, or another format or key (a digest shared by chance)
    try:
        cal = DecodeCalibration.from_dict(data.get("calibration"))
        if (list(cal.tokens), list(cal.histories), list(cal.modes)) != (key["tokens"], key["histories"], key["modes"]):
            raise DecodeCalibrationError("its token points, histories or modes are not its key's")
        if cal.noise is None:  # every rank's table has the same entries: they are reduced together
            raise DecodeCalibrationError("it has no noise figures")
        if cal.padded != ("graph" in key):
            raise DecodeCalibrationError("its steps are not the key's (captured or eager)")
    except DecodeCalibrationError as err:
        _LOG.warning("ignoring the decode calibration %s: %s; measuring again", path, err)
        return None
    return cal


def _everyone_has(cached: Optional[DecodeCalibration], group: Optional[Any]) -> bool:
    """Whether every rank of ``group`` found the calibration (one all-reduce)."""
    if group is None:
        return cached is not None
    return max_over_ranks([0.0 if cached is not None else 1.0], group)[0] == 0.0


def _alike(cal: DecodeCalibration, group: Optional[Any]) -> DecodeCalibration:
    """``cal`` with the largest of the ranks' times and noise in every entry (each rank read its own file: the same
    table on every rank, whatever the files hold; their shapes are the agreed key's)."""
    if group is None:
        return cal
    tables = [cal.seconds] + ([cal.noise] if cal.noise is not None else [])
    it = iter(max_over_ranks([t for table in tables for m in cal.modes for row in table[m] for t in row], group))
    seconds, *noise = [{m: tuple((next(it), next(it)) for _ in cal.tokens) for m in cal.modes} for _ in tables]
    return DecodeCalibration(cal.tokens, cal.histories, seconds, noise[0] if noise else None, cal.padded)


def _measure(model: DecodeModel, group: Optional[Any], points: Tuple[int, ...], histories: Tuple[int, int],
             names: Sequence[str], step: _Timer, repeats: int, steps: int, seed: int,
             progress: Optional[Progress]) -> DecodeCalibration:
    """The table measured (the module docstring), the same on every rank."""
    h0, h1 = histories
    ids = calibration_ids(points[-1], model.cfg.vocab, seed, dist.get_rank(group) if group is not None else 0)
    times: Dict[Tuple[str, int, int], List[float]] = {}
    # the table's two history columns, as measured: a captured step attends over the cache's whole room, so one
    # history stands for both (with length buckets, over the room the history uses)
    columns = (h0, h0) if step.whole_room else (h0, h1)
    grid = [(n, h) for n in points for h in dict.fromkeys(columns)]
    for rnd in range(repeats):
        for k, (n, h) in enumerate(grid):
            if progress is not None:
                progress(f"calibrating decode: round {rnd + 1}/{repeats}, {n} tokens per rank, history {h}")
            turn = (k + rnd) % len(names)
            for m in names[turn:] + names[:turn]:
                step.run(m, ids[:n], h)  # the first step of a block is not timed (a captured step: its capture)
                times.setdefault((m, n, h), []).extend(step.run(m, ids[:n], h) for _ in range(steps))
    seconds = {m: tuple(tuple(statistics.median(times[m, n, h]) for h in columns) for n in points) for m in names}
    noise = {m: tuple(tuple(relative_error(times[m, n, h]) for h in columns) for n in points) for m in names}
    return _alike(DecodeCalibration(points, (h0, h1), seconds, noise, padded=step.padded), group)


def calibration_ids(requests: int, vocab: int, seed: int, rank: int) -> List[int]:
    """The token ids of a calibration's steps on ``rank``: random, and different on every rank, as a job's requests
    are. With the same ids on every rank the tokens route alike everywhere, and the micro-batched modes' exchanges
    line up as no job's do: on 2 CPU ranks, two-batch at 256 tokens measured 1.27-1.46x serial from run to run with
    the same ids, 1.31-1.35x with ids per rank (generation's steps beside them 1.31-1.32x), and every full run of the
    decode benchmark had predicted it 9-22% too fast."""
    gen = torch.Generator().manual_seed(seed + 1009 * rank)
    return torch.randint(0, vocab, (requests,), generator=gen).tolist()


def _scratch_cache(model: DecodeModel, requests: int, rows: int) -> KVCache:
    weight = next(model.parameters())
    cfg = model.cfg
    return KVCache(cfg.n_layers, requests, rows, cfg.k_shape, cfg.v_shape, dtype=weight.dtype, device=weight.device)


def _post_step(group: Optional[Any], active: int, history: int, mode: str) -> Optional[overlap.PendingAgreement]:
    """What generate posts each step, of the same size, sent on the same side stream (read once the step is done,
    as generate reads it a step later); None without a group."""
    if group is None:
        return None
    return overlap.agree_later({"active": active, "widest": [active], "history": history, "left": 1,
                                "decode mode": mode, "seconds": 0.0, "built": False},
                               overlap.GroupTransport(group, "decode.step", stream=AGREEMENT),
                               per_rank=["active", "widest", "history", "left", "seconds", "built"], error=DecodeError)


class _Timer:
    """What `_measure` times: ``run(mode, ids, history)`` is the seconds of one step of ``len(ids)`` requests holding
    ``history`` rows each through the mode's decoder, as `launch.engine.generate` runs it: the ranks' agreement sent
    beside the step, the step (cut into the decoder's parts; a captured one padded to its bucket, captured on its
    first use), its tokens read back, the agreement read. On scratch slots of the decoders' cache, whose lengths
    are put back after each step (its rows are not
    kept) and which `close` gives back. ``padded``: a captured step, whose time is its bucket's; ``whole_room``: it
    attends over the cache's whole room, whatever the history."""

    def __init__(self, decoders: Mapping[str, Decoder], requests: int, group: Optional[Any], padded: bool = False,
                 whole_room: bool = False):
        self.decoders, self.group, self.padded, self.whole_room = decoders, group, padded, whole_room
        self.cache = next(iter(decoders.values())).cache
        self.slots = self.cache.admit(requests)

    def run(self, mode: str, ids: Sequence[int], history: int) -> float:
        cache, decoder, slots = self.cache, self.decoders[mode], self.slots[:len(ids)]
        history = min(history, cache.max_len - 1)  # the room holds no more
        for s in slots:
            cache.lengths[s] = history
        start = time.perf_counter()
        parts = decoder.parts([history] * len(slots))
        sent = _post_step(self.group, len(slots), history, mode)
        # the same point on every rank: the same widest part
        decoder.run(slots, ids, parts, widest=max(map(len, parts)), history=history).ids.tolist()
        if sent is not None:
            sent.result()
        seconds = time.perf_counter() - start
        for s in slots:
            cache.lengths[s] = history  # the step counted its row: not kept
        return seconds

    def close(self) -> None:
        for s in self.slots:
            self.cache.lengths[s] = 0
        self.cache.release(self.slots)


def calibration_histories(prompt_lens: Sequence[int], new_tokens: int) -> Tuple[int, int]:
    """The two histories a generation's calibration measures: its shortest prompt, and its longest prompt with
    every new token but the last (the most a decode step attends to)."""
    short = max(1, min(prompt_lens, default=1))
    return short, max(short + 1, max(prompt_lens, default=1) + new_tokens - 1)


__all__ = ["DECODE_AUTO_MODES", "DECODE_CALIBRATION_ROUNDS", "DECODE_FORMAT", "STEPS", "calibrate_decode",
           "calibration_histories",
           "calibration_ids", "decode_calibration_key", "graph_token_points", "token_points"]
