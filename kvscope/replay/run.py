"""Running a replay: [`replay`][kvscope.replay.replay] plans it (``kvscope.replay.plan``), runs its tasks
(``kvscope.replay.tasks``) and builds the result (``kvscope.replay.result``).

``run_pieces`` runs the tasks in this process (runs of a step
advanced by a thread pool), in worker processes forked from it (``ForkedWorkers``), or on a
``dask.distributed`` client: each worker opens the trace by
its path and writes its snapshots into the result store's chunks of its own units (chunked by
the task's block), and sends back only its small per-unit records, which ``Outputs.absorb``
puts in place.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Self

import xarray as xr

from .. import defaults
from ..errors import KvscopeError
from .check import open_result
from .forced import check_forced, forced_replay, load_model
from .plan import ReplaySetup, plan, task_block, worker_count
from .result import Outputs, build, forced_attrs, press_notes, press_settings, result_bytes, run_attrs
from .store import TierStore, result_folder, write_variables
from .tasks import oracle_splits, probe, replay_piece

if TYPE_CHECKING:
    from collections.abc import Callable

    import distributed

    from ..policies import Allocation, Policy


def replay(
    trace: str | os.PathLike | xr.Dataset,
    policies: str | Policy | list[str | Policy],
    budgets: float | list[float],
    *,
    allocations: str | Allocation | list[str | Allocation] | None = None,
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
    kv_itemsize: int | None = None,
    question_agnostic: bool = False,
    forced: bool = False,
    forced_chunk: int = defaults.FORCED_CHUNK,
    max_rounds: int = defaults.FORCED_MAX_ROUNDS,
    device: str | None = None,
    layers_per_task: int | None = None,
    kv_heads_per_task: int | None = None,
    client: distributed.Client | None = None,
    progress: Callable[[int, int], None] | None = None,
    out: str | os.PathLike | None = None,
) -> xr.Dataset:
    """Replay ``policies`` × ``budgets`` against a trace; returns the Dataset described in
    [`kvscope.replay`][kvscope.replay], dims ``(policy, budget, sample, event|step, layer, kv_head, pos)``.

    Every policy runs under every allocation at every budget. The replay runs as tasks of one sample and a block of ``layers_per_task`` layers ×
    ``kv_heads_per_task`` KV heads (default: as many layers as
    ``kvscope.defaults.REPLAY_TASK_BYTES`` hold — all of them for a small trace — and every
    KV head, or some of one layer's where that layer alone does not fit and the allocations allow
    it; ``kvscope.replay.plan``), in this process, in ``processes`` forked from it or, given a
    ``dask.distributed`` ``client``, on its workers (the trace given by its path; workers and this
    process share the result's folder). The numbers are the same either way.

    The tiers are streamed to a Zarr store as they are taken (memory never holds them all),
    and the result's ``tiers`` is a dask array reading that store, every other variable in
    memory (``kvscope.replay.store``). ``out``: the result store is written there (under a
    temporary name, renamed into place when complete; an existing path is refused) and
    returned as [`open_result`][kvscope.open_result] opens it. Without ``out`` the tiers go to a temporary
    store, removed once nothing can read it lazily any more (``.load()`` to keep them). A
    failed replay leaves no store behind.

    Args:
        trace: A store path or an opened trace.
        policies: Names, ``name:key=value`` strings or policy objects.
        budgets: Shares β of ``FP_bytes(P + S)`` in (0, 1] ([budget](concepts.md#budget)).
        allocations: How each budget is split across layers and KV heads: names,
            ``name:key=value`` strings or [`Allocation`][kvscope.policies.Allocation] objects
            (default ``uniform``).
        observe: What a policy observes at each step: ``renorm`` (the full-KV row restricted to
            what it keeps) or ``exact`` (recomputed from the recorded query; needs q/k/v).
        horizon: FMM's horizon ``H`` (steps).
        horizons: The FMM(H) curve's horizons (default 1, 2, 4, … ``H``).
        every: Steps between events (default: the trace's ``w``).
        m: Global LIR's misses before an episode is eligible.
        h_lir: Global LIR's reactivation horizon in events (None: any time later).
        delta: The lag δ of P01/P10 (events).
        errors: Attention and output errors where q/k/v are recorded.
        validate: Check every policy invariant at every step (tests).
        threads: Where this process runs the tasks itself, cache states advanced in parallel
            within a step (default: up to 2; numpy releases the GIL inside its loops).
        processes: Worker processes forked from this one that take the tasks (Linux; default:
            up to 2 for a grid of at least ``kvscope.defaults.REPLAY_FORK_CELLS`` run × step ×
            unit × position cells from a trace given by its path; 0: none).
        n_boot: Bootstrap resamples of the confidence intervals.
        seed: Seed of the bootstrap.
        resample: What the confidence intervals resample: ``samples`` (prompts) or ``units``.
        kv_itemsize: Bytes per full-precision K/V element in the byte model (default 2, 16-bit;
            under ``forced`` the model's own dtype — 4 for an fp32 model — as a live cache counts them).
        question_agnostic: Refuse a trace whose prefill held the question (the protocol is
            fixed when a trace is recorded: on a trace made with ``trace --question-agnostic``
            every policy first compresses at the end of the context, and the question's steps
            are decode steps).
        forced: Also the model's own output under each run's cache, teacher-forced on the trace's
            continuation ([forced replay](concepts.md#forced-replay), ``kvscope.replay.forced``):
            the trace's model is loaded once, on ``device``.
        forced_chunk: Decode steps per forward of the forced decodes (their closed loop converges chunk by chunk;
            a press that acts while decoding runs step by step).
        max_rounds: Forwards of one chunk before a closed loop that still changes is labelled not converged.
        device: Where forced replay runs the model (default: the trace's device).
        layers_per_task: Layers of one sample per task (default: as many as 2 GiB hold).
        kv_heads_per_task: KV heads of those layers per task (default: all).
        client: A ``dask.distributed`` client whose workers take the tasks.
        progress: Called as ``progress(done, total)`` per step (per task on a cluster).
        out: Write the result store there (an existing path is refused).

    Returns:
        The result: one run per (policy, allocation, budget).

    Raises:
        KvscopeError: Bad input, or a trace the runs cannot use (one line).
    """
    from ..storage.store import open_trace

    started = time.perf_counter()
    path = os.fspath(trace) if isinstance(trace, (str, os.PathLike)) else None
    ds = open_trace(path) if path is not None else trace
    if forced:
        check_forced(forced_chunk, max_rounds)
    setup = ReplaySetup.of(
        ds, policies, allocations, budgets, observe=observe, horizon=horizon, horizons=horizons, every=every, errors=errors,
        m=m, h_lir=h_lir, delta=delta, validate=validate, kv_itemsize=2 if kv_itemsize is None else kv_itemsize,
        n_boot=n_boot, seed=seed, resample=resample, question_agnostic=question_agnostic, source=path,
    )  # fmt: skip
    if client is not None and path is None:
        raise KvscopeError("a replay on a dask cluster takes the trace as a store path (its workers open it)")
    model = load_model(ds, device) if forced else None  # loaded once every input is checked
    if kv_itemsize is None and model is not None:
        setup = replace(setup, kv_itemsize=model.itemsize)
    processes = worker_count(setup, processes, client, path)
    workers = sum(client.nthreads().values()) if client is not None else processes
    block = task_block(setup, layers_per_task, kv_heads_per_task, workers, per_worker=2 if client is not None else 1)
    needs = functools.partial(result_bytes, setup, block)
    with result_folder(out, needs) as root:
        outputs = Outputs.allocate(setup, root, block=block)
        ran_on = _run(
            setup, outputs, block=block, client=client, threads=threads, processes=processes, progress=progress
        )
        outputs.tiers.complete()
        decoded, forced_seconds = None, 0.0
        if model is not None:
            forced_started = time.perf_counter()
            decoded = forced_replay(setup, model, splits=outputs.splits, chunk=forced_chunk, max_rounds=max_rounds,
                                    client=client, progress=progress)  # fmt: skip
            forced_seconds = time.perf_counter() - forced_started
        tiers = None if out is not None else outputs.tiers.lazy(temporary=True)
        result = build(setup, outputs, tiers, decoded)
        result.attrs.update(run_attrs(setup, trace, time.perf_counter() - started))
        result.attrs["replay_workers"] = ran_on
        if outputs.settings:
            result.attrs["press_settings"] = press_settings(setup, outputs.settings)
            result.attrs["press_notes"] = press_notes(setup, outputs.settings)
        if decoded is not None:
            result.attrs.update(forced_attrs(decoded, forced_seconds))
        if out is not None:
            write_variables(result, root, mode="a")
    return open_result(out) if out is not None else result


def _run(
    setup: ReplaySetup, outputs, block: tuple[int, int], client, threads: int | None, processes: int, progress
) -> str:
    """Every task (``kvscope.replay.plan``, ``kvscope.replay.tasks``): on the ``client``, in
    ``processes`` forked workers, or in this process with the runs of a step advanced by ``threads``
    (default: up to 2; numpy releases the GIL inside its loops). Returns where they ran (the result's
    ``replay_workers``): ``dask:N`` (N worker threads), ``forked:N`` or ``threads:N``."""
    pieces_of = plan(setup, *block)
    done, total = [0], sum(int(setup.ds.kvscope.n_steps[p.sample]) for p in pieces_of)

    def advanced(k: int) -> None:
        done[0] += k
        if progress is not None:
            progress(done[0], total)

    if client is not None:
        run_pieces(setup, outputs, block=block, client=client, progress=advanced)
        return f"dask:{sum(client.nthreads().values())}"
    if processes:
        with ForkedWorkers(processes, setup.uses_torch) as workers:
            run_pieces(setup, outputs, block=block, client=workers, progress=advanced)
        return f"forked:{processes}"
    threads = threads if threads is not None else min(2, os.cpu_count() or 1)
    if threads <= 1 or len(setup.grid) <= 1:
        run_pieces(setup, outputs, block=block, progress=advanced)
        return "threads:1"
    from concurrent.futures import ThreadPoolExecutor

    with _torch_one_thread(setup.uses_torch) as initializer:
        pool = ThreadPoolExecutor(threads, thread_name_prefix="kvscope-replay", initializer=initializer)
        try:
            run_pieces(setup, outputs, block=block, pool=pool, progress=advanced)
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


def run_pieces(setup, outputs: Outputs, *, block: tuple[int, int], client=None, pool=None, progress=None) -> None:
    """Every task of ``setup`` (``plan`` with ``block`` = (layers, KV heads) per task), in this
    process or on the dask ``client``, their records absorbed into ``outputs`` and the sample's budgets set."""
    pieces = plan(setup, *block)
    oracle = any(a.clairvoyant for a in setup.allocations)
    if client is None:
        splits = oracle_splits(setup, pieces, [probe(setup, p) for p in pieces]) if oracle else {}
        steps_done = (lambda: progress(1)) if progress is not None else None
        results = [replay_piece(setup, p, outputs.tiers, splits, pool=pool, progress=steps_done) for p in pieces]
    else:
        state = {"setup": replace(setup, ds=None), "source": setup.source}
        splits = oracle_splits(setup, pieces, _gather(client, probe, state, pieces)) if oracle else {}
        store = _StorePath(outputs.tiers.root)
        results = _gather(client, replay_piece, state, pieces, args=(store, splits), progress=progress, setup=setup)
    outputs.splits = splits
    for piece, (part, taken) in zip(pieces, results, strict=True):
        outputs.absorb(part, piece.policies, piece.sample, piece.units)
        for at in taken:
            outputs.tiers.taken[at] = True
    for s in {p.sample for p in pieces}:
        for bi, budget in enumerate(setup.budgets):
            outputs.budget_bytes[bi, s] = setup.spec(s, budget).total_capacity
        outputs.full_bytes[s] = setup.spec(s, 1.0).full_bytes


@functools.lru_cache(maxsize=4)
def _opened(path: str):
    from ..storage.store import open_trace

    return open_trace(path)


def _remote(function, setup_state: dict, *args):
    """A task on a dask worker: the setup with its trace opened there (once per process)."""
    setup = replace(setup_state["setup"], ds=_opened(setup_state["source"]))
    args = [TierStore(a) if isinstance(a, _StorePath) else a for a in args]
    return function(setup, *args)


class _StorePath(str):
    """The result store's folder, opened as a ``TierStore`` by the worker."""


def _gather(client, function, state, pieces, *, args=(), progress=None, setup=None) -> list:
    """``function(setup, piece, *args)`` per piece on the cluster (or ``ForkedWorkers``),
    results in the pieces' order (``progress(k)`` with a finished task's steps)."""
    results: list = [None] * len(pieces)
    calls = [(function, state, piece, *args) for piece in pieces]
    for i, result in _completed(client, calls):
        results[i] = result
        if progress is not None:
            progress(int(setup.ds.kvscope.n_steps[pieces[i].sample]))
    return results


def _completed(client, calls: list[tuple]):
    """``(i, _remote(*calls[i]))`` as the tasks finish."""
    if isinstance(client, ForkedWorkers):
        yield from client.completed(calls)
        return
    from distributed import as_completed

    futures = [client.submit(_remote, *call, pure=False) for call in calls]
    index = {f.key: i for i, f in enumerate(futures)}
    for future in as_completed(futures):
        yield index[future.key], future.result()


class ForkedWorkers:
    """``n`` worker processes forked from this one (multiprocessing's ``fork`` start, Linux) that
    take the tasks as a dask cluster's workers do — each opens the trace by its path and writes
    its snapshots into the result store — without a cluster: they inherit this process's modules,
    so none is imported again (a LocalCluster's workers take ~3 s to start, about what a 1K-token
    grid costs). Two processes do not share a GIL: the runs of one process, advanced by threads,
    overlap only ~20% (their steps are many short numpy calls). Each worker runs torch on one
    thread and leaves Ctrl-C to this process, which terminates them (leaving the block)."""

    def __init__(self, n: int, uses_torch: bool):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.n = n
        context = multiprocessing.get_context("fork")
        self.pool = ProcessPoolExecutor(n, mp_context=context, initializer=_forked, initargs=(uses_torch,))

    def nthreads(self) -> dict[int, int]:
        return dict.fromkeys(range(self.n), 1)

    def completed(self, calls: list[tuple]):
        """``(i, _remote(*calls[i]))`` as the tasks finish; a worker that died (killed for
        memory, say) fails the replay with one line instead of leaving it waiting."""
        from concurrent.futures import as_completed
        from concurrent.futures.process import BrokenProcessPool

        futures = {self.pool.submit(_remote, *call): i for i, call in enumerate(calls)}
        try:
            for future in as_completed(futures):
                yield futures[future], future.result()
        except BrokenProcessPool as exc:
            raise KvscopeError(
                "a replay worker process died before its task ended (killed for memory?): "
                "rerun with fewer --layers-per-task or --processes 0"
            ) from exc

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self.pool.shutdown()
            return
        # failed or interrupted: the other tasks are stopped, not waited for (concurrent.futures
        # keeps its processes in _processes; Python 3.14 adds terminate_workers for this)
        processes = list((getattr(self.pool, "_processes", None) or {}).values())
        self.pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join(timeout=10)


def _forked(uses_torch: bool) -> None:
    """A forked worker's start: Ctrl-C ignored (this process's parent handles it), torch on one thread."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if uses_torch:
        import torch

        torch.set_num_threads(1)
