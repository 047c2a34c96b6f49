"""kvpress presses replayed at equal memory: FMM, output error and replay time per press on the
`prose` and `niah` traces, against kvscope's own policies and one decode of the model.

Each press runs through kvpress's own classes (policy ``press:…``; kvscope.policies.press),
its compression ratio set so that it holds the budget's bytes. Replay time: one press at all
budgets on all samples, per (budget, sample), over one plain decode of a sample (the median of
two decodes of sample 0 with the model's sdpa attention).

    python analyses/presses.py [--workloads prose,niah] [--budgets 0.1,0.2,0.3]
                                                         → results/presses/{summary.md,summary.json}
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from workload_traces import add_arguments, ensure_traces, write_summary  # noqa: E402

PRESSES = [
    "press:KnormPress",
    "press:StreamingLLMPress",
    "press:SnapKVPress",
    "press:TOVAPress",
    "press:ObservedAttentionPress",
    "press:KeyDiffPress",
    "press:ExpectedAttentionPress",
    "press:PyramidKVPress",
    "press:AdaKVPress:press=ExpectedAttentionPress",
    "press:DecodingPress:base_press=KnormPress:compression_interval=16",
]
OURS = ["streaming", "h2o", "snapkv", "qevict"]


def one_decode(path: Path) -> float:
    """Seconds of a plain greedy decode of sample 0 (prefill + its new tokens), median of two."""
    import torch
    from trace_overhead import untraced_decode

    import kvscope
    from kvscope.model.loading import load, resolve

    ds = kvscope.open_trace(path)
    p, n = int(ds["prompt_len"].values[0]), int(ds["n_steps"].values[0])
    model, _ = load(resolve(ds.attrs["settings"]["model"], allow_hub=False), "cpu")
    model.set_attn_implementation("sdpa")
    ids = torch.tensor(ds["tokens"].values[0, :p].astype("int64"))[None]
    runs = [sum(untraced_decode(model, ids, n, lambda: None)[:2]) for _ in range(3)][1:]  # the first warms up
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.set_defaults(workloads="prose,niah")
    ap.add_argument("--budgets", default="0.1,0.2,0.3")
    args = ap.parse_args()

    import json

    import kvscope
    from kvscope.report import comparison

    budgets = [float(b) for b in args.budgets.split(",")]
    doc: dict = {}
    for name, path in ensure_traces(args).items():
        decode_s = one_decode(path)
        n_samples = kvscope.open_trace(path).sizes["sample"]
        rows, seconds, settings = [], {}, {}
        for policy in PRESSES + OURS:
            t0 = time.perf_counter()
            result = kvscope.replay(path, [policy], budgets)
            seconds[str(result["policy"].values[0])] = (time.perf_counter() - t0) / (len(budgets) * n_samples)
            rows += comparison(result)
            settings.update(json.loads(result.attrs.get("press_settings", "{}")))
        doc[name] = {"rows": rows, "seconds_per_run": seconds, "one_decode_s": decode_s, "press_settings": settings}
    write_summary(Path(args.results) / "presses", "kvpress presses", {"settings": vars(args), "workloads": doc},
                  markdown(doc, budgets, args))  # fmt: skip


def markdown(doc: dict, budgets: list[float], args) -> list[str]:
    fmt = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
    lines = [
        f"Default model ({args.model}), {args.context}-token prompts, replay with `observe=renorm`. Each cell: "
        "FMM@32 / output error (relative L2 of the attention output); `*`: the policy cannot reach β and runs at "
        "its floor (a prompt press keeps every decode token, which alone exceed 10 % of the final length on `prose`; "
        "DecodingPress never compresses the prompt). kvpress setting: the compression ratio (DecodingPress: its "
        "target size in tokens), mean over samples, that holds β's bytes. Replay time: one run (a policy at one β "
        "on one sample) over one plain decode of a sample.",
    ]
    for name, entry in doc.items():
        lines += [
            "",
            f"## {name} (one decode: {entry['one_decode_s']:.2f} s)",
            "",
            "| policy | " + " | ".join(f"β = {b:g}" for b in budgets) + " | kvpress setting at β = "
            + " / ".join(f"{b:g}" for b in budgets) + " | replay / decode |",
            "|---|" + "---|" * len(budgets) + "---|---|",
        ]  # fmt: skip
        by = {(r["policy"], r["budget"]): r for r in entry["rows"]}
        for label, per_run in entry["seconds_per_run"].items():
            cells = []
            for b in budgets:
                r = by[(label, b)]
                cells.append(f"{fmt(r['fmm'])} / {fmt(r['output_rel_l2'])}" + ("" if r["budget_reached"] else " *"))
            setting = entry["press_settings"].get(label, {})
            shown = []
            for b in budgets:
                values = next(iter(setting.get(f"{b:g}", {}).values()), None)
                shown.append("—" if not values else f"{sum(values) / len(values):.3g}")
            lines.append(
                f"| `{label}` | " + " | ".join(cells) + f" | {' / '.join(shown)} | "
                f"{per_run / entry['one_decode_s']:.3f} |"
            )
    return lines


if __name__ == "__main__":
    main()
