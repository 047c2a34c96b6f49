"""Shared pieces of the analyses: events, the history-oracle selection, bootstrap CIs.

Selections are one well-defined input everywhere: an int8 array over ``[..., event, unit]``
per trace unit with values ::

    -1  not a candidate (the unit does not exist yet, or is protected: sinks, local tail)
     0  candidate, not selected
     1  selected

so that the default history oracle and, later, any replayed policy plug into FMM, churn
and LIR the same way. Tiered selections use ``TIER_*`` codes.
"""

from __future__ import annotations

import math

import numpy as np
import xarray as xr

from ..errors import KvscopeError
from .mass import Units, prefill_unit_mass, unit_mass

NOT_CANDIDATE, NOT_SELECTED, SELECTED = -1, 0, 1
TIER_NONE, TIER_EVICTED, TIER_Q, TIER_FP = -1, 0, 1, 2
UNIT_DIMS = ("sample", "layer")  # plus the stored head dim


def make_units(ds: xr.Dataset, granularity: str = "window", w: int | None = None, n_sink: int | None = None) -> Units:
    """Units of an analysis; ``w`` and ``n_sink`` default to the trace's attributes."""
    return Units(
        granularity,
        int(w if w is not None else ds.attrs.get("w", 8)),
        int(n_sink if n_sink is not None else ds.attrs.get("n_sink", 4)),
    )


def selection_from_tiers(tiers: xr.DataArray, accessible: bool = True) -> xr.DataArray:
    """Binary selection from tiers: selected = FP or Q (``accessible``) or FP only."""
    keep = tiers >= TIER_Q if accessible else tiers == TIER_FP
    sel = xr.where(tiers < 0, NOT_CANDIDATE, xr.where(keep, SELECTED, NOT_SELECTED)).astype(np.int8)
    sel.attrs = dict(tiers.attrs)
    return sel


def event_steps(n_steps: int, every: int) -> np.ndarray:
    """Steps at which a policy re-decides: ``0, every, 2·every, … < n_steps``."""
    if every < 1:
        raise KvscopeError(f"event interval must be ≥ 1 (got {every})")
    return np.arange(0, n_steps, every)


def check_fraction(name: str, value: float) -> float:
    if not (0 < value < 1):
        raise KvscopeError(f"{name} must lie in (0, 1) (got {value})")
    return float(value)


def top_fraction_selection(
    scores: np.ndarray,  # [..., event, unit] float
    exists: np.ndarray,  # [..., event, unit] bool
    protected: np.ndarray,  # [..., event, unit] bool
    top_frac: float,
) -> np.ndarray:
    """Top-``ρ`` candidates by score at each event: int8 ``[..., event, unit]``.

    Candidates exist and are not protected; ``k = ceil(ρ · n_candidates)`` of them are
    selected (ties broken toward the older unit).
    """
    candidate = exists & ~protected
    n_cand = candidate.sum(-1)
    k = np.ceil(top_frac * n_cand - 1e-9).astype(np.int64)
    masked = np.where(candidate, scores, -np.inf)
    order = np.argsort(-masked, axis=-1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.broadcast_to(np.arange(order.shape[-1]), order.shape), axis=-1)
    sel = np.where(candidate, (ranks < k[..., None]).astype(np.int8), np.int8(NOT_CANDIDATE))
    return sel.astype(np.int8)


class Prepared:
    """Lazy per-step unit masses of a trace plus everything the metrics share.

    ``m``        ``[sample, step, layer, H, unit]``  per-step unit mass (lazy when the trace is)
    ``prefill``  ``[sample, layer, H, unit]``  prefill column mass (when ``include_prefill``)
    Cumulative scores ``c[t] = Σ_{t'≤t} m[t'] + prefill`` are gathered at the steps asked for.
    """

    def __init__(self, ds: xr.Dataset, units: Units, layers=None, heads=None, include_prefill: bool = True):
        self.ds = ds
        self.units = units
        self.m = unit_mass(ds, units, layers, heads)
        self.hdim = "kv_head" if "kv_head" in self.m.dims else "head"
        self.m = self.m.transpose("sample", "step", "layer", self.hdim, units.dim)
        self.prefill = prefill_unit_mass(ds, units, layers, heads) if include_prefill else None
        if self.prefill is not None:
            self.prefill = self.prefill.transpose("sample", "layer", self.hdim, units.dim)
        self.query_pos = np.asarray(ds["query_pos"].values)  # [sample, step]
        self.n_steps = np.asarray(ds["n_steps"].values)  # [sample]
        self.n_units = self.m.sizes[units.dim]
        self._cum: dict[int, np.ndarray] = {}

    def events(self, every: int) -> np.ndarray:
        return event_steps(self.m.sizes["step"], every)

    def exists_at(self, steps: np.ndarray) -> np.ndarray:
        """[sample, event, 1, 1, unit] existence at the given steps (broadcasts over layer, head)."""
        q = self.query_pos[:, steps]  # [sample, event]
        last = self.units.last_position(self.n_units)
        return (last <= q[..., None])[:, :, None, None, :]

    def cum_at(self, steps) -> dict[int, np.ndarray]:
        """``Σ_{t'≤t} m[t']`` at each of ``steps`` (one pass over the trace):
        step -> ``[sample, layer, H, unit]``."""
        wanted = sorted({int(s) for s in steps})
        missing = [s for s in wanted if s not in self._cum]
        if missing:
            values = np.asarray(self.m.cumsum("step").isel(step=missing).values, dtype=np.float64)
            for i, s in enumerate(missing):
                self._cum[s] = values[:, i]
        return self._cum

    def scores_at(self, steps: np.ndarray) -> np.ndarray:
        """Cumulative scores ``c`` at ``steps``: ``[sample, event, layer, H, unit]``."""
        cum = self.cum_at(steps)
        c = np.stack([cum[int(s)] for s in steps], axis=1)
        if self.prefill is not None:
            c = c + np.asarray(self.prefill.values, dtype=np.float64)[:, None]
        return c

    def history_selection(self, every: int, top_frac: float, local: int) -> xr.DataArray:
        """The oracle-by-history: top-``ρ`` candidates by cumulative score at each event.

        Returns int8 ``[sample, event, layer, H, unit]`` with coordinate ``event_step``.
        """
        steps = self.events(every)
        c = self.scores_at(steps)  # [sample, event, layer, H, unit]
        exists = np.broadcast_to(self.exists_at(steps), c.shape)
        n_exist = self.units.n_existing(self.query_pos[:, steps])  # [sample, event]
        protected = self.units.protected(n_exist, self.n_units, local)[:, :, None, None, :]
        sel = top_fraction_selection(c, exists, np.broadcast_to(protected, c.shape), top_frac)
        return self.selection_array(sel, steps)

    def selection_array(self, sel: np.ndarray, steps: np.ndarray) -> xr.DataArray:
        dims = ("sample", "event", "layer", self.hdim, self.units.dim)
        return xr.DataArray(
            sel,
            dims=dims,
            coords={
                "sample": self.m["sample"].values,
                "event": np.arange(len(steps)),
                "event_step": ("event", steps),
                "layer": self.m["layer"].values,
                self.hdim: self.m[self.hdim].values,
            },
            name="selection",
        )


def bootstrap_ratio(num: np.ndarray, den: np.ndarray, n_boot: int = 1000, seed: int = 0, level: float = 0.95):
    """Ratio of sums ``Σ num / Σ den`` over trace units with a percentile bootstrap CI.

    ``num``, ``den``: one value per trace unit (any shape, flattened). Units are resampled
    with replacement; seeded, so the same inputs give the same interval.
    """
    num = np.asarray(num, dtype=np.float64).ravel()
    den = np.asarray(den, dtype=np.float64).ravel()
    keep = den > 0
    num, den = num[keep], den[keep]
    if den.size == 0:
        return math.nan, math.nan, math.nan
    estimate = num.sum() / den.sum()
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, den.size, size=(n_boot, den.size))
    ratios = num[idx].sum(1) / den[idx].sum(1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(ratios, [alpha, 1 - alpha])
    return float(estimate), float(lo), float(hi)
