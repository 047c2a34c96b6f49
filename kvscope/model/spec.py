"""What kvscope knows about a model: one place for its facts and its attention rule.

    spec = ModelSpec.from_model(model)           # from a loaded transformers model
    spec = ModelSpec.from_config(attrs["model"]["config"])   # from a store (what tracing wrote)
    spec.rule(layer)                             # AttentionRule(scaling, softcap, window)
    spec.rules()                                 # every layer's, for tensors with a layer dim
    spec.token_values                            # values one token costs per cache unit (the geometry)

Stores keep ``ModelSpec.config`` under ``attrs["model"]["config"]`` (the keys below).

**Cache geometry** (docs/concepts.md#geometry, docs/architectures.md) — what one token costs per layer, and what
kvscope's dims mean for each family:

    family              layer dim                 kv_head (cache unit)       token_values per unit
    GQA / MHA / MQA     every layer               each KV head               head_dim + v_head_dim
    multi-head latent   every layer               1: the shared latent       kv_lora_rank + qk_rope_head_dim
    hybrid              attention layers only     as their family            (linear / SSM layers: no
                        (the model's indices)                                per-token KV, outside β)
    sliding window      a layer holds at most its window of tokens
    learned sinks       a logit per query head (``learned_sinks``), not a cached token

``n_layers`` counts the layers a trace stores (``attention_layers`` their indices in the model);
``n_kv_heads`` the cache units of a layer — under MLA one latent that every query head reads,
so kv-group rows average all heads and a policy decides per (layer, token). ``key_heads``: the
heads of the K/V tensors attention computes with (MLA: every query head's own key and value,
decompressed from the latent; ``--record qkv`` stores those).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from ..errors import KvscopeError

if TYPE_CHECKING:  # the rule needs torch; opening a trace does not
    from .attention import AttentionRule, LayerRules


@dataclass(frozen=True)
class ModelSpec:
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    architecture: str = ""
    model_type: str = ""
    hidden_size: int | None = None
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    rope_parameters: dict = field(default_factory=dict)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    attn_logit_softcapping: float | None = None
    attention_scaling: tuple[float | None, ...] = ()  # per model layer, as the attention modules carry it
    # -- cache geometry (module docstring); the defaults describe a GQA model whose every layer attends
    attention_layers: tuple[int, ...] = ()  # the model's index of each stored layer (() = 0..n_layers−1)
    model_layers: int | None = None  # layers of the whole model (None: n_layers)
    key_heads: int | None = None  # heads of the K/V tensors attention reads (None: n_kv_heads)
    v_head_dim: int | None = None  # value head size where it differs from q/k's (MLA)
    kv_latent_dim: int | None = None  # MLA: values of the latent one token caches per layer
    learned_sinks: tuple[tuple[float, ...] | None, ...] = ()  # per model layer: each query head's sink logit
    capture: str = "attention_function"  # or "output_attentions": the model attends inside its own modules
    layer_windows: tuple[int | None, ...] = ()  # per model layer: the window its transformers cache holds

    @classmethod
    def from_model(
        cls, model, attention_layers: tuple[int, ...] | None = None, capture: str | None = None
    ) -> ModelSpec:
        """From a loaded model; ``attention_layers``: the layers whose attention kvscope sees
        (``kvscope.tracing.capture.probe``; default every layer); ``capture``: how."""
        cfg = model.config.get_text_config()
        n_heads = cfg.num_attention_heads
        n_model = cfg.num_hidden_layers
        scaling, sinks = {}, {}
        for module in model.modules():  # attention modules carry layer_idx, their softmax scaling and sinks
            if not hasattr(module, "layer_idx") or not isinstance(module.layer_idx, int):
                continue
            value = getattr(module, "scaling", None)
            if isinstance(value, (int, float)):
                scaling[module.layer_idx] = float(value)
            sink = getattr(module, "sinks", None)
            if sink is not None and getattr(sink, "numel", lambda: 0)() == n_heads:
                sinks[module.layer_idx] = tuple(float(x) for x in sink.detach().float().cpu().tolist())
        layers = tuple(attention_layers) if attention_layers is not None else tuple(range(n_model))
        latent = _latent_geometry(cfg)
        head_dim = latent.get("head_dim") or getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        v_dim = getattr(cfg, "v_head_dim", None) or head_dim
        return cls(
            n_layers=len(layers),
            n_heads=n_heads,
            n_kv_heads=1 if latent else getattr(cfg, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            key_heads=n_heads if latent else None,
            v_head_dim=v_dim if v_dim != head_dim else None,
            kv_latent_dim=latent.get("kv_latent_dim"),
            attention_layers=() if layers == tuple(range(n_model)) else layers,
            model_layers=None if len(layers) == n_model else n_model,
            learned_sinks=tuple(sinks.get(layer) for layer in range(n_model)) if sinks else (),
            capture=capture or cls.capture,
            layer_windows=_cache_windows(cfg),
            architecture=(model.config.architectures or [type(model).__name__])[0],
            model_type=cfg.model_type,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=getattr(cfg, "max_position_embeddings", None),
            rope_parameters=json.loads(json.dumps(getattr(cfg, "rope_parameters", None) or {}, default=str)),
            sliding_window=getattr(cfg, "sliding_window", None),
            layer_types=tuple(getattr(cfg, "layer_types", None) or ()),
            attn_logit_softcapping=getattr(cfg, "attn_logit_softcapping", None),
            attention_scaling=tuple(scaling.get(layer) for layer in range(n_model)),
        )

    @classmethod
    def from_config(cls, config: dict, **sizes) -> ModelSpec:
        """From a store's ``attrs["model"]["config"]``; ``sizes`` (``n_layers``, ``n_heads``,
        ``n_kv_heads``, ``head_dim``) fill what an older or synthetic store left out."""
        known = {k: v for k, v in config.items() if k in cls.__dataclass_fields__ and v is not None}
        merged = {**{k: v for k, v in sizes.items() if v is not None}, **known}
        merged.setdefault("n_heads", merged.get("n_kv_heads"))
        for key in ("layer_types", "attention_scaling", "attention_layers", "layer_windows"):
            merged[key] = tuple(merged.get(key) or ())
        merged["learned_sinks"] = tuple(None if s is None else tuple(s) for s in merged.get("learned_sinks") or ())
        return cls(**merged)

    def config(self) -> dict:
        """The JSON document a store keeps (``attrs["model"]["config"]``)."""
        doc = asdict(self)
        for key in ("layer_types", "attention_scaling", "attention_layers", "layer_windows"):
            doc[key] = list(getattr(self, key))
        doc["learned_sinks"] = [None if s is None else list(s) for s in self.learned_sinks]
        return doc

    @property
    def group(self) -> int:
        """Query heads per KV head (cache unit)."""
        return self.n_heads // self.n_kv_heads

    # -- cache geometry ----------------------------------------------------------------------
    def model_layer(self, layer: int) -> int:
        """The model's index of stored layer ``layer`` (they differ in a hybrid model)."""
        return self.attention_layers[layer] if self.attention_layers else layer

    def stored_layer(self, model_layer: int) -> int:
        """The stored layer of the model's layer ``model_layer`` (a ``layer`` coordinate value)."""
        if not self.attention_layers:
            return model_layer
        try:
            return self.attention_layers.index(model_layer)
        except ValueError:
            raise KvscopeError(
                f"layer {model_layer} holds no attention (attention layers: {self.layer_index})"
            ) from None

    @property
    def layer_index(self) -> tuple[int, ...]:
        """The model's index of every stored layer (the store's ``layer`` coordinate)."""
        return tuple(self.model_layer(layer) for layer in range(self.n_layers))

    @property
    def from_weights(self) -> bool:
        """Rows come from the model's own ``output_attentions`` (it does not call kvscope's
        attention function): no queries or keys to record."""
        return self.capture == "output_attentions"

    @property
    def n_key_heads(self) -> int:
        """Heads of the K/V tensors attention reads (``n_kv_heads`` but under MLA)."""
        return self.key_heads or self.n_kv_heads

    @property
    def v_dim(self) -> int:
        """Values per value head."""
        return self.v_head_dim or self.head_dim

    @property
    def latent(self) -> bool:
        """The model caches one latent per (layer, token) for all heads (MLA)."""
        return self.kv_latent_dim is not None

    @property
    def token_values(self) -> int:
        """Values one token costs per cache unit at full precision: ``head_dim + v_dim`` (its K
        and V) per KV head, or the latent's ``kv_lora_rank + qk_rope_head_dim`` per layer."""
        return self.kv_latent_dim if self.latent else self.head_dim + self.v_dim

    def held(self, layer: int, length: int) -> int:
        """Tokens stored layer ``layer`` holds at ``length`` tokens: its window at most."""
        window = self.window(layer)
        return min(length, window) if window else length

    def full_tokens(self, length: int) -> int:
        """Tokens all stored layers hold together at full KV and ``length`` tokens (× units)."""
        return sum(self.held(layer, length) for layer in range(self.n_layers)) * self.n_kv_heads

    def geometry(self) -> dict:
        """The cache geometry in plain values (``kvscope info``)."""
        windows = {self.model_layer(i): self.window(i) for i in range(self.n_layers) if self.window(i)}
        return {
            "attention_layers": list(self.layer_index),
            "model_layers": self.model_layers or self.n_layers,
            "cache_units_per_layer": self.n_kv_heads,
            "unit": "latent" if self.latent else "kv_head",
            "values_per_token_per_unit": self.token_values,
            "sliding_windows": windows,
            "learned_sinks": self.has_sinks,
            "rows_from": self.capture,
        }

    def geometry_line(self) -> str:
        """One line of what the model caches (``kvscope info``)."""
        g = self.geometry()
        layers = f"{self.n_layers} layers"
        if self.attention_layers:
            layers = f"{self.n_layers} of {g['model_layers']} layers attend ({', '.join(map(str, self.layer_index))})"
        unit = (
            f"one latent of {self.token_values} values per token and layer (MLA)"
            if self.latent
            else f"{self.n_kv_heads} KV heads of {self.token_values} values per token (K and V)"
        )
        extra = [f"sliding windows on {len(g['sliding_windows'])} layers"] if g["sliding_windows"] else []
        extra += ["learned sinks"] if self.has_sinks else []
        extra += ["rows from output_attentions"] if self.from_weights else []
        return "cache: " + "; ".join([layers, unit, *extra])

    def window(self, layer: int) -> int | None:
        """The sliding window of stored layer ``layer`` (None for global attention): the tokens its
        transformers cache holds at most (a chunked-attention layer's chunk), or, in a store
        written before that was recorded, the config's sliding window."""
        if self.layer_windows:
            return self.layer_windows[self.model_layer(layer)]
        if self.layer_types:
            kind = self.layer_types[self.model_layer(layer)]
            return self.sliding_window if kind == "sliding_attention" else None
        return self.sliding_window or None

    @property
    def global_only(self) -> bool:
        """Every stored layer attends every position (no sliding window)."""
        return all(self.window(layer) is None for layer in range(self.n_layers))

    def scaling(self, layer: int) -> float:
        """The softmax scaling of stored layer ``layer`` (``head_dim^−½`` where the model did not say)."""
        m = self.model_layer(layer)
        value = self.attention_scaling[m] if m < len(self.attention_scaling) else None
        return float(value) if value is not None else self.head_dim**-0.5

    def sinks(self, layer: int) -> tuple[float, ...] | None:
        """Learned sink logits ``[head]`` of stored layer ``layer`` (None without)."""
        m = self.model_layer(layer)
        return self.learned_sinks[m] if m < len(self.learned_sinks) else None

    @property
    def has_sinks(self) -> bool:
        return any(s is not None for s in self.learned_sinks)

    def rule(self, layer: int) -> AttentionRule:
        from .attention import AttentionRule

        return AttentionRule(self.scaling(layer), self.attn_logit_softcapping, self.window(layer), self.sinks(layer))

    def rules(self) -> LayerRules:
        from .attention import LayerRules

        return LayerRules(tuple(self.rule(layer) for layer in range(self.n_layers)))


def _cache_windows(cfg) -> tuple[int | None, ...]:
    """The window each layer's transformers cache holds at most (sliding-window and chunked
    layers; None for the others), as ``DynamicCache(config=…)`` builds it; ``()`` where transformers
    cannot tell."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        _, per_layer = get_layer_types_and_kwargs(cfg)
    except Exception:  # noqa: BLE001 - an older transformers, or a config it cannot read: the config decides
        return ()
    windows = tuple(kwargs.get("sliding_window") for kwargs in per_layer)
    return windows if any(w is not None for w in windows) else ()


def _latent_geometry(cfg) -> dict:
    """Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, …) from the config: the q/k head
    size and the latent a token caches per layer; ``{}`` for any other attention."""
    rank, rope = getattr(cfg, "kv_lora_rank", None), getattr(cfg, "qk_rope_head_dim", None)
    if not rank or rope is None:
        return {}
    nope = getattr(cfg, "qk_nope_head_dim", None) or 0
    return {"head_dim": nope + rope, "kv_latent_dim": rank + rope}


TRANSFORMERS_TESTED = (5, 25)  # the oldest transformers the suite runs on: pyproject's floor (tests/test_house.py)


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers older than ``TRANSFORMERS_TESTED`` (``version``: the installed
    one by default). Older releases differ in what kvscope relies on — the cache's keyword, how
    sliding-window and hybrid layers mask and cache — and a trace made with them is wrong, not
    refused (5.17 decodes every step on its own token alone)."""
    if version is None:
        import transformers

        version = transformers.__version__
    import re

    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) < TRANSFORMERS_TESTED:
        floor = ".".join(map(str, TRANSFORMERS_TESTED))
        raise KvscopeError(
            f"transformers {version} is older than {floor}, the oldest kvscope is tested on: pip install 'transformers>={floor},<6'"
        )


def cache_keyword(model) -> str:
    """The keyword under which ``model``'s forward takes a KV cache: ``cache`` where the forward
    has it (transformers ≥ 5.24), ``past_key_values`` before. The wrong name is not an error there:
    ``**kwargs`` swallows it and every decode step attends to its own token alone. (A decode loop
    asks once, not per step: the answer comes from the forward's signature.)"""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def with_cache(model, cache) -> dict:
    """``{keyword: cache}`` for one forward of ``model`` (``cache_keyword``)."""
    return {cache_keyword(model): cache}


def returned_cache(out):
    """The cache a forward returned (``out.cache``; ``out.past_key_values`` before transformers 5.24)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def last_logits_only(model) -> dict:
    """Keyword arguments for a forward whose next token needs the last position's logits only:
    ``logits_to_keep=1`` where the model's ``forward`` takes it (transformers' ``generate`` does
    the same), none otherwise. Without it a prompt's forward computes ``P × vocab`` logits that
    nothing reads: at 2,048 tokens of SmolLM2 0.4 GB in fp32 and a fifth of the prefill's
    multiply-adds; at 32K tokens of Llama-3.1-8B 8.4 GB in bf16."""
    import inspect

    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
