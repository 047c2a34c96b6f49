"""Given continuations (issue 48, item 4): ``trace --continuation FILE``, a ``"continuation"`` per
JSONL line, ``kvscope.trace(…, continuation=…)`` and ``--workload prose --continuation-tokens N``
teacher-force a text as the decode steps. The stored tokens are the prompt's and the text's, the
rows are the model's attention when fed that text (a plain eager forward of prompt + text), EOS
does not stop it, a question comes first, resume replays it, and bad input ends in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import kvscope
from kvscope.errors import KvscopeError
from kvscope.model.prompts import (
    Prompt,
    encode_continuations,
    load_continuation_file,
    load_prompts_file,
    with_continuations,
)

from .conftest import one_line_error, run_cli, run_main, tree_digest
from .test_inputs import Stop
from .test_inputs import _stop_at as stop_after
from .test_trace_shard import assert_same_store

PROMPTS = ["The old lighthouse stood on the cliff above the harbour, and every night", "Rain fell on the town."]
# the second holds the tokenizer's end-of-sequence token: forcing goes on through it
TEXTS = [" its lamp turned slowly over the dark water.", " The streets shone<|im_end|> and the gutters ran full."]


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["llama"])


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("cont") / "continued.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "continuation": c}) for p, c in zip(PROMPTS, TEXTS)) + "\n")
    return path


@pytest.fixture(scope="module")
def continued(tmp_path_factory, tiny_models, jsonl):
    """Both prompts in one left-padded batch, every query head's rows in float32, all of each text."""
    out = tmp_path_factory.mktemp("cont") / "continued.zarr"
    kvscope.trace(
        load_prompts_file(jsonl), out, model=str(tiny_models["llama"]), max_new_tokens=None, heads="all",
        dtype="float32", batch_size=2, block_steps=4,
    )  # fmt: skip
    return out


def test_prompts_carry_their_continuations(jsonl, tmp_path, tokenizer):
    prompts = load_prompts_file(jsonl)
    assert [p.continuation for p in prompts] == TEXTS
    assert Prompt.from_doc(prompts[1].doc()) == prompts[1] and prompts[1].doc()["continuation"] == TEXTS[1]
    assert "continuation" not in Prompt("plain").doc()
    split = tmp_path / "split.jsonl"
    split.write_text(json.dumps({"context": "A B C. ", "question": "What?", "continuation": " C."}) + "\n")
    (p,) = load_prompts_file(split)
    assert (p.context, p.question, p.continuation) == ("A B C. ", "What?", " C.")

    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"prompt": "a", "continuation": "b"}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    with pytest.raises(KvscopeError, match=r"prompt 1 \(mixed.jsonl:2\) has no continuation while others have one"):
        load_prompts_file(mixed)
    for bad in ("", 7, ["x"]):
        (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "a", "continuation": bad}) + "\n")
        with pytest.raises(KvscopeError, match=r"bad.jsonl:1: 'continuation' must be a non-empty string"):
            load_prompts_file(tmp_path / "bad.jsonl")

    assert with_continuations([Prompt("a")], "b")[0].continuation == "b"
    with pytest.raises(KvscopeError, match="one continuation goes with a single prompt"):
        with_continuations([Prompt("a"), Prompt("b")], "c")
    with pytest.raises(KvscopeError, match="1 continuations for 2 prompts"):
        with_continuations([Prompt("a"), Prompt("b")], ["c"])
    with pytest.raises(KvscopeError, match="carry continuations of their own"):
        with_continuations(prompts, TEXTS)

    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    assert tokenizer.eos_token_id in ids[1]  # the second text holds EOS, as one token
    assert encode_continuations(tokenizer, prompts, None) == ids
    assert encode_continuations(tokenizer, prompts, 3) == [i[:3] for i in ids]
    assert encode_continuations(tokenizer, [Prompt("a")], None) is None

    raw = tmp_path / "next.txt"
    raw.write_bytes(b"caf\xe9\n")
    with pytest.raises(
        KvscopeError, match=r"continuation file .*next.txt is not UTF-8 text: byte 0xe9 at byte offset 3"
    ):
        load_continuation_file(raw)
    raw.write_text("")
    with pytest.raises(KvscopeError, match="is empty"):
        load_continuation_file(raw)
    raw.write_text("as it is\n")
    assert load_continuation_file(raw) == "as it is\n"  # a final newline is part of the text


def test_the_stored_tokens_are_the_prompt_and_its_continuation(continued, tokenizer):
    ds = kvscope.open_trace(continued)
    acc = ds.kvscope
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    assert acc.continued and not acc.question_agnostic
    assert ds.attrs["continuation_tokens"] == [len(i) for i in ids] == acc.continuation_tokens.tolist()
    assert ds.attrs["generation"]["continuation"] is True
    assert tokenizer.eos_token_id in ds.attrs["generation"]["eos_token_ids"] and ds.attrs["generation"]["stop_at_eos"]
    assert ds.attrs["generation"]["max_new_tokens"] == max(map(len, ids))  # all of the longest
    assert [p["continuation"] for p in ds.attrs["prompts"]] == TEXTS
    assert ds.sizes["step"] == max(map(len, ids))
    for s, (prompt, forced) in enumerate(zip(PROMPTS, ids)):
        P = int(acc.prompt_len[s])
        prompt_ids = tokenizer(prompt)["input_ids"]
        assert P == len(prompt_ids) and int(acc.n_steps[s]) == len(forced)  # through the EOS token
        assert ds["tokens"].values[s, : P + len(forced)].tolist() == prompt_ids + forced
        assert (ds["tokens"].values[s, P + len(forced) :] == -1).all()
        assert ds["token_id"].values[s, : len(forced)].tolist() == forced == acc.generated(s).tolist()


def test_rows_are_the_models_attention_when_fed_the_continuation(continued, tiny_models, tokenizer):
    """Step t's rows equal transformers' eager ``output_attentions`` of one forward over the
    prompt and the continuation's first t tokens, at the query position P − 1 + t."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], attn_implementation="eager").eval()
    ds = kvscope.open_trace(continued)
    attn = ds["attn"].values  # [sample, step, layer, head, pos]
    for s in range(len(PROMPTS)):
        P, S = int(ds.kvscope.prompt_len[s]), int(ds.kvscope.n_steps[s])
        fed = ds["tokens"].values[s, : P + S - 1]  # the last forced token is emitted, never fed
        with torch.no_grad():
            eager = model(input_ids=torch.tensor([fed.tolist()]), output_attentions=True).attentions
        for layer, probs in enumerate(eager):
            want = probs[0, :, P - 1 : P - 1 + S].permute(1, 0, 2).numpy()  # [step, head, pos]
            for t in range(S):
                np.testing.assert_allclose(attn[s, t, layer, :, : P + t], want[t, :, : P + t], rtol=0, atol=1e-5)
                assert np.isnan(attn[s, t, layer, :, P + t :]).all()


def test_a_question_comes_first_and_max_new_tokens_caps_the_continuation(tmp_path, tiny_models, tokenizer):
    path = tmp_path / "qa.jsonl"
    context, question, text = "The code on the wall is 4471. " * 4, "\nWhat is the code?", " The code is 4471."
    path.write_text(json.dumps({"context": context, "question": question, "continuation": text}) + "\n")
    out = tmp_path / "qa.zarr"
    kvscope.trace(
        load_prompts_file(path), out, model=str(tiny_models["llama"]), max_new_tokens=3, question_agnostic=True
    )
    ds = kvscope.open_trace(out)
    q = tokenizer(question, add_special_tokens=False)["input_ids"]
    c = tokenizer(text, add_special_tokens=False)["input_ids"][:3]
    assert ds.attrs["question_tokens"] == [len(q)] and ds.attrs["continuation_tokens"] == [3]
    assert int(ds.kvscope.n_steps[0]) == ds.sizes["step"] == len(q) + 3
    assert ds["token_id"].values[0].tolist() == q + c
    assert ds.kvscope.generated(0).tolist() == c


def test_resume_replays_the_forced_steps_and_refuses_another_continuation(tmp_path, tiny_models):
    settings = {"model": str(tiny_models["qwen2"]), "max_new_tokens": None, "block_steps": 4}
    text = " and the ships came home one by one, their lanterns swinging in the wind."
    whole, resumed = tmp_path / "whole.zarr", tmp_path / "resumed.zarr"
    kvscope.trace(PROMPTS[0], whole, continuation=text, **settings)
    with pytest.raises(Stop):
        kvscope.trace(PROMPTS[0], resumed, continuation=text, progress=stop_after(6), **settings)
    assert kvscope.open_trace(resumed).attrs["steps_committed"] == [4]
    before = tree_digest(resumed)
    steps = {**settings, "max_new_tokens": kvscope.open_trace(whole).attrs["generation"]["max_new_tokens"]}
    with pytest.raises(KvscopeError, match="traced with different continuations$"):  # as many steps of another
        kvscope.trace(PROMPTS[0], resumed, continuation=text + " More.", resume=True, **steps)
    with pytest.raises(KvscopeError, match="traced with different continuations$"):  # of the model's own
        kvscope.trace(PROMPTS[0], resumed, resume=True, **steps)
    assert tree_digest(resumed) == before
    kvscope.trace(PROMPTS[0], resumed, continuation=text, resume=True, **settings)
    assert_same_store(whole, resumed)


def test_sampling_and_steps_without_continuation_are_refused(tmp_path, tiny_models):
    model = str(tiny_models["llama"])
    with pytest.raises(KvscopeError, match="nothing is sampled: --temperature must be 0"):
        kvscope.trace("a", tmp_path / "t.zarr", model=model, continuation="b", temperature=0.7)
    with pytest.raises(KvscopeError, match="--max-new-tokens is required"):
        kvscope.trace("a", tmp_path / "t.zarr", model=model, max_new_tokens=None)
    assert not (tmp_path / "t.zarr").exists()


def test_the_prose_workload_continues_with_the_text_that_follows(tokenizer):
    from kvscope import workloads
    from kvscope.workloads.builtin import _token_ids, prose_text

    plain = workloads.prompts("prose", tokenizer, context=128, samples=2)
    cont = workloads.prompts("prose", tokenizer, context=128, samples=2, continuation_tokens=40)
    ids = _token_ids(tokenizer, prose_text())
    for p, c in zip(plain, cont):
        assert p.continuation is None and c.text == p.text  # the same prompt, now continued
        start, n = c.meta["start_token"], c.meta["tokens"]
        assert c.text == tokenizer.decode(ids[start : start + n])
        assert c.continuation == tokenizer.decode(ids[start + n : start + n + 40])  # the text right after it
    with pytest.raises(KvscopeError, match="workload niah does not continue a text"):
        workloads.prompts("niah", tokenizer, context=256, samples=1, continuation_tokens=8)
    with pytest.raises(KvscopeError, match="before the 120000 that continue it"):
        workloads.prompts("prose", tokenizer, context=128, samples=1, continuation_tokens=120_000)


def test_the_command_line(tmp_path, tiny_models, tokenizer):
    model = str(tiny_models["llama"])
    text = tmp_path / "next.txt"
    text.write_text(TEXTS[0])
    out = tmp_path / "cli.zarr"
    base = ["trace", "--model", model, "--quiet"]
    ran = run_main(*base, "--prompt", PROMPTS[0], "--continuation", text, "--out", out)  # all of it
    assert ran.returncode == 0, ran.stderr
    ds = kvscope.open_trace(out)
    assert ds.attrs["continuation_tokens"] == [len(tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"])]
    info = run_main("info", out)
    assert f"forced steps per sample: given continuation {ds.attrs['continuation_tokens']}" in info.stdout
    doc = json.loads(run_main("info", out, "--json").stdout)
    assert doc["continuation_tokens"] == ds.attrs["continuation_tokens"]
    assert doc["continuation_kind"] == "given continuation"

    prose = tmp_path / "prose.zarr"
    ran = run_main(*base, "--workload", "prose", "--context", "96", "--samples", "1", "--continuation-tokens", "12",
                   "--out", prose)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    ds = kvscope.open_trace(prose)
    forced = tokenizer(ds.attrs["prompts"][0]["continuation"], add_special_tokens=False)["input_ids"]
    assert ds.kvscope.generated(0).tolist() == forced and abs(len(forced) - 12) <= 1  # ≈ N: retokenized

    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes(b"\xff")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a"}) + "\n")
    bad = tmp_path / "bad.zarr"
    refused = {
        ("--prompt", "a", "--continuation", tmp_path / "gone.txt"): "continuation file not found",
        ("--prompt", "a", "--continuation", tmp_path / "empty.txt"): "empty.txt is empty",
        ("--prompt", "a", "--continuation", tmp_path / "latin1.txt"): "is not UTF-8 text: byte 0xff at byte offset 0",
        ("--prompts", tmp_path / "p.jsonl", "--continuation", text): "--continuation FILE goes with a single --prompt",
        ("--workload", "prose", "--continuation", text): "--continuation FILE goes with a single --prompt",
        ("--prompt", "a", "--continuation-tokens", "8"): "--continuation-tokens goes with --workload prose or code",
        ("--workload", "niah", "--continuation-tokens", "8"): "workload niah does not continue a text",
        ("--prompt", "a", "--continuation", text, "--temperature", "0.5"): "--temperature must be 0",
        ("--prompts", tmp_path / "p.jsonl"): "--max-new-tokens is required",
    }
    for args, needle in refused.items():
        one_line_error(run_main(*base, *args, "--out", bad), needle)
    one_line_error(run_cli(*base, "--prompt", "a", "--continuation", tmp_path / "gone.txt", "--out", bad), "not found")
    assert not bad.exists()
