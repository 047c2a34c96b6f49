"""The closed loop of one forced decode (``ForcedRun``): the policy driven chunk by chunk, each
chunk's forward run under its tier maps in rounds until they stop changing (the algorithm:
``kvscope.replay.forced``)."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import numpy as np

from ...errors import KvscopeError
from ...policies.driver import PolicyDriver
from ..output_error import renormalized
from .kernel import ChunkAttention, KeySlots
from .quantized import QuantLog, ServedQuantized
from .routing import reads_decodes, reads_prompt, start_state


class ForcedRun:
    """One (policy, allocation, budget) on one ``sample`` (a ``SampleForcing``): its closed-loop
    forced decode (``kvscope.replay.forced``), ``split`` the oracle allocation's where it is one.
    ``scored``: against the sample's full-KV reference (False: the reference's own run).

    After ``run``: ``kl``, ``nll``, ``top1``, ``hit``, ``rank`` ``[S]`` (``ForcedRun._score``),
    ``rounds`` (most rounds of any chunk), ``converged``; with ``keep_logits`` the log-probabilities
    ``[S, vocab]``, and ``feeds`` (each decode forward's q/k/v) where the sample needs them."""

    def __init__(self, sample, policy, allocation, budget: float, split=None, *, scored: bool = True):
        from ...policies.allocation import Given, Uniform

        self.sample, self.policy, self.scored = sample, policy, scored
        cache_spec = sample.cache_spec(budget)
        state = start_state(policy, cache_spec, model_spec=sample.model_spec, rope=sample.rope,
                            capture=lambda: sample.context.capture)  # fmt: skip
        allocation = allocation.for_sample(sample.s) if allocation is not None else Uniform()
        if allocation.clairvoyant:
            allocation = Given.of(split)
        self.driver = PolicyDriver(state, allocation=allocation, where=f" of sample {sample.s} (forced)")
        self.log = QuantLog(cache_spec.n_layers)
        self.decoding = reads_decodes(state)  # a decoding press on stand-ins: fed each forward's q/k/v
        self.depends = policy.observes or self.decoding  # its maps change with what the decode computes
        self.pressed = None  # the cache a prompt-time press left, where it rewrote what it kept
        if (reads_prompt(policy, allocation) and not sample.context.prompt_attention) or (
            self.decoding and not sample.context.feeds_needed
        ):
            raise ValueError(f"sample {sample.s} was prefilled without what {policy.label()} reads")
        self.futures = {policy.horizon: sample.reader.future(policy.horizon)} if policy.clairvoyant else {}
        S = sample.S
        self.kl, self.nll, self.top1 = np.zeros(S), np.zeros(S), np.ones(S, dtype=bool)
        self.hit, self.rank = np.zeros(S, dtype=bool), np.zeros(S, dtype=np.int64)
        self.rounds, self.converged = 1, True
        self.log_probs = None
        self.feeds = None
        self.quantized: ServedQuantized | None = None  # during ``run``, where the ledger quantizes
        self._rows_buffer: np.ndarray | None = None

    @property
    def state(self):
        return self.driver.state

    @property
    def max_rounds(self) -> int:
        return self.sample.max_rounds

    # -- driving the policy ---------------------------------------------------------------------
    def _future(self, t: int):
        return self.futures[self.policy.horizon].at(t) if self.futures else None

    def _begin(self) -> None:
        """Step 0: the policy takes the prompt (its attention, its q/k/v for a press)."""
        pre, st = self.sample.context.prefill, self.state
        if st.ledger is not None:
            st.ledger.sink = self.log
        if self.decoding:  # a decoding press on the recording's stand-ins: the prompt's tensors first
            keys, values, queries = st.recorded
            p = self.sample.P
            keys[:, :, :p], values[:, :, :p], queries[:p] = pre.qkv[0], pre.qkv[1], pre.qkv[2]
        self.log.visible = 1
        self.driver.prefill(pre.colsum, pre.tail, self._future(0))
        pressed = getattr(st, "pressed", None)
        if pressed is not None and pressed.rewrites:
            self.pressed = pressed

    def _drive(self, steps: range, rows_at, feeds_at) -> np.ndarray:
        """The policy through ``steps`` (append, then decide on the rows ``rows_at(t, state)``, a
        decoding press fed ``feeds_at(t)``); returns the tier maps the steps' queries see
        ``[step, layer, unit, P + S]``."""
        maps = np.empty((len(steps), *self.state.tiers.shape), dtype=np.int8)
        for i, t in enumerate(steps):
            maps[i] = self._append(t)
            self._decide(t, rows_at, feeds_at)
        return maps

    def _append(self, t: int) -> np.ndarray:
        """Step ``t``'s position enters the cache; returns the tier map its query sees
        ``[layer, unit, P + S]`` (decided by the steps before it alone)."""
        self.log.visible = t
        self.driver.append(self.sample.P - 1 + t)
        self.log.visible = t + 1
        return self.state.tiers

    def _decide(self, t: int, rows_at, feeds_at) -> None:
        """The policy's decision after step ``t``: on the rows ``rows_at(t, state)`` its query saw
        (where it observes), a decoding press fed the step's own q/k/v ``feeds_at(t)``."""
        st = self.state
        if self.decoding:
            keys, values, queries = st.recorded
            k, v, q = feeds_at(t)
            at = self.sample.P - 1 + t
            keys[:, :, at], values[:, :, at], queries[at] = k[:, :, 0], v[:, :, 0], q[0]
        self.driver.decide(rows_at(t, st) if self.policy.observes else None, self._future(t))
        if self.decoding and st.rewrites:
            raise KvscopeError(
                f"press {self.policy.press} rewrites what it keeps while decoding ({', '.join(sorted(st.rewrites))}"
                "): forced replay serves a press's rewrites of the prompt's cache, not those made while decoding"
            )

    def _recorded_rows(self, t: int, st) -> np.ndarray:
        """Round 0's observation: the recorded full-KV row restricted to the cache, renormalized."""
        reader = self.sample.reader
        return renormalized(reader.row(t)[..., : st.length], st.accessible(), reader.share(t))

    def _snapshot(self):
        """The driver and the quantization log, copied (the ledger's sink detached meanwhile)."""
        ledger = self.state.ledger
        if ledger is not None:
            ledger.sink = None
        saved = copy.deepcopy((self.driver, self.log))
        if ledger is not None:
            ledger.sink = self.log
        return saved

    def _restore(self, saved) -> None:
        self.driver, self.log = copy.deepcopy(saved)
        if self.state.ledger is not None:
            self.state.ledger.sink = self.log

    # -- the forced decode ----------------------------------------------------------------------
    def run(self, keep_logits: bool = False) -> ForcedRun:
        """The forced decode (its reference, the sample's, made first where it is still to make)."""
        import torch

        sample = self.sample
        reference = sample.reference if self.scored else None
        self._begin()
        cache = copy.deepcopy(sample.context.prefill.cache) if self.pressed is None else self._pressed_cache()
        if self.state.ledger is not None and self.pressed is None:
            self.quantized = ServedQuantized(sample.n_positions, len(self.log.layers), self.state.ledger.dequantized)
        logits0 = torch.log_softmax(sample.context.prefill.logits, -1)
        if keep_logits:
            self.log_probs = np.empty((sample.S, logits0.shape[-1]), dtype=np.float32)
            self.log_probs[0] = logits0.numpy()
        if sample.context.feeds_needed and keep_logits:
            self.feeds = [None] * sample.S
        self._score(range(1), logits0[None], None, keep_logits=False)
        chunk = 1 if self.decoding else sample.chunk  # a decoding press: step by step (``_step``)
        for c0 in range(1, sample.S, chunk):
            steps = range(c0, min(sample.S, c0 + chunk))
            cache = self._chunk(steps, cache, reference, keep_logits)
        self.quantized = self._rows_buffer = None
        return self

    def _pressed_cache(self):
        """The continuation's past where a prompt-time press rewrote what it kept (re-rotated or
        merged keys and values, pruned key channels): each layer holds the rows the press left, as
        it left them (masked rows too: their tiers hide them)."""
        from transformers.cache_utils import DynamicLayer

        cache = copy.deepcopy(self.sample.context.prefill.cache)
        model_spec = self.sample.model_spec
        for stored, pressed in enumerate(self.pressed.layers):
            layer = cache.layers[model_spec.model_layer(stored)]
            if type(layer) is not DynamicLayer:
                raise KvscopeError(
                    f"forced replay serves {self.policy.label()}'s own rewritten cache on layers that keep every "
                    f"position; this model's layer {model_spec.model_layer(stored)} is a {type(layer).__name__}"
                )
            layer.keys = pressed.keys[None].to(layer.keys.dtype)  # [1, kv_head, n, D]
            layer.values = pressed.values[None].to(layer.values.dtype)
        return cache

    def _chunk(self, steps: range, cache, reference, keep_logits: bool):
        """One chunk of steps, in rounds until its tier maps stop changing; returns the cache after it."""
        if self.depends and len(steps) == 1:
            return self._step(steps.start, cache, reference, keep_logits)
        saved = self._snapshot() if self.depends else None
        if self.quantized is not None:
            self.quantized.close_chunk(self.sample.P - 1 + steps.start, self.log)
        mark = _Checkpoint(cache, cache.get_seq_length(), again=self.depends)
        maps = self._drive(steps, self._recorded_rows, lambda t: reference.feeds[t])
        signature = self.log.signature()
        seen, first = None, 0  # the round's forward; the first step whose maps changed since the last
        for rounds in range(1, self.max_rounds + 1):
            seen = self._forward(steps, maps, mark, before=seen, first=first)
            if not self.depends:
                break
            self._restore(saved)
            again = self._drive(steps, *seen.observations(steps.start))
            same_log = self.log.signature() == signature
            if same_log and np.array_equal(again, maps):
                break
            if rounds == self.max_rounds:
                self.converged = False
                break
            # by causality the steps before the first changed map saw the same cache: they are kept
            first = int(np.argmax((again != maps).reshape(len(again), -1).any(1))) if same_log else 0
            maps, signature = again, self.log.signature()
            mark.rewind(first)
        self.rounds = max(self.rounds, rounds)
        self._score(steps, seen.log_probs, reference, keep_logits)
        if keep_logits and self.feeds is not None:
            self.feeds[steps.start : steps.stop] = seen.feeds
        return mark.cache

    def _step(self, t: int, cache, reference, keep_logits: bool):
        """Step ``t`` of a closed loop as live decoding takes it: its query's tier map is decided by
        the steps before it alone, so one forward under it is exact and the policy decides on what
        that forward computed (a chunk of one step, without its rounds). A press that acts while
        decoding runs this way: in chunks, each round would make about one more of its steps exact."""
        if self.quantized is not None:
            self.quantized.close_chunk(self.sample.P - 1 + t, self.log)
        steps = range(t, t + 1)
        maps = self._append(t)[None].copy()  # [1, layer, unit, P + S]
        seen = self._forward(steps, maps, _Checkpoint(cache, cache.get_seq_length(), again=False))
        self._decide(t, *seen.observations(t))
        self._score(steps, seen.log_probs, reference, keep_logits)
        if keep_logits and self.feeds is not None:
            self.feeds[t] = seen.feeds[0]
        return cache

    def _forward(self, steps: range, maps: np.ndarray, mark: _Checkpoint, before=None, first: int = 0) -> ChunkSeen:
        """The chunk's forward under ``maps`` on ``mark``'s cache; returns its log-probabilities, the
        rows its queries saw (where the policy observes) and its new positions' q/k/v (where a policy
        reads them). With ``before`` (the previous round's) and ``first``: only the steps from the
        chunk's ``first`` on are run again (the cache holds the ones before), the earlier ones kept
        from ``before`` (its rows written over from ``first`` on)."""
        cache = mark.cache
        if before is not None and first > 0 and cache.get_seq_length() == mark.length + first:
            rows = None if before.rows is None else before.rows[first:]
            again = self._forward_all(steps[first:], maps[first:], cache, rows)
            return before.joined(first, again)
        rows = self._row_buffer(len(steps), maps.shape[1:]) if self.policy.observes else None
        return self._forward_all(steps, maps, cache, rows)

    def _row_buffer(self, n: int, shape: tuple) -> np.ndarray:
        """``[n, layer, unit, P + S]`` float32 for a forward's rows: one buffer of the run, reused by
        every chunk (the rows of a chunk are read before the next one starts)."""
        if self._rows_buffer is None or self._rows_buffer.shape[1:] != shape:
            self._rows_buffer = np.zeros((self.sample.chunk, *shape), dtype=np.float32)
        return self._rows_buffer[:n]

    def _forward_all(self, steps: range, maps: np.ndarray, cache, rows: np.ndarray | None) -> ChunkSeen:
        """The forward of ``steps`` under ``maps``, the rows its queries see written into ``rows``."""
        import torch

        from ...model.spec import with_cache
        from ...tracing.capture import attention_override

        sample = self.sample
        model = sample.forced.model
        quantized = None
        if self.quantized is not None:
            quantized = functools.partial(self.quantized.window, steps=steps, log=self.log)
        attention = ChunkAttention(steps, maps, rows=rows, model_spec=sample.model_spec,
                                   slots=KeySlots(sample.P, self.pressed), quantized=quantized,
                                   keep_feeds=sample.context.feeds_needed)  # fmt: skip
        ids = sample.continuation[steps.start - 1 : steps.stop - 1][None].to(sample.forced.device)
        where = {}
        if self.pressed is not None and self.pressed.first_position != sample.P:  # the press renumbered the rows
            first = self.pressed.first_position + steps.start - 1
            where["position_ids"] = torch.arange(first, first + len(steps), device=ids.device)[None]
        with torch.no_grad(), attention_override(attention):
            out = model(input_ids=ids, use_cache=True, **with_cache(model, cache), **where)
        log_probs = torch.log_softmax(out.logits[0].float(), -1).cpu()
        return ChunkSeen(log_probs, attention.rows, attention.step_feeds())

    def _score(self, steps: range, log_probs, reference, keep_logits: bool) -> None:
        """Of the chunk's steps (``log_probs [step, vocab]``, ``log p = log_softmax z`` in float32):

            nll_t  = −log p(y_t)
            hit_t  = [argmax p = y_t]                 the greedy decode would emit y_t here
            rank_t = #{v : log p(v) > log p(y_t)}     0 where y_t is a most likely token

        and against the full-KV reference ``p*`` (where scored) ``kl_t = Σ p* (log p* − log p)`` and
        ``top1_t = [argmax p* = argmax p]``. ``argmax`` is ``torch.argmax``, the first maximal index,
        as the live greedy decode breaks ties (``kvscope.live.run.decode``); it takes it over the
        logits, this over their log-softmax — the same index unless two logits differ by less than
        the log-softmax's float32 rounding and become an exact tie (then this takes the lower index).
        Step 0 (the prefill's last row) is scored by ``run`` with no reference (its KL is 0)."""
        import torch

        at = slice(steps.start, steps.stop)
        y = self.sample.continuation[at]
        chosen = log_probs.gather(-1, y[:, None])  # [step, 1]
        self.nll[at] = (-chosen[:, 0]).numpy()
        self.hit[at] = (log_probs.argmax(-1) == y).numpy()
        self.rank[at] = (log_probs > chosen).sum(-1).numpy()
        if reference is not None:
            ref = torch.from_numpy(reference.log_probs[at])
            self.kl[at] = (ref.exp() * (ref - log_probs)).sum(-1).numpy()
            self.top1[at] = (ref.argmax(-1) == log_probs.argmax(-1)).numpy()
        if keep_logits:
            self.log_probs[at] = log_probs.numpy()


@dataclass
class ChunkSeen:
    log_probs: object  # [chunk, vocab] float32 tensor
    rows: np.ndarray | None  # [chunk, layer, unit, P + S] the kv-group rows the queries saw
    feeds: list | None  # per step (keys, values [layer, unit, 1, D], queries [1, layer, head, D])

    def observations(self, start: int):
        """``(rows_at(t, state), feeds_at(t))`` of the chunk beginning at step ``start``: what its
        queries saw, as a policy is driven on it (the rows up to the state's length)."""
        return (lambda t, st: self.rows[t - start][..., : st.length]), (lambda t: self.feeds[t - start])

    def joined(self, first: int, later: ChunkSeen) -> ChunkSeen:
        """This round's steps before ``first`` and ``later``'s from there."""
        import torch

        rows = self.rows  # later's were written into it
        feeds = None if self.feeds is None else self.feeds[:first] + later.feeds
        return ChunkSeen(torch.cat([self.log_probs[:first], later.log_probs]), rows, feeds)


class _Checkpoint:
    """The cache as it was before a chunk (``length`` positions), to run the chunk again: cropped
    back where every layer holds all its positions (a plain ``DynamicLayer``), else a copy taken now
    (sliding windows drop positions, recurrent layers keep a state)."""

    def __init__(self, cache, length: int, again: bool):
        from transformers.cache_utils import DynamicLayer

        self.cache, self.length = cache, length
        layers = getattr(cache, "layers", None) or []
        self.croppable = bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
        self.copy = copy.deepcopy(cache) if again and not self.croppable else None

    def rewind(self, steps: int = 0) -> None:
        """Back to the chunk's start, or ``steps`` into it where the cache can be cropped."""
        if self.croppable:
            self.cache.crop(self.length + steps - self.cache.get_seq_length())  # tokens to remove, negative
        else:
            self.cache = copy.deepcopy(self.copy)
