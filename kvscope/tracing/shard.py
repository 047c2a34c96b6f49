"""Which samples a shard of a trace decodes (``kvscope trace --shard i/n``, ``--dask``).

The samples are decoded in batches of ``batch_size`` consecutive samples: batch ``b`` holds
samples ``b·B … b·B + B − 1``. Shard ``i`` of ``n`` decodes the batches ``b`` with
``b mod n = i`` — with ``--batch-size 1`` the samples ``s`` with ``s mod n = i``. A shard decodes
each of its batches exactly as a single process would (same padding, same seed ``seed + b·B``),
so the store the shards write together equals a single-process trace's bit for bit (with the
same torch thread count: CPU kernels' sums depend on it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import KvscopeError
from .writer import LOCK_NAME


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``: it decodes the batches ``b`` with ``b mod count = index``
    into a store that ``count`` shards write together (``kvscope trace --shard index/count``).

    Attributes:
        index: This shard (0 ≤ index < count).
        count: The shards in all.
    """

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``"i/n"`` → ``Shard(i, n)``; anything else one line.

        Args:
            text: ``"i/n"`` with 0 ≤ i < n.

        Raises:
            KvscopeError: Any other text.
        """
        i, sep, n = str(text).partition("/")
        try:
            index, count = int(i), int(n)
        except ValueError:
            index = count = -1
        if not sep or count < 1 or not 0 <= index < count:
            raise KvscopeError(f"--shard takes i/n with 0 ≤ i < n, e.g. 0/2 (got {text!r})")
        return cls(index, count)

    @property
    def label(self) -> str:
        """``"index/count"``."""
        return f"{self.index}/{self.count}"

    @property
    def lock_name(self) -> str:
        """The lock file that one process of this shard holds."""
        return f"{LOCK_NAME}.shard-{self.index}"

    def batches(self, n_samples: int, batch_size: int) -> list[list[int]]:
        """The sample indices of every batch this shard decodes.

        Args:
            n_samples: The store's samples.
            batch_size: Samples per batch.
        """
        return [b for b in batches(n_samples, batch_size) if owner(b[0], batch_size, self.count) == self.index]

    def samples(self, n_samples: int, batch_size: int) -> list[int]:
        """The samples this shard decodes, in order.

        Args:
            n_samples: The store's samples.
            batch_size: Samples per batch.
        """
        return [s for batch in self.batches(n_samples, batch_size) for s in batch]


def owner(sample: int, batch_size: int, count: int) -> int:
    """The shard of ``count`` that decodes ``sample``: its batch ``b = sample // batch_size``, mod ``count``."""
    return (sample // batch_size) % count


def batches(n_samples: int, batch_size: int, shard: Shard | None = None) -> list[list[int]]:
    """Batches of ``batch_size`` consecutive samples (of ``shard`` only, if given)."""
    if shard is not None:
        return shard.batches(n_samples, batch_size)
    return [list(range(b0, min(n_samples, b0 + batch_size))) for b0 in range(0, n_samples, batch_size)]
