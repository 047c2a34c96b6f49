"""What the workload builders share: the text that ships with Python, and the meta keys a
builder's ``make(n)`` uses to hand [`prompts`][kvscope.workloads.prompts] more than a text.

    prose_text()                   the reference-manual topics of ``pydoc_data``, in a fixed order
    prose_sentences()              their sentences (40–300 characters)
    haystack_words(rng, n)         n words of consecutive sentences from a seeded start
    prose_words()                  the distinct lowercase words of 4–12 letters in them, sorted

Nothing here is downloaded: a seed gives the same text on every machine with the same Python.
"""

from __future__ import annotations

import functools
import random
import re

QUESTION_AT = "question_at"  # a builder's meta key: where the question starts (split prompts)
CONTINUATION = "continuation"  # a builder's meta key: the text that follows the prompt (prose, code)
ANSWER_PREFIX = "answer_prefix"  # a builder's meta key: the text the answer starts after (RULER)
ANSWERS = "answers"  # a builder's meta key: the accepted answers (RULER's ``outputs``)


@functools.cache
def prose_text() -> str:
    """The reference-manual topics that ship with Python, in a fixed order."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k].strip() for k in sorted(topics.topics))


@functools.cache
def _sentences() -> tuple[str, ...]:
    text = re.sub(r"\s+", " ", prose_text())
    return tuple(s.strip() + "." for s in re.split(r"(?<=[a-z])\. ", text) if 40 <= len(s) <= 300)


def prose_sentences() -> list[str]:
    """The reference manual's sentences of 40–300 characters, in order."""
    return list(_sentences())


def haystack_words(rng: random.Random, n_words: int) -> list[str]:
    """``n_words`` words of consecutive reference-manual sentences from a seeded start."""
    sentences = _sentences()
    start = rng.randrange(0, len(sentences))
    words: list[str] = []
    i = start
    while len(words) < n_words:
        words += sentences[i % len(sentences)].split()
        i += 1
    return words[:n_words]


@functools.cache
def prose_words() -> tuple[str, ...]:
    """The distinct words of the reference manual that are lowercase, alphabetic and 4–12 letters
    long (not part of an identifier, a dotted name or a hyphenated word), sorted: about 2,500
    with Python 3.12 — kvscope's stand-in for RULER's ``wonderwords`` lists."""
    return tuple(sorted(set(re.findall(r"(?<![\w.-])[a-z]{4,12}(?![\w-])", prose_text()))))
