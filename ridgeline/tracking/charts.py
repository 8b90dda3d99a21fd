"""Small matplotlib charts rendered to base64 PNG, for embedding in a self-contained HTML page.

Figures are built with `matplotlib.figure.Figure` directly (no pyplot): no global figure state
and no backend switch inside a training process; PNG output uses the Agg renderer.
"""

from __future__ import annotations

import base64
import io
from typing import Mapping, Sequence

Points = Sequence[tuple[float, float]]

FIGSIZE = (6.0, 3.2)
DPI = 100


def _label(text: str) -> str:
    return text.replace("$", r"\$")  # a `$` would start matplotlib mathtext


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _axes(title: str, ylabel: str, xlabel: str = "step"):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="tight")
    ax = fig.subplots()
    if xlabel == "step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_title(_label(title), fontsize=10)
    ax.set_xlabel(_label(xlabel), fontsize=8)
    if ylabel:
        ax.set_ylabel(_label(ylabel), fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    return fig, ax


def line_chart(title: str, series: Mapping[str, Points], ylabel: str = "",
               ylim: tuple[float, float] | None = None, dashed: Sequence[str] = (),
               xlabel: str = "step", faint: Sequence[str] = ()) -> str | None:
    """Lines (with point markers when there are few points, so a single eval shows), one per
    non-empty series, against `xlabel` (steps by default); `faint` series are drawn pale (raw
    values behind their smoothed line). None when every series is empty."""
    series = {name: points for name, points in series.items() if points}
    if not series:
        return None
    fig, ax = _axes(title, ylabel, xlabel)
    for name, points in series.items():
        xs, ys = zip(*points)
        ax.plot(xs, ys, label=_label(name), linestyle="--" if name in dashed else "-",
                marker="o" if len(xs) <= 40 else None, markersize=3, alpha=0.35 if name in faint else 1.0)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.legend(fontsize=7, loc="best")
    return _png(fig)


def stacked_chart(title: str, parts: Mapping[str, Points], total: tuple[str, Points] | None = None,
                  extra: dict[str, Points] | None = None, ylabel: str = "") -> str | None:
    """`parts` stacked as areas over the union of their steps (a missing value counts as 0),
    `total` as a line on top (e.g. the whole step), `extra` as markers (e.g. eval time)."""
    by_step = {name: dict(points) for name, points in parts.items() if points}
    extra = {name: points for name, points in (extra or {}).items() if points}
    if not by_step and not extra and not (total and total[1]):
        return None
    fig, ax = _axes(title, ylabel)
    if by_step:
        steps = sorted({s for values in by_step.values() for s in values})
        ax.stackplot(steps, [[values.get(s, 0.0) for s in steps] for values in by_step.values()],
                     labels=[_label(n) for n in by_step], alpha=0.8)
    if total and total[1]:
        xs, ys = zip(*total[1])
        ax.plot(xs, ys, color="black", linewidth=1, label=_label(total[0]))
    for name, points in extra.items():
        xs, ys = zip(*points)
        ax.plot(xs, ys, linestyle="none", marker="x", label=_label(name))
    # outside the axes: a stacked area leaves no empty corner for it
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return _png(fig)
