"""What every policy shares: the cache geometry, the per-sequence state, the write-once
quantization ledger.

A policy is a small ``@dataclass`` whose fields are its parameters; ``policy.start(spec)``
returns a [`CacheState`][kvscope.policies.CacheState] for one sequence. The state never reads a trace: it is driven by
observations, exactly as a live cache would be:

    state.prefill(colsum, tail)      prompt positions 0..P−1 exist; compress to the budget
    state.append(p)                  a decode step adds position p at full precision
    state.observe(row)               the attention the cache served at this step
    state.compress()                 decide tiers; bytes must now be ≤ the budget
    state.tiers                      # [layer, kv_head, pos] int8: −1 none, 0 EVICTED, 1 Q, 2 FP

Shapes: ``colsum [layer, kv_head, P]`` (mass each prompt key got from all prompt queries),
``tail [layer, kv_head, obs, P]`` (the last prefill rows), ``row [layer, kv_head, length]``
(kv-group mean over the accessible positions, 0 elsewhere, sums to 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from .. import defaults
from ..errors import KvscopeError
from ..model.rope import Rope, apply_rope, undo_rope
from ..params import check_params, field_values, spelled
from ..storage.dtypes import cast
from ..tiers import TIER_EVICTED, TIER_FP, TIER_NONE, TIER_Q
from .quant import fp_token_bytes, quantize

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..model.spec import ModelSpec

NONE, EVICTED, Q, FP = TIER_NONE, TIER_EVICTED, TIER_Q, TIER_FP
BYTES_TOLERANCE = 1e-6  # relative slack of every budget check (float sums of bytes)
QUANTIZE_ROWS = 1024  # key groups quantized at once: bounds the float32 temporaries of a prefill


def check_budget(budget: float | str) -> float:
    """β as a number in (0, 1] (one line naming the value otherwise).

    Args:
        budget: A share of the full cache's bytes, as a number or its text (``"0.3"``).

    Returns:
        The budget as a float.

    Raises:
        KvscopeError: Not a number, or outside (0, 1].
    """
    try:
        value = float(budget)
    except (TypeError, ValueError):
        raise KvscopeError(f"budget must be a number in (0, 1] (got {budget!r})") from None
    if not (0 < value <= 1):
        raise KvscopeError(f"budget must lie in (0, 1] (got {budget})")
    return value


class BudgetExceeded(KvscopeError):
    """A policy that claimed to fit its budget used more bytes."""


class LedgerError(RuntimeError):
    """A ledger entry was quantized a second time (a bug in a policy, never bad input)."""


@dataclass(frozen=True)
class CacheSpec:
    """Geometry and budget of one sequence's cache.

    ``budget`` β is a share of ``FP_bytes(P + S)``, what the model really caches at full
    precision for the final length (the cache geometry, ``kvscope.model.spec``):
    ``B = β · FP_bytes(P + S)`` over all layers and cache units, the same for every policy. One
    token costs ``token_values · fp_itemsize`` bytes per unit (K and V of a KV head: ``2·D``
    values; MLA's shared latent: ``kv_lora_rank + qk_rope_head_dim``), and a sliding-window layer
    holds at most its window (``layer_windows``: the positions that leave it are dropped by the
    model itself, [`CacheState.drop_outside_windows`][kvscope.policies.CacheState.drop_outside_windows],
    and cost nothing). An allocation ([`kvscope.policies.allocation`][kvscope.policies.allocation])
    splits ``B`` into ``unit_capacity [layer, kv_head]``
    bytes; without one every unit holds ``β`` of its own full bytes (uniform). ``fp_itemsize`` =
    2 accounts full-precision entries at 16 bit, 4 at 32 bit (a live cache of an fp32 model);
    quantized entries keep their 16-bit scale and zero either way. ``capacity`` and
    ``fp_capacity_tokens`` are numbers under the uniform split of a model whose layers hold alike,
    and arrays broadcastable to ``[layer, kv_head]`` otherwise, so that a policy written with numpy
    broadcasting sizes itself the same way under both.

    Attributes:
        n_layers: Layers this cache holds.
        n_kv: KV heads (cache units) per layer this cache holds.
        head_dim: ``D``, the size of one key or value head.
        prompt_len: ``P``, the prompt's tokens.
        final_len: ``P + S``, the length after the last decode step.
        budget: β, a share of ``FP_bytes(P + S)`` in (0, 1].
        n_sink: Sinks: the first positions.
        w: The window size.
        fp_itemsize: Bytes per element of a full-precision K/V entry (2: 16-bit).
        tail_rows: The last prefill rows the policy can observe.
        first_layer: The model's index of this cache's first layer (a replay task of some layers).
        model_layers: Layers of the whole model (0: ``n_layers``, this cache holds them all).
        model_kv: KV heads of the whole model (0: ``n_kv``; a replay task may hold some).
        token_values: Values one token costs per unit at full precision (0: ``2·D``, its K and V).
        layer_windows: Each layer's sliding window (None: global; ``()``: all global).
        model_held: Tokens a layer of the whole model holds at the final length, on average
            (0: ``final_len``).
        unit_capacity: ``[layer, kv_head]`` bytes per unit an allocation gave (None: uniform).
    """

    n_layers: int
    n_kv: int
    head_dim: int
    prompt_len: int
    final_len: int
    budget: float
    n_sink: int = 4
    w: int = 8
    fp_itemsize: int = 2
    tail_rows: int = defaults.OBS_WINDOW
    first_layer: int = 0
    model_layers: int = 0
    model_kv: int = 0
    token_values: int = 0
    layer_windows: tuple[int | None, ...] = ()
    model_held: float = 0.0
    unit_capacity: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def fp_bytes(self) -> float:
        """Bytes of one full-precision token per unit: ``token_values · fp_itemsize`` (``2·D·fp_itemsize``)."""
        if self.token_values:
            return float(self.token_values * self.fp_itemsize)
        return fp_token_bytes(self.head_dim) * self.fp_itemsize / 2

    @property
    def windowed(self) -> bool:
        """Some layer of this cache is a sliding-window layer."""
        return any(w is not None for w in self.layer_windows)

    def held_tokens(self, length: int) -> int | np.ndarray:
        """Tokens each layer holds at ``length`` tokens: ``length``, or ``[layer, 1]`` capped at
        each sliding layer's window.

        Args:
            length: Tokens of the sequence so far.
        """
        if not self.windowed:
            return length
        return np.array([[min(length, w) if w else length] for w in self.layer_windows], dtype=np.int64)

    @property
    def unit_full_bytes(self):
        """Bytes of one unit at full KV and the final length (a number, or ``[layer, 1]``)."""
        return self.held_tokens(self.final_len) * self.fp_bytes

    @property
    def layers(self) -> slice:
        """The model's layers this cache holds (a replay task may hold some: see
        [Cache geometry](concepts.md#geometry))."""
        return slice(self.first_layer, self.first_layer + self.n_layers)

    @property
    def all_layers(self) -> int:
        """Layers of the whole model."""
        return self.model_layers or self.n_layers

    @property
    def whole_model(self) -> bool:
        """This cache holds every layer and KV head of the model (``B`` is the model's budget)."""
        return self.all_layers == self.n_layers and (self.model_kv or self.n_kv) == self.n_kv

    @property
    def uniform_capacity(self):
        """Each unit's bytes under the uniform split: ``β`` of its full bytes (a number, or
        ``[layer, 1]`` where sliding layers hold less)."""
        return self.budget * self.unit_full_bytes

    @property
    def mean_capacity(self) -> float:
        """``B / (layers · kv_heads)`` of the whole model: the mean bytes of a unit, which
        allocations split around (the same number in a replay task of some layers)."""
        return self.budget * (self.model_held or self.final_len) * self.fp_bytes

    @property
    def allocated(self) -> bool:
        """The units hold what an allocation gave them (not the uniform split)."""
        return self.unit_capacity is not None

    @property
    def capacity(self):
        """Bytes allowed per (layer, kv_head): a number, or ``[layer, kv_head]`` when allocated."""
        return self.unit_capacity if self.allocated else self.uniform_capacity

    @property
    def fp_capacity_tokens(self):
        """Full-precision tokens that fit each unit's capacity (a number, or an array broadcastable
        to ``[layer, kv_head]``)."""
        tokens = np.floor(np.asarray(self.capacity) / self.fp_bytes + 1e-9).astype(np.int64)
        return tokens if tokens.ndim else int(tokens)

    def allotted(self, capacities: np.ndarray) -> CacheSpec:
        """This spec with ``capacities`` bytes per unit.

        Args:
            capacities: ``[layer, kv_head]`` bytes per unit (an allocation's split).
        """
        capacities = np.asarray(capacities, dtype=np.float64)
        if capacities.shape != (self.n_layers, self.n_kv):
            raise ValueError(f"capacities must be [layer, kv_head] = {(self.n_layers, self.n_kv)}")
        return replace(self, unit_capacity=capacities)

    def capacity_groups(self):
        """``(capacity, units)`` per distinct capacity: ``units`` the ``[layer, kv_head]`` mask of
        the units that hold it, None for all of them (what a policy sizes once per value)."""
        if not self.allocated and not self.windowed:
            yield self.uniform_capacity, None
            return
        capacity = np.broadcast_to(self.capacity, (self.n_layers, self.n_kv))
        values = np.unique(capacity)
        if len(values) == 1:
            yield float(values[0]), None
            return
        for value in values:
            yield float(value), capacity == value

    @property
    def decode_steps(self) -> int:
        """``S``: the decode steps after the prompt."""
        return self.final_len - self.prompt_len

    @property
    def total_capacity(self) -> float:
        """``B = β · FP_bytes(P + S)`` over all layers and KV heads."""
        return self.budget * self.full_bytes

    @property
    def full_bytes(self) -> float:
        """``FP_bytes(P + S)``: every layer and unit at full precision, each layer holding what
        the model keeps of the final length (its window on a sliding layer)."""
        return float(np.sum(np.broadcast_to(self.unit_full_bytes, (self.n_layers, 1)))) * self.n_kv

    def fits(self, per_unit_bytes: float | np.ndarray, capacity: float | np.ndarray | None = None) -> bool:
        """``per_unit_bytes`` per (layer, kv_head) fit ``capacity`` (within a relative 1e-6).

        Args:
            per_unit_bytes: Bytes of each unit: a number, or ``[layer, kv_head]``.
            capacity: Bytes allowed per unit (default: the uniform share).
        """
        capacity = self.uniform_capacity if capacity is None else capacity
        return bool(np.all(np.asarray(per_unit_bytes) <= np.asarray(capacity) * (1 + BYTES_TOLERANCE)))

    def exceeded(self, used: np.ndarray) -> bool:
        """Some (layer, kv_head) holds more than its capacity.

        Args:
            used: ``[layer, kv_head]`` bytes each unit holds.
        """
        return bool((used > np.asarray(self.capacity) * (1 + BYTES_TOLERANCE)).any())

    def exceeded_total(self, held: float) -> bool:
        """All layers and heads together hold more than ``B``.

        Args:
            held: Bytes of all layers and heads.
        """
        return held > self.total_capacity * (1 + BYTES_TOLERANCE)


def per_unit(x) -> np.ndarray:
    """A number or ``[layer, kv_head]`` array → broadcastable against ``[layer, kv_head, pos]``."""
    return np.asarray(x)[..., None]


class Ledger:
    """Write-once quantized copies of K and V for one sequence, per (layer, kv_head, pos).

    Every position is quantized at most once ([`LedgerError`][kvscope.policies.LedgerError] otherwise); later
    demotions reuse the codes. With the recorded ``k``/``v`` (``[layer, kv_head, pos, D]``)
    it keeps ``k_eff``/``v_eff``: the values this cache serves — the originals until a
    position is quantized, its dequantized values from then on, also after a promotion
    (the original is gone), in the dtype of the recording (fp16 by default, as a live fp16
    cache would hold them). Without them it keeps only membership and bytes.

    ``q_cost [layer, kv_head, pos]``: bytes a position costs while it is in tier Q (codes +
    value parameters + its share of its key group's parameters).

    Args:
        spec: The cache's geometry.
        bits: Bits per quantized value.
        key_axis: Keys quantized per ``channel`` (over a group of tokens) or per ``token``.
        key_group: Channels per key group with ``key_axis="token"`` (default: the head dim).
        value_group: Channels per value group (default: the head dim).
        k: Recorded keys ``[layer, kv_head, pos, D]`` (post-RoPE), or None (bytes only).
        v: Recorded values ``[layer, kv_head, pos, D]``, or None.
        rope: Rotary parameters: keys are then quantized before RoPE.
    """

    def __init__(
        self,
        spec: CacheSpec,
        bits: int,
        key_axis: str = "channel",
        key_group: int | None = None,
        value_group: int | None = None,
        k: np.ndarray | None = None,
        v: np.ndarray | None = None,
        rope: Rope | None = None,
    ):
        d = spec.head_dim
        self.spec, self.bits, self.key_axis = spec, bits, key_axis
        self.value_group = value_group or d
        self.key_group = key_group or d  # channels per key group when key_axis == "token"
        if d % self.value_group or (key_axis == "token" and d % self.key_group):
            raise KvscopeError(f"channel groups must divide head_dim {d}")
        shape = (spec.n_layers, spec.n_kv, spec.final_len)
        self.done = np.zeros(shape, dtype=bool)
        self.q_cost = np.zeros(shape, dtype=np.float64)
        self.rope = rope
        self.k_eff = None if k is None else np.array(k)  # [layer, kv_head, pos, D] copies
        self.v_eff = None if v is None else np.array(v)
        self.n_quantized = 0
        # a live cache holds the data itself: sink(positions [n, G], layers [n], heads [n]) is
        # called for every quantization, before the tiers change
        self.sink = None

    @property
    def token_value_bytes(self) -> float:
        """Bytes of one quantized token's codes and parameters, but for its key group's share."""
        d = self.spec.head_dim
        key_meta = 4.0 * d / self.key_group if self.key_axis == "token" else 0.0
        return 2.0 * d * self.bits / 8 + 4.0 * d / self.value_group + key_meta

    def quantize(
        self, positions: np.ndarray, layers: np.ndarray | None = None, heads: np.ndarray | None = None
    ) -> None:
        """Quantize groups of positions, each at most once.

        Args:
            positions: ``[n, G]`` one key group per row — or, with ``layers=None``, ``[G]`` one
                group in every (layer, kv_head).
            layers: ``[n]`` the layer of each group.
            heads: ``[n]`` the KV head of each group.

        Raises:
            LedgerError: A position was quantized before.
        """
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size == 0:
            return
        key_share = 4.0 * self.spec.head_dim / positions.shape[-1] if self.key_axis == "channel" else 0.0
        if layers is None:  # one group in every (layer, kv_head): plain slicing
            if self.done[:, :, positions].any():
                raise LedgerError("a ledger entry was quantized twice (write-once violated)")
            self.done[:, :, positions] = True
            self.q_cost[:, :, positions] = self.token_value_bytes + key_share
            self.n_quantized += positions.size * self.spec.n_layers * self.spec.n_kv
            if self.sink is not None:
                n_l, n_h = self.spec.n_layers, self.spec.n_kv
                self.sink(
                    np.broadcast_to(positions, (n_l * n_h, positions.size)),
                    np.repeat(np.arange(n_l), n_h),
                    np.tile(np.arange(n_h), n_l),
                )
            if self.k_eff is not None:
                keys = cast(self.k_eff[:, :, positions], np.float32)  # [L, Hkv, G, D]
                values = cast(self.v_eff[:, :, positions], np.float32)
                n_l, n_h = keys.shape[:2]
                ll = np.repeat(np.arange(n_l), n_h)
                k_hat, v_hat = self.dequantized(
                    keys.reshape(n_l * n_h, *keys.shape[2:]),
                    values.reshape(n_l * n_h, *values.shape[2:]),
                    np.broadcast_to(positions, (n_l * n_h, positions.size)),
                    ll,
                )
                self.k_eff[:, :, positions] = cast(k_hat.reshape(keys.shape), self.k_eff.dtype, copy=False)
                self.v_eff[:, :, positions] = cast(v_hat.reshape(values.shape), self.v_eff.dtype, copy=False)
            return
        layers = np.asarray(layers, dtype=np.int64)
        heads = np.asarray(heads, dtype=np.int64)
        li, hi = layers[:, None], heads[:, None]
        if self.done[li, hi, positions].any():
            raise LedgerError("a ledger entry was quantized twice (write-once violated)")
        self.done[li, hi, positions] = True
        self.q_cost[li, hi, positions] = self.token_value_bytes + key_share
        self.n_quantized += positions.size
        if self.sink is not None:
            self.sink(positions, layers, heads)
        if self.k_eff is not None:  # groups are quantized independently: QUANTIZE_ROWS of them at a time
            for a in range(0, len(positions), QUANTIZE_ROWS):
                p, layer = positions[a : a + QUANTIZE_ROWS], layers[a : a + QUANTIZE_ROWS]
                at = (layer[:, None], heads[a : a + QUANTIZE_ROWS, None], p)
                keys = cast(self.k_eff[at], np.float32)  # [n, G, D] still the originals
                values = cast(self.v_eff[at], np.float32)
                k_hat, v_hat = self.dequantized(keys, values, p, layer)
                self.k_eff[at] = cast(k_hat, self.k_eff.dtype, copy=False)
                self.v_eff[at] = cast(v_hat, self.v_eff.dtype, copy=False)

    def _rotary(self, positions, layers):
        """``(cos, sin [n, G, D], scaling [n, 1, 1], n_rot)`` for pre-RoPE keys, or None."""
        rope = self.rope if (self.rope is not None and self.rope.usable()) else None
        if rope is None:
            return None
        cos, sin = rope.cos_sin(
            np.broadcast_to(layers[:, None], positions.shape), positions, self.spec.head_dim, self.spec.final_len
        )
        return cos, sin, rope.scaling[layers].astype(np.float32)[:, None, None], rope.n_rot

    def encode(self, keys: np.ndarray, values: np.ndarray, positions: np.ndarray, layers: np.ndarray) -> tuple:
        """Quantize groups of keys and values → ``(qk, qv)``.

        Key codes are over the G tokens per channel (``[n, G, D]``, parameters ``[n, 1, D]``)
        or per token in groups of ``key_group`` channels (``[n, G, D/kg, kg]``), taken before
        RoPE when rotary parameters are known; value codes ``[n, G, D/g_v, g_v]``.

        Args:
            keys: ``[n, G, D]`` float32, post-RoPE as attention sees them.
            values: ``[n, G, D]`` float32.
            positions: ``[n, G]`` their positions.
            layers: ``[n]`` their layers.
        """
        d = self.spec.head_dim
        rotary = self._rotary(positions, layers)
        if rotary is not None:  # quantize keys before rotation (pre-RoPE)
            cos, sin, scale, n_rot = rotary
            keys = undo_rope(keys, cos, sin, n_rot, scaling=scale)
        if self.key_axis == "channel":
            qk = quantize(keys, self.bits, axis=1)  # per channel over the G tokens
        else:
            qk = quantize(keys.reshape(*keys.shape[:2], d // self.key_group, self.key_group), self.bits, axis=-1)
        qv = quantize(values.reshape(*values.shape[:2], d // self.value_group, self.value_group), self.bits, axis=-1)
        return qk, qv

    def decode_keys(self, k_hat: np.ndarray, positions: np.ndarray, layers: np.ndarray) -> np.ndarray:
        """Dequantized keys as attention sees them (RoPE applied where they were quantized before it).

        Args:
            k_hat: ``[n, G, D]`` dequantized keys.
            positions: ``[n, G]`` their positions.
            layers: ``[n]`` their layers.
        """
        rotary = self._rotary(positions, layers)
        if rotary is None:
            return k_hat
        cos, sin, _, n_rot = rotary
        return apply_rope(k_hat, cos, sin, n_rot)

    def dequantized(
        self, keys: np.ndarray, values: np.ndarray, positions: np.ndarray, layers: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Quantize then dequantize groups of keys and values → ``(k̂, v̂)`` (what a cache serves
        for them: the quantizer of [the concepts](concepts.md#quantizer), keys back through RoPE).

        Args:
            keys: ``[n, G, D]`` float32, post-RoPE as attention sees them.
            values: ``[n, G, D]`` float32.
            positions: ``[n, G]`` their positions.
            layers: ``[n]`` their layers.
        """
        qk, qv = self.encode(keys, values, positions, layers)
        k_hat = self.decode_keys(qk.dequantize().reshape(keys.shape), positions, layers)
        return k_hat, qv.dequantize().reshape(values.shape)


class CacheState:
    """The cache of one sequence under one policy (see the module docstring).

    ``reached``: False when the policy cannot fit the budget (a quantization floor, or a
    fixed size the user chose); such a state runs at its smallest configuration and the
    replay reports the ratio it used instead of checking the budget.

    Args:
        policy: The policy whose decisions the state carries out.
        spec: The cache's geometry and budget.
        ledger: The quantized copies (a quantizing policy's), or None.
    """

    def __init__(self, policy: Policy, spec: CacheSpec, ledger: Ledger | None = None):
        self.policy, self.spec = policy, spec
        self.tiers = np.full((spec.n_layers, spec.n_kv, spec.final_len), NONE, dtype=np.int8)  # [layer, kv_head, pos]
        self.length = 0
        self.reached = True
        self.ledger = ledger
        self.evicted_ever = np.zeros(self.tiers.shape, dtype=bool)
        self.pooled = False  # the budget holds for all layers and heads together, not per unit
        self.setting: dict | None = None  # what the state set itself to for its budget (a press: its ratio)

    def size(self) -> None:
        """Size the state from ``self.spec``'s capacities (a subclass computes its token counts
        here): called on construction, and again by [`allot`][kvscope.policies.CacheState.allot]."""

    def allot(self, capacities: np.ndarray) -> None:
        """Hold ``capacities`` bytes per unit from now on (given before the prefill).

        Args:
            capacities: ``[layer, kv_head]`` bytes per unit (an allocation's split).
        """
        if self.length:
            raise RuntimeError("an allocation is given before the prefill")
        self.spec = self.spec.allotted(capacities)
        self.reached = True
        self.size()

    # -- driven by the replay or a live cache ---------------------------------------------
    def prefill(self, colsum: np.ndarray, tail: np.ndarray | None) -> None:
        """The prompt's positions exist, at full precision; then compress to the budget.

        Args:
            colsum: ``[layer, kv_head, P]`` the attention each prompt key got from all prompt queries.
            tail: ``[layer, kv_head, obs, P]`` the last prefill rows (None where not recorded).
        """
        p = self.spec.prompt_len
        self.tiers[..., :p] = FP
        self.length = p
        self.drop_outside_windows(every=True)
        self.after_prefill(colsum, tail)

    def append(self, position: int) -> None:
        """A decode step adds ``position`` at full precision.

        Args:
            position: The new position (the current length: positions arrive in order).
        """
        if position != self.length:
            raise KvscopeError(f"positions must arrive in order (got {position}, expected {self.length})")
        self.tiers[..., position] = FP
        self.length += 1
        self.drop_outside_windows()

    def drop_outside_windows(self, every: bool = False) -> None:
        """On a sliding-window layer the query at ``q = length − 1`` sees ``p > q − window`` only,
        and so does every later one: the model drops the rest (its cache holds the window), so they
        are EVICTED here — no loss a policy chose, no bytes. Called before the policy decides (the
        position that just left; ``every``: all of them, after the prompt) and by the driver after
        it decided (``every``: a policy that quantizes bands of positions in every layer may have
        touched one).

        Args:
            every: Every position outside a window, not only the one that just left.
        """
        for layer, window in enumerate(self.spec.layer_windows):
            gone = self.length - window if window else 0  # positions 0 … gone − 1 are out of the window
            if gone > 0:
                view = self.tiers[layer, :, 0 if every else gone - 1 : gone]
                view[view >= Q] = EVICTED

    def observe(self, row: np.ndarray) -> None:
        """The attention the cache served at this step.

        Args:
            row: ``[layer, kv_head, length]`` the kv-group mean over the accessible positions.
        """

    def compress(self) -> None:
        """Decide tiers after this step's observation."""

    def after_prefill(self, colsum: np.ndarray, tail: np.ndarray | None) -> None:
        """The policy's first decision, once the prompt exists (default: ``compress``).

        Args:
            colsum: ``[layer, kv_head, P]`` the attention each prompt key got from all prompt queries.
            tail: ``[layer, kv_head, obs, P]`` the last prefill rows (None where not recorded).
        """
        self.compress()

    def scratch_bytes(self) -> int:
        """Bytes the state itself holds besides the cache's own (a press's working copies)."""
        return 0

    # -- helpers for policies --------------------------------------------------------------
    def evict(self, mask: np.ndarray) -> None:
        """Evict the positions ``mask`` marks.

        Args:
            mask: ``[layer, kv_head, n]`` or ``[n]`` (every head) over positions ``0..n−1``.
        """
        mask = np.asarray(mask, dtype=bool)
        view = self.tiers[..., : mask.shape[-1]]
        view[np.broadcast_to(mask, view.shape)] = EVICTED

    def set_tier_positions(self, positions: np.ndarray, tier: int) -> None:
        """Put ``positions`` in ``tier`` in every (layer, kv_head).

        Args:
            positions: ``[n]`` positions.
            tier: A tier code (``kvscope.tiers``: 0 EVICTED, 1 Q, 2 FP).
        """
        self.tiers[..., np.asarray(positions, dtype=np.int64)] = tier

    def accessible(self) -> np.ndarray:
        """``[layer, kv_head, length]`` True for FP or Q."""
        return self.tiers[..., : self.length] >= Q

    def bytes_used(self) -> np.ndarray:
        """``[layer, kv_head]`` bytes resident now."""
        t = self.tiers[..., : self.length]
        total = count_true(t == FP) * self.spec.fp_bytes
        if self.ledger is not None and self.ledger.n_quantized:
            total = total + (self.ledger.q_cost[..., : self.length] * (t == Q)).sum(-1)  # sum(where=) is 6x slower
        return total

    def check(self) -> None:
        """Invariants every policy keeps: Q only for ledger entries, no position returns
        from EVICTED unless the policy is clairvoyant."""
        t = self.tiers[..., : self.length]
        if (t == NONE).any():
            raise AssertionError("an existing position has no tier")
        if (t == Q).any() and (self.ledger is None or not self.ledger.done[..., : self.length][t == Q].all()):
            raise AssertionError("a Q position is not in the ledger")
        if not self.policy.clairvoyant:
            if (self.evicted_ever[..., : self.length] & (t != EVICTED)).any():
                raise AssertionError("an evicted position came back")
        self.evicted_ever[..., : self.length] |= t == EVICTED


@dataclass
class Policy:
    """Base of every policy dataclass; a subclass sets ``name`` and ``kind``, its fields are its
    parameters (``param(…)``: type, range and meaning), and ``start`` makes its state."""

    name: ClassVar[str] = "policy"
    kind: ClassVar[str] = ""
    clairvoyant: ClassVar[bool] = False
    quantizes: ClassVar[bool] = False
    observes: ClassVar[bool] = False  # decisions use the rows served at each step
    observes_prefill: ClassVar[bool] = False  # decisions use the prompt's attention (colsum, tail)
    reads_queries: ClassVar[bool] = False  # start() takes the model spec and recorded q/k/v (offline)
    live_hooks: ClassVar[bool] = False  # live, it runs on the model's own attention modules (kvpress's presses)
    splits_itself: ClassVar[bool] = False  # sets its own split across layers and heads (no allocation)

    def start(
        self, spec: CacheSpec, k: np.ndarray | None = None, v: np.ndarray | None = None, rope: Rope | None = None
    ) -> CacheState:
        """The state of one sequence's cache under this policy.

        Args:
            spec: The cache's geometry and budget.
            k: Recorded keys ``[layer, kv_head, pos, D]`` (post-RoPE): a quantizing policy's
                ledger keeps their dequantized copies (None: bytes only).
            v: Recorded values ``[layer, kv_head, pos, D]``.
            rope: Rotary parameters (keys quantized before RoPE).
        """
        return self.state_type()(self, spec)

    def state_type(self) -> type[CacheState]:
        """The class of this policy's per-sequence state where it needs only the cache's spec
        (what ``start`` makes by default)."""
        raise NotImplementedError

    def __post_init__(self):
        check_params(self)

    def params(self) -> dict:
        """``{field: value}`` of the policy's parameters."""
        return field_values(self)

    def label(self) -> str:
        """``name`` or ``name:key=value:…`` for fields that differ from the defaults, spelled as
        the command line takes them (``evict=true``), so that ``parse(label())`` gives it back."""
        return spelled(self)

    def check_live(self, model: ModelSpec, rope: Rope | None = None, loaded: PreTrainedModel | None = None) -> None:
        """Refuse in one line, before a live cache of a model decodes anything, what this policy
        cannot do there.

        Args:
            model: The model's geometry.
            rope: Its rotary parameters.
            loaded: The transformers model itself, where there is one (kvpress's presses run on it).

        Raises:
            KvscopeError: The policy cannot run live on this model.
        """

    def unit_floor(self, spec: CacheSpec) -> float:
        """The fewest bytes one (layer, kv_head) can run at: allocations give every unit at
        least this and split only what lies above it (PyramidKV's observation window, AdaKV's
        safeguard, in the policy's own terms).

        Args:
            spec: The cache's geometry.
        """
        return 0.0

    def allocation_scores(self, colsum: np.ndarray, tail: np.ndarray | None) -> np.ndarray:
        """``[layer, kv_head, P]`` how much each prompt position matters to this policy, read by
        the ``adakv`` allocation: the prompt attention each key received (H2O's score) unless the
        policy ranks by something else.

        Args:
            colsum: ``[layer, kv_head, P]`` the attention each prompt key got from all prompt queries.
            tail: ``[layer, kv_head, obs, P]`` the last prefill rows (None where not recorded).
        """
        return colsum


def check_geometry(policies: list[Policy], model: ModelSpec) -> None:
    """Refuse, in one line, a policy the model's cache geometry does not let kvscope model
    exactly: under multi-head latent attention a token's cache is one latent per layer that a
    trace does not hold — its quantized copy, and a kvpress press that scores and prunes each
    head's keys, are not what such a cache would do. Evicting a token (for every head of the
    layer at once) is.

    Args:
        policies: The policies to run.
        model: The model's geometry.

    Raises:
        KvscopeError: A policy quantizes or prunes heads under multi-head latent attention.
    """
    if not model.latent:
        return
    for policy in policies:
        if policy.quantizes or policy.reads_queries:
            what = "quantizes each KV head's K and V" if policy.quantizes else "prunes each head's own keys"
            raise KvscopeError(
                f"{policy.label()} {what}; {model.architecture or 'this model'} caches one latent of "
                f"{model.kv_latent_dim} values per token and layer for all heads (multi-head latent attention), "
                "which kvscope models for eviction only (docs/architectures.md)"
            )


class AsEviction:
    """Mixin of a quantizing policy with an ``evict`` field: ``evict=true`` evicts what it
    would quantize (LogQuant's Table 2 "as eviction" variants), and then neither quantizes
    nor counts as a quantization policy."""

    @property
    def quantizes(self) -> bool:
        return not self.evict

    @property
    def kind(self) -> str:
        return "eviction" if self.evict else "quantization"


def count_true(mask: np.ndarray, keepdims: bool = False) -> np.ndarray:
    """``mask [..., n]`` → how many are True along the last axis (int64): a sum of its bytes,
    twice as fast as ``count_nonzero(axis=)`` or a bool sum (both cast every value to int64)."""
    return mask.view(np.uint8).sum(-1, keepdims=keepdims, dtype=np.int64)


def top_k_mask(scores: np.ndarray, candidates: np.ndarray, k) -> np.ndarray:
    """``[..., n]`` True for the ``k`` (scalar or ``[...]``) best candidates by score;
    ties go to the newer (higher-index) position."""
    n = scores.shape[-1]
    masked = np.where(candidates, scores, -np.inf)
    if np.ndim(k) == 0:
        k = int(k)
        if k <= 0:
            return np.zeros(candidates.shape, dtype=bool)
        if k >= n:
            return candidates.copy()
        # the k-th largest value, then everything above it and the newest of those equal to it
        threshold = -np.partition(-masked, k - 1, axis=-1)[..., k - 1 : k]
        above = masked > threshold
        equal = masked == threshold
        need = k - count_true(above, keepdims=True)
        if (count_true(equal, keepdims=True) <= need).all():
            return candidates & (above | equal)  # no tie to break (the usual case): the cumsum below is skipped
        from_newest = np.cumsum(equal[..., ::-1], axis=-1)[..., ::-1]
        return candidates & (above | (equal & (from_newest <= need)))
    order = np.argsort(-masked[..., ::-1], axis=-1, kind="stable")
    order = n - 1 - order
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.broadcast_to(np.arange(n), order.shape), axis=-1)
    return candidates & (ranks < np.asarray(k)[..., None])
