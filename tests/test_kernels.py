"""The compiled kernels against plain-Python references written here, on hand cases and
random inputs: one-pass row statistics (windows, peaks, coverage), the top-ρ selection,
LIR episodes and cumulative sums; the streaming forms of LIR, transitions and churn against
the kernels."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.analysis.churn import ChurnStream, churn_kernel
from kvscope.analysis.common import top_fraction_selection
from kvscope.analysis.fmm import fmm_kernel
from kvscope.analysis.kernels import block_stats, cumulative, fmm_curve, peak_width
from kvscope.analysis.lir import LirStream, lir_kernel, transition_counts
from kvscope.analysis.mass import window_masses
from kvscope.windows import window_sums

# -- references -----------------------------------------------------------------------


def reference_peaks(row: np.ndarray, q: int, n_sink: int, k: int) -> list[int]:
    """Positions of the k largest row[p], n_sink ≤ p < q; equal values: the later position."""
    cand = sorted(range(n_sink, q), key=lambda p: (float(row[p]), p), reverse=True)
    return cand[:k]


def reference_row_stats(row, q, fp, n_sink, k, n_bins):
    """The ``stats`` vector of one row, from its definition."""
    out = np.zeros(n_bins + 5)
    if q < 0:
        return out
    for p in reference_peaks(row, q, n_sink, k):
        d = q - p
        out[0] += math.log(d)
        out[1] += d
        out[2 + min(n_bins - 1, int(math.floor(math.log2(d))))] += 1
    if q >= n_sink:
        vals = np.nan_to_num(row.astype(np.float64))
        total = vals[n_sink : q + 1].sum()
        kept = [p for p in fp if p >= n_sink]
        if total > 0:
            out[2 + n_bins] += sum(vals[p] for p in kept if p <= q) / total
            out[3 + n_bins] += vals[max(n_sink, q - len(kept) + 1) : q + 1].sum() / total
            out[4 + n_bins] += 1
    return out


def reference_lir(seq: list[int], n_valid: int, m: int, h_lir: int | None) -> tuple[int, int]:
    """Global LIR (docs/concepts.md#lir) on one unit's selection sequence, episode by episode."""
    seq = list(seq[:n_valid])
    eligible = reactivated = 0
    e = 1
    while e < len(seq):
        if seq[e] == 0 and seq[e - 1] == 1:  # an inactive episode starts
            end = e
            while end < len(seq) and seq[end] == 0:
                end += 1
            closed_by_one = end < len(seq) and seq[end] == 1
            if end - e >= m:
                at = e + m - 1
                if h_lir is None:
                    eligible += 1
                    reactivated += closed_by_one
                elif at + h_lir <= len(seq) - 1:
                    eligible += 1
                    reactivated += closed_by_one and end - at <= h_lir
            e = end
        e += 1
    return eligible, reactivated


def reference_top_fraction(scores, candidate, top_frac):
    order = sorted(
        (u for u in range(len(scores)) if candidate[u]), key=lambda u: (-scores[u], u)
    )  # highest first, older first among equals
    k = math.ceil(top_frac * len(order) - 1e-9)
    out = np.where(candidate, 0, -1).astype(np.int8)
    out[order[:k]] = 1
    return out


# -- row statistics ----------------------------------------------------------------------


def _rows(rng, n_steps, n_heads, n_pos, qpos, dtype, ties=False):
    x = rng.random((n_steps, n_heads, n_pos)) ** 4
    if ties:
        x = np.round(x * 4) / 4  # many equal values
    for t, q in enumerate(qpos):
        x[t, :, max(q + 1, 0) :] = np.nan  # nothing stored beyond the query
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("ties", [False, True])
def test_block_stats_equal_their_definition(dtype, ties):
    rng = np.random.default_rng(3)
    n_steps, n_heads, n_pos, n_sink, w, k = 7, 3, 301, 4, 8, 5
    qpos = np.array([-1, 2, 4, 9, 150, 299, 300])
    x = _rows(rng, n_steps, n_heads, n_pos, qpos, dtype, ties)
    fp = np.full((n_steps, 12), -1)
    for t, q in enumerate(qpos):
        if q >= 0:
            chosen = rng.choice(np.arange(0, q + 1), size=min(12, q + 1), replace=False)
            fp[t, : len(chosen)] = np.sort(chosen)
    n_units = (n_pos - n_sink) // w
    n_bins = 9
    windows = np.zeros((n_steps, n_heads, n_units))
    stats = np.zeros((n_heads, peak_width(n_bins)))
    block_stats(x, qpos, fp, n_sink=n_sink, w=w, n_units=n_units, k=k, n_bins=n_bins, windows=windows, stats=stats)
    expected = sum(
        np.stack([reference_row_stats(x[t, h], q, fp[t], n_sink, k, n_bins) for h in range(n_heads)])
        for t, q in enumerate(qpos)
    )
    np.testing.assert_allclose(stats, expected, rtol=1e-6, atol=1e-12)
    body = np.nan_to_num(x[..., n_sink : n_sink + n_units * w].astype(np.float32))
    np.testing.assert_allclose(windows, body.reshape(n_steps, n_heads, n_units, w).sum(-1), rtol=1e-6)


def test_peaks_break_ties_toward_the_nearer_key_and_skip_sinks_and_the_query():
    row = np.array([[[9.0, 9.0, 1.0, 5.0, 5.0, 2.0, 5.0, 7.0, np.nan]]], dtype=np.float32)  # [1, 1, pos]
    q = np.array([7])  # the query sits at 7 (its own 7.0 is no peak), sinks 0-1
    stats = np.zeros((1, peak_width(4)))
    block_stats(
        row, q, np.full((1, 0), -1), n_sink=2, w=4, n_units=0, k=2, n_bins=4, windows=np.empty((1, 1, 0)), stats=stats
    )
    # top 2 of positions 2..6 = {5 @ 6, 5 @ 4} (5 @ 3 loses the tie): d = 1 and 3
    assert stats[0, 1] == 4
    assert stats[0, 0] == pytest.approx(math.log(3))
    np.testing.assert_array_equal(stats[0, 2:6], [1, 1, 0, 0])  # d=1 -> bin 0, d=3 -> bin 1


def test_window_sums_are_chunking_invariant_float32_sums():
    rng = np.random.default_rng(0)
    x = rng.random((6, 2, 100)).astype(np.float16)
    x[..., 90:] = np.nan
    whole = window_masses(x, None, 4, 12, 8)
    parts = np.concatenate([window_masses(x[:2], None, 4, 12, 8), window_masses(x[2:], None, 4, 12, 8)])
    np.testing.assert_array_equal(whole, parts)  # the same bits
    expected = np.zeros((6, 2, 12), dtype=np.float32)
    for i in range(8):  # float32, position order, NaN as 0
        expected += np.nan_to_num(x[..., 4 + i : 4 + 12 * 8 : 8].astype(np.float32))
    np.testing.assert_array_equal(whole, expected.astype(np.float64))
    # the compiled form of the one definition (kvscope.windows.window_sums), bit for bit
    np.testing.assert_array_equal(whole, window_sums(x.astype(np.float32), 4, 8, 12).astype(np.float64))


def test_block_stats_refuses_windows_past_the_row():
    x = np.zeros((1, 1, 20), np.float16)
    with pytest.raises(ValueError):
        block_stats(
            x, np.array([5]), np.zeros((1, 0)), n_sink=4, w=8, n_units=3, k=0, n_bins=1, windows=None, stats=None
        )


# -- selection, LIR, cumulative sums ---------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    n_heads=st.integers(1, 3),
    n_events=st.integers(1, 6),
    n_units=st.integers(1, 20),
    top_frac=st.floats(0.01, 0.99),
    seed=st.integers(0, 10_000),
)
def test_top_fraction_selection_equals_its_definition(n_heads, n_events, n_units, top_frac, seed):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 4, size=(n_heads, n_events, n_units)).astype(np.float64)  # plenty of ties
    exists = rng.random((n_events, n_units)) < 0.8
    protected = rng.random((n_events, n_units)) < 0.2
    got = top_fraction_selection(scores, exists, protected, top_frac)
    for h in range(n_heads):
        for e in range(n_events):
            want = reference_top_fraction(scores[h, e], exists[e] & ~protected[e], top_frac)
            np.testing.assert_array_equal(got[h, e], want)


LIR_CASES = {  # selection matrices [event, unit] and the LIR parameters
    "n_events": st.integers(1, 14),
    "n_units": st.integers(1, 5),
    "m": st.integers(1, 4),
    "h_lir": st.one_of(st.none(), st.integers(1, 5)),
    "seed": st.integers(0, 10_000),
}


@settings(max_examples=80, deadline=None)
@given(**LIR_CASES)
def test_lir_kernel_equals_the_episode_walk(n_events, n_units, m, h_lir, seed):
    rng = np.random.default_rng(seed)
    sel = rng.choice(np.array([-1, 0, 1], dtype=np.int8), p=[0.1, 0.5, 0.4], size=(2, n_events, n_units))
    n_valid = rng.integers(0, n_events + 1, size=2)
    elig, react = lir_kernel(sel, n_valid, m=m, h_lir=h_lir)
    for a in range(2):
        ref = [reference_lir(list(sel[a, :, u]), int(n_valid[a]), m, h_lir) for u in range(n_units)]
        assert (elig[a], react[a]) == tuple(map(sum, zip(*ref)))


@settings(max_examples=150, deadline=None)
@given(**LIR_CASES, delta=st.integers(1, 3))
def test_streaming_lir_transitions_and_churn_equal_the_kernels(n_events, n_units, m, h_lir, delta, seed):
    """Replay's one-event-at-a-time forms against the kernels on the whole matrix, with events
    past ``n_valid`` (censoring and ignored events) on random selections."""
    rng = np.random.default_rng(seed)
    sel = rng.choice(np.array([-1, 0, 1], dtype=np.int8), p=[0.15, 0.45, 0.4], size=(3, 2, n_events, n_units))
    n_valid = rng.integers(0, n_events + 1, size=(3, 2))  # [a, b]
    lir, churn = LirStream((3, 2, n_units), n_valid, m, h_lir, delta), ChurnStream(n_valid, earlier_only=True)
    churned = [churn.push(sel[..., 0, :])]
    for e in range(n_events):
        lir.push(sel[..., e, :])
        if e:
            churned.append(churn.push(sel[..., e, :]))
    eligible, reactivated, transitions = lir.counts()
    want_e, want_r = lir_kernel(sel, n_valid, m, h_lir)
    np.testing.assert_array_equal(eligible, want_e)
    np.testing.assert_array_equal(reactivated, want_r)
    if n_events > delta:
        np.testing.assert_array_equal(transitions, transition_counts(sel, n_valid, delta))
    else:
        assert not transitions.any()
    assert churned[0] is None
    got = np.stack(churned[1:], -1) if n_events > 1 else np.zeros((3, 2, 0))  # [a, b, event−1]
    np.testing.assert_array_equal(got, churn_kernel(sel, n_valid, earlier_only=True))
    assert lir.counts()[0].tolist() == eligible.tolist()  # counts() closes open episodes without consuming them


def test_cumulative_has_the_bits_of_numpy_cumsum():
    m = np.random.default_rng(1).random((3, 50, 7))
    np.testing.assert_array_equal(cumulative(m), np.cumsum(m, axis=-2))
    view = np.moveaxis(np.random.default_rng(2).random((50, 3, 7)), 1, 0)  # not contiguous
    np.testing.assert_array_equal(cumulative(view), np.cumsum(view, axis=-2))


@settings(max_examples=40, deadline=None)
@given(n_steps=st.integers(1, 30), n_units=st.integers(1, 9), every=st.integers(1, 5), seed=st.integers(0, 10_000))
def test_fmm_curve_equals_the_fmm_definition(n_steps, n_units, every, seed):
    rng = np.random.default_rng(seed)
    m = rng.random((2, n_steps, n_units)) * (rng.random((2, n_steps, n_units)) < 0.7)
    cum = cumulative(m)
    steps = np.arange(0, n_steps, every)
    horizons = np.array([1, 2, 4, 32])
    exists = rng.random((len(steps), n_units)) < 0.8
    missed = rng.random((2, len(steps), n_units)) < 0.5
    valid_steps = n_steps - int(rng.integers(0, 3))
    got = np.empty((2, len(horizons), len(steps)))
    fmm_curve(cum, steps, horizons, valid_steps, exists, missed, got)
    for k, h in enumerate(horizons):
        future = cum[:, np.minimum(steps + h, n_steps - 1)] - cum[:, steps]
        want = fmm_kernel(future, exists, missed, steps + h <= valid_steps - 1)
        np.testing.assert_allclose(got[:, k], want, rtol=1e-12, atol=1e-15)


def test_half_to_single_is_exact_for_every_fp16_pattern():
    """The compiled fp16 decode equals numpy's conversion bit for bit (NaN payloads: NaN)."""
    from kvscope.analysis.kernels import half_to_single

    bits = np.arange(2**16, dtype=np.uint16)
    out = np.empty(bits.size, np.float32)
    half_to_single(bits, out)
    ref = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert (np.isnan(out) == nan).all()
    assert (out[~nan].view(np.uint32) == ref[~nan].view(np.uint32)).all()  # ±0, subnormals, ±Inf included


def test_the_fp16_row_decode_and_its_checks_equal_numpy():
    """A row decoded through the lookup table is numpy's fp16 → float32 with NaN as 0, its NaN
    counted; the check's float64 sum, added in any order by the compiler, is exact for values
    decoded from fp16 and so equals ``math.fsum`` — every pattern, zeros, subnormals and Inf included."""
    from kvscope.analysis.kernels import HALF_TABLE, _decode_half_row, _half_row_sum, _row_sum

    rng = np.random.default_rng(5)
    bits = np.concatenate([np.arange(2**16, dtype=np.uint16), rng.integers(0, 2**16, 4099).astype(np.uint16)])
    out = np.empty(bits.size, np.float32)
    nans = _decode_half_row(bits, HALF_TABLE, out)
    ref = bits.view(np.float16).astype(np.float32)
    assert nans == np.isnan(ref).sum()
    assert (out.view(np.uint32) == np.nan_to_num(ref, nan=0.0, posinf=np.inf, neginf=-np.inf).view(np.uint32)).all()
    for n in (0, 1, 17, 4096):
        row = rng.random(n).astype(np.float16).astype(np.float32)  # probability-like: exact sums in float64
        total, outside = _half_row_sum(row, n)
        assert total == math.fsum(row.tolist()) == _row_sum(row, n)[0] and outside == 0
    row = np.array([0.5, -0.25, 1.0 + 2**-10, 1.0 + 2**-9, 0.0], np.float32)
    assert _half_row_sum(row, 5)[1] == _row_sum(row, 5)[1] == 2  # below 0, and above the highest fp16 "1"


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_rows_out_of_range_are_named_with_their_extremes(dtype):
    """Only rows holding a value outside [0, 1 + 2^-10] are scanned for their extremes; the
    message names the smallest and the largest value of those rows."""
    from kvscope.analysis.kernels import row_checks, rows_problem

    x = np.zeros((3, 1, 8), dtype)
    x[:, 0, 0] = 1.0
    assert rows_problem(row_checks(x, np.full(3, 7))) is None
    x[1, 0, :3] = [1.25, -0.125, -0.125]
    x[2, 0, :2] = [0.5, 0.5]
    problem = rows_problem(row_checks(x, np.full(3, 7)))
    assert problem == "probabilities outside [0, 1] (min -0.125, max 1.25)"


def test_step_blocks_cut_a_task_where_the_stored_blocks_end():
    """A task's steps, cut at multiples of the store's block: aligned tasks give whole blocks and a
    last short one; a task that starts mid-block is cut at the next boundary."""
    from kvscope.analysis.kernels import step_blocks

    assert step_blocks(0, 100, 32) == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert step_blocks(64, 36, 32) == [(0, 32), (32, 36)]
    assert step_blocks(32, 32, 32) == [(0, 32)]
    assert step_blocks(10, 40, 32) == [(0, 22), (22, 40)]
    assert step_blocks(0, 5, 32) == [(0, 5)]
