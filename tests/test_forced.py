"""Forced replay (docs/concepts.md#forced-replay) is the live forced decode, computed offline.

Ground truth: `kvscope run`'s forced decode — the live `PolicyCache` fed the full-KV tokens one
forward at a time — on the real SmolLM2 and a tiny GQA model. Per step the KL to full KV agrees
within 1e-5 nats + 1e-5 of its size in float32 (the two sum in other orders: tests/tolerance.py) and the final tier maps are identical, for every kind of policy: a
prompt-time press, a decode-time eviction (closed loop), a tiered quantizer, a quantizer, an
allocation and per-head budgets. The CLI's `replay --forced` gives `run`'s mean KL."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import kvscope
from kvscope.errors import KvscopeError
from kvscope.live import PolicyCache, prepare
from kvscope.live.run import decode
from kvscope.policies import parse
from kvscope.replay.forced import ForcedRun, SampleForcing, load_model
from kvscope.replay.plan import ReplaySetup

from .conftest import one_line_error, run_cli, run_main
from .tolerance import KL_FLOOR, assert_kl_close

STEPS = 16


def _trace(out, text, steps=STEPS, **extra):
    kvscope.trace(text, out, max_new_tokens=steps, stop_at_eos=False, record_qkv=True, dtype="float32",
                  block_steps=8, **extra)  # fmt: skip
    return out


@pytest.fixture(scope="session")
def forced_trace(tmp_path_factory, smollm2_dir):
    """SmolLM2, one ~360-token prose prompt, 16 steps, float32 with q/k/v."""
    from pydoc_data import topics

    return _trace(tmp_path_factory.mktemp("forced") / "prose.zarr", topics.topics["assignment"][:1500])


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from kvscope.model.loading import load, resolve

    model, _ = load(resolve("smollm2-135m"))
    return prepare(model)


@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory, tiny_models):
    text = " ".join(f"item {i} is {i * 7 % 13}." for i in range(40))
    return _trace(tmp_path_factory.mktemp("forced-tiny") / "tiny.zarr", text, model=str(tiny_models["llama"]))


@pytest.fixture(scope="module")
def tiny_llama(tiny_models):
    from transformers import AutoModelForCausalLM

    return prepare(AutoModelForCausalLM.from_pretrained(tiny_models["llama"]))


_MODELS: dict = {}  # trace → its model, loaded once per test process
_SAMPLES: dict = {}  # (trace, chunk, max_rounds) → its sample 0 prefilled, with its full-KV reference
_FULL: dict = {}  # (id(model), trace) → the live full-KV decode


def _sample(trace, policies=("full",), budgets=(1.0,), allocations=None, chunk=4, max_rounds=8):
    """Sample 0 of ``trace`` for forced runs: its prefill (with the prompt's q/k/v) and full-KV
    reference (with each step's q/k/v) made once per (trace, chunk, max_rounds) and shared by every
    run the tests make on it."""
    key = (str(trace), chunk, max_rounds)
    if key in _SAMPLES:
        return _SAMPLES[key]
    ds = kvscope.open_trace(trace)
    forced = _MODELS.get(str(trace)) or _MODELS.setdefault(str(trace), load_model(ds))
    setup = ReplaySetup.of(
        ds, list(policies), allocations, list(budgets), observe="renorm", every=None, errors=False, validate=True,
        kv_itemsize=forced.itemsize, question_agnostic=False, horizon=32, horizons=None, m=4, h_lir=8, delta=1,
        n_boot=10, seed=0, resample="samples",
    )  # fmt: skip
    sample = SampleForcing(setup, 0, forced, chunk, max_rounds)
    sample.start()
    _SAMPLES[key] = setup, sample
    return setup, sample


def _live(model, trace, policy, budget, allocation=None):
    """The live forced decode: per-step KL to full KV and the final tier maps."""
    ds = kvscope.open_trace(trace)
    p = int(ds.kvscope.prompt_len[0])
    ids = [int(x) for x in ds["tokens"].values[0, :p]]
    key = (id(model), str(trace))
    if key not in _FULL:
        _FULL[key] = decode(model, ids, DynamicCache(config=model.config), STEPS)
    full = _FULL[key]
    assert full.tokens == [int(x) for x in ds.kvscope.generated(0)]
    cache = PolicyCache(model, policy, budget, STEPS, allocation=allocation)
    forced = decode(model, ids, cache, STEPS, forced=full.tokens)
    cache.end_step()
    ref, logp = torch.log_softmax(full.logits, -1), torch.log_softmax(forced.logits, -1)
    return (ref.exp() * (ref - logp)).sum(-1).numpy(), cache.state.tiers


def _forced(sample, policy, budget, allocation=None):
    """The forced decode of one run."""
    return ForcedRun(sample, parse(policy), allocation and parse_allocation(allocation), budget).run()


def parse_allocation(name):
    from kvscope.policies.allocation import parse as parse_alloc

    return parse_alloc(name)


def _agree(model, trace, policy, budget, allocation=None, chunk=4):
    _, sample = _sample(trace, chunk=chunk)
    run = _forced(sample, policy, budget, allocation)
    kl, tiers = _live(model, trace, policy, budget, allocation)
    assert_kl_close(run.kl, kl)
    np.testing.assert_array_equal(run.state.tiers, tiers)
    assert run.converged
    return run, kl


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy, allocation",
    [("press:SnapKVPress", None), ("h2o", None), ("qevict", None), ("kivi", None), ("h2o", "pyramid")],
)
def test_forced_replay_is_the_live_forced_decode_on_smollm2(smollm2, forced_trace, policy, allocation):
    run, kl = _agree(smollm2, forced_trace, policy, 0.3, allocation)
    assert kl[0] == pytest.approx(0, abs=1e-6) and kl[1:].max() > 1e-3  # the cache changed the output
    assert run.depends == (policy in ("h2o", "qevict"))  # decisions on what the cache served: a closed loop


@pytest.mark.parametrize(
    "policy, budget, allocation",
    [
        ("streaming", 0.4, None),
        ("h2o", 0.4, None),
        ("h2o", 0.7, None),
        ("qevict", 0.5, None),
        ("logquant:W=8", 0.6, None),
        ("h2o", 0.4, "adakv"),
        ("press:AdaKVPress:press=SnapKVPress:window_size=16", 0.4, None),
        ("press:KnormPress", 0.5, None),
        # presses on the model's own modules, that rewrite what they keep, that run the model, that decode
        ("press:LeverageScorePress", 0.5, None),
        ("press:CriticalKVPress:press=SnapKVPress:window_size=16", 0.5, None),
        ("press:KeyRerotationPress:press=KnormPress", 0.5, None),
        ("press:ThinKPress", 0.5, None),
        ("press:KVzipPress", 0.5, None),
        ("press:DecodingPress:base_press=KnormPress:compression_interval=4", 0.6, None),
    ],
)
def test_forced_replay_is_the_live_forced_decode_on_a_gqa_model(tiny_llama, tiny_trace, policy, budget, allocation):
    _agree(tiny_llama, tiny_trace, policy, budget, allocation)


def test_chunks_of_one_step_give_the_same_decode(tiny_trace):
    """The chunked closed loop reaches what a step-by-step loop computes (one round each)."""
    out = {}
    for chunk in (1, 5, 16):
        _setup, sample = _sample(tiny_trace, chunk=chunk)
        run = _forced(sample, "h2o", 0.4)
        out[chunk] = run
        assert run.converged and (run.rounds == 1 if chunk == 1 else True)
    assert_kl_close(out[5].kl, out[1].kl)
    assert_kl_close(out[16].kl, out[1].kl)
    np.testing.assert_array_equal(out[16].state.tiers, out[1].state.tiers)


def test_a_decoding_press_runs_step_by_step_at_any_chunk(tiny_trace):
    """A press that acts while decoding reads each step's own q/k/v: it is driven one step per
    forward, as live decoding drives it (one round, whatever ``chunk``), to the same decode."""
    policy = "press:DecodingPress:base_press=KnormPress:compression_interval=4"
    runs = [_forced(_sample(tiny_trace, chunk=chunk)[1], policy, 0.6) for chunk in (1, 16)]
    assert [(run.rounds, run.converged) for run in runs] == [(1, True), (1, True)]
    assert_kl_close(runs[1].kl, runs[0].kl)  # each against its own sample's reference (decoded in its chunks)
    np.testing.assert_array_equal(runs[0].state.tiers, runs[1].state.tiers)


def test_a_loop_that_runs_out_of_rounds_is_labelled(tiny_trace):
    """H2O at β 0.7 on the tiny model needs three forwards of a 16-step chunk: with fewer allowed the
    run says it did not converge; with enough it does."""
    got = {}
    for max_rounds in (1, 2, 8):
        _setup, sample = _sample(tiny_trace, chunk=16, max_rounds=max_rounds)
        run = _forced(sample, "h2o", 0.7)
        got[max_rounds] = (run.rounds, run.converged)
    assert got == {1: (1, False), 2: (2, False), 8: (3, True)}


@pytest.mark.slow
def test_cli_forced_replay_equals_run(forced_trace):
    """`kvscope replay --forced` against `kvscope run --json` on the same prompt and budget."""
    ran = run_cli("replay", forced_trace, "--forced", "--policies", "press:SnapKVPress,h2o,qevict", "--budgets", "0.3",
                  "--json", check=True)  # fmt: skip
    rows = {row["policy"]: row for row in json.loads(ran.stdout)["rows"]}
    doc = json.loads(ran.stdout)
    assert json.loads(doc["forced"])["loops"] == {"press:SnapKVPress": "one round", "h2o": "closed", "qevict": "closed"}
    ds = kvscope.open_trace(forced_trace)
    prompt = ds.attrs["prompts"][0]["text"]
    for policy, row in rows.items():  # kvscope run through the CLI's own main (the same code a subprocess runs)
        live = run_main("run", "--policy", policy, "--budget", "0.3", "--max-new-tokens", STEPS, "--prompt", prompt,
                        "--json", "--quiet")  # fmt: skip
        assert live.returncode == 0, live.stderr
        got = json.loads(live.stdout)["samples"][0]
        assert row["forced_kl"] == pytest.approx(got["kl"], abs=1e-4), policy
        assert row["forced_converged"]


def test_forced_replay_refuses_what_it_cannot_do(tmp_path, tiny_trace, tiny_models):
    import shutil

    from .conftest import tree_digest

    one_line_error(run_cli("replay", tiny_trace, "--forced", "--policies", "h2o", "--budgets", "0.5",
                           "--max-rounds", "0"), "max rounds must be an integer ≥ 1")  # fmt: skip
    # the trace's model folder is gone: refused in one line, nothing written
    folder = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], folder)
    store = _trace(tmp_path / "gone.zarr", "a short prompt about nothing in particular " * 4, steps=4,
                   model=str(folder))  # fmt: skip
    shutil.rmtree(folder)
    before = tree_digest(store)
    out = tmp_path / "result.zarr"
    one_line_error(run_cli("replay", store, "--forced", "--policies", "h2o", "--budgets", "0.5", "--out", out),
                   "forced replay needs the trace's model")  # fmt: skip
    # every other input is checked before the model is looked for
    with pytest.raises(KvscopeError, match="observe must be renorm or exact"):
        kvscope.replay(store, ["h2o"], [0.5], forced=True, observe="nearby")
    assert tree_digest(store) == before and not out.exists()


ARCHITECTURES = ["mistral", "gpt_oss", "deepseek_v3", "lfm2"]  # sliding windows, learned sinks + sliding, MLA, hybrid


@pytest.fixture(scope="module")
def architecture_traces(tmp_path_factory, smollm2_dir):
    """Tiny random-weight models of ``ARCHITECTURES`` and a float32 trace of each (eager attention,
    the reference's kernel), 12 steps after a ~70-token prompt."""
    from .architectures import build_tiny_model

    base = tmp_path_factory.mktemp("forced-architectures")
    text = " ".join(f"line {i}: the value is {i * 5 % 11}." for i in range(12))
    out = {}
    for model_type in ARCHITECTURES:
        folder = build_tiny_model(model_type, base / model_type, smollm2_dir)
        out[model_type] = folder, _trace(base / f"{model_type}.zarr", text, steps=12, model=str(folder), attn="eager")
    return out


@pytest.mark.parametrize("model_type", ARCHITECTURES)
@pytest.mark.parametrize("policy, budget", [("streaming", 0.5), ("h2o", 0.5), ("snapkv", 0.6)])
def test_forced_replay_is_the_sequential_decode_on_other_architectures(architecture_traces, model_type, policy, budget):
    """Sliding windows, learned sinks, latent attention and a hybrid: forced replay (chunks of 4)
    against the model's own eager attention one token per forward, masked per layer and head by the
    policy's tier maps, the policy driven on the rows that attention produced
    (tests/forced_reference.py)."""
    from .forced_reference import reference

    folder, trace = architecture_traces[model_type]
    setup, sample = _sample(trace)
    run = _forced(sample, policy, budget)
    ds = kvscope.open_trace(trace)
    p = int(ds.kvscope.prompt_len[0])
    tokens = [int(x) for x in ds["tokens"].values[0, : p + int(ds.kvscope.n_steps[0])]]
    kl, tiers = reference(folder, tokens[:p], tokens[p:], parse(policy), setup.spec(0, budget), ds.kvscope.model)
    assert_kl_close(run.kl, kl)
    np.testing.assert_array_equal(run.state.tiers, tiers)
    assert run.converged
    if policy != "snapkv" or model_type != "mistral":  # (every mistral layer's window already drops what SnapKV would)
        assert kl[1:].max() > 1e-4  # the cache changed the output


def test_forced_result_store_compare_and_cluster(tmp_path, tiny_trace):
    """The forced variables in a replay result: written, reopened (checked), shown by compare; the
    same numbers from tasks on a dask cluster."""
    from distributed import Client, LocalCluster

    out = tmp_path / "result.zarr"
    kvscope.replay(tiny_trace, ["streaming", "h2o"], [0.4, 0.7], forced=True, forced_chunk=5, out=out)
    result = kvscope.open_result(out)
    assert result.attrs["kv_itemsize"] == 4
    kl = result["forced_kl"].values  # [policy, allocation, budget, sample, step]
    assert kl.shape == (2, 1, 2, 1, STEPS) and np.isfinite(kl).all() and kl[..., 0].max() == 0
    mean = result["forced_kl_mean"].values  # [policy, allocation, budget]: one sample, the mean over its steps
    np.testing.assert_allclose(mean, kl[..., 0, :].mean(-1))
    assert np.isnan(result["forced_kl_ci_low"].values).all()  # one sample: no between-prompt interval
    ppl = np.exp(result["forced_nll"].values[..., 0, :].mean(-1))
    np.testing.assert_allclose(result["forced_perplexity"].values, ppl)
    assert (result["forced_perplexity"].values >= 1).all() and (result["forced_agreement"].values <= 1).all()
    shown = run_cli("compare", out, check=True).stdout
    assert "KL (forced)" in shown and "nats per step" in shown and "nan" not in shown
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None, processes=False) as cluster,
        Client(cluster) as client,
    ):
        on_cluster = kvscope.replay(tiny_trace, ["streaming", "h2o"], [0.4, 0.7], forced=True, forced_chunk=5,
                                    client=client)  # fmt: skip
    np.testing.assert_array_equal(on_cluster["forced_kl"].values, kl)


def test_forced_replay_of_a_given_continuation(tmp_path, tiny_models):
    """A trace that teacher-forced a given text (``trace --continuation``): forced replay scores that
    text under each cache (its NLL is the text's under full KV for ``full``), and refuses a trace
    whose recorded continuation no longer gives its tokens."""
    import zarr

    text = " ".join(f"entry {i} holds {i * 3 % 7}." for i in range(20))
    follow = " The list goes on: entry twenty holds six, entry twenty-one holds two, and so on."
    store = tmp_path / "continued.zarr"
    kvscope.trace(text, store, model=str(tiny_models["llama"]), continuation=follow, record_qkv=True,
                  dtype="float32", block_steps=8)  # fmt: skip
    result = kvscope.replay(store, ["full", "streaming"], [1.0, 0.4], forced=True, forced_chunk=6)
    ds = kvscope.open_trace(store)
    n = int(ds.kvscope.continuation_tokens[0])
    assert result.sizes["step"] == n
    nll = result["forced_nll"].sel(policy="full", budget=1.0).values[0]  # [step]
    ppl = np.exp(nll.mean())
    assert ppl == pytest.approx(float(result["forced_perplexity_full"].values[0]), rel=1e-5)
    assert result["forced_kl"].sel(policy="full", budget=1.0).values.max() < KL_FLOOR
    assert result["forced_kl"].sel(policy="streaming", budget=0.4).values.max() > 1e-3
    # the recorded text edited: its tokens are not the trace's any more
    group = zarr.open_group(str(store), mode="r+")
    prompts = list(group.attrs["prompts"])
    prompts[0] = {**prompts[0], "continuation": "Something else entirely."}
    group.attrs["prompts"] = prompts
    one_line_error(run_cli("replay", store, "--forced", "--policies", "streaming", "--budgets", "0.4"),
                   "recorded continuation does not match the trace's tokens")  # fmt: skip
