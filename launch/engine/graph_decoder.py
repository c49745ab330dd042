"""The decode step captured once per batch bucket and replayed: static shapes, padding rows, one graph a bucket.

A decode step's shapes change every step: the active requests shrink as they finish, and each request's
history grows. `GraphDecoder` makes them static. A step of ``n`` active requests in a mode of ``N``
micro-batches cuts them into ``N`` contiguous parts of at most ``ceil(n / N)`` (`GraphDecoder.widest`), takes
the **bucket** of the widest part over the ranks (`launch.engine.step.bucket_of`: the powers of two, or the
``buckets`` given, the same on every rank) and pads every part to it: ``N x bucket`` rows whatever ``n``,
the MoE's exchange capacity the bucket (its layer's `decode_stages`), its padding rows sent to no expert
(``MOE_ACTIVE``: every padding row carries the same token, so routed they would all load the same experts).
Attention reads every slot's whole ``max_len`` with a mask built on the device from each row's length
(`microbatch.kv_cache.StaticRows`); a padding row writes back what row 0 of a slot holds, so it never changes a
request's cache rows. Nothing in
the step depends on the host's values but the bucket, so one graph per bucket serves every step of it.
With ``length_buckets`` attention reads each slot's first ``length`` rows instead, the power of two (at
least `MIN_LENGTH`, at most ``max_len``) that holds the longest history over the ranks and the step's new
row (`GraphDecoder.length`; the ranks agree on it with the bucket): one graph per (bucket, length), so a
step reads and gathers the room its histories use, not the whole ``max_len``, at the price of more graphs.

- ``ge`` / ``aclgraph``: ``torch.compile(fullgraph=True, dynamic=False)`` with the path's torchair backend
  (`overlap.backends.Backend.compile_backend`), as `launch.engine.prefiller.graph_prefill`; each bucket a function of
  its own code, so Dynamo keeps one graph per bucket (and none is shared between decoders or paths);
- ``cuda``: the eager step captured with ``torch.cuda.CUDAGraph`` (warmed up on a side stream first, static
  input buffers copied in before each replay, the picked ids copied out);
- ``cpu``: the padded static step run eagerly (what the graphs compute, testable on any machine).

A `GraphDecoder` is a `launch.engine.decoder.Decoder`: `launch.engine.generation.generate(graph=path)` (or
``decoder=``) runs its decode steps through one; the generation launcher's ``--decode-graph PATH``,
``--decode-buckets`` and ``--decode-length-buckets``. Which model it can capture is the model's to say
(``no_capture_reason``, `microbatch.DecodeModel`), not its class's.
"""
from __future__ import annotations

import importlib.util
import math
import types
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

import microbatch
import overlap
from collectives import MOE_ACTIVE, MOE_CAPACITY, ExpertParallelMoE
from microbatch import KV_STEP, DecodeModel, KVCache
from microbatch.kv_cache import StaticKVStep, StaticRows

from .step import (DECODE_STEP, TOKENS, Picked, bucket_of, check_cache_dtype, checked_buckets, decode_step,
                   lower_step)

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MIN_LENGTH = 16  # the shortest room a step with length buckets attends over (fewer graphs for short histories)
CompileBackend = Union[str, Callable[..., object]]


class GraphDecoder:
    """Decode steps of ``model`` over ``cache`` in ``mode`` (`microbatch.DECODE_MODES`), one graph per bucket on
    ``path`` (see the module docstring). ``buckets``: the sizes a micro-batch is padded to, the same on every
    rank (default: the powers of two); ``compile_backend``: what ``torch.compile`` uses on ``ge`` / ``aclgraph``
    (default: the path's own); ``length_buckets``: attention over the room the histories use, a graph per
    (bucket, length), instead of every slot's whole ``max_len`` (see the module docstring). Refused with a
    ValueError: a path that captures nothing here (``npu``: use ``aclgraph``), a cache that is not a device
    `KVCache` (the host cache), a model that says why its steps cannot be captured (``no_capture_reason``: the
    transformers adapter, whose attention does not go through the step's ``attend``), on the graph paths a
    MoE block that is not an `ExpertParallelMoE` (its decode stages are the static ones), and a path this machine
    or the cache's device cannot capture on (`capture_problem`)."""

    def __init__(self, model: DecodeModel, cache: KVCache, mode: str = "serial", path: str = "cpu",
                 buckets: Optional[Sequence[int]] = None, compile_backend: Optional[CompileBackend] = None,
                 length_buckets: bool = False):
        self.target = overlap.backends.get(path)  # a ValueError for an unknown path
        self.device_graph = self.target.device_type == "cuda"  # torch.cuda.CUDAGraph (the NPU's graphs: aclgraph)
        self.captures = self.target.is_graph or self.device_graph
        _refuse(model, cache, path, self.target, self.captures)
        # a compile_backend of the caller's own decides where a ge / aclgraph step runs (the tests' stand-in for
        # torchair runs it on the CPU); a CUDA graph always needs the device
        problem = (capture_problem(path, cache.device.type) if compile_backend is None or self.device_graph
                   else None)
        if problem is not None:
            raise ValueError(f"GraphDecoder(path={path!r}): {problem}")
        self.model, self.cache, self.path, self.mode = model, cache, path, mode
        self.how = microbatch.decode_mode(mode)
        self.buckets = checked_buckets(buckets)
        self.compile_backend = compile_backend
        self.layers = model.decode_layer_operations(self.how.moe_chunks)
        self.length_buckets = bool(length_buckets)
        self._steps: Dict[Tuple[int, int], StepFn] = {}

    @property
    def micro_batches(self) -> int:
        """The micro-batches of every step (the mode's)."""
        return self.how.micro_batches

    @property
    def built(self) -> int:
        """The steps built so far (`compiled_steps`)."""
        return len(self._steps)

    @property
    def compiled_buckets(self) -> List[int]:
        """The buckets with a step built so far (captured, or on ``cpu`` run), in order."""
        return sorted({bucket for bucket, _ in self._steps})

    @property
    def compiled_steps(self) -> List[Tuple[int, int]]:
        """The (bucket, length) of every step built so far, in order (one length, ``max_len``, without
        ``length_buckets``)."""
        return sorted(self._steps)

    def length(self, history: int) -> int:
        """The rows of each slot a step attends over when the longest history over the ranks is ``history`` rows
        (before the step's own): ``max_len``, or with ``length_buckets`` the power of two (at least `MIN_LENGTH`)
        that holds those rows and the new one, at most ``max_len``."""
        if not self.length_buckets:
            return self.cache.max_len
        return min(self.cache.max_len, max(MIN_LENGTH, bucket_of(history + 1)))

    def widest(self, active: int) -> int:
        """The rows of the widest micro-batch of a step of ``active`` requests (what the ranks agree on)."""
        return math.ceil(active / self.micro_batches)

    def bucket(self, widest: int) -> int:
        """The bucket of a step whose widest micro-batch over the ranks has ``widest`` rows."""
        return bucket_of(widest, self.buckets)

    def parts(self, history: Sequence[int]) -> List[List[int]]:
        """The requests cut into `micro_batches` contiguous parts of at most `widest` (its static step attends
        over the whole room: there is no cost to balance)."""
        size = self.widest(len(history))
        return [list(range(i * size, min(len(history), (i + 1) * size))) for i in range(self.micro_batches)]

    def run(self, slots: Sequence[int], tokens: Sequence[int], parts: Sequence[Sequence[int]], widest: int,
            history: int, number: Optional[int] = None, margins: bool = False) -> Picked:
        """`step` as a `launch.engine.decoder.Decoder` runs it: ``parts`` are `parts`' (the requests in order),
        and a captured step picks without margins."""
        return Picked(self.step(slots, tokens, widest=widest, history=history))

    @torch.no_grad()
    def step(self, slots: Sequence[int], tokens: Union[Sequence[int], torch.Tensor],
             widest: Optional[int] = None, history: Optional[int] = None) -> torch.Tensor:
        """One decode step of the requests in ``slots`` (in use in the cache) whose last tokens are ``tokens``:
        padded to its bucket, the bucket's graph built on first use or replayed; returns each request's picked
        token id (a device tensor, -1 where its logits hold NaN or inf) and counts its new row in the cache.
        ``widest``: the widest micro-batch over the ranks; ``history``: the longest history over the ranks, in
        rows before this step's (`length`); each by default this rank's (one process)."""
        slots, mine = list(slots), self.widest(len(slots))
        if len(tokens) != len(slots):
            raise ValueError(f"{len(slots)} slots but {len(tokens)} tokens")
        widest = mine if widest is None else int(widest)
        if widest < mine:
            raise ValueError(f"widest={widest} is below this rank's widest micro-batch of {mine} rows")
        longest = max((self.cache.lengths[s] for s in slots), default=0)
        history = longest if history is None else int(history)
        if history < longest:
            raise ValueError(f"history={history} is below this rank's longest history of {longest} rows")
        bucket, length = self.bucket(widest), self.length(history)
        layout, real = _layout(len(slots), self.micro_batches, bucket)
        rows = self.cache.static_rows([slots[j] if j >= 0 else None for j in layout])
        where = torch.tensor(real, dtype=torch.long, device=self.cache.device)
        padded = torch.zeros(len(layout), dtype=torch.long, device=self.cache.device)
        padded[where] = torch.as_tensor(tokens, dtype=torch.long).to(self.cache.device)
        run = self._steps.get((bucket, length)) or self._build(bucket, length)
        with overlap.use_path(self.path), overlap.no_host_sync(f"{DECODE_STEP} (bucket {bucket})"):
            ids = run(padded, rows.index, rows.held, rows.real)
        self.cache.advance(rows)
        return ids.index_select(0, where)

    def _build(self, bucket: int, length: int) -> StepFn:
        # on a graph path the schedule is lowered here, once: the trace then holds the launches, not the lowering
        lowered = lower_step(self.layers, self.how.make, self.micro_batches, self.path, _STEP_INPUTS) \
            if self.target.is_graph else None
        fn = _static_step(self.model, self.layers, self.how.make, self.cache, self.micro_batches, bucket, length,
                          lowered)
        if self.target.is_graph:
            own = _own_code(fn, f"decode_step_bucket_{bucket}_rows_{length}")
            run: StepFn = torch.compile(own, backend=self.compile_backend or self.target.compile_backend(),
                                        fullgraph=True, dynamic=False)
        elif self.device_graph:
            with overlap.use_path(self.path), overlap.no_host_sync(f"{DECODE_STEP} capture (bucket {bucket})"):
                run = _DeviceGraph(fn, self.target.mod, self.micro_batches * bucket, self.cache.device,
                                   f"{self.mode} bucket {bucket}, {length} rows")
        else:
            run = fn
        self._steps[bucket, length] = run
        return run


def graph_decoders(model: DecodeModel, cache: KVCache, modes: Sequence[str], path: str = "cpu",
                   buckets: Optional[Sequence[int]] = None, length_buckets: bool = False) -> Dict[str, GraphDecoder]:
    """A `GraphDecoder` of each of ``modes`` over ``cache`` on ``path``, keyed by its mode (auto's decoders)."""
    return {m: GraphDecoder(model, cache, m, path, buckets, length_buckets=length_buckets) for m in modes}


def decoders_of(decoders: Mapping[str, GraphDecoder], modes: Sequence[str]) -> Dict[str, GraphDecoder]:
    """The decoders of ``modes`` (``decoders`` keyed by the mode each runs, as auto takes them), checked to run over
    one cache with one path, buckets and length buckets: a one-line ValueError naming a missing or mismatched one."""
    missing = [m for m in modes if m not in decoders]
    if missing:
        raise ValueError(f"no decoder for the calibrated mode {missing[0]!r} (decoders for: "
                         f"{', '.join(decoders) or 'none'})")
    chosen = {m: decoders[m] for m in modes}
    first = next(iter(chosen.values()), None)
    for mode, d in chosen.items():
        if d.mode != mode:
            raise ValueError(f"the decoder for {mode!r} runs mode {d.mode!r}")
        if d.cache is not first.cache or (d.path, d.buckets, d.length_buckets) != (first.path, first.buckets,
                                                                                  first.length_buckets):
            raise ValueError(f"the decoders must share one cache, path, buckets and length buckets ({mode!r}'s "
                             f"differ from {first.mode!r}'s)")
    return chosen


def capture_problem(path: str, device: Optional[str] = None) -> Optional[str]:
    """Why decode steps cannot be captured on ``path`` here (None where they can), found before anything runs:
    the path's device on this machine (a CUDA device for ``cuda``; torch_npu with an NPU for ``ge`` and
    ``aclgraph``), the run's ``device`` where one is given (the model's and cache's), and the path's compiler
    importable (torchair for ``ge``, torch_npu's ``npugraph_ex`` for ``aclgraph``).
    ``cpu`` (the padded step run eagerly) can always run, and so can a path the caller forced onto a machine
    without its device (`overlap.use_path`, ``$OVERLAP_PATH``: a stand-in device); an unknown path is a ValueError."""
    target = overlap.backends.get(path)
    if target.device_type == "cpu":
        return None
    here = overlap.backends.get(overlap.detect_path()).device_type
    if overlap.backends.get(overlap.current_path()).device_type == target.device_type != here:
        return None  # the caller forced this path (use_path, $OVERLAP_PATH): its device is the caller's word
    if target.device_type != here:
        return (f"needs a CUDA device, and this machine has none (torch.cuda.is_available() is False)"
                if target.device_type == "cuda" else
                f"needs an Ascend NPU, and this machine has none (torch_npu with an available NPU: "
                f"{'not installed' if importlib.util.find_spec('torch_npu') is None else 'no NPU found'})")
    if device is not None and device != target.device_type:
        return f"captures on {target.device_type}, and this run's model and cache are on {device}"
    if target.is_graph:
        try:
            compiler = target.compile_backend()
        except ImportError as exc:
            return f"its compiler needs {exc.name or 'a module'} ({exc}): install the torchair matching torch_npu"
        import torch._dynamo  # what torch.compile would load anyway

        if isinstance(compiler, str) and compiler not in torch._dynamo.list_backends(exclude_tags=()):
            return f"torch.compile has no backend {compiler!r} here (torch_npu registers it: a newer torch_npu)"
    return None


def _refuse(model: DecodeModel, cache: KVCache, path: str, target: overlap.backends.Backend, captures: bool) -> None:
    """A one-line ValueError for what a `GraphDecoder` cannot run (before any collective)."""
    if not captures and target.device_type != "cpu":
        raise ValueError(f"GraphDecoder captures on ge, aclgraph or cuda (cpu runs it eagerly), not on {path!r}")
    if type(cache) is not KVCache:
        raise ValueError(f"GraphDecoder needs a device KVCache, got {type(cache).__name__}")
    check_cache_dtype(model, cache, "GraphDecoder's cache")
    if model.no_capture_reason is not None:
        raise ValueError(model.no_capture_reason)
    loose = [type(layer.moe).__name__ for layer in model.moe_layers() if not isinstance(layer.moe, ExpertParallelMoE)]
    if captures and loose:
        raise ValueError(f"GraphDecoder on {path} needs every MoE block expert-parallel (its decode stages are "
                         f"static: launch.engine.make_expert_parallel), got {loose[0]}")


def _layout(n: int, parts: int, bucket: int) -> Tuple[List[int], List[int]]:
    """The padded rows of a step: for each of ``parts`` micro-batches ``bucket`` rows, the requests ``0..n-1``
    cut in contiguous parts of at most ``ceil(n / parts)`` first (-1: a padding row); and where each request's
    row is."""
    size = math.ceil(n / parts) if n else 0
    layout = [-1] * (parts * bucket)
    real = []
    for j in range(n):
        at = (j // size) * bucket + j % size
        layout[at] = j
        real.append(at)
    return layout, real


_STEP_INPUTS = (TOKENS, MOE_CAPACITY, KV_STEP, MOE_ACTIVE)  # what each micro-batch of a captured step passes


def _static_step(model: DecodeModel, layers: Sequence[Sequence[microbatch.Operation]], make: Callable[..., object],
                 cache: KVCache, parts: int, bucket: int, length: int, lowered: Optional[microbatch.Lowered] = None
                 ) -> StepFn:
    """The step of one bucket on tensors only: ``(tokens, index, held, real)`` of ``parts x bucket`` rows to the
    picked ids (`launch.engine.step.decode_step` with `StaticKVStep` attention over each slot's first ``length`` rows,
    the exchange capacity ``bucket``; ``lowered``: its schedule lowered ahead, `lower_step`)."""

    def decode_static(tokens: torch.Tensor, index: torch.Tensor, held: torch.Tensor, real: torch.Tensor
                      ) -> torch.Tensor:
        rows = StaticRows(index, held, real)
        cut = [slice(i * bucket, (i + 1) * bucket) for i in range(parts)]
        inputs = [dict(zip(_STEP_INPUTS, (tokens[c], bucket, StaticKVStep(cache, rows.part(c.start, c.stop), length),
                                          real[c]))) for c in cut]
        return decode_step(model, layers, make, inputs, lowered=lowered).ids
    return decode_static


def _own_code(fn: Callable[..., torch.Tensor], name: str) -> StepFn:
    """``fn`` with a code object of its own: Dynamo keeps its graphs per code object and reads the path while
    tracing without a guard, so each step (bucket, length) of each decoder gets its own (one graph each, no
    recompile limit)."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__,
                              fn.__closure__)


class _DeviceGraph:
    """One bucket's step captured as a device graph (``torch.cuda.CUDAGraph``) and replayed.

    The static inputs start as a step of padding rows only (row 0 of slot 0, written back unchanged), which
    the warm-up runs on a side stream (PyTorch's recipe: the allocator and lazy initialisation settle outside
    the capture) and the capture records; every call copies its inputs into them, replays, and copies the
    ids out. Every rank builds the same bucket and length at the same step, so the warm-up's exchanges pair up.
    """

    def __init__(self, fn: StepFn, mod: types.ModuleType, rows: int, device: torch.device, what: str,
                 warmup: int = 2):
        self.inputs = (torch.zeros(rows, dtype=torch.long, device=device),
                       torch.zeros(rows, dtype=torch.long, device=device),
                       torch.zeros(rows, dtype=torch.long, device=device),
                       torch.zeros(rows, dtype=torch.bool, device=device))
        side = mod.Stream()
        side.wait_stream(mod.current_stream())
        with mod.stream(side):
            for _ in range(warmup):
                fn(*self.inputs)
        mod.current_stream().wait_stream(side)
        self.graph = mod.CUDAGraph()
        try:
            with mod.graph(self.graph, capture_error_mode="thread_local"):
                self.out = fn(*self.inputs)
        except RuntimeError as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise RuntimeError(f"capturing the decode step ({what}) as a device graph failed: {first} (the "
                               f"generation launcher's --decode-graph off runs eager steps)") from err

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        for buf, x in zip(self.inputs, args):
            buf.copy_(x)
        self.graph.replay()
        return self.out.clone()


__all__ = ["MIN_LENGTH", "GraphDecoder", "decoders_of", "graph_decoders"]
