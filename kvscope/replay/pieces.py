"""Replay as independent tasks: cut by :mod:`kvscope.replay.plan`, each done as :mod:`kvscope.replay.tasks` says.

:func:`run_pieces` runs the tasks in this process (runs of a step
advanced by a thread pool), in worker processes forked from it (:class:`ForkedWorkers`), or on a
``dask.distributed`` client: each worker opens the trace by
its path and writes its snapshots into the result store's chunks of its own units (chunked by
the task's block), and sends back only its small per-unit records, which :meth:`Outputs.absorb`
puts in place.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Self

from ..errors import KvscopeError
from .plan import plan
from .result import Outputs
from .store import TierStore
from .tasks import oracle_splits, probe, replay_piece


@functools.lru_cache(maxsize=4)
def _opened(path: str):
    from ..store import open_trace

    return open_trace(path)


def _remote(function, setup_state: dict, *args):
    """A task on a dask worker: the setup with its trace opened there (once per process)."""
    setup = replace(setup_state["setup"], ds=_opened(setup_state["source"]))
    args = [TierStore(a) if isinstance(a, _StorePath) else a for a in args]
    return function(setup, *args)


class _StorePath(str):
    """The result store's folder, opened as a :class:`TierStore` by the worker."""


def run_pieces(setup, outputs: Outputs, *, block: tuple[int, int], client=None, pool=None, progress=None) -> None:
    """Every task of ``setup`` (:func:`plan` with ``block`` = (layers, KV heads) per task), in this
    process or on the dask ``client``, their records absorbed into ``outputs`` and the sample's budgets set."""
    pieces = plan(setup, *block)
    oracle = any(a.clairvoyant for a in setup.allocations)
    if client is None:
        splits = oracle_splits(setup, pieces, [probe(setup, p) for p in pieces]) if oracle else {}
        steps_done = (lambda: progress(1)) if progress is not None else None
        results = [replay_piece(setup, p, outputs.tiers, splits, pool, steps_done) for p in pieces]
    else:
        state = {"setup": replace(setup, ds=None), "source": setup.source}
        splits = oracle_splits(setup, pieces, _gather(client, probe, state, pieces)) if oracle else {}
        store = _StorePath(outputs.tiers.root)
        results = _gather(client, replay_piece, state, pieces, store, splits, progress=progress, setup=setup)
    for piece, (part, taken) in zip(pieces, results, strict=True):
        outputs.absorb(part, piece.policies, piece.sample, piece.units)
        for at in taken:
            outputs.tiers.taken[at] = True
    for s in {p.sample for p in pieces}:
        for bi, budget in enumerate(setup.budgets):
            outputs.budget_bytes[bi, s] = setup.spec(s, budget).total_capacity
        outputs.full_bytes[s] = setup.spec(s, 1.0).full_bytes


def _gather(client, function, state, pieces, *args, progress=None, setup=None) -> list:
    """``function(setup, piece, *args)`` per piece on the cluster (or :class:`ForkedWorkers`),
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
