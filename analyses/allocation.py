"""Allocation study: how β's bytes are split across layers and KV heads matters as much as the
policy. H2O, SnapKV, QEvict and LogQuant at β = 0.1 and 0.2 on every workload's trace, under
uniform, pyramid, adakv and oracle allocations (FMM@32, FMM fp, output error, the split per
layer); then ``kvscope tune`` on two policies, each checked live on held-out prompts of the
workload (a seed the traces did not use).

    python analyses/allocation.py [--context 1024] [--budgets 0.1,0.2] [--trials 50]
                                  → results/allocation/{summary.md,summary.json,*.png}
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload_traces import add_arguments, ensure_traces, write_summary  # noqa: E402

POLICIES = ["h2o", "snapkv", "qevict", "logquant"]
ALLOCATIONS = ["uniform", "pyramid", "adakv", "oracle"]
TUNED = [("h2o", "pyramid"), ("qevict", "uniform")]  # (policy, allocation) searched by kvscope tune


def fmt(x) -> str:
    return "—" if x is None else f"{x:.3f}"


def allocation_tables(name: str, rows: list[dict], budgets: list[float]) -> list[str]:
    """Markdown: FMM / output error per policy (rows) and allocation (columns), per budget."""
    out = []
    by = {(r["policy"], r["allocation"], r["budget"]): r for r in rows}
    for budget in budgets:
        out += [
            "",
            f"### {name}, β = {budget:g} — FMM@32 · output error (`(floor)`: the policy cannot fit β)",
            "",
            "| policy | " + " | ".join(ALLOCATIONS) + " |",
            "|---" * (len(ALLOCATIONS) + 1) + "|",
        ]
        for policy in POLICIES:
            cells = []
            for allocation in ALLOCATIONS:
                r = by[(policy, allocation, budget)]
                metric = r["fmm_fp"] if policy == "logquant" else r["fmm"]  # LogQuant evicts nothing: FMM fp
                floor = "" if r["budget_reached"] else " (floor)"
                cells.append(f"{fmt(metric)} · {fmt(r['output_rel_l2'])}{floor}")
            out.append(f"| {policy}{' (FMM fp)' if policy == 'logquant' else ''} | " + " | ".join(cells) + " |")
    return out


def tuned(path: Path, workload: str, budget: float, trials: int, samples: int | None) -> dict:
    """``kvscope tune`` of each (policy, allocation) in TUNED, checked live on held-out prompts."""
    from kvscope.tune import check_live, held_out, tune

    out = {}
    for policy, allocation in TUNED:
        t0 = time.perf_counter()
        result = tune(path, policy, budget, allocation=allocation, trials=trials)
        seconds = time.perf_counter() - t0
        source = workload if samples is None else f"{workload}:samples={samples}"
        held = held_out(path, source, result.allocation)
        result.check = check_live(result, path, source, held=held)
        out[f"{policy}/{allocation}"] = {**result.doc(), "search_seconds": seconds}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--budgets", default="0.1,0.2")
    ap.add_argument("--trials", type=int, default=50, help="configurations per kvscope tune")
    ap.add_argument("--tune-workload", default="niah", help="the trace tune searches on (niah: scored)")
    ap.add_argument("--check-samples", type=int, default=None, help="held-out prompts (default: as many as the trace)")
    args = ap.parse_args()

    import kvscope
    from kvscope.figures import save
    from kvscope.plots import plot_allocation
    from kvscope.report import comparison

    folder = Path(args.results) / "allocation"
    folder.mkdir(parents=True, exist_ok=True)
    budgets = [float(b) for b in args.budgets.split(",")]
    doc: dict = {"workloads": {}}
    markdown = [
        f"Default model ({args.model}), {args.context}-token prompts, replay with `observe=renorm`, FMM horizon 32, "
        f"budgets {', '.join(f'{b:g}' for b in budgets)}. Each cell: FMM@32 (future mass on evicted positions; "
        "LogQuant, which evicts nothing: FMM fp, the mass not at full precision) · attention-output relative L2 "
        "error. The oracle allocation minimises the policy's own FMM (FMM fp for LogQuant) at equal total bytes "
        "(docs/replay.md): a bound, not a causal method."
    ]
    traces = ensure_traces(args)
    for name, path in traces.items():
        t0 = time.perf_counter()
        r = kvscope.replay(path, POLICIES, budgets, allocations=ALLOCATIONS)
        seconds = time.perf_counter() - t0
        rows = comparison(r)
        doc["workloads"][name] = {"rows": rows, "replay_seconds": seconds}
        save(plot_allocation(r, "h2o", budgets[0]), folder / f"{name}.png")
        markdown += ["", f"## {name} (replay of all {len(rows)} runs: {seconds:.0f} s)"]
        markdown += allocation_tables(name, rows, budgets)
    if args.tune_workload in traces:
        doc["tune"] = tuned(traces[args.tune_workload], args.tune_workload, budgets[-1], args.trials, args.check_samples)
        markdown += ["", f"## kvscope tune on {args.tune_workload} at β = {budgets[-1]:g}, checked live", ""]
        markdown += [
            "| search | configs | s | default (offline) | best | best (offline) | live KL default → best | "
            "agreement default → best | score default → best | ranking held |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for key, t in doc["tune"].items():
            c = t["check"]
            held = {True: "yes", False: "**no**", None: "not judged (default at its floor)"}[c["held"]]
            score = f"{fmt(c['default']['score'])} → {fmt(c['best']['score'])}"
            markdown.append(
                f"| {key} | {len(t['trials'])} | {t['search_seconds']:.0f} | {fmt(t['default']['value'])} | "
                f"`{t['best']['policy']}` / `{t['best']['allocation']}` | {fmt(t['best']['value'])} | "
                f"{c['default']['kl']:.4f} → {c['best']['kl']:.4f} | "
                f"{c['default']['agreement']:.3f} → {c['best']['agreement']:.3f} | {score} | {held} |"
            )
    write_summary(folder, "Allocations: splitting β across layers and KV heads", doc, markdown)


if __name__ == "__main__":
    main()
