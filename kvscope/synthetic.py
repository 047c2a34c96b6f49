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
    _write_prompt(g, rng, n_samples, n_steps, n_layers, n_kv, prompt_len, layout.obs_window)
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
