"""Trace store: schema, creation, opening and validation (docs/trace-format.md#arrays).

One Zarr v3 group per trace. Every array carries ``dimension_names`` so that
``xarray.open_zarr`` gives named dims; 1-D coordinate arrays carry the index of each dim.

Arrays (shapes with dims; ``Hs`` = the stored head dim: ``kv_head``, ``head``, or ``head``
of length 1 for ``--heads mean``; ``T`` = max prompt length + max_new_tokens):

    attn            [sample, step, layer, Hs, pos]          f16/f32  decode rows, NaN beyond query_pos
                    [sample, step, layer, Hs, window]       (resolution=window: window sums)
    attn_sink       [sample, step, layer, Hs, sink]         (resolution=window only)
    prefill_colsum  [sample, layer, Hs, pos]                f32      mass each prompt token got from prompt queries
    prefill_tail    [sample, layer, Hs, obs, pos]           f16/f32  last obs_window prefill rows
    prefill_tail_qpos [sample, obs]                         i32      query position of each tail row (-1: none)
    tokens          [sample, pos]                           i32      prompt + generated ids, pad = -1
    prompt_len      [sample]                                i32
    n_steps         [sample]                                i32      valid steps per sample
    query_pos       [sample, step]                          i32      = prompt_len - 1 + step (-1 beyond n_steps)
    token_id        [sample, step]                          i32      = tokens[prompt_len + step]
    q               [sample, qpos, layer, head, dim]        f16/f32  optional, post-RoPE queries
    k, v            [sample, layer, kv_head, pos, dim]      f16/f32  optional, post-RoPE keys / values
                                                                     (MLA: [.., head, ..] each query head's own,
                                                                     v over ``vdim`` where its size differs)
    attn_learned_sink [sample, step, layer, Hs]             f32      learned sinks only: the sink's share of each
    prefill_learned_sink [sample, layer, Hs]                f32      row, its sum over the prompt's rows,
    prefill_tail_learned_sink [sample, layer, Hs, obs]      f32      and its share of each tail row
    rope_inv_freq   [layer, rope_freq]                      f32      optional, rotary inverse frequencies
    rope_attention_scaling [layer]                          f32      optional
    policy_tiers    [sample, event, layer, kv_head, pos]    i8       optional (trace --policy): tiers of the
                                                                     live cache after deciding at steps
                                                                     0, w, 2w, … (−1 none, 0 EVICTED, 1 Q, 2 FP)
    policy_bytes    [sample, step]                          f64      its bytes by the byte model (docs/concepts.md#budget)
    policy_cache_bytes [sample, step]                       i64      nbytes of its tensors
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .. import defaults
from ..errors import StoreError, first_line
from ..model.spec import ModelSpec
from . import dataset  # noqa: F401  (registers the ds.kvscope accessor on every opened trace)
from .rowformat import ROW_ARRAYS, RowFormat
from .schema import SCHEMA_VERSION, Layout, schema

if TYPE_CHECKING:
    import xarray as xr


@contextlib.contextmanager
def walking_members():
    """zarr warns about the writer's lock files (``.kvscope-lock``, and the shards'
    ``.kvscope-lock.*``) when it lists a group's members; the files are ours, not stray objects.
    Silenced only around the calls that walk a store."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Object at \.kvscope-lock(\.[\w-]+)? is not recognized")
        yield


def consolidate(path) -> None:
    """Consolidate a store's metadata (only once it is complete: docs/trace-format.md#capture). zarr's note that
    consolidated metadata is not part of the v3 specification is kvscope's to know, not the
    user's (a shard of ``trace --dask`` consolidates inside a worker, whose stderr is the CLI's)."""
    import zarr

    with walking_members(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Consolidated metadata is currently not part")
        zarr.consolidate_metadata(str(path))


def stop_background_io(timeout: float = 10.0) -> None:
    """Cancel the chunk reads and writes still under way on zarr's event loop (a thread of its
    own) and wait for them to end. A read of several chunks fails at its first bad chunk and
    leaves the others running there; when zarr closes the loop at exit, under them, each prints
    ``RuntimeError: Event loop is closed`` with a traceback. Nothing to do before zarr is used."""
    sync = sys.modules.get("zarr.core.sync")
    loop = sync.loop[0] if sync is not None else None
    if loop is None or loop.is_closed() or not loop.is_running():
        return
    with contextlib.suppress(TimeoutError):  # a task that ignores its cancellation is left to zarr
        asyncio.run_coroutine_threadsafe(_cancel_tasks(), loop).result(timeout)


async def _cancel_tasks() -> None:
    """Every other task of the running loop cancelled, and ended."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    for task in others:
        task.cancel()
    if others:
        await asyncio.wait(others)


COORD_VARIABLES = ("query_pos", "token_id", "prompt_len", "n_steps", "prefill_tail_qpos")


def compressors(clevel: int = 1):
    """blosc-zstd level 1 with bit-shuffle (lossless), then a CRC32C checksum so that a
    truncated or damaged chunk is refused when read instead of decoding to garbage (blosc
    stores small chunks uncompressed and cannot tell). On fp16 attention rows zstd level 5
    saves only 0.5% more and costs 4× the CPU time, which the writer thread takes from
    decoding. (``kvscope compact``, offline, writes level 9: on rounded rows it saves ~4%.)"""
    import zarr

    return [zarr.codecs.BloscCodec(cname="zstd", clevel=clevel, shuffle="bitshuffle"), zarr.codecs.Crc32cCodec()]


def create(path: Path, layout: Layout, attrs: dict, row_clevel: int = 1) -> None:
    """Create the group and preallocate every array of ``schema`` at full size (chunks
    are written later); coordinates hold the index of their dim; ``row_clevel``: zstd's level
    for the probability rows (``kvscope.storage.rowformat.ROW_ARRAYS``)."""
    import zarr

    root = zarr.open_group(str(path), mode="w", zarr_format=3, attributes=attrs)
    coords, arrays = schema(layout)
    for name, n in coords:
        root.create_array(name, shape=(n,), dtype="int32", dimension_names=(name,), fill_value=0, compressors=None)
        root[name][:] = layout.coordinate(name, n)
    for a in arrays:
        root.create_array(
            a.name,
            shape=a.shape,
            dtype=a.dtype,
            chunks=a.chunks,
            dimension_names=a.dims,
            fill_value=a.fill,
            filters=[zarr.codecs.TransposeCodec(order=a.transpose)] if a.transpose else None,
            compressors=compressors(row_clevel if a.name in ROW_ARRAYS else 1),
        )


# -- reading ------------------------------------------------------------------------


def read_attrs(path: str | os.PathLike) -> dict:
    """Group attributes, with a clear error for anything that is not a kvscope store."""
    from .integrity import group_attributes

    p = Path(path)
    attrs = group_attributes(p, "trace store")
    if "schema_version" not in attrs:
        raise StoreError(f"{p} is not a kvscope trace (no schema_version attribute)")
    version = attrs["schema_version"]
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise StoreError(f"{p} has schema version {version!r}, not a kvscope schema version")
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{p} has schema version {version}, newer than this kvscope supports ({SCHEMA_VERSION}); upgrade kvscope"
        )
    return attrs


@dataclass
class CheckedStore:
    """A trace store that passed every check of ``kvscope.storage.integrity`` on open."""

    path: Path
    attrs: dict
    layout: Layout
    store: object  # kvscope.storage.integrity.TraceStore: every read checked
    committed: np.ndarray  # [sample] committed steps
    prompt_len: np.ndarray  # [sample]
    small: dict  # the small arrays read and checked on open (query_pos, token_id, tokens, …)


def check_store(path: str | os.PathLike) -> CheckedStore:
    """Attributes, schema and the small arrays of a trace (``kvscope.storage.integrity``), one line
    naming what and where for the first problem."""
    from .integrity import check_attrs, check_schema, check_small_arrays, read_metas

    p = Path(path)
    attrs = read_attrs(p)
    check_attrs(p, attrs)
    layout, arrays = check_schema(p, attrs, read_metas(p))
    store, committed, prompt_len, small = check_small_arrays(p, attrs, layout, arrays)
    return CheckedStore(
        path=p, attrs=attrs, layout=layout, store=store, committed=committed, prompt_len=prompt_len, small=small
    )


def open_trace(path: str | os.PathLike, chunks: str | dict | None = None) -> xr.Dataset:
    """Open a trace as a lazily loaded ``xarray.Dataset`` with named dims and coordinates,
    after the checks of ``check_store``; every chunk it reads is checked too.

    Only committed steps are visible: ``n_steps`` and ``query_pos`` say which rows exist, and in
    a partial store uncommitted rows read as NaN (lazily: a partial store opens dask-backed).
    The Dataset has the ``ds.kvscope`` accessor
    ([`TraceAccessor`][kvscope.storage.dataset.TraceAccessor]).

    Args:
        path: The store (``*.zarr``).
        chunks: None gives lazily indexed arrays; ``{}`` dask arrays with the store's chunks
            (one block of steps × one layer); ``"analysis"`` dask arrays of as many of those
            blocks of steps as one analysis task reads; any other value is passed to xarray.

    Raises:
        StoreError: Not a trace store, or a damaged one (one line naming the problem).
    """
    import xarray as xr

    checked = check_store(path)
    complete = checked.attrs["status"] == "complete"
    if not complete and chunks is None:
        chunks = {}
    if chunks == "analysis":
        chunks = analysis_chunks(checked.layout)
    try:  # never the consolidated copy of the metadata: the arrays' own, which check_store checked
        with walking_members(), warnings.catch_warnings():
            # query_pos and token_id are stored whole per sample (and replaced below by the checked copies)
            warnings.filterwarnings("ignore", message="The specified chunks separate the stored chunks")
            ds = xr.open_zarr(checked.store, chunks=chunks, consolidated=False, zarr_format=3)
    except Exception as exc:
        raise StoreError(f"cannot open {path}: {first_line(exc)}") from exc
    ds = ds.set_coords([name for name in COORD_VARIABLES if name in ds])
    ds = ds.assign_coords(
        n_steps=("sample", checked.committed.astype(np.int32)),
        query_pos=(("sample", "step"), checked.small["query_pos"]),
        token_id=(("sample", "step"), checked.small["token_id"]),
    )
    if not complete:
        ds = _committed_only(ds, checked)
    ds.attrs = dict(checked.attrs)
    return ds


def analysis_chunks(layout: Layout, task_bytes: int = defaults.ANALYSIS_TASK_BYTES) -> dict:
    """``{"step": n}``: the most whole blocks of steps whose stored rows (one sample × one layer)
    fit in ``task_bytes``, at least one block. A task then reads its rows in one zarr call: on a
    2-core machine a read of 1 MiB chunks spends more time in zarr's and dask's per-call Python
    than in decompression, and reading 16 of them per call halved it (docs/performance.md)."""
    attn = next(spec for spec in schema(layout)[1] if spec.name == "attn")
    block = int(np.prod(attn.chunks)) * np.dtype(attn.dtype).itemsize
    blocks = max(1, task_bytes // block)
    return {"step": min(layout.n_steps, blocks * layout.block_steps)}


def _committed_only(ds, checked: CheckedStore):
    """Rows of uncommitted steps (a killed writer's half-written block) hidden as NaN."""
    import xarray as xr

    step_ok = xr.DataArray(np.arange(ds.sizes["step"])[None, :] < checked.committed[:, None], dims=("sample", "step"))
    for name in [v for v in ("attn", "attn_sink", "policy_bytes") if v in ds]:
        ds[name] = ds[name].where(step_ok)
    return ds


def _continuation_kind(attrs: dict) -> str | None:
    """What a trace forced after any question: ``"gold answer"`` (its prompts carry answers),
    ``"given continuation"``, or None where it forced nothing."""
    from ..model.prompts import has_answers

    if attrs.get("continuation_tokens") is None:
        return None
    prompts = attrs.get("prompts")
    return "gold answer" if isinstance(prompts, list) and any(map(has_answers, prompts)) else "given continuation"


def store_info(path: str | os.PathLike) -> dict:
    """Summary for ``kvscope info``: model, dims, status, sizes and compression."""
    import zarr

    attrs = check_store(path).attrs
    group = zarr.open_group(str(path), mode="r", use_consolidated=False)
    arrays = {}
    total_stored = total_logical = 0
    with walking_members():
        members = sorted(group.arrays())
    for name, arr in members:
        stored = stored_bytes(Path(path) / name / "c")
        chunk_bytes = int(np.prod(arr.chunks)) * arr.dtype.itemsize
        logical = arr.nchunks_initialized * chunk_bytes
        arrays[name] = {
            "dims": list(arr.metadata.dimension_names or ()),
            "shape": list(arr.shape),
            "dtype": str(arr.dtype),
            "stored_bytes": stored,
            "logical_bytes": int(logical),
        }
        total_stored += stored
        total_logical += logical
    model = attrs.get("model", {})
    spec = ModelSpec.from_config(model["config"])
    return {
        "path": str(path),
        "cache": spec.geometry(),
        "cache_line": spec.geometry_line(),
        "status": attrs.get("status"),
        "schema_version": attrs.get("schema_version"),
        "kvscope_version": attrs.get("kvscope_version"),
        "model": model.get("name"),
        "model_source": model.get("source"),
        "dims": dict(zip(arrays["attn"]["dims"], arrays["attn"]["shape"])),
        "heads": attrs.get("heads"),
        "resolution": attrs.get("resolution"),
        "dtype": attrs.get("dtype"),
        "row_format": RowFormat.of(attrs).attrs(attrs.get("n_sink")),
        "attn_kernel": attrs.get("attn_kernel"),
        "attn_output": attrs.get("attn_output", "kernel"),
        "steps_committed": attrs.get("steps_committed"),
        "samples_done": attrs.get("samples_done"),
        "question_tokens": attrs.get("question_tokens"),  # forced steps per sample (question-agnostic)
        "continuation_tokens": attrs.get("continuation_tokens"),  # forced steps per sample (continuation, answer)
        "continuation_kind": _continuation_kind(attrs),
        "stored_bytes": int(total_stored),
        "logical_bytes": int(total_logical),
        "compression_ratio": (total_logical / total_stored) if total_stored else None,
        "arrays": arrays,
    }


def stored_bytes(folder: Path) -> int:
    """Bytes of the chunks under ``folder``; while other shards write the store, a chunk zarr is
    replacing (``*.partial``, renamed over the chunk) is not counted."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            if not name.endswith(".partial"):
                with contextlib.suppress(FileNotFoundError):
                    total += os.path.getsize(os.path.join(root, name))
    return total
