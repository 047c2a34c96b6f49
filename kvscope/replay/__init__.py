"""Offline policy replay (SPEC §5): every policy × budget driven step by step by one trace.

For each sample the trace's rows are read once, block by block, and every (policy, budget)
cache state is driven through the same steps by the policy driver
(:class:`kvscope.policies.driver.PolicyDriver`, the one a live cache uses too)::

    step 0      driver.prefill(colsum, tail)        prompt 0..P−1, compressed to the budget
    step t ≥ 1  driver.append(P − 1 + t)            the new key, at full precision
                row_seen = observe(row_t, tiers)    renorm | exact (below)
                driver.decide(row_seen)             observe, compress; bytes ≤ B checked

``observe="renorm"`` (open loop): the full-KV kv-group row restricted to the accessible
(FP or Q) positions and renormalized. ``observe="exact"`` (needs ``--record qkv``): the row
recomputed from the recorded query with the cache the policy keeps — Q keys dequantized,
evicted keys absent — exactly what a live cache would compute.

Tiers are snapshot at the events ``0, every, 2·every, …`` *after* the policy acted, so the
metrics score the decision against the future (the analysis layer's definitions, SPEC §4):

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

import contextlib
import functools
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import xarray as xr

from .. import defaults
from ..analysis.fmm import FMM
from ..analysis.lir import LIR
from ..errors import KvscopeError
from ..policies import Allocation, CacheSpec, Policy, check_budget, check_geometry, parse
from ..policies import allocation as allocation_module
from ..policies.allocation import check_allocatable
from . import pieces
from . import result as _result
from .check import open_result
from .output_error import effective_kv
from .reader import rule_of
from .result import _attrs, _press_settings, save_result, tiers_for
from .store import result_folder, write_variables

OBSERVE_MODES = ("renorm", "exact")

__all__ = ["OBSERVE_MODES", "effective_kv", "open_result", "replay", "resolve_policies", "save_result", "tiers_for"]


def _resolved(items, cls, parse_one, what: str) -> list:
    """Names, ``name:key=value`` strings or ``cls`` objects → objects with distinct labels."""
    if isinstance(items, (str, cls)):
        items = [items]
    out = [x if isinstance(x, cls) else parse_one(x) for x in items]
    if not out:
        raise KvscopeError(f"no {what} given")
    labels = [x.label() for x in out]
    if len(set(labels)) != len(labels):
        raise KvscopeError(f"{'an' if what[0] in 'aeiou' else 'a'} {what} is listed twice: {', '.join(labels)}")
    return out


def resolve_policies(policies) -> list[Policy]:
    """Names, ``name:key=value`` strings or policy objects → policy objects (unique labels)."""
    return _resolved(policies, Policy, parse, "policy")


def resolve_allocations(allocations) -> list[Allocation]:
    """The same for allocations (default: uniform alone)."""
    return _resolved(
        ["uniform"] if allocations is None else allocations, Allocation, allocation_module.parse, "allocation"
    )


def resolve_budgets(budgets) -> list[float]:
    if isinstance(budgets, (int, float, str)):
        budgets = [budgets]
    out = [check_budget(b) for b in budgets]
    if not out:
        raise KvscopeError("no budget given")
    if len(set(out)) != len(out):
        raise KvscopeError("a budget is listed twice")
    return out


@dataclass
class ReplaySetup:
    """Everything a replay needs besides the runs themselves."""

    ds: xr.Dataset
    policies: list[Policy]
    allocations: list[Allocation]
    budgets: list[float]
    observe: str
    fmm: FMM  # horizon, curve horizons, bootstrap: the analysis layer's definitions and checks
    lir: LIR  # m, H_lir, δ
    steps: np.ndarray  # [event] steps of the events
    group: int  # stored rows per KV head (1: kv-group rows)
    with_errors: bool
    validate: bool
    kv_itemsize: int
    source: str | None = None  # the trace's path (a dask worker opens it there)

    @classmethod
    def of(
        cls,
        ds,
        policies,
        allocations,
        budgets,
        *,
        observe,
        every,
        errors,
        validate,
        kv_itemsize,
        question_agnostic,
        source=None,
        **metric,
    ) -> ReplaySetup:
        acc = ds.kvscope
        if question_agnostic and not acc.question_agnostic:
            raise KvscopeError(
                "question-agnostic replay needs a trace recorded with kvscope trace --question-agnostic "
                "(this one prefilled the question with the context, so every policy saw it)"
            )
        if observe not in OBSERVE_MODES:
            raise KvscopeError(f"observe must be renorm or exact (got {observe!r})")
        stats = {k: metric.pop(k) for k in ("n_boot", "seed", "resample")}
        fmm = FMM(horizon=metric.pop("horizon"), horizons=metric.pop("horizons"), **stats)
        lir = LIR(**metric, **stats)
        if every is not None and every < 1:
            raise KvscopeError(f"every must be ≥ 1 (got {every})")
        if acc.resolution != "token" and not acc.has_qkv:
            raise KvscopeError(
                "replay needs token-resolution rows, or q/k to recompute them from; this store holds window sums only"
            )
        acc.require_steps()
        if observe == "exact" and not acc.has_qkv:
            raise KvscopeError("observe=exact needs recorded q/k/v (trace with --record qkv)")
        steps = np.arange(0, ds.sizes["step"], every or acc.w)
        policies = resolve_policies(policies)
        check_geometry(policies, acc.model)
        needs_qkv = [p.label() for p in policies if p.reads_queries]
        if needs_qkv and not acc.has_qkv:
            raise KvscopeError(f"{needs_qkv[0]} needs recorded q/k/v (trace with --record qkv)")
        allocations = resolve_allocations(allocations)
        check_allocatable(policies, allocations)
        needs_qkv = [a.label() for a in allocations if a.needs_qkv]
        if needs_qkv and not acc.has_qkv:
            raise KvscopeError(f"the {needs_qkv[0]} allocation needs recorded q/k/v (trace with --record qkv)")
        return cls(
            ds, policies, allocations, resolve_budgets(budgets), observe, fmm, lir, steps, acc.group,
            with_errors=errors and acc.has_qkv, validate=validate, kv_itemsize=kv_itemsize, source=source,
        )  # fmt: skip

    @property
    def horizons(self) -> list[int]:
        """Horizons of the FMM(H) curve."""
        return self.fmm.curve_horizons()

    @property
    def grid(self) -> list[tuple[Policy, Allocation, float]]:
        """Every run of a sample, in the order of the result's (policy, allocation, budget)."""
        return [(p, a, b) for p in self.policies for a in self.allocations for b in self.budgets]

    @property
    def has_qkv(self) -> bool:
        return self.ds.kvscope.has_qkv

    @property
    def uses_torch(self) -> bool:
        """Some step computes with torch: errors, exact observation or a kvpress press (q/k/v
        recorded) — or, torch being loaded already, every float16 conversion (``dtypes.cast``).
        Forked workers must then set torch to one thread before its first op: a child of a
        process whose OpenMP team ran once hangs in its first parallel region (libgomp is not
        fork-safe)."""
        needs = self.with_errors or self.observe == "exact" or any(p.reads_queries for p in self.policies)
        return (self.has_qkv and needs) or "torch" in sys.modules

    @property
    def every(self) -> int:
        return int(self.steps[1] - self.steps[0]) if len(self.steps) > 1 else self.ds.kvscope.w

    @property
    def n_layers(self) -> int:
        return self.ds.sizes["layer"]

    @property
    def n_kv(self) -> int:
        """KV heads replayed (a task may hold some): the stored heads, ``group`` per KV head."""
        return self.ds.sizes[self.ds.kvscope.hdim] // self.group

    @property
    def head_dim(self) -> int:
        return self.ds.kvscope.model.head_dim

    @property
    def n_sink(self) -> int:
        return self.ds.kvscope.n_sink

    @property
    def w(self) -> int:
        return self.ds.kvscope.w

    @property
    def n_pos(self) -> int:
        return self.ds.sizes["pos"]

    @property
    def n_samples(self) -> int:
        return self.ds.sizes["sample"]

    @property
    def n_step_total(self) -> int:
        return self.ds.sizes["step"]

    def spec(self, s: int, budget: float) -> CacheSpec:
        """Sample ``s``'s cache at ``budget`` over the layers and KV heads replayed here."""
        acc = self.ds.kvscope
        prompt_len = int(acc.prompt_len[s])
        model, final = acc.model, prompt_len + int(acc.n_steps[s])
        return CacheSpec(
            self.n_layers, self.n_kv, self.head_dim, prompt_len, final, budget, self.n_sink,
            self.w, self.kv_itemsize, first_layer=int(self.layers[0]), model_layers=model.n_layers,
            model_kv=model.n_kv_heads, token_values=model.token_values,
            layer_windows=tuple(model.window(int(layer)) for layer in self.layers) if not model.global_only else (),
            model_held=0.0 if model.global_only else model.full_tokens(final) / (model.n_layers * model.n_kv_heads),
        )  # fmt: skip

    @property
    def layers(self) -> np.ndarray:
        """``[layer]`` the stored indices of the layers replayed (a task may hold some; a hybrid
        model's ``layer`` coordinate holds the model's indices of its attention layers)."""
        model = self.ds.kvscope.model
        return np.asarray([model.stored_layer(int(x)) for x in self.ds["layer"].values], dtype=np.int64)

    @property
    def rules(self):
        """The attention rules of the layers replayed."""
        from ..attention import LayerRules

        return LayerRules(tuple(rule_of(self.ds, int(layer)) for layer in self.layers))

    @property
    def rope(self):
        return self.ds.kvscope.rope


def replay(
    trace,
    policies,
    budgets,
    *,
    allocations=None,
    observe: str = "renorm",
    horizon: int = defaults.HORIZON,
    horizons: list[int] | None = None,
    every: int | None = None,
    m: int = defaults.LIR_MISSES,
    h_lir: int | None = defaults.LIR_HORIZON,
    delta: int = defaults.LIR_LAG,
    errors: bool = True,
    validate: bool = False,
    threads: int | None = None,
    processes: int | None = None,
    n_boot: int = defaults.N_BOOT,
    seed: int = 0,
    resample: str = "samples",
    kv_itemsize: int = 2,
    question_agnostic: bool = False,
    layers_per_task: int | None = None,
    kv_heads_per_task: int | None = None,
    client=None,
    progress=None,
    out=None,
) -> xr.Dataset:
    """Replay ``policies`` × ``budgets`` against a trace; returns the Dataset described in
    the module docstring, dims ``(policy, budget, sample, event|step, layer, kv_head, pos)``.

    ``trace``: a store path or an opened trace. ``policies``: names, ``name:key=value``
    strings or policy objects. ``budgets``: shares β of ``FP_bytes(P + S)`` in (0, 1].
    ``allocations``: how each budget is split across layers and KV heads (names,
    ``name:key=value`` strings or :class:`~kvscope.policies.Allocation` objects; default
    ``uniform``): every policy runs under every allocation.
    ``errors``: attention and output errors when q/k/v are recorded. ``validate``: check
    every policy invariant at every step (tests). ``processes``: worker processes forked
    from this one that take the tasks (Linux; default: up to 2 for a grid of at least
    :data:`kvscope.defaults.REPLAY_FORK_CELLS` run × step × unit × position cells from a trace
    given by its path; 0: none). ``threads``: where this process runs the tasks itself, cache
    states advanced in parallel within a step (default: up to 2; numpy releases the GIL inside
    its loops).
    ``resample``: what the confidence intervals resample, ``samples`` (prompts) or ``units``.
    ``kv_itemsize``: bytes per full-precision K/V element in the byte model (2: 16-bit; 4
    compares with a live cache of an fp32 model). ``question_agnostic``: refuse a trace whose
    prefill held the question (the protocol is fixed when a trace is recorded: on a trace made
    with ``trace --question-agnostic`` every policy first compresses at the end of the context,
    and the question's steps are decode steps). ``progress(done, total)`` is called per step
    (per task on a cluster).

    The replay runs as tasks of one sample and a block of ``layers_per_task`` layers ×
    ``kv_heads_per_task`` KV heads (default: as many layers as
    :data:`kvscope.defaults.REPLAY_TASK_BYTES` hold — all of them for a small trace — and every
    KV head, or some of one layer's where that layer alone does not fit and the allocations allow
    it; :mod:`kvscope.replay.pieces`), in this process, in ``processes`` forked from it or, given a
    ``dask.distributed`` ``client``, on its workers (the trace given by its path; workers and this
    process share the result's folder). The numbers are the same either way.

    The tiers are streamed to a Zarr store as they are taken (memory never holds them all),
    and the result's ``tiers`` is a dask array reading that store, every other variable in
    memory (:mod:`kvscope.replay.store`). ``out``: the result store is written there (under a
    temporary name, renamed into place when complete; an existing path is refused) and
    returned as :func:`open_result` opens it. Without ``out`` the tiers go to a temporary
    store, removed once nothing can read it lazily any more (``.load()`` to keep them). A
    failed replay leaves no store behind.
    """
    from ..store import open_trace

    started = time.perf_counter()
    path = os.fspath(trace) if isinstance(trace, (str, os.PathLike)) else None
    ds = open_trace(path) if path is not None else trace
    setup = ReplaySetup.of(
        ds, policies, allocations, budgets, observe=observe, horizon=horizon, horizons=horizons, every=every, errors=errors,
        m=m, h_lir=h_lir, delta=delta, validate=validate, kv_itemsize=kv_itemsize, n_boot=n_boot, seed=seed,
        resample=resample, question_agnostic=question_agnostic, source=path,
    )  # fmt: skip
    if client is not None and path is None:
        raise KvscopeError("a replay on a dask cluster takes the trace as a store path (its workers open it)")
    processes = _processes(setup, processes, client, path)
    workers = sum(client.nthreads().values()) if client is not None else processes
    block = _block(setup, layers_per_task, kv_heads_per_task, workers, 2 if client is not None else 1)
    with result_folder(out) as root:
        outputs = _result.Outputs.allocate(setup, root, block=block)
        ran_on = _run(setup, outputs, block, client, threads, processes, progress)
        outputs.tiers.complete()
        tiers = None if out is not None else outputs.tiers.lazy(temporary=True)
        result = _result.build(setup, outputs, tiers)
        result.attrs.update(_attrs(setup, trace, time.perf_counter() - started))
        result.attrs["replay_workers"] = ran_on
        if outputs.settings:
            result.attrs["press_settings"] = _press_settings(setup, outputs.settings)
        if out is not None:
            write_variables(result, root, mode="a")
    return open_result(out) if out is not None else result


def _processes(setup: ReplaySetup, processes: int | None, client, path: str | None) -> int:
    """Worker processes to fork (0: none): ``processes`` checked, or the default (``replay``'s docstring)."""
    forkable = sys.platform == "linux" and "fork" in multiprocessing.get_all_start_methods()
    daemon = multiprocessing.current_process().daemon  # a dask worker, say: may not have children
    if processes is None:
        cells = len(setup.grid) * int(setup.ds.kvscope.n_steps.sum()) * setup.n_layers * setup.n_kv * setup.n_pos
        wanted = cells >= defaults.REPLAY_FORK_CELLS and setup.n_layers > 1 and len(setup.grid) > 1
        n = min(2, os.cpu_count() or 1) if wanted and forkable and not daemon and client is None and path else 0
        return n if n > 1 else 0
    if isinstance(processes, bool) or not isinstance(processes, (int, np.integer)) or processes < 0:
        raise KvscopeError(f"processes must be an integer ≥ 0 (got {processes!r})")
    if processes <= 1:
        return 0
    if client is not None:
        raise KvscopeError(
            "a replay runs on a dask cluster or in forked processes, not both (processes=0 with a client)"
        )
    if path is None:
        raise KvscopeError("a replay in forked processes takes the trace as a store path (each process opens it)")
    if daemon:
        raise KvscopeError(
            "this is a daemonic process (a dask worker?), which may not fork worker processes: processes=0"
        )
    if not forkable:
        raise KvscopeError(
            f"forked worker processes need Linux (this is {sys.platform}): use a dask cluster (--dask local:N)"
        )
    return int(processes)


def _block(
    setup: ReplaySetup, layers: int | None, kv_heads: int | None, workers: int, per_worker: int
) -> tuple[int, int]:
    """(layers, KV heads) per task, checked, or chosen for ``workers`` to keep busy
    (:func:`kvscope.replay.pieces.layers_per_task`, :func:`~kvscope.replay.pieces.kv_heads_per_task`)."""
    if layers is None:
        layers = pieces.layers_per_task(setup, workers, tasks_per_worker=per_worker)
    layers = _count(layers, setup.n_layers, "layers per task")
    if kv_heads is None:
        return layers, pieces.kv_heads_per_task(setup, layers)
    kv_heads = _count(kv_heads, setup.n_kv, "KV heads per task")
    if kv_heads < setup.n_kv and not pieces.per_head(setup):
        across = next(a.label() for a in setup.allocations if a.across_heads)
        raise KvscopeError(
            f"the {across} allocation splits each layer's budget across its KV heads: "
            f"a task holds all {setup.n_kv} of them (got {kv_heads} KV heads per task)"
        )
    return layers, kv_heads


def _count(value, most: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= most:
        raise KvscopeError(f"{what} must be an integer in 1..{most} (got {value!r})")
    return int(value)


def _run(
    setup: ReplaySetup, outputs, block: tuple[int, int], client, threads: int | None, processes: int, progress
) -> str:
    """Every task (:mod:`kvscope.replay.pieces`): on the ``client``, in ``processes`` forked
    workers, or in this process with the runs of a step advanced by ``threads`` (default: up to
    2; numpy releases the GIL inside its loops). Returns where they ran (the result's
    ``replay_workers``): ``dask:N`` (N worker threads), ``forked:N`` or ``threads:N``."""
    pieces_of = pieces.plan(setup, *block)
    done, total = [0], sum(int(setup.ds.kvscope.n_steps[p.sample]) for p in pieces_of)

    def advanced(k: int) -> None:
        done[0] += k
        if progress is not None:
            progress(done[0], total)

    if client is not None:
        pieces.run_pieces(setup, outputs, block=block, client=client, progress=advanced)
        return f"dask:{sum(client.nthreads().values())}"
    if processes:
        with pieces.ForkedWorkers(processes, setup.uses_torch) as workers:
            pieces.run_pieces(setup, outputs, block=block, client=workers, progress=advanced)
        return f"forked:{processes}"
    threads = threads if threads is not None else min(2, os.cpu_count() or 1)
    if threads <= 1 or len(setup.grid) <= 1:
        pieces.run_pieces(setup, outputs, block=block, progress=advanced)
        return "threads:1"
    from concurrent.futures import ThreadPoolExecutor

    with _torch_one_thread(setup.uses_torch) as initializer:
        pool = ThreadPoolExecutor(threads, thread_name_prefix="kvscope-replay", initializer=initializer)
        try:
            pieces.run_pieces(setup, outputs, block=block, pool=pool, progress=advanced)
        finally:
            pool.shutdown()
    return f"threads:{threads}"


@contextlib.contextmanager
def _torch_one_thread(uses_torch: bool):
    """While the pool's threads advance the runs, torch's ops run on the thread that calls them
    (``torch.set_num_threads(1)``, here and in each pool thread: OpenMP's and MKL's thread counts
    are per calling thread), not each in an intra-op team of its own beside the pool's — which
    oversubscribes the cores and spins (replay grid 6.6 → 5.7 s on 2 cores). Restored afterwards.
    Yields the pool threads' initializer. A replay without q/k/v never imports torch."""
    if not uses_torch:
        yield None
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield functools.partial(torch.set_num_threads, 1)
    finally:
        torch.set_num_threads(before)
