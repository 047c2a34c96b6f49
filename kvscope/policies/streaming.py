"""``streaming`` (StreamingLLM): the sinks plus the most recent tokens that fit the budget.

Capacity ``n = ⌊B / FP_bytes⌋`` tokens per (layer, kv_head): positions ``< n_sink`` stay,
plus the newest ``n − n_sink``; a position that leaves the recent window is evicted for good.
The same decision for every layer and head."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..params import param
from .base import FP, CacheSpec, CacheState, Policy


@dataclass
class Streaming(Policy):
    n_sink: int | None = param(None, low=0, help="sinks kept", none="the trace's")

    name = "streaming"
    kind = "eviction"

    def start(self, spec: CacheSpec, k=None, v=None, rope=None) -> CacheState:
        return _StreamingState(self, spec)


class _StreamingState(CacheState):
    def __init__(self, policy: Streaming, spec: CacheSpec):
        super().__init__(policy, spec)
        self.n_sink = spec.n_sink if policy.n_sink is None else policy.n_sink
        self.recent = spec.fp_capacity_tokens - self.n_sink
        if self.recent < 1:  # not even one recent token fits next to the sinks
            self.reached = False
            self.recent = 1

    def compress(self) -> None:
        old = np.arange(self.length) < self.length - self.recent
        old[: self.n_sink] = False
        self.evict(old & (self.tiers[0, 0, : self.length] == FP))
