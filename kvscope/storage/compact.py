"""``kvscope compact IN OUT --rows FORMAT``: a copy of a complete trace whose probability rows
are stored in a lossy row format (``kvscope.storage.rowformat``: rounded once here, then written
through the store's usual lossless codecs), everything else as it was, bit for bit.

    summary = compact("traces/demo.zarr", "traces/demo-round4.zarr", "round4")

The input is read through the checks of ``kvscope.storage.store.check_store`` (every chunk's
CRC32C, chunks missing inside the committed steps refused); only a complete trace stored
exactly is converted (rounding a rounded store would add a second error). The copy is written
chunk by chunk (memory: one chunk) under a temporary name beside ``OUT``, checked with
``kvscope.storage.verify.verify`` (the rows against the format's widened tolerance) and only then
renamed to ``OUT``; on any failure nothing is left. ``OUT`` must not exist.
"""

from __future__ import annotations

import datetime
import itertools
import os
import shutil
from pathlib import Path

from ..errors import KvscopeError
from .paths import output_path
from .rowformat import ATTR, ROW_ARRAYS, RowFormat, row_format
from .store import check_store, consolidate, create, walking_members

CLEVEL = 9  # zstd's level for the rows: written once, offline; on rounded rows ~4% smaller than level 1


def compact(src: str | os.PathLike, dst: str | os.PathLike, rows: str, level: int = CLEVEL) -> dict:
    """Write ``dst``, the trace ``src`` with its rows in format ``rows`` (the module docstring).

    Args:
        src: A complete trace whose rows are exact.
        dst: The new store (it must not exist).
        rows: The row format: ``exact``, or a lossy one (``round4``, ``round3-peaks``, …;
            ``kvscope.storage.rowformat.FORMATS``).
        level: zstd's level (blosc's 1–9; 9: ~2% smaller than 6 on rounded rows and ~25× slower).

    Returns:
        ``{"rows", "in_bytes", "out_bytes", "attn_in_bytes", "attn_out_bytes", "attn_raw_bytes"}``
        (``attn_raw_bytes``: the committed rows' values × their itemsize, uncompressed).

    Raises:
        KvscopeError: A partial or already lossy trace, an existing ``dst``, a bad format or level.
    """
    fmt = row_format(rows)
    if not (isinstance(level, int) and not isinstance(level, bool) and 1 <= level <= 9):
        raise KvscopeError(f"--level must be an integer in 1..9 (got {level!r})")
    src, dst = Path(src), output_path(dst, "OUT", inputs=[src])
    checked = check_store(src)
    if checked.attrs["status"] != "complete":
        raise KvscopeError(f"{src} is a partial trace; compact a complete one (kvscope trace --resume finishes it)")
    have = RowFormat.of(checked.attrs)
    if have.lossy:
        raise KvscopeError(f"{src} already stores its rows as {have.name} (lossy); compact the exact original")
    if os.path.lexists(dst):
        raise KvscopeError(f"OUT {dst} exists; choose another path (compact never overwrites)")
    tmp = dst.with_name(f".{dst.name}.compacting-{os.getpid()}")
    try:
        _write(checked, tmp, fmt, level)
        from .verify import refuse_if_damaged, verify

        refuse_if_damaged(verify(tmp))
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "rows": fmt.name,
        "level": level,
        **_sizes(src, "in"),
        **_sizes(dst, "out"),
        "attn_raw_bytes": _raw_rows(checked),
    }


def _write(checked, tmp: Path, fmt: RowFormat, level: int) -> None:
    """Every array of ``checked`` copied into a new store at ``tmp`` in format ``fmt``."""
    import zarr

    n_sink = checked.layout.n_sink
    attrs = dict(checked.attrs)
    attrs[ATTR] = fmt.attrs(n_sink)
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    attrs["compacted"] = {"from": str(checked.path), "at": now, "zstd_level": level}
    create(tmp, checked.layout, attrs, row_clevel=level)
    source = zarr.open_group(store=checked.store, mode="r", zarr_format=3, use_consolidated=False)
    target = zarr.open_group(str(tmp), mode="r+", zarr_format=3)
    with walking_members():
        names = [name for name, _ in source.arrays()]
    for name in names:
        a, b = source[name], target[name]
        w = 1 if a.metadata.dimension_names[-1] == "window" else checked.layout.window  # values per window of a row
        for region in _chunk_regions(a.shape, a.chunks):
            block = a[region]
            b[region] = fmt.round(block, n_sink, w) if name in ROW_ARRAYS else block
    consolidate(tmp)


def _chunk_regions(shape, chunks):
    """The slices of every chunk of an array (row-major)."""
    ranges = [range(0, n, c) for n, c in zip(shape, chunks, strict=True)]
    for origin in itertools.product(*ranges):
        yield tuple(slice(o, min(o + c, n)) for o, c, n in zip(origin, chunks, shape, strict=True))


def _sizes(path: Path, side: str) -> dict:
    """Bytes on disk of a whole store and of its ``attn`` chunks."""
    from .store import stored_bytes

    return {f"{side}_bytes": stored_bytes(path), f"attn_{side}_bytes": stored_bytes(path / "attn" / "c")}


def _raw_rows(checked) -> int:
    """Bytes of the committed ``attn`` rows, uncompressed: committed steps × the rest of a row's
    shape × the stored itemsize."""
    import numpy as np

    L = checked.layout
    per_step = L.n_layers * L.n_stored_heads * (L.n_pos if L.resolution == "token" else L.n_windows)
    return int(checked.committed.sum()) * per_step * np.dtype(L.dtype).itemsize
