"""Figures of replay results (the figures of the analyses are their metrics' ``plot``
methods). Every function returns a matplotlib ``Figure`` in the project's style
(``kvscope.figures``) and saves nothing (``kvscope.figures.save`` does)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .figures import TIER_COLORS, mosaic, styled
from .figures import axes as figure_axes

if TYPE_CHECKING:
    import xarray as xr
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_allocation", "plot_compare", "plot_tiers", "run_lines"]


@styled
def plot_compare(result: xr.Dataset, ax: Sequence[Axes] | None = None) -> Figure:
    """Replay comparison: FMM and output error against the bytes each policy really used
    (hollow markers: the policy could not fit β and used more), and tier-mass stacks.

    Args:
        result: A replay result.
        ax: Draw into these axes: the FMM panel, one for output errors and one for forced replay's
            KL where the result has them, then the stacks (default: a new figure, the line panels
            side by side above the stacks).

    Returns:
        The figure.
    """
    has_err = "output_rel_l2_mean" in result
    forced = "forced_kl_mean" in result
    top = ["fmm", *(["err"] if has_err else []), *(["kl"] if forced else [])]
    if ax is None:
        fig, panels = mosaic([top, ["tiers"] * len(top)], height=7.6)
        axes = [panels[name] for name in (*top, "tiers")]
    else:
        fig, axes = figure_axes(ax, ncols=len(top) + 1)
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
    ax = axes[-1]
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
    return fig


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
