"""One sample of a forced replay (``SampleForcing``): its prompt's prefill, shared by every run, and
its full-KV reference ``z*`` — each made once, when first read, whatever reads it first."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ...errors import KvscopeError
from ...policies import parse
from ..reader import SampleReader
from .loop import ForcedRun


@dataclass
class Prefill:
    """The prompt's forward, shared by every run of a sample."""

    cache: object  # the transformers cache after the prompt
    logits: object  # [vocab] float32: step 0's logits (the prefill's last position)
    colsum: np.ndarray | None  # [layer, unit, P] float64 (None: not recorded, nobody reads it)
    tail: np.ndarray | None  # [layer, unit, obs, P] float32
    qkv: tuple | None  # (keys, values [layer, unit, P, D] tensors, queries [P, layer, head, D]) for presses


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
    (``prompt_presses``: a prompt-time press — the prefill's own forward keeps it, else ``capture``
    makes a forward of its own)."""

    def __init__(self, setup, s: int, forced, chunk: int, max_rounds: int, prompt_attention: bool = True,
                 decoding_presses: bool = True, prompt_presses: bool = False):  # fmt: skip
        import torch

        acc = setup.ds.kvscope
        self.setup, self.s, self.forced = setup, s, forced
        self.chunk, self.max_rounds = chunk, max_rounds
        self.P, self.S = int(acc.prompt_len[s]), int(acc.n_steps[s])
        tokens = np.asarray(setup.ds["tokens"].values[s, : self.P + self.S], dtype=np.int64)
        self.prompt = torch.from_numpy(tokens[: self.P])
        self.continuation = torch.from_numpy(tokens[self.P :])  # [S] y_0 … y_{S−1}
        self.first_scored = int(acc.question_tokens[s])  # question-agnostic: the question's steps are not scored
        self.reader = SampleReader(setup.ds, s, setup.group)
        self.model_spec = acc.model
        self.rope = forced.rope
        self.feeds_needed = decoding_presses
        self.prompt_attention = prompt_attention
        self.prompt_presses = prompt_presses

    @property
    def final_len(self) -> int:
        return self.P + self.S

    def cache_spec(self, budget: float):
        """The cache spec of a run (the replay's: full-precision entries counted at its ``kv_itemsize``,
        by default the model's own dtype under forced replay, as ``kvscope run`` counts them)."""
        return self.setup.spec(self.s, budget)

    @property
    def prefill(self) -> Prefill:
        """The prompt's forward, made once: its layers' outputs by the model's kernel (as a live
        cache computes them under every policy), with the prompt's attention where
        ``prompt_attention``."""
        return self._prompt_forward[0]

    @functools.cached_property
    def capture(self):
        """What each layer's press hook is handed on the prompt (``PrefillCapture``), made once per
        sample: prompt-time presses decide from it, as their hook does on a live prefill. The
        prefill's own forward where the sample was made for ``prompt_presses``, else a forward of
        its own."""
        kept = self._prompt_forward[1] if self.prompt_presses else None
        return kept if kept is not None else self._press_capture()

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

    @functools.cached_property
    def _prompt_forward(self) -> tuple:
        """``(Prefill, PrefillCapture | None)``: the prompt's forward; with ``prompt_presses`` the same
        forward keeps what each layer's press hook is handed."""
        import torch

        from ...model.spec import returned_cache
        from ...tracing.capture import ForwardContext

        recorder = self._recorder()
        recorder.begin(ForwardContext(seq_len=self.P, pad=torch.zeros(1, dtype=torch.long)))
        done = {}

        def forward():
            done["out"] = self._forward(recorder)
            return returned_cache(done["out"])

        captured = self._press_capture(forward) if self.prompt_presses else None
        if captured is None:
            forward()
        out = done["out"]
        colsum, tail = recorder.prompt_attention() if self.prompt_attention else (None, None)
        qkv = recorder.forward_tensors() if self.feeds_needed else None
        prefill = Prefill(cache=returned_cache(out), logits=out.logits[0, -1].float().cpu(), colsum=colsum,
                          tail=tail, qkv=qkv)  # fmt: skip
        return prefill, captured

    def _press_capture(self, forward=None):
        """The prompt's ``PrefillCapture`` on the model: through ``forward`` (a forward of the prompt
        returning its cache), else a forward of its own."""
        from ...policies.press_hooks import PrefillCapture

        return PrefillCapture(self.forced.model, self.prompt.tolist(), model_spec=self.model_spec,
                              tokenizer=self.forced.tokenizer, forward=forward)  # fmt: skip

    def _recorder(self):
        """The recorder of the prompt's forward: its attention where ``prompt_attention``, its q/k/v
        where ``decoding_presses``."""
        from ...tracing.capture import AttentionRecorder

        model_spec = self.model_spec
        slots = {layer: i for i, layer in enumerate(model_spec.layer_index)} if model_spec.attention_layers else None
        return AttentionRecorder(
            n_layers=model_spec.n_layers, n_stored_heads=model_spec.n_kv_heads,
            obs_window=self.setup.ds.kvscope.obs_window, record_qkv=self.feeds_needed,
            n_units=model_spec.n_kv_heads, probabilities=self.prompt_attention, layer_slots=slots,
        )  # fmt: skip

    def _forward(self, recorder):
        """The model's forward of the prompt (its last position's logits) into a new cache, recorded."""
        import torch
        from transformers import DynamicCache

        from ...model.spec import last_logits_only, with_cache

        model = self.forced.model
        ids = self.prompt[None].to(self.forced.device)
        with torch.no_grad(), recorder.active():
            return model(input_ids=ids, use_cache=True, **last_logits_only(model),
                         **with_cache(model, DynamicCache(config=model.config)))  # fmt: skip

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
