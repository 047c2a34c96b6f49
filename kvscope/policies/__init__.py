"""KV-cache policies ([Concepts → Policies](concepts.md#policies)), one small dataclass per module, kvpress style.

    make("qevict", q_frac=0.5)          a policy object; its fields are its parameters
    available()                         {name: class} of every registered policy
    parse("qevict:q_frac=0.5:bits=4")   the CLI's spelling of the same
    parse("press:SnapKVPress:window_size=64")   a press of NVIDIA kvpress (optional extra)

Each policy's ``start(spec, k, v, rope)`` returns the per-sequence
[`CacheState`][kvscope.policies.CacheState] that the one [`PolicyDriver`][kvscope.policies.PolicyDriver]
runs — offline in [`kvscope.replay`][kvscope.replay.replay], online in
[`kvscope.live.PolicyCache`][kvscope.live.PolicyCache]. Parameters are checked on construction
against the range written beside each field (``kvscope.params``).
"""

from __future__ import annotations

from typing import Any

from ..params import make_registered, parse_spelled, registered, split_outside_brackets
from . import allocation
from .allocation import Allocation
from .base import BudgetExceeded, CacheSpec, CacheState, Ledger, LedgerError, Policy, check_budget, check_geometry
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


def make(name: str, **params: Any) -> Policy:
    """The policy ``name`` with ``params`` as its fields (each checked against its range).

    Args:
        name: A registered policy's name.
        **params: Its parameters by field name.

    Raises:
        KvscopeError: An unknown name or parameter, or a value out of range.
    """
    return make_registered(REGISTRY, "policy", name, **params)


def parse(spec: str) -> Policy:
    """``"name"`` or ``"name:key=value:key=value"`` → a policy (``press:Name:…`` a kvpress press).

    Args:
        spec: The spelling, as the command line takes it.

    Raises:
        KvscopeError: An unknown name or parameter, or a value out of range.
    """
    name, *pairs = split_outside_brackets(spec.strip(), ":")
    if registered(REGISTRY, "policy", name) is Press:
        return Press.from_text(pairs)
    return parse_spelled(REGISTRY, "policy", spec)


__all__ = [
    "H2O",
    "KIVI",
    "REGISTRY",
    "Allocation",
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
    "allocation",
    "available",
    "check_budget",
    "check_geometry",
    "make",
    "parse",
]
