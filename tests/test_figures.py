"""Figures are legible where they are read: every text of every figure kvscope draws shows at
9 pt or more at the width the documentation site gives it (kvscope.figures: one style for the
project). The figures of the metrics, of replay results and of the benchmark history are drawn
here and measured; the committed figures of docs/figures are read back from their PNGs; the
explorer's Bokeh figures are checked for their text sizes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import kvscope
from kvscope import analysis as A
from kvscope import figures
from kvscope.plots import plot_allocation, plot_compare, plot_tiers
from kvscope.storage.synthetic import toy_trace

ROOT = Path(__file__).resolve().parents[1]


def test_shown_points_by_hand():
    # 9 pt in a figure 8 in wide at 120 dpi: 15 px in a 960-px image, shown at 800 px: 12.5 px = 9.375 pt
    assert figures.shown_points(9, 960, 120) == pytest.approx(9.375)
    # an image narrower than the column is shown at its own width: 9 pt at 96 dpi is 12 px = 9 pt
    assert figures.shown_points(9, 600, 96) == pytest.approx(9.0)
    # the legends that were too small: 7 pt in 13 in at 110 dpi (1430 px) showed at 6 px = 4.5 pt
    assert figures.shown_points(7, 1430, 110) == pytest.approx(7 * 110 / 72 * 800 / 1430 * 0.75)


def test_a_small_text_or_a_wide_figure_is_caught():
    fig, ax = figures.axes()
    ax.set_title("fine")
    assert figures.smallest_shown(fig) >= figures.MIN_PT
    ax.legend(handles=ax.plot([0, 1], label="tiny")[:1], fontsize=6)
    assert figures.smallest_shown(fig) < figures.MIN_PT
    from matplotlib.figure import Figure

    wide = Figure(figsize=(15, 4))
    wide.subplots().set_title("drawn 15 in wide, shown at 800 px", fontsize=10)
    assert figures.smallest_shown(wide) < figures.MIN_PT


@pytest.fixture(scope="module")
def toy():
    return toy_trace()


@pytest.fixture(scope="module")
def replayed(toy):
    r = kvscope.replay(toy, ["streaming", "h2o", "qevict:local=0:q_frac=0.3", "kivi"], [0.5, 0.75], horizon=3)
    a = kvscope.replay(toy, ["h2o", "logquant"], [0.5], allocations=["uniform", "pyramid"], horizon=3)
    return r, a


def metric_figures(ds):
    yield "fmm", A.FMM(horizon=3, top_frac=0.5, local=0).plot(A.fmm(ds, horizon=3, top_frac=0.5, local=0))
    yield "churn", A.Churn().plot(A.churn(ds, top_frac=0.5, local=0))
    yield "lir", A.LIR().plot(A.lir(ds, top_frac=0.5, local=0))
    yield "concentration", A.Concentration().plot(A.concentration(ds))
    yield "peaks", A.Peaks().plot(A.peaks(ds, k=2, logquant_window=2, n_boot=10))
    drift = A.Drift(top_frac=0.5, local=0)
    result = drift(ds)
    yield "drift", drift.plot(result)
    yield "drift ranks", drift.plot_ranks(result)


def test_every_metric_draws_legibly(toy):
    names = []
    for name, fig in metric_figures(toy):
        names.append(name)
        assert fig.get_figwidth() <= figures.WIDTH, name
        assert figures.smallest_shown(fig) >= figures.MIN_PT, (name, figures.smallest_text(fig))
    assert {n.split()[0] for n in names} == set(A.available())  # every registered metric drawn


def test_replay_figures_draw_legibly(replayed):
    r, a = replayed
    with_errors = r.assign(output_rel_l2_mean=r["fmm_mean"])  # the three-panel layout (q/k/v recorded)
    drawn = {
        "compare": plot_compare(r),
        "compare with output errors": plot_compare(with_errors),
        "tiers": plot_tiers(r, "h2o", 0.5),
        "allocation": plot_allocation(a, "h2o", 0.5),
    }
    assert len(drawn["compare with output errors"].axes) == 3
    for name, fig in drawn.items():
        assert fig.get_figwidth() <= figures.WIDTH, name
        assert figures.smallest_shown(fig) >= figures.MIN_PT, (name, figures.smallest_text(fig))


def _png(path: Path) -> tuple[int, float, float]:
    """(width px, dpi, smallest text pt recorded by kvscope.figures.save) of a PNG."""
    with Image.open(path) as im:
        assert figures.PNG_KEY in im.info, f"{path.name} was not saved through kvscope.figures.save"
        return im.size[0], float(im.info["dpi"][0]), float(im.info[figures.PNG_KEY])


def test_the_benchmark_history_draws_legibly(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import history

    runs = history.load_runs(ROOT / "benchmarks" / "results")
    # one plot function draws them all: the two with the most panels and the most legend entries
    panels = max(runs, key=lambda n: len(history.HEADLINES.get(n, {})))
    entries = max(runs, key=lambda n: len({history.machine_id(r.get("machine")) for r in runs[n]}) + len(runs[n]))
    drawn = [name for name in {panels, entries} if history.plot(name, runs[name], tmp_path / f"{name}.png")]
    assert drawn
    for name in drawn:
        width, dpi, smallest = _png(tmp_path / f"{name}.png")
        assert figures.shown_points(smallest, width, dpi) >= figures.MIN_PT, name


COMMITTED = sorted((ROOT / "docs" / "figures").glob("*.png"))


@pytest.mark.parametrize("path", COMMITTED, ids=[p.name for p in COMMITTED])
def test_the_committed_figures_are_legible_at_the_width_shown(path):
    width, dpi, smallest = _png(path)
    assert figures.shown_points(smallest, width, dpi) >= figures.MIN_PT
    assert path.stat().st_size < (200_000 if path.name.startswith("concepts_") else 1_000_000)


def test_every_committed_figure_is_shown_and_every_shown_figure_exists():
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    shown = {m for p in pages for m in re.findall(r"figures/([\w.-]+\.png)", p.read_text())}
    assert shown == {p.name for p in COMMITTED}


def _font_sizes(model) -> list[str]:
    sizes = []
    for ref in model.references():
        for name in ref.properties():
            if name.endswith("text_font_size"):
                value = getattr(ref, name)
                value = value.get("value") if isinstance(value, dict) else getattr(value, "value", value)
                sizes.append(str(value))
    return sizes


def _px(size: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(px|pt|em)", size).groups()
    return float(number) * {"px": 1.0, "pt": 96 / 72, "em": 16.0}[unit]


def test_the_explorer_text_is_legible():
    from bokeh.models import ColumnDataSource as Source

    from kvscope.explorer.figures import Heatmap, SideViews, shared_ranges

    x, y = shared_ranges(8, 18)
    views = SideViews(3)
    models = [Heatmap("h", "title", Source({}), Source({}), x, y).fig, views.per_layer, views.fmm_h, views.peak_fig,
              views.top_fig, views.tier_fig]  # fmt: skip
    sizes = [s for m in models for s in _font_sizes(m)]
    assert sizes and min(_px(s) for s in sizes) >= figures.MIN_PT * 96 / 72, sorted(set(sizes))
    assert np.isclose(_px(figures.BOKEH_PX), 12.0)
