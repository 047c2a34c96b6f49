"""``kivi``: 2-bit KV quantization with a full-precision residual (KIVI).

Keys are quantized per channel over groups of ``G`` consecutive tokens, values per token
(groups of ``value_group`` channels, default the head dim). The newest ``R`` tokens (a
multiple of ``G``) stay FP: after ``T`` tokens the quantized prefix is
``⌊(T − R) / G⌋·G`` tokens, so the FP tail holds between ``R`` and ``R + G − 1``.
Nothing is evicted. ``R = None`` (default) takes the largest multiple of ``G`` whose bytes
stay within the budget over the whole sequence; when even ``R = 0`` does not fit, the
policy runs at ``R = 0`` and reports its floor.

``evict=true`` is KIVI *as eviction* (LogQuant's Table 2): the groups it would quantize are
dropped instead, and ``R`` is fitted to the budget with full-precision bytes only (equal
memory: the residual grows into what the quantized prefix would have held)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import KvscopeError
from ..params import param
from .base import EVICTED, AsEviction, CacheSpec, CacheState, Ledger, Policy, Q
from .quant import BITS, q_token_bytes


@dataclass
class KIVI(AsEviction, Policy):
    bits: int = param(2, choices=BITS, help="bits per quantized value")
    G: int = param(32, low=1, help="tokens per key group (keys per channel)")
    R: int | None = param(
        None, low=0, help="full-precision residual tokens (a multiple of G)", none="the most that fit"
    )
    value_group: int | None = param(None, low=1, help="channels per value group", none="the head dim")
    evict: bool = param(False, help="drop what it would quantize (KIVI as eviction)")

    name = "kivi"

    def __post_init__(self):
        super().__post_init__()
        if self.R is not None and self.R % self.G:
            raise KvscopeError(f"kivi parameter R must be a multiple of G={self.G} (got {self.R})")

    def start(self, spec: CacheSpec, k=None, v=None, rope=None) -> CacheState:
        ledger = Ledger(spec, self.bits, "channel", value_group=self.value_group, k=k, v=v)
        return _KIVIState(self, spec, ledger)

    def max_bytes(self, spec: CacheSpec, R: int) -> float:
        """Largest bytes per (layer, kv_head) over the sequence with residual ``R``."""
        lengths = np.arange(spec.prompt_len, spec.final_len + 1)
        n_q = np.maximum(0, (lengths - R) // self.G) * self.G
        q_bytes = 0.0 if self.evict else q_token_bytes(spec.head_dim, self.bits, self.G, self.value_group)
        return float(((lengths - n_q) * spec.fp_bytes + n_q * q_bytes).max())


class _KIVIState(CacheState):
    def __init__(self, policy: KIVI, spec: CacheSpec, ledger: Ledger):
        super().__init__(policy, spec, ledger)
        if policy.R is not None:
            self.R = policy.R
            self.reached = spec.fits(policy.max_bytes(spec, self.R))
        else:
            self.R = (spec.final_len // policy.G) * policy.G
            while self.R > 0 and not spec.fits(policy.max_bytes(spec, self.R)):
                self.R -= policy.G
            self.reached = spec.fits(policy.max_bytes(spec, self.R))
        self.n_quantized = 0

    def compress(self) -> None:
        g = self.policy.G
        target = max(0, (self.length - self.R) // g) * g
        while self.n_quantized < target:
            group = np.arange(self.n_quantized, self.n_quantized + g)
            if self.policy.evict:
                self.set_tier_positions(group, EVICTED)
            else:
                self.ledger.quantize(group)
                self.set_tier_positions(group, Q)
            self.n_quantized += g
