"""``h2o`` (Heavy-Hitter Oracle): keep the most recent half of the capacity and the heavy
hitters by cumulative attention; each step evict the lowest-scoring non-recent token.

Capacity ``n = ⌊B / FP_bytes⌋`` tokens per (layer, kv_head); ``n_recent = ⌈recent_frac·n⌉``.
Scores per (layer, kv_head, pos): the prefill column sums plus every attention row the
cache observed. Evictions are permanent."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..params import param
from .base import EVICTED, CacheSpec, CacheState, Policy, top_k_mask


@dataclass
class H2O(Policy):
    recent_frac: float = param(0.5, low=0, high=1, help="share of the capacity kept for the newest tokens")

    name = "h2o"
    kind = "eviction"
    observes = True
    observes_prefill = True

    def start(self, spec: CacheSpec, k=None, v=None, rope=None) -> CacheState:
        return _H2OState(self, spec)


class _H2OState(CacheState):
    def __init__(self, policy: H2O, spec: CacheSpec):
        super().__init__(policy, spec)
        self.capacity = spec.fp_capacity_tokens
        if self.capacity < 2:
            self.reached, self.capacity = False, 2
        self.n_recent = max(1, int(np.ceil(policy.recent_frac * self.capacity)))
        self.n_heavy = self.capacity - self.n_recent
        self.scores = np.zeros(self.tiers.shape, dtype=np.float64)  # [layer, kv_head, pos]

    def after_prefill(self, colsum, tail) -> None:
        p = self.length
        self.scores[..., :p] = colsum
        if p <= self.capacity:
            return
        older = np.arange(p) < p - self.n_recent  # [pos]
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
        candidates = acc & (np.arange(n) < n - self.n_recent)
        masked = np.where(candidates, self.scores[..., :n], np.inf)
        lowest = masked.argmin(-1)  # [layer, kv_head]
        li, hi = np.nonzero(over)
        self.tiers[li, hi, lowest[li, hi]] = EVICTED
