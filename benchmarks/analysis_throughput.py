"""Analysis throughput and memory on synthetic stores larger than a few GB.

For each size, a synthetic token-resolution store (random rows with sinks, real schema,
fp16, blosc-zstd) is written once, then — in a fresh subprocess, so that peak RSS is the
analysis's own — FMM + churn + LIR + peaks run over it (`kvscope.analysis.study`, one
streaming read) and are timed against a plain chunked read of the same `attn` array
(every chunk read and decompressed, nothing computed). Each is measured in its own fresh
process (so each peak RSS is its own), interleaved read, analysis, read, analysis; the
second pair is reported (warm page cache), each the median of ``--repeats`` after one
untimed call in the same process (which loads numba's compiled kernels; its time is
reported as ``analysis_first_call_s``).

    python benchmarks/analysis_throughput.py --sizes 0.5 2 [--dir /tmp/kvscope-bench]
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

SHAPE = dict(n_layers=16, n_kv=4, prompt_len=3584, n_steps=512)  # 268 MB of fp16 rows per sample


def bytes_per_sample() -> int:
    T = SHAPE["prompt_len"] + SHAPE["n_steps"]
    return SHAPE["n_steps"] * SHAPE["n_layers"] * SHAPE["n_kv"] * T * 2


def measure(path: str, repeats: int, what: str) -> dict:
    """In a fresh process: time ``what`` (plain read, or the analyses) and its peak RSS
    (``VmHWM`` of this process: ``ru_maxrss`` would carry the parent's peak across exec)."""
    import dask

    import kvscope
    from kvscope.analysis import study

    dask.config.set(scheduler="threads")
    ds = kvscope.open_trace(path, chunks={})
    attn = ds["attn"].data
    rss_before = _peak_rss_mb()

    def plain_read():
        attn[..., :1].sum().compute()  # every chunk is fetched and decoded; almost nothing computed

    def analysis():
        r = study(ds, n_boot=200)
        return {k: float(v.get("mean", v.get("lir", v.get("alpha")))) for k, v in r.items()}

    run = plain_read if what == "read" else analysis
    t0 = time.perf_counter()
    values = run()  # untimed: loads numba's cached kernels (compiles them on the very first run)
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        values = run()
        times.append(time.perf_counter() - t0)
    return {
        "seconds": statistics.median(times),
        "first_call_seconds": first,
        "peak_rss_mb": _peak_rss_mb(),
        "rss_after_imports_mb": rss_before,
        "values": values,
    }


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.5, 2.0], help="store sizes in GB of fp16 rows")
    ap.add_argument("--dir", default="/tmp/kvscope-bench", help="where the synthetic stores are kept")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--what", default="read", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.repeats, args.what)))
        return

    from kvscope.synthetic import write_synthetic_store

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
        for what in ("read", "analysis", "read", "analysis"):  # interleaved; the page cache is warm after the first
            proc = subprocess.run(
                [sys.executable, __file__, "--measure", str(path), "--repeats", str(args.repeats), "--what", what],
                capture_output=True,
                text=True,
                check=True,
            )
            runs.setdefault(what, []).append(json.loads(proc.stdout.strip().splitlines()[-1]))
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
        }
        rows.append(result)
        print(
            f"{result['logical_gb']:.2f} GB rows ({result['on_disk_gb']:.2f} GB on disk): plain read "
            f"{result['read_s']:.1f} s (peak RSS {result['read_peak_rss_mb']:.0f} MB), FMM+churn+LIR+peaks "
            f"{result['analysis_s']:.1f} s (peak RSS {result['analysis_peak_rss_mb']:.0f} MB), "
            f"ratio {result['ratio']:.2f} (target ≤ 2)",
            flush=True,
        )
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
