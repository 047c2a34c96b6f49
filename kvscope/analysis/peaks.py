"""Log-distributed attention peaks — LogQuant's observation (SPEC §4.4).

For each row (step ``t``, trace unit) the *peaks* are the top-``k`` keys by probability,
excluding the sinks and the query's own position; their distance ``d = q − p ≥ 1``,
``q = query_pos[t]``. A row can only show distances ``1 ≤ d ≤ D = q − n_sink``::

    count[i]    = #peaks with d ∈ [2^i, 2^{i+1})
    exposure[i] = Σ_rows #{d ∈ [2^i, 2^{i+1}) : d ≤ D_row}         (row, distance) pairs possible
    density[i]  = count[i] / exposure[i]                            peaks per possible position

Fit ``density ∝ d^(−α)`` by maximum likelihood of a discrete power law truncated per row::

    log L(α) = −α Σ_d n_d log d − Σ_D N_D log Z_α(D),   Z_α(D) = Σ_{d=1}^{D} d^(−α)

(``n_d`` peaks at distance ``d``, ``N_D`` peaks from rows with ``D``), with a bootstrap CI
over trace units, compared by AIC with a truncated exponential ``∝ e^(−λd)`` and the
uniform ``1/D``. LogQuant's claim corresponds to ``α ≈ 1`` (equal mass per log2 bin).

Coverage: mean fraction of a row's non-sink mass that LogQuant's FP set (§5.1, window
``W``) holds, against a recency window of the same number of non-sink positions.
"""

from __future__ import annotations

import math

import dask
import dask.array as dsa
import numpy as np
import xarray as xr
from scipy.optimize import minimize_scalar

from ..errors import KvscopeError
from ..policies.logquant import fp_sets_per_step
from .mass import head_dim, rows


def row_peaks(a: np.ndarray, q: np.ndarray, n_sink: int, k: int, n_dist: int) -> np.ndarray:
    """Sufficient statistics of one block of rows.

    ``a [..., step, pos]`` probabilities (NaN beyond ``q``), ``q [..., step]`` query positions
    (−1 = no row). Returns ``[..., n_dist, 3]``: per distance/D index ``x``:
    ``[:, 0]`` peaks at distance ``x``, ``[:, 1]`` peaks from rows with ``D = x``,
    ``[:, 2]`` rows with ``D = x`` (exposure).
    """
    lead = a.shape[:-2]
    n_pos = a.shape[-1]
    pos = np.arange(n_pos)
    q = np.broadcast_to(q, a.shape[:-1])
    cand = (pos >= n_sink) & (pos < q[..., None])  # [..., step, pos]
    scores = np.where(cand, np.nan_to_num(a, nan=-1.0), -np.inf).astype(np.float32)
    kk = min(k, n_pos)
    top = np.argpartition(-scores, kk - 1, axis=-1)[..., :kk] if kk < n_pos else np.broadcast_to(pos, scores.shape)
    picked = np.take_along_axis(cand, top, axis=-1)  # a peak only where it was a candidate
    dist = q[..., None] - top  # [..., step, k]
    D = q - n_sink  # [..., step]
    has_row = D >= 1
    out = np.zeros(lead + (n_dist, 3), dtype=np.int64)
    flat_lead = int(np.prod(lead)) if lead else 1
    picked_f = picked.reshape(flat_lead, -1, kk)
    dist_f = dist.reshape(flat_lead, -1, kk)
    D_f = np.broadcast_to(D, picked.shape[:-1]).reshape(flat_lead, -1)
    row_f = np.broadcast_to(has_row, picked.shape[:-1]).reshape(flat_lead, -1)
    o = out.reshape(flat_lead, n_dist, 3)
    for i in range(flat_lead):
        d_ok = dist_f[i][picked_f[i]]
        np.add.at(o[i, :, 0], np.clip(d_ok, 0, n_dist - 1), 1)
        n_per_row = picked_f[i].sum(-1)
        rows_ok = row_f[i]
        np.add.at(o[i, :, 1], np.clip(D_f[i][rows_ok], 0, n_dist - 1), n_per_row[rows_ok])
        np.add.at(o[i, :, 2], np.clip(D_f[i][rows_ok], 0, n_dist - 1), 1)
    return out


def _log_z(alpha: float, n_dist: int, kind: str) -> np.ndarray:
    """``log Z(D)`` for D = 0..n_dist−1 (Z(0) := 1)."""
    d = np.arange(1, n_dist, dtype=np.float64)
    terms = d ** (-alpha) if kind == "power" else np.exp(-alpha * d)
    z = np.concatenate([[1.0], np.cumsum(terms)])
    return np.log(np.maximum(z, 1e-300))


def _neg_log_lik(param: float, n_d: np.ndarray, N_D: np.ndarray, kind: str) -> float:
    d = np.arange(n_d.shape[-1], dtype=np.float64)
    if kind == "power":
        data = -param * np.dot(n_d[1:], np.log(d[1:]))
    else:
        data = -param * np.dot(n_d, d)
    return -(data - np.dot(N_D, _log_z(param, n_d.shape[-1], kind)))


def fit(n_d: np.ndarray, N_D: np.ndarray, kind: str = "power") -> tuple[float, float]:
    """MLE of α (power) or λ (exponential): returns (parameter, log-likelihood)."""
    if n_d.sum() == 0:
        return math.nan, math.nan
    bounds = (-3.0, 8.0) if kind == "power" else (-0.5, 5.0)
    res = minimize_scalar(_neg_log_lik, bounds=bounds, args=(n_d, N_D, kind), method="bounded",
                          options={"xatol": 1e-6})
    return float(res.x), float(-res.fun)


def uniform_log_lik(N_D: np.ndarray) -> float:
    D = np.arange(N_D.shape[-1], dtype=np.float64)
    ok = N_D > 0
    return float(-np.dot(N_D[ok], np.log(D[ok])))


def log2_histogram(n_d: np.ndarray, rows_D: np.ndarray) -> dict:
    """Counts, exposure and density per log2 bin ``[2^i, 2^{i+1})``."""
    n_dist = n_d.shape[-1]
    exposure_d = np.cumsum(rows_D[::-1])[::-1]  # rows with D ≥ d
    n_bins = max(1, int(math.floor(math.log2(max(1, n_dist - 1)))) + 1)
    counts = np.zeros(n_bins)
    exposure = np.zeros(n_bins)
    for i in range(n_bins):
        lo, hi = 2**i, min(2 ** (i + 1), n_dist)
        counts[i] = n_d[lo:hi].sum()
        exposure[i] = exposure_d[lo:hi].sum()
    with np.errstate(invalid="ignore", divide="ignore"):
        density = np.where(exposure > 0, counts / exposure, np.nan)
    return {"bin_low": 2 ** np.arange(n_bins), "count": counts, "exposure": exposure, "density": density}


def peak_statistics(ds: xr.Dataset, *, k: int = 8, n_sink: int | None = None, layers=None, heads=None,
                    logquant_window: int = 32):
    """One streaming pass over the rows: ``(stats, coverage)`` as numpy arrays.

    ``stats [sample, layer, H, distance, 3]`` (see :func:`row_peaks`);
    ``coverage [sample, layer, H, 3]`` = Σ LogQuant share, Σ recency share, rows.
    """
    if k < 1:
        raise KvscopeError(f"--top-k must be ≥ 1 (got {k})")
    n_sink = int(ds.attrs.get("n_sink", 4) if n_sink is None else n_sink)
    a = rows(ds, layers, heads).transpose("sample", "step", "layer", head_dim(ds["attn"]), "pos")
    block = int(ds.attrs.get("block_steps", 32))
    if not isinstance(a.data, dsa.Array):
        a = a.chunk({"sample": 1, "step": block, "layer": 1})
    arr = a.data.rechunk({4: -1})
    qpos = np.asarray(ds["query_pos"].values)  # [sample, step]
    n_pos = arr.shape[-1]
    n_dist = n_pos + 1
    q_arr = dsa.from_array(qpos[:, :, None, None, None], chunks=(arr.chunks[0], arr.chunks[1], 1, 1, 1))

    def block_peaks(x, qb):
        # x [s, step, l, h, pos] -> move step next to pos
        xs = np.moveaxis(x, 1, 3)  # [s, l, h, step, pos]
        qs = np.moveaxis(np.broadcast_to(qb, x.shape[:-1] + (1,))[..., 0], 1, 3)  # [s, l, h, step]
        return row_peaks(xs, qs, n_sink, k, n_dist)[:, None]  # [s, 1, l, h, n_dist, 3]

    n_blocks = len(arr.chunks[1])
    stats = dsa.map_blocks(
        block_peaks, arr, q_arr, new_axis=[5],
        chunks=(arr.chunks[0], (1,) * n_blocks, arr.chunks[2], arr.chunks[3], (n_dist,), (3,)), dtype=np.int64,
    ).sum(axis=1)

    lq_mask, recent_mask = coverage_masks(ds, n_sink, logquant_window, n_pos)  # [sample, step, pos]
    lq = dsa.from_array(lq_mask[:, :, None, None, :], chunks=(arr.chunks[0], arr.chunks[1], 1, 1, n_pos))
    rc = dsa.from_array(recent_mask[:, :, None, None, :], chunks=(arr.chunks[0], arr.chunks[1], 1, 1, n_pos))

    def block_coverage(x, lqb, rcb, qb):
        x = np.nan_to_num(x.astype(np.float64))
        pos = np.arange(x.shape[-1])
        nonsink = (pos >= n_sink) & (pos <= qb)
        total = (x * nonsink).sum(-1)  # [s, step, l, h]
        ok = (total > 0) & (qb[..., 0] >= 0)
        with np.errstate(invalid="ignore", divide="ignore"):
            share_lq = np.where(ok, (x * lqb).sum(-1) / total, 0.0)
            share_rc = np.where(ok, (x * rcb).sum(-1) / total, 0.0)
        out = np.stack([share_lq.sum(1), share_rc.sum(1), ok.sum(1)], -1)  # [s, l, h, 3]
        return out[:, None]

    coverage = dsa.map_blocks(
        block_coverage, arr, lq, rc, q_arr, drop_axis=[4], new_axis=[4],
        chunks=(arr.chunks[0], (1,) * n_blocks, arr.chunks[2], arr.chunks[3], (3,)), dtype=np.float64,
    ).sum(axis=1)
    stats, coverage = dask.compute(stats, coverage)
    return a, stats, coverage


def coverage_masks(ds: xr.Dataset, n_sink: int, W: int, n_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """``[sample, step, pos]`` LogQuant FP set and an equally large recency window (sinks excluded)."""
    prompt_len = np.asarray(ds["prompt_len"].values)
    n_steps_all = ds.sizes["step"]
    n_valid = np.asarray(ds["n_steps"].values)
    lq = np.zeros((len(prompt_len), n_steps_all, n_pos), dtype=bool)
    rc = np.zeros_like(lq)
    for s, P in enumerate(prompt_len):
        for t, fp in enumerate(fp_sets_per_step(int(P), int(n_valid[s]), W)):
            kept = [p for p in fp if p >= n_sink]
            lq[s, t, kept] = True
            q = int(P) - 1 + t
            size = len(kept)
            lo = max(n_sink, q - size + 1)
            rc[s, t, lo : q + 1] = True
    return lq, rc


def peaks(
    ds: xr.Dataset,
    *,
    k: int = 8,
    n_sink: int | None = None,
    layers=None,
    heads=None,
    logquant_window: int = 32,
    n_boot: int = 200,
    seed: int = 0,
) -> xr.Dataset:
    """Exposure-normalized log2 histogram of peak distances, α fit with CI, AIC comparison
    and LogQuant coverage. Returns an ``xarray.Dataset`` (see module docstring)."""
    a, stats, coverage = peak_statistics(ds, k=k, n_sink=n_sink, layers=layers, heads=heads,
                                         logquant_window=logquant_window)
    hdim = head_dim(a)
    units = stats.reshape(-1, stats.shape[-2], 3)  # [unit, distance, 3]
    n_d, N_D, rows_D = (units[..., i].sum(0) for i in range(3))
    hist = log2_histogram(n_d, rows_D)
    alpha, ll_power = fit(n_d, N_D, "power")
    lam, ll_exp = fit(n_d, N_D, "exponential")
    ll_uniform = uniform_log_lik(N_D)
    rng = np.random.default_rng(seed)
    boot = []
    if np.isfinite(alpha):
        for _ in range(n_boot):
            idx = rng.integers(0, units.shape[0], units.shape[0])
            sample = units[idx].sum(0)
            boot.append(fit(sample[:, 0], sample[:, 1], "power")[0])
    lo, hi = (np.quantile(boot, [0.025, 0.975]) if boot else (math.nan, math.nan))
    per_layer_alpha = []
    for li in range(stats.shape[1]):
        s = stats[:, li].reshape(-1, stats.shape[-2], 3).sum(0)
        per_layer_alpha.append(fit(s[:, 0], s[:, 1], "power")[0])
    cov = coverage.sum((0, 2))  # [layer, 3]
    with np.errstate(invalid="ignore", divide="ignore"):
        cov_lq = cov[:, 0] / cov[:, 2]
        cov_rc = cov[:, 1] / cov[:, 2]
    aic = {"power": 2 - 2 * ll_power, "exponential": 2 - 2 * ll_exp, "uniform": -2 * ll_uniform}
    best = min(aic, key=lambda key: aic[key] if np.isfinite(aic[key]) else np.inf)
    return xr.Dataset(
        {
            "count": ("bin", hist["count"]),
            "exposure": ("bin", hist["exposure"]),
            "density": ("bin", hist["density"]),
            "alpha": alpha,
            "alpha_low": float(lo),
            "alpha_high": float(hi),
            "lambda": lam,
            "aic": ("model", [aic["power"], aic["exponential"], aic["uniform"]]),
            "log_lik": ("model", [ll_power, ll_exp, ll_uniform]),
            "alpha_layer": ("layer", np.asarray(per_layer_alpha)),
            "coverage_logquant": ("layer", cov_lq),
            "coverage_recency": ("layer", cov_rc),
            "n_peaks": int(n_d.sum()),
            "n_rows": int(rows_D.sum()),
        },
        coords={
            "bin": np.arange(len(hist["count"])),
            "bin_low": ("bin", hist["bin_low"]),
            "model": ["power", "exponential", "uniform"],
            "layer": a["layer"].values,
        },
        attrs={"metric": "peaks", "k": k, "n_sink": int(ds.attrs.get("n_sink", 4) if n_sink is None else n_sink),
               "logquant_W": logquant_window, "best_model": best, "heads_dim": hdim},
    )
