"""Lossy row formats (kvscope.storage.rowformat) and ``kvscope compact``: the rounding's bound by hand and
as a property, a compacted real trace against its original (rows, every other array, metrics),
the format recorded and reported, bad inputs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvscope.errors import KvscopeError
from kvscope.storage.rowformat import FORMATS, RowFormat, row_format
from tests.conftest import one_line_error, run_cli, run_main, tree_digest

NAN = np.float16(np.nan)


def test_rounding_by_hand():
    """fp16 values rounded to 3 and 4 mantissa bits, worked out by hand."""
    x = np.array([0.3, 0.1234, 1e-5, 6e-8, 0.999, 1.0, 0.0, np.nan], dtype=np.float16)
    # 0.3 = 1.2·2^-2 → 1.25·2^-2 (3 bits: eighths); 0.1234 = 1.974·2^-4 → 2·2^-4 (carries into
    # the exponent); 1e-5 = 168·2^-24 (subnormal) → 128·2^-24 (units of 2^7); 6e-8 = 1·2^-24 → 0;
    # 0.999 = 1.998·2^-1 → 1; 1, 0 and NaN unchanged
    want3 = [0.3125, 0.125, 2.0**-17, 0.0, 1.0, 1.0, 0.0, np.nan]
    np.testing.assert_array_equal(row_format("round3").round(x, 4, 8).astype(np.float64), want3)
    # 4 bits (sixteenths): 1.2 → 1.1875 (19/16), 1.974 → 2, 168 → 192 (units of 2^6 = 64: 2.625 → 3)
    want4 = [1.1875 / 4, 0.125, 192 * 2.0**-24, 0.0, 1.0, 1.0, 0.0, np.nan]
    np.testing.assert_array_equal(row_format("round4").round(x, 4, 8).astype(np.float64), want4)
    assert row_format("round4").slack == 2.0**-5 and row_format("exact").slack == 0


def test_peaks_keep_each_rows_largest_values():
    """``-peaks``: the row's k + n_sink + 1 largest values (and anything that would round up to
    the smallest of them) are kept exactly; the rest are rounded and stay below them."""
    fmt = row_format("round2-peaks")
    n_sink = 1
    keep = RowFormat.kept(n_sink)  # 8 + 1 + 1
    assert keep == 10
    row = np.array([0.2, 0.11, 0.1, 0.09, 0.0901, 0.08, 0.07, 0.06, 0.05, 0.04, 0.0399, 0.03, 0.02, NAN], np.float16)
    out = fmt.round(row, n_sink, 8)
    top = np.argsort(-np.nan_to_num(row.astype(np.float64), nan=-1))[:keep]
    np.testing.assert_array_equal(out[top], row[top])  # the ten largest, exact
    # 0.0399 rounds (2 bits) to 0.0391 < 0.04: rounded; 0.03 → 0.0312, 0.02 → 0.0195
    np.testing.assert_array_equal(out[10:13].astype(np.float64), [0.0390625, 0.03125, 0.01953125])
    assert np.isnan(out[-1])
    assert (out[10:13] < row[top].min()).all()


def test_carried_rounding_by_hand():
    """``-carry``: each rounding error is added to the next value of its window before that is
    rounded (2 bits: a value in [2^e, 2^e+1) lands on a multiple of 2^(e-2)); NaN and zeros pass
    the carry on; a window's sum is off by its last carry only."""
    x = np.array([11 / 32, 1 / 64, np.nan, 7 / 64, 0.3, 0.0], dtype=np.float16)
    # 4 sinks (one window), then windows of 8: 11/32 = 1.375·2^-2, a tie between 1.25 and 1.5 →
    # 1.5 (even) = 0.375, carry −1/32; 1/64 − 1/32 < 0 → 0, carry −1/64; NaN passes it;
    # 7/64 − 1/64 = 1.5·2^-4 → 0.09375, carry 0 (the sinks' sum exact); the next window: fp16
    # 0.3 = 0.300048828125 → 0.3125 (2^-4 steps), carry −0.012451171875; the zero stays 0
    want = [0.375, 0.0, np.nan, 0.09375, 0.3125, 0.0]
    carry = row_format("round2-carry")
    d = carry.round(x, 4, 8)
    np.testing.assert_array_equal(d.astype(np.float64), want)
    assert np.nansum(d.astype(np.float64)) - np.nansum(x.astype(np.float64)) == 0.012451171875  # −c_n
    # plain 2-bit rounding keeps 1/64 and 7/64 (on the grid) and is off by 0.0437 in sum; so is
    # the carry with 1 sink and windows of 2: 11/32's error stays in its window (the sink)
    plain = row_format("round2").round(x, 4, 8)
    assert np.nansum(plain.astype(np.float64)) - np.nansum(x.astype(np.float64)) == 0.043701171875
    np.testing.assert_array_equal(carry.round(x, 1, 2), plain)
    fmt = row_format("round3-peaks-carry")
    assert (fmt.keepbits, fmt.peaks, fmt.carry, fmt.slack) == (3, True, True, 1 / 15)  # h/(1−h), h = 1/16
    assert fmt.attrs(4) == {
        "format": "round3-peaks-carry", "lossy": True, "keepbits": 3, "relative_error": 1 / 15,
        "error_carried": True, "kept_exact_per_row": 13,
    }  # fmt: skip
    assert RowFormat.of({"row_format": fmt.attrs(4), "n_sink": 4}) == fmt


@settings(max_examples=200, deadline=None)
@given(
    arrays(np.uint16, st.integers(1, 64), elements=st.integers(0, 0x3C00)),  # fp16 bit patterns of 0 … 1
    st.sampled_from([f for f in FORMATS if f != "exact"]),
    st.integers(0, 4),
)
def test_rounding_stays_within_its_bound(bits, name, n_sink):
    """|stored − exact| ≤ 2^-(K+1)·max(p, 2^-14) for every fp16 value in [0, 1] (``-carry``:
    2s·max(its window's largest, 2^-14), here the row's largest), every format; zeros stay
    zero, nothing exceeds 1."""
    x = bits.view(np.float16)
    fmt = row_format(name)
    d = fmt.round(x, n_sink, 8)
    err = np.abs(d.astype(np.float64) - x.astype(np.float64))
    assert (err <= fmt.bound(x.astype(np.float64), top=float(x.max()))).all()
    assert (d[x == 0] == 0).all() and (d <= 1).all()


@settings(max_examples=100, deadline=None)
@given(
    arrays(np.uint16, st.tuples(st.integers(1, 3), st.integers(1, 48)), elements=st.integers(0, 0x3C00)),
    st.sampled_from([f for f in FORMATS if f.endswith("-carry")]),
    st.integers(0, 5),
    st.integers(1, 9),
    st.integers(0, 2**31),
)
def test_carried_errors_stay_within_one_carry(bits, name, n_sink, w, seed):
    """``-carry`` rows (NaN beyond a random end, and a few inside): in every window (the sinks, then ``w`` at a
    time; each value alone when ``w = 1``, rows of windows) every prefix's sum error is one carry, |Σ_{a≤i≤b} (d_i − p_i)| ≤ s·max(M, 2^-14),
    M the window's largest rounded value; ``-peaks-carry`` keeps each row's largest values
    exact, every rounded one below them."""
    x = bits.view(np.float16).copy()  # [row, pos]
    rng = np.random.default_rng(seed)
    ends = rng.integers(1, x.shape[1] + 1, size=x.shape[0])
    x[(np.arange(x.shape[1]) >= ends[:, None]) | (rng.random(x.shape) < 0.1)] = NAN  # and a few inside
    fmt = row_format(name)
    d = fmt.round(x, n_sink, w)
    assert np.array_equal(np.isnan(d), np.isnan(x)) and (d[x == 0] == 0).all()
    p, q = np.nan_to_num(x.astype(np.float64)), np.nan_to_num(d.astype(np.float64))  # [row, pos]
    kept = RowFormat.kept(n_sink)
    low = np.sort(p, axis=-1)[:, -kept:][:, :1] if fmt.peaks else np.inf  # [row, 1] the smallest kept
    starts = [*range(x.shape[1])] if w == 1 else [0, *range(n_sink or w, x.shape[1], w)]  # w = 1: rows of windows
    for a, b in zip(starts, [*starts[1:], x.shape[1]], strict=True):  # one window [a, b)
        big = np.where(p[:, a:b] < low, p[:, a:b], 0).max(-1, keepdims=True)  # [row, 1] ≥ M
        assert (np.abs(np.cumsum(q[:, a:b] - p[:, a:b], axis=-1)) <= fmt.slack * np.maximum(big, 2.0**-14)).all()
    if fmt.peaks:  # every value at or above the keep-th largest exact, every changed one below it
        assert (q[p >= low] == p[p >= low]).all()
        assert (q[q != p] < np.broadcast_to(low, q.shape)[q != p]).all()


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 2000),
    st.floats(0.1, 30),
    st.sampled_from(["round2", "round3-peaks", "round2-carry"]),
    st.integers(0, 2**31),
)
def test_rounded_rows_pass_the_widened_row_check(n, sharpness, name, seed):
    """Softmax rows in fp16, rounded: they sum to 1 within the format's tolerance (the check every
    reader runs with the store's slack)."""
    from kvscope.analysis.kernels import row_checks, rows_problem

    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(3, 1, n)) * sharpness
    p = np.exp(logits - logits.max(-1, keepdims=True))
    rows = (p / p.sum(-1, keepdims=True)).astype(np.float16)
    fmt = row_format(name)
    out = fmt.round(rows, 4, 8)
    assert rows_problem(row_checks(out, np.full(3, n - 1), fmt.slack)) is None


def _read(path, name):
    import zarr

    return zarr.open_group(str(path), mode="r")[name][...]


@pytest.fixture(scope="module")
def compacted(qkv_trace, tmp_path_factory):
    """The real SmolLM2 trace with q/k/v, compacted to round4-peaks through the command line."""
    out = tmp_path_factory.mktemp("compact") / "round4p.zarr"
    before = tree_digest(qkv_trace)
    proc = run_cli("compact", qkv_trace, out, "--rows", "round4-peaks", "--json", check=True)
    assert tree_digest(qkv_trace) == before  # the input untouched
    return out, json.loads(proc.stdout)


def test_compacted_store_rows_within_bound_and_the_rest_identical(qkv_trace, compacted):
    out, summary = compacted
    fmt = row_format("round4-peaks")
    for name in ("attn", "prefill_tail"):
        a, b = _read(qkv_trace, name).astype(np.float64), _read(out, name).astype(np.float64)
        assert np.array_equal(np.isnan(a), np.isnan(b))
        ok = ~np.isnan(a)
        assert (np.abs(a[ok] - b[ok]) <= fmt.bound(a[ok])).all()
        assert (a[ok] != b[ok]).mean() > 0.5  # most values were rounded
    for name in ("q", "k", "v", "prefill_colsum", "tokens", "query_pos", "rope_inv_freq"):
        np.testing.assert_array_equal(_read(qkv_trace, name), _read(out, name))
    assert summary["rows"] == "round4-peaks"
    assert summary["attn_out_bytes"] < 0.75 * summary["attn_in_bytes"]
    assert 0 < summary["attn_out_bytes"] / summary["attn_raw_bytes"] < 0.5


def test_compacted_metrics_stay_close(qkv_trace, compacted):
    """On the real trace: α of the peaks fit identical (each row's top values are exact), FMM,
    churn and coverage within 1e-3, replayed FMM of two policies within 1e-3 (measured in
    benchmarks/compact_formats.py on longer traces; the README's table)."""
    import kvscope
    from kvscope import analysis as A
    from kvscope.replay import replay

    out, _ = compacted
    docs = []
    for path in (qkv_trace, out):
        ds = kvscope.open_trace(path, chunks={})
        r = A.study(ds, ["fmm", "churn", "peaks"])
        docs.append({name: A.make(name).summary(v) for name, v in r.items()})
        res = replay(ds, ["h2o", "snapkv"], [0.3], errors=False)
        docs[-1]["replayed"] = res["fmm"].mean(["sample", "event", "layer", "kv_head"]).values
    a, b = docs
    assert a["peaks"]["alpha"] == b["peaks"]["alpha"]
    assert abs(a["fmm"]["fmm"] - b["fmm"]["fmm"]) < 1e-3
    assert abs(a["churn"]["churn"] - b["churn"]["churn"]) < 1e-3
    assert abs(a["peaks"]["coverage_logquant"] - b["peaks"]["coverage_logquant"]) < 1e-3
    np.testing.assert_allclose(a["replayed"], b["replayed"], atol=1e-3)


def test_format_recorded_and_reported(compacted):
    import kvscope

    out, _ = compacted
    ds = kvscope.open_trace(out)
    assert ds.kvscope.rows == row_format("round4-peaks")
    assert ds.attrs["row_format"] == {
        "format": "round4-peaks", "lossy": True, "keepbits": 4, "relative_error": 2.0**-5, "kept_exact_per_row": 13,
    }  # fmt: skip
    line = "rows: round4-peaks (lossy, ≤ 3.12% relative"
    info = run_main("info", out)
    assert info.returncode == 0 and line in info.stdout
    fmm = run_main("analyze", "fmm", out)
    assert fmm.returncode == 0 and line in fmm.stdout
    from_qk = run_main("analyze", "fmm", out, "--from-qk")  # rows recomputed from the exact q/k: not rounded
    assert from_qk.returncode == 0 and "rows:" not in from_qk.stdout
    doc = json.loads(run_main("analyze", "churn", out, "--json").stdout)
    assert doc["row_format"]["format"] == "round4-peaks"
    assert run_main("verify", out).returncode == 0


def test_bad_inputs_one_line(qkv_trace, compacted, tmp_path):
    out, _ = compacted
    target = tmp_path / "x.zarr"
    one_line_error(run_main("compact", qkv_trace, target, "--rows", "log8"), "is not a row format")
    one_line_error(run_main("compact", out, target, "--rows", "round3"), "already stores its rows as round4-peaks")
    one_line_error(run_main("compact", qkv_trace, out, "--rows", "round3"), "exists")
    partial = tmp_path / "partial.zarr"
    shutil.copytree(qkv_trace, partial)
    meta = json.loads((partial / "zarr.json").read_text())
    meta["attributes"]["status"] = "partial"
    (partial / "zarr.json").write_text(json.dumps(meta))
    one_line_error(run_main("compact", partial, target, "--rows", "round3"), "is a partial trace")
    assert not target.exists() and not list(tmp_path.glob(".x.zarr*"))
    # a rows attribute that no format writes is refused on open
    bad = tmp_path / "bad.zarr"
    shutil.copytree(out, bad)
    meta = json.loads((bad / "zarr.json").read_text())
    meta["attributes"]["row_format"]["keepbits"] = 7
    (bad / "zarr.json").write_text(json.dumps(meta))
    one_line_error(run_main("info", bad, "--quick"), "attribute row_format")
    with pytest.raises(KvscopeError, match="not a row format"):
        row_format("round9")


def test_carried_store_windows_within_one_carry(qkv_trace, tmp_path):
    """The real trace compacted to round3-peaks-carry (it passes verify with the format's
    tolerance): every window of every stored row — the sinks, then every w positions — sums
    within s·max(its largest value, 2^-14) of the original's; a window-resolution store's rows
    of windows are rounded without carry (as round3-peaks)."""
    from kvscope.storage.compact import compact
    from kvscope.storage.synthetic import write_geometry_store

    fmt = row_format("round3-peaks-carry")
    out = tmp_path / "r3pc.zarr"
    compact(qkv_trace, out, fmt.name, level=1)
    w, n_sink = 8, 4  # the trace's
    for name in ("attn", "prefill_tail"):
        a, b = _read(qkv_trace, name).astype(np.float64), _read(out, name).astype(np.float64)
        assert np.array_equal(np.isnan(a), np.isnan(b))
        a, b = np.nan_to_num(a), np.nan_to_num(b)
        starts = [0, *range(n_sink, a.shape[-1], w)]
        for lo, hi in zip(starts, [*starts[1:], a.shape[-1]], strict=True):
            err = np.abs(b[..., lo:hi].sum(-1) - a[..., lo:hi].sum(-1))
            assert (err <= fmt.slack * np.maximum(a[..., lo:hi].max(-1), 2.0**-14)).all()
    windows = write_geometry_store(
        tmp_path / "win.zarr", prompt_len=40, n_steps=4, n_layers=1, n_heads=2, n_kv=1, head_dim=8, window=4
    )
    for name in ("round3-peaks", "round3-peaks-carry"):
        compact(windows, tmp_path / f"{name}.zarr", name, level=1)
    plain, carried = (tmp_path / "round3-peaks.zarr", tmp_path / "round3-peaks-carry.zarr")
    for name in ("attn", "attn_sink"):
        np.testing.assert_array_equal(_read(plain, name), _read(carried, name))
