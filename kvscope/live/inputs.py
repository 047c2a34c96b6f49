"""What a live cache accepts, checked before torch loads: ``kvscope run`` and ``validate``
refuse a bad ``--policy``, ``--allocation`` or ``--kv-dtype`` in a fraction of a second."""

from __future__ import annotations

from ..errors import KvscopeError
from ..policies import Allocation, Policy, parse
from ..policies.allocation import parse as parse_allocation

KV_DTYPES = ("float16", "bfloat16", "float32")  # --kv-dtype, besides "model"


def live_policy(policy: Policy | str) -> Policy:
    """A policy object (from a name or ``name:key=value`` string) that can run live: the
    clairvoyant oracle cannot (a press is rehearsed on the model's geometry by the cache,
    [`check_live`][kvscope.policies.Policy.check_live])."""
    policy = parse(policy) if isinstance(policy, str) else policy
    if policy.clairvoyant:
        raise KvscopeError(f"{policy.name} is clairvoyant (it reads future attention): it has no live cache")
    return policy


def live_allocation(allocation: Allocation | str | None) -> Allocation:
    """An allocation a live cache can run under: the clairvoyant oracle only as the split a
    replay of the trace gave (kvscope validate)."""
    allocation = parse_allocation(allocation or "uniform")
    if allocation.clairvoyant:
        raise KvscopeError(
            f"the {allocation.label()} allocation reads the future attention of a trace: live, only kvscope "
            "validate can run it (with the split its replay of the trace gives)"
        )
    return allocation


def kv_dtype_name(name: str | None) -> str | None:
    """``--kv-dtype``: None for the model's dtype, else one of ``KV_DTYPES``."""
    if name in (None, "", "model"):
        return None
    if name not in KV_DTYPES:
        raise KvscopeError(f"--kv-dtype must be model, {', '.join(KV_DTYPES[:-1])} or {KV_DTYPES[-1]} (got {name!r})")
    return name
