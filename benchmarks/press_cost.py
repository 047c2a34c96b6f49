"""What the presses that need the model cost offline, against ``kvscope run`` of the same grid.

On the default model, one prompt of real prose (``--prompt-tokens``, default 512) traced once with
q/k/v (fp32, ``--new-tokens`` steps, default 32), then for the presses that read more than q, k, v
(LeverageScore, Compactor, CriticalKV(SnapKV), KVzip) at every budget (default 0.2, 0.5):

    offline    kvscope.replay of the trace: the trace's model loaded once, the prompt prefilled
               once (KVzip's reconstruction once), every press and budget decided from that
    live       kvscope run's decodes per press and budget (the policy on its own tokens and fed
               the full-KV tokens; the full-KV decode once, shared), the model loaded once

and prints the wall time of each, the model forwards each ran, and their ratio.

    python benchmarks/press_cost.py [--prompt-tokens 512] [--new-tokens 32] [--budgets 0.2,0.5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import record  # benchmarks/record.py: runs as data

PRESSES = [
    "press:LeverageScorePress",
    "press:CompactorPress",
    "press:CriticalKVPress:press=SnapKVPress",
    "press:KVzipPress",
]


class Forwards:
    """Counts the forwards of a model's decoder (its ``model.model``)."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.model.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.n += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--budgets", default="0.2,0.5")
    ap.add_argument("--presses", default=",".join(PRESSES))
    ap.add_argument("--json", action="store_true")
    record.add_argument(ap)
    args = ap.parse_args()
    machine_info = record.machine()

    import kvscope
    from kvscope import workloads
    from kvscope.live import prepare
    from kvscope.live.run import full_decode, run_loaded
    from kvscope.model.loading import load, resolve
    from kvscope.model.prompts import encode
    from kvscope.replay import presses as replay_presses

    budgets = [float(b) for b in args.budgets.split(",")]
    presses = args.presses.split(",")
    prompt = workloads.prompts_for_model("prose", args.model, context=args.prompt_tokens, samples=1)[0]
    with tempfile.TemporaryDirectory(prefix="kvscope-press-cost-") as tmp:
        trace = Path(tmp) / "trace.zarr"
        kvscope.trace(
            [prompt], trace, model=args.model, max_new_tokens=args.new_tokens, stop_at_eos=False, record_qkv=True,
            dtype="float32",
        )  # fmt: skip
        replay_presses._loaded.cache_clear()  # the replay loads the trace's model: part of its cost
        started = time.perf_counter()
        result = kvscope.replay(trace, presses, budgets, n_boot=10)
        offline_s = time.perf_counter() - started
        offline_forwards = _offline_forwards(trace, presses, budgets)

    started = time.perf_counter()
    model, tokenizer = load(resolve(args.model))
    prepare(model)
    ids = encode(tokenizer, [prompt], False)[0]
    counter = Forwards(model)
    full = full_decode(model, ids, args.new_tokens)
    rows = []
    for press in presses:
        for budget in budgets:
            run_started = time.perf_counter()
            out = run_loaded(model, tokenizer, ids, press, budget, args.new_tokens, full=full)
            rows.append({"policy": press, "budget": budget, "seconds": round(time.perf_counter() - run_started, 2),
                         "kl": out.kl})  # fmt: skip
    live_s = time.perf_counter() - started
    report = {
        "model": args.model,
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "presses": presses,
        "budgets": budgets,
        "offline_seconds": round(offline_s, 2),
        "offline_forwards": offline_forwards,
        "live_seconds": round(live_s, 2),
        "live_forwards": counter.n,
        "live_over_offline": round(live_s / offline_s, 2),
        "reached": bool(result["budget_reached"].values.all()),
        "runs": rows,
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"{len(presses)} presses × {len(budgets)} budgets, {len(ids)}-token prompt, {args.new_tokens} new tokens")
        print(f"  offline (replay on the trace's model): {offline_s:7.1f} s, {offline_forwards} model forwards")
        print(f"  live (kvscope run of the same grid):   {live_s:7.1f} s, {counter.n} model forwards")
    record.finish("press_cost", args, report, machine_info)


def _offline_forwards(trace, presses, budgets) -> int:
    """The model forwards a replay of the grid runs (counted on a second, identical replay)."""
    import kvscope
    from kvscope.replay import presses as replay_presses

    model, _ = replay_presses.TraceModel.of(kvscope.open_trace(trace), str(trace), "bench").load()
    counter = Forwards(model)
    try:
        kvscope.replay(trace, presses, budgets, n_boot=10)
    finally:
        counter.handle.remove()
    return counter.n


if __name__ == "__main__":
    main()
