"""``press:Name[:key=value…]``: a press of NVIDIA kvpress, replayed on recorded q/k/v.

    press:KnormPress                         kvpress's KnormPress
    press:SnapKVPress:window_size=64         a parameter of the press (kvpress's field names)
    press:DecodingPress:base=KnormPress:compression_interval=16
    press:AdaKVPress:press=SnapKVPress       a press wrapping a scorer

The press classes are kvpress's own (``kvscope.policies.kvpress_bridge`` drives them on
stand-ins of the attention layers). The budget sets what kvpress takes as a compression
ratio, so that a press holds the same bytes as every other policy at the same β:

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
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ..errors import KvscopeError
from . import kvpress_bridge as bridge
from .base import EVICTED, FP, CacheSpec, CacheState, Policy

if TYPE_CHECKING:
    from ..model.rope import Rope
    from ..model.spec import ModelSpec

REHEARSAL_PROMPT = 128  # tokens (at least) of the random prompt a press is tried on before it runs live


def _options(options) -> tuple[tuple[str, str], ...]:
    items = options.items() if isinstance(options, dict) else options
    out = []
    for item in items:
        if len(item) != 2:
            raise KvscopeError(f"press options must be key=value pairs (got {item!r})")
        key, value = item
        key = bridge.ALIASES.get(key, key)
        text = (
            bridge.press_name(value)
            if isinstance(value, type)
            else str(value).lower()
            if isinstance(value, bool)
            else str(value)
        )
        out.append((str(key), text))
    return tuple(out)


@dataclass
class Press(Policy):
    """A press of NVIDIA kvpress, driven on stand-ins of the attention layers at the same bytes
    as every other policy (the module docstring); it needs recorded q/k/v offline.

    Attributes:
        press: kvpress's class name (``SnapKVPress``), or a dotted path to a press of one's own.
        options: ``((key, text), …)`` the press's own fields, in the order given.
    """

    press: str = "KnormPress"
    options: tuple = field(default=())

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
        """The press the command line spells ``press:SnapKVPress:window_size=64``.

        Args:
            parts: The spelling's parts after ``press``: ``["SnapKVPress", "window_size=64"]``.
        """
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
        """``{"press": name, key: text, …}``."""
        return {"press": self.press, **dict(self.options)}

    def make_press(self):
        """A fresh kvpress object (presses keep per-sequence state, e.g. DecodingPress's buffers)."""
        return bridge.build(self._tree)

    def check_live(self, model: ModelSpec, rope: Rope | None = None) -> None:
        """Rehearse the press on random tensors of ``model``'s geometry — a prompt of
        ``REHEARSAL_PROMPT`` tokens (twice the press's largest integer parameter, if more: a
        window must fit) and a decode step, as a live cache feeds them — so that a press that
        fails on kvscope's stand-in layers (it reads a projection's weights, runs the model
        itself) is refused in one line before anything is decoded.

        Args:
            model: The model's geometry.
            rope: Its rotary parameters.
        """
        import torch

        sizes = [int(v) for _, v in self.options if v.lstrip("-").isdigit()]
        p = max(REHEARSAL_PROMPT, 2 * max(sizes, default=0))
        spec = CacheSpec(model.n_layers, model.n_kv_heads, model.head_dim, p, p + 1, 0.5, 1, 4, 4, 4)
        state = self.start(spec, rope=rope, model=model)
        generator = torch.Generator().manual_seed(0)
        shape = (model.n_layers, model.n_kv_heads, p + 1, model.head_dim)
        k, v = (torch.randn(shape, generator=generator) for _ in range(2))
        q = torch.randn((p + 1, model.n_layers, model.n_heads, model.head_dim), generator=generator).numpy()
        state.feed(k[:, :, :p], v[:, :, :p], q[:p])
        state.prefill(np.zeros((*shape[:2], p)), None)
        state.append(p)
        if state.reads_forward(prefill=False):
            state.feed(k[:, :, p:], v[:, :, p:], q[p:])
        state.compress()

    def start(
        self,
        spec: CacheSpec,
        k: np.ndarray | None = None,
        v: np.ndarray | None = None,
        rope: Rope | None = None,
        q: np.ndarray | None = None,
        model: ModelSpec | None = None,
    ) -> CacheState:
        """The press's state for one sequence. Offline it reads the recorded ``k``, ``v``, ``q``;
        live (none of them) the cache feeds each forward's tensors (``_PressState.feed``).

        Args:
            spec: The cache's geometry and budget.
            k: Recorded keys ``[layer, kv_head, pos, D]`` (post-RoPE).
            v: Recorded values ``[layer, kv_head, pos, D]``.
            rope: Rotary parameters.
            q: Recorded queries ``[qpos, layer, head, D]`` (post-RoPE).
            model: The model's geometry (required).
        """
        if model is None or (any(x is None for x in (k, v, q)) and any(x is not None for x in (k, v, q))):
            raise KvscopeError(f"{self.label()} needs recorded q/k/v (trace with --record qkv)")
        recorded = None
        if k is not None:
            import torch

            k, v = (torch.as_tensor(x).float() for x in (k, v))  # no copy of float32 tensors (replay shares them)
            recorded = (k, v, q)
        runner = bridge.PressRunner(self.make_press(), spec, rope, model)
        return _PressState(self, spec, runner, recorded)


class _PressState(CacheState):
    """Tiers follow the positions the press keeps in each layer's stand-in cache. The press
    reads each forward's q/k/v: sliced from a recording, or fed by a live cache
    (``feed``) right before the state decides."""

    def __init__(self, policy: Press, spec: CacheSpec, runner, recorded=None):
        super().__init__(policy, spec)
        self.runner = runner
        self.recorded = recorded  # (k [layer, kv_head, pos, D], v, q [qpos, layer, head, D]) or None: live
        self.fed = None
        self.pooled = True
        self.reached, self.setting = runner.fit_budget()

    def reads_forward(self, prefill: bool) -> bool:
        """Whether the forward (the prompt's, or a decode step's) must be fed to ``feed``."""
        return prefill or self.runner.decodes

    def feed(self, keys, values, queries) -> None:
        """A live forward's tensors: ``keys, values [layer, kv_head, n, D]`` float32 tensors and
        ``queries [n, layer, head, D]`` (post-RoPE) of its ``n`` new positions."""
        self.fed = (keys, values, queries)

    def scratch_bytes(self) -> int:
        return self.runner.scratch_bytes()

    def _forward(self, start: int, stop: int):
        """``keys, values [layer, kv_head, n, D]``, ``queries [n, layer, head, D]`` of positions
        ``start … stop − 1``."""
        if self.recorded is not None:
            k, v, q = self.recorded
            return k[:, :, start:stop], v[:, :, start:stop], q[start:stop]
        fed, self.fed = self.fed, None
        if fed is None or fed[0].shape[2] != stop - start:
            raise RuntimeError("a live press state reads the tensors of each forward it decides on (feed)")
        return fed

    def after_prefill(self, colsum, tail) -> None:
        self._evict_absent(self.runner.prefill(*self._forward(0, self.length)))

    def compress(self) -> None:
        if self.runner.decodes:
            position = self.length - 1
            keys, values, queries = self._forward(position, self.length)
            self.runner.append(position, keys[:, :, 0], values[:, :, 0])
            self._evict_absent(self.runner.decode(position, queries[0]))

    def _evict_absent(self, present: np.ndarray) -> None:
        """``present [layer, kv_head, length]``: what the press still holds; the rest is evicted."""
        view = self.tiers[..., : self.length]
        view[(view == FP) & ~present] = EVICTED
