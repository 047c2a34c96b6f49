"""The explorer's Bokeh figures, shared by the served app, Jupyter and the static page.

Every figure draws from ``ColumnDataSource``s; choosing a sample, layer, head or policy only
replaces their data — in Python when served (``kvscope.explorer.app``), in the browser for the
static page (``kvscope.explorer.static``).
"""

from __future__ import annotations

import numpy as np
from bokeh.models import (
    BoxAnnotation,
    ColorBar,
    ColumnDataSource,
    CustomJS,
    CustomJSHover,
    DataTable,
    FixedTicker,
    HoverTool,
    HTMLTemplateFormatter,
    Legend,
    LinearColorMapper,
    LogColorMapper,
    Range1d,
    TableColumn,
    TapTool,
)
from bokeh.palettes import Inferno256
from bokeh.plotting import figure as bokeh_figure

from ..figures import BOKEH_PX
from .data import Rect

LOW, HIGH = 1e-5, 1.0  # log colour scale of a per-position probability; lower values take LOW's colour
TIER_NAMES = ("EVICTED", "Q", "FP")
# overlay codes tier + 1 (0 none, 1 EVICTED, 2 Q, 3 FP) over [0, 3]: four colours, one per code
TIER_PALETTE = (
    "rgba(0,0,0,0)",
    "rgba(190,190,190,0.6)",
    "rgba(0,200,255,0.45)",
    "rgba(0,0,0,0)",
)  # evicted mass still shows through
TIER_COLORS = {"FP": "#d62728", "Q": "#17becf", "EVICTED": "#7f7f7f"}
HEAT_SIZE = (880, 420)  # figure width, height in pixels; a view holds at most one cell per pixel


def image_columns(values: np.ndarray, rect: Rect) -> dict:
    """An image source's data: the cells of ``rect`` placed on the step × position axes
    (position p spans [p, p+1), step t spans [t, t+1))."""
    ny, nx = values.shape
    return {
        "image": [values],
        "x": [rect.p0],
        "y": [rect.t0],
        "dw": [nx * rect.dx],
        "dh": [ny * rect.dy],
        "p0": [rect.p0],
        "dx": [rect.dx],
        "t0": [rect.t0],
        "dy": [rect.dy],
    }


def empty_image(dtype=np.float32) -> dict:
    return image_columns(np.full((1, 1), np.nan if dtype == np.float32 else 0, dtype=dtype), Rect(0, 1, 0, 1))


# $x → "position 17 'token'" (or the cell's range when a cell holds several positions)
KEY_HOVER = """
const s = grid.data, p0 = s.p0[0], dx = s.dx[0];
const first = p0 + Math.floor((value - p0) / dx) * dx;
const tok = labels.data.key[first];
const text = tok === undefined ? '' : ' ' + JSON.stringify(tok);
return dx == 1 ? first + text : first + '–' + (first + dx - 1) + text + ' …';
"""
QUERY_HOVER = """
const s = grid.data, t0 = s.t0[0], dy = s.dy[0];
const first = t0 + Math.floor((value - t0) / dy) * dy;
const tok = queries.data.query[first];
const text = tok === undefined ? '' : ' ' + tok;
return dy == 1 ? first + text : first + '–' + (first + dy - 1) + text + ' …';
"""


def figure(**kwargs):
    """Bokeh's ``figure`` with the project's text size (``kvscope.figures.BOKEH_PX``: the
    explorer is shown at one CSS pixel per pixel, so no text is smaller than 9 pt)."""
    f = bokeh_figure(**kwargs)
    f.title.text_font_size = BOKEH_PX
    for axis in f.axis:
        axis.major_label_text_font_size = axis.axis_label_text_font_size = BOKEH_PX
    return f


class Heatmap:
    """Decode step × key position of one (sample, layer, head), with a policy's tiers over it."""

    def __init__(self, name: str, title: str, keys: ColumnDataSource, queries: ColumnDataSource, x_range, y_range):
        self.source = ColumnDataSource(empty_image(), name=f"{name}-heat")
        self.tiers = ColumnDataSource(empty_image(np.uint8), name=f"{name}-tiers")
        width, height = HEAT_SIZE
        self.fig = figure(
            name=name,
            title=title,
            width=width,
            height=height,
            x_range=x_range,
            y_range=y_range,
            x_axis_label="key position",
            y_axis_label="decode step",
            tools="pan,wheel_zoom,box_zoom,reset,save",
            active_scroll="wheel_zoom",
            output_backend="canvas",
            # a wheel zoom announces its new ranges (RangesUpdate → the chunks in view are read)
            # when the interaction stops: lod_timeout after the last wheel event (Bokeh's 500 ms)
            lod_timeout=60,
            lod_interval=100,
        )
        mapper = LogColorMapper(palette=Inferno256, low=LOW, high=HIGH, nan_color="rgba(0,0,0,0)")
        heat = self.fig.image(source=self.source, color_mapper=mapper, name=f"{name}-image")
        self.fig.image(
            source=self.tiers,
            color_mapper=LinearColorMapper(palette=list(TIER_PALETTE), low=0, high=3),
        )
        bar = ColorBar(
            color_mapper=mapper,
            width=10,
            title="a (mean per position)",
            title_text_font_size=BOKEH_PX,
            major_label_text_font_size=BOKEH_PX,
        )
        self.fig.add_layout(bar, "right")
        self.fig.add_tools(
            HoverTool(
                renderers=[heat],
                tooltips=[("step", "$y{custom}"), ("key", "$x{custom}"), ("attention", "@image{0.000e}")],
                formatters={
                    "$x": CustomJSHover(args={"grid": self.source, "labels": keys}, code=KEY_HOVER),
                    "$y": CustomJSHover(args={"grid": self.source, "queries": queries}, code=QUERY_HOVER),
                },
            )
        )
        self.fig.grid.visible = False

    def show(self, values: np.ndarray, rect: Rect, tiers: np.ndarray | None = None) -> None:
        self.source.data = image_columns(values, rect)
        self.tiers.data = image_columns(tiers, rect) if tiers is not None else empty_image(np.uint8)


# a cell of the answers table: lost (full KV answered, the policy did not) red, gained green
ANSWER_CELL = """<span style="font-size: {size}; color: <%= value == 'lost' ? '#c44e52' : value == 'gained' ? '#2ca02c'
: 'inherit' %>; font-weight: <%= value == 'lost' || value == 'gained' ? 'bold' : 'normal' %>"><%= value %></span>"""


def answers_table(columns: list[str], source: ColumnDataSource) -> DataTable:
    """The samples × policies table of a result with answers at the chosen β
    (``TierView.answer_columns``): 1 / 0 the policy's ``answer_exact``, ``lost`` / ``gained`` where
    it differs from full KV's."""
    cell = HTMLTemplateFormatter(template=ANSWER_CELL.format(size=BOKEH_PX))
    table = DataTable(
        source=source,
        columns=[TableColumn(field=c, title=c, formatter=cell) for c in columns],
        name="answers-table",
        width=min(1440, 110 * len(columns)),
        height=260,
        index_position=None,
        sortable=True,
        reorderable=False,  # reordering columns needs jquery-ui, which Bokeh does not ship
    )
    # new data of as many rows leaves the table's view unchanged, so Bokeh would not redraw it
    source.js_on_change("data", CustomJS(args={"table": table}, code="table.change.emit();"))
    return table


def shared_ranges(n_steps: int, n_pos: int) -> tuple[Range1d, Range1d]:
    """Positions left to right, steps top to bottom, bounded by the trace."""
    x = Range1d(0, n_pos, bounds=(0, n_pos), name="positions")
    y = Range1d(n_steps, 0, bounds=(0, n_steps), name="steps")
    return x, y


def small_figure(title: str, x_label: str, x: tuple, y: tuple, **kwargs):
    """One of the side views' small static figures (no tools); ``x``, ``y`` its initial ranges."""
    return figure(
        title=title,
        width=300,
        height=260,
        x_axis_label=x_label,
        x_range=Range1d(*x),
        y_range=Range1d(*y),
        tools="",
        **kwargs,
    )


class SideViews:
    """Per-layer metrics (tap a layer to show it), FMM(H), log2 peak density, concentration,
    and — with a replay result — the future mass each tier of the chosen policy received."""

    def __init__(self, n_layers: int):
        self.layers = ColumnDataSource(
            {k: [] for k in ("layer", "label", "fmm", "churn", "lir", "coverage", "top_share")}, name="layers"
        )
        self.curve = ColumnDataSource({"horizon": [], "fmm": [], "low": [], "high": []})
        self.peaks = ColumnDataSource({"distance": [], "density": [], "fit": []})
        self.top = ColumnDataSource({"top_frac": [], "share": []})
        self.tier_mass = ColumnDataSource({"step": [], "FP": [], "Q": [], "EVICTED": []}, name="tier-mass")
        self.forced = ColumnDataSource({"step": [], "kl": []}, name="forced-kl")
        self.chosen = BoxAnnotation(left=-0.5, right=0.5, fill_alpha=0.12, fill_color="#1f77b4")
        self.per_layer = self._per_layer(n_layers)
        self.fmm_h = self._fmm_curve()
        self.peak_fig = self._peaks()
        self.top_fig = self._top()
        self.tier_fig = self._tiers()
        self.forced_fig = self._forced()

    def _per_layer(self, n_layers: int):
        f = figure(
            name="per-layer",
            title="per layer (tap a layer to show it)",
            width=720,
            height=260,
            x_range=Range1d(-0.5, n_layers - 0.5),
            y_range=Range1d(0, 1.02),
            x_axis_label="layer",
            tools="tap,pan,wheel_zoom,reset",
        )
        column = f.vbar(
            x="layer", top=1.02, width=1.0, source=self.layers, fill_alpha=0, line_alpha=0
        )  # what a tap hits
        column.selection_glyph = column.nonselection_glyph = None
        bars = f.vbar(x="layer", top="fmm", width=0.8, source=self.layers, color="#1f77b4", alpha=0.6)
        bars.nonselection_glyph = None
        items = [("FMM", [bars])]
        for key, color, label in (
            ("churn", "#ff7f0e", "churn"),
            ("lir", "#2ca02c", "LIR"),
            ("coverage", "#9467bd", "LogQuant coverage"),
            ("top_share", "#8c564b", "mass in top 20% windows"),
        ):
            line = f.line(x="layer", y=key, source=self.layers, color=color, line_width=2)
            line.nonselection_glyph = None  # a tap chooses a layer; it does not fade the others
            items.append((label, [line]))
        f.add_layout(Legend(items=items, label_text_font_size=BOKEH_PX), "right")
        f.select_one(TapTool).renderers = [column]
        f.add_layout(self.chosen)
        f.add_tools(
            HoverTool(
                renderers=[column],
                tooltips=[
                    ("layer", "@label"),
                    ("FMM", "@fmm{0.000}"),
                    ("churn", "@churn{0.000}"),
                    ("LIR", "@lir{0.000}"),
                ],
            )
        )
        return f

    def _fmm_curve(self):
        f = small_figure("FMM(H)", "horizon H", (1, 64), (0, 1), x_axis_type="log")
        f.line(x="horizon", y="fmm", source=self.curve, line_width=2)
        f.varea(x="horizon", y1="low", y2="high", source=self.curve, alpha=0.2)
        f.scatter(x="horizon", y="fmm", source=self.curve, size=5)
        return f

    def _peaks(self):
        f = small_figure(
            "log2 peak density, power-law fit", "distance d", (1, 1024), (1e-4, 1), x_axis_type="log", y_axis_type="log"
        )
        f.scatter(x="distance", y="density", source=self.peaks, size=6)
        f.line(x="distance", y="fit", source=self.peaks, color="#d62728", line_width=2)
        return f

    def _top(self):
        f = small_figure("mass in the top p of the windows", "p", (0, 0.42), (0, 1.02))
        f.line(x="top_frac", y="share", source=self.top, line_width=2)
        f.scatter(x="top_frac", y="share", source=self.top, size=6)
        return f

    def _tiers(self):
        f = figure(
            title="future mass by tier (policy A; events whose horizon ended)",
            width=560,
            height=260,
            x_axis_label="event step",
            x_range=Range1d(0, 1),
            y_range=Range1d(0, 1.02),
            tools="hover",
        )
        f.varea_stack(
            stackers=list(TIER_COLORS),
            x="step",
            color=list(TIER_COLORS.values()),
            source=self.tier_mass,
            legend_label=list(TIER_COLORS),
        )
        f.legend.location = "bottom_left"
        f.legend.background_fill_alpha = 0.6
        f.legend.label_text_font_size = BOKEH_PX
        return f

    def _forced(self):
        """The model's output under policy A's cache (a result replayed with ``--forced``): KL to
        full KV per step."""
        f = figure(
            name="forced-fig",
            title="model output under policy A: KL(full ‖ policy) per step (forced)",
            width=560,
            height=260,
            x_axis_label="step",
            y_axis_label="nats",
            tools="hover,pan,wheel_zoom,reset",
            visible=False,
        )
        f.line(x="step", y="kl", source=self.forced, line_width=2, color="#c44e52")
        f.scatter(x="step", y="kl", source=self.forced, size=4, color="#c44e52")
        return f

    def fill(self, columns: dict) -> None:
        self.layers.data = columns["layers"]
        layers = columns["layers"]  # ticks at the stored layers, labelled with the model's indices
        self.per_layer.xaxis.major_label_overrides = {i: str(x) for i, x in zip(layers["layer"], layers["label"])}
        self.curve.data = columns["fmm_curve"]
        self.peaks.data = columns["peaks"]
        self.top.data = columns["top_share"]
        horizons = columns["fmm_curve"]["horizon"]
        if horizons:
            self.fmm_h.x_range.start, self.fmm_h.x_range.end = horizons[0] / 1.3, horizons[-1] * 1.3
            self.fmm_h.xaxis.ticker = FixedTicker(ticks=horizons)
            top = np.nanmax(columns["fmm_curve"]["high"] + columns["fmm_curve"]["fmm"] + [0.01])
            self.fmm_h.y_range.end = float(min(1.0, top * 1.1))
        peaks = columns["peaks"]
        if peaks["distance"]:
            self.peak_fig.x_range.start, self.peak_fig.x_range.end = (
                peaks["distance"][0] / 1.5,
                peaks["distance"][-1] * 1.5,
            )
            both = np.array(peaks["density"] + [x for x in peaks["fit"] if np.isfinite(x)])
            self.peak_fig.y_range.start, self.peak_fig.y_range.end = float(both.min() / 2), float(both.max() * 2)

    def show_steps(self, steps: list[int]) -> None:
        """The tier-mass figure's x range: the trace's event steps."""
        self.tier_fig.x_range.start, self.tier_fig.x_range.end = 0, max(1, steps[-1] if steps else 1)

    def mark_layer(self, layer: int) -> None:
        self.chosen.left, self.chosen.right = layer - 0.5, layer + 0.5
