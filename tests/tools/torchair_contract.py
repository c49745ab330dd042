"""Graph-mode contract harness: torchair's own ``scope`` / ``ops`` code on a CPU machine.

torchair and npugraph_ex ship inside the torch_npu wheel (``torch_npu/dynamo/torchair/`` and
``torch_npu/dynamo/npugraph_ex/``). Their Python layers register the custom ops the lowerings
emit: ``torch.ops.air.*`` for ``ge`` (torchair's GE graph) and ``torch.ops.npugraph_ex.*`` for
``aclgraph`` (the ``npugraph_ex`` backend). `load_torchair` downloads the wheel that matches the
installed torch (``pip download``, never installed), unpacks only the ``scope/`` and ``ops/`` of
both, replaces the native modules they import with small stand-ins and imports the rest as the
modules ``torchair`` and ``npugraph_ex``. `capture_graph` then compiles a function with
``torch.compile(fullgraph=True)`` on a chosen path and returns the FX graph Dynamo captured, with
the real ``air.*`` / ``npugraph_ex.*`` nodes in it. `unordered_reads` checks, on such a graph, that
every value read on another stream than its writer's is ordered after the write, under the ordering
model of the path the graph's nodes show it was captured on (`path_of`).

The wheel is cached in ``$OVERLAP_WHEEL_CACHE`` (default ``~/.cache/npu-overlap/wheels``); when
it can neither be found there nor downloaded, `load_torchair` skips the calling test with the
reason (`unavailable` tells it to programs outside pytest). Loading happens once per process, and
the process is left as it was: ``torchair`` and
``npugraph_ex`` are importable only inside `installed()` (which `capture_graph` enters), the
``torch_npu`` / ``torch.npu`` stand-ins exist only while they are imported or a graph is captured,
so ``import torch``, path detection and other tests are unaffected. Only the inert ``torch.ops.air``
and ``torch.ops.npugraph_ex`` registrations remain. Where a real torchair registered its ops in this
process already, loading fails and the tests skip with that reason.
"""
from __future__ import annotations

import contextlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import torch

ENV_CACHE = "OVERLAP_WHEEL_CACHE"
DEFAULT_CACHE = os.path.join("~", ".cache", "npu-overlap", "wheels")
_IN_WHEEL = "torch_npu/dynamo/"
_PACKAGES = ("torchair", "npugraph_ex")  # the two Python layers, each unpacked into a folder of its own
_SUBPACKAGES = ("scope", "ops")
NAMESPACES = ("air", "npugraph_ex")  # the operator namespaces of torchair and of the npugraph_ex backend
_state: Dict[str, Any] = {}  # "modules" once loaded, "error" once it failed (no second download)
# The newest torch_npu release (2026-10): its signatures are checked beside those of the installed torch's release,
# so a call it renamed fails here before a deployment upgrades.
CURRENT_RELEASE = "2.14.0"


def cache_dir() -> str:
    """Where wheels and the unpacked torchair sources are kept."""
    return os.path.expanduser(os.environ.get(ENV_CACHE) or DEFAULT_CACHE)


def _torch_release() -> str:
    return torch.__version__.split("+")[0]


def _wheel_tags() -> Tuple[str, str]:
    """The python version and platform tag of this interpreter, as ``pip download`` wants them."""
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    return py, f"manylinux_2_28_{machine}"


def _cached_wheels(directory: str, version_pattern: str) -> List[str]:
    pat = re.compile(rf"^torch_npu-{version_pattern}-.*\.whl$")
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if pat.match(f))


def _pip_download(spec: str, directory: str) -> str:
    """Download ``spec`` for this interpreter and machine into ``directory``; returns pip's error, "" if none.

    pip writes into a private folder first and the wheel is moved in whole, so concurrent test
    processes never see a partial file.
    """
    py, plat = _wheel_tags()
    with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", py,
               "--platform", plat, "--disable-pip-version-check", "-q", spec, "-d", tmp]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{' '.join(cmd)}: {exc}"
        if res.returncode != 0:
            text = (res.stderr or res.stdout).strip()
            errors = [line for line in text.splitlines() if line.startswith("ERROR")]
            return " ".join(errors or [text[-600:]]) or f"pip exited with {res.returncode}"
        for name in os.listdir(tmp):
            if name.endswith(".whl"):
                os.replace(os.path.join(tmp, name), os.path.join(directory, name))
    return ""


def find_wheel(release: Optional[str] = None) -> str:
    """Path of the torch_npu wheel of ``release`` (default: the one matching the installed torch), downloaded into
    `cache_dir` if needed.

    torch_npu X.Y.Z pins torch X.Y.Z (``.postN`` rebuilds included). When no wheel of that exact
    release exists, a ``X.Y.*`` release is taken and a warning names it. Raises RuntimeError with
    pip's error when neither can be had (no registry, no wheel for this interpreter or machine).
    """
    release = release or _torch_release()
    major_minor = ".".join(release.split(".")[:2])
    directory = cache_dir()
    os.makedirs(directory, exist_ok=True)
    errors = []
    for spec, pattern in ((f"torch-npu=={release}", rf"{re.escape(release)}(\.post\d+)?"),
                          (f"torch-npu=={major_minor}.*", rf"{re.escape(major_minor)}\.[^-]+")):
        hits = _cached_wheels(directory, pattern)
        if not hits:
            errors.append(_pip_download(spec, directory))
            hits = _cached_wheels(directory, pattern)
        if hits:
            if spec.endswith("*"):
                logging.getLogger(__name__).warning("no torch_npu %s wheel; using %s", release,
                                                    os.path.basename(hits[-1]))
            return hits[-1]
    raise RuntimeError(f"cannot download torch_npu {release} (nor {major_minor}.*) into {directory}: "
                       f"{next((e for e in errors if e), 'no wheel')}")


def _unpack(wheel: str, package: str = "torchair") -> str:
    """Unpack ``package``'s ``scope/`` and ``ops/`` from ``wheel`` (once); returns the folder holding ``package/``."""
    root = os.path.join(os.path.dirname(wheel), os.path.basename(wheel)[:-len(".whl")] + "-" + package)
    if os.path.isdir(root):
        return root
    prefix = f"{_IN_WHEEL}{package}/"
    tmp = tempfile.mkdtemp(dir=os.path.dirname(wheel), prefix=".unpack-")
    try:
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                rel = name[len(prefix):] if name.startswith(prefix) else ""
                if not rel.endswith(".py") or rel.split("/")[0] not in _SUBPACKAGES:
                    continue
                dest = os.path.join(tmp, package, rel)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                with zf.open(name) as src, open(dest, "wb") as out:
                    out.write(src.read())
        missing = [p for p in _SUBPACKAGES if not os.path.exists(os.path.join(tmp, package, p, "__init__.py"))]
        if missing:
            raise RuntimeError(f"{wheel} has no {prefix}{{{','.join(missing)}}}/__init__.py")
        try:
            os.rename(tmp, root)  # atomic: another process either finished first or sees nothing
        except OSError:
            if not os.path.isdir(root):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


# ---- stand-ins for the native / GE modules the Python layer imports -------------------------------

class _Anything:
    """A GE graph type that is only used in converters, which never run on CPU."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs = args, kwargs

    def __getattr__(self, name: str) -> Any:
        return _Anything()


class _NpuEvent:
    """Stand-in for ``torch.npu.Event``: an identity, enough for torchair's tag <-> event map."""

    def record(self, stream: Any = None) -> None:
        raise NotImplementedError("a tagged event cannot be recorded on a CPU machine")

    wait = record


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def _stand_ins() -> Dict[str, types.ModuleType]:
    def register_fx_node_ge_converter(_op: Any) -> Callable[[Callable], Callable]:
        return lambda fn: fn

    ge_graph = _module("torchair.ge._ge_graph", compat_as_bytes=lambda s: s.encode() if isinstance(s, str) else s,
                       get_default_ge_graph=lambda: _Anything(), Tensor=_Anything, ControlTensor=_Anything,
                       TensorSpec=_Anything, DataType=_Anything, dont_prune_me=lambda *a, **k: None)
    logger = logging.getLogger("npugraph_ex")
    return {
        "npugraph_ex.core": _module("npugraph_ex.core", __path__=[]),
        "npugraph_ex.core.utils": _module("npugraph_ex.core.utils", logger=logger),
        "torchair.ge": _module("torchair.ge", _ge_graph=ge_graph, __path__=[]),
        "torchair.ge._ge_graph": ge_graph,
        "torchair.core": _module("torchair.core", __path__=[]),
        "torchair.core.utils": _module("torchair.core.utils", logger=logging.getLogger("torchair")),
        "torchair._ge_concrete_graph": _module("torchair._ge_concrete_graph", __path__=[]),
        "torchair._ge_concrete_graph.fx2ge_converter": _module(
            "torchair._ge_concrete_graph.fx2ge_converter", register_fx_node_ge_converter=register_fx_node_ge_converter),
        "torchair._ge_concrete_graph.ge_apis": _module("torchair._ge_concrete_graph.ge_apis", Identity=_Anything),
    }


@contextlib.contextmanager
def _temporary_torch_npu(module: bool = True) -> Iterator[None]:
    """``torch.npu.Event`` (and with ``module``, ``import torch_npu``) exist only inside the block.

    A real torch_npu, if one is installed, is left alone.
    """
    npu = _module("torch_npu.npu", Event=_NpuEvent)
    add_module = module and "torch_npu" not in sys.modules
    add_attr = not hasattr(torch, "npu")
    if add_module:
        sys.modules["torch_npu"] = _module("torch_npu", npu=npu)
    if add_attr:
        torch.npu = npu  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if add_attr:
            del torch.npu  # type: ignore[attr-defined]
        if add_module:
            sys.modules.pop("torch_npu", None)


def _loaded_modules() -> Dict[str, types.ModuleType]:
    return {n: m for n, m in sys.modules.items() if n in _PACKAGES or n.split(".")[0] in _PACKAGES}


def _import_layers(roots: Dict[str, str]) -> Dict[str, types.ModuleType]:
    """Import ``scope`` / ``ops`` of each package from its folder in ``roots``; returns every module made."""
    import importlib

    saved = _loaded_modules()
    for name in saved:
        del sys.modules[name]
    for package, root in roots.items():
        pkg_dir = os.path.join(root, package)
        sys.modules[package] = _module(package, __path__=[pkg_dir], __file__=os.path.join(pkg_dir, "__init__.py"),
                                       __doc__=f"{package}'s scope/ops layer from the torch_npu wheel, "
                                               f"native modules replaced")
    sys.modules.update(_stand_ins())
    try:
        with _temporary_torch_npu():
            for package in roots:
                for sub in _SUBPACKAGES:
                    setattr(sys.modules[package], sub, importlib.import_module(f"{package}.{sub}"))
            # imported lazily by the packages themselves; importing them now registers every op once
            for lazy in ("torchair.scope._wait_tensor", "torchair.ops._tagged_event", "npugraph_ex.ops._tagged_event"):
                importlib.import_module(lazy)
        return _loaded_modules()
    finally:  # the process sees no torchair / npugraph_ex outside `installed()`
        for name in _loaded_modules():
            del sys.modules[name]
        sys.modules.update(saved)


@contextlib.contextmanager
def installed() -> Iterator[types.ModuleType]:
    """``import torchair`` / ``import npugraph_ex`` give the loaded modules inside the block (and a
    stand-in ``torch.npu.Event``); yields ``torchair``.

    Outside it the process looks as before: no ``torchair``, ``npugraph_ex``, ``torch_npu`` or
    ``torch.npu``. The ``torch.ops.air`` / ``torch.ops.npugraph_ex`` operators stay registered (they
    cannot be unregistered and are inert).
    """
    mods = _load()
    saved = _loaded_modules()
    sys.modules.update(mods)
    try:
        with _temporary_torch_npu(module=False):
            yield mods["torchair"]
    finally:
        for name in _loaded_modules():
            del sys.modules[name]
        sys.modules.update(saved)


def _try_load() -> Optional[str]:
    """Load once per process; why it cannot be loaded (kept: no second download), or None."""
    if "modules" in _state:
        return None
    if "error" not in _state:
        try:
            wheel = find_wheel()
            _state["modules"] = _import_layers({p: _unpack(wheel, p) for p in _PACKAGES})
            return None
        except Exception as exc:  # no registry, no wheel for this torch, layout changed
            _state["error"] = f"torchair graph-contract tests need the torch_npu wheel: {exc}"
    return _state["error"]


def _load() -> Dict[str, types.ModuleType]:
    why = _try_load()
    if why is not None:
        pytest.skip(why)
    return _state["modules"]


def unavailable() -> Optional[str]:
    """Why torchair cannot be loaded here (no torch_npu wheel to be had), or None once it is loaded: for
    programs outside pytest, where `load_torchair` and `capture_graph` skip the calling test instead."""
    return _try_load()


def load_torchair() -> types.ModuleType:
    """torchair (``scope`` + ``ops`` of the matching torch_npu wheel, npugraph_ex's beside it); skips the
    calling test if unavailable.

    Loaded once per process; use `installed` (or `capture_graph`) to make it importable.
    """
    return _load()["torchair"]


# ---- capturing ------------------------------------------------------------------------------------

def _capturing_backend(graphs: List[torch.fx.GraphModule]) -> Callable:
    """A torch.compile backend that keeps the FX graph and runs it on fake tensors.

    The ``air`` ops have no CPU kernels that work (``wait_tensor`` raises there); on fake tensors
    their Meta kernels run instead, so the compiled call returns (fake) results without error.
    """
    def backend(gm: torch.fx.GraphModule, example_inputs: List[Any]) -> Callable:
        graphs.append(gm)

        def run(*args: Any) -> Any:
            from torch._subclasses.fake_tensor import FakeTensorMode

            with FakeTensorMode(allow_non_fake_inputs=True):
                return gm(*args)

        return run

    return backend


@contextlib.contextmanager
def schedule_checks() -> Iterator[List[bool]]:
    """Inside the block, each check of a schedule by the executor (`microbatch.validate`, the first thing a
    lowering does) appends whether Dynamo was tracing it: a compiled step's schedule is lowered before its trace
    (`microbatch.lower_ahead`), so every entry should be False."""
    import microbatch.lowering as lowering

    seen: List[bool] = []
    real = lowering.validate

    def validate(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.compiler.is_compiling())
        return real(*args, **kwargs)
    lowering.validate = validate
    try:
        yield seen
    finally:
        lowering.validate = real


@contextlib.contextmanager
def _sanitizer_set_aside() -> Iterator[None]:
    """The process-wide stream sanitizer (``OVERLAP_SANITIZE``), if one runs, sees nothing inside the block.

    It models eager streams; what Dynamo traces runs on fake tensors, and a graph path's edges are
    graph nodes (on ``ge`` the wait is the ``wait_tensor`` that reads the guarded tensor). A
    captured graph's ordering is checked by `unordered_reads` instead.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    from overlap import hooks
    from overlap.state import STATE

    sanitizer = STATE.sanitizer
    if sanitizer is None:
        yield
        return
    hooks.remove_observer(sanitizer)
    try:
        with _disable_current_modes():  # its dispatch mode (the only mode outside a capture)
            yield
    finally:
        hooks.add_observer(sanitizer)


def capture_graph(fn: Callable, *args: Any, path: str = "ge", **kwargs: Any) -> torch.fx.GraphModule:
    """The FX graph Dynamo captures for ``fn(*args, **kwargs)`` with the primitives lowered on ``path``.

    Compiles with ``torch.compile(fullgraph=True)``, so any graph break fails here. The overlap
    switch (`overlap.enabled`) is taken from the caller. Dynamo's caches are reset first because
    the path is read at trace time without a guard. A process-wide stream sanitizer is set aside
    while it traces (`_sanitizer_set_aside`).
    """
    import overlap

    graphs: List[torch.fx.GraphModule] = []
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=_capturing_backend(graphs))
    try:
        with installed(), overlap.use_path(path), _sanitizer_set_aside():
            compiled(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    if len(graphs) != 1:
        raise AssertionError(f"expected one captured graph, got {len(graphs)}")
    return graphs[0]


# ---- reading a captured graph ---------------------------------------------------------------------

_CALLS = ("call_function", "call_method")


_PATH_OF_NAMESPACE = {"air": "ge", "npugraph_ex": "aclgraph"}  # which lowering emits each namespace
GRAPH_PATHS = ("ge", "aclgraph")


def op_namespace(node: torch.fx.Node) -> Optional[str]:
    """``"air"`` or ``"npugraph_ex"`` when ``node`` calls one of those ops, else None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return None
    name = target.name() if isinstance(target, torch._ops.OpOverload) else target._qualified_op_name
    ns = name.partition("::")[0]
    return ns if ns in NAMESPACES else None


def path_of(gm: torch.fx.GraphModule) -> Optional[str]:
    """The path ``gm`` was captured on, from its nodes: ``"ge"`` (``air`` ops), ``"aclgraph"`` (``npugraph_ex``
    ops), or None (neither: a single-stream graph, the same on both). Both namespaces at once is an error."""
    held = sorted({ns for ns in map(op_namespace, gm.graph.nodes) if ns is not None})
    if len(held) > 1:
        raise ValueError(f"the graph holds both {' and '.join(held)} ops: not one captured on a single path")
    return _PATH_OF_NAMESPACE[held[0]] if held else None


def graph_path(gm: torch.fx.GraphModule, path: Optional[str] = None) -> str:
    """The ordering model for ``gm``: its own path (`path_of`), which ``path``, when given, must name.

    A mismatch is a ValueError, never an answer for the wrong model (a ``ge`` graph has no events,
    so the ``aclgraph`` model would find every cross-stream read unordered).
    """
    if path is not None and path not in GRAPH_PATHS:
        raise ValueError(f"no ordering model for path {path!r}: expected one of {GRAPH_PATHS}")
    held = path_of(gm)
    if path is not None and held is not None and held != path:
        ns = next(n for n, p in _PATH_OF_NAMESPACE.items() if p == held)
        raise ValueError(f"the graph was captured on the {held} path (it holds {ns} ops), not on {path}: "
                         f"pass path={held!r}, or no path to read it from the graph")
    return path or held or GRAPH_PATHS[0]  # no graph-mode op: one stream, which both models order alike


def air_op(node: torch.fx.Node) -> Optional[str]:
    """``"scope_enter"`` etc. when ``node`` calls a ``torch.ops.air`` or ``torch.ops.npugraph_ex`` op, else None.

    The two namespaces name their scope, event and record-stream ops alike; `op_namespace` tells them apart.
    """
    if op_namespace(node) is None:
        return None
    target = node.target
    name = target.name() if isinstance(target, torch._ops.OpOverload) else target._qualified_op_name
    return name.partition("::")[2].split(".")[0]


def scope_attrs(node: torch.fx.Node) -> Dict[str, str]:
    """The attributes an ``air.scope_enter`` node sets (keys and values are its first two arguments)."""
    keys, values = node.args[0], node.args[1]
    return dict(zip(keys, values))


def _label(node: torch.fx.Node) -> str:
    op = air_op(node)
    if op is None:
        return node.name
    if op == "scope_enter":
        return "scope_enter(" + ",".join(f"{k}={v}" for k, v in scope_attrs(node).items()) + ")"
    if op in ("tagged_event_record", "tagged_event_wait"):
        return f"{op}({node.args[0]})"
    if op.startswith("record_tagged_stream"):
        return f"record_tagged_stream({node.args[0].name},{node.args[1]})"
    if op == "wait_tensor":
        return f"wait_tensor({node.args[0].name},{node.args[1].name})"
    return op


def ops_in_order(gm: torch.fx.GraphModule, air_only: bool = False) -> List[str]:
    """The call nodes of ``gm`` in graph order (node names), ``air`` ops spelled out with their arguments."""
    return [_label(n) for n in gm.graph.nodes
            if n.op in _CALLS and (not air_only or air_op(n) is not None)]


def scope_of(gm: torch.fx.GraphModule) -> Dict[str, Dict[str, str]]:
    """For every call node but the scope markers, the merged attributes of the ``scope_enter`` blocks around it."""
    stack: List[Dict[str, str]] = []
    out: Dict[str, Dict[str, str]] = {}
    for n in gm.graph.nodes:
        op = air_op(n)
        if op == "scope_enter":
            stack.append(scope_attrs(n))
        elif op == "scope_exit":
            if not stack:
                raise AssertionError(f"unbalanced air.scope_exit at {n.name}")
            stack.pop()
        elif n.op in _CALLS:
            merged: Dict[str, str] = {}
            for attrs in stack:
                merged.update(attrs)
            out[n.name] = merged
    if stack:
        raise AssertionError(f"air.scope_enter without scope_exit: {stack}")
    return out


def nodes(gm: torch.fx.GraphModule, op: str, namespace: Optional[str] = None) -> List[torch.fx.Node]:
    """The nodes calling ``torch.ops.air.<op>`` or ``torch.ops.npugraph_ex.<op>`` (only ``namespace``'s if given)."""
    return [n for n in gm.graph.nodes if air_op(n) == op and namespace in (None, op_namespace(n))]


def strip_air(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` without ``air`` / ``npugraph_ex`` ops (``wait_tensor`` becomes its first input), runnable on CPU.

    Running it checks that the lowering kept the computation: it must equal the eager result.
    """
    graph = torch.fx.Graph()
    env: Dict[torch.fx.Node, Any] = {}
    for n in gm.graph.nodes:
        op = air_op(n)
        if op == "wait_tensor":
            env[n] = env[n.args[0]]
        elif op is None:
            env[n] = graph.node_copy(n, lambda a: env[a])
    return torch.fx.GraphModule(gm, graph)


def stream_of(gm: torch.fx.GraphModule, main: str = "default") -> Dict[str, str]:
    """For every call node but the scope markers, the ``_user_stream_label`` it runs under (``main`` outside any)."""
    return {name: attrs.get("_user_stream_label", main) for name, attrs in scope_of(gm).items()}


def node_by_target(gm: torch.fx.GraphModule, target: Any) -> List[torch.fx.Node]:
    """The call nodes whose target is ``target`` (``operator.mul``, ``torch.relu``, ``"sin"`` for a method), in order."""
    return [n for n in gm.graph.nodes if n.op in _CALLS and n.target == target]


# ---- the wheel itself, for tests that read it without importing anything from it -----------------

ENV_WHEEL = "OVERLAP_NPU_WHEEL"


def wheel_path(release: Optional[str] = None) -> str:
    """The torch_npu wheel to read: for the installed torch, ``$OVERLAP_NPU_WHEEL`` when set, else `find_wheel`'s;
    for another ``release`` (`CURRENT_RELEASE`), `find_wheel`'s of it.

    ``$OVERLAP_NPU_WHEEL`` names any wheel file (a new torch_npu release, before torch is upgraded
    to match it); a missing file is an error. Without it, when `find_wheel` cannot get a wheel, the
    calling test is skipped with the reason. The outcome is kept for the process (one download try).
    """
    explicit = os.environ.get(ENV_WHEEL)
    if explicit and release is None:
        if not os.path.isfile(explicit):
            raise FileNotFoundError(f"${ENV_WHEEL}={explicit}: no such wheel file")
        return explicit
    key, error = ("wheel", release), ("wheel_error", release)
    if key not in _state and error not in _state:
        try:
            _state[key] = find_wheel(release)
        except Exception as exc:  # no registry, no wheel for this torch or this machine
            _state[error] = f"the signature contract needs the torch_npu wheel: {exc}"
    if key in _state:
        return _state[key]
    pytest.skip(_state[error])


# ---- ordering: what runs after what in a captured graph ----------------------------------------------

def is_work(node: torch.fx.Node) -> bool:
    """A call that computes (an aten op, a collective, a method), not a scope / event / edge op."""
    return node.op in _CALLS and air_op(node) is None


def _written_in_place(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The tensor a work node writes in place (``out.copy_(x)``, ``out[i] = x``, ``aten.add_``), if any."""
    from overlap.backends.ge_reorder import written_in_place

    return written_in_place(node) if is_work(node) else None


def reads_of(gm: torch.fx.GraphModule) -> Dict[torch.fx.Node, List[torch.fx.Node]]:
    """Each node's inputs as it reads them: a tensor written in place before (in graph order) stands
    for the last call that wrote it, as the compiler sees it once the graph is functionalized."""
    last: Dict[torch.fx.Node, torch.fx.Node] = {}
    out: Dict[torch.fx.Node, List[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        out[n] = [last.get(p, p) for p in n.all_input_nodes]
        written = _written_in_place(n)
        if written is not None:
            last[written] = n
    return out


def _value(node: torch.fx.Node, reads: Dict[torch.fx.Node, List[torch.fx.Node]]) -> torch.fx.Node:
    """The value a node stands for: ``wait_tensor(x, dep)`` is ``x`` with an edge added."""
    while air_op(node) == "wait_tensor":
        node = reads[node][0]
    return node


class Order:
    """Happens-before between the work nodes of a captured graph, as its path executes it (``path``: read
    from the graph by default; a path the graph was not captured on is a ValueError, `graph_path`).

    ``ge``: GE runs a node after everything it reaches through its inputs (data edges, and
    ``wait_tensor(x, dep)`` whose result is consumed, a tensor written in place standing for its
    writer: `reads_of`); nothing else orders streams. ``aclgraph``:
    each stream runs its nodes in graph order; a tagged event wait on a stream orders it after what
    the stream of the tag's latest earlier record had run by then (vector clocks).
    """

    def __init__(self, gm: torch.fx.GraphModule, path: Optional[str] = None, main: str = "default"):
        path = graph_path(gm, path)
        self.path, self.streams = path, stream_of(gm, main)
        self._index = {n: i for i, n in enumerate(gm.graph.nodes)}
        self._ancestors: Dict[torch.fx.Node, int] = {}  # ge: bit set of the nodes each node reaches back to
        self._pos: Dict[torch.fx.Node, Tuple[str, int]] = {}  # aclgraph: (stream, sequence number there)
        self._seen: Dict[torch.fx.Node, Dict[str, int]] = {}  # aclgraph: its stream's clock when it runs
        self.reads = reads_of(gm)
        (self._data_edges if path == "ge" else self._clocks)(gm)

    def _data_edges(self, gm: torch.fx.GraphModule) -> None:
        for n in gm.graph.nodes:
            bits = 0
            for p in self.reads[n]:
                bits |= self._ancestors.get(p, 0) | (1 << self._index[p])
            self._ancestors[n] = bits

    def _clocks(self, gm: torch.fx.GraphModule) -> None:
        clocks: Dict[str, Dict[str, int]] = {}
        recorded: Dict[str, Dict[str, int]] = {}
        for n in gm.graph.nodes:
            op = air_op(n)
            if n.op not in _CALLS or op in ("scope_enter", "scope_exit"):
                continue
            stream = self.streams[n.name]
            clock = clocks.setdefault(stream, {})
            if op == "tagged_event_record":
                recorded[n.args[0]] = dict(clock)
            elif op == "tagged_event_wait":
                for s, seq in recorded.get(n.args[0], {}).items():
                    clock[s] = max(clock.get(s, 0), seq)
            elif op is None:
                clock[stream] = clock.get(stream, 0) + 1
                self._pos[n] = (stream, clock[stream])
                self._seen[n] = dict(clock)

    def before(self, producer: torch.fx.Node, reader: torch.fx.Node) -> bool:
        """Whether ``producer`` is done before ``reader`` starts."""
        if self.path == "ge":
            return bool(self._ancestors[reader] >> self._index[producer] & 1)
        stream, seq = self._pos[producer]
        return self._seen[reader].get(stream, 0) >= seq


def cross_stream_reads(gm: torch.fx.GraphModule, main: str = "default") -> List[Tuple[torch.fx.Node, torch.fx.Node]]:
    """Every ``(writer, reader)`` of work nodes where the reader's stream is not the writer's.

    The writer of a tensor written in place is the last call that wrote it (`reads_of`). Graph
    inputs are left out: they are written before the graph starts.
    """
    streams, reads = stream_of(gm, main), reads_of(gm)
    pairs = []
    for reader in gm.graph.nodes:
        if not is_work(reader):
            continue
        for inp in reads[reader]:
            writer = _value(inp, reads)
            if is_work(writer) and streams[writer.name] != streams[reader.name] and (writer, reader) not in pairs:
                pairs.append((writer, reader))
    return pairs


def unordered_reads(gm: torch.fx.GraphModule, path: Optional[str] = None, main: str = "default") -> List[str]:
    """The values read on another stream than their writer's with no ordering edge reaching the reader.

    Empty when every cross-stream read is ordered: on ``aclgraph`` by a record after the writer on
    its stream and a wait on that event on the reader's stream before the reader (or a chain of
    them), on ``ge`` by data dependence. Each entry names the writer, the reader and their streams.
    ``path`` is the graph's own by default (`graph_path`: another one is a ValueError).
    """
    order = Order(gm, path, main)
    streams = order.streams
    return [f"{w.name} ({streams[w.name]}) -> {r.name} ({streams[r.name]})"
            for w, r in cross_stream_reads(gm, main) if not order.before(w, r)]


def stream_regions(gm: torch.fx.GraphModule, label: str) -> List[List[torch.fx.Node]]:
    """The work nodes of each outermost scope of stream ``label``, in graph order (one per stream block)."""
    regions: List[List[torch.fx.Node]] = []
    depth, inside = 0, False
    for n in gm.graph.nodes:
        op = air_op(n)
        if op == "scope_enter":
            if depth == 0:
                inside = scope_attrs(n).get("_user_stream_label") == label
                if inside:
                    regions.append([])
            depth += 1
        elif op == "scope_exit":
            depth -= 1
            inside = inside and depth > 0
        elif inside and is_work(n):
            regions[-1].append(n)
    return regions


def discarded_waits(gm: torch.fx.GraphModule) -> List[str]:
    """``wait_tensor`` nodes whose result no computation consumes: GE prunes them, so they order nothing."""
    def consumed(n: torch.fx.Node) -> bool:
        return any(is_work(u) or u.op == "output" or (air_op(u) == "wait_tensor" and u.args[0] is n and consumed(u))
                   for u in n.users)

    return [f"wait_tensor({n.args[0].name},{n.args[1].name})" for n in nodes(gm, "wait_tensor") if not consumed(n)]


# ---- the contract a captured overlapped graph is checked against, as plain data -------------------------------

def all_to_alls(gm: torch.fx.GraphModule) -> List[torch.fx.Node]:
    """The ``all_to_all`` collectives of ``gm``, in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and "all_to_all" in str(n.target)]


def unordered_exchanges(gm: torch.fx.GraphModule, path: str, label: str = "ep_comm") -> List[Tuple[str, str]]:
    """Exchanges of consecutive ``label`` stream blocks not ordered as the schedule issues them (every rank must
    issue its collectives in one order)."""
    order = Order(gm, path)
    exchanges = set(all_to_alls(gm))
    blocks = [[n for n in block if n in exchanges] for block in stream_regions(gm, label)]
    blocks = [b for b in blocks if b]
    return [(a.name, b.name) for prev, nxt in zip(blocks, blocks[1:]) for a in prev for b in nxt
            if not order.before(a, b)]


def contract_summary(gm: torch.fx.GraphModule, path: str) -> Dict[str, Any]:
    """What the graph-mode contract tests check of ``gm`` captured on ``path``, as plain data (graphs do not
    travel between processes): unordered cross-stream reads and exchanges, the waits, the ``air`` ops in order,
    the scopes of the exchanges, the tagged events' records and waits with their streams."""
    at = {n: i for i, n in enumerate(gm.graph.nodes)}
    streams, scopes = stream_of(gm), scope_of(gm)
    records = nodes(gm, "tagged_event_record")
    pairs = []
    for wait in nodes(gm, "tagged_event_wait"):
        earlier = [r for r in records if r.args[0] == wait.args[0] and at[r] < at[wait]]
        pairs.append((wait.args[0], streams[earlier[-1].name] if earlier else None, streams[wait.name]))
    exchanges = all_to_alls(gm)
    return dict(
        unordered_reads=unordered_reads(gm, path),
        consumed_waits=len(nodes(gm, "wait_tensor")) - len(discarded_waits(gm)),
        unordered_exchanges=unordered_exchanges(gm, path),
        cross_stream_reads=len(cross_stream_reads(gm)),
        namespaces=sorted({op_namespace(n) for n in gm.graph.nodes} - {None}),
        air=ops_in_order(gm, air_only=True),
        a2a_scopes=[scopes[n.name] for n in exchanges],
        a2a_targets=sorted({str(n.target) for n in exchanges}),
        record_tags=[r.args[0] for r in records],
        record_streams=[streams[r.name] for r in records],
        event_pairs=pairs,
        wait_tensor_streams=[streams[n.name] for n in nodes(gm, "wait_tensor")],
        record_tagged_stream=len(nodes(gm, "record_tagged_stream_")),
    )
