"""Global LIR — latent importance reactivation (docs/concepts.md#lir).

Selection matrix ``sel [..., event, unit]`` in {−1, 0, 1}. Each maximal run of 0s that
directly follows a 1 is one *inactive episode*. It becomes *eligible* once it reaches ``m``
consecutive misses (at event ``s + m − 1`` for a run starting at ``s``) and is
*reactivated* if a 1 arrives within ``H_lir`` events after that. Episodes whose window of
``H_lir`` events runs past the last valid event are censored (excluded) unless
``H_lir = None`` (then any later 1 counts, and an episode still open at the end is
eligible and not reactivated):

    LIR = Σ reactivated / Σ eligible                                    (ratio of sums)
    P01(δ) = #(sel[e]=0 ∧ sel[e+δ]=1) / #(sel[e]=0 ∧ sel[e+δ]≠−1)       (cold → hot)
    P10(δ) = #(sel[e]=1 ∧ sel[e+δ]=0) / #(sel[e]=1 ∧ sel[e+δ]≠−1)       (hot → cold)

Two forms of the same counts: ``lir_kernel`` and ``transition_counts`` over a whole
selection matrix, and ``LirStream`` while events arrive one at a time (replay), tested equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import xarray as xr

from .. import defaults
from ..figures import styled
from ..params import param
from .common import Prepared, UnitData
from .kernels import lir_episodes
from .metric import Pass, SelectionMetric, ci_text, fmt, num, nums


def lir_kernel(sel: np.ndarray, n_valid: np.ndarray, m: int, h_lir: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``(eligible, reactivated)`` episode counts ``[...]`` summed over units.

    ``sel [..., event, unit]``; ``n_valid [...]`` events per leading index that are inside
    the trace (later events are ignored). Compiled (``kvscope.analysis.kernels.lir_episodes``):
    an episode starts at ``s`` where ``sel[s] = 0`` follows ``sel[s−1] = 1`` and ends at the
    first later non-zero event inside the trace (a reactivation if it is a 1) or at its end.
    """
    sel = np.asarray(sel, dtype=np.int8)
    lead, (n_events, n_units) = sel.shape[:-2], sel.shape[-2:]
    flat = np.ascontiguousarray(sel.reshape(-1, n_events, n_units))
    n_valid = np.ascontiguousarray(np.broadcast_to(np.asarray(n_valid), lead).reshape(-1), dtype=np.int64)
    eligible = np.zeros(flat.shape[0], dtype=np.int64)
    reactivated = np.zeros(flat.shape[0], dtype=np.int64)
    lir_episodes(flat, n_valid, m, h_lir=-1 if h_lir is None else h_lir, eligible=eligible, reactivated=reactivated)
    return eligible.reshape(lead), reactivated.reshape(lead)


def transition_counts(sel: np.ndarray, n_valid: np.ndarray, delta: int) -> np.ndarray:
    """``[..., 4]`` counts (n0, n01, n1, n10) of lag-``δ`` pairs where both are candidates."""
    a, b = sel[..., :-delta, :], sel[..., delta:, :]
    pair_ok = (np.arange(a.shape[-2]) + delta < np.asarray(n_valid)[..., None])[..., None]
    both = pair_ok & (a >= 0) & (b >= 0)
    n0 = (both & (a == 0)).sum((-1, -2))
    n01 = (both & (a == 0) & (b == 1)).sum((-1, -2))
    n1 = (both & (a == 1)).sum((-1, -2))
    n10 = (both & (a == 1) & (b == 0)).sum((-1, -2))
    return np.stack([n0, n01, n1, n10], -1)


class LirStream:
    """``lir_kernel`` and ``transition_counts`` while a selection arrives one event at
    a time (replay), tested equal to them:

        stream.push(sel_e)     sel_e [..., unit] of event e = 0, 1, …  (events e ≥ n_valid are ignored)
        stream.counts()        → eligible [...], reactivated [...], transitions [..., 4]

    ``n_valid [...]`` (broadcast to the leading dims) is the number of events inside the
    trace, known up front and at most the number of events pushed. A state machine per unit:
    the code of the previous event, the start ``s`` of the inactive episode that is open
    (−1: none) and the codes of the last δ events. An episode that ends at event ``e`` (a
    non-zero code, or the end ``n_valid``) after ``e − s ≥ m`` zeros became eligible at
    ``a = s + m − 1``; it counts when ``H_lir = None`` or ``a + H_lir ≤ n_valid − 1``
    (otherwise censored), and is reactivated when it ends with a 1 and ``e − a ≤ H_lir``."""

    def __init__(self, shape: tuple[int, ...], n_valid, m: int, h_lir: int | None, delta: int):
        lead = tuple(shape[:-1])
        self.end = np.broadcast_to(np.asarray(n_valid, dtype=np.int64), lead)[..., None]  # [..., 1]
        self.m, self.h_lir, self.delta, self.e = m, h_lir, delta, 0
        self.prev = np.full(shape, -1, dtype=np.int8)  # [..., unit] code at the previous valid event
        self.start = np.full(shape, -1, dtype=np.int32)  # [..., unit] first event of the open episode
        self.lagged = np.full((delta,) + tuple(shape), -1, dtype=np.int8)  # [δ, ..., unit] ring of codes
        self.eligible = np.zeros(lead, dtype=np.int64)  # [...]
        self.reactivated = np.zeros(lead, dtype=np.int64)  # [...]
        self.transitions = np.zeros(lead + (4,), dtype=np.int64)  # [..., (n0, n01, n1, n10)]

    def push(self, sel: np.ndarray) -> None:
        """Advance every unit by event ``e`` with codes ``sel [..., unit]``."""
        e, active = self.e, self.e < self.end  # [..., 1]
        ending = active & (self.start >= 0) & (sel != 0)
        eligible, reactivated = self._episodes(ending, e, sel == 1)
        self.eligible += eligible
        self.reactivated += reactivated
        self.start[ending] = -1
        self.start[active & (sel == 0) & (self.prev == 1)] = e
        np.copyto(self.prev, sel, where=active)
        if e >= self.delta:  # the pair (e − δ, e), counted while e is inside the trace
            pair = np.stack([self.lagged[e % self.delta], sel], -2)  # [..., 2, unit]
            self.transitions += transition_counts(pair, np.where(active[..., 0], 2, 0), 1)
        self.lagged[e % self.delta] = sel
        self.e += 1

    def counts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(eligible, reactivated, transitions)`` with the episodes still open closed by the
        end of the trace (eligible if long enough and not censored, never reactivated)."""
        open_ = self.start >= 0
        eligible, _ = self._episodes(open_, self.end, np.zeros(open_.shape, dtype=bool))
        return self.eligible + eligible, self.reactivated.copy(), self.transitions.copy()

    def _episodes(self, ending: np.ndarray, e, ends_with_one: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(eligible, reactivated) [...]`` of the episodes that end at ``e`` where ``ending [..., unit]``."""
        long = ending & (e - self.start >= self.m)
        at = self.start + (self.m - 1)  # [..., unit] event at which the episode became eligible
        if self.h_lir is None:
            counted, back = long, long & ends_with_one
        else:
            counted = long & (at + self.h_lir <= self.end - 1)
            back = counted & ends_with_one & (e - at <= self.h_lir)
        return counted.sum(-1), back.sum(-1)


@dataclass(kw_only=True)
class LIR(SelectionMetric):
    """Global LIR and lag-δ transition probabilities of a selection (default: the
    oracle-by-history): per-trace-unit counts ``eligible``/``reactivated`` ``[sample, layer, H]``,
    ``lir`` with its CI, ``p01``, ``p10`` and ``lir_layer [layer]``."""

    name: ClassVar[str] = "lir"
    title: ClassVar[str] = "Global LIR (latent importance reactivation), P01/P10"
    replayed: ClassVar[str] = "fp"

    m: int = param(defaults.LIR_MISSES, low=1, flag="--m", help="misses before an episode is eligible")
    h_lir: int | None = param(defaults.LIR_HORIZON, low=1, help="reactivation horizon in events", none="any time later")
    delta: int = param(defaults.LIR_LAG, low=1, help="lag δ of P01/P10 (events)")

    def width(self, run: Pass) -> int:
        return 6

    def per_unit(self, u: UnitData, run: Pass) -> np.ndarray:
        sel = self.selection(u, run)
        n_valid = np.array(u.valid_events(run.steps))
        elig, react = lir_kernel(sel, n_valid, self.m, self.h_lir)  # [H] each
        trans = transition_counts(sel, n_valid, self.delta)
        return np.concatenate([elig[..., None], react[..., None], trans], axis=-1)

    def reduce(self, flat: np.ndarray, run: Pass) -> xr.Dataset:
        prep = run.prep
        elig, react, trans = flat[..., 0], flat[..., 1], flat[..., 2:]
        est, lo, hi = self.interval(react, elig)
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
            attrs=self.attrs(
                run,
                H_lir="none" if self.h_lir is None else self.h_lir,
                selection=run.source,
                ci=self.ci_note(prep.n_samples, prep.n_trace_units),
            ),
        )

    def summary(self, r: xr.Dataset) -> dict:
        return {
            **self.base_summary(r),
            "lir": num(r["lir"]),
            "ci95": [num(r["ci_low"]), num(r["ci_high"])],
            "eligible": int(r["n_eligible"]),
            "reactivated": int(r["n_reactivated"]),
            "p01": num(r["p01"]),
            "p10": num(r["p10"]),
            "per_layer": nums(r["lir_layer"]),
        }

    def table(self, s: dict) -> list[tuple[str, str]]:
        unit = s.get("granularity", "window")
        why = f"no eligible episode (a selected {unit} missing {s['m']} events in a row"
        why += ")" if s["H_lir"] == "none" else f" with {s['H_lir']} events after it inside the trace)"
        later = f"with a candidate event {s['delta']} later"
        return [
            (f"Global LIR (m={s['m']}, H_lir={s['H_lir']})", fmt(s["lir"], why=why) + ci_text(*s["ci95"])),
            ("95% CI", s["ci"]),
            ("episodes eligible / reactivated", f"{s['eligible']} / {s['reactivated']}"),
            (f"P01 cold→hot (δ={s['delta']})", fmt(s["p01"], why=f"no unselected {unit} {later}")),
            ("P10 hot→cold", fmt(s["p10"], why=f"no selected {unit} {later}")),
        ]

    @styled
    def plot(self, result: xr.Dataset, ax=None):
        from ..figures import axes

        fig, (ax1, ax2) = axes(ax, 9, 4, ncols=2)
        ax1.bar(result["layer"].values, result["lir_layer"].values)
        ax1.axhline(float(result["lir"]), color="k", lw=1, ls="--", label=f"all layers {float(result['lir']):.3f}")
        ax1.set_xlabel("layer")
        ax1.set_ylabel("LIR (reactivated / eligible)")
        ax1.legend()
        ax2.bar(["P01 cold→hot", "P10 hot→cold"], [float(result["p01"]), float(result["p10"])])
        ax2.set_ylabel(f"lag-{self.delta} transition probability")
        return fig


def lir(
    ds: xr.Dataset, *, selection: xr.DataArray | None = None, prep: Prepared | None = None, **params: Any
) -> xr.Dataset:
    """``LIR(**params)(ds, selection=…)`` — see [`LIR`][kvscope.analysis.LIR].

    Args:
        ds: The trace.
        selection: ``[sample, event, layer, H, unit]`` a given selection (codes −1/0/1, with
            ``event_step``); default the history oracle.
        prep: The trace already read for a pass (``study`` shares one).
        **params: Fields of [`LIR`][kvscope.analysis.LIR] by name.
    """
    return LIR(**params)(ds, selection=selection, prep=prep)
