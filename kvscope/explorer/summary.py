"""The explorer's side views: the numbers ``kvscope analyze`` prints, as plain arrays.

One streaming pass of ``kvscope.analysis.study`` (FMM, churn, LIR, peaks) plus
concentration, reduced to what the views draw:

    layers      [layer]     FMM, churn, LIR, LogQuant coverage, mass in the top 20 % windows
    fmm_curve   [horizon]   FMM(H) with its bootstrap interval
    peaks       [bin]       exposure-normalized log2 peak density and the fitted power law
    top_share   [top_frac]  mass held by the top p of the windows (mean over events and units)
"""

from __future__ import annotations

import numpy as np
import xarray as xr

TOP = 0.2  # the per-layer concentration line: mass held by the top 20 % of the windows


def summaries(ds: xr.Dataset) -> dict[str, dict[str, list]]:
    """Columns for the side views (each a dict of equal-length lists)."""
    from ..analysis import churn, concentration, fmm, lir, study

    window = ds.kvscope.resolution == "window"  # study and peaks read token rows: each metric alone
    r = {"fmm": fmm(ds), "churn": churn(ds), "lir": lir(ds)} if window else study(ds)
    conc = concentration(ds)
    fmm_r, churn_r, lir_r = r["fmm"], r["churn"], r["lir"]
    peaks = r.get("peaks")
    layers = fmm_r["layer"].values
    nan = [float("nan")] * len(layers)
    return {
        "layers": {
            "layer": list(range(len(layers))),  # the stored layer (what the layer choice selects)
            "label": [int(x) for x in layers],  # the model's index (a hybrid's attention layers: 3, 7, …)
            "fmm": _floats(fmm_r["fmm_layer"]),
            "churn": _floats(churn_r["churn_layer"]),
            "lir": _floats(lir_r["lir_layer"]),
            "coverage": nan if peaks is None else _floats(peaks["coverage_logquant"]),
            "top_share": _floats(conc["top_share_layer"].sel(top_frac=TOP)),
        },
        "fmm_curve": {
            "horizon": [int(h) for h in fmm_r["horizon"].values],
            "fmm": _floats(fmm_r["curve"]),
            "low": _floats(fmm_r["curve_low"]),
            "high": _floats(fmm_r["curve_high"]),
        },
        "peaks": {"distance": [], "density": [], "fit": []} if peaks is None else _peak_columns(peaks),
        "top_share": {
            "top_frac": [float(p) for p in conc["top_frac"].values],
            "share": _floats(conc["top_share_mean"]),
        },
        "numbers": {
            "name": ["FMM", "churn", "LIR", "α (peaks)", "LogQuant coverage"],
            "value": [
                float(fmm_r["mean"]),
                float(churn_r["mean"]),
                float(lir_r["lir"]),
                float("nan") if peaks is None else float(peaks["alpha"]),
                float("nan") if peaks is None else float(np.nanmean(peaks["coverage_logquant"].values)),
            ],
        },
    }


def _peak_columns(peaks: xr.Dataset) -> dict[str, list]:
    """Density per log2 bin at the bin's geometric centre ``d = low·√2`` and the power law
    ``c·d^(−α)`` through the first bin (as ``Peaks.plot`` draws it)."""
    centers = peaks["bin_low"].values.astype(float) * np.sqrt(2)
    dens = peaks["density"].values.astype(float)
    ok = np.isfinite(dens) & (dens > 0)
    alpha = float(peaks["alpha"])
    fit = np.full(len(dens), np.nan)
    if ok.any() and np.isfinite(alpha):
        fit = dens[ok][0] * (centers / centers[ok][0]) ** (-alpha)
    return {"distance": list(centers[ok]), "density": list(dens[ok]), "fit": list(fit[ok])}


def _floats(da: xr.DataArray) -> list[float]:
    return [float(x) for x in np.asarray(da.values, dtype=float).ravel()]
