"""Global LIR — latent importance reactivation (SPEC §4.3).

Selection matrix ``sel [..., event, unit]`` in {−1, 0, 1}. Each maximal run of 0s that
directly follows a 1 is one *inactive episode*. It becomes *eligible* once it reaches ``m``
consecutive misses (at event ``s + m − 1`` for a run starting at ``s``) and is
*reactivated* if a 1 arrives within ``H_lir`` events after that. Episodes whose window of
``H_lir`` events runs past the last valid event are censored (excluded) unless
``H_lir = None`` (then any later 1 counts, and an episode still open at the end is
eligible and not reactivated)::

    LIR = Σ reactivated / Σ eligible                                    (ratio of sums)
    P01(δ) = #(sel[e]=0 ∧ sel[e+δ]=1) / #(sel[e]=0 ∧ sel[e+δ]≠−1)       (cold → hot)
    P10(δ) = #(sel[e]=1 ∧ sel[e+δ]=0) / #(sel[e]=1 ∧ sel[e+δ]≠−1)       (hot → cold)
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from ..errors import KvscopeError
from .common import Prepared, UnitData, UnitPlan, bootstrap_ratio, check_fraction, make_units
from .kernels import lir_episodes


def lir_kernel(
    sel: np.ndarray, n_valid: np.ndarray, m: int = 4, h_lir: int | None = 8
) -> tuple[np.ndarray, np.ndarray]:
    """``(eligible, reactivated)`` episode counts ``[...]`` summed over units.

    ``sel [..., event, unit]``; ``n_valid [...]`` events per leading index that are inside
    the trace (later events are ignored). Compiled (:func:`kvscope.analysis.kernels.lir_episodes`):
    an episode starts at ``s`` where ``sel[s] = 0`` follows ``sel[s−1] = 1`` and ends at the
    first later non-zero event inside the trace (a reactivation if it is a 1) or at its end.
    """
    if m < 1:
        raise KvscopeError(f"m (misses to become eligible) must be ≥ 1 (got {m})")
    if h_lir is not None and h_lir < 1:
        raise KvscopeError(f"H_lir must be ≥ 1 or None (got {h_lir})")
    sel = np.asarray(sel, dtype=np.int8)
    lead, (n_events, n_units) = sel.shape[:-2], sel.shape[-2:]
    flat = np.ascontiguousarray(sel.reshape(-1, n_events, n_units))
    n_valid = np.ascontiguousarray(np.broadcast_to(np.asarray(n_valid), lead).reshape(-1), dtype=np.int64)
    eligible = np.zeros(flat.shape[0], dtype=np.int64)
    reactivated = np.zeros(flat.shape[0], dtype=np.int64)
    lir_episodes(flat, n_valid, m, -1 if h_lir is None else h_lir, eligible, reactivated)
    return eligible.reshape(lead), reactivated.reshape(lead)


def transition_counts(sel: np.ndarray, n_valid: np.ndarray, delta: int = 1) -> np.ndarray:
    """``[..., 4]`` counts (n0, n01, n1, n10) of lag-``δ`` pairs where both are candidates."""
    if delta < 1:
        raise KvscopeError(f"lag δ must be ≥ 1 (got {delta})")
    a, b = sel[..., :-delta, :], sel[..., delta:, :]
    pair_ok = (np.arange(a.shape[-2]) + delta < np.asarray(n_valid)[..., None])[..., None]
    both = pair_ok & (a >= 0) & (b >= 0)
    n0 = (both & (a == 0)).sum((-1, -2))
    n01 = (both & (a == 0) & (b == 1)).sum((-1, -2))
    n1 = (both & (a == 1)).sum((-1, -2))
    n10 = (both & (a == 1) & (b == 0)).sum((-1, -2))
    return np.stack([n0, n01, n1, n10], -1)


def lir(
    ds: xr.Dataset,
    *,
    granularity: str = "window",
    w: int | None = None,
    n_sink: int | None = None,
    every: int | None = None,
    top_frac: float = 0.2,
    local: int = 64,
    m: int = 4,
    h_lir: int | None = 8,
    delta: int = 1,
    selection: xr.DataArray | None = None,
    include_prefill: bool = True,
    layers=None,
    heads=None,
    n_boot: int = 1000,
    seed: int = 0,
    prep: Prepared | None = None,
    compute: bool = True,
):
    """Global LIR and lag-δ transition probabilities of a selection (default: the
    oracle-by-history). Returns per-trace-unit counts ``eligible``/``reactivated``
    ``[sample, layer, H]``, ``lir`` with CI, ``p01``, ``p10`` and ``lir_layer [layer]``."""
    check_fraction("--top-frac", top_frac)
    if m < 1:
        raise KvscopeError(f"--m must be ≥ 1 (got {m})")
    if h_lir is not None and h_lir < 1:
        raise KvscopeError(f"--h-lir must be ≥ 1 or none (got {h_lir})")
    if delta < 1:
        raise KvscopeError(f"--delta must be ≥ 1 (got {delta})")
    prep = prep or Prepared(ds, make_units(ds, granularity, w, n_sink), layers, heads, include_prefill)
    units = prep.units
    every = every or units.w

    def per_unit(u: UnitData) -> np.ndarray:
        sel, st = u.selection_or_history(every, top_frac, local)
        n_valid = np.array(u.valid_events(st))
        elig, react = lir_kernel(sel, n_valid, m=m, h_lir=h_lir)  # [H] each
        return np.concatenate([elig[..., None], react[..., None], transition_counts(sel, n_valid, delta)], axis=-1)

    width_ = 6

    def finish(flat: np.ndarray) -> xr.Dataset:
        elig, react, trans = flat[..., 0], flat[..., 1], flat[..., 2:]
        est, lo, hi = bootstrap_ratio(react, elig, n_boot=n_boot, seed=seed)
        t = trans.reshape(-1, 4).sum(0)
        with np.errstate(invalid="ignore", divide="ignore"):
            per_layer = react.sum((0, 2)) / elig.sum((0, 2))
        dims = ("sample", "layer", prep.hdim)
        return xr.Dataset(
            {
                "eligible": (dims, elig.astype(np.int64)),
                "reactivated": (dims, react.astype(np.int64)),
                "transitions": (dims + ("count",), trans.astype(np.int64)),
                "lir_layer": ("layer", per_layer),
                "lir": est,
                "ci_low": lo,
                "ci_high": hi,
                "p01": t[1] / t[0] if t[0] else np.nan,
                "p10": t[3] / t[2] if t[2] else np.nan,
                "n_eligible": int(elig.sum()),
                "n_reactivated": int(react.sum()),
            },
            coords={
                "sample": prep.m["sample"].values,
                "layer": prep.m["layer"].values,
                prep.hdim: prep.m[prep.hdim].values,
                "count": ["n0", "n01", "n1", "n10"],
            },
            attrs={
                "metric": "lir",
                "granularity": units.kind,
                "w": units.w,
                "top_frac": top_frac,
                "local": local,
                "m": m,
                "H_lir": "none" if h_lir is None else h_lir,
                "delta": delta,
            },
        )

    plan = UnitPlan(per_unit, width_, finish, selection)
    return plan.run(prep) if compute else plan
