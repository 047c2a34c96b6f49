"""Prompts: where they come from, how they become token ids, when generation stops.

as_prompts("text" | ["a", "b"] | [Prompt, …])   → [Prompt]
has_answers(doc)                                whether a stored prompt entry carries answers (forced)
load_continuation_file("next.txt")              → str        (trace --continuation FILE)
json_objects(text, where)                       → [(line, object)]   JSON lines (prompts files, datasets)
load_prompts_file("prompts.jsonl")              → [Prompt]   one {"prompt" | "text": …} or
                                                             {"context": …, "question": …} per line
                                                             (and a "continuation" on every line or none)
encode(tokenizer, prompts, chat)                → [[token id, …], …]   (chat template when asked;
                                                             then the answer prefix, if any)
encode_split(tokenizer, prompts, chat)          → [(context ids, question ids), …]  (--question-agnostic)
encode_prompts(tokenizer, prompts, chat, qa)    → (prefill ids, forced question ids) per prompt
answer_ids(tokenizer, prompt)                   → the gold answer's ids as the model continues the prefix
encode_answers(tokenizer, prompts)              → answer_ids of every prompt (None: no answers)
with_continuations(prompts, text | [text, …])   → the prompts with a given continuation each
continuations(prompts)                          → the forced texts (given continuations or gold
                                                             answers, every prompt's), or None
encode_continuations(tokenizer, prompts, cap)   → the ids forced as the decode steps, or None
check_context(encoded, max_new_tokens, context) refuses prompts that do not fit the model
eos_ids(model, tokenizer)                       the ids that end generation
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import KvscopeError, parse_json


@dataclass
class Prompt:
    """One prompt: its text, where it came from, where its question starts (if it has one), and
    the text that continues it (if given).

    Attributes:
        text: The whole prompt (context and question).
        source: Where it came from (``cli``, a file and line, ``workload:NAME:…``).
        expected: A workload's answer (what its scorer grades against).
        meta: A workload's details (seed, context, tokens, …).
        split: Where the question starts in ``text`` (characters); None: no question.
        continuation: A given continuation: ``kvscope trace`` forces its tokens as the decode
            steps instead of the model's own (teacher forcing); None: the model decodes.
        answer_prefix: The text the answer starts after (RULER's and kvpress's protocol: "… The
            special magic number for X mentioned in the provided text is"), placed after the chat
            template's generation prompt, so that the answer is the head of the output; None: none.
        answers: The accepted answers of a task prompt (the first is the gold answer forced
            offline); None: no answer known.
    """

    text: str
    source: str = "cli"
    expected: object = None
    meta: dict = field(default_factory=dict)
    split: int | None = None
    continuation: str | None = None
    answer_prefix: str | None = None
    answers: list[str] | None = None

    def __post_init__(self):
        if self.continuation is not None and self.answers is not None:
            raise KvscopeError(
                f"the prompt from {self.source} has both a continuation and answers: a trace forces one text as its "
                "decode steps (the gold answer where answers are given); give one of them"
            )
        if self.split is not None and not (isinstance(self.split, int) and 0 < self.split < len(self.text)):
            raise KvscopeError(
                f"prompt from {self.source}: its question must start inside the text (split {self.split!r})"
            )
        _check_text(self.text, f"prompt from {self.source}")
        if self.continuation is not None:
            _check_text(self.continuation, f"the continuation of the prompt from {self.source}")
            if not self.continuation:
                raise KvscopeError(f"the continuation of the prompt from {self.source} is empty")
        if self.answer_prefix is not None:
            _check_text(self.answer_prefix, f"the answer prefix of the prompt from {self.source}")
        if self.answers is not None:
            if isinstance(self.answers, str) or not self.answers:
                raise KvscopeError(f"the prompt from {self.source} needs a non-empty list of accepted answers")
            for answer in self.answers:
                _check_text(answer, f"an answer of the prompt from {self.source}")
                if not answer.strip():
                    raise KvscopeError(f"the prompt from {self.source} has an empty answer")

    def doc(self) -> dict:
        """What the store's ``prompts`` attribute holds for this prompt."""
        out = {"text": self.text, "source": self.source}
        if self.expected is not None:
            out["expected"] = self.expected
        if self.meta:
            out["meta"] = self.meta
        if self.split is not None:
            out["split"] = self.split
        if self.continuation is not None:
            out["continuation"] = self.continuation
        if self.answer_prefix is not None:
            out["answer_prefix"] = self.answer_prefix
        if self.answers is not None:
            out["answers"] = list(self.answers)
        return out

    @classmethod
    def from_doc(cls, doc: dict) -> Prompt:
        """The inverse of [`doc`][kvscope.model.prompts.Prompt.doc] (prompts read back from a store).

        Args:
            doc: One entry of a store's ``prompts`` attribute.
        """
        return cls(
            doc["text"], doc.get("source", "cli"), doc.get("expected"), meta=doc.get("meta") or {},
            split=doc.get("split"), continuation=doc.get("continuation"), answer_prefix=doc.get("answer_prefix"),
            answers=doc.get("answers"),
        )  # fmt: skip

    @classmethod
    def split_at(cls, context: str, question: str, source: str = "cli", **fields: object) -> Prompt:
        """A prompt whose text is ``context + question`` with the question marked.

        Args:
            context: The context.
            question: The question.
            source: Where it came from.
            **fields: ``expected``, ``meta``, ``continuation``, ``answer_prefix`` and ``answers``.
        """
        return cls(context + question, source, split=len(context), **fields)

    @property
    def context(self) -> str:
        """The text before the question (all of it without one)."""
        return self.text if self.split is None else self.text[: self.split]

    @property
    def question(self) -> str | None:
        """The question (None without one)."""
        return None if self.split is None else self.text[self.split :]


def has_answers(doc) -> bool:
    """Whether an entry of a store's ``prompts`` attribute (``Prompt.doc``) carries accepted
    answers: its trace forced the gold answer's tokens as the sample's decode steps."""
    return isinstance(doc, dict) and bool(doc.get("answers"))


def task_of(doc) -> str:
    """The task of an entry of a store's ``prompts`` attribute: its ``meta``'s ``task`` (a
    ``trace --dataset`` row's), else its workload; ``""`` for neither."""
    meta = _meta(doc)
    return str(meta.get("task") or meta.get("workload") or "")


def question_of(doc) -> int:
    """The index of an entry of a store's ``prompts`` attribute among its context's questions: its
    ``meta``'s ``question`` (a ``trace --dataset`` row's), 0 for a prompt without one."""
    return int(_meta(doc).get("question") or 0)


def _meta(doc) -> dict:
    """The ``meta`` of an entry of a store's ``prompts`` attribute ({} where it has none)."""
    meta = doc.get("meta") if isinstance(doc, dict) else None
    return meta if isinstance(meta, dict) else {}


def _check_text(text, what: str) -> None:
    """``text`` is a ``str`` that encodes as UTF-8 (``what`` names it in the refusal)."""
    if not isinstance(text, str):
        raise KvscopeError(f"{what} is not text (got {type(text).__name__})")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # argv carries undecodable bytes as surrogate escapes
        raise KvscopeError(f"{what} is not UTF-8 text: {_not_utf8(text, exc.start)}") from None


def _not_utf8(text: str, start: int) -> str:
    """Where ``text`` stops being UTF-8: the byte (a surrogate escape) or lone surrogate at ``start``."""
    offset = len(text[:start].encode("utf-8"))
    code = ord(text[start])
    what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
    return f"{what} at byte offset {offset}"


def as_prompts(prompts) -> list[Prompt]:
    """One text, texts or [`Prompt`][kvscope.model.prompts.Prompt] objects → a non-empty list of prompts."""
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = [p if isinstance(p, Prompt) else Prompt(str(p)) for p in prompts]
    if not prompts:
        raise KvscopeError("no prompts given")
    return prompts


def read_text_file(path: str | Path, what: str) -> str:
    """The UTF-8 text of the file at ``path`` (``what`` names it in the refusals: missing,
    unreadable, not UTF-8)."""
    p = Path(path)
    if not p.is_file():
        raise KvscopeError(f"{what} not found: {p}")
    try:
        raw = p.read_bytes()
        return raw.decode("utf-8")
    except OSError as exc:
        raise KvscopeError(f"cannot read {what} {p}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise KvscopeError(
            f"{what} {p} is not UTF-8 text: byte 0x{raw[exc.start]:02x} at byte offset {exc.start}"
        ) from None


def load_continuation_file(path: str | Path) -> str:
    """The text of a continuation file (``trace --continuation FILE``): UTF-8, as it is (a final
    newline included), not empty."""
    text = read_text_file(path, "continuation file")
    if not text:
        raise KvscopeError(f"continuation file {path} is empty")
    return text


def json_objects(text: str, where) -> list[tuple[int, dict]]:
    """``(line number, object)`` of each non-blank line of JSON-lines ``text`` (lines count from 1);
    a line that is not a JSON object is refused as ``"{where(line, row)}: not a JSON object"``
    (``row``: its index among the non-blank lines)."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = parse_json(line)
        except ValueError:  # not JSON, or nested too deep
            obj = None
        if not isinstance(obj, dict):
            raise KvscopeError(f"{where(n, len(out))}: not a JSON object")
        out.append((n, obj))
    return out


def load_prompts_file(path: str | Path) -> list[Prompt]:
    """JSONL with one object per line: ``{"prompt" | "text": str, "source"?: str}`` or
    ``{"context": str, "question": str, …}``, each with an optional ``"continuation": str``
    (given on every line or on none)."""
    p = Path(path)
    text = read_text_file(p, "prompts file")
    prompts = []
    for n, obj in json_objects(text, lambda line, _: f"{p}:{line}"):
        source = str(obj.get("source", f"{p.name}:{n}"))
        continuation = obj.get("continuation")
        if continuation is not None and not (isinstance(continuation, str) and continuation):
            raise KvscopeError(f"{p}:{n}: 'continuation' must be a non-empty string")
        if "context" in obj or "question" in obj:
            context, question = obj.get("context"), obj.get("question")
            if not all(isinstance(x, str) and x for x in (context, question)):
                raise KvscopeError(f"{p}:{n}: 'context' and 'question' must both be non-empty strings")
            prompts.append(Prompt.split_at(context, question, source, continuation=continuation))
            continue
        text = obj.get("prompt", obj.get("text"))
        if not isinstance(text, str) or not text:
            raise KvscopeError(
                f"{p}:{n}: needs a non-empty string field 'prompt' or 'text' (or 'context' and 'question')"
            )
        prompts.append(Prompt(text, source, continuation=continuation))
    if not prompts:
        raise KvscopeError(f"{p} holds no prompts")
    continuations(prompts)  # on every line or none
    return prompts


PLAIN_PREFIX_SEPARATOR = "\n"  # between the text and the answer prefix without a chat template (kvpress's)


def _rendered(tokenizer, prompt: Prompt) -> str:
    """The chat template around the prompt's text, up to and with the generation prompt."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt.text}], add_generation_prompt=True, tokenize=False
    )


def encode(tokenizer, prompts: list[Prompt], chat: bool) -> list[list[int]]:
    """Token ids of every prompt (wrapped in the tokenizer's chat template when ``chat``).

    A prompt's ``answer_prefix`` follows, as kvpress's pipeline places it: with ``chat`` after
    the template's generation prompt, ``tokenizer(rendered + answer_prefix,
    add_special_tokens=False)``; without, after the text and a newline, ``tokenizer(text + "\n"
    + answer_prefix)``. A prompt without one (None or "") is tokenized exactly as before answer
    prefixes existed."""
    out = []
    for prompt in prompts:
        if chat and prompt.answer_prefix:
            ids = tokenizer(_rendered(tokenizer, prompt) + prompt.answer_prefix, add_special_tokens=False)["input_ids"]
        elif chat:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt.text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        elif prompt.answer_prefix:
            text = prompt.text + PLAIN_PREFIX_SEPARATOR + prompt.answer_prefix
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        else:
            ids = tokenizer(prompt.text, add_special_tokens=True)["input_ids"]
        if not ids:
            raise KvscopeError(f"prompt from {prompt.source} is empty after tokenization")
        out.append([int(i) for i in ids])
    return out


def encode_split(tokenizer, prompts: list[Prompt], chat: bool) -> list[tuple[list[int], list[int]]]:
    """``(context ids, question ids)`` of every prompt, tokenized apart so that the context's
    tokens never depend on the question. With ``chat`` the template is rendered around the
    whole text and cut where the question starts: the template's opening belongs to the
    context, its closing (the generation prompt) to the question. An ``answer_prefix`` ends the
    question (after the generation prompt; without ``chat`` after a newline), as in kvpress's
    ``preprocess``: ``question + closing + answer_prefix`` tokenized as one text."""
    out = []
    for n, prompt in enumerate(prompts):
        if prompt.split is None:
            raise KvscopeError(
                f"prompt {n} ({prompt.source}) has no question: --question-agnostic needs prompts with a context and "
                'a question ({"context": …, "question": …} in JSONL, or the niah and vt workloads)'
            )
        prefix = prompt.answer_prefix
        if chat:
            rendered = _rendered(tokenizer, prompt)
            cut = rendered.rindex(prompt.question)
            tail = rendered[cut:] + (prefix or "")
            context = tokenizer(rendered[:cut], add_special_tokens=False)["input_ids"]
            question = tokenizer(tail, add_special_tokens=False)["input_ids"]
        else:
            tail = prompt.question + PLAIN_PREFIX_SEPARATOR + prefix if prefix else prompt.question
            context = tokenizer(prompt.context, add_special_tokens=True)["input_ids"]
            question = tokenizer(tail, add_special_tokens=False)["input_ids"]
        if not context or not question:
            raise KvscopeError(f"prompt {n} ({prompt.source}): its context or question is empty after tokenization")
        out.append(([int(i) for i in context], [int(i) for i in question]))
    return out


def encode_prompts(
    tokenizer, prompts: list[Prompt], chat: bool, question_agnostic: bool
) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids the prefill takes per prompt, and those fed as the first decode steps: with
    ``question_agnostic`` the context and the question (``encode_split``), else the whole
    prompt and none."""
    if question_agnostic:
        pairs = encode_split(tokenizer, prompts, chat)
        return [c for c, _ in pairs], [q for _, q in pairs]
    encoded = encode(tokenizer, prompts, chat)
    return encoded, [[] for _ in encoded]


def continuations(prompts: list[Prompt]) -> list[str] | None:
    """The text a trace forces as each prompt's decode steps — its given continuation, or its
    gold answer (the first of its ``answers``; ``encode_continuations`` tokenizes it as
    ``answer_ids`` does) — or None where no prompt has either; refuses prompts of which only
    some have one (a trace forces every sample's steps or none)."""
    given = [p.continuation is not None or p.answers is not None for p in prompts]
    if not any(given):
        return None
    if not all(given):
        n = given.index(False)
        if any(p.answers is not None for p in prompts):
            raise KvscopeError(
                f"prompt {n} ({prompts[n].source}) has no answer while others have one: a trace forces every "
                "sample's gold answer or none; give answers to every prompt or to none"
            )
        raise KvscopeError(
            f"prompt {n} ({prompts[n].source}) has no continuation while others have one: "
            "give a continuation to every prompt or to none"
        )
    if any(p.answers is not None for p in prompts) and any(p.continuation is not None for p in prompts):
        n = next(n for n, p in enumerate(prompts) if p.continuation is not None)
        raise KvscopeError(
            f"prompt {n} ({prompts[n].source}) has a continuation while others have answers: a trace forces "
            "given continuations or gold answers, not both"
        )
    return [p.continuation if p.continuation is not None else p.answers[0] for p in prompts]


def with_continuations(prompts: list[Prompt], continuation: str | list[str] | None) -> list[Prompt]:
    """``prompts`` continued by ``continuation``: one text for a single prompt, or a list of one
    per prompt (None: the prompts as they are)."""
    if continuation is None:
        return prompts
    if isinstance(continuation, str):
        if len(prompts) > 1:
            raise KvscopeError(
                f"one continuation goes with a single prompt (got {len(prompts)} prompts): give one per prompt"
            )
        continuation = [continuation]
    continuation = list(continuation)
    if len(continuation) != len(prompts):
        raise KvscopeError(f"{len(continuation)} continuations for {len(prompts)} prompts: give one per prompt")
    if any(p.continuation is not None for p in prompts):
        raise KvscopeError("the prompts carry continuations of their own already")
    if any(p.answers is not None for p in prompts):
        raise KvscopeError("the prompts carry answers, whose gold answer a trace forces: give no continuation")
    return [replace(p, continuation=c) for p, c in zip(prompts, continuation)]


def answer_ids(tokenizer, prompt: Prompt) -> list[int] | None:
    """The token ids of the prompt's gold answer (the first of its ``answers``) as the model
    continues its answer prefix; None without answers.

    The rule: ``ids(prefix + separator + answer)`` minus ``ids(prefix)`` (both
    ``add_special_tokens=False``), where the separator is one space unless the prefix ends with
    whitespace or the answer starts with it (RULER's answers follow "… is" after a space:
    ``"… is" + " " + "4471"``). Without an answer prefix, ``ids(answer)``. A tokenizer that
    merges the prefix's last token with the answer's first (the joint ids do not start with the
    prefix's) is refused in one line: the answer would not be a run of whole tokens after the
    prompt."""
    if prompt.answers is None:
        return None
    answer, prefix = prompt.answers[0], prompt.answer_prefix or ""
    if not prefix:
        ids = [int(i) for i in tokenizer(answer, add_special_tokens=False)["input_ids"]]
    else:
        separator = "" if prefix[-1].isspace() or answer[0].isspace() else " "
        head = [int(i) for i in tokenizer(prefix, add_special_tokens=False)["input_ids"]]
        joint = [int(i) for i in tokenizer(prefix + separator + answer, add_special_tokens=False)["input_ids"]]
        if joint[: len(head)] != head:
            at = next((i for i, (a, b) in enumerate(zip(head, joint)) if a != b), min(len(head), len(joint)))
            fix = (
                "end the answer prefix without whitespace (kvscope then puts one space before the answer)"
                if prefix[-1].isspace()
                else "end the answer prefix where a token ends, or start the answer with a space"
            )
            raise KvscopeError(
                f"the answer of the prompt from {prompt.source} cannot be split from its answer prefix: kvscope "
                "forces the ids of (prefix + separator + answer) that follow the prefix's own ids, and the tokenizer "
                f"merges the prefix's end {tokenizer.decode(head[at:])!r} with the answer's start into "
                f"{tokenizer.decode(joint[at : at + 1])!r}; {fix}"
            )
        ids = joint[len(head) :]
    if not ids:
        raise KvscopeError(f"the answer of the prompt from {prompt.source} is empty after tokenization")
    return ids


def encode_answers(tokenizer, prompts: list[Prompt]) -> list[list[int] | None]:
    """``answer_ids`` of every prompt (None for a prompt without answers)."""
    return [answer_ids(tokenizer, p) for p in prompts]


def encode_continuations(tokenizer, prompts: list[Prompt], max_new_tokens: int | None) -> list[list[int]] | None:
    """The token ids forced as each prompt's decode steps: its continuation as
    ``tokenizer(continuation, add_special_tokens=False)`` gives them (no BOS, no EOS added), the
    first ``max_new_tokens`` of them (None: all); its gold answer as ``answer_ids`` gives them,
    all of them (an answer longer than ``max_new_tokens`` is refused); None where the prompts
    have neither."""
    texts = continuations(prompts)
    if texts is None:
        return None
    out = []
    for n, (prompt, text) in enumerate(zip(prompts, texts)):
        if prompt.answers is not None:
            ids = answer_ids(tokenizer, prompt)
            if max_new_tokens is not None and len(ids) > max_new_tokens:
                raise KvscopeError(
                    f"the answer of prompt {n} ({prompt.source}) has {len(ids)} tokens, more than --max-new-tokens "
                    f"{max_new_tokens}: raise it, or leave it out to force every answer whole"
                )
            out.append(ids)
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise KvscopeError(f"the continuation of prompt {n} ({prompt.source}) is empty after tokenization")
        out.append([int(i) for i in ids[:max_new_tokens]])
    return out


def check_context(
    encoded: list[list[int]],
    max_new_tokens: int,
    context: int | None,
    questions: list[list[int]] | None = None,
    forced: list[list[int]] | None = None,
    *,
    prompts: list[Prompt] | None = None,
    steps: list[int] | None = None,
) -> None:
    """Refuse a prompt whose tokens (with its question's) plus ``max_new_tokens`` — or the
    tokens of its continuation, ``forced``, or its own decode length, ``steps`` — exceed the
    model context (``prompts``: named by their source in the refusal)."""
    for n, ids in enumerate(encoded):
        tokens = len(ids) + (len(questions[n]) if questions else 0)
        if forced:
            new = len(forced[n])
            kind = "answer" if prompts and prompts[n].answers is not None else "continuation"
            what = f"its {kind}'s {new} tokens"
        elif steps and steps[n] != max_new_tokens:
            new, what = steps[n], f"its max_new_tokens {steps[n]}"
        else:
            new, what = max_new_tokens, f"--max-new-tokens {max_new_tokens}"
        if context and tokens + new > context:
            name = f"prompt {n}" + (f" ({prompts[n].source})" if prompts else "")
            raise KvscopeError(f"{name} has {tokens} tokens; with {what} it exceeds the model context of {context}")


def eos_ids(model, tokenizer) -> list[int]:
    """The token ids that end generation (the model's generation config, else the tokenizer's)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
