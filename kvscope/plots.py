"""Figures for the analyses (matplotlib, headless). Each function takes an analysis
result Dataset and a file path and writes one figure."""

from __future__ import annotations

import numpy as np


def _figure(width=7.0, height=4.2, ncols=1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width, height), constrained_layout=True)


def _save(fig, path) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_fmm(result, path) -> None:
    """FMM(H) with its bootstrap CI band."""
    fig, ax = _figure()
    h = result["horizon"].values
    ax.plot(h, result["curve"].values, marker="o", label=f"FMM ({result.attrs['selection']})")
    ax.fill_between(h, result["curve_low"].values, result["curve_high"].values, alpha=0.25, label="95% CI")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("horizon H (steps)")
    ax.set_ylabel("future missed mass")
    ax.set_ylim(0, max(0.05, float(np.nanmax(result["curve_high"].values)) * 1.15))
    ax.set_title(f"Future Missed Mass, top {result.attrs['top_frac']:.0%} windows by history")
    ax.legend()
    _save(fig, path)


def plot_churn(result, path) -> None:
    fig, ax = _figure()
    ax.plot(result["event_step"].values, result["churn_over_time"].values, marker=".")
    ax.set_xlabel("step of the later event")
    ax.set_ylabel("Jaccard distance to previous selection")
    ax.set_title(f"Selection churn (mean {float(result['mean']):.3f})")
    _save(fig, path)


def plot_lir(result, path) -> None:
    fig, (ax1, ax2) = _figure(9, 4, ncols=2)
    ax1.bar(result["layer"].values, result["lir_layer"].values)
    ax1.axhline(float(result["lir"]), color="k", lw=1, ls="--", label=f"all layers {float(result['lir']):.3f}")
    ax1.set_xlabel("layer")
    ax1.set_ylabel("LIR (reactivated / eligible)")
    ax1.legend()
    ax2.bar(["P01 cold→hot", "P10 hot→cold"], [float(result["p01"]), float(result["p10"])])
    ax2.set_ylabel(f"lag-{result.attrs['delta']} transition probability")
    _save(fig, path)


def plot_peaks(result, path) -> None:
    """Log-log exposure-normalized peak density with the fitted power law and alternatives."""
    fig, ax = _figure()
    lo = result["bin_low"].values.astype(float)
    centers = lo * np.sqrt(2)
    dens = result["density"].values
    ok = np.isfinite(dens) & (dens > 0)
    ax.loglog(centers[ok], dens[ok], "o", label="peak density per position")
    alpha = float(result["alpha"])
    if np.isfinite(alpha) and ok.any():
        ref = centers[ok][0]
        scale = dens[ok][0] / ref ** (-alpha)
        ax.loglog(
            centers[ok],
            scale * centers[ok] ** (-alpha),
            "-",
            label=f"power law α={alpha:.2f} [{float(result['alpha_low']):.2f}, {float(result['alpha_high']):.2f}]",
        )
        lam = float(result["lambda"])
        if np.isfinite(lam):
            e_scale = dens[ok][0] / np.exp(-lam * ref)
            ax.loglog(centers[ok], e_scale * np.exp(-lam * centers[ok]), ":", label=f"exponential λ={lam:.3f}")
        ax.loglog(centers[ok], np.full(ok.sum(), np.nanmean(dens[ok])), "--", label="uniform")
    ax.set_xlabel("distance to the query d (log2 bins)")
    ax.set_ylabel("peaks per possible position")
    ax.set_title(f"Attention peaks (top-{result.attrs['k']}), best by AIC: {result.attrs['best_model']}")
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_concentration(result, path) -> None:
    fig, ax = _figure()
    p = np.asarray(result["top_frac"].values)
    ax.plot(p * 100, result["top_share_mean"].values, marker="o", label="mean over events and units")
    ax.plot([0, 100], [0, 1], color="gray", ls=":", label="uniform")
    ax.set_xlabel("top windows (%)")
    ax.set_ylabel("share of per-step mass")
    ax.set_title("Concentration of attention over windows")
    ax.legend()
    _save(fig, path)


def plot_drift(result, path, sample=0, layer=None, head=0) -> None:
    """Window-mass heatmap (step × window) of one unit with the selection overlaid."""
    hdim = "kv_head" if "kv_head" in result["mass"].dims else "head"
    layer = int(result["layer"].values[len(result["layer"]) // 2]) if layer is None else layer
    m = result["mass"].sel(layer=layer).isel(sample=sample, **{hdim: head}).values  # [step, window]
    sel = result["selection"].sel(layer=layer).isel(sample=sample, **{hdim: head}).values  # [event, window]
    fig, ax = _figure(8, 5)
    im = ax.imshow(np.log10(np.maximum(m.T, 1e-6)), aspect="auto", origin="lower", cmap="viridis")
    fig.colorbar(im, ax=ax, label="log10 window mass")
    ev, win = np.nonzero(sel == 1)
    ax.scatter(result["event_step"].values[ev], win, s=4, c="red", marker="s", label="selected (history top-ρ)")
    ax.set_xlabel("step")
    ax.set_ylabel("window")
    ax.set_title(f"Window mass, sample {sample}, layer {layer}, {hdim} {head}")
    ax.legend(loc="upper left", fontsize=8)
    _save(fig, path)


PLOTS = {
    "fmm": plot_fmm,
    "churn": plot_churn,
    "lir": plot_lir,
    "peaks": plot_peaks,
    "concentration": plot_concentration,
    "drift": plot_drift,
}


def plot_compare(result, path) -> None:
    """Replay comparison: FMM and output error against the bytes each policy really used
    (hollow markers: the policy could not fit β and used more), and tier-mass stacks."""
    has_err = "output_rel_l2_mean" in result
    fig, axes = _figure(width=15 if has_err else 10, height=4.4, ncols=3 if has_err else 2)
    budgets = result["budget"].values
    policies = list(result["policy"].values)

    def lines(ax, values_of, ylabel, title, with_ci=False):
        for p in policies:
            r = result.sel(policy=p)
            if str(r["policy_name"].values) == "full":
                continue  # the reference: 0 at 100% of the memory
            x = r["byte_ratio_used"].values
            y = values_of(r)
            line = ax.plot(x, y, marker="o", label=p)[0]
            if with_ci:
                ax.fill_between(
                    x, r["fmm_fp_ci_low"].values, r["fmm_fp_ci_high"].values, color=line.get_color(), alpha=0.15
                )
            floors = ~r["budget_reached"].values
            if floors.any():
                ax.plot(x[floors], y[floors], "o", markerfacecolor="white", color=line.get_color())
        ax.set_xlabel("bytes used (share of the full cache); hollow = could not fit β")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7)

    lines(
        axes[0],
        lambda r: r["fmm_fp_mean"].values,
        f"FMM@{result.attrs.get('horizon', 32)} (mass not at full precision)",
        "Future Missed Mass vs memory (full KV: 0)",
        with_ci=True,
    )
    if has_err:
        lines(
            axes[1],
            lambda r: r["output_rel_l2_mean"].values,
            "attention output relative L2 error",
            "Output error vs memory (full KV: 0)",
        )
    ax = axes[-1]
    tiers = result["tier_mean"].values  # [policy, budget, tier]
    width = 0.8 / len(budgets)
    colors = {"FP": "#4c72b0", "Q": "#dd8452", "EVICTED": "#c44e52"}
    for bi in range(len(budgets)):
        x = np.arange(len(policies)) + (bi - (len(budgets) - 1) / 2) * width
        bottom = np.zeros(len(policies))
        for ti, tier in enumerate(result["tier"].values):
            values = np.nan_to_num(tiers[:, bi, ti])
            ax.bar(
                x,
                values,
                width=width * 0.9,
                bottom=bottom,
                color=colors.get(str(tier)),
                label=str(tier) if bi == 0 else None,
            )
            bottom += values
    ax.set_xticks(np.arange(len(policies)), policies, fontsize=7, rotation=30)
    ax.set_ylabel("share of future attention mass")
    ax.set_title("Where the future mass sits (bars: β = " + ", ".join(f"{b:g}" for b in budgets) + ")", fontsize=9)
    ax.legend(fontsize=7)
    _save(fig, path)
