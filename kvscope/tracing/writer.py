"""Background writer for a trace store (docs/trace-format.md#capture).

The decode loop hands finished blocks of steps to ``StoreWriter``, which writes them
on a background thread and bumps ``steps_committed`` in the group attributes only after
the block's chunks are written (each chunk and the group's ``zarr.json`` are replaced
atomically by zarr's LocalStore). A killed run therefore loses at most the block in flight
and always leaves a store that opens. Metadata is consolidated only when the trace is
complete. An exclusive ``flock`` on ``STORE/.kvscope-lock`` refuses a second writer; the
kernel drops it when the writer dies, even on SIGKILL. The lock file is opened with
``O_NOFOLLOW``: a lock that is a symbolic link is refused, never followed.

Shards (``trace --shard i/n``) write one store together: each holds ``.kvscope-lock`` *shared*
(an exclusive writer is refused while any shard runs, and a shard while one writes) and its
own ``.kvscope-lock.shard-i`` exclusively (one process per shard). A shard's writer
(``shared=True``) commits under ``.kvscope-lock.commit``: it reads the attributes again,
changes only its own samples' entries of ``steps_committed``/``samples_done``, and writes the
arrays whose chunks hold several samples (``n_steps``) there too; every other chunk holds one
sample, so shards never write the same chunk.
"""

from __future__ import annotations

import errno
import fcntl
import os
import queue
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import StoreError

LOCK_NAME = ".kvscope-lock"
COMMIT_LOCK = f"{LOCK_NAME}.commit"


def _open_lock(folder: Path, create: bool, name: str = LOCK_NAME) -> int:
    """A descriptor of ``folder/.kvscope-lock`` (read-write and created when ``create``, else
    read-only), never opened through a symbolic link (a crafted store must not make kvscope
    truncate or write the file a link points to)."""
    path = folder / name
    flags = os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY)
    try:
        return os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreError(f"{path} is a symbolic link; kvscope never locks or writes through a link") from None
        raise StoreError(f"cannot open the lock file {path}: {exc.strerror}") from None


class StoreLock:
    """A writer lock on a store folder: ``folder/name`` held exclusively, or shared (the shards
    of one store), never waiting unless ``wait``."""

    def __init__(self, path: Path, name: str = LOCK_NAME, shared: bool = False):
        self.path = Path(path)
        self.name, self.shared = name, shared
        self.handle = None

    def acquire(self, wait: bool = False) -> StoreLock:
        self.path.mkdir(parents=True, exist_ok=True)
        handle = os.fdopen(_open_lock(self.path, create=True, name=self.name), "r+")
        try:
            mode = fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX
            fcntl.flock(handle, mode if wait else mode | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "another process"
            handle.close()
            raise StoreError(f"{self.path} is being written by another kvscope process (pid {owner})") from None
        if not self.shared:
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
        self.handle = handle
        return self

    @staticmethod
    def held_by_other(path: Path, shared: bool = False) -> bool:
        """Another process holds the writer lock of the store at ``path`` (``shared``: holds it
        exclusively, so that a shard may not join)."""
        if not os.path.lexists(Path(path) / LOCK_NAME):
            return False
        with os.fdopen(_open_lock(Path(path), create=False)) as handle:
            try:
                fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
        return False

    def release(self) -> None:
        if self.handle is not None:
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            self.handle.close()
            self.handle = None


@contextmanager
def commit_lock(path: Path):
    """The short exclusive lock under which shards change the attributes they share."""
    lock = StoreLock(path, COMMIT_LOCK).acquire(wait=True)
    try:
        yield
    finally:
        lock.release()


@dataclass
class Block:
    """One block of decode steps for the samples of one batch.

    ``writes`` holds (array name, region, data): the data is written to ``array[region]``.
    ``commit`` maps sample index -> committed steps after this block. ``release`` is called once
    the writer no longer reads the data (written, or dropped after a failure): the decode loop
    reuses the buffers behind it.
    """

    writes: list[tuple[str, tuple, np.ndarray]] = field(default_factory=list)
    commit: dict[int, int] = field(default_factory=dict)
    done: dict[int, bool] = field(default_factory=dict)
    release: Callable[[], None] | None = None


class StoreWriter:
    """Writes blocks on a background thread; the main thread never blocks on I/O
    unless a block is already queued (back-pressure: the time it then waits is summed in
    ``waited_s``, the times in ``waits``), so a killed run loses at most the block being
    written besides the steps not yet handed over.

    ``create``: a new store is made by this callable (returning the writer locks it holds) as
    the thread's first job, so that its creation overlaps the prompt's prefill; ``created``
    says whether it succeeded (a failure is raised on the main thread like a failed write)."""

    def __init__(
        self,
        path: Path,
        committed: list[int],
        done: list[bool],
        max_queue: int = 1,
        shared: bool = False,
        create: Callable[[], list[StoreLock]] | None = None,
    ):
        self.path = Path(path)
        self.shared = shared  # a shard's writer: commits under the commit lock (module docstring)
        self._spanning: dict[str, bool] = {}
        self.group = None if create is not None else self._open()
        self._create = create
        self.created = False  # the store was made by ``create`` (and ``locks`` are held)
        self.locks: list[StoreLock] = []
        self.committed = list(committed)
        self.done = list(done)
        self.bytes_written = 0
        self.waited_s, self.waits = 0.0, 0  # back-pressure: the decode loop's waits for a place in the queue
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvscope-writer", daemon=True)
        self._thread.start()

    def submit(self, block: Block) -> None:
        self._raise_if_failed()
        try:
            self._queue.put_nowait(block)
        except queue.Full:
            t0 = time.perf_counter()
            self._queue.put(block)
            self.waited_s += time.perf_counter() - t0
            self.waits += 1

    def flush(self) -> None:
        self._queue.join()
        self._raise_if_failed()

    def close(self) -> None:
        self.abandon()
        self._raise_if_failed()

    def abandon(self) -> None:
        """Stop once the blocks already handed over are written (or failed); raises nothing."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _open(self):
        import zarr

        return zarr.open_group(str(self.path), mode="r+")

    def _run(self) -> None:
        if self._create is not None:
            try:
                self.locks = self._create()
                self.created = True
                self.group = self._open()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
                self._error = exc
        while True:
            block = self._queue.get()
            try:
                if block is None:
                    return
                if self._error is None:
                    self._write(block)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
                self._error = exc
            finally:
                if block is not None and block.release is not None:
                    block.release()
                self._queue.task_done()

    def _write(self, block: Block) -> None:
        own, common = [], []
        for w in block.writes:
            (common if self.shared and self._spans_samples(w[0]) else own).append(w)
        for name, region, data in own:
            self._put(self.group, name, region, data)
        if not (common or block.commit or block.done):
            return
        for sample, steps in block.commit.items():
            self.committed[sample] = int(steps)
        for sample, flag in block.done.items():
            self.done[sample] = bool(flag)
        if not self.shared:
            self.group.attrs.update({"steps_committed": self.committed, "samples_done": self.done})
            return
        import zarr

        with commit_lock(self.path):
            group = zarr.open_group(str(self.path), mode="r+")  # read again: the other shards' commits
            for name, region, data in common:
                self._put(group, name, region, data)
            committed, done = list(group.attrs["steps_committed"]), list(group.attrs["samples_done"])
            for sample in block.commit:
                committed[sample] = self.committed[sample]
            for sample in block.done:
                done[sample] = self.done[sample]
            group.attrs.update({"steps_committed": committed, "samples_done": done})

    def _put(self, group, name: str, region: tuple, data: np.ndarray) -> None:
        group[name][region] = data
        self.bytes_written += data.nbytes

    def _spans_samples(self, name: str) -> bool:
        """A chunk of ``name`` holds several samples (``n_steps``): shards write it in turn."""
        if name not in self._spanning:
            self._spanning[name] = self.group[name].chunks[0] > 1
        return self._spanning[name]
