"""What is drawn over the heatmap: the tier of every position at every step (−1 none,
0 EVICTED, 1 Q, 2 FP), from a replayed policy or from the trace itself.

    Replayed(tiers, policy, β, allocation)   the result's snapshot of the latest event ≤ t
    HistoryOracle(ds)                         the analyses' oracle-by-history (FMM's selection):
                                              at each event the top-ρ windows by cumulative score,
                                              sinks and the newest ``local`` tokens kept — FP; the
                                              other windows that exist — EVICTED
    LogQuantFP(ds, W)                         LogQuant's full-precision set of each step (docs/concepts.md#logquant)
                                              — FP; every other existing position — Q

Each gives ``codes(sample, layer, t0, t1, p0, p1) → [head, step, pos]`` over the heads it is
defined for (``per_kv_head``: the result's KV heads; else the trace's stored heads).
"""

from __future__ import annotations

import threading

import numpy as np
import xarray as xr

from ..analysis import FMM
from ..analysis.common import NOT_SELECTED
from ..analysis.peaks import LogQuantSets
from ..defaults import LOGQUANT_W
from .data import NONE, Rect, TierView, overlay_cells

EVICTED, Q, FP = 0, 1, 2
HISTORY_ORACLE = "history oracle"
LOGQUANT_FP = "LogQuant FP set"


class Overlay:
    name: str
    per_kv_head: bool = False

    def codes(self, sample: int, layer: int, t0: int, t1: int, p0: int, p1: int) -> np.ndarray:
        raise NotImplementedError

    def cells(self, sample: int, layer: int, rect: Rect, n_steps: int) -> np.ndarray:
        """``[head, row, col]`` uint8 ``tier + 1`` of the rectangle; steps past ``n_steps`` none."""
        codes = self.codes(sample, layer, t0=rect.t0, t1=rect.t1, p0=rect.p0, p1=rect.p1)
        codes[:, max(0, n_steps - rect.t0) :] = NONE  # past the sample's steps: not part of the trace
        return overlay_cells(codes, rect)


class Replayed(Overlay):
    per_kv_head = True

    def __init__(self, tiers: TierView, policy: str, budget: float, allocation: str = "uniform"):
        self.tiers, self.run = tiers, tiers.run(policy, budget, allocation)
        self.name = policy

    def codes(self, sample, layer, t0, t1, p0, p1):
        return self.tiers.codes(self.run, sample, layer, t0=t0, t1=t1, p0=p0, p1=p1)


def _existing(query_pos: np.ndarray, p0: int, p1: int) -> np.ndarray:
    """``[step, pos]`` True where key ``p`` exists for the step's query."""
    return np.arange(p0, p1)[None, :] <= np.asarray(query_pos)[:, None]


class HistoryOracle(Overlay):
    """FMM's history-oracle selection (its defaults: ρ, local, events every w steps), computed
    per layer on first use."""

    name = HISTORY_ORACLE

    def __init__(self, ds: xr.Dataset):
        self.ds, self.metric = ds, FMM()
        self.units = self.metric.units(ds)
        self._layers: dict[int, xr.DataArray] = {}
        self._lock = threading.Lock()

    def selection(self, layer: int) -> xr.DataArray:
        """``[sample, event, H, window]`` selection codes (−1 not a candidate, 0, 1) of a layer."""
        with self._lock:
            if layer not in self._layers:
                m = FMM(layers=[layer])
                prep = m.prepare(self.ds)
                self._layers[layer] = prep.history_selection(m.every or prep.units.w, m.top_frac, m.local).isel(layer=0)
            return self._layers[layer]

    def codes(self, sample, layer, t0, t1, p0, p1):
        sel = self.selection(layer).isel(sample=sample)  # [event, H, window]
        steps = np.asarray(sel["event_step"].values)
        query_pos = self.ds.kvscope.query_pos[sample, t0:t1]
        event = np.searchsorted(steps, np.arange(t0, t1), side="right") - 1  # [step]
        n_sink, w = self.units.n_sink, self.units.w
        window = np.where(np.arange(p0, p1) >= n_sink, (np.arange(p0, p1) - n_sink) // w, -1)  # [pos]
        codes = np.where(_existing(query_pos, p0, p1), FP, NONE).astype(np.int8)  # [step, pos]
        codes = np.repeat(codes[None], sel.sizes[sel.dims[1]], axis=0)  # [H, step, pos]
        values = np.asarray(sel.values)  # [event, H, window]
        inside = (window >= 0) & (window < values.shape[-1])
        dropped = np.zeros(codes.shape, dtype=bool)  # [H, step, pos]
        have = event >= 0
        picked = values[event[have]][..., window[inside]]  # [step with an event, H, pos inside]
        dropped[:, np.flatnonzero(have)[:, None], np.flatnonzero(inside)[None, :]] = (
            np.moveaxis(picked, 1, 0) == NOT_SELECTED
        )
        codes[dropped & (codes == FP)] = EVICTED
        return codes


class LogQuantFP(Overlay):
    name = LOGQUANT_FP

    def __init__(self, ds: xr.Dataset, W: int = LOGQUANT_W):
        self.ds, self.sets = ds, LogQuantSets(ds, W)
        self.n_heads = ds.sizes[ds.kvscope.hdim]

    def codes(self, sample, layer, t0, t1, p0, p1):
        query_pos = self.ds.kvscope.query_pos[sample, t0:t1]
        codes = np.where(_existing(query_pos, p0, p1), Q, NONE).astype(np.int8)  # [step, pos]
        fp = self.sets.block(sample, t0, t1 - t0)  # [step, 3W] positions, −1 padded
        rows, cols = np.nonzero((fp >= p0) & (fp < p1))
        codes[rows, fp[rows, cols] - p0] = FP
        return np.repeat(codes[None], self.n_heads, axis=0)
