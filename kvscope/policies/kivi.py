"""``kivi``: 2-bit KV quantization with a full-precision residual (KIVI)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import KvscopeError
from ..params import param
from .base import EVICTED, AsEviction, CacheSpec, CacheState, Ledger, Policy, Q
from .quant import BITS, q_token_bytes

if TYPE_CHECKING:
    from ..model.rope import Rope


@dataclass
class KIVI(AsEviction, Policy):
    """2-bit KV quantization with a full-precision residual (KIVI).

    Keys are quantized per channel over groups of ``G`` consecutive tokens, values per token
    (groups of ``value_group`` channels, default the head dim). The newest ``R`` tokens (a
    multiple of ``G``) stay FP: after ``T`` tokens the quantized prefix is
    ``⌊(T − R) / G⌋·G`` tokens, so the FP tail holds between ``R`` and ``R + G − 1``.
    Nothing is evicted. ``R = None`` (default) takes the largest multiple of ``G`` whose bytes
    stay within the budget over the whole sequence; when even ``R = 0`` does not fit, the
    policy runs at ``R = 0`` and reports its floor.

    ``evict=true`` is KIVI *as eviction* (LogQuant's Table 2): the groups it would quantize are
    dropped instead, and ``R`` is fitted to the budget with full-precision bytes only (equal
    memory: the residual grows into what the quantized prefix would have held).
    """

    bits: int = param(2, choices=BITS, help="bits per quantized value", tune=(2, 4))
    G: int = param(32, low=1, help="tokens per key group (keys per channel)", tune=(16, 32, 64))
    R: int | None = param(
        None, low=0, help="full-precision residual tokens (a multiple of G)", none="the most that fit"
    )
    value_group: int | None = param(None, low=1, help="channels per value group", none="the head dim")
    evict: bool = param(False, help="drop what it would quantize (KIVI as eviction)")

    name = "kivi"

    def __post_init__(self):
        super().__post_init__()
        if self.R is not None and self.R % self.G:
            raise KvscopeError(f"kivi parameter R must be a multiple of G={self.G} (got {self.R})")

    def start(
        self, spec: CacheSpec, k: np.ndarray | None = None, v: np.ndarray | None = None, rope: Rope | None = None
    ) -> CacheState:
        ledger = Ledger(spec, self.bits, "channel", value_group=self.value_group, k=k, v=v)
        return _KIVIState(self, spec, ledger)

    def max_bytes(self, spec: CacheSpec, R: int) -> float:
        """Largest bytes per (layer, kv_head) over the sequence with residual ``R``.

        Args:
            spec: The cache's geometry.
            R: The full-precision residual (tokens).
        """
        lengths = np.arange(spec.prompt_len, spec.final_len + 1)
        n_q = np.maximum(0, (lengths - R) // self.G) * self.G
        q_bytes = 0.0 if self.evict else q_token_bytes(spec.head_dim, self.bits, self.G, self.value_group)
        return float(((lengths - n_q) * spec.fp_bytes + n_q * q_bytes).max())

    def residual(self, spec: CacheSpec, capacity: float) -> tuple[int, bool]:
        """``(R, fits)``: the user's ``R``, or the largest multiple of ``G`` whose bytes fit
        ``capacity`` (0 at the floor), and whether they fit.

        Args:
            spec: The cache's geometry.
            capacity: Bytes per (layer, kv_head).
        """
        if self.R is not None:
            return self.R, spec.fits(self.max_bytes(spec, self.R), capacity)
        R = (spec.final_len // self.G) * self.G
        while R > 0 and not spec.fits(self.max_bytes(spec, R), capacity):
            R -= self.G
        return R, spec.fits(self.max_bytes(spec, R), capacity)

    def unit_floor(self, spec: CacheSpec) -> float:
        return self.max_bytes(spec, 0 if self.R is None else self.R)


class _KIVIState(CacheState):
    def __init__(self, policy: KIVI, spec: CacheSpec, ledger: Ledger):
        super().__init__(policy, spec, ledger)
        self.size()

    def size(self) -> None:
        """``R`` and the quantized prefix: numbers, or ``[layer, kv_head]`` when the units'
        capacities differ."""
        groups = list(self.spec.capacity_groups())
        shape = (self.spec.n_layers, self.spec.n_kv)
        self.R = 0 if groups[0][1] is None else np.zeros(shape, dtype=np.int64)
        for capacity, units in groups:
            R, fits = self.policy.residual(self.spec, capacity)
            self.reached &= fits
            if units is None:
                self.R = R
            else:
                self.R[units] = R
        self.n_quantized = 0 if np.ndim(self.R) == 0 else np.zeros(shape, dtype=np.int64)

    def compress(self) -> None:
        g = self.policy.G
        target = np.maximum(0, (self.length - self.R) // g) * g
        if np.ndim(target) == 0:
            while self.n_quantized < target:
                self._leave(np.arange(self.n_quantized, self.n_quantized + g))
                self.n_quantized += g
            return
        while (behind := self.n_quantized < target).any():
            li, hi = np.nonzero(behind)
            self._leave(self.n_quantized[behind][:, None] + np.arange(g), li, hi)  # [unit, G]
            self.n_quantized[behind] += g

    def _leave(self, positions: np.ndarray, layers=None, heads=None) -> None:
        """A key group leaves the residual: ``positions [G]`` in every unit, or ``[n, G]`` in the
        units ``layers [n]``, ``heads [n]``."""
        if not self.policy.evict:
            self.ledger.quantize(positions, layers, heads)
        tier = EVICTED if self.policy.evict else Q
        if layers is None:
            self.set_tier_positions(positions, tier)
        else:
            self.tiers[layers[:, None], heads[:, None], positions] = tier
