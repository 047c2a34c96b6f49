"""NVIDIA kvpress's own press classes: their arguments from text (``route``, ``build``) and what β
sets on them (``fit_budget``). What kvscope knows of each class (what it reads, its protocol, its
budget knob) is the traits table (``kvscope.policies.press_traits``); a press decides through
the one runner of its hook (``kvscope.policies.press_run``): on the model
(``kvscope.policies.press_hooks``) or, where it reads only q, k, v, on stand-ins of the layers built
from a recording (``kvscope.policies.press_standins``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import typing
from pathlib import Path

import numpy as np

from ..errors import KvscopeError, first_line
from ..params import hint_options, parse_text, split_outside_brackets
from . import press_traits as traits
from .kvpress_load import INSTALL, KVPRESS_VERSION, load, press_base, presses_in, scorer_base

# kvpress_load's, used through this module
__all__ = ["INSTALL", "KVPRESS_VERSION", "load", "presses_in"]

ALIASES = {"base": "base_press"}  # press:DecodingPress:base=KnormPress
SET_BY_BUDGET = ("compression_ratio", "target_size", "key_channel_compression_ratio", "target_compression_ratio")


def press_classes() -> dict[str, type]:
    """Every press class kvpress exports, by name."""
    kvpress = load()
    return {
        name: cls
        for name in kvpress.__all__
        if isinstance(cls := getattr(kvpress, name), type) and issubclass(cls, press_base())
    }


def press_names() -> list[str]:
    """The names kvpress exports that name a press (``…Press``), read from its package's
    ``__all__`` without importing it (torch and transformers cost seconds): for help texts.
    Empty where kvpress is not installed."""
    found = importlib.util.find_spec("kvpress")
    if found is None or found.origin is None:
        return []
    for node in ast.parse(Path(found.origin).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [name for name in ast.literal_eval(node.value) if name.endswith("Press")]
    return []


def press_class(name: str) -> type:
    """kvpress's press ``name`` (``SnapKVPress``), or a press class by dotted path
    (``mypkg.module.MyPress``: a user's own press, importable from where kvscope runs)."""
    if "." in name:
        return _imported_press(name)
    classes = press_classes()
    if name not in classes:
        raise KvscopeError(f"unknown press {name!r} (kvpress has: {', '.join(sorted(classes))})")
    return classes[name]


def press_name(cls: type) -> str:
    """How ``press:…`` names a press class: kvpress's by its name, any other by dotted path."""
    return cls.__name__ if cls.__module__.split(".")[0] == "kvpress" else f"{cls.__module__}.{cls.__qualname__}"


def _imported_press(path: str) -> type:
    module, _, attr = path.rpartition(".")
    base = press_base()
    try:
        cls = getattr(importlib.import_module(module), attr)
    except Exception as error:  # noqa: BLE001 - whatever importing a user's module raises
        raise KvscopeError(f"press {path} cannot be imported ({first_line(error, named=True)})") from None
    if not (isinstance(cls, type) and issubclass(cls, base) and dataclasses.is_dataclass(cls)):
        raise KvscopeError(f"press {path} is not a press class (a dataclass subclassing kvpress.BasePress)")
    return cls


def _hints(cls) -> dict:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: take it as written
        hints = {f.name: f.type for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    if _own_init(cls):
        try:
            hints.update(typing.get_type_hints(cls.__init__))
        except Exception:  # noqa: BLE001
            hints.update({n: p.annotation for n, p in inspect.signature(cls.__init__).parameters.items()})
    return hints


def _own_init(cls) -> bool:
    """The class writes its own ``__init__`` (CriticalKVPress), not the dataclass's."""
    return "__init__" in cls.__dict__ and "__dataclass_fields__" not in cls.__dict__


def _press_types(hint) -> tuple[type, ...]:
    """The press classes a field accepts, itself or as the elements of a list (empty for a plain value)."""
    base = press_base()
    options = [typing.get_args(o)[0] if _is_list(o) else o for o in hint_options(hint)]
    return tuple(o for o in options if isinstance(o, type) and issubclass(o, base))


def _is_list(hint) -> bool:
    return typing.get_origin(hint) in (list, typing.List) and len(typing.get_args(hint)) == 1  # noqa: UP006


def parameters(cls) -> dict[str, tuple[typing.Any, typing.Any]]:
    """``{name: (type, default)}`` of every constructor argument of a press class (its dataclass
    fields, or its own ``__init__``'s parameters); ``dataclasses.MISSING`` where none is given."""
    hints = _hints(cls)
    if _own_init(cls):
        signature = inspect.signature(cls.__init__)
        return {
            name: (hints.get(name, p.annotation), dataclasses.MISSING if p.default is p.empty else p.default)
            for name, p in list(signature.parameters.items())[1:]
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and not name.startswith("_")
        }
    return {
        f.name: (hints.get(f.name, f.type), _default(f))
        for f in dataclasses.fields(cls)
        if f.init and not f.name.startswith("_")  # Compactor's own sub-presses are no arguments
    }


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def fields(cls) -> dict[str, typing.Any]:
    """``{name: type}`` of what ``press:NAME:key=value`` may set: the press's constructor arguments
    and its fields set after construction that it reads (``late_fields``)."""
    return {**{name: hint for name, (hint, _) in parameters(cls).items()}, **late_fields(cls)}


def _settable(cls, free: bool) -> dict[str, typing.Any]:
    """``fields``, with the budget's knobs (init=False ones too) where the budget sets none."""
    out = fields(cls)
    if free and dataclasses.is_dataclass(cls):
        hints = _hints(cls)
        out.update({f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls) if f.name in SET_BY_BUDGET})
    return out


def late_fields(cls) -> dict[str, typing.Any]:
    """``{name: type}`` of the plain fields a press leaves out of its constructor and sets later
    itself or asks its user to set (FinchPress's ``window_size``, which kvpress derives from a
    delimiter token): kvscope sets them after construction."""
    if not dataclasses.is_dataclass(cls):
        return {}
    hints = _hints(cls)
    return {
        f.name: hints.get(f.name, f.type)
        for f in dataclasses.fields(cls)
        if not f.init and not f.name.startswith("_") and f.name not in SET_BY_BUDGET
        and next((o for o in hint_options(hints.get(f.name, f.type)) if o is not type(None)), None) in (bool, int, float, str)
    }  # fmt: skip


def _parse_value(owner: str, key: str, hint, text: str, free: bool = False):
    """A press parameter from its text: a press (a tree), a list ``[a,b,…]`` of either, or a plain value."""
    lists = [o for o in hint_options(hint) if _is_list(o)]
    if lists and text.startswith("[") and text.endswith("]"):
        element = typing.get_args(lists[0])[0]
        items = [t.strip() for t in split_outside_brackets(text[1:-1], ",") if t.strip()]
        return [_parse_value(owner, key, element, item, free=True) for item in items]
    if lists and not _press_types(hint) and not hint_options(hint)[0] in (bool, int, float, str):
        raise KvscopeError(f"press {owner} parameter {key} is a list: write it as [a,b,…]")
    if _press_types(hint):
        name, *pairs = split_outside_brackets(text, ":")
        cls = press_class(name.strip())
        if not issubclass(cls, _press_types(hint)):
            allowed = ", ".join(t.__name__ for t in _press_types(hint))
            raise KvscopeError(f"press {owner} parameter {key} must be a press of kind {allowed} (got {name})")
        return route(press_name(cls), tuple(pair(part) for part in pairs), free=free)
    kind = next((o for o in hint_options(hint) if o is not type(None)), hint)
    if typing.get_origin(kind) is typing.Literal:
        if text not in map(str, typing.get_args(kind)):
            allowed = ", ".join(map(str, typing.get_args(kind)))
            raise KvscopeError(f"press {owner} parameter {key} must be one of {allowed} (got {text!r})")
        return next(v for v in typing.get_args(kind) if str(v) == text)
    if kind is typing.Any or isinstance(kind, typing.TypeVar):
        kind = str
    if kind not in (bool, int, float, str):
        raise KvscopeError(f"press {owner} parameter {key} ({hint}) cannot be given on the command line")
    if text.lower() == "none" and type(None) in hint_options(hint):
        return None
    try:
        return parse_text(kind, text)
    except ValueError:
        raise KvscopeError(f"press {owner} parameter {key} must be {kind.__name__} (got {text!r})") from None


def pair(part: str) -> tuple[str, str]:
    if "=" not in part:
        raise KvscopeError(f"press parameter {part!r} must read key=value")
    key, value = part.split("=", 1)
    return key.strip(), value.strip()


def route(name: str, options: tuple[tuple[str, str], ...], free: bool = False) -> dict:
    """``press`` and ``name=value`` options → a tree ``{"class": cls, "values": {...}}``: each key
    goes to the outermost press that has it (``base`` is kvpress's ``base_press``), a press-typed
    value opens a nested press (``press=SnapKVPress``, or with its own options in brackets
    ``presses=[SnapKVPress:window_size=16,ThinKPress]``), a list is ``[a,b,…]``. What β sets is
    refused as a parameter, except in a list's presses (``free``: the budget sets none of them)."""
    cls = press_class(name)
    tree = {"class": cls, "values": {}}
    nested: list[dict] = []
    for key, text in options:
        key = ALIASES.get(key, key)
        if key == "asset":
            raise KvscopeError("asset= is given once, outermost (press:NAME:asset=FOLDER)")
        owner = next((node for node in [tree, *nested] if key in _settable(node["class"], True)), None)
        if owner is None:
            known = sorted({k for node in [tree, *nested] for k in fields(node["class"])} - set(SET_BY_BUDGET))
            raise KvscopeError(f"press {name} has no parameter {key!r} (has: {', '.join(known) or 'none'})")
        if key in SET_BY_BUDGET and not free:
            raise KvscopeError(f"press parameter {key} is set from the budget β (give --budgets instead)")
        value = _parse_value(owner["class"].__name__, key, _settable(owner["class"], True)[key], text, free=free)
        owner["values"][key] = value
        nested += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, dict)]
    return tree


def build(tree: dict):
    """A fresh press object from a ``route`` tree (nested presses first); kvpress's own
    checks (assertions in ``__post_init__``) become one line."""
    cls = tree["class"]

    def made(value):
        if isinstance(value, dict):
            return build(value)
        return [made(v) for v in value] if isinstance(value, list) else value

    late = late_fields(cls)
    values = {k: made(v) for k, v in tree["values"].items() if k not in late}
    asserted = traits.traits_of(cls).asserted
    if asserted and asserted.name not in tree["values"]:
        raise KvscopeError(f"press {cls.__name__} needs {asserted.name}=N: {asserted.what}")
    for key, (hint, default) in parameters(cls).items():  # a press that needs a press and got none
        none_allowed = type(None) in hint_options(hint)
        if (
            key not in values
            and _press_types(hint)
            and (default is dataclasses.MISSING or (default is None and not none_allowed))
        ):
            example = f"[{_example(hint)},…]" if any(_is_list(o) for o in hint_options(hint)) else _example(hint)
            raise KvscopeError(f"press {cls.__name__} needs {key}=<press> (e.g. {key}={example})")
        if key not in values and default is dataclasses.MISSING:
            raise KvscopeError(f"press {cls.__name__} needs {key}=… ({_spelled_hint(hint)})")
    try:
        press = cls(**values)
    except Exception as error:  # noqa: BLE001 - kvpress's own checks (assertions in __post_init__)
        raise KvscopeError(f"press {cls.__name__}: {first_line(error)}") from None
    for key in late.keys() & tree["values"].keys():
        setattr(press, key, tree["values"][key])
    return press


def _example(hint) -> str:
    kinds = _press_types(hint)
    scorer = scorer_base()
    return traits.EXAMPLE if any(issubclass(scorer, k) or k is scorer for k in kinds) else kinds[0].__name__


def _spelled_hint(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def catalog() -> dict[str, dict]:
    """Every press class kvpress exports: its parameters (read from the class) and what β sets."""
    out = {}
    for name, cls in sorted(press_classes().items()):
        rows = [
            {"name": key, "type": _spelled_hint(hint), "default": None if default is dataclasses.MISSING else repr(default),
             "required": default is dataclasses.MISSING}
            for key, (hint, default) in parameters(cls).items()
        ] + [{"name": key, "type": _spelled_hint(hint), "default": None, "required": _asserted(cls) == key, "after": True}
             for key, hint in late_fields(cls).items()]  # fmt: skip
        out[name] = {"parameters": rows, "budget sets": budget_knob(cls)}
    return out


def _asserted(cls) -> str | None:
    asserted = traits.traits_of(cls).asserted
    return asserted.name if asserted else None


def budget_knob(cls) -> str:
    """What β sets on a press of class ``cls`` (``fit_budget``)."""
    row = traits.traits_of(cls)
    if row.given is not None:
        return f"nothing ({row.given.what}): give {row.given.knob}"
    return traits.KNOBS[row.budget]


# -- what β sets ---------------------------------------------------------------------------------------
def fit_budget(press, cache_spec, model_spec) -> tuple[bool, dict]:
    """Set ``press``'s knob from the budget so that the cache after the last step holds ``≤ B``
    (``kvscope.policies.press``); ``(reached, {setting: value})``. ``cache_spec``: the
    ``CacheSpec``, ``model_spec``: the ``ModelSpec``. What the knob is, is the press's ``budget``
    in the traits table. A press whose compression no ratio sets (a threshold, a list of ratios, a
    chain of presses) runs as its parameters say, reported as not set by β; with none given it is
    refused."""
    fit = _FITS.get(traits.traits(press).budget, _fit_ratio)
    return fit(press, cache_spec, model_spec)


def _fit_decoding(press, cache_spec, model_spec) -> tuple[bool, dict]:
    """DecodingPress: ``target_size`` (or, keeping (1 − r) of what it has seen, its
    ``target_compression_ratio``) so that the cache fits after ``compression_interval − 1`` more rows."""
    cap, p, s = cache_spec.fp_capacity_tokens, cache_spec.prompt_len, cache_spec.decode_steps
    interval = press.compression_interval
    reached = cap - interval + 1 >= 1 and p + interval - 1 <= cap
    if traits.traits(press).budget == traits.TARGET_RATIO:
        ratio = min(max(1 - (cap - interval + 1) / (p + s), 0.0), 1 - 1e-9)
        press.target_compression_ratio = ratio
        return reached, {"target_compression_ratio": ratio}
    press.target_size = max(1, cap - interval + 1)
    return reached, {"target_size": press.target_size}


def _fit_given(press, cache_spec, model_spec) -> tuple[bool, dict]:
    """A press no ratio sets runs as its own knob says (refused where the knob compresses nothing)."""
    given = traits.traits(press).given
    if getattr(press, given.knob) == given.default:
        name = type(press).__name__
        raise KvscopeError(f"press {name} has no ratio a budget can set ({given.what}): give {given.knob}=…")
    return False, {"set by": given.knob}


def _fit_ratio(press, cache_spec, model_spec) -> tuple[bool, dict]:
    """``compression_ratio`` keeping ``n = ⌊B / FP_bytes⌋ − S`` prompt tokens per (layer, kv_head),
    or pruning ``L·H·(P − n)`` over every layer and head where the press counts globally."""
    cap, p, s = cache_spec.fp_capacity_tokens, cache_spec.prompt_len, cache_spec.decode_steps
    n = cap - s
    reached = n >= 1
    n = max(n, 1)
    if n >= p:
        ratio = 0.0
    elif traits.traits(press).budget == traits.GLOBAL_COUNT:
        units = cache_spec.n_layers * cache_spec.n_kv  # kvpress prunes ⌊units·P·r⌋ across every layer and head
        ratio = (units * (p - n) + 0.5) / (units * p)
    else:
        ratio = _ratio_for(press, model_spec, n, p)
    try:
        press.compression_ratio = ratio
    except Exception as error:  # noqa: BLE001 - a property that refuses to be set
        raise KvscopeError(
            f"press {type(press).__name__} takes no compression ratio a budget could set ({first_line(error)})"
        ) from None
    return reached, {"compression_ratio": ratio}


def _fit_prefill_decoding(press, cache_spec, model_spec) -> tuple[bool, dict]:
    """PrefillDecodingPress: the decoding press as DecodingPress (its target), and the prefilling
    press keeps at most that target of the prompt (the cache grows by ``compression_interval − 1``
    between compressions either way)."""
    decoding, prefilling = press.decoding_press, press.prefilling_press
    if decoding is None:
        return fit_budget(prefilling, cache_spec, model_spec) if prefilling is not None else (False, {})
    reached, setting = fit_budget(decoding, cache_spec, model_spec)
    if prefilling is not None:
        room = cache_spec.fp_capacity_tokens - decoding.compression_interval + 1
        n, p = max(1, room), cache_spec.prompt_len
        prefilling.compression_ratio = 0.0 if n >= p else _ratio_for(prefilling, model_spec, n, p)
        setting["prefilling compression_ratio"] = prefilling.compression_ratio
        reached = reached or room >= 1
    return reached, setting


def _fit_channels(press, cache_spec, model_spec) -> tuple[bool, dict]:
    """ThinK prunes ``m`` of the ``D`` key channels of every prompt position: a prompt token then
    costs ``(2D − m)/(2D)`` of a full one; ``m`` is the fewest that fit."""
    d = model_spec.head_dim
    p, s = cache_spec.prompt_len, cache_spec.decode_steps
    room = np.min(np.asarray(cache_spec.capacity)) / cache_spec.fp_bytes  # tokens of full size one unit may hold
    needed = int(np.ceil(max(0.0, (p + s - room) * 2 * d / p) - 1e-9)) if p else 0
    m = min(needed, d)
    press.key_channel_compression_ratio = (m + 0.5) / d if m else 0.0
    return needed <= d, {"key_channel_compression_ratio": press.key_channel_compression_ratio, "channels": m}


_FITS = {  # the traits table's budget → how β sets it (else a compression ratio)
    traits.PREFILL_DECODING: _fit_prefill_decoding,
    traits.TARGET_SIZE: _fit_decoding,
    traits.TARGET_RATIO: _fit_decoding,
    traits.CHANNELS: _fit_channels,
    traits.AS_GIVEN_KNOB: _fit_given,
}


def _ratio_for(press, model_spec, n: int, p: int) -> float:
    """The ratio that keeps ``n`` of ``p`` prompt tokens per (layer, kv_head) — for a press with
    per-layer budgets (PyramidKV) the smallest whose budgets sum to at most ``L·n`` (bisection)."""
    from kvpress.utils import compute_n_kept

    if traits.traits(press).budget != traits.LAYER_RATIO:
        ratio = 1.0 - (n + 0.5) / p
        if compute_n_kept(p, ratio) != n:  # pragma: no cover - float rounding guard
            raise KvscopeError(f"no compression ratio keeps exactly {n} of {p} tokens")
        return ratio
    from .press_standins import LayerStandIn, config_of

    config = config_of(model_spec, False)
    modules = [LayerStandIn(config, layer, model_spec.head_dim, None) for layer in range(model_spec.n_layers)]

    def kept(ratio: float) -> int:
        press.compression_ratio = ratio
        return sum(press.get_layer_budget(m, p) for m in modules)

    low, high = 0.0, 1.0 - 0.5 / p
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if kept(mid) > n * len(modules) else (low, mid)
    return high
