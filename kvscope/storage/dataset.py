"""``ds.kvscope``: a trace's geometry, read once from its attributes and coordinates.

    ds = kvscope.open_trace("demo.zarr")
    ds.kvscope.w, ds.kvscope.n_sink          # windows and sinks the trace was recorded with
    ds.kvscope.hdim                          # the stored head dim: "kv_head" or "head"
    ds.kvscope.model                         # ModelSpec (layers, heads, rule per layer)
    ds.kvscope.query_pos                     # [sample, step] numpy
    ds.kvscope.has_qkv, ds.kvscope.rope      # recorded q/k/v and rotary parameters
    ds.kvscope.rows                          # RowFormat: how the rows are stored (exact or lossy)

xarray caches an accessor per Dataset object, so each value is computed once per Dataset.
"""

from __future__ import annotations

import functools

import numpy as np
import xarray as xr

from .. import defaults
from ..errors import KvscopeError
from ..model.rope import Rope
from ..model.spec import ModelSpec
from .rowformat import RowFormat


@xr.register_dataset_accessor("kvscope")
class TraceAccessor:
    """``ds.kvscope`` of a trace opened with [`open_trace`][kvscope.open_trace]: what the trace
    was recorded with and the model's geometry, read from its attributes and coordinates (the
    module docstring).

    Args:
        ds: The trace.
    """

    def __init__(self, ds: xr.Dataset):
        self._ds = ds

    @property
    def attrs(self) -> dict:
        """The trace's group attributes."""
        return self._ds.attrs

    # -- recording settings ------------------------------------------------------------------
    @property
    def w(self) -> int:
        """The window size the trace was recorded with."""
        return int(self.attrs.get("w", defaults.W))

    @property
    def n_sink(self) -> int:
        """The sinks the trace was recorded with."""
        return int(self.attrs.get("n_sink", defaults.N_SINK))

    @property
    def obs_window(self) -> int:
        """The last prefill rows stored (``prefill_tail``)."""
        return int(self.attrs.get("obs_window", defaults.OBS_WINDOW))

    @property
    def block_steps(self) -> int:
        """Steps per stored chunk of rows."""
        return int(self.attrs.get("block_steps", defaults.BLOCK_STEPS))

    @property
    def resolution(self) -> str:
        """``token`` (one value per position) or ``window`` (window sums)."""
        return str(self.attrs.get("resolution", "token"))

    @functools.cached_property
    def rows(self) -> RowFormat:
        """How the probability rows are stored (``kvscope.storage.rowformat``; exact unless compacted)."""
        return RowFormat.of(self.attrs)

    @property
    def hdim(self) -> str:
        """The stored head dim of ``attn``: ``kv_head`` (kv-group rows) or ``head``."""
        return "kv_head" if "kv_head" in self._ds["attn"].dims else "head"

    @property
    def policy(self) -> dict | None:
        """What a trace recorded under a live policy cache says about it (None otherwise)."""
        return self.attrs.get("policy")

    # -- the model ---------------------------------------------------------------------------
    @functools.cached_property
    def model(self) -> ModelSpec:
        """The model's geometry: layers, heads, the attention rule of each layer, cache geometry."""
        ds = self._ds
        config = (self.attrs.get("model") or {}).get("config") or {}
        if not (config.get("head_dim") or "dim" in ds.sizes):
            raise KvscopeError("the trace does not record the model's head_dim (attrs model.config)")
        return ModelSpec.from_config(
            config,
            n_layers=ds.sizes.get("layer"),
            n_heads=ds.sizes.get("head"),
            n_kv_heads=ds.sizes.get("kv_head"),
            head_dim=ds.sizes.get("dim"),
        )

    @property
    def group(self) -> int:
        """Stored rows per KV head: 1 for kv-group rows, the GQA group for ``--heads all``."""
        if self.hdim == "kv_head":
            return 1
        spec = self.model
        if self._ds.sizes["head"] == spec.n_heads and spec.n_kv_heads:
            return spec.n_heads // spec.n_kv_heads
        raise KvscopeError("this needs per-KV-head rows: trace with --heads kv (default) or --heads all")

    @property
    def has_qkv(self) -> bool:
        """The trace recorded q/k/v (``--record qkv``)."""
        return all(name in self._ds for name in ("q", "k", "v"))

    @functools.cached_property
    def rope(self) -> Rope | None:
        """Recorded rotary parameters, or None."""
        if "rope_inv_freq" not in self._ds:
            return None
        return Rope(
            np.asarray(self._ds["rope_inv_freq"].values, np.float64),
            np.asarray(self._ds["rope_attention_scaling"].values),
        )

    # -- per sample --------------------------------------------------------------------------
    @functools.cached_property
    def query_pos(self) -> np.ndarray:
        """``[sample, step]`` query position of every step (−1 past the sample's steps)."""
        return np.asarray(self._ds["query_pos"].values)

    @functools.cached_property
    def n_steps(self) -> np.ndarray:
        """``[sample]`` valid steps."""
        return np.asarray(self._ds["n_steps"].values)

    def require_steps(self) -> None:
        """Refuse a trace without a single committed step (nothing to measure)."""
        if not self.n_steps.any():
            raise KvscopeError(
                "the trace holds no committed decode steps (a partial store killed before its first block)"
            )

    @functools.cached_property
    def prompt_len(self) -> np.ndarray:
        """``[sample]`` prompt tokens (the context alone in a question-agnostic trace)."""
        return np.asarray(self._ds["prompt_len"].values)

    @property
    def question_agnostic(self) -> bool:
        """The prefill held the context only; the question was decoded as the first steps."""
        return "question_tokens" in self.attrs

    @functools.cached_property
    def question_tokens(self) -> np.ndarray:
        """``[sample]`` forced question steps before the generated ones (0 without the protocol)."""
        return np.asarray(self.attrs.get("question_tokens", [0] * self._ds.sizes["sample"]), dtype=np.int64)

    @functools.cached_property
    def contexts(self) -> np.ndarray:
        """``[sample]`` the index of each sample's context, in order of first appearance: in a
        question-agnostic trace the samples whose prefills hold the same tokens share one (a
        context with several questions); otherwise every sample is its own."""
        if not self.question_agnostic:
            return np.arange(self._ds.sizes["sample"])
        tokens = np.asarray(self._ds["tokens"].values)  # [sample, token]
        seen: dict[bytes, int] = {}
        return np.asarray(
            [seen.setdefault(tokens[s, :P].tobytes(), len(seen)) for s, P in enumerate(self.prompt_len)], dtype=np.int64
        )

    @functools.cached_property
    def final_len(self) -> np.ndarray:
        """``[sample]`` the final length a sample's budget is a share of: ``P + S``, the longest of
        its context's samples where they share one (each question is answered over the same
        compressed context, docs/replay.md#several-questions-per-context)."""
        ends = self.prompt_len + self.n_steps  # [sample]
        longest = np.zeros(int(self.contexts.max(initial=-1)) + 1, dtype=np.int64)
        np.maximum.at(longest, self.contexts, ends)
        return longest[self.contexts]

    @property
    def continued(self) -> bool:
        """The decode steps forced a given continuation (``trace --continuation``) after any
        question, instead of the model's own tokens."""
        return "continuation_tokens" in self.attrs

    @functools.cached_property
    def continuation_tokens(self) -> np.ndarray:
        """``[sample]`` forced continuation steps after the question (0 without a given continuation)."""
        return np.asarray(self.attrs.get("continuation_tokens", [0] * self._ds.sizes["sample"]), dtype=np.int64)

    def generated(self, s: int) -> np.ndarray:
        """Token ids sample ``s`` generated (after a forced question; a given continuation's
        tokens where the trace forced one).

        Args:
            s: The sample's index.
        """
        start = int(self.prompt_len[s] + self.question_tokens[s])
        return np.asarray(self._ds["tokens"].values[s, start : int(self.prompt_len[s] + self.n_steps[s])])
