"""The one place kvscope touches kvpress's private attributes and methods, written for kvpress
``KVPRESS_VERSION`` (0.5.5): what its ``__call__`` protocols set on a press before and after a
prefill, where its attention leaves a layer's masks, and where its presses keep a learned asset.
A new kvpress version is checked here first; the rest of kvscope reads presses through their
public fields and ``kvscope.policies.press_traits``.

    masks        ``module.masked_key_indices`` (AdaKV, KVzip, DMS, …: kvpress's attention reads
                 them; masked rows count as evicted)
    registering  ``_register_model``, ``_register_cache``, ``_reset_state`` (KVCompose),
                 ``_reset_internal_parameters`` (KVzip and kin)
    KVzip        ``_suffix_ids``, ``_context_ids``, ``_cache`` (its reconstruction's inputs) and
                 KVgrad's ``_perform_kvzip_compression`` over ``ReadOnlyDynamicLayer``s
    assets       QFilter's ``q_filters``, KVzap's ``kvzap_model``, DuoAttention's module cache
"""

from __future__ import annotations

KVPRESS_VERSION = "0.5.5"  # the kvpress this adapter (and kvscope's press traits table) was written for
MASKS = "masked_key_indices"  # the attribute kvpress's attention reads on a module


# -- the base classes ------------------------------------------------------------------------------
def press_base(kvpress) -> type:
    """What every press class of the ``kvpress`` module subclasses (``BasePress``)."""
    return kvpress.BasePress


def scorer_base(kvpress) -> type:
    """The presses that keep the prompt positions of highest score (``ScorerPress``)."""
    return kvpress.ScorerPress


# -- a layer's masks ---------------------------------------------------------------------------
def masks(module):
    """``(batch, kv_head, row)`` index tensors of the rows the press masked in ``module``'s layer, or None."""
    return module.__dict__.get(MASKS)


def clear_masks(module) -> None:
    """No row masked (as kvpress's attention leaves it at every prefill)."""
    module.__dict__[MASKS] = None


# -- the protocols' private state ----------------------------------------------------------------
def register_model(press, model) -> None:
    """What KVCompose's ``__call__`` registers before the prefill."""
    press._register_model(model)


def register_cache(press, cache) -> None:
    press._register_cache(cache)


def reset_state(press) -> None:
    """KVCompose's state dropped after its protocol."""
    press._reset_state()


def reset_internal(press) -> None:
    """KVzip's (and kin's) scores and indices dropped after its protocol."""
    press._reset_internal_parameters()


def kvzip_inputs(press, suffix_ids, context_ids, cache) -> None:
    """The reconstruction's inputs, as ``KVzipPress.__call__`` sets them."""
    press._suffix_ids, press._context_ids, press._cache = suffix_ids, context_ids, cache


def context_ids(press):
    return press._context_ids


def kvgrad_compression(press, model, tokenizer, cache) -> None:
    """KVgrad's own scoring forwards over ``cache`` (its read-only layers adapted to transformers
    5.25's keyword ``kwargs``)."""
    press._cache = _read_only_adapting(cache)
    press._perform_kvzip_compression(model, tokenizer)


def _read_only_adapting(cache):
    """``cache``'s layers in a DynamicCache whose read-only layers (KVgrad's ``read_only_cache``
    puts them in place) take the ``kwargs`` transformers 5.25 hands every layer update."""
    from kvpress.presses.kvgrad_press import ReadOnlyDynamicLayer
    from transformers import DynamicCache

    class Adapting(DynamicCache):
        def __setattr__(self, name, value):
            if name == "layers":
                for layer in value:
                    if isinstance(layer, ReadOnlyDynamicLayer) and "update" not in vars(layer):
                        layer.update = _without_kwargs(layer.update)
            super().__setattr__(name, value)

    adapted = Adapting.__new__(Adapting)
    adapted.__dict__.update(cache.__dict__)
    return adapted


def _without_kwargs(update):
    def adapted(key_states, value_states, *args, kwargs=None, **rest):
        return update(key_states, value_states, *args, **rest)

    return adapted


# -- where presses keep their assets --------------------------------------------------------------
def install_qfilters(press, folder: str, dtype):
    """QFilterPress's filters from a local ``QFilters.save_pretrained`` folder, in its place (its own
    ``post_init_from_model`` would fetch them again); returns them."""
    from kvpress.presses.qfilter_press import QFilters

    filters = QFilters.from_pretrained(folder).q_filters.detach().to(dtype)
    press.q_filters = filters
    press.post_init_from_model = _loaded  # this object's own
    return filters


def _loaded(model) -> None:
    """The press's asset is in place already."""


def install_kvzap(press, folder: str, name: str) -> None:
    """KVzapPress's surrogate model from a local ``KVzapModel.save_pretrained`` folder."""
    from kvpress.presses.kvzap_press import KVzapModel

    press.kvzap_model = KVzapModel.from_pretrained(folder)
    press.kvzap_model_name = name


def install_duo_pattern(model, sink_size: int, recent_size: int, scores) -> None:
    """DuoAttentionPress's head pattern for ``model``: kvpress caches it by the model's name, so its
    own ``post_init_from_model`` reads this one."""
    from kvpress.presses import duo_attention_press

    duo_attention_press.cache[model.config.name_or_path] = (sink_size, recent_size, scores)


def forget_duo_pattern(model) -> None:
    from kvpress.presses import duo_attention_press

    duo_attention_press.cache.pop(model.config.name_or_path, None)
