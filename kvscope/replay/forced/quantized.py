"""Served quantized values: what a forced decode's queries see of the positions its policy's
write-once ledger quantized — the ledger's quantizer applied to the forward's own K/V of each group,
from the step after the decision that quantized it (docs/concepts.md#quantizer)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FOREVER = np.iinfo(np.int64).max  # a position never quantized


class Quantized:
    """Groups one ledger quantized in one stored layer, by group size ``G``: ``positions [n, G]``,
    ``heads [n]`` and ``visible [n]`` — the first step whose query sees them dequantized."""

    def __init__(self):
        self.parts: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}

    def add(self, positions: np.ndarray, heads: np.ndarray, visible: int) -> None:
        seen = np.full(len(heads), visible, dtype=np.int64)
        self.parts.setdefault(positions.shape[1], []).append((positions, heads, seen))

    def arrays(self):
        """``[(positions [n, G], heads [n], visible [n])]``, one per group size."""
        return [tuple(np.concatenate(x) for x in zip(*parts)) for _, parts in sorted(self.parts.items())]

    def counts(self) -> dict[int, int]:
        """``{G: groups}`` quantized so far."""
        return {G: sum(len(h) for _, h, _ in parts) for G, parts in self.parts.items()}

    def signature(self) -> tuple:
        return tuple(x.tobytes() for got in self.arrays() for x in got)


class QuantLog:
    """Every quantization of a ledger (its sink), with the step from which its values are served:
    ``visible``, set by the run as it drives the policy (quantizations now are served from that step on)."""

    def __init__(self, n_layers: int):
        self.layers = [Quantized() for _ in range(n_layers)]
        self.visible = 0

    def __call__(self, positions, layers, heads) -> None:  # the ledger's sink
        positions, layers, heads = (np.asarray(x, dtype=np.int64) for x in (positions, layers, heads))
        for layer in np.unique(layers):
            at = layers == layer
            self.layers[int(layer)].add(positions[at], heads[at], self.visible)

    def signature(self) -> tuple:
        return tuple(q.signature() for q in self.layers)


class ServedQuantized:
    """What one run's queries see of the positions its ledger quantized, per stored layer: the
    dequantized K/V of each group (``dequantize``: the ledger's ``dequantized``, its quantizer —
    settings, not state — applied to the forward's own K/V of the group's positions) and
    ``since [unit, P + S]``, the first step that sees them. ``n_positions``: ``P + S``.

    Groups quantized before a chunk (``close_chunk``) are final: their positions' K/V are the cache's
    and no longer change, so they are dequantized once and kept (``[unit, P + S, D]`` per layer).
    A chunk's own groups may change from round to round: those of positions before the chunk are
    dequantized once per chunk (by group), those holding the chunk's own positions on every forward.
    The log (``QuantLog``) is the one of the round being run: each call is handed it."""

    def __init__(self, n_positions: int, n_layers: int, dequantize):
        self.n_positions, self.dequantize = n_positions, dequantize
        self.kept: dict[int, tuple] = {}  # layer → (keys, values [unit, P + S, D] tensors, since [unit, P + S])
        self.final: list[dict[int, int]] = [{} for _ in range(n_layers)]  # layer → G → groups final
        self.done: list[dict[int, int]] = [{} for _ in range(n_layers)]  # layer → G → groups kept
        self.chunk_first = 0  # the chunk's first position
        self.chunk_groups: dict[tuple, tuple] = {}  # (layer, head, positions) → (k̂, v̂ [G, D]) of the chunk

    def close_chunk(self, first: int, log: QuantLog) -> None:
        """The groups ``log`` holds are final (the next chunk's forwards keep their values); the next
        chunk's first position is ``first``."""
        self.chunk_first, self.chunk_groups = first, {}
        self.final = [quantized.counts() for quantized in log.layers]

    def window(self, layer: int, keys, values, *, first: int, steps: range, log: QuantLog):
        """``(k̂, v̂ [keys, kv, D], since [keys, kv])`` for the key slots ``first …`` of this forward
        (``keys``, ``values`` the K/V it hands attention; ``steps`` its chunk), or None where nothing
        is quantized."""
        import torch

        quantized = log.layers[layer]
        groups_by_size = quantized.arrays()
        if not groups_by_size:
            return None
        handed = Handed(keys, values, first)
        kv = keys.shape[1]
        finals = [(G, self.final[layer].get(G, 0)) for G in sorted(quantized.parts)]  # as arrays() orders them
        k_kept, v_kept, since_kept = self._kept(layer, list(zip(groups_by_size, finals)), handed)
        k_hat, v_hat = k_kept[:, first : first + kv], v_kept[:, first : first + kv]
        since = since_kept[:, first : first + kv]
        current = [(g[n:], h[n:], v[n:]) for (g, h, v), (_, n) in zip(groups_by_size, finals)]
        current = [(g, h, v) for g, h, v in current if len(h)]
        if current:
            k_hat, v_hat, since = k_hat.clone(), v_hat.clone(), since.copy()
        for groups, heads, visible in current:
            keep = (visible < steps.stop) & (groups.min(1) >= first)  # seen in this chunk, keys handed over
            if keep.any():
                groups, heads, visible = groups[keep], heads[keep], visible[keep]
                self._chunk_roundtrip(layer, (groups, heads), handed, (k_hat, v_hat))
                since[heads[:, None], groups - first] = visible[:, None]
        return k_hat, v_hat, torch.from_numpy(since)

    def _chunk_roundtrip(self, layer: int, groups_heads: tuple, handed: Handed, out) -> None:
        """``_roundtrip`` of a chunk's groups, those of positions before the chunk once per chunk."""
        groups, heads = groups_heads  # [n, G], [n]
        settled = groups.max(1) < self.chunk_first
        if not settled.all():
            self._roundtrip(layer, (groups[~settled], heads[~settled]), handed, out)
        if not settled.any():
            return
        groups, heads = groups[settled], heads[settled]
        names = [(layer, int(h), g.tobytes()) for h, g in zip(heads, groups)]
        new = [i for i, name in enumerate(names) if name not in self.chunk_groups]
        if new:
            k_hat, v_hat = self._dequantized(layer, (groups[new], heads[new]), handed)
            for j, i in enumerate(new):
                self.chunk_groups[names[i]] = (k_hat[j], v_hat[j])
        got = [self.chunk_groups[name] for name in names]
        handed.write(out, (groups, heads), (np.stack([k for k, _ in got]), np.stack([v for _, v in got])))

    def _kept(self, layer: int, sizes: list, handed: Handed):
        """The layer's kept values ``(keys, values [unit, P + S, D], since [unit, P + S])``, with the
        final groups not yet kept dequantized now; ``sizes``: ``[((positions, heads, visible), (G,
        groups final))]`` by group size."""
        import torch

        keys, values, first = handed.keys, handed.values, handed.first
        if layer not in self.kept:
            n, units = self.n_positions, keys.shape[0]
            self.kept[layer] = (
                torch.zeros((units, n, keys.shape[-1]), dtype=keys.dtype, device=keys.device),
                torch.zeros((units, n, values.shape[-1]), dtype=values.dtype, device=values.device),
                np.full((units, n), FOREVER, dtype=np.int64),
            )
        k_kept, v_kept, since = self.kept[layer]
        for (groups, heads, visible), (G, n_final) in sizes:
            n_done = self.done[layer].get(G, 0)
            if n_final <= n_done:
                continue
            groups, heads, visible = groups[n_done:n_final], heads[n_done:n_final], visible[n_done:n_final]
            self.done[layer][G] = n_final
            seen = groups.min(1) >= first  # a sliding window's dropped positions are never seen again
            groups, heads, visible = groups[seen], heads[seen], visible[seen]
            if len(heads):
                window = (k_kept[:, first : first + keys.shape[1]], v_kept[:, first : first + keys.shape[1]])
                self._roundtrip(layer, (groups, heads), handed, window)
                since[heads[:, None], groups] = visible[:, None]
        return k_kept, v_kept, since

    def _roundtrip(self, layer: int, groups_heads: tuple, handed: Handed, out) -> None:
        """The groups ``positions [n, G]`` of ``heads [n]`` quantized and dequantized by the ledger
        (the quantizer of docs/concepts.md#quantizer) from this forward's own K/V (``handed``), into
        ``out`` (keys, values: the same slots)."""
        handed.write(out, groups_heads, self._dequantized(layer, groups_heads, handed))

    def _dequantized(self, layer: int, groups_heads: tuple, handed: Handed) -> tuple:
        """``(k̂, v̂ [n, G, D])`` float32 of the groups (``_roundtrip``)."""
        groups, heads = groups_heads
        slots, hh = handed.slots(groups, heads)
        keys, values = (x[hh, slots].float().cpu().numpy() for x in (handed.keys, handed.values))  # [n, G, D]
        return self.dequantize(keys, values, groups, np.full(len(groups), layer))


@dataclass(frozen=True)
class Handed:
    """The K/V a forward hands attention in one layer, ``keys``, ``values [unit, kv, D]``: key slot
    ``j`` holds position ``first + j``."""

    keys: object
    values: object
    first: int

    def slots(self, groups: np.ndarray, heads: np.ndarray) -> tuple:
        """``(slots [n, G], heads [n, 1])`` index tensors of the groups ``positions [n, G]`` of ``heads [n]``."""
        import torch

        return torch.from_numpy(groups - self.first), torch.from_numpy(heads)[:, None]

    def write(self, out, groups_heads: tuple, hat: tuple) -> None:
        """``hat = (k̂, v̂ [n, G, D])`` into ``out`` (keys, values laid out as these) at the groups' slots."""
        import torch

        slots, hh = self.slots(*groups_heads)
        for target, got in zip(out, hat):
            target[hh, slots] = torch.from_numpy(got).to(target.dtype).to(target.device)
