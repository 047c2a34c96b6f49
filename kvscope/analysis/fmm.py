"""Future Missed Mass (SPEC §4.1).

For a selection decided at event ``e`` at step ``t`` with horizon ``H``::

    FMM(e) = Σ_{t'=t+1}^{t+H} Σ_j m[t', j]·[j existed at t ∧ j not selected at e]
             ─────────────────────────────────────────────────────────────────────
             Σ_{t'=t+1}^{t+H} Σ_j m[t', j]·[j existed at t]

Only units that existed at the decision count. Events without ``H`` future steps are
right-censored (NaN), never scored on a shorter horizon. With ``S[t] = Σ_{t'≤t} m[t']``
the future mass of a unit is ``S[t+H] − S[t]``.

Shapes: ``future``, ``exists``, ``missed`` ``[..., event, unit]``; results ``[..., event]``.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from ..errors import KvscopeError
from .common import (
    NOT_SELECTED,
    TIER_EVICTED,
    TIER_FP,
    TIER_Q,
    Prepared,
    bootstrap_ratio,
    check_fraction,
    make_units,
    selection_from_tiers,
)


def fmm_kernel(future: np.ndarray, exists: np.ndarray, missed: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """``[..., event]`` FMM from future unit mass ``[..., event, unit]``.

    ``valid [..., event]``: False where the horizon runs past the trace (censored → NaN).
    Events whose existing units receive no future mass are NaN too.
    """
    den = np.where(exists, future, 0.0).sum(-1)
    num = np.where(exists & missed, future, 0.0).sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = num / den
    return np.where(valid & (den > 0), out, np.nan)


def tier_fractions(future: np.ndarray, exists: np.ndarray, tiers: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """``[..., event, 3]`` fractions of future mass on existing units in FP, Q and EVICTED."""
    den = np.where(exists, future, 0.0).sum(-1)
    parts = [np.where(exists & (tiers == tier), future, 0.0).sum(-1) for tier in (TIER_FP, TIER_Q, TIER_EVICTED)]
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.stack(parts, -1) / den[..., None]
    return np.where((valid & (den > 0))[..., None], out, np.nan)


def default_horizons(horizon: int) -> list[int]:
    """1, 2, 4, … up to and including ``horizon``."""
    hs, h = [], 1
    while h < horizon:
        hs.append(h)
        h *= 2
    return hs + [horizon]


def _future(prep: Prepared, steps: np.ndarray, horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """Future unit mass over (t, t+H] ``[sample, event, layer, H, unit]`` and validity ``[sample, event]``."""
    S = prep.m.sizes["step"]
    ends = np.minimum(steps + horizon, S - 1)
    cum = prep.cum_at(np.concatenate([steps, ends]))
    future = np.stack([cum[int(e)] - cum[int(s)] for s, e in zip(steps, ends)], axis=1)
    valid = (steps[None, :] + horizon) <= (prep.n_steps[:, None] - 1)
    return future, valid


def fmm(
    ds: xr.Dataset,
    *,
    granularity: str = "window",
    w: int | None = None,
    n_sink: int | None = None,
    horizon: int = 32,
    horizons: list[int] | None = None,
    every: int | None = None,
    top_frac: float = 0.2,
    local: int = 64,
    selection: xr.DataArray | None = None,
    tiers: xr.DataArray | None = None,
    include_prefill: bool = True,
    layers=None,
    heads=None,
    n_boot: int = 1000,
    seed: int = 0,
) -> xr.Dataset:
    """Future Missed Mass of a selection (default: the oracle-by-history, top-``ρ``
    candidates by cumulative score, newest ``local`` tokens protected).

    Returns a Dataset with
    ``fmm [sample, event, layer, H]`` at ``horizon`` (NaN = censored),
    ``fmm_layer [layer]`` (mean over events and other units),
    ``curve [horizon]`` with ``curve_low``/``curve_high`` (bootstrap 95% CI over trace units),
    scalars ``mean``, ``ci_low``, ``ci_high``, ``n_events`` and ``n_censored``, and — for a
    tiered selection — ``tier_mass [sample, event, layer, H, tier]`` and ``tier_mean [tier]``.
    """
    if horizon < 1:
        raise KvscopeError(f"--horizon must be ≥ 1 (got {horizon})")
    check_fraction("--top-frac", top_frac)
    units = make_units(ds, granularity, w, n_sink)
    prep = Prepared(ds, units, layers, heads, include_prefill)
    source = "history-oracle"
    if tiers is not None:
        selection = selection_from_tiers(tiers)
    if selection is not None:
        source = selection.attrs.get("policy", "given")
    else:
        selection = prep.history_selection(every or units.w, top_frac, local)
    steps = np.asarray(selection["event_step"].values)
    sel = np.asarray(selection.transpose("sample", "event", "layer", prep.hdim, units.dim).values)
    exists = np.broadcast_to(prep.exists_at(steps), sel.shape)
    missed = sel == NOT_SELECTED

    curve_h = sorted(set(horizons or default_horizons(horizon)) | {horizon})
    results, curve = {}, {"mean": [], "low": [], "high": []}
    for h in curve_h:
        future, valid = _future(prep, steps, h)
        values = fmm_kernel(future, exists, missed, valid[:, :, None, None])  # [sample, event, layer, H]
        results[h] = (values, future, valid)
        est, lo, hi = _summary(values, n_boot, seed)
        curve["mean"].append(est)
        curve["low"].append(lo)
        curve["high"].append(hi)

    values, future, valid = results[horizon]
    coords = {
        "sample": prep.m["sample"].values,
        "event": selection["event"].values,
        "event_step": ("event", steps),
        "layer": prep.m["layer"].values,
        prep.hdim: prep.m[prep.hdim].values,
    }
    dims = ("sample", "event", "layer", prep.hdim)
    est, lo, hi = _summary(values, n_boot, seed)
    out = xr.Dataset(
        {
            "fmm": (dims, values),
            "fmm_layer": ("layer", np.nanmean(np.moveaxis(values, 2, 0).reshape(values.shape[2], -1), axis=1)
                          if np.isfinite(values).any() else np.full(values.shape[2], np.nan)),
            "curve": ("horizon", np.asarray(curve["mean"])),
            "curve_low": ("horizon", np.asarray(curve["low"])),
            "curve_high": ("horizon", np.asarray(curve["high"])),
            "mean": est,
            "ci_low": lo,
            "ci_high": hi,
            "n_events": int(np.isfinite(values).sum()),
            "n_censored": int((~np.broadcast_to(valid[:, :, None, None], values.shape)).sum()),
        },
        coords={**coords, "horizon": curve_h},
        attrs={
            "metric": "fmm",
            "granularity": units.kind,
            "w": units.w,
            "n_sink": units.n_sink,
            "H": horizon,
            "top_frac": top_frac,
            "local": local,
            "selection": source,
        },
    )
    if tiers is not None:
        t = np.asarray(tiers.transpose("sample", "event", "layer", prep.hdim, units.dim).values)
        fr = tier_fractions(future, exists, t, valid[:, :, None, None])  # [sample, event, layer, H, 3]
        out["tier_mass"] = (dims + ("tier",), fr)
        out = out.assign_coords(tier=["FP", "Q", "EVICTED"])
        out["tier_mean"] = ("tier", np.nanmean(fr.reshape(-1, 3), axis=0))
    return out


def _summary(values: np.ndarray, n_boot: int, seed: int):
    """Mean over (event, unit) pairs with a bootstrap CI over trace units."""
    finite = np.isfinite(values)
    per_unit_sum = np.where(finite, values, 0.0).sum(axis=1)  # [sample, layer, H]
    per_unit_n = finite.sum(axis=1)
    return bootstrap_ratio(per_unit_sum, per_unit_n, n_boot=n_boot, seed=seed)
