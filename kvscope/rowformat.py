"""How a trace stores its probability rows (``attn``, ``attn_sink``, ``prefill_tail``): exactly,
or with fewer mantissa bits (opt-in, lossy; ``kvscope compact``, docs/trace-format.md).

    fmt = row_format("round4-peaks")  # one of FORMATS, refused with one line otherwise
    fmt.round(rows, n_sink)           # rows [..., pos] as this format stores them
    fmt.bound(p)                      # |stored − exact| ≤ 2^-(K+1) · max(p, smallest normal)
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
value ``p`` stored as ``d``, with ``m`` the dtype's smallest normal (2^-14 fp16, 2^-126 fp32)::

    |d − p| ≤ 2^-(K+1) · max(p, m)

(a normal value keeps ``K`` bits after its leading one: half a unit in the last kept place; a
subnormal's spacing is that of ``m``). Hence a row of ``n`` values that summed to 1 within the
dtype's tolerance ``T(n)`` sums to 1 within ``T(n) + 2^-(K+1) · (1 + T(n) + n·m)``
(:attr:`RowFormat.slack` is the ``2^-(K+1)`` the row checks add; 0 for exact rows). Zeros stay 0
and NaN stays NaN, so the positions a row covers do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import defaults
from .errors import KvscopeError

ROW_ARRAYS = ("attn", "attn_sink", "prefill_tail")  # the probability rows a format applies to
ATTR = "row_format"  # the group attribute that records a store's format
FORMATS = ("exact", *(f"round{k}{p}" for k in (5, 4, 3, 2) for p in ("", "-peaks")))


@dataclass(frozen=True)
class RowFormat:
    """One row format: ``exact``, ``roundK`` or ``roundK-peaks`` (``keepbits = K``)."""

    name: str
    keepbits: int | None = None  # None: exact
    peaks: bool = False  # each row's largest values kept exact

    @property
    def lossy(self) -> bool:
        return self.keepbits is not None

    @property
    def slack(self) -> float:
        """The relative bound ``2^-(K+1)`` of a rounded value (0 for exact rows)."""
        return 2.0 ** -(self.keepbits + 1) if self.lossy else 0.0

    def bound(self, p, smallest_normal: float = 2.0**-14):
        """The largest ``|stored − exact|`` of a value ``p`` (fp16's smallest normal by default)."""
        return self.slack * np.maximum(np.abs(p), smallest_normal)

    @staticmethod
    def kept(n_sink: int) -> int:
        """Values per row a ``-peaks`` format keeps exact: the peaks' ``k`` + the sinks + the query."""
        return defaults.PEAKS_TOP_K + n_sink + 1

    def round(self, x: np.ndarray, n_sink: int) -> np.ndarray:
        """Rows ``x [..., pos]`` (fp16 or fp32, NaN where nothing is stored) as this format
        stores them (a new array; ``x`` itself when exact)."""
        if not self.lossy:
            return x
        from numcodecs import BitRound

        x = np.ascontiguousarray(x)
        d = np.asarray(BitRound(self.keepbits).encode(x)).view(x.dtype).reshape(x.shape)
        keep = self.kept(n_sink)
        if not self.peaks:
            return d
        if x.shape[-1] <= keep:  # every value is among the kept
            return x.copy()
        filled = np.where(np.isnan(x), -np.inf, x)  # [..., pos]
        low = -np.partition(-filled, keep - 1, axis=-1)[..., keep - 1 : keep]  # [..., 1] the keep-th largest
        return np.where((filled >= low) | (d >= low), x, d)

    def attrs(self, n_sink: int | None = None) -> dict:
        """The group attribute ``row_format`` of a store in this format (``-peaks``: ``n_sink`` of the store)."""
        doc = {"format": self.name, "lossy": self.lossy}
        if self.lossy:
            doc |= {"keepbits": self.keepbits, "relative_error": self.slack}
        if self.peaks:
            doc["kept_exact_per_row"] = self.kept(n_sink)
        return doc

    def line(self) -> str:
        """One line for ``kvscope info`` and the analyses' output."""
        if not self.lossy:
            return f"rows: {self.name} (lossless)"
        kept = ", each row's largest values exact" if self.peaks else ""
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
    """The format called ``name`` (one of :data:`FORMATS`), else one line listing them."""
    if name not in FORMATS:
        raise KvscopeError(f"--rows {name!r} is not a row format; choose one of {', '.join(FORMATS)}")
    if name == "exact":
        return EXACT
    bits, _, peaks = name.removeprefix("round").partition("-")
    return RowFormat(name, int(bits), peaks == "peaks")
