"""The one exception type that the CLI turns into a single line and exit code 2."""

__all__ = ["KvscopeError", "StoreError", "first_line"]


class KvscopeError(Exception):
    """Bad input or an unusable store: the message is one line naming the problem."""


class StoreError(KvscopeError):
    """A trace store that cannot be opened or written as asked."""


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
