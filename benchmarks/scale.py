"""Scale: kvscope at Llama-3.1-8B geometry (32 layers, 32 query / 8 KV heads, head_dim 128),
prompts of 4K–32K tokens, 256 decode steps, window resolution (w = 16) with q/k/v recorded.

For each context length a synthetic store with the real schema is written
(:func:`kvscope.storage.synthetic.write_geometry_store`) and measured:

    disk        bytes on disk, and raw (every array at its dtype, uncompressed)
    analysis    FMM over the window rows, time vs a plain read of the same rows (ratio)
    replay      8 policies × 3 budgets, in a fresh process (rows recomputed from q/k per task,
                tasks of as many layers as 2 GiB holds; the process forks 2 workers for them,
                replay's default): time, time per step and per 1K positions, the largest peak
                RSS of the process and its workers; then the same on a 2-worker LocalCluster:
                time and the largest peak RSS of a worker and of the client

and how each cost grows with context (per step, relative to the smallest context: ≤ the
context ratio is at most linear). Goal: the 32K grid completes with peak RSS ≤ 8 GB per process.

    python benchmarks/scale.py [--contexts 4096,8192,16384,32768] [--steps 256] [--workers 2]
                               [--layers 32] [--folder DIR] [--json]
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import record  # benchmarks/record.py: runs as data

POLICIES = "full,streaming,h2o,snapkv,kivi,logquant,qevict,oracle"
BUDGETS = "0.2,0.35,0.5"

CHILD = """
import json, sys, time
import kvscope

def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))

store, policies, budgets, workers = sys.argv[1], sys.argv[2].split(","), [float(b) for b in sys.argv[3].split(",")], int(sys.argv[4])
client = cluster = None
if workers:
    from distributed import Client
    from kvscope.cluster import local_cluster
    cluster = local_cluster(workers, memory_limit=0)
    client = Client(cluster)
    client.run(lambda: __import__("kvscope.replay"))
t0 = time.perf_counter()
r = kvscope.replay(store, policies, budgets, client=client, n_boot=100)
seconds = time.perf_counter() - t0
fmm = {p: float(r["fmm_mean"].sel(policy=p, budget=budgets[0]).values.ravel()[0]) for p in policies}
if client:
    worker_kib = max(client.run(lambda: status("VmHWM")).values())
else:  # the worker processes the replay forked (replay_workers forked:N), reaped by now
    import resource
    worker_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"seconds": seconds, "peak_kib": max(status("VmHWM"), worker_kib), "worker_peak_kib": worker_kib,
                  "fmm": fmm, "workers": r.attrs.get("replay_workers", "")}))
"""


def measure_replay(store: Path, workers: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(store), POLICIES, BUDGETS, str(workers)],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"replay of {store.name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def raw_bytes(path: Path) -> int:
    import zarr

    g = zarr.open_group(str(path), mode="r")
    return sum(a.nbytes for _, a in g.arrays())


def measure_analysis(path: Path) -> dict:
    """FMM over the window rows vs reading them (both stream the same chunks)."""
    import kvscope
    from kvscope.analysis import FMM

    ds = kvscope.open_trace(path, chunks={})
    t0 = time.perf_counter()
    ds["attn"].data.sum().compute()
    read = time.perf_counter() - t0
    t0 = time.perf_counter()
    FMM(n_boot=100)(ds)
    fmm = time.perf_counter() - t0
    return {"read_seconds": read, "fmm_seconds": fmm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,8192,16384,32768")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--layers", type=int, default=32, help="fewer for a quick check of the script")
    ap.add_argument("--folder", default=None, help="where the stores go (default: a temporary folder, removed)")
    ap.add_argument("--json", action="store_true")
    record.add_argument(ap)
    args = ap.parse_args()
    machine_info = record.machine()  # the load as the run begins

    from kvscope.storage.synthetic import write_geometry_store

    folder = Path(args.folder or tempfile.mkdtemp(prefix="kvscope-scale-"))
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for context in [int(c) for c in args.contexts.split(",")]:
            path = folder / f"scale-{context}.zarr"
            shutil.rmtree(path, ignore_errors=True)
            t0 = time.perf_counter()
            write_geometry_store(path, prompt_len=context, n_steps=args.steps, n_layers=args.layers)
            row = {"context": context, "write_seconds": time.perf_counter() - t0}
            row |= {"disk_bytes": disk_bytes(path), "raw_bytes": raw_bytes(path)}
            row |= measure_analysis(path)
            row["in_process"] = measure_replay(path, 0)
            if args.workers:
                row["cluster"] = measure_replay(path, args.workers)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            shutil.rmtree(path, ignore_errors=True)
    finally:
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)
    report = {
        "steps": args.steps, "layers": args.layers, "workers": args.workers, "policies": POLICIES, "budgets": BUDGETS,
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "rows": rows,
    }  # fmt: skip
    record.finish("scale", args, report, machine_info)
    print(json.dumps(report, indent=1) if args.json else table(report))


def table(report: dict) -> str:
    gib = 2**30
    rows = report["rows"]
    first = rows[0]
    title = (
        f"scale · Llama-3.1-8B geometry ({report['layers']} layers, 32/8 heads, D 128), window rows w = 16 + q/k/v, "
        f"{report['steps']} steps · replay {len(report['policies'].split(','))} policies × 3 budgets · "
        f"CPU, {report['cores']} cores"
    )
    head = (
        f"{'context':>7} {'disk':>8} {'raw':>8} {'fmm/read':>8} {'replay':>8} {'peak':>8} {'/step·1K':>9} "
        f"{'growth':>7} {'cluster':>8} {'worker':>8}"
    )
    lines = [title, head]
    for r in rows:
        rp, cl = r["in_process"], r.get("cluster")
        per = rp["seconds"] / report["steps"] / (r["context"] / 1024)
        growth = (rp["seconds"] / first["in_process"]["seconds"]) / (r["context"] / first["context"])
        lines.append(
            f"{r['context']:>7} {r['disk_bytes'] / gib:>6.2f}G {r['raw_bytes'] / gib:>6.2f}G "
            f"{r['fmm_seconds'] / r['read_seconds']:>8.2f} {rp['seconds']:>7.0f}s {rp['peak_kib'] / 2**20:>6.2f}G "
            f"{per * 1000:>7.1f}ms {growth:>7.2f} "
            + (f"{cl['seconds']:>7.0f}s {cl['worker_peak_kib'] / 2**20:>6.2f}G" if cl else "")
        )
    lines.append(
        "fmm/read: analysis time / plain read of the rows; /step·1K: replay seconds per step per 1K positions; "
        "growth: replay time ratio / context ratio vs the first row (≤ 1: at most linear)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
