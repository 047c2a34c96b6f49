"""What kvscope knows about a model: one place for its facts and its attention rule.

    spec = ModelSpec.from_model(model)           # from a loaded transformers model
    spec = ModelSpec.from_config(attrs["model"]["config"])   # from a store (what tracing wrote)
    spec.rule(layer)                             # AttentionRule(scaling, softcap, window)
    spec.rules()                                 # every layer's, for tensors with a layer dim
    spec.rope(model)                             # rotary parameters (inv_freq, scaling) per layer

Stores keep :meth:`ModelSpec.config` under ``attrs["model"]["config"]`` (the keys below).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

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
    attention_scaling: tuple[float | None, ...] = ()  # per layer, as the attention modules carry it

    @classmethod
    def from_model(cls, model) -> ModelSpec:
        cfg = model.config.get_text_config()
        n_heads = cfg.num_attention_heads
        scaling = {}
        for module in model.modules():  # attention modules carry layer_idx and their softmax scaling
            value = getattr(module, "scaling", None)
            if hasattr(module, "layer_idx") and isinstance(value, (int, float)):
                scaling[int(module.layer_idx)] = float(value)
        return cls(
            n_layers=cfg.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads,
            architecture=(model.config.architectures or [type(model).__name__])[0],
            model_type=cfg.model_type,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=getattr(cfg, "max_position_embeddings", None),
            rope_parameters=json.loads(json.dumps(getattr(cfg, "rope_parameters", None) or {}, default=str)),
            sliding_window=getattr(cfg, "sliding_window", None),
            layer_types=tuple(getattr(cfg, "layer_types", None) or ()),
            attn_logit_softcapping=getattr(cfg, "attn_logit_softcapping", None),
            attention_scaling=tuple(scaling.get(layer) for layer in range(cfg.num_hidden_layers)),
        )

    @classmethod
    def from_config(cls, config: dict, **sizes) -> ModelSpec:
        """From a store's ``attrs["model"]["config"]``; ``sizes`` (``n_layers``, ``n_heads``,
        ``n_kv_heads``, ``head_dim``) fill what an older or synthetic store left out."""
        known = {k: v for k, v in config.items() if k in cls.__dataclass_fields__ and v is not None}
        merged = {**{k: v for k, v in sizes.items() if v is not None}, **known}
        merged.setdefault("n_heads", merged.get("n_kv_heads"))
        for key in ("layer_types", "attention_scaling"):
            merged[key] = tuple(merged.get(key) or ())
        return cls(**merged)

    def config(self) -> dict:
        """The JSON document a store keeps (``attrs["model"]["config"]``)."""
        doc = asdict(self)
        doc["layer_types"] = list(self.layer_types)
        doc["attention_scaling"] = list(self.attention_scaling)
        return doc

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None for global attention)."""
        if self.layer_types:
            return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None
        return self.sliding_window or None

    @property
    def global_only(self) -> bool:
        """Every layer attends every position (no sliding-window or other layer types)."""
        if self.layer_types:
            return all(t == "full_attention" for t in self.layer_types)
        return not self.sliding_window

    def scaling(self, layer: int) -> float:
        """The softmax scaling of ``layer`` (``head_dim^−½`` where the model did not say)."""
        value = self.attention_scaling[layer] if layer < len(self.attention_scaling) else None
        return float(value) if value is not None else self.head_dim**-0.5

    def rule(self, layer: int) -> AttentionRule:
        from .attention import AttentionRule

        return AttentionRule(self.scaling(layer), self.attn_logit_softcapping, self.window(layer))

    def rules(self) -> LayerRules:
        from .attention import LayerRules

        return LayerRules(tuple(self.rule(layer) for layer in range(self.n_layers)))


def last_logits_only(model) -> dict:
    """Keyword arguments for a forward whose next token needs the last position's logits only:
    ``logits_to_keep=1`` where the model's ``forward`` takes it (transformers' ``generate`` does
    the same), none otherwise. Without it a prompt's forward computes ``P × vocab`` logits that
    nothing reads: at 2,048 tokens of SmolLM2 0.4 GB in fp32 and a fifth of the prefill's
    multiply-adds; at 32K tokens of Llama-3.1-8B 8.4 GB in bf16."""
    import inspect

    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
