"""Metrics as objects: one ``@dataclass`` per metric, its parameters as fields (defaults
written once, type and range beside them, checked on construction), and what every metric does:

    metric = FMM(horizon=16)            # kvscope.analysis.make("fmm", horizon=16) alike
    result = metric(ds)                 # xarray.Dataset, streamed over trace units
    doc = metric.summary(result)        # headline numbers + parameters, JSON-ready
    rows = metric.table(doc)            # (quantity, value) rows for the CLI's table
    fig = metric.plot(result, ax=None)  # a matplotlib Figure, saved only when asked

A metric over trace units (``UnitMetric``: FMM, churn, LIR, concentration, drift) makes one
pass per (sample, layer): ``start`` fixes what the pass needs (the events, a given selection),
``per_unit`` turns the trace units of one task into a few numbers each, ``reduce`` turns them
all into the result. Several unit metrics share one read of a trace in
``kvscope.analysis.study``. The registry (``kvscope.analysis``) lists every metric;
``kvscope analyze`` and its JSON are generated from it. docs/metrics.md adds a metric in a
worked example.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import xarray as xr

from .. import defaults
from ..errors import KvscopeError
from ..params import check_params, param, specs
from ..windows import Units
from .common import Prepared, UnitData, bootstrap_ratio, selection_from_tiers

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


@dataclass(kw_only=True)
class Metric:
    """Base of every metric: the trace units it looks at (``layers``, ``heads``)."""

    name: ClassVar[str] = "metric"
    title: ClassVar[str] = ""  # one line for ``kvscope analyze --help``
    cli_flags: ClassVar[bool] = True  # messages name parameters by their ``kvscope analyze`` flags
    replayed: ClassVar[str | None] = None  # a replayed policy feeds it "tiers", its "fp" set, or nothing

    layers: tuple[int, ...] | None = param(
        None, help="layers by the model's index, e.g. 0,3,5 or 10-15 (default all; a hybrid's attention layers)"
    )
    heads: tuple[int, ...] | None = param(None, help="indices of the stored head dim (default all)")

    def __post_init__(self):
        check_params(self)

    def params(self) -> dict:
        """Every parameter and its value (what the JSON and the result's attributes record)."""
        return {name: getattr(self, name) for name in specs(self)}

    def check_scope(self, ds: xr.Dataset) -> None:
        """``layers`` among the trace's layers (the model's indices: a hybrid stores its attention
        layers), ``heads`` inside its head dim (one line naming the flag otherwise).

        Args:
            ds: The trace.
        """
        layers = [int(x) for x in ds["layer"].values]
        if self.layers and any(x not in layers for x in self.layers):
            held = f"0..{len(layers) - 1}" if layers == list(range(len(layers))) else ", ".join(map(str, layers))
            raise KvscopeError(f"--layers outside {held}")
        size = ds.sizes[ds.kvscope.hdim]
        if self.heads and any(x >= size for x in self.heads):
            raise KvscopeError(f"--heads outside 0..{size - 1}")

    def __call__(self, ds: xr.Dataset, **given: Any) -> xr.Dataset:
        """The metric of a trace (a result Dataset with named dims).

        Args:
            ds: The trace.
            **given: What the metric takes besides the trace (a selection, replayed tiers).
        """
        raise NotImplementedError

    def inputs_from_tiers(self, tiers: xr.DataArray, n_sink: int) -> dict:
        """The keyword arguments that feed a replayed policy's ``tiers`` to ``__call__``:
        the tiers themselves, or the FP-set selection (sinks are not candidates).

        Args:
            tiers: ``[sample, event, layer, kv_head, pos]`` a run's tiers
                ([`tiers_for`][kvscope.replay.tiers_for]).
            n_sink: The sinks.
        """
        if self.replayed == "tiers":
            return {"tiers": tiers}
        if self.replayed == "fp":
            return {"selection": selection_from_tiers(tiers, accessible=False, n_sink=n_sink)}
        raise KvscopeError(f"{self.name} takes no replayed selection")

    def summary(self, result: xr.Dataset) -> dict:
        """JSON-ready headline numbers (``kvscope analyze --json``); every metric starts from
        ``base_summary``.

        Args:
            result: What the metric returned.
        """
        return self.base_summary(result)

    def base_summary(self, result: xr.Dataset) -> dict:
        """``{"analysis": name, **the result's attributes}``, JSON-ready.

        Args:
            result: What the metric returned.
        """
        attrs = {
            k: (v if isinstance(v, (int, float, str, bool)) or v is None else str(v)) for k, v in result.attrs.items()
        }
        return {"analysis": self.name, **attrs}

    def table(self, doc: dict) -> list[tuple[str, str]]:
        """``(quantity, value)`` rows of the summary for the CLI's table.

        Args:
            doc: What ``summary`` returned.
        """
        return []

    def plot(self, result: xr.Dataset, ax: Axes | None = None) -> Figure:
        """The metric's figure (saved only when asked: ``kvscope.figures.save``).

        Args:
            result: What the metric returned.
            ax: Draw into this axes (default: a new figure).
        """
        raise KvscopeError(f"{self.name} has no figure")


@dataclass(kw_only=True)
class Bootstrapped:
    """Confidence intervals: a percentile bootstrap that resamples prompts by default."""

    n_boot: int = param(defaults.N_BOOT, low=1, flag="--bootstrap", help="bootstrap resamples")
    seed: int = param(0, help="seed of the bootstrap")
    resample: str = param(
        "samples",
        choices=("samples", "units"),
        help="what the bootstrap resamples: samples (prompts, with every layer and head) or units",
    )

    def interval(self, num: np.ndarray, den: np.ndarray) -> tuple[float, float, float]:
        """Ratio of sums with its 95% CI; ``num``, ``den`` ``[sample, …]`` per trace unit."""
        return bootstrap_ratio(num, den, n_boot=self.n_boot, seed=self.seed, resample=self.resample)

    def ci_note(self, n_samples: int, n_units: int) -> str:
        """What the interval is (every table and JSON says it)."""
        return ci_note(self.resample, n_samples, n_units)


def ci_note(resample: str, n_samples: int, n_units: int) -> str:
    if resample == "units":
        return f"bootstrap over {n_units} trace units (sample, layer, head): within-prompt only"
    if n_samples < 2:
        return "none: one sample, so no between-prompt interval"
    return f"bootstrap over {n_samples} samples (prompts)"


def num(x) -> float | None:
    """A JSON number (6 decimals), None for NaN."""
    x = float(x)
    return None if math.isnan(x) else round(x, 6)


def nums(values) -> list:
    return [num(v) for v in np.asarray(values).ravel()]


def fmt(x, spec: str = ".3f", why: str | None = None) -> str:
    """A table cell: ``n/a`` for a missing number, followed by ``why`` it is missing when given."""
    if x is None:
        return f"n/a: {why}" if why else "n/a"
    return format(x, spec)


def layer_means(values: np.ndarray) -> np.ndarray:
    """``[layer]`` NaN-ignoring means of ``values [sample, event, layer, H]``."""
    per_layer = np.moveaxis(values, 2, 0).reshape(values.shape[2], -1)
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(per_layer)
        return np.where(finite.any(1), np.where(finite, per_layer, 0).sum(1) / np.maximum(finite.sum(1), 1), np.nan)


def ci_text(low, high) -> str:
    """`` [lo, hi]`` or nothing where there is no interval."""
    ok = low is not None and high is not None and math.isfinite(low) and math.isfinite(high)
    return f" [{low:.3f}, {high:.3f}]" if ok else ""


@dataclass
class Pass:
    """What one unit metric's pass over a trace needs besides the trace units."""

    prep: Prepared
    steps: np.ndarray  # [event] the steps at which selections are decided
    given: xr.DataArray | None = None  # a given selection (or tiers), else the history oracle
    source: str = "history-oracle"
    tiered: bool = False  # ``given`` holds tier codes (−1 none, 0 EVICTED, 1 Q, 2 FP)


@dataclass(kw_only=True)
class UnitMetric(Metric):
    """A metric computed per trace unit from per-step unit masses (window or token units)."""

    granularity: ClassVar[str] = "window"  # fields in subclasses that offer token units
    include_prefill: ClassVar[bool] = True  # scores include the prompt's column mass

    w: int | None = param(None, low=4, multiple_of=4, flag="--window", help="window size w", none="the trace's")
    n_sink: int | None = param(None, low=0, flag="--sinks", help="sink positions", none="the trace's")
    every: int | None = param(None, low=1, help="steps between events", none="w")

    def units(self, ds: xr.Dataset) -> Units:
        """The units of a pass: this metric's ``w`` and ``n_sink``, or the trace's.

        Args:
            ds: The trace.
        """
        return Units(
            self.granularity,
            self.w if self.w is not None else ds.kvscope.w,
            self.n_sink if self.n_sink is not None else ds.kvscope.n_sink,
        )

    def geometry(self) -> tuple:
        """What [`Prepared`][kvscope.analysis.Prepared] depends on: metrics with equal geometry share one read."""
        return (self.granularity, self.w, self.n_sink, self.layers, self.heads, self.include_prefill)

    def prepare(self, ds: xr.Dataset) -> Prepared:
        """The trace read for a pass over its units (metrics of equal ``geometry`` share one).

        Args:
            ds: The trace.
        """
        self.check_scope(ds)
        ds.kvscope.require_steps()
        units = self.units(ds)
        n_pos = ds.sizes["pos"] if "pos" in ds.sizes else units.n_sink + ds.sizes["window"] * ds.kvscope.w
        if units.count(n_pos) < 1 or units.n_sink >= n_pos:
            raise KvscopeError(
                f"{self.name}: --sinks {units.n_sink} and --window {units.w} leave no unit in {n_pos} positions"
            )
        return Prepared(ds, units, layers=self.layers, heads=self.heads, include_prefill=self.include_prefill)

    def events(self, prep: Prepared) -> np.ndarray:
        """``[event]`` the steps at which the history oracle decides: every ``every`` (default ``w``).

        Args:
            prep: The trace read for the pass.
        """
        return prep.events(self.every or prep.units.w)

    def start(self, prep: Prepared, given: xr.DataArray | None = None, tiered: bool = False) -> Pass:
        """What the pass needs besides the trace units: the events, and a given selection.

        Args:
            prep: The trace read for the pass.
            given: A selection (codes −1/0/1) or replayed tiers, with ``event_step``; None: the
                history oracle.
            tiered: ``given`` holds tier codes.
        """
        if given is None:
            return Pass(prep, self.events(prep))
        steps = np.asarray(given["event_step"].values)
        return Pass(prep, steps, given=given, source=given.attrs.get("policy", "given"), tiered=tiered)

    def width(self, run: Pass) -> int:
        """The numbers ``per_unit`` gives each trace unit.

        Args:
            run: The pass.
        """
        raise NotImplementedError

    def per_unit(self, u: UnitData, run: Pass) -> np.ndarray:
        """``[H, width]`` numbers of the task's trace units.

        Args:
            u: One (sample, layer)'s unit masses and what else the pass reads.
            run: The pass.
        """
        raise NotImplementedError

    def reduce(self, flat: np.ndarray, run: Pass) -> xr.Dataset:
        """The result from every trace unit's numbers.

        Args:
            flat: ``[sample, layer, H, width]`` what ``per_unit`` gave.
            run: The pass.
        """
        raise NotImplementedError

    def __call__(
        self,
        ds: xr.Dataset,
        *,
        selection: xr.DataArray | None = None,
        tiers: xr.DataArray | None = None,
        prep: Prepared | None = None,
    ) -> xr.Dataset:
        """The metric of ``ds`` — of the history oracle, a given ``selection`` or, for metrics
        that take them, replayed ``tiers``.

        Args:
            ds: The trace.
            selection: ``[sample, event, layer, H, unit]`` codes −1 none, 0 not selected,
                1 selected, with ``event_step`` (``selection_from_tiers`` makes one).
            tiers: A replayed run's tiers ([`tiers_for`][kvscope.replay.tiers_for]).
            prep: The trace already read for a pass (``study`` shares one).
        """
        if tiers is not None and self.replayed != "tiers":
            raise KvscopeError(f"{self.name} takes a selection, not tiers (selection_from_tiers makes one)")
        prep = prep or self.prepare(ds)
        run = self.start(prep, tiers if tiers is not None else selection, tiered=tiers is not None)
        flat = prep.map_units(functools.partial(self.per_unit, run=run), self.width(run), selection=run.given)
        return self.reduce(flat, run)

    def attrs(self, run: Pass, **extra: Any) -> dict:
        """The result's attributes: the metric, its geometry and parameters.

        Args:
            run: The pass.
            **extra: More attributes.
        """
        units = run.prep.units
        doc = {"metric": self.name, "granularity": units.kind, "w": units.w, "n_sink": units.n_sink}
        for name, value in self.params().items():
            if name not in ("layers", "heads", "w", "n_sink") and value is not None:
                doc[name] = value
        return {**doc, **extra}


@dataclass(kw_only=True)
class HistoryOracle(UnitMetric):
    """Unit metrics whose default selection is the oracle-by-history
    ([Concepts → history oracle](concepts.md#history-oracle)): the top-ρ candidate units by
    cumulative score at each event, the newest ``local`` tokens protected."""

    top_frac: float = param(
        defaults.TOP_FRAC, low=0, high=1, low_open=True, high_open=True, help="ρ of the history oracle"
    )
    local: int = param(defaults.LOCAL, low=0, help="protected newest tokens")
    include_prefill: bool = param(True, flag="--no-prefill", help="cumulative scores without prefill mass")

    def selection(self, u: UnitData, run: Pass) -> np.ndarray:
        """``[H, event, unit]`` the given selection, or the history oracle's."""
        if run.given is not None:
            return np.asarray(u.selection)
        return u.history_selection(run.steps, self.top_frac, self.local)


@dataclass(kw_only=True)
class SelectionMetric(Bootstrapped, HistoryOracle):
    """FMM, churn and LIR: over windows or tokens, of the history oracle or a given selection."""

    granularity: str = param("window", choices=("window", "token"), help="units: windows or tokens")
