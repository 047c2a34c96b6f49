"""The trace's own model for forced replay: loaded once (``kvscope.replay.presses.TraceModel``, the
one loader of a trace's model), checked against what the trace says of it."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import KvscopeError
from ..presses import TraceModel


@dataclass
class ForcedModel:
    """The trace's own model, loaded once per replay, attending through kvscope's function."""

    model: object  # the transformers model
    model_spec: object  # its ModelSpec as inspected
    label: str
    tokenizer: object = None

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def rope(self):
        """The model's rotary parameters where the ledger can quantize keys before RoPE (as a live
        cache does), else None."""
        from ...model.rope import Rope

        rope = Rope.from_model(self.model, self.model_spec.n_layers)
        return rope if rope.usable() else None

    @property
    def itemsize(self) -> int:
        """Bytes of one K/V element in the model's own cache (its dtype)."""
        return next(self.model.parameters()).dtype.itemsize


def load_model(ds, device: str | None = None) -> ForcedModel:
    """Load the model a trace was recorded with (``TraceModel``: its name, weights' sha256, dtype,
    device and kernel), on ``device`` where given, checked against what the trace says of it
    (geometry, continuations); refused in one line where it is gone or differs."""
    from ...tracing.architecture import inspect

    where = TraceModel.of(ds, "the trace", "forced replay", needs="needs the trace's model")
    model, tokenizer = where.on(device).load()
    model_spec = inspect(model, where.kernel)
    check_geometry(model_spec, ds.kvscope.model, where.name)
    forced = ForcedModel(model=model, model_spec=model_spec, label=where.name, tokenizer=tokenizer)
    check_continuations(ds, forced)
    return forced


def check_continuations(ds, forced: ForcedModel) -> None:
    """A trace that forced given continuations or gold answers: each recorded text still
    tokenizes to the stored tokens with the loaded model's tokenizer (else the forced replay
    would score another text); a gold answer as ``kvscope.model.prompts.answer_ids`` does."""
    from ...model.prompts import Prompt, answer_ids, has_answers

    acc = ds.kvscope
    if not acc.continued:
        return
    prompts = ds.attrs.get("prompts") or []
    for s, n in enumerate(acc.continuation_tokens):
        doc = prompts[s] if s < len(prompts) else {}
        text = doc.get("continuation")
        start = int(acc.prompt_len[s] + acc.question_tokens[s])
        stored = [int(x) for x in ds["tokens"].values[s, start : start + int(n)]]
        if text is None and has_answers(doc):
            text = doc["answers"][0]
            ids = answer_ids(forced.tokenizer, Prompt.from_doc(doc))[: int(n)]
        else:
            ids = forced.tokenizer(text or "", add_special_tokens=False)["input_ids"][: int(n)]
        if not isinstance(text, str) or ids != stored:
            raise KvscopeError(
                f"forced replay: sample {s}'s recorded continuation does not match the trace's tokens with the "
                f"tokenizer of {forced.label!r} (the trace holds {len(stored)} forced tokens)"
            )


def check_geometry(model_spec, traced, name: str) -> None:
    """The loaded model caches what the trace says it does (else refused, naming what differs)."""
    if model_spec.from_weights:
        raise KvscopeError(
            f"forced replay serves each policy's cache through kvscope's attention function; "
            f"{model_spec.architecture or name} attends in its own modules"
        )
    mine = (model_spec.n_layers, model_spec.n_kv_heads, model_spec.head_dim)
    theirs = (traced.n_layers, traced.n_kv_heads, traced.head_dim)
    if mine != theirs:
        raise KvscopeError(
            f"forced replay: the model {name!r} loaded now has (layers, cache units, head_dim) {mine}, "
            f"the trace {theirs}"
        )
