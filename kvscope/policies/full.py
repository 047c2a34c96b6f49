"""``full``: the reference — every position at full precision, nothing ever dropped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .base import CacheSpec, CacheState, Policy

if TYPE_CHECKING:
    from ..model.rope import Rope


@dataclass
class Full(Policy):
    """The reference — every position at full precision, nothing ever dropped.

    Its bytes grow to ``FP_bytes(P + S)``, so it fits only ``β = 1``; at smaller budgets the
    replay reports it as not reaching the budget (ratio 1.0) and it serves as the zero-error,
    zero-FMM reference.
    """

    name = "full"
    kind = "reference"

    def start(
        self, spec: CacheSpec, k: np.ndarray | None = None, v: np.ndarray | None = None, rope: Rope | None = None
    ) -> CacheState:
        state = CacheState(self, spec)
        state.reached = spec.budget >= 1.0
        return state

    def unit_floor(self, spec: CacheSpec) -> float:
        return float(np.max(spec.unit_full_bytes))
