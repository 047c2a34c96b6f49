"""What a command line pays for its imports: wall time of a fresh `kvscope` process for commands
that end early (a refused option, `--help`, `info` of a small store).

Each command runs ``--repeats`` times in a fresh ``python -m kvscope`` process (after one untimed
run, so the page cache holds the libraries); the median is reported, and the exit status is
checked (2 for a refusal, 0 otherwise).

    python benchmarks/cli_startup.py [--repeats 5] [--no-record]

Each run is appended to ``benchmarks/results/cli_startup.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # benchmarks/record.py: runs as data

# label (as the records name it) → (arguments, the exit status it must end with); {tmp}: a scratch folder
COMMANDS = {
    "kvscope trace … --temperature nan": (
        ["trace", "--prompt", "x", "--max-new-tokens", "2", "--temperature", "nan", "--out", "{tmp}/n.zarr"],
        2,
    ),
    "kvscope run … --policy oracle": (["run", "--prompt", "x", "--policy", "oracle", "--budget", "0.3"], 2),
    "kvscope validate MISSING.zarr … --kv-dtype int3": (
        ["validate", "{tmp}/missing.zarr", "--policy", "h2o", "--budget", "0.3", "--kv-dtype", "int3"],
        2,
    ),
    "kvscope --help": (["--help"], 0),
    "kvscope info STORE": (["info", "{tmp}/store.zarr"], 0),
}


def seconds(args: list[str], status: int, repeats: int) -> float:
    """Median wall time of ``python -m kvscope ARGS`` over ``repeats`` fresh processes."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "kvscope", *args], capture_output=True, text=True, check=False)
        took = time.perf_counter() - start
        if proc.returncode != status:
            raise SystemExit(
                f"kvscope {' '.join(args)}: exit {proc.returncode}, expected {status}: {proc.stderr[-500:]}"
            )
        if i:  # the first run warms the page cache
            times.append(took)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    record.add_argument(ap)
    args = ap.parse_args()
    started = record.machine()
    from kvscope.storage.synthetic import write_synthetic_store

    with tempfile.TemporaryDirectory() as tmp:
        write_synthetic_store(f"{tmp}/store.zarr", n_samples=1, n_steps=16, n_layers=2, n_kv=2, prompt_len=32)
        rows = []
        for label, (argv, status) in COMMANDS.items():
            took = seconds([a.format(tmp=tmp) for a in argv], status, args.repeats)
            rows.append({"command": label, "seconds": round(took, 3)})
            print(f"{label:<52} {took:6.2f} s", file=sys.stderr)
    figures = {"repeats": args.repeats, "rows": rows}
    if args.json:
        print(json.dumps(figures, indent=1))
    record.finish("cli_startup", args, figures, started)


if __name__ == "__main__":
    main()
