"""Every policy through the same invariants (kvpress style), driven by observations only —
no trace involved — plus the hand-made cases of LogQuant (docs/concepts.md#logquant) and QEvict (docs/concepts.md#qevict)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.errors import KvscopeError
from kvscope.policies import CacheSpec, LedgerError, LogQuantIndex, available, make, parse
from kvscope.replay import effective_kv

NONE, EVICTED, Q, FP = -1, 0, 1, 2
L, H, D, P, S = 2, 2, 16, 160, 64
BUDGETS = (0.4, 0.7)

# one entry per registered policy (defaults) plus the variants the issue names
CASES = [
    *[name for name, cls in available().items() if name != "qevict" and not cls.reads_queries],  # presses: test_presses
    "qevict:local=16",
    "qevict:local=16:q_frac=0",
    "qevict:local=16:key_prerope=false",
    "logquant:key_axis=token",
    "kivi:R=32",
    "kivi:evict=true",
    "logquant:evict=true",
]


def stream(seed: int = 0):
    """Observations of one synthetic sequence: ``rows [S, L, H, P+S]`` (each sums to 1 over
    ``0..P−1+t``, with sinks, a few persistent heavy hitters and drifting ones),
    ``colsum [L, H, P]``, ``tail [L, H, 16, P]`` and random ``k``, ``v [L, H, P+S, D]``."""
    rng = np.random.default_rng(seed)
    T = P + S
    base = rng.standard_normal((L, H, T)) * 1.5
    base[..., :4] += 4
    base[..., rng.choice(np.arange(4, P), 6, replace=False)] += 3
    rows = np.zeros((S, L, H, T), np.float32)
    for t in range(S):
        q = P - 1 + t
        logits = base[..., : q + 1] + rng.standard_normal((L, H, q + 1)) * 1.0
        logits[..., max(0, q - 8) : q + 1] += 2  # recency
        p = np.exp(logits - logits.max(-1, keepdims=True))
        rows[t, ..., : q + 1] = p / p.sum(-1, keepdims=True)
    tail = np.zeros((L, H, 16, P), np.float32)
    for o in range(16):
        q = P - 16 + o
        logits = base[..., : q + 1] + rng.standard_normal((L, H, q + 1))
        p = np.exp(logits - logits.max(-1, keepdims=True))
        tail[..., o, : q + 1] = p / p.sum(-1, keepdims=True)
    colsum = tail.sum(2) * (P / 16)
    k = rng.standard_normal((L, H, T, D)).astype(np.float32)
    v = rng.standard_normal((L, H, T, D)).astype(np.float32)
    return rows, colsum, tail, k, v


@functools.lru_cache(maxsize=None)
def drive(case: str, budget: float, seed: int = 0):
    """Run one policy over the stream; returns the state and per-step tiers and bytes."""
    rows, colsum, tail, k, v = stream(seed)
    policy = parse(case)
    spec = CacheSpec(L, H, D, P, P + S, budget, n_sink=4, w=8)
    state = policy.start(spec, k, v) if policy.quantizes else policy.start(spec)
    future = lambda t: rows[t + 1 : t + 33].sum(0)  # noqa: E731 - only the oracle may look ahead
    if policy.clairvoyant:
        state.observe_future(future(0))
    state.prefill(colsum, tail)
    tiers, used = [state.tiers.copy()], [state.bytes_used()]
    state.check()
    for t in range(1, S):
        state.append(P - 1 + t)
        acc = state.accessible()
        seen = np.where(acc, rows[t, ..., : state.length], 0)
        state.observe(seen / seen.sum(-1, keepdims=True))
        if policy.clairvoyant:
            state.observe_future(future(t))
        state.compress()
        state.check()  # Q only for ledger entries; nothing evicted comes back (causal policies)
        tiers.append(state.tiers.copy())
        used.append(state.bytes_used())
    return state, np.stack(tiers), np.stack(used)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("case", CASES)
def test_tiers_only_for_existing_positions(case, budget):
    _, tiers, _ = drive(case, budget)
    for t in range(S):
        length = P + t
        assert (tiers[t, ..., :length] != NONE).all()
        assert (tiers[t, ..., length:] == NONE).all()


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("case", CASES)
def test_bytes_within_budget_at_every_step(case, budget):
    state, tiers, used = drive(case, budget)
    # full keeps everything (fits only β = 1); KIVI with a fixed R = 32 keeps up to 63 FP tokens:
    # (63·64 + 161·14) / (224·64) = 0.4386 of the full cache > 0.4
    floors = {("full", 0.4), ("full", 0.7), ("kivi:R=32", 0.4)}
    assert state.reached == ((case, budget) not in floors)
    if state.reached:
        assert used.max() <= state.spec.capacity + 1e-6
    else:  # a floor is reported, never hidden
        assert used.max() > state.spec.capacity
    # bytes agree with the tiers: FP tokens cost 4·D, Q tokens their ledger cost, EVICTED nothing
    last = tiers[-1]
    fp_bytes = (last == FP).sum(-1) * 4 * D
    q_bytes = np.where(last == Q, state.ledger.q_cost, 0).sum(-1) if state.ledger is not None else 0
    assert np.allclose(used[-1], fp_bytes + q_bytes)


@pytest.mark.parametrize("case", CASES)
def test_evicted_positions_never_come_back(case):
    state, tiers, _ = drive(case, 0.4)
    if state.policy.clairvoyant:
        pytest.skip("the oracle is clairvoyant: it may bring a position back")
    ever = np.zeros(tiers.shape[1:], dtype=bool)
    for t in range(S):
        assert not (ever & (tiers[t] != EVICTED)).any()
        ever |= tiers[t] == EVICTED


@pytest.mark.parametrize("case", CASES)
def test_deterministic(case):
    _, a, ua = drive(case, 0.4, 0)
    drive.cache_clear()
    _, b, ub = drive(case, 0.4, 0)
    assert (a == b).all() and (ua == ub).all()


def test_registry_and_parsing():
    assert list(available()) == ["full", "streaming", "h2o", "snapkv", "kivi", "logquant", "qevict", "oracle", "press"]
    p = make("qevict", q_frac=0.5)
    assert p.q_frac == 0.5 and p.label() == "qevict:q_frac=0.5"
    assert parse("qevict:q_frac=0.5:key_prerope=false").key_prerope is False
    assert parse("logquant:W=none").W is None
    for bad in ("nope", "h2o:x=1", "h2o:recent_frac=abc", "kivi:bits"):
        with pytest.raises(KvscopeError):
            parse(bad)


def test_policies_that_keep_everything_accessible():
    for case in ("full", "kivi", "logquant"):
        _, tiers, _ = drive(case, 0.4)
        assert not (tiers == EVICTED).any()
    _, tiers, _ = drive("full", 0.4)
    assert (tiers[-1][..., : P + S - 1] == FP).all()


def test_streaming_keeps_sinks_and_the_newest_tokens():
    state, tiers, _ = drive("streaming", 0.4)
    n = state.spec.fp_capacity_tokens  # ⌊0.4 · 224⌋ = 89
    assert n == 89
    last = tiers[-1][0, 0]
    expected = np.zeros(P + S, dtype=bool)
    expected[:4] = True
    expected[P + S - 1 - (n - 4) : P + S - 1] = True
    assert ((last == FP) == expected).all()


def test_h2o_keeps_the_recent_half_and_heavy_hitters():
    state, tiers, _ = drive("h2o", 0.4)
    last = tiers[-1]
    assert ((last == FP).sum(-1) == 89).all()
    recent = state.n_recent
    assert (last[..., P + S - 1 - recent : P + S - 1] == FP).all()
    # heavy hitters: every kept older token scores at least as high as every evicted one
    older = np.arange(P + S - 1 - recent)
    for li in range(L):
        for hi in range(H):
            kept = state.scores[li, hi, older][last[li, hi, older] == FP]
            gone = state.scores[li, hi, older][last[li, hi, older] == EVICTED]
            assert kept.min() >= gone.max() - 1e-9 or gone.size == 0


def test_snapkv_scores_the_prompt_with_pooled_observation_rows():
    from kvscope.policies.snapkv import pool

    assert pool(np.array([0.0, 5.0, 0.0, 0.0, 0.0, 1.0]), 3).tolist() == [5, 5, 5, 0, 1, 1]
    # avg: zeros past the ends, divided by the kernel (torch's avg_pool1d default)
    assert pool(np.array([3.0, 0.0, 0.0, 6.0]), 3, "avg").tolist() == [1, 1, 2, 2]
    state, tiers, _ = drive("snapkv", 0.7)
    first = tiers[0]
    n_prompt = state.spec.fp_capacity_tokens - (S)  # ⌊0.7·224⌋ − 64 = 92
    assert ((first[..., :P] == FP).sum(-1) == n_prompt).all()
    assert (first[..., P - 16 : P] == FP).all()  # the observation window stays
    assert (tiers[-1][..., P:] != EVICTED).all()  # decode tokens stay


def test_kivi_residual_and_groups():
    state, tiers, _ = drive("kivi:R=32", 0.7)
    for t in (0, 10, S - 1):
        length = P + t
        n_q = max(0, (length - 32) // 32) * 32
        row = tiers[t][0, 0, :length]
        assert (row[:n_q] == Q).all() and (row[n_q:] == FP).all()
    state, _, used = drive("kivi", 0.4)
    assert state.R % 32 == 0 and state.policy.max_bytes(state.spec, state.R + 32) > state.spec.capacity


def test_logquant_index_hand_cases():
    # LogQuant's worked example (docs/concepts.md#logquant): W = 8, prefill 20, positions up to 139 appended
    index = LogQuantIndex.after_prefill(20, 8)
    for p in range(20, 140):
        index.append(p)
    assert index.reserve == [0, 104, 112, 116, 120, 122, 124, 126]
    assert index.local == list(range(128, 140))
    # prefill shorter than W: everything local
    short = LogQuantIndex.after_prefill(5, 8)
    assert short.reserve == [] and short.local == [0, 1, 2, 3, 4]
    # W < L < 3W: reserve = the first W, local = the rest
    mid = LogQuantIndex.after_prefill(20, 8)
    assert mid.reserve == list(range(8)) and mid.local == list(range(8, 20))
    # L ≥ 3W (W = 4, L = 14): reserve = tmp[0:8:2], local = tmp[8:]; then 3 appends flush once
    long = LogQuantIndex.after_prefill(14, 4)
    assert long.reserve == [0, 2, 4, 6] and long.local == list(range(8, 14))
    for p in (14, 15):
        long.append(p)
    assert long.local == list(range(8, 16)) and long.reserve == [0, 2, 4, 6]
    long.append(16)  # local has 9 > 2W: reserve = ([0,2,4,6] + [8,9,10,11])[0::2], local = local[4:]
    assert long.reserve == [0, 4, 8, 10] and long.local == [12, 13, 14, 15, 16]


def test_logquant_prefill_lists_equal_the_papers_loop():
    """after_prefill computes LogQuant's loop in O(length); the loop itself, literally, as reference."""

    def loop(length, W):
        tmp, reserve, local = list(range(length)), [], list(range(length))
        if length >= 3 * W:
            while len(tmp) >= 3 * W:
                reserve, local = tmp[0 : 2 * W : 2], tmp[2 * W :]
                tmp = reserve + local
        elif W < length < 3 * W:
            reserve, local = tmp[:W], tmp[W:]
        return reserve, local

    cases = [(length, W) for W in range(1, 13) for length in range(0, 90)] + [(4099, 64), (8193, 7)]
    for length, W in cases:
        index = LogQuantIndex.after_prefill(length, W)
        assert (index.reserve, index.local) == loop(length, W), (length, W)


def test_logquant_policy_tiers_follow_the_index_lists():
    state, tiers, _ = drive("logquant", 0.4)
    index = LogQuantIndex.after_prefill(P, state.W)
    fp = set(index.fp)
    assert set(np.nonzero(tiers[0][0, 0] == FP)[0]) == fp
    for t in range(1, S):
        index.append(P - 1 + t)
        row = tiers[t][1, 1, : P + t]
        assert set(np.nonzero(row == FP)[0]) == set(index.fp)
        assert (row[row != FP] == Q).all()
    assert state.ledger.n_quantized == L * H * (P + S - 1 - len(index.fp))  # each token quantized once


def _qevict_state(q_frac=1 / 3):
    """1 layer, 1 kv head, D = 8, w = 4, one local window: the budget leaves room for exactly
    one FP and one Q window (M = 576 − 12·32 = 192: n_fp = ⌊128/128⌋, n_q = ⌊64/64⌋)."""
    rng = np.random.default_rng(3)
    k = rng.standard_normal((1, 1, 36, 8)).astype(np.float32)
    v = rng.standard_normal((1, 1, 36, 8)).astype(np.float32)
    spec = CacheSpec(1, 1, 8, prompt_len=20, final_len=36, budget=0.5, n_sink=4, w=4)
    state = make("qevict", local=4, q_frac=q_frac).start(spec, k, v)
    assert (state.n_fp, state.n_q) == (1, 1)
    return state, k, v


def _window(state, j):
    return state.tiers[0, 0, 4 + 4 * j : 8 + 4 * j]


def test_qevict_promotion_demotion_and_the_write_once_ledger():
    state, k, v = _qevict_state()
    colsum = np.zeros((1, 1, 20))
    colsum[0, 0, 4:8] = 2.5  # window 0: 10
    colsum[0, 0, 8:12] = 1.75  # window 1: 7
    state.prefill(colsum, None)
    assert (_window(state, 0) == FP).all() and (_window(state, 1) == Q).all() and (_window(state, 2) == EVICTED).all()
    assert state.ledger.n_quantized == 4
    codes_w1 = state.ledger.k_eff[0, 0, 8:12].copy()

    def step(target: slice, mass: float):
        state.append(state.length)
        row = np.zeros((1, 1, state.length))
        row[0, 0, target] = mass / 4
        state.observe(row)
        state.compress()
        assert state.bytes_used().max() <= state.spec.capacity

    for _ in range(4):  # window 1 gains 4 → 11 > 10: promoted; window 0 demoted (first time → quantized)
        step(slice(8, 12), 1.0)
    assert (_window(state, 1) == FP).all() and (_window(state, 0) == Q).all() and (_window(state, 3) == EVICTED).all()
    assert state.ledger.n_quantized == 8 and state.promotions == 1
    # a promoted window serves its dequantized values, not the originals
    keys, values, present = effective_kv(state, k, v, state.length)
    assert (keys[0, 0, 8:12] == codes_w1.astype(np.float32)).all()
    assert not np.allclose(keys[0, 0, 8:12], k[0, 0, 8:12])
    assert present[0, 0, 8:12].all() and not present[0, 0, 12:16].any()
    for _ in range(4):  # window 0 gains 6 → 16 > 11: promoted again; window 1 demoted again
        step(slice(4, 8), 1.5)
    assert (_window(state, 0) == FP).all() and (_window(state, 1) == Q).all() and (_window(state, 4) == EVICTED).all()
    assert state.ledger.n_quantized == 8  # demote → promote → demote reused the codes
    assert (state.ledger.k_eff[0, 0, 8:12] == codes_w1).all()
    with pytest.raises(LedgerError):
        state.ledger.quantize(np.array([[8, 9, 10, 11]]), np.array([0]), np.array([0]))


def test_qevict_q_frac_zero_is_window_eviction():
    state, tiers, _ = drive("qevict:local=16:q_frac=0", 0.4)
    assert not (tiers == Q).any() and state.ledger.n_quantized == 0
    body = tiers[-1][..., 4 : 4 + ((P + S - 1 - 4) // 8) * 8]
    windows = body.reshape(L, H, -1, 8)
    assert (windows == windows[..., :1]).all()  # whole windows share one tier
    assert (tiers == EVICTED).any()


@pytest.mark.parametrize("case", ["qevict:local=16", "qevict:local=16:q_frac=0", "qevict:local=16:key_prerope=false"])
def test_qevict_never_demotes_sinks_or_local_windows(case):
    state, tiers, _ = drive(case, 0.4)
    for t in range(S):
        length = P + t
        complete = (length - 4) // 8
        local_start = 4 + (complete - 2) * 8  # local = 16 tokens = 2 windows, plus the partial one
        assert (tiers[t][..., :4] == FP).all()
        assert (tiers[t][..., local_start:length] == FP).all()


def test_oracle_keeps_the_most_future_mass():
    state, tiers, _ = drive("oracle", 0.4)
    rows = stream(0)[0]
    future = rows[11:43].sum(0)  # at step 10
    kept = tiers[10] == FP
    assert (kept.sum(-1) == 89).all()
    for li in range(L):
        for hi in range(H):
            f = future[li, hi, : P + 10]
            assert f[kept[li, hi, : P + 10]].min() >= f[~kept[li, hi, : P + 10]].max() - 1e-7


def test_rope_helpers_match_transformers_and_invert():
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from kvscope.model.rope import Rope, apply_rope, undo_rope

    config = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, rope_theta=10000.0)
    rotary = LlamaRotaryEmbedding(config)
    positions = torch.arange(0, 300, 7)[None]
    k_pre = torch.randn(1, 1, positions.shape[1], 64, generator=torch.Generator().manual_seed(0))
    cos, sin = rotary(k_pre, positions)
    _, k_post = apply_rotary_pos_emb(k_pre, k_pre, cos, sin)
    rope = Rope(rotary.inv_freq.numpy()[None].astype(np.float64), np.array([rotary.attention_scaling]))
    c, s = rope.cos_sin(np.zeros(positions.shape[1], dtype=int), positions[0].numpy(), 64)
    ours = apply_rope(k_pre[0, 0].numpy(), c, s, 64)
    # transformers takes the angles p·θ in fp32 (ours in fp64): ~1e-5 relative at p ≈ 300
    assert np.abs(ours - k_post[0, 0].numpy()).max() < 1e-3
    back = undo_rope(k_post[0, 0].numpy(), c, s, 64, rope.scaling[0])
    assert np.abs(back - k_pre[0, 0].numpy()).max() < 1e-4


def test_qevict_quantizes_keys_before_rope_when_parameters_are_given():
    from kvscope.model.rope import Rope, apply_rope

    # keys with one large constant channel before RoPE: per-channel quantization is exact on
    # it pre-RoPE, while rotation smears it across a pair of channels
    rng = np.random.default_rng(0)
    positions = np.arange(40)
    inv_freq = 1.0 / (10000 ** (np.arange(0, 8, 2) / 8))
    rope = Rope(inv_freq[None], np.array([1.0]))
    pre = rng.standard_normal((40, 8)).astype(np.float32) * 0.1
    pre[:, 0] = 5.0
    c, s = rope.cos_sin(np.zeros(40, dtype=int), positions, 8)
    post = apply_rope(pre, c, s, 8).astype(np.float32)[None, None]
    spec = CacheSpec(1, 1, 8, prompt_len=40, final_len=40, budget=1.0, n_sink=4, w=4)
    errors = {}
    for prerope in (True, False):
        ledger = make("qevict", key_prerope=prerope).start(spec, post, post.copy(), rope).ledger
        ledger.quantize(np.array([[4, 5, 6, 7]]), np.array([0]), np.array([0]))
        errors[prerope] = np.abs(ledger.k_eff[0, 0, 4:8] - post[0, 0, 4:8]).max()
    assert errors[True] < errors[False]


@pytest.mark.parametrize("name", ["logquant:W=8", "kivi:R=32"])
def test_as_eviction_drops_exactly_what_the_quantizer_quantizes(name):
    """Same W / R: the eviction variant evicts at every step the positions the quantizing one
    holds in Q, and holds no Q itself."""
    _, quantized, _ = drive(name, 1.0)
    _, evicted, used = drive(name + ":evict=true", 1.0)
    assert ((quantized == Q) == (evicted == EVICTED)).all()
    assert not (evicted == Q).any()
    fp = (evicted == FP).sum(-1)  # [step, layer, kv_head]
    assert np.allclose(used, fp * CacheSpec(L, H, D, P, P + S, 1.0).fp_bytes)


def test_as_eviction_is_fitted_to_the_same_bytes():
    """Unset W / R: the eviction variant's full-precision window grows into the bytes the
    quantized tier would have used (equal memory), and stays within them."""
    spec = CacheSpec(L, H, D, P, P + S, 0.3, n_sink=4, w=8)
    for name in ("logquant", "kivi"):
        quantizing, evicting = parse(name).start(spec), parse(name + ":evict=true").start(spec)
        window = (lambda st: st.W) if name == "logquant" else (lambda st: st.R)
        assert window(evicting) > window(quantizing), name
        assert evicting.reached and parse(name + ":evict=true").kind == "eviction"
        _, _, used = drive(name + ":evict=true", 0.3)
        assert (used <= spec.capacity * (1 + 1e-6)).all()


@given(
    st.integers(1, 3), st.integers(1, 12), st.integers(0, 14), st.integers(0, 2**32 - 1), st.sampled_from([2, 5, 1000])
)
@settings(max_examples=80, deadline=None)
def test_top_k_mask_is_the_k_best_newest_first_on_ties(units, n, k, seed, levels):
    """The ``k`` best candidates by score, ties to the newer position — against a sort, with
    ties frequent (scores from ``levels`` values) and rare, and units with fewer candidates than ``k``."""
    from kvscope.policies.base import top_k_mask

    rng = np.random.default_rng(seed)
    scores = rng.integers(0, levels, (units, n)).astype(np.float64)
    candidates = rng.random((units, n)) < 0.8
    want = np.zeros((units, n), dtype=bool)
    for u in range(units):
        ranked = sorted(np.flatnonzero(candidates[u]), key=lambda p: (-scores[u, p], -p))
        want[u, ranked[:k]] = True
    assert top_k_mask(scores, candidates, k).tolist() == want.tolist()
    per_unit = np.full(units, k)  # the per-unit (array) path agrees
    assert top_k_mask(scores, candidates, per_unit).tolist() == want.tolist()
