"""Synthetic traces with the real schema: hand-made fixtures for tests and large stores
for benchmarks. Nothing here is used by ``kvscope trace``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xarray as xr


def dataset_from_rows(
    attn: np.ndarray,  # [sample, step, layer, kv_head, pos] probabilities, NaN beyond query_pos
    prompt_len,
    n_steps=None,
    prefill_colsum: np.ndarray | None = None,  # [sample, layer, kv_head, pos]
    w: int = 8,
    n_sink: int = 4,
    head_dim: int = 64,
) -> xr.Dataset:
    """An in-memory trace Dataset (what ``open_trace`` returns) from given rows."""
    attn = np.asarray(attn, dtype=np.float32)
    S_n, S, L, H, T = attn.shape
    prompt_len = np.broadcast_to(np.asarray(prompt_len, dtype=np.int32), (S_n,))
    n_steps = np.broadcast_to(np.asarray(S if n_steps is None else n_steps, dtype=np.int32), (S_n,))
    step = np.arange(S)
    query_pos = np.where(step[None, :] < n_steps[:, None], prompt_len[:, None] - 1 + step[None, :], -1).astype(np.int32)
    if prefill_colsum is None:
        prefill_colsum = np.zeros((S_n, L, H, T), dtype=np.float32)
    tokens = np.full((S_n, T), -1, dtype=np.int32)
    return xr.Dataset(
        {
            "attn": (("sample", "step", "layer", "kv_head", "pos"), attn),
            "prefill_colsum": (("sample", "layer", "kv_head", "pos"), np.asarray(prefill_colsum, np.float32)),
            "tokens": (("sample", "pos"), tokens),
        },
        coords={
            "sample": np.arange(S_n),
            "step": step,
            "layer": np.arange(L),
            "kv_head": np.arange(H),
            "pos": np.arange(T),
            "query_pos": (("sample", "step"), query_pos),
            "prompt_len": ("sample", prompt_len.copy()),
            "n_steps": ("sample", n_steps.copy()),
        },
        attrs={
            "schema_version": 1,
            "model": {
                "name": "synthetic",
                "config": {"n_layers": L, "n_heads": H, "n_kv_heads": H, "head_dim": head_dim},
            },
            "status": "complete",
            "resolution": "token",
            "heads": "kv",
            "w": w,
            "n_sink": n_sink,
            "block_steps": 32,
            "steps_committed": n_steps.tolist(),
        },
    )


def write_synthetic_store(
    path: str | Path,
    *,
    n_samples: int,
    n_steps: int,
    n_layers: int,
    n_kv: int,
    prompt_len: int,
    block_steps: int = 32,
    seed: int = 0,
    progress=None,
) -> Path:
    """A complete token-resolution store of random rows (fp16), written block by block so
    that stores larger than memory can be made."""
    import zarr

    from .schema import SCHEMA_VERSION, Layout
    from .store import consolidate, create

    rng = np.random.default_rng(seed)
    T = prompt_len + n_steps
    block_steps = min(block_steps, n_steps)  # as a real trace's
    layout = Layout(
        n_samples=n_samples,
        n_steps=n_steps,
        n_layers=n_layers,
        n_heads=n_kv,
        n_kv_heads=n_kv,
        head_dim=64,
        heads="kv",
        resolution="token",
        n_pos=T,
        obs_window=32,
        n_sink=4,
        window=8,
        block_steps=block_steps,
        record_qkv=False,
        dtype="float16",
    )
    attrs = {
        "schema_version": SCHEMA_VERSION,
        "kvscope_version": "synthetic",
        "status": "partial",
        "steps_committed": [0] * n_samples,
        "samples_done": [False] * n_samples,
        "model": {
            "name": "synthetic",
            "config": {"n_layers": n_layers, "n_heads": n_kv, "n_kv_heads": n_kv, "head_dim": layout.head_dim},
        },
        "heads": "kv",
        "head_dim_name": "kv_head",
        "resolution": "token",
        "n_sink": 4,
        "w": 8,
        "obs_window": 32,
        "block_steps": block_steps,
        "record_qkv": False,
        "dtype": "float16",
    }
    path = Path(path)
    create(path, layout, attrs)
    g = zarr.open_group(str(path), mode="r+")
    _write_prompt(g, rng, n_samples, n_steps=n_steps, n_layers=n_layers, n_kv=n_kv, P=prompt_len, obs=layout.obs_window)
    for s in range(n_samples):
        for t0 in range(0, n_steps, block_steps):
            t1 = min(n_steps, t0 + block_steps)
            block = np.full((1, t1 - t0, n_layers, n_kv, T), np.nan, dtype=np.float16)
            for t in range(t0, t1):
                q = prompt_len - 1 + t
                logits = rng.standard_normal((n_layers, n_kv, q + 1), dtype=np.float32) * 2.0
                logits[..., :4] += 4
                p = np.exp(logits - logits.max(-1, keepdims=True))
                block[0, t - t0, :, :, : q + 1] = p / p.sum(-1, keepdims=True)
            g["attn"][s : s + 1, t0:t1] = block
            if progress:
                progress(s, t1)
    g.attrs.update({"status": "complete", "steps_committed": [n_steps] * n_samples, "samples_done": [True] * n_samples})
    consolidate(path)
    return path


def _write_prompt(g, rng, n_samples: int, n_steps: int, n_layers: int, n_kv: int, P: int, obs: int) -> None:
    """Everything but the decode rows: tokens, positions, and the prompt's attention taken as
    uniform over the causal prefix (row ``r`` gives ``1/(r+1)`` to each key ``≤ r``), so the
    column sums ``Σ_{r ≥ p} 1/(r+1)`` add up to ``P`` as a real trace's do."""
    T = P + n_steps
    tokens = rng.integers(0, 1000, (n_samples, T)).astype(np.int32)
    step = np.arange(n_steps)
    g["prompt_len"][:] = np.full(n_samples, P, dtype=np.int32)
    g["n_steps"][:] = np.full(n_samples, n_steps, dtype=np.int32)
    g["tokens"][:] = tokens
    g["token_id"][:] = tokens[:, P:]
    g["query_pos"][:] = np.broadcast_to(P - 1 + step, (n_samples, n_steps)).astype(np.int32)
    colsum = np.full(T, np.nan, dtype=np.float32)
    colsum[:P] = np.cumsum((1.0 / np.arange(1, P + 1))[::-1])[::-1]
    g["prefill_colsum"][:] = np.broadcast_to(colsum, (n_samples, n_layers, n_kv, T))
    qpos = np.arange(P - obs, P)
    tail = np.full((obs, T), np.nan, dtype=np.float16)
    for o, r in enumerate(qpos):
        if r >= 0:
            tail[o, : r + 1] = 1.0 / (r + 1)
    g["prefill_tail"][:] = np.broadcast_to(tail, (n_samples, n_layers, n_kv, obs, T))
    g["prefill_tail_qpos"][:] = np.broadcast_to(np.where(qpos >= 0, qpos, -1), (n_samples, obs)).astype(np.int32)


def write_geometry_store(
    path: str | Path,
    *,
    prompt_len: int,
    n_steps: int,
    n_layers: int = 32,
    n_heads: int = 32,
    n_kv: int = 8,
    head_dim: int = 128,
    window: int = 16,
    n_sink: int = 4,
    block_steps: int = 32,
    rope_theta: float = 500000.0,
    seed: int = 0,
) -> Path:
    """A complete window-resolution store with q/k/v at a model's geometry (default
    Llama-3.1-8B: 32 layers, 32 query / 8 KV heads, head_dim 128), one sample, for the scale
    benchmark. q, k, v are random normal (fp16) with a shared direction ``u`` per (layer,
    kv_head) added to every query (×3) and to the sinks' keys (×12), so the attention a replay
    recomputes from them has sinks; the stored window rows are random masses (``attn`` and
    ``attn_sink``, each row summing to 1), not q·k's — the benchmark times their reading."""
    import zarr

    from .schema import SCHEMA_VERSION, Layout
    from .store import consolidate, create

    rng = np.random.default_rng(seed)
    T = prompt_len + n_steps
    block_steps = min(block_steps, n_steps)
    layout = Layout(
        n_samples=1, n_steps=n_steps, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        heads="kv", resolution="window", n_pos=T, obs_window=32, n_sink=n_sink, window=window,
        block_steps=block_steps, record_qkv=True, dtype="float16", rope_freqs=head_dim // 2,
    )  # fmt: skip
    config = {
        "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": head_dim,
        "architecture": "LlamaForCausalLM", "model_type": "llama", "sliding_window": None, "layer_types": [],
        "attn_logit_softcapping": None, "attention_scaling": [head_dim**-0.5] * n_layers,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
    }  # fmt: skip
    attrs = {
        "schema_version": SCHEMA_VERSION, "kvscope_version": "synthetic", "status": "partial",
        "steps_committed": [0], "samples_done": [False], "model": {"name": "synthetic-geometry", "config": config},
        "heads": "kv", "head_dim_name": "kv_head", "resolution": "window", "n_sink": n_sink, "w": window,
        "obs_window": 32, "block_steps": block_steps, "record_qkv": True, "dtype": "float16",
    }  # fmt: skip
    path = Path(path)
    create(path, layout, attrs)
    g = zarr.open_group(str(path), mode="r+")
    _write_prompt(g, rng, 1, n_steps=n_steps, n_layers=n_layers, n_kv=n_kv, P=prompt_len, obs=layout.obs_window)
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2) / head_dim)
    g["rope_inv_freq"][:] = np.broadcast_to(inv_freq.astype(np.float32), (n_layers, head_dim // 2))
    g["rope_attention_scaling"][:] = np.ones(n_layers, dtype=np.float32)
    u = rng.standard_normal((n_layers, n_kv, head_dim)).astype(np.float32)
    u /= np.linalg.norm(u, axis=-1, keepdims=True)  # [layer, kv_head, D]
    _write_qkv(g, rng, u, T=T, n_sink=n_sink, pos_block=layout.pos_block, group=n_heads // n_kv)
    _write_window_rows(g, rng, prompt_len, n_steps=n_steps, layout=layout, block_steps=block_steps)
    g.attrs.update({"status": "complete", "steps_committed": [n_steps], "samples_done": [True]})
    consolidate(path)
    return path


def _write_qkv(g, rng, u: np.ndarray, T: int, n_sink: int, pos_block: int, group: int) -> None:
    """q ``[1, qpos, layer, head, D]`` and k, v ``[1, layer, kv_head, pos, D]``, a block of positions
    at a time; the last position (the last token decoded, never fed back) is NaN, as in a trace."""
    n_layers, n_kv, D = u.shape
    lift = np.repeat(u, group, axis=1)  # [layer, head, D]
    for p0 in range(0, T, pos_block):
        p1 = min(T, p0 + pos_block)
        q = rng.standard_normal((p1 - p0, n_layers, n_kv * group, D), dtype=np.float32) + 3 * lift
        q[T - 1 - p0 :] = np.nan
        g["q"][0, p0:p1] = q.astype(np.float16)
        for name in ("k", "v"):
            x = rng.standard_normal((n_layers, n_kv, p1 - p0, D), dtype=np.float32)
            if name == "k" and p0 < n_sink:
                x[:, :, : n_sink - p0] += 12 * u[:, :, None, :]
            x[:, :, T - 1 - p0 :] = np.nan
            g[name][0, :, :, p0:p1] = x.astype(np.float16)


def _write_window_rows(g, rng, P: int, n_steps: int, layout, block_steps: int) -> None:
    """``attn [1, step, layer, kv_head, window]`` and ``attn_sink``: random masses over the
    windows a query sees and the sinks, each row summing to 1 (NaN beyond the query)."""
    n_win, w, n_sink = layout.n_windows, layout.window, layout.n_sink
    shape = (layout.n_layers, layout.n_kv_heads)
    for t0 in range(0, n_steps, block_steps):
        t1 = min(n_steps, t0 + block_steps)
        rows = np.full((1, t1 - t0) + shape + (n_win,), np.nan, dtype=np.float32)
        sinks = np.zeros((1, t1 - t0) + shape + (n_sink,), dtype=np.float32)
        for t in range(t0, t1):
            seen = -(-(P + t - n_sink) // w)  # windows holding a position ≤ the query's
            mass = rng.exponential(1.0, shape + (seen + n_sink,)).astype(np.float32)
            mass[..., :n_sink] *= 20
            mass /= mass.sum(-1, keepdims=True)
            sinks[0, t - t0], rows[0, t - t0, ..., :seen] = mass[..., :n_sink], mass[..., n_sink:]
        g["attn"][0:1, t0:t1] = rows.astype(np.float16)
        g["attn_sink"][0:1, t0:t1] = sinks.astype(np.float16)


# The toy trace of docs/concepts.md: 10 prompt tokens, 8 decode steps, one layer and one KV
# head, 2 sinks and windows of 4. Each decode row lists the keys it attends (position: mass);
# every other key up to the query gets 0. Multiples of 0.05, each row summing to 1.
TOY_ROWS = (
    {0: 0.40, 1: 0.10, 3: 0.05, 7: 0.15, 8: 0.10, 9: 0.20},  # step 0, query at position 9
    {0: 0.40, 1: 0.10, 2: 0.10, 4: 0.15, 8: 0.05, 10: 0.20},  # step 1, query 10
    {0: 0.40, 1: 0.10, 4: 0.20, 9: 0.05, 10: 0.10, 11: 0.15},
    {0: 0.45, 1: 0.05, 3: 0.10, 5: 0.10, 11: 0.10, 12: 0.20},
    {0: 0.40, 1: 0.10, 4: 0.05, 7: 0.05, 12: 0.15, 13: 0.25},
    {0: 0.40, 1: 0.10, 6: 0.15, 8: 0.10, 13: 0.05, 14: 0.20},
    {0: 0.35, 1: 0.10, 2: 0.05, 6: 0.20, 14: 0.10, 15: 0.20},
    {0: 0.40, 1: 0.10, 7: 0.10, 10: 0.10, 15: 0.10, 16: 0.20},  # step 7, query 16
)
# the mass each prompt token received from the 10 prompt queries (row 9 = step 0 included)
TOY_PREFILL_COLSUM = (5.1, 1.2, 0.5, 0.6, 0.4, 0.3, 0.5, 0.6, 0.6, 0.2)


def toy_trace() -> xr.Dataset:
    """The worked example of docs/concepts.md (``TOY_ROWS``, ``TOY_PREFILL_COLSUM``): a trace
    Dataset of one sample, ``P = 10``, ``S = 8``, ``T = 18`` positions, ``n_sink = 2``, ``w = 4``."""
    P, S = len(TOY_PREFILL_COLSUM), len(TOY_ROWS)
    attn = np.full((1, S, 1, 1, P + S), np.nan, dtype=np.float32)  # [sample, step, layer, kv_head, pos]
    for t, row in enumerate(TOY_ROWS):
        attn[0, t, 0, 0, : P + t] = 0.0
        for p, mass in row.items():
            attn[0, t, 0, 0, p] = mass
    colsum = np.full((1, 1, 1, P + S), np.nan, dtype=np.float32)
    colsum[0, 0, 0, :P] = TOY_PREFILL_COLSUM
    ds = dataset_from_rows(attn, prompt_len=P, prefill_colsum=colsum, w=4, n_sink=2)
    # the prompt's last row (step 0's) is its observation window of one row
    ds["prefill_tail"] = (("sample", "layer", "kv_head", "obs", "pos"), attn[:, :1].transpose((0, 2, 3, 1, 4)))
    ds = ds.assign_coords(prefill_tail_qpos=(("sample", "obs"), np.array([[P - 1]], dtype=np.int32)))
    ds.attrs["obs_window"] = 1
    return ds
