"""Which models kvscope traces exactly, and the one-line refusal of the rest (docs/architectures.md).

Before anything is written, one probe forward (``kvscope.tracing.capture.probe``) shows
which attention modules call kvscope's attention function and with what tensors. The model is
traced when every such module fits one cache geometry that the model spec describes
(``kvscope.model.spec``) and hands the function nothing the attention rule does not model;
otherwise it is refused in one line that says why:

    spec = inspect(model, settings)       # the ModelSpec of what the probe saw, or KvscopeError
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import KvscopeError, first_line
from ..model.spec import ModelSpec, check_transformers
from .capture import PROBE_TOKENS, Probe, probe, weights_probe

# keyword tensors an attention function may receive that do not change what it computes from
# q, k, v and the mask: positions (already applied by RoPE) and a varlen kernel's bookkeeping
HARMLESS_TENSORS = frozenset({"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "cache_position"})


def inspect(model, attn: str = "sdpa", record_qkv: bool = False) -> ModelSpec:
    """The model spec of ``model`` (whose attention already routes through kvscope's function,
    kernel ``attn``), its attention layers as the probe saw them; a [`KvscopeError`][kvscope.errors.KvscopeError] naming
    the reason where kvscope cannot trace it exactly.

    A model that attends inside its own modules (BLOOM and MPT with ALiBi, GPT-1, …) never calls
    the function: its rows are then transformers' own eager probabilities (``output_attentions``),
    exact by definition, but its queries and keys stay unseen (no ``--record qkv``)."""
    check_transformers()
    name = (model.config.architectures or [type(model).__name__])[0]
    seen = _probed(name, probe, model)
    if not seen.cache:
        raise KvscopeError(
            f"{name} keeps its state inside its own modules, not in a transformers Cache, which kvscope decodes with"
        )
    if not seen.layers and not seen.unnamed:
        return _weights_spec(name, model, record_qkv)
    _check_seen(name, seen)
    spec = _check_spec(name, ModelSpec.from_model(model, attention_layers=tuple(sorted(seen.layers))), seen)
    shaped = _mask_shapes_rows(name, spec, seen, attn)
    if shaped and record_qkv:
        raise KvscopeError(
            f"--record qkv: {name} {shaped}; the rows kvscope records hold it, rows recomputed from q and k would not"
        )
    _check_kernel(name, spec, attn, shaped)
    return spec


def _mask_shapes_rows(name: str, spec: ModelSpec, seen: Probe, attn: str) -> str:
    """What, besides causality and the layer's window, the mask the model hands its attention
    does to the rows — a position bias (Falcon's ALiBi), a selection of keys (sparse attention) —
    in words ("" for nothing). A mask that shows keys causality or the window hide is a refusal:
    what the model attends then is not what its config says (or, under sdpa, not what its eager
    attention computes)."""
    import torch

    n = seen.n_tokens
    selects = False
    for index, layer in enumerate(spec.layer_index):
        shown = seen.layers[layer].visible  # [q, kv]
        if shown is None:
            continue
        q_pos = torch.arange(n - shown.shape[0], n)[:, None]
        rule = spec.rule(index).visible(q_pos, torch.arange(shown.shape[1]))
        if (shown & ~rule).any():
            hint = "; trace it with --attn eager" if attn == "sdpa" else ""
            raise KvscopeError(
                f"{name}: layer {layer}'s attention mask under --attn {attn} shows keys that causality or its "
                f"window ({spec.window(index)}) hide: not what its config describes{hint}"
            )
        selects |= bool((rule & ~shown).any())
    if seen.mask_bias:
        return "adds a bias to its logits through its attention mask (ALiBi, a dynamic mask)"
    return "selects keys in its attention mask (beyond causality and its window)" if selects else ""


def _probed(name: str, how, model):
    """A probe (``how(model)``); one whose forwards the model itself cannot run is a refusal."""
    try:
        return how(model)
    except Exception as exc:  # noqa: BLE001 - whatever the model raises, said in one line
        raise KvscopeError(
            f"{name}: a forward of {PROBE_TOKENS} tokens and a decode step with a cache fail "
            f"({first_line(exc, named=True)})"
        ) from None


def _weights_spec(name: str, model, record_qkv: bool) -> ModelSpec:
    """The spec of a model kvscope records through ``output_attentions`` (``inspect``): its
    heads from the probabilities, its KV heads and head size from the keys its cache holds."""
    model.set_attn_implementation("eager")  # what such a model computes whatever it is asked
    shapes, keys = _probed(name, weights_probe, model)
    beyond = sorted({shape[-1] for shape in shapes.values()} - {PROBE_TOKENS})
    if beyond:
        raise KvscopeError(
            f"{name} attends over {beyond[0]} positions for {PROBE_TOKENS} tokens (positions of its own beside "
            "the sequence's), which kvscope cannot place"
        )
    if not shapes:
        raise KvscopeError(
            f"{name} neither calls transformers' attention functions nor returns its attention "
            "(output_attentions): kvscope cannot see it (docs/architectures.md)"
        )
    if record_qkv:
        raise KvscopeError(
            f"--record qkv: {name} computes attention inside its own modules; kvscope records its rows from "
            "transformers' output_attentions but cannot see its queries and keys"
        )
    spec = ModelSpec.from_model(model, attention_layers=tuple(sorted(shapes)), capture="output_attentions")
    heads = {shape[1] for shape in shapes.values()}
    if heads != {spec.n_heads}:
        raise KvscopeError(f"{name} returns attention of {sorted(heads)} heads; its config says {spec.n_heads}")
    cached = {keys[layer][1::2] for layer in shapes if layer in keys}  # (kv_head, D)
    if len(cached) == 1:  # what its cache really holds (a config may carry an attribute it never reads)
        ((n_kv, head_dim),) = cached
        spec = replace(spec, n_kv_heads=n_kv, head_dim=head_dim, v_head_dim=None)
    return spec


def _check_seen(name: str, seen: Probe) -> None:
    if seen.unnamed:
        raise KvscopeError(
            f"{name}: {seen.unnamed} attention call(s) come from modules without a layer index of their own"
        )
    if seen.repeated:
        layers = ", ".join(map(str, sorted(seen.repeated)))
        raise KvscopeError(
            f"{name}: layer(s) {layers} call attention more than once per forward (a looped model, or two "
            "attentions per layer as differential attention): kvscope keeps one row per layer and step"
        )
    if seen.extra_keys:
        layer, extra = next(iter(sorted(seen.extra_keys.items())))
        raise KvscopeError(
            f"{name}: layer {layer} attends to {extra} key(s) beyond the tokens (compressed or memory entries), "
            "which are no position of the sequence"
        )
    if seen.shared:
        pairs = ", ".join(
            f"{layer} those of {owner}" if owner >= 0 else f"{layer} keeps none of its own"
            for layer, owner in sorted(seen.shared.items())
        )
        raise KvscopeError(
            f"{name}: layers reuse other layers' keys and values ({pairs}): one cache serves several layers, "
            "which kvscope's per-layer cache model does not describe"
        )
    shapes = {(s.heads, s.key_heads, s.head_dim, s.v_dim) for s in seen.layers.values()}
    if len(shapes) > 1:
        described = "; ".join(f"{h} heads on {kh} KV heads of size {d}/{v}" for h, kh, d, v in sorted(shapes))
        raise KvscopeError(
            f"{name}: its layers attend with different head layouts ({described}): not one cache geometry"
        )
    extra = sorted(set().union(*(s.kwargs for s in seen.layers.values())) - HARMLESS_TENSORS)
    if extra:
        raise KvscopeError(
            f"{name} hands its attention the tensor(s) {', '.join(extra)}, which kvscope's attention rule does not model"
        )


def _check_spec(name: str, spec: ModelSpec, seen: Probe) -> ModelSpec:
    """The spec with the head layout the attention modules computed with (a config may carry an
    attribute its model never reads); under MLA, the config's latent must be what they compute
    with, and the learned sinks where the model keeps them."""
    first = seen.layers[spec.layer_index[0]]
    if spec.latent:
        want = (spec.n_heads, spec.n_key_heads, spec.head_dim, spec.v_dim)
        got = (first.heads, first.key_heads, first.head_dim, first.v_dim)
        if got != want:
            raise KvscopeError(
                f"{name} attends with {got[0]} heads on {got[1]} KV heads of size {got[2]}/{got[3]}; its latent "
                f"attention config says {want[0]} on {want[1]} of size {want[2]}/{want[3]}"
            )
    else:
        v_dim = first.v_dim if first.v_dim != first.head_dim else None
        units = _cached_units(seen, spec.layer_index, first.key_heads)
        spec = replace(
            spec, n_heads=first.heads, n_kv_heads=units, key_heads=first.key_heads if units != first.key_heads else None,
            head_dim=first.head_dim, v_head_dim=v_dim,
        )  # fmt: skip
    if spec.n_key_heads not in (spec.n_kv_heads, spec.n_heads):
        raise KvscopeError(
            f"{name} attends with {spec.n_heads} heads on keys of {spec.n_key_heads} heads from a cache of "
            f"{spec.n_kv_heads}: not a geometry kvscope stores"
        )
    caps = {seen.layers[layer].softcap for layer in spec.layer_index}
    if len(caps) > 1:
        raise KvscopeError(f"{name}: its layers cap their logits differently ({caps}): not one attention rule")
    n_model = spec.model_layers or spec.n_layers
    scaling = (list(spec.attention_scaling) + [None] * n_model)[:n_model]
    for layer in spec.layer_index:  # the scaling it passes (a model may scale its queries itself and pass 1)
        scaling[layer] = seen.layers[layer].scaling
    spec = replace(spec, attn_logit_softcapping=caps.pop(), attention_scaling=tuple(scaling))
    for index, layer in enumerate(spec.layer_index):
        if seen.layers[layer].sink != (spec.sinks(index) is not None):
            raise KvscopeError(
                f"{name}: layer {layer}'s learned sinks are not where the model keeps them (module.sinks)"
            )
    return spec


def _cached_units(seen: Probe, layers, key_heads: int) -> int:
    """The cache units of a layer: the KV heads its transformers cache holds — fewer than the heads
    of the keys attention reads where the model repeats them after the cache (JetMoE's mixture
    of attention heads: one cached head serves two) — else the keys' heads."""
    cached = {seen.cached_heads.get(layer) for layer in layers}
    if len(cached) == 1:
        (units,) = cached
        if units and units < key_heads and key_heads % units == 0:
            return units
    return key_heads


def _check_kernel(name: str, spec: ModelSpec, attn: str, shaped: str) -> None:
    """flash_attention_2 has no learned-sink column, no mask to carry a bias or a selection, and
    wants one head size for q, k and v."""
    if attn != "flash_attention_2":
        return
    if shaped:
        raise KvscopeError(
            f"--attn flash_attention_2: {name} {shaped}, which that kernel is not handed; trace it with --attn sdpa"
        )
    if spec.has_sinks:
        raise KvscopeError(
            f"--attn flash_attention_2: {name}'s learned sinks are not a column that kernel computes; "
            "trace it with --attn sdpa (kvscope then computes its output with the sinks)"
        )
    if spec.v_dim != spec.head_dim:
        raise KvscopeError(
            f"--attn flash_attention_2: {name}'s value heads ({spec.v_dim}) differ in size from its query and key "
            f"heads ({spec.head_dim}); trace it with --attn sdpa"
        )
