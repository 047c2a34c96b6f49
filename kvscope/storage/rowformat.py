"""How a trace stores its probability rows (``attn``, ``attn_sink``, ``prefill_tail``): exactly,
or with fewer mantissa bits (opt-in, lossy; ``kvscope compact``, docs/trace-format.md).

    fmt = row_format("round4-peaks")  # one of FORMATS, refused with one line otherwise
    fmt.round(rows, n_sink, w)        # rows [..., pos] as this format stores them
    fmt.bound(p, top)                 # the largest |stored − exact| of a value p (-carry: top ≥ its window's largest)
    fmt.line()                        # "rows: round4-peaks (lossy, ≤ 3.12% relative, …)"
    RowFormat.of(attrs)               # what a store's ``row_format`` attribute says (exact when absent)

``roundK`` keeps ``K`` of the stored dtype's mantissa bits of every value, rounding to nearest
(ties to even: numcodecs' ``BitRound`` arithmetic). ``roundK-peaks`` does the same except for
each row's ``PEAKS_TOP_K + n_sink + 1`` largest values and any value whose rounding would reach
the smallest of them, which stay exact: every rounded value then lies strictly below every kept
one, so the top-``k`` set of any range of the row that leaves out at most ``n_sink + 1`` positions
(the peaks' range ``n_sink ≤ p < q``) is unchanged — and with it the peak distances and α.

The values are rounded once, when a store is written in the format; the chunks then go through
the store's usual lossless codecs. The dropped bits are zeros, which bit-shuffle and zstd store
almost for free, and any zarr reader reads the rows without kvscope (no codec to know). For a
value ``p`` stored as ``d``, with ``m`` the dtype's smallest normal (2^-14 fp16, 2^-126 fp32):

    |d − p| ≤ h · max(p, m),   h = 2^-(K+1)

(a normal value keeps ``K`` bits after its leading one: half a unit in the last kept place; a
subnormal's spacing is that of ``m``). Hence a row of ``n`` values that summed to 1 within the
dtype's tolerance ``T(n)`` sums to 1 within ``T(n) + h · (1 + T(n) + n·m)``
(``RowFormat.slack`` is the ``h`` the row checks add; 0 for exact rows). Zeros stay 0
and NaN stays NaN, so the positions a row covers do not change.

``…-carry`` (``roundK-carry``, ``roundK-peaks-carry``) feeds each rounding error forward
inside its window (error diffusion; the windows of the store: the sinks, then every ``w``
positions): in position order, each value to round becomes ``y_i = p_i + c_{i-1}``
(``c = 0`` at a window's start), is stored as ``d_i``, the nearest ``K``-bit value to ``y_i``
clamped into ``[0, max(1, p_i)]``, and leaves ``c_i = y_i − d_i`` to the next; a value kept
exact (peaks, zeros, NaN, or one whose ``d_i`` would reach the kept) passes ``c`` on
unchanged. Then ``d_i − p_i = c_{i-1} − c_i``, so a window's errors telescope: with ``M`` the
window's largest rounded value and ``s = h / (1 − h)``:

    |c_i| ≤ s · max(M, m)                                 (induction: docs/trace-format.md)
    |Σ_{window} d − Σ_{window} p| = |c_last| ≤ s · max(M, m)        (a window's mass)
    |Σ_row d − Σ_row p| ≤ s · Σ_windows max(M, m) ≤ s · (1 + T(n) + n·m)   (the row)

— a window's mass is off by one carry, not by the sum of its ``w`` errors; the readers add
``s``. A single value may move by up to ``2s · max(M, m)`` (its own and its predecessor's
carry), more than ``h · p`` for a small value after a large one of its window. Rows of
windows (window resolution) are not carried (``w = 1``: plain rounding). In fp16 every
quantity is a multiple of 2^-24 below 4, so the float64 arithmetic is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import defaults
from ..errors import KvscopeError

ROW_ARRAYS = ("attn", "attn_sink", "prefill_tail")  # the probability rows a format applies to
ATTR = "row_format"  # the group attribute that records a store's format
FORMATS = (
    "exact",
    *(f"round{k}{p}" for k in (5, 4, 3, 2) for p in ("", "-peaks")),
    *(f"round{k}{p}-carry" for k in (5, 4, 3, 2) for p in ("", "-peaks")),
)


@dataclass(frozen=True)
class RowFormat:
    """One row format: ``exact``, ``roundK``, ``roundK-peaks``, ``roundK-carry`` or
    ``roundK-peaks-carry`` (``keepbits = K``)."""

    name: str
    keepbits: int | None = None  # None: exact
    peaks: bool = False  # each row's largest values kept exact
    carry: bool = False  # each rounding error fed forward to the row's next rounded value

    @property
    def lossy(self) -> bool:
        return self.keepbits is not None

    @property
    def slack(self) -> float:
        """What the row checks add (relative to 1): ``h = 2^-(K+1)``, a rounded value's relative
        bound; with ``-carry`` ``s = h / (1 − h)``, the bound of a carry relative to its
        window's largest rounded value; 0 for exact rows."""
        if not self.lossy:
            return 0.0
        h = 2.0 ** -(self.keepbits + 1)
        return h / (1 - h) if self.carry else h

    def bound(self, p, top=None, smallest_normal: float = 2.0**-14):
        """The largest ``|stored − exact|`` of a value ``p`` (fp16's smallest normal ``m`` by
        default): ``h · max(p, m)``; with ``-carry`` ``2s · max(top, m)``, ``top`` the largest
        value of ``p``'s window or anything above it, such as its row's largest (required)."""
        if self.carry:
            return 2 * self.slack * np.maximum(top, smallest_normal)
        return self.slack * np.maximum(np.abs(p), smallest_normal)

    @staticmethod
    def kept(n_sink: int) -> int:
        """Values per row a ``-peaks`` format keeps exact: the peaks' ``k`` + the sinks + the query."""
        return defaults.PEAKS_TOP_K + n_sink + 1

    def round(self, x: np.ndarray, n_sink: int, w: int) -> np.ndarray:
        """Rows ``x [..., pos]`` (fp16 or fp32, NaN where nothing is stored) as this format
        stores them (a new array; ``x`` itself when exact). ``w``: the store's windows, in
        values of ``x``'s last axis (the trace's ``w`` for rows of tokens, 1 for rows of
        windows) — a ``-carry`` error stays inside its window (the sinks are one)."""
        if not self.lossy:
            return x
        x = np.ascontiguousarray(x)
        keep = self.kept(n_sink)
        if self.peaks and x.shape[-1] <= keep:  # every value is among the kept
            return x.copy()
        hold, low = np.zeros(x.shape, bool), np.full(x.shape[:-1] + (1,), np.inf)  # [..., pos], [..., 1]
        if self.peaks:  # each row's keep-th largest value, and every value at or above it
            filled = np.where(np.isnan(x), -np.inf, x)
            low = -np.partition(-filled, keep - 1, axis=-1)[..., keep - 1 : keep]
            hold = filled >= low
        if self.carry and w > 1:  # (windows of one value: each error stays where it is, plain rounding)
            return _carried(x, self.keepbits, hold=hold, low=low, starts=_window_starts(x.shape[-1], n_sink, w))
        from numcodecs import BitRound

        d = np.asarray(BitRound(self.keepbits).encode(x)).view(x.dtype).reshape(x.shape)
        return np.where(hold | (d >= low), x, d)

    def attrs(self, n_sink: int | None = None) -> dict:
        """The group attribute ``row_format`` of a store in this format (``-peaks``: ``n_sink`` of the store)."""
        doc = {"format": self.name, "lossy": self.lossy}
        if self.lossy:
            doc |= {"keepbits": self.keepbits, "relative_error": self.slack}
        if self.carry:
            doc["error_carried"] = True
        if self.peaks:
            doc["kept_exact_per_row"] = self.kept(n_sink)
        return doc

    def line(self) -> str:
        """One line for ``kvscope info`` and the analyses' output."""
        if not self.lossy:
            return f"rows: {self.name} (lossless)"
        kept = ", each row's largest values exact" if self.peaks else ""
        if self.carry:
            return (
                f"rows: {self.name} (lossy, errors carried within each window: its mass within "
                f"{100 * self.slack:.3g}% of its largest rounded value{kept})"
            )
        return (
            f"rows: {self.name} (lossy, ≤ {100 * self.slack:.3g}% relative, "
            f"≤ 2^-{15 + self.keepbits} absolute below 2^-14 in fp16{kept})"
        )

    @classmethod
    def of(cls, attrs: dict) -> RowFormat:
        """The format a store's attributes record (``exact`` when they name none); one line for
        anything else, naming the attribute."""
        doc = attrs.get(ATTR)
        if doc is None:
            return EXACT
        if not isinstance(doc, dict) or doc.get("format") not in FORMATS:
            raise KvscopeError(f"attribute {ATTR} must name a row format ({', '.join(FORMATS)}); got {doc!r}")
        fmt = row_format(doc["format"])
        want = fmt.attrs(attrs.get("n_sink"))
        if doc != want:
            raise KvscopeError(f"attribute {ATTR} {doc!r} disagrees with format {fmt.name} ({want!r})")
        return fmt


EXACT = RowFormat("exact")


def row_format(name: str) -> RowFormat:
    """The format called ``name`` (one of ``FORMATS``), else one line listing them."""
    if name not in FORMATS:
        raise KvscopeError(f"--rows {name!r} is not a row format; choose one of {', '.join(FORMATS)}")
    if name == "exact":
        return EXACT
    bits, *flags = name.removeprefix("round").split("-")
    return RowFormat(name, int(bits), "peaks" in flags, "carry" in flags)


def _grid(y: np.ndarray, keepbits: int, smallest_normal: float) -> np.ndarray:
    """The nearest value to ``y ≥ 0`` with ``keepbits`` mantissa bits (ties to even), its
    exponent floored at that of ``smallest_normal`` (a subnormal's spacing)."""
    _, e = np.frexp(np.maximum(y, smallest_normal))  # y = f · 2^e, f ∈ [½, 1)
    step = np.ldexp(1.0, e - 1 - keepbits)
    return np.rint(y / step) * step


def _window_starts(n: int, n_sink: int, w: int) -> np.ndarray:
    """``[pos]`` True where a window of a row of ``n`` tokens starts: 0 (the sinks), then every
    ``w`` from ``n_sink``. (Rows of windows, ``w = 1``, are not carried: ``RowFormat.round``.)"""
    i = np.arange(n)
    return (i == 0) | ((i >= n_sink) & ((i - n_sink) % w == 0))


def _carried(x: np.ndarray, keepbits: int, hold: np.ndarray, low: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Rows ``x [..., pos]`` rounded with each error carried to the next rounded value of its
    window (module docstring); ``hold [..., pos]`` marks values kept exact (NaN and zeros too),
    ``low [..., 1]`` the value a rounded one must stay below (else it is kept exact too),
    ``starts [pos]`` where the carry restarts at 0. One numpy step per position, over all rows
    at once."""
    m = float(np.finfo(x.dtype).smallest_normal)
    p = x.reshape(-1, x.shape[-1]).astype(np.float64)  # [row, pos]
    hold, low = hold.reshape(p.shape) | np.isnan(p) | (p == 0), low.reshape(-1)  # [row, pos], [row]
    out = np.empty_like(p)
    c = np.zeros(p.shape[0])  # [row] the carry
    for i in range(p.shape[1]):
        if starts[i]:  # a window's first value: nothing carried into it, whatever came before
            c = np.zeros(p.shape[0])
        y = p[:, i] + c
        d = np.clip(_grid(y, keepbits, m), 0.0, np.maximum(1.0, p[:, i]))
        d = np.where(hold[:, i] | (d >= low), p[:, i], d)
        out[:, i] = d
        c = np.where(np.isnan(d), c, y - d)
    return out.astype(x.dtype).reshape(x.shape)
