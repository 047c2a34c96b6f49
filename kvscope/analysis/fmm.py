"""Future Missed Mass (docs/concepts.md#fmm).

For a selection decided at event ``e`` at step ``t`` with horizon ``H``:

    FMM(e) = Σ_{t'=t+1}^{t+H} Σ_j m[t', j]·[j existed at t ∧ j not selected at e]
             ─────────────────────────────────────────────────────────────────────
             Σ_{t'=t+1}^{t+H} Σ_j m[t', j]·[j existed at t]

Only units that existed at the decision count. Events without ``H`` future steps are
right-censored (NaN), never scored on a shorter horizon. With ``S[t] = Σ_{t'≤t} m[t']``
the future mass of a unit is ``S[t+H] − S[t]``. For a tiered selection (codes −1 none,
0 EVICTED, 1 Q, 2 FP) "not selected" is EVICTED, and the *tier-resolved future mass* splits
the denominator into its FP, Q and EVICTED shares.

Two forms of the same definition: [`FMM`][kvscope.analysis.FMM] over a whole trace (per trace unit, streamed
over dask tasks), and ``FutureMassStream`` while rows arrive one step at a time (replay),
tested equal.

Shapes: ``future``, ``exists``, ``missed`` ``[..., event, unit]``; results ``[..., event]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import xarray as xr

from .. import defaults
from ..figures import styled
from ..params import param
from ..tiers import TIER_EVICTED, TIER_FP, TIER_Q
from .common import NOT_SELECTED, Prepared, UnitData
from .kernels import fmm_curve
from .metric import Pass, SelectionMetric, ci_text, fmt, layer_means, num, nums

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


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


def tier_shares(future: np.ndarray, den: np.ndarray, tiers: np.ndarray, exists: int, present: tuple, fp: bool = True):
    """``tier_fractions`` of one event: shares of ``future [..., pos]`` (total ``den [...]``
    over the existing positions ``< exists``) on FP, Q and EVICTED → 3 × ``[...]``;
    ``present`` (any FP, any Q, any EVICTED) says which tiers occur: absent ones are exactly 0
    and an all-FP cache exactly 1. ``fp=False``: the FP share is not computed (None)."""
    f = future[..., :exists]
    t = tiers[..., :exists]
    has_fp, has_q, has_ev = present
    zero = np.zeros(den.shape)

    def on(tier):  # a product and a plain (SIMD, pairwise) sum: several times faster than sum(where=)
        return (f * (t == tier)).sum(-1)

    q = on(TIER_Q) if has_q else zero
    ev = on(TIER_EVICTED) if has_ev else zero
    if not fp:
        share_fp = None
    elif not has_fp:
        share_fp = zero
    elif not (has_q or has_ev):
        share_fp = den
    else:
        share_fp = on(TIER_FP)
    with np.errstate(invalid="ignore", divide="ignore"):
        return [None if part is None else np.where(den > 0, part / den, np.nan) for part in (share_fp, q, ev)]


@dataclass
class Resolved:
    """An event whose horizon ``horizon`` (index ``index`` among the horizons) ends now."""

    event: int
    index: int
    horizon: int
    future: np.ndarray  # [..., pos] mass of steps t_e+1 .. t_e+horizon
    den: np.ndarray  # [...] of it on positions that existed at the event
    exists: int  # positions that existed at the event


class FutureMassStream:
    """FMM's future mass while rows arrive one step at a time:

        stream.add(t, row)          → the events whose horizon h ∈ horizons ends at step t
        stream.decided(e, t, n)     event e was decided at step t with n positions existing

    ``future = S[t] − S[t_e]`` with ``S[t] = Σ_{t'≤t} row[t']`` (float64), as ``FMM`` has it."""

    def __init__(self, horizons: list[int], shape: tuple[int, ...]):
        self.horizons = list(horizons)
        self.cum = np.zeros(shape, dtype=np.float64)
        self.pending: list[tuple[int, int, np.ndarray, int]] = []  # (event, step, S at that step, exists)

    def add(self, t: int, row: np.ndarray) -> list[Resolved]:
        self.cum += row
        self.pending = [p for p in self.pending if t - p[1] <= self.horizons[-1]]
        out = []
        for event, t_e, cum_e, exists in self.pending:
            h = t - t_e
            if h in self.horizons:
                future = self.cum - cum_e
                resolved = Resolved(
                    event=event,
                    index=self.horizons.index(h),
                    horizon=h,
                    future=future,
                    den=future[..., :exists].sum(-1),
                    exists=exists,
                )
                out.append(resolved)
        return out

    def decided(self, event: int, t: int, exists: int) -> None:
        self.pending.append((event, t, self.cum.copy(), exists))


def default_horizons(horizon: int) -> list[int]:
    """1, 2, 4, … up to and including ``horizon``."""
    hs, h = [], 1
    while h < horizon:
        hs.append(h)
        h *= 2
    return hs + [horizon]


@dataclass(kw_only=True)
class FMM(SelectionMetric):
    """Future Missed Mass of a selection (default: the oracle-by-history), its FMM(H) curve
    and, for tiers, the tier-resolved future mass."""

    name: ClassVar[str] = "fmm"
    title: ClassVar[str] = "Future Missed Mass of the history oracle (or a replayed policy), FMM(H) curve"
    replayed: ClassVar[str] = "tiers"

    horizon: int = param(defaults.HORIZON, low=1, help="FMM horizon H (steps)")
    horizons: tuple[int, ...] | None = param(None, cli=False, help="curve horizons (default 1, 2, 4, … H)")

    def curve_horizons(self) -> list[int]:
        """The horizons of the FMM(H) curve: ``horizons`` (default 1, 2, 4, … ``H``) and ``H``."""
        return sorted(set(self.horizons or default_horizons(self.horizon)) | {self.horizon})

    def width(self, run: Pass) -> int:
        n_ev = len(run.steps)
        return len(self.curve_horizons()) * n_ev + (3 * n_ev if run.tiered else 0)

    def per_unit(self, u: UnitData, run: Pass) -> np.ndarray:
        st, n_h = run.steps, len(self.curve_horizons())
        sel = self.selection(u, run)  # [H, event, unit]
        tier = sel if run.tiered else None
        if run.tiered:
            sel = np.where(tier < 0, -1, np.where(tier == TIER_EVICTED, NOT_SELECTED, 1))
        exists = u.exists(st)  # [event, unit]
        missed = (sel == NOT_SELECTED).reshape((-1,) + sel.shape[-2:])  # [H, event, unit]
        curve = np.empty(u.lead + (n_h, len(st)))  # [H, horizon, event]
        cum = u.cum.reshape((-1,) + u.cum.shape[-2:])
        last = min(u.n_steps, cum.shape[-2])  # steps that exist
        horizons = np.asarray(self.curve_horizons(), dtype=np.int64)
        fmm_curve(
            cum,
            np.asarray(st, np.int64),
            horizons,
            n_steps=last,
            exists=exists,
            missed=missed,
            out=curve.reshape(-1, n_h, len(st)),
        )
        out = [u.flatten(curve)]
        if run.tiered:
            future = u.cum[..., np.minimum(st + self.horizon, u.m.shape[-2] - 1), :] - u.cum[..., st, :]
            out.append(u.flatten(tier_fractions(future, exists, tier, st + self.horizon <= u.n_steps - 1)))
        return np.concatenate(out, axis=-1)

    def reduce(self, flat: np.ndarray, run: Pass) -> xr.Dataset:
        prep, steps, curve_h = run.prep, run.steps, self.curve_horizons()
        n_ev, n_h = len(steps), len(curve_h)
        per_h = flat[..., : n_h * n_ev].reshape(*flat.shape[:3], n_h, n_ev)  # [sample, layer, H, horizon, event]
        per_h = np.moveaxis(per_h, (3, 4), (0, 2))  # [horizon, sample, event, layer, H]
        curve = np.array([self._mean_ci(v) for v in per_h])  # [horizon, 3]
        values = per_h[curve_h.index(self.horizon)]
        valid = (steps[None, :] + self.horizon) <= (prep.n_steps[:, None] - 1)  # [sample, event]
        est, lo, hi = self._mean_ci(values)
        dims = ("sample", "event", "layer", prep.hdim)
        out = xr.Dataset(
            {
                "fmm": (dims, values),
                "fmm_layer": ("layer", layer_means(values)),
                "curve": ("horizon", curve[:, 0]),
                "curve_low": ("horizon", curve[:, 1]),
                "curve_high": ("horizon", curve[:, 2]),
                "mean": est,
                "ci_low": lo,
                "ci_high": hi,
                "n_events": int(np.isfinite(values).sum()),
                "n_censored": int((~valid).sum()) * values.shape[2] * values.shape[3],
            },
            coords={**prep.event_coords(steps), "horizon": curve_h},
            attrs=self.attrs(
                run, H=self.horizon, selection=run.source, ci=self.ci_note(prep.n_samples, prep.n_trace_units)
            ),
        )
        if run.tiered:
            fr = np.moveaxis(
                flat[..., n_h * n_ev :].reshape(*flat.shape[:3], n_ev, 3), 3, 1
            )  # [sample, event, layer, H, 3]
            out["tier_mass"] = (dims + ("tier",), fr)
            out = out.assign_coords(tier=["FP", "Q", "EVICTED"])
            with np.errstate(invalid="ignore"):
                out["tier_mean"] = ("tier", np.nanmean(fr.reshape(-1, 3), axis=0))
        return out

    def _mean_ci(self, values: np.ndarray):
        """Mean over (event, unit) pairs with its bootstrap CI; ``values [sample, event, layer, H]``."""
        finite = np.isfinite(values)
        return self.interval(np.where(finite, values, 0.0).sum(axis=1), finite.sum(axis=1))

    def summary(self, r: xr.Dataset) -> dict:
        doc = {
            **self.base_summary(r),
            "fmm": num(r["mean"]),
            "ci95": [num(r["ci_low"]), num(r["ci_high"])],
            "n_events": int(r["n_events"]),
            "n_censored": int(r["n_censored"]),
            "curve": {str(int(h)): num(v) for h, v in zip(r["horizon"].values, r["curve"].values)},
            "per_layer": nums(r["fmm_layer"]),
        }
        if "tier_mean" in r:
            doc["tier_mass"] = dict(zip(["FP", "Q", "EVICTED"], nums(r["tier_mean"])))
        return doc

    def table(self, s: dict) -> list[tuple[str, str]]:
        head = f"FMM@{s['H']} ({s['selection']}, top {s['top_frac']:.0%}, local {s['local']})"
        why = f"no event has H = {s['H']} later steps in the trace" if not s["n_events"] else "no future mass"
        rows = [
            (head, fmt(s["fmm"], why=why) + ci_text(*s["ci95"])),
            ("95% CI", s["ci"]),
            ("events scored / censored", f"{s['n_events']} / {s['n_censored']}"),
        ]
        return rows + [(f"FMM(H={h})", fmt(v, why=f"no event has {h} later steps")) for h, v in s["curve"].items()]

    @styled
    def plot(self, result: xr.Dataset, ax: Axes | None = None) -> Figure:
        """FMM(H) with its bootstrap CI band; where there is no interval (one sample) the legend
        says so, and where no event was scored the axes say why instead of drawing nothing.

        Args:
            result: What the metric returned.
            ax: Draw into this axes (default: a new figure).
        """
        from ..figures import axes, no_data

        fig, ax = axes(ax)
        h = result["horizon"].values
        curve, low, high = (result[k].values for k in ("curve", "curve_low", "curve_high"))
        ax.plot(h, curve, marker="o", label=f"FMM ({result.attrs['selection']})")
        if np.isfinite(low).any():
            ax.fill_between(h, low, high, alpha=0.25, label="95% CI")
        else:
            ax.plot([], [], " ", label="no 95% CI: " + result.attrs["ci"].removeprefix("none: "))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("horizon H (steps)")
        ax.set_ylabel("future missed mass")
        shown = np.concatenate([curve, high])
        top = float(np.max(shown[np.isfinite(shown)], initial=0.0))
        ax.set_ylim(0, max(0.05, top * 1.15))
        ax.set_title(f"Future Missed Mass, top {result.attrs['top_frac']:.0%} windows by history")
        if not np.isfinite(curve).any():
            no_data(ax, "no event scored: the trace ends before any event's horizon")
        ax.legend()
        return fig


def fmm(
    ds: xr.Dataset,
    *,
    selection: xr.DataArray | None = None,
    tiers: xr.DataArray | None = None,
    prep: Prepared | None = None,
    **params: Any,
) -> xr.Dataset:
    """``FMM(**params)(ds, selection=…, tiers=…)`` — see [`FMM`][kvscope.analysis.FMM].

    Args:
        ds: The trace.
        selection: ``[sample, event, layer, H, unit]`` a given selection (codes −1/0/1, with
            ``event_step``); default the history oracle.
        tiers: A replayed run's tiers ([`tiers_for`][kvscope.replay.tiers_for]).
        prep: The trace already read for a pass (``study`` shares one).
        **params: Fields of [`FMM`][kvscope.analysis.FMM] by name.
    """
    return FMM(**params)(ds, selection=selection, tiers=tiers, prep=prep)
