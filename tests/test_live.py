"""Live decoding under policy caches on the real SmolLM2: `full` is plain decoding token for
token, every policy stays within its budget at every step (by the byte model and by the
tensors it really holds), QEvict's ledger is write-once live too, replay makes exactly the
live cache's decisions on a trace recorded under it, and the CLI (run, trace --policy,
validate) works end to end with one-line errors for bad input."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

import kvscope
from kvscope.errors import KvscopeError
from kvscope.live import PolicyCache, prepare
from kvscope.live.run import agreement, decode
from kvscope.model.spec import with_cache
from kvscope.policies import CacheState, Ledger, LedgerError, Policy, available, parse
from kvscope.tiers import TIER_EVICTED as EVICTED
from kvscope.tiers import TIER_FP as FP
from kvscope.tiers import TIER_Q as Q

from .conftest import run_cli, run_main

LIVE_POLICIES = [name for name, cls in available().items() if not cls.clairvoyant and not cls.reads_queries]
# kvpress's presses run live on the model's own attention modules: a prompt press, a press reading
# the layer's attention weights, one moving budget across heads, one across layers, one while decoding
LIVE_PRESSES = [
    "press:SnapKVPress",
    "press:ObservedAttentionPress",
    "press:AdaKVPress:press=KeyDiffPress",
    "press:PyramidKVPress",
    "press:DecodingPress:base=KnormPress:compression_interval=8",
]
STEPS = 24


@pytest.fixture(scope="module")
def loaded(smollm2_dir):
    from kvscope.model.loading import load, resolve

    source = resolve("smollm2-135m")
    model, tokenizer = load(source)
    prepare(model)
    return source, model, tokenizer


@pytest.fixture(scope="module")
def tiny_llama(tiny_models):
    from transformers import AutoModelForCausalLM

    return prepare(AutoModelForCausalLM.from_pretrained(tiny_models["llama"]))


@pytest.fixture(scope="module")
def prompt_ids(loaded):
    import pydoc_data.topics as topics

    _, _, tokenizer = loaded
    return tokenizer(topics.topics["assignment"][:1600]).input_ids[:240]


@pytest.fixture(scope="module")
def full_decode(loaded, prompt_ids):
    _, model, _ = loaded
    return decode(model, prompt_ids, DynamicCache(config=model.config), STEPS)


def test_full_policy_is_plain_decoding(loaded, prompt_ids, full_decode):
    _, model, _ = loaded
    cache = PolicyCache(model, "full", 1.0, STEPS, check=True)
    live = decode(model, prompt_ids, cache, STEPS)
    assert live.tokens == full_decode.tokens
    assert torch.equal(live.logits, full_decode.logits)  # bit for bit: the same keys in the same order
    assert cache.bytes_actual[-1] == cache.bytes_model[-1] == (len(prompt_ids) + STEPS - 1) * 30 * 3 * 2 * 64 * 4
    metrics = agreement(full_decode, live, live)
    assert metrics["agreement"] == 1.0 and metrics["kl"] == 0.0 and metrics["first_divergence"] is None
    assert metrics["perplexity"] == metrics["perplexity_full"]


def test_an_observing_cache_serves_the_row_it_observes(loaded, prompt_ids, full_decode):
    """A policy that observes its decode rows gets them from the attention that produced the
    output (probs · V, one pass over the keys), while the prompt's forward is the kernel's (its
    column sums computed beside it): with every position held (H2O at β = 1) that is plain
    decoding up to float summation order; per head with padding slots, the kernel's output."""
    from kvscope.tracing.capture import _masked_output, _observed_row, _per_head_mask, attention_probs

    _, model, _ = loaded
    cache = PolicyCache(model, "h2o", 1.0, STEPS, check=True)
    live = decode(model, prompt_ids, cache, STEPS)
    assert live.tokens == full_decode.tokens
    assert (live.logits - full_decode.logits).abs().max() < 1e-3
    assert torch.equal(live.logits[0], full_decode.logits[0])  # the prompt's forward: the kernel's, bit for bit
    assert not torch.equal(live.logits[1:], full_decode.logits[1:])  # not the kernel's bits: the observed row's
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, n, r, 16, generator=g) for n, r in ((6, 1), (2, 11), (2, 11)))
    held = torch.rand(2, 11, generator=g) > 0.3
    held[:, 0] = True
    mask = _per_head_mask(held, 6, 1, None)  # [1, head, 1, kv]
    out, probs = _observed_row(query, key, value, mask, 0.25, None)
    assert torch.equal(probs, attention_probs(query, key, mask, 0.25, None))
    assert (probs[0, :, 0][~held.repeat_interleave(3, 0)] == 0).all()
    torch.testing.assert_close(out, _masked_output(query, key, value, mask, 0.25, None), rtol=0, atol=1e-6)
    assert out.shape == (1, 1, 6, 16)


def test_generate_accepts_the_cache(loaded, prompt_ids, full_decode):
    _, model, _ = loaded
    cache = PolicyCache(model, "h2o", 0.3, 12)
    out = model.generate(
        torch.tensor([prompt_ids]), **with_cache(model, cache), max_new_tokens=12, do_sample=False, min_new_tokens=12
    )
    manual = decode(model, prompt_ids, PolicyCache(model, "h2o", 0.3, 12), 12)
    assert out[0, len(prompt_ids) :].tolist() == manual.tokens
    assert cache.step == 10  # 12 forwards: the last decision is applied by the next forward, which never comes
    prepare(model, "eager")  # eager builds a mask for every forward: the cache's decisions must not upset it
    try:
        out = model.generate(
            torch.tensor([prompt_ids]), **with_cache(model, PolicyCache(model, "qevict", 0.3, 12)), max_new_tokens=12,
            do_sample=False, min_new_tokens=12,
        )  # fmt: skip
        assert out.shape[1] == len(prompt_ids) + 12
    finally:
        prepare(model)


@pytest.mark.parametrize("name", LIVE_POLICIES)
@pytest.mark.parametrize("budget", [0.2, 0.5])
def test_every_policy_stays_within_budget(loaded, prompt_ids, full_decode, name, budget):
    _, model, _ = loaded
    cache = PolicyCache(model, name, budget, STEPS, check=True)  # check: invariants + rows == tiers each step
    live = decode(model, prompt_ids, cache, STEPS)
    assert len(cache.bytes_actual) == len(cache.bytes_model) == STEPS  # decode() ends every step
    actual = np.asarray(cache.bytes_actual, dtype=np.float64)
    model_bytes = np.asarray(cache.bytes_model)
    if cache.state.reached:
        assert (actual <= cache.budget_bytes * (1 + 1e-9)).all()
        assert (model_bytes <= cache.budget_bytes * (1 + 1e-9)).all()
    assert (actual <= model_bytes + 1e-6).all()  # a promoted window is served from its codes, never more
    if name != "full":
        assert actual.max() < cache.full_bytes
    tiers = cache.state.tiers[..., : cache.seen]
    if not cache.policy.quantizes:
        assert not (tiers == 1).any()
    held = sum(int(p.fp_pos.numel()) + p.n_q() for p in cache.pools)
    assert held == int((tiers >= 1).sum())  # exactly the accessible positions are held
    assert live.logits.shape == full_decode.logits.shape


@pytest.mark.parametrize("name", LIVE_PRESSES[:4])
def test_presses_live_hold_their_budget(loaded, prompt_ids, name):
    """A prompt press compresses once, after the prefill: the cache then holds the kept prompt
    rows and every decode row, within β at every step, exactly the accessible positions."""
    _, model, _ = loaded
    cache = PolicyCache(model, name, 0.3, STEPS, check=True)
    decode(model, prompt_ids, cache, STEPS)
    actual, budget = np.asarray(cache.bytes_actual, dtype=np.float64), cache.budget_bytes
    assert cache.state.reached and cache.state.setting["compression_ratio"] > 0.5
    assert (actual <= budget * (1 + 1e-9)).all() and actual.max() > 0.9 * budget
    np.testing.assert_array_equal(actual, cache.bytes_model)  # fp32 rows, counted as the byte model counts them
    tiers = cache.state.tiers[..., : cache.seen]
    assert (tiers[..., len(prompt_ids) :] == 2).all()  # every decode token kept
    assert sum(int(p.fp_pos.numel()) for p in cache.pools) == int((tiers == 2).sum())
    assert cache.bytes_serving[-1] > 0 and cache.state.scratch_bytes() == 0  # prompt presses keep no copy


def test_decoding_press_live_compresses_while_decoding(loaded, prompt_ids):
    """DecodingPress never compresses the prompt and prunes to its target every
    ``compression_interval`` steps: the bytes grow by 7 rows between compressions, stay within
    β, and the copy its hook compresses (the cache's mirror) is counted with the serving buffers."""
    _, model, _ = loaded
    cache = PolicyCache(model, LIVE_PRESSES[4], 0.8, 40, check=True)
    decode(model, prompt_ids[:60], cache, 40)
    assert cache.state.reached and cache.state.setting == {"target_size": 73}  # ⌊0.8 · 100⌋ − 8 + 1
    held = np.asarray(cache.bytes_actual) / cache.spec.fp_bytes / (cache.n_layers * cache.n_kv)  # tokens per unit
    assert held.max() <= 80 and held[-1] < 100 and len(set(np.diff(held)) - {0.0, 1.0}) > 0
    assert cache.press.scratch_bytes() > 0
    assert cache.bytes_serving[-1] >= cache.press.scratch_bytes()


def test_qevict_ledger_is_write_once_live(loaded, prompt_ids):
    _, model, _ = loaded
    cache = PolicyCache(model, "qevict", 0.3, STEPS, check=True)
    model_inputs = torch.tensor([prompt_ids])
    snapshots = {}
    with torch.no_grad():
        inputs = model_inputs
        for t in range(STEPS):
            out = model(input_ids=inputs, use_cache=True, **with_cache(model, cache))
            cache.end_step()
            pool = cache.pools[5]
            if pool.q is not None:  # codes of a position never change while it is held
                for h, p, row in zip(pool.q["q_head"].tolist(), pool.q["q_pos"].tolist(), pool.q["k_codes"]):
                    key = (h, p)
                    if key in snapshots:
                        assert torch.equal(snapshots[key], row)
                    snapshots[key] = row.clone()
            inputs = out.logits[:, -1:].argmax(-1)
    ledger = cache.state.ledger
    assert ledger.n_quantized > 0 and snapshots
    layer, head, pos = np.argwhere(ledger.done)[0]
    window = pos - (pos - cache.state.n_sink) % cache.state.w + np.arange(cache.state.w)
    with pytest.raises(LedgerError):
        ledger.quantize(window[None], np.array([layer]), np.array([head]))


@pytest.mark.parametrize("name", ["streaming", "h2o", "snapkv", "kivi", "logquant", "qevict", *LIVE_PRESSES])
def test_replay_makes_the_live_decisions(loaded, tmp_path, name):
    source, model, tokenizer = loaded
    from kvscope.live import LivePolicy
    from kvscope.model.prompts import Prompt
    from kvscope.tracing.runner import TraceSettings, trace_loaded

    settings = TraceSettings(max_new_tokens=33, record_qkv=True, dtype="float32", stop_at_eos=False, block_steps=16)
    settings.check()
    import pydoc_data.topics as topics

    out = tmp_path / "live.zarr"
    prompt = [Prompt(topics.topics["assignment"][:900])]
    trace_loaded(model, tokenizer, source, prompt, out=out, settings=settings, cache=LivePolicy(name, 0.3))
    live = kvscope.open_trace(out)
    assert live.attrs["policy"]["label"] == parse(name).label() and live.attrs["policy"]["kv_itemsize"] == 4
    replayed = kvscope.replay(live, [name], [0.3], observe="exact", kv_itemsize=4)
    tiers = replayed["tiers"].values[0, 0, 0, 0]  # [event, layer, kv_head, pos]
    recorded = live["policy_tiers"].values[0]
    assert tiers.shape == recorded.shape
    np.testing.assert_array_equal(tiers, recorded)
    np.testing.assert_allclose(replayed["bytes_used"].values[0, 0, 0, 0], live["policy_bytes"].values[0])
    # rows under the policy: the step after an event gives its evicted positions no attention
    rows = live["attn"].values[0, 25]  # [layer, kv_head, pos]
    assert np.nansum(rows[recorded[3] == 0]) == 0.0 and np.nansum(rows[recorded[3] >= 1]) > 0


def test_bad_use_is_refused(loaded, prompt_ids):
    _, model, _ = loaded
    with pytest.raises(KvscopeError, match="clairvoyant"):
        PolicyCache(model, "oracle", 0.3, 8)
    with pytest.raises(KvscopeError, match="budget"):
        PolicyCache(model, "h2o", 0.0, 8)
    cache = PolicyCache(model, "h2o", 0.3, 8)
    with pytest.raises(KvscopeError, match="batch"):
        model(input_ids=torch.tensor([prompt_ids[:20], prompt_ids[:20]]), cache=cache)
    cache = PolicyCache(model, "full", 1.0, 2)
    with pytest.raises(KvscopeError, match="past them"):
        decode(model, prompt_ids[:20], cache, 4)
    model.set_attn_implementation("sdpa")
    try:
        cache = PolicyCache(model, "h2o", 0.3, 8)
        with pytest.raises(KvscopeError, match="prepare"):
            decode(model, prompt_ids[:30], cache, 3)
    finally:
        prepare(model)


def test_cli_run_trace_validate(tmp_path, small_qkv_trace):
    """``run`` and ``validate`` as real subprocesses once each, the others through ``main``;
    the trace is the session's (``trace --workload prose --record qkv`` by subprocess)."""
    proc = run_cli(
        "run", "--prompt", "The history of the Roman Empire begins", "--policy", "full", "--budget", "1",
        "--max-new-tokens", "8", "--json", check=True,
    )  # fmt: skip
    doc = json.loads(proc.stdout)["samples"][0]
    assert doc["agreement"] == 1.0 and doc["kl"] == 0.0 and doc["bytes_actual_peak"] <= doc["budget_bytes"]
    proc = run_main(
        "run", "--workload", "niah", "--context", "300", "--samples", "1", "--policy", "streaming", "--budget", "0.5",
        "--max-new-tokens", "12",  # three decodes of 12 steps (the recipe's 48 add nothing to the claim)
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "streaming" in proc.stdout and "score" in proc.stdout
    full = small_qkv_trace
    proc = run_cli(
        "validate", full, "--policy", "qevict", "--budget", "0.3", "--json", "--live-out", tmp_path / "l.zarr"
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["decisions_identical"] and report["decision_agreement"] == 1.0
    assert len(report["layers"]) == 30 and report["live_mean"] > 0 and report["predicted_mean"] > 0
    # open loop predicts the live error: same size on average (0.19 vs 0.20), same layers (ρ 0.99)
    assert 0.5 < report["predicted_mean"] / report["live_mean"] < 2 and report["correlation"] > 0.8
    assert "Warning" not in proc.stderr
    assert kvscope.open_trace(tmp_path / "l.zarr")["policy_tiers"].shape[:2] == (1, 2)  # 16 steps, every w = 8
    proc = run_main("validate", full, "--policy", "h2o", "--budget", "0.3")
    assert proc.returncode == 0, proc.stderr
    assert "decisions: identical" in proc.stdout and "predicted / live" in proc.stdout
    proc = run_main("validate", full, "--policy", "press:KnormPress", "--budget", "0.3", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["policy"] == "press:KnormPress" and report["decisions_identical"]


def test_cli_bad_input(tmp_path):
    from kvscope.storage.synthetic import write_synthetic_store

    plain = write_synthetic_store(tmp_path / "plain.zarr", n_samples=1, n_steps=16, n_layers=2, n_kv=2, prompt_len=24)
    cases = [
        (("run", "--prompt", "hi", "--policy", "nope", "--budget", "0.3"), "unknown policy"),
        (("run", "--prompt", "hi", "--policy", "h2o", "--budget", "0"), "(0, 1]"),
        (("run", "--prompt", "hi", "--policy", "oracle", "--budget", "0.3"), "clairvoyant"),
        (("run", "--prompt", "hi", "--policy", "h2o", "--budget", "0.3", "--kv-dtype", "int3"), "--kv-dtype"),
        (("run", "--prompt", "hi", "--policy", "h2o", "--budget", "0.3", "--model", "nomodel"), "model not found"),
        (
            ("trace", "--prompt", "hi", "--max-new-tokens", "4", "--policy", "h2o", "--out", tmp_path / "a.zarr"),
            "--budget",
        ),
        (
            ("trace", "--prompt", "hi", "--max-new-tokens", "4", "--budget", "0.3", "--out", tmp_path / "b.zarr"),
            "--policy",
        ),
        (
            (
                "trace",
                "--prompt",
                "hi",
                "--max-new-tokens",
                "4",
                "--policy",
                "h2o",
                "--budget",
                "0.3",
                "--batch-size",
                "2",
                "--out",
                tmp_path / "c.zarr",
            ),
            "one sample at a time",
        ),  # fmt: skip
        (("validate", plain, "--policy", "h2o", "--budget", "0.3"), "q/k/v"),
        (("validate", tmp_path / "missing.zarr", "--policy", "h2o", "--budget", "0.3"), "missing.zarr"),
        (("validate", plain, "--policy", "h2o", "--budget", "2"), "(0, 1]"),
    ]
    for i, (args, words) in enumerate(cases):  # the first as a real subprocess, the rest in-process
        proc = (run_cli if i == 0 else run_main)(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr, (args, proc.stderr)
    assert not any((tmp_path / n).exists() for n in ("a.zarr", "b.zarr", "c.zarr"))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_other_geometries(tiny_models, kind):
    """Tiny random-weight Llama (4 heads / 2 KV heads) and Qwen2 (6 / 2, attention biases):
    `full` is plain decoding, QEvict and KIVI keep their invariants and budgets."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models[kind])
    prepare(model)
    ids = list(range(5, 125))
    plain = decode(model, ids, DynamicCache(config=model.config), 20)
    assert decode(model, ids, PolicyCache(model, "full", 1.0, 20), 20).tokens == plain.tokens
    for name in ("qevict", "kivi", "h2o"):
        cache = PolicyCache(model, name, 0.4, 20, check=True)
        decode(model, ids, cache, 20)
        if cache.state.reached:
            assert max(cache.bytes_actual) <= cache.budget_bytes


def test_sliding_window_models_are_refused(tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["mistral_sliding"])
    with pytest.raises(KvscopeError, match="global-attention"):
        PolicyCache(model, "h2o", 0.3, 8)


@dataclass
class _Shuffler(Policy):
    """A test policy that moves random positions between tiers at every step: quantizes random
    groups of FP positions of random heads (write-once, as every quantizing policy; at the
    append too, before the forward attends), promotes
    random Q positions back to FP (served from their codes, as QEvict's promotions), and evicts
    random accessible positions (never position 0, so that no head runs empty)."""

    seed: int = 0
    bits: int = 2
    key_axis: str = "channel"
    prerope: bool = False
    G: int = 4

    name = "shuffler"
    quantizes = True

    def start(self, spec, k=None, v=None, rope=None):
        key_group = 8 if self.key_axis == "token" else None
        ledger = Ledger(spec, self.bits, self.key_axis, key_group, 8, rope=rope if self.prerope else None)
        return _ShufflerState(self, spec, ledger)


class _ShufflerState(CacheState):
    def __init__(self, policy, spec, ledger):
        super().__init__(policy, spec, ledger)
        self.reached = False  # no budget: the point is the tier changes

    def _quantize_some(self, rng, n: int, share: float) -> None:
        """Quantize a random group of FP positions below ``n`` in a ``share`` of the heads."""
        tiers, done = self.tiers[..., :n], self.ledger.done[..., :n]
        for layer, head in np.argwhere(rng.random(tiers.shape[:2]) < share):
            free = np.nonzero((tiers[layer, head] == FP) & ~done[layer, head])[0]
            if len(free) >= self.policy.G:
                group = np.sort(rng.choice(free, self.policy.G, replace=False))
                self.ledger.quantize(group[None], np.array([layer]), np.array([head]))
                tiers[layer, head, group] = Q

    def append(self, position: int) -> None:
        """Quantizes at the append too, before the forward attends (as LogQuant when its
        reserve moves on); never the new key, which the cache takes during the forward."""
        super().append(position)
        self._quantize_some(np.random.default_rng([self.policy.seed, position, 1]), position, 0.3)

    def compress(self) -> None:
        rng = np.random.default_rng([self.policy.seed, self.length])
        self._quantize_some(rng, self.length, 0.6)
        tiers = self.tiers[..., : self.length]
        tiers[(tiers == Q) & (rng.random(tiers.shape) < 0.1)] = FP  # promoted: served from the codes
        evict = (tiers >= Q) & (rng.random(tiers.shape) < 0.05)
        evict[..., 0] = False
        tiers[evict] = EVICTED


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    bits=st.sampled_from([2, 4, 8]),
    key_axis=st.sampled_from(["channel", "token"]),
    prerope=st.booleans(),
    kv_dtype=st.sampled_from([None, torch.float16]),
)
def test_serving_copy_is_the_dequantized_codes(tiny_llama, seed, bits, key_axis, prerope, kv_dtype):
    """After any sequence of random quantizations, promotions and evictions the served buffer
    (updated in place: rows quantized overwritten with their dequantized values once, holes of
    evicted rows filled with the last ones) holds exactly the rows a fresh gather gives — FP
    rows as stored, Q rows dequantized from every code — set-wise by (head, position), bit for
    bit, the cache's record of its rows equals its rows, and every forward attends to each
    accessible position exactly once (check=True compares all three at every step); the values
    served are those the ledger gives."""
    model = tiny_llama
    cache = PolicyCache(model, _Shuffler(seed, bits, key_axis, prerope), 1.0, 10, kv_dtype=kv_dtype, check=True)
    decode(model, list(range(5, 45)), cache, 10)
    tiers, done = cache.state.tiers[..., : cache.seen], cache.state.ledger.done[..., : cache.seen]
    assert (tiers == Q).any() and (tiers == EVICTED).any() and (done & (tiers == FP)).any()
    permuted = False
    for layer, pool in enumerate(cache.pools):
        served = pool.served
        heads, pos, keys, values = cache._gathered(layer, torch.float32)  # a fresh gather from the pools
        slots = served.slot_of[heads, pos]  # every held row has one slot of its head, below its count
        assert ((slots >= 0) & (slots < served.count[heads])).all()
        assert np.array_equal(served.pos_at[heads, slots], pos) and (served.pos_at >= 0).sum() == len(pos)
        assert torch.equal(served.keys[heads, slots], keys) and torch.equal(served.values[heads, slots], values)
        permuted |= any((np.diff(served.pos_at[h, : served.count[h]]) < 0).any() for h in range(served.n_kv))
    assert permuted  # an eviction filled a hole: the slots are not in position order any more
    assert cache.bytes_serving[-1] == sum(p.served.nbytes() for p in cache.pools)
