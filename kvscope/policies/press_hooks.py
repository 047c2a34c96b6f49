"""kvpress's presses on the model itself: the press's hook on the model's own attention modules
(``PressHooks``: live, and the protocols' forwards), and a prompt's prefill recorded once so that
any press decides from its module calls (``PrefillCapture``) ([presses](concepts.md#presses)).

kvpress registers ``press.forward_hook`` on every attention module (``BasePress.__call__``) and
compresses the cache the hook finds in the module's keyword arguments. transformers 5.25 hands
its attention modules ``cache`` (no ``past_key_values``, no ``cache_position``); kvscope's hook
runs the press through the one runner (``kvscope.policies.press_run.run_hook``), which hands it
what it reads, nothing patched:

    past_key_values   the cache the press compresses: the model's own DynamicCache, or — under a
                      live PolicyCache — a mirror DynamicCache of what the press holds
    module.rotary_emb the model's rotary embedding, set on each module for the session (as
                      ``BasePress.__call__`` does) and removed afterwards

kvpress's protocol where a press needs more than its hook (KVzip's reconstruction, KVCompose's
second pass, FastKVzip's masks) is ``kvscope.policies.press_protocol.finish``, the same call live
and offline. ``pressed_prefill`` runs a prompt's prefill this way and returns the cache the press
left (``PressedCache``): offline replay takes its decision from there, and forced replay serves it
as the continuation's past.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Self

from . import kvpress_adapter as adapter
from . import press_protocol as protocol
from .press_run import PressedCache, PressedLayer, attention_modules, language_model, run_hook, weights_of
from .press_traits import RERUN_CONTEXT, hooked_prefill, rerotates
from .press_traits import attentions as reads_attentions
from .press_traits import protocol as protocol_of

_MODULES = threading.RLock()  # held while a press runs on a model's modules offline
SEED = 0  # torch's generator is seeded with it for every press session (LeverageScore sketches at random)


class PressHooks:
    """``press``'s forward hook on every attention module of ``model`` (a transformers model), for
    the forwards whose cache ``serve`` names. ``model_spec``: its ``ModelSpec`` (attention weights
    for presses that read them).

    Per layer it keeps ``rows[layer] [kv_head, n]``, the prompt position of every row of the cache
    the press holds, and after each hook the layer's ``PressedLayer`` in ``decided``."""

    def __init__(self, model, press, model_spec, attentions: bool = False):
        self.model, self.press, self.model_spec, self.attentions = model, press, model_spec, attentions
        self.modules = attention_modules(model)
        self.rows: list = [None] * len(self.modules)
        self.decided: dict[int, PressedLayer] = {}
        self._served: dict[int, object] = {}  # id(the cache a forward is handed) → the cache the press compresses
        self._handles: list = []
        self._saved: list = []
        self._rng = None  # the generator's state before this forward's hooks seeded it

    # -- lifetime --------------------------------------------------------------------------
    def install(self) -> PressHooks:
        """The hooks registered; each module carries ``rotary_emb`` (not as a submodule: nothing the
        model saves changes) and no masks (kvpress's attention clears them at every prefill)."""
        self._saved = _attach(self.model, self.modules)
        self._handles = [module.register_forward_hook(self._hook, with_kwargs=True) for module in self.modules]
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        _detach(self.modules, self._saved)
        self._handles, self._saved = [], []

    def __enter__(self) -> Self:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()

    @contextlib.contextmanager
    def installed(self):
        """The hooks registered for the block (as they are where they already were)."""
        if self._handles:
            yield self
            return
        with self:
            yield self

    def serve(self, cache, compressed) -> None:
        """Forwards handed ``cache`` run the press on ``compressed`` (a DynamicCache; the same
        cache, or a live cache's mirror)."""
        self._served[id(cache)] = compressed

    @contextlib.contextmanager
    def paused(self):
        """No forward runs the press's hook inside the block."""
        served, self._served = self._served, {}
        try:
            yield
        finally:
            self._served = served

    def appended(self, layer: int, positions) -> None:
        """Rows of ``positions [n]`` (every KV head) entered the layer's compressed cache."""
        import torch

        new = torch.as_tensor(positions, dtype=torch.long).expand(self.model_spec.n_kv_heads, -1)
        self.rows[layer] = new.clone() if self.rows[layer] is None else torch.cat([self.rows[layer], new], 1)

    def take(self) -> dict[int, PressedLayer]:
        """The layers decided since the last call, with their masks read (and cleared)."""
        decided, self.decided = self.decided, {}
        for layer, result in decided.items():
            result.mask(self.modules[layer])
            adapter.clear_masks(self.modules[layer])
        return decided

    # -- the hook ----------------------------------------------------------------------------
    def _hook(self, module, args, kwargs, output):
        handed = kwargs.get("cache", kwargs.get("past_key_values"))
        cache = self._served.get(id(handed))
        if cache is None:
            return output
        layer = int(module.layer_idx)
        q, n = kwargs["hidden_states"].shape[1], cache.layers[layer].keys.shape[2]
        if self.rows[layer] is None:  # the cache's rows are its positions
            self.appended(layer, _arange(n))
        elif self.rows[layer].shape[1] == n - q:  # rows nobody announced: after the last one
            self.appended(layer, self._next(layer, q))
        elif self.rows[layer].shape[1] != n:
            raise RuntimeError(
                f"layer {layer}: the press's cache holds {n} rows, kvscope counts {self.rows[layer].shape[1]}"
            )
        if layer == 0:  # each forward's hooks draw from the seeded generator, as PrefillCapture.decide's
            self._rng = _rng_state(kwargs["hidden_states"].device)
            _seed()
        try:
            self.run(layer, module, args, kwargs, output=output, cache=cache)
        finally:
            if layer == len(self.modules) - 1 and self._rng is not None:
                _restore_rng(*self._rng)
                self._rng = None
        return output

    def run(self, layer: int, module, args, kwargs, output, cache) -> None:
        """The press's hook on one module call over ``cache``: the layer's rows and decision follow it."""
        weights = weights_of(self.model_spec, module, kwargs, cache.layers[layer].keys) if self.attentions else None
        result = run_hook(
            self.press, module, args, kwargs, output=output, cache=cache, rows=self.rows[layer], weights=weights
        )
        if result is not None:
            self.rows[layer] = result.positions
            self.decided[layer] = result

    def _next(self, layer: int, q: int):
        """Positions of ``q`` rows a forward appended that nobody announced: after the last one."""
        last = int(self.rows[layer].max()) + 1 if self.rows[layer].numel() else 0
        return _arange(q) + last


def _rng_state(device):
    import torch

    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda, device


def _seed() -> None:
    import torch

    torch.manual_seed(SEED)


def _restore_rng(cpu, cuda, device) -> None:
    import torch

    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _arange(n: int):
    import torch

    return torch.arange(n)


# -- a prompt's prefill under a press ---------------------------------------------------------------
@contextlib.contextmanager
def seeded(device):
    """torch's generator seeded with ``SEED`` for the block, restored afterwards (presses that
    draw at random draw the same numbers live, offline and in kvpress's own run seeded alike)."""
    import torch

    devices = [device] if getattr(device, "type", "cpu") == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(SEED)
        yield


def post_init(press, model, asset: str | None = None) -> None:
    """``press.post_init_from_model(model)``: a press that loads a learned asset it cannot reach
    is refused naming the asset (``kvscope.policies.press_assets``); a press whose protocol runs
    the model is registered with it, as its ``__call__`` does before the prefill."""
    from .press_assets import prepare_assets

    prepare_assets(press, model, asset)
    if protocol_of(press) == RERUN_CONTEXT:
        adapter.register_model(press, model)


class PrefillCapture:
    """A prompt's prefill run once, and what each layer's hook is handed kept (its module's
    arguments, its keys and values), so that any press decides at any budget without another
    forward: ``decide`` runs the press's hook on every layer's recorded call in order, as the
    forward would, then its protocol (``press_protocol.finish``). A reconstructing press (KVzip,
    KVgrad) reconstructs the context once per configuration (its scores do not depend on the
    ratio); each ``decide`` masks from those scores.

    ``model`` a transformers model; ``model_spec`` its ``ModelSpec`` (default: read from it);
    ``prompt_keys [layer]`` ``[kv_head, P, D]``: the keys the prefill computed. ``forward()``: runs
    the prefill and returns its cache (a caller's own prefill of these ids, the hooks kept meanwhile:
    one forward serves both); default the language model's forward."""

    def __init__(self, model, prompt_ids, model_spec=None, tokenizer=None, forward=None):
        import torch
        from transformers import DynamicCache

        from ..model.spec import ModelSpec

        self.model, self.prompt_ids, self.tokenizer = model, list(prompt_ids), tokenizer
        self.model_spec = model_spec or ModelSpec.from_model(model)
        self.modules = attention_modules(model)
        self.device = next(model.parameters()).device
        self.calls: list = [None] * len(self.modules)  # [layer] (args, kwargs without the cache, output)
        self._scores: dict = {}  # a reconstructing press's score_val by its configuration
        self._decided: dict = {}  # (press configuration, attentions, asset) → its PressedCache

        def prefill():
            cache = DynamicCache(config=model.config)
            with torch.no_grad():
                language_model(model)(input_ids=torch.as_tensor([self.prompt_ids], device=self.device), cache=cache)
            return cache

        def keep(module, args, kwargs, output):
            kept = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}
            self.calls[int(module.layer_idx)] = (args, kept, output)

        handles = [module.register_forward_hook(keep, with_kwargs=True) for module in self.modules]
        try:
            cache = (forward or prefill)()
        finally:
            for handle in handles:
                handle.remove()
        self.keys = [layer.keys for layer in cache.layers]  # [layer] [1, kv_head, P, D]
        self.values = [layer.values for layer in cache.layers]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prompt_keys(self) -> list:
        return [k[0] for k in self.keys]

    def _cache(self):
        """A DynamicCache holding copies of the prefill's keys and values (a press may change them in place)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
            cache.layers[layer].lazy_initialization(keys, values)
            cache.layers[layer].keys, cache.layers[layer].values = keys.clone(), values.clone()
        return cache

    def _reconstructed(self, press):
        """A reconstructing press's scores of this prompt, its forwards run once per configuration."""
        import torch

        key = configuration(press, ignoring=("compression_ratio",))
        if key not in self._scores:
            ratio = press.compression_ratio
            press.compression_ratio = 0.5  # the hook scores whatever the ratio; the masks come later
            hooks = PressHooks(self.model, press, self.model_spec)
            try:
                with torch.no_grad(), seeded(self.device), hooks:
                    protocol.reconstruct(hooks, self._cache(), self.prompt_ids, self.tokenizer)
                    self._scores[key] = press.score_val.clone()
            finally:
                adapter.reset_internal(press)
                press.compression_ratio = ratio
        return self._scores[key]

    def decide(self, press, attentions: bool = False, asset: str | None = None) -> PressedCache:
        """The cache ``press`` (a fresh one, set to its budget) leaves after this prefill;
        ``attentions``: it reads the layer's attention weights (so does any the traits table says
        does); ``asset``: a local folder of its learned asset. A press configured as one before (the
        same class, fields and budget) is handed that decision: the questions of a context share its
        compression, as kvpress compresses a context once for all its questions."""
        key = (configuration(press), bool(attentions), asset)
        with _MODULES:  # the model's modules and torch's generator are shared by the replay's threads
            if key not in self._decided:
                post_init(press, self.model, asset)
                hooks = PressHooks(self.model, press, self.model_spec, attentions or reads_attentions(press))
                hooks.rows = [_arange(self.prompt_len).expand(k.shape[1], -1).to(k.device) for k in self.keys]
                self._decided[key] = self._decide(hooks)
            return self._decided[key]

    def _decide(self, hooks: PressHooks) -> PressedCache:
        import torch

        press, cache = hooks.press, self._cache()
        saved = _attach(self.model, self.modules)
        try:
            with torch.no_grad(), seeded(self.device):
                protocol.before_hooks(press, len(self.modules))
                if hooked_prefill(press):
                    for layer, module in enumerate(self.modules):
                        args, kwargs, output = self.calls[layer]
                        hooks.run(layer, module, args, {**kwargs, "cache": cache}, output=output, cache=cache)
                protocol.finish(hooks, cache, self.prompt_ids, self.tokenizer, scores=self._reconstructed)
            for layer, result in hooks.decided.items():
                result.mask(self.modules[layer])
        finally:
            _detach(self.modules, saved)
        protocol.all_decided(hooks.decided, hooks.rows, cache)  # a layer no hook changed, as it is
        layers = [hooks.decided[layer] for layer in range(len(self.modules))]
        first = int(layers[0].positions.shape[1]) if rerotates(press) else self.prompt_len
        return PressedCache(layers, self.prompt_keys, self.prompt_len, first)


def configuration(press, ignoring: tuple[str, ...] = ()) -> tuple:
    """``(class, (field, repr(value)) …)`` of every field of a press but ``ignoring`` — those kvscope
    sets after construction too (the budget's knobs, FinchPress's ``window_size``), nested presses by
    their own repr: two presses with equal configurations decide alike on one prefill."""
    import dataclasses as dc

    fields = tuple((f.name, repr(getattr(press, f.name))) for f in dc.fields(press) if f.name not in ignoring)
    return (f"{type(press).__module__}.{type(press).__qualname__}", fields)


_ATTACHED = ("rotary_emb", adapter.MASKS)  # what a session sets on each attention module


def _attach(model, modules) -> list:
    """What ``PressHooks.install`` sets on the modules, without the hooks; returns what was there."""
    rotary = getattr(language_model(model), "rotary_emb", None)
    saved = []
    for module in modules:
        saved.append({k: module.__dict__[k] for k in _ATTACHED if k in module.__dict__})
        if rotary is not None:
            module.__dict__["rotary_emb"] = rotary
        adapter.clear_masks(module)
    return saved


def _detach(modules, saved) -> None:
    for module, kept in zip(modules, saved):
        for key in _ATTACHED:
            module.__dict__.pop(key, None)
        module.__dict__.update(kept)


def pressed_prefill(
    model, prompt_ids, press, model_spec=None, tokenizer=None, attentions: bool = False, asset: str | None = None
) -> PressedCache:
    """The cache ``press`` leaves after the prompt's prefill on ``model`` (its hook on every
    attention module, its protocol after it): per layer the rows it kept, as it left them, and
    the keys the prefill computed before it. What forced replay serves as the continuation's past
    ([forced replay](concepts.md#forced-replay)); ``press`` is set up for ``model`` here (a fresh one per call)."""
    return PrefillCapture(model, prompt_ids, model_spec, tokenizer).decide(press, attentions, asset)
