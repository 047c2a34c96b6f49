"""``press:Name[:key=value…]``: a press of NVIDIA kvpress, run by kvpress's own classes.

    press:KnormPress                         kvpress's KnormPress
    press:SnapKVPress:window_size=64         a parameter of the press (kvpress's field names)
    press:DecodingPress:base=KnormPress:compression_interval=16
    press:AdaKVPress:press=SnapKVPress       a press wrapping a scorer
    press:ComposedPress:presses=[SnapKVPress:compression_ratio=0.5,ThinKPress:key_channel_compression_ratio=0.5]
    press:PerLayerCompressionPress:press=KnormPress:compression_ratios=[0.1,0.5,…]
    press:QFilterPress:asset=FOLDER          a learned asset from a local folder (``press_assets``)

Where a press runs ([presses](concepts.md#presses)):

    live      the press's own forward hook on the model's own attention modules, with its protocol
              (``kvscope.policies.press_hooks``); the live cache serves what the press left
    offline   a press the traits table declares to read only q, k, v on stand-ins of the layers
              built from the recording (``kvscope.policies.press_standins``); any other (a
              projection's weights, the model itself, a press of one's own) on the trace's own
              model, its prefill run once per sample (``PrefillCapture``)

Every way goes through one runner of the press's hook (``kvscope.policies.press_run``); what a
press needs is its row in ``kvscope.policies.press_traits``.

The budget sets the press's knob so that a press holds the same bytes as every other policy at
the same β (``fit_budget``):

    prompt presses    n = ⌊B / FP_bytes⌋ − S kept prompt tokens per (layer, kv_head) (every
                      decode token still fits at the final length, as for ``snapkv``);
                      compression_ratio r with kvpress's compute_n_kept(P, r) = n (PyramidKV:
                      the smallest r whose per-layer budgets sum to at most L·n; KVzip, KVgrad:
                      ⌊L·H·P·r⌋ pruned over all layers and heads = L·H·(P − n))
    DecodingPress     target_size = ⌊B / FP_bytes⌋ − compression_interval + 1 (the cache grows
                      by compression_interval − 1 tokens between compressions); the prompt is
                      not compressed, so P + compression_interval − 1 must fit as well
    ThinKPress        m pruned key channels of every prompt token (a prompt token costs
                      (2D − m)/2D of a full one), the fewest that fit
    as given          DMS (threshold), SimLayerKV, DuoAttention, PerLayerCompression, Composed:
                      no ratio sets them; they run as their parameters say, not set by β

A budget the press cannot reach (the decode tokens alone exceed it, or the prompt for
DecodingPress) runs at its smallest setting and is reported as not reached. Presses are checked on
the total bytes of all layers and heads (they may move budget between heads or layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ..errors import KvscopeError
from . import kvpress_bridge as bridge
from . import press_traits as traits
from .base import EVICTED, FP, CacheSpec, CacheState, Policy

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..model.rope import Rope
    from ..model.spec import ModelSpec
    from .press_hooks import PrefillCapture, PressHooks

REHEARSAL_PROMPT = 128  # tokens (at least) of the random prompt a press is tried on before it runs live
NOTES = {  # what a position-level metric means for a press that rewrites what it keeps
    "channels": "prunes key channels, not positions: FMM and churn see every position kept; "
    "its error is in attn L1 and out err of forced replay",
    "keys": "re-rotates the keys it keeps: FMM and churn count the positions it dropped, "
    "not how the kept ones now attend",
    "values": "merges the values it drops into those it keeps: FMM counts the dropped positions as lost",
}


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
            else "[" + ",".join(map(str, value)) + "]"
            if isinstance(value, (list, tuple))
            else str(value)
        )
        out.append((str(key), text))
    return tuple(out)


@dataclass
class Press(Policy):
    """A press of NVIDIA kvpress at the same bytes as every other policy (the module docstring):
    live on the model's own attention modules, offline on the recorded q/k/v or, where it reads
    more, on the trace's own model.

    Attributes:
        press: kvpress's class name (``SnapKVPress``), or a dotted path to a press of one's own.
        options: ``((key, text), …)`` the press's own arguments, in the order given (``asset``: a
            local folder of its learned asset).
    """

    press: str = traits.EXAMPLE
    options: tuple = field(default=())

    name = "press"
    kind = "kvpress"
    reads_queries: ClassVar[bool] = True  # offline: recorded q/k/v (or the trace's model)
    splits_itself: ClassVar[bool] = True
    live_hooks: ClassVar[bool] = True  # live: the press's hook on the model's own modules

    def __post_init__(self):
        super().__post_init__()
        self.options = _options(self.options)
        assets = [v for k, v in self.options if k == "asset"]
        self.asset = assets[-1] if assets else None
        self._tree = bridge.route(self.press, tuple((k, v) for k, v in self.options if k != "asset"))
        if traits.traits_of(self._tree["class"]).base:
            raise KvscopeError(
                f"press {self.press} is kvpress's base class, not a press: subclass it (a ScorerPress with a score)"
            )
        bridge.build(self._tree)  # kvpress's own checks, now

    @classmethod
    def from_text(cls, parts: list[str]) -> Press:
        """The press the command line spells ``press:SnapKVPress:window_size=64``.

        Args:
            parts: The spelling's parts after ``press``: ``["SnapKVPress", "window_size=64"]``.
        """
        if not parts or "=" in parts[0] or not parts[0]:
            raise KvscopeError("a press policy reads press:<PressClass>[:key=value…] (e.g. press:KnormPress)")
        return cls(parts[0].strip(), tuple(bridge.pair(part) for part in parts[1:]))

    def label(self) -> str:
        return ":".join(["press", self.press, *(f"{k}={v}" for k, v in self.options)])

    def params(self) -> dict:
        """``{"press": name, key: text, …}``."""
        return {"press": self.press, **dict(self.options)}

    def make_press(self):
        """A fresh kvpress object (presses keep per-sequence state, e.g. DecodingPress's buffers)."""
        return bridge.build(self._tree)

    @property
    def attentions(self) -> bool:
        """The press reads the layer's attention weights."""
        return traits.attentions(self.make_press())

    @property
    def renumbers(self) -> bool:
        """The press numbers the continuation from the rows it keeps (KeyRerotation, Finch)."""
        return traits.rerotates(self.make_press())

    def needs_model(self) -> str | None:
        """Why the press needs the model itself offline (None: recorded q, k, v suffice), as the
        traits table says of it and the presses nested in it (``press_traits.needs_model``)."""
        return traits.needs_model(self.make_press())

    def check_live(self, model: ModelSpec, rope: Rope | None = None, loaded: PreTrainedModel | None = None) -> None:
        """Refuse in one line, before anything is decoded, a press that cannot run on the model:
        its prefill under the press is rehearsed once on a random prompt of ``REHEARSAL_PROMPT``
        tokens (twice the press's largest integer parameter, if more: a window must fit).

        Args:
            model: The model's geometry.
            rope: Its rotary parameters.
            loaded: The transformers model the press runs on (None: nothing to rehearse).
        """
        if loaded is not None:
            _rehearse_live(self, loaded, model)

    def start(
        self,
        spec: CacheSpec,
        k: np.ndarray | None = None,
        v: np.ndarray | None = None,
        rope: Rope | None = None,
        q: np.ndarray | None = None,
        model: ModelSpec | None = None,
        *,
        capture: PrefillCapture | None = None,
        hooks: PressHooks | None = None,
    ) -> CacheState:
        """The press's state for one sequence.

        Args:
            spec: The cache's geometry and budget.
            k: Recorded keys ``[layer, kv_head, pos, D]`` (post-RoPE): the press on stand-ins.
            v: Recorded values ``[layer, kv_head, pos, D]``.
            rope: Rotary parameters.
            q: Recorded queries ``[qpos, layer, head, D]`` (post-RoPE).
            model: The model's geometry (required).
            capture: Offline on the trace's model: the sample's prompt prefilled
                (``kvscope.policies.press_hooks.PrefillCapture``).
            hooks: Live: the press's hook on the model (``PressHooks``), whose decisions the
                cache hands to the state.
        """
        if model is None:
            raise KvscopeError(f"{self.label()} needs the model's geometry")
        press = self.make_press()
        if capture is not None or hooks is not None:
            return _PressState(self, spec, press, model, capture=capture, hooks=hooks)
        if any(x is None for x in (k, v, q)):
            raise KvscopeError(f"{self.label()} needs recorded q/k/v (trace with --record qkv)")
        import torch

        k, v = (torch.as_tensor(x).float() for x in (k, v))  # no copy of float32 tensors (replay shares them)
        from .press_standins import StandInRunner

        runner = StandInRunner(press, spec, rope, model)
        return _PressState(self, spec, press, model, runner=runner, recorded=(k, v, q))

    def hooks(self, model: PreTrainedModel, model_spec: ModelSpec) -> PressHooks:
        """The press's hook on the attention modules of a model, installed, for a live cache.

        Args:
            model: The transformers model.
            model_spec: Its geometry.
        """
        from .press_hooks import PressHooks, post_init

        press = self.make_press()
        post_init(press, model, self.asset)
        return PressHooks(model, press, model_spec, self.attentions).install()


_REHEARSED: dict = {}


def _rehearse_live(policy: Press, model, model_spec) -> None:
    """A prefill of a random prompt under the press on the real model (once per press and model)."""
    key = (policy.label(), id(model))
    if key in _REHEARSED:
        return
    import torch

    from .press_hooks import PrefillCapture

    sizes = [int(v) for _, v in policy.options if v.lstrip("-").isdigit()]
    p = max(REHEARSAL_PROMPT, 2 * max(sizes, default=0))
    ids = torch.randint(0, int(model.config.vocab_size), (p,), generator=torch.Generator().manual_seed(0)).tolist()
    press = policy.make_press()
    cache_spec = CacheSpec(
        n_layers=model_spec.n_layers, n_kv=model_spec.n_kv_heads, head_dim=model_spec.head_dim, prompt_len=p,
        final_len=p + 1, budget=0.5, n_sink=1, w=4, fp_itemsize=4, tail_rows=4,
    )  # fmt: skip
    bridge.fit_budget(press, cache_spec, model_spec)
    PrefillCapture(model, ids, model_spec).decide(press, policy.attentions, policy.asset)
    _REHEARSED[key] = True


class _PressState(CacheState):
    """Tiers follow the positions the press holds: from its hook on stand-ins built from a recording
    (``runner``), from a prefill of the trace's model (``capture``), or from its hook on the live
    model (``hooks``, decisions handed over by ``take``).

    ``pruned [layer, kv_head]``: key channels the press zeroed at the prompt's positions (ThinK;
    their bytes are freed); ``rewrites``: what it changed in what it kept (``keys``, ``values``,
    ``channels``)."""

    def __init__(
        self, policy: Press, cache_spec: CacheSpec, press, model_spec: ModelSpec, *, runner=None, recorded=None,
        capture=None, hooks=None,
    ):  # fmt: skip
        super().__init__(policy, cache_spec)
        self.press, self.model_spec = press, model_spec
        self.runner, self.recorded, self.capture, self.hooks = runner, recorded, capture, hooks
        self.pooled = True
        pressing = hooks.press if hooks is not None else press
        self.reached, self.setting = bridge.fit_budget(pressing, cache_spec, model_spec)
        self.pruned = np.zeros((cache_spec.n_layers, cache_spec.n_kv), dtype=np.int64)
        self.rewrites: set[str] = set()
        self.pressed = None  # the PressedCache of an offline prefill on the model
        self._taken: dict = {}

    @property
    def decodes(self) -> bool:
        """The press acts on decode forwards too (``press_traits.decodes``)."""
        return traits.decodes(self.hooks.press if self.hooks is not None else self.press)

    def take(self, decided: dict) -> None:
        """A live forward's decisions: ``{layer: PressedLayer}`` (``PressHooks.take``)."""
        self._taken.update(decided)

    def scratch_bytes(self) -> int:
        return self.runner.scratch_bytes() if self.runner is not None else 0

    def _forward(self, start: int, stop: int):
        """Recorded ``keys, values [layer, kv_head, n, D]``, ``queries [n, layer, head, D]`` of
        positions ``start … stop − 1``."""
        k, v, q = self.recorded
        return k[:, :, start:stop], v[:, :, start:stop], q[start:stop]

    def after_prefill(self, colsum, tail) -> None:
        p = self.length
        if self.runner is not None:
            present = self.runner.prefill(*self._forward(0, p))
            self._note(self.runner.rewrites, self.runner.pruned)
        elif self.capture is not None:
            self.pressed = self.capture.decide(self.press, self.policy.attentions, self.policy.asset)
            present = self.pressed.held(p)
            layers = self.pressed.layers
            self._note(_rewritten(layers), self.pressed.channel_counts())
        else:
            present = self._taken_present(p)
        self._evict_absent(present)

    def compress(self) -> None:
        if self.runner is not None and self.runner.decodes:
            position = self.length - 1
            keys, values, queries = self._forward(position, self.length)
            self.runner.append(position, keys[:, :, 0], values[:, :, 0])
            self._evict_absent(self.runner.decode(position, queries[0]))
            self._note(self.runner.rewrites, None)
        elif self.hooks is not None and self._taken:
            self._evict_absent(self._taken_present(self.length))

    def _taken_present(self, length: int) -> np.ndarray:
        """``[layer, kv_head, length]`` what the live press holds after the decisions taken (a layer
        it did not touch holds what it held)."""
        present = self.tiers[..., :length] >= FP
        layers = self._taken
        self._taken = {}
        for layer, result in layers.items():
            present[layer] = result.held(length)
        self._note(_rewritten(layers.values()), None)
        for layer, result in layers.items():
            if result.pruned_channels is not None:
                self.pruned[layer] = result.channel_counts()
        return present

    def _note(self, rewrites, pruned) -> None:
        self.rewrites |= set(rewrites)
        if pruned is not None and np.any(pruned):
            self.pruned = np.asarray(pruned, dtype=np.int64)
            self.rewrites.add("channels")
        if self.rewrites:
            self.setting["rewrites"] = ",".join(sorted(self.rewrites))  # a note (``notes``), not a number

    def _evict_absent(self, present: np.ndarray) -> None:
        """``present [layer, kv_head, length]``: what the press still holds; the rest is evicted."""
        view = self.tiers[..., : self.length]
        view[(view == FP) & ~present] = EVICTED

    def bytes_used(self) -> np.ndarray:
        """The byte model's, less the key channels pruned at the prompt positions still held."""
        used = super().bytes_used()
        if not self.pruned.any():
            return used
        p = self.spec.prompt_len
        held = (self.tiers[..., : min(p, self.length)] == FP).sum(-1)  # [layer, kv_head]
        return used - held * self.pruned * self.spec.fp_itemsize


def _rewritten(layers) -> set[str]:
    """What the press rewrote in any of ``layers`` (``PressedLayer``s)."""
    return set().union(*(layer.rewritten for layer in layers))


def notes(rewrites: str) -> str:
    """What FMM and churn mean for a press that rewrote ``rewrites`` (``keys,values,channels``)."""
    return "; ".join(NOTES[what] for what in ("channels", "keys", "values") if what in rewrites.split(","))
