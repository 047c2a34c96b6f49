"""What one replay task does (``Piece``: one sample, a block of layers ×
KV heads, some policies): the trace restricted to its units (``restricted``); for the
oracle allocation first its units' losses at the candidate capacities (``probe``, phase 1),
from which the split is chosen over every task of the sample (``oracle_splits``); then its
runs (``replay_piece``, phase 2), their snapshots written into the result store through a
``TierWindow``, its small per-unit records returned. Where the tasks run:
``kvscope.replay.run``.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np

from .plan import Piece
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
    (``oracle_probes``)."""
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
    in one write (``TierStore.write_runs``; the runs call from the pool's threads), on a
    writer thread of its own while the runs go on (at most ``WRITES_AHEAD`` events queued;
    ``complete`` waits for them and raises a failed write)."""

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
        self.store.write_runs(self.piece.policies, self.piece.sample, event, block, units=self.piece.units)
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
    ``Outputs`` of one sample and its units, tiers dropped) and the snapshots taken."""
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
