"""kvpress presses that need more than the recorded q, k, v, replayed on the trace's own model
([presses](concepts.md#presses)): the model the trace names is loaded once per process, each sample's prompt is
prefilled once (``PrefillCapture``) — every such press at every
budget decides from that one prefill — and the keys it computes must be the keys the trace
recorded, else the replay is refused naming what differs (another model, another dtype).
Presses that read only q, k, v run on the recording and never load the model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..errors import KvscopeError

# how far recomputed keys may stray from the recorded ones, relative to the layer's largest key:
# the recording's own rounding (fp16) or a batch's other float summation order (fp32)
KEY_TOLERANCE = {"float16": 4e-3, "float32": 1e-5}


@dataclass(frozen=True)
class TraceModel:
    """Where the trace's model is (resolved and checked when the replay is set up) and how it
    was run: a worker process loads it from this (picklable) description, once."""

    spec: str  # what resolves it
    dtype: str  # the trace's model dtype setting
    device: str
    recorded: str  # the recorded keys' dtype
    name: str  # how messages name it
    kernel: str = "sdpa"  # the attention kernel the trace computed with

    @classmethod
    def of(cls, ds, store: str, label: str) -> TraceModel:
        from ..model.loading import recorded_model_dtype, trace_model_source

        attrs = ds.attrs
        try:
            source = trace_model_source(store, attrs.get("model"))
        except KvscopeError as error:
            raise KvscopeError(f"{label} runs on the trace's own model, which is not here: {error}") from None
        kernel = attrs.get("attn_kernel", "sdpa")
        return cls(
            source.spec, recorded_model_dtype(store, attrs), attrs.get("device", "cpu"), str(ds["k"].dtype),
            source.spec, kernel if kernel in ("sdpa", "eager") else "sdpa",
        )  # fmt: skip

    def load(self):
        """``(model, tokenizer)``, loaded once per process."""
        return _loaded(self)


@functools.lru_cache(maxsize=2)
def _loaded(where: TraceModel):
    from ..model.loading import load, resolve
    from ..tracing.capture import implementation_name, register

    model, tokenizer = load(resolve(where.spec, allow_hub=False), where.device, where.dtype)
    register()
    model.set_attn_implementation(implementation_name(where.kernel))  # as a live cache runs it
    return model, tokenizer


def model_presses(setup) -> dict[int, str]:
    """``{policy index: why it needs the model}`` of the replay's presses that need the trace's model."""
    acc = setup.ds.kvscope
    out = {}
    for i, policy in enumerate(setup.policies):
        if getattr(policy, "live_hooks", False) and acc.has_qkv:
            reason = policy.needs_model(acc.model, acc.rope)
            if reason is not None:
                out[i] = reason
    return out


def capture(setup, s: int, sample_index: int):
    """Sample ``s``'s prefill on the trace's model (``PrefillCapture``), its keys checked
    against the recorded ones; ``sample_index``: the sample's index in the whole trace (messages)."""
    from ..policies.press_hooks import PrefillCapture

    where = setup.press_model
    model, tokenizer = where.load()
    acc = setup.ds.kvscope
    p = int(acc.prompt_len[s])
    ids = [int(t) for t in setup.ds["tokens"].values[s, :p]]
    captured = PrefillCapture(model, ids, spec=acc.model, tokenizer=tokenizer)
    check_keys(setup, s, sample_index, captured.prompt_keys, where)
    return captured


def check_keys(setup, s: int, sample_index: int, keys: list, where: TraceModel) -> None:
    """The prefill's keys ``[layer] [kv_head, P, D]`` against the trace's ``k`` (rounded to its dtype)."""
    acc = setup.ds.kvscope
    p = int(acc.prompt_len[s])
    recorded = setup.ds["k"].isel(sample=s, pos=slice(0, p))  # [layer, kv_head, P, D]
    layers = [int(x) for x in setup.ds["layer"].values]
    tolerance = KEY_TOLERANCE.get(where.recorded, 4e-3)
    for i, layer in enumerate(layers):
        ours = keys[acc.model.stored_layer(layer)].float().cpu().numpy().astype(where.recorded).astype(np.float32)
        theirs = recorded.isel(layer=i).values.astype(np.float32)
        if ours.shape != theirs.shape:
            raise KvscopeError(
                f"the trace's model {where.name} gives keys of shape {list(ours.shape)} in layer {layer}, "
                f"the trace recorded {list(theirs.shape)}: it was recorded with another model"
            )
        scale = float(np.abs(theirs).max()) or 1.0
        off = float(np.abs(ours - theirs).max())
        if not off <= tolerance * scale:
            raise KvscopeError(
                f"the prefill of sample {sample_index} on {where.name} ({where.dtype}) gives other keys than the "
                f"trace recorded: layer {layer}, max |Δk| {off:.3g} of {scale:.3g} (the trace was recorded with "
                f"another model or dtype; its keys are {where.recorded})"
            )
