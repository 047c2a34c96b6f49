"""Attention capture through transformers' ``AttentionInterface`` (docs/trace-format.md#capture).

kvscope registers one attention function per fast kernel (``kvscope_fused`` for sdpa,
``kvscope_eager``, ``kvscope_fa2`` for flash_attention_2) together with the matching
``AttentionMaskInterface`` entry. The function computes the layer output with the
kernel the user chose and, when a ``AttentionRecorder`` is active, recomputes the
probabilities of the *new query rows only* in fp32 with the attention rule of
``kvscope.model.attention`` (the layer's scaling and softcap as the model passes them; the
sliding window and padding through transformers' mask):

    a = softmax(mask(softcap(q · kᵀ · scaling)))          # [batch, head, q, kv]

Under ``attn_output="probs"`` the layer's output is computed from those probabilities
instead (``out = a·V``, ``AttentionRecorder.attend``) wherever the recorder computes all
of them — one pass over the keys instead of two, equal to the kernel's output up to float
summation order; the default ``kernel`` keeps the untraced model's outputs bit for bit.

Nothing model-specific is hooked: the function sees the real post-RoPE q/k/v of every model
that routes through ``AttentionInterface``.

Key slots are mapped to absolute positions: the keys handed to the function are always
the last ``kv`` slots of the sequence (dynamic layers return every slot, sliding-window
layers the window), so slot ``s = seq_len − kv + j`` and position ``p = s − pad[b]``
under left padding — except for the keys of a live policy cache ([`kvscope.live`][kvscope.live]),
which hands over a ``SlotView`` with its keys: the absolute position of every slot per
KV head, and which slots are padding (heads that keep fewer positions than others). The
function then masks the padding per head and scatters rows onto positions by that map.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import eager_mask, flash_attention_mask, sdpa_mask

from ..model import attention
from ..model.spec import returned_cache, with_cache
from .settings import KERNELS

# float32 probabilities per chunk of a prefill's query rows, and the fewest rows of a chunk: on a
# CPU a chunk that stays in one core's L2 (2 MiB here); on a GPU few, large launches within a
# bounded memory (64 MiB per float32 tensor of a chunk, a few of them live at once)
_CHUNK_PROBS = {"cpu": 1 << 19, "cuda": 1 << 24}
_CHUNK_MIN_ROWS = {"cpu": 16, "cuda": 64}

_ACTIVE: contextvars.ContextVar[AttentionRecorder | None] = contextvars.ContextVar(
    "kvscope_active_recorder", default=None
)


@dataclass
class SlotView:
    """What a live policy cache layer hands to the attention function with its keys."""

    keys: torch.Tensor  # the very tensor the cache layer returned (matched by identity)
    slot_pos: torch.Tensor  # [kv_head, kv] absolute position of each key slot, −1 = padding
    head_mask: torch.Tensor | None  # [kv_head, kv] bool, True = a real slot (None: no padding)
    recorder: AttentionRecorder | None = None  # the cache's own observer (rows it decides on)
    used: bool = False  # set by the attention function: the cache checks that it was seen


_LIVE: contextvars.ContextVar[SlotView | None] = contextvars.ContextVar("kvscope_live_slots", default=None)

# a layer-output function that takes over every call of the registered attention function while it
# is set (forced replay's cache emulation, kvscope.replay.forced): ``fn(module, query, key, value,
# mask, scaling, softcap, sink) -> out [batch, q, head, D]``
_OVERRIDE: contextvars.ContextVar = contextvars.ContextVar("kvscope_attention_override", default=None)


class attention_override:
    """``with attention_override(fn):`` every layer that attends through kvscope's function calls
    ``fn`` instead, with the same arguments the function was given (scaling resolved, the learned
    sink logits as ``sink``)."""

    def __init__(self, fn):
        self.fn, self.token = fn, None

    def __enter__(self):
        self.token = _OVERRIDE.set(self.fn)
        return self.fn

    def __exit__(self, *exc):
        _OVERRIDE.reset(self.token)


def offer_slots(view: SlotView | None) -> None:
    """Called by a live cache layer's ``update`` right before the layer's attention."""
    _LIVE.set(view)


def _slot_view(key: torch.Tensor) -> SlotView | None:
    view = _LIVE.get()
    return view if view is not None and view.keys is key else None


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[batch, kv_head, T, D] -> [batch, kv_head·n_rep, T, D] (query-head order)."""
    if n_rep == 1:
        return x
    b, h_kv, t, d = x.shape
    return x[:, :, None].expand(b, h_kv, n_rep, t, d).reshape(b, h_kv * n_rep, t, d)


def mask_terms(mask: torch.Tensor | None, q_offset: int, q_len: int, kv_len: int, full_q_len: int, device):
    """transformers' ``mask`` (bool: True = attend; float: additive) for the rows
    ``q_offset … q_offset + q_len`` as ``(visible, bias)`` for ``kvscope.model.attention.softmax``.
    ``None`` with more than one query row means sdpa's upper-left causal alignment (docs/trace-format.md#capture)."""
    if mask is None:
        if full_q_len == 1:
            return None, None
        rows = torch.arange(q_offset, q_offset + q_len, device=device)[:, None]
        return attention.visible(rows, torch.arange(kv_len, device=device)), None
    block = mask[..., q_offset : q_offset + q_len, :]
    return (block, None) if block.dtype == torch.bool else (None, block)


def attention_probs(
    query: torch.Tensor,  # [batch, head, q, D]
    key: torch.Tensor,  # [batch, kv_head, kv, D]
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
    q_offset: int = 0,
    full_q_len: int | None = None,
    sink: torch.Tensor | None = None,  # [head] learned sink logits
) -> torch.Tensor:
    """fp32 probabilities [batch, head, q, kv] of ``query`` rows against ``key`` (the rule of
    ``kvscope.model.attention``; the heads of a GQA group stacked as rows, keys never copied:
    logits of the model's dtype accumulated in float32, ``kvscope.model.attention.matmul_float32``).
    Rows whose every key is masked (left-padding query rows) come out as zeros, not NaN."""
    b, h, r, _ = query.shape
    n_kv, kv = key.shape[1], key.shape[2]
    logits = attention.logits(attention.grouped(query, n_kv), key, scaling, softcap, float32=True).view(b, h, r, kv)
    visible, bias = mask_terms(mask, q_offset, q_len=r, kv_len=kv, full_q_len=full_q_len or r, device=query.device)
    return attention.softmax(logits, visible, bias, sink=None if sink is None else sink.view(1, h, 1, 1))


@dataclass
class ForwardContext:
    """What the recorder must know about the forward pass about to run."""

    seq_len: int  # sequence slots after this forward (cache + new tokens)
    pad: torch.Tensor  # [batch] left padding of each row, in slots

    def __post_init__(self):
        self.padded = bool(self.pad.any())


@dataclass
class LayerCapture:
    """What one layer yields for one forward pass (shapes at ``heads`` resolution Hs)."""

    colsum: torch.Tensor | None = None  # [batch, Hs, seq_len] prefill column sums
    tail: torch.Tensor | None = None  # [batch, Hs, obs, seq_len] last obs_window prefill rows
    q: torch.Tensor | None = None  # [batch, head, q, D] post-RoPE queries of the new rows (the model's dtype)
    k: torch.Tensor | None = None  # [batch, kv_head, q, D] post-RoPE keys of the new slots
    v: torch.Tensor | None = None  # [batch, kv_head, q, D]


@dataclass
class AttentionRecorder:
    """Collects the probabilities of the new query rows, per layer, for one forward.

    ``heads``: ``all`` keeps every query head, ``kv`` averages the heads that share a KV
    head (a kv-group row, still sums to 1), ``mean`` averages all heads (one row).
    ``attn_output``: ``kernel`` leaves the layer's output to the model's kernel; ``probs``
    lets ``attend`` compute it from the recorded probabilities wherever the recorder
    computes all of them (decode rows, unpadded causal prefills).

    ``probabilities``: False keeps only the forward's q/k/v (``record_qkv``) and computes no
    probability (a prefill whose attention nobody reads).

    ``n_units``: the cache units of a layer that kv-group rows average over (the model spec's
    ``n_kv_heads``; 1 under multi-head latent attention, whose keys are per query head); None:
    the heads of the keys. ``layer_slots``: the model's layer index → stored layer (a hybrid
    model's attention layers); None: the same index. ``chunk_rows``: query rows per chunk of a
    prefill's capture (``chunk_rows_for``); None: as many as the device's budget holds.
    """

    n_layers: int
    n_stored_heads: int  # Hs
    heads: str = "kv"
    obs_window: int = 32
    record_qkv: bool = False
    chunk_rows: int | None = None
    attn_output: str = "kernel"  # one of ATTN_OUTPUTS
    enabled: bool = True
    probabilities: bool = True
    n_units: int | None = None
    layer_slots: dict[int, int] | None = None
    ctx: ForwardContext | None = None
    layers: dict[int, LayerCapture] = field(default_factory=dict)
    rows: torch.Tensor | None = None  # [batch, layer, Hs, seq_len] last query row of each layer, by absolute pos

    def begin(self, ctx: ForwardContext) -> None:
        self.ctx = ctx
        self.layers = {}
        self.rows = None

    def active(self) -> _Activation:
        return _Activation(self)

    # -- reductions --------------------------------------------------------------
    def _reduce_heads(self, x: torch.Tensor, n_kv: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """[batch, head, ...] -> [batch, Hs, ...], written into ``out`` when given (``n_kv``:
        the heads of the keys; kv-group rows average over the cache units' groups)."""
        n_kv = self.n_units or n_kv
        if self.heads == "all":
            return x if out is None else out.copy_(x)
        if self.heads == "mean":
            return x.mean(dim=1, keepdim=True) if out is None else torch.mean(x, dim=1, keepdim=True, out=out)
        b, h = x.shape[:2]
        grouped = x.reshape(b, n_kv, h // n_kv, *x.shape[2:])
        return grouped.mean(dim=2) if out is None else torch.mean(grouped, dim=2, out=out)

    def _to_positions(self, x: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Scatter key slots (last dim, length kv) onto absolute positions [.., seq_len]."""
        ctx = self.ctx
        if kv_len == ctx.seq_len and not ctx.padded:
            return x
        slots = torch.arange(ctx.seq_len - kv_len, ctx.seq_len, device=x.device)
        pos = slots[None, :] - ctx.pad.to(x.device)[:, None]  # [batch, kv]
        bshape = (pos.shape[0],) + (1,) * (x.dim() - 2) + (kv_len,)
        index = pos.clamp(min=0).view(bshape).expand_as(x)
        src = torch.where((pos >= 0).view(bshape), x, torch.zeros((), dtype=x.dtype, device=x.device))
        out = torch.zeros((*x.shape[:-1], ctx.seq_len), dtype=x.dtype, device=x.device)
        return out.scatter_add_(-1, index, src)

    # -- the hook ------------------------------------------------------------------
    def observe(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,  # [batch, head, q, D]
        key: torch.Tensor,  # [batch, kv_head, kv, D]
        value: torch.Tensor,  # [batch, kv_head, kv, D]
        mask: torch.Tensor | None,
        scaling: float,
        softcap: float | None,
        slot_pos: torch.Tensor | None = None,  # [kv_head, kv] positions of a live cache's slots
        probs: torch.Tensor | None = None,  # [batch, head, 1, kv] a decode row already computed
        blocks: tuple[torch.Tensor, torch.Tensor] | None = None,  # a causal prefill's (colsum, tail) already computed
        sink: torch.Tensor | None = None,  # [head] learned sink logits
    ) -> None:
        ctx = self.ctx
        if ctx is None or not self.enabled:
            return
        layer = self.slot(module)
        b, h, q_len, _ = query.shape
        n_kv, kv_len = key.shape[1], key.shape[2]
        if not self.probabilities:
            self.layers[layer] = self._qkv(LayerCapture(), query, key, value, q_len=q_len)
            return
        if slot_pos is not None and q_len == 1:
            if probs is None:
                probs = attention_probs(query, key, mask, scaling=scaling, softcap=softcap, sink=sink)
            probs = probs[:, :, 0]  # [batch, head, kv]
            if self.rows is None:
                self.rows = torch.zeros((b, self.n_layers, self.n_stored_heads, ctx.seq_len), device=query.device)
            if self.heads == "kv":  # a group's heads share its KV head's slots: averaged before placing
                _place(self._reduce_heads(probs, n_kv), slot_pos, self.rows[:, layer])
            else:
                by_pos = torch.zeros((b, h, ctx.seq_len), device=query.device)
                _place(probs, slot_pos.repeat_interleave(h // n_kv, dim=0), by_pos)
                self._reduce_heads(by_pos, n_kv, out=self.rows[:, layer])
            cap = LayerCapture()
            if self.record_qkv:  # the new key sits in the last slot of every head
                cap.q, cap.k, cap.v = query.detach(), key[:, :, -1:].detach(), value[:, :, -1:].detach()
            self.layers[layer] = cap
            return
        if kv_len > ctx.seq_len:
            raise RuntimeError(
                f"layer {layer}: {kv_len} keys for a sequence of {ctx.seq_len} slots; "
                "kvscope traces with a DynamicCache only"
            )
        if q_len == 1 and ctx.seq_len > 1:  # a decode row (a one-token prompt is a prefill: its row fills every slot)
            if probs is None:
                probs = attention_probs(query, key, mask, scaling=scaling, softcap=softcap, sink=sink)
            probs = probs[:, :, 0]  # [batch, head, kv]
            if self.rows is None:
                self.rows = torch.zeros((b, self.n_layers, self.n_stored_heads, ctx.seq_len), device=query.device)
            if kv_len == ctx.seq_len and not ctx.padded:
                self._reduce_heads(probs, n_kv, out=self.rows[:, layer])
            else:
                self.rows[:, layer] = self._to_positions(self._reduce_heads(probs, n_kv), kv_len)
            cap = LayerCapture()
        else:
            cap = LayerCapture()
            cap.colsum, cap.tail, row = self._prefill(
                query, key, mask, scaling=scaling, softcap=softcap, n_kv=n_kv, blocks=blocks, sink=sink
            )
            if self.rows is None:
                self.rows = torch.zeros((b, self.n_layers, self.n_stored_heads, ctx.seq_len), device=query.device)
            self.rows[:, layer] = self._to_positions(row, kv_len)
        self.layers[layer] = self._qkv(cap, query, key, value, q_len=q_len)

    def _qkv(self, cap: LayerCapture, query, key, value, q_len: int) -> LayerCapture:
        """``cap`` with the forward's queries and its ``q_len`` new keys and values (under ``record_qkv``)."""
        if self.record_qkv:
            cap.q, cap.k, cap.v = query.detach(), key[:, :, -q_len:].detach(), value[:, :, -q_len:].detach()
        return cap

    def prompt_attention(self) -> tuple:
        """``colsum [L, Hs, P]`` float64 and ``tail [L, Hs, obs, P]`` float32 (numpy, NaN as 0) of
        the prompt this recorder saw, every stored layer (batch row 0)."""
        import numpy as np

        caps = [self.layers[layer] for layer in range(self.n_layers)]
        colsum = torch.stack([c.colsum[0] for c in caps]).float().cpu().numpy().astype(np.float64)
        tail = torch.stack([c.tail[0] for c in caps]).float().cpu().numpy()
        return np.nan_to_num(colsum), np.nan_to_num(tail)

    def forward_tensors(self) -> tuple:
        """``keys, values [layer, kv_head, n, D]`` float32 tensors and ``queries [n, layer, head,
        D]`` (numpy, post-RoPE) of the forward's ``n`` new positions (batch row 0), as attention
        was handed them — what a trace under ``--record qkv`` stores (needs ``record_qkv``)."""
        import numpy as np

        caps = [self.layers[layer] for layer in range(self.n_layers)]
        keys = torch.stack([c.k[0] for c in caps]).cpu()  # [layer, kv_head, n, D]
        values = torch.stack([c.v[0] for c in caps]).cpu()
        queries = torch.stack([c.q[0] for c in caps], dim=2).cpu().numpy()  # [head, n, layer, D]
        return keys, values, np.ascontiguousarray(queries.transpose(1, 2, 0, 3))  # [n, layer, head, D]

    def slot(self, module) -> int:
        """The stored layer of an attention module (its ``layer_idx`` in the model)."""
        return self.slot_of(int(module.layer_idx))

    def slot_of(self, layer: int) -> int:
        """The stored layer of the model's layer ``layer``."""
        return layer if self.layer_slots is None else self.layer_slots[layer]

    def attend(self, module, query, key, value, mask, scaling, softcap, sink=None) -> torch.Tensor | None:
        """The layer's output ``[batch, q, head, D]`` from the probabilities the recorder
        computes anyway, the forward recorded as by ``observe`` (when enabled):

            out = a.to(value.dtype) · V          # a: the rule's fp32 probabilities (eager's convention)

        one pass over K and V instead of the kernel's and the capture's. ``None`` — the kernel
        computes the output — under ``attn_output="kernel"`` and where the recorder does not
        compute every probability of the forward (a padded, windowed or cached-slot prefill).
        The output equals the kernel's up to float summation order; computed whether or not
        the recorder is enabled, so a resumed trace regenerates the same tokens."""
        ctx = self.ctx
        if self.attn_output == "kernel" or ctx is None:
            return None
        if query.shape[2] == 1 and ctx.seq_len > 1:
            out, probs = _observed_row(query, key, value, mask, scaling=scaling, softcap=softcap, sink=sink)
            self.observe(module, query, key, value, mask=mask, scaling=scaling, softcap=softcap, probs=probs, sink=sink)
            return out
        prefilled = self.causal_prefill(query, key, value, mask, scaling=scaling, softcap=softcap, sink=sink)
        if prefilled is None:
            return None
        out, blocks = prefilled
        self.observe(module, query, key, value, mask=mask, scaling=scaling, softcap=softcap, blocks=blocks, sink=sink)
        return out

    def causal_prefill(self, query, key, value, mask, scaling, softcap, sink=None):
        """``(out [batch, P, head, D], (colsum, tail))`` of an unpadded causal prefill from one
        blocked pass (``_causal_blocks``): the output ``a · V`` made of the probabilities the
        column sums are summed from. None for any other forward (the kernel's output then)."""
        b, h, q_len, _ = query.shape
        if self.ctx is None or not self._is_causal_prefill(mask, q_len, key.shape[2]):
            return None
        out = torch.empty(
            (b, q_len, h, value.shape[-1]), dtype=value.dtype, device=value.device
        )  # [batch, q, head, Dv]
        blocks = self._causal_blocks(
            query, key, scaling=scaling, softcap=softcap, n_kv=key.shape[1], value=value, out=out, sink=sink
        )
        return out, blocks

    def prompt_blocks(self, query, key, mask, scaling, softcap, sink=None):
        """``(colsum, tail)`` of an unpadded causal prefill (``_causal_blocks``, probabilities only:
        the layer's output stays the kernel's), or None for any other forward."""
        if self.ctx is None or not self._is_causal_prefill(mask, query.shape[2], key.shape[2]):
            return None
        return self._causal_blocks(query, key, scaling=scaling, softcap=softcap, n_kv=key.shape[1], sink=sink)

    def _is_causal_prefill(self, mask, q_len: int, kv_len: int) -> bool:
        """An unpadded causal prefill: no mask tensor (sdpa's upper-left causal), ``q`` queries on ``q`` keys."""
        return mask is None and not self.ctx.padded and kv_len == q_len

    def _prefill(self, query, key, mask, scaling, softcap, n_kv, blocks=None, sink=None):
        """Column sums, last ``obs_window`` rows and the last row of the prompt (``blocks``:
        the causal prefill's ``(colsum, tail)`` when ``attend`` computed them)."""
        if blocks is None:
            blocks = self.prompt_blocks(query, key, mask, scaling=scaling, softcap=softcap, sink=sink)
        if blocks is None:
            blocks = self._masked_blocks(query, key, mask, scaling=scaling, softcap=softcap, sink=sink)
        colsum, tail = blocks
        return self._prefill_rows(colsum, tail, n_kv, key.shape[2])

    def _prefill_rows(self, colsum, tail, n_kv: int, kv_len: int):
        """``(colsum [batch, head, kv], tail [batch, head, obs, kv])`` by key slot → the stored
        heads by position, and the last prompt row (step 0) by key slot."""
        ctx, n_obs = self.ctx, self.obs_window
        pad = ctx.pad.to(tail.device)
        # query positions before the start of a (left-padded) prompt are not rows
        tail_slots = torch.arange(ctx.seq_len - n_obs, ctx.seq_len, device=tail.device)
        tail = tail.masked_fill((tail_slots[None, :] < pad[:, None])[:, None, :, None], float("nan"))
        tail = self._reduce_heads(tail, n_kv)
        return (
            self._to_positions(self._reduce_heads(colsum, n_kv), kv_len),
            self._to_positions(tail, kv_len),
            tail[:, :, -1],  # [batch, Hs, kv] the last prompt row = step 0, by key slot
        )

    def observe_weights(self, layer: int, weights: torch.Tensor) -> None:
        """Stored layer ``layer`` from the model's own probabilities of this forward's query rows
        ``weights [batch, head, q, kv]`` (``output_attentions``): a model whose attention does not
        call kvscope's function (``kvscope.tracing.architecture``). Decode rows and the
        prompt's column sums and tail as ``observe`` keeps them."""
        ctx = self.ctx
        if ctx is None or not self.enabled:
            return
        w = weights.detach().to(torch.float32)
        b, h, q_len, kv_len = w.shape
        if self.rows is None:
            self.rows = torch.zeros((b, self.n_layers, self.n_stored_heads, ctx.seq_len), device=w.device)
        cap = LayerCapture()
        if q_len == 1 and ctx.seq_len > 1:
            self.rows[:, layer] = self._to_positions(self._reduce_heads(w[:, :, 0], h), kv_len)
        else:
            cap.colsum, cap.tail, row = self._prefill_rows(*self._weight_blocks(w), h, kv_len)
            self.rows[:, layer] = self._to_positions(row, kv_len)
        self.layers[layer] = cap

    def _weight_blocks(self, w: torch.Tensor):
        """``(colsum [batch, head, kv], tail [batch, head, obs, kv])`` of a prompt's probabilities
        ``w [batch, head, q, kv]``: the column sums over the rows of real (not padding) queries."""
        ctx, n_obs = self.ctx, self.obs_window
        b, h, q_len, kv_len = w.shape
        slots = torch.arange(ctx.seq_len - q_len, ctx.seq_len, device=w.device)
        real = (slots[None, :] >= ctx.pad.to(w.device)[:, None]).to(w.dtype)  # [batch, q]
        colsum = torch.einsum("bhrk,br->bhk", w, real)
        tail = torch.zeros((b, h, n_obs, kv_len), dtype=w.dtype, device=w.device)
        rows = min(n_obs, q_len)
        tail[:, :, n_obs - rows :] = w[:, :, q_len - rows :]
        return colsum, tail

    def chunk_rows_for(self, heads: int, kv_len: int, device: torch.device) -> int:
        """Query rows per chunk of a prefill's capture, each chunk a ``[heads, rows, ≤ kv_len]``
        block of float32 probabilities: ``chunk_rows`` where set, else as many as the device's
        budget holds (``_CHUNK_PROBS``, at least ``_CHUNK_MIN_ROWS``) — never the whole
        ``[heads, P, P]`` matrix of a long prompt."""
        if self.chunk_rows is not None:
            return self.chunk_rows
        kind = "cpu" if device.type == "cpu" else "cuda"
        return max(_CHUNK_MIN_ROWS[kind], _CHUNK_PROBS[kind] // (heads * kv_len))

    def _causal_blocks(self, query, key, scaling, softcap, n_kv, value=None, out=None, sink=None):
        """``(colsum [batch, head, P], tail [batch, head, obs, P])`` of an unpadded causal
        prefill (no mask tensor, ``P`` queries on ``P`` keys): ``colsum[k] = Σ_r a[r, k]``;
        with ``value`` and ``out [batch, P, head, Dv]`` (the layout a layer's output takes), ``out``
        filled with ``a · V`` as well; ``sink [head]``: learned sink logits.

        Blocks of ``n`` rows (``chunk_rows_for``) see the keys ``0 … r1 − 1`` only; of those,
        only the block's diagonal square has keys to hide (``k > r``), so no mask is built. The
        heads of a GQA group are stacked as rows of one matmul on their shared keys, in the
        model's dtype with float32 accumulation (no copies of K); the column sums and tail rows
        are reduced on the device, block by block."""
        b, h, P, d = query.shape
        g, n_obs = h // n_kv, self.obs_window
        keys = key.reshape(b * n_kv, P, d)
        colsum = torch.zeros((b * n_kv, g, P), dtype=torch.float32, device=query.device)  # [batch·kv_head, group, P]
        tail = torch.zeros((b, h, n_obs, P), dtype=torch.float32, device=query.device)
        n = min(P, self.chunk_rows_for(h, P, query.device))
        above = torch.ones((n, n), dtype=torch.bool, device=query.device).triu_(1)  # [row, key]: k > r
        dv = d if value is None else value.shape[-1]
        values = None if out is None else value.reshape(b * n_kv, P, dv)  # [batch·kv_head, P, Dv]
        column = None if sink is None else sink.view(n_kv, g, 1, 1).repeat(b, 1, 1, 1)  # [batch·kv_head, group, 1, 1]
        for r0 in range(0, P, n):
            r1 = min(P, r0 + n)
            rows = query[:, :, r0:r1].reshape(b * n_kv, g * (r1 - r0), d)
            scores = attention.logits(rows, keys[:, :r1], scaling, softcap, float32=True).view(b * n_kv, g, r1 - r0, r1)
            scores[..., r0:].masked_fill_(above[: r1 - r0, : r1 - r0], float("-inf"))
            probs = attention.softmax(scores, sink=column)  # [batch·kv_head, group, rows, r1]
            colsum[..., :r1] += probs.sum(2)
            if values is not None:  # the group's rows on their shared values, weights in the value's dtype
                weights = probs.view(b * n_kv, g * (r1 - r0), r1).to(values.dtype)
                rows_out = torch.matmul(weights, values[:, :r1]).view((b, n_kv, g, r1 - r0, dv))
                out[:, r0:r1].view((b, r1 - r0, n_kv, g, dv)).copy_(rows_out.permute(0, 3, 1, 2, 4))
            t0 = max(r0, P - n_obs)  # tail row o holds query slot P − n_obs + o
            if t0 < r1:
                o0 = t0 - (P - n_obs)
                tail[:, :, o0 : o0 + (r1 - t0), :r1] = probs.view(b, h, r1 - r0, r1)[:, :, t0 - r0 :]
        return colsum.view(b, h, P), tail

    def _masked_blocks(self, query, key, mask, scaling, softcap, sink=None):
        """``(colsum [batch, head, kv], tail [batch, head, obs, kv])`` under transformers' mask
        (padding, sliding windows, a prefill after cached slots), ``chunk_rows_for`` rows at a time."""
        ctx = self.ctx
        b, h, q_len, _ = query.shape
        kv_len = key.shape[2]
        first_slot = ctx.seq_len - q_len  # slot of query row 0
        pad = ctx.pad.to(query.device)
        n_obs = self.obs_window
        colsum = torch.zeros((b, h, kv_len), dtype=torch.float32, device=query.device)
        tail = torch.zeros((b, h, n_obs, kv_len), dtype=torch.float32, device=query.device)
        n = self.chunk_rows_for(h, kv_len, query.device)
        for r0 in range(0, q_len, n):
            r1 = min(q_len, r0 + n)
            # causal: rows r0..r1-1 see no key beyond slot (kv_len - q_len) + r1 - 1
            kv_end = kv_len - q_len + r1
            block_mask = None if mask is None else mask[..., :kv_end]
            probs = attention_probs(
                query[:, :, r0:r1],
                key[:, :, :kv_end],
                block_mask,
                scaling=scaling,
                softcap=softcap,
                q_offset=r0,
                full_q_len=q_len,
                sink=sink,
            )  # [batch, head, rows, kv_end]
            if ctx.padded:
                slots = torch.arange(first_slot + r0, first_slot + r1, device=query.device)
                real = (slots[None, :] >= pad[:, None]).to(torch.float32)  # [batch, rows]
                colsum[..., :kv_end] += torch.einsum("bhrk,br->bhk", probs, real)
            else:
                colsum[..., :kv_end] += probs.sum(2)
            # tail row o holds query slot seq_len - n_obs + o
            t0 = max(r0, q_len - n_obs)
            if t0 < r1:
                o0 = t0 - (q_len - n_obs)
                tail[:, :, o0 : o0 + (r1 - t0), :kv_end] = probs[:, :, t0 - r0 :]
        return colsum, tail


@dataclass(frozen=True)
class LayerSeen:
    """What one attention module handed the attention function in a probe forward."""

    heads: int  # query heads
    key_heads: int  # heads of the keys and values
    head_dim: int  # of queries and keys
    v_dim: int
    scaling: float  # the softmax scaling it passed (a model may scale its queries itself and pass 1)
    softcap: float | None
    sink: bool  # a learned sink logit per head (``s_aux``)
    kwargs: frozenset[str]  # the other keyword arguments that carried a tensor
    visible: torch.Tensor | None  # [q, kv] bool: what the mask lets each query see (None: no mask, causal)


@dataclass
class Probe:
    """The attention modules that call the registered attention function, by ``layer_idx``."""

    n_tokens: int = 0  # the probe's tokens (keys beyond them: compressed or memory entries)
    layers: dict[int, LayerSeen] = field(default_factory=dict)
    unnamed: int = 0  # calls from modules without a layer index
    mask_bias: bool = False  # a float mask with values besides 0 and −∞/min: a position bias (Falcon's ALiBi)
    shared: dict[int, int] = field(
        default_factory=dict
    )  # layer → the earlier layer whose keys it reads (−1: its cache holds none)
    repeated: set[int] = field(default_factory=set)  # layers that attend more than once per forward (looped)
    extra_keys: dict[int, int] = field(default_factory=dict)  # layer → keys handed over beyond the tokens
    cache: bool = True  # the forward returned a transformers Cache
    cached_heads: dict[int, int] = field(default_factory=dict)  # layer → the KV heads its cache layer holds
    # data pointer → (the layer that had it first, its keys: held, so that no later tensor reuses the memory)
    _keys: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict, repr=False)

    def saw(self, module, query, key, value, mask, scaling, softcap, kwargs) -> None:
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int) or layer < 0:  # (−1: a block shared by several layers, Zamba2's)
            self.unnamed += 1
            return
        if layer in self.layers:
            self.repeated.add(layer)
        if key.shape[2] > self.n_tokens:
            self.extra_keys[layer] = key.shape[2] - self.n_tokens
        owner, _ = self._keys.setdefault(key.data_ptr(), (layer, key))
        if owner != layer:
            self.shared[layer] = owner
        tensors = frozenset(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k != "s_aux")
        self.layers[layer] = LayerSeen(
            heads=query.shape[1],
            key_heads=key.shape[1],
            head_dim=query.shape[-1],
            v_dim=value.shape[-1],
            scaling=float(scaling),
            softcap=softcap,
            sink=kwargs.get("s_aux") is not None,
            kwargs=tensors,
            visible=self._visible(mask),
        )

    def _visible(self, mask) -> torch.Tensor | None:
        """``[q, kv]``: what the mask lets each query row see (in any batch row and head); a float
        mask's values besides 0 and its hiding minimum mark a bias."""
        if not isinstance(mask, torch.Tensor):
            return None
        rows = mask.reshape(-1, *mask.shape[-2:])  # [batch·head, q, kv]
        if mask.dtype == torch.bool:
            return rows.any(0).cpu()
        shown = rows > torch.finfo(mask.dtype).min / 2
        self.mask_bias |= bool((rows[shown] != 0).any())
        return shown.any(0).cpu()


_PROBE: contextvars.ContextVar[Probe | None] = contextvars.ContextVar("kvscope_probe", default=None)
PROBE_TOKENS = 24  # enough for a mask that selects keys (a sparse pattern, a small window) to show it


def _prefill(model, n_tokens: int, **extra):
    """A forward of ``n_tokens`` tokens with a cache, as a trace's prefill calls it."""
    device = next(model.parameters()).device
    ids = torch.ones((1, n_tokens), dtype=torch.long, device=device)
    with torch.no_grad():
        return model(input_ids=ids, position_ids=torch.arange(n_tokens, device=device)[None], use_cache=True, **extra)


def _decode_step(model, out, n_tokens: int, **extra) -> None:
    """The decode step a trace runs after the prefill ``out`` (a model that fails it fails here,
    and so does one that decodes on a cache of its own instead of the one it is handed)."""
    cache = returned_cache(out)
    device = next(model.parameters()).device
    with torch.no_grad():
        step = model(
            input_ids=torch.ones((1, 1), dtype=torch.long, device=device),
            position_ids=torch.full((1, 1), n_tokens, device=device),
            use_cache=True,
            **with_cache(model, cache),
            **extra,
        )
    if cache is not None and returned_cache(step) is not cache:
        raise RuntimeError(
            "the decode step did not use the cache it was handed (a transformers version kvscope does not know?)"
        )


def weights_probe(model, n_tokens: int = PROBE_TOKENS) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]:
    """What ``model`` returns with ``output_attentions=True`` from a forward of ``n_tokens``: the
    shapes ``[batch, head, q, kv]`` of its attention probabilities and ``[batch, kv_head, kv, D]``
    of the keys its cache holds, by layer (layers that return none left out); a decode step then
    runs as a trace's would."""
    out = _prefill(model, n_tokens, output_attentions=True)
    weights = getattr(out, "attentions", None) or ()
    shapes = {layer: tuple(w.shape) for layer, w in enumerate(weights) if isinstance(w, torch.Tensor) and w.dim() == 4}
    cache = returned_cache(out)
    keys = {}
    for layer, cached in enumerate(getattr(cache, "layers", None) or ()):
        k = getattr(cached, "keys", None)
        if isinstance(k, torch.Tensor) and k.dim() == 4:
            keys[layer] = tuple(k.shape)
    _decode_step(model, out, n_tokens, output_attentions=True)
    return shapes, keys


def probe(model, n_tokens: int = PROBE_TOKENS) -> Probe:
    """Which of ``model``'s layers attend through kvscope's attention function, and with what:
    one forward of ``n_tokens`` tokens with the function registered (nothing recorded), then a
    decode step as a trace's. The model must already use a kvscope implementation
    (``implementation_name``)."""
    from transformers import Cache

    seen = Probe(n_tokens=n_tokens)
    token = _PROBE.set(seen)
    try:
        out = _prefill(model, n_tokens)
    finally:
        _PROBE.reset(token)
    seen._keys.clear()  # the keys were held for the forward only
    cache = returned_cache(out)
    seen.cache = isinstance(cache, Cache)
    if seen.cache:  # an attention layer whose cache layer holds no keys reads another layer's
        for layer in seen.layers:
            cached = cache.layers[layer] if layer < len(cache.layers) else None
            if getattr(cached, "keys", None) is None or not cached.keys.numel():
                seen.shared.setdefault(layer, -1)
            elif cached.keys.dim() == 4:
                seen.cached_heads[layer] = cached.keys.shape[1]
        _decode_step(model, out, n_tokens)
    return seen


def _place(x: torch.Tensor, slot_pos: torch.Tensor, out: torch.Tensor) -> None:
    """Add ``x [batch, n, kv]`` (values of a live cache's key slots) into the zeros ``out
    [batch, n, seq_len]`` at each slot's position ``slot_pos [n, kv]``. A position is held by
    at most one slot of a head, so each value lands as it is; a padding slot (−1) is masked
    per head, its probability exactly 0, and adds that 0 to position 0 (``p + 0 = p``)."""
    out.scatter_add_(-1, slot_pos.clamp(min=0)[None].expand(x.shape), x)


class _Activation:
    def __init__(self, recorder: AttentionRecorder):
        self.recorder = recorder
        self.token = None

    def __enter__(self):
        self.token = _ACTIVE.set(self.recorder)
        return self.recorder

    def __exit__(self, *exc):
        _ACTIVE.reset(self.token)


# -- registered attention functions ---------------------------------------------------


def _eager_output(query, key, value, mask, scaling, softcap, dropout=0.0, training=False, sink=None):
    """Generic eager attention in the query's dtype: the rule's logits, then the mask the way
    transformers' per-model eager functions apply it (so outputs match them bit for bit);
    ``sink [head]``: learned sink logits, one more softmax column (gpt-oss's eager)."""
    n_rep = query.shape[1] // key.shape[1]
    scores = attention.logits(query, repeat_kv(key, n_rep), scaling, softcap)
    if mask is None and query.shape[2] > 1:
        q_len = query.shape[2]
        mask, _ = mask_terms(None, 0, q_len=q_len, kv_len=key.shape[2], full_q_len=q_len, device=query.device)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    v = repeat_kv(value, n_rep)
    if sink is not None:
        column = sink.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, column], -1), dim=-1, dtype=torch.float32)[..., :-1]
        weights = weights.to(query.dtype)
    else:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout and training:
        weights = torch.nn.functional.dropout(weights, p=dropout, training=True)
    out = torch.matmul(weights, v)
    return out.transpose(1, 2).contiguous()


def _per_head_mask(head_mask, n_heads, q_len, mask):
    """A live cache's ``head_mask [kv_head, kv]`` as a bool mask ``[1, head, q, kv]`` (query
    heads of a group share their KV head's slots), combined with transformers' ``mask``."""
    n_kv, kv = head_mask.shape
    out = head_mask.repeat_interleave(n_heads // n_kv, dim=0)[None, :, None, :].expand(1, n_heads, q_len, kv)
    if mask is None:
        return out
    if mask.dtype == torch.bool:
        return out & mask[..., -kv:]
    return out & (mask[..., -kv:] == 0)


def _masked_output(query, key, value, mask, scaling, softcap, sink=None):
    """Attention output ``[batch, q, head, D]`` with a per-head bool ``mask`` (any kernel)."""
    if softcap is not None or sink is not None:
        return _eager_output(query, key, value, mask, scaling=scaling, softcap=softcap, sink=sink)
    n_rep = query.shape[1] // key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, n_rep), repeat_kv(value, n_rep), attn_mask=mask, scale=scaling
    )
    return out.transpose(1, 2).contiguous()


def _observed_row(query, key, value, mask, scaling, softcap, sink=None):
    """One decode row computed once, for a live cache whose policy observes it or a trace
    under ``attn_output="probs"``: ``(out [batch, 1, head, D], probs [batch, head, 1, kv])`` —
    ``probs`` by the rule (fp32, the row observed), ``out = probs · V`` in the value's dtype
    (eager's convention: weights cast to the value's dtype), the heads of a GQA group as rows
    of one matmul on their shared values. The kernel's output would need the same keys read
    a second time."""
    b, h, r, _ = query.shape
    n_kv, kv = key.shape[1], key.shape[2]
    probs = attention_probs(query, key, mask, scaling=scaling, softcap=softcap, sink=sink)
    grouped = probs.view(b, n_kv, (h // n_kv) * r, kv).to(value.dtype)  # [batch, kv_head, group·1, kv]
    out = torch.matmul(grouped, value).view(b, h, r, value.shape[-1])
    return out.transpose(1, 2).contiguous(), probs


def _base_forward(kernel: str):
    """The layer-output function of ``kernel``, resolved once (not per call)."""
    if kernel == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as fast
    elif kernel == "flash_attention_2":
        from transformers.integrations.flash_attention import flash_attention_forward as fast
    else:
        fast = None

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        sink = kwargs.get("s_aux")
        if fast is None or (kernel == "sdpa" and (softcap is not None or sink is not None)):
            # eager by choice, or softcapping or a learned sink, which sdpa cannot apply: eager math
            return _eager_output(
                query,
                key,
                value,
                attention_mask,
                scaling=scaling,
                softcap=softcap,
                dropout=dropout,
                training=module.training,
                sink=sink,
            )
        if kernel == "sdpa":
            return fast(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)[0]
        return fast(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, softcap=softcap, **kwargs
        )[0]

    return forward


def _capturing(kernel: str):
    base = _base_forward(kernel)

    # transformers' registered-function order (sdpa, flash): ``dropout`` sixth, then ``scaling`` — a
    # wrapper that passes ``dropout`` by position (kvpress's attention patch, applied to every
    # registered function when kvpress is imported) must not land it in ``scaling``
    def kvscope_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        sink = kwargs.get("s_aux")  # [head] learned sink logits (gpt-oss), or None
        override = _OVERRIDE.get()
        if override is not None:
            with torch.no_grad():
                return override(module, query, key, value, attention_mask, scale, softcap, sink), None
        probe = _PROBE.get()
        if probe is not None:
            probe.saw(module, query, key, value, mask=attention_mask, scaling=scale, softcap=softcap, kwargs=kwargs)
        view = _slot_view(key)
        recorder = _ACTIVE.get()
        if view is None and recorder is not None and not module.training:
            with torch.no_grad():
                out = recorder.attend(
                    module, query, key, value, mask=attention_mask, scaling=scale, softcap=softcap, sink=sink
                )
            if out is not None:  # the output from the recorded probabilities (attn_output="probs")
                return out, None
        slot_pos = None
        recorders = [recorder]
        if view is not None:
            view.used = True
            if query.shape[2] == 1:  # one unpadded sequence: a decode row needs no mask, and a mask
                attention_mask = None  # sized before the cache's last decision could be stale
                slot_pos = view.slot_pos
            if view.recorder is not recorders[0]:
                recorders.append(view.recorder)
        if view is not None and view.head_mask is not None:  # padding slots of a live cache: mask them per head
            attention_mask = _per_head_mask(view.head_mask, query.shape[1], query.shape[2], attention_mask)
        observer = view.recorder if view is not None and not module.training else None
        observer = observer if observer is not None and observer.enabled else None  # the cache's policy observes
        out = probs = blocks = None
        if observer is not None and slot_pos is not None:
            with torch.no_grad():  # the policy observes this row: the output comes from the same probabilities
                out, probs = _observed_row(query, key, value, attention_mask, scaling=scale, softcap=softcap, sink=sink)
        elif view is not None and view.head_mask is not None:
            out = _masked_output(query, key, value, attention_mask, scaling=scale, softcap=softcap, sink=sink)
        elif observer is not None:
            # the prompt's attention the policy reads, once for every recorder; the kernel's output
            with torch.no_grad():
                blocks = observer.prompt_blocks(query, key, attention_mask, scaling=scale, softcap=softcap, sink=sink)
        if out is None:
            out = base(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, softcap=softcap, **kwargs
            )
        if any(r is not None for r in recorders):
            with torch.no_grad():  # the probabilities computed above serve every recorder (a trace under a
                for recorder in recorders:  # policy: the trace's and the cache's), blocks at their tail's size
                    if recorder is not None:
                        shared = blocks if blocks is not None and recorder.obs_window == observer.obs_window else None
                        recorder.observe(
                            module, query, key, value, mask=attention_mask, scaling=scale, softcap=softcap,
                            slot_pos=slot_pos, probs=probs, blocks=shared, sink=sink,
                        )  # fmt: skip
        return out, None

    kvscope_attention.__name__ = f"kvscope_{kernel}_attention"
    return kvscope_attention


_MASKS = {"sdpa": sdpa_mask, "eager": eager_mask, "flash_attention_2": flash_attention_mask}
_REGISTERED = False


def register() -> None:
    """Register ``kvscope_{kernel}`` attention and mask functions (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    for kernel in KERNELS:
        name = implementation_name(kernel)
        AttentionInterface.register(name, _capturing(kernel))
        AttentionMaskInterface.register(name, _MASKS[kernel])
    _REGISTERED = True


# transformers matches implementation names by substring ("sdpa" in name triggers its SDPA
# support check, "flash" its kernel loader), so the registered names avoid those words.
_NAMES = {"sdpa": "kvscope_fused", "eager": "kvscope_eager", "flash_attention_2": "kvscope_fa2"}


def implementation_name(kernel: str) -> str:
    """The name under which the capturing variant of ``kernel`` is registered."""
    return _NAMES[kernel]
