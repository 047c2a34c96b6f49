"""Several analyses of one trace over a single streaming read.

FMM, churn and LIR of the history oracle share one ``Prepared`` and their per-trace-unit
tasks and the peaks statistics go into one ``dask.compute``: the chunk reads are shared
task keys, so every chunk of ``attn`` is read and decompressed once.
"""

from __future__ import annotations

import dask
import numpy as np
import xarray as xr

from .churn import churn
from .common import Prepared, make_units
from .fmm import fmm
from .lir import lir
from .peaks import peak_statistics, peaks


def study(
    ds: xr.Dataset,
    *,
    w: int | None = None,
    n_sink: int | None = None,
    horizon: int = 32,
    every: int | None = None,
    top_frac: float = 0.2,
    local: int = 64,
    m: int = 4,
    h_lir: int | None = 8,
    k: int = 8,
    logquant_window: int = 32,
    layers=None,
    heads=None,
    n_boot: int = 1000,
    seed: int = 0,
) -> dict[str, xr.Dataset]:
    """``{"fmm", "churn", "lir", "peaks"}`` results, computed from one read of the trace."""
    prep = Prepared(ds, make_units(ds, "window", w, n_sink), layers, heads)
    shared = dict(every=every, top_frac=top_frac, local=local, n_boot=n_boot, seed=seed, prep=prep, compute=False)
    plans = {
        "fmm": fmm(ds, horizon=horizon, **shared),
        "churn": churn(ds, **shared),
        "lir": lir(ds, m=m, h_lir=h_lir, **shared),
    }
    bounds = np.cumsum([0] + [p.width for p in plans.values()])

    def all_metrics(u):  # one task per trace unit: the history selection is computed once
        return np.concatenate([p.per_unit(u) for p in plans.values()])

    lazy = prep.map_units(all_metrics, int(bounds[-1]), compute=False)
    a, lazy_rows = peak_statistics(
        ds, k=k, n_sink=n_sink, layers=layers, heads=heads, logquant_window=logquant_window, compute=False
    )
    flat, per_unit = dask.compute(lazy, lazy_rows)
    results = {name: p.finish(flat[..., bounds[i] : bounds[i + 1]]) for i, (name, p) in enumerate(plans.items())}
    results["peaks"] = peaks(
        ds,
        k=k,
        n_sink=n_sink,
        logquant_window=logquant_window,
        n_boot=min(n_boot, 200),
        seed=seed,
        precomputed=(a, per_unit),
    )
    return results
