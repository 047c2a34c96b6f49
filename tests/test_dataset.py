"""Task accuracy offline, items 1, 2 and 9: the user's own datasets (``trace --dataset``, ``run
--dataset``: kvpress's evaluation columns in JSONL or Parquet), the answer prefix placed as
kvpress places it, the gold answer tokenized as the model continues that prefix and forced as a
trace's decode steps, ``answer_exact`` and the task's score in ``run``, and every refusal of bad
input in one line that names the file and the row."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

import kvscope
from kvscope.errors import KvscopeError
from kvscope.model.dataset import load_dataset
from kvscope.model.prompts import (
    Prompt,
    answer_ids,
    continuations,
    encode,
    encode_answers,
    encode_continuations,
    encode_split,
)

from .conftest import one_line_error, run_cli, run_main

CONTEXTS = [
    "The special magic number for lighthouse is 4471. The harbour was quiet all week. ",
    "Anna keeps a blue whale poster above her desk. Her brother prefers trains. ",
]
ROWS = [  # two contexts × two questions, as kvpress's RULER and LongBench data hold them
    {"context": CONTEXTS[0], "question": "What is the special magic number for lighthouse?",
     "answer_prefix": "The special magic number for lighthouse is", "answer": ["4471"], "task": "niah_single_1",
     "max_new_tokens": 8},
    {"context": CONTEXTS[0], "question": "How was the harbour?", "answer_prefix": "Answer:",
     "answer": ["quiet", "calm"], "task": "qa_1"},
    {"context": CONTEXTS[1], "question": "Which animal is on the poster?", "answer_prefix": "The animal is",
     "answer": ["blue whale"], "task": "qa_2", "max_new_tokens": 6},
    {"context": CONTEXTS[1], "question": "What does her brother prefer?", "answer_prefix": "Answer:",
     "answer": "trains"},
]  # fmt: skip
# SmolLM2's ids of each gold answer after its prefix, read off its vocabulary by hand:
# " " 216, "4" 36, "7" 39, "1" 33 (digits one by one); " quiet" 8354; " blue" 4461, " whale" 15682; " trains" 13420
ANSWER_IDS = [[216, 36, 36, 39, 33], [8354], [4461, 15682], [13420]]


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from kvscope.model.loading import load_tokenizer, resolve

    return load_tokenizer(resolve("smollm2-135m"))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("dataset") / "qa.jsonl", ROWS)


def test_jsonl_and_parquet_give_the_same_prompts(dataset, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = load_dataset(dataset)
    assert [p.source for p in prompts] == ["qa.jsonl:0", "qa.jsonl:1", "qa.jsonl:2", "qa.jsonl:3"]
    assert [(p.context, p.question) for p in prompts] == [(r["context"], r["question"]) for r in ROWS]
    assert [p.text for p in prompts] == [r["context"] + r["question"] for r in ROWS]
    assert [p.answers for p in prompts] == [["4471"], ["quiet", "calm"], ["blue whale"], ["trains"]]
    assert [p.answer_prefix for p in prompts] == [r["answer_prefix"] for r in ROWS]
    assert [p.meta for p in prompts] == [
        {"row": 0, "context_id": 0, "task": "niah_single_1", "max_new_tokens": 8, "question": 0},
        {"row": 1, "context_id": 0, "task": "qa_1", "max_new_tokens": None, "question": 1},
        {"row": 2, "context_id": 1, "task": "qa_2", "max_new_tokens": 6, "question": 0},
        {"row": 3, "context_id": 1, "task": None, "max_new_tokens": None, "question": 1},
    ]
    assert all(p.continuation is None and p.expected is None for p in prompts)
    assert [Prompt.from_doc(p.doc()) for p in prompts] == prompts  # what a store's attribute gives back

    columns = {key: [r.get(key) for r in ROWS] for key in ("context", "question", "answer_prefix", "task")}
    columns["answer"] = [r["answer"] if isinstance(r["answer"], list) else [r["answer"]] for r in ROWS]
    columns["max_new_tokens"] = pa.array([r.get("max_new_tokens") for r in ROWS], pa.int64())
    columns["length"] = [100, 100, 90, 90]  # a column kvscope does not read
    pq.write_table(pa.table(columns), tmp_path / "qa.parquet")
    from_parquet = load_dataset(tmp_path / "qa.parquet")  # a list<string> answer column
    assert [p.source for p in from_parquet] == [f"qa.parquet:{n}" for n in range(4)]
    assert [Prompt(**{**vars(p), "source": "x"}) for p in from_parquet] == [
        Prompt(**{**vars(p), "source": "x"}) for p in prompts
    ]
    columns["answer"] = ["4471", "quiet", "blue whale", "trains"]  # a string column: one answer each
    pq.write_table(pa.table(columns), tmp_path / "strings.parquet")
    assert [p.answers for p in load_dataset(tmp_path / "strings.parquet")] == [["4471"], ["quiet"], ["blue whale"],
                                                                               ["trains"]]  # fmt: skip


def test_the_gold_answer_is_tokenized_as_the_model_continues_its_prefix(dataset, tokenizer):
    prompts = load_dataset(dataset)
    assert encode_answers(tokenizer, prompts) == ANSWER_IDS
    assert encode_continuations(tokenizer, prompts, None) == ANSWER_IDS  # what a trace forces
    assert continuations(prompts) == ["4471", "quiet", "blue whale", "trains"]

    def ids(prefix, answer):
        return answer_ids(tokenizer, Prompt("Q?", answer_prefix=prefix, answers=[answer]))

    assert ids("The capital is", "Paris") == [7042]  # one space between them: " Paris"
    assert ids("The capital is", " Paris") == [7042]  # the answer brings its own
    assert ids("Answer:\n", "Paris") == [38634]  # the prefix ends with whitespace: "Paris" as it is
    assert ids(None, "Paris") == ids("", "Paris") == [38634]  # no prefix: the answer's own ids
    assert answer_ids(tokenizer, Prompt("Q?")) is None
    with pytest.raises(KvscopeError) as refused:  # "Answer: " + "Paris": the space and "Paris" are one token
        ids("Answer: ", "Paris")
    assert str(refused.value) == (
        "the answer of the prompt from cli cannot be split from its answer prefix: kvscope forces the ids of "
        "(prefix + separator + answer) that follow the prefix's own ids, and the tokenizer merges the prefix's end "
        "' ' with the answer's start into ' Paris'; end the answer prefix without whitespace (kvscope then puts one "
        "space before the answer)"
    )
    with pytest.raises(KvscopeError, match=r"has 5 tokens, more than --max-new-tokens 4: raise it"):
        encode_continuations(tokenizer, prompts, 4)


def test_the_answer_prefix_follows_the_generation_prompt_as_in_kvpress(dataset, tokenizer):
    from kvpress.pipeline import KVPressTextGenerationPipeline

    prompts = load_dataset(dataset)
    plain = [Prompt.split_at(p.context, p.question, p.source) for p in prompts]  # the same rows, no prefix
    for p, bare in zip(prompts, plain):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": p.text}], add_generation_prompt=True, tokenize=False
        )
        (chat,) = encode(tokenizer, [p], chat=True)
        assert chat == tokenizer(rendered + p.answer_prefix, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(chat).endswith("<|im_start|>assistant\n" + p.answer_prefix)
        (text,) = encode(tokenizer, [p], chat=False)
        assert text == tokenizer(p.text + "\n" + p.answer_prefix)["input_ids"]
        # kvpress's own preprocess: the context alone, then question + the template's closing + prefix
        kv = KVPressTextGenerationPipeline.preprocess(
            SimpleNamespace(tokenizer=tokenizer), p.context, [p.question], p.answer_prefix, 10_000
        )
        ((context, question),) = encode_split(tokenizer, [p], chat=True)
        assert context == kv["context_ids"][0].tolist() and question == kv["questions_ids"][0][0].tolist()
        ((context, question),) = encode_split(tokenizer, [p], chat=False)
        assert question == tokenizer(p.question + "\n" + p.answer_prefix, add_special_tokens=False)["input_ids"]

        # without an answer prefix, exactly the ids of before (answers or not)
        template = tokenizer.apply_chat_template(
            [{"role": "user", "content": p.text}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        with_answers = Prompt.split_at(p.context, p.question, answers=p.answers)
        assert encode(tokenizer, [bare, with_answers], chat=True) == [template, template]
        assert encode(tokenizer, [bare, with_answers], chat=False) == [tokenizer(p.text)["input_ids"]] * 2
        for chat_mode in (True, False):
            assert encode_split(tokenizer, [with_answers], chat_mode) == encode_split(tokenizer, [bare], chat_mode)


def test_a_trace_forces_the_gold_answers_and_keeps_them(dataset, tmp_path, tiny_models, tokenizer):
    """The 4-row dataset through the command line (chat template): each sample's decode steps are
    exactly its gold answer's tokens, after the prompt with its answer prefix, and the store keeps
    every row's prefix, answers and meta (--question-aware: the question in the prefill); under the
    question-agnostic protocol (the default of --dataset) the question (ending in the prefix) comes first."""
    from kvscope.replay.forced.model import ForcedModel, check_continuations

    model = str(tiny_models["llama"])
    out = tmp_path / "qa.zarr"
    ran = run_main(
        "trace", "--dataset", dataset, "--model", model, "--chat", "--question-aware", "--out", out, "--quiet"
    )
    assert ran.returncode == 0, ran.stderr
    assert "sample 0 (gold answer): ' 4471'" in ran.stdout and "sample 2 (gold answer): ' blue whale'" in ran.stdout
    ds = kvscope.open_trace(out)
    acc = ds.kvscope
    prompts = load_dataset(dataset)
    assert ds.attrs["prompts"] == [p.doc() for p in prompts]
    assert [d["answers"] for d in ds.attrs["prompts"]] == [["4471"], ["quiet", "calm"], ["blue whale"], ["trains"]]
    assert [d["answer_prefix"] for d in ds.attrs["prompts"]] == [r["answer_prefix"] for r in ROWS]
    assert [d["meta"]["context_id"] for d in ds.attrs["prompts"]] == [0, 0, 1, 1]
    assert ds.attrs["continuation_tokens"] == [5, 1, 2, 1] == acc.n_steps.tolist()
    assert ds.attrs["generation"]["continuation"] is True and ds.attrs["generation"]["max_new_tokens"] == 5
    encoded = encode(tokenizer, prompts, chat=True)
    for s, (ids, forced) in enumerate(zip(encoded, ANSWER_IDS)):
        assert int(acc.prompt_len[s]) == len(ids)
        assert ds["tokens"].values[s, : len(ids) + len(forced)].tolist() == ids + forced
        assert acc.generated(s).tolist() == forced == ds["token_id"].values[s, : len(forced)].tolist()
    info = run_main("info", out)
    assert "forced steps per sample: gold answer [5, 1, 2, 1]" in info.stdout
    assert json.loads(run_main("info", out, "--json").stdout)["continuation_kind"] == "gold answer"
    check_continuations(ds, ForcedModel(model=None, model_spec=None, label="tiny", tokenizer=tokenizer))

    agnostic = tmp_path / "agnostic.zarr"
    assert run_main("trace", "--dataset", dataset, "--model", model, "--out", agnostic, "--quiet").returncode == 0
    ds = kvscope.open_trace(agnostic)
    pairs = encode_split(tokenizer, prompts, chat=False)
    assert ds.attrs["question_tokens"] == [len(q) for _, q in pairs]
    for s, ((context, question), forced) in enumerate(zip(pairs, ANSWER_IDS)):
        assert int(ds.kvscope.prompt_len[s]) == len(context)
        assert ds["token_id"].values[s, : len(question) + len(forced)].tolist() == question + forced
        assert tokenizer.decode(question).endswith("\n" + prompts[s].answer_prefix)


def test_run_gives_answer_exact_and_the_tasks_score(tmp_path, tiny_models):
    """``answer_exact`` is 1 exactly where the greedy tokens begin with the gold answer's: checked
    against transformers' own greedy ``generate`` on a full cache (policy full). One row's answer
    is the tiny model's own greedy text (it must be 1), the other's is not (0)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvscope.workloads.metrics import metric_for

    folder = tiny_models["llama"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()

    def greedy(prompt, steps):
        (ids,) = encode(tokenizer, [prompt], chat=False)
        with torch.no_grad():
            return model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)[0, len(ids) :].tolist()

    question = {"context": CONTEXTS[1], "question": "What does her brother prefer?", "answer_prefix": "Answer:"}
    own = greedy(Prompt.split_at(CONTEXTS[1], question["question"], answer_prefix="Answer:", answers=["x"]), 3)
    text = tokenizer.decode(own[:2])
    row = Prompt.split_at(CONTEXTS[1], question["question"], answer_prefix="Answer:", answers=[text])
    assert answer_ids(tokenizer, row) == own[:2]  # the model's own text, tokenized back to its tokens
    rows = [{**question, "answer": [text, "trains"], "task": "qa_1", "max_new_tokens": 3}, {**ROWS[0], "answer": "9"}]
    path = write_jsonl(tmp_path / "mine.jsonl", rows)

    ran = run_main("run", "--dataset", path, "--model", folder, "--policy", "full", "--budget", "1",
                   "--max-new-tokens", "4", "--question-aware", "--json", "--quiet")  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    samples = json.loads(ran.stdout)["samples"]
    assert [s["new_tokens"] for s in samples] == [3, 8]  # a row's max_new_tokens comes first
    for prompt, sample in zip(load_dataset(path), samples):
        answer = answer_ids(tokenizer, prompt)
        tokens = greedy(prompt, sample["new_tokens"])
        exact = int(tokens[: len(answer)] == answer)
        assert sample["answer_exact"] == sample["answer_exact_full"] == exact
        metric = metric_for(prompt.meta["task"])
        assert sample["score"] == metric(sample["text"], prompt.answers)
        assert sample["score_full"] == metric(sample["text_full"], prompt.answers)
    assert [s["answer_exact"] for s in samples] == [1, 0]
    assert samples[0]["score"] == 1.0 and samples[0]["agreement"] == 1.0

    table = run_main("run", "--dataset", path, "--model", folder, "--policy", "full", "--budget", "1",
                     "--question-aware", "--quiet")  # fmt: skip
    assert table.returncode == 0, table.stderr
    assert "exact (full)" in table.stdout and "1 (1)" in table.stdout and "0 (0)" in table.stdout


def test_bad_datasets_are_refused_in_one_line_naming_the_file_and_row(tmp_path, tiny_models, monkeypatch):
    good = ROWS[1]
    base = {k: v for k, v in good.items() if k != "answer"}
    out = tmp_path / "never.zarr"
    model = str(tiny_models["llama"])

    def refused(rows, needle, name="bad.jsonl", *extra, command="trace"):
        path = write_jsonl(tmp_path / name, rows)
        args = [command, "--dataset", path, "--model", model, "--quiet", *extra]
        args += ["--out", out] if command == "trace" else ["--policy", "full", "--budget", "1"]
        one_line_error(run_main(*args), needle)
        assert not out.exists()

    bad = f"dataset {tmp_path / 'bad.jsonl'}"
    refused([good, base], f"{bad} row 1 (line 2): no 'answer' (a string or a list of accepted strings)")
    refused([{**good, "answer": None}], f"{bad} row 0 (line 1): no 'answer'")
    refused([{**good, "answer": ""}], f"{bad} row 0 (line 1): 'answer' is empty")
    refused([{**good, "answer": ["a", " "]}], "row 0 (line 1): 'answer' is empty (one of its strings)")
    refused([{**good, "answer": []}], "row 0 (line 1): 'answer' is an empty list")
    refused([{**good, "answer": 7}], "row 0 (line 1): 'answer' must be a string or a list of strings (got int)")
    refused([{**good, "answer": ["a", 3]}], "'answer' must be a string or a list of strings (it holds int)")
    refused([good, "", {**good, "context": None}], f"{bad} row 1 (line 3): no 'context'")  # a blank line is skipped
    refused([{k: v for k, v in good.items() if k != "question"}], "row 0 (line 1): no 'question'")
    refused([{**good, "question": ""}], "'question' must be a non-empty string (got an empty string)")
    refused([{**good, "answer_prefix": 3}], "row 0 (line 1): 'answer_prefix' must be a string (got int)")
    refused([{**good, "max_new_tokens": 0}], "row 0 (line 1): 'max_new_tokens' must be an integer ≥ 1 (got 0)")
    refused([{**good, "task": ["qa"]}], "row 0 (line 1): 'task' must be a string (got list)")
    refused([good, "{not json"], f"{bad} row 1 (line 2): not a JSON object")
    refused([good, "[1, 2]"], f"{bad} row 1 (line 2): not a JSON object")
    refused([], f"{bad} holds no rows")
    refused([good], "unknown file type '.csv'; kvscope reads JSON lines (.jsonl) or Parquet (.parquet)", "bad.csv")
    # the tokenizer merges the prefix's trailing space with the answer
    refused([{**good, "answer_prefix": "Answer: ", "answer": "Paris"}],
            "the answer of the prompt from bad.jsonl:0 cannot be split from its answer prefix")  # fmt: skip
    # an answer longer than the tokens to decode: trace --max-new-tokens, a run row's max_new_tokens
    refused([ROWS[0]], "the answer of prompt 0 (bad.jsonl:0) has 5 tokens, more than --max-new-tokens 4",
            "bad.jsonl", "--max-new-tokens", "4")  # fmt: skip
    refused([{**ROWS[0], "max_new_tokens": 2}], "the answer of prompt 0 (bad.jsonl:0) has 5 tokens, more than its "
            "max_new_tokens 2", command="run")  # fmt: skip
    # a context longer than the model's (48 positions)
    long = {**ROWS[0], "context": "The harbour was quiet all week. " * 12}
    path = write_jsonl(tmp_path / "long.jsonl", [ROWS[3], long])
    proc = run_main("trace", "--dataset", path, "--model", tiny_models["llama_short"], "--out", out, "--quiet")
    one_line_error(proc, "prompt 1 (long.jsonl:1) has ")
    assert "; with its answer's 5 tokens it exceeds the model context of 48" in proc.stderr
    assert not out.exists()
    # another source beside --dataset, a prompt with both a continuation and answers
    one_line_error(run_main("trace", "--dataset", path, "--prompt", "hi", "--out", out),
                   "argument --prompt: not allowed with argument --dataset")  # fmt: skip
    with pytest.raises(KvscopeError, match="has both a continuation and answers: a trace forces one text"):
        Prompt("a", continuation="b", answers=["c"])
    with pytest.raises(KvscopeError, match="carry answers, whose gold answer a trace forces"):
        kvscope.trace(load_dataset(path)[:1], out, model=model, continuation="b")
    with pytest.raises(KvscopeError, match=r"prompt 1 \(cli\) has no answer while others have one"):
        continuations([Prompt("a", answers=["b"]), Prompt("c")])
    one_line_error(run_main("trace", "--dataset", tmp_path / "gone.jsonl", "--out", out), "dataset file not found")

    # Parquet: not one, and without pyarrow
    (tmp_path / "fake.parquet").write_text("not parquet\n")
    one_line_error(run_main("trace", "--dataset", tmp_path / "fake.parquet", "--out", out),
                   f"dataset {tmp_path / 'fake.parquet'} is not a readable Parquet file")  # fmt: skip
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    one_line_error(run_main("trace", "--dataset", tmp_path / "fake.parquet", "--out", out),
                   "reading Parquet needs pyarrow (pip install pyarrow), or give the rows as JSON lines")  # fmt: skip
    assert not out.exists()


def test_the_command_line_refuses_in_a_real_process(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [ROWS[0], {**ROWS[1], "answer": [""]}])
    proc = run_cli("trace", "--dataset", path, "--out", tmp_path / "never.zarr")
    one_line_error(proc, f"dataset {path} row 1 (line 2): 'answer' is empty")
    assert not (tmp_path / "never.zarr").exists()
