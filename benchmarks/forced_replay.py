"""Forced replay's cost: the model's output under each policy's cache computed offline
(``kvscope replay --forced``) against decoding it live (``kvscope run`` per cell), side by side.

For each prompt size and number of steps ``S``: one trace of the default model (prose from the
standard library, ``S`` greedy steps), then the grid (``--policies`` × ``--budgets``)

    live     what ``kvscope run`` does per cell: a full-KV decode, the policy's free decode and its
             teacher-forced decode (3 × S forwards); the cells one after another in this process,
             the model loaded once
    forced   ``kvscope.replay(..., forced=True)``: the forced phase alone (the result's
             ``forced.seconds``: model loaded, one prefill and one full-KV reference per sample, each
             run's chunks in rounds until its closed loop converges) and the whole replay
    forced / live                  target ≤ 0.1 on a CPU
    one budget                     the same at the middle budget alone (forced replay of that budget
                                   against the live cells of it): the prefill and the full-KV
                                   reference, a fixed cost per sample, shared by fewer cells
    KL agreement                   per cell, forced mean KL − live mean KL (nats; the same decode)

The grid by default: the four policies at the offline-vs-live study's budgets, 0.2, 0.3 and 0.5.

    python benchmarks/forced_replay.py [--prompts 1024,4096] [--steps 32,128,512] [--policies …] [--budgets 0.2,0.3,0.5]
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

POLICIES = "press:SnapKVPress,streaming,h2o,qevict"


def live_grid(model, tokenizer, ids: list[int], policies: list[str], budgets: list[float], steps: int) -> dict:
    """``kvscope run``'s work per cell, timed: {(policy, budget): (seconds, mean KL)}."""
    from kvscope.live.run import run_loaded

    out = {}
    for policy in policies:
        for budget in budgets:
            t0 = time.perf_counter()
            result = run_loaded(model, tokenizer, ids, policy, budget, steps)
            out[policy, budget] = (time.perf_counter() - t0, result.kl)
    return out


def one_size(model, tokenizer, source, prompt_tokens: int, steps: int, policies, budgets, chunk: int) -> dict:
    from trace_overhead import prose_prompt

    import kvscope
    from kvscope.live.cache import prepare
    from kvscope.model.prompts import Prompt
    from kvscope.replay.forced import check_forced
    from kvscope.tracing.runner import TraceSettings, trace_loaded

    check_forced(chunk, 8)
    prompt = prose_prompt(tokenizer, prompt_tokens)
    workdir = Path(tempfile.mkdtemp(prefix="kvscope-forced-bench-"))
    try:
        store = workdir / "trace.zarr"
        settings = TraceSettings(model="smollm2-135m", max_new_tokens=steps, stop_at_eos=False,
                                 record_qkv=any(p.startswith("press:") for p in policies), dtype="float32")  # fmt: skip
        trace_loaded(model, tokenizer, source, [Prompt(prompt, "pydoc_data")], out=store, settings=settings)
        ds = kvscope.open_trace(store)
        ids = [int(x) for x in ds["tokens"].values[0, : int(ds.kvscope.prompt_len[0])]]
        t0 = time.perf_counter()
        result = kvscope.replay(store, policies, budgets, forced=True, forced_chunk=chunk, errors=False)
        replay_s = time.perf_counter() - t0
        forced = json.loads(result.attrs["forced"])
        middle = budgets[len(budgets) // 2]
        alone = kvscope.replay(store, policies, [middle], forced=True, forced_chunk=chunk, errors=False)
        alone_s = json.loads(alone.attrs["forced"])["seconds"]
        prepare(model)
        live = live_grid(model, tokenizer, ids, policies, budgets, steps)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    live_s = sum(s for s, _ in live.values())
    live_middle_s = sum(s for (_, b), (s, _) in live.items() if b == middle)
    cells = {
        f"{p}@{b:g}": {
            "live_s": round(live[p, b][0], 3),
            "live_kl": live[p, b][1],
            "forced_kl": float(result["forced_kl_mean"].sel(policy=p, budget=b).values[0]),
            "rounds": int(result["forced_rounds"].sel(policy=p, budget=b).max()),
        }
        for p in result["policy"].values
        for b in budgets
    }
    return {
        "prompt_tokens": len(ids),
        "steps": steps,
        "cells": len(cells),
        "live_grid_s": round(live_s, 3),
        "forced_s": forced["seconds"],
        "replay_forced_s": round(replay_s, 3),
        "forced_over_live": round(forced["seconds"] / live_s, 4),
        "replay_forced_over_live": round(replay_s / live_s, 4),
        "one_budget": {"budget": middle, "cells": len(policies), "forced_s": alone_s,
                       "live_s": round(live_middle_s, 3), "forced_over_live": round(alone_s / live_middle_s, 4)},
        "max_kl_difference": max(abs(c["forced_kl"] - c["live_kl"]) for c in cells.values()),
        "per_cell": cells,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="1024,4096", help="prompt sizes in tokens")
    ap.add_argument("--steps", default="32,128,512", help="decode steps S")
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--budgets", default="0.2,0.3,0.5")
    ap.add_argument("--chunk", type=int, default=64, help="forced replay's steps per forward")
    ap.add_argument("--json", action="store_true")
    record.add_argument(ap)
    args = ap.parse_args()
    machine_info = record.machine()

    import torch

    model, tokenizer, source = record.default_model()
    policies, budgets = args.policies.split(","), [float(b) for b in args.budgets.split(",")]
    sizes = []
    for prompt_tokens in (int(x) for x in args.prompts.split(",")):
        for steps in (int(x) for x in args.steps.split(",")):
            sizes.append(one_size(model, tokenizer, source, prompt_tokens, steps, policies, budgets, args.chunk))
            s = sizes[-1]
            print(f"  P {s['prompt_tokens']:5d}  S {steps:4d}  live grid {s['live_grid_s']:8.1f} s  forced "
                  f"{s['forced_s']:7.1f} s  forced / live {s['forced_over_live']:.3f}  (whole replay "
                  f"{s['replay_forced_over_live']:.3f}; one budget {s['one_budget']['forced_over_live']:.3f})  "
                  f"|ΔKL| ≤ {s['max_kl_difference']:.1e}", file=sys.stderr)  # fmt: skip
    report = {
        "model": "smollm2-135m",
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "policies": policies,
        "budgets": budgets,
        "chunk": args.chunk,
        "sizes": sizes,
        "forced_over_live_max": max(s["forced_over_live"] for s in sizes),
    }
    record.finish("forced_replay", args, report, machine_info)
    if args.json:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
