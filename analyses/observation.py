"""Observation study: how concentrated attention is, what a history-based selection misses
(FMM), how often importance comes back (Global LIR) and how much the selection churns — per
workload and per layer, on the default model.

    python analyses/observation.py [--context 1024]      → results/observation/{summary.md,summary.json,*.png}
    python analyses/observation.py --redraw              the figures again from results/observation/summary.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload_traces import add_arguments, ensure_traces, write_summary  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--redraw", action="store_true", help="only the figures, from the folder's summary.json")
    args = ap.parse_args()
    folder = Path(args.results) / "observation"
    if args.redraw:
        figures(json.loads((folder / "summary.json").read_text())["workloads"], folder)
        return

    import kvscope
    from kvscope import analysis as A

    folder.mkdir(parents=True, exist_ok=True)
    doc, rows = {}, []
    for name, path in ensure_traces(args).items():
        ds = kvscope.open_trace(path, chunks={})
        r = A.study(ds, [A.FMM(n_boot=500), A.Churn(n_boot=500), A.LIR(n_boot=500), A.Peaks()])
        conc = A.concentration(ds)
        fmm, churn, lir = r["fmm"], r["churn"], r["lir"]
        lir_any = A.lir(ds, h_lir=None, n_boot=500)  # short QA traces censor every H_lir = 8 window
        top10 = float(conc["top_share_mean"].sel(top_frac=0.1))
        need80 = float(conc["needed_mean"].sel(mass_level=0.8))
        doc[name] = {
            "fmm32": float(fmm["mean"]),
            "fmm32_ci": [float(fmm["ci_low"]), float(fmm["ci_high"])],
            "fmm_curve": dict(zip(map(int, fmm["horizon"].values), map(float, fmm["curve"].values))),
            "churn": float(churn["mean"]),
            "lir": float(lir["lir"]),
            "lir_ci": [float(lir["ci_low"]), float(lir["ci_high"])],
            "lir_any_time": float(lir_any["lir"]),
            "lir_any_time_ci": [float(lir_any["ci_low"]), float(lir_any["ci_high"])],
            "p01": float(lir["p01"]),
            "p10": float(lir["p10"]),
            "top10_mass": top10,
            "windows_for_80pct": need80,
            "fmm_layer": [float(x) for x in fmm["fmm_layer"].values],
            "churn_layer": [float(x) for x in churn["churn_layer"].values],
            "lir_layer": [float(x) for x in lir["lir_layer"].values],
            "samples": int(ds.sizes["sample"]),
            "steps": int(ds["n_steps"].values.sum()),
        }
        d = doc[name]

        def ci(value, bounds):
            if not np.isfinite(value):
                return "— (censored)"
            if not np.isfinite(bounds).all():
                return f"{value:.3f} (one prompt: no CI)"
            return f"{value:.3f} [{bounds[0]:.3f}, {bounds[1]:.3f}]"

        rows.append(
            f"| {name} | {d['samples']} / {d['steps']} | {ci(d['fmm32'], d['fmm32_ci'])} | {d['churn']:.3f} "
            f"| {ci(d['lir'], d['lir_ci'])} | {ci(d['lir_any_time'], d['lir_any_time_ci'])} "
            f"| {d['p01']:.3f} / {d['p10']:.3f} | {d['top10_mass']:.3f} | {d['windows_for_80pct']:.3f} |"
        )

    figures(doc, folder)
    markdown = [
        f"Default model ({args.model}), {args.context}-token prompts per workload, windows of 8 after 4 sinks, "
        "events every 8 steps, history oracle = top 20% of candidate windows by cumulative score with the newest "
        "64 tokens protected; 95% percentile-bootstrap CIs over the prompts (whole samples drawn with every layer "
        "and head; none where only one prompt has uncensored data). Global LIR with H_lir = 8 needs "
        "m + H_lir = 12 events after an episode starts; the question-answering workloads stop at their answer (EOS) "
        "after 6–12 events, so only H_lir = none (reactivation at any later event) is defined there.",
        "",
        "| workload | samples / steps | FMM@32 [95% CI] | churn | Global LIR, H_lir = 8 [95% CI] | LIR, H_lir = none | P01 / P10 | mass in top 10% windows | share of windows for 80% mass |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "![per layer](per_layer.png)",
        "",
        "![FMM curves](fmm_curves.png)",
    ]
    write_summary(folder, "Observation study", {"settings": vars(args), "workloads": doc}, markdown)


def figures(doc: dict, folder: Path) -> None:
    """per_layer.png and fmm_curves.png from the summary's per-workload numbers."""
    from kvscope.figures import axes, save

    fig, panels = axes(height=7.5, nrows=3)
    for name, d in doc.items():
        for ax, key in zip(panels, ("fmm_layer", "churn_layer", "lir_layer")):
            ax.plot(np.arange(len(d[key])), d[key], marker=".", label=name)
    for ax, title in zip(
        panels, ("FMM@32 of the top-20% history oracle", "selection churn", "Global LIR (m=4, H_lir=8)")
    ):
        ax.set_ylabel(title)
    panels[-1].set_xlabel("layer")
    panels[0].legend(ncol=len(doc))
    save(fig, folder / "per_layer.png")
    fig, ax = axes(width=6, height=4)
    for name, d in doc.items():
        hs = sorted(d["fmm_curve"], key=int)
        ax.plot([int(h) for h in hs], [d["fmm_curve"][h] for h in hs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("horizon H (steps)")
    ax.set_ylabel("FMM of the top-20% history oracle")
    fig.legend(loc="outside lower center", ncol=len(doc))
    save(fig, folder / "fmm_curves.png")


if __name__ == "__main__":
    main()
