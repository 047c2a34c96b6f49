"""A context's prefill under forced replay (``ContextPrefill``): the prompt's forward on the trace's
model, made once and shared by every run of every sample whose prefill holds the same tokens — a
context with several questions (question-agnostic: ``ds.kvscope.contexts``) is prefilled once."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass
class Prefill:
    """The prompt's forward, shared by every run of its samples."""

    cache: object  # the transformers cache after the prompt
    logits: object  # [vocab] float32: step 0's logits (the prefill's last position)
    colsum: np.ndarray | None  # [layer, unit, P] float64 (None: not recorded, nobody reads it)
    tail: np.ndarray | None  # [layer, unit, obs, P] float32
    qkv: tuple | None  # (keys, values [layer, unit, P, D] tensors, queries [P, layer, head, D]) for presses


class ContextPrefill:
    """The forward of ``prompt`` (``[P]`` token ids) on the loaded ``forced`` model: its cache,
    logits and, as the runs need them, the prompt's attention (``prompt_attention``: a policy or
    allocation reads it), its q/k/v (``feeds_needed``: a press that acts while decoding) and what
    each layer's press hook is handed (``prompt_presses``: a prompt-time press — the same forward
    keeps it, else ``capture`` makes a forward of its own). Each is made once, when first read."""

    def __init__(self, prompt, forced, *, model_spec, obs_window: int, prompt_attention: bool = True,
                 feeds_needed: bool = True, prompt_presses: bool = False):  # fmt: skip
        self.prompt, self.forced, self.model_spec, self.obs_window = prompt, forced, model_spec, obs_window
        self.prompt_attention, self.feeds_needed, self.prompt_presses = prompt_attention, feeds_needed, prompt_presses

    @property
    def P(self) -> int:
        return int(self.prompt.shape[0])

    @property
    def prefill(self) -> Prefill:
        """The prompt's forward, made once: its layers' outputs by the model's kernel (as a live
        cache computes them under every policy), with the prompt's attention where
        ``prompt_attention``."""
        return self._prompt_forward[0]

    @functools.cached_property
    def capture(self):
        """What each layer's press hook is handed on the prompt (``PrefillCapture``), made once:
        prompt-time presses decide from it, as their hook does on a live prefill. The prefill's own
        forward where ``prompt_presses``, else a forward of its own."""
        kept = self._prompt_forward[1] if self.prompt_presses else None
        return kept if kept is not None else self._press_capture()

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
        where ``feeds_needed``."""
        from ...tracing.capture import AttentionRecorder

        model_spec = self.model_spec
        slots = {layer: i for i, layer in enumerate(model_spec.layer_index)} if model_spec.attention_layers else None
        return AttentionRecorder(
            n_layers=model_spec.n_layers, n_stored_heads=model_spec.n_kv_heads, obs_window=self.obs_window,
            record_qkv=self.feeds_needed, n_units=model_spec.n_kv_heads, probabilities=self.prompt_attention,
            layer_slots=slots,
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
