"""kvpress presses that need more than the recorded q, k, v, replayed on the trace's own model
([presses](concepts.md#presses)): the model the trace names is loaded once per process, each sample's prompt is
prefilled once (``PrefillCapture``) — every such press at every
budget decides from that one prefill — and the keys it computes must be the keys the trace
recorded, else the replay is refused naming what differs (another model, another dtype).
Presses that read only q, k, v run on the recording and never load the model.

``TraceModel`` is the one loader of a trace's model: press replay here and forced replay
(``kvscope.replay.forced.model``) read the trace's settings through it and share its cache.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from ..errors import KvscopeError

# how far recomputed keys may stray from the recorded ones, relative to the layer's largest key:
# the recording's own rounding (fp16) or a batch's other float summation order (fp32)
KEY_TOLERANCE = {"float16": 4e-3, "float32": 1e-5}


@dataclass(frozen=True)
class TraceModel:
    """The model a trace was recorded with and how it ran, read from the trace's attributes (the
    recorded name and weights, ``settings.model_dtype``, ``device``, ``attn_kernel``), resolved and
    checked when a replay is set up; a worker process loads it from this (picklable) description,
    once (``load``)."""

    name: str  # the model's name as the trace records it: what resolves it, how messages name it
    dtype: str  # the trace's model dtype setting
    device: str
    kernel: str = "sdpa"  # the attention kernel that computed the trace's layer outputs
    trust_remote_code: bool = False

    @classmethod
    def of(cls, ds, store: str, label: str, needs: str = "runs on the trace's own model") -> TraceModel:
        """The trace's model, looked up locally (a store never makes kvscope reach the network) with
        the weights' sha256 the trace records; where it is not here, refused in one line saying
        what ``needs`` it (``label``: a press, or forced replay)."""
        from ..model.loading import recorded_model_dtype, trace_model_source

        attrs = ds.attrs
        settings = attrs.get("settings") or {}
        try:
            source = trace_model_source(store, attrs.get("model"))
        except KvscopeError as error:
            raise KvscopeError(f"{label} {needs}, which is not here: {error}") from None
        return cls(
            name=source.spec,
            dtype=recorded_model_dtype(store, attrs),
            device=attrs.get("device") or settings.get("device") or "cpu",
            kernel=attrs.get("attn_kernel") or settings.get("attn") or "sdpa",
            trust_remote_code=bool(settings.get("trust_remote_code", False)),
        )

    def on(self, device: str | None) -> TraceModel:
        """The same model on ``device`` (None: the trace's)."""
        return self if device is None else replace(self, device=device)

    def load(self):
        """``(model, tokenizer)``, loaded once per process and description, attending through
        kvscope's variant of the trace's kernel (as a live cache runs it)."""
        return _loaded(self)


@functools.lru_cache(maxsize=2)
def _loaded(where: TraceModel):
    from ..model.loading import load, resolve
    from ..tracing.capture import implementation_name, register

    source = resolve(where.name, allow_hub=False)  # ModelSource
    model, tokenizer = load(source, where.device, where.dtype, trust_remote_code=where.trust_remote_code)
    register()
    model.set_attn_implementation(implementation_name(where.kernel))
    return model, tokenizer


def model_presses(setup) -> dict[int, str]:
    """``{policy index: why it needs the model}`` of the replay's presses that need the trace's model."""
    acc = setup.ds.kvscope
    out = {}
    for i, policy in enumerate(setup.policies):
        if getattr(policy, "live_hooks", False) and acc.has_qkv:
            reason = policy.needs_model()
            if reason is not None:
                out[i] = reason
    return out


def capture(setup, s: int, sample_index: int):
    """Sample ``s``'s prefill on the trace's model (``PrefillCapture``), its keys checked
    against the recorded ones; ``sample_index``: the sample's index in the whole trace (messages).
    The samples of one context (its questions) share it in a process: their presses decide from one
    prefill, and a reconstructing press (KVzip) scores the context once."""
    acc = setup.ds.kvscope
    p = int(acc.prompt_len[s])
    ids = tuple(int(t) for t in setup.ds["tokens"].values[s, :p])
    captured = _prefill_capture(setup.press_model, ids, acc.model)
    check_keys(setup, s, sample_index=sample_index, keys=captured.prompt_keys, where=setup.press_model)
    return captured


_CAPTURES: dict = {}  # (model, its spec, prompt ids) → PrefillCapture: the last two prompts of this process


def _prefill_capture(where: TraceModel, ids: tuple[int, ...], model_spec):
    """The prompt ``ids``' ``PrefillCapture`` on ``where``'s model, made once per process."""
    from ..policies.press_hooks import PrefillCapture

    key = (where, repr(model_spec), ids)
    if key not in _CAPTURES:
        model, tokenizer = where.load()
        while len(_CAPTURES) >= 2:
            _CAPTURES.pop(next(iter(_CAPTURES)))
        _CAPTURES[key] = PrefillCapture(model, list(ids), model_spec=model_spec, tokenizer=tokenizer)
    return _CAPTURES[key]


def check_keys(setup, s: int, *, sample_index: int, keys: list, where: TraceModel) -> None:
    """The prefill's keys ``[layer] [kv_head, P, D]`` against the trace's ``k`` (rounded to its dtype)."""
    acc = setup.ds.kvscope
    p = int(acc.prompt_len[s])
    recorded = setup.ds["k"].isel(sample=s, pos=slice(0, p))  # [layer, kv_head, P, D]
    stored = str(recorded.dtype)  # the recorded keys' dtype
    layers = [int(x) for x in setup.ds["layer"].values]
    tolerance = KEY_TOLERANCE.get(stored, 4e-3)
    for i, layer in enumerate(layers):
        ours = keys[acc.model.stored_layer(layer)].float().cpu().numpy().astype(stored).astype(np.float32)
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
                f"another model or dtype; its keys are {stored})"
            )
