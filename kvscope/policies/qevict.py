"""``qevict``: window-level, three tiers (FP, Q, EVICTED), byte-bounded (docs/concepts.md#qevict)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .. import defaults
from ..params import param
from ..windows import window_sums
from .base import EVICTED, FP, CacheSpec, CacheState, Ledger, Policy, Q, top_k_mask
from .quant import BITS

if TYPE_CHECKING:
    from ..model.rope import Rope


@dataclass
class QEvict(Policy):
    """Window-level, three tiers (FP, Q, EVICTED), byte-bounded ([Concepts → QEvict](concepts.md#qevict)).

    Windows ``j = [n_sink + j·w, n_sink + (j+1)·w)``; the sinks and the newest ``local`` tokens
    (rounded up to whole windows, plus the window being filled) always stay FP. Whenever a window
    completes (every ``w`` steps) the *evictable* windows — complete, outside sinks and local,
    not yet EVICTED — are ranked by their cumulative score ``c[j]`` (prefill column mass plus
    every row the cache observed; Q windows keep accruing, evicted ones are absent):

        M    = B − FP_bytes(n_sink + (n_local_windows + 1)·w)
        n_fp = ⌊(1 − q_frac)·M / b_fp⌋,   n_q = ⌊q_frac·M / b_q⌋
        b_fp = w·4·D,                    b_q = w·(2·D·b/8 + 4·D/g_v) + 4·D   (keys per channel per window)

    The top ``n_fp`` are FP, the next ``n_q`` Q, the rest EVICTED for good. A Q window ranked
    into FP is promoted (its dequantized values come back — not the originals); an FP window
    ranked into Q is demoted. Each window is quantized once, at its first demotion (the write-once
    ledger refuses a second quantization); later demotions reuse its codes. Decisions per
    (layer, kv_head) from the kv-group mean rows. With rotary parameters recorded, keys are
    quantized before RoPE (``key_prerope``).
    """

    w: int | None = param(None, low=4, multiple_of=4, help="window size", none="the trace's")
    n_sink: int | None = param(None, low=0, help="sinks kept", none="the trace's")
    local: int = param(defaults.LOCAL, low=0, help="protected newest tokens (whole windows)", tune=(0, 16, 32, 64, 128))
    q_frac: float = param(0.7, low=0, high=1, help="share of the evictable budget given to the Q tier", tune=(0.0, 1.0))
    bits: int = param(2, choices=BITS, help="bits per quantized value", tune=(2, 4))
    key_prerope: bool = param(True, help="quantize keys before RoPE when rotary parameters are known")
    value_group: int | None = param(None, low=1, help="channels per value group", none="the head dim")

    name = "qevict"
    kind = "tiered"
    observes = True
    observes_prefill = True
    quantizes = True

    def start(
        self, spec: CacheSpec, k: np.ndarray | None = None, v: np.ndarray | None = None, rope: Rope | None = None
    ) -> CacheState:
        w = self.w or spec.w
        ledger = Ledger(
            spec, self.bits, "channel", value_group=self.value_group, k=k, v=v, rope=rope if self.key_prerope else None
        )
        return _QEvictState(self, spec, ledger, w)

    def sinks(self, spec: CacheSpec) -> int:
        """The sinks kept: ``n_sink``, or the trace's.

        Args:
            spec: The cache's geometry (its ``n_sink``: the trace's).
        """
        return spec.n_sink if self.n_sink is None else self.n_sink

    def protected(self, spec: CacheSpec) -> int:
        """Tokens always at full precision: the sinks, the local windows and the one being filled.

        Args:
            spec: The cache's geometry.
        """
        w = self.w or spec.w
        return self.sinks(spec) + (math.ceil(self.local / w) + 1) * w

    def unit_floor(self, spec: CacheSpec) -> float:
        return self.protected(spec) * spec.fp_bytes


class _QEvictState(CacheState):
    def __init__(self, policy: QEvict, spec: CacheSpec, ledger: Ledger, w: int):
        super().__init__(policy, spec, ledger)
        self.w = w
        self.n_sink = policy.sinks(spec)
        self.n_local_windows = math.ceil(policy.local / w)
        self.scores = np.zeros(self.tiers.shape, dtype=np.float64)  # [layer, kv_head, pos]
        self.promotions = 0
        self.demotions = 0
        self.size()

    def size(self) -> None:
        spec, q_frac = self.spec, self.policy.q_frac
        b_fp = self.w * spec.fp_bytes
        b_q = self.w * self.ledger.token_value_bytes + 4.0 * spec.head_dim
        room = np.asarray(spec.capacity - spec.fp_bytes * self.policy.protected(spec), dtype=np.float64)
        if np.any(room < 0):
            self.reached, room = False, np.maximum(room, 0.0)
        self.n_fp = np.floor((1 - q_frac) * room / b_fp + 1e-9).astype(np.int64)  # a number or [layer, kv_head]
        self.n_q = np.floor(q_frac * room / b_q + 1e-9).astype(np.int64)

    def after_prefill(self, colsum, tail) -> None:
        self.scores[..., : self.length] = colsum
        self.route()

    def observe(self, row: np.ndarray) -> None:
        self.scores[..., : row.shape[-1]] += row

    def compress(self) -> None:
        done = self.length - self.n_sink
        if done > 0 and done % self.w == 0:  # a window just completed
            self.route()

    def route(self) -> None:
        w, s = self.w, self.n_sink
        n_ev = (self.length - s) // w - self.n_local_windows  # evictable windows 0..n_ev−1
        if n_ev <= 0:
            return
        c = window_sums(self.scores, s, w, n_ev)  # [layer, kv_head, window]
        body = self.tiers[..., s : s + n_ev * w]  # view
        current = body[..., ::w]  # [layer, kv_head, window] tier of each window's first position
        alive = current != EVICTED
        to_fp = top_k_mask(c, alive, self.n_fp)
        to_q = top_k_mask(c, alive & ~to_fp, self.n_q)
        new = np.where(to_fp, FP, np.where(to_q, Q, EVICTED)).astype(np.int8)
        first_demotion = to_q & (current == FP) & ~self.ledger.done[..., s : s + n_ev * w : w]
        if first_demotion.any():
            li, hi, ji = np.nonzero(first_demotion)
            self.ledger.quantize(s + ji[:, None] * w + np.arange(w), li, hi)
        self.promotions += int((to_fp & (current == Q)).sum())
        self.demotions += int((to_q & (current == FP)).sum())
        body[...] = np.repeat(new, w, axis=-1)
