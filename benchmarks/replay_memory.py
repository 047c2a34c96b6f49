"""Replay memory: peak RSS of a replay at S and at 8·S decode steps, one (policy, budget)
state and the 8 policies × 3 budgets grid.

Two synthetic stores with the real schema (:func:`kvscope.storage.synthetic.write_synthetic_store`:
random rows, no q/k/v) share a long prompt ``P`` (default 2,048 tokens) and differ only in
the decode steps (``S`` = 128 and ``8·S`` = 1,024). Each configuration is replayed in a fresh
process, which first replays a tiny store (imports, compiled kernels), then records

    base    VmRSS before the replay (interpreter, libraries, the opened trace)
    peak    VmHWM at the end (the process's high-water mark)

and this prints ``peak`` and ``peak − base`` (what the replay itself adds) at S and 8·S with
their ratios. The configuration is one where the tiers would dominate if they were held:
``events × (P + S)`` per (layer, kv_head) and run grows 8 × 1.41 ≈ 11× from S to 8·S, while
what a replay does hold grows with the final length ``P + S`` (1.41×: each state's
``[layer, kv_head, pos]`` arrays, the FMM's cumulative sums, one block of rows) or with the
number of events, without a position axis (tier shares, FMM curve, churn, bytes per step).

    python benchmarks/replay_memory.py [--prompt-tokens 2048] [--steps 128] [--layers 8] [--kv-heads 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import record  # benchmarks/record.py: runs as data

POLICIES = ["full", "streaming", "h2o", "snapkv", "kivi", "logquant", "qevict", "oracle"]
BUDGETS = "0.2,0.35,0.5"
ONE_STATE = ("h2o", "0.35")

CHILD = """
import gc, json, sys, time
import kvscope

def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))

tiny, store, policies, budgets = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4].split(",")
budgets = [float(b) for b in budgets]
kvscope.replay(tiny, policies, budgets, n_boot=50)  # imports and compiled kernels, off the record
ds = kvscope.open_trace(store)
gc.collect()
base = status("VmRSS")
t0 = time.perf_counter()
r = kvscope.replay(ds, policies, budgets)
seconds = time.perf_counter() - t0
print(json.dumps({"base_kib": base, "peak_kib": status("VmHWM"), "seconds": seconds, "events": r.sizes["event"]}))
"""


def measure(tiny: Path, store: Path, policies: list[str], budgets: str) -> dict:
    """One configuration in a fresh process (its own high-water mark)."""
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tiny), str(store), ",".join(policies), budgets],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"replay of {store.name} with {policies} failed:\n{proc.stderr}")
    return json.loads(proc.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=128, help="S; the long store has 8·S")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    record.add_argument(ap)
    args = ap.parse_args()
    machine_info = record.machine()  # the load as the run begins

    from kvscope.storage.synthetic import write_synthetic_store

    P, S = args.prompt_tokens, args.steps
    shape = {"n_samples": 1, "n_layers": args.layers, "n_kv": args.kv_heads}
    configs = {"one state": ([ONE_STATE[0]], ONE_STATE[1]), "grid 8 × 3": (POLICIES, BUDGETS)}
    workdir = Path(tempfile.mkdtemp(prefix="kvscope-replay-memory-"))
    rows = []
    try:
        tiny = write_synthetic_store(workdir / "tiny.zarr", n_steps=16, prompt_len=24, **shape)
        stores = {n: write_synthetic_store(workdir / f"{n}.zarr", n_steps=n, prompt_len=P, **shape) for n in (S, 8 * S)}
        for name, (policies, budgets) in configs.items():
            short, long = (measure(tiny, stores[n], policies, budgets) for n in (S, 8 * S))
            rows.append({"configuration": name, "short": short, "long": long})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "prompt_tokens": P, "steps": [S, 8 * S], "layers": args.layers, "kv_heads": args.kv_heads,
        "final_length_ratio": (P + 8 * S) / (P + S), "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(), "rows": rows,
    }  # fmt: skip
    record.finish("replay_memory", args, report, machine_info)
    print(json.dumps(report, indent=1) if args.json else table(report))


def table(report: dict) -> str:
    S, S8 = report["steps"]
    mib = 1024
    title = (
        f"replay memory · synthetic trace, P = {report['prompt_tokens']} + S decode steps, {report['layers']} layers × "
        f"{report['kv_heads']} kv heads, no q/k/v · CPU, {report['cores']} cores · final length ×"
        f"{report['final_length_ratio']:.2f} from S = {S} to {S8}"
    )
    head = (
        f"{'configuration':<12} {'peak S':>9} {'peak 8S':>9} {'ratio':>6}   {'added S':>9} {'added 8S':>9} {'ratio':>6}"
        f"   {'time S':>7} {'time 8S':>7}"
    )
    lines = [title, head]
    for r in report["rows"]:
        a, b = r["short"], r["long"]
        added_a, added_b = a["peak_kib"] - a["base_kib"], b["peak_kib"] - b["base_kib"]
        lines.append(
            f"{r['configuration']:<12} {a['peak_kib'] / mib:>5.0f} MiB {b['peak_kib'] / mib:>5.0f} MiB "
            f"{b['peak_kib'] / a['peak_kib']:>6.2f}   {added_a / mib:>5.0f} MiB {added_b / mib:>5.0f} MiB "
            f"{added_b / added_a:>6.2f}   {a['seconds']:>6.1f}s {b['seconds']:>6.1f}s"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
