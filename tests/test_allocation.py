"""Allocations (docs/concepts.md#allocation): how β's bytes are split across layers and KV heads.

By hand for uniform, pyramid and adakv; every allocator's split within the total budget for
any input (hypothesis); the oracle's knapsack against brute force; on a real SmolLM2 trace: a
policy under ``uniform`` gives exactly the numbers of the same capacities given per unit, the
oracle allocation's FMM is at most every other allocation's for the same policy, every run
holds its total at every step; replay = live decisions under each allocation; bad input is one
line."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvscope
from kvscope.errors import KvscopeError
from kvscope.policies import CacheSpec, PolicyDriver, make, parse
from kvscope.policies.allocation import AdaKV, Given, Pyramid, Uniform, cheapest_split
from kvscope.policies.allocation import parse as parse_allocation
from kvscope.report import comparison

from .conftest import run_cli, run_main

SPEC = CacheSpec(4, 2, 8, prompt_len=100, final_len=120, budget=0.25)  # FP token 32 bytes, B = 7680


def test_uniform_and_pyramid_by_hand():
    assert SPEC.fp_bytes == 32 and SPEC.total_capacity == 7680 and SPEC.uniform_capacity == 960
    np.testing.assert_array_equal(Uniform().split(SPEC, 64.0), np.full((4, 2), 960.0))
    # floor 64 per unit, room 7680 − 8·64 = 7168, 896 per unit on average; beta 2: shares
    # top 2 − 1/2 = 1.5 to bottom 1/2 = 0.5 over 4 layers: 1.5, 7/6, 5/6, 0.5
    caps = Pyramid(beta=2).split(SPEC, 64.0)
    want = 64 + 896 * np.array([1.5, 7 / 6, 5 / 6, 0.5])
    np.testing.assert_allclose(caps, np.repeat(want[:, None], 2, axis=1))
    assert caps.sum() == pytest.approx(7680)
    # the default beta 20: the last layer keeps 1/20 of the mean room
    assert Pyramid().split(SPEC, 64.0)[-1, 0] == pytest.approx(64 + 896 / 20)
    # PyramidKV's own fallback: a first layer past every position of the sequence → uniform
    big = CacheSpec(4, 2, 8, 100, 120, 0.9)
    np.testing.assert_allclose(Pyramid().split(big, 64.0), np.full((4, 2), big.uniform_capacity))
    # a floor that does not fit: every allocation gives the uniform split (the policy reports its floor)
    np.testing.assert_allclose(Pyramid().split(SPEC, 2000.0), np.full((4, 2), 960.0))


def test_adakv_by_hand():
    spec = CacheSpec(1, 2, 8, prompt_len=4, final_len=4, budget=0.5)  # B = 0.5·4·32·2 = 128: 2 tokens a head
    scores = np.array([[[0.9, 0.8, 0.7, 0.6], [0.1, 0.05, 0.01, 0.0]]])  # [layer, kv_head, pos]
    # no safeguard: the layer's top 4 scores all sit in head 0
    np.testing.assert_allclose(AdaKV(alpha=0).split(spec, 0.0, scores=scores), [[128, 0]])
    # alpha 0.5: each head keeps its top ⌊0.5·2⌋ = 1 first, then the rest of the top 4: 3 and 1
    np.testing.assert_allclose(AdaKV(alpha=0.5).split(spec, 0.0, scores=scores), [[96, 32]])
    # alpha 1: every head keeps its mean, the uniform split
    np.testing.assert_allclose(AdaKV(alpha=1).split(spec, 0.0, scores=scores), [[64, 64]])


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 5),
    heads=st.integers(1, 3),
    budget=st.floats(0.05, 1.0),
    floor_tokens=st.integers(0, 6),
    beta=st.floats(1, 40),
    alpha=st.floats(0, 1),
    seed=st.integers(0, 10**6),
)
def test_every_split_stays_within_the_total(layers, heads, budget, floor_tokens, beta, alpha, seed):
    spec = CacheSpec(layers, heads, 8, prompt_len=30, final_len=40, budget=budget)
    floor = floor_tokens * spec.fp_bytes
    scores = np.random.default_rng(seed).random((layers, heads, 30))
    for allocation in (Uniform(), Pyramid(beta=beta), AdaKV(alpha=alpha)):
        caps = allocation.split(spec, floor, scores=scores)
        assert caps.shape == (layers, heads)
        assert caps.sum() <= spec.total_capacity * (1 + 1e-9), allocation
        if floor * layers * heads <= spec.total_capacity:
            assert (caps >= floor - 1e-9).all(), allocation  # every unit keeps the policy's floor


@settings(max_examples=80, deadline=None)
@given(units=st.integers(1, 4), n_cand=st.integers(1, 3), seed=st.integers(0, 10**6))
def test_cheapest_split_is_the_brute_force_optimum(units, n_cand, seed):
    rng = np.random.default_rng(seed)
    caps = rng.integers(0, 10, (n_cand, 1, units)).astype(float) * 2  # multiples of the quantum 2
    loss = rng.random((n_cand, 1, units))
    total = float(rng.integers(0, 20 * units))
    best = None
    for pick in itertools.product(range(n_cand), repeat=units):
        used = sum(caps[j, 0, u] for u, j in enumerate(pick))
        if used <= total:
            cost = sum(loss[j, 0, u] for u, j in enumerate(pick))
            best = cost if best is None else min(best, cost)
    chosen = cheapest_split(caps, loss, total, 2.0)
    if best is None:
        return  # nothing fits: any answer is refused later by the budget check
    assert chosen.sum() <= total + 1e-9
    # the least loss of a candidate with the chosen capacity (two candidates may share one)
    cost = sum(min(loss[j, 0, u] for j in range(n_cand) if caps[j, 0, u] == chosen[0, u]) for u in range(units))
    assert cost == pytest.approx(best)


def test_spelling_round_trips():
    for text in ("uniform", "pyramid", "pyramid:beta=10.0", "adakv:alpha=0.5", "oracle", "oracle:measure=output"):
        assert parse_allocation(text).label() == text
    assert parse_allocation("pyramid:beta=4") == Pyramid(beta=4.0)


# -- on a real trace ---------------------------------------------------------------------------

ALLOCATIONS = ["uniform", "pyramid", "adakv", "oracle"]
POLICIES = ["streaming", "h2o", "snapkv:obs_window=16", "qevict", "kivi", "logquant", "oracle"]


@pytest.fixture(scope="module")
def allocated(qkv_trace):
    return kvscope.replay(qkv_trace, POLICIES, [0.3], allocations=ALLOCATIONS, n_boot=20)


def test_uniform_gives_the_numbers_of_the_same_capacities_given_per_unit(qkv_trace, allocated):
    """Under uniform a state keeps one capacity for every unit (today's code path); given as a
    [layer, kv_head] array, every policy sizes and decides per unit: the numbers are equal."""
    spec_bytes = float(allocated["budget_bytes"].values[0, 0]) / (30 * 3)
    per_unit = Given.of(np.full((30, 3), spec_bytes))
    again = kvscope.replay(qkv_trace, POLICIES, [0.3], allocations=[per_unit], n_boot=20)
    uniform = allocated.sel(allocation=["uniform"])
    for name in ("fmm", "fmm_fp", "tier_mass", "bytes_used", "attn_l1", "output_rel_l2", "churn", "n_quantized"):
        np.testing.assert_array_equal(again[name].values, uniform[name].values, err_msg=name)
    np.testing.assert_array_equal(again["tiers"].values, uniform["tiers"].values)


def test_the_oracle_allocation_bounds_every_other_for_the_same_policy(allocated):
    fmm = allocated["fmm_mean"].sel(budget=0.3)  # [policy, allocation]
    fmm_fp = allocated["fmm_fp_mean"].sel(budget=0.3)
    for policy in POLICIES:
        measure = fmm_fp if policy in ("kivi", "logquant") else fmm  # auto: FMM fp for pure quantizers
        oracle = float(measure.sel(policy=policy, allocation="oracle"))
        for other in ALLOCATIONS[:-1]:
            assert oracle <= float(measure.sel(policy=policy, allocation=other)) + 1e-12, (policy, other)
    # and it moves bytes: h2o's oracle split is far from even, and better than uniform
    split = allocated["allocated"].sel(policy="h2o", allocation="oracle", budget=0.3).values[0]
    assert split.max() > 2 * split.min()
    assert float(fmm.sel(policy="h2o", allocation="oracle")) < float(fmm.sel(policy="h2o", allocation="uniform"))


def test_every_run_holds_its_total_and_the_splits_sum_to_it(allocated):
    budget = allocated["budget_bytes"].values[0, 0]
    assert (allocated["allocated"].sum(("layer", "kv_head")).values <= budget * (1 + 1e-9)).all()
    reached = allocated["budget_reached"].sel(budget=0.3)
    used = allocated["bytes_used"].sel(budget=0.3).max("step")  # [policy, allocation, sample]
    assert (used.where(reached).fillna(0).values <= budget * (1 + 1e-6)).all()
    # pyramid shrinks with depth; adakv keeps each layer's total and moves it between heads
    pyramid = allocated["allocated"].sel(policy="h2o", allocation="pyramid", budget=0.3).values[0]
    assert (np.diff(pyramid[:, 0]) < 0).all() and (pyramid[:, 0] == pyramid[:, 1]).all()
    adakv = allocated["allocated"].sel(policy="h2o", allocation="adakv", budget=0.3).values[0]
    np.testing.assert_allclose(adakv.sum(1), np.full(30, budget / 30))
    assert (adakv.max(1) > adakv.min(1)).any()
    rows = {(r["policy"], r["allocation"]): r for r in comparison(allocated)}
    shares = rows[("h2o", "pyramid")]["layer_bytes"]
    assert shares[0] > 1.5 and shares[-1] < 0.5
    assert rows[("h2o", "uniform")]["layer_bytes"] == [1.0] * 30


def test_the_output_oracle_minimises_the_output_error(qkv_trace, allocated):
    r = kvscope.replay(qkv_trace, ["h2o"], [0.3], allocations=["uniform", "oracle:measure=output"], n_boot=20)
    error = r["output_rel_l2_mean"].sel(policy="h2o", budget=0.3)
    assert float(error.sel(allocation="oracle:measure=output")) < float(error.sel(allocation="uniform"))
    assert float(error.sel(allocation="uniform")) == float(
        allocated["output_rel_l2_mean"].sel(policy="h2o", allocation="uniform", budget=0.3)
    )


def test_the_driver_checks_each_unit_against_its_share():
    spec = CacheSpec(2, 1, 8, 20, 24, 0.5)  # B = 768 bytes, 384 per unit
    driver = PolicyDriver(make("streaming").start(spec), allocation=Pyramid(beta=4))
    colsum = np.zeros((2, 1, 20))
    used = driver.prefill(colsum, None)
    caps = driver.state.spec.capacity
    assert caps[0, 0] > caps[1, 0] and (used <= caps + 1e-9).all() and used.sum() <= 768


@pytest.mark.parametrize("policy,allocation", [("h2o", "pyramid"), ("logquant", "adakv"), ("h2o", "oracle")])
def test_replay_equals_live_decisions_under_each_allocation(small_qkv_trace, policy, allocation):
    """The live cache holds what the split gives each head, decides exactly as replay (adakv:
    from the prompt attention it records live even for a policy that does not read it)."""
    args = ("validate", small_qkv_trace, "--policy", policy, "--budget", "0.3", "--allocation", allocation, "--json")
    proc = run_main(*args)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["allocation"] == allocation and report["decisions_identical"], report["first_mismatch"]
    assert report["bytes_ratio_live"] <= 0.3 + 1e-6


def test_cli_replay_shows_the_allocations(qkv_trace):
    proc = run_cli("replay", qkv_trace, "--policies", "h2o", "--budgets", "0.3", "--allocation", "uniform,pyramid")
    assert proc.returncode == 0, proc.stderr
    assert "allocation" in proc.stdout and "pyramid" in proc.stdout
    assert "h2o under pyramid at β = 0.3: bytes per layer" in proc.stdout


def test_bad_input_is_one_line(qkv_trace, tmp_path):
    from kvscope.storage.synthetic import write_synthetic_store

    plain = write_synthetic_store(tmp_path / "plain.zarr", n_samples=1, n_steps=16, n_layers=2, n_kv=2, prompt_len=24)
    replay = ("replay", qkv_trace, "--policies", "h2o", "--budgets", "0.3", "--allocation")
    cases = [
        ((*replay, "nope"), "unknown allocation 'nope' (available: uniform, pyramid, adakv, oracle)"),
        ((*replay, "pyramid:beta=0.5"), "pyramid parameter beta must be ≥ 1 (got 0.5)"),
        ((*replay, "adakv:alpha=2"), "adakv parameter alpha must lie in [0, 1] (got 2.0)"),
        ((*replay, "adakv:gamma=1"), "allocation adakv has no parameter 'gamma'"),
        ((*replay, "oracle:measure=loss"), "oracle parameter measure must be one of"),
        ((*replay, "pyramid,pyramid"), "an allocation is listed twice"),
        ((*replay, ","), "--allocation needs at least one allocation"),
        (
            ("replay", plain, "--policies", "h2o", "--budgets", "0.3", "--allocation", "oracle:measure=output"),
            "the oracle:measure=output allocation needs recorded q/k/v",
        ),
        (
            ("replay", qkv_trace, "--policies", "press:KnormPress", "--budgets", "0.3", "--allocation", "pyramid"),
            "sets its own split across layers and heads",
        ),
        (("run", "--prompt", "hi", "--policy", "h2o", "--budget", "0.3", "--allocation", "oracle"), "only kvscope validate"),
        (("run", "--prompt", "hi", "--policy", "h2o", "--budget", "0.3", "--allocation", "pyramid:x=1"), "no parameter"),
    ]  # fmt: skip
    for i, (args, words) in enumerate(cases):  # the first as a real subprocess, the rest in-process
        proc = (run_cli if i == 0 else run_main)(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], (args, proc.stderr)


def test_a_policy_parses_with_its_allocation_apart():
    assert parse("h2o").label() == "h2o"
    with pytest.raises(KvscopeError, match="unknown policy"):
        parse("pyramid")


def test_cli_lists_policies_and_allocations_with_their_ranges():
    doc = json.loads(run_main("policies", "--json").stdout)
    assert set(doc["allocations"]) == {"uniform", "pyramid", "adakv", "oracle"}
    beta = doc["allocations"]["pyramid"]["parameters"][0]
    assert beta["name"] == "beta" and beta["default"] == 20.0 and beta["allowed"] == "be ≥ 1" and beta["tune"] == "1.0–40.0"
    h2o = {p["name"]: p for p in doc["policies"]["h2o"]["parameters"]}
    assert h2o["recent_frac"]["allowed"] == "lie in [0, 1]"
    kinds = {name: entry["kind"] for name, entry in doc["policies"].items()}
    assert kinds["h2o"] == "eviction" and kinds["kivi"] == kinds["logquant"] == "quantization"
    assert "pyramid" in run_main("policies").stdout
