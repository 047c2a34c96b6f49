"""kvpress's presses replayed on a real SmolLM2 trace (fp32, q/k/v recorded): the twins make
kvscope's decisions, every verified press keeps the shared policy invariants, budgets move
across layers and heads where the press says so, and importing kvpress leaves transformers'
attention functions as they were."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvscope
from kvscope.policies import parse
from kvscope.tiers import TIER_EVICTED, TIER_FP

from .conftest import ROOT, one_line_error

VERIFIED = [
    "press:KnormPress",
    "press:StreamingLLMPress",
    "press:SnapKVPress:window_size=16",
    "press:TOVAPress",
    "press:ObservedAttentionPress",
    "press:KeyDiffPress",
    "press:ExpectedAttentionPress",
    "press:PyramidKVPress:window_size=8:beta=2",
    "press:AdaKVPress:press=ExpectedAttentionPress",
    "press:DecodingPress:base_press=KnormPress:compression_interval=4",
]
BUDGETS = [0.3, 0.95]


@pytest.fixture(scope="module")
def trace(tmp_path_factory, smollm2_dir):
    import pydoc_data.topics as topics

    out = tmp_path_factory.mktemp("presses") / "fp32-qkv.zarr"
    text = topics.topics["assignment"]
    prompts = [text[:600], text[2000:2900]]
    kvscope.trace(prompts, out, max_new_tokens=24, stop_at_eos=False, block_steps=8, record_qkv=True, dtype="float32")
    return out


@pytest.fixture(scope="module")
def result(trace):
    """Every verified press at both budgets, invariants checked at every step (validate)."""
    return kvscope.replay(trace, VERIFIED, BUDGETS, every=1, validate=True, n_boot=20).load().sel(allocation="uniform")


def _tiers(result, policy, budget):
    tiers = result["tiers"]
    if "allocation" in tiers.dims:  # presses run under the uniform allocation only
        tiers = tiers.sel(allocation="uniform")
    return tiers.sel(policy=policy, budget=budget).values  # [sample, event, layer, kv_head, pos]


def test_presses_hold_their_budget_at_every_step(result):
    budget_bytes = result["budget_bytes"].values  # [budget, sample]
    for policy in VERIFIED:
        for bi, budget in enumerate(BUDGETS):
            run = result.sel(policy=policy, budget=budget)
            reached = bool(run["budget_reached"])
            if policy.startswith("press:DecodingPress") and budget == 0.3:
                assert not reached  # its prompt is never compressed: P alone exceeds 30 %
                continue
            assert reached, (policy, budget)
            used = run["bytes_used"].values  # [sample, step]
            assert (np.nan_to_num(used) <= budget_bytes[bi][:, None] * (1 + 1e-6)).all(), (policy, budget)


def test_evicted_positions_never_return(result):
    for policy in VERIFIED:
        for budget in BUDGETS:
            tiers = _tiers(result, policy, budget)
            evicted = np.logical_or.accumulate(tiers == TIER_EVICTED, axis=1)
            assert not (evicted & (tiers == TIER_FP)).any(), policy


def test_presses_are_deterministic(trace, result):
    again = kvscope.replay(trace, VERIFIED[:4] + VERIFIED[-2:], [0.3], every=1, n_boot=20)
    for policy in again["policy"].values:
        assert (_tiers(again, policy, 0.3) == _tiers(result, policy, 0.3)).all(), policy


def test_snapkv_press_is_kvscope_snapkv(trace):
    """Same window (16), kernel (5) and average pooling: the same positions at every step."""
    twin = kvscope.replay(trace, ["snapkv:obs_window=16", "press:SnapKVPress:window_size=16"], BUDGETS, every=1)
    for budget in BUDGETS:
        ours, theirs = (_tiers(twin, p, budget) for p in twin["policy"].values)
        assert (ours == theirs).all(), budget
        assert (ours == TIER_EVICTED).any()


def test_streaming_press_is_kvscope_streaming_at_the_same_kept_tokens(trace):
    """StreamingLLMPress keeps n = ⌊B/FP⌋ − S prompt tokens; kvscope's streaming with a capacity
    of n tokens keeps the same sinks and newest positions after the prefill."""
    ds = kvscope.open_trace(trace)
    for s in range(ds.sizes["sample"]):
        p, n_steps = int(ds.kvscope.prompt_len[s]), int(ds.kvscope.n_steps[s])
        final = p + n_steps
        kept = int(np.floor(0.6 * final + 1e-9)) - n_steps
        one = ds.isel(sample=[s])
        press = kvscope.replay(one, ["press:StreamingLLMPress"], [0.6], n_boot=20)
        ours = kvscope.replay(one, ["streaming"], [kept / final], n_boot=20)
        first_press = _tiers(press, "press:StreamingLLMPress", 0.6)[0, 0]  # [layer, kv_head, pos] after prefill
        first_ours = _tiers(ours, "streaming", kept / final)[0, 0]
        assert ((first_press == TIER_FP).sum(-1) == kept).all()
        assert (first_press == first_ours).all(), s


def test_pyramid_and_adakv_move_budget_across_layers_and_heads(result):
    n_kv = result.sizes["kv_head"]
    pyramid = _tiers(result, "press:PyramidKVPress:window_size=8:beta=2", 0.3)[0, 0]  # after prefill
    per_layer = (pyramid == TIER_FP).sum((-1, -2))
    assert (np.diff(per_layer) <= 0).all() and per_layer[0] > per_layer[-1]  # shrinks with depth
    ada = _tiers(result, "press:AdaKVPress:press=ExpectedAttentionPress", 0.3)[0, 0]
    per_head = (ada == TIER_FP).sum(-1)  # [layer, kv_head]
    assert (per_head.max(-1) > per_head.min(-1)).any()  # heads of a layer keep different counts
    assert len(set(per_head.sum(-1).tolist())) == 1 and per_head.sum(-1)[0] % n_kv == 0  # same total per layer


def test_settings_state_the_compression_ratio(result):
    import json

    settings = json.loads(result.attrs["press_settings"])
    ratios = settings["press:KnormPress"]["0.3"]["compression_ratio"]
    ds_prompt = result["bytes_used"].sel(policy="press:KnormPress", budget=0.3)  # one per sample
    assert len(ratios) == ds_prompt.sizes["sample"] and all(0 < r < 1 for r in ratios)
    assert "target_size" in settings["press:DecodingPress:base_press=KnormPress:compression_interval=4"]["0.95"]


def test_press_labels_and_parsing():
    p = parse("press:DecodingPress:base=KnormPress:compression_interval=8")
    assert p.label() == "press:DecodingPress:base_press=KnormPress:compression_interval=8"
    built = p.make_press()
    assert type(built).__name__ == "DecodingPress" and type(built.base_press).__name__ == "KnormPress"
    assert built.compression_interval == 8
    nested = parse("press:AdaKVPress:press=SnapKVPress:window_size=8:alpha_safeguard=0.5").make_press()
    assert nested.press.window_size == 8 and nested.alpha_safeguard == 0.5


def test_importing_kvpress_leaves_transformers_attention_alone():
    code = textwrap.dedent(
        """
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        before = {k: ALL_ATTENTION_FUNCTIONS[k] for k in ALL_ATTENTION_FUNCTIONS}
        from kvscope.policies import kvpress_bridge
        kvpress_bridge.load()
        after = {k: ALL_ATTENTION_FUNCTIONS[k] for k in ALL_ATTENTION_FUNCTIONS}
        assert before.keys() == after.keys() and all(before[k] is after[k] for k in before), "patched"
        import kvpress  # the module is loaded: a second import changes nothing either
        assert all(ALL_ATTENTION_FUNCTIONS[k] is before[k] for k in before)
        print("unchanged")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.stdout.strip() == "unchanged", proc.stderr


def test_without_kvpress_one_line_names_the_install(tmp_path, trace):
    shadow = tmp_path / "shadow" / "kvpress"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'kvpress'\")\n")
    env = {"PYTHONPATH": f"{shadow.parent}:{ROOT}"}
    import os

    proc = subprocess.run(
        [sys.executable, "-m", "kvscope", "replay", str(trace), "--policies", "press:KnormPress", "--budgets", "0.3"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, **env},
    )  # fmt: skip
    one_line_error(proc, "press policies need kvpress")
    assert "pip install --no-deps kvpress" in proc.stderr


USER_PRESS = '''
from dataclasses import dataclass

from kvpress import ScorerPress


@dataclass
class ValueNormPress(ScorerPress):
    """Keeps the positions whose values have the largest L2 norm."""

    compression_ratio: float = 0.0

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        return values.norm(dim=-1)
'''


def test_a_users_own_press_by_dotted_path_offline_and_live(tmp_path, trace):
    """docs/replay.md, "Your own press": a ScorerPress subclass in the user's module runs by its
    dotted path in replay and live, alone and wrapped — and keeps the positions its score ranks
    highest."""
    import os

    (tmp_path / "mypress.py").write_text(USER_PRESS)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}", "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "r.zarr"
    policies = "press:mypress.ValueNormPress,press:AdaKVPress:press=mypress.ValueNormPress"
    kvscope_cmd = [sys.executable, "-m", "kvscope"]
    proc = subprocess.run(
        [*kvscope_cmd, "replay", str(trace), "--policies", policies, "--budgets", "0.3", "--out", str(out)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    from kvscope.replay import open_result

    result = open_result(out)
    assert list(result.policy.values) == policies.split(",")
    tiers = _tiers(result, "press:mypress.ValueNormPress", 0.3)[0, 0]  # [layer, kv_head, pos] after the prefill
    values = kvscope.open_trace(trace)["v"].values[0]  # [layer, kv_head, pos, D]
    p = int(kvscope.open_trace(trace).prompt_len[0])
    norms = np.linalg.norm(values[..., :p, :], axis=-1)  # [layer, kv_head, P]
    kept = tiers[..., :p] == TIER_FP
    assert 0 < kept.mean() < 0.5
    assert (np.where(kept, norms, np.inf).min(-1) >= np.where(kept, -np.inf, norms).max(-1)).all()
    proc = subprocess.run(
        [*kvscope_cmd, "run", "--prompt", "The capital of France is", "--policy", "press:mypress.ValueNormPress",
         "--budget", "0.5", "--max-new-tokens", "4", "--json"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert '"policy": "press:mypress.ValueNormPress"' in proc.stdout


@pytest.mark.parametrize(
    ("name", "needle"),
    [("nosuch.Press", "cannot be imported (ModuleNotFoundError"), ("os.path", "is not a press class")],
)
def test_a_press_path_that_is_no_press_is_one_line(name, needle):
    from kvscope.errors import KvscopeError

    with pytest.raises(KvscopeError, match=needle.replace("(", r"\(")):
        parse(f"press:{name}")


def test_a_press_state_takes_recorded_numpy_arrays_as_replay_s_tensors(trace):
    """``Press.start`` takes k/v as numpy arrays or float32 tensors alike (replay shares tensors)."""
    import torch

    from kvscope.policies import CacheSpec

    ds = kvscope.open_trace(trace)
    k, v, q = (ds[name].values[0].astype(np.float32) for name in ("k", "v", "q"))
    model, p = ds.kvscope.model, int(ds.prompt_len[0])
    spec = CacheSpec(model.n_layers, model.n_kv_heads, model.head_dim, p, p + 24, 0.3)
    press = parse("press:KnormPress")
    states = [
        press.start(spec, k, v, None, q, model),
        press.start(spec, *map(torch.from_numpy, (k, v)), None, q, model),
    ]
    for state in states:
        state.prefill(np.zeros((model.n_layers, model.n_kv_heads, p)), None)
    np.testing.assert_array_equal(states[0].tiers, states[1].tiers)
    assert 0.5 < (states[0].tiers[..., :p] == TIER_EVICTED).mean() < 1


def test_the_help_texts_name_exactly_kvpress_s_presses():
    """The press names help texts list are read from kvpress without importing it: they are the
    presses the bridge finds once it is imported."""
    from kvscope.policies.kvpress_bridge import press_classes, press_names

    assert sorted(press_names()) == sorted(press_classes())
