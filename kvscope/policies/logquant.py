"""LogQuant's log-sparse full-precision selection (SPEC §5.1), as index lists.

One parameter ``W``. ``local`` holds the newest tokens (between ``W+1`` and ``2W`` once
warm), ``reserve`` at most ``W`` log-sparse tokens; the FP set is ``reserve ∪ local``.

* Prefill of length ``L``: ``tmp = [0..L)``; while ``len(tmp) ≥ 3W``:
  ``reserve = tmp[0:2W:2]``, ``local = tmp[2W:]``, ``tmp = reserve + local``. Then, if
  ``W < L < 3W``: ``reserve = tmp[:W]``, ``local = tmp[W:]``; if ``L ≤ W`` all is local.
* Each decode position is appended to ``local``; when ``len(local) > 2W``:
  ``reserve = (reserve + local[:W])[0::2]`` (or ``local[:W]`` when ``reserve`` is empty),
  then ``local = local[W:]``.

Position 0 is never dropped. The policy class (replay) builds on these lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LogQuantIndex:
    """The index lists of one sequence; ``append`` one decode position at a time."""

    W: int
    reserve: list[int] = field(default_factory=list)
    local: list[int] = field(default_factory=list)

    @classmethod
    def after_prefill(cls, length: int, W: int) -> "LogQuantIndex":
        if W < 1:
            raise ValueError(f"LogQuant W must be ≥ 1 (got {W})")
        tmp = list(range(length))
        reserve: list[int] = []
        local = tmp
        if length >= 3 * W:
            while len(tmp) >= 3 * W:
                reserve = tmp[0 : 2 * W : 2]
                local = tmp[2 * W :]
                tmp = reserve + local
        elif W < length < 3 * W:
            reserve, local = tmp[:W], tmp[W:]
        return cls(W, reserve, list(local))

    def append(self, position: int) -> None:
        self.local.append(position)
        if len(self.local) > 2 * self.W:
            head = self.local[: self.W]
            self.reserve = (self.reserve + head)[0::2] if self.reserve else head
            self.local = self.local[self.W :]

    @property
    def fp(self) -> list[int]:
        """Positions kept at full precision, ascending."""
        return self.reserve + self.local


def fp_sets_per_step(prompt_len: int, n_steps: int, W: int) -> list[list[int]]:
    """The FP set seen by the query of each step ``t`` (its own key already appended).

    Step 0 is the last prefill row: the cache holds positions ``0..P−1``. Step ``t ≥ 1``
    appends position ``P − 1 + t`` before attending.
    """
    index = LogQuantIndex.after_prefill(prompt_len, W)
    sets = [index.fp]
    for t in range(1, n_steps):
        index.append(prompt_len - 1 + t)
        sets.append(index.fp)
    return sets
