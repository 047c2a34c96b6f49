"""kvscope — what an LLM's KV cache really needs.

Record per-step attention during real decoding into Zarr stores ([`trace`][kvscope.trace]), open them
as xarray Datasets ([`open_trace`][kvscope.open_trace], with the ``ds.kvscope`` accessor), measure importance
drift (``kvscope.analysis``), replay KV-cache policies offline ([`replay`][kvscope.replay.replay],
``kvscope.policies``; a saved result with [`open_result`][kvscope.open_result]) and run them live (``kvscope.live``).
"""

from __future__ import annotations

__version__ = "0.2.0"

import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names the signatures below give (nothing of it is imported at run time)
    from collections.abc import Callable
    from pathlib import Path

    import xarray as xr

    from .live import LivePolicy
    from .model.prompts import Prompt
    from .policies import Allocation, Policy
    from .replay import open_result
    from .storage.store import open_trace
    from .tracing.runner import Progress, TraceResult
    from .tracing.settings import TraceSettings
    from .tracing.shard import Shard

# open_trace, open_result, replay and the subpackages load on first use (PEP 562): ``import
# kvscope`` — and with it every CLI command, ``kvscope --help`` and an option refused before any
# model or store is touched — costs no torch, transformers, xarray or dask import (~2 s). The
# ``ds.kvscope`` accessor is registered with kvscope.storage.dataset (open_trace imports it).
_LAZY = {
    "open_trace": "storage.store",
    "open_result": "replay",
    "replay": "replay",
    "TraceSettings": "tracing.settings",
}


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


def trace(
    prompts: str | list[str] | list[Prompt],
    out: str | Path,
    settings: TraceSettings | None = None,
    *,
    policy: Policy | str | None = None,
    budget: float | None = None,
    allocation: Allocation | str = "uniform",
    kv_dtype: str = "model",
    resume: bool = False,
    force: bool = False,
    progress: Callable[[Progress], None] | None = None,
    cache: LivePolicy | None = None,
    shard: Shard | None = None,
    continuation: str | list[str] | None = None,
    **overrides: Any,
) -> TraceResult:
    """Decode ``prompts`` with attention capture and write a trace store at ``out``.

    What the trace records is a [`TraceSettings`][kvscope.TraceSettings]: pass one as ``settings``,
    or name its fields as keyword arguments (``max_new_tokens=64``, ``record_qkv=True``, …), which
    override those of ``settings`` (or of the defaults). The store is created under a temporary
    name and renamed into place: ``out`` is either absent or a store that opens.

    Args:
        prompts: One text, several, or [`Prompt`][kvscope.model.prompts.Prompt] objects (a
            context and a question).
        out: Where the store goes (``*.zarr``); it must not exist unless ``resume`` or ``force``.
        settings: What determines the trace's contents (default: ``TraceSettings()``).
        policy: Decode under this live policy cache (a name, ``name:key=value:…`` or a policy
            object): its tiers and bytes are recorded too. Goes with ``budget``.
        budget: The budget β of ``policy``, a share of the full cache's bytes in (0, 1].
        allocation: How ``budget`` is split across layers and KV heads (with ``policy``).
        kv_dtype: Storage of the policy cache's full-precision entries: ``model`` (the model's
            dtype), ``float16``, ``bfloat16`` or ``float32`` (with ``policy``).
        resume: Continue a partial store made with the same settings.
        force: Overwrite an existing store.
        progress: Called after every decode step with a [`Progress`][kvscope.tracing.runner.Progress].
        cache: A cache factory instead of ``policy``/``budget`` (a
            [`LivePolicy`][kvscope.live.LivePolicy]); default: the cache the model makes itself.
        shard: Decode only this shard's batches into a store that several shards write together.
        continuation: A given text forced as the decode steps instead of the model's tokens
            (teacher forcing): one text for a single prompt, or one per prompt (or each
            [`Prompt`][kvscope.model.prompts.Prompt]'s ``continuation``). Step ``t`` emits its
            token ``t``; ``min(its tokens, max_new_tokens)`` steps, all of it with
            ``max_new_tokens=None``; no stop at end-of-sequence; greedy only.
        **overrides: Fields of [`TraceSettings`][kvscope.TraceSettings] by name.

    Returns:
        What was decoded: steps and texts of each sample, seconds, bytes written.

    Raises:
        KvscopeError: Bad input or an unusable store (one line naming the problem).
    """
    from .errors import KvscopeError
    from .tracing import runner

    if (policy is None) != (budget is None):
        raise KvscopeError("--policy and --budget go together")
    if policy is not None:
        from .live import LivePolicy

        cache = LivePolicy(policy, budget, kv_dtype, allocation)
    return runner.trace(
        prompts, out, settings, resume=resume, force=force, progress=progress, cache=cache, shard=shard,
        continuation=continuation, **overrides,
    )  # fmt: skip


def view(ds: xr.Dataset, result: xr.Dataset | None = None, *, tokens: str = "model", title: str = "") -> Any:
    """The attention explorer of a trace, and of a replay result, in Jupyter (needs Panel).

    Args:
        ds: A trace ([`open_trace`][kvscope.open_trace]).
        result: A replay result of that trace ([`open_result`][kvscope.open_result]): its
            policies' tiers are overlaid; with answers (``replay --forced`` of a ``trace --dataset``
            store), a table shows the samples each policy loses or gains against full KV.
        tokens: How a token is labelled: ``model``, its text by the model's tokenizer (found
            locally), or ``ids``, ``#id``.
        title: The explorer's title (default: the store and its model).

    Returns:
        A Panel object: displayed by Jupyter, served by ``.servable()``.
    """
    from . import explorer

    return explorer.view(ds, result, tokens=tokens, title=title)


__all__ = ["TraceSettings", "__version__", "open_result", "open_trace", "replay", "trace", "view"]
