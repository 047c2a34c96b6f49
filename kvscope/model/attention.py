"""The attention rule — one definition for capture, replay, recompute and the live cache.

For a query at position ``q`` and keys at positions ``p`` (one layer, one head):

    logit[p] = c · tanh(q·k[p] · scaling / c)        (plain q·k[p] · scaling without softcap c)
    visible  = p ≤ q  ∧  q − p < window               (window only on sliding-attention layers)
    a[p]     = softmax over the visible keys (fp32);  a row with no visible key is all zeros

With a learned sink (gpt-oss: one logit ``s_h`` per query head) the softmax has one more
column that no key holds, and a row sums to ``1 − σ`` with ``σ = e^{s_h} / (e^{s_h} + Σ e^{logit})``
the sink's share:

    a[p] = e^{logit[p]} / (e^{s_h} + Σ_visible e^{logit})

``scaling``, ``softcap`` and ``sinks`` are the layer's (``kvscope.model.spec.ModelSpec.rule``).
Grouped-query attention needs no copies of the keys: the query heads that share a KV head
are stacked as extra rows (``grouped``), ``[.., kv_head, group·rows, D] @ [.., kv_head, D, keys]``.

Everything is torch; numpy inputs are converted by the callers (``torch.from_numpy``), so
there is exactly one implementation of the rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch


def grouped(query: torch.Tensor, n_kv: int) -> torch.Tensor:
    """``[..., head, rows, D]`` → ``[..., kv_head, group·rows, D]`` (heads of a group stacked)."""
    *lead, h, r, d = query.shape
    return query.reshape(*lead, n_kv, (h // n_kv) * r, d)


def logits(
    query: torch.Tensor, key: torch.Tensor, scaling, softcap: float | None = None, float32: bool = False
) -> torch.Tensor:
    """``[..., rows, D] × [..., keys, D]`` → ``[..., rows, keys]`` in the inputs' dtype, or in
    float32 with ``float32=True`` (``matmul_float32``: no float32 copy of the keys).

    ``scaling``: a number, or a tensor broadcastable to the result (one per layer: ``[L, 1, 1, 1]``).
    A power of two (``1/√D`` for D = 64, 256, …) scales the queries instead of the logits: a
    shift of binary exponents commutes with every rounding of the matmul, so the bits are the
    same (barring under- or overflow), at rows·D multiplications instead of rows·keys."""
    matmul = matmul_float32 if float32 else _matmul
    if isinstance(scaling, float) and math.frexp(scaling)[0] == 0.5:
        scores = matmul(query * scaling, key)
    else:
        scores = matmul(query, key)
        scores.mul_(scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a · bᵀ`` over the last two dims, in the inputs' dtype."""
    return torch.matmul(a, b.transpose(-1, -2))


def matmul_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [..., rows, D] · b [..., keys, D]ᵀ`` → ``[..., rows, keys]`` in float32, the leading
    dims of ``a`` and ``b`` equal. The product of two float16 or bfloat16 numbers is exact in
    float32, so accumulating the inputs' products in float32 equals upcasting them first, up to
    summation order; where the device multiplies 16-bit matrices into float32 (CUDA's
    ``bmm(out_dtype=float32)``, ``accumulates_in_float32``) neither input is copied to
    float32, elsewhere both are."""
    if a.dtype == b.dtype == torch.float32:
        return _matmul(a, b)
    if a.dtype != b.dtype or a.shape[:-2] != b.shape[:-2] or not accumulates_in_float32(a.device, a.dtype):
        return _matmul(a.to(torch.float32), b.to(torch.float32))
    rows, keys = a.shape[-2], b.shape[-2]
    out = torch.bmm(a.reshape(-1, rows, a.shape[-1]), b.reshape(-1, keys, b.shape[-1]).transpose(-1, -2),
                    out_dtype=torch.float32)  # fmt: skip
    return out.view(*a.shape[:-2], rows, keys)


_FLOAT32_BMM: dict[tuple[str, torch.dtype], bool] = {}


def accumulates_in_float32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch multiplies ``dtype`` matrices on ``device`` into float32 (``bmm`` with
    ``out_dtype``: CUDA with float16/bfloat16 inputs, torch ≥ 2.8), tried once per device kind."""
    key = (device.type, dtype)
    if key not in _FLOAT32_BMM:
        ok = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
        if ok:
            try:
                x = torch.ones((1, 2, 2), dtype=dtype, device=device)
                ok = torch.bmm(x, x, out_dtype=torch.float32).dtype == torch.float32
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _FLOAT32_BMM[key] = ok
    return _FLOAT32_BMM[key]


def visible(q_pos, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """bool, True where the query at ``q_pos`` sees the key at ``k_pos`` (broadcast):
    ``0 ≤ p ≤ q`` and, on a sliding-window layer, ``q − p < window``."""
    q_pos = torch.as_tensor(q_pos, device=k_pos.device)
    out = (k_pos <= q_pos) & (k_pos >= 0)
    if window:
        out &= q_pos - k_pos < window
    return out


def softmax(
    scores: torch.Tensor,
    visible: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 probabilities over the last dim. ``visible`` (bool) hides keys; a row with no
    visible key comes out as zeros (all its mass on the sink, with one). ``bias``: an additive
    mask (transformers' float masks). ``sink``: learned sink logits broadcastable to
    ``scores[..., :1]`` — one more column of the softmax, dropped from the result."""
    scores = scores.to(torch.float32)
    if bias is not None:
        scores = scores + bias.to(torch.float32)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    if sink is not None:
        column = sink.to(torch.float32).expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    probs = torch.softmax(scores, dim=-1)
    return probs if visible is None else torch.nan_to_num_(probs, nan=0.0)


def grouped_sinks(sinks, n_kv: int, rows: int) -> torch.Tensor:
    """Per-query-head sink logits ``[head]`` as a column of the grouped layout of
    ``grouped``: ``[kv_head, group·rows, 1]`` (row ``j·rows + i`` of KV head ``k`` is query
    head ``k·group + j``)."""
    sinks = torch.as_tensor(sinks, dtype=torch.float32)
    return sinks.view(n_kv, -1, 1, 1).expand(n_kv, sinks.numel() // n_kv, rows, 1).reshape(n_kv, -1, 1)


@dataclass(frozen=True)
class AttentionRule:
    """One layer's parameters of the rule."""

    scaling: float
    softcap: float | None = None
    window: int | None = None  # sliding window (keys with q − p ≥ window are hidden)
    sinks: tuple[float, ...] | None = None  # learned sink logit of each query head

    def logits(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return logits(query, key, self.scaling, self.softcap)

    def visible(self, q_pos, k_pos: torch.Tensor) -> torch.Tensor:
        return visible(q_pos, k_pos, self.window)

    def of_kv_heads(self, first: int, count: int, n_kv: int) -> AttentionRule:
        """This rule for KV heads ``first … first + count − 1`` of ``n_kv`` only (the sinks of
        their query heads), for queries grouped over those heads alone."""
        if self.sinks is None:
            return self
        g = len(self.sinks) // n_kv
        return replace(self, sinks=self.sinks[first * g : (first + count) * g])

    def sink_column(self, query: torch.Tensor) -> torch.Tensor | None:
        """The sink logits for grouped queries ``[.., kv_head, group·rows, D]``: ``[kv_head,
        group·rows, 1]`` (None without learned sinks)."""
        if self.sinks is None:
            return None
        n_kv, stacked = query.shape[-3], query.shape[-2]
        return grouped_sinks(self.sinks, n_kv, stacked * n_kv // len(self.sinks)).to(query.device)

    def probs(self, query, key, q_pos, k_pos, present: torch.Tensor | None = None) -> torch.Tensor:
        """Probabilities ``[..., kv_head, group·rows, keys]`` of grouped queries (``grouped``)
        at ``q_pos`` (broadcastable to ``[..., group·rows, 1]``) over keys at ``k_pos [keys]``;
        ``present`` (bool, broadcastable) hides keys a cache no longer holds."""
        shown = self.visible(q_pos, k_pos)
        if present is not None:
            shown = shown & present
        return softmax(self.logits(query, key), shown, sink=self.sink_column(query))


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
        return softmax(self.logits(query, key), shown, sink=self.sink_column(query))

    def sink_column(self, query: torch.Tensor) -> torch.Tensor | None:
        """Learned sink logits for grouped queries ``[L, kv_head, group·rows, D]``: ``[L,
        kv_head, group·rows, 1]``, −inf on a layer without sinks; None where no layer has any."""
        if all(rule.sinks is None for rule in self.rules):
            return None
        columns = [
            rule.sink_column(query[layer])
            if rule.sinks is not None
            else torch.full((*query.shape[1:3], 1), float("-inf"), device=query.device)
            for layer, rule in enumerate(self.rules)
        ]
        return torch.stack(columns)
