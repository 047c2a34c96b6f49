"""Concentration of attention over windows (docs/concepts.md#concentration).

At each event step ``t``, over the windows that exist, with masses sorted descending
``m_(1) ≥ m_(2) ≥ …`` and ``n`` existing windows:

    top_share(p)   = Σ_{i ≤ ⌈p·n⌉} m_(i) / Σ_i m_(i)               p ∈ {5, 10, 20, 40}%
    needed(q)      = min{r : Σ_{i ≤ r} m_(i) ≥ q·Σ_i m_(i)} / n      q ∈ {50, 80, 90}%

Shapes: ``m [..., event, unit]``, ``exists`` alike → ``[..., event, p]`` and ``[..., event, q]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import xarray as xr

from ..figures import styled
from .common import UnitData
from .metric import Pass, UnitMetric, fmt, num

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


@dataclass(kw_only=True)
class Concentration(UnitMetric):
    """Concentration of per-step window mass at each event: ``top_share`` and ``needed``
    ``[sample, event, layer, H, ·]`` and their means (overall and per layer)."""

    name: ClassVar[str] = "concentration"
    title: ClassVar[str] = "mass held by the top windows, windows needed for 50/80/90% of the mass"
    include_prefill: ClassVar[bool] = False

    def width(self, run: Pass) -> int:
        return len(run.steps) * (len(TOP_FRACTIONS) + len(MASS_LEVELS))

    def per_unit(self, u: UnitData, run: Pass) -> np.ndarray:
        steps = run.steps
        exists = u.exists(steps) & (steps < u.n_steps)[:, None]
        share, needed = concentration_kernel(u.m[..., steps, :], exists)  # [H, event, ·]
        return u.flatten(np.concatenate([share, needed], axis=-1))

    def reduce(self, flat: np.ndarray, run: Pass) -> xr.Dataset:
        prep, steps = run.prep, run.steps
        n_f, n_q = len(TOP_FRACTIONS), len(MASS_LEVELS)
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
            coords={**prep.event_coords(steps), "top_frac": list(TOP_FRACTIONS), "mass_level": list(MASS_LEVELS)},
            attrs=self.attrs(run),
        )

    def summary(self, r: xr.Dataset) -> dict:
        return {
            **self.base_summary(r),
            "top_share": {f"{p:.0%}": num(v) for p, v in zip(r["top_frac"].values, r["top_share_mean"].values)},
            "windows_needed": {f"{q:.0%}": num(v) for q, v in zip(r["mass_level"].values, r["needed_mean"].values)},
        }

    def table(self, s: dict) -> list[tuple[str, str]]:
        return [(f"mass in top {k} windows", fmt(v)) for k, v in s["top_share"].items()] + [
            (f"windows needed for {k} of mass", fmt(v)) for k, v in s["windows_needed"].items()
        ]

    @styled
    def plot(self, result: xr.Dataset, ax=None):
        from ..figures import axes

        fig, ax = axes(ax)
        p = np.asarray(result["top_frac"].values)
        ax.plot(p * 100, result["top_share_mean"].values, marker="o", label="mean over events and units")
        ax.plot([0, 100], [0, 1], color="gray", ls=":", label="uniform")
        ax.set_xlabel("top windows (%)")
        ax.set_ylabel("share of per-step mass")
        ax.set_title("Concentration of attention over windows")
        ax.legend()
        return fig


def concentration(ds: xr.Dataset, **params: Any) -> xr.Dataset:
    """``Concentration(**params)(ds)`` — see [`Concentration`][kvscope.analysis.Concentration].

    Args:
        ds: The trace.
        **params: Fields of [`Concentration`][kvscope.analysis.Concentration] by name.
    """
    return Concentration(**params)(ds)
