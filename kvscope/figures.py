"""One figure style for everything kvscope draws, and figures without global state.

Every plot function returns a matplotlib ``Figure`` (or draws on the ``ax`` it is given) and
saves only when asked. No backend is chosen here and pyplot is never used, so a notebook keeps
its own backend (``%matplotlib inline`` shows the returned figures) and a script can
``save(fig, path)``.

Sizes are chosen for where figures are read: the documentation site shows an image at its own
pixel width, at most ``DISPLAY_PX`` (800) CSS pixels (the content column); a notebook shows it
at ``DPI``. Text of ``f`` points in a figure ``W`` inches wide, rendered at ``DPI``, shows at::

    shown(f) = f · DPI/72 [image px] · min(1, DISPLAY_PX / (W·DPI)) · 72/96 [CSS pt per px]

and every text must show at ``MIN_PT`` (9 pt) or more. With ``WIDTH`` = 8 in, ``DPI`` = 120
and ``SMALL_PT`` = 9 pt for ticks and legends, ``shown(9) = 9.4 pt``. A wider figure would
need larger type: draw several panels in rows instead. ``smallest_shown`` measures a
figure; ``save`` records it in the PNG (``tests/test_figures.py`` checks both).
"""

from __future__ import annotations

import functools

WIDTH = 8.0  # inches: the widest figure (8 in at 120 dpi is 960 px, shown at 800)
DPI = 120
DISPLAY_PX = 800  # CSS px: the documentation site's content width (mkdocs-material)
MIN_PT = 9.0  # the smallest text, in points as shown
TEXT_PT = 10.0  # titles, axis labels
SMALL_PT = 9.0  # tick labels, legends, annotations
BOKEH_PX = f"{round(SMALL_PT * 96 / 72)}px"  # the explorer (Bokeh) draws at 1 CSS px per px: 9 pt = 12 px
TIER_COLORS = {"none": "#eeeeee", "EVICTED": "#c44e52", "Q": "#dd8452", "FP": "#4c72b0"}

STYLE = {
    "font.size": TEXT_PT,
    "axes.titlesize": TEXT_PT,
    "axes.labelsize": TEXT_PT,
    "xtick.labelsize": SMALL_PT,
    "ytick.labelsize": SMALL_PT,
    "legend.fontsize": SMALL_PT,
    "legend.title_fontsize": SMALL_PT,
    "figure.titlesize": TEXT_PT,
    "figure.dpi": DPI,
    "savefig.dpi": DPI,
}
PNG_KEY = "kvscope smallest text pt"  # the PNG text chunk save() writes


def styled(func):
    """Draw ``func``'s figure in the project's style (matplotlib's rc parameters, for the
    duration of the call).

    Args:
        func: A function that draws and returns a figure.
    """

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        import matplotlib

        with matplotlib.rc_context(STYLE):
            return func(*args, **kwargs)

    return wrapper


def axes(ax=None, width: float = WIDTH, height: float = 4.2, ncols: int = 1, nrows: int = 1):
    """``(figure, ax)``: the figure of a given ``ax`` (a sequence of axes when the figure has
    several), or a new constrained-layout ``Figure`` of ``nrows × ncols`` axes (a flat sequence
    when there are several) at most ``WIDTH`` inches wide, in the project's style.

    Args:
        ax: Axes to draw into (their figure is returned), or None for a new figure.
        width: Inches (at most ``WIDTH``).
        height: Inches.
        ncols: Columns of axes.
        nrows: Rows of axes.
    """
    if ax is not None:
        first = ax[0] if ncols * nrows > 1 else ax
        return first.figure, ax
    import matplotlib
    from matplotlib.figure import Figure

    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(min(width, WIDTH), height), dpi=DPI, layout="constrained")
        grid = fig.subplots(nrows, ncols, squeeze=False)
    flat = list(grid.ravel())
    for a in flat:
        a.tick_params(labelsize=SMALL_PT)  # kept by the axis: ticks are made when the figure is drawn
    return fig, flat if len(flat) > 1 else flat[0]


def mosaic(layout: list[list[str]], width: float = WIDTH, height: float = 4.2):
    """``(figure, {name: ax})``: a constrained-layout ``Figure`` of named panels laid out as
    ``layout`` (matplotlib's ``subplot_mosaic``: a name repeated spans cells), in the style.

    Args:
        layout: Rows of panel names.
        width: Inches (at most ``WIDTH``).
        height: Inches.
    """
    import matplotlib
    from matplotlib.figure import Figure

    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(min(width, WIDTH), height), dpi=DPI, layout="constrained")
        panels = fig.subplot_mosaic(layout)
    for a in panels.values():
        a.tick_params(labelsize=SMALL_PT)
    return fig, panels


def shown_points(fontsize: float, width_px: float, dpi: float = DPI) -> float:
    """Points at which text shows in an image on the documentation site (module docstring).

    Args:
        fontsize: Points of the text in the figure.
        width_px: Width of the image in pixels.
        dpi: Pixels per inch it was rendered at.
    """
    return fontsize * dpi / 72 * min(1.0, DISPLAY_PX / width_px) * 72 / 96


def smallest_text(fig) -> float:
    """The smallest font size (pt) of the visible, non-empty text of a figure as it draws.

    Args:
        fig: A matplotlib figure.
    """
    from matplotlib.text import Text

    fig.draw_without_rendering()
    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    return min(sizes) if sizes else TEXT_PT


def smallest_shown(fig, dpi: float = DPI) -> float:
    """``shown_points`` of the smallest text of a figure saved at ``dpi``.

    Args:
        fig: A matplotlib figure.
        dpi: Pixels per inch it is saved at.
    """
    return shown_points(smallest_text(fig), fig.get_figwidth() * dpi, dpi)


def save(fig, path, dpi: int = DPI) -> None:
    """Write ``fig`` (format from the suffix: PNG, PDF, SVG, …); a PNG records its smallest
    text size (``PNG_KEY``) so that the documentation's figures can be checked.

    Args:
        fig: A matplotlib figure.
        path: Where to write it.
        dpi: Pixels per inch.
    """
    from pathlib import Path

    metadata = {PNG_KEY: f"{smallest_text(fig):g}"} if Path(path).suffix.lower() == ".png" else None
    fig.savefig(path, dpi=dpi, metadata=metadata)


def no_data(ax, why: str) -> None:
    """Say on ``ax`` why it holds nothing to draw (a figure is never silently empty)."""
    ax.text(0.5, 0.5, why, transform=ax.transAxes, ha="center", va="center", wrap=True)
