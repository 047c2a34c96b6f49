"""NVIDIA kvpress's own press classes: their arguments from text, what β sets on them, and the
presses that read only q, k, v driven on stand-ins of the attention layers built from a recording.

A press is written against a transformers attention layer: after the layer's prefill forward,
``press.forward_hook(module, input, kwargs, output)`` reads the layer's cache and hidden
states and writes back the keys and values it keeps. Offline, a press that reads only q, k, v
gets a stand-in per layer that carries what presses read, built from a trace recorded with
``--record qkv``:

    module          config (heads, KV heads, layers), layer_idx, head_dim, rotary_emb
                    (cos, sin from the recorded inv_freq and attention scaling), q_proj = identity
    hidden_states   the layer's pre-RoPE queries ``[1, n, H·D]`` (recorded q with RoPE undone):
                    what ``q_proj(hidden_states)`` gives a press is exactly the model's queries
    cache           ``cache.layers[l].keys/values [1, Hkv, n, D]``: the recorded post-RoPE K/V
                    of the positions the press kept so far
    output[1]       attention ``[1, H, P, P]`` by kvscope's attention rule, for the presses that
                    read the layer's attention weights (ObservedAttention); None otherwise, as
                    under sdpa

What a press did is read back as on the model (``kvscope.policies.press_hooks.read_back``): the
positions it keeps (its ``gather``, its masks), what it rewrote. A press that reads what the
stand-ins do not hold (a projection's weights, the model itself) raises ``NeedsModel``: offline it
runs on the trace's own model, live every press runs on the model
(``kvscope.policies.press_hooks``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import typing
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ..errors import KvscopeError, first_line
from ..params import hint_options, parse_text, split_outside_brackets
from .kvpress_load import INSTALL, KVPRESS_VERSION, load, presses_in

__all__ = ["INSTALL", "KVPRESS_VERSION", "load", "presses_in"]  # kvpress_load's, used through this module

NEEDS_ATTENTIONS = ("ObservedAttentionPress", "KVComposePress")  # presses that read the layer's attention weights
ALIASES = {"base": "base_press"}  # press:DecodingPress:base=KnormPress
SET_BY_BUDGET = ("compression_ratio", "target_size", "key_channel_compression_ratio", "target_compression_ratio")


def press_classes() -> dict[str, type]:
    """Every press class kvpress exports, by name."""
    kvpress = load()
    return {
        name: cls
        for name in kvpress.__all__
        if isinstance(cls := getattr(kvpress, name), type) and issubclass(cls, kvpress.BasePress)
    }


def press_names() -> list[str]:
    """The names kvpress exports that name a press (``…Press``), read from its package's
    ``__all__`` without importing it (torch and transformers cost seconds): for help texts.
    Empty where kvpress is not installed."""
    spec = importlib.util.find_spec("kvpress")
    if spec is None or spec.origin is None:
        return []
    for node in ast.parse(Path(spec.origin).read_text()).body:
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
    base = load().BasePress
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
    base = load().BasePress
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


ASSERTED = {  # a late field a press asserts is set, and what it is
    "FinchPress": (
        "window_size",
        "the question's tokens at the end of the prompt, which kvpress finds by a delimiter token",
    ),
}


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
        value = _parse_value(owner["class"].__name__, key, _settable(owner["class"], True)[key], text, free)
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
    asserted = ASSERTED.get(cls.__name__)
    if asserted and asserted[0] not in tree["values"]:
        raise KvscopeError(f"press {cls.__name__} needs {asserted[0]}=N: {asserted[1]}")
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
    scorer = load().ScorerPress
    return "KnormPress" if any(issubclass(scorer, k) or k is scorer for k in kinds) else kinds[0].__name__


def _spelled_hint(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


class LayerStandIn:
    """What a press reads of one attention layer (see the module docstring); reading anything
    else raises an ``AttributeError`` that names it."""

    def __init__(self, config, layer_idx: int, head_dim: int, rotary):
        import torch

        self.config, self.layer_idx, self.head_dim = config, layer_idx, head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.q_proj = torch.nn.Identity()  # hidden states are the queries already
        self.rotary_emb = rotary
        self.is_sliding = False
        self.training = False
        self.masked_key_indices = None  # as kvpress's attention sets it at every prefill (DMS reads it)
        self.missing: list[str] = []

    def __getattr__(self, name: str):
        if not name.startswith("__"):
            self.__dict__.setdefault("missing", []).append(name)
        raise AttributeError(f"the recorded layer has no {name!r}")


def config_of(model, attentions: bool) -> SimpleNamespace:
    """The model config a press reads (sizes only; ``_attn_implementation`` says whether the
    layer's attention weights are given, as eager does)."""
    return SimpleNamespace(
        num_attention_heads=model.n_heads,
        num_key_value_heads=model.n_kv_heads,
        num_hidden_layers=model.n_layers,
        head_dim=model.head_dim,
        hidden_size=model.n_heads * model.head_dim,
        _attn_implementation="eager" if attentions else "sdpa",
    )


class Rotary:
    """``rotary_emb(x, position_ids) → (cos, sin) [batch, n, D]`` of one layer, from the
    recorded rotary parameters (identity where the model has none)."""

    def __init__(self, rope, layer: int, head_dim: int):
        import torch

        self.rope, self.layer, self.head_dim = rope, layer, head_dim
        # what transformers' rotary modules carry (KeyRerotationPress reads them)
        self.inv_freq = torch.from_numpy(rope.inv_freq[layer].astype(np.float32)) if rope is not None else None
        self.attention_scaling = float(rope.scaling[layer]) if rope is not None else 1.0

    def numpy(self, positions):
        """``cos, sin [n, D]`` float32 of ``positions [n]``."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.rope is None:
            return np.ones((len(positions), self.head_dim), np.float32), np.zeros(
                (len(positions), self.head_dim), np.float32
            )
        cos, sin = self.rope.tables(int(positions.max()) + 1 if positions.size else 1, self.head_dim)
        return cos[self.layer, positions], sin[self.layer, positions]

    def __call__(self, x, position_ids):
        import torch

        cos, sin = self.numpy(position_ids.reshape(-1).cpu().numpy())
        shape = (*position_ids.shape, self.head_dim)
        return torch.from_numpy(cos).to(x.dtype).reshape(shape), torch.from_numpy(sin).to(x.dtype).reshape(shape)


class NeedsModel(KvscopeError):
    """A press that reads more of the layer than recorded q, k and v (a projection's weights, the
    model itself): offline it runs on the trace's own model (``kvscope.policies.press_hooks``)."""


class PressRunner:
    """One sequence's press on stand-ins of the attention layers, built from recorded tensors:
    the stand-in caches and which positions they hold:

        prefill(keys, values, queries)      keys, values [layer, kv_head, P, D] float32 tensors,
                                            queries [P, layer, head, D] post-RoPE
        append(position, keys, values)      [layer, kv_head, D]: the decode position enters
        decode(position, queries)           [layer, head, D]: the press's decode hook

    ``rope`` the model's rotary parameters; ``model`` its ``ModelSpec``.
    A press that reads what the stand-ins do not hold raises ``NeedsModel``. What the press
    did besides dropping positions is kept: ``rewrites`` (``keys``, ``values``) and ``pruned``
    ``[layer, kv_head]`` key channels zeroed (ThinK)."""

    def __init__(self, press, spec, rope, model):
        import torch

        from .press_hooks import decodes

        self.press, self.spec, self.model = press, spec, model
        self.label = type(press).__name__
        self.attentions = any(type(p).__name__ in NEEDS_ATTENTIONS for p in presses_in(press))
        self.decodes = decodes(press)
        config = config_of(model, self.attentions)
        rope = rope if rope is not None and rope.usable() else None
        self.n_rot = rope.n_rot if rope is not None else 0
        self.rope = rope
        self.modules = [
            LayerStandIn(config, layer, model.head_dim, Rotary(rope, layer, model.head_dim))
            for layer in range(model.n_layers)
        ]
        self.cache = SimpleNamespace(layers=[SimpleNamespace(keys=None, values=None) for _ in self.modules])
        self.positions: list = [None] * model.n_layers  # per layer [kv_head, n] positions in the cache
        self.rewrites: set[str] = set()
        self.pruned = np.zeros((model.n_layers, model.n_kv_heads), dtype=np.int64)
        try:
            press.post_init_from_model(SimpleNamespace(config=config, device=torch.device("cpu")))
        except Exception as error:  # noqa: BLE001 - a press that needs the model itself
            raise NeedsModel(
                f"press {self.label} needs the model itself to be set up ({first_line(error, named=True)})"
            ) from None

    def scratch_bytes(self) -> int:
        """Bytes of the stand-in caches the press works on (held between forwards only by
        presses that decode)."""
        return sum(int(t.nbytes) for layer in self.cache.layers for t in (layer.keys, layer.values) if t is not None)

    # -- driving ----------------------------------------------------------------------------
    def _queries(self, layer: int, queries, positions):
        """Pre-RoPE queries ``[1, n, H·D]`` (the layer's hidden states, as ``q_proj`` = identity
        reads them) from its post-RoPE ``queries [n, H, D]`` at ``positions [n]``."""
        import torch

        from ..model.rope import undo_rope

        q = np.asarray(queries, dtype=np.float32)  # [n, H, D]
        if self.rope is not None:
            cos, sin = self.modules[layer].rotary_emb.numpy(positions)
            q = undo_rope(q, cos[:, None], sin[:, None], self.n_rot, float(self.rope.scaling[layer]))
        return torch.from_numpy(np.ascontiguousarray(q, dtype=np.float32)).reshape(1, len(positions), -1)

    def _attentions(self, layer: int, queries, keys):
        """``[1, H, P, P]`` prefill attention of ``layer`` by kvscope's rule from its
        ``queries [P, H, D]`` and ``keys [kv_head, P, D]``."""
        import torch

        from ..model.attention import grouped

        h, n_kv = self.model.n_heads, self.model.n_kv_heads
        p = keys.shape[1]
        query = torch.from_numpy(np.asarray(queries, dtype=np.float32)).transpose(0, 1)  # [H, P, D]
        rows = grouped(query, n_kv)  # [Hkv, group·P, D]
        q_pos = torch.arange(p).repeat(h // n_kv)[:, None]
        probs = self.model.rule(layer).probs(rows, keys, q_pos, torch.arange(p))
        return probs.reshape(1, h, p, p)

    def prefill(self, keys, values, queries) -> np.ndarray:
        """The prompt ``0..P−1`` in every layer (``keys, values [layer, kv_head, P, D]`` float32
        tensors, ``queries [P, layer, head, D]``), compressed by the press → present
        ``[layer, kv_head, P]``."""
        import torch

        p = keys.shape[2]
        present = np.zeros((len(self.modules), self.spec.n_kv, p), dtype=bool)
        for layer, module in enumerate(self.modules):
            cache = self.cache.layers[layer]
            cache.keys = keys[layer][None].clone()  # [1, Hkv, P, D]
            cache.values = values[layer][None].clone()
            self.positions[layer] = torch.arange(p).repeat(self.spec.n_kv, 1)
            q = queries[:, layer]  # [P, H, D]
            attentions = self._attentions(layer, q, keys[layer]) if self.attentions else None
            self._hook(module, self._queries(layer, q, np.arange(p)), torch.arange(p), attentions)
            present[layer] = self._present(layer, p)
            if not self.decodes:  # a prompt press never reads this cache again
                cache.keys = cache.values = None
        return present

    def append(self, position: int, keys, values) -> None:
        """Decode position ``position`` enters every layer's cache (``keys, values
        [layer, kv_head, D]`` float32 tensors)."""
        import torch

        for layer, cache in enumerate(self.cache.layers):
            cache.keys = torch.cat([cache.keys, keys[layer][None, :, None]], dim=2)
            cache.values = torch.cat([cache.values, values[layer][None, :, None]], dim=2)
            self.positions[layer] = torch.cat(
                [self.positions[layer], torch.full((self.spec.n_kv, 1), position, dtype=torch.long)], dim=1
            )

    def decode(self, position: int, queries) -> np.ndarray:
        """The decode step of the query at ``position`` (``queries [layer, head, D]``) → present
        ``[layer, kv_head, position + 1]``."""
        import torch

        length = position + 1
        present = np.zeros((len(self.modules), self.spec.n_kv, length), dtype=bool)
        for layer, module in enumerate(self.modules):
            hidden = self._queries(layer, queries[layer][None], np.array([position]))
            self._hook(module, hidden, torch.tensor([position]), None)
            present[layer] = self._present(layer, length)
        return present

    def _hook(self, module, hidden, cache_position, attentions) -> None:
        """kvpress's forward hook of one layer; what it kept is read back
        (``read_back``)."""
        from .press_hooks import GatherRecorder, _same, read_back

        layer = module.layer_idx
        cache = self.cache.layers[layer]
        before_k, before_v = cache.keys, cache.values
        saved_k, saved_v = before_k.clone(), before_v.clone()
        kwargs = {
            "hidden_states": hidden,
            "past_key_values": self.cache,
            "cache_position": cache_position,
            "position_embeddings": module.rotary_emb(hidden, cache_position[None]),
            "position_ids": cache_position[None],
            "attention_mask": None,
        }
        try:
            with GatherRecorder(before_k) as recorder:
                self.press.forward_hook(module, [], kwargs, (None, attentions))
        except KvscopeError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever a press raises on a stand-in becomes one line
            missing = module.__dict__.get("missing")
            if missing:
                raise NeedsModel(f"press {self.label} reads {missing[-1]!r} of the attention layer") from None
            if isinstance(error, AssertionError):  # kvpress's own checks say what is wrong
                raise KvscopeError(
                    f"press {self.label} failed on layer {layer} ({first_line(error, named=True)})"
                ) from None
            raise NeedsModel(
                f"press {self.label} cannot run on recorded q, k, v ({first_line(error, named=True)})"
            ) from None
        after_k, after_v = cache.keys, cache.values
        if after_k is before_k and after_v is before_v and _same(after_k, saved_k) and _same(after_v, saved_v):
            return
        result = read_back(
            self.positions[layer], before_k, before_v, saved_k, saved_v, after_k, after_v, recorder.index
        )
        self.positions[layer] = result.positions
        self.rewrites |= {
            name for name, done in (("keys", result.rewrote_keys), ("values", result.rewrote_values)) if done
        }
        self.pruned[layer] = result.channel_counts()

    def _present(self, layer: int, length: int) -> np.ndarray:
        """``[kv_head, length]`` positions in the layer's cache and not masked (AdaKV)."""
        positions = self.positions[layer].numpy()  # [kv_head, n]
        present = np.zeros((positions.shape[0], length), dtype=bool)
        np.put_along_axis(present, positions, True, axis=1)
        masked = self.modules[layer].__dict__.get("masked_key_indices")  # set by AdaKV
        if masked is not None:
            _, heads, slots = (t.numpy() for t in masked)
            present[heads, positions[heads, slots]] = False
        return present


def catalog() -> dict[str, dict]:
    """Every press class kvpress exports: its parameters (read from the class) and what β sets."""
    out = {}
    for name, cls in sorted(press_classes().items()):
        rows = [
            {"name": key, "type": _spelled_hint(hint), "default": None if default is dataclasses.MISSING else repr(default),
             "required": default is dataclasses.MISSING}
            for key, (hint, default) in parameters(cls).items()
        ] + [{"name": key, "type": _spelled_hint(hint), "default": None, "required": ASSERTED.get(name, ("",))[0] == key, "after": True}
             for key, hint in late_fields(cls).items()]  # fmt: skip
        out[name] = {"parameters": rows, "budget sets": budget_knob(cls)}
    return out


def budget_knob(cls) -> str:
    """What β sets on a press of class ``cls`` (``fit_budget``)."""
    kvpress = load()
    if issubclass(cls, kvpress.PrefillDecodingPress):
        return "decoding_press target_size, prefilling_press compression_ratio"
    if issubclass(cls, kvpress.CompressionRatioDecodingPress):
        return "target_compression_ratio"
    if issubclass(cls, kvpress.DecodingPress):
        return "target_size"
    if issubclass(cls, kvpress.ThinKPress):
        return "key_channel_compression_ratio"
    if cls.__name__ in AS_GIVEN:
        knob, _, what = AS_GIVEN[cls.__name__]
        return f"nothing ({what}): give {knob}"
    return "compression_ratio"


# -- what β sets ---------------------------------------------------------------------------------------
def fit_budget(press, spec, model) -> tuple[bool, dict]:
    """Set ``press``'s knob from the budget so that the cache after the last step holds ``≤ B``
    (``kvscope.policies.press``); ``(reached, {setting: value})``. ``spec``: the
    ``CacheSpec``, ``model``: the ``ModelSpec``.
    A press whose compression no ratio sets (a threshold, a list of ratios, a chain of presses) runs
    as its parameters say, reported as not set by β; with none given it is refused."""
    kvpress = load()
    cap, p, s = spec.fp_capacity_tokens, spec.prompt_len, spec.decode_steps
    name = type(press).__name__
    if isinstance(press, kvpress.PrefillDecodingPress):
        return _fit_prefill_decoding(press, spec, model)
    if isinstance(press, kvpress.DecodingPress):
        interval = press.compression_interval
        reached = cap - interval + 1 >= 1 and p + interval - 1 <= cap
        if isinstance(press, kvpress.CompressionRatioDecodingPress):  # keeps (1 − r) of what it has seen
            ratio = min(max(1 - (cap - interval + 1) / (p + s), 0.0), 1 - 1e-9)
            press.target_compression_ratio = ratio
            return reached, {"target_compression_ratio": ratio}
        press.target_size = max(1, cap - interval + 1)
        return reached, {"target_size": press.target_size}
    if isinstance(press, kvpress.ThinKPress):
        return _fit_channels(press, spec, model)
    given = AS_GIVEN.get(name)
    if given is not None:
        knob, default, what = given
        if getattr(press, knob) == default:
            raise KvscopeError(f"press {name} has no ratio a budget can set ({what}): give {knob}=…")
        return False, {"set by": knob}
    n = cap - s
    reached = n >= 1
    n = max(n, 1)
    if n >= p:
        ratio = 0.0
    elif isinstance(press, GLOBAL_COUNT):
        units = spec.n_layers * spec.n_kv  # kvpress prunes ⌊units·P·r⌋ across every layer and head
        ratio = (units * (p - n) + 0.5) / (units * p)
    else:
        ratio = _ratio_for(press, model, n, p)
    try:
        press.compression_ratio = ratio
    except Exception as error:  # noqa: BLE001 - a property that refuses to be set
        raise KvscopeError(
            f"press {name} takes no compression ratio a budget could set ({first_line(error)})"
        ) from None
    return reached, {"compression_ratio": ratio}


AS_GIVEN = {  # press → (its own knob, the default that compresses nothing, what decides instead of a ratio)
    "DMSPress": ("threshold", None, "it evicts by a score threshold"),
    "SimLayerKVPress": ("lazy_threshold", 1.0, "it keeps whole layers or their ends by a threshold"),
    "DuoAttentionPress": ("head_compression_ratio", 0.0, "it turns a share of heads into streaming heads"),
    "PerLayerCompressionPress": ("compression_ratios", None, "each layer's ratio is given"),
    "ComposedPress": ("presses", None, "its presses compress one after the other"),
}


def _global_count() -> tuple:
    kvpress = load()
    return (kvpress.KVzipPress, kvpress.FastKVzipPress, kvpress.KVComposePress)


class _GlobalCount:
    """isinstance() target: presses that prune ⌊numel · r⌋ positions over every layer and head."""

    def __instancecheck__(self, obj) -> bool:
        return isinstance(obj, _global_count())


GLOBAL_COUNT = _GlobalCount()


def _fit_prefill_decoding(press, spec, model) -> tuple[bool, dict]:
    """PrefillDecodingPress: the decoding press as DecodingPress (its target), and the prefilling
    press keeps at most that target of the prompt (the cache grows by ``compression_interval − 1``
    between compressions either way)."""
    decoding, prefilling = press.decoding_press, press.prefilling_press
    if decoding is None:
        return fit_budget(prefilling, spec, model) if prefilling is not None else (False, {})
    reached, setting = fit_budget(decoding, spec, model)
    if prefilling is not None:
        n, p = max(1, spec.fp_capacity_tokens - decoding.compression_interval + 1), spec.prompt_len
        prefilling.compression_ratio = 0.0 if n >= p else _ratio_for(prefilling, model, n, p)
        setting["prefilling compression_ratio"] = prefilling.compression_ratio
        reached = reached or spec.fp_capacity_tokens - decoding.compression_interval + 1 >= 1
    return reached, setting


def _fit_channels(press, spec, model) -> tuple[bool, dict]:
    """ThinK prunes ``m`` of the ``D`` key channels of every prompt position: a prompt token then
    costs ``(2D − m)/(2D)`` of a full one; ``m`` is the fewest that fit."""
    d = model.head_dim
    p, s = spec.prompt_len, spec.decode_steps
    room = np.min(np.asarray(spec.capacity)) / spec.fp_bytes  # tokens of full size one unit may hold
    needed = int(np.ceil(max(0.0, (p + s - room) * 2 * d / p) - 1e-9)) if p else 0
    m = min(needed, d)
    press.key_channel_compression_ratio = (m + 0.5) / d if m else 0.0
    return needed <= d, {"key_channel_compression_ratio": press.key_channel_compression_ratio, "channels": m}


def _ratio_for(press, model, n: int, p: int) -> float:
    """The ratio that keeps ``n`` of ``p`` prompt tokens per (layer, kv_head) — for PyramidKV
    the smallest whose per-layer budgets sum to at most ``L·n`` (bisection)."""
    from kvpress.utils import compute_n_kept

    kvpress = load()
    if not isinstance(press, kvpress.PyramidKVPress):
        ratio = 1.0 - (n + 0.5) / p
        if compute_n_kept(p, ratio) != n:  # pragma: no cover - float rounding guard
            raise KvscopeError(f"no compression ratio keeps exactly {n} of {p} tokens")
        return ratio
    config = config_of(model, False)
    modules = [LayerStandIn(config, layer, model.head_dim, None) for layer in range(model.n_layers)]

    def kept(ratio: float) -> int:
        press.compression_ratio = ratio
        return sum(press.get_layer_budget(m, p) for m in modules)

    low, high = 0.0, 1.0 - 0.5 / p
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if kept(mid) > n * len(modules) else (low, mid)
    return high
