"""The attention of a forced chunk: every attention layer's output for a chunk of forced steps under
the policy's tier maps, called by kvscope's attention function while
``kvscope.tracing.capture.attention_override`` holds it. The rule is ``kvscope.model.attention``'s
(fp32 logits and softmax, ``out = a·V`` in the value's dtype); the heads of a GQA group are stacked
as rows (``attention.grouped``), transformers' mask read as ``kvscope.tracing.capture.mask_terms``
reads it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...tiers import TIER_Q


@dataclass(frozen=True)
class KeySlots:
    """Which position each key slot a layer hands attention holds: the cache's last slots, or past
    a press that rewrote its cache (``pressed``), the rows it kept and then the continuation's."""

    prompt_len: int  # P
    pressed: object = None  # the cache a prompt-time press left, where it rewrote what it kept

    def positions(self, layer: int, kv: int, seq: int) -> np.ndarray:
        """``[unit | kv_head, kv]`` the positions of the ``kv`` slots a layer hands over in a
        sequence of ``seq``: its last ``kv`` (every head alike), or the press's rows then the
        continuation's."""
        if self.pressed is None:
            return np.arange(seq - kv, seq)[None]
        kept = self.pressed.layers[layer].positions.cpu().numpy()  # [kv_head, n]
        new = np.arange(self.prompt_len, self.prompt_len + kv - kept.shape[1])
        return np.concatenate([kept, np.broadcast_to(new, (kept.shape[0], len(new)))], axis=1)

    def last(self, positions: np.ndarray) -> slice | None:
        """The positions as a slice where they are the cache's last slots (no press rewrote the
        cache), else None."""
        return slice(int(positions[0, 0]), int(positions[0, -1]) + 1) if self.pressed is None else None


class ChunkAttention:
    """Every attention layer's output for the chunk ``steps`` under the tier maps
    ``maps [c, layer, unit, P + S]``.

    Key slot ``j`` of the ``kv`` the layer hands over holds position ``slots.positions`` (the cache's
    last slots: ``seq − kv + j``, ``seq = P − 1 + stop``). Per query ``t`` and unit, a key is shown
    where ``T_t ≥ Q`` (and the model's own mask shows it); keys and values of positions the ledger
    quantized before ``t`` are its dequantized ones, from ``quantized(layer, keys, values, first=…)``
    (``ServedQuantized.window`` of the round, or None where the ledger quantizes nothing). Where
    ``rows`` is given the kv-group rows the queries see are written into it ``[c, layer, unit, P + S]``;
    with ``keep_feeds`` each new position's q/k/v are kept (``step_feeds``)."""

    def __init__(self, steps: range, maps: np.ndarray, *, rows, model_spec, slots: KeySlots, quantized,
                 keep_feeds: bool):  # fmt: skip
        self.steps, self.maps = steps, maps  # maps [c, layer, unit, P + S]
        self.seq = slots.prompt_len - 1 + steps.stop
        self.model_spec, self.slots, self.quantized = model_spec, slots, quantized
        self.rows = rows  # [c, layer, unit, P + S] the rows the queries see, where observed
        if rows is not None:
            rows.fill(0)
        self.keep_feeds = keep_feeds
        self.new_qkv: dict[int, tuple] = {}  # stored layer → (queries [head, c, D], keys, values [unit, c, D])

    def __call__(self, module, query, key, value, mask, scaling, softcap, sink):
        import torch

        from ...model import attention

        layer = self.model_spec.stored_layer(int(module.layer_idx))
        _b, h, c, _d = query.shape
        n_keys, kv = key.shape[1], key.shape[2]
        g = h // n_keys
        positions = self.slots.positions(layer, kv, self.seq)  # [1 | unit, kv]
        visible, bias = _mask_block(mask, c, kv)  # [1 | head, c, kv]
        shown = self._shown(layer, positions, n_keys, query.device)  # [keys, c, kv]
        if visible is not None:
            shown = shown & visible
        q32 = attention.grouped(query[0].float(), n_keys)  # [keys, g·c, D]
        keys, values, switching = self._keys_values(layer, key[0], value[0], g)
        logits = attention.logits(q32, keys.float(), scaling, softcap)  # [keys, g·c, kv]
        if switching is not None:  # slots a query before the ledger's step sees as computed, later dequantized
            cols, k_hat, _, hat_seen = switching  # k̂ [keys, m, D], hat_seen [keys, g·c, m]
            hat = attention.logits(q32, k_hat.float(), scaling, softcap)
            logits[..., cols] = torch.where(hat_seen, hat, logits[..., cols])
        if bias is not None:  # per query head where it is per head (ALiBi)
            bias = attention.grouped(bias.float().expand(h, c, kv), n_keys)  # [keys, g·c, kv]
        column = None if sink is None else attention.grouped_sinks(sink, n_keys, c).to(query.device)
        probs = attention.softmax(logits, _per_query_head(shown, g), bias, sink=column)  # [keys, g·c, kv]
        out = _attended(probs, values, switching)  # [keys, g·c, Dv]
        if self.rows is not None:
            self._observe(layer, probs.view(n_keys, g, c, kv), positions)
        if self.keep_feeds:
            self.new_qkv[layer] = (query[0].float().cpu(), key[0, :, -c:].float().cpu(), value[0, :, -c:].float().cpu())
        return out.view(n_keys * g, c, -1)[None].transpose(1, 2).contiguous()  # [1, c, head, Dv]

    def _shown(self, layer: int, positions: np.ndarray, n_keys: int, device):
        """``[keys, c, kv]`` bool: the tier maps, each unit's for its keys."""
        import torch

        maps = self.maps[:, layer]  # [c, unit, P + S]
        last = self.slots.last(positions)
        if last is not None:
            at = maps[..., last]
        else:
            at = np.broadcast_to(positions, (maps.shape[1], positions.shape[-1]))  # [unit, kv]
            at = np.take_along_axis(maps, at[None].repeat(len(maps), 0), axis=2)
        held = torch.from_numpy(at >= TIER_Q).permute(1, 0, 2).to(device)  # [unit, c, kv]
        if n_keys != held.shape[0]:
            held = held.repeat_interleave(n_keys // held.shape[0], dim=0)
        return held

    def _keys_values(self, layer: int, keys, values, g: int):
        """``(keys, values [keys, kv, D], switching)``: the K/V this chunk's queries see — the ledger's
        dequantized values at slots quantized before the chunk's first step — and, for slots the ledger
        quantizes within the chunk, ``(cols [m], k̂, v̂ [keys, m, D], hat_seen [keys, g·c, m])``; None
        where nothing is."""
        import torch

        kv = keys.shape[1]
        got = None if self.quantized is None else self.quantized(layer, keys, values, first=self.seq - kv)
        if got is None:
            return keys, values, None
        k_hat, v_hat, since = got  # since [keys, kv]
        always = (since <= self.steps.start).to(keys.device)[..., None]
        keys, values = torch.where(always, k_hat, keys), torch.where(always, v_hat, values)
        cols = torch.nonzero(((since > self.steps.start) & (since < self.steps.stop)).any(0))[:, 0]
        if not len(cols):
            return keys, values, None
        step = torch.arange(self.steps.start, self.steps.stop)
        hat_seen = since[:, None, cols] <= step[None, :, None]  # [keys, c, m]
        cols = cols.to(keys.device)
        return keys, values, (cols, k_hat[:, cols], v_hat[:, cols], _per_query_head(hat_seen.to(keys.device), g))

    def _observe(self, layer: int, probs, positions: np.ndarray) -> None:
        """The kv-group rows ``[c, unit, kv]`` (mean over the query heads of each unit), by position."""
        n_keys, g, c, kv = probs.shape
        units = self.rows.shape[2]
        per_unit = probs.reshape(units, (n_keys * g) // units, c, kv).mean(1).permute(1, 0, 2).cpu().numpy()
        last = self.slots.last(positions)
        self.rows[:, layer][..., last if last is not None else positions[0]] = per_unit

    def step_feeds(self) -> list | None:
        """Per step ``(keys, values [layer, unit, 1, D], queries [1, layer, head, D])`` of its new
        position (a press that reads each decode forward's tensors is fed these)."""
        if not self.keep_feeds:
            return None
        import torch

        layers = range(len(self.new_qkv))
        out = []
        for i in range(len(self.steps)):
            keys = torch.stack([self.new_qkv[layer][1][:, i : i + 1] for layer in layers])
            values = torch.stack([self.new_qkv[layer][2][:, i : i + 1] for layer in layers])
            queries = torch.stack([self.new_qkv[layer][0][:, i] for layer in layers])[None].numpy()
            out.append((keys, values, queries))
        return out


def _attended(probs, values, switching):
    """``out = a·V`` ``[keys, g·c, Dv]`` in the value's dtype; where ``switching``, the dequantized
    values ``v̂`` for the queries that see them."""
    import torch

    weights = probs.to(values.dtype, copy=switching is not None)  # [keys, g·c, kv]
    if switching is None:
        return torch.matmul(weights, values)
    cols, _, v_hat, hat_seen = switching
    w_cols = weights[..., cols]
    weights[..., cols] = w_cols.masked_fill(hat_seen, 0)
    return torch.matmul(weights, values) + torch.matmul(w_cols.masked_fill(~hat_seen, 0), v_hat)


def _mask_block(mask, c: int, kv: int) -> tuple:
    """transformers' mask for the chunk's ``c`` queries (its last rows) and the ``kv`` keys handed
    over (its last columns), as ``(visible, bias)`` ``[1 | head, c, kv]`` (``mask_terms``: a bool
    mask shows keys, a float one is added); ``(None, None)`` without one."""
    import torch

    from ...tracing.capture import mask_terms

    if not isinstance(mask, torch.Tensor):
        return None, None
    block = mask[0, :, :, -kv:]  # [1 | head, q, kv]
    return mask_terms(block, q_offset=block.shape[-2] - c, q_len=c, kv_len=kv, full_q_len=c, device=mask.device)


def _per_query_head(x, g: int):
    """``[keys, c, kv]`` → the grouped layout's rows ``[keys, g·c, kv]``: each query head of a group
    shares its key head's (``repeat_kv`` into query-head order, then ``attention.grouped``)."""
    from ...model import attention
    from ...tracing.capture import repeat_kv

    return attention.grouped(repeat_kv(x[None], g)[0], x.shape[0])
