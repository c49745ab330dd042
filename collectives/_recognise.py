"""Recognise an MoE block by its parts: routed experts, the routing its forward computes, shared experts.

Nothing here knows a class name. A block is a module with a child ``experts``:

- **routed experts**, stored fused (3-D ``gate_up_proj [E, 2F, H]`` and ``down_proj [E, H, F]``, transposed
  ``[E, H, 2F]`` / ``[E, F, H]``, gate and up rows interleaved where the module says
  ``is_concatenated = False``), as separate 3-D ``gate_proj`` / ``up_proj`` / ``down_proj``, or as an
  ``nn.ModuleList`` of gated MLPs (`GLU_NAMES`); the activation is their ``act_fn`` (SiLU if none);
- **routing**: for fused experts, what the block's own forward passes them, captured by running a shallow
  copy of the block with its experts replaced by a recorder (which ends the forward at the experts call)
  and its shared experts by zero stubs (`CapturedRouter`); where the block passes its router child's output
  on unchanged, that child alone (`RoutingOf`, found by `CapturedRouter.observe`), also where its router scores
  identity experts past the weighted ones that the block takes out of its experts' picks and adds itself
  (`folds_identity`, checked with identity picks forced in: `Observed.forced`); for a list of experts,
  which the block calls one by one, its ``router`` / ``gate`` child, which must return the top-k ids and
  weights;
- optional **shared experts** (`SHARED_NAMES`), a gated MLP, with an optional sigmoid output gate
  (`SHARED_GATE_NAMES`).
"""
from __future__ import annotations

import collections
import copy
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .experts import ClampedGLU, ClampedSwiGLU
from .layer import SharedExperts

ROUTED = "experts"
ROUTER_NAMES = ("gate", "router")
SHARED_NAMES = ("shared_experts", "shared_expert", "shared_mlp")
SHARED_GATE_NAMES = ("shared_expert_gate", "shared_experts_gate", "shared_gate")
# gated MLPs: (gate, up, down); a fused (gate_up, down) pair is recognised separately
GLU_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"), ("wi_0", "wi_1", "wo"))
PLAIN_NAMES = (("up_proj", "down_proj"), ("fc1", "fc2"), ("wi", "wo"), ("c_fc", "c_proj"), ("w1", "w2"))
FUSED_NAMES = (("gate_up_proj", "down_proj"), ("input_linear", "output_linear"))  # gate rows first, then up rows
ACT_NAMES = ("act_fn", "activation_fn", "act", "activation")
# relative tolerance of the probes, against the largest value of the block's output
PROBE_RTOL = {torch.float32: 1e-4, torch.float64: 1e-9, torch.float16: 1e-2, torch.bfloat16: 4e-2}

Act = Callable[[torch.Tensor], torch.Tensor]


def misfit(block: nn.Module, what: str) -> TypeError:
    """The error for a block that does not fit, naming it and what does not fit."""
    return TypeError(f"wrap_expert_parallel: {type(block).__name__} does not fit: {what}")


def _act_of(module: nn.Module) -> Optional[Act]:
    for name in ACT_NAMES:
        act = getattr(module, name, None)
        if callable(act):
            return act
    return None


def _check_act(block: nn.Module, act: Act, where: nn.Module) -> None:
    try:
        act(torch.zeros(2))
    except TypeError as err:  # e.g. an activation of (gate, up)
        raise misfit(block, f"the activation {type(act).__name__} of {type(where).__name__} is not an elementwise "
                            f"act(gate): we model a GLU act(gate) * up ({err})") from None


# --- routed experts ----------------------------------------------------------------------------------------------
class RoutedExperts:
    """A view of a block's routed experts: this rank's weights in the stacked layout, without holding copies.

    ``biases``: whether they add a bias after each projection (fused layouts: ``<tensor>_bias``);
    ``glus``: the GLUs of gate and up they may compute, most likely first (`glu_candidates`; the
    probe keeps the one their forward matches; None is ``act(gate) * up``); ``has_identity``: an
    ``nn.Identity`` child, for ids past the weighted experts (zero-compute experts).
    """

    def __init__(self, block: nn.Module, module: nn.Module):
        self.module = module
        self.layout = ""
        self._t = False  # fused and transposed
        self._interleaved = False
        self._bias: Tuple[Optional[torch.Tensor], ...] = ()
        if isinstance(module, nn.ModuleList):
            self._init_list(block, module)
        else:
            self._init_fused(block, module)
        self.count = len(module) if self.layout == "list" else self._tensors[-1].shape[0]
        self.first, self.total, self.sharded = 0, self.count, False
        self.glus: List[Optional[nn.Module]] = glu_candidates(module, self.act)
        self.has_identity = any(isinstance(m, nn.Identity) for m in module.children())
        shard = getattr(module, "ep_shard", None)
        if shard is not None:
            self.first, self.total = int(shard[0]), int(shard[1])
            self.sharded = True

    def _init_list(self, block: nn.Module, module: nn.ModuleList) -> None:
        if not len(module):
            raise misfit(block, "no routed experts found: its experts are an empty nn.ModuleList")
        for mlp in module:
            _mlp_glu(block, mlp, "routed expert")
        self.layout = "list"
        self.act = _act_of(module[0]) or F.silu
        _check_act(block, self.act, module[0])
        self._tensors = ()

    def _fused_biases(self, block: nn.Module, module: nn.Module, t3: dict) -> None:
        """The ``<tensor>_bias`` of each fused tensor; any other bias is refused."""
        kind = type(module).__name__
        biases = {n: p for n, p in module.named_parameters(recurse=False) if n.endswith("bias") and p is not None}
        known = {f"{n}_bias": n for n in t3}
        unknown = sorted(set(biases) - set(known))
        if unknown:
            raise misfit(block, f"its experts ({kind}) have biases ({', '.join(unknown)}) that belong to none of "
                                f"their projections")
        for name, tensor in biases.items():
            w = t3[known[name]]
            if tensor.dim() != 2 or tensor.shape[0] != w.shape[0]:
                raise misfit(block, f"its experts' {name} {tuple(tensor.shape)} is not one bias row per expert")
        if getattr(module, "has_bias", False) and not biases:
            raise misfit(block, f"its experts ({kind}) say they have biases, and none is named <projection>_bias")
        self._bias_of = {known[n]: t for n, t in biases.items()}

    def _init_fused(self, block: nn.Module, module: nn.Module) -> None:
        t3 = {n: getattr(module, n, None) for n in ("gate_up_proj", "gate_proj", "up_proj", "down_proj")}
        t3 = {n: v for n, v in t3.items() if isinstance(v, torch.Tensor) and v.dim() == 3}
        kind = type(module).__name__
        if "down_proj" not in t3 or not ("gate_up_proj" in t3 or "gate_proj" in t3 or "up_proj" in t3):
            raise misfit(block, f"no routed experts found: its experts ({kind}) are neither fused 3-D tensors "
                                f"(gate_up_proj [E, 2F, H] and down_proj [E, H, F], or gate_proj / up_proj / "
                                f"down_proj) nor an nn.ModuleList of gated MLPs")
        self._fused_biases(block, module, t3)
        if getattr(module, "has_post_expert_norm", False):
            raise misfit(block, f"its experts ({kind}) normalise each expert's output")
        if getattr(module, "has_gate", True) is False or ("gate_up_proj" not in t3 and "gate_proj" not in t3):
            raise misfit(block, f"its experts ({kind}) are not gated (up_proj / down_proj only): the activation is not "
                                f"a GLU of gate and up")
        down = t3["down_proj"]
        if "gate_up_proj" in t3:
            gu = t3["gate_up_proj"]
            self.layout = "fused"
            self._interleaved = getattr(module, "is_concatenated", True) is False
            self._tensors = (gu, down)
            self._names = ("gate_up_proj", "down_proj")
        else:
            if "up_proj" not in t3 or t3["gate_proj"].shape != t3["up_proj"].shape:
                raise misfit(block, f"its experts ({kind}) have gate_proj without a matching 3-D up_proj")
            gu = t3["gate_proj"]
            self.layout = "split"
            self._tensors = (t3["gate_proj"], t3["up_proj"], down)
            self._names = ("gate_proj", "up_proj", "down_proj")
        two = 2 if self.layout == "fused" else 1
        e = down.shape[0]  # gate_up may hold more (unused) rows, e.g. for zero-compute experts
        shape = lambda *s: s[1:] if gu.shape[0] >= e else None  # noqa: E731
        plain = shape(*gu.shape) == (two * down.shape[2], down.shape[1])
        flipped = shape(*gu.shape) == (down.shape[2], two * down.shape[1])
        declared = getattr(module, "is_transposed", None)
        self._t = bool(declared) if isinstance(declared, bool) else (flipped and not plain)
        if not (flipped if self._t else plain):
            gname = "gate_up_proj" if self.layout == "fused" else "gate_proj"
            raise misfit(block, f"its experts' {gname} {tuple(gu.shape)} and down_proj {tuple(down.shape)} are not "
                                f"[E, {two}F, H] and [E, H, F] (nor their transposes)")
        act = _act_of(module)
        self.act = act or F.silu
        _check_act(block, self.act, module)

    @property
    def hidden(self) -> int:
        return self.weights(0)[1].shape[0]

    @property
    def weight(self) -> torch.Tensor:
        """A tensor of the experts' dtype and device."""
        return self.weights(0)[0]

    @property
    def biases(self) -> bool:
        return bool(getattr(self, "_bias_of", None))

    def weights(self, e: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e`` (counted within this module) as ``gate_up [2F, H]`` (gate rows first) and ``down [H, F]``."""
        if self.layout == "list":
            g, u, d = _mlp_glu(None, self.module[e], "routed expert")
            return torch.cat([g, u]), d
        if self.layout == "split":
            g, u, d = (t[e].t() if self._t else t[e] for t in self._tensors)
            return torch.cat([g, u]), d
        gu, d = (t[e].t() if self._t else t[e] for t in self._tensors)
        if self._interleaved:
            gu = torch.cat([gu[0::2], gu[1::2]])
        return gu, d

    def bias(self, e: int) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Expert ``e``'s biases, ``gate_up [2F]`` (gate first, as `weights`) and ``down [H]``; None where absent."""
        of = getattr(self, "_bias_of", None) or {}
        if not of:
            return None, None
        f = self.weights(e)[1].shape[1]
        zeros = self.weight.new_zeros(f)
        d = of.get("down_proj")
        d = None if d is None else d[e]
        if self.layout == "split":
            g, u = of.get("gate_proj"), of.get("up_proj")
            if g is None and u is None:
                return None, d
            return torch.cat([zeros if g is None else g[e], zeros if u is None else u[e]]), d
        gu = of.get("gate_up_proj")
        if gu is None:
            return None, d
        gu = gu[e]
        return (torch.cat([gu[0::2], gu[1::2]]) if self._interleaved else gu), d

    def stacked(self, lo: int, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Experts ``lo .. lo + n - 1`` (within this module) stacked: fresh tensors, except that a loader's shard
        in the plain fused layout is used as it is."""
        with torch.no_grad():
            whole = self.layout == "fused" and self._tensors[0].shape[0] == self.count
            if whole and not self._t and not self._interleaved and self.sharded and (lo, n) == (0, self.count):
                return self._tensors[0].detach(), self._tensors[1].detach()
            if whole and not self._t and not self._interleaved:
                return self._tensors[0].detach()[lo:lo + n].clone(), self._tensors[1].detach()[lo:lo + n].clone()
            pairs = [self.weights(lo + i) for i in range(n)]
            return torch.stack([p[0].detach() for p in pairs]), torch.stack([p[1].detach() for p in pairs])

    def stacked_biases(self, lo: int, n: int) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The biases of experts ``lo .. lo + n - 1``, stacked (fresh tensors), or None where there are none."""
        if not self.biases:
            return None, None
        with torch.no_grad():
            pairs = [self.bias(lo + i) for i in range(n)]
            return tuple(None if pairs[0][j] is None else torch.stack([p[j].detach() for p in pairs])
                         for j in range(2))


def _number(module: nn.Module, *names: str) -> Optional[float]:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def glu_candidates(module: nn.Module, act: Act) -> List[Optional[nn.Module]]:
    """The GLUs of gate and up that experts with these attributes may compute, most likely first: with a
    ``limit`` / ``swiglu_limit``, gpt-oss's clamped SwiGLU (when they also have an ``alpha`` /
    ``swiglu_alpha``) and the clamped ``act(gate) * up``; None (``act(gate) * up``) always, last."""
    limit = _number(module, "limit", "swiglu_limit")
    if limit is None:
        return [None]
    alpha = _number(module, "alpha", "swiglu_alpha")
    found: List[Optional[nn.Module]] = [] if alpha is None else [ClampedSwiGLU(alpha, limit)]
    return found + [ClampedGLU(limit, act), None]


def _linear_weight(block: Optional[nn.Module], mod: Any, what: str) -> Optional[torch.Tensor]:
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    if getattr(mod, "bias", None) is not None and block is not None:
        raise misfit(block, f"its {what}s have biases, which the stacked expert layout does not hold")
    return w


def _mlp_glu(block: Optional[nn.Module], mlp: nn.Module, what: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gate, up and down weights of a gated MLP of linears (TypeError naming what is wrong)."""
    for g, u, d in GLU_NAMES:
        ws = [_linear_weight(block, getattr(mlp, n, None), what) for n in (g, u, d)]
        if all(w is not None for w in ws):
            return ws[0], ws[1], ws[2]
    gu = _linear_weight(block, getattr(mlp, "gate_up_proj", None), what)
    d = _linear_weight(block, getattr(mlp, "down_proj", None), what)
    if gu is not None and d is not None and gu.shape[0] == 2 * d.shape[1]:
        return gu[: d.shape[1]], gu[d.shape[1]:], d
    if block is None:
        raise TypeError(f"{type(mlp).__name__} is not a gated MLP")
    if any(all(isinstance(getattr(mlp, n, None), nn.Module) for n in names) for names in PLAIN_NAMES):
        raise misfit(block, f"its {what} {type(mlp).__name__} is not gated: the activation is not a GLU of gate and up")
    names = ", ".join("/".join(n) for n in GLU_NAMES)
    raise misfit(block, f"its {what} {type(mlp).__name__} has none of the gated projections {names} "
                        f"(or a fused gate_up_proj with down_proj)")


# --- shared experts ----------------------------------------------------------------------------------------------
class _Rows(nn.Module):
    """Rows ``lo:hi`` of a linear layer (a view of its weight, no copy)."""

    def __init__(self, linear: nn.Module, lo: int, hi: int):
        super().__init__()
        self.linear, self.lo, self.hi = linear, lo, hi

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = getattr(self.linear, "bias", None)
        return F.linear(x, self.linear.weight[self.lo:self.hi], None if b is None else b[self.lo:self.hi])


class _GatedMLP(nn.Module):
    """A gated MLP's projections under the names `SharedExperts` uses (the modules themselves, no copy)."""

    def __init__(self, gate: nn.Module, up: nn.Module, down: nn.Module, act: Act):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = gate, up, down, act


def _shared_mlp(block: nn.Module, name: str, mlp: nn.Module) -> nn.Module:
    """``mlp`` with ``gate_proj`` / ``up_proj`` / ``down_proj`` modules (itself where it has them)."""
    act = _act_of(mlp) or F.silu
    _check_act(block, act, mlp)
    for g, u, d in GLU_NAMES:
        parts = [getattr(mlp, n, None) for n in (g, u, d)]
        if all(isinstance(p, nn.Module) and isinstance(getattr(p, "weight", None), torch.Tensor)
               and p.weight.dim() == 2 for p in parts):
            return mlp if (g, u, d) == GLU_NAMES[0] else _GatedMLP(*parts, act)
    for fused, down in FUSED_NAMES:
        gu, d = getattr(mlp, fused, None), getattr(mlp, down, None)
        if isinstance(gu, nn.Module) and isinstance(d, nn.Module) and getattr(gu, "weight", None) is not None \
                and gu.weight.dim() == 2 and getattr(d, "weight", None) is not None and gu.weight.shape[0] % 2 == 0:
            f = gu.weight.shape[0] // 2
            return _GatedMLP(_Rows(gu, 0, f), _Rows(gu, f, 2 * f), d, act)
    raise misfit(block, f"its shared experts {name} ({type(mlp).__name__}) are not a gated MLP of linear layers "
                        f"({', '.join('/'.join(n) for n in GLU_NAMES)}, or "
                        f"{' or '.join(' with '.join(n) for n in FUSED_NAMES)})")


def shared_part(block: nn.Module) -> Tuple[Optional[SharedExperts], Tuple[str, ...]]:
    """The block's shared experts as `SharedExperts`, and the names of the children they are made of."""
    names = [n for n in SHARED_NAMES if isinstance(getattr(block, n, None), nn.Module)]
    gates = [n for n in SHARED_GATE_NAMES if isinstance(getattr(block, n, None), nn.Module)]
    if len(names) > 1 or len(gates) > 1:
        raise misfit(block, f"it has several shared-expert children ({', '.join(names + gates)})")
    if not names:
        if gates:
            raise misfit(block, f"it has a shared-expert gate {gates[0]} but no shared experts")
        return None, ()
    mlp = _shared_mlp(block, names[0], getattr(block, names[0]))
    gate = getattr(block, gates[0]) if gates else None
    return SharedExperts(mlp, act=_act_of(mlp) or F.silu, output_gate=gate), tuple(names + gates)


# --- routing -----------------------------------------------------------------------------------------------------
class _CallMismatch(Exception):
    """The block calls its experts with something else than (hidden_states, top_k_index, top_k_weights)."""


def _roles(args: Sequence[Any], kwargs: dict) -> Tuple[List[Tuple[Any, str]], Tuple[torch.Tensor, ...]]:
    """Which argument of an experts call is the hidden states, the top-k ids and the top-k weights."""
    items = [(i, a) for i, a in enumerate(args)] + [(k, v) for k, v in kwargs.items() if v is not None]
    if not all(isinstance(a, torch.Tensor) for _, a in items):
        raise _CallMismatch("it passes its experts arguments that are not tensors")
    ints = [(k, a) for k, a in items if not a.is_floating_point()]
    floats = [(k, a) for k, a in items if a.is_floating_point()]
    if len(ints) != 1 or len(floats) != 2 or floats[1][1].shape != ints[0][1].shape:
        raise _CallMismatch(f"it calls its experts with {len(items)} tensor argument(s), not (hidden_states, "
                            f"top_k_index, top_k_weights)")
    roles = [(floats[0][0], "hidden"), (ints[0][0], "index"), (floats[1][0], "weights")]
    return roles, (floats[0][1], ints[0][1], floats[1][1])


def call_experts(experts: nn.Module, roles: List[Tuple[Any, str]], hs: torch.Tensor, idx: torch.Tensor,
                 w: torch.Tensor) -> torch.Tensor:
    """Call ``experts`` the way the block does (``roles`` from `_roles`)."""
    value = {"hidden": hs, "index": idx, "weights": w}
    args = [value[r] for k, r in sorted((k, r) for k, r in roles if isinstance(k, int))]
    kwargs = {k: value[r] for k, r in roles if not isinstance(k, int)}
    return experts(*args, **kwargs)


class _OneTensor(BaseException):
    """Carries the one tensor a block passed its experts (e.g. every expert's copy of the tokens, scaled by its
    router score: Llama 4) out of its forward."""


class _Captured(BaseException):
    """Carries what a block passed its experts out of its forward, so that nothing after that call runs
    (a BaseException, so that no ``except Exception`` in the block swallows it)."""


class _Recorder(nn.Module):
    """Stands in for the routed experts: takes what the block passes them and ends the block's forward there
    (while compiling, where that cannot be traced, it records them and returns zeros)."""

    def __init__(self):
        super().__init__()
        self.seen: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.roles: List[Tuple[Any, str]] = []

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        items = list(args) + [v for v in kwargs.values() if v is not None]
        if len(items) == 1 and isinstance(items[0], torch.Tensor) and items[0].is_floating_point() \
                and not torch.compiler.is_compiling():
            raise _OneTensor(items[0])
        self.roles, seen = _roles(args, kwargs)
        if not torch.compiler.is_compiling():
            raise _Captured(seen)
        self.seen.append(seen)
        return torch.zeros_like(seen[0])


class _Zeros(nn.Module):
    """Stands in for a shared expert (or its gate): zeros of its output shape, no compute."""

    def __init__(self, out_features: Optional[int]):
        super().__init__()
        self.out_features = out_features

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        n = x.shape[-1] if self.out_features is None else self.out_features
        return x.new_zeros(*x.shape[:-1], n)


class _Spy(nn.Module):
    """Calls ``inner`` and keeps the arguments and the output of each call."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.calls: List[Tuple[tuple, dict, Any]] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        self.calls.append((args, kwargs, out))
        return out

    def __getattr__(self, name: str) -> Any:  # the block may read the router's weights directly
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)


class _Forced(_Spy):
    """Stands in for a router child: its output with the top-k ids (item ``at``) replaced by ``ids``."""

    def __init__(self, inner: nn.Module, at: int, ids: torch.Tensor):
        super().__init__(inner)
        self.at, self.ids = at, ids

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = list(self.inner(*args, **kwargs))
        out[self.at] = self.ids
        self.calls.append((args, kwargs, tuple(out)))
        return tuple(out)


def _shallow_copy(block: nn.Module, swap: dict) -> nn.Module:
    """A copy of ``block`` sharing every child, parameter and buffer, with the children in ``swap`` replaced and
    no hooks (they would see the stand-ins); ``block`` itself is left as it is."""
    clone = copy.copy(block)
    for key, value in block.__dict__.items():
        if key.endswith("hooks") and isinstance(value, dict):
            setattr(clone, key, type(value)())
    clone._modules = collections.OrderedDict(block._modules)
    clone._parameters = dict(block._parameters)
    clone._buffers = dict(block._buffers)
    clone._non_persistent_buffers_set = set(block._non_persistent_buffers_set)
    clone._modules.update(swap)
    return clone


class RoutingOf(nn.Module):
    """Picks ``(top_k_index, top_k_weights)`` out of a router child's output (e.g. transformers'
    ``(logits, weights, index)``). ``batched``: the router takes ``[1, tokens, hidden]``; ``extra``: tensors of
    the block passed after the tokens (e.g. a score correction bias), held here under their names."""

    def __init__(self, router: nn.Module, index_at: int, weights_at: int, batched: bool = False,
                 extra: Sequence[Tuple[str, torch.Tensor]] = ()):
        super().__init__()
        self.gate = router
        self.index_at, self.weights_at, self.batched = index_at, weights_at, batched
        self.extra = tuple(name for name, _ in extra)
        for name, t in extra:
            if isinstance(t, nn.Parameter):
                self.register_parameter(name, t)
            else:
                self.register_buffer(name, t)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        out = self.gate(x.unsqueeze(0) if self.batched else x, *(getattr(self, n) for n in self.extra))
        idx, w = out[self.index_at], out[self.weights_at]
        return idx.reshape(-1, idx.shape[-1]), w.reshape(-1, w.shape[-1])


def _own_tensors(block: nn.Module, args: Sequence[Any]) -> Optional[List[Tuple[str, torch.Tensor]]]:
    """``args`` as ``(name, tensor)`` of the block's own parameters and buffers (the tensors themselves), or None."""
    own = {id(t): (n, t) for n, t in list(block._parameters.items()) + list(block._buffers.items()) if t is not None}
    found = [own.get(id(a)) for a in args]
    return None if any(f is None or f[1] is not a for f, a in zip(found, args)) else found


class Observed(NamedTuple):
    """What a block passed its experts on a probe batch, how it called them, and the router child that
    computes exactly that routing on its own (None where the block changes the router's output)."""

    hidden: torch.Tensor
    index: torch.Tensor
    weights: torch.Tensor
    roles: List[Tuple[Any, str]]
    shortcut: Optional[nn.Module]
    scale: Optional["DenseScores"] = None  # the experts' tokens are scaled by these scores (`DenseTopK`)
    scores: Optional[torch.Tensor] = None  # the scores on the probe batch, [tokens, experts]
    # the block adds its identity experts itself (`CapturedRouter.observe`): (router child's name, the stand-in that
    # forces identity picks into its output); index and weights are the router's picks with those forced in
    forced: Optional[Tuple[str, nn.Module]] = None


class DenseScores(nn.Module):
    """A router child's dense per-expert scores ``[tokens, experts]`` (item ``at`` of its output): the score by
    which a block scales each token's copy for each expert (0 for the experts it did not choose)."""

    def __init__(self, router: nn.Module, at: int):
        super().__init__()
        self.gate, self.at = router, at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.gate(x)
        return out[self.at] if isinstance(out, (tuple, list)) else out


class DenseTopK(nn.Module):
    """The routing of a block that scales each token by its dense router scores before the experts: the ``k``
    experts of largest score, each of weight 1 (the score scales the expert's input instead, see
    `collectives.experts.LocalExperts` ``input_scale``). An expert the block did not choose has score 0, so
    its input is zero: picking it on a tie adds nothing."""

    def __init__(self, scores: DenseScores, k: int):
        super().__init__()
        self.scores, self.k = scores, int(k)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = self.scores(x).topk(self.k, dim=-1).indices
        return idx, torch.ones(idx.shape, dtype=x.dtype, device=x.device)


def _dense_layout(name: str, block: nn.Module, h: torch.Tensor, spy: Optional["_Spy"], flat: torch.Tensor,
                  experts: int) -> Observed:
    """A block that passed its experts one tensor ``h``: it must be, expert after expert, the tokens times that
    expert's score from the router child's dense output (Llama 4), the router having got the tokens."""
    def fail(what: str) -> TypeError:
        return TypeError(f"wrap_expert_parallel: {name} does not fit: it calls its experts with one tensor "
                         f"{tuple(h.shape)}, {what}")

    if spy is None or len(spy.calls) != 1:
        raise fail("and no router child computed it from the tokens")
    args, kwargs, out = spy.calls[0]
    if kwargs or not args or not isinstance(args[0], torch.Tensor) or args[0].numel() != flat.numel() \
            or not torch.equal(args[0].reshape(flat.shape), flat):
        raise fail("and its router child did not get the tokens alone")
    n = flat.shape[0]
    for at, s in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
        if not (isinstance(s, torch.Tensor) and s.is_floating_point() and s.shape == (n, experts)
                and h.shape == (n * experts, flat.shape[1])):
            continue
        want = flat.repeat(experts, 1) * s.transpose(0, 1).reshape(-1, 1).to(flat.dtype)
        if not torch.allclose(h, want.to(h.dtype), rtol=PROBE_RTOL.get(h.dtype, 1e-2) / 10, atol=0.0):
            continue
        k = next((int(v) for v in (getattr(spy.inner, "top_k", None), getattr(block, "top_k", None))
                  if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= experts), None)
        if k is None:
            raise fail("the tokens scaled by dense router scores, but neither its router nor the block says its "
                       "top_k")
        scale = DenseScores(spy.inner, at) if isinstance(out, (tuple, list)) else DenseScores(spy.inner, 0)
        idx = s.topk(k, dim=-1).indices
        return Observed(flat, idx, torch.ones(idx.shape, dtype=flat.dtype, device=flat.device), [],
                        DenseTopK(scale, k), scale, s)
    raise fail(f"which is not, for each of its {experts} experts, the tokens times that expert's score from its "
               f"router")


def _router_call(spy: Optional[_Spy], block: nn.Module,
                 x: torch.Tensor) -> Optional[Tuple[tuple, bool, List[Tuple[str, torch.Tensor]]]]:
    """``(output, batched, extra)`` of the router child's one call, where it got the block's tokens (``batched``:
    as ``x``, ``[1, tokens, hidden]``; else flat), then only the block's own tensors (``extra``); else None."""
    if spy is None or len(spy.calls) != 1:
        return None
    args, kwargs, out = spy.calls[0]
    extra = _own_tensors(block, args[1:])
    if not isinstance(out, tuple) or not args or not isinstance(args[0], torch.Tensor) or extra is None or kwargs:
        return None
    flat = x.reshape(-1, x.shape[-1])
    batched = args[0].shape == x.shape and torch.equal(args[0], x)
    return (out, batched, extra) if batched or (args[0].shape == flat.shape and torch.equal(args[0], flat)) else None


def _picks(out: object) -> Optional[Tuple[int, int]]:
    """Where a router's output holds its top-k ids and weights: its one integer tensor and the one float tensor of
    that shape (None where there are not exactly these)."""
    if not isinstance(out, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in out):
        return None
    ints = [i for i, t in enumerate(out) if not t.is_floating_point()]
    like = [i for i, t in enumerate(out) if len(ints) == 1 and t.is_floating_point() and t.shape == out[ints[0]].shape]
    return (ints[0], like[0]) if len(ints) == len(like) == 1 else None


def _scored(out: tuple, idx: torch.Tensor, weighted: int) -> int:
    """How many experts past the ``weighted`` ones a router scores: the widest float tensor of its output beside
    its picks ``idx`` (its scores, ``[tokens, experts]``)."""
    widths = [t.shape[-1] for t in out if t.is_floating_point() and t.shape[:-1] == idx.shape[:-1]]
    return max(widths + [weighted]) - weighted


def _with_identity(idx: torch.Tensor, weighted: int, past: int) -> torch.Tensor:
    """The picks ``idx`` with the first of every other token an identity expert (``weighted`` .. ``weighted + past
    - 1`` in turn)."""
    forced = idx.clone()
    rows = forced.view(-1, forced.shape[-1])
    even = torch.arange(0, rows.shape[0], 2, device=idx.device)
    rows[even, 0] = (weighted + (even // 2) % past).to(rows.dtype)
    return forced


def folds_identity(picks: Tuple[torch.Tensor, torch.Tensor], passed: Tuple[torch.Tensor, torch.Tensor],
                   weighted: int) -> bool:
    """Whether ``passed``, the ids and weights a block gave its experts, are a router's ``picks`` with each
    identity pick (an id from ``weighted`` on) taken out: weight 0, on an id below ``weighted``; the other picks
    as they are. False where no pick is an identity expert."""
    (idx, w), (got_i, got_w) = picks, passed
    if not idx.numel() == w.numel() == got_i.numel() == got_w.numel():
        return False
    idx, w, got_i, got_w = (t.reshape(-1) for t in (idx, w, got_i, got_w))
    ident = idx >= weighted
    kept, moved = ~ident, got_i[ident]
    return bool(ident.any()) and torch.equal(got_i[kept], idx[kept]) and torch.equal(got_w[kept], w[kept]) \
        and bool((got_w[ident] == 0).all()) and bool(((moved >= 0) & (moved < weighted)).all())


def forced_block(block: nn.Module, seen: Observed) -> nn.Module:
    """``block`` as the probe runs it: with its router's picks forced to hold identity experts where ``seen`` says
    the block adds them itself (`Observed.forced`), else itself."""
    return block if seen.forced is None else _shallow_copy(block, dict([seen.forced]))


class CapturedRouter(nn.Module):
    """The routing a block computes, as ``(top_k_index, top_k_weights)``: the block's own forward with its routed
    experts recorded (not computed) and its shared experts stubbed out, up to its experts call. Costs the
    block's routing and what its forward does before that call."""

    def __init__(self, block: nn.Module, shared_names: Sequence[str] = ()):
        super().__init__()
        swap = {ROUTED: _Recorder()}
        for name in shared_names:
            w = getattr(getattr(block, name), "weight", None)
            swap[name] = _Zeros(w.shape[0] if isinstance(w, torch.Tensor) and w.dim() == 2 else None)
        self.block = _shallow_copy(block, swap)
        self._name = type(block).__name__

    @property
    def gate(self) -> Optional[nn.Module]:
        """The block's router child (the module itself, shared with the block)."""
        for name in ROUTER_NAMES:
            if isinstance(getattr(self.block, name, None), nn.Module):
                return getattr(self.block, name)
        return None

    def _capture(self, block: nn.Module, x: torch.Tensor, one_tensor: bool = False) -> Any:
        rec = self.block._modules[ROUTED]
        rec.seen = []
        try:
            block(x)
        except _Captured as got:
            return got.args[0]
        except _OneTensor as got:
            if one_tensor:
                return got
            raise TypeError(f"wrap_expert_parallel: {self._name} does not fit: it calls its experts with one "
                            f"tensor, not (hidden_states, top_k_index, top_k_weights)") from None
        except _CallMismatch as err:
            raise TypeError(f"wrap_expert_parallel: {self._name} does not fit: {err}") from None
        seen, rec.seen = rec.seen, []
        if len(seen) != 1:
            raise TypeError(f"wrap_expert_parallel: {self._name} does not fit: its forward called its experts "
                            f"{len(seen)} times, expected once with (hidden_states, top_k_index, top_k_weights)")
        return seen[0]

    def observe(self, x: torch.Tensor, experts: int = 0, weighted: int = 0) -> Observed:
        """Capture on ``x`` (``[1, tokens, hidden]``), watching the router child: where the block passes the
        router's ids and weights (the tensors themselves) to its experts, and the router got the block's
        input, that router alone is the routing, at the cost of nothing else; so too where the router scores
        identity experts past the ``weighted`` ones (default ``experts``) that the block adds itself (`_fold`).
        A block that passes its ``experts`` experts one tensor must pass the tokens scaled by the router's
        dense scores (`DenseTopK`, with the scores in ``scale``)."""
        name = next((n for n in ROUTER_NAMES if isinstance(self.block._modules.get(n), nn.Module)), None)
        spy = _Spy(self.block._modules[name]) if name else None
        got = self._capture(_shallow_copy(self.block, {name: spy}) if spy else self.block, x, one_tensor=True)
        flat = x.reshape(-1, x.shape[-1])
        if isinstance(got, _OneTensor):
            return _dense_layout(self._name, self.block, got.args[0], spy, flat, experts)
        hs, idx, w = got
        roles = self.block._modules[ROUTED].roles
        tokens = hs.dtype == flat.dtype and hs.numel() == flat.numel() and torch.equal(hs.reshape(flat.shape), flat)
        call = _router_call(spy, self.block, x) if tokens else None
        if call is None:
            return Observed(hs, idx, w, roles, None)
        out, batched, extra = call
        at_i, at_w = [i for i, t in enumerate(out) if t is idx], [i for i, t in enumerate(out) if t is w]
        if len(at_i) == len(at_w) == 1:
            return Observed(hs, idx, w, roles, RoutingOf(spy.inner, at_i[0], at_w[0], batched, extra))
        folded = self._fold(x, name, spy.inner, call, weighted or experts)
        return Observed(hs, idx, w, roles, None) if folded is None else folded

    def _fold(self, x: torch.Tensor, name: str, router: nn.Module, call: Tuple[tuple, bool, list],
              weighted: int) -> Optional[Observed]:
        """A block whose router also scores identity experts (ids from ``weighted`` on) and that takes those picks
        out of its experts' (weight 0, on a weighted expert's id), adding the token times their weight itself:
        what it passes its experts with the router's picks forced to hold identity experts (`_with_identity`)
        must be exactly that; then the router is the routing. None where it scores none, or the block does
        otherwise."""
        out, batched, extra = call
        picks = _picks(out)
        past = 0 if picks is None or weighted < 1 else _scored(out, out[picks[0]], weighted)
        if not past:
            return None
        at_i, at_w = picks
        forced = _Forced(router, at_i, _with_identity(out[at_i], weighted, past))
        try:
            hs, idx, w = self._capture(_shallow_copy(self.block, {name: forced}), x)
        except Exception:  # noqa: BLE001 (its forward cannot take identity picks: not this structure)
            return None
        idx_f, w_f = forced.calls[0][2][at_i], forced.calls[0][2][at_w]
        if not folds_identity((idx_f, w_f), (idx, w), weighted):
            return None
        routing = RoutingOf(router, at_i, at_w, batched, extra)
        return Observed(hs, idx_f, w_f, self.block._modules[ROUTED].roles, routing,
                        forced=(name, _Forced(router, at_i, forced.ids)))

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        hs, idx, w = self._capture(self.block, x.unsqueeze(0))
        if hs.numel() != x.numel():
            raise TypeError(f"wrap_expert_parallel: {self._name} passed its experts {tuple(hs.shape)} hidden states "
                            f"for {tuple(x.shape)} tokens")
        return idx.reshape(-1, idx.shape[-1]), w.reshape(-1, w.shape[-1])


def child_router(block: nn.Module, probe: torch.Tensor) -> nn.Module:
    """The router child of a block that calls a list of experts itself: the child if it returns
    ``(top_k_index, top_k_weights)``, else `RoutingOf` where its output holds them."""
    names = [n for n in ROUTER_NAMES if isinstance(getattr(block, n, None), nn.Module)]
    if not names:
        raise misfit(block, f"its experts are an nn.ModuleList it calls itself, so the routing must come from a router "
                            f"child ({' or '.join(ROUTER_NAMES)}), and it has none")
    router = getattr(block, names[0])
    with torch.no_grad():
        out = router(probe)
    picks = _picks(out)
    if picks is not None:
        return router if picks == (0, 1) and len(out) == 2 else RoutingOf(router, *picks)
    raise misfit(block, f"its router {names[0]} ({type(router).__name__}) does not return the top-k expert ids "
                        f"and weights (it computes only part of the routing, and the block the rest)")


# --- finding blocks ----------------------------------------------------------------------------------------------
def find_moe_blocks(model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """``(name, module)`` for every module of ``model`` with a child named ``experts`` (outermost only): the
    candidates `wrap_expert_parallel` looks at."""
    skip: Optional[str] = None
    for name, module in model.named_modules():
        if skip is not None and (skip == "" or name.startswith(skip + ".")):
            continue
        if isinstance(module._modules.get(ROUTED), nn.Module):
            skip = name
            yield name, module
