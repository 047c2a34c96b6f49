"""Analysis throughput and memory on synthetic stores larger than a few GB, on one process and on dask.

For each size, a synthetic token-resolution store (random rows with sinks, real schema,
fp16, blosc-zstd) is written once, then — in a fresh subprocess, so that peak RSS is the
analysis's own — FMM + churn + LIR + peaks run over it (`kvscope.analysis.study`, one
streaming read) and are timed against a plain chunked read of the same `attn` array
(every chunk read and decompressed, nothing computed). Each is measured in its own fresh
process (so each peak RSS is its own), interleaved read, analysis, read, analysis; the
second pair is reported (warm page cache), each the median of ``--repeats`` after one
untimed call in the same process (which loads numba's compiled kernels; its time is
reported as ``analysis_first_call_s``). With ``--dask N`` the analyses also run on a local
dask.distributed cluster of N single-threaded worker processes (``kvscope … --dask local:N``),
timed against the single process and checked to give the same numbers.

``--chunks analysis`` opens the store as ``kvscope analyze`` does (``open_trace(chunks="analysis")``:
several stored blocks of steps per task, one zarr call each) for both sides; the default reads
the store's own chunks.

Both sides say what they read — the array's shape and the rows that hold a probability at
position 0 (the read counts them; the analyses' peaks count the rows they scanned) — and the
benchmark stops with exit 1, recording nothing, where they disagree. Each run is appended to
``benchmarks/results/analysis_throughput.jsonl`` (``--no-record``: not).

    python benchmarks/analysis_throughput.py --sizes 0.5 2 [--dask 2] [--dir /tmp/kvscope-bench]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # benchmarks/record.py: runs as data

SHAPE = {"n_layers": 16, "n_kv": 4, "prompt_len": 3584, "n_steps": 512}  # 268 MB of fp16 rows per sample


def bytes_per_sample() -> int:
    T = SHAPE["prompt_len"] + SHAPE["n_steps"]
    return SHAPE["n_steps"] * SHAPE["n_layers"] * SHAPE["n_kv"] * T * 2


def measure(path: str, repeats: int, what: str, chunks: str = "store") -> dict:
    """In a fresh process: time ``what`` (plain read, or the analyses) and its peak RSS
    (``VmHWM`` of this process: ``ru_maxrss`` would carry the parent's peak across exec)."""
    import dask
    import dask.array as dsa

    import kvscope
    from kvscope.analysis import study

    dask.config.set(scheduler="threads")
    ds = kvscope.open_trace(path, chunks={} if chunks == "store" else chunks)
    attn = ds["attn"].data
    rss_before = _peak_rss_mb()
    client = None
    if what.startswith("dask:"):
        from distributed import Client

        from kvscope.cluster import local_cluster

        client = Client(local_cluster(int(what.split(":")[1])))

    def plain_read():  # every chunk is fetched and decoded; the rows holding position 0 counted
        return {"rows": int((~dsa.isnan(attn[..., 0])).sum().compute())}

    def analysis():
        r = study(ds, n_boot=200)
        values = {k: float(v.get("mean", v.get("lir", v.get("alpha")))) for k, v in r.items()}
        return {"rows": int(r["peaks"]["n_rows"].sum()), **values}

    run = plain_read if what == "read" else analysis
    t0 = time.perf_counter()
    values = run()  # untimed: loads numba's cached kernels (compiles them on the very first run)
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        values = run()
        times.append(time.perf_counter() - t0)
    if client is not None:
        client.close()
    return {
        "seconds": statistics.median(times),
        "first_call_seconds": first,
        "peak_rss_mb": _peak_rss_mb(),
        "rss_after_imports_mb": rss_before,
        "shape": list(attn.shape),
        "values": values,
    }


def check_agreement(path: Path, runs: dict) -> None:
    """Every side read the same array and the same rows, and the analyses gave the same
    numbers on every scheduler; else one line and exit 1 (nothing recorded)."""
    sides = [(what, run) for what, measured in runs.items() for run in measured]
    reference = sides[0][1]
    for what, run in sides:
        if run["shape"] != reference["shape"] or run["values"]["rows"] != reference["values"]["rows"]:
            sys.exit(
                f"{path}: the {what} read shape {run['shape']} and {run['values']['rows']} rows, the "
                f"{sides[0][0]} {reference['shape']} and {reference['values']['rows']}: they must agree"
            )
    analyses = [(what, run["values"]) for what, run in sides if what != "read"]
    for what, values in analyses[1:]:
        if json.dumps(values) != json.dumps(analyses[0][1]):  # bit for bit (NaN equal to NaN)
            sys.exit(f"{path}: the analyses on {what} gave {values}, on {analyses[0][0]} {analyses[0][1]}")


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.5, 2.0], help="store sizes in GB of fp16 rows")
    ap.add_argument("--dir", default="/tmp/kvscope-bench", help="where the synthetic stores are kept")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dask", type=int, default=0, help="also on a local cluster of this many worker processes")
    record.add_argument(ap)
    ap.add_argument(
        "--chunks", default="store", choices=["store", "analysis"],
        help="read and analyse the store's chunks, or open_trace(chunks='analysis') as `kvscope analyze` does",
    )  # fmt: skip
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--what", default="read", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.repeats, args.what, args.chunks)))
        return

    from kvscope.storage.synthetic import write_synthetic_store

    machine_info = record.machine()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    rows = []
    for size in args.sizes:
        n_samples = max(1, math.ceil(size * 1e9 / bytes_per_sample() - 1e-9))  # at least `size` GB
        path = Path(args.dir) / f"synthetic-{n_samples}x{SHAPE['n_steps']}.zarr"
        if not (path / "zarr.json").is_file() or "complete" not in (path / "zarr.json").read_text():
            t0 = time.perf_counter()
            write_synthetic_store(path, n_samples=n_samples, seed=1, **SHAPE)
            print(f"wrote {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        runs = {}
        sides = ("read", "analysis") + ((f"dask:{args.dask}",) if args.dask else ())
        for what in sides * 2:  # interleaved; the page cache is warm after the first round
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--measure",
                    str(path),
                    "--repeats",
                    str(args.repeats),
                    "--what",
                    what,
                    "--chunks",
                    args.chunks,
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            runs.setdefault(what, []).append(json.loads(proc.stdout.strip().splitlines()[-1]))
        check_agreement(path, runs)
        read, analysis = runs["read"][-1], runs["analysis"][-1]
        result = {
            "logical_gb": n_samples * bytes_per_sample() / 1e9,
            "on_disk_gb": on_disk / 1e9,
            "read_s": read["seconds"],
            "analysis_s": analysis["seconds"],
            "analysis_first_call_s": analysis["first_call_seconds"],
            "ratio": analysis["seconds"] / read["seconds"],
            "read_peak_rss_mb": read["peak_rss_mb"],
            "analysis_peak_rss_mb": analysis["peak_rss_mb"],
            "rss_after_imports_mb": analysis["rss_after_imports_mb"],
            "values": analysis["values"],
            "path": str(path),
            "chunks": args.chunks,
        }
        if args.dask:
            on_dask = runs[f"dask:{args.dask}"][-1]
            result.update(
                dask_workers=args.dask, dask_s=on_dask["seconds"], dask_speedup=analysis["seconds"] / on_dask["seconds"]
            )
        rows.append(result)
        print(
            f"{result['logical_gb']:.2f} GB rows ({result['on_disk_gb']:.2f} GB on disk): plain read "
            f"{result['read_s']:.1f} s (peak RSS {result['read_peak_rss_mb']:.0f} MB), FMM+churn+LIR+peaks "
            f"{result['analysis_s']:.1f} s (peak RSS {result['analysis_peak_rss_mb']:.0f} MB), "
            f"ratio {result['ratio']:.2f} (target ≤ 1.3)"
            + (
                f"; on {args.dask} dask workers {result['dask_s']:.1f} s, {result['dask_speedup']:.2f}× one process"
                if args.dask
                else ""
            ),
            flush=True,
        )
    print(json.dumps(rows, indent=1))
    record.finish("analysis_throughput", args, rows, machine_info)


if __name__ == "__main__":
    main()
