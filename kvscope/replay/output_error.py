"""What a policy's cache does to attention, against full KV (needs ``--record qkv``).

For the first query after each event (and, with ``observe="exact"``, every query a policy
observes), per layer and query head, with the model's attention rule (``kvscope.model.attention``):

    reference   a*  = softmax over keys 0..q of the full cache,   o* = a*·V
    policy      a   = softmax over the keys the cache holds (Q keys dequantized, evicted absent),
                o   = a·V̂
    attn_l1     = Σ_p |a[p] − a*[p]|                               mean over the heads of a KV group
    output_rel_l2 = ‖o − o*‖ / ‖o*‖                               mean over the heads of a KV group
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..policies import CacheState
from ..tiers import TIER_FP, TIER_Q

if TYPE_CHECKING:  # torch only where errors are computed (q/k/v recorded): replay itself is numpy
    import torch

    from ..model.attention import LayerRules


@dataclass
class Reference:
    """Full-KV attention of one query: logits and probabilities ``[L, Hkv, g, n]``, output
    ``[L, Hkv, g, D]``, which keys the query sees (``[L, 1, 1, n]``) and the full cache's
    values in float32 ``[L, Hkv, n, D]`` (converted once: every run that only evicts reads them)."""

    query: torch.Tensor  # [L, Hkv, g, D]
    logits: torch.Tensor
    shown: torch.Tensor
    probs: torch.Tensor
    out: torch.Tensor
    values: torch.Tensor  # [L, Hkv, n, D] float32
    sink: torch.Tensor | None = None  # [L, Hkv, g, 1] learned sink logits (None without)


def reference(rules: LayerRules, query: np.ndarray, k, v, qpos: int) -> Reference:
    """``query [L, head, D]`` (numpy) against the full cache ``k``, ``v [L, Hkv, ≥ qpos+1, D]``
    (numpy or torch, as recorded)."""
    import torch

    n, n_kv = qpos + 1, k.shape[1]
    q = torch.from_numpy(query.reshape(query.shape[0], n_kv, -1, query.shape[-1]))
    shown = rules.visible(qpos, n)[:, None, None, :]
    values = _torch(v)[:, :, :n].float()  # [L, Hkv, n, D]
    sink = rules.sink_column(q)
    logits, probs, out = attended(rules, q, _torch(k)[:, :, :n], values, shown=shown, sink=sink)
    return Reference(query=q, logits=logits, shown=shown, probs=probs, out=out, values=values, sink=sink)


def effective_kv(state: CacheState, k: np.ndarray | torch.Tensor, v: np.ndarray | torch.Tensor, n: int) -> tuple:
    """The cache a state serves over positions ``0..n−1``: ``keys, values [L, Hkv, n, D]``
    and ``present [L, Hkv, n]``. Positions that were ever quantized hold their dequantized
    values (in Q, and after a promotion: the originals are gone); evicted ones are absent.

    Args:
        state: A policy's cache state.
        k: The full-KV keys ``[L, Hkv, pos, D]`` (numpy or torch), returned where nothing was quantized.
        v: The full-KV values, likewise.
        n: The positions served.
    """
    present = state.tiers[..., :n] >= TIER_Q
    if dequantized(state):
        return state.ledger.k_eff[:, :, :n], state.ledger.v_eff[:, :, :n], present
    return k[:, :, :n], v[:, :, :n], present


def dequantized(state: CacheState) -> bool:
    """The state serves dequantized values somewhere (its ledger keeps them and quantized any)."""
    ledger = state.ledger
    return ledger is not None and ledger.k_eff is not None and bool(ledger.n_quantized)


def lossless(state: CacheState, n: int) -> bool:
    """The state holds keys ``0..n−1`` exactly as full KV does (all FP, none ever quantized)."""
    tiers = state.tiers[..., :n]
    return bool((tiers == TIER_FP).all()) and (state.ledger is None or not state.ledger.done[..., :n].any())


def only_evicted(state: CacheState, n: int) -> bool:
    """The state's comparison over keys ``0..n−1`` reuses the full-KV logits and values: it lost
    keys, and changed none (``evicted_errors`` batches such comparisons)."""
    return not dequantized(state) and not lossless(state, n)


BATCH_BYTES = 1 << 26  # the probabilities of the runs one evicted_errors batch holds


def evicted_errors(
    rules: LayerRules, ref: Reference, presents: list[np.ndarray], batch_bytes: int = BATCH_BYTES
) -> tuple[np.ndarray, np.ndarray]:
    """``against_full``'s errors for caches that ``only_evicted``, batched: each run's
    held keys ``presents[i] [L, Hkv, n]`` → ``l1, rel [run, L, Hkv]``. The runs' query rows are
    stacked (``[L, Hkv, runs·g, n]``): one softmax of the full-KV logits masked for all, and per
    layer and block of positions one product with V for all — row by row the same operations as
    each run's own (bit for bit; V is read once instead of once per run). At most ``batch_bytes``
    of probabilities at a time."""
    import torch

    n_l, n_kv, g, n = ref.probs.shape
    batch = max(1, batch_bytes // (4 * n_l * n_kv * g * n))
    l1, rel = [], []
    for a in range(0, len(presents), batch):
        present = torch.from_numpy(np.stack(presents[a : a + batch], axis=2))  # [L, Hkv, runs, n]
        runs = present.shape[2]
        shown = (ref.shown[:, :, :, None] & present[:, :, :, None, :]).expand(n_l, n_kv, runs, g, n)
        logits = ref.logits[:, :, None].expand(n_l, n_kv, runs, g, n)
        stacked = (n_l, n_kv, runs * g, n)
        sink = None if ref.sink is None else ref.sink.repeat(1, 1, runs, 1)  # rows in (run, head) order
        _, probs, out = attended(
            rules, None, None, ref.values, shown=shown.reshape(stacked), logits=logits.reshape(stacked), sink=sink
        )
        probs, out = probs.view((n_l, n_kv, runs, g, n)), out.view((n_l, n_kv, runs, g, -1))
        l1.append((probs - ref.probs[:, :, None]).abs().sum(-1).mean(-1))  # [L, Hkv, runs]
        norm = torch.linalg.vector_norm(ref.out, dim=-1)[:, :, None]
        error = torch.linalg.vector_norm(out - ref.out[:, :, None], dim=-1) / norm
        rel.append(torch.where(norm > 0, error, torch.nan).mean(-1))
    units = presents[0].shape[1] if presents else n_kv
    l1, rel = torch.cat(l1, -1).permute(2, 0, 1).numpy(), torch.cat(rel, -1).permute(2, 0, 1).numpy()
    return per_unit(l1, units, 2), per_unit(rel, units, 2)


def against_full(rules: LayerRules, state: CacheState, ref: Reference, k, v, qpos: int, row=True):
    """The state's kv-group row ``[L, Hkv, n]`` (None unless ``row``: only observe=exact reads
    it), the attention L1 distance and the output's relative L2 error ``[L, Hkv]`` (module
    docstring). ``k``/``v``: the full KV as recorded (numpy or torch). A cache that only evicts
    reuses the full-KV logits; one that lost nothing is exact."""
    import torch

    n = qpos + 1
    units = state.tiers.shape[1]
    if lossless(state, n):
        zeros = np.zeros(state.tiers.shape[:2])
        return per_unit(ref.probs.mean(2).numpy(), units, 1) if row else None, zeros, zeros
    keys, values, present = effective_kv(state, k, v, n)
    shown = ref.shown & torch.from_numpy(present)[:, :, None, :]
    changed = dequantized(state)
    logits = None if changed else ref.logits  # quantized values: the logits change too
    values = values if changed else ref.values  # evicted only: the full values, float32 already
    _, probs, out = attended(rules, ref.query, _torch(keys), _torch(values), shown=shown, logits=logits, sink=ref.sink)
    l1 = (probs - ref.probs).abs().sum(-1).mean(-1)
    norm = torch.linalg.vector_norm(ref.out, dim=-1)
    rel = torch.where(norm > 0, torch.linalg.vector_norm(out - ref.out, dim=-1) / norm, torch.nan).mean(-1)
    row_out = per_unit(probs.mean(2).numpy(), units, 1) if row else None
    return row_out, per_unit(l1.numpy(), units, 1), per_unit(rel.numpy(), units, 1)


def per_unit(x: np.ndarray, units: int, axis: int) -> np.ndarray:
    """``x`` over the keys' heads along ``axis`` → over the cache's ``units`` (the mean of the heads
    of each: under MLA every query head has its own key, and one latent serves them all)."""
    heads = x.shape[axis]
    if heads == units:
        return x
    shape = x.shape[:axis] + (units, heads // units) + x.shape[axis + 1 :]
    return x.reshape(shape).mean(axis + 1)


SCRATCH_BYTES = 1 << 20  # a float32 block of one KV head's K or V (stays in cache; not split with the heads)
# rows of every probs · V product: MKL's sgemm sums a product of 1–3 rows with another kernel than one of
# 4 or more (on a Zen 4 CPU each row's bits then differ from the same row in a larger product), and a
# reference or a lone run has g rows (3 for SmolLM2) where stacked runs have more
MIN_PRODUCT_ROWS = 4


def attended(rules: LayerRules, query, keys, values, shown, logits=None, block: int | None = None, sink=None):
    """``(logits, probs [L, Hkv, g, n], out [L, Hkv, g, D])`` of ``query [L, Hkv, g, D]`` over
    ``keys``/``values [L, Hkv, n, D]`` (torch, in their stored dtype: fp16 by default), hiding
    what ``shown`` hides; with ``logits`` given the keys and the query are not read; ``sink``
    (``[L, Hkv, g, 1]``): the learned sink logits of the rows (``LayerRules.sink_column``).

    K and V in 16 bit are converted to float32 a block of ``block`` positions of one layer at a
    time (default: ``SCRATCH_BYTES`` per KV head) into a scratch that stays in cache, instead
    of a float32 copy of the whole K/V: a memory-bound matmul then reads each value once, not
    three times; float32 ones are read in place, in the same blocks. Where one block covers every
    position this is bit for bit the batched computation over float32 copies (each layer one
    batch entry); with several, each logit is the same dot product (the matmul kernel may differ
    with the block's width: equal to float32 rounding) and ``out = Σ_blocks probs[.., block] ·
    V[block]`` the same sum grouped by block. Products of fewer than ``MIN_PRODUCT_ROWS``
    rows get zero rows below them, so that a row's output has the same bits whatever else is
    stacked with it (a run alone or with others, the reference)."""
    import torch

    from ..model.attention import softmax

    n_l, n_kv, n, d = values.shape
    block = block or max(1, SCRATCH_BYTES // (4 * d))  # the same spans whatever KV heads a task holds
    spans = [slice(a, min(a + block, n)) for a in range(0, n, block)]
    scratch: dict[int, torch.Tensor] = {}  # by channels: [Hkv, block, D] float32 (keys and values differ under MLA)

    def block_of(x, layer: int, span: slice):  # [Hkv, span, D] float32
        if x.dtype == torch.float32:
            return x[layer, :, span]
        width = x.shape[-1]
        if width not in scratch:
            scratch[width] = torch.empty(n_kv, min(block, n), width)
        return scratch[width][:, : span.stop - span.start].copy_(x[layer, :, span])

    if logits is None:
        logits = torch.empty(n_l, n_kv, query.shape[2], n)  # [L, Hkv, g, n]
        for layer, rule in enumerate(rules.rules):
            for span in spans:
                logits[layer, :, :, span] = rule.logits(query[layer], block_of(keys, layer, span))
    probs = softmax(logits, shown, sink=sink)
    rows = probs.shape[2]
    weights = probs  # [L, Hkv, ≥ MIN_PRODUCT_ROWS, n]
    if rows < MIN_PRODUCT_ROWS:
        weights = torch.zeros(n_l, n_kv, MIN_PRODUCT_ROWS, n)
        weights[:, :, :rows] = probs
    out = torch.zeros(*weights.shape[:-1], d)  # [L, Hkv, rows (padded), D]
    for layer in range(n_l):
        for span in spans:
            v = block_of(values, layer, span)
            if span.start == 0:
                torch.matmul(weights[layer, :, :, span], v, out=out[layer])
            else:
                out[layer].baddbmm_(weights[layer, :, :, span], v)
    return logits, probs, out[:, :, :rows].contiguous()  # the padding's rows dropped (a no-op without)


def _torch(x):
    import torch

    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def renormalized(row: np.ndarray, accessible: np.ndarray, share: np.ndarray | None = None) -> np.ndarray:
    """``row`` restricted to ``accessible`` and renormalized per (layer, kv_head): what a policy
    observes in open loop (``observe="renorm"``). The rows then sum to 1 — or, under learned
    sinks (``share [layer, kv_head]``: the sink's share σ of the full-KV row), the sink keeps its
    logit in a cache that lost keys: ``seen = a·[accessible] / (Σ a·[accessible] + σ)``."""
    seen = row * accessible  # rows are finite and ≥ 0: the same values as where(accessible, row, 0)
    total = seen.sum(-1, keepdims=True)
    if share is not None:
        total = total + share[..., None]
    return seen / np.where(total > 0, total, 1.0)  # a unit with nothing seen stays 0
