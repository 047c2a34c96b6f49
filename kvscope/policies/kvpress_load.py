"""kvpress imported once, transformers' attention functions left as they were (kvpress patches
them on import), and the presses nested in a press. The lowest of the press modules: the bridge
(``kvscope.policies.kvpress_bridge``), the hooks on the model
(``kvscope.policies.press_hooks``) and the assets (``kvscope.policies.press_assets``) read
kvpress through it."""

from __future__ import annotations

import functools
import logging

from ..errors import KvscopeError
from . import kvpress_adapter as adapter
from .kvpress_adapter import KVPRESS_VERSION

INSTALL = (
    f"pip install 'kvscope[presses]' && pip install --no-deps kvpress=={KVPRESS_VERSION} peft (make setup does both)"
)


@functools.cache
def load():
    """The ``kvpress`` module, imported once; transformers' attention functions unchanged."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError as error:  # pragma: no cover - transformers is a dependency
        raise KvscopeError(f"press policies need transformers ({error})") from None
    saved = dict(ALL_ATTENTION_FUNCTIONS._local_mapping), dict(type(ALL_ATTENTION_FUNCTIONS)._global_mapping)
    try:
        import kvpress

        logging.getLogger("kvpress").setLevel(logging.ERROR)  # its notes to users of its pipeline, not kvscope's
    except ImportError as error:
        raise KvscopeError(f"press policies need kvpress ({error}); install it: {INSTALL}") from None
    except Exception as error:  # noqa: BLE001 - kvpress fails to import on this transformers
        raise KvscopeError(f"kvpress cannot be imported here ({type(error).__name__}: {error})") from None
    finally:
        ALL_ATTENTION_FUNCTIONS._local_mapping.clear()
        ALL_ATTENTION_FUNCTIONS._local_mapping.update(saved[0])
        type(ALL_ATTENTION_FUNCTIONS)._global_mapping.clear()
        type(ALL_ATTENTION_FUNCTIONS)._global_mapping.update(saved[1])
    return kvpress


def presses_in(press) -> list:
    """``press`` and every press nested in it (attributes, lists of presses)."""
    base = press_base()
    out = [press]
    for value in vars(press).values():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, base) and item is not press:
                out += presses_in(item)
    return out


def press_base() -> type:
    """What every press class subclasses (kvpress's ``BasePress``)."""
    return adapter.press_base(load())


def scorer_base() -> type:
    """The presses that keep the positions of highest score (kvpress's ``ScorerPress``)."""
    return adapter.scorer_base(load())
