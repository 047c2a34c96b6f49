"""One self-contained HTML page of the explorer (``kvscope view STORE --html FILE``).

The page holds every (sample, layer, head) heatmap and every overlay over it — the trace's own
(history oracle, LogQuant FP set) and, with a replay result, every run's tiers — each reduced
to cells as the app reduces a zoomed-out view; choosing a sample, layer, head or overlay swaps
arrays in the browser. Its size is bounded: every image holds the same number of cells,
``max(MIN_CELLS, PAGE_BYTES / (4·heatmaps + overlays))`` — float32 heatmaps, uint8 overlay
codes: 8 MiB in all unless the images are so many that the 32 × 32 floor applies — which base64
makes ≈ 1.34 × that in the file, plus Bokeh's JavaScript (≈ 2 MB, inlined so that the page
opens offline).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import xarray as xr
from bokeh.models import ColumnDataSource, CustomJS

from .app import Explorer, answers_note, load, mass_columns, resolution_text, title_of
from .data import Rect
from .labels import key_labels, query_labels
from .overlays import Overlay, Replayed

PAGE_BYTES = 8 * 2**20
MIN_CELLS = 32 * 32


def page_cells(n_steps: int, n_pos: int, n_heats: int, n_overlays: int) -> tuple[int, int]:
    """``(rows, cols)``: at most ``max(MIN_CELLS, PAGE_BYTES / (4·n_heats + n_overlays))`` cells
    per image (a heatmap's cells are float32, an overlay's uint8), in the trace's proportions."""
    budget = max(MIN_CELLS, PAGE_BYTES // max(1, 4 * n_heats + n_overlays))
    rows = min(n_steps, max(1, int(math.sqrt(budget * n_steps / n_pos))))
    return rows, max(1, min(n_pos, budget // rows))


def write_html(
    ds: xr.Dataset,
    result: xr.Dataset | None,
    path,
    *,
    tokens: str = "model",
    title: str = "",
    where: str = "the replay result",
) -> dict:
    """Write the page; returns ``{"bytes", "cells", "images"}``."""
    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    shared = load(ds, result, where, tokens)
    shape = shared.trace.shape
    overlays = _overlays(shared)
    n_heats = shape["sample"] * shape["layer"] * shape["head"]
    n_overlays = sum(_heads(ds, ov) for ov in overlays.values()) * shape["sample"] * shape["layer"]
    rows, cols = page_cells(shape["step"], shape["pos"], n_heats, n_overlays)
    app = Explorer(shared, title=title or title_of(ds), cells=(rows, cols))
    rect = Rect.fitted((0, shape["step"]), (0, shape["pos"]), shape["step"], shape["pos"], rows=rows, cols=cols)
    app.view = ((0, shape["step"]), (0, shape["pos"]))  # the page's one geometry: the whole trace
    app.redraw()
    app.fill_side()  # waits for the side views' numbers
    arrays = _arrays(app, rect, overlays)
    _link(app, arrays, rect)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "real Python callbacks" are not in a static page; the JS ones are
        html = file_html(app.layout, resources=INLINE, title=title or title_of(ds))
    Path(path).write_text(html, encoding="utf-8")
    return {"bytes": len(html.encode()), "cells": rect.shape, "images": n_heats + n_overlays}


def _overlays(shared) -> dict[str, Overlay]:
    """Every overlay the page offers, keyed as the page's callback asks for it."""
    out = {f"{name}||": ov for name, ov in shared.found.items()}
    tiers = shared.tiers
    if tiers is not None:
        for p in tiers.policies:
            for a in tiers.allocations:
                for b in tiers.budgets:
                    out[f"{p}|{b:g}|{a}"] = Replayed(tiers, p, b, a)
    return out


def _heads(ds: xr.Dataset, ov: Overlay) -> int:
    return ds.sizes[ds.kvscope.hdim] // (ds.kvscope.group if ov.per_kv_head else 1)


def _arrays(app: Explorer, rect: Rect, overlays: dict[str, Overlay]) -> dict:
    """Every image the page can show and where it is: ``index["s|l|h"]`` for heatmaps,
    ``index["overlay key|s|l|h"]`` for overlays (h a KV head for replayed ones)."""
    trace, shape = app.trace, app.trace.shape
    heats, overlay_images, masses, forced, index, labels, queries = [], [], {}, {}, {}, [], []
    for s in range(shape["sample"]):
        ids = trace.tokens(s)
        labels.append(key_labels(app.decode, ids))
        queries.append(query_labels(app.decode, ids, trace.query_pos[s]))
        for key, ov in overlays.items():
            if isinstance(ov, Replayed) and app.tiers.forced:
                forced[f"{key}|{s}"] = app.tiers.forced_columns(ov.run, s)
        for layer in range(shape["layer"]):
            for h, image in enumerate(trace.heats(s, layer, rect)):
                index[f"{s}|{layer}|{h}"] = len(heats)
                heats.append(image)
            for key, ov in overlays.items():
                for h, image in enumerate(ov.cells(s, layer, rect, int(trace.n_steps[s]))):
                    index[f"{key}|{s}|{layer}|{h}"] = len(overlay_images)
                    overlay_images.append(image)
                if isinstance(ov, Replayed):
                    tm = app.tiers.tier_mass(ov.run, s, layer, slice(None)).load()  # [event, kv_head, tier]
                    for h in range(tm.sizes["kv_head"]):
                        masses[f"{key}|{s}|{layer}|{h}"] = mass_columns(tm.isel(kv_head=h), app.tiers.event_step)
    return {
        "answers": _answers(app),
        "heats": ColumnDataSource({"image": heats}, name="page-heats"),
        "overlays": ColumnDataSource({"image": overlay_images or [np.zeros((1, 1), np.uint8)]}, name="page-overlays"),
        "index": index,
        "masses": masses,
        "forced": forced,
        "labels": labels,
        "queries": queries,
    }


def _answers(app: Explorer) -> dict:
    """``{"β|allocation": {data, note}}``: the answers table of each β and allocation (a result with answers)."""
    if app.answers_table is None:
        return {}
    tiers = app.tiers
    return {
        f"{b:g}|{a}": {"data": tiers.answer_columns(b, a), "note": answers_note(b, a)}
        for b in tiers.budgets
        for a in tiers.allocations
    }


SWITCH = """
const s = +w.sample.value, l = +w.layer.value, h = +w.head.value;
const rect = {x: [0], y: [0], dw: [dims.dw], dh: [dims.dh], p0: [0], dx: [dims.dx], t0: [0], dy: [dims.dy]};
main.data = Object.assign({}, rect, {image: [heats.data.image[page.index[`${s}|${l}|${h}`]]]});
keys.data = {key: page.labels[s]};
queries.data = {query: page.queries[s]};
chosen.left = l - 0.5; chosen.right = l + 0.5;
if (cb_obj === w.sample) {
  x_range.start = 0; x_range.end = dims.pos[s]; y_range.start = dims.steps[s]; y_range.end = 0;
}
function chosen_overlay(which) {  // [key of the image, label] or null
  const name = w[which].value;
  if (name == '—') return null;
  if (page.index[`${name}|||${s}|${l}|${h}`] !== undefined) return [`${name}||`, name, h];
  return [`${name}|${w.budget.value}|${w.allocation.value}`, `${name} @ β=${w.budget.value}`, Math.floor(h / dims.group)];
}
function image_of(o) {
  return Object.assign({}, rect, {image: [overlays.data.image[page.index[`${o[0]}|${s}|${l}|${o[2]}`]]]});
}
const none = {image: [], x: [], y: [], dw: [], dh: []};
const a = chosen_overlay('policy'), b = chosen_overlay('policy_b');
tiers_a.data = a === null ? none : image_of(a);
other_fig.visible = b !== null;
if (b !== null) {
  other.data = main.data;
  tiers_b.data = image_of(b);
}
main_fig.title.text = `layer ${dims.layers[l]}, ${dims.hdim} ${h} — ${dims.cells}` + (a === null ? '' : ` — ${a[1]}`);
other_fig.title.text = b === null ? '' : b[1];
const m = a === null ? undefined : page.masses[`${a[0]}|${s}|${l}|${a[2]}`];
mass.data = m === undefined ? {step: [], FP: [], Q: [], EVICTED: []} : m;
const f = a === null ? undefined : page.forced[`${a[0]}|${s}`];
forced.data = f === undefined ? {step: [], kl: []} : f;
const t = w.budget === undefined ? undefined : page.answers[`${w.budget.value}|${w.allocation.value}`];
if (t !== undefined) { answers.data = t.data; answers_note.text = t.note; }
"""

TAP = """
const i = layers.selected.indices;
if (i.length) layer.value = String(layers.data.layer[i[0]]);
"""


def _link(app: Explorer, arrays: dict, rect: Rect) -> None:
    """The widgets' browser callbacks: swap arrays by key."""
    shape, trace = app.trace.shape, app.trace
    ny, nx = rect.shape
    dims = {
        "group": trace.ds.kvscope.group if app.tiers is not None else 1,  # replayed tiers are per KV head
        "dw": nx * rect.dx,
        "dh": ny * rect.dy,
        "dx": rect.dx,
        "dy": rect.dy,
        "steps": [trace.extent(s)[0] for s in range(shape["sample"])],
        "pos": [trace.extent(s)[1] for s in range(shape["sample"])],
        "hdim": trace.hdim,
        "layers": [int(x) for x in trace.ds["layer"].values],  # the model's index of each stored layer
        "cells": resolution_text(rect, trace),
    }
    switch = CustomJS(
        args={
            "w": app.widgets,
            "dims": dims,
            "heats": arrays["heats"],
            "overlays": arrays["overlays"],
            "page": {k: arrays[k] for k in ("index", "masses", "forced", "labels", "queries", "answers")},
            "answers": app.answers,
            "answers_note": app.answers_note,
            "main": app.main.source,
            "tiers_a": app.main.tiers,
            "other": app.other.source,
            "tiers_b": app.other.tiers,
            "main_fig": app.main.fig,
            "other_fig": app.other.fig,
            "x_range": app.x_range,
            "y_range": app.y_range,
            "keys": app.keys,
            "queries": app.queries,
            "mass": app.views.tier_mass,
            "forced": app.views.forced,
            "chosen": app.views.chosen,
        },
        code=SWITCH,
    )
    for w in app.widgets.values():
        w.js_on_change("value", switch)
    tap = CustomJS(args={"layers": app.views.layers, "layer": app.widgets["layer"]}, code=TAP)
    app.views.layers.selected.js_on_change("indices", tap)
