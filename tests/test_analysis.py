"""Every metric on small hand-computed fixtures (expected numbers written here), property
tests, dask equivalence, and the peaks fit on a known power law."""

from __future__ import annotations

import math

import numpy as np
import pytest
import xarray as xr
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope import analysis as A
from kvscope.analysis.churn import churn_kernel
from kvscope.analysis.concentration import concentration_kernel
from kvscope.analysis.fmm import fmm_kernel, tier_fractions
from kvscope.analysis.lir import LirStream, lir_kernel, transition_counts
from kvscope.analysis.peaks import fit
from kvscope.errors import KvscopeError
from kvscope.storage.synthetic import dataset_from_rows

# -- FMM ----------------------------------------------------------------------------


def test_fmm_kernel_hand_values():
    future = np.array([[1.0, 2.0, 3.0]])
    exists = np.array([[True, True, True]])
    valid = np.array([True])
    assert fmm_kernel(future, exists, np.array([[False, True, False]]), valid)[0] == pytest.approx(2 / 6)
    # everything existing selected -> 0; nothing selected -> 1
    assert fmm_kernel(future, exists, np.zeros((1, 3), bool), valid)[0] == 0.0
    assert fmm_kernel(future, exists, np.ones((1, 3), bool), valid)[0] == 1.0
    # a unit that did not exist at the decision never counts, however much mass it gets later
    got = fmm_kernel(
        np.array([[1.0, 1.0, 8.0]]), np.array([[True, True, False]]), np.array([[False, True, True]]), valid
    )[0]
    assert got == pytest.approx(0.5)
    # censored events are NaN, never scored on a shorter horizon
    assert np.isnan(fmm_kernel(future, exists, np.ones((1, 3), bool), np.array([False]))[0])
    # no future mass on existing units -> NaN
    assert np.isnan(fmm_kernel(np.zeros((1, 3)), exists, np.ones((1, 3), bool), valid)[0])


def test_tier_fractions_hand_values():
    future = np.array([[4.0, 3.0, 2.0, 1.0]])
    exists = np.array([[True, True, True, False]])
    tiers = np.array([[2, 1, 0, -1]])
    np.testing.assert_allclose(tier_fractions(future, exists, tiers, np.array([True]))[0], [4 / 9, 3 / 9, 2 / 9])


def _two_window_trace(n_steps=6, heavy=0.8):
    """P=8, w=4, no sinks: rows put ``heavy`` on position 0 (window 0) and the rest on 5 (window 1)."""
    T = 8 + n_steps
    attn = np.full((1, n_steps, 1, 1, T), np.nan, dtype=np.float32)
    for t in range(n_steps):
        q = 7 + t
        attn[0, t, 0, 0, : q + 1] = 0
        attn[0, t, 0, 0, 0] = heavy
        attn[0, t, 0, 0, 5] = 1 - heavy
    prefill = np.zeros((1, 1, 1, T), dtype=np.float32)
    prefill[0, 0, 0, 4] = 10.0  # history says window 1 matters
    return dataset_from_rows(attn, prompt_len=8, prefill_colsum=prefill, w=4, n_sink=0)


def test_fmm_history_oracle_end_to_end_hand_value():
    ds = _two_window_trace()
    r = A.fmm(ds, horizon=2, top_frac=0.5, local=0, every=4, n_boot=50)
    # event at step 0: candidates w0, w1 (w2 does not exist yet); top-50% = w1 by prefill mass.
    # future mass over steps 1..2: w0 = 1.6, w1 = 0.4  -> FMM = 1.6 / 2.0 = 0.8
    assert float(r["fmm"].isel(event=0).squeeze()) == pytest.approx(0.8)
    # event at step 4: 4 + 2 > 5 = last step -> censored
    assert np.isnan(float(r["fmm"].isel(event=1).squeeze()))
    assert int(r["n_events"]) == 1 and int(r["n_censored"]) == 1
    assert float(r["mean"]) == pytest.approx(0.8)
    # without prefill mass the history is the decode mass of step 0 only: w0 wins -> FMM of w1 = 0.4 / 2
    r2 = A.fmm(ds, horizon=2, top_frac=0.5, local=0, every=4, include_prefill=False, n_boot=50)
    assert float(r2["fmm"].isel(event=0).squeeze()) == pytest.approx(0.2)


def test_fmm_given_selection_and_extremes():
    ds = _two_window_trace()
    prep = A.Prepared(ds, A.Units("window", 4, 0))
    steps = np.array([0])
    all_sel = prep.selection_array(np.array([[[[[1, 1, -1, -1, -1]]]]], dtype=np.int8)[..., : prep.n_units], steps)
    none_sel = prep.selection_array(np.array([[[[[0, 0, -1, -1, -1]]]]], dtype=np.int8)[..., : prep.n_units], steps)
    assert float(A.fmm(ds, horizon=2, selection=all_sel, n_boot=10)["mean"]) == 0.0
    assert float(A.fmm(ds, horizon=2, selection=none_sel, n_boot=10)["mean"]) == 1.0


def test_fmm_curve_and_token_granularity():
    ds = _two_window_trace(n_steps=10)
    r = A.fmm(ds, horizon=4, top_frac=0.5, local=0, every=4, n_boot=20)
    assert list(r["horizon"].values) == [1, 2, 4]
    # events at steps 0, 4, 8. Step 0: FMM 0.8 (above). Steps 4 and 8: window 2 (and 3) exist
    # but get no mass and k = 2 keeps w1 (prefill) and w0 (decode mass): FMM 0. H=1 scores all
    # three events, H=2 and 4 censor the one at step 8 (8 + H > 9).
    np.testing.assert_allclose(r["curve"].values, [0.8 / 3, 0.4, 0.4])
    tok = A.fmm(ds, granularity="token", horizon=2, top_frac=0.1, local=0, every=4, n_sink=0, n_boot=20)
    # step 0: 8 candidate positions, k = ceil(0.8) = 1: position 4 (prefill 10) -> misses 0 and 5
    assert float(tok["fmm"].isel(event=0).squeeze()) == pytest.approx(1.0)


def test_fmm_rejects_bad_parameters():
    ds = _two_window_trace()
    with pytest.raises(KvscopeError, match="horizon"):
        A.fmm(ds, horizon=0)
    with pytest.raises(KvscopeError, match="top-frac"):
        A.fmm(ds, top_frac=1.5)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 9), st.integers(0, 2**32 - 1))
def test_fmm_is_a_fraction(n_events, n_units, seed):
    rng = np.random.default_rng(seed)
    future = rng.random((n_events, n_units))
    exists = rng.random((n_events, n_units)) < 0.8
    missed = rng.random((n_events, n_units)) < 0.5
    out = fmm_kernel(future, exists, missed, np.ones(n_events, bool))
    ok = np.isfinite(out)
    assert np.all((out[ok] >= 0) & (out[ok] <= 1 + 1e-12))
    assert np.all(fmm_kernel(future, exists, np.zeros_like(missed), np.ones(n_events, bool))[ok] == 0)


# -- churn --------------------------------------------------------------------------


def test_churn_hand_values():
    sel = np.array([[1, 1, 0, -1], [1, 0, 1, -1], [1, 0, 1, -1], [0, 0, 0, -1], [0, 0, 0, -1]], dtype=np.int8)
    np.testing.assert_allclose(churn_kernel(sel), [2 / 3, 0.0, 1.0, 0.0])
    constant = np.tile(np.array([1, 0, 1, 0], dtype=np.int8), (6, 1))
    np.testing.assert_array_equal(churn_kernel(constant), 0.0)
    # pairs past the valid events are NaN
    assert np.isnan(churn_kernel(sel, np.array(3))[2:]).all()


def test_churn_of_a_single_event_is_nan_not_an_error():
    """Fewer steps than w give one event, no pair of events: churn is undefined (NaN)."""
    from kvscope.storage.synthetic import dataset_from_rows

    a = np.full((1, 5, 1, 1, 40), np.nan, dtype=np.float32)
    for t in range(5):
        a[0, t, 0, 0, : 31 + t] = 1 / (31 + t)
    r = A.churn(dataset_from_rows(a, prompt_len=31), n_boot=10)
    assert r.sizes["event"] == 0 and r["churn_over_time"].size == 0 and np.isnan(float(r["mean"]))


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 6), st.integers(1, 8), st.integers(0, 2**32 - 1))
def test_churn_bounded_and_symmetric(n_events, n_units, seed):
    sel = np.random.default_rng(seed).integers(-1, 2, size=(n_events, n_units)).astype(np.int8)
    c = churn_kernel(sel)
    assert np.all((c >= 0) & (c <= 1))
    np.testing.assert_allclose(churn_kernel(sel[::-1])[::-1], c)


# -- LIR ----------------------------------------------------------------------------


def _lir(seq, m=4, h=8, n_valid=None):
    sel = np.asarray(seq, dtype=np.int8)[:, None]  # [event, unit=1]
    e, r = lir_kernel(sel, np.array(len(seq) if n_valid is None else n_valid), m=m, h_lir=h)
    return int(e), int(r)


def test_lir_hand_matrix():
    seq = [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0]
    # episode A: zeros at 1..4, eligible at 4, reactivated at 5; episode B: zeros at 6..11, eligible at 9
    assert _lir(seq, m=4, h=3) == (1, 1)  # B's window 9..12 runs past event 11: censored
    assert _lir(seq, m=4, h=1) == (2, 1)  # B's window 9..10 is observed and stays cold
    assert _lir(seq, m=4, h=None) == (2, 1)  # any time later; B open at the end: eligible, not reactivated
    # a late return (5 events after eligibility) counts only without a horizon
    late = [1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0]
    assert _lir(late, m=4, h=3) == (1, 0)
    assert _lir(late, m=4, h=None) == (1, 1)
    # zeros that do not follow a 1 are not an episode; runs shorter than m are not eligible
    assert _lir([-1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 1], m=4, h=None) == (0, 0)
    # events beyond the sample's valid steps are the end of the trace
    assert _lir([1, 0, 0, 0, 0, 1, 1, 1], m=4, h=None, n_valid=4) == (0, 0)


def test_lir_ratio_of_sums_over_units_and_transitions():
    sel = np.array([[1, 0], [0, 0], [0, 1], [1, 1]], dtype=np.int8)  # [event, unit]
    e, r = lir_kernel(sel, np.array(4), m=2, h_lir=None)
    assert (int(e), int(r)) == (1, 1)  # unit 0: zeros 1..2 then 1
    counts = transition_counts(sel, np.array(4), delta=1)
    # pairs (e, e+1): unit0: 1→0, 0→0, 0→1; unit1: 0→0, 0→1, 1→1
    assert counts.tolist() == [4, 2, 2, 1]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 12), st.integers(1, 5), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_lir_reactivated_never_exceeds_eligible(n_events, n_units, m, seed):
    sel = np.random.default_rng(seed).integers(-1, 2, size=(n_events, n_units)).astype(np.int8)
    for h in (None, 1, 3):
        e, r = lir_kernel(sel, np.array(n_events), m=m, h_lir=h)
        assert 0 <= r <= e


def test_streaming_lir_hand_sequence():
    seq = np.array([1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0], dtype=np.int8)
    for h, want in ((3, (1, 1)), (1, (2, 1)), (None, (2, 1))):  # the hand matrix above, one event at a time
        stream = LirStream((1,), len(seq), 4, h, 1)
        for v in seq:
            stream.push(np.array([v], dtype=np.int8))
        eligible, reactivated, transitions = stream.counts()
        assert (int(eligible), int(reactivated)) == want
        assert transitions.tolist() == [9, 1, 2, 2]  # lag-1 pairs: 0→0 ×8, 0→1 ×1, 1→0 ×2


def test_lir_end_to_end_on_dataset():
    ds = _two_window_trace(n_steps=24)
    r = A.lir(ds, top_frac=0.5, local=0, every=4, m=2, h_lir=None, n_boot=20)
    # windows existing at events (steps 0,4,..,20): 2,3,4,5,6,7; k = ceil(n/2) = 1,2,2,3,3,4.
    # w1 leads (prefill), w0 joins at e1, zero-mass windows join oldest first (w2 at e3, w3 at
    # e5). Nothing ever leaves: no episodes. Lag-1 pairs: 9 from 0 (3 of them to 1), 11 from 1.
    assert int(r["n_eligible"]) == 0 and int(r["n_reactivated"]) == 0
    assert float(r["p01"]) == pytest.approx(3 / 9)
    assert float(r["p10"]) == 0.0


# -- concentration ------------------------------------------------------------------


def test_concentration_hand_values():
    m = np.array([[0.1, 0.5, 0.1, 0.3]])
    share, needed = concentration_kernel(m, np.ones_like(m, bool))
    np.testing.assert_allclose(share[0], [0.5, 0.5, 0.5, 0.8])  # ceil(p·4) = 1, 1, 1, 2 windows
    np.testing.assert_allclose(needed[0], [0.25, 0.5, 0.75])


# -- peaks --------------------------------------------------------------------------


def test_peaks_exposure_normalization_on_rows_of_different_lengths():
    T = 10
    attn = np.full((2, 1, 1, 1, T), np.nan, dtype=np.float32)
    attn[0, 0, 0, 0, :5] = [0.1, 0.6, 0.1, 0.1, 0.1]  # q=4: peak at p=1, distance 3 (own position excluded)
    attn[1, 0, 0, 0, :9] = [0.05, 0.05, 0.6, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05]  # q=8: peak at p=2, distance 6
    ds = dataset_from_rows(attn, prompt_len=[5, 9], n_sink=0)
    r = A.peaks(ds, k=1, n_sink=0, n_boot=5, logquant_window=2)
    np.testing.assert_array_equal(r["count"].values[:4], [0, 1, 1, 0])
    # exposure: d=1: both rows; d=2,3: both; d=4: both, d=5..7: row 2; d=8: row 2
    np.testing.assert_array_equal(r["exposure"].values[:4], [2, 4, 5, 1])
    np.testing.assert_allclose(r["density"].values[:4], [0, 0.25, 0.2, 0])
    assert int(r["n_peaks"]) == 2 and int(r["n_rows"]) == 2


def test_peaks_fit_recovers_a_known_power_law():
    rng = np.random.default_rng(7)
    alpha_true, n_units, rows_per_unit = 1.3, 24, 120
    units = []
    for _ in range(n_units):
        D = rng.integers(50, 400, size=rows_per_unit)
        n_dist = 401
        stats = np.zeros((n_dist, 3), dtype=np.int64)
        for Dr in D:
            d = np.arange(1, Dr + 1)
            p = d ** (-alpha_true)
            draw = rng.choice(d, p=p / p.sum())
            stats[draw, 0] += 1
            stats[Dr, 1] += 1
            stats[Dr, 2] += 1
        units.append(stats)
    units = np.stack(units)
    total = units.sum(0)
    alpha, _ = fit(total[:, 0], total[:, 1], "power")
    boot = []
    for _ in range(100):
        s = units[rng.integers(0, n_units, n_units)].sum(0)
        boot.append(fit(s[:, 0], s[:, 1], "power")[0])
    lo, hi = np.quantile(boot, [0.025, 0.975])
    assert lo <= alpha_true <= hi
    assert abs(alpha - alpha_true) < 0.1
    lam, ll_exp = fit(total[:, 0], total[:, 1], "exponential")
    _, ll_pow = fit(total[:, 0], total[:, 1], "power")
    assert ll_pow > ll_exp  # the power law wins on power-law data


def test_peaks_bootstrap_interval_is_made_of_the_samples_own_fits():
    # two samples: a draw of whole samples is (2, 0), (1, 1) or (0, 2), so α's interval is bounded by the
    # fits on each sample alone and on both (a sample's statistics doubled give its own fit, up to the order of sums)
    rng = np.random.default_rng(3)
    n_steps, P = 24, 40
    attn = np.full((2, n_steps, 2, 2, P + n_steps), np.nan, dtype=np.float32)
    for s, t in np.ndindex(2, n_steps):
        q = P - 1 + t
        row = rng.gamma(0.3 + s, size=(2, 2, q + 1))
        attn[s, t, :, :, : q + 1] = row / row.sum(-1, keepdims=True)
    ds = dataset_from_rows(attn, prompt_len=P, n_sink=2)
    both = A.peaks(ds, n_boot=200)
    alone = [float(A.peaks(ds.isel(sample=[s]), n_boot=1)["alpha"]) for s in (0, 1)]
    fits = sorted(alone + [float(both["alpha"])])
    assert fits[0] < fits[-1]
    np.testing.assert_allclose([float(both["alpha_low"]), float(both["alpha_high"])], [fits[0], fits[-1]], rtol=1e-9)


def test_peaks_end_to_end_on_a_dataset_with_planted_peaks():
    # every row's single peak sits at distance 2 -> all counts in bin [2, 4)
    n_steps, P = 6, 12
    T = P + n_steps
    attn = np.full((1, n_steps, 1, 1, T), np.nan, dtype=np.float32)
    for t in range(n_steps):
        q = P - 1 + t
        row = np.full(q + 1, 0.01)
        row[q - 2] = 0.5
        attn[0, t, 0, 0, : q + 1] = row / row.sum()
    ds = dataset_from_rows(attn, prompt_len=P, n_sink=4)
    r = A.peaks(ds, k=1, n_boot=10, logquant_window=4)
    assert int(r["n_peaks"]) == n_steps
    assert int(r["count"].sel(bin=1)) == n_steps
    assert 0 < float(r["coverage_logquant"][0]) <= 1 and 0 < float(r["coverage_recency"][0]) <= 1


# -- dask ---------------------------------------------------------------------------


def test_dask_chunked_equals_in_memory(tmp_path):
    from kvscope.storage.store import open_trace
    from kvscope.storage.synthetic import write_synthetic_store

    path = write_synthetic_store(
        tmp_path / "syn.zarr", n_samples=2, n_steps=40, n_layers=2, n_kv=2, prompt_len=60, block_steps=8
    )
    lazy = open_trace(path, chunks={})
    eager = open_trace(path).load()
    assert lazy.attn.chunks is not None and eager.attn.chunks is None
    for name, kwargs in [
        ("fmm", {"horizon": 8, "n_boot": 50}),
        ("churn", {"n_boot": 50}),
        ("lir", {"h_lir": None, "n_boot": 50}),
        ("peaks", {"n_boot": 20}),
        ("concentration", {}),
    ]:
        a = A.make(name, **kwargs)(lazy)
        b = A.make(name, **kwargs)(eager)
        for var in a.data_vars:
            np.testing.assert_allclose(
                np.asarray(a[var].values, float),
                np.asarray(b[var].values, float),
                rtol=1e-6,
                atol=1e-9,
                err_msg=f"{name}.{var}",
            )


def test_local_cluster_gives_the_same_numbers(tmp_path):
    from distributed import Client, LocalCluster

    from kvscope.storage.store import open_trace
    from kvscope.storage.synthetic import write_synthetic_store

    path = write_synthetic_store(
        tmp_path / "syn.zarr", n_samples=1, n_steps=24, n_layers=2, n_kv=1, prompt_len=40, block_steps=8
    )
    ds = open_trace(path, chunks={})
    local = A.fmm(ds, horizon=8, n_boot=50)
    local_peaks = A.peaks(ds, n_boot=10)
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None, processes=False) as cluster,
        Client(cluster),
    ):
        dist = A.fmm(ds, horizon=8, n_boot=50)
        dist_peaks = A.peaks(ds, n_boot=10)
    np.testing.assert_allclose(dist["fmm"].values, local["fmm"].values)
    assert float(dist_peaks["alpha"]) == pytest.approx(float(local_peaks["alpha"]))


def test_bootstrap_is_seeded_and_is_a_ratio_of_sums():
    num, den = np.array([1.0, 2.0, 3.0]), np.array([2.0, 2.0, 4.0])
    est, lo, hi = A.bootstrap_ratio(num, den, n_boot=200, seed=3)
    assert est == pytest.approx(6 / 8)
    assert (lo, hi) == A.bootstrap_ratio(num, den, n_boot=200, seed=3)[1:]
    assert lo <= est <= hi
    assert all(math.isnan(x) for x in A.bootstrap_ratio(np.zeros(2), np.zeros(2)))


def test_selection_is_a_plain_int8_array():
    ds = _two_window_trace()
    sel = A.Prepared(ds, A.Units("window", 4, 0)).history_selection(every=4, top_frac=0.5, local=0)
    assert sel.dtype == np.int8 and set(np.unique(sel.values)) <= {-1, 0, 1}
    assert sel.dims == ("sample", "event", "layer", "kv_head", "window")
    assert list(sel["event_step"].values) == [0, 4]
    assert isinstance(sel, xr.DataArray)


def test_tier_resolved_future_mass_on_a_dataset():
    ds = _two_window_trace()
    prep = A.Prepared(ds, A.Units("window", 4, 0))
    # event at step 0: window 0 in Q, window 1 EVICTED (window 2 does not exist yet)
    tiers = prep.selection_array(
        np.array([1, 0, -1], dtype=np.int8)[None, None, None, None, : prep.n_units], np.array([0])
    )
    r = A.fmm(ds, horizon=2, tiers=tiers, n_boot=10)
    # future mass over steps 1..2: w0 = 1.6 (Q), w1 = 0.4 (EVICTED); FMM counts only EVICTED as missed
    np.testing.assert_allclose(r["tier_mean"].values, [0.0, 0.8, 0.2])
    assert float(r["mean"]) == pytest.approx(0.2)


def test_study_equals_the_separate_analyses(tmp_path):
    from kvscope.storage.store import open_trace
    from kvscope.storage.synthetic import write_synthetic_store

    path = write_synthetic_store(
        tmp_path / "syn.zarr", n_samples=2, n_steps=32, n_layers=2, n_kv=2, prompt_len=50, block_steps=8
    )
    ds = open_trace(path, chunks={})
    together = A.study(ds, horizon=8, n_boot=50)
    apart = {
        "fmm": A.fmm(ds, horizon=8, n_boot=50),
        "churn": A.churn(ds, n_boot=50),
        "lir": A.lir(ds, n_boot=50),
        "peaks": A.peaks(ds, n_boot=50),
    }
    _assert_same_results(together, apart, rtol=1e-9)


def _assert_same_results(got: dict, expected: dict, rtol: float) -> None:
    """Every variable of every analysis result in ``expected`` equals the one in ``got``."""
    for name, r in expected.items():
        for var in r.data_vars:
            np.testing.assert_allclose(
                np.asarray(got[name][var].values, float),
                np.asarray(r[var].values, float),
                rtol=rtol,
                err_msg=f"{name}.{var}",
            )


def test_rows_recomputed_from_qk_match_stored_rows(tmp_path, tiny_models):
    import kvscope
    from kvscope.analysis.recompute import rows_from_qk, with_recomputed_rows

    out = tmp_path / "qk.zarr"
    kvscope.trace(
        "The sea is large and the sky above it is wide and blue.",
        out,
        model=str(tiny_models["llama"]),
        max_new_tokens=10,
        dtype="float32",
        record_qkv=True,
        stop_at_eos=False,
    )
    ds = kvscope.open_trace(out, chunks={})
    np.testing.assert_allclose(rows_from_qk(ds).values, ds["attn"].values, atol=1e-5)
    recomputed = with_recomputed_rows(ds)
    a = A.unit_mass(ds, A.Units("window", 4, 4)).values
    b = A.unit_mass(recomputed, A.Units("window", 4, 4)).values
    np.testing.assert_allclose(a, b, atol=1e-5)
    sliding = tmp_path / "sliding.zarr"
    kvscope.trace(
        "The sea is large and the sky above it is wide and blue.",
        sliding,
        model=str(tiny_models["mistral_sliding"]),
        max_new_tokens=6,
        dtype="float32",
        record_qkv=True,
        stop_at_eos=False,
    )
    ds2 = kvscope.open_trace(sliding)
    np.testing.assert_allclose(rows_from_qk(ds2).values, ds2["attn"].values, atol=1e-5)


def test_rows_from_qk_needs_qk():
    from kvscope.analysis.recompute import rows_from_qk

    with pytest.raises(KvscopeError, match="no recorded q/k"):
        rows_from_qk(_two_window_trace())


def test_study_splits_heads_of_large_units_with_the_same_numbers(tmp_path, monkeypatch):
    import sys

    from kvscope.storage.store import open_trace
    from kvscope.storage.synthetic import write_synthetic_store

    path = write_synthetic_store(
        tmp_path / "syn.zarr", n_samples=1, n_steps=24, n_layers=2, n_kv=3, prompt_len=40, block_steps=8
    )
    ds = open_trace(path, chunks={})
    whole = A.study(ds, horizon=8, n_boot=20)
    monkeypatch.setattr(sys.modules["kvscope.analysis.study"], "TASK_BYTES", 1)  # one head per stage-2 task
    split = A.study(ds, horizon=8, n_boot=20)
    _assert_same_results(split, whole, rtol=1e-12)


def test_selection_codes_from_tiers_by_hand():
    from kvscope.analysis.common import selection_codes

    tiers = np.array([[2, 2, 0, 1, 2, -1], [2, 1, 1, 0, -1, -1]], dtype=np.int8)  # [event, pos]
    assert selection_codes(tiers).tolist() == [[1, 1, 0, 1, 1, -1], [1, 1, 1, 0, -1, -1]]
    assert selection_codes(tiers, accessible=False).tolist() == [[1, 1, 0, 0, 1, -1], [1, 0, 0, 0, -1, -1]]
    assert selection_codes(tiers, accessible=False, n_sink=2).tolist() == [
        [-1, -1, 0, 0, 1, -1],
        [-1, -1, 0, 0, -1, -1],
    ]
    da = A.selection_from_tiers(xr.DataArray(tiers, dims=("event", "pos"), attrs={"policy": "x"}), n_sink=1)
    assert da.values.tolist() == [[-1, 1, 0, 1, 1, -1], [-1, 1, 1, 0, -1, -1]] and da.attrs["policy"] == "x"
    with pytest.raises(KvscopeError, match="tier codes must be"):  # the lookup table knows −1..2 only
        A.selection_from_tiers(xr.DataArray(np.array([[2, -2]], dtype=np.int8), dims=("event", "pos")))


@given(st.lists(st.sampled_from([-1, 0, 1, 2]), min_size=1, max_size=40), st.booleans(), st.integers(0, 5))
@settings(max_examples=60, deadline=None)
def test_selection_codes_table_is_the_rule(codes, accessible, n_sink):
    """The lookup table gives the rule's codes: −1 where nothing exists, 1 for what is kept."""
    from kvscope.analysis.common import selection_codes

    tiers = np.array(codes, dtype=np.int8)
    keep = tiers >= 1 if accessible else tiers == 2
    want = np.where(tiers < 0, -1, np.where(keep, 1, 0)).astype(np.int8)
    want[:n_sink] = -1
    got = selection_codes(tiers, accessible, n_sink)
    assert got.dtype == np.int8 and got.tolist() == want.tolist()


def test_every_analysis_gives_the_same_bits_whatever_the_steps_per_task(tmp_path):
    """``open_trace(chunks="analysis")`` reads several stored blocks of steps per task (one zarr
    call); every metric and a study give bit for bit what they give on the store's own chunks,
    with tasks of several blocks and a last, shorter one."""
    import dataclasses

    import dask

    import kvscope
    from kvscope.analysis import study
    from kvscope.analysis.registry import available
    from kvscope.storage.store import analysis_chunks, check_store
    from kvscope.storage.synthetic import write_synthetic_store

    path = tmp_path / "s.zarr"
    write_synthetic_store(path, n_samples=2, n_steps=100, n_layers=2, n_kv=2, prompt_len=300, seed=3)
    layout = check_store(path).layout
    block = 2 * layout.block_steps * layout.n_kv_heads * layout.n_pos * 2  # two blocks of fp16 rows
    assert analysis_chunks(layout, block) == {"step": 64} and analysis_chunks(layout) == {"step": 100}
    opened = {
        "store": kvscope.open_trace(path, chunks={}),
        "two blocks": kvscope.open_trace(path, chunks=analysis_chunks(layout, block)),
        "analysis": kvscope.open_trace(path, chunks="analysis"),
    }
    assert opened["two blocks"].attn.data.chunks[1] == (64, 36)
    with dask.config.set(scheduler="threads"):
        for name, cls in available().items():
            params = {"n_boot": 20} if "n_boot" in {f.name for f in dataclasses.fields(cls)} else {}
            results = {how: cls(**params)(ds) for how, ds in opened.items()}
            for how, result in results.items():
                xr.testing.assert_identical(result, results["store"]), (name, how)
        studies = {how: study(ds, n_boot=20) for how, ds in opened.items()}
        for how, result in studies.items():
            for name in result:
                xr.testing.assert_identical(result[name], studies["store"][name])
