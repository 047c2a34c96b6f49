"""Where a replay result goes: the tiers stream into a Zarr v3 store one snapshot at a time,
and a result store appears at its path only once it is complete.

    out given    DIR/.NAME.partial-<pid>-<random>   (tiers streamed, then every other variable)
                 → os.rename → DIR/NAME              refused when DIR/NAME exists; removed on failure
    no out       TMPDIR/kvscope-replay-*             (the tiers only), removed once nothing can read
                                                     them lazily any more (weakref.finalize)

Every chunk of every array is written (``write_empty_chunks``: also those equal to the fill
value), so a chunk missing from a result store is damage, never an all-NaN block; the group's
attributes carry their own CRC32C (``attributes_checksum``), since a result is written once.

A disk (or quota) that fills up is one line naming what was being written and the space it
needs (``kvscope.storage.paths.no_space``), once the partial folder is removed.

Two writers racing for the same path each write their own partial folder; the first rename
wins, the second fails (Linux refuses to rename onto a non-empty directory) and its partial
folder is removed, so a result store is always one writer's complete result. Every chunk
carries a CRC32C checksum after the compressor (``kvscope.storage.store.compressors``), so a
damaged chunk is refused when read.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xarray as xr

from ..errors import KvscopeError
from ..storage.paths import block_size, disk_full, no_space
from ..storage.store import compressors

RUN = ("policy", "allocation", "budget")  # one run of a replay result: the leading dims of its arrays
TIER_DIMS = (*RUN, "sample", "event", "layer", "kv_head", "pos")
SNAPSHOT_INDEX = len(RUN) + 2  # (…run, sample, event) name one snapshot
CHECKSUM_ATTR = "attributes_crc32c"
RENAME_REFUSED = (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR)


def refuse_existing(path) -> None:
    """Results are never overwritten: one line naming ``path`` when anything is there."""
    if os.path.lexists(path):
        raise _exists(path)


def _exists(path) -> KvscopeError:
    return KvscopeError(f"{path} exists; choose another --out (results are never overwritten)")


@contextlib.contextmanager
def written_in_place(path):
    """Yields a fresh folder ``DIR/.NAME.partial-<pid>-<random>`` beside ``path = DIR/NAME``,
    renamed to ``path`` when the block completes and removed when it fails (Ctrl-C included).
    ``path`` is checked before and again just before the rename (which refuses a file or a
    non-empty directory by itself; only an empty directory made in between could be replaced)."""
    path = Path(path)
    refuse_existing(path)
    partial = path.parent / f".{path.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        partial.mkdir(parents=True)
    except OSError as exc:
        raise KvscopeError(f"cannot write {path}: {exc.strerror}") from exc
    try:
        yield partial
        refuse_existing(path)
        rename_into_place(partial, path)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def rename_into_place(partial: Path, path: Path) -> None:
    """``os.rename``; on Linux it refuses a file or a non-empty directory at ``path``, which
    is what makes two writers of one path safe: the second is told with one line."""
    try:
        os.rename(partial, path)
    except OSError as exc:
        if exc.errno in RENAME_REFUSED and os.path.lexists(path):
            raise _exists(path) from exc
        raise KvscopeError(f"cannot write {path}: {exc.strerror}") from exc


@contextlib.contextmanager
def result_folder(out, needs: Callable[[int, bool], int] | None = None):
    """The folder a replay streams into: ``out``'s partial folder, or a temporary one (removed
    here if the replay fails; afterwards ``lazy_tiers`` owns it). A full disk is one line
    saying what was being written and the space it needs: ``needs(block, whole)``, the bytes
    of the whole result (``whole``) or of its tiers alone in a temporary folder, in whole blocks
    of the file system's ``block`` bytes (``kvscope.replay.result.result_bytes``)."""
    where = Path(out if out is not None else tempfile.gettempdir())
    try:
        if out is not None:
            with written_in_place(out) as partial:
                yield partial
            return
        root = Path(tempfile.mkdtemp(prefix="kvscope-replay-"))
        try:
            yield root
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
    except OSError as exc:
        if not disk_full(exc):
            raise
        what, then = "the replay result", "the partial result is removed"
        if out is None:
            what, then = "the replayed tiers in the temporary folder", f"{then}; set TMPDIR to a folder with space"
        needed = needs(block_size(where), out is not None) if needs is not None else None
        raise no_space(where, what, needed, then) from exc


def tier_chunks(shape: tuple[int, ...], block: tuple[int, int] | None = None) -> tuple[int, ...]:
    """One chunk per snapshot and ``block`` of (layers, KV heads) (default all): ``[1, 1, 1, 1, 1,
    layers, kv_heads, pos]`` — a replay task of some units writes chunks of its own (docs/replay.md)."""
    chunks = (1,) * SNAPSHOT_INDEX + tuple(shape[SNAPSHOT_INDEX:])
    return chunks if block is None else chunks[:SNAPSHOT_INDEX] + tuple(block) + chunks[-1:]


class TierStore:
    """``tiers [policy, allocation, budget, sample, event, layer, kv_head, pos]`` int8 in the group at
    ``root``, each snapshot written as it is taken; ``complete`` then writes −1 (none)
    into the snapshots never taken (events past a sample's steps). ``block``: the (layers, KV
    heads) of one chunk (a task's). Without ``shape``, the existing store at ``root`` (a dask worker's view)."""

    def __init__(self, root: Path, shape: tuple[int, ...] | None = None, block: tuple[int, int] | None = None):
        import zarr

        self.root = Path(root)
        if shape is None:
            self.array = zarr.open_array(str(self.root / "tiers"), mode="r+")
        else:
            group = zarr.open_group(str(root), mode="w-", zarr_format=3)
            self.array = group.create_array(
                "tiers", shape=shape, chunks=tier_chunks(shape, block), dtype="int8", fill_value=-1,
                dimension_names=TIER_DIMS, compressors=compressors(), config={"write_empty_chunks": True},
            )  # fmt: skip
        # [policy, allocation, budget, sample, event]
        self.taken = np.zeros(self.array.shape[:SNAPSHOT_INDEX], dtype=bool)

    def write(self, index: tuple[int, ...], tiers: np.ndarray, units: tuple[slice, slice] = (slice(None),) * 2) -> None:
        """Snapshot ``tiers [layer, kv_head, n ≤ pos]`` of ``units`` (layers, KV heads) at
        ``(policy, allocation, budget, sample, event)``."""
        self.array[index + tuple(units)] = self._padded(tiers)
        self.taken[index] = True

    def write_runs(self, policies, sample: int, event: int, tiers: np.ndarray, units=(slice(None),) * 2) -> None:
        """The snapshots of every allocation and budget of ``policies`` at ``(sample, event)``,
        ``tiers [policy, allocation, budget, layer, kv_head, n ≤ pos]``, in one call (zarr
        encodes and writes their chunks together: a call per snapshot costs several times more)."""
        policies = np.asarray(policies, dtype=np.int64)
        contiguous = bool((np.diff(policies) == 1).all())
        at = slice(int(policies[0]), int(policies[-1]) + 1) if contiguous else policies
        self.array.set_orthogonal_selection((at, slice(None), slice(None), sample, event, *units), self._padded(tiers))
        self.taken[at, :, :, sample, event] = True

    def _padded(self, tiers: np.ndarray) -> np.ndarray:
        """``tiers [..., n ≤ pos]`` → ``[..., pos]``: a sample shorter than the longest, the rest none."""
        n_pos = self.array.shape[-1]
        if tiers.shape[-1] < n_pos:
            tiers = np.concatenate([tiers, np.full(tiers.shape[:-1] + (n_pos - tiers.shape[-1],), -1, np.int8)], -1)
        return tiers

    def complete(self) -> None:
        """Every snapshot not taken written as −1, so that every chunk of the store exists."""
        none = np.full(self.array.shape[SNAPSHOT_INDEX:], -1, dtype=np.int8)  # [layer, kv_head, pos]
        for index in np.argwhere(~self.taken):
            self.array[tuple(int(i) for i in index)] = none
        self.taken[...] = True

    def lazy(self, temporary: bool):
        """The tiers as a dask array reading this store; a temporary store is removed when the
        zarr array that every lazy view of it refers to is collected (or at exit)."""
        import dask.array as da
        import zarr

        array = zarr.open_array(str(self.root / "tiers"), mode="r")
        if temporary:
            weakref.finalize(array, shutil.rmtree, str(self.root), True)
        return da.from_zarr(array)


def attributes_checksum(attrs: dict) -> str:
    """CRC32C (8 hex digits) of the attributes other than itself, as JSON with sorted keys."""
    import google_crc32c

    doc = json.dumps({k: v for k, v in attrs.items() if k != CHECKSUM_ATTR}, sort_keys=True, allow_nan=False)
    return f"{google_crc32c.value(doc.encode()):08x}"


def write_variables(ds: xr.Dataset, path, mode: str) -> None:
    """``ds`` into the Zarr v3 store at ``path`` (``mode`` "w-": a new store, "a": beside the
    streamed tiers), every chunk written, each with blosc-zstd and a CRC32C checksum, the
    attributes with theirs, metadata consolidated. The labels keep zarr's fixed-length string
    type, which it flags as unstable: not said."""
    from zarr.errors import UnstableSpecificationWarning

    ds = ds.drop_encoding()
    ds.attrs = {**ds.attrs, CHECKSUM_ATTR: attributes_checksum(ds.attrs)}
    encoding = {name: {"compressors": compressors()} for name in ds.variables}
    if "tiers" in ds:
        ds["tiers"] = ds["tiers"].chunk(dict(zip(TIER_DIMS, tier_chunks(ds["tiers"].shape))))
        encoding["tiers"]["fill_value"] = -1
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UnstableSpecificationWarning)
        warnings.filterwarnings("ignore", message=".*Consolidated metadata.*")
        ds.to_zarr(str(path), mode=mode, zarr_format=3, consolidated=True, encoding=encoding, write_empty_chunks=True)
