"""The transfer study (analyses/offline_vs_live.py): its rank statistics by hand on records
whose rankings are known, and the script end to end on a tiny grid (real traces, replays and
live decodes of SmolLM2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import ROOT, script_python

sys.path.insert(0, str(ROOT / "analyses"))
import offline_vs_live as study


def _records(offline: list[float], live: list[float], samples: int = 2) -> list[dict]:
    """One workload, one budget; policy ``p{i}`` has offline FMM ``offline[i]`` and live KL
    ``live[i]`` on every sample."""
    return [
        {"workload": "w", "sample": s, "policy": f"p{i}", "budget": 0.5, "fmm": x, "kl": y}
        for s in range(samples)
        for i, (x, y) in enumerate(zip(offline, live))
    ]


def test_rank_correlations_by_hand():
    # one swapped pair of four: τ = (5 concordant − 1 discordant) / 6, ρ = 1 − 6·Σd² / (n(n²−1)) = 1 − 12/60
    table = study.transfer(_records([1, 2, 3, 4], [1, 3, 2, 4]), "w")["fmm|kl"]
    for key, value in (("tau", 4 / 6), ("rho", 0.8), ("tau_within", 4 / 6), ("rho_within", 0.8)):
        point, low, high = table[key]
        assert point == pytest.approx(value, abs=1e-4) and low == point == high  # identical prompts: no spread
    assert study.transfer(_records([1, 2, 3, 4], [4, 3, 2, 1]), "w")["fmm|kl"]["tau"][0] == -1.0
    assert study.transfer(_records([1, 2, 3, 4], [10, 20, 30, 40]), "w")["fmm|kl"]["rho"][0] == 1.0
    assert study.transfer(_records([1, 1, 1, 1], [1, 2, 3, 4]), "w")["fmm|kl"]["tau"][0] is None  # no ranking


def test_the_largest_rank_differences_come_first():
    rows = study.breaks(_records([1, 2, 3, 4, 5], [1, 5, 3, 4, 2]), "w", "fmm", "kl", top=2)
    assert {(r["policy"], r["offline_rank"], r["live_rank"]) for r in rows} == {("p1", 2, 5), ("p4", 5, 2)}


def test_merge_gives_losses():
    offline = [{"workload": "w", "sample": 0, "policy": "h2o", "budget": 0.2, "fmm": 0.1}]
    live = [{"workload": "w", "sample": 0, "policy": "h2o", "budget": 0.2, "agreement": 0.75, "score": 1.0, "kl": 2}]
    (row,) = study._merge(offline, live)
    assert row["disagreement"] == 0.25 and row["score_loss"] == 0.0 and row["fmm"] == 0.1 and row["kl"] == 2


@pytest.mark.slow
def test_the_study_end_to_end(tmp_path):
    args = [
        "--workloads", "passkey", "--context", "128", "--prompts", "2", "--budgets", "0.5",
        "--policies", "streaming,press:KnormPress", "--workers", "1", "--steps", "20", "--results", str(tmp_path),
        "--doc", str(tmp_path / "page.md"), "--figure", str(tmp_path / "figure.png"),
    ]  # fmt: skip
    proc = subprocess.run(
        [script_python(), str(ROOT / "analyses" / "offline_vs_live.py"), *args],
        capture_output=True, text=True, cwd=ROOT, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "offline_vs_live" / "summary.json").read_text())
    assert len(doc["records"]) == 4  # 2 policies × 1 budget × 2 prompts, offline and live in one record
    for r in doc["records"]:
        assert 0 <= r["fmm"] <= 1 and r["kl"] >= 0 and 0 <= r["agreement"] <= 1 and r["score"] in (0.0, 1.0)
        assert r["output_rel_l2"] > 0 and r["bytes"] <= 0.5 * (1 + 1e-9)
        # forced replay is the live forced decode: its mean KL is kvscope run's
        assert r["forced_kl"] == pytest.approx(r["kl"], abs=1e-4) and r["converged"]
    w = doc["workloads"]["passkey"]
    assert set(w["transfer"]) == {f"{o}|{m}" for o in study.OFFLINE for m in study.LIVE} | {"kl|score_loss"}
    assert w["rounds"]["runs"] == 4 and w["rounds"]["converged"] == 4
    assert doc["cost"]["ratio"] > 0 and w["best"] in study.OFFLINE
    assert (tmp_path / "figure.png").stat().st_size > 10_000 and "| streaming |" in (tmp_path / "page.md").read_text()
    # run again: every part is read back (one offline part, one live part per prompt), nothing decoded anew
    parts = sorted(p.relative_to(tmp_path / "offline_vs_live" / "parts").parent.name.split("-")[0] + "/" + p.name
                   for p in (tmp_path / "offline_vs_live" / "parts").rglob("*.json"))  # fmt: skip
    assert parts == ["live/passkey-0.json", "live/passkey-1.json", "offline/passkey.json"]
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "offline_vs_live" / "parts").rglob("*.json")}
    again = subprocess.run(
        [script_python(), str(ROOT / "analyses" / "offline_vs_live.py"), *args],
        capture_output=True, text=True, cwd=ROOT, timeout=900, check=False,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((tmp_path / "offline_vs_live" / "summary.json").read_text())["records"] == doc["records"]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
