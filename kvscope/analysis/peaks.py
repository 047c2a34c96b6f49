"""Log-distributed attention peaks — LogQuant's observation (docs/concepts.md#peaks).

For each row (step ``t``, trace unit) the *peaks* are the top-``k`` keys by probability,
excluding the sinks and the query's own position (equal probabilities: the nearer key);
their distance ``d = q − p ≥ 1``, ``q = query_pos[t]``. A row can only show distances ``1 ≤ d ≤ D = q − n_sink``:

    count[i]    = #peaks with d ∈ [2^i, 2^{i+1})
    exposure[i] = Σ_rows #{d ∈ [2^i, 2^{i+1}) : d ≤ D_row}         (row, distance) pairs possible
    density[i]  = count[i] / exposure[i]                            peaks per possible position

Fit ``density ∝ d^(−α)`` by maximum likelihood of a discrete power law truncated per row:

    log L(α) = −α Σ_d n_d log d − Σ_D N_D log Z_α(D),   Z_α(D) = Σ_{d=1}^{D} d^(−α)

(``n_d`` peaks at distance ``d``, ``N_D`` peaks from rows with ``D``), with a bootstrap CI
over prompts (``resample="units"``: over trace units), compared by AIC with a truncated exponential ``∝ e^(−λd)`` and the
uniform ``1/D``. LogQuant's claim corresponds to ``α ≈ 1`` (equal mass per log2 bin).

Coverage: mean fraction of a row's non-sink mass that LogQuant's FP set (docs/concepts.md#logquant, window
``W``) holds, against a recency window of the same number of non-sink positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import xarray as xr

from .. import defaults
from ..errors import KvscopeError
from ..figures import styled
from ..params import param
from ..policies.logquant import fp_sets_per_step
from .kernels import block_stats, new_checks, peak_width, refuse_bad_rows, row_totals, step_blocks
from .mass import sink_shares, stored_rows
from .metric import Bootstrapped, Metric, ci_text, fmt, num, nums

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def fit_stats(data_term: float, N_D: np.ndarray, kind: str = "power") -> tuple[float, float]:
    """MLE of α (power law) or λ (exponential), truncated per row at its own ``D``, from
    sufficient statistics: ``data_term`` = Σ log d (power) or Σ d (exponential) over the
    peaks, ``N_D[D]`` = peaks from rows whose largest distance is ``D``. Returns
    (parameter, log-likelihood):

        log L(θ) = −θ · data_term − Σ_D N_D log Σ_{d=1}^{D} exp(−θ·x(d)),   x = log d or d
    """
    N_D = np.asarray(N_D, dtype=np.float64)
    if N_D.sum() == 0:
        return math.nan, math.nan
    last = int(np.flatnonzero(N_D).max()) + 1
    d = np.arange(1, last, dtype=np.float64)
    x = np.log(d) if kind == "power" else d
    n_rows = N_D[1:last]

    def neg_log_lik(theta: float) -> float:
        log_z = np.log(np.maximum(np.cumsum(np.exp(-theta * x)), 1e-300))  # log Z(D), D = 1..last−1
        return theta * data_term + np.dot(n_rows, log_z)

    from scipy.optimize import minimize_scalar  # here: `kvscope verify` and `info` import the package without it

    bounds = (-3.0, 8.0) if kind == "power" else (0.0, 5.0)
    with np.errstate(over="ignore"):
        res = minimize_scalar(neg_log_lik, bounds=bounds, method="bounded", options={"xatol": 1e-5})
    return float(res.x), float(-res.fun)


def fit(n_d: np.ndarray, N_D: np.ndarray, kind: str = "power") -> tuple[float, float]:
    """``fit_stats`` from a histogram ``n_d`` of peak distances (index = distance)."""
    d = np.arange(len(n_d), dtype=np.float64)
    x = np.log(np.maximum(d, 1)) if kind == "power" else d
    return fit_stats(float(np.dot(n_d, x)), N_D, kind)


def uniform_log_lik(N_D: np.ndarray) -> float:
    D = np.arange(N_D.shape[-1], dtype=np.float64)
    ok = N_D > 0
    return float(-np.dot(N_D[ok], np.log(D[ok])))


def block_rows(
    x: np.ndarray, q: np.ndarray, shares, fp_sets, n_sink: int, k: int, slack: float, block_steps: int, block_info=None
) -> np.ndarray:
    """Everything peaks needs from a task's rows, in one pass, summed over the steps of each
    stored block (``step_blocks``) per trace unit: ``[s, block,
    l, h, 2 + n_bins + 3]`` = Σ log d and Σ d over the top-``k``
    peaks (``d = q − p``), their count per log2 bin, and Σ of each row's share of non-sink
    mass on LogQuant's FP set, Σ of the share on a recency window of the same size, and the
    number of rows with non-sink mass (``kvscope.analysis.kernels.row_block_stats``).

    ``x [s, step, l, h, pos]`` rows as stored (NaN beyond query_pos), ``q [s, step, 1, 1, 1]``,
    ``shares [s, step, l, h, 1]`` their learned sink's (zeros without); ``fp_sets`` a
    ``LogQuantSets``. A few numbers per trace unit come back, so memory does not grow with the
    trace.
    """
    s_, n_step, n_l, n_h, n_pos = x.shape
    first_sample, t0 = block_info[0]["array-location"][0][0], block_info[0]["array-location"][1][0]
    n_bins = n_bins_for(n_pos)
    blocks = step_blocks(t0, n_step, block_steps)
    out = np.zeros((s_, len(blocks), n_l, n_h, peak_width(n_bins)))
    first_layer = block_info[0]["array-location"][2][0]
    for i in range(s_):
        fp = fp_sets.block(first_sample + i, t0, n_step)
        for j in range(n_l):
            # no windows out; windows of 8 are summed only for each row's total mass
            totals = row_totals(shares[i, :, j, :, 0])
            for b, (lo, hi) in enumerate(blocks):
                checks = new_checks(slack)
                block_stats(x[i, lo:hi, j], q[i, lo:hi, 0, 0, 0], fp[lo:hi], n_sink=n_sink, w=8, n_units=0, k=k,
                            n_bins=n_bins, windows=np.empty((hi - lo, n_h, 0)), stats=out[i, b, j], checks=checks,
                            totals=totals[lo:hi])  # fmt: skip
                where = (
                    f"attn rows of sample {first_sample + i}, steps {t0 + lo}–{t0 + hi - 1}, layer {first_layer + j}"
                )
                refuse_bad_rows(checks, where)
    return out


def n_bins_for(n_pos: int) -> int:
    """log2 bins ``[2^i, 2^{i+1})`` that cover distances up to ``n_pos``."""
    return max(1, int(math.floor(math.log2(max(2, n_pos)))) + 1)


def row_profile(qpos: np.ndarray, n_sink: int, k: int, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """What every trace unit of a sample shares: ``N_D [sample, D]`` peaks from rows whose
    largest distance is ``D`` (``min(k, D)`` per row: candidates depend on the position
    only) and ``exposure [sample, bin]`` (row, distance) pairs possible per log2 bin."""
    D = np.where(qpos >= 0, qpos - n_sink, 0)  # [sample, step]
    n_dist = int(max(1, D.max())) + 1
    N_D = np.zeros((qpos.shape[0], n_dist))
    exposure = np.zeros((qpos.shape[0], n_bins))
    lo = 2 ** np.arange(n_bins)
    for s in range(qpos.shape[0]):
        rows = D[s][D[s] >= 1]
        np.add.at(N_D[s], rows, np.minimum(k, rows))
        # distances 1..D of a row in bin [lo, 2·lo): max(0, min(D, 2·lo − 1) − lo + 1)
        exposure[s] = np.clip(np.minimum(rows[:, None], 2 * lo[None, :] - 1) - lo[None, :] + 1, 0, None).sum(0)
    return N_D, exposure


class LogQuantSets:
    """LogQuant FP positions of every step of a sample, built on first use (per process)."""

    def __init__(self, ds: xr.Dataset, W: int):
        self.prompt_len = np.asarray(ds["prompt_len"].values)
        self.n_steps = np.asarray(ds["n_steps"].values)
        self.W = W
        self._init_caches()

    def _init_caches(self) -> None:
        import threading

        self._cache: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def __call__(self, sample: int) -> np.ndarray:
        """``[step, 3W]`` FP positions of each valid step, −1 padded."""
        with self._lock:
            if sample not in self._cache:
                sets = fp_sets_per_step(int(self.prompt_len[sample]), int(self.n_steps[sample]), self.W)
                out = np.full((len(sets), 3 * self.W), -1, dtype=np.int64)
                for t, fp in enumerate(sets):
                    out[t, : len(fp)] = fp
                self._cache[sample] = out
            return self._cache[sample]

    def block(self, sample: int, t0: int, n: int) -> np.ndarray:
        """``[n, 3W]`` FP positions of steps ``t0 … t0+n−1`` (−1 rows past the sample's steps)."""
        sets = self(sample)[t0 : t0 + n]
        if len(sets) == n:
            return sets
        out = np.full((n, sets.shape[1]), -1, dtype=np.int64)
        out[: len(sets)] = sets
        return out

    def __getstate__(self):  # shipped to dask workers without the caches
        return {"prompt_len": self.prompt_len, "n_steps": self.n_steps, "W": self.W}

    def __setstate__(self, state):
        self.prompt_len, self.n_steps, self.W = state["prompt_len"], state["n_steps"], state["W"]
        self._init_caches()


@dataclass(kw_only=True)
class Peaks(Bootstrapped, Metric):
    """Exposure-normalized log2 histogram of peak distances, α fit with CI, AIC comparison
    and LogQuant coverage (module docstring)."""

    name: ClassVar[str] = "peaks"
    title: ClassVar[str] = "log2 peak density, α fit, AIC, LogQuant coverage"

    k: int = param(defaults.PEAKS_TOP_K, low=1, flag="--top-k", help="peaks per row")
    n_sink: int | None = param(None, low=0, flag="--sinks", help="sink positions", none="the trace's")
    logquant_window: int = param(defaults.LOGQUANT_W, low=1, help="LogQuant W for coverage")
    n_boot: int = param(defaults.N_BOOT_PEAKS, low=1, flag="--bootstrap", help="bootstrap resamples of the α fit")

    def sinks(self, ds: xr.Dataset) -> int:
        """The sinks left out: ``n_sink``, or the trace's.

        Args:
            ds: The trace.
        """
        return self.n_sink if self.n_sink is not None else ds.kvscope.n_sink

    def statistics(self, ds: xr.Dataset, compute: bool = True) -> tuple:
        """One streaming pass over the rows: ``(rows, per_block)`` with ``per_block [sample,
        step block, layer, H, 2 + n_bins + 3]`` the sums of ``block_rows``; ``__call__`` adds
        them up over step blocks.

        Args:
            ds: The trace.
            compute: Return numpy (False: a dask array, for one read shared with other metrics).
        """
        import dask.array as dsa  # here: `kvscope verify` and `info` import the package without dask

        self.check_scope(ds)
        ds.kvscope.require_steps()
        if self.sinks(ds) >= ds.sizes["pos"] - 1:
            raise KvscopeError(f"peaks: --sinks {self.sinks(ds)} leaves no key in {ds.sizes['pos']} positions")
        a = stored_rows(ds, self.layers, self.heads)
        arr = a.data
        qpos = ds.kvscope.query_pos  # [sample, step]
        c = arr.chunks
        q_arr = dsa.from_array(qpos[:, :, None, None, None], chunks=(c[0], c[1], 1, 1, 1))
        width = peak_width(n_bins_for(arr.shape[-1]))
        shares = sink_shares(ds, arr, self.layers, self.heads)
        B = ds.kvscope.block_steps
        starts = np.cumsum((0,) + c[1])
        n_blocks = tuple(len(step_blocks(int(t0), n, B)) for t0, n in zip(starts, c[1]))
        per_block = dsa.map_blocks(
            block_rows,
            arr,
            q_arr,
            shares,
            LogQuantSets(ds, self.logquant_window),
            self.sinks(ds),
            self.k,
            ds.kvscope.rows.slack,
            B,
            dtype=np.float64,
            drop_axis=[4],
            new_axis=[4],
            chunks=(c[0], n_blocks, c[2], c[3], (width,)),
        )  # [sample, step block, layer, H, width]: independent leaves, summed on the driver
        return a, (per_block.compute() if compute else per_block)

    def __call__(self, ds: xr.Dataset, precomputed=None) -> xr.Dataset:
        a, per_block = precomputed or self.statistics(ds)
        n_sink = self.sinks(ds)
        n_bins = n_bins_for(a.sizes["pos"])
        per_unit = np.asarray(per_block).sum(1)  # over step blocks -> [sample, layer, H, width]
        sum_log, sum_d, bins = per_unit[..., 0], per_unit[..., 1], per_unit[..., 2 : 2 + n_bins]
        coverage = per_unit[..., 2 + n_bins :]  # [sample, layer, H, 3]
        qpos = ds.kvscope.query_pos
        N_D_sample, exposure_sample = row_profile(qpos, n_sink, self.k, n_bins)
        S_n, L, H = sum_log.shape

        def fitted(weights: np.ndarray, kind: str = "power"):  # weights [sample, layer, H] per trace unit
            term = sum_log if kind == "power" else sum_d
            return fit_stats(float((weights * term).sum()), weights.sum((1, 2)) @ N_D_sample, kind)

        ones = np.ones((S_n, L, H))
        alpha, ll_power = fitted(ones)
        lam, ll_exp = fitted(ones, "exponential")
        ll_uniform = uniform_log_lik(ones.sum((1, 2)) @ N_D_sample)
        counts = bins.sum((0, 1, 2)).astype(np.float64)
        exposure = L * H * exposure_sample.sum(0)
        with np.errstate(invalid="ignore", divide="ignore"):
            density = np.where(exposure > 0, counts / exposure, np.nan)
        lo, hi = self._alpha_interval(fitted, (S_n, L, H)) if np.isfinite(alpha) else (math.nan, math.nan)
        per_layer_alpha = [fitted(np.where(np.arange(L)[None, :, None] == li, 1.0, 0.0) * ones)[0] for li in range(L)]
        cov = coverage.sum((0, 2))  # [layer, 3]
        with np.errstate(invalid="ignore", divide="ignore"):
            cov_lq, cov_rc = cov[:, 0] / cov[:, 2], cov[:, 1] / cov[:, 2]
        aic = {"power": 2 - 2 * ll_power, "exponential": 2 - 2 * ll_exp, "uniform": -2 * ll_uniform}
        best = min(aic, key=lambda key: aic[key] if np.isfinite(aic[key]) else np.inf)
        n_rows = int(L * H * ((qpos >= 0) & (qpos - n_sink >= 1)).sum())
        return xr.Dataset(
            {
                "count": ("bin", counts),
                "exposure": ("bin", exposure),
                "density": ("bin", density),
                "alpha": alpha,
                "alpha_low": float(lo),
                "alpha_high": float(hi),
                "lambda": lam,
                "aic": ("model", [aic["power"], aic["exponential"], aic["uniform"]]),
                "log_lik": ("model", [ll_power, ll_exp, ll_uniform]),
                "alpha_layer": ("layer", np.asarray(per_layer_alpha)),
                "coverage_logquant": ("layer", cov_lq),
                "coverage_recency": ("layer", cov_rc),
                "n_peaks": int(counts.sum()),
                "n_rows": n_rows,
            },
            coords={
                "bin": np.arange(n_bins),
                "bin_low": ("bin", 2 ** np.arange(n_bins)),
                "model": ["power", "exponential", "uniform"],
                "layer": a["layer"].values,
            },
            attrs={
                "metric": "peaks",
                "k": self.k,
                "n_sink": n_sink,
                "logquant_W": self.logquant_window,
                "best_model": best,
                "heads_dim": ds.kvscope.hdim,
                "n_boot": self.n_boot,
                "resample": self.resample,
                "ci": self.ci_note(S_n, S_n * L * H),
            },
        )

    def _alpha_interval(self, fitted, shape: tuple[int, int, int]) -> tuple[float, float]:
        """Percentile interval of α refitted on bootstrap weights: whole samples (every layer and
        head of a drawn prompt) or, with ``resample="units"``, trace units."""
        S_n, L, H = shape
        if self.resample == "samples" and S_n < 2:
            return math.nan, math.nan
        rng = np.random.default_rng(self.seed)
        n = S_n if self.resample == "samples" else S_n * L * H
        boot, fits = [], {}  # a draw repeated (few samples give few distinct ones) is fitted once
        for _ in range(self.n_boot):
            counts = np.bincount(rng.integers(0, n, n), minlength=n)
            key = counts.tobytes()
            if key not in fits:
                weights = (
                    np.broadcast_to(counts[:, None, None], shape)
                    if self.resample == "samples"
                    else counts.reshape(shape)
                )
                fits[key] = fitted(weights)[0]
            boot.append(fits[key])
        lo, hi = np.quantile(boot, [0.025, 0.975])
        return float(lo), float(hi)

    def summary(self, r: xr.Dataset) -> dict:
        return {
            **self.base_summary(r),
            "alpha": num(r["alpha"]),
            "ci95": [num(r["alpha_low"]), num(r["alpha_high"])],
            "lambda": num(r["lambda"]),
            "aic": dict(zip(r["model"].values.tolist(), nums(r["aic"]))),
            "n_peaks": int(r["n_peaks"]),
            "n_rows": int(r["n_rows"]),
            "log2_bins": [
                {"from": int(lo), "count": int(c), "exposure": int(e), "density": num(d)}
                for lo, c, e, d in zip(
                    r["bin_low"].values, r["count"].values, r["exposure"].values, r["density"].values
                )
            ],
            "alpha_per_layer": nums(r["alpha_layer"]),
            "coverage_logquant_per_layer": nums(r["coverage_logquant"]),
            "coverage_recency_per_layer": nums(r["coverage_recency"]),
            "coverage_logquant": num(np.nanmean(r["coverage_logquant"].values)),
            "coverage_recency": num(np.nanmean(r["coverage_recency"].values)),
        }

    def table(self, s: dict) -> list[tuple[str, str]]:
        rows = [
            (f"α (power law, top-{s['k']} peaks)", fmt(s["alpha"]) + ci_text(*s["ci95"])),
            ("95% CI", s["ci"]),
            ("best model by AIC", s["best_model"]),
            (
                "AIC power / exponential / uniform",
                " / ".join(fmt(s["aic"][m], ".1f") for m in ("power", "exponential", "uniform")),
            ),
            (
                f"coverage LogQuant FP set (W={s['logquant_W']}) vs recency",
                f"{fmt(s['coverage_logquant'])} vs {fmt(s['coverage_recency'])}",
            ),
        ]
        return rows + [(f"density d∈[{b['from']}, {2 * b['from']})", fmt(b["density"], ".4g")) for b in s["log2_bins"]]

    @styled
    def plot(self, result: xr.Dataset, ax: Axes | None = None) -> Figure:
        """Log-log exposure-normalized peak density with the fitted power law and alternatives.

        Args:
            result: What the metric returned.
            ax: Draw into this axes (default: a new figure).
        """
        from ..figures import axes

        fig, ax = axes(ax)
        lo = result["bin_low"].values.astype(float)
        centers = lo * np.sqrt(2)
        dens = result["density"].values
        ok = np.isfinite(dens) & (dens > 0)
        ax.loglog(centers[ok], dens[ok], "o", label="peak density per position")
        alpha = float(result["alpha"])
        if np.isfinite(alpha) and ok.any():
            ref = centers[ok][0]
            scale = dens[ok][0] / ref ** (-alpha)
            band = ci_text(float(result["alpha_low"]), float(result["alpha_high"]))
            ax.loglog(centers[ok], scale * centers[ok] ** (-alpha), "-", label=f"power law α={alpha:.2f}{band}")
            lam = float(result["lambda"])
            if np.isfinite(lam):
                e_scale = dens[ok][0] / np.exp(-lam * ref)
                ax.loglog(centers[ok], e_scale * np.exp(-lam * centers[ok]), ":", label=f"exponential λ={lam:.3f}")
            ax.loglog(centers[ok], np.full(ok.sum(), np.nanmean(dens[ok])), "--", label="uniform")
        ax.set_xlabel("distance to the query d (log2 bins)")
        ax.set_ylabel("peaks per possible position")
        ax.set_title(f"Attention peaks (top-{result.attrs['k']}), best by AIC: {result.attrs['best_model']}")
        ax.legend()
        return fig


def peaks(ds: xr.Dataset, *, precomputed: tuple | None = None, **params: Any) -> xr.Dataset:
    """``Peaks(**params)(ds)`` — see [`Peaks`][kvscope.analysis.Peaks].

    Args:
        ds: The trace.
        precomputed: What [`Peaks.statistics`][kvscope.analysis.Peaks.statistics] returned
            (``study`` shares one read).
        **params: Fields of [`Peaks`][kvscope.analysis.Peaks] by name.
    """
    return Peaks(**params)(ds, precomputed=precomputed)
