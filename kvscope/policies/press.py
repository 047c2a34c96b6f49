"""``press:Name[:key=value…]``: a press of NVIDIA kvpress, replayed on recorded q/k/v.

    press:KnormPress                         kvpress's KnormPress
    press:SnapKVPress:window_size=64         a parameter of the press (kvpress's field names)
    press:DecodingPress:base=KnormPress:compression_interval=16
    press:AdaKVPress:press=SnapKVPress       a press wrapping a scorer

The press classes are kvpress's own (:mod:`kvscope.policies.kvpress_bridge` drives them on
stand-ins of the attention layers). The budget sets what kvpress takes as a compression
ratio, so that a press holds the same bytes as every other policy at the same β::

    prompt presses    n = ⌊B / FP_bytes⌋ − S kept prompt tokens per (layer, kv_head) (every
                      decode token still fits at the final length, as for ``snapkv``);
                      compression_ratio r with kvpress's compute_n_kept(P, r) = n (PyramidKV:
                      the smallest r whose per-layer budgets sum to at most L·n)
    DecodingPress     target_size = ⌊B / FP_bytes⌋ − compression_interval + 1 (the cache grows
                      by compression_interval − 1 tokens between compressions); the prompt is
                      not compressed, so P + compression_interval − 1 must fit as well

A budget the press cannot reach (the decode tokens alone exceed it, or the prompt for
DecodingPress) runs at its smallest setting and is reported as not reached. Presses that move
budget between heads or layers (AdaKV, PyramidKV) are checked on the total bytes of all
layers and heads, the others per (layer, kv_head) as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ..errors import KvscopeError
from . import kvpress_bridge as bridge
from .base import EVICTED, FP, CacheSpec, CacheState, Policy


def _options(options) -> tuple[tuple[str, str], ...]:
    items = options.items() if isinstance(options, dict) else options
    out = []
    for item in items:
        if len(item) != 2:
            raise KvscopeError(f"press options must be key=value pairs (got {item!r})")
        key, value = item
        key = bridge.ALIASES.get(key, key)
        text = (
            value.__name__ if isinstance(value, type) else str(value).lower() if isinstance(value, bool) else str(value)
        )
        out.append((str(key), text))
    return tuple(out)


@dataclass
class Press(Policy):
    press: str = "KnormPress"
    options: tuple = field(default=())  # ((key, text), …) in the order given

    name = "press"
    kind = "kvpress"
    observes_prefill = True
    reads_queries: ClassVar[bool] = True
    splits_itself: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        self.options = _options(self.options)
        self._tree = bridge.route(self.press, self.options)
        bridge.build(self._tree)  # kvpress's own checks, now

    @classmethod
    def from_text(cls, parts: list[str]) -> Press:
        """``["SnapKVPress", "window_size=64"]`` (the CLI's ``press:SnapKVPress:window_size=64``)."""
        if not parts or "=" in parts[0] or not parts[0]:
            raise KvscopeError("a press policy reads press:<PressClass>[:key=value…] (e.g. press:KnormPress)")
        pairs = []
        for part in parts[1:]:
            if "=" not in part:
                raise KvscopeError(f"press parameter {part!r} must read key=value")
            key, value = part.split("=", 1)
            pairs.append((key.strip(), value.strip()))
        return cls(parts[0].strip(), tuple(pairs))

    def label(self) -> str:
        return ":".join(["press", self.press, *(f"{k}={v}" for k, v in self.options)])

    def params(self) -> dict:
        return {"press": self.press, **dict(self.options)}

    def make_press(self):
        """A fresh kvpress object (presses keep per-sequence state, e.g. DecodingPress's buffers)."""
        return bridge.build(self._tree)

    def start(self, spec: CacheSpec, k=None, v=None, rope=None, q=None, model=None) -> CacheState:
        if k is None or q is None or model is None:
            raise KvscopeError(f"{self.label()} needs recorded q/k/v (trace with --record qkv)")
        return _PressState(self, spec, bridge.PressRunner(self.make_press(), spec, k, v, q, rope, model))


class _PressState(CacheState):
    """Tiers follow the positions the press keeps in each layer's stand-in cache."""

    def __init__(self, policy: Press, spec: CacheSpec, runner):
        super().__init__(policy, spec)
        self.runner = runner
        self.pooled = True
        self.reached, self.setting = runner.fit_budget()

    def after_prefill(self, colsum, tail) -> None:
        self._evict_absent(self.runner.prefill(self.length))

    def append(self, position: int) -> None:
        super().append(position)
        if self.runner.decodes:
            self.runner.append(position)

    def compress(self) -> None:
        if self.runner.decodes:
            self._evict_absent(self.runner.decode(self.length - 1))

    def _evict_absent(self, present: np.ndarray) -> None:
        """``present [layer, kv_head, length]``: what the press still holds; the rest is evicted."""
        view = self.tiers[..., : self.length]
        view[(view == FP) & ~present] = EVICTED
