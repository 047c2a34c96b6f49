"""Replay against a real SmolLM2 trace with q/k/v: budgets hold, `full` is exact, the oracle
bounds every causal policy, quantizing beats evicting the same set (LogQuant's Table 2
direction), the analyses take replayed tiers, and the CLI works end to end."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import tempfile

import dask.array as da
import numpy as np
import pytest

import kvscope
from kvscope import analysis
from kvscope.analysis.churn import churn_kernel, valid_events
from kvscope.analysis.common import selection_codes
from kvscope.analysis.lir import lir_kernel, transition_counts
from kvscope.errors import KvscopeError
from kvscope.policies import CacheState, Ledger, make
from kvscope.replay import effective_kv, open_result, tiers_for
from kvscope.replay.output_error import against_full, attended, reference
from kvscope.replay.store import rename_into_place, written_in_place
from kvscope.storage.synthetic import write_synthetic_store

from .conftest import ROOT, run_cli, run_main

POLICIES = ["full", "streaming", "h2o", "snapkv", "kivi", "logquant", "qevict", "oracle"]
BUDGETS = [0.3, 0.6]


@pytest.fixture(scope="module")
def replayed(qkv_trace):
    return kvscope.replay(qkv_trace, POLICIES, BUDGETS, validate=True)


@pytest.fixture(scope="module")
def result(replayed):
    """The runs under the default allocation (uniform), the allocation dim selected away."""
    return replayed.sel(allocation="uniform")


def test_result_layout_and_budgets(replayed, result, qkv_trace):
    ds = kvscope.open_trace(qkv_trace)
    assert list(result["policy"].values) == POLICIES and list(result["budget"].values) == BUDGETS
    assert list(replayed["allocation"].values) == ["uniform"]
    assert replayed["tiers"].dims == ("policy", "allocation", "budget", "sample", "event", "layer", "kv_head", "pos")
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


@pytest.mark.parametrize("d", [8, 64])
def test_evicted_errors_batched_are_each_runs_own(d):
    """The errors of caches that only evicted, measured together (query rows of all runs stacked,
    V read once), in batches of any size: bit for bit each run's own against_full — positions
    in one block and in several, a softcapped layer, a unit that lost nothing (exactly 0); at
    SmolLM2's head_dim 64 too, where MKL sums a 3-row product with another kernel than a larger one."""
    import torch

    from kvscope.model.attention import AttentionRule, LayerRules
    from kvscope.replay import output_error

    rng = np.random.default_rng(5)
    n_l, n_kv, g, n = 2, 2, 3, 300
    rules = LayerRules((AttentionRule(0.35), AttentionRule(0.35, softcap=2.0)))
    query = rng.normal(size=(n_l, n_kv * g, d)).astype(np.float32)
    k, v = (rng.normal(size=(n_l, n_kv, n, d)).astype(np.float16) for _ in range(2))
    spec = kvscope.policies.CacheSpec(n_l, n_kv, d, n - 8, n, 1.0)
    states = []
    for share in (0.2, 0.5, 0.9):
        state = CacheState(make("h2o"), spec, None)
        state.tiers[..., :n] = np.where(rng.random((n_l, n_kv, n)) < share, 2, 0)
        state.tiers[..., -1] = 2
        state.tiers[1, 0, :n] = 2  # this unit holds every key
        state.length = n
        states.append(state)
    presents = [state.accessible() for state in states]
    for block in (None, 64):  # one block of positions; blocks of 64
        with pytest.MonkeyPatch.context() as mp:
            if block:
                mp.setattr(output_error, "SCRATCH_BYTES", 4 * d * block)
            ref = reference(rules, query, k, v, n - 1)
            own = [against_full(rules, st, ref, torch.from_numpy(k), torch.from_numpy(v), n - 1)[1:] for st in states]
            for batch in (1 << 26, 4 * n_l * n_kv * g * n):  # all runs at once, one at a time
                l1, rel = output_error.evicted_errors(rules, ref, presents, batch_bytes=batch)
                for i, (l1_own, rel_own) in enumerate(own):
                    np.testing.assert_array_equal(l1[i], l1_own)
                    np.testing.assert_array_equal(rel[i], rel_own)
        assert (l1[:, 1, 0] == 0).all() and (rel[:, 1, 0] == 0).all() and (l1[:, 0] > 0).all()


def test_attention_in_blocks_of_positions_equals_the_naive_rule():
    """attended() converts fp16 K/V to float32 a block of positions at a time: any block gives
    the whole computation to float32 rounding (the same dot products and sums, grouped by block),
    and all of it is the attention rule computed naively in float64 (one layer with a softcap)."""
    import torch

    from kvscope.model.attention import AttentionRule, LayerRules

    rng = np.random.default_rng(3)
    n_l, n_kv, g, n, d = 2, 2, 3, 37, 8
    rules = LayerRules((AttentionRule(0.35), AttentionRule(0.35, softcap=2.0)))
    q = torch.from_numpy(rng.normal(size=(n_l, n_kv, g, d)).astype(np.float32))
    k, v = (torch.from_numpy(rng.normal(size=(n_l, n_kv, n, d)).astype(np.float16)) for _ in range(2))
    shown = torch.from_numpy(rng.random((n_l, n_kv, 1, n)) < 0.8)
    whole = attended(rules, q, k, v, shown)
    for block in (1, 5, 36):
        parts = attended(rules, q, k, v, shown, block=block)
        for got, want in zip(parts, whole):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-6)
    s = np.einsum("lhgd,lhnd->lhgn", q.numpy().astype(np.float64), k.numpy().astype(np.float64)) * 0.35
    s[1] = 2.0 * np.tanh(s[1] / 2.0)
    s = np.where(shown.numpy(), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(whole[1].numpy(), p, rtol=0, atol=1e-6)
    np.testing.assert_allclose(whole[2].numpy(), p @ v.numpy().astype(np.float64), rtol=0, atol=1e-5)


def test_logquant_table_2_order(qkv_trace):
    """LogQuant's Table 2 as a whole, at equal memory: LogQuant 2-bit < KIVI 2-bit < LogQuant as
    eviction < KIVI as eviction in attention L1 error."""
    r = kvscope.replay(qkv_trace, ["logquant", "kivi", "logquant:evict=true", "kivi:evict=true"], [0.3], n_boot=20)
    l1 = [float(r["attn_l1"].sel(policy=p, budget=0.3).mean()) for p in r["policy"].values]
    assert all(a < b for a, b in zip(l1, l1[1:])), dict(zip(r["policy"].values, l1))
    assert list(r["policy_kind"].values) == ["quantization", "quantization", "eviction", "eviction"]


def test_observe_exact_runs_and_keeps_full_exact(qkv_trace):
    r = kvscope.replay(qkv_trace, ["full", "h2o"], [0.3], observe="exact")
    assert r.attrs["observe"] == "exact"
    assert float(np.nanmax(r["attn_l1"].sel(policy="full").values)) == 0.0
    assert 0 < float(r["fmm_mean"].sel(policy="h2o", allocation="uniform", budget=0.3)) < 1


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


def test_streamed_churn_and_lir_equal_the_kernels_on_the_stored_tiers(qkv_trace, result):
    """Replay keeps churn and LIR incrementally; on the whole tiers it streamed out, the kernels agree."""
    ds = kvscope.open_trace(qkv_trace)
    for policy, budget in (("h2o", 0.3), ("qevict", 0.6), ("oracle", 0.3)):
        mine = result.sel(policy=policy, budget=budget)
        fp = selection_codes(mine["tiers"].values, accessible=False, n_sink=ds.kvscope.n_sink)
        sel = np.moveaxis(fp, 1, -2)  # [sample, layer, kv_head, event, pos]
        n_valid = valid_events(result["event_step"].values, ds["n_steps"].values)[:, None, None]  # [sample, 1, 1]
        churn = np.moveaxis(churn_kernel(sel, n_valid, earlier_only=True), -1, 1)  # [sample, event−1, layer, kv_head]
        np.testing.assert_array_equal(churn, mine["churn"].values)
        eligible, reactivated = lir_kernel(sel, n_valid, 4, 8)
        np.testing.assert_array_equal(eligible, mine["lir_eligible"].values)
        np.testing.assert_array_equal(reactivated, mine["lir_reactivated"].values)
        t = transition_counts(sel, n_valid, 1).sum((0, 1, 2))  # (n0, n01, n1, n10)
        assert float(mine["p01"]) == t[1] / t[0] and float(mine["p10"]) == t[3] / t[2]
        assert 0 < float(mine["churn_mean"]) < 1


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
    again = json.loads(run_main("compare", out, "--json").stdout)  # the same main, in process
    assert again["rows"] == doc["rows"]
    fmm = json.loads(
        run_cli("analyze", "fmm", qkv_trace, "--policy", "h2o", "--budget", "0.3", "--json", check=True).stdout
    )
    h2o = next(r for r in doc["rows"] if r["policy"] == "h2o" and r["budget"] == 0.3)
    assert fmm["selection"] == "h2o@0.3" and fmm["fmm"] == pytest.approx(h2o["fmm"], abs=1e-5)
    for name in ("lir", "churn"):
        ran = run_main("analyze", name, qkv_trace, "--policy", "qevict", "--budget", "0.3", "--json")
        assert ran.returncode == 0, ran.stderr


def test_cli_bad_input(tmp_path, qkv_trace):
    from kvscope.storage.synthetic import write_synthetic_store

    plain = write_synthetic_store(tmp_path / "plain.zarr", n_samples=1, n_steps=16, n_layers=2, n_kv=2, prompt_len=24)
    out = tmp_path / "exists.zarr"
    out.mkdir()
    (tmp_path / "a-file").write_text("not a folder")
    cases = [
        (("replay", qkv_trace, "--policies", "nope", "--budgets", "0.3"), "unknown policy"),
        (("replay", qkv_trace, "--policies", "h2o", "--budgets", "0"), "(0, 1]"),
        (("replay", qkv_trace, "--policies", "h2o", "--budgets", "1.5"), "(0, 1]"),
        (("replay", qkv_trace, "--policies", "h2o", "--budgets", "x"), "budget"),
        (("replay", qkv_trace, "--policies", "h2o:q_frac=1", "--budgets", "0.3"), "no parameter"),
        (("replay", plain, "--policies", "h2o", "--budgets", "0.3", "--observe", "exact"), "q/k/v"),
        (("replay", qkv_trace, "--policies", "h2o", "--budgets", "0.3", "--observe", "sideways"), "observe"),
        (("replay", qkv_trace, "--policies", "h2o", "--budgets", "0.3", "--out", out), "exists"),
        (
            ("replay", plain, "--policies", "h2o", "--budgets", "0.3", "--out", tmp_path / "a-file" / "r.zarr"),
            "not a folder",
        ),
        (("replay", tmp_path / "missing.zarr", "--policies", "h2o", "--budgets", "0.3"), "missing.zarr"),
        (("compare", plain), "not a kvscope replay result"),
        (("analyze", "fmm", qkv_trace, "--policy", "h2o"), "go together"),
        (("analyze", "peaks", qkv_trace, "--policy", "h2o", "--budget", "0.3"), "fmm, lir and churn"),
    ]
    for i, (args, words) in enumerate(cases):  # the first as a real subprocess, the rest in-process
        proc = (run_cli if i == 0 else run_main)(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr, (args, proc.stderr)
    assert not any(out.iterdir())  # an existing --out is never touched
    kvscope.open_trace(qkv_trace)  # and the trace still opens


# -- the result store: streamed tiers, temporary stores, written in place, checksummed -----


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small")
    return write_synthetic_store(folder / "s.zarr", n_samples=2, n_steps=40, n_layers=2, n_kv=2, prompt_len=24)


def _temporary_stores(folder) -> list:
    return sorted(p.name for p in folder.glob("kvscope-replay-*"))


def test_out_writes_the_store_and_equals_the_in_memory_result(qkv_trace, replayed, tmp_path):
    policies = ["h2o", "qevict", "oracle"]
    out = tmp_path / "r.zarr"
    written = kvscope.replay(qkv_trace, policies, [0.3], validate=True, out=out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.zarr"]  # renamed into place, nothing partial left
    assert isinstance(written["tiers"].data, da.Array)
    assert all(isinstance(written[k].data, np.ndarray) for k in written.data_vars if k != "tiers")
    same = replayed.sel(policy=policies, budget=[0.3])
    assert set(written.variables) == set(same.variables)
    for name in same.variables:
        np.testing.assert_array_equal(written[name].values, same[name].values, err_msg=name)
    assert written.attrs["trace"] == str(qkv_trace) and written.attrs["kind"] == "kvscope replay"
    # every chunk of every array carries a CRC32C checksum after the compressor
    meta = json.loads((out / "zarr.json").read_text())["consolidated_metadata"]["metadata"]
    assert len(meta) == len(written.variables)
    for name, doc in meta.items():
        assert [c["name"] for c in doc["codecs"]][-2:] == ["blosc", "crc32c"], name
    assert meta["tiers"]["chunk_grid"]["configuration"]["chunk_shape"] == [1, 1, 1, 1, 1, 30, 3, same.sizes["pos"]]


def test_temporary_tiers_live_as_long_as_anything_reads_them(small_trace, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = kvscope.replay(small_trace, ["h2o", "streaming"], [0.3, 0.6], n_boot=20)
    assert len(_temporary_stores(tmp_path)) == 1
    view = tiers_for(r, "h2o", 0.3)  # lazy: reads the temporary store
    want = r["tiers"].values[:, 0]  # [policy, budget, sample, event, layer, kv_head, pos] (uniform)
    assert r["tiers"].shape == (2, 1, 2, 2, 5, 2, 2, 64)
    for e in range(5):  # positions 0 .. P − 1 + t exist at the event of step t = 8e
        assert (want[:, :, :, e, ..., : 24 + 8 * e] >= 0).all() and (want[:, :, :, e, ..., 24 + 8 * e :] == -1).all()
    del r
    gc.collect()
    assert len(_temporary_stores(tmp_path)) == 1  # the view still needs it
    np.testing.assert_array_equal(view.values, want[0, 0])
    del view
    gc.collect()
    assert _temporary_stores(tmp_path) == []
    r = kvscope.replay(small_trace, ["h2o"], [0.3], n_boot=20)
    computed, loaded = r.compute(), r.load()  # both independent of the store
    del r
    gc.collect()
    assert _temporary_stores(tmp_path) == []
    np.testing.assert_array_equal(computed["tiers"].values[:, 0], want[:1, :1])
    np.testing.assert_array_equal(loaded["tiers"].values[:, 0], want[:1, :1])


def test_a_failed_replay_leaves_no_store(small_trace, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def interrupted(done, total):
        if done == 30:
            raise KeyboardInterrupt

    for out in (tmp_path / "r.zarr", None):
        with pytest.raises(KeyboardInterrupt):
            kvscope.replay(small_trace, ["h2o", "qevict"], [0.3], progress=interrupted, out=out)
        assert list(tmp_path.iterdir()) == []


def _finish_while_another_writer_takes(target, theirs: str) -> None:
    """Write a partial store while another writer puts ``theirs`` at ``target`` first."""
    with written_in_place(target) as partial:
        assert partial.parent == target.parent and partial.name.startswith(f".{target.name}.partial-")
        (partial / "x").write_text("mine")
        if theirs == "file":
            target.write_text("theirs")
        else:
            target.mkdir()
            if theirs == "store":
                (target / "x").write_text("theirs")


@pytest.mark.parametrize("theirs", ["store", "empty folder", "file"])
def test_written_in_place_never_replaces_what_another_writer_put_there(tmp_path, theirs):
    target = tmp_path / "r.zarr"
    with pytest.raises(KvscopeError, match=f"^{target} exists; choose another --out"):
        _finish_while_another_writer_takes(target, theirs)
    assert [p.name for p in tmp_path.iterdir()] == ["r.zarr"]  # the partial folder is gone
    if theirs == "store":
        assert [p.read_text() for p in target.iterdir()] == ["theirs"]


def test_the_rename_itself_refuses_a_store_or_a_file(tmp_path):
    """When both writers pass the last check together, os.rename decides (Linux)."""
    mine = tmp_path / ".r.zarr.partial-1-ab"
    mine.mkdir()
    (mine / "x").write_text("mine")
    target = tmp_path / "r.zarr"
    target.mkdir()
    (target / "x").write_text("theirs")
    with pytest.raises(KvscopeError, match=f"^{target} exists; choose another --out"):
        rename_into_place(mine, target)
    target_file = tmp_path / "f.zarr"
    target_file.write_text("theirs")
    with pytest.raises(KvscopeError, match=f"^{target_file} exists"):
        rename_into_place(mine, target_file)
    assert (target / "x").read_text() == "theirs" and target_file.read_text() == "theirs"
    rename_into_place(mine, tmp_path / "new.zarr")
    assert (tmp_path / "new.zarr" / "x").read_text() == "mine"


def test_concurrent_writers_to_one_out(tmp_path):
    """Two real processes race for the same --out, three times: one wins with a complete
    store whose numbers equal an uncontended run, the other exits 2 with one line. The
    replay (~3 s) outlasts the skew of the two starts, so both usually reach the rename."""
    trace = write_synthetic_store(tmp_path / "t.zarr", n_samples=1, n_steps=400, n_layers=4, n_kv=2, prompt_len=64)
    args = ["replay", str(trace), "--policies", "h2o,qevict,oracle", "--budgets", "0.3,0.6", "--json"]
    alone = json.loads(run_main(*args, "--out", tmp_path / "alone.zarr").stdout)  # uncontended, in process
    for round_ in range(3):
        out = tmp_path / f"same{round_}.zarr"
        cmd = [sys.executable, str(ROOT / "cli.py"), *args, "--out", str(out)]
        procs = [
            subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in "ab"
        ]
        done = sorted((p.wait(timeout=600), *p.communicate()) for p in procs)
        (won, won_out, _), (lost, _, lost_err) = done
        assert (won, lost) == (0, 2), done
        assert lost_err.splitlines() == [
            f"kvscope: error: {out} exists; choose another --out (results are never overwritten)"
        ]
        assert json.loads(won_out)["rows"] == alone["rows"]
        again = json.loads(run_main("compare", out, "--json").stdout)
        assert again["rows"] == alone["rows"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "alone.zarr",
        "same0.zarr",
        "same1.zarr",
        "same2.zarr",
        "t.zarr",
    ]


def test_a_damaged_result_chunk_is_refused(small_trace, tmp_path):
    out = tmp_path / "r.zarr"
    kvscope.replay(small_trace, ["h2o"], [0.3], n_boot=20, out=out)
    chunk = out / "fmm_mean" / "c" / "0" / "0" / "0"
    original = chunk.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    proc = run_cli("compare", out)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == (
        f"kvscope: error: {out}: chunk fmm_mean/c/0/0/0 of array fmm_mean fails its CRC32C checksum "
        f"(damaged or truncated); run kvscope verify {out}"
    )
    chunk.write_bytes(original)
    tiers = out.joinpath("tiers", "c", *"00000000")  # policy 0, allocation 0, budget 0, sample 0, event 0
    tiers.write_bytes(tiers.read_bytes()[:-1] + b"x")
    lazy = open_result(out)["tiers"]  # read chunk by chunk when used
    with pytest.raises(KvscopeError, match="chunk tiers/c/0/0/0/0/0/0/0/0 of array tiers fails its CRC32C"):
        lazy.load()
    with pytest.raises(KvscopeError, match="not a kvscope replay result"):
        open_result(small_trace)


def test_replay_leaves_an_in_memory_float32_trace_as_it_was(tmp_path, tiny_models):
    """A float32 trace loaded into memory: the sample reader's float32 rows and prompt tail are
    copies (their NaN beyond each row's length zeroed in place), never views of the caller's
    arrays — read directly, and through a replay (whose tasks select their units)."""
    from kvscope.replay.reader import SampleReader

    out = tmp_path / "fp32.zarr"
    kvscope.trace(
        "The sea is large and the sky above it is wide and blue.", out, model=str(tiny_models["llama"]),
        max_new_tokens=10, dtype="float32", record_qkv=True, stop_at_eos=False,
    )  # fmt: skip
    ds = kvscope.open_trace(out).load()
    before = {name: ds[name].values.copy() for name in ("attn", "prefill_tail", "q", "k", "v")}
    assert np.isnan(before["attn"]).any() and ds["attn"].dtype == np.float32
    reader = SampleReader(ds, 0, 1)
    row, (_, tail) = reader.row(1), reader.prefill()
    assert not np.isnan(row).any() and not np.isnan(tail).any()
    kvscope.replay(ds, ["h2o", "kivi"], [0.5], observe="exact")
    for name, values in before.items():
        np.testing.assert_array_equal(ds[name].values, values, err_msg=name)
