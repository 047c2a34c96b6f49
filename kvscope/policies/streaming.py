"""``streaming`` (StreamingLLM): the sinks plus the most recent tokens that fit the budget."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..params import param
from .base import FP, CacheSpec, CacheState, Policy, per_unit


@dataclass
class Streaming(Policy):
    """The sinks plus the most recent tokens that fit the budget.

    Capacity ``n = ⌊B_unit / FP_bytes⌋`` tokens per (layer, kv_head) (its share of ``B``):
    positions ``< n_sink`` stay, plus the newest ``n − n_sink``; a position that leaves the recent window is evicted for good.
    The same decision for every layer and head under the uniform split.
    """

    n_sink: int | None = param(None, low=0, help="sinks kept", none="the trace's", tune=(0, 1, 2, 4, 8, 16))

    name = "streaming"
    kind = "eviction"

    def state_type(self) -> type[CacheState]:
        return _StreamingState

    def sinks(self, spec: CacheSpec) -> int:
        """The sinks kept: ``n_sink``, or the trace's.

        Args:
            spec: The cache's geometry (its ``n_sink``: the trace's).
        """
        return spec.n_sink if self.n_sink is None else self.n_sink

    def unit_floor(self, spec: CacheSpec) -> float:
        return (self.sinks(spec) + 1) * spec.fp_bytes  # the sinks and the newest token


class _StreamingState(CacheState):
    def __init__(self, policy: Streaming, spec: CacheSpec):
        super().__init__(policy, spec)
        self.n_sink = policy.sinks(spec)
        self.size()

    def size(self) -> None:
        self.recent = self.spec.fp_capacity_tokens - self.n_sink  # a number or [layer, kv_head]
        if np.any(self.recent < 1):  # not even one recent token fits next to the sinks
            self.reached = False
            self.recent = np.maximum(self.recent, 1)

    def compress(self) -> None:
        n = self.length
        old = np.arange(n) < per_unit(n - self.recent)  # [pos] or [layer, kv_head, pos]
        old[..., : self.n_sink] = False
        self.evict(old & (self.tiers[..., :n] == FP))
