"""Allocations: how a budget's bytes ``B = β · FP_bytes(P + S)`` are split across layers and
KV heads, a choice apart from the policy (docs/concepts.md#allocation).

    parse("pyramid:beta=10")              an allocation; its fields are its parameters
    allocation.split(spec, floor, …)       → capacities [layer, kv_head] bytes, Σ ≤ B

Every unit first gets the policy's floor ``f`` (``Policy.unit_floor``: the fewest bytes it
can run at — SnapKV's observation window and decode tokens, QEvict's sinks and local
windows); the allocation splits only the room above it, ``R = B − L·H·f``:

    uniform    R / (L·H) each (kvscope's default: exactly the per-unit budget of every policy)
    pyramid    PyramidKV's linear schedule over layers: layer l gets the share
               s_l = top − l·(top − bottom)/(L − 1) of R/L, top = 2 − 1/beta, bottom = 1/beta
               (mean 1); like PyramidKV it falls back to uniform when the first layer would
               hold more than every position of the final length
    adakv      AdaKV per layer: each head's top ⌊alpha·m⌋ scores are forced in, then the layer's
               top H·m scores across its heads (the policy's own scores of the prompt,
               Policy.allocation_scores) decide how many tokens k_h each head gets;
               m = the tokens per head the layer's room R/L buys. Head h holds f + (R/L)·k_h/(H·m)
    oracle     clairvoyant: the split that minimises the policy's own future missed mass at
               equal total bytes. A unit's decisions depend only on its own capacity, so the
               replay measures each unit's loss (FMM summed over events; FMM fp for a policy
               that never evicts) with every unit at each candidate capacity — the floor plus
               0, ¼, ½, ¾, 1, 1½, 2, 3, 4 × the mean room, and the splits uniform, pyramid, adakv
               and the replay's other allocations give — and picks one candidate per unit by an
               exact knapsack over the bytes (cheapest_split). It never loses more than any of
               those allocations: a bound, like the oracle policy, that only a trace can give

Uniform is not applied at all (a state keeps its scalar capacity): a policy under ``uniform``
gives exactly the numbers it gives without an allocation. When ``R < 0`` (the floor does not
fit) every allocation gives the uniform split and the policy reports its floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..errors import KvscopeError
from ..params import check_params, field_values, param, parse_spelled, spelled
from .base import CacheSpec, Policy, top_k_mask

Gains = tuple[np.ndarray, np.ndarray]  # (capacities, loss) [candidate, layer, kv_head]: what the oracle split reads


@dataclass(frozen=True)
class Observed:
    """What a split reads besides the spec (``Allocation.reads``).

    Attributes:
        scores: ``[layer, kv_head, P]`` the policy's scores of the prompt.
        gains: Its loss at candidate capacities (the oracle's).
    """

    scores: np.ndarray | None = None
    gains: Gains | None = None


def room_above(spec: CacheSpec, floor: float) -> float:
    """``r = R/(L·H) = B/(L·H) − floor``: the mean room per unit an allocation splits (negative:
    the floor does not fit). Per unit, so that a replay task of some layers splits its layers
    exactly as the whole model's split does there.

    Args:
        spec: The cache's geometry and budget.
        floor: The policy's fewest bytes per unit (``Policy.unit_floor``).
    """
    return spec.mean_capacity - floor


@dataclass
class Allocation:
    """Base of every allocation dataclass. ``reads``: what the split needs besides the spec —
    nothing (``""``), the policy's scores of the prompt at the prefill (``"scores"``), or the
    trace's future attention (``"future"``, clairvoyant: replay and validate only). Its fields
    are its parameters, like a policy's."""

    name: ClassVar[str] = "allocation"
    reads: ClassVar[str] = ""
    whole: ClassVar[bool] = True  # the capacities split B: the total is checked too
    needs_qkv: ClassVar[bool] = False  # the split reads recorded q/k/v
    across_heads: ClassVar[bool] = False  # a layer's split reads all its KV heads (a replay task holds them all)

    def __post_init__(self):
        check_params(self)

    @property
    def clairvoyant(self) -> bool:
        """The split reads the trace's future attention (replay and validate only)."""
        return self.reads == "future"

    @property
    def uniform(self) -> bool:
        """Every unit keeps its even share (the split is not applied at all)."""
        return False

    def label(self) -> str:
        """``name`` or ``name:key=value:…`` for fields that differ from the defaults (``parse``
        gives it back)."""
        return spelled(self)

    def for_sample(self, sample: int) -> Allocation:
        """The allocation one sample runs under (itself, but for splits given per sample).

        Args:
            sample: The sample's index.
        """
        return self

    def params(self) -> dict:
        """``{field: value}`` of the allocation's parameters."""
        return field_values(self)

    def split(
        self, spec: CacheSpec, floor: float, *, scores: np.ndarray | None = None, gains: Gains | None = None
    ) -> np.ndarray:
        """Capacities ``[layer, kv_head]`` in bytes, summing to at most ``spec.total_capacity``:
        every unit ``floor`` plus its share of the room above it.

        Args:
            spec: The cache's geometry and budget.
            floor: The policy's fewest bytes per unit (``Policy.unit_floor``).
            scores: ``[layer, kv_head, P]`` the policy's scores of the prompt (``reads = "scores"``).
            gains: ``(capacities, loss)``: the policy's loss at candidate capacities
                ``[candidate, layer, kv_head]`` (``reads = "future"``).
        """
        room = room_above(spec, floor)
        even = np.broadcast_to(spec.uniform_capacity, (spec.n_layers, spec.n_kv)).astype(np.float64)
        if room < 0:
            return even
        shares = self.shares(spec, floor, room, Observed(scores, gains))  # [layer, kv_head], mean 1
        if shares is None:
            return even
        return floor + room * shares

    def shares(self, spec: CacheSpec, floor: float, room: float, observed: Observed) -> np.ndarray | None:
        """``[layer, kv_head]`` each unit's room as a multiple of the mean room ``room`` (mean 1
        over the model), None for even.

        Args:
            spec: The cache's geometry and budget.
            floor: The policy's fewest bytes per unit.
            room: The mean room per unit above ``floor`` (``room_above``).
            observed: What the split reads besides the spec (``reads``).
        """
        raise NotImplementedError


@dataclass
class Uniform(Allocation):
    """``uniform``: every unit the same room, exactly the per-unit budget of every policy (the
    default)."""

    name = "uniform"

    @property
    def uniform(self) -> bool:
        """Always: the split is not applied at all."""
        return True

    def shares(self, spec: CacheSpec, floor: float, room: float, observed: Observed) -> np.ndarray | None:
        return None


@dataclass
class Pyramid(Allocation):
    """``pyramid``: PyramidKV's linear schedule over layers, the first layers holding the most
    (the module docstring)."""

    beta: float = param(
        20.0, low=1, help="PyramidKV's beta: the last layer holds 1/beta of the mean room", tune=(1.0, 40.0)
    )

    name = "pyramid"

    def layer_shares(self, n_layers: int) -> np.ndarray:
        """``[layer]`` PyramidKV's schedule relative to the mean (mean 1): ``top`` to ``bottom``.

        Args:
            n_layers: The model's layers.
        """
        if n_layers == 1:
            return np.ones(1)
        top, bottom = 2 - 1 / self.beta, 1 / self.beta
        return top - np.arange(n_layers) * (top - bottom) / (n_layers - 1)

    def shares(self, spec: CacheSpec, floor: float, room: float, observed: Observed) -> np.ndarray | None:
        schedule = self.layer_shares(spec.all_layers)  # [model layer]: the schedule of the whole model
        if floor + room * schedule[0] > np.max(spec.unit_full_bytes):
            return None  # PyramidKV's own fallback: the schedule does not fit the sequence
        return np.repeat(schedule[spec.layers, None], spec.n_kv, axis=1)


@dataclass
class AdaKV(Allocation):
    """``adakv``: AdaKV's split across the KV heads of each layer by the policy's own scores of
    the prompt (the module docstring)."""

    alpha: float = param(
        0.2, low=0, high=1, help="AdaKV's safeguard: each head keeps at least alpha of the mean", tune=(0.0, 1.0)
    )

    name = "adakv"
    reads = "scores"
    across_heads = True

    def shares(self, spec: CacheSpec, floor: float, room: float, observed: Observed) -> np.ndarray | None:
        scores = observed.scores
        if scores is None:
            raise KvscopeError("the adakv allocation needs the policy's scores of the prompt")
        n_layers, n_kv, n_pos = scores.shape  # [layer, kv_head, P']
        m = min(int(room / spec.fp_bytes), n_pos)  # tokens per head the room buys
        if m < 1:
            return None
        forced = top_k_mask(scores, np.ones(scores.shape, dtype=bool), int(self.alpha * m))
        ranked = np.where(forced, np.inf, scores).reshape(n_layers, n_kv * n_pos)  # [layer, kv_head·pos]
        chosen = top_k_mask(ranked, np.ones(ranked.shape, dtype=bool), n_kv * m)
        counts = chosen.reshape(n_layers, n_kv, n_pos).sum(-1)  # [layer, kv_head] k_h, Σ_h = H·m
        return counts / m


@dataclass
class Oracle(Allocation):
    """``oracle``: the clairvoyant split that minimises the policy's own loss at equal total
    bytes, chosen from candidates the replay measures (the module docstring)."""

    measure: str = param(
        "auto", choices=("auto", "fmm", "fmm_fp", "output"),
        help="what the split minimises: FMM (mass on evicted positions), FMM fp (not at full precision), "
        "output (the attention output's relative L2 error; needs q/k/v); auto: FMM, or FMM fp for a policy "
        "that never evicts",
    )  # fmt: skip

    name = "oracle"
    reads = "future"
    across_heads = True  # its candidates include adakv's split

    LEVELS: ClassVar[tuple[float, ...]] = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)  # × the mean room

    def objective(self, policy: Policy) -> str:
        """The replay variable the split minimises for ``policy``.

        Args:
            policy: The policy split for.
        """
        if self.measure != "auto":
            return self.measure
        return "fmm_fp" if policy.kind == "quantization" else "fmm"

    @property
    def needs_qkv(self) -> bool:
        """The split reads recorded q/k/v (``measure="output"``)."""
        return self.measure == "output"

    def candidates(self, spec: CacheSpec, floor: float, splits: list[np.ndarray]) -> np.ndarray:
        """``[candidate, layer, kv_head]`` capacities whose loss the replay measures: every unit
        at ``floor + level · R/(L·H)`` for each of ``LEVELS`` (at most every position of the
        final length), then the whole ``splits`` of the other allocations.

        Args:
            spec: The cache's geometry and budget.
            floor: The policy's fewest bytes per unit.
            splits: ``[layer, kv_head]`` capacities the other allocations give.
        """
        room = room_above(spec, floor)
        most = spec.unit_full_bytes  # a number, or [layer, 1] where sliding layers hold less
        shape = (spec.n_layers, spec.n_kv)
        levels = [np.broadcast_to(np.minimum(floor + m * room, most), shape).astype(np.float64) for m in self.LEVELS]
        return np.stack(levels + [np.broadcast_to(c, shape) for c in splits])

    def split(
        self, spec: CacheSpec, floor: float, *, scores: np.ndarray | None = None, gains: Gains | None = None
    ) -> np.ndarray:
        if gains is None:
            raise KvscopeError("the oracle allocation reads the trace's future attention (replay or validate only)")
        capacities, loss = gains  # [candidate, layer, kv_head] bytes and the policy's loss there
        if room_above(spec, floor) < 0:
            return np.broadcast_to(spec.uniform_capacity, capacities.shape[1:]).astype(np.float64)
        return cheapest_split(capacities, loss, spec.total_capacity, spec.fp_bytes / 2)


def cheapest_split(capacities: np.ndarray, loss: np.ndarray, total: float, quantum: float) -> np.ndarray:
    """``[layer, kv_head]`` capacities, one candidate per unit, that minimise ``Σ_u loss[j_u, u]``
    with ``Σ_u capacities[j_u, u] ≤ total`` (``capacities``, ``loss [candidate, layer, kv_head]``).

    Exact over the candidates: a knapsack by dynamic programming over the bytes in steps of
    ``quantum`` (each capacity rounded up, so any split it returns fits), and any candidate
    that is a whole split within ``total`` (the other allocations) is taken as it is when it
    loses no more — so the result never loses more than any of them.

    Args:
        capacities: ``[candidate, layer, kv_head]`` bytes.
        loss: ``[candidate, layer, kv_head]`` the policy's loss at them.
        total: The bytes the split may hold in all.
        quantum: The knapsack's step in bytes.
    """
    n_cand = capacities.shape[0]
    caps, costs = capacities.reshape(n_cand, -1), np.nan_to_num(loss.reshape(n_cand, -1), nan=0.0)
    bins = int(total * (1 + 1e-12) // quantum)
    weight = np.ceil(caps / quantum - 1e-9).astype(np.int64)  # [candidate, unit]
    best = np.zeros(bins + 1)  # least loss of the units so far within b quanta
    choice = np.zeros((caps.shape[1], bins + 1), dtype=np.int16)
    for u in range(caps.shape[1]):
        new = np.full(bins + 1, np.inf)
        for j in range(n_cand):
            w = weight[j, u]
            if w > bins:
                continue
            shifted = np.full(bins + 1, np.inf)
            shifted[w:] = best[: bins + 1 - w] + costs[j, u]
            better = shifted < new
            new[better], choice[u, better] = shifted[better], j
        best = new
    wholes = [j for j in range(n_cand) if caps[j].sum() <= total * (1 + 1e-9)]
    whole = min(wholes, key=lambda j: costs[j].sum()) if wholes else None
    b = int(np.argmin(best))
    if not np.isfinite(best[b]):  # no choice per unit fits: the best whole split, else the smallest
        return capacities[whole].copy() if whole is not None else capacities.min(0)
    if whole is not None and costs[whole].sum() <= best[b]:
        return capacities[whole].copy()
    picked = np.zeros(caps.shape[1], dtype=np.int64)
    for u in range(caps.shape[1] - 1, -1, -1):
        picked[u] = choice[u, b]
        b -= weight[picked[u], u]
    return caps[picked, np.arange(caps.shape[1])].reshape(capacities.shape[1:])


@dataclass
class Given(Allocation):
    """A split given as numbers — ``[layer, kv_head]`` bytes, or ``[sample, layer, kv_head]``
    one per sample (a replay's oracle split handed to a live cache and to the replay of its
    trace); not parsed from the command line.

    Attributes:
        capacities: ``[layer][kv_head]`` or ``[sample][layer][kv_head]`` bytes.
        whole: A split of ``B`` (False: capacities to probe, each unit checked alone).
    """

    capacities: tuple = ()
    whole: bool = True

    name = "given"

    @classmethod
    def of(cls, capacities: np.ndarray, whole: bool = True) -> Given:
        """The split ``capacities`` as an allocation.

        Args:
            capacities: ``[layer, kv_head]`` or ``[sample, layer, kv_head]`` bytes.
            whole: A split of ``B`` (False: capacities to probe, each unit checked alone).
        """
        return cls(capacities=tuple(map(tuple, np.asarray(capacities, dtype=np.float64).tolist())), whole=whole)

    def for_sample(self, sample: int) -> Allocation:
        capacities = np.asarray(self.capacities, dtype=np.float64)
        return Given.of(capacities[sample], self.whole) if capacities.ndim == 3 else self

    def split(
        self, spec: CacheSpec, floor: float, *, scores: np.ndarray | None = None, gains: Gains | None = None
    ) -> np.ndarray:
        capacities = np.asarray(self.capacities, dtype=np.float64)
        if capacities.shape != (spec.n_layers, spec.n_kv):
            raise KvscopeError(
                f"the given split has shape {capacities.shape}, not [layer, kv_head] = {(spec.n_layers, spec.n_kv)}"
            )
        return capacities

    def label(self) -> str:
        return "given"


def check_allocatable(policies: list[Policy], allocations: list[Allocation]) -> None:
    """Refuse a policy that splits its budget itself under an allocation other than uniform.

    Args:
        policies: The policies to run.
        allocations: The allocations they run under.

    Raises:
        KvscopeError: A press that moves budget itself under a non-uniform allocation.
    """
    for policy in policies:
        for allocation in allocations:
            if policy.splits_itself and not allocation.uniform:
                raise KvscopeError(
                    f"{policy.label()} sets its own split across layers and heads (kvpress's compression "
                    f"ratio per layer; press:AdaKVPress and press:PyramidKVPress move it): "
                    f"run it under --allocation uniform, not {allocation.label()}"
                )


REGISTRY: dict[str, type[Allocation]] = {cls.name: cls for cls in (Uniform, Pyramid, AdaKV, Oracle)}


def parse(text: str | Allocation) -> Allocation:
    """``"name"`` or ``"name:key=value"`` (or an allocation object) → an allocation.

    Args:
        text: The spelling (``"pyramid:beta=10"``), or an allocation, returned as it is.

    Raises:
        KvscopeError: An unknown name or parameter, or a value out of range.
    """
    return text if isinstance(text, Allocation) else parse_spelled(REGISTRY, "allocation", text)
