"""The one policy driver: the sequence every cache state goes through, offline and live.

    driver = PolicyDriver(policy.start(spec), where=" of sample 3")
    driver.prefill(colsum, tail)      step 0: positions 0..P−1 exist; the policy compresses them
    driver.append(p)                  a decode step adds position p at full precision
    driver.decide(row)                the policy observes the row the cache served (policies that
                                      observe), the clairvoyant oracle its future, then compresses

After the prefill and after every decision the bytes the policy holds by the byte model
(docs/concepts.md#budget) are checked against its budget, ``B = β · FP_bytes(P + S)`` split per (layer,
kv_head) by the allocation (evenly by default, [`CacheSpec`][kvscope.policies.CacheSpec]):
a policy that claims to fit and holds more — per unit, or in all when it pools its budget —
raises ``BudgetExceeded``. Replay (``kvscope.replay``) and the live cache
(``kvscope.live.PolicyCache``) both drive their states through this class; only where the rows
come from differs.
"""

from __future__ import annotations

import numpy as np

from .allocation import Allocation, Uniform
from .base import BudgetExceeded, CacheState, Policy


class PolicyDriver:
    """Drives one [`CacheState`][kvscope.policies.CacheState]; ``step`` counts the decisions
    made (0 = the prefill).

    Args:
        state: The state of one sequence's cache (``policy.start(spec)``).
        allocation: How the budget is split across layers and KV heads (default uniform: the
            state keeps its even share); one that reads the policy's scores splits at the
            prefill, the clairvoyant oracle from ``gains``.
        gains: The clairvoyant allocation's input: ``(capacities, loss)``, the policy's loss at
            candidate capacities ``[candidate, layer, kv_head]``, measured by the replay
            (``kvscope.replay.sample.SampleReplay.oracle_probes``), which only a trace can give.
        check: Verify the policy's invariants after every decision (tests).
        where: Appended to messages (``" of sample 3"``).
    """

    def __init__(
        self,
        state: CacheState,
        *,
        allocation: Allocation | None = None,
        gains: tuple[np.ndarray, np.ndarray] | None = None,
        check: bool = False,
        where: str = "",
    ):
        self.state = state
        self.allocation = allocation or Uniform()
        self.check = check
        self.where = where
        self.step = -1
        self.used: np.ndarray | None = None  # [layer, kv_head] bytes after the last decision
        if not self.allocation.uniform and self.allocation.reads != "scores":
            self._allot(gains=gains)

    def _allot(self, **observed) -> None:
        spec = self.state.spec
        self.state.allot(self.allocation.split(spec, self.policy.unit_floor(spec), **observed))

    @property
    def policy(self) -> Policy:
        """The policy whose state this drives."""
        return self.state.policy

    def prefill(
        self, colsum: np.ndarray, tail: np.ndarray | None, future: np.ndarray | None = None, check: bool = False
    ) -> np.ndarray:
        """Step 0: the prompt's positions exist; the policy compresses them.

        Args:
            colsum: ``[layer, kv_head, P]`` the attention each prompt key got from all prompt queries.
            tail: ``[layer, kv_head, obs, P]`` the last prefill rows (None where not recorded).
            future: ``[layer, kv_head, pos]`` the future attention (the clairvoyant oracle only).
            check: Verify the policy's invariants now.

        Returns:
            ``[layer, kv_head]`` the bytes held.

        Raises:
            BudgetExceeded: The policy holds more than its budget.
        """
        if self.allocation.reads == "scores":
            self._allot(scores=self.policy.allocation_scores(colsum, tail))
        if self.policy.clairvoyant:
            self.state.observe_future(future)
        self.state.prefill(colsum, tail)
        return self._settle(check)

    def append(self, position: int) -> None:
        """A decode step adds ``position`` at full precision.

        Args:
            position: The new position (the cache's length: positions arrive in order).
        """
        self.state.append(position)

    def decide(
        self, row: np.ndarray | None = None, future: np.ndarray | None = None, check: bool = False
    ) -> np.ndarray:
        """Observe, then compress (returns and raises as
        [`prefill`][kvscope.policies.PolicyDriver.prefill]).

        Args:
            row: ``[layer, kv_head, length]`` the attention the cache served (read only by
                policies that observe).
            future: The clairvoyant oracle's future attention, as for ``prefill``.
            check: Verify the policy's invariants after this step.
        """
        if self.policy.observes:
            self.state.observe(row)
        if self.policy.clairvoyant:
            self.state.observe_future(future)
        self.state.compress()
        return self._settle(check)

    def _settle(self, check: bool) -> np.ndarray:
        """Bytes held now ``[layer, kv_head]``, checked in all and per unit (a state that pools
        its budget is checked in all only)."""
        self.step += 1
        st = self.state
        if st.spec.windowed:
            st.drop_outside_windows(every=True)
        self.used = st.bytes_used()
        if st.reached and not st.pooled and st.spec.exceeded(self.used):
            over = self.used - np.broadcast_to(st.spec.capacity, self.used.shape)
            layer, head = np.unravel_index(int(np.argmax(over)), over.shape)
            raise BudgetExceeded(
                f"{self.policy.label()} used {self.used[layer, head]:.0f} bytes in layer {layer}, kv_head {head} "
                f"at step {self.step}{self.where}, over its share "
                f"{np.broadcast_to(st.spec.capacity, over.shape)[layer, head]:.0f} (β = {st.spec.budget})"
            )
        whole = self.allocation.whole and st.spec.whole_model  # a replay task of some units: per unit only
        if st.reached and whole and st.spec.exceeded_total(self.used.sum()):
            raise BudgetExceeded(
                f"{self.policy.label()} used {self.used.sum():.0f} bytes in all at step "
                f"{self.step}{self.where}, over its budget {st.spec.total_capacity:.0f} (β = {st.spec.budget})"
            )
        if check or self.check:
            st.check()
        return self.used

    def check_held(self, held_bytes: int) -> None:
        """A live cache's bytes really held against the same budget.

        Args:
            held_bytes: Bytes of all layers and heads.

        Raises:
            BudgetExceeded: More than the budget.
        """
        spec = self.state.spec
        if self.state.reached and spec.exceeded_total(held_bytes):
            raise BudgetExceeded(
                f"{self.policy.label()} holds {held_bytes} bytes at step {self.step}{self.where}, "
                f"over its budget {spec.total_capacity:.0f} (β = {spec.budget})"
            )
