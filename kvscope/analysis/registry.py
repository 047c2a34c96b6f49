"""The registry of metrics: ``kvscope analyze``, its JSON and ``kvscope.analysis.study``
are generated from it. Adding a metric = its module + one line here (or [`register`][kvscope.analysis.register])."""

from __future__ import annotations

from typing import Any

from ..errors import KvscopeError
from ..params import specs
from .churn import Churn
from .concentration import Concentration
from .drift import Drift
from .fmm import FMM
from .lir import LIR
from .metric import Metric
from .peaks import Peaks

METRICS: dict[str, type[Metric]] = {cls.name: cls for cls in (FMM, LIR, Churn, Peaks, Concentration, Drift)}


def available() -> dict[str, type[Metric]]:
    """Every registered metric by name."""
    return dict(METRICS)


def register(cls: type[Metric]) -> type[Metric]:
    """Add a metric class to the registry (usable as a decorator): ``kvscope analyze`` and its
    JSON pick it up.

    Args:
        cls: A ``Metric`` subclass with its own ``name``.
    """
    if not (isinstance(cls, type) and issubclass(cls, Metric)) or cls.name == Metric.name:
        raise KvscopeError("a metric is a Metric subclass with its own name")
    METRICS[cls.name] = cls
    return cls


def make(name: str, **params: Any) -> Metric:
    """The metric ``name`` with ``params`` as its fields (each checked against its range).

    Args:
        name: A registered metric's name.
        **params: Its fields by name.

    Raises:
        KvscopeError: An unknown name or parameter, or a value out of range.
    """
    if name not in METRICS:
        raise KvscopeError(f"unknown metric {name!r} (available: {', '.join(METRICS)})")
    cls = METRICS[name]
    unknown = sorted(set(params) - set(specs(cls)))
    if unknown:
        raise KvscopeError(f"metric {name} has no parameter {unknown[0]!r} (has: {', '.join(specs(cls))})")
    return cls(**params)


def make_all(metrics: list[str | Metric], params: dict) -> list[Metric]:
    """Metric objects from objects or names.

    Args:
        metrics: Metric objects or names.
        params: Fields that go to every named metric that has them (a parameter no named
            metric has is refused).
    """
    out, used = [], set()
    for m in metrics:
        if isinstance(m, Metric):
            out.append(m)
            continue
        mine = {k: v for k, v in params.items() if k in specs(METRICS[m])} if m in METRICS else {}
        used |= set(mine)
        out.append(make(m, **mine))
    unused = sorted(set(params) - used)
    if unused:
        raise KvscopeError(f"no metric of this study has a parameter {unused[0]!r}")
    return out
