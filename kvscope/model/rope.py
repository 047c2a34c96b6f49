"""Rotary position embeddings of Llama-family models (rotate-half), for numpy and torch alike.

    rotate_half(x)[..., :h]      = −x[..., h:n_rot]        h = n_rot / 2; channels past n_rot → 0
    rotate_half(x)[..., h:n_rot] =  x[..., :h]
    apply_rope(x) = x·cos + rotate_half(x)·sin            cos, sin ``[..., D]`` (scaled by the model's
    undo_rope(x)  = (x·cos − rotate_half(x)·sin) / s²      attention scaling s; past n_rot: 1 and 0)

Every function takes numpy arrays or torch tensors (the same arithmetic: policies quantize
pre-RoPE keys in numpy, the live cache rotates dequantized keys back in torch, and both
serve bit-identical values).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def rotate_half(x, n_rot: int):
    """``rotate_half`` of the first ``n_rot`` channels of ``x [..., D]`` (zeros past them)."""
    half = n_rot // 2
    parts = [-x[..., half:n_rot], x[..., :half]]
    if isinstance(x, np.ndarray):
        if n_rot < x.shape[-1]:
            parts.append(np.zeros(x.shape[:-1] + (x.shape[-1] - n_rot,), dtype=x.dtype))
        return np.concatenate(parts, axis=-1)
    import torch

    if n_rot < x.shape[-1]:
        parts.append(torch.zeros(x.shape[:-1] + (x.shape[-1] - n_rot,), dtype=x.dtype, device=x.device))
    return torch.cat(parts, dim=-1)


def apply_rope(x, cos, sin, n_rot: int):
    """``x·cos + rotate_half(x)·sin`` — ``x``, ``cos``, ``sin`` broadcastable ``[..., D]``."""
    return x * cos + rotate_half(x, n_rot) * sin


def undo_rope(x, cos, sin, n_rot: int, scaling):
    """Inverse of ``apply_rope`` (a rotation scaled by ``scaling``)."""
    return (x * cos - rotate_half(x, n_rot) * sin) / (scaling * scaling)


def rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray, scaling: float, head_dim: int):
    """``cos, sin [n, D]`` float32 of the rotate-half RoPE (dims past the rotary ones get cos 1,
    sin 0), computed in float64 from ``positions [n]`` and ``inv_freq [F]``."""
    freqs = np.asarray(positions, dtype=np.float64)[:, None] * np.asarray(inv_freq, dtype=np.float64)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos = np.ones((len(positions), head_dim))
    sin = np.zeros((len(positions), head_dim))
    cos[:, : emb.shape[1]] = np.cos(emb) * scaling
    sin[:, : emb.shape[1]] = np.sin(emb) * scaling
    return cos.astype(np.float32), sin.astype(np.float32)


@dataclass(eq=False)
class Rope:
    """Rotary parameters of one model or trace: ``inv_freq [layer, F]`` float64 (NaN-padded
    where a layer has fewer), ``scaling [layer]``."""

    inv_freq: np.ndarray
    scaling: np.ndarray
    _tables: tuple | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_model(cls, model, layers) -> Rope:
        """The rotary embedding module's ``inv_freq`` and ``attention_scaling`` for each of the
        model's ``layers`` (an int: layers 0..n−1), per layer type where the model keeps one
        module for several, as Gemma 3 does."""
        layers = range(layers) if isinstance(layers, int) else list(layers)
        n_layers = len(layers)
        rotary = next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
        layer_types = list(getattr(model.config.get_text_config(), "layer_types", None) or [])
        freqs, scales = [], []
        for layer in layers:
            prefix = (
                f"{layer_types[layer]}_"
                if layer_types and rotary is not None and not hasattr(rotary, "inv_freq")
                else ""
            )
            inv = getattr(rotary, f"{prefix}inv_freq", None) if rotary is not None else None
            scale = getattr(rotary, f"{prefix}attention_scaling", getattr(rotary, "attention_scaling", 1.0))
            freqs.append(inv.detach().float().cpu().numpy() if inv is not None else None)
            scales.append(float(scale) if scale is not None else 1.0)
        width = max((len(f) for f in freqs if f is not None), default=0)
        table = np.full((n_layers, width), np.nan)  # float64 holding the model's float32 values
        for i, f in enumerate(freqs):
            if f is not None:
                table[i, : len(f)] = f
        return cls(table, np.asarray(scales, dtype=np.float32))

    def usable(self) -> bool:
        return bool(np.isfinite(self.inv_freq).all() and self.inv_freq.size)

    @property
    def n_rot(self) -> int:
        """Rotated channels per head."""
        return 2 * self.inv_freq.shape[1]

    def cos_sin(self, layers: np.ndarray, positions: np.ndarray, head_dim: int, length: int = 0):
        """``cos, sin [..., D]`` for ``layers`` and ``positions`` of the same shape; ``length``:
        the positions the caller will ever ask for (tables built once for all of them)."""
        cos, sin = self.tables(max(length, int(np.max(positions)) + 1), head_dim)
        return cos[layers, positions], sin[layers, positions]

    def tables(self, need: int, head_dim: int):
        """``cos, sin [layer, pos, D]`` float32 covering at least ``need`` positions (built once,
        grown by doubling when needed; layers with the same parameters share one computation)."""
        if self._tables is None or self._tables[0].shape[1] < need:
            size = max(need, 1024, 2 * (self._tables[0].shape[1] if self._tables else 0))
            computed: dict[bytes, tuple] = {}
            per_layer = []
            for layer in range(len(self.scaling)):
                params = (self.inv_freq[layer], float(self.scaling[layer]))
                tag = params[0].tobytes() + np.float64(params[1]).tobytes()
                if tag not in computed:
                    computed[tag] = rope_cos_sin(np.arange(size), *params, head_dim)
                per_layer.append(computed[tag])
            self._tables = (np.stack([c for c, _ in per_layer]), np.stack([s for _, s in per_layer]))
        return self._tables
