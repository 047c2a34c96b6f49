"""Prompts: where they come from, how they become token ids, when generation stops.

as_prompts("text" | ["a", "b"] | [Prompt, …])   → [Prompt]
load_prompts_file("prompts.jsonl")              → [Prompt]   one {"prompt" | "text": …} or
                                                             {"context": …, "question": …} per line
encode(tokenizer, prompts, chat)                → [[token id, …], …]   (chat template when asked)
encode_split(tokenizer, prompts, chat)          → [(context ids, question ids), …]  (--question-agnostic)
encode_prompts(tokenizer, prompts, chat, qa)    → (prefill ids, forced question ids) per prompt
check_context(encoded, max_new_tokens, context) refuses prompts that do not fit the model
eos_ids(model, tokenizer)                       the ids that end generation
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import KvscopeError, parse_json


@dataclass
class Prompt:
    """One prompt: its text, where it came from, and where its question starts (if it has one).

    Attributes:
        text: The whole prompt (context and question).
        source: Where it came from (``cli``, a file and line, ``workload:NAME:…``).
        expected: A workload's answer (what its scorer grades against).
        meta: A workload's details (seed, context, tokens, …).
        split: Where the question starts in ``text`` (characters); None: no question.
    """

    text: str
    source: str = "cli"
    expected: object = None
    meta: dict = field(default_factory=dict)
    split: int | None = None

    def __post_init__(self):
        if self.split is not None and not (isinstance(self.split, int) and 0 < self.split < len(self.text)):
            raise KvscopeError(
                f"prompt from {self.source}: its question must start inside the text (split {self.split!r})"
            )
        if not isinstance(self.text, str):
            raise KvscopeError(f"prompt from {self.source} is not text (got {type(self.text).__name__})")
        try:
            self.text.encode("utf-8")
        except UnicodeEncodeError as exc:  # argv carries undecodable bytes as surrogate escapes
            raise KvscopeError(
                f"prompt from {self.source} is not UTF-8 text: {_not_utf8(self.text, exc.start)}"
            ) from None

    def doc(self) -> dict:
        """What the store's ``prompts`` attribute holds for this prompt."""
        out = {"text": self.text, "source": self.source}
        if self.expected is not None:
            out["expected"] = self.expected
        if self.meta:
            out["meta"] = self.meta
        if self.split is not None:
            out["split"] = self.split
        return out

    @classmethod
    def from_doc(cls, doc: dict) -> Prompt:
        """The inverse of [`doc`][kvscope.model.prompts.Prompt.doc] (prompts read back from a store).

        Args:
            doc: One entry of a store's ``prompts`` attribute.
        """
        return cls(doc["text"], doc.get("source", "cli"), doc.get("expected"), doc.get("meta") or {}, doc.get("split"))

    @classmethod
    def split_at(cls, context: str, question: str, source: str = "cli", **fields: object) -> Prompt:
        """A prompt whose text is ``context + question`` with the question marked.

        Args:
            context: The context.
            question: The question.
            source: Where it came from.
            **fields: ``expected`` and ``meta``.
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


def load_prompts_file(path: str | Path) -> list[Prompt]:
    """JSONL with one object per line: ``{"prompt" | "text": str, "source"?: str}``."""
    p = Path(path)
    if not p.is_file():
        raise KvscopeError(f"prompts file not found: {p}")
    try:
        raw = p.read_bytes()
        text = raw.decode("utf-8")
    except OSError as exc:
        raise KvscopeError(f"cannot read prompts file {p}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise KvscopeError(
            f"prompts file {p} is not UTF-8 text: byte 0x{raw[exc.start]:02x} at byte offset {exc.start}"
        ) from None
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = parse_json(line)
        except ValueError:  # not JSON, or nested too deep
            raise KvscopeError(f"{p}:{n}: not a JSON object") from None
        if not isinstance(obj, dict):
            raise KvscopeError(f"{p}:{n}: not a JSON object")
        source = str(obj.get("source", f"{p.name}:{n}"))
        if "context" in obj or "question" in obj:
            context, question = obj.get("context"), obj.get("question")
            if not all(isinstance(x, str) and x for x in (context, question)):
                raise KvscopeError(f"{p}:{n}: 'context' and 'question' must both be non-empty strings")
            prompts.append(Prompt.split_at(context, question, source))
            continue
        text = obj.get("prompt", obj.get("text"))
        if not isinstance(text, str) or not text:
            raise KvscopeError(
                f"{p}:{n}: needs a non-empty string field 'prompt' or 'text' (or 'context' and 'question')"
            )
        prompts.append(Prompt(text, source))
    if not prompts:
        raise KvscopeError(f"{p} holds no prompts")
    return prompts


def encode(tokenizer, prompts: list[Prompt], chat: bool) -> list[list[int]]:
    """Token ids of every prompt (wrapped in the tokenizer's chat template when ``chat``)."""
    out = []
    for prompt in prompts:
        if chat:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt.text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
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
    context, its closing (the generation prompt) to the question."""
    out = []
    for n, prompt in enumerate(prompts):
        if prompt.split is None:
            raise KvscopeError(
                f"prompt {n} ({prompt.source}) has no question: --question-agnostic needs prompts with a context and "
                'a question ({"context": …, "question": …} in JSONL, or the niah and vt workloads)'
            )
        if chat:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt.text}], add_generation_prompt=True, tokenize=False
            )
            cut = rendered.rindex(prompt.question)
            context = tokenizer(rendered[:cut], add_special_tokens=False)["input_ids"]
            question = tokenizer(rendered[cut:], add_special_tokens=False)["input_ids"]
        else:
            context = tokenizer(prompt.context, add_special_tokens=True)["input_ids"]
            question = tokenizer(prompt.question, add_special_tokens=False)["input_ids"]
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


def check_context(
    encoded: list[list[int]], max_new_tokens: int, context: int | None, questions: list[list[int]] | None = None
) -> None:
    """Refuse a prompt whose tokens (with its question's) plus ``max_new_tokens`` exceed the
    model context."""
    for n, ids in enumerate(encoded):
        tokens = len(ids) + (len(questions[n]) if questions else 0)
        if context and tokens + max_new_tokens > context:
            raise KvscopeError(
                f"prompt {n} has {tokens} tokens; with --max-new-tokens {max_new_tokens} "
                f"it exceeds the model context of {context}"
            )


def eos_ids(model, tokenizer) -> list[int]:
    """The token ids that end generation (the model's generation config, else the tokenizer's)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
