"""kvpress's protocols where a press needs more than its hook on the prefill's forward, dispatched in
one place for the live cache and offline (``finish``); which press follows which is its
``protocol`` in the traits table (``kvscope.policies.press_traits``):

    reconstructs the context   extra forwards of the repeated context over the prefilled cache,
                               each layer's hook scoring it, then masks (``compress_post``); the
                               press's own hooks score where it has them (KVgrad)
    masks after the prefill    its hooks scored during the prefill; it masks after it
    runs the context again     the context runs over its prefilled cache, each layer's hook
                               gathering how it attends, then the press compresses the cache

``hooks`` is the ``PressHooks`` serving ``cache``: the live cache's, or a capture's own
(``PrefillCapture``), its ``rows`` and ``decided`` the layers' positions and decisions. Offline a
reconstructing press's scores are computed once per prompt and configuration (``scores``).
"""

from __future__ import annotations

from . import kvpress_adapter as adapter
from .press_run import language_model, untouched
from .press_traits import MASKS, MASKS_AFTER, RECONSTRUCT_OWN, RECONSTRUCTS, RERUN_CONTEXT, protocol


def before_hooks(press, n_layers: int) -> None:
    """Before the prefill's hooks run again on a press that keeps per-layer scores (masks after)."""
    if protocol(press) == MASKS_AFTER:
        press.score_val = [None] * n_layers  # as its post_init does at every prefill


def finish(hooks, cache, prompt_ids, tokenizer=None, scores=None) -> None:
    """What the press's protocol does once the prompt is prefilled into ``cache`` (module
    docstring); every layer is then decided where it masks. ``scores(press)``: a reconstructing
    press's scores of this prompt, kept by the caller (None: reconstruct them here)."""
    press, model = hooks.press, hooks.model
    kind = protocol(press)
    if kind in RECONSTRUCTS and press.compression_ratio > 0:
        try:
            if scores is None:
                reconstruct(hooks, cache, prompt_ids, tokenizer)
            else:
                press.score_val = scores(press).clone()
            press.compress_post(model)
        finally:
            adapter.reset_internal(press)
    elif kind == MASKS_AFTER:
        press.compress_post(model)
    elif kind == RERUN_CONTEXT:
        with hooks.installed():
            compose(hooks, cache, prompt_ids)
    if kind in MASKS:
        all_decided(hooks.decided, hooks.rows, cache)


def all_decided(decided: dict, rows: list, cache) -> None:
    """Masks set after the hooks ran: every layer is decided (a layer no hook changed as it is)."""
    for layer in range(len(rows)):
        if layer not in decided:
            decided[layer] = untouched(rows[layer], cache.layers[layer].keys, cache.layers[layer].values)


def compose(hooks, cache, prompt_ids) -> None:
    """KVCompose's protocol (``KVComposePress.__call__``): the context runs again over its prefilled
    cache, each layer's hook gathering how the context's queries attend to it (weights by kvscope's
    rule: ``hooks`` reads them), then the press chooses what each layer keeps and compresses the
    cache (structured: the same count for every head of a layer; otherwise masks)."""
    import torch

    from .press_run import read_back

    press, model = hooks.press, hooks.model
    p = len(prompt_ids)
    ids = torch.as_tensor([list(prompt_ids)], device=next(model.parameters()).device)
    adapter.register_model(press, model)
    press.register_context_ids(ids)
    handed = [(layer.keys[:, :, :p].clone(), layer.values[:, :, :p].clone()) for layer in cache.layers]
    hooks.serve(cache, cache)
    try:
        language_model(model)(input_ids=ids, cache=cache)
        adapter.register_cache(press, cache)
        press.prepare_important_masks()
        press.compress_cache(model)
    finally:
        adapter.reset_state(press)
    for layer, (keys, values) in enumerate(handed):
        rows = hooks.rows[layer][:, :p]
        after = cache.layers[layer]
        if after.keys.shape[2] > p:  # unstructured: masks over the context; the repeat is cut off
            after.keys, after.values = after.keys[:, :, :p], after.values[:, :, :p]
        result = read_back(
            rows, before_k=keys, before_v=values, saved_k=keys, saved_v=values, after_k=after.keys,
            after_v=after.values,
        )  # fmt: skip
        hooks.rows[layer] = result.positions
        hooks.decided[layer] = result


def reconstruct(hooks, cache, prompt_ids, tokenizer=None) -> None:
    """KVzip's context reconstruction (``KVzipPress.__call__`` and ``_perform_kvzip_compression``,
    whose hook transformers 5.25 needs adapted): the repeat prompts run over the prefilled
    ``cache``, each layer's hook scores the context into ``press.score_val`` and cuts the repeat
    off. A press with its own scoring hooks (KVgrad: they read nothing 5.25 lacks) runs as it is;
    transformers' note on its ``past_key_values`` (renamed ``cache``) is silenced."""
    import warnings

    import torch

    press, model = hooks.press, hooks.model
    tokenizer = tokenizer or _tokenizer(model)
    prefix_length, suffix_ids = _kvzip_affixes(tokenizer)
    press.prefix_length = prefix_length
    adapter.kvzip_inputs(press, suffix_ids, torch.as_tensor([list(prompt_ids)]), cache)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if protocol(press) == RECONSTRUCT_OWN:
            with hooks.paused():  # its own hooks score (and mask); kvpress's KVzip hook must not run beside them
                adapter.kvgrad_compression(press, model, tokenizer, cache)
            return
        _repeat_forwards(hooks, cache, tokenizer)


def _repeat_forwards(hooks, cache, tokenizer) -> None:
    """The repeat prompts over ``cache``, the hooks scoring each chunk of the context."""
    press, model = hooks.press, hooks.model
    press.context_length = adapter.context_ids(press).shape[1]
    pairs = press.prepare(model, tokenizer)
    press.start_idx = press.prefix_length
    device = next(model.parameters()).device
    hooks.serve(cache, cache)
    for prefill_ids, repeat_ids in pairs:
        press.end_idx = press.start_idx + prefill_ids.shape[1]
        language_model(model)(input_ids=repeat_ids.to(device), cache=cache)
        press.start_idx = press.end_idx


def _kvzip_affixes(tokenizer):
    """``(prefix length, suffix ids)`` of the reconstruction prompt, as ``KVzipPress.__call__``
    derives them from the tokenizer's chat template."""
    if tokenizer.chat_template is None:
        prefix_text, suffix_text = "", "\n"
    else:
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": dummy + separator}], add_generation_prompt=True, tokenize=False,
            enable_thinking=False,
        )  # fmt: skip
        context, suffix_text = text.split(separator)
        prefix_text = context.split(dummy)[0]
    prefix = tokenizer.encode(prefix_text, return_tensors="pt", add_special_tokens=False).shape[-1]
    return prefix, tokenizer.encode(suffix_text, return_tensors="pt", add_special_tokens=False)


def _tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model.config.name_or_path)

