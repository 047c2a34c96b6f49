"""Live decoding with kvscope policies as transformers caches.

prepare(model)                                     route attention through kvscope
PolicyCache(model, "qevict", 0.2, max_new_tokens)  a ``Cache`` for ``model(cache=...)``
                                                   or ``model.generate(cache=...)``
LivePolicy("qevict", 0.2)                          a cache factory: ``kvscope.trace(cache=...)``

The names load ``kvscope.live.cache`` (torch, transformers) on first use, so that
``kvscope.live.inputs`` checks a command line's live options without them.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names, for type checkers and the API page (loaded on first use below)
    from .cache import LivePolicy, PolicyCache, PolicyLayer, prepare

__all__ = ["LivePolicy", "PolicyCache", "PolicyLayer", "prepare"]


def __getattr__(name: str):
    if name in __all__:
        from . import cache

        return getattr(cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
