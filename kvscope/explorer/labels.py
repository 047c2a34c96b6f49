"""Token text for the explorer's hover: the ids of a trace decoded one token at a time.

The text comes from the tokenizer of the model the trace names, found locally only (the
default model's converted folder, a local folder; never the hub): ``tokenizer.json`` through
the ``tokenizers`` library when the folder has one (fast), else transformers' tokenizer. When
none is found, or with ``tokens="ids"``, a token shows as ``#id``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def decoder(model: dict, tokens: str = "model"):
    """``ids → list[str]``: each id decoded alone."""
    tok = _tokenizer(model) if tokens == "model" else None
    if tok is None:
        return lambda ids: [f"#{int(i)}" for i in ids]
    cache: dict[int, str] = {}

    def decode(ids) -> list[str]:
        out = []
        for i in np.asarray(ids).tolist():
            if i not in cache:
                cache[i] = tok.decode([i]) if i >= 0 else ""
            out.append(cache[i])
        return out

    return decode


def _tokenizer(model: dict):
    from ..model.loading import load_tokenizer, resolve

    try:
        source = resolve(str(model.get("name", "")), allow_hub=False)
        file = Path(source.load_path) / "tokenizer.json"
        if file.is_file():
            from tokenizers import Tokenizer

            return _Fast(Tokenizer.from_file(str(file)))
        return load_tokenizer(source)
    except Exception:  # noqa: BLE001 — any failure means: show ids
        return None


class _Fast:
    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def key_labels(decode, token_ids: np.ndarray) -> list[str]:
    """``[pos]`` the token at each position ('' for padding)."""
    return decode(token_ids)


def query_labels(decode, token_ids: np.ndarray, query_pos: np.ndarray) -> list[str]:
    """``[step]`` "q=<position> '<token at it>'" for each step's query ('' past the steps)."""
    texts = decode(token_ids)
    return [f"q={q} {texts[q]!r}" if q >= 0 else "" for q in np.asarray(query_pos).tolist()]
