"""``snapkv``: compress the prompt once, at the end of prefill, by what its last queries
attend; decode tokens all stay."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import KvscopeError
from ..params import param
from .base import CacheSpec, CacheState, Policy, top_k_mask


@dataclass
class SnapKV(Policy):
    """Compress the prompt once, at the end of prefill, by what its last queries attend; decode tokens
    all stay.

    Scores of prompt position ``p < P − obs`` per (layer, kv_head): ``Σ_o tail[o, p]`` over
    the last ``obs_window`` prefill rows, pooled over positions with kernel ``kernel`` (stride 1,
    same padding): ``avg`` is ``F.avg_pool1d`` (zeros past the ends, divided by ``kernel``),
    ``max`` the maximum over the positions that exist. Keep the top ``n_prompt − obs`` of them
    plus the observation window itself, with ``n_prompt = ⌊B / FP_bytes⌋ − S`` so that the
    decode tokens still fit at the final length. Evictions are permanent.

    Defaults are the official implementation's (FasterDecoding/SnapKV, ``init_snapkv``: window
    32, kernel 5, average pooling); its LongBench ablations use ``kernel=7:pooling=max``, and
    kvpress's ``SnapKVPress`` window 64, kernel 5, average ([Replay](replay.md)).
    """

    obs_window: int | None = param(
        None,
        low=1,
        help="observation rows scored",
        none="the rows the trace stored (32 by default, the official window)",
        tune=(8, 16, 32),
    )
    kernel: int = param(5, low=1, help="pooling kernel (odd)", tune=(1, 3, 5, 7, 9))
    pooling: str = param(
        "avg", choices=("avg", "max"), help="how scores are pooled over positions", tune=("avg", "max")
    )

    name = "snapkv"
    observes_prefill = True
    kind = "eviction (prompt)"

    def __post_init__(self):
        super().__post_init__()
        if self.kernel % 2 == 0:
            raise KvscopeError(f"snapkv parameter kernel must be a positive odd number (got {self.kernel})")

    def state_type(self) -> type[CacheState]:
        return _SnapKVState

    def observed_rows(self, stored: int) -> int:
        """Observation rows scored when the trace stored ``stored`` prefill rows.

        Args:
            stored: The prefill rows the trace stored (its ``obs_window``).
        """
        return min(self.obs_window or stored, stored)

    def unit_floor(self, spec: CacheSpec) -> float:
        """The observation window and every decode token.

        Args:
            spec: The cache's geometry.
        """
        return (self.observed_rows(spec.tail_rows) + spec.decode_steps) * spec.fp_bytes

    def scores(self, tail: np.ndarray, obs: int, prefix: int) -> np.ndarray:
        """``[layer, kv_head, prefix]``: the attention of the last ``obs`` prefill rows, pooled.

        Args:
            tail: ``[layer, kv_head, rows, P]`` the last prefill rows.
            obs: The observation rows scored (the last ``obs`` of ``tail``).
            prefix: The positions scored (``0 … prefix − 1``).
        """
        window_rows = np.nan_to_num(tail[..., tail.shape[-2] - obs :, :prefix].astype(np.float64))
        return pool(window_rows.sum(-2), self.kernel, self.pooling)

    def allocation_scores(self, colsum: np.ndarray, tail: np.ndarray | None) -> np.ndarray:
        if tail is None:
            raise KvscopeError("snapkv needs the last prefill rows (prefill_tail) of the trace")
        obs = min(self.observed_rows(tail.shape[-2]), tail.shape[-1])
        return self.scores(tail, obs, tail.shape[-1] - obs)


def pool(x: np.ndarray, kernel: int, how: str = "max") -> np.ndarray:
    """``max`` or ``avg`` over ``[p − kernel//2, p + kernel//2]`` along the last axis; the edges
    are padded with −∞ for ``max`` and with 0 for ``avg`` (which divides by ``kernel``, as
    ``torch.nn.functional.avg_pool1d`` does by default)."""
    half = kernel // 2
    fill = -np.inf if how == "max" else 0.0
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(half, half)], constant_values=fill)
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel, axis=-1)
    return windows.max(-1) if how == "max" else windows.sum(-1) / kernel


class _SnapKVState(CacheState):
    def after_prefill(self, colsum, tail) -> None:
        if tail is None:
            raise KvscopeError("snapkv needs the last prefill rows (prefill_tail) of the trace")
        p = self.length
        obs = min(self.policy.observed_rows(tail.shape[-2]), p)
        if self.policy.obs_window and self.policy.obs_window > tail.shape[-2]:
            raise KvscopeError(
                f"snapkv obs_window {self.policy.obs_window} > the {tail.shape[-2]} rows the trace stored"
            )
        n_prompt = self.spec.fp_capacity_tokens - self.spec.decode_steps  # a number or [layer, kv_head]
        if np.any(n_prompt < obs):
            self.reached = False
            n_prompt = np.maximum(n_prompt, obs)
        if np.all(p <= n_prompt):
            return
        prefix = p - obs
        scores = self.policy.scores(tail, obs, prefix)
        candidates = np.ones(scores.shape, dtype=bool)
        keep = top_k_mask(scores, candidates, n_prompt - obs)  # [layer, kv_head, prefix]
        self.evict(~keep)
