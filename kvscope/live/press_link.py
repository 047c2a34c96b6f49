"""A live policy cache's kvpress press: the press's own forward hook on the model's own attention
modules (``PressHooks``), compressing a mirror of what it
holds, and the cache made to serve what the press left ([presses](concepts.md#presses)).

    prefill forward   every layer's prompt K/V enters the mirror (a DynamicCache) as the cache
                      takes them; after the layer's attention the press's hook compresses the
                      mirror's layer, as under kvpress (KVzip: after the forward, its
                      reconstruction forwards over the mirror, then its masks)
    after the forward the positions the press holds become the state's tiers (the rest EVICTED),
                      and the rows it rewrote (re-rotated or channel-pruned keys, merged values)
                      replace the cache's rows: the continuation sees what the press left
    decode forwards   only for presses that act while decoding (DecodingPress, …): the new row
                      enters the mirror and the hook runs again; other presses' hooks and the
                      mirror are gone after the prefill

A press that re-rotates what it keeps (KeyRerotation, Finch) numbers the continuation from the
rows it kept, as kvpress's pipeline does: the cache reports that many positions to transformers,
which numbers the next token from it.
"""

from __future__ import annotations

import weakref

import torch

from ..policies import press_protocol
from ..policies.press_hooks import seeded
from ..policies.press_run import language_model
from ..policies.press_traits import decodes, hooked_prefill, rerotates


class PressLink:
    """The press of ``cache`` (a ``PolicyCache``) on ``model`` (a transformers model whose
    ``ModelSpec`` is ``model_spec``)."""

    def __init__(self, cache, model, policy, model_spec):
        from transformers import DynamicCache

        self._cache = weakref.ref(cache)
        self.model = model
        self.hooks = policy.hooks(model, model_spec)
        self.press = self.hooks.press
        self.mirror = DynamicCache(config=model.config)
        self.decodes = decodes(self.press)
        if hooked_prefill(self.press):
            self.hooks.serve(cache, self.mirror)
        self.hooks.serve(self.mirror, self.mirror)  # the protocol's own forwards (KVzip)
        self.prompt_ids: list[int] | None = None
        self._prompt = language_model(model).register_forward_pre_hook(self._prompt_of, with_kwargs=True)
        self._closed = weakref.finalize(cache, _close, self.hooks, self._prompt)

    def _prompt_of(self, module, args, kwargs):
        if self.prompt_ids is None and kwargs.get("cache") is self._cache() and kwargs.get("input_ids") is not None:
            self.prompt_ids = kwargs["input_ids"][0].tolist()

    def close(self) -> None:
        """The hooks removed, the mirror dropped (after the prefill of a prompt press)."""
        self._closed()
        self.mirror = None

    @property
    def open(self) -> bool:
        return self.mirror is not None

    def scratch_bytes(self) -> int:
        """The mirror's bytes (held between forwards by presses that decode)."""
        if self.mirror is None:
            return 0
        return sum(int(t.nbytes) for layer in self.mirror.layers for t in (layer.keys, layer.values) if t is not None)

    def entered(self, layer: int, keys, values, n_new: int) -> None:
        """A forward's new rows of ``layer`` (as the cache stores them) enter the mirror."""
        if self.mirror is None:
            return
        cache = self._cache()
        dtype = cache.kv_dtype
        self.mirror.update(keys.to(dtype), values.to(dtype), layer)
        self.hooks.appended(layer, torch.arange(cache.seen - n_new, cache.seen))

    def decided(self, prefill: bool) -> dict:
        """The forward's decisions (the protocol's too, after the prompt), handed to the state."""
        if self.mirror is None:
            return {}
        cache = self._cache()
        if prefill:
            with torch.no_grad(), seeded(cache.device):
                press_protocol.finish(self.hooks, self.mirror, self.prompt_ids or [])
        decided = self.hooks.take()
        cache.state.take(decided)
        if prefill and rerotates(self.press) and decided:
            kept = {int(result.present.sum(-1).max()) for result in decided.values()}
            cache.position_shift = cache.seen - max(kept)
        if prefill and not self.decodes:
            self.close()
        return decided

    def rewrite(self, decided: dict) -> None:
        """The rows the press rewrote replace the cache's (after the cache dropped what it evicted)."""
        cache = self._cache()
        for layer, result in decided.items():
            if not (result.rewrites or result.pruned_channels is not None):
                continue
            present = result.present.cpu()
            heads = torch.arange(present.shape[0])[:, None].expand_as(present)[present]
            positions = result.positions.cpu()[present]
            keys, values = result.keys[present], result.values[present]  # [n, D]
            cache.rewrite_rows(layer, heads, positions, keys, values=values, pruned_channels=result.pruned_channels)


def _close(hooks, prompt_hook) -> None:
    hooks.remove()
    prompt_hook.remove()
