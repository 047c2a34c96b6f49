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
    UnitData,
    UnitPlan,
    bootstrap_ratio,
    check_fraction,
    make_units,
)
from .kernels import fmm_curve


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
    prep: Prepared | None = None,
    compute: bool = True,
):
    """Future Missed Mass of a selection (default: the oracle-by-history, top-``ρ``
    candidates by cumulative score, newest ``local`` tokens protected).

    Returns a Dataset with
    ``fmm [sample, event, layer, H]`` at ``horizon`` (NaN = censored),
    ``fmm_layer [layer]`` (mean over events and other units),
    ``curve [horizon]`` with ``curve_low``/``curve_high`` (bootstrap 95% CI over trace units),
    scalars ``mean``, ``ci_low``, ``ci_high``, ``n_events`` and ``n_censored``, and — for a
    tiered selection ``tiers`` (codes −1 none, 0 EVICTED, 1 Q, 2 FP) — ``tier_mass
    [sample, event, layer, H, tier]`` and ``tier_mean [tier]``.

    Streams over trace units; ``compute=False`` returns ``(finish, lazy)`` where
    ``finish(values)`` builds the Dataset from the computed ``lazy`` array (used by
    :func:`kvscope.analysis.study` to share one read among analyses).
    """
    if horizon < 1:
        raise KvscopeError(f"--horizon must be ≥ 1 (got {horizon})")
    check_fraction("--top-frac", top_frac)
    prep = prep or Prepared(ds, make_units(ds, granularity, w, n_sink), layers, heads, include_prefill)
    units = prep.units
    curve_h = sorted(set(horizons or default_horizons(horizon)) | {horizon})
    every = every or units.w
    given = tiers if tiers is not None else selection
    source = given.attrs.get("policy", "given") if given is not None else "history-oracle"
    steps = np.asarray(given["event_step"].values) if given is not None else prep.events(every)
    n_ev, n_h = len(steps), len(curve_h)
    horizons_ = np.asarray(curve_h, dtype=np.int64)
    with_tiers = tiers is not None

    def per_unit(u: UnitData) -> np.ndarray:
        sel, st = u.selection_or_history(every, top_frac, local)  # [H, event, unit]
        tier = sel if with_tiers else None
        if with_tiers:
            sel = np.where(tier < 0, -1, np.where(tier == TIER_EVICTED, NOT_SELECTED, 1))
        exists = u.exists(st)  # [event, unit]
        missed = (sel == NOT_SELECTED).reshape((-1,) + sel.shape[-2:])  # [H, event, unit]
        curve = np.empty(u.lead + (n_h, len(st)))  # [H, horizon, event]
        cum = u.cum.reshape((-1,) + u.cum.shape[-2:])
        last = min(u.n_steps, cum.shape[-2])  # steps that exist
        fmm_curve(cum, np.asarray(st, np.int64), horizons_, last, exists, missed, curve.reshape(-1, n_h, len(st)))
        out = [u.flatten(curve)]
        if with_tiers:
            future = u.cum[..., np.minimum(st + horizon, u.m.shape[-2] - 1), :] - u.cum[..., st, :]
            out.append(u.flatten(tier_fractions(future, exists, tier, st + horizon <= u.n_steps - 1)))
        return np.concatenate(out, axis=-1)

    width = n_h * n_ev + (3 * n_ev if with_tiers else 0)

    def finish(flat: np.ndarray) -> xr.Dataset:
        return _fmm_dataset(
            prep,
            flat,
            steps,
            curve_h,
            horizon,
            with_tiers,
            n_boot,
            seed,
            {
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

    plan = UnitPlan(per_unit, width, finish, given)
    return plan.run(prep) if compute else plan


def _fmm_dataset(prep, flat, steps, curve_h, horizon, with_tiers, n_boot, seed, attrs) -> xr.Dataset:
    n_ev, n_h = len(steps), len(curve_h)
    per_h = flat[..., : n_h * n_ev].reshape(*flat.shape[:3], n_h, n_ev)  # [sample, layer, H, horizon, event]
    per_h = np.moveaxis(per_h, (3, 4), (0, 2))  # [horizon, sample, event, layer, H]
    curve = np.array([_summary(v, n_boot, seed) for v in per_h])  # [horizon, 3]
    values = per_h[curve_h.index(horizon)]
    valid = (steps[None, :] + horizon) <= (prep.n_steps[:, None] - 1)  # [sample, event]
    est, lo, hi = _summary(values, n_boot, seed)
    dims = ("sample", "event", "layer", prep.hdim)
    with np.errstate(invalid="ignore"):
        per_layer = (
            np.nanmean(np.moveaxis(values, 2, 0).reshape(values.shape[2], -1), axis=1)
            if np.isfinite(values).any()
            else np.full(values.shape[2], np.nan)
        )
    out = xr.Dataset(
        {
            "fmm": (dims, values),
            "fmm_layer": ("layer", per_layer),
            "curve": ("horizon", curve[:, 0]),
            "curve_low": ("horizon", curve[:, 1]),
            "curve_high": ("horizon", curve[:, 2]),
            "mean": est,
            "ci_low": lo,
            "ci_high": hi,
            "n_events": int(np.isfinite(values).sum()),
            "n_censored": int((~valid).sum()) * values.shape[2] * values.shape[3],
        },
        coords={
            **prep.event_coords(steps),
            "horizon": curve_h,
        },
        attrs=attrs,
    )
    if with_tiers:
        fr = flat[..., n_h * n_ev :].reshape(*flat.shape[:3], n_ev, 3)
        fr = np.moveaxis(fr, 3, 1)  # [sample, event, layer, H, 3]
        out["tier_mass"] = (dims + ("tier",), fr)
        out = out.assign_coords(tier=["FP", "Q", "EVICTED"])
        with np.errstate(invalid="ignore"):
            out["tier_mean"] = ("tier", np.nanmean(fr.reshape(-1, 3), axis=0))
    return out


def _summary(values: np.ndarray, n_boot: int, seed: int):
    """Mean over (event, unit) pairs with a bootstrap CI over trace units."""
    finite = np.isfinite(values)
    per_unit_sum = np.where(finite, values, 0.0).sum(axis=1)  # [sample, layer, H]
    per_unit_n = finite.sum(axis=1)
    return bootstrap_ratio(per_unit_sum, per_unit_n, n_boot=n_boot, seed=seed)
