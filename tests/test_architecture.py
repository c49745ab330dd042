"""The structure docs/architecture.md promises: one import chain, backends own the paths, no import side effects."""
import ast
import glob
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


def _launch_imports_outside(folder, inside):
    """Imports of launch modules by ``folder``'s modules that are not ``inside`` (a dotted package)."""
    bad = []
    for file in _modules(folder):
        for name in set(_imported_modules(file)):
            if name.startswith("launch.") and not (name == inside or name.startswith(inside + ".")):
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


def test_the_place_checks_can_fail():
    # the benchmarks use the launcher's modules, and the tests run the benchmarks
    assert _launch_imports_outside(os.path.join("launch", "bench"), "launch.bench")
    assert _bench_importers(("tests",))


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
    code = ("import overlap, collectives, microbatch, launch.runner\n"
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
