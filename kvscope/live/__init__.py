"""Live decoding with kvscope policies as transformers caches.

prepare(model)                                     route attention through kvscope
PolicyCache(model, "qevict", 0.2, max_new_tokens)  a ``Cache`` for ``model(cache=...)``
                                                   or ``model.generate(cache=...)``
LivePolicy("qevict", 0.2)                          a cache factory: ``kvscope.trace(cache=...)``
"""

from .cache import LivePolicy, PolicyCache, PolicyLayer, prepare

__all__ = ["LivePolicy", "PolicyCache", "PolicyLayer", "prepare"]
