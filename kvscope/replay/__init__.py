"""Offline policy replay ([Concepts → Policies](concepts.md#policies)): every policy × budget driven step by step by one trace.

For each sample the trace's rows are read once, block by block, and every (policy, budget)
cache state is driven through the same steps by the policy driver
([`kvscope.policies.PolicyDriver`][kvscope.policies.PolicyDriver], the one a live cache uses too):

    step 0      driver.prefill(colsum, tail)        prompt 0..P−1, compressed to the budget
    step t ≥ 1  driver.append(P − 1 + t)            the new key, at full precision
                row_seen = observe(row_t, tiers)    renorm | exact (below)
                driver.decide(row_seen)             observe, compress; bytes ≤ B checked

``observe="renorm"`` (open loop): the full-KV kv-group row restricted to the accessible
(FP or Q) positions and renormalized. ``observe="exact"`` (needs ``--record qkv``): the row
recomputed from the recorded query with the cache the policy keeps — Q keys dequantized,
evicted keys absent — exactly what a live cache would compute.

Tiers are snapshot at the events ``0, every, 2·every, …`` *after* the policy acted, so the
metrics score the decision against the future (the analysis layer's definitions, [Concepts → Analyses](concepts.md#analyses)):

    tier_mass[e, FP|Q|EVICTED]   share of the full-KV mass of steps t+1..t+H on existing positions
    fmm                          the EVICTED share (the loss no promotion can undo), FMM(H) curve
    fmm_fp                       the share not at full precision
    churn                        Jaccard distance of consecutive FP sets (positions that existed
                                 at the earlier event, sinks excluded)
    lir, p01, p10                Global LIR and lag-δ transitions of the FP-set selection
    attn_l1, output_rel_l2       with q/k/v: for the first query after each event, the L1
                                 distance of its attention distribution to full KV and the
                                 relative L2 error of the attention output (per query head,
                                 averaged over the heads of a KV group)

The package reads in one direction: ``plan`` (the setup, the tasks it is cut
into), ``run`` ([`replay`][kvscope.replay.replay]; the tasks in this process, in forked ones or on
dask) with ``tasks`` (what one task does), ``result`` (the
Dataset, its attributes, a result saved).
"""

from .check import open_result
from .output_error import effective_kv
from .plan import OBSERVE_MODES, ReplaySetup, resolve_allocations, resolve_budgets, resolve_policies
from .result import save_result, tiers_for
from .run import replay

__all__ = [
    "OBSERVE_MODES",
    "ReplaySetup",
    "effective_kv",
    "open_result",
    "replay",
    "resolve_allocations",
    "resolve_budgets",
    "resolve_policies",
    "save_result",
    "tiers_for",
]
