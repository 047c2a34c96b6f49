"""Analyses over traces (SPEC §4): one module per metric, each a function over xarray
objects that returns an ``xarray.Dataset`` with named dims, streaming over dask chunks.

    fmm(ds, horizon=32)           Future Missed Mass (+ FMM(H) curve, tier-resolved mass)
    churn(ds)                     selection churn between consecutive events
    lir(ds, m=4, h_lir=8)         Global LIR, P01/P10
    peaks(ds, k=8)                log-distributed attention peaks, α fit, LogQuant coverage
    concentration(ds)             mass held by the top windows, windows needed for a mass level
    drift(ds)                     heatmap data, rank trajectories, churn over time
"""

from .churn import churn
from .common import Prepared, bootstrap_ratio, event_steps, make_units, selection_from_tiers, top_fraction_selection
from .concentration import concentration
from .drift import drift
from .fmm import fmm
from .lir import lir
from .mass import Units, cumulative_scores, existence, prefill_unit_mass, unit_mass
from .peaks import peaks
from .recompute import rows_from_qk, with_recomputed_rows
from .study import study

ANALYSES = {
    "fmm": fmm,
    "lir": lir,
    "churn": churn,
    "peaks": peaks,
    "concentration": concentration,
    "drift": drift,
}

__all__ = [
    "ANALYSES",
    "Prepared",
    "Units",
    "bootstrap_ratio",
    "churn",
    "concentration",
    "cumulative_scores",
    "drift",
    "event_steps",
    "existence",
    "fmm",
    "lir",
    "make_units",
    "peaks",
    "prefill_unit_mass",
    "rows_from_qk",
    "with_recomputed_rows",
    "selection_from_tiers",
    "study",
    "top_fraction_selection",
    "unit_mass",
]
