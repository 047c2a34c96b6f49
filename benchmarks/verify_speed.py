"""`kvscope verify` against a plain read of the same store.

The plain read decodes every chunk of every array verify reads (``attn``, the prefill arrays,
q/k/v where recorded) with zarr's own concurrent whole-array reads and computes nothing;
verify reads the same chunks through the checked store (CRC32C before decoding, missing
chunks refused) and tests their values (the compiled row checks). Each side runs in its own
fresh process, interleaved read, verify, read, verify…; medians of ``--repeats`` after one
untimed call per process (page cache warm, numba's kernels loaded).

    python benchmarks/verify_speed.py [--store PATH] [--size-gb 0.5] [--no-record]

Each run is appended to ``benchmarks/results/verify_speed.jsonl``.

Without ``--store`` a synthetic store with the real schema is written once (16 layers × 4
KV heads, 3,584 + 512 tokens per sample, fp16 rows).
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
ARRAYS = ("attn", "prefill_colsum", "prefill_tail", "q", "k", "v")


def measure(path: str, repeats: int, what: str) -> dict:
    """In a fresh process: median seconds of ``what`` (``read`` or ``verify``)."""
    import zarr

    from kvscope.storage.verify import verify

    def plain_read():
        group = zarr.open_group(path, mode="r")
        for name in ARRAYS:
            if name in group:
                group[name][...]

    def check():
        report = verify(path)
        assert report.ok, [p.line() for p in report.problems]

    run = plain_read if what == "read" else check
    run()  # untimed
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=None, help="a trace to verify (default: a synthetic one)")
    ap.add_argument("--size-gb", type=float, default=0.5, help="fp16 rows of the synthetic store")
    ap.add_argument("--dir", default="/tmp/kvscope-bench")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=2, help="read/verify process pairs (the last is reported)")
    record.add_argument(ap)
    ap.add_argument("--measure", nargs=3, metavar=("PATH", "REPEATS", "WHAT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], int(args.measure[1]), args.measure[2])))
        return
    machine_info = record.machine()
    path = Path(args.store) if args.store else synthetic(Path(args.dir), args.size_gb)
    result = {}
    for _ in range(args.pairs):
        for what in ("read", "verify"):
            cmd = [sys.executable, __file__, "--measure", str(path), str(args.repeats), what]
            result[what] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)["seconds"]
    ratio = result["verify"] / result["read"]
    on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e9
    print(f"{path} ({on_disk:.2f} GB on disk): plain read {result['read']:.2f} s, verify {result['verify']:.2f} s, "
          f"ratio {ratio:.2f} (target ≤ 1.2)")  # fmt: skip
    figures = {"store": str(path), "on_disk_gb": on_disk, "read_s": result["read"], "verify_s": result["verify"]}
    record.finish("verify_speed", args, {**figures, "ratio": ratio}, machine_info)


def synthetic(folder: Path, size_gb: float) -> Path:
    from kvscope.storage.synthetic import write_synthetic_store

    T = SHAPE["prompt_len"] + SHAPE["n_steps"]
    per_sample = SHAPE["n_steps"] * SHAPE["n_layers"] * SHAPE["n_kv"] * T * 2
    n_samples = max(1, math.ceil(size_gb * 1e9 / per_sample))
    path = folder / f"verify-{n_samples}.zarr"
    if not (path / "zarr.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        write_synthetic_store(path, n_samples=n_samples, **SHAPE)
    return path


if __name__ == "__main__":
    main()
