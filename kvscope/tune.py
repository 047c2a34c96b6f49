"""``kvscope tune``: search a policy's parameters and its allocation's offline, against a trace,
then check the winner live on prompts the search never saw.

    space   each parameter whose field names a ``tune`` range (``param(…, tune=…)``): a float's
            (low, high) interval, the values to try otherwise; ``--space key=lo:hi`` or
            ``key=a,b,c`` overrides, ``allocation.key=…`` the allocation's
    search  every combination when the space is finite and small enough (a grid), else scipy's
            differential evolution (integers and choices through ``integrality``), seeded, its
            generations evaluated as one batch; at most ``trials`` configurations are replayed
    value   the replay's ``fmm_mean``, ``fmm_fp_mean`` or ``output_rel_l2_mean`` of the policy
            at β under the allocation; a configuration that cannot fit β (its floor) is not a
            candidate (value ∞) — it would win by using more memory
    check   the best and the default decode live (kvscope run: full KV, the policy free, the
            policy teacher-forced) on held-out prompts: KL to full KV, token agreement and the
            workload's score; the offline ranking *held* when the best's live KL is no worse
            (not judged when the default cannot fit β: it decodes at its floor, with more bytes)

The result is a JSON document: the default's and every configuration's value, best first.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import dataclass, field

import numpy as np

from .errors import KvscopeError
from .params import parse_param, specs
from .policies import Allocation, Policy, check_budget, parse
from .policies import allocation as allocation_module

OBJECTIVES = {"fmm": "fmm_mean", "fmm-fp": "fmm_fp_mean", "output-error": "output_rel_l2_mean"}
ALLOCATION_PREFIX = "allocation."


@dataclass(frozen=True)
class Dimension:
    """One searched parameter: ``name`` (``allocation.`` prefixed for the allocation's), and
    either a float interval ``(low, high)`` or the ``values`` to try."""

    name: str
    low: float | None = None
    high: float | None = None
    values: tuple = ()

    @property
    def continuous(self) -> bool:
        return not self.values

    def at(self, x: float):
        """The parameter value at coordinate ``x`` (a float to 4 decimals, or a value's index)."""
        if self.continuous:
            return round(float(min(max(x, self.low), self.high)), 4)
        return self.values[int(round(min(max(x, 0), len(self.values) - 1)))]

    @property
    def bounds(self) -> tuple[float, float]:
        return (self.low, self.high) if self.continuous else (0, len(self.values) - 1)


def _owner(policy: Policy, allocation: Allocation, name: str):
    return (allocation, name.removeprefix(ALLOCATION_PREFIX)) if name.startswith(ALLOCATION_PREFIX) else (policy, name)


def default_space(policy: Policy, allocation: Allocation) -> list[Dimension]:
    """The dimensions that the policy's and the allocation's fields name for tuning."""
    out = []
    for owner, prefix in ((policy, ""), (allocation, ALLOCATION_PREFIX)):
        for name, (spec, kind, _, _) in specs(owner).items():
            if spec.tune is None:
                continue
            if kind is float:
                out.append(Dimension(prefix + name, low=float(spec.tune[0]), high=float(spec.tune[1])))
            else:
                out.append(Dimension(prefix + name, values=tuple(spec.tune)))
    return out


def parse_space(policy: Policy, allocation: Allocation, texts: list[str]) -> list[Dimension]:
    """The default space with ``key=lo:hi`` (a float interval) or ``key=a,b,c`` (values) overriding
    or adding dimensions; each value is checked against its field."""
    dims = {d.name: d for d in default_space(policy, allocation)}
    for text in texts:
        if "=" not in text:
            raise KvscopeError(f"--space {text!r} must read key=low:high or key=a,b,c")
        name, value = (part.strip() for part in text.split("=", 1))
        owner, key = _owner(policy, allocation, name)
        if key not in specs(owner):
            known = ", ".join(sorted(specs(owner)))
            what = "allocation" if owner is allocation else "policy"
            raise KvscopeError(f"--space: {what} {owner.name} has no parameter {key!r} (has: {known or 'none'})")
        kind = specs(owner)[key][1]
        if ":" in value and kind is float:
            lo, hi = (parse_param(type(owner), key, v) for v in value.split(":", 1))
            for v in (lo, hi):
                _checked(owner, key, v)
            if not lo < hi:
                raise KvscopeError(f"--space {name}: the interval {value} must have low < high")
            dims[name] = Dimension(name, low=float(lo), high=float(hi))
        else:
            values = tuple(
                _checked(owner, key, parse_param(type(owner), key, v)) for v in value.split(",") if v.strip()
            )
            if not values:
                raise KvscopeError(f"--space {name} names no value")
            dims[name] = Dimension(name, values=values)
    if not dims:
        raise KvscopeError(f"{policy.name} under {allocation.name} has nothing to tune; name a dimension with --space")
    return list(dims.values())


def _checked(owner, key: str, value):
    """``value`` for ``owner.key``, refused with the field's own message when out of range."""
    dataclasses.replace(owner, **{key: value})
    return value


@dataclass
class Trial:
    """One configuration and its offline value (∞ where it cannot fit the budget)."""

    params: dict  # {name: value}, allocation ones prefixed
    policy: str  # label
    allocation: str  # label
    value: float
    reached: bool

    def doc(self) -> dict:
        return {**dataclasses.asdict(self), "value": None if not math.isfinite(self.value) else self.value}


def config_key(config: dict) -> str:
    """One configuration as text: what identifies it among the trials, and breaks ties."""
    return json.dumps(config, sort_keys=True, default=str)


@dataclass
class Search:
    """The search of the module docstring over ``dims`` with ``evaluate(configs) → values``
    (one batch per grid or generation); deterministic for a ``seed``."""

    dims: list[Dimension]
    evaluate: callable
    trials: int = 60
    seed: int = 0
    seen: dict = field(default_factory=dict)  # key → value

    def grid(self) -> list[dict] | None:
        """Every combination, when the space is finite and holds at most ``trials`` of them."""
        if any(d.continuous for d in self.dims):
            return None
        size = math.prod(len(d.values) for d in self.dims)
        if size > self.trials:
            return None
        return [
            dict(zip((d.name for d in self.dims), combo)) for combo in itertools.product(*(d.values for d in self.dims))
        ]

    def run(self) -> list[tuple[dict, float]]:
        """``(config, value)`` of every configuration evaluated, best first."""
        configs = self.grid()
        if configs is not None:
            self._batch(configs)
        else:
            self._evolve()
        ranked = sorted(self.seen.values(), key=lambda cv: (cv[1], config_key(cv[0])))
        return ranked

    def _batch(self, configs: list[dict]) -> list[float]:
        """Values of ``configs``, evaluating only the ones not seen, while trials remain."""
        new: dict[str, dict] = {}
        for c in configs:
            k = config_key(c)
            if k not in self.seen and k not in new and len(self.seen) + len(new) < self.trials:
                new[k] = c
        if new:
            for (k, c), v in zip(new.items(), self.evaluate(list(new.values())), strict=True):
                self.seen[k] = (c, float(v))
        return [self.seen[k][1] if (k := config_key(c)) in self.seen else math.inf for c in configs]

    def _evolve(self) -> None:
        from scipy.optimize import differential_evolution

        n = len(self.dims)
        population = max(5, min(15, self.trials // 4))  # individuals per generation
        generations = max(0, self.trials // population - 1)

        def values(x: np.ndarray) -> np.ndarray:  # x [dim, individual]
            configs = [{d.name: d.at(v) for d, v in zip(self.dims, column)} for column in np.atleast_2d(x).T]
            return np.asarray(self._batch(configs))

        differential_evolution(
            values, [d.bounds for d in self.dims], seed=self.seed, popsize=max(1, math.ceil(population / n)),
            maxiter=generations, polish=False, vectorized=True, updating="deferred", init="sobol" if n > 1 else "latinhypercube",
            integrality=[not d.continuous for d in self.dims], tol=0,
        )  # fmt: skip


@dataclass
class TuneResult:
    policy: Policy  # the default (as given)
    allocation: Allocation
    budget: float
    objective: str
    default: Trial
    trials: list[Trial]  # best first
    check: dict | None = None

    @property
    def best(self) -> Trial:
        return self.trials[0]

    def doc(self) -> dict:
        return {
            "policy": self.policy.label(),
            "allocation": self.allocation.label(),
            "budget": self.budget,
            "objective": self.objective,
            "default": self.default.doc(),
            "best": self.best.doc(),
            "trials": [t.doc() for t in self.trials],
            "check": self.check,
        }


def configure(policy: Policy, allocation: Allocation, config: dict) -> tuple[Policy, Allocation]:
    """The policy and allocation with ``config``'s values in their fields."""
    mine = {k: v for k, v in config.items() if not k.startswith(ALLOCATION_PREFIX)}
    theirs = {k.removeprefix(ALLOCATION_PREFIX): v for k, v in config.items() if k.startswith(ALLOCATION_PREFIX)}
    return dataclasses.replace(policy, **mine), dataclasses.replace(allocation, **theirs)


def tune(
    trace,
    policy,
    budget: float,
    *,
    objective: str = "fmm",
    allocation="uniform",
    space: list[str] = (),
    trials: int = 60,
    seed: int = 0,
    replay_options: dict | None = None,
) -> TuneResult:
    """Search ``policy``'s (and ``allocation``'s) parameters against ``trace`` at ``budget``
    (module docstring); ``replay_options`` go to every [`kvscope.replay`][kvscope.replay.replay]."""
    from .replay import replay
    from .storage.store import open_trace

    budget = check_budget(budget)
    if objective not in OBJECTIVES:
        raise KvscopeError(f"--objective must be one of {', '.join(OBJECTIVES)} (got {objective!r})")
    if trials < 1:
        raise KvscopeError(f"--trials must be ≥ 1 (got {trials})")
    policy = parse(policy) if isinstance(policy, str) else policy
    allocation = allocation_module.parse(allocation)
    ds = open_trace(trace) if not hasattr(trace, "kvscope") else trace
    if objective == "output-error" and not ds.kvscope.has_qkv:
        raise KvscopeError("--objective output-error needs recorded q/k/v (trace with --record qkv)")
    dims = parse_space(policy, allocation, list(space))
    variable = OBJECTIVES[objective]
    options = {"errors": objective == "output-error", "n_boot": 1, **(replay_options or {})}
    made: dict[str, Trial] = {}

    def evaluate(configs: list[dict]) -> list[float]:
        pairs = [configure(policy, allocation, c) for c in configs]
        by_allocation: dict[str, tuple[Allocation, list[Policy]]] = {}
        for p, a in pairs:
            group = by_allocation.setdefault(a.label(), (a, []))[1]
            if p.label() not in {q.label() for q in group}:
                group.append(p)
        values = {}
        for a_label, (a, group) in by_allocation.items():
            r = replay(ds, group, [budget], allocations=[a], **options)
            for p in group:
                run = r.sel(policy=p.label(), allocation=a_label, budget=budget)
                reached = bool(run["budget_reached"])
                value = float(run[variable]) if reached else math.inf
                values[(p.label(), a_label)] = (value if math.isfinite(value) else math.inf, reached)
        out = []
        for c, (p, a) in zip(configs, pairs, strict=True):
            value, reached = values[(p.label(), a.label())]
            made[config_key(c)] = Trial(params=c, policy=p.label(), allocation=a.label(), value=value, reached=reached)
            out.append(value)
        return out

    defaults = {d.name: getattr(*_owner(policy, allocation, d.name)) for d in dims}
    search = Search(dims, evaluate, trials=trials, seed=seed)
    search._batch([defaults])  # the default first: always evaluated, always in the table
    ranked = search.run()
    trials_out = [made[config_key(c)] for c, _ in ranked]
    default = made[config_key(defaults)]
    return TuneResult(
        policy=policy, allocation=allocation, budget=budget, objective=objective, default=default, trials=trials_out
    )


# -- the live check ----------------------------------------------------------------------------


def held_out_prompts(ds, source: str, model_spec: str) -> list:
    """``--check SOURCE``: a prompts file, or a built-in workload ``NAME[:seed=S][:samples=N]
    [:context=L]`` (by default the trace's context and the seed after the largest it used, so
    the prompts are new); refused when a prompt is one the trace holds."""
    from pathlib import Path

    from . import workloads
    from .model.prompts import load_prompts_file

    seen = ds.attrs.get("prompts", [])
    if not source or not str(source).strip():
        raise KvscopeError("--check needs held-out prompts: a prompts file or a workload NAME[:seed=S]")
    if Path(source).exists():
        prompts = load_prompts_file(source)
    else:
        name, *pairs = str(source).split(":")
        if name not in workloads.available():
            raise KvscopeError(
                f"--check {source}: no such file, and not a workload (available: {', '.join(workloads.available())})"
            )
        options = _workload_options(name, pairs, seen)
        prompts = workloads.prompts_for_model(name, model_spec, **options)
    texts = {doc.get("text") for doc in seen}
    for n, prompt in enumerate(prompts):
        if prompt.text in texts:
            raise KvscopeError(f"--check: prompt {n} ({prompt.source}) is in the trace: the search saw it")
    return prompts


def _workload_options(name: str, pairs: list[str], seen: list[dict]) -> dict:
    mine = [doc.get("meta", {}) for doc in seen if doc.get("meta", {}).get("workload") == name]
    options = {
        "seed": max((int(m.get("seed", 0)) for m in mine), default=-1) + 1,
        "context": int(mine[0]["context"]) if mine and "context" in mine[0] else None,
        "samples": len(mine) or None,
    }
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in options or not value.strip().lstrip("-").isdigit():
            raise KvscopeError(f"--check {name}: {pair!r} must be seed=S, samples=N or context=L")
        options[key] = int(value)
    return options


def held_out(trace, source: str, allocation, model: str | None = None):
    """``(model source, prompts)`` of ``--check``, checked before any search: the allocation
    can run live, the prompts exist and are new to the trace."""
    from .live.inputs import live_allocation
    from .model.loading import recorded_model_dtype, trace_model_source
    from .storage.store import open_trace

    if not source or not str(source).strip():
        raise KvscopeError("--check needs held-out prompts: a prompts file or a workload NAME[:seed=S]")
    live_allocation(allocation)  # the oracle has no live split without a trace
    ds = open_trace(trace) if not hasattr(trace, "kvscope") else trace
    source_model = trace_model_source(trace, ds.attrs.get("model"), model)
    recorded_model_dtype(trace, ds.attrs)
    return source_model, held_out_prompts(ds, source, source_model.spec)


def check_live(result: TuneResult, trace, source: str, *, model: str | None = None, progress=None, held=None) -> dict:
    """Decode the held-out prompts (``held``: what ``held_out`` returned, else found
    here) under the default and the best configuration (module docstring); returns both
    summaries and whether the offline ranking held."""
    from .live.cache import prepare
    from .live.run import run_loaded
    from .model.loading import load, recorded_model_dtype
    from .model.prompts import encode_prompts
    from .storage.store import open_trace

    ds = open_trace(trace) if not hasattr(trace, "kvscope") else trace
    configs = {"default": result.default, "best": result.best}
    source_model, prompts = held or held_out(ds, source, result.allocation, model)
    generation = ds.attrs.get("generation", {})
    loaded, tokenizer = load(source_model, ds.attrs.get("device", "cpu"), recorded_model_dtype(trace, ds.attrs))
    prepare(loaded, ds.attrs.get("attn_kernel", "sdpa"))
    agnostic = ds.kvscope.question_agnostic
    encoded, questions = encode_prompts(tokenizer, prompts, bool(generation.get("chat_template", False)), agnostic)
    steps = int(generation.get("max_new_tokens") or ds.sizes["step"])
    scorer = _scorer(prompts)
    out = {"prompts": len(prompts), "source": source}
    for name, trial in configs.items():
        policy, allocation = parse(trial.policy), allocation_module.parse(trial.allocation)
        runs = [
            run_loaded(
                loaded, tokenizer, ids, policy, budget=result.budget, max_new_tokens=steps, scorer=scorer,
                expected=p.expected, question=q, allocation=allocation, on_step=progress,
            )
            for p, ids, q in zip(prompts, encoded, questions, strict=True)
        ]  # fmt: skip
        scores = [r.score for r in runs if r.score is not None]
        out[name] = {
            "policy": trial.policy,
            "allocation": trial.allocation,
            "offline": trial.doc()["value"],
            "kl": float(np.mean([r.kl for r in runs])),
            "agreement": float(np.mean([r.agreement for r in runs])),
            "score": float(np.mean(scores)) if scores else None,
            "bytes_ratio": float(max(r.bytes_model_peak / r.full_bytes for r in runs)),
        }
    # at equal memory only: a default that cannot fit β decodes at its floor, with more bytes
    comparable = result.default.reached and result.best.reached
    out["held"] = (out["best"]["kl"] <= out["default"]["kl"]) if comparable else None
    return out


def _scorer(prompts):
    """The workload's scorer when the prompts come from one (their answers are known)."""
    from . import workloads

    names = {p.meta.get("workload") for p in prompts if p.expected is not None}
    if len(names) != 1 or None in names:
        return None
    return workloads.get(names.pop()).scorer
