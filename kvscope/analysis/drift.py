"""Drift views (docs/concepts.md#drift): window-mass heatmaps, rank trajectories of windows that
leave and re-enter the top set, and churn over time.

``mass [sample, step, layer, H, window]`` per-step window mass;
``rank [sample, event, layer, H, window]`` rank by cumulative score among candidates
(0 = best, −1 = not a candidate); ``returning [sample, layer, H, window]`` True for windows
that were selected, dropped out and were selected again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import xarray as xr

from ..figures import styled
from .churn import churn_kernel, valid_events
from .common import SELECTED, UnitData
from .metric import HistoryOracle, Pass, nums

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


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


@dataclass(kw_only=True)
class Drift(HistoryOracle):
    """Heatmap data, rank trajectories and churn over time. Loads the window masses of the
    chosen layers and heads (``[sample, step, layer, H, window]``): pick a few with ``layers=``."""

    name: ClassVar[str] = "drift"
    title: ClassVar[str] = "window-mass heatmaps, rank trajectories, churn over time"

    def width(self, run: Pass) -> int:
        return 2 * len(run.steps) * run.prep.n_units

    def per_unit(self, u: UnitData, run: Pass) -> np.ndarray:
        steps, n_units = run.steps, run.prep.n_units
        sel = u.history_selection(steps, self.top_frac, self.local)
        masked = np.where(sel >= 0, u.scores(steps), -np.inf)
        order = np.argsort(-masked, axis=-1, kind="stable")
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.broadcast_to(np.arange(n_units), order.shape), axis=-1)
        return np.concatenate([u.flatten(sel), u.flatten(np.where(sel >= 0, rank, -1))], axis=-1)

    def reduce(self, flat: np.ndarray, run: Pass) -> xr.Dataset:
        prep, steps = run.prep, run.steps
        both = flat.reshape(*flat.shape[:3], 2, len(steps), prep.n_units)
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
            coords={"event": np.arange(len(steps)), "event_step": ("event", steps), "pair_step": ("pair", steps[1:])},
            attrs=self.attrs(run),
        )

    def summary(self, r: xr.Dataset) -> dict:
        return {
            **self.base_summary(r),
            "returning_windows": int(r["returning"].sum()),
            "windows": int(r.sizes["window"]),
            "churn_over_time": nums(r["churn_over_time"]),
        }

    def table(self, s: dict) -> list[tuple[str, str]]:
        return [
            ("windows that left and re-entered the top set", str(s["returning_windows"])),
            ("windows", str(s["windows"])),
        ]

    @styled
    def plot(
        self, result: xr.Dataset, ax: Axes | None = None, sample: int = 0, layer: int | None = None, head: int = 0
    ) -> Figure:
        """Window-mass heatmap (step × window) of one unit with the selection overlaid.

        Args:
            result: What the metric returned.
            ax: Draw into this axes (default: a new figure).
            sample: The sample.
            layer: The layer (default: the middle one).
            head: The head (of the stored head dim).
        """
        from ..figures import axes

        hdim = "kv_head" if "kv_head" in result["mass"].dims else "head"
        layer = int(result["layer"].values[len(result["layer"]) // 2]) if layer is None else layer
        m = result["mass"].sel(layer=layer).isel(sample=sample, **{hdim: head}).values  # [step, window]
        sel = result["selection"].sel(layer=layer).isel(sample=sample, **{hdim: head}).values  # [event, window]
        fig, ax = axes(ax, 8, 5)
        im = ax.imshow(np.log10(np.maximum(m.T, 1e-6)), aspect="auto", origin="lower", cmap="viridis")
        fig.colorbar(im, ax=ax, label="log10 window mass")
        ev, win = np.nonzero(sel == 1)
        ax.scatter(result["event_step"].values[ev], win, s=4, c="red", marker="s", label="selected (history top-ρ)")
        ax.set_xlabel("step")
        ax.set_ylabel("window")
        ax.set_title(f"Window mass, sample {sample}, layer {layer}, {hdim} {head}")
        ax.legend(loc="upper left")
        return fig

    @styled
    def plot_ranks(
        self,
        result: xr.Dataset,
        ax: Axes | None = None,
        sample: int | None = None,
        layer: int | None = None,
        head: int | None = None,
        n: int = 12,
    ) -> Figure:
        """Rank trajectories (rank 0 = the heaviest window by cumulative score) of the windows that
        left the top set and came back — of the (sample, layer, head) with the most such windows
        unless given; where none came back, of the 8 best-ranked candidates at the last event that
        has any. An event where a window is not a candidate (not yet existing, a sink or in the
        protected local tail) leaves a gap in its line.

        Args:
            result: What the metric returned.
            ax: Draw into this axes (default: a new figure).
            sample: The sample (default: see above).
            layer: The layer.
            head: The head.
            n: Windows drawn at most.
        """
        from ..figures import axes, no_data

        hdim = "kv_head" if "kv_head" in result["rank"].dims else "head"
        returning = result["returning"].sum("window")  # [sample, layer, H]
        s, li, h = np.unravel_index(int(returning.values.argmax()), returning.shape)
        s = s if sample is None else sample
        li = li if layer is None else list(result["layer"].values).index(layer)
        h = h if head is None else head
        rank = result["rank"].isel(sample=s, layer=li, **{hdim: h}).values  # [event, window], −1: not a candidate
        back = result["returning"].isel(sample=s, layer=li, **{hdim: h}).values  # [window]
        candidates = np.nonzero((rank >= 0).any(axis=1))[0]  # events with any candidate
        if back.any():
            shown = np.nonzero(back)[0][:n]
        elif candidates.size:
            last = rank[candidates[-1]]
            shown = [j for j in np.argsort(np.where(last >= 0, last, np.iinfo(last.dtype).max))[:8] if last[j] >= 0]
        else:
            shown = []
        fig, ax = axes(ax, 9, 4)
        for j in shown:
            ax.plot(result["event_step"].values, np.where(rank[:, j] >= 0, rank[:, j], np.nan), marker=".",
                    label=f"window {j}")  # fmt: skip
        ax.invert_yaxis()
        ax.set_xlabel("step")
        ax.set_ylabel("rank by cumulative score")
        layer_id = int(result["layer"].values[li])
        if back.any():
            what = f"{int(back.sum())} windows left the top set and returned"
        else:
            what = f"none left the top set and returned here: the {len(shown)} best-ranked now"
        ax.set_title(f"sample {s}, layer {layer_id}, {hdim} {h}: {what}")
        if len(shown):
            ax.legend(ncol=2)
        else:
            no_data(ax, "no window is a candidate at any event (all are sinks or in the protected tail)")
        return fig


def drift(ds: xr.Dataset, **params: Any) -> xr.Dataset:
    """``Drift(**params)(ds)`` — see [`Drift`][kvscope.analysis.Drift].

    Args:
        ds: The trace.
        **params: Fields of [`Drift`][kvscope.analysis.Drift] by name.
    """
    return Drift(**params)(ds)
