"""The keys/values one layer of a live policy cache hands to attention, kept in place.

Per layer one buffer, each KV head's held rows left-aligned in its own slots:

    keys, values   [kv_head, cap, D]   serving dtype   the row of every held (head, position)
    pos_at         [kv_head, cap]      int64           the position in each slot, −1 = free
    slot_of        [kv_head, final]    int64           the slot of each held position, −1 = none
    count          [kv_head]           int64           slots 0 … count − 1 are held

``cap`` grows by doubling (at most the final length P + S), so a step allocates nothing.
At a decode forward the new key goes to slot ``W − 1`` of every head, ``W = max(count) + 1``:
the newest key is the last slot, and slots ``count … W − 2`` of a head that holds fewer are
free (masked per head, ``slot_pos`` −1). Attention reads ``keys[:, :W]``, a view. Each change
costs O(rows that change), never a gather of every row:

    settle     after the forward, a head's new row moves down from W − 1 to slot count
    write      a row quantized is overwritten with its dequantized values
    remove     the holes of rows that leave are filled with the head's last held rows

So each head's slots hold its positions in position order until the first removal, in some
permutation after it: attention over a permutation of the keys is the same function (up to
the order of float summation), and the rows the policy observes are mapped back to absolute
positions by ``slot_pos``. A cache that removes nothing serves every head's positions in
order — what a ``DynamicCache`` serves.
"""

from __future__ import annotations

import numpy as np
import torch


class Served:
    """The served rows of one layer (see the module docstring)."""

    def __init__(self, n_kv: int, head_dim: int, final: int, dtype, device):
        self.n_kv, self.head_dim, self.final = n_kv, head_dim, final
        self.dtype, self.device = dtype, device
        self.cap = 0
        self.keys = self.values = torch.zeros((n_kv, 0, head_dim), dtype=dtype, device=device)
        self.pos_at = np.full((n_kv, 0), -1, dtype=np.int64)  # [kv_head, cap]
        self.slot_of = np.full((n_kv, final), -1, dtype=np.int64)  # [kv_head, final]
        self.count = np.zeros(n_kv, dtype=np.int64)  # [kv_head]
        self.width = 0  # W of the forward not settled yet (0: settled)

    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes + self.pos_at.nbytes + self.slot_of.nbytes)

    def _grow(self, width: int) -> None:
        """Room for ``width`` slots per head (zeros: a free slot is masked, never NaN)."""
        if width <= self.cap:
            return
        cap = min(self.final, max(width, 2 * self.cap))
        shape = (self.n_kv, cap, self.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        keys[:, : self.cap], values[:, : self.cap] = self.keys, self.values
        pos_at = np.full((self.n_kv, cap), -1, dtype=np.int64)
        pos_at[:, : self.cap] = self.pos_at
        self.keys, self.values, self.pos_at, self.cap = keys, values, pos_at, cap

    def _flat(self, heads: np.ndarray, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(heads * self.cap + slots).to(self.device)

    def fill(self, heads: np.ndarray, pos: np.ndarray, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold exactly the rows ``keys, values [n, D]`` of (``heads``, ``pos``) ``[n]``, each
        head's in position order (an empty buffer)."""
        order = np.lexsort((pos, heads))
        count = np.bincount(heads, minlength=self.n_kv)
        slots = np.empty_like(order)
        slots[order] = np.arange(len(order)) - (np.cumsum(count) - count)[heads[order]]  # rank in its head
        self._grow(int(count.max(initial=0)))
        self.pos_at[heads, slots], self.slot_of[heads, pos], self.count = pos, slots, count
        self._put(self._flat(heads, slots), keys, values)

    def _put(self, flat: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """``keys, values [n, D]`` into the flat slots ``flat [n]`` (head · cap + slot)."""
        self.keys.view(-1, self.head_dim).index_copy_(0, flat, keys.to(self.dtype))
        self.values.view(-1, self.head_dim).index_copy_(0, flat, values.to(self.dtype))

    def _move(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """The rows in flat slots ``src [n]`` copied to ``dst [n]``, keys and values."""
        for t in (self.keys, self.values):
            rows = t.view(-1, self.head_dim)
            rows[dst] = rows[src]

    def append(self, pos: int, key: torch.Tensor, value: torch.Tensor):
        """The new row ``key, value [kv_head, D]`` of position ``pos`` into slot ``W − 1`` of
        every head → ``keys, values [1, kv_head, W, D]`` (views), ``slot_pos [kv_head, W]``
        (−1: free) and ``head_mask [kv_head, W]`` (None when every head holds W − 1 rows)."""
        w = int(self.count.max()) + 1
        self._grow(w)
        self.keys[:, w - 1], self.values[:, w - 1] = key, value
        self.pos_at[:, w - 1], self.slot_of[:, pos] = pos, w - 1
        self.width = w
        slot_pos = torch.from_numpy(self.pos_at[:, :w]).to(self.device)
        mask = (slot_pos >= 0) if bool((self.count < w - 1).any()) else None
        return self.keys[None, :, :w], self.values[None, :, :w], slot_pos, mask

    def settle(self) -> None:
        """After the forward: each head's new row moves from slot ``W − 1`` down to slot
        ``count`` (where they differ), and is held."""
        w, self.width = self.width, 0
        if not w:
            return
        heads = np.nonzero(self.count < w - 1)[0]
        if len(heads):
            self._move(self._flat(heads, self.count[heads]), self._flat(heads, np.full(len(heads), w - 1)))
            pos = self.pos_at[heads, w - 1]
            self.pos_at[heads, self.count[heads]], self.pos_at[heads, w - 1] = pos, -1
            self.slot_of[heads, pos] = self.count[heads]
        self.count += 1

    def write(self, heads: np.ndarray, pos: np.ndarray, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite the held rows of (``heads``, ``pos``) ``[n]`` with ``keys, values [n, D]``."""
        slots = self.slot_of[heads, pos]
        if (slots < 0).any():
            raise RuntimeError("a row written to the served keys is not held there")
        self._put(self._flat(heads, slots), keys, values)

    def remove(self, heads: np.ndarray, pos: np.ndarray) -> None:
        """Stop holding (``heads``, ``pos``) ``[k]`` (distinct, held): per head, the held rows
        in the slots past its new count move into the holes below it."""
        slots = self.slot_of[heads, pos]
        if (slots < 0).any():
            raise RuntimeError("a row removed from the served keys is not held there")
        new = self.count - np.bincount(heads, minlength=self.n_kv)  # [kv_head]
        flat = heads * self.cap + slots
        holes = np.sort(flat[slots < new[heads]])
        s = np.arange(self.cap)
        tail = np.flatnonzero((s >= new[:, None]) & (s < self.count[:, None]))  # [new, count) of every head
        movers = np.setdiff1d(tail, flat, assume_unique=True)  # sorted: pairs with holes head by head
        self.slot_of[heads, pos] = -1
        pos_flat = self.pos_at.reshape(-1)
        if len(holes):
            moved = pos_flat[movers]
            self._move(torch.from_numpy(holes).to(self.device), torch.from_numpy(movers).to(self.device))
            pos_flat[holes] = moved
            self.slot_of[holes // self.cap, moved] = holes % self.cap
        pos_flat[tail] = -1
        self.count = new

    def rows(self, heads: np.ndarray, pos: np.ndarray):
        """``keys, values [n, D]`` held for (``heads``, ``pos``) ``[n]`` — which must be exactly
        the rows held (checked against the slot maps both ways; AssertionError otherwise)."""
        slots = self.slot_of[heads, pos]
        held = self.slot_of >= 0
        if (
            (slots < 0).any()
            or (slots >= self.count[heads]).any()
            or not np.array_equal(self.pos_at[heads, slots], pos)
            or int(held.sum()) != len(pos)
            or not np.array_equal(np.bincount(heads, minlength=self.n_kv), self.count)
            or int((self.pos_at >= 0).sum()) != len(pos)
        ):
            raise AssertionError("the served slots differ from the rows the cache holds")
        flat = self._flat(heads, slots)
        return self.keys.view(-1, self.head_dim)[flat], self.values.view(-1, self.head_dim)[flat]
