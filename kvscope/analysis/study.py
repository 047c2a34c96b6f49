"""Several metrics of one trace over a single streaming read, in bounded memory.

Two fused stages, each chunk of ``attn`` read and decoded exactly once:

1. per task of rows (one or more stored blocks of steps × one layer; ``open_trace(chunks=
   "analysis")`` reads several in one call): one compiled, GIL-free pass over its rows
   (``kvscope.analysis.kernels.row_block_stats``) gives the window masses ``[step, H,
   window]`` and each stored block's peak and coverage sums — the rows never leave the task;
2. per (sample, layer): the window masses of all its steps (``S × H × U`` float64, the memory
   bound) go through the per-unit pass of every unit metric (FMM, churn and LIR share one
   history selection), computed for all heads at once.

Only a few numbers per trace unit leave stage 2. (Sharing chunk reads between separate
graphs instead let dask hold converted chunks, and peak memory grew with the trace.)
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import xarray as xr

from ..errors import KvscopeError
from .common import UnitData
from .kernels import block_stats, new_checks, peak_width, refuse_bad_rows, row_totals, step_blocks
from .mass import sink_shares, stored_rows
from .metric import Metric, UnitMetric
from .peaks import LogQuantSets, Peaks, n_bins_for
from .registry import make_all

TASK_BYTES = 256 * 2**20  # window masses per stage-2 task: all heads of a (sample, layer) unless larger
DEFAULT = ("fmm", "churn", "lir", "peaks")


def study(ds: xr.Dataset, metrics: list[str | Metric] | None = None, **params: Any) -> dict[str, xr.Dataset]:
    """``{name: result}`` of ``metrics`` from one read of the trace.

    Args:
        ds: The trace.
        metrics: Metric objects or names (default FMM, churn, LIR and peaks); window metrics
            must share one geometry, and at most one is ``peaks``.
        **params: Fields of the named metrics: each goes to every named metric that has it
            (``study(ds, horizon=8, n_boot=50)``; one that none has is refused).

    Raises:
        KvscopeError: A metric that cannot share the read, or a parameter none of them has.
    """
    chosen = make_all(metrics or DEFAULT, params)
    units = [m for m in chosen if isinstance(m, UnitMetric)]
    rows = [m for m in chosen if isinstance(m, Peaks)]
    if len(units) + len(rows) != len(chosen) or len(rows) > 1 or not units:
        raise KvscopeError("study takes window metrics (fmm, churn, lir, concentration, drift) and at most one peaks")
    if len({m.geometry() for m in units}) > 1:
        raise KvscopeError("the window metrics of a study must share w, n_sink, granularity, layers and heads")
    prep = units[0].prepare(ds)
    if prep.units.kind != "window":
        raise KvscopeError("a study reads window masses (granularity window)")
    peaks = rows[0] if rows else None
    if peaks is not None and (
        peaks.sinks(ds) != prep.units.n_sink or (peaks.layers, peaks.heads) != (units[0].layers, units[0].heads)
    ):
        raise KvscopeError("peaks in a study must use the window metrics' sinks, layers and heads")
    runs = [m.start(prep) for m in units]
    flat, a = _two_stages(ds, prep, units, runs=runs, peaks=peaks)
    bounds = np.cumsum([0] + [m.width(run) for m, run in zip(units, runs)])
    results = {
        m.name: m.reduce(flat[..., bounds[i] : bounds[i + 1]], run) for i, (m, run) in enumerate(zip(units, runs))
    }
    if peaks is not None:
        results[peaks.name] = peaks(ds, precomputed=(a, flat[:, None, ..., bounds[-1] :]))
    return {m.name: results[m.name] for m in chosen}


def _two_stages(ds, prep, units, runs, peaks):
    """``flat [sample, layer, H, Σ widths (+ peak sums)]`` and the stored rows."""
    import dask.array as dsa

    a = stored_rows(ds, prep.layers, prep.heads)
    raw = a.data  # [sample, step, layer, H, pos] as stored (fp16 by default)
    qpos, n_steps_all, u_geom, slack = prep.query_pos, prep.n_steps, prep.units, ds.kvscope.rows.slack
    fp_sets = LogQuantSets(ds, peaks.logquant_window if peaks else 1)
    k = peaks.k if peaks else 0
    n_units, n_bins = prep.n_units, n_bins_for(raw.shape[-1])
    n_peak = peak_width(n_bins) if peaks else 0
    packed_width = n_units + n_peak
    unit_width = sum(m.width(run) for m, run in zip(units, runs))
    width = unit_width + n_peak

    block_steps = ds.kvscope.block_steps

    def per_chunk(x, shares, block_info=None):
        """Stage 1: ``[1, step, 1, H, pos]`` stored rows (``shares [1, step, 1, H, 1]``: their
        learned sink's) → ``[1, step, 1, H, U + n_peak]``: window masses per step, the
        peak/coverage sums of each stored block in the block's first step's row."""
        sample = block_info[0]["chunk-location"][0]
        t0, t1 = block_info[0]["array-location"][1]
        out = np.zeros(x.shape[:4] + (packed_width,))
        fp = fp_sets.block(sample, t0, t1 - t0) if peaks else np.empty((t1 - t0, 0), dtype=np.int64)
        totals = row_totals(shares[0, :, 0, :, 0]) if learned else None
        layer = block_info[0]["array-location"][2][0]
        for a, b in step_blocks(t0, t1 - t0, block_steps):  # per stored block: its peak sums in its first row
            peak_sums = out[0, a, 0, :, n_units:] if peaks else np.empty((x.shape[3], 0))
            checks = new_checks(slack)
            block_stats(x[0, a:b, 0], qpos[sample, t0 + a : t0 + b], fp[a:b], n_sink=u_geom.n_sink, w=u_geom.w,
                        n_units=n_units, k=k, n_bins=n_bins if peaks else 1, windows=out[0, a:b, 0, :, :n_units],
                        stats=peak_sums, checks=checks, totals=None if totals is None else totals[a:b])  # fmt: skip
            refuse_bad_rows(checks, f"attn rows of sample {sample}, steps {t0 + a}–{t0 + b - 1}, layer {layer}")
        return out

    per_head = raw.shape[1] * packed_width * 8  # float64 bytes of one trace unit's window masses
    heads_per_task = max(1, min(raw.shape[3], TASK_BYTES // max(1, per_head)))
    run_id = uuid.uuid4().hex  # task names: hashing the closures (which hold the dataset) costs more than a stage
    learned = "attn_learned_sink" in ds  # rows sum to 1 − σ
    packed = dsa.map_blocks(
        per_chunk,
        raw,
        sink_shares(ds, raw, prep.layers, prep.heads),
        dtype=np.float64,
        chunks=raw.chunks[:4] + ((packed_width,),),
        name=f"study-rows-{run_id}",
    ).rechunk({1: -1, 3: heads_per_task})  # fmt: skip  (all steps of a (sample, layer), heads split when that is large)
    pre = prep.prefill.data[:, None]  # [sample, 1, layer, H, unit]

    def per_sample_layer(y, pb, block_info=None):
        """Stage 2: every unit metric's per-unit pass over the task's heads; peaks summed."""
        sample = block_info[0]["chunk-location"][0]
        masses = np.moveaxis(y[0, :, 0, :, :n_units], 1, 0)  # [H, step, unit]
        u = UnitData(
            masses,
            pb[0, 0, 0],
            qpos[sample],
            n_steps=int(n_steps_all[sample]),
            units=u_geom,
            include_prefill=prep.include_prefill,
        )
        out = np.empty((1, 1, 1, y.shape[3], width))
        out[0, 0, 0, :, :unit_width] = np.concatenate([m.per_unit(u, run) for m, run in zip(units, runs)], axis=-1)
        out[0, 0, 0, :, unit_width:] = y[0, :, 0, :, n_units:].sum(0)
        return out

    flat = dsa.map_blocks(
        per_sample_layer,
        packed,
        pre.rechunk({3: heads_per_task}),
        dtype=np.float64,
        drop_axis=[4],
        new_axis=[4],
        chunks=(packed.chunks[0], (1,), packed.chunks[2], packed.chunks[3], (width,)),
        name=f"study-units-{run_id}",
    )[:, 0].compute()  # [sample, layer, H, width]
    return flat, a
