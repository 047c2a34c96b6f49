"""The shared quantizer and byte accounting (docs/concepts.md#quantizer, docs/concepts.md#budget), with the expected numbers by hand."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvscope.errors import KvscopeError
from kvscope.policies import CacheSpec, Ledger, LedgerError
from kvscope.policies.quant import fp_token_bytes, pack, packed_bytes, q_token_bytes, quantize, unpack

finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(
    arrays(np.float32, st.tuples(st.integers(1, 5), st.integers(1, 40)), elements=finite), st.sampled_from([2, 4, 8])
)
def test_error_at_most_half_a_step_per_group(x, bits):
    q = quantize(x, bits, axis=-1)
    x_hat = q.dequantize()
    scale = q.scale.astype(np.float32)
    assert q.codes.max() <= 2**bits - 1
    assert (np.abs(x - x_hat) <= scale / 2 * (1 + 1e-5) + 1e-6).all()


@settings(max_examples=100, deadline=None)
@given(arrays(np.float16, st.tuples(st.integers(1, 4), st.integers(1, 16)), elements=st.floats(-100, 100, width=16)))
def test_constant_groups_are_exact_and_zero_is_the_minimum(x):
    const = np.repeat(x[:, :1], x.shape[1], axis=1).astype(np.float32)
    q = quantize(const, 2)
    assert (q.scale == 1).all() and (q.dequantize() == const).all()
    assert (quantize(x.astype(np.float32), 2).zero[:, 0] == x.min(1)).all()  # fp16 input: zero = min exactly


def test_round_half_even_and_hand_values():
    # scale = (3 − 0) / 3 = 1, zero = 0: 0.5 → 0 and 1.5 → 2 (half to even), 2.5 → 2
    q = quantize(np.array([0.0, 0.5, 1.5, 2.5, 3.0], np.float32), 2)
    assert q.codes.tolist() == [0, 0, 2, 2, 3]
    assert float(q.scale[0]) == 1.0 and float(q.zero[0]) == 0.0
    # per-channel keys: the group runs along the token axis
    keys = np.array([[0.0, 10.0], [3.0, 10.0], [1.0, 16.0]], np.float32)  # [token, channel]
    qk = quantize(keys, 2, axis=0)
    assert qk.scale[0].tolist() == [1.0, 2.0] and qk.zero[0].tolist() == [0.0, 10.0]
    assert qk.codes.T.tolist() == [[0, 3, 1], [0, 0, 3]]


def test_pack_hand_values_and_round_trip():
    assert pack(np.array([1, 2, 3, 0], np.uint8), 2).tolist() == [1 | 2 << 2 | 3 << 4]
    assert pack(np.array([0xA, 0x5, 0x1], np.uint8), 4).tolist() == [0x5A, 0x01]
    rng = np.random.default_rng(0)
    for bits in (2, 4, 8):
        codes = rng.integers(0, 2**bits, size=(3, 37)).astype(np.uint8)
        packed = pack(codes, bits)
        assert packed.shape[-1] == packed_bytes(37, bits)
        assert (unpack(packed, bits, 37) == codes).all()
    with pytest.raises(KvscopeError):
        pack(codes, 3)


def test_byte_formulas_against_hand_counts():
    # D = 64: FP = K + V in 16 bit = 2·64·2
    assert fp_token_bytes(64) == 256
    # 2 bits: codes 2·64·2/8 = 32, keys per channel over G = 32 tokens: 4·64/32 = 8, values per token 4·64/64 = 4
    assert q_token_bytes(64, 2, key_group=32) == 44
    assert q_token_bytes(64, 4, key_group=32) == 64 + 8 + 4
    # keys per token in groups of 64 channels (LogQuant's code): 4·64/64 = 4
    assert q_token_bytes(64, 2, key_group=64, key_axis="token") == 40
    # QEvict window of w = 8: one key group per window
    assert q_token_bytes(64, 2, key_group=8) == 32 + 32 + 4
    spec = CacheSpec(n_layers=30, n_kv=3, head_dim=64, prompt_len=1000, final_len=1100, budget=0.25)
    assert spec.capacity == 0.25 * 1100 * 256 and spec.fp_capacity_tokens == 275


def test_ledger_is_write_once_and_counts_group_bytes():
    spec = CacheSpec(n_layers=1, n_kv=2, head_dim=8, prompt_len=8, final_len=16, budget=1.0)
    rng = np.random.default_rng(1)
    k = rng.standard_normal((1, 2, 16, 8)).astype(np.float32)
    ledger = Ledger(spec, 2, "channel", k=k, v=k.copy())
    ledger.quantize(np.arange(4))  # one group of 4 tokens in every (layer, kv_head)
    # codes 2·8·2/8 = 4, value parameters 4·8/8 = 4, key parameters 4·8 per group of 4 tokens = 8 per token
    assert ledger.q_cost[0, 0, :4].tolist() == [16.0] * 4 and ledger.q_cost[0, 0, 4:].sum() == 0
    assert np.abs(ledger.k_eff[0, 0, :4] - k[0, 0, :4]).max() > 0 and (ledger.k_eff[0, 0, 4:] == k[0, 0, 4:]).all()
    with pytest.raises(LedgerError):
        ledger.quantize(np.arange(2, 6))
    ledger.quantize(np.array([[4, 5, 6, 7]]), np.array([0]), np.array([1]))  # another head, fine
    with pytest.raises(LedgerError):
        ledger.quantize(np.array([[4, 5, 6, 7]]), np.array([0]), np.array([1]))


def test_ledger_quantizes_groups_in_chunks_exactly_as_at_once(monkeypatch):
    """Groups quantized QUANTIZE_ROWS at a time (bounded temporaries) give the values of one pass
    (keys pre-RoPE, groups of two layers and heads interleaved)."""
    from kvscope.model.rope import Rope
    from kvscope.policies import base

    spec = CacheSpec(n_layers=2, n_kv=3, head_dim=8, prompt_len=64, final_len=64, budget=1.0)
    rng = np.random.default_rng(2)
    k, v = (rng.standard_normal((2, 3, 64, 8)).astype(np.float16) for _ in range(2))
    rope = Rope(1.0 / 10000 ** (np.arange(0, 8, 2)[None].repeat(2, 0) / 8), np.ones(2))
    units = np.array([(layer, head) for layer in range(2) for head in range(3)])  # [unit, (layer, head)]
    starts = np.arange(0, 64, 8)
    positions = (starts[None, :, None] + np.arange(8)).reshape(-1, 8)  # [group, 8]: 8 groups per unit
    layers, heads = np.repeat(units[:, 0], len(starts)), np.repeat(units[:, 1], len(starts))
    positions = np.tile(positions, (len(units), 1))
    ledgers = []
    for rows in (10**6, 5):
        monkeypatch.setattr(base, "QUANTIZE_ROWS", rows)
        ledger = Ledger(spec, 2, "channel", k=k, v=v, rope=rope)
        ledger.quantize(positions, layers, heads)
        ledgers.append(ledger)
    assert ledgers[0].done.all() and not np.array_equal(ledgers[0].k_eff, k)
    np.testing.assert_array_equal(ledgers[0].k_eff, ledgers[1].k_eff)
    np.testing.assert_array_equal(ledgers[0].v_eff, ledgers[1].v_eff)


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.integers(1, 300), elements=st.floats(width=32, allow_nan=True, allow_infinity=True)))
def test_torch_conversions_are_numpys_bit_for_bit(x):
    """kvscope.storage.dtypes.cast (by torch once torch is loaded) gives numpy's astype bits, fp32 →
    fp16 → fp32: fp16 subnormals, overflow to ±inf and signed zeros included; NaN stays NaN (its
    payload and sign may differ); an array already of the dtype is copied, or returned with copy=False."""
    import torch  # noqa: F401  (loaded: cast converts by torch whatever the size)

    from kvscope.storage import dtypes

    tiny = np.float32(2.0**-24) * np.arange(-8, 9, dtype=np.float32)  # fp16 subnormals and around them
    x = np.concatenate([x, tiny, np.float32([65504, 65520, -65520, 1e-8, -0.0])])
    nan = np.isnan(x)
    half = dtypes.cast(x, np.float16)
    assert half.dtype == np.float16 and (np.isnan(half) == nan).all()
    with np.errstate(over="ignore"):  # numpy says so where a value overflows to ±inf
        expected = x[~nan].astype(np.float16)
    assert np.array_equal(half[~nan].view(np.uint16), expected.view(np.uint16))
    back = dtypes.cast(half, np.float32)
    assert back.dtype == np.float32 and (np.isnan(back) == nan).all()
    assert np.array_equal(back[~nan].view(np.uint32), half[~nan].astype(np.float32).view(np.uint32))
    assert dtypes.cast(back, np.float32, copy=False) is back
    same = dtypes.cast(back, np.float32)  # a new array by default, as numpy's astype: callers change it in place
    assert same is not back and not np.shares_memory(same, back) and np.array_equal(same, back, equal_nan=True)
