"""Replay as independent tasks, cut by :mod:`kvscope.replay.plan` (:class:`~kvscope.replay.plan.Piece`).

:func:`run_pieces` runs the tasks in this process (runs of a step
advanced by a thread pool), in worker processes forked from it (:class:`ForkedWorkers`), or on a
``dask.distributed`` client: each worker opens the trace by
its path and writes its snapshots into the result store's chunks of its own units (chunked by
the task's block), and sends back only its small per-unit records, which :meth:`Outputs.absorb`
puts in place.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import replace
from typing import Self

import numpy as np

from ..errors import KvscopeError
from .plan import Piece, plan
from .result import Outputs
from .sample import SampleReplay
from .store import TierStore


def restricted(setup, piece: Piece):
    """The replay setup of one task: its sample, layers and KV heads of the trace (the query
    heads of their groups, and their stored rows), its policies."""
    layers, kv = piece.units
    g = setup.ds.kvscope.model.group  # query heads per KV head
    heads = {"kv_head": kv, "head": slice(kv.start * g, kv.stop * g)}
    ds = setup.ds.isel(sample=[piece.sample], layer=layers, **{d: i for d, i in heads.items() if d in setup.ds.sizes})
    return replace(setup, ds=ds, policies=[setup.policies[i] for i in piece.policies])


def probe(setup, piece: Piece) -> dict:
    """Phase 1 of the oracle allocation: ``{(policy, allocation, budget): (capacities, loss)}``
    ``[candidate, layer, kv_head]`` over the task's units
    (:meth:`~kvscope.replay.sample.SampleReplay.oracle_probes`)."""
    oracles = [(ai, a) for ai, a in enumerate(setup.allocations) if a.clairvoyant]
    sample = SampleReplay(restricted(setup, piece), 0, None)
    return {
        (pi, ai, bi): sample.oracle_probes(setup.policies[pi], oracle, budget)
        for pi in piece.policies
        for ai, oracle in oracles
        for bi, budget in enumerate(setup.budgets)
    }


def oracle_splits(setup, pieces: list[Piece], probes: list[dict]) -> dict:
    """``{sample: {(policy, allocation, budget): capacities [layer, kv_head]}}``: each oracle's
    split chosen over every unit of the sample from the probes of all its tasks."""
    gathered: dict = {}
    for piece, found in zip(pieces, probes, strict=True):
        for key, gains in found.items():
            gathered.setdefault((piece.sample, key), []).append((piece, gains))
    splits: dict = {}
    for (s, (pi, ai, bi)), parts in gathered.items():
        n_candidates = parts[0][1][0].shape[0]
        # [candidate, layer, kv_head] over the sample's units
        capacities, loss = (np.full((n_candidates, setup.n_layers, setup.n_kv), np.nan) for _ in range(2))
        for piece, (c, lost) in parts:
            capacities[(slice(None), *piece.units)], loss[(slice(None), *piece.units)] = c, lost
        spec, policy = setup.spec(s, setup.budgets[bi]), setup.policies[pi]
        split = setup.allocations[ai].split(spec, policy.unit_floor(spec), gains=(capacities, loss))
        splits.setdefault(s, {})[pi, ai, bi] = split
    return splits


class TierWindow:
    """A task's view of the result's tiers: a snapshot of its run ``(j, allocation, budget,
    0, event)`` is written at the replay's ``(policy, allocation, budget, sample, event)`` and the
    task's units — once every run of the task has taken its snapshot of that event, all of them
    in one write (:meth:`TierStore.write_runs`; the runs call from the pool's threads), on a
    writer thread of its own while the runs go on (at most :data:`WRITES_AHEAD` events queued;
    :meth:`complete` waits for them and raises a failed write)."""

    WRITES_AHEAD = 2

    def __init__(self, store: TierStore, piece: Piece):
        from concurrent.futures import ThreadPoolExecutor

        self.store, self.piece = store, piece
        self.runs = len(piece.policies) * store.array.shape[1] * store.array.shape[2]  # × allocations × budgets
        self.pending: dict[int, dict[tuple[int, int, int], np.ndarray]] = {}  # event → {(j, ai, bi): tiers}
        self.lock = threading.Lock()
        self.taken: list[tuple[int, ...]] = []
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="kvscope-replay-tiers")
        self.writes: list = []  # futures of the writes not yet waited for

    def write(self, index: tuple[int, ...], tiers: np.ndarray) -> None:
        j, ai, bi, _, event = index
        with self.lock:
            got = self.pending.setdefault(event, {})
            got[j, ai, bi] = tiers
            if len(got) < self.runs:
                return
            del self.pending[event]
            while len(self.writes) >= self.WRITES_AHEAD:
                self.taken += self.writes.pop(0).result()
            self.writes.append(self.writer.submit(self._write_event, event, got))

    def _write_event(self, event: int, got: dict[tuple[int, int, int], np.ndarray]) -> list[tuple[int, ...]]:
        """The writer thread: one event's snapshots of every run written; returns what they are
        (taken once the write is waited for; the thread takes no lock)."""
        n_a, n_b = self.store.array.shape[1:3]
        block = np.stack(
            [got[j, ai, bi] for j in range(len(self.piece.policies)) for ai in range(n_a) for bi in range(n_b)]
        )
        block = block.reshape(
            (len(self.piece.policies), n_a, n_b) + block.shape[1:]
        )  # [j, ai, bi, layer, kv_head, pos]
        self.store.write_runs(self.piece.policies, self.piece.sample, event, block, self.piece.units)
        s = self.piece.sample
        return [(p, ai, bi, s, event) for p in self.piece.policies for ai in range(n_a) for bi in range(n_b)]

    def complete(self) -> None:
        """Waits for the queued writes; then the snapshots of an event that not every run took
        (none, as runs step together) one by one."""
        try:
            for write in self.writes:
                self.taken += write.result()
        finally:
            self.writes.clear()
            self.writer.shutdown(wait=True)
        for event, got in self.pending.items():
            for (j, ai, bi), tiers in got.items():
                at = (self.piece.policies[j], ai, bi, self.piece.sample, event)
                self.store.write(at, tiers, self.piece.units)
                self.taken.append(at)
        self.pending.clear()

    def abandon(self) -> None:
        """The task failed: queued writes dropped, the one under way waited for (its folder is
        about to be removed)."""
        self.writer.shutdown(wait=True, cancel_futures=True)
        self.writes.clear()


def replay_piece(setup, piece: Piece, store: TierStore, splits: dict, pool=None, progress=None):
    """Phase 2: the task's runs, their snapshots written to ``store``; returns its record (an
    :class:`Outputs` of one sample and its units, tiers dropped) and the snapshots taken."""
    sub = restricted(setup, piece)
    window = TierWindow(store, piece)
    part = Outputs.allocate(sub, None, tiers=window)
    local = {
        (j, ai, bi): split[piece.units]
        for (pi, ai, bi), split in splits.get(piece.sample, {}).items()
        for j in [piece.policies.index(pi)] if pi in piece.policies
    }  # fmt: skip
    try:
        SampleReplay(sub, 0, part, local).run(pool, progress)
    except BaseException:
        window.abandon()
        raise
    window.complete()
    part.tiers = None
    return part, window.taken


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
