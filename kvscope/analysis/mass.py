"""Unit masses and cumulative scores of a trace (docs/concepts.md#windows; units: ``kvscope.windows``):

    m[t, j] = Σ_{p∈j} a[t, p]                                       per-step mass (not cumulative)
    c[t, j] = Σ_{p∈j} prefill_colsum[p] + Σ_{1≤t'≤t} m[t', j]       with the prompt's column mass
            = Σ_{0≤t'≤t} m[t', j]                                   without it

(step 0's row is the prompt's last row, which the column sums already hold).

Every function takes and returns xarray objects with named dims; the trace-unit dims are
``sample``, ``layer`` and the stored head dim (``kv_head`` or ``head``). Arrays stay lazy
(dask) when the trace was opened with ``chunks=``.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from ..errors import KvscopeError
from ..windows import Units, window_rows
from .kernels import block_stats, new_checks, refuse_bad_rows, row_checks, row_totals


def rows(ds: xr.Dataset, layers=None, heads=None) -> xr.DataArray:
    """Token attention rows ``[sample, step, layer, H, pos]`` (NaN beyond query_pos)."""
    if ds.attrs.get("resolution") == "window":
        raise KvscopeError("this analysis needs token-resolution rows; the store has window sums")
    return _subset(ds["attn"], layers, heads)


def head_dim(da: xr.DataArray) -> str:
    return "kv_head" if "kv_head" in da.dims else "head"


def _subset(da: xr.DataArray, layers=None, heads=None) -> xr.DataArray:
    if layers is not None:
        da = da.sel(layer=list(layers))
    if heads is not None:
        da = da.sel({head_dim(da): list(heads)})
    return da


def unit_mass(
    ds: xr.Dataset, units: Units, layers: tuple[int, ...] | None = None, heads: tuple[int, ...] | None = None
) -> xr.DataArray:
    """Per-step unit mass ``m [sample, step, layer, H, unit]`` (0 where nothing exists).

    Token granularity: the rows themselves. Window granularity: sums of ``w`` positions,
    from token rows or from a window-resolution store (whose ``w`` must divide ``units.w``
    and whose ``n_sink`` must match).

    Args:
        ds: The trace.
        units: The units.
        layers: The layers by the model's index (default all).
        heads: Indices of the stored head dim (default all).
    """
    if units.kind == "token":
        return rows(ds, layers, heads).fillna(0).astype(np.float64)
    if ds.attrs.get("resolution") == "window":
        stored_w, stored_sink = int(ds.attrs["w"]), int(ds.attrs["n_sink"])
        if stored_sink != units.n_sink or units.w % stored_w:
            raise KvscopeError(
                f"the store holds windows of {stored_w} after {stored_sink} sinks; "
                f"asked for windows of {units.w} after {units.n_sink}"
            )
        m = _checked_windows(ds, layers, heads).fillna(0).astype(np.float64)
        factor = units.w // stored_w
        if factor > 1:
            n = (m.sizes["window"] // factor) * factor
            m = m.isel(window=slice(0, n)).coarsen(window=factor).sum()
            m = m.assign_coords(window=np.arange(m.sizes["window"]))
        return m
    import dask.array as dsa

    a = stored_rows(ds, layers, heads)
    n_units = units.count(a.sizes["pos"])
    c = a.data.chunks
    q = dsa.from_array(ds.kvscope.query_pos[:, :, None, None, None], chunks=(c[0], c[1], 1, 1, 1))
    chunks = c[:-1] + ((n_units,),)
    args = (units.n_sink, n_units, units.w, ds.kvscope.rows.slack)
    shares = sink_shares(ds, a.data, layers, heads)  # [sample, step, layer, H, 1]: what the rows sum to, 1 − σ
    data = dsa.map_blocks(_row_masses, a.data, q, shares, *args, dtype=np.float64, chunks=chunks)
    coords = {k: v for k, v in a.coords.items() if "pos" not in v.dims}
    return xr.DataArray(data, dims=a.dims[:-1] + ("window",), coords={**coords, "window": np.arange(n_units)})


def _checked_windows(ds: xr.Dataset, layers=None, heads=None) -> xr.DataArray:
    """A window-resolution store's window sums ``[sample, step, layer, H, window]``, each block
    checked with its sinks as probability rows when it is read."""
    import dask.array as dsa

    attn = _subset(ds["attn"], layers, heads)
    sinks = _subset(ds["attn_sink"], layers, heads).transpose(*attn.dims[:-1], "sink")
    if not isinstance(attn.data, dsa.Array):
        attn, sinks = attn.chunk({"step": ds.kvscope.block_steps}), sinks.chunk({"step": ds.kvscope.block_steps})
    c = attn.data.chunks
    sinks_data = sinks.data.rechunk(c[:-1] + ((sinks.sizes["sink"],),))
    q = dsa.from_array(ds.kvscope.query_pos[:, :, None, None, None], chunks=(c[0], c[1], 1, 1, 1))
    acc = ds.kvscope
    shares = sink_shares(ds, attn.data, layers, heads)
    data = dsa.map_blocks(
        _refuse_bad_windows, attn.data, sinks_data, q, shares, acc.n_sink, acc.w, acc.rows.slack, dtype=attn.dtype
    )
    return attn.copy(data=data)


def _refuse_bad_windows(windows, sinks, q, shares, n_sink: int, w: int, slack: float) -> np.ndarray:
    rows, last = window_rows(windows, sinks, np.broadcast_to(q[..., 0], windows.shape[:-1]), n_sink=n_sink, w=w)
    flat = rows.reshape(-1, 1, rows.shape[-1])
    totals = row_totals(np.broadcast_to(shares[..., 0], windows.shape[:-1]).reshape(-1, 1))
    refuse_bad_rows(row_checks(flat, last.reshape(-1), slack, totals), "attn window rows")
    return windows


def _row_masses(block, q, shares, first: int, n_units: int, w: int, slack: float) -> np.ndarray:
    """``window_masses`` of a block of stored rows, checked against their learned sink's shares."""
    return window_masses(block, q, first, n_units=n_units, w=w, slack=slack, shares=shares)


def window_masses(
    block: np.ndarray, q, first: int, n_units: int, w: int, slack: float = 0.0, shares=None
) -> np.ndarray:
    """``[..., pos]`` rows (fp16 or fp32, NaN = nothing stored) → ``[..., window]`` float64
    masses: ``kvscope.windows.window_sums`` of the rows in float32, compiled
    (``kvscope.analysis.kernels.row_block_stats``), so the same bits whichever way the rows
    were chunked. ``q`` (broadcastable to the leading dims) places each row's query; rows with a
    query are checked as probability rows (stored with relative error ``slack``; summing to
    ``1 − σ`` with ``shares`` σ broadcastable to ``[..., 1]``) on the way, ``q = None`` (column
    sums) are not."""
    lead, n_pos = block.shape[:-1], block.shape[-1]
    rows_ = block.reshape(-1, 1, n_pos)  # [row, 1, pos]
    out = np.empty((rows_.shape[0], 1, n_units))
    query = np.full(lead, -1, dtype=np.int64) if q is None else np.broadcast_to(q[..., 0], lead)  # [..row dims]
    no_fp = np.empty((rows_.shape[0], 0), dtype=np.int64)
    checks = new_checks(slack)
    totals = None if shares is None else row_totals(np.broadcast_to(shares[..., 0], lead).reshape(-1, 1))
    block_stats(
        rows_, query.reshape(-1), no_fp, n_sink=first, w=w, n_units=n_units, k=0, n_bins=1, windows=out,
        stats=np.empty((1, 1)), checks=checks, totals=totals,
    )  # fmt: skip
    refuse_bad_rows(checks, "attn rows")
    return out.reshape(*lead, n_units)


def stored_rows(ds: xr.Dataset, layers=None, heads=None) -> xr.DataArray:
    """Token rows as stored (fp16 by default, NaN beyond query_pos), as dask blocks of one
    block of steps × one layer × all positions ``[sample, step, layer, H, pos]``."""
    import dask.array as dsa

    a = rows(ds, layers, heads)
    order = ("sample", "step", "layer", head_dim(a), "pos")
    a = a.transpose(*order)
    if not isinstance(a.data, dsa.Array):
        a = a.chunk({"sample": 1, "step": ds.kvscope.block_steps, "layer": 1})
    return a.copy(data=a.data.rechunk({4: -1}))


def sink_shares(ds: xr.Dataset, like, layers=None, heads=None):
    """The learned sink's share ``σ`` of each stored row (``attn_learned_sink``: the row sums to
    ``1 − σ``; NaN where no row is) as dask blocks ``[sample, step, layer, H, 1]`` aligned with
    ``like`` (the dask array of the stored rows or window sums); zeros without learned sinks."""
    import dask.array as dsa

    chunks = like.chunks[:4] + ((1,),)
    if "attn_learned_sink" not in ds:
        return dsa.zeros(tuple(sum(c) for c in chunks), chunks=chunks)
    share = _subset(ds["attn_learned_sink"], layers, heads).transpose("sample", "step", "layer", ...)
    data = share.data if isinstance(share.data, dsa.Array) else dsa.from_array(share.values)
    return data[..., None].rechunk(chunks)


def prefill_unit_mass(
    ds: xr.Dataset, units: Units, layers: tuple[int, ...] | None = None, heads: tuple[int, ...] | None = None
) -> xr.DataArray:
    """Prefill column sums per unit ``[sample, layer, H, unit]`` (window masses as for rows:
    ``window_masses``, one task per stored chunk).

    Args:
        ds: The trace.
        units: The units.
        layers: The layers by the model's index (default all).
        heads: Indices of the stored head dim (default all).
    """
    import dask.array as dsa

    col = _subset(ds["prefill_colsum"], layers, heads)
    if units.kind == "token":
        return col.fillna(0)
    col = col.transpose(..., "pos")
    n_units = units.count(col.sizes["pos"])
    if ds.attrs.get("resolution") == "window":  # as many units as the stored rows: the last may be partial
        n_units = ds.sizes["window"] // (units.w // int(ds.attrs["w"]))
        col = col.pad(pos=(0, max(0, units.n_sink + n_units * units.w - col.sizes["pos"])))  # NaN: nothing there
    args = (None, units.n_sink, n_units, units.w)
    if isinstance(col.data, dsa.Array):
        data = col.data.rechunk({-1: -1})
        data = data.map_blocks(window_masses, *args, dtype=np.float64, chunks=data.chunks[:-1] + ((n_units,),))
    else:
        data = window_masses(np.asarray(col.values), *args)
    coords = {k: v for k, v in col.coords.items() if "pos" not in v.dims}
    return xr.DataArray(data, dims=col.dims[:-1] + ("window",), coords={**coords, "window": np.arange(n_units)})


def cumulative_scores(m: xr.DataArray, prefill: xr.DataArray | None = None) -> xr.DataArray:
    """Cumulative scores ``c[t, j] = Σ_{t' ≤ t} m[t', j]`` (with the prompt's column mass for
    the last prompt row when ``prefill`` is given): ``[sample, step, layer, H, unit]``.

    Args:
        m: ``[sample, step, layer, H, unit]`` per-step unit mass.
        prefill: ``[sample, layer, H, unit]`` the prompt's column mass per unit.
    """
    c = m.cumsum("step")
    if prefill is not None:
        c = c - m.isel(step=0) + prefill
    return c.transpose(*m.dims)


def existence(query_pos: xr.DataArray, units: Units, n_units: int) -> xr.DataArray:
    """``[sample, step, unit]`` True where the unit exists at the step (its last position ≤
    the query's).

    Args:
        query_pos: ``[sample, step]`` the trace's query positions.
        units: The units.
        n_units: Units along the unit dim.
    """
    last = units.last_position(n_units)
    q = np.asarray(query_pos.values)
    exists = last[None, None, :] <= q[..., None]
    return xr.DataArray(exists, dims=("sample", "step", units.dim), coords={"sample": query_pos["sample"]})
