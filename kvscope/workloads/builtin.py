"""Workloads: deterministic, offline prompt sets cut to a requested token length.

    available()                                  {name: Workload}
    prompts("niah", tokenizer, context=2048, seed=0, samples=3, chat=True)  → [Prompt]
    score("niah", output_text, expected)         → task score in [0, 1]

Every workload reads its recipe (context, samples, templates) from ``kvscope/workloads/recipes/NAME.toml``
(package data, read with ``importlib.resources``);
the text comes from what ships with Python — the reference-manual topics of ``pydoc_data``
(prose, haystacks) and standard-library source files (code) — so nothing is downloaded and a
seed gives the same prompts on every machine with the same Python. A prompt's length is
counted in the tokens the model receives (chat template included when the workload is a
chat task) and lands within 2% of ``context``.

| name | task | scorer |
|---|---|---|
| ``prose`` | continue reference-manual prose | — |
| ``code`` | continue standard-library source | — |
| ``niah`` | RULER-style needle in a haystack: single, multi-key, multi-value | share of the expected numbers in the answer |
| ``vt_chains`` | RULER-style variable tracking: the asked chain among distractor chains | share of the chain's variables in the answer |
| ``reasoning`` | few-shot multi-step arithmetic | 1 if the final number is right |
| ``passkey`` | pass-key retrieval in repeated filler (Landmark Attention) | 1 if the key is in the answer |
| RULER's 11 (``niah_single_1`` … ``vt``, ``cwe``, ``fwe``) | RULER's synthetic tasks (``.ruler``) | ``string_match_all`` |

``niah``, ``passkey`` and RULER's tasks come split (``Prompt.context`` / ``Prompt.question``): the question
starts where the template asks it, so ``--question-agnostic`` compresses the haystack before it.
RULER's tasks also carry ``Prompt.answer_prefix`` (the text the answer starts after, placed after
the chat template's generation prompt) and ``Prompt.answers`` (= ``Prompt.expected``); their
``context`` counts the answer prefix's tokens too.

``prose`` and ``code`` continue a text, and with ``continuation_tokens = N`` (the recipe's field, or
``prompts(…, continuation_tokens=N)``, ``trace --continuation-tokens N``) each prompt carries the text of
the ``N`` tokens that follow it as its ``Prompt.continuation``: a trace forces that text as its decode
steps (perplexity of the real continuation, position by position).
"""

from __future__ import annotations

import ast
import importlib.resources
import importlib.util
import operator
import random
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import KvscopeError
from ..model.prompts import Prompt, encode
from . import ruler
from .metrics import string_match_all
from .sources import ANSWER_PREFIX, ANSWERS, CONTINUATION, QUESTION_AT, haystack_words, prose_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

RECIPES = importlib.resources.files("kvscope.workloads") / "recipes"
TOLERANCE = 0.02


@dataclass(frozen=True)
class Workload:
    """A built-in workload: its recipe (``recipes/NAME.toml``), how its prompts are built, and
    how an answer is scored.

    Attributes:
        name: The workload's name (``kvscope trace --workload NAME``).
        build: ``build(recipe, tokenizer, rng, sample index) → (make, available tokens)``, where
            ``make(n)`` gives ``(text, expected, meta)`` with ``n`` units of filler.
        scorer: ``scorer(output, expected) → score in [0, 1]`` (None: no task score).
        continues: Its prompts are cut from a longer text, whose next ``continuation_tokens``
            tokens ``make`` gives as the prompt's continuation (``CONTINUATION`` in ``meta``).
    """

    name: str
    build: Callable
    scorer: Callable[[str, object], float] | None = None
    continues: bool = False

    @property
    def recipe(self) -> dict:
        """The recipe: context, samples, max_new_tokens, chat, templates."""
        return load_recipe(self.name)

    @property
    def description(self) -> str:
        """The recipe's one-line description."""
        return self.recipe.get("description", "")


def load_recipe(name: str) -> dict:
    """The recipe ``recipes/NAME.toml`` of a workload.

    Args:
        name: The workload's name.

    Raises:
        KvscopeError: The recipe is missing.
    """
    path = RECIPES / f"{name}.toml"
    if not path.is_file():
        raise KvscopeError(f"workload recipe {path} is missing")
    with path.open("rb") as f:
        return tomllib.load(f)


# -- text sources (prose: see .sources) ---------------------------------------------------------


def code_text(modules: list[str], rng: random.Random) -> str:
    order = list(modules)
    rng.shuffle(order)
    parts = []
    for name in order:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        parts.append(f"# ---- {name}.py ----\n" + Path(spec.origin).read_text(encoding="utf-8"))
    return "\n\n".join(parts)


# -- builders: each returns a function of the amount of filler --------------------------------


_TOKENIZED: dict = {}


def _token_ids(tokenizer, text: str) -> list[int]:
    key = (getattr(tokenizer, "name_or_path", id(tokenizer)), len(tokenizer), hash(text))
    if key not in _TOKENIZED:
        _TOKENIZED[key] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return _TOKENIZED[key]


def _continuation(text: str, rng: random.Random, tokenizer, follow: int = 0):
    """``n`` consecutive tokens of ``text`` from a seeded start; with ``follow``, the text of the
    ``follow`` tokens after them too (the start moved back where the text would end first, so a
    prompt is the same with and without them wherever they fit)."""
    ids = _token_ids(tokenizer, text)

    def make(n: int):
        start = min(rng_start % max(1, len(ids) - n), max(0, len(ids) - n - follow))
        meta = {"start_token": start}
        if follow:
            meta[CONTINUATION] = tokenizer.decode(ids[start + n : start + n + follow])
        return tokenizer.decode(ids[start : start + n]), None, meta

    rng_start = rng.randrange(0, 1 << 30)
    return make, len(ids) - follow


def build_prose(recipe, tokenizer, rng, index):
    return _continuation(prose_text(), rng, tokenizer, recipe.get("continuation_tokens", 0))


def build_code(recipe, tokenizer, rng, index):
    return _continuation(code_text(recipe["modules"], rng), rng, tokenizer, recipe.get("continuation_tokens", 0))


def _repeated_sentences(text: str, n: int) -> list[str]:
    """``n`` sentences of ``text`` (split at periods) repeated in order: RULER's noise filler."""
    sentences = [x.strip() + "." for x in text.split(".") if x.strip()]
    return [sentences[i % len(sentences)] for i in range(n)]


def build_niah(recipe, tokenizer, rng, index):
    variant = recipe["variants"][index % len(recipe["variants"])]
    keys = rng.sample(recipe["keys"], recipe["n_keys"] if variant == "multikey" else 1)
    key = keys[0]
    n_values = recipe["n_values"] if variant == "multivalue" else 1
    needles = [(key, rng.randrange(1_000_000, 10_000_000)) for _ in range(n_values)]
    needles += [(k, rng.randrange(1_000_000, 10_000_000)) for k in keys[1:]]
    depths = [rng.random() for _ in needles]
    expected = [str(v) for k, v in needles if k == key]
    question = recipe["question"].format(key=key)
    hay_seed = rng.randrange(0, 1 << 30)

    def make(n: int):
        hay = haystack_words(random.Random(hay_seed), n)
        ends = [i + 1 for i, word in enumerate(hay) if word.endswith(".")] or [len(hay)]
        for (k, v), depth in sorted(zip(needles, depths), key=lambda x: -x[1]):
            at = next((e for e in ends if e >= depth * len(hay)), len(hay))  # after a sentence
            hay.insert(at, recipe["needle"].format(key=k, value=v))
        text = recipe["template"].format(haystack=" ".join(hay), question=question, key=key)
        meta = {"variant": variant, "key": key, "depths": [round(d, 3) for d in depths]}
        return text, expected, {**meta, QUESTION_AT: text.rindex(question)}

    return make, None


def build_vt_chains(recipe, tokenizer, rng, index):
    def name():
        return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))

    chains = []
    values = rng.sample(range(10_000, 100_000), recipe["chains"] + 1)
    for value in values:
        names = [name() for _ in range(recipe["hops"] + 1)]
        lines = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        chains.append((value, names, lines))
    value, names, _ = chains[0]
    # a seeded merge of the chains (each chain keeps its order) placed at sorted depths
    pending = [list(lines) for _, _, lines in chains]
    merged = []
    while any(pending):
        merged.append(rng.choice([p for p in pending if p]).pop(0))
    depths = sorted(rng.random() for _ in merged)

    def make(n: int):
        body = _repeated_sentences(recipe["noise"], n)
        for statement, depth in sorted(zip(merged, depths), key=lambda x: -x[1]):
            body.insert(round(depth * n), statement)
        text = recipe["template"].format(body=" ".join(body), value=value, n=len(names))
        meta = {"value": value, "hops": recipe["hops"], "chains": recipe["chains"]}
        return text, names, {**meta, QUESTION_AT: text.rindex(recipe["question_marker"])}

    return make, None


def build_passkey(recipe, tokenizer, rng, index):
    key = rng.randrange(10_000, 100_000)
    depth = rng.random()
    question = recipe["question"]

    def make(n: int):
        body = _repeated_sentences(recipe["filler"], n)
        body.insert(round(depth * n), recipe["needle"].format(key=key))
        text = recipe["template"].format(body=" ".join(body), question=question)
        return text, [str(key)], {"depth": round(depth, 3), QUESTION_AT: text.rindex(question)}

    return make, None


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def evaluate(expression: str, names: dict[str, int]) -> int:
    """Integer arithmetic with + - * // and parentheses over ``names`` (nothing else): the
    ``reasoning`` recipes' answers.

    Args:
        expression: The expression (``"a * b + c"``).
        names: The value of each name.

    Raises:
        KvscopeError: Anything but integers, names, + - * // and parentheses.
    """

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Name) and node.id in names:
            return int(names[node.id])
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise KvscopeError(f"recipe expression {expression!r}: only integers, names, + - * // allowed")

    return ev(ast.parse(expression, mode="eval"))


def _problem(recipe, rng):
    p = rng.choice(recipe["problems"])
    names = {k: rng.randint(lo, hi) for k, (lo, hi) in p["ranges"].items()}
    for k, expr in p.get("define", {}).items():
        names[k] = evaluate(expr, names)
    names["answer"] = evaluate(p["answer"], names)
    return p["text"].format(**names), p["steps"].format(**names), names["answer"]


def build_reasoning(recipe, tokenizer, rng, index):
    """Solved examples fill the context: the last ``n`` words of a long run of them (so the
    context may open mid-example, as a sliding window would), then the asked problem."""
    question, _, answer = _problem(recipe, rng)
    r = random.Random(rng.randrange(0, 1 << 30))
    shots: list[str] = []

    def make(n: int):
        while len("\n\n".join(shots).split(" ")) < n:
            q, steps, a = _problem(recipe, r)
            shots.insert(0, f"Problem: {q}\nSolution: {steps} The answer is {a}.")
        words = "\n\n".join(shots).split(" ")
        context = " ".join(words[len(words) - n :]) if n else ""
        text = "\n\n".join(x for x in (recipe["instruction"], context, f"Problem: {question}\nSolution:") if x)
        return text, str(answer), {"shot_words": n}

    return make, None


# -- scorers ------------------------------------------------------------------------------------


def score_all_present(output: str, expected) -> float:
    """RULER's string-match-all: the share of expected strings that occur in the output."""
    expected = [expected] if isinstance(expected, str) else list(expected)
    if not expected:
        return 0.0
    return sum(1.0 for e in expected if str(e) in output) / len(expected)


def score_final_number(output: str, expected) -> float:
    """1 when the number after 'The answer is' (else the last number) equals the answer."""
    found = re.findall(r"answer is\s*\$?(-?[\d,]+)", output, flags=re.IGNORECASE)
    numbers = found or re.findall(r"-?\d[\d,]*", output)
    if not numbers:
        return 0.0
    return 1.0 if numbers[-1].replace(",", "") == str(expected) else 0.0


WORKLOADS = {
    "prose": Workload("prose", build_prose, continues=True),
    "code": Workload("code", build_code, continues=True),
    "niah": Workload("niah", build_niah, score_all_present),
    "vt_chains": Workload("vt_chains", build_vt_chains, score_all_present),
    "reasoning": Workload("reasoning", build_reasoning, score_final_number),
    "passkey": Workload("passkey", build_passkey, score_all_present),
    **{name: Workload(name, ruler.build, string_match_all) for name in ruler.TASKS},  # RULER's, by RULER's names
}


def available() -> dict[str, Workload]:
    """Every built-in workload by name."""
    return dict(WORKLOADS)


def get(name: str) -> Workload:
    """The workload ``name``.

    Args:
        name: A built-in workload's name.

    Raises:
        KvscopeError: No such workload (the message lists them).
    """
    if name not in WORKLOADS:
        raise KvscopeError(f"unknown workload {name!r} (available: {', '.join(WORKLOADS)})")
    return WORKLOADS[name]


def count_tokens(tokenizer: PreTrainedTokenizerBase, text: str, chat: bool, answer_prefix: str | None = None) -> int:
    """Tokens the model receives for ``text`` (as ``kvscope trace`` encodes it), with its
    ``answer_prefix`` after the chat template's generation prompt where it has one: what the model
    has read when it starts the answer.

    Args:
        tokenizer: The model's tokenizer.
        text: The prompt.
        chat: Wrapped in the model's chat template.
        answer_prefix: The text the answer starts after (RULER's tasks), if any.
    """
    return len(encode(tokenizer, [Prompt(text, "count", answer_prefix=answer_prefix)], chat)[0])


def _fit(make, tokenizer, *, chat: bool, context: int, limit: int | None):
    """The filler amount whose prompt (with its answer prefix) is closest to ``context`` tokens
    (monotone search)."""
    sizes: dict[int, int] = {}

    def size(n: int) -> int:
        if n not in sizes:
            text, _, meta = make(n)
            sizes[n] = count_tokens(tokenizer, text, chat, meta.get(ANSWER_PREFIX)) if text else 0
        return sizes[n]

    smallest = size(0)
    if smallest > context * (1 + TOLERANCE):
        raise KvscopeError(f"this workload needs at least {smallest} tokens; asked for --context {context}")
    lo, hi = 0, 1
    while size(hi) < context:
        lo, hi = hi, hi * 2
        if limit is not None and hi >= limit:
            hi = limit
            break
        if hi > 1 << 22:
            raise KvscopeError(f"cannot build a prompt of {context} tokens")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if size(mid) < context:
            lo = mid
        else:
            hi = mid
    best = min((lo, hi), key=lambda n: abs(size(n) - context))
    return make(best)


def prompts(
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    context: int | None = None,
    seed: int = 0,
    samples: int | None = None,
    chat: bool | None = None,
    continuation_tokens: int | None = None,
) -> list[Prompt]:
    """``samples`` prompts of workload ``name``, each ``context`` tokens (±2%) as the model
    receives them; ``Prompt.expected`` holds the answer a scorer grades against.

    Args:
        name: The workload.
        tokenizer: The model's tokenizer (lengths are counted in its tokens).
        context: Tokens per prompt (default: the recipe's; at least 64).
        seed: The seed: the same seed gives the same prompts.
        samples: Prompts (default: the recipe's).
        chat: Count with the chat template (default: the recipe's).
        continuation_tokens: A workload that continues a text (``prose``, ``code``): each prompt's
            ``Prompt.continuation`` is the text of the next ``continuation_tokens`` tokens
            (default: the recipe's, 0: none).

    Raises:
        KvscopeError: A length or count out of range, or one the workload's text cannot reach.
    """
    workload = get(name)
    follow = _continuation_tokens(workload, continuation_tokens)
    recipe = {**workload.recipe, "continuation_tokens": follow}
    context = int(context or recipe["context"])
    recipe["context"] = context  # the builders see the length asked for (RULER's sizes depend on it)
    samples = int(samples or recipe.get("samples", 1))
    chat = recipe.get("chat", False) if chat is None else chat
    if context < 64:
        raise KvscopeError(f"--context must be at least 64 tokens (got {context})")
    if samples < 1:
        raise KvscopeError(f"--samples must be ≥ 1 (got {samples})")
    out = []
    for index in range(samples):
        rng = random.Random(f"{name}:{seed}:{index}")
        make, available_tokens = workload.build(recipe, tokenizer, rng, index)
        if available_tokens is not None and available_tokens < context:
            more = f" before the {follow} that continue it" if follow else ""
            raise KvscopeError(f"workload {name} has only {available_tokens} tokens of text{more}; asked for {context}")
        text, expected, meta = _fit(make, tokenizer, chat=chat, context=context, limit=available_tokens)
        split = meta.pop(QUESTION_AT, None)
        continuation = meta.pop(CONTINUATION, None)
        answer_prefix = meta.pop(ANSWER_PREFIX, None)
        answers = meta.pop(ANSWERS, None)
        n = count_tokens(tokenizer, text, chat, answer_prefix)
        if abs(n - context) > TOLERANCE * context:
            raise KvscopeError(f"workload {name}: could not reach {context} tokens (got {n})")
        out.append(
            Prompt(
                text,
                f"workload:{name}:seed={seed}:sample={index}",
                expected=expected,
                meta={"workload": name, "seed": seed, "context": context, "tokens": n, **meta},
                split=split,
                continuation=continuation,
                answer_prefix=answer_prefix,
                answers=answers,
            )
        )
    return out


def _continuation_tokens(workload: Workload, given: int | None) -> int:
    """The continuation tokens asked for (``given``, else the recipe's), refused where the
    workload does not continue a text."""
    n = workload.recipe.get("continuation_tokens", 0) if given is None else given
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise KvscopeError(f"--continuation-tokens must be an integer ≥ 0 (got {n!r})")
    if n and not workload.continues:
        continuing = ", ".join(w.name for w in WORKLOADS.values() if w.continues)
        raise KvscopeError(
            f"--continuation-tokens: workload {workload.name} does not continue a text (only {continuing} do)"
        )
    return n


def score(name: str, output: str, expected: object) -> float | None:
    """The workload's task score of one generated text (None without a scorer).

    Args:
        name: The workload.
        output: The generated text.
        expected: The prompt's ``Prompt.expected``.
    """
    workload = get(name)
    return None if workload.scorer is None else float(workload.scorer(output, expected))


def prompts_for_model(
    name: str,
    model: str,
    *,
    context: int | None = None,
    seed: int = 0,
    samples: int | None = None,
    chat: bool | None = None,
    max_new_tokens: int = 0,
    trust_remote_code: bool = False,
    continuation_tokens: int | None = None,
) -> list[Prompt]:
    """[`prompts`][kvscope.workloads.prompts] with the tokenizer of ``model``; refuses a
    context that, with ``max_new_tokens``, does not fit the model before building anything.

    Args:
        name: The workload.
        model: The model as ``--model`` names it.
        context: Tokens per prompt (default: the recipe's).
        seed: The seed.
        samples: Prompts (default: the recipe's).
        chat: Count with the chat template (default: the recipe's).
        max_new_tokens: Decode steps that must fit the model's context too.
        trust_remote_code: Let transformers run the model folder's tokenizer code.
        continuation_tokens: Tokens of the text that continues each prompt (``prompts``).
    """
    import json

    from ..model.loading import load_tokenizer, resolve

    workload = get(name)
    context = int(context or workload.recipe["context"])
    follow = _continuation_tokens(workload, continuation_tokens)
    if follow:  # the forced steps: the continuation, at most max_new_tokens of it
        max_new_tokens = min(max_new_tokens, follow) if max_new_tokens else follow
    source = resolve(model)
    config = Path(source.load_path) / "config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        cfg = cfg.get("text_config", cfg)
        limit = cfg.get("max_position_embeddings")
        if limit and context + max_new_tokens > limit:
            raise KvscopeError(
                f"--context {context} + --max-new-tokens {max_new_tokens} exceeds the model context of {limit}"
            )
    tokenizer = load_tokenizer(source, trust_remote_code)
    return prompts(
        name, tokenizer, context=context, seed=seed, samples=samples, chat=chat, continuation_tokens=follow
    )  # fmt: skip
