"""Shared pieces of the analyses: events, the history-oracle selection, bootstrap CIs.

Selections are one well-defined input everywhere: an int8 array over ``[..., event, unit]``
per trace unit with values:

    -1  not a candidate (the unit does not exist yet, or is protected: sinks, local tail)
     0  candidate, not selected
     1  selected

so that the default history oracle and, later, any replayed policy plug into FMM, churn
and LIR the same way. Tiered selections use ``TIER_*`` codes.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable

import numpy as np
import xarray as xr

from .. import defaults
from ..errors import KvscopeError
from ..tiers import TIER_CODES_RULE, TIER_EVICTED, TIER_FP, TIER_NONE, TIER_Q, valid_codes
from ..windows import Units
from .kernels import cumulative, top_fraction_codes
from .mass import prefill_unit_mass, unit_mass

NOT_CANDIDATE, NOT_SELECTED, SELECTED = -1, 0, 1


def selection_codes(tiers: np.ndarray, accessible: bool = True, n_sink: int = 0) -> np.ndarray:
    """int8 selection codes from tier codes ``[..., pos]`` (valid codes −1..2 only: checked where
    tiers come in): −1 where nothing exists (and for the first ``n_sink`` positions when given),
    1 for FP or Q (``accessible``) or FP only, else 0."""
    sel = np.take(_SELECTION_OF_TIER[accessible], tiers)  # a table lookup: 3-8x a nested np.where
    sel[..., :n_sink] = NOT_CANDIDATE
    return sel


def _selection_table(accessible: bool) -> np.ndarray:
    """The code of each tier, indexed by the tier code (``TIER_NONE`` = −1: the last entry)."""
    table = np.empty(4, dtype=np.int8)
    table[TIER_NONE] = NOT_CANDIDATE
    table[TIER_EVICTED] = NOT_SELECTED
    table[TIER_Q] = SELECTED if accessible else NOT_SELECTED
    table[TIER_FP] = SELECTED
    return table


_SELECTION_OF_TIER = {True: _selection_table(True), False: _selection_table(False)}


def selection_from_tiers(tiers: xr.DataArray, accessible: bool = True, n_sink: int = 0) -> xr.DataArray:
    """A selection (codes −1 not a candidate, 0 not selected, 1 selected) from tiers.

    Args:
        tiers: Tier codes with ``pos`` last ([`tiers_for`][kvscope.replay.tiers_for]).
        accessible: Selected = FP or Q (False: FP only).
        n_sink: The first positions, which are not candidates.
    """
    if not valid_codes(tiers.values):
        raise KvscopeError(TIER_CODES_RULE)
    sel = tiers.copy(data=selection_codes(tiers.values, accessible, n_sink))
    sel.attrs = dict(tiers.attrs)
    return sel


def event_steps(n_steps: int, every: int) -> np.ndarray:
    """Steps at which a policy re-decides: ``0, every, 2·every, … < n_steps``.

    Args:
        n_steps: The steps.
        every: Steps between events (≥ 1).
    """
    if every < 1:
        raise KvscopeError(f"event interval must be ≥ 1 (got {every})")
    return np.arange(0, n_steps, every)


def top_fraction_selection(
    scores: np.ndarray,
    exists: np.ndarray,
    protected: np.ndarray,
    top_frac: float,
) -> np.ndarray:
    """Top-``ρ`` candidates by score at each event: int8 ``[..., event, unit]``.

    Candidates exist and are not protected; ``k = ceil(ρ · n_candidates)`` of them are
    selected: every candidate above the k-th largest score, then those equal to it from the
    oldest unit on (ties broken toward the older unit).

    Args:
        scores: ``[..., event, unit]`` float.
        exists: ``[..., event, unit]`` bool (broadcastable).
        protected: ``[..., event, unit]`` bool (broadcastable): always kept, not candidates.
        top_frac: ρ in (0, 1).
    """
    scores = np.asarray(scores, dtype=np.float64)
    shape3 = (-1,) + scores.shape[-2:]  # leading dims flattened
    candidate = np.broadcast_to(exists & ~protected, scores.shape).reshape(shape3)
    out = np.empty(scores.shape, dtype=np.int8)
    top_fraction_codes(scores.reshape(shape3), candidate, float(top_frac), out.reshape(shape3))
    return out


class Prepared:
    """A trace made ready for per-trace-unit analysis, streaming and bounded in memory.

    ``m``        ``[sample, step, layer, H, unit]``  per-step unit mass, as dask blocks of one
                 trace unit × all steps (``S × U`` values: the memory bound of every metric)
    ``prefill``  ``[sample, layer, H, unit]``  prefill column mass (zeros without ``include_prefill``)

    [`map_units`][kvscope.analysis.Prepared.map_units] runs a function on every trace unit inside
    dask tasks (threads, or a ``dask.distributed`` cluster when a client is active) and gathers
    only its small output.

    Args:
        ds: The trace.
        units: The units (windows or tokens).
        layers: The layers by the model's index (default all).
        heads: Indices of the stored head dim (default all).
        include_prefill: Scores hold the prompt's column mass.
    """

    def __init__(
        self,
        ds: xr.Dataset,
        units: Units,
        layers: tuple[int, ...] | None = None,
        heads: tuple[int, ...] | None = None,
        include_prefill: bool = True,
    ):
        import dask.array as dsa

        self.ds = ds
        self.units = units
        self.layers, self.heads, self.include_prefill = layers, heads, include_prefill
        m = unit_mass(ds, units, layers, heads)
        self.hdim = "kv_head" if "kv_head" in m.dims else "head"
        order = ("sample", "step", "layer", self.hdim, units.dim)
        m = m.transpose(*order)
        if not isinstance(m.data, dsa.Array):
            m = m.chunk({"sample": 1, "step": ds.kvscope.block_steps, "layer": 1})
        # one task per (sample, layer): all steps, all heads (heads are looped inside the task)
        self.m = m.chunk({"sample": 1, "step": -1, "layer": 1, self.hdim: -1, units.dim: -1})
        prefill = prefill_unit_mass(ds, units, layers, heads).transpose("sample", "layer", self.hdim, units.dim)
        if not include_prefill:
            prefill = xr.zeros_like(prefill)
        self.prefill = prefill.chunk({"sample": 1, "layer": 1, self.hdim: -1, units.dim: -1})
        self.query_pos = ds.kvscope.query_pos  # [sample, step]
        self.n_steps = ds.kvscope.n_steps  # [sample]
        self.n_units = self.m.sizes[units.dim]
        self.n_step_total = self.m.sizes["step"]

    @property
    def n_samples(self) -> int:
        """Samples analysed."""
        return self.m.sizes["sample"]

    @property
    def n_trace_units(self) -> int:
        """(sample, layer, head) units analysed."""
        return self.m.sizes["sample"] * self.m.sizes["layer"] * self.m.sizes[self.hdim]

    def events(self, every: int) -> np.ndarray:
        """``[event]`` every ``every`` steps of the trace.

        Args:
            every: Steps between events.
        """
        return event_steps(self.n_step_total, every)

    def map_units(
        self,
        func: Callable[[UnitData], np.ndarray],
        width: int,
        selection: xr.DataArray | None = None,
        compute: bool = True,
    ) -> np.ndarray:
        """``func(u)`` for the trace units of every task; returns ``[sample, layer, H, width]``.

        Args:
            func: ``func(u) → [H, width]`` floats, ``u`` a ``UnitData`` holding all heads of
                one (sample, layer).
            width: The numbers ``func`` gives each trace unit.
            selection: ``[sample, event, layer, H, unit]`` a given selection handed to every
                task (``u.selection``).
            compute: Return numpy (False: a dask array).
        """
        import dask.array as dsa

        m = self.m.data
        pre = self.prefill.data[:, None]  # [sample, 1, layer, H, unit]
        qpos, n_steps, units, with_prefill = self.query_pos, self.n_steps, self.units, self.include_prefill
        args = [m, pre]
        if selection is not None:
            order = ("sample", "event", "layer", self.hdim, units.dim)
            sel = selection.transpose(*order)
            args.append(dsa.from_array(np.asarray(sel.values), chunks=(1, -1, 1, -1, -1)))
            steps = np.asarray(selection["event_step"].values)
        else:
            steps = None

        def block(mb, pb, sb=None, block_info=None):
            sample = block_info[0]["chunk-location"][0]
            unit = UnitData(
                np.moveaxis(mb[0, :, 0], 1, 0),  # [H, step, unit]
                pb[0, 0, 0],
                qpos[sample],
                n_steps=int(n_steps[sample]),
                units=units,
                include_prefill=with_prefill,
                selection=None if sb is None else np.moveaxis(sb[0, :, 0], 1, 0),  # [H, event, unit]
                selection_steps=steps,
            )
            return np.asarray(func(unit), dtype=np.float64).reshape(1, 1, 1, mb.shape[3], width)

        out = dsa.map_blocks(
            block,
            *args,
            dtype=np.float64,
            drop_axis=[4],
            new_axis=[4],
            chunks=(m.chunks[0], (1,) * len(m.chunks[1]), m.chunks[2], m.chunks[3], (width,)),
            name=f"units-{uuid.uuid4().hex}",  # hashing the closure (it holds the dataset) would cost more than the task
        )[:, 0]
        return out.compute() if compute else out

    def event_coords(self, steps: np.ndarray) -> dict:
        """Coordinates of a result over ``[sample, event, layer, H]``.

        Args:
            steps: ``[event]`` the events' steps.
        """
        return {
            "sample": self.m["sample"].values,
            "event": np.arange(len(steps)),
            "event_step": ("event", np.asarray(steps)),
            "layer": self.m["layer"].values,
            self.hdim: self.m[self.hdim].values,
        }

    def selection_array(self, sel: np.ndarray, steps: np.ndarray) -> xr.DataArray:
        """A selection as a DataArray with the result's coordinates.

        Args:
            sel: ``[sample, event, layer, H, unit]`` codes.
            steps: ``[event]`` the events' steps.
        """
        dims = ("sample", "event", "layer", self.hdim, self.units.dim)
        return xr.DataArray(sel, dims=dims, coords=self.event_coords(steps), name="selection")

    def history_selection(self, every: int, top_frac: float, local: int) -> xr.DataArray:
        """The oracle-by-history for every trace unit: int8 ``[sample, event, layer, H, unit]``.

        Args:
            every: Steps between events.
            top_frac: ρ, the share of candidates selected.
            local: Newest tokens always kept (not candidates).
        """
        steps = self.events(every)
        n_units = self.n_units
        flat = self.map_units(lambda u: u.flatten(u.history_selection(steps, top_frac, local)), len(steps) * n_units)
        sel = flat.reshape(*flat.shape[:3], len(steps), n_units).astype(np.int8)
        return self.selection_array(np.moveaxis(sel, 3, 1), steps)


class UnitData:
    """The trace units of one task (the heads of a (sample, layer)), vectorized over a
    leading dim: ``m [H, step, unit]``, ``prefill [H, unit]``, the sample's ``query_pos
    [step]`` and ``n_steps``, and optionally a given selection ``[H, event, unit]``. Every
    per-unit function returns ``[H, ...]``; any leading shape works (``[step, unit]`` alone too)."""

    def __init__(
        self,
        m,
        prefill,
        query_pos,
        n_steps,
        units: Units,
        *,
        include_prefill=True,
        selection=None,
        selection_steps=None,
    ):
        self.m = np.asarray(m, dtype=np.float64)
        self.prefill = np.asarray(prefill, dtype=np.float64)
        self.include_prefill = include_prefill
        self.query_pos = np.asarray(query_pos)
        self.n_steps = n_steps
        self.units = units
        self.selection = selection
        self.selection_steps = selection_steps
        self._cum = None
        self._selections: dict = {}

    @property
    def lead(self) -> tuple:
        """Shape of the leading (trace-unit) dims."""
        return self.m.shape[:-2]

    def flatten(self, x: np.ndarray) -> np.ndarray:
        """``[*lead, ...]`` → ``[*lead, width]``."""
        return np.asarray(x).reshape(*self.lead, -1)

    @property
    def cum(self) -> np.ndarray:
        """``S[t] = Σ_{t'≤t} m[t']``, ``[..., step, unit]``."""
        if self._cum is None:
            self._cum = cumulative(self.m)
        return self._cum

    def exists(self, steps) -> np.ndarray:
        """``[event, unit]`` the unit's last position ≤ query_pos at the step."""
        last = self.units.last_position(self.m.shape[-1])
        return last[None, :] <= self.query_pos[steps][:, None]

    def scores(self, steps) -> np.ndarray:
        """Cumulative scores at ``steps`` ``[..., event, unit]`` (docs/concepts.md#windows):

            c[t] = prefill + Σ_{1 ≤ t' ≤ t} m[t']       with the prompt's column mass
            c[t] = Σ_{0 ≤ t' ≤ t} m[t']                  without it

        Step 0's row is the prompt's last row, which the column sums already hold: counted once."""
        scores = self.cum[..., steps, :]
        if self.include_prefill:
            scores = scores - self.m[..., :1, :] + self.prefill[..., None, :]
        return scores

    def history_selection(self, steps, top_frac: float, local: int) -> np.ndarray:
        """``[..., event, unit]`` the oracle-by-history (FMM, churn and LIR of one task share it)."""
        key = (tuple(np.asarray(steps).tolist()), top_frac, local)
        if key not in self._selections:
            n_exist = self.units.n_existing(self.query_pos[steps])
            protected = self.units.protected(n_exist, self.m.shape[-1], local)
            self._selections[key] = top_fraction_selection(self.scores(steps), self.exists(steps), protected, top_frac)
        return self._selections[key]

    def valid_events(self, steps) -> int:
        return int((np.asarray(steps) < self.n_steps).sum())


RESAMPLE = ("samples", "units")


def bootstrap_ratio(
    num: np.ndarray,
    den: np.ndarray,
    n_boot: int = defaults.N_BOOT,
    seed: int = 0,
    level: float = 0.95,
    resample: str = "samples",
) -> tuple[float, float, float]:
    """Ratio of sums ``Σ num / Σ den`` with a percentile bootstrap CI: ``(estimate, low, high)``.

    ``resample="samples"`` (default) is a cluster bootstrap: whole samples are drawn with
    replacement, each with every layer and head, because the units of one prompt are correlated
    and a claim is about prompts; with fewer than two samples there is no between-prompt
    interval (low = high = NaN). ``resample="units"`` draws trace units independently (a
    within-prompt interval). Seeded.

    Args:
        num: One value per trace unit, ``[sample, …]``.
        den: Likewise (units with ``den = 0`` are left out).
        n_boot: Bootstrap resamples.
        seed: The generator's seed.
        level: The interval's confidence level.
        resample: ``samples`` or ``units``.
    """
    if resample not in RESAMPLE:
        raise KvscopeError(f"resample must be samples or units (got {resample!r})")
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    if resample == "samples" and num.ndim:
        num, den = num.reshape(num.shape[0], -1).sum(1), den.reshape(den.shape[0], -1).sum(1)
    num, den = num.ravel(), den.ravel()
    keep = den > 0
    num, den = num[keep], den[keep]
    if den.size == 0:
        return math.nan, math.nan, math.nan
    estimate = num.sum() / den.sum()
    if resample == "samples" and den.size < 2:
        return float(estimate), math.nan, math.nan
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, den.size, size=(n_boot, den.size))
    ratios = num[idx].sum(1) / den[idx].sum(1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(ratios, [alpha, 1 - alpha])
    return float(estimate), float(lo), float(hi)
