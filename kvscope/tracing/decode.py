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
from .writer import Block


class BatchDecode:
    """Decode the samples ``batch`` of ``encoded`` into ``writer`` (one block at a time);
    ``questions``, ``continuations``: the tokens forced per sample (module docstring)."""

    def __init__(
        self, model, encoded, batch, layout: Layout, settings, writer, cache, eos: set[int], questions=None,
        continuations=None,
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
        self.buffers = BlockBuffers(layout, B, self.dtype)
        self.generator = torch.Generator(device="cpu").manual_seed(settings.seed + batch[0])
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
        self.cache = returned_cache(out)
        if self.records is not None:
            self.cache.end_step()
            self.records.add_step(t, self.cache)
        token = self.sample(out.logits[:, -1])
        for i, forced in enumerate(self.forced):
            if t < len(forced):
                token[i] = forced[t]
        if self.stored_tokens is not None and t < self.committed:
            self._check_replayed(t, token)
        return token

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
                write_prefill(self.writer, self.batch, self.recorder, self.layout, self.lens, self.pad, self.dtype)
        for i in range(len(self.batch)):
            generated = t >= len(self.forced[i])
            if live[i] and ((generated and int(token[i]) in self.eos) or t >= self.last_step[i]):
                self.finished[i] = True
                self.n_steps[i] = t + 1
        S = self.layout.n_steps
        end_of_block = (t + 1) % self.layout.block_steps == 0 or t == S - 1 or self.finished.all()
        if end_of_block and capturing:
            block = self.buffers.block(self.batch, t + 1, self.prompt_ids, self.generated, self.n_steps, self.finished)
            if self.records is not None:
                self.records.flush_into(block, self.batch[0])
            self.writer.submit(block)
            self.buffers.reset()
        return int(live.sum())


def decode_all(
    model, encoded, batches, layout: Layout, settings, writer, cache_factory, eos: set[int], progress, questions=None,
    continuations=None,
) -> None:  # fmt: skip
    """Every unfinished batch of ``batches`` (lists of consecutive sample indices of ``encoded``:
    ``kvscope.tracing.shard.batches``), in turn; ``progress(steps_done, steps_total, tokens,
    seconds)``; ``questions``: the tokens forced as each sample's first steps (--question-agnostic);
    ``continuations``: the tokens forced after them (given continuations; None: generated)."""
    todo = [s for batch in batches for s in batch if not writer.done[s]]
    steps_total = sum(layout.n_steps - writer.committed[s] for s in todo)
    counter = {"done": 0, "tokens": 0, "t0": time.perf_counter()}

    def step_done(live_tokens: int) -> None:
        counter["done"] += 1
        counter["tokens"] += live_tokens
        if progress is not None:
            progress(counter["done"], steps_total, counter["tokens"], time.perf_counter() - counter["t0"])

    for batch in batches:
        if all(writer.done[s] for s in batch):
            continue
        cache = cache_factory(model, layout, batch)
        decoder = BatchDecode(model, encoded, batch, layout, settings, writer, cache, eos, questions, continuations)
        decoder.run(step_done)
    writer.flush()


def write_prefill(writer, batch, recorder, layout: Layout, lens, pad, dtype) -> None:
    """Prefill column sums, tail rows (and q/k/v of the prompt), handed to the writer ahead
    of the first block of steps (the queue keeps order, so they are durable before any
    step is committed)."""
    L, T, obs = layout.n_layers, layout.n_pos, layout.obs_window
    caps = [recorder.layers[layer] for layer in range(L)]
    colsum = torch.stack([c.colsum for c in caps], 1).cpu().numpy()  # [B, layer, Hs, p_max]
    tail = stored(torch.stack([c.tail for c in caps], 1), dtype)  # [B, layer, Hs, obs, p_max]
    if layout.learned_sinks:  # the shares from the float32 rows
        shares = 1 - torch.stack([c.tail for c in caps], 1).float().sum(-1).clamp_(max=1).cpu().numpy()
    block = Block()
    for i, s in enumerate(batch):
        P = lens[i]
        cs = np.full((1, L, colsum.shape[2], T), np.nan, dtype=np.float32)
        cs[0, :, :, :P] = colsum[i, :, :, :P]
        tl = np.full((1, L, tail.shape[2], obs, T), np.nan, dtype=dtype)
        qpos = np.arange(P - obs, P, dtype=np.int32)
        for o in range(obs):
            if qpos[o] >= 0:
                tl[0, :, :, o, : qpos[o] + 1] = tail[i, :, :, o, : qpos[o] + 1]
        block.writes.append(("prefill_colsum", (slice(s, s + 1),), cs))
        block.writes.append(("prefill_tail", (slice(s, s + 1),), tl))
        block.writes.append(("prefill_tail_qpos", (slice(s, s + 1),), np.where(qpos >= 0, qpos, -1)[None]))
        if layout.learned_sinks:
            _sink_shares(block, s, P, colsum[i], shares[i])
        if layout.record_qkv:
            p0 = int(pad[i])
            q = stored(torch.stack([c.q[i, :, p0:] for c in caps], 0).permute(2, 0, 1, 3), dtype)  # [P, L, H, D]
            k = stored(torch.stack([c.k[i, :, p0:] for c in caps], 0), dtype)  # [L, Hkv, P, D]
            v = stored(torch.stack([c.v[i, :, p0:] for c in caps], 0), dtype)
            region = (slice(s, s + 1), slice(None), slice(None), slice(0, P))
            block.writes.append(("q", (slice(s, s + 1), slice(0, P)), q[None]))
            block.writes.append(("k", region, k[None]))
            block.writes.append(("v", region, v[None]))
    writer.submit(block)


def _sink_shares(block, s: int, P: int, colsum: np.ndarray, tail_shares: np.ndarray) -> None:
    """A model with learned sinks: the sink's share of the prompt's rows summed over them, beside
    the column sums (``P − Σ colsum``, from ``colsum [layer, Hs, pos]`` in float32), and of each
    tail row (``tail_shares [layer, Hs, obs]``: ``1 − Σ row``, NaN where the tail row is none)."""
    total = np.clip(P - colsum[:, :, :P].astype(np.float64).sum(-1), 0, P).astype(np.float32)  # [layer, Hs]
    share = np.clip(tail_shares, 0, 1).astype(np.float32)  # NaN stays NaN
    block.writes.append(("prefill_learned_sink", (slice(s, s + 1),), total[None]))
    block.writes.append(("prefill_tail_learned_sink", (slice(s, s + 1),), share[None]))


class BlockBuffers:
    """One block of steps for a batch, at the stored resolution."""

    def __init__(self, layout: Layout, B: int, dtype):
        self.layout = layout
        self.B = B
        self.dtype = dtype
        self.reset()

    def reset(self) -> None:
        L = self.layout
        blk, Hs = L.block_steps, L.n_stored_heads
        last = L.n_windows if L.resolution == "window" else L.n_pos
        self.t0 = None
        self.attn = np.full(
            (self.B, blk, L.n_layers, Hs, last), np.nan, dtype=self.dtype
        )  # [B, step, L, Hs, pos|window]
        self.sink = np.full((self.B, blk, L.n_layers, Hs, L.n_sink), np.nan, dtype=self.dtype)
        self.learned = np.full((self.B, blk, L.n_layers, Hs), np.nan, dtype=np.float32) if L.learned_sinks else None
        self.qkv: list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]] = []  # (i, pos, q, k, v)

    def add_step(self, t, recorder, live, lens) -> None:
        L = self.layout
        if self.t0 is None:
            self.t0 = t - t % L.block_steps
        j = t - self.t0
        # [B, layer, Hs, seq]; window sums are taken in float32, from the rows as computed
        rows = stored(recorder.rows, self.dtype) if L.resolution == "token" else recorder.rows.cpu().numpy()
        if self.learned is not None:  # the learned sink's share: 1 − Σ row, from the float32 row
            shares = (1 - recorder.rows.sum(-1)).clamp_(0, 1).cpu().numpy()  # [B, layer, Hs]
        for i in range(self.B):
            if not live[i]:
                continue
            qpos = lens[i] - 1 + t
            row = rows[i, :, :, : qpos + 1]  # [layer, Hs, qpos+1]
            if self.learned is not None:
                self.learned[i, j] = shares[i]
            if L.resolution == "token":
                self.attn[i, j, :, :, : qpos + 1] = row
            else:
                n = min(L.n_sink, row.shape[-1])
                self.sink[i, j, :, :, :n] = row[:, :, :n]
                self.attn[i, j] = window_sums(row, L.n_sink, L.window, L.n_windows)
            if L.record_qkv and t > 0:
                caps = [recorder.layers[layer] for layer in range(L.n_layers)]
                q = stored(torch.stack([c.q[i, :, -1] for c in caps], 0), self.dtype)  # [L, H, D]
                k = stored(torch.stack([c.k[i, :, -1] for c in caps], 0), self.dtype)  # [L, Hkv, D]
                v = stored(torch.stack([c.v[i, :, -1] for c in caps], 0), self.dtype)
                self.qkv.append((i, qpos, q, k, v))

    def block(self, batch, t_end, prompt_ids, generated, n_steps, finished) -> Block:
        L = self.layout
        blk = Block()
        t0 = self.t0 if self.t0 is not None else t_end - 1
        n = t_end - t0
        sl = slice(batch[0], batch[-1] + 1)
        blk.writes.append(("attn", (sl, slice(t0, t_end)), self.attn[:, :n]))
        if L.resolution == "window":
            blk.writes.append(("attn_sink", (sl, slice(t0, t_end)), self.sink[:, :n]))
        if self.learned is not None:
            blk.writes.append(("attn_learned_sink", (sl, slice(t0, t_end)), self.learned[:, :n]))
        self._qkv_writes(blk, batch)
        self._token_writes(blk, batch, t_end, prompt_ids, generated, n_steps, finished)
        return blk

    def _qkv_writes(self, blk: Block, batch) -> None:
        """q/k/v of the block: one region per sample (each chunk written once)."""
        by_sample: dict[int, list] = {}
        for i, qpos, q, k, v in self.qkv:
            by_sample.setdefault(i, []).append((qpos, q, k, v))
        for i, items in by_sample.items():
            s = batch[i]
            items.sort(key=lambda item: item[0])
            p0, p1 = items[0][0], items[-1][0] + 1
            if p1 - p0 != len(items):
                raise RuntimeError("q/k/v of a block must cover consecutive positions")
            q = np.stack([item[1] for item in items])  # [n, L, H, D]
            k = np.stack([item[2] for item in items], axis=2)  # [L, Hkv, n, D]
            v = np.stack([item[3] for item in items], axis=2)
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
