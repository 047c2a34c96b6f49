"""The replay result: every run's record assembled into one Dataset, with the metrics of
the analysis layer (streaming churn and LIR, the bootstrap) over the replayed tiers, and its
attributes; one run's tiers as the analyses take them ([`tiers_for`][kvscope.replay.tiers_for]) and a result written
as a store ([`save_result`][kvscope.replay.save_result]).

Dims: ``policy, allocation, budget, sample, event | event_pair | step, layer, kv_head, pos,
horizon, tier``; a run is one (policy, allocation, budget) — ``RUN`` below.
The tiers (the only variable per position) are not held here: each snapshot is written to
the result store as it is taken (``kvscope.replay.store.TierStore``).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import xarray as xr

from ..analysis.churn import ChurnStream, valid_events
from ..analysis.common import selection_codes
from ..analysis.lir import LIR, LirStream
from ..storage.schema import CHUNK_OVERHEAD, METADATA_BYTES, chunked_bytes, on_disk
from .check import COORDINATES, VARIABLES
from .reader import answered
from .store import RUN, TIER_DIMS, TierStore, tier_chunks, write_variables, written_in_place

TIERS = ("FP", "Q", "EVICTED")


class NoTiers:
    """Where the snapshots of runs whose tiers nobody reads go (the oracle allocation's probes)."""

    def write(self, index, tiers) -> None:
        pass

    def complete(self) -> None:
        pass


@dataclass
class Outputs:
    """Preallocated result arrays (none per position); each run of each sample records into
    views of them and streams its tiers to ``tiers``."""

    tiers: TierStore | NoTiers  # [*run, sample, event, layer, kv_head, pos] int8, in the result store
    bytes: np.ndarray  # [*run, sample, step]
    mass: np.ndarray  # [*run, sample, event, layer, kv_head, tier]
    curve: np.ndarray  # [evicted | not FP, *run, sample, horizon, event, layer, kv_head]
    l1: np.ndarray  # [*run, sample, event, layer, kv_head]
    out: np.ndarray
    churn: np.ndarray  # [*run, sample, event−1, layer, kv_head]
    eligible: np.ndarray  # [*run, sample, layer, kv_head] int64
    reactivated: np.ndarray
    transitions: np.ndarray  # [*run, sample, (n0, n01, n1, n10)] int64
    reached: np.ndarray  # [*run, sample]
    n_quantized: np.ndarray
    allocated: np.ndarray  # [*run, sample, layer, kv_head] bytes each unit was given
    budget_bytes: np.ndarray  # [budget, sample]
    full_bytes: np.ndarray  # [sample]
    n_valid: np.ndarray  # [sample] events inside each sample's steps
    n_sink: int
    lir: LIR  # m, H_lir, δ
    settings: dict = field(default_factory=dict)  # (policy, allocation, budget, sample) → a state's setting
    splits: dict = field(default_factory=dict)  # sample → {(policy, allocation, budget): the oracle's split}

    def record(self, pi: int, ai: int, bi: int, s: int, shape: tuple[int, ...]) -> RunRecord:
        return RunRecord(self, (pi, ai, bi, s), shape)

    # per-unit records: (the axis of their policy dim, of their layer dim)
    UNIT_AXES: ClassVar[dict[str, tuple[int, int]]] = {
        "mass": (0, 5), "l1": (0, 5), "out": (0, 5), "churn": (0, 5), "curve": (1, 7),
        "eligible": (0, 4), "reactivated": (0, 4), "allocated": (0, 4),
    }  # fmt: skip

    def absorb(self, part: Outputs, policies: tuple[int, ...], sample: int, units: tuple[slice, slice]) -> None:
        """The record of a task (its ``policies``, its one sample, the model's ``units`` = layers,
        KV heads) into these arrays: per-unit values in place, bytes, quantized counts and LIR
        transitions summed over the tasks, ``reached`` only where every task reached the budget."""
        for j, pi in enumerate(policies):
            for name, (run_axis, layer_axis) in self.UNIT_AXES.items():
                to, src = [slice(None)] * layer_axis, [slice(None)] * layer_axis
                to[run_axis], to[run_axis + 3], src[run_axis], src[run_axis + 3] = pi, sample, j, 0
                getattr(self, name)[(*to, *units)] = getattr(part, name)[tuple(src)]
            to, src = (pi, slice(None), slice(None), sample), (j, slice(None), slice(None), 0)
            held, add = self.bytes[to], part.bytes[src]  # [allocation, budget, step]
            self.bytes[to] = np.where(np.isnan(held), add, held + add)
            self.transitions[to] += part.transitions[src]
            self.n_quantized[to] += part.n_quantized[src]
            self.reached[to] &= part.reached[src]
            for (pj, ai, bi, _), setting in part.settings.items():
                if pj == j:
                    self.settings[pi, ai, bi, sample] = setting

    @classmethod
    def allocate(cls, setup, root, tiers=None, block: tuple[int, int] | None = None) -> Outputs:
        """Arrays for ``setup`` (a [`kvscope.replay.ReplaySetup`][kvscope.replay.ReplaySetup]); the tiers go to a new
        store in the folder ``root`` (None: they are not kept, as for the oracle's probes),
        chunked by ``block`` (a task's layers, KV heads), or to ``tiers`` (a task's window on that store)."""
        lead = (len(setup.policies), len(setup.allocations), len(setup.budgets), setup.n_samples)
        per_event = lead + (len(setup.steps), setup.n_layers, setup.n_kv)
        per_unit = lead + (setup.n_layers, setup.n_kv)
        if tiers is None:
            tiers = TierStore(root, per_event + (setup.n_pos,), block) if root is not None else NoTiers()
        return cls(
            tiers=tiers,
            bytes=np.full(lead + (setup.n_step_total,), np.nan),
            mass=np.full(per_event + (3,), np.nan),
            curve=np.full((2,) + lead + (len(setup.horizons),) + per_event[4:], np.nan),
            l1=np.full(per_event, np.nan),
            out=np.full(per_event, np.nan),
            churn=np.full(lead + (max(0, len(setup.steps) - 1),) + per_event[5:], np.nan),
            eligible=np.zeros(per_unit, dtype=np.int64),
            reactivated=np.zeros(per_unit, dtype=np.int64),
            transitions=np.zeros(lead + (4,), dtype=np.int64),
            reached=np.ones(lead, dtype=bool),
            n_quantized=np.zeros(lead, dtype=np.int64),
            allocated=np.full(per_unit, np.nan),
            budget_bytes=np.zeros((len(setup.budgets), setup.n_samples)),
            full_bytes=np.zeros(setup.n_samples),
            n_valid=valid_events(setup.steps, setup.ds.kvscope.n_steps),
            n_sink=setup.n_sink,
            lir=setup.lir,
        )


class RunRecord:
    """What one (policy, budget) records on one sample: views into ``Outputs``, its tier
    snapshots streamed to the store, and churn and LIR of its FP-set selection (sinks not
    candidates) kept by the analysis layer's streaming forms, one event at a time."""

    def __init__(self, o: Outputs, index: tuple[int, int, int, int], shape: tuple[int, ...]):
        self.outputs, self.index = o, index
        self.bytes = o.bytes[index]  # [step]
        self.mass = o.mass[index]  # [event, layer, kv_head, tier]
        self.curve = o.curve[(slice(None),) + index]  # [evicted | not FP, horizon, event, layer, kv_head]
        self.l1 = o.l1[index]  # [event, layer, kv_head]
        self.out = o.out[index]
        self.churn = o.churn[index]  # [event−1, layer, kv_head]
        n_valid = o.n_valid[index[-1]]
        self.churn_stream = ChurnStream(n_valid, earlier_only=True)
        # shape [layer, kv_head, pos]
        self.lir_stream = LirStream(shape, n_valid, o.lir.m, o.lir.h_lir, delta=o.lir.delta)

    BYTES_GRID = 1024  # a unit's bytes are summed on a grid of 1/1024 B (record_bytes)

    def record_bytes(self, t: int, used: np.ndarray) -> None:
        """Step ``t``'s bytes: the sum over ``used [layer, kv_head]``, each unit's bytes first
        rounded to ``BYTES_GRID`` — a position's share of its key group's parameters
        (``4·D/G`` B) is not a binary fraction for every group size ``G``, and float sums
        grouped by task would differ in the last bit; on the grid every sum is exact, so a
        task's total adds up to the whole replay's (< 2⁴² B a step)."""
        self.bytes[t] = np.round(used * self.BYTES_GRID).sum() / self.BYTES_GRID

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
        o.allocated[i] = np.broadcast_to(state.spec.capacity, o.allocated[i].shape)
        o.eligible[i], o.reactivated[i], transitions = self.lir_stream.counts()  # [layer, kv_head], …, [L, H, 4]
        o.transitions[i] = transitions.sum((0, 1))


def result_bytes(setup, block: tuple[int, int] | None = None, fs_block: int = 1, whole: bool = True) -> int:
    """About the most the result of ``setup`` takes on disk, in whole blocks of ``fs_block`` bytes:
    its tiers uncompressed in chunks of ``block`` (a task's layers, KV heads) and, if ``whole``,
    every other variable of a result (``kvscope.replay.check.VARIABLES``) uncompressed in one
    chunk, a chunk of each coordinate, and each array's metadata, in its own ``zarr.json`` and
    again in the group's consolidated copy."""
    n_events = len(setup.steps)
    sizes = {
        "policy": len(setup.policies), "allocation": len(setup.allocations), "budget": len(setup.budgets),
        "sample": setup.n_samples, "event": n_events, "event_pair": max(0, n_events - 1), "layer": setup.n_layers,
        "kv_head": setup.n_kv, "pos": setup.n_pos, "step": setup.n_step_total, "horizon": len(setup.horizons),
        "tier": len(TIERS),
    }  # fmt: skip
    shape = tuple(sizes[d] for d in TIER_DIMS)
    total = chunked_bytes(shape, tier_chunks(shape, block), 1, fs_block)
    if not whole:
        return total
    for name, variable in VARIABLES.items():
        if name != "tiers":
            data = int(np.prod([sizes[d] for d in variable.dims])) * np.dtype(variable.dtypes[0]).itemsize
            total += on_disk(data + CHUNK_OVERHEAD, fs_block)
    total += len(COORDINATES) * on_disk(METADATA_BYTES, fs_block)  # labels and indices: small
    return total + (len(VARIABLES) + len(COORDINATES)) * (on_disk(METADATA_BYTES, fs_block) + METADATA_BYTES)


def _per_run(values: np.ndarray, reduce, lead: int = 3) -> np.ndarray:
    """``reduce`` over everything after the ``lead`` run dims (``[*run, …]`` → ``[*run]``)."""
    return reduce(values.reshape(values.shape[:lead] + (-1,)), axis=-1)


def build(setup, o: Outputs, tiers=None, forced=None) -> xr.Dataset:
    """The Dataset described in [`kvscope.replay`][kvscope.replay] from the filled ``Outputs``; ``tiers``
    (a dask array reading the result store) is included when given, the forced decodes
    (``kvscope.replay.forced.ForcedOutputs``) when given."""
    fmm, fmm_fp = o.mass[..., 2], o.mass[..., 1] + o.mass[..., 2]
    summary = {name: _mean_ci(values, setup) for name, values in (("fmm", fmm), ("fmm_fp", fmm_fp))}
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-censored events: NaN means, said so by n_events
        per_horizon = np.moveaxis(o.curve, 5, 4)  # [evicted | not FP, *run, horizon, sample, …]
        curve = _per_run(per_horizon, np.nanmean, lead=5)
        tier_mean = _per_run(np.moveaxis(o.mass, -1, 3), np.nanmean, lead=4)  # [*run, tier]
        ratio = np.nanmax(o.bytes, axis=-1) / o.full_bytes  # [*run, sample]
    dims_sample = RUN + ("sample",)
    dims_event = dims_sample + ("event", "layer", "kv_head")
    data = {} if tiers is None else {"tiers": (TIER_DIMS, tiers)}
    data |= {
        "tier_mass": (dims_event + ("tier",), o.mass),
        "tier_mean": (RUN + ("tier",), tier_mean),
        "fmm": (dims_event, fmm),
        "fmm_fp": (dims_event, fmm_fp),
        "fmm_curve": (RUN + ("horizon",), curve[0]),
        "fmm_fp_curve": (RUN + ("horizon",), curve[1]),
        **_selection_variables(o),
        "bytes_used": (dims_sample + ("step",), o.bytes),
        "allocated": (dims_sample + ("layer", "kv_head"), o.allocated),
        "budget_bytes": (("budget", "sample"), o.budget_bytes),
        "full_bytes": (("sample",), o.full_bytes),
        "byte_ratio": (dims_sample, ratio),
        "byte_ratio_used": (RUN, np.nanmax(ratio, axis=-1)),
        "budget_reached": (RUN, o.reached.all(-1)),
        "n_quantized": (dims_sample, o.n_quantized),
    }
    for name, (est, lo, hi) in summary.items():
        data[f"{name}_mean"], data[f"{name}_ci_low"], data[f"{name}_ci_high"] = (RUN, est), (RUN, lo), (RUN, hi)
    if setup.with_errors:
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            data["attn_l1"] = (dims_event, o.l1)
            data["output_rel_l2"] = (dims_event, o.out)
            data["attn_l1_mean"] = (RUN, _per_run(o.l1, np.nanmean))
            data["output_rel_l2_mean"] = (RUN, _per_run(o.out, np.nanmean))
    if forced is not None:
        data |= _forced_variables(setup, forced)
    coords = _coords(setup, o)
    if "answer_exact_full" in data:
        coords["task"] = ("sample", tasks(setup.ds))
        coords["context"] = ("sample", setup.ds.kvscope.contexts)
        coords["question"] = ("sample", question_indices(setup.ds))
    return xr.Dataset(data, coords=coords)


def tasks(ds: xr.Dataset) -> list[str]:
    """``[sample]`` each sample's task (``kvscope.model.prompts.task_of`` of its entry in the trace's
    ``prompts``; ``""`` for none): the result's ``task`` coordinate, written with the answers."""
    from ..model.prompts import task_of

    return _of_prompts(ds, task_of, missing="")


def question_indices(ds: xr.Dataset) -> np.ndarray:
    """``[sample]`` each sample's index among its context's questions (``kvscope.model.prompts.question_of``
    of its entry in the trace's ``prompts``; 0 for none): the result's ``question`` coordinate."""
    from ..model.prompts import question_of

    return np.asarray(_of_prompts(ds, question_of, missing=0), dtype=np.int64)


def _of_prompts(ds: xr.Dataset, read, missing) -> list:
    """``[sample]`` ``read(entry)`` of each sample's entry in the trace's ``prompts`` (``missing`` past them)."""
    prompts = ds.attrs.get("prompts") or []
    return [read(prompts[s]) if s < len(prompts) else missing for s in range(ds.sizes["sample"])]


def _forced_variables(setup, f) -> dict:
    """The forced decodes' variables (docs/concepts.md#forced-replay)::

        forced_kl, forced_nll, forced_top1   [*run, sample, step]   per step (NaN where not scored)
        forced_kl_mean                       Σ kl / Σ scored steps, over samples and steps (CI: bootstrap)
        forced_perplexity                    exp(Σ nll / Σ scored steps)  (its CI the exp of nll's)
        forced_agreement                     Σ top1 / Σ scored steps
        forced_rounds, forced_converged      [*run, sample]   forwards of the slowest chunk; fixed point reached
        forced_perplexity_full               [sample]   the continuation's perplexity under full KV

    and where samples carry answers (``kvscope.replay.reader.answered``: their scored steps are the
    gold answer's tokens a_0 … a_{m−1}; docs/concepts.md#task-accuracy) ``_answer_variables`` and::

        answer_exact_full                    [sample]   answer_exact under full KV (the reference)

    with each sample's ``task``, ``context`` (``ds.kvscope.contexts``) and ``question`` (its index among
    its context's questions) as coordinates on ``sample`` (``build``).
    """
    dims_sample = RUN + ("sample",)
    data = {
        "forced_kl": (dims_sample + ("step",), f.kl),
        "forced_nll": (dims_sample + ("step",), f.nll),
        "forced_top1": (dims_sample + ("step",), f.top1),
        "forced_rounds": (dims_sample, f.rounds),
        "forced_converged": (dims_sample, f.converged),
        "forced_perplexity_full": (("sample",), f.perplexity_full),
    }
    for name, values, transform in (("forced_kl", f.kl, None), ("forced_perplexity", f.nll, np.exp),
                                     ("forced_agreement", f.top1, None)):  # fmt: skip
        est = np.full(values.shape[:3] + (3,), np.nan)
        for run in np.ndindex(*values.shape[:3]):
            scored = np.isfinite(values[run])  # [sample, step]
            est[run] = setup.fmm.interval(np.where(scored, values[run], 0).sum(1), scored.sum(1))
        est = transform(est) if transform is not None else est
        key = "forced_kl_mean" if name == "forced_kl" else name
        data[key] = (RUN, est[..., 0])
        data[f"{name}_ci_low"], data[f"{name}_ci_high"] = (RUN, est[..., 1]), (RUN, est[..., 2])
    has_answers = answered(setup.ds)
    if has_answers.any():
        data |= _answer_variables(setup, f, has_answers)
        graded = has_answers & np.isfinite(f.nll).any(axis=(0, 1, 2, 4))  # [sample]
        data["answer_exact_full"] = (("sample",), np.where(graded, f.exact_full, np.nan))
    return data


def _answer_variables(setup, f, has_answers: np.ndarray) -> dict:
    """Task accuracy from the gold answer (docs/concepts.md#task-accuracy): over a sample's scored
    steps ``i = 0 … m−1`` (its answer's tokens; ``has_answers [sample]``)::

        answer_exact       [*run, sample]   Π_i hit_i: 1 iff greedy decoding under the run's cache
                                            emits the gold answer as its first m tokens, else 0
        answer_nll         [*run, sample]   Σ_i nll_i = −log p(a_0 … a_{m−1})
        answer_rank        [*run, sample]   rank_0: tokens with a larger log-probability than a_0
        accuracy           [*run]           Σ answer_exact / #samples with answers (CI: bootstrap
                                            over those samples: ratio of Σ exact to Σ 1)

    NaN for samples without answers or without forced steps.
    """
    scored = np.isfinite(f.nll)  # [*run, sample, step]
    valid = has_answers & scored.any(-1)  # [*run, sample]
    first = scored.argmax(-1)[..., None]
    with np.errstate(invalid="ignore"):
        exact = np.where(valid, (np.where(scored, f.hit, 1) == 1).all(-1), np.nan)
        nll = np.where(valid, np.where(scored, f.nll, 0).sum(-1), np.nan)
        rank = np.where(valid, np.take_along_axis(f.rank, first, -1)[..., 0], np.nan)
    est = np.full(exact.shape[:3] + (3,), np.nan)
    for run in np.ndindex(*exact.shape[:3]):
        est[run] = setup.fmm.interval(np.nan_to_num(exact[run]), np.isfinite(exact[run]).astype(np.float64))
    dims_sample = RUN + ("sample",)
    return {
        "answer_exact": (dims_sample, exact.astype(np.float64)),
        "answer_nll": (dims_sample, nll.astype(np.float64)),
        "answer_rank": (dims_sample, rank.astype(np.float64)),
        "accuracy": (RUN, est[..., 0]),
        "accuracy_ci_low": (RUN, est[..., 1]),
        "accuracy_ci_high": (RUN, est[..., 2]),
    }


def _selection_variables(o: Outputs) -> dict:
    """Churn, LIR and P01/P10 of the FP-set selection from what the runs streamed:

    churn_mean = mean of churn over (sample, event pair, layer, kv_head), NaN past a sample's events
    lir = Σ reactivated / Σ eligible,   p01 = n01 / n0,   p10 = n10 / n1   (sums over samples and units)
    """
    transitions = o.transitions.sum(3)  # [*run, (n0, n01, n1, n10)]
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN churn (one event): NaN mean
        churn_mean = _per_run(o.churn, np.nanmean) if o.churn.size else np.full(o.churn.shape[:3], np.nan)
    per_unit = RUN + ("sample", "layer", "kv_head")
    return {
        "churn": (RUN + ("sample", "event_pair", "layer", "kv_head"), o.churn),
        "churn_mean": (RUN, churn_mean),
        "lir_eligible": (per_unit, o.eligible),
        "lir_reactivated": (per_unit, o.reactivated),
        "lir": (RUN, _ratio(_per_run(o.reactivated, np.sum), _per_run(o.eligible, np.sum))),
        "p01": (RUN, _ratio(transitions[..., 1], transitions[..., 0])),
        "p10": (RUN, _ratio(transitions[..., 3], transitions[..., 2])),
    }


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return np.where(den > 0, num / np.maximum(den, 1), np.nan)


def _mean_ci(values: np.ndarray, setup) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over (event, trace unit) pairs with its bootstrap CI, per run;
    ``values [*run, sample, event, layer, kv_head]`` (NaN = censored)."""
    out = np.full(values.shape[:3] + (3,), np.nan)
    for run in np.ndindex(*values.shape[:3]):
        v = values[run]  # [sample, event, layer, kv_head]
        finite = np.isfinite(v)
        out[run] = setup.fmm.interval(np.where(finite, v, 0).sum(1), finite.sum(1))
    return out[..., 0], out[..., 1], out[..., 2]


def _coords(setup, o: Outputs) -> dict:
    ds, policies = setup.ds, setup.policies
    return {
        "policy": [p.label() for p in policies],
        "policy_name": ("policy", [p.name for p in policies]),
        "policy_kind": ("policy", [p.kind for p in policies]),
        "allocation": [a.label() for a in setup.allocations],
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


def run_attrs(setup, trace, seconds: float) -> dict:
    ds = setup.ds
    return {
        "kind": "kvscope replay",
        "observe": setup.observe,
        "horizon": setup.fmm.horizon,
        "every": setup.every,
        "n_sink": setup.n_sink,
        "w": setup.w,
        "lir_m": setup.lir.m,
        "lir_h": "none" if setup.lir.h_lir is None else setup.lir.h_lir,
        "delta": setup.lir.delta,
        "resample": setup.fmm.resample,
        "ci": ci_attr(setup),
        "trace": str(trace) if isinstance(trace, (str, os.PathLike)) else ds.encoding.get("source", ""),
        "model": ds.attrs.get("model", {}).get("name", ""),
        "policies": json.dumps({p.label(): {"name": p.name, "kind": p.kind, **p.params()} for p in setup.policies}),
        "allocations": json.dumps({a.label(): {"name": a.name, **a.params()} for a in setup.allocations}),
        "kv_itemsize": setup.kv_itemsize,
        "protocol": "question-agnostic" if ds.kvscope.question_agnostic else "question-aware",
        "replay_seconds": round(seconds, 3),
    }


def forced_attrs(forced, seconds: float) -> dict:
    """The ``forced`` attribute of a result with forced decodes: its settings, each policy's loop and
    the seconds the forced decodes took (of ``replay_seconds``)."""
    doc = {**forced.settings, "loops": forced.loops, "served": forced.served, "seconds": round(seconds, 3)}
    return {"forced": json.dumps(doc)}


def press_settings(setup, settings: dict) -> str:
    """JSON ``{policy label: {β: {setting: [value per sample]}}}``: what each press was set to
    so that it holds the budget's bytes (kvscope.policies.press)."""
    out: dict = {}
    for (pi, _ai, bi, s), setting in sorted(settings.items()):
        per_budget = out.setdefault(setup.policies[pi].label(), {}).setdefault(f"{setup.budgets[bi]:g}", {})
        for key, value in setting.items():
            if not isinstance(value, str):  # a note (what rewrote, what sets it): not a number to average
                per_budget.setdefault(key, [None] * setup.n_samples)[s] = value
    return json.dumps(out)


def press_notes(setup, settings: dict) -> str:
    """JSON ``{policy label: note}``: for each press that rewrote what it kept, what its
    position-level metrics (FMM, churn) mean, and why its attn L1 and out err are not given
    (the recording holds the keys and values as computed, not as the press left them)."""
    from ..policies.press import notes

    out = {}
    for (pi, _ai, _bi, _s), setting in sorted(settings.items()):
        if setting.get("rewrites"):
            out[setup.policies[pi].label()] = notes(setting["rewrites"])
    return json.dumps(out)


def tiers_for(result: xr.Dataset, policy: str, budget: float, allocation: str = "uniform") -> xr.DataArray:
    """The replayed tiers of one (policy, allocation, budget) as the analyses take them:
    ``[sample, event, layer, kv_head, pos]`` with ``event_step``, labelled with the policy
    (``FMM()(ds, tiers=tiers_for(result, "h2o", 0.3))``).

    Args:
        result: A replay result.
        policy: The run's policy label.
        budget: The run's β.
        allocation: The run's allocation label.
    """
    tiers = result["tiers"]
    if "allocation" in tiers.dims:
        tiers = tiers.sel(allocation=allocation)
    tiers = tiers.sel(policy=policy, budget=budget).drop_vars(
        ["policy", "allocation", "budget", "policy_name", "policy_kind"], errors="ignore"
    )
    tiers.attrs = {"policy": f"{policy}@{budget}" if allocation == "uniform" else f"{policy}/{allocation}@{budget}"}
    return tiers


def save_result(result: xr.Dataset, path: str | os.PathLike) -> None:
    """Write a replay result as a Zarr v3 store (checksummed chunks), under a temporary name
    renamed into place when complete; an existing path is refused, never overwritten.

    Args:
        result: A replay result.
        path: The new store.
    """
    with written_in_place(path) as partial:
        write_variables(result, partial, mode="w-")
