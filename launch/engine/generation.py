"""Greedy generation with the device KV cache: prefill writes it, each decode step appends to it.

`generate` is the loop: it admits the prompts into the cache, prefills them in a mode's schedule (each layer's keys
and values written to the cache right after its attention, `launch.engine.prefiller.prefill_cache`), takes the argmax
of the LM head, then runs one decode step per new token: a batch of one token per active request, in the step's
decode mode (``serial``, ``shared``, ``two-batch``, ...; with ``auto`` chosen each step from a decode calibration),
through that mode's decoder (`launch.engine.decoder.Decoder`: eager through the executor, or captured per bucket).
A request that is done frees its slot; the others go on. Which decoders a generation runs, and over which cache, is
settled once before the loop (`make_decoders`).

With expert-parallel layers over several ranks, each rank brings its own prompts (none is fine) and its own
lengths; a rank with no active request keeps taking part in every step with zero tokens until every rank is done.
After each step every rank posts, in one small all-reduce (`overlap.agree_later`, ``decode.step``), its active
requests, its widest micro-batch, its longest history, the most steps its requests may still take, and whether its
logits held NaN or inf. The all-reduce travels on its own side stream (`AGREEMENT`) under the next step, and the
step after that runs on it (``agreement="lagged"``, the default): what a rank posts only changes in known
directions, so a step's figures one step old still bound it. Its exchange's bucket comes from the widest
micro-batch of one step before (an upper bound: a rank's requests only finish, and its micro-batches are cut no
wider than that), its mode from the figures one step before (the same on every rank), its history from the
longest one step before plus one. A request that ends at a token the ranks could not foresee (a stop token) costs
at most one step more, all ranks empty; a rank whose logits hold NaN or inf takes no token from them and takes
part with none until the agreement that carries its problem raises `NonFiniteLogits` on every rank, one step
later. ``agreement="blocking"`` waits for each step's own agreement before it runs, as before (to compare).
"""
from __future__ import annotations

import dataclasses
import operator
import time
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

import microbatch
import overlap
from microbatch import AUTO, Batch, DecodeModel, KVCache, OffloadedKVCache, SeqInfo
from microbatch.planning import DEFAULT_MARGIN, DecodeCalibration, DecodeGuard, choose_decode

from .alike import check_alike, collective_settings
from .decoder import Decoder, eager_decoders, expert_group
from .graph_decoder import GraphDecoder, decoders_of, graph_decoders
from .prefiller import prefill_cache
from .step import AGREEMENT, check_cache_dtype, checked_buckets, read_picked

# (step, active requests on every rank) -> whether the caller observes the next step (step 0: the prefill's token)
OnStep = Callable[[int, int], Optional[bool]]
Decoders = Union[GraphDecoder, Mapping[str, GraphDecoder]]  # one decoder, or auto's: one per candidate mode
LAGGED, BLOCKING = "lagged", "blocking"  # a step runs on the ranks' agreement one step old, or waits for its own
AGREEMENTS = (LAGGED, BLOCKING)


class DecodeError(RuntimeError):
    """The ranks of a generation disagree on a step (its number of micro-batches), or one found it wrong."""

    expected = True  # reported in one line on every rank, not a bug (`launch.job.guarded`)


class NonFiniteLogits(DecodeError):
    """NaN or inf in the logits of a request (on this rank or, named, another)."""


@dataclasses.dataclass
class Generated:
    """What `generate` produced on this rank: each request's new tokens and, with ``margins=True``, the gap
    between the top two logits where each was taken (how near a tie it was)."""

    tokens: List[List[int]]
    margins: Optional[List[List[float]]] = None
    steps: int = 0  # decode steps after the prefill (the same on every rank)
    modes: List[str] = dataclasses.field(default_factory=list)  # each decode step's mode (auto's choices)
    predicted: List[float] = dataclasses.field(default_factory=list)  # with auto: each step's predicted seconds


def new_cache(model: DecodeModel, prompts: Sequence[Sequence[int]], new_tokens: Union[int, Sequence[int]], *,
              offload: bool = False, requests: int = 0, room: int = 0) -> KVCache:
    """A cache with one slot per prompt, room for the longest prompt plus its new tokens, of the model's own
    per-token key and value shapes (``cfg.k_shape``, ``cfg.v_shape``); with ``offload``, on the host, each
    layer's history prefetched on the ``kv_offload`` stream while the layer before computes
    (`microbatch.OffloadedKVCache`: close it when done). ``requests`` / ``room``: at least that many slots / rows
    (a cache that captured steps calibrate the whole job over, where another rank brings more)."""
    cfg = model.cfg
    limits = _limits(prompts, new_tokens)
    longest = max((len(p) + n for p, n in zip(prompts, limits)), default=1)
    weight = next(model.parameters())
    kind = OffloadedKVCache if offload else KVCache
    return kind(cfg.n_layers, max(1, len(prompts), requests), max(longest, room), cfg.k_shape, cfg.v_shape,
                dtype=weight.dtype, device=weight.device)


def _limits(prompts: Sequence[Sequence[int]], new_tokens: Union[int, Sequence[int]]) -> List[int]:
    """Each prompt's most new tokens: ``new_tokens`` for all, or one count per prompt; a one-line ValueError naming
    the value otherwise (a float, a bool, a count below 1)."""
    many = isinstance(new_tokens, Sequence) and not isinstance(new_tokens, (str, bytes))
    limits = list(new_tokens) if many else [new_tokens] * len(prompts)
    if not all(_is_int(n) and n >= 1 for n in limits):
        raise ValueError(f"new_tokens must be an integer of at least 1 (or one per prompt), got {new_tokens!r}")
    if len(limits) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(limits)} new-token counts")
    return [int(n) for n in limits]


def _is_int(value: object) -> bool:
    """Whether ``value`` is an integer (a Python or numpy one, not a bool)."""
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return not isinstance(value, bool)


def _is_list(value: object) -> bool:
    """Whether ``value`` is a sized collection of items (a list, a tuple, a tensor), not a string."""
    return not isinstance(value, (str, bytes)) and hasattr(value, "__len__") and hasattr(value, "__iter__")


def _check_arguments(model: DecodeModel, prompts: Sequence[Sequence[int]], stop_token: Optional[int],
                     cache: Optional[KVCache]) -> None:
    """`generate`'s prompts, stop token and cache against the model (its vocabulary, its dtype): a one-line
    ValueError naming the argument and its value, before any collective."""
    vocab = model.cfg.vocab
    _check_prompts(prompts, vocab)
    if stop_token is not None and not (_is_int(stop_token) and 0 <= stop_token < vocab):
        raise ValueError(f"stop_token must be a token id in [0, {vocab}) (the vocabulary) or None, got {stop_token!r}")
    check_cache_dtype(model, cache, "cache")


def _check_prompts(prompts: Sequence[Sequence[int]], vocab: int) -> None:
    """A one-line ValueError unless ``prompts`` is a list of non-empty lists of token ids in ``[0, vocab)``."""
    if not _is_list(prompts):
        raise ValueError(f"prompts must be a list of prompts, each a list of token ids, got {prompts!r}")
    for i, prompt in enumerate(prompts):
        if not _is_list(prompt):
            raise ValueError(f"prompts[{i}] must be a list of token ids, got {prompt!r}")
        if len(prompt) == 0:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
        wrong = next((t for t in prompt if not (_is_int(t) and 0 <= t < vocab)), None)
        if wrong is not None:
            raise ValueError(f"prompts[{i}] holds {wrong!r}: token ids are integers in [0, {vocab}) (the vocabulary)")


@torch.no_grad()
def greedy_generate(model: DecodeModel, prompts: Sequence[Sequence[int]], new_tokens: Union[int, Sequence[int]],
                    stop_token: Optional[int] = None, cache: Optional[KVCache] = None,
                    mode: str = "serial", check_weights: bool = True) -> List[List[int]]:
    """Each prompt's greedy continuation (argmax of the LM head), at most ``new_tokens`` long (one count, or one
    per prompt), ending at ``stop_token`` (included) where it comes; the decode steps run in ``mode``
    (`microbatch.DECODE_MODES`; every rank passes the same). `generate`'s tokens."""
    return generate(model, prompts, new_tokens, stop_token=stop_token, cache=cache, mode=mode,
                    check_weights=check_weights).tokens


@torch.no_grad()
def generate(model: DecodeModel, prompts: Sequence[Sequence[int]], new_tokens: Union[int, Sequence[int]], *,
             stop_token: Optional[int] = None, cache: Optional[KVCache] = None, mode: Optional[str] = None,
             prefill_mode: str = "serial", on_step: Optional[OnStep] = None, margins: bool = False,
             buckets: Optional[Sequence[int]] = None, calibration: Optional[DecodeCalibration] = None,
             margin: float = DEFAULT_MARGIN, guard: Union[bool, DecodeGuard] = True, graph: Optional[str] = None,
             decoder: Optional[Decoders] = None, length_buckets: bool = False, agreement: str = LAGGED,
             check_weights: bool = True) -> Generated:
    """Greedy generation (see the module docstring): prefill in ``prefill_mode``, decode steps in ``mode``.

    ``prompts``: this rank's requests' token ids (none is fine with several ranks); ``new_tokens``: the most
    each generates (one count, or one per prompt); ``cache``: where the keys and values go (default
    `new_cache`; its slots are taken and freed here); ``on_step(step, active)`` is called once each step's
    tokens are taken and the ranks' agreement read, with the requests active on every rank as that agreement says
    (one step old on several ranks), 0 where no step follows; where it returns True the caller observes the next
    step (a timeline), whose time the guard then does not count; ``buckets``: the sizes a step's
    exchange is padded to (`launch.engine.step.bucket_of`; default the powers of two). ``mode="auto"`` chooses each
    step's mode from ``calibration`` (`launch.engine.calibrate_decode`; the same on every rank), serial unless
    another is predicted at least ``margin`` faster (`microbatch.planning.choose_decode`), and checks its choices
    with ``guard`` (`microbatch.planning.DecodeGuard`: each step timed, the slowest rank's time agreed with the
    step; a mode measured slower than serial is set aside): True for a new one, one of your own to keep what it
    measured across generations, False for none. ``graph``: decode steps padded to their bucket and captured once
    per bucket on that path (`launch.engine.GraphDecoder`: ``ge``, ``aclgraph``, ``cuda``; ``cpu`` runs the padded
    step eagerly; ``length_buckets``: attention over the room the histories use, a graph per bucket and length),
    or through ``decoder`` (its cache, mode and graphs, kept across generations). With ``mode="auto"`` the steps
    are captured too: ``decoder`` is then a mapping of each mode of ``calibration`` to its decoder over one cache
    (``graph`` builds them), and ``calibration`` one of those captured steps (`launch.engine.calibrate_decode` with
    ``decoders``). ``agreement``: ``"lagged"`` (a step runs on the ranks' agreement issued after the step before
    the last, which travelled under the last step) or ``"blocking"`` (each step waits for its own; see the module
    docstring). With several ranks, one agreement before the prefill checks that every argument shaping a
    collective (modes, buckets, graph, exchanges, the model's layers and dims) and, with ``check_weights``, the
    replicated weights (`launch.engine.alike`) are alike on every rank: `DecodeError` on every rank otherwise.
    """
    _check_arguments(model, prompts, stop_token, cache)
    buckets = checked_buckets(buckets)
    if agreement not in AGREEMENTS:
        raise ValueError(f"agreement must be one of {', '.join(AGREEMENTS)}, got {agreement!r}")
    limits = _limits(prompts, new_tokens)
    mode, decoders = make_decoders(model, prompts, limits, mode=mode, calibration=calibration, cache=cache,
                                   decoder=decoder, graph=graph, buckets=buckets, length_buckets=length_buckets)
    group = expert_group(model)
    if group is not None:
        overlap.watch_peers()  # so that a wait that runs out names the rank it waited for
    check_alike(model, group, _settings(model, mode, prefill_mode, agreement, decoders), DecodeError, check_weights)
    cache = next(iter(decoders.values())).cache
    slots = cache.admit(len(prompts))
    device = next(model.parameters()).device
    lens = [len(p) for p in prompts]
    tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    hidden = prefill_cache(model, Batch(tokens, SeqInfo.from_lens(lens)), cache, slots, prefill_mode, group)
    last = torch.tensor(lens, dtype=torch.long, device=device).cumsum(0) - 1
    out = Generated([[] for _ in prompts], [[] for _ in prompts] if margins else None)
    active = list(range(len(prompts)))
    nxt, gaps, problem = _greedy(model.logits(hidden[last]), active, 0, margins)
    checks = _guard_for(mode, guard)
    lagged = agreement == LAGGED and group is not None
    sent: Optional[_Sent] = None  # the newest agreement, in flight under the last step where lagged
    runs: Dict[int, _Ran] = {}  # auto's steps, by number, until the agreement that times them is read
    while True:
        number = out.steps  # the step whose tokens are taken now (0: the prefill's)
        known = sent.result() if sent is not None else None  # on the step before: it travelled under this one
        if known is not None:
            _record(checks, runs, known)
        still = []
        for j, (i, t) in enumerate(zip(active, nxt)):
            if problem:
                break  # no token from logits that went wrong: this rank takes part with none until it raises
            out.tokens[i].append(t)
            if out.margins is not None and gaps:  # a captured step picks without margins
                out.margins[i].append(gaps[j])
            if len(out.tokens[i]) < limits[i] and t != stop_token:
                still.append(i)
        going = set(still)
        cache.release([slots[i] for i in active if i not in going])
        history = [lens[i] + len(out.tokens[i]) - 1 for i in still]  # rows held before the next step's
        parts_by_count = _parts(decoders, history)
        if known is not None:  # cut no wider than the bound the next step runs on
            parts_by_count = {n: _within(p, known.widest[n], history) for n, p in parts_by_count.items()}
        ran = runs.get(number)
        took = time.perf_counter() - ran.start if ran is not None else 0.0
        built = ran is not None and _builds(decoders) != ran.builds
        left = max((limits[i] - len(out.tokens[i]) for i in still), default=0)
        widest = {n: max(map(len, p)) for n, p in parts_by_count.items()}
        post = _Post(len(still), widest, max(history, default=0), left, mode, took, built)
        sent = _send(post, problem, group, number, lagged)
        if known is None or not lagged or not known.follows(number):  # the first, blocking, or the last: its own
            known = sent.result()
            _record(checks, runs, known)
        lag = number - known.number  # steps the agreement is behind: 0 or 1
        follows = known.follows(number)
        observed = bool(on_step(number, known.active if follows else 0)) if on_step is not None else False
        if not follows:
            return out
        out.steps += 1
        overlap.peer_step()  # a rank held before here (in on_step, say) stays a step behind its peers
        name = mode
        if mode == AUTO:
            if checks is not None:
                choice = checks.choose(calibration, known.tokens, known.history + lag, margin=margin)
            else:
                choice = choose_decode(calibration, known.tokens, known.history + lag, margin=margin)
            name = choice.mode
            out.predicted.append(choice.seconds)
            runs[out.steps] = _Ran(name, choice.seconds, time.perf_counter(), observed, _builds(decoders))
        out.modes.append(name)
        current = decoders[name]
        parts = parts_by_count[current.micro_batches]
        picked = current.run([slots[i] for i in still], [out.tokens[i][-1] for i in still], parts,
                             widest=known.widest[current.micro_batches], history=known.history + lag,
                             number=out.steps, margins=margins)
        active = [still[j] for part in parts for j in part]  # the order of the picked rows
        nxt, gaps, problem = read_picked(picked, active, out.steps)


def make_decoders(model: DecodeModel, prompts: Sequence[Sequence[int]], limits: Sequence[int], *,
                  mode: Optional[str] = None, calibration: Optional[DecodeCalibration] = None,
                  cache: Optional[KVCache] = None, decoder: Optional[Decoders] = None, graph: Optional[str] = None,
                  buckets: Optional[Sequence[int]] = None, length_buckets: bool = False
                  ) -> Tuple[str, Dict[str, Decoder]]:
    """A generation's decode mode and the decoder of each mode it may run (auto: every mode of ``calibration``),
    all over one cache: ``decoder``'s own (a `GraphDecoder`, or auto's mapping of them), else ones built here,
    captured on ``graph`` or eager, over ``cache`` (default `new_cache` of ``prompts`` and ``limits``). ``mode``
    defaults to ``decoder``'s (auto for a mapping), else serial. `generate`'s arguments; a one-line ValueError for
    what does not fit together."""
    if mode is None:
        mode = AUTO if isinstance(decoder, Mapping) else decoder.mode if decoder is not None else "serial"
    if mode == AUTO and calibration is None:
        raise ValueError("decode mode 'auto' chooses each step's mode from a decode calibration: pass "
                         "calibration=launch.engine.calibrate_decode(model, ...)")
    captured = graph is not None or decoder is not None
    if mode == AUTO and calibration.padded != captured:
        raise ValueError("decode mode 'auto' with captured steps chooses from a calibration of them "
                         "(calibrate_decode(model, decoders=...))" if captured else
                         "this decode calibration timed captured steps: pass their decoders (decoder=...)")
    modes = list(calibration.modes) if mode == AUTO else [mode]
    if decoder is not None:
        given = _given_decoders(decoder, mode, modes, cache)
        check_cache_dtype(model, next(iter(given.values())).cache, "decoder's cache")
        return mode, given
    cache = cache or new_cache(model, prompts, limits)
    if graph is None:
        return mode, eager_decoders(model, cache, modes, buckets)
    return mode, graph_decoders(model, cache, modes, graph, buckets, length_buckets)


def _settings(model: DecodeModel, mode: str, prefill_mode: str, agreement: str, decoders: Mapping[str, Decoder]
              ) -> Dict[str, object]:
    """What `generate` must run alike on every rank (`launch.engine.alike.collective_settings`)."""
    first = next(iter(decoders.values()))
    buckets = getattr(first, "buckets", None)
    return collective_settings(model, **{"decode mode": mode, "prefill mode": prefill_mode, "agreement": agreement,
                                         "modes": sorted(decoders),
                                         "buckets": "powers of two" if buckets is None else list(buckets),
                                         "graph": getattr(first, "path", "off"),
                                         "length buckets": bool(getattr(first, "length_buckets", False))})


def _given_decoders(decoder: Decoders, mode: str, modes: Sequence[str], cache: Optional[KVCache]
                    ) -> Dict[str, Decoder]:
    """The caller's decoder of each of ``modes``, checked against ``mode`` (auto: every calibrated mode's, over one
    cache) and ``cache``; a one-line ValueError for what does not fit."""
    if mode != AUTO:
        if not isinstance(decoder, GraphDecoder) or decoder.mode != mode or cache not in (None, decoder.cache):
            raise ValueError(f"the decoder runs its own mode over its own cache: pass neither another mode ({mode!r}) "
                             f"nor another cache")
        return {mode: decoder}
    if not isinstance(decoder, Mapping):
        raise ValueError("decode mode 'auto' takes one decoder per calibrated mode: decoder={mode: GraphDecoder}")
    chosen = decoders_of(decoder, modes)
    if cache not in (None, next(iter(chosen.values())).cache):
        raise ValueError("auto's decoders run over their own cache: pass no other cache")
    return dict(chosen)


def _parts(decoders: Mapping[str, Decoder], history: Sequence[int]) -> Dict[int, List[List[int]]]:
    """A step's requests (holding ``history`` rows each) cut into the micro-batches of each count a decoder runs
    (decoders of one generation with the same count cut alike)."""
    parts: Dict[int, List[List[int]]] = {}
    for d in decoders.values():
        if d.micro_batches not in parts:
            parts[d.micro_batches] = d.parts(history)
    return parts


def _guard_for(mode: str, guard: Union[bool, DecodeGuard]) -> Optional[DecodeGuard]:
    """Auto's guard: a new one for True, the caller's own kept across generations, none for False or a fixed mode."""
    if mode != AUTO or guard is False:
        return None
    return DecodeGuard() if guard is True else guard


def _greedy(logits: torch.Tensor, requests: List[int], step: int, margins: bool
            ) -> Tuple[List[int], List[float], Optional[str]]:
    """Each row's argmax, the gap to its runner-up (with ``margins``), and what is wrong where a row holds NaN or
    inf (naming its request and the step)."""
    bad = (~torch.isfinite(logits)).any(-1).nonzero().flatten().tolist()
    problem = None
    if bad:
        problem = (f"NaN or inf in the logits of request {requests[bad[0]]} at decode step {step} (0: the prefill's)"
                   + (f" and of {len(bad) - 1} more" if len(bad) > 1 else ""))
    gaps: List[float] = []
    if margins and logits.shape[0] and logits.shape[-1] > 1:
        top = logits.float().topk(2, dim=-1).values
        gaps = (top[:, 0] - top[:, 1]).tolist()
    return logits.argmax(-1).tolist(), gaps, problem


class _Ran(NamedTuple):
    """Auto's step, as its guard needs it once the agreement that times it is read."""

    mode: str
    predicted: float  # seconds
    start: float  # perf_counter
    observed: bool  # the caller recorded its launches (`OnStep`)
    builds: Tuple[int, int]  # `_builds` before it


@dataclasses.dataclass(frozen=True)
class _Post:
    """What a rank posts once a step's tokens are taken: its active requests, its widest micro-batch for each
    micro-batch count a candidate mode uses, its longest history, the most steps its requests may still take, and
    the decode mode (which every rank must share)."""

    active: int
    widest: Dict[int, int]
    history: int
    left: int
    mode: str
    seconds: float = 0.0  # the step's time on this rank (auto's guard; 0 for the prefill's)
    built: bool = False  # the step lowered a schedule or captured a bucket on this rank


@dataclasses.dataclass(frozen=True)
class _Step:
    """What every rank agreed once step ``number``'s tokens were taken: requests active on all ranks, the most on
    one rank (``tokens``), the widest micro-batch of any rank per micro-batch count, the longest history, the most
    steps a request may still take (``left``)."""

    number: int
    active: int
    tokens: int
    widest: Dict[int, int]
    history: int
    left: int
    seconds: float = 0.0  # the step's time on the slowest rank
    built: bool = False  # the step lowered a schedule or captured a bucket on some rank

    def follows(self, number: int) -> bool:
        """Whether step ``number + 1`` runs, on what this agreement (on step ``self.number``) knows: a request is
        active and may still take that step."""
        return self.active > 0 and self.left > number - self.number


class _Sent:
    """A rank's post on step ``number``, sent to every rank (`_send`); `result` waits for their agreement."""

    def __init__(self, number: int, widths: Sequence[int], pending: Optional[overlap.PendingAgreement] = None,
                 alone: Optional[_Step] = None):
        self.number, self.widths, self.pending, self.agreed = number, list(widths), pending, alone

    def result(self) -> _Step:
        """The step as every rank agreed it (`_Step`); `NonFiniteLogits` on every rank, naming the rank, where one
        found NaN or inf; waits at most the wait bound (`overlap.set_wait_timeout`)."""
        if self.agreed is None:
            posts = self.pending.result()
            widest = {n: max(p["widest"][i] for p in posts) for i, n in enumerate(self.widths)}
            self.agreed = _Step(self.number, sum(p["active"] for p in posts), max(p["active"] for p in posts), widest,
                                max(p["history"] for p in posts), max(p["left"] for p in posts),
                                max(float(p["seconds"]) for p in posts), any(p["built"] for p in posts))
        return self.agreed


def _send(post: _Post, problem: Optional[str], group: Optional[dist.ProcessGroup], number: int, aside: bool
          ) -> _Sent:
    """This rank's post on step ``number`` sent to every rank of ``group`` (`overlap.agree_later`: one small
    all-reduce, on the `AGREEMENT` side stream where ``aside``); alone, the step as it is, or `NonFiniteLogits` at
    once."""
    widths = sorted(post.widest)
    if group is None:
        if problem:
            raise NonFiniteLogits(problem)
        return _Sent(number, widths, alone=_Step(number, post.active, post.active, dict(post.widest), post.history,
                                                 post.left, post.seconds, post.built))
    mine = {"active": post.active, "widest": [post.widest[n] for n in widths], "history": post.history,
            "left": post.left, "decode mode": post.mode, "seconds": post.seconds, "built": post.built}
    transport = overlap.GroupTransport(group, "decode.step", stream=AGREEMENT if aside else None)
    pending = overlap.agree_later(mine, transport, problems=[problem] if problem else [],
                                  per_rank=["active", "widest", "history", "left", "seconds", "built"],
                                  error=DecodeError, problem_error=NonFiniteLogits)
    return _Sent(number, widths, pending)


def _record(checks: Optional[DecodeGuard], runs: Dict[int, _Ran], known: _Step) -> None:
    """Auto's step ``known.number``, timed on the slowest rank, to its guard: once, unless the caller observed it or
    it built something (a lowering, a capture: its time is no measurement)."""
    ran = runs.pop(known.number, None)
    if ran is not None and checks is not None and not ran.observed and not known.built:
        checks.record(ran.mode, ran.predicted, known.seconds)


def _within(parts: List[List[int]], most: int, history: Sequence[int]) -> List[List[int]]:
    """``parts`` (indices into ``history``) with none wider than ``most``: from a wider part, its shortest-history
    requests move to the narrowest part. Always possible where ``most`` bounds a cut of more requests before."""
    if max(map(len, parts), default=0) <= most:
        return parts
    parts = [sorted(p, key=lambda j: (history[j], j)) for p in parts]
    for part in parts:
        while len(part) > most:
            min(parts, key=len).append(part.pop(0))
    return [sorted(p) for p in parts]


def _builds(decoders: Mapping[str, Decoder]) -> Tuple[int, int]:
    """What this process has built so far: schedules lowered (`microbatch.replay_stats`), the decoders' own steps
    (captured buckets). A step that builds pays for it once (a lowering; on a device a capture or a compile): its
    time is no measurement."""
    return microbatch.replay_stats()["lowered"], sum(d.built for d in decoders.values())


__all__ = ["AGREEMENTS", "BLOCKING", "DecodeError", "Decoders", "Generated", "LAGGED", "NonFiniteLogits", "OnStep",
           "generate", "greedy_generate",
           "make_decoders", "new_cache"]
