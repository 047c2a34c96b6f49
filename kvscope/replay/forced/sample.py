"""One sample of a forced replay (``SampleForcing``): its context's prefill (``ContextPrefill``,
shared by every run and by the other questions of its context) and its full-KV reference ``z*`` —
each made once, when first read, whatever reads it first."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ...errors import KvscopeError
from ...policies import parse
from ..reader import SampleReader
from .loop import ForcedRun
from .prefill import ContextPrefill


@dataclass
class Reference:
    """The continuation decoded under full KV: ``log_probs [S, vocab]`` float32 (``log softmax z*_t``)
    and, where the sample's runs need them, each step's ``feeds`` (keys, values, queries)."""

    log_probs: np.ndarray
    feeds: list | None


class SampleForcing:
    """Sample ``s`` of a replay ``setup`` under the loaded ``forced`` model: its prefill, its full-KV
    reference, then any policy's forced decode (``ForcedRun.run``). What the runs read: the
    prompt's attention (``prompt_attention``: a policy or allocation), each forward's q/k/v
    (``decoding_presses``: a kvpress press that acts while decoding — the prefill keeps the
    prompt's, the reference each step's), what each layer's press hook is handed on the prompt
    (``prompt_presses``: a prompt-time press): these make its own prefill, unless ``context`` is given —
    the prefill of a sample with the same prompt tokens, which carries its own (``context_prefill``)."""

    def __init__(self, setup, s: int, forced, chunk: int, max_rounds: int, prompt_attention: bool = True,
                 decoding_presses: bool = True, prompt_presses: bool = False,
                 context: ContextPrefill | None = None):  # fmt: skip
        import torch

        acc = setup.ds.kvscope
        self.setup, self.s, self.forced = setup, s, forced
        self.chunk, self.max_rounds = chunk, max_rounds
        self.P, self.S = int(acc.prompt_len[s]), int(acc.n_steps[s])
        tokens = np.asarray(setup.ds["tokens"].values[s, : self.P + self.S], dtype=np.int64)
        self.continuation = torch.from_numpy(tokens[self.P :])  # [S] y_0 … y_{S−1}
        self.first_scored = int(acc.question_tokens[s])  # question-agnostic: the question's steps are not scored
        self.reader = SampleReader(setup.ds, s, setup.group)
        self.model_spec = acc.model
        self.rope = forced.rope
        needs = {"prompt_attention": prompt_attention, "decoding_presses": decoding_presses,
                 "prompt_presses": prompt_presses}  # fmt: skip
        self.context = context or context_prefill(setup, s, forced, **needs)
        if not np.array_equal(self.context.prompt.numpy(), tokens[: self.P]):
            raise ValueError(f"sample {s} was given the prefill of another prompt")

    @property
    def n_positions(self) -> int:
        """``P + S``: the positions of the sample's own arrays (its budget's final length is its
        context's, ``cache_spec``)."""
        return self.P + self.S

    def cache_spec(self, budget: float):
        """The cache spec of a run (the replay's: full-precision entries counted at its ``kv_itemsize``,
        by default the model's own dtype under forced replay, as ``kvscope run`` counts them)."""
        return self.setup.spec(self.s, budget)

    @functools.cached_property
    def reference(self) -> Reference:
        """The full-KV reference: the forced decode under ``full``, its tokens checked to be the
        model's greedy choices (``_check_tokens``)."""
        full = ForcedRun(self, parse("full"), None, 1.0, scored=False).run(keep_logits=True)
        self._check_tokens(full.log_probs)
        return Reference(full.log_probs, full.feeds)

    def start(self) -> None:
        """Make the full-KV reference now (else the first run makes it)."""
        _ = self.reference

    def perplexity_full(self) -> float:
        """``exp(mean −log p*(y_t))`` over the scored steps under full KV."""
        steps = np.arange(self.first_scored, self.S)
        return math.exp(float(-self.reference.log_probs[steps, self.continuation.numpy()[steps]].mean()))

    def exact_full(self) -> float:
        """``Π_t [argmax_v log p*_t(v) = y_t]`` over the scored steps under full KV: 1.0 iff greedy
        decoding with the full cache emits the continuation (with answers: the gold answer) first."""
        steps = np.arange(self.first_scored, self.S)
        return float((self.reference.log_probs[steps].argmax(-1) == self.continuation.numpy()[steps]).all())

    def _check_tokens(self, log_probs: np.ndarray) -> None:
        """The trace's greedy tokens are this model's greedy choices under full KV (``log_probs
        [S, vocab]``; else the model, or its weights, differ from the recording's); sampled traces
        and forced question steps are not checked."""
        gen = self.setup.ds.attrs.get("generation") or {}
        if gen.get("sampling") or self.setup.ds.kvscope.continued:  # sampled, or a given text: not greedy
            return
        y = self.continuation.numpy()
        chosen = log_probs[np.arange(self.S), y]
        best = log_probs.max(-1)
        slack = 1e-3 if self.forced.itemsize >= 4 else 5e-2
        wrong = np.flatnonzero((chosen < best - slack) & (np.arange(self.S) >= self.first_scored))
        if wrong.size:
            t = int(wrong[0])
            raise KvscopeError(
                f"forced replay: sample {self.s}'s token at step {t} ({int(y[t])}) is not the greedy choice of the "
                f"model {self.forced.label!r} loaded now (log-probability {chosen[t]:.4f} against {best[t]:.4f}): "
                "the trace was recorded with other weights, dtype or kernel"
            )


def context_prefill(setup, s: int, forced, *, prompt_attention: bool, decoding_presses: bool,
                    prompt_presses: bool) -> ContextPrefill:  # fmt: skip
    """The prefill of sample ``s``'s prompt, for every sample of its context (``ds.kvscope.contexts``)."""
    import torch

    acc = setup.ds.kvscope
    prompt = torch.from_numpy(np.asarray(setup.ds["tokens"].values[s, : int(acc.prompt_len[s])], dtype=np.int64))
    return ContextPrefill(prompt, forced, model_spec=acc.model, obs_window=acc.obs_window,
                          prompt_attention=prompt_attention, feeds_needed=decoding_presses,
                          prompt_presses=prompt_presses)  # fmt: skip
