"""kvscope — what an LLM's KV cache really needs.

Record per-step attention during real decoding into Zarr stores (:func:`trace`), open them
as xarray Datasets (:func:`open_trace`), measure importance drift (``kvscope.analysis``)
and replay KV-cache policies offline (``kvscope.policies``).
"""

__version__ = "0.1.0"

from .store import open_trace  # noqa: E402


def trace(*args, **kwargs):
    """Decode prompts with attention capture into a store; see :func:`kvscope.tracing.runner.trace`."""
    from .tracing.runner import trace as _trace

    return _trace(*args, **kwargs)


from .replay import replay  # noqa: E402  (the function; the module stays importable as kvscope.replay)

__all__ = ["__version__", "open_trace", "replay", "trace"]
