"""Analyses over traces ([Concepts → Analyses](concepts.md#analyses)): one module per metric, each a ``@dataclass`` whose fields
are its parameters, kept in a registry like the policies (``kvscope.analysis.metric``).

    available()                   {name: class} of every registered metric
    make("fmm", horizon=16)       a metric object (parameters checked on construction)
    FMM(horizon=16)(ds)           → xarray.Dataset with named dims; fmm(ds, horizon=16) alike
    register(MyMetric)            add a metric: kvscope analyze and its JSON pick it up
    study(ds)                     FMM + churn + LIR + peaks over one read of the trace

    fmm            Future Missed Mass (+ FMM(H) curve, tier-resolved mass)
    lir            Global LIR, P01/P10
    churn          selection churn between consecutive events
    peaks          log-distributed attention peaks, α fit, LogQuant coverage
    concentration  mass held by the top windows, windows needed for a mass level
    drift          heatmap data, rank trajectories, churn over time
"""

from __future__ import annotations

from ..storage import dataset  # noqa: F401  (registers ds.kvscope: a Dataset opened without open_trace has it too)
from ..windows import Units
from .churn import Churn, churn
from .common import Prepared, bootstrap_ratio, event_steps, selection_from_tiers, top_fraction_selection
from .concentration import Concentration, concentration
from .drift import Drift, drift
from .fmm import FMM, fmm
from .lir import LIR, lir
from .mass import cumulative_scores, existence, prefill_unit_mass, unit_mass
from .metric import Metric, UnitMetric
from .peaks import Peaks, peaks
from .recompute import rows_from_qk, with_recomputed_rows
from .registry import METRICS, available, make, make_all, register
from .study import study

__all__ = [
    "FMM",
    "LIR",
    "METRICS",
    "Churn",
    "Concentration",
    "Drift",
    "Metric",
    "Peaks",
    "Prepared",
    "UnitMetric",
    "Units",
    "available",
    "bootstrap_ratio",
    "churn",
    "concentration",
    "cumulative_scores",
    "drift",
    "event_steps",
    "existence",
    "fmm",
    "lir",
    "make",
    "make_all",
    "peaks",
    "prefill_unit_mass",
    "register",
    "rows_from_qk",
    "selection_from_tiers",
    "study",
    "top_fraction_selection",
    "unit_mass",
    "with_recomputed_rows",
]
