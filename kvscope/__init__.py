"""kvscope — what an LLM's KV cache really needs.

Record per-step attention during real decoding into Zarr stores (:func:`trace`), open them
as xarray Datasets (:func:`open_trace`, with the ``ds.kvscope`` accessor), measure importance
drift (``kvscope.analysis``), replay KV-cache policies offline (:func:`replay`,
``kvscope.policies``; a saved result with :func:`open_result`) and run them live (``kvscope.live``).
"""

__version__ = "0.2.0"

import sys
import types

# open_trace, open_result, replay and the subpackages load on first use (PEP 562): ``import
# kvscope`` — and with it every CLI command, ``kvscope --help`` and an option refused before any
# model or store is touched — costs no torch, transformers, xarray or dask import (~2 s). The
# ``ds.kvscope`` accessor is registered with kvscope.storage.dataset (open_trace imports it).
_LAZY = {"open_trace": "storage.store", "open_result": "replay", "replay": "replay"}


def __getattr__(name: str):
    """The lazy names above, and a submodule by its name (``kvscope.policies.available()``)."""
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f".{name}", __name__)  # the import system sets it on us
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """``kvscope.replay`` is the function, as it always was: importing the subpackage of the same
    name (which the import system then sets on its parent) leaves it alone."""

    def __setattr__(self, name, value):
        if name == "replay" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def trace(prompts, out, settings=None, *, policy=None, budget=None, kv_dtype: str = "model", **kwargs):
    """Decode ``prompts`` with attention capture into a store; see
    :func:`kvscope.tracing.runner.trace`. With ``policy`` and ``budget`` the decode runs under
    a live policy cache whose tiers and bytes are recorded too (:class:`kvscope.live.LivePolicy`)."""
    from .errors import KvscopeError
    from .tracing.runner import trace as _trace

    if (policy is None) != (budget is None):
        raise KvscopeError("--policy and --budget go together")
    if policy is not None:
        from .live import LivePolicy

        kwargs["cache"] = LivePolicy(policy, budget, kv_dtype)
    return _trace(prompts, out, settings, **kwargs)


def view(ds, result=None, **kwargs):
    """The attention explorer of a trace (and a replay result) in Jupyter — see
    :func:`kvscope.explorer.view` (needs Panel)."""
    from .explorer import view as _view

    return _view(ds, result, **kwargs)


__all__ = ["__version__", "open_result", "open_trace", "replay", "trace", "view"]
