"""kvscope — what an LLM's KV cache really needs.

Record per-step attention during real decoding into Zarr stores (:func:`trace`), open them
as xarray Datasets (:func:`open_trace`, with the ``ds.kvscope`` accessor), measure importance
drift (``kvscope.analysis``), replay KV-cache policies offline (:func:`replay`,
``kvscope.policies``; a saved result with :func:`open_result`) and run them live (``kvscope.live``).
"""

__version__ = "0.2.0"

from .store import open_trace


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


from .replay import open_result, replay


def view(ds, result=None, **kwargs):
    """The attention explorer of a trace (and a replay result) in Jupyter — see
    :func:`kvscope.explorer.view` (needs Panel)."""
    from .explorer import view as _view

    return _view(ds, result, **kwargs)


__all__ = ["__version__", "open_result", "open_trace", "replay", "trace", "view"]
