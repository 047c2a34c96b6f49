"""The one exception type that the CLI turns into a single line and exit code 2."""


class KvscopeError(Exception):
    """Bad input or an unusable store: the message is one line naming the problem."""


class StoreError(KvscopeError):
    """A trace store that cannot be opened or written as asked."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type when it has none), for one-line errors."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
