"""The explorer: a heatmap of decode step × key position that reads only the chunks in view,
policy tiers over it, and the per-layer views beside it (module ``kvscope.explorer``).

Served (``kvscope view``) and in Jupyter (``kvscope.view(ds)``) the callbacks run in Python:
a zoom or pan reads the view's chunks again, at the exact rows once a cell is one position
and one step. ``kvscope.explorer.static`` writes the same figures with browser callbacks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import xarray as xr
from bokeh.events import RangesUpdate
from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, Div, Select

from ..errors import KvscopeError
from .data import Rect, TierView, TraceView, matching
from .figures import HEAT_SIZE, TIER_NAMES, Heatmap, SideViews, answers_table, shared_ranges
from .labels import decoder, key_labels, query_labels
from .overlays import HistoryOracle, LogQuantFP, Overlay, Replayed
from .summary import summaries

NO_POLICY = "—"


class Summaries:
    """The side views' columns of one trace, computed once (in a thread) for every session."""

    def __init__(self, ds: xr.Dataset):
        self._ds = ds
        self._done = threading.Event()
        self.columns: dict | None = None
        self.error: str | None = None
        threading.Thread(target=self._compute, daemon=True, name="kvscope-view-summaries").start()

    def _compute(self) -> None:
        try:
            self.columns = summaries(self._ds)
        except KvscopeError as exc:
            self.error = str(exc)
        except Exception as exc:  # noqa: BLE001 — shown in the page, never a traceback
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


@dataclass
class Shared:
    """What every session of one trace shares: its reader, the replayed tiers (if any), the
    side views' numbers, the overlays computed from the trace, the token decoder."""

    trace: TraceView
    tiers: TierView | None
    side: Summaries
    found: dict[str, Overlay]  # overlays from the trace itself, by name
    decode: object


class Explorer:
    """One session's view of a trace (and a replay result). ``layout`` is a Bokeh layout."""

    def __init__(self, shared: Shared, title: str = "", cells=None):
        self.shared = shared
        self.trace, self.tiers, self.side, self.decode = shared.trace, shared.tiers, shared.side, shared.decode
        self.cells = cells or HEAT_SIZE[::-1]  # (rows, cols) of a view at most: one cell per pixel
        shape = self.trace.shape
        self.keys = ColumnDataSource({"key": []}, name="keys")
        self.queries = ColumnDataSource({"query": []}, name="queries")
        self.x_range, self.y_range = shared_ranges(shape["step"], shape["pos"])
        self.view = ((0.0, float(shape["step"])), (0.0, float(shape["pos"])))
        self.main = Heatmap("heatmap", "attention", self.keys, self.queries, x_range=self.x_range, y_range=self.y_range)
        self.other = Heatmap(
            "heatmap-b", "policy B", self.keys, self.queries, x_range=self.x_range, y_range=self.y_range
        )
        self.views = SideViews(shape["layer"])
        self.message = Div(text="", name="message", styles={"color": "#b00"})
        self._labelled: int | None = None  # the sample whose token labels the page holds
        self.status = Div(text="computing FMM, churn, LIR, peaks, concentration …", name="status")
        self.widgets = self._widgets(shape)
        self.header = Div(text=f"<b>{title}</b>", name="title")
        self.main.fig.on_event(RangesUpdate, self._on_range)
        self.views.layers.selected.on_change("indices", self._on_tap)
        self.views.show_steps([int(x) for x in self.tiers.event_step] if self.tiers is not None else [])
        self.views.forced_fig.visible = self.tiers is not None and self.tiers.forced
        self.answers = ColumnDataSource({}, name="answers")  # samples × policies at the chosen β (with answers)
        self.answers_note = Div(text="", name="answers-note")
        self.answers_table = self._answers_table()
        self.fit_sample()

    def _answers_table(self):
        """The samples a policy loses or gains against full KV (a result with answers), else None."""
        if self.tiers is None or not self.tiers.answers:
            return None
        columns = self.tiers.answer_columns(self.tiers.budgets[0], self.tiers.allocations[0])
        self.answers.data = columns
        return answers_table(list(columns), self.answers)

    def show_answers(self) -> None:
        """The answers table at the chosen β and allocation."""
        if self.answers_table is None:
            return
        budget, allocation = float(self.widgets["budget"].value), self.widgets["allocation"].value
        self.answers.data = self.tiers.answer_columns(budget, allocation)
        self.answers_note.text = answers_note(budget, allocation)

    def _widgets(self, shape: dict) -> dict[str, Select]:
        def select(key: str, title: str, options: list, value: str | None = None) -> Select:
            first = options[0][0] if isinstance(options[0], tuple) else options[0]  # (value, label) pairs
            w = Select(
                title=title, options=options, value=value or first, name=key, width=110, css_classes=[f"kv-{key}"]
            )
            w.on_change("value", lambda attr, old, new: self.fit_sample() if key == "sample" else self.redraw())
            return w

        widgets = {
            "sample": select("sample", "sample", [str(i) for i in range(shape["sample"])]),
            "layer": select("layer", "layer", [(str(i), str(x)) for i, x in enumerate(self.trace.ds["layer"].values)]),
            "head": select("head", self.trace.hdim, [str(i) for i in range(shape["head"])]),
        }
        policies = self.tiers.policies if self.tiers is not None else []
        choices = [NO_POLICY, *self.shared.found, *policies]
        widgets["policy"] = select("policy", "overlay", choices, policies[0] if policies else NO_POLICY)
        if self.tiers is not None:
            widgets["budget"] = select("budget", "budget", [f"{b:g}" for b in self.tiers.budgets])
            widgets["allocation"] = select("allocation", "allocation", self.tiers.allocations)
        widgets["policy_b"] = select("policy_b", "overlay B", choices, NO_POLICY)
        return widgets

    @property
    def layout(self):
        side = self.views
        return column(
            self.header,
            row(*self.widgets.values()),
            self.message,
            row(self.main.fig, self.other.fig),
            self.status,
            row(side.per_layer, side.tier_fig, side.forced_fig),
            row(side.fmm_h, side.peak_fig, side.top_fig),
            *([self.answers_note, self.answers_table] if self.answers_table is not None else []),
            name="kvscope-view",
        )

    def fit_sample(self) -> None:
        """Show the chosen sample whole: its steps and the positions its queries reach."""
        n_steps, n_pos = self.trace.extent(int(self.widgets["sample"].value))
        self.view = ((0.0, float(n_steps)), (0.0, float(n_pos)))
        self.x_range.start, self.x_range.end = 0, n_pos
        self.y_range.start, self.y_range.end = n_steps, 0
        self.redraw()

    def choice(self) -> tuple[int, int, int]:
        w = self.widgets
        return int(w["sample"].value), int(w["layer"].value), int(w["head"].value)

    def rect(self) -> Rect:
        shape = self.trace.shape
        rows, cols = self.cells
        return Rect.fitted(*self.view, shape["step"], shape["pos"], rows=rows, cols=cols)

    def redraw(self) -> None:
        """Read the view's chunks and refill every source (one line in the page on bad data)."""
        sample, layer, head = self.choice()
        try:
            rect = self.rect()
            values = self.trace.heat(sample, layer, head, rect)
            self._label(sample)
            self.main.show(values, rect, self._tiers("policy", sample, layer, head=head, rect=rect))
            b = self._tiers("policy_b", sample, layer, head=head, rect=rect)
            self.other.fig.visible = b is not None
            if b is not None:
                self.other.show(values, rect, b)
            self._titles(layer, head, rect)
            self._tier_mass(sample, layer, head)
            self.show_answers()
            self.message.text = ""
        except KvscopeError as exc:
            self.message.text = str(exc)
        self.views.mark_layer(layer)

    def _label(self, sample: int) -> None:
        if self._labelled == sample:
            return
        ids = self.trace.tokens(sample)
        self.keys.data = {"key": key_labels(self.decode, ids)}
        self.queries.data = {"query": query_labels(self.decode, ids, self.trace.query_pos[sample])}
        self._labelled = sample

    def overlay(self, which: str) -> Overlay | None:
        """The overlay chosen in widget ``which`` (``policy`` or ``policy_b``), if any."""
        w = self.widgets
        name = w[which].value
        if name == NO_POLICY:
            return None
        if name in self.shared.found:
            return self.shared.found[name]
        return Replayed(self.tiers, name, float(w["budget"].value), w["allocation"].value)

    def _tiers(self, which: str, sample: int, layer: int, head: int, rect: Rect) -> np.ndarray | None:
        ov = self.overlay(which)
        if ov is None:
            return None
        n_steps = int(self.trace.n_steps[sample])
        return ov.cells(sample, layer, rect, n_steps)[head // self.trace.ds.kvscope.group if ov.per_kv_head else head]

    def _label_of(self, which: str) -> str:
        ov = self.overlay(which)
        if ov is None:
            return ""
        return f"{ov.name} @ β={self.widgets['budget'].value}" if isinstance(ov, Replayed) else ov.name

    def _titles(self, layer: int, head: int, rect: Rect) -> None:
        res = resolution_text(rect, self.trace)
        a = self._label_of("policy")
        label = int(self.trace.ds["layer"].values[layer])  # the model's index of the stored layer
        self.main.fig.title.text = f"layer {label}, {self.trace.hdim} {head} — {res}" + (f" — {a}" if a else "")
        self.other.fig.title.text = self._label_of("policy_b")

    def _tier_mass(self, sample: int, layer: int, head: int) -> None:
        ov = self.overlay("policy")
        if not isinstance(ov, Replayed):
            self.views.tier_mass.data = {"step": [], "FP": [], "Q": [], "EVICTED": []}
            self.views.forced.data = {"step": [], "kl": []}
            return
        tm = self.tiers.tier_mass(ov.run, sample, layer, head // self.trace.ds.kvscope.group)
        self.views.tier_mass.data = mass_columns(tm, self.tiers.event_step)
        if self.tiers.forced:
            self.views.forced.data = self.tiers.forced_columns(ov.run, sample)

    def _on_range(self, event) -> None:
        ys = sorted((event.y0, event.y1))
        xs = sorted((event.x0, event.x1))
        self.view = (tuple(ys), tuple(xs))
        self.redraw()

    def _on_tap(self, attr, old, new) -> None:
        if new:
            self.widgets["layer"].value = str(self.views.layers.data["layer"][new[0]])

    def fill_side_later(self, doc) -> None:
        """Fill the side views once computed, from the session's event loop (never blocking it)."""

        def wait() -> None:
            self.side.wait()
            doc.add_next_tick_callback(self.fill_side)

        threading.Thread(target=wait, daemon=True, name="kvscope-view-side").start()

    def fill_side(self) -> None:
        """Put the side views' numbers in (waits for their computation)."""
        self.side.wait()
        if self.side.error:
            self.status.text = f"side views not drawn: {self.side.error}"
            return
        self.views.fill(self.side.columns)
        nums = self.side.columns["numbers"]
        self.status.text = " · ".join(f"{n} {v:.3f}" for n, v in zip(nums["name"], nums["value"]))


def load(
    ds: xr.Dataset, result: xr.Dataset | None = None, where: str = "the replay result", tokens: str = "model"
) -> Shared:
    """Open everything the sessions of a trace share (the result checked against the trace)."""
    trace = TraceView(ds)
    tiers = matching(result, trace, where) if result is not None else None
    found = {o.name: o for o in (HistoryOracle(ds), LogQuantFP(ds))}
    return Shared(
        trace=trace, tiers=tiers, side=Summaries(ds), found=found, decode=decoder(ds.attrs.get("model", {}), tokens)
    )


def mass_columns(tier_mass: xr.DataArray, event_step: np.ndarray) -> dict[str, list]:
    """``{step, FP, Q, EVICTED}`` of the events whose horizon ended (censored ones left out)."""
    values = np.stack([tier_mass.sel(tier=name).values for name in TIER_NAMES])  # [tier, event]
    done = np.isfinite(values).all(0)
    out = {"step": [int(s) for s in np.asarray(event_step)[done]]}
    out.update({name: [float(x) for x in values[i, done]] for i, name in enumerate(TIER_NAMES)})
    return out


def answers_note(budget: float, allocation: str) -> str:
    """What the answers table shows."""
    under = "" if allocation == "uniform" else f" under {allocation}"
    return (
        f"<b>answers at β = {budget:g}{under}</b>: 1 the greedy output under the cache starts with the gold "
        "answer, 0 it does not; <b>lost</b>: full KV answered and the policy did not; <b>gained</b>: the reverse"
    )


def resolution_text(rect: Rect, trace: TraceView) -> str:
    """What a cell of the view is, for the heatmap's title."""
    if trace.window and rect.dx < trace.w:
        return f"window means (w = {trace.w}), {rect.dy} step(s) per row"
    return "exact rows" if rect.exact else f"cells of {rect.dy} steps × {rect.dx} positions (mean)"


def title_of(ds: xr.Dataset) -> str:
    """ "STORE — model" for the page's header."""
    model = ds.attrs.get("model", {}).get("name", "")
    src = ds.encoding.get("source", "")
    return f"{src} — {model}" if src else str(model)
