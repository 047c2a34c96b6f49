"""Offline policy replay (SPEC §5): every policy × budget driven step by step by one trace.

For each sample the trace's rows are read once, block by block, and every (policy, budget)
cache state is driven through the same loop — the memory bound is one block of rows plus
each state's ``[layer, kv_head, pos]`` arrays, whatever the number of steps::

    step 0      state.prefill(colsum, tail)           prompt 0..P−1, compressed to the budget
    step t ≥ 1  state.append(P − 1 + t)               the new key, at full precision
                row_seen = observe(row_t, tiers)        renorm | exact (below)
                state.observe(row_seen); state.compress()
                bytes_used[t] ≤ B                       checked; a policy over its budget raises

``observe="renorm"`` (open loop): the full-KV kv-group row restricted to the accessible
(FP or Q) positions and renormalized. ``observe="exact"`` (needs ``--record qkv``): the row
recomputed from the recorded query with the cache the policy keeps — Q keys dequantized,
evicted keys absent — exactly what a live cache would compute.

Tiers are snapshot at the events ``0, every, 2·every, …`` *after* the policy acted, so the
metrics score the decision against the future:

    tier_mass[e, FP|Q|EVICTED]   share of the full-KV mass of steps t+1..t+H on existing positions
    fmm                          the EVICTED share (the loss no promotion can undo), FMM(H) curve
    fmm_fp                       the share not at full precision
    churn                        Jaccard distance of consecutive FP sets (positions that existed
                                 at the earlier event, sinks excluded)
    lir, p01, p10                Global LIR and lag-δ transitions of the FP-set selection
    attn_l1, output_rel_l2       with q/k/v: for the first query after each event, the L1
                                 distance of its attention distribution to full KV and the
                                 relative L2 error of the attention output (per query head,
                                 averaged over the heads of a KV group)
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass

import numpy as np
import xarray as xr

from .analysis.churn import valid_events
from .analysis.common import bootstrap_ratio, event_steps, selection_codes
from .analysis.fmm import default_horizons
from .analysis.lir import lir_kernel, transition_counts
from .analysis.recompute import attention_params
from .errors import KvscopeError
from .policies import BudgetExceeded, CacheSpec, CacheState, Policy, Rope, parse
from .tiers import TIER_EVICTED, TIER_FP, TIER_Q

OBSERVE_MODES = ("renorm", "exact")
TIERS = ("FP", "Q", "EVICTED")
BYTES_TOLERANCE = 1e-6


def check_budget(budget: float) -> float:
    try:
        value = float(budget)
    except (TypeError, ValueError):
        raise KvscopeError(f"budget must be a number in (0, 1] (got {budget!r})") from None
    if not (0 < value <= 1):
        raise KvscopeError(f"budget must lie in (0, 1] (got {budget})")
    return value


def resolve_policies(policies) -> list[Policy]:
    """Names, ``name:key=value`` strings or policy objects → policy objects (unique labels)."""
    if isinstance(policies, (str, Policy)):
        policies = [policies]
    out = [p if isinstance(p, Policy) else parse(p) for p in policies]
    if not out:
        raise KvscopeError("no policy given")
    labels = [p.label() for p in out]
    if len(set(labels)) != len(labels):
        raise KvscopeError(f"a policy is listed twice: {', '.join(labels)}")
    return out


@dataclass
class _AttentionModel:
    """What exact rows and output errors need: per-layer scaling, softcap, windows."""

    scaling: np.ndarray  # [layer]
    softcap: float | None
    windows: list

    def scores(self, q, keys, qpos):
        """Logits of ``q [L, Hkv, g, D]`` over ``keys [L, Hkv, n, D]`` (torch float32), with
        scaling, softcap and sliding windows applied → ``[L, Hkv, g, n]``."""
        import torch

        scores = torch.matmul(q, keys.transpose(-1, -2)) * torch.from_numpy(self.scaling)[:, None, None, None]
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        for layer, window in enumerate(self.windows):
            if window:
                scores[layer, ..., : max(0, qpos - window + 1)] = -torch.inf
        return scores

    @staticmethod
    def attend(scores, values, present=None):
        """Probabilities ``[L, Hkv, g, n]`` and output ``[L, Hkv, g, D]``; ``present
        [L, Hkv, n]`` (bool tensor) masks absent (evicted) keys."""
        import torch

        if present is not None:
            scores = scores.masked_fill(~present[:, :, None, :], -torch.inf)
        probs = torch.softmax(scores, dim=-1)
        return probs, torch.matmul(probs, values)


class _Sample:
    """One sample's inputs, read lazily block by block."""

    def __init__(self, ds: xr.Dataset, s: int, block: int, hdim: str, group: int):
        self.ds, self.s, self.block, self.hdim, self.group = ds, s, block, hdim, group
        self.prompt_len = int(ds["prompt_len"].values[s])
        self.n_steps = int(ds["n_steps"].values[s])
        self.final_len = self.prompt_len + self.n_steps
        self.query_pos = np.asarray(ds["query_pos"].values[s])
        self._blocks: dict[int, np.ndarray] = {}
        self._q_blocks: dict[int, np.ndarray] = {}

    def _grouped(self, x: np.ndarray, axis: int) -> np.ndarray:
        if self.group == 1:
            return x
        shape = x.shape[:axis] + (x.shape[axis] // self.group, self.group) + x.shape[axis + 1 :]
        return x.reshape(shape).mean(axis + 1)

    def row(self, t: int) -> np.ndarray:
        """Full-KV kv-group row of step ``t`` ``[layer, kv_head, final_len]`` float32 (0 beyond)."""
        b = t // self.block
        if b not in self._blocks:
            for old in [k for k in self._blocks if k < b - 1]:
                del self._blocks[old]
            lo, hi = b * self.block, min((b + 1) * self.block, self.n_steps)
            a = self.ds["attn"].isel(sample=self.s, step=slice(lo, hi), pos=slice(0, self.final_len)).values
            a = np.nan_to_num(a.astype(np.float32), copy=False)  # [step, layer, Hs, pos]
            self._blocks[b] = self._grouped(a, 2)
        return self._blocks[b][t - b * self.block]

    def query(self, t: int) -> np.ndarray:
        """Recorded query of step ``t`` ``[layer, head, D]`` float32."""
        b = t // self.block
        if b not in self._q_blocks:
            self._q_blocks = {}
            lo, hi = b * self.block, min((b + 1) * self.block, self.n_steps)
            qpos = self.query_pos[lo:hi]
            q = self.ds["q"].isel(sample=self.s, qpos=slice(int(qpos[0]), int(qpos[-1]) + 1)).values
            self._q_blocks[b] = q.astype(np.float32)
        return self._q_blocks[b][t - b * self.block]

    def prefill(self):
        p = self.prompt_len
        colsum = self.ds["prefill_colsum"].isel(sample=self.s, pos=slice(0, p)).values
        colsum = self._grouped(np.nan_to_num(colsum.astype(np.float64)), 1)  # [layer, kv_head, P]
        tail = self.ds["prefill_tail"].isel(sample=self.s, pos=slice(0, p)).values
        tail = self._grouped(np.nan_to_num(tail.astype(np.float32)), 1)  # [layer, kv_head, obs, P]
        return colsum, tail

    def kv(self):
        k = self.ds["k"].isel(sample=self.s, pos=slice(0, self.final_len)).values
        v = self.ds["v"].isel(sample=self.s, pos=slice(0, self.final_len)).values
        return np.ascontiguousarray(k), np.ascontiguousarray(v)  # [layer, kv_head, pos, D] as stored


class _Run:
    """One (policy, budget) on one sample: its state and what is recorded of it."""

    def __init__(self, state: CacheState, n_events: int, n_steps_total: int, n_h: int, shape):
        n_layers, n_kv, n_pos = shape
        self.state = state
        self.tiers = np.full((n_events, n_layers, n_kv, n_pos), -1, dtype=np.int8)  # [event, layer, kv_head, pos]
        self.bytes = np.full(n_steps_total, np.nan)  # [step] all layers and kv heads
        self.mass = np.full((n_events, n_layers, n_kv, 3), np.nan)  # [event, layer, kv_head, tier] at H
        self.curve = np.full((2, n_h, n_events, n_layers, n_kv), np.nan)  # [evicted|not-FP, horizon, event, ...]
        self.l1 = np.full((n_events, n_layers, n_kv), np.nan)
        self.out = np.full((n_events, n_layers, n_kv), np.nan)
        self.present: dict[int, tuple] = {}  # event → (any FP, any Q, any EVICTED)


def _tier_shares(future: np.ndarray, den: np.ndarray, tiers: np.ndarray, exists: int, present: tuple):
    """Shares of ``future [L, Hkv, pos]`` (total ``den [L, Hkv]`` over existing positions
    ``< exists``) on FP, Q and EVICTED → 3×[L, Hkv]; ``present`` says which tiers occur
    (absent ones are exactly 0, an all-FP cache exactly 1)."""
    f = future[..., :exists]
    t = tiers[..., :exists]
    has_fp, has_q, has_ev = present
    zero = np.zeros(den.shape)
    q = f.sum(-1, where=t == TIER_Q) if has_q else zero
    ev = f.sum(-1, where=t == TIER_EVICTED) if has_ev else zero
    if not has_fp:
        fp = zero
    elif not (has_q or has_ev):
        fp = den
    else:
        fp = f.sum(-1, where=t == TIER_FP)
    with np.errstate(invalid="ignore", divide="ignore"):
        return [np.where(den > 0, part / den, np.nan) for part in (fp, q, ev)]


def replay(
    trace,
    policies,
    budgets,
    *,
    observe: str = "renorm",
    horizon: int = 32,
    horizons: list[int] | None = None,
    every: int | None = None,
    m: int = 4,
    h_lir: int | None = 8,
    delta: int = 1,
    errors: bool = True,
    validate: bool = False,
    threads: int | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    kv_itemsize: int = 2,
    progress=None,
) -> xr.Dataset:
    """Replay ``policies`` × ``budgets`` against a trace; returns the Dataset described in
    the module docstring, dims ``(policy, budget, sample, event|step, layer, kv_head, pos)``.

    ``trace``: a store path or an opened trace. ``policies``: names, ``name:key=value``
    strings or policy objects. ``budgets``: shares β of ``FP_bytes(P + S)`` in (0, 1].
    ``errors``: attention and output errors when q/k/v are recorded. ``validate``: check
    every policy invariant at every step (tests). ``threads``: cache states advanced in
    parallel within a step (default: up to 2; numpy releases the GIL inside its loops).
    ``kv_itemsize``: bytes per full-precision K/V element in the byte model (2: 16-bit; 4
    compares with a live cache of an fp32 model). ``progress(done, total)`` is called per step.
    """
    from .store import open_trace

    ds = open_trace(trace) if isinstance(trace, (str, os.PathLike)) else trace
    if observe not in OBSERVE_MODES:
        raise KvscopeError(f"observe must be renorm or exact (got {observe!r})")
    if horizon < 1:
        raise KvscopeError(f"horizon must be ≥ 1 (got {horizon})")
    policy_list = resolve_policies(policies)
    if isinstance(budgets, (int, float, str)):
        budgets = [budgets]
    budget_list = [check_budget(b) for b in budgets]
    if not budget_list:
        raise KvscopeError("no budget given")
    if len(set(budget_list)) != len(budget_list):
        raise KvscopeError("a budget is listed twice")
    if ds.attrs.get("resolution", "token") != "token":
        raise KvscopeError("replay needs token-resolution rows; this store holds window sums")
    config = ds.attrs.get("model", {}).get("config", {})
    n_kv = int(config.get("n_kv_heads") or ds.sizes.get("kv_head", 1))
    if "kv_head" in ds["attn"].dims:
        hdim, group = "kv_head", 1
    elif ds.sizes["head"] == int(config.get("n_heads") or 0) and n_kv:
        hdim, group = "head", ds.sizes["head"] // n_kv
    else:
        raise KvscopeError("replay needs per-KV-head rows: trace with --heads kv (default) or --heads all")
    has_qkv = all(name in ds for name in ("q", "k", "v"))
    if observe == "exact" and not has_qkv:
        raise KvscopeError("observe=exact needs recorded q/k/v (trace with --record qkv)")
    with_errors = errors and has_qkv
    head_dim = int(ds.sizes["dim"]) if "dim" in ds.sizes else int(config.get("head_dim") or 64)
    n_sink, w = int(ds.attrs.get("n_sink", 4)), int(ds.attrs.get("w", 8))
    every = every or w
    curve_h = sorted(set(horizons or default_horizons(horizon)) | {horizon})
    n_layers = ds.sizes["layer"]
    n_samples, n_step_total, n_pos = ds.sizes["sample"], ds.sizes["step"], ds.sizes["pos"]
    steps = event_steps(n_step_total, every)
    n_events = len(steps)
    attention = None
    rope = None
    if has_qkv:
        scaling, softcap, windows = attention_params(ds)
        attention = _AttentionModel(np.asarray(scaling, dtype=np.float32), softcap, windows)
        if "rope_inv_freq" in ds:
            rope = Rope(
                np.asarray(ds["rope_inv_freq"].values, np.float64), np.asarray(ds["rope_attention_scaling"].values)
            )

    grid = [(p, b) for p in policy_list for b in budget_list]
    shape_out = (len(policy_list), len(budget_list), n_samples)
    tiers_out = np.full(shape_out + (n_events, n_layers, n_kv, n_pos), -1, dtype=np.int8)
    bytes_out = np.full(shape_out + (n_step_total,), np.nan)
    mass_out = np.full(shape_out + (n_events, n_layers, n_kv, 3), np.nan)
    curve_out = np.full((2,) + shape_out + (len(curve_h), n_events, n_layers, n_kv), np.nan)
    l1_out = np.full(shape_out + (n_events, n_layers, n_kv), np.nan)
    err_out = np.full(shape_out + (n_events, n_layers, n_kv), np.nan)
    reached = np.ones(shape_out, dtype=bool)
    budget_bytes = np.zeros((len(budget_list), n_samples))
    full_bytes = np.zeros(n_samples)
    quantized = np.zeros(shape_out, dtype=np.int64)
    total_steps = int(np.asarray(ds["n_steps"].values).sum())
    threads = threads if threads is not None else min(2, os.cpu_count() or 1)
    pool = None
    if threads > 1 and len(policy_list) * len(budget_list) > 1:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(threads, thread_name_prefix="kvscope-replay")
    done_steps = 0
    started = time.perf_counter()

    for s in range(n_samples):
        sample = _Sample(ds, s, int(ds.attrs.get("block_steps", 32)), hdim, group)
        if sample.n_steps < 1:
            continue
        final_len = sample.final_len
        colsum, tail = sample.prefill()
        k = v = k32 = v32 = buffers = None
        if has_qkv:
            import torch

            k, v = sample.kv()  # [layer, kv_head, pos, D] as recorded (fp16 by default)
            k32, v32 = torch.from_numpy(k).float(), torch.from_numpy(v).float()
            buffers = (torch.empty(k32.shape), torch.empty(v32.shape))
        runs: list[_Run] = []
        for policy, budget in grid:
            spec = CacheSpec(n_layers, n_kv, head_dim, sample.prompt_len, final_len, budget, n_sink, w, kv_itemsize)
            values_needed = policy.quantizes and (with_errors or observe == "exact")
            kk, vv = (k, v) if values_needed else (None, None)
            state = policy.start(spec, kk, vv, rope)
            runs.append(_Run(state, n_events, n_step_total, len(curve_h), (n_layers, n_kv, n_pos)))
        for bi, budget in enumerate(budget_list):
            budget_bytes[bi, s] = runs[bi].state.spec.capacity * n_layers * n_kv  # the same for every policy
        full_bytes[s] = runs[0].state.spec.fp_bytes * final_len * n_layers * n_kv

        oracle_h = sorted({r.state.policy.horizon for r in runs if r.state.policy.clairvoyant})
        futures = {h: _Future(sample, h) for h in oracle_h}
        cum = np.zeros((n_layers, n_kv, final_len), dtype=np.float64)  # Σ_{t'≤t} row[t']
        pending: list[tuple[int, int, np.ndarray]] = []  # (event index, its step, cum at that step)
        event_index = {int(st): i for i, st in enumerate(steps) if st < sample.n_steps}
        error_steps = {int(st) + 1: i for i, st in enumerate(steps) if st + 1 < sample.n_steps}

        for t in range(sample.n_steps):
            row = sample.row(t)  # [layer, kv_head, final_len]
            cum += row
            qpos = int(sample.query_pos[t])
            ahead = {h: f.at(t) for h, f in futures.items()}  # only the oracle may look ahead
            if t == 0:
                for run in runs:
                    if run.state.policy.clairvoyant:
                        run.state.observe_future(ahead[run.state.policy.horizon])
                    run.state.prefill(colsum, tail)
                exact_rows = {}
            else:
                error_due = with_errors and t in error_steps
                need_q = error_due or (observe == "exact" and any(r.state.policy.observes for r in runs))
                query = sample.query(t) if need_q else None
                reference = _reference(attention, query, k32, v32, qpos, n_kv) if need_q else None
                exact_rows = {}
                for i, run in enumerate(runs):
                    st = run.state
                    st.append(qpos)
                    if error_due or (observe == "exact" and st.policy.observes):
                        exact_rows[i], l1, out_err = _against_full(
                            attention, query, k32, v32, st, qpos, reference, n_kv, buffers
                        )
                        if error_due:
                            run.l1[error_steps[t]] = l1
                            run.out[error_steps[t]] = out_err

            resolved = []  # events whose horizon h ends at this step: (event, curve index, future, den, exists)
            for e, te, cum_e in pending:
                if t - te in curve_h:
                    future = cum - cum_e
                    exists = int(sample.query_pos[te]) + 1
                    resolved.append((e, curve_h.index(t - te), t - te, future, future[..., :exists].sum(-1), exists))
            event = event_index.get(t)

            def advance(
                i: int, run: _Run, t=t, row=row, exact_rows=exact_rows, ahead=ahead, resolved=resolved, event=event
            ):
                st = run.state
                if t > 0:
                    if st.policy.observes:
                        seen = (
                            exact_rows[i]
                            if observe == "exact"
                            else _renormalized(row[..., : st.length], st.accessible())
                        )
                        st.observe(seen)
                    if st.policy.clairvoyant:
                        st.observe_future(ahead[st.policy.horizon])
                    st.compress()
                used = st.bytes_used()  # [layer, kv_head]
                if st.reached and (used > st.spec.capacity * (1 + BYTES_TOLERANCE)).any():
                    raise BudgetExceeded(
                        f"{st.policy.label()} used {used.max():.0f} bytes per (layer, kv_head) at step {t} "
                        f"of sample {s}, over its budget {st.spec.capacity:.0f} (β = {st.spec.budget})"
                    )
                run.bytes[t] = used.sum()
                if validate or event is not None:
                    st.check()
                if event is not None:
                    run.tiers[event, ..., :final_len] = st.tiers
                    now = st.tiers[..., : st.length]
                    run.present[event] = tuple(bool((now == tier).any()) for tier in (TIER_FP, TIER_Q, TIER_EVICTED))
                for e, hi, h, future, den, exists in resolved:
                    fp, qq, ev = _tier_shares(future, den, run.tiers[e], exists, run.present[e])
                    run.curve[0, hi, e] = ev
                    run.curve[1, hi, e] = qq + ev
                    if h == horizon:
                        run.mass[e] = np.stack([fp, qq, ev], -1)

            if pool is None:
                for i, run in enumerate(runs):
                    advance(i, run)
            else:
                for done in [pool.submit(advance, i, run) for i, run in enumerate(runs)]:
                    done.result()
            if event is not None:
                pending.append((event, t, cum.copy()))
            pending = [p for p in pending if t - p[1] < curve_h[-1]]
            done_steps += 1
            if progress is not None:
                progress(done_steps, total_steps)

        for gi, run in enumerate(runs):
            pi, bi = divmod(gi, len(budget_list))
            tiers_out[pi, bi, s] = run.tiers
            bytes_out[pi, bi, s] = run.bytes
            mass_out[pi, bi, s] = run.mass
            curve_out[:, pi, bi, s] = run.curve
            l1_out[pi, bi, s] = run.l1
            err_out[pi, bi, s] = run.out
            reached[pi, bi, s] = run.state.reached
            quantized[pi, bi, s] = run.state.ledger.n_quantized if run.state.ledger is not None else 0

    if pool is not None:
        pool.shutdown()
    n_valid = valid_events(steps, np.asarray(ds["n_steps"].values))  # [sample]
    result = _dataset(
        ds,
        policy_list,
        budget_list,
        steps,
        curve_h,
        horizon,
        tiers_out,
        bytes_out,
        mass_out,
        curve_out,
        l1_out if with_errors else None,
        err_out if with_errors else None,
        reached,
        budget_bytes,
        full_bytes,
        quantized,
        n_valid,
        n_sink,
        m,
        h_lir,
        delta,
        n_boot,
        seed,
    )
    result.attrs.update(
        {
            "kind": "kvscope replay",
            "observe": observe,
            "horizon": horizon,
            "every": every,
            "n_sink": n_sink,
            "w": w,
            "lir_m": m,
            "lir_h": "none" if h_lir is None else h_lir,
            "delta": delta,
            "trace": str(trace) if isinstance(trace, (str, os.PathLike)) else ds.encoding.get("source", ""),
            "model": ds.attrs.get("model", {}).get("name", ""),
            "policies": json.dumps({p.label(): {"name": p.name, "kind": p.kind, **p.params()} for p in policy_list}),
            "kv_itemsize": kv_itemsize,
            "replay_seconds": round(time.perf_counter() - started, 3),
        }
    )
    return result


class _Future:
    """Full-KV attention over the next ``h`` steps per position — only the oracle may ask:
    ``at(t) = Σ_{t'=t+1}^{min(t+h, S−1)} row[t']``, kept as a sliding sum."""

    def __init__(self, sample: _Sample, h: int):
        self.sample, self.h, self.t = sample, h, -1
        self.total = None

    def at(self, t: int) -> np.ndarray:
        n = self.sample.n_steps
        if t == self.t:
            return self.total
        if self.total is None or t != self.t + 1:
            self.total = np.zeros(self.sample.row(0).shape, dtype=np.float64)
            for tt in range(t + 1, min(t + self.h, n - 1) + 1):
                self.total += self.sample.row(tt)
        else:
            self.total -= self.sample.row(t)
            if t + self.h <= n - 1:
                self.total += self.sample.row(t + self.h)
        self.t = t
        return self.total


def _renormalized(row: np.ndarray, accessible: np.ndarray) -> np.ndarray:
    """``row`` restricted to ``accessible`` and renormalized to sum 1 per (layer, kv_head)."""
    seen = np.where(accessible, row, 0.0)
    total = seen.sum(-1, keepdims=True)
    return np.divide(seen, total, out=np.zeros_like(seen), where=total > 0)


def _reference(attention: _AttentionModel, query, k, v, qpos, n_kv):
    """Full-KV attention of one query (torch): ``(scores, probs, output)`` with logits and
    probabilities ``[L, Hkv, g, n]`` and output ``[L, Hkv, g, D]``."""
    import torch

    n = qpos + 1
    q = torch.from_numpy(query.reshape(query.shape[0], n_kv, -1, query.shape[-1]))
    scores = attention.scores(q, k[:, :, :n], qpos)
    return (scores, *attention.attend(scores, v[:, :, :n]))


def effective_kv(state: CacheState, k, v, n: int):
    """The cache a state serves over positions ``0..n−1``: ``keys, values [L, Hkv, n, D]``
    and ``present [L, Hkv, n]``. Positions that were ever quantized hold their dequantized
    values (in Q, and after a promotion: the originals are gone); evicted ones are absent.
    ``k``/``v`` are the full-KV values (numpy or torch), returned where nothing was quantized."""
    ledger = state.ledger
    present = state.tiers[..., :n] >= TIER_Q
    if ledger is not None and ledger.k_eff is not None and ledger.n_quantized:
        return ledger.k_eff[:, :, :n], ledger.v_eff[:, :, :n], present
    return k[:, :, :n], v[:, :, :n], present


def _against_full(attention, query, k, v, state: CacheState, qpos, reference, n_kv, buffers=None):
    """Attention with the state's cache (:func:`effective_kv`): its kv-group row
    ``[L, Hkv, n]``, the L1 distance to full KV and the output's relative L2 error, both
    ``[L, Hkv]`` (means over the query heads of each group). ``k``/``v``: torch float32;
    ``buffers``: two float32 tensors shaped like them to convert dequantized values into.
    A cache that only evicts reuses the full-KV logits; one that lost nothing is exact."""
    import torch

    n = qpos + 1
    ref_scores, ref_probs, ref_out = reference
    tiers = state.tiers[..., :n]
    if (tiers == TIER_FP).all() and (state.ledger is None or not state.ledger.done[..., :n].any()):
        zeros = np.zeros(tiers.shape[:2])
        return ref_probs.mean(2).numpy(), zeros, zeros
    keys, values, present = effective_kv(state, k, v, n)
    if isinstance(keys, np.ndarray):  # quantized values: the logits change too
        q = torch.from_numpy(query.reshape(query.shape[0], n_kv, -1, query.shape[-1]))
        if buffers is None:
            buffers = (torch.empty(k.shape), torch.empty(v.shape))
        keys = buffers[0][:, :, :n].copy_(torch.from_numpy(keys))  # reused memory: no page faults
        values = buffers[1][:, :, :n].copy_(torch.from_numpy(values))
        scores = attention.scores(q, keys, qpos)
    else:
        scores = ref_scores
    probs, out = attention.attend(scores, values, torch.from_numpy(present))
    l1 = (probs - ref_probs).abs().sum(-1).mean(-1)
    norm = torch.linalg.vector_norm(ref_out, dim=-1)
    rel = torch.where(norm > 0, torch.linalg.vector_norm(out - ref_out, dim=-1) / norm, torch.nan).mean(-1)
    return probs.mean(2).numpy(), l1.numpy(), rel.numpy()


def _fp_churn(tiers: np.ndarray, exists: np.ndarray, n_sink: int, n_valid: int) -> np.ndarray:
    """``[event−1, layer, kv_head]`` Jaccard distance of consecutive FP sets over positions that
    existed at the earlier event (sinks excluded); NaN past the sample's events."""
    n_events = tiers.shape[0]
    out = np.full((max(0, n_events - 1),) + tiers.shape[1:3], np.nan)
    for e in range(min(n_events, n_valid) - 1):
        mask = np.zeros(tiers.shape[-1], dtype=bool)
        mask[n_sink : exists[e]] = True
        a = (tiers[e] == TIER_FP) & mask
        b = (tiers[e + 1] == TIER_FP) & mask
        union = (a | b).sum(-1)
        inter = (a & b).sum(-1)
        out[e] = np.where(union > 0, 1.0 - inter / np.maximum(union, 1), 0.0)
    return out


def _dataset(
    ds, policy_list, budget_list, steps, curve_h, horizon, tiers, bytes_used, mass, curve, l1, out_err, reached,
    budget_bytes, full_bytes, quantized, n_valid, n_sink, m, h_lir, delta, n_boot, seed,
) -> xr.Dataset:  # fmt: skip
    n_p, n_b, n_s = tiers.shape[:3]
    labels = [p.label() for p in policy_list]
    query_pos = np.asarray(ds["query_pos"].values)
    n_events = len(steps)
    churn = np.full((n_p, n_b, n_s, max(0, n_events - 1)) + tiers.shape[4:6], np.nan)
    eligible = np.zeros((n_p, n_b, n_s) + tiers.shape[4:6], dtype=np.int64)
    reactivated = np.zeros_like(eligible)
    transitions = np.zeros((n_p, n_b, 4), dtype=np.int64)
    for pi in range(n_p):
        for bi in range(n_b):
            for s in range(n_s):
                nv = int(n_valid[s])
                exists = np.where(
                    steps < query_pos.shape[1], query_pos[s, np.minimum(steps, query_pos.shape[1] - 1)] + 1, 0
                )
                churn[pi, bi, s] = np.moveaxis(_fp_churn(tiers[pi, bi, s], exists, n_sink, nv), 0, 0)
                # FP-set selection, sinks not candidates: [layer, kv_head, event, pos]
                sel = np.moveaxis(selection_codes(tiers[pi, bi, s], accessible=False, n_sink=n_sink), 0, 2)
                el, re = lir_kernel(sel, nv, m, h_lir)
                eligible[pi, bi, s], reactivated[pi, bi, s] = el, re
                if n_events > delta:
                    transitions[pi, bi] += transition_counts(sel, nv, delta).reshape(-1, 4).sum(0)

    dims_event = ("policy", "budget", "sample", "event", "layer", "kv_head")
    fmm = mass[..., 2]
    fmm_fp = mass[..., 1] + mass[..., 2]
    summary = {}
    for name, values in (("fmm", fmm), ("fmm_fp", fmm_fp)):
        est = np.full((n_p, n_b, 3), np.nan)
        for pi in range(n_p):
            for bi in range(n_b):
                v = values[pi, bi]  # [sample, event, layer, kv_head]
                finite = np.isfinite(v)
                est[pi, bi] = bootstrap_ratio(np.where(finite, v, 0).sum(1), finite.sum(1), n_boot=n_boot, seed=seed)
        summary[name] = est
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-censored events: NaN means, said so by n_events
        curve_mean = np.nanmean(curve.reshape(curve.shape[:3] + (len(curve_h), -1)), axis=-1) if curve.size else curve
        tier_mean = np.nanmean(np.moveaxis(mass, -1, 2).reshape(n_p, n_b, 3, -1), axis=-1)
        churn_mean = np.nanmean(churn.reshape(n_p, n_b, -1), axis=-1) if churn.size else np.full((n_p, n_b), np.nan)
        el_sum, re_sum = eligible.sum((2, 3, 4)), reactivated.sum((2, 3, 4))
        lir = np.where(el_sum > 0, re_sum / np.maximum(el_sum, 1), np.nan)
        p01 = np.where(transitions[..., 0] > 0, transitions[..., 1] / np.maximum(transitions[..., 0], 1), np.nan)
        p10 = np.where(transitions[..., 2] > 0, transitions[..., 3] / np.maximum(transitions[..., 2], 1), np.nan)
        ratio = np.nanmax(bytes_used, axis=-1) / full_bytes[None, None, :]
    data = {
        "tiers": (dims_event + ("pos",), tiers),
        "tier_mass": (dims_event + ("tier",), mass),
        "tier_mean": (("policy", "budget", "tier"), tier_mean),
        "fmm": (dims_event, fmm),
        "fmm_fp": (dims_event, fmm_fp),
        "fmm_mean": (("policy", "budget"), summary["fmm"][..., 0]),
        "fmm_ci_low": (("policy", "budget"), summary["fmm"][..., 1]),
        "fmm_ci_high": (("policy", "budget"), summary["fmm"][..., 2]),
        "fmm_fp_mean": (("policy", "budget"), summary["fmm_fp"][..., 0]),
        "fmm_fp_ci_low": (("policy", "budget"), summary["fmm_fp"][..., 1]),
        "fmm_fp_ci_high": (("policy", "budget"), summary["fmm_fp"][..., 2]),
        "fmm_curve": (("policy", "budget", "horizon"), curve_mean[0]),
        "fmm_fp_curve": (("policy", "budget", "horizon"), curve_mean[1]),
        "churn": (("policy", "budget", "sample", "event_pair", "layer", "kv_head"), churn),
        "churn_mean": (("policy", "budget"), churn_mean),
        "lir_eligible": (("policy", "budget", "sample", "layer", "kv_head"), eligible),
        "lir_reactivated": (("policy", "budget", "sample", "layer", "kv_head"), reactivated),
        "lir": (("policy", "budget"), lir),
        "p01": (("policy", "budget"), p01),
        "p10": (("policy", "budget"), p10),
        "bytes_used": (("policy", "budget", "sample", "step"), bytes_used),
        "budget_bytes": (("budget", "sample"), budget_bytes),
        "full_bytes": (("sample",), full_bytes),
        "byte_ratio": (("policy", "budget", "sample"), ratio),
        "byte_ratio_used": (("policy", "budget"), np.nanmax(ratio, axis=-1)),
        "budget_reached": (("policy", "budget"), reached.all(-1)),
        "n_quantized": (("policy", "budget", "sample"), quantized),
    }
    if l1 is not None:
        with np.errstate(invalid="ignore"):
            data["attn_l1"] = (dims_event, l1)
            data["output_rel_l2"] = (dims_event, out_err)
            data["attn_l1_mean"] = (("policy", "budget"), np.nanmean(l1.reshape(n_p, n_b, -1), -1))
            data["output_rel_l2_mean"] = (("policy", "budget"), np.nanmean(out_err.reshape(n_p, n_b, -1), -1))
    coords = {
        "policy": labels,
        "policy_name": ("policy", [p.name for p in policy_list]),
        "policy_kind": ("policy", [p.kind for p in policy_list]),
        "budget": budget_list,
        "sample": ds["sample"].values,
        "event": np.arange(n_events),
        "event_step": ("event", steps),
        "event_pair": np.arange(1, n_events),
        "layer": ds["layer"].values,
        "kv_head": np.arange(tiers.shape[5]),
        "pos": np.arange(tiers.shape[6]),
        "step": np.arange(bytes_used.shape[-1]),
        "horizon": curve_h,
        "tier": list(TIERS),
    }
    return xr.Dataset(data, coords=coords)


def tiers_for(result: xr.Dataset, policy: str, budget: float) -> xr.DataArray:
    """The replayed tiers of one (policy, budget) as the analyses take them:
    ``[sample, event, layer, kv_head, pos]`` with ``event_step``, labelled with the policy."""
    tiers = (
        result["tiers"]
        .sel(policy=policy, budget=budget)
        .drop_vars(["policy", "budget", "policy_name", "policy_kind"], errors="ignore")
    )
    tiers.attrs = {"policy": f"{policy}@{budget}"}
    return tiers


def open_result(path) -> xr.Dataset:
    """A replay result written with ``--out`` (refused with one line when it is not one)."""
    if not os.path.exists(path):
        raise KvscopeError(f"no replay result at {path}")
    try:
        result = xr.open_zarr(str(path), consolidated=None)
    except Exception as exc:  # noqa: BLE001
        raise KvscopeError(f"cannot open {path} as a replay result: {str(exc).splitlines()[0]}") from exc
    if result.attrs.get("kind") != "kvscope replay":
        raise KvscopeError(f"{path} is not a kvscope replay result")
    return result


def save_result(result: xr.Dataset, path) -> None:
    """Write a replay result as a Zarr v3 store; an existing path is refused, never overwritten."""
    if os.path.exists(path):
        raise KvscopeError(f"{path} exists; choose another --out (results are never overwritten)")
    result.to_zarr(str(path), mode="w-", zarr_format=3, consolidated=True)


def _num(x) -> float | None:
    x = float(x)
    return None if np.isnan(x) else round(x, 6)


def comparison(result: xr.Dataset) -> list[dict]:
    """The policy × budget table of a replay result, one dict per (policy, budget)."""
    rows = []
    has_err = "attn_l1_mean" in result
    for policy in result["policy"].values:
        for budget in result["budget"].values:
            r = result.sel(policy=policy, budget=budget)
            tier = dict(zip(TIERS, (float(x) for x in r["tier_mean"].values)))
            rows.append(
                {
                    "policy": str(policy),
                    "kind": str(r["policy_kind"].values),
                    "budget": float(budget),
                    "byte_ratio": _num(r["byte_ratio_used"]),
                    "budget_reached": bool(r["budget_reached"]),
                    "fmm": _num(r["fmm_mean"]),
                    "fmm_ci95": [_num(r["fmm_ci_low"]), _num(r["fmm_ci_high"])],
                    "fmm_fp": _num(r["fmm_fp_mean"]),
                    "evicted_mass": _num(tier["EVICTED"]),
                    "q_mass": _num(tier["Q"]),
                    "attn_l1": _num(r["attn_l1_mean"]) if has_err else None,
                    "output_rel_l2": _num(r["output_rel_l2_mean"]) if has_err else None,
                    "churn": _num(r["churn_mean"]),
                    "lir": _num(r["lir"]),
                }
            )
    return rows


def comparison_doc(result: xr.Dataset) -> dict:
    """JSON document of :func:`comparison` with the replay's settings."""
    attrs = {k: v for k, v in result.attrs.items() if k != "policies"}
    return {**attrs, "policies": json.loads(result.attrs.get("policies", "{}")), "rows": comparison(result)}


def print_comparison(result: xr.Dataset, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(x, digits=3):
        return "—" if x is None else f"{x:.{digits}f}"

    h = result.attrs.get("horizon", 32)
    table = Table(
        "policy",
        "β",
        "bytes used",
        f"FMM@{h} [95% CI]",
        "FMM fp",
        "Q mass",
        "attn L1",
        "out err",
        "churn",
        "LIR",
        title=title,
    )
    for row in comparison(result):
        used = fmt(row["byte_ratio"]) + ("" if row["budget_reached"] else " (floor)")
        ci = row["fmm_ci95"]
        fmm = f"{fmt(row['fmm'])} [{fmt(ci[0])}, {fmt(ci[1])}]"
        table.add_row(
            row["policy"],
            f"{row['budget']:g}",
            used,
            fmm,
            fmt(row["fmm_fp"]),
            fmt(row["q_mass"]),
            fmt(row["attn_l1"]),
            fmt(row["output_rel_l2"]),
            fmt(row["churn"]),
            fmt(row["lir"]),
        )
    console = Console(width=max(120, Console().width))
    console.print(table)
    console.print(
        "bytes used: peak share of the full cache at the final length; (floor): the policy cannot fit β and "
        "reports what it used. FMM: future mass on evicted positions; FMM fp: not at full precision."
    )
