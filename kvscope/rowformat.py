"""How a trace stores its probability rows (``attn``, ``attn_sink``, ``prefill_tail``): exactly,
or rounded to fewer mantissa bits (opt-in, lossy; ``kvscope compact``, docs/trace-format.md).

    fmt = row_format("round4")        # one of FORMATS, refused with one line otherwise
    fmt.filters()                     # the zarr codec that rounds on write (numcodecs' BitRound)
    fmt.bound(p)                      # |decoded − stored| ≤ 2^-(k+1) · max(p, smallest normal)
    fmt.line()                        # "rows: round4 (lossy, ≤ 3.1% relative, ≤ 2^-19 absolute below 2^-14)"
    RowFormat.of(attrs)               # what a store's ``rows`` attribute says (exact when absent)

``roundK`` keeps ``K`` of the stored dtype's mantissa bits, rounding to nearest (ties to
even) — numcodecs' ``BitRound``, a standard Zarr v3 array-to-array codec whose decode is the
identity, so any zarr reader reads the rounded values without kvscope. The dropped bits are
zero, which bit-shuffle and zstd then store almost for free. For a stored value ``p`` rounded to
``d``, with ``m`` the dtype's smallest normal (2^-14 for fp16, 2^-126 for fp32)::

    |d − p| ≤ 2^-(K+1) · max(p, m)

(a normal value keeps ``K`` bits after its leading one: half a unit in the last kept place;
a subnormal's spacing is that of ``m``). Hence a row of ``n`` stored values that summed to 1
within the dtype's tolerance ``T(n)`` sums to 1 within ``T(n) + 2^-(K+1) · (1 + T(n) + n·m)``
(:attr:`RowFormat.slack` is the ``2^-(K+1)`` the row checks add; 0 for exact rows). Zeros stay
0 and NaN stays NaN (a quiet NaN keeps its top mantissa bit), so the positions a row covers do
not change.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from .errors import KvscopeError

ROW_ARRAYS = ("attn", "attn_sink", "prefill_tail")  # the probability rows a format applies to
FORMATS = ("exact", "round5", "round4", "round3", "round2")
CODEC = "numcodecs.bitround"

# zarr says this of every numcodecs codec (BitRound is one); a store kvscope writes names it on purpose
warnings.filterwarnings("ignore", message="Numcodecs codecs are not in the Zarr version 3 specification")


@dataclass(frozen=True)
class RowFormat:
    """One row format: ``exact`` or ``roundK`` (``keepbits = K``)."""

    name: str
    keepbits: int | None = None  # None: exact

    @property
    def lossy(self) -> bool:
        return self.keepbits is not None

    @property
    def slack(self) -> float:
        """The relative bound ``2^-(K+1)`` of a rounded value (0 for exact rows)."""
        return 2.0 ** -(self.keepbits + 1) if self.lossy else 0.0

    def bound(self, p, smallest_normal: float = 2.0**-14):
        """The largest ``|decoded − stored|`` of a stored value ``p`` (fp16's smallest normal
        by default): ``slack · max(p, smallest_normal)``."""
        import numpy as np

        return self.slack * np.maximum(np.abs(p), smallest_normal)

    def filters(self) -> list:
        """The zarr array-to-array codecs that encode rows in this format (none when exact)."""
        if not self.lossy:
            return []
        from zarr.codecs.numcodecs import BitRound

        return [BitRound(keepbits=self.keepbits)]

    def codec_doc(self) -> dict | None:
        """The codec as a store's ``zarr.json`` names it (None when exact)."""
        return {"name": CODEC, "configuration": {"keepbits": self.keepbits}} if self.lossy else None

    def attrs(self) -> dict:
        """The group attribute ``rows`` of a store in this format."""
        doc = {"format": self.name, "lossy": self.lossy}
        if self.lossy:
            doc |= {"codec": CODEC, "keepbits": self.keepbits, "relative_error": self.slack}
        return doc

    def line(self) -> str:
        """One line for ``kvscope info`` and the analyses' output."""
        if not self.lossy:
            return f"rows: {self.name} (lossless)"
        k = self.keepbits
        return (
            f"rows: {self.name} (lossy, ≤ {100 * self.slack:.3g}% relative, "
            f"≤ 2^-{15 + k} absolute below 2^-14 in fp16)"
        )

    @classmethod
    def of(cls, attrs: dict) -> RowFormat:
        """The format a store's attributes record (``exact`` when they name none); one line for
        anything else, naming the attribute."""
        doc = attrs.get("rows")
        if doc is None:
            return EXACT
        if not isinstance(doc, dict) or doc.get("format") not in FORMATS:
            raise KvscopeError(f"attribute rows must name a row format ({', '.join(FORMATS)}); got {doc!r}")
        fmt = row_format(doc["format"])
        if doc != fmt.attrs():
            raise KvscopeError(f"attribute rows {doc!r} disagrees with format {fmt.name} ({fmt.attrs()!r})")
        return fmt


EXACT = RowFormat("exact")


def row_format(name: str) -> RowFormat:
    """The format called ``name`` (one of :data:`FORMATS`), else one line listing them."""
    if name not in FORMATS:
        raise KvscopeError(f"--rows {name!r} is not a row format; choose one of {', '.join(FORMATS)}")
    return EXACT if name == "exact" else RowFormat(name, int(name.removeprefix("round")))
