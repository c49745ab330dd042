"""Every torch_npu / torchair call of the toolkit matches the torch_npu wheel for the installed torch, and the newest
release's (`torchair_contract.CURRENT_RELEASE`).

The toolkit's sources (overlap/, collectives/, microbatch/, launch/) are parsed with ``ast`` and
every call that reaches ``torch_npu``, ``torch.npu``, ``torch.ops.{npu,air,npugraph_ex}``,
``torchair`` or ``npugraph_ex`` is found, through aliases; each is checked against the wheel's schemas: the native
operators' yaml and ``Library.define`` schemas, the Python APIs' signatures (see tests/tools/npu_schema.py
for what is resolved and how). A renamed operator, argument or method in a new torch_npu release
fails here, not on an NPU node.

The wheel is the one tests/tools/torchair_contract.py fetches for the installed torch (``$OVERLAP_NPU_WHEEL``
names another); without one the wheel check skips with the reason, while the discovery checks
and the self-tests (on a small synthetic wheel) still run.
"""
import os
import textwrap
import zipfile

import pytest

from tools import npu_schema as ns
from tools import torchair_contract as tc
from tools.npu_allow import ALLOW

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def found():
    return ns.discover(ns.toolkit_sources(ROOT), ALLOW)


@pytest.fixture(scope="module")
def wheel():
    w = ns.Wheel(tc.wheel_path())
    yield w
    w.close()


# ---- the toolkit -----------------------------------------------------------------------------------

def test_every_npu_call_is_resolved(found):
    """No call can reach torch_npu / torchair in a way the check cannot follow (or it is in ALLOW)."""
    assert not found.unresolved, "calls that cannot be resolved statically (resolve them, or add the site " \
                                 "to ALLOW with the paths it stands for):\n" + "\n".join(map(str, found.unresolved))


def test_allowlist_is_current(found):
    stale = [k for k in ALLOW if k not in found.allow_used]
    assert not stale, f"ALLOW entries that match no site any more: {stale}"


def test_discovery_sees_every_kind_of_call(found):
    """A guard on the discovery itself: each way the toolkit reaches torch_npu / torchair is found."""
    paths = sorted({c.path for c in found.calls})
    for kind in ("torch_npu.npu_", "torch.npu.", "torch.npu.current_stream().", "torch.npu.Event().", "torch.ops.",
                 "torchair.scope.", "torchair.get_npu_backend"):
        assert any(p.startswith(kind) for p in paths), f"no call of {kind}* found; found: {paths}"


@pytest.fixture(scope="module", params=["installed", tc.CURRENT_RELEASE])
def each_wheel(request):
    """The installed torch's wheel (the `wheel` fixture's), then the newest release's."""
    w = ns.Wheel(tc.wheel_path(None if request.param == "installed" else request.param))
    yield w
    w.close()


def test_every_npu_call_matches_the_wheel(found, each_wheel):
    wheel = each_wheel
    verdicts = ns.check_all(wheel, found)
    print(f"{os.path.basename(wheel.path)}: {len(found.calls)} calls, {len(found.references)} imports / references")
    print(ns.format_verdicts(verdicts))
    bad = [v for v in verdicts if v.status in ("error", "unknown")]
    assert not bad, f"calls that do not match {os.path.basename(wheel.path)} (\"unknown\": the wheel's Python " \
                    f"sources cannot tell, e.g. a member of a native base class):\n" + ns.format_verdicts(bad)


# ---- self-tests: the check reports what it must ---------------------------------------------------

MINI_WHEEL = {
    "torch_npu/__init__.py": "",
    "torch_npu/_C.cpython-311-x86_64-linux-gnu.so": "",
    "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml": """\
        custom:
        - func: npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor? group_list=None, int? split_item=0,
            int? group_type=None) -> Tensor[]
        - func: npu_grouped_matmul.List(Tensor[] x, Tensor[] weight, *, int[]? group_list=None,
            int? split_item=0) -> Tensor[]
        - func: npu_moe_init_routing_v2(Tensor x, Tensor expert_idx, *, int active_num=-1,
            int[2] active_expert_range=[]) -> (Tensor, Tensor, Tensor, Tensor)
        """,
    "torch_npu/npu/__init__.py": """\
        from .streams import Stream, Event
        from .config import *
        import torch_npu

        def current_stream(device=None):
            return torch_npu.npu.Stream(device)

        def synchronize(device=None):
            pass
        """,
    "torch_npu/npu/config.py": """\
        __all__ = ["set_stream_limit"]

        def set_stream_limit(stream, cube_num=-1, vector_num=-1):
            pass

        def not_exported():
            pass
        """,
    "torch_npu/npu/streams.py": """\
        import torch_npu._C

        class Stream(torch_npu._C._NPUStreamBase):
            def __new__(cls, device=None, priority=0, **kwargs):
                pass

            def wait_event(self, event):
                pass

        class Event:
            def __init__(self, enable_timing=False):
                self.timing = enable_timing

            def record(self, stream=None):
                pass
        """,
    "torch_npu/dynamo/torchair/__init__.py": """\
        import torchair.scope
        from torchair.configs import CompilerConfig
        """,
    "torch_npu/dynamo/torchair/configs.py": """\
        class CompilerConfig:
            def __init__(self):
                self.mode = "max-autotune"
        """,
    "torch_npu/dynamo/torchair/scope/__init__.py": """\
        def npu_stream_switch(stream_tag: str, stream_priority: int = 0):
            pass
        """,
    "torch_npu/dynamo/torchair/ops/__init__.py": """\
        import torch

        def npu_record_tagged_stream(input: torch.Tensor, tagged_stream: str):
            pass
        """,
    "torch_npu/dynamo/torchair/ops/_lib.py": """\
        import torch
        lib = torch.library.Library("air", "FRAGMENT")
        """,
    "torch_npu/dynamo/torchair/ops/_tagged_event.py": """\
        from ._lib import lib
        lib.define(\"\"\"
            tagged_event_record(str tag, bool created_inside=False) -> ()
        \"\"\")
        """,
}

# (statement(s) in a toolkit function with parameters x, w, s, e, expected problem or None: it fits)
CASES = [
    # fits
    ("torch_npu.npu_grouped_matmul([x], [w], group_list=s, split_item=2)", None),
    ("torch_npu.npu_moe_init_routing_v2(x, s, active_num=4, active_expert_range=[0, 8])", None),
    ("npu = _torch_npu()\nnpu.npu_grouped_matmul([x], [w], group_type=0)", None),
    ("scope = torchair.scope\nwith scope.npu_stream_switch('side', 1):\n    pass", None),
    ("torch.ops.air.tagged_event_record('t')", None),
    ("torch.ops.air.tagged_event_record.default('t', created_inside=True)", None),
    ("torch.npu.current_stream().wait_event(e)", None),
    ("torch.npu.set_stream_limit(s, *limits)", None),
    ("c = torchair.CompilerConfig()\nc.mode = 'reduce-overhead'", None),
    ("kind = 'cuda' if x else 'npu'\ngetattr(torch, kind).synchronize()", None),
    # wrong keyword, directly and through each kind of alias
    ("torch_npu.npu_grouped_matmul([x], [w], group_lists=s)", "keyword 'group_lists' is not an argument"),
    ("npu = _torch_npu()\nnpu.npu_grouped_matmul([x], [w], split_items=2)", "keyword 'split_items' is not an argument"),
    ("from torchair.scope import npu_stream_switch as sw\nsw('side', stream_priorty=1)",
     "keyword 'stream_priorty' is not an argument"),
    ("tnpu = torch.npu\ntnpu.set_stream_limit(s, cube_nums=8)", "keyword 'cube_nums' is not an argument"),
    ("torch.npu.Event(enable_timng=True)", "keyword 'enable_timng' is not an argument"),
    ("kind = 'cuda' if x else 'npu'\ngetattr(torch, kind).synchronize(devcie=0)", "keyword 'devcie' is not an argument"),
    # wrong name: operator, Python API, method of a returned object, import, stored attribute, overload
    ("torch_npu.npu_grouped_matmull([x], [w])", "torch_npu has no attribute 'npu_grouped_matmull'"),
    ("torch.ops.air.tagged_event_recrd('t')", "torch.ops.air has no operator 'tagged_event_recrd'"),
    ("torch.npu.not_exported()", "has no attribute 'not_exported'"),
    ("torch.npu.current_stream().wait_evnt(e)", "has no Python attribute 'wait_evnt'"),
    ("torch.npu.Event().recrod()", "has no attribute 'recrod'"),
    ("from torchair.scope import npu_stream_swich", "has no attribute 'npu_stream_swich'"),
    ("c = torchair.CompilerConfig()\nc.mdoe = 'reduce-overhead'", "has no attribute 'mdoe'"),
    ("torch.ops.air.tagged_event_record.out('t')", "has no overload 'out'"),
    # too many positional arguments, missing required ones
    ("torch.ops.air.tagged_event_record('t', False, 3)", "3 positional arguments, at most 2"),
    ("torch.npu.set_stream_limit(s, 8, 16, 4)", "4 positional arguments, at most 3"),
    ("torch_npu.npu_grouped_matmul([x], [w], s)", "no overload fits"),
    ("torch.ops.air.tagged_event_record()", "missing required argument(s) tag"),
    ("torch.ops.air.tagged_event_record('t', tag='u')", "given both by position and by keyword"),
    # literal types
    ("torch_npu.npu_grouped_matmul([x], [w], split_item='2')", "a str does not fit int?"),
    ("torch_npu.npu_moe_init_routing_v2(x, s, active_expert_range=[0, 1.5])", "a list does not fit int[2]"),
    ("torch.ops.air.tagged_event_record(None)", "a None does not fit str"),
    ("torchair.scope.npu_stream_switch(3)", "an int does not fit str"),
    ("torch.npu.set_stream_limit(s, cube_num='8')", "a str does not fit the type of its default -1"),
    # not resolvable: reported, not skipped
    ("getattr(torch, x).Stream()", "goes through getattr(torch, <not a literal>)"),
    ("functools.partial(torch_npu.npu_grouped_matmul, split_item=2)", "passed to functools.partial()"),
    ("ops = {'gmm': torch_npu.npu_grouped_matmul}", "kept in a container"),
    ("STATE.gmm = torch_npu.npu_grouped_matmul", "stored as STATE.gmm"),
]

KIT_HEADER = """\
import functools

import torch
import torch_npu
import torchair

from .util import _torch_npu

STATE = object()
"""

KIT_FILES = {
    "kit/__init__.py": "",
    "kit/util.py": "def _torch_npu():\n    import torch_npu\n\n    return torch_npu\n",
    "kit/dev.py": """\
        import torch


        class Dev:
            def __init__(self, kind):
                self.kind = kind

            @property
            def mod(self):
                return getattr(torch, self.kind)

            def stream(self):
                return self.mod.Event(enable_timng=True)

            def clock(self):
                return Clock(self.mod)


        class Clock:
            def __init__(self, mod):
                self.mod = mod

            def sync(self):
                self.mod.synchronize(0, 1)
        """,
}
DEV_SITE = ("kit/dev.py", "Dev.mod", "getattr(torch, self.kind)")


def _kit():
    """The synthetic toolkit: one function per case; returns (sources, {case index: line range})."""
    lines = KIT_HEADER.splitlines()
    spans = {}
    for i, (stmt, _) in enumerate(CASES):
        lines += ["", "", f"def case_{i}(x, w, s, e, limits):"]
        start = len(lines) + 1
        lines += ["    " + line for line in stmt.splitlines()]
        spans[i] = range(start, len(lines) + 1)
    files = {name: textwrap.dedent(text) for name, text in KIT_FILES.items()}
    files["kit/calls.py"] = "\n".join(lines) + "\n"
    return files, spans


@pytest.fixture(scope="module")
def mini_wheel(tmp_path_factory):
    path = tmp_path_factory.mktemp("wheel") / "torch_npu-0.0.0-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in MINI_WHEEL.items():
            zf.writestr(name, textwrap.dedent(text))
    w = ns.Wheel(str(path))
    yield w
    w.close()


@pytest.fixture(scope="module")
def kit_report(mini_wheel):
    files, spans = _kit()
    found = ns.discover(files, {})
    verdicts = ns.check_all(mini_wheel, found)
    per_case = {}
    for i, span in spans.items():
        msgs = [p for v in verdicts if v.call.file == "kit/calls.py" and v.call.line in span
                and v.status != "ok" for p in v.problems or [v.status]]
        msgs += [str(u) for u in found.unresolved if u.file == "kit/calls.py" and u.line in span]
        seen = [v for v in verdicts if v.call.file == "kit/calls.py" and v.call.line in span]
        per_case[i] = (msgs, seen)
    return per_case, found


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0].splitlines()[-1][:50] for c in CASES])
def test_the_check_reports_each_mistake(kit_report, index):
    stmt, expected = CASES[index]
    msgs, seen = kit_report[0][index]
    if expected is None:
        assert seen and not msgs, f"{stmt!r}: expected a clean check of a discovered call, got {msgs or 'no call'}"
    else:
        assert any(expected in m for m in msgs), f"{stmt!r}: expected {expected!r} among {msgs}"


def test_a_dynamic_site_is_checked_once_allowlisted(mini_wheel):
    files = {name: textwrap.dedent(text) for name, text in KIT_FILES.items()}
    plain = ns.discover(files, {})
    assert {u.line for u in plain.unresolved if u.file == "kit/dev.py"} == {13, 24}, plain.unresolved
    found = ns.discover(files, {DEV_SITE: (("torch.npu",), "torch.cuda or torch.npu")})
    assert not found.unresolved and found.allow_used == {DEV_SITE}
    problems = {(v.call.line, p) for v in ns.check_all(mini_wheel, found) for p in v.problems}
    # the property's value, and the same module handed to another class's constructor
    assert any(line == 13 and "keyword 'enable_timng'" in p for line, p in problems), problems
    assert any(line == 24 and "2 positional arguments, at most 1" in p for line, p in problems), problems


WRAP_FILE = """\
import dataclasses
from typing import Any, Optional

from .util import _torch_npu


def _fused(name, fn, reads, **kwargs):
    return fn(**kwargs)


class _Call:
    def kwargs(self):
        return dict(split_item=2, group_typ=0)


@dataclasses.dataclass
class Rows:
    npu: Optional[Any] = None


def grouped(x, w):
    npu = _torch_npu()
    good = _fused("gmm", npu.npu_grouped_matmul, (x,), x=[x], weight=[w], split_item=2)
    return _fused("gmm", npu.npu_grouped_matmul, (x,), x=[x], weight=[w], **_Call().kwargs())


def rows(x):
    return Rows(_torch_npu())


def use(r: Rows, x):
    return r.npu.npu_grouped_matmul([x], [x], group_lists=x)
"""


def test_wrappers_fields_and_annotations_are_followed(mini_wheel):
    """``fn(**kwargs)`` is checked per call site, ``**`` keys expanded; a dataclass field and an annotated
    parameter carry torch_npu to the call."""
    files = {"kit/__init__.py": "", "kit/util.py": KIT_FILES["kit/util.py"], "kit/wrap.py": WRAP_FILE}
    found = ns.discover(files, {})
    assert not found.unresolved, found.unresolved
    verdicts = {v.call.line: v for v in ns.check_all(mini_wheel, found)
                if isinstance(v.call, ns.CallSite) and v.call.file == "kit/wrap.py"}
    assert verdicts[23].status == "ok" and verdicts[23].call.keywords.keys() == {"x", "weight", "split_item"}
    assert "keyword 'group_typ'" in " ".join(verdicts[24].problems), verdicts[24]
    assert "keyword 'group_lists'" in " ".join(verdicts[32].problems), verdicts[32]
    assert 8 not in verdicts  # the wrapper's own fn(**kwargs) is checked at its call sites, not as a union


def test_schema_parsing():
    name, overload, sig = ns.parse_schema(
        "npu_moe_init_routing_v2.foo(Tensor(a!) x, Tensor expert_idx, *, int[2] active_expert_range=[], "
        "str group=\"a, b\", ScalarType? dtype=None) -> (Tensor, Tensor)")
    assert (name, overload) == ("npu_moe_init_routing_v2", "foo")
    assert [(p.name, p.type, p.kind, p.required, p.default) for p in sig.params] == [
        ("x", "Tensor", "pos", True, None), ("expert_idx", "Tensor", "pos", True, None),
        ("active_expert_range", "int[2]", "kwonly", False, "[]"), ("group", "str", "kwonly", False, '"a, b"'),
        ("dtype", "ScalarType?", "kwonly", False, "None")]
    assert ns.schema_accepts("int[2]", "int") and not ns.schema_accepts("int[]", "int")
    assert ns.schema_accepts("Tensor?", "None") and not ns.schema_accepts("Tensor", "None")
    assert not ns.schema_accepts("int", "bool") and ns.schema_accepts("Scalar", "bool")


def test_the_real_wheel_reports_each_mistake(wheel):
    """The same mistakes against the real schemas (a wrong keyword, a wrong name, too many positionals)."""
    source = KIT_HEADER + textwrap.dedent("""\

        def calls(x, w, g, s, e):
            torch_npu.npu_grouped_matmul([x], [w], group_list=g, split_item=2, group_type=0, group_list_type=1)
            torch_npu.npu_grouped_matmul([x], [w], group_lists=g, split_item=2)
            torch_npu.npu_grouped_matmull([x], [w], group_list=g)
            torch.ops.air.tagged_event_record("t", False, 1)
            torchair.scope.npu_stream_switch("side", stream_priorty=1)
            torch.npu.set_stream_limit(s, cube_nums=8)
            torch.npu.current_stream().wait_evnt(e)
        """)
    found = ns.discover({"kit/__init__.py": "", "kit/util.py": KIT_FILES["kit/util.py"], "kit/real.py": source})
    by_line = {}
    for v in ns.check_all(wheel, found):
        if v.call.file == "kit/real.py":
            by_line.setdefault(v.call.line, []).append(v)
    first = KIT_HEADER.count("\n") + 3
    expected = [None, "keyword 'group_lists'", "no attribute 'npu_grouped_matmull'", "3 positional arguments",
                "keyword 'stream_priorty'", "keyword 'cube_nums'", "'wait_evnt'"]
    for offset, want in enumerate(expected):
        verdicts = by_line.get(first + offset, [])
        problems = [p for v in verdicts for p in v.problems]
        if want is None:
            assert verdicts and all(v.status == "ok" for v in verdicts), problems
        else:
            assert any(want in p for p in problems), (first + offset, want, problems)
