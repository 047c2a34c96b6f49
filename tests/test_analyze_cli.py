"""`kvscope analyze` on a real SmolLM2 trace of prose, via subprocess: tables, JSON, plots,
a LocalCluster run, and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvscope

from .conftest import run_cli, run_main

ANALYSES = ["fmm", "lir", "churn", "peaks", "concentration", "drift"]


@pytest.fixture(scope="module")
def prose_trace(prompts_qkv_trace):
    """The session's SmolLM2 trace of three prose prompts (CIs over prompts), 40 steps."""
    return prompts_qkv_trace


@pytest.mark.slow
@pytest.mark.parametrize("name", ANALYSES)
def test_each_analysis_table_json_plot(tmp_path, prose_trace, name):
    fast = ["--bootstrap", "100"] if name in ("fmm", "lir", "churn", "peaks") else []  # metrics with an interval
    table = run_cli("analyze", name, prose_trace, *fast, check=True)  # a real process for each analysis
    assert name in table.stdout and "quantity" in table.stdout
    png = tmp_path / f"{name}.png"
    proc = run_main("analyze", name, prose_trace, "--json", "--plot", png, *fast)  # the same main, in process
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["analysis"] == name
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    if name == "fmm":
        assert 0 <= doc["fmm"] <= 1 and doc["ci95"][0] <= doc["fmm"] <= doc["ci95"][1]
        assert list(doc["curve"]) == ["1", "2", "4", "8", "16", "32"]
    if name == "peaks":
        # LogQuant's observation on real prose: a finite, positive decay exponent
        assert doc["alpha"] is not None and 0 < doc["alpha"] < 5
        assert doc["ci95"][0] <= doc["alpha"] <= doc["ci95"][1]
        assert set(doc["aic"]) == {"power", "exponential", "uniform"}
    if name == "lir":
        assert 0 <= doc["p01"] <= 1 and 0 <= doc["p10"] <= 1


@pytest.mark.slow
def test_local_cluster_matches_in_process(prose_trace):
    plain = json.loads(run_cli("analyze", "fmm", prose_trace, "--json", "--layers", "0-5", check=True).stdout)
    dist = json.loads(
        run_cli("analyze", "fmm", prose_trace, "--json", "--layers", "0-5", "--dask", "local:2", check=True).stdout
    )
    assert dist["fmm"] == plain["fmm"] and dist["curve"] == plain["curve"]
    assert len(plain["per_layer"]) == 6


@pytest.mark.slow
def test_layer_and_head_subsets(prose_trace):
    doc = json.loads(
        run_cli(
            "analyze", "lir", prose_trace, "--json", "--layers", "3,7", "--heads", "1", "--h-lir", "none", check=True
        ).stdout
    )
    assert len(doc["per_layer"]) == 2 and doc["H_lir"] == "none"
    ds = kvscope.open_trace(prose_trace)
    assert np.isfinite(ds.attn.sel(layer=3, kv_head=1).isel(sample=0, step=0).sum("pos"))


def _one_line(proc, needle):
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvscope: error: ") and needle in lines[0], proc.stderr


def test_analyze_bad_input(tmp_path, prose_trace):
    _one_line(run_cli("analyze", "fmm", tmp_path / "missing.zarr"), "no trace store at")
    _one_line(run_main("analyze", "entropy", prose_trace), "invalid choice: 'entropy'")
    _one_line(run_main("analyze", "fmm", prose_trace, "--horizon", "0"), "--horizon must be ≥ 1")
    _one_line(run_main("analyze", "fmm", prose_trace, "--top-frac", "1.5"), "--top-frac must lie in (0, 1)")
    _one_line(run_main("analyze", "churn", prose_trace, "--top-frac", "0"), "--top-frac must lie in (0, 1)")
    _one_line(run_main("analyze", "lir", prose_trace, "--layers", "99"), "--layers outside 0..29")
    _one_line(run_main("analyze", "fmm", prose_trace, "--dask", "nowhere"), "--dask takes local:N or tcp://")
    _one_line(run_main("analyze", "fmm", prose_trace, "--window", "6"), "--window must be a positive multiple of 4")


@pytest.mark.slow
def test_existing_scheduler_over_tcp(prose_trace):
    """`--dask tcp://…` sends the same graph to a scheduler the CLI did not start."""
    from distributed import LocalCluster

    plain = json.loads(run_cli("analyze", "churn", prose_trace, "--json", "--layers", "0-3", check=True).stdout)
    with LocalCluster(
        n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None, protocol="tcp://", host="127.0.0.1"
    ) as cluster:
        assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
        remote = json.loads(
            run_cli(
                "analyze",
                "churn",
                prose_trace,
                "--json",
                "--layers",
                "0-3",
                "--dask",
                cluster.scheduler_address,
                check=True,
            ).stdout
        )
    assert remote["churn"] == plain["churn"] and remote["per_layer"] == plain["per_layer"]
