"""The shared low-bit quantizer (docs/concepts.md#quantizer) and the byte accounting (docs/concepts.md#budget).

Asymmetric affine quantization of one group (the values along ``axis``) to ``b`` bits:

    zero  = min(x)                      stored in 16 bit, rounded toward −∞
    scale = (max(x) − zero) / (2^b − 1) stored in 16 bit, rounded toward +∞ (1 when max == min)
    q     = clamp(round_half_even((x − zero) / scale), 0, 2^b − 1)      codes fitted against the
    x̂     = q · scale + zero                                             *stored* scale and zero

Rounding the stored zero down and the stored scale up keeps the whole ``[min, max]`` on the
code grid, so ``|x − x̂| ≤ scale/2`` holds for every element (with ``scale`` the stored one);
for fp16 inputs the stored zero is exactly ``min``, so a constant group is reproduced exactly.

Bytes per token per (layer, kv_head), head dim ``D``:

    FP       2·D·2                               K and V in 16 bit
    Q (b)    2·D·b/8                             codes of K and V
             + 4·D/G                             keys per channel, one 16-bit scale+zero per G tokens
               (or 4·D/g_k with keys per token)
             + 4·D/g_v                           values per token, groups of g_v channels
    EVICTED  0
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import KvscopeError

FP16_MAX = float(np.finfo(np.float16).max)


BITS = (2, 4, 8)  # code widths: 4, 2 or 1 codes per byte


def check_bits(bits: int) -> int:
    if bits not in BITS:
        raise KvscopeError(f"bits must be 2, 4 or 8 (got {bits})")
    return int(bits)


@dataclass
class Quantized:
    """Codes and 16-bit parameters of groups quantized along one axis.

    ``codes`` has the input's shape (uint8, unpacked); ``scale`` and ``zero`` have the
    input's shape with the group axis kept as length 1 (float16)."""

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray
    bits: int

    def dequantize(self) -> np.ndarray:
        """``x̂ = q · scale + zero`` in float32."""
        return self.codes.astype(np.float32) * self.scale.astype(np.float32) + self.zero.astype(np.float32)


def _fp16_down(x: np.ndarray) -> np.ndarray:
    """Largest float16 ≤ x (x float32)."""
    h = np.clip(x, -FP16_MAX, FP16_MAX).astype(np.float16)
    over = h.astype(np.float32) > x
    return np.where(over, np.nextafter(h, np.float16(-np.inf)), h).astype(np.float16)


def _fp16_up(x: np.ndarray) -> np.ndarray:
    """Smallest float16 ≥ x (x float32)."""
    h = np.clip(x, -FP16_MAX, FP16_MAX).astype(np.float16)
    under = h.astype(np.float32) < x
    return np.where(under, np.nextafter(h, np.float16(np.inf)), h).astype(np.float16)


def quantize(x: np.ndarray, bits: int, axis: int = -1) -> Quantized:
    """Quantize ``x`` with one group per slice along ``axis`` (see the module docstring)."""
    bits = check_bits(bits)
    x = np.asarray(x, dtype=np.float32)
    levels = (1 << bits) - 1
    lo = x.min(axis=axis, keepdims=True)
    hi = x.max(axis=axis, keepdims=True)
    zero = _fp16_down(lo)
    z32 = zero.astype(np.float32)
    degenerate = hi == lo
    scale = _fp16_up(np.where(degenerate, 1.0, (hi - z32) / levels).astype(np.float32))
    scale = np.where(degenerate | (scale == 0), np.float16(1.0), scale).astype(np.float16)
    codes = np.clip(np.rint((x - z32) / scale.astype(np.float32)), 0, levels).astype(np.uint8)
    return Quantized(codes, scale, zero, bits)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack ``bits``-bit codes along the last axis, ``8/bits`` per byte, first code in the
    lowest bits: ``[..., n]`` uint8 → ``[..., ceil(n·bits/8)]`` uint8."""
    bits = check_bits(bits)
    per = 8 // bits
    codes = np.asarray(codes, dtype=np.uint8)
    n = codes.shape[-1]
    pad = (-n) % per
    if pad:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (pad,), np.uint8)], axis=-1)
    grouped = codes.reshape(*codes.shape[:-1], -1, per).astype(np.uint16)
    shifts = (np.arange(per) * bits).astype(np.uint16)
    return (grouped << shifts).sum(-1).astype(np.uint8)


def unpack(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of ``pack``: ``[..., bytes]`` → ``[..., n]`` codes."""
    bits = check_bits(bits)
    per = 8 // bits
    packed = np.asarray(packed, dtype=np.uint8)
    shifts = (np.arange(per) * bits).astype(np.uint8)
    codes = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :n]


def fp_token_bytes(head_dim: int) -> float:
    """Bytes of one full-precision token per (layer, kv_head): K and V in 16 bit."""
    return 2.0 * head_dim * 2


def q_token_bytes(
    head_dim: int, bits: int, key_group: int | None = None, value_group: int | None = None, key_axis: str = "channel"
) -> float:
    """Bytes of one quantized token per (layer, kv_head) (module docstring).

    ``key_group``: tokens per key group (``key_axis="channel"``) or channels per key group
    (``key_axis="token"``); ``value_group``: channels per value group (default ``D``)."""
    d = head_dim
    key_group = key_group or d
    value_group = value_group or d
    if key_axis not in ("channel", "token"):
        raise KvscopeError(f"key_axis must be channel or token (got {key_axis!r})")
    return 2.0 * d * bits / 8 + 4.0 * d / key_group + 4.0 * d / value_group


def packed_bytes(n_values: int, bits: int) -> int:
    """Bytes that ``pack`` uses for ``n_values`` codes."""
    per = 8 // check_bits(bits)
    return -(-n_values // per)
