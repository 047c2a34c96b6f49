"""Workloads: deterministic for a seed, the requested token length (±2%), scorers that grade
known-correct and known-wrong answers, a few traced steps of each via subprocess, bad input."""

from __future__ import annotations

import json

import pytest

from kvscope import workloads as W
from kvscope.errors import KvscopeError
from kvscope.model.prompts import encode
from kvscope.workloads.metrics import string_match_all

from .conftest import run_cli, run_main

NAMES = ["prose", "code", "niah", "vt", "reasoning", "passkey"]  # those that fit 384–512 tokens
RULER = [
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
]  # fmt: skip
ALL = ["prose", "code", "niah", "vt_chains", "reasoning", "passkey", *RULER]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.parametrize("name", [*NAMES, "vt_chains"])
@pytest.mark.parametrize("context", [512, 2048])
def test_requested_length_within_two_percent(tokenizer, name, context):
    chat = W.load_recipe(name).get("chat", False)
    for p in W.prompts(name, tokenizer, context=context, seed=3):
        n = W.count_tokens(tokenizer, p.text, chat, p.answer_prefix)  # vt: its answer prefix counts too
        assert abs(n - context) <= 0.02 * context, (name, n)
        assert p.meta["tokens"] == n and p.meta["workload"] == name


@pytest.mark.parametrize("name", [*NAMES, "vt_chains"])
def test_deterministic_for_a_seed(tokenizer, name):
    a = W.prompts(name, tokenizer, context=512, seed=7)
    b = W.prompts(name, tokenizer, context=512, seed=7)
    c = W.prompts(name, tokenizer, context=512, seed=8)
    assert [(p.text, p.expected) for p in a] == [(p.text, p.expected) for p in b]
    assert [p.text for p in a] != [p.text for p in c]
    assert len({p.text for p in a}) == len(a)  # the samples differ from each other


def test_niah_variants_hide_their_needles(tokenizer):
    single, multikey, multivalue = W.prompts("niah", tokenizer, context=1024, seed=0)
    assert [p.meta["variant"] for p in (single, multikey, multivalue)] == ["single", "multikey", "multivalue"]
    assert len(single.expected) == 1 and len(multikey.expected) == 1 and len(multivalue.expected) == 4
    for p in (single, multikey, multivalue):
        for value in p.expected:
            assert f"{p.meta['key']} is: {value}." in p.text
        assert p.text.count("special magic numbers for") >= len(p.expected) + 1
    assert multikey.text.count("One of the special magic numbers for") == 4  # three distractor keys


def test_passkey_hides_one_key_and_asks_for_it(tokenizer):
    prompts = W.prompts("passkey", tokenizer, context=1024, seed=0)
    assert len(prompts) == 4 and len({p.expected[0] for p in prompts}) == 4
    for p in prompts:
        (key,) = p.expected
        assert len(key) == 5 and p.text.count(f"The pass key is {key}. Remember it. {key} is the pass key.") == 1
        assert p.text.endswith("What is the pass key? The pass key is") and p.text[p.split :].startswith("What is the pass key?")
        assert W.score("passkey", f" {key}. Remember", p.expected) == 1.0 and W.score("passkey", " 1234", p.expected) == 0
    depths = [p.text.index(p.expected[0]) / len(p.text) for p in prompts]
    assert max(depths) - min(depths) > 0.2  # hidden at different depths


def _assignments(text: str) -> dict[str, int]:
    """What each ``VAR X = …`` line of ``text`` assigns, chains followed."""
    assigned: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("VAR "):
            name, rhs = line[4:].strip().split(" = ")
            assigned[name] = assigned[rhs[4:]] if rhs.startswith("VAR ") else int(rhs)
    return assigned


def test_vt_chain_resolves_to_the_asked_value(tokenizer):
    (p, *_) = W.prompts("vt", tokenizer, context=1024, seed=2)
    example, task = p.text.split("\n\nMemorize and track")  # RULER's one-shot example, then the task
    value = p.meta["value"]
    holders = [n for n, v in _assignments(task).items() if v == value]
    assert holders == p.answers == p.expected and len(holders) == p.meta["hops"] + 1 == 5
    assert all(len(n) == 5 and n.isupper() for n in holders)
    solved = _assignments(example)  # the example's chain of 3-letter names, solved after its answer prefix
    (shown,) = set(solved.values())
    assert example.endswith(f"{len(solved)} variables are assigned the value {shown}, they are: " + " ".join(solved))
    assert len(solved) == 5 and all(len(n) == 3 for n in solved)
    # at most a quarter of the context (RULER: 500 tokens)
    assert len(tokenizer(example, add_special_tokens=False)["input_ids"]) <= 256


def test_reasoning_answers_follow_the_recipe_arithmetic(tokenizer):
    (p, *_) = W.prompts("reasoning", tokenizer, context=512, seed=5)
    assert p.text.rstrip().endswith("Solution:") and p.expected.lstrip("-").isdigit()
    assert W.evaluate("(a + b - c) // d", {"a": 30, "b": 25, "c": 7, "d": 5}) == 9
    for bad in ("__import__('os')", "a ** 2", "len(a)", "a / 2"):
        with pytest.raises(KvscopeError):
            W.evaluate(bad, {"a": 3})


def test_scorers_grade_right_and_wrong_answers():
    assert W.score("niah", "The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert W.score("niah", "It is 1234567.", ["1234567", "7654321"]) == 0.5
    assert W.score("niah", "I do not know.", ["1234567"]) == 0.0
    assert W.score("vt", "ABCDE, FGHIJ, kLmNo", ["ABCDE", "FGHIJ", "KLMNO", "PQRST"]) == 0.75  # any case
    assert W.score("reasoning", "3 + 4 = 7. 7 * 2 = 14. The answer is 14.", "14") == 1.0
    assert W.score("reasoning", "3 + 4 = 7. The answer is 1,400.", "1400") == 1.0
    assert W.score("reasoning", "The answer is 15. Wait, no: 14 apples", "14") == 0.0  # the stated answer counts
    assert W.score("reasoning", "so we get 14", "14") == 1.0
    assert W.score("reasoning", "no idea", "14") == 0.0
    assert W.score("prose", "anything", None) is None


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_each_workload_traces_by_the_cli(tmp_path, name):
    out = tmp_path / f"{name}.zarr"
    args = ("trace", "--workload", name, "--context", 384, "--samples", 1, "--max-new-tokens", 3, "--seed", 1,
            "--out", out, "--quiet")  # fmt: skip
    if name == "prose":  # one as a real process; the others through the same main in this one
        proc = run_cli(*args, check=True)
    else:
        proc = run_main(*args)
        assert proc.returncode == 0, proc.stderr
    assert "traced 1 sample(s)" in proc.stdout
    import kvscope

    ds = kvscope.open_trace(out)
    (prompt,) = ds.attrs["prompts"]
    assert prompt["meta"]["workload"] == name and abs(int(ds["prompt_len"].values[0]) - 384) <= 8
    assert (prompt.get("expected") is not None) == (name in ("niah", "vt", "reasoning", "passkey"))
    assert ds.attrs["generation"]["chat_template"] == (name in ("niah", "vt", "reasoning"))  # passkey: a completion


def test_workloads_command_and_bad_input(tmp_path):
    rows = json.loads(run_cli("workloads", "--json", check=True).stdout)
    assert [r["name"] for r in rows] == ALL
    assert {r["name"]: r["scorer"] for r in rows} == {
        "prose": None, "code": None, "niah": "score_all_present", "vt_chains": "score_all_present",
        "reasoning": "score_final_number",
        "passkey": "score_all_present", **dict.fromkeys(RULER, "string_match_all"),
    }  # fmt: skip
    prefixes = {r["name"]: r["answer_prefix"] for r in rows if r["answer_prefix"]}
    assert sorted(prefixes) == sorted(RULER)
    assert prefixes["cwe"] == " Answer: The top {num_cw} words that appear most often in the list are:"
    cases = [
        (("trace", "--workload", "poetry", "--out", tmp_path / "a.zarr"), "unknown workload"),
        (("trace", "--workload", "prose", "--context", 9000, "--out", tmp_path / "b.zarr"), "model context"),
        (("trace", "--workload", "vt", "--context", 100, "--out", tmp_path / "c.zarr"), "at least"),
        (
            ("trace", "--prompt", "hi", "--context", 100, "--max-new-tokens", 2, "--out", tmp_path / "d.zarr"),
            "--workload",
        ),
        (("trace", "--prompt", "hi", "--out", tmp_path / "e.zarr"), "--max-new-tokens"),
    ]
    for i, (args, words) in enumerate(cases):  # the first as a real subprocess, the rest in-process
        proc = (run_cli if i == 0 else run_main)(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert not (tmp_path / "a.zarr").exists()


# -- RULER's synthetic tasks ------------------------------------------------------------------------

_BUILT: dict = {}


def _ruler(tokenizer, name: str, context: int, seed: int = 0):
    """One prompt of a RULER task, built once per module (token counting is the cost)."""
    if (name, context, seed) not in _BUILT:
        _BUILT[name, context, seed] = W.prompts(name, tokenizer, context=context, seed=seed, samples=1)[0]
    return _BUILT[name, context, seed]


@pytest.mark.parametrize("name", RULER)
@pytest.mark.parametrize("context", [1024, 4096])
def test_each_ruler_task_lands_within_two_percent_with_its_answer_prefix_counted(tokenizer, name, context):
    p = _ruler(tokenizer, name, context)
    n = W.count_tokens(tokenizer, p.text, True, p.answer_prefix)
    assert n == len(encode(tokenizer, [p], chat=True)[0]) > W.count_tokens(tokenizer, p.text, True) + 10  # the prefix's
    assert abs(n - context) <= 0.02 * context and p.meta["tokens"] == n and p.meta["workload"] == name
    assert p.answers == p.expected and p.answers and all(isinstance(a, str) and a for a in p.answers)
    assert p.text[p.split :] == p.question and p.question.startswith(("What", "Question:"))
    assert p.context.endswith("\n") and not p.text.endswith(p.answer_prefix)  # it comes after the prompt
    assert p.answer_prefix.startswith(" ") and p.answer_prefix == p.answer_prefix.rstrip()
    assert W.get(name).scorer is string_match_all and W.score(name, " ".join(p.answers), p.answers) == 1.0


@pytest.mark.parametrize("name", RULER)
def test_each_ruler_task_is_the_same_for_a_seed_and_differs_across_seeds(tokenizer, name):
    a, c = _ruler(tokenizer, name, 1024, seed=1), _ruler(tokenizer, name, 1024, seed=0)
    (b,) = W.prompts(name, tokenizer, context=1024, seed=1, samples=1)
    assert (a.text, a.answers, a.answer_prefix) == (b.text, b.answers, b.answer_prefix)
    assert a.text != c.text and a.answers != c.answers


NIAH = {  # RULER's scripts/synthetic.yaml: haystack, key kind, value kind, needles k · v · q
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 1, 1, 4),
}


def _is(kind: str, text: str) -> bool:
    import uuid

    from kvscope.workloads.sources import prose_words

    if kind == "numbers":
        return len(text) == 7 and text.isdigit()
    if kind == "uuids":
        return str(uuid.UUID(text)) == text and uuid.UUID(text).version == 4
    return len(text.split("-")) == 2 and all(w in prose_words() for w in text.split("-"))


@pytest.mark.parametrize("name", list(NIAH))
def test_each_niah_task_hides_the_asked_values_under_the_asked_keys(tokenizer, name):
    haystack, kind_k, kind_v, n_k, n_v, n_q = NIAH[name]
    p = _ruler(tokenizer, name, 4096)
    keys, (needles, *_) = p.meta["queries"], p.context.rsplit("\n", 1)
    assert len(keys) == n_q and len(p.answers) == n_q * n_v and all(_is(kind_k, k) for k in keys)
    assert all(_is(kind_v, v) for v in p.answers)
    found = [v for k in keys for v in p.answers if f"One of the special magic {kind_v} for {k} is: {v}." in needles]
    assert sorted(found) == sorted(p.answers)  # each asked value under its key, in the haystack
    hidden = needles.count("One of the special magic")
    assert hidden == max(n_k, n_q) * n_v if haystack != "needle" else hidden > 20  # needle: other keys around it
    assert ("The grass is green. The sky is blue." in needles) == (haystack == "noise")
    query = keys[0] if n_q == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]
    kind = kind_v if n_q * n_v > 1 else kind_v[:-1]  # RULER's singular wording for one value
    opening = f"Some special magic {kind} are hidden" if n_q * n_v > 1 else f"A special magic {kind} is hidden"
    asks = "What are all the" if n_q * n_v > 1 else "What is the"
    assert p.text.startswith(f"{opening} within the following text. Make sure to memorize it.")
    assert p.question == f"{asks} special magic {kind} for {query} mentioned in the provided text?"
    verb = "are" if n_q * n_v > 1 else "is"
    assert p.answer_prefix == f" The special magic {kind} for {query} mentioned in the provided text {verb}"


def _numbered(text: str) -> list[str]:
    """The words of a RULER numbered list ``1. a 2. b …``, their numbers checked in order."""
    parts = text.split(" ")
    assert parts[0::2] == [f"{i + 1}." for i in range(len(parts) // 2)]
    return parts[1::2]


@pytest.mark.parametrize("context, freq_cw, freq_ucw", [(1024, 6, 1), (4096, 30, 3)])
def test_cwe_answers_are_the_ten_most_common_words_of_the_list(tokenizer, context, freq_cw, freq_ucw):
    from collections import Counter

    p = _ruler(tokenizer, "cwe", context)
    example, listed = p.context.split("Memorize the ones that appear most often.\n")[1:]
    counts = Counter(_numbered(listed.strip()))
    assert (p.meta["freq_cw"], p.meta["freq_ucw"]) == (freq_cw, freq_ucw)  # RULER's short settings below 4096
    assert sorted(w for w, c in counts.items() if c == freq_cw) == sorted(p.answers) and len(p.answers) == 10
    assert set(counts.values()) == {freq_cw, freq_ucw} and len(counts) == p.meta["words"] > 10
    asked = "\nQuestion: What are the 10 most common words in the above list?"
    shown_list, solved = example.split(asked + " Answer: The top 10 words that appear most often in the list are: ")
    top = [w for w, _ in Counter(_numbered(shown_list)).most_common(10)]
    assert sorted(_numbered(solved.split("\n")[0])) == sorted(top)  # the solved example's answer is its own top 10


@pytest.mark.parametrize("context", [1024, 4096])
def test_fwe_answers_are_the_three_most_frequent_coded_words(tokenizer, context):
    from collections import Counter

    p = _ruler(tokenizer, "fwe", context)
    coded = p.context.split("Find the three most frequently appeared coded words. ")[1].split()
    (noise, _), *ranked = Counter(coded).most_common()
    assert noise == "..." and [w for w, _ in ranked[:3]] == p.answers and ranked[2][1] > ranked[3][1]
    assert all(len(w) == 6 and w.isalpha() for w, _ in ranked) and p.meta["vocab_size"] == context // 50


def test_ruler_scores_are_string_match_all(tokenizer):
    answers = ["1234567", "7654321", "abc-def", "9999999"]
    assert W.score("niah_multivalue", "The numbers are 1234567 and 7654321, and ABC-Def.", answers) == 0.75
    assert W.score("niah_single_1", "no number here", ["1234567"]) == 0.0
    assert W.score("cwe", " 1. Scope 2. block 3. padding", ["scope", "block", "output", "breaks"]) == 0.5
    assert W.score("fwe", " vybpkz, jycgid", ["vybpkz", "jycgid", "qkdcrl"]) == pytest.approx(2 / 3)


def test_a_ruler_task_refuses_a_context_its_example_and_list_cannot_fit(tokenizer):
    with pytest.raises(KvscopeError, match="needs at least"):
        W.prompts("cwe", tokenizer, context=256, samples=1)
