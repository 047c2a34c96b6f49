"""Concentration of attention over windows (SPEC §4.5).

At each event step ``t``, over the windows that exist, with masses sorted descending
``m_(1) ≥ m_(2) ≥ …`` and ``n`` existing windows::

    top_share(p)   = Σ_{i ≤ ⌈p·n⌉} m_(i) / Σ_i m_(i)               p ∈ {5, 10, 20, 40}%
    needed(q)      = min{r : Σ_{i ≤ r} m_(i) ≥ q·Σ_i m_(i)} / n      q ∈ {50, 80, 90}%

Shapes: ``m [..., event, unit]``, ``exists`` alike → ``[..., event, p]`` and ``[..., event, q]``.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from .common import Prepared, UnitData, make_units

TOP_FRACTIONS = (0.05, 0.10, 0.20, 0.40)
MASS_LEVELS = (0.5, 0.8, 0.9)


def concentration_kernel(m: np.ndarray, exists: np.ndarray, fractions=TOP_FRACTIONS, levels=MASS_LEVELS):
    """``(top_share [..., p], needed [..., q])``; NaN where nothing exists or carries mass."""
    exists = np.broadcast_to(exists, m.shape)
    x = np.where(exists, m, 0.0)
    n = exists.sum(-1)
    srt = -np.sort(-x, axis=-1)
    cum = np.cumsum(srt, axis=-1)
    total = cum[..., -1] if x.shape[-1] else np.zeros(x.shape[:-1])
    ok = (n > 0) & (total > 0)
    shares, needed = [], []
    for p in fractions:
        r = np.clip(np.ceil(p * n - 1e-9).astype(np.int64), 1, max(1, x.shape[-1]))
        top = np.take_along_axis(cum, (r - 1)[..., None], axis=-1)[..., 0]
        with np.errstate(invalid="ignore", divide="ignore"):
            shares.append(np.where(ok, top / total, np.nan))
    for q in levels:
        r = (cum < (q * total)[..., None] - 1e-12).sum(-1) + 1
        with np.errstate(invalid="ignore", divide="ignore"):
            needed.append(np.where(ok, r / n, np.nan))
    return np.stack(shares, -1), np.stack(needed, -1)


def concentration(
    ds: xr.Dataset,
    *,
    w: int | None = None,
    n_sink: int | None = None,
    every: int | None = None,
    layers=None,
    heads=None,
) -> xr.Dataset:
    """Concentration of per-step window mass at each event. Returns ``top_share`` and
    ``needed`` ``[sample, event, layer, H, ·]`` and their means (overall and per layer)."""
    prep = Prepared(ds, make_units(ds, "window", w, n_sink), layers, heads, include_prefill=False)
    steps = prep.events(every or prep.units.w)
    n_f, n_q = len(TOP_FRACTIONS), len(MASS_LEVELS)

    def per_unit(u: UnitData) -> np.ndarray:
        exists = u.exists(steps) & (steps < u.n_steps)[:, None]
        share, needed = concentration_kernel(u.m[..., steps, :], exists)  # [H, event, ·]
        return u.flatten(np.concatenate([share, needed], axis=-1))

    flat = prep.map_units(per_unit, len(steps) * (n_f + n_q))
    both = np.moveaxis(flat.reshape(*flat.shape[:3], len(steps), n_f + n_q), 3, 1)  # [sample, event, layer, H, 7]
    share, needed = both[..., :n_f], both[..., n_f:]
    dims = ("sample", "event", "layer", prep.hdim)
    with np.errstate(invalid="ignore"):
        share_layer = np.nanmean(np.moveaxis(share, 2, 0).reshape(share.shape[2], -1, n_f), axis=1)
        needed_layer = np.nanmean(np.moveaxis(needed, 2, 0).reshape(needed.shape[2], -1, n_q), axis=1)
        share_mean = np.nanmean(share.reshape(-1, n_f), axis=0)
        needed_mean = np.nanmean(needed.reshape(-1, n_q), axis=0)
    return xr.Dataset(
        {
            "top_share": (dims + ("top_frac",), share),
            "needed": (dims + ("mass_level",), needed),
            "top_share_mean": ("top_frac", share_mean),
            "needed_mean": ("mass_level", needed_mean),
            "top_share_layer": (("layer", "top_frac"), share_layer),
            "needed_layer": (("layer", "mass_level"), needed_layer),
        },
        coords={
            **prep.event_coords(steps),
            "top_frac": list(TOP_FRACTIONS),
            "mass_level": list(MASS_LEVELS),
        },
        attrs={"metric": "concentration", "w": prep.units.w, "n_sink": prep.units.n_sink},
    )
