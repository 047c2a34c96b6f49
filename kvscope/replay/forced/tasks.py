"""A replay's forced decodes as tasks: one per context (its samples share the prefill, each sample's
runs its full-KV reference), in this process or on a dask cluster (each worker loads the trace's
model once), and their figures gathered into ``ForcedOutputs``."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import numpy as np

from ...errors import KvscopeError
from .loop import ForcedRun
from .model import ForcedModel, load_model
from .routing import decoding_press, loop_of, prompt_press, reads_prompt
from .sample import SampleForcing, context_prefill


def check_forced(chunk: int, max_rounds: int) -> tuple[int, int]:
    """The forced-replay settings, checked where they are defined."""
    for name, value in (("forced chunk", chunk), ("max rounds", max_rounds)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise KvscopeError(f"{name} must be an integer ≥ 1 (got {value!r})")
    return int(chunk), int(max_rounds)


@dataclass
class ForcedOutputs:
    """Every run's forced decode: ``kl``, ``nll``, ``top1``, ``hit`` (1.0 where the greedy choice is
    the forced token) and ``rank`` (of the forced token: how many tokens are likelier)
    ``[*run, sample, step]`` (``ForcedRun._score``; NaN past a sample's steps, and on the steps a
    question-agnostic trace does not score), ``rounds`` and
    ``converged`` ``[*run, sample]``, ``perplexity_full [sample]`` (the continuation under full KV),
    ``exact_full [sample]`` (1.0 where full KV's greedy choice is the forced token at every scored step),
    per policy how its loop ran (``loops``: closed, one round, or open for the clairvoyant), and
    ``served``: per policy what the continuation saw, where not the masked cache."""

    kl: np.ndarray
    nll: np.ndarray
    top1: np.ndarray
    hit: np.ndarray
    rank: np.ndarray
    rounds: np.ndarray
    converged: np.ndarray
    perplexity_full: np.ndarray
    loops: dict
    settings: dict
    exact_full: np.ndarray | None = None  # [sample]
    served: dict = field(default_factory=dict)

    @classmethod
    def allocate(cls, setup, settings: dict) -> ForcedOutputs:
        lead = (len(setup.policies), len(setup.allocations), len(setup.budgets), setup.n_samples)
        per_step = lead + (setup.n_step_total,)
        return cls(
            kl=np.full(per_step, np.nan), nll=np.full(per_step, np.nan), top1=np.full(per_step, np.nan),
            hit=np.full(per_step, np.nan), rank=np.full(per_step, np.nan),
            rounds=np.zeros(lead, dtype=np.int64), converged=np.ones(lead, dtype=bool),
            perplexity_full=np.full(setup.n_samples, np.nan), loops={}, settings=settings,
            exact_full=np.full(setup.n_samples, np.nan),
        )  # fmt: skip

    def absorb(self, result: TaskResult) -> None:
        """A task's runs into place (their scored steps: the rest stay NaN)."""
        s = result.sample
        for (pi, ai, bi), (kl, nll, top1, hit, rank, rounds, converged) in result.runs.items():
            at, steps = (pi, ai, bi, s), slice(result.first, result.first + len(kl))
            self.kl[at][steps], self.nll[at][steps], self.top1[at][steps] = kl, nll, top1
            self.hit[at][steps], self.rank[at][steps] = hit, rank
            self.rounds[at], self.converged[at] = rounds, converged
        self.perplexity_full[s], self.exact_full[s] = result.perplexity_full, result.exact_full
        self.loops.update(result.loops)
        self.served.update(result.served)


@dataclass(frozen=True)
class ForcedTask:
    """The forced decodes of one context's samples (its questions: ``ds.kvscope.contexts``) under
    some policies (every allocation and budget of each): one prefill shared by all, one full-KV
    reference per sample."""

    samples: tuple[int, ...]
    policies: tuple[int, ...]


@dataclass
class TaskResult:
    """What a task sends back: per run ``(policy, allocation, budget)`` its per-step figures, rounds
    and convergence; the sample's perplexity under full KV; each policy's loop."""

    sample: int
    first: int  # the first scored step (the runs' arrays start there)
    runs: dict  # (pi, ai, bi) → (kl, nll, top1, hit, rank [scored step], rounds, converged)
    perplexity_full: float
    loops: dict  # policy label → loop
    served: dict = field(default_factory=dict)  # policy label → what the continuation saw, where not the masked cache
    exact_full: float = float("nan")  # full KV's greedy choices are the scored tokens (1.0) or not (0.0)


def run_task(
    setup, forced: ForcedModel, task: ForcedTask, *, splits: dict, chunk: int, max_rounds: int
) -> list[TaskResult]:
    """The forced decodes of ``task`` (``kvscope.replay.forced``), one result per sample: ``chunk``
    steps per forward, at most ``max_rounds`` per chunk; ``splits``: the oracle allocation's, by sample."""
    policies = [setup.policies[pi] for pi in task.policies]
    allocations = [a.for_sample(s) if a is not None else None for a in setup.allocations for s in task.samples]
    needs = {
        "prompt_attention": any(reads_prompt(policy, a) for policy in policies for a in allocations),
        "decoding_presses": any(decoding_press(policy) for policy in policies),
        "prompt_presses": any(prompt_press(policy) for policy in policies),
    }
    context = context_prefill(setup, task.samples[0], forced, **needs)
    results = []
    for s in task.samples:
        sample = SampleForcing(setup, s, forced, chunk=chunk, max_rounds=max_rounds, context=context)
        results.append(_sample_runs(sample, task.policies, splits=splits.get(s, {})))
    return results


def _sample_runs(sample: SampleForcing, policies: tuple[int, ...], splits: dict) -> TaskResult:
    """Every run of ``policies`` (each allocation and budget) on ``sample``; ``splits``: its oracle splits."""
    setup, s = sample.setup, sample.s
    runs = {
        (pi, ai, bi): ForcedRun(sample, setup.policies[pi], allocation, budget, split=splits.get((pi, ai, bi)))
        for pi in policies
        for ai, allocation in enumerate(setup.allocations)
        for bi, budget in enumerate(setup.budgets)
    }
    loops = {run.policy.label(): loop_of(run.policy, run.state) for run in runs.values()}
    scored = slice(sample.first_scored, sample.S)
    done, served = {}, {}
    for key, run in runs.items():
        run.run()
        done[key] = (run.kl[scored], run.nll[scored], run.top1[scored], run.hit[scored], run.rank[scored],
                     run.rounds, run.converged)  # fmt: skip
        if run.pressed is not None:
            served[run.policy.label()] = "the press's own rewritten cache"
    return TaskResult(sample=s, first=sample.first_scored, runs=done, perplexity_full=sample.perplexity_full(),
                      loops=loops, served=served, exact_full=sample.exact_full())  # fmt: skip


def forced_tasks(setup, client) -> list[ForcedTask]:
    """One task per context of the samples with steps (its samples share the prefill, each sample's
    runs its reference); on a cluster one per (context, policy), so that the workers share the grid."""
    acc = setup.ds.kvscope
    by_context: dict[int, list[int]] = {}
    for s in np.flatnonzero(acc.n_steps > 0):
        by_context.setdefault(int(acc.contexts[s]), []).append(int(s))
    groups = [tuple(samples) for samples in by_context.values()]
    if client is None:
        return [ForcedTask(samples, tuple(range(len(setup.policies)))) for samples in groups]
    return [ForcedTask(samples, (pi,)) for samples in groups for pi in range(len(setup.policies))]


def forced_replay(setup, forced: ForcedModel, splits: dict, chunk: int, max_rounds: int, client=None,
                  progress=None) -> ForcedOutputs:  # fmt: skip
    """The forced decode of every run of ``setup`` on every sample with steps — in this process with
    the model ``forced`` loaded once, or as tasks on a dask ``client`` (each worker loads the trace's
    model once); ``splits``: the oracle allocation's per sample, as the replay chose them.
    ``progress(done, total)`` per task."""
    out = ForcedOutputs.allocate(setup, {"chunk": chunk, "max_rounds": max_rounds, "model": forced.label,
                                         "kv_itemsize": setup.kv_itemsize})  # fmt: skip
    forcing = {"splits": splits, "chunk": chunk, "max_rounds": max_rounds}
    tasks = forced_tasks(setup, client)
    if client is None:
        results = (run_task(setup, forced, task, **forcing) for task in tasks)
    else:
        results = _on_cluster(client, setup, tasks, device=str(forced.device), forcing=forcing)
    for done, task_results in enumerate(results, 1):
        for result in task_results:
            out.absorb(result)
        if progress is not None:
            progress(done, len(tasks))
    return out


def _on_cluster(client, setup, tasks, *, device: str, forcing: dict):
    """The tasks' results from the cluster's workers, as they finish (``forcing``: ``run_task``'s
    splits, chunk and max_rounds)."""
    from distributed import as_completed

    state = replace(setup, ds=None)
    futures = [client.submit(_remote_task, state, setup.source, task, device=device, pure=False, **forcing)
               for task in tasks]  # fmt: skip
    for future in as_completed(futures):
        yield future.result()


@functools.lru_cache(maxsize=2)
def _worker_model(path: str, device: str) -> tuple:
    """A worker's trace and its model (``load_model``: the model itself loaded once per process),
    opened and checked once per process."""
    from ...storage.store import open_trace

    ds = open_trace(path)
    return ds, load_model(ds, device)


def _remote_task(setup, path: str, task: ForcedTask, *, device: str, **forcing) -> list[TaskResult]:
    ds, forced = _worker_model(path, device)
    return run_task(replace(setup, ds=ds), forced, task, **forcing)
