"""One context, several questions (docs/replay.md#several-questions-per-context): the rows of a
``--dataset`` file that share a context are, under the question-agnostic protocol (the default of
``--dataset``), one context whose questions share one budget — a share of the context's longest
final length — and, under forced replay, one prefill; ``--question-aware`` gives every row its own."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

import kvscope
from kvscope.policies.base import CacheSpec

from .conftest import run_main

CONTEXTS = [
    "The lighthouse keeper counted ships every morning and wrote their names in a book. " * 7,
    "Anna keeps a blue whale poster above her desk; her brother prefers trains and maps. " * 7,
]
QUESTIONS = ["Who counted?", "What did the keeper write in the book every single morning?"]
ROWS = [
    {"context": context, "question": question, "answer": answer}
    for context, answers in zip(CONTEXTS, [["the keeper", "names"], ["Anna", "trains"]])
    for question, answer in zip(QUESTIONS, answers)
]  # two contexts × two questions of different lengths
POLICIES = ["h2o", "press:SnapKVPress", "kivi"]
BUDGET = 0.5


@pytest.fixture(scope="module")
def questions(tmp_path_factory, tiny_models):
    """The dataset traced with the default protocol and replayed with ``--forced``, the prefill
    forwards and the prompt-time presses' decisions counted."""
    from kvscope.policies.press_hooks import PrefillCapture
    from kvscope.replay.forced.prefill import ContextPrefill

    base = tmp_path_factory.mktemp("questions")
    dataset = base / "rows.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    model = str(tiny_models["llama"])
    trace = base / "rows.zarr"
    ran = run_main("trace", "--dataset", dataset, "--model", model, "--out", trace, "--record", "qkv",
                   "--dtype", "float32", "--quiet")  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    prefills = []
    forward = ContextPrefill._forward

    def counted(self, recorder):
        prefills.append(self.prompt.tolist())
        return forward(self, recorder)

    decisions = []
    decide = PrefillCapture._decide

    def counted_decision(self, hooks):
        decisions.append(type(hooks.press).__name__)
        return decide(self, hooks)

    out = base / "result.zarr"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ContextPrefill, "_forward", counted)
        patch.setattr(PrefillCapture, "_decide", counted_decision)
        ran = run_main("replay", trace, "--forced", "--policies", ",".join(POLICIES), "--budgets", BUDGET,
                       "--out", out, "--quiet")  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    return SimpleNamespace(dataset=dataset, model=model, ds=kvscope.open_trace(trace), result=kvscope.open_result(out),
                           out=out, prefills=prefills, decisions=decisions)  # fmt: skip


def test_the_rows_of_a_context_are_its_questions(questions):
    ds = questions.ds
    acc = ds.kvscope
    assert acc.question_agnostic  # the default of --dataset
    assert [(p["meta"]["context_id"], p["meta"]["question"]) for p in ds.attrs["prompts"]] == [(0, 0), (0, 1),
                                                                                              (1, 0), (1, 1)]  # fmt: skip
    assert acc.contexts.tolist() == [0, 0, 1, 1]
    ends = acc.prompt_len + acc.n_steps  # [sample]
    assert ends[0] != ends[1]  # the questions' lengths differ: their own final lengths would too
    longest = [max(ends[0], ends[1])] * 2 + [max(ends[2], ends[3])] * 2
    assert acc.final_len.tolist() == longest


def test_the_trace_prefills_each_context_once_to_the_same_store(questions, tmp_path):
    """``trace --dataset`` runs one prefill per context (its questions take a copy of its cache and
    of what was recorded of it), and the store is the one a prefill per question makes."""
    import zarr

    from kvscope.tracing.decode import BatchDecode, PrefillMemo

    prefills, forward = [], BatchDecode._model_forward
    kept, keep = [], PrefillMemo.keep

    def counted(self, t, next_input):
        if t == 0:
            prefills.append(self.batch[0])
        return forward(self, t, next_input)

    def counted_keep(self, ids, recorder, **kwargs):
        keep(self, ids, recorder, **kwargs)
        kept.append(self.kept is not None)

    stores = {}
    for shared in (True, False):
        stores[shared] = tmp_path / f"shared-{shared}.zarr"
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(BatchDecode, "_model_forward", counted)
            patch.setattr(PrefillMemo, "keep", counted_keep)
            if not shared:
                patch.setattr(PrefillMemo, "take", lambda self, ids, recorder: None)
            ran = run_main("trace", "--dataset", questions.dataset, "--model", questions.model, "--out", stores[shared],
                           "--record", "qkv", "--dtype", "float32", "--quiet")  # fmt: skip
        assert ran.returncode == 0, ran.stderr
    assert prefills == [0, 2, 0, 1, 2, 3]  # shared: the first sample of each context; then every sample
    assert kept == [True, True, True, False, True, False]  # a prefill is kept only for a next batch that shares it
    one, per_question = (zarr.open_group(str(stores[shared]), mode="r") for shared in (True, False))
    names = sorted(name for name, _ in one.arrays())
    assert names == sorted(name for name, _ in per_question.arrays())
    for name in names:
        np.testing.assert_array_equal(one[name][...], per_question[name][...], err_msg=name)


def test_forced_replay_prefills_each_context_once(questions):
    ds = questions.ds
    tokens = ds["tokens"].values
    assert questions.prefills == [tokens[s, : int(ds.kvscope.prompt_len[s])].tolist() for s in (0, 2)]
    assert np.isfinite(questions.result["answer_exact"].values).all()


def test_a_prompt_time_press_decides_once_per_context(questions):
    """SnapKV compresses each context once for both its questions (kvpress's protocol), at the
    replay's one budget: two decisions for four samples."""
    assert questions.decisions == ["SnapKVPress", "SnapKVPress"]


def test_a_contexts_questions_share_one_budget_live_as_offline(questions):
    """``run --dataset`` sizes every question's cache by the context's longest final length,
    ``B = β · FP_bytes(P + max_q S_q)``: the same bytes for both questions of a context, those of the
    trace's ``final_len`` (each question decodes its answer's tokens, as the trace forced them)."""
    dataset, acc = questions.dataset, questions.ds.kvscope
    spec = acc.model
    steps = [int(n - q) for n, q in zip(acc.n_steps, acc.question_tokens)]  # the answer's tokens
    rows = [{**row, "max_new_tokens": n} for row, n in zip(ROWS, steps)]
    dataset.with_name("sized.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    ran = run_main("run", "--dataset", dataset.with_name("sized.jsonl"), "--model", questions.model, "--policy", "h2o",
                   "--budget", BUDGET, "--kv-dtype", "float32", "--json", "--quiet")  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    live = json.loads(ran.stdout)["samples"]
    for s, sample in enumerate(live):
        cache = CacheSpec(n_layers=spec.n_layers, n_kv=spec.n_kv_heads, head_dim=spec.head_dim,
                          prompt_len=int(acc.prompt_len[s]), final_len=int(acc.final_len[s]), budget=BUDGET,
                          fp_itemsize=4)  # fmt: skip
        assert sample["budget_bytes"] == pytest.approx(cache.total_capacity, rel=1e-12)
    assert live[0]["budget_bytes"] == live[1]["budget_bytes"] and live[2]["budget_bytes"] == live[3]["budget_bytes"]
    offline = questions.result["answer_exact"].sel(policy="h2o", budget=BUDGET, allocation="uniform").values
    assert offline.tolist() == [float(s["answer_exact"]) for s in live]


def test_question_aware_gives_every_row_its_own_prefill(questions, tmp_path):
    dataset, model = questions.dataset, questions.model
    out = tmp_path / "aware.zarr"
    ran = run_main("trace", "--dataset", dataset, "--model", model, "--question-aware", "--out", out, "--quiet")
    assert ran.returncode == 0, ran.stderr
    acc = kvscope.open_trace(out).kvscope
    assert not acc.question_agnostic
    assert acc.contexts.tolist() == [0, 1, 2, 3]
    assert acc.final_len.tolist() == (acc.prompt_len + acc.n_steps).tolist()
    both = run_main("run", "--dataset", dataset, "--model", model, "--policy", "h2o", "--budget", "0.5",
                    "--question-aware", "--question-agnostic")  # fmt: skip
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_accuracy_is_reported_per_question_index(questions):
    """The result's ``context`` and ``question`` coordinates; accuracy per question index, the mean of
    ``answer_exact`` over the contexts' first and second questions; ``compare`` shows it."""
    from kvscope.report import question_accuracy

    result = questions.result
    assert result["context"].values.tolist() == [0, 0, 1, 1]
    assert result["question"].values.tolist() == [0, 1, 0, 1]
    by_question = question_accuracy(result)
    exact = result["answer_exact"].transpose("policy", "allocation", "budget", "sample").values  # [*run, sample]
    np.testing.assert_array_equal(by_question["accuracy"].values, np.stack([exact[..., ::2].mean(-1),
                                                                            exact[..., 1::2].mean(-1)], -1))  # fmt: skip
    assert by_question["n"].values.tolist() == [2, 2]
    ran = run_main("compare", questions.out, "--json")
    assert ran.returncode == 0, ran.stderr
    for row in json.loads(ran.stdout)["rows"]:
        at = by_question["accuracy"].sel(policy=row["policy"], allocation=row["allocation"], budget=row["budget"])
        assert row["accuracy_by_question"] == pytest.approx(at.values.tolist())
    table = run_main("compare", questions.out)
    assert "accuracy by question (each context's 1st, 2nd, … question):" in table.stdout
