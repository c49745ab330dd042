"""What the primitives lower to right now: the execution path, the enable switch and the current stream.

A path names how a schedule is lowered: ``ge`` (torchair max-autotune), ``aclgraph`` (torch_npu's
``npugraph_ex`` backend), ``npu`` / ``cuda`` (eager streams) and ``cpu`` (logical streams:
compute inline, collectives and copies asynchronous on host threads). Each has one backend in
`overlap.backends`. The three settings here are context variables, so a thread or an asyncio
task can lower on its own path; this module imports nothing else of the toolkit.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
import sys
from typing import Iterator, Optional

import torch

PATHS = ("ge", "aclgraph", "npu", "cuda", "cpu")
GRAPH_PATHS = ("ge", "aclgraph")  # what $OVERLAP_GRAPH_PATH may name: a compiled region lowers to a graph
ENV_PATH = "OVERLAP_PATH"
ENV_GRAPH_PATH = "OVERLAP_GRAPH_PATH"
ENV_ENABLE = "OVERLAP_ENABLE"
DEFAULT = "default"  # the main stream's tag (torchair's name for it)

_path_override: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("overlap_path", default=None)
_enable_override: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar("overlap_enable", default=None)
_stream_tag: contextvars.ContextVar[str] = contextvars.ContextVar("overlap_stream", default=DEFAULT)
ON_WORDS = ("1", "true", "on", "yes")  # what a switch in the environment takes for on
OFF_WORDS = ("0", "false", "off", "no")  # ... and for off


def eager_in_trace(fn):  # type: ignore[no-untyped-def]
    """Run ``fn`` as plain Python while Dynamo traces; its result becomes a constant of the graph.

    For the context-variable reads and writes and the lock-guarded registries behind the
    primitives, which Dynamo cannot trace: the graph paths need them only while tracing. This is
    ``torch.compiler.assume_constant_result`` without importing Dynamo (a second) on ``import
    overlap``. No guard is installed, so a compiled function does not recompile when the path or
    the switch changes: compile under the path it will run on.
    """
    fn._dynamo_marked_constant = True
    return fn


def check_path(path: str, source: str) -> str:
    """``path`` if it names an execution path, else a ValueError naming where it came from."""
    if path not in PATHS:
        raise ValueError(f"unknown execution path {path!r} from {source}; expected one of {', '.join(PATHS)}")
    return path


@functools.lru_cache(maxsize=1)
def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
        return bool(torch.npu.is_available())
    except Exception:  # a wheel without CANN cannot even be imported
        return False


def env_path() -> Optional[str]:
    """``$OVERLAP_PATH`` as a path name (None when unset or empty); ValueError naming it for anything else."""
    env = os.environ.get(ENV_PATH, "").strip().lower()
    return check_path(env, f"${ENV_PATH}") if env else None


def env_graph_path() -> str:
    """``$OVERLAP_GRAPH_PATH`` (default ``ge``): the lowering inside a compiled region; ValueError naming it
    for anything but a graph path."""
    value = os.environ.get(ENV_GRAPH_PATH, "").strip().lower() or "ge"
    if value not in GRAPH_PATHS:
        raise ValueError(f"unknown graph path {value!r} from ${ENV_GRAPH_PATH}; expected one of "
                         f"{', '.join(GRAPH_PATHS)}")
    return value


def env_switch(name: str, on: str, off: str) -> Optional[bool]:
    """``$name`` as a switch: True for `ON_WORDS` (1, true, on, yes), False for `OFF_WORDS` (0, false, off, no),
    None when unset or empty; ValueError naming it, the words and what each side means (``on``, ``off``) for
    any other word (``maybe`` is neither)."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return None
    if value in ON_WORDS + OFF_WORDS:
        return value in ON_WORDS
    raise ValueError(f"${name}={raw!r}: expected {', '.join(ON_WORDS)} ({on}) or {', '.join(OFF_WORDS)} ({off})")


def env_enabled() -> bool:
    """``$OVERLAP_ENABLE``: on unless it says 0, false, off or no; ValueError naming it for a word that is
    neither (`env_switch`)."""
    return env_switch(ENV_ENABLE, "overlap on", "single-stream") is not False


def detect_path() -> str:
    """The execution path without overrides: compiled region, NPU, CUDA or CPU."""
    graph = env_graph_path()  # checked wherever it is read from: a bad value fails here, not only in a graph
    if torch.compiler.is_compiling() and "torch_npu" in sys.modules:
        return graph
    if _npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


@eager_in_trace
def _path_override_value() -> Optional[str]:
    return _path_override.get()


@eager_in_trace
def _enable_override_value() -> Optional[bool]:
    return _enable_override.get()


def current_path() -> str:
    """The path primitives lower to: `use_path` override, then ``$OVERLAP_PATH``, then detection."""
    path = _path_override_value()
    if path is not None:
        return path
    return env_path() or detect_path()


def set_path(path: Optional[str]) -> None:
    """Force the execution path for this context (``None`` restores detection)."""
    _path_override.set(None if path is None else check_path(path, "set_path()"))


@contextlib.contextmanager
def use_path(path: str) -> Iterator[str]:
    """Lower every primitive inside the block on ``path``."""
    token = _path_override.set(check_path(path, "use_path()"))
    try:
        yield path
    finally:
        _path_override.reset(token)


def is_enabled() -> bool:
    """Whether overlap is on; off, every primitive lowers to plain single-stream code."""
    flag = _enable_override_value()
    if flag is not None:
        return flag
    return env_enabled()


def set_enabled(flag: Optional[bool]) -> None:
    """Turn overlap on or off for this context (``None`` restores ``$OVERLAP_ENABLE``)."""
    _enable_override.set(flag)


@contextlib.contextmanager
def enabled(flag: bool = True) -> Iterator[bool]:
    """Turn overlap on or off inside the block."""
    token = _enable_override.set(bool(flag))
    try:
        yield bool(flag)
    finally:
        _enable_override.reset(token)


class Pinned(tuple):
    """This context's path and switch as `pin` set them (their tokens: a tuple, made without a Python
    ``__init__`` on every run that pins); `restore` puts back what was there before."""

    __slots__ = ()

    def restore(self) -> None:
        """Put back the path and switch this context had before `pin` (once, in the context that pinned)."""
        _enable_override.reset(self[1])
        _path_override.reset(self[0])


def pin(path: str, flag: bool) -> Pinned:
    """Set this context's path and switch at once until the returned `Pinned`'s ``restore()``: for a run that
    reads both at every primitive (a `microbatch` program), so that none reads the environment, with no
    ``with`` block (`use_path`, `enabled`) to enter. Not while Dynamo traces: it cannot set context variables."""
    if path not in PATHS:
        check_path(path, "pin()")
    return Pinned((_path_override.set(path), _enable_override.set(flag)))


@eager_in_trace
def current_stream_tag() -> str:
    """The tag of the stream work is placed on now (``"default"`` outside any `stream` block)."""
    return _stream_tag.get()


@eager_in_trace
def swap_stream_tag(tag: str) -> str:
    """Make ``tag`` the current stream tag; returns the previous one (a constant while tracing)."""
    prev = _stream_tag.get()
    _stream_tag.set(tag)
    return prev
