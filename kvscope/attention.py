"""The attention rule — one definition for capture, replay, recompute and the live cache.

For a query at position ``q`` and keys at positions ``p`` (one layer, one head)::

    logit[p] = c · tanh(q·k[p] · scaling / c)        (plain q·k[p] · scaling without softcap c)
    visible  = p ≤ q  ∧  q − p < window               (window only on sliding-attention layers)
    a[p]     = softmax over the visible keys (fp32);  a row with no visible key is all zeros

``scaling`` and ``softcap`` are the layer's (:class:`kvscope.model_spec.ModelSpec.rule`).
Grouped-query attention needs no copies of the keys: the query heads that share a KV head
are stacked as extra rows (:func:`grouped`), ``[.., kv_head, group·rows, D] @ [.., kv_head, D, keys]``.

Everything is torch; numpy inputs are converted by the callers (``torch.from_numpy``), so
there is exactly one implementation of the rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def grouped(query: torch.Tensor, n_kv: int) -> torch.Tensor:
    """``[..., head, rows, D]`` → ``[..., kv_head, group·rows, D]`` (heads of a group stacked)."""
    *lead, h, r, d = query.shape
    return query.reshape(*lead, n_kv, (h // n_kv) * r, d)


def logits(query: torch.Tensor, key: torch.Tensor, scaling, softcap: float | None = None) -> torch.Tensor:
    """``[..., rows, D] × [..., keys, D]`` → ``[..., rows, keys]`` in the inputs' dtype.

    ``scaling``: a number, or a tensor broadcastable to the result (one per layer: ``[L, 1, 1, 1]``).
    A power of two (``1/√D`` for D = 64, 256, …) scales the queries instead of the logits: a
    shift of binary exponents commutes with every rounding of the matmul, so the bits are the
    same (barring under- or overflow), at rows·D multiplications instead of rows·keys."""
    if isinstance(scaling, float) and math.frexp(scaling)[0] == 0.5:
        scores = torch.matmul(query * scaling, key.transpose(-1, -2))
    else:
        scores = torch.matmul(query, key.transpose(-1, -2))
        scores.mul_(scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores


def visible(q_pos, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """bool, True where the query at ``q_pos`` sees the key at ``k_pos`` (broadcast):
    ``0 ≤ p ≤ q`` and, on a sliding-window layer, ``q − p < window``."""
    q_pos = torch.as_tensor(q_pos, device=k_pos.device)
    out = (k_pos <= q_pos) & (k_pos >= 0)
    if window:
        out &= q_pos - k_pos < window
    return out


def softmax(
    scores: torch.Tensor, visible: torch.Tensor | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 probabilities over the last dim. ``visible`` (bool) hides keys; a row with no
    visible key comes out as zeros. ``bias``: an additive mask (transformers' float masks)."""
    scores = scores.to(torch.float32)
    if bias is not None:
        scores = scores + bias.to(torch.float32)
    if visible is None:
        return torch.softmax(scores, dim=-1)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.nan_to_num_(probs, nan=0.0)


@dataclass(frozen=True)
class AttentionRule:
    """One layer's parameters of the rule."""

    scaling: float
    softcap: float | None = None
    window: int | None = None  # sliding window (keys with q − p ≥ window are hidden)

    def logits(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return logits(query, key, self.scaling, self.softcap)

    def visible(self, q_pos, k_pos: torch.Tensor) -> torch.Tensor:
        return visible(q_pos, k_pos, self.window)

    def probs(self, query, key, q_pos, k_pos, present: torch.Tensor | None = None) -> torch.Tensor:
        """Probabilities ``[..., rows, keys]`` of queries at ``q_pos [rows, 1]`` over keys at
        ``k_pos [keys]``; ``present`` (bool, broadcastable) hides keys a cache no longer holds."""
        shown = self.visible(q_pos, k_pos)
        if present is not None:
            shown = shown & present
        return softmax(self.logits(query, key), shown)


@dataclass(frozen=True)
class LayerRules:
    """The rules of every layer, applied to tensors with a leading layer dim ``[L, ...]``."""

    rules: tuple[AttentionRule, ...]

    def logits(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """``[L, ..., rows, D] × [L, ..., keys, D]`` → ``[L, ..., rows, keys]``."""
        scaling = torch.tensor([r.scaling for r in self.rules], dtype=query.dtype, device=query.device)
        scaling = scaling.view(-1, *([1] * (query.dim() - 1)))
        caps = {r.softcap for r in self.rules}
        if len(caps) == 1:
            return logits(query, key, scaling, caps.pop())
        out = logits(query, key, scaling)
        for layer, rule in enumerate(self.rules):
            if rule.softcap is not None:
                out[layer] = torch.tanh(out[layer] / rule.softcap) * rule.softcap
        return out

    def visible(self, q_pos: int, n_keys: int, device=None) -> torch.Tensor:
        """``[L, n_keys]`` bool: what a query at ``q_pos`` sees of keys ``0..n_keys−1`` per layer."""
        k_pos = torch.arange(n_keys, device=device)
        return torch.stack([rule.visible(q_pos, k_pos) for rule in self.rules])

    def probs(self, query, key, q_pos: int, present: torch.Tensor | None = None) -> torch.Tensor:
        """``[L, kv_head, rows, keys]`` probabilities of queries at ``q_pos`` over keys
        ``0..keys−1`` (``present [L, kv_head, keys]`` hides absent keys)."""
        shown = self.visible(q_pos, key.shape[-2], key.device)[:, None, None, :]  # [L, 1, 1, keys]
        if present is not None:
            shown = shown & present[:, :, None, :]
        return softmax(self.logits(query, key), shown)
