"""``h2o`` (Heavy-Hitter Oracle): keep the most recent half of the capacity and the heavy
hitters by cumulative attention; each step evict the lowest-scoring non-recent token."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..params import param
from .base import EVICTED, CacheSpec, CacheState, Policy, per_unit, top_k_mask


@dataclass
class H2O(Policy):
    """Keep the most recent half of the capacity and the heavy hitters by cumulative attention; each
    step evict the lowest-scoring non-recent token.

    Capacity ``n = ⌊B_unit / FP_bytes⌋`` tokens per (layer, kv_head) (its share of ``B``);
    ``n_recent = ⌈recent_frac·n⌉``.
    Scores per (layer, kv_head, pos): the prefill column sums plus every attention row the
    cache observed. Evictions are permanent.
    """

    recent_frac: float = param(
        0.5, low=0, high=1, help="share of the capacity kept for the newest tokens", tune=(0.05, 0.95)
    )

    name = "h2o"
    kind = "eviction"
    observes = True
    observes_prefill = True

    def state_type(self) -> type[CacheState]:
        return _H2OState

    def unit_floor(self, spec: CacheSpec) -> float:
        return 2 * spec.fp_bytes  # one recent token and one heavy hitter


class _H2OState(CacheState):
    def __init__(self, policy: H2O, spec: CacheSpec):
        super().__init__(policy, spec)
        self.scores = np.zeros(self.tiers.shape, dtype=np.float64)  # [layer, kv_head, pos]
        self.size()

    def size(self) -> None:
        capacity = self.spec.fp_capacity_tokens  # a number, or [layer, kv_head] when allocated
        if np.any(capacity < 2):
            self.reached = False
            capacity = np.maximum(capacity, 2)
        self.capacity = capacity
        self.n_recent = np.maximum(1, np.ceil(self.policy.recent_frac * capacity).astype(np.int64))
        self.n_heavy = self.capacity - self.n_recent

    def after_prefill(self, colsum, tail) -> None:
        p = self.length
        self.scores[..., :p] = colsum
        if np.all(p <= self.capacity):
            return
        older = np.arange(p) < per_unit(p - self.n_recent)  # [pos] or [layer, kv_head, pos]
        candidates = np.broadcast_to(older, self.scores[..., :p].shape)
        keep = top_k_mask(self.scores[..., :p], candidates, self.n_heavy)
        self.evict(candidates & ~keep)

    def observe(self, row: np.ndarray) -> None:
        self.scores[..., : row.shape[-1]] += row

    def compress(self) -> None:
        n = self.length
        acc = self.accessible()  # [layer, kv_head, n]
        over = acc.sum(-1) > self.capacity  # one new token per step → at most one eviction
        if not over.any():
            return
        candidates = acc & (np.arange(n) < per_unit(n - self.n_recent))
        masked = np.where(candidates, self.scores[..., :n], np.inf)
        lowest = masked.argmin(-1)  # [layer, kv_head]
        li, hi = np.nonzero(over)
        self.tiers[li, hi, lowest[li, hi]] = EVICTED
