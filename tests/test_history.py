"""The benchmark records (``benchmarks/results/*.jsonl``) and the history page made of them
(``benchmarks/history.py``); ``benchmarks/record.py append`` for a report written elsewhere."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TRANSCRIBED = "transcribed from the README's benchmark log"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


history = _module("history")
record = _module("record")


def _section(text: str, name: str) -> str:
    start = text.index(f"## {name} {{#{name}}}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def _all_runs_rows(section: str) -> list[list[str]]:
    """The cells of the collapsible table of all runs (its data rows)."""
    rows = [line.strip() for line in section.splitlines() if line.startswith("    | ")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows[1:]]  # after the header


def test_every_committed_record_has_the_required_keys_and_the_files_are_in_date_order():
    files = sorted(RESULTS.glob("*.jsonl"))
    assert files
    for path in files:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        assert records, path.name
        for r in records:
            assert {"date", "benchmark", "machine", "figures"} <= set(r), (path.name, r.get("date"))
            assert r["benchmark"] == path.stem
            assert isinstance(r["machine"], dict) and r["machine"], (path.name, r["date"])
            history.parse_date(r["date"])  # readable
            if "source" in r:  # a run transcribed from the written log: its figures as printed, no invented commit
                assert r["source"] == TRANSCRIBED
            else:  # a run recorded by record.py
                assert {"code", "command"} <= set(r) and r["code"].get("commit"), (path.name, r["date"])
        keys = [history.date_key(r) for r in records]
        assert keys == sorted(keys), f"{path.name} is not in date order"


def test_the_page_names_every_benchmark_and_shows_each_ones_latest_headline_values():
    runs = history.load_runs(RESULTS)
    text = history.page(runs)
    for name, records in runs.items():
        section = _section(text, name)
        latest = history.latest(records)  # valid, and not the baseline of a comparison
        assert latest is [r for r in records if history.valid(r) and not r.get("baseline")][-1]
        figures = history.headline(name, latest)
        assert figures, f"{name}: its latest run has no headline figure"
        for (key, series), value in figures.items():
            assert f"| {history.series_label(name, key, series)} | {history.fmt(value)} |" in section.replace(
                "\\|", "|"
            )
        assert f"All {len(records)} run" in section
    # concrete values: the first transcribed trace overhead, the verify run recorded on 2026-12-04
    assert "| 1.158 | — | 1.476 | — | 1.226 | — |" in _section(text, "trace_overhead")
    assert "| 1.25 |" in _section(text, "verify_speed")
    # an image is referenced only where its plot is drawn, always relative to the page
    for name in re.findall(r"\]\(benchmarks/(\w+)\.png\)", text):
        assert history._points(name, runs[name])
    assert "](../" not in text and "](/" not in text
    words = re.compile(r"\b(other|another) agents?\b|\blent\b|\ballowances?\b|\bsessions?\b", re.IGNORECASE)
    assert not words.search(text)


def _write(folder: Path, name: str, records: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


TWO = [
    {
        "date": "2026-12-02T10:00:00+00:00",
        "benchmark": "verify_speed",
        "code": {"commit": "abc1234", "changed": False},
        "machine": {"processor": "Test CPU", "cores": 2, "load_1min": 0.5},
        "command": "python benchmarks/verify_speed.py",
        "figures": {"store": "/tmp/kvscope-bench/verify-2.zarr", "read_s": 1.0, "verify_s": 1.21, "ratio": 1.21},
    },
    {
        "date": "2026-12-01",
        "benchmark": "verify_speed",
        "machine": {"cores": 2, "load": "≈ 2"},
        "figures": {"store": "synthetic", "read_s": 0.93, "verify_s": 1.07, "ratio": 1.15},
        "source": TRANSCRIBED,
        "note": "before the tuning",
    },
]


def test_a_page_of_two_hand_written_records_holds_exactly_their_values(tmp_path):
    _write(tmp_path / "results", "verify_speed", TWO)
    runs = history.load_runs(tmp_path / "results")
    assert [r["date"] for r in runs["verify_speed"]] == ["2026-12-01", "2026-12-02T10:00:00+00:00"]  # date order
    section = _section(history.page(runs), "verify_speed")
    assert _all_runs_rows(section) == [
        ["2026-12-01", "CPU, 2 cores", "≈ 2", "1.15", "1.07", "(transcribed) before the tuning"],
        ["2026-12-02T10:00:00+00:00", "Test CPU, 2 cores", "0.5", "1.21", "1.21", "—"],
    ]
    assert "| verify / plain read, synthetic store | 1.21 |" in section  # the latest run
    assert "| commit | `abc1234` |" in section and "| command | `python benchmarks/verify_speed.py` |" in section
    assert "![verify_speed: headline figures over time](benchmarks/verify_speed.png)" in section
    png = tmp_path / "site" / "benchmarks" / "verify_speed.png"
    assert history.plot("verify_speed", runs["verify_speed"], png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 150_000


def test_a_record_missing_a_headline_figure_is_skipped_without_error(tmp_path):
    lacking = [
        {**TWO[0], "figures": {"store": "/tmp/kvscope-bench/verify-2.zarr", "read_s": 1.0}},  # no ratio, no verify_s
        {**TWO[1], "figures": ["not", "a", "dict"]},
    ]
    _write(tmp_path, "verify_speed", lacking)
    _write(tmp_path, "trace_overhead", [{**TWO[0], "benchmark": "trace_overhead", "figures": {"kernel": None}}])
    _write(tmp_path, "scale", [{**TWO[0], "benchmark": "scale", "figures": {"rows": [{"context": 4096}]}}])
    runs = history.load_runs(tmp_path)
    text = history.page(runs)
    for name in runs:
        assert f"## {name} {{#{name}}}" in text
        assert f"benchmarks/{name}.png" not in text  # nothing to plot, so no image
        assert not history.plot(name, runs[name], tmp_path / f"{name}.png")
        assert not (tmp_path / f"{name}.png").exists()
    # one figure present, another missing: the present one is shown, the other cell is blank
    _write(tmp_path / "two", "verify_speed", [TWO[0], {**TWO[1], "figures": {"store": "synthetic", "ratio": 1.15}}])
    runs = history.load_runs(tmp_path / "two")
    rows = _all_runs_rows(_section(history.page(runs), "verify_speed"))
    assert [row[3:5] for row in rows] == [["1.15", "—"], ["1.21", "1.21"]]
    assert history.plot("verify_speed", runs["verify_speed"], tmp_path / "v.png")


def test_the_committed_history_is_drawn_small_and_written_by_the_command_line(tmp_path):
    history.main(["--out", str(tmp_path)])
    text = (tmp_path / "benchmarks.md").read_text()
    for name in re.findall(r"\]\(benchmarks/(\w+)\.png\)", text):
        png = tmp_path / "benchmarks" / f"{name}.png"
        assert png.stat().st_size < 150_000, name


@pytest.mark.parametrize("elsewhere", [False, True])
def test_record_append_adds_a_report_written_elsewhere(tmp_path, monkeypatch, elsewhere):
    report = {"device": "cuda", "device_name": "NVIDIA H200", "torch": "2.11.0+cu130", "overhead": []}
    (tmp_path / "gpu_check.json").write_text(json.dumps(report))
    monkeypatch.setattr(record, "RESULTS", tmp_path / "results")
    argv = ["append", "gpu_check", str(tmp_path / "gpu_check.json"), "--note", "a check"]
    if elsewhere:
        argv += ["--elsewhere", "--machine", "cores=16", "load=idle apart from the run", "--date", "2026-12-04"]
    record.main(argv)
    (line,) = (tmp_path / "results" / "gpu_check.jsonl").read_text().splitlines()
    r = json.loads(line)
    assert r["figures"] == report and r["command"] == "bash benchmarks/gpu_check.sh" and r["note"] == "a check"
    assert r["machine"]["gpu"] == "NVIDIA H200" and "load_1min" not in r["machine"]
    if elsewhere:
        assert r["machine"] == {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "cores": 16,
                                "load": "idle apart from the run"}  # fmt: skip
        assert r["date"] == "2026-12-04"
    else:
        assert r["machine"]["cores"] and "processor" in r["machine"]
    assert history.headline("gpu_check", r) == {}  # no overhead rows: nothing to show, no error


def test_todays_figures_come_from_the_latest_run_that_measured_each_never_from_a_baseline(tmp_path):
    """Three hand-written runs: the first measures both figures, the second only the ratio, the
    third (the latest) measured the code before a change. Today: the second's ratio with its
    command, the first's verify time with the benchmark's default command (it recorded none)."""
    third = {**TWO[0], "date": "2026-12-03", "figures": {"store": "synthetic", "ratio": 9.9}, "baseline": True}
    _write(tmp_path, "verify_speed", [TWO[1], TWO[0] | {"figures": {"store": "synthetic", "ratio": 1.21}}, third])
    runs = history.load_runs(tmp_path)
    today = history.current("verify_speed", runs["verify_speed"])
    assert {k: v for k, (v, _) in today.items()} == {
        ("ratio", "synthetic store"): 1.21,
        ("verify_s", "synthetic store"): 1.07,
    }
    assert history.today_table("verify_speed", runs["verify_speed"]).splitlines() == [
        "| figure | today | measured | reproduce |",
        "|---|---|---|---|",
        "| verify / plain read, synthetic store | 1.21 | 2026-12-02, Test CPU, 2 cores | `python benchmarks/verify_speed.py` |",
        "| verify (s), synthetic store | 1.07 | 2026-12-01, CPU, 2 cores | `python benchmarks/verify_speed.py` |",
    ]
    assert history.latest(runs["verify_speed"])["figures"]["ratio"] == 1.21  # the history page's latest run too
    text = "before\n\n<!-- today: verify_speed -->\n\nafter\n"
    assert history.fill_today(text, runs) == (
        "before\n\n" + history.today_table("verify_speed", runs["verify_speed"]) + "\n\nafter\n"
    )
    with pytest.raises(ValueError, match="no benchmarks/results/scale.jsonl"):
        history.fill_today("<!-- today: scale -->", runs)


def test_the_performance_page_shows_todays_figures_of_every_benchmark_and_no_lab_log():
    """docs/performance.md names the benchmarks whose figures it shows (generated when the site is
    built: docs/gen_pages.py); every benchmark with records but the A/B of two code versions is
    there, each figure with the command that reproduces it. The page itself holds no dated
    figure and no commit; the lab log it replaced is gone from the docs."""
    source = (ROOT / "docs" / "performance.md").read_text()
    runs = history.load_runs(RESULTS)
    shown = history.TODAY.findall(source)
    assert sorted(shown) == sorted(set(runs) - {"replay_speed_ab"})
    page = history.fill_today(source, runs)
    for name in shown:
        for (key, series), (value, run) in history.current(name, runs[name]).items():
            command = run.get("command") or record.default_command(name)
            row = f"| {history.series_label(name, key, series)} | {history.fmt(value)} | "
            assert row in page.replace("\\|", "|") and f"`{command}`" in page, (name, key, series)
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", source), "dates belong in the records"
    assert not re.search(r"\b[0-9a-f]{7}\b", source), "commits belong in the records"
    assert not re.search(r"\b(morning|afternoon|evening|tonight|yesterday)\b", source, re.IGNORECASE)
    assert not (ROOT / "docs" / "performance-log.md").exists()
    for path in [ROOT / "README.md", ROOT / "mkdocs.yml", *(ROOT / "docs").rglob("*.md")]:
        assert "performance-log" not in path.read_text(), path.name
