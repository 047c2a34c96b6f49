"""What the explorer draws, read from a trace (and a replay result) a view at a time.

A view is a rectangle of decode steps × key positions of one (sample, layer, head). Only the
stored chunks it covers are read (a chunk is one block of steps × one layer × all positions),
and the rectangle is reduced to at most ``rows × cols`` cells:

    cell (i, j) = mean of a[t, p] over t ∈ [t0 + i·dy, t0 + (i+1)·dy), p ∈ [p0 + j·dx, p0 + (j+1)·dx)
    dy = ⌈(t1 − t0) / rows⌉,  dx = ⌈(p1 − p0) / cols⌉                (dy = dx = 1: the exact rows)

over the positions that exist (NaN beyond ``query_pos``, rows past ``n_steps`` NaN). The mean,
not the sum, keeps the colour of a cell comparable at every zoom. A window-resolution store
gives each position of window ``j`` the window's mean ``m_j / w`` (the sinks their own
probability), so its finest view is ``w`` positions wide.

Tier overlays: at step ``t`` a position shows the tier the policy gave it at the latest event
``e`` with ``event_step[e] ≤ t`` (−1 none, 0 EVICTED, 1 Q, 2 FP; drawn as ``tier + 1`` in
uint8, 0 = none); a cell shows the lowest tier among its positions (an evicted position is
never hidden by a kept neighbour).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import xarray as xr

from ..errors import KvscopeError
from ..storage import dataset  # noqa: F401  (registers the ds.kvscope accessor this module reads)

NONE = -1


@dataclass(frozen=True)
class Rect:
    """A half-open rectangle of steps × positions and its cell size."""

    t0: int
    t1: int
    p0: int
    p1: int
    dy: int = 1
    dx: int = 1

    @classmethod
    def fitted(
        cls, steps: tuple[float, float], pos: tuple[float, float], n_steps: int, n_pos: int, rows: int, cols: int
    ):
        """The rectangle covering the (float) ranges, clipped to the trace, cells ≤ rows × cols."""
        t0, t1 = _clip(steps, n_steps)
        p0, p1 = _clip(pos, n_pos)
        return cls(t0, t1, p0, p1, max(1, math.ceil((t1 - t0) / rows)), max(1, math.ceil((p1 - p0) / cols)))

    @property
    def shape(self) -> tuple[int, int]:
        return math.ceil((self.t1 - self.t0) / self.dy), math.ceil((self.p1 - self.p0) / self.dx)

    @property
    def exact(self) -> bool:
        return self.dy == self.dx == 1


def _clip(span: tuple[float, float], n: int) -> tuple[int, int]:
    lo = min(max(0, math.floor(span[0])), n - 1)
    return lo, max(lo + 1, min(n, math.ceil(span[1])))


def cells(x: np.ndarray, dy: int, dx: int, reduce=np.nanmean, fill=np.nan) -> np.ndarray:
    """``[t, p]`` → ``[⌈t/dy⌉, ⌈p/dx⌉]``: ``reduce`` over each cell, the edges padded with ``fill``."""
    ny, nx = math.ceil(x.shape[0] / dy), math.ceil(x.shape[1] / dx)
    padded = np.full((ny * dy, nx * dx), fill, dtype=x.dtype)
    padded[: x.shape[0], : x.shape[1]] = x
    blocks = padded.reshape(ny, dy, nx, dx).transpose(0, 2, 1, 3).reshape(ny, nx, dy * dx)
    if dy * dx == 1:
        return blocks[..., 0]
    with warnings.catch_warnings():  # "Mean of empty slice": a cell with nothing in it is NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        return reduce(blocks, axis=-1)


def overlay_cells(codes: np.ndarray, rect: Rect) -> np.ndarray:
    """``[head, step, pos]`` tier codes → ``[head, row, col]`` uint8 ``tier + 1`` (0 = none):
    the lowest tier of each cell (NONE never hides a tier)."""
    ranked = np.where(codes == NONE, 127, codes).astype(np.int16)
    low = np.stack([cells(x, rect.dy, rect.dx, reduce=np.min, fill=127) for x in ranked])
    return np.where(low == 127, 0, low + 1).astype(np.uint8)


class TraceView:
    """Reads views of one trace. ``ds`` from [`kvscope.open_trace`][kvscope.open_trace] (checked on open; every
    chunk passes its checksum when read)."""

    def __init__(self, ds: xr.Dataset):
        if "attn" not in ds or "tokens" not in ds:
            raise KvscopeError("not a kvscope trace: no attn/tokens arrays")
        self.ds = ds
        acc = ds.kvscope
        self.hdim = acc.hdim
        self.window = acc.resolution == "window"
        self.w, self.n_sink = acc.w, acc.n_sink
        self.query_pos = acc.query_pos  # [sample, step]
        self.n_steps = acc.n_steps  # [sample]
        self.slack = acc.rows.slack
        self.n_pos = ds.sizes["pos"] if "pos" in ds.sizes else self.n_sink + ds.sizes["window"] * self.w

    @property
    def shape(self) -> dict[str, int]:
        ds = self.ds
        return {
            "sample": ds.sizes["sample"],
            "step": ds.sizes["step"],
            "layer": ds.sizes["layer"],
            "head": ds.sizes[self.hdim],
            "pos": self.n_pos,
        }

    def extent(self, sample: int) -> tuple[int, int]:
        """``(steps, positions)`` of a sample: its valid steps and the keys its last query sees."""
        n_steps = max(1, int(self.n_steps[sample]))
        return n_steps, max(1, int(self.query_pos[sample, n_steps - 1]) + 1)  # a sample without steps: 1 × 1

    def check(self, sample: int, layer: int, head: int) -> None:
        for name, value in (("sample", sample), ("layer", layer), ("head", head)):
            if not 0 <= value < self.shape[name]:
                raise KvscopeError(f"{name} {value} is not in this trace (0..{self.shape[name] - 1})")

    def probabilities(self, sample: int, layer: int, t0: int, t1: int) -> np.ndarray:
        """``[head, step, pos]`` float32 per-position probabilities of steps ``t0..t1−1`` (NaN
        where no key exists or the step is past ``n_steps``); values out of [0, 1] are refused."""
        self.check(sample, layer, 0)
        sel = {"sample": sample, "layer": layer, "step": slice(t0, t1)}
        if self.window:
            win = self._read("attn", sel, "window")  # [H, step, window]
            sink = self._read("attn_sink", sel, "sink")  # [H, step, sink]
            body = np.repeat(win / self.w, self.w, axis=-1)
            a = np.concatenate([sink, body], axis=-1)[..., : self.n_pos]
        else:
            a = self._read("attn", sel, "pos")  # [H, step, pos]
        qpos = self.query_pos[sample, t0:t1]
        alive = (np.arange(t0, t1) < self.n_steps[sample])[:, None] & (np.arange(a.shape[-1]) <= qpos[:, None])
        a = np.where(alive, a, np.nan)
        bad = alive & ~((a >= 0) & (a <= 1 + self.slack + 1e-3))
        if bad.any():
            h, t, p = np.argwhere(bad)[0]
            raise KvscopeError(
                f"attn of sample {sample}, step {t0 + t}, layer {layer}, {self.hdim} {h}, position {p} "
                f"holds {float(a[h, t, p])!r}, not a probability: not drawn"
            )
        return a

    def _read(self, name: str, sel: dict, last: str) -> np.ndarray:
        """``[H, step, last]`` float32 of the stored chunks ``sel`` covers (read, then ordered:
        transposing xarray's lazy array first would make it index point by point)."""
        da = self.ds[name].isel(sel)
        order = [da.dims.index(d) for d in (self.hdim, "step", last)]
        return np.transpose(da.values, order).astype(np.float32)

    def heats(self, sample: int, layer: int, rect: Rect, heads=None) -> np.ndarray:
        """``[head, row, col]`` cell means of the rectangle (module docstring), of ``heads``
        (default all: a chunk holds every head)."""
        a = self.probabilities(sample, layer, rect.t0, rect.t1)[..., rect.p0 : rect.p1]
        chosen = range(len(a)) if heads is None else heads
        return np.stack([cells(a[h], rect.dy, rect.dx) for h in chosen]).astype(np.float32)

    def heat(self, sample: int, layer: int, head: int, rect: Rect) -> np.ndarray:
        """``[row, col]`` of one head."""
        self.check(sample, layer, head)
        return self.heats(sample, layer, rect, [head])[0]

    def tokens(self, sample: int) -> np.ndarray:
        """``[pos]`` token ids of the sample (−1 = pad)."""
        return self.ds["tokens"].isel(sample=sample).values


class TierView:
    """The replayed tiers of a result that belongs to the trace (``matching``)."""

    def __init__(self, result: xr.Dataset):
        self.result = result
        self.tiers = result["tiers"]  # [policy, allocation?, budget, sample, event, layer, kv_head, pos] (lazy)
        self.event_step = np.asarray(result["event_step"].values)

    @property
    def policies(self) -> list[str]:
        return [str(p) for p in self.result["policy"].values]

    @property
    def budgets(self) -> list[float]:
        return [float(b) for b in self.result["budget"].values]

    @property
    def allocations(self) -> list[str]:
        return [str(a) for a in self.result["allocation"].values] if "allocation" in self.result.dims else ["uniform"]

    def run(self, policy: str, budget: float, allocation: str = "uniform") -> dict:
        sel = {"policy": policy, "budget": budget}
        if "allocation" in self.tiers.dims:
            sel["allocation"] = allocation
        return sel

    def codes(self, run: dict, sample: int, layer: int, t0: int, t1: int, p0: int, p1: int) -> np.ndarray:
        """``[kv_head, step, pos]`` tier codes: each step shows the snapshot of the latest event
        at or before it."""
        steps = np.arange(t0, t1)
        event = np.searchsorted(self.event_step, steps, side="right") - 1  # [step]
        used = np.unique(event[event >= 0])
        codes = np.full((self.tiers.sizes["kv_head"], len(steps), p1 - p0), NONE, dtype=np.int8)
        if len(used):
            snap = self.tiers.sel(run).isel(sample=sample, layer=layer, event=used, pos=slice(p0, p1))
            order = [snap.dims.index(d) for d in ("kv_head", "event", "pos")]
            snap = np.transpose(snap.values, order)  # [kv_head, used event, pos]
            have = event >= 0
            codes[:, have] = snap[:, np.searchsorted(used, event[have])]
        return codes

    @property
    def forced(self) -> bool:
        """The result holds forced replay's per-step figures."""
        return "forced_kl" in self.result

    def forced_columns(self, run: dict, sample: int) -> dict[str, list]:
        """``{step, kl}``: forced replay's KL to full KV at each scored step of a run on ``sample``."""
        kl = np.asarray(self.result["forced_kl"].sel(run).isel(sample=sample).values, dtype=float)  # [step]
        scored = np.flatnonzero(np.isfinite(kl))
        return {"step": [int(t) for t in scored], "kl": [float(x) for x in kl[scored]]}

    @property
    def answers(self) -> bool:
        """The result holds task accuracy (forced replay of a trace with answers)."""
        return "answer_exact" in self.result

    def answer_columns(self, budget: float, allocation: str = "uniform") -> dict[str, list]:
        """``{sample, task, full KV, <policy>…}``: each graded sample's answer under each policy at
        ``budget``, ``lost`` / ``gained`` where it differs from full KV's (``kvscope.report.answer_table``)."""
        from ..report import answer_table

        return answer_table(self.result, budget, allocation if "allocation" in self.result.dims else "uniform")

    def tier_mass(self, run: dict, sample: int, layer: int, head: int) -> xr.DataArray:
        """``[event, tier]`` share of the future mass each tier received (NaN = censored)."""
        return self.result["tier_mass"].sel(run).isel(sample=sample, layer=layer, kv_head=head)


def matching(result: xr.Dataset, trace: TraceView, where: str) -> TierView:
    """The result's tiers if it was replayed from a trace of this shape, else one line naming
    the first difference."""
    ds, acc = trace.ds, trace.ds.kvscope
    want = {
        "sample": ds.sizes["sample"],
        "layer": ds.sizes["layer"],
        "kv_head": ds.sizes.get("kv_head", acc.model.n_kv_heads),
        "pos": trace.n_pos,
    }
    for dim, n in want.items():
        got = result.sizes.get(dim)
        if got != n:
            raise KvscopeError(f"{where} does not match the trace: {dim} is {got} there, {n} in the trace")
    if str(result.attrs.get("model", "")) != str(ds.attrs.get("model", {}).get("name", "")):
        raise KvscopeError(f"{where} does not match the trace: it was replayed on model {result.attrs.get('model')!r}")
    steps = np.asarray(result["event_step"].values)
    if len(steps) and steps.max() >= ds.sizes["step"]:
        raise KvscopeError(f"{where} does not match the trace: an event at step {int(steps.max())} is past its steps")
    return TierView(result)
