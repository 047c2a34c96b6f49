"""The decode loop of ``kvscope trace``: one batch of prompts, step by step, into blocks.

Step ``t`` is the forward whose query sits at ``prompt_len − 1 + t`` (step 0 = the last
prefill row); its sampled token is ``tokens[prompt_len + t]`` (docs/concepts.md#steps-and-rows). Greedy by default;
``temperature > 0`` samples with a seeded ``torch.Generator``. With ``--question-agnostic``
the prefill is the context only and the question's ``Q`` tokens are *forced*: step ``t < Q``
emits question token ``t`` (whatever the model predicts), so the question is decoded into the
cache position by position and generation starts at step ``Q``; end-of-sequence counts from
there, and a sample stops after ``Q + max_new_tokens`` steps. A given continuation's ``C``
tokens (``Prompt.continuation``, at most ``max_new_tokens``) are forced the same way after the
question: steps ``Q … Q + C − 1`` emit them, end-of-sequence never stops them, and the sample
stops after them. Rows are gathered per block of steps and handed to the background writer,
which commits the block once it is durable.

On ``--resume`` the committed steps are decoded again with capture off (a bit-identical
replay of the same operations) and their tokens checked against the stored ones; capture
resumes at the first uncommitted step.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..errors import StoreError
from ..model.spec import cache_keyword, last_logits_only, returned_cache
from ..storage.dtypes import stored
from ..storage.schema import Layout
from ..windows import window_sums
from .capture import AttentionRecorder, ForwardContext
from .staging import HostStaging
from .writer import Block


class BatchDecode:
    """Decode the samples ``batch`` of ``encoded`` into ``writer`` (one block at a time);
    ``questions``, ``continuations``: the tokens forced per sample (module docstring)."""

    def __init__(
        self, model, encoded, batch, layout: Layout, settings, writer, cache, eos: set[int], questions=None,
        continuations=None, staging=None, prefill_memo: PrefillMemo | None = None,
    ):  # fmt: skip
        self.model, self.batch, self.layout, self.settings, self.writer = model, batch, layout, settings, writer
        self.prompt_ids = [encoded[s] for s in batch]
        questions = [questions[s] if questions else [] for s in batch]
        given = [continuations[s] if continuations else None for s in batch]
        self.forced = [q + (c or []) for q, c in zip(questions, given)]  # forced tokens per sample, from step 0
        self.last_step = [
            len(q) + (len(c) if c is not None else settings.max_new_tokens) - 1 for q, c in zip(questions, given)
        ]
        self.lens = [len(ids) for ids in self.prompt_ids]
        self.eos = eos
        B, S = len(batch), layout.n_steps
        self.device = settings.device
        self.committed = min(writer.committed[s] for s in batch)
        self.stored_tokens = self._stored_tokens()
        self.recorder = AttentionRecorder(
            n_layers=layout.n_layers,
            n_stored_heads=layout.n_stored_heads,
            heads=settings.heads,
            obs_window=layout.obs_window,
            record_qkv=settings.record_qkv,
            attn_output=settings.attn_output,
            n_units=layout.n_kv_heads,
            layer_slots={layer: i for i, layer in enumerate(layout.layer_index)} if layout.layer_index else None,
        )
        self.cache = cache
        self.last_only = last_logits_only(model)  # the prompt's logits at every position: never read
        self.cache_keyword = cache_keyword(model)
        self.records = CacheRecords(layout) if layout.policy_events else None
        self.dtype = np.float16 if settings.dtype == "float16" else np.float32
        self.n_steps = np.full(B, S, dtype=np.int64)  # final number of steps per sample
        self.finished = np.zeros(B, dtype=bool)
        self.generated = np.full((B, S), -1, dtype=np.int64)  # [sample, step] sampled tokens
        self.prefill: Block | None = None  # the prompt's writes, until the first block of steps takes them
        self.buffers = BlockBuffers(layout, B, self.dtype, staging or HostStaging(settings.device))
        self.generator = torch.Generator(device="cpu").manual_seed(settings.seed + batch[0])
        # a prompt alone in its batch, decoded from the start into the model's own cache: its prefill
        # is the one of the last such prompt with the same tokens (a context's questions)
        shared = prefill_memo is not None and cache is None and B == 1 and self.committed == 0
        self.prefill_memo = prefill_memo if shared else None
        self._inputs()

    def _stored_tokens(self):
        if self.committed == 0:
            return None
        import zarr

        group = zarr.open_group(str(self.writer.path), mode="r")
        return group["tokens"][self.batch[0] : self.batch[-1] + 1]

    def _inputs(self) -> None:
        """Left-padded input ids, attention mask and position ids of the prompts."""
        B, p_max = len(self.batch), max(self.lens)
        input_ids = torch.zeros((B, p_max), dtype=torch.long)
        mask = torch.zeros((B, p_max), dtype=torch.long)
        for i, ids in enumerate(self.prompt_ids):
            input_ids[i, p_max - len(ids) :] = torch.tensor(ids)
            mask[i, p_max - len(ids) :] = 1
        self.pad = torch.tensor([p_max - n for n in self.lens], dtype=torch.long)
        self.padded = bool((self.pad > 0).any())
        self.input_ids, self.mask = input_ids.to(self.device), mask.to(self.device)
        self.position_ids = (self.mask.cumsum(-1) - 1).masked_fill(self.mask == 0, 1)
        self.p_max = p_max

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """Next token of every sample from ``logits [B, vocab]``."""
        if self.settings.temperature > 0:  # shifted first: a tiny temperature must not overflow to inf − inf
            shifted = logits.float() - logits.float().max(dim=-1, keepdim=True).values
            probs = torch.softmax(shifted / self.settings.temperature, dim=-1).cpu()
            return torch.multinomial(probs, 1, generator=self.generator)[:, 0]
        return logits.float().argmax(-1).cpu()

    def run(self, progress) -> None:
        with torch.no_grad(), self.recorder.active():
            next_input, seq_len = self.input_ids, self.p_max
            for t in range(self.layout.n_steps):
                token = self.forward(t, next_input, seq_len)
                live = self.record(t, token)
                if t >= self.committed:
                    progress(live)
                if self.finished.all():
                    break
                next_input = token.to(self.device)[:, None]
                if self.padded:
                    self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
                seq_len += 1

    def forward(self, t: int, next_input, seq_len: int) -> torch.Tensor:
        """One forward; returns the sampled tokens ``[B]`` (checked against the store while resuming)."""
        self.recorder.enabled = t >= self.committed
        self.recorder.begin(ForwardContext(seq_len=seq_len, pad=self.pad))
        memo = self.prefill_memo if t == 0 else None
        kept = memo.take(self.prompt_ids[0], self.recorder) if memo is not None else None
        if kept is not None:
            self.cache, logits = kept
        else:
            self.cache, logits = self._model_forward(t, next_input)
            if memo is not None:
                memo.keep(self.prompt_ids[0], self.recorder, cache=self.cache, logits=logits)
        if self.records is not None:
            self.cache.end_step()
            self.records.add_step(t, self.cache)
        token = self.sample(logits)
        for i, forced in enumerate(self.forced):
            if t < len(forced):
                token[i] = forced[t]
        if self.stored_tokens is not None and t < self.committed:
            self._check_replayed(t, token)
        return token

    def _model_forward(self, t: int, next_input) -> tuple:
        """The model's forward of step ``t``, recorded; returns ``(cache, logits [B, vocab])``."""
        weights = self.layout.from_weights and self.recorder.enabled  # the model's own probabilities
        out = self.model(
            input_ids=next_input,
            attention_mask=self.mask if self.padded else None,  # all ones: let transformers skip the mask
            position_ids=self.position_ids if t == 0 else (self.position_ids[:, -1:] + t),
            use_cache=True,
            **{self.cache_keyword: self.cache},
            **({"output_attentions": True} if weights else {}),
            **self.last_only,
        )
        if weights:
            for layer, probs in enumerate(out.attentions):
                if probs is not None:
                    self.recorder.observe_weights(self.recorder.slot_of(layer), probs)
        return returned_cache(out), out.logits[:, -1]

    def _check_replayed(self, t: int, token: torch.Tensor) -> None:
        for i, s in enumerate(self.batch):
            expected = self.stored_tokens[i, self.lens[i] + t]
            if not self.finished[i] and expected >= 0 and int(token[i]) != int(expected):
                raise StoreError(
                    f"--resume: replay produced token {int(token[i])} at step {t} of sample {s}, "
                    f"the store has {int(expected)}; the model or environment differs"
                )

    def record(self, t: int, token: torch.Tensor) -> int:
        """Keep step ``t``'s rows and token, hand a finished block to the writer; returns the
        number of samples that were still decoding."""
        live = ~self.finished
        self.generated[live, t] = token.numpy()[live]
        capturing = t >= self.committed
        if capturing:
            self.buffers.add_step(t, self.recorder, live, self.lens)
            if t == 0:
                self.prefill = prefill_writes(
                    self.batch, self.recorder, self.layout, lens=self.lens, pad=self.pad, dtype=self.dtype
                )
        for i in range(len(self.batch)):
            generated = t >= len(self.forced[i])
            if live[i] and ((generated and int(token[i]) in self.eos) or t >= self.last_step[i]):
                self.finished[i] = True
                self.n_steps[i] = t + 1
        S = self.layout.n_steps
        end_of_block = (t + 1) % self.layout.block_steps == 0 or t == S - 1 or self.finished.all()
        if end_of_block and capturing:
            block = self.buffers.block(
                self.batch,
                t + 1,
                prompt_ids=self.prompt_ids,
                generated=self.generated,
                n_steps=self.n_steps,
                finished=self.finished,
            )
            if self.prefill is not None:  # the prompt's arrays go ahead of the first block's rows
                block.writes[:0], self.prefill = self.prefill.writes, None
            if self.records is not None:
                self.records.flush_into(block, self.batch[0])
            self.writer.submit(block)
            self.buffers.reset()
        return int(live.sum())


class PrefillMemo:
    """The last prefill of a prompt decoded alone: its cache, its last logits and what the recorder
    kept of it (the forward's rows, by reference: the next forward records into new ones), handed
    to the next batch with the same prompt tokens instead of a forward of its own — a context's
    questions (question-agnostic) are prefilled once. One prompt's is kept at a time, and only where
    the next batch to decode (``wanted``: its prompt, alone in it) has the same tokens."""

    def __init__(self):
        self.ids: list[int] | None = None
        self.kept: tuple | None = None  # (cache, logits, recorder's layers, recorder's rows)
        self.wanted: list[int] | None = None

    def keep(self, ids: list[int], recorder: AttentionRecorder, *, cache, logits) -> None:
        import copy

        self.ids, self.kept = None, None
        if self.wanted == ids:
            self.ids, self.kept = ids, (copy.deepcopy(cache), logits.clone(), recorder.layers, recorder.rows)

    def take(self, ids: list[int], recorder: AttentionRecorder) -> tuple | None:
        """``(cache, logits)`` of the kept prefill where it is the prefill of ``ids`` (its cache a copy),
        the recorder given what it recorded; None otherwise."""
        import copy

        if self.kept is None or self.ids != ids:
            return None
        cache, logits, recorder.layers, recorder.rows = self.kept
        return copy.deepcopy(cache), logits


def decode_all(
    model, encoded, batches, layout: Layout, settings, writer, cache_factory, eos: set[int], progress, questions=None,
    continuations=None, staging: HostStaging | None = None,
) -> None:  # fmt: skip
    """Every unfinished batch of ``batches`` (lists of consecutive sample indices of ``encoded``:
    ``kvscope.tracing.shard.batches``), in turn; ``progress(steps_done, steps_total, tokens,
    seconds)``; ``questions``: the tokens forced as each sample's first steps (--question-agnostic);
    ``continuations``: the tokens forced after them (given continuations; None: generated);
    ``staging``: the host buffers the rows are copied into (one for the trace's device where None).
    Consecutive prompts with the same tokens, each alone in its batch, share one prefill (``PrefillMemo``)."""
    staging = staging or HostStaging(settings.device)
    prefill_memo = PrefillMemo()
    todo = [s for batch in batches for s in batch if not writer.done[s]]
    steps_total = sum(layout.n_steps - writer.committed[s] for s in todo)
    counter = {"done": 0, "tokens": 0, "t0": time.perf_counter()}

    def step_done(live_tokens: int) -> None:
        counter["done"] += 1
        counter["tokens"] += live_tokens
        if progress is not None:
            progress(counter["done"], steps_total, counter["tokens"], time.perf_counter() - counter["t0"])

    pending = [batch for batch in batches if not all(writer.done[s] for s in batch)]
    for batch, following in zip(pending, [*pending[1:], None]):
        prefill_memo.wanted = encoded[following[0]] if following is not None and len(following) == 1 else None
        cache = cache_factory(model, layout, batch)
        decoder = BatchDecode(
            model, encoded, batch, layout=layout, settings=settings, writer=writer, cache=cache, eos=eos,
            questions=questions, continuations=continuations, staging=staging, prefill_memo=prefill_memo,
        )  # fmt: skip
        decoder.run(step_done)
    writer.flush()


def prefill_writes(batch, recorder, layout: Layout, lens, pad, dtype) -> Block:
    """Prefill column sums, tail rows (and q/k/v of the prompt) as writes, to go ahead of the
    first block of steps in the same block (durable before any step is committed). The tail
    rows are made on the device as stored (NaN beyond each row's query), so that only they
    leave it."""
    L, T, obs = layout.n_layers, layout.n_pos, layout.obs_window
    caps = [recorder.layers[layer] for layer in range(L)]
    colsum = torch.stack([c.colsum for c in caps], 1).cpu().numpy()  # [B, layer, Hs, p_max]
    if layout.learned_sinks:  # the shares from the float32 rows
        shares = 1 - torch.stack([c.tail.sum(-1) for c in caps], 1).clamp_(max=1).cpu().numpy()  # [B, layer, Hs, obs]
    block = Block()
    for i, s in enumerate(batch):
        P = lens[i]
        cs = np.full((1, L, colsum.shape[2], T), np.nan, dtype=np.float32)
        cs[0, :, :, :P] = colsum[i, :, :, :P]
        qpos = np.arange(P - obs, P, dtype=np.int32)
        block.writes.append(("prefill_colsum", (slice(s, s + 1),), cs))
        tails = [c.tail[i] for c in caps]  # [Hs, obs, p_max] float32 per layer, on the device
        block.writes.append(("prefill_tail", (slice(s, s + 1),), _stored_tail(tails, P, T, dtype)[None]))
        block.writes.append(("prefill_tail_qpos", (slice(s, s + 1),), np.where(qpos >= 0, qpos, -1)[None]))
        if layout.learned_sinks:
            _sink_shares(block, s, P, colsum=colsum[i], tail_shares=shares[i])
        if layout.record_qkv:
            p0 = int(pad[i])
            q = stored(torch.stack([c.q[i, :, p0:] for c in caps], 0).permute(2, 0, 1, 3), dtype)  # [P, L, H, D]
            k = stored(torch.stack([c.k[i, :, p0:] for c in caps], 0), dtype)  # [L, Hkv, P, D]
            v = stored(torch.stack([c.v[i, :, p0:] for c in caps], 0), dtype)
            region = (slice(s, s + 1), slice(None), slice(None), slice(0, P))
            block.writes.append(("q", (slice(s, s + 1), slice(0, P)), q[None]))
            block.writes.append(("k", region, k[None]))
            block.writes.append(("v", region, v[None]))
    return block


def _stored_tail(tails: list[torch.Tensor], P: int, n_pos: int, dtype) -> np.ndarray:
    """A prompt's tail rows, ``tails[layer] [Hs, obs, ≥ P]`` (float32, by position), as stored:
    ``[layer, Hs, obs, n_pos]`` in ``dtype``, row ``o`` (query ``P − obs + o``) NaN beyond its
    query and all NaN where that query is before the prompt; made on the device layer by layer
    (no float32 copy of every layer's rows at once)."""
    Hs, obs, device = tails[0].shape[0], tails[0].shape[1], tails[0].device
    out = torch.empty((len(tails), Hs, obs, n_pos), dtype=_torch_dtype(dtype), device=device)
    for layer, tail in enumerate(tails):
        out[layer, ..., :P] = tail[..., :P]
    out[..., P:] = float("nan")
    qpos = torch.arange(P - obs, P, device=device)
    out[..., :P].masked_fill_(torch.arange(P, device=device)[None, :] > qpos[:, None], float("nan"))  # [obs, P]
    return out.cpu().numpy()


def _torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of the storage ``dtype`` (float16 or float32)."""
    return torch.float16 if np.dtype(dtype) == np.float16 else torch.float32


def _sink_shares(block, s: int, P: int, colsum: np.ndarray, tail_shares: np.ndarray) -> None:
    """A model with learned sinks: the sink's share of the prompt's rows summed over them, beside
    the column sums (``P − Σ colsum``, from ``colsum [layer, Hs, pos]`` in float32), and of each
    tail row (``tail_shares [layer, Hs, obs]``: ``1 − Σ row``, NaN where the tail row is none)."""
    total = np.clip(P - colsum[:, :, :P].astype(np.float64).sum(-1), 0, P).astype(np.float32)  # [layer, Hs]
    share = np.clip(tail_shares, 0, 1).astype(np.float32)  # NaN stays NaN
    block.writes.append(("prefill_learned_sink", (slice(s, s + 1),), total[None]))
    block.writes.append(("prefill_tail_learned_sink", (slice(s, s + 1),), share[None]))


class BlockBuffers:
    """One block of steps for a batch, at the stored resolution, gathered in host buffers.

    Each step's rows are made on the device as they are stored — a full ``n_pos`` row per layer
    and head, in the storage dtype, NaN beyond the query and for a finished sample — and copied
    into the block's buffers by ``kvscope.tracing.staging.HostStaging`` (on CUDA: pinned,
    asynchronous on a side stream), which the host waits for only when the block is handed to
    the writer (``block``). Window sums are taken then, on the host, from the rows as
    computed (float32; ``kvscope.windows.window_sums``, the one definition)."""

    def __init__(self, layout: Layout, B: int, dtype, staging: HostStaging):
        self.layout = layout
        self.B = B
        self.dtype = dtype
        self.staging = staging
        self.row_dtype = _torch_dtype(dtype) if layout.resolution == "token" else torch.float32
        self.reset()

    def reset(self) -> None:
        blk = self.layout.block_steps
        self.t0 = self.first_j = None  # the block's first step, and the first one captured in it
        self.host: dict[str, torch.Tensor] = {}  # name → [step, B, ...] host buffer of this block
        self.qpos = np.full((blk, self.B), -1, dtype=np.int64)  # [step, B] query of each captured row, −1: none
        self.qkv_pos = np.full((blk, self.B), -1, dtype=np.int64)  # [step, B] position of recorded q/k/v, −1: none

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if name not in self.host:
            self.host[name] = self.staging.buffer((self.layout.block_steps, self.B, *shape), dtype)
        return self.host[name]

    def add_step(self, t, recorder, live, lens) -> None:
        L = self.layout
        if self.t0 is None:
            self.t0 = t - t % L.block_steps
            self.first_j = t - self.t0
        j = t - self.t0
        qpos = [lens[i] - 1 + t if live[i] else -1 for i in range(self.B)]
        self.qpos[j] = qpos
        rows = recorder.rows  # [B, layer, Hs, seq] float32, on the device
        shape = (L.n_layers, L.n_stored_heads, L.n_pos)
        self.staging.copy(
            self._buffer("rows", shape, self.row_dtype)[j], _stored_rows(rows, qpos, L.n_pos, self.row_dtype)
        )
        if L.learned_sinks:  # the learned sink's share: 1 − Σ row, from the float32 row
            shares = (1 - rows.sum(-1)).clamp_(0, 1)  # [B, layer, Hs]
            for i in np.flatnonzero(~np.asarray(live)):
                shares[i] = float("nan")
            self.staging.copy(self._buffer("learned", shares.shape[1:], torch.float32)[j], shares)
        if L.record_qkv and t > 0:  # step 0's q/k/v are the prompt's last position (prefill_writes)
            caps = [recorder.layers[layer] for layer in range(L.n_layers)]
            for name in ("q", "k", "v"):
                x = torch.stack([getattr(c, name)[:, :, -1] for c in caps], 1)  # [B, layer, H or Hkv, D]
                x = x.to(_torch_dtype(self.dtype))
                self.staging.copy(self._buffer(name, x.shape[1:], x.dtype)[j], x)
            self.qkv_pos[j] = qpos

    def block(self, batch, t_end, prompt_ids, generated, n_steps, finished) -> Block:
        """The block's writes from its first captured step (a resumed trace may begin mid-block)
        to ``t_end``, once the copies into its buffers have landed; the buffers go back to the
        pool when the writer is done with them."""
        L = self.layout
        self.staging.wait()
        buffers = list(self.host.values())
        blk = Block(release=lambda: self.staging.give_back(buffers))
        j0, j1 = self.first_j, t_end - self.t0
        host = {name: np.swapaxes(x.numpy()[j0:j1], 0, 1) for name, x in self.host.items()}  # [B, step, ...]
        sl, steps = slice(batch[0], batch[-1] + 1), slice(self.t0 + j0, t_end)
        if L.resolution == "token":
            blk.writes.append(("attn", (sl, steps), host["rows"]))
        else:
            attn, sink = self._window_rows(host["rows"], self.qpos[j0:j1])
            blk.writes.append(("attn", (sl, steps), attn))
            blk.writes.append(("attn_sink", (sl, steps), sink))
        if L.learned_sinks:
            blk.writes.append(("attn_learned_sink", (sl, steps), host["learned"]))
        if L.record_qkv:
            self._qkv_writes(blk, batch, host, self.qkv_pos[j0:j1])
        self._token_writes(
            blk, batch, t_end, prompt_ids=prompt_ids, generated=generated, n_steps=n_steps, finished=finished
        )
        return blk

    def _window_rows(self, rows: np.ndarray, qpos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``rows [B, step, layer, Hs, n_pos]`` (float32) with the query of each ``qpos [step,
        B]`` (−1: none) → window sums ``[B, step, layer, Hs, window]`` and sink rows ``[B, step,
        layer, Hs, n_sink]`` in the storage dtype."""
        L = self.layout
        shape = (self.B, len(qpos), L.n_layers, L.n_stored_heads)
        attn = np.full((*shape, L.n_windows), np.nan, dtype=self.dtype)
        sink = np.full((*shape, L.n_sink), np.nan, dtype=self.dtype)
        for j, i in zip(*np.nonzero(qpos >= 0)):
            row = rows[i, j, :, :, : qpos[j, i] + 1]  # [layer, Hs, qpos+1]
            m = min(L.n_sink, row.shape[-1])
            sink[i, j, :, :, :m] = row[:, :, :m]
            attn[i, j] = window_sums(row, L.n_sink, L.window, L.n_windows)
        return attn, sink

    def _qkv_writes(self, blk: Block, batch, host: dict, qkv_pos: np.ndarray) -> None:
        """q/k/v of the block (``qkv_pos [step, B]``: the position of each, −1: none): one region
        per sample (each chunk written once)."""
        for i, s in enumerate(batch):
            js = np.flatnonzero(qkv_pos[:, i] >= 0)
            if not len(js):
                continue
            pos = qkv_pos[js, i]
            if np.any(np.diff(pos) != 1):
                raise RuntimeError("q/k/v of a block must cover consecutive positions")
            q = host["q"][i, js]  # [n, L, H, D]
            k = np.moveaxis(host["k"][i, js], 0, 2)  # [L, Hkv, n, D]
            v = np.moveaxis(host["v"][i, js], 0, 2)
            p0, p1 = int(pos[0]), int(pos[-1]) + 1
            blk.writes.append(("q", (slice(s, s + 1), slice(p0, p1)), q[None]))
            region = (slice(s, s + 1), slice(None), slice(None), slice(p0, p1))
            blk.writes.append(("k", region, k[None]))
            blk.writes.append(("v", region, v[None]))

    def _token_writes(self, blk: Block, batch, t_end, prompt_ids, generated, n_steps, finished) -> None:
        """Tokens, coordinates and the commit of the block."""
        L, S = self.layout, self.layout.n_steps
        B = len(batch)
        tokens = np.full((B, L.n_pos), -1, dtype=np.int32)
        query_pos = np.full((B, S), -1, dtype=np.int32)
        token_id = np.full((B, S), -1, dtype=np.int32)
        counts = []
        for i in range(B):
            P = len(prompt_ids[i])
            valid = int(min(t_end, n_steps[i]))
            counts.append(valid)
            tokens[i, :P] = prompt_ids[i]
            gen = generated[i, :valid]
            tokens[i, P : P + valid] = gen
            query_pos[i, :valid] = P - 1 + np.arange(valid)
            token_id[i, :valid] = gen
        sl = slice(batch[0], batch[-1] + 1)
        blk.writes.append(("tokens", (sl,), tokens))
        blk.writes.append(("query_pos", (sl,), query_pos))
        blk.writes.append(("token_id", (sl,), token_id))
        blk.writes.append(("n_steps", (sl,), np.asarray(counts, dtype=np.int32)))
        for i, s in enumerate(batch):
            blk.commit[s] = counts[i]
            blk.done[s] = bool(finished[i] or t_end >= S)


def _stored_rows(rows: torch.Tensor, qpos: list[int], n_pos: int, dtype: torch.dtype) -> torch.Tensor:
    """``rows [B, layer, Hs, seq]`` as stored: ``[B, layer, Hs, n_pos]`` in ``dtype``, NaN beyond
    each sample's query ``qpos[i]`` (−1: a finished sample, all NaN); made on the rows' device."""
    seq = rows.shape[-1]
    out = torch.empty((*rows.shape[:-1], n_pos), dtype=dtype, device=rows.device)
    out[..., :seq] = rows
    out[..., seq:] = float("nan")
    for i, q in enumerate(qpos):
        if q < seq - 1:  # a left-padded sample's positions end before the batch's slots, a finished one's at once
            out[i, ..., q + 1 :] = float("nan")
    return out


class CacheRecords:
    """Tier snapshots and bytes of a recording cache (a live policy cache), written with each
    block. The cache reports ``bytes_model``/``bytes_actual`` per step and ``tier_events``."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.every = layout.window
        self.events: dict[int, np.ndarray] = {}  # event → tiers [layer, kv_head, pos]
        self.bytes: dict[int, tuple[float, int]] = {}  # step → (byte model, actual): docs/concepts.md#budget

    def add_step(self, t: int, cache) -> None:
        self.bytes[t] = (cache.bytes_model[-1], cache.bytes_actual[-1])
        if t in cache.tier_events:
            tiers = cache.tier_events.pop(t)
            out = np.full(tiers.shape[:2] + (self.layout.n_pos,), -1, dtype=np.int8)
            n = min(tiers.shape[-1], self.layout.n_pos)
            out[..., :n] = tiers[..., :n]
            self.events[t // self.every] = out

    def flush_into(self, block: Block, s: int) -> None:
        for e, tiers in self.events.items():  # one chunk per event
            block.writes.append(("policy_tiers", (slice(s, s + 1), slice(e, e + 1)), tiers[None, None]))
        if self.bytes:  # the block's steps are consecutive: one region per array
            steps = sorted(self.bytes)
            region = (slice(s, s + 1), slice(steps[0], steps[-1] + 1))
            block.writes.append(("policy_bytes", region, np.array([[self.bytes[t][0] for t in steps]])))
            block.writes.append(("policy_cache_bytes", region, np.array([[self.bytes[t][1] for t in steps]])))
        self.events, self.bytes = {}, {}
