"""A press's module calls built from a recording: stand-ins of the attention layers, driven by the
one runner (``kvscope.policies.press_run.run_hook``) offline, for the presses the traits table
declares to read only q, k, v (``kvscope.policies.press_traits``). From a trace recorded with
``--record qkv``:

    module          config (heads, KV heads, layers), layer_idx, head_dim, rotary_emb
                    (cos, sin from the recorded inv_freq and attention scaling), q_proj = identity
    hidden_states   the layer's pre-RoPE queries ``[1, n, H·D]`` (recorded q with RoPE undone):
                    what ``q_proj(hidden_states)`` gives a press is exactly the model's queries
    cache           ``cache.layers[l].keys/values [1, Hkv, n, D]``: the recorded post-RoPE K/V
                    of the positions the press kept so far
    output[1]       attention ``[1, H, P, P]`` by kvscope's rule (``press_run.attention_weights``)
                    from the recorded queries, for presses that read the layer's attention weights;
                    None otherwise, as under sdpa

A press that reads what a stand-in does not hold fails naming the attribute: the table declared
it q, k, v only, and that is a bug of the table, reported as the press's error.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ..errors import KvscopeError, first_line
from .press_run import attention_weights, masked, run_hook
from .press_traits import attentions, decodes


class LayerStandIn:
    """What a press reads of one attention layer (see the module docstring); reading anything
    else raises an ``AttributeError`` that names it."""

    def __init__(self, config, layer_idx: int, head_dim: int, rotary):
        import torch

        from .kvpress_adapter import clear_masks

        self.config, self.layer_idx, self.head_dim = config, layer_idx, head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.q_proj = torch.nn.Identity()  # hidden states are the queries already
        self.rotary_emb = rotary
        self.is_sliding = False
        self.training = False
        clear_masks(self)  # as kvpress's attention leaves them at every prefill (DMS reads them)

    def __getattr__(self, name: str):
        raise AttributeError(
            f"the recorded layer has no {name!r}: the press reads more than q, k, v, which the press traits "
            "table does not say of it (kvscope.policies.press_traits)"
        )


def config_of(model_spec, attentions: bool) -> SimpleNamespace:
    """The model config a press reads (sizes only; ``_attn_implementation`` says whether the
    layer's attention weights are given, as eager does)."""
    return SimpleNamespace(
        num_attention_heads=model_spec.n_heads,
        num_key_value_heads=model_spec.n_kv_heads,
        num_hidden_layers=model_spec.n_layers,
        head_dim=model_spec.head_dim,
        hidden_size=model_spec.n_heads * model_spec.head_dim,
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


class StandInRunner:
    """One sequence's press on stand-ins of the attention layers, built from recorded tensors:
    the stand-in caches and which positions they hold:

        prefill(keys, values, queries)      keys, values [layer, kv_head, P, D] float32 tensors,
                                            queries [P, layer, head, D] post-RoPE
        append(position, keys, values)      [layer, kv_head, D]: the decode position enters
        decode(position, queries)           [layer, head, D]: the press's decode hook

    ``cache_spec`` the cache's ``CacheSpec``; ``rope`` the model's rotary parameters; ``model_spec``
    its ``ModelSpec``. What the press did
    besides dropping positions is kept: ``rewrites`` (``keys``, ``values``) and ``pruned``
    ``[layer, kv_head]`` key channels zeroed (ThinK)."""

    def __init__(self, press, cache_spec, rope, model_spec):
        import torch

        self.press, self.cache_spec, self.model_spec = press, cache_spec, model_spec
        self.label = type(press).__name__
        self.attentions = attentions(press)
        self.decodes = decodes(press)
        config = config_of(model_spec, self.attentions)
        rope = rope if rope is not None and rope.usable() else None
        self.n_rot = rope.n_rot if rope is not None else 0
        self.rope = rope
        self.modules = [
            LayerStandIn(config, layer, model_spec.head_dim, Rotary(rope, layer, model_spec.head_dim))
            for layer in range(model_spec.n_layers)
        ]
        self.cache = SimpleNamespace(layers=[SimpleNamespace(keys=None, values=None) for _ in self.modules])
        self.positions: list = [None] * model_spec.n_layers  # per layer [kv_head, n] positions in the cache
        self.rewrites: set[str] = set()
        self.pruned = np.zeros((model_spec.n_layers, model_spec.n_kv_heads), dtype=np.int64)
        try:
            press.post_init_from_model(SimpleNamespace(config=config, device=torch.device("cpu")))
        except Exception as error:  # noqa: BLE001 - the press's own error, in one line
            raise KvscopeError(
                f"press {self.label} cannot be set up on recorded q, k, v ({first_line(error, named=True)})"
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
            q = undo_rope(q, cos[:, None], sin[:, None], self.n_rot, scaling=float(self.rope.scaling[layer]))
        return torch.from_numpy(np.ascontiguousarray(q, dtype=np.float32)).reshape(1, len(positions), -1)

    def prefill(self, keys, values, queries) -> np.ndarray:
        """The prompt ``0..P−1`` in every layer (``keys, values [layer, kv_head, P, D]`` float32
        tensors, ``queries [P, layer, head, D]``), compressed by the press → present
        ``[layer, kv_head, P]``."""
        import torch

        p = keys.shape[2]
        present = np.zeros((len(self.modules), self.cache_spec.n_kv, p), dtype=bool)
        for layer, module in enumerate(self.modules):
            cache = self.cache.layers[layer]
            cache.keys = keys[layer][None].clone()  # [1, Hkv, P, D]
            cache.values = values[layer][None].clone()
            self.positions[layer] = torch.arange(p).repeat(self.cache_spec.n_kv, 1)
            q = queries[:, layer]  # [P, H, D]
            weights = None
            if self.attentions:
                recorded = torch.from_numpy(np.asarray(q, dtype=np.float32)).transpose(0, 1)  # [H, P, D]
                weights = attention_weights(self.model_spec, layer, recorded, keys[layer])
            self._hook(module, self._queries(layer, q, np.arange(p)), torch.arange(p), weights)
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
                [self.positions[layer], torch.full((self.cache_spec.n_kv, 1), position, dtype=torch.long)], dim=1
            )

    def decode(self, position: int, queries) -> np.ndarray:
        """The decode step of the query at ``position`` (``queries [layer, head, D]``) → present
        ``[layer, kv_head, position + 1]``."""
        import torch

        length = position + 1
        present = np.zeros((len(self.modules), self.cache_spec.n_kv, length), dtype=bool)
        for layer, module in enumerate(self.modules):
            hidden = self._queries(layer, queries[layer][None], np.array([position]))
            self._hook(module, hidden, torch.tensor([position]), None)
            present[layer] = self._present(layer, length)
        return present

    def _hook(self, module, hidden, positions, weights) -> None:
        """The press's hook on the layer's stand-in call (``run_hook``); what it kept is read back."""
        layer = module.layer_idx
        kwargs = {
            "hidden_states": hidden,
            "position_embeddings": module.rotary_emb(hidden, positions[None]),
            "position_ids": positions[None],
            "attention_mask": None,
        }
        result = run_hook(
            self.press, module, [], kwargs, output=(None, None), cache=self.cache, rows=self.positions[layer],
            weights=weights,
        )  # fmt: skip
        if result is None:
            return
        self.positions[layer] = result.positions
        self.rewrites |= result.rewritten
        self.pruned[layer] = result.channel_counts()

    def _present(self, layer: int, length: int) -> np.ndarray:
        """``[kv_head, length]`` positions in the layer's cache and not masked (AdaKV)."""
        positions = self.positions[layer].numpy()  # [kv_head, n]
        present = np.zeros((positions.shape[0], length), dtype=bool)
        np.put_along_axis(present, positions, masked(self.modules[layer], *positions.shape).numpy(), axis=1)
        return present
