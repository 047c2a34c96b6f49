"""Drift views (SPEC §4.6): window-mass heatmaps, rank trajectories of windows that
leave and re-enter the top set, and churn over time.

``mass [sample, step, layer, H, window]`` per-step window mass;
``rank [sample, event, layer, H, window]`` rank by cumulative score among candidates
(0 = best, −1 = not a candidate); ``returning [sample, layer, H, window]`` True for windows
that were selected, dropped out and were selected again.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from .churn import churn_kernel, valid_events
from .common import SELECTED, Prepared, UnitData, check_fraction, make_units


def returning_windows(sel: np.ndarray) -> np.ndarray:
    """``[..., unit]`` True where the selection goes 1 → 0 … → 1 (``sel [..., event, unit]``)."""
    was_in = np.zeros(sel.shape[:-2] + sel.shape[-1:], dtype=bool)
    left = np.zeros_like(was_in)
    back = np.zeros_like(was_in)
    for e in range(sel.shape[-2]):
        v = sel[..., e, :]
        back |= left & (v == SELECTED)
        left |= was_in & (v == 0)
        was_in |= v == SELECTED
    return back


def drift(
    ds: xr.Dataset,
    *,
    w: int | None = None,
    n_sink: int | None = None,
    every: int | None = None,
    top_frac: float = 0.2,
    local: int = 64,
    layers=None,
    heads=None,
) -> xr.Dataset:
    """Heatmap data, rank trajectories and churn over time. Loads the window masses of the
    chosen layers and heads (``[sample, step, layer, H, window]``): pick a few with ``layers=``."""
    check_fraction("--top-frac", top_frac)
    prep = Prepared(ds, make_units(ds, "window", w, n_sink), layers, heads)
    steps = prep.events(every or prep.units.w)
    n_ev, n_units = len(steps), prep.n_units

    def per_unit(u: UnitData) -> np.ndarray:
        sel = u.history_selection(steps, top_frac, local)
        masked = np.where(sel >= 0, u.scores(steps), -np.inf)
        order = np.argsort(-masked, axis=-1, kind="stable")
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.broadcast_to(np.arange(n_units), order.shape), axis=-1)
        return np.concatenate([u.flatten(sel), u.flatten(np.where(sel >= 0, rank, -1))], axis=-1)

    flat = prep.map_units(per_unit, 2 * n_ev * n_units)
    both = flat.reshape(*flat.shape[:3], 2, n_ev, n_units)
    sel = np.moveaxis(both[..., 0, :, :], 3, 1).astype(np.int8)  # [sample, event, layer, H, window]
    rank = np.moveaxis(both[..., 1, :, :], 3, 1).astype(np.int64)
    back = returning_windows(np.moveaxis(sel, 1, -2))  # [sample, layer, H, window]
    n_valid = valid_events(steps, prep.n_steps)[:, None, None]
    ch = churn_kernel(np.moveaxis(sel, 1, -2), n_valid)  # [sample, layer, H, event-1]
    with np.errstate(invalid="ignore"):
        over_time = np.nanmean(ch.reshape(-1, ch.shape[-1]), axis=0) if ch.size else np.zeros(0)
    dims = ("sample", "event", "layer", prep.hdim, "window")
    return xr.Dataset(
        {
            "mass": prep.m.compute(),
            "selection": (dims, sel),
            "rank": (dims, rank),
            "returning": (("sample", "layer", prep.hdim, "window"), back),
            "churn_over_time": ("pair", over_time),
        },
        coords={"event": np.arange(n_ev), "event_step": ("event", steps), "pair_step": ("pair", steps[1:])},
        attrs={"metric": "drift", "w": prep.units.w, "n_sink": prep.units.n_sink, "top_frac": top_frac, "local": local},
    )
