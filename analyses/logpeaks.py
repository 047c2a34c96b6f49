"""Log-peak study (LogQuant's observation): the distance decay α of attention peaks per layer
and workload with bootstrap CIs, the fit against exponential and uniform alternatives, and the
attention LogQuant's FP set covers versus a recency window of the same size.

    python analyses/logpeaks.py [--context 1024]          → results/logpeaks/{summary.md,summary.json,*.png}
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload_traces import add_arguments, ensure_traces, write_summary  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--layers-every", type=int, default=3, help="α with its CI for every n-th layer")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import kvscope
    from kvscope import analysis as A

    folder = Path(args.results) / "logpeaks"
    folder.mkdir(parents=True, exist_ok=True)
    doc, rows = {}, []
    fig, axes = plt.subplots(1, 2, figsize=(13, 4), constrained_layout=True)
    for name, path in ensure_traces(args).items():
        ds = kvscope.open_trace(path, chunks={})
        r = A.peaks(ds, n_boot=300)
        n_layers = ds.sizes["layer"]
        layers = list(range(0, n_layers, args.layers_every))
        per_layer = []
        for layer in layers:
            p = A.peaks(ds, layers=[layer], n_boot=200)
            per_layer.append([float(p["alpha"]), float(p["alpha_low"]), float(p["alpha_high"])])
        per_layer = np.array(per_layer)
        aic = dict(zip(r["model"].values.tolist(), map(float, r["aic"].values)))
        best = min(aic, key=aic.get)
        cov_lq = float(np.nanmean(r["coverage_logquant"].values))
        cov_rc = float(np.nanmean(r["coverage_recency"].values))
        doc[name] = {
            "alpha": float(r["alpha"]),
            "alpha_ci": [float(r["alpha_low"]), float(r["alpha_high"])],
            "aic": aic,
            "best_model": best,
            "alpha_layer": {str(layer): v.tolist() for layer, v in zip(layers, per_layer)},
            "coverage_logquant": cov_lq,
            "coverage_recency": cov_rc,
            "coverage_logquant_layer": [float(x) for x in r["coverage_logquant"].values],
            "coverage_recency_layer": [float(x) for x in r["coverage_recency"].values],
            "n_peaks": int(r["n_peaks"]),
        }
        rows.append(
            f"| {name} | {doc[name]['alpha']:.3f} [{doc[name]['alpha_ci'][0]:.3f}, {doc[name]['alpha_ci'][1]:.3f}] "
            f"| {best} (ΔAIC exp {aic['exponential'] - aic['power']:+.0f}, uniform {aic['uniform'] - aic['power']:+.0f}) "
            f"| {cov_lq:.3f} | {cov_rc:.3f} | {doc[name]['n_peaks']} |"
        )
        line = axes[0].errorbar(
            layers, per_layer[:, 0], yerr=[per_layer[:, 0] - per_layer[:, 1], per_layer[:, 2] - per_layer[:, 0]],
            marker="o", capsize=3, label=name,
        )  # fmt: skip
        color = line[0].get_color()
        axes[1].plot(doc[name]["coverage_logquant_layer"], color=color, label=f"{name}: LogQuant FP set")
        axes[1].plot(doc[name]["coverage_recency_layer"], color=color, linestyle="--", label=f"{name}: recency window")
    axes[0].axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    axes[0].set_xlabel("layer")
    axes[0].set_ylabel("α (peak density ∝ d^−α), 95% CI")
    axes[0].set_title("distance decay of attention peaks")
    axes[0].legend(fontsize=7)
    axes[1].set_xlabel("layer")
    axes[1].set_ylabel("non-sink attention covered")
    axes[1].set_title("LogQuant FP set (W = 32) vs a recency window of equal size")
    axes[1].legend(fontsize=6, ncol=2)
    fig.savefig(folder / "alpha_and_coverage.png", dpi=110)
    markdown = [
        f"Default model ({args.model}), {args.context}-token prompts; top-8 peaks per row (sinks and the query's own "
        "position excluded), exposure-normalized log2 histogram, discrete truncated power-law MLE with a bootstrap "
        "95% CI over the prompts (whole samples, every layer and head; with 2–3 prompts a rough one); AIC against exponential decay and uniform; coverage: mean share of a row's "
        "non-sink mass on LogQuant's FP set (W = 32) and on the same number of most recent positions. "
        "LogQuant's claim corresponds to α ≈ 1.",
        "",
        "| workload | α [95% CI] | best fit (AIC differences) | coverage LogQuant | coverage recency | peaks |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "![alpha and coverage](alpha_and_coverage.png)",
    ]
    write_summary(folder, "Log-peak study", {"settings": vars(args), "workloads": doc}, markdown)


if __name__ == "__main__":
    main()
