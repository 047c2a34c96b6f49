"""LogQuant's log-sparse full-precision selection (docs/concepts.md#logquant), as index lists.

One parameter ``W``. ``local`` holds the newest tokens (between ``W+1`` and ``2W`` once
warm), ``reserve`` at most ``W`` log-sparse tokens; the FP set is ``reserve ∪ local``.

* Prefill of length ``L``: ``tmp = [0..L)``; while ``len(tmp) ≥ 3W``:
  ``reserve = tmp[0:2W:2]``, ``local = tmp[2W:]``, ``tmp = reserve + local``. Then, if
  ``W < L < 3W``: ``reserve = tmp[:W]``, ``local = tmp[W:]``; if ``L ≤ W`` all is local.
* Each decode position is appended to ``local``; when ``len(local) > 2W``:
  ``reserve = (reserve + local[:W])[0::2]`` (or ``local[:W]`` when ``reserve`` is empty),
  then ``local = local[W:]``.

Position 0 is never dropped. The policy ``LogQuant`` keeps ``reserve ∪ local`` at full
precision and quantizes the rest (its docstring).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..params import param
from .base import EVICTED, AsEviction, CacheSpec, CacheState, Ledger, Policy, Q
from .quant import BITS

if TYPE_CHECKING:
    from ..model.rope import Rope


@dataclass
class LogQuantIndex:
    """The index lists of one sequence (the module docstring); ``append`` one decode position
    at a time.

    Attributes:
        W: LogQuant's window.
        reserve: At most ``W`` log-sparse positions kept at full precision.
        local: The newest positions (between ``W + 1`` and ``2W`` once warm).
    """

    W: int
    reserve: list[int] = field(default_factory=list)
    local: list[int] = field(default_factory=list)

    @classmethod
    def after_prefill(cls, length: int, W: int) -> LogQuantIndex:
        """The index lists after a prefill of ``length`` positions.

        Args:
            length: The prompt's positions.
            W: LogQuant's window (≥ 1).
        """
        if W < 1:
            raise ValueError(f"LogQuant W must be ≥ 1 (got {W})")
        # LogQuant's loop over tmp = reserve + local (while len(tmp) ≥ 3W: reserve = tmp[0:2W:2],
        # local = tmp[2W:]), with local kept as the range start..length−1 it always is: O(length)
        reserve: list[int] = []
        start = 0
        if length >= 3 * W:
            reserve, start = list(range(0, 2 * W, 2)), 2 * W
            while W + length - start >= 3 * W:
                reserve = (reserve + list(range(start, start + W)))[::2]
                start += W
        elif W < length < 3 * W:
            reserve, start = list(range(W)), W
        return cls(W, reserve, list(range(start, length)))

    def append(self, position: int) -> None:
        """A decode step appends ``position`` to ``local``; past ``2W`` the oldest ``W`` move on
        to ``reserve``, which keeps every second one.

        Args:
            position: The new position.
        """
        self.local.append(position)
        if len(self.local) > 2 * self.W:
            head = self.local[: self.W]
            self.reserve = (self.reserve + head)[0::2] if self.reserve else head
            self.local = self.local[self.W :]

    @property
    def fp(self) -> list[int]:
        """Positions kept at full precision, ascending."""
        return self.reserve + self.local


def fp_sets_per_step(prompt_len: int, n_steps: int, W: int) -> list[list[int]]:
    """The FP set seen by the query of each step ``t`` (its own key already appended).

    Step 0 is the last prefill row: the cache holds positions ``0..P−1``. Step ``t ≥ 1``
    appends position ``P − 1 + t`` before attending.
    """
    index = LogQuantIndex.after_prefill(prompt_len, W)
    sets = [index.fp]
    for t in range(1, n_steps):
        index.append(prompt_len - 1 + t)
        sets.append(index.fp)
    return sets


def fp_transitions(prompt_len: int, final_len: int, W: int) -> Iterator[tuple[int, list[int], list[int]]]:
    """``(length, fp, left)`` after the prefill and after each appended position: the cache
    length, the FP set and the positions that left it at that moment (ascending)."""
    index = LogQuantIndex.after_prefill(prompt_len, W)
    fp = index.fp
    yield prompt_len, fp, sorted(set(range(prompt_len)) - set(fp))
    for position in range(prompt_len, final_len):
        before = index.fp
        index.append(position)
        after = index.fp
        left = sorted(set(before) - set(after))
        yield position + 1, after, left


@functools.lru_cache(maxsize=4096)
def _max_bytes(
    prompt_len: int, final_len: int, W: int, head_dim: int, token_bytes: float, G: int, fp_bytes: float
) -> float:
    """Peak bytes of the LogQuant cache (the same for every budget: cached). ``G`` tokens per
    key group when keys are quantized per channel, 0 when per token."""
    n_q, key_meta, worst = 0, 0.0, 0.0
    for _, fp, left in fp_transitions(prompt_len, final_len, W):
        if left:
            n_q += len(left)
            if G:
                key_meta += 4.0 * head_dim * math.ceil(len(left) / G)
        worst = max(worst, len(fp) * fp_bytes + n_q * token_bytes + key_meta)
    return worst


def _chunks(positions: list[int], size: int) -> list[list[int]]:
    return [positions[i : i + size] for i in range(0, len(positions), size)]


@dataclass
class LogQuant(AsEviction, Policy):
    """LogQuant: a log-sparse set at full precision (the index lists above), the rest at ``bits``
    bits ([Concepts → LogQuant](concepts.md#logquant)).

    Position 0 is never dropped. The policy keeps ``reserve ∪ local`` at full precision and
    everything else at ``bits`` bits; nothing is evicted. Each token is quantized once, when it
    leaves the FP set (the published code re-quantizes the whole history at every flush; kvscope
    follows the index lists). Keys per channel (``key_axis="channel"``, the paper's text: the
    tokens that leave FP together form key groups of at most ``G``) or per token in groups of
    ``key_group`` channels (``key_axis="token"``, the published code: 64). ``W = None``
    (default) takes the largest ``W`` whose bytes fit the budget over the whole sequence; when
    even ``W = 1`` does not, it runs at ``W = 1`` and reports its floor.

    ``evict=true`` is LogQuant *as eviction* (the paper's Table 2): the positions that leave the
    FP set are dropped instead of quantized, and ``W`` is fitted with full-precision bytes only
    (equal memory).
    """

    W: int | None = param(None, low=1, help="LogQuant's window W", none="the largest that fits")
    bits: int = param(2, choices=BITS, help="bits per quantized value", tune=(2, 4))
    key_axis: str = param(
        "channel", choices=("channel", "token"), help="keys per channel (paper) or per token (code)",
        tune=("channel", "token"),
    )  # fmt: skip
    G: int = param(32, low=1, help="key_axis=channel: at most G tokens per key group")
    key_group: int = param(64, low=1, help="key_axis=token: channels per key group (the published code's 64)")
    value_group: int | None = param(None, low=1, help="channels per value group", none="the head dim")
    evict: bool = param(False, help="drop what it would quantize (LogQuant as eviction)")

    name = "logquant"

    def _ledger(self, spec: CacheSpec, k=None, v=None) -> Ledger:
        key_group = min(self.key_group, spec.head_dim) if self.key_axis == "token" else None
        return Ledger(spec, self.bits, self.key_axis, key_group, value_group=self.value_group, k=k, v=v)

    def start(
        self, spec: CacheSpec, k: np.ndarray | None = None, v: np.ndarray | None = None, rope: Rope | None = None
    ) -> CacheState:
        return _LogQuantState(self, spec, self._ledger(spec, k, v))

    def max_bytes(self, spec: CacheSpec, W: int, ledger: Ledger | None = None) -> float:
        """Largest bytes per (layer, kv_head) over the sequence for this ``W``.

        Args:
            spec: The cache's geometry.
            W: LogQuant's window.
            ledger: The ledger whose byte costs count (default: a new one for ``spec``).
        """
        ledger = ledger or self._ledger(spec)
        groups = self.G if self.key_axis == "channel" and not self.evict else 0
        token_bytes = 0.0 if self.evict else ledger.token_value_bytes
        return _max_bytes(
            spec.prompt_len, spec.final_len, W, spec.head_dim, token_bytes=token_bytes, G=groups, fp_bytes=spec.fp_bytes
        )

    def window(self, spec: CacheSpec, ledger: Ledger, capacity: float) -> tuple[int, bool]:
        """``(W, fits)``: the user's ``W`` or the largest that fits ``capacity`` bytes per unit.

        Args:
            spec: The cache's geometry.
            ledger: The ledger whose byte costs count.
            capacity: Bytes per (layer, kv_head).
        """
        W = self.W if self.W is not None else self._fit_W(spec, ledger, capacity)
        return W, spec.fits(self.max_bytes(spec, W, ledger), capacity)

    def _smallest(self, spec: CacheSpec, ledger: Ledger) -> int:
        """The cheapest ``W`` among small ones (bytes fall with ``W`` while per-flush key groups
        are tiny, then grow)."""
        return min(range(1, min(_w_max(spec), 64) + 1), key=lambda W: self.max_bytes(spec, W, ledger))

    def unit_floor(self, spec: CacheSpec) -> float:
        ledger = self._ledger(spec)
        return self.max_bytes(spec, self.W if self.W is not None else self._smallest(spec, ledger), ledger)

    def _fit_W(self, spec: CacheSpec, ledger: Ledger, capacity: float) -> int:
        """The largest ``W`` that fits: from the cheapest small one, search upward."""
        cheapest = self._smallest(spec, ledger)
        fits = lambda W: spec.fits(self.max_bytes(spec, W, ledger), capacity)
        if not fits(cheapest):
            return cheapest  # the floor
        lo, hi = cheapest, _w_max(spec)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo


def _w_max(spec: CacheSpec) -> int:
    """The largest ``W`` worth trying: ``3W`` covers the final length."""
    return max(1, spec.final_len // 3 + 1)


@dataclass
class _Band:
    """The units that share one ``W`` (``units [layer, kv_head]``, None: all) and their index."""

    W: int
    units: np.ndarray | None
    index: LogQuantIndex | None = None


class _LogQuantState(CacheState):
    def __init__(self, policy: LogQuant, spec: CacheSpec, ledger: Ledger):
        super().__init__(policy, spec, ledger)
        self.size()

    def size(self) -> None:
        by_w: dict[int, np.ndarray | None] = {}
        for capacity, units in self.spec.capacity_groups():
            W, fits = self.policy.window(self.spec, self.ledger, capacity)
            self.reached &= fits
            by_w[W] = units if units is None or W not in by_w else by_w[W] | units
        self.bands = [_Band(W, units) for W, units in by_w.items()]

    @property
    def W(self) -> int | np.ndarray:
        """``W``: a number, or ``[layer, kv_head]`` when the units' capacities differ."""
        if self.bands[0].units is None:
            return self.bands[0].W
        out = np.zeros((self.spec.n_layers, self.spec.n_kv), dtype=np.int64)
        for band in self.bands:
            out[band.units] = band.W
        return out

    def _leave_fp(self, left: list[int], units: np.ndarray | None) -> None:
        if not left:
            return
        layers = heads = None
        if units is not None:
            layers, heads = np.nonzero(units)
        tier = EVICTED if self.policy.evict else Q
        if not self.policy.evict:
            size = self.policy.G if self.policy.key_axis == "channel" else len(left)  # token axis: per token anyway
            for group in _chunks(left, size):
                group = np.asarray(group)
                if units is None:
                    self.ledger.quantize(group)
                else:
                    self.ledger.quantize(np.broadcast_to(group, (len(layers), len(group))), layers, heads)
        if units is None:
            self.set_tier_positions(left, tier)
        else:
            self.tiers[layers[:, None], heads[:, None], np.asarray(left)] = tier

    def after_prefill(self, colsum, tail) -> None:
        for band in self.bands:
            band.index = LogQuantIndex.after_prefill(self.length, band.W)
            self._leave_fp(sorted(set(range(self.length)) - set(band.index.fp)), band.units)

    def append(self, position: int) -> None:
        super().append(position)
        for band in self.bands:
            before = band.index.fp
            band.index.append(position)
            self._leave_fp(sorted(set(before) - set(band.index.fp)), band.units)
