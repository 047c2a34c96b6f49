"""Policy study: every policy × budget (5%, 10%, 20%, 30% of the full cache) replayed on each
workload's trace — byte ratio used, FMM@32 with CI, tier mass, attention and output errors,
churn, LIR — with the workload's task score of the full-KV generation where it has a scorer.

    python analyses/policies.py [--context 1024] [--budgets 0.05,0.1,0.2,0.3]
                                                        → results/policies/{summary.md,summary.json,*.png}
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload_traces import add_arguments, ensure_traces, task_scores, write_summary  # noqa: E402

POLICIES = ["full", "streaming", "h2o", "snapkv", "kivi", "logquant", "qevict", "oracle"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--budgets", default="0.05,0.1,0.2,0.3")
    ap.add_argument("--policies", default=",".join(POLICIES))
    args = ap.parse_args()

    import kvscope
    from kvscope.figures import save
    from kvscope.plots import plot_compare
    from kvscope.report import comparison

    folder = Path(args.results) / "policies"
    folder.mkdir(parents=True, exist_ok=True)
    budgets = [float(b) for b in args.budgets.split(",")]
    doc, markdown = {}, []
    markdown.append(
        f"Default model ({args.model}), {args.context}-token prompts, replay with `observe=renorm`, FMM horizon 32. "
        "Bytes: the peak share of the full cache at the final length; `(floor)`: the policy cannot fit the budget "
        "and reports what it used. FMM: future mass on evicted positions; FMM fp: not at full precision. Task "
        "scores are of the full-KV generation (a policy's own score needs live decoding under it)."
    )
    for name, path in ensure_traces(args).items():
        r = kvscope.replay(path, args.policies.split(","), budgets)
        rows = comparison(r)
        scores = task_scores(path)
        graded = [s for s in scores if s is not None]
        doc[name] = {"rows": rows, "full_kv_task_scores": scores}
        save(plot_compare(r), folder / f"{name}.png")
        markdown += [
            "",
            f"## {name}"
            + (f" — full-KV task score {sum(graded) / len(graded):.2f} over {len(graded)} samples" if graded else ""),
            "",
            "| policy | β | bytes used | FMM@32 [95% CI] | FMM fp | Q mass | attn L1 | out err | churn | LIR |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        fmt = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
        for row in rows:
            used = fmt(row["byte_ratio"]) + ("" if row["budget_reached"] else " (floor)")
            markdown.append(
                f"| {row['policy']} | {row['budget']:g} | {used} | {fmt(row['fmm'])} [{fmt(row['fmm_ci95'][0])}, "
                f"{fmt(row['fmm_ci95'][1])}] | {fmt(row['fmm_fp'])} | {fmt(row['q_mass'])} | {fmt(row['attn_l1'])} "
                f"| {fmt(row['output_rel_l2'])} | {fmt(row['churn'])} | {fmt(row['lir'])} |"
            )
        markdown += ["", f"![{name}]({name}.png)"]
    write_summary(folder, "Policy study", {"settings": vars(args), "budgets": budgets, "workloads": doc}, markdown)


if __name__ == "__main__":
    main()
