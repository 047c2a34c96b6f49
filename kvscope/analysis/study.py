"""Several analyses of one trace over a single streaming read, in bounded memory.

One dask task per (sample, layer) receives all its steps of ``attn`` (``S × H × T`` values,
the memory bound), converts them once, and computes everything there: window masses, the
history selection shared by FMM, churn and LIR, and the peak and coverage statistics. Only
a few numbers per trace unit leave the task. (Sharing chunk reads between separate graphs
instead let dask hold converted chunks, and peak memory grew with the trace.)
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from .churn import churn
from .common import Prepared, UnitData, make_units
from .fmm import fmm
from .lir import lir
from .mass import filled_rows, window_sums
from .peaks import LogQuantSets, _block_rows, n_bins_for, peaks

TASK_BYTES = 256 * 2**20  # rows per task: all heads of a (sample, layer) unless that exceeds this


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
    n_sink_ = units.n_sink
    rows = filled_rows(ds, layers, heads)  # [sample, step, layer, H, pos] float32 blocks
    S_, H_, T_ = rows.shape[1], rows.shape[3], rows.shape[4]
    per_head = S_ * T_ * 4  # float32 bytes of one trace unit's rows
    heads_per_task = max(1, min(H_, TASK_BYTES // max(1, per_head)))
    rows = rows.data.rechunk({1: -1, 3: heads_per_task})  # all steps of a (sample, layer), heads split if large
    pre = prep.prefill.data[:, None].rechunk({3: heads_per_task})  # [sample, 1, layer, H, unit]
    qpos, n_steps_all = prep.query_pos, prep.n_steps
    fp_sets = LogQuantSets(ds, logquant_window)
    n_units, lo, wsize = prep.n_units, units.n_sink, units.w
    n_peak = 2 + n_bins_for(rows.shape[-1]) + 3
    width = int(bounds[-1]) + n_peak

    def per_sample_layer(x, pb, block_info=None):
        sample = block_info[0]["chunk-location"][0]
        m = window_sums(x[0, :, 0], lo, n_units, wsize)  # [step, H, unit]
        out = np.empty((1, 1, 1, x.shape[3], width))
        for h in range(x.shape[3]):
            u = UnitData(m[:, h], pb[0, 0, 0, h], qpos[sample], int(n_steps_all[sample]), units)
            out[0, 0, 0, h, : bounds[-1]] = np.concatenate([p.per_unit(u) for p in plans.values()])
        q = qpos[sample][None, :, None, None, None]
        info = [{"chunk-location": (sample, 0, 0, 0, 0), "array-location": [(sample, sample + 1), (0, x.shape[1])]}]
        out[0, 0, 0, :, bounds[-1] :] = _block_rows(x, q, fp_sets, n_sink_, k, block_info=info, inplace=True)[0, 0, 0]
        return out

    flat = dsa.map_blocks(
        per_sample_layer,
        rows,
        pre,
        dtype=np.float64,
        drop_axis=[4],
        new_axis=[4],
        chunks=(rows.chunks[0], (1,), rows.chunks[2], rows.chunks[3], (width,)),
    )[:, 0].compute()  # [sample, layer, H, width]
    results = {name: p.finish(flat[..., bounds[i] : bounds[i + 1]]) for i, (name, p) in enumerate(plans.items())}
    a = filled_rows(ds, layers, heads)
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
