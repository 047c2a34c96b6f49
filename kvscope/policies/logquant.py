"""LogQuant's log-sparse full-precision selection (SPEC §5.1), as index lists.

One parameter ``W``. ``local`` holds the newest tokens (between ``W+1`` and ``2W`` once
warm), ``reserve`` at most ``W`` log-sparse tokens; the FP set is ``reserve ∪ local``.

* Prefill of length ``L``: ``tmp = [0..L)``; while ``len(tmp) ≥ 3W``:
  ``reserve = tmp[0:2W:2]``, ``local = tmp[2W:]``, ``tmp = reserve + local``. Then, if
  ``W < L < 3W``: ``reserve = tmp[:W]``, ``local = tmp[W:]``; if ``L ≤ W`` all is local.
* Each decode position is appended to ``local``; when ``len(local) > 2W``:
  ``reserve = (reserve + local[:W])[0::2]`` (or ``local[:W]`` when ``reserve`` is empty),
  then ``local = local[W:]``.

Position 0 is never dropped. The policy :class:`LogQuant` keeps ``reserve ∪ local`` at full
precision and everything else at ``bits`` bits; nothing is evicted. Each token is quantized
once, when it leaves the FP set (the published code re-quantizes the whole history at every
flush; kvscope follows the index lists). Keys per channel (``key_axis="channel"``, the
paper's text: the tokens that leave FP together form key groups of at most ``G``) or per
token in groups of ``key_group`` channels (``key_axis="token"``, the published code: 64).
``W = None`` (default) takes the largest ``W`` whose bytes fit the budget over the whole
sequence; when even ``W = 1`` does not, it runs at ``W = 1`` and reports its floor.

``evict=true`` is LogQuant *as eviction* (the paper's Table 2): the positions that leave the
FP set are dropped instead of quantized, and ``W`` is fitted with full-precision bytes only
(equal memory).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ..params import param
from .base import EVICTED, AsEviction, CacheSpec, CacheState, Ledger, Policy, Q
from .quant import BITS


@dataclass
class LogQuantIndex:
    """The index lists of one sequence; ``append`` one decode position at a time."""

    W: int
    reserve: list[int] = field(default_factory=list)
    local: list[int] = field(default_factory=list)

    @classmethod
    def after_prefill(cls, length: int, W: int) -> LogQuantIndex:
        if W < 1:
            raise ValueError(f"LogQuant W must be ≥ 1 (got {W})")
        tmp = list(range(length))
        reserve: list[int] = []
        local = tmp
        if length >= 3 * W:
            while len(tmp) >= 3 * W:
                reserve = tmp[0 : 2 * W : 2]
                local = tmp[2 * W :]
                tmp = reserve + local
        elif W < length < 3 * W:
            reserve, local = tmp[:W], tmp[W:]
        return cls(W, reserve, list(local))

    def append(self, position: int) -> None:
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
    W: int | None = param(None, low=1, help="LogQuant's window W", none="the largest that fits")
    bits: int = param(2, choices=BITS, help="bits per quantized value")
    key_axis: str = param("channel", choices=("channel", "token"), help="keys per channel (paper) or per token (code)")
    G: int = param(32, low=1, help="key_axis=channel: at most G tokens per key group")
    key_group: int = param(64, low=1, help="key_axis=token: channels per key group (the published code's 64)")
    value_group: int | None = param(None, low=1, help="channels per value group", none="the head dim")
    evict: bool = param(False, help="drop what it would quantize (LogQuant as eviction)")

    name = "logquant"

    def _ledger(self, spec: CacheSpec, k=None, v=None) -> Ledger:
        key_group = min(self.key_group, spec.head_dim) if self.key_axis == "token" else None
        return Ledger(spec, self.bits, self.key_axis, key_group, self.value_group, k=k, v=v)

    def start(self, spec: CacheSpec, k=None, v=None, rope=None) -> CacheState:
        ledger = self._ledger(spec, k, v)
        W = self.W if self.W is not None else self._fit_W(spec, ledger)
        return _LogQuantState(self, spec, ledger, W, spec.fits(self.max_bytes(spec, W, ledger)))

    def max_bytes(self, spec: CacheSpec, W: int, ledger: Ledger | None = None) -> float:
        """Largest bytes per (layer, kv_head) over the sequence for this ``W``."""
        ledger = ledger or self._ledger(spec)
        groups = self.G if self.key_axis == "channel" and not self.evict else 0
        token_bytes = 0.0 if self.evict else ledger.token_value_bytes
        return _max_bytes(spec.prompt_len, spec.final_len, W, spec.head_dim, token_bytes, groups, spec.fp_bytes)

    def _fit_W(self, spec: CacheSpec, ledger: Ledger) -> int:
        """The largest ``W`` that fits; bytes fall with ``W`` while per-flush key groups are
        tiny, then grow: find the cheapest ``W`` among small ones, then search upward."""
        w_max = max(1, spec.final_len // 3 + 1)
        small = range(1, min(w_max, 64) + 1)
        cheapest = min(small, key=lambda W: self.max_bytes(spec, W, ledger))
        fits = lambda W: spec.fits(self.max_bytes(spec, W, ledger))  # noqa: E731
        if not fits(cheapest):
            return cheapest  # the floor
        lo, hi = cheapest, w_max
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo


class _LogQuantState(CacheState):
    def __init__(self, policy: LogQuant, spec: CacheSpec, ledger: Ledger, W: int, reached: bool):
        super().__init__(policy, spec, ledger)
        self.W, self.reached = W, reached
        self.index: LogQuantIndex | None = None

    def _leave_fp(self, left: list[int]) -> None:
        if not left:
            return
        if self.policy.evict:
            self.set_tier_positions(left, EVICTED)
            return
        size = self.policy.G if self.policy.key_axis == "channel" else len(left)  # token axis: per token anyway
        for group in _chunks(left, size):
            self.ledger.quantize(np.asarray(group))
        self.set_tier_positions(left, Q)

    def after_prefill(self, colsum, tail) -> None:
        self.index = LogQuantIndex.after_prefill(self.length, self.W)
        self._leave_fp(sorted(set(range(self.length)) - set(self.index.fp)))

    def append(self, position: int) -> None:
        super().append(position)
        before = self.index.fp
        self.index.append(position)
        self._leave_fp(sorted(set(before) - set(self.index.fp)))
