"""``full``: the reference — every position at full precision, nothing ever dropped.

Its bytes grow to ``FP_bytes(P + S)``, so it fits only ``β = 1``; at smaller budgets the
replay reports it as not reaching the budget (ratio 1.0) and it serves as the zero-error,
zero-FMM reference."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import CacheSpec, CacheState, Policy


@dataclass
class Full(Policy):
    name = "full"
    kind = "reference"

    def start(self, spec: CacheSpec, k=None, v=None, rope=None) -> CacheState:
        state = CacheState(self, spec)
        state.reached = spec.budget >= 1.0
        return state

    def unit_floor(self, spec: CacheSpec) -> float:
        return float(np.max(spec.unit_full_bytes))
