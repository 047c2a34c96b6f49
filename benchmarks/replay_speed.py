"""Replay speed: the whole policy × budget grid replayed offline vs one decode of the model,
each allocation's runs, and a ``kvscope tune`` search.

Records one trace (default model, a 1,024-token prompt of real prose + 128 new tokens, with
q/k/v), times a plain untraced decode of the same sequence (what re-running the model for
one policy would cost at least), then replays all 8 policies × 3 budgets in a fresh process
(attention and output errors included; each repeat in a fresh process after one small
warm-up replay, as the decode timing drops its first run; medians of ``--repeats``) and prints

    replay time / decode time      target ≤ 1.0 — the grid costs less than one decode,
                                   where re-decoding would cost 24 of them
    peak RSS of the replay process
    per allocation                 the policies (full excluded) × budgets under uniform, pyramid,
                                   adakv and oracle: seconds per run over one decode (the oracle
                                   replays the policy at each candidate capacity first)
    tune                           ``tune --trials 50`` (h2o under pyramid at the first budget):
                                   seconds over re-decoding 5 configurations (target < 1)

    python benchmarks/replay_speed.py [--prompt-tokens 1024] [--new-tokens 128] [--budgets 0.2,0.35,0.5]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import record  # benchmarks/record.py: runs as data

POLICIES = ["full", "streaming", "h2o", "snapkv", "kivi", "logquant", "qevict", "oracle"]

REPLAY = """
import json, sys, time
import kvscope
from kvscope.report import comparison
store, policies, budgets, observe = sys.argv[1], sys.argv[2].split(","), sys.argv[3], sys.argv[4]
t0 = time.perf_counter()
kvscope.replay(store, ["full"], [1.0], observe=observe)  # warm-up, as the decode's first run is
warm_up = time.perf_counter() - t0
t0 = time.perf_counter()
r = kvscope.replay(store, policies, [float(b) for b in budgets.split(",")], observe=observe)
seconds = time.perf_counter() - t0
# VmHWM: this process's own peak (ru_maxrss would carry the parent's peak across fork + exec);
# the largest peak of the worker processes the replay forked (sharing this one's pages until written)
import resource
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"seconds": seconds, "warm_up_seconds": warm_up, "rss_kib": max(hwm, workers), "rows": comparison(r),
                  "workers": r.attrs.get("replay_workers", "threads")}))
"""

ALLOCATIONS = """
import json, sys, time
import kvscope
from kvscope.tune import tune
store, policies, budgets, allocations, trials = sys.argv[1], sys.argv[2].split(","), sys.argv[3], sys.argv[4], int(sys.argv[5])
budgets = [float(b) for b in budgets.split(",")]
kvscope.replay(store, ["full"], [1.0])  # warm-up
out = {}
for allocation in allocations.split(","):
    t0 = time.perf_counter()
    kvscope.replay(store, policies, budgets, allocations=[allocation], errors=False)
    out[allocation] = time.perf_counter() - t0
t0 = time.perf_counter()
result = tune(store, "h2o", budgets[0], allocation="pyramid", trials=trials)
print(json.dumps({"allocations": out, "tune_seconds": time.perf_counter() - t0, "tune_trials": len(result.trials)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--budgets", default="0.2,0.35,0.5")
    ap.add_argument("--observe", default="renorm")
    ap.add_argument("--repeats", type=int, default=3, help="plain decodes and grid replays (medians)")
    ap.add_argument("--allocations", default="uniform,pyramid,adakv,oracle")
    ap.add_argument("--tune-trials", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    record.add_argument(ap)
    args = ap.parse_args()
    machine_info = record.machine()  # the load as the run begins

    import statistics

    import torch
    from trace_overhead import prose_prompt, untraced_decode

    from kvscope.cli import quiet_libraries
    from kvscope.model.loading import load, resolve
    from kvscope.model.prompts import Prompt
    from kvscope.tracing.runner import TraceSettings, trace_loaded

    quiet_libraries().__enter__()  # for the whole benchmark process
    source = resolve(args.model)
    model, tokenizer = load(source, "cpu")
    prompt = prose_prompt(tokenizer, args.prompt_tokens)
    input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    decodes = []
    for r in range(args.repeats + 1):  # the first one warms up
        model.set_attn_implementation("sdpa")
        prefill_s, decode_s, _ = untraced_decode(model, input_ids, args.new_tokens, lambda: None)
        if r:
            decodes.append((prefill_s, decode_s))
    plain_prefill = statistics.median(p for p, _ in decodes)
    plain_decode = statistics.median(d for _, d in decodes)

    workdir = Path(tempfile.mkdtemp(prefix="kvscope-replay-bench-"))
    try:
        store = workdir / "trace.zarr"
        settings = TraceSettings(model=args.model, max_new_tokens=args.new_tokens, stop_at_eos=False, record_qkv=True)
        t0 = time.perf_counter()
        trace_loaded(model, tokenizer, source, [Prompt(prompt, "pydoc_data")], out=store, settings=settings)
        traced_s = time.perf_counter() - t0
        del model
        runs = []
        for _ in range(args.repeats):  # each in a fresh process: its own peak RSS
            proc = subprocess.run(
                [sys.executable, "-c", REPLAY, str(store), ",".join(POLICIES), args.budgets, args.observe],
                capture_output=True,
                text=True,
                check=True,
                cwd=ROOT,
            )
            runs.append(json.loads(proc.stdout))
        replayed = {
            "seconds": statistics.median(r["seconds"] for r in runs),
            "all_seconds": [r["seconds"] for r in runs],
            "warm_up_seconds": statistics.median(r["warm_up_seconds"] for r in runs),
            "rss_kib": max(r["rss_kib"] for r in runs),
            "workers": runs[-1]["workers"],
            "rows": runs[-1]["rows"],
        }
        causal = [p for p in POLICIES if p != "full"]
        proc = subprocess.run(
            [sys.executable, "-c", ALLOCATIONS, str(store), ",".join(causal), args.budgets, args.allocations,
             str(args.tune_trials)],
            capture_output=True, text=True, check=True, cwd=ROOT,
        )  # fmt: skip
        allocated = json.loads(proc.stdout)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    n_budgets = len(args.budgets.split(","))
    one_decode = plain_prefill + plain_decode
    report = {
        "model": args.model,
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "prompt_tokens": int(input_ids.shape[1]),
        "new_tokens": args.new_tokens,
        "policies": POLICIES,
        "budgets": args.budgets,
        "observe": args.observe,
        "plain_prefill_s": plain_prefill,
        "plain_decode_s": plain_decode,
        "traced_with_qkv_s": traced_s,
        "replay_s": replayed["seconds"],
        "replay_all_s": replayed["all_seconds"],
        "replay_warm_up_s": replayed["warm_up_seconds"],
        "replay_over_one_decode": replayed["seconds"] / one_decode,
        "replay_over_decode_steps_only": replayed["seconds"] / plain_decode,
        "re_decoding_would_cost_s": one_decode * len(POLICIES) * n_budgets,
        "replay_peak_rss_mib": replayed["rss_kib"] / 1024,
        "replay_workers": replayed["workers"],
        "allocation_run_over_one_decode": {
            a: sec / ((len(POLICIES) - 1) * len(args.budgets.split(","))) / (plain_prefill + plain_decode)
            for a, sec in allocated["allocations"].items()
        },
        "allocation_seconds": allocated["allocations"],
        "tune_seconds": allocated["tune_seconds"],
        "tune_trials": allocated["tune_trials"],
        "tune_over_five_decodes": allocated["tune_seconds"] / (5 * (plain_prefill + plain_decode)),
        "rows": replayed["rows"],
    }
    record.finish("replay_speed", args, report, machine_info)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    grid = len(POLICIES) * n_budgets
    print(
        f"replay speed ({args.model}, cpu, {report['prompt_tokens']} + {args.new_tokens} tokens, q/k/v, "
        f"{len(POLICIES)} policies × {n_budgets} budgets = {grid} runs, observe={args.observe}):\n"
        f"  one plain decode      prefill {plain_prefill:.2f} s + decode {plain_decode:.2f} s = {one_decode:.2f} s\n"
        f"  replay of the grid    {replayed['seconds']:.2f} s  →  replay / one decode = "
        f"{report['replay_over_one_decode']:.3f}  (target ≤ 1.0; re-decoding: {grid} decodes = "
        f"{report['re_decoding_would_cost_s']:.0f} s)\n"
        f"                        replay / decode steps only = {report['replay_over_decode_steps_only']:.3f}\n"
        f"  replay peak RSS       {report['replay_peak_rss_mib']:.0f} MiB (per process; ran on {replayed['workers']})\n"
        f"  per run (policy × budget, errors off) over one decode, by allocation: "
        + ", ".join(f"{a} {r:.3f}" for a, r in report["allocation_run_over_one_decode"].items())
        + f"\n  tune, {report['tune_trials']} configurations: {report['tune_seconds']:.1f} s  →  over re-decoding 5 = "
        f"{report['tune_over_five_decodes']:.3f}  (target < 1)"
    )


if __name__ == "__main__":
    main()
