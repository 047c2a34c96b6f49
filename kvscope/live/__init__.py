"""Live decoding with kvscope policies as transformers caches (issue 6).

prepare(model)                                     route attention through kvscope
PolicyCache(model, "qevict", 0.2, max_new_tokens)  a ``Cache`` for ``model(cache=...)``
                                                   or ``model.generate(cache=...)``
"""

from .cache import PolicyCache, PolicyLayer, prepare

__all__ = ["PolicyCache", "PolicyLayer", "prepare"]
