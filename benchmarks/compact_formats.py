"""Bytes and metric changes of the lossy row formats (``kvscope compact --rows FORMAT``) on real traces.

For each trace and format: the trace compacted into a temporary store, then

* bytes of the ``attn`` chunks against raw fp16 (the committed rows' values × 2 bytes) and
  against the lossless store they came from;
* the largest absolute change, against the original, of every metric's headline numbers:
  FMM at the default horizon (and its FMM(H) curve), churn, LIR (and P01/P10), the peaks' α
  fit, LogQuant/recency coverage, the concentration shares — all over one
  :func:`kvscope.analysis.study` / concentration pass with default parameters — and the
  replayed FMM of every policy at every budget (8 policies × ``--budgets``; traces with
  q/k/v only); plus the largest change of any number the summaries hold (per-layer values,
  CIs) as "any".

    python benchmarks/compact_formats.py traces/demo.zarr results/traces/prose-1024.zarr --json out.json

Prints a Markdown table (one row per trace × format) for the README.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import record  # benchmarks/record.py: runs as data

import kvscope
from kvscope import analysis as A
from kvscope.storage.compact import compact
from kvscope.storage.rowformat import FORMATS

POLICIES = ["full", "streaming", "h2o", "snapkv", "kivi", "logquant", "qevict", "oracle"]
HEADLINE = {  # metric column → (summary, keys) whose numbers it covers
    "FMM": ("fmm", ("fmm", "curve")),
    "churn": ("churn", ("churn",)),
    "LIR": ("lir", ("lir", "p01", "p10")),
    "α": ("peaks", ("alpha",)),
    "coverage": ("peaks", ("coverage_logquant", "coverage_recency")),
    "concentration": ("concentration", ("top_share", "windows_needed")),
}


COUNTS = {"aic", "log2_bins", "n_peaks", "n_rows", "n_events", "n_censored", "eligible", "reactivated", "n_boot"}


def numbers(doc, prefix="") -> dict[str, float]:
    """Every number in a JSON-like document, by its path (None as NaN), except counts and
    log-likelihoods (:data:`COUNTS`), which are not on a metric's scale."""
    out = {}
    if isinstance(doc, dict):
        for k, v in doc.items():
            if k not in COUNTS:
                out |= numbers(v, f"{prefix}.{k}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out |= numbers(v, f"{prefix}[{i}]")
    elif doc is None:
        out[prefix] = float("nan")
    elif isinstance(doc, (int, float)) and not isinstance(doc, bool):
        out[prefix] = float(doc)
    return out


def largest_change(a: dict, b: dict) -> float:
    """max |a − b| over the numbers both hold (NaN on both sides: equal; on one side: inf)."""
    worst = 0.0
    for k in a.keys() & b.keys():
        x, y = a[k], b[k]
        if math.isnan(x) or math.isnan(y):
            worst = max(worst, 0.0 if (math.isnan(x) and math.isnan(y)) else float("inf"))
        else:
            worst = max(worst, abs(x - y))
    return worst


def metrics(path: Path, budgets: list[float]) -> dict:
    """Summaries of every analysis (default parameters) and the replayed FMM per policy × budget."""
    ds = kvscope.open_trace(path, chunks={})
    docs = {name: A.make(name).summary(r) for name, r in A.study(ds).items()}
    conc = A.make("concentration")
    docs["concentration"] = conc.summary(conc(ds))
    if ds.kvscope.has_qkv:
        from kvscope.replay import replay
        from kvscope.report import comparison

        result = replay(ds, POLICIES, budgets, errors=False)
        docs["replay"] = {f"{r['policy']}@{r['budget']}": r["fmm"] for r in comparison(result)}
    return docs


def changes(base: dict, other: dict) -> dict:
    """Largest absolute change per column (module docstring)."""
    out = {}
    for column, (name, keys) in HEADLINE.items():
        out[column] = largest_change(
            numbers({k: base[name].get(k) for k in keys}), numbers({k: other[name].get(k) for k in keys})
        )
    out["replayed FMM"] = largest_change(base["replay"], other["replay"]) if "replay" in base else None
    out["any"] = largest_change(numbers(base), numbers(other))
    return out


def run(traces: list[Path], formats: list[str], budgets: list[float], work: Path, level: int) -> list[dict]:
    rows = []
    for trace in traces:
        t0 = time.perf_counter()
        base = metrics(trace, budgets)
        print(f"{trace}: metrics of the original in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for fmt in formats:
            out = work / f"{trace.stem}-{fmt}.zarr"
            t0 = time.perf_counter()
            sizes = compact(trace, out, fmt, level=level)
            t_compact = time.perf_counter() - t0
            other = metrics(out, budgets)
            row = {
                "trace": str(trace),
                "rows": fmt,
                "vs_raw": sizes["attn_out_bytes"] / sizes["attn_raw_bytes"],
                "vs_lossless": sizes["attn_out_bytes"] / sizes["attn_in_bytes"],
                "store_vs_lossless": sizes["out_bytes"] / sizes["in_bytes"],
                "compact_s": t_compact,
                **sizes,
                "max_change": changes(base, other),
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


def markdown(rows: list[dict]) -> str:
    cols = [*HEADLINE, "replayed FMM", "any"]
    head = "| trace | rows | attn / raw fp16 | attn / lossless | " + " | ".join(cols) + " |"
    lines = [head, "|" + "---|" * (4 + len(cols))]
    for r in rows:
        ch = r["max_change"]
        cells = ["—" if ch[c] is None else f"{ch[c]:.1e}" if ch[c] else "0" for c in cols]
        lines.append(
            f"| {Path(r['trace']).name} | {r['rows']} | {r['vs_raw']:.3f} | {r['vs_lossless']:.3f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--budgets", default="0.2,0.5")
    p.add_argument("--level", type=int, default=9, help="zstd level of the compacted rows")
    p.add_argument("--json", type=Path, default=None)
    record.add_argument(p)
    args = p.parse_args()
    machine_info = record.machine()  # the load as the run begins
    budgets = [float(b) for b in args.budgets.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvscope-compact-") as work:
        rows = run(args.traces, args.formats.split(","), budgets, Path(work), args.level)
    doc = {"machine": f"{platform.machine()}, {platform.processor() or 'cpu'}", "rows": rows}
    record.finish("compact_formats", args, doc, machine_info)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    print(markdown(rows))


if __name__ == "__main__":
    main()
