"""Units and window sums (docs/concepts.md#windows): what a policy keeps or drops, and how much mass it holds.

A *unit* is a window of ``w`` positions after the sinks (window granularity) or a single
position (token granularity):

    window j = positions [n_sink + j·w, n_sink + (j+1)·w)          exists at t iff its last position ≤ query_pos[t]
    token  p = position p                                          exists at t iff p ≤ query_pos[t]

    window_sums(x)[..., j] = Σ_{p ∈ window j} x[..., p]            in position order, in x's precision

Tracing stores window sums of rows (``--resolution window``), QEvict ranks windows by the
window sums of its scores, and the analyses sum rows into window masses with the compiled
form of the same definition (``kvscope.analysis.kernels.row_block_stats``, tested equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import KvscopeError


def window_sums(x: np.ndarray, n_sink: int, w: int, n_windows: int) -> np.ndarray:
    """``[..., n]`` → ``[..., n_windows]``: each window's values summed in position order, in the
    precision of ``x``. NaN and positions past ``n`` count as 0; a window whose first position
    lies past ``n`` is NaN (it does not exist)."""
    x = np.asarray(x)
    body = np.nan_to_num(x[..., n_sink : n_sink + n_windows * w])
    missing = n_windows * w - body.shape[-1]
    if missing:
        body = np.concatenate([body, np.zeros(body.shape[:-1] + (missing,), dtype=body.dtype)], axis=-1)
    sums = body.reshape(*body.shape[:-1], n_windows, w).cumsum(-1)[..., -1]  # sequential: position order
    exists = n_sink + np.arange(n_windows) * w < x.shape[-1]
    return sums if exists.all() else np.where(exists, sums, np.nan)


def window_rows(windows: np.ndarray, sinks: np.ndarray, qpos: np.ndarray, n_sink: int, w: int):
    """A window-resolution row as units in order of their first position — the sinks, then the
    windows — and the last unit that exists for each query (a unit exists when its first
    position ≤ the query): ``(rows [..., unit], last [...])``, ``last = −1`` where there is no
    query. ``windows [..., window]``, ``sinks [..., sink]``, ``qpos`` broadcastable to ``[...]``."""
    first = np.concatenate([np.arange(n_sink), n_sink + np.arange(windows.shape[-1]) * w])  # [unit]
    last = np.searchsorted(first, qpos, side="right") - 1
    return np.concatenate([sinks, windows], axis=-1), np.where(np.asarray(qpos) >= 0, last, -1)


@dataclass(frozen=True)
class Units:
    """Geometry of the units of an analysis or a policy.

    Attributes:
        kind: ``window`` or ``token``.
        w: The window size (positions per window).
        n_sink: Sinks: the first positions, before window 0.
    """

    kind: str
    w: int
    n_sink: int

    def __post_init__(self):
        if self.kind not in ("window", "token"):
            raise KvscopeError(f"granularity must be window or token (got {self.kind!r})")
        if self.kind == "window" and (self.w < 4 or self.w % 4):
            raise KvscopeError(f"--window must be a positive multiple of 4 (got {self.w})")
        if self.n_sink < 0:
            raise KvscopeError(f"n_sink must be ≥ 0 (got {self.n_sink})")

    @property
    def dim(self) -> str:
        """The name of the unit dim: ``window`` or ``pos``."""
        return "window" if self.kind == "window" else "pos"

    @property
    def size(self) -> int:
        """Positions per unit."""
        return self.w if self.kind == "window" else 1

    @property
    def offset(self) -> int:
        """First position of unit 0."""
        return self.n_sink if self.kind == "window" else 0

    def count(self, n_pos: int) -> int:
        """Complete units among ``n_pos`` positions.

        Args:
            n_pos: Positions.
        """
        if self.kind == "token":
            return n_pos
        return max(0, (n_pos - self.n_sink) // self.w)

    def last_position(self, n_units: int) -> np.ndarray:
        """``[unit]`` last position of each unit.

        Args:
            n_units: Units.
        """
        return self.offset + (np.arange(n_units) + 1) * self.size - 1

    def n_existing(self, query_pos: np.ndarray) -> np.ndarray:
        """Number of units that exist when the query sits at ``query_pos``.

        Args:
            query_pos: Query positions (any shape).
        """
        q = np.asarray(query_pos)
        n = (q - self.offset + 1) // self.size
        return np.where(q >= 0, np.maximum(n, 0), 0)

    def protected(self, n_existing: np.ndarray, n_units: int, local_tokens: int) -> np.ndarray:
        """``[..., unit]`` True for units a policy always keeps: the newest ``local_tokens``
        (rounded up to whole units) and, at token granularity, the sinks.

        Args:
            n_existing: ``[...]`` units that exist.
            n_units: Units along the unit dim.
            local_tokens: Newest tokens always kept.
        """
        n_local = -(-local_tokens // self.size) if local_tokens > 0 else 0
        j = np.arange(n_units)
        newest = j >= (np.asarray(n_existing)[..., None] - n_local)
        if self.kind == "token":
            newest = newest | (j < self.n_sink)
        return newest
