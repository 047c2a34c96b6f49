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

import dask.array as dsa
import numpy as np
import xarray as xr
from scipy.optimize import minimize_scalar

from ..errors import KvscopeError
from ..policies.logquant import fp_sets_per_step
from .mass import filled_rows, head_dim


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


def fit(n_d: np.ndarray, N_D: np.ndarray, kind: str = "power") -> tuple[float, float]:
    """MLE of α (power law) or λ (exponential), truncated per row at its ``D``:
    returns (parameter, log-likelihood). ``n_d``, ``N_D`` indexed by distance 0..n−1."""
    if n_d.sum() == 0:
        return math.nan, math.nan
    last = int(max(np.flatnonzero(n_d).max(), np.flatnonzero(N_D).max())) + 1
    n_d, N_D = np.asarray(n_d[:last], float), np.asarray(N_D[:last], float)
    d = np.arange(1, last, dtype=np.float64)
    x = np.log(d) if kind == "power" else d  # density ∝ exp(−θ·x)
    data = np.dot(n_d[1:], x)
    n_rows = N_D[1:]

    def neg_log_lik(theta: float) -> float:
        log_z = np.log(np.maximum(np.cumsum(np.exp(-theta * x)), 1e-300))  # log Z(D), D = 1..last−1
        return theta * data + np.dot(n_rows, log_z)

    bounds = (-3.0, 8.0) if kind == "power" else (0.0, 5.0)
    with np.errstate(over="ignore"):
        res = minimize_scalar(neg_log_lik, bounds=bounds, method="bounded", options={"xatol": 1e-5})
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


def _block_rows(x: np.ndarray, q: np.ndarray, fp_sets, n_sink: int, k: int, block_info=None) -> np.ndarray:
    """Everything peaks needs from one block of rows, in one pass: float32
    ``[s, step, l, h, k + 3]`` = the distances ``q − p`` of the top-``k`` peaks (0 = none),
    the share of the row's non-sink mass on LogQuant's FP set, the share on a recency
    window of the same size, and 1 where the row has non-sink mass.

    ``x [s, step, l, h, pos]`` float32 (0 beyond query_pos), ``q [s, step, 1, 1, 1]``;
    ``fp_sets(sample)`` the LogQuant FP positions ``[step, 3W]`` (−1 padded). A few bytes
    per row come back, so memory does not grow with the trace.
    """
    import torch

    s_, n_step, n_l, n_h, n_pos = x.shape
    xt = torch.from_numpy(x)
    qb = np.asarray(q[0, :, 0, 0, 0], dtype=np.int64)
    qt = torch.from_numpy(qb)
    pos = torch.arange(n_pos)
    # peaks: top-k among non-sink keys before the query's own position
    cand = (pos >= n_sink) & (pos[None, :] < qt[:, None])  # [step, pos]
    vals, idx = xt.masked_fill(~cand[None, :, None, None, :], float("-inf")).topk(min(k, n_pos), dim=-1)
    dist = torch.where(torch.isfinite(vals), qt[None, :, None, None, None] - idx, torch.zeros((), dtype=torch.int64))
    # coverage: masks over positions, built per block (they depend on the step only)
    sample = block_info[0]["chunk-location"][0]
    t0 = block_info[0]["array-location"][1][0]
    fp = fp_sets(sample)[t0 : t0 + n_step]  # [≤step, 3W]
    p_np = np.arange(n_pos)
    visible = (qb >= 0)[:, None] & (p_np[None, :] >= n_sink) & (p_np[None, :] <= qb[:, None])
    lq = np.zeros((n_step, n_pos + 1), dtype=bool)
    kept = fp >= n_sink
    lq[np.broadcast_to(np.arange(len(fp))[:, None], fp.shape)[kept], fp[kept]] = True
    size = np.zeros(n_step, dtype=np.int64)
    size[: len(fp)] = kept.sum(1)
    recent = visible & (p_np[None, :] > (qb - size)[:, None])
    masks = torch.from_numpy(np.stack([visible, lq[:, :n_pos] & visible, recent], -1).astype(np.float32))
    sums = torch.matmul(xt.reshape(s_, n_step, n_l * n_h, n_pos), masks[None])  # [s, step, l·h, 3]
    sums = sums.reshape(s_, n_step, n_l, n_h, 3)
    total = sums[..., 0]
    ok = total > 0
    shares = torch.where(ok[..., None], sums[..., 1:] / total.clamp_min(1e-30)[..., None], torch.zeros(()))
    out = torch.zeros((s_, n_step, n_l, n_h, k + 3), dtype=torch.float32)
    out[..., : dist.shape[-1]] = dist.to(torch.float32)
    out[..., k : k + 2] = shares
    out[..., k + 2] = ok.to(torch.float32)
    return out.numpy()


def stats_from_distances(dist: np.ndarray, qpos: np.ndarray, n_sink: int, n_dist: int) -> np.ndarray:
    """Per-trace-unit sufficient statistics ``[sample, layer, H, n_dist, 3]`` (see
    :func:`row_peaks`) from peak distances ``[sample, step, layer, H, k]``."""
    S_n, S, L, H, _ = dist.shape
    unit = np.arange(S_n * L * H).reshape(S_n, 1, L, H)  # [sample, 1, layer, H]
    size = S_n * L * H * n_dist
    picked = dist > 0
    keys = (unit[..., None] * n_dist + np.clip(dist, 0, n_dist - 1))[picked]
    D = (qpos - n_sink)[:, :, None, None]  # [sample, step, 1, 1]
    has_row = np.broadcast_to(D >= 1, picked.shape[:-1])
    row_keys = np.broadcast_to(unit * n_dist + np.clip(D, 0, n_dist - 1), has_row.shape)[has_row]
    n_picked = picked.sum(-1)[has_row]
    out = np.empty((size, 3), dtype=np.int64)
    out[:, 0] = np.bincount(keys, minlength=size)
    out[:, 1] = np.bincount(row_keys, weights=n_picked, minlength=size)
    out[:, 2] = np.bincount(row_keys, minlength=size)
    return out.reshape(S_n, L, H, n_dist, 3)


def peak_statistics(
    ds: xr.Dataset,
    *,
    k: int = 8,
    n_sink: int | None = None,
    layers=None,
    heads=None,
    logquant_window: int = 32,
    compute: bool = True,
):
    """One streaming pass over the rows: ``(rows, per_row)`` with ``per_row [sample, step,
    layer, H, k + 3]`` from :func:`_block_rows` (numpy, or dask with ``compute=False`` so
    that other analyses can share the read)."""
    if k < 1:
        raise KvscopeError(f"--top-k must be ≥ 1 (got {k})")
    n_sink = int(ds.attrs.get("n_sink", 4) if n_sink is None else n_sink)
    a = filled_rows(ds, layers, heads)
    arr = a.data
    qpos = np.asarray(ds["query_pos"].values)  # [sample, step]
    c = arr.chunks
    q_arr = dsa.from_array(qpos[:, :, None, None, None], chunks=(c[0], c[1], 1, 1, 1))
    per_row = dsa.map_blocks(
        _block_rows,
        arr,
        q_arr,
        LogQuantSets(ds, logquant_window),
        n_sink,
        k,
        dtype=np.float32,
        chunks=c[:4] + ((k + 3,),),
    )
    if compute:
        per_row = per_row.compute()
    return a, per_row


class LogQuantSets:
    """LogQuant FP positions of every step of a sample, built on first use (per process)."""

    def __init__(self, ds: xr.Dataset, W: int):
        self.prompt_len = np.asarray(ds["prompt_len"].values)
        self.n_steps = np.asarray(ds["n_steps"].values)
        self.W = W
        self._cache: dict[int, np.ndarray] = {}

    def __call__(self, sample: int) -> np.ndarray:
        """``[step, 3W]`` FP positions of each valid step, −1 padded."""
        if sample not in self._cache:
            sets = fp_sets_per_step(int(self.prompt_len[sample]), int(self.n_steps[sample]), self.W)
            out = np.full((len(sets), 3 * self.W), -1, dtype=np.int64)
            for t, fp in enumerate(sets):
                out[t, : len(fp)] = fp
            self._cache[sample] = out
        return self._cache[sample]

    def __getstate__(self):  # shipped to dask workers without the cache
        return {"prompt_len": self.prompt_len, "n_steps": self.n_steps, "W": self.W, "_cache": {}}


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
    precomputed=None,
) -> xr.Dataset:
    """Exposure-normalized log2 histogram of peak distances, α fit with CI, AIC comparison
    and LogQuant coverage. Returns an ``xarray.Dataset`` (see module docstring).
    ``precomputed``: the ``(rows, stats, coverage)`` of :func:`peak_statistics`."""
    a, per_row = precomputed or peak_statistics(
        ds, k=k, n_sink=n_sink, layers=layers, heads=heads, logquant_window=logquant_window
    )
    n_sink_ = int(ds.attrs.get("n_sink", 4) if n_sink is None else n_sink)
    distances = per_row[..., :k].astype(np.int64)
    stats = stats_from_distances(distances, np.asarray(ds["query_pos"].values), n_sink_, a.sizes["pos"] + 1)
    coverage = per_row[..., k:].astype(np.float64).sum(1)  # [sample, layer, H, 3]
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
        n_units = units.shape[0]
        fit_stats = units[..., :2].reshape(n_units, -1)  # [unit, distance·2], no per-draw copies
        for _ in range(n_boot):
            weights = np.bincount(rng.integers(0, n_units, n_units), minlength=n_units)
            sample = (weights @ fit_stats).reshape(-1, 2)
            boot.append(fit(sample[:, 0], sample[:, 1], "power")[0])
    lo, hi = np.quantile(boot, [0.025, 0.975]) if boot else (math.nan, math.nan)
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
        attrs={
            "metric": "peaks",
            "k": k,
            "n_sink": int(ds.attrs.get("n_sink", 4) if n_sink is None else n_sink),
            "logquant_W": logquant_window,
            "best_model": best,
            "heads_dim": hdim,
        },
    )
