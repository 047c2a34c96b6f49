"""The question-agnostic protocol: the context is prefilled and compressed alone, the question
is then decoded into the compressed cache. Split prompts, the trace's forced question steps,
no decision at the context boundary that a question could change, and live = replay."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvscope
from kvscope.errors import KvscopeError
from kvscope.model.prompts import Prompt, encode, encode_split, load_prompts_file

from .conftest import run_main

CONTEXT = (
    "The lighthouse keeper wrote the code 4471 on the wall, then the code 9023 on the door. "
    "Boats came and went while the tide rose over the rocks, and gulls circled the tower. " * 3
)
# as many tokens each (the budget is a share of the final length, which counts the question)
QUESTIONS = ["\nWhich code is on the wall? Answer:", "\nWhat did the gulls circle? Answer:"]
POLICIES = ["streaming", "h2o", "snapkv", "qevict:local=8", "logquant", "press:SnapKVPress:window_size=4",
            "press:ExpectedAttentionPress", "press:TOVAPress"]  # fmt: skip


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("qa") / "split.jsonl"
    path.write_text("\n".join(json.dumps({"context": CONTEXT, "question": q}) for q in QUESTIONS) + "\n")
    return path


@pytest.fixture(scope="module")
def qa_trace(tmp_path_factory, tiny_models, prompts_file):
    out = tmp_path_factory.mktemp("qa") / "qa.zarr"
    prompts = load_prompts_file(prompts_file)
    kvscope.trace(
        prompts, out, model=str(tiny_models["llama"]), max_new_tokens=6, record_qkv=True, block_steps=8,
        question_agnostic=True, stop_at_eos=False, dtype="float32",
    )  # fmt: skip
    return out


def test_split_prompts_from_jsonl_and_workloads(prompts_file, tiny_models):
    from transformers import AutoTokenizer

    prompts = load_prompts_file(prompts_file)
    assert [p.question for p in prompts] == QUESTIONS and all(p.context == CONTEXT for p in prompts)
    assert Prompt.from_doc(prompts[0].doc()).split == len(CONTEXT)
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    (context, _question), _ = encode_split(tokenizer, prompts, chat=False)
    assert context == tokenizer(CONTEXT)["input_ids"]
    chat_context, chat_question = encode_split(tokenizer, prompts, chat=True)[0]
    assert chat_context + chat_question == encode(tokenizer, prompts, chat=True)[0]  # the template, cut
    from kvscope import workloads

    for name in ("niah", "vt"):
        p = workloads.prompts(name, tokenizer, context=512, samples=1)[0]
        assert p.split is not None and p.question.startswith(("What are all", "Question:"))
    assert workloads.prompts("prose", tokenizer, context=128, samples=1)[0].split is None
    with pytest.raises(KvscopeError, match="has no question: --question-agnostic needs"):
        encode_split(tokenizer, [Prompt("no question here")], chat=False)


def test_trace_prefills_the_context_and_forces_the_question(qa_trace, tiny_models):
    from transformers import AutoTokenizer

    ds = kvscope.open_trace(qa_trace)
    acc = ds.kvscope
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    context = tokenizer(CONTEXT)["input_ids"]
    assert acc.question_agnostic and ds.attrs["generation"]["question_agnostic"]
    for s, question in enumerate(QUESTIONS):
        ids = tokenizer(question, add_special_tokens=False)["input_ids"]
        assert int(acc.prompt_len[s]) == len(context)
        assert int(acc.question_tokens[s]) == len(ids)
        assert int(acc.n_steps[s]) == len(ids) + 6  # the question, then max_new_tokens
        assert ds["token_id"].values[s, : len(ids)].tolist() == ids  # forced, whatever the model predicted
        assert acc.generated(s).tolist() == ds["token_id"].values[s, len(ids) : len(ids) + 6].tolist()
    assert ds.sizes["step"] == max(acc.question_tokens) + 6


def test_no_question_position_changes_a_decision_at_the_context_boundary(qa_trace):
    """Same context, different questions: every policy decides identically after the prefill."""
    assert len(set(kvscope.open_trace(qa_trace).kvscope.question_tokens)) == 1
    r = kvscope.replay(qa_trace, POLICIES, [0.3, 0.5], question_agnostic=True, n_boot=20)
    assert r.attrs["protocol"] == "question-agnostic"
    C = int(kvscope.open_trace(qa_trace).kvscope.prompt_len[0])
    boundary = r["tiers"].sel(allocation="uniform").isel(event=0).values  # [policy, budget, sample, layer, kv_head, pos]
    assert (boundary[:, :, 0, ..., :C] == boundary[:, :, 1, ..., :C]).all()
    assert (boundary[..., :C] == 0).any()  # the context was compressed there
    assert (boundary[..., C:] == -1).all()  # and no question position existed yet


def test_question_agnostic_replay_needs_such_a_trace(tmp_path, tiny_models):
    plain = tmp_path / "plain.zarr"
    kvscope.trace(CONTEXT, plain, model=str(tiny_models["llama"]), max_new_tokens=4, stop_at_eos=False)
    with pytest.raises(KvscopeError, match="needs a trace recorded with kvscope trace --question-agnostic"):
        kvscope.replay(plain, ["h2o"], [0.3], question_agnostic=True)
    assert kvscope.replay(plain, ["h2o"], [0.3], n_boot=20).attrs["protocol"] == "question-aware"


def test_run_and_validate_follow_the_protocol(qa_trace, tiny_models, prompts_file):
    from kvscope.live.run import run

    results = run(load_prompts_file(prompts_file)[:1], "h2o", 0.4, model=str(tiny_models["llama"]),
                  max_new_tokens=4, question_agnostic=True)  # fmt: skip
    assert results[0].question_tokens == int(kvscope.open_trace(qa_trace).kvscope.question_tokens[0])
    ran = run_main("validate", qa_trace, "--policy", "h2o", "--budget", "0.4", "--question-agnostic", "--json")
    assert ran.returncode == 0, ran.stderr
    report = json.loads(ran.stdout)
    assert report["decisions_identical"]  # the live cache decided what replay predicted, question fed after
    assert np.isfinite(report["predicted_mean"])
