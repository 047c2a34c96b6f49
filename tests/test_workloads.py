"""Workloads: deterministic for a seed, the requested token length (±2%), scorers that grade
known-correct and known-wrong answers, a few traced steps of each via subprocess, bad input."""

from __future__ import annotations

import json

import pytest

from kvscope import workloads as W
from kvscope.errors import KvscopeError

from .conftest import run_cli, run_main

NAMES = ["prose", "code", "niah", "vt", "reasoning", "passkey"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("context", [512, 2048])
def test_requested_length_within_two_percent(tokenizer, name, context):
    chat = W.load_recipe(name).get("chat", False)
    for p in W.prompts(name, tokenizer, context=context, seed=3):
        n = W.count_tokens(tokenizer, p.text, chat)
        assert abs(n - context) <= 0.02 * context, (name, n)
        assert p.meta["tokens"] == n and p.meta["workload"] == name


@pytest.mark.parametrize("name", NAMES)
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


def test_vt_chain_resolves_to_the_asked_value(tokenizer):
    (p, *_) = W.prompts("vt", tokenizer, context=1024, seed=2)
    value = p.meta["value"]
    assigned = {}
    for statement in [s for s in p.text.split(". ") if s.startswith("VAR ")]:
        name, rhs = statement[4:].rstrip(".").split(" = ")
        assigned[name] = assigned[rhs[4:]] if rhs.startswith("VAR ") else int(rhs)
    holders = sorted(n for n, v in assigned.items() if v == value)
    assert holders == sorted(p.expected) and len(holders) == p.meta["hops"] + 1


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
    assert W.score("vt", "ABCDE, FGHIJ, KLMNO", ["ABCDE", "FGHIJ", "KLMNO", "PQRST"]) == 0.75
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
    assert [r["name"] for r in rows] == NAMES
    assert {r["name"]: r["scorer"] is not None for r in rows} == {
        "prose": False, "code": False, "niah": True, "vt": True, "reasoning": True, "passkey": True,
    }  # fmt: skip
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
