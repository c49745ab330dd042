"""Per-stream core limits, checked against the device's core budget.

Two streams that run in parallel share the AI cores: if their limits add up to more than the
device has, the overlap stops or the device hangs. `limit_cores` records the limit of each
stream it is used on and refuses, with an error naming the streams, a limit that would make the
per-stream limits add up to more than the budget. The budget comes from `set_core_budget`,
``$OVERLAP_CORE_BUDGET`` ("aic|aiv", e.g. "24|48") or CANN's ``platform_config/<soc>.ini``.
"""
from __future__ import annotations

import configparser
import contextlib
import dataclasses
import glob
import os
from typing import Dict, Iterator, Optional, Tuple

from . import backends
from .context import current_stream_tag, eager_in_trace, is_enabled
from .state import STATE

ENV_BUDGET = "OVERLAP_CORE_BUDGET"
ENV_SOC = "OVERLAP_SOC_VERSION"
_CANN_HOMES = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")


class CoreBudgetError(ValueError):
    """Core limits that the device cannot honour."""


@dataclasses.dataclass(frozen=True)
class CoreBudget:
    """How many AI (cube) and vector cores the device has, and where that was read."""

    aic: int
    aiv: int
    source: str = "given"


def parse_budget(text: str, source: str = ENV_BUDGET) -> CoreBudget:
    """Parse "aic|aiv" (or "aic" alone, for devices without vector cores)."""
    parts = [p.strip() for p in text.split("|")]
    try:
        aic = int(parts[0])
        aiv = int(parts[1]) if len(parts) > 1 and parts[1] else 0
    except (ValueError, IndexError):
        raise CoreBudgetError(f"{source}: expected 'aic|aiv' such as '24|48', got {text!r}") from None
    if aic < 1 or aiv < 0 or len(parts) > 2:
        raise CoreBudgetError(f"{source}: expected 'aic|aiv' with aic >= 1 and aiv >= 0, got {text!r}")
    return CoreBudget(aic, aiv, source)


def read_soc_config(file: str) -> CoreBudget:
    """Read ``[SoCInfo]`` ``cube_core_cnt`` (or ``ai_core_cnt``) and ``vector_core_cnt`` from a CANN ini."""
    cfg = configparser.ConfigParser()
    if not cfg.read(file):
        raise CoreBudgetError(f"cannot read SoC description {file}")
    if not cfg.has_section("SoCInfo"):
        raise CoreBudgetError(f"{file}: no [SoCInfo] section")
    info = cfg["SoCInfo"]
    aic = info.get("cube_core_cnt") or info.get("ai_core_cnt")
    if aic is None:
        raise CoreBudgetError(f"{file}: [SoCInfo] has neither cube_core_cnt nor ai_core_cnt")
    return CoreBudget(int(aic), int(info.get("vector_core_cnt", "0") or 0), file)


def _soc_version() -> Optional[str]:
    return os.environ.get(ENV_SOC) or backends.current().soc_version()


def find_soc_config(soc: Optional[str] = None) -> Optional[str]:
    """The ``platform_config/<soc>.ini`` of the installed CANN toolkit, if any."""
    soc = soc or _soc_version()
    if not soc:
        return None
    homes = [os.environ[v] for v in _CANN_HOMES if os.environ.get(v)] + ["/usr/local/Ascend/ascend-toolkit/latest"]
    for home in homes:
        hits = sorted(glob.glob(os.path.join(home, "**", "platform_config", f"{soc}.ini"), recursive=True))
        if hits:
            return hits[0]
    return None


def set_core_budget(budget: Optional[CoreBudget]) -> None:
    """Use ``budget`` for validation (None: back to the environment / SoC description)."""
    STATE.core_budget = budget


def core_budget() -> Optional[CoreBudget]:
    """The device's core budget, or None when it cannot be known."""
    if STATE.core_budget is not None:
        return STATE.core_budget
    env = os.environ.get(ENV_BUDGET)
    if env:
        return parse_budget(env)
    ini = find_soc_config()
    return read_soc_config(ini) if ini else None


def reset_core_limits() -> None:
    """Forget the limits recorded so far (e.g. between models)."""
    with STATE.lock:
        STATE.core_limits.clear()


def stream_limits() -> Dict[str, Tuple[int, int]]:
    """The limit recorded for each stream tag."""
    with STATE.lock:
        return dict(STATE.core_limits)


@eager_in_trace  # reads files and the environment: plain Python even while Dynamo traces
def _check(tag: str, aic: int, aiv: int) -> None:
    if not (isinstance(aic, int) and isinstance(aiv, int)) or aic < 1 or aiv < 0:
        raise CoreBudgetError(f"limit_cores(aic={aic!r}, aiv={aiv!r}): aic must be an int >= 1 and aiv an int >= 0")
    budget = core_budget()
    with STATE.lock:
        old = STATE.core_limits.get(tag, (0, 0))
        new = dict(STATE.core_limits)
        new[tag] = (max(old[0], aic), max(old[1], aiv))
        if budget is not None:
            total_aic = sum(a for a, _ in new.values())
            total_aiv = sum(v for _, v in new.values())
            if total_aic > budget.aic or total_aiv > budget.aiv:
                detail = ", ".join(f"{t}: {a}|{v}" for t, (a, v) in sorted(new.items()))
                raise CoreBudgetError(
                    f"core limits of streams that run in parallel add up to {total_aic}|{total_aiv} "
                    f"(aic|aiv), more than the device's {budget.aic}|{budget.aiv} from {budget.source} "
                    f"({detail}); oversubscribed parallel streams stop overlapping or hang the device. "
                    f"Limits persist per stream; call overlap.reset_core_limits() between phases whose "
                    f"streams never run in parallel")
        STATE.core_limits[tag] = new[tag]


@contextlib.contextmanager
def limit_cores(aic: int, aiv: int) -> Iterator[None]:
    """Limit the operators launched in the block to ``aic`` cube and ``aiv`` vector cores.

    ``ge`` / ``aclgraph``: ``torchair.scope.limit_core_num``; ``npu``: ``torch.npu.set_stream_limit``
    on the current stream; ``cuda`` / ``cpu``: validated, otherwise a no-op.
    """
    if not is_enabled():
        yield
        return
    _check(current_stream_tag(), aic, aiv)
    scope = backends.current().core_scope(aic, aiv)
    if scope is None:
        yield
    else:
        with scope:
            yield
