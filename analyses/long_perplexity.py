"""Perplexity versus position on long prose under each policy's cache — the StreamingLLM / H2O
evaluation, offline.

One trace of the default model teacher-forced on the bundled prose (``kvscope trace --workload
prose --context P --continuation-tokens N``: a prompt of ``P`` tokens, then the ``N`` tokens that
follow it in the text), then ``kvscope.replay(..., forced=True)`` of the policies at each budget:
per step the negative log-likelihood of the text's next token under the policy's cache, exactly as
decoding the text under that cache would give it. Reported: the perplexity of every window of
``--window`` positions along the text (the figure), and over the whole continuation (the table),
beside full KV's.

    python analyses/long_perplexity.py [--context 256] [--tokens 3840] [--budgets 0.1,0.25]
        [--policies streaming,h2o,kivi,logquant,qevict]
            → results/long_perplexity/summary.json, docs/long-perplexity.md, docs/figures/long_perplexity.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "results"


def trace(args, store: Path) -> float:
    import kvscope
    from kvscope import workloads

    prompts = workloads.prompts_for_model(
        "prose", args.model, context=args.context, seed=args.seed, samples=1, continuation_tokens=args.tokens
    )
    started = time.perf_counter()
    kvscope.trace(
        prompts, store, model=args.model, dtype="float32", force=True, block_steps=64, max_new_tokens=args.tokens
    )
    return time.perf_counter() - started


def windows(nll: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """``(centres, perplexity)`` of consecutive windows of ``width`` steps (the last may be shorter)."""
    starts = np.arange(0, len(nll), width)
    ppl = np.array([np.exp(np.nanmean(nll[a : a + width])) for a in starts])
    centres = np.array([a + min(width, len(nll) - a) / 2 for a in starts])
    return centres, ppl


def summarize(result, args, prompt_len: int) -> dict:
    """What the page and the figure show (and summary.json keeps)."""
    full_nll = None
    rows = []
    curves = {}
    for policy in result["policy"].values:
        for budget in result["budget"].values:
            r = result.sel(policy=policy, budget=budget, allocation="uniform")
            nll = r["forced_nll"].values[0]  # [step]
            if full_nll is None:
                full_nll = nll  # the same text under full KV: from any run, the reference's
            key = f"{policy}@{budget:g}"
            _centres, ppl = windows(nll, args.window)
            curves[key] = [float(x) for x in ppl]
            rows.append({
                "policy": str(policy), "budget": float(budget), "bytes": float(r["byte_ratio_used"]),
                "reached": bool(r["budget_reached"]), "perplexity": float(r["forced_perplexity"]),
                "kl": float(r["forced_kl_mean"]), "agreement": float(r["forced_agreement"]),
                "rounds": int(r["forced_rounds"].max()), "converged": bool(r["forced_converged"].all()),
            })  # fmt: skip
    return {
        "context": prompt_len,
        "tokens": int(result.sizes["step"]),
        "window": args.window,
        "perplexity_full": float(result["forced_perplexity_full"].values[0]),
        "positions": [float(prompt_len + c) for c in windows(np.zeros(result.sizes["step"]), args.window)[0]],
        "curves": curves,
        "rows": rows,
    }


def figure(doc: dict, path: Path, full_curve: list[float]) -> None:
    from kvscope.figures import axes, save

    budgets = sorted({r["budget"] for r in doc["rows"]})
    fig, panels = axes(height=3.6 * len(budgets) + 1.2, nrows=len(budgets))
    panels = panels if len(budgets) > 1 else [panels]
    x = doc["positions"]
    for ax, budget in zip(panels, budgets):
        ax.plot(x, full_curve, color="black", linewidth=2, label="full KV")
        for key, curve in doc["curves"].items():
            policy, b = key.rsplit("@", 1)
            if float(b) == budget and policy != "full":
                ax.plot(x, curve, marker="o", markersize=3, label=policy)
        ax.set_yscale("log")
        ax.set_xlabel("position in the text (tokens)")
        ax.set_ylabel(f"perplexity, windows of {doc['window']}")
        ax.set_title(f"β = {budget:g} of the full cache at {doc['context'] + doc['tokens']} tokens")
    handles, labels = panels[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(6, len(labels)))
    save(fig, path)


def page(doc: dict, meta: dict) -> str:
    lines = [
        "# Perplexity on long prose under each cache",
        "",
        (
            f"SmolLM2-135M-Instruct teacher-forced on the bundled prose: a {doc['context']}-token prompt, then the "
            f"{doc['tokens']} tokens that follow it in the text, each policy's cache at each budget — forced replay "
            "([how](replay.md#forced-replay-the-models-own-output-under-each-cache)), which gives the numbers decoding "
            "the text under each cache gives. Perplexity of the whole continuation under full KV: "
            f"**{doc['perplexity_full']:.2f}**."
        ),
        "",
        "![perplexity versus position](figures/long_perplexity.png)",
        "",
        "| policy | β | bytes used | perplexity | KL to full KV (nats/token) | top-1 agreement | rounds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        used = f"{r['bytes']:.3f}" + ("" if r["reached"] else " (floor)")
        rounds = f"{r['rounds']}" + ("" if r["converged"] else " (not converged)")
        lines.append(
            f"| {r['policy']} | {r['budget']:g} | {used} | {r['perplexity']:.2f} | {r['kl']:.4f} | "
            f"{r['agreement']:.3f} | {rounds} |"
        )
    lines += [
        "",
        (
            "Bytes used: the peak share of the full cache (full-precision entries at the model's float32, as a live "
            "cache holds them); (floor): the policy cannot fit β and used what the table says. Rounds: the most "
            "forwards one chunk of 64 steps took before its closed loop reached its fixed point."
        ),
        "",
        (
            f"Reproduce: `{meta['command']}` ({meta['machine']}; trace {meta['trace_s']:.0f} s, replay with forced "
            f"decodes {meta['replay_s']:.0f} s, of which forced {meta['forced_s']:.0f} s)."
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=3840, help="continuation tokens (the text that follows)")
    ap.add_argument("--budgets", default="0.1,0.25")
    ap.add_argument("--policies", default="streaming,h2o,kivi,logquant,qevict")
    ap.add_argument("--window", type=int, default=256, help="positions per perplexity window")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--doc", default=str(ROOT / "docs" / "long-perplexity.md"))
    ap.add_argument("--figure", default=str(ROOT / "docs" / "figures" / "long_perplexity.png"))
    args = ap.parse_args()
    import os
    import platform

    import kvscope

    folder = Path(args.results) / "long_perplexity"
    folder.mkdir(parents=True, exist_ok=True)
    store = folder / "trace.zarr"
    trace_s = trace(args, store)
    started = time.perf_counter()
    policies = ["full", *args.policies.split(",")]
    result = kvscope.replay(store, policies, [float(b) for b in args.budgets.split(",")], forced=True, errors=False)
    replay_s = time.perf_counter() - started
    prompt_len = int(kvscope.open_trace(store).kvscope.prompt_len[0])
    doc = summarize(result, args, prompt_len)
    full = next(v for k, v in doc["curves"].items() if k.startswith("full@"))
    doc["rows"] = [r for r in doc["rows"] if r["policy"] != "full"]
    meta = {
        "command": " ".join(["python analyses/long_perplexity.py", *sys.argv[1:]]),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "trace_s": trace_s,
        "replay_s": replay_s,
        "forced_s": json.loads(result.attrs["forced"])["seconds"],
    }
    (folder / "summary.json").write_text(json.dumps({**doc, "full_curve": full, **meta}, indent=1))
    figure(doc, Path(args.figure), full)
    Path(args.doc).write_text(page(doc, meta))
    print(page(doc, meta))


if __name__ == "__main__":
    main()
