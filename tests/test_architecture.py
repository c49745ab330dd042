"""The structure docs/architecture.md promises: one import chain, backends own the paths, no import side effects."""
import ast
import functools
import glob
import inspect
import os
import re
import subprocess
import sys

import pytest
import torch

import overlap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAIN = ("launch", "collectives", "microbatch", "overlap")  # each may import only those to its right
_PATH_COMPARE = re.compile(r"\b(path|current_path\(\))\s*(==|!=|\bin\b|\bnot in\b)\s*[(\"']")


def _imports(file):
    """Top-level package names a module imports (absolute imports; relative ones stay in their package)."""
    tree = ast.parse(open(file, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


def _modules(package):
    return sorted(glob.glob(os.path.join(ROOT, package, "**", "*.py"), recursive=True))


def _chain_violations(chain=CHAIN):
    bad = []
    for i, pkg in enumerate(chain):
        forbidden = set(chain[:i + 1]) - {pkg}
        for file in _modules(pkg):
            for name in set(_imports(file)) & forbidden:
                bad.append(f"{os.path.relpath(file, ROOT)} imports {name}")
    return bad


def test_packages_form_one_chain():
    assert _chain_violations() == []


def test_the_chain_check_can_fail():
    # microbatch imports overlap: with the order reversed that is a violation
    assert _chain_violations(("launch", "collectives", "overlap", "microbatch"))


def _imported_modules(file):
    """Full dotted names a module imports, relative imports resolved; ``from a import b`` also names ``a.b``."""
    rel = os.path.relpath(file, ROOT)[:-len(".py")].split(os.sep)
    package = rel[:-1]  # a module's package; for an __init__.py, the package itself
    tree = ast.parse(open(file, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def _launch_imports_outside(folder, *inside):
    """Imports of launch modules by ``folder``'s modules that are in none of ``inside`` (dotted packages)."""
    bad = []
    for file in _modules(folder):
        for name in set(_imported_modules(file)):
            if name.startswith("launch.") and not any(name == p or name.startswith(p + ".") for p in inside):
                bad.append(f"{os.path.relpath(file, ROOT)} imports {name}")
    return sorted(bad)


def _bench_importers(packages=CHAIN):
    """Modules of ``packages`` outside launch/bench that import a benchmark."""
    bench = os.path.join(ROOT, "launch", "bench")
    return sorted(f"{os.path.relpath(file, ROOT)} imports {name}" for pkg in packages for file in _modules(pkg)
                  if not file.startswith(bench + os.sep)
                  for name in set(_imported_modules(file)) if name.startswith("launch.bench"))


def test_models_and_benchmarks_keep_their_place():
    """launch/models imports nothing of the rest of launch; no production module imports a benchmark."""
    assert _launch_imports_outside(os.path.join("launch", "models"), "launch.models") == []
    assert _bench_importers() == []


def test_the_engine_is_a_library_below_the_launchers():
    """launch/engine (the runtime that prefills and decodes a model) imports nothing of launch but itself and the
    models: not the launchers' top floor (their options, configuration, job), their measurements (launch.measure)
    nor the benchmarks."""
    assert _launch_imports_outside(os.path.join("launch", "engine"), "launch.engine", "launch.models") == []


def test_the_place_checks_can_fail():
    # the benchmarks use the launcher's modules, the measurements run the engine, and the tests run the benchmarks
    assert _launch_imports_outside(os.path.join("launch", "bench"), "launch.bench")
    assert _launch_imports_outside(os.path.join("launch", "measure"), "launch.measure", "launch.models")
    assert _bench_importers(("tests",))


TOP_FLOOR = 10  # launch/'s own modules: the entry points and the job's life


def _top_floor(folder=os.path.join(ROOT, "launch")):
    """The modules at the top of ``folder`` (``__init__.py`` aside)."""
    return sorted(n for n in os.listdir(folder) if n.endswith(".py") and n != "__init__.py")


def test_launchs_top_floor_holds_the_entry_points_and_the_jobs_life():
    """The runtime is launch/engine, the measurements launch/measure, the models and benchmarks their folders: the
    top holds the entry points and the job's life, at most `TOP_FLOOR` modules."""
    assert "prefill.py" in _top_floor() and len(_top_floor()) <= TOP_FLOOR, _top_floor()


def test_the_top_floor_check_can_fail(tmp_path):
    for name in ["__init__.py"] + [f"m{i}.py" for i in range(TOP_FLOOR + 1)]:
        (tmp_path / name).write_text("")
    assert not len(_top_floor(str(tmp_path))) <= TOP_FLOOR


def _relative_targets(file):
    tree = ast.parse(open(file, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            yield (node.module or "").split(".")[0]


def test_primitives_do_not_import_the_jobs_built_on_them():
    """overlap's primitives import neither observability, offload nor the multi-rank harness."""
    jobs = {"observability", "offload", "multirank"}
    primitives = [f for f in glob.glob(os.path.join(ROOT, "overlap", "*.py"))
                  if os.path.basename(f) not in ("__init__.py", "multirank.py", "_torchrun.py")]
    primitives += glob.glob(os.path.join(ROOT, "overlap", "backends", "*.py"))
    bad = [f"{os.path.relpath(f, ROOT)} imports .{t}" for f in primitives for t in _relative_targets(f) if t in jobs]
    assert primitives and bad == []


def test_only_backends_compare_execution_paths():
    hits = []
    for pkg in CHAIN:
        for file in _modules(pkg):
            rel = os.path.relpath(file, ROOT)
            if rel.startswith(os.path.join("overlap", "backends")) or rel == os.path.join("overlap", "context.py"):
                continue
            for n, line in enumerate(open(file, encoding="utf-8"), 1):
                if _PATH_COMPARE.search(line):
                    hits.append(f"{rel}:{n}: {line.strip()}")
    assert hits == []
    assert _PATH_COMPARE.search('if path == "ge":') and _PATH_COMPARE.search("elif path in ('npu', 'ge'):")


def test_every_path_has_a_backend_with_the_interface():
    from overlap.backends.base import Backend

    for path in overlap.PATHS:
        b = overlap.backends.get(path)
        assert isinstance(b, Backend) and b.name == path
    assert [p for p in overlap.PATHS if overlap.backends.get(p).is_graph] == ["ge", "aclgraph"]
    assert [p for p in overlap.PATHS if overlap.backends.get(p).data_edges_order_streams] == ["ge"]


def test_import_has_no_side_effect():
    code = ("import overlap, collectives, microbatch, launch.engine, launch.measure\n"
            "from overlap.state import STATE\n"
            "assert not STATE.observers and STATE.sanitizer is None, STATE.observers\n")
    env = dict(os.environ, OVERLAP_SANITIZE="raise", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_reset_forgets_the_process_state():
    overlap.set_core_budget(overlap.CoreBudget(24, 48))
    overlap.set_link(overlap.Link(1.0))
    overlap.set_path("cpu")
    overlap.set_enabled(False)
    with overlap.enabled(True), overlap.limit_cores(16, 32), overlap.stream("side"), overlap.limit_cores(8, 16):
        overlap.event("reset.me").record(torch.ones(1))
    assert overlap.stream_limits() and overlap.current_link() is not None
    overlap.reset()
    from overlap.state import STATE

    assert (STATE.events, STATE.cpu_streams, STATE.core_limits) == ({}, {}, {})
    assert STATE.core_budget is None and overlap.current_link() is None and STATE.pools == {}
    assert overlap.is_enabled() and overlap.current_stream_tag() == overlap.DEFAULT


@pytest.mark.parametrize("name", ["serial", "shared", "two-batch"])
def test_one_mode_vocabulary(name):
    import microbatch

    ops = [[microbatch.Operation("f", lambda x: x, ("hidden",), ("out",))]]
    assert microbatch.schedule_for(name, ops, microbatch.MODES[name].micro_batches).name == name


# --- no import cycle inside a package ------------------------------------------------------------------------
# The graph of modules: an edge from a module to every module it imports, anywhere in it (inside functions too:
# a lazy import is a dependency all the same, and the cycles that come back hide there), and to every package
# such an import loads on the way (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``), except the
# importer's own packages (loaded before it, always). Imports under ``if TYPE_CHECKING:`` never run: left out.

def _module_name(file, root):
    parts = os.path.relpath(file, root)[:-len(".py")].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(packages=CHAIN, root=ROOT):
    """``{module: modules it imports}`` over the modules of ``packages`` under ``root`` (see above)."""
    files = {_module_name(f, root): f for pkg in packages
             for f in glob.glob(os.path.join(root, pkg, "**", "*.py"), recursive=True)}
    graph = {}
    for name, file in files.items():
        package = name if file.endswith("__init__.py") else name.rpartition(".")[0]
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        targets = set()

        def visit(node):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue
                if isinstance(child, ast.Import):
                    targets.update(a.name for a in child.names)
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        up = package.split(".")[:len(package.split(".")) - child.level + 1]
                        base = ".".join(up + ([child.module] if child.module else []))
                    targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in child.names)
                visit(child)

        visit(ast.parse(open(file, encoding="utf-8").read()))
        graph[name] = {prefix for t in targets for prefix in
                       (".".join(t.split(".")[:i]) for i in range(1, t.count(".") + 2))
                       if prefix in files and prefix not in own and prefix != name}
    return graph


def _cycles(graph):
    """The import cycles of ``graph``: each strongly connected set of two or more modules, sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def test_no_import_cycle_inside_a_package():
    """docs/architecture.md: within a package, modules import one another in one direction only, so that no
    import order matters (the chain test above rules out cycles between packages)."""
    graph = _import_graph()
    assert "microbatch.forward" in graph and "microbatch.split" in graph["microbatch.forward"]
    assert _cycles(graph) == []


def test_the_cycle_check_can_fail(tmp_path):
    """The two cycles the toolkit had: imports inside functions both ways (the harness and its torchrun half),
    and a package __init__ loaded on the way (the forward importing a module of planning, whose __init__ loads
    the calibration, which imports the forward); an import under TYPE_CHECKING is no cycle."""
    files = {
        "pkg/__init__.py": "from . import forward, planning\n",
        "pkg/harness.py": "def run():\n    from . import _torchrun\n",
        "pkg/_torchrun.py": "def timeout():\n    from .harness import run\n",
        "pkg/forward.py": "from .planning.split import Split\n",
        "pkg/planning/__init__.py": "from .split import Split\nfrom .calibration import calibrate\n",
        "pkg/planning/split.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..forward import x\n",
        "pkg/planning/calibration.py": "from ..forward import run\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert _cycles(_import_graph(("pkg",), str(tmp_path))) == [
        ["pkg._torchrun", "pkg.harness"],
        ["pkg.forward", "pkg.planning", "pkg.planning.calibration"]]


# --- no module reaches into another module's private names ------------------------------------------------------
def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_module_privates():
    """What torch's own ``nn.Module`` keeps under private names (``_modules``, ``_parameters``, ...): torch's, which a
    module walking a model's tree may read; not the toolkit's."""
    m = torch.nn.Linear(1, 1)
    return {n for n in list(dir(m)) + list(vars(m)) if _private(n)}


def _private_reaches(packages=CHAIN, root=ROOT):
    """Every place where a module of ``packages`` imports another module's private name (``from .x import _y``; a
    package's private module, ``from . import _buffers``, is its own) or reads a private member of an object that
    another module defines (``layer._compose`` where ``_compose`` is defined in another module and not in this one;
    ``self`` / ``cls`` / ``super()`` are the object's own)."""
    trees, defined = {}, {}
    for pkg in packages:
        for file in sorted(glob.glob(os.path.join(root, pkg, "**", "*.py"), recursive=True)):
            name = _module_name(file, root)
            tree = ast.parse(open(file, encoding="utf-8").read())
            trees[name] = (file, tree)
            own = set()
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                    own.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                        own.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name) and _private(n.id))
                        own.update(n.attr for n in ast.walk(target)
                                   if isinstance(n, ast.Attribute) and _private(n.attr))
            defined[name] = own
    owners = {}
    for name, own in defined.items():
        for n in own:
            owners.setdefault(n, set()).add(name)
    torch_own = _torch_module_privates()
    found = []
    for name, (file, tree) in trees.items():
        where = os.path.relpath(file, root)
        package = name if file.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = (".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [node.module or ""])
                        .strip(".") if node.level else node.module or "")
                if base.split(".")[0] not in packages:
                    continue
                for alias in node.names:
                    module = f"{base}.{alias.name}"
                    if _private(alias.name) and not (module in trees and base == package):
                        found.append(f"{where}:{node.lineno}: from {base} import {alias.name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in defined[name]:
                value = node.value
                if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                    continue
                if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "super":
                    continue
                if node.attr in owners and node.attr not in torch_own:
                    found.append(f"{where}:{node.lineno}: .{node.attr} of {', '.join(sorted(owners[node.attr]))}")
    return sorted(found)


def test_no_module_reaches_into_another_modules_private_names():
    """docs/architecture.md: a module uses another module's public names only, in production code: no private name
    imported, no private member of another module's object read or called (as the static decode step once called
    nine of the EP layer's)."""
    assert _private_reaches() == []


def test_the_private_name_check_can_fail(tmp_path):
    files = {
        "pkg/__init__.py": "from . import _helpers, layer\n",
        "pkg/_helpers.py": "def shared():\n    pass\n\n\ndef _inner():\n    pass\n",
        "pkg/layer.py": ("class Layer:\n    def _compose(self):\n        return self._gate()\n\n"
                         "    def _gate(self):\n        self._checked = True\n"),
        "pkg/step.py": ("import torch\nfrom ._helpers import _inner, shared\nfrom .layer import Layer\n\n\n"
                        "def stages(layer: Layer, module: torch.nn.Module):\n"
                        "    children = module._modules  # torch's own\n"
                        "    torch._grouped_mm  # not the toolkit's\n"
                        "    return layer._compose(), layer._checked, children\n"),
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert _private_reaches(("pkg",), str(tmp_path)) == [
        "pkg/step.py:2: from pkg._helpers import _inner", "pkg/step.py:9: ._checked of pkg.layer",
        "pkg/step.py:9: ._compose of pkg.layer"]


# --- one exchange interface, one EP layer -----------------------------------------------------------------------
def _classes(package, root=ROOT):
    """``(module, class name, base names)`` of every top-level class of ``package``'s modules under ``root``."""
    found = []
    for file in sorted(glob.glob(os.path.join(root, package, "**", "*.py"), recursive=True)):
        for node in ast.parse(open(file, encoding="utf-8").read()).body:
            if isinstance(node, ast.ClassDef):
                bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases]
                found.append((_module_name(file, root), node.name, bases))
    return found


def _exchange_families(root=ROOT):
    """Every class of collectives whose name says it is an exchange (``*Exchange``), the Protocol aside."""
    return [(m, name) for m, name, _ in _classes("collectives", root) if name.endswith("Exchange") and name != "Exchange"]


def _layer_subclasses(root=ROOT):
    """Classes of the toolkit that subclass the EP layer: an exchange is a class of its own, never a layer's."""
    return [f"{m}.{name}" for pkg in CHAIN for m, name, bases in _classes(pkg, root) if "ExpertParallelMoE" in bases]


def _class_protocol_problems(cls, proto):
    """Why instances of ``cls`` cannot be ``proto`` (each member there, each method taking the Protocol's calls)."""
    from support.protocols import protocol_members, signature_problems

    problems = []
    for member, kind in protocol_members(proto).items():
        what = f"{cls.__name__}.{member}"
        value = inspect.getattr_static(cls, member, None)
        if value is None and member not in getattr(cls, "__annotations__", {}):
            problems.append(f"{what}: missing")
        elif kind == "method":
            problems += signature_problems(functools.partial(value, None), getattr(proto, member), what) \
                if callable(value) else [f"{what}: not a method"]
        elif callable(value) and not isinstance(value, property):
            problems.append(f"{what}: a method, but {proto.__name__} has this data")
    return problems


def test_every_exchange_family_is_one_class_of_the_exchange_protocol():
    """docs/architecture.md: the EP layer holds a prefill and a decode exchange; each family (all-to-all, capacity,
    MC2, and any new one named ``*Exchange``) is one class implementing `collectives.Exchange` member by member, and
    no class subclasses the layer."""
    import importlib

    from collectives import Exchange

    families = _exchange_families()
    assert {name for _, name in families} >= {"AllToAllExchange", "CapacityExchange", "MC2Exchange"}
    problems = [p for m, name in families for p in _class_protocol_problems(getattr(importlib.import_module(m), name),
                                                                            Exchange)]
    assert problems == []
    assert _layer_subclasses() == []


def test_the_exchange_checks_can_fail(tmp_path):
    from collectives import AllToAllExchange, Exchange

    class HalfExchange:  # a family that forgot its combine and reads its layer's name by a method
        def name(self):
            return "half"

        two_step, prepare, dispatch = AllToAllExchange.two_step, AllToAllExchange.prepare, AllToAllExchange.dispatch

        def run_experts(self, handle):
            return handle

    assert _class_protocol_problems(HalfExchange, Exchange) == [
        "HalfExchange.name: a method, but Exchange has this data",
        "HalfExchange.run_experts: takes no positional parameter 2 (experts)", "HalfExchange.combine: missing"]
    (tmp_path / "collectives").mkdir()
    (tmp_path / "collectives" / "quantized.py").write_text(
        "from .layer import ExpertParallelMoE\n\n\nclass Int8Exchange:\n    pass\n\n\n"
        "class Int8ExpertParallelMoE(ExpertParallelMoE):\n    pass\n")
    assert _exchange_families(str(tmp_path)) == [("collectives.quantized", "Int8Exchange")]
    assert _layer_subclasses(str(tmp_path)) == ["collectives.quantized.Int8ExpertParallelMoE"]


def _harness_importers(packages=CHAIN):
    """Modules of ``packages`` that import the multi-rank test harness (`overlap.multirank`), the benchmarks
    (launch/bench) and the harness itself left out: docs/architecture.md's rule."""
    bench = os.path.join(ROOT, "launch", "bench") + os.sep
    harness = os.path.join(ROOT, "overlap", "multirank.py")
    return sorted(f"{os.path.relpath(file, ROOT)} imports {name}" for pkg in packages for file in _modules(pkg)
                  if not file.startswith(bench) and file != harness
                  for name in set(_imported_modules(file)) if name == "overlap.multirank")


def test_production_code_imports_no_test_harness():
    """Only the benchmarks use the multi-rank harness; the launcher (and the harness's torchrun half) take what
    they share with it from `overlap.ranks`."""
    assert _harness_importers() == []


def test_the_harness_check_can_fail():
    assert _harness_importers(("tests",))  # the tests run on the harness


# --- no Any in a public signature where a type exists ----------------------------------------------------------
ANY_CHECKED = ("launch/prefill.py", "launch/engine/prefiller.py", "launch/measure/prefill.py", "launch/config/job.py",
               "launch/config/decode.py", "launch/config/modes.py", "launch/config/environment.py",
               "launch/config/model.py", "launch/outputs.py", "launch/memory.py", "launch/health.py",
               "microbatch/planning/cache.py",
               "microbatch/planning/prefill/calibration.py", "microbatch/planning/prefill/fit.py",
               "microbatch/planning/prefill/measure.py", "microbatch/planning/prefill/choice.py",
               "microbatch/planning/split.py", "microbatch/planning/probes.py",
               "microbatch/forward.py", "microbatch/model.py", "microbatch/split.py")
# What is left, each where a value really is anything: JSON (a calibration's key and cache file, the job's model
# fields), click's other options (prefill.cli), and the keyword arguments decide_split forwards to propose_split.
MAX_ANY = 11


def _any_in_annotation(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
        try:
            node = ast.parse(node.value, mode="eval")
        except SyntaxError:
            return 0
    return sum(1 for n in ast.walk(node) if (isinstance(n, ast.Name) and n.id == "Any")
               or (isinstance(n, ast.Attribute) and n.attr == "Any"))


def _signature_anys(func, where):
    a = func.args
    params = a.posonlyargs + a.args + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p is not None]
    parts = [(p.arg, p.annotation) for p in params if p.annotation is not None]
    parts += [("return", func.returns)] if func.returns is not None else []
    return [f"{where}: {name}" for name, ann in parts for _ in range(_any_in_annotation(ann))]


def _public_anys(source, module):
    """Each ``Any`` in a public signature of ``source``: the parameters and return of its public functions, of
    the public methods (and ``__init__``) of its public classes, and those classes' annotated fields (a
    dataclass's constructor)."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            found += _signature_anys(node, f"{module}::{node.name}")
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                where = f"{module}::{node.name}"
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                        not item.name.startswith("_") or item.name == "__init__"):
                    found += _signature_anys(item, f"{where}.{item.name}")
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                        and not item.target.id.startswith("_"):
                    found += [f"{where}.{item.target.id}"] * _any_in_annotation(item.annotation)
    return found


def _anys_in_public_signatures(files=ANY_CHECKED):
    return [hit for f in files for hit in _public_anys(open(os.path.join(ROOT, f), encoding="utf-8").read(), f)]


def test_no_any_creeps_back_into_public_signatures():
    """Where a Protocol or a concrete type exists (`MoEModel`, `dist.ProcessGroup`, `Split`, `Choice`,
    `JobConfig`, `OffloadCache`, ...), a public signature names it; private helpers may keep ``Any``."""
    found = _anys_in_public_signatures()
    assert len(found) <= MAX_ANY, "Any in public signatures:\n" + "\n".join(found)


def test_the_any_count_can_fail():
    source = ("from typing import Any, Dict\n"
              "import typing\n"
              "def public(x: Any, *a: int, y: 'Dict[str, Any]' = None, **kw: Any) -> typing.Any: ...\n"
              "def _private(x: Any) -> Any: ...\n"
              "class Job:\n"
              "    model: Any\n"
              "    _cache: Any\n"
              "    def __init__(self, model: Any) -> None: ...\n"
              "    def run(self) -> Dict[str, Any]: ...\n"
              "    def _step(self, x: Any) -> None: ...\n"
              "class _Private:\n"
              "    def run(self, x: Any) -> None: ...\n")
    assert _public_anys(source, "m.py") == ["m.py::public: x", "m.py::public: y", "m.py::public: kw",
                                            "m.py::public: return", "m.py::Job.model", "m.py::Job.__init__: model",
                                            "m.py::Job.run: return"]


# --- agreement between ranks: one helper, overlap/agreement.py ----------------------------------------------------

_AGREEMENT_HELPER = os.path.join("overlap", "agreement.py")
_AGREE_NAME = re.compile(r"(^|_)agree(d|ment)?(_|$)")  # agree, _agree_once, agree_split, check_agreement, ...
# The places' public entry points, each built on the helper (their module must call it).
_AGREEMENT_ENTRY_POINTS = {
    os.path.join("launch", "agreement.py"): {"agree", "agree_ready"},  # the job, through torchrun's store
    os.path.join("microbatch", "planning", "prefill", "measure.py"): {"agree"},  # the structure, then the maximum
    os.path.join("microbatch", "planning", "split.py"): {"agree_split"},  # the votes, then the common count
}
# Left as it was while another change reworks its file: the calibration cache's check (to move onto the helper).
_KNOWN_HAND_ROLLED = {(os.path.join("microbatch", "planning", "prefill", "measure.py"), "_everyone_has")}
_REDUCERS = {"all_reduce", "max_over_ranks", "_all_max", "all_gather", "all_gather_into_tensor"}


def _callee(call):
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _hand_rolled(func):
    """Whether ``func`` makes ranks agree with an all-reduce of its own: the min / max trick (``[v, -v]``,
    ``spread(fields)``) or each rank's own slot of a tensor (``t[get_rank()] = v``) reduced."""
    reductions = [n for n in ast.walk(func) if isinstance(n, ast.Call) and _callee(n) in _REDUCERS]
    for call in reductions:
        for arg in list(call.args) + [k.value for k in call.keywords]:
            for n in ast.walk(arg):
                if isinstance(n, (ast.List, ast.Tuple)) and any(
                        isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub) for e in n.elts):
                    return True
                if isinstance(n, ast.Call) and _callee(n) == "spread":
                    return True
    own_slot = any(isinstance(t, ast.Subscript) and any(isinstance(c, ast.Call) and _callee(c) == "get_rank"
                                                        for c in ast.walk(t.slice))
                   for n in ast.walk(func) if isinstance(n, ast.Assign) for t in n.targets)
    return bool(reductions) and own_slot


def _calls_the_helper(tree):
    """Whether a module calls `overlap.agree` or `compare_posts` (``overlap.agree``, ``agreement.agree``, ``agree``)."""
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module == "overlap.agreement":
            names |= {a.asname or a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module == "overlap":
            names |= {a.asname or a.name for a in n.names if a.name in ("agreement", "agree", "compare_posts")}
        elif isinstance(n, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names if a.name.startswith("overlap")}
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        if isinstance(f, ast.Name) and f.id in names and f.id in ("agree", "compare_posts"):
            return True
        if isinstance(f, ast.Attribute) and f.attr in ("agree", "compare_posts"):
            base = f.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in names:
                return True
    return False


def _agreement_problems(source, rel):
    """Agreement in module ``rel`` that is not the helper's: a function named for it outside the places' entry
    points, a hand-rolled all-reduce of fields, or an entry point whose module never calls the helper."""
    tree = ast.parse(source)
    allowed = _AGREEMENT_ENTRY_POINTS.get(rel, set())
    out = []
    for f in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        if _AGREE_NAME.search(f.name) and f.name not in allowed:
            out.append(f"{rel}: def {f.name}: agreement outside {_AGREEMENT_HELPER}")
        if _hand_rolled(f) and (rel, f.name) not in _KNOWN_HAND_ROLLED:
            out.append(f"{rel}: {f.name}: a hand-rolled all-reduce of fields (use overlap.agree)")
    if allowed and not _calls_the_helper(tree):
        out.append(f"{rel}: {', '.join(sorted(allowed))} without overlap.agree")
    return out


def test_ranks_agree_through_one_helper():
    """Every place where ranks must agree uses `overlap.agree` (or `compare_posts` on an exchange of its own)."""
    bad = []
    for pkg in CHAIN:
        for file in _modules(pkg):
            rel = os.path.relpath(file, ROOT)
            if rel != _AGREEMENT_HELPER:
                bad += _agreement_problems(open(file, encoding="utf-8").read(), rel)
    assert bad == []


def test_the_agreement_check_can_fail():
    here = os.path.join("collectives", "m.py")
    assert _agreement_problems("def agree_on_dtype(x):\n    pass\n", here) == [
        f"{here}: def agree_on_dtype: agreement outside {_AGREEMENT_HELPER}"]
    assert _agreement_problems("class L:\n    def _agree_once(self):\n        pass\n", here)
    assert _agreement_problems("def check_agreement(fields):\n    pass\n", here)
    min_max = "def same(n, group):\n    hi, lo = max_over_ranks([n, -n], group)\n    return hi == -lo\n"
    assert _agreement_problems(min_max, here) == [
        f"{here}: same: a hand-rolled all-reduce of fields (use overlap.agree)"]
    assert _agreement_problems("def same(f, g):\n    return _all_max(spread(f) + [0], g, 'a', 'b')\n", here)
    own_slot = ("def votes(mine, group):\n    t = torch.zeros(4)\n    t[dist.get_rank(group)] = mine\n"
                "    overlap.all_reduce(t, group=group)\n    return t.tolist()\n")
    assert _agreement_problems(own_slot, here)
    split = os.path.join("microbatch", "planning", "split.py")
    assert _agreement_problems("def agree_split(plan):\n    return plan\n", split) == [
        f"{split}: agree_split without overlap.agree"]
    # a reduction is not an agreement, and an entry point on the helper passes
    assert _agreement_problems("def worst(x, group):\n    return max_over_ranks([x, 0.0], group)[0]\n", here) == []
    assert _agreement_problems("import overlap\ndef agree_split(p, g):\n    return overlap.agree({}, g)\n", split) == []


# --- tests/: test files, conftest, data, and two packages; no test file imports another ----------------------------

TESTS = os.path.join(ROOT, "tests")
TEST_FOLDERS = ("data", "support", "tools")  # recorded data; shared fakes and helpers; tools that are not tests
_PACKAGES_IN_TESTS = ("support", "tools")
_IMPORT_CALLS = {"import_module", "importorskip", "__import__"}  # each with a module name as a literal
# the text of a script a test writes (``probe.write_text("from test_x import f")``), or any other string
_TEST_IMPORT_TEXT = re.compile(r"\b(?:from\s+(?:[\w.]+\.)?test_\w*\s+import|import\s+(?:[\w.]+\.)?test_\w*)")


def _is_test_module(name):
    return any(part.startswith("test_") for part in name.split("."))


def _test_file_imports(folder=TESTS):
    """Each import of a test file (a ``test_*`` module) by a module under ``folder``: import statements (inside
    functions too), ``importlib.import_module`` / ``pytest.importorskip`` / ``__import__`` of a literal name,
    and string literals holding one (the scripts tests write and run)."""
    bad = []
    for file in sorted(glob.glob(os.path.join(folder, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(file, folder)
        for node in ast.walk(ast.parse(open(file, encoding="utf-8").read())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module or ''}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Call) and _callee(node) in _IMPORT_CALLS and node.args \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                bad += [f"{rel}:{node.lineno}: a string holds {m.group(0)!r}"
                        for m in _TEST_IMPORT_TEXT.finditer(node.value)]
            tests = [name for name in names if _is_test_module(name)]
            bad += [f"{rel}:{node.lineno}: imports {tests[0]}"] if tests else []  # one line per import
    return bad


def test_no_test_file_imports_another():
    """What test files share lives in tests/support/ (or tests/tools/), which import no test file either."""
    assert _test_file_imports() == []


def test_the_test_import_check_can_fail(tmp_path):
    imported = "test_grouping"  # spelled apart here, so that this file's own strings hold no such import
    files = {
        "test_a.py": f"from {imported} import fake_npu\n",
        "test_b.py": f"def helper():\n    import {imported} as g\n",
        "test_c.py": f"import pytest\ng = pytest.importorskip({imported!r})\n",
        "test_d.py": f"SCRIPT = 'import sys\\nfrom {imported} import fake_npu\\n'\n",
        "support/fakes.py": f"from tests.{imported} import fake_npu\n",
        "test_fine.py": "from support.fake_npu import fake_npu\nfrom tools import npu_schema\n"
                        "TEXT = 'no test file imports another; run_test_suite'\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert _test_file_imports(str(tmp_path)) == [
        f"support{os.sep}fakes.py:1: imports tests.{imported}",
        f"test_a.py:1: imports {imported}",
        f"test_b.py:2: imports {imported}",
        f"test_c.py:2: imports {imported}",
        f"test_d.py:1: a string holds 'from {imported} import'",
    ]


def _layout_problems(folder=TESTS):
    """What the top of ``folder`` (tests/) holds besides test files (``test_*.py``), ``conftest.py`` and the
    folders of `TEST_FOLDERS` (Python's and pytest's caches aside), and a package there without ``__init__.py``."""
    bad = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            if name not in TEST_FOLDERS + ("__pycache__", ".pytest_cache"):
                bad.append(f"{name}/: not one of {', '.join(TEST_FOLDERS)}")
            elif name in _PACKAGES_IN_TESTS and not os.path.isfile(os.path.join(path, "__init__.py")):
                bad.append(f"{name}/: a package without __init__.py")
        elif name != "conftest.py" and not (name.startswith("test_") and name.endswith(".py")):
            bad.append(f"{name}: neither a test file nor conftest.py")
    return bad


def test_tests_holds_only_tests_conftest_and_its_folders():
    """Fakes, helpers and tools go to tests/support/ or tests/tools/, never beside the test files."""
    assert _layout_problems() == []


def test_the_layout_check_can_fail(tmp_path):
    for name in ("test_ok.py", "conftest.py", "_ports.py", "npu_schema.py", "data/trace.json", "support/x.py",
                 "tools/__init__.py", "helpers/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert _layout_problems(str(tmp_path)) == [
        "_ports.py: neither a test file nor conftest.py",
        "helpers/: not one of data, support, tools",
        "npu_schema.py: neither a test file nor conftest.py",
        "support/: a package without __init__.py",
    ]
