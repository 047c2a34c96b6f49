"""``oracle``: the clairvoyant bound — labelled so, never a causal policy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import defaults
from ..params import param
from .base import EVICTED, FP, CacheSpec, CacheState, Policy, top_k_mask


@dataclass
class Oracle(Policy):
    """The clairvoyant bound — labelled so, never a causal policy.

    At every step the FP set is the ``⌊B_unit / FP_bytes⌋`` existing positions that receive the most
    full-KV attention over the next ``horizon`` steps; everything else is (temporarily) absent,
    and a position may come back. At an event this is the set of that size with the smallest
    Future Missed Mass at ``horizon`` for that event, so its FP-set FMM bounds every causal
    policy's at the same budget from below. It needs the future (``observe_future``), which only
    a replay can give.
    """

    horizon: int = param(defaults.HORIZON, low=1, help="future steps whose attention decides")

    name = "oracle"
    observes_prefill = True
    kind = "clairvoyant bound"
    clairvoyant = True

    def state_type(self) -> type[CacheState]:
        return _OracleState

    def unit_floor(self, spec: CacheSpec) -> float:
        return spec.fp_bytes


class _OracleState(CacheState):
    def __init__(self, policy: Oracle, spec: CacheSpec):
        super().__init__(policy, spec)
        self.future = None
        self.size()

    def size(self) -> None:
        self.capacity = self.spec.fp_capacity_tokens  # a number or [layer, kv_head]
        if np.any(self.capacity < 1):
            self.reached, self.capacity = False, np.maximum(self.capacity, 1)

    def observe_future(self, future: np.ndarray) -> None:
        """Full-KV attention over the next ``horizon`` steps ``[layer, kv_head, ≥length]``."""
        self.future = future

    def after_prefill(self, colsum, tail) -> None:
        self.compress()

    def compress(self) -> None:
        n = self.length
        if np.all(n <= self.capacity):
            self.tiers[..., :n] = FP
            return
        future = self.future[..., :n] if self.future is not None else np.zeros(self.tiers[..., :n].shape)
        keep = top_k_mask(future, np.ones(future.shape, dtype=bool), self.capacity)
        self.tiers[..., :n] = np.where(keep, FP, EVICTED)
