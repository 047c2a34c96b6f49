"""KV-cache policies (SPEC §5), one small dataclass per module, kvpress style.

    make("qevict", q_frac=0.5)          a policy object; its fields are its parameters
    available()                         {name: class} of every registered policy
    parse("qevict:q_frac=0.5:bits=4")   the CLI's spelling of the same
    parse("press:SnapKVPress:window_size=64")   a press of NVIDIA kvpress (optional extra)

Each policy's ``start(spec, k, v, rope)`` returns the per-sequence :class:`CacheState` that
the one :class:`PolicyDriver` runs — offline in :func:`kvscope.replay`, online in
:class:`kvscope.live.PolicyCache`. Parameters are checked on construction against the range
written beside each field (:mod:`kvscope.params`).
"""

from __future__ import annotations

import dataclasses

from ..errors import KvscopeError
from ..params import parse_param
from .base import BudgetExceeded, CacheSpec, CacheState, Ledger, LedgerError, Policy, check_budget
from .driver import PolicyDriver
from .full import Full
from .h2o import H2O
from .kivi import KIVI
from .logquant import LogQuant, LogQuantIndex
from .oracle import Oracle
from .press import Press
from .qevict import QEvict
from .snapkv import SnapKV
from .streaming import Streaming

REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Full, Streaming, H2O, SnapKV, KIVI, LogQuant, QEvict, Oracle, Press)
}


def available() -> dict[str, type[Policy]]:
    """Every registered policy by name."""
    return dict(REGISTRY)


def _policy_class(name: str) -> type[Policy]:
    if name not in REGISTRY:
        raise KvscopeError(f"unknown policy {name!r} (available: {', '.join(REGISTRY)})")
    return REGISTRY[name]


def _check_known(cls: type[Policy], keys) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(keys) - known)
    if unknown:
        raise KvscopeError(
            f"policy {cls.name} has no parameter {unknown[0]!r} (has: {', '.join(sorted(known)) or 'none'})"
        )


def make(name: str, **params) -> Policy:
    """The policy ``name`` with ``params`` as its fields (each checked against its range)."""
    cls = _policy_class(name)
    _check_known(cls, params)
    return cls(**params)


def parse(spec: str) -> Policy:
    """``"name"`` or ``"name:key=value:key=value"`` → a policy."""
    name, *pairs = spec.strip().split(":")
    cls = _policy_class(name)
    if cls is Press:
        return Press.from_text(pairs)
    params = {}
    for pair in pairs:
        if "=" not in pair:
            raise KvscopeError(f"policy parameter {pair!r} must read key=value")
        key, value = pair.split("=", 1)
        _check_known(cls, [key])
        params[key] = parse_param(cls, key, value)
    return make(name, **params)


__all__ = [
    "H2O",
    "KIVI",
    "REGISTRY",
    "BudgetExceeded",
    "CacheSpec",
    "CacheState",
    "Full",
    "Ledger",
    "LedgerError",
    "LogQuant",
    "LogQuantIndex",
    "Oracle",
    "Policy",
    "PolicyDriver",
    "Press",
    "QEvict",
    "SnapKV",
    "Streaming",
    "available",
    "check_budget",
    "make",
    "parse",
]
