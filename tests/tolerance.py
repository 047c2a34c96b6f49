"""Tolerances of float32 results that hold on any x86-64 CPU.

Two float32 computations of one quantity that add their terms in another order differ by a few
units in the last place of every sum. The order is not fixed: torch's CPU kernels (oneDNN, MKL,
its own vectorised loops) pick AVX2 or AVX-512 paths by the processor, split a reduction by the
length of the data, and a batched forward sums otherwise than one token per forward. An error of
that kind grows with the size of what is summed, so a tolerance of a float32 result is

    |actual − desired| ≤ floor + rel · |desired|

``floor``: what an exact zero may show; ``rel``: a multiple of float32's machine epsilon
(``F32_EPS`` = 2⁻²³ ≈ 1.19e-7) large enough for the number of roundings between the inputs and the
value compared. A test that compares a float64 reference states its own bound.

The suite's other absolute bounds (``atol``) compare values of a known scale: probabilities and
their row sums (≤ 1: 1e-5 there is ~84 ulps of the largest value), attention outputs and keys of
unit-variance tensors, column sums with ``rtol`` beside them. A KL of a whole model's forward has
no such scale (several nats at a small budget), hence ``assert_kl_close``.
"""

from __future__ import annotations

import numpy as np

F32_EPS = float(np.finfo(np.float32).eps)

# A KL divergence of two float32 forwards of a whole model (30 layers of SmolLM2, or the tiny models')
# over a summation order of their own: measured |Δ| up to 1.1e-5 nats at KL 3.87 (2.8e-6 relative)
# on an Intel Xeon with AVX-512, under 5e-7 nats on an AMD EPYC with AVX2. 1e-5 nats + 1e-5 relative
# (≈ 84 ulps of the KL) holds both with room; exactness tests in nats stay as strict as that.
KL_FLOOR = 1e-5  # nats: what an exact KL (0, or two equal forwards) may show
KL_REL = 1e-5  # of the KL's size


def assert_f32_close(actual, desired, *, floor: float, rel: float, what: str = "") -> None:
    """``|actual − desired| ≤ floor + rel·|desired|`` element by element, naming the worst element."""
    actual, desired = np.asarray(actual, dtype=np.float64), np.asarray(desired, dtype=np.float64)
    assert actual.shape == desired.shape, (what, actual.shape, desired.shape)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(desired), err_msg=f"{what}: NaNs elsewhere")
    excess = np.nan_to_num(np.abs(actual - desired) - (floor + rel * np.abs(desired)), nan=-1.0)
    if excess.size and excess.max() > 0:
        i = np.unravel_index(int(excess.argmax()), excess.shape)
        raise AssertionError(
            f"{what or 'float32 values'} differ beyond {floor:g} + {rel:g}·|desired| at {tuple(map(int, i))}: "
            f"{actual[i]!r} vs {desired[i]!r} (|Δ| {abs(actual[i] - desired[i]):.3g})"
        )


def assert_kl_close(actual, desired, what: str = "KL") -> None:
    """Per-step KLs (nats) of two float32 decodes of the same cache: ``KL_FLOOR + KL_REL·KL``."""
    assert_f32_close(actual, desired, floor=KL_FLOOR, rel=KL_REL, what=what)
