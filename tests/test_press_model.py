"""kvpress's presses on the model itself (see Concepts → kvpress presses), against kvpress's own run of the press.

The reference is kvpress as its users run it: ``with press(model): model.model(prompt)`` —
kvpress's own context manager registers the press's own hook on the model's attention modules —
adapted to transformers 5.25 in the one place that cannot be avoided (the hook reads
``past_key_values`` and ``cache_position``, which 5.25 no longer hands it: an adapter on the
press object gives them), then a teacher-forced decode over the cache it left, masked keys
served by kvpress's own ``attention_patch`` (registered as an attention function), positions as
kvpress's pipeline numbers them. Against it: the positions kvscope keeps live (``PolicyCache``)
and offline (``kvscope.replay`` on a trace, the presses that need the model re-running the
prefill), every layer and KV head, and the forced decode of ``kvscope run`` (per-step KL to full
KV equal within 1e-5 nats + 1e-5 of the KL, fp32: tests/tolerance.py) — on SmolLM2 and a tiny GQA model."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import kvscope
from kvscope.errors import KvscopeError
from kvscope.policies import parse

from .conftest import TINY_GQA_STEPS, one_line_error, run_main, tree_digest
from .tolerance import KL_FLOOR, assert_kl_close

PRESSES = [
    "press:LeverageScorePress",
    "press:CompactorPress",
    "press:KeyRerotationPress:press=KnormPress",
    "press:ThinKPress",
    "press:CriticalKVPress:press=SnapKVPress",
    "press:KVzipPress",
]
BUDGETS = [0.3, 0.6]
STEPS = 4


@pytest.fixture(scope="module", params=["smollm2", "tiny-llama"])
def setting(request, smollm2_dir, tiny_models, tmp_path_factory):
    """A model (fp32, kvscope's attention), a prompt of ~100 tokens, its full-KV decode, and a
    trace of the same prompt with q/k/v (fp32) replayed under every press at both budgets."""
    from pydoc_data import topics

    from transformers import DynamicCache

    from kvscope.live import prepare
    from kvscope.live.run import decode
    from kvscope.model.loading import load, resolve

    name = "smollm2-135m" if request.param == "smollm2" else str(tiny_models["llama"])
    model, tokenizer = load(resolve(name))
    prepare(model)
    out = tmp_path_factory.mktemp("press-model") / f"{request.param}.zarr"
    text = topics.topics["assignment"][:420]
    kvscope.trace(
        text, out, model=name, max_new_tokens=STEPS, stop_at_eos=False, block_steps=4, record_qkv=True,
        dtype="float32",
    )  # fmt: skip
    ds = kvscope.open_trace(out)
    p = int(ds.kvscope.prompt_len[0])
    ids = [int(t) for t in ds["tokens"].values[0, :p]]
    assert 80 <= p <= 140
    full = decode(model, ids, DynamicCache(config=model.config), STEPS)
    replayed = kvscope.replay(out, PRESSES, BUDGETS, n_boot=10).load()
    return {"model": model, "tokenizer": tokenizer, "ids": ids, "full": full, "trace": out, "replayed": replayed}


# -- kvpress's own run, adapted to transformers 5.25 where it must be -------------------------------
def _adapted(press):
    """The press's hook, handed what transformers 5.25 no longer passes (an attribute of this
    press object: ``BasePress.__call__`` and KVzip register ``self.forward_hook``)."""
    hook = press.forward_hook

    def forward_hook(module, args, kwargs, output):
        cache = kwargs["cache"]
        n, q = cache.layers[module.layer_idx].keys.shape[2], kwargs["hidden_states"].shape[1]
        return hook(
            module, args, {**kwargs, "past_key_values": cache, "cache_position": torch.arange(n - q, n)}, output
        )

    press.forward_hook = forward_hook
    return press


@contextlib.contextmanager
def _kvpress_attention(model):
    """kvpress's ``attention_patch`` (masked keys replaced by keys no query attends to) as the
    model's attention function, registered through transformers' AttentionInterface."""
    from kvpress.attention_patch import attention_patch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register("kvpress_patched", attention_patch(sdpa_attention_forward))
    AttentionMaskInterface.register("kvpress_patched", sdpa_mask)
    before = model.config._attn_implementation
    model.set_attn_implementation("kvpress_patched")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def _reference(model, ids, label: str, budget: float, forced: list[int]):
    """kvpress's run of the press at ``budget`` (its ratio as kvscope sets it): the positions it
    holds (:func:`_held`, per layer) and the teacher-forced logits ``[S − 1, vocab]`` over its cache."""
    from transformers import DynamicCache

    from kvscope.model.spec import ModelSpec
    from kvscope.policies import CacheSpec
    from kvscope.policies.kvpress_bridge import fit_budget, load

    kvpress = load()
    spec = ModelSpec.from_model(model)
    p = len(ids)
    press = _adapted(parse(label).make_press())
    fit_budget(press, CacheSpec(spec.n_layers, spec.n_kv_heads, spec.head_dim, p, p + STEPS, budget), spec)
    plain = DynamicCache(config=model.config)
    with torch.no_grad():
        model.model(input_ids=torch.tensor([ids]), cache=plain)
    cache = DynamicCache(config=model.config)
    attention = _kvpress_attention(model) if isinstance(press, kvpress.KVzipPress) else contextlib.nullcontext()
    logits = []
    with torch.no_grad(), attention:
        torch.manual_seed(0)
        with press(model):
            model.model(input_ids=torch.tensor([ids]), past_key_values=cache)
        modules = [layer.self_attn for layer in model.model.layers]
        masks = [module.__dict__.pop("masked_key_indices", None) for module in modules]
        found = [_held(plain.layers[i], cache.layers[i], masks[i], p) for i in range(len(modules))]
        held = (np.stack([f[0] for f in found]), [f[1] for f in found])
        start = cache.get_seq_length() if isinstance(press, kvpress.KeyRerotationPress) else p
        for module, mask in zip(modules, masks):
            module.masked_key_indices = mask
            module._modules.pop("rotary_emb", None)
        for t in range(1, STEPS):  # step 0's logits are the prefill's, uncompressed: full KV's
            out = model(
                input_ids=torch.tensor([[forced[t - 1]]]), cache=cache, position_ids=torch.tensor([[start + t - 1]])
            )
            logits.append(out.logits[0, -1].float())
        for module in modules:
            module.__dict__.pop("masked_key_indices", None)
    return held, torch.stack(logits)


def _held(plain, pressed, mask, p: int) -> tuple[np.ndarray, list]:
    """``[kv_head, P]`` the positions a press's cache holds: each row it left matched to the
    prefill's row with the same value (the same key where it merged values), less the masked
    ones. Where a value is several positions' (a token repeated, in the first layer) the rows
    say only how many of them are held: ``ties`` lists those ``(head, positions, how many held)``."""
    out = np.zeros((pressed.keys.shape[1], p), dtype=bool)
    ties: dict = {}
    unchanged = pressed.keys.shape == plain.keys.shape and torch.equal(pressed.keys, plain.keys)
    for h in range(out.shape[0] * (not unchanged)):
        keys, values = pressed.keys[0, h], pressed.values[0, h]
        by_key = (keys[:, None] == plain.keys[0, h][None]).all(-1)  # [kept, P]
        by_value = (values[:, None] == plain.values[0, h][None]).all(-1)
        same = by_value if bool(by_value.any(1).all()) else by_key  # values kept as they were, or keys (merged values)
        for i in range(keys.shape[0]):
            candidates = torch.nonzero(same[i]).flatten().tolist()
            if not candidates:
                raise AssertionError(f"row {i} of KV head {h} matches no prefill row")
            if len(candidates) == 1:
                out[h, candidates[0]] = True
            else:
                ties[h, tuple(candidates)] = ties.get((h, tuple(candidates)), 0) + 1
    out |= unchanged  # a press that only masks: every row is its position
    if mask is not None:
        _, heads, rows = (torch.as_tensor(t) for t in mask)
        out[heads.numpy(), rows.numpy()] = False
    return out, [(h, list(group), n) for (h, group), n in ties.items()]


def _assert_held(ours: np.ndarray, theirs: tuple[np.ndarray, list]) -> None:
    """``ours [layer, kv_head, P]`` equals the reference's positions, tied groups by their count."""
    held, ties = theirs
    free = np.ones_like(held)
    for layer, layer_ties in enumerate(ties):
        for h, group, n in layer_ties:
            assert ours[layer, h, group].sum() == n, (layer, h, group)
            free[layer, h, group] = False
    np.testing.assert_array_equal(ours[free], held[free])


def _kl(ref, logits):
    """``[S]`` KL(softmax ref ‖ softmax logits) in float64 of float32 logits."""
    a, b = torch.log_softmax(ref.double(), -1), torch.log_softmax(logits.double(), -1)
    return (a.exp() * (a - b)).sum(-1)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("label", PRESSES)
def test_kept_positions_and_forced_kl_are_kvpress_own(setting, label, budget):
    from kvscope.live import PolicyCache
    from kvscope.live.run import decode

    model, ids, full = setting["model"], setting["ids"], setting["full"]
    p = len(ids)
    held, ref_logits = _reference(model, ids, label, budget, full.tokens)
    assert 0 < held[0].mean() < 1 or label == "press:ThinKPress"
    cache = PolicyCache(model, label, budget, STEPS, kv_dtype=torch.float32, check=True)
    forced = decode(model, ids, cache, STEPS, forced=full.tokens)
    _assert_held(cache.state.tiers[..., :p] == 2, held)  # [layer, kv_head, P]
    _assert_held(setting["replayed"]["tiers"].sel(policy=label, budget=budget).values[0, 0, 0][..., :p] == 2, held)
    kl_live, kl_ref = _kl(full.logits, forced.logits), _kl(full.logits[1:], ref_logits)
    assert float(kl_live[0]) < KL_FLOOR  # the prefill attends to the whole prompt
    assert_kl_close(kl_live[1:].numpy(), kl_ref.numpy())
    assert float(kl_ref.mean()) > 1e-4  # the press changed something the test can see
    if label == "press:ThinKPress":  # pruned channels freed: bytes below a full cache's, as counted
        assert cache.bytes_actual[-1] == cache.bytes_model[-1] < cache.full_bytes


def test_the_post_press_cache_is_what_live_decoding_serves(setting):
    """``pressed_prefill`` (what forced replay serves as the continuation's past): per layer the
    rows the press left, re-rotated keys included, equal to the live cache's rows after the prefill."""
    from kvscope.live import PolicyCache
    from kvscope.model.spec import ModelSpec
    from kvscope.policies import CacheSpec
    from kvscope.policies.kvpress_bridge import fit_budget
    from kvscope.policies.press_hooks import pressed_prefill

    model, ids = setting["model"], setting["ids"]
    label, p = "press:KeyRerotationPress:press=KnormPress", len(ids)
    spec = ModelSpec.from_model(model)
    press = parse(label).make_press()
    fit_budget(press, CacheSpec(spec.n_layers, spec.n_kv_heads, spec.head_dim, p, p + STEPS, 0.3), spec)
    pressed = pressed_prefill(model, ids, press)
    n = int(pressed.layers[0].positions.shape[1])
    assert pressed.first_position == n < p and pressed.layers[0].rewrote_keys and not pressed.layers[0].rewrote_values
    cache = PolicyCache(model, label, 0.3, STEPS, kv_dtype=torch.float32)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), cache=cache)
    cache.end_step()
    assert cache.position_shift == p - n  # the next token is numbered n, as kvpress's pipeline numbers it
    for layer, result in enumerate(pressed.layers):
        pool = cache.pools[layer]
        order = np.lexsort((pool.fp_pos.numpy(), pool.fp_head.numpy()))
        positions, rows = torch.sort(result.positions, dim=1)
        keys = result.keys.gather(1, rows[..., None].expand(-1, -1, result.keys.shape[-1]))
        assert torch.equal(pool.fp_pos[order].long(), positions.reshape(-1))
        assert torch.equal(pool.fp_k[order], keys.reshape(-1, keys.shape[-1]))


def test_one_prefill_per_sample_serves_every_budget(setting):
    """A press that needs the model decides at every budget from one prefill of the prompt: KVzip's
    reconstruction runs once per configuration, its ratio only picks how many to mask. A fresh press
    configured as one before (another question of the context) is handed that decision."""
    from kvscope.policies.press_hooks import PrefillCapture

    model, ids = setting["model"], setting["ids"]
    calls = []
    handle = model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        capture = PrefillCapture(model, ids)
        decided = {}
        for ratio in (0.2, 0.5, 0.7, 0.5):
            press = parse("press:KVzipPress").make_press()
            press.compression_ratio = ratio
            decided.setdefault(ratio, []).append(capture.decide(press))
    finally:
        handle.remove()
    kept = [int(decided[ratio][0].held().sum()) for ratio in (0.2, 0.5, 0.7)]
    assert kept[0] > kept[1] > kept[2]
    assert decided[0.5][1] is decided[0.5][0]
    chunks = 1  # the prompt is shorter than KVzip's chunk: one reconstruction forward
    assert len(calls) == 1 + chunks


def test_a_press_configuration_counts_the_fields_kvscope_sets_late():
    """Two presses share a capture's decision only when every field agrees — those kvscope sets after
    construction too (FinchPress's ``window_size``, outside its constructor)."""
    from kvscope.policies.press_hooks import configuration

    presses = [parse(f"press:FinchPress:window_size={n}").make_press() for n in (8, 8, 16)]
    assert [p.window_size for p in presses] == [8, 8, 16]
    assert configuration(presses[0]) == configuration(presses[1]) != configuration(presses[2])
    assert configuration(presses[0], ignoring=("window_size",)) == configuration(presses[2], ignoring=("window_size",))


def test_replay_names_the_presses_that_rewrite_what_they_keep(setting):
    """ThinK, KeyRerotation: the result says what FMM and churn mean for them; their attention
    errors are left out offline (the recording holds no rewritten cache)."""
    from kvscope.report import press_settings

    result = setting["replayed"]
    notes = __import__("json").loads(result.attrs["press_notes"])
    assert set(notes) == {"press:ThinKPress", "press:KeyRerotationPress:press=KnormPress"}
    assert "prunes key channels" in notes["press:ThinKPress"]
    assert np.isnan(result["output_rel_l2"].sel(policy="press:ThinKPress").values).all()
    assert np.isfinite(result["output_rel_l2"].sel(policy="press:LeverageScorePress").values).any()
    lines = press_settings(result)
    assert any(line.startswith("press:ThinKPress prunes key channels") for line in lines)


# -- refusals ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory, tiny_models):
    """A tiny GQA model copied to its own folder, and a fp32 q/k/v trace made with it."""
    import shutil

    folder = tmp_path_factory.mktemp("tiny-own") / "llama"
    shutil.copytree(tiny_models["llama"], folder)
    out = folder.parent / "tiny.zarr"
    kvscope.trace("The quick brown fox jumps over the lazy dog. " * 8, out, model=str(folder), max_new_tokens=3,
                  stop_at_eos=False, record_qkv=True, dtype="float32")  # fmt: skip
    return folder, out


def test_a_press_that_needs_the_model_refuses_a_trace_whose_keys_differ(tiny_trace, tmp_path):
    import shutil

    import zarr

    _, trace = tiny_trace
    ok = run_main("replay", trace, "--policies", "press:LeverageScorePress,press:KnormPress", "--budgets", "0.5")
    assert ok.returncode == 0, ok.stderr
    changed = tmp_path / "changed.zarr"
    shutil.copytree(trace, changed)
    k = zarr.open_group(str(changed), mode="r+")["k"]
    k[0, 1] = k[0, 1] * 1.01  # layer 1's keys as another model (or dtype) would give them
    before = tree_digest(changed)
    out = tmp_path / "r.zarr"
    proc = run_main("replay", changed, "--policies", "press:LeverageScorePress", "--budgets", "0.5", "--out", out)
    one_line_error(proc, "gives other keys than the trace recorded: layer 1")
    assert not out.exists() and tree_digest(changed) == before
    from kvscope.replay.presses import _loaded

    _loaded.cache_clear()
    proc = run_main("replay", changed, "--policies", "press:KnormPress", "--budgets", "0.5")
    assert proc.returncode == 0 and _loaded.cache_info().currsize == 0  # q, k, v alone: the model is not loaded


def test_the_cli_runs_the_presses_that_need_the_model(tiny_trace):
    """``kvscope run`` (its three decodes) and ``kvscope replay`` of the presses that read more
    than q, k, v, as a user types them."""
    import json

    folder, trace = tiny_trace
    for label in ["press:KVzipPress", "press:CriticalKVPress:press=SnapKVPress:window_size=8"]:
        ran = run_main("run", "--model", folder, "--prompt", "The quick brown fox jumps over the lazy dog. " * 6,
                       "--policy", label, "--budget", "0.5", "--max-new-tokens", "3", "--json")  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        doc = json.loads(ran.stdout)["samples"][0]
        assert doc["policy"] == label and doc["budget_reached"] and doc["kl"] >= 0
    ran = run_main("replay", trace, "--policies", "press:KVzipPress,press:CompactorPress", "--budgets", "0.3,0.6")
    assert ran.returncode == 0, ran.stderr


def test_a_press_whose_model_is_gone_is_refused_in_one_line(tiny_trace, tmp_path):
    import shutil

    folder, trace = tiny_trace
    moved = folder.parent / "moved"
    shutil.move(folder, moved)
    try:
        out = tmp_path / "r.zarr"
        proc = run_main("replay", trace, "--policies", "press:KVzipPress", "--budgets", "0.5", "--out", out)
        one_line_error(proc, "press:KVzipPress runs on the trace's own model, which is not here")
        assert not out.exists()
    finally:
        shutil.move(moved, folder)


def test_errors_name_what_a_press_needs():
    for text, needle in [
        ("press:FinchPress", "needs window_size=N"),
        ("press:CriticalKVPress", "needs press=<press>"),
        ("press:ComposedPress", "needs presses=<press>"),
        ("press:KnormPress:key_channel_compression_ratio=0.5", "has no parameter"),
        ("press:ThinKPress:key_channel_compression_ratio=0.5", "set from the budget"),
        ("press:CURPress:leverage_type=both", "must be one of key, value, kv_avg, kv_product"),
        ("press:ComposedPress:presses=[KnormPress", "unbalanced brackets"),
    ]:
        with pytest.raises(KvscopeError, match=needle.replace("[", r"\[").replace("(", r"\(")):
            parse(text).make_press()


# -- learned assets made locally ------------------------------------------------------------------------
def _both(model, ids, trace, label: str, budget: float) -> tuple[np.ndarray, np.ndarray]:
    """``[layer, kv_head, P]`` what the press holds after the prefill, live and offline (the
    trace's ``TINY_GQA_STEPS`` steps decoded live)."""
    from kvscope.live import PolicyCache
    from kvscope.live.run import decode

    p = len(ids)
    cache = PolicyCache(model, label, budget, TINY_GQA_STEPS, check=True)
    decode(model, ids, cache, TINY_GQA_STEPS)
    replayed = kvscope.replay(trace, [label], [budget], n_boot=10)
    return cache.state.tiers[..., :p] == 2, replayed["tiers"].values[0, 0, 0, 0, 0][..., :p] == 2


def test_q_filters_made_locally(tiny_gqa_trace, tmp_path):
    """QFilterPress with Q-filters saved as kvpress saves them (``QFilters.save_pretrained``):
    each head keeps the prompt keys with the least response to its filter, live and offline."""
    from kvscope.policies.kvpress_bridge import load

    load()  # kvpress imported through kvscope: transformers' attention functions stay as they are
    from kvpress.presses.qfilter_press import QFilters

    model, ids, trace = tiny_gqa_trace
    ds = kvscope.open_trace(trace)
    torch.manual_seed(1)
    filters = QFilters(num_layers=2, num_kv_heads=2, kv_head_dim=16)
    filters.save_pretrained(tmp_path / "qfilt")
    label = f"press:QFilterPress:asset={tmp_path / 'qfilt'}"
    live, offline = _both(model, ids, trace, label, 0.5)
    np.testing.assert_array_equal(live, offline)
    p = len(ids)
    keys = ds["k"].values[0, :, :, :p]  # [layer, kv_head, P, D]
    scores = -(filters.q_filters.detach().numpy()[:, :, None] * keys).sum(-1)  # kvpress's score
    n = int(live[0, 0].sum())
    expected = np.zeros_like(live)
    np.put_along_axis(expected, np.argsort(-scores, -1)[..., :n], True, -1)
    np.testing.assert_array_equal(live, expected)
    proc = run_main("run", "--model", ds.attrs["model"]["name"], "--prompt", "hi there", "--policy",
                    f"press:QFilterPress:asset={tmp_path}", "--budget", "0.5", "--max-new-tokens", "2")  # fmt: skip
    one_line_error(proc, "cannot be read")  # a folder that holds no Q-filters


def test_duo_attention_head_patterns_made_locally(tiny_gqa_trace, tmp_path):
    """DuoAttentionPress with head patterns in DuoAttention's own format (config.json with the sink
    and recent sizes, full_attention_heads.tsv [layer, kv_head]): the half of the heads with the
    lowest scores hold the sinks and the recent tokens only, the others everything."""
    import json

    model, ids, trace = tiny_gqa_trace
    scores = np.array([[0.9, 0.1], [0.2, 0.8]])
    folder = tmp_path / "duo"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"sink_size": 4, "recent_size": 8}))
    np.savetxt(folder / "full_attention_heads.tsv", scores, delimiter="\t")
    live, offline = _both(model, ids, trace, f"press:DuoAttentionPress:head_compression_ratio=0.5:asset={folder}", 0.5)
    np.testing.assert_array_equal(live, offline)
    p = len(ids)
    streaming = np.zeros((p,), dtype=bool)
    streaming[:4] = streaming[p - 8 :] = True
    for layer, head in [(0, 1), (1, 0)]:  # the lowest scores: streaming heads
        np.testing.assert_array_equal(live[layer, head], streaming)
    assert live[0, 0].all() and live[1, 1].all()


def test_policies_lists_every_press_with_its_parameters():
    proc = run_main("policies", "--json")
    assert proc.returncode == 0
    presses = __import__("json").loads(proc.stdout)["presses"]
    assert len(presses) == 46
    assert [r["name"] for r in presses["CriticalKVPress"]["parameters"]] == ["press", "epsilon", "first_stage_ratio"]
    assert presses["CriticalKVPress"]["parameters"][0]["required"]
    assert presses["ThinKPress"]["budget sets"] == "key_channel_compression_ratio"
    finch = {r["name"]: r for r in presses["FinchPress"]["parameters"]}
    assert finch["window_size"]["required"] and finch["window_size"]["after"]
    assert presses["ComposedPress"]["budget sets"].startswith("nothing")
    text = run_main("policies")
    assert "kvpress presses" in text.stdout and "LeverageScorePress" in text.stdout
