"""Selection churn (SPEC §4.2).

Jaccard distance between consecutive selections of candidate units (sinks and the
protected local tail are not candidates)::

    churn(e) = 1 − |A_e ∩ A_{e+1}| / |A_e ∪ A_{e+1}|,   0 when both are empty

with ``A_e = {j : sel[e, j] = 1}``. Shapes: ``sel [..., event, unit]`` → ``[..., event−1]``.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from .common import SELECTED, Prepared, UnitData, UnitPlan, bootstrap_ratio, check_fraction, make_units


def churn_kernel(sel: np.ndarray, n_valid_events: np.ndarray | None = None) -> np.ndarray:
    """``[..., event−1]`` churn between events e and e+1 (NaN past ``n_valid_events``)."""
    a = sel[..., :-1, :] == SELECTED
    b = sel[..., 1:, :] == SELECTED
    inter = (a & b).sum(-1)
    union = (a | b).sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(union > 0, 1.0 - inter / np.maximum(union, 1), 0.0)
    if n_valid_events is not None:
        pair = np.arange(out.shape[-1])
        out = np.where(pair + 1 < np.asarray(n_valid_events)[..., None], out, np.nan)
    return out


def valid_events(steps: np.ndarray, n_steps: np.ndarray) -> np.ndarray:
    """``[sample]`` number of events that fall inside each sample's valid steps."""
    return (steps[None, :] < np.asarray(n_steps)[:, None]).sum(1)


def churn(
    ds: xr.Dataset,
    *,
    granularity: str = "window",
    w: int | None = None,
    n_sink: int | None = None,
    every: int | None = None,
    top_frac: float = 0.2,
    local: int = 64,
    selection: xr.DataArray | None = None,
    include_prefill: bool = True,
    layers=None,
    heads=None,
    n_boot: int = 1000,
    seed: int = 0,
    prep: Prepared | None = None,
    compute: bool = True,
):
    """Churn of a selection (default: the oracle-by-history) between consecutive events.

    Returns ``churn [sample, event, layer, H]`` (event = the later of the pair),
    ``churn_over_time [event]``, ``churn_layer [layer]`` and ``mean``/``ci_low``/``ci_high``.
    """
    check_fraction("--top-frac", top_frac)
    prep = prep or Prepared(ds, make_units(ds, granularity, w, n_sink), layers, heads, include_prefill)
    units = prep.units
    every = every or units.w
    steps = np.asarray(selection["event_step"].values) if selection is not None else prep.events(every)

    def per_unit(u: UnitData) -> np.ndarray:
        sel, st = u.selection_or_history(every, top_frac, local)
        return churn_kernel(sel, u.valid_events(st))

    width_ = max(0, len(steps) - 1)

    def finish(flat: np.ndarray) -> xr.Dataset:
        values = np.moveaxis(flat, 3, 1)  # [sample, event-1, layer, H]
        finite = np.isfinite(values)
        est, lo, hi = bootstrap_ratio(np.where(finite, values, 0).sum(1), finite.sum(1), n_boot=n_boot, seed=seed)
        with np.errstate(invalid="ignore"):
            over_time = np.nanmean(np.moveaxis(values, 1, 0).reshape(values.shape[1], -1), axis=1)
            per_layer = np.nanmean(np.moveaxis(values, 2, 0).reshape(values.shape[2], -1), axis=1)
        return xr.Dataset(
            {
                "churn": (("sample", "event", "layer", prep.hdim), values),
                "churn_over_time": ("event", over_time),
                "churn_layer": ("layer", per_layer),
                "mean": est,
                "ci_low": lo,
                "ci_high": hi,
            },
            coords={
                "sample": prep.m["sample"].values,
                "event": np.arange(1, len(steps)),
                "event_step": ("event", steps[1:]),
                "layer": prep.m["layer"].values,
                prep.hdim: prep.m[prep.hdim].values,
            },
            attrs={"metric": "churn", "granularity": units.kind, "w": units.w, "top_frac": top_frac, "local": local},
        )

    plan = UnitPlan(per_unit, width_, finish, selection)
    return plan.run(prep) if compute else plan
