"""Task accuracy offline against live: an accuracy grid (policies × budgets × samples) scored by forced
replay of one trace, against the same grid through ``kvscope run``, side by side in one run.

The task: RULER's multi-query needles split into their questions. Each context is a
``niah_multiquery`` haystack (four word keys with a number each, hidden in essay prose) at the
context length; its four rows each ask for one key's number with RULER's singular template and
answer prefix ("What is the special magic number for KEY mentioned in the provided text?" /
" The special magic number for KEY mentioned in the provided text is"), the number the gold
answer. ``--contexts`` contexts × 4 questions are the samples, as a ``--dataset`` JSONL file
(chat template on), under the question-agnostic protocol (kvpress's default: each policy
compresses the context before any question, and the four questions share it).

    offline   kvscope.trace of the file (the gold answers forced; q/k/v recorded for the presses)
              then kvscope.replay(..., forced=True): answer_exact per (policy, β, sample)
    live      what ``kvscope run --dataset FILE --policy P --budget β`` does, per cell (run_prompts:
              per sample a full-KV, a free and a forced decode of --max-new-tokens), the model
              loaded once for the whole grid
    offline / live       trace + forced replay over the live grid (goal ≤ 0.1 at 1K, ≤ 0.05 at 4K);
                         also the forced replay alone (a trace is often made anyway)
    agreement            cells × samples where offline answer_exact = live answer_exact (goal: all)
    accuracy             per cell, offline and live, and full KV's

    python benchmarks/accuracy_grid.py [--context 1024,4096] [--contexts 5] [--policies …] [--budgets 0.2,0.3,0.5]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import record  # benchmarks/record.py: runs as data

POLICIES = (
    "h2o,qevict,kivi,logquant,streaming,press:SnapKVPress,press:KVzipPress,press:KeyRerotationPress:press=KnormPress,"
    "press:DecodingPress:base=KnormPress:compression_interval=2"
)
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = " The special magic number for {key} mentioned in the provided text is"


def dataset_rows(tokenizer, context: int, contexts: int, seed: int) -> list[dict]:
    """``contexts`` × 4 rows with kvpress's columns: each niah_multiquery context with its four keys
    asked one at a time."""
    from kvscope.workloads.builtin import prompts

    rows = []
    for prompt in prompts("niah_multiquery", tokenizer, context=context, seed=seed, samples=contexts, chat=True):
        for key, number in zip(prompt.meta["queries"], prompt.answers, strict=True):
            rows.append({"context": prompt.context, "question": QUESTION.format(key=key),
                         "answer_prefix": ANSWER_PREFIX.format(key=key), "answer": number, "task": "niah"})  # fmt: skip
    return rows


def offline(model, tokenizer, source, prompts, *, store: Path, policies, budgets, steps: int) -> dict:
    """Trace (gold answers forced) and forced replay: seconds and answer_exact per cell."""
    import kvscope
    from kvscope.tracing.runner import TraceSettings, trace_loaded

    settings = TraceSettings(model="smollm2-135m", max_new_tokens=steps, record_qkv=True, dtype="float32",
                             chat=True, question_agnostic=True)  # fmt: skip
    t0 = time.perf_counter()
    trace_loaded(model, tokenizer, source, prompts, out=store, settings=settings)
    trace_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = kvscope.replay(store, policies, budgets, forced=True, errors=False)
    replay_s = time.perf_counter() - t0
    exact = {
        (p, b): [int(x) for x in result["answer_exact"].isel(policy=i).sel(budget=b).values.ravel()]
        for i, p in enumerate(policies)  # the result's policy coordinate holds each policy's label, in this order
        for b in budgets
    }
    full = [int(x) for x in result["answer_exact_full"].values]
    return {"trace_s": trace_s, "replay_s": replay_s, "forced_s": json.loads(result.attrs["forced"])["seconds"],
            "exact": exact, "full": full, "labels": [str(p) for p in result["policy"].values]}  # fmt: skip


def live(model, tokenizer, prompts, *, policies, budgets, steps: int) -> dict:
    """``kvscope run``'s work per cell: seconds and answer_exact per cell."""
    from kvscope.live.inputs import live_policy
    from kvscope.live.run import run_prompts

    seconds, exact, full = {}, {}, None
    for p in policies:
        for b in budgets:
            t0 = time.perf_counter()
            results = run_prompts(model, tokenizer, prompts, policy=live_policy(p), budget=b, max_new_tokens=steps, chat=True,
                                  question_agnostic=True)  # fmt: skip
            seconds[p, b] = time.perf_counter() - t0
            exact[p, b] = [r.answer_exact for r in results]
            full = [r.answer_exact_full for r in results]
    return {"seconds": seconds, "exact": exact, "full": full}


def one_length(model, tokenizer, source, context: int, *, contexts: int, policies, budgets, steps: int, seed: int):
    from kvscope.model.dataset import load_dataset

    workdir = Path(tempfile.mkdtemp(prefix="kvscope-accuracy-bench-"))
    try:
        rows = dataset_rows(tokenizer, context, contexts, seed)
        path = workdir / "rows.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        prompts = load_dataset(path)
        off = offline(model, tokenizer, source, prompts, store=workdir / "trace.zarr", policies=policies, budgets=budgets,
                      steps=steps)  # fmt: skip
        on = live(model, tokenizer, prompts, policies=policies, budgets=budgets, steps=steps)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    live_s = sum(on["seconds"].values())
    offline_s = off["trace_s"] + off["replay_s"]
    cells = {
        f"{label}@{b:g}": {
            "live_s": round(on["seconds"][p, b], 3),
            "accuracy_offline": sum(off["exact"][p, b]) / len(rows),
            "accuracy_live": sum(on["exact"][p, b]) / len(rows),
            "disagreements": sum(a != c for a, c in zip(off["exact"][p, b], on["exact"][p, b])),
        }
        for p, label in zip(policies, off["labels"])
        for b in budgets
    }
    return {
        "context_tokens": context,
        "contexts": contexts,
        "samples": len(rows),
        "cells": len(cells),
        "live_grid_s": round(live_s, 3),
        "trace_s": round(off["trace_s"], 3),
        "replay_forced_s": round(off["replay_s"], 3),
        "forced_s": off["forced_s"],
        "offline_over_live": round(offline_s / live_s, 4),
        "replay_over_live": round(off["replay_s"] / live_s, 4),
        "agreement": sum(len(rows) - c["disagreements"] for c in cells.values()) / (len(rows) * len(cells)),
        "accuracy_full_offline": sum(off["full"]) / len(rows),
        "accuracy_full_live": sum(on["full"]) / len(rows),
        "per_cell": cells,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="1024,4096", help="context lengths in tokens")
    ap.add_argument("--contexts", type=int, default=5, help="contexts per length (4 questions each)")
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--budgets", default="0.2,0.3,0.5")
    ap.add_argument("--max-new-tokens", type=int, default=10, help="live decode steps per question")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    record.add_argument(ap)
    args = ap.parse_args()
    machine_info = record.machine()

    import torch

    model, tokenizer, source = record.default_model()
    policies, budgets = args.policies.split(","), [float(b) for b in args.budgets.split(",")]
    sizes = []
    for context in (int(x) for x in args.context.split(",")):
        s = one_length(model, tokenizer, source, context, contexts=args.contexts, policies=policies, budgets=budgets,
                       steps=args.max_new_tokens, seed=args.seed)  # fmt: skip
        sizes.append(s)
        print(f"  context {context:5d}  {s['samples']} samples × {s['cells']} cells  live grid {s['live_grid_s']:8.1f} s"
              f"  offline {s['trace_s'] + s['replay_forced_s']:7.1f} s  offline / live {s['offline_over_live']:.3f}"
              f"  (replay alone {s['replay_over_live']:.3f})  agreement {s['agreement']:.3f}", file=sys.stderr)  # fmt: skip
    report = {
        "model": "smollm2-135m",
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "task": "niah_multiquery, one key per question (4 questions per context)",
        "policies": policies,
        "budgets": budgets,
        "max_new_tokens": args.max_new_tokens,
        "sizes": sizes,
    }
    record.finish("accuracy_grid", args, report, machine_info)
    if args.json:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
