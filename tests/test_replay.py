"""Replay against a real SmolLM2 trace with q/k/v: budgets hold, `full` is exact, the oracle
bounds every causal policy, quantizing beats evicting the same set (LogQuant's Table 2
direction), the analyses take replayed tiers, and the CLI works end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvscope
from kvscope import analysis
from kvscope.policies import CacheState, Ledger, make
from kvscope.replay import effective_kv, tiers_for
from kvscope.replay.output_error import against_full, reference

from .conftest import run_cli

POLICIES = ["full", "streaming", "h2o", "snapkv", "kivi", "logquant", "qevict", "oracle"]
BUDGETS = [0.3, 0.6]


@pytest.fixture(scope="module")
def qkv_trace(tmp_path_factory, smollm2_dir):
    import pydoc_data.topics as topics

    out = tmp_path_factory.mktemp("replay") / "prose-qkv.zarr"
    text = topics.topics["assignment"][:1500]
    kvscope.trace(text, out, max_new_tokens=64, stop_at_eos=False, block_steps=16, record_qkv=True)
    return out


@pytest.fixture(scope="module")
def result(qkv_trace):
    return kvscope.replay(qkv_trace, POLICIES, BUDGETS, validate=True)


def test_result_layout_and_budgets(result, qkv_trace):
    ds = kvscope.open_trace(qkv_trace)
    assert list(result["policy"].values) == POLICIES and list(result["budget"].values) == BUDGETS
    assert result["tiers"].dims == ("policy", "budget", "sample", "event", "layer", "kv_head", "pos")
    assert result.sizes["event"] == 8 and result.sizes["layer"] == 30 and result.sizes["kv_head"] == 3
    reached = result["budget_reached"].to_series()
    assert not reached["full"].any()
    # on a ~400-token sequence every other policy reaches both budgets
    assert reached.drop("full").all(), reached
    for p in POLICIES[1:]:
        for b in BUDGETS:
            used = result["bytes_used"].sel(policy=p, budget=b).isel(sample=0)
            assert float(used.max()) <= float(result["budget_bytes"].sel(budget=b).isel(sample=0)) * (1 + 1e-9)
            assert float(result["byte_ratio_used"].sel(policy=p, budget=b)) <= b + 1e-9
    assert float(result["byte_ratio_used"].sel(policy="full", budget=0.3)) == pytest.approx(1.0, abs=0.01)
    # tiers exist exactly for the positions the cache holds at each event
    qpos = ds["query_pos"].values[0, result["event_step"].values]
    tiers = result["tiers"].sel(policy="h2o", budget=0.3).isel(sample=0).values
    for e, q in enumerate(qpos):
        assert (tiers[e, ..., : q + 1] >= 0).all() and (tiers[e, ..., q + 1 :] == -1).all()


def test_full_is_exact(result):
    full = result.sel(policy="full")
    assert float(np.nanmax(full["fmm"].values)) == 0.0 and float(np.nanmax(full["fmm_fp"].values)) == 0.0
    assert float(np.nanmax(full["attn_l1"].values)) == 0.0
    assert float(np.nanmax(full["output_rel_l2"].values)) == 0.0
    assert float(np.nanmin(full["tier_mass"].sel(tier="FP").values)) == pytest.approx(1.0)


def test_oracle_bounds_every_causal_policy(result):
    for b in BUDGETS:
        oracle = result["fmm_fp"].sel(policy="oracle", budget=b).values
        for p in POLICIES[1:-1]:
            other = result["fmm_fp"].sel(policy=p, budget=b).values
            both = np.isfinite(oracle) & np.isfinite(other)
            assert both.any()
            assert (oracle[both] <= other[both] + 1e-9).all(), p  # per event and trace unit
            assert float(result["fmm_fp_mean"].sel(policy="oracle", budget=b)) <= float(
                result["fmm_fp_mean"].sel(policy=p, budget=b)
            )


def test_quantizers_lose_no_mass_and_evictors_serve_no_q(result):
    for p in ("kivi", "logquant"):
        assert float(np.nanmax(result["fmm"].sel(policy=p).values)) == 0.0
        assert float(result["tier_mean"].sel(policy=p, budget=0.3, tier="Q")) > 0
    for p in ("streaming", "h2o", "snapkv", "oracle"):
        assert float(result["tier_mean"].sel(policy=p, budget=0.3, tier="Q")) == 0
    # a bigger budget never loses more
    for p in ("streaming", "h2o", "oracle"):
        assert float(result["fmm_mean"].sel(policy=p, budget=0.6)) <= float(
            result["fmm_mean"].sel(policy=p, budget=0.3)
        )


def test_quantizing_a_set_beats_evicting_it(qkv_trace, result):
    """The set that streaming evicts at β = 0.3, quantized to 2 bits instead: the attention
    distribution moves much less (the direction of LogQuant's Table 2)."""
    import torch

    ds = kvscope.open_trace(qkv_trace)
    rules = ds.kvscope.model.rules()
    P, S = int(ds["prompt_len"].values[0]), int(ds["n_steps"].values[0])
    k = ds["k"].isel(sample=0, pos=slice(0, P + S)).values.astype(np.float32)
    v = ds["v"].isel(sample=0, pos=slice(0, P + S)).values.astype(np.float32)
    policy = make("full")
    l1 = {"evict": [], "quantize": []}
    for e in (3, 5, 7):
        t = int(result["event_step"].values[e]) + 1
        qpos = P - 1 + t
        tiers = result["tiers"].sel(policy="streaming", budget=0.3).isel(sample=0, event=e).values[..., : P + S]
        gone = tiers[0, 0, :qpos] == 0  # streaming decides by position: the same set in every head
        assert gone.sum() > 50
        query = ds["q"].isel(sample=0, qpos=qpos).values.astype(np.float32)
        ref = reference(rules, query, torch.from_numpy(k), torch.from_numpy(v), qpos)
        for how in l1:
            spec = kvscope.policies.CacheSpec(30, 3, 64, P, P + S, 1.0)
            ledger = Ledger(spec, 2, "channel", k=k, v=v) if how == "quantize" else None
            state = CacheState(policy, spec, ledger)
            state.tiers[..., : qpos + 1] = 2
            if how == "quantize":
                positions = np.nonzero(gone)[0]
                for group in np.array_split(positions, max(1, len(positions) // 32)):
                    ledger.quantize(group)
                state.tiers[..., positions] = 1
            else:
                state.tiers[..., np.nonzero(gone)[0]] = 0
            state.length = qpos + 1
            _, err, _ = against_full(rules, state, ref, torch.from_numpy(k), torch.from_numpy(v), qpos)
            l1[how].append(float(err.mean()))
    assert np.mean(l1["quantize"]) < 0.5 * np.mean(l1["evict"]), l1


def test_observe_exact_runs_and_keeps_full_exact(qkv_trace):
    r = kvscope.replay(qkv_trace, ["full", "h2o"], [0.3], observe="exact")
    assert r.attrs["observe"] == "exact"
    assert float(np.nanmax(r["attn_l1"].sel(policy="full").values)) == 0.0
    assert 0 < float(r["fmm_mean"].sel(policy="h2o", budget=0.3)) < 1


def test_analyses_take_replayed_tiers(qkv_trace, result):
    ds = kvscope.open_trace(qkv_trace, chunks={})
    tiers = tiers_for(result, "qevict", 0.3)
    fmm = analysis.fmm(ds, granularity="token", tiers=tiers, n_boot=50)
    assert float(fmm["mean"]) == pytest.approx(float(result["fmm_mean"].sel(policy="qevict", budget=0.3)), abs=1e-6)
    tm = fmm["tier_mean"].values
    assert np.allclose(tm, result["tier_mean"].sel(policy="qevict", budget=0.3).values, atol=1e-6)
    # replay's streaming form of FMM equals the analysis layer's, event by event and per horizon
    mine = result.sel(policy="qevict", budget=0.3)
    np.testing.assert_allclose(fmm["tier_mass"].values, mine["tier_mass"].values, atol=1e-12)
    np.testing.assert_allclose(fmm["curve"].values, mine["fmm_curve"].values, atol=1e-12)
    sel = analysis.selection_from_tiers(tiers, accessible=False)
    churn = analysis.churn(ds, granularity="token", selection=sel, n_boot=20)
    assert 0 <= float(churn["mean"]) <= 1


def test_effective_kv_of_an_evicting_policy_drops_keys(qkv_trace, result):
    ds = kvscope.open_trace(qkv_trace)
    P, S = int(ds["prompt_len"].values[0]), int(ds["n_steps"].values[0])
    k = np.zeros((30, 3, P + S, 64), np.float32)
    spec = kvscope.policies.CacheSpec(30, 3, 64, P, P + S, 1.0)
    state = CacheState(make("streaming"), spec)
    state.tiers[..., :10] = [2, 2, 0, 0, 1, 2, 2, 2, 2, 2]
    state.length = 10
    _, _, present = effective_kv(state, k, k, 10)
    assert present[0, 0].tolist() == [True, True, False, False, True] + [True] * 5


def test_cli_replay_compare_and_analyze(tmp_path, qkv_trace):
    out = tmp_path / "result.zarr"
    proc = run_cli(
        "replay", qkv_trace, "--policies", "streaming,h2o,qevict:q_frac=0.5,kivi,oracle", "--budgets", "0.3,0.6",
        "--out", out, "--json", check=True,
    )  # fmt: skip
    doc = json.loads(proc.stdout)
    assert len(doc["rows"]) == 10 and doc["out"] == str(out)
    row = next(r for r in doc["rows"] if r["policy"] == "qevict:q_frac=0.5" and r["budget"] == 0.3)
    assert row["budget_reached"] and 0 < row["byte_ratio"] <= 0.3 and row["attn_l1"] > 0
    table = run_cli("compare", out, "--plot", tmp_path / "cmp.png", check=True)
    assert "FMM@32" in table.stdout and "oracle" in table.stdout
    assert (tmp_path / "cmp.png").stat().st_size > 10_000
    again = json.loads(run_cli("compare", out, "--json", check=True).stdout)
    assert again["rows"] == doc["rows"]
    fmm = json.loads(
        run_cli("analyze", "fmm", qkv_trace, "--policy", "h2o", "--budget", "0.3", "--json", check=True).stdout
    )
    h2o = next(r for r in doc["rows"] if r["policy"] == "h2o" and r["budget"] == 0.3)
    assert fmm["selection"] == "h2o@0.3" and fmm["fmm"] == pytest.approx(h2o["fmm"], abs=1e-5)
    for name in ("lir", "churn"):
        run_cli("analyze", name, qkv_trace, "--policy", "qevict", "--budget", "0.3", "--json", check=True)


def test_cli_bad_input(tmp_path, qkv_trace):
    from kvscope.synthetic import write_synthetic_store

    plain = write_synthetic_store(tmp_path / "plain.zarr", n_samples=1, n_steps=16, n_layers=2, n_kv=2, prompt_len=24)
    out = tmp_path / "exists.zarr"
    out.mkdir()
    cases = [
        (("replay", qkv_trace, "--policies", "nope", "--budgets", "0.3"), "unknown policy"),
        (("replay", qkv_trace, "--policies", "h2o", "--budgets", "0"), "(0, 1]"),
        (("replay", qkv_trace, "--policies", "h2o", "--budgets", "1.5"), "(0, 1]"),
        (("replay", qkv_trace, "--policies", "h2o", "--budgets", "x"), "budget"),
        (("replay", qkv_trace, "--policies", "h2o:q_frac=1", "--budgets", "0.3"), "no parameter"),
        (("replay", plain, "--policies", "h2o", "--budgets", "0.3", "--observe", "exact"), "q/k/v"),
        (("replay", qkv_trace, "--policies", "h2o", "--budgets", "0.3", "--observe", "sideways"), "observe"),
        (("replay", qkv_trace, "--policies", "h2o", "--budgets", "0.3", "--out", out), "exists"),
        (("replay", tmp_path / "missing.zarr", "--policies", "h2o", "--budgets", "0.3"), "missing.zarr"),
        (("compare", plain), "not a kvscope replay result"),
        (("analyze", "fmm", qkv_trace, "--policy", "h2o"), "go together"),
        (("analyze", "peaks", qkv_trace, "--policy", "h2o", "--budget", "0.3"), "fmm, lir and churn"),
    ]
    for args, words in cases:
        proc = run_cli(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr, (args, proc.stderr)
    assert not any(out.iterdir())  # an existing --out is never touched
    kvscope.open_trace(qkv_trace)  # and the trace still opens
