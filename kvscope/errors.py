"""The one exception type that the CLI turns into a single line and exit code 2, and the JSON
parse every reader of a file a user hands kvscope goes through."""

import json

__all__ = ["KvscopeError", "StoreError", "first_line"]


class KvscopeError(Exception):
    """Bad input or an unusable store: the message is one line naming the problem."""


class StoreError(KvscopeError):
    """A trace store that cannot be opened or written as asked."""


class JSONTooDeep(ValueError):
    """JSON nested deeper than Python's parser recurses (`json.loads` raises RecursionError)."""


def parse_json(text: str | bytes):
    """`json.loads(text)`, where every way hostile text fails it is a `ValueError`: invalid JSON,
    bytes that are not UTF-8, and (as `JSONTooDeep`) arrays or objects nested thousands of
    levels deep, which `json.loads` ends with a RecursionError.

    Args:
        text: The JSON document.
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise JSONTooDeep("JSON nested deeper than Python's parser recurses") from None


def first_line(exc: BaseException, *, named: bool = False) -> str:
    """The first line of an exception's message (at most 200 characters), for a one-line error.
    An empty message gives the type's name.

    Args:
        exc: The exception.
        named: Put the exception's type before the message.
    """
    text = str(exc).strip().splitlines()
    if not text:
        return type(exc).__name__
    return f"{type(exc).__name__}: {text[0][:200]}" if named else text[0][:200]
