"""Benchmark runs as data: each run appends one JSON line to ``benchmarks/results/<name>.jsonl``.

A record holds the date (UTC), the code (commit, and whether the tree had changes), the machine
and its load as the run began, the command line and the figures::

    from record import append_run
    append_run("analysis_throughput", {"sizes": [...]})          # → benchmarks/results/analysis_throughput.jsonl

``--no-record`` on a benchmark's command line skips it (a trial run)::

    record.add_argument(ap); args = ap.parse_args(); started = record.machine()
    ...
    record.finish("trace_overhead", args, report, started)
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]


def machine() -> dict:
    """The machine a run measured: processor, cores, memory, load average and versions."""
    from importlib.metadata import PackageNotFoundError, version

    info = {
        "processor": _cpu_model() or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
        "load_1min": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
    }
    for name in ("numpy", "numba", "zarr", "dask", "torch", "transformers"):
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            pass
    return info


def code() -> dict:
    """The commit measured and whether the working tree differed from it."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "changed": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def append_run(name: str, figures, machine_info: dict | None = None, argv: list[str] | None = None) -> Path:
    """Append a run of benchmark ``name`` with ``figures`` (JSON-able) to its results file;
    ``machine_info``: :func:`machine` as the run began (its load then), now by default."""
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "benchmark": name,
        "code": code(),
        "machine": machine_info or machine(),
        "command": " ".join(["python", f"benchmarks/{name}.py", *(sys.argv[1:] if argv is None else argv)]),
        "figures": figures,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.jsonl"
    with path.open("a") as out:
        out.write(json.dumps(record) + "\n")
    return path


def add_argument(parser) -> None:
    """``--no-record``: a trial run, not appended to benchmarks/results."""
    parser.add_argument("--no-record", action="store_true", help="do not append the run to benchmarks/results")


def finish(name: str, args, figures, machine_info: dict) -> None:
    """Append the run unless ``--no-record``; say where on stderr."""
    if not getattr(args, "no_record", False):
        print(f"recorded in {append_run(name, figures, machine_info)}", file=sys.stderr)


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    except OSError:
        return None
