"""Figures without global state: every plot function returns a matplotlib ``Figure`` (or draws
on the ``ax`` it is given) and saves only when asked.

No backend is chosen here and pyplot is never used, so a notebook keeps its own backend
(``%matplotlib inline`` shows the returned figures) and a script can ``fig.savefig(path)``.
"""

from __future__ import annotations


def axes(ax=None, width: float = 7.0, height: float = 4.2, ncols: int = 1):
    """``(figure, ax)``: the figure of a given ``ax`` (a sequence of ``ncols`` axes when
    ``ncols > 1``), or a new constrained-layout ``Figure`` with ``ncols`` axes."""
    if ax is not None:
        return (ax[0] if ncols > 1 else ax).figure, ax
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(1, ncols)


def save(fig, path, dpi: int = 120) -> None:
    """Write ``fig`` (format from the suffix: PNG, PDF, SVG, …)."""
    fig.savefig(path, dpi=dpi)


def no_data(ax, why: str) -> None:
    """Say on ``ax`` why it holds nothing to draw (a figure is never silently empty)."""
    ax.text(0.5, 0.5, why, transform=ax.transAxes, ha="center", va="center", wrap=True)
