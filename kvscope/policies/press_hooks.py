"""kvpress's presses on the model itself: the press's own forward hook on the model's own
attention modules, and what it leaves in the cache read back ([presses](concepts.md#presses)).

kvpress registers ``press.forward_hook`` on every attention module (``BasePress.__call__``) and
compresses the cache the hook finds in the module's keyword arguments. transformers 5.25 hands
its attention modules ``cache`` (no ``past_key_values``, no ``cache_position``); kvscope's hook
wraps the press's and hands it what it reads, nothing patched:

    past_key_values   the cache the press compresses: the model's own DynamicCache, or — under a
                      live PolicyCache — a mirror DynamicCache of what the press holds
    cache_position    the new rows' indices in that cache (``is_prefilling`` reads it)
    output[1]         attention weights ``[1, H, n, n]`` by kvscope's attention rule for presses
                      that read them (ObservedAttention; kvscope's and sdpa's kernels give none)
    module.rotary_emb the model's rotary embedding, set on each module for the session (as
                      ``BasePress.__call__`` does) and removed afterwards

What a press keeps is read from the press: the index of the last ``gather`` it applies to a
layer's keys (a ``GatherRecorder``), rows it cuts off the end (KVzip's reconstruction),
and ``module.masked_key_indices`` (AdaKV, KVzip, CriticalAdaKV: masked rows count as evicted).
What it leaves — re-rotated keys (KeyRerotation, Finch), merged values (Merging, CAM), zeroed
key channels (ThinK) — is compared with what it was handed (``read_back``).

kvpress's protocol where a press needs more than its hook: KVzip and KVgrad reconstruct the
context with extra forwards over the prefilled cache, then mask (``compress_post``); FastKVzip
masks after the prefill. ``pressed_prefill`` runs a prompt's prefill this way and returns the
cache the press left (``PressedCache``): offline replay takes its decision from there, and
forced replay serves it as the continuation's past.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Self

import numpy as np

from ..errors import KvscopeError, first_line

_MODULES = threading.RLock()  # held while a press runs on a model's modules offline
SEED = 0  # torch's generator is seeded with it for every press session (LeverageScore sketches at random)


# -- what a press kept ---------------------------------------------------------------------------
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


@dataclass
class PressedCache:
    """The cache a press left after a prompt's prefill (``pressed_prefill``):

    layers        [layer] ``PressedLayer``
    prompt_keys   [layer] keys ``[kv_head, P, D]`` the prefill computed, before the press
    first_position  the position the continuation's first token takes: ``P``, or the rows kept
                  where the press re-numbers them (KeyRerotation, Finch: kvpress's protocol)
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


def read_back(rows, before_k, before_v, saved_k, saved_v, after_k, after_v, index) -> PressedLayer:
    """What a press did to one layer: ``rows [kv_head, n]`` the positions of the rows it was
    handed (``before_k, before_v [1, kv_head, n, D]``; ``saved_*`` their contents before the hook,
    which may change them in place), ``after_*`` what the layer holds after it, ``index`` the last
    gather it applied to ``before_k`` along the rows (or None)."""
    import torch

    if index is not None and index.shape == after_k.shape:
        chosen = index[0, :, :, 0]  # [kv_head, n_kept] rows of the handed cache
    elif after_k.shape == before_k.shape:
        chosen = torch.arange(before_k.shape[2], device=rows.device).expand(before_k.shape[1], -1)
    elif after_k.shape[2] < before_k.shape[2] and _same(after_k, saved_k[:, :, : after_k.shape[2]]):
        chosen = torch.arange(after_k.shape[2], device=rows.device).expand(before_k.shape[1], -1)  # cut off the end
    else:
        chosen = _matched_rows(saved_k, saved_v, after_k, after_v)
    idx = chosen[None, :, :, None].expand(-1, -1, -1, saved_k.shape[-1])
    original_k, original_v = saved_k.gather(2, idx), saved_v.gather(2, idx)
    pruned = None
    rewrote_keys = not _same(after_k, original_k)
    if rewrote_keys and after_k.shape == original_k.shape:
        zeroed = (after_k[0] == 0).all(1) & (original_k[0] != 0).any(1)  # [kv_head, D]
        if zeroed.any() and _same(
            after_k[0].masked_fill(zeroed[:, None], 0), original_k[0].masked_fill(zeroed[:, None], 0)
        ):
            pruned, rewrote_keys = zeroed, False
    return PressedLayer(
        positions=rows.gather(1, chosen.to(rows.device)),
        keys=after_k[0],
        values=after_v[0],
        present=torch.ones(chosen.shape, dtype=torch.bool, device=rows.device),
        rewrote_keys=rewrote_keys,
        rewrote_values=not _same(after_v, original_v),
        pruned_channels=pruned,
    )


def _same(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


def _matched_rows(saved_k, saved_v, after_k, after_v):
    """``[kv_head, n_kept]`` the handed rows equal to each row a press left without a gather
    (a slice, a concatenation, a boolean index): each must match exactly one row, key and value."""
    import torch

    heads = []
    for h in range(after_k.shape[1]):
        same = (after_k[0, h][:, None] == saved_k[0, h][None]).all(-1) & (
            after_v[0, h][:, None] == saved_v[0, h][None]
        ).all(-1)  # [kept, handed]
        if not bool((same.sum(1) == 1).all()):
            raise KvscopeError("the press rewrote the cache without a gather kvscope can follow (rows it kept differ)")
        heads.append(same.float().argmax(1))
    return torch.stack(heads)


def masked(module, n_heads: int, n_rows: int):
    """``[kv_head, n_rows]`` False where ``module.masked_key_indices`` (batch 1) masks a row."""
    import torch

    indices = module.__dict__.get("masked_key_indices")
    present = torch.ones((n_heads, n_rows), dtype=torch.bool)
    if indices is not None:
        _, heads, rows = (torch.as_tensor(t).cpu() for t in indices)
        present[heads, rows] = False
    return present


# -- the press's hook on the model's attention modules ----------------------------------------------
def attention_modules(model) -> list:
    """The attention module of every decoder layer (kvpress's rule: ``model.model.layers``, or the
    language model's of a multimodal model)."""
    return [layer.self_attn for layer in language_model(model).layers]


def language_model(model):
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


def rerotates(press) -> bool:
    """kvpress's pipeline rule: after these presses the continuation is numbered from the rows kept."""
    kvpress = _kvpress()
    return isinstance(press, kvpress.KeyRerotationPress) or (
        isinstance(press, kvpress.FinchPress) and press.rerotate_keys
    )


def decodes(press) -> bool:
    """The press acts on decode forwards too (kvpress's pipeline keeps its hooks while decoding)."""
    kvpress = _kvpress()
    return isinstance(press, (kvpress.DecodingPress, kvpress.PrefillDecodingPress)) or (
        isinstance(press, kvpress.DMSPress) and press.decoding
    )


def runs_the_model(press) -> bool:
    """The press's protocol runs the model beyond the prefill's forward (context reconstruction,
    repeated context) or finishes after it (``compress_post``)."""
    kvpress = _kvpress()
    return isinstance(press, (kvpress.KVzipPress, kvpress.FastKVzipPress, kvpress.KVComposePress))


def hooked_prefill(press) -> bool:
    """The press's hook runs on the prefill's forward (KVzip's only on its reconstruction forwards)."""
    return not isinstance(press, _kvpress().KVzipPress)


def _kvpress():
    from .kvpress_load import load

    return load()


class PressHooks:
    """``press``'s forward hook on every attention module of ``model``, adapted to transformers
    ≥ 5.25 (module docstring), for the forwards whose cache ``serve`` names. ``spec``: the
    model's ``ModelSpec`` (attention weights for presses that read them).

    Per layer it keeps ``rows[layer] [kv_head, n]``, the prompt position of every row of the cache
    the press holds, and after each hook the layer's ``PressedLayer`` in ``decided``."""

    def __init__(self, model, press, spec, attentions: bool = False):
        self.model, self.press, self.spec, self.attentions = model, press, spec, attentions
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
        model saves changes) and ``masked_key_indices = None`` (kvpress's attention sets it so at
        every prefill)."""
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

        new = torch.as_tensor(positions, dtype=torch.long).expand(self.spec.n_kv_heads, -1)
        self.rows[layer] = new.clone() if self.rows[layer] is None else torch.cat([self.rows[layer], new], 1)

    def take(self) -> dict[int, PressedLayer]:
        """The layers decided since the last call, with their masks read (and cleared)."""
        decided, self.decided = self.decided, {}
        for layer, result in decided.items():
            result.present = result.present & masked(self.modules[layer], *result.positions.shape).to(
                result.present.device
            )
            self.modules[layer].__dict__["masked_key_indices"] = None
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
        weights = weights_of(self.spec, module, kwargs, cache.layers[layer].keys) if self.attentions else None
        if layer == 0:  # each forward's hooks draw from the seeded generator, as PrefillCapture.decide's
            self._rng = _rng_state(hidden_device := kwargs["hidden_states"].device)
            _seed(hidden_device)
        try:
            result = run_hook(self.press, module, args, kwargs, output, cache, self.rows[layer], weights)
        finally:
            if layer == len(self.modules) - 1 and self._rng is not None:
                _restore_rng(*self._rng)
                self._rng = None
        if result is not None:
            self.rows[layer] = result.positions
            self.decided[layer] = result
        return output

    def _next(self, layer: int, q: int):
        """Positions of ``q`` rows a forward appended that nobody announced: after the last one."""
        last = int(self.rows[layer].max()) + 1 if self.rows[layer].numel() else 0
        return _arange(q) + last


def _rng_state(device):
    import torch

    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda, device


def _seed(device) -> None:
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


def run_hook(press, module, args, kwargs, output, cache, rows, weights=None) -> PressedLayer | None:
    """``press.forward_hook`` on ``module`` over ``cache`` (a DynamicCache whose layer holds the rows
    at positions ``rows [kv_head, n]``), handed what transformers 5.25 no longer passes (module
    docstring); returns what it did to the layer (None: nothing)."""
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
    unchanged = after_k is before_k and after_v is before_v and _same(after_k, saved_k) and _same(after_v, saved_v)
    if unchanged and module.__dict__.get("masked_key_indices") is None:
        return None
    return read_back(rows, before_k, before_v, saved_k, saved_v, after_k, after_v, recorder.index)


def weights_of(spec, module, kwargs, keys):
    """``[1, H, q, n]`` a forward's attention weights by kvscope's rule (for presses that read
    them): queries from the module (kvpress's ``get_prerope_query_states``, then RoPE), ``keys
    [1, kv_head, n, D]`` from the cache."""
    import torch
    from kvpress.utils import get_prerope_query_states
    from transformers.models.llama.modeling_llama import rotate_half

    from ..model.attention import grouped

    hidden = kwargs["hidden_states"]
    queries = get_prerope_query_states(module, hidden)  # [1, H, q, D]
    cos, sin = kwargs["position_embeddings"]
    queries = queries * cos.unsqueeze(1) + rotate_half(queries) * sin.unsqueeze(1)
    h, q, n = queries.shape[1], queries.shape[2], keys.shape[2]
    layer = int(module.layer_idx)
    rows = grouped(queries[0].float(), spec.n_kv_heads)  # [kv_head, group·q, D]
    device = keys.device
    q_pos = (torch.arange(q, device=device) + n - q).repeat(h // spec.n_kv_heads)[:, None]
    probs = spec.rule(layer).probs(rows, keys[0].float(), q_pos, torch.arange(n, device=device))
    return probs.reshape(1, h, q, n).to(hidden.dtype)


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


# -- kvpress's protocol after the prefill -------------------------------------------------------------
def finish_prefill(hooks: PressHooks, cache, prompt_ids, tokenizer=None) -> None:
    """What the press's protocol does once the prompt is prefilled into ``cache`` (a DynamicCache
    the hooks serve): KVzip and KVgrad reconstruct the context and mask, FastKVzip masks; every
    layer is then decided (its masks read by ``PressHooks.take``)."""
    kvpress = _kvpress()
    press, model = hooks.press, hooks.model
    if isinstance(press, kvpress.KVzipPress):
        if press.compression_ratio == 0:
            return
        try:
            reconstruct(hooks, cache, prompt_ids, tokenizer)
            press.compress_post(model)
        finally:
            press._reset_internal_parameters()
    elif isinstance(press, kvpress.FastKVzipPress):
        press.compress_post(model)
    elif isinstance(press, kvpress.KVComposePress):
        compose(hooks, cache, prompt_ids)
        return
    else:
        return
    _all_decided(hooks.decided, hooks.rows, cache)


def compose(hooks: PressHooks, cache, prompt_ids) -> None:
    """KVCompose's protocol (``KVComposePress.__call__``): the context runs again over its prefilled
    cache, each layer's hook gathering how the context's queries attend to it (weights by kvscope's
    rule: ``hooks`` reads them), then the press chooses what each layer keeps and compresses the
    cache (structured: the same count for every head of a layer; otherwise masks)."""
    import torch

    press, model = hooks.press, hooks.model
    p = len(prompt_ids)
    ids = torch.as_tensor([list(prompt_ids)], device=next(model.parameters()).device)
    press._register_model(model)
    press.register_context_ids(ids)
    handed = [(layer.keys[:, :, :p].clone(), layer.values[:, :, :p].clone()) for layer in cache.layers]
    hooks.serve(cache, cache)
    try:
        language_model(model)(input_ids=ids, cache=cache)
        press._register_cache(cache)
        press.prepare_important_masks()
        press.compress_cache(model)
    finally:
        press._reset_state()
    for layer, (keys, values) in enumerate(handed):
        rows = hooks.rows[layer][:, :p]
        after = cache.layers[layer]
        if after.keys.shape[2] > p:  # unstructured: masks over the context; the repeat is cut off
            after.keys, after.values = after.keys[:, :, :p], after.values[:, :, :p]
        hooks.rows[layer] = rows
        result = read_back(rows, keys, values, keys, values, after.keys, after.values, None)
        hooks.rows[layer] = result.positions
        hooks.decided[layer] = result


def _all_decided(decided: dict, rows: list, cache) -> None:
    for layer in range(len(rows)):  # masks set after the hooks ran: every layer is decided
        if layer not in decided:
            keys, values = cache.layers[layer].keys, cache.layers[layer].values
            decided[layer] = PressedLayer(rows[layer], keys[0], values[0], _ones(rows[layer]))


def _ones(rows):
    import torch

    return torch.ones(rows.shape, dtype=torch.bool, device=rows.device)


def reconstruct(hooks: PressHooks, cache, prompt_ids, tokenizer=None) -> None:
    """``_reconstruct``, transformers' note on KVgrad's ``past_key_values`` (renamed ``cache``) silenced."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        _reconstruct(hooks, cache, prompt_ids, tokenizer)


def _reconstruct(hooks: PressHooks, cache, prompt_ids, tokenizer=None) -> None:
    """KVzip's context reconstruction (``KVzipPress.__call__`` and ``_perform_kvzip_compression``,
    whose hook transformers 5.25 needs adapted): the repeat prompts run over the prefilled
    ``cache``, each layer's hook scores the context into ``press.score_val`` and cuts the repeat
    off. KVgrad's own scoring (its hooks read nothing 5.25 lacks) runs as it is."""
    import torch

    kvpress = _kvpress()
    press, model = hooks.press, hooks.model
    tokenizer = tokenizer or _tokenizer(model)
    press.prefix_length, press._suffix_ids = _kvzip_affixes(tokenizer)
    press._context_ids = torch.as_tensor([list(prompt_ids)])
    press._cache = cache
    if isinstance(press, kvpress.KVgradPress):
        press._cache = _read_only_adapting(cache)
        with hooks.paused():  # its own hooks score (and mask); kvpress's KVzip hook must not run beside them
            press._perform_kvzip_compression(model, tokenizer)
        return
    press.context_length = press._context_ids.shape[1]
    pairs = press.prepare(model, tokenizer)
    press.start_idx = press.prefix_length
    device = next(model.parameters()).device
    hooks.serve(cache, cache)
    for prefill_ids, repeat_ids in pairs:
        press.end_idx = press.start_idx + prefill_ids.shape[1]
        language_model(model)(input_ids=repeat_ids.to(device), cache=cache)
        press.start_idx = press.end_idx


def _read_only_adapting(cache):
    """``cache``'s layers in a DynamicCache whose read-only layers (KVgrad's ``read_only_cache``
    puts them in place) take the ``kwargs`` transformers 5.25 hands every layer update."""
    from transformers import DynamicCache

    class Adapting(DynamicCache):
        def __setattr__(self, name, value):
            if name == "layers":
                for layer in value:
                    if type(layer).__name__ == "ReadOnlyDynamicLayer" and "update" not in vars(layer):
                        layer.update = _without_kwargs(layer.update)
            super().__setattr__(name, value)

    adapted = Adapting.__new__(Adapting)
    adapted.__dict__.update(cache.__dict__)
    return adapted


def _without_kwargs(update):
    def adapted(key_states, value_states, *args, kwargs=None, **rest):
        return update(key_states, value_states, *args, **rest)

    return adapted


def _kvzip_affixes(tokenizer):
    """``(prefix length, suffix ids)`` of the reconstruction prompt, as ``KVzipPress.__call__``
    derives them from the tokenizer's chat template."""
    if tokenizer.chat_template is None:
        prefix_text, suffix_text = "", "\n"
    else:
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": dummy + separator}], add_generation_prompt=True, tokenize=False,
            enable_thinking=False,
        )  # fmt: skip
        context, suffix_text = text.split(separator)
        prefix_text = context.split(dummy)[0]
    prefix = tokenizer.encode(prefix_text, return_tensors="pt", add_special_tokens=False).shape[-1]
    return prefix, tokenizer.encode(suffix_text, return_tensors="pt", add_special_tokens=False)


def _tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model.config.name_or_path)


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
    is refused naming the asset (``kvscope.policies.press_assets``)."""
    from .press_assets import prepare_assets

    prepare_assets(press, model, asset)
    if isinstance(press, _kvpress().KVComposePress):
        press._register_model(model)  # as its __call__ does before the prefill


class PrefillCapture:
    """A prompt's prefill run once, and what each layer's hook is handed kept (its module's
    arguments, its keys and values), so that any press decides at any budget without another
    forward: ``decide`` runs the press's hook on every layer in order, as the forward would,
    then its protocol's masks. KVzip and KVgrad reconstruct the context once per configuration
    (their scores do not depend on the ratio); each ``decide`` masks from those scores.

    ``prompt_keys [layer]`` ``[kv_head, P, D]``: the keys the prefill computed. ``forward()``: runs
    the prefill and returns its cache (a caller's own prefill of these ids, the hooks kept meanwhile:
    one forward serves both); default the language model's forward."""

    def __init__(self, model, prompt_ids, spec=None, tokenizer=None, forward=None):
        import torch
        from transformers import DynamicCache

        from ..model.spec import ModelSpec

        self.model, self.prompt_ids, self.tokenizer = model, list(prompt_ids), tokenizer
        self.spec = spec or ModelSpec.from_model(model)
        self.modules = attention_modules(model)
        self.device = next(model.parameters()).device
        self.calls: list = [None] * len(self.modules)  # [layer] (args, kwargs without the cache, output)
        self._scores: dict = {}  # KVzip's and KVgrad's score_val by their configuration

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
        """KVzip's (KVgrad's) scores of this prompt, its reconstruction forwards run once per configuration."""
        import dataclasses as dc

        import torch

        key = (
            type(press).__name__,
            *((f.name, getattr(press, f.name)) for f in dc.fields(press) if f.name != "compression_ratio"),
        )
        if key not in self._scores:
            ratio = press.compression_ratio
            press.compression_ratio = 0.5  # the hook scores whatever the ratio; the masks come later
            hooks = PressHooks(self.model, press, self.spec)
            try:
                with torch.no_grad(), seeded(self.device), hooks:
                    reconstruct(hooks, self._cache(), self.prompt_ids, self.tokenizer)
                    self._scores[key] = press.score_val.clone()
            finally:
                press._reset_internal_parameters()
                press.compression_ratio = ratio
        return self._scores[key]

    def decide(self, press, attentions: bool = False, asset: str | None = None) -> PressedCache:
        """The cache ``press`` (a fresh one, set to its budget) leaves after this prefill;
        ``attentions``: it reads the layer's attention weights; ``asset``: a local folder of its
        learned asset."""
        kvpress = _kvpress()
        post_init(press, self.model, asset)
        cache = self._cache()
        rows = [_arange(self.prompt_len).expand(k.shape[1], -1).to(k.device) for k in self.keys]
        decided: dict[int, PressedLayer] = {}
        masks_after = isinstance(press, (kvpress.KVzipPress, kvpress.FastKVzipPress))
        with _MODULES:  # the model's modules and torch's generator are shared by the replay's threads
            return self._decide(press, attentions, asset, cache, rows, decided, masks_after)

    def _decide(self, press, attentions, asset, cache, rows, decided, masks_after) -> PressedCache:
        import torch

        kvpress = _kvpress()
        saved = _attach(self.model, self.modules)
        try:
            with torch.no_grad(), seeded(self.device):
                if isinstance(press, kvpress.FastKVzipPress):
                    press.score_val = [None] * len(self.modules)
                if hooked_prefill(press):
                    for layer, module in enumerate(self.modules):
                        args, kwargs, output = self.calls[layer]
                        kwargs = {**kwargs, "cache": cache}
                        keys = cache.layers[layer].keys
                        weights = weights_of(self.spec, module, kwargs, keys) if attentions else None
                        result = run_hook(press, module, args, kwargs, output, cache, rows[layer], weights)
                        if result is not None:
                            decided[layer] = result
                elif press.compression_ratio > 0:
                    press.score_val = self._reconstructed(press).clone()
                    press.compress_post(self.model)
                if isinstance(press, kvpress.FastKVzipPress):
                    press.compress_post(self.model)
                if isinstance(press, kvpress.KVComposePress):  # its protocol forward, on this budget's cache
                    hooks = PressHooks(self.model, press, self.spec, attentions=True)
                    hooks.rows = list(rows)
                    with hooks:
                        compose(hooks, cache, self.prompt_ids)
                    decided.update(hooks.decided)
            if masks_after:
                _all_decided(decided, rows, cache)
            for layer, result in decided.items():
                present = masked(self.modules[layer], *result.positions.shape)
                result.present = result.present & present.to(result.present.device)
        finally:
            _detach(self.modules, saved)
            if isinstance(press, kvpress.KVzipPress):
                press._reset_internal_parameters()
        layers = []
        for layer in range(len(self.modules)):
            if layer in decided:
                layers.append(decided[layer])
            else:
                k, v = cache.layers[layer].keys, cache.layers[layer].values
                layers.append(PressedLayer(rows[layer], k[0], v[0], _ones(rows[layer])))
        first = int(layers[0].positions.shape[1]) if rerotates(press) else self.prompt_len
        return PressedCache(layers, self.prompt_keys, self.prompt_len, first)


def _attach(model, modules) -> list:
    """What ``PressHooks.install`` sets on the modules, without the hooks; returns what was there."""
    rotary = getattr(language_model(model), "rotary_emb", None)
    saved = []
    for module in modules:
        saved.append({k: module.__dict__[k] for k in ("rotary_emb", "masked_key_indices") if k in module.__dict__})
        if rotary is not None:
            module.__dict__["rotary_emb"] = rotary
        module.__dict__["masked_key_indices"] = None
    return saved


def _detach(modules, saved) -> None:
    for module, kept in zip(modules, saved):
        for key in ("rotary_emb", "masked_key_indices"):
            module.__dict__.pop(key, None)
        module.__dict__.update(kept)


def pressed_prefill(
    model, prompt_ids, press, spec=None, tokenizer=None, attentions: bool = False, asset: str | None = None
) -> PressedCache:
    """The cache ``press`` leaves after the prompt's prefill on ``model`` (its hook on every
    attention module, its protocol after it): per layer the rows it kept, as it left them, and
    the keys the prefill computed before it. What forced replay serves as the continuation's past
    ([forced replay](concepts.md#forced-replay)); ``press`` is set up for ``model`` here (a fresh one per call)."""
    return PrefillCapture(model, prompt_ids, spec, tokenizer).decide(press, attentions, asset)
