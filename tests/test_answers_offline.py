"""Task accuracy offline (docs/concepts.md#task-accuracy): forced replay of a ``trace --dataset``
store gives, per policy and sample, ``answer_exact`` — whether greedy decoding under the policy's
cache emits the gold answer as its first tokens — and it is ``kvscope run``'s live ``answer_exact``
on the same prompts; ``answer_nll`` is the answer's forced NLL, which the live greedy decode
gives too where it emits the answer; ``accuracy`` with its CI reaches ``compare``.

Ground truth, on a RULER-like needle task of 2 contexts × 2 questions (~200 tokens each): on a tiny
GQA model ``kvscope run --dataset`` itself (the CLI encodes the rows as ``trace`` does); on SmolLM2
(float32 model and cache, as the trace) the decode ``kvscope run`` grades — ``kvscope.live.run.decode``
under a ``PolicyCache``, its free decode — of the trace's own prompt tokens, the model loaded once
for every policy (the CLI would load it and prefill every prompt three times per policy)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import xarray as xr

import kvscope

from .conftest import run_main

KEYS = [("lighthouse", "4471"), ("orchard", "8203")]
POLICIES = [
    "h2o", "qevict",  # closed loops: they decide from what their cache served
    "kivi", "logquant",  # quantizers
    "press:SnapKVPress",  # a prompt-time press on q, k, v
    "press:KVzipPress",  # a press that runs the model (its context reconstruction)
    "press:KeyRerotationPress:press=KnormPress",  # a press that rewrites the keys it keeps
    "press:DecodingPress:base=KnormPress:compression_interval=2",  # a press that acts while decoding
]  # both models, every sample  # fmt: skip
BUDGET = 0.3
ANSWER_TOKENS = 5  # " " and four digits: SmolLM2 writes numbers digit by digit
TINY_POLICIES = ["streaming", *POLICIES]
TINY_STEPS = 4


def needle_rows() -> list[dict]:
    """2 haystacks of Python-docs prose, each hiding both keys' magic numbers, × 2 questions."""
    from pydoc_data import topics

    rows = []
    for text in (topics.topics["assignment"][200:900], topics.topics["if"][:700]):
        half, quarter = text.rindex(" ", 0, len(text) // 2), len(text) // 4
        needles = [f" The special magic number for {key} is: {number}." for key, number in KEYS]
        context = text[:half] + needles[0] + text[half : half + quarter] + needles[1] + text[half + quarter :] + "\n"
        for key, number in KEYS:
            rows.append({
                "context": context,
                "question": f"What is the special magic number for {key} mentioned in the provided text?",
                "answer_prefix": f"The special magic number for {key} mentioned in the provided text is",
                "answer": number,
            })  # fmt: skip
    return rows


def traced(base, rows, policies, budget, *options) -> SimpleNamespace:
    """``rows`` as a dataset, traced (float32, q/k/v; ``options``: trace's and run's own, the model and
    the protocol) and replayed with ``--forced`` under ``policies``."""
    dataset = base / "needles.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    trace = base / "needles.zarr"
    ran = run_main("trace", "--dataset", dataset, *options, "--out", trace, "--record", "qkv", "--dtype", "float32",
                   "--quiet")  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    out = base / "result.zarr"
    ran = run_main("replay", trace, "--forced", "--policies", ",".join(policies), "--budgets", budget, "--out", out,
                   "--quiet")  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    return SimpleNamespace(dataset=dataset, trace=trace, result=kvscope.open_result(out), out=out, options=options,
                           policies=policies, budget=budget)  # fmt: skip


def run_live(case, steps: int):
    """``policy → [sample]`` ``kvscope run --dataset``'s samples (``run --json``) on ``case``."""

    def live(policy: str) -> list[dict]:
        ran = run_main("run", "--dataset", case.dataset, *case.options, "--policy", policy, "--budget", case.budget,
                       "--max-new-tokens", steps, "--json", "--quiet")  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        return json.loads(ran.stdout)["samples"]

    return live


def greedy_live(case):
    """``policy → [sample] {answer_exact, answer_nll}`` from the live greedy decode ``kvscope run``
    grades (``run_loaded``'s free decode: ``decode`` under a ``PolicyCache``; ``"full"``: its
    ``full_decode``) of each traced sample's prompt (its prefill, then any question's tokens), the
    model loaded once; ``a`` the gold answer the trace forced, ``y`` the greedy tokens::

        answer_exact = [y_0 … y_{m−1} = a_0 … a_{m−1}]
        answer_nll   = Σ_{t<m} −log softmax(z_t)[a_t]        the forced NLL where answer_exact = 1
    """
    from kvscope.live import PolicyCache, prepare
    from kvscope.live.run import context_forwards, decode, full_decode
    from kvscope.model.loading import load, resolve

    ds = kvscope.open_trace(case.trace)
    acc = ds.kvscope
    model, _ = load(resolve(ds.attrs["model"]["name"]))
    prepare(model)
    samples = []  # (prefill ids, question ids, answer ids, forwards)
    for s, (P, Q, n) in enumerate(zip(acc.prompt_len, acc.question_tokens, acc.n_steps)):
        tokens = [int(t) for t in ds["tokens"].values[s, : P + n]]
        samples.append((tokens[:P], tokens[P : P + Q], tokens[P + Q :], int(n)))
    # a context's questions share one budget, sized by kvscope run's rule for its longest
    sized = context_forwards([ids for ids, *_ in samples], [n for *_, n in samples])

    def graded(decoded, answer: list[int]) -> dict:
        log_probs = torch.log_softmax(decoded.logits[: len(answer)], -1)  # [m, vocab]
        return {"answer_exact": int(decoded.tokens[: len(answer)] == answer),
                "answer_nll": float(-log_probs[torch.arange(len(answer)), answer].double().sum())}  # fmt: skip

    def live(policy: str) -> list[dict]:
        out = []
        for (ids, question, answer, n), forwards in zip(samples, sized):
            steps = n - len(question)
            if policy == "full":
                decoded = full_decode(model, ids, steps, question=question)
            else:
                cache = PolicyCache(model, policy, case.budget, forwards)
                decoded = decode(model, ids, cache, steps, question=question)
            out.append(graded(decoded, answer))
        return out

    return live


def offline_against_live(case, live) -> tuple[set, dict]:
    """Per policy of ``case``: the result's ``answer_exact`` against the live one (``live(policy)``: per
    sample ``answer_exact``), ``answer_nll`` against the sum of the forced steps' NLL, ``accuracy``
    against their mean. Returns the outcomes seen and each policy's live samples."""
    result, seen, lives = case.result, set(), {}
    for policy, label in zip(case.policies, [str(p) for p in result["policy"].values]):
        samples = live(policy)
        run = result.sel(policy=label, budget=case.budget, allocation="uniform")
        offline = run["answer_exact"].values
        assert (label, offline.tolist()) == (label, [float(s["answer_exact"]) for s in samples])
        lives[label] = samples
        seen |= set(offline.tolist())
        np.testing.assert_allclose(run["answer_nll"].values, np.nansum(run["forced_nll"].values, -1), rtol=1e-12)
        assert (run["answer_rank"].values[offline == 1] == 0).all()  # an exact answer's first token is a top one
        assert float(run["accuracy"]) == pytest.approx(offline.mean())
        assert float(run["accuracy_ci_low"]) <= float(run["accuracy"]) <= float(run["accuracy_ci_high"])
    return seen, lives


@pytest.fixture(scope="module")
def needles(tmp_path_factory, smollm2_dir):
    """The needle task on SmolLM2 replayed under ``POLICIES`` at β = 0.3, question-aware (each row's
    question in its prefill: the answer's 5 steps alone are decoded; the question-agnostic protocol,
    --dataset's default, is checked on the tiny model and in tests/test_several_questions.py)."""
    return traced(tmp_path_factory.mktemp("answers"), needle_rows(), POLICIES, BUDGET, "--question-aware")


@pytest.mark.slow
def test_the_trace_forces_each_gold_answer(needles):
    ds = kvscope.open_trace(needles.trace)
    assert not ds.kvscope.question_agnostic and ds.attrs["continuation_tokens"] == [ANSWER_TOKENS] * 4
    assert ds.kvscope.n_steps.tolist() == [ANSWER_TOKENS] * 4
    assert [p["answers"] for p in ds.attrs["prompts"]] == [[n] for _ in range(2) for _, n in KEYS]
    assert np.isfinite(needles.result["answer_exact"].values).all()


@pytest.mark.slow
def test_offline_answer_exact_is_the_live_greedy_answer_for_every_policy_and_sample(needles):
    """Full KV answers every question right; where a policy's greedy decode emits the answer, its
    logits are the forced decode's, and the answer's NLL is the live one."""
    live = greedy_live(needles)
    assert [s["answer_exact"] for s in live("full")] == [1, 1, 1, 1]
    seen, lives = offline_against_live(needles, live)
    assert seen == {0.0, 1.0}  # some policies lose the needles at β = 0.3, some keep them
    for label, samples in lives.items():
        offline = needles.result["answer_nll"].sel(policy=label, budget=BUDGET, allocation="uniform").values
        exact = [s["answer_exact"] == 1 for s in samples]
        np.testing.assert_allclose(offline[exact], [s["answer_nll"] for s in samples if s["answer_exact"]], rtol=1e-4)


def test_offline_answer_exact_is_live_on_a_tiny_gqa_model(tmp_path, tiny_models):
    """A random-weight GQA model, whose gold answers are its own greedy words under full KV (any
    other answer it would miss under every cache): β = 0.9 keeps some and loses others."""
    from kvscope.model.dataset import load_dataset
    from kvscope.model.loading import load, resolve
    from kvscope.model.prompts import Prompt, answer_ids, encode_split

    folder = str(tiny_models["llama"])
    rows = [{k: v for k, v in row.items() if k != "answer_prefix"} for row in needle_rows()]
    placeholder = tmp_path / "placeholder.jsonl"
    placeholder.write_text("".join(json.dumps(row) + "\n" for row in rows))
    model, tokenizer = load(resolve(folder))
    greedy = []
    for row, prompt in zip(rows, load_dataset(placeholder)):
        context, question = encode_split(tokenizer, [prompt], False)[0]  # --dataset's protocol: question-agnostic
        ids = context + question
        with torch.no_grad():
            for _ in range(TINY_STEPS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        row["answer"] = tokenizer.decode(ids[-TINY_STEPS:])
        # an answer whose text does not give its tokens back (a token that is half a character) is
        # forced as its text's tokens: not the greedy ones, so full KV misses it too
        again = answer_ids(tokenizer, Prompt.split_at(row["context"], row["question"], "row", answers=[row["answer"]]))
        greedy.append(int(again == ids[-TINY_STEPS:]))
    case = traced(tmp_path, rows, TINY_POLICIES, 0.9, "--model", folder)
    seen, lives = offline_against_live(case, run_live(case, TINY_STEPS))
    assert seen == {0.0, 1.0}
    assert [[s["answer_exact_full"] for s in live] for live in lives.values()] == [greedy] * len(TINY_POLICIES)


@pytest.mark.slow
def test_compare_shows_accuracy_with_its_interval(needles):
    ran = run_main("compare", needles.out, "--json")
    assert ran.returncode == 0, ran.stderr
    rows = json.loads(ran.stdout)["rows"]
    result = needles.result
    for row in rows:
        run = result.sel(policy=row["policy"], budget=row["budget"], allocation=row["allocation"])
        assert row["accuracy"] == pytest.approx(float(run["accuracy"]))
        assert row["accuracy_ci95"] == [pytest.approx(float(run["accuracy_ci_low"])),
                                        pytest.approx(float(run["accuracy_ci_high"]))]  # fmt: skip
    table = run_main("compare", needles.out)
    assert table.returncode == 0, table.stderr
    assert "accuracy [95% CI]" in table.stdout and "samples with answers" in table.stdout


def test_hit_and_rank_count_strictly_larger_log_probabilities_and_break_ties_as_argmax():
    from kvscope.replay.forced import ForcedRun

    log_probs = torch.log_softmax(torch.tensor([
        [0.0, 3.0, 1.0, 3.0],  # tie for the top: argmax takes index 1
        [0.0, 3.0, 1.0, 3.0],
        [5.0, 4.0, 4.0, 1.0],
        [2.0, 1.0, 0.0, -1.0],
    ]), -1)  # fmt: skip
    y = torch.tensor([1, 3, 3, 0])
    run = ForcedRun.__new__(ForcedRun)
    run.sample = SimpleNamespace(continuation=y)
    S = len(y)
    run.kl, run.nll, run.top1 = np.zeros(S), np.zeros(S), np.ones(S, dtype=bool)
    run.hit, run.rank = np.zeros(S, dtype=bool), np.zeros(S, dtype=np.int64)
    run._score(range(S), log_probs, None, keep_logits=False)
    assert run.hit.tolist() == [True, False, False, True]  # y = 3 ties with the argmax but is not it
    assert run.rank.tolist() == [0, 0, 3, 0]
    np.testing.assert_allclose(run.nll, -log_probs[torch.arange(S), y].numpy())


def test_answer_variables_grade_only_samples_with_answers():
    """Samples 0–2 carry answers (sample 1 was never decoded), sample 3 none: exactness is every
    answer step a hit, NaN without an answer or steps; accuracy the mean over the graded ones."""
    from kvscope.analysis.common import bootstrap_ratio
    from kvscope.replay.forced import ForcedOutputs
    from kvscope.replay.reader import answered
    from kvscope.replay.result import _answer_variables

    prompts = [{"text": "a", "answers": ["x"]}, {"text": "b", "answers": ["y"]}, {"text": "c", "answers": ["z"]},
               {"text": "d"}]  # fmt: skip
    ds = xr.Dataset(coords={"sample": np.arange(4)}, attrs={"prompts": prompts})
    assert answered(ds).tolist() == [True, True, True, False]
    nan = np.nan
    shape = (1, 1, 1, 4, 3)  # [*run, sample, step]
    nll = np.array([[0.5, 0.25, nan], [nan, nan, nan], [nan, 1.0, 2.0], [0.1, 0.1, 0.1]]).reshape(shape)
    hit = np.array([[1, 1, nan], [nan, nan, nan], [nan, 1, 0], [1, 1, 1]], dtype=float).reshape(shape)
    rank = np.array([[0, 0, nan], [nan, nan, nan], [nan, 2, 7], [0, 0, 0]], dtype=float).reshape(shape)
    f = ForcedOutputs(kl=np.zeros(shape), nll=nll, top1=np.zeros(shape), hit=hit, rank=rank,
                      rounds=np.ones(shape[:4], dtype=np.int64), converged=np.ones(shape[:4], dtype=bool),
                      perplexity_full=np.ones(4), loops={}, settings={})  # fmt: skip
    setup = SimpleNamespace(ds=ds, fmm=SimpleNamespace(interval=lambda n, d: bootstrap_ratio(n, d, n_boot=50)))
    data = _answer_variables(setup, f, answered(ds))
    np.testing.assert_array_equal(data["answer_exact"][1][0, 0, 0], [1.0, nan, 0.0, nan])
    np.testing.assert_array_equal(data["answer_nll"][1][0, 0, 0], [0.75, nan, 3.0, nan])
    np.testing.assert_array_equal(data["answer_rank"][1][0, 0, 0], [0.0, nan, 2.0, nan])
    assert data["accuracy"][1][0, 0, 0] == 0.5
    assert (data["accuracy_ci_low"][1][0, 0, 0], data["accuracy_ci_high"][1][0, 0, 0]) == (0.0, 1.0)
