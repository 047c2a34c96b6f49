"""Figures of replay results (the figures of the analyses are their metrics' ``plot``
methods). Every function returns a matplotlib ``Figure`` in the project's style
(``kvscope.figures``) and saves nothing (``kvscope.figures.save`` does)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .figures import TIER_COLORS, mosaic, no_data, styled
from .figures import axes as figure_axes
from .report import task_accuracy, task_names

if TYPE_CHECKING:
    import xarray as xr
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_accuracy", "plot_allocation", "plot_compare", "plot_tiers", "run_lines"]

TASK_COLUMNS = 3  # accuracy panels per row
TASK_ROW_HEIGHT = 2.8  # inches per row of accuracy panels


@styled
def plot_compare(result: xr.Dataset, ax: Sequence[Axes] | None = None) -> Figure:
    """Replay comparison: FMM and output error against the bytes each policy really used
    (hollow markers: the policy could not fit β and used more), and tier-mass stacks.

    With answers (``replay --forced`` of a trace made with ``trace --dataset``), below them
    ``plot_accuracy``'s panels: accuracy against β per policy, one panel per task.

    Args:
        result: A replay result.
        ax: Draw into these axes: the FMM panel, one for output errors and one for forced replay's
            KL where the result has them, then the stacks, then one per task where the result has
            answers (default: a new figure, the line panels side by side above the stacks, the
            tasks' panels below, three to a row).

    Returns:
        The figure.
    """
    has_err = "output_rel_l2_mean" in result
    forced = "forced_kl_mean" in result
    top = ["fmm", *(["err"] if has_err else []), *(["kl"] if forced else [])]
    tasks = task_names(result)
    if ax is None:
        rows = _task_rows(tasks)
        fig, panels = mosaic(spanning([top, ["tiers"], *rows]), height=7.6 + TASK_ROW_HEIGHT * len(rows))
        axes = [panels[name] for name in (*top, "tiers", *(name for row in rows for name in row))]
    else:
        fig, axes = figure_axes(ax, ncols=len(top) + 1 + len(tasks))
    budgets = result["budget"].values
    runs = run_lines(result)

    def lines(ax, values_of, ylabel, title, ci=None, legend=False):
        for label, r in runs:
            if str(r["policy_name"].values) == "full":
                continue  # the reference: 0 at 100% of the memory
            x = r["byte_ratio_used"].values
            y = values_of(r)
            line = ax.plot(x, y, marker="o", label=label)[0]
            if ci is not None:
                low, high = r[f"{ci}_ci_low"].values, r[f"{ci}_ci_high"].values
                ax.fill_between(x, low, high, color=line.get_color(), alpha=0.15)
            floors = ~r["budget_reached"].values
            if floors.any():
                ax.plot(x[floors], y[floors], "o", markerfacecolor="white", color=line.get_color())
        ax.set_xlabel("bytes used (share of the full cache)\nhollow: could not fit β")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if legend:
            ax.legend()

    lines(
        axes[0],
        lambda r: r["fmm_fp_mean"].values,
        f"FMM@{result.attrs.get('horizon', 32)} (mass not at full precision)",
        "Future Missed Mass vs memory",
        ci="fmm_fp",
        legend=ax is not None,  # axes given: the legend in the first; else one for the figure, above the panels
    )
    if has_err:
        lines(
            axes[1],
            lambda r: r["output_rel_l2_mean"].values,
            "attention output relative L2 error",
            "Output error vs memory",
            legend=False,  # the same lines as beside it
        )
    if forced:
        lines(
            axes[len(top) - 1],
            lambda r: r["forced_kl_mean"].values,
            "KL(full ‖ policy), nats per step",
            "Model output under the cache (forced)",
            ci="forced_kl",
        )
    if ax is None:
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside upper center", ncol=min(len(runs), 4))
    ax = axes[len(top)]  # the stacks
    tiers = np.stack([r["tier_mean"].values for _, r in runs])  # [run, budget, tier]
    width = 0.8 / len(budgets)
    for bi in range(len(budgets)):
        x = np.arange(len(runs)) + (bi - (len(budgets) - 1) / 2) * width
        bottom = np.zeros(len(runs))
        for ti, tier in enumerate(result["tier"].values):
            values = np.nan_to_num(tiers[:, bi, ti])
            ax.bar(
                x,
                values,
                width=width * 0.9,
                bottom=bottom,
                color=TIER_COLORS.get(str(tier)),
                label=str(tier) if bi == 0 else None,
            )
            bottom += values
    ax.set_xticks(np.arange(len(runs)), [label for label, _ in runs], rotation=30, ha="right")
    ax.set_ylabel("share of future attention mass")
    ax.set_title("Where the future mass sits (bars: β = " + ", ".join(f"{b:g}" for b in budgets) + ")")
    ax.legend()
    if tasks:
        accuracy_panels(result, axes[len(top) + 1 :])
    return fig


@styled
def plot_accuracy(result: xr.Dataset, ax: Sequence[Axes] | None = None) -> Figure:
    """Task accuracy against β, one line per policy (under each allocation), one panel per task —
    the picture of kvpress's leaderboard, from forced replay of the gold answers
    (docs/concepts.md#task-accuracy): the band is the bootstrap CI over the task's samples, a
    hollow marker a run that could not fit β, the dashed line full KV's accuracy.

    Args:
        result: A replay result with answers (``kvscope replay --forced`` of a trace made with
            ``kvscope trace --dataset``).
        ax: Draw into these axes, one per task (``kvscope.report.task_accuracy``'s order; default: a
            new figure, three panels to a row).

    Returns:
        The figure (one panel saying why, for a result without answers).
    """
    tasks = task_names(result)
    if ax is None:
        rows = _task_rows(tasks) or [["none"]]
        fig, panels = mosaic(spanning(rows), height=1.2 + TASK_ROW_HEIGHT * len(rows))
        axes = [panels[name] for row in rows for name in row]
    else:
        axes = list(np.ravel(np.asarray(ax, dtype=object)))  # one Axes or a sequence of them
        fig = axes[0].figure
    if not tasks:
        no_data(axes[0], "no answers: replay --forced a trace made with trace --dataset")
        return fig
    accuracy_panels(result, axes)
    if ax is None:
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside upper center", ncol=min(len(labels), 4))
    return fig


def accuracy_panels(result: xr.Dataset, axes: Sequence[Axes]) -> None:
    """Into ``axes`` (one per task of ``kvscope.report.task_accuracy``): accuracy [95% CI] against β
    per run (``run_lines``; ``full`` is the dashed reference, as is ``answer_exact_full``).

    Args:
        result: A replay result with answers.
        axes: One axes per task.
    """
    table = task_accuracy(result)  # [policy, allocation, budget, task]
    budgets = table["budget"].values
    for k, ax in enumerate(axes):
        task = table.isel(task=k)
        full = _full_accuracy(task)
        for label, r in run_lines(result):
            if str(r["policy_name"].values) == "full":
                continue  # the reference line
            run = task.sel(policy=r["policy"].values, allocation=r["allocation"].values)
            y = run["accuracy"].values  # [budget]
            line = ax.plot(budgets, y, marker="o", label=label)[0]
            ax.fill_between(budgets, run["ci_low"].values, run["ci_high"].values, color=line.get_color(), alpha=0.15)
            floors = ~r["budget_reached"].values  # [budget]
            if floors.any():
                ax.plot(budgets[floors], y[floors], "o", markerfacecolor="white", color=line.get_color())
        reference = "" if np.isnan(full) else f", full KV {full:.2f}"
        if reference:
            ax.axhline(full, color="grey", linestyle="--", linewidth=1, label="full KV" if ax is axes[0] else None)
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("budget β")
        ax.set_ylabel("accuracy")
        n = int(task["n"])
        ax.set_title(f"{task['task'].item()}\n{n} sample{'s' if n != 1 else ''}{reference}")


def _full_accuracy(task: xr.Dataset) -> float:
    """Full KV's accuracy on one task: ``answer_exact_full``'s, else a ``full`` run's."""
    if np.isfinite(task["accuracy_full"]):
        return float(task["accuracy_full"])
    full = [p for p, name in zip(task["policy"].values, task["policy_name"].values, strict=True) if name == "full"]
    return float(task["accuracy"].sel(policy=full[0]).values.flat[0]) if full else float("nan")


def _task_rows(tasks: list[str]) -> list[list[str]]:
    """Panel names of the tasks, ``TASK_COLUMNS`` to a row."""
    names = [f"task {i}" for i in range(len(tasks))]
    return [names[i : i + TASK_COLUMNS] for i in range(0, len(names), TASK_COLUMNS)]


def spanning(rows: list[list[str]]) -> list[list[str]]:
    """Rows of panel names of different lengths as one ``mosaic`` layout: every name repeated so that
    the panels of a row share its width equally (``lcm`` of the rows' lengths columns).

    Args:
        rows: Rows of panel names.
    """
    n = math.lcm(*(len(row) for row in rows))
    return [[name for name in row for _ in range(n // len(row))] for row in rows]


def run_lines(result: xr.Dataset) -> list[tuple[str, xr.Dataset]]:
    """``(label, result of one policy under one allocation)`` per line of a figure: the policy's
    label, with ``/ allocation`` when the result holds any allocation but uniform.

    Args:
        result: A replay result.
    """
    allocations = [str(a) for a in result["allocation"].values]
    split = allocations != ["uniform"]
    return [
        (f"{p} / {a}" if split else str(p), result.sel(policy=p, allocation=a))
        for p in result["policy"].values
        for a in allocations
    ]


@styled
def plot_tiers(
    result: xr.Dataset,
    policy: str,
    budget: float,
    layer: int | None = None,
    sample: int | None = None,
    head: int = 0,
    ax: Axes | None = None,
    allocation: str = "uniform",
) -> Figure:
    """The tier of every position at every event (none, EVICTED, Q, FP) of one (policy,
    allocation, β) in one layer and KV head.

    Args:
        result: A replay result.
        policy: The run's policy label.
        budget: The run's β.
        layer: The layer (default: the middle one).
        sample: The sample (default: the longest).
        head: The KV head.
        ax: Draw into this axes (default: a new figure).
        allocation: The run's allocation label.

    Returns:
        The figure.
    """
    from matplotlib.colors import ListedColormap

    layer = int(result["layer"].values[result.sizes["layer"] // 2]) if layer is None else layer
    sample = int(np.argmax(result["full_bytes"].values)) if sample is None else sample
    tiers = result["tiers"].sel(policy=policy, allocation=allocation, budget=budget, layer=layer)
    tiers = tiers.isel(sample=sample, kv_head=head)
    length = int((tiers >= 0).sum("pos").max())
    fig, ax = figure_axes(ax, height=3.2)
    cmap = ListedColormap([TIER_COLORS[t] for t in ("none", "EVICTED", "Q", "FP")])
    im = ax.imshow(tiers.values[:, :length], aspect="auto", interpolation="nearest", cmap=cmap, vmin=-1.5, vmax=2.5)
    bar = fig.colorbar(im, ax=ax, ticks=[-1, 0, 1, 2])
    bar.ax.set_yticklabels(["none", "EVICTED", "Q", "FP"])
    ax.set_xlabel("position")
    ax.set_ylabel("event")
    ax.set_title(f"{policy} at β = {budget}, layer {layer}, kv head {head}")
    return fig


@styled
def plot_allocation(result: xr.Dataset, policy: str, budget: float, ax: Sequence[Axes] | None = None) -> Figure:
    """How each allocation split β's bytes over the layers for one policy (bytes per layer as
    a multiple of the uniform split; the band: the smallest to the largest KV head), and every
    policy's FMM under each allocation (FMM fp for a policy that never evicts; hatched where it
    cannot fit β).

    Args:
        result: A replay result with several allocations.
        policy: The policy whose splits are drawn.
        budget: The β drawn.
        ax: Draw into these 2 axes (default: a new figure).

    Returns:
        The figure.
    """
    from .report import unit_shares

    fig, axes = figure_axes(ax, height=7.2, nrows=2)
    ax = axes[0]
    layers = result["layer"].values
    for allocation in result["allocation"].values:
        shares = unit_shares(result, policy, str(allocation), budget)  # [layer, kv_head]
        line = ax.plot(layers, shares.mean("kv_head"), marker=".", label=str(allocation))[0]
        ax.fill_between(layers, shares.min("kv_head"), shares.max("kv_head"), color=line.get_color(), alpha=0.15)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xlabel("layer")
    ax.set_ylabel("bytes per unit × uniform")
    ax.set_title(f"{policy} at β = {budget:g}: the split (band: across KV heads)")
    ax.legend(ncol=len(result["allocation"]))
    ax = axes[1]
    allocations, policies = list(result["allocation"].values), list(result["policy"].values)
    width = 0.8 / len(allocations)
    quantizers = result["policy_kind"].values == "quantization"  # they evict nothing: FMM fp
    for ai, allocation in enumerate(allocations):
        run = result.sel(allocation=allocation, budget=budget)
        values = np.where(quantizers, run["fmm_fp_mean"].values, run["fmm_mean"].values)  # [policy]
        x = np.arange(len(policies)) + (ai - (len(allocations) - 1) / 2) * width
        bars = ax.bar(x, np.nan_to_num(values), width=width * 0.9, label=str(allocation))
        for bar, reached in zip(bars, run["budget_reached"].values, strict=True):
            if not reached:
                bar.set_hatch("//")
    labels = [f"{p}\n(FMM fp)" if q else p for p, q in zip(policies, quantizers, strict=True)]
    ax.set_xticks(np.arange(len(policies)), labels)
    ax.set_ylabel(f"FMM@{result.attrs.get('horizon', 32)}")
    ax.set_title(f"FMM by allocation at β = {budget:g} (hatched: the policy cannot fit β)")
    ax.legend(ncol=len(allocations))
    return fig
