"""Memory plots shared by the notebooks and the one byte formatter: one colour per category in every notebook,
so a learner recognises "optimizer state" at a glance wherever it appears."""

from typing import Mapping, Sequence

COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer_state": "#55A868",
          "activations": "#C44E52", "other": "#8C8C8C"}
LABELS = {c: c.replace("_", " ") for c in COLORS}


def unit_for(max_bytes: float) -> tuple[float, str]:
    """(divisor, name): GiB for figures above 2 GiB, KiB below 1 MiB, MiB otherwise."""
    if max_bytes >= 2 * 2**30:
        return 2**30, "GiB"
    if max_bytes < 2**20:
        return 2**10, "KiB"
    return 2**20, "MiB"


def fmt_bytes(n: float) -> str:
    """Bytes in the unit of :func:`unit_for` (what notebooks and ``mgpu-plan`` print)."""
    div, unit = unit_for(n)
    return f"{n / div:.2f} {unit}" if unit != "KiB" or n >= 1024 else f"{int(n)} B"


def stacked_bars(bars: Mapping[str, Mapping[str, int]], title: str = "", ax=None, xlabel: str = "",
                 unit: tuple[float, str] | None = None):
    """One stacked bar per entry of ``bars`` (label → {category: bytes}), totals written on top.
    ``unit``: (divisor, name), e.g. ``(1e9, "GB")`` to match a table in decimal GB; default binary units."""
    import matplotlib.pyplot as plt  # here: the planner's command line formats bytes without matplotlib
    ax = ax or plt.subplots(figsize=(1.6 + 1.3 * len(bars), 4))[1]
    totals = [sum(b.values()) for b in bars.values()]
    div, unit = unit or unit_for(max(totals + [1]))
    cats = [c for c in COLORS if any(b.get(c, 0) for b in bars.values())]
    bottoms = [0.0] * len(bars)
    for c in cats:
        vals = [b.get(c, 0) / div for b in bars.values()]
        ax.bar(list(bars), vals, bottom=bottoms, color=COLORS[c], label=LABELS[c])
        bottoms = [x + v for x, v in zip(bottoms, vals)]
    for i, t in enumerate(totals):
        ax.text(i, t / div, f"{t / div:.1f}", ha="center", va="bottom", fontsize=9)
    ax.set(ylabel=unit, title=title, xlabel=xlabel)
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    return ax


def timeline(samples: Sequence[tuple[str, int, Mapping[str, int]]], title: str = "", ax=None):
    """Stacked area of a tracker timeline (never empty: entry takes a sample), phase boundaries marked and named."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(9, 3.8))[1]
    div, unit = unit_for(max(s[1] for s in samples))
    xs = list(range(len(samples)))
    cats = [c for c in COLORS if any(s[2].get(c, 0) for s in samples)]
    ax.stackplot(xs, *[[s[2].get(c, 0) / div for s in samples] for c in cats],
                 colors=[COLORS[c] for c in cats], labels=[LABELS[c] for c in cats], step="post")
    last = None
    for x, (phase, _, _) in enumerate(samples):
        if phase != last:
            ax.axvline(x, color="k", lw=0.6, ls=":")
            ax.text(x, ax.get_ylim()[1] * 0.97, f" {phase}", fontsize=8, va="top")
            last = phase
    ax.set(xlabel="allocation / free events", ylabel=unit, title=title)
    ax.legend(loc="upper right", fontsize=8, frameon=False)
    return ax
