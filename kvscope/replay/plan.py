"""Planning a replay: the policies, allocations and budgets given resolved and checked against the
trace (``ReplaySetup``), and the work cut into independent tasks — each sample's runs split
by layers and KV heads (docs/replay.md) — with the worker processes to fork and the
block of a task chosen. How the tasks run: ``kvscope.replay.run``.

A task (``Piece``) replays one sample, a block of the model's layers × KV heads and some
policies; its peak memory is that block's rows and K/V, not the sample's. Every kvscope policy
decides each (layer, kv_head) from that unit's rows and capacity alone, and every allocation
but one splits per unit (uniform; pyramid, the whole model's schedule at the task's layers;
adakv, each layer's room by its own heads' scores — so its tasks hold every KV head of their
layers), so a task of some units gives exactly the numbers of the whole replay there. Two
things cross units, and are handled so:

    a policy that splits its budget itself   kvpress's presses (one compression ratio solved over
    (Policy.splits_itself)                   every layer): its runs take all units in one task
    the oracle allocation                    a knapsack over every unit of the sample: the tasks
                                             first measure their units' losses at the candidate
                                             capacities (probes), the split is chosen over all of
                                             them (``kvscope.replay.tasks.oracle_splits``),
                                             then the tasks replay with their part of it
                                             (whole layers: the candidates include adakv's split)

Tasks hold some of a layer's KV heads only where one layer does not fit the task's memory
(``kv_heads_per_task``).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr

from .. import defaults
from ..analysis.fmm import FMM
from ..analysis.lir import LIR
from ..errors import KvscopeError
from ..policies import Allocation, CacheSpec, Policy, check_budget, check_geometry, parse
from ..policies import allocation as allocation_module
from ..policies.allocation import check_allocatable
from .reader import rule_of

if TYPE_CHECKING:
    from ..model.rope import Rope

OBSERVE_MODES = ("renorm", "exact")


def _resolved(items, cls, parse_one, what: str) -> list:
    """Names, ``name:key=value`` strings or ``cls`` objects → objects with distinct labels."""
    if isinstance(items, (str, cls)):
        items = [items]
    out = [x if isinstance(x, cls) else parse_one(x) for x in items]
    if not out:
        raise KvscopeError(f"no {what} given")
    labels = [x.label() for x in out]
    if len(set(labels)) != len(labels):
        raise KvscopeError(f"{'an' if what[0] in 'aeiou' else 'a'} {what} is listed twice: {', '.join(labels)}")
    return out


def resolve_policies(policies: str | Policy | list[str | Policy]) -> list[Policy]:
    """Names, ``name:key=value`` strings or policy objects → policy objects (unique labels).

    Args:
        policies: One policy or several.

    Raises:
        KvscopeError: None given, one unknown or out of range, or one listed twice.
    """
    return _resolved(policies, Policy, parse, "policy")


def resolve_allocations(allocations: str | Allocation | list[str | Allocation] | None) -> list[Allocation]:
    """Names, ``name:key=value`` strings or allocation objects → allocation objects.

    Args:
        allocations: One allocation or several (None: uniform alone).

    Raises:
        KvscopeError: None given, one unknown or out of range, or one listed twice.
    """
    return _resolved(
        ["uniform"] if allocations is None else allocations, Allocation, allocation_module.parse, "allocation"
    )


def resolve_budgets(budgets: float | str | list[float | str]) -> list[float]:
    """Budgets β, each a number in (0, 1], none twice.

    Args:
        budgets: One budget or several.

    Raises:
        KvscopeError: None given, one outside (0, 1], or one listed twice.
    """
    if isinstance(budgets, (int, float, str)):
        budgets = [budgets]
    out = [check_budget(b) for b in budgets]
    if not out:
        raise KvscopeError("no budget given")
    if len(set(out)) != len(out):
        raise KvscopeError("a budget is listed twice")
    return out


@dataclass
class ReplaySetup:
    """Everything a replay needs besides the runs themselves ([`of`][kvscope.replay.ReplaySetup.of]
    checks the inputs against the trace).

    Attributes:
        ds: The trace.
        policies: The policies replayed.
        allocations: The allocations each runs under.
        budgets: The budgets β.
        observe: ``renorm`` or ``exact`` (the module docstring).
        fmm: FMM's parameters (horizon, curve horizons, bootstrap): the analysis layer's
            definitions and checks.
        lir: Global LIR's parameters (``m``, ``h_lir``, ``delta``).
        steps: ``[event]`` the steps of the events.
        group: Stored rows per KV head (1: kv-group rows).
        with_errors: Attention and output errors are computed (q/k/v recorded).
        validate: Every policy invariant is checked at every step.
        kv_itemsize: Bytes per full-precision K/V element in the byte model.
        source: The trace's path (a dask worker opens it there).
        model_presses: Labels of the presses that run on the trace's own model (they read more
            than q, k, v; ``kvscope.replay.presses``).
        press_model: Where that model is (``kvscope.replay.presses.TraceModel``), or None.
    """

    ds: xr.Dataset
    policies: list[Policy]
    allocations: list[Allocation]
    budgets: list[float]
    observe: str
    fmm: FMM
    lir: LIR
    steps: np.ndarray
    group: int
    with_errors: bool
    validate: bool
    kv_itemsize: int
    source: str | None = None
    model_presses: frozenset = frozenset()  # labels of the presses that run on the trace's own model
    press_model: object = None  # replay.presses.TraceModel: where that model is

    @classmethod
    def of(
        cls,
        ds: xr.Dataset,
        policies: str | Policy | list[str | Policy],
        allocations: str | Allocation | list[str | Allocation] | None,
        budgets: float | list[float],
        *,
        observe: str,
        every: int | None,
        errors: bool,
        validate: bool,
        kv_itemsize: int,
        question_agnostic: bool,
        source: str | None = None,
        **metric: Any,
    ) -> ReplaySetup:
        """The setup of a replay of ``ds``, every input checked against it (one line otherwise).

        Args:
            ds: The trace.
            policies: Names, ``name:key=value`` strings or policy objects.
            allocations: The same for allocations (None: uniform).
            budgets: Budgets β in (0, 1].
            observe: ``renorm`` or ``exact`` (needs q/k/v).
            every: Steps between events (None: the trace's ``w``).
            errors: Compute attention and output errors where q/k/v are recorded.
            validate: Check every policy invariant at every step.
            kv_itemsize: Bytes per full-precision K/V element in the byte model.
            question_agnostic: Refuse a trace whose prefill held the question.
            source: The trace's path.
            **metric: FMM's and LIR's parameters: ``horizon``, ``horizons``, ``m``, ``h_lir``,
                ``delta``, ``n_boot``, ``seed``, ``resample``.

        Raises:
            KvscopeError: An input the trace cannot serve.
        """
        acc = ds.kvscope
        if question_agnostic and not acc.question_agnostic:
            raise KvscopeError(
                "question-agnostic replay needs a trace recorded with kvscope trace --question-agnostic "
                "(this one prefilled the question with the context, so every policy saw it)"
            )
        if observe not in OBSERVE_MODES:
            raise KvscopeError(f"observe must be renorm or exact (got {observe!r})")
        stats = {k: metric.pop(k) for k in ("n_boot", "seed", "resample")}
        fmm = FMM(horizon=metric.pop("horizon"), horizons=metric.pop("horizons"), **stats)
        lir = LIR(**metric, **stats)
        if every is not None and every < 1:
            raise KvscopeError(f"every must be ≥ 1 (got {every})")
        if acc.resolution != "token" and not acc.has_qkv:
            raise KvscopeError(
                "replay needs token-resolution rows, or q/k to recompute them from; this store holds window sums only"
            )
        acc.require_steps()
        if observe == "exact" and not acc.has_qkv:
            raise KvscopeError("observe=exact needs recorded q/k/v (trace with --record qkv)")
        steps = np.arange(0, ds.sizes["step"], every or acc.w)
        policies = resolve_policies(policies)
        check_geometry(policies, acc.model)
        needs_qkv = [p.label() for p in policies if p.reads_queries]
        if needs_qkv and not acc.has_qkv:
            raise KvscopeError(f"{needs_qkv[0]} needs recorded q/k/v (trace with --record qkv)")
        allocations = resolve_allocations(allocations)
        check_allocatable(policies, allocations)
        needs_qkv = [a.label() for a in allocations if a.needs_qkv]
        if needs_qkv and not acc.has_qkv:
            raise KvscopeError(f"the {needs_qkv[0]} allocation needs recorded q/k/v (trace with --record qkv)")
        setup = cls(
            ds, policies, allocations, resolve_budgets(budgets), observe=observe, fmm=fmm, lir=lir, steps=steps,
            group=acc.group, with_errors=errors and acc.has_qkv, validate=validate, kv_itemsize=kv_itemsize,
            source=source,
        )  # fmt: skip
        return setup.with_press_model()

    def with_press_model(self) -> ReplaySetup:
        """The presses that need the trace's own model found, and the model checked to be there
        (:mod:`kvscope.replay.presses`)."""
        from dataclasses import replace

        from .presses import TraceModel, model_presses

        needing = model_presses(self)
        if not needing:
            return self
        label = self.policies[next(iter(needing))].label()
        where = TraceModel.of(self.ds, self.source or "the trace", label)
        return replace(self, model_presses=frozenset(self.policies[i].label() for i in needing), press_model=where)

    @property
    def horizons(self) -> list[int]:
        """Horizons of the FMM(H) curve."""
        return self.fmm.curve_horizons()

    @property
    def grid(self) -> list[tuple[Policy, Allocation, float]]:
        """Every run of a sample, in the order of the result's (policy, allocation, budget)."""
        return [(p, a, b) for p in self.policies for a in self.allocations for b in self.budgets]

    @property
    def has_qkv(self) -> bool:
        """The trace holds q/k/v."""
        return self.ds.kvscope.has_qkv

    @property
    def uses_torch(self) -> bool:
        """Some step computes with torch: errors, exact observation or a kvpress press (q/k/v
        recorded) — or, torch being loaded already, every float16 conversion (``dtypes.cast``).
        Forked workers must then set torch to one thread before its first op: a child of a
        process whose OpenMP team ran once hangs in its first parallel region (libgomp is not
        fork-safe)."""
        needs = self.with_errors or self.observe == "exact" or any(p.reads_queries for p in self.policies)
        return (self.has_qkv and needs) or "torch" in sys.modules

    @property
    def every(self) -> int:
        """Steps between events."""
        return int(self.steps[1] - self.steps[0]) if len(self.steps) > 1 else self.ds.kvscope.w

    @property
    def n_layers(self) -> int:
        """Layers replayed (a task may hold some)."""
        return self.ds.sizes["layer"]

    @property
    def n_kv(self) -> int:
        """KV heads replayed (a task may hold some): the stored heads, ``group`` per KV head."""
        return self.ds.sizes[self.ds.kvscope.hdim] // self.group

    @property
    def head_dim(self) -> int:
        """``D``, the size of one key or value head."""
        return self.ds.kvscope.model.head_dim

    @property
    def n_sink(self) -> int:
        """The trace's sinks."""
        return self.ds.kvscope.n_sink

    @property
    def w(self) -> int:
        """The trace's window size."""
        return self.ds.kvscope.w

    @property
    def n_pos(self) -> int:
        """Positions of the trace's ``pos`` dim."""
        return self.ds.sizes["pos"]

    @property
    def n_samples(self) -> int:
        """Samples of the trace."""
        return self.ds.sizes["sample"]

    @property
    def n_step_total(self) -> int:
        """Steps of the trace's ``step`` dim."""
        return self.ds.sizes["step"]

    def spec(self, s: int, budget: float) -> CacheSpec:
        """Sample ``s``'s cache at ``budget`` over the layers and KV heads replayed here.

        Args:
            s: The sample's index.
            budget: β.
        """
        acc = self.ds.kvscope
        prompt_len = int(acc.prompt_len[s])
        model, final = acc.model, int(acc.final_len[s])
        return CacheSpec(
            self.n_layers, self.n_kv, self.head_dim, prompt_len, final_len=final, budget=budget, n_sink=self.n_sink,
            w=self.w, fp_itemsize=self.kv_itemsize, first_layer=int(self.layers[0]), model_layers=model.n_layers,
            model_kv=model.n_kv_heads, token_values=model.token_values,
            layer_windows=tuple(model.window(int(layer)) for layer in self.layers) if not model.global_only else (),
            model_held=0.0 if model.global_only else model.full_tokens(final) / (model.n_layers * model.n_kv_heads),
        )  # fmt: skip

    @property
    def layers(self) -> np.ndarray:
        """``[layer]`` the stored indices of the layers replayed (a task may hold some; a hybrid
        model's ``layer`` coordinate holds the model's indices of its attention layers)."""
        model = self.ds.kvscope.model
        return np.asarray([model.stored_layer(int(x)) for x in self.ds["layer"].values], dtype=np.int64)

    @property
    def rules(self):
        """The attention rules of the layers replayed."""
        from ..model.attention import LayerRules

        return LayerRules(tuple(rule_of(self.ds, int(layer)) for layer in self.layers))

    @property
    def rope(self) -> Rope | None:
        """The trace's rotary parameters (None where it recorded none)."""
        return self.ds.kvscope.rope


def worker_count(setup: ReplaySetup, processes: int | None, client, path: str | None) -> int:
    """Worker processes to fork (0: none): ``processes`` checked, or the default (``replay``'s docstring)."""
    forkable = sys.platform == "linux" and "fork" in multiprocessing.get_all_start_methods()
    daemon = multiprocessing.current_process().daemon  # a dask worker, say: may not have children
    if processes is None:
        cells = len(setup.grid) * int(setup.ds.kvscope.n_steps.sum()) * setup.n_layers * setup.n_kv * setup.n_pos
        wanted = cells >= defaults.REPLAY_FORK_CELLS and setup.n_layers > 1 and len(setup.grid) > 1
        n = min(2, os.cpu_count() or 1) if wanted and forkable and not daemon and client is None and path else 0
        return n if n > 1 else 0
    if isinstance(processes, bool) or not isinstance(processes, (int, np.integer)) or processes < 0:
        raise KvscopeError(f"processes must be an integer ≥ 0 (got {processes!r})")
    if processes <= 1:
        return 0
    if client is not None:
        raise KvscopeError(
            "a replay runs on a dask cluster or in forked processes, not both (processes=0 with a client)"
        )
    if path is None:
        raise KvscopeError("a replay in forked processes takes the trace as a store path (each process opens it)")
    if daemon:
        raise KvscopeError(
            "this is a daemonic process (a dask worker?), which may not fork worker processes: processes=0"
        )
    if not forkable:
        raise KvscopeError(
            f"forked worker processes need Linux (this is {sys.platform}): use a dask cluster (--dask local:N)"
        )
    return int(processes)


def layer_bytes(setup) -> int:
    """What a task holds per layer, estimated: two blocks of float32 rows, K/V as recorded
    (and their float32 copies where kvpress presses run) and each quantizing run's dequantized copy,
    the float32 V of a step's full-KV reference (errors), every run's state and pending snapshots,
    the future-mass stream — each ``[kv_head, pos]`` wide (``/ n_kv`` per KV head). Quantizing
    the prompt adds temporaries of at most ``QUANTIZE_ROWS`` key groups
    per thread, left out."""
    acc = setup.ds.kvscope
    per_position = 2 * acc.block_steps * setup.group * 4 * 1.5  # rows as read, and as float32
    if setup.has_qkv:
        quantizing = sum(1 for policy, _, _ in setup.grid if policy.quantizes)
        float32 = 4 if any(policy.reads_queries for policy, _, _ in setup.grid) else 0
        model = acc.model  # K and V of each key head (MLA: every query head's, all in one unit)
        keys = model.n_key_heads // model.n_kv_heads
        per_position += (
            (model.head_dim + model.v_dim) * keys * (setup.ds["k"].dtype.itemsize + float32 + 4 * quantizing)
        )
        per_position += 4 * model.v_dim * keys if setup.with_errors else 0
    per_position += len(setup.grid) * 40 + len(setup.horizons) * 16
    return int(setup.n_kv * setup.n_pos * per_position)


def layers_per_task(
    setup, workers: int = 0, memory: int = defaults.REPLAY_TASK_BYTES, tasks_per_worker: int = 2
) -> int:
    """Layers per task: as many as ``memory`` holds (all of them for a small trace) — and,
    with ``workers`` to keep busy, few enough that the samples give ``tasks_per_worker``·workers
    tasks in all (2 on a cluster, whose workers may differ; 1 for ``ForkedWorkers``:
    each task pays the per-step work that does not shrink with its layers)."""
    fit = max(1, min(setup.n_layers, memory // max(layer_bytes(setup), 1)))
    if workers:
        samples = max(1, int((setup.ds.kvscope.n_steps > 0).sum()))
        fit = min(fit, max(1, math.ceil(setup.n_layers / math.ceil(tasks_per_worker * workers / samples))))
    return fit


def per_head(setup) -> bool:
    """Tasks may hold some of a layer's KV heads: no allocation's split of a layer reads all
    its heads (``across_heads``: adakv, and the
    oracle, whose candidates include adakv's split)."""
    return not any(a.across_heads for a in setup.allocations)


def kv_heads_per_task(setup, layers: int, memory: int = defaults.REPLAY_TASK_BYTES) -> int:
    """KV heads per task: all of them, unless a task of one layer does not fit ``memory`` and
    the allocations allow it (``per_head``) — then blocks of even size that fit, at least one head."""
    if layers > 1 or not per_head(setup):
        return setup.n_kv
    fit = max(1, memory * setup.n_kv // max(layer_bytes(setup), 1))
    return setup.n_kv if fit >= setup.n_kv else math.ceil(setup.n_kv / math.ceil(setup.n_kv / fit))


def task_block(
    setup: ReplaySetup, layers: int | None, kv_heads: int | None, workers: int, per_worker: int
) -> tuple[int, int]:
    """(layers, KV heads) per task, checked, or chosen for ``workers`` to keep busy
    (``layers_per_task``, ``kv_heads_per_task``)."""
    if layers is None:
        layers = layers_per_task(setup, workers, tasks_per_worker=per_worker)
    layers = _count(layers, setup.n_layers, "layers per task")
    if kv_heads is None:
        return layers, kv_heads_per_task(setup, layers)
    kv_heads = _count(kv_heads, setup.n_kv, "KV heads per task")
    if kv_heads < setup.n_kv and not per_head(setup):
        across = next(a.label() for a in setup.allocations if a.across_heads)
        raise KvscopeError(
            f"the {across} allocation splits each layer's budget across its KV heads: "
            f"a task holds all {setup.n_kv} of them (got {kv_heads} KV heads per task)"
        )
    return layers, kv_heads


def _count(value, most: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= most:
        raise KvscopeError(f"{what} must be an integer in 1..{most} (got {value!r})")
    return int(value)


@dataclass(frozen=True)
class Piece:
    """One task: ``sample``, the model's layers ``start..stop−1`` and KV heads
    ``kv_start..kv_stop−1``, and the ``policies`` (indices into the replay's) it runs under
    every allocation and budget."""

    sample: int
    start: int
    stop: int
    kv_start: int
    kv_stop: int
    policies: tuple[int, ...]

    @property
    def layers(self) -> slice:
        return slice(self.start, self.stop)

    @property
    def units(self) -> tuple[slice, slice]:
        """The task's ``[layer, kv_head]`` in the model's."""
        return self.layers, slice(self.kv_start, self.kv_stop)


def plan(setup, layers: int, kv_heads: int | None = None) -> list[Piece]:
    """The tasks of a replay: per sample with steps, blocks of ``layers`` layers × ``kv_heads``
    KV heads (default all) for the policies that decide per unit, every unit at once for those
    that split their budget."""
    local = tuple(i for i, p in enumerate(setup.policies) if not p.splits_itself)
    whole = tuple(i for i, p in enumerate(setup.policies) if p.splits_itself)
    n_layers, n_kv = setup.n_layers, setup.n_kv
    heads = kv_heads or n_kv
    pieces = []
    for s in np.flatnonzero(setup.ds.kvscope.n_steps > 0):
        if local:
            pieces += [
                Piece(int(s), a, min(a + layers, n_layers), h, kv_stop=min(h + heads, n_kv), policies=local)
                for a in range(0, n_layers, layers)
                for h in range(0, n_kv, heads)
            ]
        if whole:
            pieces.append(Piece(int(s), 0, n_layers, 0, kv_stop=n_kv, policies=whole))
    return pieces
