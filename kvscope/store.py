"""Trace store: schema, creation, opening and validation (SPEC §3, docs/trace-format.md).

One Zarr v3 group per trace. Every array carries ``dimension_names`` so that
``xarray.open_zarr`` gives named dims; 1-D coordinate arrays carry the index of each dim.

Arrays (shapes with dims; ``Hs`` = the stored head dim: ``kv_head``, ``head``, or ``head``
of length 1 for ``--heads mean``; ``T`` = max prompt length + max_new_tokens)::

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
    rope_inv_freq   [layer, rope_freq]                      f32      optional, rotary inverse frequencies
    rope_attention_scaling [layer]                          f32      optional
    policy_tiers    [sample, event, layer, kv_head, pos]    i8       optional (trace --policy): tiers of the
                                                                     live cache after deciding at steps
                                                                     0, w, 2w, … (−1 none, 0 EVICTED, 1 Q, 2 FP)
    policy_bytes    [sample, step]                          f64      its bytes by the SPEC §5 accounting
    policy_cache_bytes [sample, step]                       i64      nbytes of its tensors
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import dataset  # noqa: F401  (registers the ds.kvscope accessor on every opened trace)
from .errors import StoreError

SCHEMA_VERSION = 1
REQUIRED_ARRAYS = (
    "attn",
    "prefill_colsum",
    "prefill_tail",
    "prefill_tail_qpos",
    "tokens",
    "prompt_len",
    "n_steps",
    "query_pos",
    "token_id",
)
QKV_ARRAYS = ("q", "k", "v", "rope_inv_freq", "rope_attention_scaling")


@contextlib.contextmanager
def walking_members():
    """zarr warns about the writer's lock file when it lists a group's members; the file is
    ours, not a stray object. Silenced only around the calls that walk a store."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Object at \.kvscope-lock is not recognized")
        yield


def consolidate(path) -> None:
    """Consolidate a store's metadata (only once it is complete: SPEC §2)."""
    import zarr

    with walking_members():
        zarr.consolidate_metadata(str(path))


COORD_VARIABLES = ("query_pos", "token_id", "prompt_len", "n_steps", "prefill_tail_qpos")


def compressors():
    """blosc-zstd level 1 with bit-shuffle (lossless), then a CRC32C checksum so that a
    truncated or damaged chunk is refused when read instead of decoding to garbage (blosc
    stores small chunks uncompressed and cannot tell). On fp16 attention rows zstd level 5
    saves only 0.5% more and costs 4× the CPU time, which the writer thread takes from
    decoding."""
    import zarr

    return [zarr.codecs.BloscCodec(cname="zstd", clevel=1, shuffle="bitshuffle"), zarr.codecs.Crc32cCodec()]


def steps_last(dims: tuple[str, ...]):
    """Transpose codec that lays each chunk out with ``step`` fastest: the same key's
    probability at consecutive steps sits side by side, which bit-shuffle compresses
    better (0.67 vs 0.68 of raw fp16 on SmolLM2 rows). Standard Zarr v3, read anywhere."""
    import zarr

    order = [i for i, d in enumerate(dims) if d != "step"] + [dims.index("step")]
    return [zarr.codecs.TransposeCodec(order=tuple(order))]


@dataclass(frozen=True)
class Layout:
    """Sizes of every dim of one store, and how arrays are chunked."""

    n_samples: int
    n_steps: int  # max_new_tokens
    n_layers: int
    n_heads: int  # query heads of the model
    n_kv_heads: int
    head_dim: int
    heads: str  # all | kv | mean
    resolution: str  # token | window
    n_pos: int  # T = max prompt length + max_new_tokens
    obs_window: int
    n_sink: int
    window: int
    block_steps: int
    record_qkv: bool
    dtype: str  # float16 | float32
    rope_freqs: int = 0
    policy_events: int = 0  # > 0: traced under a live policy cache (tier snapshots)

    @property
    def head_dim_name(self) -> str:
        return "kv_head" if self.heads == "kv" else "head"

    @property
    def n_stored_heads(self) -> int:
        return {"all": self.n_heads, "kv": self.n_kv_heads, "mean": 1}[self.heads]

    @property
    def n_windows(self) -> int:
        return max(0, -(-(self.n_pos - self.n_sink) // self.window))

    @property
    def pos_block(self) -> int:
        return 256


@dataclass(frozen=True)
class ArraySpec:
    """One array of the schema: what ``create`` makes and what a reader may expect."""

    name: str
    shape: tuple[int, ...]
    dims: tuple[str, ...]
    dtype: str
    chunks: tuple[int, ...]
    fill: float | int


def _spec(name, dims, dtype, sizes: dict, chunks: dict, fill=float("nan")) -> ArraySpec:
    """An array over ``dims`` whose chunk is the whole dim except where ``chunks`` says."""
    shape = tuple(sizes[d] for d in dims)
    return ArraySpec(name, shape, dims, dtype, tuple(max(1, chunks.get(d, sizes[d])) for d in dims), fill)


def schema(L: Layout) -> tuple[list[tuple[str, int]], list[ArraySpec]]:
    """``(coordinates, arrays)`` of a store with layout ``L`` (SPEC §3; the module docstring).
    Rows and prefill arrays are chunked per sample, block of steps and layer; q/k/v per
    sample, layer and block of positions."""
    hs, f = L.head_dim_name, L.dtype
    sizes = {
        "sample": L.n_samples, "step": L.n_steps, "layer": L.n_layers, "pos": L.n_pos, "obs": L.obs_window,
        "window": L.n_windows, "sink": L.n_sink, "qpos": L.n_pos, "head": L.n_heads, "kv_head": L.n_kv_heads,
        "dim": L.head_dim, "rope_freq": L.rope_freqs, "event": L.policy_events,
        hs: L.n_stored_heads,  # the stored head dim (one "head" for --heads mean)
    }  # fmt: skip
    rows = {"sample": 1, "step": L.block_steps, "layer": 1}
    per_sample = {"sample": 1}
    coords = ["sample", "step", "layer", hs, "pos", "obs"]
    last = "pos" if L.resolution == "token" else "window"
    arrays = [_spec("attn", ("sample", "step", "layer", hs, last), f, sizes, rows)]
    if L.resolution == "window":
        coords += ["window", "sink"]
        arrays.append(_spec("attn_sink", ("sample", "step", "layer", hs, "sink"), f, sizes, rows))
    arrays += [
        _spec("prefill_colsum", ("sample", "layer", hs, "pos"), "float32", sizes, {"sample": 1, "layer": 1}),
        _spec("prefill_tail", ("sample", "layer", hs, "obs", "pos"), f, sizes, {"sample": 1, "layer": 1}),
        _spec("prefill_tail_qpos", ("sample", "obs"), "int32", sizes, per_sample, -1),
        _spec("tokens", ("sample", "pos"), "int32", sizes, per_sample, -1),
        _spec("prompt_len", ("sample",), "int32", sizes, {}, 0),
        _spec("n_steps", ("sample",), "int32", sizes, {}, 0),
        _spec("query_pos", ("sample", "step"), "int32", sizes, per_sample, -1),
        _spec("token_id", ("sample", "step"), "int32", sizes, per_sample, -1),
    ]
    if L.record_qkv:
        coords += ["qpos"] + [d for d in ("head", "kv_head") if d != hs] + ["dim", "rope_freq"]
        pb = L.pos_block
        arrays += [
            _spec("q", ("sample", "qpos", "layer", "head", "dim"), f, sizes, {"sample": 1, "qpos": pb, "layer": 1}),
            _spec("k", ("sample", "layer", "kv_head", "pos", "dim"), f, sizes, {"sample": 1, "layer": 1, "pos": pb}),
            _spec("v", ("sample", "layer", "kv_head", "pos", "dim"), f, sizes, {"sample": 1, "layer": 1, "pos": pb}),
            _spec("rope_inv_freq", ("layer", "rope_freq"), "float32", sizes, {}),
            _spec("rope_attention_scaling", ("layer",), "float32", sizes, {}),
        ]
    if L.policy_events:
        coords += ["event"] + (["kv_head"] if hs != "kv_head" and not L.record_qkv else [])
        arrays += [
            _spec("policy_tiers", ("sample", "event", "layer", "kv_head", "pos"), "int8", sizes, {"sample": 1, "event": 1}, -1),
            _spec("policy_bytes", ("sample", "step"), "float64", sizes, per_sample),
            _spec("policy_cache_bytes", ("sample", "step"), "int64", sizes, per_sample, -1),
        ]  # fmt: skip
    return [(name, sizes[name]) for name in coords], arrays


def create(path: Path, layout: Layout, attrs: dict) -> None:
    """Create the group and preallocate every array of :func:`schema` at full size (chunks
    are written later); coordinates hold the index of their dim."""
    import zarr

    root = zarr.open_group(str(path), mode="w", zarr_format=3, attributes=attrs)
    coords, arrays = schema(layout)
    for name, n in coords:
        root.create_array(name, shape=(n,), dtype="int32", dimension_names=(name,), fill_value=0, compressors=None)
        root[name][:] = np.arange(n, dtype=np.int32)
    comp = compressors()
    for a in arrays:
        root.create_array(
            a.name,
            shape=a.shape,
            dtype=a.dtype,
            chunks=a.chunks,
            dimension_names=a.dims,
            fill_value=a.fill,
            filters=steps_last(a.dims) if "step" in a.dims and len(a.dims) > 2 else None,
            compressors=comp,
        )


# -- reading ------------------------------------------------------------------------


def read_attrs(path: str | os.PathLike) -> dict:
    """Group attributes, with a clear error for anything that is not a kvscope store."""
    p = Path(path)
    if not p.exists():
        raise StoreError(f"no trace store at {p}")
    meta = p / "zarr.json"
    if not p.is_dir() or not meta.is_file():
        raise StoreError(f"{p} is not a Zarr v3 store (no zarr.json)")
    try:
        doc = json.loads(meta.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StoreError(f"{p}/zarr.json is unreadable or truncated ({exc.__class__.__name__})") from exc
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        raise StoreError(f"{p} is not a Zarr v3 group")
    attrs = doc.get("attributes") or {}
    version = attrs.get("schema_version")
    if version is None:
        raise StoreError(f"{p} is not a kvscope trace (no schema_version attribute)")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise StoreError(
            f"{p} has schema version {version}, newer than this kvscope supports ({SCHEMA_VERSION}); upgrade kvscope"
        )
    return attrs


def validate(path: str | os.PathLike) -> dict:
    """Check schema version, required arrays, shapes, committed steps and chunk files.

    Returns the group attributes. Chunk *contents* are verified by :func:`verify_chunks`.
    """
    p = Path(path)
    attrs = read_attrs(p)
    required = list(REQUIRED_ARRAYS)
    if attrs.get("resolution") == "window":
        required.append("attn_sink")
    if attrs.get("record_qkv"):
        required += list(QKV_ARRAYS)
    missing = [name for name in required if not (p / name / "zarr.json").is_file()]
    if missing:
        raise StoreError(f"{p} is missing arrays: {', '.join(missing)}")
    metas = {}
    for name in required:
        try:
            metas[name] = json.loads((p / name / "zarr.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise StoreError(f"{p}/{name}/zarr.json is unreadable or truncated") from exc
    shape = metas["attn"]["shape"]
    n_samples, n_steps = shape[0], shape[1]
    committed = attrs.get("steps_committed")
    if not isinstance(committed, list) or len(committed) != n_samples:
        raise StoreError(f"{p}: steps_committed must list one count per sample ({n_samples})")
    if any((not isinstance(c, int)) or c < 0 or c > n_steps for c in committed):
        raise StoreError(f"{p}: steps_committed {committed} outside 0..{n_steps}")
    for name in ("tokens", "query_pos", "token_id", "prefill_colsum"):
        if metas[name]["shape"][0] != n_samples:
            raise StoreError(f"{p}: array {name} has {metas[name]['shape'][0]} samples, attn has {n_samples}")
    block = metas["attn"]["chunk_grid"]["configuration"]["chunk_shape"][1]
    n_layers = shape[2]
    for s, c in enumerate(committed):
        for b in range(-(-c // block)):
            for layer in range(n_layers):
                chunk = p / "attn" / "c" / str(s) / str(b) / str(layer) / "0" / "0"
                if not chunk.is_file():
                    raise StoreError(
                        f"{p}: chunk attn/c/{s}/{b}/{layer}/0/0 of committed steps is missing (truncated store)"
                    )
    return attrs


def verify_chunks(path: str | os.PathLike, names=("attn",)) -> None:
    """Decode every committed chunk of ``names`` (bounded memory); raise on corruption."""
    import zarr

    attrs = validate(path)
    group = zarr.open_group(str(path), mode="r")
    for name in names:
        arr = group[name]
        block = arr.chunks[1]
        for s, c in enumerate(attrs["steps_committed"]):
            for t0 in range(0, c, block):
                for layer in range(arr.shape[2]):
                    try:
                        arr[s, t0 : min(c, t0 + block), layer]
                    except Exception as exc:  # noqa: BLE001 - any codec error means corruption
                        raise StoreError(
                            f"{path}: chunk {name}[sample {s}, steps {t0}.., layer {layer}] is corrupt "
                            f"({exc.__class__.__name__})"
                        ) from exc


def open_trace(path: str | os.PathLike, chunks=None, validate_store: bool = True):
    """Open a trace as a lazily loaded ``xarray.Dataset`` with named dims and coordinates.

    ``chunks=None`` gives lazily indexed arrays; ``chunks={}`` dask arrays with the store's
    chunks (one block of steps × one layer); any other value is passed to xarray.
    Rows at ``step >= n_steps[sample]`` are not part of the trace (NaN, or uncommitted
    data in a killed partial store).
    """
    import xarray as xr

    attrs = validate(path) if validate_store else read_attrs(path)
    complete = attrs.get("status") == "complete"
    try:
        with walking_members():
            ds = xr.open_zarr(str(path), chunks=chunks, consolidated=complete, zarr_format=3)
    except Exception as exc:  # noqa: BLE001
        raise StoreError(f"cannot open {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    ds = ds.set_coords([name for name in COORD_VARIABLES if name in ds])
    if not complete:
        ds = ds.assign_coords(n_steps=("sample", np.asarray(attrs["steps_committed"], dtype=np.int32)))
    ds.attrs = dict(attrs)
    return ds


def store_info(path: str | os.PathLike) -> dict:
    """Summary for ``kvscope info``: model, dims, status, sizes and compression."""
    import zarr

    attrs = validate(path)
    group = zarr.open_group(str(path), mode="r")
    arrays = {}
    total_stored = total_logical = 0
    with walking_members():
        members = sorted(group.arrays())
    for name, arr in members:
        stored = _stored_bytes(Path(path) / name / "c")
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
    return {
        "path": str(path),
        "status": attrs.get("status"),
        "schema_version": attrs.get("schema_version"),
        "kvscope_version": attrs.get("kvscope_version"),
        "model": model.get("name"),
        "model_source": model.get("source"),
        "dims": dict(zip(arrays["attn"]["dims"], arrays["attn"]["shape"])),
        "heads": attrs.get("heads"),
        "resolution": attrs.get("resolution"),
        "dtype": attrs.get("dtype"),
        "attn_kernel": attrs.get("attn_kernel"),
        "steps_committed": attrs.get("steps_committed"),
        "samples_done": attrs.get("samples_done"),
        "stored_bytes": int(total_stored),
        "logical_bytes": int(total_logical),
        "compression_ratio": (total_logical / total_stored) if total_stored else None,
        "arrays": arrays,
    }


def _stored_bytes(folder: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            total += os.path.getsize(os.path.join(root, name))
    return total
