"""One sample replayed: every (policy, budget) run driven through the same steps.

Per step ``t`` (the loop of [`kvscope.replay`][kvscope.replay]):

    t = 0    driver.prefill(colsum, tail)            every run, from the trace's prompt attention
    t ≥ 1    driver.append(P − 1 + t)                the new key at full precision (every run)
             errors after an event                   against full KV; the runs that only evicted
                                                     together (output_error.evicted_errors)
             seen = renormalized row | exact row     what the cache serves (observe=renorm | exact)
             driver.decide(seen)                     observe, compress, budget checked
    events   tiers snapshot, streamed to the result store; churn and LIR advanced; tier shares
             of the future mass resolved as each horizon ends (then the snapshot is dropped)
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..analysis.fmm import FutureMassStream, tier_shares
from ..policies import CacheSpec
from ..policies.allocation import AdaKV, Given, Pyramid
from ..policies.driver import PolicyDriver
from ..tiers import TIER_EVICTED, TIER_FP, TIER_Q
from .output_error import against_full, evicted_errors, only_evicted, reference, renormalized
from .reader import SampleReader
from .result import Outputs, RunRecord


class Run:
    """One (policy, budget) on one sample: its driver, its record, and the snapshots of the
    events whose FMM horizons have not all ended yet (the only tiers a run keeps)."""

    def __init__(self, driver: PolicyDriver, record: RunRecord, last_horizon: int):
        self.driver, self.record, self.last_horizon = driver, record, last_horizon
        self.pending: dict[int, tuple[np.ndarray, tuple[bool, bool, bool]]] = {}  # event → (tiers, present)

    @property
    def state(self):
        return self.driver.state

    def snapshot(self, event: int) -> None:
        st = self.state
        tiers = st.tiers.copy()  # [layer, kv_head, pos]
        now = tiers[..., : st.length]
        present = tuple(bool((now == tier).any()) for tier in (TIER_FP, TIER_Q, TIER_EVICTED))  # any FP, Q, EVICTED
        self.pending[event] = tiers, present
        self.record.snapshot(event, tiers)

    def resolve(self, resolved, horizon: int) -> None:
        """Tier shares of events whose horizon just ended (FMM: the EVICTED share); an event's
        snapshot is dropped once its last horizon has ended (censored ones when the run ends)."""
        for r in resolved:
            tiers, present = self.pending[r.event]
            fp, q, ev = tier_shares(r.future, r.den, tiers, r.exists, present=present, fp=r.horizon == horizon)
            self.record.curve[0, r.index, r.event] = ev
            self.record.curve[1, r.index, r.event] = q + ev
            if r.horizon == horizon:
                self.record.mass[r.event] = np.stack([fp, q, ev], -1)
            if r.horizon == self.last_horizon:
                del self.pending[r.event]

    def finish(self) -> None:
        self.record.finish(self.state)
        self.pending.clear()


@dataclass
class StepInputs:
    """What every run's step ``t`` reads, all of it from the trace alone (so that step ``t + 1``'s
    is prepared while the runs take step ``t``): the tier-share events that resolve now, the
    event decided at ``t`` and the one whose errors ``t`` measures (or None), the full-KV
    reference of the step's query where a run compares with it, the oracle's look-ahead sums."""

    t: int
    resolved: list
    event: int | None
    error_event: int | None
    ref: object  # Reference | None
    ahead: dict
    compared: set = field(default_factory=set)  # id() of the runs whose errors this step are recorded already


def _step(advance, run: Run, inputs: StepInputs, horizon: int) -> None:
    """One run's step (a pool task): its comparison with full KV where one is due, the
    decision, then the tier shares that resolve now."""
    advance(run, inputs)
    run.resolve(inputs.resolved, horizon)


class SampleReplay:
    """Sample ``s`` of ``setup`` (a [`kvscope.replay.ReplaySetup`][kvscope.replay.ReplaySetup]) under every run of the
    grid, recorded into ``outputs``."""

    def __init__(self, setup, s: int, outputs: Outputs | None, splits: dict | None = None):
        self.setup, self.s, self.outputs = setup, s, outputs
        self.splits = splits or {}  # (policy, allocation, budget) → the oracle's split [layer, kv_head] bytes
        self.reader = SampleReader(setup.ds, s, setup.group)
        r = self.reader
        self.colsum, self.tail = r.prefill()
        on_model = [p for p in setup.policies if p.label() in setup.model_presses]
        self.capture = None  # the sample's prefill on the trace's model (presses that need it)
        if on_model:
            from .presses import capture

            index = int(setup.ds["sample"].values[s]) if "sample" in setup.ds.coords else s
            self.capture = capture(setup, s, index)
        presses = any(policy.reads_queries and policy not in on_model for policy in setup.policies)
        self.kv = self.kv32 = self.queries = None
        if presses:
            self.queries = r.queries()  # [pos, layer, head, D] (kvpress presses)
        if setup.has_qkv:
            self.kv = r.kv()  # [layer, kv_head, pos, D] as recorded (fp16 by default)
        if setup.has_qkv and presses:  # the float32 K/V every press of this sample shares
            import torch

            self.kv32 = tuple(torch.from_numpy(x).float() for x in self.kv)
        self.runs: list[Run] = []

    def spec(self, budget: float) -> CacheSpec:
        return self.setup.spec(self.s, budget)

    def _start(self, gi: int, policy, allocation, budget) -> Run:
        allocation = allocation.for_sample(self.s)
        st = self.setup
        values_needed = policy.quantizes and (st.with_errors or st.observe == "exact")
        k, v = self.kv if values_needed else (None, None)
        recorded = {}
        if policy.label() in st.model_presses:  # a press on the trace's model: its prefill, captured once
            k, v, recorded = None, None, {"model": st.ds.kvscope.model, "capture": self.capture}
        elif policy.reads_queries:  # presses: the float32 K/V every run of this sample shares
            (k, v), recorded = self.kv32, {"q": self.queries, "model": st.ds.kvscope.model}
        state = policy.start(self.spec(budget), k, v, st.rope, **recorded)
        pi, rest = divmod(gi, len(st.allocations) * len(st.budgets))
        ai, bi = divmod(rest, len(st.budgets))
        record = self.outputs.record(pi, ai, bi, self.s, shape=state.tiers.shape)
        if allocation.clairvoyant:  # the oracle's split, decided over every unit of the sample (replay.tasks)
            allocation = Given.of(self.splits[pi, ai, bi])  # a task of some layers: checked per unit (driver)
        driver = PolicyDriver(state, allocation=allocation, where=f" of sample {self.s}")
        return Run(driver, record, st.horizons[-1])

    def oracle_probes(self, policy, oracle, budget) -> tuple[np.ndarray, np.ndarray]:
        """``(capacities, loss) [candidate, layer, kv_head]`` for the oracle allocation: the
        policy replayed on this sample with every unit at each candidate capacity
        ([`candidates`][kvscope.policies.allocation.Oracle.candidates]: levels of the room above its
        floor, and the splits of uniform, pyramid, adakv and the replay's other allocations),
        and each unit's loss there — its FMM, FMM fp or output error summed over the events. A unit's
        decisions depend only on its own capacity, so these are the losses of any split."""
        from dataclasses import replace

        spec = self.spec(budget)
        floor = policy.unit_floor(spec)
        others = {a.label(): a for a in [*self.setup.allocations, Pyramid(), AdaKV()]}
        scores = policy.allocation_scores(self.colsum, self.tail)
        splits = [
            a.split(spec, floor, scores=scores if a.reads == "scores" else None)
            for a in others.values()
            if not a.clairvoyant and not a.uniform
        ]
        capacities = oracle.candidates(spec, floor, splits)
        measure = oracle.objective(policy)
        probe = replace(
            self.setup, policies=[policy], allocations=[Given.of(c, whole=False) for c in capacities], budgets=[budget],
            with_errors=measure == "output", validate=False,
        )  # fmt: skip
        outputs = Outputs.allocate(probe, None)
        SampleReplay(probe, self.s, outputs).run(None, None)
        mass = outputs.mass[0, :, 0, self.s]  # [candidate, event, layer, kv_head, tier]
        lost = {
            "fmm": lambda: mass[..., 2],
            "fmm_fp": lambda: mass[..., 1] + mass[..., 2],
            "output": lambda: outputs.out[0, :, 0, self.s],  # [candidate, event, layer, kv_head]
        }[measure]()
        return capacities, np.nansum(lost, axis=1)

    def run(self, pool: ThreadPoolExecutor | None, progress) -> None:
        setup, r = self.setup, self.reader
        grid = [(gi, *run) for gi, run in enumerate(setup.grid)]
        self.runs = list(pool.map(self._start, *zip(*grid))) if pool is not None else [self._start(*g) for g in grid]
        for bi, budget in enumerate(setup.budgets):
            self.outputs.budget_bytes[bi, self.s] = self.spec(budget).total_capacity
        self.outputs.full_bytes[self.s] = self.spec(1.0).full_bytes
        horizons = sorted({run.state.policy.horizon for run in self.runs if run.state.policy.clairvoyant})
        self.futures = {h: r.future(h) for h in horizons}  # only the oracle may look ahead
        self.stream = FutureMassStream(setup.horizons, (setup.n_layers, setup.n_kv, r.final_len))
        self.event_of = {int(t): e for e, t in enumerate(setup.steps) if t < r.n_steps}
        self.error_at = {int(t) + 1: e for e, t in enumerate(setup.steps) if t + 1 < r.n_steps}
        horizon = setup.fmm.horizon
        inputs = self._inputs(0)
        for t in range(r.n_steps):
            if t > 0:
                self._appended(inputs)
            steps = [(self._advance, run, inputs, horizon) for run in self.runs]
            last = t + 1 == r.n_steps
            if pool is None:
                for args in steps:
                    _step(*args)
                inputs = None if last else self._inputs(t + 1)
            else:  # step t + 1's inputs prepared beside step t's runs (submitted first: started first)
                upcoming = None if last else pool.submit(self._inputs, t + 1)
                for done in [pool.submit(_step, *args) for args in steps]:
                    done.result()
                inputs = None if last else upcoming.result()
            if progress is not None:
                progress()
        for run in self.runs:
            run.finish()

    def _inputs(self, t: int) -> StepInputs:
        """Step ``t``'s ``StepInputs``; the future-mass stream advances here (and only here)."""
        r = self.reader
        resolved = self.stream.add(t, r.row(t))
        event = self.event_of.get(t)
        if event is not None:
            self.stream.decided(event, t, int(r.query_pos[t]) + 1)
        error_event = self.error_at.get(t)
        ref = self._reference(t, error_event) if t > 0 else None
        ahead = {h: f.at(t) for h, f in self.futures.items()}
        return StepInputs(t, resolved, event, error_event, ref=ref, ahead=ahead)

    def _advance(self, run: Run, inputs: StepInputs) -> None:
        setup, driver, t = self.setup, run.driver, inputs.t
        check = setup.validate or inputs.event is not None
        policy = driver.policy
        future = inputs.ahead.get(getattr(policy, "horizon", None)) if policy.clairvoyant else None
        if t == 0:
            used = driver.prefill(self.colsum, self.tail, future, check=check)
        else:
            due = self._compares(run, inputs.error_event) and id(run) not in inputs.compared
            exact_row = self._compared(run, inputs) if due else None
            row = None
            if policy.observes:
                st = run.state
                row = (
                    exact_row
                    if setup.observe == "exact"
                    else renormalized(self.reader.row(t)[..., : st.length], st.accessible(), self.reader.share(t))
                )
            used = driver.decide(row, future, check=check)
        run.record.record_bytes(t, used)
        if inputs.event is not None:
            run.snapshot(inputs.event)

    def _appended(self, inputs: StepInputs) -> None:
        """Step ``t ≥ 1`` begins: every run appends the new key (at full precision); the errors of
        the runs that ``only_evicted`` are then measured together (``evicted_errors``)."""
        qpos = int(self.reader.query_pos[inputs.t])
        for run in self.runs:
            run.driver.append(qpos)
        if not self.setup.with_errors or inputs.error_event is None:
            return
        exact = self.setup.observe == "exact"
        batched = [
            run for run in self.runs
            if not (exact and run.driver.policy.observes) and only_evicted(run.state, qpos + 1) and not _rewrites(run)
        ]  # fmt: skip
        if not batched:
            return
        presents = [run.state.accessible() for run in batched]  # [L, Hkv, qpos + 1] after the append
        l1, rel = evicted_errors(self.setup.rules, inputs.ref, presents)
        for run, l1_run, rel_run in zip(batched, l1, rel, strict=True):
            run.record.l1[inputs.error_event], run.record.out[inputs.error_event] = l1_run, rel_run
            inputs.compared.add(id(run))

    def _compares(self, run: Run, error_event: int | None) -> bool:
        """This step compares ``run`` with full KV: its errors after an event, or its exact row
        (observe=exact, a policy that observes)."""
        setup = self.setup
        errors = setup.with_errors and error_event is not None and not _rewrites(run)
        return errors or (setup.observe == "exact" and run.driver.policy.observes)

    def _reference(self, t: int, error_event: int | None):
        """The full-KV reference of step ``t``'s recorded query when a run compares with it
        this step (else None). Computed in a pool task where there is a pool, as the runs'
        comparisons are (torch's ops then run on the pool's threads, one thread each: the
        replay sets torch to one thread while its pool runs)."""
        if not any(self._compares(run, error_event) for run in self.runs):
            return None
        return reference(self.setup.rules, self.reader.query(t), *self.kv, int(self.reader.query_pos[t]))

    def _compared(self, run: Run, inputs: StepInputs) -> np.ndarray | None:
        """``run`` against full KV at step ``t`` (after its append, before its decision): the
        errors recorded after an event; returns the exact row for observe=exact (else None)."""
        setup, t = self.setup, inputs.t
        exact = setup.observe == "exact" and run.driver.policy.observes
        qpos = int(self.reader.query_pos[t])
        row, l1, out_err = against_full(setup.rules, run.state, inputs.ref, *self.kv, qpos, row=exact)
        if setup.with_errors and inputs.error_event is not None:
            run.record.l1[inputs.error_event] = l1
            run.record.out[inputs.error_event] = out_err
        return row


def _rewrites(run: Run) -> bool:
    """The run's press rewrote what it kept (re-rotated or merged, channel-pruned): its errors need
    the press's own cache, which the recording does not hold (forced replay serves it)."""
    return bool(getattr(run.state, "rewrites", None))
