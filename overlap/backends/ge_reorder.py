"""The GE reorder hazard, found on an FX graph traced on the ``ge`` path, and the pass that removes it.

On the ``ge`` path a side stream is a scope of the graph (``air.scope_enter`` with ``_user_stream_label`` ...
``air.scope_exit``, what ``torchair.scope.npu_stream_switch`` leaves in it). GE issues the graph in an order of
its own: a cheap consumer of a side output (a cast, ``silu``, ``sigmoid``, a reshape, a multiply by a scalar)
placed on the main stream may be issued there ahead of the main path's long operation (the *dominator*, a
matmul with no data path to or from the side work); the main stream then waits for the side stream before it
reaches the dominator, and the two run one after the other with the streams looking right.

`ge_hazards` lists, for every side-stream output whose first main-stream consumer is cheap and could be issued
ahead of a dominator (no data path from the dominator to it), the output, the consumer and its operation, and
the dominator. `pin_cheap_consumers` moves such consumers into their side scope (just before its
``scope_exit``, where all their inputs are defined), so the side stream computes them: the outputs are the same,
and `ge_hazards` then finds none. `GeBackend` applies it to every graph it compiles unless its
``pin_cheap_consumers`` is off.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..context import DEFAULT

STREAM_LABEL = "_user_stream_label"
# what GE pulls onto the consuming stream: casts, activations, shape changes (aten, torch and method names)
_CHEAP = frozenset({"to", "_to_copy", "type", "float", "half", "bfloat16", "type_as", "convert_element_type",
                    "silu", "sigmoid", "relu", "gelu", "tanh", "exp", "neg", "swish", "npu_swiglu", "softmax",
                    "view", "reshape", "_unsafe_view", "flatten", "unsqueeze", "squeeze", "transpose", "permute",
                    "contiguous", "expand", "t", "clone"})
# cheap only with a scalar or a broadcast operand (two tensors of one shape are a join, not a precompute)
_ELEMENTWISE = frozenset({"mul", "add", "sub", "div", "truediv", "iadd", "imul"})
_HEAVY = frozenset({"mm", "matmul", "bmm", "addmm", "baddbmm", "linear", "einsum", "conv1d", "conv2d", "convolution",
                    "scaled_dot_product_attention", "npu_grouped_matmul", "grouped_mm", "_grouped_mm",
                    "npu_fused_infer_attention_score", "matmul_"})
_MAX_ROUNDS = 16  # a chain of cheap consumers (cast, then silu ...) is pinned one link a round


@dataclasses.dataclass(frozen=True)
class Hazard:
    """A side output whose cheap main-stream consumer GE may issue ahead of the main stream's dominator."""

    output: str  # the side node whose value is consumed
    stream: str
    consumer: str  # the main-stream node
    operation: str  # what the consumer computes (silu, to, view ...)
    dominator: str  # the main-stream node it may be issued ahead of

    def __str__(self) -> str:
        return (f"{self.consumer} ({self.operation}) reads {self.output} of the {self.stream!r} stream on the main "
                f"stream and may be issued ahead of {self.dominator}: compute it inside the side scope")


def _air_op(node: torch.fx.Node) -> Optional[str]:
    """``"scope_enter"`` etc. for a ``torch.ops.air`` call, else None."""
    if node.op != "call_function":
        return None
    target = node.target
    name = target.name() if isinstance(target, torch._ops.OpOverload) else getattr(target, "_qualified_op_name", "")
    namespace, _, op = str(name).partition("::")
    return op.split(".")[0] if namespace == "air" else None


def operation_of(node: torch.fx.Node) -> str:
    """The name of what ``node`` computes: ``silu``, ``to``, ``mm`` ... (aten overloads, torch functions, methods)."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.partition("::")[2]  # type: ignore[attr-defined]
    return str(getattr(target, "__name__", target)).rstrip("_") or str(target)


def _shape(node: Any) -> Optional[Tuple[int, ...]]:
    if not isinstance(node, torch.fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def is_cheap(node: torch.fx.Node) -> bool:
    """A cast, an activation, a shape change, or an elementwise op with a scalar or a broadcast operand."""
    if node.op not in ("call_function", "call_method") or _air_op(node) is not None:
        return False
    name = operation_of(node)
    if name in _CHEAP:
        return True
    if name in _ELEMENTWISE or node.target in (operator.mul, operator.add, operator.sub, operator.truediv):
        operands = list(node.args[:2])
        if any(not isinstance(a, torch.fx.Node) for a in operands):
            return True
        shapes = [_shape(a) for a in operands]
        return None not in shapes and shapes[0] != shapes[1]
    return False


def is_heavy(node: torch.fx.Node) -> bool:
    """A matmul, a convolution or an attention: what a side stream hides behind."""
    return node.op in ("call_function", "call_method") and operation_of(node) in _HEAVY


@dataclasses.dataclass
class _Scopes:
    """Each call node's stream, and for a side node the ``scope_exit`` closing its stream's scope."""

    stream: Dict[torch.fx.Node, str]
    exit: Dict[torch.fx.Node, torch.fx.Node]
    members: Dict[torch.fx.Node, List[torch.fx.Node]]  # per scope_exit, the nodes of the scope


def _scopes(gm: torch.fx.GraphModule) -> _Scopes:
    stack: List[Tuple[Optional[str], List[torch.fx.Node]]] = []
    out = _Scopes({}, {}, {})
    for n in gm.graph.nodes:
        op = _air_op(n)
        if op == "scope_enter":
            attrs = dict(zip(n.args[0], n.args[1])) if len(n.args) >= 2 else {}
            stack.append((attrs.get(STREAM_LABEL), []))
        elif op == "scope_exit" and stack:
            label, members = stack.pop()
            if label is not None:
                out.members[n] = members
                for m in members:
                    out.exit[m] = n
            elif stack:  # a core-limit scope inside a stream's: its nodes are that stream's
                stack[-1][1].extend(members)
        elif n.op in ("call_function", "call_method"):
            label = next((lb for lb, _ in reversed(stack) if lb is not None), None)
            out.stream[n] = label or DEFAULT
            if stack:
                stack[-1][1].append(n)
    return out


def written_in_place(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The tensor ``node`` writes in place (``out[i] = x``, ``out.copy_(x)``, ``aten.index_put_``), if any."""
    if node.op not in ("call_function", "call_method") or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    target = node.target
    if target is operator.setitem:
        return node.args[0]
    if isinstance(target, torch._ops.OpOverload):
        arguments = target._schema.arguments
        alias = arguments[0].alias_info if arguments else None
        return node.args[0] if alias is not None and alias.is_write else None
    name = target if node.op == "call_method" else getattr(target, "__name__", "")
    return node.args[0] if isinstance(name, str) and name.endswith("_") and not name.startswith("_") else None


def _successors(gm: torch.fx.GraphModule, at: Dict[torch.fx.Node, int]) -> Dict[torch.fx.Node, List[torch.fx.Node]]:
    """Each node's data successors: its users, and for a write in place the later readers of the tensor written
    (a key written into a cache and read back from it is a data path)."""
    out = {n: list(n.users) for n in gm.graph.nodes}
    for n in gm.graph.nodes:
        written = written_in_place(n)
        if written is not None:
            out[n] += [u for u in written.users if at[u] > at[n]]
    return out


def _descendants(gm: torch.fx.GraphModule) -> Dict[torch.fx.Node, int]:
    """Per node, the bit set (by graph position) of every node reachable from it along data edges."""
    nodes = list(gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    successors = _successors(gm, at)
    desc: Dict[torch.fx.Node, int] = {}
    for n in reversed(nodes):
        bits = 0
        for u in successors[n]:
            bits |= (1 << at[u]) | desc.get(u, 0)
        desc[n] = bits
    return desc


def _main_consumers(node: torch.fx.Node, scopes: _Scopes) -> List[torch.fx.Node]:
    """The main-stream readers of ``node``'s value (through ``wait_tensor``, which passes its first input on)."""
    out, todo = [], list(node.users)
    while todo:
        u = todo.pop(0)
        if _air_op(u) == "wait_tensor" and u.args and u.args[0] is node:
            todo += list(u.users)
        elif scopes.stream.get(u) == DEFAULT and _air_op(u) is None:
            out.append(u)
    return out


def ge_hazards(gm: torch.fx.GraphModule) -> List[Hazard]:
    """Every side output of ``gm`` whose first main-stream consumer is cheap and may be issued ahead of a dominator
    (see the module docstring)."""
    scopes, desc = _scopes(gm), _descendants(gm)
    at = {n: i for i, n in enumerate(gm.graph.nodes)}
    heavy_main = [n for n, s in scopes.stream.items() if s == DEFAULT and is_heavy(n)]
    hazards = []
    for exit_node, members in scopes.members.items():
        region = 0
        for m in members:
            region |= 1 << at[m]
        free = [d for d in heavy_main if not desc[d] & region and not any(desc[m] >> at[d] & 1 for m in members)]
        for out in members:
            consumers = sorted(_main_consumers(out, scopes), key=at.__getitem__)
            if not consumers or not is_cheap(consumers[0]):
                continue
            first = consumers[0]
            dominator = next((d for d in free if not desc[d] >> at[first] & 1), None)
            if dominator is not None:
                hazards.append(Hazard(out.name, scopes.stream[out], first.name, operation_of(first), dominator.name))
    return hazards


def _movable(node: torch.fx.Node, exit_node: torch.fx.Node, at: Dict[torch.fx.Node, int]) -> bool:
    """Whether ``node`` can run just before ``exit_node``: every input defined before it, no reader before it."""
    return all(at[i] < at[exit_node] for i in node.all_input_nodes) and all(at[u] > at[exit_node] for u in node.users)


def pin_cheap_consumers(gm: torch.fx.GraphModule) -> List[Hazard]:
    """Move every hazard's cheap consumer into its side scope (in place; chains link by link); returns what it
    moved. A consumer with an input defined after the scope stays where it is (`ge_hazards` still lists it)."""
    moved: List[Hazard] = []
    for _ in range(_MAX_ROUNDS):
        scopes = _scopes(gm)
        names = {n.name: n for n in gm.graph.nodes}
        at = {n: i for i, n in enumerate(gm.graph.nodes)}
        done = False
        for h in ge_hazards(gm):
            consumer, exit_node = names[h.consumer], scopes.exit[names[h.output]]
            if _movable(consumer, exit_node, at):
                exit_node.prepend(consumer)
                moved.append(h)
                done = True
                break  # positions changed: look again
        if not done:
            break
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved


__all__ = ["Hazard", "ge_hazards", "is_cheap", "is_heavy", "operation_of", "pin_cheap_consumers", "written_in_place"]
