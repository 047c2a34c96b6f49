"""Attention rows recomputed from recorded queries and keys (``--record qkv``).

For step ``t`` with query position ``q = P − 1 + t``, layer ``l`` and query head ``h``, with
the model's attention rule (``kvscope.model.attention``: scaling, softcap, sliding window of
layer ``l``, from the trace's model config):

    a[t, l, h, p] = softmax_p( softcap(q[q, l, h] · k[l, h // g, p] · scaling_l) ),  p ≤ q

then averaged over the heads of a KV group when ``heads="kv"``. Returns rows shaped like
``attn`` — ``[sample, step, layer, kv_head, pos]`` float32, NaN beyond ``q`` — as dask blocks
of one (sample, layer), so the analyses accept them wherever they accept stored rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import xarray as xr

from ..errors import KvscopeError

if TYPE_CHECKING:  # torch is imported by the recomputation only: reading a trace never needs it
    from ..model.attention import AttentionRule

STEP_BLOCK = 64  # steps whose logits are computed together: [steps, head, pos] float32 at a time


def layer_rows(q, k, qpos, rule: AttentionRule, heads: str, q_first: int = 0, per_unit: int = 1) -> np.ndarray:
    """q [qpos − q_first, head, D], k [key_head, pos, D], qpos [step] -> [1, step, 1, Hs, pos]
    float32; kv-group rows average the heads of each cache unit, ``per_unit`` key heads each (1 but
    under MLA, where every query head has its own key and the layer's one latent serves them all)."""
    import torch

    from ..model.attention import grouped

    n_heads, n_kv, n_pos = q.shape[1], k.shape[0], k.shape[1]
    n_units = n_kv // per_unit
    out = np.full((len(qpos), n_heads if heads == "all" else n_units, n_pos), np.nan, dtype=np.float32)
    keys = torch.from_numpy(np.nan_to_num(np.asarray(k, dtype=np.float32)))  # [kv, pos, D]
    k_pos = torch.arange(n_pos)
    steps = np.flatnonzero(np.asarray(qpos) >= 0)
    g = n_heads // n_kv
    for b0 in range(0, len(steps), STEP_BLOCK):
        block = steps[b0 : b0 + STEP_BLOCK]
        rows = np.asarray(qpos)[block]
        queries = torch.from_numpy(np.asarray(q[rows - q_first], dtype=np.float32))  # [n, head, D]
        qg = grouped(queries[:, :, None, :], n_kv)  # [n, kv, g, D]
        q_at = torch.from_numpy(rows)[:, None, None, None]
        hidden = np.arange(n_pos)[None, None, :] > rows[:, None, None]
        # one KV head at a time: a head's rows do not depend on the heads computed with it
        # (a replay task of some KV heads recomputes exactly the whole trace's rows there)
        for j in range(n_kv):
            probs = rule.of_kv_heads(j, 1, n_kv).probs(qg[:, j : j + 1], keys[j : j + 1], q_at, k_pos)  # [n, 1, g, pos]
            if heads == "all":
                out[block, j * g : (j + 1) * g] = np.where(hidden, np.nan, probs[:, 0].numpy())
                continue
            row = probs.mean(2).numpy()  # [n, 1, pos]
            u = j // per_unit
            if j % per_unit == 0:
                out[block, u : u + 1] = row
            else:  # MLA: a unit's row averages every head (each with its own key)
                out[block, u : u + 1] += row
            if j % per_unit == per_unit - 1:
                if per_unit > 1:
                    out[block, u : u + 1] /= per_unit
                out[block, u : u + 1] = np.where(hidden, np.nan, out[block, u : u + 1])
    return out[None, :, None]


def rows_from_qk(ds: xr.Dataset, heads: str = "kv") -> xr.DataArray:
    """Rows ``[sample, step, layer, kv_head|head, pos]`` recomputed from ``q`` and ``k`` with
    the model's attention rule.

    Args:
        ds: A trace recorded with ``--record qkv``.
        heads: ``kv`` (kv-group mean rows) or ``all`` (every query head).
    """
    import dask  # here, not at the top: `kvscope verify` and `info` read the package without dask
    import dask.array as dsa

    if "q" not in ds or "k" not in ds:
        raise KvscopeError("this trace has no recorded q/k (trace with --record qkv)")
    model = ds.kvscope.model
    n_layers = ds.sizes["layer"]
    qpos = ds.kvscope.query_pos
    n_samples, n_steps = qpos.shape
    n_pos = ds.sizes["pos"]
    n_out = ds.sizes["head"] if heads == "all" else model.n_kv_heads
    blocks = []
    for s in range(n_samples):
        row = []
        for layer in range(n_layers):
            task = dask.delayed(layer_rows)(
                ds["q"].data[s, :, layer] if hasattr(ds["q"].data, "dask") else ds["q"][s, :, layer].values,
                ds["k"].data[s, layer] if hasattr(ds["k"].data, "dask") else ds["k"][s, layer].values,
                qpos[s],
                model.rule(layer),
                heads,
                0,
                model.n_key_heads // model.n_kv_heads,
            )
            row.append(dsa.from_delayed(task, shape=(1, n_steps, 1, n_out, n_pos), dtype=np.float32))
        blocks.append(dsa.concatenate(row, axis=2))
    data = dsa.concatenate(blocks, axis=0)
    hdim = "head" if heads == "all" else "kv_head"
    return xr.DataArray(
        data,
        dims=("sample", "step", "layer", hdim, "pos"),
        coords={
            "sample": ds["sample"].values,
            "step": ds["step"].values,
            "layer": ds["layer"].values,
            hdim: np.arange(n_out),
            "pos": ds["pos"].values,
        },
        name="attn",
    )


def with_recomputed_rows(ds: xr.Dataset, heads: str = "kv") -> xr.Dataset:
    """The trace with ``attn`` replaced by rows recomputed from q/k (for every analysis).

    Args:
        ds: A trace recorded with ``--record qkv``.
        heads: ``kv`` (kv-group mean rows) or ``all`` (every query head).
    """
    out = ds.drop_vars([v for v in ("attn", "attn_sink") if v in ds]).copy()
    rows = rows_from_qk(ds, heads)
    if rows.dims[3] not in out.dims:
        out = out.assign_coords({rows.dims[3]: rows[rows.dims[3]].values})
    out["attn"] = rows.assign_coords(query_pos=ds["query_pos"])
    kept = {k: v for k, v in ds.attrs.items() if k != "row_format"}  # recomputed rows are not rounded
    out.attrs = {**kept, "resolution": "token", "heads": heads, "rows": "recomputed from q/k"}
    return out
