"""A transformers cache that runs a kvscope policy during real decoding (the policy contract: docs/concepts.md#observe).

The same policy objects that [`kvscope.replay`][kvscope.replay.replay] drives offline run here inside
``model(..., cache=PolicyCache(...))`` or ``model.generate(cache=...)``. The cache drives the
policy's [`CacheState`][kvscope.policies.CacheState] exactly as replay does — ``prefill(colsum,
tail)`` after the prompt, then per decode step ``append(p)``, ``observe(row)``,
``compress()`` — with the rows this cache really served, and then makes the decision real:

    EVICTED        the position's K/V are deleted
    Q              packed codes + 16-bit scale/zero (the policy's write-once ledger holds
                   the codes), dequantized once, when quantized, into the served buffer
    FP             the original K/V in ``kv_dtype`` (the model's dtype by default)
    FP, promoted   (QEvict) a promotion restores the dequantized values, which the ledger's
                   codes already give: served from the codes, counted as FP by the byte model

Per layer the cache holds two flat pools of rows, each row one (kv_head, position):

    fp_k, fp_v        [n_fp, D]          kv_dtype      originals
    fp_pos, fp_head   [n_fp]             int32         index
    k_codes, v_codes  [n_q, D·b/8]       uint8         2/4/8-bit codes packed along channels
    v_scale, v_zero   [n_q, D/g_v]       fp16          per token
    k_scale, k_zero   [n_groups, D]      fp16          keys per channel per group (k_group [n_q])
                      [n_q, D/g_k]                     or per token (key_axis=token)
    q_pos, q_head     [n_q]              int32         index (k_group [n_q] int32 too)
    nk, nv            [n_c, D − m], [n_c, D]  kv_dtype  FP rows whose keys a press pruned to D − m
    n_pos, n_head     [n_c]              int32         channels (ThinK; the channels kept per head in
    n_channels        [kv_head, D − m]   int64         ``n_channels``): only the kept ones are stored
    served            ``Served``   what attention reads

(new FP rows wait as the tensors appended and join ``fp_*`` by one concatenation when a
decision next reads the layer's pools — counted in the bytes held all along).

At each decode forward a layer hands attention ``[1, kv_head, W, D]`` keys/values, a view of
its served buffer: per KV head its FP rows and its Q rows dequantized, left-aligned, the
newest key in the last slot of every head (free slots of heads that hold fewer masked per
head by the kvscope attention function). The buffer changes in place where rows change
(``kvscope.live.served``): a Q row's codes never change while it is held (the ledger is
write-once) and dequantization is elementwise per row, so each row is dequantized once, when
quantized, and the buffer equals a fresh gather of the pools — FP rows as stored, Q rows
dequantized from every code — set-wise by position, bit for bit (checked at every step under
``check``). Evictions permute the slots; a cache that evicts nothing hands over exactly what a
``DynamicCache`` would. The buffer is a CPU-speed trade (no fused unpack + matmul kernel
here): it is reported apart, ``bytes_serving``, not in ``bytes_actual``.

Bytes per step: ``bytes_model`` (the byte model of docs/concepts.md#budget, what replay reports) and
``bytes_actual`` (``nbytes`` of every pool data tensor; index tensors apart in
``bytes_index``, the served buffer in ``bytes_serving``); both must stay within
``β · FP_bytes(P + S)`` at ``kv_dtype``.
One sequence at a time (batch 1). Needs a kvscope attention implementation
([`prepare`][kvscope.live.prepare]), which also computes the rows the policy observes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from .. import defaults
from ..errors import KvscopeError
from ..model.rope import Rope, rotate_half
from ..model.spec import ModelSpec
from ..policies import Allocation, CacheSpec, Policy, PolicyDriver, check_budget
from ..policies.allocation import check_allocatable
from ..policies.quant import pack
from ..tiers import TIER_FP, TIER_Q
from ..tracing.capture import AttentionRecorder, ForwardContext, SlotView, implementation_name, offer_slots, register
from .inputs import kv_dtype_name, live_allocation, live_policy
from .press_link import PressLink
from .served import Served

if TYPE_CHECKING:
    from transformers import PreTrainedModel

INDEX = torch.int32  # dtype of the position / head / group index tensors


def parse_kv_dtype(name: str | None):
    """``--kv-dtype``: None for the model's dtype, else the torch dtype FP entries are stored in."""
    name = kv_dtype_name(name)
    return None if name is None else getattr(torch, name)


def kv_storage_dtype(model, name: str | None):
    """The dtype a live cache of ``model`` stores FP entries in: ``--kv-dtype``, or the model's."""
    return parse_kv_dtype(name) or next(model.parameters()).dtype


def prepare(model: PreTrainedModel, kernel: str = "sdpa") -> PreTrainedModel:
    """Route ``model``'s attention through kvscope (needed by
    [`PolicyCache`][kvscope.live.PolicyCache]), refusing in one line a model a live cache cannot
    serve (``check_live_geometry``).

    Args:
        model: A loaded transformers model.
        kernel: The attention kernel kvscope wraps: ``sdpa``, ``eager`` or ``flash_attention_2``.

    Returns:
        The same model.
    """
    from ..tracing.architecture import inspect

    register()
    model.set_attn_implementation(implementation_name(kernel))
    check_live_geometry(model, inspect(model, kernel))
    return model


def check_live_geometry(model, spec: ModelSpec) -> None:
    """A live policy cache holds per-head K/V of every layer, all attending globally: a model with
    sliding windows, a shared latent (MLA) or layers whose cache is not K/V (linear attention,
    SSM) is refused in one line (docs/architectures.md; offline replay serves all of them)."""
    from transformers import DynamicCache

    name = spec.architecture or type(model).__name__
    if spec.from_weights:
        raise KvscopeError(
            f"live policy caches serve attention through kvscope's function; {name} attends in its own modules"
        )
    if spec.latent:
        raise KvscopeError(f"live policy caches hold per-head K/V; {name} caches one latent per token (MLA)")
    kinds = {type(layer).__name__ for layer in DynamicCache(config=model.config).layers}
    if kinds - {"DynamicLayer", "DynamicSlidingWindowLayer"}:
        raise KvscopeError(
            f"live policy caches hold K/V of every layer; {name} caches other state in some ({', '.join(sorted(kinds))})"
        )
    if not spec.global_only:
        raise KvscopeError("live policy caches support global-attention layers only (this model slides windows)")


def _codes_float(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """``[rows, bytes]`` packed codes (first code in the lowest bits, as
    ``kvscope.policies.quant.pack``) → ``[rows, n]`` float32 (small integers: exact)."""
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed[..., None] >> shifts) & ((1 << bits) - 1)  # [rows, bytes, per]
    return codes.view(packed.shape[0], packed.shape[1] * per)[:, :n].float()


class _Pool:
    """The rows of one layer (see the module docstring). New FP rows wait in ``pending`` (the
    tensors as appended, held and counted like the rest) and join ``fp_k, fp_v, fp_pos,
    fp_head`` in one concatenation when those are next read — at a decision that touches the
    layer, not at every step."""

    _FP = ("fp_k", "fp_v", "fp_pos", "fp_head")

    def __init__(self, head_dim: int, kv_dtype, device):
        d = head_dim
        self._fp = {
            "fp_k": torch.empty((0, d), dtype=kv_dtype, device=device),
            "fp_v": torch.empty((0, d), dtype=kv_dtype, device=device),
            "fp_pos": torch.empty(0, dtype=INDEX, device=device),
            "fp_head": torch.empty(0, dtype=INDEX, device=device),
        }
        self.pending: list[tuple[torch.Tensor, ...]] = []  # (keys, values [n, D], pos, head [n]) in order
        self.narrow: dict[str, torch.Tensor] | None = None  # FP rows with channel-pruned keys (module docstring)
        self.q: dict[str, torch.Tensor] | None = None  # created at the first quantization
        self.group_size = 0  # key groups all of this many consecutive rows (0: mixed sizes)
        self.served: Served | None = None  # what attention reads, from the first decode forward

    def append_fp(self, keys, values, pos, head) -> None:
        self.pending.append((keys, values, pos, head))

    def _joined(self) -> dict[str, torch.Tensor]:
        if self.pending:
            parts = list(zip(*self.pending))
            self.pending = []
            self._fp = {name: torch.cat([self._fp[name], *new]) for name, new in zip(self._FP, parts)}
        return self._fp

    fp_k = property(lambda self: self._joined()["fp_k"])
    fp_v = property(lambda self: self._joined()["fp_v"])
    fp_pos = property(lambda self: self._joined()["fp_pos"])
    fp_head = property(lambda self: self._joined()["fp_head"])

    def keep_fp(self, keep: torch.Tensor) -> None:
        """Keep the FP rows where ``keep [n_fp]``."""
        self._fp = {name: t[keep] for name, t in self._joined().items()}

    def data_tensors(self):
        out = [self._fp["fp_k"], self._fp["fp_v"], *(t for row in self.pending for t in row[:2])]
        if self.q is not None:
            out += [self.q[k] for k in ("k_codes", "v_codes", "v_scale", "v_zero", "k_scale", "k_zero")]
        if self.narrow is not None:
            out += [self.narrow["nk"], self.narrow["nv"]]
        return out

    def index_tensors(self):
        out = [self._fp["fp_pos"], self._fp["fp_head"], *(t for row in self.pending for t in row[2:])]
        if self.q is not None:
            out += [self.q[k] for k in ("q_pos", "q_head", "k_group")]
        if self.narrow is not None:
            out += [self.narrow[k] for k in ("n_pos", "n_head", "n_channels")]
        return out

    def narrow_rows(self, keep: torch.Tensor, channels: torch.Tensor) -> None:
        """The FP rows where ``keep [n_fp]`` move to the narrow rows, their keys stored at
        ``channels [kv_head, D − m]`` only (the press zeroed the others)."""
        rows = self._joined()
        head = rows["fp_head"][keep]
        index = channels.to(head.device)[head.long()]  # [n, D − m]
        self.narrow = {
            "nk": rows["fp_k"][keep].gather(1, index), "nv": rows["fp_v"][keep], "n_pos": rows["fp_pos"][keep],
            "n_head": head, "n_channels": channels.to(head.device),
        }  # fmt: skip
        self.keep_fp(~keep)

    def narrow_full(self):
        """``heads, pos [n_c]``, ``keys [n_c, D]`` (zeros at the pruned channels), ``values [n_c, D]``."""
        n = self.narrow
        keys = torch.zeros((n["nk"].shape[0], n["nv"].shape[1]), dtype=n["nk"].dtype, device=n["nk"].device)
        keys.scatter_(1, n["n_channels"][n["n_head"].long()], n["nk"])
        return n["n_head"], n["n_pos"], keys, n["nv"]

    def keep_narrow(self, keep: torch.Tensor) -> None:
        """Keep the narrow rows where ``keep [n_c]``."""
        self.narrow = {k: (v if k == "n_channels" else v[keep]) for k, v in self.narrow.items()}

    def heads(self) -> torch.Tensor:
        """The KV head of every row held (FP, narrow, Q)."""
        parts = [self.fp_head]
        if self.narrow is not None:
            parts.append(self.narrow["n_head"])
        if self.q is not None:
            parts.append(self.q["q_head"])
        return torch.cat(parts)

    def n_q(self) -> int:
        return 0 if self.q is None else int(self.q["q_pos"].shape[0])


class PolicyLayer(DynamicLayer):
    """One layer of a [`PolicyCache`][kvscope.live.PolicyCache]: it delegates to the cache,
    which owns the policy.

    Args:
        cache: The cache.
        index: The layer's index.
    """

    is_sliding = False
    is_croppable = False

    def __init__(self, cache: PolicyCache, index: int):
        super().__init__()
        self.cache, self.index = cache, index
        self.n_seen = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.cache.position_shift and self.index == 0:
            self.cache._check_positions(kwargs.get("kwargs") or {})
        return self.cache._update(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.n_seen - self.cache.position_shift  # a re-rotating press numbers the rows it kept from 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # decode rows need no mask (batch 1); the prefill sees every position
        return self.cache.slots(self.index) + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        raise KvscopeError("a PolicyCache cannot be cropped (its positions are decided by the policy)")

    def reset(self) -> None:
        raise KvscopeError("a PolicyCache serves one sequence; make a new one")


class PolicyCache(DynamicCache):
    """A transformers ``Cache`` that compresses with ``policy`` at budget ``β`` while decoding.

    ``max_new_tokens`` = S fixes the final length ``P + S`` and with it the byte budget
    ``β · FP_bytes(P + S)`` ([Concepts → Budget](concepts.md#budget);
    ``generate(max_new_tokens=S)`` runs S forwards).

    Args:
        model: The model (prepared with [`prepare`][kvscope.live.prepare]).
        policy: A policy object, name or ``name:key=value:…`` (not a clairvoyant one).
        budget: β, a share of the full cache's bytes in (0, 1].
        max_new_tokens: ``S``, the decode steps the budget is sized for.
        kv_dtype: Storage of FP entries (default: the model's dtype; the byte model counts
            ``2·D·itemsize`` per FP token).
        n_sink: Sinks: the first positions.
        w: The window size.
        obs_window: The prompt's last rows a policy may observe.
        every: Tier snapshots kept every that many steps (``tier_events``; default ``w``).
        keep_tiers: Keep the tiers of every event (a recording cache).
        check: Verify every policy invariant and the physical content at every step (tests).
        allocation: How β is split across layers and KV heads (default uniform).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        policy: Policy | str,
        budget: float,
        max_new_tokens: int,
        *,
        kv_dtype: torch.dtype | None = None,
        n_sink: int = defaults.N_SINK,
        w: int = defaults.W,
        obs_window: int = defaults.OBS_WINDOW,
        every: int | None = None,
        keep_tiers: bool = False,
        check: bool = False,
        allocation: Allocation | str | None = None,
    ):
        policy = live_policy(policy)
        self.allocation = live_allocation(allocation)
        check_allocatable([policy], [self.allocation])
        if max_new_tokens < 1:
            raise KvscopeError(f"max_new_tokens must be at least 1 (got {max_new_tokens})")
        spec = ModelSpec.from_model(model)
        check_live_geometry(model, spec)
        self.policy, self.budget = policy, check_budget(budget)
        self.max_new_tokens = int(max_new_tokens)
        self.n_layers, self.n_kv, self.head_dim = spec.n_layers, spec.n_kv_heads, spec.head_dim
        parameter = next(model.parameters())
        self.kv_dtype = kv_dtype or parameter.dtype
        self.itemsize = self.kv_dtype.itemsize
        self.device = parameter.device
        self.n_sink, self.w, self.obs_window = n_sink, w, obs_window
        self.every = every or w
        rope = Rope.from_model(model, self.n_layers)
        self.rope = rope if rope.usable() else None
        policy.check_live(spec, self.rope, loaded=model)
        self.model_spec = spec
        self.recorder = AttentionRecorder(
            n_layers=self.n_layers, n_stored_heads=self.n_kv, obs_window=obs_window,
            record_qkv=policy.reads_queries and not policy.live_hooks,
        )  # fmt: skip
        self.position_shift = 0  # positions a re-rotating press took off the continuation's numbering
        self.press = PressLink(self, model, policy, self.model_spec) if policy.live_hooks else None
        self.keep_tiers, self.check = keep_tiers, check
        Cache.__init__(self, layers=[PolicyLayer(self, i) for i in range(self.n_layers)])
        self.pools = [_Pool(self.head_dim, self.kv_dtype, self.device) for _ in range(self.n_layers)]
        self.driver: PolicyDriver | None = None
        self.seen = 0  # positions that exist
        self.step = -1  # last step whose decision was applied
        self._pending: str | None = None
        self._views: list[SlotView] = []
        self.bytes_model: list[float] = []  # [step] byte model, all layers and heads
        self.bytes_actual: list[int] = []  # [step] nbytes of the data tensors
        self.bytes_index: list[int] = []  # [step] nbytes of the index tensors
        self.bytes_serving: list[int] = []  # [step] nbytes of the served buffers (and slot maps)
        self._held: np.ndarray | None = None  # [2 (FP, Q), layer, kv_head, pos] rows the pools hold
        self.tier_events: dict[int, np.ndarray] = {}  # step → tiers [layer, kv_head, pos] after deciding

    def _check_positions(self, attention_kwargs: dict) -> None:
        """A decode forward under a re-rotating press must number its token from the rows kept
        (kvpress's protocol), as transformers does from ``PolicyLayer.get_seq_length``."""
        given = attention_kwargs.get("position_ids")
        expected = self.seen - self.position_shift
        if given is not None and int(given.reshape(-1)[-1]) != expected:
            raise KvscopeError(
                f"{self.policy.label()} re-rotates the keys it keeps and numbers the continuation from them "
                f"(position {expected}, kvpress's protocol); this decode passes position {int(given.reshape(-1)[-1])}"
            )

    # -- sizes ------------------------------------------------------------------------------
    @property
    def state(self):
        """The policy's cache state (None before the prompt)."""
        return None if self.driver is None else self.driver.state

    @property
    def spec(self) -> CacheSpec:
        """The cache's geometry and budget (once it has seen the prompt)."""
        if self.state is None:
            raise KvscopeError("the cache has not seen a prompt yet")
        return self.state.spec

    @property
    def budget_bytes(self) -> float:
        """``β · FP_bytes(P + S)`` over all layers and KV heads."""
        return self.spec.total_capacity

    @property
    def full_bytes(self) -> float:
        """``FP_bytes(P + S)``: a full cache of the final length at ``kv_dtype``."""
        return self.spec.full_bytes

    def slots(self, layer: int) -> int:
        """Key slots per head the layer hands to attention now (before this forward's key).

        Args:
            layer: The layer.
        """
        heads = self.pools[layer].heads()
        return int(torch.bincount(heads.long(), minlength=self.n_kv).max()) if heads.numel() else 0

    def actual_bytes(self) -> tuple[int, int]:
        """``(data, index)`` bytes of every tensor the cache holds now."""
        data = sum(t.nbytes for pool in self.pools for t in pool.data_tensors())
        index = sum(t.nbytes for pool in self.pools for t in pool.index_tensors())
        return int(data), int(index)

    # -- the forward ------------------------------------------------------------------------
    def _begin_forward(self, n_new: int) -> None:
        self.end_step()
        if self.state is None:
            cache_spec = CacheSpec(
                n_layers=self.n_layers, n_kv=self.n_kv, head_dim=self.head_dim, prompt_len=n_new,
                final_len=n_new + self.max_new_tokens, budget=self.budget, n_sink=self.n_sink, w=self.w,
                fp_itemsize=self.itemsize, tail_rows=self.obs_window,
            )  # fmt: skip
            reads = {"model": self.model_spec} if self.policy.reads_queries else {}
            if self.press is not None:  # the press's decisions come from its hook on the model
                reads["hooks"] = self.press.hooks
            state = self.policy.start(cache_spec, rope=self.rope, **reads)
            self._held = np.zeros((2, *state.tiers.shape), dtype=bool)
            self.driver = PolicyDriver(state, allocation=self.allocation, check=self.check)
            if self.state.ledger is not None:
                self.state.ledger.sink = self._quantize
            self._pending = "prefill"
        else:
            if n_new != 1:
                raise KvscopeError("after the prompt a PolicyCache takes one token per forward")
            if self.seen + 1 > self.state.spec.final_len:
                raise KvscopeError(
                    f"this PolicyCache was made for {self.max_new_tokens} new tokens; decoding went past them"
                )
            self.driver.append(self.seen)
            self._pending = "decode"
        self.seen += n_new
        self.recorder.begin(ForwardContext(seq_len=self.seen, pad=torch.zeros(1, dtype=torch.long)))
        prefill = self._pending == "prefill"
        reads_prompt = self.policy.observes_prefill or self.allocation.reads == "scores"  # adakv: the policy's scores
        self.recorder.enabled = self.policy.observes or (prefill and reads_prompt)
        self._views = []

    def _update(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        if key_states.shape[0] != 1:
            raise KvscopeError("a PolicyCache decodes one sequence at a time (batch size 1)")
        n_new = key_states.shape[2]
        if layer == 0:
            self._begin_forward(n_new)
        self.layers[layer].n_seen += n_new
        recorder = self.recorder if self.recorder.enabled else None
        if self._pending == "prefill":  # every position of every head, in order: as given
            if self.kv_dtype == key_states.dtype:
                keys, values = key_states, value_states
            else:
                keys, values = (
                    key_states.to(self.kv_dtype).to(key_states.dtype),
                    value_states.to(self.kv_dtype).to(value_states.dtype),
                )
            view = SlotView(keys, None, None, recorder)
        else:  # before the pools take the new row (the served buffer may be built from them)
            keys, values, slot_pos, head_mask = self._served(layer, key_states, value_states)
            view = SlotView(keys, slot_pos, head_mask, recorder)
        if self.press is not None:
            self.press.entered(layer, keys if n_new > 1 else key_states, values if n_new > 1 else value_states, n_new)
        pool = self.pools[layer]
        device = key_states.device
        heads = torch.arange(self.n_kv, dtype=INDEX, device=device)
        if n_new == 1:  # a decode row: one position, every head
            pos = torch.full((self.n_kv,), self.seen - 1, dtype=INDEX, device=device)
        else:  # head-major, as the rows below
            pos = torch.arange(self.seen - n_new, self.seen, dtype=INDEX, device=device).repeat(self.n_kv)
            heads = heads.repeat_interleave(n_new)
        pool.append_fp(
            key_states[0].reshape(-1, self.head_dim).to(self.kv_dtype),
            value_states[0].reshape(-1, self.head_dim).to(self.kv_dtype),
            pos,
            heads,
        )
        self._held[0, layer, :, self.seen - n_new : self.seen] = True
        self._views.append(view)
        offer_slots(view)
        return keys, values

    def _served(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """The layer's served buffer with this forward's key appended (``Served.append``);
        built from the pools at the first decode forward, or again when attention's dtype
        changes."""
        pool, dtype = self.pools[layer], key_states.dtype
        if pool.served is None or pool.served.dtype != dtype:
            pool.served = Served(self.n_kv, self.head_dim, self.state.spec.final_len, dtype, device=self.device)
            pool.served.fill(*self._gathered(layer, dtype))
        new_k, new_v = (x[0, :, 0].to(self.kv_dtype).to(dtype) for x in (key_states, value_states))
        served = pool.served.append(self.seen - 1, new_k, new_v)
        if self.check:
            self._check_forward(layer, served[2])
        return served

    def _gathered(self, layer: int, dtype):
        """``heads, pos [n]`` (numpy) and ``keys, values [n, D]`` (``dtype``) of every position
        the layer's pools hold: FP rows as stored, Q rows dequantized from their codes. An FP
        row whose position is also held as Q (quantized at an append, before the forward; the
        FP row leaves at the step's end) is not served: the position is Q."""
        pool = self.pools[layer]
        heads, pos, keys, values = pool.fp_head, pool.fp_pos, pool.fp_k.to(dtype), pool.fp_v.to(dtype)
        fresh = ~torch.from_numpy(self._held[1, layer][heads.cpu().numpy(), pos.cpu().numpy()]).to(heads.device)
        if not bool(fresh.all()):
            heads, pos, keys, values = heads[fresh], pos[fresh], keys[fresh], values[fresh]
        if pool.narrow is not None:
            n_heads, n_pos, n_keys, n_values = pool.narrow_full()
            heads, pos = torch.cat([heads, n_heads]), torch.cat([pos, n_pos])
            keys, values = torch.cat([keys, n_keys.to(dtype)]), torch.cat([values, n_values.to(dtype)])
        if pool.q is not None:
            qk, qv = self._dequantized(pool.q, pool.group_size, layer)
            heads, pos = torch.cat([heads, pool.q["q_head"]]), torch.cat([pos, pool.q["q_pos"]])
            keys, values = torch.cat([keys, qk.to(dtype)]), torch.cat([values, qv.to(dtype)])
        return heads.cpu().numpy().astype(np.int64), pos.cpu().numpy().astype(np.int64), keys, values

    def _fp_rows(self, pool: _Pool, heads: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The index in ``pool``'s FP rows of each (``heads``, ``positions``) (CPU integer tensors
        that broadcast together), −1 where it holds none."""
        final = self.state.spec.final_len
        lookup = torch.full((self.n_kv * final,), -1, dtype=torch.long)
        lookup[(pool.fp_head.long() * final + pool.fp_pos.long()).cpu()] = torch.arange(pool.fp_pos.numel())
        return lookup[heads.long() * final + positions.long()]

    def rewrite_rows(
        self,
        layer: int,
        heads: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        pruned_channels: torch.Tensor | None = None,
    ) -> None:
        """Rows a press rewrote, written over the full-precision rows the cache holds.

        Args:
            layer: The layer.
            heads: ``[n]`` the KV head of each row.
            positions: ``[n]`` the position of each row.
            keys: ``[n, D]`` the rows' new keys.
            values: ``[n, D]`` their new values.
            pruned_channels: ``[kv_head, D]`` True where the press zeroed a key channel (those
                channels are then not stored).
        """
        pool = self.pools[layer]
        rows = self._fp_rows(pool, heads, positions)
        if bool((rows < 0).any()):
            raise RuntimeError(f"layer {layer}: a row the press left is not held by the cache")
        rows = rows.to(pool.fp_k.device)
        pool.fp_k[rows] = keys.to(pool.fp_k.dtype)
        pool.fp_v[rows] = values.to(pool.fp_v.dtype)
        if pool.served is not None:
            pool.served.write(heads.numpy(), positions.numpy(), keys, values)
        if pruned_channels is not None:  # the pruned channels are not stored at all
            kept = ~pruned_channels.cpu()
            channels = torch.stack([torch.nonzero(kept[h]).flatten() for h in range(kept.shape[0])])
            moved = torch.zeros(pool.fp_pos.numel(), dtype=torch.bool)
            moved[rows.cpu()] = True
            pool.narrow_rows(moved.to(pool.fp_k.device), channels)

    # -- quantized rows -------------------------------------------------------------------
    def _quantize(self, positions: np.ndarray, layers: np.ndarray, heads: np.ndarray) -> None:
        """The ledger's sink: quantize groups ``positions [n, G]`` of (``layers [n]``,
        ``heads [n]``) from the FP originals this cache holds, and keep their codes."""
        ledger = self.state.ledger
        d = self.head_dim
        for layer in np.unique(layers):
            rows = np.nonzero(layers == layer)[0]
            pos = positions[rows]  # [n, G]
            pool = self.pools[layer]
            index = self._fp_rows(pool, torch.from_numpy(heads[rows][:, None]), torch.from_numpy(pos))  # [n, G]
            if bool((index < 0).any()):
                raise RuntimeError("the policy quantized a position this cache does not hold at full precision")
            index = index.to(pool.fp_k.device)
            keys = pool.fp_k[index].float().cpu().numpy()  # [n, G, D]
            values = pool.fp_v[index].float().cpu().numpy()
            layer_ids = np.full(len(rows), layer)
            qk, qv = ledger.encode(keys, values, pos, layer_ids)
            n, g = pos.shape
            dev = self.device
            new = {
                "q_pos": torch.from_numpy(pos.reshape(-1).astype(np.int32)).to(dev),
                "q_head": torch.from_numpy(np.repeat(heads[rows], g).astype(np.int32)).to(dev),
                "k_codes": torch.from_numpy(pack(qk.codes.reshape(n * g, d), ledger.bits)).to(dev),
                "v_codes": torch.from_numpy(pack(qv.codes.reshape(n * g, d), ledger.bits)).to(dev),
                "v_scale": torch.from_numpy(qv.scale.reshape(n * g, -1)).to(dev),
                "v_zero": torch.from_numpy(qv.zero.reshape(n * g, -1)).to(dev),
            }
            if ledger.key_axis == "channel":
                first = 0 if pool.q is None else int(pool.q["k_scale"].shape[0])
                new["k_scale"] = torch.from_numpy(qk.scale.reshape(n, d)).to(dev)  # [group, D]
                new["k_zero"] = torch.from_numpy(qk.zero.reshape(n, d)).to(dev)
                new["k_group"] = torch.arange(first, first + n, dtype=INDEX, device=dev).repeat_interleave(g)
            else:
                new["k_scale"] = torch.from_numpy(qk.scale.reshape(n * g, -1)).to(dev)  # [token, D/g_k]
                new["k_zero"] = torch.from_numpy(qk.zero.reshape(n * g, -1)).to(dev)
                new["k_group"] = torch.empty(0, dtype=INDEX, device=dev)
            if pool.served is not None:  # dequantized once, into the rows served (the prefill's: when built)
                q_heads = np.repeat(heads[rows], g).astype(np.int64)
                pool.served.write(q_heads, pos.reshape(-1).astype(np.int64), *self._dequantized(new, g, layer))
            self._held[1, layer, heads[rows][:, None], pos] = True
            if pool.q is None:
                pool.q, pool.group_size = new, g
            else:
                pool.q = {name: torch.cat([pool.q[name], new[name]]) for name in new}
                if pool.group_size != g:
                    pool.group_size = 0

    def _dequantized(self, q: dict[str, torch.Tensor], g: int, layer: int):
        """``keys, values [n, D]`` float32 of the Q rows ``q`` of ``layer`` (a pool's rows, key
        groups all of ``g`` consecutive rows, or mixed when ``g`` = 0) — the same arithmetic as
        replay's ledger (``x̂ = q·scale + zero``, then RoPE for pre-RoPE keys), so both serve
        bit-identical values. Elementwise per row: any subset of rows gives the same values."""
        ledger = self.state.ledger
        d, bits = self.head_dim, ledger.bits
        n = q["q_pos"].shape[0]
        k_codes = _codes_float(q["k_codes"], bits, d)  # [n, D]
        v_codes = _codes_float(q["v_codes"], bits, d)
        if ledger.key_axis == "channel":
            if g:  # whole groups of g rows in order: broadcast the group parameters
                ng = n // g
                keys = (k_codes.view(ng, g, d) * q["k_scale"].float()[:, None] + q["k_zero"].float()[:, None]).view(
                    n, d
                )
            else:
                group = q["k_group"]
                scale = torch.index_select(q["k_scale"], 0, group).float()
                keys = k_codes * scale + torch.index_select(q["k_zero"], 0, group).float()
        else:
            kg = ledger.key_group
            keys = (
                k_codes.view(n, d // kg, kg) * q["k_scale"].float()[..., None] + q["k_zero"].float()[..., None]
            ).view(n, d)
        gv = ledger.value_group
        values = (v_codes.view(n, d // gv, gv) * q["v_scale"].float()[..., None] + q["v_zero"].float()[..., None]).view(
            n, d
        )
        if ledger.rope is not None and ledger.rope.usable():
            cos_table, sin_table = self._rope_tables(ledger.rope)
            pos = q["q_pos"]
            cos = torch.index_select(cos_table[layer], 0, pos)  # [n, D] float32: replay's tables
            sin = torch.index_select(sin_table[layer], 0, pos)
            keys = keys * cos + rotate_half(keys, ledger.rope.n_rot) * sin
        return keys, values

    def _rope_tables(self, rope: Rope):
        """``cos, sin [layer, pos, D]``: the rotary tables the ledger quantized with (shared
        memory, on the cache's device)."""
        final = self.state.spec.final_len
        if getattr(self, "_tables", None) is None or self._tables[0].shape[1] < final:
            cos, sin = rope.tables(final, self.head_dim)
            self._tables = (torch.from_numpy(cos).to(self.device), torch.from_numpy(sin).to(self.device))
        return self._tables

    # -- deciding ---------------------------------------------------------------------------
    def end_step(self) -> None:
        """Apply the decision of the forward that just ran (called by the next forward, or by
        a decode loop right after each forward): the policy observes, compresses, and the
        cache deletes, quantizes and keeps accordingly."""
        if self._pending is None:
            return
        kind, self._pending = self._pending, None
        if not all(view.used for view in self._views):
            raise KvscopeError(
                "a PolicyCache needs kvscope's attention implementation: call kvscope.live.prepare(model) first"
            )
        self._views = []
        offer_slots(None)
        for pool in self.pools:  # the new rows take their places before any row changes
            if pool.served is not None:
                pool.served.settle()
        decided = self.press.decided(kind == "prefill") if self.press is not None else {}
        used = self.driver.prefill(*self._prompt_attention()) if kind == "prefill" else self._decide()
        self.recorder.begin(ForwardContext(seq_len=self.seen, pad=torch.zeros(1, dtype=torch.long)))
        self._sync()
        if decided:
            self.press.rewrite(decided)
        self.step += 1
        data, index = self.actual_bytes()
        self.driver.check_held(data)
        self.bytes_model.append(float(used.sum()))
        self.bytes_actual.append(data)
        self.bytes_index.append(index)
        self.bytes_serving.append(
            sum(pool.served.nbytes() for pool in self.pools if pool.served is not None)
            + self.state.scratch_bytes()
            + (self.press.scratch_bytes() if self.press is not None else 0)
        )
        if self.check:
            self._check_content()
        if self.keep_tiers and self.step % self.every == 0:
            self.tier_events[self.step] = self.state.tiers.copy()

    def _prompt_attention(self) -> tuple[np.ndarray, np.ndarray]:
        """``colsum [L, Hkv, P]`` and ``tail [L, Hkv, obs, P]`` of the prompt's own attention
        (zeros for a policy that ignores it: they were not computed)."""
        p = self.seen
        if not self.recorder.enabled:
            return np.zeros((self.n_layers, self.n_kv, p)), np.zeros((self.n_layers, self.n_kv, 1, p), np.float32)
        return self.recorder.prompt_attention()

    def _decide(self) -> np.ndarray:
        """The policy decides on the row this cache served (kv-group mean, by position)."""
        row = self.recorder.rows[0, :, :, : self.seen].float().cpu().numpy() if self.policy.observes else None
        return self.driver.decide(row)

    def _sync(self) -> None:
        """Make the pools match the state's tiers: FP rows stay while their position is FP
        and was never quantized; Q rows stay unless their position was evicted. Only layers
        that hold a row to drop (``_held`` against the tiers) are touched."""
        st = self.state
        tiers = st.tiers[..., : self.seen]  # [layer, kv_head, pos]
        want_fp = tiers == TIER_FP
        if st.ledger is not None:
            want_fp &= ~st.ledger.done[..., : self.seen]
        held = self._held[..., : self.seen]  # [2, layer, kv_head, pos]
        gone = (held[0] | held[1]) & (tiers < TIER_Q)  # [layer, kv_head, pos] evicted now
        drop = (held[0] & ~want_fp).any((1, 2)) | gone.any((1, 2))  # [layer]
        held[0] &= want_fp
        held[1] &= tiers >= TIER_Q
        for layer in np.nonzero(drop)[0]:
            self._drop(layer, torch.from_numpy(want_fp[layer]), torch.from_numpy(tiers[layer] >= TIER_Q))
            if self.pools[layer].served is not None:
                self.pools[layer].served.remove(*np.nonzero(gone[layer]))

    def _drop(self, layer: int, want_fp: torch.Tensor, want_q: torch.Tensor) -> None:
        """Keep the layer's FP rows where ``want_fp [kv_head, pos]`` and its Q rows (codes,
        parameters) where ``want_q [kv_head, pos]``."""
        pool = self.pools[layer]
        keep = want_fp[pool.fp_head.cpu(), pool.fp_pos.cpu()]
        if not bool(keep.all()):
            pool.keep_fp(keep.to(pool.fp_k.device))
        if pool.narrow is not None:
            keep = want_fp[pool.narrow["n_head"].cpu(), pool.narrow["n_pos"].cpu()]
            if not bool(keep.all()):
                pool.keep_narrow(keep.to(pool.narrow["nk"].device))
        if pool.q is None:
            return
        q = pool.q
        keep = want_q[q["q_head"].cpu(), q["q_pos"].cpu()].to(q["q_pos"].device)
        if bool(keep.all()):
            return
        kept = {name: q[name][keep] for name in ("q_pos", "q_head", "k_codes", "v_codes", "v_scale", "v_zero")}
        if self.state.ledger.key_axis == "channel":
            groups, new_index, sizes = torch.unique(q["k_group"][keep], return_inverse=True, return_counts=True)
            kept["k_scale"], kept["k_zero"] = q["k_scale"][groups], q["k_zero"][groups]
            kept["k_group"] = new_index.to(INDEX)
            if pool.group_size and not bool((sizes == pool.group_size).all()):
                pool.group_size = 0  # a group lost part of its rows
        else:
            kept["k_scale"], kept["k_zero"] = q["k_scale"][keep], q["k_zero"][keep]
            kept["k_group"] = q["k_group"]
        pool.q = kept

    def _check_content(self) -> None:
        """Every accessible position is held exactly once, nothing else is; ``_held`` says
        which; the served buffer holds exactly the held rows (FP as stored, Q dequantized from
        the codes), bit for bit."""
        tiers = self.state.tiers[..., : self.seen]
        for layer, pool in enumerate(self.pools):
            held = np.zeros((2, *tiers.shape[1:]), dtype=np.int64)  # [FP / Q, kv_head, pos]
            np.add.at(held[0], (pool.fp_head.cpu().numpy(), pool.fp_pos.cpu().numpy()), 1)
            if pool.narrow is not None:
                np.add.at(held[0], (pool.narrow["n_head"].cpu().numpy(), pool.narrow["n_pos"].cpu().numpy()), 1)
            if pool.q is not None:
                np.add.at(held[1], (pool.q["q_head"].cpu().numpy(), pool.q["q_pos"].cpu().numpy()), 1)
            if pool.served is not None:  # set-wise by (head, position): the slots are a permutation
                heads, pos, *gathered = self._gathered(layer, pool.served.dtype)
                if not all(torch.equal(x, y) for x, y in zip(pool.served.rows(heads, pos), gathered)):
                    raise AssertionError(f"layer {layer}: the served rows differ from the held rows, dequantized")
            if not np.array_equal(held.sum(0), (tiers[layer] >= TIER_Q).astype(np.int64)):  # evicted: held 0 times
                raise AssertionError(f"layer {layer}: the cache's rows differ from the policy's tiers")
            if not np.array_equal(held > 0, self._held[:, layer, :, : self.seen]):
                raise AssertionError(f"layer {layer}: the cache's record of its rows differs from its rows")

    def _check_forward(self, layer: int, slot_pos: torch.Tensor) -> None:
        """What this forward attends to (``slot_pos [kv_head, W]``): every accessible position
        of the tiers now (after the append) once, nothing else."""
        slot_pos = slot_pos.cpu().numpy()
        heads, slots = np.nonzero(slot_pos >= 0)
        times = np.zeros((self.n_kv, self.seen), dtype=np.int64)
        np.add.at(times, (heads, slot_pos[heads, slots]), 1)
        if not np.array_equal(times, (self.state.tiers[layer, :, : self.seen] >= TIER_Q).astype(np.int64)):
            raise AssertionError(f"layer {layer}: this forward's keys differ from the policy's tiers")


@dataclass
class LivePolicy:
    """A cache factory for [`kvscope.trace`][kvscope.trace] (``cache=``): every batch decodes
    under a recording [`PolicyCache`][kvscope.live.PolicyCache] (tiers kept at every event,
    bytes at every step).

    Attributes:
        policy: A policy object, name or ``name:key=value:…`` (not a clairvoyant one).
        budget: β, a share of the full cache's bytes in (0, 1].
        kv_dtype: Storage of FP entries: ``model`` (the model's dtype), ``float16``,
            ``bfloat16`` or ``float32``.
        allocation: How β is split across layers and KV heads (a ``Given`` split may hold one
            per sample).
    """

    policy: Policy | str
    budget: float
    kv_dtype: str = "model"
    allocation: Allocation | str = "uniform"

    def __post_init__(self):
        self.policy = live_policy(self.policy)
        self.budget = check_budget(self.budget)
        self.allocation = live_allocation(self.allocation)
        check_allocatable([self.policy], [self.allocation])
        parse_kv_dtype(self.kv_dtype)

    def settings(self) -> dict:
        """What a resumed trace must match."""
        return {
            "policy": self.policy.label(), "budget": self.budget, "kv_dtype": self.kv_dtype,
            "allocation": self.allocation.label(),
        }  # fmt: skip

    def describe(self, model: PreTrainedModel) -> dict:
        """The store's ``policy`` attribute.

        Args:
            model: The loaded model (its dtype is the default storage of FP entries).
        """
        dtype = kv_storage_dtype(model, self.kv_dtype)
        return {
            "label": self.policy.label(),
            "name": self.policy.name,
            "params": self.policy.params(),
            "budget": self.budget,
            "allocation": self.allocation.label(),
            "kv_dtype": str(dtype).removeprefix("torch."),
            "kv_itemsize": dtype.itemsize,
        }

    def check_model(self, model: PreTrainedModel, spec: ModelSpec) -> None:
        """Refuse, before a trace writes anything, a model a live cache cannot serve (or a
        policy it cannot run there).

        Args:
            model: The loaded model.
            spec: Its geometry.

        Raises:
            KvscopeError: The model or the policy cannot run live.
        """
        check_live_geometry(model, spec)
        if getattr(self.policy, "renumbers", False):
            raise KvscopeError(
                f"{self.policy.label()} numbers the continuation from the rows it keeps (kvpress's protocol); "
                "kvscope trace decodes at the prompt's positions: use kvscope run"
            )
        self.policy.check_live(spec, Rope.from_model(model, spec.n_layers), loaded=model)

    def __call__(self, model, layout, batch: list[int]) -> PolicyCache:
        return PolicyCache(
            model, self.policy, self.budget, layout.n_steps, kv_dtype=parse_kv_dtype(self.kv_dtype),
            n_sink=layout.n_sink, w=layout.window, obs_window=layout.obs_window, every=layout.window, keep_tiers=True,
            allocation=self.allocation.for_sample(batch[0]),
        )  # fmt: skip
