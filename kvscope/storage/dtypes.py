"""Float conversions between the stored 16-bit dtype and float32, done by torch.

torch and numpy both round to nearest even (the same bits, a NaN's payload aside), but numpy
converts values in fp16's subnormal range — most attention probabilities, and many dequantized
values near zero — one at a time: on real rows fp32 → fp16 is ~20–60× and fp16 → fp32 ~4–25×
slower than torch (measured in ``docs/replay.md``, "Conversions").
"""

from __future__ import annotations

import sys

import numpy as np

LARGE = 1 << 27  # elements: numpy converts this many (fp16 subnormals) in about the ~1 s torch takes to import


def stored(x, dtype) -> np.ndarray:
    """Torch tensor ``x`` as a numpy array of the storage ``dtype`` (float16 or float32)."""
    import torch

    return x.to(torch.float16 if np.dtype(dtype) == np.float16 else torch.float32).cpu().numpy()


def cast(x: np.ndarray, dtype, copy: bool = True) -> np.ndarray:
    """``x.astype(dtype, copy=copy)``: a new array, or with ``copy=False`` ``x`` itself where it
    has that dtype already. float16 ↔ float32 bit for bit numpy's (a NaN stays NaN, its payload
    and sign may differ), converted by torch where torch is loaded or ``x`` is large; other
    dtypes by numpy."""
    dtype = np.dtype(dtype)
    floats = {np.dtype(np.float16), np.dtype(np.float32)}
    if x.dtype == dtype or x.dtype not in floats or dtype not in floats:
        return x.astype(dtype, copy=copy)
    if "torch" not in sys.modules and x.size < LARGE:
        return x.astype(dtype)
    import torch

    return stored(torch.from_numpy(np.ascontiguousarray(x)), dtype)
