"""KV-cache policies (SPEC §5), one small dataclass per module, kvpress style.

    make("qevict", q_frac=0.5)          a policy object; its fields are its parameters
    available()                         {name: class} of every registered policy
    parse("qevict:q_frac=0.5:bits=4")   the CLI's spelling of the same

Each policy's ``start(spec, k, v, rope)`` returns the per-sequence :class:`CacheState` that
:func:`kvscope.replay` drives offline (and a live cache can drive online).
"""

from __future__ import annotations

import dataclasses
import typing

from ..errors import KvscopeError
from .base import BudgetExceeded, CacheSpec, CacheState, Ledger, LedgerError, Policy, Rope
from .full import Full
from .h2o import H2O
from .kivi import KIVI
from .logquant import LogQuant, LogQuantIndex
from .oracle import Oracle
from .qevict import QEvict
from .snapkv import SnapKV
from .streaming import Streaming

REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Full, Streaming, H2O, SnapKV, KIVI, LogQuant, QEvict, Oracle)
}


def available() -> dict[str, type[Policy]]:
    """Every registered policy by name."""
    return dict(REGISTRY)


def make(name: str, **params) -> Policy:
    """The policy ``name`` with ``params`` as its fields."""
    if name not in REGISTRY:
        raise KvscopeError(f"unknown policy {name!r} (available: {', '.join(REGISTRY)})")
    _check_parameters(name, params)
    return REGISTRY[name](**params)


def _check_parameters(name: str, keys) -> None:
    known = {f.name for f in dataclasses.fields(REGISTRY[name])}
    unknown = set(keys) - known
    if unknown:
        raise KvscopeError(
            f"policy {name} has no parameter {sorted(unknown)[0]!r} (has: {', '.join(sorted(known)) or 'none'})"
        )


def _convert(cls: type[Policy], key: str, text: str):
    hints = typing.get_type_hints(cls)
    kind = hints.get(key)
    if text.lower() == "none":
        return None
    options = typing.get_args(kind) or (kind,)
    for option in options:
        if option is type(None):
            continue
        try:
            if option is bool:
                if text.lower() in ("true", "1", "yes"):
                    return True
                if text.lower() in ("false", "0", "no"):
                    return False
                raise ValueError
            return option(text)
        except (TypeError, ValueError):
            continue
    raise KvscopeError(f"policy parameter {key}={text!r} is not a valid value")


def parse(spec: str) -> Policy:
    """``"name"`` or ``"name:key=value:key=value"`` → a policy."""
    name, *pairs = spec.strip().split(":")
    if name not in REGISTRY:
        raise KvscopeError(f"unknown policy {name!r} (available: {', '.join(REGISTRY)})")
    params = {}
    for pair in pairs:
        if "=" not in pair:
            raise KvscopeError(f"policy parameter {pair!r} must read key=value")
        key, value = pair.split("=", 1)
        _check_parameters(name, [key])
        params[key] = _convert(REGISTRY[name], key, value)
    return make(name, **params)


__all__ = [
    "REGISTRY",
    "BudgetExceeded",
    "CacheSpec",
    "CacheState",
    "Full",
    "H2O",
    "KIVI",
    "Ledger",
    "LedgerError",
    "LogQuant",
    "LogQuantIndex",
    "Oracle",
    "Policy",
    "QEvict",
    "Rope",
    "SnapKV",
    "Streaming",
    "available",
    "make",
    "parse",
]
