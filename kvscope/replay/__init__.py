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
import os
import time

import xarray as xr

from .. import defaults
from ..errors import KvscopeError
from . import pieces
from . import result as _result
from .check import open_result
from .output_error import effective_kv
from .plan import (
    OBSERVE_MODES,
    ReplaySetup,
    _block,
    _processes,
    resolve_allocations,
    resolve_budgets,
    resolve_policies,
)
from .result import _attrs, _press_settings, save_result, tiers_for
from .store import result_folder, write_variables

__all__ = [
    "OBSERVE_MODES",
    "ReplaySetup",
    "effective_kv",
    "open_result",
    "replay",
    "resolve_allocations",
    "resolve_budgets",
    "resolve_policies",
    "save_result",
    "tiers_for",
]


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
