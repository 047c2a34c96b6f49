"""Selection churn (docs/concepts.md#churn).

Jaccard distance between consecutive selections of candidate units (sinks and the
protected local tail are not candidates):

    churn(e) = 1 − |A_e ∩ A_{e+1}| / |A_e ∪ A_{e+1}|,   0 when both are empty

with ``A_e = {j : sel[e, j] = 1}``. ``earlier_only`` restricts both sets to the units that
were candidates at the earlier event (replay's churn of FP sets: a position that appears
between two events is new, not churn). Shapes: ``sel [..., event, unit]`` → ``[..., event−1]``.
``ChurnStream`` is the same while events arrive one at a time (replay), tested equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import xarray as xr

from ..figures import styled
from .common import SELECTED, Prepared, UnitData
from .metric import Pass, SelectionMetric, ci_text, fmt, layer_means, num, nums


def churn_kernel(sel: np.ndarray, n_valid_events: np.ndarray | None = None, earlier_only: bool = False) -> np.ndarray:
    """``[..., event−1]`` churn between events e and e+1 (NaN past ``n_valid_events``)."""
    a = sel[..., :-1, :] == SELECTED
    b = sel[..., 1:, :] == SELECTED
    if earlier_only:
        b &= sel[..., :-1, :] >= 0
    inter = (a & b).sum(-1)
    union = (a | b).sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(union > 0, 1.0 - inter / np.maximum(union, 1), 0.0)
    if n_valid_events is not None:
        pair = np.arange(out.shape[-1])
        out = np.where(pair + 1 < np.asarray(n_valid_events)[..., None], out, np.nan)
    return out


class ChurnStream:
    """``churn_kernel`` while a selection arrives one event at a time (replay), tested
    equal to it: ``push(sel_e)`` with ``sel_e [..., unit]`` of event e = 0, 1, … returns the
    churn ``[...]`` of the pair (e − 1, e), NaN once ``e ≥ n_valid [...]`` (None at e = 0).
    Keeps the previous event's codes only."""

    def __init__(self, n_valid_events, earlier_only: bool = False):
        self.n_valid, self.earlier_only = np.asarray(n_valid_events), earlier_only
        self.prev: np.ndarray | None = None  # [..., unit] codes of the previous event
        self.e = 0

    def push(self, sel: np.ndarray) -> np.ndarray | None:
        out = None
        if self.prev is not None:
            pair = np.stack([self.prev, sel], -2)  # [..., 2, unit]
            out = churn_kernel(pair, np.where(self.e < self.n_valid, 2, 0), self.earlier_only)[..., 0]
        self.prev, self.e = sel, self.e + 1
        return out


def valid_events(steps: np.ndarray, n_steps: np.ndarray) -> np.ndarray:
    """``[sample]`` number of events that fall inside each sample's valid steps."""
    return (steps[None, :] < np.asarray(n_steps)[:, None]).sum(1)


@dataclass(kw_only=True)
class Churn(SelectionMetric):
    """Churn of a selection (default: the oracle-by-history) between consecutive events:
    ``churn [sample, event, layer, H]`` (event = the later of the pair), ``churn_over_time
    [event]``, ``churn_layer [layer]`` and the mean with its CI."""

    name: ClassVar[str] = "churn"
    title: ClassVar[str] = "selection churn: Jaccard distance between consecutive selections"
    replayed: ClassVar[str] = "fp"

    def width(self, run: Pass) -> int:
        return max(0, len(run.steps) - 1)

    def per_unit(self, u: UnitData, run: Pass) -> np.ndarray:
        return churn_kernel(self.selection(u, run), u.valid_events(run.steps))

    def reduce(self, flat: np.ndarray, run: Pass) -> xr.Dataset:
        prep, steps = run.prep, run.steps
        values = np.moveaxis(flat, 3, 1)  # [sample, event-1, layer, H]
        finite = np.isfinite(values)
        est, lo, hi = self.interval(np.where(finite, values, 0).sum(1), finite.sum(1))
        with np.errstate(invalid="ignore"):
            per_pair = np.moveaxis(values, 1, 0).reshape(values.shape[1], values.size // max(1, values.shape[1]))
            over_time = np.nanmean(per_pair, axis=1)  # [event-1]; empty with a single event
        coords = prep.event_coords(steps[1:])
        coords["event"] = np.arange(1, len(steps))
        return xr.Dataset(
            {
                "churn": (("sample", "event", "layer", prep.hdim), values),
                "churn_over_time": ("event", over_time),
                "churn_layer": ("layer", layer_means(values)),
                "mean": est,
                "ci_low": lo,
                "ci_high": hi,
            },
            coords=coords,
            attrs=self.attrs(run, selection=run.source, ci=self.ci_note(prep.n_samples, prep.n_trace_units)),
        )

    def summary(self, r: xr.Dataset) -> dict:
        return {
            **self.base_summary(r),
            "churn": num(r["mean"]),
            "ci95": [num(r["ci_low"]), num(r["ci_high"])],
            "per_layer": nums(r["churn_layer"]),
            "over_time": nums(r["churn_over_time"]),
        }

    def table(self, s: dict) -> list[tuple[str, str]]:
        value = fmt(s["churn"], why="fewer than two events in the trace") + ci_text(*s["ci95"])
        return [("mean churn (Jaccard distance)", value), ("95% CI", s["ci"])]

    @styled
    def plot(self, result: xr.Dataset, ax=None):
        from ..figures import axes

        fig, ax = axes(ax)
        ax.plot(result["event_step"].values, result["churn_over_time"].values, marker=".")
        ax.set_xlabel("step of the later event")
        ax.set_ylabel("Jaccard distance to previous selection")
        ax.set_title(f"Selection churn (mean {float(result['mean']):.3f})")
        return fig


def churn(
    ds: xr.Dataset, *, selection: xr.DataArray | None = None, prep: Prepared | None = None, **params: Any
) -> xr.Dataset:
    """``Churn(**params)(ds, selection=…)`` — see [`Churn`][kvscope.analysis.Churn].

    Args:
        ds: The trace.
        selection: ``[sample, event, layer, H, unit]`` a given selection (codes −1/0/1, with
            ``event_step``); default the history oracle.
        prep: The trace already read for a pass (``study`` shares one).
        **params: Fields of [`Churn`][kvscope.analysis.Churn] by name.
    """
    return Churn(**params)(ds, selection=selection, prep=prep)
