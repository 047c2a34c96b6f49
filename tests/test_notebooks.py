"""Both notebooks run top to bottom (nbclient, a real kernel) on a real trace of one prompt and on
one of three, and are committed without outputs. What they show is checked, not only that they
ran: every figure holds drawn data inside its axes (on the figure objects themselves) and its PNG
is not blank, no number is printed as nan, an n/a says why, and nothing reaches stderr (a warning
would print the paths of the machine that built the page). The figures' own one-sample cases are
checked the same way on small synthetic stores."""

from __future__ import annotations

import base64
import io
import pickle
import re
from pathlib import Path

import nbformat
import numpy as np
import pytest

import kvscope
from kvscope import analysis as A

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["explore_attention_drift.ipynb", "compare_policies.ipynb"]

# appended to a notebook before it runs: the figures its cells returned (IPython keeps them in Out)
KEEP_FIGURES = """
import pickle as _pickle
from matplotlib.figure import Figure as _Figure
with open({path!r}, "wb") as _out:
    _pickle.dump([_value for _, _value in sorted(Out.items()) if isinstance(_value, _Figure)], _out)
"""


def _inside(ax, display_xy: np.ndarray) -> np.ndarray:
    """``[n]`` whether each point (display coordinates) lies inside the axes' box."""
    uv = ax.transAxes.inverted().transform(np.reshape(display_xy, (-1, 2)))
    return np.isfinite(uv).all(1) & (uv >= -1e-6).all(1) & (uv <= 1 + 1e-6).all(1)


def drawn(ax) -> list[str]:
    """What ``ax`` draws inside its box from data: lines, bands and points (collections), images,
    bars. Text alone (titles, legends, a note) is not data."""
    from matplotlib.collections import PathCollection

    found = []
    for line in ax.get_lines():
        xy = np.asarray(line.get_xydata(), dtype=float)
        xy = xy[np.isfinite(xy).all(1)]
        if len(xy) and _inside(ax, line.get_transform().transform(xy)).any():
            found.append("line")
    for coll in ax.collections:
        if isinstance(coll, PathCollection):  # scatter: the offsets are the points
            xy = np.asarray(coll.get_offsets(), dtype=float)
            points = coll.get_offset_transform().transform(xy[np.isfinite(xy).all(1)]) if len(xy) else xy
        else:  # a band (fill_between) and the like: the vertices of its paths
            paths = [p.vertices for p in coll.get_paths() if len(p.vertices)]
            xy = np.concatenate(paths) if paths else np.zeros((0, 2))
            points = coll.get_transform().transform(xy[np.isfinite(xy).all(1)]) if len(xy) else xy
        if len(points) and _inside(ax, points).any():
            found.append(type(coll).__name__)
    for image in ax.images:
        values = np.ma.masked_invalid(np.ma.asarray(image.get_array(), dtype=float))
        if values.count():
            found.append("image")
    for patch in ax.patches:
        size = (getattr(patch, "get_height", lambda: 1)(), getattr(patch, "get_width", lambda: 1)())
        if all(np.isfinite(size)) and all(size) and _inside(ax, patch.get_verts()).any():
            found.append("bar")
    return found


def assert_every_axes_draws_data(fig, where: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()  # limits and layout as shown
    plots = [ax for ax in fig.axes if not hasattr(ax, "_colorbar")]
    assert plots, where
    for i, ax in enumerate(plots):
        assert drawn(ax), f"{where}: axes {i} ({ax.get_title()!r}) draws no data inside its limits"


def assert_png_not_blank(data: str, where: str) -> None:
    from matplotlib.image import imread

    pixels = imread(io.BytesIO(base64.b64decode(data)))[..., :3]  # [row, column, rgb] in 0..1
    colours, counts = np.unique(pixels.reshape(-1, 3).round(2), axis=0, return_counts=True)
    assert counts.max() / counts.sum() < 0.97 and len(colours) > 8, f"{where}: the PNG is (nearly) one colour"


def _texts(output) -> list[str]:
    """The text a reader sees of one output: its plain text where it has one (the HTML beside it
    holds the same numbers, and data: the explorer's embedded document, the prompts' text)."""
    if output.output_type == "stream":
        return [output.text]
    data = output.get("data", {})
    return [data["text/plain"]] if "text/plain" in data else [data.get("text/markdown", "")]


def check_outputs(nb, figures: list, where: str) -> None:
    outputs = [(i, o) for i, c in enumerate(nb.cells) if c.cell_type == "code" for o in c.outputs]
    errors = [o for _, o in outputs if o.output_type == "error"]
    assert not errors, (where, errors[:1])
    stderr = [(i, o.text) for i, o in outputs if o.output_type == "stream" and o.name == "stderr"]
    assert not stderr, f"{where}: cell {stderr[0][0]} wrote to stderr: {stderr[0][1][:300]}"
    for i, output in outputs:
        for text in _texts(output):
            assert not re.search(r"\bnan\b", text, re.IGNORECASE), f"{where}: cell {i} shows nan: {text[:500]}"
            bare = [m.start() for m in re.finditer(r"n/a", text) if not text[m.end() :].startswith(": ")]
            assert not bare, f"{where}: cell {i} shows n/a without a reason: {text[max(0, bare[0] - 200) :][:400]}"
    pngs = [(i, o["data"]["image/png"]) for i, o in outputs if "image/png" in o.get("data", {})]
    assert len(pngs) == len(figures) >= 3, (where, len(pngs), len(figures))
    for i, png in pngs:
        assert_png_not_blank(png, f"{where}, cell {i}")
    for n, fig in enumerate(figures):
        assert_every_axes_draws_data(fig, f"{where}, figure {n}")


def test_committed_without_outputs():
    for name in NOTEBOOKS:
        nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, name


@pytest.mark.slow
@pytest.mark.parametrize("prompts", ["one prompt", "three prompts"])
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom_and_shows_data(tmp_path, monkeypatch, request, name, prompts):
    from nbclient import NotebookClient

    trace = request.getfixturevalue("qkv_trace" if prompts == "one prompt" else "prompts_qkv_trace")
    assert kvscope.open_trace(trace).sizes["sample"] == (1 if prompts == "one prompt" else 3)
    monkeypatch.setenv("KVSCOPE_TRACE", str(trace))
    monkeypatch.setenv("KVSCOPE_QKV_TRACE", str(trace))
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    kept = tmp_path / "figures.pickle"
    nb.cells.append(nbformat.v4.new_code_cell(KEEP_FIGURES.format(path=str(kept))))
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    figures = pickle.loads(kept.read_bytes())
    check_outputs(nb, figures, f"{name} on {prompts}")
    if name == "explore_attention_drift.ipynb":  # kvscope.view(ds): the explorer as a Panel/Bokeh app in the page
        shown = [o for o in nb.cells[-2].outputs if o.output_type == "execute_result"]
        assert shown and "application/vnd.holoviews_exec.v0+json" in shown[0]["data"]
        assert '"heatmap"' in shown[0]["data"]["text/html"]  # the heatmap figure, named, in the embedded document
        outputs = [o for c in nb.cells for o in c.get("outputs", [])]
        table = next(o["data"]["text/plain"] for o in outputs if "95% CI" in str(o.get("data")))
        no_interval = "none: one sample, so no between-prompt interval"
        assert (no_interval in table) == (prompts == "one prompt")


# -- the figures' one-sample cases, on synthetic stores (fast) ---------------------------------------------------


@pytest.fixture(scope="module", params=[1, 2], ids=["one sample", "two samples"])
def synthetic(request, tmp_path_factory):
    from kvscope.storage.synthetic import write_synthetic_store

    out = tmp_path_factory.mktemp("synthetic") / "s.zarr"
    write_synthetic_store(out, n_samples=request.param, n_steps=48, n_layers=2, n_kv=2, prompt_len=120)
    return kvscope.open_trace(out)


def test_the_fmm_figure_shows_its_curve_and_says_when_there_is_no_interval(synthetic):
    fmm = A.FMM(horizon=8, n_boot=20, local=8)
    r = fmm(synthetic)
    assert np.nanmin(r["curve"].values) > 0.05  # random rows: much of the future mass is missed
    fig = fmm.plot(r)
    assert_every_axes_draws_data(fig, "FMM")
    ax = fig.axes[0]
    assert np.nanmax(r["curve"].values) < ax.get_ylim()[1]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    one = synthetic.sizes["sample"] == 1
    assert ("no 95% CI: one sample, so no between-prompt interval" in labels) == one
    assert ("95% CI" in labels) == (not one)


def test_the_fmm_figure_of_a_trace_too_short_for_any_horizon_says_why(tmp_path):
    from kvscope.storage.synthetic import write_synthetic_store

    store = write_synthetic_store(tmp_path / "short.zarr", n_samples=1, n_steps=1, n_layers=1, n_kv=1, prompt_len=40)
    ds = kvscope.open_trace(store)
    fmm = A.FMM(horizon=8, n_boot=20)
    r = fmm(ds)
    ax = fmm.plot(r).axes[0]
    assert "no event scored" in " ".join(t.get_text() for t in ax.texts)
    rows = dict(fmm.table(fmm.summary(r)))
    assert rows["FMM(H=1)"] == "n/a: no event has 1 later steps"


def test_rank_trajectories_show_candidates_only(synthetic):
    drift = A.Drift(local=8)
    d = drift(synthetic)
    fig = drift.plot_ranks(d)
    assert_every_axes_draws_data(fig, "ranks")
    for line in fig.axes[0].get_lines():
        y = line.get_ydata()
        assert np.isfinite(y).any() and np.nanmin(y) >= 0  # a rank, never the −1 of "not a candidate"


def test_lir_and_churn_say_why_a_number_cannot_exist():
    lir, churn = A.LIR(), A.Churn()
    base = {"m": 4, "H_lir": 8, "delta": 1, "granularity": "window", "ci95": [None, None], "ci": "none"}
    rows = dict(lir.table({**base, "lir": None, "eligible": 0, "reactivated": 0, "p01": None, "p10": 0.5}))
    assert rows["Global LIR (m=4, H_lir=8)"] == (
        "n/a: no eligible episode (a selected window missing 4 events in a row with 8 events after it inside the trace)"
    )
    assert rows["P01 cold→hot (δ=1)"] == "n/a: no unselected window with a candidate event 1 later"
    assert rows["P10 hot→cold"] == "0.500"
    rows = dict(churn.table({"churn": None, "ci95": [None, None], "ci": "none"}))
    assert rows["mean churn (Jaccard distance)"] == "n/a: fewer than two events in the trace"
