"""Attention rows recomputed from recorded queries and keys (``--record qkv``).

For step ``t`` with query position ``q = P − 1 + t``, layer ``l`` and query head ``h``::

    a[t, l, h, p] = softmax_p( softcap(q[q, l, h] · k[l, h // g, p] · scaling_l) ),  p ≤ q

(``g`` query heads per KV head; ``scaling_l`` and the softcap from the trace attributes,
``head_dim^−½`` and none when absent), then averaged over the heads of a KV group when
``heads="kv"``. Returns rows shaped like ``attn`` — ``[sample, step, layer, kv_head, pos]``
float32, NaN beyond ``q`` — as dask blocks of one (sample, layer), so the analyses accept
them wherever they accept stored rows. Sliding-window layers see only their window.
"""

from __future__ import annotations

import dask
import dask.array as dsa
import numpy as np
import xarray as xr

from ..errors import KvscopeError


def _layer_rows(q, k, qpos, scaling, softcap, window, heads):
    """q [qpos, head, D], k [kv_head, pos, D], qpos [step] -> [1, step, 1, Hs, pos] float32."""
    n_heads, n_kv = q.shape[1], k.shape[0]
    g = n_heads // n_kv
    n_pos = k.shape[1]
    out = np.full((len(qpos), n_heads if heads == "all" else n_kv, n_pos), np.nan, dtype=np.float32)
    kk = np.nan_to_num(k.astype(np.float32))
    for t, qp in enumerate(qpos):
        if qp < 0:
            continue
        qv = q[qp].astype(np.float32).reshape(n_kv, g, -1)  # [kv, g, D]
        scores = np.einsum("kgd,kpd->kgp", qv, kk[:, : qp + 1]) * scaling
        if softcap:
            scores = np.tanh(scores / softcap) * softcap
        if window:
            scores[..., : max(0, qp - window + 1)] = -np.inf
        scores -= scores.max(-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(-1, keepdims=True)
        out[t, :, : qp + 1] = probs.reshape(n_heads, -1) if heads == "all" else probs.mean(1)
    return out[None, :, None]


def attention_params(ds: xr.Dataset) -> tuple[list[float], float | None, list[int | None]]:
    """``(scaling [layer], softcap, sliding_window [layer])`` of the traced model: the
    recorded per-layer scaling (``head_dim^−½`` when absent), the logit softcap, and the
    window of each sliding-attention layer (None for full attention)."""
    config = ds.attrs.get("model", {}).get("config", {})
    head_dim = ds.sizes["dim"] if "dim" in ds.sizes else int(config.get("head_dim") or 64)
    n_layers = ds.sizes["layer"]
    scaling = [s if s is not None else head_dim**-0.5 for s in (config.get("attention_scaling") or [None] * n_layers)]
    layer_types = config.get("layer_types") or []
    window = config.get("sliding_window")
    windows = [
        window if (layer_types and layer_types[layer] == "sliding_attention") or (not layer_types and window) else None
        for layer in range(n_layers)
    ]
    return scaling, config.get("attn_logit_softcapping"), windows


def rows_from_qk(ds: xr.Dataset, heads: str = "kv") -> xr.DataArray:
    """Rows ``[sample, step, layer, kv_head|head, pos]`` recomputed from ``q`` and ``k``."""
    if "q" not in ds or "k" not in ds:
        raise KvscopeError("this trace has no recorded q/k (trace with --record qkv)")
    scaling, softcap, windows = attention_params(ds)
    n_layers = ds.sizes["layer"]
    qpos = np.asarray(ds["query_pos"].values)
    n_samples, n_steps = qpos.shape
    n_pos = ds.sizes["pos"]
    n_out = ds.sizes["head"] if heads == "all" else ds.sizes["kv_head"]
    blocks = []
    for s in range(n_samples):
        row = []
        for layer in range(n_layers):
            sliding = windows[layer]
            task = dask.delayed(_layer_rows)(
                ds["q"].data[s, :, layer] if hasattr(ds["q"].data, "dask") else ds["q"][s, :, layer].values,
                ds["k"].data[s, layer] if hasattr(ds["k"].data, "dask") else ds["k"][s, layer].values,
                qpos[s],
                scaling[layer],
                softcap,
                sliding,
                heads,
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
    """The trace with ``attn`` replaced by rows recomputed from q/k (for every analysis)."""
    out = ds.drop_vars([v for v in ("attn", "attn_sink") if v in ds]).copy()
    rows = rows_from_qk(ds, heads)
    if rows.dims[3] not in out.dims:
        out = out.assign_coords({rows.dims[3]: rows[rows.dims[3]].values})
    out["attn"] = rows.assign_coords(query_pos=ds["query_pos"])
    out.attrs = {**ds.attrs, "resolution": "token", "heads": heads, "rows": "recomputed from q/k"}
    return out
