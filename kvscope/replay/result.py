"""The replay result: every run's record assembled into one Dataset, with the metrics of
the analysis layer (churn and LIR kernels, the bootstrap) over the replayed tiers.

Dims: ``policy, budget, sample, event | event_pair | step, layer, kv_head, pos, horizon, tier``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import xarray as xr

from ..analysis.churn import churn_kernel, valid_events
from ..analysis.common import selection_codes
from ..analysis.lir import lir_kernel, transition_counts

TIERS = ("FP", "Q", "EVICTED")


@dataclass
class Outputs:
    """Preallocated result arrays; each run of each sample records into views of them."""

    tiers: np.ndarray  # [policy, budget, sample, event, layer, kv_head, pos] int8
    bytes: np.ndarray  # [policy, budget, sample, step]
    mass: np.ndarray  # [policy, budget, sample, event, layer, kv_head, tier]
    curve: np.ndarray  # [evicted | not FP, policy, budget, sample, horizon, event, layer, kv_head]
    l1: np.ndarray  # [policy, budget, sample, event, layer, kv_head]
    out: np.ndarray
    reached: np.ndarray  # [policy, budget, sample]
    n_quantized: np.ndarray
    budget_bytes: np.ndarray  # [budget, sample]
    full_bytes: np.ndarray  # [sample]

    def record(self, pi: int, bi: int, s: int) -> RunRecord:
        return RunRecord(self, (pi, bi, s))

    @classmethod
    def allocate(cls, setup) -> Outputs:
        lead = (len(setup.policies), len(setup.budgets), setup.n_samples)
        per_event = lead + (len(setup.steps), setup.n_layers, setup.n_kv)
        return cls(
            np.full(per_event + (setup.n_pos,), -1, dtype=np.int8),
            np.full(lead + (setup.n_step_total,), np.nan),
            np.full(per_event + (3,), np.nan),
            np.full((2,) + lead + (len(setup.horizons),) + per_event[3:], np.nan),
            np.full(per_event, np.nan),
            np.full(per_event, np.nan),
            np.ones(lead, dtype=bool),
            np.zeros(lead, dtype=np.int64),
            np.zeros((len(setup.budgets), setup.n_samples)),
            np.zeros(setup.n_samples),
        )


class RunRecord:
    """What one (policy, budget) records on one sample: views into :class:`Outputs`."""

    def __init__(self, o: Outputs, index: tuple[int, int, int]):
        self.outputs, self.index = o, index
        self.tiers = o.tiers[index]  # [event, layer, kv_head, pos]
        self.bytes = o.bytes[index]  # [step]
        self.mass = o.mass[index]  # [event, layer, kv_head, tier]
        self.curve = o.curve[(slice(None),) + index]  # [evicted | not FP, horizon, event, layer, kv_head]
        self.l1 = o.l1[index]  # [event, layer, kv_head]
        self.out = o.out[index]

    def finish(self, state) -> None:
        self.outputs.reached[self.index] = bool(state.reached)
        self.outputs.n_quantized[self.index] = state.ledger.n_quantized if state.ledger is not None else 0


def fp_churn(tiers: np.ndarray, n_sink: int, n_valid: np.ndarray) -> np.ndarray:
    """``[..., event−1, layer, kv_head]`` Jaccard distance of consecutive FP sets over the
    positions that existed at the earlier event (sinks excluded); NaN past a sample's events.
    ``tiers [..., event, layer, kv_head, pos]``, ``n_valid [...]``."""
    sel = np.moveaxis(selection_codes(tiers, accessible=False, n_sink=n_sink), -4, -2)  # [..., L, H, event, pos]
    out = churn_kernel(sel, np.asarray(n_valid)[..., None, None], earlier_only=True)
    return np.moveaxis(out, -1, -3)


def lir_counts(tiers: np.ndarray, n_sink: int, n_valid: np.ndarray, lir):
    """Global LIR episodes ``(eligible, reactivated) [..., layer, kv_head]`` and lag-δ transition
    counts ``[..., 4]`` of the FP-set selection (sinks not candidates); ``lir`` an :class:`LIR`."""
    sel = np.moveaxis(selection_codes(tiers, accessible=False, n_sink=n_sink), -4, -2)  # [..., L, H, event, pos]
    n_valid = np.asarray(n_valid)[..., None, None]
    eligible, reactivated = lir_kernel(sel, n_valid, lir.m, lir.h_lir)
    if sel.shape[-2] > lir.delta:
        transitions = transition_counts(sel, n_valid, lir.delta).sum((-2, -3))
    else:
        transitions = np.zeros(sel.shape[:-4] + (4,), dtype=np.int64)
    return eligible, reactivated, transitions


def build(setup, o: Outputs) -> xr.Dataset:
    """The Dataset described in :mod:`kvscope.replay` from the filled ``Outputs``."""
    n_p, n_b = o.tiers.shape[:2]
    n_valid = valid_events(setup.steps, setup.ds.kvscope.n_steps)  # [sample]
    churn = fp_churn(o.tiers, setup.n_sink, n_valid)  # [policy, budget, sample, event−1, layer, kv_head]
    eligible, reactivated, transitions = lir_counts(o.tiers, setup.n_sink, n_valid, setup.lir)
    transitions = transitions.sum(2)  # [policy, budget, 4]
    fmm, fmm_fp = o.mass[..., 2], o.mass[..., 1] + o.mass[..., 2]
    summary = {name: _mean_ci(values, setup) for name, values in (("fmm", fmm), ("fmm_fp", fmm_fp))}
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-censored events: NaN means, said so by n_events
        per_horizon = np.moveaxis(o.curve, 4, 3)  # [evicted | not FP, policy, budget, horizon, sample, …]
        curve = np.nanmean(per_horizon.reshape(per_horizon.shape[:4] + (-1,)), axis=-1)
        tier_mean = np.nanmean(np.moveaxis(o.mass, -1, 2).reshape(n_p, n_b, 3, -1), axis=-1)
        churn_mean = np.nanmean(churn.reshape(n_p, n_b, -1), axis=-1) if churn.size else np.full((n_p, n_b), np.nan)
        el_sum, re_sum = eligible.sum((2, 3, 4)), reactivated.sum((2, 3, 4))
        ratio = np.nanmax(o.bytes, axis=-1) / o.full_bytes[None, None, :]
    dims_event = ("policy", "budget", "sample", "event", "layer", "kv_head")
    per_run = ("policy", "budget")
    data = {
        "tiers": (dims_event + ("pos",), o.tiers),
        "tier_mass": (dims_event + ("tier",), o.mass),
        "tier_mean": (per_run + ("tier",), tier_mean),
        "fmm": (dims_event, fmm),
        "fmm_fp": (dims_event, fmm_fp),
        "fmm_curve": (per_run + ("horizon",), curve[0]),
        "fmm_fp_curve": (per_run + ("horizon",), curve[1]),
        "churn": (("policy", "budget", "sample", "event_pair", "layer", "kv_head"), churn),
        "churn_mean": (per_run, churn_mean),
        "lir_eligible": (("policy", "budget", "sample", "layer", "kv_head"), eligible),
        "lir_reactivated": (("policy", "budget", "sample", "layer", "kv_head"), reactivated),
        "lir": (per_run, _ratio(re_sum, el_sum)),
        "p01": (per_run, _ratio(transitions[..., 1], transitions[..., 0])),
        "p10": (per_run, _ratio(transitions[..., 3], transitions[..., 2])),
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
