"""The user's own evaluation data (``trace --dataset FILE``, ``run --dataset FILE``): rows with
kvpress's evaluation columns, so that a copy of kvpress's RULER or LongBench data runs as it is.

    load_dataset("ruler.jsonl" | "ruler.parquet")   → [Prompt], one per row

Columns (one JSON object per line in ``.jsonl``; a table in ``.parquet``, read with pyarrow):

    context          str, not empty          the document
    question         str, not empty          asked after it (the prompt is split there)
    answer           str or [str, …]         the accepted answers (the first is the gold answer)
    answer_prefix    str, optional           the text the answer follows ("" or null: none)
    max_new_tokens   int ≥ 1, optional       ``run``: this row's decode length
    task             str, optional           the task (its metric: ``kvscope.workloads.metrics``)

Other columns are ignored. Each row is one sample, in file order: its prompt is
``context + question`` split at the question, with ``answer_prefix`` and ``answers``;
``source`` is ``FILE:ROW`` (ROW counts data rows from 0: a JSONL file's blank lines are
skipped) and ``meta`` holds ``row``, ``context_id`` (the index of the row's context among the
file's distinct contexts, in order of first appearance: rows sharing one get the same id),
``question`` (the row's index among the rows of its context, in file order), ``task`` and
``max_new_tokens`` (None where the row has none). Rows sharing a context are one context with
several questions: under the question-agnostic protocol, the default of ``--dataset``, the context
is prefilled and compressed without any question, and each question is answered over it
(docs/replay.md#several-questions-per-context).

A row that cannot be read is refused in one line naming the file and the row (and, for
JSONL, the line).
"""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import KvscopeError
from .prompts import Prompt, json_objects, read_text_file

SUFFIXES = (".jsonl", ".parquet")
COLUMNS = ("context", "question", "answer", "answer_prefix", "max_new_tokens", "task")


def load_dataset(path: str | Path) -> list[Prompt]:
    """The prompts of a dataset file (module docstring), one per row."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in SUFFIXES:
        raise KvscopeError(
            f"dataset {p}: unknown file type {p.suffix or '(no suffix)'!r}; kvscope reads JSON lines (.jsonl) "
            "or Parquet (.parquet)"
        )
    rows = _jsonl_rows(p) if suffix == ".jsonl" else _parquet_rows(p)
    prompts, contexts = [], {}
    for row, (where, obj) in enumerate(rows):
        prompts.append(_prompt(p, row, where=where, obj=obj, contexts=contexts))
    asked: dict[int, int] = {}
    for prompt in prompts:
        context_id = prompt.meta["context_id"]
        prompt.meta["question"] = asked[context_id] = asked.get(context_id, -1) + 1
    if not prompts:
        raise KvscopeError(f"dataset {p} holds no rows")
    return prompts


def _jsonl_rows(p: Path) -> list[tuple[str, dict]]:
    """``(where, object)`` of each non-blank line (``where``: "row R (line L)")."""
    text = read_text_file(p, "dataset file")
    objects = json_objects(text, lambda line, row: f"dataset {p} row {row} (line {line})")
    return [(f"row {row} (line {line})", obj) for row, (line, obj) in enumerate(objects)]


def _parquet_rows(p: Path) -> list[tuple[str, dict]]:
    """``(where, row)`` of each row of a Parquet file (the columns kvscope reads)."""
    if not p.is_file():
        raise KvscopeError(f"dataset file not found: {p}")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise KvscopeError(
            f"dataset {p}: reading Parquet needs pyarrow (pip install pyarrow), or give the rows as JSON lines (.jsonl)"
        ) from None
    try:
        table = pq.read_table(p)
    except (OSError, pa.ArrowException) as exc:  # not Parquet, truncated, unreadable
        raise KvscopeError(f"dataset {p} is not a readable Parquet file: {' '.join(str(exc).split())}") from None
    table = table.select([c for c in table.column_names if c in COLUMNS])
    return [(f"row {n}", row) for n, row in enumerate(table.to_pylist())]


def _prompt(p: Path, row: int, *, where: str, obj: dict, contexts: dict[str, int]) -> Prompt:
    """The prompt of one row (``contexts``: the distinct contexts seen so far → their ids)."""
    at = f"dataset {p} {where}"
    text = {}
    for key in ("context", "question"):
        value = obj.get(key)
        if value is None:
            raise KvscopeError(f"{at}: no {key!r}")
        if not isinstance(value, str) or not value:
            raise KvscopeError(f"{at}: {key!r} must be a non-empty string (got {_kind(value)})")
        text[key] = value
    answers = _answers(at, obj.get("answer"))
    prefix = obj.get("answer_prefix")
    if prefix is not None and not isinstance(prefix, str):
        raise KvscopeError(f"{at}: 'answer_prefix' must be a string (got {_kind(prefix)})")
    task = obj.get("task")
    if task is not None and not isinstance(task, str):
        raise KvscopeError(f"{at}: 'task' must be a string (got {_kind(task)})")
    steps = _max_new_tokens(at, obj.get("max_new_tokens"))
    context_id = contexts.setdefault(text["context"], len(contexts))
    meta = {"row": row, "context_id": context_id, "task": task, "max_new_tokens": steps}
    return Prompt.split_at(
        text["context"], text["question"], f"{p.name}:{row}", meta=meta, answer_prefix=prefix or None, answers=answers
    )


def _answers(at: str, value) -> list[str]:
    """The accepted answers of a row's ``answer``: a string or a non-empty list of strings."""
    if value is None:
        raise KvscopeError(f"{at}: no 'answer' (a string or a list of accepted strings)")
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, (list, tuple)):
        value = list(value)
        if not value:
            raise KvscopeError(f"{at}: 'answer' is an empty list")
        odd = next((a for a in value if not isinstance(a, str)), None)
        if odd is not None:
            raise KvscopeError(f"{at}: 'answer' must be a string or a list of strings (it holds {_kind(odd)})")
    else:
        raise KvscopeError(f"{at}: 'answer' must be a string or a list of strings (got {_kind(value)})")
    if any(not a.strip() for a in value):
        raise KvscopeError(f"{at}: 'answer' is empty" + (" (one of its strings)" if len(value) > 1 else ""))
    return value


def _max_new_tokens(at: str, value) -> int | None:
    """A row's ``max_new_tokens``: an integer ≥ 1 (a whole float too: pandas writes integer
    columns with gaps as floats), or None (a NaN too: pandas' gap)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KvscopeError(f"{at}: 'max_new_tokens' must be an integer ≥ 1 (got {value!r})")
    return value


def _kind(value) -> str:
    return "an empty string" if value == "" else type(value).__name__
