"""RULER's synthetic tasks (Hsieh et al., 2024, *RULER: What's the Real Context Size of Your
Long-Context Language Models?*; NVIDIA/RULER ``scripts/synthetic.yaml``), built offline under
RULER's own names, from a seed, at any context length.

| name | RULER task | haystack | keys / values | needles k · v · q |
|---|---|---|---|---|
| ``niah_single_1`` | niah | noise | words / numbers | 1 · 1 · 1 |
| ``niah_single_2`` | niah | essay | words / numbers | 1 · 1 · 1 |
| ``niah_single_3`` | niah | essay | words / uuids | 1 · 1 · 1 |
| ``niah_multikey_1`` | niah | essay | words / numbers | 4 · 1 · 1 |
| ``niah_multikey_2`` | niah | needle | words / numbers | 1 · 1 · 1 |
| ``niah_multikey_3`` | niah | needle | uuids / uuids | 1 · 1 · 1 |
| ``niah_multivalue`` | niah | essay | words / numbers | 1 · 4 · 1 |
| ``niah_multiquery`` | niah | essay | words / numbers | 4 · 1 · 4 |
| ``vt`` | variable_tracking | noise | 1 chain of 4 hops | — |
| ``cwe`` | common_words_extraction | numbered word list | freq_cw 30, freq_ucw 3, num_cw 10 | — |
| ``fwe`` | freq_words_extraction | coded words, Zipf | alpha 2.0 | — |

Each task's recipe (``recipes/NAME.toml``) holds RULER's template, answer prefix and settings;
one builder per RULER task reads them. A builder's ``make(n)`` (``n``: haystack words, list words or
coded words) gives the text — the template with the context and the question, the question
marked (``QUESTION_AT``) — the answers (RULER's ``outputs``, also under ``ANSWERS``) and the
answer prefix (``ANSWER_PREFIX``), which the model receives after the chat template's
generation prompt, so that its output opens with the answer. Every task is scored with
``string_match_all`` ([`metrics`][kvscope.workloads.metrics]).

Where kvscope departs from RULER, and why:

* essay haystack: RULER downloads Paul Graham's essays; kvscope uses the reference-manual prose
  of ``pydoc_data`` (from a seeded start), split into sentences at words that end in ``.``,
  ``!`` or ``?`` (RULER: nltk's ``sent_tokenize``).
* words: RULER draws from ``wonderwords``' lists; kvscope from the reference manual's
  lowercase words of 4–12 letters ([`prose_words`][kvscope.workloads.sources.prose_words]).
  A ``words`` key is two of them joined by a hyphen (RULER: adjective-noun); ``cwe`` draws
  single words (those of its own template left out) and, for a list longer than the pool — where
  RULER turns to another list — hyphenated pairs of them for the words beyond.
* line haystacks (noise, needle) are counted in words (and parts of hyphenated words and uuids):
  their first line may start mid-line (a whole line of ~20–80 tokens is too coarse a step to
  land within 2%).
* ``vt``'s one-shot example fills at most 500 tokens as in RULER, and at most a quarter of the
  context (RULER's 500 would leave little of a short context).
* ``vt``'s answer prefix ends in a space in RULER; kvscope drops it (a tokenizer merges it into
  the answer's first token) and puts one space before the answer.
* length: the tokens the model receives before it answers — the prompt in its chat template,
  then the answer prefix (``kvscope.model.prompts.encode``) — are ``context`` (±2%); RULER fits prompt plus ``tokens_to_generate`` below its
  ``max_seq_length``. ``cwe`` uses RULER's short-sequence settings (frequencies 6 and 1, a
  smaller example) below ``short_context`` (4096) tokens, and ``fwe``'s vocabulary holds
  ``context // 50`` coded words, as RULER's below ``max_seq_length``.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections.abc import Callable

from ..errors import KvscopeError
from .sources import ANSWER_PREFIX, ANSWERS, QUESTION_AT, haystack_words, prose_words

DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER: np.round(np.linspace(0, 100, 40))
VALUE_KINDS = ("numbers", "words", "uuids")
HAYSTACKS = ("noise", "essay", "needle")


# -- shared pieces ------------------------------------------------------------------------------


def _draw(kind: str, rng: random.Random) -> str:
    """One key or value of ``kind``: a 7-digit number, two words joined by a hyphen, or a uuid."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        words = prose_words()
        return f"{rng.choice(words)}-{rng.choice(words)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise KvscopeError(f"RULER recipe: unknown needle type {kind!r} (one of {', '.join(VALUE_KINDS)})")


def _distinct(draw: Callable[[], str], k: int, avoid: frozenset = frozenset()) -> list[str]:
    """``k`` different draws, none in ``avoid``."""
    out: list[str] = []
    while len(out) < k:
        x = draw()
        if x not in out and x not in avoid:
            out.append(x)
    return out


def _sentences(words: list[str]) -> list[str]:
    """Words grouped into sentences, each ending at a word that ends in . ! or ?"""
    out, current = [], []
    for word in words:
        current.append(word)
        if word.endswith((".", "!", "?")):
            out.append(" ".join(current))
            current = []
    if current:
        out.append(" ".join(current))
    return out


def _at_depths(words: list[str], items: list[str], rng: random.Random) -> str:
    """RULER's essay haystack: ``items`` between sentences, at depths drawn from ``DEPTHS``."""
    sentences = _sentences(words)
    cuts = sorted(len(sentences) * depth // 100 for depth in rng.sample(DEPTHS, len(items)))
    parts, last = [], 0
    for cut, item in zip(cuts, items):
        parts += [" ".join(sentences[last:cut]), item]
        last = cut
    parts.append(" ".join(sentences[last:]))
    return " ".join(p for p in parts if p)


def _pieces(line: str) -> list[str]:
    """A line cut after each space and hyphen (a uuid is five pieces), so that joining gives it back."""
    return re.findall(r"[^ -]*[ -]|[^ -]+$", line)


def _line_window(n_pieces: int, next_line: Callable[[], str]) -> list[str]:
    """RULER's line haystacks (noise, needle) counted in pieces (words, and the parts of a
    hyphenated word or uuid): lines from ``next_line`` until they hold ``n_pieces``, the first one
    cut to its last pieces where they hold more (as if the haystack were a window onto a longer
    one: a whole line of ~20–80 tokens is too coarse a step to land within 2%)."""
    lines: list[str] = []
    held = 0
    while held < n_pieces:
        lines.append(next_line())
        if not lines[-1].strip():
            raise KvscopeError("RULER recipe: an empty haystack line (the recipe's noise?)")
        held += len(_pieces(lines[-1]))
    if held > n_pieces:
        lines[0] = "".join(_pieces(lines[0])[held - n_pieces :])
    return lines


def _between_lines(lines: list[str], items: list[str], rng: random.Random) -> list[str]:
    """RULER's line haystacks (noise, needle): each item inserted at its own seeded line index."""
    n = len(lines)
    at = rng.sample(range(n), len(items)) if n >= len(items) else [n] * len(items)
    for i, item in zip(sorted(at, reverse=True), items):
        lines.insert(i, item)
    return lines


def _render(template: str, answer_prefix: str, context: str, before: str = "", **fields) -> tuple[str, int, str]:
    """``(text, where the question starts, answer prefix)``: ``before`` (an example), then the
    template around ``context``; the question is what follows the context (newlines skipped).
    The answer prefix ends without whitespace (RULER's ``vt`` prefix ends in a space, which a
    tokenizer would merge into the answer's first token; kvscope puts one space before the answer)."""
    head, tail = template.split("{context}")
    head, tail = head.format(**fields), tail.format(**fields)
    text = before + head + context + tail
    return text, len(text) - len(tail.lstrip("\n")), answer_prefix.format(**fields).rstrip()


def _made(text: str, split: int, answer_prefix: str, answers: list[str], **meta) -> tuple[str, list[str], dict]:
    return text, list(answers), {**meta, QUESTION_AT: split, ANSWER_PREFIX: answer_prefix, ANSWERS: list(answers)}


def _check(recipe: dict, field: str, allowed: tuple[str, ...]) -> str:
    value = recipe[field]
    if value not in allowed:
        raise KvscopeError(f"RULER recipe: {field} = {value!r} (one of {', '.join(allowed)})")
    return value


# -- niah -----------------------------------------------------------------------------------------


def _singular(text: str) -> str:
    """RULER's rewording of the niah template when one value is asked for."""
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


def build_niah(recipe, tokenizer, rng, index):
    """RULER's needle in a haystack: ``num_needle_k`` keys with ``num_needle_v`` values each, hidden
    as "One of the special magic {type} for {key} is: {value}." in a haystack of noise sentences,
    essay prose or other needles; ``num_needle_q`` keys asked for, their values the answers."""
    haystack = _check(recipe, "type_haystack", HAYSTACKS)
    kind_k, kind_v = _check(recipe, "type_needle_k", VALUE_KINDS), _check(recipe, "type_needle_v", VALUE_KINDS)
    n_v, n_q = recipe["num_needle_v"], recipe["num_needle_q"]
    n_k = max(recipe["num_needle_k"], n_q)
    keys = _distinct(lambda: _draw(kind_k, rng), n_k)
    values = _distinct(lambda: _draw(kind_v, rng), n_k * n_v)
    values = [values[i * n_v : (i + 1) * n_v] for i in range(n_k)]
    needle = recipe["needle"]
    needles = [needle.format(type_needle_v=kind_v, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    asked = rng.sample(range(n_k), n_q)
    queries = [keys[i] for i in asked]
    answers = [v for i in asked for v in values[i]]
    query = queries[0] if n_q == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    template, prefix, kind = recipe["template"], recipe["answer_prefix"], kind_v
    if n_q * n_v == 1:
        template, prefix, kind = _singular(template), _singular(prefix), kind_v[:-1]
    seed = rng.randrange(1 << 30)
    taken = frozenset(keys)

    def make(n: int):
        r = random.Random(seed)
        if haystack == "essay":
            context = _at_depths(haystack_words(r, n), needles, r)
        else:
            if haystack == "noise":
                lines = _line_window(n, lambda: recipe["noise"])
            else:  # needle: distractor needles with other keys
                used = set(taken)

                def distractor() -> str:
                    (key,) = _distinct(lambda: _draw(kind_k, r), 1, frozenset(used))
                    used.add(key)
                    return needle.format(type_needle_v=kind_v, key=key, value=_draw(kind_v, r))

                lines = _line_window(n, distractor)
            context = "\n".join(_between_lines(lines, needles, r))
        text, split, answer_prefix = _render(template, prefix, context, type_needle_v=kind, query=query)
        return _made(text, split, answer_prefix, answers, task="niah", queries=queries, haystack=haystack)

    return make, None


# -- variable tracking --------------------------------------------------------------------------


def _letters(rng: random.Random, k: int) -> str:
    return "".join(rng.choices(string.ascii_uppercase, k=k))


def _chains(rng: random.Random, n_chains: int, hops: int, letters: int) -> list[tuple[list[str], int, list[str]]]:
    """``(variables, value, statements)`` per chain: VAR A = value, VAR B = VAR A , …"""
    names = _distinct(lambda: _letters(rng, letters), n_chains * (hops + 1))
    out = []
    for c in range(n_chains):
        chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        value = rng.randint(10_000, 99_998)
        statements = [f"VAR {chain[0]} = {value}"] + [f"VAR {b} = VAR {a} " for a, b in zip(chain, chain[1:])]
        out.append((chain, value, statements))
    return out


def _vt_context(recipe: dict, chains: list[list[str]], n: int, rng: random.Random) -> str:
    """The chains' statements in ``n`` units of haystack, each chain in its order."""
    if recipe["type_haystack"] == "noise":
        lines = _line_window(n, lambda: recipe["noise"])
        for statements in chains:
            if len(lines) >= len(statements):
                at = sorted(rng.sample(range(len(lines)), len(statements)))
            else:
                at = [len(lines)] * len(statements)
            for j, (i, statement) in enumerate(zip(at, statements)):
                lines.insert(i + j, statement)
        return "\n".join(lines).replace(". \n", ".\n")
    pending = [list(s) for s in chains]  # essay: a seeded merge of the chains, each in its order
    merged = []
    while any(pending):
        merged.append(rng.choice([p for p in pending if p]).pop(0).strip() + ".")
    return _at_depths(haystack_words(rng, n), merged, rng)


def _vt_example(recipe: dict, tokenizer, rng: random.Random) -> str:
    """RULER's one-shot example: a solved chain (3-letter names, at most 10 hops) in as much noise
    as fits ``example_tokens`` (at most ``example_share`` of the context), then a blank line."""
    hops = min(10, recipe["num_hops"])
    ((names, value, statements),) = _chains(rng, 1, hops, 3)
    seed = rng.randrange(1 << 30)
    budget = min(recipe["example_tokens"], int(recipe["example_share"] * recipe["context"]))

    def example(m: int) -> str:
        context = _vt_context(recipe, [statements], m, random.Random(seed))
        text, _, prefix = _render(recipe["template"], recipe["answer_prefix"], context, query=value, num_v=hops + 1)
        return text + prefix + " " + " ".join(names) + "\n"

    def tokens(m: int) -> int:
        return len(tokenizer(example(m), add_special_tokens=False)["input_ids"])

    lo, hi = 0, 1  # the most noise words whose example fits the budget
    while tokens(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if tokens(mid) <= budget else (lo, mid)
    return example(lo) + "\n"


def build_vt(recipe, tokenizer, rng, index):
    """RULER's variable tracking: ``num_chains`` chains of ``num_hops`` assignments hidden in
    noise (or essay prose) after a solved example; the answers are the variables of the first
    chain, which all hold its value."""
    _check(recipe, "type_haystack", ("noise", "essay"))
    hops = recipe["num_hops"]
    chains = _chains(rng, recipe["num_chains"], hops, 5)
    names, value, _ = chains[0]
    example = _vt_example(recipe, tokenizer, rng)
    seed = rng.randrange(1 << 30)

    def make(n: int):
        context = _vt_context(recipe, [s for _, _, s in chains], n, random.Random(seed))
        text, split, prefix = _render(
            recipe["template"], recipe["answer_prefix"], context, before=example, query=value, num_v=hops + 1
        )
        return _made(text, split, prefix, names, task="variable_tracking", value=value, hops=hops)

    return make, None


# -- common words extraction --------------------------------------------------------------------


def _words(rng: random.Random, pool: tuple[str, ...], k: int) -> list[str]:
    """``k`` different words of ``pool`` in a seeded order; beyond the words it holds, different
    hyphenated pairs of them (the list grows smoothly with ``k``)."""
    if k <= len(pool):
        return rng.sample(pool, k)
    return rng.sample(pool, len(pool)) + _distinct(lambda: f"{rng.choice(pool)}-{rng.choice(pool)}", k - len(pool))


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def _word_list(rng, pool, n_words: int, *, freq_cw: int, freq_ucw: int, num_cw: int) -> tuple[str, list[str]]:
    """RULER's numbered list: ``num_cw`` words ``freq_cw`` times each, the other ``n_words − num_cw``
    ``freq_ucw`` times each, shuffled; and the common words."""
    words = _words(rng, pool, n_words)
    common, uncommon = words[:num_cw], words[num_cw:]
    entries = common * freq_cw + uncommon * freq_ucw
    rng.shuffle(entries)
    return _numbered(entries), common


def build_cwe(recipe, tokenizer, rng, index):
    """RULER's common words extraction: a numbered list in which ``num_cw`` words appear
    ``freq_cw`` times and the others ``freq_ucw`` times, after a solved example; the answers are
    the ``num_cw`` common words. Below ``short_context`` tokens, RULER's short settings."""
    short = recipe["context"] < recipe["short_context"]
    freq_cw, freq_ucw = recipe["short_freq"] if short else (recipe["freq_cw"], recipe["freq_ucw"])
    example_words, example_cw, example_ucw = recipe["short_example"] if short else recipe["example"]
    num_cw = recipe["num_cw"]
    template, prefix = recipe["template"], recipe["answer_prefix"]
    own = set(re.findall(r"[a-z]+", (template + prefix).lower()))
    pool = tuple(w for w in prose_words() if w not in own)
    shots = []
    for _ in range(recipe["num_fewshot"]):
        context, common = _word_list(rng, pool, example_words, freq_cw=example_cw, freq_ucw=example_ucw, num_cw=num_cw)
        text, _, answer_prefix = _render(template, prefix, context, num_cw=num_cw)
        shots.append(text + answer_prefix + " " + _numbered(common))
    before = "".join(shot + "\n" for shot in shots)
    seed = rng.randrange(1 << 30)

    def make(n: int):
        r = random.Random(seed)
        context, common = _word_list(r, pool, num_cw + n, freq_cw=freq_cw, freq_ucw=freq_ucw, num_cw=num_cw)
        text, split, answer_prefix = _render(template, prefix, context, before=before, num_cw=num_cw)
        meta = {"task": "common_words_extraction", "freq_cw": freq_cw, "freq_ucw": freq_ucw, "words": num_cw + n}
        return _made(text, split, answer_prefix, common, **meta)

    return make, None


# -- frequent words extraction ------------------------------------------------------------------


def build_fwe(recipe, tokenizer, rng, index):
    """RULER's frequent words extraction: coded words (``coded_wordlen`` random letters) drawn with
    Zipf frequencies ``∝ k^−alpha`` by rank; the top rank is noise (``...``), and the answers are
    the three coded words of ranks 2–4."""
    from scipy.special import zeta

    alpha, letters = float(recipe["alpha"]), recipe["coded_wordlen"]
    size = recipe["vocab_size"] if recipe["vocab_size"] > 0 else recipe["context"] // 50
    size = max(size, 5)
    vocab = sorted(_distinct(lambda: "".join(rng.choices(string.ascii_lowercase, k=letters)), size))
    rng.shuffle(vocab)
    vocab[0] = "..."  # the top rank is noise
    answers = vocab[1:4]
    z = float(zeta(alpha))
    seed = rng.randrange(1 << 30)

    def make(n: int):
        words = [w for k, w in enumerate(vocab, 1) for _ in range(int(n * k**-alpha / z))]
        random.Random(seed).shuffle(words)
        text, split, prefix = _render(recipe["template"], recipe["answer_prefix"], " ".join(words))
        return _made(text, split, prefix, answers, task="freq_words_extraction", vocab_size=size, words=len(words))

    return make, None


BUILDERS = {"niah": build_niah, "variable_tracking": build_vt, "common_words_extraction": build_cwe,
            "freq_words_extraction": build_fwe}  # fmt: skip
TASKS = [
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
]  # fmt: skip


def build(recipe, tokenizer, rng, index):
    """The builder of the recipe's RULER ``task`` (niah, variable_tracking, …)."""
    if recipe.get("task") not in BUILDERS:
        raise KvscopeError(f"RULER recipe: task = {recipe.get('task')!r} (one of {', '.join(BUILDERS)})")
    return BUILDERS[recipe["task"]](recipe, tokenizer, rng, index)
