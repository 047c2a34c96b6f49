"""Benchmark history: every recorded run (``benchmarks/results/*.jsonl``) as one Markdown page with a
figure per benchmark — its latest run, its headline figures over time, and all of its runs.

    python benchmarks/history.py --out DIR      # DIR/benchmarks.md and DIR/benchmarks/<benchmark>.png

For a documentation build (``docs/gen_pages.py``)::

    runs = history.load_runs(RESULTS)           # benchmark → its records, in date order
    text = history.page(runs)                   # the page; figures referenced as benchmarks/<benchmark>.png
    history.plot(name, runs[name], path)        # one PNG, or nothing where no headline figure was recorded
    history.fill_today(text, runs)              # each <!-- today: NAME --> of a page → NAME's figures today

Today's value of a figure is that of the latest valid run that measured it; a run marked
``"baseline": true`` measured the code before a change (the "before" of a comparison) and is
never today's (:func:`current`).

The headline figures of each benchmark are named in ``HEADLINES`` and read from a record's
``figures`` by that benchmark's extractor below (records differ in shape: rows per store size,
nested dicts per layer-output mode). A figure a record lacks is skipped.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from record import default_command  # benchmarks/record.py: the command line of a benchmark's default run

RESULTS = HERE / "results"

HEADLINES = {  # benchmark → {figure key: what it is}; the extractor of the benchmark reads them per row or mode
    "trace_overhead": {  # per layer-output mode; the bytes on disk are the same in both
        "decode_ratio": "decode, traced / untraced",
        "prefill_ratio": "prefill, traced / untraced",
        "end_to_end_ratio": "end to end, traced / untraced",
        "disk_over_raw_fp16": "attn bytes on disk / raw fp16",
    },
    "gpu_check": {  # kernel mode, per prompt length
        "decode_ratio": "decode, traced / untraced",
        "prefill_ratio": "prefill, traced / untraced",
        "capture_max_abs": "capture vs eager, max |Δ| of a row",
    },
    "analysis_throughput": {  # per store size
        "ratio": "analyses / plain read",
        "read_s": "plain read (s)",
        "analysis_s": "FMM + churn + LIR + peaks (s)",
    },
    "verify_speed": {"ratio": "verify / plain read", "verify_s": "verify (s)"},  # per store
    "live_memory": {  # per quantizing policy and budget
        "time_ratio": "decode time / full KV",
        "peak_ratio": "peak cache bytes / full KV",
        "serving_ratio": "served buffer / full KV",
    },
    "replay_speed": {
        "replay_over_one_decode": "grid replay / one decode",
        "replay_s": "grid replay (s)",
        "tune_over_five_decodes": "tune / five decodes",
    },
    "replay_speed_ab": {
        "after_over_decode": "after / one decode",
        "before_over_decode": "before / one decode",
        "after_over_before": "after / before",
    },
    "replay_memory": {"ratio": "peak RSS at 8·S / at S"},  # per configuration
    "scale": {  # at the run's largest context, in process and on the cluster
        "seconds": "replay of the grid (s)",
        "peak_gib": "peak RSS (GiB)",
        "per_step_over_first": "time per step / smallest context's",
    },
    "explorer": {  # per store size
        "first_view_s": "first view (s)",
        "layer_ms": "layer switch (ms)",
        "zoom_ms": "wheel zoom (ms)",
        "pan_exact_ms": "pan in exact rows (ms)",
    },
    "forced_replay": {  # per prompt and steps
        "forced_over_live": "forced replay / kvscope run, the whole grid",
        "one_budget_over_live": "forced replay / kvscope run, one budget (four cells)",
    },
    "accuracy_grid": {  # per context length: task accuracy offline against kvscope run
        "offline_over_live": "trace + forced replay / kvscope run, the accuracy grid",
        "replay_over_live": "forced replay alone / kvscope run",
        "agreement": "samples × cells where offline answer_exact = live",
    },
    "press_cost": {  # the model-needing presses' grid, offline against kvscope run
        "live_over_offline": "kvscope run of the grid / offline replay",
        "offline_seconds": "offline replay (s)",
        "live_seconds": "kvscope run of the grid (s)",
    },
    "cli_startup": {"seconds": "wall time of a fresh process (s)"},  # per command line
    "compact_formats": {"vs_raw": "attn / raw fp16"},  # per trace and row format
}

ABOUT: dict[str, str] = {}  # benchmarks without a script of their own (the others: their script's docstring)
READING = {
    "trace_overhead": "Before `--attn-output` existed (2026-12-02) a trace's layers returned the model's own kernel "
    "outputs: those runs are shown as `kernel`.",
    "gpu_check": "The `--attn-output kernel` overhead by prompt tokens, at 4 layers of the 8B geometry unless the "
    "series names 32; runs marked invalid are listed, not plotted.",
    "live_memory": "The quantizing policies (KIVI, LogQuant, QEvict): each decode's time over a full-KV decode's, "
    "the cache's peak bytes and the buffer it serves attention from over the full cache's.",
    "scale": "At the run's largest context; the series say where the replay ran and how many layers the store had "
    "(a reduced run has 2).",
    "replay_speed_ab": "The grid replayed by two versions of the code (before, after) against one plain decode.",
}

INTRO = (  # the page's first paragraphs
    "Every benchmark in `benchmarks/` appends a record of each run to `benchmarks/results/<benchmark>.jsonl`: "
    "the date, the commit measured (and whether the working tree differed from it), the machine and its load "
    "as the run began, the command line and the figures the benchmark printed. To add a run, run a benchmark "
    "(`python benchmarks/verify_speed.py`, say); `--no-record` makes a trial run that is not appended. A "
    "report written on another machine is appended with `python benchmarks/record.py append gpu_check "
    "gpu_check.json`. This page is generated from those files by `benchmarks/history.py`."
    "\n\n"
    "The runs before 2026-12-04 were transcribed from the project's earlier written benchmark log, each figure "
    "as it was printed then (their notes say what a run compared); the plots show them as hollow markers. In "
    "the plots a colour is a figure and a marker shape a machine; the x axis is the date (runs of one day "
    "without a time are spread over that day in their order)."
)

Extractor = Callable[[dict, dict], dict]
EXTRACTORS: dict[str, Extractor] = {}


def extractor(name: str):
    def register(f: Extractor) -> Extractor:
        EXTRACTORS[name] = f
        return f

    return register


def _number(x) -> float | None:
    """A finite number, or None."""
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    return float(x) if ok else None


def _put(out: dict, key: str, series: str, value) -> None:
    value = _number(value)
    if value is not None:
        out[(key, series)] = value


def _rows(figures) -> list[dict]:
    rows = figures if isinstance(figures, list) else figures.get("rows", []) if isinstance(figures, dict) else []
    return [r for r in rows if isinstance(r, dict)]


@extractor("trace_overhead")
def _trace_overhead(f: dict, keys: dict) -> dict:
    modes = [(m, f[m]) for m in ("kernel", "probs") if isinstance(f.get(m), dict)] or [("kernel", f)]
    out: dict = {}
    for key in keys:
        if key == "disk_over_raw_fp16":
            _put(out, key, "", f.get(key))
            continue
        for mode, d in modes:
            _put(out, key, mode, d.get(key))
    return out


@extractor("gpu_check")
def _gpu_check(f: dict, keys: dict) -> dict:
    out: dict = {}
    for key in ("decode_ratio", "prefill_ratio"):
        for row in f.get("overhead") or []:
            tokens, layers = row.get("prompt_tokens"), row.get("layers", 4)  # rows before 32 layers: 4
            if isinstance(row.get("kernel"), dict) and _number(tokens) is not None:
                deep = f", {layers} layers" if layers != 4 else ""
                _put(out, key, f"{tokens / 1024:g}K tokens{deep}", row["kernel"].get(key))
    captured = [v.get("rows_max_abs") for v in (f.get("capture_vs_eager") or {}).values() if isinstance(v, dict)]
    captured = [v for v in map(_number, captured) if v is not None]
    if captured:
        out[("capture_max_abs", "fp32")] = max(captured)
    return out


def _per_row(f, keys: dict, size: str, label) -> dict:
    """Each headline ``key`` of every row of ``f`` that has a number under ``size``, labelled ``label(size)``."""
    out: dict = {}
    for key in keys:
        for row in _rows(f):
            if _number(row.get(size)) is not None:
                _put(out, key, label(row[size]), row.get(key))
    return out


@extractor("analysis_throughput")
def _analysis_throughput(f, keys: dict) -> dict:
    return _per_row(f, keys, "logical_gb", lambda gb: f"{gb:.2f} GB")


@extractor("verify_speed")
def _verify_speed(f: dict, keys: dict) -> dict:
    store = str(f.get("store", ""))
    synthetic = "synthetic" in store or Path(store).name.startswith("verify-")
    series = "synthetic store" if synthetic else Path(store).name or "store"
    out: dict = {}
    for key in keys:
        _put(out, key, series, f.get(key))
    return out


@extractor("live_memory")
def _live_memory(f: dict, keys: dict) -> dict:
    out: dict = {}
    for row in _rows(f):
        if row.get("policy") in ("kivi", "logquant", "qevict") and _number(row.get("budget")) is not None:
            for key in keys:
                _put(out, key, f"{row['policy']} β {row['budget']:g}", row.get(key))
    return out


@extractor("replay_memory")
def _replay_memory(f: dict, keys: dict) -> dict:
    out: dict = {}
    for row in _rows(f):
        ratio = row.get("ratio")
        short, long = row.get("short"), row.get("long")
        if ratio is None and isinstance(short, dict) and isinstance(long, dict) and short.get("peak_kib"):
            ratio = long.get("peak_kib", 0) / short["peak_kib"]
        _put(out, "ratio", str(row.get("configuration", "")), ratio)
    return out


@extractor("scale")
def _scale(f: dict, keys: dict) -> dict:
    rows = [r for r in _rows(f) if _number(r.get("context")) is not None]
    if not rows:
        return {}
    last = max(rows, key=lambda r: r["context"])
    size = f"{last['context'] / 1024:g}K" + (f", {f['layers']} layers" if f.get("layers") else "")
    out: dict = {}
    for where, peak in (("in_process", "peak"), ("cluster", "worker_peak")):
        got = last.get(where)
        if not isinstance(got, dict):
            continue
        label = f"{'in process' if where == 'in_process' else 'cluster'}, {size}"
        _put(out, "seconds", label, got.get("seconds"))
        gib = got.get(f"{peak}_gib")
        if gib is None and _number(got.get(f"{peak}_kib")) is not None:
            gib = got[f"{peak}_kib"] / 2**20
        _put(out, "peak_gib", label, gib)
        growth = got.get("per_step_over_first")
        first = rows[0].get(where)
        if growth is None and rows[0] is not last and isinstance(first, dict) and _number(first.get("seconds")):
            growth = (_number(got.get("seconds")) or math.nan) / first["seconds"]  # the same steps at every context
        _put(out, "per_step_over_first", label, growth)
    return out


@extractor("explorer")
def _explorer(f, keys: dict) -> dict:
    return _per_row(f, keys, "positions", lambda n: f"{n:,} positions")


@extractor("forced_replay")
def _forced_replay(f, keys: dict) -> dict:
    out: dict = {}
    for row in f.get("sizes", []) if isinstance(f, dict) else []:
        if isinstance(row, dict):
            size = f"P {row.get('prompt_tokens')}, S {row.get('steps')}"
            _put(out, "forced_over_live", size, row.get("forced_over_live"))
            one = row.get("one_budget")
            if isinstance(one, dict):
                _put(out, "one_budget_over_live", size, one.get("forced_over_live"))
    return out


@extractor("accuracy_grid")
def _accuracy_grid(f, keys: dict) -> dict:
    out: dict = {}
    for row in f.get("sizes", []) if isinstance(f, dict) else []:
        if isinstance(row, dict):
            size = f"{row.get('context_tokens')} tokens, {row.get('samples')} samples × {row.get('cells')} cells"
            for key in keys:
                _put(out, key, size, row.get(key))
    return out


@extractor("cli_startup")
def _cli_startup(f, keys: dict) -> dict:
    out: dict = {}
    for row in _rows(f):
        _put(out, "seconds", str(row.get("command", "")), row.get("seconds"))
    return out


@extractor("compact_formats")
def _compact_formats(f, keys: dict) -> dict:
    out: dict = {}
    for row in _rows(f):
        _put(out, "vs_raw", f"{Path(str(row.get('trace', ''))).name}, {row.get('rows')}", row.get("vs_raw"))
    return out


def _top_level(f, keys: dict) -> dict:
    out: dict = {}
    if isinstance(f, dict):
        for key in keys:
            _put(out, key, "", f.get(key))
    return out


def headline(name: str, record: dict) -> dict[tuple[str, str], float]:
    """The headline figures of one run: ``{(figure key, series): value}``, in ``HEADLINES``' order;
    what the record lacks (or cannot be read) is left out."""
    keys = HEADLINES.get(name, {})
    figures = record.get("figures")
    if not keys or figures is None:
        return {}
    try:
        out = EXTRACTORS.get(name, _top_level)(figures, keys)
    except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError):
        return {}
    order = list(keys)
    return dict(sorted(out.items(), key=lambda kv: order.index(kv[0][0]) if kv[0][0] in order else len(order)))


# ---------------------------------------------------------------------------------------------------------------
# records


def date_key(record: dict) -> tuple[str, str]:
    """Sorts records by day, then time of day; a record dated by its day alone comes first that day."""
    date = str(record.get("date", ""))
    return date[:10], date[10:]


def parse_date(date: str) -> datetime.datetime:
    """A record's date (``2026-12-01`` or an ISO date-time) as a UTC date-time."""
    if len(date) == 10:
        return datetime.datetime.fromisoformat(date).replace(tzinfo=datetime.UTC)
    when = datetime.datetime.fromisoformat(date)
    return when if when.tzinfo else when.replace(tzinfo=datetime.UTC)


def load_runs(results_dir: str | Path = RESULTS) -> dict[str, list[dict]]:
    """Every ``*.jsonl`` of ``results_dir``: benchmark (the file's name) → its records in date order
    (stable: runs of one day keep the file's order). Blank lines are skipped."""
    runs = {}
    for path in sorted(Path(results_dir).glob("*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        runs[path.stem] = sorted(records, key=date_key)
    return runs


def valid(record: dict) -> bool:
    return record.get("valid", True) is not False


def latest(records: list[dict]) -> dict | None:
    """The latest valid run that measured the code of its day (not a baseline), if any."""
    usable = [r for r in records if valid(r) and not r.get("baseline")]
    return usable[-1] if usable else None


def machine_id(machine) -> str:
    """What tells machines apart in the plots: the GPU or the processor, and the cores."""
    if not isinstance(machine, dict):
        return str(machine or "machine not recorded")
    what = machine.get("gpu") or machine.get("processor") or "CPU"
    return f"{what}, {machine['cores']} cores" if machine.get("cores") else what


def machine_words(machine) -> str:
    if not isinstance(machine, dict):
        return str(machine or "—")
    parts = [machine.get("gpu"), machine.get("processor") or (None if machine.get("gpu") else "CPU")]
    if machine.get("cores"):
        parts.append(f"{machine['cores']} {'CPU cores' if machine.get('gpu') else 'cores'}")
    if machine.get("memory_gb"):
        parts.append(f"{machine['memory_gb']} GB of memory")
    elif machine.get("memory_gib"):
        parts.append(f"{machine['memory_gib']} GiB of memory")
    words = ", ".join(str(p) for p in parts if p)
    return words or "—"


def load_words(machine) -> str:
    if not isinstance(machine, dict):
        return "—"
    if _number(machine.get("load_1min")) is not None:
        return f"{machine['load_1min']:g} (1-minute load average as the run began)"
    return str(machine.get("load") or "—")


def commit_words(record: dict) -> str:
    code = record.get("code")
    if not isinstance(code, dict) or not code.get("commit"):
        return "—"
    words = f"`{code['commit']}`"
    if code.get("note"):
        words += f" + {code['note']}"
    elif code.get("changed"):
        words += " (with uncommitted changes)"
    return words


def fmt(value: float) -> str:
    """A figure as the page prints it: 4 significant digits, thousands separated."""
    if value == int(value) and abs(value) < 1e6:
        return f"{int(value):,}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 1e-3:
        return f"{value:.4g}"
    return f"{value:.3g}"


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _about(name: str) -> str:
    if name in ABOUT:
        return ABOUT[name]
    script = HERE / f"{name}.py"
    try:
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    except (OSError, SyntaxError):
        return ""
    first = " ".join(doc.split("\n\n")[0].split())
    return re.sub(r"``([^`]+)``", r"`\1`", first)


def series_label(name: str, key: str, series: str) -> str:
    words = HEADLINES.get(name, {}).get(key, key)
    return f"{words}, {series}" if series else words


# ---------------------------------------------------------------------------------------------------------------
# the page


def page(runs: dict[str, list[dict]], figure_dir_name: str = "benchmarks") -> str:
    """The Markdown page: an introduction, a summary, and per benchmark its latest run's headline
    figures, their plot (``figure_dir_name/<benchmark>.png``, where a figure was recorded) and all runs."""
    names = sorted(runs)
    lines = [
        "# Benchmark history",
        "",
        INTRO,
        "",
        "| benchmark | runs | first | latest | latest machine |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        records = runs[name]
        last = records[-1] if records else {}
        lines.append(
            f"| [{name}](#{name}) | {len(records)} | {str(records[0].get('date', '—'))[:10] if records else '—'} | "
            f"{str(last.get('date', '—'))[:10]} | {_cell(machine_words(last.get('machine')))} |"
        )
    for name in names:
        lines += ["", *_section(name, runs[name], figure_dir_name)]
    return "\n".join(lines) + "\n"


def _section(name: str, records: list[dict], figure_dir_name: str) -> list[str]:
    lines = [f"## {name} {{#{name}}}", ""]
    about = _about(name)
    if about:
        lines += [about, ""]
    if name in READING:
        lines += [READING[name], ""]
    last = latest(records)
    if last is None:
        return lines + ["No valid run recorded yet.", ""]
    lines += ["**Latest run**", "", "| | |", "|---|---|"]
    lines.append(f"| date | {_cell(last.get('date', '—'))} |")
    lines.append(f"| machine | {_cell(machine_words(last.get('machine')))} |")
    lines.append(f"| load | {_cell(load_words(last.get('machine')))} |")
    lines.append(f"| commit | {_cell(commit_words(last))} |")
    if last.get("command"):
        lines.append(f"| command | `{_cell(last['command'])}` |")
    if last.get("note"):
        lines.append(f"| note | {_cell(last['note'])} |")
    if last.get("source"):
        lines.append("| source | transcribed from the earlier written benchmark log |")
    for (key, series), value in headline(name, last).items():
        lines.append(f"| {_cell(series_label(name, key, series))} | {fmt(value)} |")
    lines.append("")
    if _points(name, records):
        lines += [f"![{name}: headline figures over time]({figure_dir_name}/{name}.png)", ""]
    columns = []
    values = [headline(name, r) for r in records]
    for got in values:
        columns += [c for c in got if c not in columns]
    columns.sort(key=lambda c: list(HEADLINES.get(name, {})).index(c[0]) if c[0] in HEADLINES.get(name, {}) else 0)
    head = ["date", "machine", "load", *(series_label(name, k, s) for k, s in columns), "note"]
    lines += [f'??? note "All {len(records)} run{"s" if len(records) != 1 else ""}"', ""]
    lines.append("    | " + " | ".join(_cell(h) for h in head) + " |")
    lines.append("    |" + "---|" * len(head))
    for record, got in zip(records, values):
        note = record.get("note", "")
        if record.get("baseline"):
            note = f"(baseline) {note}".strip()
        if not valid(record):
            note = f"invalid: {record.get('why_invalid', '')} {note}".strip()
        if record.get("source"):
            note = f"(transcribed) {note}".strip()
        cells = [
            str(record.get("date", "—")),
            machine_words(record.get("machine")),
            load_words(record.get("machine")).split(" (")[0],
            *(fmt(got[c]) if c in got else "—" for c in columns),
            note or "—",
        ]
        lines.append("    | " + " | ".join(_cell(c) for c in cells) + " |")
    lines.append("")
    return lines


# ---------------------------------------------------------------------------------------------------------------
# today's figures


TODAY = re.compile(r"<!-- today: (\w+) -->")


def current(name: str, records: list[dict]) -> dict[tuple[str, str], tuple[float, dict]]:
    """Today's value of each headline figure of benchmark ``name``: ``(figure key, series) → (value,
    run)`` from the latest valid run that measured it, baseline runs left out; ``HEADLINES``' order."""
    out: dict = {}
    for record in records:  # in date order: a later run replaces an earlier one's value
        if valid(record) and not record.get("baseline"):
            out.update({key: (value, record) for key, value in headline(name, record).items()})
    order = list(HEADLINES.get(name, {}))
    return dict(sorted(out.items(), key=lambda kv: order.index(kv[0][0]) if kv[0][0] in order else len(order)))


def today_table(name: str, records: list[dict]) -> str:
    """A Markdown table of benchmark ``name``'s figures today: each with the run that measured it
    (day and machine) and the command that reproduces it."""
    figures = current(name, records)
    if not figures:
        return "No valid run recorded yet."
    lines = ["| figure | today | measured | reproduce |", "|---|---|---|---|"]
    for (key, series), (value, run) in figures.items():
        when = f"{str(run.get('date', '—'))[:10]}, {machine_words(run.get('machine'))}"
        command = run.get("command") or default_command(name)
        lines.append(
            f"| {_cell(series_label(name, key, series))} | {fmt(value)} | {_cell(when)} | `{_cell(command)}` |"
        )
    return "\n".join(lines)


def fill_today(text: str, runs: dict[str, list[dict]]) -> str:
    """``text`` with each ``<!-- today: NAME -->`` replaced by :func:`today_table` of benchmark NAME
    (ValueError for a benchmark without records: a page cannot name figures that do not exist)."""

    def table(match: re.Match) -> str:
        name = match.group(1)
        if name not in runs:
            raise ValueError(f"<!-- today: {name} -->: no benchmarks/results/{name}.jsonl")
        return today_table(name, runs[name])

    return TODAY.sub(table, text)


# ---------------------------------------------------------------------------------------------------------------
# the figure


def _points(name: str, records: list[dict]) -> list[tuple[datetime.datetime, dict, dict]]:
    """(x, record, headline) of every valid run with a headline figure; the runs of a day with no
    time of day are spread over that day in their order."""
    dated = [r for r in records if valid(r)]
    day_only: dict[str, list[dict]] = {}
    for r in dated:
        if len(str(r.get("date", ""))) == 10:
            day_only.setdefault(r["date"], []).append(r)
    points = []
    for r in dated:
        got = headline(name, r)
        if not got:
            continue
        try:
            when = parse_date(str(r.get("date", "")))
        except ValueError:
            continue
        if r["date"] in day_only:
            same = [id(other) for other in day_only[r["date"]]]
            when += datetime.timedelta(days=(same.index(id(r)) + 1) / (len(same) + 1))
        points.append((when, r, got))
    return points


MARKERS = "osD^vP*Xh<>p"


def plot(name: str, runs: list[dict], path: str | Path) -> bool:
    """The headline figures of ``runs`` (one benchmark's records) over time, one panel per figure,
    written as a PNG to ``path``; False (and nothing written) where no run has a headline figure."""
    points = _points(name, runs)
    if not points:
        return False
    import matplotlib
    import matplotlib.dates as mdates
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    from kvscope.figures import axes as figure_axes
    from kvscope.figures import save, styled

    keys = [k for k in HEADLINES.get(name, {}) if any(k == c[0] for _, _, got in points for c in got)]
    series = list(dict.fromkeys(s for _, _, got in points for _, s in got))
    machines = list(dict.fromkeys(machine_id(r.get("machine")) for _, r, _ in points))
    colours = matplotlib.colormaps["tab10"]
    colour = {s: colours(i % 10) for i, s in enumerate(series)}
    marker = {m: MARKERS[i % len(MARKERS)] for i, m in enumerate(machines)}

    handles = [Line2D([], [], color=colour[s], lw=2, label=s) for s in series]
    handles += [
        Line2D([], [], linestyle="none", marker=marker[m], color="0.3", markerfacecolor="0.3", label=m)
        for m in machines
    ]
    kinds = {bool(r.get("source")) for _, r, _ in points}
    if True in kinds:
        handles.append(Line2D([], [], linestyle="none", marker="o", color="0.3", markerfacecolor="none",
                              label="transcribed run"))  # fmt: skip
    if kinds == {True, False}:
        handles.append(Line2D([], [], linestyle="none", marker="o", color="0.3", label="recorded run"))
    ncol = min(len(handles), 3)
    legend_rows = -(-len(handles) // ncol)
    rows = -(-len(keys) // 2)  # panels two by two: the figure stays within the style's width
    height = 2.8 * rows + 0.25 * legend_rows + 0.3  # inches: the panels, then the legend below them
    days = [x.replace(hour=0, minute=0, second=0, microsecond=0) for x, _, _ in points]
    first_day, last_day = min(days), max(days) + datetime.timedelta(days=1)  # whole days: the runs lie within
    fig, panels = styled(figure_axes)(height=height, nrows=rows, ncols=min(2, len(keys)))
    panels = list(panels) if len(keys) > 1 else [panels]
    for extra in panels[len(keys) :]:
        extra.remove()
    for ax, key in zip(panels, keys):
        for s in series:
            line = [(x, got[(key, s)], r) for x, r, got in points if (key, s) in got]
            if not line:
                continue
            ax.plot([x for x, _, _ in line], [y for _, y, _ in line], color=colour[s], lw=0.8, alpha=0.45)
            for x, y, r in line:
                hollow = bool(r.get("source"))
                ax.plot(
                    [x], [y], linestyle="none", marker=marker[machine_id(r.get("machine"))], markersize=5,
                    markeredgecolor=colour[s], markerfacecolor="none" if hollow else colour[s], markeredgewidth=1.1,
                )  # fmt: skip
        ax.set_title(HEADLINES[name][key])
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt(v) if v else "0"))
        ax.set_xlim(first_day, last_day)
        ax.xaxis.set_major_locator(mdates.DayLocator(interval=max(1, (last_day - first_day).days // 6)))
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%m-%d"))
        ax.grid(alpha=0.3, lw=0.5)
    styled(fig.legend)(handles=handles, loc="outside lower center", ncol=ncol, frameon=False)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save(fig, path)
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for benchmarks.md and benchmarks/<benchmark>.png")
    ap.add_argument("--results", default=str(RESULTS), help="the records (default: benchmarks/results)")
    args = ap.parse_args(argv)
    runs = load_runs(args.results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmarks.md").write_text(page(runs))
    for name, records in runs.items():
        plot(name, records, out / "benchmarks" / f"{name}.png")
    print(f"{out / 'benchmarks.md'}: {sum(map(len, runs.values()))} runs of {len(runs)} benchmarks")


if __name__ == "__main__":
    main()
