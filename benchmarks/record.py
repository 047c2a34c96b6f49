"""Benchmark runs as data: each run appends one JSON line to ``benchmarks/results/<name>.jsonl``.

A record holds the date (UTC), the code (commit, and whether the tree had changes), the machine
and its load as the run began, the command line and the figures::

    from record import append_run
    append_run("analysis_throughput", {"sizes": [...]})          # → benchmarks/results/analysis_throughput.jsonl

``--no-record`` on a benchmark's command line skips it (a trial run)::

    record.add_argument(ap); args = ap.parse_args(); started = record.machine()
    ...
    record.finish("trace_overhead", args, report, started)

A report written elsewhere — ``benchmarks/gpu_check.py --out gpu_check.json`` on a CUDA machine,
``$OUT/gpu_check.json`` from ``benchmarks/gpu_check.sh`` — is appended as a run from the command line::

    python benchmarks/record.py append gpu_check gpu_check.json
    python benchmarks/record.py append gpu_check gpu_check.json --elsewhere \
        --machine gpu="NVIDIA H200" cores=16 memory_gib=128 load="idle apart from the run" --date 2026-12-04

The report's JSON is the run's figures. The machine is this one (``machine()``, less the load: the
run is over) with the report's GPU (``device_name`` where ``device`` is CUDA); ``--elsewhere``: the
report ran on another machine, so only the report's GPU and ``--machine KEY=VALUE`` describe it
(values are JSON where they parse: numbers stay numbers). ``--date`` (default now), ``--command``
(default ``bash benchmarks/NAME.sh`` where that script exists, else ``python benchmarks/NAME.py``)
and ``--note`` as the run needs; the code is this checkout's commit.
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


def append_run(
    name: str,
    figures,
    machine_info: dict | None = None,
    argv: list[str] | None = None,
    *,
    command: str | None = None,
    date: str | None = None,
    extra: dict | None = None,
) -> Path:
    """Append a run of benchmark ``name`` with ``figures`` (JSON-able) to its results file;
    ``machine_info``: :func:`machine` as the run began (its load then), now by default;
    ``command``: the command line (default: this process's, as ``python benchmarks/NAME.py ARGS``);
    ``date``: ISO date or date-time (default: now, UTC); ``extra``: further keys (``note``…)."""
    record = {
        "date": date or datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "benchmark": name,
        "code": code(),
        "machine": machine_info or machine(),
        "command": command or " ".join(["python", f"benchmarks/{name}.py", *(sys.argv[1:] if argv is None else argv)]),
        "figures": figures,
        **(extra or {}),
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.jsonl"
    with path.open("a") as out:
        out.write(json.dumps(record) + "\n")
    return path


def default_command(name: str) -> str:
    """The command line of benchmark ``name``'s default run: ``bash benchmarks/NAME.sh`` where that
    script exists, else ``python benchmarks/NAME.py``."""
    script = ROOT / "benchmarks" / f"{name}.sh"
    return f"bash benchmarks/{name}.sh" if script.is_file() else f"python benchmarks/{name}.py"


def add_argument(parser) -> None:
    """``--no-record``: a trial run, not appended to benchmarks/results."""
    parser.add_argument("--no-record", action="store_true", help="do not append the run to benchmarks/results")


def default_model(device: str = "cpu") -> tuple:
    """``(model, tokenizer, source)``: kvscope's default model loaded once for a benchmark's grid,
    the libraries' progress bars and warnings quiet for the rest of the run."""
    from kvscope.cli import quiet_libraries
    from kvscope.model.loading import DEFAULT_MODEL, load, resolve

    quiet_libraries().__enter__()
    source = resolve(DEFAULT_MODEL)
    model, tokenizer = load(source, device)
    return model, tokenizer, source


def finish(name: str, args, figures, machine_info: dict) -> None:
    """Append the run unless ``--no-record``; say where on stderr."""
    if not getattr(args, "no_record", False):
        print(f"recorded in {append_run(name, figures, machine_info)}", file=sys.stderr)


def append_file(args) -> Path:
    """``record.py append NAME FILE.json``: the report in FILE as a run of NAME (module docstring)."""
    figures = json.loads(Path(args.file).read_text())
    info = {} if args.elsewhere else {k: v for k, v in machine().items() if k != "load_1min"}
    if isinstance(figures, dict) and str(figures.get("device", "")).startswith("cuda") and figures.get("device_name"):
        info["gpu"] = figures["device_name"]
        if figures.get("torch"):
            info["torch"] = figures["torch"]
    for pair in args.machine:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--machine {pair!r}: KEY=VALUE")
        try:
            info[key] = json.loads(value)
        except json.JSONDecodeError:
            info[key] = value
    command = args.command or default_command(args.name)
    if args.date:
        datetime.date.fromisoformat(args.date[:10])  # a readable date, or ValueError
    extra = {"note": args.note} if args.note else None
    return append_run(args.name, figures, info, command=command, date=args.date, extra=extra)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Append a benchmark report written elsewhere as a recorded run.")
    sub = ap.add_subparsers(dest="action", required=True)
    add = sub.add_parser("append", help="append FILE (the report's JSON) as a run of benchmark NAME")
    add.add_argument("name", help="the benchmark (its results file: benchmarks/results/NAME.jsonl)")
    add.add_argument("file", help="the report, JSON")
    add.add_argument("--machine", nargs="*", default=[], metavar="KEY=VALUE", help="what describes the machine")
    add.add_argument("--elsewhere", action="store_true", help="the report ran on another machine: not this one's info")
    add.add_argument("--date", default=None, help="when it ran (ISO; default now)")
    add.add_argument("--command", default=None, help="the command that wrote the report")
    add.add_argument("--note", default=None)
    args = ap.parse_args(argv)
    print(f"recorded in {append_file(args)}", file=sys.stderr)


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    except OSError:
        return None


if __name__ == "__main__":
    main()
