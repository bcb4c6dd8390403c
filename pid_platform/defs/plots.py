"""PNG plots for asset metadata, embedded in Markdown as data URIs (the UI's Markdown renderer
allows ``data:`` image sources), so a materialization shows its picture with no file server.

Rendered with matplotlib's Agg backend (no display), small and at a fixed size and DPI: a plot
is a few tens of KB of metadata. matplotlib is imported on first use, not when the code
location loads.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence

import dagster as dg

WIDTH_IN, HEIGHT_IN, DPI = 6.4, 3.2, 90


def _figure():
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure  # not pyplot: no global state shared between threads

    return Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})  # no version stamp: same bytes for the same plot
    return buf.getvalue()


def png_markdown(png: bytes, alt: str) -> dg.MetadataValue:
    return dg.MetadataValue.md(f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})")


def bar_png(counts: Mapping[str, float], *, title: str, ylabel: str, color: str = "#4f6fb3") -> bytes:
    """One bar per label, in the given order, each with its value written above it."""
    fig = _figure()
    ax = fig.add_subplot()
    labels, values = list(counts), list(counts.values())
    bars = ax.bar(range(len(labels)), values, color=color)
    ax.bar_label(bars, fmt="%g", fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=30 if len(labels) > 4 else 0, ha="right" if len(labels) > 4 else "center",
                  fontsize=8)
    ax.set_ylabel(ylabel)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_title(title, fontsize=10)
    if not labels:
        ax.text(0.5, 0.5, "nothing to show", ha="center", va="center", transform=ax.transAxes)
    ax.margins(y=0.15)
    return _png(fig)


PALETTE = ["#4f6fb3", "#d9822b", "#3a9e6f", "#b34f6f", "#7a5fb3", "#8c8c3a", "#2b9ad9", "#b3874f", "#5f5f5f",
           "#c94fc9"]
MAX_LEGEND = len(PALETTE)  # beyond this, colours would repeat: the buckets are named under the bars instead


def shard_sizes_png(sizes_mib: Sequence[float], labels: Sequence[str], bound_mib: float | None, *, title: str) -> bytes:
    """Each shard's size in MiB (all modalities together) as a bar, coloured by bucket, against the bound."""
    return _png(shard_sizes_figure(sizes_mib, labels, bound_mib, title=title))


def shard_sizes_figure(sizes_mib: Sequence[float], labels: Sequence[str], bound_mib: float | None, *, title: str):
    """The figure of ``shard_sizes_png``: bars in the given (bucket) order, one colour per bucket with a
    legend entry each, every bucket's name under its run of bars, the bound as a dashed line.

    The y axis is logarithmic: shards of a small source sit far below a 500 MiB bound, and a
    linear axis would draw them as nothing."""
    from matplotlib.patches import Patch

    fig = _figure()
    ax = fig.add_subplot()
    buckets = list(dict.fromkeys(labels))  # in the order the bars come
    colour = {b: PALETTE[i % len(PALETTE)] for i, b in enumerate(buckets)}
    positive = [v for v in sizes_mib if v > 0] or [1.0]
    floor = min(positive) / 10  # bars start here: a log axis has no zero
    top = max(max(positive), bound_mib or 0) * 4
    ax.set_yscale("log")
    ax.bar(range(len(sizes_mib)), [max(v, floor) - floor for v in sizes_mib], bottom=floor,
           color=[colour[b] for b in labels], width=0.9)
    ax.set_ylim(floor, top)
    if bound_mib is not None:
        ax.axhline(bound_mib, color="#c0392b", linestyle="--", linewidth=1)
        ax.text(0.99, bound_mib, f"bound {bound_mib:g} MiB", color="#c0392b", ha="right", va="bottom",
                transform=ax.get_yaxis_transform(), fontsize=8)
    if 1 < len(buckets) <= MAX_LEGEND:
        ax.legend(handles=[Patch(facecolor=colour[b], label=b) for b in buckets], title="bucket", fontsize=7,
                  title_fontsize=7, ncols=min(5, len(buckets)), loc="upper left")
    # Each bucket's name under the middle of its bars.
    starts = [i for i, b in enumerate(labels) if i == 0 or labels[i - 1] != b]
    ends = starts[1:] + [len(labels)]
    ax.set_xticks([(a + b - 1) / 2 for a, b in zip(starts, ends, strict=True)], [labels[a] for a in starts],
                  fontsize=7, rotation=30 if len(starts) > 6 else 0)
    ax.set_xlabel(f"shards by bucket ({len(sizes_mib)} shards)")
    ax.set_ylabel("MiB per shard (all modalities)")
    ax.set_title(title, fontsize=10)
    return fig


def grouped_bars_png(groups: Mapping[str, Mapping[str, float]], *, title: str, ylabel: str) -> bytes:
    """Bars per x label (``groups``' inner keys), one colour per series (its outer keys)."""
    fig = _figure()
    ax = fig.add_subplot()
    series = list(groups)
    labels = sorted({x for values in groups.values() for x in values}, key=_natural)
    width = 0.8 / max(1, len(series))
    for i, name in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, [groups[name].get(x, 0) for x in labels], width=width, label=name)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if len(series) > 1:
        ax.legend(fontsize=7)
    return _png(fig)


def _natural(label: str) -> tuple:
    return (0, int(label)) if label.isdigit() else (1, label)
