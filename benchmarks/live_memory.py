"""Live memory: what each policy's cache really holds while decoding, and what it costs in time.

On the default model, one prompt of real prose (``--prompt-tokens``, default 2,048) and
``--new-tokens`` (default 256) greedy forwards, side by side in one process:

    full KV        a plain DynamicCache with the model's own sdpa attention
    policy × β     a PolicyCache (kvscope attention, rows observed where the policy needs them)

and prints, per policy and budget β (default 10% and 20%):

    peak bytes / full      the cache's own tensors (codes + scale/zero + FP rows) at its peak,
                           over the full cache's tensors at the end (both at the model's dtype)
    serving / full         the served buffer: the keys/values attention reads, FP rows and Q
                           rows dequantized once, kept in place at the model's dtype
                           (``bytes_serving``: time bought with memory, reported apart)
    time / full            decode time (the same forwards) over the full-KV decode timed
                           right before it (``--pairs``, the default: a full-KV decode before
                           every policy's, so that a VM whose speed drifts divides like by
                           like; ``--no-pairs``: the first full-KV decode for all)
    agreement              share of identical greedy tokens with full KV

    python benchmarks/live_memory.py [--prompt-tokens 2048] [--new-tokens 256] [--budgets 0.1,0.2]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import record  # benchmarks/record.py: runs as data

POLICIES = ["streaming", "h2o", "snapkv", "kivi", "logquant", "qevict"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--budgets", default="0.1,0.2")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--pairs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time a full-KV decode right before each policy's (default)",
    )
    record.add_argument(ap)
    args = ap.parse_args()
    machine_info = record.machine()  # the load as the run begins

    import torch
    from transformers import DynamicCache

    from kvscope import workloads
    from kvscope.live import PolicyCache, prepare
    from kvscope.live.run import decode
    from kvscope.model.loading import load, resolve
    from kvscope.model.prompts import encode

    source = resolve(args.model)
    model, tokenizer = load(source)
    prompt = workloads.prompts_for_model("prose", args.model, context=args.prompt_tokens, samples=1)[0]
    ids = encode(tokenizer, [prompt], False)[0]
    S = args.new_tokens

    model.set_attn_implementation("sdpa")
    decode(model, ids[:64], DynamicCache(config=model.config), 4)  # warm-up
    cache = DynamicCache(config=model.config)
    full = decode(model, ids, cache, S)
    full_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)

    rows, full_seconds = [], [full.seconds]
    for name in args.policies.split(","):
        for budget in [float(b) for b in args.budgets.split(",")]:
            if args.pairs and rows:  # the first policy follows the first full-KV decode
                model.set_attn_implementation("sdpa")
                full_seconds.append(decode(model, ids, DynamicCache(config=model.config), S).seconds)
            prepare(model)
            live_cache = PolicyCache(model, name, budget, S)
            started = time.perf_counter()
            live = decode(model, ids, live_cache, S)
            seconds = time.perf_counter() - started
            rows.append(
                {
                    "policy": name,
                    "budget": budget,
                    "peak_bytes": max(live_cache.bytes_actual),
                    "peak_ratio": max(live_cache.bytes_actual) / full_bytes,
                    "index_bytes": max(live_cache.bytes_index),
                    "serving_ratio": max(live_cache.bytes_serving) / full_bytes,
                    "budget_reached": bool(live_cache.state.reached),
                    "time_ratio": seconds / full_seconds[-1],
                    "full_seconds": full_seconds[-1],
                    "seconds": seconds,
                    "agreement": sum(a == b for a, b in zip(live.tokens, full.tokens)) / S,
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    doc = {
        "model": args.model,
        "prompt_tokens": len(ids),
        "new_tokens": S,
        "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "full_bytes": full_bytes,
        "full_seconds": full_seconds,
        "pairs": args.pairs,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "rows": rows,
    }
    record.finish("live_memory", args, doc, machine_info)
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    print(
        f"live memory · {args.model} ({doc['model_dtype']}) · {len(ids)} + {S} tokens · "
        f"full KV {full_bytes / 2**20:.1f} MiB, decode {min(full_seconds):.1f}–{max(full_seconds):.1f} s"
        + (" (one before each policy)" if args.pairs else "")
    )
    print(f"{'policy':<10} {'β':>5} {'peak/full':>10} {'serving/full':>13} {'time/full':>10} {'agreement':>10}")
    for r in rows:
        floor = "" if r["budget_reached"] else "  (floor)"
        print(
            f"{r['policy']:<10} {r['budget']:>5.2f} {r['peak_ratio']:>10.3f} {r['serving_ratio']:>13.3f} {r['time_ratio']:>10.2f} "
            f"{r['agreement']:>10.3f}{floor}"
        )


if __name__ == "__main__":
    main()
