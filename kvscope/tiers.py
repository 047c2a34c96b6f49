"""Tier codes shared by policies, replay and analyses (SPEC §1): one int8 per position."""

TIER_NONE, TIER_EVICTED, TIER_Q, TIER_FP = -1, 0, 1, 2
TIER_NAMES = {TIER_FP: "FP", TIER_Q: "Q", TIER_EVICTED: "EVICTED"}
