"""The replay result: every run's record assembled into one Dataset, with the metrics of
the analysis layer (streaming churn and LIR, the bootstrap) over the replayed tiers.

Dims: ``policy, budget, sample, event | event_pair | step, layer, kv_head, pos, horizon, tier``.
The tiers (the only variable per position) are not held here: each snapshot is written to
the result store as it is taken (:class:`kvscope.replay.store.TierStore`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import xarray as xr

from ..analysis.churn import ChurnStream, valid_events
from ..analysis.common import selection_codes
from ..analysis.lir import LIR, LirStream
from .store import TIER_DIMS, TierStore

TIERS = ("FP", "Q", "EVICTED")


@dataclass
class Outputs:
    """Preallocated result arrays (none per position); each run of each sample records into
    views of them and streams its tiers to ``tiers``."""

    tiers: TierStore  # [policy, budget, sample, event, layer, kv_head, pos] int8, in the result store
    bytes: np.ndarray  # [policy, budget, sample, step]
    mass: np.ndarray  # [policy, budget, sample, event, layer, kv_head, tier]
    curve: np.ndarray  # [evicted | not FP, policy, budget, sample, horizon, event, layer, kv_head]
    l1: np.ndarray  # [policy, budget, sample, event, layer, kv_head]
    out: np.ndarray
    churn: np.ndarray  # [policy, budget, sample, event−1, layer, kv_head]
    eligible: np.ndarray  # [policy, budget, sample, layer, kv_head] int64
    reactivated: np.ndarray
    transitions: np.ndarray  # [policy, budget, sample, (n0, n01, n1, n10)] int64
    reached: np.ndarray  # [policy, budget, sample]
    n_quantized: np.ndarray
    budget_bytes: np.ndarray  # [budget, sample]
    full_bytes: np.ndarray  # [sample]
    n_valid: np.ndarray  # [sample] events inside each sample's steps
    n_sink: int
    lir: LIR  # m, H_lir, δ
    settings: dict = field(default_factory=dict)  # (policy, budget, sample) → a state's setting

    def record(self, pi: int, bi: int, s: int, shape: tuple[int, ...]) -> RunRecord:
        return RunRecord(self, (pi, bi, s), shape)

    @classmethod
    def allocate(cls, setup, root) -> Outputs:
        """Arrays for ``setup`` (a :class:`kvscope.replay.ReplaySetup`); the tiers go to a new
        store in the folder ``root``."""
        lead = (len(setup.policies), len(setup.budgets), setup.n_samples)
        per_event = lead + (len(setup.steps), setup.n_layers, setup.n_kv)
        per_unit = lead + (setup.n_layers, setup.n_kv)
        return cls(
            TierStore(root, per_event + (setup.n_pos,)),
            np.full(lead + (setup.n_step_total,), np.nan),
            np.full(per_event + (3,), np.nan),
            np.full((2,) + lead + (len(setup.horizons),) + per_event[3:], np.nan),
            np.full(per_event, np.nan),
            np.full(per_event, np.nan),
            np.full(lead + (max(0, len(setup.steps) - 1),) + per_event[4:], np.nan),
            np.zeros(per_unit, dtype=np.int64),
            np.zeros(per_unit, dtype=np.int64),
            np.zeros(lead + (4,), dtype=np.int64),
            np.ones(lead, dtype=bool),
            np.zeros(lead, dtype=np.int64),
            np.zeros((len(setup.budgets), setup.n_samples)),
            np.zeros(setup.n_samples),
            valid_events(setup.steps, setup.ds.kvscope.n_steps),
            setup.n_sink,
            setup.lir,
        )


class RunRecord:
    """What one (policy, budget) records on one sample: views into :class:`Outputs`, its tier
    snapshots streamed to the store, and churn and LIR of its FP-set selection (sinks not
    candidates) kept by the analysis layer's streaming forms, one event at a time."""

    def __init__(self, o: Outputs, index: tuple[int, int, int], shape: tuple[int, ...]):
        self.outputs, self.index = o, index
        self.bytes = o.bytes[index]  # [step]
        self.mass = o.mass[index]  # [event, layer, kv_head, tier]
        self.curve = o.curve[(slice(None),) + index]  # [evicted | not FP, horizon, event, layer, kv_head]
        self.l1 = o.l1[index]  # [event, layer, kv_head]
        self.out = o.out[index]
        self.churn = o.churn[index]  # [event−1, layer, kv_head]
        n_valid = o.n_valid[index[2]]
        self.churn_stream = ChurnStream(n_valid, earlier_only=True)
        self.lir_stream = LirStream(shape, n_valid, o.lir.m, o.lir.h_lir, o.lir.delta)  # shape [layer, kv_head, pos]

    def snapshot(self, event: int, tiers: np.ndarray) -> None:
        """``tiers [layer, kv_head, pos]`` after the policy acted at ``event``: written out, and
        its FP set advances churn (the pair event − 1, event) and the LIR walk."""
        self.outputs.tiers.write(self.index + (event,), tiers)
        sel = selection_codes(tiers, accessible=False, n_sink=self.outputs.n_sink)  # [layer, kv_head, pos]
        churn = self.churn_stream.push(sel)
        if churn is not None:
            self.churn[event - 1] = churn
        self.lir_stream.push(sel)

    def finish(self, state) -> None:
        o, i = self.outputs, self.index
        o.reached[i] = bool(state.reached)
        if state.setting:
            o.settings[i] = state.setting
        o.n_quantized[i] = state.ledger.n_quantized if state.ledger is not None else 0
        o.eligible[i], o.reactivated[i], transitions = self.lir_stream.counts()  # [layer, kv_head], …, [L, H, 4]
        o.transitions[i] = transitions.sum((0, 1))


def build(setup, o: Outputs, tiers=None) -> xr.Dataset:
    """The Dataset described in :mod:`kvscope.replay` from the filled ``Outputs``; ``tiers``
    (a dask array reading the result store) is included when given."""
    n_p, n_b = o.mass.shape[:2]
    fmm, fmm_fp = o.mass[..., 2], o.mass[..., 1] + o.mass[..., 2]
    summary = {name: _mean_ci(values, setup) for name, values in (("fmm", fmm), ("fmm_fp", fmm_fp))}
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-censored events: NaN means, said so by n_events
        per_horizon = np.moveaxis(o.curve, 4, 3)  # [evicted | not FP, policy, budget, horizon, sample, …]
        curve = np.nanmean(per_horizon.reshape(per_horizon.shape[:4] + (-1,)), axis=-1)
        tier_mean = np.nanmean(np.moveaxis(o.mass, -1, 2).reshape(n_p, n_b, 3, -1), axis=-1)
        ratio = np.nanmax(o.bytes, axis=-1) / o.full_bytes[None, None, :]
    dims_event = ("policy", "budget", "sample", "event", "layer", "kv_head")
    per_run = ("policy", "budget")
    data = {} if tiers is None else {"tiers": (TIER_DIMS, tiers)}
    data |= {
        "tier_mass": (dims_event + ("tier",), o.mass),
        "tier_mean": (per_run + ("tier",), tier_mean),
        "fmm": (dims_event, fmm),
        "fmm_fp": (dims_event, fmm_fp),
        "fmm_curve": (per_run + ("horizon",), curve[0]),
        "fmm_fp_curve": (per_run + ("horizon",), curve[1]),
        **_selection_variables(o),
        "bytes_used": (("policy", "budget", "sample", "step"), o.bytes),
        "budget_bytes": (("budget", "sample"), o.budget_bytes),
        "full_bytes": (("sample",), o.full_bytes),
        "byte_ratio": (("policy", "budget", "sample"), ratio),
        "byte_ratio_used": (per_run, np.nanmax(ratio, axis=-1)),
        "budget_reached": (per_run, o.reached.all(-1)),
        "n_quantized": (("policy", "budget", "sample"), o.n_quantized),
    }
    for name, (est, lo, hi) in summary.items():
        data[f"{name}_mean"], data[f"{name}_ci_low"], data[f"{name}_ci_high"] = (
            (per_run, est),
            (per_run, lo),
            (per_run, hi),
        )
    if setup.with_errors:
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            data["attn_l1"] = (dims_event, o.l1)
            data["output_rel_l2"] = (dims_event, o.out)
            data["attn_l1_mean"] = (per_run, np.nanmean(o.l1.reshape(n_p, n_b, -1), -1))
            data["output_rel_l2_mean"] = (per_run, np.nanmean(o.out.reshape(n_p, n_b, -1), -1))
    return xr.Dataset(data, coords=_coords(setup, o))


def _selection_variables(o: Outputs) -> dict:
    """Churn, LIR and P01/P10 of the FP-set selection from what the runs streamed::

    churn_mean = mean of churn over (sample, event pair, layer, kv_head), NaN past a sample's events
    lir = Σ reactivated / Σ eligible,   p01 = n01 / n0,   p10 = n10 / n1   (sums over samples and units)
    """
    n_p, n_b = o.churn.shape[:2]
    transitions = o.transitions.sum(2)  # [policy, budget, (n0, n01, n1, n10)]
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN churn (one event): NaN mean
        churn_mean = np.nanmean(o.churn.reshape(n_p, n_b, -1), axis=-1) if o.churn.size else np.full((n_p, n_b), np.nan)
    per_run, per_unit = ("policy", "budget"), ("policy", "budget", "sample", "layer", "kv_head")
    return {
        "churn": (("policy", "budget", "sample", "event_pair", "layer", "kv_head"), o.churn),
        "churn_mean": (per_run, churn_mean),
        "lir_eligible": (per_unit, o.eligible),
        "lir_reactivated": (per_unit, o.reactivated),
        "lir": (per_run, _ratio(o.reactivated.sum((2, 3, 4)), o.eligible.sum((2, 3, 4)))),
        "p01": (per_run, _ratio(transitions[..., 1], transitions[..., 0])),
        "p10": (per_run, _ratio(transitions[..., 3], transitions[..., 2])),
    }


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return np.where(den > 0, num / np.maximum(den, 1), np.nan)


def _mean_ci(values: np.ndarray, setup) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over (event, trace unit) pairs with its bootstrap CI, per (policy, budget);
    ``values [policy, budget, sample, event, layer, kv_head]`` (NaN = censored)."""
    out = np.full(values.shape[:2] + (3,), np.nan)
    for pi in range(values.shape[0]):
        for bi in range(values.shape[1]):
            v = values[pi, bi]  # [sample, event, layer, kv_head]
            finite = np.isfinite(v)
            out[pi, bi] = setup.fmm.interval(np.where(finite, v, 0).sum(1), finite.sum(1))
    return out[..., 0], out[..., 1], out[..., 2]


def _coords(setup, o: Outputs) -> dict:
    ds, policies = setup.ds, setup.policies
    return {
        "policy": [p.label() for p in policies],
        "policy_name": ("policy", [p.name for p in policies]),
        "policy_kind": ("policy", [p.kind for p in policies]),
        "budget": list(setup.budgets),
        "sample": ds["sample"].values,
        "event": np.arange(len(setup.steps)),
        "event_step": ("event", setup.steps),
        "event_pair": np.arange(1, len(setup.steps)),
        "layer": ds["layer"].values,
        "kv_head": np.arange(setup.n_kv),
        "pos": np.arange(setup.n_pos),
        "step": np.arange(setup.n_step_total),
        "horizon": setup.horizons,
        "tier": list(TIERS),
    }


def ci_attr(setup) -> str:
    return setup.fmm.ci_note(setup.n_samples, setup.n_samples * setup.n_layers * setup.n_kv)
