"""The cache geometry (kvscope.model.spec, docs/concepts.md#geometry), by hand: learned sinks in
the attention rule, sliding-window layers in the byte model, multi-head latent attention's one
unit per layer, hybrid models' layer indices — and every policy through the driver on a cache
whose layers hold different windows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvscope.errors import KvscopeError
from kvscope.model.attention import AttentionRule, LayerRules, grouped, grouped_sinks, softmax
from kvscope.model.spec import ModelSpec
from kvscope.policies import CacheSpec, PolicyDriver, check_geometry, parse
from kvscope.replay.output_error import per_unit, renormalized

from .test_policies import CASES, stream

EVICTED = 0


def test_a_learned_sink_is_a_softmax_column_no_key_holds():
    """logits 0, ln 2 and a sink logit 0: e⁰, 2, e⁰ → the keys get 1/4, 1/2 and the sink 1/4."""
    probs = softmax(torch.tensor([[0.0, math.log(2)]]), sink=torch.tensor([[0.0]]))
    np.testing.assert_allclose(probs.numpy(), [[0.25, 0.5]], rtol=1e-6)
    hidden = softmax(torch.tensor([[0.0, 5.0]]), torch.tensor([[False, False]]), sink=torch.tensor([[1.0]]))
    assert hidden.tolist() == [[0.0, 0.0]]  # no visible key: all of the row on the sink, no NaN


def test_grouped_sinks_follow_the_grouped_query_layout():
    """Query head h of KV head k = h // g sits in rows j·r … j·r + r − 1 of k's stacked rows."""
    sinks = [10.0, 11.0, 12.0, 13.0]  # heads 0..3, two per KV head
    column = grouped_sinks(sinks, n_kv=2, rows=3)[..., 0]
    assert column.tolist() == [[10, 10, 10, 11, 11, 11], [12, 12, 12, 13, 13, 13]]
    q = torch.randn(4, 3, 8)  # [head, rows, D]
    k = torch.randn(2, 5, 8)
    rule = AttentionRule(0.3, sinks=tuple(sinks))
    pos = torch.arange(5)
    got = rule.probs(grouped(q, 2), k, torch.tensor(4), pos).view(4, 3, 5)
    for h in range(4):  # each head on its own: softmax over its keys and its own sink
        logits = q[h] @ k[h // 2].T * 0.3
        want = torch.softmax(torch.cat([logits, torch.full((3, 1), sinks[h])], -1), -1)[:, :5]
        torch.testing.assert_close(got[h], want)
    one = rule.of_kv_heads(1, 1, 2).probs(grouped(q[2:], 1), k[1:], torch.tensor(4), pos).view(2, 3, 5)
    torch.testing.assert_close(one, got[2:])  # KV head 1 alone: its heads' sinks only


def test_layer_rules_give_layers_without_sinks_none():
    rules = LayerRules((AttentionRule(1.0, sinks=(0.0, 0.0)), AttentionRule(1.0)))
    q, k = torch.zeros(2, 1, 2, 4), torch.zeros(2, 1, 3, 4)  # [L, kv, group, D], equal logits
    probs = rules.probs(q, k, 2)
    np.testing.assert_allclose(probs[0].sum(-1).numpy(), 3 / 4)  # 3 keys and the sink e⁰ each
    np.testing.assert_allclose(probs[1].sum(-1).numpy(), 1.0)


def test_renormalized_keeps_the_sinks_share():
    """A cache that lost keys still has the sink's logit: a·[acc] / (Σ a·[acc] + σ)."""
    row = np.array([[[0.2, 0.3, 0.1]]])  # σ = 0.4
    acc = np.array([[[True, False, True]]])
    np.testing.assert_allclose(renormalized(row, acc, np.array([[0.4]])), [[[0.2 / 0.7, 0, 0.1 / 0.7]]])
    np.testing.assert_allclose(renormalized(row, acc), [[[2 / 3, 0, 1 / 3]]])


def test_spec_geometry_round_trips_through_a_store_config():
    spec = ModelSpec(
        n_layers=2, n_heads=4, n_kv_heads=1, head_dim=24, key_heads=4, v_head_dim=16, kv_latent_dim=24,
        attention_layers=(1, 3), model_layers=4, layer_types=("linear_attention", "full_attention") * 2,
        learned_sinks=(None, (0.5, 1.0, 1.5, 2.0), None, (0.0, 0.0, 0.0, 0.0)),
    )  # fmt: skip
    again = ModelSpec.from_config(spec.config())
    assert again == spec
    assert again.layer_index == (1, 3) and again.stored_layer(3) == 1 and again.model_layer(0) == 1
    assert again.token_values == 24 and again.n_key_heads == 4 and again.v_dim == 16 and again.latent
    assert again.rule(0).sinks == (0.5, 1.0, 1.5, 2.0)
    with pytest.raises(KvscopeError, match="layer 2 holds no attention"):
        again.stored_layer(2)


def test_a_gqa_token_costs_its_k_and_v_and_sliding_layers_hold_their_window():
    spec = ModelSpec(
        n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, sliding_window=8,
        layer_types=("sliding_attention", "full_attention"),
    )  # fmt: skip
    assert spec.token_values == 32
    assert spec.held(0, 20) == 8 and spec.held(1, 20) == 20
    assert spec.full_tokens(20) == (8 + 20) * 2


def test_cache_spec_bytes_follow_the_windows():
    """Layer 0 slides a window of 24, layer 1 is global: at 100 tokens a unit holds 24 and 100
    tokens of 2·D·2 bytes; β = 0.5 gives each unit half of its own."""
    spec = CacheSpec(2, 2, 16, 60, 100, 0.5, layer_windows=(24, None))
    assert spec.full_bytes == (24 + 100) * 64 * 2
    assert spec.total_capacity == 0.5 * spec.full_bytes
    np.testing.assert_array_equal(spec.uniform_capacity, [[0.5 * 24 * 64], [0.5 * 100 * 64]])
    assert spec.mean_capacity == 0.5 * 100 * 64  # the whole model's mean (not given: every layer global)
    model = CacheSpec(2, 2, 16, 60, 100, 0.5, layer_windows=(24, None), model_held=62.0)
    assert model.mean_capacity == spec.total_capacity / 4
    latent = CacheSpec(3, 1, 24, 10, 20, 1.0, token_values=40)  # MLA: one latent of 40 values per layer
    assert latent.fp_bytes == 80 and latent.full_bytes == 3 * 20 * 80


@pytest.mark.parametrize("case", CASES)
def test_every_policy_keeps_to_its_bytes_on_windowed_layers(case):
    """Through the one driver: positions that left a sliding layer's window are EVICTED at every
    step (the model drops them), at no cost; every unit keeps to β of what its layer holds."""
    rows, colsum, tail, k, v = stream()
    n_l, n_kv, final = rows.shape[1], rows.shape[2], rows.shape[-1]
    prompt, window = colsum.shape[-1], 48
    spec = CacheSpec(n_l, n_kv, k.shape[-1], prompt, final, 0.7, n_sink=4, w=8, layer_windows=(window, None))
    policy = parse(case)
    state = policy.start(spec, k, v) if policy.quantizes else policy.start(spec)
    driver = PolicyDriver(state, check=True)
    future = lambda t: rows[t + 1 : t + 33].sum(0)
    driver.prefill(colsum, tail, future(0) if policy.clairvoyant else None)
    for t in range(1, rows.shape[0]):
        driver.append(prompt - 1 + t)
        seen = renormalized(rows[t, ..., : state.length], state.accessible())
        used = driver.decide(seen, future(t) if policy.clairvoyant else None)
        gone = state.length - window
        assert (state.tiers[0, :, :gone] == EVICTED).all()  # out of the window: dropped by the model
        if state.reached:
            assert (used <= np.broadcast_to(spec.capacity, used.shape) * (1 + 1e-6)).all()


def test_mla_is_one_unit_per_layer_and_refuses_quantizing():
    """Under MLA every head reads one latent: per-head errors average into the layer's unit, and
    a policy that quantizes K/V or prunes per head is refused in one line."""
    np.testing.assert_allclose(per_unit(np.arange(8.0).reshape(2, 4), 1, 1), [[1.5], [5.5]])
    assert per_unit(np.ones((2, 3)), 3, 1).shape == (2, 3)
    spec = ModelSpec(n_layers=2, n_heads=4, n_kv_heads=1, head_dim=24, key_heads=4, kv_latent_dim=24,
                     architecture="DeepseekV2ForCausalLM")  # fmt: skip
    check_geometry([parse("h2o"), parse("snapkv"), parse("streaming"), parse("oracle")], spec)
    for name in ("kivi", "logquant", "qevict"):
        with pytest.raises(KvscopeError, match="latent of 24 values per token and layer"):
            check_geometry([parse(name)], spec)
