"""Tier codes shared by policies, replay and analyses (docs/concepts.md#tiers): one int8 per position."""

import numpy as np

TIER_NONE, TIER_EVICTED, TIER_Q, TIER_FP = -1, 0, 1, 2
TIER_NAMES = {TIER_FP: "FP", TIER_Q: "Q", TIER_EVICTED: "EVICTED"}
TIER_CODES = (TIER_NONE, TIER_EVICTED, TIER_Q, TIER_FP)
TIER_CODES_RULE = "tier codes must be −1 (none), 0 EVICTED, 1 Q or 2 FP"


def valid_codes(x) -> bool:
    """Every value of ``x`` is a tier code."""
    return bool(np.isin(x, TIER_CODES).all())
