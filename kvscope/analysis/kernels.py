"""Compiled kernels (numba, GIL-free): the inner loops of the analyses.

GIL-free matters because dask's threads share two cores with zarr's read path, whose Python
needs the GIL: numpy's many small operations kept interrupting it. Each kernel is the
compiled form of a definition written elsewhere, and ``tests/test_kernels.py`` checks it
against a plain-Python reference.

- ``row_block_stats`` — the rows are the bulk of a trace; this reads each stored row
  once and returns window masses ``m[t, h, j] = Σ_{p ∈ window j} a[t, h, p]`` (float32 sums in
  position order, NaN — nothing stored — as 0) and, per head summed over the block's rows,
  the top-``k`` peak statistics and LogQuant coverage sums of ``kvscope.analysis.peaks``.
  Peaks are the ``k`` largest ``a[t, h, p]`` over ``n_sink ≤ p < q_t``; equal probabilities go
  to the nearer key (larger ``p``), so a row has one peak set whatever the chunking.
- ``cumulative`` — ``S[t] = Σ_{t' ≤ t} m[t']`` (``kvscope.analysis.mass``).
- ``top_fraction_codes`` — the top-``ρ`` selection (``kvscope.analysis.top_fraction_selection``).
- ``fmm_curve`` — FMM at several horizons from ``S`` (``kvscope.analysis.fmm.fmm_kernel``).
- ``lir_episodes`` — LIR's episode walk (``kvscope.analysis.lir.lir_kernel``).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..errors import StoreError

N_PEAK_EXTRA = 5  # Σ log d, Σ d, then (after the bins) Σ FP share, Σ recency share, rows with mass


def peak_width(n_bins: int) -> int:
    """Length of a head's peak/coverage vector: ``2 + n_bins + 3``."""
    return n_bins + N_PEAK_EXTRA


SCAN = 32  # positions per block: blocks whose maximum cannot reach the top k are passed over


@njit(nogil=True, cache=True, fastmath={"nnan", "ninf", "nsz"})
def _block_maxima(buf, lo, hi, out):  # pragma: no cover - compiled
    """``out[b] = max buf[lo + b·SCAN : lo + (b+1)·SCAN]`` (clipped at ``hi``; no NaN there)."""
    n_full = (hi - lo) // SCAN
    for b in range(n_full):
        start = lo + b * SCAN
        m = buf[start]
        for i in range(1, SCAN):  # a fixed count: compiled to vector max
            m = max(m, buf[start + i])
        out[b] = m
    if lo + n_full * SCAN < hi:
        m = buf[lo + n_full * SCAN]
        for i in range(lo + n_full * SCAN + 1, hi):
            m = max(m, buf[i])
        out[n_full] = m
        return n_full + 1
    return n_full


@njit(nogil=True, cache=True)
def _top_k(buf, lo, hi, k, top_v, top_p, block_max):  # pragma: no cover - compiled
    """The ``k`` largest ``buf[p]``, ``lo ≤ p < hi``, in (value, position) order (the later
    of equal values wins) into ``top_v``/``top_p``; returns how many (``min(k, hi − lo)``).

    Exact without visiting most blocks: the k-th largest block maximum ``τ`` is ≤ the k-th
    largest value (k blocks hold a value ≥ τ), so every one of the top k lies in a block
    whose maximum is ≥ τ; only those blocks are scanned, in position order."""
    n_blocks = _block_maxima(buf, lo, hi, block_max)
    tau = -np.inf
    if n_blocks > k:  # τ: the k-th largest of the block maxima
        for i in range(k):
            top_v[i] = block_max[i]
        low = _lowest(top_v, top_p, k, False)
        for b in range(k, n_blocks):
            if block_max[b] > top_v[low]:
                top_v[low] = block_max[b]
                low = _lowest(top_v, top_p, k, False)
        tau = top_v[low]
    n = 0
    low = 0
    for b in range(n_blocks):
        if block_max[b] < tau:
            continue
        for p in range(lo + b * SCAN, min(lo + (b + 1) * SCAN, hi)):
            v = buf[p]
            if v < tau:  # at least k values are ≥ τ: this one is not among them
                continue
            if n < k:
                top_v[n] = v
                top_p[n] = p
                n += 1
                if n == k:
                    low = _lowest(top_v, top_p, n, True)
            elif v >= top_v[low]:
                top_v[low] = v
                top_p[low] = p
                low = _lowest(top_v, top_p, n, True)
    return n


@njit(nogil=True, cache=True)
def _lowest(top_v, top_p, n, by_position):  # pragma: no cover - compiled
    """Index of the smallest of the first ``n`` values (equal values: the earlier position)."""
    low = 0
    for i in range(1, n):
        if top_v[i] < top_v[low] or (by_position and top_v[i] == top_v[low] and top_p[i] < top_p[low]):
            low = i
    return low


@njit(nogil=True, cache=True)
def half_to_single(bits, out):  # pragma: no cover - compiled
    """fp16 bit patterns ``bits`` (uint16) → float32 ``out``, exactly (every one of the 65,536
    patterns: tests/test_kernels.py), in integer steps the compiler vectorizes: sign moved to
    bit 31, exponent rebased by 127 − 15 (all ones: Inf/NaN), mantissa shifted by 13; zeros
    and subnormals are ``± m · 2^-24``."""
    raw = out.view(np.uint32)
    for p in range(bits.shape[0]):
        b = np.uint32(bits[p])
        e, m = b & np.uint32(0x7C00), b & np.uint32(0x03FF)
        if e == np.uint32(0x7C00):
            body = np.uint32(0x7F800000) | (m << np.uint32(13))
        else:
            body = ((e + np.uint32(0x1C000)) << np.uint32(13)) | (m << np.uint32(13))
        raw[p] = ((b & np.uint32(0x8000)) << np.uint32(16)) | body
    for p in range(bits.shape[0]):
        b = bits[p]
        if (b & 0x7C00) == 0:
            v = np.float32(b & 0x03FF) * np.float32(2.0**-24)
            out[p] = -v if b & 0x8000 else v


@njit(nogil=True, cache=True)
def row_block_stats(
    half, full, table, q, fp, n_sink, w, n_units, k, n_bins, windows, stats, checks, totals
):  # pragma: no cover
    """One pass over a block of rows ``[step, H, pos]``, given as fp16 bit patterns ``half``
    (uint16, decoded through ``table``: ``HALF_TABLE``) or as float32 ``full`` (the other one empty). NaN
    (nothing stored: beyond the query) counts as 0. Each row is decoded once into a buffer
    that stays in cache for every statistic, and checked on the way:

    ``checks  [5]`` float64, accumulated over rows with a query: rows whose NaN are not exactly
              the positions beyond the query, the smallest and the largest value up to the
              query of rows holding one outside ``[0, HIGHEST]`` (±inf while none does: only
              those are counted in full), and the largest excess of ``|Σ row − 1|`` over the tolerance of ``n`` stored
              values (``T(n) = 2^-10 + n·2^-24`` for fp16, ``10^-5 + n·2^-23`` for fp32; > 0 = a
              bad sum); ``checks[4]`` (read, not written) is the relative error ``ρ`` of a lossy
              row format (``kvscope.storage.rowformat``), which widens the tolerance to
              ``T(n) + ρ·(1 + T(n) + n·m)`` (``m`` the dtype's smallest normal).
    ``totals  [step, H]`` float64 what each row sums to where it is not 1: ``1 − σ`` of a model
              with learned sinks (σ the sink's share, stored beside the row); empty: every row 1

    ``q       [step]`` int64 query position of each row (−1: no query at that step)
    ``fp      [step, F]`` int64 LogQuant FP positions of each step (−1 padded)
    ``windows [step, H, n_units]`` float64, written: masses of the windows of ``w`` positions
              after ``n_sink`` (``n_units = 0``: not written)
    ``stats   [H, n_bins + 5]`` float64, accumulated over the block's rows (``k = 0``: skipped):
              ``Σ log d``, ``Σ d`` over the peaks (``d = q − p``), peaks per log2 bin
              ``[2^i, 2^{i+1})`` (the last bin takes the rest), ``Σ`` of each row's share of
              non-sink mass ``Σ_{n_sink ≤ p ≤ q}`` on the FP set and on the ``|FP set|`` newest
              positions, and the number of rows with mass.
    """
    is_half = half.shape[0] > 0
    n_steps, n_heads, n_pos = half.shape if is_half else full.shape
    n_win = max(0, (n_pos - n_sink) // w)
    buf = np.empty(n_pos, np.float32)
    win = np.empty(n_win, np.float32)
    top_v = np.empty(max(k, 1), np.float32)
    top_p = np.empty(max(k, 1), np.int64)
    block_max = np.empty(n_pos // SCAN + 1, np.float32)
    zero = np.float32(0.0)
    for t in range(n_steps):
        qt = q[t]
        if k > 0 and qt < 0 and n_units == 0:
            continue
        fp_size = 0
        for i in range(fp.shape[1]):
            if fp[t, i] >= n_sink:
                fp_size += 1
        for h in range(n_heads):
            if is_half:
                nans = _decode_half_row(half[t, h], table, buf)
            else:
                buf[:] = full[t, h]
                nans = 0
                for p in range(n_pos):
                    v = buf[p]
                    nans += v != v
                    buf[p] = v if v == v else zero
            if qt >= 0:
                target = totals[t, h] if totals.shape[0] else 1.0
                _check_row(buf, qt, nans, n_pos=n_pos, is_half=is_half, checks=checks, target=target)
            if n_units == 0 and k == 0:  # the checks only
                continue
            for j in range(n_win):  # position order within each window, windows side by side
                win[j] = buf[n_sink + j * w]
            for i in range(1, w):
                for j in range(n_win):
                    win[j] += buf[n_sink + j * w + i]
            stored = 0.0  # Σ of the windows: the row's non-sink mass up to q (nothing beyond it)
            for j in range(n_win):
                stored += win[j]
            for j in range(n_units):
                windows[t, h, j] = win[j]
            if k == 0 or qt < 0:
                continue
            n = _top_k(buf, n_sink, qt, k, top_v=top_v, top_p=top_p, block_max=block_max)
            for i in range(n):
                d = qt - top_p[i]
                stats[h, 0] += math.log(d)
                stats[h, 1] += d
                b = 0
                while b + 1 < n_bins and (d >> (b + 1)) > 0:
                    b += 1
                stats[h, 2 + b] += 1.0
            # coverage: non-sink mass on LogQuant's FP set and on a recency window of its size
            if qt < n_sink:
                continue
            total = stored
            for p in range(n_sink + n_win * w, qt + 1):
                total += buf[p]
            if total > 0:
                on_fp = 0.0
                for i in range(fp.shape[1]):
                    p = fp[t, i]
                    if p >= n_sink and p <= qt:
                        on_fp += buf[p]
                recent = 0.0
                for p in range(max(n_sink, qt - fp_size + 1), qt + 1):
                    recent += buf[p]
                stats[h, 2 + n_bins] += on_fp / total
                stats[h, 3 + n_bins] += recent / total
                stats[h, 4 + n_bins] += 1.0


@njit(nogil=True, cache=True)
def _check_row(buf, qt, nans, n_pos, is_half, checks, target):  # pragma: no cover - compiled
    """Fold one decoded row (NaN already 0 in ``buf``, ``nans`` counted) that must sum to
    ``target`` into ``checks``."""
    n = min(qt + 1, n_pos)
    if nans != n_pos - n:
        checks[0] += 1.0
    total, outside = _half_row_sum(buf, n) if is_half else _row_sum(buf, n)
    if outside:  # a value no probability has: the row's extremes, for the message
        lo, hi = checks[1], checks[2]
        for p in range(n):
            lo = min(lo, buf[p])
            hi = max(hi, buf[p])
        checks[1], checks[2] = lo, hi
    tolerance = 2.0**-10 + n * 2.0**-24 if is_half else 1e-5 + n * 2.0**-23
    tolerance += checks[4] * (1.0 + tolerance + n * (2.0**-14 if is_half else 2.0**-126))
    checks[3] = max(checks[3], abs(total - target) - tolerance)


HIGHEST = np.float32(1.0 + 2.0**-10)  # the largest value a stored probability may hold (fp16 rounding of 1)


@njit(nogil=True, cache=True)
def _row_sum(buf, n):  # pragma: no cover - compiled
    """``(Σ buf[:n] in float64, position order; how many lie outside [0, HIGHEST])``."""
    total, outside = 0.0, 0
    for p in range(n):
        v = buf[p]
        total += v
        outside += (v < 0) | (v > HIGHEST)
    return total, outside


@njit(nogil=True, cache=True, fastmath={"reassoc", "nsz"})
def _half_row_sum(buf, n):  # pragma: no cover - compiled
    """``_row_sum`` of values decoded from fp16, in any order: each is a multiple of 2^-24,
    so float64 partial sums below 2^29 are exact and the order cannot change them — the compiler
    may add in vector lanes. (A row whose sum reaches 2^29 holds values no probability row has
    and fails its check by far, whatever the last bits.)"""
    total, outside = 0.0, 0
    for p in range(n):
        v = buf[p]
        total += np.float64(v)
        outside += (v < 0) | (v > HIGHEST)
    return total, outside


@njit(nogil=True, cache=True)
def _decode_half_row(bits, table, out):  # pragma: no cover - compiled
    """``out[p] = table[bits[p]]`` (fp16 → float32 with NaN as 0: ``HALF_TABLE``); returns
    how many of ``bits`` are NaN (exponent all ones, mantissa not 0)."""
    nans = 0
    for p in range(bits.shape[0]):
        b = bits[p]
        out[p] = table[b]
        nans += (b & 0x7FFF) > 0x7C00
    return nans


def _half_table() -> np.ndarray:
    """float32 of every fp16 bit pattern (``half_to_single``), NaN patterns as 0."""
    table = np.empty(1 << 16, np.float32)
    half_to_single(np.arange(1 << 16, dtype=np.uint16), table)
    table[np.isnan(table)] = 0.0
    return table


HALF_TABLE = _half_table()  # 256 KiB: a row's decode is one lookup per position


def new_checks(slack: float = 0.0) -> np.ndarray:
    """The ``checks`` accumulator of ``row_block_stats``, empty, for rows stored with the
    relative error ``slack`` (``kvscope.storage.rowformat.RowFormat.slack``; 0: exact rows)."""
    return np.array([0.0, np.inf, -np.inf, -np.inf, float(slack)])


def row_checks(x: np.ndarray, q: np.ndarray, slack: float = 0.0, totals=None) -> np.ndarray:
    """The checks of probability rows ``x [a, b, pos]`` (as stored with relative error
    ``slack``) whose queries sit at ``q [a]`` (−1: none), nothing else computed; ``totals
    [a, b]``: what each row sums to (None: 1)."""
    checks = new_checks(slack)
    no_fp, no_windows, no_stats = (
        np.empty((x.shape[0], 0), np.int64),
        np.empty(x.shape[:2] + (0,)),
        np.empty((x.shape[1], 0)),
    )
    block_stats(
        x, q, no_fp, n_sink=0, w=x.shape[-1], n_units=0, k=0, n_bins=1, windows=no_windows, stats=no_stats,
        checks=checks, totals=totals,
    )  # fmt: skip
    return checks


def refuse_bad_rows(checks: np.ndarray, where: str) -> None:
    """One line naming the rows and what is wrong with them (a value a trace cannot hold)."""
    problem = rows_problem(checks)
    if problem is not None:
        raise StoreError(f"{where}: {problem}; kvscope verify names every such chunk")


def rows_problem(checks: np.ndarray) -> str | None:
    """What is wrong with the rows ``checks`` summarize, or None."""
    if checks[0]:
        return f"{int(checks[0])} row(s) with NaN where a probability belongs or values beyond the query"
    if checks[1] < 0 or checks[2] > HIGHEST:
        return f"probabilities outside [0, 1] (min {checks[1]:.3g}, max {checks[2]:.3g})"
    if checks[3] > 0:
        return (
            f"rows that do not sum to 1 (less their learned sink's share) (off by {checks[3]:.3g} beyond the "
            "tolerance of their dtype and format)"
        )
    return None


_NO_HALF = np.empty((0, 0, 0), dtype=np.uint16)
_NO_FULL = np.empty((0, 0, 0), dtype=np.float32)
_ONES = np.empty((0, 0), dtype=np.float64)  # totals: every row sums to 1


def block_stats(
    x, q, fp, *, n_sink: int, w: int, n_units: int, k: int, n_bins: int, windows, stats, checks=None, totals=None
):
    """``row_block_stats`` on rows ``x [step, H, pos]`` as stored (fp16 or any float);
    ``checks`` (``new_checks``) accumulates the row checks of rows with a query, which sum
    to ``totals [step, H]`` (``1 − σ`` under learned sinks: ``row_totals``; None: 1).

    Peaks only (``n_units = 0``) still sum windows of ``w`` for each row's total mass."""
    if w < 1 or n_sink + n_units * w > x.shape[-1]:
        raise ValueError(f"{n_units} windows of {w} after {n_sink} do not fit in {x.shape[-1]} positions")
    q = np.ascontiguousarray(q, dtype=np.int64)
    fp = np.ascontiguousarray(fp, dtype=np.int64)
    if x.dtype == np.float16:
        half, full = np.ascontiguousarray(x).view(np.uint16), _NO_FULL
    else:
        half, full = _NO_HALF, np.ascontiguousarray(x, dtype=np.float32)
    checks = new_checks() if checks is None else checks
    totals = _ONES if totals is None else np.ascontiguousarray(np.broadcast_to(totals, x.shape[:2]), dtype=np.float64)
    row_block_stats(
        half, full, HALF_TABLE, q, fp=fp, n_sink=n_sink, w=w, n_units=n_units, k=k, n_bins=n_bins, windows=windows,
        stats=stats, checks=checks, totals=totals,
    )  # fmt: skip


def step_blocks(t0: int, n: int, block_steps: int) -> list[tuple[int, int]]:
    """Steps ``t0 … t0+n−1`` cut where the store's blocks of ``block_steps`` steps end:
    ``[(start, stop), …]`` relative to ``t0``. Sums over a block's rows (peaks, coverage) are
    made per stored block whatever the task holds, so that they keep their bits however many
    blocks a task reads (``open_trace(chunks="analysis")``)."""
    cuts = [t0, *range((t0 // block_steps + 1) * block_steps, t0 + n, block_steps), t0 + n]
    return [(a - t0, b - t0) for a, b in zip(cuts[:-1], cuts[1:])]


def row_totals(shares) -> np.ndarray | None:
    """What rows sum to given their learned sink's shares ``σ`` (any shape; None: no sinks, 1).
    A row with no share recorded (NaN: no query there) keeps 1: it is not checked."""
    if shares is None:
        return None
    shares = np.asarray(shares, dtype=np.float64)
    return 1.0 - np.nan_to_num(shares, nan=0.0)


@njit(nogil=True, cache=True)
def _cumulative(m, out):  # pragma: no cover - compiled
    for a in range(m.shape[0]):
        for u in range(m.shape[2]):
            out[a, 0, u] = m[a, 0, u]
        for t in range(1, m.shape[1]):
            for u in range(m.shape[2]):
                out[a, t, u] = out[a, t - 1, u] + m[a, t, u]


def cumulative(m: np.ndarray) -> np.ndarray:
    """``S[..., t, u] = Σ_{t' ≤ t} m[..., t', u]`` in float64, summed in step order (the bits
    of ``np.cumsum(m, axis=-2)``), C-contiguous; GIL-free."""
    m = np.asarray(m, dtype=np.float64)
    out = np.empty(m.shape)
    if m.shape[-2] and m.size:
        _cumulative(m.reshape(-1, *m.shape[-2:]), out.reshape(-1, *m.shape[-2:]))
    return out


@njit(nogil=True, cache=True)
def top_fraction_codes(scores, candidate, top_frac, out):  # pragma: no cover - compiled
    """Top-``ρ`` selection per ``[a, e]`` row of ``scores [A, E, U]``: ``out`` int8 −1 (not a
    candidate), 0, 1. ``k = ceil(ρ · n_candidates)``: every candidate above the k-th largest
    score, then those equal to it from the oldest unit on."""
    n_a, n_e, n_u = scores.shape
    pool = np.empty(n_u)
    for a in range(n_a):
        for e in range(n_e):
            n = 0
            for u in range(n_u):
                if candidate[a, e, u]:
                    pool[n] = scores[a, e, u]
                    n += 1
            k = int(math.ceil(top_frac * n - 1e-9))
            kth = np.inf
            above = 0
            if k > 0:
                kth = np.partition(pool[:n], n - k)[n - k]
                for i in range(n):
                    above += pool[i] > kth
            room = k - above
            for u in range(n_u):
                if not candidate[a, e, u]:
                    out[a, e, u] = -1
                elif scores[a, e, u] > kth:
                    out[a, e, u] = 1
                elif scores[a, e, u] == kth and room > 0:
                    out[a, e, u] = 1
                    room -= 1
                else:
                    out[a, e, u] = 0


@njit(nogil=True, cache=True)
def lir_episodes(sel, n_valid, m, h_lir, eligible, reactivated):  # pragma: no cover - compiled
    """Walk every unit's events of ``sel [A, E, U]`` (first ``n_valid[a]`` only) and count its
    inactive episodes into ``eligible[a]`` and ``reactivated[a]`` (``h_lir < 0``: no limit)."""
    n_a, n_e, n_u = sel.shape
    for a in range(n_a):
        end = min(n_valid[a], n_e)
        for u in range(n_u):
            prev = -1
            start = -1
            for e in range(end + 1):
                v = sel[a, e, u] if e < end else 0
                if start >= 0 and (e == end or v != 0):  # the run ends: a 1, a −1, or the trace's end
                    if e - start >= m:
                        eligible_at = start + m - 1
                        is_one = e < end and v == 1
                        if h_lir < 0:
                            eligible[a] += 1
                            reactivated[a] += is_one
                        elif eligible_at + h_lir <= end - 1:
                            eligible[a] += 1
                            reactivated[a] += is_one and e - eligible_at <= h_lir
                    start = -1
                if e < end:
                    if v == 0 and prev == 1:
                        start = e
                    prev = v


@njit(nogil=True, cache=True)
def fmm_curve(cum, steps, horizons, n_steps, exists, missed, out):  # pragma: no cover - compiled
    """FMM of every event at every horizon straight from cumulative masses, without
    materializing the future masses (``kvscope.analysis.fmm.fmm_kernel`` is the
    definition; they agree to rounding):

    ``cum [A, step, U]``, ``steps [E]``, ``horizons [K]``, ``exists [E, U]``,
    ``missed [A, E, U]`` → ``out [A, K, E]``; NaN when ``step + H > n_steps − 1`` (censored)
    or when the existing units receive no future mass."""
    n_a, n_u = cum.shape[0], cum.shape[2]
    for a in range(n_a):
        for k in range(horizons.shape[0]):
            for e in range(steps.shape[0]):
                t = steps[e]
                ahead = t + horizons[k]
                out[a, k, e] = np.nan
                if ahead > n_steps - 1:
                    continue
                den = 0.0
                num = 0.0
                for u in range(n_u):
                    if exists[e, u]:
                        f = cum[a, ahead, u] - cum[a, t, u]
                        den += f
                        if missed[a, e, u]:
                            num += f
                if den > 0:
                    out[a, k, e] = num / den
