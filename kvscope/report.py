"""Tables and JSON documents of results: what the CLI prints, and what notebooks can call.

comparison(result)            the policy × allocation × budget rows of a replay result (dicts)
comparison_doc(result)        the same with the replay's settings (JSON)
print_comparison(result, t)   as a rich table
print_rows(rows, title)       (quantity, value) rows of an analysis as a rich table
task_accuracy(result)         accuracy per task of a result with answers, with its CI and full KV's
answer_table(result, β)       per sample and policy: answered, lost or gained against full KV
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Iterator

    import rich.table
    import xarray as xr

TIERS = ("FP", "Q", "EVICTED")

__all__ = [
    "allocation_lines",
    "answer_table",
    "comparison",
    "comparison_doc",
    "layer_shares",
    "press_settings",
    "print_comparison",
    "print_rows",
    "print_table",
    "runs",
    "sample_tasks",
    "task_accuracy",
    "task_names",
    "unit_shares",
]


def _num(x) -> float | None:
    x = float(x)
    return None if np.isnan(x) else round(x, 6)


def runs(result: xr.Dataset) -> Iterator[tuple[str, str, float]]:
    """``(policy, allocation, budget)`` labels of every run of a replay result, in order.

    Args:
        result: A replay result ([`replay`][kvscope.replay.replay], [`open_result`][kvscope.open_result]).
    """
    for policy in result["policy"].values:
        for allocation in result["allocation"].values:
            for budget in result["budget"].values:
                yield str(policy), str(allocation), float(budget)


def unit_shares(result: xr.Dataset, policy: str, allocation: str, budget: float) -> xr.DataArray:
    """``[layer, kv_head]`` the bytes a run gave each unit as a multiple of the uniform split,
    mean over samples: 1 everywhere under ``uniform``.

    Args:
        result: A replay result.
        policy: The run's policy label.
        allocation: The run's allocation label.
        budget: The run's β.
    """
    allocated = result["allocated"].sel(policy=policy, allocation=allocation, budget=budget)  # [sample, layer, kv_head]
    even = result["budget_bytes"].sel(budget=budget) / (result.sizes["layer"] * result.sizes["kv_head"])  # [sample]
    return (allocated / even).mean("sample")


def layer_shares(result: xr.Dataset, policy: str, allocation: str, budget: float) -> list[float]:
    """``[layer]`` [`unit_shares`][kvscope.report.unit_shares] averaged over KV heads, rounded.

    Args:
        result: A replay result.
        policy: The run's policy label.
        allocation: The run's allocation label.
        budget: The run's β.
    """
    return [round(float(x), 4) for x in unit_shares(result, policy, allocation, budget).mean("kv_head").values]


def comparison(result: xr.Dataset) -> list[dict]:
    """The policy × allocation × budget table of a replay result, one dict per run.

    A row holds ``policy``, ``kind``, ``allocation``, ``budget``; ``layer_bytes`` (each layer's
    bytes as a multiple of the uniform split); ``byte_ratio`` (the peak bytes used as a share
    of the full cache) and ``budget_reached``; ``fmm`` with ``fmm_ci95`` and ``fmm_fp``
    ([FMM](concepts.md#fmm)); ``evicted_mass`` and ``q_mass`` (the
    [tier-resolved future mass](concepts.md#tier-resolved-mass)); ``attn_l1`` and
    ``output_rel_l2`` ([output error](concepts.md#output-error), None without q/k/v);
    ``churn`` and ``lir``; with forced replay its ``forced_*`` figures and, where the trace's
    samples carry answers, ``accuracy`` with ``accuracy_ci95`` ([task accuracy from the gold
    answer](concepts.md#task-accuracy)) and, where contexts hold several questions,
    ``accuracy_by_question`` (per question index: ``question_accuracy``). A number that is NaN is None.

    Args:
        result: A replay result ([`replay`][kvscope.replay.replay], [`open_result`][kvscope.open_result]).
    """
    rows = []
    has_err = "attn_l1_mean" in result
    forced = "forced_kl_mean" in result
    answers = "accuracy" in result
    by_question = question_accuracy(result) if answers and several_questions(result) else None
    for policy, allocation, budget in runs(result):
        r = result.sel(policy=policy, allocation=allocation, budget=budget)
        tier = dict(zip(TIERS, (float(x) for x in r["tier_mean"].values)))
        rows.append(
            {
                "policy": policy,
                "kind": str(r["policy_kind"].values),
                "allocation": allocation,
                "budget": budget,
                "layer_bytes": layer_shares(result, policy, allocation, budget),
                "byte_ratio": _num(r["byte_ratio_used"]),
                "budget_reached": bool(r["budget_reached"]),
                "fmm": _num(r["fmm_mean"]),
                "fmm_ci95": [_num(r["fmm_ci_low"]), _num(r["fmm_ci_high"])],
                "fmm_fp": _num(r["fmm_fp_mean"]),
                "evicted_mass": _num(tier["EVICTED"]),
                "q_mass": _num(tier["Q"]),
                "attn_l1": _num(r["attn_l1_mean"]) if has_err else None,
                "output_rel_l2": _num(r["output_rel_l2_mean"]) if has_err else None,
                "churn": _num(r["churn_mean"]),
                "lir": _num(r["lir"]),
                **(_forced_row(r) if forced else {}),
                **(_accuracy_row(r) if answers else {}),
            }
        )
        if by_question is not None:
            at = by_question["accuracy"].sel(policy=policy, allocation=allocation, budget=budget)
            rows[-1]["accuracy_by_question"] = [_num(x) for x in at]
    return rows


def several_questions(result: xr.Dataset) -> bool:
    """Some context of the result holds more than one question (its ``question`` coordinate)."""
    return "question" in result.coords and bool((result["question"].values > 0).any())


def _forced_row(r) -> dict:
    """A run's forced-decode figures (docs/concepts.md#forced-replay)."""
    return {
        "forced_kl": _num(r["forced_kl_mean"]),
        "forced_kl_ci95": [_num(r["forced_kl_ci_low"]), _num(r["forced_kl_ci_high"])],
        "forced_perplexity": _num(r["forced_perplexity"]),
        "forced_perplexity_ci95": [_num(r["forced_perplexity_ci_low"]), _num(r["forced_perplexity_ci_high"])],
        "forced_agreement": _num(r["forced_agreement"]),
        "forced_rounds": int(r["forced_rounds"].max()),
        "forced_converged": bool(r["forced_converged"].all()),
    }


def _accuracy_row(r) -> dict:
    """A run's task accuracy: the share of samples with answers whose greedy output under the run's
    cache starts with the gold answer, with its bootstrap CI (docs/concepts.md#task-accuracy)."""
    return {
        "accuracy": _num(r["accuracy"]),
        "accuracy_ci95": [_num(r["accuracy_ci_low"]), _num(r["accuracy_ci_high"])],
    }


def comparison_doc(result: xr.Dataset) -> dict:
    """JSON document of [`comparison`][kvscope.report.comparison] with the replay's settings.

    Args:
        result: A replay result ([`replay`][kvscope.replay.replay], [`open_result`][kvscope.open_result]).
    """
    parsed = {k: json.loads(result.attrs.get(k, "{}")) for k in ("policies", "allocations")}
    attrs = {k: v for k, v in result.attrs.items() if k not in parsed}
    return {**attrs, **parsed, "rows": comparison(result)}


def print_table(table: rich.table.Table, min_width: int = 100) -> None:
    """Print a rich table at least ``min_width`` columns wide (wider terminals keep their width).

    Args:
        table: The table.
        min_width: Columns at least.
    """
    from rich.console import Console

    Console(width=max(min_width, Console().width)).print(table)


def print_comparison(result: xr.Dataset, title: str) -> None:
    """Print [`comparison`][kvscope.report.comparison] as a table (``kvscope replay``), then
    what the columns mean and one line per press setting and allocation.

    Args:
        result: A replay result ([`replay`][kvscope.replay.replay], [`open_result`][kvscope.open_result]).
        title: The table's title.
    """
    from rich.table import Table

    def fmt(x, digits=3):
        return "—" if x is None else f"{x:.{digits}f}"

    h = result.attrs.get("horizon", 32)
    allocations = [str(a) for a in result["allocation"].values]
    split = allocations != ["uniform"]  # show the allocation column
    forced = "forced_kl_mean" in result
    answers = "accuracy" in result
    table = Table(
        "policy", *(["allocation"] if split else []), "β", "bytes used", f"FMM@{h} [95% CI]", "FMM fp", "Q mass",
        "attn L1", "out err", "churn", "LIR", *(["KL (forced) [95% CI]", "ppl", "top-1"] if forced else []),
        *(["accuracy [95% CI]"] if answers else []),
        title=title,
    )  # fmt: skip
    rows = comparison(result)
    for row in rows:
        used = fmt(row["byte_ratio"]) + ("" if row["budget_reached"] else " (floor)")
        table.add_row(
            row["policy"], *([row["allocation"]] if split else []), f"{row['budget']:g}", used,
            fmt(row["fmm"]) + _ci(row["fmm_ci95"], fmt), fmt(row["fmm_fp"]), fmt(row["q_mass"]),
            fmt(row["attn_l1"]), fmt(row["output_rel_l2"]), fmt(row["churn"]), fmt(row["lir"]),
            *(_forced_cells(row, fmt) if forced else []),
            *([fmt(row["accuracy"]) + _ci(row["accuracy_ci95"], fmt)] if answers else []),
        )  # fmt: skip
    print_table(table, (170 if answers else 150) if forced else 120)
    print(
        "bytes used: peak share of the full cache at the final length; (floor): the policy cannot fit β and "
        "reports what it used. FMM: future mass on evicted positions; FMM fp: not at full precision. "
        f"CI: {result.attrs.get('ci', 'bootstrap')}."
    )
    if forced:
        print(forced_note(result, rows))
    for line in question_lines(rows) + press_settings(result) + allocation_lines(rows):
        print(line)


def _ci(pair, fmt) -> str:
    lo, hi = pair
    return f" [{fmt(lo)}, {fmt(hi)}]" if lo is not None and hi is not None else ""


NO_TASK = "no task"  # the panel of samples without a task, beside others'
ALL = "all"  # the one panel when no sample has a task


def sample_tasks(result: xr.Dataset) -> np.ndarray:
    """``[sample]`` each sample's task: the result's ``task`` coordinate (``replay --forced`` of a trace
    with answers), ``NO_TASK`` where a sample has none, and ``ALL`` for every sample when none has one
    (or the result predates the coordinate).

    Args:
        result: A replay result.
    """
    given = (
        np.asarray(result["task"].values, dtype=str) if "task" in result.coords else np.full(result.sizes["sample"], "")
    )
    if not (given != "").any():
        return np.full(given.shape, ALL)
    return np.where(given == "", NO_TASK, given)


def task_accuracy(result: xr.Dataset) -> xr.Dataset:
    """Task accuracy of a result with answers, per task (docs/concepts.md#task-accuracy): ``accuracy_by``
    over ``sample_tasks``, tasks in the order of their first graded sample (``task_names``).

    Args:
        result: A replay result with ``answer_exact`` (``kvscope replay --forced`` of a trace with answers).
    """
    return accuracy_by(result, sample_tasks(result), task_names(result), dim="task")


def question_accuracy(result: xr.Dataset) -> xr.Dataset:
    """Task accuracy of a result with answers per question index (its ``question`` coordinate: a
    context's first question 0, its second 1, …; docs/replay.md#several-questions-per-context):
    ``accuracy_by`` over it, indices in increasing order (one, 0, for a result without the coordinate).

    Args:
        result: A replay result with ``answer_exact``.
    """
    of = result["question"].values if "question" in result.coords else np.zeros(result.sizes["sample"], np.int64)
    graded = result["answer_exact"].notnull().any(("policy", "allocation", "budget")).values  # [sample]
    return accuracy_by(result, of, sorted({int(q) for q in of[graded]}), dim="question")


def accuracy_by(result: xr.Dataset, of: np.ndarray, names: list, dim: str) -> xr.Dataset:
    """Task accuracy per group of samples, ``of [sample]`` each sample's group, ``names`` the groups::

        accuracy [policy, allocation, budget, dim]   Σ answer_exact / n over the group's graded samples
        ci_low, ci_high                              bootstrap over those samples (resampled whole; the
                                                     result's own accuracy_ci_* where one group holds all)
        n [dim]                                      graded samples (answer_exact not NaN)
        accuracy_full [dim]                          the same of answer_exact_full (NaN where absent)

    Args:
        result: A replay result with ``answer_exact``.
        of: ``[sample]`` each sample's group.
        names: The groups, in the order of the ``dim`` coordinate.
        dim: The groups' dimension.
    """
    import xarray as xr

    from .analysis.common import bootstrap_ratio

    exact = result["answer_exact"].transpose("policy", "allocation", "budget", "sample").values  # [*run, sample]
    graded = np.isfinite(exact).any((0, 1, 2))  # [sample]
    shape = exact.shape[:3] + (len(names),)
    acc, low, high = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
    full, n = np.full(len(names), np.nan), np.zeros(len(names), dtype=np.int64)
    reference = result["answer_exact_full"].values if "answer_exact_full" in result else None  # [sample]
    for k, name in enumerate(names):
        mine = graded & (of == name)
        n[k] = mine.sum()
        if reference is not None:
            full[k] = np.nanmean(reference[mine])
        if (mine | ~graded).all():  # one group: the result's own numbers
            acc[..., k], low[..., k], high[..., k] = (
                result[v].transpose("policy", "allocation", "budget").values
                for v in ("accuracy", "accuracy_ci_low", "accuracy_ci_high")
            )
            continue
        for run in np.ndindex(*shape[:3]):
            values = np.nan_to_num(exact[run][mine])
            acc[run + (k,)], low[run + (k,)], high[run + (k,)] = bootstrap_ratio(
                values, np.ones_like(values), resample=result.attrs.get("resample", "samples")
            )
    run_dims = ("policy", "allocation", "budget", dim)
    return xr.Dataset(
        {
            "accuracy": (run_dims, acc),
            "ci_low": (run_dims, low),
            "ci_high": (run_dims, high),
            "n": ((dim,), n),
            "accuracy_full": ((dim,), full),
        },
        coords={d: result[d].values for d in ("policy", "allocation", "budget")}
        | {"policy_name": ("policy", result["policy_name"].values), dim: names},
    )


def task_names(result: xr.Dataset) -> list[str]:
    """The tasks of a result's graded samples (``answer_exact`` not NaN), in the order of their first
    sample (``sample_tasks``); none without answers.

    Args:
        result: A replay result.
    """
    if "answer_exact" not in result:
        return []
    graded = result["answer_exact"].notnull().any(("policy", "allocation", "budget")).values  # [sample]
    return list(dict.fromkeys(str(t) for t in sample_tasks(result)[graded]))


def answer_table(result: xr.Dataset, budget: float, allocation: str = "uniform") -> dict[str, list]:
    """Per graded sample (rows) and policy (columns) at one β: the policy's ``answer_exact`` against
    full KV's (``answer_exact_full``)::

        cell = "lost"    full KV answered, the policy did not (1 → 0)
               "gained"  the policy answered, full KV did not (0 → 1)
               "1", "0"  both answered, neither did

    Columns ``sample``, ``task``, ``full KV`` ("1", "0"; "?" where the result predates it) and one per policy.

    Args:
        result: A replay result with ``answer_exact``.
        budget: The β.
        allocation: The allocation.
    """
    exact = result["answer_exact"].sel(budget=budget, allocation=allocation).transpose("policy", "sample").values
    graded = np.flatnonzero(np.isfinite(exact).any(0))  # [graded sample]
    has_full = "answer_exact_full" in result
    full = result["answer_exact_full"].values if has_full else np.full(result.sizes["sample"], np.nan)
    table: dict[str, list] = {
        "sample": [int(result["sample"].values[s]) for s in graded],
        "task": [str(t) for t in sample_tasks(result)[graded]],
        "full KV": ["?" if np.isnan(full[s]) else str(int(full[s])) for s in graded],
    }
    for p, policy in enumerate(result["policy"].values):
        table[str(policy)] = [_answer_cell(exact[p, s], full[s]) for s in graded]
    return table


def _answer_cell(policy: float, full: float) -> str:
    if np.isnan(policy):
        return "n/a"
    if not np.isnan(full) and policy != full:
        return "lost" if full == 1 else "gained"
    return str(int(policy))


def _forced_cells(row: dict, fmt) -> list[str]:
    """KL with its CI (``*`` where a sample's closed loop did not reach its fixed point), perplexity, top-1."""
    mark = "" if row["forced_converged"] else " *"
    kl = fmt(row["forced_kl"], 4) + _ci(row["forced_kl_ci95"], lambda x: fmt(x, 4)) + mark
    return [kl, fmt(row["forced_perplexity"], 2), fmt(row["forced_agreement"])]


def forced_note(result: xr.Dataset, rows: list[dict]) -> str:
    """What the forced columns are, and which runs did not converge."""
    settings = json.loads(result.attrs.get("forced", "{}"))
    full = result["forced_perplexity_full"].values
    text = (
        "forced: the model's own output teacher-forced on the trace's continuation under each cache — KL(full ‖ policy) "
        f"in nats per step, perplexity (full KV: {np.exp(np.nanmean(np.log(full))):.2f}), top-1 agreement with full KV; "
        f"{settings.get('chunk', '?')} steps per forward."
    )
    if "accuracy" in result:
        n = int(np.isfinite(result["answer_exact"].values).any(tuple(range(3))).sum())
        text += (
            f" accuracy: share of the {n} samples with answers whose greedy output under the cache starts with the "
            "gold answer (exact match of its tokens, from the forced answer)."
        )
    stuck = sorted({row["policy"] for row in rows if not row["forced_converged"]})
    if stuck:
        text += (
            f" * not converged within {settings.get('max_rounds', '?')} rounds (the figures are the last round's, "
            f"not the live decode's): {', '.join(stuck)}."
        )
    return text


def question_lines(rows: list[dict]) -> list[str]:
    """Accuracy per question index of each run, where contexts hold several questions."""
    if not rows or "accuracy_by_question" not in rows[0]:
        return []

    def cell(x):
        return "—" if x is None else f"{x:.3f}"

    lines = ["accuracy by question (each context's 1st, 2nd, … question):"]
    for row in rows:
        run = f"{row['policy']}" + ("" if row["allocation"] == "uniform" else f" under {row['allocation']}")
        lines.append(f"  {run} at β = {row['budget']:g}: " + " · ".join(map(cell, row["accuracy_by_question"])))
    return lines


def allocation_lines(rows: list[dict]) -> list[str]:
    """One line per run under an allocation other than uniform: the bytes it gave each layer
    as a multiple of the uniform split (first layer first).

    Args:
        rows: Rows of [`comparison`][kvscope.report.comparison].
    """
    return [
        f"{row['policy']} under {row['allocation']} at β = {row['budget']:g}: bytes per layer × uniform "
        + " ".join(f"{x:.2f}" for x in row["layer_bytes"])
        for row in rows
        if row["allocation"] != "uniform"
    ]


def press_settings(result: xr.Dataset) -> list[str]:
    """One line per kvpress press and budget: the setting that makes it hold β's bytes
    (mean over samples, and the range where samples differ).

    Args:
        result: A replay result ([`replay`][kvscope.replay.replay], [`open_result`][kvscope.open_result]).
    """
    lines = []
    for label, budgets in json.loads(result.attrs.get("press_settings", "{}")).items():
        for budget, settings in budgets.items():
            parts = []
            for key, values in settings.items():
                values = [v for v in values if v is not None]
                lo, hi, mean = min(values), max(values), sum(values) / len(values)
                spread = "" if lo == hi else f" ({lo:.4g}–{hi:.4g} by sample)"
                parts.append(f"{key} {mean:.4g}{spread}")
            lines.append(f"{label} at β = {budget}: kvpress {', '.join(parts)}")
    for label, note in json.loads(result.attrs.get("press_notes", "{}")).items():
        lines.append(
            f"{label} {note}; attn L1 and out err are not given offline (the recording holds no rewritten cache)"
        )
    return lines


def print_rows(rows: list[tuple[str, str]], title: str) -> None:
    """Print ``(quantity, value)`` rows of an analysis as a table (``kvscope analyze``).

    Args:
        rows: The rows.
        title: The table's title.
    """
    from rich.table import Table

    table = Table("quantity", "value", title=title)
    for k, v in rows:
        table.add_row(k, v)
    print_table(table)
