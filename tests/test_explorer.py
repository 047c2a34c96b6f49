"""The attention explorer (kvscope view): what it reads, the pages it serves and writes,
driven in a real headless Chromium (Debian's ``chromium``; `.ci/run` installs it)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvscope.explorer.data import Rect, TierView, TraceView, cells
from kvscope.explorer.overlays import Replayed
from kvscope.storage.synthetic import dataset_from_rows
from kvscope.windows import window_sums

from .conftest import one_line_error, run_cli

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


# -- what a view reads (no browser) -----------------------------------------------------


def test_cells_are_means_of_the_positions_that_exist():
    x = np.array([[1, 2, 3, np.nan, 5], [np.nan, np.nan, np.nan, np.nan, 7]], dtype=np.float64)
    got = cells(x, 1, 2)
    np.testing.assert_array_equal(got, [[1.5, 3.0, 5.0], [np.nan, np.nan, 7.0]])
    np.testing.assert_array_equal(cells(x, 2, 5), [[(1 + 2 + 3 + 5 + 7) / 5]])
    assert np.array_equal(cells(x, 1, 1), x, equal_nan=True)


def test_rect_fits_the_view_to_at_most_one_cell_per_pixel():
    r = Rect.fitted((0, 100), (0, 4096), 100, 4096, rows=50, cols=800)
    assert (r.dy, r.dx) == (2, 6) and r.shape == (50, 683) and not r.exact
    z = Rect.fitted((10.4, 20.2), (99.5, 300.1), 100, 4096, rows=50, cols=800)
    assert (z.t0, z.t1, z.p0, z.p1) == (10, 21, 99, 301) and z.exact
    edge = Rect.fitted((-5, 500), (4000, 9999), 100, 4096, rows=400, cols=800)
    assert (edge.t0, edge.t1, edge.p0, edge.p1) == (0, 100, 4000, 4096)


def _rows(rng, S=6, T=40, P=30, L=2, H=2):
    a = rng.random((1, S, L, H, T)).astype(np.float32)
    qpos = P - 1 + np.arange(S)
    future = np.arange(T)[None, :] > qpos[:, None]  # [step, pos]
    a = np.where(future[None, :, None, None, :], np.nan, a)
    a = np.where(np.isnan(a), np.nan, a / np.nansum(a, -1, keepdims=True))
    return a


def test_heats_equal_a_naive_mean_and_refuse_what_is_not_a_probability():
    rng = np.random.default_rng(0)
    a = _rows(rng)
    ds = dataset_from_rows(a, prompt_len=30, n_steps=5)
    view = TraceView(ds)
    rect = Rect(1, 6, 3, 39, dy=2, dx=4)
    got = view.heats(0, 1, rect)  # [head, row, col]
    for h in range(2):
        x = a[0, 1:6, 1, h, 3:39].copy()
        x[4:] = np.nan  # step 5 is past n_steps
        for i in range(3):
            for j in range(9):
                cell = x[2 * i : 2 * i + 2, 4 * j : 4 * j + 4]
                want = np.nanmean(cell) if np.isfinite(cell).any() else np.nan
                np.testing.assert_allclose(got[h, i, j], want, rtol=1e-6, equal_nan=True)
    bad = a.copy()
    bad[0, 2, 1, 0, 7] = 1.5
    with pytest.raises(Exception, match=r"step 2, layer 1, kv_head 0, position 7 holds 1.5"):
        TraceView(dataset_from_rows(bad, prompt_len=30)).heats(0, 1, rect)


def test_window_store_gives_each_position_its_window_mean():
    rng = np.random.default_rng(1)
    a = _rows(rng, T=36, P=30)
    tok = dataset_from_rows(a, prompt_len=30, w=8, n_sink=4)
    win = window_sums(a, 4, 8, 4)  # [sample, step, layer, head, window]
    ds = tok.drop_vars("attn").assign(
        attn=(("sample", "step", "layer", "kv_head", "window"), win),
        attn_sink=(("sample", "step", "layer", "kv_head", "sink"), a[..., :4]),
    )
    ds = ds.drop_dims("pos").assign(
        tokens=(("sample", "pos"), np.zeros((1, 36), np.int32)), prefill_colsum=tok.prefill_colsum
    )
    ds.attrs["resolution"] = "window"
    view = TraceView(ds)
    assert view.n_pos == 36
    got = view.probabilities(0, 0, 0, 6)[1]  # [step, pos] of head 1
    t = 2  # query 31: windows 0..3 exist up to position 31
    np.testing.assert_allclose(got[t, :4], a[0, t, 0, 1, :4], rtol=1e-6)
    np.testing.assert_allclose(got[t, 4:12], np.full(8, np.nansum(a[0, t, 0, 1, 4:12]) / 8), rtol=1e-6)
    assert np.isnan(got[t, 32:]).all()
    from kvscope.analysis import churn
    from kvscope.explorer.summary import summaries

    side = summaries(ds)  # window sums: FMM, churn, LIR, concentration; no token rows for peaks
    assert side["peaks"]["distance"] == [] and np.isnan(side["numbers"]["value"][3])
    np.testing.assert_equal(side["numbers"]["value"][1], float(churn(ds)["mean"]))  # one event: NaN, no pair


def test_tier_overlay_takes_the_latest_event_and_the_lowest_tier_of_a_cell():
    import xarray as xr

    # events at steps 0 and 2; 1 sample, 1 layer, 1 kv head, 6 positions
    tiers = np.array([[2, 2, 1, 0, -1, -1], [2, 0, 0, 1, 2, -1]], dtype=np.int8)
    result = xr.Dataset(
        {
            "tiers": (
                ("policy", "budget", "sample", "event", "layer", "kv_head", "pos"),
                tiers[None, None, None, :, None, None, :],
            ),
            "tier_mass": (
                ("policy", "budget", "sample", "event", "layer", "kv_head", "tier"),
                np.zeros((1, 1, 1, 2, 1, 1, 3)),
            ),
        },
        coords={"policy": ["p"], "budget": [0.5], "event_step": ("event", [0, 2]), "tier": ["FP", "Q", "EVICTED"]},
    )
    overlay = Replayed(TierView(result), "p", 0.5)
    exact = overlay.cells(0, 0, Rect(0, 5, 0, 6), n_steps=4)[0]  # codes tier + 1, 0 = none
    np.testing.assert_array_equal(exact[:2], [[3, 3, 2, 1, 0, 0]] * 2)
    np.testing.assert_array_equal(exact[2:4], [[3, 1, 1, 2, 3, 0]] * 2)
    np.testing.assert_array_equal(exact[4], [0] * 6)  # step 4 is past the sample's 4 steps
    coarse = overlay.cells(0, 0, Rect(0, 4, 0, 6, dy=2, dx=3), n_steps=4)[0]
    np.testing.assert_array_equal(coarse, [[2, 1], [1, 2]])


def test_trace_overlays_map_the_oracle_selection_and_logquant_sets_to_positions():
    from kvscope.analysis import FMM
    from kvscope.explorer.overlays import HistoryOracle, LogQuantFP
    from kvscope.policies.logquant import fp_sets_per_step

    rng = np.random.default_rng(2)
    a = _rows(rng, S=20, T=130, P=111, L=1, H=2)
    ds = dataset_from_rows(a, prompt_len=111, n_steps=19, w=8, n_sink=4)
    codes = HistoryOracle(ds).codes(0, 0, 0, 20, 0, 130)  # [H, step, pos]
    m = FMM(layers=[0])
    prep = m.prepare(ds)
    sel = prep.history_selection(8, m.top_frac, m.local).isel(sample=0, layer=0)  # [event, H, window]
    steps = sel["event_step"].values
    assert list(steps) == [0, 8, 16]
    assert (codes[:, 19] == -1).all()  # step 19 is past the sample's 19 steps
    for t in range(19):
        e = np.searchsorted(steps, t, side="right") - 1
        qpos = 110 + t
        for h in range(2):
            row = codes[h, t]
            assert (row[qpos + 1 :] == -1).all() and (row[:4] == 2).all()  # nothing yet; sinks kept
            for j in range(sel.sizes["window"]):
                span = row[4 + 8 * j : min(12 + 8 * j, qpos + 1)]
                want = 0 if int(sel.values[e, h, j]) == 0 else 2
                assert (span == want).all(), (t, h, j)
    assert (codes == 0).any() and (codes == 2).any()
    lq = LogQuantFP(ds, W=4).codes(0, 0, 0, 19, 0, 130)[1]  # [step, pos] of head 1
    for t, fp in enumerate(fp_sets_per_step(111, 19, 4)):
        want = np.where(np.arange(130) <= 110 + t, 1, -1)
        want[list(fp)] = 2
        np.testing.assert_array_equal(lq[t], want)


def test_page_cells_bound_the_page():
    from kvscope.explorer.static import MIN_CELLS, PAGE_BYTES, page_cells

    for steps, pos, heats, tiers in ((128, 1024, 90, 0), (256, 32768, 2048, 8 * 2048), (16, 300, 90, 270)):
        rows, cols = page_cells(steps, pos, heats, tiers)
        assert rows <= steps and cols <= pos
        assert rows * cols * (4 * heats + tiers) <= max(PAGE_BYTES, MIN_CELLS * (4 * heats + tiers))


# -- a real trace, its replay, the CLI ----------------------------------------------------


@pytest.fixture(scope="module")
def replayed(small_qkv_trace, tmp_path_factory) -> Path:
    import kvscope

    out = tmp_path_factory.mktemp("explorer") / "r.zarr"
    kvscope.replay(str(small_qkv_trace), ["h2o", "logquant", "oracle"], [0.4], out=str(out), errors=False, forced=True)
    return out


def test_view_refuses_bad_input(small_qkv_trace, replayed, tmp_path):
    one_line_error(run_cli("view", tmp_path), "")
    other = tmp_path / "other.zarr"
    from kvscope.storage.synthetic import write_synthetic_store

    write_synthetic_store(other, n_samples=1, n_steps=8, n_layers=2, n_kv=3, prompt_len=40, block_steps=8)
    import kvscope

    kvscope.replay(str(other), ["h2o"], [0.5], out=str(tmp_path / "other-r.zarr"), errors=False)
    one_line_error(run_cli("view", small_qkv_trace, "--replay", tmp_path / "other-r.zarr"), "does not match the trace")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        one_line_error(
            run_cli("view", small_qkv_trace, "--port", port, timeout=120), f"cannot listen on 127.0.0.1:{port}"
        )
    one_line_error(run_cli("view", small_qkv_trace, "--port", "70000"), "is not a port")
    one_line_error(run_cli("view", small_qkv_trace, "--html", tmp_path / "page.png"), "ending in .html")


def test_zoom_reads_exact_rows_once_a_cell_is_one_position(small_qkv_trace):
    """The served app's callback path, in process: a zoomed-out view is aggregated, a zoom to
    fewer positions than pixels draws the stored rows themselves."""
    import kvscope
    from kvscope.explorer.app import Explorer, load

    ds = kvscope.open_trace(small_qkv_trace)
    app = Explorer(load(ds), cells=(8, 64))
    first = app.main.source.data
    assert (first["dy"][0], first["dx"][0]) == (2, 5) and "cells of 2 steps × 5 positions" in app.main.fig.title.text

    class Zoom:  # what Bokeh's RangesUpdate carries
        x0, x1, y0, y1 = 100.2, 150.7, 12.0, 4.0

    app._on_range(Zoom)
    data = app.main.source.data
    assert (data["x"][0], data["y"][0], data["dx"][0], data["dy"][0]) == (100, 4, 1, 1)
    want = ds.attn.isel(sample=0, layer=0, kv_head=0, step=slice(4, 12), pos=slice(100, 151)).values.astype(np.float32)
    np.testing.assert_array_equal(data["image"][0], want)
    assert "exact rows" in app.main.fig.title.text


# -- in a real browser ---------------------------------------------------------------------

BROWSER_REQUIRED = os.environ.get("KVSCOPE_BROWSER_REQUIRED") == "1"


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        if BROWSER_REQUIRED:
            pytest.fail("chromium is not installed (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def served(small_qkv_trace, replayed):
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvscope", "view", str(small_qkv_trace), "--replay", str(replayed)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("kvscope view: http://127.0.0.1:"), line + proc.stderr.read()
    yield line.split()[2]
    proc.terminate()
    proc.wait(30)


class Page:
    """A page of the explorer in Chromium, with what its console said."""

    def __init__(self, browser, url: str):
        self.page = browser.new_page(viewport={"width": 1500, "height": 1200})
        self.problems: list[str] = []
        self.page.on("console", lambda m: self.problems.append(m.text) if m.type in ("error", "warning") else None)
        self.page.on("pageerror", lambda e: self.problems.append(str(e)))
        self.page.goto(url)
        self.page.wait_for_selector("canvas", timeout=60_000)
        self.wait_for(
            lambda: self.js(
                "() => Bokeh.documents.length > 0 && Bokeh.documents[0].get_model_by_name('heatmap') !== null"
            )
        )

    def js(self, code: str, arg=None):
        return self.page.evaluate(code, arg)

    def wait_for(self, condition, timeout: float = 60.0):
        end = time.time() + timeout
        while not condition():
            assert time.time() < end, f"timed out; console: {self.problems}"
            time.sleep(0.1)

    def image_sum(self, name: str) -> float:
        return self.js(
            """(name) => { const img = Bokeh.documents[0].get_model_by_name(name).data.image[0];
               let s = 0; for (const v of img) if (!Number.isNaN(v)) s += v; return s; }""",
            name,
        )

    def choose(self, widget: str, value: str) -> None:
        self.page.locator(f".kv-{widget} select").select_option(value)

    def at(self, pos: float, step: float, figure: str = "heatmap") -> tuple[float, float]:
        """Page coordinates of a data point of a figure."""
        return self.js(
            """([name, x, y]) => { const v = Bokeh.index.find_one(Bokeh.documents[0].get_model_by_name(name));
               const r = v.canvas_view.el.getBoundingClientRect();
               return [r.left + v.frame.x_scale.compute(x), r.top + v.frame.y_scale.compute(y)]; }""",
            [figure, pos, step],
        )

    def hover(self, pos: float, step: float) -> str:
        self.page.mouse.move(*self.at(pos, step))
        tip = self.page.locator(".bk-tooltip-content").first
        tip.wait_for(timeout=10_000)
        return tip.inner_text()

    def shot(self, path: Path, figure: str = "heatmap") -> np.ndarray:
        from PIL import Image

        view = self.js(
            """(name) => { const r = Bokeh.index.find_one(Bokeh.documents[0].get_model_by_name(name)).el.getBoundingClientRect();
               return [r.left, r.top, r.width, r.height]; }""",
            figure,
        )
        self.page.screenshot(path=str(path), clip=dict(zip(("x", "y", "width", "height"), view)))
        return np.asarray(Image.open(path).convert("RGB")).astype(int)


def _expected_hover(trace_path, pos: int, step: int) -> tuple[str, str]:
    """The tooltip's key and query lines, from the tokenizer of the trace's model."""
    import json

    import kvscope
    from kvscope.explorer.labels import decoder

    ds = kvscope.open_trace(trace_path)
    decode = decoder(ds.attrs["model"])
    ids = ds.tokens.isel(sample=0).values
    q = int(ds.query_pos.values[0, step])
    key = decode([ids[pos]])[0]
    assert key.strip() and not key.startswith("#"), "the tokenizer of the trace's model was not found"
    return f"{pos} {json.dumps(key, ensure_ascii=False)}", f"{step} q={q} {decode([ids[q]])[0]!r}"


def _check_explorer(page: Page, trace_path, shots: Path, served: bool) -> None:
    """Loads clean, draws, switches layer and policy, hovers the right token, taps a layer."""
    page.wait_for(lambda: "FMM" in page.js("() => Bokeh.documents[0].get_model_by_name('status').text"))
    first = page.shot(shots / "heatmap.png")
    assert first.std() > 10 and (first < 250).any(axis=-1).mean() > 0.2, "the heatmap is blank"
    before = page.image_sum("heatmap-heat")
    page.choose("layer", "5")
    page.wait_for(lambda: page.image_sum("heatmap-heat") != before)
    assert np.abs(page.shot(shots / "layer5.png") - first).sum() > 0
    tiers = page.image_sum("heatmap-tiers")
    page.choose("policy", "logquant")
    page.wait_for(lambda: page.image_sum("heatmap-tiers") != tiers)
    # the model's output under logquant's cache, per step (forced replay): every decode step but the first
    forced = "() => Bokeh.documents[0].get_model_by_name('forced-kl').data.kl"
    page.wait_for(lambda: len(page.js(forced)) == 16)
    assert page.js("() => Bokeh.documents[0].get_model_by_name('forced-fig').visible") and max(page.js(forced)) > 0
    page.choose("policy_b", "history oracle")  # an overlay from the trace itself
    page.wait_for(lambda: page.js("() => Bokeh.documents[0].get_model_by_name('heatmap-b').visible"))
    key, query = _expected_hover(trace_path, 10, 3)
    tip = page.hover(10.5, 3.5)
    assert key in tip and query in tip, (key, query, tip)
    page.page.mouse.click(*page.at(7, 0.5, "per-layer"))  # layer 7's column
    page.wait_for(lambda: page.js("() => Bokeh.documents[0].get_model_by_name('layer').value") == "7")
    page.page.screenshot(path=str(shots / ("served.png" if served else "static.png")), full_page=True)
    assert not page.problems, page.problems


def test_served_page_in_chromium(browser, served, small_qkv_trace, tmp_path):
    page = Page(browser, served)
    _check_explorer(page, small_qkv_trace, tmp_path, served=True)


def test_server_serves_nothing_but_the_app(served, small_qkv_trace):
    """No request names a file: the trace's own files, traversals and package files are refused."""
    import urllib.error
    import urllib.request

    def status(path: str) -> int:
        try:
            with urllib.request.urlopen(served + path, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert status("") == 200
    for path in (
        "static/../../../../etc/passwd",
        "static/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        "components/kvscope/cli.py",
        "components/panel/../../../../etc/passwd",
        f"{str(small_qkv_trace).lstrip('/')}/zarr.json",
        "zarr.json",
    ):
        assert status(path) in (400, 403, 404), path


def test_static_page_in_chromium(browser, small_qkv_trace, replayed, tmp_path):
    out = tmp_path / "page.html"
    proc = run_cli("view", small_qkv_trace, "--replay", replayed, "--html", out, check=True)
    assert proc.stdout.startswith(f"wrote {out}")
    page = Page(browser, out.as_uri())
    _check_explorer(page, small_qkv_trace, tmp_path, served=False)


def test_the_answers_table_follows_the_chosen_beta_in_chromium(browser, tmp_path):
    """The samples × policies table of a result with answers (tests/test_task_accuracy.py) redraws
    when β changes: Bokeh redraws a table only when its rows change, unless told."""
    from kvscope.explorer.static import write_html

    from .test_task_accuracy import explorer_inputs, result_with_answers

    ds, result = explorer_inputs(result_with_answers())
    out = tmp_path / "answers.html"
    write_html(ds, result, out, tokens="ids")
    page = Page(browser, out.as_uri())

    def row(sample: int) -> list[str]:  # sample, task, full KV, full, h2o, snapkv
        return page.page.locator(".slick-cell").all_inner_texts()[6 * sample : 6 * sample + 6]

    page.wait_for(lambda: row(1) == ["1", "a", "1", "1", "lost", "lost"])  # β = 0.2
    page.choose("budget", "0.5")
    page.wait_for(lambda: row(1) == ["1", "a", "1", "1", "1", "1"])
    assert row(4) == ["4", "b", "0", "0", "gained", "0"] and row(2)[5] == "gained"
    # Bokeh's "could not set initial ranges": this synthetic trace's side views give it, answers or not
    assert [p for p in page.problems if "could not set initial ranges" not in p] == []
