"""Forced replay: the model's own output under each policy's cache, offline (docs/concepts.md#forced-replay).

For a sample with prompt ``0..P−1`` and continuation ``y_0 … y_{S−1}`` (the trace's tokens), the
forced decode under a policy is one forward of the continuation over the prompt's prefill cache in
which query ``t`` (position ``P − 1 + t``) sees, per layer and cache unit, what the policy's tier
map ``T_t`` holds after it appended position ``P − 1 + t``::

    FP          the key/value as this forward computes it
    Q           the values the policy's write-once ledger quantized (the quantizer of
                docs/concepts.md#quantizer, applied to this forward's own K/V of the position, from
                the step the ledger quantized it on: after a decision at step t, from query t + 1)
    EVICTED     masked

    kl_t   = KL(softmax z*_t ‖ softmax z_t)          nats (z*: the same forward under full KV)
    nll_t  = −log softmax(z_t)[y_t]
    top1_t = [argmax z_t = argmax z*_t]

Step 0 is the prefill's last row: every policy compresses after the prefill, so ``z_0 = z*_0``.

Closed loop. A policy that decides from what its cache served (``observes``: H2O, QEvict) or reads
each decode forward's tensors (kvpress's DecodingPress) changes its tier maps with the rows the
forward produces. The steps go in chunks of ``chunk``; in each, round 0 drives the policy on the
recorded full-KV rows restricted to its cache and renormalized (ordinary replay's ``observe=renorm``),
the chunk's forward runs under those maps, and round ``r + 1`` drives it again (from its state at
the chunk's start) on the rows the queries of round ``r`` really saw. When a round's tier maps (and
quantized groups) equal the previous round's, that forward is the live closed-loop forced decode
exactly — by causality a round makes one more step exact, so a chunk of ``c`` steps converges in at
most ``c + 1`` rounds. A chunk still changing after ``max_rounds`` keeps its last round and the
sample is marked not converged. Policies whose maps do not depend on the decode (prompt-time
policies and presses, StreamingLLM, KIVI, LogQuant) need one round; the clairvoyant oracle's maps
come from the recorded future (open loop) and are labelled so.

Attention is the rule of ``kvscope.model.attention`` (fp32 logits and softmax, ``out = a·V`` in
the value's dtype, learned sinks and softcapping as the layer has them), through transformers'
``AttentionInterface`` (``kvscope.tracing.capture.attention_override``); the model classes are
not changed. Memory: a chunk's tier maps ``[chunk, layer, unit, P + S]`` and rows, never an
``[S, S]`` mask.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import KvscopeError
from ..policies import parse
from ..policies.driver import PolicyDriver
from ..tiers import TIER_Q
from .output_error import renormalized
from .reader import SampleReader

FOREVER = np.iinfo(np.int64).max  # a position never quantized


def check_forced(chunk: int, max_rounds: int) -> tuple[int, int]:
    """The forced-replay settings, checked where they are defined."""
    for name, value in (("forced chunk", chunk), ("max rounds", max_rounds)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise KvscopeError(f"{name} must be an integer ≥ 1 (got {value!r})")
    return int(chunk), int(max_rounds)


# -- the model --------------------------------------------------------------------------------


@dataclass
class ForcedModel:
    """The trace's own model, loaded once per replay, attending through kvscope's function."""

    model: object
    spec: object  # ModelSpec as inspected
    label: str
    tokenizer: object = None

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def rope(self):
        """The model's rotary parameters where the ledger can quantize keys before RoPE (as a live
        cache does), else None."""
        from ..model.rope import Rope

        rope = Rope.from_model(self.model, self.spec.n_layers)
        return rope if rope.usable() else None

    @property
    def itemsize(self) -> int:
        """Bytes of one K/V element in the model's own cache (its dtype)."""
        return next(self.model.parameters()).dtype.itemsize


def load_model(ds, device: str | None = None) -> ForcedModel:
    """Load the model a trace was recorded with (its ``settings``), checked against what the trace
    says of it (weights' sha256, geometry); refused in one line where it is gone or differs."""
    from ..model.loading import load, resolve
    from ..tracing.architecture import inspect
    from ..tracing.capture import implementation_name, register

    settings = ds.attrs.get("settings") or {}
    recorded = ds.attrs.get("model") or {}
    name = settings.get("model") or recorded.get("name")
    if not name:
        raise KvscopeError(
            "forced replay needs the trace's model, and the trace does not name it (attrs settings.model)"
        )
    try:
        source = resolve(str(name), allow_hub=True)
    except KvscopeError as exc:
        raise KvscopeError(f"forced replay needs the trace's model {name!r}, which cannot be loaded: {exc}") from None
    if recorded.get("sha256") and source.weights_sha256 and source.weights_sha256 != recorded["sha256"]:
        raise KvscopeError(
            f"forced replay: the model {name!r} found now is not the one the trace recorded "
            f"(weights sha256 {source.weights_sha256[:12]}… against {recorded['sha256'][:12]}…)"
        )
    kernel = settings.get("attn", "sdpa")
    model, tokenizer = load(source, device or settings.get("device", "cpu"), settings.get("model_dtype", "auto"),
                            bool(settings.get("trust_remote_code", False)))  # fmt: skip
    register()
    model.set_attn_implementation(implementation_name(kernel))
    spec = inspect(model, kernel)
    _check_geometry(spec, ds.kvscope.model, name)
    forced = ForcedModel(model, spec, str(name), tokenizer)
    check_continuations(ds, forced)
    return forced


def check_continuations(ds, forced: ForcedModel) -> None:
    """A trace that forced given continuations: each recorded text still tokenizes to the stored
    tokens with the loaded model's tokenizer (else the forced replay would score another text)."""
    acc = ds.kvscope
    if not acc.continued:
        return
    prompts = ds.attrs.get("prompts") or []
    for s, n in enumerate(acc.continuation_tokens):
        text = (prompts[s] if s < len(prompts) else {}).get("continuation")
        start = int(acc.prompt_len[s] + acc.question_tokens[s])
        stored = [int(x) for x in ds["tokens"].values[s, start : start + int(n)]]
        ids = forced.tokenizer(text or "", add_special_tokens=False)["input_ids"][: int(n)]
        if not isinstance(text, str) or ids != stored:
            raise KvscopeError(
                f"forced replay: sample {s}'s recorded continuation does not match the trace's tokens with the "
                f"tokenizer of {forced.label!r} (the trace holds {len(stored)} forced tokens)"
            )


def _check_geometry(spec, traced, name: str) -> None:
    """The loaded model caches what the trace says it does (else refused, naming what differs)."""
    if spec.from_weights:
        raise KvscopeError(
            f"forced replay serves each policy's cache through kvscope's attention function; "
            f"{spec.architecture or name} attends in its own modules"
        )
    mine = (spec.n_layers, spec.n_kv_heads, spec.head_dim)
    theirs = (traced.n_layers, traced.n_kv_heads, traced.head_dim)
    if mine != theirs:
        raise KvscopeError(
            f"forced replay: the model {name!r} loaded now has (layers, cache units, head_dim) {mine}, "
            f"the trace {theirs}"
        )


# -- one sample -------------------------------------------------------------------------------


@dataclass
class Prefill:
    """The prompt's forward, shared by every run of a sample."""

    cache: object  # the transformers cache after the prompt
    logits: object  # [vocab] float32: step 0's logits (the prefill's last position)
    colsum: np.ndarray | None  # [layer, unit, P] float64 (None: not recorded, nobody reads it)
    tail: np.ndarray | None  # [layer, unit, obs, P] float32
    qkv: tuple | None  # (keys, values [layer, unit, P, D] tensors, queries [P, layer, head, D]) for presses


class SampleForcing:
    """Sample ``s`` of a replay ``setup`` under the loaded ``forced`` model: its prefill, its full-KV
    reference, then any policy's forced decode (``ForcedRun.run``). What the runs read: the
    prompt's attention (``prompt_attention``: a policy or allocation), each forward's q/k/v
    (``decoding_presses``: a kvpress press that acts while decoding — the prefill keeps the
    prompt's, the reference each step's)."""

    def __init__(self, setup, s: int, forced: ForcedModel, chunk: int, max_rounds: int,
                 prompt_attention: bool = True, decoding_presses: bool = True):  # fmt: skip
        import torch

        acc = setup.ds.kvscope
        self.setup, self.s, self.forced = setup, s, forced
        self.chunk, self.max_rounds = chunk, max_rounds
        self.P, self.S = int(acc.prompt_len[s]), int(acc.n_steps[s])
        tokens = np.asarray(setup.ds["tokens"].values[s, : self.P + self.S], dtype=np.int64)
        self.prompt = torch.from_numpy(tokens[: self.P])
        self.continuation = torch.from_numpy(tokens[self.P :])  # [S] y_0 … y_{S−1}
        self.first_scored = int(acc.question_tokens[s])  # question-agnostic: the question's steps are not scored
        self.reader = SampleReader(setup.ds, s, setup.group)
        self.model_spec = acc.model
        self.rope = forced.rope
        self.feeds_needed = decoding_presses
        self.prompt_attention = prompt_attention
        self._prefill_done: Prefill | None = None  # the prompt's forward, shared by every run
        self.reference: np.ndarray | None = None  # [S, vocab] float32 log-probabilities under full KV
        self.reference_feeds: list | None = None  # per step (keys, values, queries) of the full-KV forward
        self._capture = None

    @property
    def final_len(self) -> int:
        return self.P + self.S

    def start(self) -> None:
        """The full-KV reference (after the prefill)."""
        full = ForcedRun(self, parse("full"), None, 1.0)
        full.run(keep_logits=True)
        self.reference = full.log_probs
        self.reference_feeds = full.feeds
        self._check_tokens()

    @property
    def prefill(self) -> Prefill:
        """The prompt's forward, made once: its layers' outputs by the model's kernel (as a live
        cache computes them under every policy), with the prompt's attention where
        ``prompt_attention``."""
        if self._prefill_done is None:
            self._prefill_done = self._prefill()
        return self._prefill_done

    def _prefill(self, capture: bool = False) -> Prefill:
        """The prompt's forward (``prefill``); with ``capture`` the same forward keeps what each
        layer's press hook is handed (``self._capture``)."""
        import torch
        from transformers import DynamicCache

        from ..model.spec import last_logits_only, returned_cache, with_cache
        from ..policies.press_hooks import PrefillCapture
        from ..tracing.capture import AttentionRecorder, ForwardContext

        model, spec = self.forced.model, self.model_spec
        observed = self.prompt_attention
        recorder = AttentionRecorder(
            n_layers=spec.n_layers, n_stored_heads=spec.n_kv_heads, obs_window=self.setup.ds.kvscope.obs_window,
            record_qkv=self.feeds_needed, n_units=spec.n_kv_heads, probabilities=observed,
            layer_slots={layer: i for i, layer in enumerate(spec.layer_index)} if spec.attention_layers else None,
        )  # fmt: skip
        recorder.begin(ForwardContext(seq_len=self.P, pad=torch.zeros(1, dtype=torch.long)))
        ids = self.prompt[None].to(self.forced.device)
        done = {}

        def forward():
            with torch.no_grad(), recorder.active():
                done["out"] = model(input_ids=ids, use_cache=True, **last_logits_only(model),
                                    **with_cache(model, DynamicCache(config=model.config)))  # fmt: skip
            return returned_cache(done["out"])

        if capture:
            self._capture = PrefillCapture(model, self.prompt.tolist(), spec=spec, tokenizer=self.forced.tokenizer,
                                           forward=forward)  # fmt: skip
        else:
            forward()
        out = done["out"]
        colsum, tail = recorder.prompt_attention() if observed else (None, None)
        qkv = recorder.forward_tensors() if self.feeds_needed else None
        return Prefill(returned_cache(out), out.logits[0, -1].float().cpu(), colsum, tail, qkv)

    def _check_tokens(self) -> None:
        """The trace's greedy tokens are this model's greedy choices under full KV (else the model,
        or its weights, differ from the recording's); sampled traces and forced question steps are
        not checked."""
        gen = self.setup.ds.attrs.get("generation") or {}
        if gen.get("sampling") or self.setup.ds.kvscope.continued:  # sampled, or a given text: not greedy
            return
        y = self.continuation.numpy()
        logp = self.reference  # [S, vocab]
        chosen = logp[np.arange(self.S), y]
        best = logp.max(-1)
        slack = 1e-3 if self.forced.itemsize >= 4 else 5e-2
        wrong = np.flatnonzero((chosen < best - slack) & (np.arange(self.S) >= self.first_scored))
        if wrong.size:
            t = int(wrong[0])
            raise KvscopeError(
                f"forced replay: sample {self.s}'s token at step {t} ({int(y[t])}) is not the greedy choice of the "
                f"model {self.forced.label!r} loaded now (log-probability {chosen[t]:.4f} against {best[t]:.4f}): "
                "the trace was recorded with other weights, dtype or kernel"
            )

    def capture(self):
        """The prompt's prefill on the model with what each layer's press hook is handed kept
        (``PrefillCapture``), made once per sample: prompt-time presses decide from it, as their
        hook does on a live prefill. It is the prefill's own forward where that is still to run
        (runs are made before ``start``), else a forward of its own."""
        if self._capture is None:
            from ..policies.press_hooks import PrefillCapture

            if self._prefill_done is None:
                self._prefill_done = self._prefill(capture=True)
            else:
                self._capture = PrefillCapture(self.forced.model, self.prompt.tolist(), spec=self.model_spec,
                                               tokenizer=self.forced.tokenizer)  # fmt: skip
        return self._capture

    def spec(self, budget: float):
        """The cache spec of a run (the replay's: full-precision entries counted at its ``kv_itemsize``,
        by default the model's own dtype under forced replay, as ``kvscope run`` counts them)."""
        return self.setup.spec(self.s, budget)

    def perplexity_full(self) -> float:
        """``exp(mean −log p*(y_t))`` over the scored steps under full KV."""
        steps = np.arange(self.first_scored, self.S)
        return math.exp(float(-self.reference[steps, self.continuation.numpy()[steps]].mean()))


# -- one run ----------------------------------------------------------------------------------


class Quantized:
    """Groups one ledger quantized in one stored layer, by group size ``G``: ``positions [n, G]``,
    ``heads [n]`` and ``visible [n]`` — the first step whose query sees them dequantized."""

    def __init__(self):
        self.parts: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}

    def add(self, positions: np.ndarray, heads: np.ndarray, visible: int) -> None:
        seen = np.full(len(heads), visible, dtype=np.int64)
        self.parts.setdefault(positions.shape[1], []).append((positions, heads, seen))

    def arrays(self):
        """``[(positions [n, G], heads [n], visible [n])]``, one per group size."""
        return [tuple(np.concatenate(x) for x in zip(*parts)) for _, parts in sorted(self.parts.items())]

    def signature(self) -> tuple:
        return tuple(x.tobytes() for got in self.arrays() for x in got)


class QuantLog:
    """Every quantization of a ledger, with the step from which its values are served."""

    def __init__(self, n_layers: int):
        self.layers = [Quantized() for _ in range(n_layers)]
        self.visible = 0  # set by the driver loop: quantizations now are served from this step on

    def __call__(self, positions, layers, heads) -> None:  # the ledger's sink
        positions, layers, heads = (np.asarray(x, dtype=np.int64) for x in (positions, layers, heads))
        for layer in np.unique(layers):
            at = layers == layer
            self.layers[int(layer)].add(positions[at], heads[at], self.visible)

    def signature(self) -> tuple:
        return tuple(q.signature() for q in self.layers)


class ServedQuantized:
    """What one run's queries see of the positions its ledger quantized, per stored layer: the
    dequantized K/V of each group (the ledger's quantizer applied to the forward's own K/V of its
    positions) and ``since [unit, P + S]``, the first step that sees them.

    Groups quantized before a chunk (``close_chunk``) are final: their positions' K/V are the cache's
    and no longer change, so they are dequantized once and kept (``[unit, P + S, D]`` per layer).
    A chunk's own groups may change from round to round: those of positions before the chunk are
    dequantized once per chunk (by group), those holding the chunk's own positions on every forward."""

    def __init__(self, run: ForcedRun):
        self.run = run
        self.kept: dict[int, tuple] = {}  # layer → (keys, values [unit, P + S, D] tensors, since [unit, P + S])
        self.final: list[dict[int, int]] = [{} for _ in run.log.layers]  # layer → G → groups final
        self.done: list[dict[int, int]] = [{} for _ in run.log.layers]  # layer → G → groups kept
        self.chunk_first = 0  # the chunk's first position
        self.chunk_groups: dict[tuple, tuple] = {}  # (layer, head, positions) → (k̂, v̂ [G, D]) of the chunk

    def close_chunk(self, first: int) -> None:
        """The groups quantized so far are final (the next chunk's forwards keep their values); the
        next chunk's first position is ``first``."""
        self.chunk_first, self.chunk_groups = first, {}
        for layer, quantized in enumerate(self.run.log.layers):
            self.final[layer] = {G: sum(len(h) for _, h, _ in parts) for G, parts in quantized.parts.items()}

    def served(self, layer: int, keys, values, first: int, steps: range):
        """``(k̂, v̂ [keys, kv, D], since [keys, kv])`` for the key slots ``first …`` of this forward
        (``keys``, ``values`` the K/V it hands attention), or None where nothing is quantized."""
        import torch

        groups_by_size = self.run.log.layers[layer].arrays()
        if not groups_by_size:
            return None
        kv = keys.shape[1]
        finals = self._final_counts(layer)  # [(G, groups final)] in the order of groups_by_size
        k_kept, v_kept, since_kept = self._kept(layer, groups_by_size, finals, keys, values, first)
        k_hat, v_hat = k_kept[:, first : first + kv], v_kept[:, first : first + kv]
        since = since_kept[:, first : first + kv]
        current = [(g[n:], h[n:], v[n:]) for (g, h, v), (_, n) in zip(groups_by_size, finals)]
        current = [(g, h, v) for g, h, v in current if len(h)]
        if current:
            k_hat, v_hat, since = k_hat.clone(), v_hat.clone(), since.copy()
        for groups, heads, visible in current:
            keep = (visible < steps.stop) & (groups.min(1) >= first)  # seen in this chunk, keys handed over
            if keep.any():
                groups, heads, visible = groups[keep], heads[keep], visible[keep]
                self._chunk_roundtrip(layer, groups, heads, first, (keys, values), (k_hat, v_hat))
                since[heads[:, None], groups - first] = visible[:, None]
        return k_hat, v_hat, torch.from_numpy(since)

    def _chunk_roundtrip(self, layer: int, groups: np.ndarray, heads: np.ndarray, first: int, kv, out) -> None:
        """``_roundtrip`` of a chunk's groups, those of positions before the chunk once per chunk."""
        settled = groups.max(1) < self.chunk_first
        if not settled.all():
            self._roundtrip(layer, groups[~settled], heads[~settled], first, kv, out)
        if not settled.any():
            return
        groups, heads = groups[settled], heads[settled]
        names = [(layer, int(h), g.tobytes()) for h, g in zip(heads, groups)]
        new = [i for i, name in enumerate(names) if name not in self.chunk_groups]
        if new:
            k_hat, v_hat = self._dequantized(layer, groups[new], heads[new], first, kv)
            for j, i in enumerate(new):
                self.chunk_groups[names[i]] = (k_hat[j], v_hat[j])
        got = [self.chunk_groups[name] for name in names]
        self._write(out, groups, heads, first, np.stack([k for k, _ in got]), np.stack([v for _, v in got]))

    def _final_counts(self, layer: int) -> list[tuple[int, int]]:
        """``[(G, groups final)]`` by group size, as ``Quantized.arrays`` orders them."""
        return [(G, self.final[layer].get(G, 0)) for G in sorted(self.run.log.layers[layer].parts)]

    def _kept(self, layer: int, groups_by_size, finals, keys, values, first: int):
        """The layer's kept values, with the final groups not yet kept dequantized now."""
        import torch

        if layer not in self.kept:
            n, units = self.run.sample.final_len, keys.shape[0]
            self.kept[layer] = (
                torch.zeros((units, n, keys.shape[-1]), dtype=keys.dtype, device=keys.device),
                torch.zeros((units, n, values.shape[-1]), dtype=values.dtype, device=values.device),
                np.full((units, n), FOREVER, dtype=np.int64),
            )
        k_kept, v_kept, since = self.kept[layer]
        for (groups, heads, visible), (G, n_final) in zip(groups_by_size, finals):
            n_done = self.done[layer].get(G, 0)
            if n_final <= n_done:
                continue
            groups, heads, visible = groups[n_done:n_final], heads[n_done:n_final], visible[n_done:n_final]
            self.done[layer][G] = n_final
            handed = groups.min(1) >= first  # a sliding window's dropped positions are never seen again
            groups, heads, visible = groups[handed], heads[handed], visible[handed]
            if len(heads):
                window = (k_kept[:, first : first + keys.shape[1]], v_kept[:, first : first + keys.shape[1]])
                self._roundtrip(layer, groups, heads, first, (keys, values), window)
                since[heads[:, None], groups] = visible[:, None]
        return k_kept, v_kept, since

    def _roundtrip(self, layer: int, groups: np.ndarray, heads: np.ndarray, first: int, kv, out) -> None:
        """The groups ``positions [n, G]`` of ``heads [n]`` quantized and dequantized by the ledger
        (the quantizer of docs/concepts.md#quantizer) from this forward's own K/V ``kv`` (key slots
        from position ``first``), into ``out`` (the same slots)."""
        self._write(out, groups, heads, first, *self._dequantized(layer, groups, heads, first, kv))

    def _dequantized(self, layer: int, groups: np.ndarray, heads: np.ndarray, first: int, kv) -> tuple:
        """``(k̂, v̂ [n, G, D])`` float32 of the groups (``_roundtrip``)."""
        import torch

        slots, hh = torch.from_numpy(groups - first), torch.from_numpy(heads)[:, None]  # [n, G], [n, 1]
        keys, values = (x[hh, slots].float().cpu().numpy() for x in kv)  # [n, G, D]
        return self.run.state.ledger.dequantized(keys, values, groups, np.full(len(groups), layer))

    @staticmethod
    def _write(out, groups: np.ndarray, heads: np.ndarray, first: int, k_hat, v_hat) -> None:
        import torch

        slots, hh = torch.from_numpy(groups - first), torch.from_numpy(heads)[:, None]
        for target, got in zip(out, (k_hat, v_hat)):
            target[hh, slots] = torch.from_numpy(got).to(target.dtype).to(target.device)


def _start(policy, spec, sample: SampleForcing):
    """The policy's state for a forced decode, as a live cache would drive it: a prompt-time kvpress
    press decides from its hook on the model's own prefill (``PrefillCapture``); a press that acts
    while decoding runs on stand-ins fed the prompt's and each step's own q/k/v (filled in as the
    forced decode computes them)."""
    if not policy.reads_queries:
        return policy.start(spec, rope=sample.rope)
    model = sample.model_spec
    if not decoding_press(policy):
        return policy.start(spec, rope=sample.rope, model=model, capture=sample.capture())
    import torch

    n = spec.final_len
    keys = torch.zeros((model.n_layers, model.n_kv_heads, n, model.head_dim))  # [layer, kv_head, pos, D]
    values = torch.zeros((model.n_layers, model.n_kv_heads, n, model.v_dim))
    queries = np.zeros((n, model.n_layers, model.n_heads, model.head_dim), dtype=np.float32)  # [qpos, layer, head, D]
    return policy.start(spec, keys, values, sample.rope, queries, model)


def decoding_press(policy) -> bool:
    """A kvpress press that acts while decoding (it reads each decode forward's q/k/v)."""
    from ..policies.press_hooks import decodes

    return policy.reads_queries and decodes(policy.make_press())


def reads_prompt(policy, allocation) -> bool:
    """The run reads the prompt's attention (its policy, or the allocation's scores)."""
    return policy.observes or policy.observes_prefill or (allocation is not None and allocation.reads == "scores")


def reads_decodes(state) -> bool:
    """The state reads each decode forward's q/k/v (a decoding press on stand-ins)."""
    return getattr(state, "runner", None) is not None and state.decodes


class ForcedRun:
    """One (policy, allocation, budget) on one sample: its closed-loop forced decode (module docstring).

    After ``run``: ``kl``, ``nll``, ``top1`` ``[S]``, ``rounds`` (most rounds of any chunk),
    ``converged``; with ``keep_logits`` the log-probabilities ``[S, vocab]``, and ``feeds`` (each decode
    forward's q/k/v) where the sample needs them."""

    def __init__(self, sample: SampleForcing, policy, allocation, budget: float, split=None):
        from ..policies.allocation import Given, Uniform

        self.sample, self.policy = sample, policy
        spec = sample.spec(budget)
        state = _start(policy, spec, sample)
        allocation = allocation.for_sample(sample.s) if allocation is not None else Uniform()
        if allocation.clairvoyant:
            allocation = Given.of(split)
        self.driver = PolicyDriver(state, allocation=allocation, where=f" of sample {sample.s} (forced)")
        self.log = QuantLog(spec.n_layers)
        self.depends = policy.observes or reads_decodes(state)  # its maps change with what the decode computes
        self.pressed = None  # the cache a prompt-time press left, where it rewrote what it kept
        if (reads_prompt(policy, allocation) and not sample.prompt_attention) or (
            reads_decodes(state) and not sample.feeds_needed
        ):
            raise ValueError(f"sample {sample.s} was prefilled without what {policy.label()} reads")
        self.futures = {}
        if policy.clairvoyant:
            self.futures = {policy.horizon: sample.reader.future(policy.horizon)}
        S = sample.S
        self.kl, self.nll, self.top1 = np.zeros(S), np.zeros(S), np.ones(S, dtype=bool)
        self.rounds, self.converged = 1, True
        self.log_probs = None
        self.feeds = None
        self.quantized: ServedQuantized | None = None  # during ``run``, where the ledger quantizes
        self._rows_buffer: np.ndarray | None = None

    @property
    def state(self):
        return self.driver.state

    @property
    def prefill(self) -> Prefill:
        return self.sample.prefill

    # -- driving the policy ---------------------------------------------------------------------
    def _future(self, t: int):
        return self.futures[self.policy.horizon].at(t) if self.futures else None

    def _begin(self) -> None:
        """Step 0: the policy takes the prompt (its attention, its q/k/v for a press)."""
        pre, st = self.prefill, self.state
        if st.ledger is not None:
            st.ledger.sink = self.log
        if reads_decodes(st):  # a decoding press on the recording's stand-ins: the prompt's tensors first
            keys, values, queries = st.recorded
            p = self.sample.P
            keys[:, :, :p], values[:, :, :p], queries[:p] = pre.qkv[0], pre.qkv[1], pre.qkv[2]
        self.log.visible = 1
        self.driver.prefill(pre.colsum, pre.tail, self._future(0))
        pressed = getattr(st, "pressed", None)
        if pressed is not None and pressed.rewrites:
            self.pressed = pressed

    def _drive(self, steps: range, rows, feeds) -> np.ndarray:
        """The policy through ``steps`` (append, then decide on ``rows(t, state)``); returns the tier
        maps the steps' queries see ``[step, layer, unit, P + S]``."""
        st, sample = self.state, self.sample
        maps = np.empty((len(steps), *st.tiers.shape), dtype=np.int8)
        for i, t in enumerate(steps):
            self.log.visible = t
            self.driver.append(sample.P - 1 + t)
            maps[i] = st.tiers
            self.log.visible = t + 1
            if reads_decodes(st):  # the step's own q/k/v where its press reads them
                keys, values, queries = st.recorded
                k, v, q = feeds(t)
                at = sample.P - 1 + t
                keys[:, :, at], values[:, :, at], queries[at] = k[:, :, 0], v[:, :, 0], q[0]
            self.driver.decide(rows(t, st) if self.policy.observes else None, self._future(t))
            if reads_decodes(st) and st.rewrites:
                raise KvscopeError(
                    f"press {self.policy.press} rewrites what it keeps while decoding ({', '.join(sorted(st.rewrites))}"
                    "): forced replay serves a press's rewrites of the prompt's cache, not those made while decoding"
                )
        return maps

    def _recorded_rows(self, t: int, st) -> np.ndarray:
        """Round 0's observation: the recorded full-KV row restricted to the cache, renormalized."""
        reader = self.sample.reader
        return renormalized(reader.row(t)[..., : st.length], st.accessible(), reader.share(t))

    def _snapshot(self):
        """The driver and the quantization log, copied (the ledger's sink detached meanwhile)."""
        ledger = self.state.ledger
        if ledger is not None:
            ledger.sink = None
        saved = copy.deepcopy((self.driver, self.log))
        if ledger is not None:
            ledger.sink = self.log
        return saved

    def _restore(self, saved) -> None:
        self.driver, self.log = copy.deepcopy(saved)
        if self.state.ledger is not None:
            self.state.ledger.sink = self.log

    # -- the forced decode ----------------------------------------------------------------------
    def run(self, keep_logits: bool = False) -> ForcedRun:
        import torch

        sample = self.sample
        self._begin()
        cache = copy.deepcopy(self.prefill.cache) if self.pressed is None else self._pressed_cache()
        quantizes = self.state.ledger is not None and self.pressed is None
        self.quantized = ServedQuantized(self) if quantizes else None
        logits0 = torch.log_softmax(self.prefill.logits, -1)
        if keep_logits:
            self.log_probs = np.empty((sample.S, logits0.shape[-1]), dtype=np.float32)
            self.log_probs[0] = logits0.numpy()
        if sample.feeds_needed and keep_logits:
            self.feeds = [None] * sample.S
        self.nll[0] = float(-logits0[int(sample.continuation[0])])
        for c0 in range(1, sample.S, sample.chunk):
            steps = range(c0, min(sample.S, c0 + sample.chunk))
            cache = self._chunk(steps, cache, keep_logits)
        self.quantized = self._rows_buffer = None
        return self

    def _pressed_cache(self):
        """The continuation's past where a prompt-time press rewrote what it kept (re-rotated or
        merged keys and values, pruned key channels): each layer holds the rows the press left, as
        it left them (masked rows too: their tiers hide them)."""
        from transformers.cache_utils import DynamicLayer

        cache = copy.deepcopy(self.prefill.cache)
        spec = self.sample.model_spec
        for stored, pressed in enumerate(self.pressed.layers):
            layer = cache.layers[spec.model_layer(stored)]
            if type(layer) is not DynamicLayer:
                raise KvscopeError(
                    f"forced replay serves {self.policy.label()}'s own rewritten cache on layers that keep every "
                    f"position; this model's layer {spec.model_layer(stored)} is a {type(layer).__name__}"
                )
            layer.keys = pressed.keys[None].to(layer.keys.dtype)  # [1, kv_head, n, D]
            layer.values = pressed.values[None].to(layer.values.dtype)
        return cache

    def slot_positions(self, layer: int, kv: int, seq: int) -> np.ndarray:
        """``[unit | kv_head, kv]`` the position each key slot a layer hands attention holds: the
        cache's last ``kv`` slots of a sequence of ``seq`` (every head alike), or, past a press that
        rewrote its cache, the rows it kept and then the continuation's."""
        if self.pressed is None:
            return np.arange(seq - kv, seq)[None]
        kept = self.pressed.layers[layer].positions.cpu().numpy()  # [kv_head, n]
        new = np.arange(self.sample.P, self.sample.P + kv - kept.shape[1])
        return np.concatenate([kept, np.broadcast_to(new, (kept.shape[0], len(new)))], axis=1)

    def _chunk(self, steps: range, cache, keep_logits: bool):
        """One chunk of steps, in rounds until its tier maps stop changing; returns the cache after it."""
        saved = self._snapshot() if self.depends else None
        if self.quantized is not None:
            self.quantized.close_chunk(self.sample.P - 1 + steps.start)
        self._chunk_start = cache.get_seq_length()
        mark = _Checkpoint(cache, self._chunk_start, again=self.depends)
        feeds = self.sample.reference_feeds
        maps = self._drive(steps, self._recorded_rows, lambda t: feeds[t])
        signature = self.log.signature()
        seen, first = None, 0  # the round's forward; the first step whose maps changed since the last
        for rounds in range(1, self.max_rounds + 1):
            seen = self._forward(steps, maps, mark.cache, self.policy.observes, seen, first)
            if not self.depends:
                break
            self._restore(saved)
            again = self._drive(steps, *seen.observations(steps.start))
            same_log = self.log.signature() == signature
            if same_log and np.array_equal(again, maps):
                break
            if rounds == self.max_rounds:
                self.converged = False
                break
            # by causality the steps before the first changed map saw the same cache: they are kept
            first = int(np.argmax((again != maps).reshape(len(again), -1).any(1))) if same_log else 0
            maps, signature = again, self.log.signature()
            mark.rewind(first)
        self.rounds = max(self.rounds, rounds)
        self._score(steps, seen.log_probs, keep_logits)
        if keep_logits and self.feeds is not None:
            self.feeds[steps.start : steps.stop] = seen.feeds
        return mark.cache

    @property
    def max_rounds(self) -> int:
        return self.sample.max_rounds

    def _forward(self, steps: range, maps: np.ndarray, cache, observe: bool, before=None, first: int = 0) -> ChunkSeen:
        """The chunk's forward under ``maps``; returns its log-probabilities, the rows its queries saw
        (``observe``) and its new positions' q/k/v (where a policy reads them). With ``before`` (the
        previous round's) and ``first``: only the steps from the chunk's ``first`` on are run again
        (``cache`` holds the ones before), the earlier ones kept from ``before`` (its rows written over
        from ``first`` on)."""
        if before is not None and first > 0 and cache.get_seq_length() == self._chunk_start + first:
            rows = None if before.rows is None else before.rows[first:]
            again = self._forward_all(steps[first:], maps[first:], cache, rows)
            return before.joined(first, again)
        return self._forward_all(steps, maps, cache, self._rows(len(steps), maps.shape[1:]) if observe else None)

    def _rows(self, n: int, shape: tuple) -> np.ndarray:
        """``[n, layer, unit, P + S]`` float32 for a forward's rows: one buffer of the run, reused by
        every chunk (the rows of a chunk are read before the next one starts)."""
        if self._rows_buffer is None or self._rows_buffer.shape[1:] != shape:
            self._rows_buffer = np.zeros((self.sample.chunk, *shape), dtype=np.float32)
        return self._rows_buffer[:n]

    def _forward_all(self, steps: range, maps: np.ndarray, cache, rows: np.ndarray | None) -> ChunkSeen:
        """The forward of ``steps`` under ``maps``, the rows its queries see written into ``rows``."""
        import torch

        from ..model.spec import with_cache
        from ..tracing.capture import attention_override

        sample = self.sample
        model = sample.forced.model
        attention = ChunkAttention(self, steps, maps, rows, feeds=sample.feeds_needed)
        ids = sample.continuation[steps.start - 1 : steps.stop - 1][None].to(sample.forced.device)
        where = {}
        if self.pressed is not None and self.pressed.first_position != sample.P:  # the press renumbered the rows
            first = self.pressed.first_position + steps.start - 1
            where["position_ids"] = torch.arange(first, first + len(steps), device=ids.device)[None]
        with torch.no_grad(), attention_override(attention):
            out = model(input_ids=ids, use_cache=True, **with_cache(model, cache), **where)
        log_probs = torch.log_softmax(out.logits[0].float(), -1).cpu()
        return ChunkSeen(log_probs, attention.rows, attention.step_feeds())

    def _score(self, steps: range, log_probs, keep_logits: bool) -> None:
        """kl, nll, top1 of the chunk's steps against the full-KV reference."""
        import torch

        sample = self.sample
        at = slice(steps.start, steps.stop)
        y = sample.continuation[at]
        self.nll[at] = (-log_probs.gather(-1, y[:, None])[:, 0]).numpy()
        if sample.reference is not None:
            ref = torch.from_numpy(sample.reference[at])
            self.kl[at] = (ref.exp() * (ref - log_probs)).sum(-1).numpy()
            self.top1[at] = (ref.argmax(-1) == log_probs.argmax(-1)).numpy()
        if keep_logits:
            self.log_probs[at] = log_probs.numpy()

    # -- per sample -----------------------------------------------------------------------------
    def summary(self) -> dict:
        """Mean KL, perplexity ``exp(mean nll)`` and top-1 agreement over the scored steps."""
        scored = slice(self.sample.first_scored, self.sample.S)
        return {
            "kl": float(self.kl[scored].mean()),
            "perplexity": float(math.exp(self.nll[scored].mean())),
            "agreement": float(self.top1[scored].mean()),
        }


@dataclass
class ChunkSeen:
    log_probs: object  # [chunk, vocab] float32 tensor
    rows: np.ndarray | None  # [chunk, layer, unit, P + S] the kv-group rows the queries saw
    feeds: list | None  # per step (keys, values [layer, unit, 1, D], queries [1, layer, head, D])

    def observations(self, start: int):
        """``(rows(t, state), feeds(t))`` of the chunk beginning at step ``start``: what its queries saw,
        as a policy is driven on it (the rows up to the state's length)."""
        return (lambda t, st: self.rows[t - start][..., : st.length]), (lambda t: self.feeds[t - start])

    def joined(self, first: int, later: ChunkSeen) -> ChunkSeen:
        """This round's steps before ``first`` and ``later``'s from there."""
        import torch

        rows = self.rows  # later's were written into it
        feeds = None if self.feeds is None else self.feeds[:first] + later.feeds
        return ChunkSeen(torch.cat([self.log_probs[:first], later.log_probs]), rows, feeds)


class _Checkpoint:
    """The cache as it was before a chunk, to run the chunk again: cropped back where every layer
    holds all its positions (a plain ``DynamicLayer``), else a copy taken now (sliding windows drop
    positions, recurrent layers keep a state)."""

    def __init__(self, cache, length: int, again: bool):
        from transformers.cache_utils import DynamicLayer

        self.cache, self.length = cache, length
        layers = getattr(cache, "layers", None) or []
        self.croppable = bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
        self.copy = copy.deepcopy(cache) if again and not self.croppable else None

    def rewind(self, steps: int = 0) -> None:
        """Back to the chunk's start, or ``steps`` into it where the cache can be cropped."""
        if self.croppable:
            self.cache.crop(self.length + steps - self.cache.get_seq_length())  # tokens to remove, negative
        else:
            self.cache = copy.deepcopy(self.copy)


# -- the attention of a chunk -----------------------------------------------------------------


class ChunkAttention:
    """Every attention layer's output for a chunk of forced steps under their tier maps (called by
    kvscope's attention function while ``kvscope.tracing.capture.attention_override`` holds it).

    Key slot ``j`` of the ``kv`` the layer hands over holds position ``seq − kv + j`` (the cache's
    last slots: all of them, or a sliding layer's window), ``seq = P − 1 + stop``. Per query ``t``
    and unit, a key is shown where ``T_t ≥ Q`` (and the model's own mask shows it); keys and values
    of positions the ledger quantized before ``t`` are its dequantized ones."""

    def __init__(self, run: ForcedRun, steps: range, maps: np.ndarray, rows: np.ndarray | None, feeds: bool):
        sample = run.sample
        self.run, self.steps, self.maps = run, steps, maps  # maps [c, layer, unit, P + S]
        self.seq = sample.P - 1 + steps.stop
        self.spec = sample.model_spec
        self.rows = rows  # [c, layer, unit, P + S] the rows the queries see, where observed
        if rows is not None:
            rows.fill(0)
        self.want_feeds = feeds
        self.new_qkv: dict[int, tuple] = {}  # stored layer → (queries [head, c, D], keys, values [unit, c, D])

    def __call__(self, module, query, key, value, mask, scaling, softcap, sink):
        import torch

        from ..model import attention

        layer = self.spec.stored_layer(int(module.layer_idx))
        _b, h, c, _d = query.shape
        n_keys, kv = key.shape[1], key.shape[2]
        g = h // n_keys
        positions = self.run.slot_positions(layer, kv, self.seq)  # [1 | unit, kv]
        shown = self._shown(layer, positions, n_keys, mask, query.device)  # [keys, c, kv]
        q32 = attention.grouped(query[0].float(), n_keys)  # [keys, g·c, D]
        keys, values, switching = self._served(layer, key[0], value[0], g)
        logits = attention.logits(q32, keys.float(), scaling, softcap)  # [keys, g·c, kv]
        if switching is not None:  # slots a query before the ledger's step sees as computed, later dequantized
            cols, k_hat, v_hat, served = switching  # served [keys, g·c, m]
            hat = attention.logits(q32, k_hat.float(), scaling, softcap)
            logits[..., cols] = torch.where(served, hat, logits[..., cols])
        bias = _bias(mask, h, n_keys, c, kv)
        column = None if sink is None else attention.grouped_sinks(sink, n_keys, c).to(query.device)
        probs = attention.softmax(logits, _rows(shown, g), bias, sink=column)  # [keys, g·c, kv]
        weights = probs.to(values.dtype, copy=switching is not None)  # [keys, g·c, kv]
        if switching is None:
            out = torch.matmul(weights, values)
        else:
            w_cols = weights[..., cols]
            weights[..., cols] = w_cols.masked_fill(served, 0)
            out = torch.matmul(weights, values) + torch.matmul(w_cols.masked_fill(~served, 0), v_hat)
        if self.rows is not None:
            self._observe(layer, probs.view(n_keys, g, c, kv), positions)
        if self.want_feeds:
            self.new_qkv[layer] = (query[0].float().cpu(), key[0, :, -c:].float().cpu(), value[0, :, -c:].float().cpu())
        return out.view(n_keys * g, c, -1)[None].transpose(1, 2).contiguous()  # [1, c, head, Dv]

    def _shown(self, layer: int, positions: np.ndarray, n_keys: int, mask, device):
        """``[keys, c, kv]`` bool: the tier maps (each unit's keys), and the model's boolean mask."""
        import torch

        maps = self.maps[:, layer]  # [c, unit, P + S]
        last = self._last_slots(positions)
        if last is not None:
            at = maps[..., last]
        else:
            at = np.broadcast_to(positions, (maps.shape[1], positions.shape[-1]))  # [unit, kv]
            at = np.take_along_axis(maps, at[None].repeat(len(maps), 0), axis=2)
        held = torch.from_numpy(at >= TIER_Q).permute(1, 0, 2).to(device)  # [unit, c, kv]
        if n_keys != held.shape[0]:
            held = held.repeat_interleave(n_keys // held.shape[0], dim=0)
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            held = held & mask[0, :, -held.shape[1] :, -held.shape[2] :]
        return held

    def _served(self, layer: int, keys, values, g: int):
        """``(keys, values [keys, kv, D], switching)``: the K/V this chunk's queries see — the ledger's
        dequantized values at slots quantized before the chunk's first step — and, for slots the ledger
        quantizes within the chunk, ``(cols [m], k̂, v̂ [keys, m, D], served [keys, g·c, m])``; None
        where nothing is."""
        import torch

        quantized = self.run.quantized
        kv = keys.shape[1]
        got = None if quantized is None else quantized.served(layer, keys, values, self.seq - kv, self.steps)
        if got is None:
            return keys, values, None
        k_hat, v_hat, since = got  # since [keys, kv]
        always = (since <= self.steps.start).to(keys.device)[..., None]
        keys, values = torch.where(always, k_hat, keys), torch.where(always, v_hat, values)
        cols = torch.nonzero(((since > self.steps.start) & (since < self.steps.stop)).any(0))[:, 0]
        if not len(cols):
            return keys, values, None
        step = torch.arange(self.steps.start, self.steps.stop)
        served = since[:, None, cols] <= step[None, :, None]  # [keys, c, m]
        cols = cols.to(keys.device)
        return keys, values, (cols, k_hat[:, cols], v_hat[:, cols], _rows(served.to(keys.device), g))

    def _observe(self, layer: int, probs, positions: np.ndarray) -> None:
        """The kv-group rows ``[c, unit, kv]`` (mean over the query heads of each unit), by position."""
        n_keys, g, c, kv = probs.shape
        units = self.rows.shape[2]
        per_unit = probs.reshape(units, (n_keys * g) // units, c, kv).mean(1).permute(1, 0, 2).cpu().numpy()
        last = self._last_slots(positions)
        self.rows[:, layer][..., last if last is not None else positions[0]] = per_unit

    def _last_slots(self, positions: np.ndarray) -> slice | None:
        """The positions as a slice where they are the cache's last slots (``slot_positions`` without a
        press that rewrote the cache), else None."""
        return slice(int(positions[0, 0]), int(positions[0, -1]) + 1) if self.run.pressed is None else None

    def step_feeds(self) -> list | None:
        """Per step ``(keys, values [layer, unit, 1, D], queries [1, layer, head, D])`` of its new
        position (a press that reads each decode forward's tensors is fed these)."""
        if not self.want_feeds:
            return None
        import torch

        layers = range(len(self.new_qkv))
        out = []
        for i in range(len(self.steps)):
            keys = torch.stack([self.new_qkv[layer][1][:, i : i + 1] for layer in layers])
            values = torch.stack([self.new_qkv[layer][2][:, i : i + 1] for layer in layers])
            queries = torch.stack([self.new_qkv[layer][0][:, i] for layer in layers])[None].numpy()
            out.append((keys, values, queries))
        return out


def _rows(x, g: int):
    """``[keys, c, kv]`` → the grouped layout's rows ``[keys, g·c, kv]`` (each query head of a group
    shares its key head's)."""
    n_keys, c, kv = x.shape
    return x[:, None].expand(n_keys, g, c, kv).reshape(n_keys, g * c, kv)


def _bias(mask, h: int, n_keys: int, c: int, kv: int):
    """A float (additive) mask of transformers as ``[keys, g·c, kv]`` (per query head where it is
    per head: ALiBi), or None."""
    import torch

    if not isinstance(mask, torch.Tensor) or mask.dtype == torch.bool:
        return None
    block = mask[0, :, -c:, -kv:].float()  # [1 | head, c, kv]
    return block.expand(h, c, kv).reshape(n_keys, (h // n_keys) * c, kv)


# -- a replay's forced decodes ----------------------------------------------------------------


@dataclass
class ForcedOutputs:
    """Every run's forced decode: ``kl``, ``nll``, ``top1`` ``[*run, sample, step]`` (NaN past a
    sample's steps, and on the steps a question-agnostic trace does not score), ``rounds`` and
    ``converged`` ``[*run, sample]``, ``perplexity_full [sample]`` (the continuation under full KV),
    and per policy how its loop ran (``loops``: closed, one round, or open for the clairvoyant)."""

    kl: np.ndarray
    nll: np.ndarray
    top1: np.ndarray
    rounds: np.ndarray
    converged: np.ndarray
    perplexity_full: np.ndarray
    loops: dict
    settings: dict
    served: dict = field(default_factory=dict)

    @classmethod
    def allocate(cls, setup, settings: dict) -> ForcedOutputs:
        lead = (len(setup.policies), len(setup.allocations), len(setup.budgets), setup.n_samples)
        per_step = lead + (setup.n_step_total,)
        return cls(
            np.full(per_step, np.nan), np.full(per_step, np.nan), np.full(per_step, np.nan),
            np.zeros(lead, dtype=np.int64), np.ones(lead, dtype=bool), np.full(setup.n_samples, np.nan), {}, settings,
        )  # fmt: skip

    def absorb(self, result: TaskResult) -> None:
        """A task's runs into place (their scored steps: the rest stay NaN)."""
        s = result.sample
        for (pi, ai, bi), (kl, nll, top1, rounds, converged) in result.runs.items():
            at, steps = (pi, ai, bi, s), slice(result.first, result.first + len(kl))
            self.kl[at][steps], self.nll[at][steps], self.top1[at][steps] = kl, nll, top1
            self.rounds[at], self.converged[at] = rounds, converged
        self.perplexity_full[s] = result.perplexity_full
        self.loops.update(result.loops)
        self.served.update(result.served)


def loop_of(policy, state) -> str:
    """How a policy's forced decode runs: ``closed`` (its maps follow what its cache served),
    ``one round`` (they do not depend on the decode) or ``open`` (the clairvoyant oracle: its
    look-ahead is the recorded full-KV future)."""
    if policy.clairvoyant:
        return "open"
    return "closed" if policy.observes or reads_decodes(state) else "one round"


@dataclass(frozen=True)
class ForcedTask:
    """One sample's forced decodes under some policies (every allocation and budget of each):
    one prefill and one full-KV reference shared by its runs."""

    sample: int
    policies: tuple[int, ...]


@dataclass
class TaskResult:
    """What a task sends back: per run ``(policy, allocation, budget)`` its per-step figures, rounds
    and convergence; the sample's perplexity under full KV; each policy's loop."""

    sample: int
    first: int  # the first scored step (the runs' arrays start there)
    runs: dict  # (pi, ai, bi) → (kl, nll, top1 [scored step], rounds, converged)
    perplexity_full: float
    loops: dict  # policy label → loop
    served: dict = field(default_factory=dict)  # policy label → what the continuation saw, where not the masked cache


def run_task(setup, forced: ForcedModel, task: ForcedTask, splits: dict, chunk: int, max_rounds: int) -> TaskResult:
    """The forced decodes of ``task`` (module docstring); ``splits``: the oracle allocation's, by sample."""
    s = task.sample
    allocations = [a.for_sample(s) if a is not None else None for a in setup.allocations]
    prompt_attention = any(reads_prompt(setup.policies[pi], a) for pi in task.policies for a in allocations)
    presses = any(decoding_press(setup.policies[pi]) for pi in task.policies)
    sample = SampleForcing(setup, s, forced, chunk, max_rounds, prompt_attention, presses)
    runs = {
        (pi, ai, bi): ForcedRun(sample, setup.policies[pi], allocation, budget, splits.get(s, {}).get((pi, ai, bi)))
        for pi in task.policies
        for ai, allocation in enumerate(setup.allocations)
        for bi, budget in enumerate(setup.budgets)
    }
    loops = {run.policy.label(): loop_of(run.policy, run.state) for run in runs.values()}
    sample.start()
    scored = slice(sample.first_scored, sample.S)
    done, served = {}, {}
    for key, run in runs.items():
        run.run()
        done[key] = (run.kl[scored], run.nll[scored], run.top1[scored], run.rounds, run.converged)
        if run.pressed is not None:
            served[run.policy.label()] = "the press's own rewritten cache"
    return TaskResult(s, sample.first_scored, done, sample.perplexity_full(), loops, served)


def forced_tasks(setup, client) -> list[ForcedTask]:
    """One task per sample with steps (its runs share the prefill and the reference); on a cluster one
    per (sample, policy), so that the workers share the grid."""
    samples = [int(s) for s in np.flatnonzero(setup.ds.kvscope.n_steps > 0)]
    if client is None:
        return [ForcedTask(s, tuple(range(len(setup.policies)))) for s in samples]
    return [ForcedTask(s, (pi,)) for s in samples for pi in range(len(setup.policies))]


def forced_replay(setup, forced: ForcedModel, splits: dict, chunk: int, max_rounds: int, client=None,
                  progress=None) -> ForcedOutputs:  # fmt: skip
    """The forced decode of every run of ``setup`` on every sample with steps — in this process with
    the model ``forced`` loaded once, or as tasks on a dask ``client`` (each worker loads the trace's
    model once); ``splits``: the oracle allocation's per sample, as the replay chose them.
    ``progress(done, total)`` per task."""
    out = ForcedOutputs.allocate(setup, {"chunk": chunk, "max_rounds": max_rounds, "model": forced.label,
                                         "kv_itemsize": setup.kv_itemsize})  # fmt: skip
    tasks = forced_tasks(setup, client)
    if client is None:
        results = (run_task(setup, forced, task, splits, chunk, max_rounds) for task in tasks)
    else:
        results = _on_cluster(client, setup, tasks, splits, chunk, max_rounds, str(forced.device))
    for done, result in enumerate(results, 1):
        out.absorb(result)
        if progress is not None:
            progress(done, len(tasks))
    return out


def _on_cluster(client, setup, tasks, splits, chunk, max_rounds, device):
    """The tasks' results from the cluster's workers, as they finish."""
    from dataclasses import replace

    from distributed import as_completed

    state = replace(setup, ds=None)
    futures = [client.submit(_remote_task, state, setup.source, task, splits, chunk, max_rounds, device, pure=False)
               for task in tasks]  # fmt: skip
    for future in as_completed(futures):
        yield future.result()


@functools.lru_cache(maxsize=2)
def _worker_model(path: str, device: str) -> tuple:
    """A worker's trace and its model, opened and loaded once per process."""
    from ..storage.store import open_trace

    ds = open_trace(path)
    return ds, load_model(ds, device)


def _remote_task(setup, path: str, task: ForcedTask, splits, chunk, max_rounds, device) -> TaskResult:
    from dataclasses import replace

    ds, forced = _worker_model(path, device)
    return run_task(replace(setup, ds=ds), forced, task, splits, chunk, max_rounds)
