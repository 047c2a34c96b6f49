"""The three studies of analyses/ run end to end (a real trace of one small workload) and
write their figures, markdown and JSON."""

from __future__ import annotations

import json
import subprocess

import pytest

from .conftest import ROOT, script_python


@pytest.mark.slow
def test_studies_write_figures_and_summaries(tmp_path):
    common = ["--workloads", "niah", "--context", "384", "--results", str(tmp_path)]

    def start(script: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen(
            [script_python(), str(ROOT / "analyses" / f"{script}.py"), *common, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip

    def finished(proc: subprocess.Popen) -> None:
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-2000:]

    finished(start("workload_traces"))
    # the three studies only read the traces: run side by side
    studies = [
        start("observation"),
        start("logpeaks"),
        start("policies", "--budgets", "0.2,0.5", "--policies", "streaming,h2o,qevict,oracle"),
    ]
    for proc in studies:
        finished(proc)
    obs = json.loads((tmp_path / "observation" / "summary.json").read_text())["workloads"]["niah"]
    assert 0 <= obs["fmm32"] <= 1 and 0 < obs["top10_mass"] <= 1 and len(obs["fmm_layer"]) == 30
    peaks = json.loads((tmp_path / "logpeaks" / "summary.json").read_text())["workloads"]["niah"]
    assert peaks["alpha"] > 0 and peaks["best_model"] in ("power", "exponential", "uniform")
    pol = json.loads((tmp_path / "policies" / "summary.json").read_text())["workloads"]["niah"]
    assert len(pol["rows"]) == 8 and len(pol["full_kv_task_scores"]) == 3
    assert all(0 <= s <= 1 for s in pol["full_kv_task_scores"])
    for study, figure in (
        ("observation", "per_layer.png"),
        ("logpeaks", "alpha_and_coverage.png"),
        ("policies", "niah.png"),
    ):
        assert (tmp_path / study / figure).stat().st_size > 10_000
        assert "| " in (tmp_path / study / "summary.md").read_text()
