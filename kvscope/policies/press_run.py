"""The one runner of a press: kvpress's ``forward_hook`` on one attention module's call, and what
it kept read back ([presses](concepts.md#presses)). Every way a press decides goes through
``run_hook`` — the live forward (``PressHooks``), a recorded module call of the trace's model
(``PrefillCapture``), a module call built from recorded q/k/v (``StandInRunner``) — which hands
the hook what transformers 5.25 no longer passes:

    past_key_values   the cache the press compresses (a DynamicCache, or the stand-ins' cache)
    cache_position    the new rows' indices in that cache (``is_prefilling`` reads it)
    output[1]         attention weights ``[1, H, q, n]`` by kvscope's rule (``attention_weights``)
                      for presses that read them; kvscope's and sdpa's kernels give none

What a press keeps is read from what it did: the index of the last ``gather`` it applied to a
layer's keys (``GatherRecorder``), rows it cut off the end (KVzip's reconstruction), and the
layer's masks (``kvscope.policies.kvpress_adapter.masks``: masked rows count as evicted). What
it left — re-rotated keys, merged values, zeroed key channels — is compared with what it was
handed (``read_back``). A press's own error is reported as its error, naming the press and layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import KvscopeError, first_line
from .kvpress_adapter import masks


@dataclass
class PressedLayer:
    """What a press left in one layer's cache (batch 1):

    positions  [kv_head, n]      the prompt position of each row it left, in its order
    keys       [kv_head, n, D]   the rows as it left them (re-rotated, channel-pruned, …)
    values     [kv_head, n, D]
    present    [kv_head, n]      False where the press masks the row (it counts as evicted)
    """

    positions: object
    keys: object
    values: object
    present: object
    rewrote_keys: bool = False  # the kept keys differ from the keys it was handed
    rewrote_values: bool = False
    pruned_channels: object = None  # [kv_head, D] bool: key channels zeroed in every row (ThinK), or None

    @property
    def rewrites(self) -> bool:
        return self.rewrote_keys or self.rewrote_values

    @property
    def rewritten(self) -> set[str]:
        """What it rewrote of the rows it kept: ``keys``, ``values``, both or neither."""
        return {name for name, done in (("keys", self.rewrote_keys), ("values", self.rewrote_values)) if done}

    def held(self, length: int) -> np.ndarray:
        """``[kv_head, length]`` True at the positions the layer holds (present rows)."""
        positions = self.positions.cpu().numpy()
        out = np.zeros((positions.shape[0], length), dtype=bool)
        present = self.present.cpu().numpy()
        heads = np.broadcast_to(np.arange(positions.shape[0])[:, None], positions.shape)
        out[heads[present], positions[present]] = True
        return out

    def channel_counts(self) -> np.ndarray:
        """``[kv_head]`` key channels pruned (0 without channel pruning)."""
        if self.pruned_channels is None:
            return np.zeros(self.positions.shape[0], dtype=np.int64)
        return self.pruned_channels.sum(-1).cpu().numpy().astype(np.int64)

    def mask(self, module) -> None:
        """The rows ``module``'s masks mark count as evicted."""
        present = masked(module, *self.positions.shape)
        self.present = self.present & present.to(self.present.device)


@dataclass
class PressedCache:
    """The cache a press left after a prompt's prefill (``pressed_prefill``):

    layers        [layer] ``PressedLayer``
    prompt_keys   [layer] keys ``[kv_head, P, D]`` the prefill computed, before the press
    first_position  the position the continuation's first token takes: ``P``, or the rows kept
                  where the press re-numbers them (kvpress's protocol: ``press_traits.rerotates``)
    """

    layers: list
    prompt_keys: list
    prompt_len: int
    first_position: int

    def held(self, length: int | None = None) -> np.ndarray:
        """``[layer, kv_head, length]`` (default ``P``) True where the press holds a prompt position."""
        length = self.prompt_len if length is None else length
        return np.stack([layer.held(length) for layer in self.layers])

    def channel_counts(self) -> np.ndarray:
        """``[layer, kv_head]`` key channels pruned."""
        return np.stack([layer.channel_counts() for layer in self.layers])

    @property
    def rewrites(self) -> bool:
        return any(layer.rewrites or layer.pruned_channels is not None for layer in self.layers)


def attention_modules(model) -> list:
    """The attention module of every decoder layer of a transformers model (kvpress's rule:
    ``model.model.layers``, or the language model's of a multimodal model)."""
    return [layer.self_attn for layer in language_model(model).layers]


def language_model(model):
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


def untouched(rows, keys, values) -> PressedLayer:
    """A layer the press left as it was handed: ``rows [kv_head, n]``, ``keys, values [1, kv_head, n, D]``."""
    import torch

    return PressedLayer(rows, keys[0], values[0], torch.ones(rows.shape, dtype=torch.bool, device=rows.device))


def read_back(rows, *, before_k, before_v, saved_k, saved_v, after_k, after_v, index=None) -> PressedLayer:
    """What a press did to one layer: ``rows [kv_head, n]`` the positions of the rows it was
    handed (``before_k, before_v [1, kv_head, n, D]``; ``saved_*`` their contents before the hook,
    which may change them in place), ``after_*`` what the layer holds after it, ``index`` the last
    gather it applied to ``before_k`` along the rows (or None)."""
    import torch

    if index is not None and index.shape == after_k.shape:
        chosen = index[0, :, :, 0]  # [kv_head, n_kept] rows of the handed cache
    elif after_k.shape == before_k.shape:
        chosen = torch.arange(before_k.shape[2], device=rows.device).expand(before_k.shape[1], -1)
    elif after_k.shape[2] < before_k.shape[2] and same(after_k, saved_k[:, :, : after_k.shape[2]]):
        chosen = torch.arange(after_k.shape[2], device=rows.device).expand(before_k.shape[1], -1)  # cut off the end
    else:
        chosen = _matched_rows(saved_k, saved_v, after_k, after_v)
    idx = chosen[None, :, :, None].expand(-1, -1, -1, saved_k.shape[-1])
    original_k, original_v = saved_k.gather(2, idx), saved_v.gather(2, idx)
    pruned = None
    rewrote_keys = not same(after_k, original_k)
    if rewrote_keys and after_k.shape == original_k.shape:
        zeroed = (after_k[0] == 0).all(1) & (original_k[0] != 0).any(1)  # [kv_head, D]
        if zeroed.any() and same(
            after_k[0].masked_fill(zeroed[:, None], 0), original_k[0].masked_fill(zeroed[:, None], 0)
        ):
            pruned, rewrote_keys = zeroed, False
    return PressedLayer(
        positions=rows.gather(1, chosen.to(rows.device)),
        keys=after_k[0],
        values=after_v[0],
        present=torch.ones(chosen.shape, dtype=torch.bool, device=rows.device),
        rewrote_keys=rewrote_keys,
        rewrote_values=not same(after_v, original_v),
        pruned_channels=pruned,
    )


def same(a, b) -> bool:
    """The two tensors are equal in shape and every element."""
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


def _matched_rows(saved_k, saved_v, after_k, after_v):
    """``[kv_head, n_kept]`` the handed rows equal to each row a press left without a gather
    (a slice, a concatenation, a boolean index): each must match exactly one row, key and value."""
    import torch

    heads = []
    for h in range(after_k.shape[1]):
        equal = (after_k[0, h][:, None] == saved_k[0, h][None]).all(-1) & (
            after_v[0, h][:, None] == saved_v[0, h][None]
        ).all(-1)  # [kept, handed]
        if not bool((equal.sum(1) == 1).all()):
            raise KvscopeError("the press rewrote the cache without a gather kvscope can follow (rows it kept differ)")
        heads.append(equal.float().argmax(1))
    return torch.stack(heads)


def masked(module, n_heads: int, n_rows: int):
    """``[kv_head, n_rows]`` False where the layer's masks (batch 1) mark a row."""
    import torch

    indices = masks(module)
    present = torch.ones((n_heads, n_rows), dtype=torch.bool)
    if indices is not None:
        _, heads, rows = (torch.as_tensor(t).cpu() for t in indices)
        present[heads, rows] = False
    return present


class GatherRecorder:
    """Records the index of the last ``gather`` along the position dim applied to ``keys``
    inside the ``with`` block (the positions a press keeps)."""

    def __init__(self, keys):
        self.keys, self.index = keys, None
        self._mode = None  # the torch function mode while inside the block

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


def run_hook(press, module, args, kwargs, output, cache, rows, weights=None) -> PressedLayer | None:
    """``press.forward_hook`` on ``module`` over ``cache`` (its ``layers[l].keys/values``: the rows
    at positions ``rows [kv_head, n]``), handed what transformers 5.25 no longer passes (module
    docstring); returns what it did to the layer (None: nothing). Whatever the press raises is
    reported in one line naming the press and the layer."""
    import torch

    layer = int(module.layer_idx)
    hidden = kwargs["hidden_states"]
    q, n = hidden.shape[1], cache.layers[layer].keys.shape[2]
    adapted = {**kwargs, "past_key_values": cache, "cache_position": torch.arange(n - q, n, device=hidden.device)}
    handed_output = (output[0], weights, *output[2:]) if weights is not None else output
    before_k, before_v = cache.layers[layer].keys, cache.layers[layer].values
    saved_k, saved_v = before_k.clone(), before_v.clone()  # a press may change them in place (ThinK)
    with GatherRecorder(before_k) as recorder:
        try:
            press.forward_hook(module, args, adapted, handed_output)
        except KvscopeError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever a press raises becomes one line
            raise KvscopeError(
                f"press {type(press).__name__} failed on layer {layer} ({first_line(error, named=True)})"
            ) from None
    after_k, after_v = cache.layers[layer].keys, cache.layers[layer].values
    unchanged = after_k is before_k and after_v is before_v and same(after_k, saved_k) and same(after_v, saved_v)
    if unchanged and masks(module) is None:
        return None
    return read_back(
        rows, before_k=before_k, before_v=before_v, saved_k=saved_k, saved_v=saved_v,
        after_k=after_k, after_v=after_v, index=recorder.index,
    )  # fmt: skip


def attention_weights(model_spec, layer: int, queries, keys):
    """``[1, H, q, n]`` attention weights of ``layer`` by kvscope's rule: post-RoPE ``queries
    [H, q, D]`` of the last ``q`` of ``n`` positions over ``keys [kv_head, n, D]``."""
    import torch

    from ..model.attention import grouped

    h, q, n = queries.shape[0], queries.shape[1], keys.shape[1]
    n_kv = model_spec.n_kv_heads
    rows = grouped(queries.float(), n_kv)  # [kv_head, group·q, D]
    device = keys.device
    q_pos = (torch.arange(q, device=device) + n - q).repeat(h // n_kv)[:, None]
    probs = model_spec.rule(layer).probs(rows, keys.float(), q_pos, torch.arange(n, device=device))
    return probs.reshape(1, h, q, n)


def weights_of(model_spec, module, kwargs, keys):
    """``[1, H, q, n]`` a forward's attention weights (``attention_weights``): queries from the
    module (kvpress's ``get_prerope_query_states``, then RoPE), ``keys [1, kv_head, n, D]`` from
    the cache."""
    from kvpress.utils import get_prerope_query_states
    from transformers.models.llama.modeling_llama import rotate_half

    hidden = kwargs["hidden_states"]
    queries = get_prerope_query_states(module, hidden)  # [1, H, q, D]
    cos, sin = kwargs["position_embeddings"]
    queries = queries * cos.unsqueeze(1) + rotate_half(queries) * sin.unsqueeze(1)
    return attention_weights(model_spec, int(module.layer_idx), queries[0], keys[0]).to(hidden.dtype)
