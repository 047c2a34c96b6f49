"""Several analyses of one trace over a single streaming read, in bounded memory.

Two fused stages, each chunk of ``attn`` read and decoded exactly once:

1. per stored chunk (one block of steps × one layer): one compiled, GIL-free pass over its
   rows (:func:`kvscope.analysis.kernels.row_block_stats`) gives the window masses
   ``[step, H, window]`` and the block's peak and coverage sums — the rows themselves never
   leave the task;
2. per (sample, layer): the window masses of all its steps (``S × H × U`` float64, the memory
   bound) give the history selection shared by FMM, churn and LIR, computed for all heads
   at once.

Only a few numbers per trace unit leave stage 2. (Sharing chunk reads between separate
graphs instead let dask hold converted chunks, and peak memory grew with the trace.)
"""

from __future__ import annotations

import uuid

import numpy as np
import xarray as xr

from .churn import churn
from .common import Prepared, UnitData, make_units
from .fmm import fmm
from .kernels import block_stats, peak_width
from .lir import lir
from .mass import stored_rows
from .peaks import LogQuantSets, n_bins_for, peaks

TASK_BYTES = 256 * 2**20  # window masses per stage-2 task: all heads of a (sample, layer) unless larger


def study(
    ds: xr.Dataset,
    *,
    w: int | None = None,
    n_sink: int | None = None,
    horizon: int = 32,
    every: int | None = None,
    top_frac: float = 0.2,
    local: int = 64,
    m: int = 4,
    h_lir: int | None = 8,
    k: int = 8,
    logquant_window: int = 32,
    layers=None,
    heads=None,
    n_boot: int = 1000,
    seed: int = 0,
) -> dict[str, xr.Dataset]:
    """``{"fmm", "churn", "lir", "peaks"}`` results, computed from one read of the trace."""
    import dask.array as dsa

    prep = Prepared(ds, make_units(ds, "window", w, n_sink), layers, heads)
    units = prep.units
    shared = dict(every=every, top_frac=top_frac, local=local, n_boot=n_boot, seed=seed, prep=prep, compute=False)
    plans = {
        "fmm": fmm(ds, horizon=horizon, **shared),
        "churn": churn(ds, **shared),
        "lir": lir(ds, m=m, h_lir=h_lir, **shared),
    }
    bounds = np.cumsum([0] + [p.width for p in plans.values()])
    a = stored_rows(ds, layers, heads)
    raw = a.data  # [sample, step, layer, H, pos] as stored (fp16 by default)
    qpos, n_steps_all = prep.query_pos, prep.n_steps
    fp_sets = LogQuantSets(ds, logquant_window)
    n_units, lo, wsize = prep.n_units, units.n_sink, units.w
    n_bins = n_bins_for(raw.shape[-1])
    n_peak = peak_width(n_bins)
    packed_width = n_units + n_peak
    width = int(bounds[-1]) + n_peak

    def per_chunk(x, block_info=None):
        """Stage 1: ``[1, step, 1, H, pos]`` stored rows → ``[1, step, 1, H, U + n_peak]``:
        window masses per step, the block's peak/coverage sums in its first step's row."""
        sample = block_info[0]["chunk-location"][0]
        t0, t1 = block_info[0]["array-location"][1]
        out = np.zeros(x.shape[:4] + (packed_width,))
        fp = fp_sets.block(sample, t0, t1 - t0)
        windows, peak_sums = out[0, :, 0, :, :n_units], out[0, 0, 0, :, n_units:]
        block_stats(x[0, :, 0], qpos[sample, t0:t1], fp, lo, wsize, n_units, k, n_bins, windows, peak_sums)
        return out

    per_head = raw.shape[1] * packed_width * 8  # float64 bytes of one trace unit's window masses
    heads_per_task = max(1, min(raw.shape[3], TASK_BYTES // max(1, per_head)))
    run = uuid.uuid4().hex  # task names: hashing the closures (which hold the dataset) costs more than a stage
    packed = dsa.map_blocks(
        per_chunk, raw, dtype=np.float64, chunks=raw.chunks[:4] + ((packed_width,),), name=f"study-rows-{run}"
    ).rechunk(
        {1: -1, 3: heads_per_task}
    )  # all steps of a (sample, layer): S × H × (U + n_peak) float64, heads split when that is large
    pre = prep.prefill.data[:, None]  # [sample, 1, layer, H, unit]

    def per_sample_layer(y, pb, block_info=None):
        """Stage 2: FMM, churn and LIR of the task's heads from their window masses; peaks summed."""
        sample = block_info[0]["chunk-location"][0]
        masses = np.moveaxis(y[0, :, 0, :, :n_units], 1, 0)  # [H, step, unit]
        u = UnitData(masses, pb[0, 0, 0], qpos[sample], int(n_steps_all[sample]), units)
        out = np.empty((1, 1, 1, y.shape[3], width))
        out[0, 0, 0, :, : bounds[-1]] = np.concatenate([p.per_unit(u) for p in plans.values()], axis=-1)
        out[0, 0, 0, :, bounds[-1] :] = y[0, :, 0, :, n_units:].sum(0)
        return out

    flat = dsa.map_blocks(
        per_sample_layer,
        packed,
        pre.rechunk({3: heads_per_task}),
        dtype=np.float64,
        drop_axis=[4],
        new_axis=[4],
        chunks=(packed.chunks[0], (1,), packed.chunks[2], packed.chunks[3], (width,)),
        name=f"study-units-{run}",
    )[:, 0].compute()  # [sample, layer, H, width]
    results = {name: p.finish(flat[..., bounds[i] : bounds[i + 1]]) for i, (name, p) in enumerate(plans.items())}
    results["peaks"] = peaks(
        ds,
        k=k,
        n_sink=n_sink,
        logquant_window=logquant_window,
        n_boot=min(n_boot, 200),
        seed=seed,
        precomputed=(a, flat[:, None, ..., bounds[-1] :]),
    )
    return results
