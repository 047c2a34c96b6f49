"""NVIDIA kvpress's own press classes, driven by recorded tensors instead of a model.

A press is written against a transformers attention layer: after the layer's prefill forward,
``press.forward_hook(module, input, kwargs, output)`` reads the layer's cache and hidden
states and writes back the keys and values it keeps. Here every layer gets a stand-in that
carries what presses read, built from a trace recorded with ``--record qkv``:

    module          config (heads, KV heads, layers), layer_idx, head_dim, rotary_emb
                    (cos, sin from the recorded inv_freq and attention scaling), q_proj = identity
    hidden_states   the layer's pre-RoPE queries ``[1, n, H·D]`` (recorded q with RoPE undone):
                    what ``q_proj(hidden_states)`` gives a press is exactly the model's queries
    cache           ``cache.layers[l].keys/values [1, Hkv, n, D]``: the recorded post-RoPE K/V
                    of the positions the press kept so far
    output[1]       attention ``[1, H, P, P]`` by kvscope's attention rule, for the presses that
                    read the layer's attention weights (ObservedAttention); None otherwise, as
                    under sdpa

Which positions a press keeps is read from the press itself: the ``gather`` it applies to
the cache's keys (observed with a ``torch.overrides.TorchFunctionMode``, nothing
patched) and the ``masked_key_indices`` AdaKV leaves on the module. Keys it returns are
checked to be exactly that gather; a press that merges, re-rotates or quantizes what it keeps
is refused. Anything a press reads that the stand-ins do not hold (a projection's weights, a
norm, extra forward passes) raises one line naming it.

A live cache ([`kvscope.live.PolicyCache`][kvscope.live.PolicyCache]) drives the same runner with the tensors of
each forward as attention was handed them — what a trace under ``--record qkv`` stores — so a
press decides live exactly as it does on a recording of that decode.

kvpress pins ``transformers<5.3`` and patches transformers' attention functions on import;
``load`` imports it lazily and puts the attention functions back as they were.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import typing
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ..errors import KvscopeError, first_line
from ..params import hint_options, parse_text

KVPRESS_VERSION = "0.5.5"
INSTALL = (
    f"pip install 'kvscope[presses]' && pip install --no-deps kvpress=={KVPRESS_VERSION} peft (make setup does both)"
)
NEEDS_ATTENTIONS = ("ObservedAttentionPress",)  # scorers that read the layer's attention weights
ALIASES = {"base": "base_press"}  # press:DecodingPress:base=KnormPress
SET_BY_BUDGET = ("compression_ratio", "target_size")


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
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: take it as written
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _press_types(hint) -> tuple[type, ...]:
    """The press classes a field accepts (empty for a plain value)."""
    base = load().BasePress
    return tuple(o for o in hint_options(hint) if isinstance(o, type) and issubclass(o, base))


def fields(cls) -> dict[str, typing.Any]:
    """``{name: type}`` of a press's dataclass fields."""
    hints = _hints(cls)
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls) if f.init}


def _parse_value(owner: str, key: str, hint, text: str):
    if _press_types(hint):
        cls = press_class(text)
        if not issubclass(cls, _press_types(hint)):
            allowed = ", ".join(t.__name__ for t in _press_types(hint))
            raise KvscopeError(f"press {owner} parameter {key} must be a press of kind {allowed} (got {text})")
        return cls
    kind = next((o for o in hint_options(hint) if o is not type(None)), hint)
    if kind not in (bool, int, float, str):
        raise KvscopeError(f"press {owner} parameter {key} ({hint}) cannot be given on the command line")
    try:
        return parse_text(kind, text)
    except ValueError:
        raise KvscopeError(f"press {owner} parameter {key} must be {kind.__name__} (got {text!r})") from None


def route(name: str, options: tuple[tuple[str, str], ...]) -> dict:
    """``press`` and ``name=value`` options → a tree ``{"class": cls, "values": {...}}``: each key
    goes to the outermost press that has it (``base`` is kvpress's ``base_press``), a press-typed
    value opens a nested press."""
    cls = press_class(name)
    tree = {"class": cls, "values": {}}
    nested: list[dict] = []
    for key, text in options:
        key = ALIASES.get(key, key)
        if key in SET_BY_BUDGET:
            raise KvscopeError(f"press parameter {key} is set from the budget β (give --budgets instead)")
        owner = next((node for node in [tree, *nested] if key in fields(node["class"])), None)
        if owner is None:
            known = sorted({k for node in [tree, *nested] for k in fields(node["class"])} - set(SET_BY_BUDGET))
            raise KvscopeError(f"press {name} has no parameter {key!r} (has: {', '.join(known) or 'none'})")
        value = _parse_value(owner["class"].__name__, key, fields(owner["class"])[key], text)
        if isinstance(value, type):
            child = {"class": value, "values": {}}
            owner["values"][key] = child
            nested.append(child)
        else:
            owner["values"][key] = value
    return tree


def build(tree: dict):
    """A fresh press object from a ``route`` tree (nested presses first); kvpress's own
    checks (assertions in ``__post_init__``) become one line."""
    cls = tree["class"]
    values = {k: build(v) if isinstance(v, dict) else v for k, v in tree["values"].items()}
    for key, hint in fields(cls).items():  # a press that needs a press and got none
        field = next(f for f in dataclasses.fields(cls) if f.name == key)
        if key not in values and _press_types(hint) and field.default is dataclasses.MISSING:
            raise KvscopeError(f"press {cls.__name__} needs {key}=<press> (e.g. {key}=KnormPress)")
    try:
        return cls(**values)
    except Exception as error:  # noqa: BLE001 - kvpress's own checks (assertions in __post_init__)
        raise KvscopeError(f"press {cls.__name__}: {first_line(error)}") from None


def presses_in(press) -> list:
    """``press`` and every press nested in it."""
    out = [press]
    for f in dataclasses.fields(press):
        value = getattr(press, f.name, None)
        if isinstance(value, load().BasePress):
            out += presses_in(value)
    return out


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


class GatherRecorder:
    """Records the index of the last ``gather`` along the position dim applied to ``keys``
    inside the ``with`` block (the positions a press keeps)."""

    def __init__(self, keys):
        self.keys, self.index = keys, None

    def __enter__(self):
        import torch
        from torch.overrides import TorchFunctionMode

        recorder = self

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in (torch.Tensor.gather, torch.gather) and args and args[0] is recorder.keys:
                    dim = args[1] if len(args) > 1 else kwargs.get("dim")
                    index = args[2] if len(args) > 2 else kwargs.get("index")
                    if dim in (2, -2):
                        recorder.index = index
                return func(*args, **kwargs)

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


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


class PressRunner:
    """One sequence's press over every layer: the stand-in caches and which positions they hold.

    Driven by the tensors of each forward, from a trace or from a live cache alike:

        prefill(keys, values, queries)      keys, values [layer, kv_head, P, D] float32 tensors,
                                            queries [P, layer, head, D] post-RoPE
        append(position, keys, values)      [layer, kv_head, D]: the decode position enters
        decode(position, queries)           [layer, head, D]: the press's decode hook

    ``rope`` the model's rotary parameters; ``model`` its ``ModelSpec``."""

    def __init__(self, press, spec, rope, model):
        import torch

        kvpress = load()
        self.press, self.spec, self.model = press, spec, model
        self.label = type(press).__name__
        self.attentions = any(type(p).__name__ in NEEDS_ATTENTIONS for p in presses_in(press))
        self.decodes = isinstance(press, (kvpress.DecodingPress, kvpress.PrefillDecodingPress))
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
        try:
            press.post_init_from_model(SimpleNamespace(config=config, device=torch.device("cpu")))
        except Exception as error:  # noqa: BLE001 - a press that needs the model itself
            raise KvscopeError(
                f"press {self.label} needs the model itself, which kvscope's stand-in layers do not give "
                f"({first_line(error, named=True)})"
            ) from None

    def scratch_bytes(self) -> int:
        """Bytes of the stand-in caches the press works on (held between forwards only by
        presses that decode)."""
        return sum(int(t.nbytes) for layer in self.cache.layers for t in (layer.keys, layer.values) if t is not None)

    # -- budget ---------------------------------------------------------------------------
    def fit_budget(self) -> tuple[bool, dict]:
        """Set the press's compression ratio (or DecodingPress's target size) from the budget
        (module docstring of ``kvscope.policies.press``); ``(reached, {setting: value})``."""
        kvpress = load()
        spec, press = self.spec, self.press
        cap, p, s = spec.fp_capacity_tokens, spec.prompt_len, spec.decode_steps
        if isinstance(press, kvpress.DecodingPress):
            interval = press.compression_interval
            press.target_size = max(1, cap - interval + 1)
            return cap - interval + 1 >= 1 and p + interval - 1 <= cap, {"target_size": press.target_size}
        try:
            has_ratio = hasattr(press, "compression_ratio")
        except Exception as error:  # noqa: BLE001 - a ratio only a model forward can tell (DMS, SimLayerKV)
            raise KvscopeError(
                f"press {self.label} knows its compression ratio only after a model forward ({first_line(error)}): "
                "a budget cannot set it"
            ) from None
        if not has_ratio:
            raise KvscopeError(f"press {self.label} has no compression_ratio a budget could set")
        n = cap - s
        reached = n >= 1
        n = max(n, 1)
        ratio = 0.0 if n >= p else self._ratio_for(n, p)
        try:
            press.compression_ratio = ratio
        except Exception as error:  # noqa: BLE001 - a property that refuses to be set (ThinK)
            raise KvscopeError(
                f"press {self.label} takes no compression ratio a budget could set ({first_line(error)})"
            ) from None
        return reached, {"compression_ratio": ratio}

    def _ratio_for(self, n: int, p: int) -> float:
        """The ratio that keeps ``n`` of ``p`` prompt tokens per (layer, kv_head) — for PyramidKV
        the smallest whose per-layer budgets sum to at most ``L·n`` (bisection)."""
        from kvpress.utils import compute_n_kept

        kvpress = load()
        if not isinstance(self.press, kvpress.PyramidKVPress):
            ratio = 1.0 - (n + 0.5) / p
            if compute_n_kept(p, ratio) != n:  # pragma: no cover - float rounding guard
                raise KvscopeError(f"no compression ratio keeps exactly {n} of {p} tokens")
            return ratio

        def kept(ratio: float) -> int:
            self.press.compression_ratio = ratio
            return sum(self.press.get_layer_budget(m, p) for m in self.modules)

        low, high = 0.0, 1.0 - 0.5 / p
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (mid, high) if kept(mid) > n * len(self.modules) else (low, mid)
        return high

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
        """kvpress's forward hook of one layer; the positions it keeps follow its gather."""
        import torch

        cache = self.cache.layers[module.layer_idx]
        before = cache.keys
        kwargs = {
            "hidden_states": hidden,
            "past_key_values": self.cache,
            "cache_position": cache_position,
            "position_embeddings": module.rotary_emb(hidden, cache_position[None]),
            "attention_mask": None,
        }
        try:
            with GatherRecorder(before) as recorder:
                self.press.forward_hook(module, [], kwargs, (None, attentions))
        except KvscopeError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever a press raises on a stand-in becomes one line
            missing = module.__dict__.get("missing")
            if missing:
                raise KvscopeError(
                    f"press {self.label} reads {missing[-1]!r} of the attention layer, which kvscope does not hold "
                    "(a trace or a live cache hands a press the layer's q, k and v — not its weights, norms or inputs)"
                ) from None
            hint = (  # kvpress's own checks are assertions that say what is wrong; anything else is a guess
                ""
                if isinstance(error, AssertionError)
                else "; a press that runs the model itself (extra forward passes) cannot run on kvscope's stand-in layers"
            )
            raise KvscopeError(
                f"press {self.label} failed on layer {module.layer_idx} ({first_line(error, named=True)}){hint}"
            ) from None
        after = cache.keys
        if after is before:
            return
        index = recorder.index
        if index is None or index.shape != after.shape or not torch.equal(after, before.gather(2, index)):
            raise KvscopeError(
                f"press {self.label} rewrites the keys it keeps (merging, re-rotating or quantizing them): "
                "kvscope replays presses that keep or drop positions"
            )
        self.positions[module.layer_idx] = self.positions[module.layer_idx].gather(1, index[0, :, :, 0])

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
