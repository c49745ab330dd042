"""The PNG timeline (`overlap.observability.save_png`): one lane per rank and stream.

A span's colour is its micro-batch (``meta["mb"]``), its hatch its kind, so that micro-batch 0's
exchange under micro-batch 1's compute is two colours one above the other; the longest span of
each micro-batch and layer on a lane carries the layer (``L3``) where the label fits. ``issue``
spans (host time, not busy time: `overlap.observability._intervals`) are thin strips at the foot
of their lane. The legend, outside the plotting area, names the micro-batches drawn and every
kind the toolkit writes. matplotlib is imported only when a PNG is drawn.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..hooks import Span
from ._intervals import COMM, COMPUTE, COPY, HOST_KINDS, ISSUE, KINDS

MB_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")  # micro-batch 0, 1, ...
NO_MB = "#9A9A9A"  # spans outside any micro-batch
_HATCH = {COMPUTE: "", COMM: "////", COPY: "....", ISSUE: "xxxx"}
_OTHER_HATCH = "\\\\"  # a kind of another writer
_KIND_WORDS = {COMPUTE: "compute", COMM: "comm (hatched)", COPY: "copy (dotted)",
               ISSUE: "issue: host time (thin)"}
LABEL_MIN = 0.02  # a layer label needs a span this share of the time axis wide


@dataclasses.dataclass(frozen=True)
class Style:
    """How one span is drawn: fill colour, hatch, and its height and offset within the lane (0..1)."""

    colour: str
    hatch: str
    height: float = 0.8
    bottom: float = 0.1


def mb_colour(mb: Any) -> str:
    """The colour of micro-batch ``mb``; grey for a span outside any micro-batch."""
    return MB_COLOURS[mb % len(MB_COLOURS)] if isinstance(mb, int) and mb >= 0 else NO_MB


def span_style(span: Span) -> Style:
    """Colour by micro-batch, hatch by kind; host spans thin at the foot of the lane."""
    colour, hatch = mb_colour(span.meta.get("mb")), _HATCH.get(span.kind, _OTHER_HATCH)
    if span.kind in HOST_KINDS:
        return Style(colour, hatch, height=0.22, bottom=0.0)
    return Style(colour, hatch)


def legend_entries(spans: Sequence[Span]) -> List[Tuple[str, Style]]:
    """The legend: one entry per micro-batch drawn (and one for spans outside any), then every kind."""
    mbs = {s.meta.get("mb") for s in spans}
    numbered = sorted(m for m in mbs if isinstance(m, int) and m >= 0)
    out = [(f"micro-batch {m}", Style(mb_colour(m), "")) for m in numbered]
    if any(not (isinstance(m, int) and m >= 0) for m in mbs):
        out.append(("no micro-batch", Style(NO_MB, "")))
    kinds = list(KINDS) + sorted({s.kind for s in spans} - set(KINDS))
    for k in kinds:  # in grey: the colour is the micro-batch's
        style = Style("#606060", "") if k == COMPUTE else Style("#E4E4E4", _HATCH.get(k, _OTHER_HATCH))
        out.append((_KIND_WORDS.get(k, k), style))
    return out


def layer_labels(spans: Sequence[Span], min_width: float) -> List[Tuple[Span, str]]:
    """Per lane (rank, stream), micro-batch and layer: its longest span, labelled ``L<layer>``; and each span that
    names itself (``meta["label"]``: an agreement between ranks, such as a decode step's ``decode.step``) with
    that name; where at least ``min_width`` seconds wide (host spans are never labelled)."""
    longest: Dict[Tuple[Any, ...], Tuple[float, Span]] = {}
    named: List[Tuple[Span, str]] = []
    for s in spans:
        if s.end is None or s.kind in HOST_KINDS:
            continue
        width = s.end - s.start
        if s.meta.get("label"):
            named += [(s, str(s.meta["label"]))] if width >= min_width else []
            continue
        layer = s.meta.get("layer")
        if layer is None:
            continue
        key = (s.rank, s.stream, s.meta.get("mb"), layer)
        if key not in longest or width > longest[key][0]:
            longest[key] = (width, s)
    return [(s, f"L{s.meta['layer']}") for width, s in longest.values() if width >= min_width] + named


def _lighter(colour: str, by: float = 0.45) -> Tuple[float, float, float]:
    r, g, b = (int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return (r + (1 - r) * by, g + (1 - g) * by, b + (1 - b) * by)


def draw(spans: Sequence[Span], file: str, lanes: List[Tuple[int, str]], title: str) -> str:
    """Draw finished ``spans`` on ``lanes`` (top to bottom) into ``file``; needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("save_png needs matplotlib: pip install 'npu-overlap[plot]'") from e
    origin = min((s.start for s in spans), default=0.0)
    extent = max((s.end for s in spans), default=origin) - origin  # type: ignore[type-var]
    row = {lane: i for i, lane in enumerate(lanes)}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.55 * max(3, len(lanes))))

    def ms(t: float) -> float:
        return (t - origin) * 1e3

    # host spans last, so that their strips lie over the work they issued
    for s in sorted(spans, key=lambda s: s.kind in HOST_KINDS):
        st = span_style(s)
        fill = st.colour if s.kind == COMPUTE else _lighter(st.colour)
        y = row[(s.rank, s.stream)] + 0.5 - st.bottom - st.height
        ax.barh(y, max(ms(s.end) - ms(s.start), 1e-6), left=ms(s.start), height=st.height, align="edge",
                color=fill, hatch=st.hatch or None, edgecolor=st.colour if st.hatch else "black", linewidth=0.3)
    for s, text in layer_labels(spans, LABEL_MIN * extent):
        y = row[(s.rank, s.stream)]
        ax.text((ms(s.start) + ms(s.end)) / 2, y - 0.02, text, ha="center", va="center", fontsize=7,
                color="white" if s.kind == COMPUTE else "black", clip_on=True)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"rank {r} / {t}" for r, t in lanes])
    ax.set_ylim(max(len(lanes), 1) - 0.5, -0.5)
    ax.set_xlim(0, max(extent * 1e3, 1e-3))
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=9)
    handles = [Patch(facecolor=st.colour, hatch=st.hatch or None, edgecolor="black", linewidth=0.3, label=name)
               for name, st in legend_entries(spans)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False,
              borderaxespad=0.0)
    os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
    fig.savefig(file, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return file


def title_of(prefix: Optional[str], hidden: Optional[float], per_rank: Dict[Any, Optional[float]]) -> str:
    """The picture's title: ``prefix``, then the hidden share of communication, all ranks and each."""
    def pct(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.0%}"

    ranks = ", ".join(f"rank {r} {pct(h)}" for r, h in sorted(per_rank.items(), key=lambda kv: str(kv[0])))
    what = "no communication" if hidden is None else f"{hidden:.0%} of communication hidden under compute"
    return (prefix + "\n" if prefix else "") + f"{what} ({ranks})"
