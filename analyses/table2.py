"""LogQuant's Table 2 as a whole: quantizing a selection vs evicting it, at equal memory.

LogQuant 2-bit, KIVI 2-bit and both *as eviction* (``evict=true``: the positions they would
quantize are dropped, the FP window refitted to the same bytes) replayed on each workload's
trace; attention L1 distance to full KV (the paper's measure), relative output error and FMM.
The paper's order: LogQuant < KIVI < LogQuant as eviction < KIVI as eviction.

    python analyses/table2.py [--context 1024] [--budgets 0.2,0.3]   → results/table2/{summary.md,summary.json}
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload_traces import add_arguments, ensure_traces, write_summary  # noqa: E402

POLICIES = ["logquant", "kivi", "logquant:evict=true", "kivi:evict=true"]
# the paper's Table 2 (§2.3): summed L1 distance to the original attention, Llama-3.1-8B on GSM8K
PAPER = {"logquant": 432.50, "kivi": 556.10, "logquant:evict=true": 1076.70, "kivi:evict=true": 1612.56}
NAMES = {
    "logquant": "LogQuant 2-bit",
    "kivi": "KIVI 2-bit",
    "logquant:evict=true": "LogQuant as eviction",
    "kivi:evict=true": "KIVI as eviction",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--budgets", default="0.2,0.3")
    args = ap.parse_args()

    import kvscope
    from kvscope.report import comparison

    budgets = [float(b) for b in args.budgets.split(",")]
    doc: dict = {}
    for name, path in ensure_traces(args).items():
        doc[name] = comparison(kvscope.replay(path, POLICIES, budgets))
    fmt = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
    markdown = [
        f"Default model ({args.model}), {args.context}-token prompts, replay with `observe=renorm`. attn L1: the "
        "first query after each event, L1 distance of its attention distribution to full KV (0–2), averaged over "
        "heads, events and samples; out err: relative L2 error of the attention output; FMM@32.",
        "",
        "| workload | β | " + " | ".join(NAMES.values()) + " | order holds |",
        "|---|---|" + "---|" * len(NAMES) + "---|",
    ]
    for name, rows in doc.items():
        for budget in budgets:
            by = {r["policy"]: r for r in rows if r["budget"] == budget}
            l1 = [by[p]["attn_l1"] for p in NAMES]
            cells = [f"{fmt(by[p]['attn_l1'])} / {fmt(by[p]['output_rel_l2'])} / {fmt(by[p]['fmm'])}" for p in NAMES]
            holds = all(a < b for a, b in zip(l1, l1[1:]))
            markdown.append(f"| {name} | {budget:g} | " + " | ".join(cells) + f" | {'yes' if holds else 'no'} |")
    paper = " | ".join(f"{PAPER[p]:.2f} ({PAPER[p] / PAPER['logquant']:.2f}×)" for p in NAMES)
    markdown += [f"| the paper (Llama-3.1-8B, GSM8K, summed L1) | — | {paper} | yes |", "",
                 "Cells: attn L1 / out err / FMM; the paper's row: its summed L1 (ratio to LogQuant 2-bit)."]  # fmt: skip
    write_summary(
        Path(args.results) / "table2", "LogQuant Table 2", {"settings": vars(args), "workloads": doc}, markdown
    )


if __name__ == "__main__":
    main()
