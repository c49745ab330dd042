"""Static contract: every torch_npu / torchair call of the toolkit, checked against the wheel's schemas.

Two halves, both plain `ast` and text work (nothing is installed or imported from the wheel):

`discover`
    parses the toolkit's sources and finds every call, import and attribute use that reaches
    torch_npu or torchair: ``torch_npu.X``, ``torch.npu.X``, ``torch.ops.{npu,air,npugraph_ex}.X``,
    ``torchair.X`` (``torchair.scope``, ``torchair.ops`` ...), ``npugraph_ex.X``, through aliases
    (see below).
`Wheel`
    reads the torch_npu wheel (a zip): native operator schemas from its yaml files
    (``torch_npu/csrc/aten/*.yaml``, ``func:`` entries, namespace ``npu``) and from every
    ``Library("ns", ...).define("schema")`` in its Python sources (``air``, ``npugraph_ex`` ...);
    Python APIs (``torch.npu`` = ``torch_npu.npu``; ``torchair`` and ``npugraph_ex`` =
    ``torch_npu/dynamo/<name>``) from its Python sources, parsed with `ast` into modules (star
    imports and ``__all__`` honoured), functions, classes and signatures. `Wheel.check` matches one
    discovered call against them.

What a call is checked for: the name exists (module attribute, class member, operator, overload);
every keyword is an argument; the positional arguments fit; no argument is given twice; every
required argument is given (unless the call uses ``*args`` / ``**kwargs`` that cannot be expanded);
a literal argument (int, float, bool, str, None, list / tuple display, or a name bound once to one)
fits the argument's type: the schema type of a native operator, the annotation of a Python
function, else the type of its literal default. An operator matches when one of its overloads does.

Alias resolution (static, flow-insensitive, documented so that its limits are known):

1. Values are tracked per name and scope (module, function, class body; Python's scoping rules,
   ``global`` honoured), as the union of everything the name is ever bound to in that scope:
   imports (``import torch_npu as tnpu``, ``from torchair import scope``, ``from torchair.scope import
   npu_wait_tensor as w``, relative imports of toolkit modules), assignments (``npu = torch.ops.npu``,
   ``scope = torchair.scope``), ``a if c else b`` / ``a or b`` (both), ``getattr(x, NAME)`` and
   ``importlib.import_module(NAME)`` where NAME is a string known statically (a literal, an f-string
   of constants, ``"cuda" if c else "npu"``, a name bound only to such strings). A call through a
   name bound to several NPU paths is checked against each of them.
2. Toolkit functions are followed, to a fixed point: a function whose ``return`` gives an NPU value
   makes its calls that value (``npu = _torch_npu(); npu.npu_grouped_matmul(...)``), also across
   modules; an NPU value passed to a toolkit function or class flows into that parameter (or
   dataclass / NamedTuple field); ``self.attr = value`` and ``@property`` returns make ``self.attr``
   (and ``obj.attr`` on an instance of that class) that value; a parameter or field annotated with a
   toolkit class holds an instance of it.
3. Wrappers: a toolkit function that calls one of its parameters (``def _fused(name, fn, **kwargs):
   return fn(**kwargs)``) is checked at each of its call sites, with the function passed there and
   the arguments forwarded through ``*args`` / ``**kwargs``. A ``**`` argument whose keys are known
   (a dict display, ``dict(k=...)``, a toolkit function returning one) is expanded into keywords.
4. The result of an NPU call keeps its path, and one attribute past it is followed
   (``torch.npu.current_stream().wait_event``, ``torchair.CompilerConfig().mode``); the wheel side
   infers the class a call returns (constructor, return annotation, or ``return Class(...)``), so
   methods of returned streams / events / configs are checked, and an attribute stored on an NPU
   object must exist on its class. An operator's result is a tensor: its methods are torch's, not
   checked (status "tensor").
5. Unresolvable, and reported rather than skipped: ``getattr(<torch / NPU value>, <unknown name>)``
   or ``importlib.import_module(<unknown name>)`` whose result is called (``getattr(torch,
   device_type).Stream()``); a ``from torch_npu... import *``; an NPU function or module stored in a
   container, an attribute of another object, yielded, or passed to a callable that is neither a
   toolkit function nor torch_npu / torchair (``functools.partial(torch_npu.npu_x, ...)``). Each
   such site can be listed in an allowlist ((file, function, expression) -> the NPU paths it
   stands for, and why), which then resolves it.

Not followed (by design): values kept in dicts or lists and read back, a wrapper's wrapper (only one
level of forwarding), calls made by code outside the scanned folders. Where the wheel cannot tell
(a method a Python class may inherit from a native base, a return value it cannot infer) the
verdict is "unknown", which fails like a mismatch; a ``**kwargs`` in the wheel's own signature
accepts any keyword (``torch.npu.Stream(...)``), so those keywords are not checked.
"""
from __future__ import annotations

import ast
import os
import re
import zipfile
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple

# ---- what counts as an NPU call ---------------------------------------------------------------------

NPU_OP_NAMESPACES = ("npu", "air", "npugraph_ex")
# torchair and npugraph_ex live in torch_npu/dynamo/ and are importable as top-level modules
NPU_ROOTS = ("torch_npu", "torchair", "npugraph_ex", "torch.npu") + tuple(f"torch.ops.{ns}" for ns in NPU_OP_NAMESPACES)
_PREFIXES = ("torch", "torch.ops")  # not NPU themselves, but an attribute of them can be
_TOP_MODULES = ("torch", "torch_npu", "torchair", "npugraph_ex")
_DYNAMO_PACKAGES = ("torchair", "npugraph_ex")  # torch_npu/dynamo/<name>, imported as <name>
TOOLKIT_PACKAGES = ("overlap", "collectives", "microbatch", "launch")
# builtins that only look at an object: passing an NPU function or module to them is not an escape
_HARMLESS = {"hasattr", "isinstance", "issubclass", "callable", "id", "type", "repr", "str", "print", "bool", "dir"}


def is_npu(path: str) -> bool:
    return any(path == r or path.startswith(r + ".") or path.startswith(r + "(") for r in NPU_ROOTS)


def _keep(path: str) -> Optional[str]:
    """``path`` if it is worth tracking, else None (OTHER).

    Past a call result only one attribute is followed (``torch.npu.current_stream().wait_event``,
    ``torchair.CompilerConfig().mode``): what a method returns, or an attribute of an attribute, is
    not tracked (mostly tensors, whose API is torch's).
    """
    if not (is_npu(path) or path in _PREFIXES):
        return None
    head, call, tail = path.partition("()")
    if call and (tail.count(".") > 1 or "()" in tail):
        return None
    return path


def is_call_result(path: str) -> bool:
    return path.endswith("()")


# ---- abstract values (toolkit side) ---------------------------------------------------------------

OTHER = ("other",)
Val = Tuple[str, ...]  # ("path", p) | ("def", module, qual) | ("inst", module, classqual) | ("mod", module)
#                        | ("global", module, name) | ("dyn", key) | OTHER
Vals = FrozenSet[Val]
_EMPTY: Vals = frozenset()
_ONLY_OTHER: Vals = frozenset([OTHER])
AllowKey = Tuple[str, str, str]  # (file, qualified function or "<module>", ast.unparse(expression))


@dataclass
class Arg:
    kind: Any  # literal kind: "int" "float" "bool" "str" "None" "bytes" "dict" "set" ("list", [kinds]) or None
    text: str


@dataclass
class CallSite:
    path: str
    file: str
    line: int
    qual: str
    text: str
    positional: List[Arg] = field(default_factory=list)
    keywords: Dict[str, Arg] = field(default_factory=dict)
    star_args: bool = False
    star_kwargs: bool = False

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class Reference:
    path: str
    file: str
    line: int
    kind: str  # "import", "attribute" or "store"

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class Unresolved:
    file: str
    line: int
    qual: str
    key: AllowKey
    why: str

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def __str__(self) -> str:
        return f"{self.where} (in {self.qual}): {self.why}; allowlist key {self.key!r}"


@dataclass
class Discovery:
    calls: List[CallSite]
    references: List[Reference]
    unresolved: List[Unresolved]
    allow_used: Set[AllowKey]


def _literal_kind(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None:
            return "None"
        for t in (bool, int, float, str, bytes):
            if type(v) is t:
                return t.__name__
        return None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        k = _literal_kind(node.operand)
        return k if k in ("int", "float") else None
    if isinstance(node, (ast.List, ast.Tuple)):
        if any(isinstance(e, ast.Starred) for e in node.elts):
            return ("list", [])
        return ("list", [_literal_kind(e) for e in node.elts])
    if isinstance(node, ast.JoinedStr):
        return "str"
    if isinstance(node, (ast.Dict, ast.DictComp)):
        return "dict"
    if isinstance(node, (ast.Set, ast.SetComp)):
        return "set"
    if isinstance(node, ast.ListComp):
        return ("list", [])
    return None


def kind_name(kind: Any) -> str:
    return "list" if isinstance(kind, tuple) else str(kind)


# ---- scopes -------------------------------------------------------------------------------------

class _Scope:
    def __init__(self, kind: str, node: Optional[ast.AST], parent: Optional["_Scope"], qual: str, module: "_Module"):
        self.kind, self.node, self.parent, self.qual, self.module = kind, node, parent, qual, module
        self.bindings: Dict[str, List[Tuple[Any, ...]]] = {}
        self.globals: Set[str] = set()
        self.params: List[str] = []  # positional ones first, then keyword-only
        self.n_positional = 0
        self.vararg: Optional[str] = None
        self.varkw: Optional[str] = None
        self.cls: Optional[_Scope] = None  # for a method: the class scope it is defined in
        self.returns: List[ast.AST] = []
        self.is_generator = False
        self.decorators: List[str] = []

    def bind(self, name: str, binding: Tuple[Any, ...]) -> None:
        target = self
        if name in self.globals:
            target = self.module.scope
        target.bindings.setdefault(name, []).append(binding)

    def is_local(self, name: str) -> bool:
        return name in self.bindings and name not in self.globals


def _deco_names(node: Any) -> List[str]:
    out = []
    for d in getattr(node, "decorator_list", []):
        d = d.func if isinstance(d, ast.Call) else d
        out.append(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return out


class _Module:
    def __init__(self, name: str, file: str, tree: ast.Module, is_package: bool):
        self.name, self.file, self.tree, self.is_package = name, file, tree, is_package
        self.scope = _Scope("module", tree, None, "<module>", self)
        self.scope_of: Dict[ast.AST, _Scope] = {}
        self.defs: Dict[str, _Scope] = {}  # qual -> function / class scope
        _ScopeBuilder(self).build()

    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


class _ScopeBuilder(ast.NodeVisitor):
    """Collects every scope's bindings (flow-insensitive), parameters and returns."""

    def __init__(self, module: _Module):
        self.m = module
        self.cur = module.scope

    def build(self) -> None:
        for stmt in self.m.tree.body:
            self.visit(stmt)

    def _new_scope(self, kind: str, node: ast.AST, name: str) -> _Scope:
        parent = self.cur
        qual = name if parent.kind == "module" else f"{parent.qual}.{name}"
        s = _Scope(kind, node, parent, qual, self.m)
        self.m.scope_of[node] = s
        self.m.defs[qual] = s
        return s

    def _bind_target(self, target: ast.AST, binding: Tuple[Any, ...]) -> None:
        if isinstance(target, ast.Name):
            self.cur.bind(target.id, binding)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for e in target.elts:
                self._bind_target(e.value if isinstance(e, ast.Starred) else e, ("other",))
        elif isinstance(target, ast.Starred):
            self._bind_target(target.value, ("other",))

    def _function(self, node: Any, name: str) -> None:
        for d in getattr(node, "decorator_list", []):
            self.visit(d)
        args = node.args
        for d in list(args.defaults) + [d for d in args.kw_defaults if d is not None]:
            self.visit(d)
        if not isinstance(node, ast.Lambda):
            self.cur.bind(name, ("def", self.m.name, self._qual(name)))
        s = self._new_scope("function", node, name)
        s.decorators = _deco_names(node)
        if self.cur.kind == "class":
            s.cls = self.cur
        all_args = args.posonlyargs + args.args
        defaults = [None] * (len(all_args) - len(args.defaults)) + list(args.defaults)
        for a, d in zip(all_args, defaults):
            s.params.append(a.arg)
            s.bindings.setdefault(a.arg, []).append(("param", a.arg, d, a.annotation))
        s.n_positional = len(all_args)
        s.vararg = args.vararg.arg if args.vararg else None
        s.varkw = args.kwarg.arg if args.kwarg else None
        for a, d in zip(args.kwonlyargs, args.kw_defaults):
            s.params.append(a.arg)
            s.bindings.setdefault(a.arg, []).append(("param", a.arg, d, a.annotation))
        for a in (args.vararg, args.kwarg):
            if a is not None:
                s.bindings.setdefault(a.arg, []).append(("other",))
        outer, self.cur = self.cur, s
        if isinstance(node, ast.Lambda):
            s.returns.append(node.body)
            self.visit(node.body)
        else:
            for stmt in node.body:
                self.visit(stmt)
        self.cur = outer

    def _qual(self, name: str) -> str:
        return name if self.cur.kind == "module" else f"{self.cur.qual}.{name}"

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._function(node, node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._function(node, f"<lambda:{node.lineno}:{node.col_offset}>")

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for d in node.decorator_list + node.bases + [k.value for k in node.keywords]:
            self.visit(d)
        self.cur.bind(node.name, ("def", self.m.name, self._qual(node.name)))
        s = self._new_scope("class", node, node.name)
        outer, self.cur = self.cur, s
        for stmt in node.body:
            self.visit(stmt)
        self.cur = outer

    def visit_Global(self, node: ast.Global) -> None:
        self.cur.globals.update(node.names)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.asname:
                self.cur.bind(a.asname, ("import", a.name, None, 0, node))
            else:
                top = a.name.split(".")[0]
                self.cur.bind(top, ("import", top, None, 0, node))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for a in node.names:
            if a.name == "*":
                self.cur.bind("*", ("star", node.module or "", node.level, node))
                continue
            self.cur.bind(a.asname or a.name, ("import", node.module or "", a.name, node.level, node))

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for t in node.targets:
            self._bind_target(t, ("expr", node.value))
            if not isinstance(t, ast.Name):
                self.visit(t)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
            self._bind_target(node.target, ("expr", node.value))
        else:  # a declaration (a dataclass field): its annotation says what it holds
            self._bind_target(node.target, ("annot", node.annotation))
        if not isinstance(node.target, ast.Name):
            self.visit(node.target)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.visit(node.value)
        self._bind_target(node.target, ("other",))

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        self._bind_target(node.target, ("expr", node.value))

    def visit_For(self, node: Any) -> None:
        self._bind_target(node.target, ("other",))
        self.generic_visit(node)

    visit_AsyncFor = visit_For

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self._bind_target(node.target, ("other",))
        self.generic_visit(node)

    def visit_withitem(self, node: ast.withitem) -> None:
        if node.optional_vars is not None:
            self._bind_target(node.optional_vars, ("other",))
        self.visit(node.context_expr)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.cur.bind(node.name, ("other",))
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        if node.value is not None:
            self.cur.returns.append(node.value)
            self.visit(node.value)

    def visit_Yield(self, node: Any) -> None:
        self.cur.is_generator = True
        self.generic_visit(node)

    visit_YieldFrom = visit_Yield


# ---- discovery ----------------------------------------------------------------------------------

def module_name(relpath: str) -> Tuple[str, bool]:
    parts = relpath[:-3].replace(os.sep, "/").split("/")
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def toolkit_sources(root: str, packages: Sequence[str] = TOOLKIT_PACKAGES) -> Dict[str, str]:
    """``{relative path: source}`` of every ``.py`` file under ``packages`` of ``root``."""
    out = {}
    for pkg in packages:
        for dirpath, dirs, files in os.walk(os.path.join(root, pkg)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    with open(path, encoding="utf-8") as fh:
                        out[os.path.relpath(path, root).replace(os.sep, "/")] = fh.read()
    return out


class _Analysis:
    def __init__(self, sources: Dict[str, str], allow: Dict[AllowKey, Tuple[Sequence[str], str]]):
        self.allow = allow
        self.allow_used: Set[AllowKey] = set()
        self.modules: Dict[str, _Module] = {}
        for rel, text in sorted(sources.items()):
            name, pkg = module_name(rel)
            self.modules[name] = _Module(name, rel, ast.parse(text, filename=rel), pkg)
        self.tops = {n.split(".")[0] for n in self.modules}
        # fixed-point state
        self.param_vals: Dict[Tuple[str, str, str], Set[Val]] = {}
        self.attr_vals: Dict[Tuple[str, str, str], Set[Val]] = {}
        self.changed = False
        self.memo: Dict[Tuple[int, str], Vals] = {}
        self.busy: Set[Any] = set()
        self.subclasses: Dict[Tuple[str, str], Set[Tuple[str, str]]] = {}
        # results of the last pass
        self.collect = False
        self.calls: List[CallSite] = []
        self.refs: List[Reference] = []
        self.unresolved: Dict[Tuple[str, int, AllowKey, str], Unresolved] = {}

    # -- state updates
    def _add(self, table: Dict[Any, Set[Val]], key: Any, vals: Iterable[Val]) -> None:
        cur = table.setdefault(key, set())
        new = {v for v in vals if v != OTHER and v[0] != "global"} - cur
        if new:
            cur |= new
            self.changed = True

    # -- module / name resolution
    def _resolve_module_name(self, module: _Module, name: str, level: int) -> str:
        if not level:
            return name
        base = module.package().split(".")
        if level > 1:
            base = base[: len(base) - (level - 1)]
        return ".".join([p for p in base if p] + ([name] if name else []))

    def _module_value(self, name: str) -> Vals:
        top = name.split(".")[0]
        if top in _TOP_MODULES:
            kept = _keep(name)
            return frozenset([("path", kept)]) if kept else _ONLY_OTHER
        if name in self.modules:
            return frozenset([("mod", name)])
        return _ONLY_OTHER

    def _global(self, modname: str, name: str) -> Vals:
        """``name`` looked up in toolkit module ``modname`` (a submodule, or a module-level binding)."""
        sub = f"{modname}.{name}"
        if sub in self.modules:
            return frozenset([("mod", sub)])
        m = self.modules.get(modname)
        if m is None:
            return _ONLY_OTHER
        if name in m.scope.bindings:
            return self._scope_name(m.scope, name)
        return _ONLY_OTHER

    def _binding_vals(self, scope: _Scope, b: Tuple[Any, ...]) -> Vals:
        kind = b[0]
        if kind == "other":
            return _ONLY_OTHER
        if kind == "expr":
            return self.ev(b[1], scope)
        if kind == "def":
            return frozenset([("def", b[1], b[2])])
        if kind == "param":
            fs = scope
            out: Set[Val] = {OTHER}
            if b[2] is not None:
                out |= self.ev(b[2], fs.parent)
            if fs.cls is not None and fs.params and fs.params[0] == b[1] and "staticmethod" not in fs.decorators:
                out.add(("def" if "classmethod" in fs.decorators else "inst", fs.module.name, fs.cls.qual))
            out |= self.param_vals.get((fs.module.name, fs.qual, b[1]), set())
            out |= self._annotation_vals(b[3], fs.parent)
            return frozenset(out)
        if kind == "annot":
            return frozenset({OTHER}) | self._annotation_vals(b[1], scope)
        if kind == "import":
            _, modname, attr, level, node = b
            full = self._resolve_module_name(scope.module, modname, level)
            if attr is None:
                return self._module_value(full)
            top = full.split(".")[0]
            if top in _TOP_MODULES:
                return self._module_value(f"{full}.{attr}")
            if full in self.modules:
                return frozenset([("global", full, attr)])
            return _ONLY_OTHER
        return _ONLY_OTHER

    def _annotation_vals(self, node: Optional[ast.AST], scope: Optional[_Scope]) -> Vals:
        """Instances of the toolkit or NPU classes an annotation names (``Optional[X]``, ``"X"``, ``X | None``)."""
        if node is None or scope is None:
            return _EMPTY
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                return self._annotation_vals(ast.parse(node.value, mode="eval").body, scope)
            except SyntaxError:
                return _EMPTY
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return self._annotation_vals(node.left, scope) | self._annotation_vals(node.right, scope)
        if isinstance(node, ast.Subscript):
            outer = ast.unparse(node.value).split(".")[-1]
            if outer in ("Optional", "Union"):
                elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                out: Set[Val] = set()
                for e in elts:
                    out |= self._annotation_vals(e, scope)
                return frozenset(out)
            return _EMPTY
        if not isinstance(node, (ast.Name, ast.Attribute)):
            return _EMPTY
        out = set()
        for v in self.ev(node, scope):
            if v[0] == "def" and self._class_scope(v[1], v[2]) is not None:
                out.add(("inst", v[1], v[2]))
            elif v[0] == "path" and is_npu(v[1]) and not is_call_result(v[1]):
                out.add(("path", f"{v[1]}()"))
        return frozenset(out)

    def _scope_name(self, scope: _Scope, name: str) -> Vals:
        key = (id(scope), name)
        if key in self.memo:
            return self.memo[key]
        if key in self.busy:
            return _EMPTY
        self.busy.add(key)
        try:
            out: Set[Val] = set()
            for b in scope.bindings.get(name, []):
                out |= self._deref(self._binding_vals(scope, b))
            res = frozenset(out)
        finally:
            self.busy.discard(key)
        self.memo[key] = res
        return res

    def _deref(self, vals: Vals) -> Vals:
        if not any(v[0] == "global" for v in vals):
            return vals
        out: Set[Val] = set()
        for v in vals:
            out |= self._global(v[1], v[2]) if v[0] == "global" else {v}
        return frozenset(out)

    def lookup(self, scope: _Scope, name: str) -> Vals:
        s: Optional[_Scope] = scope
        if name in scope.globals:
            s = scope.module.scope
        first = True
        while s is not None:
            if (first or s.kind != "class") and name in s.bindings:
                return self._scope_name(s, name)
            first = False
            s = s.parent
        return _ONLY_OTHER

    # -- classes
    def _class_scope(self, modname: str, qual: str) -> Optional[_Scope]:
        m = self.modules.get(modname)
        s = m.defs.get(qual) if m else None
        return s if s is not None and s.kind == "class" else None

    def _bases(self, cs: _Scope) -> List[_Scope]:
        out = []
        for b in cs.node.bases:
            for v in self.ev(b, cs.parent):
                if v[0] == "def":
                    bs = self._class_scope(v[1], v[2])
                    if bs is not None:
                        out.append(bs)
        return out

    def _family(self, cs: _Scope) -> List[_Scope]:
        """The class, its toolkit bases and its toolkit subclasses (``self`` may be any of them)."""
        seen: List[_Scope] = []
        todo = [cs]
        while todo:
            c = todo.pop()
            if c in seen:
                continue
            seen.append(c)
            todo.extend(self._bases(c))
        for sub in self.subclasses.get((cs.module.name, cs.qual), ()):
            s = self._class_scope(*sub)
            if s is not None and s not in seen:
                seen.append(s)
        return seen

    def _member(self, modname: str, classqual: str, attr: str) -> Vals:
        cs = self._class_scope(modname, classqual)
        if cs is None:
            return _ONLY_OTHER
        out: Set[Val] = set()
        for c in self._family(cs):
            if attr in c.bindings:
                for v in self._scope_name(c, attr):
                    fn = self._def_scope(v)
                    if fn is not None and fn.kind == "function" and "property" in fn.decorators:
                        out |= self._returns(fn)
                    else:
                        out.add(v)
            out |= self.attr_vals.get((c.module.name, c.qual, attr), set())
        return frozenset(out) or _ONLY_OTHER

    def _def_scope(self, v: Val) -> Optional[_Scope]:
        if v[0] != "def":
            return None
        m = self.modules.get(v[1])
        return m.defs.get(v[2]) if m else None

    def _returns(self, fs: _Scope) -> Vals:
        key = ("returns", id(fs))
        if key in self.memo:
            return self.memo[key]
        if key in self.busy or fs.is_generator:
            return _ONLY_OTHER
        self.busy.add(key)
        try:
            out: Set[Val] = {OTHER}
            for r in fs.returns:
                out |= self.ev(r, fs)
            res = frozenset(out)
        finally:
            self.busy.discard(key)
        self.memo[key] = res
        return res

    # -- expressions
    def ev(self, node: ast.AST, scope: _Scope) -> Vals:
        if isinstance(node, ast.Name):
            return self.lookup(scope, node.id)
        if isinstance(node, ast.Attribute):
            return self._attr(self.ev(node.value, scope), node.attr)
        if isinstance(node, ast.Call):
            return self._call_value(node, scope)
        if isinstance(node, ast.IfExp):
            return self.ev(node.body, scope) | self.ev(node.orelse, scope)
        if isinstance(node, ast.BoolOp):
            out: Set[Val] = set()
            for v in node.values:
                out |= self.ev(v, scope)
            return frozenset(out)
        if isinstance(node, ast.NamedExpr):
            return self.ev(node.value, scope)
        if isinstance(node, ast.Lambda):
            return frozenset([("def", scope.module.name, scope.module.scope_of[node].qual)])
        return _ONLY_OTHER

    def _attr(self, vals: Vals, attr: str) -> Vals:
        out: Set[Val] = set()
        for v in vals:
            if v[0] == "path":
                kept = _keep(f"{v[1]}.{attr}")
                out.add(("path", kept) if kept else OTHER)
            elif v[0] == "dyn":
                out.add(v)
            elif v[0] == "mod":
                out |= self._global(v[1], attr)
            elif v[0] == "inst" or (v[0] == "def" and self._class_scope(v[1], v[2]) is not None):
                out |= self._member(v[1], v[2], attr)
            else:
                out.add(OTHER)
        return frozenset(out)

    def _site(self, node: ast.AST, scope: _Scope) -> AllowKey:
        return (scope.module.file, scope.qual, ast.unparse(node))

    def _dynamic(self, node: ast.Call, scope: _Scope, why: str, extra: Vals = _EMPTY) -> Vals:
        key = self._site(node, scope)
        if key in self.allow:
            self.allow_used.add(key)
            return frozenset([("path", p) for p in self.allow[key][0]] + [OTHER]) | extra
        return frozenset([("dyn", key, str(node.lineno), why)]) | extra

    def _call_value(self, node: ast.Call, scope: _Scope) -> Vals:
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("getattr", "__import__") and not self._bound(scope, f.id) and node.args:
            if f.id == "getattr" and len(node.args) >= 2:
                base = self.ev(node.args[0], scope)
                default = self.ev(node.args[2], scope) if len(node.args) > 2 else _EMPTY
                names = self._const_strs(node.args[1], scope)
                if names is not None:
                    out: Set[Val] = set(default)
                    for name in sorted(names):
                        out |= self._attr(base, name)
                    return frozenset(out)
                if any(v[0] in ("path", "dyn") for v in base):
                    return self._dynamic(node, scope, f"getattr({ast.unparse(node.args[0])}, <not a literal>)",
                                         default)
                return _ONLY_OTHER
            return self._import_call(node, scope)
        if self._is_import_module(node):
            return self._import_call(node, scope)
        funcs = self.ev(f, scope)
        out: Set[Val] = set()
        for v in funcs:
            if v[0] == "path":
                kept = _keep(f"{v[1]}()")
                out.add(("path", kept) if kept and is_npu(kept) else OTHER)
            elif v[0] == "dyn":
                out.add(v)
            elif v[0] == "def":
                s = self._def_scope(v)
                if s is None:
                    out.add(OTHER)
                elif s.kind == "class":
                    out.add(("inst", v[1], v[2]))
                else:
                    out |= self._returns(s)
            else:
                out.add(OTHER)
        return frozenset(out)

    def _import_call(self, node: ast.Call, scope: _Scope) -> Vals:
        if not node.args:
            return _ONLY_OTHER
        names = self._const_strs(node.args[0], scope)
        if names is not None:
            out: Set[Val] = set()
            for name in sorted(names):
                out |= self._module_value(name)
            return frozenset(out)
        return self._dynamic(node, scope, "import of a module named at run time")

    @staticmethod
    def _bound(scope: _Scope, name: str) -> bool:
        """Whether ``name`` is bound in ``scope`` or a scope around it (a builtin shadowed by the code)."""
        s: Optional[_Scope] = scope
        while s is not None:
            if name in s.bindings:
                return True
            s = s.parent
        return False

    # -- the walk
    def run(self) -> Discovery:
        for m in self.modules.values():
            for qual, s in m.defs.items():
                if s.kind == "class":
                    for b in self._bases(s):
                        self.subclasses.setdefault((b.module.name, b.qual), set()).add((m.name, qual))
        self._find_param_calls()
        for _ in range(50):
            self.changed = False
            self.memo.clear()
            self._pass()
            if not self.changed:
                break
        self.memo.clear()
        self.collect = True
        self._pass()
        return Discovery(self.calls, self.refs, sorted(self.unresolved.values(), key=lambda u: (u.file, u.line)),
                         self.allow_used)

    def _pass(self) -> None:
        for m in self.modules.values():
            for stmt in m.tree.body:
                self._walk(stmt, m.scope)

    def _walk(self, node: ast.AST, scope: _Scope) -> None:
        inner = scope.module.scope_of.get(node)
        if inner is None:
            self._visit(node, scope)
            for child in ast.iter_child_nodes(node):
                self._walk(child, scope)
            return
        # decorators, bases and defaults belong to the enclosing scope, the body to the new one
        pre: List[ast.AST] = list(getattr(node, "decorator_list", []))
        if isinstance(node, ast.ClassDef):
            pre += node.bases + [k.value for k in node.keywords]
            body: List[ast.AST] = node.body
        else:
            args = node.args  # type: ignore[attr-defined]
            pre += list(args.defaults) + [d for d in args.kw_defaults if d is not None]
            body = [node.body] if isinstance(node, ast.Lambda) else node.body  # type: ignore[attr-defined]
        for p in pre:
            self._walk(p, scope)
        for b in body:
            self._walk(b, inner)

    def _visit(self, node: ast.AST, scope: _Scope) -> None:
        if isinstance(node, ast.Call):
            self._on_call(node, scope)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                self._on_store(t, node.value, scope)
        elif self.collect and isinstance(node, (ast.Import, ast.ImportFrom)):
            self._on_import(node, scope)
        elif self.collect and isinstance(node, ast.Attribute):
            self._on_attribute(node, scope)
        elif self.collect and isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict)) \
                and isinstance(getattr(node, "ctx", ast.Load()), ast.Load) and not hasattr(node, "_harmless_arg"):
            elts = node.values if isinstance(node, ast.Dict) else node.elts
            for e in elts:
                self._escape(e, scope, "kept in a container")
        elif self.collect and isinstance(node, (ast.Yield, ast.YieldFrom)) and node.value is not None:
            self._escape(node.value, scope, "yielded")

    def _npu_refs(self, node: ast.AST, scope: _Scope, static: bool = False) -> List[str]:
        """The NPU paths ``node`` may be that are not call results (``static``: nothing called on the way)."""
        return sorted(v[1] for v in self.ev(node, scope) if v[0] == "path" and is_npu(v[1])
                      and not is_call_result(v[1]) and not (static and "()" in v[1]))

    def _escape(self, node: ast.AST, scope: _Scope, how: str) -> None:
        if isinstance(node, ast.Starred):
            node = node.value
        refs = self._npu_refs(node, scope, static=True)
        if not refs:
            return
        key = self._site(node, scope)
        if key in self.allow:
            self.allow_used.add(key)
            return
        self._unresolved(node, scope, key, f"{', '.join(refs)} {how}: its calls cannot be followed")

    def _unresolved(self, node: ast.AST, scope: _Scope, key: AllowKey, why: str) -> None:
        u = Unresolved(scope.module.file, node.lineno, scope.qual, key, why)
        self.unresolved[(u.file, u.line, key, why)] = u

    def _on_store(self, target: ast.AST, value: ast.AST, scope: _Scope) -> None:
        if isinstance(target, ast.Attribute):
            base = self.ev(target.value, scope)
            selfish = [v for v in base if v[0] == "inst"]
            if selfish:
                vals = self.ev(value, scope)
                for v in selfish:
                    self._add(self.attr_vals, (v[1], v[2], target.attr), vals)
            elif self.collect:
                self._escape(value, scope, f"stored as {ast.unparse(target)}")
        elif isinstance(target, ast.Subscript) and self.collect:
            self._escape(value, scope, f"stored in {ast.unparse(target.value)}")

    def _on_import(self, node: Any, scope: _Scope) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                if is_npu(a.name):
                    self.refs.append(Reference(a.name, scope.module.file, node.lineno, "import"))
            return
        full = self._resolve_module_name(scope.module, node.module or "", node.level)
        if full.split(".")[0] not in _TOP_MODULES:
            return
        for a in node.names:
            if a.name == "*":
                if is_npu(full) or full in _PREFIXES:
                    key = (scope.module.file, scope.qual, ast.unparse(node))
                    if key in self.allow:
                        self.allow_used.add(key)
                    else:
                        self._unresolved(node, scope, key, f"star import from {full}: which names it binds is unknown")
                continue
            path = f"{full}.{a.name}"
            if is_npu(path):
                self.refs.append(Reference(path, scope.module.file, node.lineno, "import"))

    def _on_attribute(self, node: ast.Attribute, scope: _Scope) -> None:
        parent = getattr(node, "_parent", None)
        if isinstance(node.ctx, ast.Store):
            for v in self.ev(node.value, scope):
                if v[0] == "path" and is_npu(v[1]):
                    self.refs.append(Reference(f"{v[1]}.{node.attr}", scope.module.file, node.lineno, "store"))
            return
        if parent is not None:
            return  # only the outermost attribute of a chain that is not called
        for p in self._npu_refs(node, scope):
            self.refs.append(Reference(p, scope.module.file, node.lineno, "attribute"))

    def _on_call(self, node: ast.Call, scope: _Scope) -> None:
        funcs = self.ev(node.func, scope)
        for v in funcs:  # toolkit callees: arguments flow into their parameters (or dataclass fields)
            self._propagate(v, node, scope)
        if not self.collect:
            return
        if self._is_import_module(node) and node.args:
            name = self._const_str(node.args[0], scope)
            if name is not None and is_npu(name):
                self.refs.append(Reference(name, scope.module.file, node.lineno, "import"))
        forwarded = id(node) in self.param_call_nodes  # checked at each call site of the wrapper instead
        paths = [] if forwarded else sorted(v[1] for v in funcs if v[0] == "path" and is_npu(v[1]))
        for p in paths:
            self.calls.append(self._callsite(p, node, scope))
        for v in [] if forwarded else sorted(v for v in funcs if v[0] == "dyn"):
            self._dyn_call(node, scope, v)
        for v in funcs:
            target = self._callee(v)
            if target is not None:
                for pname, inner in self.templates.get(id(target[0]), []):
                    self._expand_wrapper(node, scope, target[0], target[1], pname, inner)
        has_toolkit = any(self._callee(v) is not None or v[0] == "def" for v in funcs)
        harmless = isinstance(node.func, ast.Name) and node.func.id in _HARMLESS | {"getattr"}
        if not paths and not has_toolkit and not harmless and not forwarded:
            callee = ast.unparse(node.func)
            for a in list(node.args) + [k.value for k in node.keywords]:
                self._escape(a, scope, f"passed to {callee}()")

    def _dyn_call(self, node: ast.Call, scope: _Scope, v: Val) -> None:
        key, line, why = v[1], int(v[2]), v[3]
        self._unresolved(node, scope, key, f"{ast.unparse(node.func)}(...) goes through {why} "
                                           f"(line {line}): cannot tell which API is called")

    @staticmethod
    def _is_import_module(node: ast.Call) -> bool:
        f = node.func
        return isinstance(f, ast.Attribute) and f.attr == "import_module" and isinstance(f.value, ast.Name) \
            and f.value.id == "importlib"

    def _propagate(self, v: Val, node: ast.Call, scope: _Scope) -> None:
        target = self._callee(v)
        if target is not None:
            fs, skip_first = target
            bound = self._bind_args(fs, skip_first, node)[0]
            for name, expr in bound.items():
                self._add(self.param_vals, (fs.module.name, fs.qual, name), self.ev(expr, scope))
            return
        cs = self._record_class(v)
        if cs is not None:
            fields = self._fields(cs)
            for i, a in enumerate(node.args):
                if isinstance(a, ast.Starred) or i >= len(fields):
                    break
                self._add(self.attr_vals, (cs.module.name, cs.qual, fields[i]), self.ev(a, scope))
            for k in node.keywords:
                if k.arg in fields:
                    self._add(self.attr_vals, (cs.module.name, cs.qual, k.arg), self.ev(k.value, scope))

    @staticmethod
    def _bind_args(fs: _Scope, skip_first: bool, node: ast.Call) -> Tuple[Dict[str, ast.AST], List[ast.AST],
                                                                            List[ast.keyword], bool, List[ast.AST]]:
        """How a call's arguments land in ``fs``'s parameters: (bound, extra positionals, extra keywords,
        a ``*`` argument seen, the ``**`` arguments)."""
        positional = fs.params[:fs.n_positional][1 if skip_first else 0:]
        names = set(fs.params[1:] if skip_first else fs.params)
        bound: Dict[str, ast.AST] = {}
        extra_pos: List[ast.AST] = []
        extra_kw: List[ast.keyword] = []
        star = False
        dstar: List[ast.AST] = []
        for i, a in enumerate(node.args):
            if isinstance(a, ast.Starred):
                star = True
                break
            if i < len(positional):
                bound[positional[i]] = a
            else:
                extra_pos.append(a)
        for k in node.keywords:
            if k.arg is None:
                dstar.append(k.value)
            elif k.arg in names:
                bound[k.arg] = k.value
            else:
                extra_kw.append(k)
        return bound, extra_pos, extra_kw, star, dstar

    def _record_class(self, v: Val) -> Optional[_Scope]:
        """A toolkit dataclass / NamedTuple without its own ``__init__`` that a call of ``v`` constructs."""
        s = self._def_scope(v) if v[0] == "def" else None
        if s is None or s.kind != "class" or self._callee(v) is not None:
            return None
        family = [s] + self._bases(s)
        if any("dataclass" in _deco_names(c.node) for c in family) or \
                any(ast.unparse(b).endswith("NamedTuple") for b in s.node.bases):
            return s
        return None

    def _fields(self, cs: _Scope) -> List[str]:
        out: List[str] = []
        for b in reversed(self._bases(cs)):
            out += [f for f in self._fields(b) if f not in out]
        for stmt in cs.node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and \
                    "ClassVar" not in ast.unparse(stmt.annotation) and stmt.target.id not in out:
                out.append(stmt.target.id)
        return out

    def _find_param_calls(self) -> None:
        """Wrappers: a function that calls one of its own parameters (``fn(**kwargs)``).

        Such a call is checked at every call site of the wrapper, with the function passed there and
        the arguments as they arrive (``*args`` / ``**kwargs`` forwarded), not as a union of them all.
        """
        self.templates: Dict[int, List[Tuple[str, ast.Call]]] = {}
        self.param_call_nodes: Set[int] = set()
        for m in self.modules.values():
            for fs in m.defs.values():
                if fs.kind != "function":
                    continue
                for node in _own_nodes(fs.node):
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in fs.params \
                            and all(b[0] == "param" for b in fs.bindings.get(node.func.id, [])):
                        self.templates.setdefault(id(fs), []).append((node.func.id, node))
                        self.param_call_nodes.add(id(node))

    def _expand_wrapper(self, outer: ast.Call, scope: _Scope, fs: _Scope, skip_first: bool, pname: str,
                        inner: ast.Call) -> None:
        bound, extra_pos, extra_kw, star, dstar = self._bind_args(fs, skip_first, outer)
        if pname in bound:
            vals = self.ev(bound[pname], scope)
        else:
            default = next((b[2] for b in fs.bindings.get(pname, []) if b[0] == "param"), None)
            if default is None:
                return
            vals = self.ev(default, fs.parent)
        for v in sorted(v for v in vals if v[0] == "dyn"):
            self._dyn_call(outer, scope, v)
        text = f"{ast.unparse(outer)} -> {ast.unparse(inner)} ({fs.module.file}:{inner.lineno})"

        def kind(a: ast.AST) -> Any:  # a parameter of the wrapper: what the call site passed
            if isinstance(a, ast.Name) and a.id in bound and all(b[0] == "param" for b in fs.bindings.get(a.id, [])):
                return self._kind(bound[a.id], scope)
            return self._kind(a, fs)

        for p in sorted(v[1] for v in vals if v[0] == "path" and is_npu(v[1])):
            site = CallSite(p, scope.module.file, outer.lineno, scope.qual, text)
            for a in inner.args:
                if isinstance(a, ast.Starred):
                    if isinstance(a.value, ast.Name) and a.value.id == fs.vararg:
                        site.positional += [Arg(self._kind(e, scope), ast.unparse(e)) for e in extra_pos]
                        site.star_args = site.star_args or star
                    else:
                        site.star_args = True
                else:
                    site.positional.append(Arg(kind(a), ast.unparse(a)))
            for k in inner.keywords:
                if k.arg is not None:
                    site.keywords[k.arg] = Arg(kind(k.value), ast.unparse(k.value))
                elif isinstance(k.value, ast.Name) and k.value.id == fs.varkw:
                    for ek in extra_kw:
                        site.keywords[ek.arg] = Arg(self._kind(ek.value, scope), ast.unparse(ek.value))
                    for d in dstar:
                        self._expand_dstar(site, d, scope)
                else:
                    self._expand_dstar(site, k.value, fs)
            self.calls.append(site)

    def _expand_dstar(self, site: CallSite, node: ast.AST, scope: _Scope) -> None:
        keys = self._dict_keys(node, scope)
        if keys is None:
            site.star_kwargs = True
            return
        for name, value, vscope in keys:
            site.keywords[name] = Arg(self._kind(value, vscope), ast.unparse(value))

    def _dict_keys(self, node: ast.AST, scope: _Scope, depth: int = 0) -> Optional[List[Tuple[str, ast.AST, _Scope]]]:
        """The keys of a ``**`` argument when they are known statically: a dict display with literal keys,
        ``dict(k=...)``, a name bound once to one of those, or a toolkit function returning one."""
        if depth > 6:
            return None
        if isinstance(node, ast.Dict):
            if all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
                return [(k.value, v, scope) for k, v in zip(node.keys, node.values)]  # type: ignore[union-attr]
            return None
        if isinstance(node, ast.Name):
            bound = _single_binding(scope, node.id)
            return None if bound is None else self._dict_keys(bound[0], bound[1], depth + 1)
        if not isinstance(node, ast.Call):
            return None
        if isinstance(node.func, ast.Name) and node.func.id == "dict" and not self._bound(scope, "dict"):
            if node.args or any(k.arg is None for k in node.keywords):
                return None
            return [(k.arg, k.value, scope) for k in node.keywords]  # type: ignore[misc]
        defs = {s for s in (self._def_scope(v) for v in self.ev(node.func, scope)) if s is not None}
        if len(defs) != 1:
            return None
        fs = defs.pop()
        if fs.kind != "function" or not fs.returns:
            return None
        shapes = [self._dict_keys(r, fs, depth + 1) for r in fs.returns]
        if any(sh is None for sh in shapes) or len({tuple(k for k, _, _ in sh) for sh in shapes}) != 1:  # type: ignore
            return None
        return shapes[0]

    def _const_strs(self, node: ast.AST, scope: _Scope, depth: int = 0) -> Optional[Set[str]]:
        """The strings ``node`` can be when known statically: `_const_str`, either side of ``a if c else b``,
        or any of the strings a name is bound to (when all its bindings are such strings)."""
        if depth > 6:
            return None
        if isinstance(node, ast.IfExp):
            a, b = self._const_strs(node.body, scope, depth + 1), self._const_strs(node.orelse, scope, depth + 1)
            return None if a is None or b is None else a | b
        if isinstance(node, ast.Name):
            s = _binding_scope(scope, node.id)
            bs = s.bindings.get(node.id, []) if s is not None else []
            out: Set[str] = set()
            for b in bs:
                got = self._const_strs(b[1], s, depth + 1) if b[0] == "expr" else None  # type: ignore[arg-type]
                if got is None:
                    return None
                out |= got
            return out or None
        one = self._const_str(node, scope, depth)
        return None if one is None else {one}

    def _const_str(self, node: ast.AST, scope: _Scope, depth: int = 0) -> Optional[str]:
        """A string known statically: a literal, an f-string or ``+`` of such, a name bound once to one."""
        if depth > 6:
            return None
        if isinstance(node, ast.Constant):
            return node.value if isinstance(node.value, str) else None
        if isinstance(node, ast.JoinedStr):
            parts = []
            for v in node.values:
                if isinstance(v, ast.FormattedValue):
                    if v.conversion not in (-1, None) or v.format_spec is not None:
                        return None
                    v = v.value
                part = self._const_str(v, scope, depth + 1)
                if part is None:
                    return None
                parts.append(part)
            return "".join(parts)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            a, b = self._const_str(node.left, scope, depth + 1), self._const_str(node.right, scope, depth + 1)
            return None if a is None or b is None else a + b
        if isinstance(node, ast.Name):
            bound = _single_binding(scope, node.id)
            return None if bound is None else self._const_str(bound[0], bound[1], depth + 1)
        return None

    def _callee(self, v: Val) -> Optional[Tuple[_Scope, bool]]:
        """The toolkit function a call of ``v`` runs, and whether its first parameter is bound (self)."""
        s = self._def_scope(v) if v[0] == "def" else None
        if s is None:
            return None
        if s.kind == "class":
            for c in [s] + self._bases(s):
                for name in ("__init__", "__new__"):
                    init = c.module.defs.get(f"{c.qual}.{name}")
                    if init is not None:
                        return init, True
            return None
        bound = s.cls is not None and "staticmethod" not in s.decorators
        return s, bound

    def _callsite(self, path: str, node: ast.Call, scope: _Scope) -> CallSite:
        site = CallSite(path, scope.module.file, node.lineno, scope.qual, ast.unparse(node))
        for a in node.args:
            if isinstance(a, ast.Starred):
                site.star_args = True
            else:
                site.positional.append(Arg(self._kind(a, scope), ast.unparse(a)))
        for k in node.keywords:
            if k.arg is None:
                self._expand_dstar(site, k.value, scope)
            else:
                site.keywords[k.arg] = Arg(self._kind(k.value, scope), ast.unparse(k.value))
        return site

    def _kind(self, node: ast.AST, scope: _Scope) -> Any:
        kind = _literal_kind(node)
        if kind is None and isinstance(node, ast.Name):
            # a name bound exactly once, to a literal (a module or function constant)
            bound = _single_binding(scope, node.id)
            kind = None if bound is None else _literal_kind(bound[0])
        return kind


def _binding_scope(scope: _Scope, name: str) -> Optional[_Scope]:
    s: Optional[_Scope] = scope
    while s is not None and name not in s.bindings:
        s = s.parent
    return s


def _single_binding(scope: _Scope, name: str) -> Optional[Tuple[ast.AST, _Scope]]:
    """The expression ``name`` is bound to and the scope binding it, when it is bound exactly once, to an expression."""
    s = _binding_scope(scope, name)
    bs = s.bindings.get(name, []) if s is not None else []
    if s is None or len(bs) != 1 or bs[0][0] != "expr":
        return None
    return bs[0][1], s  # type: ignore[return-value]


def _own_nodes(fn: ast.AST) -> Iterable[ast.AST]:
    """The nodes of a function's body, not those of functions, lambdas or classes nested in it."""
    todo = list(fn.body) if isinstance(fn.body, list) else [fn.body]  # type: ignore[attr-defined]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                todo.append(child)


def _link_parents(tree: ast.AST) -> None:
    """Marks the ``.value`` of an Attribute and the ``.func`` of a Call (not outermost chain links)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            node.value._parent = node  # type: ignore[attr-defined]
        elif isinstance(node, ast.Call):
            node.func._parent = node  # type: ignore[attr-defined]
            if isinstance(node.func, ast.Name) and node.func.id in _HARMLESS:
                for a in node.args:
                    a._harmless_arg = True  # type: ignore[attr-defined]


def discover(sources: Dict[str, str], allow: Optional[Dict[AllowKey, Tuple[Sequence[str], str]]] = None) -> Discovery:
    """Every NPU call, reference and unresolvable site in ``sources`` (``{relative path: text}``)."""
    an = _Analysis(sources, allow or {})
    for m in an.modules.values():
        _link_parents(m.tree)
    return an.run()


# ---- the wheel ----------------------------------------------------------------------------------

@dataclass
class Param:
    name: str
    kind: str  # "posonly", "pos", "kwonly", "varargs", "varkw"
    required: bool
    type: Optional[str] = None  # schema type or annotation text
    accepts: Optional[Set[str]] = None  # literal kinds that fit (Python functions); None: not checked
    default: Optional[str] = None  # source text of the default

    def describe(self) -> str:
        if self.type:
            return self.type
        return f"the type of its default {self.default}" if self.default else "its type"


@dataclass
class Signature:
    params: List[Param]
    origin: str
    schema: bool = False  # a native operator schema (types checked the schema way)

    def names(self) -> str:
        return ", ".join(p.name for p in self.params if p.kind not in ("varargs", "varkw"))


_ALIAS = re.compile(r"\([^()]*\)")


def _split_top(text: str) -> List[str]:
    out, depth, cur, quote = [], 0, [], ""
    for ch in text:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = ""
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def parse_schema(text: str) -> Tuple[str, str, Signature]:
    """``("npu_grouped_matmul", "List", Signature)`` from ``npu_grouped_matmul.List(Tensor[] x, ...) -> Tensor[]``."""
    text = " ".join(text.split())
    head, sep, rest = text.partition("(")
    if not sep:
        raise ValueError(f"not an operator schema: {text!r}")
    depth, end = 1, None
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    if end is None:
        raise ValueError(f"unbalanced operator schema: {text!r}")
    name, _, overload = head.strip().split("::")[-1].partition(".")
    params, kwonly = [], False
    for item in _split_top(rest[:end]):
        if item == "*":
            kwonly = True
            continue
        decl, eq, default = item.partition("=")
        typ, _, pname = _ALIAS.sub("", decl).strip().rpartition(" ")
        params.append(Param(pname.strip(), "kwonly" if kwonly else "pos", not eq, typ.strip(),
                            default=default.strip() if eq else None))
    return name, overload, Signature(params, text, schema=True)


def _schema_type(t: str) -> Tuple[bool, Optional[Tuple[str, str]], str]:
    """(optional, (element type, size) for a list, base type)."""
    t = _ALIAS.sub("", t).strip()
    optional = t.endswith("?")
    t = t.rstrip("?")
    m = re.match(r"^(.*)\[(\d*)\]$", t)
    if m:
        return optional, (m.group(1), m.group(2)), "list"
    return optional, None, t


_INT_LIKE = {"int", "SymInt"}
_SCHEMA_FITS = {
    "bool": {"bool", "Scalar"},
    "int": {"int", "SymInt", "float", "SymFloat", "Scalar", "ScalarType", "Layout", "MemoryFormat", "Device"},
    "float": {"float", "SymFloat", "Scalar"},
    "str": {"str", "Device", "Dimname", "c10::string_view"},
}
_SCHEMA_KNOWN = {"Tensor", "bool", "int", "SymInt", "float", "SymFloat", "Scalar", "ScalarType", "Layout",
                 "MemoryFormat", "Device", "str", "Dimname", "Generator", "Storage", "Stream", "c10::string_view"}


def schema_accepts(t: str, kind: Any) -> bool:
    """Whether a literal of ``kind`` fits the operator schema type ``t``."""
    if kind is None:
        return True
    optional, lst, base = _schema_type(t)
    if base in ("Any", "t") or (base not in _SCHEMA_KNOWN and lst is None):
        return True
    if kind == "None":
        return optional
    if lst is not None:
        elem, size = lst
        if isinstance(kind, tuple):
            return all(schema_accepts(elem, k) for k in kind[1])
        return kind == "int" and bool(size) and _schema_type(elem)[2] in _INT_LIKE
    if isinstance(kind, tuple):
        return False
    return base in _SCHEMA_FITS.get(kind, set())


_ANN_KINDS = {
    "int": {"int", "bool"}, "float": {"float", "int", "bool"}, "bool": {"bool"}, "str": {"str"},
    "bytes": {"bytes"}, "None": {"None"}, "NoneType": {"None"},
    "list": {"list"}, "List": {"list"}, "Sequence": {"list"}, "tuple": {"list"}, "Tuple": {"list"},
    "Iterable": {"list", "str", "dict", "set"}, "MutableSequence": {"list"},
    "dict": {"dict"}, "Dict": {"dict"}, "Mapping": {"dict"}, "set": {"set"}, "Set": {"set"},
    "FrozenSet": {"set"}, "Tensor": set(),
}
_DEFAULT_KINDS = {"int": {"int", "bool"}, "float": {"float", "int", "bool"}, "bool": {"bool", "int"}, "str": {"str"}}


def annotation_kinds(node: Optional[ast.AST]) -> Optional[Set[str]]:
    """The literal kinds a Python annotation admits; None when it admits anything (or is not understood)."""
    if node is None:
        return None
    if isinstance(node, ast.Constant):
        if node.value is None:
            return {"None"}
        if isinstance(node.value, str):
            try:
                return annotation_kinds(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                return None
        return None
    if isinstance(node, (ast.Name, ast.Attribute)):
        name = node.id if isinstance(node, ast.Name) else node.attr
        kinds = _ANN_KINDS.get(name)
        return set(kinds) if kinds is not None else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        a, b = annotation_kinds(node.left), annotation_kinds(node.right)
        return None if a is None or b is None else a | b
    if isinstance(node, ast.Subscript):
        outer = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
        inner = node.slice
        elts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
        if outer == "Optional":
            k = annotation_kinds(elts[0])
            return None if k is None else k | {"None"}
        if outer == "Union":
            out: Set[str] = set()
            for e in elts:
                k = annotation_kinds(e)
                if k is None:
                    return None
                out |= k
            return out
        if outer == "Literal":
            return {kind_name(_literal_kind(e)) for e in elts}
        return annotation_kinds(node.value)
    return None


def python_accepts(p: Param, kind: Any) -> bool:
    return kind is None or p.accepts is None or kind_name(kind) in p.accepts


def _signature(fn: Any, origin: str, bound: bool) -> Signature:
    a = fn.args
    params: List[Param] = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)

    def make(arg: ast.arg, kind: str, default: Optional[ast.AST]) -> Param:
        accepts = annotation_kinds(arg.annotation)
        if arg.annotation is None and default is not None:
            dk = _literal_kind(default)
            accepts = set(_DEFAULT_KINDS[dk]) if dk in _DEFAULT_KINDS else None
        text = ast.unparse(arg.annotation) if arg.annotation is not None else None
        return Param(arg.arg, kind, default is None, text, accepts,
                     ast.unparse(default) if default is not None else None)

    for i, (arg, d) in enumerate(zip(positional, defaults)):
        params.append(make(arg, "posonly" if i < len(a.posonlyargs) else "pos", d))
    if a.vararg is not None:
        params.append(Param(a.vararg.arg, "varargs", False))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append(make(arg, "kwonly", d))
    if a.kwarg is not None:
        params.append(Param(a.kwarg.arg, "varkw", False))
    if bound and params and params[0].kind in ("pos", "posonly"):
        params = params[1:]
    return Signature(params, origin)


def check_signature(sig: Signature, call: CallSite) -> List[str]:
    """What is wrong with ``call`` against ``sig`` (empty: it fits)."""
    problems = []
    positional = [p for p in sig.params if p.kind in ("posonly", "pos")]
    varargs = any(p.kind == "varargs" for p in sig.params)
    varkw = any(p.kind == "varkw" for p in sig.params)
    by_name = {p.name: p for p in sig.params if p.kind in ("pos", "kwonly")}
    if not varargs and len(call.positional) > len(positional):
        problems.append(f"{len(call.positional)} positional arguments, at most {len(positional)} "
                        f"({', '.join(p.name for p in positional) or 'none'})")
    given = {p.name for p in positional[:len(call.positional)]}
    for name, arg in call.keywords.items():
        p = by_name.get(name)
        if p is None:
            if not varkw:
                problems.append(f"keyword {name!r} is not an argument (arguments: {sig.names() or 'none'})")
            continue
        if name in given:
            problems.append(f"argument {name!r} given both by position and by keyword")
        given.add(name)
        if not _fits(sig, p, arg.kind):
            problems.append(f"{name}={arg.text}: {_a(arg.kind)} does not fit {p.describe()}")
    for p, arg in zip(positional, call.positional):
        if not _fits(sig, p, arg.kind):
            problems.append(f"argument {p.name} = {arg.text}: {_a(arg.kind)} does not fit {p.describe()}")
    if not call.star_args and not call.star_kwargs:
        missing = [p.name for p in sig.params if p.required and p.kind in ("posonly", "pos", "kwonly")
                   and p.name not in given]
        if missing:
            problems.append(f"missing required argument(s) {', '.join(missing)}")
    return problems


def _a(kind: Any) -> str:
    name = kind_name(kind)
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _fits(sig: Signature, p: Param, kind: Any) -> bool:
    return schema_accepts(p.type or "", kind) if sig.schema else python_accepts(p, kind)


# objects the wheel side resolves a path to
@dataclass(frozen=True)
class _Obj:
    kind: str  # module, function, class, instance, opns, oppacket, opoverload, opaque, value
    name: str
    module: str = ""
    node: Any = None
    bound: bool = False
    extra: Any = None


class PathError(Exception):
    """The path does not resolve: ``missing`` says it names nothing in the wheel, else it is unknowable."""

    def __init__(self, msg: str, missing: bool):
        super().__init__(msg)
        self.missing = missing


@dataclass
class Verdict:
    call: Any  # CallSite or Reference
    status: str  # "ok", "exists" (no signature to check), "tensor" (a method of an operator's result: torch's),
    #              "error" (does not match the wheel), "unknown" (cannot be checked against it)
    problems: List[str]
    origin: str = ""


class _WheelModule:
    def __init__(self, name: str, entry: str, tree: ast.Module):
        self.name, self.entry, self.tree = name, entry, tree
        self.is_package = entry.endswith("__init__.py")
        self.bindings: Dict[str, List[Tuple[Any, ...]]] = {}
        self.stars: List[Tuple[str, int]] = []
        self.all: Optional[List[str]] = None
        self._collect(tree.body)

    def _collect(self, body: List[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.bindings.setdefault(stmt.name, []).append(("node", stmt))
            elif isinstance(stmt, ast.Import):
                for a in stmt.names:
                    if a.asname:
                        self.bindings.setdefault(a.asname, []).append(("module", a.name, 0))
                    else:
                        top = a.name.split(".")[0]
                        self.bindings.setdefault(top, []).append(("module", top, 0))
            elif isinstance(stmt, ast.ImportFrom):
                for a in stmt.names:
                    if a.name == "*":
                        self.stars.append((stmt.module or "", stmt.level))
                    else:
                        self.bindings.setdefault(a.asname or a.name, []).append(
                            ("from", stmt.module or "", a.name, stmt.level))
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        self.bindings.setdefault(t.id, []).append(("expr", stmt.value))
                        if t.id == "__all__":
                            try:
                                self.all = list(ast.literal_eval(stmt.value))
                            except Exception:  # not a literal list
                                pass
            elif isinstance(stmt, (ast.If, ast.Try)):
                self._collect(stmt.body)
                for h in getattr(stmt, "handlers", []):
                    self._collect(h.body)
                self._collect(stmt.orelse)
                self._collect(getattr(stmt, "finalbody", []))

    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


class Wheel:
    """The schemas of one torch_npu wheel: native operators and the Python APIs, read from the zip."""

    def __init__(self, path: str):
        self.path = path
        self.zip = zipfile.ZipFile(path)
        self.entries = set(self.zip.namelist())
        self._modules: Dict[str, Optional[_WheelModule]] = {}
        self.ops: Dict[str, Dict[str, Dict[str, Signature]]] = {}
        self.op_sources: Dict[str, str] = {}
        self._read_yaml()
        self._read_library_defines()
        self._busy: Set[Any] = set()

    def close(self) -> None:
        self.zip.close()

    # -- operators
    def _add_op(self, ns: str, schema: str, origin: str) -> None:
        name, overload, sig = parse_schema(schema)
        sig.origin = f"{ns}::{' '.join(schema.split())} [{origin}]"
        self.ops.setdefault(ns, {}).setdefault(name, {})[overload] = sig

    def _read_yaml(self) -> None:
        for entry in sorted(self.entries):
            if not (entry.startswith("torch_npu/") and entry.endswith((".yaml", ".yml"))):
                continue
            lines = self.zip.read(entry).decode("utf-8", "replace").splitlines()
            i = 0
            while i < len(lines):
                m = re.match(r"^\s*(?:-\s+)?func:\s*(.*)$", lines[i])
                i += 1
                if not m or "(" not in m.group(1):
                    continue
                text = m.group(1).strip().strip("'\"")
                while text.count("(") > text.count(")") and i < len(lines):  # a folded long line
                    text += " " + lines[i].strip()
                    i += 1
                self._add_op("npu", text, entry)

    def _read_library_defines(self) -> None:
        """Every ``<Library>.define("schema")`` and ``torch.library.define("ns::schema")`` in the Python sources."""
        libs: Dict[Tuple[str, str], str] = {}  # (module, variable) -> namespace
        defines: List[Tuple[str, str, ast.Call, str]] = []
        for entry in sorted(self.entries):
            if not (entry.startswith("torch_npu/") and entry.endswith(".py")):
                continue
            text = self.zip.read(entry).decode("utf-8", "replace")
            if "Library(" not in text and ".define(" not in text:
                continue
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            modname = self._entry_module(entry)
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                    f = node.value.func
                    fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                    args = node.value.args
                    if fname == "Library" and args and isinstance(args[0], ast.Constant):
                        for t in node.targets:
                            if isinstance(t, ast.Name):
                                libs[(modname, t.id)] = args[0].value
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "define":
                    defines.append((modname, entry, node, ast.unparse(node.func.value)))
            for node in ast.walk(tree):  # `from ._lib import lib` : the variable of another module
                if isinstance(node, ast.ImportFrom):
                    src = self._relative(modname, entry.endswith("__init__.py"), node.module or "", node.level)
                    for a in node.names:
                        libs.setdefault((modname, a.asname or a.name), f"@{src}:{a.name}")
        for modname, entry, node, receiver in defines:
            if not node.args:
                continue
            try:
                schema = ast.literal_eval(node.args[0])
            except ValueError:
                continue
            if not isinstance(schema, str):
                continue
            ns = None
            if "::" in schema.split("(")[0]:
                ns = schema.split("::")[0].strip()
            else:
                ns = libs.get((modname, receiver))
                for _ in range(5):
                    if ns is None or not ns.startswith("@"):
                        break
                    src, _, var = ns[1:].partition(":")
                    ns = libs.get((src, var))
            if ns and not ns.startswith("@"):
                try:
                    self._add_op(ns, schema.strip(), entry)
                except ValueError:
                    continue

    # -- modules
    @staticmethod
    def _entry_module(entry: str) -> str:
        name, _ = module_name(entry)
        for pkg in _DYNAMO_PACKAGES:
            prefix = f"torch_npu.dynamo.{pkg}"
            if name == prefix or name.startswith(prefix + "."):
                return pkg + name[len(prefix):]
        return name

    @staticmethod
    def _relative(modname: str, is_package: bool, name: str, level: int) -> str:
        if not level:
            return name
        base = (modname if is_package else modname.rpartition(".")[0]).split(".")
        if level > 1:
            base = base[: len(base) - (level - 1)]
        return ".".join([p for p in base if p] + ([name] if name else []))

    def _entry_of(self, modname: str) -> Tuple[Optional[str], bool]:
        """(zip entry of ``modname``'s source, whether it is a native extension) for a module in the wheel."""
        parts = modname.split(".")
        if parts[0] in _DYNAMO_PACKAGES:
            parts = ["torch_npu", "dynamo"] + parts
        elif parts[0] != "torch_npu":
            return None, False
        base = "/".join(parts)
        for cand in (base + ".py", base + "/__init__.py"):
            if cand in self.entries:
                return cand, False
        if any(e.startswith(base + ".") and e.endswith((".so", ".pyd")) for e in self.entries):
            return None, True
        return None, False

    def module(self, modname: str) -> Optional[_WheelModule]:
        if modname not in self._modules:
            entry, _ = self._entry_of(modname)
            mod = None
            if entry is not None:
                try:
                    mod = _WheelModule(modname, entry, ast.parse(self.zip.read(entry).decode("utf-8", "replace")))
                except SyntaxError:
                    mod = None
            self._modules[modname] = mod
        return self._modules[modname]

    def _module_obj(self, modname: str) -> _Obj:
        if self.module(modname) is not None:
            return _Obj("module", modname, modname)
        entry, native = self._entry_of(modname)
        if native:
            return _Obj("opaque", f"{modname} (native extension)")
        top = modname.split(".")[0]
        if top in ("torch_npu",) + _DYNAMO_PACKAGES:
            raise PathError(f"no module {modname} in the wheel", True)
        return _Obj("opaque", f"{modname} (outside the wheel)")

    def _lazy_symbols(self) -> Dict[str, Tuple[str, str]]:
        m = self.module("torch_npu._init.core._exports")
        if m is None or "_LAZY_PYTHON_SYMBOLS" not in m.bindings:
            return {}
        try:
            return dict(ast.literal_eval(m.bindings["_LAZY_PYTHON_SYMBOLS"][-1][1]))
        except (ValueError, TypeError):
            return {}

    def _mod_attr(self, modname: str, name: str) -> _Obj:
        key = ("attr", modname, name)
        if key in self._busy:
            raise PathError(f"{modname}.{name}: circular definition", False)
        self._busy.add(key)
        try:
            return self._mod_attr_inner(modname, name)
        finally:
            self._busy.discard(key)

    def _mod_attr_inner(self, modname: str, name: str) -> _Obj:
        m = self.module(modname)
        if m is None:
            raise PathError(f"{modname}: not a Python module of the wheel", False)
        if name in m.bindings:
            error: Optional[PathError] = None
            for b in reversed(m.bindings[name]):  # the last binding wins; an earlier one if it cannot be read
                try:
                    return self._binding_obj(m, b)
                except PathError as exc:
                    error = error or exc
            raise error  # type: ignore[misc]
        for star, level in reversed(m.stars):
            src = self._relative(m.name, m.is_package, star, level)
            sm = self.module(src)
            if sm is None:
                continue
            exported = sm.all if sm.all is not None else [n for n in sm.bindings if not n.startswith("_")]
            if name in exported:
                return self._mod_attr(src, name)
        sub = f"{modname}.{name}"
        entry, native = self._entry_of(sub)
        if entry is not None or native:
            return self._module_obj(sub)
        if modname == "torch_npu":
            if name in self.ops.get("npu", {}):
                return _Obj("oppacket", name, extra="npu")
            lazy = self._lazy_symbols()
            if name in lazy:
                return self._mod_attr(*lazy[name])
        if "__getattr__" in m.bindings:
            raise PathError(f"{modname}.{name}: not defined in {m.entry}, which has a module __getattr__", False)
        raise PathError(f"{modname} has no attribute {name!r} ({m.entry})", True)

    def _binding_obj(self, m: _WheelModule, b: Tuple[Any, ...]) -> _Obj:
        if b[0] == "node":
            node = b[1]
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            return _Obj(kind, f"{m.name}.{node.name}", m.name, node)
        if b[0] == "module":
            return self._module_obj(b[1])
        if b[0] == "from":
            src = self._relative(m.name, m.is_package, b[1], b[3])
            if self.module(src) is not None:
                return self._mod_attr(src, b[2])
            sub = f"{src}.{b[2]}"
            if any(self._entry_of(sub)):
                return self._module_obj(sub)
            return _Obj("opaque", f"{sub} (native)") if self._entry_of(src)[1] else self._module_obj(sub)
        if b[0] == "expr":
            return self._eval(m, b[1])
        raise PathError("unknown binding", False)

    def _eval(self, m: _WheelModule, node: ast.AST, local: Optional[Dict[str, _Obj]] = None) -> _Obj:
        if isinstance(node, ast.Name):
            if local and node.id in local:
                return local[node.id]
            return self._mod_attr(m.name, node.id)
        if isinstance(node, ast.Attribute):
            return self.attr(self._eval(m, node.value, local), node.attr)
        if isinstance(node, ast.Call):
            return self.result(self._eval(m, node.func, local))
        return _Obj("value", ast.unparse(node)[:60])

    # -- classes
    def _class_mro(self, cls: _Obj) -> Tuple[List[_Obj], Optional[str]]:
        """Python classes of ``cls``'s MRO (depth first) and the first base that is not Python source, if any."""
        out, foreign, todo = [], None, [cls]
        while todo:
            c = todo.pop(0)
            if c in out:
                continue
            out.append(c)
            m = self.module(c.module)
            for b in c.node.bases:
                if isinstance(b, ast.Name) and b.id == "object":
                    continue
                try:
                    bo = self._eval(m, b)
                except PathError:
                    bo = _Obj("opaque", ast.unparse(b))
                if bo.kind == "class":
                    todo.append(bo)
                elif foreign is None:
                    foreign = ast.unparse(b)
        return out, foreign

    @staticmethod
    def _class_body(cls: _Obj) -> Dict[str, ast.AST]:
        out: Dict[str, ast.AST] = {}
        for stmt in cls.node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if isinstance(stmt, ast.ClassDef) or "setter" not in "".join(_deco_names(stmt)):
                    out.setdefault(stmt.name, stmt)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]):
                    if isinstance(t, ast.Name):
                        out.setdefault(t.id, stmt)
        return out

    @staticmethod
    def _instance_attrs(cls: _Obj) -> Set[str]:
        out = set()
        for node in ast.walk(cls.node):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "self":
                out.add(node.attr)
        slots = Wheel._class_body(cls).get("__slots__")
        if isinstance(slots, ast.Assign):
            try:
                out |= set(ast.literal_eval(slots.value))
            except ValueError:
                pass
        return out

    def _member(self, cls: _Obj, name: str, instance: bool) -> _Obj:
        mro, foreign = self._class_mro(cls)
        for c in mro:
            body = self._class_body(c)
            if name in body:
                node = body[name]
                if isinstance(node, ast.ClassDef):
                    return _Obj("class", f"{c.name}.{name}", c.module, node)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    decos = _deco_names(node)
                    if "property" in decos or "cached_property" in decos:
                        return self._returned(_Obj("function", f"{c.name}.{name}", c.module, node, bound=True))
                    static = "staticmethod" in decos
                    bound = not static and (instance or "classmethod" in decos)
                    return _Obj("function", f"{c.name}.{name}", c.module, node, bound=bound)
                return _Obj("value", f"{c.name}.{name}")
            if instance and name in self._instance_attrs(c):
                return _Obj("value", f"{c.name}().{name}")
        if foreign is not None:
            raise PathError(f"{cls.name} has no Python attribute {name!r}; its base {foreign} may define it natively",
                            False)
        if name.startswith("__") and name.endswith("__"):
            return _Obj("opaque", f"{cls.name}.{name} (object)")
        raise PathError(f"{cls.name} has no attribute {name!r}", True)

    def _constructor(self, cls: _Obj) -> Optional[Signature]:
        mro, foreign = self._class_mro(cls)
        for c in mro:
            body = self._class_body(c)
            for special in ("__init__", "__new__"):
                fn = body.get(special)
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    m = self.module(c.module)
                    return _signature(fn, f"{c.name}.{special} ({m.entry}:{fn.lineno})", bound=True)
            if "dataclass" in _deco_names(c.node):
                params = []
                for stmt in c.node.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                        params.append(Param(stmt.target.id, "pos", stmt.value is None, ast.unparse(stmt.annotation),
                                            annotation_kinds(stmt.annotation),
                                            ast.unparse(stmt.value) if stmt.value is not None else None))
                return Signature(params, f"{c.name} (dataclass)")
        if foreign is not None:
            return None
        return Signature([], f"{cls.name} (object)")

    # -- generic operations
    def attr(self, obj: _Obj, name: str) -> _Obj:
        if obj.kind == "tensor":
            return obj
        if obj.kind == "module":
            return self._mod_attr(obj.module, name)
        if obj.kind == "class":
            return self._member(obj, name, instance=False)
        if obj.kind == "instance":
            return self._member(obj.extra, name, instance=True)
        if obj.kind == "opns":
            if name in self.ops.get(obj.name, {}):
                return _Obj("oppacket", name, extra=obj.name)
            raise PathError(f"torch.ops.{obj.name} has no operator {name!r} in the wheel", True)
        if obj.kind == "oppacket":
            overloads = self.ops[obj.extra][obj.name]
            ov = "" if name == "default" else name
            if ov in overloads:
                return _Obj("opoverload", f"{obj.name}.{name}", extra=(obj.extra, obj.name, ov))
            raise PathError(f"{obj.extra}::{obj.name} has no overload {name!r} "
                            f"(overloads: {', '.join(o or 'default' for o in overloads)})", True)
        if obj.kind == "opaque":
            return _Obj("opaque", f"{obj.name}.{name}")
        raise PathError(f"{obj.name}.{name}: attribute of a value the wheel's sources do not describe", False)

    def _returned(self, fn: _Obj) -> _Obj:
        """What calling the function ``fn`` gives: an instance when its class can be inferred."""
        node, m = fn.node, self.module(fn.module)
        key = ("returns", fn.name)
        if key in self._busy:
            return _Obj("value", f"{fn.name}()")
        self._busy.add(key)
        try:
            if node.returns is not None and ast.unparse(node.returns).strip("'\"").endswith("Tensor"):
                return _Obj("tensor", f"{fn.name}()")
            if node.returns is not None:
                try:
                    o = self._eval(m, node.returns if not isinstance(node.returns, ast.Constant) else
                                   ast.parse(str(node.returns.value), mode="eval").body)
                    if o.kind == "class":
                        return _Obj("instance", f"{o.name}()", extra=o)
                except (PathError, SyntaxError):
                    pass
            found: Set[_Obj] = set()
            for sub in ast.walk(node):
                if isinstance(sub, ast.Return) and sub.value is not None:
                    if not isinstance(sub.value, ast.Call):
                        return _Obj("value", f"{fn.name}()")
                    try:
                        callee = self._eval(m, sub.value.func)
                    except PathError:
                        return _Obj("value", f"{fn.name}()")
                    if callee.kind != "class":
                        return _Obj("value", f"{fn.name}()")
                    found.add(callee)
            if len(found) == 1:
                c = found.pop()
                return _Obj("instance", f"{c.name}()", extra=c)
            return _Obj("value", f"{fn.name}()")
        finally:
            self._busy.discard(key)

    def result(self, obj: _Obj) -> _Obj:
        if obj.kind in ("oppacket", "opoverload", "tensor"):
            return _Obj("tensor", f"{obj.name}()")
        if obj.kind == "class":
            return _Obj("instance", f"{obj.name}()", extra=obj)
        if obj.kind == "function":
            return self._returned(obj)
        if obj.kind == "instance":
            return self.result(self._member(obj.extra, "__call__", instance=True))
        if obj.kind == "opaque":
            return _Obj("opaque", f"{obj.name}()")
        return _Obj("value", f"{obj.name}()")

    def signatures(self, obj: _Obj) -> Optional[List[Signature]]:
        """The signatures a call of ``obj`` may match (any one suffices); None when they are unknown."""
        if obj.kind == "function":
            m = self.module(obj.module)
            return [_signature(obj.node, f"{obj.name} ({m.entry}:{obj.node.lineno})", obj.bound)]
        if obj.kind == "class":
            sig = self._constructor(obj)
            return None if sig is None else [sig]
        if obj.kind == "oppacket":
            return list(self.ops[obj.extra][obj.name].values())
        if obj.kind == "opoverload":
            ns, name, ov = obj.extra
            return [self.ops[ns][name][ov]]
        if obj.kind == "instance":
            return self.signatures(self._member(obj.extra, "__call__", instance=True))
        if obj.kind == "module":
            raise PathError(f"module {obj.name} is not callable", True)
        return None

    def resolve(self, path: str) -> _Obj:
        segs = re.findall(r"[^.()]+|\(\)", path)
        if segs[:2] == ["torch", "npu"]:
            obj, rest = self._module_obj("torch_npu.npu"), segs[2:]
        elif segs[:2] == ["torch", "ops"] and len(segs) >= 3:
            obj, rest = _Obj("opns", segs[2]), segs[3:]
            if segs[2] not in self.ops:
                raise PathError(f"the wheel defines no operator namespace {segs[2]!r}", True)
        elif segs[0] in ("torch_npu",) + _DYNAMO_PACKAGES:
            obj, rest = self._module_obj(segs[0]), segs[1:]
        else:
            raise PathError(f"{path}: not a torch_npu / torchair path", False)
        for s in rest:
            obj = self.result(obj) if s == "()" else self.attr(obj, s)
        return obj

    def check(self, item: Any) -> Verdict:
        """Verdict for one CallSite (callable with these arguments) or Reference (exists)."""
        try:
            obj = self.resolve(item.path)
            if obj.kind == "tensor":  # an operator's result: torch's Tensor API, not torch_npu's
                return Verdict(item, "tensor", [], obj.name)
            if isinstance(item, Reference):
                return Verdict(item, "ok" if obj.kind != "opaque" else "exists", [], obj.name)
            sigs = self.signatures(obj)
        except PathError as exc:
            return Verdict(item, "error" if exc.missing else "unknown", [str(exc)])
        if sigs is None:
            return Verdict(item, "exists", [], f"{obj.name}: no Python signature (native or foreign)")
        tried = []
        for sig in sigs:
            problems = check_signature(sig, item)
            if not problems:
                return Verdict(item, "ok", [], sig.origin)
            tried.append((sig, problems))
        if len(tried) == 1:
            return Verdict(item, "error", [f"{p} [{tried[0][0].origin}]" for p in tried[0][1]], tried[0][0].origin)
        return Verdict(item, "error", ["no overload fits: " + "; ".join(
            f"{s.origin}: {' / '.join(ps)}" for s, ps in tried)], "")


def check_all(wheel: Wheel, found: Discovery) -> List[Verdict]:
    return [wheel.check(c) for c in found.calls] + [wheel.check(r) for r in found.references]


def format_verdicts(verdicts: List[Verdict]) -> str:
    lines = []
    for v in verdicts:
        item = v.call
        what = "call" if isinstance(item, CallSite) else item.kind
        line = f"{v.status:7} {item.where:40} {what:9} {item.path}"
        if v.problems:
            line += "\n" + "\n".join(f"          - {p}" for p in v.problems)
        lines.append(line)
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """``python tests/tools/npu_schema.py [WHEEL]``: every NPU call of the toolkit and its verdict against WHEEL
    (by default the wheel `torchair_contract.find_wheel` gives for the installed torch)."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(tests)
    if tests not in sys.path:  # run as a script: sys.path[0] is tests/tools, and `tools` lives in tests/
        sys.path.insert(0, tests)
    from tools.npu_allow import ALLOW

    if argv[:1] in (["-h"], ["--help"]) or len(argv) > 1:
        print("usage: python tests/tools/npu_schema.py [WHEEL]\n\nEvery torch_npu / torchair call of the toolkit "
              "and its verdict against WHEEL (default: the torch_npu wheel for the installed torch, fetched "
              "into the cache of tests/tools/torchair_contract.py); exit status 1 when a call does not match.")
        return 0 if len(argv) == 1 else 2
    if argv:
        wheel_file = argv[0]
        if not os.path.isfile(wheel_file):
            print(f"npu_schema: {wheel_file}: no such wheel file", file=sys.stderr)
            return 2
    else:
        from tools import torchair_contract

        try:
            wheel_file = torchair_contract.find_wheel()
        except RuntimeError as e:
            print(f"npu_schema: no torch_npu wheel given and none to fetch: {e}", file=sys.stderr)
            return 2
    found = discover(toolkit_sources(root), ALLOW)
    wheel = Wheel(wheel_file)
    verdicts = check_all(wheel, found)
    print(f"{os.path.basename(wheel_file)}: {len(found.calls)} calls, {len(found.references)} references")
    print(format_verdicts(verdicts))
    for u in found.unresolved:
        print(f"UNRESOLVED {u}")
    bad = [v for v in verdicts if v.status in ("error", "unknown")] + found.unresolved
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
