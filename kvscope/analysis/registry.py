"""The registry of metrics: ``kvscope analyze``, its JSON and :func:`kvscope.analysis.study`
are generated from it. Adding a metric = its module + one line here (or :func:`register`)."""

from __future__ import annotations

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
    """Add a metric class to the registry (usable as a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Metric)) or cls.name == Metric.name:
        raise KvscopeError("a metric is a Metric subclass with its own name")
    METRICS[cls.name] = cls
    return cls


def make(name: str, **params) -> Metric:
    """The metric ``name`` with ``params`` as its fields."""
    if name not in METRICS:
        raise KvscopeError(f"unknown metric {name!r} (available: {', '.join(METRICS)})")
    cls = METRICS[name]
    unknown = sorted(set(params) - set(specs(cls)))
    if unknown:
        raise KvscopeError(f"metric {name} has no parameter {unknown[0]!r} (has: {', '.join(specs(cls))})")
    return cls(**params)


def make_all(metrics, params: dict) -> list[Metric]:
    """Metric objects from objects or names; ``params`` go to every named metric that has them
    (a parameter no named metric has is refused)."""
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
